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
//! The exception is start progress ([`Task::progress_only`]): a step that only advances the
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
//!   [`Event::PersistRequested`] if [`Task::dirty`], [`Event::Observed`] (for a terminated
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
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    /// What is persisted (status, reason, resources...): the machine's intent.
    pub record: TaskRecord,
    /// The status, reason and message of the last durable record: what the API shows.
    pub saved: Saved,
    /// The record changed since the last successful write.
    pub dirty: bool,
    /// Everything in the record not yet durable is start progress (see the module docs;
    /// [`Task::dirty`] is then true too): the next start step may go out, and the next write
    /// carries the progress.
    pub progress_only: bool,
    /// The last failed side effect (a write, a stop, a release...), for logs; cleared by the
    /// next successful write.
    pub last_error: Option<String>,
    /// Start owns the task while true: nothing else may release its resources.
    pub start_in_flight: bool,
    /// Published ports: `None` until known, `[]` in host network mode.
    pub ports: Option<Vec<PortMapping>>,
    /// Image pull progress, once a pull reported any.
    pub pull_progress: Option<PullProgress>,
    /// GPU ids for [`TaskInfo`]; kept after release.
    pub gpu_ids: Option<Vec<String>>,
    /// The start step in progress (`None` before [`Event::StartBegan`] and after
    /// [`Event::StartFinished`]).
    pub start_step: Option<StartStep>,
    /// The action of [`Task::start_step`] is out (its outcome is awaited); false while it
    /// waits to be emitted.
    pub start_step_out: bool,
    /// A [`Action::CancelPull`] is called for.
    pub cancel_pull: bool,
    /// Where stopping the container stands.
    pub stop: StopState,
    /// An [`Action::Release`] is out and its outcome not yet stepped: no second one is emitted.
    pub release_in_flight: bool,
    /// A release or a stop just failed: the next one waits for the reconciler's next cycle
    /// ([`Event::ReleaseRequested`]), never a tight loop.
    pub release_backoff: bool,
    /// The last write of the record failed (a full disk) and none succeeded since: the stop,
    /// pull cancel and release a termination calls for no longer wait for it (see the module
    /// docs); the reconciler retries the write.
    pub write_failed: bool,
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
    /// ([`Task::progress_only`]).
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
            last_error: None,
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

/// The action of a start step, if the config has it.
fn start_action(config: Option<&TaskConfig>, step: StartStep) -> Option<Action> {
    let c = config?;
    match step {
        StartStep::Finish => Some(Action::FinishStart),
        StartStep::AcquireGpus => Some(Action::AcquireGpus { count: c.gpu }),
        StartStep::AddHostKeys => Some(Action::AddHostKeys(HostKeysGrant {
            user: c.host_ssh_user.clone(),
            keys: c.host_keys().0,
            upstream: false,
        })),
        StartStep::MountVolume(i) => c.volumes.get(i).cloned().map(Action::MountVolume),
        StartStep::CreateDir(i) => c
            .instance_mounts
            .get(i)
            .map(|m| Action::CreateDir(m.instance_path.clone())),
        StartStep::Pull => Some(Action::Pull {
            image: c.image_name.clone(),
        }),
        StartStep::CreateContainer => Some(Action::CreateContainer),
        StartStep::StartContainer => Some(Action::StartContainer),
    }
}

/// Makes `step` the step in progress (its action goes out once the record is durable) and
/// records what must be recorded ahead of it; a step the config does not have (or a task
/// without config) finishes start.
fn begin(t: &mut Task, step: StartStep) {
    let step = match start_action(t.config(), step) {
        Some(Action::AddHostKeys(grant)) => {
            // Recorded ahead (and persisted before the add): a crash during the add cannot
            // leak the keys, and removing a task's keys that were never added is a no-op.
            t.record.resources.host_keys = Some(grant);
            step
        }
        Some(Action::Pull { .. }) => {
            t.set_status(TaskStatus::Pulling);
            step
        }
        Some(Action::CreateContainer) => {
            t.set_status(TaskStatus::Creating);
            step
        }
        Some(_) => step,
        None => StartStep::Finish,
    };
    t.start_step = Some(step);
    t.start_step_out = false;
}

