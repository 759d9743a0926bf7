//! One scenario, every world (issue 38): a behaviour written once as an async function generic
//! over [`World`], run in each world named in the test's name (`<scenario>::fake`, `::docker`,
//! `::binary`): `fake`, the engine library on the fake runtime and fake host resources on
//! tokio's paused time; `docker`, the engine library on the real Docker daemon with the real
//! `authorized_keys` and volume code and the stub runner; `binary`, the built `dstack-shim`
//! over HTTP, as the dstack server drives it.
//!
//! Every world has [`GPUS`] fake GPUs and a home of its own; tasks are the server's JSON
//! ([`World::task`]), answers the API's `TaskInfo` JSON. The worlds that need Docker are
//! ignored unless run with `--run-ignored all`, and then fail, never skip, without
//! `SHIM_TEST_DOCKER=1`.

#![allow(
    dead_code,
    unused_imports,
    async_fn_in_trait,
    reason = "each test file uses the part of the worlds its scenarios need; the trait is only used generically"
)]

pub mod binary;
pub mod engine;
pub mod flaky;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

pub use binary::BinaryWorld;
pub use engine::{DockerWorld, FakeWorld};

/// The fake GPUs of every world.
pub const GPUS: usize = shim_e2e::harness::FAKE_GPUS;

/// An image whose pull lasts long enough to be caught in the middle ([`World::slow_image`]),
/// with the credentials its registry wants; kept while this lives.
pub struct SlowImage {
    /// What a task names as its image.
    pub reference: String,
    /// The registry's user (empty: none).
    pub username: String,
    /// The registry's password (empty: none).
    pub password: String,
    /// The real one (removed from the registry and the daemon when dropped).
    _fresh: Option<shim_e2e::harness::FreshImage>,
}

impl SlowImage {
    /// `task` pulling this image, with the credentials.
    pub fn for_task(&self, task: &mut Value) {
        task["image_name"] = self.reference.clone().into();
        task["registry_username"] = self.username.clone().into();
        task["registry_password"] = self.password.clone().into();
    }
}

/// [`World::slow_image`] and [`World::stalled_image`]: `bytes` of fresh content whose pull
/// stops after `stall_after` bytes (`None`: goes on, slowly); in the fake world, a pull that
/// reports some progress and hangs.
async fn fresh_image(
    fake: Option<&shim_runtime::fake::FakeRuntime>,
    repo: &str,
    bytes: usize,
    stall_after: Option<u64>,
) -> SlowImage {
    if let Some(fake) = fake {
        let total = bytes as u64;
        fake.set_pull_behavior(shim_runtime::fake::PullBehavior::Hang {
            steps: vec![shim_task::PullProgress {
                downloaded_bytes: stall_after.map_or(total * 5 / 8, |_| 3 << 20),
                extracted_bytes: 0,
                total_bytes: total,
                is_total_bytes_final: true,
            }],
        });
        return SlowImage {
            reference: format!("{repo}:latest"),
            username: String::new(),
            password: String::new(),
            _fresh: None,
        };
    }
    let repo = repo.to_owned();
    let fresh = tokio::task::spawn_blocking(move || {
        shim_e2e::harness::FreshImage::push(&repo, bytes).unwrap()
    })
    .await
    .unwrap();
    if let Some(after) = stall_after {
        // The manifests and configs pass; the layer's first part too (whole MiB blocks: what
        // the containerd store reports), then nothing.
        fresh.proxy().stall_after(after);
    }
    SlowImage {
        reference: fresh.reference().to_owned(),
        username: shim_e2e::registry_user(),
        password: shim_e2e::registry_password(),
        _fresh: Some(fresh),
    }
}

/// An image made of a container ([`World::commit`]).
pub struct Committed {
    /// What a task names as its image.
    pub reference: String,
    on_docker: bool,
}

impl Drop for Committed {
    fn drop(&mut self) {
        if self.on_docker {
            shim_e2e::docker(&["rmi", "-f", &self.reference]);
        }
    }
}

/// A shim's change feed ([`World::changes`]).
pub struct Changes {
    changes: tokio::sync::mpsc::UnboundedReceiver<Value>,
    /// The engine world's forwarding job, stopped with the feed.
    forward: Option<tokio::task::JoinHandle<()>>,
}

