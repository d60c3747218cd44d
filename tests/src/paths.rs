//! Every path a user's connection to or from a VM takes, as
//! [`crate::streams`], all started before a live migration and read after
//! it: the suites and `tether-bench vm` run the same set.
//!
//! The VM is a guest (a [`GuestShell`]: the harness's QEMU guests of
//! [`crate::qemu`], or KubeVirt's) whose `tether-echo`s this module
//! starts: two listeners (TCP [`VM_TCP`], UDP [`VM_UDP`]) for the
//! streams toward the VM, and one connector per stream the VM opens. The
//! measuring ends are [`crate::streams::Stream`]s in the test's pods and in
//! a host outside the cluster (each a [`Place`]) ([`Outside`]: on the nodes' underlay, with no
//! route to any pod, so the VM reaches it only through outbound NAT).
//!
//! | path | opened by | where the translation is |
//! |---|---|---|
//! | pod on the source, target or third node → VM (pod IP) | the pod | none |
//! | VM → a host outside the cluster | the VM | outbound NAT on the VM's node |
//! | VM → a pod (on the third node) | the VM | none |
//! | pod (on the third node) → ClusterIP whose endpoint is the VM | the pod | kube-proxy on the pod's node |
//! | outside → NodePort on the source, target, third node | the outside host | kube-proxy on the entry node (DNAT and masquerade) |
//! | VM → ClusterIP of two pods | the VM | kube-proxy on the VM's node |
//!
//! Each path runs over TCP and UDP, over IPv4 and IPv6 where the path has
//! both (the Services are IPv4: single-stack, of a dual-stack cluster's
//! first family).

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::cluster::{assert_ping_within, Cluster, Fabric, Pod, Underlay};
use crate::kube::ServiceSpec;
use crate::qemu::{Guest, Pause, BOOT_TIMEOUT};
use crate::streams::{Proto, Stream, StreamReport};
use crate::topology::{Tetherd, Topology};
use crate::vm::{add_vm_pod, boot_guest, VmPodSpec};
use crate::Netns;

/// The guest's TCP listener, for the streams toward the VM.
pub const VM_TCP: u16 = 7000;
/// The guest's UDP listener.
pub const VM_UDP: u16 = 7001;
/// The port the outside host listens on for the VM's connections (TCP
/// and UDP; IPv6 on the port [`V6_OFFSET`] above, since an IPv6 socket
/// on the wildcard address takes the IPv4 port too).
pub const OUTSIDE_PORT: u16 = 8000;
/// The port a pod listens on for the VM's connections (as
/// [`OUTSIDE_PORT`]).
pub const POD_PORT: u16 = 9000;
/// What an IPv6 listener adds to its port.
pub const V6_OFFSET: u16 = 10;
/// The port the backends of the VM's ClusterIP listen on (TCP and UDP).
pub const BACKEND_PORT: u16 = 9100;
/// The outside host's number on the underlay (nodes start at 21).
pub const OUTSIDE_HOST: u8 = 200;

/// A host outside the cluster: a netns on the nodes' underlay, with its
/// default route to the fabric's gateway and no route to any pod.
#[derive(Debug)]
pub struct Outside {
    netns: Netns,
    underlay: Underlay,
}

impl Outside {
    /// Attaches a new host to `cluster`'s fabric.
    pub fn new(cluster: &Cluster) -> Outside {
        Outside::on(cluster.fabric())
    }

    /// Attaches a new host to `fabric` (any cluster's: the kubelet
    /// clusters' too).
    pub fn on(fabric: &Fabric) -> Outside {
        let netns = Netns::new("out");
        let underlay = fabric.attach_host(&netns, OUTSIDE_HOST.into());
        Outside { netns, underlay }
    }

    /// The host as a place streams run from.
    pub fn place(&self) -> Place<'_> {
        Place {
            netns: &self.netns,
            v4: IpAddr::V4(self.underlay.v4),
            v6: Some(IpAddr::V6(self.underlay.v6)),
        }
    }

    /// Its netns.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// Its addresses on the underlay.
    pub fn underlay(&self) -> &Underlay {
        &self.underlay
    }
}

