//! Tests on real mounts (ignored; `SHIM_TEST_ROOT=1` and `--run-ignored all` run them): a full
//! filesystem, an undeletable directory.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers

mod common;

use std::io::Write as _;

use common::{Tmpfs, create_with_record, names, record, temp_store, umount};
use shim_store::{ScanEntry, Store, StoreError};
use shim_task::{TaskStatus, TerminationReason};
use shim_util::testing::require_root;

/// Fills the filesystem holding `path` with a file there until it is full; returns its size.
fn fill(path: &std::path::Path) -> u64 {
    let mut f = fs_err::File::create(path).unwrap();
    let chunk = vec![0xaa_u8; 4096];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    written
}

fn is_enospc(err: &StoreError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::StorageFull
        {
            return true;
        }
        source = e.source();
    }
    false
}

#[test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_full_filesystem_fails_the_write_and_keeps_the_old_record() {
    require_root();
    let tmp = tempfile::tempdir().unwrap();
    let mnt = Tmpfs::mount(&tmp.path().join("fs"), "1m");
    let store = Store::open(mnt.dir.join("home")).unwrap();
    let old = record("t1");
    let paths = create_with_record(&store, &old);
    let new = shim_task::TaskRecord {
        status: TaskStatus::Terminated,
        termination_reason: Some(TerminationReason::TerminatedByUser),
        // Far larger than what will be free: the write fails part-way through.
        termination_message: "m".repeat(256 * 1024),
        ..old.clone()
    };

    let filler = mnt.dir.join("filler");
    let size = fill(&filler);
    assert!(size > 0);

    // Completely full.
    let err = store.write(&new).unwrap_err();
    assert!(is_enospc(&err), "{err:?}");
    assert_eq!(store.read(&old.container_name).unwrap().unwrap(), old);
    assert_eq!(names(&paths.dir), ["runner", "task.json"]);

    // Some room, not enough: the temp file gets part of the record, then ENOSPC.
    fs_err::OpenOptions::new()
        .write(true)
        .open(&filler)
        .unwrap()
        .set_len(size - 64 * 1024)
        .unwrap();
    let err = store.write(&new).unwrap_err();
    assert!(is_enospc(&err), "{err:?}");
    assert_eq!(store.read(&old.container_name).unwrap().unwrap(), old);
    let left = names(&paths.dir);
    assert_eq!(left, ["runner", "task.json"], "temp file removed");
    // Scan agrees.
    let entries = Store::open(mnt.dir.join("home")).unwrap().scan().unwrap();
    assert!(matches!(&entries[..], [ScanEntry::Record { record: r, .. }] if *r == old));

    // Space is back: the same write succeeds.
    fs_err::remove_file(&filler).unwrap();
    store.write(&new).unwrap();
    assert_eq!(store.read(&old.container_name).unwrap().unwrap(), new);
    drop(store);
}

#[test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn an_undeletable_task_dir_goes_to_the_trash() {
    require_root();
    let (_home, store) = temp_store();
    let r = record("t1");
    let paths = create_with_record(&store, &r);
    // A mount point inside the runner dir cannot be removed (EBUSY) while mounted.
    let inner = Tmpfs::mount(&paths.runner_dir.join("busy"), "64k");
    std::mem::forget(inner); // unmounted by hand below, at its new path.

    store.delete(&r.container_name).unwrap();
    assert!(!paths.dir.exists(), "the task is gone from its place");
    assert!(store.read(&r.container_name).unwrap().is_none());
    let trash: Vec<String> = names(store.runners_dir());
    assert_eq!(trash.len(), 1, "{trash:?}");
    assert!(trash[0].starts_with(".trash-job-t1-"), "{trash:?}");
    assert!(store.scan().unwrap().is_empty(), "trash is not a task");
    // The id is free again.
    store.create_task_dir(&r.container_name).unwrap();
    store.delete(&r.container_name).unwrap();

    // Still mounted: sweeping fails, logged, not fatal.
    assert_eq!(store.sweep_trash(), 0);
    let busy = store.runners_dir().join(&trash[0]).join("runner/busy");
    umount(&busy);
    assert_eq!(store.sweep_trash(), 1);
    assert!(names(store.runners_dir()).is_empty());
}
