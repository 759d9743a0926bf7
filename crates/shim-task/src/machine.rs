//! The task state machine: events in, the next task and the actions to carry out out.
//!
//! [`step`] is a pure function. The engine holds a [`Task`], feeds it an [`Event`] (a request,
//! the outcome of an action it carried out, or what the reconciler saw), and gets a
//! [`Transition`]: the task to keep and the [`Action`]s to carry out, in order. Every action
//! that has an outcome (see [`Action`]) is answered by stepping the matching event before the
//! next action of the same list is carried out (depth first: the actions of that step come
//! first). [`Action::Persist`] leads the list whenever the step changed the record, so the state
//! file is written before any later side effect. See the crate docs for the state diagram.
//!
//! # What the engine must do (checked by the simulated engine in `tests/properties.rs`)
//!
//! - Write the record on [`Action::Persist`] before carrying out the next action, under the
//!   same per-task ordering as the step that returned it (a terminate answers 200 only after).
//! - Step the outcome of every action that has one (see each [`Action`]) — in particular one
//!   of [`Event::Released`] / [`Event::ReleaseFailed`] for every [`Action::Release`], and
//!   [`Event::StartFinished`] whenever the start job returns, however it returns.
//! - Launch start for every [`Task::new`] task (it counts as in flight from submit on).
//! - Carry out the actions of [`restore()`](crate::restore::restore) (GPU locks first) before
//!   the reconciler's first cycle.
//! - Reconciler, every cycle, for each task whose start is not in flight: step
//!   [`Event::Observed`] (for a terminated task at least when its container runs), then
//!   [`Event::ReleaseRequested`] if [`Task::needs_release`]. Failed stops and failed releases
//!   are retried this way, never in a tight loop.
//! - Remove: carry out the list in order and stop at the first failure; a release that leaves
//!   anything held ([`Task::held`] not empty after its outcome) is a failure, so the task and
//!   its directory stay and a later remove retries.
//!
//! Known window: a crash after a volume was mounted but before the outcome's
//! [`Action::Persist`] leaves that volume unrecorded (its mount point is the engine's to
//! choose, so it cannot be recorded ahead). Host keys are recorded ahead of the add, and GPU
//! locks live in memory, so neither can leak that way; every other point of a crash is
//! covered by [`restore()`](crate::restore::restore).

use crate::config::{TaskConfig, VolumeSpec};
use crate::ids::TaskId;
use crate::info::{HostKeysGrant, MountedVolume, PortMapping, PullProgress, Resources, TaskInfo};
use crate::record::TaskRecord;
use crate::status::{TaskStatus, TerminationReason};

/// How many log lines make the message of a container that exited with an error.
pub const EXIT_MESSAGE_LINES: usize = 5;

/// The message of a task whose container was created but never started.
pub const NEVER_STARTED_MESSAGE: &str =
    "container was created but never started (the shim stopped between create and start)";

/// The message of a task whose container disappeared.
pub const VANISHED_MESSAGE: &str = "container vanished";

/// The step of start that the machine is waiting on: the action it emitted last, whose outcome
/// the next start event must report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StartStep {
    /// [`Action::AcquireGpus`] is out.
    AcquireGpus,
    /// [`Action::AddHostKeys`] is out.
    AddHostKeys,
    /// [`Action::MountVolume`] for `config.volumes[i]` is out.
    MountVolume(usize),
    /// [`Action::CreateDir`] for `config.instance_mounts[i]` is out.
    CreateDir(usize),
    /// [`Action::Pull`] is out.
    Pull,
    /// [`Action::CreateContainer`] is out.
    CreateContainer,
    /// [`Action::StartContainer`] is out.
    StartContainer,
    /// [`Action::FinishStart`] is out: start is returning.
    Finish,
}

/// Where stopping the container stands (volatile).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum StopState {
    /// No stop is pending.
    #[default]
    Idle,
    /// [`Action::StopContainer`] is out: release waits for its outcome, since the container may
    /// still use the resources.
    InFlight,
    /// The last stop failed: the container may still run, so release waits until the
    /// reconciler sees it not running, or a stop retried by the reconciler (on
    /// [`Event::Observed`] `Running` or [`Event::ReleaseRequested`]) succeeds.
    Failed,
}