impl Changes {
    /// The feed of what `changes` receives; `forward` is stopped when the feed is dropped.
    pub fn new(
        changes: tokio::sync::mpsc::UnboundedReceiver<Value>,
        forward: Option<tokio::task::JoinHandle<()>>,
    ) -> Self {
        Self { changes, forward }
    }

    /// The changes of task `id` up to and with the first of kind `last`; fails the test if
    /// the feed ends or stays silent for two minutes first.
    pub async fn of_task_until(&mut self, id: &str, last: &str) -> Vec<Value> {
        let mut seen = Vec::new();
        loop {
            let next = tokio::time::timeout(Duration::from_secs(120), self.changes.recv()).await;
            match next {
                Ok(Some(change)) if change["task"] == id => {
                    let done = change["change"] == last;
                    seen.push(change);
                    if done {
                        return seen;
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => panic!("the change feed ended before {last}: {seen:?}"),
                Err(_) => panic!("no {last} change of {id} in two minutes: {seen:?}"),
            }
        }
    }
}

impl Drop for Changes {
    fn drop(&mut self) {
        if let Some(forward) = &self.forward {
            forward.abort();
        }
    }
}

/// How a world is made.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The runner binary the shim mounts (default: the stub runner).
    pub runner: Option<PathBuf>,
    /// The engine reached through a proxy that [`World::set_engine_reachable`] can cut.
    pub flaky_engine: bool,
    /// Full relists this often (seconds), so that the binary world can [`World::relist`] (by
    /// waiting for the next one); default: the shim's own (an hour in the engine worlds).
    pub relist_every_s: Option<u64>,
    /// GPUs whose health the scenario sets ([`World::set_gpu_healthy`]), probed every second:
    /// in the engine worlds a health source set by hand, in the binary world a fake GPU host
    /// (`tests/gpu-host`: device nodes, CDI spec, `nvidia-smi`; needs root).
    pub gpu_health: bool,
    /// The pull stall timeout (seconds; default: the shim's own).
    pub pull_stall_timeout_s: Option<u64>,
    /// A home whose disk the scenario can fill ([`World::set_disk_full`]): a task store whose
    /// writes fail with `ENOSPC`, or (binary) a home on a 16 MiB loop-mounted ext4 (root).
    pub fillable_home: bool,
    /// The engine's answers to the first container create, start and removal are lost (the
    /// requests are carried out; [`World::answers_lost`]): by the fake, or by a proxy on the
    /// Docker socket that closes the connection instead of answering.
    pub losing_engine: bool,
    /// The engine's answer to the first container start never comes (the start is carried
    /// out): by the fake, or by a proxy on the Docker socket that holds the answer until the
    /// shim gives up ([`World::answers_lost`] counts it).
    pub late_engine: bool,
    /// A host user whose real `authorized_keys` tasks' host keys go to ([`World::host_user`]):
    /// `tester` in the Docker world, a system user made for the test in the binary world
    /// (root); none in the fake world, whose keys are fakes new at each restart.
    pub host_user: bool,
}

impl Options {
    /// The defaults, changed by `set` (`Options::with(|o| o.host_user = true)`).
    pub fn with(set: impl FnOnce(&mut Self)) -> Self {
        let mut options = Self::default();
        set(&mut options);
        options
    }
}

/// A host user with a real `authorized_keys` ([`Options::host_user`]).
pub struct HostKeys {
    /// The user's name (a task's `host_ssh_user`).
    pub user: String,
    /// Its `authorized_keys`.
    pub file: PathBuf,
}

impl HostKeys {
    /// The file's lines (none while there is no file).
    pub fn lines(&self) -> Vec<String> {
        match fs_err::read_to_string(&self.file) {
            Ok(text) => text.lines().map(str::to_owned).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("{e}"),
        }
    }

    /// The key blobs of the lines the shim marked as its own.
    pub fn marked(&self) -> std::collections::BTreeSet<String> {
        self.lines()
            .iter()
            .filter(|l| l.trim_end().ends_with(shim_e2e::harness::KEY_MARKER))
            .filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned))
            .collect()
    }
}

