//! What every benchmark shares, written once: the flags all of them take
//! ([`CommonArgs`]), the run itself ([`Benchmark`] and [`run`]: root, the
//! machine, prepare, measure, report, the BENCHMARKS.md section and the
//! exit code), the report's fixed parts ([`Report`], [`Table`]), failures
//! counted without ending the run ([`Failures`], [`guarded`]), and small
//! helpers of the measurements.

use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

pub use tether_e2e::machine::{loadavg, stdout_of, Machine};
use tether_e2e::{target_dir, workspace_dir, CniOutput};

/// The flags every benchmark takes besides its own.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CommonArgs {
    /// Use the release binaries as they are (`TETHER_BIN_DIR`, or
    /// target/release) instead of building them first.
    #[arg(long)]
    pub no_build: bool,
    /// Write the report into this file's section for the benchmark
    /// (BENCHMARKS.md), replacing the one there.
    #[arg(long, value_name = "FILE")]
    pub write: Option<PathBuf>,
}

impl CommonArgs {
    /// Whether to build the release binaries first.
    pub fn build(&self) -> bool {
        !self.no_build
    }
}

/// A benchmark: what `tether-bench <NAME>` runs. [`run`] calls its steps
/// in order, and does the rest the same way for every benchmark.
pub trait Benchmark {
    /// Its subcommand, and its prefix in the progress log.
    const NAME: &'static str;
    /// Its section's id in BENCHMARKS.md: the section lies between
    /// `<!-- ID:begin ... -->` and `<!-- ID:end -->`.
    const SECTION: &'static str;
    /// What [`Benchmark::prepare`] gives [`Benchmark::measure`]: mostly
    /// where the binaries are.
    type Ready;
    /// What [`Benchmark::measure`] found.
    type Measured;

    /// The flags all benchmarks take.
    fn common(&self) -> &CommonArgs;

    /// The section this run writes: [`Benchmark::SECTION`], unless its
    /// flags make it another kind of run that has a section of its own.
    fn section(&self) -> &'static str {
        Self::SECTION
    }

    /// Builds or finds what the run needs (release binaries, images). An
    /// error ends the run before anything is measured.
    fn prepare(&self) -> Result<Self::Ready, String>;

    /// The measurements. What goes wrong is counted in `failures` and the
    /// run goes on; a phase run through [`guarded`] may even panic.
    fn measure(&self, ready: &Self::Ready, failures: &mut Failures) -> Self::Measured;

    /// The report, in Markdown: [`Report`] gives its fixed parts.
    fn report(&self, run: &Run, ready: &Self::Ready, measured: &Self::Measured) -> String;
}

/// What a report is given besides the measurements.
pub struct Run {
    /// The benchmark's name.
    pub bench: &'static str,
    /// The machine, probed when the run started.
    pub machine: Machine,
    /// The arguments after the benchmark's name, as given.
    pub command_line: String,
    /// How long the run took, up to the report.
    pub runtime: Duration,
    /// What went wrong.
    pub failures: Failures,
}

impl Run {
    /// The command that made the report, as one can type it again.
    pub fn command(&self) -> String {
        let line = format!("tether-bench {} {}", self.bench, self.command_line);
        line.trim_end().to_owned()
    }
}

/// Runs `bench`, whose flags came after `tether-bench NAME` as
/// `command_line`: root is required, the machine is probed and logged,
/// then prepare, measure and report; the report is printed and written
/// into its section of `--write`'s file. A failure to prepare or to
/// write, or any failure counted, makes the exit code a failure.
pub fn run<B: Benchmark>(bench: &B, command_line: String) -> ExitCode {
    tether_e2e::require_root();
    let started = Instant::now();
    let machine = Machine::probe();
    eprintln!(
        "{}: run prefix {}; {}",
        B::NAME,
        tether_e2e::run_prefix(),
        machine.one_line()
    );
    let ready = match bench.prepare() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{}: {e}", B::NAME);
            return ExitCode::FAILURE;
        }
    };
    let mut failures = Failures::new(B::NAME);
    let measured = bench.measure(&ready, &mut failures);
    let run = Run {
        bench: B::NAME,
        machine,
        command_line,
        runtime: started.elapsed(),
        failures,
    };
    let report = bench.report(&run, &ready, &measured);
    println!("{report}");
    if let Some(path) = &bench.common().write {
        let writer = format!("tether-bench {}", B::NAME);
        match write_section(path, bench.section(), &writer, &report) {
            Ok(()) => eprintln!("{}: wrote {}", B::NAME, path.display()),
            Err(e) => {
                eprintln!("{}: cannot write {}: {e}", B::NAME, path.display());
                return ExitCode::FAILURE;
            }
        }
    }
    eprintln!(
        "{}: done in {:.1} s, {} failure(s)",
        B::NAME,
        started.elapsed().as_secs_f64(),
        run.failures.count
    );
    if run.failures.count > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// A report in the making, with the parts every report has.