/// The outcome of the step in progress arrived: go on with the next step, or finish when the
/// task was terminated meanwhile (start stops at its next step).
fn advance(t: &mut Task) {
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
    begin(t, next);
}

/// Checks that `event` is the outcome of the step whose action is out (`ok` says which steps
/// match).
fn expect(
    t: &Task,
    event: &'static str,
    ok: impl Fn(StartStep) -> bool,
) -> Result<(), TransitionError> {
    match t.start_step {
        Some(s) if t.start_in_flight && t.start_step_out && ok(s) => Ok(()),
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
        Event::ContainerRecreated { .. } => "ContainerRecreated",
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
        Event::Persisted => "Persisted",
        Event::PersistFailed { .. } => "PersistFailed",
        Event::PersistRequested => "PersistRequested",
        Event::ActionsAbandoned { .. } => "ActionsAbandoned",
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

/// The message of a container that exited with an error: its last log lines (and a note when
/// the OOM killer ended it).
pub fn exit_message(code: i64, last_lines: &[String], oom_killed: bool) -> String {
    let start = last_lines.len().saturating_sub(EXIT_MESSAGE_LINES);
    let mut message = match last_lines.get(start..) {
        Some(lines) if !lines.is_empty() => lines.join("\n"),
        _ => format!("container exited with code {code}"),
    };
    if oom_killed {
        message.push('\n');
        message.push_str(OOM_NOTE);
    }
    message
}

/// How a step's event shapes the actions beyond its own.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// A write that the record needs goes out now even if this event did not change it (a
    /// request or the reconciler finding a dirty record).
    retry_write: bool,
    /// No write may be emitted (the event is a write's failure: the retry waits).
    no_write: bool,
}

const PLAIN: Shape = Shape {
    retry_write: false,
    no_write: false,
};

/// Applies one event: changes the task and may push actions that need no durable record (the
/// steps of a remove, the end of a given-up start).
fn apply(t: &mut Task, event: Event, actions: &mut Vec<Action>) -> Result<Shape, TransitionError> {
    let name = event_name(&event);
    let mut shape = PLAIN;
    match event {
        Event::StartBegan => {
            if !t.start_in_flight || t.start_step.is_some() {
                return Err(t.unexpected(name));
            }
            if t.terminated() {
                begin(t, StartStep::Finish);
                return Ok(shape);
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
            begin(t, StartStep::AcquireGpus);
        }
        Event::GpusAcquired(ids) => {
            expect(t, name, |s| s == StartStep::AcquireGpus)?;
            for id in &ids {
                if !t.record.resources.gpus.contains(id) {
                    t.record.resources.gpus.push(id.clone());
                }
            }
            t.gpu_ids = Some(ids);
            advance(t);
        }
        Event::HostKeysAdded(grant) => {
            expect(t, name, |s| s == StartStep::AddHostKeys)?;
            t.record.resources.host_keys = Some(grant);
            advance(t);
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
            advance(t);
        }
        Event::DirCreated(path) => {
            expect(t, name, |s| matches!(s, StartStep::CreateDir(_)))?;
            if !t.record.resources.created_dirs.contains(&path) {
                t.record.resources.created_dirs.push(path);
            }
            advance(t);
        }
        Event::DirExisted(_) => {
            expect(t, name, |s| matches!(s, StartStep::CreateDir(_)))?;
            advance(t);
        }
        Event::PrepareFailed { message } => {
            expect(t, name, is_preparing)?;
            if t.start_step == Some(StartStep::AddHostKeys) {
                // The add is atomic: it failed, so nothing was added.
                t.record.resources.host_keys = None;
            }
            t.terminate(TerminationReason::ExecutorError, message);
            advance(t);
        }
        Event::PullProgressed(progress) => {
            expect(t, name, |s| s == StartStep::Pull)?;
            t.pull_progress = Some(progress);
        }
        Event::PullSkipped => {
            expect(t, name, |s| s == StartStep::Pull)?;
            t.cancel_pull = false;
            advance(t);
        }
        Event::PullDone(progress) => {
            expect(t, name, |s| s == StartStep::Pull)?;
            t.pull_progress = Some(progress);
            t.cancel_pull = false;
            advance(t);
        }
        Event::PullFailed { message } => {
            expect(t, name, |s| s == StartStep::Pull)?;
            t.cancel_pull = false;
            t.terminate(TerminationReason::CreatingContainerError, message);
            advance(t);
        }
        Event::ContainerCreated { container_id } => {
            expect(t, name, |s| s == StartStep::CreateContainer)?;
            t.record.container_id = container_id;
            advance(t);
        }
        Event::CreateFailed { message } => {
            expect(t, name, |s| s == StartStep::CreateContainer)?;
            t.terminate(TerminationReason::CreatingContainerError, message);
            advance(t);
        }
        Event::ContainerRecreated { container_id } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.record.container_id = container_id;
        }
        Event::ContainerStarted { ports } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.ports = Some(ports);
            if t.terminated() {
                // Terminated while starting: nothing may keep running.
                t.stop = StopState::Wanted { timeout_s: 0 };
            } else {
                t.set_status(TaskStatus::Running);
            }
            advance(t);
        }
        Event::StartFailed { message } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.terminate(TerminationReason::ContainerExitedWithError, message);
            advance(t);
        }
        Event::StartAborted { message } => {
            if !t.start_in_flight {
                return Err(t.unexpected(name));
            }
            t.cancel_pull = false;
            t.terminate(TerminationReason::ExecutorError, message);
            begin(t, StartStep::Finish);
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
            t.start_step_out = false;
            t.cancel_pull = false;
        }
        Event::TerminateRequested {
            reason,
            message,
            timeout_s,
        } => {
            // A request, not a retry loop: whatever failed before may go out again.
            shape.retry_write = true;
            t.release_backoff = false;
            match t.record.status {
                TaskStatus::Terminated => {
                    // A task terminated without a reason takes the reason of a later
                    // terminate (upstream: runner/internal/shim/task.go, TaskStorage.Update).
                    if t.record
                        .termination_reason
                        .as_ref()
                        .is_some_and(|r| r.as_str().is_empty())
                    {
                        t.record.termination_reason = Some(reason);
                        t.record.termination_message = message;
                    }
                }
                TaskStatus::Running => {
                    t.terminate(reason, message);
                    t.stop = StopState::Wanted { timeout_s };
                }
                _ => {
                    t.terminate(reason, message);
                    if t.start_in_flight
                        && t.start_step == Some(StartStep::Pull)
                        && t.start_step_out
                    {
                        t.cancel_pull = true;
                    }
                }
            }
        }
        Event::ContainerStopped => {
            t.stop = StopState::Idle;
        }
        Event::StopFailed { message } => {
            // Retried by the reconciler's next cycle, not at once.
            t.release_backoff = true;
            t.stop = StopState::Failed;
            t.last_error = Some(message);
        }
        Event::RemoveRequested => {
            // Terminated durably, or terminated and its write failed: remove deletes the
            // record anyway, so the disk that could not take it does not keep the task.
            let terminated = t.record.status == TaskStatus::Terminated
                && (t.saved.status == TaskStatus::Terminated || t.write_failed);
            if !terminated {
                return Err(TransitionError::NotTerminated {
                    id: t.record.id.clone(),
                    status: t.saved.status,
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
            t.release_backoff = true;
            // The container is force-removed: a stop still wanted (its record's write failed)
            // is moot. Should the removal fail, the reconciler sees a running container and
            // stops it.
            if matches!(t.stop, StopState::Wanted { .. } | StopState::Failed) {
                t.stop = StopState::Idle;
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
                return Ok(shape);
            }
            // An observation is the reconciler's (or Docker's) news, not a retry loop.
            t.release_backoff = false;
            if t.terminated() {
                match observation {
                    Observation::Running => {
                        if matches!(t.stop, StopState::Idle | StopState::Failed) {
                            t.stop = StopState::Wanted { timeout_s: 0 };
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
                        // Exit 0 is the runner's own end, even when the kernel killed some
                        // other process of the container for memory (SPEC §2; upstream's
                        // waitContainer looks at the exit code only).
                        t.terminate(TerminationReason::DoneByRunner, String::new());
                    }
                    Observation::Exited {
                        code,
                        last_lines,
                        oom_killed,
                    } => {
                        t.terminate(
                            TerminationReason::ContainerExitedWithError,
                            exit_message(code, &last_lines, oom_killed),
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
        Event::ReleaseRequested => {
            shape.retry_write = true;
            t.release_backoff = false;
            if t.needs_release() && t.stop == StopState::Failed {
                t.stop = StopState::Wanted { timeout_s: 0 };
            }
        }
        Event::Released {
            gpus,
            host_keys,
            volumes,
            unknown_keys,
        } => {
            t.release_backoff = true;
            let r = &mut t.record.resources;
            r.gpus.retain(|g| !gpus.contains(g));
            if host_keys {
                r.host_keys = None;
            }
            if unknown_keys {
                r.unknown_keys = None;
            }
            r.volumes.retain(|v| !volumes.contains(&v.name));
            t.release_in_flight = false;
        }
        Event::ReleaseFailed { message } => {
            t.release_backoff = true;
            t.release_in_flight = false;
            t.last_error = Some(message);
        }
        Event::GpusRelocked(locked) => {
            // Only what this task newly locked is its own: a GPU another restored task (a
            // duplicate, or a stale record) locked first must not be freed by this one.
            t.record.resources.gpus.retain(|g| locked.contains(g));
        }
        Event::Persisted => {
            t.dirty = false;
            t.write_failed = false;
            t.progress_only = false;
            t.saved = Saved::of(&t.record);
            t.last_error = None;
        }
        Event::PersistFailed { message } => {
            shape.no_write = true;
            // What ends the task goes out without the write (`due`); the write is retried by
            // the reconciler's next cycle.
            t.write_failed = true;
            if t.start_in_flight
                && !t.start_step_out
                && t.start_step.is_some_and(|s| s != StartStep::Finish)
            {
                // The start chain waits on this write, which failed: give the start up.
                t.terminate(
                    TerminationReason::ExecutorError,
                    format!("{WRITE_FAILED_PREFIX}: {message}"),
                );
                begin(t, StartStep::Finish);
            }
            t.last_error = Some(message);
        }
        Event::PersistRequested => {
            shape.retry_write = true;
            t.release_backoff = false;
        }
        Event::ActionsAbandoned {
            actions: abandoned,
            message,
        } => {
            t.release_backoff = true;
            for a in &abandoned {
                match a {
                    Action::StopContainer { .. } => t.stop = StopState::Failed,
                    // Remove dropped the stop it made moot; a removal that failed leaves a
                    // container that may still run: it must stop before anything is
                    // released (found by the property test: a later terminate released
                    // while the container ran).
                    Action::RemoveContainer if t.stop == StopState::Idle => {
                        t.stop = StopState::Failed;
                    }
                    Action::Release(_) => t.release_in_flight = false,
                    Action::CancelPull => t.cancel_pull = true,
                    a if a.is_start_step() && t.start_in_flight && t.start_step_out => {
                        // The awaited outcome will never come: start is given up.
                        t.cancel_pull = false;
                        t.terminate(TerminationReason::ExecutorError, message.clone());
                        begin(t, StartStep::Finish);
                    }
                    _ => {}
                }
            }
            t.last_error = Some(message);
        }
    }
    Ok(shape)
}

/// The side effects due now, marking each as out. Only [`Action::FinishStart`] goes out while
/// the record is not durable, unless all that is not durable is start progress
/// ([`Task::progress_only`]), or its write failed ([`Task::write_failed`]: then what ends the
/// task, a stop, a pull cancel, a release, goes out too); everything else waits for the
/// write.
fn due(t: &mut Task, actions: &mut Vec<Action>) {
    if t.releases_may_go() && t.cancel_pull {
        t.cancel_pull = false;
        actions.push(Action::CancelPull);
    }
    if t.releases_may_go()
        && let StopState::Wanted { timeout_s } = t.stop
    {
        t.stop = StopState::InFlight;
        actions.push(Action::StopContainer { timeout_s });
    }
    if t.start_in_flight
        && !t.start_step_out
        && let Some(s) = t.start_step
        && (s == StartStep::Finish || !t.dirty || t.progress_only)
        && let Some(action) = start_action(t.config(), s).or(Some(Action::FinishStart))
    {
        if !matches!(action, Action::FinishStart) {
            t.start_step = Some(s);
        } else {
            t.start_step = Some(StartStep::Finish);
        }
        t.start_step_out = true;
        actions.push(action);
    }
    if !t.release_backoff && t.needs_release() {
        if t.stop == StopState::Failed {
            t.stop = StopState::InFlight;
            actions.push(Action::StopContainer { timeout_s: 0 });
        } else {
            t.release_in_flight = true;
            actions.push(Action::Release(t.held()));
        }
    }
}

/// Marks a settled terminated task that holds nothing as released.
fn settle_released(t: &mut Task) {
    if t.terminated()
        && !t.start_in_flight
        && !t.release_in_flight
        && !t.record.resources.holds_any()
        && !t.record.resources.released
    {
        t.record.resources.released = true;
    }
}

/// Whether two records differ in more than their update time. Exhaustive by construction: a
/// new field of [`TaskRecord`] is a compile error here until it is compared.
pub(crate) fn record_changed(old: &TaskRecord, new: &TaskRecord) -> bool {
    let TaskRecord {
        id,
        name,
        container_name,
        config,
        status,
        termination_reason,
        termination_message,
        container_id,
        resources,
        created_at_ms,
        updated_at_ms: _,
    } = old;
    *id != new.id
        || *name != new.name
        || *container_name != new.container_name
        || *config != new.config
        || *status != new.status
        || *termination_reason != new.termination_reason
        || *termination_message != new.termination_message
        || *container_id != new.container_id
        || *resources != new.resources
        || *created_at_ms != new.created_at_ms
}

/// Whether `new` differs from `old` only by start progress: the status advanced to a start
/// status (`preparing`, `pulling`, `creating`), or the first container id arrived during one.
fn is_progress(old: &TaskRecord, new: &TaskRecord) -> bool {
    let start_status = |s: TaskStatus| {
        matches!(
            s,
            TaskStatus::Preparing | TaskStatus::Pulling | TaskStatus::Creating
        )
    };
    let advanced = new.status > old.status;
    let first_container = old.container_id.is_empty() && !new.container_id.is_empty();
    (advanced || first_container)
        && new.status >= old.status
        && start_status(new.status)
        && !record_changed(
            old,
            &TaskRecord {
                status: old.status,
                container_id: old.container_id.clone(),
                ..new.clone()
            },
        )
}

/// Finishes a transition: a changed (or, when asked, a dirty) record is written first and
/// alone, unless the change is start progress only ([`Task::progress_only`]); otherwise the
/// side effects due go out.
fn finish(before: &TaskRecord, t: &mut Task, actions: &mut Vec<Action>, shape: Shape, now_ms: u64) {
    settle_released(t);
    let changed = record_changed(before, &t.record);
    if changed {
        t.record.updated_at_ms = now_ms.max(before.updated_at_ms);
        // Start progress stays progress only while nothing else waits to be written.
        t.progress_only =
            t.start_in_flight && (!t.dirty || t.progress_only) && is_progress(before, &t.record);
        t.dirty = true;
    }
    let write = t.dirty && !shape.no_write && ((changed && !t.progress_only) || shape.retry_write);
    if write {
        // Only actions that need no durable record may follow the write (GPU relocks at
        // restore); the side effects wait for `Persisted`.
        debug_assert!(actions.iter().all(|a| !a.needs_durable_record()));
        actions.insert(0, Action::Persist);
    } else {
        due(t, actions);
    }
}

/// Steps a task through one event at time `now_ms` (Unix milliseconds).
///
/// On error the task is unchanged and nothing must be done.
pub fn step(task: &Task, event: Event, now_ms: u64) -> Result<Transition, TransitionError> {
    let mut t = task.clone();
    let mut actions = Vec::new();
    let shape = apply(&mut t, event, &mut actions)?;
    finish(&task.record, &mut t, &mut actions, shape, now_ms);
    Ok(Transition { task: t, actions })
}

/// Finishes the transition of a restored task: `before` is the record read from disk, or
/// `None` when there was none (the task is written either way).
pub(crate) fn finish_restore(
    before: Option<&TaskRecord>,
    t: &mut Task,
    actions: &mut Vec<Action>,
    now_ms: u64,
) {
    let shape = match before {
        Some(_) => PLAIN,
        None => {
            t.dirty = true;
            Shape {
                retry_write: true,
                no_write: false,
            }
        }
    };
    let before = before.cloned().unwrap_or_else(|| t.record.clone());
    finish(&before, t, actions, shape, now_ms);
}