/// A host with a shim on it, as a scenario sees it.
pub trait World: Sized {
    /// A new host and a shim on a home of its own.
    async fn new(options: Options) -> Self;

    /// Another shim on a home of its own, on the same engine.
    async fn neighbour(&self) -> Self;

    /// A task as the dstack server sends it: `gpu` GPUs, bridge network, the test image, a
    /// name unique to this run.
    fn task(&self, id: &str, gpu: i64) -> Value {
        let name = format!("w-{id}-{}", shim_e2e::harness::run_tag());
        shim_e2e::harness::bridge_task(id, &name, gpu)
    }

    /// Submits [`World::task`] `id` with `gpu` GPUs and waits until it has `status`
    /// ([`World::wait_status`]); answers its `TaskInfo`.
    async fn submitted(&self, id: &str, gpu: i64, status: &str) -> Value {
        self.submit(&self.task(id, gpu)).await.unwrap();
        self.wait_status(id, status).await
    }

    /// Submits [`World::task`] for each `(id, gpu)`, then waits until each runs; answers their
    /// `TaskInfo`s in that order.
    async fn all_running<const N: usize>(&self, tasks: [(&str, i64); N]) -> [Value; N] {
        for (id, gpu) in tasks {
            self.submit(&self.task(id, gpu)).await.unwrap();
        }
        let mut infos = Vec::new();
        for (id, _) in tasks {
            infos.push(self.wait_status(id, "running").await);
        }
        infos.try_into().unwrap()
    }

    /// Terminates the task as the server does when it is done with it (at once, no message)
    /// and removes it.
    async fn finish(&self, id: &str) {
        self.terminate(id, "terminated_by_server", "", 0).await;
        self.remove(id).await;
    }

    /// The ids of the host's GPUs, in index order (the ids `gpus_ids` answers).
    fn gpu_ids(&self) -> Vec<String>;

    /// Makes GPU `index` healthy, or unhealthy for retired pages pending (needs
    /// [`Options::gpu_health`]); the shim sees it at its next probe.
    async fn set_gpu_healthy(&self, index: usize, healthy: bool);

    /// Submits; the error is the HTTP status and the shim's message (the engine worlds: the
    /// status the engine's error kind stands for).
    async fn submit(&self, task: &Value) -> Result<(), String>;

    /// The task's `TaskInfo`, `None` when the shim does not know it.
    async fn info(&self, id: &str) -> Option<Value>;

    /// Every task the shim lists, with its status.
    async fn list(&self) -> BTreeMap<String, String>;

    /// Terminates as the dstack server does; answers the `TaskInfo`.
    async fn terminate(&self, id: &str, reason: &str, message: &str, timeout_s: u64) -> Value {
        let answer = self.try_terminate(id, reason, message, timeout_s).await;
        answer.unwrap_or_else(|e| panic!("terminate {id}: {e}"))
    }

    /// Terminates once; the error is the HTTP status and the shim's message, as
    /// [`World::submit`]'s.
    async fn try_terminate(
        &self,
        id: &str,
        reason: &str,
        message: &str,
        timeout_s: u64,
    ) -> Result<Value, String>;

    /// Removes a task once; the error is the HTTP status and the shim's message, as
    /// [`World::submit`]'s.
    async fn try_remove(&self, id: &str) -> Result<(), String>;

    /// Removes a terminated task, retrying while its start or release is under way.
    async fn remove(&self, id: &str) {
        let what = format!("task {id} could not be removed");
        self.poll(&what, async || self.try_remove(id).await).await;
    }

    /// The shim stops: a kill where the world has a process (its containers go on).
    async fn stop(&mut self);

    /// The shim starts again on its home (after [`World::stop`]).
    async fn start(&mut self);

    /// [`World::stop`], then [`World::start`] with the home spelled `spelled` (another path to
    /// the same directory), from now on.
    async fn restart_spelling_home_as(&mut self, spelled: &Path);

    /// [`World::stop`], then [`World::start`].
    async fn restart(&mut self) {
        self.stop().await;
        self.start().await;
    }

    /// The shim's owner identity (`<home>/owner-id`).
    fn owner(&self) -> String;

    /// The shim's home.
    fn home(&self) -> PathBuf;

