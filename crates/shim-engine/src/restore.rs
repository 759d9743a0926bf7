//! Restore at start-up (SPEC §5): state files and containers become tasks again.
//!
//! Tasks are paired with containers by container name (a task's directory is named after its
//! container). State files of the upstream shim are adopted with what they hold; containers
//! without a state file (an unreadable one moved aside, or an upstream container of the
//! version without state files) are adopted from what the container shows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use shim_runtime::{
    ContainerDetails, ContainerRuntime, ContainerState as RtState, ContainerSummary,
};
use shim_store::{Origin, ScanEntry, Store};
use shim_task::machine::Action;
use shim_task::{
    ContainerState, HostKeysGrant, MountedVolume, ObservedContainer, PortMapping, TaskId,
    TaskRecord, UnknownKeys, restore,
};

use crate::engine::{Inner, Slot, chain, now_ms};
use crate::error::{EngineError, Result};
use crate::labels::{
    LABEL_GPUS, LABEL_OWNER, LABEL_TASK_ID, LEGACY_LABEL_TASK, any_shim_filter, is_ours,
    is_ours_lexically, legacy_owner_identity, new_owner_identity, runner_mount,
};

/// How long start-up waits for the container runtime before giving up.
const RUNTIME_WAIT: Duration = Duration::from_secs(60);

/// Lists containers with `labels`, waiting (bounded) for the runtime to answer.
async fn list_waiting(
    runtime: &dyn ContainerRuntime,
    labels: &[(String, String)],
) -> Result<Vec<shim_runtime::ContainerSummary>> {
    let deadline = tokio::time::Instant::now() + RUNTIME_WAIT;
    loop {
        match runtime.list(labels).await {
            Ok(s) => return Ok(s),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %chain(&e), "container runtime not reachable yet; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(EngineError::RuntimeUnavailable(e)),
        }
    }
}

/// The owner identity of the home: the one stored in it, or, the first time, a new one — or,
/// for a home of the first release (which derived it from the home's path as spelled), the
/// identity its running containers carry, so they stay this shim's. Stored once.
pub(crate) async fn determine_owner(
    store: &Arc<Store>,
    runtime: &dyn ContainerRuntime,
) -> Result<String> {
    let s = store.clone();
    if let Some(id) = tokio::task::spawn_blocking(move || s.owner_id()).await?? {
        return Ok(id);
    }
    let home = store.home().to_path_buf();
    let id = if store.has_legacy_layout() {
        let s = store.clone();
        let records = tokio::task::spawn_blocking(move || s.legacy_records()).await?;
        let mut found = None;
        if !records.is_empty() {
            let legacy = [(LEGACY_LABEL_TASK.to_owned(), "true".to_owned())];
            for c in list_waiting(runtime, &legacy).await? {
                let matches = records.iter().any(|r| {
                    c.labels.get(LABEL_TASK_ID).map(String::as_str) == Some(r.id.as_str())
                        && c.name == r.container_name
                });
                if matches && let Some(owner) = c.labels.get(LABEL_OWNER) {
                    found = Some(owner.clone());
                    break;
                }
            }
        }
        found.unwrap_or_else(|| legacy_owner_identity(&home))
    } else {
        new_owner_identity(&home)
    };
    let s = store.clone();
    let stored = tokio::task::spawn_blocking(move || s.create_owner_id(&id)).await??;
    tracing::info!(owner = %stored, "owner identity created and stored in the home");
    Ok(stored)
}

/// What the state files say about one container name.
enum Found {
    Record(Box<TaskRecord>, Origin),
    /// The state file was unreadable (moved aside).
    Corrupt,
    /// A directory without a state file.
    Bare {
        skeleton: bool,
    },
}

