//! Running external commands with useful error messages, and daemons in a session of their own.

use std::ffi::OsStr;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};
use shim_e2e::harness::open_log;
use shim_e2e::harness::procs::which_program;

/// A new command for `program`, without the variables cargo set for xtask (see
/// [`shim_e2e::harness::scrub_cargo_env`]).
pub fn cmd(program: impl AsRef<OsStr>) -> Command {
    let mut command = Command::new(program);
    shim_e2e::harness::scrub_cargo_env(&mut command);
    command
}

/// The command line of `command`, for messages.
pub use shim_e2e::harness::procs::command_line as display;

/// Runs `command` with inherited stdio (echoing it first); fails on a non-zero exit.
pub fn run(command: &mut Command) -> Result<()> {
    run_shown(command, "")
}

/// [`run`], the echoed line followed by `after` (a redirection, say).
fn run_shown(command: &mut Command, after: &str) -> Result<()> {
    let line = display(command);
    println!("$ {line}{after}");
    let status = command
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    anyhow::ensure!(status.success(), "`{line}` failed: {status}");
    Ok(())
}

/// Runs `command` with `input` on its stdin (stdout/stderr inherited); fails on a non-zero exit.
/// The input is not echoed (it may be a password).
pub fn run_with_stdin(command: &mut Command, input: &[u8]) -> Result<()> {
    let line = display(command);
    println!("$ {line} <input>");
    let mut child = command
        .stdin(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{line}`"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input)
            .with_context(|| format!("could not write to the stdin of `{line}`"))?;
    }
    let status = child
        .wait()
        .with_context(|| format!("could not wait for `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed: {status}");
    }
    Ok(())
}

/// Runs `command` quietly and returns its stdout; on failure the error carries its stderr.
pub fn output(command: &mut Command) -> Result<String> {
    Ok(shim_e2e::harness::procs::output(command)?)
}

/// Whether `command`, run quietly, exits with status 0 (false also when it cannot start).
pub fn succeeds(command: &mut Command) -> bool {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// `name` found in `PATH` or in the system directories (daemons live in `/usr/sbin`, which a
/// non-login root `PATH` may lack), else the bare `name`.
pub fn find_program(name: &str) -> PathBuf {
    which_program(name).unwrap_or_else(|| PathBuf::from(name))
}

/// Whether `name` is a program found in `PATH` or in the system directories.
pub fn have_program(name: &str) -> bool {
    which_program(name).is_some()
}

/// Starts `program args..` as a daemon in a new session (`setsid --fork`), stdin from
/// `/dev/null`, stdout and stderr appended to `log`. It outlives this process and is not killed
/// by a terminal hang-up or Ctrl-C of the xtask.
pub fn spawn_daemon(program: &Path, args: &[&str], log: &Path) -> Result<()> {
    let mut command = cmd(find_program("setsid"));
    command
        .arg("--fork")
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(open_log(log)?)
        .stderr(open_log(log)?);
    run_shown(&mut command, &format!(" >>{} 2>&1", log.display()))
}
