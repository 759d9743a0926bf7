//! Upgrades in place (SPEC §9). The dstack server upgrades a host with `POST
//! /api/components/install` (the new binary renamed over `--shim-binary-path`) then `POST
//! /api/shutdown`, and systemd starts the process again (`Restart=always`, `RestartSec=3`).
//! Exiting there would leave the API unanswered for the restart delay; this module makes
//! that shutdown an upgrade that no request notices:
//!
//! 1. [`Upgrader::decide`], before the server stops accepting: nothing new at the path (the
//!    same bytes as the running image) → [`Decision::Exit`], as upstream. Otherwise the
//!    pre-flight: `<new> --version` must answer `dstack-shim version X` (5 s), and the binary
//!    must not be one whose start failed in the last hour ([`RollbackRecord`]). A binary that
//!    fails it is never started: the running image is put back over the path, `dstack-shim`
//!    reports `error`, and the shim keeps serving ([`Decision::RolledBack`]).
//! 2. The server drains as for any graceful shutdown (in-flight requests answered, engine
//!    jobs stopped, containers untouched) while the listening socket stays open (the binary
//!    keeps a duplicate): new connections wait in the kernel's backlog.
//! 3. [`Handover::start_watchdog`] when the server's run ends (this binary, `__upgrade-watch`,
//!    a child of the PID being replaced), then [`exec`]: once the watchdog says it is ready,
//!    `execve` of the new binary with the same argv and PID, the socket at fd 3 with
//!    `LISTEN_FDS=1` and `LISTEN_PID` (see `listen_fds`). The new shim restores its tasks and
//!    accepts the waiting connections. A binary that is not this shim (no `+rust.` in its version:
//!    upstream's Go shim) does not speak `LISTEN_FDS`: it gets no socket and binds the port
//!    itself (connections waiting then are refused).
//! 4. The watchdog ([`watch_main`]) polls the healthcheck until the new version answers
//!    (then exits). If its parent (the same PID) dies first, or nothing answers within the
//!    bound (60 s, `DSTACK_SHIM_UPGRADE_TIMEOUT`; the hung process is then killed), it puts
//!    its own image (the old, running binary) back over the path and writes the
//!    [`RollbackRecord`]; systemd starts the restored binary, which reports `error`. It
//!    blocks SIGTERM/SIGINT/SIGHUP: systemd signals the unit's remaining processes when the
//!    main PID exits, and the rollback must complete.

use std::ffi::OsString;
use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use shim_components::upgrade::policy::{self, AtStart, Step, Watch};
use shim_components::upgrade::{
    RUNNING_EXE, RollbackRecord, differs_from_running, digest, restore_running, unix_now,
};
use shim_components::{ComponentName, Components, FileKey, binary_version};
use shim_http::{ShutdownHook, ShutdownRequest};
use shim_util::{SystemCommandRunner, error_chain};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, VERSION};
use crate::listen_fds;

/// The hidden first argument that runs the watchdog.
pub const WATCH_COMMAND: &str = "__upgrade-watch";
/// The watchdog's instructions (JSON), from the process it watches.
const ENV_WATCH_SPEC: &str = "DSTACK_SHIM_UPGRADE_WATCH";
/// The watchdog's PID, for the new image to reap it (it is that process's child).
const ENV_WATCHDOG_PID: &str = "DSTACK_SHIM_UPGRADE_WATCHDOG";
/// Ours: how many seconds the new binary has to answer before it is rolled back.
pub const ENV_TIMEOUT: &str = "DSTACK_SHIM_UPGRADE_TIMEOUT";
/// How long the new binary has to answer by default: restore waits up to a minute for Docker.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `<new> --version` may take.
const VERSION_TIMEOUT: Duration = Duration::from_secs(5);

/// The binary an upgrade starts.
#[derive(Debug, Clone)]
pub struct Plan {
    path: PathBuf,
    /// The checked file (device, inode, size, modification time): the one started.
    file: FileKey,
    version: String,
    sha256: String,
    takes_socket: bool,
}

/// What `POST /api/shutdown` does.
#[derive(Debug)]
pub enum Decision {
    /// Nothing new is installed: exit, as upstream does.
    Exit,
    /// Replace this process with the installed binary.
    Upgrade(Plan),
    /// The installed binary was refused and the running one put back: keep serving.
    RolledBack,
}

/// Decides what a shutdown is ([`Upgrader::decide`]); cheap to clone.
#[derive(Debug, Clone)]
pub struct Upgrader {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    home: PathBuf,
    components: Components,
}

impl Upgrader {
    /// For the shim binary at `path` (`--shim-binary-path`), the home `home`.
    pub fn new(path: PathBuf, home: PathBuf, components: Components) -> Self {
        Self {
            inner: Arc::new(Inner {
                path,
                home,
                components,
            }),
        }
    }

    /// At start-up: a rollback recorded by the watchdog (or by an earlier pre-flight) about
    /// this binary makes `dstack-shim` report `error`; a record about another binary (a later
    /// upgrade succeeded) is removed.
    pub async fn load_record(&self) {
        let home = self.inner.home.clone();
        let read = tokio::task::spawn_blocking(move || RollbackRecord::read(&home)).await;
        let record = match read {
            Ok(record) => record.map_err(|e| error_chain(&e)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the upgrade record");
                return;
            }
        };
        if let Err(e) = &record {
            tracing::warn!(error = %e, "ignoring an unreadable upgrade record");
        }
        match policy::at_start(record, VERSION) {
            AtStart::Report(reason) => {
                tracing::warn!(
                    %reason,
                    "an upgrade of this shim was rolled back; dstack-shim reports `error` until the next install"
                );
                self.inner
                    .components
                    .mark_rolled_back(ComponentName::Shim, reason);
            }
            AtStart::Remove => self.remove_record().await,
            AtStart::Nothing => {}
        }
    }