impl Inner {
    /// The containers of `containers` that are this shim's: their runner mount lies in this
    /// home's task roots ([`crate::labels`]). Most are decided as spelled; the others, whose
    /// sources need their links resolved, off the async workers.
    pub(crate) async fn ours(&self, containers: Vec<ContainerSummary>) -> Vec<ContainerSummary> {
        let mut ours = Vec::new();
        let mut unsure = Vec::new();
        for c in containers {
            match is_ours_lexically(&c.mounts, &self.roots) {
                Some(true) => ours.push(c),
                Some(false) => {}
                None => unsure.push(c),
            }
        }
        if !unsure.is_empty() {
            let roots = self.roots.clone();
            let resolved = tokio::task::spawn_blocking(move || {
                unsure
                    .into_iter()
                    .filter(|c| is_ours(&c.mounts, &roots))
                    .collect::<Vec<_>>()
            })
            .await;
            match resolved {
                Ok(more) => ours.extend(more),
                Err(e) => tracing::error!(error = %e, "resolving container mounts failed"),
            }
        }
        ours
    }

    /// Whether a container with these mounts is this shim's (see [`Inner::ours`]).
    pub(crate) async fn owns(&self, mounts: &[shim_runtime::MountPoint]) -> bool {
        if let Some(known) = is_ours_lexically(mounts, &self.roots) {
            return known;
        }
        let (mounts, roots) = (mounts.to_vec(), self.roots.clone());
        tokio::task::spawn_blocking(move || is_ours(&mounts, &roots))
            .await
            .unwrap_or(false)
    }

