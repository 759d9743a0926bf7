//! An in-memory [`ContainerRuntime`] for fast, deterministic tests of the layers above
//! (`cfg(test)` or feature `test-support`, like every fake of the workspace).
//!
//! It records every call ([`FakeRuntime::calls`]) and can be told to make a container exit
//! ([`FakeRuntime::exit`], which also emits the exit event), vanish, fail or hang on start,
//! fail, hang or time out on pull, hold stops, report logs, answer lists and event
//! subscriptions late, refuse a create whose bind source is missing (as the Docker runtime
//! does), break event streams, or have the daemon unreachable.
//!
//! Container ids are 64 hex digits, counting up from 1; published host ports are assigned from
//! 32768 upwards at start, in bridge mode.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures_util::StreamExt;
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

use crate::spec::ContainerSpec;
use crate::types::{
    ContainerDetails, ContainerEvent, ContainerState, ContainerSummary, EventKind, GpuSupport,
    ImageDetails, MountPoint, PublishedPort, PullRequest, has_labels,
};
use crate::{ContainerRuntime, EventStream, ProgressFn, Result, RuntimeError};
use shim_task::NetworkMode;
use shim_task::PullProgress;
use shim_util::BoxError;

/// One recorded call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `image_present(image)`.
    ImagePresent(String),
    /// `pull(request)` (the image, and whether credentials were given).
    Pull {
        /// The image.
        image: String,
        /// Whether credentials were given.
        with_auth: bool,
    },
    /// `create(spec)`.
    Create(Box<ContainerSpec>),
    /// `start(id)`.
    Start(String),
    /// `inspect(id)`.
    Inspect(String),
    /// `list(labels)`.
    List(Vec<(String, String)>),
    /// `stop(id, timeout)`.
    Stop(String, Duration),
    /// `remove(id)`.
    Remove(String),
    /// `logs_tail(id, n)`.
    LogsTail(String, usize),
    /// `events(labels, since_ns)`.
    Events(Vec<(String, String)>, Option<i64>),
    /// `inspect_image(image)`.
    InspectImage(String),
    /// `delete_image(image)`.
    DeleteImage(String),
}

impl Call {
    /// The operation's name (`"start"`, `"list"`, …), handy for counting calls.
    pub fn op(&self) -> &'static str {
        match self {
            Self::ImagePresent(_) => "image_present",
            Self::InspectImage(_) => "inspect_image",
            Self::DeleteImage(_) => "delete_image",
            Self::Pull { .. } => "pull",
            Self::Create(_) => "create",
            Self::Start(_) => "start",
            Self::Inspect(_) => "inspect",
            Self::List(_) => "list",
            Self::Stop(..) => "stop",
            Self::Remove(_) => "remove",
            Self::LogsTail(..) => "logs_tail",
            Self::Events(..) => "events",
        }
    }
}

/// What `pull` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullBehavior {
    /// Reports `progress` steps, then succeeds (the image becomes present).
    Succeed {
        /// The progress reported, in order (the last one, made final, is returned).
        steps: Vec<PullProgress>,
    },
    /// Reports `steps`, then fails with the daemon message `message`.
    Fail {
        /// The progress reported before failing.
        steps: Vec<PullProgress>,
        /// The daemon's message.
        message: String,
    },
    /// Reports `steps`, then waits until cancelled (→ `Cancelled`), the request's timeout
    /// expires (→ `PullTimeout`), its stall timeout expires (→ `PullStalled`, the steps' time
    /// not counted), or [`FakeRuntime::release_pulls`] is called (→ success).
    Hang {
        /// The progress reported before hanging.
        steps: Vec<PullProgress>,
    },
}

impl Default for PullBehavior {
    fn default() -> Self {
        Self::Succeed {
            steps: vec![PullProgress {
                downloaded_bytes: 100,
                extracted_bytes: 100,
                total_bytes: 100,
                is_total_bytes_final: true,
            }],
        }
    }
}

/// What `start` does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StartBehavior {
    /// The container runs.
    #[default]
    Succeed,
    /// Start fails with this daemon message (the container stays `created`).
    Fail(String),
    /// Start waits until [`FakeRuntime::release_starts`], then succeeds.
    Hang,
    /// The container starts, but the answer is lost: the call fails as a request that timed
    /// out does ([`RuntimeError::DaemonUnavailable`]).
    StartsAnswerLost,
    /// The container starts, but the answer does not come: the call waits until
    /// [`FakeRuntime::release_starts`], then answers (a request whose answer is late while
    /// the engine already shows the container running; counted by
    /// [`FakeRuntime::answers_lost`]).
    StartsAnswerLate,
}

/// How a container's exit is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    /// The `die` event.
    Announced,
    /// The OOM flag, the `oom` event, then the `die` event (Docker).
    OomKilled,
    /// The OOM flag and the `die` event only (Podman).
    OomKilledSilently,
    /// No event (lost).
    Unannounced,
}

#[derive(Debug, Clone)]
struct FakeContainer {
    id: String,
    spec: ContainerSpec,
    /// The id of the image it was created from.
    image_id: String,
    state: ContainerState,
    exit_code: Option<i64>,
    error: String,
    ports: Vec<PublishedPort>,
    logs: Vec<String>,
    started_at: Option<String>,
    finished_at: Option<String>,
    oom_killed: bool,
    /// The main process's id, as inspect reports it while it runs.
    pid: Option<u32>,
}

#[derive(Debug, Default)]
struct State {
    calls: Vec<Call>,
    unreachable: bool,
    /// The local images: each name (normalised) → the id it points to.
    images: BTreeMap<String, String>,
    /// Every local image by id (dangling ones too) → its size.
    image_ids: BTreeMap<String, u64>,
    /// The labels of images made by [`FakeRuntime::commit`], by id.
    image_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// The id the next pull of a name (normalised) gives (default: [`FakeRuntime::default_image_id`]).
    pull_ids: BTreeMap<String, String>,
    data_root: Option<std::path::PathBuf>,
    containers: BTreeMap<String, FakeContainer>,
    next_id: u64,
    next_port: u16,
    clock: u64,
    pull: PullBehavior,
    start: StartBehavior,
    start_queue: VecDeque<StartBehavior>,
    /// The next create makes its container but fails as a request that timed out.
    lose_create_answer: bool,
    /// The next removal removes its container but fails as a request that timed out.
    lose_remove_answer: bool,
    /// How many answers were lost so far (creates, starts, removals).
    answers_lost: usize,
    stop_exit_code: Option<i64>,
    /// Every event sent so far, for replays (`since`), like the daemon's ring buffer.
    event_log: Vec<ContainerEvent>,
    /// The events clock: Unix nanoseconds of the next event (strictly increasing).
    event_clock: i64,
    /// Lists answer only once released, with what they saw when called.
    hold_lists: bool,
    /// An unreachable daemon shows on a new event stream's first item, not at subscribing.
    events_fail_late: bool,
    /// Event subscriptions answer only once released.
    hold_subscriptions: bool,
    /// Stops answer only once released (the stop itself happens when released).
    hold_stops: bool,
    /// Container removals answer only once released (the removal happens when released).
    hold_removes: bool,
    /// Image removals answer only once released (the removal happens when released).
    hold_image_deletes: bool,
    /// A create fails, as Docker's does, when a bind mount's source does not exist on this
    /// host.
    check_bind_sources: bool,
    /// Podman's version when creates refuse device requests as the Docker runtime does on
    /// Podman.
    podman: Option<String>,
    /// What `gpu_support` answers.
    gpu_support: Option<GpuSupport>,
}

