//! Reading a component's version: `<binary> --version`, whose output must be exactly
//! `<component name> version X` (upstream: runner/internal/shim/components/utils.go,
//! checkDstackComponent), with a timeout, and the key under which an answer stays valid.

use std::path::Path;
use std::time::Duration;

use shim_util::{Command, CommandError, CommandRunner};

use crate::ComponentsError;

/// Extracts `X` from `--version`'s output `<name> version X`: exactly three words, the first
/// the component's name (upstream's checkDstackComponent; a runner binary in the shim's place
/// is not an installed shim).
pub fn parse_version(output: &str, name: &str) -> Option<String> {
    let words: Vec<&str> = output.split_whitespace().collect();
    match words.as_slice() {
        [first, _, version] if *first == name => Some((*version).to_owned()),
        _ => None,
    }
}

/// How many times `--version` is tried again while exec finds the binary busy (50 ms apart).
const TEXT_BUSY_TRIES: u32 = 20;

/// Runs `<path> --version` (killed after `timeout`) through `runner` and parses its standard
/// output as the version of component `name` (see [`parse_version`]). A binary that cannot
/// run, does not finish or fails is [`ComponentsError::VersionRun`]; one that prints anything else than
/// its version is [`ComponentsError::VersionOutput`].
pub async fn binary_version(
    runner: &dyn CommandRunner,
    path: &Path,
    name: &str,
    timeout: Duration,
) -> Result<String, ComponentsError> {
    let version = Command::new(path).arg("--version").timeout(timeout);
    let mut busy_tries = 0;
    let out = loop {
        match runner.run(&version).await {
            // A binary just written: a process forked elsewhere in this one (the runtime's
            // other children) may still hold the temp file's write descriptor until it execs,
            // and exec then fails with ETXTBSY for a moment. Tried again, briefly.
            Err(CommandError::Spawn { source, .. })
                if source.kind() == std::io::ErrorKind::ExecutableFileBusy
                    && busy_tries < TEXT_BUSY_TRIES =>
            {
                busy_tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other,
        }
    };
    let out =
        out.and_then(|out| out.check(&version))
            .map_err(|source| ComponentsError::VersionRun {
                path: path.to_path_buf(),
                source,
            })?;
    parse_version(&out.stdout, name).ok_or_else(|| ComponentsError::VersionOutput {
        path: path.to_path_buf(),
        output: out.stdout.trim().to_owned(),
    })
}

/// Identifies one version of a file on disk (device, inode, size, mtime): a binary does not
/// change its version without changing its file, so a `--version` answer is cached under it,
/// and an upgrade starts the very file it checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileKey {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl FileKey {
    /// The key of the file `meta` describes.
    pub fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: meta.mtime(),
            mtime_nsec: meta.mtime_nsec(),
        }
    }

    /// The key of the file at `path` (following a symbolic link). Blocking.
    pub fn at(path: &std::path::Path) -> std::io::Result<Self> {
        fs_err::metadata(path).map(|m| Self::of(&m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(
            parse_version("dstack-runner version 1.2.3\n", "dstack-runner").as_deref(),
            Some("1.2.3")
        );
        // Anything but exactly `<name> version X` is not a version (upstream's rule).
        assert_eq!(
            parse_version("dstack-runner version 1.2.3\n", "dstack-shim"),
            None
        );
        assert_eq!(
            parse_version("banner\ndstack-shim version 0.19.1\n", "dstack-shim"),
            None
        );
        assert_eq!(
            parse_version("dstack-shim version 0.19.1 (abc)", "dstack-shim"),
            None
        );
        assert_eq!(parse_version("1.2.3", "dstack-shim"), None);
        assert_eq!(
            parse_version("dstack-runner version", "dstack-runner"),
            None
        );
    }

    /// A binary still open for writing somewhere in this process (a write just done, or a
    /// descriptor a forked child holds until it execs) cannot be executed for a moment
    /// (ETXTBSY): `--version` is tried again until it can, so a fresh install does not read
    /// as a binary that does not run. Found by CI: an install's check failed this way.
    #[tokio::test]
    async fn a_binary_busy_for_a_moment_is_asked_again() {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dstack-shim");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o755)
            .open(&path)
            .unwrap();
        file.write_all(b"#!/bin/sh\necho dstack-shim version 1.0\n")
            .unwrap();
        let release = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(file);
        });
        let runner = shim_util::SystemCommandRunner::default();
        let version = binary_version(&runner, &path, "dstack-shim", Duration::from_secs(5)).await;
        release.await.unwrap();
        assert_eq!(version.unwrap(), "1.0");
    }
}
