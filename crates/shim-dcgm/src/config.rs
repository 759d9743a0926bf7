//! [`DcgmConfig`]: the upstream `--dcgm-*` settings plus a few of ours, with upstream's
//! defaults (the binary maps upstream's `--dcgm-*` flags and environment variables onto it).

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Upstream's `--dcgm-exporter-http-port` default.
pub const DEFAULT_EXPORTER_HTTP_PORT: u16 = 10997;
/// Upstream's `--dcgm-exporter-interval` default, in milliseconds.
pub const DEFAULT_EXPORTER_INTERVAL_MS: u64 = 5000;
/// The exporter's executable name, looked up in `PATH` (upstream: `dcgmExporterExecName`).
pub const EXPORTER_PROGRAM: &str = "dcgm-exporter";
/// DCGM's command line client, looked up in `PATH`.
pub const DCGMI_PROGRAM: &str = "dcgmi";
/// DCGM's host engine, looked up in `PATH`.
pub const HOSTENGINE_PROGRAM: &str = "nv-hostengine";

/// How a supervised program is restarted after it exits: the first restart waits `initial`,
/// each further one twice as long up to `max`; a run that lasted `reset_after` or longer
/// starts the sequence again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first delay.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
    /// A run at least this long resets the delay to `initial`.
    pub reset_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
            reset_after: Duration::from_secs(60),
        }
    }
}

/// The DCGM settings of the shim.
///
/// Upstream (`runner/cmd/shim/main.go`) has three: `--dcgm-exporter-http-port`
/// (`DSTACK_DCGM_EXPORTER_HTTP_PORT`, 10997), `--dcgm-exporter-interval`
/// (`DSTACK_DCGM_EXPORTER_INTERVAL`, 5000 ms) and `--dcgm-address` (`DSTACK_DCGM_ADDRESS`,
/// empty). The program paths are ours (upstream only looks `dcgm-exporter` up in `PATH`); the
/// timeouts and the backoff are fixed in upstream and only settable here for tests.
#[derive(Debug, Clone)]
pub struct DcgmConfig {
    /// The exporter listens on `localhost:<port>`.
    pub exporter_http_port: u16,
    /// The exporter's collect interval (`-c <ms>`), also how long a fetched answer is reused.
    pub exporter_interval: Duration,
    /// `nv-hostengine` to ask for health (`dcgmi --host <address>`). Empty or `None`: like
    /// upstream's embedded libdcgm, the shim runs its own host engine when `nv-hostengine` is
    /// found, else `dcgmi` asks the default one (`localhost`).
    pub address: Option<String>,
    /// The exporter binary; `None` looks `dcgm-exporter` up in `PATH`.
    pub exporter_path: Option<PathBuf>,
    /// The `dcgmi` binary; `None` looks it up in `PATH`.
    pub dcgmi_path: Option<PathBuf>,
    /// The `nv-hostengine` binary; `None` looks it up in `PATH`.
    pub hostengine_path: Option<PathBuf>,
    /// Where the private host engine writes `nv-hostengine.log`; `None`: its temporary
    /// directory (removed at shutdown).
    pub log_dir: Option<PathBuf>,
    /// Where the supervised children's pid files live (`dcgm-exporter.pid`,
    /// `nv-hostengine.pid`; the shim passes its home). A child left running by a shim that was
    /// killed without its shutdown (SIGKILL, a crash) is stopped when the next one starts, so
    /// it neither lingers nor keeps the port its successor needs, and the host engine's
    /// temporary directory it left is removed (recorded in `nv-hostengine.scratch`). The
    /// exporter's collectors file lives here too (`dcgm-exporter-counters.csv`). `None`: no
    /// pid files, no records, the collectors file in the temporary directory.
    pub state_dir: Option<PathBuf>,
    /// How long one fetch of the exporter's metrics may take (upstream: 10 s).
    pub fetch_timeout: Duration,
    /// How long one `dcgmi` or `dcgm-exporter -v` run may take.
    pub command_timeout: Duration,
    /// How long a stopping child gets between SIGTERM and SIGKILL (upstream: 5 s).
    pub stop_grace: Duration,
    /// Restart delays of the supervised programs.
    pub backoff: Backoff,
}

