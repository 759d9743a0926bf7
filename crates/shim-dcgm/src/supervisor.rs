//! A child process kept running: started at once, restarted with backoff whenever it exits,
//! its output logged line by line at debug level, stopped with SIGTERM then SIGKILL on
//! [`Supervisor::shutdown`], and killed when the supervisor is dropped.
//!
//! With a pid file ([`ChildSpec::pid_file`]) the running child is recorded as `<pid> <start
//! time> <boot id>` (the start time in clock ticks since boot, `/proc/<pid>/stat` field 22;
//! the boot id from `/proc/sys/kernel/random/boot_id`), and the file is removed when the child
//! ends. A shim killed without its shutdown leaves the child running and the file behind:
//! before its first start, the next supervisor stops the process the file names (SIGTERM,
//! SIGKILL after the grace period), but only if that pid still has the recorded start time in
//! the same boot, so a pid reused by another process is never signalled.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::Backoff;

/// What to run and how to treat it.
#[derive(Debug, Clone)]
pub(crate) struct ChildSpec {
    /// A short name for logs (`dcgm-exporter`, `nv-hostengine`).
    pub name: &'static str,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub stop_grace: Duration,
    pub backoff: Backoff,
    /// Where the running child's pid is recorded (see the module docs); `None`: nowhere.
    pub pid_file: Option<PathBuf>,
}

#[derive(Debug, Default)]
struct State {
    /// The running child's pid, 0 when none runs.
    pid: AtomicU32,
    /// How many times a child was started.
    starts: AtomicU64,
}

impl ChildSpec {
    /// `program args` as `name`, with `config`'s grace period and backoff, and its pid file
    /// `<state dir>/<name>.pid` when `config` has a state directory.
    pub(crate) fn new(
        name: &'static str,
        program: &std::path::Path,
        args: Vec<OsString>,
        config: &crate::DcgmConfig,
    ) -> Self {
        Self {
            name,
            program: program.to_path_buf(),
            args,
            stop_grace: config.stop_grace,
            backoff: config.backoff,
            pid_file: config
                .state_dir
                .as_ref()
                .map(|d| d.join(format!("{name}.pid"))),
        }
    }
}

/// The handle of a supervised child. Dropping it kills the child (SIGKILL); prefer
/// [`Supervisor::shutdown`], which lets it exit on SIGTERM first.
#[derive(Debug)]
pub(crate) struct Supervisor {
    stop: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
    state: Arc<State>,
}

impl Supervisor {
    /// Starts supervising; the first start happens at once in the background. Must be called
    /// inside a tokio runtime.
    pub fn spawn(spec: ChildSpec) -> Self {
        let (stop, stop_rx) = watch::channel(false);
        let state = Arc::new(State::default());
        let task = tokio::spawn(run(spec, stop_rx, state.clone()));
        Self {
            stop,
            task: Mutex::new(Some(task)),
            state,
        }
    }

    /// The running child's pid.
    pub fn pid(&self) -> Option<u32> {
        match self.state.pid.load(Ordering::SeqCst) {
            0 => None,
            pid => Some(pid),
        }
    }

    /// How many times a child was started (1 + restarts).
    pub fn starts(&self) -> u64 {
        self.state.starts.load(Ordering::SeqCst)
    }

    fn take_task(&self) -> Option<JoinHandle<()>> {
        crate::take(&self.task)
    }

    /// Stops restarting and stops the child: SIGTERM, SIGKILL after the grace period. Later
    /// calls return at once.
    pub async fn shutdown(&self) {
        self.stop.send_replace(true);
        if let Some(task) = self.take_task()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "a supervisor task failed");
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Aborting drops the task's future and with it the Child, whose kill_on_drop sends
        // SIGKILL.
        if let Some(task) = self.take_task() {
            task.abort();
        }
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    // A dropped sender means the owner is gone: stop as well.
    let _ = stop.wait_for(|s| *s).await;
}

