//! A child process kept running: started at once, restarted with backoff whenever it exits,
//! its output logged line by line at debug level, stopped with SIGTERM then SIGKILL on
//! [`Supervisor::shutdown`], and killed when the supervisor is dropped.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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
}

#[derive(Debug, Default)]
struct State {
    /// The running child's pid, 0 when none runs.
    pid: AtomicU32,
    /// How many times a child was started.
    starts: AtomicU64,
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
        self.task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
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
                tokio::select! {
                    status = child.wait() => {
                        state.pid.store(0, Ordering::SeqCst);
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
                        terminate(name, &mut child, spec.stop_grace).await;
                        state.pid.store(0, Ordering::SeqCst);
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

/// SIGTERM, then SIGKILL if the child is still there after `grace` (upstream: `cmd.Cancel`
/// sends SIGTERM, `cmd.WaitDelay = 5 * time.Second`).
async fn terminate(name: &'static str, child: &mut Child, grace: Duration) {
    let Some(pid) = child.id() else {
        return; // already reaped
    };
    let Ok(raw) = i32::try_from(pid) else {
        let _ = child.kill().await;
        return;
    };
    if let Err(e) = kill(Pid::from_raw(raw), Signal::SIGTERM) {
        tracing::debug!(name, pid, error = %e, "SIGTERM failed");
    }
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(Ok(status)) => tracing::info!(name, pid, %status, "stopped"),
        Ok(Err(e)) => tracing::warn!(name, pid, error = %e, "waiting for the process failed"),
        Err(_) => {
            tracing::warn!(name, pid, ?grace, "did not stop on SIGTERM; killing");
            if let Err(e) = child.kill().await {
                tracing::warn!(name, pid, error = %e, "SIGKILL failed");
            }
        }
    }
}
