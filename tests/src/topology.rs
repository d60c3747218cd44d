//! The one way a suite or a benchmark builds the machines it runs on: a
//! [`Topology`], its nodes' kind and its options, then `start`.
//!
//! Two kinds of node, each on the test fabric ([`crate::cluster::Fabric`]),
//! each its own network namespace:
//!
//! - [`Topology::tetherd`]: a node is a netns running tetherd, and the
//!   test itself plays the runtime, calling the real `tether` plugin for
//!   each pod ([`crate::cluster::Pod`]). The nodes share a control store:
//!   an etcd cluster ([`Store::Etcd`], the default) or a kube-apiserver
//!   ([`Store::Kubernetes`]); on etcd a kube-apiserver can stand beside it
//!   for the API's signals ([`Topology::with_api`]), and kube-proxy can run
//!   on every node ([`Topology::kube_proxy`]). `start` gives a
//!   [`Cluster`]. The quickest kind: most cluster, migration and VM suites
//!   run on it.
//! - [`Topology::kubelet`]: a node is a netns with a mount and PID
//!   namespace of its own, running containerd, the kubelet and
//!   kube-proxy, beside a control plane (API server, controller manager,
//!   scheduler); tether goes on it with its chart
//!   ([`KubeCluster::install_tether`]), and pods are made through the API.
//!   One node or several. KubeVirt's needs (aggregated APIs, its node
//!   paths, its images, the tun device) are the option
//!   [`Topology::kubevirt`]; KubeVirt itself is deployed by
//!   [`crate::kubevirt::deploy`] with the suite's own bindings. `start`
//!   gives a [`KubeCluster`].
//!
//! VMs in QEMU go on a pod of either kind: [`crate::vm::boot_guest`] on a
//! tetherd node's pod, [`crate::qemu::Guest::start`] in a
//! [`crate::kube_cluster::KubePod`]'s netns.
//!
//! ```no_run
//! use tether_e2e::cluster::Store;
//! use tether_e2e::topology::Topology;
//!
//! let cluster = Topology::tetherd(2).store(Store::Kubernetes).start();
//! let kube = Topology::kubelet(1).node_cidrs().start();
//! # drop((cluster, kube));
//! ```

use std::path::PathBuf;

use crate::cluster::{Cluster, NodeOpts, Store};
use crate::kube_cluster::KubeCluster;
use crate::stack::Stack;

/// A topology to start: how many nodes, of which kind `K` ([`Tetherd`] or
/// [`Kubelet`]), with which options.
#[derive(Clone, Debug)]
#[must_use = "a topology does nothing until it is started"]
pub struct Topology<K> {
    pub(crate) nodes: usize,
    pub(crate) kind: K,
}

/// The options of tetherd nodes ([`Topology::tetherd`]).
#[derive(Clone, Debug)]
pub struct Tetherd {
    pub(crate) store: Store,
    pub(crate) etcd_members: usize,
    pub(crate) node: NodeOpts,
    pub(crate) with_api: bool,
    pub(crate) kube_proxy: bool,
}

/// The options of kubelet nodes ([`Topology::kubelet`]).
#[derive(Clone, Debug)]
pub struct Kubelet {
    pub(crate) images: Vec<PathBuf>,
    pub(crate) sandbox_image: String,
    pub(crate) aggregating: bool,
    pub(crate) node_paths: Vec<(String, String)>,
    pub(crate) node_cidrs: bool,
    pub(crate) kubevirt: bool,
    pub(crate) stack: Stack,
}

impl Topology<Tetherd> {
    /// `nodes` netns nodes running tetherd, on an etcd cluster of 3
    /// members, each daemon with [`NodeOpts::default`].
    pub fn tetherd(nodes: usize) -> Topology<Tetherd> {
        Topology {
            nodes,
            kind: Tetherd {
                store: Store::Etcd,
                etcd_members: 3,
                node: NodeOpts::default(),
                with_api: false,
                kube_proxy: false,
            },
        }
    }

    /// The control store the daemons share.
    pub fn store(mut self, store: Store) -> Self {
        self.kind.store = store;
        self
    }

