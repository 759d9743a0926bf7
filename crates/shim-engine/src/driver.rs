//! The driver: the one place where a task's record changes and is written.
//!
//! - **The task and its step lock are private here.** A [`Slot`]'s task (the state machine's
//!   [`Task`], under a mutex) and its step lock are fields of this module only: everyone else
//!   reads the task through [`Slot::read`] and its few accessors, and changes it only by
//!   asking the driver to step an event ([`Driver::drive`]). So every record change is a step
//!   of the state machine, taken under the task's step lock, and followed by its write before
//!   any other step of the task.
//! - **Persist and the directory's deletion are carried out here, and only here.** A step
//!   that returns [`Action::Persist`] has the record written at once, under the same lock, and
//!   the write's outcome stepped
//!   ([`Driver::step`]); a `Persist` found later in a list is a request for that
//!   ([`Event::PersistRequested`]); [`Action::DeleteTaskDir`] removes the record's directory
//!   once the record holds nothing. The store's record writes ([`Records`]) are opened here and
//!   held by the driver alone: everyone else sees the store as [`Home`], which writes no
//!   record.
//! - **Task changes are sent here**, under the task's mutex, so a task's changes reach
//!   subscribers in the order they happened ([`crate::changes`]).
//! - **The end of a start is stamped here**: the step of [`Event::StartFinished`] stamps the
//!   slot first (a list requested before that cannot judge the task), and the start job stamps
//!   it again when it is over.
//!
//! The driver carries out the other actions through [`Execute`] (the effects, `crate::effects`:
//! a trait, because the effects record through the driver, so the driver may not name them).
//! The few effects that must record something in the middle of their action (a volume's
//! write-ahead, the container recreated by the NVIDIA display retry, `pulling` before a real
//! pull, a stall, the task forgotten) ask through the narrow [`Recorder`] they are given.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use shim_runtime::RegistryAuth;
use shim_store::Store;
use shim_task::machine::{Action, Event, Task, TransitionError, step};
use shim_task::{
    MountedVolume, PullProgress, Resources, TaskConfig, TaskId, TaskInfo, TaskRecord, TaskStatus,
};
use tokio::sync::watch;

use crate::changes::{ChangeKind, Changes, Subscription};
use crate::clock::Clock;
use crate::counters::{Metrics, WriteTimer};
use crate::error::{EngineError, Result, chain};
use crate::home::{Home, blocking};
use crate::pulling::Pulling;
use crate::queue::Observed;

/// Opens the task store under `home`: its record writes for the driver, the rest ([`Home`]) for
/// everyone.
pub(crate) async fn open_store(home: PathBuf) -> Result<(Records, Home)> {
    let store = Arc::new(tokio::task::spawn_blocking(move || Store::open(home)).await??);
    Ok((Records(store.clone()), Home::new(store)))
}

/// The task store's record writes (create, write, delete a task's directory): only this
/// module can use them.
pub(crate) struct Records(Arc<Store>);

impl Records {
    /// Creates the task directory and writes the record's first state file; a failure leaves
    /// nothing behind (or a skeleton the next start-up sweeps).
    async fn create(&self, record: shim_task::TaskRecord) -> Result<()> {
        blocking(&self.0, move |store| match store.create(&record) {
            Ok(_) => Ok(()),
            Err(e) => {
                // Nothing was acquired: leave nothing behind. Another task's directory
                // (`TaskExists`) holds a state file, which `remove_skeleton` leaves alone.
                if let Err(rm) = store.remove_skeleton(&record.container_name) {
                    tracing::warn!(error = %chain(&rm), "cannot remove the directory of a failed submit");
                }
                Err(e)
            }
        })
        .await
    }

    /// Writes the record (atomically, durably).
    async fn write(&self, record: shim_task::TaskRecord) -> Result<()> {
        blocking(&self.0, move |store| match store.write(&record) {
            Err(shim_store::StoreError::NoTaskDir { .. }) if record.config.is_none() => {
                // A task adopted from a container without a state file has no directory yet.
                store.create_task_dir(&record.container_name)?;
                store.write(&record)
            }
            other => other,
        })
        .await
    }

