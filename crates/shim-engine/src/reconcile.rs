//! The reconciler: brings tasks in line with their containers, in the background, driven by
//! Docker's events.
//!
//! - **Events first.** One subscription to the `die`, `oom` and `destroy` events of every
//!   dstack shim container; each event goes to its task (by container name, and by id once the
//!   task knows its container), in order per task, tasks in parallel. A `die` carries the exit
//!   code, so an exit needs no blocking inspect (in bridge mode Docker holds the container's
//!   lock for ~140 ms while it tears the network down); only a non-zero exit reads the last log
//!   lines. A `destroy` marks a vanished container. Events for a task whose start is in flight
//!   wait until start returns.
//! - **Lists as a backstop.** One list request for all containers runs at start-up, on every
//!   reconnection of the event stream (which resubscribes `since` the last event seen, so
//!   Docker replays what it still has), and every `reconcile_interval` (minutes), never every
//!   second. A failed list changes no task.
//! - **Retries cost nothing while idle.** Every second, tasks with a failed write, a failed
//!   stop, a release to retry or queued events are driven again; in-memory checks only, no
//!   Docker request when nothing is to do.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::StreamExt as _;
use shim_runtime::{ContainerEvent, ContainerSummary, EventKind, EventStream};
use shim_task::TaskStatus;
use shim_task::machine::{Event, Observation};

use crate::engine::{Inner, Slot, chain, now_ms};
use crate::labels::{LABEL_TASK_ID, any_shim_filter};

/// How often failed side effects and queued events are retried.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// The event stream's reconnection delays.
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

