//! Restore at start-up (SPEC §5): state files and containers become tasks again.
//!
//! Tasks are paired with containers by container name (a task's directory is named after its
//! container). State files of the upstream shim are adopted with what they hold; containers
//! without a state file (an unreadable one moved aside, or an upstream container of the
//! version without state files) are adopted from what the container shows.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shim_resources::{AuthorizedKeys, VolumeManager};
use shim_runtime::{ContainerDetails, ContainerRuntime, ContainerState, ContainerSummary};
use shim_store::{Origin, RecordError, ScanEntry};
use shim_task::machine::Action;
use shim_task::{
    HostKeysGrant, MountedVolume, ObservedContainer, ObservedState, PortMapping, TaskId,
    TaskRecord, TaskStatus, UnknownKeys, restore as restore_task,
};

use crate::clock::Clock;
use crate::error::{EngineError, Result, chain};
use crate::home::Home;
use crate::labels::{
    LABEL_GPUS, LABEL_OWNER, LABEL_TASK_ID, LEGACY_LABEL_TASK, legacy_owner_identity,
    new_owner_identity,
};
use crate::ownership::Ownership;
use crate::records::Slot;

/// How long start-up waits for the container runtime before giving up.
const RUNTIME_WAIT: Duration = Duration::from_secs(60);

/// Lists containers with `labels`, waiting (bounded) for the runtime to answer.
pub(crate) async fn list_waiting(
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
/// identity its running containers carry, so they stay this shim's. Stored once; where it
/// cannot be stored (a full disk), it serves this run only and the next start stores one: the
/// identity is a label, not the proof of ownership (the runner mount is), so a start never
/// fails for it.
pub(crate) async fn determine_owner(home: &Home, runtime: &dyn ContainerRuntime) -> Result<String> {
    if let Some(id) = home.owner_id().await? {
        return Ok(id);
    }
    let id = if home.has_legacy_layout() {
        let records = home.legacy_records().await?;
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
        found.unwrap_or_else(|| legacy_owner_identity(home.path()))
    } else {
        new_owner_identity(home.path())
    };
    match home.create_owner_id(id.clone()).await {
        Ok(stored) => {
            tracing::info!(owner = %stored, "owner identity created and stored in the home");
            Ok(stored)
        }
        Err(e) => {
            tracing::warn!(owner = %id, error = %chain(&e), "cannot store the owner identity; using it for this run only (the next start stores one; ownership is the runner mount, so no task is orphaned)");
            Ok(id)
        }
    }
}

/// What the state files say about one container name.
enum Found {
    Record(Box<TaskRecord>, Origin),
    /// The state file was unusable: moved aside, or (`left`) left in place because it only
    /// could not be read now.
    Corrupt {
        left: bool,
    },
    /// A directory marked as mounted whole by its container: its state file, if any, is the
    /// container's and was not read.
    MountedWhole,
    /// A directory without a state file.
    Bare {
        skeleton: bool,
    },
}

/// What restore needs.
pub(crate) struct RestoreContext<'a> {
    /// What the restored records and the list are stamped with.
    pub(crate) clock: Clock,
    /// The home's task directories.
    pub(crate) home: &'a Home,
    /// The runtime (metered).
    pub(crate) runtime: &'a dyn ContainerRuntime,
    /// Which containers are this engine's.
    pub(crate) ownership: &'a Ownership,
    /// Where live tasks' keys are registered again.
    pub(crate) keys: &'a dyn AuthorizedKeys,
    /// Where volumes are mounted.
    pub(crate) volumes: &'a dyn VolumeManager,
    /// The volumes root (volumes of a container without a state file are recovered from
    /// mounts under it).
    pub(crate) volumes_root: &'a Path,
}

