//! Fault injection: a failure or a crash at each step of an atomic write leaves the old or the
//! new content, never a partial one. (Ported from shim-store's store tests.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use crate::Step::{CreateTemp, Rename, SyncDir, SyncFile, Write};
use crate::fault::{FaultKind, Faults, injected};
use crate::{Dir, FsError, Step, WriteOptions, is_temp_of};

const STEPS: [Step; 5] = [CreateTemp, Write, SyncFile, Rename, SyncDir];

fn names(dir: &Dir) -> Vec<String> {
    let names = dir.names().unwrap().into_iter();
    let mut v: Vec<String> = names.map(|n| n.into_string().unwrap()).collect();
    v.sort();
    v
}

fn read(dir: &Dir, name: &str) -> Vec<u8> {
    dir.read_file(name, 1 << 20).unwrap().unwrap().0
}

/// Writes `data` as `name` atomically, mode 0600, no faults.
fn put(dir: &Dir, name: &str, data: &[u8]) {
    dir.write_atomic(name, data, &WriteOptions::new(0o600))
        .unwrap();
}

/// A directory in a fresh temporary one holding `old` as `state`.
fn holding(old: &[u8]) -> (tempfile::TempDir, Dir) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    put(&dir, "state", old);
    (tmp, dir)
}

fn armed(step: Step, kind: FaultKind) -> (Arc<Faults>, WriteOptions) {
    let f = Arc::new(Faults::new());
    f.arm(step, kind);
    (f.clone(), WriteOptions::new(0o600).faults(f))
}

#[test]
fn failure_at_each_step_keeps_the_old_content_and_cleans_up() {
    for step in STEPS {
        let (old, new) = (b"old content\n".to_vec(), vec![b'n'; 10_000]);
        let (_tmp, dir) = holding(&old);
        let (faults, opts) = armed(step, FaultKind::Fail);
        let err = dir.write_atomic("state", &new, &opts).unwrap_err();
        let inj = injected(&err).unwrap_or_else(|| panic!("{step:?}: {err:?}"));
        assert_eq!((inj.step, err.step()), (step, Some(step)), "{err}");
        let fired = faults.fired();
        assert_eq!(fired, Some((step, FaultKind::Fail)), "{step:?} not reached");
        // At `SyncDir` the rename happened: the new content is in place (not yet known durable).
        let expected = if step == Step::SyncDir { &new } else { &old };
        assert_eq!(&read(&dir, "state"), expected, "{step:?}");
        // No temp file is left behind after a reported failure.
        assert_eq!(names(&dir), ["state"], "{step:?}");
        // And the next write goes through.
        put(&dir, "state", &new);
        assert_eq!(read(&dir, "state"), new);
    }
}

#[test]
fn a_full_file_system_fails_every_write_with_enospc_until_freed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    let faults = Arc::new(Faults::new());
    let opts = WriteOptions::new(0o600).faults(faults.clone());
    dir.write_atomic("state", b"old\n", &opts).unwrap();
    faults.set_full(true);
    for _ in 0..2 {
        let err = dir.write_atomic("state", b"new\n", &opts).unwrap_err();
        assert_eq!(err.step(), Some(Step::Write), "{err}");
        let source =
            std::error::Error::source(&err).and_then(|e| e.downcast_ref::<std::io::Error>());
        let errno = source.and_then(std::io::Error::raw_os_error);
        assert_eq!(errno, Some(28), "ENOSPC: {err:?}");
        let inj = injected(&err);
        assert!(inj.is_none(), "a real error, not an injected one: {inj:?}");
        assert_eq!(read(&dir, "state"), b"old\n");
        assert_eq!(names(&dir), ["state"]);
    }
    assert_eq!(faults.fired(), None, "the armed fault is apart");
    faults.set_full(false);
    dir.write_atomic("state", b"new\n", &opts).unwrap();
    assert_eq!(read(&dir, "state"), b"new\n");
}

