//! [`FakeGpuHost`]: a fake GPU host for one test, made by `tests/gpu-host/fake_gpu_host.py`
//! (see its docstring and `tests/gpu-host/README.md`): fake device nodes, the vendor's tool in
//! its real output formats, a CDI spec that gives containers the fake nodes, and a command
//! prefix ([`FakeGpuHost::exec_prefix`]) under which a process (the shim) sees all of it at the
//! real paths (`/dev/nvidiactl`, `nvidia-smi` in `PATH`, ...) while the host does not.
//!
//! One fake host at a time per machine: [`FakeGpuHost::setup`] waits for the script's lock (a
//! CDI spec is global per engine: two fake hosts would both define `nvidia.com/gpu=0`), and the
//! lock is released at the teardown, when the value is dropped. The script also tears the host
//! down by itself if this process dies first (a killed test).
//!
//! Needs root (`mknod`, a mount namespace). AMD and Tenstorrent hosts also import their tool's
//! image into the engine at `DOCKER_HOST` (or [`FakeGpuHostOptions::docker_host`]).

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use super::http::Request;

/// The script, relative to the repository root.
pub const SCRIPT_IN_REPO: &str = "tests/gpu-host/fake_gpu_host.py";
/// The Python that runs it (standard library only, 3.11 or newer).
pub const PYTHON: &str = "python3";
/// How long `setup` may take besides waiting for the lock (image imports included), and how
/// long a command under [`FakeGpuHost::exec_prefix`] run by [`FakeGpuHost::exec`] may take.
pub const COMMAND_BOUND: Duration = Duration::from_secs(120);
/// How long [`FakeGpuHost::setup`] waits for another fake host's teardown (tests of one run
/// queue on it).
pub const LOCK_BOUND: Duration = Duration::from_secs(600);

/// The GPU vendor a fake host imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeVendor {
    /// `/dev/nvidiactl`, `/dev/nvidia<i>`, `nvidia-smi`; CDI kind `nvidia.com/gpu`.
    Nvidia,
    /// `/dev/kfd`, `/dev/dri/renderD<128+i>`, the `dstackai/amd-smi` image; CDI kind
    /// `amd.com/gpu`.
    Amd,
    /// `/dev/tenstorrent/<i>`, the `dstackai/tt-smi` image; no CDI spec.
    Tenstorrent,
}

impl FakeVendor {
    /// The script's `--vendor` (and the shim's name of the vendor).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nvidia => "nvidia",
            Self::Amd => "amd",
            Self::Tenstorrent => "tenstorrent",
        }
    }
}

/// How the CDI spec names each GPU's device (`--cdi-names`); `all` comes with any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CdiName {
    /// `nvidia.com/gpu=0` (NVIDIA Container Toolkit 1.18 and newer, AMD's toolkit).
    Index,
    /// `nvidia.com/gpu=GPU-<uuid>` (NVIDIA Container Toolkit 1.18 and newer).
    Uuid,
    /// `nvidia.com/gpu=gpu0` (older `nvidia-ctk`).
    Legacy,
}

impl CdiName {
    fn as_str(self) -> &'static str {
        match self {
            Self::Index => "index",
            Self::Uuid => "uuid",
            Self::Legacy => "legacy",
        }
    }
}

/// What `nvidia-smi -q` reports for an NVIDIA GPU ([`FakeGpuHost::set_health`]); the names
/// are the shim's `UnhealthyReason`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeHealth {
    /// No fault.
    Healthy,
    /// `Retired Pages` / `Pending Page Blacklist: Yes`.
    RetiredPagesPending,
    /// `Remapped Rows` / `Pending: Yes`.
    RowRemapPending,
    /// `Remapped Rows` / `Remapping Failure Occurred: Yes`.
    RowRemapFailure,
}

impl FakeHealth {
    /// The script's name of the state.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::RetiredPagesPending => "retired_pages_pending",
            Self::RowRemapPending => "row_remap_pending",
            Self::RowRemapFailure => "row_remap_failure",
        }
    }
}