/// A task in memory: the persisted record plus what only lives as long as the process.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// What is persisted (status, reason, resources...).
    pub record: TaskRecord,
    /// Start owns the task while true: nothing else may release its resources.
    pub start_in_flight: bool,
    /// Published ports: `None` until known, `[]` in host network mode.
    pub ports: Option<Vec<PortMapping>>,
    /// Image pull progress, once a pull reported any.
    pub pull_progress: Option<PullProgress>,
    /// GPU ids for [`TaskInfo`]; kept after release.
    pub gpu_ids: Option<Vec<String>>,
    /// The start step whose outcome is awaited (`None` before [`Event::StartBegan`] and after
    /// [`Event::StartFinished`]).
    pub start_step: Option<StartStep>,
    /// Where stopping the container stands.
    pub stop: StopState,
    /// An [`Action::Release`] is out and its outcome not yet stepped: no second one is emitted.
    pub release_in_flight: bool,
}

/// What the reconciler saw of a task's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// The container runs.
    Running,
    /// The container exited with `code`; `last_lines` are the last lines of its log
    /// (stdout and stderr), oldest first. Only the last [`EXIT_MESSAGE_LINES`] are kept.
    Exited {
        /// The exit code.
        code: i64,
        /// The last log lines.
        last_lines: Vec<String>,
    },
    /// The container exists but was never started.
    NeverStarted,
    /// There is no container for the task.
    Missing,
}

/// Something that happened to a task.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The start job began (the task must be pending, or already terminated: then start just
    /// finishes).
    StartBegan,
    /// Outcome of [`Action::AcquireGpus`]: these GPUs are locked for the task.
    GpusAcquired(Vec<String>),
    /// Outcome of [`Action::AddHostKeys`].
    HostKeysAdded(HostKeysGrant),
    /// Write-ahead for [`Action::MountVolume`]: the engine is about to mount this volume here.
    /// Recorded (and persisted) before the mount, so a crash during the format or the mount
    /// cannot leak it: releasing a volume that was never mounted is a no-op. Not an outcome:
    /// the step is still awaited.
    VolumeMounting(MountedVolume),
    /// Outcome of [`Action::MountVolume`].
    VolumeMounted(MountedVolume),
    /// Outcome of [`Action::CreateDir`] when the engine created the directory.
    DirCreated(String),
    /// Outcome of [`Action::CreateDir`] when the directory already existed (left alone).
    DirExisted(String),
    /// Any preparing step failed (GPUs, keys, volume, dir): `executor_error`.
    PrepareFailed {
        /// What failed, readable.
        message: String,
    },
    /// Outcome of [`Action::Pull`] when the image is present and not `:latest`.
    PullSkipped,
    /// Pull progress (any number of times while [`Action::Pull`] is out).
    PullProgressed(PullProgress),
    /// Outcome of [`Action::Pull`]: the pull completed.
    PullDone(PullProgress),
    /// Outcome of [`Action::Pull`]: the pull failed, timed out or was cancelled.
    PullFailed {
        /// What failed, incl. the bytes downloaded.
        message: String,
    },
    /// Outcome of [`Action::CreateContainer`].
    ContainerCreated {
        /// The new container's id.
        container_id: String,
    },
    /// Outcome of [`Action::CreateContainer`]: creation failed.
    CreateFailed {
        /// What failed.
        message: String,
    },
    /// Outcome of [`Action::StartContainer`]: the container runs.
    ContainerStarted {
        /// The published ports (`[]` in host network mode).
        ports: Vec<PortMapping>,
    },
    /// Outcome of [`Action::StartContainer`]: start failed.
    StartFailed {
        /// Last log lines or the error.
        message: String,
    },
    /// The start job hit an error of its own (e.g. the state file could not be written) and
    /// is returning early: `executor_error`, then [`Action::FinishStart`].
    StartAborted {
        /// What went wrong.
        message: String,
    },
    /// The start job returned (it steps this after [`Action::FinishStart`], and also when it
    /// ends any other way): start no longer owns the task.
    StartFinished,
    /// A terminate request.
    TerminateRequested {
        /// The reason, stored as given.
        reason: TerminationReason,
        /// The message, stored as given.
        message: String,
        /// Seconds Docker waits after SIGTERM before SIGKILL.
        timeout_s: u64,
    },
    /// Outcome of [`Action::StopContainer`]: the container no longer runs (a missing container
    /// counts as stopped).
    ContainerStopped,
    /// Outcome of [`Action::StopContainer`]: stopping failed.
    StopFailed {
        /// What failed.
        message: String,
    },
    /// A remove request (only for terminated tasks whose start has returned).
    RemoveRequested,
    /// The reconciler's view of the task's container (ignored while start is in flight).
    Observed(Observation),
    /// The reconciler asks for a release of what a terminated task still holds (emits
    /// [`Action::Release`] when [`Task::needs_release`]).
    ReleaseRequested,
    /// Outcome of [`Action::Release`]: what WAS released (partial success is allowed; what is
    /// not listed stays recorded and is retried on a later cycle).
    Released {
        /// Unlocked GPU ids.
        gpus: Vec<String>,
        /// The host keys were removed.
        host_keys: bool,
        /// Names of the unmounted volumes.
        volumes: Vec<String>,
    },
    /// Outcome of [`Action::Release`]: nothing more could be released now.
    ReleaseFailed {
        /// What failed.
        message: String,
    },
    /// Outcome of [`Action::LockGpus`] (restore): these GPUs are locked again.
    GpusRelocked(Vec<String>),
}

