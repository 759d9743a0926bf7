//! Crash states, enumerated (the method of ALICE, OSDI '14, and CrashMonkey, OSDI '18, in
//! process). Workloads of submits (into a spare made ahead or a directory made on the spot;
//! concurrent ones sharing one group commit of the runners directory), spares made ahead,
//! adoptions (`create_task_dir` then `write`, as restore adopts a container), marks as mounted
//! whole, status writes, terminates, removes and the owner identity run on a recorded store
//! (`Store::open_recorded`). `shim_fs::crash::explore` builds every state a crash could leave
//! after each operation (each one not yet made durable applied or undone, each unsynced write
//! kept, dropped or torn); the store's start-up (open, legacy migration, trash sweep, scan) runs
//! on each, and what it finds is checked against what was acknowledged (`Ok`) before the crash:
//!
//! - start-up never fails;
//! - an acknowledged submit is there, unless its remove had begun;
//! - a record is the last acknowledged one or a later one in flight, never older, never torn;
//! - an acknowledged remove does not come back;
//! - an acknowledged mark as mounted whole is never read again; an unmarked one never taken for
//!   marked;
//! - the owner identity, once acknowledged, is there, and it is never unreadable;
//! - (of the run itself) a submit into a ready spare made one file fsync and one directory
//!   fsync, one without a spare one directory fsync more.
//!
//! With a step of the durable writes left out (`shim_fs::crash::Bug`), the same checks find
//! violating states: a missing file fsync and a missing directory fsync are caught.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // test helpers

mod common;

use std::collections::{BTreeMap, HashMap};
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Mutex;

use proptest::prelude::*;
use proptest::sample::select;
use shim_fs::crash::{Bug, CrashState, Limits, Log, NodeId, Op, Recorder, Stats, Tree, explore};
use shim_store::{ScanEntry, Store};
use shim_task::{TaskRecord, TaskStatus, TerminationReason};

/// Tasks a workload works on.
const TASKS: usize = 3;
/// The "task" number of the owner identity's calls and of the spares made ahead (their own
/// thread in concurrent runs).
const OWNER: usize = TASKS;
/// Spares a workload's `Prepare` keeps ready (few: each is seven operations).
const SPARES: usize = TASKS;

/// One step of a workload, before it is resolved against the tasks' states.
#[derive(Debug, Clone)]
enum Step {
    /// `Store::create` of a new task (its first record).
    Submit(usize),
    /// A task adopted without a config: `Store::create_task_dir`, then `Store::write`.
    Adopt(usize),
    /// A status write (`Store::write`).
    Status(usize, TaskStatus),
    /// A write of `terminated` with a reason.
    Terminate(usize, TerminationReason),
    /// `Store::delete`.
    Remove(usize),
    /// `Store::mark_mounted_whole` (no record is written to the task after it).
    Mark(usize),
    /// `Store::create_owner_id` (once; a later one is dropped).
    Owner,
    /// `Store::prepare_spares_up_to` (spares made ahead of submits).
    Prepare,
}

/// A store call a workload makes.
#[derive(Debug, Clone)]
enum Action {
    Create(TaskRecord),
    Adopt(TaskRecord),
    Write(TaskRecord),
    Delete,
    Mark,
    Owner(String),
    Prepare,
}

/// A call as it ran: the recorder's positions before it and after it returned.
#[derive(Debug, Clone)]
struct Call {
    task: usize,
    action: Action,
    start: usize,
    end: usize,
    ok: bool,
    /// A spare was ready when the call began (meaningful for a `Create` run alone).
    spare_ready: bool,
}

fn container(task: usize) -> String {
    format!("job-t{task}")
}

