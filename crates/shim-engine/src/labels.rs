//! Container labels, the owner identity, and the rule that says which containers are this
//! shim's.
//!
//! Every container carries the upstream shim's labels (`ai.dstack.shim.is-task=true`,
//! `ai.dstack.shim.task-id=<id>`; upstream `runner/internal/shim/docker.go`), so the upstream
//! shim adopts it after a switch, plus this shim's owner label and the task's GPU ids.
//!
//! What makes a container this shim's is its runner mount (SPEC §5): a container whose
//! `/tmp/runner` source lies in this home's `runners/` (or the first release's `tasks/`),
//! compared as spelled and after resolving links ([`TaskRoots`]), is ours whatever its labels
//! say. Two shims cannot share a home (the home is locked), so this never claims another
//! shim's task, and a lost or regenerated owner identity, or a container the upstream shim
//! made (no owner label), orphans nothing. The owner label is what this shim stamps on its
//! containers, so a home's containers can be found with one filter (tools, test sweepers)
//! and two shims on one daemon are told apart at a glance; it is never the proof.

use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};
use shim_runtime::MountPoint;

/// Marks a container as a shim task (upstream's label).
pub const LABEL_IS_TASK: &str = "ai.dstack.shim.is-task";
/// The task id (upstream's label).
pub const LABEL_TASK_ID: &str = "ai.dstack.shim.task-id";
/// The owner identity (this shim's: SPEC §5).
pub const LABEL_OWNER: &str = "ai.dstack.shim.owner";
/// The task's GPU ids, comma-separated (how GPUs are recovered for any vendor, fake included).
pub const LABEL_GPUS: &str = "ai.dstack.shim.gpus";
/// The task marker of this shim's first release (before upstream's labels were adopted).
pub const LEGACY_LABEL_TASK: &str = "ai.dstack.shim.task";

/// The owner identity the first release of this shim derived from its home: the first 16 hex
/// chars of the SHA-256 of the home's absolute path as given. Homes made by that release keep
/// it (see `restore::determine_owner`).
pub fn legacy_owner_identity(home: &Path) -> String {
    let abs = std::path::absolute(home).unwrap_or_else(|_| home.to_path_buf());
    hex16(&Sha256::digest(abs.as_os_str().as_encoded_bytes()))
}

/// A fresh owner identity: 16 hex chars that no other shim on the host will draw (the time,
/// the process and the home go into it).
pub fn new_owner_identity(home: &Path) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut h = Sha256::new();
    h.update(nanos.to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update(home.as_os_str().as_encoded_bytes());
    hex16(&h.finalize())
}