pub struct Report {
    text: String,
}

impl Report {
    /// Its title (with the benchmark's name and the run's date) and the
    /// machine's line.
    pub fn new(title: &str, run: &Run) -> Report {
        Report {
            text: format!(
                "## {title} (tether-bench {}): latest run: {}\n\n{}\n",
                run.bench,
                run.machine.date,
                run.machine.report_line()
            ),
        }
    }

    /// A line of the list under the title.
    pub fn item(&mut self, line: impl AsRef<str>) -> &mut Report {
        let _ = writeln!(self.text, "- {}", line.as_ref());
        self
    }

    /// The command line, how long it ran and how many failures, as one
    /// item, then `more` in the same sentence when not empty.
    pub fn command(&mut self, run: &Run, more: &str) -> &mut Report {
        let sep = if more.is_empty() { "" } else { "; " };
        self.item(format!(
            "Command: `{}`; ran {:.0} s; {} failure(s){sep}{more}.",
            run.command(),
            run.runtime.as_secs_f64(),
            run.failures.count
        ))
    }

    /// A paragraph, after a blank line.
    pub fn paragraph(&mut self, text: impl AsRef<str>) -> &mut Report {
        let _ = write!(self.text, "\n{}\n", text.as_ref().trim_end());
        self
    }

    /// A table, after a blank line.
    pub fn table(&mut self, table: &Table) -> &mut Report {
        let _ = write!(self.text, "\n{}", table.markdown());
        self
    }

    /// Text as it is.
    pub fn raw(&mut self, text: impl AsRef<str>) -> &mut Report {
        self.text.push_str(text.as_ref());
        self
    }

    /// The failures kept, one item each, and the report's text.
    pub fn finish(mut self, run: &Run) -> String {
        if !run.failures.problems.is_empty() {
            self.text.push('\n');
            // One line each: a CNI call's output runs to many.
            for f in &run.failures.problems {
                let _ = writeln!(
                    self.text,
                    "- Failure: {}",
                    first_lines(f, 4).replace('\n', " / ")
                );
            }
            if run.failures.count > run.failures.problems.len() {
                let _ = writeln!(
                    self.text,
                    "- ... and {} more failure(s).",
                    run.failures.count - run.failures.problems.len()
                );
            }
        }
        self.text
    }
}

/// A Markdown table: a header and rows of cells.
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    /// The right-aligned columns (figures).
    right: Vec<usize>,
}

impl Table {
    /// A table with these column headers.
    pub fn new<S: AsRef<str>>(header: &[S]) -> Table {
        Table {
            header: header.iter().map(|s| s.as_ref().to_owned()).collect(),
            rows: Vec::new(),
            right: Vec::new(),
        }
    }

    /// Right-aligns the columns from `column` (0-based) on: the figures
    /// after the row's name.
    pub fn right_aligned_from(self, column: usize) -> Table {
        let all: Vec<usize> = (column..self.header.len()).collect();
        self.right_aligned(&all)
    }

    /// Right-aligns these columns (0-based).
    pub fn right_aligned(mut self, columns: &[usize]) -> Table {
        self.right.extend_from_slice(columns);
        self
    }

    /// Adds a row; missing cells are shown as "-", extra ones dropped.
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Table {
        let mut row: Vec<String> = cells.into_iter().map(Into::into).collect();
        row.resize(self.header.len(), "-".to_owned());
        self.rows.push(row);
        self
    }

