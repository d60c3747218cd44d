//! tether's gRPC contract, generated at build time from `proto/`.
//!
//! Features choose what is generated besides the messages: `client` stubs
//! for the test suites, `server` stubs for the daemon.
//! The shim builds with neither: it needs only the messages, and without
//! either feature tonic is not even a dependency.
//!
//! It also holds what both sides of the contract must agree on besides the
//! messages: the cniVersions tether speaks ([`cni::SUPPORTED_VERSIONS`]) and
//! the pending-DEL queue's on-disk format ([`pending_del`]).

pub mod pending_del;

/// The shim-to-daemon CNI service, `tether.cni.v1`.
pub mod cni {
    /// Every cniVersion tether accepts, oldest first: the shim's VERSION
    /// answer and the daemon's check of each request both read it.
    ///
    /// 0.1.0 and 0.2.0 are left out on purpose: their result type has no
    /// interface list, so a routed veth cannot be described in it.
    pub const SUPPORTED_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

    /// The newest of [`SUPPORTED_VERSIONS`]: the version of the VERSION
    /// answer, and of errors made before a configuration was read.
    pub const LATEST_VERSION: &str = SUPPORTED_VERSIONS[SUPPORTED_VERSIONS.len() - 1];

    /// The VERSION answer, one line of JSON.
    pub fn version_reply() -> String {
        let quoted: Vec<String> = SUPPORTED_VERSIONS
            .iter()
            .map(|v| format!("\"{v}\""))
            .collect();
        format!(
            "{{\"cniVersion\":\"{LATEST_VERSION}\",\"supportedVersions\":[{}]}}\n",
            quoted.join(",")
        )
    }

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

#[cfg(test)]
mod tests {
    #[test]
    fn version_reply_is_the_spec_shape() {
        let reply = super::cni::version_reply();
        assert!(reply.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&reply).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "cniVersion": "1.1.0",
                "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
            })
        );
    }
}
