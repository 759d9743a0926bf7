//! Property tests of the state machine and the restore decision, driven by a small simulated
//! engine: it carries out the machine's actions against a model world (GPU locks, volumes,
//! host keys, one container, the state file) with random failures, random external events and
//! crashes of the shim at any point followed by `restore`.
//!
//! Several jobs run concurrently (start, request handlers, the reconciler); an action's effect
//! and the delivery of its outcome are separate scheduling points. A `Persist`, its write and
//! the step of its outcome are one point, as in `crates/shim-engine/src/engine.rs`, which holds
//! the task's `step_lock` across all three; pull progress is stepped outside that lock.
//!
//! Faults: actions fail, the disk fills up and empties again, remove's container removal
//! fails, the shim crashes anywhere. Beyond the per-step rules: what the API showed survives
//! every crash; no side effect runs before the record that called for it is durable; once the
//! faults stop, one terminate and ONE reconcile cycle bring every task to its end.
//!
//! Each property runs 10,000 cases, or `PROPTEST_CASES` where that is more: a deep run before
//! a change of the machine (`PROPTEST_CASES=3000000 cargo nextest run --release -p shim-task
//! --test properties`, about 2.5 min on 2 cores) finds what 10,000 cases rarely do (a stray
//! stop's outcome, `an_outcome_of_a_step_not_awaited_is_an_error`, failed after 884,309).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // test helpers: panics are failures

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use proptest::prelude::*;
use shim_task::machine::Saved;
use shim_task::machine::{
    Action, Effect, Event, Observation, Task, Transition, TransitionError, step,
};
use shim_task::naming::container_name;
use shim_task::{
    InstanceMountPoint, MountedVolume, NetworkMode, ObservedContainer, ObservedState, PortMapping,
    PublicKey, PullProgress, TaskConfig, TaskId, TaskName, TaskRecord, TaskStatus,
    TerminationReason, VolumeBackend, VolumeSpec, restore,
};

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe k";
const GPUS: [&str; 4] = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"];

#[derive(Debug, Clone)]
enum Op {
    /// Carry out an action.
    Do(Action),
    /// Step an event (the outcome of an action of this job).
    Deliver(Event),
    /// A pull in progress (the effect of `Effect::Pull`), reporting progress until it ends.
    PullRunning { reports: u32 },
    /// The mount itself, after the volume was recorded ahead (`Event::VolumeMounting`).
    Mount(MountedVolume),
}

#[derive(Debug, Clone, PartialEq)]
enum Ctr {
    Created,
    Running,
    Exited(i64),
}

#[derive(Debug, Clone)]
struct Container {
    id: String,
    state: Ctr,
    gpu_ids: Vec<String>,
    ports: Vec<PortMapping>,
    volumes: Vec<MountedVolume>,
}

/// The model world. Everything but `gpus_locked` (process memory) survives a crash.
#[derive(Debug, Default)]
struct World {
    gpus_locked: BTreeSet<String>,
    volumes_mounted: BTreeSet<String>,
    keys_present: bool,
    container: Option<Container>,
    containers_made: u32,
    pull_cancelled: bool,
    /// The state file: the record as of the last `Persist`.
    persisted: Option<TaskRecord>,
    /// Acquisitions per resource key ("gpu:X", "vol:X", "keys").
    acquired: BTreeMap<String, u32>,
    /// Releases that freed a held resource.
    released: BTreeMap<String, u32>,
}

impl World {
    fn acquire(&mut self, key: String) {
        *self.acquired.entry(key).or_default() += 1;
    }

    /// Frees `key` if held; returns false when it was not held (a no-op release).
    fn free(&mut self, key: String, held: bool) -> bool {
        if held {
            *self.released.entry(key).or_default() += 1;
        }
        held
    }

    fn container_state(&self) -> Option<&Ctr> {
        self.container.as_ref().map(|c| &c.state)
    }

    fn container_runs(&self) -> bool {
        self.container_state() == Some(&Ctr::Running)
    }
}

struct Sim {
    task: Option<Task>,
    world: World,
    /// Job 0 is the start job; the others are handlers and the reconciler.
    jobs: Vec<VecDeque<Op>>,
    now: u64,
    failures: bool,
    /// Every write fails while true (a full disk).
    disk_full: bool,
    /// A write failed at some point (a volume recorded ahead may never have been mounted).
    write_failed: bool,
    crashed: bool,
    /// The shim crashes at the next write, after the step that called for it.
    crash_at_next_write: bool,
    /// A crash lost the state file: the task was adopted from its container (its SSH keys
    /// cannot be recovered; the status may go back to running).
    corrupted: bool,
    /// An adopted task whose record a full disk refused lost its container while the shim was
    /// down: nothing names its volumes any more (the one leak no shim can avoid).
    forgotten: bool,
    config: TaskConfig,
}

/// Prints the simulation's steps when `SHIM_TASK_TRACE` is set (for debugging a failure).
fn trace(args: std::fmt::Arguments<'_>) {
    if std::env::var_os("SHIM_TASK_TRACE").is_some() {
        eprintln!("{args}");
    }
}

/// An event that says an action failed: `failed!(PrepareFailed, "volume {} not found", name)`.
macro_rules! failed {
    ($variant:ident, $($message:tt)+) => {
        Event::$variant { message: format!($($message)+) }
    };
}

fn terminate(reason: TerminationReason, message: &str, timeout_s: u64) -> Event {
    Event::TerminateRequested {
        reason,
        message: message.into(),
        timeout_s,
    }
}

/// A pull's progress (`last`: its total is final).
fn progress(downloaded_bytes: u64, extracted_bytes: u64, total: u64, last: bool) -> PullProgress {
    PullProgress {
        downloaded_bytes,
        extracted_bytes,
        total_bytes: total,
        is_total_bytes_final: last,
    }
}

/// What ends a task: it may go out before the termination is durable once its write failed
/// (SPEC §4: a failed state write never blocks a stop or a release).
fn ends_task(a: &Action) -> bool {
    matches!(
        a,
        Action::Effect(Effect::StopContainer { .. })
            | Action::Effect(Effect::CancelPull)
            | Action::Effect(Effect::Release(_))
    )
}

/// A record's reason and message.
fn ending(r: &TaskRecord) -> (&Option<TerminationReason>, &str) {
    (&r.termination_reason, &r.termination_message)
}

/// Terminated with an empty reason (the server's terminate of a dangling task), which a later
/// terminate may still replace.
fn empty_reason(r: &TaskRecord) -> bool {
    r.termination_reason
        .as_ref()
        .is_some_and(|r| r.as_str().is_empty())
}

fn same_record(a: &TaskRecord, b: &TaskRecord) -> bool {
    let mut b = b.clone();
    b.updated_at_ms = a.updated_at_ms;
    *a == b
}

fn is_start_status(s: TaskStatus) -> bool {
    matches!(
        s,
        TaskStatus::Preparing | TaskStatus::Pulling | TaskStatus::Creating
    )
}

/// `new` is `old` with only start progress: a start status further on (or the same), or
/// `running` while the container `runs`, and the first container id, nothing else.
fn only_progress(old: &TaskRecord, new: &TaskRecord, runs: bool) -> bool {
    let mut o = old.clone();
    o.status = new.status;
    if old.container_id.is_none() {
        o.container_id = new.container_id.clone();
    }
    same_record(&o, new)
        && new.status >= old.status
        && (same_record(old, new)
            || is_start_status(new.status)
            || (new.status == TaskStatus::Running && runs))
}

