//! The local Docker daemon: detect it, start it once, wait for it.

use std::path::Path;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use shim_e2e::harness::tail;

use crate::{cmd, engines};

/// How long to wait for the daemon to answer after starting it (or finding it starting). A
/// daemon answers in about a second on a clean machine, but one that finds a thousand
/// containers of a killed run cleans up their network sandboxes first (measured: 100 s for
/// 929 on this project's 2-core CI machine).
const START_TIMEOUT: Duration = Duration::from_secs(600);

/// How often a wait for the daemon says it is still waiting.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// Makes sure the main engine ([`engines::MAIN`]: Debian sid's Docker with the containerd
/// image store) answers on the default socket: a daemon that answers there as another engine
/// (Debian 12's own, which earlier versions of xtask started) is stopped first; if none runs,
/// one is started in the background (log in [`engines::main_log`]); then waits for it, at most
/// [`START_TIMEOUT`]. Never starts a second daemon.
pub fn ensure_daemon() -> Result<()> {
    let main = engines::MAIN;
    if main.answers_as_itself() {
        println!(
            "docker: the main engine answers (server {})",
            shim_e2e::harness::docker::server_version().unwrap_or_default()
        );
        return Ok(());
    }
    let running = shim_e2e::harness::procs::default_dockerds();
    let log = engines::main_log();
    if !running.is_empty() {
        if shim_e2e::harness::docker::server_version().is_none()
            && !running.iter().any(|pid| is_main_engine(*pid))
        {
            println!(
                "docker: dockerd is running (pid {running:?}) but does not answer yet; waiting"
            );
            wait_for_daemon(&log, true)?;
        } else if running.iter().all(|pid| is_main_engine(*pid)) {
            println!("docker: the main engine is running (pid {running:?}); waiting for it");
            return wait_for_daemon(&log, true);
        }
        if main.answers_as_itself() {
            return Ok(());
        }
        println!(
            "docker: the daemon on the default socket (pid {running:?}, server {}) is not the \
             main engine ({}); stopping it",
            shim_e2e::harness::docker::server_version().unwrap_or_else(|| "?".to_owned()),
            main.name
        );
        stop_default_daemons(&running)?;
    }
    println!(
        "docker: no daemon running; starting the main engine ({})",
        main.name
    );
    main.spawn()?;
    wait_for_daemon(&log, false)
}

/// Whether `pid` runs in the main engine's mount namespace: there the main engine's root's
/// `/usr` is bound over `/usr` (mountinfo: root of the mount `<root>/usr`, mount point `/usr`).
fn is_main_engine(pid: u32) -> bool {
    let Some(root) = engines::MAIN.suite.root() else {
        return false;
    };
    let usr = root.join("usr");
    let usr = usr.to_string_lossy();
    fs_err::read_to_string(format!("/proc/{pid}/mountinfo")).is_ok_and(|mounts| {
        mounts.lines().any(|line| {
            let mut fields = line.split(' ').skip(3);
            fields.next() == Some(&*usr) && fields.next() == Some("/usr")
        })
    })
}

/// Stops the daemons serving the default socket (SIGTERM; they stop their containers), and
/// waits up to 2 minutes for them to exit.
fn stop_default_daemons(pids: &[u32]) -> Result<()> {
    for pid in pids {
        let _ = cmd::output(cmd::cmd("kill").args(["-TERM", &pid.to_string()]));
    }
    let started = Instant::now();
    while pids
        .iter()
        .any(|pid| Path::new(&format!("/proc/{pid}")).exists())
    {
        if started.elapsed() > Duration::from_secs(120) {
            bail!("dockerd (pid {pids:?}) did not exit within 2 minutes of SIGTERM");
        }
        sleep(Duration::from_millis(200));
    }
    Ok(())
}

fn wait_for_daemon(log: &Path, foreign: bool) -> Result<()> {
    let started = Instant::now();
    let mut next_progress = PROGRESS_EVERY;
    loop {
        if let Some(version) = shim_e2e::harness::docker::server_version() {
            println!(
                "docker: daemon answers (server {version}) after {:.1}s",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
        }
        if started.elapsed() >= next_progress {
            println!(
                "docker: still waiting for the daemon after {}s; last line of {}: {}",
                started.elapsed().as_secs(),
                log.display(),
                tail(log, 1).trim()
            );
            next_progress += PROGRESS_EVERY;
        }
        if started.elapsed() > START_TIMEOUT {
            let whose = if foreign {
                " (that dockerd was not started by xtask; its log may be elsewhere)"
            } else {
                ""
            };
            bail!(
                "the Docker daemon did not answer within {}s{whose}; last lines of {}:\n{}",
                START_TIMEOUT.as_secs(),
                log.display(),
                tail(log, 30)
            );
        }
        // (After a grace period: right after `setsid --fork` the child may not have exec'd yet.)
        if !foreign
            && started.elapsed() > Duration::from_secs(3)
            && shim_e2e::harness::procs::default_dockerds().is_empty()
        {
            bail!(
                "dockerd exited during start-up; last lines of {}:\n{}",
                log.display(),
                tail(log, 30)
            );
        }
        sleep(Duration::from_millis(500));
    }
}
