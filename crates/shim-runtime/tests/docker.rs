//! shim-runtime against a real engine (Docker or Podman at `DOCKER_HOST`). The tests are
//! ignored unless run with `--run-ignored all`, and then need `SHIM_TEST_DOCKER=1`, a reachable
//! engine and the fixtures of `cargo xtask dev-env`: the image `shim-test:1`, the registry on
//! 127.0.0.1:5799 and the stub runner. `cargo xtask conformance` runs them on every engine.
//!
//! Every container a test makes carries the label `shim-runtime-test=<unique run value>` and is
//! removed by a guard, also when the test fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::collections::BTreeMap;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use shim_e2e::harness::{FreshImage, LosingProxy, docker_socket};
use shim_e2e::{assert_matches, require_docker};
use shim_runtime::{
    BindMount, ContainerDetails, ContainerEvent, ContainerInputs, ContainerRuntime, ContainerSpec,
    ContainerState, DeviceMapping, DeviceRequest, DockerRuntime, EventKind, EventStream, GpuConfig,
    LogLimits, MountPoint, PullRequest, RegistryAuth, RunnerParams, RuntimeError, Ulimit,
    build_container_spec, normalize_reference,
};
use shim_runtime::{RUNNER_DIR_IN_CONTAINER, runner_script};
use shim_task::NetworkMode;
use shim_task::PullProgress;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const TEST_LABEL: &str = "shim-runtime-test";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}

fn image() -> String {
    env_or("SHIM_TEST_IMAGE", "shim-test:1")
}

fn registry() -> String {
    env_or("SHIM_TEST_REGISTRY", "127.0.0.1:5799")
}

fn registry_auth() -> RegistryAuth {
    RegistryAuth {
        username: env_or("SHIM_TEST_REGISTRY_USER", "shimtest"),
        password: env_or("SHIM_TEST_REGISTRY_PASSWORD", "shimtest-pw"),
    }
}

fn runner_binary() -> PathBuf {
    match std::env::var("SHIM_TEST_RUNNER") {
        Ok(path) if !path.is_empty() => PathBuf::from(path),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/runner/dstack-runner"),
    }
}

/// Now, in nanoseconds since the Unix epoch.
fn now_ns() -> i64 {
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    i64::try_from(since_epoch.as_nanos()).unwrap()
}

/// A label value unique to this test in this run.
fn unique(test: &str) -> String {
    format!("{test}-{}-{}", std::process::id(), now_ns())
}

/// Whether the engine under test is Podman (its version answer names a component "Podman
/// Engine"). Only for what Podman reports differently, said where it is checked and printed
/// as `ENGINE Podman: ...` when a test takes that branch.
async fn is_podman(docker: &DockerRuntime) -> bool {
    let version = docker.client().version().await.unwrap();
    version
        .components
        .unwrap_or_default()
        .iter()
        .any(|c| c.name.starts_with("Podman"))
}

async fn runtime() -> DockerRuntime {
    DockerRuntime::connect()
        .await
        .expect("SHIM_TEST_DOCKER=1 but the Docker daemon is unreachable")
}

/// The runtime, a run value unique to `test` and the guard removing the run's containers.
async fn setup(test: &str) -> (DockerRuntime, String, Cleanup) {
    let run = unique(test);
    let guard = Cleanup::new(&run);
    (runtime().await, run, guard)
}

/// Removes every container carrying this test's label when dropped.
struct Cleanup {
    labels: Vec<(String, String)>,
    /// Images the test made, removed after its containers (a failed test leaves none).
    images: std::sync::Mutex<Vec<String>>,
}

impl Cleanup {
    fn new(value: &str) -> Self {
        Self {
            labels: vec![(TEST_LABEL.to_owned(), value.to_owned())],
            images: std::sync::Mutex::default(),
        }
    }

    /// Removes `image` at the end too.
    fn image(&self, image: &str) {
        self.images.lock().unwrap().push(image.to_owned());
    }

    fn labels(&self) -> BTreeMap<String, String> {
        self.labels.iter().cloned().collect()
    }

    /// The run's label and `key=value`.
    fn labels_with(&self, key: &str, value: &str) -> BTreeMap<String, String> {
        let mut labels = self.labels();
        labels.insert(key.to_owned(), value.to_owned());
        labels
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let labels = self.labels.clone();
        let images = std::mem::take(&mut *self.images.lock().unwrap_or_else(|p| p.into_inner()));
        // A separate thread: the test's own runtime may be the one dropping us.
        let joined = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let docker = DockerRuntime::connect().await.unwrap();
                for c in docker.list(&labels).await.unwrap() {
                    docker.remove(&c.id).await.unwrap();
                }
                for image in images {
                    // Gone already where the test ended well.
                    let _ = docker.delete_image(&image).await;
                }
            });
        })
        .join();
        if joined.is_err() {
            eprintln!("cleanup of {:?} failed", self.labels);
        }
    }
}

/// A container running `script` with `/bin/sh -c` in the test image.
fn shell_spec(name: &str, labels: &BTreeMap<String, String>, script: &str) -> ContainerSpec {
    let mut spec = ContainerSpec::new(name, image());
    spec.entrypoint = vec!["/bin/sh".to_owned(), "-c".to_owned()];
    spec.cmd = vec![script.to_owned()];
    spec.labels = labels.clone();
    spec
}

/// The inputs of a runner's task container, its runner directory `dir`, with two SSH keys
/// that a shell would misread.
fn runner_inputs(
    run: &str,
    labels: BTreeMap<String, String>,
    dir: &Path,
    network: NetworkMode,
) -> ContainerInputs {
    ContainerInputs {
        name: run.to_owned(),
        image: image(),
        labels,
        runner: RunnerParams {
            binary_host_path: runner_binary(),
            dir_host_path: dir.to_owned(),
            http_port: 10999,
            ssh_port: 10022,
            log_level: "4".to_owned(),
            ssh_log_level: None,
            http_address_localhost: network == NetworkMode::Host,
            authorized_keys: vec![
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey1 it's me".to_owned(),
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKey2 $(touch /tmp/pwned)".to_owned(),
            ],
        },
        network,
        env: vec![("SHIM_RUNTIME_TEST".to_owned(), "1".to_owned())],
        ..ContainerInputs::default()
    }
}

/// A bind mount of `source` at `target`.
fn bind(source: &Path, target: &str, read_only: bool) -> BindMount {
    BindMount {
        source: source.to_owned(),
        target: target.to_owned(),
        read_only,
    }
}

/// The event of an exit with `code`.
fn died(code: i64) -> EventKind {
    EventKind::Die {
        exit_code: Some(code),
    }
}

/// Mounts by their target: source and whether writable.
fn mounts_by_target(mounts: &[MountPoint]) -> BTreeMap<String, (String, bool)> {
    mounts
        .iter()
        .map(|m| (m.destination.clone(), (m.source.clone(), m.read_write)))
        .collect()
}

/// Creates a container of `spec` and starts it: its id.
async fn create_and_start(docker: &DockerRuntime, spec: &ContainerSpec) -> String {
    let id = docker.create(spec).await.unwrap();
    docker.start(&id).await.unwrap();
    id
}

async fn wait_exited(docker: &DockerRuntime, id: &str) -> ContainerDetails {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let details = docker.inspect(id).await.unwrap();
        if matches!(details.state, ContainerState::Exited | ContainerState::Dead) {
            return details;
        }
        assert!(
            Instant::now() < deadline,
            "container {id} did not exit: {details:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn run_to_exit(
    docker: &DockerRuntime,
    spec: &ContainerSpec,
) -> (ContainerDetails, Vec<String>) {
    let id = create_and_start(docker, spec).await;
    let details = wait_exited(docker, &id).await;
    let logs = docker.logs_tail(&id, 100).await.unwrap();
    (details, logs)
}

/// The next event of `events` that `wanted` takes, within 30 s.
async fn next_event_where(
    events: &mut EventStream,
    wanted: impl Fn(&ContainerEvent) -> bool,
) -> ContainerEvent {
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let event = events.next().await.expect("event stream ended").unwrap();
            if wanted(&event) {
                return event;
            }
        }
    })
    .await
    .expect("no such event within 30 s")
}