/// The Services of the kube-proxy paths (see [`Services::create`]).
#[derive(Debug, Clone)]
pub struct Services {
    /// The ClusterIP whose endpoint is the VM (ports [`VM_TCP`],
    /// [`VM_UDP`]).
    pub vm_cluster_ip: IpAddr,
    /// That Service's NodePorts, TCP and UDP.
    pub vm_node_ports: (u16, u16),
    /// The ClusterIP of the two backend pods (port [`BACKEND_PORT`]).
    pub backend_cluster_ip: IpAddr,
}

/// How a cluster makes a Service with its endpoints written by hand
/// ([`Cluster::expose`], [`crate::kube_cluster::KubeCluster::expose`]):
/// the Service as the API server answers it.
pub type Expose<'a> = dyn Fn(&ServiceSpec<'_>) -> Value + 'a;

impl Services {
    /// Creates both Services on `cluster` (which runs kube-proxy): one
    /// NodePort Service with the VM's IPv4 address as its endpoint, one
    /// ClusterIP Service with `backends` as its endpoints.
    pub fn create(cluster: &Cluster, vm: IpAddr, backends: &[IpAddr]) -> Services {
        Services::create_with(
            &|spec| cluster.expose(spec),
            ("vm", "backends"),
            vm,
            backends,
        )
    }

    /// Creates both Services through `expose`, named `names` (the VM's,
    /// the backends'): one NodePort Service with the VM's IPv4 address as
    /// its endpoint, one ClusterIP Service with `backends` as its
    /// endpoints.
    pub fn create_with(
        expose: &Expose<'_>,
        names: (&str, &str),
        vm: IpAddr,
        backends: &[IpAddr],
    ) -> Services {
        let vm_svc = expose(&ServiceSpec {
            name: names.0,
            kind: "NodePort",
            ports: &[
                ("tcp", "TCP", VM_TCP, VM_TCP),
                ("udp", "UDP", VM_UDP, VM_UDP),
            ],
            endpoints: &[vm],
        });
        let node_port = |name: &str| -> u16 {
            vm_svc["spec"]["ports"]
                .as_array()
                .and_then(|ports| ports.iter().find(|p| p["name"] == name))
                .and_then(|p| p["nodePort"].as_u64())
                .and_then(|p| u16::try_from(p).ok())
                .unwrap_or_else(|| panic!("no {name} NodePort: {vm_svc}"))
        };
        let backend_svc = expose(&ServiceSpec {
            name: names.1,
            kind: "ClusterIP",
            ports: &[
                ("tcp", "TCP", BACKEND_PORT, BACKEND_PORT),
                ("udp", "UDP", BACKEND_PORT, BACKEND_PORT),
            ],
            endpoints: backends,
        });
        let ip = |svc: &Value| -> IpAddr {
            svc["spec"]["clusterIP"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("no ClusterIP: {svc}"))
        };
        Services {
            vm_cluster_ip: ip(&vm_svc),
            vm_node_ports: (node_port("tcp"), node_port("udp")),
            backend_cluster_ip: ip(&backend_svc),
        }
    }
}

/// Routes follow the store through a watch: allow for it.
const CONVERGE: Duration = Duration::from_secs(15);
/// How long [`PathSet::stop`] waits, for all its streams together, for
/// each to echo once more: a guard against a stream that never will, not
/// a measure (a TCG guest on a machine at a load average of 20 answered
/// 2 s late; a dead connection never answers).
const ALIVE_LIMIT: Duration = Duration::from_secs(15);

/// Everything the paths need but the migration: a three-node cluster
/// running kube-proxy, a host outside it, a VM (namespace `tenant`, VM
/// `vm1`, the `tap` binding) on node 0 with its guest leased, an observer
/// pod on every node, two backend pods (nodes 0 and 2) and the Services.
/// The VM moves between nodes 0 and 1; node 2 is the third.
pub struct Scene {
    /// The host outside the cluster.
    pub outside: Outside,
    /// The guest where the VM runs now.
    pub guest: Guest,
    /// The VM's pod where it runs now.
    pub pod: Pod,
    /// That pod's spec.
    pub spec: VmPodSpec,
    /// The node the VM runs on now (0 or 1).
    pub on: usize,
    /// The VM's addresses, IPv4 and IPv6.
    pub vm: (IpAddr, IpAddr),
    /// An observer pod on each node.
    pub pods: [Pod; 3],
    /// The backends of the VM's ClusterIP (nodes 0 and 2).
    pub backends: [Pod; 2],
    /// The Services.
    pub services: Services,
    /// Last: everything above lives in its namespaces.
    pub cluster: Cluster,
}

