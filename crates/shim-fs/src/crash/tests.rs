//! The recorder and the crash-state builder on this crate's own writes: the model's rules on
//! small logs, an atomic write that leaves the old or the new content in every state, and the
//! left-out steps that the states catch.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use super::{Bug, Fate, Limits, Log, Node, Op, Recorder, Tree, explore};
use crate::{Dir, WriteOptions};

fn recording(root: &Path) -> (Arc<Recorder>, Dir) {
    let recorder = Recorder::start(root).unwrap();
    let dir = Dir::open(root).unwrap().with_recorder(recorder.clone());
    (recorder, dir)
}

/// A state built: its crash point, tree and the fates of the operations pending there.
type Built = (usize, Tree, Vec<(usize, Fate)>);

/// Every state of `log`.
fn states(log: &Log) -> Vec<Built> {
    let mut out = Vec::new();
    explore(log, &Limits::default(), |s| {
        out.push((s.point, s.tree.clone(), s.fates.clone()));
        ControlFlow::Continue(())
    });
    out
}

fn file<'t>(tree: &'t Tree, path: &str) -> Option<&'t [u8]> {
    match tree.lookup(path) {
        Some(Node::File { data, .. }) => Some(data),
        _ => None,
    }
}

/// The trees of the states at the end of `log` (every operation done, some not durable).
fn at_end(log: &Log) -> Vec<Tree> {
    let end = log.ops.len();
    states(log)
        .into_iter()
        .filter(|(p, _, _)| *p == end)
        .map(|(_, t, _)| t)
        .collect()
}

/// How many operations of a log match a pattern (and guard).
macro_rules! count {
    ($ops:expr, $pattern:pat $(if $guard:expr)?) => {
        $ops.iter().filter(|op| matches!(op, $pattern $(if $guard)?)).count()
    };
}

/// Writes `data` as `name` atomically, mode 0600.
fn put(dir: &Dir, name: &str, data: &[u8]) {
    let opts = WriteOptions::new(0o600);
    dir.write_atomic(name, data, &opts).unwrap();
}

/// The recorded tree equals the disk: nothing bypassed the recorder.
fn assert_live_is_disk(log: &Log, root: &Path) {
    assert!(log.problems.is_empty(), "{:?}", log.problems);
    assert_eq!(log.live().listing(), Tree::read(root).unwrap().listing());
}

#[test]
fn an_atomic_write_leaves_the_old_or_the_new_content_in_every_crash_state() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    let (old, new) = (vec![b'o'; 3000], vec![b'n'; 5000]);
    put(&dir, "state", &old);
    let (recorder, dir) = recording(tmp.path());
    put(&dir, "state", &new);
    let log = recorder.log();
    // create, chmod, write, fsync, rename, fsync of the directory.
    let six = matches!(
        &log.ops[..],
        [
            Op::Create { .. },
            Op::SetMode { .. },
            Op::Write { .. },
            Op::Fsync { .. },
            Op::Rename { .. },
            Op::FsyncDir { .. }
        ]
    );
    assert!(six, "{:?}", log.ops);
    assert_live_is_disk(&log, tmp.path());

    let all = states(&log);
    let mut saw_new = false;
    for (point, tree, fates) in &all {
        let got = file(tree, "state").unwrap();
        assert!(got == old || got == new, "point {point}: {fates:?}");
        saw_new |= got == new;
        if *point == log.ops.len() {
            // Acknowledged: durable.
            assert_eq!(got, new);
        }
    }
    assert!(saw_new);
    // Before the rename, the temp file may hold nothing, half or all of the bytes.
    let temp_lengths: std::collections::BTreeSet<usize> = all
        .iter()
        .filter(|(p, _, _)| *p == 3)
        .filter_map(|(_, tree, _)| {
            let Some(Node::Dir { entries, .. }) = tree.nodes.get(&tree.root) else {
                return None;
            };
            let temp = entries.keys().find(|n| *n != "state")?;
            file(tree, temp.to_str()?).map(<[u8]>::len)
        })
        .collect();
    assert_eq!(temp_lengths, [0, 2500, 5000].into());
}

#[test]
fn the_model_keeps_an_entry_until_its_directory_is_fsynced_and_data_until_its_file_is() {
    let tmp = tempfile::tempdir().unwrap();
    let (recorder, dir) = recording(tmp.path());
    dir.create_dir_unsynced("a", 0o700, None).unwrap();
    let log = recorder.log();
    // mkdir, chmod: at the end, "a" may or may not be there.
    let there = |log: &Log| -> Vec<bool> {
        let ends = at_end(log);
        ends.iter().map(|t| t.lookup("a").is_some()).collect()
    };
    assert_eq!(there(&log), [true, false]);
    dir.sync().unwrap();
    let log = recorder.log();
    assert_eq!(there(&log), [true]);
    assert_live_is_disk(&log, tmp.path());
}