/// The options of [`FakeGpuHost::setup`]; `Default` is the script's defaults.
#[derive(Debug, Clone, Default)]
pub struct FakeGpuHostOptions {
    /// `--cdi-names`: `None` the vendor's default (NVIDIA index and uuid, AMD index,
    /// Tenstorrent none); `Some(vec![])` no spec at all (a host without CDI).
    pub cdi_names: Option<Vec<CdiName>>,
    /// `--cdi-dir` (default `/var/run/cdi`, which every engine here reads).
    pub cdi_dir: Option<PathBuf>,
    /// `--topology`: a recording's name in `crates/shim-resources/testdata/gpu/topo`,
    /// `plain` (the default) or `none`.
    pub topology: Option<String>,
    /// `--spec-name` (default `dstack-shim-fake-<key>`).
    pub spec_name: Option<String>,
    /// `--docker-host`: the engine the tool images go to (default `DOCKER_HOST`, else the
    /// default socket).
    pub docker_host: Option<String>,
    /// `--owner-pid`: the process whose exit tears the host down (default: this process).
    pub owner_pid: Option<u32>,
    /// `--lock-timeout` (default [`LOCK_BOUND`]).
    pub lock_timeout: Option<Duration>,
    /// `--state-dir`: where the lock and the records of live hosts are (default
    /// `/var/lib/dstack-shim-dev`).
    pub state_dir: Option<PathBuf>,
    /// `--host-nodes` (AMD, Tenstorrent): the nodes also at their real paths on the host, for
    /// upstream's plain device mappings; a test using it must run alone (any shim detecting
    /// GPUs meanwhile sees the vendor): `.config/nextest.toml`.
    pub host_nodes: bool,
}

/// One fake GPU host; torn down when dropped (see the module docs).
#[derive(Debug)]
pub struct FakeGpuHost {
    dir: PathBuf,
    record: Value,
    state_dir: Option<PathBuf>,
    torn_down: bool,
    /// The empty directory the script fills (it removes it at the teardown; this guard only
    /// removes what a failed teardown left).
    _tmp: tempfile::TempDir,
}

/// Runs `command` with its output collected, killed after `limit`; its output whatever its
/// exit status.
pub fn output_within(command: &mut Command, limit: Duration) -> io::Result<Output> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| io::Error::new(e.kind(), format!("cannot run {command:?}: {e}")))?;
    let stdout = collect(child.stdout.take());
    let stderr = collect(child.stderr.take());
    let started = Instant::now();
    let status: ExitStatus = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{command:?} did not finish within {limit:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

/// Reads `pipe` to its end on a thread of its own (a full pipe must not block the child).
fn collect<R: io::Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf);
        }
        buf
    })
}