    async fn remove_record(&self) {
        let home = self.inner.home.clone();
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || RollbackRecord::remove(&home)).await
        {
            tracing::warn!(error = %error_chain(&e), "cannot remove the upgrade record");
        }
    }

    /// What a shutdown requested over the API does: exit, upgrade, or (a refused binary,
    /// rolled back) nothing. The checks and their order are [`policy`]'s; this runs them.
    pub async fn decide(&self) -> Decision {
        match self.preflight().await {
            Ok(plan) => {
                tracing::info!(
                    from = VERSION,
                    to = %plan.version,
                    path = %plan.path.display(),
                    takes_socket = plan.takes_socket,
                    "a new dstack-shim is installed: upgrading in place"
                );
                Decision::Upgrade(plan)
            }
            Err(Step::Exit(why)) => {
                tracing::info!(reason = %why, "exiting on the shutdown request");
                Decision::Exit
            }
            Err(Step::Refuse { record, why }) => self.refuse(*record, why).await,
            Err(Step::Next) => Decision::Exit,
        }
    }

    /// The pre-flight's steps, each on what it found; `Err` is the step that ended it.
    async fn preflight(&self) -> Result<Plan, Step> {
        let path = self.inner.path.clone();
        let blocking = |f: Box<dyn FnOnce() -> Step + Send>| async move {
            tokio::task::spawn_blocking(f)
                .await
                .unwrap_or_else(|e| Step::Exit(format!("a pre-flight job failed: {e}")))
        };
        let differs = {
            let path = path.clone();
            blocking(Box::new(move || {
                policy::installed(differs_from_running(&path).map_err(|e| error_chain(&e)))
            }))
            .await
        };
        if differs != Step::Next {
            return Err(differs);
        }
        let read = {
            let path = path.clone();
            tokio::task::spawn_blocking(move || {
                let stat = || FileKey::at(&path).map_err(|e| e.to_string());
                let before = stat();
                let sha = digest(&path).map_err(|e| error_chain(&e));
                policy::read(before, sha, stat(), VERSION)
            })
            .await
            .unwrap_or_else(|e| Err(Step::Exit(format!("a pre-flight job failed: {e}"))))
        };
        let (file, sha256) = read?;
        let home = self.inner.home.clone();
        let record = tokio::task::spawn_blocking(move || RollbackRecord::read(&home))
            .await
            .ok()
            .and_then(Result::ok)
            .flatten();
        match policy::recorded(record.as_ref(), &sha256, unix_now()) {
            Step::Next => {}
            other => return Err(other),
        }
        let runner = SystemCommandRunner::default();
        let shim = ComponentName::Shim.as_str();
        let answer = binary_version(&runner, &path, shim, VERSION_TIMEOUT)
            .await
            .map_err(|e| error_chain(&e));
        let start = policy::version(answer, &sha256, VERSION)?;
        Ok(Plan {
            path,
            file,
            version: start.version,
            sha256,
            takes_socket: start.takes_socket,
        })
    }

    /// Puts the running image back over the path, writes `record` and reports `error` with
    /// `why`.
    async fn refuse(&self, record: RollbackRecord, why: String) -> Decision {
        let path = self.inner.path.clone();
        let home = self.inner.home.clone();
        let done = tokio::task::spawn_blocking(move || roll_back(&path, &home, &record)).await;
        if let Err(e) = done {
            tracing::error!(error = %e, "the rollback job failed");
        }
        tracing::warn!(
            path = %self.inner.path.display(),
            reason = %why,
            "refused the installed dstack-shim: the running binary is back in place and keeps serving"
        );
        self.inner
            .components
            .mark_rolled_back(ComponentName::Shim, why);
        Decision::RolledBack
    }
}

/// Puts the running image over `path` and writes `record` into `home`. Blocking; logs what
/// fails.
fn roll_back(path: &Path, home: &Path, record: &RollbackRecord) {
    match restore_running(path) {
        Ok(()) => {
            tracing::info!(path = %path.display(), version = VERSION, "put the running binary back")
        }
        Err(e) => tracing::error!(
            path = %path.display(),
            error = %error_chain(&e),
            "cannot put the running binary back; the next start runs the refused one"
        ),
    }
    if let Err(e) = record.write(home) {
        tracing::error!(error = %error_chain(&e), "cannot record the rollback");
    }
}

/// What [`exec`] needs: the plan, the listening socket (a duplicate kept open across the
/// server's end) and its address.
#[derive(Debug)]
pub struct Handover {
    plan: Plan,
    socket: OwnedFd,
    addr: SocketAddr,
    watchdog: Option<anyhow::Result<Watchdog>>,
}

/// The watchdog, started, and its readiness (one byte on its stdout once it blocks the
/// signals that would end it).
#[derive(Debug)]
pub(crate) struct Watchdog {
    pid: u32,
    ready: std::sync::mpsc::Receiver<bool>,
}

