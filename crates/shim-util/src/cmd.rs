//! Running a host program to completion, behind [`CommandRunner`] so that the logic around
//! it (parsing a tool's output, deciding on an exit code) is tested with recorded answers
//! (`fake::ScriptedCommandRunner`) and the real runner is tested once, here.

use std::fmt;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use async_trait::async_trait;

/// How much of a failed program's output an error keeps: its end, which usually says what
/// failed.
const EXCERPT_CHARS: usize = 500;

/// One run of a program: what, with which arguments, and for how long at most (else the
/// runner's own limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    program: PathBuf,
    args: Vec<String>,
    timeout: Option<Duration>,
}

impl Command {
    /// Runs `program` (a path, or a name looked up in `PATH`) without arguments.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            timeout: None,
        }
    }

    /// Adds one argument.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Adds arguments.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Kills the program once it has run for `timeout` (instead of the runner's limit).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// The program.
    pub fn get_program(&self) -> &Path {
        &self.program
    }

    /// The arguments.
    pub fn get_args(&self) -> &[String] {
        &self.args
    }

    /// The command's own time limit, if it has one.
    pub fn get_timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

impl fmt::Display for Command {
    /// `program arg arg`, for messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.program.display())?;
        for arg in &self.args {
            write!(f, " {arg}")?;
        }
        Ok(())
    }
}

/// What a finished program left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommandOutput {
    /// How it ended (an exit code, or the signal that killed it).
    pub status: ExitStatus,
    /// Its standard output (lossily decoded).
    pub stdout: String,
    /// Its standard error (lossily decoded).
    pub stderr: String,
}

impl CommandOutput {
    /// A run that ended with `status` and printed `stdout` and `stderr`.
    pub fn new(status: ExitStatus, stdout: impl Into<String>, stderr: impl Into<String>) -> Self {
        Self {
            status,
            stdout: stdout.into(),
            stderr: stderr.into(),
        }
    }

    /// A successful run printing `stdout`.
    pub fn ok(stdout: impl Into<String>) -> Self {
        Self::exit(0, "").with_stdout(stdout)
    }

    /// A run exiting with `code` (0 to 255) and printing `stderr`.
    pub fn exit(code: u8, stderr: impl Into<String>) -> Self {
        Self::new(ExitStatus::from_raw(i32::from(code) << 8), "", stderr)
    }

    /// This output with `stdout` instead.
    #[must_use]
    pub fn with_stdout(mut self, stdout: impl Into<String>) -> Self {
        self.stdout = stdout.into();
        self
    }

    /// The exit code; `None` when a signal killed it.
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// `Ok(self)` on success, else [`CommandError::Failed`] for `command` (the command this
    /// is the output of).
    pub fn check(self, command: &Command) -> Result<Self, CommandError> {
        if self.success() {
            Ok(self)
        } else {
            Err(self.failure(command))
        }
    }

    /// The [`CommandError::Failed`] describing this run of `command`.
    pub fn failure(&self, command: &Command) -> CommandError {
        CommandError::Failed {
            command: command.to_string(),
            status: self.status,
            output: self.excerpt(),
        }
    }

    /// What the program said, for a message: its stderr, or its stdout when stderr is empty
    /// (some tools print their errors there), trimmed; the last 500 characters of it.
    pub fn excerpt(&self) -> String {
        let text = if self.stderr.trim().is_empty() {
            &self.stdout
        } else {
            &self.stderr
        };
        let text = text.trim();
        let count = text.chars().count();
        text.chars()
            .skip(count.saturating_sub(EXCERPT_CHARS))
            .collect()
    }
}

