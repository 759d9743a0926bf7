//! The step: one event in, the task changed and the actions out. [`apply`] dispatches each
//! event to its family (the start chain in `start`, requests, the container's news, releases,
//! writes), and `durability::finish` decides what goes out.

use super::durability::{PLAIN, Shape, finish};
use super::event::{
    Action, EXIT_MESSAGE_LINES, EXIT_MESSAGE_MAX_BYTES, Effect, Event, NEVER_STARTED_MESSAGE,
    OOM_NOTE, Observation, StartStep, TransitionError, VANISHED_MESSAGE, WRITE_FAILED_PREFIX,
};
use super::start::{begin, on_start_event};
use super::task::{Saved, StopState, Task};
use crate::status::{TaskStatus, TerminationReason};

/// The result of a step: the task to keep and what to do.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Transition {
    /// The task after the event.
    pub task: Task,
    /// The actions, in order.
    pub actions: Vec<Action>,
}

/// Steps a task through one event at time `now_ms` (Unix milliseconds).
///
/// On error the task is unchanged and nothing must be done.
pub fn step(task: &Task, event: Event, now_ms: u64) -> Result<Transition, TransitionError> {
    let mut t = task.clone();
    let mut actions = Vec::new();
    // Pull progress changes the view only, and the engine applies it outside the step lock,
    // maybe while a write it awaits is out: what is due waits for that write's outcome or the
    // next step (a `CancelPull` handed to progress would be dropped, and the pull run on).
    let progress = matches!(event, Event::PullProgressed(_));
    let shape = apply(&mut t, event, &mut actions)?;
    if progress {
        return Ok(Transition { task: t, actions });
    }
    let may_defer = t.start_in_flight;
    finish(&task.record, &mut t, &mut actions, shape, now_ms, may_defer);
    Ok(Transition { task: t, actions })
}

/// Applies one event: changes the task and may push actions that need no durable record (the
/// steps of a remove, the end of a given-up start).
fn apply(t: &mut Task, event: Event, actions: &mut Vec<Action>) -> Result<Shape, TransitionError> {
    let name = event_name(&event);
    match event {
        start @ (Event::StartBegan
        | Event::GpusAcquired(_)
        | Event::HostKeysAdded(_)
        | Event::VolumeMounting(_)
        | Event::VolumeMounted(_)
        | Event::DirCreated(_)
        | Event::DirExisted(_)
        | Event::PrepareFailed { .. }
        | Event::PullProgressed(_)
        | Event::PullSkipped
        | Event::PullDone(_)
        | Event::PullFailed { .. }
        | Event::ContainerCreated { .. }
        | Event::CreateFailed { .. }
        | Event::ContainerRecreated { .. }
        | Event::ContainerStarted { .. }
        | Event::StartFailed { .. }
        | Event::StartRefused { .. }
        | Event::StartAborted { .. }
        | Event::StartFinished) => on_start_event(t, start, name).map(|()| PLAIN),
        Event::TerminateRequested {
            reason,
            message,
            timeout_s,
        } => Ok(terminate_requested(t, reason, message, timeout_s)),
        Event::RemoveRequested => remove_requested(t, actions),
        // A stop's or a release's outcome while none is out is an engine bug: taken, a stray
        // stop would mark a running task's container ended and show a `running` task as
        // `pending` again (found by the property test at 3 million cases), a stray release
        // would drop from the record what the task still holds.
        Event::ContainerStopped | Event::StopFailed { .. } if t.stop != StopState::InFlight => {
            Err(t.unexpected(name))
        }
        Event::Released { .. } | Event::ReleaseFailed { .. } if !t.release_in_flight => {
            Err(t.unexpected(name))
        }
        Event::ContainerStopped => {
            t.stop = StopState::Idle;
            t.ended = true;
            Ok(PLAIN)
        }
        Event::StopFailed { .. } => {
            // Retried by the reconciler's next cycle, not at once.
            t.release_backoff = true;
            t.stop = StopState::Failed;
            Ok(PLAIN)
        }
        Event::Observed(observation) => {
            observed(t, observation);
            Ok(PLAIN)
        }
        Event::ReleaseRequested => {
            t.release_backoff = false;
            if t.needs_release() && t.stop == StopState::Failed {
                t.stop = StopState::Wanted { timeout_s: 0 };
            }
            Ok(RETRY)
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
            Ok(PLAIN)
        }
        Event::ReleaseFailed { .. } => {
            t.release_backoff = true;
            t.release_in_flight = false;
            Ok(PLAIN)
        }
        Event::GpusRelocked(locked) => {
            // Only what this task newly locked is its own: a GPU another restored task (a
            // duplicate, or a stale record) locked first must not be freed by this one.
            t.record.resources.gpus.retain(|g| locked.contains(g));
            Ok(PLAIN)
        }
        Event::Persisted => {
            t.dirty = false;
            t.write_failed = false;
            t.progress_only = false;
            t.saved = Saved::of(&t.record);
            Ok(PLAIN)
        }
        Event::PersistFailed { message } => Ok(persist_failed(t, message)),
        Event::PersistRequested => {
            t.release_backoff = false;
            Ok(RETRY)
        }
        Event::ActionsAbandoned {
            actions: abandoned,
            message,
        } => {
            actions_abandoned(t, &abandoned, message);
            Ok(PLAIN)
        }
    }
}

