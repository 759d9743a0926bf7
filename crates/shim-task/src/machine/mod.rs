//! The task state machine: events in, the next task and the actions to carry out out.
//!
//! [`step`] is a pure function. The engine holds a [`Task`], feeds it an [`Event`] (a request,
//! the outcome of an action it carried out, or what the reconciler saw), and gets a
//! [`Transition`]: the task to keep and the [`Action`]s to carry out, in order.
//!
//! # Durability first
//!
//! The record ([`Task::record`]) is what the machine intends; [`Task::saved`] is what the state
//! file last durably held, and it is what the API shows ([`Task::info`]): the in-memory state
//! never claims what is not durable. A step that changes the record returns exactly
//! `[Persist]` and nothing else (two exceptions below); every side effect that step calls for
//! waits in the task as an intent (the next start step, a stop, a pull cancel, a release)
//! and is emitted by the step of [`Event::Persisted`]. So a side effect never runs before the
//! state that called for it is on disk, and a failed write ([`Event::PersistFailed`]) loses
//! no intent: the reconciler retries the write ([`Event::PersistRequested`]) until it
//! succeeds. A request that finds the record not yet durable retries the write too (a second
//! terminate after the disk filled up and emptied again answers from a durable record).
//!
//! What ends a task does not wait for a write that failed (SPEC §4: a failed state write
//! never blocks a stop or a release; a task that fills the disk must still be stoppable).
//! Once a write of a terminated record failed ([`Task::write_failed`]), its stop, its pull
//! cancel and its release go out at once, and a remove is accepted. They are idempotent: the
//! record is written when the disk allows, and a crash before that write restores the last
//! durable record, which repeats them (releasing what is already free is a no-op; at worst
//! the reason reads as the container's exit). The API keeps showing the durable record
//! meanwhile. Nothing is acquired without a durable record: start steps still wait.
//!
//! The exception is start progress ([`Task::is_progress_only`]): a step that only advances the
//! status through `preparing`, `pulling` and `creating`, or records the id of the container
//! just created, needs no write of its own. Nothing a restore does depends on it: without a
//! container every start status restores as a start cut short, and a container is found by
//! its labels, not by a recorded id. The API keeps showing the last durable status, so the
//! next start step goes out at once and the next write carries the progress along.
//! Everything a crash could lose (the write-ahead of keys and volumes, GPU ids, created
//! directories, `running`, a termination) is still written before what follows it. This
//! keeps a start's state-file writes at two (`pending` at submit, `running`) when nothing is
//! acquired and the image is present; the engine writes `pulling` before an image is really
//! pulled, so a long pull shows it.
//!
//! # What the engine must do (checked by the simulated engine in `tests/properties.rs`)
//!
//! - Carry out [`Action::Persist`] (always alone in its list) under the same per-task lock as
//!   the step that returned it, and step [`Event::Persisted`] or [`Event::PersistFailed`]
//!   before the lock is released: no other step of the task may come between.
//! - Step the outcome of every action that has one (see each [`Action`]) — in particular one
//!   of [`Event::Released`] / [`Event::ReleaseFailed`] for every [`Action::Release`], and
//!   [`Event::StartFinished`] whenever the start job returns, however it returns.
//! - When it stops carrying out a list because an action failed without an outcome event,
//!   step [`Event::ActionsAbandoned`] with that action and the rest of the list, so nothing
//!   stays marked as in flight.
//! - Launch start for every [`Task::new`] task (it counts as in flight from submit on).
//! - Carry out the actions of [`restore()`](crate::restore::restore) (GPU locks first) before
//!   the reconciler's first cycle.
//! - Reconciler, for each task whose start is not in flight: step
//!   [`Event::PersistRequested`] if [`Task::is_dirty`], [`Event::Observed`] (for a terminated
//!   task at least when its container runs), then [`Event::ReleaseRequested`] if
//!   [`Task::needs_release`]. Failed writes, stops and releases are retried this way, never in
//!   a tight loop.
//! - Remove: carry out the list in order and stop at the first failure; a release that leaves
//!   anything held ([`Task::held`] not empty after its outcome) is a failure, so the task and
//!   its directory stay and a later remove retries.
//!
//! Host keys and volumes are recorded ahead of their acquisition (write-ahead), and GPU locks
//! live in memory, so a crash at any point leaves nothing unrecorded; every point of a crash
//! is covered by [`restore()`](crate::restore::restore).
//!
//! # Where each part lives
//!
//! This module holds the types ([`Task`], [`Event`], [`Action`]) and what a task answers
//! about itself; the machine's work is split by job: `transition` (the step, one function
//! per family of events), `start` (the chain of start steps), `due` (which side effects go
//! out now) and `durability` (what a change means for the state file: a write first, start
//! progress, or nothing).