    /// Makes the task's runner exit with `code`.
    async fn exit_runner(&self, info: &Value, code: i32);

    /// Whether the container runs (`None`: no such container).
    async fn container_running(&self, container_id: &str) -> Option<bool>;

    /// The containers of this world's engine that belong to tasks of this shim's home.
    async fn containers(&self) -> usize;

    /// What tells one start of the container from another (Docker's `StartedAt`; the fake's
    /// count of starts): unchanged when it was not restarted.
    async fn container_started(&self, container_id: &str) -> String;

    /// The container's exit code (`None`: no such container, or it runs).
    async fn container_exit_code(&self, container_id: &str) -> Option<i64>;

    /// The shim's metrics (`GET /metrics`, or the engine's registry encoded as the binary
    /// serves it), parsed by the strict OpenMetrics parser.
    async fn metrics(&self) -> shim_e2e::harness::Metrics;

    /// The shim under test of the binary world, for what only it shows (its other endpoints,
    /// its process); `None` elsewhere.
    fn binary(&self) -> Option<&shim_e2e::harness::TestShim> {
        None
    }

    /// The fake engine of the fake world, for what only it can show (its call log, a
    /// container's spec); `None` elsewhere.
    fn fake(&self) -> Option<&shim_runtime::fake::FakeRuntime> {
        None
    }

    /// An image made of the container `container_id` with its labels and `added`, as `docker
    /// commit --change 'LABEL k=v'` makes it (removed from the daemon when dropped); a task
    /// names it by its reference.
    async fn commit(&self, container_id: &str, added: &[(&str, &str)]) -> Committed {
        let reference = format!("shim-test-commit:{}", shim_e2e::harness::run_tag());
        if let Some(fake) = self.fake() {
            fake.commit(container_id, &reference, added);
            return Committed {
                reference,
                on_docker: false,
            };
        }
        let mut args = vec!["commit".to_owned()];
        for (key, value) in added {
            args.extend(["--change".to_owned(), format!("LABEL {key}={value}")]);
        }
        args.extend([container_id.to_owned(), reference.clone()]);
        shim_e2e::docker_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
        Committed {
            reference,
            on_docker: true,
        }
    }

    /// The task's state file (`<home>/runners/<container name>/task.json`) as JSON; `None`
    /// while there is none.
    fn state_file(&self, info: &Value) -> Option<Value> {
        let name = info["container_name"].as_str().unwrap();
        let path = self.home().join("runners").join(name).join("task.json");
        let bytes = fs_err::read(path).ok()?;
        Some(serde_json::from_slice(&bytes).unwrap())
    }

    /// Waits until the task's state file satisfies `ok` (what a record says is written a
    /// moment after the API shows it).
    async fn wait_state_file(&self, info: &Value, what: &str, ok: impl Fn(&Value) -> bool) {
        let what = format!("the state file never {what}");
        self.poll(&what, async || match self.state_file(info) {
            Some(file) if ok(&file) => Ok(()),
            other => Err(format!("{other:?}")),
        })
        .await;
    }

    /// Runs a container as the upstream Go shim creates one for `task` (its two labels only,
    /// `/tmp/runner` bound from `runner_dir`, the stub runner's command): running, or, with
    /// `exit_code`, exited by its runner with that code. Made while the shim is stopped.
    /// upstream: runner/internal/shim/docker.go (createContainer).
    async fn run_upstream_container(
        &self,
        task: &Value,
        runner_dir: &Path,
        exit_code: Option<i32>,
    ) -> String;

    /// Plants what the upstream shim leaves for `task` in this home: its directory, and in
    /// it, unless `state_file` is `None`, `runner/` and a `task.json` recording `reason`
    /// (`Some("")`: not terminated); then its container ([`World::run_upstream_container`]).
    /// Answers the directory and the container's id.
    async fn plant_upstream_task(
        &self,
        task: &Value,
        state_file: Option<&str>,
        exit_code: Option<i32>,
    ) -> (PathBuf, String) {
        let name = shim_e2e::harness::container_name_of(task);
        let dir = self.home().join("runners").join(name);
        let runner_dir = match state_file {
            Some(reason) => {
                fs_err::create_dir_all(dir.join("runner")).unwrap();
                fs_err::write(dir.join("task.json"), upstream_state_file(task, reason)).unwrap();
                dir.join("runner")
            }
            None => {
                fs_err::create_dir_all(&dir).unwrap();
                dir.clone()
            }
        };
        let cid = self
            .run_upstream_container(task, &runner_dir, exit_code)
            .await;
        (dir, cid)
    }