/// One task restored: its slot, and what restore's decision calls for (GPU relocks first,
/// then a write, a stop, a release), not carried out yet.
pub(crate) struct RestoredTask {
    /// The task.
    pub(crate) slot: Arc<Slot>,
    /// What to do, in order.
    pub(crate) actions: Vec<Action>,
    /// The reason, when this restore ended the task (its record, if any, was not
    /// terminated): a termination like any other for the metrics.
    pub(crate) ended: Option<String>,
}

/// What restore found.
pub(crate) struct Restored {
    /// Every task, those whose containers run first (they keep a GPU two tasks claim).
    pub(crate) tasks: Vec<RestoredTask>,
    /// The start-up list of this engine's containers, for the first cycle.
    pub(crate) listed: Vec<ContainerSummary>,
    /// When the list was requested ([`Clock::mono_ns`](crate::Clock::mono_ns)).
    pub(crate) listed_at: u64,
}

/// Restores every task of this shim: state files and containers paired by container name,
/// [`shim_task::restore()`] decides each, and the SSH keys of every live task are registered
/// again before anything is released (its GPUs are relocked by the first of its actions,
/// which the caller carries out for every task before the rest). Nothing is released here.
///
/// `listing` is the start-up list of the shim's containers, requested at `listed_at`
/// ([`Clock::mono_ns`](crate::Clock::mono_ns)) by the caller before anything else, so that
/// the state files are read while the daemon answers it.
pub(crate) async fn restore(
    ctx: RestoreContext<'_>,
    listing: tokio::task::JoinHandle<Result<Vec<ContainerSummary>>>,
    listed_at: u64,
) -> Result<Restored> {
    let (migration, swept, entries) = ctx.home.scan().await?;
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
            ScanEntry::MountedWhole { name, .. } => {
                found.insert(name, Found::MountedWhole);
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
                    error = %chain(&error),
                    "unusable state file (moved aside unless it only could not be read now); the task is restored from its container if it has one"
                );
                let left = moved_to.is_none() && matches!(error, RecordError::Io(_));
                found.insert(name, Found::Corrupt { left });
            }
        }
    }

    let listed = listing.await??;
    let listed = ctx.ownership.ours(listed).await;
    let referenced: BTreeSet<String> = listed
        .iter()
        .flat_map(|c| c.mounts.iter().map(|m| m.source.clone()))
        .collect();
    let mut observed: BTreeMap<String, (ObservedContainer, bool)> = BTreeMap::new();
    for c in &listed {
        let Some(o) = observe(&ctx, c).await? else {
            continue;
        };
        if observed.contains_key(&o.name) {
            tracing::warn!(container = %o.id, "a second container with one name; ignored");
            continue;
        }
        // A container of the upstream version without state files mounts its whole task
        // directory: nothing the shim keeps may be written there.
        let whole_dir = ctx.ownership.mounts_whole_task_dir(&c.mounts).await?;
        if whole_dir && !matches!(found.get(&o.name), Some(Found::MountedWhole)) {
            // Marked beside the directory, durably: a state file the container writes there
            // stays unread at every later start, its container gone or not.
            if let Err(e) = ctx.home.mark_mounted_whole(o.name.clone()).await {
                tracing::warn!(container = %o.id, error = %chain(&e), "cannot mark a task directory as mounted whole");
            }
        }
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
            // The container mounts its whole task directory (upstream before state files):
            // a state file there is the container's to write, so it names nothing this shim
            // may act on (host keys, volumes, GPUs, even the task's id). The task is restored
            // from its container, as one without a state file.
            Some(Found::Record(..)) if whole_dir => {
                tracing::warn!(dir = %ctx.home.runners_dir().join(&name).display(),
                    "a state file in a task directory its container mounts whole is the container's: not trusted");
                None
            }
            Some(Found::Record(mut r, origin)) => {
                if origin == Origin::Upstream {
                    complete_upstream_record(ctx.volumes, &mut r, container.as_ref());
                }
                Some(*r)
            }
            // Restored from its container, if it has one, as a container without a state
            // file: its keys cannot be named, so `restore` holds the unknown-origin lines. A
            // file left in place (it could not be read now) is moved aside first when there
            // is a container, whose task's record, written next, would replace its bytes;
            // without one it stays, to be read at the next start.
            Some(Found::Corrupt { left }) => {
                if left && container.is_some() {
                    match ctx.home.set_aside_state_file(name.clone()).await {
                        Ok(moved_to) => {
                            tracing::warn!(dir = %ctx.home.runners_dir().join(&name).display(), moved_to = ?moved_to,
                                "a state file that could not be read, of a task restored from its container, moved aside")
                        }
                        Err(e) => {
                            tracing::warn!(error = %chain(&e), "cannot move aside a state file that could not be read")
                        }
                    }
                }
                None
            }
            // Marked at an earlier start as mounted whole: restored from its container; once
            // the container is gone (removed while no shim ran), the directory is deleted
            // unless another container mounts something in it.
            Some(Found::MountedWhole) => {
                if container.is_none() {
                    let dir = ctx.home.runners_dir().join(&name);
                    if referenced.iter().any(|s| Path::new(s).starts_with(&dir)) {
                        tracing::warn!(dir = %dir.display(), "a task directory mounted whole, its container gone, is mounted by another container; left alone");
                    } else {
                        match ctx.home.delete(name.clone()).await {
                            Ok(()) => {
                                tracing::info!(dir = %dir.display(), "removed the directory of an adopted task whose container is gone")
                            }
                            Err(e) => {
                                tracing::warn!(dir = %dir.display(), error = %chain(&e), "cannot remove the directory of an adopted task whose container is gone")
                            }
                        }
                    }
                    continue;
                }
                None
            }
            Some(Found::Bare { skeleton }) => {
                if container.is_none() {
                    let dir = ctx.home.runners_dir().join(&name);
                    if skeleton && !referenced.iter().any(|s| Path::new(s).starts_with(&dir)) {
                        // What a submit cut short before its first write leaves: no container
                        // can exist for it (the state file is written before any
                        // acquisition).
                        match ctx.home.remove_skeleton(name.clone()).await {
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
        let was_terminated = record
            .as_ref()
            .is_some_and(|r| r.status == TaskStatus::Terminated);
        let Some((task, actions)) = restore_task(record, container, ctx.clock.now_ms()) else {
            continue;
        };
        let ended = (!was_terminated && task.status() == TaskStatus::Terminated)
            .then(|| task.record().termination_reason.as_ref())
            .flatten()
            .map(|r| r.as_str().to_owned());
        // A running task whose container runs comes back as it was: one line for all of them
        // (the caller's count); a task a restart finds ended, or whose running container it
        // stops (a recorded termination), is said task by task.
        if running && task.status() == TaskStatus::Running {
            tracing::debug!(task = %task.record().id, status = %task.status(), "task restored");
        } else {
            tracing::info!(task = %task.record().id, status = %task.status(), reason = ?task.record().termination_reason, "task restored");
        }
        if whole_dir {
            tracing::warn!(task = %task.record().id, "container mounts its whole task directory (an upstream shim without state files made it): its state stays in memory");
        }
        restored.push((
            RestoredTask {
                slot: Arc::new(Slot::restored(task, whole_dir)),
                actions,
                ended,
            },
            running,
        ));
    }
    // GPUs go to the tasks whose containers run first: when two tasks claim one GPU (a stale
    // container of an older shim, a duplicate), the one using it keeps it, and the other,
    // which locked nothing, frees nothing.
    restored.sort_by_key(|(_, running)| !running);
    let tasks: Vec<RestoredTask> = restored.into_iter().map(|(t, _)| t).collect();

    // Register what live tasks hold, before anything is released.
    for t in &tasks {
        let slot = &t.slot;
        slot.read(|task| {
            let r = &task.record().resources;
            if r.released {
                return;
            }
            if let Some(grant) = &r.host_keys {
                ctx.keys.restore(&slot.id, &grant.user, &grant.keys);
            }
            if let Some(hold) = &r.unknown_keys {
                // Keys nobody can name: marked lines of unknown origin stay while it lives.
                ctx.keys.hold_unknown(&slot.id, hold.user.as_deref());
            }
        });
    }
    Ok(Restored {
        tasks,
        listed,
        listed_at,
    })
}

/// Fills in what a state file of the upstream shim does not hold: the resources its config
/// says the task acquired (unless upstream recorded them as cleaned up).
fn complete_upstream_record(
    volumes: &dyn VolumeManager,
    r: &mut TaskRecord,
    container: Option<&ObservedContainer>,
) {
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
                    mount_point: volumes
                        .mount_point(v.name.as_str())
                        .to_string_lossy()
                        .into_owned(),
                    device: String::new(),
                })
                .collect();
        }
        None => {
            r.resources.unknown_keys = Some(UnknownKeys { user: None });
            // Its volumes as its container mounts them, as for a container without a state
            // file: they are released with the task.
            if let Some(c) = container {
                r.resources.volumes = c.recovered_volumes.clone();
            }
        }
    }
}

