//! Modes do not depend on the process umask. (Its own test binary: the umask is per process.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers

mod common;

use std::os::unix::fs::PermissionsExt as _;

use common::{create_with_record, mode};
use nix::sys::stat::{Mode, umask};
use shim_store::Store;

#[test]
fn modes_are_exact_whatever_the_umask() {
    for mask in [0o000, 0o022, 0o077, 0o277] {
        umask(Mode::from_bits_truncate(mask));
        let home = tempfile::tempdir().unwrap();
        let store = Store::open(home.path()).unwrap();
        let p = create_with_record(&store, &common::record("t1"));
        assert_eq!(mode(store.runners_dir()), 0o755, "umask {mask:o}");
        assert_eq!(mode(&p.dir), 0o700, "umask {mask:o}");
        assert_eq!(mode(&p.runner_dir), 0o755, "umask {mask:o}");
        assert_eq!(mode(&p.state_file), 0o600, "umask {mask:o}");
    }
    umask(Mode::from_bits_truncate(0o022));
}

#[test]
fn loose_modes_are_tightened() {
    umask(Mode::from_bits_truncate(0o022));
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path()).unwrap();
    let r = common::record("t1");
    let p = create_with_record(&store, &r);
    for (path, m) in [
        (store.runners_dir(), 0o777),
        (p.dir.as_path(), 0o755),
        (p.state_file.as_path(), 0o644),
    ] {
        fs_err::set_permissions(path, std::fs::Permissions::from_mode(m)).unwrap();
    }
    let store = Store::open(home.path()).unwrap();
    assert_eq!(mode(store.runners_dir()), 0o755);
    store.write(&r).unwrap();
    assert_eq!(mode(&p.state_file), 0o600);
}
