//! Issue 21: the dstack server upgrades a host with `POST /api/components/install` then `POST
//! /api/shutdown`, and systemd restarts the process (`Restart=always`, `RestartSec=3`). Here
//! that shutdown is an upgrade in place: under a steady load of API requests and with tasks
//! running, no request fails, the PID stays the same, every task keeps its container; a new
//! binary that does not start is rolled back and the host keeps a shim.
//!
//! The shim runs under the harness's `Supervisor`, which restarts it 3 s after it exits as
//! systemd does with the unit the server writes (there is no systemd here). The binaries are
//! the release artifacts of two dstack releases (`cargo xtask dist --upstream-version X`,
//! found through `shim_e2e::dist_artifact`), served over HTTP to the install as the server's
//! `DSTACK_SHIM_DOWNLOAD_URL` serves them.
//!
//! upstream: runner/internal/shim/api/handlers.go (ComponentInstallHandler, ShutdownHandler),
//! runner/internal/shim/components/shim.go, src/dstack/_internal/server/background/
//! pipeline_tasks/instances/check.py (_maybe_install_components: install, then shutdown at
//! a later check once the installed version differs from the running one),
//! src/dstack/_internal/server/services/ssh_fleets/provisioning.py (the unit: RestartSec=3).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    reason = "test code: a failed unwrap is a failed test; figures go to stderr"
)]

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shim_e2e::harness::supervisor::group_members;
use shim_e2e::harness::{
    Request, Response, TestShim, bridge_task, docker_ok, run_tag, wait_for, wait_until,
};
use shim_e2e::{
    DSTACK_VERSION, OLDER_DSTACK_VERSION, dist_artifact, dstack_python, go_arch, repo_root,
    require_docker,
};

/// The restart delay of the unit the dstack server writes.
const RESTART_SEC: Duration = Duration::from_secs(3);
/// The dstack server's timeout for a shim request (`REQUEST_TIMEOUT` in
/// services/runner/client.py).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(9);
/// Bounds of the waits (never timed assertions).
const BOUND: Duration = Duration::from_secs(120);
/// The load: this many clients, each sending a request every `LOAD_EVERY` on a new
/// connection (the server's SSH tunnel opens one per request): 100 requests/s.
const LOAD_CLIENTS: usize = 4;
const LOAD_EVERY: Duration = Duration::from_millis(40);
/// The record of a rolled-back upgrade, in the shim's home.
const ROLLBACK_RECORD: &str = "upgrade-rollback.json";

// ---- Fixtures

/// The release artifact for `release`; fails the test loudly when it was not built.
fn artifact(release: &str) -> PathBuf {
    let path = dist_artifact(release);
    assert!(
        path.is_file(),
        "{} is missing: build it with `cargo xtask dist --upstream-version {release}` (or set \
         SHIM_TEST_DIST_DIR to a directory of release artifacts)",
        path.display()
    );
    path
}