/// Why a program gave no [`CommandOutput`], or (from [`CommandOutput::check`]) why its output
/// is a failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The program could not be started (missing, not executable), or its output could not
    /// be read.
    #[error("cannot run {}", program.display())]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The program ran past its time limit and was killed.
    #[error("{command} did not finish within {timeout:?}")]
    TimedOut {
        /// The command line.
        command: String,
        /// The limit.
        timeout: Duration,
    },
    /// An earlier run of the same command line ran past its limit and has not exited since,
    /// although killed (a process in uninterruptible sleep: `nvidia-smi` on a wedged driver):
    /// it is not started again until that one is gone, so that a periodic probe does not
    /// pile up one stuck process per period.
    #[error(
        "{command} is not started: its run of {since_s} s ago has not exited (killed after its time limit; hung in the kernel?)"
    )]
    StillRunning {
        /// The command line.
        command: String,
        /// How long ago the stuck run was started, in seconds.
        since_s: u64,
    },
    /// The program ended unsuccessfully ([`CommandOutput::check`]).
    #[error(
        "{command} failed: {status}{}",
        if output.is_empty() { String::new() } else { format!(": {output}") }
    )]
    Failed {
        /// The command line.
        command: String,
        /// How it ended.
        status: ExitStatus,
        /// The end of what it said ([`CommandOutput::excerpt`]).
        output: String,
    },
}

/// Runs a program to completion and collects its output. A non-zero exit is *not* an error
/// here (callers read exit codes: `blkid` exits 2 for a blank device); failing to start it or
/// running past its time limit is.
#[async_trait]
pub trait CommandRunner: Send + Sync {
    /// Runs `command` with stdin closed.
    async fn run(&self, command: &Command) -> Result<CommandOutput, CommandError>;
}

/// The real runner: `tokio::process`. A program still running after its time limit (the
/// command's own, else the runner's) is killed, and so is one whose caller stopped waiting
/// (the future was dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SystemCommandRunner {
    timeout: Duration,
}

impl SystemCommandRunner {
    /// A runner killing commands without a limit of their own after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self { timeout }
    }

    /// The limit of commands without one of their own.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl Default for SystemCommandRunner {
    /// Five minutes: `mkfs.ext4` on a large volume or a first `docker run` of a vendor tool's
    /// image can take a while.
    fn default() -> Self {
        Self::new(Duration::from_secs(300))
    }
}

