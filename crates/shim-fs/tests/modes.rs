//! Modes do not depend on the process umask, and an existing file's mode survives a replace
//! that asks to preserve it. (Its own test binary: the umask is per process. Ported from
//! shim-store's tests/modes.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use nix::sys::stat::{Mode, umask};
use shim_fs::{Dir, FileKind, WriteOptions};

fn mode(p: &Path) -> u32 {
    fs_err::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

fn chmod(p: &Path, mode: u32) {
    fs_err::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn modes_are_exact_whatever_the_umask() {
    for mask in [0o000, 0o022, 0o077, 0o277] {
        umask(Mode::from_bits_truncate(mask));
        let tmp = tempfile::tempdir().unwrap();
        let d = Dir::open(tmp.path()).unwrap();
        let check = |name: &str, m: u32| {
            assert_eq!(mode(&tmp.path().join(name)), m, "umask {mask:o}, {name}");
        };
        for (name, m) in [("a", 0o600), ("b", 0o644), ("c", 0o755), ("d", 0o777)] {
            d.write_atomic(name, b"x", &WriteOptions::new(m)).unwrap();
            check(name, m);
        }
        let script = WriteOptions::new(0o755);
        d.write_atomic_with("e", &script, |f| f.write_all(b"#!"))
            .unwrap();
        check("e", 0o755);
        let opts = WriteOptions::new(0o644);
        assert!(d.create_new_atomic("f", b"x", &opts).unwrap());
        check("f", 0o644);
        let (sub, created) = d.create_dir("sub", 0o700, None).unwrap();
        check("sub", 0o700);
        assert_eq!(sub.info().unwrap().kind, FileKind::Directory);
        let (_, wide) = d.create_dir("wide", 0o777, None).unwrap();
        check("wide", 0o777);
        // The unsynced variant makes the same directory, and finds it the second time.
        let (_, lazy) = d.create_dir_unsynced("lazy", 0o755, None).unwrap();
        check("lazy", 0o755);
        let (_, again) = d.create_dir_unsynced("lazy", 0o755, None).unwrap();
        let created = (created, wide, lazy, again);
        assert_eq!(created, (true, true, true, false), "umask {mask:o}");
    }
    umask(Mode::from_bits_truncate(0o022));
}

#[test]
fn replace_sets_or_preserves_the_mode() {
    umask(Mode::from_bits_truncate(0o022));
    let tmp = tempfile::tempdir().unwrap();
    let d = Dir::open(tmp.path()).unwrap();
    let opts = WriteOptions::new(0o600);
    let preserve = opts.clone().preserve_existing();
    let p = tmp.path().join("f");
    d.write_atomic("f", b"1", &opts).unwrap();
    chmod(&p, 0o640);
    // Preserve: the existing file's mode wins over the one given for creation.
    d.write_atomic("f", b"2", &preserve).unwrap();
    assert_eq!(mode(&p), 0o640);
    // Without preserve, the given mode is set: a loose mode is tightened.
    chmod(&p, 0o666);
    d.write_atomic("f", b"3", &opts).unwrap();
    assert_eq!(mode(&p), 0o600);
    // Preserve on a missing file: the given mode.
    let preserve = WriteOptions::new(0o604).preserve_existing();
    d.write_atomic("g", b"1", &preserve).unwrap();
    assert_eq!(mode(&tmp.path().join("g")), 0o604);
    // An existing directory is left as it is by create_dir.
    fs_err::create_dir(tmp.path().join("sub")).unwrap();
    chmod(&tmp.path().join("sub"), 0o751);
    let (sub, created) = d.create_dir("sub", 0o700, None).unwrap();
    assert!(!created);
    assert_eq!(mode(&tmp.path().join("sub")), 0o751);
    // set_mode tightens it, on the handle: a link swapped in at its path is not followed.
    sub.set_mode(0o700).unwrap();
    assert_eq!(mode(&tmp.path().join("sub")), 0o700);
    assert_eq!(sub.info().unwrap().mode, 0o700);
    fs_err::rename(tmp.path().join("sub"), tmp.path().join("moved")).unwrap();
    fs_err::create_dir(tmp.path().join("other")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("other"), tmp.path().join("sub")).unwrap();
    sub.set_mode(0o750).unwrap();
    assert_eq!(mode(&tmp.path().join("moved")), 0o750);
    let other = mode(&tmp.path().join("other"));
    assert_eq!(other, 0o755, "umask 022, untouched");
}