/// `<binary> --version`'s version.
fn version_of(binary: &Path) -> String {
    let out = Command::new(binary).arg("--version").output().unwrap();
    assert!(
        out.status.success(),
        "{} --version: {out:?}",
        binary.display()
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.split_whitespace().nth(2).unwrap().to_owned()
}

fn same_bytes(a: &Path, b: &Path) -> bool {
    fs_err::read(a).unwrap() == fs_err::read(b).unwrap()
}

/// A shell script that answers `--version` with `version` and does `then` when started as a
/// shim: the hard case of a broken binary (a good version, no shim).
fn script(version: &str, then: &str) -> Vec<u8> {
    format!(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo \"dstack-shim version {version}\"; \
         exit 0; fi\n{then}\n"
    )
    .into_bytes()
}

/// A tiny HTTP server for the installs: `GET /<name>` answers the file `name` of its
/// directory (404 otherwise), as the server's download URL does.
struct FileServer {
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl FileServer {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let (addr, dir) = (listener.local_addr().unwrap(), tempfile::tempdir().unwrap());
        let root = dir.path().to_owned();
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let root = root.clone();
                std::thread::spawn(move || Self::answer(stream, &root));
            }
        });
        Self { addr, dir }
    }

    /// Answers one request on `stream` (one request per connection).
    fn answer(mut stream: TcpStream, root: &Path) {
        let reader = BufReader::new(stream.try_clone().unwrap());
        let mut lines = reader.lines().map_while(Result::ok);
        let Some(request) = lines.next() else { return };
        // The headers, up to the empty line.
        lines.find(String::is_empty);
        let target = request.split(' ').nth(1).unwrap_or("/");
        let name = target.trim_start_matches('/');
        let (status, body) = match fs_err::read(root.join(name)) {
            Ok(body) => ("200 OK", body),
            Err(_) => ("404 Not Found", Vec::new()),
        };
        let head = format!(
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        let head = stream.write_all(head.as_bytes());
        let _ = head.and_then(|()| stream.write_all(&body));
    }

    /// Serves `bytes` as `name`; its URL.
    fn serve(&self, name: &str, bytes: Vec<u8>) -> String {
        let path = self.dir.path().join(name);
        fs_err::create_dir_all(path.parent().unwrap()).unwrap();
        fs_err::write(path, bytes).unwrap();
        format!("http://{}/{name}", self.addr)
    }

    /// Serves `binary` where the server's download URL puts `release`'s artifact for this
    /// machine; its URL.
    fn serve_release(&self, release: &str, binary: &Path) -> String {
        let name = format!("{release}/dstack-shim-linux-{}", go_arch());
        self.serve(&name, fs_err::read(binary).unwrap())
    }
}

// ---- The load

/// One request of the load.
#[derive(Debug, Clone)]
struct Sample {
    sent: Instant,
    latency: Duration,
    #[allow(dead_code, reason = "shown when a request failed")]
    path: String,
    /// The status, or why no answer came.
    outcome: Result<u16, String>,
    /// The healthcheck's version.
    version: Option<String>,
}

impl Sample {
    /// Sends `GET path` to `addr` (a new connection, the server's timeout); how it went.
    fn take(addr: SocketAddr, path: &str) -> Self {
        let sent = Instant::now();
        let answer = Request::get(path).timeout(REQUEST_TIMEOUT).send(addr);
        let latency = sent.elapsed();
        let healthy = |r: &&Response| path == "/api/healthcheck" && r.status == 200;
        let version = answer
            .as_ref()
            .ok()
            .filter(healthy)
            .and_then(|r| r.json().ok());
        let version = version.and_then(|v| v["version"].as_str().map(str::to_owned));
        let outcome = answer.map(|r| r.status).map_err(|e| e.to_string());
        let path = path.to_owned();
        Self {
            sent,
            latency,
            path,
            outcome,
            version,
        }
    }

    fn failed(&self) -> bool {
        self.outcome != Ok(200)
    }

    fn answered(&self) -> Instant {
        self.sent + self.latency
    }
}

/// Clients sending healthchecks, task lists and task infos at a steady rate, each on a new
/// connection with the server's timeout, recording every request.
struct Load {
    stop: Arc<AtomicBool>,
    clients: Vec<JoinHandle<Vec<Sample>>>,
}

impl Load {
    fn start(addr: SocketAddr, task_ids: &[String]) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let mut paths = vec!["/api/healthcheck".to_owned(), "/api/tasks".to_owned()];
        paths.extend(task_ids.iter().map(|id| format!("/api/tasks/{id}")));
        let clients = (0..LOAD_CLIENTS)
            .map(|n| {
                let (stop, paths) = (stop.clone(), paths.clone());
                std::thread::spawn(move || {
                    // Spread the clients over the period.
                    std::thread::sleep(LOAD_EVERY / LOAD_CLIENTS as u32 * n as u32);
                    let mut samples = Vec::new();
                    let mut next = Instant::now();
                    for path in paths.iter().cycle().skip(n) {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        samples.push(Sample::take(addr, path));
                        // The next request's time, never in the past.
                        next = (next + LOAD_EVERY).max(Instant::now());
                        std::thread::sleep(next.saturating_duration_since(Instant::now()));
                    }
                    samples
                })
            })
            .collect();
        Self { stop, clients }
    }

    /// Stops the clients; every request they made, by time sent.
    fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::SeqCst);
        let all = self.clients.into_iter().flat_map(|c| c.join().unwrap());
        let mut all: Vec<Sample> = all.collect();
        all.sort_by_key(|s| s.sent);
        all
    }
}