/// The store calls of `steps`, per task, in order: a submit of a task not yet submitted, a
/// write or a remove of a live one (a write to a task not yet submitted submits it first; a
/// step on a removed task, or a second submit, is dropped); every record carries a version of
/// its own (`updated_at_ms`).
fn resolve(steps: &[Step]) -> Vec<(usize, Action)> {
    #[derive(Clone)]
    enum Life {
        Unborn,
        Live(Box<TaskRecord>),
        /// Marked as mounted whole: only a remove is left.
        Marked,
        Gone,
    }
    let mut life = vec![Life::Unborn; TASKS];
    let mut out = Vec::new();
    let mut owner = false;
    for step in steps {
        let task = match step {
            Step::Owner if owner => continue,
            Step::Owner => {
                owner = true;
                out.push((OWNER, Action::Owner("0123abcd".to_owned())));
                continue;
            }
            Step::Prepare => {
                out.push((OWNER, Action::Prepare));
                continue;
            }
            Step::Submit(t)
            | Step::Adopt(t)
            | Step::Status(t, _)
            | Step::Terminate(t, _)
            | Step::Remove(t)
            | Step::Mark(t) => *t,
        };
        // A submit, or a write to a task not yet submitted (which submits it first).
        if let (Step::Submit(_) | Step::Status(..) | Step::Terminate(..), Life::Unborn) =
            (step, &life[task])
        {
            let r = common::record(&format!("t{task}"));
            out.push((task, Action::Create(r.clone())));
            life[task] = Life::Live(Box::new(r));
        }
        let action = match (step, &life[task]) {
            (Step::Adopt(_), Life::Unborn) => Action::Adopt(TaskRecord {
                config: None,
                status: TaskStatus::Running,
                ..common::record(&format!("t{task}"))
            }),
            (Step::Status(_, status), Life::Live(last)) => Action::Write(TaskRecord {
                status: *status,
                termination_reason: None,
                termination_message: String::new(),
                updated_at_ms: last.updated_at_ms + 1,
                ..(**last).clone()
            }),
            (Step::Terminate(_, reason), Life::Live(last)) => Action::Write(TaskRecord {
                status: TaskStatus::Terminated,
                termination_reason: Some(reason.clone()),
                termination_message: format!("stopped at version {}", last.updated_at_ms + 1),
                updated_at_ms: last.updated_at_ms + 1,
                ..(**last).clone()
            }),
            (Step::Remove(_), Life::Live(_) | Life::Marked) => Action::Delete,
            (Step::Mark(_), Life::Live(_)) => Action::Mark,
            _ => continue,
        };
        life[task] = match &action {
            Action::Adopt(r) | Action::Write(r) => Life::Live(Box::new(r.clone())),
            Action::Mark => Life::Marked,
            _ => Life::Gone,
        };
        out.push((task, action));
    }
    out
}

fn perform(store: &Store, recorder: &Recorder, task: usize, action: Action) -> Call {
    let spare_ready = store.spares_ready() > 0;
    let start = recorder.position();
    let result = match &action {
        Action::Create(r) => store.create(r).map(drop),
        Action::Adopt(r) => store
            .create_task_dir(&r.container_name)
            .and_then(|_| store.write(r)),
        Action::Write(r) => store.write(r),
        Action::Delete => store.delete(&container(task)),
        Action::Mark => store.mark_mounted_whole(&container(task)),
        Action::Owner(id) => store.create_owner_id(id).map(|got| assert_eq!(&got, id)),
        Action::Prepare => store.prepare_spares_up_to(SPARES).map(drop),
    };
    let end = recorder.position();
    if let Err(e) = &result {
        eprintln!("task {task}: {action:?} failed: {e}");
    }
    Call {
        task,
        action,
        start,
        end,
        ok: result.is_ok(),
        spare_ready,
    }
}

/// A scratch directory: on tmpfs where there is one (`/dev/shm`), where the workload's real
/// fsyncs cost nothing (the crash states come from the model, not from the disk), else in the
/// temp directory.
fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::tempdir_in(shm)
    {
        return dir;
    }
    tempfile::tempdir().unwrap()
}

/// A workload run under a recorder.
struct Run {
    _tmp: tempfile::TempDir,
    log: Log,
    calls: Vec<Call>,
}