/// A migration's target: its pod on the other node, and a QEMU waiting
/// for the guest's state.
pub struct Incoming {
    /// The target pod.
    pub pod: Pod,
    /// Its spec.
    pub spec: VmPodSpec,
    /// The waiting QEMU.
    pub guest: Guest,
}

/// What a completed migration left behind on its source.
pub struct Left {
    /// The source pod (its netns goes on drop).
    pub pod: Pod,
    /// Its spec, for its DEL.
    pub spec: VmPodSpec,
    /// The source QEMU, done.
    pub guest: Guest,
    /// The node it is on.
    pub node: usize,
}

impl Scene {
    /// Builds the scene on `topology`, started with kube-proxy (the
    /// Services need it).
    pub fn new(topology: Topology<Tetherd>) -> Scene {
        let cluster = topology.kube_proxy(true).start();
        let outside = Outside::new(&cluster);
        let spec = VmPodSpec::tap("tenant", "vm1", "virt-launcher-vm1-0");
        let pod = add_vm_pod(cluster.node(0), &spec);
        let vm = (pod.v4().expect("IPv4"), pod.v6().expect("IPv6"));
        let guest = boot_guest(&pod, false);
        guest.wait_line("TETHER-LEASE4", BOOT_TIMEOUT);
        guest.wait_line("TETHER-LEASE6", BOOT_TIMEOUT);
        let pods = [0, 1, 2].map(|i| cluster.add_pod(i));
        let backends = [0, 2].map(|i| cluster.add_pod(i));
        assert_ping_within(pods[2].netns(), vm.0, CONVERGE);
        assert_ping_within(pods[2].netns(), vm.1, CONVERGE);
        let backend_ips = backends.each_ref().map(|p| p.v4().expect("IPv4"));
        let services = Services::create(&cluster, vm.0, &backend_ips);
        Scene {
            outside,
            guest,
            pod,
            spec,
            on: 0,
            vm,
            pods,
            backends,
            services,
            cluster,
        }
    }

    /// The ends of every path, the VM's node now as the source.
    pub fn ends(&self) -> Ends<'_> {
        let (s, t) = (self.on, 1 - self.on);
        let c = &self.cluster;
        let node = |i: usize| Some(IpAddr::V4(c.node(i).underlay().v4));
        Ends {
            vm: (self.vm.0, Some(self.vm.1)),
            pods: [s, t, 2].map(|i| Some(Place::of(&self.pods[i]))),
            nodes: [node(s), node(t), node(2)],
            outside: self.outside.place(),
            peer: Place::of(&self.pods[2]),
            services: Some((
                &self.services,
                self.backends.iter().map(|p| p.netns()).collect(),
            )),
        }
    }

    /// A migration target pod `pod_name` on the other node of the two,
    /// its QEMU waiting.
    pub fn incoming(&self, pod_name: &str) -> Incoming {
        let spec = self.spec.target(pod_name);
        let pod = add_vm_pod(self.cluster.node(1 - self.on), &spec);
        let guest = boot_guest(&pod, true);
        Incoming { pod, spec, guest }
    }

    /// After a completed migration to `incoming`: the VM runs there now;
    /// what its source left.
    pub fn switch(&mut self, incoming: Incoming) -> Left {
        let node = self.on;
        self.on = 1 - self.on;
        Left {
            pod: std::mem::replace(&mut self.pod, incoming.pod),
            spec: std::mem::replace(&mut self.spec, incoming.spec),
            guest: std::mem::replace(&mut self.guest, incoming.guest),
            node,
        }
    }
}

/// Where a stream's end runs: a netns (a pod's, a host's) and its
/// addresses.
#[derive(Clone, Copy)]
pub struct Place<'a> {
    /// The netns the end's socket is opened in.
    pub netns: &'a Netns,
    /// Its IPv4 address.
    pub v4: IpAddr,
    /// Its IPv6 address, if it has one.
    pub v6: Option<IpAddr>,
}