/// The figures of the samples sent in `[from, to)`.
fn figures(samples: &[Sample], from: Instant, to: Instant) -> (usize, Vec<Sample>, Duration) {
    let in_window = |s: &&Sample| s.sent >= from && s.sent < to;
    let window: Vec<&Sample> = samples.iter().filter(in_window).collect();
    let failed = window.iter().filter(|s| s.failed()).map(|&s| s.clone());
    let failed = failed.collect();
    let longest = window.iter().map(|s| s.latency).max().unwrap_or_default();
    (window.len(), failed, longest)
}

/// When the first and the last answer of the healthchecks that `version` answered came.
fn answers_from(samples: &[Sample], version: &str) -> (Instant, Instant) {
    let by_version = |s: &&Sample| s.version.as_deref() == Some(version);
    let answered = samples.iter().filter(by_version).map(Sample::answered);
    (answered.clone().min().unwrap(), answered.max().unwrap())
}

// ---- The shim and its tasks

/// A supervised shim running a copy of `binary` at `<dir>/bin/dstack-shim` (0755), where
/// installs put the new binary (`--shim-binary-path` defaults to the running executable); with
/// `env`; started. Returns the path and its directory too (keep it while the shim runs).
fn supervised_shim(
    label: &str,
    binary: &Path,
    env: &[(&str, &str)],
) -> (TestShim, PathBuf, tempfile::TempDir) {
    let prefix = format!("shim-{label}-bin-");
    let dir = tempfile::Builder::new().prefix(&prefix).tempdir().unwrap();
    let path = dir.path().join("bin/dstack-shim");
    fs_err::create_dir_all(path.parent().unwrap()).unwrap();
    fs_err::copy(binary, &path).unwrap();
    fs_err::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let builder = TestShim::builder(label).supervised(RESTART_SEC);
    let builder = builder.binary(&path);
    let shim = env.iter().fold(builder, |b, (k, v)| b.env(k, v)).start();
    (shim, path, dir)
}

/// `docker inspect` of a container: (running, started at).
fn container_state(id: &str) -> (String, String) {
    let out = docker_ok(&[
        "inspect",
        "-f",
        "{{.State.Running}} {{.State.StartedAt}}",
        id,
    ]);
    let (running, started) = out.trim().split_once(' ').unwrap();
    (running.to_owned(), started.to_owned())
}

/// Tasks running through an upgrade: task id → (container id, the container's state
/// ([`container_state`]) once they all ran).
struct Tasks(BTreeMap<String, (String, (String, String))>);

impl Tasks {
    /// Submits `n` tasks and waits until they run.
    fn start(shim: &TestShim, n: usize) -> Self {
        let ids: Vec<String> = (0..n).map(|i| shim.unique_id(&format!("up{i}"))).collect();
        for id in &ids {
            let config = bridge_task(id, &format!("up-{id}-{}", run_tag()), 1);
            shim.submit(&config).ok();
        }
        let running = ids.into_iter().map(|id| {
            let info = shim.wait_status(&id, "running");
            (id, info["container_id"].as_str().unwrap().to_owned())
        });
        let running: Vec<(String, String)> = running.collect();
        // The states once they all ran.
        let tasks = running.into_iter().map(|(id, cid)| {
            let state = container_state(&cid);
            (id, (cid, state))
        });
        Self(tasks.collect())
    }

    fn ids(&self) -> Vec<String> {
        self.0.keys().cloned().collect()
    }

