//! tether's gRPC contract, generated at build time from `proto/`.
//!
//! Features choose what is generated: `client` for the shim and tests,
//! `server` for the daemon. The shim builds with `client` only, so that no
//! server code ends up in the plugin binary.

/// The shim-to-daemon CNI service, `tether.cni.v1`.
pub mod cni {
    /// The CNI_* variables the shim forwards, in the order in which
    /// `CniRequest.present` lists those that were set.
    pub const FORWARDED_VARIABLES: [&str; 6] = [
        "CNI_COMMAND",
        "CNI_CONTAINERID",
        "CNI_NETNS",
        "CNI_IFNAME",
        "CNI_ARGS",
        "CNI_PATH",
    ];

    /// Version 1 of the CNI service.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        tonic::include_proto!("tether.cni.v1");
    }
}

/// The operator service, `tether.admin.v1`.
pub mod admin {
    /// Version 1 of the admin service.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        tonic::include_proto!("tether.admin.v1");
    }
}

/// The encoded `FileDescriptorSet` of tether's protos, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/tether_descriptor.bin"));