    /// An image that pulls slowly: on a real daemon, fresh random content (16 MiB) in `repo` of
    /// the test registry behind a slow proxy; in the fake world, a pull that reports some
    /// progress and then hangs until cancelled (every later pull of the fake world too).
    async fn slow_image(&self, repo: &str) -> SlowImage {
        fresh_image(self.fake(), repo, 16 << 20, None).await
    }

    /// An image whose pull stops moving halfway: on a real daemon, fresh random content
    /// (8 MiB) in `repo` of the test registry behind a proxy that stops sending after 4 MiB;
    /// in the fake world, a pull that reports 3 MiB of 8 and then nothing (every later pull
    /// of the fake world too).
    async fn stalled_image(&self, repo: &str) -> SlowImage {
        fresh_image(self.fake(), repo, 8 << 20, Some(4 << 20)).await
    }

    /// The shim's changes from now on, each as `GET /api/events` streams it (`TaskChange`
    /// JSON: `seq`, `task`, `change`, ...).
    async fn changes(&self) -> Changes;

    /// Replaces the task's container with one created from the same image, labels and mounts
    /// but never started: what the engine shows when the shim died between create and start.
    /// Made while the shim is stopped.
    async fn replace_with_created(&self, info: &Value) {
        let cid = cid(info);
        match self.fake() {
            Some(fake) => {
                let spec = fake.spec(cid).unwrap();
                assert!(fake.vanish(cid));
                fake.add_container(&spec, shim_runtime::ContainerState::Created, None);
            }
            None => {
                let inspect = |format: &str| {
                    shim_e2e::docker_ok(&["inspect", "-f", format, cid])
                        .split_whitespace()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                };
                let labels = inspect("{{range $k, $v := .Config.Labels}}{{$k}}={{$v}} {{end}}");
                // Its runner mount too: what makes a container this shim's.
                let mounts = inspect(
                    "{{range .Mounts}}type=bind,source={{.Source}},target={{.Destination}} {{end}}",
                );
                shim_e2e::docker_ok(&["rm", "-f", cid]);
                let name = info["container_name"].as_str().unwrap();
                let mut args = vec!["create", "--name", name];
                for label in labels.iter().filter(|l| l.starts_with("ai.dstack.shim.")) {
                    args.extend(["--label", label]);
                }
                for mount in &mounts {
                    args.extend(["--mount", mount]);
                }
                let image = shim_e2e::image();
                args.extend([image.as_str(), "true"]);
                shim_e2e::docker_ok(&args);
            }
        }
    }

    /// The host user of [`Options::host_user`] (`None` in the fake world).
    fn host_user(&self) -> Option<HostKeys> {
        None
    }

    /// Adds `line` to the host user's `authorized_keys` as the user would (unmarked).
    fn add_own_key_line(&self, line: &str) {
        let keys = self.host_user().expect("a host user");
        shim_e2e::harness::append_key_line(&keys.file, line);
    }

    /// How many of the engine's answers were lost so far ([`Options::losing_engine`]).
    fn answers_lost(&self) -> usize;

    /// Removes a container behind the shim's back (`docker rm -f`; the fake forgets it).
    async fn remove_container(&self, container_id: &str) {
        match self.fake() {
            Some(fake) => assert!(fake.vanish(container_id), "no container {container_id}"),
            None => {
                shim_e2e::docker_ok(&["rm", "-f", container_id]);
            }
        }
    }

    /// Fills the home's disk (a write fails with `ENOSPC`) or frees it again (needs
    /// [`Options::fillable_home`]). Filling again after something was freed fills what it
    /// gave back.
    async fn set_disk_full(&self, full: bool);

    /// Makes the home's writes wait at their write step until released (a slow disk; needs
    /// [`Options::fillable_home`]; the engine worlds only): returns once `waiting` writes wait.
    async fn hold_writes(&self, held: bool, waiting: usize) {
        let _ = (held, waiting);
        unimplemented!("only the engine worlds hold their writes");
    }

