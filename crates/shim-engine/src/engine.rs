//! The engine: the task table, the public operations, and the driver that carries out the
//! state machine's actions.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shim_resources::{AuthorizedKeys, GpuLock, HostGpus, VolumeManager};
use shim_runtime::{ContainerEvent, ContainerRuntime, HostDevices, RegistryAuth};
use shim_store::Store;
use shim_task::machine::{Action, Event, Task, TransitionError, step};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskRecord, TaskStatus, TerminationReason};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use prometheus_client::registry::Registry;

use crate::changes::{ChangeKind, Changes, Subscription};
use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::labels::TaskRoots;
use crate::metrics::{Metered, Metrics, WriteTimer};

/// The external systems the engine works with. Real implementations for the binary, fakes for
/// tests.
#[derive(Clone)]
pub struct Deps {
    /// The container runtime (Docker).
    pub runtime: Arc<dyn ContainerRuntime>,
    /// The host's GPUs (detected, or a fake host); the engine keeps its lock over exactly
    /// these.
    pub host_gpus: HostGpus,
    /// When true the GPUs are accounted for but not passed to containers (a fake GPU host).
    pub fake_gpus: bool,
    /// The host users' authorized_keys.
    pub keys: Arc<dyn AuthorizedKeys>,
    /// Block volumes.
    pub volumes: Arc<dyn VolumeManager>,
    /// Host device facts for the container spec.
    pub host_devices: HostDevices,
}

/// One task in memory: the state machine's task, plus what only this process needs.
pub(crate) struct Slot {
    pub(crate) id: TaskId,
    /// The task's container name (fixed at submit): its directory's name.
    pub(crate) container_name: String,
    task: Mutex<Task>,
    /// Serializes the task's steps with their state writes: a step that changes the record,
    /// its write and the write's outcome are one unit no other step of the task comes between
    /// (so the file always ends with the newest state, and the durable view is exact). Guards
    /// `deleted` (set under it, so no write recreates a deleted task's directory). Never held
    /// across a side effect.
    step_lock: tokio::sync::Mutex<bool>,
    /// True while the start job runs (until it has also released what it must).
    starting: tokio::sync::watch::Sender<bool>,
    /// Cancels the pull in flight.
    pub(crate) pull_cancel: CancellationToken,
    /// Registry credentials from submit: memory only.
    pub(crate) auth: Option<RegistryAuth>,
    /// The task's state is never written: its container (made by the upstream shim before it
    /// kept state files) mounts the whole task directory, where the container could change it.
    stateless: bool,
    /// Container events waiting to be handled, in order, and whether a worker handles them.
    events: Mutex<(VecDeque<ContainerEvent>, bool)>,
    /// An `oom` event came for the container: its `die` reports it.
    pub(crate) oom: AtomicBool,
    /// When the start job last finished ([`mono_ns`]; 0: never): a list requested before
    /// that cannot judge the task. Set before the task leaves the start's ownership, so a
    /// cycle never sees a finished start without it.
    pub(crate) start_returned: AtomicU64,
    /// Unix ns when the task's container exited, as Docker reports it (0: unknown): the
    /// start of the exit → terminated latency.
    pub(crate) exit_ns: AtomicI64,
}

impl Slot {
    pub(crate) fn new(task: Task, auth: Option<RegistryAuth>) -> Self {
        Self {
            id: task.record().id.clone(),
            container_name: task.record().container_name.clone(),
            task: Mutex::new(task),
            step_lock: tokio::sync::Mutex::new(false),
            starting: tokio::sync::watch::Sender::new(false),
            pull_cancel: CancellationToken::new(),
            auth,
            stateless: false,
            events: Mutex::new((VecDeque::new(), false)),
            oom: AtomicBool::new(false),
            start_returned: AtomicU64::new(0),
            exit_ns: AtomicI64::new(0),
        }
    }

    /// Queues a container event for the task.
    pub(crate) fn queue_event(&self, event: ContainerEvent) {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .push_back(event);
    }