/// The rules every step `step` accepts keeps, whatever the order of events: statuses never
/// move back; terminated keeps its first reason and message (unless empty); a reason iff
/// terminated; unwritten start progress only while a start runs or its container runs; a
/// `Persist` only first, and nothing after it that needs the record durable; `released` only
/// once nothing is held; remove only from terminated with its start returned.
fn check_step(before: &Task, tr: &Transition, event: &Event) {
    let (b, a) = (before.record(), tr.task.record());
    let (was, is) = (b.status, a.status);
    assert!(is >= was, "{was:?} -> {is:?} on {event:?}");
    if b.status == TaskStatus::Terminated && !empty_reason(b) {
        assert_eq!(ending(a), ending(b), "{event:?}");
    }
    let terminated = a.status == TaskStatus::Terminated;
    assert_eq!(terminated, a.termination_reason.is_some(), "{event:?}");
    if tr.task.is_progress_only() {
        assert!(tr.task.is_dirty());
        let running = a.status == TaskStatus::Running && tr.task.container_runs();
        let started = tr.task.start_in_flight() || running;
        let task = &tr.task;
        assert!(started, "{event:?}: progress unwritten at rest: {task:?}");
    }
    if tr.actions.first() == Some(&Action::Persist) {
        assert!(tr.task.is_dirty());
        let durable = tr.actions.iter().skip(1).all(|a| !a.needs_durable_record());
        assert!(durable, "{event:?}: {:?}", tr.actions);
    }
    assert!(!tr.actions.iter().skip(1).any(|a| *a == Action::Persist));
    assert!(a.updated_at_ms >= b.updated_at_ms);
    if a.resources.released {
        assert!(!a.resources.holds_any());
    }
    if matches!(event, Event::RemoveRequested) {
        assert_eq!(b.status, TaskStatus::Terminated);
        assert!(!before.start_in_flight());
    }
}

fn config_from(gpu: i64, keys: bool, volumes: u8, dirs: u8, bridge: bool) -> TaskConfig {
    let mut c = TaskConfig::new(
        TaskId::new("task-1").unwrap(),
        TaskName::new("job").unwrap(),
        "shim-test:1",
    );
    c.gpu = gpu;
    if keys {
        c.host_ssh_user = "ubuntu".into();
        c.host_ssh_keys = vec![PublicKey::parse(KEY).unwrap().into()];
    }
    c.volumes = (0..volumes)
        .map(|i| VolumeSpec {
            backend: VolumeBackend::Aws,
            name: TaskName::new(format!("vol{i}")).unwrap(),
            volume_id: format!("vol-{i}"),
            init_fs: true,
            device_name: String::new(),
        })
        .collect();
    c.instance_mounts = (0..dirs)
        .map(|i| InstanceMountPoint {
            instance_path: format!("/mnt/data{i}"),
            path: format!("/data{i}"),
        })
        .collect();
    c.network_mode = if bridge {
        NetworkMode::Bridge
    } else {
        NetworkMode::Host
    };
    c
}

impl Sim {
    fn new(config: TaskConfig) -> Self {
        let name = container_name(&config.name, &config.id);
        let record = TaskRecord::new(&config, name, 1_000);
        let world = World {
            // Submit writes the state file before anything else.
            persisted: Some(record.clone()),
            ..World::default()
        };
        Sim {
            task: Some(Task::new(record)),
            world,
            jobs: vec![VecDeque::from([Op::Deliver(Event::StartBegan)])],
            now: 1_000,
            failures: true,
            disk_full: false,
            write_failed: false,
            crashed: false,
            crash_at_next_write: false,
            corrupted: false,
            forgotten: false,
            config,
        }
    }

    /// A simulation in which no action fails.
    fn faultless(config: TaskConfig) -> Self {
        Sim {
            failures: false,
            ..Sim::new(config)
        }
    }

    /// Replays `choices` (regression sequences the property test found, written as the
    /// `kind a b` of each choice, comma-separated), then drains.
    fn replay(config: TaskConfig, choices: &str) {
        let mut sim = Sim::new(config);
        for choice in choices.split(',') {
            let parse = |n: &str| n.parse::<u8>().unwrap();
            let n: Vec<u8> = choice.split_whitespace().map(parse).collect();
            sim.apply((n[0], n[1], n[2]));
        }
        sim.drain_and_check();
    }

    /// Runs the start job until `next` is its next op.
    fn run_start_until(&mut self, next: impl Fn(&Op) -> bool) {
        for _ in 0..10_000 {
            if self.jobs[0].front().is_some_and(&next) {
                return;
            }
            self.run_one(0, 1);
        }
        panic!("the start never reached the op awaited: {:?}", self.jobs);
    }

    /// A simulation of `config` in which no action fails, run until every job is done.
    fn faultless_run(config: TaskConfig) -> Self {
        let mut sim = Sim::faultless(config);
        sim.run_all();
        sim
    }

    /// The task (a test that asks knows there is one).
    fn the_task(&self) -> &Task {
        self.task.as_ref().expect("the task is known")
    }

    /// The outcome of writing `record` to the state file: it fails while the disk is full.
    fn write_state_file(&mut self, record: &TaskRecord) -> Event {
        if self.disk_full {
            failed!(PersistFailed, "No space left on device (os error 28)")
        } else {
            self.world.persisted = Some(record.clone());
            Event::Persisted
        }
    }

    fn fail(&self, b: u8) -> bool {
        self.failures && b.is_multiple_of(4)
    }