fn failed(what: &str, out: &Output) -> io::Error {
    io::Error::other(format!(
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

#[allow(
    clippy::panic,
    clippy::expect_used,
    reason = "test helpers: a fake host that cannot be made or used fails the test"
)]
impl FakeGpuHost {
    /// The script's path.
    pub fn script() -> PathBuf {
        crate::repo_root().join(SCRIPT_IN_REPO)
    }

    /// Makes a fake host with `gpus` GPUs of `vendor` (waiting for the lock); panics (failing
    /// the test) with the script's message if it cannot.
    pub fn setup(vendor: FakeVendor, gpus: usize, options: &FakeGpuHostOptions) -> Self {
        Self::try_setup(vendor, gpus, options).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`FakeGpuHost::setup`] with the default options changed by `set`.
    pub fn with(
        vendor: FakeVendor,
        gpus: usize,
        set: impl FnOnce(&mut FakeGpuHostOptions),
    ) -> Self {
        let mut options = FakeGpuHostOptions::default();
        set(&mut options);
        Self::setup(vendor, gpus, &options)
    }

    /// [`FakeGpuHost::setup`], returning the script's failure (e.g. the lock not free within
    /// [`FakeGpuHostOptions::lock_timeout`]).
    pub fn try_setup(
        vendor: FakeVendor,
        gpus: usize,
        options: &FakeGpuHostOptions,
    ) -> io::Result<Self> {
        let tmp = tempfile::Builder::new()
            .prefix("fake-gpu-host-")
            .tempdir()?;
        let dir = tmp.path().to_owned();
        let mut command = Command::new(PYTHON);
        command
            .arg(Self::script())
            .args(["setup", "--vendor", vendor.as_str(), "--gpus"])
            .arg(gpus.to_string())
            .arg("--dir")
            .arg(&dir)
            .arg("--owner-pid")
            .arg(
                options
                    .owner_pid
                    .unwrap_or_else(std::process::id)
                    .to_string(),
            );
        if let Some(names) = &options.cdi_names {
            let names: Vec<&str> = names.iter().map(|n| n.as_str()).collect();
            command.arg("--cdi-names").arg(if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(",")
            });
        }
        if let Some(cdi_dir) = &options.cdi_dir {
            command.arg("--cdi-dir").arg(cdi_dir);
        }
        if let Some(topology) = &options.topology {
            command.args(["--topology", topology]);
        }
        if let Some(name) = &options.spec_name {
            command.args(["--spec-name", name]);
        }
        if let Some(host) = &options.docker_host {
            command.args(["--docker-host", host]);
        }
        let lock = options.lock_timeout.unwrap_or(LOCK_BOUND);
        command
            .arg("--lock-timeout")
            .arg(lock.as_secs_f64().to_string());
        if let Some(state_dir) = &options.state_dir {
            command.arg("--state-dir").arg(state_dir);
        }
        if options.host_nodes {
            command.arg("--host-nodes");
        }
        let out = output_within(&mut command, lock + COMMAND_BOUND)?;
        if !out.status.success() {
            return Err(failed(
                &format!(
                    "fake_gpu_host.py setup --vendor {} --gpus {gpus}",
                    vendor.as_str()
                ),
                &out,
            ));
        }
        let record: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            io::Error::other(format!(
                "fake_gpu_host.py setup printed no record ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            ))
        })?;
        Ok(Self {
            dir,
            record,
            state_dir: options.state_dir.clone(),
            torn_down: false,
            _tmp: tmp,
        })
    }

    /// The fake host's directory (nodes under `dev/`, tools under `bin/`, `host.json`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The record the script wrote (`host.json`): vendor, GPUs, spec, images, holder.
    pub fn record(&self) -> &Value {
        &self.record
    }

    fn gpus(&self) -> &[Value] {
        self.record["gpus"].as_array().map_or(&[], Vec::as_slice)
    }

    fn gpu_strings(&self, key: &str) -> Vec<String> {
        self.gpus()
            .iter()
            .map(|g| g[key].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    /// The GPUs' UUIDs (`GPU-…`) in index order: for NVIDIA the ids the shim uses.
    pub fn uuids(&self) -> Vec<String> {
        self.gpu_strings("uuid")
    }

    /// The ids the shim gives the GPUs, in index order: NVIDIA the UUID, AMD the render node
    /// (`/dev/dri/renderD128`), Tenstorrent the index.
    pub fn ids(&self) -> Vec<String> {
        self.gpu_strings("id")
    }

    /// The GPUs' PCI bus ids as the vendor's tool prints them (`00000000:18:00.0` for
    /// NVIDIA, `0000:18:00.0` otherwise), in index order.
    pub fn bus_ids(&self) -> Vec<String> {
        self.gpu_strings("bus_id")
    }

    /// The GPUs' name, as the tool reports it (the same for all).
    pub fn gpu_name(&self) -> String {
        self.gpu_strings("name")
            .into_iter()
            .next()
            .unwrap_or_default()
    }

    /// The GPUs' memory in MiB, as the shim reads it.
    pub fn gpu_memory_mib(&self) -> u64 {
        self.gpus()
            .first()
            .and_then(|g| g["memory_mib"].as_u64())
            .unwrap_or_default()
    }

    /// The fully qualified CDI names of GPU `index` (`nvidia.com/gpu=0`,
    /// `nvidia.com/gpu=GPU-…`); empty without a spec.
    pub fn cdi_devices(&self, index: usize) -> Vec<String> {
        self.gpus()
            .get(index)
            .and_then(|g| g["cdi_devices"].as_array())
            .map(|names| {
                names
                    .iter()
                    .filter_map(|n| n.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The device nodes of GPU `index` at their real paths (`/dev/nvidia0`; AMD: card and
    /// render node).
    pub fn nodes(&self, index: usize) -> Vec<String> {
        self.gpus()
            .get(index)
            .and_then(|g| g["nodes"].as_array())
            .map(|n| {
                n.iter()
                    .filter_map(|p| p.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The CDI spec file, `None` with [`FakeGpuHostOptions::cdi_names`] `Some(vec![])` or on
    /// Tenstorrent.
    pub fn spec_path(&self) -> Option<PathBuf> {
        self.record["cdi"]["spec"].as_str().map(PathBuf::from)
    }

    /// The tool images imported (`dstackai/amd-smi:latest`, `dstackai/tt-smi:latest`).
    pub fn images(&self) -> Vec<String> {
        self.record["images"]
            .as_array()
            .map(|images| {
                images
                    .iter()
                    .filter_map(|i| i["ref"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The process that holds the lock (and tears the host down if its owner dies).
    pub fn holder_pid(&self) -> Option<u32> {
        self.record["holder_pid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
    }

    /// The argv prefix that runs a command inside the fake host:
    /// `python3 <script> exec --dir <dir> --`. The command keeps the prefix's process id (each
    /// step `exec`s the next), so signals reach it.
    pub fn exec_prefix(&self) -> Vec<String> {
        vec![
            PYTHON.to_owned(),
            Self::script().to_string_lossy().into_owned(),
            "exec".to_owned(),
            "--dir".to_owned(),
            self.dir.to_string_lossy().into_owned(),
            "--".to_owned(),
        ]
    }

    /// A command that runs `program` inside the fake host (add its arguments).
    pub fn command(&self, program: &str) -> Command {
        let prefix = self.exec_prefix();
        let mut command = Command::new(&prefix[0]);
        command.args(&prefix[1..]).arg(program);
        command
    }

    /// Runs `argv` inside the fake host (bounded by [`COMMAND_BOUND`]); its output whatever its
    /// exit status.
    pub fn exec(&self, argv: &[&str]) -> Output {
        let (program, args) = argv.split_first().expect("a command");
        output_within(self.command(program).args(args), COMMAND_BOUND)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `argv` inside the fake host, which must exit 0; its stdout.
    pub fn exec_ok(&self, argv: &[&str]) -> String {
        let out = self.exec(argv);
        if !out.status.success() {
            panic!(
                "{}",
                failed(&format!("{argv:?} in the fake GPU host"), &out)
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Makes `nvidia-smi -q` report `state` for NVIDIA GPU `index` from now on.
    pub fn set_health(&self, index: usize, state: FakeHealth) {
        let mut command = Command::new(PYTHON);
        command
            .arg(Self::script())
            .args(["set-health", "--dir"])
            .arg(&self.dir)
            .arg("--gpu")
            .arg(index.to_string())
            .arg(state.as_str());
        let out = output_within(&mut command, COMMAND_BOUND).unwrap_or_else(|e| panic!("{e}"));
        if !out.status.success() {
            panic!("{}", failed("fake_gpu_host.py set-health", &out));
        }
    }

    /// Removes everything the host made (spec, images, nodes, its directory) and releases the
    /// lock; the error says what was left.
    pub fn teardown(mut self) -> io::Result<()> {
        self.torn_down = true;
        self.run_teardown()
    }

    fn run_teardown(&self) -> io::Result<()> {
        let mut command = Command::new(PYTHON);
        command
            .arg(Self::script())
            .args(["teardown", "--dir"])
            .arg(&self.dir);
        if let Some(state_dir) = &self.state_dir {
            command.arg("--state-dir").arg(state_dir);
        }
        let out = output_within(&mut command, COMMAND_BOUND)?;
        if out.status.success() {
            Ok(())
        } else {
            Err(failed("fake_gpu_host.py teardown", &out))
        }
    }
}

impl Drop for FakeGpuHost {
    #[allow(
        clippy::print_stderr,
        reason = "a clean-up that fails says so; the test's own failure matters more"
    )]
    fn drop(&mut self) {
        if !self.torn_down
            && let Err(e) = self.run_teardown()
        {
            eprintln!("fake GPU host teardown: {e}");
        }
    }
}

/// A container's output and exit status.
#[derive(Debug, Clone)]
pub struct ContainerRun {
    /// Its exit code.
    pub exit_code: i64,
    /// Its output (a TTY's: stdout and stderr together, `\r` removed).
    pub output: String,
}

/// Runs `cmd` in a new container of `image` through the engine API at `socket` with the CDI
/// devices `devices` requested as the shim requests them (`HostConfig.DeviceRequests:
/// [{"Driver": "cdi", "DeviceIDs": devices}]`), without network and with a TTY; waits
/// (bounded) for its exit and removes it, however this ends. An engine that refuses the
/// request (no CDI, an unknown device) is an error with its message.
pub fn run_with_cdi_devices(
    socket: &Path,
    image: &str,
    devices: &[&str],
    cmd: &[&str],
) -> io::Result<ContainerRun> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = format!("fake-gpu-host-{}-{nanos}", std::process::id());
    let mut host_config = json!({"NetworkMode": "none"});
    if !devices.is_empty() {
        host_config["DeviceRequests"] = json!([{"Driver": "cdi", "DeviceIDs": devices}]);
    }
    let create = Request::post(&format!("/containers/create?name={name}"))
        .json(&json!({
            "Image": image,
            "Cmd": cmd,
            "Tty": true,
            "HostConfig": host_config,
        }))
        .send_unix(socket)?;
    if create.status != 201 {
        return Err(io::Error::other(format!(
            "create a container with CDI devices {devices:?}: {} {}",
            create.status, create.body
        )));
    }
    // Removed however this ends (the name is ours alone).
    struct Remove<'a>(&'a Path, String);
    impl Drop for Remove<'_> {
        fn drop(&mut self) {
            let _ = Request::new("DELETE", &format!("/containers/{}?force=true", self.1))
                .send_unix(self.0);
        }
    }
    let _remove = Remove(socket, name.clone());
    let start = Request::post(&format!("/containers/{name}/start")).send_unix(socket)?;
    if start.status != 204 {
        return Err(io::Error::other(format!(
            "start the container with CDI devices {devices:?}: {} {}",
            start.status, start.body
        )));
    }
    let wait = Request::post(&format!("/containers/{name}/wait"))
        .timeout(COMMAND_BOUND)
        .send_unix(socket)?;
    let exit_code = wait
        .json()
        .ok()
        .and_then(|v| v["StatusCode"].as_i64())
        .ok_or_else(|| {
            io::Error::other(format!(
                "wait for the container: {} {}",
                wait.status, wait.body
            ))
        })?;
    let logs = Request::get(&format!("/containers/{name}/logs?stdout=true&stderr=true"))
        .send_unix(socket)?;
    if logs.status != 200 {
        return Err(io::Error::other(format!(
            "the container's logs: {} {}",
            logs.status, logs.body
        )));
    }
    Ok(ContainerRun {
        exit_code,
        output: logs.body.replace('\r', ""),
    })
}