mod due;
mod durability;
mod start;
mod transition;

pub(crate) use durability::finish_restore;
pub use transition::{exit_message, step};

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

/// The line added to the message of a container the kernel's OOM killer ended.
pub const OOM_NOTE: &str = "out of memory: the kernel's OOM killer ended the container's process";

/// The prefix of the message of a start given up because its state could not be written.
pub const WRITE_FAILED_PREFIX: &str = "cannot write the task's state file";

/// The steps of start, in order. The machine waits on one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StartStep {
    /// [`Action::AcquireGpus`].
    AcquireGpus,
    /// [`Action::AddHostKeys`].
    AddHostKeys,
    /// [`Action::MountVolume`] for `config.volumes[i]`.
    MountVolume(usize),
    /// [`Action::CreateDir`] for `config.instance_mounts[i]`.
    CreateDir(usize),
    /// [`Action::Pull`].
    Pull,
    /// [`Action::CreateContainer`].
    CreateContainer,
    /// [`Action::StartContainer`].
    StartContainer,
    /// [`Action::FinishStart`]: start is returning.
    Finish,
}

/// Where stopping the container stands (volatile).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum StopState {
    /// No stop is pending.
    #[default]
    Idle,
    /// A stop is called for and goes out once the record is durable.
    Wanted {
        /// Seconds between SIGTERM and SIGKILL.
        timeout_s: u64,
    },
    /// [`Action::StopContainer`] is out: release waits for its outcome, since the container may
    /// still use the resources.
    InFlight,
    /// The last stop failed: the container may still run, so release waits until the
    /// reconciler sees it not running, or a stop retried by the reconciler (on
    /// [`Event::Observed`] `Running` or [`Event::ReleaseRequested`]) succeeds.
    Failed,
}

/// What the API shows of a task: the status, reason and message of its last durable record.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Saved {
    /// The status.
    pub status: TaskStatus,
    /// The reason (set once terminated).
    pub termination_reason: Option<TerminationReason>,
    /// The message.
    pub termination_message: String,
    /// Everything the task held is released.
    pub released: bool,
}

impl Saved {
    /// The view of a record.
    pub fn of(record: &TaskRecord) -> Self {
        Self {
            status: record.status,
            termination_reason: record.termination_reason.clone(),
            termination_message: record.termination_message.clone(),
            released: record.resources.released,
        }
    }
}

/// A task in memory: the intended record, its durable view, and what only lives as long as
/// the process.
///
/// Its fields are the machine's own: only [`step`] and [`restore()`](crate::restore::restore)
/// change a task, and everyone else reads it through the accessors below (the record
/// through [`Task::record`], the API view through [`Task::info`]). An embedder cannot put a
/// task in a state the machine would not reach.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// What is persisted (status, reason, resources...): the machine's intent.
    pub(crate) record: TaskRecord,
    /// The status, reason and message of the last durable record: what the API shows.
    pub(crate) saved: Saved,
    /// The record changed since the last successful write.
    pub(crate) dirty: bool,
    /// Everything in the record not yet durable is start progress (see the module docs;
    /// `dirty` is then true too): the next start step may go out, and the next write carries
    /// the progress.
    pub(crate) progress_only: bool,
    /// Start owns the task while true: nothing else may release its resources.
    pub(crate) start_in_flight: bool,
    /// Published ports: `None` until known, `[]` in host network mode.
    pub(crate) ports: Option<Vec<PortMapping>>,
    /// Image pull progress, once a pull reported any.
    pub(crate) pull_progress: Option<PullProgress>,
    /// GPU ids for [`TaskInfo`]; kept after release.
    pub(crate) gpu_ids: Option<Vec<String>>,
    /// The start step in progress (`None` before [`Event::StartBegan`] and after
    /// [`Event::StartFinished`]).
    pub(crate) start_step: Option<StartStep>,
    /// The action of `start_step` is out (its outcome is awaited); false while it waits to be
    /// emitted.
    pub(crate) start_step_out: bool,
    /// A [`Action::CancelPull`] is called for.
    pub(crate) cancel_pull: bool,
    /// Where stopping the container stands.
    pub(crate) stop: StopState,
    /// An [`Action::Release`] is out and its outcome not yet stepped: no second one is emitted.
    pub(crate) release_in_flight: bool,
    /// A release or a stop just failed: the next one waits for the reconciler's next cycle
    /// ([`Event::ReleaseRequested`]), never a tight loop.
    pub(crate) release_backoff: bool,
    /// The last write of the record failed (a full disk) and none succeeded since: the stop,
    /// pull cancel and release a termination calls for no longer wait for it (see the module
    /// docs); the reconciler retries the write.
    pub(crate) write_failed: bool,
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
    /// Pull progress (any number of times while [`Action::Pull`] is out). Never changes the
    /// record.
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
    /// While [`Action::StartContainer`] is out: the engine replaced the container with a new
    /// one (the NVIDIA display retry). Not an outcome: the step is still awaited.
    ContainerRecreated {
        /// The new container's id.
        container_id: String,
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
    /// The start job hit an error of its own and is returning early: `executor_error`, then
    /// [`Action::FinishStart`].
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
    /// A remove request (only for terminated tasks whose start has returned: durably
    /// terminated, or terminated with a failed write, since remove deletes the record).
    RemoveRequested,
    /// The reconciler's view of the task's container (ignored while start is in flight).
    Observed(Observation),
    /// The reconciler asks for a release of what a terminated task still holds (emits
    /// [`Action::Release`] when [`Task::needs_release`]); it also ends a release backoff.
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
        /// The hold on key lines of unknown origin was dropped.
        unknown_keys: bool,
    },
    /// Outcome of [`Action::Release`]: nothing more could be released now.
    ReleaseFailed {
        /// What failed.
        message: String,
    },
    /// Outcome of [`Action::LockGpus`] (restore): these GPUs are locked again.
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