    /// Steps an event and checks the step's properties; the actions go to the front of `job`
    /// (or a new job). Returns the step's error, if any.
    fn feed(&mut self, event: Event, job: Option<usize>) -> Result<(), TransitionError> {
        let Some(before) = self.task.clone() else {
            return Ok(()); // forgotten: late outcomes are dropped
        };
        self.now += 7;
        let is_remove = matches!(event, Event::RemoveRequested);
        trace(format_args!("step {event:?} (job {job:?})"));
        let tr = match step(&before, event.clone(), self.now) {
            Ok(tr) => tr,
            Err(e) => {
                assert_eq!(self.task.as_ref(), Some(&before));
                return Err(e);
            }
        };
        check_step(&before, &tr, &event);
        let after = &tr.task;
        // Pull progress is applied outside the step lock and what it returns is not carried
        // out: it must return nothing and leave the record as it was.
        if matches!(event, Event::PullProgressed(_)) {
            assert_eq!(tr.actions, vec![], "pull progress took actions");
            let (old, new) = (before.record(), after.record());
            assert_eq!(new, old, "pull progress changed the record");
        }
        let (was, is) = (before.status(), after.status());
        assert!(is >= was, "shown {was} -> {is} on {event:?}");
        // Remove only from terminated: durably, or with its write failed (remove deletes the
        // record).
        if is_remove {
            assert!(before.saved().status == TaskStatus::Terminated || before.write_failed());
        }
        // A changed record is persisted first, but for start progress while everything not
        // yet written is progress.
        let changed = !same_record(before.record(), after.record());
        let lazy = after.is_progress_only();
        if lazy && tr.actions.first() != Some(&Action::Persist) {
            let durable = self.world.persisted.as_ref().unwrap();
            let progress = only_progress(durable, after.record(), after.container_runs());
            assert!(progress, "{event:?}: more than progress unwritten");
        }
        if changed && !lazy {
            assert_eq!(tr.actions.first(), Some(&Action::Persist), "{event:?}");
        }
        // The durable view is what the disk holds; the API shows it, or what the container
        // itself proves (SPEC §5): `running` while it runs, `terminated` once it does not.
        if let Some(p) = &self.world.persisted {
            let saved = after.saved();
            assert_eq!(*saved, Saved::of(p), "the durable view is not the disk's");
            let shown = after.shown();
            if shown != Saved::of(p) {
                let container = self.world.container_state();
                match shown.status {
                    // Started (it may have exited or vanished since, unseen: a restart then
                    // reads that from Docker, and the task moves on to its end).
                    TaskStatus::Running => assert!(
                        container != Some(&Ctr::Created) && after.container_runs(),
                        "running shown ahead of its record without a started container"
                    ),
                    TaskStatus::Terminated => assert!(
                        container != Some(&Ctr::Running) && after.container_ended(),
                        "terminated shown ahead of its record while the container runs"
                    ),
                    other => panic!("{other} shown ahead of its record"),
                }
            }
        }
        let mut tr = tr;
        if tr.actions.first() == Some(&Action::Persist) && self.crash_at_next_write {
            // The step is taken (and its change shown); the shim dies before the write.
            self.crash_at_next_write = false;
            self.task = Some(tr.task);
            self.crash(false, 0);
            return Ok(());
        }
        let mut actions: VecDeque<Op> = VecDeque::new();
        if tr.actions.first() == Some(&Action::Persist) {
            tr.actions.remove(0);
            // The write and its outcome, under the task's step lock (one scheduling point).
            let outcome = self.write_state_file(tr.task.record());
            let failed = matches!(outcome, Event::PersistFailed { .. });
            self.write_failed |= failed;
            let next = step(&tr.task, outcome, self.now).unwrap();
            assert!(!next.actions.contains(&Action::Persist));
            if failed {
                assert!(next.task.is_dirty() && next.task.write_failed());
                // Only what ends a terminated task goes out without its write.
                let terminated = next.task.record().status == TaskStatus::Terminated;
                let ending = |a: &Action| !a.needs_durable_record() || (ends_task(a) && terminated);
                assert!(next.actions.iter().all(ending), "{:?}", next.actions);
            } else {
                assert!(!next.task.is_dirty());
                assert_eq!(*next.task.saved(), Saved::of(next.task.record()));
            }
            actions.extend(next.actions.iter().cloned().map(Op::Do));
            tr.task = next.task;
        }
        actions.extend(tr.actions.iter().cloned().map(Op::Do));
        // A side effect goes out only once the record that called for it is durable (a remove
        // deletes the record), with two exceptions: the next start step while only start
        // progress is unwritten, and what ends a terminated task once its write failed.
        if !is_remove {
            for op in &actions {
                if let Op::Do(a) = op
                    && a.needs_durable_record()
                {
                    let p = || self.world.persisted.as_ref().unwrap();
                    if tr.task.is_progress_only() {
                        // Only start progress is unwritten: the next start step may go.
                        assert!(a.is_start_step(), "{a:?} with a record not yet durable");
                        let runs = tr.task.container_runs();
                        let progress = only_progress(p(), tr.task.record(), runs);
                        assert!(progress, "{a:?} unpersisted");
                    } else if tr.task.is_dirty() && ends_task(a) {
                        // The termination's write failed: its stop, pull cancel and release
                        // do not wait for the disk (SPEC §4).
                        assert!(tr.task.write_failed(), "{a:?} before its write was tried");
                        assert_eq!(tr.task.record().status, TaskStatus::Terminated, "{a:?}");
                    } else {
                        assert!(!tr.task.is_dirty(), "{a:?} with a record not yet durable");
                        assert!(same_record(tr.task.record(), p()), "{a:?} unpersisted");
                    }
                }
            }
        }
        self.task = Some(tr.task);
        match job {
            Some(j) => {
                let queue = &mut self.jobs[j];
                for op in actions.into_iter().rev() {
                    queue.push_front(op);
                }
            }
            None => {
                if !actions.is_empty() {
                    self.jobs.push(actions);
                }
            }
        }
        Ok(())
    }

    fn observation(&self) -> Observation {
        match self.world.container_state() {
            None => Observation::Missing,
            Some(Ctr::Created) => Observation::NeverStarted,
            Some(Ctr::Running) => Observation::Running,
            Some(Ctr::Exited(code)) => Observation::Exited {
                oom_killed: false,
                code: *code,
                last_lines: (1..=7).map(|i| format!("line {i}")).collect(),
            },
        }
    }

    fn observed_container(&self) -> Option<ObservedContainer> {
        self.world.container.as_ref().map(|c| ObservedContainer {
            id: c.id.clone(),
            name: format!("/{}", container_name(&self.config.name, &self.config.id)),
            task_id: self.config.id.clone(),
            state: match c.state {
                Ctr::Created => ObservedState::Created,
                Ctr::Running => ObservedState::Running,
                Ctr::Exited(code) => ObservedState::Exited { code },
            },
            gpu_ids: c.gpu_ids.clone(),
            ports: c.ports.clone(),
            recovered_volumes: c.volumes.clone(),
        })
    }

    fn crash(&mut self, lose_state_file: bool, b: u8) {
        if self.task.is_none() {
            return;
        }
        let before = self.task.clone().unwrap();
        if let Some(p) = &self.world.persisted {
            // What the API showed is exactly what is on disk.
            assert_eq!(*before.saved(), Saved::of(p));
            // Not dirty: the disk holds the record (dirty may be conservative: a change undone
            // before its write costs one redundant write).
            assert!(before.is_dirty() || same_record(before.record(), p));
        }
        self.crashed = true;
        self.jobs.clear();
        // GPU locks live in the process: its death frees them.
        for g in std::mem::take(&mut self.world.gpus_locked) {
            *self.world.released.entry(format!("gpu:{g}")).or_default() += 1;
        }
        self.world.pull_cancelled = false;
        let container = self.observed_container();
        let record = if lose_state_file && container.is_some() {
            // The unreadable file is moved aside: there is no state file until the adopted
            // task is written.
            self.corrupted = true;
            self.world.persisted = None;
            None
        } else {
            self.world.persisted.clone()
        };
        self.now += 1_000;
        let Some((task, actions)) = restore(record.clone(), container.clone(), self.now) else {
            assert!(record.is_none() && container.is_none());
            // Persist precedes every side effect: a task never written holds nothing, unless
            // it was adopted from a container whose state file was lost.
            self.forgotten |= self.corrupted;
            self.task = None;
            return;
        };
        assert!(!task.start_in_flight());
        // A record the container proves `running` (its progress never written) stays as it
        // is; any other change is written first.
        let deferred = record.as_ref().is_some_and(|r| {
            !same_record(r, task.record()) && only_progress(r, task.record(), task.container_runs())
        });
        assert_eq!(task.is_progress_only(), deferred, "{task:?}");
        let changed = record
            .as_ref()
            .is_none_or(|r| !same_record(r, task.record()));
        let persists = actions.first() == Some(&Action::Persist);
        assert_eq!(persists, changed && !deferred);
        if !self.corrupted {
            // Nothing the API showed is lost: a status never goes back, and a durable termination
            // keeps its reason and message. What it showed ahead of the record, the container
            // proves: `running` comes back, and a termination from the container's end (its
            // requested reason may be lost).
            assert!(task.record().status >= before.saved().status);
            let shown = before.shown();
            let (shown, back) = (shown.status, task.record().status);
            if shown == TaskStatus::Terminated {
                let ended = back == TaskStatus::Terminated || task.container_ended();
                assert!(ended, "a shown termination is lost: {task:?}");
            } else {
                assert!(back >= shown, "shown {shown} came back as {back}");
            }
            let (saved, view) = (before.saved(), Saved::of(task.record()));
            if saved.status == TaskStatus::Terminated {
                assert_eq!(view.termination_reason, saved.termination_reason);
                assert_eq!(view.termination_message, saved.termination_message);
            }
        }
        if task.record().status == TaskStatus::Terminated {
            assert!(task.record().termination_reason.is_some());
        }
        // Restore is idempotent: restoring what it wrote changes nothing.
        let (again, again_actions) =
            restore(Some(task.record().clone()), container, self.now + 5).unwrap();
        let same = same_record(again.record(), task.record());
        assert!(same, "restore is not idempotent");
        assert_eq!(*again.saved(), Saved::of(task.record()));
        assert!(!again_actions.contains(&Action::Persist));

        // GPU relocks first (the engine's phase 1), then the write and what follows it.
        let (locks, rest): (Vec<Action>, Vec<Action>) = actions
            .into_iter()
            .partition(|a| matches!(a, Action::Effect(Effect::LockGpus(_))));
        let mut queue: VecDeque<Op> = locks.into_iter().map(Op::Do).collect();
        let mut task = task;
        if rest.first() == Some(&Action::Persist) {
            let outcome = self.write_state_file(task.record());
            let next = step(&task, outcome, self.now).unwrap();
            task = next.task;
            queue.extend(next.actions.into_iter().map(Op::Do));
        } else {
            queue.extend(rest.into_iter().map(Op::Do));
        }
        self.task = Some(task);
        self.jobs.push(queue);
        // The engine carries out restore's actions before its reconciler's first cycle and
        // before serving requests.
        let mut b = b;
        while self.jobs.iter().any(|q| !q.is_empty()) {
            b = b.wrapping_mul(31).wrapping_add(7);
            self.run_one(0, b);
        }
        // GPUs the task still holds are locked again.
        if let Some(t) = &self.task {
            for g in &t.record().resources.gpus {
                assert!(self.world.gpus_locked.contains(g), "{g} not locked again");
            }
        }
    }

