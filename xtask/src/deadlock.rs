//! A watch on the local Docker daemon for the one deadlock of Debian 12's `docker.io`
//! (20.10.24) that this project's tests can reach, and the way out of it.
//!
//! libnetwork's `watchLoop` handles an endpoint's deletion holding the controller's lock and
//! then takes the network's (`processEndpointDelete`), while a container leaving the same
//! network holds the network's lock and then takes the controller's (`getSvcRecords`, from
//! `sbLeave`). Many containers stopping at once on the default bridge can interleave the two;
//! from then on every stop, removal and inspect of those containers blocks forever, while
//! `docker version` and `docker ps` still answer. Upstream fixed it in libnetwork's 20.10
//! branch (moby/libnetwork#2679, moby/moby#46661) after 20.10.24; Debian 12 never took it.
//! Seen here once in about twenty runs of the whole suite: 34 containers wedged, every later
//! Docker test hanging until its own time limits.
//!
//! Nothing short of a new daemon ends it. [`Watch`] asks the daemon for its goroutine stacks
//! (`SIGUSR1`, which only writes them to a file) every minute while the tests run and looks for
//! exactly that signature; [`restart_daemon`] replaces a wedged daemon (containerd keeps the
//! containers, the new daemon stops them, as after any crash of `dockerd`).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, Result, bail};

use crate::{cmd, docker, proc};

/// The pid file of the default daemon (`--pidfile`'s default).
const PID_FILE: &str = "/var/run/docker.pid";

/// Where the default daemon writes its goroutine stacks (its `--exec-root`).
const EXEC_ROOT: &str = "/var/run/docker";

/// How long `processEndpointDelete` must have waited on a lock to count: a healthy daemon
/// holds these locks for microseconds.
const STUCK_MINUTES: u32 = 2;

/// How often [`Watch`] looks.
const EVERY: Duration = Duration::from_secs(60);

/// How long `processEndpointDelete` has waited on a lock, in minutes, if a goroutine dump
/// shows the deadlock: a goroutine blocked in it (`semacquire`) for [`STUCK_MINUTES`] or more.
pub fn libnetwork_deadlock(stacks: &str) -> Option<u32> {
    stacks
        .split("\n\n")
        .filter(|block| block.contains("libnetwork.(*controller).processEndpointDelete"))
        .filter_map(|block| {
            let header = block.trim_start().lines().next()?;
            let state = header.split_once('[')?.1.split_once(']')?.0;
            let (what, minutes) = state.split_once(", ")?;
            let minutes: u32 = minutes.strip_suffix(" minutes")?.parse().ok()?;
            (what == "semacquire" && minutes >= STUCK_MINUTES).then_some(minutes)
        })
        .max()
}

/// The default daemon's pid, from its pid file, if that process runs.
fn daemon_pid() -> Option<u32> {
    let pid: u32 = fs_err::read_to_string(PID_FILE).ok()?.trim().parse().ok()?;
    proc::find("dockerd", None).contains(&pid).then_some(pid)
}

/// The daemon's goroutine stacks: `SIGUSR1`, then the file it writes under [`EXEC_ROOT`]
/// (read and removed). `None` if there is no daemon or it wrote nothing within 10 s.
fn dump_stacks() -> Option<String> {
    let pid = daemon_pid()?;
    let asked = SystemTime::now();
    cmd::output(cmd::cmd("kill").args(["-USR1", &pid.to_string()])).ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
        let newest = fs_err::read_dir(EXEC_ROOT)
            .ok()?
            .flatten()
            .filter(|entry| {
                entry
                    .file_name()
                    .to_string_lossy()
                    .starts_with("goroutine-stacks-")
            })
            .filter(|entry| {
                entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t >= asked - Duration::from_secs(1))
            })
            .map(|entry| entry.path())
            .max();
        if let Some(path) = newest {
            // Written in one go, but give a large dump a moment to be complete.
            thread::sleep(Duration::from_millis(500));
            let stacks = fs_err::read_to_string(&path).ok();
            let _ = fs_err::remove_file(&path);
            return stacks;
        }
    }
    None
}

/// `cargo xtask docker-deadlock [--fix]`: says whether the default daemon is deadlocked;
/// with `fix`, replaces it if so.
pub fn check(fix: bool) -> Result<()> {
    let Some(stacks) = dump_stacks() else {
        bail!("no goroutine dump from the default dockerd (none runs, or it wrote none in 10 s)");
    };
    match libnetwork_deadlock(&stacks) {
        None => {
            println!("docker: the daemon is not in the libnetwork deadlock");
            Ok(())
        }
        Some(minutes) => {
            println!(
                "docker: the daemon is deadlocked in libnetwork (processEndpointDelete has \
                 waited {minutes} minutes for a lock: moby/moby#46661)"
            );
            if fix {
                restart_daemon()
            } else {
                bail!("the daemon is deadlocked; `cargo xtask docker-deadlock --fix` replaces it")
            }
        }
    }
}