/// The runs that went past their limit and have not exited since they were killed, by command
/// line (one process-wide list: every runner starts the same programs on the same host).
static STUCK: std::sync::Mutex<Vec<(String, tokio::process::Child, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

/// The most stuck runs remembered (the oldest is forgotten first).
const STUCK_MAX: usize = 64;

/// `Err` while an earlier run of `line` is stuck (killed, not exited); forgets those that have
/// exited since.
fn check_not_stuck(line: &str) -> Result<(), CommandError> {
    let mut stuck = STUCK.lock().unwrap_or_else(|p| p.into_inner());
    stuck.retain_mut(|(_, child, _)| matches!(child.try_wait(), Ok(None)));
    match stuck.iter().find(|(l, _, _)| l == line) {
        Some((_, _, at)) => Err(CommandError::StillRunning {
            command: line.to_owned(),
            since_s: at.elapsed().as_secs(),
        }),
        None => Ok(()),
    }
}

/// Keeps `child`, a run of `line` started at `started`, killed and not exited.
fn remember_stuck(line: &str, child: tokio::process::Child, started: std::time::Instant) {
    tracing::warn!(command = %line, "a command killed after its time limit has not exited; it is not started again until it has");
    let mut stuck = STUCK.lock().unwrap_or_else(|p| p.into_inner());
    if stuck.len() >= STUCK_MAX {
        stuck.remove(0);
    }
    stuck.push((line.to_owned(), child, started));
}

#[async_trait]
impl CommandRunner for SystemCommandRunner {
    async fn run(&self, command: &Command) -> Result<CommandOutput, CommandError> {
        use tokio::io::AsyncReadExt as _;
        tracing::debug!(%command, "running a command");
        let line = command.to_string();
        check_not_stuck(&line)?;
        let spawn_error = |source| CommandError::Spawn {
            program: command.program.clone(),
            source,
        };
        let started = std::time::Instant::now();
        let mut child = tokio::process::Command::new(&command.program)
            .args(&command.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(spawn_error)?;
        let timeout = command.timeout.unwrap_or(self.timeout);
        let (mut stdout, mut stderr) = (child.stdout.take(), child.stderr.take());
        let run = async {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let read_out = async {
                match stdout.as_mut() {
                    Some(s) => s.read_to_end(&mut out).await.map(drop),
                    None => Ok(()),
                }
            };
            let read_err = async {
                match stderr.as_mut() {
                    Some(s) => s.read_to_end(&mut err).await.map(drop),
                    None => Ok(()),
                }
            };
            let (o, e, status) = tokio::join!(read_out, read_err, child.wait());
            o.and(e)?;
            Ok::<_, std::io::Error>((status?, out, err))
        };
        let Ok(done) = tokio::time::timeout(timeout, run).await else {
            // Killed; kept while it has not exited (see `STUCK`), reaped by tokio once it does.
            if let Err(e) = child.start_kill() {
                tracing::debug!(%command, error = %e, "cannot kill a command past its limit");
            }
            // A killed process is gone within milliseconds, unless it is stuck in the kernel:
            // looked at for up to 100 ms of real time (this path is rare: a run past its
            // limit), whatever the runtime's clock, on the blocking pool (not this thread:
            // the binary's runtime has one).
            let looked = tokio::task::spawn_blocking(move || {
                for _ in 0..100 {
                    if !matches!(child.try_wait(), Ok(None)) {
                        return (child, false);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                (child, true)
            })
            .await;
            match looked {
                Ok((child, true)) => remember_stuck(&line, child, started),
                Ok((_, false)) => {}
                Err(e) => tracing::debug!(%command, error = %e, "cannot look at a killed command"),
            }
            return Err(CommandError::TimedOut {
                command: line,
                timeout,
            });
        };
        let (status, out, err) = done.map_err(spawn_error)?;
        Ok(CommandOutput {
            status,
            stdout: String::from_utf8_lossy(&out).into_owned(),
            stderr: String::from_utf8_lossy(&err).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        Command::new("/bin/sh").args(["-c", script])
    }

    #[tokio::test]
    async fn reports_exit_codes_and_output() {
        let r = SystemCommandRunner::default();
        let cmd = sh("echo hi; echo err >&2; exit 3");
        let out = r.run(&cmd).await.unwrap();
        assert_eq!(out.code(), Some(3));
        assert!(!out.success());
        assert_eq!(out.stdout, "hi\n");
        assert_eq!(out.stderr, "err\n");
        let e = out.check(&cmd).unwrap_err();
        assert_eq!(
            e.to_string(),
            "/bin/sh -c echo hi; echo err >&2; exit 3 failed: exit status: 3: err"
        );
        let ok = sh("echo fine");
        assert_eq!(
            r.run(&ok).await.unwrap().check(&ok).unwrap().stdout,
            "fine\n"
        );
    }

    #[tokio::test]
    async fn a_program_that_cannot_start_is_an_error_naming_it() {
        let e = SystemCommandRunner::default()
            .run(&Command::new("/nonexistent/dcgmi"))
            .await
            .unwrap_err();
        assert!(matches!(e, CommandError::Spawn { .. }), "{e}");
        assert_eq!(e.to_string(), "cannot run /nonexistent/dcgmi");
        assert_eq!(
            crate::error_chain(&e),
            "cannot run /nonexistent/dcgmi: No such file or directory (os error 2)"
        );
    }

    #[tokio::test]
    async fn kills_after_the_commands_limit_or_the_runners() {
        let started = std::time::Instant::now();
        // The program would outlive the test by far; the limit ends it.
        let e = SystemCommandRunner::default()
            .run(&sh("exec sleep 30").timeout(Duration::from_millis(200)))
            .await
            .unwrap_err();
        assert!(matches!(e, CommandError::TimedOut { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "/bin/sh -c exec sleep 30 did not finish within 200ms"
        );
        let e = SystemCommandRunner::new(Duration::from_millis(200))
            .run(&sh("exec sleep 30"))
            .await
            .unwrap_err();
        assert!(matches!(e, CommandError::TimedOut { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(30));
    }

    /// A run killed after its limit that has not exited (stuck in the kernel: a wedged
    /// driver's `nvidia-smi`) keeps the same command line from starting again, so that a
    /// probe every 30 s does not leave one stuck process per period; once it is gone, the
    /// command runs again. (The stuck process is played by one never killed: a process in
    /// uninterruptible sleep cannot be made here.)
    #[tokio::test]
    async fn a_command_whose_killed_run_has_not_exited_is_not_started_again() {
        let cmd = sh("exec sleep 30 # stuck");
        let line = cmd.to_string();
        let child = tokio::process::Command::new("sleep")
            .arg("30")
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = child.id().unwrap();
        remember_stuck(&line, child, std::time::Instant::now());
        let e = SystemCommandRunner::default().run(&cmd).await.unwrap_err();
        assert!(matches!(e, CommandError::StillRunning { .. }), "{e}");
        let other = sh("echo other");
        assert!(SystemCommandRunner::default().run(&other).await.is_ok());
        let killed = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        assert!(killed.unwrap().success());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while check_not_stuck(&line).is_err() {
            assert!(std::time::Instant::now() < deadline, "still stuck");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_killed_program_is_killed_for_good() {
        let pid_file =
            std::env::temp_dir().join(format!("shim-util-cmd-{}.pid", std::process::id()));
        let script = format!("echo $$ > {}; exec sleep 30", pid_file.display());
        let e = SystemCommandRunner::new(Duration::from_millis(300))
            .run(&sh(&script))
            .await
            .unwrap_err();
        assert!(matches!(e, CommandError::TimedOut { .. }), "{e}");
        let pid = fs_err::read_to_string(&pid_file).unwrap();
        // kill_on_drop sends SIGKILL; the zombie is reaped by tokio's orphan reaper, so wait
        // (bounded) until the process is gone or a zombie.
        let gone = (0..100).any(|_| {
            // Field 3 of /proc/<pid>/stat is the state; no file: the process is gone.
            let state = fs_err::read_to_string(format!("/proc/{}/stat", pid.trim()))
                .ok()
                .and_then(|stat| {
                    let rest = stat.rsplit_once(')')?.1.to_owned();
                    rest.split_whitespace().next().map(str::to_owned)
                });
            if state.as_deref().is_none_or(|s| s == "Z" || s == "X") {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
            false
        });
        assert!(gone, "pid {pid} still runs");
        fs_err::remove_file(&pid_file).unwrap();
    }

    #[test]
    fn outputs_and_failures() {
        let out = CommandOutput::exit(1, "").with_stdout("said on stdout\n");
        assert_eq!(out.excerpt(), "said on stdout");
        let cmd = Command::new("dcgmi").args(["health", "-c"]);
        assert_eq!(cmd.to_string(), "dcgmi health -c");
        assert_eq!(
            out.failure(&cmd).to_string(),
            "dcgmi health -c failed: exit status: 1: said on stdout"
        );
        assert_eq!(
            CommandOutput::exit(2, "").failure(&cmd).to_string(),
            "dcgmi health -c failed: exit status: 2"
        );
        let long = "x".repeat(400) + &"y".repeat(400);
        assert_eq!(
            CommandOutput::exit(1, long).excerpt(),
            "x".repeat(100) + &"y".repeat(400)
        );
        let killed = CommandOutput::new(ExitStatus::from_raw(9), "", "");
        assert_eq!(killed.code(), None);
        assert!(!killed.success());
        assert!(CommandOutput::ok("").success());
    }
}
