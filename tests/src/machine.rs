//! The machine a benchmark or a conformance run ran on, for its report:
//! CPUs, model, kernel, load, date and tether's version.

use std::process::Command;

use crate::workspace_dir;

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