/// Runs `actions` on a store opened (recorded) on an empty home: in their order on this
/// thread, or with `concurrent`, each task's calls in order on a thread of its own.
fn run(actions: &[(usize, Action)], concurrent: bool, bug: Option<Bug>) -> Run {
    let tmp = scratch();
    let home = tmp.path().join("home");
    fs_err::create_dir(&home).unwrap();
    let recorder = Recorder::start(&home).unwrap();
    if let Some(bug) = bug {
        recorder.inject(bug);
    }
    let store = Store::open_recorded(&home, recorder.clone()).unwrap();
    // Spares made ahead at the head of the workload are ready before any thread starts.
    let lead = actions
        .iter()
        .take_while(|(_, a)| matches!(a, Action::Prepare))
        .count();
    let in_order = |actions: &[(usize, Action)]| -> Vec<Call> {
        (actions.iter())
            .map(|(task, action)| perform(&store, &recorder, *task, action.clone()))
            .collect()
    };
    let mut calls = in_order(&actions[..lead]);
    let actions = &actions[lead..];
    calls.extend(if concurrent {
        // The tasks whose first call is a submit share the first commit of the runners
        // directory (bounded: a thread that comes late commits on its own).
        let first_submits = (0..TASKS)
            .filter(|t| {
                actions
                    .iter()
                    .find(|(task, _)| task == t)
                    .is_some_and(|(_, a)| matches!(a, Action::Create(_)))
            })
            .count();
        if first_submits > 1 {
            store.gather_next_commit(first_submits, std::time::Duration::from_millis(500));
        }
        let calls = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for task in 0..=OWNER {
                let mine: Vec<Action> = actions
                    .iter()
                    .filter(|(t, _)| *t == task)
                    .map(|(_, a)| a.clone())
                    .collect();
                let (store, recorder, calls) = (&store, &recorder, &calls);
                s.spawn(move || {
                    for action in mine {
                        let call = perform(store, recorder, task, action);
                        calls.lock().unwrap().push(call);
                    }
                });
            }
        });
        calls.into_inner().unwrap()
    } else {
        in_order(actions)
    });
    let log = recorder.log();
    let submits = calls
        .iter()
        .filter(|c| matches!(c.action, Action::Create(_)));
    for call in submits.filter(|_| !concurrent && bug.is_none()) {
        let expected = if call.spare_ready { (1, 1) } else { (1, 2) };
        let got = fsyncs(&log, call.start, call.end);
        assert_eq!(got, expected, "fsyncs of a submit: {call:?}");
    }
    // Every operation went through the recorder: the recorded tree is the disk's.
    assert!(log.problems.is_empty(), "{:?}", log.problems);
    let (live, disk) = (log.live().listing(), Tree::read(&home).unwrap().listing());
    assert_eq!(live, disk, "an operation bypassed the recorder");
    Run {
        _tmp: tmp,
        log,
        calls,
    }
}

/// The file fsyncs and directory fsyncs among the operations `from..to` of `log`.
fn fsyncs(log: &Log, from: usize, to: usize) -> (usize, usize) {
    let count = |f: fn(&Op) -> bool| log.ops[from..to].iter().filter(|op| f(op)).count();
    let file = count(|op| matches!(op, Op::Fsync { .. }));
    (file, count(|op| matches!(op, Op::FsyncDir { .. })))
}

/// What a crash state got wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Wrong {
    /// The store's start-up failed.
    StartUp,
    /// A directory no task made.
    Stranger,
    /// A task whose remove was acknowledged is back.
    CameBack,
    /// A state file is unusable (a torn or empty record).
    Unusable,
    /// A record other than the last acknowledged one or a later one in flight (an older one).
    Contradicts,
    /// A task whose submit was acknowledged has a directory but no record.
    NoRecord,
    /// A task whose submit was acknowledged is gone.
    Gone,
    /// The owner identity is unreadable, or missing once acknowledged.
    Owner,
    /// A directory whose mark as mounted whole was acknowledged is read (or is no longer
    /// marked), or one never marked is taken for marked.
    Mark,
}

/// What start-up found for one task directory.
#[derive(Debug, Clone)]
enum Found {
    Record(Box<TaskRecord>),
    NoRecord,
    Corrupt(String),
    /// Marked as mounted whole: not read.
    Whole,
}

/// What start-up found in a state: every task directory by name, and the owner identity (or
/// why it could not be read).
struct Seen {
    tasks: BTreeMap<String, Found>,
    owner: Result<Option<String>, String>,
}

/// What start-up found, or why it failed.
type Startup = Result<Seen, String>;

/// The store's start-up (as the engine runs it) on a home.
fn start_up(home: &Path) -> Startup {
    let store = Store::open(home).map_err(|e| format!("open: {e}"))?;
    let owner = store.owner_id().map_err(|e| e.to_string());
    store
        .migrate_legacy()
        .map_err(|e| format!("migration: {e}"))?;
    store.sweep_trash();
    let entries = store.scan().map_err(|e| format!("scan: {e}"))?;
    let tasks = entries
        .into_iter()
        .map(|e| match e {
            ScanEntry::Record { record, .. } => (
                record.container_name.clone(),
                Found::Record(Box::new(record)),
            ),
            ScanEntry::NoRecord { name, .. } => (name, Found::NoRecord),
            ScanEntry::MountedWhole { name, .. } => (name, Found::Whole),
            ScanEntry::Corrupt { name, error, .. } => (name, Found::Corrupt(error.to_string())),
        })
        .collect();
    Ok(Seen { tasks, owner })
}

