//! Helpers that the suites of more than one area use.

use std::path::Path;

use tether_e2e::{Daemon, DaemonOpts, Netns};

/// The code spans (`` `...` ``) of a Markdown table cell, in order.
pub(crate) fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// tetherd in `ns`, taking its pod CIDRs from its Node object
/// (`--pod-cidr-from-node`) read with `kubeconfig`, and `extra` args.
pub(crate) fn node_cidr_daemon(ns: Netns, kubeconfig: &Path, extra: &[&str]) -> Daemon {
    let mut args = vec![
        "--pod-cidr-from-node".to_owned(),
        "--kubeconfig".to_owned(),
        kubeconfig.display().to_string(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    Daemon::start_in(
        ns,
        DaemonOpts {
            extra_args: args,
            ..DaemonOpts::default()
        },
    )
}