    /// Every container still runs since the same moment.
    fn assert_containers_untouched(&self) {
        for (cid, state) in self.0.values() {
            assert_eq!(&container_state(cid), state, "container {cid}");
        }
    }

    /// Every task is `running` with the same container, which runs since the same moment.
    fn assert_untouched(&self, shim: &TestShim) {
        for (id, (cid, _)) in &self.0 {
            let info = shim.info(id);
            assert_eq!(info["status"], "running", "{info}");
            assert_eq!(info["container_id"], cid.as_str(), "{info}");
        }
        self.assert_containers_untouched();
    }

    fn finish(&self, shim: &TestShim) {
        self.0.keys().for_each(|id| shim.finish(id));
    }
}

/// The `dstack-shim` component: [status, version] (every component must have the three).
fn shim_component(shim: &TestShim) -> [String; 2] {
    let list = shim.get("/api/components").ok();
    let components = list["components"].as_array().unwrap().iter().map(|c| {
        let [name, status, version] =
            ["name", "status", "version"].map(|f| c[f].as_str().unwrap().to_owned());
        (name, [status, version])
    });
    let mut components: BTreeMap<String, [String; 2]> = components.collect();
    let shim = components.remove("dstack-shim");
    shim.unwrap_or_else(|| panic!("{list}"))
}

/// Installs `url` as `dstack-shim` and waits until the install is over (the server's next
/// instance check reads the list the same way); the component's [status, version].
fn install(shim: &TestShim, url: &str) -> [String; 2] {
    let install = json!({"name": "dstack-shim", "url": url});
    let answer = shim.post("/api/components/install", &install);
    answer.assert_empty_ok();
    wait_for("the install ends", BOUND, || {
        let component = shim_component(shim);
        let state = format!("{component:?}");
        (component[0] != "installing")
            .then_some(component)
            .ok_or(state)
    })
}

/// `POST /api/shutdown` as the server sends it; when it was answered.
fn shutdown(shim: &TestShim) -> Instant {
    let answer = shim.post("/api/shutdown", &json!({"force": false}));
    let at = Instant::now();
    answer.assert_empty_ok();
    at
}

/// Waits until the healthcheck answers `version`.
fn wait_version(shim: &TestShim, version: &str) {
    let healthcheck = Request::get("/api/healthcheck").timeout(REQUEST_TIMEOUT);
    wait_for(&format!("version {version} answers"), BOUND, || {
        let answer = healthcheck.send(shim.addr());
        match answer {
            Ok(r) if r.status == 200 && r.json_body()["version"] == version => Ok(()),
            Ok(r) => Err(format!("{r:?}")),
            Err(e) => Err(e.to_string()),
        }
    });
}

/// Waits until the supervisor has started the shim `n` times and the last start runs.
fn wait_starts(shim: &TestShim, n: usize) {
    wait_for("the supervisor starts the shim again", BOUND, || {
        let starts = shim.supervisor().starts();
        let started = starts.len() == n && shim.supervisor().pid().is_some();
        started.then_some(()).ok_or_else(|| format!("{starts:?}"))
    });
}

/// Nothing restarted: the supervisor started the shim once, and `pid` (the process systemd
/// watches) still runs it.
fn assert_same_process(shim: &TestShim, pid: u32) {
    let starts = shim.supervisor().starts();
    assert_eq!(starts.len(), 1, "{starts:?}");
    assert_eq!(shim.supervisor().pid(), Some(pid), "the same process");
}

/// The watchdog is gone: only the shim is left in its process group.
fn wait_alone(shim: &TestShim) {
    let pid = shim.supervisor().pid().unwrap();
    wait_for("the upgrade watchdog exits", BOUND, || {
        let members = group_members(pid);
        let state = format!("process group {pid}: {members:?}");
        (members == [pid]).then_some(()).ok_or(state)
    });
}

/// Fails the test unless the shim's logs hold each of `lines`.
fn assert_logged(shim: &TestShim, lines: &[&str]) {
    let log = shim.all_logs();
    for line in lines {
        assert!(log.contains(line), "{line:?} missing: {log}");
    }
}