impl<'a> Place<'a> {
    /// A pod of the harness's clusters.
    pub fn of(pod: &'a Pod) -> Place<'a> {
        Place {
            netns: pod.netns(),
            v4: pod.v4().expect("the pod's IPv4 address"),
            v6: pod.v6(),
        }
    }
}

/// Who takes part in the paths.
pub struct Ends<'a> {
    /// The VM's addresses: IPv4, and IPv6 if it has one.
    pub vm: (IpAddr, Option<IpAddr>),
    /// A pod on the source node, one on the target node, one on a third
    /// (None: the cluster has two nodes).
    pub pods: [Option<Place<'a>>; 3],
    /// The nodes' IPv4 addresses (NodePort entries), in the order of
    /// `pods`: source, target, third.
    pub nodes: [Option<IpAddr>; 3],
    /// The host outside the cluster.
    pub outside: Place<'a>,
    /// The pod the VM opens its connection to (a pod on the third node,
    /// or on any other than the VM's).
    pub peer: Place<'a>,
    /// The kube-proxy paths' Services, if the cluster runs kube-proxy,
    /// with the netns of each of the backends.
    pub services: Option<(&'a Services, Vec<&'a Netns>)>,
}

/// A guest the paths can start `tether-echo` in and read the console of:
/// the harness's QEMU guests, and KubeVirt's.
pub trait GuestShell {
    /// Runs a shell command in the guest (it backgrounds what it starts);
    /// panics if it cannot.
    fn run_ok(&self, command: &str) -> String;
    /// How many console lines there are so far.
    fn mark(&self) -> usize;
    /// Waits up to `limit` for a console line after `mark` that starts
    /// with `prefix`; panics if none comes.
    fn wait_line_after(&self, prefix: &str, mark: usize, limit: Duration) -> (usize, String);
    /// The console so far, for a failure's message.
    fn console_text(&self) -> String;
}

impl GuestShell for Guest {
    fn run_ok(&self, command: &str) -> String {
        Guest::run_ok(self, command)
    }
    fn mark(&self) -> usize {
        Guest::mark(self)
    }
    fn wait_line_after(&self, prefix: &str, mark: usize, limit: Duration) -> (usize, String) {
        Guest::wait_line_after(self, prefix, mark, limit)
    }
    fn console_text(&self) -> String {
        Guest::console_text(self)
    }
}

/// The streams of every path, started together.
#[derive(Debug, Default)]
pub struct PathSet {
    streams: Vec<Stream>,
}

/// The three roles of the nodes, for the streams' names.
const ROLES: [&str; 3] = ["source", "target", "third"];

impl PathSet {
    /// Starts the guest's echoes and a stream for every path of `ends`,
    /// each sending every `interval`, and waits until every stream has
    /// echoes; panics naming the streams that never did.
    pub fn start(guest: &dyn GuestShell, ends: &Ends, interval: Duration) -> PathSet {
        PathSet::start_of(guest, ends, interval, true)
    }

    /// Like [`PathSet::start`], with only the streams the VM opens (to the
    /// outside host, to the peer pod, to the ClusterIP of pods): what a VM
    /// has when a policy keeps every other connection to it out.
    pub fn start_opened_by_vm(guest: &dyn GuestShell, ends: &Ends, interval: Duration) -> PathSet {
        PathSet::start_of(guest, ends, interval, false)
    }