    /// Makes the next read of a state file at a start fail with an I/O error, as a bad sector
    /// would (needs [`Options::fillable_home`]; the engine worlds only).
    async fn fail_next_state_read(&self) {
        unimplemented!("only the engine worlds fail their reads");
    }

    /// Cuts or restores the shim's way to the engine (needs [`Options::flaky_engine`]); a cut
    /// returns once the shim saw its event stream break.
    async fn set_engine_reachable(&self, reachable: bool);

    /// Asks the shim to list the engine now, where the world can: `Some(whether it could)`.
    async fn relist(&self) -> Option<bool>;

    /// Waits until the shim's metrics say its event stream is (or is not) connected.
    async fn wait_events_connected(&self, connected: bool) {
        let want = if connected { 1.0 } else { 0.0 };
        let what = format!("the event stream never became connected={connected}");
        self.wait_until(&what, async || {
            let metrics = self.metrics().await;
            metrics.get("dstack_shim_events_connected", &[]) == want
        })
        .await;
    }

    /// Lets time pass (virtual time in the fake world).
    async fn sleep(&self, how_long: Duration) {
        tokio::time::sleep(how_long).await;
    }

    /// Waits until the task has `status` (and its start returned); fails the test if it
    /// ends otherwise or never gets there.
    async fn wait_status(&self, id: &str, status: &str) -> Value {
        let what = format!("task {id} never became {status}");
        self.poll(&what, async || match self.info(id).await {
            Some(info) if info["status"] == status && self.settled(id).await => Ok(info),
            Some(info) if info["status"] == "terminated" && status != "terminated" => {
                panic!("task {id} ended while waiting for {status}: {info}")
            }
            other => Err(format!("{other:?}")),
        })
        .await
    }

    /// Whether the task's start job has returned (worlds that cannot tell: true).
    async fn settled(&self, _id: &str) -> bool {
        true
    }

    /// Waits until every task is released: a task asking for all [`GPUS`] GPUs gets them
    /// (and is then terminated and removed).
    async fn wait_all_gpus_free(&self) {
        let id = format!("gpu-probe-{}", shim_e2e::harness::run_tag());
        for attempt in 0..200 {
            let probe = format!("{id}-{attempt}");
            self.submit(&self.task(&probe, GPUS as i64)).await.unwrap();
            let info = self.wait_started_or_ended(&probe).await;
            let got = info["status"] != "terminated";
            self.terminate(&probe, "terminated_by_server", "", 0).await;
            self.remove(&probe).await;
            if got {
                return;
            }
            self.sleep(Duration::from_millis(50)).await;
        }
        panic!("the GPUs never came free");
    }

    /// Waits until the task runs or ends; answers its `TaskInfo`.
    async fn wait_started_or_ended(&self, id: &str) -> Value {
        let what = format!("task {id} neither ran nor ended");
        let ran_or_ended =
            |info: &Value| info["status"] == "running" || info["status"] == "terminated";
        self.poll(&what, async || match self.info(id).await {
            Some(info) if ran_or_ended(&info) && self.settled(id).await => Ok(info),
            other => Err(format!("{other:?}")),
        })
        .await
    }

    /// Waits until the container no longer runs.
    async fn wait_stopped(&self, container_id: &str) {
        let what = format!("container {container_id} never stopped");
        self.wait_until(&what, async || {
            self.container_running(container_id).await == Some(false)
        })
        .await;
    }

    /// Polls `probe` every 30 ms (virtual time in the fake world) until it answers `Ok`, and
    /// answers that; fails the test with `what` and the last `Err` after 3000 tries.
    async fn poll<T>(&self, what: &str, mut probe: impl AsyncFnMut() -> Result<T, String>) -> T {
        let mut last = String::new();
        for _ in 0..3000 {
            match probe().await {
                Ok(value) => return value,
                Err(e) => last = e,
            }
            self.sleep(Duration::from_millis(30)).await;
        }
        panic!("{what}: {last}");
    }