/// The in-memory fake runtime. Cheap to clone (clones share state).
#[derive(Debug, Clone)]
pub struct FakeRuntime {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<ContainerEvent>,
    calls_seen: Arc<watch::Sender<usize>>,
    starts_released: Arc<watch::Sender<u64>>,
    pulls_released: Arc<watch::Sender<u64>>,
    lists_released: Arc<watch::Sender<u64>>,
    /// Bumped to end every open event stream with an error.
    streams_broken: Arc<watch::Sender<u64>>,
    subscriptions_released: Arc<watch::Sender<u64>>,
    stops_released: Arc<watch::Sender<u64>>,
    removes_released: Arc<watch::Sender<u64>>,
    image_deletes_released: Arc<watch::Sender<u64>>,
}

impl Default for FakeRuntime {
    fn default() -> Self {
        Self::new()
    }
}

fn unavailable(op: &'static str, what: &str) -> RuntimeError {
    let source: BoxError = Box::new(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        "fake daemon unreachable",
    ));
    RuntimeError::DaemonUnavailable {
        op,
        what: what.to_owned(),
        source,
    }
}

fn container_not_found(id: &str) -> RuntimeError {
    RuntimeError::NotFound {
        what: format!("container {id}"),
    }
}

/// The mounts Docker reports for a container made from `spec`.
fn mount_points(spec: &ContainerSpec) -> Vec<MountPoint> {
    spec.mounts
        .iter()
        .map(|m| MountPoint {
            source: m.source.to_string_lossy().into_owned(),
            destination: m.target.clone(),
            read_write: !m.read_only,
        })
        .collect()
}

