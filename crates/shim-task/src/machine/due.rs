//! Which side effects go out now: what the task calls for and may do given what is durable.

use super::event::{Action, Effect, StartStep};
use super::start::start_action;
use super::task::{StopState, Task};

/// The side effects due now, marking each as out. Only [`Effect::FinishStart`] goes out while
/// the record is not durable, unless all that is not durable is start progress
/// ([`Task::is_progress_only`]), or its write failed ([`Task::write_failed`]: then what ends the
/// task, a stop, a pull cancel, a release, goes out too); everything else waits for the
/// write.
pub(super) fn due(t: &mut Task, actions: &mut Vec<Action>) {
    if t.releases_may_go() && t.cancel_pull {
        t.cancel_pull = false;
        actions.push(Action::Effect(Effect::CancelPull));
    }
    if t.releases_may_go()
        && let StopState::Wanted { timeout_s } = t.stop
    {
        t.stop = StopState::InFlight;
        actions.push(Action::Effect(Effect::StopContainer { timeout_s }));
    }
    if t.start_in_flight
        && !t.start_step_out
        && let Some(s) = t.start_step
        && (s == StartStep::Finish || !t.dirty || t.progress_only)
    {
        let action = start_action(t.config(), s).unwrap_or(Action::Effect(Effect::FinishStart));
        if matches!(action, Action::Effect(Effect::FinishStart)) {
            t.start_step = Some(StartStep::Finish);
        }
        t.start_step_out = true;
        actions.push(action);
    }
    if !t.release_backoff && t.needs_release() {
        if t.stop == StopState::Failed {
            t.stop = StopState::InFlight;
            actions.push(Action::Effect(Effect::StopContainer { timeout_s: 0 }));
        } else {
            t.release_in_flight = true;
            actions.push(Action::Effect(Effect::Release(t.held())));
        }
    }
}

/// Marks a settled terminated task that holds nothing as released.
pub(super) fn settle_released(t: &mut Task) {
    if t.terminated()
        && !t.start_in_flight
        && !t.release_in_flight
        && !t.record.resources.holds_any()
        && !t.record.resources.released
    {
        t.record.resources.released = true;
    }
}
