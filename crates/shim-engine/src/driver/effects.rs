//! The effects: carrying out one action of the state machine against the container runtime,
//! the host's resources (GPU lock, authorized_keys, volumes, instance directories) and the
//! task's directory, and reporting its outcome as an event.
//!
//! The effects own the runtime (metered) and the GPU lock. They write
//! no record: what must be recorded in the middle of an action goes through the driver's
//! [`Recorder`], and the task's directory is deleted by it.
//!
//! The NVIDIA display retry and the removal of a leftover container of the same task live
//! here, and so does the check of a create or start whose answer was lost in transit (a 30 s
//! request timeout on a loaded daemon): the container made under the task's name and labels,
//! or one that started, is taken, not failed. A start whose answer is late is looked at every
//! 5 s ([`START_CHECK_EVERY`]): a container the engine shows running has started, answer or
//! not.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shim_resources::{AuthorizedKeys, GpuLock, GpuVendor, ResourcesError, VolumeManager};
use shim_runtime::{ContainerRuntime, ContainerState, HostDevices, PullRequest, RuntimeError};
use shim_task::machine::{Effect, Event};
use shim_task::{MountedVolume, PortMapping, PullProgress, Resources, TaskId};

use crate::clock::Clock;
use crate::config::EngineConfig;
use crate::deps::Deps;
use crate::error::{EngineError, Result, chain};
use crate::gpus::{GpuPassing, Passing};
use crate::home::Home;
use crate::images::{ImageGc, Pass};
use crate::labels::LABEL_TASK_ID;
use crate::ownership::Ownership;
use crate::records::{Recorder, Retried, Slot, Written};
use crate::spec::{SpecContext, container_spec};
use crate::table::TaskTable;

/// How long a start may go unanswered before the engine is asked whether the container runs,
/// and again after each such look ([`Effects::start_checked`]).
const START_CHECK_EVERY: Duration = Duration::from_secs(5);

/// What the effects are made of (the engine's parts they act on).
pub(crate) struct EffectParts {
    /// The engine's configuration.
    pub(crate) cfg: EngineConfig,
    /// This home's owner identity.
    pub(crate) owner: String,
    /// The host's resources and the container engine.
    pub(crate) deps: Deps,
    /// The tasks.
    pub(crate) table: Arc<TaskTable>,
    /// The store as everyone but the records sees it.
    pub(crate) home: Home,
    /// Which containers are this home's.
    pub(crate) ownership: Ownership,
    /// The image ledger and collection.
    pub(crate) images: Arc<ImageGc>,
}

/// What carries out the state machine's effects (see the module docs).
pub(super) struct Effects {
    cfg: EngineConfig,
    owner: String,
    runtime: Arc<dyn ContainerRuntime>,
    /// The GPU lock over the host's GPUs (memory only: a new process starts with none).
    gpus: Arc<GpuLock>,
    gpu_vendor: Option<GpuVendor>,
    fake_gpus: bool,
    /// Fixed host device facts; `None`: looked at each create.
    host_devices: Option<HostDevices>,
    keys: Arc<dyn AuthorizedKeys>,
    volumes: Arc<dyn VolumeManager>,
    /// Where a removed task is forgotten.
    table: Arc<TaskTable>,
    home: Home,
    ownership: Ownership,
    /// What was pulled, and the room made for pulls.
    images: Arc<ImageGc>,
    /// What pull progress is stamped with.
    clock: Clock,
    /// How GPUs reach containers.
    gpu_passing: Arc<GpuPassing>,
    /// One lock per volume mount point, held by a task's write-ahead and mount, and by a
    /// release's look at the other tasks and its unmount: a volume two tasks name stays
    /// mounted until the last of them lets it go.
    volume_holds: shim_util::KeyedLocks<String>,
    /// The tasks whose container a remove is force-removing now: their release is out (it
    /// follows the removal), but their container may run until the removal returns.
    removing: Mutex<HashSet<TaskId>>,
}

