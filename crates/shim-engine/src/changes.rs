//! Task change subscriptions: every change of every task, in order per task, for embedding
//! agents ([`crate::Engine::subscribe`]) and the HTTP API's live events.
//!
//! A change is what the API would show differently, sent when the API starts showing it: a
//! task submitted (its state file written), a status step (once its record is durable), a
//! termination with its reason and message, the release of everything the task held (once
//! recorded), its removal. The API never shows what a restart would undo, and so never sends
//! it — with one reading to keep in mind: a `terminated` the container's own end proves (its
//! exit, a stop on request) is shown, and sent, *at once*, before its record is written (a
//! full disk must not hide that a task ended); a crash before that write loses at most the
//! requested reason (a restart reads the end from the container: the reason then reads as
//! the exit's), never the status. The buffer is bounded: a
//! subscriber that falls behind by more than [`CHANGES_BUFFER`] changes gets
//! [`SubscriptionError::Lagged`] once, and should resync with [`crate::Engine::list`] (and
//! [`crate::Engine::task_info`]); the engine never waits for a subscriber.

use std::sync::Mutex;

use serde::Serialize;
use shim_task::machine::Saved;
use shim_task::{TaskId, TaskStatus};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// How many changes a subscriber may fall behind before it lags.
pub const CHANGES_BUFFER: usize = 4096;

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "change", rename_all = "snake_case")]
#[non_exhaustive]
pub enum ChangeKind {
    /// Submitted (the state file is written; the task is `pending`).
    Submitted,
    /// A new status (durable), other than `terminated`.
    Status {
        /// The status.
        status: TaskStatus,
    },
    /// Terminated, or its empty reason replaced by a later terminate's: sent as the API shows
    /// it, which for an end the container proves (an exit, a stop on request) is before the
    /// record is durable (see the module docs).
    Terminated {
        /// The reason.
        termination_reason: String,
        /// The message.
        termination_message: String,
    },
    /// The task's image pull made no progress for the stall timeout and was given up (the
    /// `terminated` change with `creating_container_error` follows).
    PullStalled {
        /// The image.
        image: String,
        /// Bytes downloaded before the stall.
        downloaded_bytes: u64,
        /// The image's size as far as the engine had announced it.
        total_bytes: u64,
        /// How long nothing moved, milliseconds.
        stalled_ms: u64,
        /// How long the pull ran, milliseconds.
        elapsed_ms: u64,
    },
    /// Everything the task held is released (recorded durably).
    Released,
    /// Removed: forgotten, its directory deleted.
    Removed,
}

/// One change of one task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct TaskChange {
    /// Sequence number, global across tasks and strictly increasing (a gap means changes were
    /// missed: see [`SubscriptionError::Lagged`]).
    pub seq: u64,
    /// Unix milliseconds.
    pub time_ms: u64,
    /// The task.
    pub task: TaskId,
    /// What changed.
    #[serde(flatten)]
    pub kind: ChangeKind,
}

/// Why a subscription gave no change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubscriptionError {
    /// The subscriber fell behind and `missed` changes were dropped for it: resync with the
    /// task list, then go on receiving.
    #[error("fell behind: {missed} task changes were dropped; resync with the task list")]
    Lagged {
        /// How many changes were dropped.
        missed: u64,
    },
    /// The engine is gone.
    #[error("the engine stopped")]
    Closed,
}

/// A subscription to task changes ([`crate::Engine::subscribe`]).
#[derive(Debug)]
pub struct Subscription {
    rx: broadcast::Receiver<TaskChange>,
    /// Cancelled when the engine shuts down: the subscription ends once it has given every
    /// change sent before.
    ended: CancellationToken,
}

impl Subscription {
    /// Ends (after the changes already sent) when `ended` is cancelled.
    pub(crate) fn until(mut self, ended: CancellationToken) -> Self {
        self.ended = ended;
        self
    }

    /// The next change, in order; [`SubscriptionError::Lagged`] after changes were dropped.
    pub async fn recv(&mut self) -> Result<TaskChange, SubscriptionError> {
        let received = tokio::select! {
            biased;
            received = self.rx.recv() => received,
            () = self.ended.cancelled() => return Err(SubscriptionError::Closed),
        };
        match received {
            Ok(change) => Ok(change),
            Err(broadcast::error::RecvError::Lagged(missed)) => {
                Err(SubscriptionError::Lagged { missed })
            }
            Err(broadcast::error::RecvError::Closed) => Err(SubscriptionError::Closed),
        }
    }

    /// The next change if one is waiting, without waiting.
    pub fn try_recv(&mut self) -> Option<Result<TaskChange, SubscriptionError>> {
        match self.rx.try_recv() {
            Ok(change) => Some(Ok(change)),
            Err(broadcast::error::TryRecvError::Empty) if self.ended.is_cancelled() => {
                Some(Err(SubscriptionError::Closed))
            }
            Err(broadcast::error::TryRecvError::Empty) => None,
            Err(broadcast::error::TryRecvError::Lagged(missed)) => {
                Some(Err(SubscriptionError::Lagged { missed }))
            }
            Err(broadcast::error::TryRecvError::Closed) => Some(Err(SubscriptionError::Closed)),
        }
    }
}

/// The engine's side: numbers changes and sends them.
#[derive(Debug)]
pub(crate) struct Changes {
    seq: Mutex<u64>,
    tx: broadcast::Sender<TaskChange>,
}

impl Changes {
    pub(crate) fn new() -> Self {
        Self {
            seq: Mutex::new(0),
            tx: broadcast::channel(CHANGES_BUFFER).0,
        }
    }

    pub(crate) fn subscribe(&self) -> Subscription {
        Subscription {
            rx: self.tx.subscribe(),
            ended: CancellationToken::new(),
        }
    }

    /// Sends a change. Callers send a task's changes while holding that task's lock, so a
    /// task's changes are numbered and sent in the order they happened.
    pub(crate) fn send(&self, task: &TaskId, kind: ChangeKind, time_ms: u64) {
        let mut seq = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        *seq += 1;
        // No subscriber is fine.
        let _ = self.tx.send(TaskChange {
            seq: *seq,
            time_ms,
            task: task.clone(),
            kind,
        });
    }

    /// The changes between two durable views of a task, in the order they happened.
    pub(crate) fn between(before: &Saved, after: &Saved) -> Vec<ChangeKind> {
        let mut out = Vec::new();
        let reason = |s: &Saved| {
            s.termination_reason
                .as_ref()
                .map(|r| r.as_str().to_owned())
                .unwrap_or_default()
        };
        if after.status == TaskStatus::Terminated {
            if before.status != TaskStatus::Terminated
                || reason(before) != reason(after)
                || before.termination_message != after.termination_message
            {
                out.push(ChangeKind::Terminated {
                    termination_reason: reason(after),
                    termination_message: after.termination_message.clone(),
                });
            }
        } else if after.status != before.status {
            out.push(ChangeKind::Status {
                status: after.status,
            });
        }
        if after.released && !before.released {
            out.push(ChangeKind::Released);
        }
        out
    }
}