    /// Deletes the task's directory (renamed to a trash name first).
    async fn delete(&self, container_name: String) -> Result<()> {
        blocking(&self.0, move |store| store.delete(&container_name)).await
    }
}

/// One task in memory: the state machine's task, plus what only this process needs.
pub(crate) struct Slot {
    /// The task's id.
    pub(crate) id: TaskId,
    /// The task's container name (fixed at submit): its directory's name.
    pub(crate) container_name: String,
    /// The state machine's task. Replaced by a step only (a step returns a new task that
    /// replaces the old one in one assignment, so a panic cannot leave it half-updated).
    task: Mutex<Task>,
    /// Serializes the task's steps with their state writes: a step that changes the record,
    /// its write and the write's outcome are one unit no other step of the task comes between
    /// (so the file always ends with the newest state, and the durable view is exact). Guards
    /// "deleted" (set under it, so no write recreates a deleted task's directory). Never held
    /// across a side effect.
    step_lock: tokio::sync::Mutex<bool>,
    /// The task's state is never written: its container (made by the upstream shim before it
    /// kept state files) mounts the whole task directory, where the container could change it.
    stateless: bool,
    /// True while the start job runs (until it has also released what it must).
    starting: watch::Sender<bool>,
    /// When the start last finished ([`mono_ns`]; 0: never): a list requested before that
    /// cannot judge the task. Stamped before the task leaves the start's ownership, so a
    /// cycle never sees a finished start without it.
    start_returned: AtomicU64,
    /// The effects' part: the pull's credentials and cancellation.
    pub(crate) pulling: Pulling,
    /// The reconciler's part: the container's events and what they said.
    pub(crate) observed: Observed,
    /// Told after every step that replaced the task (what a caller waiting for the task to
    /// move on, such as a remove behind a release, waits on instead of polling).
    stepped: tokio::sync::Notify,
}

impl Slot {
    fn with(task: Task, auth: Option<RegistryAuth>, stateless: bool) -> Self {
        Self {
            id: task.record().id.clone(),
            container_name: task.record().container_name.clone(),
            task: Mutex::new(task),
            step_lock: tokio::sync::Mutex::new(false),
            stateless,
            starting: watch::Sender::new(false),
            start_returned: AtomicU64::new(0),
            pulling: Pulling::new(auth),
            observed: Observed::default(),
            stepped: tokio::sync::Notify::new(),
        }
    }

    /// A task being submitted with `config` (its first write is [`Driver::submit`]'s): its
    /// record, and its registry credentials (memory only). Host keys that are not one plain
    /// OpenSSH public key are never written, and said so.
    pub(crate) fn submitted(config: &TaskConfig, now_ms: u64) -> Self {
        let id = &config.id;
        let container_name = shim_task::naming::container_name(&config.name, id);
        let record = TaskRecord::new(config, container_name, now_ms);
        let auth = (!config.registry_username.is_empty() || !config.registry_password.is_empty())
            .then(|| RegistryAuth {
                username: config.registry_username.clone(),
                password: config.registry_password.expose().to_owned(),
            });
        let (_, skipped) = config.host_keys();
        for key in &skipped {
            tracing::warn!(task = %id, error = %key, "host SSH key skipped: not one plain OpenSSH public key (never written)");
        }
        Self::with(Task::new(record), auth, false)
    }

    /// A task restored at start-up (`stateless`: its state is never written, see the field).
    pub(crate) fn restored(task: Task, stateless: bool) -> Self {
        Self::with(task, None, stateless)
    }

    fn lock(&self) -> MutexGuard<'_, Task> {
        self.task.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the task.
    pub(crate) fn read<R>(&self, f: impl FnOnce(&Task) -> R) -> R {
        f(&self.lock())
    }

    /// A copy of the task.
    pub(crate) fn snapshot(&self) -> Task {
        self.lock().clone()
    }

    /// The API's view of the task.
    pub(crate) fn info(&self) -> TaskInfo {
        self.lock().info()
    }

    /// The status as the API shows it.
    pub(crate) fn status(&self) -> TaskStatus {
        self.lock().status()
    }

    /// Start owns the task.
    pub(crate) fn start_in_flight(&self) -> bool {
        self.lock().start_in_flight()
    }