/// What is wrong with `found` after a crash at `point`, given the calls and when they ran.
fn judge(calls: &[Call], point: usize, seen: &Seen) -> Vec<(Wrong, String)> {
    let mut wrong = Vec::new();
    let owner = calls.iter().find(|c| matches!(c.action, Action::Owner(_)));
    match (&seen.owner, owner) {
        (Err(e), _) => wrong.push((Wrong::Owner, format!("owner identity unreadable: {e}"))),
        (Ok(None), Some(c)) if c.ok && c.end <= point => wrong.push((
            Wrong::Owner,
            "the owner identity was acknowledged, yet it is gone".to_owned(),
        )),
        (Ok(Some(id)), c) => {
            let expected = c.and_then(|c| match &c.action {
                Action::Owner(id) if c.start < point => Some(id),
                _ => None,
            });
            if expected != Some(id) {
                wrong.push((Wrong::Owner, format!("owner identity {id:?} never written")));
            }
        }
        (Ok(None), _) => {}
    }
    let found = &seen.tasks;
    for name in found.keys() {
        if !(0..TASKS).any(|t| container(t) == *name) {
            wrong.push((Wrong::Stranger, format!("{name}: a directory no task made")));
        }
    }
    for task in 0..TASKS {
        let name = container(task);
        let mine: Vec<&Call> = calls.iter().filter(|c| c.task == task).collect();
        let acked = |c: &Call| c.ok && c.end <= point;
        let started = |c: &Call| c.start < point;
        // Whether a call of `mine` that `is` holds `when`.
        let any = |is: fn(&Action) -> bool, when: &dyn Fn(&Call) -> bool| {
            mine.iter().any(|c| is(&c.action) && when(c))
        };
        let create: fn(&Action) -> bool = |a| matches!(a, Action::Create(_) | Action::Adopt(_));
        let delete: fn(&Action) -> bool = |a| matches!(a, Action::Delete);
        let mark: fn(&Action) -> bool = |a| matches!(a, Action::Mark);
        let created = any(create, &acked);
        let (removing, removed) = (any(delete, &started), any(delete, &acked));
        let (marking, marked) = (any(mark, &started), any(mark, &acked));
        // The records it may hold: the last acknowledged, or a later one in flight.
        let writes: Vec<(&TaskRecord, &Call)> = mine
            .iter()
            .filter_map(|c| match &c.action {
                Action::Create(r) | Action::Adopt(r) | Action::Write(r) => Some((r, *c)),
                Action::Delete | Action::Mark | Action::Owner(_) | Action::Prepare => None,
            })
            .collect();
        let last_acked = writes.iter().rposition(|(_, c)| acked(c));
        let allowed: Vec<&TaskRecord> = writes
            .iter()
            .enumerate()
            .filter(|(i, (_, c))| Some(*i) == last_acked || (Some(*i) > last_acked && started(c)))
            .map(|(_, (r, _))| *r)
            .collect();
        let (kind, text) = match found.get(&name) {
            Some(_) if removed => (Wrong::CameBack, "its acknowledged remove undone".into()),
            Some(Found::Whole) if !marking => (Wrong::Mark, "whole, never marked".into()),
            Some(Found::Whole) => continue,
            Some(_) if marked => (Wrong::Mark, "read after its acknowledged mark".into()),
            Some(Found::Corrupt(e)) => (Wrong::Unusable, format!("an unusable record ({e})")),
            Some(Found::Record(r)) if !allowed.iter().any(|a| common::stored_form(a) == **r) => {
                let versions: Vec<u64> = allowed.iter().map(|r| r.updated_at_ms).collect();
                let (version, status) = (r.updated_at_ms, r.status);
                let text = format!("record version {version} ({status:?}), allowed: {versions:?}");
                (Wrong::Contradicts, text)
            }
            Some(Found::NoRecord) if created && !removing => {
                (Wrong::NoRecord, "acknowledged submit, no record".into())
            }
            None if created && !removing => (Wrong::Gone, "acknowledged submit, gone".into()),
            Some(Found::Record(_) | Found::NoRecord) | None => continue,
        };
        wrong.push((kind, format!("{name}: {text}")));
    }
    wrong
}

