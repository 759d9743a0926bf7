//! The engine's public handle: it puts the rooms together at open ([`Engine::open`]) and
//! answers the operations (submit, terminate, remove, the views), each by asking the room
//! that owns what it needs.
//!
//! Dropping the last [`Engine`] handle stops the background jobs (the event listener, the
//! reconciler, the retry pass): they hold the parts they use, never the handle, and end at
//! their next await once it is gone. Start and terminate jobs in flight run to their end;
//! containers keep running; nothing is waited for. [`Engine::shutdown`] does the same and
//! waits for the jobs (and, when graceful, for start jobs in flight, at most its bound: then
//! a start job still in flight stops where it is, as a crash would stop it).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::registry::Registry;
use shim_resources::{GpuLock, HostGpus};
use shim_runtime::ContainerRuntime;
use shim_task::machine::{Action, Effect, Event, TransitionError};
use shim_task::{TaskConfig, TaskId, TaskInfo, TaskStatus, TerminationReason};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::changes::Subscription;
use crate::clock::Clock;
use crate::config::EngineConfig;
use crate::counters::Metrics;
use crate::deps::Deps;
use crate::driver::{Driver, EffectParts};
use crate::error::{EngineError, Result, chain};
use crate::gpus::GpuHealthWatch;
use crate::health::EngineHealth;
use crate::images::ImageGc;
use crate::labels::any_shim_filter;
use crate::metered::Metered;
use crate::metrics::Sources;
use crate::ownership::Ownership;
use crate::reconcile::{Reconciler, ReconcilerParts};
use crate::records::{RecordKeeper, Slot, open_store};
use crate::restore::{RestoreContext, Restored, determine_owner, list_waiting, restore};
use crate::table::TaskTable;
use crate::usage::Usage;

/// How [`Engine::shutdown`] treats start jobs in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shutdown {
    /// Wait for them to finish, at most this long.
    Graceful(Duration),
    /// Do not wait.
    Now,
}

/// The shim engine. Cheap to clone; all clones share one task table. Dropping the last clone
/// stops the background jobs (see the module docs); [`Engine::shutdown`] also waits for them.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Shared>,
}

/// What the handles share. Dropped with the last handle, which cancels the background jobs.
struct Shared {
    terminate_slack: Duration,
    owner: String,
    host_gpus: HostGpus,
    table: Arc<TaskTable>,
    driver: Arc<Driver>,
    /// The GPU lock (the effects' own, read for [`Engine::gpu_lock`]).
    gpus: Arc<GpuLock>,
    /// The GPUs' health, as last probed.
    gpu_health: Arc<GpuHealthWatch>,
    reconciler: Arc<Reconciler>,
    metrics: Sources,
    /// The engine's own registry ([`Engine::encode_metrics`]).
    registry: Registry,
    /// Cancels the background jobs.
    shutdown: CancellationToken,
    /// The background jobs (event listener, reconciler), awaited at shutdown.
    background: Mutex<Vec<JoinHandle<()>>>,
    /// Start jobs in flight (graceful shutdown waits for them, with a bound).
    jobs: Mutex<Vec<JoinHandle<()>>>,
    /// Cancelled by [`Engine::shutdown`] once it waited for start jobs as long as it would:
    /// each still in flight stops at its next await, as a crash would stop it.
    cut_starts: CancellationToken,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// How long [`Engine::open`] waits for the restored tasks' side effects (its first cycle's
/// steps are bounded alike).
const START_UP_EFFECTS_WAIT: Duration = Duration::from_secs(10);

/// How soon after the start-up list the first event subscription must connect to be covered
/// by it (no list of its own), in nanoseconds.
const FIRST_SUBSCRIPTION_COVERED_NS: u64 = 1_000_000_000;

/// Reads the GPUs' interconnect (`nvidia-smi topo -m`) once, in the background, and gives it
/// to the GPU lock, which places tasks by it from then on (first-free until then, or for good
/// when it cannot be read).
fn spawn_topology(
    detector: Arc<shim_resources::GpuDetector>,
    lock: Arc<GpuLock>,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let read = tokio::select! {
            () = shutdown.cancelled() => return,
            read = detector.topology() => read,
        };
        match read {
            Ok(topology) => {
                tracing::info!(
                    gpus = topology.gpus().len(),
                    "GPU interconnect read: tasks get their GPUs by it (one NUMA node where one can hold them, then the best links)"
                );
                lock.set_topology(Some(topology));
            }
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot read the GPU interconnect: GPUs are handed out first-free");
            }
        }
    })
}