/// A request or the reconciler asking again: a write the record needs goes out even if this
/// event did not change it.
const RETRY: Shape = Shape {
    retry_write: true,
    no_write: false,
};

/// A terminate request: `terminated` with its reason (the first reason is kept), and the stop
/// or pull cancel the status calls for.
fn terminate_requested(
    t: &mut Task,
    reason: TerminationReason,
    message: String,
    timeout_s: u64,
) -> Shape {
    // A request, not a retry loop: whatever failed before may go out again.
    t.release_backoff = false;
    match t.record.status {
        TaskStatus::Terminated => {
            // A task terminated without a reason takes the reason of a later terminate
            // (upstream: runner/internal/shim/task.go, TaskStorage.Update).
            if t.record
                .termination_reason
                .as_ref()
                .is_some_and(|r| r.as_str().is_empty())
            {
                t.record.termination_reason = Some(reason);
                t.record.termination_message = super::task::without_nul(message);
            }
        }
        TaskStatus::Running => {
            t.terminate(reason, message);
            t.stop = StopState::Wanted { timeout_s };
        }
        _ => {
            t.terminate(reason, message);
            let cancellable = matches!(
                t.start_step,
                Some(StartStep::Pull | StartStep::CreateDir(_))
            );
            if t.start_in_flight && cancellable && t.start_step_out {
                t.cancel_pull = true;
            }
        }
    }
    RETRY
}

/// A remove request: only for a terminated task that start and release have let go of; the
/// steps of a remove go out at once (they need no durable record: it is deleted).
fn remove_requested(t: &mut Task, actions: &mut Vec<Action>) -> Result<Shape, TransitionError> {
    // Terminated durably, shown terminated, or terminated and its write failed: remove
    // deletes the record anyway, so the disk that could not take it does not keep the task.
    let terminated = t.record.status == TaskStatus::Terminated
        && (t.status() == TaskStatus::Terminated || t.write_failed);
    if !terminated {
        return Err(TransitionError::NotTerminated {
            id: t.record.id.clone(),
            status: t.status(),
        });
    }
    if t.start_in_flight {
        return Err(TransitionError::StartInFlight {
            id: t.record.id.clone(),
        });
    }
    if t.remove_in_flight {
        return Err(TransitionError::RemoveInFlight {
            id: t.record.id.clone(),
        });
    }
    if t.release_in_flight {
        return Err(TransitionError::ReleaseInFlight {
            id: t.record.id.clone(),
        });
    }
    t.remove_in_flight = true;
    t.release_backoff = true;
    // The container is force-removed: a stop still wanted (its record's write failed) is
    // moot. Should the removal fail, the reconciler sees a running container and stops it.
    if matches!(t.stop, StopState::Wanted { .. } | StopState::Failed) {
        t.stop = StopState::Idle;
    }
    actions.push(Action::Effect(Effect::RemoveContainer));
    if t.record.resources.holds_any() {
        t.release_in_flight = true;
        actions.push(Action::Effect(Effect::Release(t.held())));
    }
    actions.push(Action::DeleteTaskDir);
    actions.push(Action::Effect(Effect::Forget));
    Ok(PLAIN)
}