/// Explores every crash state of `run`, start-up on each distinct tree once and its findings
/// checked against what was acknowledged at each crash point; the violations found, the
/// statistics, and on how many trees start-up ran.
fn explore_run(run: &Run) -> (Vec<(Wrong, String)>, Stats, usize) {
    let mut startups: HashMap<u64, Startup> = HashMap::new();
    let mut violations = Vec::new();
    let stats = explore(&run.log, &Limits::default(), |state: &CrashState| {
        let startup = startups.entry(state.digest).or_insert_with(|| {
            let dir = scratch();
            state.tree.materialise(dir.path()).unwrap();
            start_up(dir.path())
        });
        let problems = match startup {
            Err(e) => vec![(Wrong::StartUp, format!("start-up failed: {e}"))],
            Ok(found) => judge(&run.calls, state.point, found),
        };
        let at = state.describe(&run.log);
        for (wrong, p) in problems {
            violations.push((wrong, format!("{p}\n  in {at}")));
        }
        ControlFlow::Continue(())
    });
    (violations, stats, startups.len())
}

/// Explores `run` and fails on the first violating state; `what` names the workload.
fn assert_no_violating_state(run: &Run, what: &str) {
    let (violations, stats, started) = explore_run(run);
    let ops = run.log.ops.len();
    eprintln!("{what}, {ops} operations: {stats}; start-up run on {started}");
    let (n, first) = (violations.len(), violations.first().map(|v| &v.1));
    assert!(n == 0, "{n} violating crash states; the first:\n{first:?}");
}

fn step() -> impl Strategy<Value = Step> {
    use {TaskStatus as S, TerminationReason as R};
    let task = 0..TASKS;
    let status = select(vec![S::Preparing, S::Pulling, S::Creating, S::Running]);
    let reason = select(vec![
        R::DoneByRunner,
        R::TerminatedByUser,
        R::ContainerExitedWithError,
        R::Other("gone fishing".to_owned()),
    ]);
    prop_oneof![
        3 => task.clone().prop_map(Step::Submit),
        3 => (task.clone(), status).prop_map(|(t, s)| Step::Status(t, s)),
        2 => (task.clone(), reason).prop_map(|(t, r)| Step::Terminate(t, r)),
        1 => task.clone().prop_map(Step::Remove),
        1 => task.clone().prop_map(Step::Adopt),
        1 => task.prop_map(Step::Mark),
        1 => Just(Step::Owner),
        2 => Just(Step::Prepare),
    ]
}

proptest! {
    // Each case runs a workload of up to 15 calls and checks up to a few thousand crash
    // states: 64 cases take about 3 s with /dev/shm, 10 to 30 s on a disk (2 cores, debug).
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn no_crash_state_loses_or_contradicts_an_acknowledged_call(
        steps in proptest::collection::vec(step(), 1..16),
        concurrent in any::<bool>(),
    ) {
        let run = run(&resolve(&steps), concurrent, None);
        prop_assert!(run.calls.iter().all(|c| c.ok), "{:?}", run.calls);
        let threads = if concurrent { " (threads)" } else { "" };
        assert_no_violating_state(&run, &format!("{} calls{threads}", run.calls.len()));
    }
}

/// A fixed workload: spares made ahead, two submits (the first into a spare, the second into
/// one made on the spot... or the second spare), a status write each, a terminate, a remove,
/// an adoption, its directory marked as mounted whole, and the owner identity.
fn fixed() -> Vec<(usize, Action)> {
    resolve(&[
        Step::Owner,
        Step::Prepare,
        Step::Submit(0),
        Step::Submit(1),
        Step::Status(0, TaskStatus::Running),
        Step::Status(1, TaskStatus::Pulling),
        Step::Terminate(0, TerminationReason::TerminatedByUser),
        Step::Remove(1),
        Step::Status(0, TaskStatus::Terminated),
        Step::Adopt(2),
        Step::Mark(2),
    ])
}

/// The real code on the fixed workload: no violating state (the baseline of the bug tests).
#[test]
fn the_fixed_workload_has_no_violating_crash_state() {
    assert_no_violating_state(&run(&fixed(), false, None), "fixed workload");
}

