//! The machine's vocabulary: what happens to a task ([`Event`]), what the engine must do
//! ([`Action`]), what the reconciler sees ([`Observation`]), the steps of start
//! ([`StartStep`]), the transitions it refuses ([`TransitionError`]) and the messages it
//! writes.

use crate::config::VolumeSpec;
use crate::ids::TaskId;
use crate::info::{HostKeysGrant, MountedVolume, PortMapping, PullProgress, Resources};
use crate::status::{TaskStatus, TerminationReason};

/// How many log lines make the message of a container that exited with an error.
pub const EXIT_MESSAGE_LINES: usize = 5;

/// The most bytes of log lines the message of a container that exited with an error keeps (the
/// end): the message is in every task answer and in the state file.
pub const EXIT_MESSAGE_MAX_BYTES: usize = 16 * 1024;

/// The message of a task whose container was created but never started.
pub const NEVER_STARTED_MESSAGE: &str =
    "container was created but never started (the shim stopped between create and start)";

/// The message of a task whose container disappeared.
pub const VANISHED_MESSAGE: &str = "container vanished";

/// The line added to the message of a container the kernel's OOM killer ended.
pub const OOM_NOTE: &str = "out of memory: the kernel's OOM killer ended the container's process";

/// The prefix of the message of a start given up because its state could not be written.
pub const WRITE_FAILED_PREFIX: &str = "cannot write the task's state file";

