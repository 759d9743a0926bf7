//! The `dstack-shim` process: building the binary, free ports, log files, and a guard that
//! starts the binary on a home and port, waits for it, signals it and kills it when dropped.

use std::ffi::OsStr;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::http::Api;

/// How long a shim may take to answer after it was spawned (a bound, not a goal).
pub const START_BOUND: Duration = Duration::from_secs(60);
/// Environment variable naming a prebuilt `dstack-shim` for [`shim_binary`].
pub const ENV_BINARY: &str = "SHIM_E2E_BINARY";

/// A free TCP port on 127.0.0.1 (bound, then released: another process could take it first,
/// which the shim then reports as an address in use).
pub fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// Opens `path` for appending (created if missing, parent directories too): the stdout or
/// stderr of a process started in the background.
pub fn open_log(path: &Path) -> io::Result<std::fs::File> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs_err::create_dir_all(dir)?;
    }
    Ok(fs_err::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?
        .into_parts()
        .0)
}

/// The last `lines` lines of the file at `path` (a note if it cannot be read).
pub fn tail(path: &Path, lines: usize) -> String {
    match fs_err::read_to_string(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(err) => format!("(no log: {err})"),
    }
}

/// Cargo's target directory: `CARGO_TARGET_DIR` (relative to the repository root if it is
/// relative), else `<repo>/target`.
pub fn target_dir() -> PathBuf {
    let root = crate::repo_root();
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => root.join(dir),
        _ => root.join("target"),
    }
}

/// Whether cargo sets `name` for the package it builds or runs (as opposed to user
/// configuration such as `CARGO_HOME` or `CARGO_TARGET_DIR`).
pub fn is_cargo_package_var(name: &str) -> bool {
    matches!(
        name,
        "CARGO_MANIFEST_DIR"
            | "CARGO_MANIFEST_PATH"
            | "CARGO_MANIFEST_LINKS"
            | "CARGO_CRATE_NAME"
            | "CARGO_BIN_NAME"
            | "CARGO_PRIMARY_PACKAGE"
            | "CARGO_RUSTC_CURRENT_DIR"
            | "CARGO_TARGET_TMPDIR"
            | "OUT_DIR"
    ) || name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_EXE_")
}

/// Removes from `command` the variables cargo set for the package running us: they describe
/// that package, not the child, and a nested `cargo` that sees them rebuilds crates whose
/// build scripts watch them (ring) every time.
pub fn scrub_cargo_env(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_cargo_package_var) {
            command.env_remove(name);
        }
    }
    command
}

/// The path of `cargo` that runs us (cargo sets `CARGO`), else `cargo` from `PATH`.
pub fn cargo() -> PathBuf {
    std::env::var_os("CARGO")
        .filter(|c| !c.is_empty())
        .map_or_else(|| PathBuf::from("cargo"), PathBuf::from)
}

/// Builds `dstack-shim` (`release` or debug) with the output shown, bounded by `limit`, and
/// returns the binary's path.
pub fn build_shim(release: bool, limit: Duration) -> io::Result<PathBuf> {
    let mut build = Command::new(cargo());
    scrub_cargo_env(&mut build)
        .args(["build", "-p", "dstack-shim", "--bin", "dstack-shim"])
        .current_dir(crate::repo_root())
        .stdin(Stdio::null());
    if release {
        build.arg("--release");
    }
    run_build(build, limit, "dstack-shim")?;
    built(
        target_dir()
            .join(if release { "release" } else { "debug" })
            .join("dstack-shim"),
    )
}

