//! The engine library as a world: on the fake runtime and fake host resources
//! ([`FakeWorld`], paused time), or on the real Docker daemon with the real `authorized_keys`
//! and volume code ([`DockerWorld`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use shim_engine::{Clock, Deps, Engine, EngineConfig, Shutdown};
use shim_resources::fake::{FakeAuthorizedKeys, FakeGpuHealth, FakeVolumes, StaticUserDb};
use shim_resources::gpu::UnhealthyReason;
use shim_resources::{AuthorizedKeysManager, BlockVolumes, HostGpus, VolumeConfig};
use shim_runtime::fake::FakeRuntime;
use shim_runtime::{ContainerState, DockerRuntime};
use shim_task::{TaskConfig, TaskId, TerminationReason};
use shim_util::SystemCommandRunner;

use super::flaky::FlakyDocker;
use super::{Changes, GPUS, Options, World};

/// The engine on the fake runtime, on paused time.
pub type FakeWorld = EngineWorld<false>;
/// The engine on the real Docker daemon.
pub type DockerWorld = EngineWorld<true>;

/// The wall time the fake world starts at (Unix ms: 2026-12-01T00:00:00Z).
const START_MS: u64 = 1_796_083_200_000;

/// The engine library on a home of its own; `DOCKER` picks the real daemon.
pub struct EngineWorld<const DOCKER: bool> {
    dir: Arc<tempfile::TempDir>,
    options: Options,
    /// The fake world's daemon (shared with its neighbours).
    fake: Option<FakeRuntime>,
    proxy: Option<FlakyDocker>,
    /// The proxy that loses answers ([`Options::losing_engine`], the Docker world).
    losing: Option<shim_e2e::harness::LosingProxy>,
    engine: Option<Engine>,
    clock: Clock,
    gpus: HostGpus,
    /// The GPUs' health source ([`Options::gpu_health`]), kept across restarts.
    health: Option<Arc<FakeGpuHealth>>,
    /// How the home is spelled to the engine, if not as made.
    spelled: Option<PathBuf>,
    /// The task store's faults ([`Options::fillable_home`]): its disk full or not, kept
    /// across restarts.
    disk: Option<Arc<shim_fs::fault::Faults>>,
    /// Every submitted task's container name, removed however the test ends (one that keeps
    /// an earlier owner identity escapes a sweep by owner).
    named: std::sync::Mutex<Vec<String>>,
}

impl DockerWorld {
    /// The host user `tester`'s real `authorized_keys` (empty while there is none).
    pub fn authorized_keys(&self) -> String {
        fs_err::read_to_string(self.path("user/.ssh/authorized_keys")).unwrap_or_default()
    }

    /// A 32 MiB loop device named `name` with a GCP-style by-id link, as a task's volume
    /// (`device_name`) finds it; where the engine mounts it; detached and unmounted on drop.
    pub fn loop_volume(&self, name: &str) -> LoopVolume {
        let file = self.path(&format!("{name}.img"));
        fs_err::File::create(&file)
            .unwrap()
            .set_len(32 << 20)
            .unwrap();
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "losetup: {out:?}");
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        let link = self.path("by-id").join(format!("google-{name}"));
        std::os::unix::fs::symlink(&dev, link).unwrap();
        LoopVolume {
            dev,
            mount: self.path("volumes").join(name),
        }
    }
}

/// A loop device as a task's volume ([`DockerWorld::loop_volume`]).
pub struct LoopVolume {
    /// Its loop device.
    pub dev: String,
    /// Where the engine mounts it.
    pub mount: PathBuf,
}

impl LoopVolume {
    /// Whether it is mounted now.
    pub fn is_mounted(&self) -> bool {
        let info = fs_err::read_to_string("/proc/self/mountinfo").unwrap();
        let p = self.mount.to_str().unwrap();
        info.lines().any(|l| l.split(' ').nth(4) == Some(p))
    }
}

impl Drop for LoopVolume {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

impl<const DOCKER: bool> EngineWorld<DOCKER> {
    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn engine(&self) -> &Engine {
        self.engine.as_ref().expect("the engine runs")
    }

