//! Carrying out one action of the state machine, and reporting its outcome as an event.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use shim_runtime::{ContainerState, PullRequest, RuntimeError, docker_time_ns};
use shim_task::machine::{Action, Event, Observation};
use shim_task::{MountedVolume, PortMapping, Resources};

use crate::engine::{Inner, Slot};
use crate::error::{EngineError, Result};

/// The most images [`Inner::pull`] remembers as present.
const MAX_KNOWN_IMAGES: usize = 256;

impl Inner {
    /// Executes `action` for the task in `slot`. Returns the outcome event, if the action has
    /// one. An error stops the driver (the caller decides what that means for the task).
    pub(crate) async fn execute(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        action: Action,
    ) -> Result<Option<Event>> {
        let id = slot.id.clone();
        tracing::debug!(task = %id, ?action, "action");
        Ok(match action {
            // Writes are carried out by `Inner::step`, under the step lock; a stray one asks
            // for it there.
            Action::Persist => Some(Event::PersistRequested),
            Action::AcquireGpus { count } => Some(match self.gpus.acquire(count) {
                Ok(ids) => Event::GpusAcquired(ids),
                Err(e) => Event::PrepareFailed {
                    message: format!("cannot acquire GPUs: {e}"),
                },
            }),
            Action::AddHostKeys(grant) => Some(
                match self.deps.keys.add(&id, &grant.user, &grant.keys).await {
                    Ok(()) => Event::HostKeysAdded(grant),
                    Err(e) => Event::PrepareFailed {
                        message: format!("cannot add SSH keys for host user {:?}: {e}", grant.user),
                    },
                },
            ),
            Action::MountVolume(spec) => {
                // Write-ahead: the volume is recorded (and persisted) before it is mounted.
                let ahead = MountedVolume {
                    name: spec.name.to_string(),
                    mount_point: self
                        .deps
                        .volumes
                        .mount_point(spec.name.as_str())
                        .to_string_lossy()
                        .into_owned(),
                    device: String::new(),
                };
                let (actions, failure) = self.step(slot, Event::VolumeMounting(ahead)).await?;
                if let Some(e) = failure {
                    // Not recorded ahead: never mounted.
                    return Ok(Some(Event::PrepareFailed {
                        message: format!(
                            "cannot record volume {:?} before mounting it: {}",
                            spec.name.as_str(),
                            crate::engine::chain(&e)
                        ),
                    }));
                }
                Box::pin(self.run_actions(slot, actions)).await?;
                Some(self.mount(&spec).await)
            }
            Action::CreateDir(path) => {
                let p = PathBuf::from(&path);
                let r =
                    tokio::task::spawn_blocking(move || shim_resources::ensure_instance_dir(&p))
                        .await?;
                Some(match r {
                    Ok(true) => Event::DirCreated(path),
                    Ok(false) => Event::DirExisted(path),
                    Err(e) => Event::PrepareFailed {
                        message: format!("cannot create instance mount directory {path:?}: {e}"),
                    },
                })
            }
            Action::Pull { image } => Some(self.pull(slot, image).await),
            Action::CancelPull => {
                slot.pull_cancel.cancel();
                None
            }
            Action::CreateContainer => Some(match self.create(slot).await {
                Ok(container_id) => Event::ContainerCreated { container_id },
                Err(e) => Event::CreateFailed {
                    message: format!("cannot create container: {e}"),
                },
            }),
            Action::StartContainer => Some(match self.start_container(slot).await {
                Ok(ports) => Event::ContainerStarted { ports },
                Err(message) => Event::StartFailed { message },
            }),
            Action::StopContainer { timeout_s } => {
                let cid = container_ref(slot);
                match self
                    .deps
                    .runtime
                    .stop(&cid, Duration::from_secs(timeout_s))
                    .await
                {
                    Ok(()) | Err(RuntimeError::NotFound { .. }) => Some(Event::ContainerStopped),
                    Err(e) => {
                        tracing::warn!(task = %id, container = %cid, error = %e, "stop failed");
                        Some(Event::StopFailed {
                            message: e.to_string(),
                        })
                    }
                }
            }
            Action::Release(resources) => Some(self.release(slot, resources).await),
            Action::RemoveContainer => {
                let cid = container_ref(slot);
                self.deps.runtime.remove(&cid).await?;
                None
            }
            Action::DeleteTaskDir => {
                // Renamed to a trash name first, then removed (SPEC §4).
                let held = slot.lock().record().resources.clone();
                if held.holds_any() {
                    return Err(EngineError::ReleaseIncomplete {
                        id,
                        message: describe(&held),
                    });
                }
                self.delete_dir(slot).await?;
                None
            }
            Action::Forget => {
                self.table().remove(&id);
                {
                    let _order = slot.lock();
                    self.changes.send(
                        &id,
                        crate::changes::ChangeKind::Removed,
                        crate::engine::now_ms(),
                    );
                }
                tracing::info!(task = %id, "task removed");
                None
            }
            Action::FinishStart => {
                slot.mark_start_returned();
                Some(Event::StartFinished)
            }
            Action::LockGpus(ids) => Some(Event::GpusRelocked(self.gpus.lock(&ids))),
        })
    }

