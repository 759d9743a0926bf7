//! Container labels, and the owner identity that scopes which containers are this shim's.
//!
//! Every container carries the upstream shim's labels (`ai.dstack.shim.is-task=true`,
//! `ai.dstack.shim.task-id=<id>`; upstream `runner/internal/shim/docker.go`), so the upstream
//! shim adopts it after a switch, plus this shim's owner label and the task's GPU ids. A
//! container is this shim's when its owner label is this shim's identity, or when it has no
//! owner label (made by the upstream shim) and its runner directory lies under this shim's
//! `runners/` directory (the same host and home: the switch the other way).

use std::collections::BTreeMap;
use std::path::Path;

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

/// Whether a container belongs to this shim (see the module docs).
pub fn is_ours(
    labels: &BTreeMap<String, String>,
    mounts: &[MountPoint],
    owner: &str,
    runners_dirs: &[&Path],
) -> bool {
    match labels.get(LABEL_OWNER) {
        Some(o) => o == owner,
        None => {
            labels.get(LABEL_IS_TASK).map(String::as_str) == Some("true")
                && runner_mount(mounts).is_some_and(|source| {
                    runners_dirs
                        .iter()
                        .any(|d| Path::new(source).starts_with(d))
                })
        }
    }
}

/// The host source of a container's runner directory mount.
pub fn runner_mount(mounts: &[MountPoint]) -> Option<&str> {
    mounts
        .iter()
        .find(|m| m.destination == shim_runtime::spec::RUNNER_DIR_IN_CONTAINER)
        .map(|m| m.source.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(source: &str) -> MountPoint {
        MountPoint {
            source: source.into(),
            destination: shim_runtime::spec::RUNNER_DIR_IN_CONTAINER.into(),
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
    fn ownership() {
        let runners = Path::new("/root/.dstack/runners");
        let mut labels = BTreeMap::from([
            (LABEL_IS_TASK.to_owned(), "true".to_owned()),
            (LABEL_TASK_ID.to_owned(), "t".to_owned()),
        ]);
        let ours = [mount("/root/.dstack/runners/job-01234567/runner")];
        let theirs = [mount("/home/x/.dstack/runners/job-01234567")];
        // Upstream's container: ours by its runner directory.
        assert!(is_ours(&labels, &ours, "me", &[runners]));
        assert!(!is_ours(&labels, &theirs, "me", &[runners]));
        assert!(!is_ours(&labels, &[], "me", &[runners]));
        // Another shim's container, even in our home: not ours.
        labels.insert(LABEL_OWNER.to_owned(), "other".to_owned());
        assert!(!is_ours(&labels, &ours, "me", &[runners]));
        labels.insert(LABEL_OWNER.to_owned(), "me".to_owned());
        assert!(is_ours(&labels, &theirs, "me", &[runners]));
    }
}