impl Effects {
    /// The effects of an engine configured by `cfg`, on `deps` (whose runtime is the one every
    /// request goes through), locking the GPUs of `deps.host_gpus`.
    pub(super) fn new(parts: EffectParts) -> Self {
        let EffectParts {
            cfg,
            owner,
            deps,
            table,
            home,
            ownership,
            images,
        } = parts;
        let gpu_passing = Arc::new(GpuPassing::new(
            cfg.gpu_device_mode,
            deps.host_gpus.clone(),
            deps.runtime.clone(),
        ));
        Self {
            cfg,
            owner,
            gpu_passing,
            gpus: Arc::new(GpuLock::for_host(&deps.host_gpus)),
            runtime: deps.runtime,
            gpu_vendor: deps.host_gpus.vendor,
            fake_gpus: deps.fake_gpus,
            host_devices: deps.host_devices,
            keys: deps.keys,
            volumes: deps.volumes,
            table,
            home,
            ownership,
            images,
            clock: deps.clock,
            volume_holds: shim_util::KeyedLocks::default(),
            removing: Mutex::default(),
        }
    }

    /// Whether a task other than `id` holds the volume mounted at `mount_point`: it records
    /// the volume (ahead of its mount or after it) and its own release is not out, or its
    /// container is being removed. A task whose release is out has a stopped container (a
    /// release waits for the stop) or, on a remove, one being force-removed, which may run
    /// until the removal returns (a container stuck in the kernel holds it up, and it may
    /// fail); any other may have a container that uses the volume or will (a terminated
    /// task's stop may still be under way, or its start still creating the container).
    fn volume_held_by_another(&self, id: &TaskId, mount_point: &str) -> bool {
        let removing = self
            .removing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        self.table.slots().iter().any(|slot| {
            slot.id != *id
                && slot.read(|t| {
                    (!t.release_in_flight() || removing.contains(&slot.id))
                        && (t.record().resources.volumes.iter())
                            .any(|v| v.mount_point == mount_point)
                })
        })
    }

    /// The GPU lock (which GPUs tasks hold now).
    pub(super) fn gpus(&self) -> &Arc<GpuLock> {
        &self.gpus
    }

    /// How GPUs reach containers (the room).
    pub(super) fn gpu_passing(&self) -> &Arc<GpuPassing> {
        &self.gpu_passing
    }

    /// How the GPUs of `task` go to its container now (decided only for a task that has GPUs
    /// to pass).
    async fn passing_for(&self, task: &shim_task::machine::Task) -> Passing {
        if task.record().resources.gpus.is_empty() || self.fake_gpus {
            return Passing::Legacy;
        }
        self.gpu_passing.current().await
    }

    fn spec_context<'a>(&'a self, passing: &'a Passing) -> SpecContext<'a> {
        SpecContext {
            cfg: &self.cfg,
            owner: &self.owner,
            home: &self.home,
            volumes: self.volumes.as_ref(),
            gpu_vendor: self.gpu_vendor,
            fake_gpus: self.fake_gpus,
            // Two `stat`s of device paths (devtmpfs: nothing to wait for).
            host_devices: self.host_devices.unwrap_or_else(HostDevices::probe),
            passing,
        }
    }
}

