//! The driver: carries out what a task's steps call for, in order, through the effects, and
//! drives the task's long operations (the start job, terminate, remove) to their end.
//!
//! [`Driver::drive`] steps an event ([`RecordKeeper::step`]) and runs the resulting actions: the
//! steps' own ([`Action::Persist`] as a request, [`Action::DeleteTaskDir`]) here, every other
//! one through the effects, whose outcome event is stepped at once and whose further actions
//! run before the rest of the list (depth first). What an effect recorded in the middle of its
//! action calls for runs when the action returns, before its outcome is stepped. The room
//! below ([`crate::records`]) knows nothing of effects, and the effects know nothing of this
//! room: the layers run one way (driver → effects → records).

mod effects;

pub(crate) use effects::EffectParts;
use effects::Effects;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use shim_task::TaskInfo;
use shim_task::machine::{Action, Event, Task, TransitionError};

use crate::changes::Subscription;
use crate::clock::Clock;
use crate::error::{EngineError, Result, chain};
use crate::records::{RecordKeeper, Recorder, Slot, StartingGuard};

/// Carries out what steps call for (see the module docs).
pub(crate) struct Driver {
    records: RecordKeeper,
    effects: Arc<Effects>,
}

/// How long terminate and remove wait for a start job to let go of a task (a cancelled pull
/// returns at once; preparing a volume can take longer). Kept well under the dstack server's
/// 9-second request timeout: past it, start releases when it returns; remove answers 409 and
/// the server retries. Terminate's answer is bounded by its own budget
/// (`EngineConfig::terminate_slack`) whatever this wait does.
const START_SETTLE: Duration = Duration::from_secs(4);

/// How long remove waits for a release in flight (the reconciler's) to end.
const RELEASE_SETTLE: Duration = Duration::from_secs(4);

impl Driver {
    /// A driver stepping through `records` and carrying out effects through the effects it
    /// makes of `parts` (no other room can name them).
    pub(crate) fn new(records: RecordKeeper, parts: EffectParts) -> Self {
        let effects = Arc::new(Effects::new(parts));
        Self { records, effects }
    }

    /// The GPU lock (the effects' own).
    pub(crate) fn gpus(&self) -> &Arc<shim_resources::GpuLock> {
        self.effects.gpus()
    }

    /// How GPUs go to containers (the effects' own).
    pub(crate) fn gpu_passing(&self) -> &Arc<crate::gpus::GpuPassing> {
        self.effects.gpu_passing()
    }

    /// The clock records and changes are stamped with.
    pub(crate) fn clock(&self) -> Clock {
        self.records.clock()
    }

    /// Makes spare task directories in the background, for the next submits.
    pub(crate) fn prepare_spares(&self) {
        self.records.prepare_spares();
    }

    /// Every task change from now on.
    pub(crate) fn subscribe(&self) -> Subscription {
        self.records.subscribe()
    }

    /// Submit's first write ([`RecordKeeper::submit`]); the caller launches the start
    /// ([`Driver::run_start`]).
    pub(crate) async fn submit(&self, slot: &Slot) -> Result<TaskInfo> {
        self.records.submit(slot).await
    }