impl Default for DcgmConfig {
    fn default() -> Self {
        Self {
            exporter_http_port: DEFAULT_EXPORTER_HTTP_PORT,
            exporter_interval: Duration::from_millis(DEFAULT_EXPORTER_INTERVAL_MS),
            address: None,
            exporter_path: None,
            dcgmi_path: None,
            hostengine_path: None,
            log_dir: None,
            state_dir: None,
            fetch_timeout: Duration::from_secs(10),
            command_timeout: Duration::from_secs(10),
            stop_grace: Duration::from_secs(5),
            backoff: Backoff::default(),
        }
    }
}

impl DcgmConfig {
    /// The host engine address when one was given (empty counts as none, as upstream).
    pub fn address(&self) -> Option<&str> {
        self.address.as_deref().filter(|a| !a.is_empty())
    }

    /// The exporter binary: the configured path if it is an executable file, else
    /// `dcgm-exporter` from `PATH`.
    pub fn find_exporter(&self) -> Option<PathBuf> {
        find(self.exporter_path.as_deref(), EXPORTER_PROGRAM)
    }

    /// The `dcgmi` binary, the same way.
    pub fn find_dcgmi(&self) -> Option<PathBuf> {
        find(self.dcgmi_path.as_deref(), DCGMI_PROGRAM)
    }

    /// The `nv-hostengine` binary, the same way.
    pub fn find_hostengine(&self) -> Option<PathBuf> {
        find(self.hostengine_path.as_deref(), HOSTENGINE_PROGRAM)
    }
}

fn find(configured: Option<&Path>, name: &str) -> Option<PathBuf> {
    match configured {
        Some(p) => is_executable(p).then(|| p.to_path_buf()),
        None => find_program(name, std::env::var_os("PATH").as_deref()),
    }
}

/// Looks `name` up in the `PATH`-style list `path` like a shell does (Go's `exec.LookPath`):
/// the first directory holding a regular file of that name that this process may execute
/// wins (the `which` crate: access(2) with `X_OK`). Empty entries are skipped, not taken as
/// the current directory.
pub fn find_program(name: &str, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    let dirs: Vec<PathBuf> = std::env::split_paths(path?)
        .filter(|dir| !dir.as_os_str().is_empty())
        .collect();
    if dirs.is_empty() {
        return None;
    }
    let path = std::env::join_paths(dirs).ok()?;
    which::which_in_global(name, Some(path)).ok()?.next()
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs_err::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn touch(path: &Path, mode: u32) {
        fs_err::write(path, "#!/bin/sh\n").unwrap();
        fs_err::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn find_program_takes_the_first_executable_file_in_path_order() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let c = tempfile::tempdir().unwrap();
        touch(&a.path().join("dcgmi"), 0o644); // not executable: skipped
        fs_err::create_dir(b.path().join("dcgmi")).unwrap(); // a directory: skipped
        touch(&c.path().join("dcgmi"), 0o755);
        let path = std::env::join_paths([a.path(), b.path(), c.path()]).unwrap();
        assert_eq!(
            find_program("dcgmi", Some(&path)),
            Some(c.path().join("dcgmi"))
        );
        assert_eq!(find_program("dcgm-exporter", Some(&path)), None);
        assert_eq!(find_program("dcgmi", None), None);
        // Empty entries are skipped (not the current directory).
        let path = std::env::join_paths([Path::new(""), c.path(), Path::new("")]).unwrap();
        assert_eq!(
            find_program("dcgmi", Some(&path)),
            Some(c.path().join("dcgmi"))
        );
        assert_eq!(find_program("dcgmi", Some("::".as_ref())), None);
    }

    #[test]
    fn a_configured_path_must_be_executable_and_is_not_searched() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("my-exporter");
        touch(&exe, 0o755);
        let config = DcgmConfig {
            exporter_path: Some(exe.clone()),
            dcgmi_path: Some(dir.path().join("missing")),
            ..DcgmConfig::default()
        };
        assert_eq!(config.find_exporter(), Some(exe));
        assert_eq!(config.find_dcgmi(), None);
    }

    // upstream: runner/cmd/shim/main.go (dcgm-exporter-http-port 10997, dcgm-exporter-interval
    // 5000 ms, dcgm-address empty)
    #[test]
    fn defaults_are_upstreams() {
        let c = DcgmConfig::default();
        assert_eq!(c.exporter_http_port, 10997);
        assert_eq!(c.exporter_interval, Duration::from_millis(5000));
        assert_eq!(c.address(), None);
        let c = DcgmConfig {
            address: Some(String::new()),
            ..c
        };
        assert_eq!(c.address(), None);
    }
}
