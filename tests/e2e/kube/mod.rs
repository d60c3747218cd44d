//! Real kubelet nodes: the kubelet calls tether; dual-stack and IPv6-only clusters in each mode; VMs move between two kubelet nodes; KubeVirt itself.

mod kube_nodes;
mod kube_stacks;
mod kube_vm_connections;
mod kubelet;
mod kubevirt;