    /// Whether it has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table in Markdown, ending with a newline.
    pub fn markdown(&self) -> String {
        let line = |cells: &[String]| format!("| {} |\n", cells.join(" | "));
        let mut out = line(&self.header);
        out.push('|');
        for i in 0..self.header.len() {
            let right = self.right.contains(&i);
            out.push_str(if right { "---:|" } else { "---|" });
        }
        out.push('\n');
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

/// What went wrong in a run, counted, with the first few kept for the
/// report.
#[derive(Debug)]
pub struct Failures {
    /// The benchmark's name, for its log lines.
    pub bench: &'static str,
    /// How many failures.
    pub count: usize,
    /// The first 12 of them.
    pub problems: Vec<String>,
}

impl Failures {
    /// None yet.
    pub fn new(bench: &'static str) -> Failures {
        Failures {
            bench,
            count: 0,
            problems: Vec::new(),
        }
    }

    /// Counts a failure, logs it, and keeps it if there is room.
    pub fn fail(&mut self, what: String) {
        self.count += 1;
        eprintln!("{}: FAILED: {what}", self.bench);
        if self.problems.len() < 12 {
            self.problems.push(what);
        }
    }
}

/// Runs one phase of a benchmark; a panic in it is counted as a failure
/// (and the other phases still run).
pub fn guarded<T>(
    phase: &str,
    failures: &mut Failures,
    f: impl FnOnce(&mut Failures) -> T,
) -> Option<T> {
    match std::panic::catch_unwind(AssertUnwindSafe(|| f(&mut *failures))) {
        Ok(v) => Some(v),
        Err(p) => {
            let text = panic_text(&p);
            failures.fail(format!(
                "{phase} phase aborted: {}",
                first_lines(&text, 6).replace('\n', " / ")
            ));
            None
        }
    }
}

/// The first `n` lines of `s`.
pub fn first_lines(s: &str, n: usize) -> String {
    s.lines().take(n).collect::<Vec<_>>().join("\n")
}

/// A caught panic's message.
pub fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "panic".to_owned())
}

/// Builds the release shim and daemon, one package per build as `make
/// release` does: built together, the shim would pick up the daemon's
/// features through feature unification. `who` prefixes the progress log.
pub fn build_release(who: &str) -> Result<(), String> {
    for package in ["tether-cni-shim", "tether-node-server"] {
        cargo_build_release(who, &["-p", package])?;
    }
    Ok(())
}

/// `cargo build --release` with `args`, in the workspace, logged as `who`.
pub fn cargo_build_release(who: &str, args: &[&str]) -> Result<(), String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let line = format!("cargo build --release {}", args.join(" "));
    eprintln!("{who}: {line}");
    let status = Command::new(&cargo)
        .args(["build", "--release"])
        .args(args)
        .current_dir(workspace_dir())
        .status()
        .map_err(|e| format!("running cargo: {e}"))?;
    if !status.success() {
        return Err(format!("{line} failed ({status})"));
    }
    Ok(())
}

/// The directory of the `tether` and `tetherd` a benchmark runs:
/// `TETHER_BIN_DIR` if set, else the release build (built first if
/// `build`). `TETHER_BIN_DIR` is set to it, so that the harness takes the
/// plugin from there too; call this before starting any thread.
pub fn release_dir(bench: &str, build: bool) -> Result<PathBuf, String> {
    let dir = match std::env::var_os("TETHER_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            if build {
                build_release(bench)?;
            }
            let dir = target_dir().join("release");
            std::env::set_var("TETHER_BIN_DIR", &dir);
            dir
        }
    };
    for bin in ["tether", "tetherd"] {
        if !dir.join(bin).exists() {
            return Err(format!("{} does not exist", dir.join(bin).display()));
        }
    }
    Ok(dir)
}

/// Whether a plugin call did its job: success, and for ADD an address in
/// the result. The error says what was wrong, for the report.
pub fn judge(command: &str, out: &CniOutput) -> Result<(), String> {
    if !out.success() {
        return Err(format!("{out}"));
    }
    if command == "ADD" {
        let has_ip = out
            .json
            .as_ref()
            .and_then(|j| j["ips"][0]["address"].as_str())
            .is_some();
        if !has_ip {
            return Err(format!("no address in the result: {out}"));
        }
    }
    Ok(())
}