/// Something the engine must do, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Write the task's record to its state file now, before the next action. No outcome.
    Persist,
    /// Lock GPUs (`-1` all available, `0` none, `N` exactly N). Outcome:
    /// [`Event::GpusAcquired`] or [`Event::PrepareFailed`].
    AcquireGpus {
        /// As in [`TaskConfig::gpu`].
        count: i64,
    },
    /// Add keys to the user's authorized_keys, atomically (all or nothing). The grant is
    /// already recorded (write-ahead) when this is emitted. Outcome: [`Event::HostKeysAdded`]
    /// or [`Event::PrepareFailed`] (which drops the grant from the record).
    AddHostKeys(HostKeysGrant),
    /// Find, maybe format, and mount a volume. The engine first steps
    /// [`Event::VolumeMounting`] with the mount point (and persists), then mounts. Outcome:
    /// [`Event::VolumeMounted`] or [`Event::PrepareFailed`] (the recorded volume stays recorded
    /// and is released: unmounting what is not mounted is a no-op).
    MountVolume(VolumeSpec),
    /// Create an instance mount directory if missing. Outcome: [`Event::DirCreated`] (only if
    /// it really created it), [`Event::DirExisted`] or [`Event::PrepareFailed`].
    CreateDir(String),
    /// Pull the image, or skip when present and not `:latest` (the engine knows). Outcome:
    /// [`Event::PullProgressed`]*, then [`Event::PullDone`], [`Event::PullSkipped`] or
    /// [`Event::PullFailed`].
    Pull {
        /// The normalized image reference.
        image: String,
    },
    /// Cancel the pull in progress now (its outcome is still reported by the start job).
    /// No outcome of its own.
    CancelPull,
    /// Create the container. Outcome: [`Event::ContainerCreated`] or [`Event::CreateFailed`].
    CreateContainer,
    /// Start the container (the NVIDIA display retry is the engine's). Outcome:
    /// [`Event::ContainerStarted`] or [`Event::StartFailed`].
    StartContainer,
    /// Stop the container with this timeout. Outcome: [`Event::ContainerStopped`] or
    /// [`Event::StopFailed`].
    StopContainer {
        /// Seconds between SIGTERM and SIGKILL; `0` kills at once.
        timeout_s: u64,
    },
    /// Release exactly these resources (what is still held). Outcome: [`Event::Released`]
    /// and/or [`Event::ReleaseFailed`] (exactly one of them ends the release).
    Release(Resources),
    /// Force-remove the container. No outcome; on failure the engine stops carrying out the
    /// rest of the list.
    RemoveContainer,
    /// Delete the task directory (or rename it to a trash name in the same parent). No outcome.
    DeleteTaskDir,
    /// Drop the task from memory. No outcome.
    Forget,
    /// Start is done: the start job returns, then steps [`Event::StartFinished`].
    FinishStart,
    /// Restore: lock these GPUs again. Outcome: [`Event::GpusRelocked`] with the ids this call
    /// newly locked; the task keeps only those (a GPU already locked by another task is not
    /// this task's to free).
    LockGpus(Vec<String>),
}

