//! The temporary paths of the DCGM parts (the private host engine's socket directory; the
//! exporter's collectors file when there is no state directory) live in the system's temporary
//! directory, named `dstack-dcgm-…` ([`PREFIX`]); a shutdown removes them. With a state
//! directory ([`crate::DcgmConfig::state_dir`]), the host engine's is also recorded there
//! (`nv-hostengine.scratch`), and the next start removes what a shim killed without its
//! shutdown left, so that a host whose shim is killed now and then does not gather them.

use std::path::{Path, PathBuf};

/// The prefix of every temporary path of this crate.
pub(crate) const PREFIX: &str = "dstack-dcgm-";

/// The record of `child`'s temporary path in `state_dir`.
fn record_path(state_dir: &Path, child: &str) -> PathBuf {
    state_dir.join(format!("{child}.scratch"))
}

/// Removes the temporary path recorded for `child` by an earlier start, if it is still
/// there: only a path directly in the temporary directory named with [`PREFIX`] (a link is
/// removed, not followed). Errors are logged.
pub(crate) fn sweep(state_dir: Option<&Path>, child: &str) {
    let Some(state_dir) = state_dir else {
        return;
    };
    let record = record_path(state_dir, child);
    let Ok(recorded) = fs_err::read_to_string(&record) else {
        return;
    };
    let path = Path::new(recorded.trim_end_matches('\n'));
    let ours = path.parent() == Some(std::env::temp_dir().as_path())
        && path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(PREFIX));
    if !ours {
        tracing::warn!(record = %record.display(), path = %path.display(), "a recorded temporary path that is not this shim's: left alone");
        return;
    }
    let removed = match fs_err::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs_err::remove_dir_all(path),
        Ok(_) => fs_err::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    match removed {
        Ok(()) => tracing::debug!(path = %path.display(), "removed what an earlier start left"),
        Err(e) => tracing::warn!(error = %e, "cannot remove what an earlier start left"),
    }
}

/// Records `path` as `child`'s temporary path (logged when it cannot).
pub(crate) fn record(state_dir: Option<&Path>, child: &str, path: &Path) {
    let Some(state_dir) = state_dir else {
        return;
    };
    let mut line = path.as_os_str().as_encoded_bytes().to_vec();
    line.push(b'\n');
    if let Err(e) = fs_err::write(record_path(state_dir, child), line) {
        tracing::warn!(error = %e, "cannot record a temporary path");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a start left in the temporary directory is removed by the next one; a recorded
    /// path elsewhere, or without the prefix, is left alone.
    #[test]
    fn what_a_killed_start_left_is_removed_at_the_next() {
        let state = tempfile::tempdir().unwrap();
        let state = Some(state.path());
        let left = tempfile::Builder::new().prefix(PREFIX).tempdir().unwrap();
        fs_err::write(left.path().join("nv-hostengine.pid"), b"1").unwrap();
        let left = left.keep();
        record(state, "nv-hostengine", &left);
        let file = tempfile::Builder::new().prefix(PREFIX).tempfile().unwrap();
        let (_, file) = file.keep().unwrap();
        record(state, "dcgm-exporter", &file);
        sweep(state, "nv-hostengine");
        sweep(state, "dcgm-exporter");
        assert!(!left.exists() && !file.exists());
        sweep(state, "nv-hostengine"); // gone already: nothing to do

        let elsewhere = tempfile::tempdir().unwrap();
        let kept = elsewhere.path().join(format!("{PREFIX}x"));
        fs_err::write(&kept, b"x").unwrap();
        record(state, "dcgm-exporter", &kept);
        sweep(state, "dcgm-exporter");
        let unprefixed = tempfile::NamedTempFile::new().unwrap();
        record(state, "nv-hostengine", unprefixed.path());
        sweep(state, "nv-hostengine");
        assert!(kept.exists() && unprefixed.path().exists());
    }
}
