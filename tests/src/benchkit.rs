//! What the benchmarks (`src/bin/bench.rs`, `bench_cluster.rs`,
//! `bench_migration.rs`) share: the command line's common flags and the
//! end of `main` ([`parse_command_line`], [`finish`]), the machine's
//! description, building the release binaries, counting failures, and
//! writing a generated section of BENCHMARKS.md.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{target_dir, workspace_dir, CniOutput};

/// What the machine is, for the record.
pub struct Machine {
    /// CPUs available to this process.
    pub nproc: usize,
    /// The kernel release.
    pub kernel: String,
    /// The CPU model.
    pub cpu: String,
    /// When the run started, `YYYY-MM-DD HH:MM UTC`.
    pub date: String,
    /// tether's version and git revision, marked when the tree has
    /// uncommitted changes (BENCHMARKS.md itself aside).
    pub tether_version: String,
    /// The load average before the run.
    pub load_before: String,
}

impl Machine {
    /// Reads the machine now.
    pub fn probe() -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_owned())
            .unwrap_or_else(|| "unknown".to_owned());
        let ws = workspace_dir().display().to_string();
        let rev = stdout_of("git", &["-C", &ws, "rev-parse", "--short", "HEAD"]);
        // The report file itself is rewritten by every run: not a change to
        // what was measured.
        let status = [
            "-C",
            &ws,
            "status",
            "--porcelain",
            "--",
            ".",
            ":!BENCHMARKS.md",
        ];
        let dirty = !stdout_of("git", &status).is_empty();
        Machine {
            nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            cpu,
            date: stdout_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            tether_version: format!(
                "{} (git {rev}{})",
                env!("CARGO_PKG_VERSION"),
                if dirty { ", uncommitted changes" } else { "" }
            ),
            load_before: loadavg(),
        }
    }

    /// The report's machine line; the load is read again now, for "after".
    pub fn report_line(&self) -> String {
        format!(
            "- Machine: {} CPUs ({}), kernel {}, load average {} before and {} after.",
            self.nproc,
            self.cpu,
            self.kernel,
            self.load_before,
            loadavg()
        )
    }

    /// CPUs, model, kernel and load on one line, for the progress log.
    pub fn one_line(&self) -> String {
        format!(
            "{} × {}, kernel {}, load {}",
            self.nproc, self.cpu, self.kernel, self.load_before
        )
    }
}

/// The head of a benchmark's report: its title with the run's date, and
/// the machine's line.
pub fn report_head(title: &str, machine: &Machine) -> String {
    format!(
        "## {title}: latest run: {}\n\n{}\n",
        machine.date,
        machine.report_line()
    )
}