    /// Everything a terminate (`event`) calls for, to its end: the termination, then, once a
    /// start in flight has let go (bounded), the release of what the task still holds. A
    /// termination that cannot be written yet (a full disk) stops nothing: the task is
    /// stopped and released all the same, and the reconciler writes it when the disk allows
    /// (SPEC §4).
    pub(crate) async fn terminate(&self, slot: &Arc<Slot>, event: Event) -> Result<()> {
        match self.drive(slot, event).await {
            Ok(()) => {}
            Err(e @ EngineError::StateWrite { .. }) => {
                tracing::warn!(task = %slot.id, error = %chain(&e), "terminate: the termination cannot be written yet; the task is stopped and released all the same, and the reconciler writes it when the disk allows");
            }
            Err(e) => return Err(e),
        }
        // Start stops at its next step and releases what it acquired: wait for it, so the
        // server's remove that follows a terminate finds the task settled.
        slot.start_settled(START_SETTLE).await;
        if slot.read(Task::needs_release) {
            match self.drive(slot, Event::ReleaseRequested).await {
                Ok(()) | Err(EngineError::StateWrite { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Removes a terminated task, waiting (bounded) for a start job or a release in flight to
    /// let go of it rather than refusing; woken by the task's next step, not by polling.
    pub(crate) async fn remove(&self, slot: &Arc<Slot>) -> Result<()> {
        slot.start_settled(START_SETTLE).await;
        let deadline = tokio::time::Instant::now() + RELEASE_SETTLE;
        loop {
            let stepped = slot.next_step();
            tokio::pin!(stepped);
            stepped.as_mut().enable();
            match self.drive(slot, Event::RemoveRequested).await {
                Err(EngineError::Conflict(TransitionError::ReleaseInFlight { .. }))
                    if tokio::time::Instant::now() < deadline =>
                {
                    // The release ends with a step of the task: try again then (bounded).
                    let _ = tokio::time::timeout_at(deadline, stepped).await;
                }
                other => return other,
            }
        }
    }

    /// Feeds `event` to the task and carries out the resulting actions in order. The outcome
    /// of an action is stepped at once, and the actions it yields run before the rest of the
    /// list (depth first). Returns the first failure (a state write, an action without an
    /// outcome), after everything that could still be done was done.
    pub(crate) async fn drive(&self, slot: &Arc<Slot>, event: Event) -> Result<()> {
        let (actions, failure) = self.records.step(slot, event).await?;
        let result = self.run_actions(slot, actions).await;
        match failure {
            Some(e) => Err(e),
            None => result,
        }
    }

    /// Carries out `actions` in order (see [`Driver::drive`]).
    pub(crate) async fn run_actions(&self, slot: &Arc<Slot>, actions: Vec<Action>) -> Result<()> {
        let mut queue: VecDeque<Action> = actions.into();
        let mut first_failure = None;
        while let Some(action) = queue.pop_front() {
            let outcome = match &action {
                // A write asked for in a list: the step of the request carries it out, under
                // the step lock.
                Action::Persist => Ok(Some(Event::PersistRequested)),
                Action::DeleteTaskDir => self.records.delete_dir(slot).await.map(|()| None),
                Action::Effect(effect) => {
                    let recorder = Recorder::new(&self.records, slot);
                    let outcome = self.effects.execute(slot, effect.clone(), &recorder).await;
                    let pending = recorder.into_pending();
                    if !pending.is_empty()
                        && let Err(e) = Box::pin(self.run_actions(slot, pending)).await
                    {
                        first_failure.get_or_insert(e);
                    }
                    outcome
                }
            };
            let event = match outcome {
                Ok(Some(outcome)) => outcome,
                Ok(None) => continue,
                Err(e) => {
                    // The action failed without an outcome: the rest of the list is dropped,
                    // and the task is told, so nothing stays marked as in flight.
                    let message = chain(&e);
                    tracing::warn!(task = %slot.id, ?action, error = %message, "action failed");
                    let mut abandoned = vec![action];
                    abandoned.extend(queue.drain(..));
                    first_failure.get_or_insert(e);
                    Event::ActionsAbandoned {
                        actions: abandoned,
                        message,
                    }
                }
            };
            let (more, failure) = self.records.step(slot, event).await?;
            if let Some(e) = failure {
                first_failure.get_or_insert(e);
            }
            for a in more.into_iter().rev() {
                queue.push_front(a);
            }
        }
        match first_failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The start job: drives start from `StartBegan` until it finishes, whatever happens, and
    /// always gives up the task's ownership, also when the driver stopped on an error.
    pub(crate) async fn run_start(&self, slot: &Arc<Slot>) {
        // Set at submit, before this job was spawned; cleared when it is over.
        let _running = StartingGuard::of(slot);
        let outcome = self.drive(slot, Event::StartBegan).await;
        if let Err(e) = &outcome {
            tracing::error!(task = %slot.id, error = %chain(e), "start failed");
        }
        if slot.start_in_flight() {
            if let Err(e) = outcome {
                let ev = Event::StartAborted {
                    message: format!("start failed: {}", chain(&e)),
                };
                if let Err(e) = self.drive(slot, ev).await {
                    tracing::error!(task = %slot.id, error = %chain(&e), "aborting start failed");
                }
            }
            if slot.start_in_flight()
                && let Err(e) = self.drive(slot, Event::StartFinished).await
            {
                tracing::error!(task = %slot.id, error = %chain(&e), "finishing start failed");
            }
        }
        // Again now that the job is over (it may have released what start acquired).
        slot.mark_start_returned(self.clock().mono_ns());
    }
}