/// Runs a prepared `cargo build` of `package` with its output shown; fails if it fails or
/// takes longer than `limit`.
fn run_build(mut build: Command, limit: Duration, package: &str) -> io::Result<()> {
    let mut child = build.spawn()?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::other(format!(
                "`cargo build -p {package}` did not finish in {limit:?} (plain `cargo test` \
                 holds the build lock while tests run: use `cargo nextest run`, or set \
                 SHIM_E2E_BINARY)"
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if !status.success() {
        return Err(io::Error::other(format!(
            "cargo build -p {package} failed: {status}"
        )));
    }
    Ok(())
}

fn built(binary: PathBuf) -> io::Result<PathBuf> {
    if !binary.is_file() {
        return Err(io::Error::other(format!(
            "{} missing after the build",
            binary.display()
        )));
    }
    Ok(binary)
}

/// Builds `shim-test-runner` (`tests/runner`, the stand-in for dstack's runner that the fleet
/// test serves as the server's runner download) static, with glibc's crt-static, so that it
/// runs in the busybox test image: a release build for this machine's `*-unknown-linux-gnu`
/// target in its own target directory (`<target>/test-runner`, so that the flags never
/// rebuild the workspace's other artifacts), bounded by `limit`. A no-op when it is up to
/// date (about a second); the first build takes about half a minute on 2 cores (serde's
/// derive, serde_json, tiny_http). Returns the binary's path.
pub fn build_test_runner(limit: Duration) -> io::Result<PathBuf> {
    let triple = format!("{}-unknown-linux-gnu", std::env::consts::ARCH);
    let dir = target_dir().join("test-runner");
    let mut build = Command::new(cargo());
    scrub_cargo_env(&mut build)
        .args(["build", "--release", "-p", "shim-test-runner", "--target"])
        .arg(&triple)
        .arg("--target-dir")
        .arg(&dir)
        // With --target, RUSTFLAGS applies to the target's artifacts only; the encoded form
        // (set by an outer cargo) would take precedence over it.
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .current_dir(crate::repo_root())
        .stdin(Stdio::null());
    run_build(build, limit, "shim-test-runner")?;
    built(dir.join(triple).join("release").join("shim-test-runner"))
}

/// For tests: the debug `dstack-shim`, built once per test process (a no-op build takes well
/// under a second), or [`ENV_BINARY`] if set. Panics (failing the test) if the build fails.
#[allow(
    clippy::panic,
    reason = "a test helper: a binary that cannot be built fails the test"
)]
pub fn shim_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        if let Some(path) = std::env::var_os(ENV_BINARY).filter(|p| !p.is_empty()) {
            return PathBuf::from(path);
        }
        build_shim(false, Duration::from_secs(600)).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// The command that starts `binary --shim-home home --shim-http-port port args..` with `env`
/// set, `RUST_LOG` removed and `NO_COLOR=1` (what [`ShimProcess::spawn_with_env`] runs).
pub fn shim_command<A: AsRef<OsStr>>(
    binary: &Path,
    home: &Path,
    port: u16,
    args: &[A],
    env: &[(&str, &OsStr)],
) -> Command {
    let mut command = Command::new(binary);
    command
        .arg("--shim-home")
        .arg(home)
        .arg("--shim-http-port")
        .arg(port.to_string())
        .args(args)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1");
    for (name, value) in env {
        command.env(name, value);
    }
    command
}

/// `command` run under `prefix` (`PREFIX.. <program> <args>`: a wrapper such as
/// `qemu-aarch64-static`, or a fake GPU host's `exec`), with the same environment changes and
/// working directory; `command` itself if `prefix` is empty.
pub fn prefixed<S: AsRef<OsStr>>(command: Command, prefix: &[S]) -> Command {
    let Some((program, rest)) = prefix.split_first() else {
        return command;
    };
    let mut wrapped = Command::new(program);
    wrapped
        .args(rest)
        .arg(command.get_program())
        .args(command.get_args());
    for (name, value) in command.get_envs() {
        match value {
            Some(value) => wrapped.env(name, value),
            None => wrapped.env_remove(name),
        };
    }
    if let Some(dir) = command.get_current_dir() {
        wrapped.current_dir(dir);
    }
    wrapped
}