fn take<T>(jobs: &Mutex<Vec<T>>) -> Vec<T> {
    std::mem::take(&mut *jobs.lock().unwrap_or_else(|p| p.into_inner()))
}

impl Engine {
    /// Opens the engine on `cfg.home`: restores every task of this shim (its state files, and
    /// every container whose runner directory lies in this home: [`crate::labels`]), runs the
    /// first reconcile cycle, subscribes to container events, then starts the background
    /// reconciler. When this returns the engine is ready to serve: containers that exited
    /// while the shim was down have been processed. A side effect of that (a release, a stop)
    /// is waited for at most 10 s per phase: one that hangs (a hung network home, a stuck
    /// unmount) finishes in the background, the task shown as it is recorded meanwhile.
    /// A config [`EngineConfig::check`] refuses is [`EngineError::InvalidConfig`].
    pub async fn open(cfg: EngineConfig, deps: Deps) -> Result<Engine> {
        Engine::begin(deps.runtime.clone(), deps.clock)
            .open(cfg, deps)
            .await
    }

    /// The first step of [`Engine::open`], for a program with more to do before it can open
    /// the engine (GPU detection, say): the start-up list of containers goes out to the
    /// daemon now, so that a restart takes about one list however long the rest takes.
    /// Every request on `runtime` is counted in the engine's metrics from here on.
    pub fn begin(runtime: Arc<dyn ContainerRuntime>, clock: Clock) -> Opening {
        let metrics = Arc::new(Metrics::new());
        let given = runtime.clone();
        let runtime: Arc<dyn ContainerRuntime> = Arc::new(Metered::new(runtime, metrics.clone()));
        // Events are read from before the start-up list on: nothing falls between them.
        let since = clock.now_unix_ns();
        let listed_at = clock.mono_ns();
        let listing = {
            let runtime = runtime.clone();
            tokio::spawn(async move { list_waiting(runtime.as_ref(), &any_shim_filter()).await })
        };
        Opening {
            given,
            clock,
            runtime,
            metrics,
            since,
            listed_at,
            listing,
        }
    }
}

/// An engine being opened: its start-up list is out ([`Engine::begin`]); [`Opening::open`]
/// does the rest.
pub struct Opening {
    /// The runtime and clock given to [`Engine::begin`].
    given: Arc<dyn ContainerRuntime>,
    clock: Clock,
    /// The runtime given, counted.
    runtime: Arc<dyn ContainerRuntime>,
    metrics: Arc<Metrics>,
    /// Unix nanoseconds before the list: container events are read from then on.
    since: i64,
    /// When the list was requested ([`Clock::mono_ns`]).
    listed_at: u64,
    listing: JoinHandle<Result<Vec<shim_runtime::ContainerSummary>>>,
}

