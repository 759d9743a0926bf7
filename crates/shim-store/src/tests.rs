//! The store's writes under fault injection (shim-fs's, at each step of the atomic write it
//! goes through): a failure or a crash at any step leaves the old or the new record, never a
//! partial one. shim-fs tests the write itself at every step and under real kills; these pin
//! that the store's records go through it.

use std::path::Path;

use shim_fs::Step::{self, CreateTemp, Rename, SyncDir, SyncFile, Write};
use shim_fs::fault::FaultKind;
use shim_task::{TaskConfig, TaskId, TaskName, TaskRecord, TaskStatus, TerminationReason};

use crate::{ScanEntry, Store};

const STEPS: [Step; 5] = [CreateTemp, Write, SyncFile, Rename, SyncDir];

fn record(id: &str, status: TaskStatus) -> TaskRecord {
    let id = TaskId::new(id).unwrap();
    let config = TaskConfig::new(id, TaskName::new("job").unwrap(), "shim-test:1");
    let mut r = TaskRecord::new(&config, "job-0123abcd".into(), 1_000);
    r.status = status;
    r
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs_err::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn is_temp(name: &str) -> bool {
    shim_fs::is_temp_of("task.json", name)
}

/// A store in a fresh home holding task `old`: its directory and its first record.
fn store_with(old: &TaskRecord) -> (tempfile::TempDir, Store, crate::TaskPaths) {
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path()).unwrap();
    let paths = store.create_task_dir(&old.container_name).unwrap();
    store.write(old).unwrap();
    (home, store, paths)
}

/// A write that failed at `step`: the fault armed there fired, and its error is the one injected.
fn assert_injected(store: &Store, step: Step, err: &crate::StoreError) {
    assert!(format!("{err:?}").contains("Injected"), "{step:?}: {err:?}");
    let fired = store.faults.fired();
    assert_eq!(fired, Some((step, FaultKind::Fail)), "{step:?} not reached");
}

/// A create of `r` works: its record, and nothing else but `runner`, in its directory.
fn assert_create_works(store: &Store, r: &TaskRecord) {
    let paths = store.create(r).unwrap();
    assert_eq!(store.read(&r.container_name).unwrap().as_ref(), Some(r));
    assert_eq!(files_in(&paths.dir), ["runner", "task.json"]);
}

/// `new` is written, and read back.
fn assert_next_write_goes_through(store: &Store, new: &TaskRecord) {
    store.write(new).unwrap();
    assert_eq!(store.read(&new.container_name).unwrap().as_ref(), Some(new));
}

#[test]
fn failure_at_each_step_keeps_the_old_record_and_cleans_up() {
    let old = record("t1", TaskStatus::Pending);
    let new = TaskRecord {
        status: TaskStatus::Terminated,
        termination_reason: Some(TerminationReason::TerminatedByUser),
        termination_message: "x".repeat(10_000),
        ..old.clone()
    };
    for step in STEPS {
        let (_home, store, paths) = store_with(&old);
        store.faults.arm(step, FaultKind::Fail);
        assert_injected(&store, step, &store.write(&new).unwrap_err());
        // At `SyncDir` the rename happened: the new record is in place (not yet known durable).
        let expected = if step == Step::SyncDir { &new } else { &old };
        let got = store.read(&old.container_name).unwrap().unwrap();
        assert_eq!(&got, expected, "{step:?}");
        // No temp file is left behind after a reported failure.
        assert_eq!(files_in(&paths.dir), ["runner", "task.json"], "{step:?}");
        assert_next_write_goes_through(&store, &new);
    }
}

