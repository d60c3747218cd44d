//! Real kubelet nodes: the kubelet calls tether; VMs move between two kubelet nodes; KubeVirt itself.

mod kube_nodes;
mod kube_vm_connections;
mod kubelet;
mod kubevirt;