    /// How many etcd members ([`Store::Etcd`]).
    pub fn etcd_members(mut self, members: usize) -> Self {
        self.kind.etcd_members = members;
        self
    }

    /// How every node's tetherd is started.
    pub fn node(mut self, opts: NodeOpts) -> Self {
        self.kind.node = opts;
        self
    }

    /// On etcd, also a kube-apiserver with tether's CRDs and RBAC, whose
    /// token every daemon uses (`--kubeconfig`) for the API's signals
    /// (claims, pod watch, events). The Kubernetes store always has one.
    pub fn with_api(mut self, on: bool) -> Self {
        self.kind.with_api = on;
        self
    }

    /// kube-proxy (iptables mode, as a kubeadm node runs it) in every node
    /// netns, against the cluster's API server (started for it on etcd):
    /// Services whose endpoints the test writes itself
    /// ([`Cluster::expose`]), since no controller manager runs.
    pub fn kube_proxy(mut self, on: bool) -> Self {
        self.kind.kube_proxy = on;
        self
    }

    /// The store, then the nodes one after another (node `i` registers
    /// `i`-th).
    pub fn start(self) -> Cluster {
        Cluster::start(self.nodes, self.kind)
    }
}

impl Topology<Kubelet> {
    /// `nodes` kubelet nodes (one or more), with the harness's busybox and
    /// pause images ([`crate::kubelet::busybox_images`]).
    pub fn kubelet(nodes: usize) -> Topology<Kubelet> {
        Topology {
            nodes,
            kind: Kubelet {
                images: Vec::new(),
                sandbox_image: crate::kubelet::PAUSE_IMAGE.to_string(),
                aggregating: false,
                node_paths: Vec::new(),
                node_cidrs: false,
                kubevirt: false,
                stack: Stack::V4,
            },
        }
    }

    /// More OCI archives, imported into every node's containerd.
    pub fn images(mut self, archives: impl IntoIterator<Item = PathBuf>) -> Self {
        self.kind.images.extend(archives);
        self
    }

    /// containerd's sandbox (pause) image, by name (its archive among
    /// [`Topology::images`]).
    pub fn sandbox_image(mut self, name: &str) -> Self {
        self.kind.sandbox_image = name.to_string();
        self
    }

    /// The cluster's IP families (IPv4 unless set): the API server's
    /// Service ranges, the nodes' addresses, the pod CIDRs of the
    /// controller manager, kube-proxy and tether's chart, and cluster DNS
    /// ([`crate::stack`]).
    pub fn stack(mut self, stack: Stack) -> Self {
        self.kind.stack = stack;
        self
    }

    /// kube-controller-manager gives every node a pod CIDR per family of
    /// [`Stack::pod_cidrs`] (`--allocate-node-cidrs`, as `kubeadm init
    /// --pod-network-cidr` turns on): what the chart's `nodeCidrs` mode
    /// routes by.
    pub fn node_cidrs(mut self) -> Self {
        self.kind.node_cidrs = true;
        self
    }

    /// What KubeVirt needs of the cluster: the API server fronts
    /// aggregated APIs and calls webhooks at pod IPs (virt-api), every
    /// node keeps KubeVirt's hostPaths its own
    /// ([`crate::kubevirt::NODE_PATHS`]), has KubeVirt's images
    /// ([`crate::kubevirt::kubevirt_images`], built here or taken from
    /// the cache) under the digests its operator asks for, and a tun
    /// device its launchers can open.
    pub fn kubevirt(mut self) -> Self {
        self.kind.aggregating = true;
        self.kind.kubevirt = true;
        self.kind.node_paths.extend(
            crate::kubevirt::NODE_PATHS
                .iter()
                .map(|(s, t)| (s.to_string(), t.to_string())),
        );
        self.kind.images.extend(
            crate::kubevirt::kubevirt_images()
                .into_iter()
                .map(|(_, archive)| archive),
        );
        self
    }

    /// The control plane, then the nodes (containerd with the images, the
    /// kubelet, kube-proxy); waits until every node is registered
    /// (NotReady until tether is installed).
    pub fn start(self) -> KubeCluster {
        KubeCluster::start(self.nodes, self.kind)
    }
}