    /// When the start last finished ([`mono_ns`]; 0: never).
    pub(crate) fn start_returned(&self) -> u64 {
        self.start_returned.load(Ordering::SeqCst)
    }

    fn mark_start_returned(&self, mono_ns: u64) {
        self.start_returned.store(mono_ns, Ordering::SeqCst);
    }

    /// Waits (at most `bound`) until no start job runs for this task.
    pub(crate) async fn start_settled(&self, bound: Duration) {
        let mut rx = self.starting.subscribe();
        let _ = tokio::time::timeout(bound, rx.wait_for(|running| !running)).await;
    }

    /// A wait for the task's next step: create it (and `enable` it) before the attempt whose
    /// outcome calls for waiting, so a step in between is not missed.
    pub(crate) fn next_step(&self) -> tokio::sync::futures::Notified<'_> {
        self.stepped.notified()
    }

    /// Pull progress: a step that never changes the record (only the view), so it needs no
    /// step lock and no write.
    pub(crate) fn pull_progressed(&self, progress: PullProgress, now_ms: u64) {
        let mut task = self.lock();
        if let Ok(tr) = step(&task, Event::PullProgressed(progress), now_ms) {
            *task = tr.task;
        }
    }
}

/// What carries out an action that is not the driver's own: the effects (`crate::effects`).
#[async_trait]
pub(crate) trait Execute: Send + Sync {
    /// Carries out `action` for the task in `slot` and returns its outcome event, if the
    /// action has one. An error stops the list (the driver tells the task). What must be
    /// recorded in the middle of the action goes through `recorder`.
    async fn execute(
        &self,
        slot: &Arc<Slot>,
        action: Action,
        recorder: Recorder<'_>,
    ) -> Result<Option<Event>>;
}

/// Whether a record made in the middle of an action is durable.
pub(crate) enum Written {
    /// Written: the action may go on.
    Durable,
    /// The write failed (the task has recorded the failure).
    Failed(EngineError),
}

/// What an effect may ask the driver in the middle of its action: these records and nothing
/// else.
pub(crate) struct Recorder<'a> {
    driver: &'a Driver,
    slot: &'a Arc<Slot>,
}

impl Recorder<'_> {
    /// Steps `event` (written at once when it changes the record), then carries out what it
    /// calls for, also when the write failed: the step has marked those actions as out (a
    /// stop or a release the failure lets go), so dropping them would leave them out forever.
    async fn record(&self, event: Event) -> Result<Written> {
        let (actions, failure) = self.driver.step(self.slot, event).await?;
        Box::pin(self.driver.run_actions(self.slot, actions)).await?;
        Ok(match failure {
            Some(e) => Written::Failed(e),
            None => Written::Durable,
        })
    }

    /// The write-ahead of a volume: recorded, and durable, before it is mounted.
    pub(crate) async fn volume_mounting(&self, volume: MountedVolume) -> Result<Written> {
        self.record(Event::VolumeMounting(volume)).await
    }

    /// The container the start replaced (the NVIDIA display retry): durable before it starts.
    pub(crate) async fn container_recreated(&self, container_id: String) -> Result<Written> {
        self.record(Event::ContainerRecreated { container_id })
            .await
    }

    /// A real pull begins: `pulling` (start progress, not written yet) is made durable, and
    /// so shown, before it. A failed write does not stop the pull: the task stays dirty and
    /// its next write (or the reconciler) carries it.
    pub(crate) async fn pulling(&self) {
        match self.driver.step(self.slot, Event::PersistRequested).await {
            Ok((actions, _)) if !actions.is_empty() => {
                if let Err(e) = Box::pin(self.driver.run_actions(self.slot, actions)).await {
                    tracing::warn!(task = %self.slot.id, error = %chain(&e), "an action due before the pull failed");
                }
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(task = %self.slot.id, error = %chain(&e), "cannot record that the pull begins");
            }
        }
    }

    /// The pull was given up as stalled (`error`): subscribers are told, before the
    /// termination that follows.
    pub(crate) fn pull_stalled(&self, error: &shim_runtime::RuntimeError) {
        let shim_runtime::RuntimeError::PullStalled {
            image,
            stalled_for,
            done_bytes,
            total_bytes,
            elapsed,
            ..
        } = error
        else {
            return;
        };
        let ms = |d: &std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let _order = self.slot.lock();
        self.driver.changes.send(
            &self.slot.id,
            ChangeKind::PullStalled {
                image: image.clone(),
                downloaded_bytes: *done_bytes,
                total_bytes: *total_bytes,
                stalled_ms: ms(stalled_for),
                elapsed_ms: ms(elapsed),
            },
            self.driver.clock.now_ms(),
        );
    }

    /// The task is forgotten: subscribers are told, after every other change of the task.
    pub(crate) fn removed(&self) {
        let _order = self.slot.lock();
        self.driver.changes.send(
            &self.slot.id,
            ChangeKind::Removed,
            self.driver.clock.now_ms(),
        );
    }
}

