//! Events on pods, as values: which pod, and what happened to it. The
//! attachment lifecycle and the VM component say them; the Kubernetes
//! layer writes them to the API when the daemon has one.

/// The pod an event is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PodRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID, when known (the runtime sends K8S_POD_UID).
    pub uid: Option<String>,
}

/// What happened to a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodEvent {
    /// An ADD failed because the address or MAC it needs is held by
    /// another pod or VM, or excluded (CNI codes 105 and 109).
    AddressConflict(String),
    /// An ADD failed because its pool has no free address (CNI code 100).
    PoolExhausted(String),
    /// A VM's traffic now goes to this pod (a migration's cutover).
    CutoverDone(String),
    /// A migration failed after its cutover: the VM's traffic goes back to
    /// its source pod.
    CutoverReverted(String),
}

impl PodEvent {
    /// The event's reason, as `kubectl` shows it.
    pub fn reason(&self) -> &'static str {
        match self {
            PodEvent::AddressConflict(_) => "AddressConflict",
            PodEvent::PoolExhausted(_) => "PoolExhausted",
            PodEvent::CutoverDone(_) => "CutoverDone",
            PodEvent::CutoverReverted(_) => "CutoverReverted",
        }
    }

    /// The event's text.
    pub fn note(&self) -> &str {
        match self {
            PodEvent::AddressConflict(n)
            | PodEvent::PoolExhausted(n)
            | PodEvent::CutoverDone(n)
            | PodEvent::CutoverReverted(n) => n,
        }
    }

    /// True for a warning, false for a normal event.
    pub fn warning(&self) -> bool {
        !matches!(self, PodEvent::CutoverDone(_))
    }

    /// What tether was doing (the event's `action`).
    pub fn action(&self) -> &'static str {
        match self {
            PodEvent::AddressConflict(_) | PodEvent::PoolExhausted(_) => "AddPodNetwork",
            PodEvent::CutoverDone(_) | PodEvent::CutoverReverted(_) => "MigrateVmNetwork",
        }
    }
}