fn hex16(digest: &[u8]) -> String {
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The list filter that finds every container of any dstack shim on the daemon (this
/// release's, the first release's and the upstream shim's all carry a task id); [`is_ours`]
/// picks this shim's.
pub fn any_shim_filter() -> Vec<(String, String)> {
    vec![(LABEL_TASK_ID.to_owned(), String::new())]
}

/// The directories whose task directories are this home's: `<home>/runners` (upstream's
/// layout) and `<home>/tasks` (this shim's first release, whose running containers keep
/// that source after the migration), each as the home is spelled (made absolute) and as it
/// resolves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRoots {
    roots: Vec<PathBuf>,
}

/// The task directories' parents under a home.
const ROOT_DIRS: [&str; 2] = ["runners", "tasks"];

impl TaskRoots {
    /// The roots of `home` (reads the file system to resolve the home's links: call it off
    /// the async workers).
    pub fn of_home(home: &Path) -> Self {
        let mut homes = Vec::new();
        if let Ok(abs) = std::path::absolute(home) {
            homes.push(abs);
        }
        if let Ok(resolved) = fs_err::canonicalize(home) {
            homes.push(resolved);
        }
        let mut roots: Vec<PathBuf> = Vec::new();
        for h in &homes {
            for d in ROOT_DIRS {
                let root = h.join(d);
                if !roots.contains(&root) {
                    roots.push(root);
                }
            }
        }
        Self { roots }
    }

    /// Where `source` lies under a root, compared as spelled (no file system access): the
    /// path below the root, `None` when it is not under one. A path with `..` is never
    /// decided here.
    pub fn locate_lexically(&self, source: &Path) -> Option<PathBuf> {
        if !source.is_absolute() || source.components().any(|c| c == Component::ParentDir) {
            return None;
        }
        self.roots.iter().find_map(|root| {
            let rel = source.strip_prefix(root).ok()?;
            (!rel.as_os_str().is_empty()).then(|| rel.to_path_buf())
        })
    }

    /// Where `source` lies under a root, as spelled or after resolving its links (the
    /// deepest part of it that exists is resolved; reads the file system: call it off the
    /// async workers). `None` when it is not under one.
    pub fn locate(&self, source: &Path) -> Option<PathBuf> {
        if let Some(rel) = self.locate_lexically(source) {
            return Some(rel);
        }
        self.locate_lexically(&resolve_existing(source)?)
    }
}

/// `path` with its deepest existing ancestor resolved (links, `.` and `..`), the rest
/// appended as it is; `None` if nothing of it resolves or the rest climbs with `..`.
fn resolve_existing(path: &Path) -> Option<PathBuf> {
    let mut rest = Vec::new();
    let mut current = path;
    loop {
        if let Ok(resolved) = fs_err::canonicalize(current) {
            let mut out = resolved;
            for c in rest.iter().rev() {
                out.push(c);
            }
            return Some(out);
        }
        // A path ending in `..` has no file name: it is not resolved.
        rest.push(current.file_name()?.to_owned());
        current = current.parent()?;
    }
}

/// Whether a container is this shim's: its runner directory mount's source lies in one of the
/// home's task roots (see the module docs). Reads the file system when the source is not
/// under a root as spelled: call it off the async workers, or use
/// [`TaskRoots::locate_lexically`] first.
pub fn is_ours(mounts: &[MountPoint], roots: &TaskRoots) -> bool {
    runner_mount(mounts).is_some_and(|source| roots.locate(Path::new(source)).is_some())
}

/// Whether a container is this shim's as far as can be told without the file system:
/// `Some(true)` when its runner mount lies under a root as spelled, `Some(false)` when it has
/// no runner mount, `None` when only resolving links can tell ([`is_ours`]).
pub fn is_ours_lexically(mounts: &[MountPoint], roots: &TaskRoots) -> Option<bool> {
    match runner_mount(mounts) {
        None => Some(false),
        Some(source) => roots.locate_lexically(Path::new(source)).map(|_| true),
    }
}

/// The host source of a container's runner directory mount.
pub fn runner_mount(mounts: &[MountPoint]) -> Option<&str> {
    mounts
        .iter()
        .find(|m| m.destination == shim_runtime::RUNNER_DIR_IN_CONTAINER)
        .map(|m| m.source.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(source: &str) -> MountPoint {
        MountPoint {
            source: source.into(),
            destination: shim_runtime::RUNNER_DIR_IN_CONTAINER.into(),
            read_write: true,
        }
    }

    #[test]
    fn legacy_identity_depends_on_home() {
        let a = legacy_owner_identity(Path::new("/a/home"));
        assert_ne!(a, legacy_owner_identity(Path::new("/b/home")));
        assert_eq!(a.len(), 16);
        assert_eq!(a, legacy_owner_identity(Path::new("/a/home")));
        assert_ne!(
            new_owner_identity(Path::new("/a")),
            new_owner_identity(Path::new("/a"))
        );
    }

    #[test]
    fn ownership_is_the_runner_mount_whatever_the_labels() {
        let home = tempfile::tempdir().unwrap();
        let roots = TaskRoots::of_home(home.path());
        let runners = home.path().join("runners");
        let ours = [mount(&format!("{}/job-01234567/runner", runners.display()))];
        // Upstream's stateless containers mount the whole task directory; the first release
        // mounted `tasks/<id>/runner`.
        let whole = [mount(&format!("{}/job-01234567", runners.display()))];
        let first = [mount(&format!("{}/tasks/t1/runner", home.path().display()))];
        let elsewhere = tempfile::tempdir().unwrap();
        let theirs = [mount(&format!(
            "{}/runners/job-01234567/runner",
            elsewhere.path().display()
        ))];
        for m in [&ours[..], &whole, &first] {
            assert!(is_ours(m, &roots), "{m:?}");
            assert_eq!(is_ours_lexically(m, &roots), Some(true));
        }
        assert!(!is_ours(&theirs, &roots));
        assert!(!is_ours(&[], &roots));
        assert_eq!(is_ours_lexically(&[], &roots), Some(false));
        // The runners directory itself, or a path that climbs out of it, is not a task's.
        assert!(!is_ours(&[mount(&runners.display().to_string())], &roots));
        let climbing = format!("{}/../../etc", runners.display());
        assert_eq!(is_ours_lexically(&[mount(&climbing)], &roots), None);
        assert!(!is_ours(&[mount(&climbing)], &roots));
    }

    #[test]
    fn ownership_compares_after_resolving_links() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        fs_err::create_dir_all(real.join("runners/job-01234567/runner")).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        // The home spelled through the link: containers made through the real path are ours.
        let through_link = TaskRoots::of_home(&dir.path().join("link"));
        let made = [mount(&format!(
            "{}/runners/job-01234567/runner",
            real.display()
        ))];
        assert!(is_ours(&made, &through_link));
        // The home spelled as it is: containers made through the link are ours too, also
        // when their directory is gone.
        let as_is = TaskRoots::of_home(&real);
        for rel in ["job-01234567/runner", "gone-89abcdef/runner"] {
            let via_link = [mount(&format!(
                "{}/runners/{rel}",
                dir.path().join("link").display()
            ))];
            assert_eq!(is_ours_lexically(&via_link, &as_is), None);
            assert!(is_ours(&via_link, &as_is), "{rel}");
        }
        // Another home, also through a link, is not ours.
        let other = dir.path().join("other");
        fs_err::create_dir_all(other.join("runners")).unwrap();
        let theirs = [mount(&format!(
            "{}/runners/job-01234567/runner",
            other.display()
        ))];
        assert!(!is_ours(&theirs, &as_is));
        assert!(!is_ours(&theirs, &through_link));
    }
}
