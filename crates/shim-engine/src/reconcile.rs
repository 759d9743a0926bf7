//! The reconciler: brings tasks in line with their containers, in the background, driven by
//! Docker's events.
//!
//! - **Events first.** One subscription to the `die`, `oom` and `destroy` events of every
//!   dstack shim container (filtered on "has upstream's task-id label", so other shims'
//!   containers on the daemon come too); an event goes to the task whose container has its
//!   name (none: not this engine's), is dropped there when the task knows another container
//!   id, and is handled in order per task, tasks in parallel. A `die` carries the exit
//!   code, so an exit needs no blocking inspect (in bridge mode Docker holds the container's
//!   lock for ~140 ms while it tears the network down); only a non-zero exit reads the last log
//!   lines. A `destroy` marks a vanished container. Events for a task whose start is in flight
//!   wait until start returns.
//! - **Lists as a backstop.** One list request (the same filter; the runner-mount rule keeps
//!   this engine's containers: [`crate::labels`]) runs at start-up, on every
//!   reconnection of the event stream (which resubscribes `since` the last event seen, so
//!   Docker replays what it still has), and every `reconcile_interval` (minutes), never every
//!   second, except while a task's container is still settling (Podman's `stopped`: see
//!   [`Reconciler::cycle_with_since`]). A failed list changes no task.
//! - **Retries cost nothing while idle.** Every second, tasks with a failed write, a failed
//!   stop, a release to retry or queued events are driven again; in-memory checks only, no
//!   Docker request when nothing is to do.
//!
//! The reconciler owns its state (the event cursor, the connection, the relist request, the
//! last successful cycle); health and the metrics read the part they show
//! ([`ReconcileState`]). It changes tasks only by asking the driver to step them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use shim_runtime::{
    ContainerEvent, ContainerRuntime, ContainerState, ContainerSummary, EventKind, EventStream,
    RuntimeError, docker_time_ns,
};
use shim_task::TaskStatus;
use shim_task::machine::{Event, Observation};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::counters::Metrics;
use crate::driver::Driver;
use crate::error::{EngineError, chain};
use crate::health::EngineHealth;
use crate::home::Home;
use crate::images::ImageGc;
use crate::labels::{LABEL_TASK_ID, any_shim_filter};
use crate::ownership::Ownership;
use crate::records::{Retried, Slot};
use crate::table::TaskTable;

/// How often failed side effects and queued events are retried.
const RETRY_EVERY: Duration = Duration::from_secs(1);
/// How many lists in a row, one a retry tick apart, look again at containers still settling
/// (see [`Reconciler::cycle_with_since`]) before they are left to the backstop.
const SETTLING_RELISTS: u32 = 30;

/// How long a cycle waits for its tasks' steps before it ends (see
/// [`Reconciler::cycle_with_since`]).
const CYCLE_STEPS_WAIT: Duration = Duration::from_secs(10);

/// The exit code of a process killed by SIGKILL (128 + 9), as the OOM killer ends one.
const SIGKILL_EXIT: i64 = 137;
/// The exit code of a container cut by the host going down, as Docker records it at its next
/// start (moby's restore: 255).
const UNRECORDED_END_EXIT: i64 = 255;

/// The event stream's reconnection delays.
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// What the reconciler knows of how it keeps up, as others read it (health, metrics).
#[derive(Debug)]
pub(crate) struct ReconcileState {
    /// The event stream is connected.
    events_connected: AtomicBool,
    /// The last successful full cycle: Unix ms (shown) and [`Clock::mono_ns`] (its age, which
    /// a step of the wall clock must not change).
    last_cycle_ms: Mutex<Option<(u64, u64)>>,
    /// What the cycles are stamped with.
    clock: Clock,
}

impl ReconcileState {
    fn new(clock: Clock) -> Self {
        Self {
            events_connected: AtomicBool::new(false),
            last_cycle_ms: Mutex::new(None),
            clock,
        }
    }

    /// Time since the last successful full cycle, if there was one.
    pub(crate) fn last_cycle_age(&self) -> Option<Duration> {
        let (_, mono) = (*self.last_cycle_ms.lock().unwrap_or_else(|p| p.into_inner()))?;
        Some(Duration::from_nanos(
            self.clock.mono_ns().saturating_sub(mono),
        ))
    }

