//! Restore at start-up (SPEC §5): state files and containers become tasks again.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shim_runtime::{ContainerDetails, ContainerState as RtState};
use shim_store::ScanEntry;
use shim_task::machine::Action;
use shim_task::{
    ContainerState, MountedVolume, ObservedContainer, PortMapping, TaskId, TaskRecord, restore,
};

use crate::engine::{Inner, Slot, now_ms};
use crate::error::{EngineError, Result};
use crate::labels::{LABEL_GPUS, LABEL_TASK_ID, owner_labels};

/// How long start-up waits for the container runtime before giving up.
const RUNTIME_WAIT: Duration = Duration::from_secs(60);

impl Inner {
    /// Restores every task of this shim. Nothing is released before every live task's SSH
    /// keys and GPUs are registered again, so a release never drops what a live task needs.
    pub(crate) async fn restore_all(self: &Arc<Self>) -> Result<()> {
        let entries = self
            .blocking(|store| {
                let swept = store.sweep_trash();
                if swept > 0 {
                    tracing::info!(swept, "removed leftover trash directories");
                }
                store.scan()
            })
            .await?;
        let mut records: BTreeMap<TaskId, Option<TaskRecord>> = BTreeMap::new();
        for entry in entries {
            match entry {
                ScanEntry::Record(r) => {
                    records.insert(r.id.clone(), Some(r));
                }
                ScanEntry::NoRecord { dir } => {
                    tracing::debug!(dir = %dir.display(), "task directory without a state file left alone");
                }
                ScanEntry::Corrupt {
                    id,
                    dir,
                    moved_to,
                    error,
                } => {
                    tracing::error!(
                        task = %id,
                        dir = %dir.display(),
                        moved_to = ?moved_to,
                        error = %error,
                        "unreadable state file moved aside; the task is restored from its container if it has one"
                    );
                    records.insert(id, None);
                }
            }
        }

        let containers = self.list_at_startup().await?;
        let mut observed: BTreeMap<TaskId, ObservedContainer> = BTreeMap::new();
        for c in containers {
            if let Some(o) = observe(&c, &self.cfg.volumes_root) {
                if observed.contains_key(&o.task_id) {
                    tracing::warn!(task = %o.task_id, container = %o.id, "a second container for one task; ignored");
                    continue;
                }
                observed.insert(o.task_id.clone(), o);
            }
        }

        let ids: BTreeSet<TaskId> = records.keys().chain(observed.keys()).cloned().collect();
        let mut restored = Vec::new();
        for id in ids {
            let record = records.remove(&id).flatten();
            let container = observed.remove(&id);
            let running = container.as_ref().is_some_and(|c| c.state.is_running());
            let Some((task, actions)) = restore(record, container, now_ms()) else {
                continue;
            };
            tracing::info!(task = %id, status = %task.status(), reason = ?task.record.termination_reason, "task restored");
            restored.push((Arc::new(Slot::new(task, None)), actions, running));
        }
        // GPUs go to the tasks whose containers run first: when two tasks claim one GPU (a
        // stale container of an older shim, a duplicate), the one using it keeps it, and the
        // other, which locked nothing, frees nothing.
        restored.sort_by_key(|(_, _, running)| !running);

        // Phase 1: register what live tasks hold, before anything is released.
        for (slot, _, _) in &restored {
            let t = slot.lock();
            if !t.record.resources.released
                && let Some(grant) = &t.record.resources.host_keys
            {
                self.deps.keys.restore(&slot.id, &grant.user, &grant.keys);
            }
        }
        let mut rest = Vec::new();
        for (slot, actions, _) in restored {
            self.table().insert(slot.id.clone(), slot.clone());
            let (locks, others): (Vec<Action>, Vec<Action>) = actions
                .into_iter()
                .partition(|a| matches!(a, Action::LockGpus(_)));
            if let Err(e) = self.run_actions(&slot, locks).await {
                tracing::error!(task = %slot.id, error = %e, "relocking GPUs failed");
            }
            rest.push((slot, others));
        }
        // Phase 2: everything else (persist the restored state, stop, release).
        for (slot, actions) in rest {
            if let Err(e) = self.run_actions(&slot, actions).await {
                tracing::error!(task = %slot.id, error = %e, "restore actions failed; the reconciler retries");
            }
        }
        Ok(())
    }

    /// Lists this shim's containers and inspects each; waits (bounded) for the runtime.
    async fn list_at_startup(&self) -> Result<Vec<ContainerDetails>> {
        let labels = owner_labels(&self.owner);
        let deadline = tokio::time::Instant::now() + RUNTIME_WAIT;
        let summaries = loop {
            match self.deps.runtime.list(&labels).await {
                Ok(s) => break s,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::warn!(error = %e, "container runtime not reachable yet; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => return Err(EngineError::RuntimeUnavailable(e)),
            }
        };
        let mut out = Vec::new();
        for s in summaries {
            match self.deps.runtime.inspect(&s.id).await {
                Ok(d) => out.push(d),
                Err(shim_runtime::RuntimeError::NotFound { .. }) => {}
                Err(e) => return Err(EngineError::Runtime(e)),
            }
        }
        Ok(out)
    }
}

/// What restore needs of a container, or `None` if it has no valid task id label.
fn observe(d: &ContainerDetails, volumes_root: &Path) -> Option<ObservedContainer> {
    let task_id = TaskId::new(d.labels.get(LABEL_TASK_ID)?.as_str()).ok()?;
    let state = match d.state {
        RtState::Created => ContainerState::Created,
        RtState::Running | RtState::Paused | RtState::Restarting => ContainerState::Running,
        RtState::Exited => ContainerState::Exited {
            code: d.exit_code.unwrap_or(-1),
        },
        RtState::Dead => ContainerState::Dead,
        ref other => ContainerState::Other(other.to_string()),
    };
    Some(ObservedContainer {
        id: d.id.clone(),
        name: d.name.clone(),
        task_id,
        state,
        gpu_ids: gpu_ids(d),
        ports: d
            .ports
            .iter()
            .map(|p| PortMapping {
                host: p.host,
                container: p.container,
            })
            .collect(),
        recovered_volumes: d
            .mounts
            .iter()
            .filter_map(|m| {
                let source = Path::new(&m.source);
                let rel = source.strip_prefix(volumes_root).ok()?;
                let name = rel.to_str().filter(|n| !n.is_empty() && !n.contains('/'))?;
                Some(MountedVolume {
                    name: name.to_owned(),
                    mount_point: m.source.clone(),
                    device: String::new(),
                })
            })
            .collect(),
    })
}

/// GPU ids of a container: our label first (any vendor, fake hosts too), then NVIDIA device
/// requests, then AMD render nodes.
fn gpu_ids(d: &ContainerDetails) -> Vec<String> {
    if let Some(l) = d.labels.get(LABEL_GPUS) {
        return l
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
    }
    let nvidia: Vec<String> = d
        .device_requests
        .iter()
        .flat_map(|r| r.device_ids.iter().cloned())
        .collect();
    if !nvidia.is_empty() {
        return nvidia;
    }
    d.devices
        .iter()
        .filter(|m| m.path_on_host.starts_with("/dev/dri/renderD"))
        .map(|m| m.path_on_host.clone())
        .collect()
}