    /// Polls until `done` holds ([`World::poll`]).
    async fn wait_until(&self, what: &str, done: impl AsyncFn() -> bool) {
        let not_yet = || Err("not yet".to_owned());
        self.poll(what, async || if done().await { Ok(()) } else { not_yet() })
            .await;
    }
}

/// The object of `value`'s fields `names` (a missing one is `null`): what [`assert_has!`]
/// compares.
pub fn pick<'a>(value: &Value, names: impl IntoIterator<Item = &'a str>) -> Value {
    let fields = names.into_iter().map(|k| (k.to_owned(), value[k].clone()));
    fields.collect()
}

/// The JSON file at `path`.
pub fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs_err::read(path).unwrap()).unwrap()
}

/// A task's container id.
pub fn cid(info: &Value) -> &str {
    info["container_id"].as_str().unwrap()
}

/// A task's termination message.
pub fn message(info: &Value) -> &str {
    info["termination_message"].as_str().unwrap()
}

/// The ids of a task's GPUs (each once).
pub fn gpu_ids(info: &Value) -> BTreeSet<String> {
    let ids = info["gpus_ids"].as_array();
    let ids = ids.unwrap_or_else(|| panic!("no gpus_ids: {info}"));
    let set: BTreeSet<String> = ids.iter().map(|g| g.as_str().unwrap().to_owned()).collect();
    assert_eq!(set.len(), ids.len(), "duplicate GPU ids: {info}");
    set
}

/// `assert_has!(value, {"field": expected, ..})`: fails unless the JSON `value` has each
/// field named with that value (its other fields are not compared), all compared at once;
/// a third argument, `format!`'s, says which case it is.
#[macro_export]
macro_rules! assert_has {
    ($value:expr, {$($fields:tt)*}) => {
        $crate::assert_has!($value, {$($fields)*}, "")
    };
    ($value:expr, {$($fields:tt)*}, $($what:tt)+) => {{
        let value: &serde_json::Value = &$value;
        let expected = serde_json::json!({$($fields)*});
        let what = format!($($what)+);
        let names = expected.as_object().unwrap().keys().map(String::as_str);
        assert_eq!($crate::world::pick(value, names), expected, "{what} {value}");
    }};
}

/// A state file as the upstream shim writes it for `task` (Go's `json.Marshal` of its task
/// state: `version`, `id`, `config` with `TaskConfig`'s fields in declaration order,
/// `termination_reason`, `termination_message`, `cleaned_up`; slices the server did not send
/// are `null`; registry credentials blank; `reason` as recorded, `""` until terminated). It
/// follows dstack PR #4220's format version 1 as the issue describes it (the PR's source is
/// not in the mirror).
pub fn upstream_state_file(task: &Value, reason: &str) -> String {
    let s = |f: &str| Value::String(task[f].as_str().unwrap().to_owned()).to_string();
    let keys = |f: &str| task[f].to_string();
    format!(
        concat!(
            r#"{{"version":1,"id":{id},"config":{{"id":{id},"name":{name},"#,
            r#""registry_username":"","registry_password":"","image_name":{image},"#,
            r#""container_user":{user},"privileged":false,"gpu":{gpu},"cpu":0,"memory":0,"#,
            r#""shm_size":0,"network_mode":{net},"volumes":[],"volume_mounts":[],"#,
            r#""instance_mounts":[],"gpu_devices":null,"host_ssh_user":{host_user},"#,
            r#""host_ssh_keys":{host_keys},"container_ssh_keys":{keys}}},"#,
            r#""termination_reason":{reason},"termination_message":"","cleaned_up":false}}"#
        ),
        id = s("id"),
        name = s("name"),
        image = s("image_name"),
        user = s("container_user"),
        gpu = task["gpu"],
        net = s("network_mode"),
        host_user = s("host_ssh_user"),
        host_keys = keys("host_ssh_keys"),
        keys = keys("container_ssh_keys"),
        reason = Value::String(reason.to_owned()),
    )
}