/// Something the engine must do, in the order given.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Write the task's record to its state file now. Always alone in its list. Outcome:
    /// [`Event::Persisted`] or [`Event::PersistFailed`], stepped under the same lock.
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
    /// Pull the image, or skip when present and not `:latest` (the engine knows, and adds the
    /// `:latest` of a bare name). Outcome: [`Event::PullProgressed`]*, then [`Event::PullDone`],
    /// [`Event::PullSkipped`] or [`Event::PullFailed`].
    Pull {
        /// The image as submitted (`image_name`).
        image: String,
    },
    /// Cancel the pull in progress now (its outcome is still reported by the start job).
    /// No outcome of its own.
    CancelPull,
    /// Create the container. Outcome: [`Event::ContainerCreated`] or [`Event::CreateFailed`].
    CreateContainer,
    /// Start the container (the NVIDIA display retry is the engine's, reported with
    /// [`Event::ContainerRecreated`]). Outcome: [`Event::ContainerStarted`] or
    /// [`Event::StartFailed`].
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
    /// Delete the task directory (renamed to a trash name first). No outcome.
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

    /// Whether the action may only run once the record that called for it is durable: every
    /// side effect but GPU relocks (memory only) and the steps of a remove (which runs on a
    /// durably terminated task and deletes its record).
    pub fn needs_durable_record(&self) -> bool {
        self.is_side_effect()
            && !matches!(
                self,
                Self::LockGpus(_) | Self::RemoveContainer | Self::DeleteTaskDir
            )
    }

    /// Whether this is a step of start ([`Task::start_step`]'s action, or its end): the only
    /// side effects that may go out while the unwritten part of the record is start progress
    /// ([`Task::is_progress_only`]).
    pub fn is_start_step(&self) -> bool {
        matches!(
            self,
            Self::AcquireGpus { .. }
                | Self::AddHostKeys(_)
                | Self::MountVolume(_)
                | Self::CreateDir(_)
                | Self::Pull { .. }
                | Self::CreateContainer
                | Self::StartContainer
                | Self::FinishStart
        )
    }
}

/// The result of a step: the task to keep and what to do.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Transition {
    /// The task after the event.
    pub task: Task,
    /// The actions, in order.
    pub actions: Vec<Action>,
}