#[test]
fn a_write_left_unsynced_is_kept_dropped_or_torn_and_a_missing_fsync_is_caught() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    put(&dir, "state", b"old!");
    let (recorder, dir) = recording(tmp.path());
    recorder.inject(Bug::SkipFileFsync);
    put(&dir, "state", b"new-content");
    let log = recorder.log();
    assert_eq!(count!(log.ops, Op::Fsync { .. }), 0);
    let ends = at_end(&log);
    let contents: std::collections::BTreeSet<&[u8]> =
        ends.iter().map(|t| file(t, "state").unwrap()).collect();
    // The rename is durable, the data is not: empty, half, whole.
    assert_eq!(contents, [&b""[..], b"new-c", b"new-content"].into());
}

#[test]
fn a_missing_directory_fsync_loses_an_acknowledged_write() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = Dir::open(tmp.path()).unwrap();
    put(&dir, "state", b"old");
    for bug in [Bug::SkipPublishDirFsync, Bug::SkipDirFsync] {
        let (recorder, dir) = recording(tmp.path());
        recorder.inject(bug);
        put(&dir, "state", b"new");
        let log = recorder.log();
        let lost = (at_end(&log).iter()).any(|t| file(t, "state") == Some(b"old"));
        assert!(lost, "{bug:?}");
        put(&dir, "state", b"old");
    }
}

#[test]
fn create_new_links_then_unlinks_the_temp() {
    let tmp = tempfile::tempdir().unwrap();
    let (recorder, dir) = recording(tmp.path());
    let opts = WriteOptions::new(0o644);
    assert!(dir.create_new_atomic("id", b"first", &opts).unwrap());
    assert!(!dir.create_new_atomic("id", b"second", &opts).unwrap());
    let log = recorder.log();
    // The refused link is not recorded; both temp files are removed.
    let links = (
        count!(log.ops, Op::Link { .. }),
        count!(log.ops, Op::Unlink { .. }),
    );
    assert_eq!(links, (1, 2), "{:?}", log.ops);
    assert_live_is_disk(&log, tmp.path());
    for (point, tree, fates) in states(&log) {
        let got = file(&tree, "id");
        assert!(got.is_none() || got == Some(b"first"), "{point}: {fates:?}");
    }
}

#[test]
fn moves_and_removals_on_handles_are_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Dir::open(tmp.path()).unwrap();
    let (pre, _) = root.create_dir("pre", 0o755, None).unwrap();
    put(&pre, "f", b"x");
    // A hard link in the snapshot, and a symbolic link.
    rustix::fs::linkat(&pre, "f", &pre, "g", rustix::fs::AtFlags::empty()).unwrap();
    rustix::fs::symlinkat("f", &pre, "l").unwrap();
    let (recorder, root) = recording(tmp.path());
    let (a, _) = root.create_dir("a", 0o700, None).unwrap();
    let (b, _) = a.create_dir_unsynced("b", 0o755, None).unwrap();
    put(&b, "x", b"1");
    let o640 = WriteOptions::new(0o640);
    b.write_atomic("y", b"2", &o640).unwrap();
    b.rename("x", &root, "moved").unwrap();
    a.set_mode(0o750).unwrap();
    assert!(root.remove_tree("pre").unwrap());
    assert!(!root.remove_tree("pre").unwrap());
    a.rename("b", &a, "c").unwrap();
    assert!(root.remove_file("moved").unwrap());
    let (d, _) = root.create_dir("d", 0o700, None).unwrap();
    drop(d);
    assert!(root.remove_dir("d").unwrap());
    assert!(!root.remove_dir("d").unwrap());
    let log = recorder.log();
    assert_live_is_disk(&log, tmp.path());
    let pre_removed = count!(log.ops, Op::Rmdir { name, .. } if name == "pre");
    assert!(pre_removed > 0, "{:?}", log.ops);
}

#[test]
fn a_tree_materialises_as_it_was_read() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Dir::open(tmp.path()).unwrap();
    let (a, _) = root.create_dir("a", 0o750, None).unwrap();
    let o640 = WriteOptions::new(0o640);
    a.write_atomic("f", b"data", &o640).unwrap();
    rustix::fs::linkat(&a, "f", &root, "hard", rustix::fs::AtFlags::empty()).unwrap();
    rustix::fs::symlinkat("a/f", &root, "soft").unwrap();
    let tree = Tree::read(tmp.path()).unwrap();
    let out = tempfile::tempdir().unwrap();
    tree.materialise(out.path()).unwrap();
    let back = Tree::read(out.path()).unwrap();
    assert_eq!(back.listing(), tree.listing());
    assert_eq!(back.digest(), tree.digest());
    let st = rustix::fs::stat(out.path().join("hard")).unwrap();
    assert_eq!(st.st_nlink, 2, "a hard link stays one");
}