/// The trimmed stdout of a command that succeeded, else "unknown" (for
/// version strings in a report).
pub fn stdout_of(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The 1, 5 and 15 minute load averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
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

/// Replaces the section of `path` between the markers `begin` and `end`
/// with `report`, or appends one; the rest of the file is left as it is.
/// Written to a temporary file and renamed into place.
pub fn write_section(path: &Path, begin: &str, end: &str, report: &str) -> std::io::Result<()> {
    let old = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::from("# Benchmarks\n"),
        Err(e) => return Err(e),
    };
    let section = format!("{begin}\n{}\n{end}", report.trim_end());
    let new = match (old.find(begin), old.find(end)) {
        (Some(a), Some(b)) if a < b => format!("{}{section}{}", &old[..a], &old[b + end.len()..]),
        _ => format!("{}\n\n{section}\n", old.trim_end()),
    };
    let tmp = path.with_extension("md.tmp");
    std::fs::write(&tmp, new)?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_is_replaced_in_place_and_others_are_kept() {
        let dir = crate::TempDir::new("bk");
        let path = dir.path().join("B.md");
        std::fs::write(&path, "# B\n\nintro\n").unwrap_or_else(|e| panic!("{e}"));
        write_section(&path, "<!-- a:begin -->", "<!-- a:end -->", "one")
            .unwrap_or_else(|e| panic!("{e}"));
        write_section(&path, "<!-- b:begin -->", "<!-- b:end -->", "two")
            .unwrap_or_else(|e| panic!("{e}"));
        write_section(&path, "<!-- a:begin -->", "<!-- a:end -->", "three")
            .unwrap_or_else(|e| panic!("{e}"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            text,
            "# B\n\nintro\n\n<!-- a:begin -->\nthree\n<!-- a:end -->\n\n<!-- b:begin -->\ntwo\n<!-- b:end -->\n"
        );
    }
}

/// What went wrong in a benchmark run, counted, with the first few kept for
/// the report.
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

/// What every benchmark's `main` starts with.
pub struct Start<A> {
    /// Its parsed command line.
    pub args: A,
    /// When it started.
    pub started: Instant,
    /// The machine it runs on.
    pub machine: Machine,
    /// Its failures, none yet.
    pub failures: Failures,
}

/// The start of benchmark `bench`: its command line parsed by `parse` (a
/// bad one is printed and exits 2), root required, the clock started and
/// the machine probed and named on stderr with the run's prefix.
pub fn start<A>(
    bench: &'static str,
    parse: impl FnOnce() -> Result<A, String>,
) -> Result<Start<A>, std::process::ExitCode> {
    let args = parse().map_err(|e| {
        eprintln!("{e}");
        std::process::ExitCode::from(2)
    })?;
    crate::require_root();
    let started = Instant::now();
    let machine = Machine::probe();
    eprintln!(
        "{bench}: run prefix {}; {}",
        crate::run_prefix(),
        machine.one_line()
    );
    Ok(Start {
        args,
        started,
        machine,
        failures: Failures::new(bench),
    })
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

/// The `q` quantile (0 to 1) of `v` by nearest rank; `None` if empty.
pub fn percentile<T: Copy + Ord>(v: &[T], q: f64) -> Option<T> {
    let mut v = v.to_vec();
    v.sort();
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v.get(i).copied()
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

/// The flags every benchmark takes besides its own. The default is what no
/// flag says: build, write nothing.
#[derive(Debug, Clone)]
pub struct CommonArgs {
    /// Build the release binaries first (`--no-build` clears it).
    pub build: bool,
    /// The file to write the report's section into (`--write FILE`).
    pub write: Option<PathBuf>,
    /// The arguments as given, for the report.
    pub command_line: String,
}

impl Default for CommonArgs {
    fn default() -> Self {
        CommonArgs {
            build: true,
            write: None,
            command_line: String::new(),
        }
    }
}

/// One flag's value, taken from the command line when the flag asks for it.
pub struct FlagValue<'a> {
    flag: &'a str,
    rest: &'a mut dyn Iterator<Item = String>,
}

impl FlagValue<'_> {
    /// The next argument, which the flag needs.
    pub fn text(&mut self) -> Result<String, String> {
        self.rest
            .next()
            .ok_or_else(|| format!("{} needs a value", self.flag))
    }

    /// The next argument as a count.
    pub fn number(&mut self) -> Result<usize, String> {
        let text = self.text()?;
        number(self.flag, &text)
    }
}

/// `text` as a count, or an error naming `flag`.
pub fn number(flag: &str, text: &str) -> Result<usize, String> {
    text.parse::<usize>().map_err(|e| format!("{flag}: {e}"))
}

/// Reads the command line `args` (without the program name): `--no-build`,
/// `--write FILE` and `-h`/`--help` here, every other flag through `own`,
/// which answers `Ok(false)` for a flag it does not know. `--help` and
/// errors come back as `Err` with `usage` appended.
pub fn parse_command_line(
    args: impl IntoIterator<Item = String>,
    usage: &str,
    mut own: impl FnMut(&str, &mut FlagValue<'_>) -> Result<bool, String>,
) -> Result<CommonArgs, String> {
    let args: Vec<String> = args.into_iter().collect();
    let mut common = CommonArgs {
        command_line: args.join(" "),
        ..CommonArgs::default()
    };
    let mut rest = args.into_iter();
    while let Some(flag) = rest.next() {
        let mut value = FlagValue {
            flag: &flag,
            rest: &mut rest,
        };
        match flag.as_str() {
            "--no-build" => common.build = false,
            "--write" => common.write = Some(PathBuf::from(value.text()?)),
            "-h" | "--help" => return Err(usage.to_owned()),
            _ => {
                if !own(&flag, &mut value)? {
                    return Err(format!("unknown argument {flag:?}\n{usage}"));
                }
            }
        }
    }
    Ok(common)
}

/// The end of every benchmark: prints `report`, writes it between `begin`
/// and `end` in the `--write` file, logs the run's length, and gives the
/// exit code, a failure when writing failed or `failures` is not zero.
pub fn finish(
    bench: &str,
    common: &CommonArgs,
    (begin, end): (&str, &str),
    report: &str,
    failures: usize,
    runtime: Duration,
) -> std::process::ExitCode {
    println!("{report}");
    if let Some(path) = &common.write {
        match write_section(path, begin, end, report) {
            Ok(()) => eprintln!("{bench}: wrote {}", path.display()),
            Err(e) => {
                eprintln!("{bench}: cannot write {}: {e}", path.display());
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    eprintln!(
        "{bench}: done in {:.1} s, {failures} failure(s)",
        runtime.as_secs_f64()
    );
    if failures > 0 {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod command_line_tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<(CommonArgs, usize, Vec<String>), String> {
        let mut cycles = 7;
        let mut list = Vec::new();
        let common =
            parse_command_line(args.iter().map(|s| s.to_string()), "usage: x", |flag, v| {
                match flag {
                    "--cycles" => cycles = v.number()?,
                    "--list" => list = v.text()?.split(',').map(str::to_owned).collect(),
                    _ => return Ok(false),
                }
                Ok(true)
            })?;
        Ok((common, cycles, list))
    }

    #[test]
    fn common_and_own_flags() {
        let (common, cycles, list) = parse(&[
            "--cycles",
            "20",
            "--no-build",
            "--write",
            "B.md",
            "--list",
            "a,b",
        ])
        .unwrap();
        assert!(!common.build);
        assert_eq!(common.write, Some(PathBuf::from("B.md")));
        assert_eq!(
            common.command_line,
            "--cycles 20 --no-build --write B.md --list a,b"
        );
        assert_eq!((cycles, list), (20, vec!["a".to_owned(), "b".to_owned()]));

        let (common, cycles, _) = parse(&[]).unwrap();
        assert!(common.build && common.write.is_none());
        assert_eq!(cycles, 7);
    }

    #[test]
    fn errors_name_the_flag() {
        assert_eq!(parse(&["--help"]).unwrap_err(), "usage: x");
        assert!(parse(&["--frob"])
            .unwrap_err()
            .starts_with("unknown argument \"--frob\""));
        assert_eq!(parse(&["--write"]).unwrap_err(), "--write needs a value");
        assert!(parse(&["--cycles", "x"])
            .unwrap_err()
            .starts_with("--cycles: "));
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
