//! The task state machine: events in, the next task and the actions to carry out out.
//!
//! [`step`] is a pure function. The engine holds a [`Task`], feeds it an [`Event`] (a request,
//! the outcome of an action it carried out, or what the reconciler saw), and gets a
//! [`Transition`]: the task to keep and the [`Action`]s to carry out, in order.
//!
//! # Durability first
//!
//! The record ([`Task::record`]) is what the machine intends; [`Task::saved`] is what the state
//! file last durably held, and it is what the API shows ([`Task::info`], [`Task::shown`]): the
//! in-memory state never claims what a crash would undo. The two exceptions follow from that
//! rule (SPEC §4, §5), where the container itself proves what is shown: a task whose container
//! no longer runs (it exited or vanished, a stop succeeded, or there never was one:
//! [`Task::container_ended`]) shows its termination at once, durable or not, since a restart
//! would read the end from the container itself (a crash before the write loses at most the
//! requested reason); and a task whose container was started and runs
//! ([`Task::container_runs`]) shows `running` at once, durable or not, since a restart reads
//! Docker first and restores a task whose container runs as `running` whatever its record
//! says (`pending` to `creating` included). So a start is shown `running` as soon as Docker
//! says the container runs, and `running` is never written on its own (start progress,
//! below). A step that changes the record returns exactly
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
//! the reason reads as the container's exit). Once the container is stopped the API shows the
//! termination (above). Nothing is acquired without a durable record: start steps still wait.
//!
//! The exception is start progress ([`Task::is_progress_only`]): a step that only advances the
//! status through `preparing`, `pulling`, `creating` and, once the container runs,
//! `running`, or records the id of the container just created, needs no write of its own.
//! Nothing a restore does depends on it: without a container every start status restores as
//! a start cut short, a record without a reason whose container is there restores as
//! `running`, and a container is found by its labels, not by a recorded id. The API keeps
//! showing the last durable status (and `running` once the container runs, which the
//! container itself proves), so the next start step goes out at once and the next write
//! carries the progress along; a restore that finds the container running leaves the record
//! as it is, for the same reason. Everything a crash could lose (the write-ahead of keys and
//! volumes, GPU ids, created directories, a termination) is still written before what follows
//! it. This keeps a start's state-file writes at one (`pending` at submit) when nothing is
//! acquired and the image is present; the engine writes `pulling` before an image is really
//! pulled, so a long pull shows it.
//!
//! # What the engine must do (checked by the simulated engine in `tests/properties.rs`)
//!
//! - Carry out [`Action::Persist`] (always alone in its list) under the same per-task lock as
//!   the step that returned it, and step [`Event::Persisted`] or [`Event::PersistFailed`]
//!   before the lock is released: no other step of the task may come between.
//! - Step the outcome of every action that has one (see each [`Action`]) — in particular one
//!   of [`Event::Released`] / [`Event::ReleaseFailed`] for every [`Effect::Release`], and
//!   [`Event::StartFinished`] whenever the start job returns, however it returns.
//! - When it stops carrying out a list because an action failed without an outcome event,
//!   step [`Event::ActionsAbandoned`] with that action and the rest of the list, so nothing
//!   stays marked as in flight.
//! - Launch start for every [`Task::new`] task (it counts as in flight from submit on).
//! - Carry out the actions of [`restore()`](crate::restore::restore) (GPU locks first) before
//!   the reconciler's first cycle.
//! - Reconciler, for each task whose start is not in flight: step
//!   [`Event::PersistRequested`] if [`Task::needs_write`], [`Event::Observed`] (for a terminated
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
//! One job per file: `event` (the vocabulary: [`Event`], [`Action`], [`Observation`],
//! [`StartStep`], [`TransitionError`], the messages), `task` ([`Task`] and what it answers
//! about itself), `transition` ([`step`], one function per family of events), `start` (the
//! chain of start steps), `due` (which side effects go out now) and `durability` (what a
//! change means for the state file: a write first, start progress, or nothing). This file
//! only declares them; none of them imports it.

mod due;
mod durability;
mod event;
mod start;
mod task;
mod transition;

pub(crate) use durability::finish_restore;
pub use event::{
    Action, EXIT_MESSAGE_LINES, EXIT_MESSAGE_MAX_BYTES, Effect, Event, NEVER_STARTED_MESSAGE,
    OOM_NOTE, Observation, StartStep, TransitionError, VANISHED_MESSAGE, WRITE_FAILED_PREFIX,
};
pub use task::{Saved, StopState, Task};
pub use transition::{Transition, exit_message, step};