/// A running `dstack-shim` started on a home and a loopback port, stdout and stderr appended
/// to a log file. SIGKILLed (and reaped) when dropped unless it already exited. Containers
/// are not touched: pair it with a [`super::ContainerSweeper`] for the home.
#[derive(Debug)]
pub struct ShimProcess {
    child: Child,
    api: Api,
    log: PathBuf,
}

impl ShimProcess {
    /// Starts `binary --shim-home home --shim-http-port port args..` (with `RUST_LOG` removed
    /// and `NO_COLOR=1`) and returns at once. `home` is passed as spelled (a trailing slash,
    /// `.` components, a symbolic link stay as they are).
    pub fn spawn<A: AsRef<OsStr>>(
        binary: &Path,
        home: &Path,
        port: u16,
        args: &[A],
        log: &Path,
    ) -> io::Result<Self> {
        Self::spawn_with_env(binary, home, port, args, &[], log)
    }

    /// [`ShimProcess::spawn`] with more environment variables for the process (e.g.
    /// `DOCKER_HOST` for a daemon of the test's own).
    pub fn spawn_with_env<A: AsRef<OsStr>>(
        binary: &Path,
        home: &Path,
        port: u16,
        args: &[A],
        env: &[(&str, &OsStr)],
        log: &Path,
    ) -> io::Result<Self> {
        let mut command = shim_command(binary, home, port, args, env);
        let child = command
            .stdin(Stdio::null())
            .stdout(open_log(log)?)
            .stderr(open_log(log)?)
            .spawn()
            .map_err(|e| {
                io::Error::new(e.kind(), format!("cannot start {}: {e}", binary.display()))
            })?;
        Ok(Self {
            child,
            api: Api {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            },
            log: log.to_owned(),
        })
    }

    /// [`ShimProcess::spawn`], then waits (at most [`START_BOUND`]) until its healthcheck
    /// answers.
    pub fn start<A: AsRef<OsStr>>(
        binary: &Path,
        home: &Path,
        port: u16,
        args: &[A],
        log: &Path,
    ) -> io::Result<Self> {
        let mut shim = Self::spawn(binary, home, port, args, log)?;
        shim.wait_answering(START_BOUND, Duration::from_millis(5))?;
        Ok(shim)
    }

    /// Starts a command the caller prepared (how it gets its home and port, by flags or by
    /// environment, is the caller's), stdout and stderr appended to `log`; its API is taken
    /// to listen on `port`. Returns at once.
    pub fn from_command(mut command: Command, port: u16, log: &Path) -> io::Result<Self> {
        let child = command
            .stdin(Stdio::null())
            .stdout(open_log(log)?)
            .stderr(open_log(log)?)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("cannot start {command:?}: {e}")))?;
        Ok(Self {
            child,
            api: Api {
                addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            },
            log: log.to_owned(),
        })
    }

    /// Its API.
    pub fn api(&self) -> Api {
        self.api
    }

    /// Where its API listens.
    pub fn addr(&self) -> SocketAddr {
        self.api.addr
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The file its stdout and stderr are appended to.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Polls the healthcheck every `every` until it answers 200; fails if the process exits
    /// or `limit` passes (the error holds the end of its log).
    pub fn wait_answering(&mut self, limit: Duration, every: Duration) -> io::Result<()> {
        let api = self.api;
        self.wait_until(limit, every, "answer its healthcheck", || api.answers())
    }

    /// Waits until its port accepts a connection, sending no request (so the next request is
    /// the first the new process answers); fails if it exits or `limit` passes.
    pub fn wait_listening(&mut self, limit: Duration) -> io::Result<()> {
        let addr = self.api.addr;
        self.wait_until(limit, Duration::from_millis(5), "listen", || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        })
    }

    fn wait_until(
        &mut self,
        limit: Duration,
        every: Duration,
        what: &str,
        mut ready: impl FnMut() -> bool,
    ) -> io::Result<()> {
        let started = Instant::now();
        loop {
            if ready() {
                return Ok(());
            }
            if let Some(status) = self.child.try_wait()? {
                return Err(io::Error::other(format!(
                    "dstack-shim exited ({status}) before it would {what}; end of {}:\n{}",
                    self.log.display(),
                    tail(&self.log, 30)
                )));
            }
            if started.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "dstack-shim did not {what} within {limit:?}; end of {}:\n{}",
                        self.log.display(),
                        tail(&self.log, 30)
                    ),
                ));
            }
            std::thread::sleep(every);
        }
    }

    /// Its resident set size in KiB (`VmRSS` of `/proc/<pid>/status`).
    pub fn rss_kib(&self) -> io::Result<u64> {
        let path = format!("/proc/{}/status", self.pid());
        fs_err::read_to_string(&path)?
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .ok_or_else(|| io::Error::other(format!("no VmRSS in {path}")))
    }

    /// Sends SIGTERM (the process keeps running until it has shut down: see
    /// [`ShimProcess::wait_exit`]).
    pub fn sigterm(&self) -> io::Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .stdin(Stdio::null())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "kill -TERM {}: {status}",
                self.pid()
            )))
        }
    }

    /// SIGKILL, as a crash or an OOM kill would, and reaps it.
    pub fn kill(mut self) -> io::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Waits (at most `limit`) for it to exit by itself and returns how it exited.
    pub fn wait_exit(mut self, limit: Duration) -> io::Result<ExitStatus> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if started.elapsed() > limit {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("dstack-shim did not exit within {limit:?}"),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for ShimProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "test code")]