#[test]
fn crash_at_each_step_leaves_old_or_new() {
    let old = record("t1", TaskStatus::Running);
    let new = TaskRecord {
        status: TaskStatus::Terminated,
        termination_reason: Some(TerminationReason::DoneByRunner),
        container_id: Some("c".repeat(64)),
        ..old.clone()
    };
    for step in STEPS {
        let (home, store, paths) = store_with(&old);
        store.faults.arm(step, FaultKind::Crash);
        store.write(&new).unwrap_err();
        assert!(store.faults.crashed(), "{step:?} not reached");
        drop(store);
        let before = files_in(&paths.dir);
        let leaves_temp = matches!(step, Step::Write | Step::SyncFile | Step::Rename);
        let has_temp = before.iter().any(|f| is_temp(f));
        assert_eq!(has_temp, leaves_temp, "{step:?}: {before:?}");

        // The shim restarts (in this process: the temp file is still "its own"; a restarted
        // process removes it, see `scan_removes_only_other_processes_temp_files`).
        let store = Store::open(home.path()).unwrap();
        let entries = store.scan().unwrap();
        let [ScanEntry::Record { record: got, .. }] = &entries[..] else {
            panic!("{step:?}: {entries:?}");
        };
        let expected = if step == Step::SyncDir { &new } else { &old };
        assert_eq!(got, expected, "{step:?}");
        assert_next_write_goes_through(&store, &new);
    }
}

#[test]
fn scan_removes_only_other_processes_temp_files() {
    let r = record("t1", TaskStatus::Pending);
    let (_home, store, paths) = store_with(&r);
    store.faults.arm(Step::Rename, FaultKind::Crash);
    store.write(&r).unwrap_err();
    let mut own = files_in(&paths.dir);
    own.retain(|f| is_temp(f));
    assert_eq!(own.len(), 1, "{own:?}");
    // What a process killed mid-write left (its pid and start time in the name).
    fs_err::write(paths.dir.join(".task.json.tmp-1-0.0"), b"{").unwrap();
    // This process (a write possibly in flight) keeps its own temp file; the other one goes.
    store.scan().unwrap();
    let left = files_in(&paths.dir);
    assert_eq!(left, [own[0].as_str(), "runner", "task.json"]);
    assert_eq!(store.read(&r.container_name).unwrap().unwrap(), r);
}

/// `Store::create` (a submit's first write) that fails at any step of the state file's write
/// leaves no state file, even after the rename (a failed submit must not come back as a task
/// at the next start-up): a spare that fails before it is renamed into place leaves nothing
/// under the task's name, one whose commit (the runners directory's fsync) fails leaves a
/// skeleton; that goes with `remove_skeleton`, and the next create works.
#[test]
fn a_failed_create_leaves_no_state_file() {
    for step in [Step::Write, Step::SyncFile, Step::Rename, Step::SyncDir] {
        let home = tempfile::tempdir().unwrap();
        let store = Store::open(home.path()).unwrap();
        assert_eq!(store.prepare_spares().unwrap(), crate::SPARES);
        let r = record("t1", TaskStatus::Pending);
        store.faults.arm(step, FaultKind::Fail);
        assert_injected(&store, step, &store.create(&r).unwrap_err());
        let dir = home.path().join("runners").join(&r.container_name);
        if step == Step::SyncDir {
            assert_eq!(files_in(&dir), ["runner"], "{step:?}");
            assert!(store.remove_skeleton(&r.container_name).unwrap());
        } else {
            assert!(!dir.exists(), "{step:?}");
            assert!(!store.remove_skeleton(&r.container_name).unwrap());
        }
        assert!(!dir.exists());
        assert_create_works(&store, &r);
        let again = store.create(&r);
        let exists = matches!(again, Err(crate::StoreError::TaskExists { .. }));
        assert!(exists, "{step:?}: {again:?}");
    }
}

/// A create over a skeleton (a submit cut short before its first write) writes into it; one
/// that fails at any step of that write leaves the skeleton and no state file.
#[test]
fn a_create_over_a_skeleton_reuses_it_and_a_failed_one_leaves_no_state_file() {
    for step in STEPS {
        let home = tempfile::tempdir().unwrap();
        let store = Store::open(home.path()).unwrap();
        let r = record("t1", TaskStatus::Pending);
        store.create_task_dir(&r.container_name).unwrap();
        store.faults.arm(step, FaultKind::Fail);
        assert_injected(&store, step, &store.create(&r).unwrap_err());
        let dir = home.path().join("runners").join(&r.container_name);
        assert_eq!(files_in(&dir), ["runner"], "{step:?}");
        assert_create_works(&store, &r);
    }
}