/// Reads until `done` or the deadline, every 50 ms; the last value read.
pub fn poll_until<T>(
    deadline: Instant,
    mut read: impl FnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    loop {
        let value = read();
        if done(&value) || Instant::now() >= deadline {
            return value;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// [`poll_until`] for something cheap to read (files): every 5 ms.
pub fn poll_until_fast(deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The `q` quantile (0 to 1) of `v`, the element whose rank is the
/// ceiling of `q * n` (the textbook nearest rank); `None` if empty.
pub fn nearest_rank<T: Copy + Ord>(v: &[T], q: f64) -> Option<T> {
    if v.is_empty() {
        return None;
    }
    let mut v = v.to_vec();
    v.sort();
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// [`nearest_rank`] of floats (ordered by `total_cmp`).
pub fn nearest_rank_f64(v: &[f64], q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// The `q` quantile (0 to 1) of `v`, the element at `q * (n - 1)`
/// rounded; `None` if empty. (What kubelet, ipam and nodes have always
/// reported; the others use [`nearest_rank`].)
pub fn percentile<T: Copy + Ord>(v: &[T], q: f64) -> Option<T> {
    let mut v = v.to_vec();
    v.sort();
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(i).copied()
}

/// Replaces section `id` of `path` (from the line that starts with
/// `<!-- ID:begin` to `<!-- ID:end -->`) with `report`, or appends one;
/// the rest of the file is left as it is. The begin line says which
/// `command` writes it (`tether-bench NAME`; the section's own command
/// line, with its flags, is in the report). Written to a temporary file
/// and renamed into place.
pub fn write_section(path: &Path, id: &str, command: &str, report: &str) -> std::io::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::from("# Benchmarks\n"),
        Err(e) => return Err(e),
    };
    let begin = format!("<!-- {id}:begin");
    let end = format!("<!-- {id}:end -->");
    let section = format!(
        "{begin} (generated by `{command} --write`; edits inside are lost) -->\n{}\n{end}",
        report.trim_end()
    );
    let new = match (old.find(&begin), old.find(&end)) {
        (Some(a), Some(b)) if a < b => format!("{}{section}{}", &old[..a], &old[b + end.len()..]),
        _ => format!("{}\n\n{section}\n", old.trim_end()),
    };
    let tmp = path.with_extension("md.tmp");
    std::fs::write(&tmp, new)?;
    std::fs::rename(&tmp, path)
}

/// What tetherd logs when it claims an address block: `<RFC 3339 UTC>
/// INFO ...: claimed an address block block=<cidr> took_ms=<f64>`.
pub const CLAIM_LINE: &str = "claimed an address block";

/// One block claim, read from a tetherd log line.
#[derive(Debug, Clone)]
pub struct BlockClaim {
    /// When it was logged, µs since the epoch (UTC).
    pub at_us: i64,
    /// The block claimed.
    pub block: ipnet::IpNet,
    /// The daemon's own measure of the claim.
    pub took_ms: f64,
}

/// The block claim a tetherd log line (colours or not) reports, if it
/// reports one.
pub fn parse_claim_line(line: &str) -> Option<BlockClaim> {
    let line = strip_ansi(line);
    if !line.contains(CLAIM_LINE) {
        return None;
    }
    let mut tokens = line.split_whitespace();
    let at_us = parse_utc_micros(tokens.next()?)?;
    let (mut block, mut took_ms) = (None, None);
    for t in tokens {
        if let Some(v) = t.strip_prefix("block=") {
            block = v.parse::<ipnet::IpNet>().ok();
        } else if let Some(v) = t.strip_prefix("took_ms=") {
            took_ms = v.parse::<f64>().ok();
        }
    }
    Some(BlockClaim {
        at_us,
        block: block?,
        took_ms: took_ms?,
    })
}

/// Removes ANSI colour sequences (`ESC [ ... m`), in case a log has them.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Microseconds since the Unix epoch of `YYYY-MM-DDTHH:MM:SS[.fraction][Z]`
/// read as UTC (the caller makes sure it is UTC).
pub fn parse_utc_micros(s: &str) -> Option<i64> {
    let s = s.strip_suffix('Z').unwrap_or(s);
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (h, m, sec) = (t.next()??, t.next()??, t.next()??);
    if !frac.bytes().all(|b| b.is_ascii_digit())
        || !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
    {
        return None;
    }
    let micros: i64 = format!("{frac:0<6}")[..6].parse().ok()?;
    let days = days_from_civil(year, month, day);
    Some(((days * 24 + h) * 60 + m) * 60_000_000 + sec * 1_000_000 + micros)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// algorithm).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_is_replaced_in_place_and_others_are_kept() {
        let dir = tether_e2e::TempDir::new("bk");
        let path = dir.path().join("B.md");
        std::fs::write(&path, "# B\n\nintro\n").unwrap_or_else(|e| panic!("{e}"));
        write_section(&path, "a", "tether-bench a", "one").unwrap_or_else(|e| panic!("{e}"));
        write_section(&path, "b", "tether-bench b", "two").unwrap_or_else(|e| panic!("{e}"));
        write_section(&path, "a", "tether-bench a2", "three").unwrap_or_else(|e| panic!("{e}"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            text,
            "# B\n\nintro\n\n\
             <!-- a:begin (generated by `tether-bench a2 --write`; edits inside are lost) -->\nthree\n<!-- a:end -->\n\n\
             <!-- b:begin (generated by `tether-bench b --write`; edits inside are lost) -->\ntwo\n<!-- b:end -->\n"
        );
    }

    #[test]
    fn a_section_written_by_an_older_command_is_found_by_its_id() {
        let dir = tether_e2e::TempDir::new("bk");
        let path = dir.path().join("B.md");
        std::fs::write(
            &path,
            "# B\n\n<!-- bench-ipam:begin (generated by `bench_ipam --write`; edits inside are lost) -->\nold\n<!-- bench-ipam:end -->\n\nafter\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        write_section(&path, "bench-ipam", "tether-bench ipam", "new")
            .unwrap_or_else(|e| panic!("{e}"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            text,
            "# B\n\n<!-- bench-ipam:begin (generated by `tether-bench ipam --write`; edits inside are lost) -->\nnew\n<!-- bench-ipam:end -->\n\nafter\n"
        );
    }

    #[test]
    fn a_table_fills_missing_cells_and_renders_as_markdown() {
        let mut t = Table::new(&["CNI", "p50 ms", "max ms"]);
        t.row(["tether", "1.2", "3.4"]).row(["ptp"]);
        assert_eq!(
            t.markdown(),
            "| CNI | p50 ms | max ms |\n|---|---|---|\n| tether | 1.2 | 3.4 |\n| ptp | - | - |\n"
        );
        let t = Table::new(&["CNI", "p50 ms", "max ms"]).right_aligned_from(1);
        assert!(
            t.markdown().ends_with("|---|---:|---:|\n"),
            "{}",
            t.markdown()
        );
        let t = Table::new(&["n", "CNI", "ms"]).right_aligned(&[0, 2]);
        assert!(
            t.markdown().ends_with("|---:|---|---:|\n"),
            "{}",
            t.markdown()
        );
    }

    #[test]
    fn the_two_quantiles_differ_only_in_their_rank() {
        let v = [4, 1, 3, 2];
        assert_eq!(nearest_rank(&v, 0.5), Some(2));
        assert_eq!(percentile(&v, 0.5), Some(3));
        assert_eq!(nearest_rank(&v, 0.99), Some(4));
        assert_eq!(nearest_rank_f64(&[2.5, 0.5, 1.5], 0.5), Some(1.5));
        assert_eq!(nearest_rank::<u8>(&[], 0.5), None);
    }

    #[test]
    fn claim_lines_parse() {
        let line = "2026-11-21T18:25:31.158628Z  INFO tetherd::cluster: claimed an address block \
                    block=10.244.0.4/30 took_ms=3.25";
        let c = parse_claim_line(line).unwrap();
        assert_eq!(c.at_us, 1_795_285_531_158_628);
        assert_eq!(c.block, "10.244.0.4/30".parse::<ipnet::IpNet>().unwrap());
        assert_eq!(c.took_ms, 3.25);
        let colored = "\u{1b}[2m2026-11-21T18:25:31.158628Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m \
                       claimed an address block block=fd00:10:244::4/126 took_ms=1";
        assert!(parse_claim_line(colored).is_some());
        assert!(parse_claim_line("2026-11-21T18:25:31Z INFO something else").is_none());
    }

    #[test]
    fn dates_in_utc_read_to_the_microsecond() {
        assert_eq!(parse_utc_micros("1970-01-01T00:00:01.5Z"), Some(1_500_000));
        assert_eq!(days_from_civil(2026, 11, 29), 20_786);
        assert_eq!(parse_utc_micros("2026-13-01T00:00:00Z"), None);
    }
}
