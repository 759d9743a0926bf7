//! The runner's state and its HTTP API, as the dstack server drives it: healthcheck, submit,
//! upload_archive, upload_code, run, pull, stop (and metrics, answered "not available").
//!
//! upstream: runner/internal/runner/api/{server.go,http.go} (routes, states, answers),
//! runner/internal/runner/executor/{executor.go,query.go,states.go,timestamp.go} (the job's
//! states and logs, `pull` as events after a timestamp), runner/internal/runner/schemas
//! (the JSON: [`crate::schemas`]). The server's side:
//! dstack/_internal/server/services/runner/client.py (`RunnerClient`) and
//! dstack/_internal/server/schemas/runner.py (`PullResponse`, ...).
//!
//! The phases are upstream's: `wait_submit` → (submit) `wait_run` → (run) `serve_logs` →
//! (the job ended or was stopped) `wait_logs_finished`. Then upstream's runner waits for two
//! readers, `/api/pull` (the server) and `/logs_ws` (an attached CLI), at most 5 minutes in
//! all, and exits: without an attached CLI (`dstack apply -d`) it outlives the job until the
//! server's terminate stops the container. This runner does the same, or, when the job's env
//! sets [`EXIT_AFTER_PULL_ENV`]`=1` (as if an attached CLI had read `/logs_ws`), exits once a
//! pull was answered in the last phase (`has_more: false`), so the container ends by itself
//! with code 0.

use std::io::Read;
use std::os::unix::process::{CommandExt as _, ExitStatusExt as _};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::http::{Request, Response};
use crate::schemas::{Healthcheck, JobInfo, JobStateEvent, LogEvent, PullResponse, SubmitBody};

/// A job env variable: `1` makes the runner exit as soon as the server pulled the last logs.
pub const EXIT_AFTER_PULL_ENV: &str = "SHIM_TEST_RUNNER_EXIT_AFTER_PULL";

/// How long the job's process group has after SIGINT before SIGKILL (upstream's `killDelay`).
pub(crate) const KILL_DELAY: Duration = Duration::from_secs(10);
/// How long the job's output may still be read after its process exited (a background
/// process that keeps the pipe open would hold it forever).
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// The runner's phase (upstream's `executor` states).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Nothing submitted yet.
    WaitSubmit,
    /// Submitted; code and archives may be uploaded; waits for `run`.
    WaitRun,
    /// The job runs; its logs are served.
    ServeLogs,
    /// The job ended; the last logs wait for a pull.
    WaitLogsFinished,
}

/// What the server submitted that this runner uses.
#[derive(Debug, Clone, Default)]
pub struct Job {
    /// The command line (`job_spec.commands`: the server sends the shell and its arguments).
    pub commands: Vec<String>,
    /// `job_spec.env`.
    pub env: Vec<(String, String)>,
    /// `job_spec.working_dir`, if set.
    pub working_dir: Option<String>,
    /// `job_spec.user.username`, else `root`.
    pub username: String,
    /// `job_spec.max_duration` in seconds (0: none).
    pub max_duration: u64,
    /// Variables upstream sets for every job (`DSTACK_RUN_NAME`, ...).
    pub dstack_env: Vec<(String, String)>,
    /// [`EXIT_AFTER_PULL_ENV`] is `1` in `env`.
    pub exit_after_pull: bool,
}

