//! The chain of start steps: which steps a config has, the action of each, and moving from
//! one to the next as outcomes arrive.

use super::event::{Action, Effect, Event, StartStep, TransitionError};
use super::task::{StopState, Task};
use crate::config::TaskConfig;
use crate::info::HostKeysGrant;
use crate::status::{TaskStatus, TerminationReason};

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
pub(super) fn start_action(config: Option<&TaskConfig>, step: StartStep) -> Option<Action> {
    let c = config?;
    match step {
        StartStep::Finish => Some(Action::Effect(Effect::FinishStart)),
        StartStep::AcquireGpus => Some(Action::Effect(Effect::AcquireGpus { count: c.gpu })),
        StartStep::AddHostKeys => Some(Action::Effect(Effect::AddHostKeys(HostKeysGrant {
            user: c.host_ssh_user.clone(),
            keys: c.host_keys().0,
            upstream: false,
        }))),
        StartStep::MountVolume(i) => c
            .volumes
            .get(i)
            .cloned()
            .map(|v| Action::Effect(Effect::MountVolume(v))),
        StartStep::CreateDir(i) => c
            .instance_mounts
            .get(i)
            .map(|m| Action::Effect(Effect::CreateDir(m.instance_path.clone()))),
        StartStep::Pull => Some(Action::Effect(Effect::Pull {
            image: c.image_name.clone(),
        })),
        StartStep::CreateContainer => Some(Action::Effect(Effect::CreateContainer)),
        StartStep::StartContainer => Some(Action::Effect(Effect::StartContainer)),
    }
}

/// Makes `step` the step in progress (its action goes out once the record is durable) and
/// records what must be recorded ahead of it; a step the config does not have (or a task
/// without config) finishes start.
pub(super) fn begin(t: &mut Task, step: StartStep) {
    let step = match start_action(t.config(), step) {
        Some(Action::Effect(Effect::AddHostKeys(grant))) => {
            // Recorded ahead (and persisted before the add): a crash during the add cannot
            // leak the keys, and removing a task's keys that were never added is a no-op.
            t.record.resources.host_keys = Some(grant);
            step
        }
        Some(Action::Effect(Effect::Pull { .. })) => {
            t.set_status(TaskStatus::Pulling);
            step
        }
        Some(Action::Effect(Effect::CreateContainer)) => {
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
pub(super) fn advance(t: &mut Task) {
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
pub(super) fn expect(
    t: &Task,
    event: &'static str,
    ok: impl Fn(StartStep) -> bool,
) -> Result<(), TransitionError> {
    match t.start_step {
        Some(s) if t.start_in_flight && t.start_step_out && ok(s) => Ok(()),
        _ => Err(t.unexpected(event)),
    }
}

/// Whether `s` is a step of `preparing` (the host resources).
pub(super) fn is_preparing(s: StartStep) -> bool {
    matches!(
        s,
        StartStep::AcquireGpus
            | StartStep::AddHostKeys
            | StartStep::MountVolume(_)
            | StartStep::CreateDir(_)
    )
}

/// Steps an event of the start chain (from [`Event::StartBegan`] to [`Event::StartFinished`]):
/// the outcome of the step whose action is out moves the chain on (or ends it when the task
/// was terminated meanwhile: start stops at its next step).
pub(super) fn on_start_event(
    t: &mut Task,
    event: Event,
    name: &'static str,
) -> Result<(), TransitionError> {
    match event {
        Event::StartBegan => {
            if !t.start_in_flight || t.start_step.is_some() {
                return Err(t.unexpected(name));
            }
            if t.terminated() {
                begin(t, StartStep::Finish);
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
            // Recorded ahead of the mount; recorded again (its device named) when the mount
            // point turns out to hold another file system.
            expect(t, name, |s| matches!(s, StartStep::MountVolume(_)))?;
            t.record.resources.volumes.retain(|v| v.name != volume.name);
            t.record.resources.volumes.push(volume);
        }
        Event::VolumeMounted(volume) => {
            expect(t, name, |s| matches!(s, StartStep::MountVolume(_)))?;
            t.record.resources.volumes.retain(|v| v.name != volume.name);
            t.record.resources.volumes.push(volume);
            advance(t);
        }
        Event::DirCreated(path) => {
            expect(t, name, |s| matches!(s, StartStep::CreateDir(_)))?;
            t.cancel_pull = false;
            if !t.record.resources.created_dirs.contains(&path) {
                t.record.resources.created_dirs.push(path);
            }
            advance(t);
        }
        Event::DirExisted(_) => {
            expect(t, name, |s| matches!(s, StartStep::CreateDir(_)))?;
            t.cancel_pull = false;
            advance(t);
        }
        Event::PrepareFailed { message } => {
            expect(t, name, is_preparing)?;
            if t.start_step == Some(StartStep::AddHostKeys) {
                // The add is atomic: it failed, so nothing was added.
                t.record.resources.host_keys = None;
            }
            t.cancel_pull = false;
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
            t.record.container_id = Some(container_id);
            advance(t);
        }
        Event::CreateFailed { message } => {
            expect(t, name, |s| s == StartStep::CreateContainer)?;
            t.terminate(TerminationReason::CreatingContainerError, message);
            advance(t);
        }
        Event::ContainerRecreated { container_id } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.record.container_id = Some(container_id);
            t.ended = false;
            t.runs = false;
        }
        Event::ContainerStarted { ports } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.ports = Some(ports);
            t.runs = true;
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
        Event::StartRefused { message } => {
            expect(t, name, |s| s == StartStep::StartContainer)?;
            t.terminate(TerminationReason::CreatingContainerError, message);
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
            if t.record.container_id.is_none() {
                // Without a container, nothing of the task runs.
                t.ended = true;
            } else if t.ports.is_none() && t.stop == StopState::Idle {
                // A container whose start failed may run all the same: the start's answer
                // was lost and the look that would have told failed too, or it started and
                // the inspect of its ports failed. It is stopped before anything is released
                // (a container that never started stops at once), so that no GPU, volume or
                // key is given back under a running container.
                t.stop = StopState::Wanted { timeout_s: 0 };
            }
            t.start_in_flight = false;
            t.start_step = None;
            t.start_step_out = false;
            t.cancel_pull = false;
        }
        // The dispatcher (`transition::apply`) passes start events only.
        _ => return Err(t.unexpected(name)),
    }
    Ok(())
}