async fn run(spec: ChildSpec, mut stop: watch::Receiver<bool>, state: Arc<State>) {
    let name = spec.name;
    let mut delay = spec.backoff.initial;
    if let Some(file) = &spec.pid_file {
        stop_leftover(&spec, file).await;
    }
    loop {
        if *stop.borrow() {
            return;
        }
        let started = Instant::now();
        match start(&spec) {
            Ok(mut child) => {
                let pid = child.id().unwrap_or(0);
                state.pid.store(pid, Ordering::SeqCst);
                state.starts.fetch_add(1, Ordering::SeqCst);
                tracing::info!(name, pid, program = %spec.program.display(), "started");
                if let Some(file) = &spec.pid_file {
                    record_pid(name, file, pid);
                }
                tokio::select! {
                    status = child.wait() => {
                        state.pid.store(0, Ordering::SeqCst);
                        forget_pid(name, spec.pid_file.as_deref());
                        if started.elapsed() >= spec.backoff.reset_after {
                            delay = spec.backoff.initial;
                        }
                        match status {
                            Ok(status) => tracing::warn!(
                                name, pid, %status, restart_in = ?delay, "exited; restarting"
                            ),
                            Err(e) => tracing::warn!(
                                name, pid, error = %e, restart_in = ?delay,
                                "lost track of the process; restarting"
                            ),
                        }
                    }
                    () = stopped(&mut stop) => {
                        let ended = terminate(name, &mut child, spec.stop_grace).await;
                        state.pid.store(0, Ordering::SeqCst);
                        // One left behind keeps its pid file: the next start stops it.
                        if ended {
                            forget_pid(name, spec.pid_file.as_deref());
                        }
                        return;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(
                    name, program = %spec.program.display(), error = %e, retry_in = ?delay,
                    "failed to start"
                );
            }
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stopped(&mut stop) => return,
        }
        delay = (delay * 2).min(spec.backoff.max);
    }
}

fn start(spec: &ChildSpec) -> std::io::Result<Child> {
    let mut child = Command::new(&spec.program)
        .args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    if let Some(out) = child.stdout.take() {
        tokio::spawn(log_lines(spec.name, "stdout", out));
    }
    if let Some(err) = child.stderr.take() {
        tokio::spawn(log_lines(spec.name, "stderr", err));
    }
    Ok(child)
}

async fn log_lines(name: &'static str, stream: &'static str, out: impl AsyncRead + Unpin) {
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next_line().await {
            Ok(Some(line)) => tracing::debug!(name, stream, "{line}"),
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(name, stream, error = %e, "stopped reading the output");
                return;
            }
        }
    }
}

/// How long a child is waited for after SIGKILL. One stuck in the kernel (an NVML call into a
/// wedged driver) does not die until that call returns, and a shutdown (an upgrade's, whose
/// watchdog would roll back a binary that never ran) must not wait for it.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// SIGTERM, then SIGKILL if the child is still there after `grace` (upstream: `cmd.Cancel`
/// sends SIGTERM, `cmd.WaitDelay = 5 * time.Second`); whether it ended. One still there
/// [`KILL_WAIT`] after its SIGKILL is left behind (tokio reaps it once it dies).
async fn terminate(name: &'static str, child: &mut Child, grace: Duration) -> bool {
    let Some(pid) = child.id() else {
        return true; // already reaped
    };
    if let Ok(raw) = i32::try_from(pid) {
        if let Err(e) = kill(Pid::from_raw(raw), Signal::SIGTERM) {
            tracing::debug!(name, pid, error = %e, "SIGTERM failed");
        }
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(Ok(status)) => {
                tracing::info!(name, pid, %status, "stopped");
                return true;
            }
            Ok(Err(e)) => {
                tracing::warn!(name, pid, error = %e, "waiting for the process failed");
                return false;
            }
            Err(_) => tracing::warn!(name, pid, ?grace, "did not stop on SIGTERM; killing"),
        }
    }
    if let Err(e) = child.start_kill() {
        tracing::warn!(name, pid, error = %e, "SIGKILL failed");
    }
    match tokio::time::timeout(KILL_WAIT, child.wait()).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => {
            tracing::warn!(name, pid, error = %e, "waiting for the process failed");
            false
        }
        Err(_) => {
            tracing::warn!(name, pid, wait = ?KILL_WAIT, "did not exit on SIGKILL (stuck in the kernel?); left behind, its pid file kept for the next start");
            false
        }
    }
}