    async fn open(&self) -> Engine {
        let home = self.spelled.clone().unwrap_or_else(|| self.path("home"));
        let mut cfg = EngineConfig::new(home);
        cfg.volumes_root = self.path("volumes");
        cfg.runner_binary_path = match (&self.options.runner, DOCKER) {
            (Some(runner), _) => runner.clone(),
            (None, true) => shim_e2e::runner_path(),
            // The fake runs nothing: a file is enough.
            (None, false) => self.path("dstack-runner"),
        };
        // Long unless asked: the worlds move by events and the engine's own relists only.
        cfg.reconcile_interval = Duration::from_secs(self.options.relist_every_s.unwrap_or(3600));
        if let Some(stall) = self.options.pull_stall_timeout_s {
            cfg.pull_stall_timeout = Some(Duration::from_secs(stall));
        }
        let mut deps = match &self.fake {
            Some(fake) => Deps::new(
                Arc::new(fake.clone()),
                // A restarted process has no key registered: fresh fakes each time.
                Arc::new(FakeAuthorizedKeys::new()),
                Arc::new(FakeVolumes::new(self.path("volumes"))),
            ),
            None => {
                let runtime = match (&self.proxy, &self.losing) {
                    (Some(proxy), _) => DockerRuntime::connect_to(&proxy.docker_host()).await,
                    (None, Some(losing)) => DockerRuntime::connect_to(&losing.host()).await,
                    (None, None) => DockerRuntime::connect().await,
                }
                .unwrap();
                let users = StaticUserDb::new().with_user("tester", self.path("user"));
                let mut volumes = VolumeConfig::with_root(self.path("volumes")).fast();
                volumes.gcp_by_id_dir = self.path("by-id");
                let mut deps = Deps::new(
                    Arc::new(runtime),
                    Arc::new(AuthorizedKeysManager::new(Arc::new(users))),
                    Arc::new(BlockVolumes::new(
                        volumes,
                        Arc::new(SystemCommandRunner::default()),
                    )),
                );
                deps.fake_gpus = true;
                deps
            }
        };
        deps.host_gpus = self.gpus.clone();
        deps.clock = self.clock;
        deps.store_faults = self.disk.clone();
        if let Some(health) = &self.health {
            deps.gpu_health = Some(health.clone());
            cfg.gpu_health_interval = Duration::from_secs(1);
        }
        Engine::open(cfg, deps).await.unwrap()
    }