/// How long the watchdog may take to come up.
const WATCHDOG_READY: Duration = Duration::from_secs(10);

impl Handover {
    /// Starts the watchdog now, so that it comes up while the engine stops; [`exec`] waits
    /// until it is ready.
    pub fn start_watchdog(&mut self) {
        self.watchdog = Some(spawn_watchdog(&self.plan, self.addr));
    }

    /// Gives the upgrade up (a stop came during the hand-off: the process exits instead, and
    /// the new binary, installed at its path, runs at the next start). Its watchdog, which
    /// would take the exit for a failed start and roll the binary back, is killed and reaped.
    pub fn abandon(self) {
        if let Some(Ok(watchdog)) = self.watchdog {
            kill_and_reap(watchdog.pid);
        }
    }
}

/// Kills (`SIGKILL`: it blocks the stop signals) and reaps the watchdog `pid`, this process's
/// child not waited for yet.
fn kill_and_reap(pid: u32) {
    let child = nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
    if let Err(e) = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL) {
        tracing::debug!(pid, error = %e, "cannot kill the upgrade watchdog");
        return;
    }
    if let Err(e) = nix::sys::wait::waitpid(child, None) {
        tracing::debug!(pid, error = %e, "cannot reap the upgrade watchdog");
    }
}

/// The shim's argv0 and arguments.
fn own_args() -> (OsString, Vec<OsString>) {
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_else(|| OsString::from("dstack-shim"));
    (argv0, args.collect())
}

fn spawn_watchdog(plan: &Plan, addr: SocketAddr) -> anyhow::Result<Watchdog> {
    let timeout = std::env::var(ENV_TIMEOUT)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
    let spec = WatchSpec {
        parent: std::process::id(),
        addr,
        binary: plan.path.clone(),
        version: plan.version.clone(),
        sha256: plan.sha256.clone(),
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    };
    let (argv0, args) = own_args();
    let mut child = Command::new(RUNNING_EXE)
        .arg0(&argv0)
        .arg(WATCH_COMMAND)
        .args(&args)
        .env(ENV_WATCH_SPEC, serde_json::to_string(&spec)?)
        .env_remove(listen_fds::LISTEN_PID)
        .env_remove(listen_fds::LISTEN_FDS)
        .env_remove(listen_fds::LISTEN_FDNAMES)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the upgrade watchdog")?;
    let pid = child.id();
    let mut stdout = child.stdout.take().context("the watchdog has no stdout")?;
    let (tx, ready) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("upgrade-watchdog-ready".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            let _ = tx.send(matches!(stdout.read(&mut byte), Ok(1)));
        })
        .context("cannot wait for the upgrade watchdog")?;
    // The child is not waited for here: after the exec the new image reaps it.
    drop(child);
    Ok(Watchdog { pid, ready })
}

/// What an upgrade in place hands over, filled in while the server runs: a duplicate of the
/// listening socket, kept only while an upgrade may still come (an exit drops it at once, so
/// connections are refused from the server's end on, as before), and the plan.
#[derive(Debug)]
pub struct Handoff {
    state: Mutex<HandoffState>,
    addr: SocketAddr,
}

#[derive(Debug)]
struct HandoffState {
    socket: Option<OwnedFd>,
    plan: Option<Plan>,
}

impl Handoff {
    /// Keeps `socket` (the API's, on `addr`: any loopback address an inherited socket may
    /// have) for an upgrade.
    pub fn new(socket: OwnedFd, addr: SocketAddr) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(HandoffState {
                socket: Some(socket),
                plan: None,
            }),
            addr,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, HandoffState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The shutdown is an upgrade to `plan` (unless [`Handoff::no_upgrade`] came first).
    fn upgrade(&self, plan: Plan) {
        let mut state = self.state();
        if state.socket.is_some() {
            state.plan = Some(plan);
        }
    }

    /// The shutdown is an exit (nothing new installed, or a signal): the socket and any plan
    /// go now.
    pub fn no_upgrade(&self) {
        let mut state = self.state();
        state.socket = None;
        state.plan = None;
    }

    /// After the server's end: the handover, if the shutdown is an upgrade.
    pub fn take(&self) -> Option<Handover> {
        let mut state = self.state();
        let (plan, socket) = (state.plan.take(), state.socket.take());
        Some(Handover {
            plan: plan?,
            socket: socket?,
            addr: self.addr,
            watchdog: None,
        })
    }
}

/// The `POST /api/shutdown` hook: decided by the [`Upgrader`] before the server stops
/// accepting: exit (nothing new installed), upgrade in place (the plan goes to `handoff`), or
/// keep serving (the new binary was refused and rolled back). One decision at a time; a
/// request while shutting down only adds `force`.
pub fn shutdown_hook(
    upgrader: Upgrader,
    handoff: Arc<Handoff>,
    shutdown: CancellationToken,
    force: CancellationToken,
) -> ShutdownHook {
    let deciding = Arc::new(tokio::sync::Mutex::new(()));
    Arc::new(move |request: ShutdownRequest| {
        let (upgrader, handoff, shutdown, force, deciding) = (
            upgrader.clone(),
            handoff.clone(),
            shutdown.clone(),
            force.clone(),
            deciding.clone(),
        );
        tokio::spawn(async move {
            let _one = deciding.lock().await;
            if !shutdown.is_cancelled() {
                match upgrader.decide().await {
                    Decision::Exit => handoff.no_upgrade(),
                    Decision::Upgrade(plan) => handoff.upgrade(plan),
                    Decision::RolledBack => return,
                }
            }
            if request.force {
                force.cancel();
            }
            shutdown.cancel();
        });
    })
}