impl Action {
    /// Whether the action has an effect outside the task's memory and state file.
    pub fn is_side_effect(&self) -> bool {
        !matches!(self, Self::Persist | Self::FinishStart | Self::Forget)
    }
}

/// The result of a step: the task to keep and what to do.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// The task after the event.
    pub task: Task,
    /// The actions, in order.
    pub actions: Vec<Action>,
}

/// A forbidden transition. The task is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// Remove of a task that is not terminated (the API answers 409).
    #[error("task {id} is {status}, not terminated: terminate it first")]
    NotTerminated {
        /// The task.
        id: TaskId,
        /// Its status.
        status: TaskStatus,
    },
    /// Remove while start still owns the task (409: retry once start has returned).
    #[error("task {id} is still being started")]
    StartInFlight {
        /// The task.
        id: TaskId,
    },
    /// Remove while a release is being carried out (409: retry).
    #[error("task {id} is releasing its resources")]
    ReleaseInFlight {
        /// The task.
        id: TaskId,
    },
    /// [`Event::StartBegan`] for a task that is not pending.
    #[error("task {id} cannot start: it is {status}")]
    NotPending {
        /// The task.
        id: TaskId,
        /// Its status.
        status: TaskStatus,
    },
    /// [`Event::StartBegan`] for a task without a config (adopted from an older shim).
    #[error("task {id} has no config")]
    NoConfig {
        /// The task.
        id: TaskId,
    },
    /// A start event that is not the outcome of the action the machine is waiting on (an
    /// engine bug).
    #[error("task {id} ({status}): unexpected {event} while waiting on {awaited:?}")]
    Unexpected {
        /// The task.
        id: TaskId,
        /// Its status.
        status: TaskStatus,
        /// The event's name.
        event: &'static str,
        /// The step awaited, if any.
        awaited: Option<StartStep>,
    },
}

impl Task {
    /// A freshly submitted pending task. Its start counts as in flight from now on: the engine
    /// launches start for every new task (and steps [`Event::StartFinished`] if it cannot).
    pub fn new(record: TaskRecord) -> Task {
        Task {
            record,
            start_in_flight: true,
            ports: None,
            pull_progress: None,
            gpu_ids: None,
            start_step: None,
            stop: StopState::Idle,
            release_in_flight: false,
        }
    }

    /// A task rebuilt from what survives a restart (start is not in flight).
    pub(crate) fn restored(record: TaskRecord) -> Task {
        Task {
            start_in_flight: false,
            ..Task::new(record)
        }
    }

    /// The task id.
    pub fn id(&self) -> &TaskId {
        &self.record.id
    }

    /// The task status.
    pub fn status(&self) -> TaskStatus {
        self.record.status
    }

    /// The API view (SPEC §3).
    pub fn info(&self) -> TaskInfo {
        let terminated = self.record.status == TaskStatus::Terminated;
        TaskInfo {
            id: self.record.id.clone(),
            status: self.record.status,
            termination_reason: match (&self.record.termination_reason, terminated) {
                (Some(reason), true) => reason.as_str().to_owned(),
                _ => String::new(),
            },
            termination_message: if terminated {
                self.record.termination_message.clone()
            } else {
                String::new()
            },
            ports: self.ports.clone(),
            image_pull_progress: self.pull_progress,
            container_name: self.record.container_name.clone(),
            container_id: self.record.container_id.clone(),
            gpu_ids: self.gpu_ids.clone(),
        }
    }

    /// What the task still holds and a release must free (created instance-mount dirs are
    /// left in place and not included).
    pub fn held(&self) -> Resources {
        let r = &self.record.resources;
        Resources {
            gpus: r.gpus.clone(),
            host_keys: r.host_keys.clone(),
            volumes: r.volumes.clone(),
            created_dirs: Vec::new(),
            released: false,
        }
    }

    /// Whether a release is due now: terminated, holding something, start not in flight, no
    /// stop in flight and no release already out. The reconciler asks this every cycle and
    /// then steps [`Event::ReleaseRequested`], which emits [`Action::Release`] — or, when the
    /// last stop failed, [`Action::StopContainer`] again first (release waits for a successful
    /// stop, since the container may still use the resources).
    pub fn needs_release(&self) -> bool {
        self.record.status == TaskStatus::Terminated
            && self.record.resources.holds_any()
            && !self.start_in_flight
            && self.stop != StopState::InFlight
            && !self.release_in_flight
    }

