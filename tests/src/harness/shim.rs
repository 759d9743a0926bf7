//! [`TestShim`]: one test's `dstack-shim` under test. A home (temporary, or given), the
//! running binary (or none between restarts) with the stub runner, fake GPUs and one log file
//! per start, the shim's API with the checks the end-to-end tests make of every answer, and
//! the clean-up of everything it started however the test ends.
//!
//! Its methods are assertions: a request that cannot be sent, an answer that is not what the
//! method expects, or a wait that does not end within [`WAIT_BOUND`] fails the test (panics)
//! with the answer or the state that was wrong.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{OsStr, OsString};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use super::docker::{ContainerSweeper, LABEL_OWNER, container_running, docker_at_ok};
use super::http::{Api, Request, Response};
use super::layout::{task_dir, tasks_dir, write_runner_exit};
use super::metrics::{Metrics, parse_openmetrics};
use super::process::{ShimProcess, free_port, prefixed, shim_binary, shim_command};
use super::supervisor::Supervisor;
use super::wait::{POLL, wait_for};

/// How many fake GPUs a [`TestShim`] has (`--fake-gpus`).
pub const FAKE_GPUS: usize = 4;
/// The runner's HTTP port in a task's container (the shim's default, passed explicitly).
pub const RUNNER_HTTP_PORT: u16 = 10999;
/// The runner's SSH port in a task's container (the shim's default, passed explicitly).
pub const RUNNER_SSH_PORT: u16 = 10022;
/// The bound of every wait of a [`TestShim`] (its start, a status, a remove, its exit):
/// generous, never a timed assertion, only there so that a hang fails.
pub const WAIT_BOUND: Duration = Duration::from_secs(90);
/// How many of the last starts' logs a failed test prints, and how many lines of each.
const TAIL_STARTS: u32 = 3;
const TAIL_LINES: usize = 150;
/// The log lines left out of the printed tail: the tests poll with GET requests.
const POLL_LINE: &str = "request method=GET";

/// How a [`TestShimBuilder`] is set up; see its methods.
#[derive(Debug, Clone)]
pub struct TestShimBuilder {
    label: String,
    given: Option<(PathBuf, PathBuf)>,
    args: Vec<OsString>,
    env: Vec<(String, OsString)>,
    docker_host: Option<String>,
    wait_answering: bool,
    runner: Option<PathBuf>,
    binary: Option<PathBuf>,
    restart_delay: Option<Duration>,
    prefix: Vec<OsString>,
    detect_gpus: bool,
}

impl TestShimBuilder {
    /// Runs `binary` instead of the workspace's debug build.
    #[must_use]
    pub fn binary(mut self, binary: &Path) -> Self {
        self.binary = Some(binary.to_owned());
        self
    }

    /// Runs the shim under a [`Supervisor`] that starts it again `restart_delay` after it
    /// exits, as systemd does with the dstack server's unit (`Restart=always`,
    /// `RestartSec=3`). [`TestShim::supervisor`] then replaces [`TestShim::process`].
    #[must_use]
    pub fn supervised(mut self, restart_delay: Duration) -> Self {
        self.restart_delay = Some(restart_delay);
        self
    }

    /// Uses `home` (created if missing; the test removes it) and writes the logs and the
    /// volumes' root into `logs` (created if missing; outside the home, which may be full),
    /// instead of a temporary directory holding all three.
    #[must_use]
    pub fn home(mut self, home: &Path, logs: &Path) -> Self {
        self.given = Some((home.to_owned(), logs.to_owned()));
        self
    }