impl Job {
    /// Takes what this runner uses from the submit body (upstream's `SubmitBody`).
    pub fn from_submit(body: SubmitBody) -> Result<Self, String> {
        let SubmitBody {
            run,
            job_spec: spec,
            job_submission,
        } = body;
        if spec.commands.is_empty() {
            return Err("job_spec.commands is empty".into());
        }
        let env: Vec<(String, String)> = spec
            .env
            .into_iter()
            .filter_map(|(k, v)| Some((k, v.as_str()?.to_owned())))
            .collect();
        let exit_after_pull = env
            .iter()
            .any(|(k, v)| k == EXIT_AFTER_PULL_ENV && v == "1");
        let dstack_env = [
            ("DSTACK_RUN_ID", run.id),
            ("DSTACK_JOB_ID", job_submission.id),
            ("DSTACK_RUN_NAME", run.run_spec.run_name),
            ("DSTACK_REPO_ID", run.run_spec.repo_id),
            ("DSTACK_NODE_RANK", spec.job_num.unwrap_or(0).to_string()),
            (
                "DSTACK_NODES_NUM",
                spec.jobs_per_replica.unwrap_or(1).to_string(),
            ),
        ]
        .map(|(k, v)| (k.to_owned(), v))
        .into();
        Ok(Self {
            commands: spec.commands,
            env,
            working_dir: spec.working_dir,
            username: spec.user.username.unwrap_or_else(|| "root".to_owned()),
            max_duration: spec
                .max_duration
                .and_then(|d| u64::try_from(d).ok())
                .unwrap_or(0),
            dstack_env,
            exit_after_pull,
        })
    }
}

#[derive(Debug)]
struct State {
    phase: Phase,
    job: Option<Job>,
    /// The last timestamp handed out (milliseconds, strictly increasing).
    clock: i64,
    job_states: Vec<JobStateEvent>,
    job_logs: Vec<LogEvent>,
    runner_logs: Vec<LogEvent>,
    /// The job's process group while it runs.
    pgid: Option<u32>,
    /// `stop` was requested while the job ran.
    stopping: bool,
    /// A pull was answered in [`Phase::WaitLogsFinished`].
    final_pull_served: bool,
    /// When the job ended.
    finished_at: Option<Instant>,
    archives: usize,
    code_bytes: usize,
}

impl State {
    /// The next timestamp: milliseconds since the epoch, strictly after the last one (upstream
    /// counts within a second; the server only compares them).
    fn tick(&mut self) -> i64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        self.clock = now.max(self.clock + 1);
        self.clock
    }

    fn runner_log(&mut self, level: &str, message: &str) {
        crate::log(message);
        let timestamp = self.tick();
        let quoted = serde_json::to_string(message).unwrap_or_default();
        let line = format!("level={level} msg={quoted}\n");
        self.runner_logs.push(LogEvent {
            timestamp,
            message: line.into_bytes(),
        });
    }

    fn job_state(
        &mut self,
        state: &'static str,
        termination_reason: &'static str,
        termination_message: String,
        exit_status: Option<i32>,
    ) {
        let timestamp = self.tick();
        self.runner_log(
            "info",
            &format!(
                "Job state changed new={state} exit_status={exit_status:?} \
                 termination_reason={termination_reason:?} {termination_message}"
            ),
        );
        self.job_states.push(JobStateEvent {
            state,
            timestamp,
            termination_reason,
            termination_message,
            exit_status,
        });
    }
}

/// Events of `events` strictly after `timestamp` (they are in timestamp order).
fn after<T>(events: &[T], timestamp: i64, stamp: impl Fn(&T) -> i64) -> &[T] {
    let start = events.partition_point(|e| stamp(e) <= timestamp);
    &events[start..]
}

/// The runner: its state, shared by the connection threads and the job's thread.
#[derive(Debug)]
pub struct Runner {
    version: String,
    state: Mutex<State>,
    changed: Condvar,
}

/// How the process should end, as [`Runner::wait_end`] sees it.
#[derive(Debug, PartialEq, Eq)]
pub enum End {
    /// The job ended and its logs were given (or nobody asked for them in time).
    Done,
    /// No job was submitted and run in time.
    NoJob,
}