#[test]
fn crash_at_each_step_leaves_old_or_new_and_a_recognisable_temp() {
    for step in STEPS {
        let (old, new) = (vec![b'o'; 5000], vec![b'n'; 8000]);
        let (_tmp, dir) = holding(&old);
        let (faults, opts) = armed(step, FaultKind::Crash);
        dir.write_atomic("state", &new, &opts).unwrap_err();
        assert_eq!(faults.fired(), Some((step, FaultKind::Crash)), "{step:?}");

        let expected = if step == Step::SyncDir { &new } else { &old };
        assert_eq!(&read(&dir, "state"), expected, "{step:?}");
        let leftovers: Vec<String> = names(&dir).into_iter().filter(|n| n != "state").collect();
        let leaves_temp = matches!(step, Step::Write | Step::SyncFile | Step::Rename);
        let has_temp = !leftovers.is_empty();
        assert_eq!(has_temp, leaves_temp, "{step:?}: {leftovers:?}");
        for l in &leftovers {
            assert!(is_temp_of("state", l), "{step:?}: {l}");
            if step == Step::Write {
                // Half the bytes: a torn write, which nobody may read as the state.
                assert_eq!(read(&dir, l).len(), new.len() / 2);
            }
        }
        // This process's own temp files are never taken for stale ones (a write may be in
        // flight); another process's are (tests/kill.rs).
        assert_eq!(dir.remove_stale_temps("state").unwrap(), 0);
    }
}

#[test]
fn writer_callback_failure_removes_the_temp_and_returns_its_error() {
    #[derive(Debug)]
    enum MyError {
        Fs(FsError),
        Mine(&'static str),
    }
    impl From<FsError> for MyError {
        fn from(e: FsError) -> Self {
            Self::Fs(e)
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    let opts = WriteOptions::new(0o755);
    dir.write_atomic("bin", b"v1", &opts).unwrap();
    let r: Result<(), MyError> = dir.write_atomic_with("bin", &opts, |f| {
        f.write_all(b"partial download")?;
        assert_eq!(f.written(), 16);
        Err(MyError::Mine("connection reset"))
    });
    assert!(matches!(r, Err(MyError::Mine("connection reset"))), "{r:?}");
    assert_eq!(read(&dir, "bin"), b"v1");
    assert_eq!(names(&dir), ["bin"]);
    // A fault inside the callback's steps comes back as the callback's error type.
    let (_, failing) = armed(Step::SyncFile, FaultKind::Fail);
    let r: Result<(), MyError> =
        dir.write_atomic_with("bin", &failing, |f| Ok(f.write_all(b"v2")?));
    let at_sync = matches!(r, Err(MyError::Fs(ref e)) if e.step() == Some(SyncFile));
    assert!(at_sync, "{r:?}");
    assert_eq!(names(&dir), ["bin"]);
    let r: Result<(), MyError> = dir.write_atomic_with("bin", &opts, |f| Ok(f.write_all(b"v2")?));
    r.unwrap();
    assert_eq!(read(&dir, "bin"), b"v2");
}

#[test]
fn create_new_is_first_write_wins_and_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    let opts = WriteOptions::new(0o644);
    // A failure at the link step leaves neither the file nor a temp file.
    let (faults, failing) = armed(Step::Link, FaultKind::Fail);
    assert!(dir.create_new_atomic("info", b"first", &failing).is_err());
    assert_eq!(faults.fired(), Some((Step::Link, FaultKind::Fail)));
    assert!(names(&dir).is_empty());
    assert!(dir.create_new_atomic("info", b"first", &opts).unwrap());
    assert!(!dir.create_new_atomic("info", b"second", &opts).unwrap());
    assert_eq!(read(&dir, "info"), b"first");
    assert_eq!(names(&dir), ["info"]);
}

#[test]
fn names_must_be_one_component() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    for bad in ["", ".", "..", "a/b", "../x", "a\0b"] {
        let write = dir.write_atomic(bad, b"x", &WriteOptions::default());
        let invalid = matches!(write, Err(FsError::InvalidName { .. }));
        assert!(invalid, "{bad:?}: {write:?}");
        let read = dir.read_file(bad, 10);
        let invalid = matches!(read, Err(FsError::InvalidName { .. }));
        assert!(invalid, "{bad:?}: {read:?}");
    }
    assert!(names(&dir).is_empty());
}