mod tests {
    use super::*;

    #[test]
    fn package_variables_are_scrubbed_but_configuration_is_not() {
        for v in [
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_BIN_EXE_x",
            "OUT_DIR",
        ] {
            assert!(is_cargo_package_var(v), "{v}");
        }
        for v in ["CARGO_HOME", "CARGO_TARGET_DIR", "CARGO", "PATH"] {
            assert!(!is_cargo_package_var(v), "{v}");
        }
    }

    #[test]
    fn a_prefixed_command_keeps_arguments_environment_and_directory() {
        let mut command = Command::new("/bin/shim");
        command
            .args(["--a", "b"])
            .env("SET", "1")
            .env_remove("GONE")
            .current_dir("/tmp");
        let wrapped = prefixed(command, &["wrap", "--x", "--"]);
        assert_eq!(wrapped.get_program(), "wrap");
        let args: Vec<&OsStr> = wrapped.get_args().collect();
        assert_eq!(args, ["--x", "--", "/bin/shim", "--a", "b"]);
        let envs: Vec<(&OsStr, Option<&OsStr>)> = wrapped.get_envs().collect();
        assert!(envs.contains(&(OsStr::new("SET"), Some(OsStr::new("1")))));
        assert!(envs.contains(&(OsStr::new("GONE"), None)));
        assert_eq!(wrapped.get_current_dir(), Some(Path::new("/tmp")));
        let unchanged = prefixed(Command::new("/bin/shim"), &[] as &[&str]);
        assert_eq!(unchanged.get_program(), "/bin/shim");
    }

    #[test]
    fn a_process_that_exits_early_is_reported_with_its_log() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("not-a-shim");
        fs_err::write(&script, "#!/bin/sh\necho \"started with $*\"\nexit 3\n").unwrap();
        fs_err::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let log = dir.path().join("logs").join("out.log");
        let port = free_port().unwrap();
        let mut shim = ShimProcess::spawn(&script, dir.path(), port, &["--x"], &log).unwrap();
        let err = shim.wait_listening(START_BOUND).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("exited (exit status: 3)"), "{message}");
        assert!(
            message.contains(&format!(
                "started with --shim-home {} --shim-http-port {port} --x",
                dir.path().display()
            )),
            "{message}"
        );
    }
}
