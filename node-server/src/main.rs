//! `tetherd`, tether's node daemon: parses its flags, starts its logs and
//! its runtime, and runs [`tetherd::daemon::run`], where everything else
//! is (the flags and their checks in [`tetherd::daemon::options`]).

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tetherd::daemon::options::{colour, LogFormat, Options};
use tetherd::daemon::{self, Fatal, Seams};

fn main() -> ExitCode {
    let opts = Options::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&opts.log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    match opts.log_format {
        LogFormat::Text => {
            let no_color = std::env::var_os("NO_COLOR");
            logs.with_ansi(colour(std::io::stderr().is_terminal(), no_color.as_deref()))
                .init()
        }
        LogFormat::Json => logs.json().init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tetherd")
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(daemon::run(opts, Seams::default())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fatal(message)) => {
            tracing::error!("{message}");
            ExitCode::FAILURE
        }
    }
}