    fn config(&self) -> Option<&TaskConfig> {
        self.record.config.as_ref()
    }

    /// Sets `terminated` with the reason and message unless already terminated (the first
    /// reason is kept).
    fn terminate(&mut self, reason: TerminationReason, message: String) {
        if self.record.status != TaskStatus::Terminated {
            self.record.status = TaskStatus::Terminated;
            self.record.termination_reason = Some(reason);
            self.record.termination_message = message;
        }
    }

    fn terminated(&self) -> bool {
        self.record.status == TaskStatus::Terminated
    }

    fn set_status(&mut self, status: TaskStatus) {
        if status > self.record.status {
            self.record.status = status;
        }
    }

    fn unexpected(&self, event: &'static str) -> TransitionError {
        TransitionError::Unexpected {
            id: self.record.id.clone(),
            status: self.record.status,
            event,
            awaited: self.start_step,
        }
    }
}

/// The steps of start for a config, in order.
fn plan(config: &TaskConfig) -> Vec<StartStep> {
    let mut steps = vec![StartStep::AcquireGpus];
    if !config.host_keys().0.is_empty() {
        steps.push(StartStep::AddHostKeys);
    }
    steps.extend((0..config.volumes.len()).map(StartStep::MountVolume));
    steps.extend((0..config.instance_mounts.len()).map(StartStep::CreateDir));
    steps.extend([
        StartStep::Pull,
        StartStep::CreateContainer,
        StartStep::StartContainer,
        StartStep::Finish,
    ]);
    steps
}

/// Emits `step`'s action and waits on it; sets the status the step belongs to. A step the
/// config does not have (or a task without config) finishes start.
fn begin(t: &mut Task, step: StartStep, actions: &mut Vec<Action>) {
    let action = t.record.config.as_ref().and_then(|c| match step {
        StartStep::Finish => None,
        StartStep::AcquireGpus => Some(Action::AcquireGpus { count: c.gpu }),
        StartStep::AddHostKeys => Some(Action::AddHostKeys(HostKeysGrant {
            user: c.host_ssh_user.clone(),
            keys: c.host_keys().0,
        })),
        StartStep::MountVolume(i) => c.volumes.get(i).cloned().map(Action::MountVolume),
        StartStep::CreateDir(i) => c
            .instance_mounts
            .get(i)
            .map(|m| Action::CreateDir(m.instance_path.clone())),
        StartStep::Pull => Some(Action::Pull {
            image: c.image_ref(),
        }),
        StartStep::CreateContainer => Some(Action::CreateContainer),
        StartStep::StartContainer => Some(Action::StartContainer),
    });
    match action {
        Some(action) => {
            match (step, &action) {
                (StartStep::Pull, _) => t.set_status(TaskStatus::Pulling),
                (StartStep::CreateContainer, _) => t.set_status(TaskStatus::Creating),
                (StartStep::AddHostKeys, Action::AddHostKeys(grant)) => {
                    // Recorded ahead (and persisted before the add): a crash during the add
                    // cannot leak the keys, and removing a task's keys that were never added
                    // is a no-op.
                    t.record.resources.host_keys = Some(grant.clone());
                }
                _ => {}
            }
            t.start_step = Some(step);
            actions.push(action);
        }
        None => {
            t.start_step = Some(StartStep::Finish);
            actions.push(Action::FinishStart);
        }
    }
}

/// The outcome of the awaited step arrived: go on with the next step, or finish when the task
/// was terminated meanwhile (start stops at its next step).
fn advance(t: &mut Task, actions: &mut Vec<Action>) {
    let next = match (t.terminated(), t.start_step, t.config()) {
        (false, Some(current), Some(config)) => {
            let steps = plan(config);
            steps
                .iter()
                .position(|s| *s == current)
                .and_then(|i| steps.get(i + 1).copied())
                .unwrap_or(StartStep::Finish)
        }
        _ => StartStep::Finish,
    };
    begin(t, next, actions);
}

/// Checks that `event` is the outcome of the awaited step (`ok` says which steps match).
fn expect(
    t: &Task,
    event: &'static str,
    ok: impl Fn(StartStep) -> bool,
) -> Result<(), TransitionError> {
    match t.start_step {
        Some(s) if t.start_in_flight && ok(s) => Ok(()),
        _ => Err(t.unexpected(event)),
    }
}