/// The next container event of `events`, within 30 s (image removals, which any test may
/// cause, are passed over).
async fn next_event(events: &mut EventStream) -> ContainerEvent {
    next_event_where(events, |e| e.kind != EventKind::ImageRemoved).await
}

/// Asserts that `message` contains one of `parts` (engines word the same failure differently).
#[track_caller]
fn assert_says_one_of(message: &str, parts: &[&str]) {
    let says = parts.iter().any(|p| message.contains(p));
    assert!(says, "none of {parts:?} in {message}");
}

/// What a pull returns.
type Pulled = Result<PullProgress, RuntimeError>;

/// Pulls `request`, its progress unread.
async fn pull(docker: &DockerRuntime, request: &PullRequest) -> Pulled {
    docker
        .pull(request, &|_| {}, CancellationToken::new())
        .await
}

/// The message and image of a pull that must fail as `PullFailed`.
async fn pull_failure(docker: &DockerRuntime, request: &PullRequest) -> (String, String) {
    match pull(docker, request).await {
        Err(RuntimeError::PullFailed { message, image, .. }) => (message, image),
        other => panic!("expected a pull failure, got {other:?}"),
    }
}

/// Pulls `request` recording its progress: the result, each report with the time since the
/// pull began, and how long the pull took.
async fn pull_recorded(
    docker: &DockerRuntime,
    request: &PullRequest,
) -> (Pulled, Vec<(Duration, PullProgress)>, Duration) {
    let seen = Mutex::new(Vec::new());
    let started = Instant::now();
    let record = |p: PullProgress| seen.lock().unwrap().push((started.elapsed(), p));
    let result = docker
        .pull(request, &record, CancellationToken::new())
        .await;
    (result, seen.into_inner().unwrap(), started.elapsed())
}

/// A pull interrupted once it moves.
struct Interrupted {
    /// What the pull returned.
    result: Pulled,
    /// Whether it reported bytes within 60 s (the interruption came then, or after that).
    moved: bool,
    /// How long after the interruption the pull returned.
    after: Duration,
}

/// Pulls `request` and, beside it, does `interrupt` as soon as the pull reports bytes.
async fn pull_interrupted(
    docker: &DockerRuntime,
    request: &PullRequest,
    cancel: CancellationToken,
    interrupt: impl FnOnce(),
) -> Interrupted {
    let (tx, mut rx) = tokio::sync::watch::channel(PullProgress::default());
    let on_progress = |p: PullProgress| {
        tx.send_replace(p);
    };
    let pulling = async {
        let result = docker.pull(request, &on_progress, cancel).await;
        (result, Instant::now())
    };
    let interrupting = async {
        let moving = rx.wait_for(|p| p.downloaded_bytes > 0);
        let moved = tokio::time::timeout(Duration::from_secs(60), moving)
            .await
            .is_ok();
        interrupt();
        (moved, Instant::now())
    };
    let ((result, returned), (moved, interrupted_at)) = tokio::join!(pulling, interrupting);
    Interrupted {
        result,
        moved,
        after: returned.saturating_duration_since(interrupted_at),
    }
}

/// Asserts what [`SHM_SCRIPT`] printed: `/dev/shm` mounted with `size_kib`, and whether a
/// file there could be run (mounted `exec`).
#[track_caller]
fn assert_shm(logs: &[String], size_kib: i64, exec: bool) {
    let line = logs.iter().find(|l| l.contains(" /dev/shm "));
    let line = line.unwrap_or_else(|| panic!("no /dev/shm mount line in {logs:?}"));
    assert!(line.contains(&format!("size={size_kib}k")), "{line}");
    assert_eq!(!line.contains("noexec"), exec, "{line}");
    let ran = logs.iter().any(|l| l == "shm-exec-ok");
    assert_eq!(ran, exec, "{logs:?}");
}

const SHM_SCRIPT: &str = "mount | grep ' /dev/shm '; \
printf '#!/bin/sh\\necho shm-exec-ok\\n' > /dev/shm/x.sh && chmod +x /dev/shm/x.sh && /dev/shm/x.sh; \
echo done";

/// A task that prints one 300 KB line and exits: the tail of its log is its end, at most
/// `LOGS_TAIL_MAX_BYTES` (Docker answers the line in 16 KiB pieces, Podman 5 whole), not the
/// whole line held in memory.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_log_tail_of_one_huge_line_is_its_bounded_end() {
    require_docker();
    let (docker, run, guard) = setup("longline").await;
    let script =
        "i=0; while [ $i -lt 3000 ]; do printf '%0100d' $i; i=$((i+1)); done; echo END; exit 1";
    let spec = shell_spec(&run, &guard.labels(), script);
    let (details, logs) = run_to_exit(&docker, &spec).await;
    assert_eq!(details.exit_code, Some(1));
    let bytes: usize = logs.iter().map(String::len).sum();
    assert!(bytes <= shim_runtime::LOGS_TAIL_MAX_BYTES, "{bytes} bytes");
    // Its end: Podman 4.3 answers the line's last piece alone.
    assert!(logs.last().is_some_and(|l| l.ends_with("END")), "{logs:?}");
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn dev_shm_is_noexec_by_default_and_exec_with_shm_size() {
    require_docker();
    let (docker, run, guard) = setup("shm").await;

    let spec = shell_spec(&format!("{run}-default"), &guard.labels(), SHM_SCRIPT);
    let (details, logs) = run_to_exit(&docker, &spec).await;
    assert_eq!(details.exit_code, Some(0), "{logs:?}");
    // No shm_size: the engine's default, which differs per engine (Docker 64 MiB, Podman
    // 64000 KiB) and which the engine reports as the container's ShmSize; the mount has
    // that size.
    let size = details.shm_size;
    let defaults = [64 << 20, 64_000 << 10];
    let default = defaults.contains(&size);
    assert!(default, "neither Docker's nor Podman's: {size}");
    assert_shm(&logs, size >> 10, false);

    // The spec built for a task with shm_size set.
    let runner_dir = tempfile::tempdir().unwrap();
    let name = format!("{run}-sized");
    let mut inputs = runner_inputs(&name, guard.labels(), runner_dir.path(), NetworkMode::Host);
    inputs.shm_size = 128 << 20;
    let mut spec = build_container_spec(&inputs);
    spec.cmd = vec![SHM_SCRIPT.to_owned()];
    // In the host's IPC namespace too (AMD and Gaudi tasks), where Podman refuses a ShmSize:
    // the tmpfs carries the size on every engine.
    let mut host_ipc = spec.clone();
    host_ipc.name = format!("{run}-host-ipc");
    host_ipc.ipc_mode = Some("host".to_owned());
    let (_, logs) = run_to_exit(&docker, &host_ipc).await;
    assert_shm(&logs, 131_072, true);

    let (details, logs) = run_to_exit(&docker, &spec).await;
    assert_eq!(details.exit_code, Some(0), "{logs:?}");
    assert_eq!(details.shm_size, 128 << 20);
    // The tmpfs options asked for, among the engine's own (Podman reports its defaults too:
    // `rw,rprivate,nosuid,nodev,tmpcopyup`).
    let options: Vec<&str> = details
        .tmpfs
        .get("/dev/shm")
        .map_or(Vec::new(), |o| o.split(',').collect());
    let asked = options.contains(&"exec") && options.contains(&"size=134217728");
    assert!(asked && !options.contains(&"noexec"), "{options:?}");
    assert_shm(&logs, 131_072, true);
}

/// A task's container may start as many processes as the host allows, on every engine: Docker
/// sets no limit (as under upstream's shim), Podman's default would be 2,048.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_container_has_no_process_limit() {
    require_docker();
    let (docker, run, guard) = setup("pids").await;
    let script = "cat /sys/fs/cgroup/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids/pids.max";
    let spec = shell_spec(&format!("{run}-pids"), &guard.labels(), script);
    let (details, logs) = run_to_exit(&docker, &spec).await;
    assert_eq!(details.exit_code, Some(0), "{logs:?}");
    assert_eq!(logs.last().map(String::as_str), Some("max"), "{logs:?}");
}