/// The record of the last rolled-back upgrade.
fn record(shim: &TestShim) -> Value {
    serde_json::from_slice(&fs_err::read(shim.home().join(ROLLBACK_RECORD)).unwrap()).unwrap()
}

/// Fails the test unless the last upgrade was rolled back for `reason` (a part of the record's).
fn assert_rolled_back_for(shim: &TestShim, reason: &str) {
    let record = record(shim);
    let recorded = record["reason"].as_str().unwrap();
    assert!(recorded.contains(reason), "{reason:?} not in {record}");
}

// ---- The tests

/// Install + shutdown as the server does, from the older release to the current one, under
/// 100 requests/s and with three tasks running: no request fails, the PID (the process
/// systemd watches) stays the same, the new version answers, every task keeps its container
/// (same container, still running since the same moment), the watchdog goes away.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn an_upgrade_in_place_fails_no_request_and_keeps_every_task() {
    require_docker();
    let (old, new) = (artifact(OLDER_DSTACK_VERSION), artifact(DSTACK_VERSION));
    let (old_version, new_version) = (version_of(&old), version_of(&new));
    assert_ne!(old_version, new_version);
    let (shim, path, _bin) = supervised_shim("upgrade", &old, &[]);
    wait_version(&shim, &old_version);
    let tasks = Tasks::start(&shim, 3);
    let pid = shim.supervisor().pid().unwrap();
    let files = FileServer::start();
    let url = files.serve_release(DSTACK_VERSION, &new);

    let load = Load::start(shim.addr(), &tasks.ids());
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(install(&shim, &url), ["installed", &new_version]);
    let shutdown_at = shutdown(&shim);
    wait_version(&shim, &new_version);
    let new_answers = shutdown_at.elapsed();
    std::thread::sleep(Duration::from_secs(2));
    let samples = load.finish();

    let (total, failed, longest) = figures(&samples, samples[0].sent, Instant::now());
    let (after, _, longest_after) = figures(&samples, shutdown_at, Instant::now());
    let since_shutdown = |at: Instant| at.saturating_duration_since(shutdown_at).as_secs_f64();
    let first_new = since_shutdown(answers_from(&samples, &new_version).0);
    let last_old = since_shutdown(answers_from(&samples, &old_version).1);
    let (n, new_answers) = (failed.len(), new_answers.as_secs_f64());
    let (longest, longest_after) = (longest.as_secs_f64(), longest_after.as_secs_f64());
    eprintln!(
        "upgrade in place {old_version} -> {new_version}: {total} requests ({after} after the \
         shutdown), {n} failed; the new version answered {new_answers:.3} s after the \
         shutdown's 200 (load: first new answer {first_new:.3} s after it, last old answer \
         {last_old:.3} s); longest request {longest:.3} s ({longest_after:.3} s after the \
         shutdown)",
    );
    assert!(failed.is_empty(), "failed requests: {failed:#?}");
    assert!(
        after > 50,
        "the load ran through the upgrade: {after} requests"
    );

    // The same process (systemd's main PID), now the new binary; nothing restarted.
    assert_same_process(&shim, pid);
    let exe = fs_err::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert_eq!(exe, path, "the new binary runs from the path");
    assert!(same_bytes(&path, &new));
    assert_eq!(shim_component(&shim), ["installed", &new_version]);
    tasks.assert_untouched(&shim);
    wait_alone(&shim);
    assert!(!shim.home().join(ROLLBACK_RECORD).exists());
    assert_logged(
        &shim,
        &[
            "serving the listening socket passed by the parent",
            "the new dstack-shim answers: upgrade done",
        ],
    );

    // A second shutdown with nothing new installed exits, as upstream's does; systemd (the
    // supervisor) starts it again, and the tasks are still there.
    shutdown(&shim);
    wait_starts(&shim, 2);
    assert!(shim.supervisor().starts()[0].exit.unwrap().success());
    shim.wait_answering_supervised();
    tasks.assert_untouched(&shim);
    tasks.finish(&shim);
}