    /// Runs the next op of a job picked by `pick`; `b` decides outcomes.
    fn run_one(&mut self, pick: u8, b: u8) {
        let live: Vec<usize> = (0..self.jobs.len())
            .filter(|&j| !self.jobs[j].is_empty())
            .collect();
        if live.is_empty() {
            return;
        }
        let j = live[pick as usize % live.len()];
        let op = self.jobs[j].pop_front().unwrap();
        match op {
            Op::Deliver(event) => {
                // What the outcome calls for goes first; a remove whose release left
                // something held stops at its DeleteTaskDir (see carry_out).
                if let Err(e) = self.feed(event.clone(), Some(j)) {
                    panic!("outcome {event:?} rejected: {e}");
                }
            }
            Op::PullRunning { reports } => {
                let outcome = if self.world.pull_cancelled {
                    failed!(PullFailed, "pull cancelled")
                } else if self.fail(b) {
                    failed!(PullFailed, "pull failed: 1000 bytes downloaded")
                } else if reports < 3 && !b.is_multiple_of(3) {
                    self.jobs[j].push_front(Op::PullRunning {
                        reports: reports + 1,
                    });
                    Event::PullProgressed(progress(u64::from(reports) * 100, 0, 1000, false))
                } else {
                    Event::PullDone(progress(1000, 1000, 1000, true))
                };
                self.jobs[j].push_front(Op::Deliver(outcome));
            }
            Op::Mount(volume) => {
                let recorded = self
                    .world
                    .persisted
                    .as_ref()
                    .is_some_and(|p| p.resources.volumes.iter().any(|v| v.name == volume.name));
                if !recorded {
                    // The write-ahead failed (a full disk): the engine does not mount.
                    let message = format!("cannot record volume {} ahead", volume.name);
                    let outcome = Event::PrepareFailed { message };
                    self.jobs[j].push_front(Op::Deliver(outcome));
                    return;
                }
                assert!(self.world.volumes_mounted.insert(volume.name.clone()));
                self.world.acquire(format!("vol:{}", volume.name));
                let mounted = MountedVolume {
                    device: "/dev/loop0".into(),
                    ..volume
                };
                self.jobs[j].push_front(Op::Deliver(Event::VolumeMounted(mounted)));
            }
            Op::Do(action) => self.carry_out(j, action, b),
        }
    }