impl Runner {
    /// A runner reporting `version` in its healthcheck.
    pub fn new(version: &str) -> Arc<Self> {
        Arc::new(Self {
            version: version.to_owned(),
            state: Mutex::new(State {
                phase: Phase::WaitSubmit,
                job: None,
                clock: 0,
                job_states: Vec::new(),
                job_logs: Vec::new(),
                runner_logs: Vec::new(),
                pgid: None,
                stopping: false,
                final_pull_served: false,
                finished_at: None,
                archives: 0,
                code_bytes: 0,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Blocks until the process should end: `logs_wait` after the job ended (or once its last
    /// logs were pulled, with [`EXIT_AFTER_PULL_ENV`]), or when no job started within
    /// `start_wait` (upstream: 5 minutes each).
    pub fn wait_end(&self, start_wait: Duration, logs_wait: Duration) -> End {
        let started = Instant::now();
        let mut state = self.lock();
        loop {
            let exit_after_pull = state.job.as_ref().is_some_and(|j| j.exit_after_pull);
            if state.final_pull_served && exit_after_pull {
                return End::Done;
            }
            let wait = match (state.phase, state.finished_at) {
                (Phase::WaitLogsFinished, Some(at)) => match logs_wait.checked_sub(at.elapsed()) {
                    Some(left) => left,
                    None => return End::Done,
                },
                (Phase::WaitSubmit | Phase::WaitRun, _) => {
                    match start_wait.checked_sub(started.elapsed()) {
                        Some(left) => left,
                        None => return End::NoJob,
                    }
                }
                _ => Duration::from_secs(1),
            };
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Answers one request.
    pub fn handle(self: &Arc<Self>, request: &Request) -> Response {
        let route = (request.method.as_str(), request.path.as_str());
        match route {
            ("GET", "/api/healthcheck") => Response::json(&Healthcheck {
                service: "dstack-runner",
                version: &self.version,
            }),
            ("GET", "/api/metrics") => Response::text(404, "Metrics collector is not available"),
            ("POST", "/api/submit") => self.submit(request),
            ("POST", "/api/upload_archive") => self.upload_archive(request),
            ("POST", "/api/upload_code") => self.upload_code(request),
            ("POST", "/api/run") => self.run(),
            ("GET", "/api/pull") => self.pull(request),
            ("POST", "/api/stop") => self.stop(),
            (
                _,
                "/api/healthcheck"
                | "/api/metrics"
                | "/api/submit"
                | "/api/upload_archive"
                | "/api/upload_code"
                | "/api/run"
                | "/api/pull"
                | "/api/stop",
            ) => Response::text(405, "Method Not Allowed"),
            _ => Response::text(404, "404 page not found"),
        }
    }

    fn submit(&self, request: &Request) -> Response {
        if let Some(ct) = request.header("content-type")
            && ct.split(';').next().map(str::trim) != Some("application/json")
        {
            return Response::text(415, "Content-Type header is not application/json");
        }
        let mut state = self.lock();
        if !matches!(state.phase, Phase::WaitSubmit | Phase::WaitRun) {
            return Response::text(409, "Conflict");
        }
        let body: SubmitBody = match serde_json::from_slice(&request.body) {
            Ok(body) => body,
            Err(e) if e.is_data() => {
                return Response::text(
                    400,
                    &format!("Request body contains an invalid value: {e}"),
                );
            }
            Err(e) => {
                return Response::text(
                    400,
                    &format!("Request body contains badly-formed JSON: {e}"),
                );
            }
        };
        match Job::from_submit(body) {
            Ok(job) => {
                let line = format!(
                    "Job submitted: commands {:?}, {} env vars",
                    job.commands,
                    job.env.len()
                );
                state.job = Some(job);
                state.phase = Phase::WaitRun;
                state.runner_log("info", &line);
                self.changed.notify_all();
                Response::text(200, "")
            }
            Err(e) => Response::text(400, &e),
        }
    }

    fn upload_archive(&self, request: &Request) -> Response {
        let mut state = self.lock();
        if state.phase != Phase::WaitRun {
            return Response::text(409, "Conflict");
        }
        let multipart = request
            .header("content-type")
            .is_some_and(|ct| ct.starts_with("multipart/form-data") && ct.contains("boundary="));
        if !multipart {
            return Response::text(400, "multipart/form-data expected");
        }
        let body = String::from_utf8_lossy(&request.body);
        if !body.contains("name=\"archive\"") || !body.contains("filename=\"") {
            return Response::text(400, "missing field archive or its file name");
        }
        state.archives += 1;
        let line = format!(
            "File archive {} received ({} bytes)",
            state.archives,
            request.body.len()
        );
        state.runner_log("info", &line);
        Response::text(200, "")
    }

    fn upload_code(&self, request: &Request) -> Response {
        let mut state = self.lock();
        if state.phase != Phase::WaitRun {
            return Response::text(409, "Conflict");
        }
        state.code_bytes = request.body.len();
        let line = format!("Code received ({} bytes)", request.body.len());
        state.runner_log("info", &line);
        Response::text(200, "")
    }

    fn run(self: &Arc<Self>) -> Response {
        let mut state = self.lock();
        if state.phase != Phase::WaitRun {
            return Response::text(409, "Conflict");
        }
        let Some(job) = state.job.clone() else {
            return Response::text(409, "Conflict");
        };
        state.phase = Phase::ServeLogs;
        self.changed.notify_all();
        drop(state);
        let working_dir = job.working_dir.clone().unwrap_or_else(|| {
            std::env::current_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|_| "/".to_owned())
        });
        let answer = Response::json(&JobInfo {
            working_dir: &working_dir,
            username: &job.username,
        });
        let runner = Arc::clone(self);
        std::thread::spawn(move || runner.execute(&job, &working_dir));
        answer
    }

    fn pull(&self, request: &Request) -> Response {
        let timestamp = match request.query_param("timestamp") {
            None => 0,
            Some(t) => match t.parse::<i64>() {
                Ok(t) => t,
                Err(_) => return Response::text(400, "Bad Request"),
            },
        };
        let mut state = self.lock();
        let finished = state.phase == Phase::WaitLogsFinished;
        let answer = Response::json(&PullResponse {
            job_states: after(&state.job_states, timestamp, |e| e.timestamp),
            job_logs: after(&state.job_logs, timestamp, |e| e.timestamp),
            runner_logs: after(&state.runner_logs, timestamp, |e| e.timestamp),
            last_updated: state.clock,
            no_connections_secs: 0,
            has_more: !finished,
        });
        if finished {
            state.final_pull_served = true;
            self.changed.notify_all();
        }
        answer
    }

    fn stop(self: &Arc<Self>) -> Response {
        let mut state = self.lock();
        let phase = state.phase;
        match phase {
            Phase::ServeLogs => {
                if !state.stopping {
                    state.stopping = true;
                    state.runner_log("info", "Stop requested: interrupting the job");
                    let pgid = state.pgid;
                    drop(state);
                    if let Some(pgid) = pgid {
                        interrupt(pgid);
                    }
                }
            }
            Phase::WaitLogsFinished => {}
            Phase::WaitSubmit | Phase::WaitRun => {
                state.runner_log("info", "Stop requested before the job ran");
                state.phase = Phase::WaitLogsFinished;
                state.finished_at = Some(Instant::now());
                self.changed.notify_all();
            }
        }
        Response::text(200, "")
    }

    fn finish(
        &self,
        state: &'static str,
        reason: &'static str,
        message: String,
        exit_status: Option<i32>,
    ) {
        let mut locked = self.lock();
        locked.job_state(state, reason, message, exit_status);
        locked.pgid = None;
        locked.phase = Phase::WaitLogsFinished;
        locked.finished_at = Some(Instant::now());
        self.changed.notify_all();
    }

    /// Runs the job (its own thread): its output becomes job logs, its end a job state.
    fn execute(self: Arc<Self>, job: &Job, working_dir: &str) {
        {
            let mut state = self.lock();
            state.runner_log("info", "Run job");
            state.job_state("running", "", String::new(), None);
        }
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .create(working_dir)
        {
            return self.finish(
                "failed",
                "executor_error",
                format!("Failed to create the working dir {working_dir}: {e}"),
                None,
            );
        }
        let (reader, writer) = match std::io::pipe() {
            Ok(pair) => pair,
            Err(e) => return self.finish("failed", "", format!("pipe: {e}"), None),
        };
        let mut command = Command::new(&job.commands[0]);
        command
            .args(&job.commands[1..])
            .current_dir(working_dir)
            .envs(job.dstack_env.iter().cloned())
            .env("DSTACK_WORKING_DIR", working_dir)
            .envs(job.env.iter().cloned())
            .env("HOME", "/root")
            .stdin(Stdio::null())
            .process_group(0);
        match writer.try_clone() {
            Ok(w) => command.stdout(w).stderr(writer),
            Err(e) => return self.finish("failed", "", format!("pipe: {e}"), None),
        };
        let child = command.spawn();
        // The writer ends live in `command`: gone, so the reader sees the end of the output.
        drop(command);
        let mut child = match child {
            Ok(child) => child,
            Err(e) => {
                return self.finish(
                    "failed",
                    "",
                    format!("start command {:?}: {e}", job.commands[0]),
                    None,
                );
            }
        };
        let stopping = {
            let mut state = self.lock();
            state.pgid = Some(child.id());
            state.stopping
        };
        if stopping {
            // Stopped between `run` and now.
            interrupt(child.id());
        }
        let (output_done, output_ended) = mpsc::channel::<()>();
        let logs = Arc::clone(&self);
        std::thread::spawn(move || {
            let mut reader = reader;
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut state = logs.lock();
                let timestamp = state.tick();
                state.job_logs.push(LogEvent {
                    timestamp,
                    message: buf[..n].to_vec(),
                });
            }
            let _ = output_done.send(());
        });
        let deadline =
            (job.max_duration > 0).then(|| Instant::now() + Duration::from_secs(job.max_duration));
        let mut timed_out = false;
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break Ok(status),
                Ok(None) => {}
                Err(e) => break Err(e),
            }
            if !timed_out && deadline.is_some_and(|d| Instant::now() >= d) {
                timed_out = true;
                self.lock()
                    .runner_log("error", "Max duration exceeded: killing the job");
                signal_group(child.id(), "KILL");
                let _ = child.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = output_ended.recv_timeout(OUTPUT_DRAIN);
        let stopping = self.lock().stopping;
        match status {
            Err(e) => self.finish("failed", "", format!("wait for command: {e}"), None),
            Ok(_) if timed_out => self.finish(
                "terminated",
                "max_duration_exceeded",
                "Max duration exceeded".to_owned(),
                None,
            ),
            Ok(_) if stopping => self.finish("terminated", "", String::new(), None),
            Ok(status) if status.success() => self.finish("done", "", String::new(), Some(0)),
            // Go's ExitError.ExitCode(): the code, or -1 for a signal.
            Ok(status) => self.finish(
                "failed",
                "",
                String::new(),
                Some(status.code().unwrap_or_else(|| {
                    crate::log(&format!("job killed by signal {:?}", status.signal()));
                    -1
                })),
            ),
        }
    }
}

/// Stops the job as upstream does: SIGINT, then SIGKILL after [`KILL_DELAY`] (to its whole
/// process group here: the job is a shell whose children hold its output open).
fn interrupt(pgid: u32) {
    signal_group(pgid, "INT");
    std::thread::spawn(move || {
        std::thread::sleep(KILL_DELAY);
        signal_group(pgid, "KILL");
    });
}

/// Sends `signal` (a name `kill` knows) to the process group `pgid`, with the image's `kill`
/// (std has no kill(2) for a group, and unsafe code is not allowed here).
fn signal_group(pgid: u32, signal: &str) {
    let sent = Command::new("kill")
        .args(["-s", signal, "--", &format!("-{pgid}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !sent.is_ok_and(|s| s.success()) {
        crate::log(&format!(
            "could not send SIG{signal} to process group {pgid}"
        ));
    }
}