/// What the hand-off asks of the operating system, behind a trait so that its decisions (which
/// binary, which arguments and environment, where the socket goes, when it refuses) are tested
/// with a recording fake (the unit tests' `Recording`); [`System`] is the real one.
pub(crate) trait HandoffOs {
    /// The identity of the file at `path` now.
    fn file_key(&self, path: &Path) -> anyhow::Result<FileKey>;
    /// Starts the watchdog of an upgrade to `plan` (the API on `addr`).
    fn spawn_watchdog(&self, plan: &Plan, addr: SocketAddr) -> anyhow::Result<Watchdog>;
    /// Makes `socket` fd 3, inherited across `execve`.
    fn place_at_first_fd(&self, socket: &OwnedFd) -> anyhow::Result<()>;
    /// Replaces this process (`execve`); returns only when that fails.
    fn exec(&self, command: &mut Command) -> std::io::Error;
    /// This process's argv0 and arguments, and its PID.
    fn own_args(&self) -> (OsString, Vec<OsString>, u32);
    /// Kills and reaps the watchdog (the upgrade is given up).
    fn dismiss_watchdog(&self, watchdog: &Watchdog);
}

/// The real operating system.
pub(crate) struct System;

impl HandoffOs for System {
    fn file_key(&self, path: &Path) -> anyhow::Result<FileKey> {
        Ok(FileKey::at(path)?)
    }

    fn spawn_watchdog(&self, plan: &Plan, addr: SocketAddr) -> anyhow::Result<Watchdog> {
        spawn_watchdog(plan, addr)
    }

    fn place_at_first_fd(&self, socket: &OwnedFd) -> anyhow::Result<()> {
        place_at_first_fd(socket)
    }

    fn exec(&self, command: &mut Command) -> std::io::Error {
        command.exec()
    }

    fn own_args(&self) -> (OsString, Vec<OsString>, u32) {
        let (argv0, args) = own_args();
        (argv0, args, std::process::id())
    }

    fn dismiss_watchdog(&self, watchdog: &Watchdog) {
        kill_and_reap(watchdog.pid);
    }
}