fn event_name(e: &Event) -> &'static str {
    match e {
        Event::StartBegan => "StartBegan",
        Event::GpusAcquired(_) => "GpusAcquired",
        Event::HostKeysAdded(_) => "HostKeysAdded",
        Event::VolumeMounting(_) => "VolumeMounting",
        Event::VolumeMounted(_) => "VolumeMounted",
        Event::DirCreated(_) => "DirCreated",
        Event::DirExisted(_) => "DirExisted",
        Event::PrepareFailed { .. } => "PrepareFailed",
        Event::PullSkipped => "PullSkipped",
        Event::PullProgressed(_) => "PullProgressed",
        Event::PullDone(_) => "PullDone",
        Event::PullFailed { .. } => "PullFailed",
        Event::ContainerCreated { .. } => "ContainerCreated",
        Event::CreateFailed { .. } => "CreateFailed",
        Event::ContainerStarted { .. } => "ContainerStarted",
        Event::StartFailed { .. } => "StartFailed",
        Event::StartAborted { .. } => "StartAborted",
        Event::StartFinished => "StartFinished",
        Event::TerminateRequested { .. } => "TerminateRequested",
        Event::ContainerStopped => "ContainerStopped",
        Event::StopFailed { .. } => "StopFailed",
        Event::RemoveRequested => "RemoveRequested",
        Event::Observed(_) => "Observed",
        Event::ReleaseRequested => "ReleaseRequested",
        Event::Released { .. } => "Released",
        Event::ReleaseFailed { .. } => "ReleaseFailed",
        Event::GpusRelocked(_) => "GpusRelocked",
    }
}

fn is_preparing(s: StartStep) -> bool {
    matches!(
        s,
        StartStep::AcquireGpus
            | StartStep::AddHostKeys
            | StartStep::MountVolume(_)
            | StartStep::CreateDir(_)
    )
}

/// The message of a container that exited with an error: its last log lines.
pub fn exit_message(code: i64, last_lines: &[String]) -> String {
    let start = last_lines.len().saturating_sub(EXIT_MESSAGE_LINES);
    match last_lines.get(start..) {
        Some(lines) if !lines.is_empty() => lines.join("\n"),
        _ => format!("container exited with code {code}"),
    }
}