const MOUNTS_SCRIPT: &str = "cat /tmp/runner/hello; \
(echo x >> /usr/local/bin/dstack-runner) 2>/dev/null && echo runner-rw || echo runner-ro; \
touch /data/written && echo data-rw";

/// Issue 22, SPEC §6: bind mounts are made as upstream makes them, Docker `Mounts` of type
/// `bind` (upstream: runner/internal/shim/docker.go, `DockerMounts`, `getVolumeMounts`,
/// `getInstanceMounts`), never `Binds` (with which Docker made a directory at a missing
/// source). Sources are mounted with their read-only flags, `/dev/shm` stays the exec tmpfs of
/// `HostConfig.Tmpfs`, and the list and inspect report each mount's source (restore reads the
/// runner directory's from the list). A missing source: the next test.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn binds_are_mounts_with_their_flags_and_their_sources_listed() {
    require_docker();
    let (docker, run, guard) = setup("mounts").await;
    let dir = tempfile::tempdir().unwrap();
    let runner_dir = dir.path().join("runner");
    let data = dir.path().join("data");
    fs_err::create_dir_all(&runner_dir).unwrap();
    fs_err::create_dir_all(&data).unwrap();
    fs_err::write(runner_dir.join("hello"), "hello-from-host\n").unwrap();

    let mut inputs = runner_inputs(&run, guard.labels(), &runner_dir, NetworkMode::Host);
    inputs.mounts = vec![bind(&data, "/data", false)];
    inputs.shm_size = 64 << 20;
    let mut spec = build_container_spec(&inputs);
    spec.cmd = vec![format!("{MOUNTS_SCRIPT}; {SHM_SCRIPT}")];
    let (details, logs) = run_to_exit(&docker, &spec).await;
    assert_eq!(details.exit_code, Some(0), "{logs:?}");
    for line in ["hello-from-host", "runner-ro", "data-rw", "shm-exec-ok"] {
        assert!(logs.iter().any(|l| l == line), "{line} missing: {logs:?}");
    }
    assert!(data.join("written").exists());
    // Docker reports a bind's source cleaned (`..` resolved, links kept).
    let binary = fs_err::canonicalize(runner_binary()).unwrap();
    let expected: BTreeMap<String, (String, bool)> = [
        (RUNNER_DIR_IN_CONTAINER, runner_dir.as_path(), true),
        ("/usr/local/bin/dstack-runner", binary.as_path(), false),
        ("/data", data.as_path(), true),
    ]
    .into_iter()
    .map(|(target, source, rw)| (target.to_owned(), (source.display().to_string(), rw)))
    .collect();
    assert_eq!(mounts_by_target(&details.mounts), expected);
    let listed = docker.list(&guard.labels).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(mounts_by_target(&listed[0].mounts), expected);
}

/// Issues 22 and 27, SPEC §6: a missing bind source — the runner binary whose download
/// failed, a volume's directory — is the shim's own error, whatever the engine would do
/// (Docker refuses the create; Podman makes an empty directory at the path, so it is not asked
/// until the sources are found). The create fails with `BindSourceMissing` naming the path: no
/// container carries the run's label, and nothing appears at the path.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_missing_bind_source_is_the_shims_error_and_creates_nothing() {
    require_docker();
    let (docker, run, guard) = setup("missing-bind").await;
    let dir = tempfile::tempdir().unwrap();
    let runner_dir = dir.path().join("runner");
    fs_err::create_dir_all(&runner_dir).unwrap();
    for what in ["runner binary", "volume"] {
        let mut inputs = runner_inputs(&run, guard.labels(), &runner_dir, NetworkMode::Host);
        let missing = if what == "volume" {
            let missing = dir.path().join("no-volume").join("data");
            inputs.mounts = vec![bind(&missing, "/data", false)];
            missing
        } else {
            let missing = dir.path().join("no-runner").join("dstack-runner");
            inputs.runner.binary_host_path = missing.clone();
            missing
        };
        let e = docker
            .create(&build_container_spec(&inputs))
            .await
            .unwrap_err();
        assert_matches!(
            e,
            RuntimeError::BindSourceMissing { path, .. } if *path == missing,
            "{what}"
        );
        let text = e.to_string();
        let named = text.contains(&missing.display().to_string());
        let says = named && text.contains("does not exist");
        assert!(says, "{what}: the error names the missing path: {text}");
        let listed = docker.list(&guard.labels).await.unwrap();
        assert!(listed.is_empty(), "{what}: {listed:?}");
        assert_matches!(docker.inspect(&run).await, Err(e) if e.is_not_found(), "{what}");
        let made = missing.parent().unwrap();
        assert!(!made.exists(), "{what}: made {missing:?}");
    }
}