impl Opening {
    /// Opens the engine as [`Engine::open`] does, on the runtime and clock given to
    /// [`Engine::begin`] (they replace `deps.runtime` and `deps.clock`).
    pub async fn open(self, cfg: EngineConfig, deps: Deps) -> Result<Engine> {
        // Everything local (the home, the state files) is read while the daemon answers
        // the start-up list: a restart takes about one list.
        let Opening {
            given,
            clock,
            runtime,
            metrics,
            since,
            listed_at,
            listing,
        } = self;
        cfg.check()?;
        let deps = Deps {
            runtime: given,
            clock,
            ..deps
        };
        let (records, home) = open_store(cfg.home.clone(), &deps).await?;
        let owner = determine_owner(&home, deps.runtime.as_ref()).await?;
        let ownership = Ownership::of_home(home.path()).await?;
        let host_gpus = deps.host_gpus.clone();
        let (fake_gpus, gpus_total_is_zero) = (deps.fake_gpus, deps.host_gpus.gpus.is_empty());
        let health_source = deps.gpu_health.clone().filter(|_| !gpus_total_is_zero);
        let topology_source = deps.gpu_topology.clone().filter(|_| !gpus_total_is_zero);
        let (keys, volumes) = (deps.keys.clone(), deps.volumes.clone());
        let cgroups = deps.cgroups.clone();
        let table = Arc::new(TaskTable::default());
        let images = Arc::new(ImageGc::open(
            runtime.clone(),
            table.clone(),
            home.path(),
            cfg.image_gc_high_percent,
            cfg.image_gc_low_percent,
            clock,
            deps.fs.clone(),
        ));
        let driver = Arc::new(Driver::new(
            RecordKeeper::new(records, metrics.clone(), clock),
            EffectParts {
                cfg: cfg.clone(),
                owner: owner.clone(),
                deps: Deps {
                    runtime: runtime.clone(),
                    ..deps
                },
                table: table.clone(),
                home: home.clone(),
                ownership: ownership.clone(),
                images: images.clone(),
            },
        ));
        let gpus = driver.gpus().clone();
        let gpu_passing = driver.gpu_passing().clone();
        // Which way GPUs go to containers is decided (and logged) now on a GPU host, and again
        // at each GPU task's create.
        if !fake_gpus && !gpus_total_is_zero {
            gpu_passing.current().await;
        }
        let shutdown = CancellationToken::new();
        let reconciler = Arc::new(Reconciler::new(ReconcilerParts {
            table: table.clone(),
            driver: driver.clone(),
            runtime: runtime.clone(),
            ownership: ownership.clone(),
            home: home.clone(),
            metrics: metrics.clone(),
            interval: cfg.reconcile_interval,
            exit_log_lines: cfg.exit_log_lines,
            shutdown: shutdown.clone(),
            events_since: since,
            images: images.clone(),
        }));

        // The event subscription is asked for now too (events since before the list are
        // kept for the reconciler), not after the first cycle.
        let begun_at = listed_at;
        let subscribing = {
            let reconciler = reconciler.clone();
            tokio::spawn(async move {
                let first = reconciler.first_subscription().await;
                (first, clock.mono_ns())
            })
        };
        let restored = restore(
            RestoreContext {
                clock,
                home: &home,
                runtime: runtime.as_ref(),
                ownership: &ownership,
                keys: keys.as_ref(),
                volumes: volumes.as_ref(),
                volumes_root: &cfg.volumes_root,
            },
            listing,
            listed_at,
        )
        .await?;
        let Restored {
            tasks,
            listed,
            listed_at,
        } = restored;
        // GPUs first, for every task, before anything is released.
        let mut rest = Vec::new();
        for t in tasks {
            if let Some(reason) = &t.ended {
                metrics.terminated(reason);
            }
            let slot = t.slot;
            if let Some(other) = table.insert(slot.clone()) {
                tracing::warn!(task = %slot.id, first = %other.container_name, second = %slot.container_name, "two task directories or containers for one task id; the second one is used");
            }
            let (locks, others): (Vec<Action>, Vec<Action>) = t
                .actions
                .into_iter()
                .partition(|a| matches!(a, Action::Effect(Effect::LockGpus(_))));
            if let Err(e) = driver.run_actions(&slot, locks).await {
                tracing::error!(task = %slot.id, error = %chain(&e), "relocking GPUs failed");
            }
            rest.push((slot, others));
        }
        // Then everything else (the restored state's write, a stop, a release), each task's
        // in a job of its own, waited for at most START_UP_EFFECTS_WAIT: a release that hangs
        // (a hung network home, a stuck unmount) finishes in the background, holding up
        // neither another task's nor the API. A release was computed from the record before
        // the GPUs were locked again: it frees only the GPUs its task still names, those it
        // locked itself (a GPU another restored task locked first, a stale record's, is that
        // task's).
        let restoring: Vec<_> = rest
            .into_iter()
            .map(|(slot, actions)| {
                let kept = slot.read(|t| t.record().resources.gpus.clone());
                let actions: Vec<Action> = actions
                    .into_iter()
                    .map(|a| match a {
                        Action::Effect(Effect::Release(mut held)) => {
                            held.gpus.retain(|g| kept.contains(g));
                            Action::Effect(Effect::Release(held))
                        }
                        other => other,
                    })
                    .collect();
                let (driver, shutdown) = (driver.clone(), shutdown.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        () = shutdown.cancelled() => {}
                        done = driver.run_actions(&slot, actions) => if let Err(e) = done {
                            tracing::error!(task = %slot.id, error = %chain(&e), "restore actions failed; the reconciler retries");
                        }
                    }
                })
            })
            .collect();
        let restored = futures_util::future::join_all(restoring);
        if tokio::time::timeout(START_UP_EFFECTS_WAIT, restored)
            .await
            .is_err()
        {
            tracing::warn!(wait = ?START_UP_EFFECTS_WAIT, "a restored task's side effects are not done (a release that hangs?); they finish in the background");
        }
        reconciler.first_cycle(listed, listed_at).await;
        // Spare task directories for the first submits (in the background).
        driver.prepare_spares();
        let (first, subscribed_at) = subscribing.await.unwrap_or_else(|e| {
            tracing::warn!(error = %chain(&e), "subscribing to container events failed; retrying");
            (None, 0)
        });
        // The start-up list covers a subscription made right after it: the daemon replays
        // the events since then. One made later (a program that detected GPUs between
        // `begin` and `open`, a slow daemon) relists: Docker replays only the last 256 events
        // it buffered, none from before its own restart.
        let covered = subscribed_at.saturating_sub(begun_at) <= FIRST_SUBSCRIPTION_COVERED_NS;
        let mut background = reconciler.spawn(first, covered);
        let (usage, locator) = Usage::spawn(
            table.clone(),
            runtime.clone(),
            cgroups,
            clock,
            shutdown.clone(),
        );
        background.push(locator);
        background.push(images.spawn(shutdown.clone()));
        if let Some(detector) = topology_source {
            background.push(spawn_topology(detector, gpus.clone(), shutdown.clone()));
        }
        let gpu_health = Arc::new(GpuHealthWatch::new());
        // A zero period: the health watch is off.
        if let Some(source) = health_source.filter(|_| !cfg.gpu_health_interval.is_zero()) {
            background.push(gpu_health.spawn(
                source,
                gpus.clone(),
                cfg.gpu_health_interval,
                shutdown.clone(),
            ));
        }

        let sources = Sources {
            metrics,
            table: table.clone(),
            gpus: gpus.clone(),
            gpu_passing,
            gpu_health: gpu_health.clone(),
            reconcile: reconciler.state().clone(),
            usage,
            images,
        };
        let mut registry = Registry::default();
        crate::metrics::register(&mut registry, &sources);
        Ok(Engine {
            inner: Arc::new(Shared {
                terminate_slack: cfg.terminate_slack,
                owner,
                host_gpus,
                table,
                driver,
                gpus,
                gpu_health,
                reconciler,
                metrics: sources,
                registry,
                shutdown,
                background: Mutex::new(background),
                jobs: Mutex::new(Vec::new()),
                cut_starts: CancellationToken::new(),
            }),
        })
    }
}

