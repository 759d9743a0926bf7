//! Reading a binary's version: `<binary> --version` (output `... version X`), with a timeout,
//! and the key under which an answer stays valid.

use std::path::Path;
use std::time::Duration;

use crate::Error;

/// Extracts `X` from `... version X ...` (the first line that has it).
pub fn parse_version(output: &str) -> Option<String> {
    output.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w.eq_ignore_ascii_case("version") {
                return words.next().map(str::to_owned);
            }
        }
        None
    })
}

/// Runs `<path> --version` (killed after `timeout`) and parses its output.
pub async fn binary_version(path: &Path, timeout: Duration) -> Result<String, Error> {
    let verr = |why: String| Error::Version {
        path: path.to_path_buf(),
        why,
    };
    let child = tokio::process::Command::new(path)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(timeout, child)
        .await
        .map_err(|_| verr(format!("no answer within {timeout:?}")))?
        .map_err(|e| verr(format!("cannot run it: {e}")))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(verr(format!("{}: {}", out.status, stderr.trim())));
    }
    parse_version(&stdout)
        .or_else(|| parse_version(&stderr))
        .ok_or_else(|| verr(format!("unexpected output {:?}", stdout.trim())))
}

/// Identifies one version of a file on disk (device, inode, size, mtime): a binary does not
/// change its version without changing its file, so a `--version` answer is cached under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileKey {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileKey {
    pub(crate) fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(
            parse_version("dstack-runner version 1.2.3\n").as_deref(),
            Some("1.2.3")
        );
        assert_eq!(
            parse_version("banner\ndstack-shim version 0.19.1 (abc)\n").as_deref(),
            Some("0.19.1")
        );
        assert_eq!(parse_version("no version here?").as_deref(), Some("here?"));
        assert_eq!(parse_version("1.2.3"), None);
        assert_eq!(parse_version("dstack-runner version"), None);
    }
}