/// Replaces this process with the planned binary (same PID, same argv and environment, the
/// socket at fd 3 when it takes `LISTEN_FDS`), once the watchdog is ready. Returns only if
/// that fails (the process then exits, as upstream's does). Call it with no other thread running (the async runtime shut down): from the
/// socket's move to fd 3 on, nothing may write to a descriptor.
///
/// `stopped` is set by a stop signal ([`crate::signals::stop_flag`]), whenever it comes: one
/// that came after the async side's last look gives the upgrade up here, before the exec
/// ([`StoppedDuringHandoff`]; the watchdog is killed).
pub fn exec(handover: Handover, stopped: &AtomicBool) -> anyhow::Error {
    match exec_with(&System, handover, stopped) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

/// A stop signal came during the hand-off, after the async side's last look: the upgrade was
/// given up (the process exits as a stop asks, and the new binary, at its path, runs at the
/// next start).
#[derive(Debug, thiserror::Error)]
#[error("stopped by a signal during an upgrade in place; the new binary runs at the next start")]
pub struct StoppedDuringHandoff;

fn exec_with(
    os: &dyn HandoffOs,
    handover: Handover,
    stopped: &AtomicBool,
) -> anyhow::Result<std::convert::Infallible> {
    let Handover {
        plan,
        socket,
        addr,
        watchdog,
    } = handover;
    // The file must still be the one checked (nothing installs while the server drains, but
    // a person may).
    let now = os.file_key(&plan.path)?;
    anyhow::ensure!(
        now == plan.file,
        "{} changed after the upgrade was decided; not starting it",
        plan.path.display()
    );
    // Without a watchdog ready (it would be killed with the unit's other processes if the
    // new binary died at once), the new binary is not started unprotected: exit instead, as
    // upstream does.
    let watchdog = watchdog
        .unwrap_or_else(|| os.spawn_watchdog(&plan, addr))
        .context("exiting instead of upgrading")?;
    let ready = watchdog.ready.recv_timeout(WATCHDOG_READY).unwrap_or(false);
    anyhow::ensure!(
        ready,
        "the upgrade watchdog (pid {}) did not come up within {WATCHDOG_READY:?}; exiting \
         instead of upgrading",
        watchdog.pid
    );
    tracing::info!(
        path = %plan.path.display(),
        version = %plan.version,
        watchdog = watchdog.pid,
        takes_socket = plan.takes_socket,
        "replacing this process with the new binary"
    );
    // The lines logged so far written before the exec ends their writers (and before fd 3,
    // perhaps the log file's, becomes the socket); before the last look, which a slow log
    // destination must not delay.
    crate::logging::flush();
    // The last look before the exec (the waits above may have taken a while).
    if stopped.load(Ordering::SeqCst) {
        os.dismiss_watchdog(&watchdog);
        return Err(StoppedDuringHandoff.into());
    }
    let (argv0, args, pid) = os.own_args();

    let mut command = Command::new(&plan.path);
    command
        .arg0(&argv0)
        .args(&args)
        .env_remove(listen_fds::LISTEN_PID)
        .env_remove(listen_fds::LISTEN_FDS)
        .env_remove(listen_fds::LISTEN_FDNAMES)
        .env_remove(ENV_WATCH_SPEC)
        .env(ENV_WATCHDOG_PID, watchdog.pid.to_string());
    if plan.takes_socket {
        command
            .env(listen_fds::LISTEN_PID, pid.to_string())
            .env(listen_fds::LISTEN_FDS, "1")
            .env(listen_fds::LISTEN_FDNAMES, listen_fds::FD_NAME);
        // From here on nothing logs: fd 3 may have been the log file.
        os.place_at_first_fd(&socket)?;
    } else {
        drop(socket);
    }
    Err(anyhow::Error::new(os.exec(&mut command))
        .context(format!("cannot exec {}", plan.path.display())))
}

/// Makes the socket fd 3 without close-on-exec (whatever fd 3 was is closed: every
/// descriptor of this process is close-on-exec anyway).
fn place_at_first_fd(socket: &OwnedFd) -> anyhow::Result<()> {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    let raw = socket.as_raw_fd();
    if raw == listen_fds::FIRST_FD {
        fcntl(raw, FcntlArg::F_SETFD(FdFlag::empty())).context("cannot hand the socket over")?;
    } else {
        nix::unistd::dup2(raw, listen_fds::FIRST_FD).context("cannot hand the socket over")?;
    }
    Ok(())
}

/// The watchdog of the upgrade that started this image, while it may still roll back: a
/// stop asked of this image (systemd's SIGTERM, during its restore or before its first
/// answer) is no failed start, so [`WatchdogGuard::dismiss`] ends the watchdog before it
/// sees this process go.
#[derive(Debug, Clone, Default)]
pub struct WatchdogGuard(Arc<Mutex<Option<i32>>>);

impl WatchdogGuard {
    /// Kills the watchdog (`SIGKILL`: it blocks the signals that stop the unit); nothing once
    /// it has ended, or where there is none.
    pub fn dismiss(&self) {
        let mut pid = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        // Not reaped yet (the reaper takes the pid before it reaps): still this process's
        // child, alive or a zombie, so the PID is its.
        if let Some(pid) = pid.take() {
            let killed = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            tracing::info!(
                pid,
                ?killed,
                "stopped before the upgrade was confirmed: its watchdog is dismissed (no rollback)"
            );
        }
    }
}

/// Reaps the watchdog the image before this one spawned (it is this process's child: the PID
/// is the same), logging how it ended. Runs on a thread of its own; nothing if there is none.
/// The guard dismisses it while it runs.
pub fn reap_watchdog() -> WatchdogGuard {
    let Some(pid) = std::env::var(ENV_WATCHDOG_PID)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return WatchdogGuard::default();
    };
    watch_child(pid)
}

/// The guard of child `pid`, and the thread that reaps it: it waits for the child's end
/// without reaping it, takes the pid from the guard, then reaps it (so that the guard never
/// signals a PID that another process may have by then).
fn watch_child(pid: i32) -> WatchdogGuard {
    use nix::sys::wait::{Id, WaitPidFlag, waitid, waitpid};
    let guard = WatchdogGuard(Arc::new(Mutex::new(Some(pid))));
    let held = guard.clone();
    let spawned = std::thread::Builder::new()
        .name("upgrade-watchdog-reaper".into())
        .spawn(move || {
            let child = nix::unistd::Pid::from_raw(pid);
            let ended = waitid(Id::Pid(child), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
            held.0.lock().unwrap_or_else(PoisonError::into_inner).take();
            match ended.and_then(|_| waitpid(child, None)) {
                Ok(status) => tracing::debug!(pid, ?status, "the upgrade watchdog ended"),
                // Not our child (the variable came from elsewhere): nothing to reap.
                Err(e) => tracing::debug!(pid, error = %e, "no upgrade watchdog to reap"),
            }
        });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "cannot wait for the upgrade watchdog");
    }
    guard
}

/// The watchdog's instructions.
#[derive(Debug, Serialize, Deserialize)]
struct WatchSpec {
    /// The PID being replaced (the watchdog's parent).
    parent: u32,
    /// The API's address (a loopback address; an inherited socket's may be `[::1]` or any
    /// of 127.0.0.0/8).
    addr: SocketAddr,
    /// The new binary's path.
    binary: PathBuf,
    /// The version it must answer.
    version: String,
    /// Its digest: only that file is rolled back.
    sha256: String,
    /// How long it has to answer.
    timeout_ms: u64,
}

/// First thing in the watchdog's `main`, before any thread exists (the mask is then the
/// process's): SIGTERM, SIGINT and SIGHUP stay pending. systemd sends SIGTERM to the unit's
/// remaining processes as soon as the main PID exits, which a broken new binary does at once.
/// The watchdog tells its parent it is ready (one byte on stdout) only after this.
pub fn block_stop_signals() {
    use nix::sys::signal::{SigSet, Signal};
    let mut blocked = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        blocked.add(signal);
    }
    let _ = blocked.thread_block();
}