/// Clears the "start job running" flag when the job ends, however it ends.
struct StartingGuard<'a>(&'a watch::Sender<bool>);

impl Drop for StartingGuard<'_> {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// Steps tasks and carries out what the steps call for (see the module docs).
pub(crate) struct Driver {
    records: Records,
    changes: Changes,
    metrics: Arc<Metrics>,
    effects: Arc<dyn Execute>,
    clock: Clock,
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
    /// A driver writing through `records` and carrying out actions through `effects`.
    pub(crate) fn new(
        records: Records,
        metrics: Arc<Metrics>,
        effects: Arc<dyn Execute>,
        clock: Clock,
    ) -> Self {
        Self {
            records,
            changes: Changes::new(),
            metrics,
            effects,
            clock,
        }
    }

    /// The clock records and changes are stamped with.
    pub(crate) fn clock(&self) -> Clock {
        self.clock
    }

    /// Every task change from now on.
    pub(crate) fn subscribe(&self) -> Subscription {
        self.changes.subscribe()
    }

    /// Submit's first write, under the task's step lock like every other one: the state file
    /// exists before the answer, and before anything is acquired. On success the task is
    /// announced and its start counts as running; the caller launches it
    /// ([`Driver::run_start`]).
    pub(crate) async fn submit(&self, slot: &Slot) -> Result<TaskInfo> {
        let record = slot.lock().record().clone();
        {
            let _guard = slot.step_lock.lock().await;
            // Counted with every other state write (here with the directory's creation).
            let timer = WriteTimer::start();
            let created = self.records.create(record).await;
            timer.done(&self.metrics, created.is_ok());
            created.map_err(|e| match e {
                EngineError::Store(shim_store::StoreError::TaskExists { .. }) => {
                    EngineError::AlreadyExists(slot.id.clone())
                }
                other => other,
            })?;
        }
        let info = {
            let t = slot.lock();
            self.changes
                .send(&slot.id, ChangeKind::Submitted, self.clock.now_ms());
            t.info()
        };
        self.metrics.submitted.inc();
        slot.starting.send_replace(true);
        Ok(info)
    }

    /// Steps the state machine and tells subscribers and the metrics what the API now shows
    /// differently, in order: the changes are sent under the task's lock. Callers that may
    /// change the record hold the step lock ([`Driver::step`]).
    fn apply(&self, slot: &Slot, event: Event) -> Result<Vec<Action>> {
        if matches!(event, Event::StartFinished) {
            // Before the task leaves the start's ownership.
            slot.mark_start_returned(self.clock.mono_ns());
        }
        let mut task = slot.lock();
        let tr = step(&task, event, self.clock.now_ms())?;
        let changes = Changes::between(&task.shown(), &tr.task.shown());
        let created_at_ms = tr.task.record().created_at_ms;
        *task = tr.task;
        slot.stepped.notify_waiters();
        for change in changes {
            let now = self.clock.now_ms();
            match &change {
                ChangeKind::Status {
                    status: TaskStatus::Running,
                } => self
                    .metrics
                    .submit_to_running
                    .observe(now.saturating_sub(created_at_ms) as f64 / 1000.0),
                ChangeKind::Terminated {
                    termination_reason, ..
                } => {
                    self.metrics.terminated(termination_reason);
                    if let Some(exit_ns) = slot.observed.take_exit_ns() {
                        let now_ns = i64::try_from(u128::from(now) * 1_000_000).unwrap_or(0);
                        self.metrics
                            .exit_to_terminated
                            .observe(now_ns.saturating_sub(exit_ns).max(0) as f64 / 1e9);
                    }
                }
                _ => {}
            }
            self.changes.send(&slot.id, change, now);
        }
        Ok(tr.actions)
    }