/// The steps of start, in order. The machine waits on one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StartStep {
    /// [`Effect::AcquireGpus`].
    AcquireGpus,
    /// [`Effect::AddHostKeys`].
    AddHostKeys,
    /// [`Effect::MountVolume`] for `config.volumes[i]`.
    MountVolume(usize),
    /// [`Effect::CreateDir`] for `config.instance_mounts[i]`.
    CreateDir(usize),
    /// [`Effect::Pull`].
    Pull,
    /// [`Effect::CreateContainer`].
    CreateContainer,
    /// [`Effect::StartContainer`].
    StartContainer,
    /// [`Effect::FinishStart`]: start is returning.
    Finish,
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
        /// The kernel's OOM killer ended it.
        oom_killed: bool,
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
    /// Outcome of [`Effect::AcquireGpus`]: these GPUs are locked for the task.
    GpusAcquired(Vec<String>),
    /// Outcome of [`Effect::AddHostKeys`].
    HostKeysAdded(HostKeysGrant),
    /// Write-ahead for [`Effect::MountVolume`]: the engine is about to mount this volume here.
    /// Recorded (and persisted) before the mount, so a crash during the format or the mount
    /// cannot leak it: releasing a volume that was never mounted is a no-op. Not an outcome:
    /// the step is still awaited.
    VolumeMounting(MountedVolume),
    /// Outcome of [`Effect::MountVolume`].
    VolumeMounted(MountedVolume),
    /// Outcome of [`Effect::CreateDir`] when the engine created the directory.
    DirCreated(String),
    /// Outcome of [`Effect::CreateDir`] when the directory already existed (left alone).
    DirExisted(String),
    /// Any preparing step failed (GPUs, keys, volume, dir): `executor_error`.
    PrepareFailed {
        /// What failed, readable.
        message: String,
    },
    /// Outcome of [`Effect::Pull`] when the image is present and not `:latest`.
    PullSkipped,
    /// Pull progress (any number of times while [`Effect::Pull`] is out). Never changes the
    /// record.
    PullProgressed(PullProgress),
    /// Outcome of [`Effect::Pull`]: the pull completed.
    PullDone(PullProgress),
    /// Outcome of [`Effect::Pull`]: the pull failed, timed out or was cancelled.
    PullFailed {
        /// What failed, incl. the bytes downloaded.
        message: String,
    },
    /// Outcome of [`Effect::CreateContainer`].
    ContainerCreated {
        /// The new container's id.
        container_id: String,
    },
    /// Outcome of [`Effect::CreateContainer`]: creation failed.
    CreateFailed {
        /// What failed.
        message: String,
    },
    /// While [`Effect::StartContainer`] is out: the engine replaced the container with a new
    /// one (the NVIDIA display retry). Not an outcome: the step is still awaited.
    ContainerRecreated {
        /// The new container's id.
        container_id: String,
    },
    /// Outcome of [`Effect::StartContainer`]: the container runs.
    ContainerStarted {
        /// The published ports (`[]` in host network mode).
        ports: Vec<PortMapping>,
    },
    /// Outcome of [`Effect::StartContainer`]: start failed.
    StartFailed {
        /// Last log lines or the error.
        message: String,
    },
    /// Outcome of [`Effect::StartContainer`]: the engine refused to start the container for
    /// what it was created with, its devices (an unresolvable CDI device, no NVIDIA runtime
    /// for a device request): nothing ran, so the task ends `creating_container_error`, as a
    /// create the engine refused does, with the engine's words.
    StartRefused {
        /// The engine's error.
        message: String,
    },
    /// The start job hit an error of its own and is returning early: `executor_error`, then
    /// [`Effect::FinishStart`].
    StartAborted {
        /// What went wrong.
        message: String,
    },
    /// The start job returned (it steps this after [`Effect::FinishStart`], and also when it
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
    /// Outcome of [`Effect::StopContainer`]: the container no longer runs (a missing container
    /// counts as stopped).
    ContainerStopped,
    /// Outcome of [`Effect::StopContainer`]: stopping failed.
    StopFailed {
        /// What failed.
        message: String,
    },
    /// A remove request (only for terminated tasks whose start has returned: durably
    /// terminated, or terminated with a failed write, since remove deletes the record).
    RemoveRequested,
    /// The reconciler's view of the task's container (ignored while start is in flight).
    Observed(Observation),
    /// The reconciler asks for a release of what a terminated task still holds (emits
    /// [`Effect::Release`] when [`Task::needs_release`](super::Task::needs_release)); it also ends a release backoff.
    ReleaseRequested,
    /// Outcome of [`Effect::Release`]: what WAS released (partial success is allowed; what is
    /// not listed stays recorded and is retried on a later cycle).
    Released {
        /// Unlocked GPU ids.
        gpus: Vec<String>,
        /// The host keys were removed.
        host_keys: bool,
        /// Names of the unmounted volumes.
        volumes: Vec<String>,
        /// The hold on key lines of unknown origin was dropped.
        unknown_keys: bool,
    },
    /// Outcome of [`Effect::Release`]: nothing more could be released now.
    ReleaseFailed {
        /// What failed.
        message: String,
    },
    /// Outcome of [`Effect::LockGpus`] (restore): these GPUs are locked again.
    GpusRelocked(Vec<String>),
    /// Outcome of [`Action::Persist`]: the record is on disk.
    Persisted,
    /// Outcome of [`Action::Persist`]: the write failed; the record stays dirty and the write
    /// is retried by the reconciler or the next request. A start that was waiting on it is
    /// given up (`executor_error` saying the state could not be written).
    PersistFailed {
        /// Why, with its cause chain.
        message: String,
    },
    /// The reconciler (or a request) asks for the record to be written again if it is dirty.
    PersistRequested,
    /// The engine stopped carrying out a list: `actions` (the one that failed without an
    /// outcome event first) were not carried out, or carried out without an outcome.
    ActionsAbandoned {
        /// The actions not carried out.
        actions: Vec<Action>,
        /// Why.
        message: String,
    },
}

/// Something the engine must do, in the order given: the record room's own (the record
/// written, its directory deleted) or an [`Effect`] on the world outside the task's record.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Write the task's record to its state file now. Always alone in its list. Outcome:
    /// [`Event::Persisted`] or [`Event::PersistFailed`], stepped under the same lock.
    Persist,
    /// Delete the task directory (renamed to a trash name first). No outcome.
    DeleteTaskDir,
    /// Carry out an effect.
    Effect(Effect),
}

