//! Where the shim keeps a task's files on the host. The one place tests and developer tasks
//! compute these paths: when the shim's layout changes, only this file changes.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::RUNNER_EXIT_FILE;

/// The directory holding one directory per task under the shim home `home` (upstream's
/// layout: `<home>/runners/<container name>/`).
pub fn tasks_dir(home: &Path) -> PathBuf {
    home.join("runners")
}

/// The directory of task `id` under the shim home `home` (its `task.json`, `pull.log`): the
/// one whose `task.json` names the task. A task without one (removed, or never written) gets
/// a path that does not exist.
pub fn task_dir(home: &Path, id: &str) -> PathBuf {
    let dirs = fs_err::read_dir(tasks_dir(home))
        .map(|l| l.flatten().map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default();
    for dir in dirs {
        let Ok(bytes) = fs_err::read(dir.join("task.json")) else {
            continue;
        };
        let Ok(json) = serde_json::from_slice::<Value>(&bytes) else {
            continue;
        };
        if json["id"].as_str() == Some(id) {
            return dir;
        }
    }
    tasks_dir(home).join(format!("no-task-{id}"))
}

/// The prefix of a spare task directory the shim keeps ready in [`tasks_dir`] for its next
/// submits (hidden; not a task's).
pub const SPARE_PREFIX: &str = ".spare-";

/// The names in the tasks directory `dir` ([`entries`]) but the spare task directories the
/// shim keeps ready there: the task directories and what is left of them (trash).
pub fn task_entries(dir: &Path) -> BTreeSet<String> {
    let mut names = entries(dir);
    names.retain(|n| !n.starts_with(SPARE_PREFIX));
    names
}

/// The task's runner directory on the host (mounted at `/tmp/runner` in the container; the
/// stub runner's `--temp-dir`), from the shim home and the task's TaskInfo JSON (which has
/// `id` and `container_name`): `<home>/runners/<container name>/runner`.
pub fn runner_dir(home: &Path, info: &Value) -> PathBuf {
    let name = info["container_name"].as_str().unwrap_or_default();
    tasks_dir(home).join(name).join("runner")
}

/// Makes the stub runner of the task exit with `code`: writes its exit file in
/// [`runner_dir`] (temp file + rename, so the runner never reads a half-written file).
pub fn write_runner_exit(home: &Path, info: &Value, code: i32) -> io::Result<()> {
    let dir = runner_dir(home, info);
    let tmp = dir.join(".exit.tmp");
    let line = format!("{code}\n");
    // One staged by `stage_runner_exit` is only renamed: a rename needs no free block.
    if fs_err::read_to_string(&tmp).ok().as_deref() != Some(line.as_str()) {
        fs_err::write(&tmp, line)?;
    }
    fs_err::rename(&tmp, dir.join(RUNNER_EXIT_FILE))
}

/// Writes the exit [`write_runner_exit`] will make the runner of `info` see (with the same
/// `code`), beside its place, so that making it seen later needs only a rename (no free
/// block: a full disk does not stop it).
pub fn stage_runner_exit(home: &Path, info: &Value, code: i32) -> io::Result<()> {
    fs_err::write(
        runner_dir(home, info).join(".exit.tmp"),
        format!("{code}\n"),
    )
}

/// The names in `dir`, sorted; empty if it does not exist. Panics (failing the test) on any
/// other error.
#[allow(
    clippy::panic,
    reason = "a test helper: an unreadable directory fails the test"
)]
pub fn entries(dir: &Path) -> BTreeSet<String> {
    match fs_err::read_dir(dir) {
        Ok(listing) => listing
            .map(|e| {
                e.map(|e| e.file_name().to_string_lossy().into_owned())
                    .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
            })
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => BTreeSet::new(),
        Err(e) => panic!("{e}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "test code")]
mod tests {
    use super::*;

    #[test]
    fn the_exit_file_lands_in_the_runner_directory() {
        let home = tempfile::tempdir().unwrap();
        let info = serde_json::json!({"id": "t1", "container_name": "t1-0a1b2c3d"});
        let dir = runner_dir(home.path(), &info);
        assert!(dir.starts_with(home.path()));
        fs_err::create_dir_all(&dir).unwrap();
        write_runner_exit(home.path(), &info, 7).unwrap();
        assert_eq!(
            fs_err::read_to_string(dir.join(RUNNER_EXIT_FILE)).unwrap(),
            "7\n"
        );
        assert!(!dir.join(".exit.tmp").exists());
    }

    #[test]
    fn entries_are_sorted_names_and_a_missing_directory_has_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(entries(&dir.path().join("missing")), BTreeSet::new());
        fs_err::write(dir.path().join("b"), "").unwrap();
        fs_err::create_dir(dir.path().join("a")).unwrap();
        assert_eq!(
            entries(dir.path()).into_iter().collect::<Vec<_>>(),
            ["a", "b"]
        );
    }
}