    /// Whether Docker's event stream is connected.
    pub(crate) fn events_connected(&self) -> bool {
        self.events_connected.load(Ordering::SeqCst)
    }

    /// Unix ms of the last successful full cycle.
    pub(crate) fn last_cycle_ms(&self) -> Option<u64> {
        self.last_cycle_ms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|(ms, _)| ms)
    }

    fn set_connected(&self, connected: bool) {
        self.events_connected.store(connected, Ordering::SeqCst);
    }

    fn cycle_done(&self) {
        let stamp = (self.clock.now_ms(), self.clock.mono_ns());
        *self.last_cycle_ms.lock().unwrap_or_else(|p| p.into_inner()) = Some(stamp);
    }
}

/// What the reconciler is built from.
pub(crate) struct ReconcilerParts {
    /// Every task.
    pub(crate) table: Arc<TaskTable>,
    /// Where tasks are stepped.
    pub(crate) driver: Arc<Driver>,
    /// The runtime (metered).
    pub(crate) runtime: Arc<dyn ContainerRuntime>,
    /// Which containers are this engine's.
    pub(crate) ownership: Ownership,
    /// The home (its trash is swept with the backstop).
    pub(crate) home: Home,
    /// The engine's counters.
    pub(crate) metrics: Arc<Metrics>,
    /// The backstop period.
    pub(crate) interval: Duration,
    /// Log lines of an error exit.
    pub(crate) exit_log_lines: usize,
    /// Cancelled when the engine stops (or its last handle drops).
    pub(crate) shutdown: CancellationToken,
    /// Unix ns from which container events are read (before the start-up list).
    pub(crate) events_since: i64,
    /// The images room (told of image removals and of the stream's connection).
    pub(crate) images: Arc<ImageGc>,
}

/// The reconciler: the event listener, the backstop list, the retry pass (see the module
/// docs), with its own state.
pub(crate) struct Reconciler {
    /// What it was made of (kept as given).
    parts: ReconcilerParts,
    state: Arc<ReconcileState>,
    /// Asks for a full list now (the event stream reconnected).
    relist: Notify,
    /// Unix ns of the newest container event seen (the resubscription's `since`).
    events_since: AtomicI64,
    /// The last list found a task's container still settling: the next retry tick lists
    /// again.
    relist_soon: AtomicBool,
    /// How many lists in a row found one settling.
    settling_lists: AtomicU32,
    /// A sweep of the home's trash is under way (beside the cycles: a container-written tree
    /// of millions of files takes minutes to delete).
    sweeping: Arc<AtomicBool>,
}

