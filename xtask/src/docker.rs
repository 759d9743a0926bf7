//! The local Docker daemon: detect it, start it once, wait for it.

use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use shim_e2e::harness::tail;

use crate::{cmd, paths, proc};

/// How long to wait for the daemon to answer after starting it (or finding it starting).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The log of a `dockerd` started by xtask.
pub fn log_path() -> PathBuf {
    paths::log_dir().join("dockerd.log")
}

/// The daemon's version if the Docker socket answers within a few seconds.
pub fn server_version() -> Option<String> {
    // `timeout`: a daemon that accepts the connection but hangs must not hang xtask.
    cmd::output(cmd::cmd("timeout").args([
        "10",
        "docker",
        "version",
        "--format",
        "{{.Server.Version}}",
    ]))
    .ok()
    .map(|version| version.trim().to_owned())
    .filter(|version| !version.is_empty())
}

/// Makes sure a Docker daemon answers: if the socket does not answer and no `dockerd` is
/// running, starts one in the background (its own session, log in [`log_path`]); then waits
/// for it, at most [`START_TIMEOUT`]. Never starts a second daemon.
pub fn ensure_daemon() -> Result<()> {
    if let Some(version) = server_version() {
        println!("docker: daemon answers (server {version})");
        return Ok(());
    }
    let running = proc::find("dockerd", None);
    let log = log_path();
    if running.is_empty() {
        println!("docker: no daemon running; starting dockerd");
        proc::spawn_daemon(&cmd::find_program("dockerd"), &[], &log)?;
    } else {
        println!(
            "docker: dockerd is running (pid {running:?}) but does not answer yet; waiting for it"
        );
    }
    wait_for_daemon(&log, !running.is_empty())
}

fn wait_for_daemon(log: &Path, foreign: bool) -> Result<()> {
    let started = Instant::now();
    loop {
        if let Some(version) = server_version() {
            println!(
                "docker: daemon answers (server {version}) after {:.1}s",
                started.elapsed().as_secs_f64()
            );
            return Ok(());
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
            && proc::find("dockerd", None).is_empty()
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