    /// Restores every task of this shim. Nothing is released before every live task's SSH
    /// keys and GPUs are registered again, so a release never drops what a live task needs.
    /// Returns the start-up list (and when it was requested) for the first cycle.
    pub(crate) async fn restore_all(self: &Arc<Self>) -> Result<(Vec<ContainerSummary>, u64)> {
        let (migration, swept, entries) = self
            .blocking(|store| {
                let migration = store.migrate_legacy()?;
                let swept = store.sweep_trash();
                Ok((migration, swept, store.scan()?))
            })
            .await?;
        if migration.moved > 0 || migration.left > 0 {
            tracing::info!(
                moved = migration.moved,
                left = migration.left,
                "task directories of the first release migrated"
            );
        }
        if swept > 0 {
            tracing::info!(swept, "removed leftover trash directories");
        }
        let mut found: BTreeMap<String, Found> = BTreeMap::new();
        for entry in entries {
            match entry {
                ScanEntry::Record { record, origin } => {
                    found.insert(
                        record.container_name.clone(),
                        Found::Record(Box::new(record), origin),
                    );
                }
                ScanEntry::NoRecord { name, skeleton, .. } => {
                    found.insert(name, Found::Bare { skeleton });
                }
                ScanEntry::Corrupt {
                    name,
                    dir,
                    moved_to,
                    error,
                } => {
                    tracing::error!(
                        dir = %dir.display(),
                        moved_to = ?moved_to,
                        error = %error,
                        "unreadable state file moved aside; the task is restored from its container if it has one"
                    );
                    found.insert(name, Found::Corrupt);
                }
            }
        }

        let listed_at = crate::engine::mono_ns();
        let summaries = self.list_at_startup().await?;
        let referenced: BTreeSet<String> = summaries
            .iter()
            .flat_map(|c| c.mounts.iter().map(|m| m.source.clone()))
            .collect();
        let mut observed: BTreeMap<String, (ObservedContainer, bool)> = BTreeMap::new();
        for c in &summaries {
            let Some(o) = self.observe(c).await? else {
                continue;
            };
            if observed.contains_key(&o.name) {
                tracing::warn!(container = %o.id, "a second container with one name; ignored");
                continue;
            }
            // A container of the upstream version without state files mounts its whole
            // task directory: nothing the shim keeps may be written there.
            // (Its mount is the task directory itself, under a root, however spelled.)
            let whole_dir = match runner_mount(&c.mounts).map(PathBuf::from) {
                None => false,
                Some(src) => {
                    let located = match self.roots.locate_lexically(&src) {
                        Some(rel) => Some(rel),
                        None => {
                            let roots = self.roots.clone();
                            tokio::task::spawn_blocking(move || roots.locate(&src)).await?
                        }
                    };
                    located.is_some_and(|rel| rel.components().count() == 1)
                }
            };
            observed.insert(o.name.clone(), (o, whole_dir));
        }

        let names: BTreeSet<String> = found.keys().chain(observed.keys()).cloned().collect();
        let mut restored = Vec::new();
        for name in names {
            let (container, whole_dir) = match observed.remove(&name) {
                Some((c, w)) => (Some(c), w),
                None => (None, false),
            };
            let running = container.as_ref().is_some_and(|c| c.state.is_running());
            let record = match found.remove(&name) {
                Some(Found::Record(mut r, origin)) => {
                    if origin == Origin::Upstream {
                        self.complete_upstream_record(&mut r);
                    }
                    Some(*r)
                }
                // Restored from its container, if it has one, as a container without a state
                // file: its keys cannot be named, so `restore` holds the unknown-origin lines.
                Some(Found::Corrupt) => None,
                Some(Found::Bare { skeleton }) => {
                    if container.is_none() {
                        let dir = self.store.runners_dir().join(&name);
                        if skeleton && !referenced.iter().any(|s| Path::new(s).starts_with(&dir)) {
                            // What a submit cut short before its first write leaves: no
                            // container can exist for it (the state file is written before
                            // any acquisition).
                            let n = name.clone();
                            match self.blocking(move |s| s.remove_skeleton(&n)).await {
                                Ok(true) => {
                                    tracing::info!(dir = %dir.display(), "removed the empty directory of a submit cut short")
                                }
                                Ok(false) => {}
                                Err(e) => {
                                    tracing::warn!(dir = %dir.display(), error = %chain(&e), "cannot remove an empty task directory")
                                }
                            }
                        } else {
                            tracing::debug!(dir = %dir.display(), "task directory without a state file left alone");
                        }
                        continue;
                    }
                    None
                }
                None => None,
            };
            let Some((task, actions)) = restore(record, container, now_ms()) else {
                continue;
            };
            tracing::info!(task = %task.record().id, status = %task.status(), reason = ?task.record().termination_reason, "task restored");
            if whole_dir {
                tracing::warn!(task = %task.record().id, "container mounts its whole task directory (an upstream shim without state files made it): its state stays in memory");
            }
            restored.push((Arc::new(Slot::restored(task, whole_dir)), actions, running));
        }
        // GPUs go to the tasks whose containers run first: when two tasks claim one GPU (a
        // stale container of an older shim, a duplicate), the one using it keeps it, and the
        // other, which locked nothing, frees nothing.
        restored.sort_by_key(|(_, _, running)| !running);

        // Phase 1: register what live tasks hold, before anything is released.
        for (slot, _, _) in &restored {
            let t = slot.lock();
            let r = &t.record().resources;
            if r.released {
                continue;
            }
            if let Some(grant) = &r.host_keys {
                self.deps.keys.restore(&slot.id, &grant.user, &grant.keys);
            }
            if let Some(hold) = &r.unknown_keys {
                // Keys nobody can name: marked lines of unknown origin stay while it lives.
                self.deps.keys.hold_unknown(&slot.id, hold.user.as_deref());
            }
        }
        let mut rest = Vec::new();
        for (slot, actions, _) in restored {
            let dup = self.table().insert(slot.id.clone(), slot.clone());
            if let Some(other) = dup {
                tracing::warn!(task = %slot.id, first = %other.container_name, second = %slot.container_name, "two task directories or containers for one task id; the second one is used");
            }
            let (locks, others): (Vec<Action>, Vec<Action>) = actions
                .into_iter()
                .partition(|a| matches!(a, Action::LockGpus(_)));
            if let Err(e) = self.run_actions(&slot, locks).await {
                tracing::error!(task = %slot.id, error = %chain(&e), "relocking GPUs failed");
            }
            rest.push((slot, others));
        }
        // Phase 2: everything else (persist the restored state, stop, release).
        for (slot, actions) in rest {
            let result = match actions.first() {
                Some(Action::Persist) => {
                    // restore() asked for a write: carry it out under the step lock.
                    self.drive(&slot, shim_task::Event::PersistRequested).await
                }
                _ => self.run_actions(&slot, actions).await,
            };
            if let Err(e) = result {
                tracing::error!(task = %slot.id, error = %chain(&e), "restore actions failed; the reconciler retries");
            }
        }
        Ok((summaries, listed_at))
    }