/// Spares are made ahead and used by creates (one is made on the spot when none is ready);
/// those an earlier process left are removed at open, and none is ever scanned as a task.
#[test]
fn spares_are_used_by_creates_and_removed_at_open() {
    let home = tempfile::tempdir().unwrap();
    let runners = home.path().join("runners");
    let spares = |dir: &Path| {
        files_in(dir)
            .into_iter()
            .filter(|n| n.starts_with(crate::SPARE_PREFIX))
            .count()
    };
    {
        let store = Store::open(home.path()).unwrap();
        let r = record("t1", TaskStatus::Pending);
        store.create(&r).unwrap();
        assert_eq!(spares(&runners), 0);
        assert_eq!(store.prepare_spares().unwrap(), crate::SPARES);
        assert_eq!(store.prepare_spares().unwrap(), 0);
        let mut r2 = record("t2", TaskStatus::Pending);
        r2.container_name = "job-89abcdef".into();
        store.create(&r2).unwrap();
        assert_eq!(store.spares_ready(), crate::SPARES - 1);
        assert_eq!(spares(&runners), crate::SPARES - 1);
        let names: Vec<_> = store
            .scan()
            .unwrap()
            .into_iter()
            .map(|e| match e {
                ScanEntry::Record { record, .. } => record.container_name,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(names, ["job-0123abcd", "job-89abcdef"]);
        // Each create: one runners commit; each fsync alone here.
        let commits = store.runners_commits();
        assert_eq!((commits.callers, commits.fsyncs), (2, 2));
    }
    let store = Store::open(home.path()).unwrap();
    assert_eq!(spares(&runners), 0);
    assert_eq!(store.scan().unwrap().len(), 2);
}

/// Spares removed behind a store (a second `Store::open` on the home, by a tool that reads
/// it, removes them) cost a create nothing: it makes its directory instead. Each such create
/// used to fail, as many as there were spares.
#[test]
fn a_create_whose_spare_was_removed_behind_the_store_succeeds() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path()).unwrap();
    assert_eq!(store.prepare_spares().unwrap(), crate::SPARES);
    let reader = Store::open(home.path()).unwrap();
    assert!(reader.scan().unwrap().is_empty());
    for i in 0..crate::SPARES + 1 {
        let mut r = record(&format!("t{i}"), TaskStatus::Pending);
        r.container_name = format!("job-{i:08x}");
        store.create(&r).unwrap();
    }
    assert_eq!(reader.scan().unwrap().len(), crate::SPARES + 1);
}

/// A delete whose rename is not made durable (the runners directory's fsync fails) is an
/// error, and leaves the trash for the sweep: after a crash the task could be back, so a
/// remove must not be answered yet (SPEC §5: a rename counts only after its directory is
/// fsynced). The retry finds the name gone and makes the rename durable before its `Ok`.
#[test]
fn a_delete_whose_rename_is_not_durable_fails_and_its_retry_syncs() {
    let r = record("t1", TaskStatus::Terminated);
    let (home, store, _) = store_with(&r);
    let runners = home.path().join("runners");
    store.faults.arm(Step::SyncDir, FaultKind::Fail);
    let err = store.delete(&r.container_name).unwrap_err();
    assert_injected(&store, Step::SyncDir, &err);
    let left = files_in(&runners);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].starts_with(crate::store::TRASH_PREFIX), "{left:?}");
    let before = store.runners_commits().fsyncs;
    store.delete(&r.container_name).unwrap();
    assert_eq!(store.runners_commits().fsyncs, before + 1);
    assert_eq!(store.sweep_trash(), 1);
    assert_eq!(files_in(&runners), Vec::<String>::new());
}