    fn carry_out(&mut self, j: usize, action: Action, b: u8) {
        trace(format_args!("job {j}: do {action:?}"));
        let Some(task) = self.task.clone() else {
            return;
        };
        let fail = self.fail(b);
        let outcome = match action {
            Action::Persist => panic!("Persist not at the head of a step's actions"),
            Action::Effect(Effect::FinishStart) => {
                assert_eq!(j, 0, "FinishStart outside the start job");
                Some(Event::StartFinished)
            }
            Action::Effect(Effect::Forget) => {
                self.task = None;
                self.jobs.clear();
                None
            }
            Action::Effect(Effect::AcquireGpus { count }) => {
                let free: Vec<String> = GPUS
                    .iter()
                    .map(|g| g.to_string())
                    .filter(|g| !self.world.gpus_locked.contains(g))
                    .collect();
                // A negative count asks for every free GPU.
                let want = usize::try_from(count).unwrap_or(free.len());
                if fail || want > free.len() {
                    Some(failed!(PrepareFailed, "{want} GPUs unavailable"))
                } else {
                    let ids: Vec<String> = free.into_iter().take(want).collect();
                    for g in &ids {
                        self.world.gpus_locked.insert(g.clone());
                        self.world.acquire(format!("gpu:{g}"));
                    }
                    Some(Event::GpusAcquired(ids))
                }
            }
            Action::Effect(Effect::AddHostKeys(grant)) => {
                if fail {
                    Some(failed!(PrepareFailed, "authorized_keys not writable"))
                } else {
                    assert!(!self.world.keys_present);
                    assert_eq!(task.record().resources.host_keys.as_ref(), Some(&grant));
                    self.world.keys_present = true;
                    self.world.acquire("keys".into());
                    Some(Event::HostKeysAdded(grant))
                }
            }
            Action::Effect(Effect::MountVolume(spec)) => {
                if fail {
                    Some(failed!(PrepareFailed, "volume {} not found", spec.name))
                } else {
                    // Like the engine: record ahead (the outcome below is stepped first and
                    // persisted), then mount.
                    let name = spec.name.to_string();
                    let volume = MountedVolume {
                        mount_point: format!("/mnt/disks/dstack-volumes/{name}"),
                        name,
                        device: String::new(),
                    };
                    self.jobs[j].push_front(Op::Mount(volume.clone()));
                    Some(Event::VolumeMounting(volume))
                }
            }
            Action::Effect(Effect::CreateDir(path)) => Some(if fail {
                failed!(PrepareFailed, "cannot create {path}")
            } else if b.is_multiple_of(2) {
                Event::DirCreated(path)
            } else {
                Event::DirExisted(path)
            }),
            Action::Effect(Effect::Pull { image }) => {
                assert_eq!(image, "shim-test:1");
                if b % 5 == 1 {
                    Some(Event::PullSkipped)
                } else {
                    self.jobs[j].push_front(Op::PullRunning { reports: 0 });
                    None
                }
            }
            Action::Effect(Effect::CancelPull) => {
                self.world.pull_cancelled = true;
                None
            }
            Action::Effect(Effect::CreateContainer) => {
                assert!(self.world.container.is_none());
                if fail {
                    Some(failed!(CreateFailed, "create failed"))
                } else {
                    self.world.containers_made += 1;
                    let id = format!("c{}", self.world.containers_made);
                    self.world.container = Some(Container {
                        id: id.clone(),
                        state: Ctr::Created,
                        gpu_ids: task.record().resources.gpus.clone(),
                        ports: Vec::new(),
                        volumes: task.record().resources.volumes.clone(),
                    });
                    Some(Event::ContainerCreated { container_id: id })
                }
            }
            Action::Effect(Effect::StartContainer) => match self.world.container.as_mut() {
                Some(c) if !fail && c.state == Ctr::Created => {
                    c.state = Ctr::Running;
                    if self.config.network_mode == NetworkMode::Bridge {
                        c.ports = vec![PortMapping {
                            host: 32768,
                            container: 10999,
                        }];
                    }
                    Some(Event::ContainerStarted {
                        ports: c.ports.clone(),
                    })
                }
                _ => Some(failed!(StartFailed, "start failed")),
            },
            Action::Effect(Effect::StopContainer { .. }) => {
                if fail {
                    Some(failed!(StopFailed, "daemon busy"))
                } else {
                    if let Some(c) = self.world.container.as_mut()
                        && c.state == Ctr::Running
                    {
                        c.state = Ctr::Exited(137);
                    }
                    Some(Event::ContainerStopped)
                }
            }
            Action::Effect(Effect::Release(res)) => {
                // Nothing is released while start is in flight, or for a task not terminated.
                assert!(!task.start_in_flight(), "release while start is in flight");
                // Nor while the container may still use the resources.
                let runs = self.world.container_runs();
                assert!(!runs, "release while the container runs");
                assert_eq!(task.record().status, TaskStatus::Terminated);
                assert!(!res.holds_any() || task.release_in_flight());
                let mut freed_gpus = Vec::new();
                let mut freed_volumes = Vec::new();
                let mut freed_keys = false;
                let mut any_failed = false;
                for (i, g) in res.gpus.iter().enumerate() {
                    if self.fail(b.wrapping_add(i as u8 * 3 + 1)) {
                        any_failed = true;
                        continue;
                    }
                    let held = self.world.gpus_locked.remove(g);
                    self.check_release_of(&format!("gpu:{g}"), held);
                    freed_gpus.push(g.clone());
                }
                if res.host_keys.is_some() {
                    if self.fail(b.wrapping_add(2)) {
                        any_failed = true;
                    } else {
                        let held = std::mem::take(&mut self.world.keys_present);
                        self.check_release_of("keys", held);
                        freed_keys = true;
                    }
                }
                for (i, v) in res.volumes.iter().enumerate() {
                    if self.fail(b.wrapping_add(i as u8 * 5 + 3)) {
                        any_failed = true;
                        continue;
                    }
                    let held = self.world.volumes_mounted.remove(&v.name);
                    self.check_release_of(&format!("vol:{}", v.name), held);
                    freed_volumes.push(v.name.clone());
                }
                let freed_any = !freed_gpus.is_empty() || freed_keys || !freed_volumes.is_empty();
                Some(if any_failed && !freed_any {
                    failed!(ReleaseFailed, "umount: target is busy")
                } else {
                    Event::Released {
                        unknown_keys: res.unknown_keys.is_some(),
                        gpus: freed_gpus,
                        host_keys: freed_keys,
                        volumes: freed_volumes,
                    }
                })
            }
            Action::Effect(Effect::RemoveContainer) => {
                if fail {
                    // Docker refused: the engine stops the remove and says what it dropped.
                    let message = "cannot remove the container: daemon busy";
                    Some(self.abandon(j, Action::Effect(Effect::RemoveContainer), message))
                } else {
                    self.world.container = None;
                    None
                }
            }
            Action::DeleteTaskDir => {
                if task.record().resources.holds_any() {
                    // The release before it left something held: the engine refuses to
                    // delete, drops the rest of the list and says so (the task stays).
                    let message = "task still holds resources after release";
                    Some(self.abandon(j, Action::DeleteTaskDir, message))
                } else {
                    self.world.persisted = None;
                    None
                }
            }
            Action::Effect(Effect::LockGpus(ids)) => {
                assert!(!task.record().resources.released);
                for g in &ids {
                    if self.world.gpus_locked.insert(g.clone()) {
                        self.world.acquire(format!("gpu:{g}"));
                    }
                }
                Some(Event::GpusRelocked(ids))
            }
        };
        if let Some(event) = outcome
            && !self.jobs.is_empty()
        {
            self.jobs[j].push_front(Op::Deliver(event));
        }
    }

    /// The engine stops carrying out job `j` at `failed`: the outcome that says so, naming the
    /// actions dropped.
    fn abandon(&mut self, j: usize, failed: Action, message: &str) -> Event {
        let mut actions = vec![failed];
        actions.extend(self.jobs[j].drain(..).filter_map(|op| match op {
            Op::Do(a) => Some(a),
            _ => None,
        }));
        let message = message.into();
        Event::ActionsAbandoned { actions, message }
    }

    /// Nothing is released that was never acquired, except after a crash: something released
    /// before the crash whose release was not yet recorded, or host keys or a volume recorded
    /// ahead of an add or mount the crash prevented (no-ops: release is idempotent).
    fn check_release_of(&mut self, key: &str, held: bool) {
        let acquired = self.world.acquired.get(key).copied().unwrap_or(0) > 0;
        if !self.world.free(key.to_owned(), held) {
            // GPU locks are taken again on restore before anything is released.
            assert!(!key.starts_with("gpu:"), "release of {key}, not locked");
            let ahead = key == "keys" || key.starts_with("vol:");
            let excused = self.crashed || (self.write_failed && ahead);
            assert!(excused, "release of {key}, not held, without a crash");
            let released_before = self.world.released.get(key).copied().unwrap_or(0) > 0;
            let excused = released_before || (ahead && !acquired);
            assert!(excused, "release of {key}, never acquired");
        }
    }

    /// A reconcile cycle. `all`: observe terminated tasks' containers in every state; else
    /// as the engine does: a terminated task's container only when it runs.
    fn reconcile(&mut self, all: bool) {
        let Some(t) = &self.task else { return };
        if t.start_in_flight() {
            return; // the engine skips tasks whose start is in flight
        }
        if t.is_dirty() {
            self.feed(Event::PersistRequested, None).unwrap();
        }
        let Some(t) = &self.task else { return };
        let obs = self.observation();
        if all || t.record().status != TaskStatus::Terminated || obs == Observation::Running {
            self.feed(Event::Observed(obs), None).unwrap();
        }
        if self.task.as_ref().is_some_and(Task::needs_release) {
            self.feed(Event::ReleaseRequested, None).unwrap();
        } else if self.task.as_ref().is_some_and(Task::stop_failed) {
            // The engine's retry pass looks at the container of a task whose stop failed.
            let obs = self.observation();
            self.feed(Event::Observed(obs), None).unwrap();
        }
    }

    fn run_all(&mut self) {
        for _ in 0..10_000 {
            if self.jobs.iter().all(|q| q.is_empty()) {
                self.jobs.retain(|q| !q.is_empty());
                return;
            }
            self.run_one(0, 1);
        }
        panic!("jobs do not finish: {:?}", self.jobs);
    }