    /// Writes the task's current record (the caller holds the step lock).
    async fn write(&self, slot: &Slot, deleted: bool) -> Result<()> {
        if deleted || slot.stateless {
            // Removed: nothing of it may come back on disk.
            return Ok(());
        }
        let record = slot.lock().record().clone();
        self.records.write(record).await
    }

    /// Steps `event` under the task's step lock. A leading [`Action::Persist`] is carried out
    /// at once, under the same lock, and its outcome stepped; the actions returned are what
    /// remains to do. A failed write is reported as the second value (the task has recorded
    /// it; what it still wants goes out once a later write succeeds).
    async fn step(&self, slot: &Slot, event: Event) -> Result<(Vec<Action>, Option<EngineError>)> {
        let deleted = slot.step_lock.lock().await;
        let mut actions = self.apply(slot, event)?;
        if actions.first() != Some(&Action::Persist) {
            return Ok((actions, None));
        }
        actions.remove(0);
        let timer = WriteTimer::start();
        let written = self.write(slot, *deleted).await;
        timer.done(&self.metrics, written.is_ok());
        let (outcome, failure) = match written {
            Ok(()) => (Event::Persisted, None),
            Err(e) => {
                let message = chain(&e);
                tracing::warn!(task = %slot.id, error = %message, "cannot write the task's state; retried by the reconciler");
                let failure = EngineError::StateWrite {
                    id: slot.id.clone(),
                    source: Box::new(e),
                };
                (Event::PersistFailed { message }, Some(failure))
            }
        };
        let more = self.apply(slot, outcome)?;
        // Relocks (the only actions a write may carry along) go first.
        actions.extend(more);
        Ok((actions, failure))
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
        let (actions, failure) = self.step(slot, event).await?;
        let result = self.run_actions(slot, actions).await;
        match failure {
            Some(e) => Err(e),
            None => result,
        }
    }

    /// Deletes the task's directory (renamed to a trash name first, then removed: SPEC §4)
    /// once it holds nothing; no later write recreates it.
    async fn delete_dir(&self, slot: &Slot) -> Result<()> {
        let held = slot.read(|t| t.record().resources.clone());
        if held.holds_any() {
            return Err(EngineError::ReleaseIncomplete {
                id: slot.id.clone(),
                message: describe(&held),
            });
        }
        let mut deleted = slot.step_lock.lock().await;
        self.records.delete(slot.container_name.clone()).await?;
        *deleted = true;
        Ok(())
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
                Action::DeleteTaskDir => self.delete_dir(slot).await.map(|()| None),
                other => {
                    let recorder = Recorder { driver: self, slot };
                    self.effects.execute(slot, other.clone(), recorder).await
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
            let (more, failure) = self.step(slot, event).await?;
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
        let _running = StartingGuard(&slot.starting);
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
        slot.mark_start_returned(self.clock.mono_ns());
    }
}

/// What a record still holds, for the error of a directory that cannot go yet.
fn describe(r: &Resources) -> String {
    let mut parts = Vec::new();
    if !r.gpus.is_empty() {
        parts.push(format!("GPUs {:?}", r.gpus));
    }
    if let Some(k) = &r.host_keys {
        parts.push(format!("SSH keys of {:?}", k.user));
    }
    if !r.volumes.is_empty() {
        let names: Vec<&str> = r
            .volumes
            .iter()
            .map(|v: &MountedVolume| v.name.as_str())
            .collect();
        parts.push(format!("volumes {names:?}"));
    }
    if let Some(u) = &r.unknown_keys {
        parts.push(match &u.user {
            Some(user) => format!("SSH keys of unknown origin of {user:?}"),
            None => "SSH keys of unknown origin".to_owned(),
        });
    }
    parts.join(", ")
}
