//! The records: the one place where a task's record changes and is written ([`RecordKeeper`]).
//!
//! - **The task and its step lock are private here.** A [`Slot`]'s task (the state machine's
//!   [`Task`], under a mutex) and its step lock are fields of this module only: everyone else
//!   reads the task through [`Slot::read`] and its few accessors, and changes it only by
//!   asking for a step ([`RecordKeeper::step`], through the driver's `drive` or an effect's
//!   [`Recorder`]). So every record change is a step of the state machine, taken under the
//!   task's step lock, and followed by its write before any other step of the task.
//! - **Persist and the directory's deletion are carried out here, and only here.** A step
//!   that returns [`Action::Persist`] has the record written at once, under the same lock, and
//!   the write's outcome stepped ([`RecordKeeper::step`]); [`RecordKeeper::delete_dir`] removes
//!   the record's directory once the record holds nothing. The store's record writes
//!   ([`Records`]) are opened here and held here alone: everyone else sees the store as
//!   [`Home`], which writes no record.
//! - **Task changes are sent here**, under the task's mutex, so a task's changes reach
//!   subscribers in the order they happened ([`crate::changes`]).
//! - **The end of a start is stamped here**: the step of [`Event::StartFinished`] stamps the
//!   slot first (a list requested before that cannot judge the task), and the start job stamps
//!   it again when it is over.
//!
//! This room knows nothing of side effects: the driver (`crate::driver`) carries out what a
//! step calls for through the effects, which record in the middle of an action through the
//! narrow [`Recorder`] (a volume's write-ahead, the container recreated by the NVIDIA display
//! retry, `pulling` before a real pull, a stall, the task forgotten).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use shim_runtime::RegistryAuth;
use shim_store::Store;
use shim_task::machine::{Action, Event, Task, step};
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
pub(crate) async fn open_store(home: PathBuf, deps: &crate::Deps) -> Result<(Records, Home)> {
    let store = tokio::task::spawn_blocking(move || Store::open(home)).await??;
    #[cfg(feature = "test-support")]
    let store = match &deps.store_faults {
        Some(faults) => store.with_faults(faults.clone()),
        None => store,
    };
    #[cfg(not(feature = "test-support"))]
    let _ = deps;
    let store = Arc::new(store);
    Ok((
        Records {
            store: store.clone(),
            preparing: Arc::new(AtomicBool::new(false)),
        },
        Home::new(store),
    ))
}

/// The task store's record writes (create, write, delete a task's directory): only this
/// module can use them.
pub(crate) struct Records {
    store: Arc<Store>,
    /// Spare task directories are being made in the background.
    preparing: Arc<AtomicBool>,
}

impl Records {
    /// Makes spare task directories in the background (one job at a time), so that a
    /// submit's first write finds one ready: one fsync of its record and one of the runners
    /// directory, shared with concurrent submits (`Store::create`).
    fn prepare_spares(&self) {
        if self.preparing.swap(true, Ordering::SeqCst) {
            return;
        }
        let (store, preparing) = (self.store.clone(), self.preparing.clone());
        tokio::task::spawn_blocking(move || {
            if let Err(e) = store.prepare_spares() {
                tracing::warn!(error = %chain(&e), "cannot prepare spare task directories; submits make their own");
            }
            preparing.store(false, Ordering::SeqCst);
        });
    }

    /// Creates the task directory and writes the record's first state file; a failure leaves
    /// nothing behind (or a skeleton the next start-up sweeps). Spares are made again once
    /// half of them are used (several in one background job).
    async fn create(&self, record: shim_task::TaskRecord) -> Result<()> {
        let created = self.create_now(record).await;
        if self.store.spares_ready() <= shim_store::SPARES / 2 {
            self.prepare_spares();
        }
        created
    }