impl Effects {
    /// Carries out `effect` for the task in `slot`. Returns the outcome event, if the effect
    /// has one. An error stops the driver (the caller decides what that means for the task).
    /// What must be recorded in the middle of the effect goes through `recorder`.
    pub(super) async fn execute(
        &self,
        slot: &Arc<Slot>,
        effect: Effect,
        recorder: &Recorder<'_>,
    ) -> Result<Option<Event>> {
        let id = slot.id.clone();
        tracing::debug!(task = %id, ?effect, "effect");
        Ok(match effect {
            Effect::AcquireGpus { count } => Some(match self.gpus.acquire(count) {
                Ok(ids) => Event::GpusAcquired(ids),
                Err(e) => Event::PrepareFailed {
                    message: format!("cannot acquire GPUs: {}", chain(&e)),
                },
            }),
            Effect::AddHostKeys(grant) => {
                Some(match self.keys.add(&id, &grant.user, &grant.keys).await {
                    Ok(()) => Event::HostKeysAdded(grant),
                    Err(e) => Event::PrepareFailed {
                        message: format!(
                            "cannot add SSH keys for host user {:?}: {}",
                            grant.user,
                            chain(&e)
                        ),
                    },
                })
            }
            Effect::MountVolume(spec) => {
                let mount_point = self.volumes.mount_point(spec.name.as_str());
                let _hold = (self.volume_holds)
                    .lock(mount_point.to_string_lossy().into_owned())
                    .await;
                // Write-ahead: the volume is recorded (and persisted) before it is mounted.
                let ahead = MountedVolume {
                    name: spec.name.to_string(),
                    mount_point: self
                        .volumes
                        .mount_point(spec.name.as_str())
                        .to_string_lossy()
                        .into_owned(),
                    device: String::new(),
                };
                if let Written::Failed(e) = recorder.volume_mounting(ahead).await? {
                    // Not recorded ahead: never mounted.
                    return Ok(Some(Event::PrepareFailed {
                        message: format!(
                            "cannot record volume {:?} before mounting it: {}",
                            spec.name.as_str(),
                            chain(&e)
                        ),
                    }));
                }
                Some(self.mount(&spec, recorder).await?)
            }
            Effect::CreateDir(path) => {
                let p = PathBuf::from(&path);
                let made =
                    tokio::task::spawn_blocking(move || shim_resources::ensure_instance_dir(&p));
                // A terminate cancels the wait (a file system that does not answer: a hung
                // NFS mount), so that the start ends and releases the task's GPUs; the
                // blocked call finishes on its own, a late directory harmless.
                let cancelled = slot.pulling.token();
                let r = tokio::select! {
                    made = made => made?,
                    () = cancelled.cancelled() => {
                        return Ok(Some(Event::PrepareFailed {
                            message: format!(
                                "terminated while instance mount directory {path:?} was being made (its file system does not answer)"
                            ),
                        }));
                    }
                };
                Some(match r {
                    Ok(true) => Event::DirCreated(path),
                    Ok(false) => Event::DirExisted(path),
                    Err(e) => Event::PrepareFailed {
                        message: format!(
                            "cannot create instance mount directory {path:?}: {}",
                            chain(&e)
                        ),
                    },
                })
            }
            Effect::Pull { image } => Some(self.pull(slot, image, recorder).await),
            Effect::CancelPull => {
                slot.pulling.cancel();
                None
            }
            Effect::CreateContainer => Some(match self.create(slot).await {
                Ok(container_id) => Event::ContainerCreated { container_id },
                Err(e) => Event::CreateFailed {
                    message: format!("cannot create container: {}", chain(&e)),
                },
            }),
            Effect::StartContainer => Some(match self.start_container(slot, recorder).await {
                Ok(ports) => Event::ContainerStarted { ports },
                Err(StartError::Failed(message)) => Event::StartFailed { message },
                Err(StartError::Refused(message)) => Event::StartRefused { message },
            }),
            Effect::StopContainer { timeout_s } => {
                let stopped = match self.own_container(slot).await {
                    Ok(Some(cid)) => {
                        let stop = self.runtime.stop(&cid, Duration::from_secs(timeout_s));
                        stop.await.map(|()| cid)
                    }
                    Ok(None) => Ok(String::new()),
                    Err(e) => Err(e),
                };
                let cid = container_ref(slot);
                match stopped {
                    Ok(_) | Err(RuntimeError::NotFound { .. }) => Some(Event::ContainerStopped),
                    Err(e) => {
                        let message = chain(&e);
                        if slot.failed_loudly(Retried::Container, &message) {
                            tracing::warn!(task = %id, container = %cid, error = %message, "stop failed; retried (the same failure is logged again in 10 minutes)");
                        } else {
                            tracing::debug!(task = %id, container = %cid, error = %message, "stop failed; retried");
                        }
                        Some(Event::StopFailed { message })
                    }
                }
            }
            Effect::Release(resources) => Some(self.release(slot, resources).await),
            Effect::RemoveContainer => {
                let _removing = Removing::start(&self.removing, &id);
                if let Some(cid) = self.own_container(slot).await? {
                    self.runtime.remove(&cid).await?;
                }
                None
            }
            Effect::Forget => {
                if self.table.remove_slot(slot) {
                    recorder.removed();
                    tracing::info!(task = %id, "task removed");
                }
                None
            }
            // The driver stamps the start's end when it steps this.
            Effect::FinishStart => Some(Event::StartFinished),
            Effect::LockGpus(ids) => Some(Event::GpusRelocked(self.gpus.lock(&ids))),
        })
    }
}