/// What restore needs of a container, or `None` if it has no valid task id label. The list
/// entry tells everything (state, labels, ports, mounts) but the GPUs of a container the
/// upstream shim made: only those are inspected.
async fn observe(
    ctx: &RestoreContext<'_>,
    c: &ContainerSummary,
) -> Result<Option<ObservedContainer>> {
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
        None => match ctx.runtime.inspect(&c.id).await {
            Ok(d) => gpu_ids(&d),
            Err(shim_runtime::RuntimeError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(EngineError::Runtime(e)),
        },
    };
    let state = match c.state {
        ContainerState::Created => ObservedState::Created,
        ref s if s.is_running() => ObservedState::Running,
        // The exit code is the reconciler's to read (it inspects stopped containers).
        ContainerState::Exited => ObservedState::Exited { code: -1 },
        ContainerState::Dead => ObservedState::Dead,
        ref other => ObservedState::Other(other.to_string()),
    };
    let volumes_root = ctx.volumes_root;
    Ok(Some(ObservedContainer {
        id: c.id.clone(),
        name: c.name.clone(),
        task_id,
        state,
        gpu_ids,
        ports: c.ports.iter().map(|&p| PortMapping::from(p)).collect(),
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

/// The GPU ids of our label, if it is there (any vendor, fake hosts too).
fn gpu_ids_from_label(labels: &BTreeMap<String, String>) -> Option<Vec<String>> {
    labels.get(LABEL_GPUS).map(|l| {
        l.split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    })
}

/// GPU ids of a container: our label first, then what upstream maps for each vendor, as it
/// recovers them (`docker.go`, `restoreStateFromContainers`): NVIDIA's device request, AMD's
/// render nodes, Tenstorrent's `/dev/tenstorrent/<id>` devices, Intel Gaudi's
/// `HABANA_VISIBLE_DEVICES`.
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
    let amd: Vec<String> = d
        .devices
        .iter()
        .filter(|m| shim_resources::gpu::is_render_node(Path::new(&m.path_on_host)))
        .map(|m| m.path_on_host.clone())
        .collect();
    if !amd.is_empty() {
        return amd;
    }
    let tenstorrent: Vec<String> = d
        .devices
        .iter()
        .filter_map(|m| m.path_on_host.strip_prefix("/dev/tenstorrent/"))
        .filter(|id| !id.is_empty())
        .map(str::to_owned)
        .collect();
    if !tenstorrent.is_empty() {
        return tenstorrent;
    }
    d.env
        .iter()
        .find_map(|e| e.strip_prefix("HABANA_VISIBLE_DEVICES="))
        .map(|ids| {
            ids.split(',')
                .filter(|id| !id.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}
