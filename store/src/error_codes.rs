//! Each typed failure of the control store and of the attachment store
//! maps to the CNI code that its cause calls for, and keeps the cause.

use crate::control::{ControlError, MemberFailures};
use crate::store::StoreError;
use std::io;
use std::path::PathBuf;
use tether_base::error::Error;

fn io_gone() -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, "gone away")
}

fn json_error() -> serde_json::Error {
    serde_json::from_str::<u32>("{").unwrap_err()
}

/// (error, its code, text the message must contain).
fn control_cases() -> Vec<(ControlError, u32, String)> {
    let json = json_error().to_string();
    let utf8 = String::from_utf8(vec![0xff]).unwrap_err();
    let utf8_text = utf8.to_string();
    vec![
        (
            ControlError::Unavailable {
                doing: "list /tether/v1/".into(),
                cause: MemberFailures(vec![
                    ("http://a:2379".into(), "connection refused".into()),
                    ("http://b:2379".into(), "no answer within 300 ms".into()),
                ]),
            },
            11,
            "etcd did not list /tether/v1/: http://a:2379: connection refused; \
             http://b:2379: no answer within 300 ms"
                .into(),
        ),
        (
            ControlError::Connect {
                endpoints: "http://a:2379,http://b:2379".into(),
                cause: etcd_client::Error::InvalidArgs("bad endpoint".into()),
            },
            11,
            "cannot reach etcd at http://a:2379,http://b:2379: invalid arguments: bad endpoint"
                .into(),
        ),
        (
            ControlError::Misconfigured("--etcd-cert and --etcd-key go together"),
            7,
            "--etcd-cert and --etcd-key go together".into(),
        ),
        (
            ControlError::TlsFile {
                what: "CA bundle",
                path: PathBuf::from("/etc/etcd/ca.pem"),
                cause: io_gone(),
            },
            7,
            "reading the etcd CA bundle /etc/etcd/ca.pem: gone away".into(),
        ),
        (
            ControlError::Io {
                context: "writing",
                path: PathBuf::from("/var/lib/tether/control-plane.json"),
                cause: io_gone(),
            },
            104,
            "writing /var/lib/tether/control-plane.json: gone away".into(),
        ),
        (
            ControlError::Corrupt {
                path: PathBuf::from("/var/lib/tether/control-plane.json"),
                cause: json_error(),
            },
            104,
            format!("decoding /var/lib/tether/control-plane.json: {json}"),
        ),
        (
            ControlError::Encode(<serde_json::Error as serde::ser::Error>::custom("boom")),
            199,
            "encoding the control-plane state: boom".into(),
        ),
        (
            ControlError::NotUtf8 {
                key: "/tether/v1/x".into(),
                cause: utf8,
            },
            199,
            format!("non-UTF-8 value for /tether/v1/x: {utf8_text}"),
        ),
    ]
}

/// Each back-end error becomes an `Error` of its code whose message
/// contains the expected text.
fn maps_each<E: Into<Error> + std::fmt::Debug>(cases: Vec<(E, u32, String)>) {
    for (e, code, text) in cases {
        let shown = format!("{e:?}");
        let mapped: Error = e.into();
        assert_eq!(mapped.code(), code, "{shown} became {mapped:?}");
        assert!(
            mapped.to_string().contains(&text),
            "{mapped} does not contain {text:?}"
        );
    }
}

#[test]
fn control_errors_map_to_their_codes_and_keep_the_cause() {
    maps_each(control_cases());
    // Today's wording is kept where the message had a cause already.
    let e = Error::from(ControlError::TlsFile {
        what: "client key",
        path: PathBuf::from("/k.pem"),
        cause: io_gone(),
    });
    assert_eq!(
        e.to_string(),
        "invalid network configuration: reading the etcd client key /k.pem: gone away"
    );
}

fn key(cid: &str) -> crate::store::AttachmentKey {
    crate::store::AttachmentKey {
        network: "net".into(),
        container_id: cid.into(),
        ifname: "eth0".into(),
    }
}

/// (error, its code, text the message must contain).
fn store_cases() -> Vec<(StoreError, u32, String)> {
    let json = json_error().to_string();
    vec![
        (
            StoreError::Io {
                context: "creating /var/lib/tether".into(),
                cause: io_gone(),
            },
            104,
            "state store failure: creating /var/lib/tether: gone away".into(),
        ),
        (
            StoreError::Corrupt {
                path: PathBuf::from("/s/attachments.snapshot"),
                cause: json_error(),
            },
            104,
            format!("decoding /s/attachments.snapshot: {json}"),
        ),
        (
            StoreError::UnsupportedVersion {
                path: PathBuf::from("/s/attachments.snapshot"),
                version: 9,
            },
            104,
            "/s/attachments.snapshot has unsupported version 9".into(),
        ),
        (
            StoreError::FlushFailed {
                context: "flushing the journal",
                cause: std::sync::Arc::new(io::Error::other("disk on fire")),
            },
            104,
            "state store failure: flushing the journal: disk on fire".into(),
        ),
        (
            StoreError::Encode {
                what: "journal record",
                cause: <serde_json::Error as serde::ser::Error>::custom("boom"),
            },
            199,
            "encoding the journal record: boom".into(),
        ),
        (
            StoreError::TooLarge { len: 5_000_000_000 },
            199,
            "record too large".into(),
        ),
        (
            StoreError::Exists(key("a")),
            199,
            "internal error: attachment net/a/eth0 exists".into(),
        ),
        (
            StoreError::AddressHeld {
                ip: "10.0.0.2".parse().unwrap(),
                holder: key("a"),
            },
            199,
            "internal error: address 10.0.0.2 is already held by net/a/eth0".into(),
        ),
    ]
}

#[test]
fn store_errors_map_to_their_codes_and_keep_the_cause() {
    maps_each(store_cases());
}
