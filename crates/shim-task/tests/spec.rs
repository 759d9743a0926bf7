//! One test per row of SPEC §2's "how a task ends" table, the terminate and remove rules of
//! §4, the TaskInfo rules of §3 and the restore table of §5, against `step` and `restore`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use shim_task::TerminationReason::{
    ContainerExitedWithError, CreatingContainerError, DoneByRunner, ExecutorError,
    MaxDurationExceeded, TerminatedByServer, TerminatedByUser,
};
use shim_task::machine::TransitionError::{
    NotTerminated, ReleaseInFlight, StartInFlight, Unexpected,
};
use shim_task::machine::{Action, Effect, Event, Observation, StartStep, StopState, Task, step};
use shim_task::machine::{EXIT_MESSAGE_LINES, EXIT_MESSAGE_MAX_BYTES, NEVER_STARTED_MESSAGE};
use shim_task::naming::container_name;
use shim_task::{
    HostKeysGrant, InstanceMountPoint, MountedVolume, NetworkMode, ObservedContainer,
    ObservedState, PortMapping, PublicKey, PullProgress, Resources, TaskConfig, TaskId, TaskName,
    TaskRecord, TaskStatus, TerminationReason, VolumeBackend, VolumeSpec, restore,
};

/// The one instance mount of `config()`.
const CACHE: &str = "/mnt/cache";
const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe k";

/// A config that acquires nothing (no GPU, key, volume or directory).
fn bare_config(image: &str) -> TaskConfig {
    let (id, name) = (TaskId::new("t1").unwrap(), TaskName::new("job").unwrap());
    TaskConfig::new(id, name, image)
}

/// One GPU, host keys, a volume and an instance mount.
fn config() -> TaskConfig {
    let mut c = bare_config("img:1");
    c.gpu = 1;
    c.host_ssh_user = "ubuntu".into();
    c.host_ssh_keys = vec![PublicKey::parse(KEY).unwrap().into()];
    c.volumes = vec![VolumeSpec {
        backend: VolumeBackend::Aws,
        name: TaskName::new("data").unwrap(),
        volume_id: "vol-1".into(),
        init_fs: true,
        device_name: String::new(),
    }];
    c.instance_mounts = vec![InstanceMountPoint {
        instance_path: CACHE.into(),
        path: "/cache".into(),
    }];
    c
}

fn new_task(c: &TaskConfig) -> Task {
    Task::new(TaskRecord::new(c, container_name(&c.name, &c.id), 100))
}

fn grant() -> HostKeysGrant {
    HostKeysGrant {
        user: "ubuntu".into(),
        keys: vec![PublicKey::parse(KEY).unwrap()],
        upstream: false,
    }
}

