//! Running host tools (`blkid`, `mkfs.ext4`, `lsblk`, `nvidia-smi`, …) behind a trait, so that
//! resolution and probing logic can be unit-tested with recorded outputs.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{Error, Result};

/// What a finished command produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommandOutput {
    /// The exit code; `None` when killed by a signal.
    pub code: Option<i32>,
    /// Its stdout.
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

impl CommandOutput {
    /// A successful run printing `stdout`.
    pub fn ok(stdout: impl Into<String>) -> Self {
        Self {
            code: Some(0),
            stdout: stdout.into(),
            stderr: String::new(),
        }
    }

    /// A run exiting with `code` and printing `stderr`.
    pub fn exit(code: i32, stderr: impl Into<String>) -> Self {
        Self {
            code: Some(code),
            stdout: String::new(),
            stderr: stderr.into(),
        }
    }

    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }

    /// `Ok(self)` on success, else [`Error::CommandFailed`] describing `program args`.
    pub fn check(self, program: &str, args: &[&str]) -> Result<Self> {
        if self.success() {
            Ok(self)
        } else {
            Err(self.failure(program, args))
        }
    }

    /// The [`Error::CommandFailed`] describing this run.
    pub fn failure(&self, program: &str, args: &[&str]) -> Error {
        let text = if self.stderr.trim().is_empty() {
            &self.stdout
        } else {
            &self.stderr
        };
        let text = text.trim();
        // Keep the end, which usually says what failed.
        let tail: String = if text.chars().count() > 500 {
            let skip = text.chars().count() - 500;
            text.chars().skip(skip).collect()
        } else {
            text.to_owned()
        };
        Error::CommandFailed {
            command: std::iter::once(program)
                .chain(args.iter().copied())
                .collect::<Vec<_>>()
                .join(" "),
            code: self.code,
            stderr: tail,
        }
    }
}

/// Runs a program with arguments and collects its output. A non-zero exit is *not* an error
/// here (callers interpret exit codes, e.g. `blkid` exit 2 = blank); failing to start it or
/// running past the time limit is.
#[async_trait]
pub trait CommandRunner: Send + Sync {
    /// Runs `program` with `args`, stdin closed.
    async fn run(&self, program: &str, args: &[&str]) -> Result<CommandOutput>;
}

/// The real runner: `tokio::process`, with a time limit after which the child is killed.
#[derive(Debug, Clone)]
pub struct SystemCommandRunner {
    timeout: Duration,
}

impl SystemCommandRunner {
    /// A runner killing commands after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self { timeout }
    }
}

impl Default for SystemCommandRunner {
    /// Five minutes: `mkfs.ext4` on a large volume or a first `docker run` of an SMI image can
    /// take a while.
    fn default() -> Self {
        Self::new(Duration::from_secs(300))
    }
}