impl Engine {
    /// The owner identity this shim stamps on its containers.
    pub fn owner(&self) -> &str {
        &self.inner.owner
    }

    /// Unix milliseconds of the last successful reconcile cycle.
    pub fn last_reconcile_ms(&self) -> Option<u64> {
        self.inner.reconciler.state().last_cycle_ms()
    }

    /// The host's GPUs as the engine accounts for them.
    pub fn host_gpus(&self) -> &HostGpus {
        &self.inner.host_gpus
    }

    /// Subscribes to every task change from now on (see [`crate::changes`]): submitted,
    /// each status step, terminated with its reason and message, released, removed, in
    /// order per task; a subscriber that falls far behind is told to resync. Once the engine
    /// is gone (its last handle dropped and its jobs ended, or shut down), the subscription
    /// ends with [`crate::SubscriptionError::Closed`].
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
    ///         // Closed, or what a later version adds (the type is non-exhaustive).
    ///         Err(_) => break,
    ///     }
    /// }
    /// # }
    /// ```
    pub fn subscribe(&self) -> Subscription {
        // Ended once a shutdown has waited for the start jobs: the changes they make while
        // it waits still come.
        self.inner
            .driver
            .subscribe()
            .until(self.inner.cut_starts.clone())
    }

    /// The engine's metrics in Prometheus' text format (OpenMetrics, ending in `# EOF`), to
    /// serve as they are (see [`crate::metrics`]). An embedder with metrics of its own
    /// registers the engine's in its registry instead ([`Engine::register_metrics`]).
    pub fn encode_metrics(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode(out, &self.inner.registry)
    }

    /// Registers the engine's metrics in an embedder's registry, beside its own (for example
    /// its build info as an `Info` metric), so one exposition serves them all. The registry
    /// holds the task table, the GPU lock and the reconciler's state, nothing more: it keeps
    /// no background job alive.
    ///
    /// ```
    /// use shim_engine::prometheus_client::{metrics::info::Info, registry::Registry};
    /// # fn serve(engine: &shim_engine::Engine) -> Result<String, std::fmt::Error> {
    /// let mut registry = Registry::default();
    /// engine.register_metrics(&mut registry);
    /// registry.register(
    ///     "my_agent_build",
    ///     "The agent's version",
    ///     Info::new(vec![("version".to_owned(), "1.2.3".to_owned())]),
    /// );
    /// let mut text = String::new();
    /// shim_engine::prometheus_client::encoding::text::encode(&mut text, &registry)?;
    /// # Ok(text) }
    /// ```
    pub fn register_metrics(&self, registry: &mut Registry) {
        crate::metrics::register(registry, &self.inner.metrics);
    }

