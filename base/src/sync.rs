//! Locking of the std mutexes that every layer's in-memory state uses.

use std::sync::{Mutex, MutexGuard};

/// Locks a std mutex, recovering from poisoning: no critical section in
/// tether leaves its data inconsistent before it could panic, so a panic
/// elsewhere must not take the state down with it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
