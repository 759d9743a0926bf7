//! The file side of replacing the running shim in place (the binary does the process side):
//! whether the binary at the shim's path differs from the running one, a binary's digest,
//! putting the running binary back over the path (the rollback), and the record of a
//! rolled-back upgrade kept in the shim's home.
//!
//! The known-good binary is the *running* one, read through `/proc/self/exe` (the kernel
//! keeps the running image's inode readable after an install renamed a new file over its
//! path). No copy of the old binary is kept beside the new one: a copy made at install time
//! could be a binary that never ran (two installs in a row), while the running image is
//! proven to start.

pub mod policy;

use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::ComponentsError;

/// The running executable's image (Linux).
pub const RUNNING_EXE: &str = "/proc/self/exe";

/// The record of a rolled-back upgrade, in the shim's home.
pub const ROLLBACK_RECORD: &str = "upgrade-rollback.json";

/// How long a binary whose start failed is refused without being started again (the dstack
/// server installs it again at each instance check while the shim reports `error`).
pub const REFUSE_FOR: Duration = Duration::from_secs(3600);

const CHUNK: usize = 1 << 20;

/// Whether the file at `path` differs from the running executable, byte for byte (same
/// inode, or same bytes: no upgrade). `Ok(false)` when there is no file at `path`.
/// Blocking: run it on the blocking pool.
pub fn differs_from_running(path: &Path) -> Result<bool, ComponentsError> {
    match same_content(path, Path::new(RUNNING_EXE)) {
        Ok(same) => Ok(!same),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(ComponentsError::Io {
            op: "compare with the running binary",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Whether `a` and `b` hold the same bytes (true at once for one inode, false at once for
/// different sizes).
pub fn same_content(a: &Path, b: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt as _;
    // The open files' metadata, not the paths': under qemu-user, a stat of `/proc/self/exe`
    // describes the emulator, while an open of it is the program itself.
    let (mut fa, mut fb) = (fs_err::File::open(a)?, fs_err::File::open(b)?);
    let (ma, mb) = (fa.metadata()?, fb.metadata()?);
    if (ma.dev(), ma.ino()) == (mb.dev(), mb.ino()) {
        return Ok(true);
    }
    if ma.len() != mb.len() {
        return Ok(false);
    }
    let (mut ba, mut bb) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
    loop {
        let na = read_full(&mut fa, &mut ba)?;
        let nb = read_full(&mut fb, &mut bb)?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

/// Reads until `buf` is full or the file ends; the bytes read.
fn read_full(file: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// The SHA-256 of the file at `path`, in lower-case hex. Blocking.
pub fn digest(path: &Path) -> Result<String, ComponentsError> {
    let io_err = |source| ComponentsError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    };
    let mut file = fs_err::File::open(path).map_err(io_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = read_full(&mut file, &mut buf).map_err(io_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// `bytes` in lower-case hex (a SHA-256 as the rollback record keeps it).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Puts the running executable's bytes over `target` (mode 0755), atomically
/// (`shim_fs::write_atomic_with`): the rollback of an upgrade whose binary did not start.
/// Blocking.
pub fn restore_running(target: &Path) -> Result<(), ComponentsError> {
    restore_from(Path::new(RUNNING_EXE), target)
}

/// Copies `source` over `target` (mode 0755), atomically. Blocking.
pub fn restore_from(source: &Path, target: &Path) -> Result<(), ComponentsError> {
    let mut from = fs_err::File::open(source).map_err(|e| ComponentsError::Io {
        op: "open",
        path: source.to_path_buf(),
        source: e,
    })?;
    shim_fs::write_atomic_with(target, &shim_fs::WriteOptions::new(0o755), |file| {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = read_full(&mut from, &mut buf).map_err(|e| ComponentsError::Io {
                op: "read",
                path: source.to_path_buf(),
                source: e,
            })?;
            if n == 0 {
                return Ok(());
            }
            file.write_all(&buf[..n])?;
        }
    })
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What the shim keeps in its home about an upgrade that was rolled back: the next shim
/// (the restored binary, started again by systemd) reports `dstack-shim` as `error`, and a
/// new shutdown does not start the same binary again for [`REFUSE_FOR`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackRecord {
    /// The version the refused binary reported (empty if it reported none).
    pub failed_version: String,
    /// Its SHA-256 (hex).
    pub failed_sha256: String,
    /// Why it was rolled back.
    pub reason: String,
    /// The version of the binary put back (the one that was running).
    pub restored_version: String,
    /// When the binary first failed (seconds since the Unix epoch).
    pub at_unix: u64,
}

impl RollbackRecord {
    /// The record of a binary (`failed_version`, `failed_sha256`) refused or rolled back now
    /// for `reason`, `restored_version` running again in its place.
    pub fn now(
        failed_version: &str,
        failed_sha256: &str,
        reason: &str,
        restored_version: &str,
    ) -> Self {
        Self {
            failed_version: failed_version.to_owned(),
            failed_sha256: failed_sha256.to_owned(),
            reason: reason.to_owned(),
            restored_version: restored_version.to_owned(),
            at_unix: unix_now(),
        }
    }

    /// The record's path in `home`.
    pub fn path(home: &Path) -> PathBuf {
        home.join(ROLLBACK_RECORD)
    }

    /// The record in `home`, if any. Blocking.
    pub fn read(home: &Path) -> Result<Option<Self>, ComponentsError> {
        let path = Self::path(home);
        let Some((bytes, _)) = shim_fs::read_file(&path, 64 * 1024)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| ComponentsError::Record { path, source })
    }

    /// Writes the record into `home` (atomically, 0600). Blocking.
    pub fn write(&self, home: &Path) -> Result<(), ComponentsError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|source| ComponentsError::Record {
            path: Self::path(home),
            source,
        })?;
        shim_fs::write_atomic(Self::path(home), &bytes, &shim_fs::WriteOptions::new(0o600))?;
        Ok(())
    }

    /// Removes the record from `home` (nothing if there is none). Blocking.
    pub fn remove(home: &Path) -> Result<(), ComponentsError> {
        let path = Self::path(home);
        match fs_err::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(ComponentsError::Io {
                op: "remove",
                path,
                source: e,
            }),
            _ => Ok(()),
        }
    }

    /// Whether a binary with digest `sha256` is refused at `now` (seconds since the epoch):
    /// it is the binary that failed, less than [`REFUSE_FOR`] ago. A failure recorded later
    /// than `now` by more than that (the clock was ahead then and set right since) refuses
    /// nothing: it would have refused for as long as the clock was wrong.
    pub fn refuses(&self, sha256: &str, now: u64) -> bool {
        self.failed_sha256 == sha256 && now.abs_diff(self.at_unix) < REFUSE_FOR.as_secs()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: panics are failures

    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn compares_and_restores_real_files() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a"),
            dir.path().join("b"),
            dir.path().join("c"),
        );
        let big: Vec<u8> = (0..(CHUNK * 2 + 17)).map(|i| (i % 251) as u8).collect();
        fs_err::write(&a, &big).unwrap();
        fs_err::write(&b, &big).unwrap();
        let mut other = big.clone();
        *other.last_mut().unwrap() ^= 1;
        fs_err::write(&c, &other).unwrap();
        assert!(same_content(&a, &a).unwrap());
        assert!(same_content(&a, &b).unwrap());
        assert!(
            !same_content(&a, &c).unwrap(),
            "one byte differs at the end"
        );
        fs_err::write(&c, &big[..10]).unwrap();
        assert!(!same_content(&a, &c).unwrap());
        assert_eq!(digest(&a).unwrap(), digest(&b).unwrap());
        assert_ne!(digest(&a).unwrap(), digest(&c).unwrap());
        // printf '' | sha256sum
        let empty = dir.path().join("empty");
        fs_err::write(&empty, b"").unwrap();
        assert_eq!(
            digest(&empty).unwrap(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );

        // A missing path is no upgrade; this test binary is its own running image.
        assert!(!differs_from_running(&dir.path().join("none")).unwrap());
        assert!(differs_from_running(&a).unwrap());
        let me = std::env::current_exe().unwrap();
        assert!(!differs_from_running(&me).unwrap());

        // Rollback: the running image's bytes over the path, 0755, nothing left beside it.
        restore_running(&c).unwrap();
        assert!(!differs_from_running(&c).unwrap());
        assert!(same_content(&c, &me).unwrap());
        let mode = fs_err::metadata(&c).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        let mut names: Vec<String> = fs_err::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["a", "b", "c", "empty"]);
    }

    #[test]
    fn records_round_trip_and_refuse_for_a_while() {
        let home = tempfile::tempdir().unwrap();
        assert_eq!(RollbackRecord::read(home.path()).unwrap(), None);
        RollbackRecord::remove(home.path()).unwrap();
        let record = RollbackRecord {
            failed_version: "0.22.6+rust.0.1.0".into(),
            failed_sha256: "ab".repeat(32),
            reason: "it exited (exit status: 1) before it answered".into(),
            restored_version: "0.22.5+rust.0.1.0".into(),
            at_unix: 1_000,
        };
        record.write(home.path()).unwrap();
        let path = RollbackRecord::path(home.path());
        let mode = fs_err::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(
            RollbackRecord::read(home.path()).unwrap(),
            Some(record.clone())
        );
        assert!(record.refuses(&"ab".repeat(32), 1_000 + 3_599));
        assert!(!record.refuses(&"ab".repeat(32), 1_000 + 3_600), "expired");
        assert!(!record.refuses(&"cd".repeat(32), 1_001), "another binary");
        assert!(
            record.refuses(&"ab".repeat(32), 999),
            "the clock a moment back"
        );
        let ahead = RollbackRecord {
            at_unix: 1_000 + 86_400,
            ..record.clone()
        };
        assert!(
            !ahead.refuses(&"ab".repeat(32), 1_000),
            "recorded by a clock a day ahead, set right since"
        );

        fs_err::write(&path, b"{\"failed_version\":").unwrap();
        let e = RollbackRecord::read(home.path()).unwrap_err();
        assert!(matches!(e, ComponentsError::Record { .. }), "{e}");
        RollbackRecord::remove(home.path()).unwrap();
        assert!(!path.exists());
    }
}