/// Applies one event. `settle` is cleared for events after which no release may be emitted
/// automatically (the release outcomes: a failed release is retried on the next cycle).
fn apply(
    t: &mut Task,
    event: Event,
    actions: &mut Vec<Action>,
    settle: &mut bool,
) -> Result<(), TransitionError> {
    let name = event_name(&event);
    match event {
        Event::StartBegan => {
            if !t.start_in_flight || t.start_step.is_some() {
                return Err(t.unexpected(name));
            }
            if t.terminated() {
                begin(t, StartStep::Finish, actions);
                return Ok(());
            }
            if t.record.status != TaskStatus::Pending {
                return Err(TransitionError::NotPending {
                    id: t.record.id.clone(),
                    status: t.record.status,
                });
            }
            if t.config().is_none() {
                return Err(TransitionError::NoConfig {
                    id: t.record.id.clone(),
                });
            }
            t.set_status(TaskStatus::Preparing);
            begin(t, StartStep::AcquireGpus, actions);
        }
        Event::GpusAcquired(ids) => {
            expect(t, name, |s| s == StartStep::AcquireGpus)?;
            for id in &ids {
                if !t.record.resources.gpus.contains(id) {
                    t.record.resources.gpus.push(id.clone());
                }
            }
            t.gpu_ids = Some(ids);
            advance(t, actions);
        }
        Event::HostKeysAdded(grant) => {
            expect(t, name, |s| s == StartStep::AddHostKeys)?;
            t.record.resources.host_keys = Some(grant);
            advance(t, actions);
        }
        Event::VolumeMounting(volume) => {
            expect(t, name, |s| matches!(s, StartStep::MountVolume(_)))?;
            if !t
                .record
                .resources
                .volumes
                .iter()
                .any(|v| v.name == volume.name)
            {
                t.record.resources.volumes.push(volume);
            }
        }
        Event::VolumeMounted(volume) => {
            expect(t, name, |s| matches!(s, StartStep::MountVolume(_)))?;
            t.record.resources.volumes.retain(|v| v.name != volume.name);
            t.record.resources.volumes.push(volume);
            advance(t, actions);
        }
        Event::DirCreated(path) => {
            expect(t, name, |s| matches!(s, StartStep::CreateDir(_)))?;
            if !t.record.resources.created_dirs.contains(&path) {
                t.record.resources.created_dirs.push(path);
            }
            advance(t, actions);
        }
        Event::DirExisted(_) => {
            expect(t, name, |s| matches!(s, StartStep::CreateDir(_)))?;
            advance(t, actions);
        }
        Event::PrepareFailed { message } => {
            expect(t, name, is_preparing)?;
            if t.start_step == Some(StartStep::AddHostKeys) {
                // The add is atomic: it failed, so nothing was added.
                t.record.resources.host_keys = None;
            }
            t.terminate(TerminationReason::ExecutorError, message);
            advance(t, actions);
        }
        Event::PullProgressed(progress) => {
            expect(t, name, |s| s == StartStep::Pull)?;
            t.pull_progress = Some(progress);
        }
        Event::PullSkipped => {
            expect(t, name, |s| s == StartStep::Pull)?;
            advance(t, actions);
        }
        Event::PullDone(progress) => {
            expect(t, name, |s| s == StartStep::Pull)?;
            t.pull_progress = Some(progress);
            advance(t, actions);
        }
        Event::PullFailed { message } => {
            expect(t, name, |s| s == StartStep::Pull)?;
            t.terminate(TerminationReason::CreatingContainerError, message);
            advance(t, actions);
        }
        Event::ContainerCreated { container_id } => {
            expect(t, name, |s| s == StartStep::CreateContainer)?;
            t.record.container_id = container_id;
            advance(t, actions);
        }
        Event::CreateFailed { message } => {
            expect(t, name, |s| s == StartStep::CreateContainer)?;
            t.terminate(TerminationReason::CreatingContainerError, message);
            advance(t, actions);
        }
        Event::ContainerStarted { ports } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.ports = Some(ports);
            if t.terminated() {
                // Terminated while starting: nothing may keep running.
                t.stop = StopState::InFlight;
                actions.push(Action::StopContainer { timeout_s: 0 });
            } else {
                t.set_status(TaskStatus::Running);
            }
            advance(t, actions);
        }
        Event::StartFailed { message } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.terminate(TerminationReason::ContainerExitedWithError, message);
            advance(t, actions);
        }
        Event::StartAborted { message } => {
            if !t.start_in_flight {
                return Err(t.unexpected(name));
            }
            t.terminate(TerminationReason::ExecutorError, message);
            begin(t, StartStep::Finish, actions);
        }
        Event::StartFinished => {
            if !t.start_in_flight {
                return Err(t.unexpected(name));
            }
            if t.record.status < TaskStatus::Running {
                let status = t.record.status;
                t.terminate(
                    TerminationReason::ExecutorError,
                    format!("start ended while the task was {status}"),
                );
            }
            t.start_in_flight = false;
            t.start_step = None;
        }
        Event::TerminateRequested {
            reason,
            message,
            timeout_s,
        } => match t.record.status {
            TaskStatus::Terminated => {}
            TaskStatus::Running => {
                t.terminate(reason, message);
                t.stop = StopState::InFlight;
                actions.push(Action::StopContainer { timeout_s });
            }
            _ => {
                t.terminate(reason, message);
                if t.start_in_flight && t.start_step == Some(StartStep::Pull) {
                    actions.push(Action::CancelPull);
                }
            }
        },
        Event::ContainerStopped => {
            t.stop = StopState::Idle;
        }
        Event::StopFailed { .. } => {
            // Retried by the reconciler's next cycle, not at once.
            *settle = false;
            t.stop = StopState::Failed;
        }
        Event::RemoveRequested => {
            *settle = false;
            if !t.terminated() {
                return Err(TransitionError::NotTerminated {
                    id: t.record.id.clone(),
                    status: t.record.status,
                });
            }
            if t.start_in_flight {
                return Err(TransitionError::StartInFlight {
                    id: t.record.id.clone(),
                });
            }
            if t.release_in_flight {
                return Err(TransitionError::ReleaseInFlight {
                    id: t.record.id.clone(),
                });
            }
            actions.push(Action::RemoveContainer);
            if t.record.resources.holds_any() {
                t.release_in_flight = true;
                actions.push(Action::Release(t.held()));
            }
            actions.push(Action::DeleteTaskDir);
            actions.push(Action::Forget);
        }
        Event::Observed(observation) => {
            if t.start_in_flight {
                return Ok(());
            }
            if t.terminated() {
                match observation {
                    Observation::Running => {
                        if t.stop != StopState::InFlight {
                            t.stop = StopState::InFlight;
                            actions.push(Action::StopContainer { timeout_s: 0 });
                        }
                    }
                    _ => {
                        if t.stop == StopState::Failed {
                            t.stop = StopState::Idle;
                        }
                    }
                }
            } else {
                match observation {
                    Observation::Running => {}
                    Observation::Exited { code: 0, .. } => {
                        t.terminate(TerminationReason::DoneByRunner, String::new());
                    }
                    Observation::Exited { code, last_lines } => {
                        t.terminate(
                            TerminationReason::ContainerExitedWithError,
                            exit_message(code, &last_lines),
                        );
                    }
                    Observation::NeverStarted => {
                        t.terminate(
                            TerminationReason::ExecutorError,
                            NEVER_STARTED_MESSAGE.to_owned(),
                        );
                    }
                    Observation::Missing => {
                        t.terminate(
                            TerminationReason::ExecutorError,
                            VANISHED_MESSAGE.to_owned(),
                        );
                    }
                }
            }
        }
        Event::ReleaseRequested => {}
        Event::Released {
            gpus,
            host_keys,
            volumes,
        } => {
            *settle = false;
            let r = &mut t.record.resources;
            r.gpus.retain(|g| !gpus.contains(g));
            if host_keys {
                r.host_keys = None;
            }
            r.volumes.retain(|v| !volumes.contains(&v.name));
            if !r.holds_any() && t.record.status == TaskStatus::Terminated && !t.start_in_flight {
                r.released = true;
            }
            t.release_in_flight = false;
        }
        Event::ReleaseFailed { .. } => {
            *settle = false;
            t.release_in_flight = false;
        }
        Event::GpusRelocked(locked) => {
            // Only what this task newly locked is its own: a GPU another restored task (a
            // duplicate, or a stale record) locked first must not be freed by this one.
            t.record.resources.gpus.retain(|g| locked.contains(g));
        }
    }
    Ok(())
}

