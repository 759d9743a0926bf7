//! The built `dstack-shim` over HTTP as a world ([`TestShim`]: the stub runner, fake GPUs, a
//! temporary home, its containers swept however the test ends).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use shim_e2e::harness::{
    EventStream, FakeGpuHost, FakeGpuHostOptions, FakeHealth, FakeVendor, HostUser, LoopFs,
    NamedContainer, TestShim, container_name_of,
};

use super::flaky::FlakyDocker;
use super::{Changes, GPUS, Options, World};

/// `dstack-shim` over HTTP. Its calls block: each runs on tokio's blocking pool, so that a
/// scenario's concurrent calls are concurrent requests.
pub struct BinaryWorld {
    shim: Arc<TestShim>,
    /// Whether the shim relists often enough for [`World::relist`] to wait for one.
    relists: bool,
    proxy: Option<FlakyDocker>,
    /// The host user ([`Options::host_user`]); removed after the shim stops.
    user: Option<HostUser>,
    /// The proxy that loses answers ([`Options::losing_engine`]).
    losing: Option<shim_e2e::harness::LosingProxy>,
    /// Every submitted task's container, removed by name however the test ends (one that
    /// keeps an earlier owner identity escapes the shim's sweeper).
    named: Mutex<Vec<NamedContainer>>,
    /// The home's file system ([`Options::fillable_home`]) and what fills it; unmounted after
    /// the shim stops (fields drop in order).
    disk: Option<(LoopFs, Mutex<Option<PathBuf>>)>,
    /// The fake GPU host the shim runs in ([`Options::gpu_health`]); torn down after the
    /// shim stops (fields drop in order).
    gpu_host: Option<FakeGpuHost>,
    /// Holds the proxy's socket.
    _dir: tempfile::TempDir,
}

impl BinaryWorld {
    /// The shim under test, for what only this world shows.
    pub fn shim(&self) -> &TestShim {
        &self.shim
    }

    async fn call<T: Send + 'static>(&self, f: impl FnOnce(&TestShim) -> T + Send + 'static) -> T {
        let shim = self.shim.clone();
        tokio::task::spawn_blocking(move || f(&shim)).await.unwrap()
    }

    /// Removes `task`'s container by name however the test ends.
    fn remove_at_end(&self, task: &Value) {
        let named = NamedContainer(container_name_of(task));
        self.named.lock().unwrap().push(named);
    }

    fn shim_mut(&mut self) -> &mut TestShim {
        Arc::get_mut(&mut self.shim).expect("no call in flight")
    }
}

/// A 200 as `Ok`, an error as [`World::submit`] answers it: the status and the shim's message.
fn answered(answer: shim_e2e::harness::Response) -> Result<(), String> {
    match answer.status {
        200 => Ok(()),
        status => Err(format!("{status} {}", answer.body)),
    }
}