impl Effects {
    async fn mount(&self, spec: &shim_task::VolumeSpec, recorder: &Recorder<'_>) -> Result<Event> {
        let prepared = self.volumes.prepare(spec).await;
        if let Err(ResourcesError::MountedElsewhere {
            mount_point,
            device,
            ..
        }) = &prepared
        {
            // Nothing of this task's is mounted there: the record ahead names the volume's
            // device, so that its release leaves what is mounted there alone.
            let named = MountedVolume {
                name: spec.name.to_string(),
                mount_point: mount_point.to_string_lossy().into_owned(),
                device: device.to_string_lossy().into_owned(),
            };
            if let Written::Failed(e) = recorder.volume_mounting(named).await? {
                tracing::warn!(volume = %spec.name, error = %chain(&e), "cannot record the device of a volume whose mount point holds another file system; its release may unmount that file system");
            }
        }
        Ok(match prepared {
            Ok(v) => Event::VolumeMounted(v),
            Err(e) => Event::PrepareFailed {
                message: format!(
                    "cannot prepare volume {:?}: {}",
                    spec.name.as_str(),
                    chain(&e)
                ),
            },
        })
    }

    /// The pull step, the one place an image is pulled (SPEC §4): a `:latest` image is always
    /// pulled, `:latest-gpu` and the like too ([`always_pulled`], as upstream does); another is pulled only when the engine does not have it
    /// (asked, unless the images room saw it present since the engine last reported an image
    /// removal: [`ImageGc::known_present`]), so an image removed since it was last used (an
    /// operator's prune, image collection) is pulled here again, in the open: the task reads
    /// `pulling` with progress, the stall watch and the fit check apply, and terminate cancels
    /// it.
    async fn pull(&self, slot: &Arc<Slot>, image: String, recorder: &Recorder<'_>) -> Event {
        let runtime = &self.runtime;
        let image = shim_runtime::with_default_tag(&image);
        // Not while image collection removes this image: neither decided present nor pulled
        // (a `:latest` one too) before the removal ends.
        self.images.presence(&image).await;
        if !always_pulled(&image) {
            if self.images.known_present(&image) {
                return Event::PullSkipped;
            }
            match runtime.image_present(&image).await {
                Ok(true) => {
                    self.images.seen_present(&image);
                    return Event::PullSkipped;
                }
                Ok(false) => {}
                Err(e) => {
                    return Event::PullFailed {
                        message: format!("cannot check image {image}: {}", chain(&e)),
                    };
                }
            }
        }
        // An absent image's name is in the ledger before the pull, so that a kill right after
        // it does not leave an image this shim pulled out of the ledger for good.
        let announced = !always_pulled(&image);
        if announced {
            self.images.pulling(&image).await;
        }
        // A real pull may take minutes: `pulling` is made durable, and so shown, before it
        // begins.
        recorder.pulling().await;
        // The disk above its high mark is collected before the pull adds to it (by the pass
        // under way, if one is: the pull does not wait for its removals).
        let before = self.images.collect_unless_under_way().await;
        let pulled = self.pull_image(slot, &image, &before, recorder).await;
        if pulled.is_ok() {
            self.images.pulled(&image).await;
        }
        if announced {
            self.images.pull_ended(&image, pulled.is_ok()).await;
        }
        match pulled {
            Ok(p) => {
                self.images.seen_present(&image);
                // What the pull added may have taken the disk over its high mark.
                let images = self.images.clone();
                tokio::spawn(async move {
                    images.collect(0).await;
                });
                Event::PullDone(p)
            }
            Err(e) => Event::PullFailed { message: e },
        }
    }