    fn start_of(
        guest: &dyn GuestShell,
        ends: &Ends,
        interval: Duration,
        toward_vm: bool,
    ) -> PathSet {
        let mut set = PathSet::default();
        let vms: Vec<IpAddr> = std::iter::once(ends.vm.0).chain(ends.vm.1).collect();
        start_listeners(guest);
        for (i, pod) in ends.pods.iter().enumerate() {
            let Some(pod) = pod.filter(|_| toward_vm) else {
                continue;
            };
            for vm in &vms {
                for (proto, port) in [(Proto::Tcp, VM_TCP), (Proto::Udp, VM_UDP)] {
                    let name = format!("pod@{} -> VM {}", ROLES[i], family(*vm));
                    set.streams.push(Stream::connect(
                        pod.netns,
                        &name,
                        proto,
                        SocketAddr::new(*vm, port),
                        interval,
                    ));
                }
            }
        }
        // The VM opens these: listeners first, then the guest's connectors.
        let mut connectors = Vec::new();
        let mut far_ends = Vec::new();
        for (place, what, port) in [
            (ends.outside, "outside", OUTSIDE_PORT),
            (ends.peer, "pod", POD_PORT),
        ] {
            let has_v6 = ends.vm.1.is_some();
            for far in std::iter::once(place.v4).chain(place.v6.filter(|_| has_v6)) {
                far_ends.push((
                    place.netns,
                    format!("VM -> {what} {}", family(far)),
                    far,
                    port,
                ));
            }
        }
        for (ns, name, far, port) in far_ends {
            let port = if far.is_ipv6() {
                port + V6_OFFSET
            } else {
                port
            };
            for proto in [Proto::Tcp, Proto::Udp] {
                set.streams
                    .push(Stream::listen_any(&[ns], &name, proto, far, port, interval));
                connectors.push(connector(proto, far, port));
            }
        }
        if let Some((svc, backends)) = &ends.services {
            let (tcp_np, udp_np) = svc.vm_node_ports;
            // The ClusterIP's client: the pod on the third node (or on the
            // last node there is).
            if let Some((i, client)) = ends
                .pods
                .iter()
                .enumerate()
                .rev()
                .find_map(|(i, p)| Some((i, (*p)?)))
                .filter(|_| toward_vm)
            {
                for (proto, port) in [(Proto::Tcp, VM_TCP), (Proto::Udp, VM_UDP)] {
                    set.streams.push(Stream::connect(
                        client.netns,
                        &format!("pod@{} -> ClusterIP -> VM", ROLES[i]),
                        proto,
                        SocketAddr::new(svc.vm_cluster_ip, port),
                        interval,
                    ));
                }
            }
            for (i, node) in ends.nodes.iter().enumerate() {
                let Some(node) = node.filter(|_| toward_vm) else {
                    continue;
                };
                for (proto, port) in [(Proto::Tcp, tcp_np), (Proto::Udp, udp_np)] {
                    set.streams.push(Stream::connect(
                        ends.outside.netns,
                        &format!("outside -> NodePort@{} -> VM", ROLES[i]),
                        proto,
                        SocketAddr::new(node, port),
                        interval,
                    ));
                }
            }
            for proto in [Proto::Tcp, Proto::Udp] {
                set.streams.push(Stream::listen_any(
                    backends,
                    "VM -> ClusterIP -> pods",
                    proto,
                    svc.backend_cluster_ip,
                    BACKEND_PORT,
                    interval,
                ));
                connectors.push(connector(proto, svc.backend_cluster_ip, BACKEND_PORT));
            }
        }
        guest.run_ok(&connectors.join(" "));
        let late: Vec<String> = set
            .streams
            .iter()
            .filter(|s| !s.wait_echoes(20, Duration::from_secs(30)))
            .map(Stream::state)
            .collect();
        if !late.is_empty() {
            // The guest's sockets (their queues and drops) tell a stuck
            // process from a path that never delivers.
            let sockets = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                guest.run_ok(
                    "cat /proc/net/udp /proc/net/udp6 /proc/net/tcp /proc/net/tcp6; ps; \
                     cat /proc/net/snmp",
                )
            }))
            .unwrap_or_else(|_| "(the guest did not answer)".into());
            panic!(
                "streams with no echoes before the migration:\n{}\nguest sockets:\n{sockets}\n\
                 guest console:\n{}",
                late.join("\n"),
                guest.console_text()
            );
        }
        set
    }

    /// Adds a stream the test started itself, to be stopped and reported
    /// with the others.
    pub fn push(&mut self, stream: Stream) {
        self.streams.push(stream);
    }

    /// Waits up to `limit` until every stream has had `n` echoes.
    pub fn wait_echoes(&self, n: u64, limit: Duration) -> bool {
        self.streams.iter().all(|s| s.wait_echoes(n, limit))
    }

    /// Stops every stream; their reports, in the order they started.
    pub fn stop(self) -> Vec<StreamReport> {
        // Each stream is asked to show it is alive (an echo of a message
        // sent from now on) before it stops, within ALIVE_LIMIT for all.
        let asked = Instant::now();
        let until = asked + ALIVE_LIMIT;
        self.streams
            .into_iter()
            .map(|s| s.stop_once_alive(asked, until))
            .collect()
    }
}

