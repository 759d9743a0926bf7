//! Running external commands with useful error messages.

use std::ffi::OsStr;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};

/// A new command for `program`, without the variables cargo set for xtask (see
/// [`shim_e2e::harness::scrub_cargo_env`]).
pub fn cmd(program: impl AsRef<OsStr>) -> Command {
    let mut command = Command::new(program);
    shim_e2e::harness::scrub_cargo_env(&mut command);
    command
}

/// The command line of `command`, for messages.
pub fn display(command: &Command) -> String {
    let mut line = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        line.push(' ');
        let arg = arg.to_string_lossy();
        if arg.is_empty() || arg.contains([' ', '"', '\'', '$', '\\']) {
            line.push('\'');
            line.push_str(&arg.replace('\'', r"'\''"));
            line.push('\'');
        } else {
            line.push_str(&arg);
        }
    }
    line
}

/// Runs `command` with inherited stdio (echoing it first); fails on a non-zero exit.
pub fn run(command: &mut Command) -> Result<()> {
    let line = display(command);
    println!("$ {line}");
    let status = command
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed: {status}");
    }
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
    let line = display(command);
    let out = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("could not start `{line}`"))?;
    if !out.status.success() {
        bail!(
            "`{line}` failed: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).with_context(|| format!("`{line}` printed invalid UTF-8"))
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

/// The first of `candidates` that is a file, else the bare `name` (looked up in `PATH`).
/// Daemons live in `/usr/sbin`, which a non-login root `PATH` may lack.
pub fn find_program(name: &str) -> PathBuf {
    [
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
        "/usr/local/bin",
        "/usr/local/sbin",
    ]
    .iter()
    .map(|dir| Path::new(dir).join(name))
    .find(|path| path.is_file())
    .unwrap_or_else(|| PathBuf::from(name))
}

/// Whether `name` is a program found in `PATH` or in the usual system directories.
pub fn have_program(name: &str) -> bool {
    if find_program(name).is_absolute() {
        return true;
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_quotes_what_a_shell_would_split() {
        let mut command = cmd("docker");
        command.args(["import", "--change", "CMD [\"/bin/sh\"]", "", "it's"]);
        assert_eq!(
            display(&command),
            r#"docker import --change 'CMD ["/bin/sh"]' '' 'it'\''s'"#
        );
    }

    #[test]
    fn output_reports_the_failing_command_and_its_stderr() {
        let err = output(cmd("sh").args(["-c", "echo boom >&2; exit 3"])).unwrap_err();
        let message = format!("{err:#}");
        assert!(message.contains("sh -c"), "{message}");
        assert!(message.contains("boom"), "{message}");
        assert_eq!(output(cmd("sh").args(["-c", "echo hi"])).unwrap(), "hi\n");
    }
}