impl FakeRuntime {
    /// A fake with no images and no containers; pulls and starts succeed.
    pub fn new() -> Self {
        let (events, _) = broadcast::channel(1024);
        Self {
            state: Arc::new(Mutex::new(State {
                next_id: 1,
                next_port: 32768,
                ..State::default()
            })),
            events,
            calls_seen: Arc::new(watch::channel(0).0),
            starts_released: Arc::new(watch::channel(0).0),
            pulls_released: Arc::new(watch::channel(0).0),
            lists_released: Arc::new(watch::channel(0).0),
            streams_broken: Arc::new(watch::channel(0).0),
            subscriptions_released: Arc::new(watch::channel(0).0),
            stops_released: Arc::new(watch::channel(0).0),
            removes_released: Arc::new(watch::channel(0).0),
            image_deletes_released: Arc::new(watch::channel(0).0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock poisons it; the data is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a call; fails with `DaemonUnavailable` when the daemon is "unreachable".
    fn record(&self, call: Call, what: &str) -> Result<MutexGuard<'_, State>> {
        let mut state = self.lock();
        let op = call.op();
        state.calls.push(call);
        let n = state.calls.len();
        self.calls_seen.send_replace(n);
        if state.unreachable {
            return Err(unavailable(op, what));
        }
        Ok(state)
    }

    fn timestamp(state: &mut State) -> String {
        state.clock += 1;
        format!(
            "2026-01-01T00:00:{:02}.{:09}Z",
            state.clock / 1000 % 60,
            state.clock
        )
    }

    /// What a list with `labels` shows now.
    fn summaries(state: &State, labels: &[(String, String)]) -> Vec<ContainerSummary> {
        state
            .containers
            .values()
            .filter(|c| has_labels(&c.spec.labels, labels))
            .map(|c| ContainerSummary {
                ports: c.ports.clone(),
                id: c.id.clone(),
                name: c.spec.name.clone(),
                state: c.state.clone(),
                labels: c.spec.labels.clone(),
                mounts: mount_points(&c.spec),
            })
            .collect()
    }

    // ---- driving the fake ----

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// How many calls of operation `op` (see [`Call::op`]) were made.
    pub fn count(&self, op: &str) -> usize {
        self.lock().calls.iter().filter(|c| c.op() == op).count()
    }

    /// Forgets the recorded calls.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    /// Waits until a recorded call satisfies `pred` (checks past calls too).
    pub async fn wait_for_call(&self, pred: impl Fn(&Call) -> bool) -> Call {
        let mut seen = self.calls_seen.subscribe();
        loop {
            if let Some(call) = self.lock().calls.iter().find(|c| pred(c)).cloned() {
                return call;
            }
            // The sender lives as long as self: changed() cannot fail here.
            let _ = seen.changed().await;
        }
    }

    /// Waits until operation `op` (see [`Call::op`]) has been called more than `count` times.
    pub async fn wait_for_count(&self, op: &str, count: usize) {
        let mut seen = self.calls_seen.subscribe();
        while self.count(op) <= count {
            // The sender lives as long as self: changed() cannot fail here.
            let _ = seen.changed().await;
        }
    }

    /// Makes every call fail with `DaemonUnavailable` (or stop doing so).
    pub fn set_unreachable(&self, unreachable: bool) {
        self.lock().unreachable = unreachable;
    }

    /// The id the fake gives an image named `image` unless told otherwise
    /// ([`Self::add_image_with_id`], [`Self::set_pull_id`]): the same for every spelling of the
    /// name.
    pub fn default_image_id(image: &str) -> String {
        format!("sha256:fake-{}", crate::normalize_reference(image))
    }

    /// Makes an image present under `image` (its id: [`Self::default_image_id`]).
    pub fn add_image(&self, image: &str) {
        self.add_image_with_id(image, &Self::default_image_id(image));
    }

    /// Points the name `image` at the image `id` (made present; an image the name pointed to
    /// before stays, dangling when no other name points to it: a tag moved, a local build
    /// over a pulled name).
    pub fn add_image_with_id(&self, image: &str, id: &str) {
        let mut state = self.lock();
        state.image_ids.entry(id.to_owned()).or_insert(0);
        state
            .images
            .insert(crate::normalize_reference(image), id.to_owned());
    }

    /// Makes an image named `image` of the container `id` with the container's labels and
    /// `added`, as `docker commit --change 'LABEL k=v'` does; a container created from it gets those labels where its spec
    /// sets none (Docker's create merges the image's labels under the spec's).
    pub fn commit(&self, id: &str, image: &str, added: &[(&str, &str)]) {
        let mut state = self.lock();
        let mut labels = Self::resolve(&mut state, id)
            .map(|c| c.spec.labels.clone())
            .unwrap_or_default();
        labels.extend(
            added
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        );
        let name = crate::normalize_reference(image);
        let image_id = format!("sha256:fake-commit-{name}");
        state.image_ids.entry(image_id.clone()).or_insert(0);
        state.images.insert(name, image_id.clone());
        state.image_labels.insert(image_id, labels);
    }

    /// The id the next pulls of `image` give (a tag moved in the registry).
    pub fn set_pull_id(&self, image: &str, id: &str) {
        self.lock()
            .pull_ids
            .insert(crate::normalize_reference(image), id.to_owned());
    }

    /// The id the name `image` points to, if present.
    pub fn image_id(&self, image: &str) -> Option<String> {
        Self::resolve_image(&self.lock(), image)
    }

    /// The bytes every local image takes together (their sizes, each id once): what a fake
    /// data root's file system holds of images.
    pub fn image_bytes(&self) -> u64 {
        self.lock().image_ids.values().sum()
    }

    /// Whether the image `id` is present (dangling or not).
    pub fn has_image_id(&self, id: &str) -> bool {
        self.lock().image_ids.contains_key(id)
    }

    /// Sets the size `inspect_image` reports for an image, by name or id (0 by default).
    pub fn set_image_size(&self, image: &str, bytes: u64) {
        let mut state = self.lock();
        if let Some(id) = Self::resolve_image(&state, image) {
            state.image_ids.insert(id, bytes);
        }
    }

    /// The id `image` (a name or an id) means, if present.
    fn resolve_image(state: &State, image: &str) -> Option<String> {
        if state.image_ids.contains_key(image) {
            return Some(image.to_owned());
        }
        state
            .images
            .get(&crate::normalize_reference(image))
            .cloned()
    }

    /// Removes the name `image`, and the image when no other name points to it, telling
    /// subscribers as the engine does ([`EventKind::ImageRemoved`]).
    fn untag(&self, state: &mut State, image: &str) {
        let name = crate::normalize_reference(image);
        if let Some(id) = state.images.remove(&name) {
            self.emit_image_removed(state, &id, &name);
            if !state.images.values().any(|i| *i == id) {
                state.image_ids.remove(&id);
            }
        }
    }

    /// Sets what `gpu_support` answers (by default: a Docker-like engine applying NVIDIA
    /// requests and no CDI, or Podman's answer after [`Self::as_podman`]).
    pub fn set_gpu_support(&self, support: GpuSupport) {
        self.lock().gpu_support = Some(support);
    }

    /// Sets the directory `data_root` reports (none by default).
    pub fn set_data_root(&self, dir: Option<std::path::PathBuf>) {
        self.lock().data_root = dir;
    }

    /// Removes an image by name (as `docker rmi NAME`: the image goes with its last name).
    pub fn remove_image(&self, image: &str) {
        self.untag(&mut self.lock(), image);
    }

    /// Sets what every following pull does.
    pub fn set_pull_behavior(&self, behavior: PullBehavior) {
        self.lock().pull = behavior;
    }

    /// Lets every hanging pull succeed.
    pub fn release_pulls(&self) {
        self.pulls_released.send_modify(|n| *n += 1);
    }

    /// Sets what every following start does (unless one is queued).
    pub fn set_start_behavior(&self, behavior: StartBehavior) {
        self.lock().start = behavior;
    }

    /// Queues a one-shot start behavior, used before the default one (e.g. fail the first
    /// start with `/dev/nvidia-modeset`, then succeed).
    pub fn queue_start_behavior(&self, behavior: StartBehavior) {
        self.lock().start_queue.push_back(behavior);
    }

    /// The next create makes its container, but its answer is lost: the call fails as a
    /// request that timed out does ([`RuntimeError::DaemonUnavailable`]).
    pub fn lose_next_create_answer(&self) {
        self.lock().lose_create_answer = true;
    }

    /// The next removal removes its container, but its answer is lost: the call fails as a
    /// request that timed out does ([`RuntimeError::DaemonUnavailable`]).
    pub fn lose_next_remove_answer(&self) {
        self.lock().lose_remove_answer = true;
    }

    /// How many answers were lost so far: creates, starts and removals that happened but
    /// failed as requests that timed out.
    pub fn answers_lost(&self) -> usize {
        self.lock().answers_lost
    }

    /// Lets every hanging start proceed (and succeed).
    pub fn release_starts(&self) {
        self.starts_released.send_modify(|n| *n += 1);
    }

    /// Makes every following list answer late: with the containers it saw when it was
    /// called, once [`FakeRuntime::release_lists`] is called (an answer delayed in transit,
    /// while the daemon went on).
    pub fn hold_lists(&self) {
        self.lock().hold_lists = true;
    }

    /// Lets every held list answer, and the following ones answer at once.
    pub fn release_lists(&self) {
        self.lock().hold_lists = false;
        self.lists_released.send_modify(|n| *n += 1);
    }

    /// Ends every open event stream with [`RuntimeError::DaemonUnavailable`], as a daemon
    /// restart or a lost connection does.
    pub fn break_event_streams(&self) {
        self.streams_broken.send_modify(|n| *n += 1);
    }

    /// Makes an unreachable daemon show on a new event stream's first item (an error) instead
    /// of failing the subscription: what a runtime whose subscription only connects when read
    /// does.
    pub fn set_event_subscriptions_fail_late(&self, late: bool) {
        self.lock().events_fail_late = late;
    }

    /// Makes every following event subscription wait for its answer until
    /// [`FakeRuntime::release_subscriptions`] (a frozen daemon).
    pub fn hold_subscriptions(&self) {
        self.lock().hold_subscriptions = true;
    }

    /// Lets every held event subscription answer, and the following ones answer at once.
    pub fn release_subscriptions(&self) {
        self.lock().hold_subscriptions = false;
        self.subscriptions_released.send_modify(|n| *n += 1);
    }

    /// Makes every following stop wait, before it stops anything, until
    /// [`FakeRuntime::release_stops`] (a busy daemon, or a process that takes its grace
    /// period).
    pub fn hold_stops(&self) {
        self.lock().hold_stops = true;
    }

    /// Lets every held stop proceed, and the following ones stop at once.
    pub fn release_stops(&self) {
        self.lock().hold_stops = false;
        self.stops_released.send_modify(|n| *n += 1);
    }

    /// Makes every following container removal wait, before it removes anything, until
    /// [`FakeRuntime::release_removes`] (a force-remove kills first: a container stuck in the
    /// kernel holds it up).
    pub fn hold_removes(&self) {
        self.lock().hold_removes = true;
    }

    /// Lets every held container removal proceed, and the following ones at once.
    pub fn release_removes(&self) {
        self.lock().hold_removes = false;
        self.removes_released.send_modify(|n| *n += 1);
    }

    /// Makes every following image removal wait, before it removes anything, until
    /// [`FakeRuntime::release_image_deletes`] (a large image's removal takes seconds).
    pub fn hold_image_deletes(&self) {
        self.lock().hold_image_deletes = true;
    }

    /// Lets every held image removal proceed, and the following ones at once.
    pub fn release_image_deletes(&self) {
        self.lock().hold_image_deletes = false;
        self.image_deletes_released.send_modify(|n| *n += 1);
    }

    /// Makes creates check, as the Docker runtime does before it asks the engine, that every
    /// bind mount's source exists on this host: a create with a missing one fails
    /// ([`RuntimeError::BindSourceMissing`]) and makes no container. Off by default (tests
    /// mount made-up paths).
    pub fn check_bind_sources(&self, on: bool) {
        self.lock().check_bind_sources = on;
    }

    /// Makes creates refuse device requests as the Docker runtime does on Podman `version`
    /// (its Docker API ignores NVIDIA ones): a create with one fails
    /// ([`RuntimeError::DeviceRequestsIgnored`]) and makes no container. `None` (the default):
    /// Docker, which honours them.
    pub fn as_podman(&self, version: Option<&str>) {
        self.lock().podman = version.map(str::to_owned);
    }

    /// The exit code containers get when stopped (default: 137 when killed at once, 143
    /// otherwise).
    pub fn set_stop_exit_code(&self, code: Option<i64>) {
        self.lock().stop_exit_code = code;
    }

    /// Makes a running (or created) container exit with `code` and emits its `die` event.
    /// Returns false if there is no such container.
    pub fn exit(&self, id: &str, code: i64) -> bool {
        self.exit_inner(id, code, Exit::Announced)
    }

    /// Like [`FakeRuntime::exit`], with the `oom` event first and the OOM flag set, as when
    /// the kernel's OOM killer ends the process.
    pub fn exit_oom(&self, id: &str, code: i64) -> bool {
        self.exit_inner(id, code, Exit::OomKilled)
    }

    /// Like [`FakeRuntime::exit_oom`], as Podman reports an OOM kill: the OOM flag set, the
    /// `die` event only (Podman sends no `oom` event).
    pub fn exit_oom_without_oom_event(&self, id: &str, code: i64) -> bool {
        self.exit_inner(id, code, Exit::OomKilledSilently)
    }

    /// Like [`FakeRuntime::exit`], but the event is lost (a subscriber that was not connected,
    /// or a daemon whose buffer dropped it).
    pub fn exit_without_event(&self, id: &str, code: i64) -> bool {
        self.exit_inner(id, code, Exit::Unannounced)
    }

    /// Records and broadcasts an event (the state lock is held by the caller).
    fn emit(&self, state: &mut State, c: &FakeContainer, kind: EventKind) {
        self.send_event(
            state,
            ContainerEvent {
                container_id: c.id.clone(),
                name: c.spec.name.clone(),
                kind,
                labels: c.spec.labels.clone(),
                time_ns: 0,
            },
        );
    }

    /// An image's removal ([`EventKind::ImageRemoved`]): `name` lost its image `id`.
    fn emit_image_removed(&self, state: &mut State, id: &str, name: &str) {
        self.send_event(
            state,
            ContainerEvent {
                container_id: id.to_owned(),
                name: name.to_owned(),
                kind: EventKind::ImageRemoved,
                labels: BTreeMap::new(),
                time_ns: 0,
            },
        );
    }

    /// Stamps `event` with the events clock, logs it for replays and sends it.
    fn send_event(&self, state: &mut State, mut event: ContainerEvent) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        state.event_clock = state.event_clock.max(now).saturating_add(1);
        event.time_ns = state.event_clock;
        state.event_log.push(event.clone());
        // No subscriber is fine.
        let _ = self.events.send(event);
    }

    fn exit_inner(&self, id: &str, code: i64, how: Exit) -> bool {
        let mut state = self.lock();
        let now = Self::timestamp(&mut state);
        let Some(c) = state.containers.get_mut(id) else {
            return false;
        };
        c.state = ContainerState::Exited;
        c.exit_code = Some(code);
        c.oom_killed = matches!(how, Exit::OomKilled | Exit::OomKilledSilently);
        c.finished_at = Some(now);
        let c = c.clone();
        if how != Exit::Unannounced {
            if how == Exit::OomKilled {
                self.emit(&mut state, &c, EventKind::Oom);
            }
            self.emit(
                &mut state,
                &c,
                EventKind::Die {
                    exit_code: Some(code),
                },
            );
        }
        true
    }

    /// Makes a container disappear without an event (as if removed behind the shim's back).
    pub fn vanish(&self, id: &str) -> bool {
        self.lock().containers.remove(id).is_some()
    }

    /// Sets the process id inspect reports for a container while it runs (none by default).
    pub fn set_pid(&self, id: &str, pid: Option<u32>) {
        if let Some(c) = self.lock().containers.get_mut(id) {
            c.pid = pid;
        }
    }

    /// Sets a container's log lines.
    pub fn set_logs(&self, id: &str, lines: &[&str]) {
        if let Some(c) = self.lock().containers.get_mut(id) {
            c.logs = lines.iter().map(|l| (*l).to_owned()).collect();
        }
    }

    /// Appends a log line to a container.
    pub fn push_log(&self, id: &str, line: &str) {
        if let Some(c) = self.lock().containers.get_mut(id) {
            c.logs.push(line.to_owned());
        }
    }

    /// Adds a container directly (e.g. left over by an earlier shim), without recording a
    /// call. Returns its id.
    pub fn add_container(
        &self,
        spec: &ContainerSpec,
        state: ContainerState,
        exit_code: Option<i64>,
    ) -> String {
        let mut st = self.lock();
        let id = Self::new_container(&mut st, spec);
        if let Some(c) = st.containers.get_mut(&id) {
            c.state = state.clone();
            c.exit_code = exit_code;
        }
        if matches!(state, ContainerState::Running | ContainerState::Exited) {
            Self::assign_ports(&mut st, &id);
        }
        id
    }

    /// The spec a container was created with.
    pub fn spec(&self, id: &str) -> Option<ContainerSpec> {
        self.lock().containers.get(id).map(|c| c.spec.clone())
    }

    /// The state of a container.
    pub fn state(&self, id: &str) -> Option<ContainerState> {
        self.lock().containers.get(id).map(|c| c.state.clone())
    }

    /// Puts a container in `state` without an event (Podman 4.3's `stopped`: the process
    /// ended, the engine's clean-up has not run, no exit code yet). Returns whether it exists.
    pub fn set_state(&self, id: &str, state: ContainerState) -> bool {
        let mut s = self.lock();
        let Some(c) = s.containers.get_mut(id) else {
            return false;
        };
        c.state = state;
        true
    }

    /// The ids of all containers.
    pub fn container_ids(&self) -> Vec<String> {
        self.lock().containers.keys().cloned().collect()
    }

    /// The id of the container with this name.
    pub fn id_by_name(&self, name: &str) -> Option<String> {
        self.lock()
            .containers
            .values()
            .find(|c| c.spec.name == name)
            .map(|c| c.id.clone())
    }

    fn new_container(state: &mut State, spec: &ContainerSpec) -> String {
        let id = format!("{:064x}", state.next_id);
        state.next_id += 1;
        state.containers.insert(
            id.clone(),
            FakeContainer {
                id: id.clone(),
                image_id: Self::resolve_image(state, &spec.image).unwrap_or_default(),
                spec: spec.clone(),
                state: ContainerState::Created,
                exit_code: Some(0),
                error: String::new(),
                ports: Vec::new(),
                logs: Vec::new(),
                started_at: None,
                finished_at: None,
                oom_killed: false,
                pid: None,
            },
        );
        id
    }

    fn assign_ports(state: &mut State, id: &str) {
        let Some(c) = state.containers.get(id) else {
            return;
        };
        if c.spec.network != NetworkMode::Bridge || !c.ports.is_empty() {
            return;
        }
        let wanted = c.spec.published_ports.clone();
        let mut ports = Vec::new();
        for container in wanted {
            ports.push(PublishedPort {
                container,
                host: state.next_port,
            });
            state.next_port = state.next_port.wrapping_add(1).max(32768);
        }
        ports.sort();
        if let Some(c) = state.containers.get_mut(id) {
            c.ports = ports;
        }
    }

    fn resolve<'a>(state: &'a mut State, id_or_name: &str) -> Option<&'a mut FakeContainer> {
        let key = if state.containers.contains_key(id_or_name) {
            Some(id_or_name.to_owned())
        } else {
            state
                .containers
                .values()
                .find(|c| c.spec.name == id_or_name || c.id.starts_with(id_or_name))
                .map(|c| c.id.clone())
        };
        key.and_then(move |k| state.containers.get_mut(&k))
    }

    /// Writes the steps as JSON lines to the request's log path, like the real pull log.
    fn write_log(request: &PullRequest, steps: &[PullProgress]) -> Result<()> {
        let Some(path) = &request.log_path else {
            return Ok(());
        };
        let mut text = String::new();
        for step in steps {
            let line = serde_json::json!({
                "status": "Downloading",
                "id": "fake",
                "progressDetail": {"current": step.downloaded_bytes, "total": step.total_bytes},
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        fs_err::write(path, text).map_err(|source| RuntimeError::PullLog {
            path: path.clone(),
            source,
        })
    }

    async fn report_steps(steps: &[PullProgress], progress: ProgressFn<'_>) -> PullProgress {
        let mut last = PullProgress::default();
        for step in steps {
            progress(*step);
            last = *step;
            tokio::task::yield_now().await;
        }
        last
    }
}

#[async_trait]
impl ContainerRuntime for FakeRuntime {
    async fn image_present(&self, image: &str) -> Result<bool> {
        let state = self.record(Call::ImagePresent(image.to_owned()), image)?;
        Ok(Self::resolve_image(&state, image).is_some())
    }

    async fn inspect_image(&self, image: &str) -> Result<Option<ImageDetails>> {
        let state = self.record(Call::InspectImage(image.to_owned()), image)?;
        Ok(Self::resolve_image(&state, image).map(|id| {
            // A name by digest (`repo@sha256:…`) is not a tag here, as Docker's classic store
            // has it: listed in `RepoDigests`, so an image pulled by digest only has no
            // `RepoTags` (the containerd store lists the digest name among the tags too).
            let (digests, tags): (Vec<String>, Vec<String>) = state
                .images
                .iter()
                .filter(|(_, i)| **i == id)
                .map(|(name, _)| name.clone())
                .partition(|name| name.contains('@'));
            let size = state.image_ids.get(&id).copied().unwrap_or(0);
            ImageDetails::new(id, tags, size).with_digests(digests)
        }))
    }

    async fn delete_image(&self, image: &str) -> Result<()> {
        // Subscribed before the call is recorded (see `pull`).
        let mut released = self.image_deletes_released.subscribe();
        released.mark_unchanged();
        let held = self
            .record(Call::DeleteImage(image.to_owned()), image)?
            .hold_image_deletes;
        if held {
            // The sender lives as long as self: changed() cannot fail here.
            let _ = released.changed().await;
        }
        let mut state = self.lock();
        let Some(id) = Self::resolve_image(&state, image) else {
            return Ok(());
        };
        let conflict = |message: &str| RuntimeError::Conflict {
            op: "remove image",
            what: format!("image {image}"),
            message: message.to_owned(),
        };
        let by_id = state.image_ids.contains_key(image);
        // Names by digest hold nothing: they go with the image.
        let names = (state.images.iter())
            .filter(|(name, i)| **i == id && !name.contains('@'))
            .count();
        if by_id && names > 0 {
            return Err(conflict("image is referenced in one or more repositories"));
        }
        // The image goes with its last name: a container made from it holds it.
        if (by_id || names <= 1) && state.containers.values().any(|c| c.image_id == id) {
            return Err(conflict("image is being used by a container"));
        }
        if by_id {
            state.image_ids.remove(&id);
            state.images.retain(|_, i| *i != id);
            self.emit_image_removed(&mut state, &id, &id);
        } else {
            self.untag(&mut state, image);
        }
        Ok(())
    }

    async fn gpu_support(&self) -> Result<GpuSupport> {
        let state = self.lock();
        if state.unreachable {
            return Err(unavailable("info", "the daemon"));
        }
        Ok(state
            .gpu_support
            .clone()
            .unwrap_or_else(|| match &state.podman {
                // Podman 5 applies CDI; the fake reads no spec of the host's own.
                Some(version) => GpuSupport::new(
                    format!("Podman {version}"),
                    crate::docker::podman_applies_cdi(version).then(Vec::new),
                    false,
                ),
                None => GpuSupport::new("Fake engine", None, true),
            }))
    }

    async fn data_root(&self) -> Result<Option<std::path::PathBuf>> {
        Ok(self.lock().data_root.clone())
    }

    async fn pull(
        &self,
        request: &PullRequest,
        progress: ProgressFn<'_>,
        cancel: CancellationToken,
    ) -> Result<PullProgress> {
        let image = request.image.clone();
        // Subscribed before the call is recorded, so that a release after `wait_for_call`
        // always reaches this pull.
        let mut released = self.pulls_released.subscribe();
        released.mark_unchanged();
        let behavior = {
            let state = self.record(
                Call::Pull {
                    image: image.clone(),
                    with_auth: request.auth.is_some(),
                },
                &image,
            )?;
            state.pull.clone()
        };
        let steps = match &behavior {
            PullBehavior::Succeed { steps }
            | PullBehavior::Fail { steps, .. }
            | PullBehavior::Hang { steps } => steps.clone(),
        };
        Self::write_log(request, &steps)?;
        if cancel.is_cancelled() {
            return Err(RuntimeError::Cancelled {
                op: "pull",
                what: format!("image {image}"),
            });
        }
        let finish = |last: PullProgress| {
            let id = self
                .lock()
                .pull_ids
                .get(&crate::normalize_reference(&image))
                .cloned()
                .unwrap_or_else(|| Self::default_image_id(&image));
            self.add_image_with_id(&image, &id);
            let done = PullProgress {
                is_total_bytes_final: true,
                ..last
            };
            progress(done);
            Ok(done)
        };
        match behavior {
            PullBehavior::Succeed { steps } => {
                let last = Self::report_steps(&steps, progress).await;
                finish(last)
            }
            PullBehavior::Fail { steps, message } => {
                let last = Self::report_steps(&steps, progress).await;
                Err(RuntimeError::PullFailed {
                    image,
                    message,
                    downloaded_bytes: last.downloaded_bytes,
                })
            }
            PullBehavior::Hang { steps } => {
                let last = Self::report_steps(&steps, progress).await;
                tokio::select! {
                    () = cancel.cancelled() => Err(RuntimeError::Cancelled {
                        op: "pull",
                        what: format!("image {image}"),
                    }),
                    () = crate::watchdog::expiry(request.timeout) => Err(RuntimeError::PullTimeout {
                        image,
                        timeout: request.timeout.unwrap_or_default(),
                        downloaded_bytes: last.downloaded_bytes,
                    }),
                    () = crate::watchdog::expiry(request.stall_timeout) => {
                        let stalled_for = request.stall_timeout.unwrap_or_default();
                        Err(RuntimeError::PullStalled {
                            image,
                            stalled_for,
                            done_bytes: last.downloaded_bytes,
                            total_bytes: last.total_bytes,
                            total_known: last.is_total_bytes_final,
                            elapsed: stalled_for,
                            rate: crate::watchdog::rate(last.downloaded_bytes, stalled_for),
                        })
                    }
                    _ = released.changed() => finish(last),
                }
            }
        }
    }

    async fn create(&self, spec: &ContainerSpec) -> Result<String> {
        let mut state = self.record(Call::Create(Box::new(spec.clone())), &spec.name)?;
        // The Docker runtime's check on Podman, made before it asks the engine.
        if let Some(version) = &state.podman
            && let Some(request) = crate::docker::podman_ignored_request(version, spec)
        {
            return Err(RuntimeError::DeviceRequestsIgnored {
                what: format!("container {}", spec.name),
                engine: format!("Podman {version}"),
                driver: request.driver.clone(),
            });
        }
        if state.check_bind_sources {
            // The Docker runtime's own check, made before it asks the engine.
            for m in &spec.mounts {
                if let Err(e) = fs_err::metadata(&m.source) {
                    return Err(RuntimeError::BindSourceMissing {
                        what: format!("container {}", spec.name),
                        path: m.source.clone(),
                        source: std::io::Error::from(e.kind()),
                    });
                }
            }
        }
        let Some(image_id) = Self::resolve_image(&state, &spec.image) else {
            return Err(RuntimeError::NotFound {
                what: format!("image {}", spec.image),
            });
        };
        if state.containers.values().any(|c| c.spec.name == spec.name) {
            return Err(RuntimeError::Conflict {
                op: "create",
                what: format!("container {}", spec.name),
                message: format!("the container name \"/{}\" is already in use", spec.name),
            });
        }
        let mut spec = spec.clone();
        for (key, value) in state.image_labels.get(&image_id).into_iter().flatten() {
            spec.labels
                .entry(key.clone())
                .or_insert_with(|| value.clone());
        }
        let id = Self::new_container(&mut state, &spec);
        if std::mem::take(&mut state.lose_create_answer) {
            state.answers_lost += 1;
            return Err(RuntimeError::DaemonUnavailable {
                op: "create",
                what: format!("container {}", spec.name),
                source: "request timed out".into(),
            });
        }
        Ok(id)
    }

    async fn start(&self, id: &str) -> Result<()> {
        // Subscribed before the call is recorded (see `pull`).
        let mut released = self.starts_released.subscribe();
        released.mark_unchanged();
        let behavior = {
            let mut state = self.record(Call::Start(id.to_owned()), id)?;
            if Self::resolve(&mut state, id).is_none() {
                return Err(container_not_found(id));
            }
            match state.start_queue.pop_front() {
                Some(b) => b,
                None => state.start.clone(),
            }
        };
        let answer_lost = behavior == StartBehavior::StartsAnswerLost;
        let answer_late = behavior == StartBehavior::StartsAnswerLate;
        match behavior {
            StartBehavior::Succeed
            | StartBehavior::StartsAnswerLost
            | StartBehavior::StartsAnswerLate => {}
            StartBehavior::Fail(message) => {
                let mut state = self.lock();
                if let Some(c) = Self::resolve(&mut state, id) {
                    c.error = message.clone();
                    c.exit_code = Some(128);
                }
                return Err(RuntimeError::Daemon {
                    op: "start",
                    what: format!("container {id}"),
                    status: 500,
                    message,
                });
            }
            StartBehavior::Hang => {
                // The sender lives as long as self.
                let _ = released.changed().await;
            }
        }
        let id = {
            let mut state = self.lock();
            let now = Self::timestamp(&mut state);
            let Some(c) = Self::resolve(&mut state, id) else {
                return Err(container_not_found(id));
            };
            if c.state != ContainerState::Running {
                c.state = ContainerState::Running;
                c.exit_code = Some(0);
                c.error.clear();
                c.started_at = Some(now);
                c.finished_at = None;
            }
            let id = c.id.clone();
            Self::assign_ports(&mut state, &id);
            id
        };
        if answer_late {
            self.lock().answers_lost += 1;
            // The sender lives as long as self.
            let _ = released.changed().await;
        }
        if answer_lost {
            self.lock().answers_lost += 1;
            return Err(RuntimeError::DaemonUnavailable {
                op: "start",
                what: format!("container {id}"),
                source: "request timed out".into(),
            });
        }
        Ok(())
    }

    async fn inspect(&self, id_or_name: &str) -> Result<ContainerDetails> {
        let mut state = self.record(Call::Inspect(id_or_name.to_owned()), id_or_name)?;
        let c =
            Self::resolve(&mut state, id_or_name).ok_or_else(|| container_not_found(id_or_name))?;
        let spec = &c.spec;
        Ok(ContainerDetails {
            id: c.id.clone(),
            name: spec.name.clone(),
            image: spec.image.clone(),
            state: c.state.clone(),
            exit_code: c.exit_code,
            error: c.error.clone(),
            oom_killed: c.oom_killed,
            pid: c.pid.filter(|_| c.state.is_running()),
            started_at: c.started_at.clone(),
            finished_at: c.finished_at.clone(),
            labels: spec.labels.clone(),
            ports: c.ports.clone(),
            mounts: mount_points(spec),
            env: spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            device_requests: spec.device_requests.clone(),
            devices: spec.devices.clone(),
            network_mode: spec.network.as_str().to_owned(),
            nano_cpus: spec.nano_cpus,
            memory: spec.memory,
            privileged: spec.privileged,
            shm_size: spec.shm_size.unwrap_or(64 << 20),
            tmpfs: spec.tmpfs.clone(),
            user: spec.user.clone(),
        })
    }

    async fn list(&self, labels: &[(String, String)]) -> Result<Vec<ContainerSummary>> {
        // Subscribed before the call is recorded (see `pull`).
        let mut released = self.lists_released.subscribe();
        released.mark_unchanged();
        let (held, seen) = {
            let state = self.record(Call::List(labels.to_vec()), "containers")?;
            (state.hold_lists, Self::summaries(&state, labels))
        };
        if held {
            // The sender lives as long as self: changed() cannot fail here.
            let _ = released.changed().await;
        }
        Ok(seen)
    }

    async fn stop(&self, id: &str, timeout: Duration) -> Result<()> {
        // Subscribed before the call is recorded (see `pull`).
        let mut released = self.stops_released.subscribe();
        released.mark_unchanged();
        let held = self
            .record(Call::Stop(id.to_owned(), timeout), id)?
            .hold_stops;
        if held {
            // The sender lives as long as self: changed() cannot fail here.
            let _ = released.changed().await;
        }
        let (full_id, code) = {
            let mut state = self.lock();
            let code = state
                .stop_exit_code
                .unwrap_or(if timeout.is_zero() { 137 } else { 143 });
            let c = Self::resolve(&mut state, id).ok_or_else(|| container_not_found(id))?;
            if !c.state.is_running() {
                return Ok(());
            }
            (c.id.clone(), code)
        };
        self.exit(&full_id, code);
        Ok(())
    }

    async fn remove(&self, id: &str) -> Result<()> {
        // Subscribed before the call is recorded (see `pull`).
        let mut released = self.removes_released.subscribe();
        released.mark_unchanged();
        if self.record(Call::Remove(id.to_owned()), id)?.hold_removes {
            // The sender lives as long as self: changed() cannot fail here.
            let _ = released.changed().await;
        }
        let mut state = self.lock();
        let key = Self::resolve(&mut state, id).map(|c| c.id.clone());
        if let Some(key) = key
            && let Some(c) = state.containers.remove(&key)
        {
            if c.state.is_running() {
                self.emit(
                    &mut state,
                    &c,
                    EventKind::Die {
                        exit_code: Some(137),
                    },
                );
            }
            self.emit(&mut state, &c, EventKind::Destroy);
        }
        if std::mem::take(&mut state.lose_remove_answer) {
            state.answers_lost += 1;
            return Err(RuntimeError::DaemonUnavailable {
                op: "remove",
                what: format!("container {id}"),
                source: "request timed out".into(),
            });
        }
        Ok(())
    }

    async fn logs_tail(&self, id: &str, n: usize) -> Result<Vec<String>> {
        let mut state = self.record(Call::LogsTail(id.to_owned(), n), id)?;
        let c = Self::resolve(&mut state, id).ok_or_else(|| container_not_found(id))?;
        let skip = c.logs.len().saturating_sub(n);
        Ok(c.logs[skip..].to_vec())
    }

    async fn events(
        &self,
        labels: &[(String, String)],
        since_ns: Option<i64>,
    ) -> Result<EventStream> {
        // Subscribed before the call is recorded (see `pull`).
        let mut released = self.subscriptions_released.subscribe();
        released.mark_unchanged();
        let mut broken = self.streams_broken.subscribe();
        broken.mark_unchanged();
        let fail_late = self.lock().events_fail_late;
        let (held, replay, rx) = {
            let state = match self.record(Call::Events(labels.to_vec(), since_ns), "events") {
                Ok(state) => state,
                Err(e) if fail_late => {
                    return Ok(futures_util::stream::once(async move { Err(e) }).boxed());
                }
                Err(e) => return Err(e),
            };
            // Subscribed under the lock: nothing falls between the replay and the live feed.
            let rx = self.events.subscribe();
            let replay: Vec<ContainerEvent> = match since_ns {
                Some(since) => state
                    .event_log
                    .iter()
                    // Docker's `since` includes its own instant.
                    .filter(|e| e.time_ns >= since)
                    .cloned()
                    .collect(),
                None => Vec::new(),
            };
            (state.hold_subscriptions, replay, rx)
        };
        if held {
            // The sender lives as long as self: changed() cannot fail here.
            let _ = released.changed().await;
        }
        let live = futures_util::stream::unfold(Some((rx, broken)), |open| async move {
            let (mut rx, mut broken) = open?;
            loop {
                tokio::select! {
                    item = rx.recv() => match item {
                        Ok(item) => return Some((Ok(item), Some((rx, broken)))),
                        // Like the daemon's: a subscriber too slow loses events.
                        Err(broadcast::error::RecvError::Lagged(_)) => {}
                        Err(broadcast::error::RecvError::Closed) => return None,
                    },
                    // (Disabled once the fake is gone: its sender with it.)
                    Ok(()) = broken.changed() => {
                        return Some((Err(unavailable("events", "containers")), None));
                    }
                }
            }
        });
        let want = labels.to_vec();
        let stream = futures_util::stream::iter(replay.into_iter().map(Ok))
            .chain(live)
            .filter_map(move |item: Result<ContainerEvent>| {
                let keep = match &item {
                    Ok(event) => {
                        event.kind == EventKind::ImageRemoved || has_labels(&event.labels, &want)
                    }
                    Err(_) => true,
                };
                async move { keep.then_some(item) }
            });
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(v: &str) -> Vec<(String, String)> {
        vec![("owner".to_owned(), v.to_owned())]
    }

    fn spec(name: &str, owner: &str) -> ContainerSpec {
        ContainerSpec {
            name: name.to_owned(),
            image: "img:1".to_owned(),
            labels: labels(owner).into_iter().collect(),
            network: NetworkMode::Bridge,
            published_ports: vec![10999, 10022],
            ..ContainerSpec::default()
        }
    }

    fn no_progress(_: PullProgress) {}

    fn request() -> PullRequest {
        PullRequest {
            image: "img:1".to_owned(),
            auth: None,
            log_path: None,
            timeout: Some(Duration::from_secs(600)),
            stall_timeout: None,
            disk: None,
        }
    }

    #[tokio::test]
    async fn lifecycle() {
        let fake = FakeRuntime::new();
        assert!(
            fake.create(&spec("a", "me"))
                .await
                .unwrap_err()
                .is_not_found()
        );
        assert!(!fake.image_present("img:1").await.unwrap());
        let done = fake
            .pull(&request(), &no_progress, CancellationToken::new())
            .await
            .unwrap();
        assert!(done.is_total_bytes_final);
        assert!(fake.image_present("img:1").await.unwrap());

        let id = fake.create(&spec("a", "me")).await.unwrap();
        assert_eq!(id.len(), 64);
        assert!(matches!(
            fake.create(&spec("a", "me")).await,
            Err(RuntimeError::Conflict { .. })
        ));
        assert_eq!(
            fake.inspect("a").await.unwrap().state,
            ContainerState::Created
        );
        fake.start(&id).await.unwrap();
        let d = fake.inspect(&id).await.unwrap();
        assert_eq!(d.state, ContainerState::Running);
        assert_eq!(
            d.ports,
            [
                PublishedPort {
                    container: 10022,
                    host: 32769
                },
                PublishedPort {
                    container: 10999,
                    host: 32768
                }
            ]
        );

        let mut events = fake.events(&labels("me"), None).await.unwrap();
        let other = fake.add_container(&spec("b", "someone"), ContainerState::Running, None);
        assert!(fake.exit(&other, 3));
        assert!(fake.exit(&id, 7));
        let ev = events.next().await.unwrap().unwrap();
        assert_eq!(ev.container_id, id);
        assert_eq!(ev.name, "a");
        assert_eq!(ev.kind, EventKind::Die { exit_code: Some(7) });

        let listed = fake.list(&labels("me")).await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].state, ContainerState::Exited);
        fake.set_logs(&id, &["1", "2", "3"]);
        assert_eq!(fake.logs_tail(&id, 2).await.unwrap(), ["2", "3"]);
        fake.stop(&id, Duration::ZERO).await.unwrap();
        fake.remove(&id).await.unwrap();
        fake.remove(&id).await.unwrap();
        assert!(fake.inspect(&id).await.unwrap_err().is_not_found());
        assert_eq!(fake.count("remove"), 2);
    }

    #[tokio::test]
    async fn pull_log_and_silent_exit() {
        let fake = FakeRuntime::new();
        let dir = tempfile::tempdir().unwrap();
        let mut req = request();
        req.log_path = Some(dir.path().join("pull.log"));
        fake.pull(&req, &no_progress, CancellationToken::new())
            .await
            .unwrap();
        let log = fs_err::read_to_string(dir.path().join("pull.log")).unwrap();
        assert_eq!(log.lines().count(), 1);

        let id = fake.add_container(&spec("a", "me"), ContainerState::Running, None);
        let mut events = fake.events(&[], None).await.unwrap();
        assert!(fake.exit_without_event(&id, 9));
        assert!(fake.exit(&id, 9));
        // Only the second exit was announced.
        assert_eq!(
            events.next().await.unwrap().unwrap().kind,
            EventKind::Die { exit_code: Some(9) }
        );
        let pending = futures_util::FutureExt::now_or_never(events.next());
        assert!(pending.is_none());
        assert!(!fake.exit(&"0".repeat(64), 1));
    }

    #[tokio::test]
    async fn stop_emits_exit() {
        let fake = FakeRuntime::new();
        let id = fake.add_container(&spec("a", "me"), ContainerState::Running, None);
        let mut events = fake.events(&[], None).await.unwrap();
        fake.stop(&id, Duration::from_secs(10)).await.unwrap();
        assert_eq!(
            events.next().await.unwrap().unwrap().kind,
            EventKind::Die {
                exit_code: Some(143)
            }
        );
        assert_eq!(fake.inspect(&id).await.unwrap().exit_code, Some(143));
    }

    #[tokio::test]
    async fn held_stops_stop_once_released() {
        let fake = FakeRuntime::new();
        let id = fake.add_container(&spec("a", "me"), ContainerState::Running, None);
        fake.hold_stops();
        let stop = {
            let (fake, id) = (fake.clone(), id.clone());
            tokio::spawn(async move { fake.stop(&id, Duration::ZERO).await })
        };
        fake.wait_for_count("stop", 0).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!stop.is_finished());
        assert_eq!(fake.state(&id), Some(ContainerState::Running));
        fake.release_stops();
        stop.await.unwrap().unwrap();
        assert_eq!(fake.state(&id), Some(ContainerState::Exited));
    }

    #[tokio::test]
    async fn a_missing_bind_source_fails_the_create_when_checked() {
        let fake = FakeRuntime::new();
        let dir = tempfile::tempdir().unwrap();
        let mut s = spec("a", "me");
        fake.add_image(&s.image);
        s.mounts = vec![
            crate::spec::BindMount {
                source: dir.path().to_path_buf(),
                target: "/tmp/runner".into(),
                read_only: false,
            },
            crate::spec::BindMount {
                source: dir.path().join("missing"),
                target: "/usr/local/bin/dstack-runner".into(),
                read_only: true,
            },
        ];
        // Off by default.
        let id = fake.create(&s).await.unwrap();
        fake.remove(&id).await.unwrap();
        fake.check_bind_sources(true);
        let e = fake.create(&s).await.unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(&e, RuntimeError::BindSourceMissing { path, .. } if *path == dir.path().join("missing")),
            "{e:?}"
        );
        assert!(
            text.contains("bind source path does not exist")
                && text.contains(&dir.path().join("missing").display().to_string()),
            "{text}"
        );
        assert!(fake.container_ids().is_empty());
    }

    #[tokio::test]
    async fn events_replay_since_and_report_oom_and_destroy() {
        let fake = FakeRuntime::new();
        let a = fake.add_container(&spec("a", "me"), ContainerState::Running, None);
        let b = fake.add_container(&spec("b", "me"), ContainerState::Running, None);
        assert!(fake.exit_oom(&a, 137));
        let mut all = fake.events(&[], Some(0)).await.unwrap();
        let first = all.next().await.unwrap().unwrap();
        assert_eq!(first.kind, EventKind::Oom);
        let die = all.next().await.unwrap().unwrap();
        assert_eq!(
            die.kind,
            EventKind::Die {
                exit_code: Some(137)
            }
        );
        assert!(fake.inspect(&a).await.unwrap().oom_killed);
        // A subscriber since the die sees it again (Docker's `since` is inclusive), then
        // what came after.
        let mut later = fake.events(&[], Some(die.time_ns)).await.unwrap();
        assert_eq!(later.next().await.unwrap().unwrap(), die);
        fake.remove(&b).await.unwrap();
        let ev = later.next().await.unwrap().unwrap();
        assert_eq!(
            (ev.name.as_str(), ev.kind),
            (
                "b",
                EventKind::Die {
                    exit_code: Some(137)
                }
            )
        );
        let ev = later.next().await.unwrap().unwrap();
        assert_eq!((ev.name.as_str(), ev.kind), ("b", EventKind::Destroy));
        assert!(ev.time_ns > die.time_ns);
    }

    #[tokio::test]
    async fn event_streams_break_and_subscriptions_can_fail_late() {
        let fake = FakeRuntime::new();
        let a = fake.add_container(&spec("a", "me"), ContainerState::Running, None);
        let mut stream = fake.events(&[], None).await.unwrap();
        fake.break_event_streams();
        assert!(stream.next().await.unwrap().unwrap_err().is_unavailable());
        assert!(
            stream.next().await.is_none(),
            "the stream ends after its error"
        );
        // A new stream is not broken by the earlier break.
        let mut stream = fake.events(&[], None).await.unwrap();
        assert!(fake.exit(&a, 0));
        assert_eq!(stream.next().await.unwrap().unwrap().container_id, a);
        fake.set_unreachable(true);
        assert!(matches!(fake.events(&[], None).await, Err(e) if e.is_unavailable()));
        fake.set_event_subscriptions_fail_late(true);
        let mut late = fake.events(&[], None).await.unwrap();
        assert!(late.next().await.unwrap().unwrap_err().is_unavailable());
        assert!(late.next().await.is_none());
    }

    #[tokio::test]
    async fn unreachable_daemon_fails_every_call() {
        let fake = FakeRuntime::new();
        let id = fake.add_container(&spec("a", "me"), ContainerState::Running, None);
        fake.set_unreachable(true);
        assert!(fake.list(&[]).await.unwrap_err().is_unavailable());
        assert!(fake.inspect(&id).await.unwrap_err().is_unavailable());
        assert!(
            fake.stop(&id, Duration::ZERO)
                .await
                .unwrap_err()
                .is_unavailable()
        );
        assert!(fake.events(&[], None).await.is_err());
        fake.set_unreachable(false);
        assert_eq!(fake.list(&[]).await.unwrap().len(), 1);
        assert_eq!(fake.count("list"), 2);
    }

    #[tokio::test]
    async fn start_failures_and_hangs() {
        let fake = FakeRuntime::new();
        fake.add_image("img:1");
        let id = fake.create(&spec("a", "me")).await.unwrap();
        fake.queue_start_behavior(StartBehavior::Fail(
            "/dev/nvidia-modeset: no such file".into(),
        ));
        let err = fake.start(&id).await.unwrap_err();
        assert!(err.message().contains("nvidia-modeset"));
        assert_eq!(fake.state(&id), Some(ContainerState::Created));

        fake.set_start_behavior(StartBehavior::Hang);
        let f2 = fake.clone();
        let id2 = id.clone();
        let start = tokio::spawn(async move { f2.start(&id2).await });
        // Wait until the second start call is in flight: it hangs.
        let mut seen = fake.calls_seen.subscribe();
        while fake.count("start") < 2 {
            seen.changed().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!start.is_finished());
        fake.release_starts();
        start.await.unwrap().unwrap();
        assert_eq!(fake.state(&id), Some(ContainerState::Running));
    }

    #[tokio::test]
    async fn pull_fail_hang_cancel_timeout() {
        let fake = FakeRuntime::new();
        let step = PullProgress {
            downloaded_bytes: 5,
            extracted_bytes: 0,
            total_bytes: 10,
            is_total_bytes_final: true,
        };
        fake.set_pull_behavior(PullBehavior::Fail {
            steps: vec![step],
            message: "unauthorized: authentication required".to_owned(),
        });
        let seen = Mutex::new(Vec::new());
        let record = |p: PullProgress| seen.lock().unwrap().push(p);
        match fake
            .pull(&request(), &record, CancellationToken::new())
            .await
        {
            Err(RuntimeError::PullFailed {
                downloaded_bytes: 5,
                message,
                ..
            }) => {
                assert!(message.contains("unauthorized"));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(seen.lock().unwrap().as_slice(), [step]);

        fake.set_pull_behavior(PullBehavior::Hang { steps: vec![step] });
        let cancel = CancellationToken::new();
        let req = request();
        let (r, ()) = tokio::join!(fake.pull(&req, &no_progress, cancel.clone()), async {
            cancel.cancel()
        });
        assert!(matches!(r, Err(RuntimeError::Cancelled { .. })));

        let mut short = request();
        short.timeout = Some(Duration::from_millis(10));
        assert!(matches!(
            fake.pull(&short, &no_progress, CancellationToken::new())
                .await,
            Err(RuntimeError::PullTimeout {
                downloaded_bytes: 5,
                ..
            })
        ));
        assert!(!fake.image_present("img:1").await.unwrap());

        let mut stalls = request();
        stalls.stall_timeout = Some(Duration::from_millis(10));
        assert!(matches!(
            fake.pull(&stalls, &no_progress, CancellationToken::new())
                .await,
            Err(RuntimeError::PullStalled {
                done_bytes: 5,
                stalled_for,
                ..
            }) if stalled_for == Duration::from_millis(10)
        ));

        let (r, ()) = tokio::join!(
            fake.pull(&req, &no_progress, CancellationToken::new()),
            async {
                fake.wait_for_call(|c| c.op() == "pull").await;
                tokio::task::yield_now().await;
                fake.release_pulls();
            }
        );
        // A release after the pull call was recorded always reaches it.
        assert!(r.unwrap().is_total_bytes_final);
    }
}