    /// Passes more arguments at every start, after the standard ones.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets an environment variable of the process at every start.
    #[must_use]
    pub fn env(mut self, name: &str, value: impl AsRef<OsStr>) -> Self {
        self.env.push((name.to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Uses the Docker daemon at `host` (`unix:///…`) instead of the default one: the
    /// shim's `DOCKER_HOST`, and the daemon [`TestShim::containers`] and
    /// [`TestShim::running`] ask. Its containers are not swept (a private daemon cleans up
    /// its own).
    #[must_use]
    pub fn docker_host(mut self, host: &str) -> Self {
        self.docker_host = Some(host.to_owned());
        self.env("DOCKER_HOST", host)
    }

    /// Passes `runner` as `--runner-binary-path` instead of the stub runner (e.g. a path
    /// that does not exist).
    #[must_use]
    pub fn runner_binary(mut self, runner: &Path) -> Self {
        self.runner = Some(runner.to_owned());
        self
    }

    /// Runs the shim under `prefix` at every start: `PREFIX.. <binary> <arguments>` (a
    /// wrapper, as `lifecycle.py --prefix` runs one). The harness signals the prefix's process:
    /// the prefix must `exec` the shim (keeping its process id), as
    /// [`FakeGpuHost::exec_prefix`](super::FakeGpuHost::exec_prefix) does.
    #[must_use]
    pub fn prefix<I, S>(mut self, prefix: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.prefix = prefix.into_iter().map(|a| a.as_ref().to_owned()).collect();
        self
    }

    /// Leaves out `--fake-gpus`: the shim detects the host's GPUs (none here, unless it runs
    /// in a fake GPU host: [`TestShimBuilder::gpu_host`]).
    #[must_use]
    pub fn detect_gpus(mut self) -> Self {
        self.detect_gpus = true;
        self
    }

    /// Runs the shim inside `host` ([`TestShimBuilder::prefix`] with its
    /// [`exec_prefix`](super::FakeGpuHost::exec_prefix)), detecting its GPUs
    /// ([`TestShimBuilder::detect_gpus`]) as on a real GPU host.
    #[must_use]
    pub fn gpu_host(self, host: &super::FakeGpuHost) -> Self {
        self.prefix(host.exec_prefix()).detect_gpus()
    }

    /// Makes [`TestShim::start`] wait until the healthcheck answers, not only until the port
    /// accepts connections.
    #[must_use]
    pub fn wait_answering(mut self) -> Self {
        self.wait_answering = true;
        self
    }

    /// The shim, not started yet (the binary is built now if needed).
    #[allow(
        clippy::panic,
        reason = "a test helper: a home that cannot be made fails the test"
    )]
    pub fn build(self) -> TestShim {
        let _ = shim_binary();
        let fail = |e: std::io::Error| -> ! { panic!("{e}") };
        let (root, home, logs) = match self.given {
            Some((home, logs)) => (None, home, logs),
            None => {
                let root = tempfile::Builder::new()
                    .prefix(&format!("shim-{}-", self.label))
                    .tempdir()
                    .unwrap_or_else(|e| fail(e));
                let logs = root.path().to_owned();
                (Some(root), logs.join("home"), logs)
            }
        };
        fs_err::create_dir_all(&home).unwrap_or_else(|e| fail(e));
        fs_err::create_dir_all(&logs).unwrap_or_else(|e| fail(e));
        let home = std::path::absolute(&home).unwrap_or_else(|e| fail(e));
        let digest = Sha256::digest(home.as_os_str().as_encoded_bytes());
        let run = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
        let sweeper = match self.docker_host {
            None => Some(ContainerSweeper::for_home(&home)),
            Some(_) => None,
        };
        TestShim {
            process: None,
            supervisor: None,
            binary: self.binary,
            restart_delay: self.restart_delay,
            prefix: self.prefix,
            detect_gpus: self.detect_gpus,
            sweeper,
            label: self.label,
            spelled: home.clone(),
            home,
            logs,
            args: self.args,
            env: self.env,
            docker_host: self.docker_host,
            wait_answering: self.wait_answering,
            runner: self.runner.unwrap_or_else(crate::runner_path),
            port: 0,
            starts: 0,
            run,
            _root: root,
        }
    }

    /// [`TestShimBuilder::build`], then [`TestShim::start`].
    pub fn start(self) -> TestShim {
        let mut shim = self.build();
        shim.start();
        shim
    }
}

/// One test's shim under test: a home, the running binary (or none between restarts), its
/// logs, and the clean-up guards. Dropped: the process is killed, then the home's containers
/// are swept (the sweeper reads the owner identity in the home), then a temporary home is
/// deleted; when the test is failing, the end of the logs is printed first.
///
/// Every start passes `--shim-home`, `--shim-http-port` (a fresh free port),
/// `--runner-binary-path` (the stub runner, or the builder's), `--runner-http-port` [`RUNNER_HTTP_PORT`],
/// `--runner-ssh-port` [`RUNNER_SSH_PORT`], `--fake-gpus` [`FAKE_GPUS`] (unless
/// [`TestShimBuilder::detect_gpus`]), `--volumes-root` (`volumes/` beside the logs),
/// `--shim-log-level 5`, then the builder's arguments; under the builder's
/// [`prefix`](TestShimBuilder::prefix) if any.
#[derive(Debug)]
pub struct TestShim {
    process: Option<ShimProcess>,
    /// The supervisor instead of `process` ([`TestShimBuilder::supervised`]).
    supervisor: Option<Supervisor>,
    binary: Option<PathBuf>,
    restart_delay: Option<Duration>,
    /// The wrapper the shim runs under ([`TestShimBuilder::prefix`]).
    prefix: Vec<OsString>,
    /// Whether `--fake-gpus` is left out ([`TestShimBuilder::detect_gpus`]).
    detect_gpus: bool,
    sweeper: Option<ContainerSweeper>,
    label: String,
    /// The home where the test reads files (absolute, as created).
    home: PathBuf,
    /// `--shim-home` as passed.
    spelled: PathBuf,
    logs: PathBuf,
    args: Vec<OsString>,
    env: Vec<(String, OsString)>,
    docker_host: Option<String>,
    wait_answering: bool,
    /// `--runner-binary-path`.
    runner: PathBuf,
    port: u16,
    starts: u32,
    run: String,
    /// The temporary directory holding the home and the logs; the last field, so it is
    /// deleted after the containers were swept.
    _root: Option<tempfile::TempDir>,
}

#[allow(
    clippy::panic,
    clippy::expect_used,
    reason = "test assertions: a failed check fails the test"
)]
impl TestShim {
    /// A builder for a shim whose temporary directory is `shim-<label>-…` and whose clean-up
    /// terminations say `<label> clean-up`.
    pub fn builder(label: &str) -> TestShimBuilder {
        TestShimBuilder {
            label: label.to_owned(),
            given: None,
            args: Vec::new(),
            env: Vec::new(),
            docker_host: None,
            wait_answering: false,
            runner: None,
            binary: None,
            restart_delay: None,
            prefix: Vec::new(),
            detect_gpus: false,
        }
    }