    /// Claims the right to handle the task's queued events; false if a worker already does,
    /// or nothing is queued.
    pub(crate) fn claim_event_worker(&self) -> bool {
        let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
        if q.1 || q.0.is_empty() {
            return false;
        }
        q.1 = true;
        true
    }

    /// The next queued event for the worker; `None` ends the worker's claim (atomically with
    /// finding the queue empty, so no event is left behind).
    pub(crate) fn next_event(&self) -> Option<ContainerEvent> {
        let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let next = q.0.pop_front();
        if next.is_none() {
            q.1 = false;
        }
        next
    }

    /// A task restored at start-up (`stateless`: see [`Slot::stateless`]).
    pub(crate) fn restored(task: Task, stateless: bool) -> Self {
        Self {
            stateless,
            ..Self::new(task, None)
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Task> {
        // A panic while holding this lock cannot leave the task half-updated: `step` returns
        // a new task that replaces the old one in a single assignment.
        self.task.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits (at most `bound`) until no start job runs for this task.
    pub(crate) async fn start_settled(&self, bound: Duration) {
        let mut rx = self.starting.subscribe();
        let _ = tokio::time::timeout(bound, rx.wait_for(|running| !running)).await;
    }

    pub(crate) fn snapshot(&self) -> Task {
        self.lock().clone()
    }

    /// Steps the state machine atomically; the task is replaced only on success. Callers that
    /// may change the record go through [`Inner::step`], which holds the step lock.
    pub(crate) fn step_volatile(&self, event: Event) -> Result<Vec<Action>> {
        let mut task = self.lock();
        let tr = step(&task, event, now_ms())?;
        *task = tr.task;
        Ok(tr.actions)
    }

    /// Stamps the end of a start: called before the task leaves the start's ownership (and
    /// again when the start job is over), so a cycle never sees a finished start without it.
    pub(crate) fn mark_start_returned(&self) {
        self.start_returned.store(mono_ns(), Ordering::SeqCst);
    }
}

/// Nanoseconds on a monotonic clock since the first call in this process, plus one (never 0):
/// orders a list request against the end of a start, which milliseconds cannot (both may fall
/// in the same one).
pub(crate) fn mono_ns() -> u64 {
    static BASE: OnceLock<std::time::Instant> = OnceLock::new();
    let base = *BASE.get_or_init(std::time::Instant::now);
    u64::try_from(base.elapsed().as_nanos())
        .unwrap_or(u64::MAX - 1)
        .saturating_add(1)
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// An error with its whole cause chain, as the API answers and the log show it: each cause
/// appended after `: ` unless the text so far already says it.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

pub(crate) struct Inner {
    pub(crate) cfg: EngineConfig,
    pub(crate) deps: Deps,
    /// The GPU lock over `deps.host_gpus` (memory only: a new process starts with none).
    pub(crate) gpus: GpuLock,
    /// The background jobs (event listener, reconciler), awaited at shutdown.
    pub(crate) background: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) store: Arc<Store>,
    pub(crate) owner: String,
    /// Where this home's task directories are: a container whose runner mount lies there is
    /// this shim's ([`crate::labels`]).
    pub(crate) roots: TaskRoots,
    pub(crate) tasks: Mutex<BTreeMap<TaskId, Arc<Slot>>>,
    /// Asks the reconciler for a full list now (the event stream reconnected).
    pub(crate) relist: Notify,
    /// Unix ns of the newest container event seen (the resubscription's `since`).
    pub(crate) events_since: AtomicI64,
    /// The event stream is connected.
    pub(crate) events_connected: AtomicBool,
    /// How many times the event stream connected.
    pub(crate) events_reconnects: AtomicU64,
    /// Task changes, for subscribers.
    pub(crate) changes: Changes,
    /// The engine's metrics.
    pub(crate) metrics: Arc<Metrics>,
    /// Where the metrics are registered (set once, right after the engine is built).
    pub(crate) registry: OnceLock<Registry>,
    /// Unix ms of the last successful reconcile cycle.
    pub(crate) last_cycle_ms: Mutex<Option<u64>>,
    pub(crate) shutdown: CancellationToken,
    /// Start jobs in flight (graceful shutdown waits for them, with a bound).
    pub(crate) jobs: Mutex<Vec<JoinHandle<()>>>,
    /// Images (with their tag) this engine saw present: a start of one skips the image
    /// check; a create that finds it gone pulls it and creates again.
    pub(crate) known_images: Mutex<BTreeSet<String>>,
}

impl Inner {
    pub(crate) fn table(&self) -> MutexGuard<'_, BTreeMap<TaskId, Arc<Slot>>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn slot(&self, id: &TaskId) -> Result<Arc<Slot>> {
        self.table()
            .get(id)
            .cloned()
            .ok_or_else(|| EngineError::NotFound(id.clone()))
    }

    pub(crate) fn slots(&self) -> Vec<Arc<Slot>> {
        self.table().values().cloned().collect()
    }

    /// Runs the store's blocking IO off the async workers.
    pub(crate) async fn blocking<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Store) -> std::result::Result<T, shim_store::StoreError> + Send + 'static,
    {
        let store = self.store.clone();
        Ok(tokio::task::spawn_blocking(move || f(&store)).await??)
    }

    /// Writes the task's current record (the caller holds the step lock).
    async fn write(&self, slot: &Slot, deleted: bool) -> Result<()> {
        if deleted || slot.stateless {
            // Removed: nothing of it may come back on disk.
            return Ok(());
        }
        let record: TaskRecord = slot.lock().record().clone();
        self.blocking(move |store| match store.write(&record) {
            Err(shim_store::StoreError::NoTaskDir { .. }) if record.config.is_none() => {
                // A task adopted from a container without a state file has no directory yet.
                store.create_task_dir(&record.container_name)?;
                store.write(&record)
            }
            other => other,
        })
        .await
    }

    /// Steps the state machine (the caller holds the step lock when the step may change the
    /// record) and tells subscribers and the metrics what the API now shows differently, in
    /// order: the changes are sent under the task's lock.
    pub(crate) fn apply(&self, slot: &Slot, event: Event) -> Result<Vec<Action>> {
        let mut task = slot.lock();
        let tr = step(&task, event, now_ms())?;
        let changes = Changes::between(task.saved(), tr.task.saved());
        let created_at_ms = tr.task.record().created_at_ms;
        *task = tr.task;
        for change in changes {
            let now = now_ms();
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
                    let exit_ns = slot.exit_ns.swap(0, Ordering::SeqCst);
                    if exit_ns > 0 {
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

    /// The last successful full cycle (Unix ms).
    pub(crate) fn last_cycle(&self) -> Option<u64> {
        *self.last_cycle_ms.lock().unwrap_or_else(|p| p.into_inner())
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

    /// Whether `slot` is still the task table's entry for its task (not removed).
    pub(crate) fn holds(&self, slot: &Arc<Slot>) -> bool {
        self.table()
            .get(&slot.id)
            .is_some_and(|s| Arc::ptr_eq(s, slot))
    }

    /// What a terminate does, to its end: the step (its write, its stop or pull cancel),
    /// then, once start let go (bounded), the release. A state write that fails does not stop
    /// it: the stop and the release do not wait for the disk (SPEC §4).
    async fn terminate_job(self: &Arc<Self>, slot: &Arc<Slot>, event: Event) -> Result<()> {
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
        if slot.lock().needs_release() {
            match self.drive(slot, Event::ReleaseRequested).await {
                Ok(()) | Err(EngineError::StateWrite { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Deletes the task's directory; no later write recreates it.
    pub(crate) async fn delete_dir(&self, slot: &Slot) -> Result<()> {
        let mut deleted = slot.step_lock.lock().await;
        let name = slot.container_name.clone();
        self.blocking(move |store| store.delete(&name)).await?;
        *deleted = true;
        Ok(())
    }

    /// Feeds `event` to the task and carries out the resulting actions in order. The outcome
    /// of an action is stepped at once, and the actions it yields run before the rest of the
    /// list (depth first). Returns the first failure (a state write, an action without an
    /// outcome), after everything that could still be done was done.
    pub(crate) async fn drive(self: &Arc<Self>, slot: &Arc<Slot>, event: Event) -> Result<()> {
        let (actions, failure) = self.step(slot, event).await?;
        let result = self.run_actions(slot, actions).await;
        match failure {
            Some(e) => Err(e),
            None => result,
        }
    }

    pub(crate) async fn run_actions(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        actions: Vec<Action>,
    ) -> Result<()> {
        let mut queue: VecDeque<Action> = actions.into();
        let mut first_failure = None;
        while let Some(action) = queue.pop_front() {
            let event = match self.execute(slot, action.clone()).await {
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

    /// The start job: drives start from `StartBegan` until it finishes, whatever happens.
    pub(crate) async fn run_start(self: Arc<Self>, slot: Arc<Slot>) {
        // Set at submit, before this job was spawned; cleared when it is over.
        let _running = StartingGuard(&slot.starting);
        let outcome = self.drive(&slot, Event::StartBegan).await;
        if let Err(e) = &outcome {
            tracing::error!(task = %slot.id, error = %chain(e), "start failed");
        }
        // Start must always give up ownership, also when the driver stopped on an error.
        if slot.lock().start_in_flight() {
            if let Err(e) = outcome {
                let ev = Event::StartAborted {
                    message: format!("start failed: {}", chain(&e)),
                };
                if let Err(e) = self.drive(&slot, ev).await {
                    tracing::error!(task = %slot.id, error = %chain(&e), "aborting start failed");
                }
            }
            if slot.lock().start_in_flight() {
                slot.mark_start_returned();
                if let Err(e) = self.drive(&slot, Event::StartFinished).await {
                    tracing::error!(task = %slot.id, error = %chain(&e), "finishing start failed");
                }
            }
        }
        slot.mark_start_returned();
        // Events that came while start owned the task.
        self.kick_events(&slot);
    }
}

/// Clears the "start job running" flag when the job ends, however it ends.
struct StartingGuard<'a>(&'a tokio::sync::watch::Sender<bool>);

impl Drop for StartingGuard<'_> {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// How long terminate and remove wait for a start job to let go of a task (a cancelled pull
/// returns at once; preparing a volume can take longer). Kept well under the dstack server's
/// 9-second request timeout: past it, start releases when it returns; remove answers 409 and
/// the server retries. Terminate's answer is bounded by its own budget
/// ([`EngineConfig::terminate_slack`]) whatever this wait does.
const START_SETTLE: Duration = Duration::from_secs(4);

/// How long remove waits for a release in flight (the reconciler's) to end.
const RELEASE_SETTLE: Duration = Duration::from_secs(4);

/// What [`Engine::health`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineHealth {
    /// Docker's event stream is connected (exits are seen as they happen).
    pub events_connected: bool,
    /// How long ago the last successful full container list was (`None`: none yet).
    pub last_cycle_age: Option<Duration>,
    /// The period of the full list.
    pub backstop: Duration,
}

impl EngineHealth {
    /// Ready: the event stream is connected and a full list succeeded within two backstop
    /// periods. A shim that is not ready answers from what it knew last; exits it has not
    /// seen yet are seen once Docker answers again.
    pub fn is_ready(&self) -> bool {
        self.events_connected
            && self
                .last_cycle_age
                .is_some_and(|age| age <= self.backstop.saturating_mul(2))
    }
}

/// How [`Engine::shutdown`] treats start jobs in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// Wait for them to finish, at most this long.
    Graceful(Duration),
    /// Do not wait.
    Now,
}

/// The shim engine. Cheap to clone; all clones share one task table.
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
}

impl Engine {
    /// Opens the engine on `cfg.home`: restores every task of this shim (state files and
    /// containers carrying its owner label), runs the first reconcile cycle, then starts the
    /// background reconciler. When this returns the engine is ready to serve: containers that
    /// exited while the shim was down have been processed.
    pub async fn open(cfg: EngineConfig, deps: Deps) -> Result<Engine> {
        let home = cfg.home.clone();
        let store = Arc::new(tokio::task::spawn_blocking(move || Store::open(home)).await??);
        let owner = crate::restore::determine_owner(&store, deps.runtime.as_ref()).await?;
        let roots = {
            let home = store.home().to_path_buf();
            tokio::task::spawn_blocking(move || TaskRoots::of_home(&home)).await?
        };
        // Events are read from before the start-up list on: nothing falls between them.
        let since = i64::try_from(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        )
        .unwrap_or(i64::MAX);
        let metrics = Arc::new(Metrics::new());
        let deps = Deps {
            runtime: Arc::new(Metered {
                runtime: deps.runtime,
                metrics: metrics.clone(),
            }),
            ..deps
        };
        let inner = Arc::new(Inner {
            changes: Changes::new(),
            metrics,
            registry: OnceLock::new(),
            gpus: GpuLock::for_host(&deps.host_gpus),
            background: Mutex::new(Vec::new()),
            cfg,
            deps,
            store,
            owner,
            roots,
            tasks: Mutex::new(BTreeMap::new()),
            relist: Notify::new(),
            events_since: AtomicI64::new(since),
            events_connected: AtomicBool::new(false),
            events_reconnects: AtomicU64::new(0),
            last_cycle_ms: Mutex::new(None),
            shutdown: CancellationToken::new(),
            jobs: Mutex::new(Vec::new()),
            known_images: Mutex::new(BTreeSet::new()),
        });
        let mut registry = Registry::default();
        inner
            .metrics
            .register(&mut registry, Arc::downgrade(&inner));
        let _ = inner.registry.set(registry);
        let (listed, listed_at) = inner.restore_all().await?;
        inner.first_cycle(listed, listed_at).await;
        let first = inner.first_subscription().await;
        let handles = crate::reconcile::spawn_background(&inner, first);
        *inner.background.lock().unwrap_or_else(|p| p.into_inner()) = handles;
        Ok(Engine { inner })
    }

    /// The owner identity scoping this shim's containers.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// Unix milliseconds of the last successful reconcile cycle.
    pub fn last_reconcile_ms(&self) -> Option<u64> {
        *self
            .inner
            .last_cycle_ms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The host's GPUs as the engine accounts for them.
    pub fn host_gpus(&self) -> &HostGpus {
        &self.inner.deps.host_gpus
    }

    /// Subscribes to every task change from now on (see [`crate::changes`]): submitted,
    /// each status step, terminated with its reason and message, released, removed, in
    /// order per task; a subscriber that falls far behind is told to resync.
    ///
    /// ```no_run
    /// # async fn watch(engine: shim_engine::Engine) {
    /// let mut changes = engine.subscribe();
    /// loop {
    ///     match changes.recv().await {
    ///         Ok(change) => println!("{} {:?}", change.task, change.kind),
    ///         Err(shim_engine::SubscriptionError::Lagged { .. }) => {
    ///             // Resync: the current state of every task.
    ///             for (id, status) in engine.list() {
    ///                 println!("{id} is {status}");
    ///             }
    ///         }
    ///         Err(shim_engine::SubscriptionError::Closed) => break,
    ///     }
    /// }
    /// # }
    /// ```
    pub fn subscribe(&self) -> Subscription {
        self.inner.changes.subscribe()
    }

    /// The engine's metrics in Prometheus' text format (OpenMetrics), to serve or to append to
    /// an embedder's own (see [`crate::metrics`]).
    pub fn encode_metrics(&self, out: &mut String) -> std::fmt::Result {
        match self.inner.registry.get() {
            Some(r) => prometheus_client::encoding::text::encode(out, r),
            None => Ok(()),
        }
    }

    /// Whether the engine keeps up with Docker: the event stream is connected, and when the
    /// last successful full list was. A readiness signal independent of the API's
    /// healthcheck (which only says the process answers).
    pub fn health(&self) -> EngineHealth {
        let last = self.inner.last_cycle();
        EngineHealth {
            events_connected: self.inner.events_connected.load(Ordering::SeqCst),
            last_cycle_age: last.map(|l| Duration::from_millis(now_ms().saturating_sub(l))),
            backstop: self.inner.cfg.reconcile_interval,
        }
    }

    /// The GPU lock (which GPUs tasks hold now).
    pub fn gpu_lock(&self) -> &GpuLock {
        &self.inner.gpus
    }

    /// Submits a task: validates the config, creates the task directory and writes the state
    /// file, then launches start in the background and returns the `pending` task.
    pub async fn submit(&self, config: TaskConfig) -> Result<TaskInfo> {
        config.validate()?;
        let inner = &self.inner;
        let id = config.id.clone();
        let container_name = shim_task::naming::container_name(&config.name, &id);
        let record = TaskRecord::new(&config, container_name, now_ms());
        let auth = (!config.registry_username.is_empty() || !config.registry_password.is_empty())
            .then(|| RegistryAuth {
                username: config.registry_username.clone(),
                password: config.registry_password.expose().to_owned(),
            });
        let (_, skipped) = config.host_keys();
        for key in &skipped {
            tracing::warn!(task = %id, error = %key, "host SSH key skipped: not one plain OpenSSH public key (never written)");
        }
        let slot = Arc::new(Slot::new(Task::new(record.clone()), auth));
        {
            let mut table = inner.table();
            if table.contains_key(&id) {
                return Err(EngineError::AlreadyExists(id));
            }
            table.insert(id.clone(), slot.clone());
        }
        // The first write, under the task's step lock like every other one: the state file
        // exists before the answer, and before anything is acquired.
        let created = {
            let _guard = slot.step_lock.lock().await;
            // Counted with every other state write (here with the directory's creation).
            let timer = WriteTimer::start();
            let created = inner
                .blocking(move |store| {
                    match store.create(&record) {
                        Ok(_) => Ok(()),
                        Err(e) => {
                            // Nothing was acquired: leave nothing behind (or a skeleton the
                            // next start-up sweeps). Another task's directory (`TaskExists`)
                            // holds a state file, which `remove_skeleton` leaves alone.
                            if let Err(rm) = store.remove_skeleton(&record.container_name) {
                                tracing::warn!(error = %rm, "cannot remove the directory of a failed submit");
                            }
                            Err(e)
                        }
                    }
                })
                .await;
            timer.done(&inner.metrics, created.is_ok());
            created
        };
        if let Err(e) = created {
            inner.table().remove(&id);
            return Err(match e {
                EngineError::Store(shim_store::StoreError::TaskExists { .. }) => {
                    EngineError::AlreadyExists(id)
                }
                other => other,
            });
        }
        let info = {
            let t = slot.lock();
            inner.changes.send(&id, ChangeKind::Submitted, now_ms());
            t.info()
        };
        inner.metrics.submitted.inc();
        slot.starting.send_replace(true);
        tracing::info!(task = %id, image = %config.image_name, "task submitted");
        let job = tokio::spawn(inner.clone().run_start(slot));
        let mut jobs = inner.jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.retain(|j| !j.is_finished());
        jobs.push(job);
        Ok(info)
    }

    /// The task's current view.
    pub fn task_info(&self, id: &TaskId) -> Result<TaskInfo> {
        Ok(self.inner.slot(id)?.lock().info())
    }

    /// Whether the task's start job still owns it (the reconciler leaves such tasks alone).
    pub fn is_starting(&self, id: &TaskId) -> Result<bool> {
        Ok(self.inner.slot(id)?.lock().start_in_flight())
    }

    /// Every known task (terminated included) with its status.
    pub fn list(&self) -> Vec<(TaskId, TaskStatus)> {
        self.inner
            .slots()
            .iter()
            .map(|s| (s.id.clone(), s.lock().status()))
            .collect()
    }

    /// Terminates a task: in any status but `terminated` it becomes `terminated` with the given
    /// reason and message; a running container is stopped with `timeout` (0 kills at once), a
    /// pull in flight is cancelled at once, and start stops at its next step. A terminated task
    /// is left as it is (its first reason is kept). Resources are released, by start when it
    /// still owns the task.
    ///
    /// Answers within `timeout` + [`EngineConfig::terminate_slack`] whatever the host does
    /// (SPEC §4): a start in flight, a slow stop, a slow unmount or a busy daemon finish in the
    /// background, and the answer is the task's view then, which shows what is durable. A
    /// state file that cannot be written (a full disk) does not fail the terminate: the stop
    /// and the release go out all the same, the view keeps showing the last durable status
    /// until the reconciler writes the termination, and a remove is accepted.
    pub async fn terminate(
        &self,
        id: &TaskId,
        reason: TerminationReason,
        message: String,
        timeout: Duration,
    ) -> Result<TaskInfo> {
        let slot = self.inner.slot(id)?;
        let budget = timeout.saturating_add(self.inner.cfg.terminate_slack);
        let deadline = tokio::time::Instant::now().checked_add(budget);
        let event = Event::TerminateRequested {
            reason,
            message,
            timeout_s: timeout.as_secs(),
        };
        // Everything terminate calls for runs in a job of its own, to its end; the answer
        // waits for it only until the deadline.
        let job = {
            let inner = self.inner.clone();
            let slot = slot.clone();
            tokio::spawn(async move { inner.terminate_job(&slot, event).await })
        };
        let done = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, job).await,
            None => Ok(job.await),
        };
        match done {
            Ok(finished) => finished??,
            Err(_) => {
                tracing::warn!(task = %id, ?budget, "terminate: not done within its budget; answering with what is durable, the rest finishes in the background");
            }
        }
        Ok(slot.lock().info())
    }

    /// Removes a terminated task: force-removes its container, releases what it still holds,
    /// deletes its directory (or renames it to a trash name) and forgets it.
    ///
    /// A terminated task whose start job or release is still running is waited for (bounded)
    /// rather than refused.
    pub async fn remove(&self, id: &TaskId) -> Result<()> {
        let slot = self.inner.slot(id)?;
        slot.start_settled(START_SETTLE).await;
        let deadline = tokio::time::Instant::now() + RELEASE_SETTLE;
        loop {
            match self.inner.drive(&slot, Event::RemoveRequested).await {
                Err(EngineError::Conflict(TransitionError::ReleaseInFlight { .. }))
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                // Forgotten: removed, whatever a write on the way said (the record went with
                // its directory).
                Err(EngineError::StateWrite { .. }) if !self.inner.holds(&slot) => return Ok(()),
                other => return other,
            }
        }
    }

    /// Stops the background jobs and waits for them to end. Containers keep running. A
    /// [`Shutdown::Graceful`] shutdown also waits (at most its bound) for start jobs in
    /// flight, so no task is left half-started; [`Shutdown::Now`] leaves them.
    pub async fn shutdown(&self, how: Shutdown) {
        self.inner.shutdown.cancel();
        let background: Vec<JoinHandle<()>> = std::mem::take(
            &mut *self
                .inner
                .background
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        // They stop at their next await on the cancellation; a cycle in progress finishes.
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            futures_util::future::join_all(background),
        )
        .await;
        if let Shutdown::Graceful(grace) = how {
            let jobs: Vec<JoinHandle<()>> =
                std::mem::take(&mut *self.inner.jobs.lock().unwrap_or_else(|p| p.into_inner()));
            let wait = futures_util::future::join_all(jobs);
            if tokio::time::timeout(grace, wait).await.is_err() {
                tracing::warn!("shutdown: start jobs still running after {grace:?}; leaving them");
            }
        }
    }

    /// Runs one full reconcile cycle now (one list request; the background job runs them on
    /// every event stream reconnection and as a slow backstop). Returns whether the list
    /// succeeded.
    pub async fn reconcile_now(&self) -> bool {
        self.inner.cycle().await
    }
}