/// Broken new binaries, under load with two tasks running; each time the host keeps a shim,
/// the path gets the running binary back, `dstack-shim` reports `error`, and the tasks keep
/// their containers:
/// - not an executable at all: refused at its install (`--version`), the running binary put
///   back at once; copied to the path by hand, refused by the shutdown's pre-flight; never
///   started either way; the shim keeps serving (same PID, no failed request);
/// - a good `--version` but exits when started as a shim (the hard case): it is exec'd, dies;
///   the watchdog puts the old binary back and systemd starts it after `RestartSec`;
/// - the same binary installed again: refused at its install, never put at the path (it
///   failed before);
/// - a good `--version` that hangs: killed by the watchdog after its bound, rolled back.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn a_broken_new_binary_is_rolled_back_and_the_host_keeps_a_shim() {
    require_docker();
    let current = artifact(DSTACK_VERSION);
    let version = version_of(&current);
    let (shim, path, _bin) = supervised_shim(
        "rollback",
        &current,
        &[("DSTACK_SHIM_UPGRADE_TIMEOUT", "5")],
    );
    let tasks = Tasks::start(&shim, 2);
    let files = FileServer::start();
    let load = Load::start(shim.addr(), &tasks.ids());
    let mut phases: Vec<(&str, Instant, Instant)> = Vec::new();
    // A shutdown whose pre-flight refuses the binary at the path: the running binary is put
    // back and the same process serves on.
    let refused = || {
        let pid = shim.supervisor().pid().unwrap();
        shutdown(&shim);
        wait_until("the running binary is put back", BOUND, || {
            same_bytes(&path, &current)
        });
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(shim.supervisor().pid(), Some(pid), "still the same process");
    };
    // An upgrade to `url` (installed as `installs`) whose binary is exec'd and ends: the
    // supervisor then starts the shim for the `starts`-th time; how the new binary ended.
    let exec_fails = |url: &str, installs: [&str; 2], starts: usize| -> ExitStatus {
        assert_eq!(install(&shim, url), installs);
        shutdown(&shim);
        wait_starts(&shim, starts);
        shim.supervisor().starts()[starts - 2].exit.unwrap()
    };
    // What every rollback leaves: `starts` starts, the old version answering from the path,
    // the component in error, the tasks untouched, the watchdog gone.
    let after_rollback = |starts: usize| {
        assert_eq!(shim.supervisor().starts().len(), starts);
        wait_version(&shim, &version);
        assert!(same_bytes(&path, &current), "the running binary is back");
        assert_eq!(shim_component(&shim), ["error", ""]);
        tasks.assert_untouched(&shim);
        wait_alone(&shim);
    };

    // Not an executable: it never reaches the path (fetched beside it, refused there), with
    // no shutdown (the dstack server, seeing no version, sends none: it installs again), so a
    // restart or a reboot never starts it.
    let from = Instant::now();
    let pid = shim.supervisor().pid().unwrap();
    assert_eq!(
        install(&shim, &files.serve("garbage", vec![0x5a; 4096])),
        ["error", ""]
    );
    assert!(same_bytes(&path, &current), "the running binary stays");
    assert_eq!(shim.supervisor().pid(), Some(pid), "still the same process");
    after_rollback(1);
    assert_logged(&shim, &["does not report a version"]);
    // Put at the path by other means (an operator's copy): refused by the shutdown's
    // pre-flight, before anything stops.
    let copied = path.with_extension("copied");
    fs_err::write(&copied, vec![0x5a; 4096]).unwrap();
    fs_err::rename(&copied, &path).unwrap();
    refused();
    after_rollback(1);
    assert_rolled_back_for(&shim, "does not report a version");
    phases.push(("not an executable", from, Instant::now()));

    // A good version that does not start (the hard case).
    let from = Instant::now();
    let exits = script(
        "0.22.99+rust.0.1.0",
        "echo 'broken dstack-shim: exiting' >&2\nexit 1",
    );
    let exits_url = files.serve("exits", exits);
    let exit = exec_fails(&exits_url, ["installed", "0.22.99+rust.0.1.0"], 2);
    assert_eq!(exit.code(), Some(1), "the broken binary exited");
    after_rollback(2);
    let rec = record(&shim);
    assert_eq!(rec["failed_version"], "0.22.99+rust.0.1.0", "{rec}");
    assert_eq!(rec["restored_version"], version.as_str(), "{rec}");
    assert_rolled_back_for(&shim, "it exited before it answered its healthcheck");
    phases.push(("exits at start", from, Instant::now()));

    // The same binary again: refused at its install, never put at the path systemd starts
    // (a restart or a reboot would start it with no watchdog); the component reads `error`
    // as after the rollback, so the server restarts nothing, and the same process serves on.
    let from = Instant::now();
    let pid = shim.supervisor().pid().unwrap();
    assert_eq!(install(&shim, &exits_url), ["error", ""]);
    assert!(
        same_bytes(&path, &current),
        "the path keeps the running binary"
    );
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(shim.supervisor().pid(), Some(pid), "still the same process");
    after_rollback(2);
    assert_eq!(
        record(&shim),
        rec,
        "the record of the failure is kept as it was"
    );
    assert_logged(&shim, &["is the binary rolled back at"]);
    phases.push(("the same binary again", from, Instant::now()));

    // A good version that never answers: killed after the bound (5 s here), rolled back.
    let from = Instant::now();
    let hangs = files.serve("hangs", script("0.22.98+rust.0.1.0", "exec sleep 600"));
    let exit = exec_fails(&hangs, ["installed", "0.22.98+rust.0.1.0"], 3);
    assert_eq!(exit.signal(), Some(9), "the hung binary was killed");
    after_rollback(3);
    assert_rolled_back_for(&shim, "it did not answer within 5s");
    phases.push(("hangs", from, Instant::now()));

    let samples = load.finish();
    for (name, from, to) in &phases {
        let (total, failed, longest) = figures(&samples, *from, *to);
        let (n, longest) = (failed.len(), longest.as_secs_f64());
        eprintln!("rollback, {name}: {total} requests, {n} failed, longest {longest:.3} s");
        if matches!(*name, "not an executable" | "the same binary again") {
            assert!(failed.is_empty(), "{name}: {failed:#?}");
        }
    }
    tasks.finish(&shim);
}