impl Reconciler {
    /// A reconciler of `parts`' tasks.
    pub(crate) fn new(parts: ReconcilerParts) -> Self {
        let events_since = AtomicI64::new(parts.events_since);
        let state = Arc::new(ReconcileState::new(parts.driver.clock()));
        Self {
            parts,
            state,
            relist: Notify::new(),
            events_since,
            relist_soon: AtomicBool::new(false),
            settling_lists: AtomicU32::new(0),
            sweeping: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Sweeps the home's trash in the background, unless a sweep is under way: the cycles do
    /// not wait for it.
    fn sweep_trash(&self) {
        if self.sweeping.swap(true, Ordering::SeqCst) {
            return;
        }
        let (home, sweeping) = (self.parts.home.clone(), self.sweeping.clone());
        tokio::spawn(async move {
            let swept = home.sweep_trash().await.unwrap_or(0);
            if swept > 0 {
                tracing::info!(swept, "removed trash directories");
            }
            sweeping.store(false, Ordering::SeqCst);
        });
    }

    /// How it keeps up, shared with the metrics.
    pub(crate) fn state(&self) -> &Arc<ReconcileState> {
        &self.state
    }

    /// The engine's readiness.
    pub(crate) fn health(&self) -> EngineHealth {
        EngineHealth::new(
            self.state.events_connected(),
            self.state.last_cycle_age(),
            self.parts.interval,
        )
    }

    /// The first cycle, on the list restore made at start-up (`listed_at`: when it was
    /// requested), so the engine reports ready only after containers that exited while the
    /// shim was down are processed. Restore waits for Docker (bounded) and fails the start-up
    /// without that list, so there is always one.
    pub(crate) async fn first_cycle(
        self: &Arc<Self>,
        containers: Vec<ContainerSummary>,
        listed_at: u64,
    ) {
        self.cycle_with_since(containers, listed_at).await;
    }

    /// This shim's containers, in one list request.
    pub(crate) async fn list_ours(&self) -> shim_runtime::Result<Vec<ContainerSummary>> {
        let containers = self.parts.runtime.list(&any_shim_filter()).await?;
        Ok(self.parts.ownership.ours(containers).await)
    }

    /// One full cycle: one list request, then every task against it. Returns whether the
    /// list request succeeded.
    pub(crate) async fn cycle(self: &Arc<Self>) -> bool {
        let listed_at = self.parts.driver.clock().mono_ns();
        match self.list_ours().await {
            Ok(containers) => {
                self.cycle_with_since(containers, listed_at).await;
                true
            }
            Err(e) => {
                tracing::warn!(error = %chain(&e), "container list failed; no task changed");
                false
            }
        }
    }

    /// Every task against `containers`, a list requested at `listed_at`
    /// ([`Clock::mono_ns`]).
    ///
    /// A task's container in a state the engine has not settled (Podman 4.3's `stopped`, whose
    /// process ended but whose clean-up has not run: no exit code yet) counts as running, and
    /// the next retry tick lists again (at most [`SETTLING_RELISTS`] times in a row): its
    /// `died` may have come while the shim was down, and no other event will tell.
    async fn cycle_with_since(self: &Arc<Self>, containers: Vec<ContainerSummary>, listed_at: u64) {
        let started = std::time::Instant::now();
        let by_task: HashMap<&str, &ContainerSummary> = containers
            .iter()
            .filter_map(|c| c.labels.get(LABEL_TASK_ID).map(|id| (id.as_str(), c)))
            .collect();
        let by_name: HashMap<&str, &ContainerSummary> =
            containers.iter().map(|c| (c.name.as_str(), c)).collect();
        let mut settling = false;
        let mut steps = Vec::new();
        for slot in self.parts.table.slots() {
            // Only tasks whose start had returned before the list was requested: a start that
            // returned since made a container the list may not show; judging it by this list
            // would call its new container vanished.
            if slot.start_in_flight() || slot.start_returned() >= listed_at {
                continue;
            }
            let (status, container_id) =
                slot.read(|t| (t.record().status, t.record().container_id.clone()));
            let summary = by_name
                .get(slot.container_name.as_str())
                .or_else(|| by_task.get(slot.id.as_str()))
                .copied()
                .filter(|c| {
                    container_id.as_ref().is_none_or(|id| c.id == *id)
                        || c.name == slot.container_name
                });
            let observation = if status == TaskStatus::Terminated {
                // A terminated task's container that still runs (a stop that failed, or a
                // shim that stopped between recording the reason and stopping) is stopped.
                summary
                    .filter(|c| c.state.is_running())
                    .map(|_| Observation::Running)
            } else {
                match summary {
                    None => Some(Observation::Missing),
                    Some(c) if c.state.is_running() => {
                        settling |= matches!(c.state, ContainerState::Other(_));
                        None
                    }
                    Some(c) => Some(self.observe_stopped_slot(&slot, &c.id).await),
                }
            };
            let Some(obs) = observation else {
                self.spawn_retry(&slot);
                continue;
            };
            tracing::info!(task = %slot.id, observation = ?obs, "container observed");
            let this = Arc::clone(self);
            steps.push(tokio::spawn(async move {
                let step = this.parts.driver.drive(&slot, Event::Observed(obs));
                tokio::select! {
                    () = this.parts.shutdown.cancelled() => return,
                    done = step => if let Err(e) = done {
                        tracing::error!(task = %slot.id, error = %chain(&e), "reconcile step failed");
                    }
                }
                this.spawn_retry(&slot);
            }));
        }
        // Each task's step in a job of its own, waited for at most CYCLE_STEPS_WAIT: one that
        // hangs (a release blocked on a hung network home or a stuck unmount) holds up no
        // other task's, nor the next cycles, relists and retries; it finishes on its own.
        let stepping = futures_util::future::join_all(steps);
        if tokio::time::timeout(CYCLE_STEPS_WAIT, stepping)
            .await
            .is_err()
        {
            tracing::warn!(wait = ?CYCLE_STEPS_WAIT, "a task's reconcile step is not done (a release or a stop that hangs?); it goes on in the background");
        }
        self.relist_if_settling(settling);
        self.state.cycle_done();
        self.parts
            .metrics
            .cycle
            .observe(started.elapsed().as_secs_f64());
    }

    /// Asks the next retry tick for a list while `settling` (a list found a container still
    /// settling, or a list meant to look at one failed), [`SETTLING_RELISTS`] times in a row
    /// at most; a list that finds none settling resets the count.
    fn relist_if_settling(&self, settling: bool) {
        let in_a_row = match settling {
            true => self.settling_lists.fetch_add(1, Ordering::SeqCst) + 1,
            false => {
                self.settling_lists.store(0, Ordering::SeqCst);
                0
            }
        };
        self.relist_soon
            .store(settling && in_a_row <= SETTLING_RELISTS, Ordering::SeqCst);
    }

    /// Retries what a task still wants after a failure: a write, a stop, a release; and its
    /// queued events. Nothing is asked of Docker unless something is to do.
    pub(crate) async fn retry_task(self: &Arc<Self>, slot: &Arc<Slot>) {
        let (in_flight, dirty) = slot.read(|t| (t.start_in_flight(), t.needs_write()));
        if in_flight {
            return;
        }
        if dirty && let Err(e) = self.parts.driver.drive(slot, Event::PersistRequested).await {
            // What ends the task does not wait for the disk: its stop and release go on.
            // Logged by the write itself (a warning at most every 10 minutes).
            tracing::debug!(task = %slot.id, error = %chain(&e), "state write still failing");
        }
        let (needs_release, stop_failed, container_id) = slot.read(|t| {
            (
                t.needs_release(),
                t.stop_failed(),
                t.record().container_id.clone(),
            )
        });
        if needs_release {
            if let Err(e) = self.parts.driver.drive(slot, Event::ReleaseRequested).await {
                still_failing(slot, &e, "release still failing");
            }
        } else if stop_failed && let Some(container_id) = container_id {
            // Its stop failed and it holds nothing: what does the container do now? A
            // container still running is stopped again; one that is gone or ended is settled.
            let observation = self.observe_stopped_slot(slot, &container_id).await;
            if let Err(e) = self
                .parts
                .driver
                .drive(slot, Event::Observed(observation))
                .await
            {
                still_failing(slot, &e, "stop still failing");
            }
        }
        self.kick_events(slot);
    }

    /// The retry pass: every task, in memory only. Each task's retry runs on its own (one at a
    /// time per task), so a stop that hangs for its bound (a container stuck in the kernel)
    /// delays no other task's write, release or stop.
    async fn retry_all(self: &Arc<Self>) {
        for slot in self.parts.table.slots() {
            let wants = slot.read(|t| !t.start_in_flight() && (t.needs_write() || t.needs_retry()));
            if !wants {
                self.kick_events(&slot);
                continue;
            }
            self.spawn_retry(&slot);
        }
    }

    /// Retries what `slot` still wants ([`Reconciler::retry_task`]) in a job of its own, unless
    /// one is out for it already; the job ends with the engine's shutdown.
    fn spawn_retry(self: &Arc<Self>, slot: &Arc<Slot>) {
        let Some(out) = slot.begin_retry() else {
            return;
        };
        let (this, slot) = (Arc::clone(self), Arc::clone(slot));
        tokio::spawn(async move {
            tokio::select! {
                () = this.parts.shutdown.cancelled() => {}
                () = this.retry_task(&slot) => {}
            }
            drop(out);
        });
    }

    /// Routes one event to its task (if it is one of ours), or an image's removal to the
    /// images room.
    fn route(self: &Arc<Self>, event: ContainerEvent) {
        if event.kind == EventKind::ImageRemoved {
            self.parts.metrics.event("image_removed");
            self.parts.images.image_removed(&event.name);
            self.parts.images.image_id_removed(&event.container_id);
            return;
        }
        let Some(slot) = self.parts.table.by_container_name(&event.name) else {
            return;
        };
        tracing::debug!(task = %slot.id, container = %event.container_id, kind = ?event.kind, "container event");
        slot.observed.events.push(event);
        self.kick_events(&slot);
    }

    /// Makes sure a task's queued events are being handled, unless start owns it (start's
    /// end kicks them).
    pub(crate) fn kick_events(self: &Arc<Self>, slot: &Arc<Slot>) {
        if slot.start_in_flight() || !slot.observed.events.claim_worker() {
            return;
        }
        let this = self.clone();
        let slot = slot.clone();
        tokio::spawn(async move {
            while let Some(event) = slot.observed.events.next() {
                this.handle_event(&slot, event).await;
            }
        });
    }

    async fn handle_event(self: &Arc<Self>, slot: &Arc<Slot>, event: ContainerEvent) {
        // An event of another container of the same name (one this task replaced, or an
        // earlier task's) is not about this task.
        let other = slot.read(|t| {
            t.record()
                .container_id
                .as_ref()
                .is_some_and(|id| *id != event.container_id)
        });
        if other {
            return;
        }
        self.parts.metrics.event(match event.kind {
            EventKind::Die { .. } => "die",
            EventKind::Oom => "oom",
            EventKind::Destroy => "destroy",
            EventKind::ImageRemoved => return,
        });
        let observation = match event.kind {
            EventKind::Oom => {
                slot.observed.oom_seen();
                return;
            }
            EventKind::Destroy => Observation::Missing,
            EventKind::ImageRemoved => return,
            EventKind::Die { exit_code: None } => {
                match self.observe_stopped_at(slot, &event.container_id).await {
                    (Some(observation), finished_ns) => {
                        if let Some(ns) = finished_ns {
                            slot.observed.exited_at(ns);
                        }
                        observation
                    }
                    // The event is used up and the inspect told nothing: a list (which
                    // inspects what it finds stopped) looks again at once, not at the backstop.
                    (None, _) => {
                        self.relist.notify_one();
                        return;
                    }
                }
            }
            EventKind::Die {
                exit_code: Some(code),
            } => {
                slot.observed.exited_at(event.time_ns);
                self.exited(slot, &event.container_id, code, None).await
            }
        };
        if let Err(e) = self
            .parts
            .driver
            .drive(slot, Event::Observed(observation))
            .await
        {
            tracing::error!(task = %slot.id, error = %chain(&e), "event step failed");
        }
    }

    /// The first subscription to the container events, made at start-up before the engine is
    /// handed out, so that a shim that serves is subscribed from its first request (bounded
    /// by [`RECONNECT_MAX`]; `None` when it failed, and the listener tries again).
    pub(crate) async fn first_subscription(&self) -> Option<EventStream> {
        match tokio::time::timeout(RECONNECT_MAX, self.subscribe()).await {
            Ok(Ok(stream)) => {
                self.connected(true);
                Some(stream)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %chain(&e), "cannot subscribe to container events; retrying");
                None
            }
            Err(_) => {
                tracing::warn!(
                    "subscribing to container events took over {RECONNECT_MAX:?}; retrying"
                );
                None
            }
        }
    }

    /// The event stream connected or was lost: the state says so, the images room trusts
    /// what it saw present only while connected, and a lost stream (the daemon may come back
    /// another version, with CDI on or off) has what the engine can do with GPUs asked again.
    fn connected(&self, connected: bool) {
        self.state.set_connected(connected);
        self.parts.images.events_connected(connected);
        if !connected {
            self.parts.driver.gpu_passing().forget_support();
        }
    }

    /// Subscribes to this shim's container events since the last one seen, or since now if
    /// that is later: Podman applies `since` to the events it streams too, so a `since` ahead
    /// of a clock set back would hide every event until the clock passed it.
    async fn subscribe(&self) -> shim_runtime::Result<EventStream> {
        let now = self.parts.driver.clock().now_unix_ns();
        let since = self.events_since.load(Ordering::SeqCst).min(now);
        self.parts
            .runtime
            .events(&any_shim_filter(), Some(since))
            .await
    }

    /// Listens to the container events for as long as the engine runs (on `first`, then on
    /// its own subscriptions), reconnecting with a backoff; every reconnection resubscribes
    /// since the last event seen and asks for a full list (what the daemon no longer had is
    /// found that way).
    async fn run_events(self: Arc<Self>, mut first: Option<EventStream>, covered: bool) {
        let mut delay = RECONNECT_MIN;
        let mut seen: HashSet<(String, i64)> = HashSet::new();
        // Only the subscription made beside the start-up list (`covered`: soon after it) is
        // covered by it: any other connection, the first one that succeeds after that one
        // failed included, relists.
        let mut covered = first.is_some() && covered;
        while !self.parts.shutdown.is_cancelled() {
            let subscribed = match first.take() {
                Some(stream) => Ok(stream),
                // Subscribing asks the daemon (bounded by the request timeout): a frozen
                // daemon must not hold up a shutdown.
                None => tokio::select! {
                    _ = self.parts.shutdown.cancelled() => return,
                    subscribed = self.subscribe() => subscribed,
                },
            };
            match subscribed {
                Ok(mut stream) => {
                    self.connected(true);
                    self.parts.metrics.events_reconnects.inc();
                    if !std::mem::take(&mut covered) {
                        tracing::info!("container event stream connected; relisting");
                        self.relist.notify_one();
                    }
                    let connected = tokio::time::Instant::now();
                    let mut carried = false;
                    loop {
                        let item = tokio::select! {
                            _ = self.parts.shutdown.cancelled() => return,
                            item = stream.next() => item,
                        };
                        match item {
                            Some(Ok(event)) => {
                                // A replay (`since` is inclusive) may repeat an event.
                                if !seen.insert((event.container_id.clone(), event.time_ns)) {
                                    continue;
                                }
                                if seen.len() > 4096 {
                                    seen.clear();
                                }
                                self.events_since.fetch_max(event.time_ns, Ordering::SeqCst);
                                carried = true;
                                self.route(event);
                            }
                            Some(Err(e)) => {
                                tracing::warn!(error = %chain(&e), "container event stream broke");
                                break;
                            }
                            None => {
                                tracing::warn!("container event stream ended");
                                break;
                            }
                        }
                    }
                    self.connected(false);
                    // Only a connection that carried events or lasted starts the backoff
                    // over. One that broke at once is a daemon still down behind a
                    // subscription that fails only when read (a runtime that does not ask the
                    // daemon when subscribing, or a daemon that went down right after):
                    // resubscribing, and relisting, at the shortest delay would spin.
                    if carried || connected.elapsed() >= RECONNECT_MAX {
                        delay = RECONNECT_MIN;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %chain(&e), "cannot subscribe to container events");
                }
            }
            tokio::select! {
                _ = self.parts.shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(RECONNECT_MAX);
        }
    }

    /// Starts the background jobs: the event listener (on `first`, the subscription made at
    /// start-up, if it succeeded; `covered`: made soon enough after the start-up list that it
    /// needs no list of its own), the retry pass and the backstop list.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        first: Option<EventStream>,
        covered: bool,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let events = {
            let this = self.clone();
            tokio::spawn(async move {
                this.clone().run_events(first, covered).await;
                // Shut down: no stream is read any more.
                this.connected(false);
            })
        };
        let reconciler = {
            let this = self.clone();
            tokio::spawn(async move {
                let mut backstop = tokio::time::interval(this.parts.interval);
                backstop.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                backstop.tick().await; // the first cycle ran at start-up
                let mut retry = tokio::time::interval(RETRY_EVERY);
                retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = this.parts.shutdown.cancelled() => break,
                        _ = backstop.tick() => {
                            this.sweep_trash();
                            this.cycle().await;
                        }
                        _ = this.relist.notified() => {
                            this.cycle().await;
                        }
                        _ = retry.tick() => {
                            if this.relist_soon.swap(false, Ordering::SeqCst)
                                && !this.cycle().await
                            {
                                this.relist_if_settling(true);
                            }
                            this.retry_all().await;
                        }
                    }
                }
                tracing::debug!("reconciler stopped");
            })
        };
        vec![events, reconciler]
    }

    /// What the reconciler saw of a task's stopped container (still running when the inspect
    /// failed: the next cycle looks again), also noting when it exited (the start of the exit
    /// → terminated latency).
    async fn observe_stopped_slot(&self, slot: &Slot, container_id: &str) -> Observation {
        let (observation, finished_ns) = self.observe_stopped_at(slot, container_id).await;
        if let Some(ns) = finished_ns {
            slot.observed.exited_at(ns);
        }
        observation.unwrap_or(Observation::Running)
    }

    /// The observation of an inspect (`None` when the inspect failed) and when the container
    /// finished.
    async fn observe_stopped_at(
        &self,
        slot: &Slot,
        container_id: &str,
    ) -> (Option<Observation>, Option<i64>) {
        let d = match self.parts.runtime.inspect(container_id).await {
            Err(RuntimeError::NotFound { .. }) => return (Some(Observation::Missing), None),
            Err(e) => {
                let message = chain(&e);
                if slot.failed_loudly(Retried::Container, &message) {
                    tracing::warn!(container = %container_id, error = %message, "inspect failed; looked at again (the same failure is logged again in 10 minutes)");
                } else {
                    tracing::debug!(container = %container_id, error = %message, "inspect failed; looked at again");
                }
                return (None, None);
            }
            Ok(d) => d,
        };
        let finished = d.finished_at.as_deref().and_then(docker_time_ns);
        // A container that ran and has no end recorded was cut by the host going down. After
        // a reboot Docker records it exited with 255; Podman's refresh instead puts it back to
        // `created` (4.x) or to `exited` with the code it was given at its start, 0, and no
        // finish time (5.x: libpod's `resetContainerState`), which would read as the runner's
        // success. Both read as Docker's.
        let ran = d.started_at.as_deref().and_then(docker_time_ns).is_some();
        let cut = ran && finished.is_none();
        let observation = match d.state {
            ContainerState::Created | ContainerState::Exited if cut => {
                tracing::warn!(container = %container_id, state = ?d.state, "the container ran and has no end recorded: the host went down under it");
                self.exited(slot, container_id, UNRECORDED_END_EXIT, Some(d.oom_killed))
                    .await
            }
            ContainerState::Created => Observation::NeverStarted,
            ref s if s.is_running() => Observation::Running,
            _ => {
                let code = d.exit_code.unwrap_or(-1);
                self.exited(slot, container_id, code, Some(d.oom_killed))
                    .await
            }
        };
        (Some(observation), finished)
    }

    /// The one builder of what a container's end looks like, however the end was found (its
    /// `die` event, or an inspect after an event without a code or a list): the exit code;
    /// whether the OOM killer ended it (an `oom` event seen before, or the engine's
    /// `OOMKilled`: `oom_killed` when an inspect gave it, else asked for a SIGKILL (137) only,
    /// as Podman sends no `oom` event); and, for a non-zero exit, the last lines of its log
    /// (an exit 0 is `done_by_runner` with no message, so none are read).
    async fn exited(
        &self,
        slot: &Slot,
        container_id: &str,
        code: i64,
        oom_killed: Option<bool>,
    ) -> Observation {
        let seen_oom = slot.observed.take_oom();
        let oom_killed = match oom_killed {
            _ if seen_oom => true,
            Some(known) => known,
            None if code == SIGKILL_EXIT => self
                .parts
                .runtime
                .inspect(container_id)
                .await
                .is_ok_and(|d| d.oom_killed),
            None => false,
        };
        // Docker serves logs without the container's lock.
        let last_lines = if code == 0 {
            Vec::new()
        } else {
            self.parts
                .runtime
                .logs_tail(container_id, self.parts.exit_log_lines)
                .await
                .unwrap_or_default()
        };
        Observation::Exited {
            code,
            last_lines,
            oom_killed,
        }
    }
}

/// A retried step that failed again. A failed state write was logged by the write itself (a
/// warning at most every 10 minutes), so it is noted at debug here; anything else warns.
fn still_failing(slot: &Slot, e: &EngineError, what: &str) {
    if matches!(e, EngineError::StateWrite { .. }) {
        tracing::debug!(task = %slot.id, error = %chain(e), "{what}");
    } else {
        tracing::warn!(task = %slot.id, error = %chain(e), "{what}");
    }
}
