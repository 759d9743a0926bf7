//! The one deadlock of Debian 12's `docker.io` (20.10.24) that this project's tests can reach,
//! recognised in the daemon's goroutine stacks.
//!
//! libnetwork's `watchLoop` handles an endpoint's deletion holding the controller's lock and
//! then takes the network's (`processEndpointDelete`), while a container leaving the same
//! network holds the network's lock and then takes the controller's (`getSvcRecords`, from
//! `sbLeave`). Many containers stopping at once on the default bridge can interleave the two;
//! from then on every stop, removal and inspect of those containers blocks forever, while
//! `docker version` and `docker ps` still answer. Upstream fixed it in libnetwork's 20.10
//! branch (moby/libnetwork#2679, moby/moby#46661) after 20.10.24; Debian 12 never took it.
//! Seen once in about twenty runs of the whole suite when 20.10 was the main engine; now that
//! it is a conformance engine, a failed run on it is checked with [`find`], and retried once
//! when this is why ([`crate::conformance`]).

use std::thread;
use std::time::{Duration, Instant, SystemTime};

use crate::cmd;
use crate::engines::Engine;

/// How long `processEndpointDelete` must have waited on a lock to count: a healthy daemon
/// holds these locks for microseconds.
const STUCK_MINUTES: u32 = 2;

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

/// The goroutine stacks of `engine`'s dockerd: `SIGUSR1`, then the file it writes under its
/// exec root (read and removed). `None` if it does not run or wrote nothing within 10 s.
fn dump_stacks(engine: &Engine) -> Option<String> {
    let pid = *engine.pids().first()?;
    let exec_root = engine.exec_root();
    let asked = SystemTime::now();
    cmd::output(cmd::cmd("kill").args(["-USR1", &pid.to_string()])).ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
        let newest = fs_err::read_dir(&exec_root)
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

/// How long `engine`'s dockerd has been in the libnetwork deadlock, in minutes, if it is.
pub fn find(engine: &Engine) -> Option<u32> {
    dump_stacks(engine).as_deref().and_then(libnetwork_deadlock)
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
}
