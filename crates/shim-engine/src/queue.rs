//! The reconciler's part of a task's slot ([`Observed`]): its container events waiting to be
//! handled, in order, by at most one worker at a time, and what the events said before the
//! exit they explain (an OOM kill, the exit's time). Only the reconciler changes it; the driver
//! reads the exit's time for the exit → terminated latency.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

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

/// What the reconciler keeps per task (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Observed {
    /// Container events waiting to be handled.
    pub(crate) events: EventQueue,
    /// An `oom` event came for the container: its `die` reports it.
    oom: AtomicBool,
    /// Unix ns when the task's container exited, as Docker reports it (0: unknown).
    exit_ns: AtomicI64,
}

impl Observed {
    /// An `oom` event came for the container.
    pub(crate) fn oom_seen(&self) {
        self.oom.store(true, Ordering::SeqCst);
    }

    /// Whether an `oom` event came since the last exit (and forgets it: it explains this
    /// exit only).
    pub(crate) fn take_oom(&self) -> bool {
        self.oom.swap(false, Ordering::SeqCst)
    }

    /// The container exited at `ns` (Unix ns).
    pub(crate) fn exited_at(&self, ns: i64) {
        self.exit_ns.store(ns, Ordering::SeqCst);
    }

    /// When the container exited, if known (and forgets it: one latency per exit).
    pub(crate) fn take_exit_ns(&self) -> Option<i64> {
        Some(self.exit_ns.swap(0, Ordering::SeqCst)).filter(|ns| *ns > 0)
    }
}
