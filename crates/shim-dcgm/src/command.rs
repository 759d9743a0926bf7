//! Running a program to completion with a timeout, behind [`CommandRunner`] so that embedders
//! and tests can substitute their own.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;

use crate::DcgmError;

/// What a finished program left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOutput {
    /// Whether it exited with status 0.
    pub success: bool,
    /// Its exit status as text (`exit status: 1`, `signal: 9 (SIGKILL)`).
    pub status: String,
    /// Its standard output (lossily decoded).
    pub stdout: String,
    /// Its standard error (lossily decoded).
    pub stderr: String,
}

/// Runs a program to completion.
#[async_trait]
pub trait CommandRunner: Send + Sync + 'static {
    /// Runs `program args...` with stdin closed, collecting its output; kills it after
    /// `timeout` ([`DcgmError::CommandTimeout`]). A non-zero exit is not an error here.
    async fn run(
        &self,
        program: &Path,
        args: &[String],
        timeout: Duration,
    ) -> Result<CommandOutput, DcgmError>;
}

/// The real runner: `tokio::process`.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioCommandRunner;

#[async_trait]
impl CommandRunner for TokioCommandRunner {
    async fn run(
        &self,
        program: &Path,
        args: &[String],
        timeout: Duration,
    ) -> Result<CommandOutput, DcgmError> {
        let child = tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| DcgmError::Spawn {
                program: PathBuf::from(program),
                source,
            })?;
        match tokio::time::timeout(timeout, child.wait_with_output()).await {
            Ok(Ok(out)) => Ok(CommandOutput {
                success: out.status.success(),
                status: out.status.to_string(),
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }),
            Ok(Err(source)) => Err(DcgmError::Spawn {
                program: PathBuf::from(program),
                source,
            }),
            // Dropping the future dropped the child: kill_on_drop killed it.
            Err(_) => Err(DcgmError::CommandTimeout {
                command: command_line(program, args),
                timeout,
            }),
        }
    }
}

/// `program arg...` for messages.
pub(crate) fn command_line(program: &Path, args: &[String]) -> String {
    let mut s = program.display().to_string();
    for a in args {
        s.push(' ');
        s.push_str(a);
    }
    s
}

/// The start of a program's stdout and stderr, for error messages.
pub(crate) fn output_excerpt(out: &CommandOutput) -> String {
    const MAX: usize = 500;
    let text = format!("{} {}", out.stdout.trim(), out.stderr.trim());
    let text = text.trim();
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_collects_and_times_out() {
        let sh = Path::new("/bin/sh");
        let args = |s: &str| vec!["-c".to_owned(), s.to_owned()];
        let out = TokioCommandRunner
            .run(
                sh,
                &args("echo out; echo err >&2; exit 3"),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        assert!(!out.success);
        assert_eq!(out.stdout, "out\n");
        assert_eq!(out.stderr, "err\n");
        assert!(out.status.contains('3'), "{}", out.status);
        assert_eq!(output_excerpt(&out), "out err");

        let err = TokioCommandRunner
            .run(sh, &args("sleep 10"), Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(err, DcgmError::CommandTimeout { .. }), "{err}");
        assert_eq!(err.kind(), crate::DcgmErrorKind::Upstream);

        let err = TokioCommandRunner
            .run(Path::new("/nonexistent/dcgmi"), &[], Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(err, DcgmError::Spawn { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/dcgmi"), "{err}");
    }
}