/// A forbidden transition. The task is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// A freshly submitted pending task, whose record submit has written. Its start counts as
    /// in flight from now on: the engine launches start for every new task (and steps
    /// [`Event::StartFinished`] if it cannot).
    pub fn new(record: TaskRecord) -> Task {
        Task {
            saved: Saved::of(&record),
            record,
            dirty: false,
            progress_only: false,
            start_in_flight: true,
            ports: None,
            pull_progress: None,
            gpu_ids: None,
            start_step: None,
            start_step_out: false,
            cancel_pull: false,
            stop: StopState::Idle,
            release_in_flight: false,
            release_backoff: false,
            write_failed: false,
        }
    }

    /// A task rebuilt from what survives a restart (start is not in flight); `saved` is the
    /// record as read from disk.
    pub(crate) fn restored(record: TaskRecord, saved: Saved) -> Task {
        Task {
            saved,
            start_in_flight: false,
            ..Task::new(record)
        }
    }

    /// The task id.
    pub fn id(&self) -> &TaskId {
        &self.record.id
    }

    /// The task status as the API shows it (durable).
    pub fn status(&self) -> TaskStatus {
        self.saved.status
    }

    /// The record: what the machine intends and persists (status, reason, resources, the
    /// container id...). It may be ahead of the state file: see [`Task::is_dirty`].
    pub fn record(&self) -> &TaskRecord {
        &self.record
    }

    /// The status, reason and message of the last durable record: what the API shows.
    pub fn saved(&self) -> &Saved {
        &self.saved
    }

    /// The record changed since its last successful write: the reconciler steps
    /// [`Event::PersistRequested`] until it is written.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Everything in the record not yet durable is start progress (the statuses `preparing`,
    /// `pulling`, `creating`, or the first container id): the next start step goes out
    /// without a write of its own, and the next write carries it (see the module docs).
    /// [`Task::is_dirty`] is then true too.
    pub fn is_progress_only(&self) -> bool {
        self.progress_only
    }

    /// The last write of the record failed and none succeeded since: what ends the task (a
    /// stop, a pull cancel, a release) no longer waits for the disk.
    pub fn write_failed(&self) -> bool {
        self.write_failed
    }

    /// Start owns the task: from [`Task::new`] until [`Event::StartFinished`] is stepped.
    /// Nothing else may release its resources meanwhile, and the reconciler leaves it alone.
    pub fn start_in_flight(&self) -> bool {
        self.start_in_flight
    }

    /// The start step in progress (`None` before [`Event::StartBegan`] and after
    /// [`Event::StartFinished`]).
    pub fn start_step(&self) -> Option<StartStep> {
        self.start_step
    }

    /// Where stopping the task's container stands.
    pub fn stop(&self) -> StopState {
        self.stop
    }

    /// An [`Action::Release`] is out and its outcome not yet stepped.
    pub fn release_in_flight(&self) -> bool {
        self.release_in_flight
    }

    /// The API view (SPEC §3): status, reason and message from the durable record.
    pub fn info(&self) -> TaskInfo {
        let terminated = self.saved.status == TaskStatus::Terminated;
        TaskInfo {
            id: self.record.id.clone(),
            status: self.saved.status,
            termination_reason: match (&self.saved.termination_reason, terminated) {
                (Some(reason), true) => reason.as_str().to_owned(),
                _ => String::new(),
            },
            termination_message: if terminated {
                self.saved.termination_message.clone()
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
            unknown_keys: r.unknown_keys.clone(),
            released: false,
        }
    }

    /// Whether a release is due now: terminated (durably), holding something, start not in
    /// flight, no stop wanted or in flight and no release already out. The reconciler asks
    /// this every cycle and then steps [`Event::ReleaseRequested`], which emits
    /// [`Action::Release`] — or, when the last stop failed, [`Action::StopContainer`] again
    /// first (release waits for a successful stop, since the container may still use the
    /// resources).
    pub fn needs_release(&self) -> bool {
        self.record.status == TaskStatus::Terminated
            && self.releases_may_go()
            && self.record.resources.holds_any()
            && !self.start_in_flight
            && matches!(self.stop, StopState::Idle | StopState::Failed)
            && !self.release_in_flight
    }

    /// Whether the reconciler's retry pass has something to do for this task: a release is
    /// due ([`Task::needs_release`]: it steps [`Event::ReleaseRequested`], which retries a
    /// failed stop first), or the last stop failed and the task holds nothing
    /// ([`Task::stop_failed`]: it looks at the container and steps [`Event::Observed`], which
    /// stops a container still running). A container that did not stop is thus retried
    /// without waiting for Docker's news or the backstop list, whatever the task holds.
    pub fn needs_retry(&self) -> bool {
        self.needs_release() || self.stop_failed()
    }

    /// A durably terminated task whose last stop failed, with nothing else in flight.
    pub fn stop_failed(&self) -> bool {
        self.record.status == TaskStatus::Terminated
            && self.releases_may_go()
            && !self.start_in_flight
            && self.stop == StopState::Failed
    }

    /// Whether what ends a task (a stop, a pull cancel, a release) may go out now: once the
    /// record that called for it is durable, or when its write failed. Those are idempotent,
    /// so they never wait for a disk that cannot take the record (SPEC §4: a failed state
    /// write never blocks a stop or a release); a crash before the record is written repeats
    /// them.
    fn releases_may_go(&self) -> bool {
        !self.dirty || self.write_failed
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
