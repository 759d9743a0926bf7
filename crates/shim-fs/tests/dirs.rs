//! Directory handles against real files: symbolic links are never followed, a directory
//! swapped for a link after it was opened redirects nothing, bounded reads refuse what is not
//! a small regular file; owners (as root).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // test helpers

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _, symlink};
use std::path::Path;
use std::time::{Duration, Instant};

use shim_fs::{Dir, FileKind, FsError, Owner, Step, WriteOptions};

use shim_util::testing::require_root;

fn names(p: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs_err::read_dir(p)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// What a refused object is (`WrongType`'s `found`); fails on any other result.
fn found<T: std::fmt::Debug>(r: Result<T, FsError>) -> &'static str {
    match r {
        Err(FsError::WrongType { found, .. }) => found,
        other => panic!("not refused for its type: {other:?}"),
    }
}

#[test]
fn a_link_where_a_directory_is_expected_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real");
    fs_err::create_dir(&real).unwrap();
    symlink(&real, tmp.path().join("link")).unwrap();
    fs_err::write(tmp.path().join("file"), "x").unwrap();

    let link = Dir::open_nofollow(tmp.path().join("link"));
    let step = link.as_ref().err().and_then(FsError::step);
    let refused = (step, found(link));
    assert_eq!(refused, (Some(Step::OpenDir), "a symbolic link"));
    let file = Dir::open_nofollow(tmp.path().join("file"));
    assert_eq!(found(file), "a regular file");
    // The trusted form follows it.
    let followed = Dir::open(tmp.path().join("link")).unwrap();
    assert_eq!(followed.info().unwrap().kind, FileKind::Directory);

    let top = Dir::open_nofollow(tmp.path()).unwrap();
    assert_eq!(found(top.open_dir("link")), "a symbolic link");
    assert!(top.open_dir("missing").unwrap().is_none());
    // create_dir on a link neither follows it nor replaces it.
    let synced = top.create_dir("link", 0o700, None);
    assert_eq!(found(synced), "a symbolic link");
    let unsynced = top.create_dir_unsynced("link", 0o700, None);
    assert_eq!(found(unsynced), "a symbolic link");
    assert!(names(&real).is_empty());
    let link = fs_err::symlink_metadata(tmp.path().join("link")).unwrap();
    assert!(link.file_type().is_symlink());
}

#[test]
fn a_directory_swapped_for_a_link_after_open_redirects_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let ssh = tmp.path().join(".ssh");
    let elsewhere = tmp.path().join("elsewhere");
    fs_err::create_dir(&ssh).unwrap();
    fs_err::create_dir(&elsewhere).unwrap();
    fs_err::write(ssh.join("keys"), "mine\n").unwrap();
    let d = Dir::open_nofollow(&ssh).unwrap();
    // The swap: the real directory moves away, a link to another one takes its name.
    fs_err::rename(&ssh, tmp.path().join("moved")).unwrap();
    symlink(&elsewhere, &ssh).unwrap();

    assert_eq!(d.read_file("keys", 100).unwrap().unwrap().0, b"mine\n");
    let opts = WriteOptions::new(0o600);
    let preserve = opts.clone().preserve_existing();
    d.write_atomic("keys", b"new\n", &preserve).unwrap();
    d.write_atomic("keys.bak", b"mine\n", &opts).unwrap();
    let through = names(&elsewhere);
    assert!(through.is_empty(), "written through the link: {through:?}");
    let moved = fs_err::read_to_string(tmp.path().join("moved/keys")).unwrap();
    assert_eq!(moved, "new\n");
    assert_eq!(names(&tmp.path().join("moved")), ["keys", "keys.bak"]);
}

// A task's runner directory is the container's to write, and it goes with the task
// (`Store::delete`, and the trash sweep at every start). Whatever is in it, the removal
// follows no link (a link's target outside the tree stays whole) and takes neither more stack
// nor more open files with the tree's depth: a chain of directories nested 5,000 deep (one
// `mkdir d && cd d` loop in a container) is removed on a thread with a 256 KiB stack. Removed
// recursively, one call per level, it overflowed the stack and aborted the shim, at every
// start after (the sweep found the same tree). A name the removal uses for the deep parts it
// moves up (`.deep-0`) already in the tree is kept clear of.
#[test]
fn a_tree_of_any_depth_is_removed_without_following_links() {
    const DEPTH: usize = 5_000;
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    fs_err::create_dir(&outside).unwrap();
    fs_err::write(outside.join("keep"), "keep me\n").unwrap();
    let top = Dir::open_nofollow(tmp.path()).unwrap();
    let (tree, _) = top.create_dir_unsynced("tree", 0o755, None).unwrap();
    let opts = WriteOptions::new(0o600);
    tree.write_atomic(".deep-0", b"x", &opts).unwrap();
    symlink(&outside, tmp.path().join("tree/link")).unwrap();
    let mut level = tree;
    for depth in 0..DEPTH {
        if depth % 7 == 0 {
            level.write_atomic("file", b"x", &opts).unwrap();
        }
        // Links by path, so where the path is short enough to name.
        if depth % 7 == 0 && depth < 5 * shim_fs::REMOVE_DEPTH {
            symlink(outside.join("keep"), level.join("to-keep")).unwrap();
        }
        level = level.create_dir_unsynced("d", 0o755, None).unwrap().0;
    }
    drop(level);
    const { assert!(DEPTH > 50 * shim_fs::REMOVE_DEPTH) };

    let removal = std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || top.remove_tree("tree"))
        .unwrap();
    assert!(removal.join().unwrap().unwrap());
    assert_eq!(names(tmp.path()), ["outside"]);
    assert_eq!(names(&outside), ["keep"]);
    let kept = fs_err::read_to_string(outside.join("keep")).unwrap();
    assert_eq!(kept, "keep me\n");
}