#[test]
fn concurrent_writers_are_recorded_in_the_order_their_calls_took_effect() {
    let tmp = tempfile::tempdir().unwrap();
    let (recorder, root) = recording(tmp.path());
    std::thread::scope(|s| {
        for t in 0..4 {
            let root = &root;
            s.spawn(move || {
                let (d, _) = root.create_dir(format!("t{t}"), 0o700, None).unwrap();
                for i in 0..5 {
                    put(&d, "state", format!("{t}-{i}").as_bytes());
                }
            });
        }
    });
    let log = recorder.log();
    assert_live_is_disk(&log, tmp.path());
    // 4 × (mkdir, chmod, fsync of the root, 5 × 6 operations).
    assert_eq!(log.ops.len(), 4 * (3 + 5 * 6));
}

#[test]
fn a_large_log_is_sampled_within_the_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let (recorder, root) = recording(tmp.path());
    // Twelve unsynced directories: 4096 combinations at the end.
    for i in 0..12 {
        root.create_dir_unsynced(format!("d{i}"), 0o700, None)
            .unwrap();
    }
    let log = recorder.log();
    let limits = Limits {
        exhaustive: 64,
        sampled: 40,
        seed: 1,
    };
    let mut at_end = 0;
    let stats = explore(&log, &limits, |s| {
        if s.point == log.ops.len() {
            at_end += 1;
        }
        ControlFlow::Continue(())
    });
    assert_eq!(stats.points, log.ops.len() + 1);
    assert_eq!(stats.max_pending, 12);
    let both = stats.sampled_points > 0 && stats.exhaustive_points > 0;
    assert!(both, "{stats}");
    assert_eq!(at_end, 40);
    // The same seed builds the same states.
    let again = explore(&log, &limits, |_| ControlFlow::Continue(()));
    assert_eq!(again, stats);
}

/// A prepared directory published, then its parent fsynced: in every crash state the
/// directory under its name holds its subdirectory and the whole file, or it is not there;
/// published on a parent that already has the name, it is refused and leaves nothing.
#[test]
fn a_published_prepared_directory_is_whole_or_absent_in_every_crash_state() {
    let tmp = tempfile::tempdir().unwrap();
    let (recorder, dir) = recording(tmp.path());
    let data = vec![b'r'; 900];
    let prepared = dir
        .prepare_dir(".spare-1", 0o700, &[("runner", 0o755)], "task.json", 0o600)
        .unwrap();
    let published = prepared
        .publish(&dir, "job-1", &data, &WriteOptions::new(0o600))
        .unwrap();
    assert_eq!(published.path(), tmp.path().join("job-1"));
    let group = crate::GroupSync::new();
    group.sync(&dir).unwrap();
    let log = recorder.log();
    assert_live_is_disk(&log, tmp.path());
    // One file fsync and one fsync of the parent after the preparation's own.
    let published_at = (log.ops.iter()).position(|op| matches!(op, Op::Write { .. }));
    let after = &log.ops[published_at.unwrap()..];
    let syncs = count!(after, Op::Fsync { .. } | Op::FsyncDir { .. });
    assert_eq!(syncs, 2, "{:?}", log.ops);
    let mut whole = 0;
    for (point, tree, fates) in states(&log) {
        let at = format!("point {point}: {fates:?}");
        match tree.lookup("job-1") {
            None => assert!(point < log.ops.len(), "durable at the end: {at}"),
            Some(Node::Dir { .. }) => {
                assert_eq!(file(&tree, "job-1/task.json"), Some(&data[..]), "{at}");
                let runner = tree.lookup("job-1/runner");
                assert!(matches!(runner, Some(Node::Dir { .. })), "{at}");
                whole += 1;
            }
            Some(other) => panic!("{at}: {other:?}"),
        }
    }
    assert!(whole > 0);

    let taken = dir
        .prepare_dir(".spare-2", 0o700, &[], "task.json", 0o600)
        .unwrap();
    let err = taken
        .publish(&dir, "job-1", b"other", &WriteOptions::new(0o600))
        .unwrap_err();
    let kind = err.io_kind();
    assert_eq!(kind, Some(std::io::ErrorKind::AlreadyExists), "{err}");
    assert!(dir.stat(".spare-2").unwrap().is_none());
    let kept = fs_err::read(tmp.path().join("job-1/task.json")).unwrap();
    assert_eq!(kept, data);
}

/// Concurrent callers share one fsync of the directory; alone, each call runs its own.
#[test]
fn a_group_commit_shares_one_fsync_among_concurrent_callers() {
    let tmp = tempfile::tempdir().unwrap();
    let (recorder, dir) = recording(tmp.path());
    let group = crate::GroupSync::new();
    group.sync(&dir).unwrap();
    group.sync(&dir).unwrap();
    assert_eq!(group.stats().fsyncs, 2);
    group.gather_next(4, std::time::Duration::from_secs(30));
    std::thread::scope(|s| {
        for i in 0..4 {
            let (dir, group) = (&dir, &group);
            s.spawn(move || {
                fs_err::write(dir.join(format!("f{i}")), b"x").unwrap();
                group.sync(dir).unwrap();
            });
        }
    });
    let stats = group.stats();
    assert_eq!((stats.callers, stats.fsyncs), (6, 3), "{stats:?}");
    assert_eq!(count!(recorder.log().ops, Op::FsyncDir { .. }), 3);
}
