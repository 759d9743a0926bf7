//! The container name of a task.

use sha2::{Digest, Sha256};

use crate::ids::{TaskId, TaskName};

/// How many hex characters of the hash end a container name.
pub const NAME_HASH_LEN: usize = 8;

/// The task's container name: `<name>-<first 8 hex chars of sha256("<name>/<id>")>`.
///
/// Two tasks with the same name (the server reuses names across runs) get different container
/// names, and the name is a pure function of the task, so a restarted shim computes the same one.
pub fn container_name(name: &TaskName, id: &TaskId) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::new()
        .chain_update(name.as_str())
        .chain_update("/")
        .chain_update(id.as_str())
        .finalize();
    let mut out = String::with_capacity(name.as_str().len() + 1 + NAME_HASH_LEN);
    out.push_str(name.as_str());
    out.push('-');
    for byte in digest.iter().take(NAME_HASH_LEN / 2) {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    out
}

/// The task name inside a container name made by [`container_name`], if it has that shape
/// (a leading `/`, as Docker reports names, is ignored). Used to adopt containers of an older
/// shim that left no state file.
pub fn task_name_of_container(container_name: &str) -> Option<TaskName> {
    let bare = container_name.strip_prefix('/').unwrap_or(container_name);
    let (name, hash) = bare.rsplit_once('-')?;
    if hash.len() != NAME_HASH_LEN
        || !hash
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    TaskName::new(name).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_is_name_dash_hash() {
        let name = TaskName::new("job").unwrap();
        let id = TaskId::new("t1").unwrap();
        // `printf 'job/t1' | sha256sum` = 4ccd04ef…
        let n = container_name(&name, &id);
        assert_eq!(n, "job-4ccd04ef");
        assert_eq!(
            task_name_of_container(&format!("/{n}")).unwrap().as_str(),
            "job"
        );
        assert_ne!(n, container_name(&name, &TaskId::new("t2").unwrap()));
    }

    #[test]
    fn foreign_names_are_not_task_names() {
        for n in [
            "job",
            "job-xyz",
            "job-0123456789",
            "-01234567",
            "job-0123456G",
        ] {
            assert!(task_name_of_container(n).is_none(), "{n}");
        }
    }
}