    /// Pulls `image` for the task: its credentials, its pull log, its cancellation, progress
    /// into its view, and room on the disk for what its layers announce (the pull fails at
    /// once, with the numbers, when there is none: see [`ImageGc::make_room`]). The error is
    /// the message for the task.
    /// `before`: the pass made before the pull (what it removed counts in the message). A
    /// stall is told to subscribers through `recorder`.
    async fn pull_image(
        &self,
        slot: &Arc<Slot>,
        image: &str,
        before: &Pass,
        recorder: &Recorder<'_>,
    ) -> Result<PullProgress, String> {
        let (removed_before, freed_before) = (before.removed.len(), before.freed);
        let cancel = slot.pulling.token();
        let need = Arc::new(AtomicU64::new(0));
        let announced = Arc::new(tokio::sync::Notify::new());
        let no_room: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        let watch = {
            let (need, announced, no_room, cancel) = (
                need.clone(),
                announced.clone(),
                no_room.clone(),
                cancel.clone(),
            );
            let images = self.images.clone();
            async move {
                let mut checked = 0u64;
                loop {
                    announced.notified().await;
                    let bytes = need.load(Ordering::Relaxed);
                    // Only a need larger than the one last found room for is looked at again.
                    if bytes <= checked {
                        continue;
                    }
                    checked = bytes;
                    // A pass of its own, run to its end even when the pull ends first and this
                    // watcher is dropped: cut in the middle of a removal, it would unmark the
                    // names it removes while the engine still deletes the image.
                    let pass = tokio::spawn({
                        let images = images.clone();
                        async move { images.make_room(bytes).await }
                    });
                    if let Ok(Err(mut e)) = pass.await {
                        e.removed += removed_before;
                        e.freed += freed_before;
                        *no_room.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                        cancel.cancel();
                        return;
                    }
                }
            }
        };
        let pulled = {
            let need = need.clone();
            let (progress_slot, clock) = (slot.clone(), self.clock);
            let progress = move |p: PullProgress| {
                progress_slot.pull_progressed(p, clock.now_ms());
                let remaining = p.total_bytes.saturating_sub(p.downloaded_bytes);
                if remaining > need.load(Ordering::Relaxed) {
                    need.store(remaining, Ordering::Relaxed);
                    announced.notify_one();
                }
            };
            let pull = self.pull_request(slot, image, &progress, cancel);
            tokio::pin!(pull);
            tokio::select! {
                r = &mut pull => r,
                // No room: the watcher cancelled the pull, which ends promptly.
                () = watch => pull.await,
            }
        };
        match pulled {
            Ok(p) => Ok(p),
            Err(e) => {
                let no_room = no_room.lock().unwrap_or_else(|p| p.into_inner()).take();
                recorder.pull_stalled(&e);
                Err(match no_room {
                    Some(why) => format!("cannot pull image {image}: {why}"),
                    None => chain(&e),
                })
            }
        }
    }

    /// The pull request itself (see [`Effects::pull_image`]).
    async fn pull_request(
        &self,
        slot: &Arc<Slot>,
        image: &str,
        progress: shim_runtime::ProgressFn<'_>,
        cancel: tokio_util::sync::CancellationToken,
    ) -> shim_runtime::Result<PullProgress> {
        let runtime = &self.runtime;
        let log_path = self
            .home
            .paths(&slot.container_name)
            .ok()
            .map(|p| p.pull_log);
        let request = PullRequest::new(image)
            .with_auth(slot.pulling.auth())
            .with_log_path(log_path)
            .with_timeout(self.cfg.pull_timeout)
            .with_stall_timeout(self.cfg.pull_stall_timeout)
            .with_disk_probe(self.images.disk_probe().await);
        tracing::info!(task = %slot.id, %image, "pulling image");
        runtime.pull(&request, progress, cancel).await
    }

    async fn create(&self, slot: &Arc<Slot>) -> Result<String> {
        let task = slot.snapshot();
        let passing = self.passing_for(&task).await;
        let spec = container_spec(&self.spec_context(&passing), &task)?;
        self.images.used(&spec.image);
        // A container left with our name by an earlier attempt of this very task (the shim
        // stopped between create and recording it) would make create fail: remove it if it
        // carries this task's labels.
        match self.runtime.create(&spec).await {
            Err(RuntimeError::Conflict { .. })
                if self.is_own_leftover(&spec.name, &slot.id).await =>
            {
                self.runtime.remove(&spec.name).await?;
                Ok(self.runtime.create(&spec).await?)
            }
            // The pull step found the image and it is gone now: removed in the moment between
            // (an operator's prune, whose event had not arrived yet). Pulling it here would
            // pull outside the pull step (no `pulling`, no progress, no cancel); the task ends
            // with the reason instead, and the next start asks the engine again.
            Err(RuntimeError::NotFound { .. }) => {
                self.images.image_removed(&spec.image);
                Err(EngineError::ImageVanished {
                    image: spec.image.clone(),
                })
            }
            // The answer was lost in transit (a timeout on a loaded daemon): the container may
            // exist all the same, under this task's name and labels.
            Err(e @ RuntimeError::DaemonUnavailable { .. }) => {
                match self.own_container_id(&spec.name, &slot.id).await {
                    Some(cid) => {
                        tracing::warn!(task = %slot.id, error = %chain(&e), "the create's answer was lost, but the container exists: going on");
                        Ok(cid)
                    }
                    None => Err(e.into()),
                }
            }
            other => Ok(other?),
        }
    }

