//! Container labels and the owner identity that scopes which containers are ours.

use std::path::Path;

use sha2::{Digest, Sha256};

/// Marks a container as a shim task.
pub const LABEL_TASK: &str = "ai.dstack.shim.task";
/// The task id.
pub const LABEL_TASK_ID: &str = "ai.dstack.shim.task-id";
/// The owner identity (derived from the shim home).
pub const LABEL_OWNER: &str = "ai.dstack.shim.owner";
/// The task's GPU ids, comma-separated (how GPUs are recovered for any vendor, fake included).
pub const LABEL_GPUS: &str = "ai.dstack.shim.gpus";

/// The owner identity of a shim home: the first 16 hex chars of the SHA-256 of its absolute
/// path. Two shims with different homes on one daemon never adopt each other's containers.
pub fn owner_identity(home: &Path) -> String {
    let abs = std::path::absolute(home).unwrap_or_else(|_| home.to_path_buf());
    let digest = Sha256::digest(abs.as_os_str().as_encoded_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The label set every container of this shim carries (the list filter).
pub fn owner_labels(owner: &str) -> Vec<(String, String)> {
    vec![
        (LABEL_TASK.to_owned(), "true".to_owned()),
        (LABEL_OWNER.to_owned(), owner.to_owned()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_depends_on_home() {
        let a = owner_identity(Path::new("/a/home"));
        let b = owner_identity(Path::new("/b/home"));
        assert_ne!(a, b);
        assert_eq!(a.len(), 16);
        assert_eq!(a, owner_identity(Path::new("/a/home")));
    }
}
