//! A task's container events waiting to be handled, in order, by at most one worker at a time.

use std::collections::VecDeque;
use std::sync::Mutex;

use shim_runtime::ContainerEvent;

/// The queue of one task's container events, and whether a worker handles them.
#[derive(Debug, Default)]
pub(crate) struct EventQueue {
    inner: Mutex<(VecDeque<ContainerEvent>, bool)>,
}

impl EventQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, (VecDeque<ContainerEvent>, bool)> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues an event.
    pub(crate) fn push(&self, event: ContainerEvent) {
        self.lock().0.push_back(event);
    }

    /// Claims the right to handle the queued events; false if a worker already does, or
    /// nothing is queued.
    pub(crate) fn claim_worker(&self) -> bool {
        let mut q = self.lock();
        if q.1 || q.0.is_empty() {
            return false;
        }
        q.1 = true;
        true
    }

    /// The next queued event for the worker; `None` ends the worker's claim (atomically with
    /// finding the queue empty, so no event is left behind).
    pub(crate) fn next(&self) -> Option<ContainerEvent> {
        let mut q = self.lock();
        let next = q.0.pop_front();
        if next.is_none() {
            q.1 = false;
        }
        next
    }
}