impl Inner {
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
        let containers = self.deps.runtime.list(&any_shim_filter()).await?;
        Ok(self.ours(containers).await)
    }

    /// One full cycle: one list request, then every task against it. Returns whether the
    /// list request succeeded.
    pub(crate) async fn cycle(self: &Arc<Self>) -> bool {
        let listed_at = crate::engine::mono_ns();
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
    /// ([`mono_ns`](crate::engine::mono_ns)).
    async fn cycle_with_since(self: &Arc<Self>, containers: Vec<ContainerSummary>, listed_at: u64) {
        let started = std::time::Instant::now();
        let by_task: HashMap<&str, &ContainerSummary> = containers
            .iter()
            .filter_map(|c| c.labels.get(LABEL_TASK_ID).map(|id| (id.as_str(), c)))
            .collect();
        let by_name: HashMap<&str, &ContainerSummary> =
            containers.iter().map(|c| (c.name.as_str(), c)).collect();
        for slot in self.slots() {
            // Only tasks whose start had returned before the list was requested: a start that
            // returned since made a container the list may not show; judging it by this list
            // would call its new container vanished.
            if slot.lock().start_in_flight()
                || slot.start_returned.load(Ordering::SeqCst) >= listed_at
            {
                continue;
            }
            let (status, container_id) = {
                let t = slot.lock();
                (t.record().status, t.record().container_id.clone())
            };
            let summary = by_name
                .get(slot.container_name.as_str())
                .or_else(|| by_task.get(slot.id.as_str()))
                .copied()
                .filter(|c| {
                    container_id.is_empty() || c.id == container_id || c.name == slot.container_name
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
                    Some(c) if c.state.is_running() => None,
                    Some(c) => Some(self.observe_stopped_slot(&slot, &c.id).await),
                }
            };
            if let Some(obs) = observation {
                tracing::info!(task = %slot.id, observation = ?obs, "container observed");
                if let Err(e) = self.drive(&slot, Event::Observed(obs)).await {
                    tracing::error!(task = %slot.id, error = %chain(&e), "reconcile step failed");
                }
            }
            self.retry_task(&slot).await;
        }
        *self.last_cycle_ms.lock().unwrap_or_else(|p| p.into_inner()) = Some(now_ms());
        self.metrics.cycle.observe(started.elapsed().as_secs_f64());
    }

    /// Retries what a task still wants after a failure: a write, a stop, a release; and its
    /// queued events. Nothing is asked of Docker unless something is to do.
    pub(crate) async fn retry_task(self: &Arc<Self>, slot: &Arc<Slot>) {
        let (in_flight, dirty) = {
            let t = slot.lock();
            (t.start_in_flight(), t.is_dirty())
        };
        if in_flight {
            return;
        }
        if dirty && let Err(e) = self.drive(slot, Event::PersistRequested).await {
            // What ends the task does not wait for the disk: its stop and release go on.
            tracing::warn!(task = %slot.id, error = %chain(&e), "state write still failing");
        }
        let (needs_release, stop_failed, container_id) = {
            let t = slot.lock();
            (
                t.needs_release(),
                t.stop_failed(),
                t.record().container_id.clone(),
            )
        };
        if needs_release {
            if let Err(e) = self.drive(slot, Event::ReleaseRequested).await {
                tracing::warn!(task = %slot.id, error = %chain(&e), "release still failing");
            }
        } else if stop_failed && !container_id.is_empty() {
            // Its stop failed and it holds nothing: what does the container do now? A
            // container still running is stopped again; one that is gone or ended is settled.
            let observation = self.observe_stopped_slot(slot, &container_id).await;
            if let Err(e) = self.drive(slot, Event::Observed(observation)).await {
                tracing::warn!(task = %slot.id, error = %chain(&e), "stop still failing");
            }
        }
        self.kick_events(slot);
    }

    /// The retry pass: every task, in memory only.
    async fn retry_all(self: &Arc<Self>) {
        for slot in self.slots() {
            let wants = {
                let t = slot.lock();
                !t.start_in_flight() && (t.is_dirty() || t.needs_retry())
            };
            if wants {
                self.retry_task(&slot).await;
            } else {
                self.kick_events(&slot);
            }
        }
    }

    /// Routes one event to its task (if it is one of ours).
    fn route(self: &Arc<Self>, event: ContainerEvent) {
        let slot = self
            .slots()
            .into_iter()
            .find(|s| s.container_name == event.name);
        let Some(slot) = slot else {
            return;
        };
        tracing::debug!(task = %slot.id, container = %event.container_id, kind = ?event.kind, "container event");
        slot.queue_event(event);
        self.kick_events(&slot);
    }

    /// Makes sure a task's queued events are being handled, unless start owns it (start's
    /// end kicks them).
    pub(crate) fn kick_events(self: &Arc<Self>, slot: &Arc<Slot>) {
        if slot.lock().start_in_flight() || !slot.claim_event_worker() {
            return;
        }
        let this = self.clone();
        let slot = slot.clone();
        tokio::spawn(async move {
            while let Some(event) = slot.next_event() {
                this.handle_event(&slot, event).await;
            }
        });
    }

    async fn handle_event(self: &Arc<Self>, slot: &Arc<Slot>, event: ContainerEvent) {
        {
            let t = slot.lock();
            // An event of another container of the same name (one this task replaced, or an
            // earlier task's) is not about this task.
            if !t.record().container_id.is_empty() && t.record().container_id != event.container_id
            {
                return;
            }
        }
        self.metrics.event(match event.kind {
            EventKind::Die { .. } => "die",
            EventKind::Oom => "oom",
            EventKind::Destroy => "destroy",
        });
        let observation = match event.kind {
            EventKind::Oom => {
                slot.oom.store(true, Ordering::SeqCst);
                return;
            }
            EventKind::Destroy => Observation::Missing,
            EventKind::Die { exit_code: None } => self.observe_stopped(&event.container_id).await,
            EventKind::Die {
                exit_code: Some(code),
            } => {
                slot.exit_ns.store(event.time_ns, Ordering::SeqCst);
                let oom_killed = slot.oom.swap(false, Ordering::SeqCst);
                // A clean exit (code 0, OOM-killed helpers or not) needs no log lines; an
                // error reads them (Docker serves logs without the container's lock).
                let last_lines = if code == 0 {
                    Vec::new()
                } else {
                    self.deps
                        .runtime
                        .logs_tail(&event.container_id, self.cfg.exit_log_lines)
                        .await
                        .unwrap_or_default()
                };
                Observation::Exited {
                    code,
                    last_lines,
                    oom_killed,
                }
            }
        };
        if let Err(e) = self.drive(slot, Event::Observed(observation)).await {
            tracing::error!(task = %slot.id, error = %chain(&e), "event step failed");
        }
    }
}

