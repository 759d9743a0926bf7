//! The reconciler: brings tasks in line with their containers, in the background.
//!
//! One cycle makes one container list request for all of this shim's containers. A running
//! task whose container still runs costs nothing more; one whose container stopped is inspected
//! (only then: the list reports the exit code inside a human-readable string only) and
//! terminated per SPEC §2. Terminated tasks that still hold resources are released. Tasks whose
//! start is in flight are skipped entirely. A failed list changes no task.
//!
//! Cycles run every `reconcile_interval` and whenever the runtime reports a container exit of
//! ours (events are hints: they can be lost, the periodic list is the source of truth).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use shim_runtime::ContainerSummary;
use shim_task::TaskStatus;
use shim_task::machine::{Event, Observation};

use crate::engine::{Inner, chain, now_ms};
use crate::labels::{LABEL_TASK_ID, any_shim_filter, is_ours, owner_labels};

impl Inner {
    /// Runs cycles until one succeeds (Docker may still be starting), with a bound, so the
    /// engine reports ready only after containers that exited while the shim was down are
    /// processed.
    pub(crate) async fn first_cycle(self: &Arc<Self>) {
        for attempt in 0..30u32 {
            if self.cycle().await {
                return;
            }
            tracing::warn!(attempt, "first reconcile cycle failed; retrying");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        tracing::error!(
            "no reconcile cycle succeeded at start-up; serving anyway, retrying in the background"
        );
    }

    /// One reconcile cycle. Returns whether the list request succeeded.
    pub(crate) async fn cycle(self: &Arc<Self>) -> bool {
        // Tasks whose start had returned before the list was requested. A start that returns
        // while the list is in flight made a container the list may not show: judging that
        // task by this list would call its new container vanished.
        let settled: HashSet<String> = self
            .slots()
            .iter()
            .filter(|s| !s.lock().start_in_flight)
            .map(|s| s.id.as_str().to_owned())
            .collect();
        let containers = match self.deps.runtime.list(&any_shim_filter()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %chain(&e), "container list failed; no task changed");
                return false;
            }
        };
        let dirs = self.runners_dirs();
        let dirs: Vec<&std::path::Path> = dirs.iter().map(std::path::PathBuf::as_path).collect();
        let containers: Vec<ContainerSummary> = containers
            .into_iter()
            .filter(|c| is_ours(&c.labels, &c.mounts, &self.owner, &dirs))
            .collect();
        let hints: HashSet<String> =
            std::mem::take(&mut *self.exit_hints.lock().unwrap_or_else(|p| p.into_inner()));
        let by_task: HashMap<&str, &ContainerSummary> = containers
            .iter()
            .filter_map(|c| c.labels.get(LABEL_TASK_ID).map(|id| (id.as_str(), c)))
            .collect();
        for slot in self.slots() {
            let (status, in_flight, container_id, needs_release) = {
                let t = slot.lock();
                (
                    t.status(),
                    t.start_in_flight,
                    t.record.container_id.clone(),
                    t.needs_release(),
                )
            };
            if in_flight || !settled.contains(slot.id.as_str()) {
                continue;
            }
            if slot.lock().dirty {
                // A write failed before (a full disk): retry it; what waited on it follows.
                if let Err(e) = self.drive(&slot, Event::PersistRequested).await {
                    tracing::warn!(task = %slot.id, error = %chain(&e), "state write still failing");
                    continue;
                }
            }
            let summary = by_task.get(slot.id.as_str()).copied().or_else(|| {
                containers
                    .iter()
                    .find(|c| !container_id.is_empty() && c.id == container_id)
            });
            let observation = if status == TaskStatus::Running {
                match summary {
                    None => Some(Observation::Missing),
                    Some(c) if c.state.is_running() && !hints.contains(&c.id) => None,
                    Some(c) => Some(self.observe_stopped(&c.id).await),
                }
            } else if status == TaskStatus::Terminated {
                // A terminated task's container that still runs (a stop that failed, or a
                // shim that stopped between recording the reason and stopping) is stopped.
                summary
                    .filter(|c| c.state.is_running())
                    .map(|_| Observation::Running)
            } else {
                None
            };
            if let Some(obs) = observation {
                if !matches!(obs, Observation::Running) || status == TaskStatus::Terminated {
                    tracing::info!(task = %slot.id, observation = ?obs, "container observed");
                }
                if let Err(e) = self.drive(&slot, Event::Observed(obs)).await {
                    tracing::error!(task = %slot.id, error = %chain(&e), "reconcile step failed");
                }
            }
            let needs_release = needs_release || slot.lock().needs_release();
            if needs_release && let Err(e) = self.drive(&slot, Event::ReleaseRequested).await {
                tracing::error!(task = %slot.id, error = %chain(&e), "release failed");
            }
        }
        *self.last_cycle_ms.lock().unwrap_or_else(|p| p.into_inner()) = Some(now_ms());
        true
    }
}

/// Starts the background reconciler and the exit-event listener that wakes it.
pub(crate) fn spawn_background(inner: &Arc<Inner>) {
    let this = inner.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = this.shutdown.cancelled() => break,
                _ = this.wake.notified() => {}
                _ = tokio::time::sleep(this.cfg.reconcile_interval) => {}
            }
            if this.shutdown.is_cancelled() {
                break;
            }
            this.cycle().await;
        }
        tracing::debug!("reconciler stopped");
    });
    let this = inner.clone();
    tokio::spawn(async move {
        let labels = owner_labels(&this.owner);
        while !this.shutdown.is_cancelled() {
            match this.deps.runtime.exit_events(&labels).await {
                Ok(mut stream) => loop {
                    tokio::select! {
                        _ = this.shutdown.cancelled() => return,
                        item = stream.next() => match item {
                            Some(Ok(ev)) => {
                                tracing::debug!(container = %ev.container_id, code = ?ev.exit_code, "exit event");
                                this.exit_hints
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .insert(ev.container_id);
                                this.wake.notify_one();
                            }
                            Some(Err(e)) => {
                                tracing::debug!(error = %e, "exit event stream error");
                                break;
                            }
                            None => break,
                        }
                    }
                },
                Err(e) => tracing::debug!(error = %e, "cannot subscribe to exit events"),
            }
            // Resubscribe after a pause; the periodic list covers the gap.
            tokio::select! {
                _ = this.shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            // Events may have been missed while unsubscribed.
            this.wake.notify_one();
        }
    });
}