/// Emits the release when it is due, and marks a settled terminated task that holds nothing
/// as released.
pub(crate) fn settle(t: &mut Task, actions: &mut Vec<Action>) {
    if t.needs_release() {
        if t.stop == StopState::Failed {
            t.stop = StopState::InFlight;
            actions.push(Action::StopContainer { timeout_s: 0 });
        } else {
            t.release_in_flight = true;
            actions.push(Action::Release(t.held()));
        }
    } else if t.terminated()
        && !t.start_in_flight
        && !t.release_in_flight
        && !t.record.resources.holds_any()
        && !t.record.resources.released
    {
        t.record.resources.released = true;
    }
}

/// Whether two records differ in more than their update time.
pub(crate) fn record_changed(old: &TaskRecord, new: &TaskRecord) -> bool {
    old.id != new.id
        || old.name != new.name
        || old.container_name != new.container_name
        || old.config != new.config
        || old.status != new.status
        || old.termination_reason != new.termination_reason
        || old.termination_message != new.termination_message
        || old.container_id != new.container_id
        || old.resources != new.resources
        || old.created_at_ms != new.created_at_ms
}

/// Steps a task through one event at time `now_ms` (Unix milliseconds).
///
/// On error the task is unchanged and nothing must be done.
pub fn step(task: &Task, event: Event, now_ms: u64) -> Result<Transition, TransitionError> {
    let mut t = task.clone();
    let mut actions = Vec::new();
    let mut settle_after = true;
    apply(&mut t, event, &mut actions, &mut settle_after)?;
    if settle_after {
        settle(&mut t, &mut actions);
    }
    if record_changed(&task.record, &t.record) {
        t.record.updated_at_ms = now_ms.max(task.record.updated_at_ms);
        actions.insert(0, Action::Persist);
    }
    Ok(Transition { task: t, actions })
}