    async fn make(options: Options, fake: Option<FakeRuntime>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        for d in ["home", "user", "volumes", "by-id"] {
            fs_err::create_dir_all(dir.path().join(d)).unwrap();
        }
        fs_err::write(dir.path().join("dstack-runner"), b"").unwrap();
        let fake = match (DOCKER, fake) {
            (true, _) => None,
            (false, Some(fake)) => Some(fake),
            (false, None) => {
                let fake = FakeRuntime::new();
                fake.add_image(&shim_e2e::image());
                // Docker refuses a bind mount of a missing file: so does the fake.
                fake.check_bind_sources(true);
                Some(fake)
            }
        };
        let proxy = (DOCKER && options.flaky_engine).then(|| FlakyDocker::start(dir.path()));
        let losing = (DOCKER && (options.losing_engine || options.late_engine))
            .then(|| losing_proxy(options.late_engine));
        if let (Some(fake), true) = (&fake, options.losing_engine) {
            fake.lose_next_create_answer();
            fake.queue_start_behavior(shim_runtime::fake::StartBehavior::StartsAnswerLost);
            fake.lose_next_remove_answer();
        }
        if let (Some(fake), true) = (&fake, options.late_engine) {
            fake.queue_start_behavior(shim_runtime::fake::StartBehavior::StartsAnswerLate);
        }
        let gpus = HostGpus::fake_nvidia(GPUS as u32);
        let disk = options
            .fillable_home
            .then(|| Arc::new(shim_fs::fault::Faults::new()));
        let health = options
            .gpu_health
            .then(|| Arc::new(FakeGpuHealth::new(&gpus)));
        let mut world = EngineWorld {
            dir: Arc::new(dir),
            options,
            fake,
            proxy,
            losing,
            engine: None,
            named: std::sync::Mutex::new(Vec::new()),
            gpus,
            health,
            spelled: None,
            disk,
            clock: if DOCKER {
                Clock::system()
            } else {
                Clock::tokio_from(START_MS)
            },
        };
        world.engine = Some(world.open().await);
        world
    }
}

/// A proxy on the Docker socket that loses the answers to the first create, start and
/// container removal ([`Options::losing_engine`]), or (`late`) holds the answer to the first
/// start ([`Options::late_engine`]).
pub fn losing_proxy(late: bool) -> shim_e2e::harness::LosingProxy {
    let socket = shim_e2e::harness::docker_socket();
    if late {
        shim_e2e::harness::LosingProxy::holding(&socket, &["/start "]).unwrap()
    } else {
        shim_e2e::harness::LosingProxy::start(
            &socket,
            &["/containers/create", "/start ", "DELETE /containers/"],
        )
        .unwrap()
    }
}

/// A stopped container's exit code as Docker reports it (`None`: none, or it runs).
pub fn docker_exit_code(container_id: &str) -> Option<i64> {
    let out = Command::new("docker")
        .args([
            "inspect",
            "-f",
            "{{.State.Running}} {{.State.ExitCode}}",
            container_id,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    match text.split_whitespace().collect::<Vec<_>>()[..] {
        ["false", code] if out.status.success() => code.parse().ok(),
        _ => None,
    }
}

/// An engine error as the binary answers it: the HTTP status its kind documents
/// (`shim_engine::ErrorKind`), then the whole chain.
fn as_answered(e: &shim_engine::EngineError) -> String {
    let status = match e.kind() {
        shim_engine::ErrorKind::NotFound => 404,
        shim_engine::ErrorKind::Conflict => 409,
        shim_engine::ErrorKind::InvalidInput => 400,
        _ => 500,
    };
    format!("{status} {}", shim_util::error_chain(e))
}

fn tid(id: &str) -> TaskId {
    TaskId::new(id).unwrap()
}

fn json(info: &shim_task::TaskInfo) -> Value {
    serde_json::to_value(info).unwrap()
}

impl<const DOCKER: bool> World for EngineWorld<DOCKER> {
    async fn new(options: Options) -> Self {
        Self::make(options, None).await
    }

    async fn neighbour(&self) -> Self {
        Self::make(Options::default(), self.fake.clone()).await
    }

    fn gpu_ids(&self) -> Vec<String> {
        self.gpus.ids()
    }

    async fn set_gpu_healthy(&self, index: usize, healthy: bool) {
        let health = self
            .health
            .as_ref()
            .expect("a world made without Options::gpu_health");
        let reasons = match healthy {
            true => vec![],
            false => vec![UnhealthyReason::RetiredPagesPending],
        };
        assert!(health.set_reasons(index, reasons), "no GPU {index}");
    }

    async fn submit(&self, task: &Value) -> Result<(), String> {
        let config: TaskConfig = serde_json::from_value(task.clone()).map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())?;
        self.named
            .lock()
            .unwrap()
            .push(shim_task::naming::container_name(&config.name, &config.id));
        match self.engine().submit(config).await {
            Ok(_) => Ok(()),
            Err(e) => Err(as_answered(&e)),
        }
    }

    async fn changes(&self) -> Changes {
        let mut subscription = self.engine().subscribe();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let forward = tokio::spawn(async move {
            while let Ok(change) = subscription.recv().await {
                if tx.send(serde_json::to_value(&change).unwrap()).is_err() {
                    return;
                }
            }
        });
        Changes::new(rx, Some(forward))
    }

    async fn info(&self, id: &str) -> Option<Value> {
        self.engine().task_info(&tid(id)).ok().map(|i| json(&i))
    }

    async fn settled(&self, id: &str) -> bool {
        !self.engine().is_starting(&tid(id)).unwrap_or(false)
    }

    async fn list(&self) -> BTreeMap<String, String> {
        self.engine()
            .list()
            .into_iter()
            .map(|(id, status)| (id.as_str().to_owned(), status.as_str().to_owned()))
            .collect()
    }

    async fn try_terminate(
        &self,
        id: &str,
        reason: &str,
        message: &str,
        timeout_s: u64,
    ) -> Result<Value, String> {
        let (id, reason) = (tid(id), TerminationReason::parse(reason));
        let timeout = Duration::from_secs(timeout_s);
        let answer = self
            .engine()
            .terminate(&id, reason, message.to_owned(), timeout);
        answer
            .await
            .map(|info| json(&info))
            .map_err(|e| as_answered(&e))
    }

    async fn try_remove(&self, id: &str) -> Result<(), String> {
        self.engine()
            .remove(&tid(id))
            .await
            .map_err(|e| as_answered(&e))
    }

    async fn stop(&mut self) {
        if let Some(engine) = self.engine.take() {
            engine
                .shutdown(Shutdown::Graceful(Duration::from_secs(5)))
                .await;
        }
    }

    async fn start(&mut self) {
        self.engine = Some(self.open().await);
    }

    async fn restart_spelling_home_as(&mut self, spelled: &std::path::Path) {
        self.stop().await;
        self.spelled = Some(spelled.to_owned());
        self.start().await;
    }

    fn owner(&self) -> String {
        self.engine().owner().to_owned()
    }

    fn home(&self) -> PathBuf {
        self.path("home")
    }

    async fn exit_runner(&self, info: &Value, code: i32) {
        match &self.fake {
            Some(fake) => {
                let cid = super::cid(info);
                // What the stub runner prints, ending as it does.
                let last = format!("runner exiting with {code}");
                let lines = [
                    "stub runner: starting",
                    "one",
                    "two",
                    "three",
                    "four",
                    &last,
                ];
                fake.set_logs(cid, &lines);
                assert!(fake.exit(cid, i64::from(code)), "no container {cid}");
            }
            None => shim_e2e::harness::write_runner_exit(&self.home(), info, code).unwrap(),
        }
    }

    async fn container_running(&self, container_id: &str) -> Option<bool> {
        match &self.fake {
            Some(fake) => fake.state(container_id).map(|s| s.is_running()),
            None => shim_e2e::harness::container_running(None, container_id),
        }
    }

    async fn containers(&self) -> usize {
        match &self.fake {
            Some(fake) => fake.container_ids().len(),
            None => {
                let filter = format!(
                    "label={}={}",
                    shim_engine::labels::LABEL_OWNER,
                    self.owner()
                );
                shim_e2e::docker_ok(&["ps", "-aq", "--filter", &filter])
                    .split_whitespace()
                    .count()
            }
        }
    }

    async fn container_started(&self, container_id: &str) -> String {
        match &self.fake {
            Some(fake) => {
                let calls = fake.calls();
                let starts = calls.iter().filter(
                    |c| matches!(c, shim_runtime::fake::Call::Start(id) if id == container_id),
                );
                format!("{} starts", starts.count())
            }
            None => shim_e2e::docker_ok(&["inspect", "-f", "{{.State.StartedAt}}", container_id]),
        }
    }

    async fn container_exit_code(&self, container_id: &str) -> Option<i64> {
        match &self.fake {
            Some(fake) => match fake.state(container_id)? {
                ContainerState::Running => None,
                // The fake's inspect is not counted as an engine call a scenario made.
                _ => {
                    shim_runtime::ContainerRuntime::inspect(fake, container_id)
                        .await
                        .ok()?
                        .exit_code
                }
            },
            None => docker_exit_code(container_id),
        }
    }

    async fn run_upstream_container(
        &self,
        task: &Value,
        runner_dir: &std::path::Path,
        exit_code: Option<i32>,
    ) -> String {
        let name = shim_e2e::harness::container_name_of(task);
        self.named.lock().unwrap().push(name.clone());
        let Some(fake) = &self.fake else {
            return super::run_upstream_container_on_docker(task, runner_dir, exit_code);
        };
        let mut spec = shim_runtime::ContainerSpec::new(&name, shim_e2e::image());
        spec.labels = [
            ("ai.dstack.shim.is-task".to_owned(), "true".to_owned()),
            (
                "ai.dstack.shim.task-id".to_owned(),
                task["id"].as_str().unwrap().to_owned(),
            ),
        ]
        .into();
        spec.mounts = vec![shim_runtime::BindMount {
            source: runner_dir.to_path_buf(),
            target: "/tmp/runner".to_owned(),
            read_only: false,
        }];
        let (state, code) = match exit_code {
            Some(code) => (ContainerState::Exited, Some(i64::from(code))),
            None => (ContainerState::Running, None),
        };
        let cid = fake.add_container(&spec, state, code);
        if let Some(code) = exit_code {
            fake.set_logs(&cid, &[&format!("runner exiting with {code}")]);
        }
        cid
    }

    async fn metrics(&self) -> shim_e2e::harness::Metrics {
        let mut text = String::new();
        self.engine().encode_metrics(&mut text).unwrap();
        shim_e2e::harness::parse_openmetrics(&text).unwrap_or_else(|e| panic!("{e}\n{text}"))
    }

    fn host_user(&self) -> Option<super::HostKeys> {
        DOCKER.then(|| super::HostKeys {
            user: "tester".to_owned(),
            file: self.path("user/.ssh/authorized_keys"),
        })
    }

    fn answers_lost(&self) -> usize {
        match (&self.fake, &self.losing) {
            (Some(fake), _) => fake.answers_lost(),
            (None, Some(losing)) => losing.lost().len(),
            (None, None) => 0,
        }
    }

    fn fake(&self) -> Option<&FakeRuntime> {
        self.fake.as_ref()
    }

    async fn set_engine_reachable(&self, reachable: bool) {
        match (&self.fake, &self.proxy) {
            (Some(fake), _) => {
                fake.set_unreachable(!reachable);
                if !reachable {
                    // As a proxy that cuts its connections: the event stream breaks (and the
                    // engine's stream sees it before anything else happens).
                    fake.break_event_streams();
                }
            }
            (None, Some(proxy)) => proxy.set_down(!reachable),
            (None, None) => panic!("a world made without Options::flaky_engine"),
        }
        if !reachable {
            self.wait_events_connected(false).await;
        }
    }

    async fn set_disk_full(&self, full: bool) {
        let disk = self.disk.as_ref();
        disk.expect("a world made without Options::fillable_home")
            .set_full(full);
    }

    async fn relist(&self) -> Option<bool> {
        Some(self.engine().reconcile_now().await)
    }

    async fn fail_next_state_read(&self) {
        let disk = self.disk.as_ref();
        let disk = disk.expect("a world made without Options::fillable_home");
        disk.arm(shim_fs::Step::Read, shim_fs::fault::FaultKind::Fail);
    }

    async fn hold_writes(&self, held: bool, waiting: usize) {
        let disk = self.disk.as_ref();
        let disk = disk.expect("a world made without Options::fillable_home");
        if !held {
            disk.release_writes();
            return;
        }
        disk.hold_writes();
        // Real time: a held write waits on a thread of the blocking pool, which virtual time
        // does not wait for.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while disk.writes_waiting() < waiting {
            assert!(
                std::time::Instant::now() < deadline,
                "no write reached its hold"
            );
            tokio::task::yield_now().await;
        }
    }
}

impl<const DOCKER: bool> Drop for EngineWorld<DOCKER> {
    /// Lets held writes go (a failed check while they were held would otherwise leave a
    /// thread of the blocking pool waiting, and the test's runtime with it), and removes
    /// every container of this home's engine however the test ends.
    fn drop(&mut self) {
        if let Some(disk) = &self.disk {
            disk.release_writes();
        }
        if !DOCKER {
            return;
        }
        let mut doomed: Vec<String> = self.named.lock().map(|n| n.clone()).unwrap_or_default();
        if let Ok(owner) = fs_err::read_to_string(self.path("home").join("owner-id")) {
            let filter = format!(
                "label={}={}",
                shim_engine::labels::LABEL_OWNER,
                owner.trim()
            );
            if let Ok(out) = shim_e2e::harness::try_docker(&["ps", "-aq", "--filter", &filter]) {
                doomed.extend(
                    String::from_utf8_lossy(&out.stdout)
                        .split_whitespace()
                        .map(str::to_owned),
                );
            }
        }
        for container in doomed {
            let _ = shim_e2e::harness::try_docker(&["rm", "-f", &container]);
        }
    }
}