#[async_trait]
impl CommandRunner for SystemCommandRunner {
    async fn run(&self, program: &str, args: &[&str]) -> Result<CommandOutput> {
        tracing::debug!(program, ?args, "running command");
        let child = tokio::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::Spawn {
                program: program.to_owned(),
                source,
            })?;
        let out = tokio::time::timeout(self.timeout, child.wait_with_output())
            .await
            .map_err(|_| Error::CommandTimedOut {
                program: program.to_owned(),
                timeout: self.timeout,
            })?
            .map_err(|source| Error::Spawn {
                program: program.to_owned(),
                source,
            })?;
        Ok(CommandOutput {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

/// A queued answer: program, optional first argument, output or spawn error.
type Scripted = (String, Option<String>, Result<CommandOutput, String>);

/// A scripted runner for tests: answers each call with the first queued response whose program
/// (and, when given, first argument) matches, and records every call.
#[derive(Debug, Default)]
pub struct ScriptedCommandRunner {
    responses: Mutex<VecDeque<Scripted>>,
    sticky: Mutex<Vec<(String, CommandOutput)>>,
    calls: Mutex<Vec<Vec<String>>>,
}

impl ScriptedCommandRunner {
    /// An empty script: every call fails to spawn.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queues one answer for `program`.
    pub fn push(&self, program: &str, out: CommandOutput) -> &Self {
        lock(&self.responses).push_back((program.to_owned(), None, Ok(out)));
        self
    }

    /// Queues one answer for `program` whose first argument is `arg0`.
    pub fn push_with_arg(&self, program: &str, arg0: &str, out: CommandOutput) -> &Self {
        lock(&self.responses).push_back((program.to_owned(), Some(arg0.to_owned()), Ok(out)));
        self
    }

    /// Queues a spawn failure for `program`.
    pub fn push_spawn_error(&self, program: &str, why: &str) -> &Self {
        lock(&self.responses).push_back((program.to_owned(), None, Err(why.to_owned())));
        self
    }

    /// Answers every call of `program` (once the queue has none for it) with `out`.
    pub fn always(&self, program: &str, out: CommandOutput) -> &Self {
        lock(&self.sticky).push((program.to_owned(), out));
        self
    }

    /// Every call so far, program first.
    pub fn calls(&self) -> Vec<Vec<String>> {
        lock(&self.calls).clone()
    }

    /// How many calls of `program` were made.
    pub fn count(&self, program: &str) -> usize {
        lock(&self.calls)
            .iter()
            .filter(|c| c.first().is_some_and(|p| p == program))
            .count()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[async_trait]
impl CommandRunner for ScriptedCommandRunner {
    async fn run(&self, program: &str, args: &[&str]) -> Result<CommandOutput> {
        lock(&self.calls).push(
            std::iter::once(program)
                .chain(args.iter().copied())
                .map(str::to_owned)
                .collect(),
        );
        let found = {
            let mut q = lock(&self.responses);
            let pos = q.iter().position(|(p, a, _)| {
                p == program && a.as_deref().is_none_or(|a| args.first() == Some(&a))
            });
            pos.and_then(|i| q.remove(i))
        };
        match found {
            Some((_, _, Ok(out))) => Ok(out),
            Some((_, _, Err(why))) => Err(spawn_error(program, &why)),
            None => lock(&self.sticky)
                .iter()
                .find(|(p, _)| p == program)
                .map(|(_, out)| out.clone())
                .ok_or_else(|| spawn_error(program, "no scripted answer")),
        }
    }
}

fn spawn_error(program: &str, why: &str) -> Error {
    Error::Spawn {
        program: program.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, why.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn system_runner_reports_exit_codes_and_output() {
        let r = SystemCommandRunner::default();
        let out = r
            .run("sh", &["-c", "echo hi; echo err >&2; exit 3"])
            .await
            .unwrap();
        assert_eq!(out.code, Some(3));
        assert_eq!(out.stdout, "hi\n");
        assert_eq!(out.stderr, "err\n");
        let e = out.check("sh", &["-c", "x"]).unwrap_err();
        assert!(e.to_string().contains("err"), "{e}");
        assert!(matches!(
            r.run("/nonexistent/program", &[]).await,
            Err(Error::Spawn { .. })
        ));
    }

    #[tokio::test]
    async fn system_runner_kills_after_timeout() {
        let r = SystemCommandRunner::new(Duration::from_millis(200));
        assert!(matches!(
            r.run("sleep", &["30"]).await,
            Err(Error::CommandTimedOut { .. })
        ));
    }

    #[tokio::test]
    async fn scripted_runner_answers_in_order() {
        let r = ScriptedCommandRunner::new();
        r.push("a", CommandOutput::ok("1"))
            .push("a", CommandOutput::ok("2"))
            .always("a", CommandOutput::exit(1, "x"));
        assert_eq!(r.run("a", &[]).await.unwrap().stdout, "1");
        assert_eq!(r.run("a", &[]).await.unwrap().stdout, "2");
        assert_eq!(r.run("a", &[]).await.unwrap().code, Some(1));
        assert!(r.run("b", &[]).await.is_err());
        assert_eq!(r.count("a"), 3);
    }
}