    /// Whether the engine keeps up with Docker: the verdict, its reasons, and what they are
    /// made of (the event stream's connection, the age of the last full list). A readiness
    /// signal independent of the API's healthcheck (which only says the process answers).
    pub fn health(&self) -> EngineHealth {
        self.inner.reconciler.health()
    }

    /// The GPU lock (which GPUs tasks hold now; which are kept out as unhealthy; where the
    /// host's interconnect is set, [`GpuLock::set_topology`]).
    pub fn gpu_lock(&self) -> &GpuLock {
        &self.inner.gpus
    }

    /// The GPUs' health as last probed (`None`: no health source, or not probed yet).
    pub fn gpu_health(&self) -> Option<shim_resources::gpu::GpuHealthReport> {
        self.inner.gpu_health.last()
    }

    /// Submits a task: validates the config, creates the task directory and writes the state
    /// file, then launches start in the background and returns the `pending` task.
    ///
    /// The submit runs in a job of its own, to its end: a caller that goes away before the
    /// answer (an HTTP client whose request timed out while the first write was slow) does not
    /// cancel it half-way, which would leave the id taken and a `pending` record with no start
    /// to follow. The task then starts as if the answer had been read, and the caller's retry
    /// finds it (a conflict naming the id).
    ///
    /// After [`Engine::shutdown`] a submit is [`EngineError::ShutDown`].
    pub async fn submit(&self, config: TaskConfig) -> Result<TaskInfo> {
        config.validate()?;
        self.refuse_after_shutdown()?;
        let engine = self.clone();
        tokio::spawn(async move { engine.submit_to_its_end(config).await }).await?
    }

    /// [`EngineError::ShutDown`] once [`Engine::shutdown`] began: nothing more is started,
    /// stopped or removed.
    fn refuse_after_shutdown(&self) -> Result<()> {
        if self.inner.shutdown.is_cancelled() {
            return Err(EngineError::ShutDown);
        }
        Ok(())
    }

    /// [`Engine::submit`]'s work, in its own job.
    async fn submit_to_its_end(&self, config: TaskConfig) -> Result<TaskInfo> {
        let inner = &self.inner;
        let id = config.id.clone();
        let slot = Arc::new(Slot::submitted(&config, self.inner.driver.clock().now_ms()));
        inner.table.insert_new(slot.clone())?;
        let info = match inner.driver.submit(&slot).await {
            Ok(info) => info,
            Err(e) => {
                inner.table.remove(&id);
                return Err(e);
            }
        };
        tracing::info!(task = %id, image = %config.image_name, "task submitted");
        let job = {
            let driver = inner.driver.clone();
            let reconciler = inner.reconciler.clone();
            let cut = inner.cut_starts.clone();
            tokio::spawn(async move {
                tokio::select! {
                    biased;
                    () = cut.cancelled() => {}
                    () = driver.run_start(&slot) => {
                        // Events that came while start owned the task.
                        reconciler.kick_events(&slot);
                    }
                }
            })
        };
        let mut jobs = inner.jobs.lock().unwrap_or_else(|p| p.into_inner());
        jobs.retain(|j| !j.is_finished());
        jobs.push(job);
        Ok(info)
    }

    /// The task's current view.
    pub fn task_info(&self, id: &TaskId) -> Result<TaskInfo> {
        Ok(self.inner.table.get(id)?.info())
    }

    /// Whether the task's start job still owns it (the reconciler leaves such tasks alone).
    pub fn is_starting(&self, id: &TaskId) -> Result<bool> {
        Ok(self.inner.table.get(id)?.start_in_flight())
    }

