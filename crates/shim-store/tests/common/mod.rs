//! Helpers shared by the integration tests.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr
)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use shim_store::{Store, TaskPaths};
use shim_task::{TaskConfig, TaskId, TaskName, TaskRecord, TaskStatus, TerminationReason};

/// A tmpfs of `size` mounted at `dir`, unmounted on drop.
pub struct Tmpfs {
    /// The mount point.
    pub dir: PathBuf,
}

impl Tmpfs {
    /// Mounts it; fails the test if that fails.
    pub fn mount(dir: &Path, size: &str) -> Self {
        fs_err::create_dir_all(dir).unwrap();
        let options = format!("size={size},mode=0755");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &options, "tmpfs"])
            .arg(dir)
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "SHIM_TEST_ROOT=1 but mounting a tmpfs at {} failed: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self {
            dir: dir.to_owned(),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        umount(&self.dir);
    }
}

/// Unmounts `dir`, reporting (not failing) errors.
pub fn umount(dir: &Path) {
    let out = Command::new("umount").arg(dir).output();
    let out = out.expect("running umount");
    if !out.status.success() {
        let (dir, err) = (dir.display(), String::from_utf8_lossy(&out.stderr));
        eprintln!("umount {dir} failed: {err}");
    }
}

/// A task id.
pub fn id(s: &str) -> TaskId {
    TaskId::new(s).unwrap()
}

/// A fresh `pending` record for task `task`.
pub fn record(task: &str) -> TaskRecord {
    let config = TaskConfig::new(id(task), TaskName::new("job").unwrap(), "shim-test:1");
    TaskRecord::new(&config, format!("job-{task}"), 1_700_000_000_000)
}

/// A store in a fresh temporary directory (the store's home).
pub fn temp_store() -> (tempfile::TempDir, Store) {
    let home = tempfile::tempdir().unwrap();
    let store = Store::open(home.path()).unwrap();
    (home, store)
}

/// Task `r`'s directory and first record, made as a submit makes them.
pub fn create_with_record(store: &Store, r: &TaskRecord) -> TaskPaths {
    let p = store.create_task_dir(&r.container_name).unwrap();
    store.write(r).unwrap();
    p
}

/// A state file, as JSON.
pub fn json(state_file: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs_err::read(state_file).unwrap()).unwrap()
}

/// The permission bits of `p` (not following a link).
pub fn mode(p: &Path) -> u32 {
    fs_err::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

/// Names in a directory, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs_err::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// Every regular file under `dir`, recursively (symlinks not followed).
pub fn all_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs_err::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let t = e.file_type().unwrap();
        if t.is_dir() {
            out.extend(all_files(&e.path()));
        } else if t.is_file() {
            out.push(e.path());
        }
    }
    out
}

/// What reading back must give: the record without registry credentials, and a reason only
/// for a terminated task (upstream's format reads a reason as "terminated"; the state machine
/// never keeps one otherwise).
pub fn stored_form(r: &TaskRecord) -> TaskRecord {
    TaskRecord {
        config: r
            .config
            .as_deref()
            .map(|c| Arc::new(c.without_credentials())),
        termination_reason: (r.status == TaskStatus::Terminated).then(|| {
            r.termination_reason
                .clone()
                .unwrap_or_else(|| TerminationReason::parse(""))
        }),
        ..r.clone()
    }
}