#[test]
fn a_link_at_the_target_is_replaced_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("victim");
    fs_err::write(&victim, "keep me\n").unwrap();
    let dir = tmp.path().join("d");
    fs_err::create_dir(&dir).unwrap();
    symlink(&victim, dir.join("target")).unwrap();
    let d = Dir::open(&dir).unwrap();
    // Reading through it is refused.
    assert_eq!(found(d.read_file("target", 100)), "a symbolic link");
    // Preserve takes nothing from a link (its target's mode is not ours to copy).
    fs_err::set_permissions(&victim, std::fs::Permissions::from_mode(0o666)).unwrap();
    let preserve = WriteOptions::new(0o600).preserve_existing();
    d.write_atomic("target", b"new\n", &preserve).unwrap();
    assert_eq!(fs_err::read_to_string(&victim).unwrap(), "keep me\n");
    let meta = fs_err::symlink_metadata(dir.join("target")).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    // The path form does the same.
    symlink(&victim, dir.join("other")).unwrap();
    shim_fs::write_atomic(dir.join("other"), b"x", &WriteOptions::default()).unwrap();
    assert_eq!(fs_err::read_to_string(&victim).unwrap(), "keep me\n");
}

#[test]
fn bounded_reads_refuse_what_is_not_a_small_regular_file() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Dir::open(tmp.path()).unwrap();
    fs_err::write(tmp.path().join("ten"), "0123456789").unwrap();
    assert_eq!(d.read_file("ten", 10).unwrap().unwrap().0, b"0123456789");
    let (_, info) = d.read_file("ten", 10).unwrap().unwrap();
    assert_eq!((info.kind, info.len), (FileKind::Regular, 10));
    let nine = d.read_file("ten", 9);
    let too_large = matches!(nine, Err(FsError::TooLarge { max: 9, .. }));
    assert!(too_large, "{nine:?}");
    assert!(d.read_file("missing", 10).unwrap().is_none());
    fs_err::create_dir(tmp.path().join("dir")).unwrap();
    assert_eq!(found(d.read_file("dir", 10)), "a directory");
    // A FIFO: refused at once, never waited on.
    nix::unistd::mkfifo(&tmp.path().join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
    let start = Instant::now();
    assert_eq!(found(d.read_file("fifo", 10)), "a named pipe");
    assert!(start.elapsed() < Duration::from_secs(2));
    // The path form.
    let (ten, _) = shim_fs::read_file(tmp.path().join("ten"), 100)
        .unwrap()
        .unwrap();
    assert_eq!(ten, b"0123456789");
    // A missing directory is an error naming it.
    let e = Dir::open(tmp.path().join("nope")).unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert!(e.to_string().contains("nope"), "{e}");
}

#[test]
#[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn owners_are_set_and_preserved_as_root() {
    require_root();
    let root = nix::unistd::geteuid().is_root();
    assert!(root, "SHIM_TEST_ROOT=1 needs root");
    let tmp = tempfile::tempdir().unwrap();
    let d = Dir::open(tmp.path()).unwrap();
    let carol = Owner::new(54321, 54322);
    let owner = |p: &Path| {
        let m = fs_err::symlink_metadata(p).unwrap();
        (m.uid(), m.gid(), m.permissions().mode() & 0o7777)
    };
    let (sub, created) = d.create_dir(".ssh", 0o700, Some(carol)).unwrap();
    assert!(created);
    assert_eq!(owner(&tmp.path().join(".ssh")), (54321, 54322, 0o700));
    let opts = WriteOptions::new(0o600).owner(carol);
    sub.write_atomic("keys", b"k\n", &opts).unwrap();
    let keys = tmp.path().join(".ssh/keys");
    assert_eq!(owner(&keys), (54321, 54322, 0o600));
    // Preserve keeps the existing owner and mode even when another owner is given.
    use nix::unistd::{Gid, Uid, chown};
    chown(&keys, Some(Uid::from_raw(4242)), Some(Gid::from_raw(4343))).unwrap();
    fs_err::set_permissions(&keys, std::fs::Permissions::from_mode(0o640)).unwrap();
    sub.write_atomic("keys", b"k2\n", &opts.preserve_existing())
        .unwrap();
    assert_eq!(owner(&keys), (4242, 4343, 0o640));
    // A set-id bit survives the chown that precedes the chmod.
    let setuid = WriteOptions::new(0o4755).owner(carol);
    d.write_atomic("tool", b"#!", &setuid).unwrap();
    assert_eq!(owner(&tmp.path().join("tool")), (54321, 54322, 0o4755));
}