    fn apply(&mut self, choice: (u8, u8, u8)) {
        let (kind, a, b) = choice;
        match kind % 32 {
            0..=15 => self.run_one(a, b),
            16 | 17 => {
                let reasons = [
                    TerminationReason::TerminatedByUser,
                    TerminationReason::TerminatedByServer,
                    TerminationReason::MaxDurationExceeded,
                    TerminationReason::Other("custom_reason".into()),
                    // The server's terminate of a dangling task carries no reason.
                    TerminationReason::Other(String::new()),
                ];
                let reason = reasons[a as usize % reasons.len()].clone();
                let event = terminate(reason, &format!("terminate {b}"), u64::from(b % 3) * 10);
                self.feed(event, None).unwrap();
            }
            18 => {
                if let Some(c) = self.world.container.as_mut()
                    && c.state == Ctr::Running
                {
                    c.state = Ctr::Exited(i64::from(a % 3));
                }
            }
            19 => {
                if a % 4 == 0 {
                    self.world.container = None;
                }
            }
            20..=23 => self.reconcile(a % 2 == 0),
            24 => {
                self.feed(Event::ReleaseRequested, None).unwrap();
            }
            25 | 26 => {
                if let Some(t) = self.task.clone() {
                    match self.feed(Event::RemoveRequested, None) {
                        Ok(()) => {}
                        Err(TransitionError::NotTerminated { .. }) => assert!(
                            t.record().status != TaskStatus::Terminated
                                || (t.saved().status != TaskStatus::Terminated
                                    && !t.write_failed())
                        ),
                        Err(TransitionError::StartInFlight { .. }) => assert!(t.start_in_flight()),
                        Err(TransitionError::ReleaseInFlight { .. }) => {
                            assert!(t.release_in_flight())
                        }
                        Err(TransitionError::RemoveInFlight { .. }) => {
                            assert!(t.remove_in_flight())
                        }
                        Err(e) => panic!("remove: {e}"),
                    }
                }
            }
            27 => self.crash(a % 8 == 0, b),
            29 if a % 2 == 0 => self.crash_at_next_write = true,
            28 => {
                // The disk fills up, or frees up again.
                if a % 3 == 0 {
                    self.disk_full = !self.disk_full;
                }
            }
            _ => self.run_one(a, b),
        }
    }

    /// No GPU is locked, no volume mounted, no key present; but for what a lost state file
    /// leaves: the keys of an adopted task, the volumes of a forgotten one.
    fn assert_nothing_held(&self) {
        assert!(self.world.gpus_locked.is_empty(), "{:?}", self.world);
        if !self.forgotten {
            assert!(self.world.volumes_mounted.is_empty(), "{:?}", self.world);
        }
        if !self.corrupted {
            assert!(!self.world.keys_present, "{:?}", self.world);
        }
    }

    /// A remove, accepted: it takes the task, its container and its state file.
    fn remove_and_check_gone(&mut self) {
        self.feed(Event::RemoveRequested, None).unwrap();
        self.run_all();
        assert!(self.task.is_none());
        assert!(self.world.container.is_none());
        assert!(self.world.persisted.is_none());
    }

    /// The faults stop: work in flight finishes, and a terminate and ONE reconcile cycle bring
    /// the task to its end (reason recorded, container stopped, everything released, nothing
    /// leaked); then a remove takes it.
    fn drain_and_check(&mut self) {
        self.failures = false;
        self.crash_at_next_write = false;
        // SPEC §4: whatever the disk does (it may still be full), a terminate and the next
        // cycle stop the container and release everything.
        self.run_all();
        if let Some(t) = self.task.clone() {
            assert!(!t.start_in_flight(), "start did not return");
            let stop = terminate(TerminationReason::TerminatedByServer, "stop", 0);
            self.feed(stop, None).unwrap();
            self.run_all();
            self.reconcile(false);
            self.run_all();
            let disk_full = self.disk_full;
            if let Some(t) = &self.task {
                assert_eq!(t.record().status, TaskStatus::Terminated);
                let held = t.record().resources.holds_any();
                assert!(!held, "not released (disk full: {disk_full}): {t:?}");
                let runs = self.world.container_runs();
                assert!(!runs, "container still runs (disk full: {disk_full})");
            }
            self.assert_nothing_held();
        }
        self.disk_full = false;
        self.run_all();
        if let Some(t) = self.task.clone() {
            assert!(!t.start_in_flight(), "start did not return");
            if t.saved().status != TaskStatus::Terminated {
                let drain = terminate(TerminationReason::TerminatedByServer, "drain", 0);
                self.feed(drain, None).unwrap();
                self.run_all();
                let saved = self.task.as_ref().unwrap().saved().status;
                assert_eq!(saved, TaskStatus::Terminated, "terminate not durable");
            }
        }
        self.reconcile(false);
        self.run_all();
        if let Some(t) = &self.task {
            assert_eq!(t.record().status, TaskStatus::Terminated);
            assert_eq!(t.saved().status, TaskStatus::Terminated);
            assert!(!t.is_dirty(), "not written within one cycle");
            assert!(!t.start_in_flight());
            let held = t.record().resources.holds_any();
            assert!(!held, "not released within one cycle: {t:?}");
            assert!(t.record().resources.released);
            assert!(!t.needs_release());
            assert!(!self.world.container_runs(), "container still runs");
            // What the API shows of a terminated task.
            let reason = t.record().termination_reason.as_ref().unwrap();
            assert_eq!(t.info().termination_reason, reason.as_str());
        }
        // Every resource acquired was released exactly once per acquisition; nothing is held.
        self.assert_nothing_held();
        for (key, n) in &self.world.acquired {
            if self.corrupted && key == "keys" {
                continue; // SPEC §5: an adopted container's keys cannot be recovered
            }
            if self.forgotten && key.starts_with("vol:") {
                continue; // nothing names the forgotten task's volumes
            }
            let released = self.world.released.get(key);
            assert_eq!(released, Some(n), "{key}: acquired {n} times");
        }
        for key in self.world.released.keys() {
            assert!(self.world.acquired.contains_key(key));
        }
        // Remove is possible now and removes everything.
        if self.task.is_some() {
            self.remove_and_check_gone();
        }
    }
}

/// 10,000 cases, or more where `PROPTEST_CASES` asks (proptest's default reads it).
fn deep_cases() -> u32 {
    ProptestConfig::default().cases.max(10_000)
}

fn config_strategy() -> impl Strategy<Value = TaskConfig> {
    (-1i64..=2, any::<bool>(), 0u8..=2, 0u8..=2, any::<bool>()).prop_map(
        |(gpu, keys, volumes, dirs, bridge)| config_from(gpu, keys, volumes, dirs, bridge),
    )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: deep_cases(),
        max_shrink_iters: 10_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Random event sequences with random failures and crashes keep every rule `Sim` checks;
    /// after draining, every acquired resource was released exactly once.
    #[test]
    fn random_sequences_keep_the_invariants(
        config in config_strategy(),
        choices in prop::collection::vec(any::<(u8, u8, u8)>(), 0..80),
    ) {
        let mut sim = Sim::new(config);
        for c in choices {
            sim.apply(c);
        }
        sim.drain_and_check();
    }
}

/// Found by the property test: a reconciler release that overtook restore's `LockGpus` freed
/// nothing, then the relock leaked every GPU. The engine carries out restore's actions first.
#[test]
fn restore_relocks_before_the_reconciler_releases() {
    Sim::replay(
        config_from(-1, false, 0, 0, false),
        "92 0 0, 60 0 17, 0 0 0, 92 0 6, 60 0 0, 28 0 29, 219 0 0, 52 0 0, 60 29 0",
    );
}

/// Keeps the simulator honest: without failures it reaches `running`, and every kind of
/// resource is acquired and released.
#[test]
fn simulator_happy_path_runs_and_releases() {
    let mut sim = Sim::faultless_run(config_from(2, true, 2, 1, true));
    let t = sim.the_task();
    assert_eq!(t.record().status, TaskStatus::Running);
    assert!(!t.start_in_flight());
    let held = &t.record().resources;
    assert_eq!(held.gpus.len(), 2);
    assert!(held.host_keys.is_some());
    assert_eq!(held.volumes.len(), 2);
    assert_eq!(t.info().ports.unwrap().len(), 1);
    assert_eq!(sim.world.acquired.len(), 5);
    sim.world.container.as_mut().unwrap().state = Ctr::Exited(0);
    sim.reconcile(false);
    sim.run_all();
    let record = sim.the_task().record();
    let done = Some(TerminationReason::DoneByRunner);
    assert_eq!(record.termination_reason, done);
    assert!(record.resources.released);
    assert_eq!(sim.world.released, sim.world.acquired);
    sim.drain_and_check();
}