/// Runs the fixed workload with `bug` injected and asserts that violating states of each of
/// `kinds` are found (printing how many of each kind, and the first of each).
fn assert_caught(bug: Bug, kinds: &[Wrong]) {
    let run = run(&fixed(), false, Some(bug));
    let (violations, stats, _) = explore_run(&run);
    let mut found: BTreeMap<Wrong, (usize, String)> = BTreeMap::new();
    for (wrong, text) in violations {
        found.entry(wrong).or_insert((0, text)).0 += 1;
    }
    eprintln!("{bug:?}: {stats}");
    for (wrong, (n, first)) in &found {
        eprintln!("  {n} states {wrong:?}; the first: {first}");
    }
    for kind in kinds {
        let caught = found.contains_key(kind);
        assert!(caught, "{kind:?} not in {:?}", found.keys());
    }
}

/// The temp file is renamed over `task.json` before its data is durable: an acknowledged
/// submit or write can leave an empty or torn record, which start-up moves aside.
#[test]
fn a_missing_file_fsync_is_caught() {
    assert_caught(Bug::SkipFileFsync, &[Wrong::Unusable]);
}

/// The rename over `task.json` is not durable when the write returns: an acknowledged status
/// write can give way to the record before it, an acknowledged submit to no record at all,
/// an acknowledged mark as mounted whole to a directory read again.
#[test]
fn a_missing_directory_fsync_after_the_rename_is_caught() {
    assert_caught(
        Bug::SkipPublishDirFsync,
        &[Wrong::Contradicts, Wrong::NoRecord, Wrong::Mark],
    );
}

/// No directory fsync at all (the store's own in create and delete included): acknowledged
/// submits vanish, acknowledged removes are undone.
#[test]
fn missing_directory_fsyncs_are_caught() {
    assert_caught(Bug::SkipDirFsync, &[Wrong::Gone, Wrong::CameBack]);
}

#[test]
fn the_recorder_sees_every_operation_of_concurrent_writers() {
    let actions = resolve(&[
        Step::Submit(0),
        Step::Submit(1),
        Step::Adopt(2),
        Step::Owner,
        Step::Status(0, TaskStatus::Running),
        Step::Status(1, TaskStatus::Running),
        Step::Remove(2),
        Step::Terminate(1, TerminationReason::DoneByRunner),
    ]);
    // `run` checks the recorded tree against the disk.
    let run = run(&actions, true, None);
    assert!(run.calls.iter().all(|c| c.ok));
}

/// Three concurrent submits into spares made ahead share one commit of the runners directory
/// (its one fsync after their three renames), and no crash state loses an acknowledged one
/// or shows one without its whole record.
#[test]
fn concurrent_submits_sharing_one_group_commit_have_no_violating_crash_state() {
    let mut steps = vec![Step::Prepare];
    steps.extend((0..TASKS).map(Step::Submit));
    steps.extend((0..TASKS).map(|t| Step::Status(t, TaskStatus::Running)));
    let run = run(&resolve(&steps), true, None);
    assert!(run.calls.iter().all(|c| c.ok), "{:?}", run.calls);
    let renames: Vec<(usize, NodeId)> = (run.log.ops.iter().enumerate())
        .filter_map(|(i, op)| match op {
            Op::Rename { to, to_dir, .. } if to.to_string_lossy().starts_with("job-") => {
                Some((i, *to_dir))
            }
            _ => None,
        })
        .collect();
    let n = renames.len();
    assert_eq!(n, TASKS, "every submit renamed a spare into place");
    let (first, runners) = renames[0];
    // One fsync of the runners directory after the last rename, before any submit returned.
    let last = renames[TASKS - 1].0;
    let first_end = (run.calls.iter())
        .filter(|c| matches!(c.action, Action::Create(_)))
        .map(|c| c.end)
        .min()
        .unwrap();
    let commits = run.log.ops[first..first_end]
        .iter()
        .filter(|op| matches!(op, Op::FsyncDir { dir } if *dir == runners))
        .count();
    let ordered = last < first_end;
    assert!(ordered, "a submit returned before the others renamed");
    assert_eq!(commits, 1, "one shared fsync of the runners directory");
    assert_no_violating_state(&run, "three concurrent submits");
}