impl World for BinaryWorld {
    async fn new(options: Options) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let proxy = options.flaky_engine.then(|| FlakyDocker::start(dir.path()));
        let mut builder = TestShim::builder("world");
        if let Some(runner) = &options.runner {
            builder = builder.runner_binary(runner);
        }
        if let Some(every) = options.relist_every_s {
            builder = builder.args(["--reconcile-interval".to_owned(), every.to_string()]);
        }
        if let Some(stall) = options.pull_stall_timeout_s {
            builder = builder.args(["--pull-stall-timeout".to_owned(), format!("{stall}s")]);
        }
        if let Some(proxy) = &proxy {
            // Only the shim goes through the proxy: the clean-up talks to Docker directly.
            builder = builder.env("DOCKER_HOST", proxy.docker_host());
        }
        let user = options.host_user.then(|| {
            shim_e2e::require_root();
            HostUser::create(dir.path())
        });
        let losing = (options.losing_engine || options.late_engine)
            .then(|| super::engine::losing_proxy(options.late_engine));
        if let Some(losing) = &losing {
            builder = builder.env("DOCKER_HOST", losing.host());
        }
        let mut disk = None;
        if options.fillable_home {
            shim_e2e::require_root();
            let fs = LoopFs::create(dir.path(), 16);
            builder = builder.home(&fs.mount.join("home"), &dir.path().join("logs"));
            disk = Some((fs, Mutex::new(None)));
        }
        let gpu_host = options.gpu_health.then(|| {
            shim_e2e::require_root();
            FakeGpuHost::setup(FakeVendor::Nvidia, GPUS, &FakeGpuHostOptions::default())
        });
        if let Some(host) = &gpu_host {
            builder = builder.gpu_host(host).args(["--gpu-health-interval", "1s"]);
        }
        let shim = tokio::task::spawn_blocking(move || {
            let shim = builder.start();
            assert_eq!(shim.get("/api/healthcheck").status, 200);
            shim
        });
        BinaryWorld {
            disk,
            gpu_host,
            relists: options.relist_every_s.is_some(),
            shim: Arc::new(shim.await.unwrap()),
            proxy,
            user,
            losing,
            named: Mutex::new(Vec::new()),
            _dir: dir,
        }
    }

    async fn neighbour(&self) -> Self {
        Self::new(Options::default()).await
    }

    fn gpu_ids(&self) -> Vec<String> {
        match &self.gpu_host {
            Some(host) => host.ids(),
            // `--fake-gpus`: the engine's fake NVIDIA GPUs.
            None => shim_resources::HostGpus::fake_nvidia(GPUS as u32).ids(),
        }
    }

    async fn set_gpu_healthy(&self, index: usize, healthy: bool) {
        let host = self
            .gpu_host
            .as_ref()
            .expect("a world made without Options::gpu_health");
        host.set_health(
            index,
            match healthy {
                true => FakeHealth::Healthy,
                false => FakeHealth::RetiredPagesPending,
            },
        );
    }

    async fn submit(&self, task: &Value) -> Result<(), String> {
        self.remove_at_end(task);
        let task = task.clone();
        answered(self.call(move |shim| shim.submit(&task)).await)
    }

    async fn changes(&self) -> Changes {
        let addr = self.shim.addr();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        // Connected and past the snapshot before this returns: every later change is seen.
        let mut stream = tokio::task::spawn_blocking(move || {
            let mut stream = EventStream::connect(addr, Duration::from_secs(90)).unwrap();
            assert_eq!(stream.next_event().unwrap().event, "snapshot");
            stream
        })
        .await
        .unwrap();
        // Ends with the stream (the shim gone) or once nobody listens.
        std::thread::spawn(move || {
            while let Ok(event) = stream.next_event() {
                let change = serde_json::from_str(&event.data).unwrap();
                if event.event == "change" && tx.send(change).is_err() {
                    return;
                }
            }
        });
        Changes::new(rx, None)
    }

    async fn info(&self, id: &str) -> Option<Value> {
        let id = id.to_owned();
        self.call(move |shim| shim.info_opt(&id)).await
    }

    async fn list(&self) -> BTreeMap<String, String> {
        self.call(TestShim::list).await
    }

    async fn try_terminate(
        &self,
        id: &str,
        reason: &str,
        message: &str,
        timeout_s: u64,
    ) -> Result<Value, String> {
        let (id, reason, message) = (id.to_owned(), reason.to_owned(), message.to_owned());
        let answer = self
            .call(move |shim| shim.terminate(&id, &reason, &message, timeout_s))
            .await;
        match answer.status {
            200 => Ok(answer.json_body()),
            status => Err(format!("{status} {}", answer.body)),
        }
    }

    async fn try_remove(&self, id: &str) -> Result<(), String> {
        let id = id.to_owned();
        answered(self.call(move |shim| shim.remove(&id)).await)
    }

    async fn remove(&self, id: &str) {
        let id = id.to_owned();
        self.call(move |shim| shim.remove_retrying(&id)).await;
    }

    async fn stop(&mut self) {
        self.shim_mut().kill();
    }

    async fn start(&mut self) {
        let shim = self.shim_mut();
        shim.start();
        // The port accepts connections before the restore is done; the first answer comes
        // after it (and after the owner identity is stored).
        assert_eq!(shim.get("/api/healthcheck").status, 200);
    }

    async fn restart_spelling_home_as(&mut self, spelled: &std::path::Path) {
        self.stop().await;
        self.shim_mut().spell_home_as(spelled);
        self.start().await;
    }

    fn owner(&self) -> String {
        self.shim.owner()
    }

    fn home(&self) -> PathBuf {
        self.shim.home().to_path_buf()
    }

    async fn exit_runner(&self, info: &Value, code: i32) {
        self.shim.exit_runner(info, code);
    }

    async fn container_running(&self, container_id: &str) -> Option<bool> {
        let id = container_id.to_owned();
        self.call(move |shim| shim.running(&id)).await
    }

    async fn containers(&self) -> usize {
        self.call(|shim| shim.containers().len()).await
    }

    async fn container_started(&self, container_id: &str) -> String {
        shim_e2e::docker_ok(&["inspect", "-f", "{{.State.StartedAt}}", container_id])
    }

    async fn metrics(&self) -> shim_e2e::harness::Metrics {
        self.call(TestShim::metrics).await
    }

    fn host_user(&self) -> Option<super::HostKeys> {
        self.user.as_ref().map(|u| super::HostKeys {
            user: u.name().to_owned(),
            file: u.authorized_keys(),
        })
    }

    fn add_own_key_line(&self, line: &str) {
        self.user.as_ref().expect("a host user").add_line(line);
    }

    fn answers_lost(&self) -> usize {
        self.losing.as_ref().map_or(0, |l| l.lost().len())
    }

    fn binary(&self) -> Option<&TestShim> {
        Some(&self.shim)
    }

    async fn container_exit_code(&self, container_id: &str) -> Option<i64> {
        super::engine::docker_exit_code(container_id)
    }

    async fn set_disk_full(&self, full: bool) {
        let (fs, filler) = self
            .disk
            .as_ref()
            .expect("a world made without Options::fillable_home");
        let mut filler = filler.lock().unwrap();
        match (full, filler.take()) {
            (true, _) => *filler = Some(fs.fill()),
            (false, Some(path)) => fs.free(&path),
            (false, None) => {}
        }
    }

    async fn set_engine_reachable(&self, reachable: bool) {
        self.proxy
            .as_ref()
            .expect("a world made without Options::flaky_engine")
            .set_down(!reachable);
        if !reachable {
            self.wait_events_connected(false).await;
        }
    }

    /// Waits for the shim's next full relist (a cycle counted in its metrics) where it
    /// relists often ([`Options::relist_every_s`]).
    async fn relist(&self) -> Option<bool> {
        if !self.relists {
            return None;
        }
        let cycles = |shim: &TestShim| {
            shim.metrics()
                .get("dstack_shim_reconcile_cycle_seconds_count", &[])
        };
        let before = self.call(move |shim| cycles(shim)).await;
        for _ in 0..600 {
            if self.call(move |shim| cycles(shim)).await > before {
                return Some(true);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("no relist in a minute");
    }

    async fn run_upstream_container(
        &self,
        task: &Value,
        runner_dir: &std::path::Path,
        exit_code: Option<i32>,
    ) -> String {
        self.remove_at_end(task);
        super::run_upstream_container_on_docker(task, runner_dir, exit_code)
    }
}