/// The dstack server's own instance check (`_maybe_install_components` of dstack 0.22.5, run
/// unchanged by `tests/dstack-server/upgrade_shim.py` every 0.5 s as a release server of
/// 0.22.5 whose `DSTACK_SHIM_DOWNLOAD_URL` points at the artifacts) upgrades a shim of the
/// older release: it installs the new binary, then asks for the restart; under 100
/// requests/s with two tasks running no request fails, the PID stays, the tasks keep their
/// containers, and the server, seeing its own version running, asks nothing more.
///
/// upstream: src/dstack/_internal/server/background/pipeline_tasks/instances/check.py
/// (_maybe_install_components, _maybe_install_shim), src/dstack/_internal/core/backends/base/
/// compute.py (get_dstack_shim_download_url).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn the_dstack_servers_own_instance_check_upgrades_it_in_place() {
    require_docker();
    let python = dstack_python();
    assert!(
        python.exists(),
        "{} is missing: run `cargo xtask dev-env` (it installs dstack[server]=={DSTACK_VERSION} \
         in a venv) or set {}",
        python.display(),
        shim_e2e::ENV_DSTACK_PYTHON
    );
    let (old, new) = (artifact(OLDER_DSTACK_VERSION), artifact(DSTACK_VERSION));
    let new_version = version_of(&new);
    // The stub runner reports the server's release, as an installed runner would: the server
    // then installs only the shim.
    let runner_version = [("STUB_RUNNER_VERSION", DSTACK_VERSION)];
    let (shim, path, _bin) = supervised_shim("server-upgrade", &old, &runner_version);
    let tasks = Tasks::start(&shim, 2);
    let pid = shim.supervisor().pid().unwrap();
    let files = FileServer::start();
    let url = files.serve_release(DSTACK_VERSION, &new);
    let load = Load::start(shim.addr(), &tasks.ids());
    let from = Instant::now();
    let template = format!(
        "http://{}/{{version}}/dstack-shim-linux-{{arch}}",
        files.addr
    );
    let out = Command::new(&python)
        .arg(repo_root().join("tests/dstack-server/upgrade_shim.py"))
        .arg(format!("http://{}", shim.addr()))
        .args(["--server-version", DSTACK_VERSION])
        .args(["--download-url", &template])
        .output()
        .unwrap();
    let took = from.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let samples = load.finish();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let summary: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let install = json!({"name": "dstack-shim", "url": url});
    let sent = json!([
        {"method": "POST", "path": "/api/components/install", "body": install},
        {"method": "POST", "path": "/api/shutdown", "body": {"force": false}},
    ]);
    assert_eq!(summary["sent"], sent, "{summary}");
    assert_eq!(summary["version"], new_version.as_str(), "{summary}");
    let (total, failed, longest) = figures(&samples, samples[0].sent, Instant::now());
    let (took, checks, n) = (took.as_secs_f64(), &summary["checks"], failed.len());
    eprintln!(
        "the dstack server's instance check upgraded the shim in {took:.1} s ({checks} checks): \
         {total} requests, {n} failed, longest {:.3} s",
        longest.as_secs_f64()
    );
    assert!(failed.is_empty(), "failed requests: {failed:#?}");
    assert_same_process(&shim, pid);
    assert!(same_bytes(&path, &new));
    tasks.assert_untouched(&shim);
    wait_alone(&shim);
    tasks.finish(&shim);
}