/// Starts the guest's two listeners ([`VM_TCP`], [`VM_UDP`]), ending any
/// `tether-echo` of an earlier run first, and waits until they listen.
pub fn start_listeners(guest: &dyn GuestShell) {
    let mark = guest.mark();
    guest.run_ok(&format!(
        "killall -q tether-echo; tether-echo tcp-listen {VM_TCP} >/dev/console 2>&1 & \
         tether-echo udp-listen {VM_UDP} >/dev/console 2>&1 &"
    ));
    for what in [
        format!("ECHO listening tcp {VM_TCP}"),
        format!("ECHO listening udp {VM_UDP}"),
    ] {
        guest.wait_line_after(&what, mark, Duration::from_secs(30));
    }
}

/// The guest's command that opens one stream toward `far`.
fn connector(proto: Proto, far: IpAddr, port: u16) -> String {
    format!(
        "tether-echo {}-connect {far} {port} >/dev/console 2>&1 &",
        proto.name()
    )
}

fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "v4"
    } else {
        "v6"
    }
}

/// The report lines of the streams that died, or whose far end saw this
/// end's address change (a translation that did not hold).
pub fn dead_or_moved(reports: &[StreamReport]) -> Vec<String> {
    reports
        .iter()
        .filter(|r| !r.survived() || !r.one_address())
        .map(|r| r.line())
        .collect()
}

/// The table of `reports`: per stream, survived or not, the longest stall
/// (against the guest's `pause` when known), loss and the addresses the
/// far end saw; `t0` is when the migration started.
pub fn table(reports: &[StreamReport], t0: Instant, pause: Option<Pause>) -> String {
    let mut out = String::new();
    if let Some(p) = pause {
        let _ = writeln!(
            out,
            "guest paused {:.1} ms (STOP at +{:.1} ms, RESUME at +{:.1} ms after the migration began)",
            p.duration().as_secs_f64() * 1e3,
            p.stop.saturating_duration_since(t0).as_secs_f64() * 1e3,
            p.resume.saturating_duration_since(t0).as_secs_f64() * 1e3,
        );
    }
    for r in reports {
        // The stall the migration cost: the longest one from its start on
        // (a stream's longest may be its first echo's wait).
        let (stall, from) = r
            .stall_within(t0, r.stopped)
            .unwrap_or((Duration::ZERO, t0));
        let over = pause.map(|p| stall.as_secs_f64() * 1e3 - p.duration().as_secs_f64() * 1e3);
        let at = from.saturating_duration_since(t0).as_secs_f64() * 1e3;
        let loss = r
            .longest_loss
            .map(|(from, n)| {
                format!(
                    "; {n} lost in a row from +{:.0} ms",
                    from.saturating_duration_since(t0).as_secs_f64() * 1e3
                )
            })
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "{}  since +0: stall {:.1} ms from +{at:.0} ms{}{loss}",
            r.line(),
            stall.as_secs_f64() * 1e3,
            over.map(|o| format!(" (stall - pause {o:+.1} ms)"))
                .unwrap_or_default()
        );
    }
    out
}

/// What each node (its name and netns) tracks and routes for a VM's
/// handover: its conntrack table, policy rules, the handover's routes and
/// tether's `inet tether_vm` table; for a failure's message.
pub fn handover_state<'a>(nodes: impl IntoIterator<Item = (&'a str, &'a Netns)>) -> String {
    let mut out = String::new();
    for (name, netns) in nodes {
        out.push_str(&format!("--- {name}\n"));
        for cmd in [
            &["conntrack", "-L"][..],
            &["ip", "rule"],
            &["ip", "route", "show", "table", "all", "proto", "204"],
            &["nft", "list", "table", "inet", "tether_vm"],
        ] {
            let o = netns.exec(cmd);
            out.push_str(&format!(
                "$ {}\n{}{}",
                cmd.join(" "),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ));
        }
    }
    out
}