    // -----------------------------------------------------------------------------------------
    // The process
    // -----------------------------------------------------------------------------------------

    /// Starts the binary on the home (a fresh API port each time) and waits (bounded) until
    /// its port accepts connections, or, with [`TestShimBuilder::wait_answering`], until its
    /// healthcheck answers. Waiting for the port sends no HTTP request: the next request is
    /// the first one the new process answers (restore and the first reconcile cycle are done
    /// by then).
    pub fn start(&mut self) {
        assert!(
            self.process.is_none() && self.supervisor.is_none(),
            "the shim is already running"
        );
        self.starts += 1;
        self.port = free_port().unwrap_or_else(|e| panic!("{e}"));
        let mut args: Vec<OsString> = vec![
            "--runner-binary-path".into(),
            self.runner.clone().into(),
            "--runner-http-port".into(),
            RUNNER_HTTP_PORT.to_string().into(),
            "--runner-ssh-port".into(),
            RUNNER_SSH_PORT.to_string().into(),
        ];
        if !self.detect_gpus {
            args.extend(["--fake-gpus".into(), FAKE_GPUS.to_string().into()]);
        }
        args.extend([
            "--volumes-root".into(),
            self.logs.join("volumes").into(),
            "--shim-log-level".into(),
            "5".into(),
        ]);
        args.extend(self.args.iter().cloned());
        let env: Vec<(&str, &OsStr)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_os_str()))
            .collect();
        let log = self.log_path(self.starts);
        let binary = self.binary.as_deref().unwrap_or_else(|| shim_binary());
        if let Some(delay) = self.restart_delay {
            let command = {
                let (binary, home, port) = (binary.to_owned(), self.spelled.clone(), self.port);
                let env: Vec<(String, OsString)> = self.env.clone();
                let prefix = self.prefix.clone();
                move || {
                    let env: Vec<(&str, &OsStr)> = env
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_os_str()))
                        .collect();
                    prefixed(shim_command(&binary, &home, port, &args, &env), &prefix)
                }
            };
            let supervisor =
                Supervisor::start(command, delay, &log).unwrap_or_else(|e| panic!("{e}"));
            self.supervisor = Some(supervisor);
            self.wait_answering_supervised();
            return;
        }
        let spawned = if self.prefix.is_empty() {
            ShimProcess::spawn_with_env(binary, &self.spelled, self.port, &args, &env, &log)
        } else {
            let command = shim_command(binary, &self.spelled, self.port, &args, &env);
            ShimProcess::from_command(prefixed(command, &self.prefix), self.port, &log)
        };
        let mut process = spawned.unwrap_or_else(|e| panic!("{e}"));
        let waited = if self.wait_answering {
            process.wait_answering(WAIT_BOUND, Duration::from_millis(10))
        } else {
            process.wait_listening(WAIT_BOUND)
        };
        waited.unwrap_or_else(|e| panic!("{e}"));
        self.process = Some(process);
    }

    /// The running process.
    pub fn process(&self) -> &ShimProcess {
        self.process
            .as_ref()
            .expect("the shim runs (not supervised: see TestShim::supervisor)")
    }

    /// The supervisor of a [`TestShimBuilder::supervised`] shim.
    pub fn supervisor(&self) -> &Supervisor {
        self.supervisor.as_ref().expect("the shim is supervised")
    }

    /// Waits (bounded) until the healthcheck of the supervised shim answers, whichever start
    /// answers it.
    pub fn wait_answering_supervised(&self) {
        let api = super::http::Api { addr: self.addr() };
        wait_for("the supervised shim answers", WAIT_BOUND, || {
            if api.answers() {
                Ok(())
            } else {
                Err(format!("starts: {:?}", self.supervisor().starts()))
            }
        });
    }

    /// SIGKILL, as a crash or an OOM kill would (reaped).
    pub fn kill(&mut self) {
        let process = self.process.take().expect("the shim runs");
        process.kill().unwrap_or_else(|e| panic!("{e}"));
    }

    /// [`TestShim::kill`], then [`TestShim::start`].
    pub fn restart(&mut self) {
        self.kill();
        self.start();
    }

    /// Sends SIGTERM (see [`TestShim::wait_exit`]).
    pub fn sigterm(&self) {
        self.process().sigterm().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits (bounded) for the process to exit by itself; how it exited.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let process = self.process.take().expect("the shim runs");
        process
            .wait_exit(WAIT_BOUND)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Passes `spelled` as `--shim-home` from the next start on (another spelling of the
    /// same home: a trailing slash, `.` or `..` components, a symbolic link).
    pub fn spell_home_as(&mut self, spelled: &Path) {
        self.spelled = spelled.to_owned();
    }

    // -----------------------------------------------------------------------------------------
    // Paths and logs
    // -----------------------------------------------------------------------------------------

    /// The home (absolute, as created).
    pub fn home(&self) -> &Path {
        &self.home
    }

    /// The directory of the logs and of `volumes/`; for a temporary home, the directory
    /// holding the home too.
    pub fn root(&self) -> &Path {
        &self.logs
    }

    /// The directory of the tasks' directories in the home.
    pub fn tasks_dir(&self) -> PathBuf {
        tasks_dir(&self.home)
    }

    /// The directory of task `id` in the home (see [`task_dir`]).
    pub fn task_dir(&self, id: &str) -> PathBuf {
        task_dir(&self.home, id)
    }

    /// Makes the stub runner of the task (its TaskInfo `info`) exit with `code` (the file
    /// appears atomically). Works while the shim is down.
    pub fn exit_runner(&self, info: &Value, code: i32) {
        write_runner_exit(&self.home, info, code).unwrap_or_else(|e| panic!("{e}"));
    }

    /// A task id unique to this shim's home (container names derive from task ids, and other
    /// tests share the Docker daemon): `<name>-<8 hex digits>`.
    pub fn unique_id(&self, name: &str) -> String {
        format!("{name}-{}", self.run)
    }

    /// The log (stdout and stderr) of start number `n` (from 1).
    pub fn log_path(&self, n: u32) -> PathBuf {
        self.logs.join(format!("shim-{n}.log"))
    }

    /// Everything the shim logged since it was first started.
    pub fn all_logs(&self) -> String {
        (1..=self.starts)
            .map(|n| fs_err::read_to_string(self.log_path(n)).unwrap_or_default())
            .collect()
    }

    /// The end of the last starts' logs, without the lines of GET requests (the tests poll).
    pub fn log_tail(&self) -> String {
        let mut out = String::new();
        for n in self.starts.saturating_sub(TAIL_STARTS) + 1..=self.starts {
            let text = fs_err::read_to_string(self.log_path(n))
                .unwrap_or_else(|e| format!("(no log: {e})"));
            let lines: Vec<&str> = text.lines().filter(|l| !l.contains(POLL_LINE)).collect();
            let tail = lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n");
            out.push_str(&format!(
                "----- shim output, start #{n} of {} (last {TAIL_LINES} lines but GET \
                 requests) -----\n{tail}\n",
                self.starts
            ));
        }
        out
    }

    // -----------------------------------------------------------------------------------------
    // The API
    // -----------------------------------------------------------------------------------------

    /// Where the API of the current (or last) start listens.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// The API of the current (or last) start, whose methods return errors instead of
    /// failing the test.
    pub fn api(&self) -> Api {
        Api { addr: self.addr() }
    }

    /// Sends `request`; the answer, or the error if none came.
    pub fn try_send(&self, request: &Request) -> std::io::Result<Response> {
        request.send(self.addr())
    }

    /// Sends `request`; the answer whatever its status.
    pub fn send(&self, request: &Request) -> Response {
        self.try_send(request).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sends `request`, which must answer 200 with JSON; that JSON.
    pub fn ok(&self, request: &Request) -> Value {
        self.send(request).ok()
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> Response {
        self.send(&Request::get(path))
    }

    /// `GET /metrics`, checked (200, OpenMetrics content type) and parsed strictly.
    pub fn metrics(&self) -> Metrics {
        let r = self.get("/metrics");
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(
            r.header("content-type"),
            Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
        );
        parse_openmetrics(&r.body).unwrap_or_else(|e| panic!("{e}\n{}", r.body))
    }

    /// `POST path` with a JSON body.
    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.send(&Request::post(path).json(body))
    }

    /// `POST path` with a raw body (and a `Content-Type` if given).
    pub fn post_raw(&self, path: &str, content_type: Option<&str>, body: &[u8]) -> Response {
        self.send(&Request::post(path).body(content_type, body))
    }

    /// Submits a task config (`POST /api/tasks`).
    pub fn submit(&self, config: &Value) -> Response {
        self.post("/api/tasks", config)
    }

    /// The TaskInfo of `id` (200, JSON).
    pub fn info(&self, id: &str) -> Value {
        self.get(&format!("/api/tasks/{id}")).ok()
    }

    /// The TaskInfo of `id`, or `None` if the shim does not know it (404); any other answer
    /// fails.
    pub fn info_opt(&self, id: &str) -> Option<Value> {
        let r = self.get(&format!("/api/tasks/{id}"));
        match r.status {
            200 => Some(r.json_body()),
            404 => None,
            _ => panic!("GET /api/tasks/{id}: {r:?}"),
        }
    }

    /// The request that terminates `id`.
    pub fn terminate_request(id: &str, reason: &str, message: &str, timeout: u64) -> Request {
        Request::post(&format!("/api/tasks/{id}/terminate")).json(&json!({
            "termination_reason": reason,
            "termination_message": message,
            "timeout": timeout,
        }))
    }

    /// Terminates `id` (see [`TestShim::terminate_request`]); the answer.
    pub fn terminate(&self, id: &str, reason: &str, message: &str, timeout: u64) -> Response {
        self.send(&Self::terminate_request(id, reason, message, timeout))
    }

    /// Removes `id` once (`POST /api/tasks/<id>/remove`); the answer.
    pub fn remove(&self, id: &str) -> Response {
        self.send(&Request::post(&format!("/api/tasks/{id}/remove")))
    }

    /// Removes a terminated task, retrying while its start or release is in flight
    /// ([`Api::remove_retrying`], bounded by [`WAIT_BOUND`]).
    pub fn remove_retrying(&self, id: &str) {
        self.api()
            .remove_retrying(id, WAIT_BOUND)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// `GET /api/tasks` as a map id → status (every id once; [`Api::list`]).
    pub fn list(&self) -> BTreeMap<String, String> {
        self.api().list().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Polls the task (every [`POLL`], bounded by [`WAIT_BOUND`]) until its status is
    /// `status`; a task that ends while another status is awaited fails the test at once
    /// ([`Api::wait_status`]).
    pub fn wait_status(&self, id: &str, status: &str) -> Value {
        self.api()
            .wait_status(id, status, POLL, WAIT_BOUND)
            .unwrap_or_else(|e| panic!("{e}"))
            .0
    }

    /// Terminates (if needed) and removes a task over the API, checking both answers and
    /// that the task is gone ([`Api::finish`]).
    pub fn finish(&self, id: &str) {
        let message = format!("{} clean-up", self.label);
        self.api()
            .finish(id, "terminated_by_server", &message, WAIT_BOUND)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    // -----------------------------------------------------------------------------------------
    // Its containers
    // -----------------------------------------------------------------------------------------

    /// The home's owner identity as the shim stored it at its first start
    /// (`<home>/owner-id`); fails if it is not there.
    pub fn owner(&self) -> String {
        fs_err::read_to_string(self.home.join("owner-id"))
            .unwrap_or_else(|e| panic!("{e}"))
            .trim()
            .to_owned()
    }

    /// The home's containers (running or not) on its daemon: name → (id, running). Their
    /// owner label is the home's owner identity (before the first start, the one derived
    /// from the home's path: see [`super::owner_identity`]).
    pub fn containers(&self) -> BTreeMap<String, (String, bool)> {
        let filter = format!("label={LABEL_OWNER}={}", super::owner_identity(&self.home));
        docker_at_ok(
            self.docker_host.as_deref(),
            &[
                "ps",
                "-a",
                "--no-trunc",
                "--filter",
                &filter,
                "--format",
                "{{.Names}} {{.ID}} {{.State}}",
            ],
        )
        .lines()
        .map(
            |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                [name, id, state] => (name.to_owned(), (id.to_owned(), state == "running")),
                _ => panic!("docker ps: unexpected line {line:?}"),
            },
        )
        .collect()
    }

    /// The full ids of the home's containers (running or not).
    pub fn container_ids(&self) -> BTreeSet<String> {
        self.containers().into_values().map(|(id, _)| id).collect()
    }

    /// Whether a container (name or id) on the shim's daemon runs: `None` if there is none.
    pub fn running(&self, container: &str) -> Option<bool> {
        container_running(self.docker_host.as_deref(), container)
    }
}

impl Drop for TestShim {
    #[allow(
        clippy::print_stderr,
        reason = "a failing test shows the end of the shim's output"
    )]
    fn drop(&mut self) {
        // The shim dies before its containers are swept, and they are swept before a
        // temporary home (the last field) is deleted: the sweeper reads the owner identity
        // from it.
        drop(self.process.take());
        drop(self.supervisor.take());
        if let Some(sweeper) = &self.sweeper {
            sweeper.sweep();
        }
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail());
        }
    }
}