impl Action {
    /// Whether the action has an effect outside the task's memory and state file.
    pub fn is_side_effect(&self) -> bool {
        match self {
            Self::Persist => false,
            Self::DeleteTaskDir => true,
            Self::Effect(effect) => effect.is_side_effect(),
        }
    }

    /// Whether the action may only run once the record that called for it is durable: every
    /// side effect but GPU relocks (memory only) and the steps of a remove (which runs on a
    /// durably terminated task and deletes its record).
    pub fn needs_durable_record(&self) -> bool {
        match self {
            Self::Persist | Self::DeleteTaskDir => false,
            Self::Effect(effect) => {
                effect.is_side_effect()
                    && !matches!(effect, Effect::LockGpus(_) | Effect::RemoveContainer)
            }
        }
    }

    /// Whether this is a step of start ([`Task::start_step`](super::Task::start_step)'s action, or its end): the only
    /// side effects that may go out while the unwritten part of the record is start progress
    /// ([`Task::is_progress_only`](super::Task::is_progress_only)).
    pub fn is_start_step(&self) -> bool {
        matches!(
            self,
            Self::Effect(
                Effect::AcquireGpus { .. }
                    | Effect::AddHostKeys(_)
                    | Effect::MountVolume(_)
                    | Effect::CreateDir(_)
                    | Effect::Pull { .. }
                    | Effect::CreateContainer
                    | Effect::StartContainer
                    | Effect::FinishStart
            )
        )
    }
}

/// What the engine carries out outside the task's record: on the host's resources, the
/// container engine and the task's memory. Each says its outcome event, if any.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Lock GPUs (`-1` all available, `0` none, `N` exactly N). Outcome:
    /// [`Event::GpusAcquired`] or [`Event::PrepareFailed`].
    AcquireGpus {
        /// As in [`TaskConfig::gpu`](crate::TaskConfig::gpu).
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
    /// Pull the image, or skip when present and not `:latest` (the engine knows, and adds the
    /// `:latest` of a bare name). Outcome: [`Event::PullProgressed`]*, then [`Event::PullDone`],
    /// [`Event::PullSkipped`] or [`Event::PullFailed`].
    Pull {
        /// The image as submitted (`image_name`).
        image: String,
    },
    /// Cancel the start's step in progress now, the pull or the making of an instance
    /// directory (a file system that does not answer): its outcome is still reported by the
    /// start job. No outcome of its own.
    CancelPull,
    /// Create the container. Outcome: [`Event::ContainerCreated`] or [`Event::CreateFailed`].
    CreateContainer,
    /// Start the container (the NVIDIA display retry is the engine's, reported with
    /// [`Event::ContainerRecreated`]). Outcome: [`Event::ContainerStarted`] or
    /// [`Event::StartFailed`] or [`Event::StartRefused`].
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
    /// rest of the list (and steps [`Event::ActionsAbandoned`]).
    RemoveContainer,
    /// Drop the task from memory. No outcome.
    Forget,
    /// Start is done: the start job returns, then steps [`Event::StartFinished`].
    FinishStart,
    /// Restore: lock these GPUs again. Outcome: [`Event::GpusRelocked`] with the ids this call
    /// newly locked; the task keeps only those (a GPU already locked by another task is not
    /// this task's to free).
    LockGpus(Vec<String>),
}

impl Effect {
    /// Whether the effect reaches outside the task's memory.
    pub fn is_side_effect(&self) -> bool {
        !matches!(self, Self::FinishStart | Self::Forget)
    }
}

/// A forbidden transition. The task is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransitionError {
    /// Remove of a task that is not (durably) terminated (the API answers 409).
    #[error("task {id} is {status}, not terminated: terminate it first")]
    NotTerminated {
        /// The task.
        id: TaskId,
        /// Its status as the API shows it.
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
    /// Remove while an earlier remove is being carried out (409).
    #[error("task {id} is being removed")]
    RemoveInFlight {
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
    /// A start event, or a stop's or a release's outcome, that is not the outcome of an
    /// action the machine is waiting on (an engine bug).
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
