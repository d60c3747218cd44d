//! tether's gRPC contract, generated at build time from `proto/`.
//!
//! Features choose what is generated besides the messages: `client` stubs
//! for the test suites, `server` stubs for the daemon.
//! The shim builds with neither: it needs only the messages, and without
//! either feature tonic is not even a dependency.

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
        include!(concat!(env!("OUT_DIR"), "/tether.cni.v1.rs"));
    }
}

/// The operator service, `tether.admin.v1`.
pub mod admin {
    /// Version 1 of the admin service.
    pub mod v1 {
        #![allow(missing_docs, clippy::all)]
        include!(concat!(env!("OUT_DIR"), "/tether.admin.v1.rs"));
    }
}

/// The encoded `FileDescriptorSet` of tether's protos, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/tether_descriptor.bin"));