/// A crash in every status restores a task that drains cleanly.
#[test]
fn crash_at_every_point_of_a_clean_start() {
    for crash_after in 0..40 {
        let mut sim = Sim::faultless(config_from(1, true, 1, 1, false));
        for _ in 0..crash_after {
            sim.run_one(0, 1);
        }
        sim.crash(false, 1);
        sim.drain_and_check();
    }
}

/// A crash between recording a volume ahead and mounting it, or right after mounting it,
/// leaks nothing: the record names the volume, and releasing what is not mounted is a no-op.
#[test]
fn crash_around_a_mount_leaks_nothing() {
    for extra in 0..3 {
        let mut sim = Sim::faultless(config_from(0, false, 1, 0, false));
        sim.run_start_until(|op| matches!(op, Op::Mount(_)));
        for _ in 0..extra {
            sim.run_one(0, 1);
        }
        sim.crash(false, 1);
        sim.drain_and_check();
    }
}

/// Any event, including ones no correct engine would send at that point, decoded from bytes
/// (cheaper to generate than a union of strategies).
fn any_event((kind, a, b): (u8, u8, u8)) -> Event {
    let gpus: Vec<String> = GPUS
        .iter()
        .take(usize::from(a % 3))
        .map(|g| g.to_string())
        .collect();
    let progress = progress(u64::from(b), 0, u64::from(b) * 2, a % 2 == 0);
    let message = format!("m{b}");
    match kind % 34 {
        0 => Event::StartBegan,
        1 => Event::GpusAcquired(gpus),
        2 => Event::HostKeysAdded(shim_task::HostKeysGrant {
            user: "ubuntu".into(),
            keys: vec![PublicKey::parse(KEY).unwrap()],
            upstream: false,
        }),
        3 => Event::VolumeMounted(MountedVolume {
            name: format!("vol{}", a % 2),
            mount_point: "/mnt/disks/dstack-volumes/vol0".into(),
            device: String::new(),
        }),
        4 => Event::DirCreated("/mnt/data0".into()),
        5 => Event::DirExisted("/mnt/data0".into()),
        6 => Event::PrepareFailed { message },
        7 => Event::PullSkipped,
        8 => Event::PullProgressed(progress),
        9 => Event::PullDone(progress),
        10 => Event::PullFailed { message },
        11 => Event::ContainerCreated {
            container_id: "c".into(),
        },
        12 => Event::CreateFailed { message },
        13 => Event::ContainerStarted { ports: vec![] },
        14 => Event::StartFailed { message },
        15 => Event::StartAborted { message },
        16 => Event::StartFinished,
        17 => Event::TerminateRequested {
            reason: [
                TerminationReason::TerminatedByUser,
                TerminationReason::TerminatedByServer,
                TerminationReason::LogQuotaExceeded,
                TerminationReason::Other("x".into()),
            ][usize::from(a % 4)]
            .clone(),
            message,
            timeout_s: u64::from(b),
        },
        18 => Event::ContainerStopped,
        19 => Event::StopFailed { message },
        20 => Event::RemoveRequested,
        21 => Event::Observed(match a % 4 {
            0 => Observation::Running,
            1 => Observation::NeverStarted,
            2 => Observation::Missing,
            _ => Observation::Exited {
                oom_killed: false,
                code: i64::from(b % 3),
                last_lines: (0..b % 8).map(|i| format!("l{i}")).collect(),
            },
        }),
        22 => Event::ReleaseRequested,
        23 | 24 => Event::Released {
            unknown_keys: false,
            gpus,
            host_keys: b % 2 == 0,
            volumes: if b % 3 == 0 {
                vec!["vol0".into()]
            } else {
                vec![]
            },
        },
        25 => Event::ReleaseFailed { message },
        26 => Event::GpusRelocked(gpus),
        27 => Event::Persisted,
        28 => Event::PersistFailed { message },
        29 => Event::PersistRequested,
        30 => Event::ContainerRecreated {
            container_id: format!("c{b}"),
        },
        31 => Event::ActionsAbandoned {
            actions: match a % 4 {
                0 => vec![Action::Effect(Effect::StopContainer { timeout_s: 0 })],
                1 => vec![Action::Effect(Effect::Release(
                    shim_task::Resources::default(),
                ))],
                2 => vec![Action::Effect(Effect::StartContainer)],
                _ => vec![
                    Action::Effect(Effect::RemoveContainer),
                    Action::DeleteTaskDir,
                    Action::Effect(Effect::Forget),
                ],
            },
            message,
        },
        32 => Event::StartRefused { message },
        _ => Event::Observed(Observation::Running),
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: deep_cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Arbitrary events in arbitrary order (an engine with bugs): `step` never panics, and
    /// whatever it accepts keeps the rules of `check_step` and those below.
    #[test]
    fn arbitrary_events_never_break_the_rules(
        config in config_strategy(),
        events in prop::collection::vec(any::<(u8, u8, u8)>(), 0..40),
    ) {
        let name = container_name(&config.name, &config.id);
        let mut task = Task::new(TaskRecord::new(&config, name, 1));
        let mut now = 1;
        for event in events.into_iter().map(any_event) {
            now += 1;
            let is_remove = matches!(event, Event::RemoveRequested);
            // A write's failure may change the record (a start given up) but never asks for
            // another write at once.
            let is_write_failure = matches!(event, Event::PersistFailed { .. });
            let Ok(tr) = step(&task, event.clone(), now) else { continue };
            check_step(&task, &tr, &event);
            let (b, a) = (task.record(), tr.task.record());
            if !same_record(b, a) && tr.task.is_progress_only() {
                // Start progress needs no write of its own.
                prop_assert!(only_progress(b, a, tr.task.container_runs()), "{:?} -> {:?}", b, a);
                prop_assert!(!tr.actions.contains(&Action::Persist));
            } else if !same_record(b, a) && !is_write_failure {
                prop_assert!(tr.actions.first() == Some(&Action::Persist));
            }
            if tr.actions.iter().any(Action::needs_durable_record) && !is_remove {
                // Durable, or only start progress unwritten, or what ends a terminated task
                // after its write failed.
                let ending = tr.task.write_failed()
                    && a.status == TaskStatus::Terminated
                    && tr.actions.iter().filter(|x| x.needs_durable_record()).all(ends_task);
                let allowed = !tr.task.is_dirty() || tr.task.is_progress_only() || ending;
                prop_assert!(allowed, "{:?}", tr.actions);
            }
            // The durable view changes only with a write's success.
            if tr.task.saved() != task.saved() {
                prop_assert!(!tr.task.is_dirty());
                prop_assert_eq!(tr.task.saved(), &Saved::of(a));
            }
            // What is shown changes with a write's success, or is the end of a task whose
            // container no longer runs (SPEC §4), or `running` while its container runs, even
            // over an unwritten termination (SPEC §5); a shown end is never taken back.
            let (shown_before, shown_after) = (task.shown(), tr.task.shown());
            let running_ahead = tr.task.container_runs()
                && shown_after.status == TaskStatus::Running
                && tr.task.saved().status < TaskStatus::Running
                && {
                    let mut saved = tr.task.saved().clone();
                    saved.status = TaskStatus::Running;
                    shown_after == saved
                };
            if shown_after != shown_before && !running_ahead {
                prop_assert_eq!(&shown_after, &Saved::of(a));
                let ended = a.status == TaskStatus::Terminated && tr.task.container_ended();
                prop_assert!(!tr.task.is_dirty() || ended);
            }
            if shown_before.status == TaskStatus::Terminated {
                prop_assert_eq!(shown_after.status, TaskStatus::Terminated);
                prop_assert_eq!(
                    &shown_after.termination_reason,
                    &shown_before.termination_reason
                );
            }
            if is_remove {
                prop_assert!(task.status() == TaskStatus::Terminated || task.write_failed());
                prop_assert!(tr.actions.last() == Some(&Action::Effect(Effect::Forget)));
                break;
            }
            for action in &tr.actions {
                if matches!(action, Action::Effect(Effect::Release(_))) {
                    prop_assert!(!tr.task.start_in_flight());
                    prop_assert_eq!(a.status, TaskStatus::Terminated);
                }
            }
            task = tr.task;
        }
    }
}

/// Found by the property test (CI): a task adopted after its state file was lost, whose record
/// a full disk refused and whose container was removed while the shim was down, is forgotten
/// at the next restart; its volume stays mounted, the one leak accepted (after this triple fault).
#[test]
fn an_adopted_task_never_written_is_forgotten_when_its_container_goes() {
    let mut sim = Sim::faultless_run(config_from(1, false, 1, 0, false));
    sim.disk_full = true;
    sim.crash(true, 0);
    assert!(sim.task.is_some(), "adopted from its container");
    assert!(sim.world.persisted.is_none(), "the disk is full");
    sim.world.container = None;
    sim.crash(false, 0);
    assert!(sim.task.is_none() && sim.forgotten);
    assert!(sim.world.gpus_locked.is_empty());
    assert_eq!(sim.world.volumes_mounted.len(), 1);
    sim.drain_and_check();
}

/// SPEC §4 (issue 22): a task on a full disk is still stoppable. A terminate whose write fails
/// stops the container and releases everything at once, and a remove is accepted. With a
/// crash before the write instead, the restart restores the durable `running`, the reconciler
/// ends it with the container's exit, and the second release frees only the GPUs locked again.
#[test]
fn a_terminate_on_a_full_disk_stops_and_releases_without_its_write() {
    for crash_before_the_write in [false, true] {
        let mut sim = Sim::faultless_run(config_from(2, true, 2, 0, true));
        let t = sim.the_task();
        assert_eq!(t.status(), TaskStatus::Running);
        let unwritten = t.saved().status < TaskStatus::Running;
        assert!(unwritten, "running is not written");
        sim.disk_full = true;
        let full = terminate(TerminationReason::TerminatedByUser, "full", 0);
        sim.feed(full, None).unwrap();
        sim.run_all();
        let t = sim.the_task();
        let unwritten = t.saved().status < TaskStatus::Terminated;
        assert!(unwritten, "the termination is not durable");
        assert!(t.is_dirty() && t.write_failed());
        assert!(!t.record().resources.holds_any(), "{t:?}");
        assert_eq!(sim.world.container_state(), Some(&Ctr::Exited(137)));
        // No crash yet: nothing is held, the keys and volumes included.
        sim.assert_nothing_held();
        if crash_before_the_write {
            sim.crash(false, 0);
            let t = sim.the_task();
            assert_eq!(t.record().status, TaskStatus::Running, "the durable record");
            assert_eq!(sim.world.gpus_locked.len(), 2, "locked again at restore");
            sim.reconcile(false);
            sim.run_all();
            let record = sim.the_task().record();
            let exit = Some(TerminationReason::ContainerExitedWithError);
            let why = "at worst the reason reads as the container's exit";
            assert_eq!(record.termination_reason, exit, "{why}");
            assert!(!record.resources.holds_any());
            assert!(sim.world.gpus_locked.is_empty());
        } else {
            sim.remove_and_check_gone();
        }
        sim.drain_and_check();
    }
}

/// A volume recorded ahead in memory while the disk is full is never mounted; the start is
/// given up and what it holds released when it returns, without waiting for the disk. A crash
/// then restores from the disk, which never named the volume: nothing is lost or leaked.
#[test]
fn a_volume_recorded_ahead_on_a_full_disk_is_given_up_and_released_at_once() {
    let mut sim = Sim::faultless(config_from(1, false, 1, 0, false));
    sim.run_start_until(|op| matches!(op, Op::Do(Action::Effect(Effect::MountVolume(_)))));
    sim.disk_full = true;
    sim.run_all();
    let t = sim.the_task();
    assert!(t.write_failed() && !t.start_in_flight());
    assert_eq!(t.record().status, TaskStatus::Terminated);
    assert!(!t.record().resources.holds_any(), "{t:?}");
    assert!(sim.world.volumes_mounted.is_empty() && sim.world.gpus_locked.is_empty());
    sim.crash(true, 0);
    sim.drain_and_check();
}

/// Found by the property test after `needs_retry`: a remove accepted while the last stop had
/// failed must not let the retry pass send that stop again while the task's directory is being
/// deleted (the force-removal makes the stop moot).
#[test]
fn a_remove_after_a_failed_stop_sends_no_stop() {
    Sim::replay(
        config_from(0, false, 0, 0, false),
        "0 0 0, 0 0 1, 29 0 0, 29 0 16, 29 0 0, 29 0 5, 27 1 0, 16 0 0, 0 0 88, 219 1 3, 121 0 0, \
         0 0 1, 29 0 0, 148 31 0",
    );
}

/// Found by the property test: a remove whose container removal failed (after a stop that
/// failed, which remove had made moot) left the task believing nothing ran, and the next
/// terminate released the task's GPU while its container still ran.
#[test]
fn a_failed_removal_makes_the_container_stop_before_any_release() {
    Sim::replay(
        config_from(1, false, 0, 1, false),
        "29 0 0, 29 0 1, 61 0 0, 0 0 5, 0 0 0, 0 0 66, 18 0 0, 0 0 0, 18 0 0, 29 0 1, 61 0 0, \
         125 0 1, 59 0 0, 0 0 0, 0 0 0, 240 0 0, 0 0 212, 125 0 0, 25 0 0, 88 0 0, 61 0 104, \
         0 0 0, 0 0 0",
    );
}

/// SPEC §5 (issue 37): `running` is shown once the container runs and never written on its
/// own. A crash right after it was shown, or once the start settled, restores `running` from
/// the container, and it drains cleanly; so does a crash after the container exited unseen.
#[test]
fn a_crash_after_running_was_shown_restores_running() {
    for (settled, exited_unseen) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut sim = Sim::faultless(config_from(1, false, 0, 0, true));
        sim.run_start_until(|op| matches!(op, Op::Deliver(Event::ContainerStarted { .. })));
        let durable = sim.world.persisted.clone().unwrap();
        assert!(durable.status < TaskStatus::Running, "{durable:?}");
        sim.run_one(0, 1);
        if settled {
            sim.run_all();
        }
        let t = sim.the_task();
        assert_eq!(t.status(), TaskStatus::Running);
        assert!(t.is_progress_only() && !t.needs_write(), "{t:?}");
        let written = sim.world.persisted.as_ref();
        assert_eq!(written, Some(&durable), "no write of its own");
        if exited_unseen {
            sim.world.container.as_mut().unwrap().state = Ctr::Exited(0);
        }
        sim.crash(false, 0);
        let t = sim.the_task();
        assert_eq!(t.record().status, TaskStatus::Running, "{t:?}");
        assert_eq!(t.status(), TaskStatus::Running);
        assert_eq!(t.container_ended(), exited_unseen);
        sim.drain_and_check();
    }
}