fn volume() -> MountedVolume {
    MountedVolume {
        name: "data".into(),
        mount_point: "/mnt/disks/dstack-volumes/data".into(),
        device: "/dev/loop3".into(),
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

/// The one GPU a task of `config()` gets.
fn gpu_a() -> Vec<String> {
    strings(&["GPU-a"])
}

// ---- Actions, events and observations, one line each ----

const PERSIST: Action = Action::Persist;
const FINISH: Action = Action::Effect(Effect::FinishStart);
const CREATE: Action = Action::Effect(Effect::CreateContainer);
const START: Action = Action::Effect(Effect::StartContainer);
const CANCEL_PULL: Action = Action::Effect(Effect::CancelPull);

fn fx(effect: Effect) -> Action {
    Action::Effect(effect)
}

fn stop(timeout_s: u64) -> Action {
    fx(Effect::StopContainer { timeout_s })
}

fn pull(image: &str) -> Action {
    let image = image.into();
    fx(Effect::Pull { image })
}

fn lock_gpu_a() -> Action {
    fx(Effect::LockGpus(gpu_a()))
}

/// What a remove carries out, with the release (if any) of what the task still holds.
fn removal(release: Option<Action>) -> Vec<Action> {
    let mut actions = vec![fx(Effect::RemoveContainer)];
    actions.extend(release);
    actions.extend([Action::DeleteTaskDir, fx(Effect::Forget)]);
    actions
}

fn terminate(reason: TerminationReason, message: &str, timeout_s: u64) -> Event {
    Event::TerminateRequested {
        reason,
        message: message.into(),
        timeout_s,
    }
}

/// The container exited with `code`, its log ending in `lines` (not OOM-killed).
fn exited(code: i64, lines: &[&str]) -> Observation {
    Observation::Exited {
        code,
        last_lines: strings(lines),
        oom_killed: false,
    }
}

fn seen(observation: Observation) -> Event {
    Event::Observed(observation)
}

fn created(id: &str) -> Event {
    let container_id = id.into();
    Event::ContainerCreated { container_id }
}

fn recreated(id: &str) -> Event {
    let container_id = id.into();
    Event::ContainerRecreated { container_id }
}

fn started() -> Event {
    Event::ContainerStarted { ports: vec![] }
}

/// What a release freed.
fn released(gpus: &[&str], host_keys: bool, volumes: &[&str]) -> Event {
    Event::Released {
        gpus: strings(gpus),
        host_keys,
        volumes: strings(volumes),
        unknown_keys: false,
    }
}

/// `fn name(message) -> Event`: an action's failure, `Event::Variant { message }`.
macro_rules! failure_events {
    ($($name:ident: $variant:ident,)*) => {
        $(
            fn $name(message: &str) -> Event {
                Event::$variant { message: message.into() }
            }
        )*
    };
}

failure_events! {
    prepare_failed: PrepareFailed,
    pull_failed: PullFailed,
    create_failed: CreateFailed,
    start_refused: StartRefused,
    start_failed: StartFailed,
    start_aborted: StartAborted,
    stop_failed: StopFailed,
    release_failed: ReleaseFailed,
}

/// The outcome of a write on a full disk.
fn disk_full() -> Event {
    let message = "No space left on device (os error 28)".into();
    Event::PersistFailed { message }
}

// ---- Driving a task ----

/// Driving a task through `step`, as the engine does.
trait Drive {
    /// Steps `event` and returns the actions. A leading `Persist` is carried out as the engine
    /// does (under the same lock): its outcome `write` (`Persisted`, or `PersistFailed`) is
    /// stepped at once, and what that step returns follows the `Persist` in the returned list.
    fn go_writing(&mut self, event: Event, write: Event) -> Vec<Action>;

    /// Steps `event`, its write (if any) succeeding.
    fn go(&mut self, event: Event) -> Vec<Action> {
        self.go_writing(event, Event::Persisted)
    }

    /// Steps `event` with the write failing (a full disk).
    fn go_disk_full(&mut self, event: Event) -> Vec<Action> {
        self.go_writing(event, disk_full())
    }

    /// Steps each event in turn (their writes succeeding): a history a test only sets up.
    fn go_all(&mut self, events: impl IntoIterator<Item = Event>) {
        for event in events {
            self.go(event);
        }
    }
}

impl Drive for Task {
    fn go_writing(&mut self, event: Event, write: Event) -> Vec<Action> {
        let tr = step(self, event, 200).unwrap();
        *self = tr.task;
        let mut actions = tr.actions;
        if actions.first() == Some(&Action::Persist) {
            let written = write == Event::Persisted;
            let tr = step(self, write, 200).unwrap();
            *self = tr.task;
            assert_eq!(self.is_dirty(), !written);
            if written {
                // Durable now: the API shows the record.
                assert_eq!(self.info().status, self.record().status);
            }
            actions.extend(tr.actions);
        }
        actions
    }
}

/// A task whose start has reached the awaited step `until` (all outcomes successful).
fn started_until(until: StartStep) -> Task {
    let mut t = new_task(&config());
    t.go(Event::StartBegan);
    let outcomes = [
        (StartStep::AcquireGpus, Event::GpusAcquired(gpu_a())),
        (StartStep::AddHostKeys, Event::HostKeysAdded(grant())),
        (StartStep::MountVolume(0), Event::VolumeMounted(volume())),
        (StartStep::CreateDir(0), Event::DirCreated(CACHE.into())),
        (StartStep::Pull, Event::PullDone(PullProgress::default())),
        (StartStep::CreateContainer, created("cid")),
        (StartStep::StartContainer, started()),
    ];
    for (s, event) in outcomes {
        if t.start_step() == Some(until) {
            break;
        }
        assert_eq!(t.start_step(), Some(s));
        t.go(event);
    }
    assert_eq!(t.start_step(), Some(until));
    t
}

fn running() -> Task {
    let mut t = started_until(StartStep::Finish);
    t.go(Event::StartFinished);
    assert_eq!(t.status(), TaskStatus::Running);
    t
}

/// The task is terminated with `reason` and `message`, in its record and in the API's view;
/// `label` names the case in a failure.
#[track_caller]
fn assert_ended_as(label: &str, t: &Task, reason: TerminationReason, message: &str) {
    let (record, info) = (t.record(), t.info());
    assert_eq!(t.status(), TaskStatus::Terminated, "{label}");
    assert_eq!(record.termination_reason, Some(reason.clone()), "{label}");
    assert_eq!(record.termination_message, message, "{label}");
    assert_eq!(info.termination_reason, reason.as_str(), "{label}");
    assert_eq!(info.termination_message, message, "{label}");
}

#[track_caller]
fn assert_ended(t: &Task, reason: TerminationReason, message: &str) {
    assert_ended_as("", t, reason, message);
}

/// A release of `gpus`, the keys of `grant()` if `keys`, and `volume()` if `volume`.
fn release(gpus: &[&str], keys: bool, volume: bool) -> Action {
    fx(Effect::Release(Resources {
        gpus: strings(gpus),
        host_keys: keys.then(grant),
        volumes: if volume { vec![self::volume()] } else { vec![] },
        ..Resources::default()
    }))
}

/// The release of everything a task of `config()` holds once started (its created dir stays).
fn release_all() -> Action {
    release(&["GPU-a"], true, true)
}

fn release_of(t: &Task) -> Action {
    fx(Effect::Release(t.held()))
}

#[test]
fn start_emits_each_step_with_persist_before_what_needs_it() {
    let c = config();
    let mut t = new_task(&c);
    assert!(t.start_in_flight());
    // `preparing` alone is start progress: no write of its own, the API still shows the
    // durable `pending`, and the first step goes out at once.
    let a = t.go(Event::StartBegan);
    assert_eq!(a, [fx(Effect::AcquireGpus { count: 1 })]);
    assert_eq!(t.record().status, TaskStatus::Preparing);
    assert_eq!(t.status(), TaskStatus::Pending);
    assert!(t.is_dirty() && t.is_progress_only());
    // GPU ids are recorded: written (with the progress) before the next step.
    let a = t.go(Event::GpusAcquired(gpu_a()));
    assert_eq!(a, [PERSIST, fx(Effect::AddHostKeys(grant()))]);
    assert_eq!(t.status(), TaskStatus::Preparing);
    assert_eq!(t.record().resources.gpus, ["GPU-a"]);
    // The keys are recorded (and persisted) ahead of the add.
    assert_eq!(t.record().resources.host_keys, Some(grant()));
    let a = t.go(Event::HostKeysAdded(grant()));
    assert_eq!(a, [fx(Effect::MountVolume(c.volumes[0].clone()))]);
    let a = t.go(Event::VolumeMounted(volume()));
    assert_eq!(a, [PERSIST, fx(Effect::CreateDir(CACHE.into()))]);
    assert_eq!(t.record().resources.volumes, [volume()]);
    let a = t.go(Event::DirCreated(CACHE.into()));
    assert_eq!(a, [PERSIST, pull("img:1")]);
    assert_eq!(t.status(), TaskStatus::Pulling);
    assert_eq!(t.record().resources.created_dirs, [CACHE]);
    let p = PullProgress {
        downloaded_bytes: 5,
        extracted_bytes: 0,
        total_bytes: 10,
        is_total_bytes_final: false,
    };
    assert_eq!(t.go(Event::PullProgressed(p)), vec![]);
    assert_eq!(t.info().image_pull_progress, Some(p));
    // `creating` is progress again: create goes out at once.
    assert_eq!(t.go(Event::PullDone(p)), [CREATE]);
    assert_eq!(t.record().status, TaskStatus::Creating);
    assert_eq!(t.status(), TaskStatus::Pulling);
    // The first container id is progress too (a restore finds the container by its labels):
    // the start goes out at once, and the next write carries the id along.
    assert_eq!(t.go(created("cid")), [START]);
    assert_eq!(t.status(), TaskStatus::Pulling);
    assert!(t.is_dirty() && t.is_progress_only());
    assert_eq!(t.info().container_id, "cid");
    let ports = vec![PortMapping {
        host: 40000,
        container: 10999,
    }];
    let shown_ports = Some(ports.clone());
    let a = t.go(Event::ContainerStarted { ports });
    // `running`, once the container runs, is progress as well (the container proves it
    // after a restart): shown at once, and written with the next change.
    assert_eq!(a, [FINISH]);
    assert_eq!(t.status(), TaskStatus::Running);
    assert_eq!(t.saved().status, TaskStatus::Pulling);
    assert_eq!(t.info().ports, shown_ports);
    assert!(t.start_in_flight());
    assert_eq!(t.go(Event::StartFinished), vec![]);
    assert!(!t.start_in_flight() && !t.needs_release());
    assert!(t.is_progress_only() && !t.needs_write());
}

/// A task that acquires nothing (no GPU, key, volume or directory) on a present image, its
/// container `cid` just created: every step is start progress, so nothing has been written
/// since `pending`, and each next start step went out at once.
fn minimal_created(cid: &str) -> Task {
    let mut t = new_task(&bare_config("ubuntu"));
    let a = t.go(Event::StartBegan);
    assert_eq!(a, [fx(Effect::AcquireGpus { count: 0 })]);
    // Nothing recorded changed (no GPUs), only the status moved to pulling: start progress,
    // which needs no write of its own.
    let a = t.go(Event::GpusAcquired(vec![]));
    assert_eq!(a, [pull("ubuntu")]);
    assert_eq!(t.info().gpu_ids, Some(vec![]));
    assert_eq!(t.go(Event::PullSkipped), [CREATE]);
    assert_eq!(t.info().image_pull_progress, None);
    // Three statuses on, the state file still holds `pending`, and the API shows it.
    assert_eq!(t.record().status, TaskStatus::Creating);
    assert_eq!(t.status(), TaskStatus::Pending);
    // The container id is progress as well: the start goes out without a write.
    assert_eq!(t.go(created(cid)), [START]);
    assert_eq!(t.status(), TaskStatus::Pending);
    assert!(t.is_dirty() && t.is_progress_only());
    t
}

#[test]
fn minimal_config_skips_keys_volumes_dirs_and_a_present_image() {
    let mut t = minimal_created("cid");
    // `running` is progress too: a start that acquires nothing writes only at submit.
    assert_eq!(t.go(started()), [FINISH]);
    assert_eq!(t.status(), TaskStatus::Running);
    assert_eq!(t.saved().status, TaskStatus::Pending);
    assert!(t.is_dirty() && t.is_progress_only());
    assert_eq!(t.record().container_id.as_deref(), Some("cid"));
}

/// A replacement container (the NVIDIA display retry, recorded through an event) is not the
/// first id: it is written at once, while the start is still out.
#[test]
fn a_replaced_container_id_is_written_at_once() {
    let display_retry = started_until(StartStep::StartContainer);
    for (label, mut t) in [("minimal", minimal_created("cid")), ("full", display_retry)] {
        assert_eq!(t.go(recreated("cid2")), [PERSIST], "{label}");
        assert!(!t.is_dirty() && !t.is_progress_only(), "{label}");
        assert_eq!(t.status(), TaskStatus::Creating, "{label}");
        assert_eq!(t.record().container_id.as_deref(), Some("cid2"), "{label}");
        let awaited = Some(StartStep::StartContainer);
        assert_eq!(t.start_step(), awaited, "{label}: still awaited");
    }
}

/// Pull progress that lands while a terminate's write is out (the engine applies progress
/// outside the step lock) takes no action, after an earlier failed write too: the cancel goes
/// out with the write's outcome, either way. (Handed to progress, it was dropped.)
#[test]
fn pull_progress_during_a_terminates_write_leaves_the_cancel_to_its_outcome() {
    for write in [Event::Persisted, disk_full()] {
        let mut t = new_task(&bare_config("ubuntu:22.04"));
        t.go_all([Event::StartBegan, Event::GpusAcquired(vec![])]);
        assert_eq!(t.go_disk_full(Event::PersistRequested), [PERSIST]);
        assert!(t.write_failed());
        let tr = step(&t, terminate(TerminatedByUser, "", 0), 300).unwrap();
        assert_eq!(tr.actions, [PERSIST]);
        let progress = Event::PullProgressed(PullProgress::default());
        let tr = step(&tr.task, progress, 300).unwrap();
        assert_eq!(tr.actions, vec![], "{write:?}");
        let tr = step(&tr.task, write.clone(), 300).unwrap();
        assert_eq!(tr.actions, [CANCEL_PULL], "{write:?}");
    }
}

/// A write asked for (the engine's, before a real pull) makes the progress durable and shown,
/// and sends nothing again; a step that records something while it is unwritten writes both.
#[test]
fn progress_is_written_with_the_next_record_or_when_asked() {
    let mut t = new_task(&bare_config("ubuntu:22.04"));
    t.go_all([Event::StartBegan, Event::GpusAcquired(vec![])]);
    assert_eq!(t.status(), TaskStatus::Pending);
    assert!(t.is_progress_only());
    // Asked: `pulling` is written and shown; the pull is out already, nothing goes again.
    let tr = step(&t, Event::PersistRequested, 300).unwrap();
    assert_eq!(tr.actions, [PERSIST]);
    let tr = step(&tr.task, Event::Persisted, 300).unwrap();
    assert_eq!(tr.actions, vec![]);
    assert_eq!(tr.task.status(), TaskStatus::Pulling);
    assert!(!tr.task.is_dirty() && !tr.task.is_progress_only());
    // `t` is still pulling, its progress unwritten: one write with both, then the cancel.
    let a = t.go(terminate(TerminatedByUser, "bye", 0));
    assert_eq!(a, [PERSIST, CANCEL_PULL]);
    assert_eq!(t.status(), TaskStatus::Terminated);
    assert!(!t.is_progress_only());
}

// ---- SPEC §2: how a task ends ----

/// One test per row of §2 where a start step fails: `name: the step awaited => its failure
/// event, the reason, the message, then what start returning calls for;`. The end is written
/// before start is told to finish; until start returns, it owns what it acquired.
macro_rules! start_step_fails {
    ($($(#[$doc:meta])* $name:ident: $at:expr => $failure:expr, $reason:expr, $message:expr,
        then $then:expr;)*) => {
        $(
            $(#[$doc])*
            #[test]
            fn $name() {
                let mut t = started_until($at);
                assert_eq!(t.go($failure($message)), [PERSIST, FINISH]);
                assert_ended(&t, $reason, $message);
                assert!(!t.needs_release(), "owned by start");
                let a = t.go(Event::StartFinished);
                assert_eq!(a, $then);
                // What is released is what the task holds; holding nothing, it is settled.
                let is_release = |a: &&Action| matches!(a, Action::Effect(Effect::Release(_)));
                if let Some(release) = a.iter().find(is_release) {
                    assert_eq!(release, &release_of(&t));
                }
                let resources = &t.record().resources;
                assert_eq!(resources.released, !resources.holds_any());
            }
        )*
    };
}

start_step_fails! {
    gpus_unavailable_is_executor_error: StartStep::AcquireGpus
        => prepare_failed, ExecutorError, "2 GPUs requested, 1 available", then [PERSIST];
    ssh_keys_failure_is_executor_error_and_releases_gpus_after_start_returns: StartStep::AddHostKeys
        => prepare_failed, ExecutorError, "cannot write authorized_keys",
        then [release(&["GPU-a"], false, false)];
    volume_failure_is_executor_error: StartStep::MountVolume(0)
        => prepare_failed, ExecutorError, "volume vol-1 not found",
        then [release(&["GPU-a"], true, false)];
    instance_mount_failure_is_executor_error: StartStep::CreateDir(0)
        => prepare_failed, ExecutorError, "mkdir /mnt/cache: read-only", then [release_all()];
    pull_failure_is_creating_container_error: StartStep::Pull
        => pull_failed, CreatingContainerError, "pull timed out after 20m (1024 bytes downloaded)",
        then [release_all()];
    create_failure_is_creating_container_error: StartStep::CreateContainer
        => create_failed, CreatingContainerError, "no such image", then [release_all()];
    /// Issue 36: a start the engine refuses for the container's devices (Docker's "CDI device
    /// injection failed", "could not select device driver") ran nothing: the task ends as a
    /// create the engine refused does, `creating_container_error`, with the engine's words.
    a_start_refused_for_devices_is_creating_container_error: StartStep::StartContainer
        => start_refused, CreatingContainerError,
        "CDI device injection failed: unresolvable CDI devices nvidia.com/gpu=9",
        then [stop(0)];
    /// A container whose start failed may still run: stopped before anything is released.
    start_failure_is_container_exited_with_error: StartStep::StartContainer
        => start_failed, ContainerExitedWithError, "exec: /bin/sh: not found", then [stop(0)];
    /// Start gave up on its own (a write failed) while a step was out.
    start_aborted_is_executor_error: StartStep::CreateContainer
        => start_aborted, ExecutorError, "state file: disk full", then [release_all()];
}

/// One test per row of §2 where what is seen of a running task's container ends it:
/// `name: the observation => the reason, the message;`. Each writes, then releases everything.
macro_rules! seen_ends {
    ($($(#[$doc:meta])* $name:ident: $seen:expr => $reason:expr, $message:expr;)*) => {
        $(
            $(#[$doc])*
            #[test]
            fn $name() {
                let mut t = running();
                assert_eq!(t.go(seen($seen)), [PERSIST, release_all()]);
                assert_ended(&t, $reason, $message);
            }
        )*
    };
}

const EIGHT_LINES: [&str; 8] = [
    "line 1", "line 2", "line 3", "line 4", "line 5", "line 6", "line 7", "line 8",
];

seen_ends! {
    /// SPEC §2: exit 0 is `done_by_runner` with an empty message. Upstream:
    /// runner/internal/shim/docker.go, waitContainer, looks at the exit code only.
    exit_zero_is_done_by_runner_with_empty_message: exited(0, &["bye"]) => DoneByRunner, "";
    /// Also when Docker marks it OOM-killed (the kernel killed another of its processes).
    an_oom_killed_exit_zero_is_done_by_runner_too: Observation::Exited {
        code: 0,
        last_lines: strings(&["bye"]),
        oom_killed: true,
    } => DoneByRunner, "";
    exit_nonzero_is_container_exited_with_error_with_last_five_lines: exited(3, &EIGHT_LINES)
        => ContainerExitedWithError, "line 4\nline 5\nline 6\nline 7\nline 8";
    an_exit_without_log_lines_has_its_code_as_the_message: exited(137, &[])
        => ContainerExitedWithError, "container exited with code 137";
    never_started_is_executor_error_saying_so: Observation::NeverStarted => ExecutorError,
        "container was created but never started (the shim stopped between create and start)";
    vanished_is_executor_error_saying_so: Observation::Missing
        => ExecutorError, "container vanished";
}

/// A log line may be a whole log (a task that never printed a newline; Podman answers such a
/// line whole): the message keeps its end, at most [`EXIT_MESSAGE_MAX_BYTES`], cut at a
/// character, so that no task answer or state file carries megabytes.
#[test]
fn an_exit_message_keeps_the_end_of_huge_lines() {
    assert_eq!(EXIT_MESSAGE_LINES, 5, "the last five lines (SPEC §2)");
    let huge = format!("é{}", "é".repeat(EXIT_MESSAGE_MAX_BYTES));
    let mut t = running();
    t.go(seen(exited(1, &["first", &huge, "last words"])));
    let message = t.info().termination_message;
    let len = message.len();
    assert!(len <= EXIT_MESSAGE_MAX_BYTES + "…".len(), "{len}");
    assert!(message.starts_with("…é") && message.ends_with("é\nlast words"));
}

/// A NUL a container prints is not stored (the dstack server's Postgres refuses it, and its
/// job would stay stuck); every other character stays, `\r` of progress bars included.
#[test]
fn an_exit_message_carries_no_nul() {
    let mut t = running();
    t.go(seen(exited(1, &["a\0b", "\u{1b}[31mred\r", "tab\there"])));
    let message = t.info().termination_message;
    assert_eq!(message, "a\u{FFFD}b\n\u{1b}[31mred\r\ntab\there");
}

#[test]
fn terminate_request_stores_reason_and_message_as_given() {
    let mut t = running();
    let reason = TerminationReason::parse("brand_new_reason");
    let a = t.go(terminate(reason, "why not", 15));
    assert_eq!(a, [PERSIST, stop(15)]);
    let reason = TerminationReason::Other("brand_new_reason".into());
    assert_ended(&t, reason, "why not");
    assert_eq!(t.info().termination_reason, "brand_new_reason");
    // Release waits for the stop.
    assert!(!t.needs_release());
    assert_eq!(t.go(Event::ContainerStopped), [release_of(&t)]);
}

// ---- SPEC §2 / §4: terminated is final, terminate during start ----

#[test]
fn second_terminate_keeps_the_first_reason_and_changes_nothing() {
    let mut t = running();
    t.go(seen(exited(0, &[])));
    t.go(released(&["GPU-a"], true, &["data"]));
    let tr = step(&t, terminate(TerminatedByUser, "stop", 10), 999).unwrap();
    assert_eq!(tr.task.record(), t.record());
    assert_eq!(tr.task.saved(), t.saved());
    assert_eq!(tr.actions, vec![]);
    assert_ended(&tr.task, DoneByRunner, "");
}

#[test]
fn terminated_absorbs_every_observation() {
    let mut t = running();
    t.go(terminate(TerminatedByUser, "user", 0));
    t.go(Event::ContainerStopped);
    for obs in [
        exited(1, &["x"]),
        exited(0, &[]),
        Observation::NeverStarted,
        Observation::Missing,
    ] {
        let label = format!("{obs:?}");
        t.go(seen(obs));
        assert_ended_as(&label, &t, TerminatedByUser, "user");
    }
}

/// Having acquired nothing, it is settled as released: a remove then has no release.
#[test]
fn terminate_while_pending_finishes_start_at_once_and_remove_has_no_release() {
    let mut t = new_task(&config());
    assert_eq!(t.go(terminate(TerminatedByServer, "gone", 0)), [PERSIST]);
    assert_ended(&t, TerminatedByServer, "gone");
    assert!(t.start_in_flight());
    assert_eq!(t.go(Event::StartBegan), [FINISH]);
    t.go(Event::StartFinished);
    assert!(!t.start_in_flight());
    assert!(t.record().resources.released);
    assert_eq!(t.go(Event::RemoveRequested), removal(None));
}

#[test]
fn terminate_while_preparing_stops_start_at_its_next_step() {
    let mut t = started_until(StartStep::AddHostKeys);
    assert_eq!(t.go(terminate(TerminatedByUser, "", 0)), [PERSIST]);
    // The keys step in progress completes (recorded ahead), then start finishes.
    assert_eq!(t.go(Event::HostKeysAdded(grant())), [FINISH]);
    assert_eq!(t.record().resources.host_keys, Some(grant()));
    assert_eq!(t.go(Event::StartFinished), [release_of(&t)]);
    assert_eq!(t.held().gpus, ["GPU-a"]);
    assert_eq!(t.held().host_keys, Some(grant()));
}

#[test]
fn terminate_while_pulling_cancels_the_pull_at_once() {
    let mut t = started_until(StartStep::Pull);
    let a = t.go(terminate(TerminatedByUser, "cancel", 0));
    assert_eq!(a, [PERSIST, CANCEL_PULL]);
    assert_eq!(t.go(pull_failed("cancelled")), [FINISH]);
    assert_ended(&t, TerminatedByUser, "cancel");
}

// The making of an instance directory is cancelled too: on a file system that does not
// answer (a hung NFS mount) it never returns, and the start held the task's GPUs until it
// did (a remove answered 409 meanwhile). Cancelled, it ends as a failed prepare; the first
// reason stays.
#[test]
fn terminate_while_making_an_instance_directory_cancels_it() {
    let mut t = started_until(StartStep::CreateDir(0));
    let a = t.go(terminate(TerminatedByUser, "cancel", 0));
    assert_eq!(a, [PERSIST, CANCEL_PULL]);
    let cancelled = Event::PrepareFailed {
        message: "terminated while instance mount directory was being made".into(),
    };
    assert_eq!(t.go(cancelled), [FINISH]);
    assert_ended(&t, TerminatedByUser, "cancel");
    assert_eq!(t.go(Event::StartFinished), [release_of(&t)]);
    assert_eq!(t.held().gpus, ["GPU-a"], "released next");
}

#[test]
fn terminate_while_creating_does_not_start_the_created_container() {
    let mut t = started_until(StartStep::CreateContainer);
    t.go(terminate(TerminatedByUser, "", 30));
    assert_eq!(t.go(created("cid")), [PERSIST, FINISH]);
    assert_eq!(t.record().container_id.as_deref(), Some("cid"));
}

#[test]
fn container_started_after_terminate_is_stopped_then_released() {
    let mut t = started_until(StartStep::StartContainer);
    t.go(terminate(TerminatedByUser, "", 30));
    assert_eq!(t.go(started()), [stop(0), FINISH]);
    assert_eq!(t.status(), TaskStatus::Terminated);
    assert_eq!(t.go(Event::ContainerStopped), vec![]);
    assert_eq!(t.go(Event::StartFinished), [release_of(&t)]);
}

#[test]
fn observations_are_ignored_while_start_is_in_flight() {
    let t = started_until(StartStep::StartContainer);
    for obs in [
        Observation::Missing,
        Observation::NeverStarted,
        exited(1, &[]),
    ] {
        let tr = step(&t, seen(obs.clone()), 300).unwrap();
        assert_eq!(tr.task, t, "{obs:?}");
        assert_eq!(tr.actions, vec![], "{obs:?}");
    }
}

#[test]
fn start_returning_early_is_executor_error() {
    let mut t = started_until(StartStep::Pull);
    let a = t.go(Event::StartFinished);
    assert_eq!(a[..2], [PERSIST, release_of(&t)]);
    assert_eq!(t.record().termination_reason, Some(ExecutorError));
}

#[test]
fn an_outcome_of_a_step_not_awaited_is_an_error() {
    let t = started_until(StartStep::Pull);
    let err = step(&t, created("x"), 1).unwrap_err();
    assert!(matches!(err, Unexpected { .. }), "{err}");
    let r = running();
    assert!(step(&r, Event::StartBegan, 1).is_err());
    assert!(step(&r, Event::StartFinished, 1).is_err());
    // A stop's outcome with no stop out (a `running` task would show `pending` again), a
    // release's with no release out (the record would drop what the task holds).
    let strays = [
        Event::ContainerStopped,
        stop_failed("x"),
        released(&["GPU-0"], true, &["vol0"]),
        release_failed("x"),
    ];
    for stray in strays {
        let err = step(&r, stray, 1).unwrap_err();
        assert!(matches!(err, Unexpected { .. }), "{err}");
    }
}

// ---- SPEC §4: release ----

#[test]
fn partial_release_keeps_the_rest_for_the_next_cycle() {
    let mut t = running();
    let a = t.go(seen(Observation::Missing));
    assert_eq!(a[1], release_of(&t));
    assert!(t.release_in_flight() && !t.needs_release());
    // Only the GPU and the keys were released.
    assert_eq!(t.go(released(&["GPU-a"], true, &[])), [PERSIST]);
    assert_eq!(t.held().volumes, [volume()]);
    assert!(t.held().gpus.is_empty() && t.held().host_keys.is_none());
    assert!(!t.record().resources.released);
    // The next cycle retries what is left.
    assert!(t.needs_release());
    assert_eq!(t.go(Event::ReleaseRequested), [release_of(&t)]);
    assert_eq!(t.go(release_failed("target is busy")), vec![]);
    assert!(t.needs_release());
    t.go(Event::ReleaseRequested);
    assert_eq!(t.go(released(&[], false, &["data"])), [PERSIST]);
    assert!(t.record().resources.released && !t.needs_release());
    // The GPU ids stay visible after release.
    assert_eq!(t.info().gpu_ids, Some(gpu_a()));
    // The created dir is never part of a release.
    assert_eq!(t.record().resources.created_dirs, [CACHE]);
}

#[test]
fn failed_stop_defers_release_until_a_stop_succeeds_or_the_container_is_seen_stopped() {
    let stop_failed_once = || {
        let mut t = running();
        t.go(terminate(TerminatedByUser, "", 10));
        // No retry at once: the reconciler's next cycle retries.
        assert_eq!(t.go(stop_failed("timeout")), vec![]);
        assert_eq!(t.stop(), StopState::Failed);
        t
    };
    let mut t = stop_failed_once();
    // The reconciler's release request retries the stop first, never releases before.
    assert!(t.needs_release());
    assert_eq!(t.go(Event::ReleaseRequested), [stop(0)]);
    assert!(!t.needs_release());
    assert_eq!(t.go(stop_failed("timeout")), vec![]);
    // Seen running: stopped again, at once.
    assert_eq!(t.go(seen(Observation::Running)), [stop(0)]);
    assert_eq!(t.go(Event::ContainerStopped), [release_of(&t)]);
    assert!(t.release_in_flight());
    // Seen not running after a failed stop: released without another stop.
    let mut t = stop_failed_once();
    assert_eq!(t.go(seen(Observation::Missing)), [release_of(&t)]);
}

/// Found in review: a task that holds nothing (no GPU, keys, volume) and whose stop failed is
/// still the retry pass's business (`needs_retry`, `stop_failed`): the pass looks at the
/// container and steps `Observed`, which stops it again if it still runs, without waiting for
/// Docker's news or the backstop list.
#[test]
fn a_failed_stop_is_retried_when_the_task_holds_nothing() {
    let mut t = minimal_created("cid");
    t.go_all([started(), Event::StartFinished]);
    assert_eq!(t.status(), TaskStatus::Running);
    let a = t.go(terminate(TerminatedByUser, "", 10));
    assert_eq!(a.last(), Some(&stop(10)));
    assert!(!t.record().resources.holds_any());
    assert_eq!(t.go(stop_failed("timeout")), vec![]);
    assert!(!t.needs_release(), "nothing to release");
    let retried = t.stop_failed() && t.needs_retry();
    assert!(retried, "but the stop is to be retried");
    assert_eq!(t.go(seen(Observation::Running)), [stop(0)]);
    assert!(!t.needs_retry());
    t.go(Event::ContainerStopped);
    assert!(!t.needs_retry());
    assert_eq!(t.stop(), StopState::Idle);
    // A container found gone settles it without another stop.
    let mut gone = t.clone();
    assert_eq!(gone.go(seen(Observation::Running)), [stop(0)]);
    gone.go(stop_failed("timeout"));
    assert_eq!(gone.stop(), StopState::Failed);
    assert_eq!(gone.go(seen(Observation::Missing)), vec![]);
    assert!(!gone.needs_retry());
}

// ---- SPEC §4: remove ----

#[test]
fn remove_only_from_terminated() {
    let remove = |t: &Task| step(t, Event::RemoveRequested, 1).unwrap_err();
    let err = remove(&running());
    let NotTerminated { status, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(*status, TaskStatus::Running);
    let mut t = started_until(StartStep::Pull);
    t.go(terminate(TerminatedByUser, "", 0));
    assert!(matches!(remove(&t), StartInFlight { .. }));
    t.go(pull_failed("cancelled"));
    assert_eq!(t.go(Event::StartFinished), [release_of(&t)]);
    assert!(matches!(remove(&t), ReleaseInFlight { .. }));
    t.go(release_failed("x"));
    let a = t.go(Event::RemoveRequested);
    assert_eq!(a, removal(Some(release_of(&t))));
}

// ---- SPEC §3: TaskInfo ----

#[test]
fn task_info_rules() {
    let mut c = config();
    c.network_mode = NetworkMode::Host;
    let info = new_task(&c).info();
    assert_eq!(info.status, TaskStatus::Pending);
    assert_eq!(info.termination_reason, "");
    assert_eq!(info.termination_message, "");
    assert_eq!(info.ports, None);
    assert_eq!(info.gpu_ids, None);
    assert_eq!(info.image_pull_progress, None);
    assert_eq!(info.container_id, "");
    assert_eq!(info.container_name, container_name(&c.name, &c.id));
    let json = serde_json::to_value(&info).unwrap();
    assert!(json["ports"].is_null() && json["gpus_ids"].is_null() && json.get("gpu_ids").is_none());
    let r = running();
    assert_eq!(r.info().ports, Some(vec![]));
    let json = serde_json::to_value(r.info()).unwrap();
    assert_eq!(json["ports"], serde_json::json!([]));
}

// ---- SPEC §5: restore ----

fn observed(state: ObservedState) -> ObservedContainer {
    let c = config();
    ObservedContainer {
        id: "cid".into(),
        name: format!("/{}", container_name(&c.name, &c.id)),
        task_id: c.id,
        state,
        gpu_ids: gpu_a(),
        ports: vec![PortMapping {
            host: 41000,
            container: 10999,
        }],
        recovered_volumes: vec![MountedVolume {
            device: String::new(),
            ..volume()
        }],
    }
}

/// `restore`, with a leading `Persist` carried out as the engine does (its `Persisted` is
/// stepped at once and what that returns follows it).
fn restored(
    record: Option<&TaskRecord>,
    container: Option<ObservedContainer>,
) -> (Task, Vec<Action>) {
    let (mut t, mut actions) = restore(record.cloned(), container, 5_000).unwrap();
    if actions.first() == Some(&Action::Persist) {
        let tr = step(&t, Event::Persisted, 5_000).unwrap();
        t = tr.task;
        actions.extend(tr.actions);
    }
    (t, actions)
}

fn assert_idempotent(task: &Task, container: Option<ObservedContainer>) {
    let (again, actions) = restore(Some(task.record().clone()), container, 10_000).unwrap();
    assert_eq!(&again, task);
    assert!(!actions.contains(&Action::Persist));
}

#[test]
fn restore_recorded_reason_wins_and_a_running_container_is_stopped() {
    let mut t = running();
    t.go(terminate(TerminatedByUser, "by user", 10));
    // The shim died before the stop: the container still runs.
    let c = observed(ObservedState::Running);
    let (r, a) = restored(Some(t.record()), Some(c.clone()));
    assert_ended(&r, TerminatedByUser, "by user");
    assert_eq!(a, [lock_gpu_a(), stop(0)]);
    assert!(!r.start_in_flight());
    assert_idempotent(&r, Some(c));
    // Exited container: released at once, the exit code does not replace the reason.
    let c = observed(ObservedState::Exited { code: 1 });
    let (r, a) = restored(Some(t.record()), Some(c.clone()));
    assert_ended(&r, TerminatedByUser, "by user");
    assert_eq!(a, [lock_gpu_a(), release_of(&r)]);
    assert_idempotent(&r, Some(c));
}

/// A record as the store reads a state file the upstream shim wrote (no fields of this
/// shim): terminated with its reason, no container id, nothing but `cleaned_up` about the
/// resources, no times.
fn upstream_record(reason: TerminationReason) -> TaskRecord {
    let c = config();
    TaskRecord {
        status: TaskStatus::Terminated,
        termination_reason: Some(reason),
        termination_message: "stopped from the UI".into(),
        created_at_ms: 0,
        updated_at_ms: 0,
        ..TaskRecord::new(&c, container_name(&c.name, &c.id), 0)
    }
}

// Issue 22: a reason the upstream shim recorded wins over its exited container's code, which
// the start-up list does not carry (`-1`) and an inspect would (`3`). upstream:
// runner/internal/shim/docker.go (restoreStateFromContainers: an exited container restores as
// terminated).
#[test]
fn restore_an_upstream_recorded_reason_wins_over_an_exited_container() {
    for code in [-1, 3, 0] {
        let label = format!("code {code}");
        let record = upstream_record(TerminatedByUser);
        let c = observed(ObservedState::Exited { code });
        let (mut r, a) = restored(Some(&record), Some(c.clone()));
        assert_ended_as(&label, &r, TerminatedByUser, "stopped from the UI");
        assert_eq!(r.info().container_id, "cid", "{label}");
        let recorded = a.contains(&Action::Persist);
        assert!(recorded, "{label}: the container id is recorded: {a:?}");
        assert!(!a.contains(&stop(0)), "{label}: {a:?}");
        assert_idempotent(&r, Some(c));
        // What the reconciler then sees of the container changes nothing.
        for obs in [exited(code, &["boom"]), Observation::Missing] {
            r.go(seen(obs));
            assert_ended_as(&label, &r, TerminatedByUser, "stopped from the UI");
        }
    }
}

#[test]
fn restore_recorded_reason_with_a_created_container_stops_it_before_releasing() {
    // Terminated during start, and the shim was killed while Docker started the container:
    // the start-up list shows it created, and it runs a moment later.
    let mut t = started_until(StartStep::StartContainer);
    t.go(terminate(TerminatedByUser, "by user", 10));
    let (r, a) = restored(Some(t.record()), Some(observed(ObservedState::Created)));
    assert_ended(&r, TerminatedByUser, "by user");
    assert_eq!(a, [lock_gpu_a(), stop(0)]);
    assert!(!r.needs_release(), "released only after the stop");
}

#[test]
fn restore_without_reason_with_container_is_running_with_the_containers_facts() {
    let t = started_until(StartStep::StartContainer);
    // The shim died between create and start.
    let c = observed(ObservedState::Created);
    let (mut r, a) = restored(Some(t.record()), Some(c.clone()));
    assert_eq!(r.status(), TaskStatus::Running);
    assert_eq!(a, [PERSIST, lock_gpu_a()]);
    let info = r.info();
    assert_eq!(info.container_id, "cid");
    assert_eq!(info.ports, Some(c.ports.clone()));
    assert_eq!(info.gpu_ids, Some(gpu_a()));
    assert_idempotent(&r, Some(c));
    // The reconciler then finds it never started.
    r.go(seen(Observation::NeverStarted));
    assert_ended(&r, ExecutorError, NEVER_STARTED_MESSAGE);
}

#[test]
fn restore_record_without_container_is_executor_error_saying_what_happened() {
    let t = started_until(StartStep::Pull);
    let (r, a) = restored(Some(t.record()), None);
    assert_ended(
        &r,
        ExecutorError,
        "the shim stopped while the task was pulling; no container of it was found when the \
         shim restarted (its start was cut short before the container was created, or the \
         container was removed while the shim was down)",
    );
    assert_eq!(a, [PERSIST, lock_gpu_a(), release_of(&r)]);
    assert_idempotent(&r, None);

    let (r, _) = restored(Some(running().record()), None);
    assert_eq!(r.record().termination_reason, Some(ExecutorError));
    let message = &r.record().termination_message;
    assert!(message.starts_with("container vanished"), "{message}");
    assert_idempotent(&r, None);
}

#[test]
fn restore_record_without_container_keeps_a_recorded_reason() {
    let mut t = started_until(StartStep::Pull);
    t.go(terminate(MaxDurationExceeded, "too long", 0));
    let (r, a) = restored(Some(t.record()), None);
    assert_ended(&r, MaxDurationExceeded, "too long");
    assert_eq!(a, [lock_gpu_a(), release_of(&r)]);
}

#[test]
fn restore_of_a_released_task_locks_nothing() {
    let mut t = running();
    t.go(seen(Observation::Missing));
    t.go(released(&["GPU-a"], true, &["data"]));
    let c = observed(ObservedState::Exited { code: 0 });
    let (r, a) = restored(Some(t.record()), Some(c));
    assert_eq!(a, vec![]);
    assert!(r.record().resources.released);
}

#[test]
fn restore_container_without_record_adopts_it() {
    let c = observed(ObservedState::Running);
    let (mut r, a) = restored(None, Some(c.clone()));
    assert_eq!(r.status(), TaskStatus::Running);
    assert!(r.record().config.is_none());
    assert_eq!(r.record().name.as_str(), "job");
    assert_eq!(r.id().as_str(), "t1");
    let resources = &r.record().resources;
    assert_eq!(resources.volumes, c.recovered_volumes);
    assert_eq!(resources.host_keys, None);
    assert_eq!(resources.gpus, ["GPU-a"]);
    assert_eq!(a, [PERSIST, lock_gpu_a()]);
    assert_idempotent(&r, Some(c.clone()));
    // When it ends, its recovered volumes are released.
    let a = r.go(seen(exited(0, &[])));
    match &a[1] {
        Action::Effect(Effect::Release(res)) => assert_eq!(res.volumes, c.recovered_volumes),
        other => panic!("{other:?}"),
    }
}

#[test]
fn restore_with_neither_is_nothing_and_a_foreign_container_is_ignored() {
    assert!(restore(None, None, 1).is_none());
    let mut c = observed(ObservedState::Running);
    c.task_id = TaskId::new("other").unwrap();
    let (r, _) = restored(Some(running().record()), Some(c));
    assert_eq!(r.status(), TaskStatus::Terminated);
}

#[test]
fn relock_keeps_only_the_gpus_newly_locked() {
    let (mut t, actions) = restored(None, Some(observed(ObservedState::Running)));
    assert!(actions.contains(&lock_gpu_a()));
    // Another restored task locked GPU-a first: this one must never free it.
    let actions = t.go(Event::GpusRelocked(vec![]));
    assert!(t.record().resources.gpus.is_empty());
    assert_eq!(actions.first(), Some(&PERSIST));
    let actions = t.go(seen(exited(0, &[])));
    let frees_a_gpu =
        |a: &Action| matches!(a, Action::Effect(Effect::Release(r)) if !r.gpus.is_empty());
    assert!(!actions.iter().any(frees_a_gpu), "{actions:?}");
}

#[test]
fn a_volume_is_recorded_and_persisted_before_it_is_mounted() {
    let mounting = || {
        let mut t = started_until(StartStep::MountVolume(0));
        let a = t.go(Event::VolumeMounting(volume()));
        assert_eq!(a, [PERSIST], "persisted before the mount");
        let awaited = Some(StartStep::MountVolume(0));
        assert_eq!(t.start_step(), awaited, "still awaited");
        assert!(t.record().resources.volumes.contains(&volume()));
        t
    };
    // The shim dies during the mount: restored without a container, the volume is released.
    let (r, actions) = restored(Some(mounting().record()), None);
    assert_eq!(r.status(), TaskStatus::Terminated);
    assert_eq!(actions, [PERSIST, lock_gpu_a(), release_all()]);
    // A failed mount keeps the record (releasing it is a no-op) and ends the task.
    let mut t = mounting();
    t.go(prepare_failed("no device"));
    assert_eq!(t.go(Event::StartFinished), [release_all()]);
}

// ---- Faults: a failed write wedges nothing (issue: disk full) ----

// SPEC §4 (issue 22): a failed state write never blocks a stop or a release; a task that
// fills the disk must still be stoppable. The termination is written when the disk allows;
// the API shows the durable record meanwhile.
#[test]
fn a_terminate_whose_write_fails_still_stops_and_releases() {
    let mut t = running();
    let a = t.go_disk_full(terminate(TerminatedByUser, "bye", 10));
    // The stop goes out without waiting for the disk; until it is done the container may
    // still run, so the API still says running.
    assert_eq!(a, [PERSIST, stop(10)]);
    assert!(t.is_dirty() && t.write_failed());
    assert_eq!(t.info().status, TaskStatus::Running);
    assert_eq!(t.info().termination_reason, "");
    // Then the release, and its record's write fails too: nothing is released twice. Once
    // the container is stopped the task reads terminated with the request's reason, though
    // the record still waits for the disk (SPEC §4).
    let a = t.go_disk_full(Event::ContainerStopped);
    assert_eq!(a, [release_of(&t)]);
    assert_eq!(t.saved().status, TaskStatus::Pulling, "not durable");
    let info = t.info();
    let shown = (
        info.status,
        info.termination_reason.as_str(),
        info.termination_message.as_str(),
    );
    assert_eq!(shown, (TaskStatus::Terminated, "terminated_by_user", "bye"));
    let a = t.go_disk_full(released(&["GPU-a"], true, &["data"]));
    assert_eq!(a, [PERSIST]);
    assert!(!t.record().resources.holds_any() && t.record().resources.released);
    assert!(!t.needs_release() && !t.needs_retry());
    // A remove is accepted: it deletes the record the disk could not take.
    let a = t.clone().go_disk_full(Event::RemoveRequested);
    assert_eq!(a, removal(None));
    // The reconciler's retry fails while the disk is full; a second terminate once space is
    // back writes the first reason, released, and changes nothing else.
    assert_eq!(t.go_disk_full(Event::PersistRequested), [PERSIST]);
    assert_eq!(t.go(terminate(TerminatedByServer, "second", 10)), [PERSIST]);
    assert_ended(&t, TerminatedByUser, "bye");
    assert!(!t.write_failed() && t.saved().released);
}

#[test]
fn a_terminate_during_a_pull_whose_write_fails_cancels_the_pull() {
    let mut t = started_until(StartStep::Pull);
    let a = t.go_disk_full(terminate(TerminatedByUser, "", 0));
    assert_eq!(a, [PERSIST, CANCEL_PULL]);
    // Start stops at its next step and releases when it returns, the disk still full.
    assert_eq!(t.go_disk_full(pull_failed("cancelled")), [FINISH]);
    assert_eq!(t.status(), TaskStatus::Pulling, "start still in flight");
    assert_eq!(t.go_disk_full(Event::StartFinished), [release_of(&t)]);
    // No container was made: the task reads terminated though its record waits.
    assert_eq!(t.saved().status, TaskStatus::Pulling);
    assert_eq!(t.status(), TaskStatus::Terminated);
    assert_eq!(t.info().termination_reason, "terminated_by_user");
}

#[test]
fn an_exit_whose_write_fails_releases_without_waiting_for_the_disk() {
    let mut t = running();
    let a = t.go_disk_full(seen(exited(0, &[])));
    assert_eq!(a, [PERSIST, release_of(&t)]);
    // SPEC §4: the container no longer runs, so the task reads terminated at once, its
    // record waiting for the disk.
    assert!(t.is_dirty() && t.write_failed());
    assert_eq!(t.saved().status, TaskStatus::Pulling, "not durable");
    assert_eq!(t.status(), TaskStatus::Terminated, "shown at once");
    assert_eq!(t.info().termination_reason, "done_by_runner");
    // The release fails (busy); the reconciler's next cycle writes the exit once the disk
    // allows, and retries the release in the same cycle.
    let retried = t.go_disk_full(release_failed("busy"));
    // Backed off: nothing but the reconciler's next request retries the release.
    assert!(t.needs_release());
    assert_eq!(retried, vec![], "a failed release is not retried at once");
    assert_eq!(t.go(Event::PersistRequested), [PERSIST, release_of(&t)]);
    assert_ended(&t, DoneByRunner, "");
}

#[test]
fn a_start_whose_write_fails_is_given_up_with_the_cause() {
    // The keys are recorded ahead, but the write fails: the add never goes out.
    let mut t = new_task(&config());
    t.go(Event::StartBegan);
    let a = t.go_disk_full(Event::GpusAcquired(gpu_a()));
    assert_eq!(a, [PERSIST, FINISH]);
    assert_eq!(t.record().status, TaskStatus::Terminated);
    let message = &t.record().termination_message;
    let cause = "cannot write the task's state file: No space left";
    assert!(message.starts_with(cause), "{message}");
    // What it acquired is released when it returns, without waiting for the disk (the keys
    // recorded ahead were never added: removing them is a no-op).
    let a = t.go_disk_full(Event::StartFinished);
    assert_eq!(a, [release(&["GPU-a"], true, false)]);
    // A step in flight is not given up by a write failure of another event.
    let mut t = started_until(StartStep::AddHostKeys);
    let a = t.go_disk_full(terminate(TerminatedByServer, "", 0));
    assert_eq!(a, [PERSIST]);
    assert_eq!(t.start_step(), Some(StartStep::AddHostKeys));
    // Start owns the task: nothing is released before it returns.
    assert!(!t.needs_release());
}

/// SPEC §5 (issue 37): `running` is never written on its own. The container proves it: the
/// API shows it at once, the reconciler asks for no write, a restart that finds the container
/// running restores `running` from it and leaves the record as it is (`pending`, what submit
/// wrote), and the next change (here a terminate) writes everything in one write.
#[test]
fn running_is_written_with_the_next_change_only() {
    let mut t = minimal_created("cid");
    let on_disk = t.saved().clone();
    assert_eq!(on_disk.status, TaskStatus::Pending);
    // Started (no write: `minimal_config_skips_keys_volumes_dirs_and_a_present_image`), and
    // the start settled: still none, and the reconciler asks for none.
    t.go(started());
    assert_eq!(t.go(Event::StartFinished), vec![]);
    assert_eq!(t.status(), TaskStatus::Running, "the container proves it");
    assert_eq!(t.saved(), &on_disk, "not written");
    assert!(t.is_dirty() && t.is_progress_only() && !t.needs_write());
    // A restart: the record still says `pending`; the running container makes it `running`,
    // with no write, and a second restart finds the same.
    let mut pending = t.record().clone();
    pending.status = TaskStatus::Pending;
    pending.container_id = None;
    let container = ObservedContainer {
        gpu_ids: vec![],
        ports: vec![],
        recovered_volumes: vec![],
        ..observed(ObservedState::Running)
    };
    let (r, actions) = restore(Some(pending.clone()), Some(container.clone()), 5_000).unwrap();
    assert_eq!(actions, vec![]);
    assert_eq!(r.status(), TaskStatus::Running);
    assert_eq!(r.record().container_id.as_deref(), Some("cid"));
    assert!(r.is_progress_only() && !r.needs_write());
    // Without a running container the change is written first (an exited one ends it next).
    let exited = ObservedContainer {
        state: ObservedState::Exited { code: 0 },
        ..container
    };
    let (_, actions) = restore(Some(pending), Some(exited), 5_000).unwrap();
    assert_eq!(actions.first(), Some(&PERSIST));
    // The next change carries `running` and the container id along.
    for mut t in [t, r] {
        let a = t.go(terminate(TerminatedByUser, "bye", 0));
        assert_eq!(a[0], PERSIST);
        assert!(!t.is_dirty());
        assert_eq!(t.record().container_id.as_deref(), Some("cid"));
        assert_eq!(t.saved().status, TaskStatus::Terminated);
    }
}

#[test]
fn an_abandoned_remove_leaves_nothing_in_flight() {
    let mut t = running();
    t.go(terminate(TerminatedByUser, "", 0));
    t.go(Event::ContainerStopped);
    t.go(release_failed("busy"));
    let actions = t.go(Event::RemoveRequested);
    assert_eq!(actions[0], fx(Effect::RemoveContainer));
    assert!(t.release_in_flight());
    // Docker refuses the container removal: the engine drops the rest and says so.
    let message = "cannot remove the container".into();
    assert_eq!(t.go(Event::ActionsAbandoned { actions, message }), vec![]);
    assert!(!t.release_in_flight());
    // The next cycle releases; a later remove is accepted.
    assert!(t.needs_release());
    t.go(Event::RemoveRequested);
}

#[test]
fn a_reason_left_empty_takes_the_reason_of_a_later_terminate() {
    // upstream: runner/internal/shim/task.go (TaskStorage.Update): "if the stored terminated
    // task has an empty reason, a later terminated update replaces reason and message". The
    // server's terminate of a dangling task sends no reason.
    let mut t = running();
    t.go(terminate(TerminationReason::parse(""), "", 0));
    assert_eq!(t.info().status, TaskStatus::Terminated);
    assert_eq!(t.info().termination_reason, "");
    let a = t.go(terminate(TerminatedByServer, "later", 0));
    assert_eq!(a.first(), Some(&PERSIST));
    assert_ended(&t, TerminatedByServer, "later");
    // A non-empty reason is then final.
    t.go(terminate(TerminatedByUser, "again", 0));
    assert_ended(&t, TerminatedByServer, "later");
}