    async fn is_own_leftover(&self, name: &str, id: &TaskId) -> bool {
        self.own_container_id(name, id).await.is_some()
    }

    /// The container to stop or remove for `slot`: the id its record has; without one (a
    /// create whose answer was lost, or refused for a name in use), the container of its
    /// name only if that one is this shim's and the task's ([`Effects::own_container_id`]), never
    /// another home's of the same name; `None`: no such container. A look that fails is the
    /// error (retried).
    async fn own_container(&self, slot: &Slot) -> Result<Option<String>, RuntimeError> {
        let (recorded, name) = slot.read(|t| {
            let record = t.record();
            (record.container_id.clone(), record.container_name.clone())
        });
        if let Some(id) = recorded {
            return Ok(Some(id));
        }
        let d = match self.runtime.inspect(&name).await {
            Ok(d) => d,
            Err(RuntimeError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let task = d.labels.get(LABEL_TASK_ID).map(String::as_str) == Some(slot.id.as_str());
        Ok((task && self.ownership.owns(&d.mounts).await).then_some(d.id))
    }

    /// The id of the container named `name` if it is this shim's (its runner mount lies in
    /// this home: [`crate::labels`]) and carries task `id`'s label.
    async fn own_container_id(&self, name: &str, id: &TaskId) -> Option<String> {
        let d = self.runtime.inspect(name).await.ok()?;
        let task = d.labels.get(LABEL_TASK_ID).map(String::as_str) == Some(id.as_str());
        (task && self.ownership.owns(&d.mounts).await).then_some(d.id)
    }

    /// Starts the container and reads its published ports. On an NVIDIA host, a start that
    /// fails on `/dev/nvidia-modeset` is retried once without the `display` capability.
    async fn start_container(
        &self,
        slot: &Arc<Slot>,
        recorder: &Recorder<'_>,
    ) -> Result<Vec<PortMapping>, StartError> {
        let runtime = &self.runtime;
        // The id the create recorded (the name would do too, and is what a record without an
        // id has).
        let mut cid = container_ref(slot);
        let mut started = self.start_checked(&slot.id, &cid).await;
        if let Err(e @ RuntimeError::DaemonUnavailable { .. }) = &started
            && self.started_anyway(&cid).await
        {
            tracing::warn!(task = %slot.id, error = %chain(e), "the start's answer was lost, but the container started: going on");
            started = Ok(());
        }
        if let Err(e) = started {
            let message = chain(&e);
            let task = slot.snapshot();
            let passing = self.passing_for(&task).await;
            let spec = container_spec(&self.spec_context(&passing), &task).ok();
            let retry = spec
                .as_ref()
                .and_then(|spec| shim_runtime::without_nvidia_display(spec, &message));
            let Some(spec) = retry else {
                if spec.is_some_and(|s| !s.device_requests.is_empty() || !s.devices.is_empty())
                    && is_device_refusal(&message)
                {
                    return Err(StartError::Refused(message));
                }
                return Err(StartError::Failed(self.start_failure(&cid, &message).await));
            };
            tracing::warn!(task = %slot.id, "start failed on nvidia-modeset; retrying without the display capability");
            runtime.remove(&cid).await.map_err(|e| {
                StartError::Failed(format!("remove container before retry: {}", chain(&e)))
            })?;
            cid = runtime.create(&spec).await.map_err(|e| {
                StartError::Failed(format!(
                    "cannot recreate container without display: {}",
                    chain(&e)
                ))
            })?;
            // The record's one writer is the state machine: the new id goes through it, and
            // is durable before the container starts.
            match recorder.container_recreated(cid.clone()).await {
                Ok(Written::Durable) => {}
                Ok(Written::Failed(e)) | Err(e) => {
                    return Err(StartError::Failed(format!(
                        "cannot record the recreated container: {}",
                        chain(&e)
                    )));
                }
            }
            if let Err(e) = runtime.start(&cid).await {
                let message = chain(&e);
                if is_device_refusal(&message) {
                    return Err(StartError::Refused(message));
                }
                return Err(StartError::Failed(self.start_failure(&cid, &message).await));
            }
        }
        let host_network = slot.read(|t| {
            t.record()
                .config
                .as_ref()
                .is_none_or(|c| c.network_mode == shim_task::NetworkMode::Host)
        });
        if host_network {
            // Nothing is published in the host's network: no inspect needed.
            return Ok(Vec::new());
        }
        // Docker picks the ephemeral host ports at start: read them back.
        let details = runtime.inspect(&cid).await.map_err(|e| {
            StartError::Failed(format!(
                "container started but cannot be inspected: {}",
                chain(&e)
            ))
        })?;
        Ok(details
            .ports
            .iter()
            .map(|&p| PortMapping::from(p))
            .collect())
    }

    /// Starts the container, and while the answer is late looks every
    /// [`START_CHECK_EVERY`] whether the engine shows the container running: if it does, the
    /// container started, whatever became of the answer, and the start goes on without it
    /// (the request is dropped). A start that answers, in time or late, is the answer.
    ///
    /// Seen on Docker 28.5 (containerd store): three starts in about 150,000 whose answer did not
    /// come within the request's 30 s bound although the container was running, which made
    /// that task's start 30 s long. On Docker an inspect waits for a start in progress (the
    /// daemon holds the container's lock), so a slow start is simply waited for; an engine
    /// that answers at once (Podman) shows it not yet running, and the start is awaited on.
    async fn start_checked(&self, id: &TaskId, cid: &str) -> Result<(), RuntimeError> {
        let start = self.runtime.start(cid);
        tokio::pin!(start);
        loop {
            tokio::select! {
                answer = &mut start => return answer,
                () = tokio::time::sleep(START_CHECK_EVERY) => {}
            }
            let running = tokio::select! {
                answer = &mut start => return answer,
                details = self.runtime.inspect(cid) => details.is_ok_and(|d| d.state.is_running()),
            };
            if running {
                tracing::warn!(task = %id, after = ?START_CHECK_EVERY, "the start has not answered, but the container runs: going on");
                return Ok(());
            }
        }
    }

    /// Whether a container whose start request failed in transit (a timeout on a loaded
    /// daemon, a dropped connection) started nonetheless: an inspect waits for a start still
    /// in progress (the daemon holds the container's lock), then tells. Upstream's start has
    /// no timeout at all; this one has, so it must not turn a slow start into a failure.
    async fn started_anyway(&self, cid: &str) -> bool {
        match self.runtime.inspect(cid).await {
            Ok(d) => d.state.is_running() || d.state == ContainerState::Exited,
            Err(_) => false,
        }
    }

    async fn start_failure(&self, cid: &str, error: &str) -> String {
        match self.runtime.logs_tail(cid, self.cfg.exit_log_lines).await {
            Ok(lines) if !lines.is_empty() => format!("{error}\n{}", lines.join("\n")),
            _ => error.to_owned(),
        }
    }

    /// Releases exactly `resources`; reports what was released (partial success allowed).
    async fn release(&self, slot: &Arc<Slot>, resources: Resources) -> Event {
        let id = &slot.id;
        let mut errors = Vec::new();
        self.gpus.release(&resources.gpus);
        let mut host_keys = false;
        if let Some(grant) = &resources.host_keys {
            let removed = if grant.upstream {
                self.keys
                    .remove_upstream(id, &grant.user, &grant.keys)
                    .await
            } else {
                self.keys.remove(id, &grant.user, &grant.keys).await
            };
            match removed {
                Ok(()) => host_keys = true,
                Err(e) => errors.push(format!("SSH keys of {:?}: {}", grant.user, chain(&e))),
            }
        }
        // Dropping the hold on unknown-origin key lines lets that user's file be pruned of
        // them (SPEC §7): `remove` with no keys forgets the hold and rewrites the file.
        let mut unknown_keys = false;
        if let Some(hold) = &resources.unknown_keys {
            let user = hold.user.as_deref().unwrap_or("");
            match self.keys.remove(id, user, &[]).await {
                Ok(()) => unknown_keys = true,
                Err(e) => errors.push(format!(
                    "unknown-origin SSH keys of {user:?}: {}",
                    chain(&e)
                )),
            }
        }
        let mut volumes = Vec::new();
        for v in &resources.volumes {
            let _hold = self.volume_holds.lock(v.mount_point.clone()).await;
            if self.volume_held_by_another(id, &v.mount_point) {
                tracing::info!(task = %id, volume = %v.name, mount_point = %v.mount_point,
                    "another task holds the volume: left mounted for it");
                volumes.push(v.name.clone());
                continue;
            }
            match self.volumes.release(v).await {
                Ok(()) => volumes.push(v.name.clone()),
                Err(e) => errors.push(format!("volume {:?}: {}", v.name, chain(&e))),
            }
        }
        if errors.is_empty() {
            tracing::info!(task = %id, "resources released");
        } else if slot.failed_loudly(Retried::Release, &errors.join("; ")) {
            tracing::warn!(task = %id, errors = ?errors, "release incomplete; will retry (the same failure is logged again in 10 minutes)");
        } else {
            tracing::debug!(task = %id, errors = ?errors, "release incomplete; will retry");
        }
        let any = !resources.gpus.is_empty() || host_keys || !volumes.is_empty() || unknown_keys;
        if !errors.is_empty() && !any {
            Event::ReleaseFailed {
                message: errors.join("; "),
            }
        } else {
            Event::Released {
                gpus: resources.gpus,
                host_keys,
                volumes,
                unknown_keys,
            }
        }
    }
}

/// Why a start failed: the container's own failure (its last log lines or the error), or the
/// engine's refusal of what it was created with, its devices.
enum StartError {
    Failed(String),
    Refused(String),
}

/// Whether a start error is the engine refusing the container's devices, not anything the
/// container did: Docker 28's "CDI device injection failed: unresolvable CDI devices …" (the
/// spec names no such device), Docker's "could not select device driver \"nvidia\"" (no
/// NVIDIA runtime hook on the host), runc's "error gathering device information while adding
/// custom device" (a mapped device missing on the host), Podman's CDI errors. Engines answer all of these with a
/// bare 500, so the words are all there is to tell them by (recorded on Docker 28.5 here).
fn is_device_refusal(message: &str) -> bool {
    [
        "CDI device injection failed",
        "error gathering device information",
        "unresolvable CDI devices",
        "could not select device driver",
        "failed to inject CDI devices",
        "error injecting CDI devices",
    ]
    .iter()
    .any(|words| message.contains(words))
}

/// The container id if known, else its name (the name is fixed at submit).
fn container_ref(slot: &Slot) -> String {
    slot.read(|t| {
        let record = t.record();
        record
            .container_id
            .clone()
            .unwrap_or_else(|| record.container_name.clone())
    })
}

/// Whether `image` (its tag made explicit) is pulled even when present: its name contains
/// `:latest` (`ubuntu:latest`, `tensorflow/tensorflow:latest-gpu`), upstream's rule
/// (`runner/internal/shim/docker.go`, `strings.Contains(taskConfig.ImageName, ":latest")`):
/// a moving tag gets its newest image.
fn always_pulled(image: &str) -> bool {
    image.contains(":latest")
}

/// A task in [`Effects::removing`] while its container's removal is out (taken out again when
/// the removal returns, or its future is dropped).
struct Removing<'a> {
    set: &'a Mutex<HashSet<TaskId>>,
    id: TaskId,
}

impl<'a> Removing<'a> {
    fn start(set: &'a Mutex<HashSet<TaskId>>, id: &TaskId) -> Self {
        set.lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone());
        Self {
            set,
            id: id.clone(),
        }
    }
}

impl Drop for Removing<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}
