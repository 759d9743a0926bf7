//! Where the dev environment keeps its state and logs. A leaf module (it uses no other module
//! of xtask), so `devenv`, `docker` and `registry` can all use it without depending on each
//! other.

use std::path::PathBuf;

/// State of the dev environment: the registry's config, auth and storage, temporary build dirs.
pub fn state_dir() -> PathBuf {
    PathBuf::from("/var/lib/dstack-shim-dev")
}

/// Scratch space of one dev-env run (image roots, throwaway Docker client configs); emptied at
/// the start of every run, under the dev-env lock.
pub fn tmp_dir() -> PathBuf {
    state_dir().join("tmp")
}

/// Logs of the daemons dev-env starts (`dockerd.log`, `registry.log`).
pub fn log_dir() -> PathBuf {
    PathBuf::from("/var/log/dstack-shim-dev")
}