/// Runs a container on the real daemon as another shim made it (not this one): named
/// `name`, with `labels`, `/tmp/runner` bound from `runner_dir`, the stub runner bound at
/// `/usr/local/bin/dstack-runner` (read-only if `runner_ro`), `/bin/sh -c` with the runner's
/// start command, both runner ports published on 127.0.0.1. Answers its id.
pub fn run_foreign_container(
    name: &str,
    labels: &[String],
    runner_dir: &Path,
    runner_ro: bool,
) -> String {
    use shim_e2e::harness::{RUNNER_HTTP_PORT, RUNNER_SSH_PORT};
    let runner_mount = format!("{}:/tmp/runner", runner_dir.display());
    let ro = if runner_ro { ":ro" } else { "" };
    let runner_bin = format!(
        "{}:/usr/local/bin/dstack-runner{ro}",
        shim_e2e::runner_path().display()
    );
    let http = format!("127.0.0.1::{RUNNER_HTTP_PORT}");
    let ssh = format!("127.0.0.1::{RUNNER_SSH_PORT}");
    let command = format!(
        "/usr/local/bin/dstack-runner --log-level 6 start --temp-dir /tmp/runner \
         --http-port {RUNNER_HTTP_PORT} --ssh-port {RUNNER_SSH_PORT}"
    );
    let mut args = vec!["run", "-d", "--name", name];
    for label in labels {
        args.extend(["--label", label.as_str()]);
    }
    let image = shim_e2e::image();
    args.extend([
        "-v",
        &runner_mount,
        "-v",
        &runner_bin,
        "-p",
        &http,
        "-p",
        &ssh,
    ]);
    args.extend(["--entrypoint", "/bin/sh", &image, "-c", &command]);
    shim_e2e::docker_ok(&args).trim().to_owned()
}

/// Runs a container on the real daemon as the upstream shim does for `task` (its two labels
/// only; see [`run_foreign_container`]); with `exit_code`, waits until its runner started,
/// makes it exit with that code and waits until the container stopped. Answers its id.
/// upstream: runner/internal/shim/docker.go (createContainer).
pub fn run_upstream_container_on_docker(
    task: &Value,
    runner_dir: &Path,
    exit_code: Option<i32>,
) -> String {
    let labels = [
        "ai.dstack.shim.is-task=true".to_owned(),
        format!("ai.dstack.shim.task-id={}", task["id"].as_str().unwrap()),
    ];
    let name = shim_e2e::harness::container_name_of(task);
    let cid = run_foreign_container(&name, &labels, runner_dir, false);
    if let Some(code) = exit_code {
        shim_e2e::harness::wait_until("the stub runner starts", Duration::from_secs(90), || {
            runner_dir.join("stub-runner.pid").exists()
        });
        let exit = runner_dir.join(shim_e2e::RUNNER_EXIT_FILE);
        fs_err::write(exit, format!("{code}\n")).unwrap();
        shim_e2e::harness::wait_until("the container stops", Duration::from_secs(90), || {
            shim_e2e::harness::container_running(None, &cid) == Some(false)
        });
    }
    cid
}

/// Runs a scenario in the fake world: a current-thread runtime on paused time.
pub fn on_paused_time(scenario: impl Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
        .block_on(scenario);
}

/// Runs a scenario in a world that needs Docker (`docker` or `binary`), on a multi-threaded
/// runtime (the binary world's calls block; the flaky proxy runs on the other threads).
pub fn with_docker(scenario: impl Future<Output = ()>) {
    shim_e2e::require_docker();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
        .block_on(scenario);
}

/// `in_worlds!(scenario: fake, docker, binary)`: a module named after the scenario (an async
/// function generic over [`World`] that makes its worlds with [`World::new`]) with one test
/// per world named.
#[macro_export]
macro_rules! in_worlds {
    ($scenario:ident: $($world:ident),+ $(,)?) => {
        mod $scenario {
            $( $crate::in_worlds!(@one $scenario $world); )+
        }
    };
    (@one $scenario:ident fake) => {
        #[test]
        fn fake() {
            $crate::world::on_paused_time(super::$scenario::<$crate::world::FakeWorld>());
        }
    };
    (@one $scenario:ident docker) => {
        #[test]
        #[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
        fn docker() {
            $crate::world::with_docker(super::$scenario::<$crate::world::DockerWorld>());
        }
    };
    (@one $scenario:ident binary) => {
        #[test]
        #[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
        fn binary() {
            $crate::world::with_docker(super::$scenario::<$crate::world::BinaryWorld>());
        }
    };
}