/// Watches the default daemon while `child` (a test run) goes on; on the deadlock, sends the
/// run SIGTERM (nextest ends its tests) and, a minute later, SIGKILL.
pub struct Watch {
    stop: Arc<AtomicBool>,
    minutes: Arc<AtomicU32>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Starts watching on behalf of `child`.
    pub fn start(child: &Child) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let minutes = Arc::new(AtomicU32::new(0));
        let pid = child.id();
        let thread = {
            let (stop, minutes) = (Arc::clone(&stop), Arc::clone(&minutes));
            thread::spawn(move || {
                let mut next = Instant::now() + EVERY;
                while !stop.load(Ordering::SeqCst) {
                    thread::sleep(Duration::from_millis(250));
                    if Instant::now() < next {
                        continue;
                    }
                    next = Instant::now() + EVERY;
                    let Some(stuck) = dump_stacks().as_deref().and_then(libnetwork_deadlock) else {
                        continue;
                    };
                    minutes.store(stuck, Ordering::SeqCst);
                    println!(
                        "\nci: dockerd is deadlocked in libnetwork (processEndpointDelete has \
                         waited {stuck} minutes for a lock: moby/moby#46661, fixed after the \
                         20.10.24 of Debian 12); ending this test run"
                    );
                    end(pid);
                    return;
                }
            })
        };
        Self {
            stop,
            minutes,
            thread: Some(thread),
        }
    }

    /// Stops watching; the minutes the daemon had been deadlocked if it was.
    pub fn finish(mut self) -> Option<u32> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        Some(self.minutes.load(Ordering::SeqCst)).filter(|m| *m > 0)
    }
}

/// SIGTERM to `pid`, SIGKILL a minute later if it still runs.
fn end(pid: u32) {
    let _ = cmd::output(cmd::cmd("kill").args(["-TERM", &pid.to_string()]));
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline && Path::new(&format!("/proc/{pid}")).exists() {
        thread::sleep(Duration::from_millis(500));
    }
    let _ = cmd::output(cmd::cmd("kill").args(["-KILL", &pid.to_string()]));
}

/// Replaces the default daemon: SIGKILL to `dockerd` and the `containerd` it runs (a wedged
/// daemon does not finish a graceful stop), then [`docker::ensure_daemon`] (through systemd
/// when `docker.service` runs it). The containerd
/// shims live on, so the new containerd finds the containers and the new daemon, without
/// live restore, stops them and cleans up their networks.
pub fn restart_daemon() -> Result<()> {
    // A daemon systemd runs (`docker.service`, Restart=always) is systemd's to restart: a
    // second one started here would race it for the pid file.
    if cmd::succeeds(cmd::cmd("systemctl").args(["is-active", "--quiet", "docker"])) {
        println!("docker: restarting docker.service");
        cmd::run(cmd::cmd("systemctl").args(["kill", "--signal=KILL", "docker"]))?;
        cmd::run(cmd::cmd("systemctl").args(["restart", "docker"]))?;
        return docker::ensure_daemon().context("waiting for the restarted docker.service");
    }
    let Some(pid) = daemon_pid() else {
        bail!("no dockerd runs with the pid in {PID_FILE}");
    };
    let containerd = children_named(pid, "containerd");
    let mut doomed = vec![pid];
    doomed.extend(&containerd);
    println!("docker: killing dockerd {pid} and its containerd {containerd:?}");
    for victim in &doomed {
        let _ = cmd::output(cmd::cmd("kill").args(["-KILL", &victim.to_string()]));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while doomed
        .iter()
        .any(|victim| PathBuf::from(format!("/proc/{victim}")).exists())
    {
        if Instant::now() > deadline {
            bail!("dockerd or containerd did not die within 30 s of SIGKILL");
        }
        thread::sleep(Duration::from_millis(100));
    }
    docker::ensure_daemon().context("starting a new dockerd")
}

/// The pids of `parent`'s children named `name`.
fn children_named(parent: u32, name: &str) -> Vec<u32> {
    proc::find(name, None)
        .into_iter()
        .filter(|pid| {
            fs_err::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = stat.rsplit_once(')')?.1.to_owned();
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four goroutines from the dump of the daemon that wedged a CI run here (2026-12-02):
    /// `watchLoop` in `processEndpointDelete` for 11 minutes, a `sbLeave` caller, a container
    /// waiter and an idle driver loop.
    const DEADLOCKED: &str = include_str!("../testdata/dockerd-libnetwork-deadlock.stacks");

    #[test]
    fn the_deadlock_of_a_wedged_daemon_is_recognised() {
        assert_eq!(libnetwork_deadlock(DEADLOCKED), Some(11));
    }

    #[test]
    fn a_short_wait_or_another_state_is_not_the_deadlock() {
        let fresh = DEADLOCKED.replace("[semacquire, 11 minutes]", "[semacquire]");
        let watch_loop_only: String = fresh
            .split("\n\n")
            .filter(|b| b.contains("processEndpointDelete"))
            .collect();
        assert!(!watch_loop_only.is_empty());
        assert_eq!(libnetwork_deadlock(&fresh), None);
        let one_minute = DEADLOCKED.replace("[semacquire, 11 minutes]", "[semacquire, 1 minutes]");
        assert_eq!(libnetwork_deadlock(&one_minute), None);
        let running = DEADLOCKED.replace("[semacquire, 11 minutes]", "[runnable]");
        assert_eq!(libnetwork_deadlock(&running), None);
        // The other goroutines alone, however long they wait, are not it.
        let others: String = DEADLOCKED
            .split("\n\n")
            .filter(|b| !b.contains("processEndpointDelete"))
            .collect::<Vec<_>>()
            .join("\n\n");
        assert_eq!(libnetwork_deadlock(&others), None);
    }

    #[test]
    fn children_are_found_by_parent() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let found = children_named(std::process::id(), "sleep");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found, vec![child.id()]);
    }
}
