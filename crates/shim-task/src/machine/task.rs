//! A task in memory ([`Task`]): the intended record, its durable view ([`Saved`]), the
//! bookkeeping only the machine changes, and what a task answers about itself.

use super::event::{StartStep, TransitionError};
use crate::config::TaskConfig;
use crate::ids::TaskId;
use crate::info::{PortMapping, PullProgress, Resources, TaskInfo};
use crate::record::TaskRecord;
use crate::status::{TaskStatus, TerminationReason};

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
    /// [`Effect::StopContainer`](super::Effect::StopContainer) is out: release waits for its outcome, since the container may
    /// still use the resources.
    InFlight,
    /// The last stop failed: the container may still run, so release waits until the
    /// reconciler sees it not running, or a stop retried by the reconciler (on
    /// [`Event::Observed`](super::Event::Observed) `Running` or [`Event::ReleaseRequested`](super::Event::ReleaseRequested)) succeeds.
    Failed,
}

/// A view of a task's status, reason and message: of its last durable record
/// ([`Task::saved`]), or what the API shows ([`Task::shown`]).
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
/// Its fields are the machine's own: only [`step`](super::step) and [`restore()`](crate::restore::restore)
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
    /// The start step in progress (`None` before [`Event::StartBegan`](super::Event::StartBegan) and after
    /// [`Event::StartFinished`](super::Event::StartFinished)).
    pub(crate) start_step: Option<StartStep>,
    /// The action of `start_step` is out (its outcome is awaited); false while it waits to be
    /// emitted.
    pub(crate) start_step_out: bool,
    /// A [`Effect::CancelPull`](super::Effect::CancelPull) is called for (the pull, or the
    /// making of an instance directory, is out and the task was terminated).
    pub(crate) cancel_pull: bool,
    /// Where stopping the container stands.
    pub(crate) stop: StopState,
    /// An [`Effect::Release`](super::Effect::Release) is out and its outcome not yet stepped: no second one is emitted.
    pub(crate) release_in_flight: bool,
    /// A remove was accepted and its actions are out (up to forgetting the task): a second
    /// remove is refused, so it cannot delete or forget what the first left behind (a task
    /// submitted again under the same id).
    pub(crate) remove_in_flight: bool,
    /// A release or a stop just failed: the next one waits for the reconciler's next cycle
    /// ([`Event::ReleaseRequested`](super::Event::ReleaseRequested)), never a tight loop.
    pub(crate) release_backoff: bool,
    /// The last write of the record failed (a full disk) and none succeeded since: the stop,
    /// pull cancel and release a termination calls for no longer wait for it (see the module
    /// docs); the reconciler retries the write.
    pub(crate) write_failed: bool,
    /// The task's container is known not to run: it exited (or vanished), a stop of it
    /// succeeded, or the task never had one. A terminated record then shows at once, durable
    /// or not ([`Task::shown`]): a restart would read the same from the container itself.
    pub(crate) ended: bool,
    /// The task's container was started (by its start, or found running at restore) and,
    /// unless `ended`, runs. A `running` record then shows at once, durable or not
    /// ([`Task::shown`]): the container carries the task's labels, and a restart that finds
    /// it running restores the task as `running` whatever its record says.
    pub(crate) runs: bool,
}

impl Task {
    /// A freshly submitted pending task, whose record submit has written. Its start counts as
    /// in flight from now on: the engine launches start for every new task (and steps
    /// [`Event::StartFinished`](super::Event::StartFinished) if it cannot).
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
            remove_in_flight: false,
            release_backoff: false,
            write_failed: false,
            ended: false,
            runs: false,
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

    /// The task status as the API shows it ([`Task::shown`]).
    pub fn status(&self) -> TaskStatus {
        self.shown().status
    }

    /// The record: what the machine intends and persists (status, reason, resources, the
    /// container id...). It may be ahead of the state file: see [`Task::is_dirty`].
    pub fn record(&self) -> &TaskRecord {
        &self.record
    }

    /// The status, reason and message of the last durable record.
    pub fn saved(&self) -> &Saved {
        &self.saved
    }

    /// What the API shows (SPEC §4, §5): the last durable record, except where the container
    /// itself proves more: a terminated task whose container no longer runs shows its
    /// termination at once, and a task whose container was started and runs shows at least
    /// `running` (whatever its record says: `running` is never written on its own, and a
    /// termination waits for its write while the container still runs), while the record
    /// waits for the disk. Nothing shown is undone by a crash but a requested reason: a
    /// restart reads the end, or the running container, from Docker first.
    pub fn shown(&self) -> Saved {
        if self.record.status == TaskStatus::Terminated
            && self.ended
            && self.saved.status != TaskStatus::Terminated
        {
            Saved::of(&self.record)
        } else if self.container_runs() && self.saved.status < TaskStatus::Running {
            Saved {
                status: TaskStatus::Running,
                ..self.saved.clone()
            }
        } else {
            self.saved.clone()
        }
    }

