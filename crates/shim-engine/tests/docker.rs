//! The engine on the real Docker daemon, real authorized_keys files and a real loop-device
//! volume. The tests are ignored unless run with `--run-ignored all`, and then need
//! `SHIM_TEST_DOCKER=1` (the restart test also `SHIM_TEST_ROOT=1`): they fail, never skip, when
//! Docker, a fixture or a variable is missing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shim_e2e::harness::FreshImage;
use shim_engine::{Deps, Engine, EngineConfig};
use shim_resources::{AuthorizedKeysManager, BlockVolumes, HostGpus, StaticUserDb, VolumeConfig};
use shim_runtime::DockerRuntime;
use shim_task::{
    NetworkMode, PublicKey, TaskConfig, TaskId, TaskInfo, TaskName, TaskStatus, TerminationReason,
    VolumeBackend, VolumeMountPoint, VolumeSpec,
};
use shim_util::SystemCommandRunner;

const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe user@host";

/// A shim home, a user home with a real authorized_keys, a volumes root and a GCP by-id dir.
struct Host {
    dir: tempfile::TempDir,
    gpus: HostGpus,
    docker_host: Option<String>,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        for d in ["home", "user", "volumes", "by-id"] {
            fs_err::create_dir_all(dir.path().join(d)).unwrap();
        }
        Host {
            dir,
            gpus: HostGpus::fake_nvidia(2),
            docker_host: None,
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn authorized_keys(&self) -> String {
        fs_err::read_to_string(self.path("user/.ssh/authorized_keys")).unwrap_or_default()
    }

    async fn engine(&self) -> Engine {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let runtime = match &self.docker_host {
            Some(h) => DockerRuntime::connect_to(h).await.unwrap(),
            None => DockerRuntime::connect().await.unwrap(),
        };
        let users = StaticUserDb::new().with_user("tester", self.path("user"));
        let mut vcfg = VolumeConfig::with_root(self.path("volumes")).fast();
        vcfg.gcp_by_id_dir = self.path("by-id");
        let mut deps = Deps::new(
            Arc::new(runtime),
            Arc::new(AuthorizedKeysManager::new(Arc::new(users))),
            Arc::new(BlockVolumes::new(
                vcfg,
                Arc::new(SystemCommandRunner::default()),
            )),
        );
        deps.host_gpus = self.gpus.clone();
        deps.fake_gpus = true;
        let mut cfg = EngineConfig::new(self.path("home"));
        cfg.runner_binary_path = shim_e2e::runner_path();
        cfg.volumes_root = self.path("volumes");
        cfg.reconcile_interval = Duration::from_secs(3600);
        Engine::open(cfg, deps).await.unwrap()
    }

    fn runner_dir(&self, id: &str) -> PathBuf {
        let name = shim_task::naming::container_name(
            &TaskName::new("enginetest").unwrap(),
            &TaskId::new(id).unwrap(),
        );
        self.path("home").join("runners").join(name).join("runner")
    }

    /// Tells the stub runner of task `id` to exit with `code`.
    fn exit_runner(&self, id: &str, code: i32) {
        fs_err::write(self.runner_dir(id).join("exit"), format!("{code}\n")).unwrap();
    }
}

/// Removes every container of this host's shim however the test ends (a failed assertion
/// skips the test's own clean-up).
impl Drop for Host {
    fn drop(&mut self) {
        let Ok(owner) = fs_err::read_to_string(self.path("home").join("owner-id")) else {
            return;
        };
        let owner = owner.trim();
        let filter = format!("label={}={owner}", shim_engine::labels::LABEL_OWNER);
        let ids = docker(&["ps", "-aq", "--filter", &filter]);
        for id in ids.split_whitespace() {
            docker(&["rm", "-f", id]);
        }
    }
}

fn config(id: &str) -> TaskConfig {
    let mut c = TaskConfig::new(
        TaskId::new(id).unwrap(),
        TaskName::new("enginetest").unwrap(),
        shim_e2e::image(),
    );
    // Bridge: every runner listens on the same container port without clashing.
    c.network_mode = NetworkMode::Bridge;
    c
}

/// A task id unique to this run, so leftovers of earlier runs never collide.
fn unique(prefix: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{n}", std::process::id())
}

async fn wait_for(
    engine: &Engine,
    id: &str,
    what: &str,
    f: impl Fn(&TaskInfo) -> bool,
) -> TaskInfo {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = engine.task_info(&TaskId::new(id).unwrap()).unwrap();
        if f(&info) {
            return info;
        }
        assert!(
            Instant::now() < deadline,
            "task {id} never {what}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the task has `status` and its start job has returned.
async fn wait_status(engine: &Engine, id: &str, status: TaskStatus) -> TaskInfo {
    wait_for(engine, id, status.as_str(), |i| {
        i.status == status && !engine.is_starting(&i.id).unwrap()
    })
    .await
}

async fn cleanup(engine: &Engine, ids: &[&str]) {
    for id in ids {
        let tid = TaskId::new(*id).unwrap();
        let _ = engine
            .terminate(
                &tid,
                TerminationReason::TerminatedByServer,
                String::new(),
                Duration::ZERO,
            )
            .await;
        let _ = engine.remove(&tid).await;
    }
}

/// Bytes of the random layer of the tests' fresh images: at about 2 MiB/s through the proxy, a
/// pull lasts several seconds (the containerd store reports bytes per whole MiB, polled every
/// 100 ms).
const FRESH_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;

/// A fresh image in `repo` of the test registry (see [`FreshImage`]).
fn fresh_image(repo: &str) -> FreshImage {
    FreshImage::push(repo, FRESH_PAYLOAD_BYTES).unwrap()
}

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A loop device with a GCP-style by-id link; detached and unmounted on drop.
struct LoopDevice {
    dev: String,
    mount: PathBuf,
}

impl LoopDevice {
    fn new(host: &Host, name: &str) -> LoopDevice {
        let file = host.path(&format!("{name}.img"));
        let f = fs_err::File::create(&file).unwrap();
        f.set_len(32 * 1024 * 1024).unwrap();
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "losetup: {out:?}");
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        std::os::unix::fs::symlink(&dev, host.path("by-id").join(format!("google-{name}")))
            .unwrap();
        LoopDevice {
            dev,
            mount: host.path("volumes").join(name),
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

fn is_mounted(path: &Path) -> bool {
    let info = fs_err::read_to_string("/proc/self/mountinfo").unwrap();
    let p = path.to_str().unwrap();
    info.lines().any(|l| l.split(' ').nth(4) == Some(p))
}

/// A crash with real resources held (every restore case of SPEC §5, on every world:
/// tests/tests/restore.rs): the shim process is simulated by a tokio runtime that is dropped
/// (killing its tasks, like SIGKILL), then a new one on the same home. A task whose runner
/// exited meanwhile has its key removed from the real authorized_keys and its loop-device
/// volume unmounted; a task cut short while pulling has its key removed.
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_crash_releases_the_real_keys_and_volumes_of_tasks_that_ended() {
    shim_e2e::require_docker();
    shim_e2e::require_root();
    let host = Host::new();
    let image = fresh_image("shim-engine-restore-pull");
    let vol = LoopDevice::new(&host, &unique("vol").replace('-', ""));
    let vol_name = vol.mount.file_name().unwrap().to_str().unwrap().to_owned();
    let [exits, cut] = ["exits", "cut"].map(unique);

    let rt1 = tokio::runtime::Runtime::new().unwrap();
    rt1.block_on(async {
        let engine = host.engine().await;
        let mut c = config(&exits);
        c.gpu = 1;
        c.host_ssh_user = "tester".into();
        c.host_ssh_keys = vec![PublicKey::parse(KEY).unwrap().into()];
        c.volumes = vec![VolumeSpec {
            backend: VolumeBackend::Gcp,
            name: TaskName::new(&*vol_name).unwrap(),
            volume_id: String::new(),
            init_fs: true,
            device_name: vol_name.clone(),
        }];
        c.volume_mounts = vec![VolumeMountPoint {
            name: TaskName::new(&*vol_name).unwrap(),
            path: "/data".into(),
        }];
        engine.submit(c).await.unwrap();
        wait_status(&engine, &exits, TaskStatus::Running).await;
        // Cut short while pulling (a slow pull of fresh content, which no content store can
        // finish at once): a state file, no container, an SSH key.
        let mut c = config(&cut);
        c.image_name = image.reference().to_owned();
        c.registry_username = shim_e2e::registry_user();
        c.registry_password = shim_task::Secret::new(shim_e2e::registry_password());
        c.host_ssh_user = "tester".into();
        c.host_ssh_keys = vec![PublicKey::parse(
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKzk3CWHbq3U5nQ6BHV1ToyN2NUxT9b3FbiIYDwGBtJd other@host",
        )
        .unwrap()
        .into()];
        engine.submit(c).await.unwrap();
        wait_for(&engine, &cut, "pulling", |i| i.status == TaskStatus::Pulling).await;
    });
    assert!(host.authorized_keys().contains("user@host"));
    assert!(host.authorized_keys().contains("other@host"));
    assert!(is_mounted(&vol.mount));
    // SIGKILL.
    rt1.shutdown_background();

    // While the shim is down, the runner exits.
    host.exit_runner(&exits, 4);
    let exits_state = || {
        docker(&[
            "ps",
            "-a",
            "--filter",
            &format!("label=ai.dstack.shim.task-id={exits}"),
            "--format",
            "{{.State}}",
        ])
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while exits_state() != "exited" {
        assert!(Instant::now() < deadline, "runner did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }

    let rt2 = tokio::runtime::Runtime::new().unwrap();
    rt2.block_on(async {
        let engine = host.engine().await;
        let info = |id: &str| engine.task_info(&TaskId::new(id).unwrap()).unwrap();
        let e = info(&exits);
        assert_eq!(e.termination_reason, "container_exited_with_error");
        assert!(
            !host.authorized_keys().contains("user@host"),
            "{}",
            host.authorized_keys()
        );
        assert!(!is_mounted(&vol.mount));
        let c = info(&cut);
        assert_eq!(c.termination_reason, "executor_error");
        assert!(!host.authorized_keys().contains("other@host"));
        cleanup(&engine, &[&exits, &cut]).await;
        engine
            .shutdown(shim_engine::Shutdown::Graceful(Duration::from_secs(5)))
            .await;
    });
    drop(vol);
}