    /// Fills in what a state file of the upstream shim does not hold: the resources its
    /// config says the task acquired (unless upstream recorded them as cleaned up).
    fn complete_upstream_record(&self, r: &mut TaskRecord) {
        if r.resources.released {
            return;
        }
        match &r.config {
            Some(c) => {
                let (keys, _) = c.host_keys();
                if !keys.is_empty() {
                    r.resources.host_keys = Some(HostKeysGrant {
                        user: c.host_ssh_user.clone(),
                        keys,
                        upstream: true,
                    });
                }
                r.resources.volumes = c
                    .volumes
                    .iter()
                    .map(|v| MountedVolume {
                        name: v.name.to_string(),
                        mount_point: self
                            .deps
                            .volumes
                            .mount_point(v.name.as_str())
                            .to_string_lossy()
                            .into_owned(),
                        device: String::new(),
                    })
                    .collect();
            }
            None => r.resources.unknown_keys = Some(UnknownKeys { user: None }),
        }
    }

    /// Lists this shim's containers; waits (bounded) for the runtime.
    async fn list_at_startup(&self) -> Result<Vec<ContainerSummary>> {
        let summaries = list_waiting(self.deps.runtime.as_ref(), &any_shim_filter()).await?;
        Ok(self.ours(summaries).await)
    }

    /// What restore needs of a container, or `None` if it has no valid task id label. The
    /// list entry tells everything (state, labels, ports, mounts) but the GPUs of a container
    /// the upstream shim made: only those are inspected.
    async fn observe(&self, c: &ContainerSummary) -> Result<Option<ObservedContainer>> {
        let Some(task_id) = c
            .labels
            .get(LABEL_TASK_ID)
            .and_then(|id| TaskId::new(id.as_str()).ok())
        else {
            return Ok(None);
        };
        let gpu_ids = match gpu_ids_from_label(&c.labels) {
            Some(ids) => ids,
            None if c.labels.contains_key(LABEL_OWNER) => Vec::new(),
            None => match self.deps.runtime.inspect(&c.id).await {
                Ok(d) => gpu_ids(&d),
                Err(shim_runtime::RuntimeError::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(EngineError::Runtime(e)),
            },
        };
        let state = match c.state {
            RtState::Created => ContainerState::Created,
            RtState::Running | RtState::Paused | RtState::Restarting => ContainerState::Running,
            // The exit code is the reconciler's to read (it inspects stopped containers).
            RtState::Exited => ContainerState::Exited { code: -1 },
            RtState::Dead => ContainerState::Dead,
            ref other => ContainerState::Other(other.to_string()),
        };
        let volumes_root = &self.cfg.volumes_root;
        Ok(Some(ObservedContainer {
            id: c.id.clone(),
            name: c.name.clone(),
            task_id,
            state,
            gpu_ids,
            ports: c
                .ports
                .iter()
                .map(|p| PortMapping {
                    host: p.host,
                    container: p.container,
                })
                .collect(),
            recovered_volumes: c
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
        }))
    }
}

/// The GPU ids of our label, if it is there (any vendor, fake hosts too).
fn gpu_ids_from_label(labels: &BTreeMap<String, String>) -> Option<Vec<String>> {
    labels.get(LABEL_GPUS).map(|l| {
        l.split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    })
}

/// GPU ids of a container: our label first, then NVIDIA device requests, then AMD render
/// nodes (as upstream recovers them: `docker.go`, `restoreStateFromContainers`).
fn gpu_ids(d: &ContainerDetails) -> Vec<String> {
    if let Some(ids) = gpu_ids_from_label(&d.labels) {
        return ids;
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