async fn http_get(port: u16, path: &str) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    Ok(body)
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn runner_container_bridge_ports_exit_code_and_event() {
    require_docker();
    let (docker, run, guard) = setup("bridge").await;
    let dir = tempfile::tempdir().unwrap();
    let inputs = runner_inputs(&run, guard.labels(), dir.path(), NetworkMode::Bridge);
    let mut events = docker.events(&guard.labels, None).await.unwrap();

    let id = create_and_start(&docker, &build_container_spec(&inputs)).await;
    let details = docker.inspect(&id).await.unwrap();
    assert_eq!(details.state, ContainerState::Running);
    assert_eq!(details.name, run);
    assert_eq!(details.network_mode, "bridge");
    assert!(details.env.contains(&"SHIM_RUNTIME_TEST=1".to_owned()));
    let containers: Vec<u16> = details.ports.iter().map(|p| p.container).collect();
    assert_eq!(containers, [10022, 10999], "{:?}", details.ports);
    assert!(details.ports.iter().all(|p| p.host != 0));
    let mounts = mounts_by_target(&details.mounts);
    let (runner_dir, _) = &mounts[RUNNER_DIR_IN_CONTAINER];
    assert_eq!(runner_dir, dir.path().to_str().unwrap());
    assert!(mounts.contains_key("/usr/local/bin/dstack-runner"));

    // The runner answers through the published port (bounded wait while it starts).
    let published = details.ports.iter().find(|p| p.container == 10999);
    let http = published.unwrap().host;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match http_get(http, "/api/healthcheck").await {
            Ok(body) if body.contains("dstack-runner") => break,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "runner not reachable on {http}: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // Keys reached the runner verbatim, one argument each, nothing executed.
    let args = fs_err::read_to_string(dir.path().join("stub-runner.args")).unwrap();
    let args: Vec<&str> = args.lines().collect();
    for key in &inputs.runner.authorized_keys {
        assert!(args.contains(&key.as_str()), "{key} in {args:?}");
    }
    assert!(!args.contains(&"--http-address"), "{args:?}");

    // The runner exits with the code written to its exit file, written whole (a temp file
    // renamed into place: the runner polls for the file and must never read it half-written).
    fs_err::write(dir.path().join(".exit.tmp"), "42\n").unwrap();
    fs_err::rename(dir.path().join(".exit.tmp"), dir.path().join("exit")).unwrap();
    let event = next_event(&mut events).await;
    assert_eq!(event.container_id, id);
    assert_eq!(event.name, run);
    assert_eq!(event.kind, died(42));
    let details = wait_exited(&docker, &id).await;
    assert_eq!(details.exit_code, Some(42));
    assert!(details.finished_at.is_some() && details.started_at.is_some());
    let logs = docker.logs_tail(&id, 5).await.unwrap();
    let last = logs.last().map(String::as_str);
    assert_eq!(last, Some("runner exiting with 42"), "{logs:?}");
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn host_network_has_no_ports() {
    require_docker();
    let (docker, run, guard) = setup("host").await;
    let dir = tempfile::tempdir().unwrap();
    let mut inputs = runner_inputs(&run, guard.labels(), dir.path(), NetworkMode::Host);
    // Another port than a real runner on this host might use.
    inputs.runner.http_port = 0;
    let mut spec = build_container_spec(&inputs);
    spec.cmd = vec!["sleep 30".to_owned()];
    let id = create_and_start(&docker, &spec).await;
    let details = docker.inspect(&id).await.unwrap();
    assert_eq!(details.network_mode, "host");
    assert_eq!(details.state, ContainerState::Running);
    assert!(details.ports.is_empty(), "{:?}", details.ports);
    docker.stop(&id, Duration::ZERO).await.unwrap();
    let details = wait_exited(&docker, &id).await;
    assert_eq!(details.exit_code, Some(137));
    // Stopping a stopped container is fine.
    docker.stop(&id, Duration::from_secs(1)).await.unwrap();
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn failing_container_exit_code_and_last_lines() {
    require_docker();
    let (docker, run, guard) = setup("fail").await;
    let script = "for i in 1 2 3 4 5 6; do echo out $i; done; sleep 0.1; echo err 7 >&2; sleep 0.1; echo out 8; exit 3";
    let (details, _) = run_to_exit(&docker, &shell_spec(&run, &guard.labels(), script)).await;
    assert_eq!(details.exit_code, Some(3));
    assert_eq!(details.state, ContainerState::Exited);
    let lines = docker.logs_tail(&details.id, 5).await.unwrap();
    assert_eq!(lines, ["out 4", "out 5", "out 6", "err 7", "out 8"]);
}

/// Issue 28, part 4: a running container's inspect gives its main process, whose control
/// group holds the container's usage (what the shim's per-task metrics read): the CPU seconds
/// of a busy container rise, its memory is charged; once it exits, no process is reported.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_running_containers_process_leads_to_its_cgroup_usage() {
    require_docker();
    let (docker, run, guard) = setup("cgroup").await;
    // Busy for a while, then waits to be told to end.
    let script =
        "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; touch /tmp/busy-done; sleep 60";
    let id = create_and_start(&docker, &shell_spec(&run, &guard.labels(), script)).await;
    let details = docker.inspect(&id).await.unwrap();
    let pid = details
        .pid
        .expect("a running container reports its process");
    let cgroup = shim_resources::cgroup::Cgroups::system()
        .locate(pid)
        .unwrap_or_else(|e| panic!("the cgroup of pid {pid}: {}", shim_util::error_chain(&e)));
    let first = cgroup.usage().unwrap();
    assert!(first.memory_bytes > 0, "{first:?} in {cgroup:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = first;
    while last.cpu_seconds < first.cpu_seconds + 0.1 {
        assert!(
            Instant::now() < deadline,
            "the busy loop's CPU never showed: {first:?} -> {last:?} in {cgroup:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        last = cgroup.usage().unwrap();
    }
    eprintln!("MEASURED cgroup {cgroup:?}: {first:?} -> {last:?}");
    docker.stop(&id, Duration::ZERO).await.unwrap();
    let ended = wait_exited(&docker, &id).await;
    assert_eq!(ended.pid, None, "an exited container has no process");
}

/// Lines the log-flooding container writes, each `<i> ` and 90 zeros.
const FLOOD_LINES: u64 = 50_000;

/// Issue 28: a container's log is bounded. A container that writes about 5 MB of lines under a
/// 1 MiB × 2 `json-file` limit ends with its current log file (`LogPath`, from the inspect) at
/// most the cap plus a line, its files together (`LogPath` and the rotated `LogPath.1`) at
/// most 2 MiB plus a line each, and its last lines, stdout and stderr, still read by
/// `logs_tail` (Docker reads them across the rotated files).
///
/// On Podman, `LogPath` is its `k8s-file` log (Podman takes `json-file` as an alias of it),
/// and `max-size` applies there too: conmon truncates the file when it is full, keeping no
/// rotated file (`max-file` is ignored), so only the one file is there to measure.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_flooding_containers_log_is_bounded_and_its_last_lines_readable() {
    require_docker();
    const MAX_SIZE: u64 = 1 << 20;
    const MAX_FILES: u32 = 2;
    // A file may exceed the size by the one line written when it reached it (about 150
    // bytes as a json-file entry); a little more for the engine's own framing.
    const MARGIN: u64 = 4 << 10;
    let (docker, run, guard) = setup("logcap").await;
    let podman = is_podman(&docker).await;
    let script = format!(
        "zeros=$(printf '%090d' 0); i=0; while [ $i -lt {FLOOD_LINES} ]; do echo \"$i $zeros\"; \
         i=$((i+1)); done; sleep 0.1; echo last-out-1; sleep 0.1; echo last-err-2 >&2; \
         sleep 0.1; echo last-out-3"
    );
    let written: u64 = (0..FLOOD_LINES)
        .map(|i| i.to_string().len() as u64 + 1 + 90 + 1)
        .sum::<u64>()
        + 3 * "last-out-1\n".len() as u64;
    let mut spec = shell_spec(&run, &guard.labels(), &script);
    spec.log = Some(LogLimits::new(
        NonZeroU64::new(MAX_SIZE).unwrap(),
        NonZeroU32::new(MAX_FILES).unwrap(),
    ));
    let id = create_and_start(&docker, &spec).await;
    let details = wait_exited(&docker, &id).await;
    assert_eq!(details.exit_code, Some(0), "{details:?}");

    let inspect = docker.client().inspect_container(&id, None).await.unwrap();
    let log_config = inspect
        .host_config
        .as_ref()
        .and_then(|h| h.log_config.clone())
        .unwrap();
    if podman {
        eprintln!("ENGINE Podman: the container's log config reads {log_config:?}");
    } else {
        assert_eq!(log_config.typ.as_deref(), Some("json-file"));
        let options = log_config.config.unwrap_or_default();
        assert_eq!(options["max-size"], MAX_SIZE.to_string());
        assert_eq!(options["max-file"], MAX_FILES.to_string());
    }
    let log_path = PathBuf::from(inspect.log_path.filter(|p| !p.is_empty()).unwrap());
    let current = fs_err::metadata(&log_path).unwrap().len();
    // The current file and the rotated ones beside it (`<LogPath>.1`, …).
    let name = log_path.file_name().unwrap().to_string_lossy().into_owned();
    let mut files: Vec<(String, u64)> = fs_err::read_dir(log_path.parent().unwrap())
        .unwrap()
        .map(Result::unwrap)
        .filter(|entry| entry.file_name().to_string_lossy().starts_with(&name))
        .map(|entry| {
            let file = entry.file_name().to_string_lossy().into_owned();
            (file, entry.metadata().unwrap().len())
        })
        .collect();
    files.sort();
    let kept: u64 = files.iter().map(|(_, len)| len).sum();
    eprintln!(
        "log flood: {written} bytes written, {kept} bytes kept in {files:?} \
         (cap {MAX_SIZE} x {MAX_FILES})"
    );
    let capped = current <= MAX_SIZE + MARGIN;
    assert!(capped, "{} is {current} bytes", log_path.display());
    let max_files = if podman { 1 } else { u64::from(MAX_FILES) };
    assert!(files.len() as u64 <= max_files, "{files:?}");
    let all_capped = kept <= max_files * (MAX_SIZE + MARGIN);
    assert!(all_capped, "{kept} bytes kept: {files:?}");
    let flood = written > 2 * u64::from(MAX_FILES) * MAX_SIZE;
    assert!(flood, "the flood exceeds the cap");

    // The termination message's source: the last lines, through the runtime. (On Podman a
    // truncation just before `last-out-1`, one chance in ten thousand, would leave only the
    // three: the flood's last line is checked on Docker, whose rotated file keeps it.)
    let tail = docker.logs_tail(&id, 4).await.unwrap();
    let last = ["last-out-1", "last-err-2", "last-out-3"];
    assert!(tail.ends_with(&last.map(str::to_owned)), "{tail:?}");
    if !podman {
        assert_eq!(tail[0], format!("{} {}", FLOOD_LINES - 1, "0".repeat(90)));
    }
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn sshd_missing_and_no_package_manager_exits_11() {
    require_docker();
    let (docker, run, guard) = setup("nosshd").await;
    let dir = tempfile::tempdir().unwrap();
    let inputs = runner_inputs(&run, guard.labels(), dir.path(), NetworkMode::Bridge);
    let mut spec = build_container_spec(&inputs);
    // Hide the image's stub sshd (busybox has no apt-get, yum or apk) under an empty
    // directory. A bind mount, not a tmpfs: Podman's tmpfs copies the image's content up
    // (its default `tmpcopyup`; Docker's starts empty), which would keep the stub there.
    let empty = tempfile::tempdir().unwrap();
    spec.mounts.push(bind(empty.path(), "/usr/sbin", true));
    let (details, logs) = run_to_exit(&docker, &spec).await;
    assert_eq!(details.exit_code, Some(11), "{logs:?}");
    let said = logs.iter().any(|l| l.contains("no package manager"));
    assert!(said, "{logs:?}");
    assert!(!dir.path().join("stub-runner.args").exists());
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn list_finds_exactly_one_label_set_in_all_states() {
    require_docker();
    let (docker, run, guard) = setup("list").await;
    let mine = guard.labels_with("set", "a");
    let other = guard.labels_with("set", "b");
    let name = |state: &str| format!("{run}-{state}");

    let created = docker
        .create(&shell_spec(&name("created"), &mine, "exit 0"))
        .await
        .unwrap();
    let mut exited_spec = shell_spec(&name("exited"), &mine, "exit 5");
    let host_tmp = std::env::temp_dir();
    exited_spec.mounts.push(bind(&host_tmp, "/hosttmp", true));
    let (exited, _) = run_to_exit(&docker, &exited_spec).await;
    let running = create_and_start(&docker, &shell_spec(&name("running"), &mine, "sleep 60")).await;
    let other_spec = shell_spec(&name("other"), &other, "exit 0");
    docker.create(&other_spec).await.unwrap();

    let wanted: Vec<(String, String)> = mine.clone().into_iter().collect();
    let mut listed = docker.list(&wanted).await.unwrap();
    listed.sort_by(|a, b| a.name.cmp(&b.name));
    let names: Vec<&str> = listed.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["created", "exited", "running"].map(name));
    let by_id: BTreeMap<&str, &ContainerState> =
        listed.iter().map(|c| (c.id.as_str(), &c.state)).collect();
    assert_eq!(by_id[created.as_str()], &ContainerState::Created);
    assert_eq!(by_id[exited.id.as_str()], &ContainerState::Exited);
    assert_eq!(by_id[running.as_str()], &ContainerState::Running);
    let exited_summary = listed.iter().find(|c| c.id == exited.id).unwrap();
    let sources: Vec<&str> = exited_summary.mounts.iter().map(|m| &*m.source).collect();
    assert_eq!(sources, [host_tmp.to_str().unwrap()]);
    let labels = &exited_summary.labels;
    let all = mine.iter().all(|(k, v)| labels.get(k) == Some(v));
    assert!(all, "{labels:?}");
    // The run's label alone finds all four.
    assert_eq!(docker.list(&guard.labels).await.unwrap().len(), 4);
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn exit_event_carries_the_code_and_respects_labels() {
    require_docker();
    let (docker, run, guard) = setup("event").await;
    let mine = guard.labels_with("set", "mine");
    let other = guard.labels_with("set", "other");
    let wanted: Vec<(String, String)> = mine.clone().into_iter().collect();
    let mut events = docker.events(&wanted, None).await.unwrap();

    let other_spec = shell_spec(&format!("{run}-other"), &other, "exit 1");
    let (other_exit, _) = run_to_exit(&docker, &other_spec).await;
    let mine_spec = shell_spec(&format!("{run}-mine"), &mine, "exit 42");
    let id = create_and_start(&docker, &mine_spec).await;
    let event = next_event(&mut events).await;
    let unlabelled = "event of a container without the labels";
    assert_ne!(event.container_id, other_exit.id, "{unlabelled}");
    assert_eq!(event.container_id, id);
    assert_eq!(event.kind, died(42));
    assert_eq!(event.labels.get("set").map(String::as_str), Some("mine"));
    let die_ns = event.time_ns;
    assert!(die_ns > 0);

    // Removing it is a `destroy`; a subscriber since the `die` gets both replayed (Docker's
    // `since` includes its own instant).
    docker.remove(&id).await.unwrap();
    let mut replay = docker.events(&wanted, Some(die_ns)).await.unwrap();
    let mut kinds = Vec::new();
    while kinds.last() != Some(&EventKind::Destroy) {
        let event = next_event(&mut replay).await;
        assert_eq!(event.container_id, id);
        assert!(event.time_ns >= die_ns);
        kinds.push(event.kind);
    }
    assert_eq!(kinds, [died(42), EventKind::Destroy]);
}

/// A container made of an image labelled `exitCode` (and `containerExitCode`) is never told
/// to have exited with the label's number: Docker copies a container's labels among its `die`
/// event's attributes after the code (moby daemon/events.go), so the runtime sets such labels
/// empty in the create and the event carries no code, or the true one. Run on every engine CI
/// has (both Docker image stores, Podman).
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn an_images_exit_code_label_names_no_containers_exit() {
    use bollard::query_parameters::CommitContainerOptionsBuilder;
    require_docker();
    let (docker, run, guard) = setup("exit-label").await;
    let donor = shell_spec(&format!("{run}-donor"), &guard.labels(), "exit 0");
    let (donor, _) = run_to_exit(&docker, &donor).await;
    let (repo, tag) = ("shim-test-exit-label", run.as_str());
    let options = CommitContainerOptionsBuilder::default()
        .container(&donor.id)
        .repo(repo)
        .tag(tag)
        .changes("LABEL exitCode=0 containerExitCode=0")
        .build();
    let commit = docker
        .client()
        .commit_container(options, bollard::models::ContainerConfig::default());
    let image = format!("{repo}:{tag}");
    guard.image(&image);
    commit.await.unwrap();
    let wanted: Vec<(String, String)> = guard.labels().into_iter().collect();
    let mut events = docker.events(&wanted, None).await.unwrap();
    let mut spec = shell_spec(&format!("{run}-labelled"), &guard.labels(), "exit 3");
    spec.image = image.clone();
    let id = create_and_start(&docker, &spec).await;
    let event = next_event_where(&mut events, |e| e.container_id == id).await;
    let unnumbered = EventKind::Die { exit_code: None };
    assert!([unnumbered, died(3)].contains(&event.kind), "{event:?}");
    assert_eq!(wait_exited(&docker, &id).await.exit_code, Some(3));
    docker.remove(&id).await.unwrap();
    docker.remove(&donor.id).await.unwrap();
    docker.delete_image(&image).await.unwrap();
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn limits_privileged_labels_and_devices_in_config() {
    require_docker();
    let (docker, run, guard) = setup("limits").await;
    let labels = guard.labels_with("ai.dstack.shim.task-id", "t-1");
    let mut inputs = runner_inputs(&run, labels.clone(), Path::new("/tmp"), NetworkMode::Host);
    inputs.nano_cpus = shim_runtime::nano_cpus(0.5);
    inputs.memory = 256 << 20;
    inputs.privileged = true;
    inputs.user = "root".to_owned();
    inputs.gpu = GpuConfig::Devices(vec![DeviceMapping {
        path_on_host: "/dev/null".to_owned(),
        path_in_container: "/dev/fake-gpu0".to_owned(),
        cgroup_permissions: "rwm".to_owned(),
    }]);
    inputs.host.infiniband = false;
    let mut spec = build_container_spec(&inputs);
    spec.device_requests.push(DeviceRequest {
        driver: "nvidia".to_owned(),
        device_ids: vec!["GPU-0000".to_owned()],
        capabilities: vec!["gpu".to_owned(), "utility".to_owned()],
    });
    spec.ulimits.push(Ulimit {
        name: "memlock".to_owned(),
        soft: -1,
        hard: -1,
    });
    let podman = is_podman(&docker).await;
    if podman {
        // Podman's compat API ignores NVIDIA device requests (5.x reads only `cdi` ones, 4.3
        // none): the shim refuses them there, before the engine creates anything, rather than
        // run a GPU task without its GPUs.
        assert_matches!(
            docker.create(&spec).await,
            Err(RuntimeError::DeviceRequestsIgnored { driver, .. }) if driver == "nvidia",
            "the NVIDIA request refused on Podman"
        );
        assert_matches!(
            docker.inspect(&spec.name).await,
            Err(RuntimeError::NotFound { .. }),
            "a refused create created {}",
            spec.name
        );
        eprintln!("ENGINE Podman: NVIDIA device requests are refused; the rest without them");
        spec.device_requests.clear();
    }
    // Created, never started: privileged containers cannot run on this VM.
    let id = docker.create(&spec).await.unwrap();
    let d = docker.inspect(&id).await.unwrap();
    assert_eq!(d.state, ContainerState::Created);
    assert_eq!(d.started_at, None);
    assert_eq!(d.nano_cpus, 500_000_000);
    assert_eq!(d.memory, 256 << 20);
    assert!(d.privileged);
    assert_eq!(d.user, "root");
    // The image's own labels come along.
    let all = labels.iter().all(|(k, v)| d.labels.get(k) == Some(v));
    assert!(all, "{:?}", d.labels);
    // The image as given, or the name an engine resolved the short name to (Podman reports
    // that: `localhost/shim-test:1`, or the registry's if the image came from one).
    let (got, given) = (&d.image, image());
    let resolved = *got == given || got.ends_with(&format!("/{given}"));
    assert!(resolved, "{got} is not {given}");
    if podman {
        // Podman reports no devices of a privileged container (it gets all of the host's).
        // This fails once Podman reports them: then check what it does with them.
        eprintln!("ENGINE Podman: a privileged container's devices are not reported");
        assert!(d.devices.is_empty(), "{:?}", d.devices);
        assert!(d.device_requests.is_empty(), "{:?}", d.device_requests);
    } else {
        assert_eq!(d.devices, spec.devices);
        assert_eq!(d.device_requests, spec.device_requests);
    }
    assert!(d.ports.is_empty());
    // An unprivileged container's devices, as every engine reports them (Podman without
    // their cgroup permissions: compared where reported).
    let mut unprivileged = spec.clone();
    unprivileged.name = format!("{run}-unprivileged");
    unprivileged.privileged = false;
    let unprivileged = docker.create(&unprivileged).await.unwrap();
    let reported = docker.inspect(&unprivileged).await.unwrap().devices;
    assert_eq!(reported.len(), spec.devices.len(), "{reported:?}");
    for (got, want) in reported.iter().zip(&spec.devices) {
        let paths = |d: &DeviceMapping| (d.path_on_host.clone(), d.path_in_container.clone());
        assert_eq!(paths(got), paths(want));
        let permissions = &got.cgroup_permissions;
        let as_asked = permissions.is_empty() || *permissions == want.cgroup_permissions;
        assert!(as_asked, "{got:?}");
    }

    // A name in use is a conflict; an unknown container is not found / removed fine.
    assert_matches!(
        docker.create(&spec).await,
        Err(RuntimeError::Conflict { .. })
    );
    let nope = format!("{run}-nope");
    assert!(docker.inspect(&nope).await.unwrap_err().is_not_found());
    docker.remove(&nope).await.unwrap();
    docker.remove(&id).await.unwrap();
    docker.remove(&id).await.unwrap();
    assert!(docker.inspect(&id).await.unwrap_err().is_not_found());
    let stop = docker.stop(&id, Duration::ZERO).await;
    assert!(stop.unwrap_err().is_not_found());
    assert!(docker.logs_tail(&id, 5).await.unwrap_err().is_not_found());
    let mut missing = spec.clone();
    missing.image = "shim-runtime-test-missing:1".to_owned();
    missing.name = format!("{run}-missing");
    assert_matches!(
        docker.create(&missing).await,
        Err(RuntimeError::NotFound { what }) if what.contains("shim-runtime-test-missing")
    );
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn unreachable_daemon_is_reported_as_such() {
    require_docker();
    let dir = tempfile::tempdir().unwrap();
    // No socket at all.
    let missing = dir.path().join("missing.sock");
    // A socket nobody listens on (connection refused).
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    for socket in [missing, stale] {
        let err = DockerRuntime::connect_to(&format!("unix://{}", socket.display()))
            .await
            .unwrap_err();
        assert!(err.is_unavailable(), "{}: {err:?}", socket.display());
    }
}

/// Issue 28 part 3, issue 39: what image collection asks of the engine. The data root is a
/// directory of this host (the file system measured); a pulled image is described by its id
/// (the same answer by name and by id), the names pointing to it (the name it was pulled as,
/// in the engine's spelling: compared normalised) and a size of at least its fresh layer;
/// removing it while a container (even an exited one) uses it is a conflict, never forced;
/// once the container is gone it is removed, it is no longer described, and removing it
/// again is no error. The removal reaches an event subscriber as an image event
/// (`ImageRemoved`, whatever labels were asked for): what tells the engine an image it saw
/// present may be gone.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn an_image_is_described_kept_while_used_and_its_removal_is_an_event() {
    require_docker();
    let (docker, run, guard) = setup("gc").await;
    let root = docker.data_root().await.unwrap();
    let root = root.expect("the engine names its data root");
    assert!(root.is_dir(), "{}", root.display());
    let fresh = FreshImage::push("shim-runtime-gc", 1 << 20).unwrap();
    let image = fresh.direct_reference();
    assert_eq!(docker.inspect_image(&image).await.unwrap(), None);
    let request = PullRequest::new(&image)
        .with_auth(Some(registry_auth()))
        .with_timeout(Some(Duration::from_secs(300)));
    pull(&docker, &request).await.unwrap();
    let details = docker.inspect_image(&image).await.unwrap().unwrap();
    assert!(!details.id.is_empty(), "{details:?}");
    // Pulled by tag from a registry, it is also named by its digest (`RepoDigests`).
    let repo = image
        .rsplit_once(':')
        .map_or(image.as_str(), |(repo, _)| repo);
    let digest_name = format!(
        "{}@sha256:",
        normalize_reference(repo).trim_end_matches(":latest")
    );
    let mut digests = details.digests.iter().map(|d| normalize_reference(d));
    assert!(digests.any(|d| d.starts_with(&digest_name)), "{details:?}");
    let normalized = normalize_reference(&image);
    let tagged = details
        .tags
        .iter()
        .any(|t| normalize_reference(t) == normalized);
    assert!(tagged, "{details:?}");
    assert!(details.size >= 1 << 20, "{details:?} for {image}");
    let by_id = docker.inspect_image(&details.id).await.unwrap();
    assert_eq!(by_id.as_ref(), Some(&details), "by id as by name");

    let mut spec = shell_spec(&run, &guard.labels(), "exit 0");
    spec.image = image.clone();
    let (container, _) = run_to_exit(&docker, &spec).await;
    assert_matches!(
        docker.delete_image(&image).await,
        Err(RuntimeError::Conflict { .. }),
        "removing an image an exited container uses"
    );
    let kept = docker.inspect_image(&image).await.unwrap();
    assert_eq!(kept.as_ref(), Some(&details));
    docker.remove(&container.id).await.unwrap();
    // Subscribed with this run's labels, which no image carries.
    let mut events = docker.events(&guard.labels, Some(now_ns())).await.unwrap();
    docker.delete_image(&image).await.unwrap();
    assert_eq!(docker.inspect_image(&image).await.unwrap(), None);
    assert_eq!(docker.inspect_image(&details.id).await.unwrap(), None);
    docker.delete_image(&image).await.unwrap();
    let removed = next_event_where(&mut events, |event| {
        event.kind == EventKind::ImageRemoved
            && (event.container_id == details.id
                || normalize_reference(&event.name) == normalize_reference(&image))
    })
    .await;
    eprintln!(
        "MEASURED data root {}; {image}: id {}, {} bytes; removal event {removed:?}",
        root.display(),
        details.id,
        details.size
    );
}

#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn pull_from_registry_with_and_without_credentials() {
    require_docker();
    let docker = runtime().await;
    // An image of this test's own (a fresh small layer on the test image's): removing the
    // registry's name of the test image itself is refused by Podman while containers of
    // other tests run from that image (the names share one image there).
    let fresh = FreshImage::push("shim-runtime-pull", 64 << 10).unwrap();
    let small = fresh.reference().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("pull.log");
    let request = |image: &str, auth: Option<RegistryAuth>| {
        PullRequest::new(image)
            .with_auth(auth)
            .with_log_path(Some(log_path.clone()))
            .with_timeout(Some(Duration::from_secs(300)))
            .with_stall_timeout(Some(Duration::from_secs(60)))
    };

    // Wrong password.
    let wrong = RegistryAuth {
        password: "wrong-password".to_owned(),
        ..registry_auth()
    };
    docker.delete_image(&small).await.unwrap(); // if an earlier run left it
    let (message, image) = pull_failure(&docker, &request(&small, Some(wrong))).await;
    // Engines word it differently ("unauthorized: authentication required" on Docker's
    // classic store, "401 Unauthorized" on its containerd store): match without case.
    assert_says_one_of(&message.to_lowercase(), &["unauthorized", "authentication"]);
    assert_eq!(image, small);
    // No credentials.
    let (message, _) = pull_failure(&docker, &request(&small, None)).await;
    assert_says_one_of(&message, &["no basic auth credentials", "unauthorized"]);
    // A missing image.
    let missing = format!("{}/shim-runtime-missing:1", registry());
    let (message, _) = pull_failure(&docker, &request(&missing, Some(registry_auth()))).await;
    assert_says_one_of(&message, &["not found", "manifest unknown"]);
    assert!(!docker.image_present(&small).await.unwrap());

    // Right credentials.
    let done = pull(&docker, &request(&small, Some(registry_auth()))).await;
    assert!(done.unwrap().is_total_bytes_final);
    assert!(docker.image_present(&small).await.unwrap());
    let log = fs_err::read_to_string(&log_path).unwrap();
    assert!(!log.is_empty());
    for line in log.lines() {
        serde_json::from_str::<serde_json::Value>(line).unwrap();
    }
    assert!(!log.contains(&registry_auth().password));
}

/// Bytes of the random layer of this file's fresh images: at about 2 MiB/s through their
/// proxy, a pull lasts several seconds, long enough for every engine to report bytes while
/// it runs (the containerd store polls every 100 ms; Podman reports a downloading layer once a
/// second).
const FRESH_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;

/// Pull progress, a cancel and a timeout, with images of fresh random content pulled through
/// a slow proxy ([`FreshImage`]): the pull downloads on every engine and store, whatever an
/// earlier run left (the containerd store keeps a removed image's content, so a registry image
/// pulled before comes back at once without a byte reported), and lasts long enough to report
/// its bytes as it goes (Podman reports a layer's bytes only once a second: a fast local pull
/// reports none). The proxy listens on a port of 127.0.0.1 of its own: Docker takes any
/// loopback registry for an insecure one, Podman only those its registries.conf names so
/// (`location = "127.0.0.1"` covers every port); else its pull fails with "server gave HTTP
/// response to HTTPS client".
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn pull_progress_cancel_and_timeout_of_a_fresh_image() {
    require_docker();
    let docker = runtime().await;
    let cancelled_image =
        FreshImage::push("shim-runtime-pull-cancel", FRESH_PAYLOAD_BYTES).unwrap();
    let whole_image = FreshImage::push("shim-runtime-pull-whole", FRESH_PAYLOAD_BYTES).unwrap();
    let request = |image: &FreshImage, timeout: Duration| {
        PullRequest::new(image.reference())
            .with_auth(Some(registry_auth()))
            .with_timeout(Some(timeout))
            .with_stall_timeout(Some(Duration::from_secs(60)))
    };

    // Cancel from another task as soon as the fresh layer is moving.
    let cancel = CancellationToken::new();
    let to_cancel = request(&cancelled_image, Duration::from_secs(300));
    let cancel_now = || cancel.cancel();
    let cancelled = pull_interrupted(&docker, &to_cancel, cancel.clone(), cancel_now).await;
    let (result, latency) = (cancelled.result, cancelled.after);
    assert!(cancelled.moved, "the pull never reported bytes: {result:?}");
    eprintln!("MEASURED pull cancellation returned {latency:?} after cancel");
    assert_matches!(result, Err(RuntimeError::Cancelled { .. }));
    let prompt = latency < Duration::from_secs(5);
    assert!(prompt, "cancellation took {latency:?}");
    // The engine abandoned the pull (the whole of it would take about 8 s).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let present = docker.image_present(cancelled_image.reference()).await;
    assert!(!present.unwrap(), "the engine finished the cancelled pull");

    // A timeout.
    let timeout_request = request(&cancelled_image, Duration::from_millis(1));
    let result = pull(&docker, &timeout_request).await;
    assert_matches!(result, Err(RuntimeError::PullTimeout { .. }));

    // A whole pull: progress during, final after. The base layers are the local test image's
    // (already there: counted 0); the fresh layer is downloaded.
    let whole_request = request(&whole_image, Duration::from_secs(300));
    let (done, seen, took) = pull_recorded(&docker, &whole_request).await;
    let done = done.unwrap();
    eprintln!(
        "MEASURED pulled {} ({} layer bytes): {done:?} in {took:?}, {} progress reports",
        whole_image.reference(),
        whole_image.layer_bytes(),
        seen.len()
    );
    assert!(done.is_total_bytes_final);
    assert!(done.total_bytes >= whole_image.layer_bytes(), "{done:?}");
    assert_eq!(done.downloaded_bytes, done.total_bytes, "{done:?}");
    assert_eq!(done.extracted_bytes, done.total_bytes, "{done:?}");
    let seen: Vec<PullProgress> = seen.into_iter().map(|(_, p)| p).collect();
    assert_eq!(seen.last(), Some(&done));
    let during = seen
        .iter()
        .filter(|p| p.downloaded_bytes > 0 && p.downloaded_bytes < done.total_bytes)
        .count();
    assert!(during > 0, "no intermediate progress in {seen:?}");
    let rising = seen
        .windows(2)
        .all(|w| w[0].downloaded_bytes <= w[1].downloaded_bytes);
    assert!(rising, "downloaded bytes went backwards: {seen:?}");
    assert!(docker.image_present(whole_image.reference()).await.unwrap());
}

/// A pull that nothing moves fails as stalled, within its stall timeout of the last message,
/// with what came before counted; a pull kept slow but moving runs well past the stall
/// timeout and succeeds. The registry's answers go through the image's [`SlowProxy`], which
/// stops sending mid-layer (`stall`) as soon as the pull reports bytes, its connection held
/// open, as a dead link or a hung CDN does.
///
/// [`SlowProxy`]: shim_e2e::harness::SlowProxy
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_stalled_pull_fails_and_a_slow_moving_one_does_not() {
    require_docker();
    const STALL: Duration = Duration::from_secs(3);
    let docker = runtime().await;
    let stalled = FreshImage::push("shim-runtime-pull-stall", 8 << 20).unwrap();
    let slow = FreshImage::push("shim-runtime-pull-slow", 12 << 20).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let request = |image: &FreshImage, log: &str| {
        PullRequest::new(image.reference())
            .with_auth(Some(registry_auth()))
            .with_log_path(Some(dir.path().join(log)))
            .with_timeout(Some(Duration::from_secs(120)))
            .with_stall_timeout(Some(STALL))
    };

    // The registry stops sending once the layer's bytes are moving.
    let started = Instant::now();
    let stall = || stalled.proxy().stall();
    let stalled_request = request(&stalled, "stalled.log");
    let halted = pull_interrupted(&docker, &stalled_request, CancellationToken::new(), stall).await;
    let (result, after) = (halted.result, halted.after);
    let log = fs_err::read_to_string(dir.path().join("stalled.log")).unwrap_or_default();
    eprintln!(
        "MEASURED stalled pull failed {after:?} after the registry stopped ({:?} in all): \
         {result:?}; {} messages, the last: {}",
        started.elapsed(),
        log.lines().count(),
        log.lines().last().unwrap_or_default()
    );
    assert!(halted.moved, "the pull never reported bytes: {result:?}");
    let Err(
        e @ RuntimeError::PullStalled {
            stalled_for,
            done_bytes,
            total_bytes,
            ..
        },
    ) = &result
    else {
        panic!("not a stall: {result:?}");
    };
    // At the stall timeout, give or take a loaded machine's late timer (well short of the
    // pull's own 120 s limit).
    let late = Duration::from_secs(5);
    assert!(*stalled_for >= STALL && *stalled_for < STALL + late, "{e}");
    assert!(*done_bytes > 0, "{e}");
    assert!(*total_bytes >= stalled.layer_bytes(), "{e}");
    let message = e.to_string();
    assert!(message.contains("stalled"), "{message}");
    assert!(message.contains(&done_bytes.to_string()), "{message}");
    // The stall timeout after the last message, which the engine may send a moment after
    // the registry stopped (what it had received by then), or a moment before (nothing new
    // after it): measured from the stop, only bounded above.
    assert!(after < STALL + late, "failed {after:?} after the stall");
    stalled.proxy().resume();

    // Slow but moving: well past the stall timeout, and done.
    let (done, seen, took) = pull_recorded(&docker, &request(&slow, "slow.log")).await;
    let gap = seen
        .windows(2)
        .map(|w| w[1].0 - w[0].0)
        .max()
        .unwrap_or_default();
    eprintln!(
        "MEASURED slow pull of {} layer bytes: {done:?} in {took:?}, {} progress reports, \
         longest gap between them {gap:?}",
        slow.layer_bytes(),
        seen.len()
    );
    let done = done.unwrap();
    assert!(done.is_total_bytes_final);
    assert!(took > STALL, "not slow enough to prove anything: {took:?}");
}

/// A registry slow to answer at all (a token server, a mirror that is not there) holds back
/// the engine's answer to a pull, whose head comes with its first message: the pull waits for
/// it as long as its stall timeout allows, not only as long as the runtime waits for any
/// other answer (here 2 s; the registry answers after 5).
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_pull_whose_answer_is_slow_to_begin_waits_for_it() {
    require_docker();
    let docker = runtime().await.with_request_timeout(Duration::from_secs(2));
    let image = FreshImage::push("shim-runtime-pull-late", 1 << 20).unwrap();
    image.proxy().stall();
    let request = PullRequest::new(image.reference())
        .with_auth(Some(registry_auth()))
        .with_stall_timeout(Some(Duration::from_secs(60)));
    let resume = async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        image.proxy().resume();
    };
    let pull = docker.pull(&request, &|_| {}, CancellationToken::new());
    let (result, ()) = tokio::join!(pull, resume);
    result.unwrap();
    assert!(docker.image_present(image.reference()).await.unwrap());
}

#[test]
fn runner_script_is_valid_sh() {
    let script = runner_script(&RunnerParams {
        authorized_keys: vec!["ssh-ed25519 AAAA it's".to_owned()],
        ssh_log_level: Some("INFO".to_owned()),
        http_address_localhost: true,
        ..RunnerParams::default()
    });
    let out = std::process::Command::new("sh")
        .args(["-n", "-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
}

// ---------------------------------------------------------------------------------------------
// A lost answer
// ---------------------------------------------------------------------------------------------

/// A [`LosingProxy`] to the daemon, losing the first answer to a request matching `lose`, and
/// a runtime through it.
async fn losing_proxy(lose: &str) -> (LosingProxy, DockerRuntime) {
    let proxy = LosingProxy::start(&docker_socket(), &[lose]).unwrap();
    let lossy = DockerRuntime::connect_to(&proxy.host()).await.unwrap();
    (proxy, lossy)
}

/// A daemon that does not answer fails the event subscription itself, as the trait says, not
/// the stream's first item: bollard's stream connects only when read, so `events` asks the
/// daemon first (a subscriber that counted such a stream as connected would resubscribe and
/// relist at its shortest delay while Docker is down). The proxy loses the answer to that
/// first question; the next subscription works and carries the container's `die`.
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn an_event_subscription_fails_when_the_daemon_does_not_answer() {
    require_docker();
    let (direct, run, guard) = setup("events-unanswered").await;
    let (proxy, lossy) = losing_proxy("/_ping").await;
    let err = match lossy.events(&guard.labels, None).await {
        Ok(_) => panic!("subscribed though the daemon's answer was lost"),
        Err(e) => e,
    };
    assert!(err.is_unavailable(), "{err:?}");
    assert_eq!(proxy.lost().len(), 1, "{:?}", proxy.lost());
    let mut events = lossy.events(&guard.labels, None).await.unwrap();
    let spec = shell_spec(&format!("{run}-e"), &guard.labels(), "exit 3");
    let id = create_and_start(&direct, &spec).await;
    let event = next_event(&mut events).await;
    assert_eq!(event.container_id, id);
    assert_eq!(event.kind, died(3));
}

/// A create or start whose answer is lost (the daemon did the work; the connection closed
/// before the answer reached the shim) is `DaemonUnavailable`, the error on which the engine
/// looks at the container instead of failing the task (that part is the scenario
/// `faults::lost_engine_answers_neither_fail_the_task_nor_leak_it`, in every world).
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_lost_answer_is_daemon_unavailable_though_the_work_was_done() {
    require_docker();
    let (direct, run, guard) = setup("lost-answer").await;
    let (proxy, lossy) = losing_proxy("/start ").await;
    let spec = shell_spec(&format!("{run}-s"), &guard.labels(), "sleep 60");
    let id = direct.create(&spec).await.unwrap();
    let err = lossy.start(&id).await.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert_eq!(proxy.lost().len(), 1, "{:?}", proxy.lost());
    // The work was done, and the proxy passes everything else: the same client goes on working.
    for (docker, asked) in [(&direct, "directly"), (&lossy, "through the proxy")] {
        let state = docker.inspect(&id).await.unwrap().state;
        assert_eq!(state, ContainerState::Running, "asked {asked}");
    }

    let (proxy, lossy) = losing_proxy("/containers/create").await;
    let name = format!("{run}-c");
    let err = lossy
        .create(&shell_spec(&name, &guard.labels(), "sleep 60"))
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert_eq!(proxy.lost().len(), 1);
    let made = direct.inspect(&name).await.unwrap();
    assert_eq!(made.state, ContainerState::Created);
}

/// A start whose answer is held (the daemon did the work; the connection stays open and
/// silent) leaves the request waiting while the engine already shows the container running,
/// through the same client: what the engine's look at a late start relies on, on every engine
/// (the engine's side is the scenario `faults::a_start_whose_answer_never_comes_runs_in_seconds`).
#[tokio::test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
async fn a_start_whose_answer_is_held_shows_the_container_running() {
    require_docker();
    let (direct, run, guard) = setup("held-answer").await;
    let proxy = LosingProxy::holding(&docker_socket(), &["/start "]).unwrap();
    let held = DockerRuntime::connect_to(&proxy.host()).await.unwrap();
    let spec = shell_spec(&format!("{run}-s"), &guard.labels(), "sleep 60");
    let id = direct.create(&spec).await.unwrap();
    let start = held.start(&id);
    tokio::pin!(start);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        tokio::select! {
            answer = &mut start => panic!("the held start answered: {answer:?}"),
            details = held.inspect(&id) => {
                if details.unwrap().state == ContainerState::Running {
                    break;
                }
            }
        }
        assert!(Instant::now() < deadline, "not running after 20 s");
    }
    // The start went through the proxy (the container runs) and has not answered. (The
    // proxy's record of the held answer may lag: it is made once the daemon's answer is read.)
}
