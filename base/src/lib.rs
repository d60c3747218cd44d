//! tether's bottom layer: the values that every other layer shares and
//! none of them owns. The daemon's error type and its CNI code table, the
//! MAC address, time, the keys of attachments and VM records, the guest
//! and tap specs of KubeVirt bindings, the names KubeVirt gives to pod
//! annotations, and the mutex helper. It depends on no other crate of
//! tether's, and none of its modules imports a layer above it: the
//! compiler sees to that.

pub mod error;
pub mod guest;
pub mod keys;
pub mod kubevirt;
pub mod mac;
pub mod net;
pub mod pod_event;
pub mod sync;
pub mod time;
