//! The names KubeVirt and its IPAM extensions give to what tether reads
//! from a virt-launcher pod.

/// The annotation naming the VM (the libvirt domain) of a virt-launcher pod.
pub const DOMAIN_ANNOTATION: &str = "kubevirt.io/domain";
/// The annotation KubeVirt puts on a migration's target pod.
pub const MIGRATION_JOB_ANNOTATION: &str = "kubevirt.io/migrationJobName";
/// The annotation KubeVirt puts on a target pod once the VM runs there.
pub const TARGET_READY_ANNOTATION: &str = "kubevirt.io/migration-target-ready-timestamp";

/// The key of a network-selection element that names the pod's IPAMClaim.
pub const NSE_CLAIM_KEY: &str = "ipam-claim-reference";