/// `dstack-shim __upgrade-watch <the shim's arguments>`: see the module's documentation.
/// [`block_stop_signals`] has run.
pub fn watch_main(config: &Config) -> ExitCode {
    use nix::sys::signal::Signal;
    let spec: WatchSpec = match std::env::var(ENV_WATCH_SPEC)
        .context(ENV_WATCH_SPEC)
        .and_then(|s| serde_json::from_str(&s).context("cannot parse it"))
    {
        Ok(spec) => spec,
        Err(e) => {
            #[allow(clippy::print_stderr)] // no logger yet
            {
                eprintln!("dstack-shim {WATCH_COMMAND}: {e:#}");
            }
            return ExitCode::FAILURE;
        }
    };
    // Ready: the parent may exec now.
    let mut stdout = std::io::stdout();
    let _ = stdout.write_all(b"r").and_then(|()| stdout.flush());
    let home = config.home().ok();
    if let Some(home) = &home
        && let Err(e) = crate::logging::init(config.shim_log_level, config.log_format, home)
    {
        #[allow(clippy::print_stderr)] // the logger is not installed
        {
            eprintln!("dstack-shim {WATCH_COMMAND}: {e:#}");
        }
    }
    let started = Instant::now();
    match watch(&spec) {
        Ok(()) => {
            tracing::info!(
                version = %spec.version,
                after_ms = started.elapsed().as_millis(),
                "the new dstack-shim answers: upgrade done"
            );
            ExitCode::SUCCESS
        }
        Err(failure) => {
            tracing::error!(
                version = %spec.version,
                reason = %failure.why,
                "the new dstack-shim did not start: rolling back"
            );
            let Some(home) = home else {
                return ExitCode::FAILURE;
            };
            roll_back_watched(&spec, &home, &failure.why);
            if failure.hung && std::os::unix::process::parent_id() == spec.parent {
                let pid = nix::unistd::Pid::from_raw(i32::try_from(spec.parent).unwrap_or(0));
                match nix::sys::signal::kill(pid, Signal::SIGKILL) {
                    Ok(()) => tracing::warn!(pid = spec.parent, "killed the new dstack-shim"),
                    Err(e) => tracing::error!(error = %e, "cannot kill the new dstack-shim"),
                }
            }
            ExitCode::SUCCESS
        }
    }
}

struct Failure {
    why: String,
    /// The process still runs (it did not answer in time).
    hung: bool,
}

/// Polls the healthcheck until `spec.version` answers (`Ok`), the parent dies or the time
/// is up ([`policy::watch`] judges each poll).
fn watch(spec: &WatchSpec) -> Result<(), Failure> {
    let addr = spec.addr;
    let timeout = Duration::from_millis(spec.timeout_ms);
    let deadline = Instant::now() + timeout;
    loop {
        let answer = healthcheck_version(addr, deadline);
        let parent_alive = std::os::unix::process::parent_id() == spec.parent;
        let timed_out = Instant::now() >= deadline;
        match policy::watch(answer, &spec.version, parent_alive, timed_out, timeout) {
            Watch::Done => return Ok(()),
            Watch::Wait => std::thread::sleep(Duration::from_millis(50)),
            Watch::Failed { why, hung } => return Err(Failure { why, hung }),
        }
    }
}

/// One `GET /api/healthcheck` (bounded by 2 s and `deadline`, no proxy: it is loopback): the
/// version it answers.
fn healthcheck_version(addr: SocketAddr, deadline: Instant) -> Result<String, String> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(100), Duration::from_secs(2));
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .proxy(None)
        .timeout_global(Some(left))
        .http_status_as_error(false)
        .build()
        .into();
    let mut answer = agent
        .get(format!("http://{addr}/api/healthcheck"))
        .call()
        .map_err(|e| e.to_string())?;
    if answer.status() != 200 {
        return Err(format!("it answers {}", answer.status()));
    }
    let body = answer
        .body_mut()
        .with_config()
        .limit(64 * 1024)
        .read_to_string()
        .map_err(|e| e.to_string())?;
    let json: serde_json::Value =
        serde_json::from_str(body.trim()).map_err(|e| format!("bad healthcheck body: {e}"))?;
    json["version"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("no version in {body}"))
}

