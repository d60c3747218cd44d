//! `tether-bench`: tether's benchmarks, one command line. Each subcommand
//! is one [`kit::Benchmark`]: it prepares (release binaries, images),
//! measures tether side by side with the reference plugins or its own
//! alternatives in one run, and reports in Markdown, which `--write
//! BENCHMARKS.md` puts into the benchmark's own section of that file.
//!
//! Run as root: `cargo run --release -p tether-bench -- <benchmark>
//! [flags]`; `make bench` runs them all. `tether-bench <benchmark> --help`
//! lists a benchmark's flags.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod kit;

mod cluster;
mod cni;
mod ipam;
mod kubelet;
mod kubevirt;
mod migration;
mod nodes;
mod policy;
mod scale;
mod vm;

#[derive(Parser)]
#[command(
    name = "tether-bench",
    version,
    about = "tether's benchmarks, side by side with the reference plugins, reported into BENCHMARKS.md (run as root)"
)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// ADD and DEL latency, concurrent ADDs and DELs, and ADD with pods on
    /// the node: tether against Debian's ptp and bridge with host-local,
    /// and the floor (one ADD's kernel work alone).
    Cni(cni::Args),
    /// tether as the IPAM of macvlan against host-local and whereabouts,
    /// on one node and on a cluster.
    Ipam(ipam::Args),
    /// Cluster mode (3 nodes on etcd) against one node: ADD and DEL
    /// latency, address-block claims, claim to route.
    Cluster(cluster::Args),
    /// A KubeVirt VM pod's live-migration cutover on 3 nodes, scripted as
    /// KubeVirt and QEMU do it: how long the VM is unreachable, how fast
    /// every node's route follows.
    Migration(migration::Args),
    /// Real QEMU guests: live migrations, the VM's connections through
    /// them, and tap ADD.
    Vm(vm::Args),
    /// Pod-ready latency through a real kubelet, tether (its chart's
    /// DaemonSet) against ptp with host-local.
    Kubelet(kubelet::Args),
    /// 10, 30 and 100 tetherd nodes on each control store: claim to
    /// route, simultaneous migrations, the store's load, start-up.
    Scale(scale::Args),
    /// Pod to pod across two nodes (iperf3 and sockperf over host-gw and
    /// VXLAN beside a bare veth), and pod-ready latency on two kubelet
    /// nodes.
    Nodes(nodes::Args),
    /// KubeVirt's own live migrations over tether, beside `vm`'s QEMU
    /// migrations.
    Kubevirt(kubevirt::Args),
    /// NetworkPolicy: creation to enforcement with 1, 100 and 1,000
    /// policies and 5,000 pod addresses, and ADD latency with it on
    /// against off.
    Policy(policy::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // What followed the benchmark's name, for the report.
    let line = std::env::args().skip(2).collect::<Vec<_>>().join(" ");
    match &cli.bench {
        Bench::Cni(b) => kit::run(b, line),
        Bench::Ipam(b) => kit::run(b, line),
        Bench::Cluster(b) => kit::run(b, line),
        Bench::Migration(b) => kit::run(b, line),
        Bench::Vm(b) => kit::run(b, line),
        Bench::Kubelet(b) => kit::run(b, line),
        Bench::Scale(b) => kit::run(b, line),
        Bench::Nodes(b) => kit::run(b, line),
        Bench::Kubevirt(b) => kit::run(b, line),
        Bench::Policy(b) => kit::run(b, line),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