/// Starts the background jobs: the event listener (on `first`, the subscription made at
/// start-up, if it succeeded), the retry pass and the backstop list.
pub(crate) fn spawn_background(
    inner: &Arc<Inner>,
    first: Option<EventStream>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let events = {
        let this = inner.clone();
        tokio::spawn(async move { this.run_events(first).await })
    };
    let reconciler = {
        let this = inner.clone();
        tokio::spawn(async move {
            let mut backstop = tokio::time::interval(this.cfg.reconcile_interval);
            backstop.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            backstop.tick().await; // the first cycle ran at start-up
            let mut retry = tokio::time::interval(RETRY_EVERY);
            retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = this.shutdown.cancelled() => break,
                    _ = backstop.tick() => {
                        let swept = this.blocking(|s| Ok(s.sweep_trash())).await.unwrap_or(0);
                        if swept > 0 {
                            tracing::info!(swept, "removed trash directories");
                        }
                        this.cycle().await;
                    }
                    _ = this.relist.notified() => {
                        this.cycle().await;
                    }
                    _ = retry.tick() => this.retry_all().await,
                }
            }
            tracing::debug!("reconciler stopped");
        })
    };
    vec![events, reconciler]
}

impl Inner {
    /// The first subscription to the container events, made at start-up before the engine is
    /// handed out, so that a shim that serves is subscribed from its first request (bounded
    /// by [`RECONNECT_MAX`]; `None` when it failed, and the listener tries again).
    pub(crate) async fn first_subscription(&self) -> Option<EventStream> {
        match tokio::time::timeout(RECONNECT_MAX, self.subscribe()).await {
            Ok(Ok(stream)) => {
                self.events_connected.store(true, Ordering::SeqCst);
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

    /// Subscribes to this shim's container events since the last one seen.
    async fn subscribe(&self) -> shim_runtime::Result<EventStream> {
        let since = self.events_since.load(Ordering::SeqCst);
        self.deps
            .runtime
            .events(&any_shim_filter(), Some(since))
            .await
    }

    /// Listens to the container events for as long as the engine runs (on `first`, then on
    /// its own subscriptions), reconnecting with a backoff; every reconnection resubscribes
    /// since the last event seen and asks for a full list (what the daemon no longer had is
    /// found that way).
    async fn run_events(self: Arc<Self>, mut first: Option<EventStream>) {
        let mut delay = RECONNECT_MIN;
        let mut seen: HashSet<(String, i64)> = HashSet::new();
        while !self.shutdown.is_cancelled() {
            let subscribed = match first.take() {
                Some(stream) => Ok(stream),
                // Subscribing asks the daemon (bounded by the request timeout): a frozen
                // daemon must not hold up a shutdown.
                None => tokio::select! {
                    _ = self.shutdown.cancelled() => return,
                    subscribed = self.subscribe() => subscribed,
                },
            };
            match subscribed {
                Ok(mut stream) => {
                    self.events_connected.store(true, Ordering::SeqCst);
                    self.metrics.events_reconnects.inc();
                    if self.events_reconnects.fetch_add(1, Ordering::SeqCst) > 0 {
                        tracing::info!("container event stream reconnected; relisting");
                        self.relist.notify_one();
                    }
                    let connected = tokio::time::Instant::now();
                    let mut carried = false;
                    loop {
                        let item = tokio::select! {
                            _ = self.shutdown.cancelled() => return,
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
                    self.events_connected.store(false, Ordering::SeqCst);
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
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(RECONNECT_MAX);
        }
    }
}