    async fn mount(&self, spec: &shim_task::VolumeSpec) -> Event {
        match self.deps.volumes.prepare(spec).await {
            Ok(v) => Event::VolumeMounted(v),
            Err(e) => Event::PrepareFailed {
                message: format!("cannot prepare volume {:?}: {e}", spec.name.as_str()),
            },
        }
    }

    /// The images this engine saw present.
    fn known_images(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<String>> {
        self.known_images
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remembers that `image` is present (a bounded set: past the bound it starts over).
    fn image_seen(&self, image: &str) {
        let mut known = self.known_images();
        if known.len() >= MAX_KNOWN_IMAGES {
            known.clear();
        }
        known.insert(image.to_owned());
    }

    /// The pull step: a `:latest` image is always pulled (as upstream does); another is
    /// pulled only when it is not present. An image this engine saw present already is not
    /// checked again (one Docker request less per start); if it was removed since, the
    /// create finds out and pulls it ([`Inner::create`]).
    async fn pull(self: &Arc<Self>, slot: &Arc<Slot>, image: String) -> Event {
        let runtime = &self.deps.runtime;
        let image = shim_runtime::spec::with_default_tag(&image);
        if !image.ends_with(":latest") {
            if self.known_images().contains(&image) {
                return Event::PullSkipped;
            }
            match runtime.image_present(&image).await {
                Ok(true) => {
                    self.image_seen(&image);
                    return Event::PullSkipped;
                }
                Ok(false) => {}
                Err(e) => {
                    return Event::PullFailed {
                        message: format!("cannot check image {image}: {e}"),
                    };
                }
            }
        }
        // A real pull may take minutes: `pulling` (start progress, not written yet) is made
        // durable, and so shown, before it begins. A failed write does not stop the pull: the
        // task stays dirty and its next write (or the reconciler) carries it.
        match self.step(slot, Event::PersistRequested).await {
            Ok((actions, _)) if !actions.is_empty() => {
                if let Err(e) = Box::pin(self.run_actions(slot, actions)).await {
                    tracing::warn!(task = %slot.id, error = %crate::engine::chain(&e), "an action due before the pull failed");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(task = %slot.id, error = %crate::engine::chain(&e), "cannot record that the pull begins");
            }
        }
        match self.pull_image(slot, &image).await {
            Ok(p) => {
                if !image.ends_with(":latest") {
                    self.image_seen(&image);
                }
                Event::PullDone(p)
            }
            Err(e) => Event::PullFailed {
                message: e.to_string(),
            },
        }
    }

    /// Pulls `image` for the task: its credentials, its pull log, its cancellation, progress
    /// into its view.
    async fn pull_image(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        image: &str,
    ) -> shim_runtime::Result<shim_runtime::PullProgress> {
        let runtime = &self.deps.runtime;
        let log_path = self
            .store
            .paths(&slot.container_name)
            .ok()
            .map(|p| p.pull_log);
        let request = PullRequest {
            image: image.to_owned(),
            auth: slot.auth.clone(),
            log_path,
            timeout: self.cfg.pull_timeout,
        };
        let progress_slot = slot.clone();
        let progress = move |p: shim_runtime::PullProgress| {
            // Progress never changes the record: stepping it only updates the view.
            let _ = progress_slot.step_volatile(Event::PullProgressed(p));
        };
        tracing::info!(task = %slot.id, %image, "pulling image");
        runtime
            .pull(&request, &progress, slot.pull_cancel.clone())
            .await
    }

    async fn create(self: &Arc<Self>, slot: &Arc<Slot>) -> Result<String> {
        let task = slot.snapshot();
        let spec = crate::spec::container_spec(self, &task)?;
        // A container left with our name by an earlier attempt of this very task (the shim
        // stopped between create and recording it) would make create fail: remove it if it
        // carries this task's labels.
        match self.deps.runtime.create(&spec).await {
            Err(RuntimeError::Conflict { .. })
                if self.is_own_leftover(&spec.name, &slot.id).await =>
            {
                self.deps.runtime.remove(&spec.name).await?;
                Ok(self.deps.runtime.create(&spec).await?)
            }
            // The image was present when this engine last looked and is gone now (pruned
            // behind its back): pull it, then create again.
            Err(RuntimeError::NotFound { .. }) if self.known_images().remove(&spec.image) => {
                tracing::warn!(task = %slot.id, image = %spec.image, "image gone since it was last seen; pulling it again");
                self.pull_image(slot, &spec.image).await?;
                self.image_seen(&spec.image);
                Ok(self.deps.runtime.create(&spec).await?)
            }
            // The answer was lost in transit (a timeout on a loaded daemon): the container may
            // exist all the same, under this task's name and labels.
            Err(e @ RuntimeError::DaemonUnavailable { .. }) => {
                match self.own_container_id(&spec.name, &slot.id).await {
                    Some(cid) => {
                        tracing::warn!(task = %slot.id, error = %e, "the create's answer was lost, but the container exists: going on");
                        Ok(cid)
                    }
                    None => Err(e.into()),
                }
            }
            other => Ok(other?),
        }
    }

    async fn is_own_leftover(&self, name: &str, id: &shim_task::TaskId) -> bool {
        self.own_container_id(name, id).await.is_some()
    }

    /// The id of the container named `name` if it is this shim's (its runner mount lies in
    /// this home: [`crate::labels`]) and carries task `id`'s label.
    async fn own_container_id(&self, name: &str, id: &shim_task::TaskId) -> Option<String> {
        let d = self.deps.runtime.inspect(name).await.ok()?;
        let task = d
            .labels
            .get(crate::labels::LABEL_TASK_ID)
            .map(String::as_str)
            == Some(id.as_str());
        (task && self.owns(&d.mounts).await).then_some(d.id)
    }

    /// Starts the container and reads its published ports. On an NVIDIA host, a start that
    /// fails on `/dev/nvidia-modeset` is retried once without the `display` capability.
    async fn start_container(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
    ) -> Result<Vec<PortMapping>, String> {
        let runtime = &self.deps.runtime;
        let mut cid = slot.lock().record().container_id.clone();
        let mut started = runtime.start(&cid).await;
        if let Err(e @ RuntimeError::DaemonUnavailable { .. }) = &started
            && self.started_anyway(&cid).await
        {
            tracing::warn!(task = %slot.id, error = %e, "the start's answer was lost, but the container started: going on");
            started = Ok(());
        }
        if let Err(e) = started {
            let message = e.to_string();
            let task = slot.snapshot();
            let retry = crate::spec::container_spec(self, &task)
                .ok()
                .and_then(|spec| shim_runtime::without_nvidia_display(&spec, &message));
            let Some(spec) = retry else {
                return Err(self.start_failure(&cid, &message).await);
            };
            tracing::warn!(task = %slot.id, "start failed on nvidia-modeset; retrying without the display capability");
            runtime
                .remove(&cid)
                .await
                .map_err(|e| format!("remove container before retry: {e}"))?;
            cid = runtime
                .create(&spec)
                .await
                .map_err(|e| format!("cannot recreate container without display: {e}"))?;
            // The record's one writer is the state machine: the new id goes through it, and
            // is durable before the container starts.
            let recreated = Event::ContainerRecreated {
                container_id: cid.clone(),
            };
            match self.step(slot, recreated).await {
                Ok((_, None)) => {}
                Ok((_, Some(e))) | Err(e) => {
                    return Err(format!(
                        "cannot record the recreated container: {}",
                        crate::engine::chain(&e)
                    ));
                }
            }
            if let Err(e) = runtime.start(&cid).await {
                return Err(self.start_failure(&cid, &e.to_string()).await);
            }
        }
        let host_network = slot
            .lock()
            .record()
            .config
            .as_ref()
            .is_none_or(|c| c.network_mode == shim_task::NetworkMode::Host);
        if host_network {
            // Nothing is published in the host's network: no inspect needed.
            return Ok(Vec::new());
        }
        // Docker picks the ephemeral host ports at start: read them back.
        let details = runtime
            .inspect(&cid)
            .await
            .map_err(|e| format!("container started but cannot be inspected: {e}"))?;
        Ok(details
            .ports
            .iter()
            .map(|p| PortMapping {
                host: p.host,
                container: p.container,
            })
            .collect())
    }

    /// Whether a container whose start request failed in transit (a timeout on a loaded
    /// daemon, a dropped connection) started nonetheless: an inspect waits for a start still
    /// in progress (the daemon holds the container's lock), then tells. Upstream's start has
    /// no timeout at all; this one has, so it must not turn a slow start into a failure.
    async fn started_anyway(&self, cid: &str) -> bool {
        match self.deps.runtime.inspect(cid).await {
            Ok(d) => matches!(
                d.state,
                ContainerState::Running
                    | ContainerState::Paused
                    | ContainerState::Restarting
                    | ContainerState::Exited
            ),
            Err(_) => false,
        }
    }

    async fn start_failure(&self, cid: &str, error: &str) -> String {
        match self
            .deps
            .runtime
            .logs_tail(cid, self.cfg.exit_log_lines)
            .await
        {
            Ok(lines) if !lines.is_empty() => format!("{error}\n{}", lines.join("\n")),
            _ => error.to_owned(),
        }
    }

    /// Releases exactly `resources`; reports what was released (partial success allowed).
    async fn release(self: &Arc<Self>, slot: &Arc<Slot>, resources: Resources) -> Event {
        let id = &slot.id;
        let mut errors = Vec::new();
        self.gpus.release(&resources.gpus);
        let mut host_keys = false;
        if let Some(grant) = &resources.host_keys {
            let removed = if grant.upstream {
                self.deps
                    .keys
                    .remove_upstream(id, &grant.user, &grant.keys)
                    .await
            } else {
                self.deps.keys.remove(id, &grant.user, &grant.keys).await
            };
            match removed {
                Ok(()) => host_keys = true,
                Err(e) => errors.push(format!(
                    "SSH keys of {:?}: {}",
                    grant.user,
                    crate::engine::chain(&e)
                )),
            }
        }
        // Dropping the hold on unknown-origin key lines lets that user's file be pruned of
        // them (SPEC §7): `remove` with no keys forgets the hold and rewrites the file.
        let mut unknown_keys = false;
        if let Some(hold) = &resources.unknown_keys {
            let user = hold.user.as_deref().unwrap_or("");
            match self.deps.keys.remove(id, user, &[]).await {
                Ok(()) => unknown_keys = true,
                Err(e) => errors.push(format!("unknown-origin SSH keys of {user:?}: {e}")),
            }
        }
        let mut volumes = Vec::new();
        for v in &resources.volumes {
            match self.deps.volumes.release(v).await {
                Ok(()) => volumes.push(v.name.clone()),
                Err(e) => errors.push(format!("volume {:?}: {}", v.name, crate::engine::chain(&e))),
            }
        }
        if errors.is_empty() {
            tracing::info!(task = %id, "resources released");
        } else {
            tracing::warn!(task = %id, errors = ?errors, "release incomplete; will retry");
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

    /// [`Inner::observe_stopped`], also noting when the container exited (the start of the
    /// exit → terminated latency).
    pub(crate) async fn observe_stopped_slot(
        &self,
        slot: &Slot,
        container_id: &str,
    ) -> Observation {
        let (observation, finished_ns) = self.observe_stopped_at(container_id).await;
        if let Some(ns) = finished_ns {
            slot.exit_ns.store(ns, std::sync::atomic::Ordering::SeqCst);
        }
        observation
    }

    /// What the reconciler saw of a running task's container, given its summary state.
    pub(crate) async fn observe_stopped(&self, container_id: &str) -> Observation {
        self.observe_stopped_at(container_id).await.0
    }

    async fn observe_stopped_at(&self, container_id: &str) -> (Observation, Option<i64>) {
        let d = match self.deps.runtime.inspect(container_id).await {
            Err(RuntimeError::NotFound { .. }) => return (Observation::Missing, None),
            Err(e) => {
                tracing::warn!(container = %container_id, error = %e, "inspect failed");
                return (Observation::Running, None);
            }
            Ok(d) => d,
        };
        let finished = d.finished_at.as_deref().and_then(docker_time_ns);
        (self.observation_of(container_id, d).await, finished)
    }

    async fn observation_of(
        &self,
        container_id: &str,
        d: shim_runtime::ContainerDetails,
    ) -> Observation {
        match d.state {
            shim_runtime::ContainerState::Created => Observation::NeverStarted,
            ref s if s.is_running() => Observation::Running,
            _ => {
                let code = d.exit_code.unwrap_or(-1);
                let last_lines = self
                    .deps
                    .runtime
                    .logs_tail(container_id, self.cfg.exit_log_lines)
                    .await
                    .unwrap_or_default();
                Observation::Exited {
                    code,
                    last_lines,
                    oom_killed: d.oom_killed,
                }
            }
        }
    }
}

/// The container id if known, else its name (the name is fixed at submit).
pub(crate) fn container_ref(slot: &Slot) -> String {
    let t = slot.lock();
    if t.record().container_id.is_empty() {
        t.record().container_name.clone()
    } else {
        t.record().container_id.clone()
    }
}

fn describe(r: &Resources) -> String {
    let mut parts = Vec::new();
    if !r.gpus.is_empty() {
        parts.push(format!("GPUs {:?}", r.gpus));
    }
    if let Some(k) = &r.host_keys {
        parts.push(format!("SSH keys of {:?}", k.user));
    }
    if !r.volumes.is_empty() {
        let names: Vec<&str> = r
            .volumes
            .iter()
            .map(|v: &MountedVolume| v.name.as_str())
            .collect();
        parts.push(format!("volumes {names:?}"));
    }
    parts.join(", ")
}