/// The watchdog's rollback ([`policy::roll_back`]): the path still holds the binary that
/// failed → its own image (the binary that ran before) goes back over it; the record is
/// written either way.
fn roll_back_watched(spec: &WatchSpec, home: &Path, why: &str) {
    let record = RollbackRecord::now(&spec.version, &spec.sha256, why, VERSION);
    let current = digest(&spec.binary).map_err(|e| error_chain(&e));
    if let Err(e) = &current {
        tracing::warn!(error = %e, "cannot read the installed binary; putting the previous one back");
    }
    if policy::roll_back(current, &spec.sha256) {
        roll_back(&spec.binary, home, &record);
    } else {
        tracing::warn!(
            path = %spec.binary.display(),
            "another binary was installed meanwhile: leaving it in place"
        );
        if let Err(e) = record.write(home) {
            tracing::error!(error = %error_chain(&e), "cannot record the rollback");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use super::*;

    /// The watchdog asks the address the API listens on, which an inherited socket may give
    /// as any loopback address (`[::1]`, `127.0.0.2`), not `127.0.0.1`: a new shim answering
    /// there was killed and rolled back.
    #[test]
    fn the_watchdog_asks_the_apis_own_address() {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("[::1]:0")
            .or_else(|_| std::net::TcpListener::bind("127.0.0.2:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request);
                let body = r#"{"service":"dstack-shim","version":"0.22.5"}"#;
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                let _ = stream.write_all(format!("{head}{body}").as_bytes());
            }
        });
        let spec = WatchSpec {
            parent: std::os::unix::process::parent_id(),
            addr,
            binary: PathBuf::new(),
            version: "0.22.5".into(),
            sha256: String::new(),
            timeout_ms: 10_000,
        };
        assert!(watch(&spec).is_ok(), "{addr} not asked");
    }

    /// A recording operating system: what the hand-off asked of it, in order, and the
    /// command it would have executed.
    pub(crate) struct Recording {
        key: FileKey,
        watchdog: Option<bool>,
        calls: Mutex<Vec<&'static str>>,
        exec: Mutex<Option<Executed>>,
    }

    /// A command as `exec` would have run it.
    #[derive(Debug, Default)]
    struct Executed {
        program: PathBuf,
        args: Vec<OsString>,
        env: std::collections::BTreeMap<OsString, Option<OsString>>,
    }

    impl Recording {
        /// The file's key is `key`; the watchdog comes up (`Some(true)`), does not
        /// (`Some(false)`) or cannot be started (`None`).
        fn new(key: FileKey, watchdog: Option<bool>) -> Self {
            Self {
                key,
                watchdog,
                calls: Mutex::new(Vec::new()),
                exec: Mutex::new(None),
            }
        }

        fn calls(&self) -> Vec<&'static str> {
            self.calls.lock().unwrap().clone()
        }

        fn call(&self, what: &'static str) {
            self.calls.lock().unwrap().push(what);
        }
    }

    impl HandoffOs for Recording {
        fn file_key(&self, _path: &Path) -> anyhow::Result<FileKey> {
            self.call("file_key");
            Ok(self.key)
        }

        fn spawn_watchdog(&self, _plan: &Plan, _addr: SocketAddr) -> anyhow::Result<Watchdog> {
            self.call("spawn_watchdog");
            let ready = self
                .watchdog
                .ok_or_else(|| anyhow::anyhow!("cannot start the upgrade watchdog"))?;
            let (tx, rx) = std::sync::mpsc::channel();
            tx.send(ready).unwrap();
            Ok(Watchdog {
                pid: 4242,
                ready: rx,
            })
        }

        fn place_at_first_fd(&self, _socket: &OwnedFd) -> anyhow::Result<()> {
            self.call("place_at_first_fd");
            Ok(())
        }

        fn exec(&self, command: &mut Command) -> std::io::Error {
            self.call("exec");
            *self.exec.lock().unwrap() = Some(Executed {
                program: PathBuf::from(command.get_program()),
                args: command.get_args().map(ToOwned::to_owned).collect(),
                env: command
                    .get_envs()
                    .map(|(k, v)| (k.to_owned(), v.map(ToOwned::to_owned)))
                    .collect(),
            });
            std::io::Error::other("recorded, not executed")
        }

        fn dismiss_watchdog(&self, _watchdog: &Watchdog) {
            self.call("dismiss_watchdog");
        }

        fn own_args(&self) -> (OsString, Vec<OsString>, u32) {
            (
                "dstack-shim".into(),
                vec!["--shim-home".into(), "/root/.dstack".into()],
                777,
            )
        }
    }

    /// A plan to start the file `binary` (its key taken now), and a socket to hand over.
    fn handover(binary: &Path, takes_socket: bool) -> Handover {
        let file = FileKey::at(binary).unwrap();
        let socket = OwnedFd::from(fs_err::File::open("/dev/null").unwrap().into_parts().0);
        Handover {
            plan: Plan {
                path: binary.to_owned(),
                file,
                version: "0.22.5".into(),
                sha256: "00".into(),
                takes_socket,
            },
            socket,
            addr: SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 10998)),
            watchdog: None,
        }
    }

    fn binary() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dstack-shim");
        fs_err::write(&path, b"#!/bin/sh\n").unwrap();
        (dir, path)
    }

    fn os(binary: &Path, watchdog: Option<bool>) -> Recording {
        Recording::new(FileKey::at(binary).unwrap(), watchdog)
    }

    /// The new binary replaces this process with the same argv0 and arguments, the watchdog's
    /// PID in its environment, and the socket at fd 3 announced as systemd announces it
    /// (`LISTEN_PID` this process, `LISTEN_FDS=1`, its name), once the watchdog is ready.
    #[test]
    fn an_upgrade_execs_the_checked_binary_with_the_socket_at_fd_3() {
        let (_dir, path) = binary();
        let os = os(&path, Some(true));
        let e = exec_with(&os, handover(&path, true), &AtomicBool::new(false)).unwrap_err();
        assert!(format!("{e:#}").contains("cannot exec"), "{e:#}");
        assert_eq!(
            os.calls(),
            ["file_key", "spawn_watchdog", "place_at_first_fd", "exec"]
        );
        let executed = os.exec.lock().unwrap().take().unwrap();
        assert_eq!(executed.program, path);
        assert_eq!(
            executed.args,
            [OsString::from("--shim-home"), "/root/.dstack".into()]
        );
        let env = |k: &str| executed.env.get(&OsString::from(k)).cloned();
        assert_eq!(env(listen_fds::LISTEN_PID), Some(Some("777".into())));
        assert_eq!(env(listen_fds::LISTEN_FDS), Some(Some("1".into())));
        assert_eq!(
            env(listen_fds::LISTEN_FDNAMES),
            Some(Some(listen_fds::FD_NAME.into()))
        );
        assert_eq!(env(ENV_WATCHDOG_PID), Some(Some("4242".into())));
        assert_eq!(env(ENV_WATCH_SPEC), Some(None), "removed");
    }

    /// A binary that does not take the socket (an older release): no socket at fd 3, and no
    /// `LISTEN_*` variables (removed, whatever this process was given).
    #[test]
    fn a_binary_that_does_not_take_the_socket_gets_none() {
        let (_dir, path) = binary();
        let os = os(&path, Some(true));
        exec_with(&os, handover(&path, false), &AtomicBool::new(false)).unwrap_err();
        assert_eq!(os.calls(), ["file_key", "spawn_watchdog", "exec"]);
        let executed = os.exec.lock().unwrap().take().unwrap();
        for name in [
            listen_fds::LISTEN_PID,
            listen_fds::LISTEN_FDS,
            listen_fds::LISTEN_FDNAMES,
        ] {
            assert_eq!(
                executed.env.get(&OsString::from(name)),
                Some(&None),
                "{name}"
            );
        }
    }

    /// The file changed after the upgrade was decided (a person replaced it): nothing starts,
    /// not even the watchdog.
    #[test]
    fn a_file_changed_since_the_decision_is_not_started() {
        let (_dir, path) = binary();
        let handover = handover(&path, true);
        fs_err::write(&path, b"#!/bin/sh\nexit 1\n").unwrap();
        let os = os(&path, Some(true));
        let e = exec_with(&os, handover, &AtomicBool::new(false)).unwrap_err();
        assert!(
            format!("{e:#}").contains("changed after the upgrade was decided"),
            "{e:#}"
        );
        assert_eq!(os.calls(), ["file_key"]);
    }

    /// Without a watchdog ready, or one at all, the new binary is not started unprotected:
    /// the process exits instead (as upstream's does).
    #[test]
    fn no_watchdog_no_upgrade() {
        let (_dir, path) = binary();
        for (watchdog, says) in [
            (Some(false), "did not come up"),
            (None, "exiting instead of upgrading"),
        ] {
            let os = os(&path, watchdog);
            let e = exec_with(&os, handover(&path, true), &AtomicBool::new(false)).unwrap_err();
            assert!(format!("{e:#}").contains(says), "{e:#}");
            assert!(!os.calls().contains(&"exec"), "{:?}", os.calls());
            assert!(!os.calls().contains(&"place_at_first_fd"));
        }
    }

    /// A stop signal that came after the async side's last look gives the upgrade up at the
    /// exec's: no exec, the watchdog dismissed, and the error that makes the process exit
    /// as the stop asks.
    #[test]
    fn a_stop_before_the_exec_gives_the_upgrade_up() {
        let (_dir, path) = binary();
        let os = os(&path, Some(true));
        let e = exec_with(&os, handover(&path, true), &AtomicBool::new(true)).unwrap_err();
        assert!(e.is::<StoppedDuringHandoff>(), "{e:#}");
        assert_eq!(
            os.calls(),
            ["file_key", "spawn_watchdog", "dismiss_watchdog"]
        );
    }

    /// A child standing for a watchdog (it sleeps), and whether its PID is still there
    /// (alive or a zombie not reaped).
    fn sleeping_child() -> (i32, impl Fn() -> bool) {
        #[allow(clippy::zombie_processes, reason = "reaped by the code under test")]
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        (pid, move || Path::new(&format!("/proc/{pid}")).exists())
    }

    /// Waits (bounded) until `gone` holds.
    fn until(gone: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !gone() {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// A stop during the hand-off gives the upgrade up: the watchdog, which would take the
    /// exit for a failed start and roll the new binary back, is killed and reaped.
    #[test]
    fn an_abandoned_upgrade_kills_and_reaps_its_watchdog() {
        let (_dir, path) = binary();
        let (pid, exists) = sleeping_child();
        let mut handover = handover(&path, true);
        let (_tx, ready) = std::sync::mpsc::channel();
        let pid_u32 = u32::try_from(pid).unwrap();
        handover.watchdog = Some(Ok(Watchdog {
            pid: pid_u32,
            ready,
        }));
        handover.abandon();
        assert!(!exists(), "killed and reaped at once");
    }

    /// The image an upgrade started, asked to stop before the upgrade was confirmed, dismisses
    /// the watchdog (a stop is no failed start); one that ended on its own is reaped and not
    /// signalled again.
    #[test]
    fn a_dismissed_watchdog_is_killed_and_reaped() {
        let (pid, exists) = sleeping_child();
        let guard = watch_child(pid);
        assert!(exists());
        guard.dismiss();
        assert!(until(|| !exists()), "killed and reaped");
        assert!(guard.0.lock().unwrap().is_none());

        #[allow(clippy::zombie_processes, reason = "reaped by the code under test")]
        let child = Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let guard = watch_child(pid);
        assert!(
            until(|| guard.0.lock().unwrap().is_none()),
            "its end is seen"
        );
        guard.dismiss();
        assert!(
            until(|| !Path::new(&format!("/proc/{pid}")).exists()),
            "reaped"
        );
    }
}
