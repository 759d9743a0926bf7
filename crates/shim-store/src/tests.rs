//! Unit tests with fault injection: a failure or a crash at each step of a durable write leaves
//! the old or the new record, never a partial one.

use std::path::Path;

use shim_task::{TaskConfig, TaskId, TaskName, TaskRecord, TaskStatus, TerminationReason};

use crate::store::{Fault, FaultKind, Step};
use crate::{ScanEntry, Store};

const STEPS: [Step; 5] = [
    Step::CreateTemp,
    Step::Write,
    Step::SyncFile,
    Step::Rename,
    Step::SyncDir,
];

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

fn arm(store: &Store, at: Step, kind: FaultKind) {
    *store.fault.lock().unwrap() = Some(Fault { at, kind });
}

#[test]
fn failure_at_each_step_keeps_the_old_record_and_cleans_up() {
    for step in STEPS {
        let home = tempfile::tempdir().unwrap();
        let store = Store::open(home.path()).unwrap();
        let old = record("t1", TaskStatus::Pending);
        let paths = store.create_task_dir(&old.container_name).unwrap();
        store.write(&old).unwrap();

        let mut new = old.clone();
        new.status = TaskStatus::Terminated;
        new.termination_reason = Some(TerminationReason::TerminatedByUser);
        new.termination_message = "x".repeat(10_000);
        arm(&store, step, FaultKind::Fail);
        let err = store.write(&new).unwrap_err();
        assert!(format!("{err:?}").contains("Injected"), "{step:?}: {err:?}");
        assert!(
            store.fault.lock().unwrap().is_none(),
            "{step:?} not reached"
        );

        let got = store.read(&old.container_name).unwrap().unwrap();
        if step == Step::SyncDir {
            // The rename happened: the new record is in place (not yet known durable).
            assert_eq!(got, new, "{step:?}");
        } else {
            assert_eq!(got, old, "{step:?}");
        }
        // No temp file is left behind after a reported failure.
        assert_eq!(files_in(&paths.dir), ["runner", "task.json"], "{step:?}");
        // And the next write goes through.
        store.write(&new).unwrap();
        assert_eq!(store.read(&old.container_name).unwrap().unwrap(), new);
    }
}

#[test]
fn crash_at_each_step_leaves_old_or_new_and_scan_cleans_up() {
    for step in STEPS {
        let home = tempfile::tempdir().unwrap();
        let old = record("t1", TaskStatus::Running);
        let mut new = old.clone();
        new.status = TaskStatus::Terminated;
        new.termination_reason = Some(TerminationReason::DoneByRunner);
        new.container_id = "c".repeat(64);
        let paths = {
            let store = Store::open(home.path()).unwrap();
            let paths = store.create_task_dir(&old.container_name).unwrap();
            store.write(&old).unwrap();
            arm(&store, step, FaultKind::Crash);
            store.write(&new).unwrap_err();
            assert!(
                store.fault.lock().unwrap().is_none(),
                "{step:?} not reached"
            );
            paths
        };
        let before = files_in(&paths.dir);
        let leaves_temp = matches!(step, Step::Write | Step::SyncFile | Step::Rename);
        assert_eq!(
            before.iter().any(|f| f.starts_with(".task.json.tmp-")),
            leaves_temp,
            "{step:?}: {before:?}"
        );

        // The shim restarts.
        let store = Store::open(home.path()).unwrap();
        let entries = store.scan().unwrap();
        assert_eq!(entries.len(), 1, "{step:?}");
        let ScanEntry::Record { record: got, .. } = &entries[0] else {
            panic!("{step:?}: {:?}", entries[0]);
        };
        let expected = if step == Step::SyncDir { &new } else { &old };
        assert_eq!(got, expected, "{step:?}");
        assert_eq!(files_in(&paths.dir), ["runner", "task.json"], "{step:?}");
    }
}

#[test]
fn scan_keeps_its_own_temp_files() {
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path()).unwrap();
    let r = record("t1", TaskStatus::Pending);
    let paths = store.create_task_dir(&r.container_name).unwrap();
    store.write(&r).unwrap();
    arm(&store, Step::Rename, FaultKind::Crash);
    store.write(&r).unwrap_err();
    // Same store (same process, a write possibly in flight): its temp file is not touched.
    store.scan().unwrap();
    assert_eq!(files_in(&paths.dir).len(), 3);
    // Another store (a restarted shim) removes it.
    Store::open(home.path()).unwrap().scan().unwrap();
    assert_eq!(files_in(&paths.dir), ["runner", "task.json"]);
}