/// A new binary that is not this shim (its version lacks `+rust.`, as dstack's Go shim's)
/// does not speak `LISTEN_FDS`: it is exec'd (same PID) without the socket and binds the port
/// itself. Here a stand-in answers the healthcheck with its version on the port it is given
/// (`--shim-http-port`, as upstream's shim reads it); the watchdog sees that version and
/// exits without rolling back; the tasks' containers keep running. Requests between the exec
/// and its bind are refused (counted, not asserted).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn a_binary_that_is_not_this_shim_binds_the_port_itself() {
    require_docker();
    let current = artifact(DSTACK_VERSION);
    let (shim, path, _bin) = supervised_shim("foreign", &current, &[]);
    let tasks = Tasks::start(&shim, 1);
    let pid = shim.supervisor().pid().unwrap();
    let foreign = script(
        "0.22.6",
        r#"port=10998
while [ $# -gt 0 ]; do [ "$1" = --shim-http-port ] && port=$2; shift; done
[ -z "$LISTEN_FDS" ] || { echo "LISTEN_FDS=$LISTEN_FDS passed to a foreign binary" >&2; exit 1; }
exec python3 -c '
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"{\"service\":\"dstack-shim\",\"version\":\"0.22.6\"}"
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
' "$port""#,
    );
    let files = FileServer::start();
    let url = files.serve("foreign", foreign);
    let load = Load::start(shim.addr(), &[]);
    assert_eq!(install(&shim, &url), ["installed", "0.22.6"]);
    let from = shutdown(&shim);
    wait_version(&shim, "0.22.6");
    let answered = from.elapsed();
    wait_alone(&shim);
    std::thread::sleep(Duration::from_millis(500));
    let samples = load.finish();
    let (after, failed, _) = figures(&samples, from, Instant::now());
    eprintln!(
        "exec of a binary that is not this shim: it answered {:.3} s after the shutdown's 200; \
         {} of {after} requests after the shutdown failed",
        answered.as_secs_f64(),
        failed.len()
    );
    assert_same_process(&shim, pid);
    assert!(!shim.home().join(ROLLBACK_RECORD).exists());
    assert!(!same_bytes(&path, &current), "not rolled back");
    tasks.assert_containers_untouched();
}