    /// Every known task (terminated included) with its status.
    pub fn list(&self) -> Vec<(TaskId, TaskStatus)> {
        self.inner
            .table
            .slots()
            .iter()
            .map(|s| (s.id.clone(), s.status()))
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
    /// background, and the answer is the task's view then. A state file that cannot be
    /// written (a full disk) does not fail the terminate: the stop and the release go out all
    /// the same, the view shows the task `terminated` once its container no longer runs (the
    /// record is written by the reconciler when the disk allows), and a remove is accepted.
    pub async fn terminate(
        &self,
        id: &TaskId,
        reason: TerminationReason,
        message: String,
        timeout: Duration,
    ) -> Result<TaskInfo> {
        let slot = self.inner.table.get(id)?;
        self.refuse_after_shutdown()?;
        let budget = timeout.saturating_add(self.inner.terminate_slack);
        let deadline = tokio::time::Instant::now().checked_add(budget);
        let event = Event::TerminateRequested {
            reason,
            message,
            timeout_s: timeout.as_secs(),
        };
        // Everything terminate calls for runs in a job of its own, to its end; the answer
        // waits for it only until the deadline.
        let job = {
            let driver = self.inner.driver.clone();
            let slot = slot.clone();
            tokio::spawn(async move { driver.terminate(&slot, event).await })
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
        // A task whose submit failed while this terminate waited for it (its first write:
        // a full disk) never was: answered as any later call on it is.
        if !self.inner.table.holds(&slot) {
            return Err(EngineError::NotFound(id.clone()));
        }
        Ok(slot.info())
    }

    /// Removes a terminated task: force-removes its container, releases what it still holds,
    /// deletes its directory (or renames it to a trash name) and forgets it.
    ///
    /// A terminated task whose start job or release is still running is waited for (bounded)
    /// rather than refused. Like [`Engine::submit`], the remove runs in a job of its own, to its
    /// end: a caller that goes away does not stop a release half-way.
    pub async fn remove(&self, id: &TaskId) -> Result<()> {
        let slot = self.inner.table.get(id)?;
        self.refuse_after_shutdown()?;
        let engine = self.clone();
        tokio::spawn(async move { engine.remove_to_its_end(slot).await }).await?
    }

    /// [`Engine::remove`]'s work, in its own job.
    async fn remove_to_its_end(&self, slot: Arc<Slot>) -> Result<()> {
        match self.inner.driver.remove(&slot).await {
            // Forgotten: removed, whatever a write on the way said (the record went with its
            // directory).
            Err(EngineError::StateWrite { .. }) if !self.inner.table.holds(&slot) => Ok(()),
            // Another remove took it meanwhile.
            Err(EngineError::Conflict(TransitionError::RemoveInFlight { .. }))
                if !self.inner.table.holds(&slot) =>
            {
                Err(EngineError::NotFound(slot.id.clone()))
            }
            other => other,
        }
    }

    /// Stops the background jobs and waits for them to end. Containers keep running. A
    /// [`Shutdown::Graceful`] shutdown also waits (at most its bound) for start jobs in
    /// flight, so no task is left half-started; a start job still in flight then (a long
    /// pull), or at once with [`Shutdown::Now`], stops at its next await as a crash would
    /// stop it, its record left as it is: the engine opened next on the home (in this
    /// process or another) finds the task as a restart does, and no job of this one starts
    /// its container or takes another step behind it (work the job had already handed to the
    /// blocking pool, a record's write or an authorized_keys rewrite, still finishes: open the
    /// home again a moment after, as after a process exit). From then on the engine is not
    /// ready ([`Engine::health`]: its event stream is disconnected), its subscriptions end,
    /// and it refuses submits, terminates and removes ([`EngineError::ShutDown`]); its views
    /// answer as before.
    pub async fn shutdown(&self, how: Shutdown) {
        self.inner.shutdown.cancel();
        let background = take(&self.inner.background);
        // They stop at their next await on the cancellation; a cycle in progress finishes.
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            futures_util::future::join_all(background),
        )
        .await;
        let jobs = take(&self.inner.jobs);
        if let Shutdown::Graceful(grace) = how
            && !jobs.is_empty()
        {
            let wait = futures_util::future::join_all(jobs);
            if tokio::time::timeout(grace, wait).await.is_err() {
                tracing::warn!(
                    "shutdown: start jobs still running after {grace:?}; stopping them where they are"
                );
            }
        }
        self.inner.cut_starts.cancel();
    }

    /// Runs one full reconcile cycle now (one list request; the background job runs them on
    /// every event stream reconnection and as a slow backstop). Returns whether the list
    /// succeeded.
    pub async fn reconcile_now(&self) -> bool {
        self.inner.reconciler.cycle().await
    }
}
