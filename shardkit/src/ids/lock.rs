//! The lock every ids file takes on its mutexes.

use std::sync::Mutex;

/// `m`'s guard, also when a thread panicked while holding it.
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