    /// The task's container is known not to run (exited, vanished, stopped, or none).
    pub fn container_ended(&self) -> bool {
        self.ended
    }

    /// The task's container was started (or found running at restore) and is not known to
    /// have ended since.
    pub fn container_runs(&self) -> bool {
        self.runs && !self.ended
    }

    /// The record changed since its last successful write (start progress included).
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Everything in the record not yet durable is start progress (the statuses `preparing`,
    /// `pulling`, `creating`, `running` while the container runs, or the first container id):
    /// the next start step goes out without a write of its own, and the next write carries it
    /// (see the module docs). [`Task::is_dirty`] is then true too.
    pub fn is_progress_only(&self) -> bool {
        self.progress_only
    }

    /// The record changed in more than start progress since its last successful write: the
    /// reconciler steps [`Event::PersistRequested`](super::Event::PersistRequested) until it
    /// is written.
    pub fn needs_write(&self) -> bool {
        self.dirty && !self.progress_only
    }

    /// The last write of the record failed and none succeeded since: what ends the task (a
    /// stop, a pull cancel, a release) no longer waits for the disk.
    pub fn write_failed(&self) -> bool {
        self.write_failed
    }

    /// Start owns the task: from [`Task::new`] until [`Event::StartFinished`](super::Event::StartFinished) is stepped.
    /// Nothing else may release its resources meanwhile, and the reconciler leaves it alone.
    pub fn start_in_flight(&self) -> bool {
        self.start_in_flight
    }

    /// The start step in progress (`None` before [`Event::StartBegan`](super::Event::StartBegan) and after
    /// [`Event::StartFinished`](super::Event::StartFinished)).
    pub fn start_step(&self) -> Option<StartStep> {
        self.start_step
    }

    /// Where stopping the task's container stands.
    pub fn stop(&self) -> StopState {
        self.stop
    }

    /// An [`Effect::Release`](super::Effect::Release) is out and its outcome not yet stepped.
    pub fn release_in_flight(&self) -> bool {
        self.release_in_flight
    }

    /// A remove was accepted and is being carried out.
    pub fn remove_in_flight(&self) -> bool {
        self.remove_in_flight
    }

    /// The API view (SPEC §3): status, reason and message as [`Task::shown`].
    pub fn info(&self) -> TaskInfo {
        let shown = self.shown();
        let terminated = shown.status == TaskStatus::Terminated;
        TaskInfo {
            id: self.record.id.clone(),
            status: shown.status,
            termination_reason: match (&shown.termination_reason, terminated) {
                (Some(reason), true) => reason.as_str().to_owned(),
                _ => String::new(),
            },
            termination_message: if terminated {
                shown.termination_message
            } else {
                String::new()
            },
            ports: self.ports.clone(),
            image_pull_progress: self.pull_progress,
            container_name: self.record.container_name.clone(),
            container_id: self.record.container_id.clone().unwrap_or_default(),
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
    /// this every cycle and then steps [`Event::ReleaseRequested`](super::Event::ReleaseRequested), which emits
    /// [`Effect::Release`](super::Effect::Release) — or, when the last stop failed, [`Effect::StopContainer`](super::Effect::StopContainer) again
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
    /// due ([`Task::needs_release`]: it steps [`Event::ReleaseRequested`](super::Event::ReleaseRequested), which retries a
    /// failed stop first), or the last stop failed and the task holds nothing
    /// ([`Task::stop_failed`]: it looks at the container and steps [`Event::Observed`](super::Event::Observed), which
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
    pub(super) fn releases_may_go(&self) -> bool {
        !self.dirty || self.write_failed
    }

    pub(super) fn config(&self) -> Option<&TaskConfig> {
        self.record.config.as_deref()
    }

    /// Sets `terminated` with the reason and message unless already terminated (the first
    /// reason is kept).
    pub(super) fn terminate(&mut self, reason: TerminationReason, message: String) {
        if self.record.status != TaskStatus::Terminated {
            self.record.status = TaskStatus::Terminated;
            self.record.termination_reason = Some(reason);
            self.record.termination_message = without_nul(message);
        }
    }

    pub(super) fn terminated(&self) -> bool {
        self.record.status == TaskStatus::Terminated
    }

    pub(super) fn set_status(&mut self, status: TaskStatus) {
        if status > self.record.status {
            self.record.status = status;
        }
    }

    pub(super) fn unexpected(&self, event: &'static str) -> TransitionError {
        TransitionError::Unexpected {
            id: self.record.id.clone(),
            status: self.record.status,
            event,
            awaited: self.start_step,
        }
    }
}

/// `message` without NUL characters (each becomes U+FFFD): a container's log, an image name
/// or a terminate request may carry one, and the dstack server's Postgres refuses to store it
/// (the job would stay stuck).
pub(super) fn without_nul(message: String) -> String {
    if message.contains('\0') {
        message.replace('\0', "\u{FFFD}")
    } else {
        message
    }
}
