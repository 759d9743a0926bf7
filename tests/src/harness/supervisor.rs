//! [`Supervisor`]: runs a command the way systemd runs the unit the dstack server writes for
//! the shim (`Type=simple`, `Restart=always`, `RestartSec=3`, the default
//! `KillMode=control-group`; upstream: src/dstack/_internal/server/services/ssh_fleets/
//! provisioning.py, run_shim_as_systemd_service), for tests on machines without systemd.
//!
//! The command runs in a process group of its own (the unit's control group). When its main
//! process exits, the rest of the group gets SIGTERM (SIGKILL after [`STOP_BOUND`], as
//! `TimeoutStopSec`), and once the group is empty the command is started again after the
//! restart delay. The main process may `exec` itself: it stays the same process.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::process::open_log;

/// How long the rest of the group has to exit after SIGTERM before SIGKILL (systemd's
/// default `TimeoutStopSec`).
pub const STOP_BOUND: Duration = Duration::from_secs(90);

/// One start of the supervised command.
#[derive(Debug, Clone)]
pub struct Start {
    /// Its process id (also its process group's).
    pub pid: u32,
    /// When it was started.
    pub at: Instant,
    /// How its main process exited, once it did.
    pub exit: Option<ExitStatus>,
    /// When the rest of its group was gone too (the restart delay starts then).
    pub ended: Option<Instant>,
}

#[derive(Debug, Default)]
struct Shared {
    starts: Mutex<Vec<Start>>,
    stop: AtomicBool,
}

impl Shared {
    fn starts(&self) -> std::sync::MutexGuard<'_, Vec<Start>> {
        self.starts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A command kept running as systemd keeps a unit with `Restart=always`. Stopped (its whole
/// process group killed, no restart) by [`Supervisor::stop`] or when dropped.
#[derive(Debug)]
pub struct Supervisor {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    log: PathBuf,
}

impl Supervisor {
    /// Starts `make()`'s command now and again `restart_delay` after each end, stdout and
    /// stderr appended to `log`.
    pub fn start(
        mut make: impl FnMut() -> Command + Send + 'static,
        restart_delay: Duration,
        log: &Path,
    ) -> io::Result<Self> {
        let shared = Arc::new(Shared::default());
        // The first start happens here, so that a command that cannot start fails the call.
        let first = spawn(&mut make, log)?;
        shared.starts().push(Start {
            pid: first.id(),
            at: Instant::now(),
            exit: None,
            ended: None,
        });
        let thread = {
            let shared = shared.clone();
            let log = log.to_owned();
            std::thread::Builder::new()
                .name("supervisor".into())
                .spawn(move || supervise(first, make, restart_delay, &log, &shared))?
        };
        Ok(Self {
            shared,
            thread: Some(thread),
            log: log.to_owned(),
        })
    }

    /// The process id of the running start (`None` between starts).
    pub fn pid(&self) -> Option<u32> {
        self.shared
            .starts()
            .last()
            .filter(|s| s.exit.is_none())
            .map(|s| s.pid)
    }

    /// Every start so far, first first.
    pub fn starts(&self) -> Vec<Start> {
        self.shared.starts().clone()
    }

    /// The log file of every start.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// No more restarts; the running start's whole process group is killed (SIGKILL) and
    /// waited for.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(pid) = self.pid() {
            signal_group(pid, "KILL");
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop();
    }
}

fn spawn(make: &mut impl FnMut() -> Command, log: &Path) -> io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt as _;
    let mut command = make();
    command
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(open_log(log)?)
        .stderr(open_log(log)?);
    command
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot start {command:?}: {e}")))
}

fn supervise(
    mut child: std::process::Child,
    mut make: impl FnMut() -> Command,
    restart_delay: Duration,
    log: &Path,
    shared: &Shared,
) {
    loop {
        let pid = child.id();
        let status = child.wait();
        let stopping = shared.stop.load(Ordering::SeqCst);
        // KillMode=control-group: what the main process left in its group is stopped too.
        signal_group(pid, if stopping { "KILL" } else { "TERM" });
        let started = Instant::now();
        while !group_members(pid).is_empty() {
            if started.elapsed() > STOP_BOUND {
                signal_group(pid, "KILL");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        {
            let mut starts = shared.starts();
            if let Some(last) = starts.last_mut() {
                last.exit = status.ok();
                last.ended = Some(Instant::now());
            }
        }
        // RestartSec, counted from the unit's stop; a stop request ends it at once.
        let until = Instant::now() + restart_delay;
        while Instant::now() < until {
            if shared.stop.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        loop {
            match spawn(&mut make, log) {
                Ok(next) => {
                    shared.starts().push(Start {
                        pid: next.id(),
                        at: Instant::now(),
                        exit: None,
                        ended: None,
                    });
                    child = next;
                    break;
                }
                // As systemd: the start failed, try again after the delay.
                Err(_) => std::thread::sleep(restart_delay),
            }
            if shared.stop.load(Ordering::SeqCst) {
                return;
            }
        }
    }
}

/// Sends `signal` (a `kill` name) to process group `pgid`.
fn signal_group(pgid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{signal}"), "--", &format!("-{pgid}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The live (not zombie) processes of process group `pgid`, from `/proc`.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = fs_err::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // `pid (comm) state ppid pgrp …`; comm may hold spaces and parentheses.
            let Ok(stat) = fs_err::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields.first().is_some_and(|state| *state != "Z")
                && fields.get(2).and_then(|g| g.parse::<u32>().ok()) == Some(pgid)
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "test code")]
mod tests {
    use super::*;

    /// A script that leaves a child behind in its group and exits 3 is restarted after the
    /// delay, once the child is gone (it ignores nothing: SIGTERM ends it).
    #[test]
    fn restarts_after_the_delay_and_stops_the_group() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("out.log");
        let script = "echo start $$; sleep 600 & exit 3";
        let mut sup = Supervisor::start(
            move || {
                let mut c = Command::new("sh");
                c.args(["-c", script]);
                c
            },
            Duration::from_millis(300),
            &log,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while sup.starts().len() < 2 {
            assert!(
                Instant::now() < deadline,
                "not restarted: {:?}",
                sup.starts()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let starts = sup.starts();
        let first = &starts[0];
        assert_eq!(first.exit.unwrap().code(), Some(3));
        assert!(
            group_members(first.pid).is_empty(),
            "the left child was stopped"
        );
        assert!(starts[1].at >= first.ended.unwrap() + Duration::from_millis(300));
        sup.stop();
        let last = sup.starts().last().unwrap().pid;
        assert!(group_members(last).is_empty());
        let text = fs_err::read_to_string(&log).unwrap();
        assert!(text.matches("start ").count() >= 2, "{text}");
    }
}