    async fn create_now(&self, record: shim_task::TaskRecord) -> Result<()> {
        blocking(&self.store, move |store| match store.create(&record) {
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
        blocking(&self.store, move |store| match store.write(&record) {
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
        blocking(&self.store, move |store| store.delete(&container_name)).await
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
    /// When the start last finished ([`Clock::mono_ns`]; 0: never): a list requested before that
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
    /// Per kind of failure retried every second, the last errors logged as a warning and
    /// when ([`Slot::failed_loudly`]).
    warned: Mutex<[Option<(String, tokio::time::Instant)>; Retried::COUNT]>,
    /// A retry of the reconciler's is out for the task ([`Slot::begin_retry`]).
    retrying: Arc<AtomicBool>,
}

/// A retry out for one task; the next may begin once it is dropped.
pub(crate) struct RetryOut(Arc<AtomicBool>);

impl Drop for RetryOut {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// How often one task's side effect that keeps failing the same way is logged as a warning
/// (it is retried every second).
const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(600);

/// What a task retries every second while it fails ([`Slot::failed_loudly`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Retried {
    /// Its resources' release.
    Release,
    /// Its state file's write.
    Write,
    /// Its container's stop, or a look at it.
    Container,
}

impl Retried {
    const COUNT: usize = 3;
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
            warned: Mutex::new([None, None, None]),
            retrying: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Claims the task's retry: `None` while one is out (a stop that hangs for its whole bound
    /// is retried once at a time, on its own, holding up no other task's).
    pub(crate) fn begin_retry(&self) -> Option<RetryOut> {
        (!self.retrying.swap(true, Ordering::SeqCst)).then(|| RetryOut(self.retrying.clone()))
    }

    /// Whether a failure of `what` with `errors` is worth a warning: the first, one whose
    /// errors differ from the last warned, or the same again after [`WARN_EVERY`]. The retries
    /// every second in between are logged at debug, so a failure that lasts (an unmount kept
    /// busy over a weekend, a home remounted read-only, Docker down) does not fill the log.
    pub(crate) fn failed_loudly(&self, what: Retried, errors: &str) -> bool {
        // Numbers masked: a write's temp file is named anew at each try
        // (`.task.json.tmp-<pid>-<ns>.<n>`), which made every retry's text new.
        let mut masked = String::with_capacity(errors.len());
        for c in errors.chars() {
            match c.is_ascii_digit() {
                true if masked.ends_with('#') => {}
                true => masked.push('#'),
                false => masked.push(c),
            }
        }
        let errors = masked.as_str();
        let now = tokio::time::Instant::now();
        let mut warned = self.warned.lock().unwrap_or_else(|p| p.into_inner());
        let last = &mut warned[what as usize];
        let loud = match &*last {
            Some((errors_then, at)) => {
                errors_then != errors || now.duration_since(*at) >= WARN_EVERY
            }
            None => true,
        };
        if loud {
            *last = Some((errors.to_owned(), now));
        }
        loud
    }

    /// A task being submitted with `config` (its first write is [`RecordKeeper::submit`]'s): its
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

    /// When the start last finished ([`Clock::mono_ns`]; 0: never).
    pub(crate) fn start_returned(&self) -> u64 {
        self.start_returned.load(Ordering::SeqCst)
    }

    pub(crate) fn mark_start_returned(&self, mono_ns: u64) {
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

/// Whether a record made in the middle of an action is durable.
pub(crate) enum Written {
    /// Written: the action may go on.
    Durable,
    /// The write failed (the task has recorded the failure).
    Failed(EngineError),
}

/// What an effect may ask in the middle of its action: these records and nothing else. What a
/// record calls for (a stop or a release that a failed write lets go) is kept for the driver,
/// which carries it out when the action returns ([`Recorder::into_pending`]).
pub(crate) struct Recorder<'a> {
    records: &'a RecordKeeper,
    slot: &'a Arc<Slot>,
    pending: Mutex<Vec<Action>>,
}

impl<'a> Recorder<'a> {
    /// The recorder of one action of the task in `slot`.
    pub(crate) fn new(records: &'a RecordKeeper, slot: &'a Arc<Slot>) -> Self {
        Self {
            records,
            slot,
            pending: Mutex::new(Vec::new()),
        }
    }

    /// What the records made during the action call for, in order.
    pub(crate) fn into_pending(self) -> Vec<Action> {
        self.pending.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    fn defer(&self, actions: Vec<Action>) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(actions);
    }

    /// Steps `event` (written at once when it changes the record); what it calls for is
    /// carried out after the action, also when the write failed: the step has marked those
    /// actions as out (a stop or a release the failure lets go), so dropping them would leave
    /// them out forever.
    async fn record(&self, event: Event) -> Result<Written> {
        let (actions, failure) = self.records.step(self.slot, event).await?;
        self.defer(actions);
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
        match self.records.step(self.slot, Event::PersistRequested).await {
            Ok((actions, _)) => self.defer(actions),
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
        self.records.changes.send(
            &self.slot.id,
            ChangeKind::PullStalled {
                image: image.clone(),
                downloaded_bytes: *done_bytes,
                total_bytes: *total_bytes,
                stalled_ms: ms(stalled_for),
                elapsed_ms: ms(elapsed),
            },
            self.records.clock.now_ms(),
        );
    }

    /// The task is forgotten: subscribers are told, after every other change of the task.
    pub(crate) fn removed(&self) {
        let _order = self.slot.lock();
        self.records.changes.send(
            &self.slot.id,
            ChangeKind::Removed,
            self.records.clock.now_ms(),
        );
    }
}

/// Clears the "start job running" flag when the job ends, however it ends.
pub(crate) struct StartingGuard<'a>(&'a watch::Sender<bool>);

impl<'a> StartingGuard<'a> {
    /// Held by the start job of the task in `slot` (whose flag submit set).
    pub(crate) fn of(slot: &'a Slot) -> Self {
        Self(&slot.starting)
    }
}

impl Drop for StartingGuard<'_> {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// Steps tasks and writes their records (see the module docs).
pub(crate) struct RecordKeeper {
    records: Records,
    changes: Changes,
    metrics: Arc<Metrics>,
    clock: Clock,
}

impl RecordKeeper {
    /// The keeper writing through `records`, counting in `metrics`, stamping with `clock`.
    pub(crate) fn new(records: Records, metrics: Arc<Metrics>, clock: Clock) -> Self {
        Self {
            records,
            changes: Changes::new(),
            metrics,
            clock,
        }
    }

    /// Makes spare task directories in the background, for the next submits.
    pub(crate) fn prepare_spares(&self) {
        self.records.prepare_spares();
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
    /// ([`crate::driver::Driver::run_start`]).
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
    /// change the record hold the step lock ([`RecordKeeper::step`]).
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
    pub(crate) async fn step(
        &self,
        slot: &Slot,
        event: Event,
    ) -> Result<(Vec<Action>, Option<EngineError>)> {
        let deleted = slot.step_lock.lock().await;
        let mut actions = self.apply(slot, event)?;
        if actions.first() != Some(&Action::Persist) {
            return Ok((actions, None));
        }
        actions.remove(0);
        // Timed only where a file is written (a removed or stateless task's record is not).
        let timer = (!*deleted && !slot.stateless).then(WriteTimer::start);
        let written = self.write(slot, *deleted).await;
        if let Some(timer) = timer {
            timer.done(&self.metrics, written.is_ok());
        }
        let (outcome, failure) = match written {
            Ok(()) => (Event::Persisted, None),
            Err(e) => {
                let message = chain(&e);
                if slot.failed_loudly(Retried::Write, &message) {
                    tracing::warn!(task = %slot.id, error = %message, "cannot write the task's state; retried by the reconciler (the same failure is logged again in 10 minutes)");
                } else {
                    tracing::debug!(task = %slot.id, error = %message, "cannot write the task's state; retried by the reconciler");
                }
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

    /// Deletes the task's directory (renamed to a trash name first, then removed: SPEC §4)
    /// once it holds nothing; no later write recreates it.
    pub(crate) async fn delete_dir(&self, slot: &Slot) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A release (or a write, a stop) retried every second that keeps failing the same way
    /// warns once, then once every ten minutes; a different failure warns at once.
    #[tokio::test(start_paused = true)]
    async fn a_failure_retried_the_same_way_warns_once_in_ten_minutes() {
        let config = TaskConfig::new(
            TaskId::new("t1").unwrap(),
            shim_task::TaskName::new("job").unwrap(),
            "img:1",
        );
        let slot = Slot::submitted(&config, 0);
        let busy = "volume \"data\": device busy";
        assert!(slot.failed_loudly(Retried::Release, busy));
        for _ in 0..599 {
            tokio::time::advance(std::time::Duration::from_secs(1)).await;
            assert!(!slot.failed_loudly(Retried::Release, busy));
        }
        assert!(slot.failed_loudly(Retried::Release, "volume \"data\": no such device"));
        assert!(slot.failed_loudly(Retried::Release, busy));
        tokio::time::advance(WARN_EVERY).await;
        assert!(slot.failed_loudly(Retried::Release, busy));
        // Each kind on its own: a write failing is told even while the release is quiet.
        assert!(!slot.failed_loudly(Retried::Release, busy));
        assert!(slot.failed_loudly(Retried::Write, "No space left on device"));
        assert!(!slot.failed_loudly(Retried::Write, "No space left on device"));
        // One failure, retried: only its temp file's name moved on.
        let tmp = |n| {
            format!(
                "cannot write /h/runners/job-t1/.task.json.tmp-12-1765{n}.{n}: No space left on device (os error 28)"
            )
        };
        assert!(slot.failed_loudly(Retried::Write, &tmp(7)));
        assert!(!slot.failed_loudly(Retried::Write, &tmp(8)));
        assert!(!slot.failed_loudly(Retried::Write, &tmp(19)));
    }
}