/// What the reconciler (or Docker's events) saw of the task's container: how a running task
/// ends, or whether a terminated task's container must still be stopped.
fn observed(t: &mut Task, observation: Observation) {
    if t.start_in_flight {
        return;
    }
    // An observation is the reconciler's (or Docker's) news, not a retry loop.
    t.release_backoff = false;
    if observation != Observation::Running {
        t.ended = true;
    }
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
        return;
    }
    match observation {
        Observation::Running => {}
        Observation::Exited { code: 0, .. } => {
            // Exit 0 is the runner's own end, even when the kernel killed some other process
            // of the container for memory (SPEC §2; upstream's waitContainer looks at the
            // exit code only).
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

/// A write of the record failed: what ends the task goes out without it (`due`), the write is
/// retried by the reconciler, and a start waiting on it is given up.
fn persist_failed(t: &mut Task, message: String) -> Shape {
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
    Shape {
        retry_write: false,
        no_write: true,
    }
}

/// The engine stopped carrying out a list: nothing it abandoned stays marked as in flight.
fn actions_abandoned(t: &mut Task, abandoned: &[Action], message: String) {
    t.release_backoff = true;
    for a in abandoned {
        match a {
            Action::Effect(Effect::StopContainer { .. }) => t.stop = StopState::Failed,
            // Remove dropped the stop it made moot; a removal that failed leaves a container
            // that may still run: it must stop before anything is released (found by the
            // property test: a later terminate released while the container ran).
            Action::Effect(Effect::RemoveContainer) if t.stop == StopState::Idle => {
                t.stop = StopState::Failed;
            }
            Action::Effect(Effect::Release(_)) => t.release_in_flight = false,
            // A remove cut short (its container's removal failed): it may be asked again.
            Action::Effect(Effect::Forget) => t.remove_in_flight = false,
            Action::Effect(Effect::CancelPull) => t.cancel_pull = true,
            a if a.is_start_step() && t.start_in_flight && t.start_step_out => {
                // The awaited outcome will never come: start is given up.
                t.cancel_pull = false;
                t.terminate(TerminationReason::ExecutorError, message.clone());
                begin(t, StartStep::Finish);
            }
            _ => {}
        }
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
        Event::StartRefused { .. } => "StartRefused",
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

/// The message of a container that exited with an error: its last log lines, at most
/// [`EXIT_MESSAGE_MAX_BYTES`] of them (the end, after `…`), and a note when the OOM killer
/// ended it.
pub fn exit_message(code: i64, last_lines: &[String], oom_killed: bool) -> String {
    let start = last_lines.len().saturating_sub(EXIT_MESSAGE_LINES);
    let mut message = match last_lines.get(start..) {
        Some(lines) if !lines.is_empty() => lines.join("\n"),
        _ => format!("container exited with code {code}"),
    };
    if message.len() > EXIT_MESSAGE_MAX_BYTES {
        let mut cut = message.len() - EXIT_MESSAGE_MAX_BYTES;
        while !message.is_char_boundary(cut) {
            cut += 1;
        }
        message = format!("…{}", &message[cut..]);
    }
    if oom_killed {
        message.push('\n');
        message.push_str(OOM_NOTE);
    }
    message
}