/// The start time of process `pid` (clock ticks since boot, `/proc/<pid>/stat` field 22), and
/// whether it is a zombie (exited, not yet reaped); `None` when there is no such process.
fn process_start(pid: u32) -> Option<(u64, bool)> {
    let stat = fs_err::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ...": the comm may hold anything, so fields count from the last ')'.
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let zombie = fields.first().is_some_and(|s| matches!(*s, "Z" | "X"));
    Some((fields.get(19)?.parse().ok()?, zombie))
}

/// This boot's id: with a pid and its start time, it names one process for good.
fn boot_id() -> Option<String> {
    let id = fs_err::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(id.trim().to_owned()).filter(|id| !id.is_empty())
}

/// Records the running child `pid` in `file` (written aside and renamed into place).
fn record_pid(name: &'static str, file: &std::path::Path, pid: u32) {
    let (Some((start, _)), Some(boot)) = (process_start(pid), boot_id()) else {
        return; // already gone (or no /proc): nothing to record
    };
    let tmp = file.with_extension("pid.tmp");
    let written = fs_err::write(&tmp, format!("{pid} {start} {boot}\n"))
        .and_then(|()| fs_err::rename(&tmp, file));
    if let Err(e) = written {
        tracing::warn!(name, pid, error = %e, "cannot record the pid; a shim killed now would leave it running");
    }
}

/// Removes the pid file once its child ended.
fn forget_pid(name: &'static str, file: Option<&std::path::Path>) {
    if let Some(file) = file
        && let Err(e) = fs_err::remove_file(file)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(name, error = %e, "cannot remove the pid file");
    }
}

/// Stops the child a previous supervisor of the same program left running (its pid file
/// survived it): SIGTERM, then SIGKILL after the grace period. A pid file that names no such
/// process any more (another start time, another boot) is only removed.
async fn stop_leftover(spec: &ChildSpec, file: &std::path::Path) {
    let name = spec.name;
    let recorded = match fs_err::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => {
            tracing::warn!(name, error = %e, "cannot read the pid file of a previous run");
            return;
        }
    };
    forget_pid(name, Some(file));
    let mut words = recorded.split_whitespace();
    let parsed = (
        words.next().and_then(|w| w.parse::<i32>().ok()),
        words.next().and_then(|w| w.parse::<u64>().ok()),
        words.next(),
    );
    let (Some(raw), Some(start), Some(boot)) = parsed else {
        tracing::warn!(name, file = %file.display(), "ignoring an unreadable pid file");
        return;
    };
    let Ok(pid) = u32::try_from(raw) else { return };
    let same = || process_start(pid).is_some_and(|(s, zombie)| s == start && !zombie);
    if boot_id().as_deref() != Some(boot) || !same() {
        return;
    }
    tracing::warn!(
        name,
        pid,
        "stopping the process a previous shim left running"
    );
    let _ = kill(Pid::from_raw(raw), Signal::SIGTERM);
    if !gone_within(&same, spec.stop_grace).await {
        tracing::warn!(name, pid, grace = ?spec.stop_grace, "did not stop on SIGTERM; killing");
        let _ = kill(Pid::from_raw(raw), Signal::SIGKILL);
        gone_within(&same, Duration::from_secs(5)).await;
    }
}

/// Waits until `alive` says no, at most `limit`; returns whether it did.
async fn gone_within(alive: &impl Fn() -> bool, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while alive() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}
