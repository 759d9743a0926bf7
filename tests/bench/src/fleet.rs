//! The two fleets the bench compares: tasks of a `dstack-shim` process (its API) and raw
//! containers of the same image made through the Engine API, both running the same cheap
//! runner, and what is read about them (dockerd's CPU time, FIFO exits).

use std::os::unix::fs::PermissionsExt as _;

use fs_err::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, Result, bail};
use bollard::models::{ContainerCreateBody, HostConfig, PortBinding};
use serde_json::{Value, json};
use shim_e2e::harness::{self, Api, ContainerSweeper, Request, ShimProcess};

use super::raw::{self, Docker};
use super::stream::Events;
use shim_e2e::harness::procs;

/// The bench runner, bind-mounted as the runner into shim tasks and raw containers alike: it
/// waits at no cost (a blocking read of a FIFO in its temp dir, the task's runner directory)
/// until the bench writes an exit code into it. It never listens on a port, so any number of
/// them run in host network mode.
const RUNNER: &str = r#"#!/bin/sh
# dstack-shim bench runner: waits, costing nothing, for a line on <temp-dir>/exit.fifo and
# exits with it.
temp_dir=/tmp/runner
while [ $# -gt 0 ]; do
    case "$1" in
        --temp-dir) temp_dir="$2"; shift 2 ;;
        *) shift ;;
    esac
done
mkdir -p "$temp_dir"
[ -p "$temp_dir/exit.fifo" ] || mkfifo "$temp_dir/exit.fifo"
read -r code < "$temp_dir/exit.fifo"
exit "${code:-0}"
"#;

/// Where the runner is mounted in containers (as the shim mounts it).
const RUNNER_IN_CONTAINER: &str = shim_e2e::RUNNER_PATH_IN_CONTAINER;
/// The label of the bench's raw containers (value: the run's id).
pub const RAW_LABEL: &str = "dev.dstack-shim.bench";
/// How long any single wait of the bench may take (a bound, never a goal).
pub const BOUND: Duration = Duration::from_secs(120);
/// How long the shim's event stream may stay silent (no bound worth the name: a day).
const EVENTS_IDLE: Duration = Duration::from_secs(24 * 3600);

/// The scratch space of one bench run: the runner script, shim homes, raw containers'
/// runner directories. Its raw containers are removed when it is dropped.
pub struct Scratch {
    // Dropped first: the raw containers go before their directories.
    _raw_sweeper: ContainerSweeper,
    dir: tempfile::TempDir,
    /// The run's id (in container names and the raw label).
    pub run: String,
    /// The bench runner script.
    pub runner: PathBuf,
    /// The raw Docker client.
    pub docker: Docker,
}

impl Scratch {
    /// A new scratch directory under the target directory, with the runner script.
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("xtask-bench-")
            .tempdir_in(harness::target_dir())?;
        // Containers run the runner as root from a bind mount: it must be readable by all.
        fs_err::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let runner = dir.path().join("bench-runner");
        fs_err::write(&runner, RUNNER)?;
        fs_err::set_permissions(&runner, std::fs::Permissions::from_mode(0o755))?;
        let run = format!("xb{}", std::process::id());
        Ok(Self {
            _raw_sweeper: ContainerSweeper::for_label(RAW_LABEL, &run),
            dir,
            run,
            runner,
            docker: Docker::connect()?,
        })
    }

    /// A path in the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A raw container like a shim task of network `mode` (`host` or `bridge`), named
    /// `<run>-raw-<name>`: the test image, the runner bind-mounted, its own runner directory,
    /// the runner ports published on 127.0.0.1 in bridge mode. Created, not started.
    pub fn raw_create(&self, name: &str, mode: &str) -> Result<RawContainer> {
        let dir = self.path("raw").join(name);
        fs_err::create_dir_all(&dir)?;
        let body = create_body(&self.runner, &dir, &self.run, mode);
        let id = self
            .docker
            .create(&format!("{}-raw-{name}", self.run), body)?;
        Ok(RawContainer { id, dir })
    }

    /// Removes every raw container of this run, 4 at a time.
    pub fn raw_remove_all(&self) -> Result<usize> {
        self.docker.remove_all(RAW_LABEL, &self.run, 4)
    }
}

/// A raw container of the bench.
#[derive(Debug, Clone)]
pub struct RawContainer {
    /// Its id.
    pub id: String,
    /// Its runner directory on the host.
    pub dir: PathBuf,
}

/// The create body of a raw container of run `run` in network `mode`: what the shim gives a
/// task (the test image, `/bin/sh -c` running the runner bind-mounted from `runner`, the
/// runner directory `dir` at `/tmp/runner`, in bridge mode the runner's ports published on
/// 127.0.0.1), labelled as the run's.
fn create_body(runner: &Path, dir: &Path, run: &str, mode: &str) -> ContainerCreateBody {
    // In bridge mode the runner's ports, published on 127.0.0.1 (a free port each).
    let ports = (mode == "bridge").then_some(["10022/tcp", "10999/tcp"]);
    ContainerCreateBody {
        image: Some(shim_e2e::image()),
        entrypoint: Some(vec!["/bin/sh".to_owned(), "-c".to_owned()]),
        cmd: Some(vec![format!(
            "{RUNNER_IN_CONTAINER} --log-level 4 start --temp-dir /tmp/runner"
        )]),
        labels: Some([(RAW_LABEL.to_owned(), run.to_owned())].into()),
        exposed_ports: ports.map(|ports| ports.map(str::to_owned).to_vec()),
        host_config: Some(HostConfig {
            network_mode: Some(mode.to_owned()),
            binds: Some(vec![
                format!("{}:{RUNNER_IN_CONTAINER}:ro", runner.display()),
                format!("{}:/tmp/runner", dir.display()),
            ]),
            port_bindings: ports.map(|ports| {
                ports
                    .iter()
                    .map(|p| {
                        let binding = PortBinding {
                            host_ip: Some("127.0.0.1".to_owned()),
                            host_port: Some(String::new()),
                        };
                        ((*p).to_owned(), Some(vec![binding]))
                    })
                    .collect()
            }),
            ..HostConfig::default()
        }),
        ..ContainerCreateBody::default()
    }
}

/// Writes `code` into the runner's FIFO in `dir` once the runner waits on it (bounded).
pub fn trigger_exit(dir: &Path, code: i32) -> Result<()> {
    let fifo = dir.join("exit.fifo");
    let started = Instant::now();
    loop {
        // Non-blocking: fails with ENXIO until the runner has opened the FIFO for reading.
        let opened = fs_err::OpenOptions::new()
            .write(true)
            .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
            .open(&fifo);
        match opened {
            Ok(mut file) => {
                use std::io::Write as _;
                file.write_all(format!("{code}\n").as_bytes())?;
                return Ok(());
            }
            Err(_) if started.elapsed() < BOUND => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => bail!("the runner never waited on {}: {e}", fifo.display()),
        }
    }
}

/// A `dstack-shim` of the bench on its own home (its containers are swept when dropped).
pub struct BenchShim {
    binary: PathBuf,
    /// Its home.
    pub home: PathBuf,
    log: PathBuf,
    port: u16,
    args: Vec<String>,
    process: Option<ShimProcess>,
    _sweeper: ContainerSweeper,
}

impl BenchShim {
    /// A shim on the new home `<scratch>/<name>`, started with the bench runner.
    pub fn start(binary: &Path, scratch: &Scratch, name: &str) -> Result<Self> {
        Self::start_at(binary, scratch, name, scratch.path(name))
    }

    /// A shim on the new home `home` (anywhere; the caller removes it after the shim is
    /// dropped), logging to `<scratch>/<name>.log`, started with the bench runner.
    pub fn start_at(binary: &Path, scratch: &Scratch, name: &str, home: PathBuf) -> Result<Self> {
        fs_err::create_dir_all(&home)?;
        let mut shim = Self {
            binary: binary.to_owned(),
            log: scratch.path(&format!("{name}.log")),
            port: harness::free_port()?,
            args: vec![
                "--runner-binary-path".to_owned(),
                scratch.runner.display().to_string(),
                "--shim-log-level".to_owned(),
                "3".to_owned(),
            ],
            process: None,
            _sweeper: ContainerSweeper::for_home(&home),
            home,
        };
        shim.spawn()?;
        shim.wait_answering()?;
        Ok(shim)
    }

    /// Starts the process (after a kill or stop) without waiting for it.
    pub fn spawn(&mut self) -> Result<()> {
        anyhow::ensure!(self.process.is_none(), "the shim already runs");
        self.process = Some(ShimProcess::spawn(
            &self.binary,
            &self.home,
            self.port,
            &self.args,
            &self.log,
        )?);
        Ok(())
    }

    /// Starts the process unless it runs, and waits until it answers.
    pub fn ensure_running(&mut self) -> Result<()> {
        if self.process.is_none() {
            self.spawn()?;
        }
        self.wait_answering()
    }

    fn process(&self) -> Result<&ShimProcess> {
        self.process.as_ref().context("the shim is not running")
    }

    /// Waits until the healthcheck answers.
    pub fn wait_answering(&mut self) -> Result<()> {
        let process = self.process.as_mut().context("the shim is not running")?;
        process.wait_answering(BOUND, Duration::from_millis(2))?;
        Ok(())
    }

    /// Its API.
    pub fn api(&self) -> Api {
        Api {
            addr: std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, self.port)),
        }
    }

    /// Its task changes (`GET /api/events`), each stamped when it arrives.
    pub fn events(&self) -> Result<Events> {
        let path = "/api/events";
        let streamed = Request::get(path)
            .timeout(EVENTS_IDLE)
            .open(self.api().addr)?;
        Events::sse(streamed, path)
    }

    /// Its pid.
    pub fn pid(&self) -> Result<u32> {
        Ok(self.process()?.pid())
    }

    /// Its RSS in KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        Ok(self.process()?.rss_kib()?)
    }

    /// Its peak RSS in KiB (`VmHWM`: the most it held since it started).
    pub fn rss_peak_kib(&self) -> Result<u64> {
        let path = format!("/proc/{}/status", self.pid()?);
        fs_err::read_to_string(&path)?
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .with_context(|| format!("no VmHWM in {path}"))
    }

    /// SIGKILL.
    pub fn kill(&mut self) -> Result<()> {
        self.process
            .take()
            .context("the shim is not running")?
            .kill()?;
        Ok(())
    }

    /// SIGTERM and wait for a clean exit (containers keep running); nothing if it is not
    /// running.
    pub fn stop(&mut self) -> Result<()> {
        let Some(process) = self.process.take() else {
            return Ok(());
        };
        process.sigterm()?;
        let status = process.wait_exit(BOUND)?;
        anyhow::ensure!(status.success(), "dstack-shim exited with {status}");
        Ok(())
    }

    /// Submits task `id` in network `mode`.
    pub fn submit(&self, id: &str, mode: &str) -> Result<()> {
        let config =
            json!({"id": id, "name": id, "image_name": shim_e2e::image(), "network_mode": mode});
        self.api().post("/api/tasks", &config)?;
        Ok(())
    }

    /// Polls the task every `every` until it is `running` (bounded); its TaskInfo.
    pub fn wait_running(&self, id: &str, every: Duration) -> Result<Value> {
        self.wait_status(id, "running", every).map(|(info, _)| info)
    }

    /// Polls the task every `every` until its status is `status` (bounded by [`BOUND`]); its
    /// TaskInfo and when that was first seen.
    pub fn wait_status(
        &self,
        id: &str,
        status: &str,
        every: Duration,
    ) -> Result<(Value, SystemTime)> {
        Ok(self.api().wait_status(id, status, every, BOUND)?)
    }

    /// The task's runner directory on the host.
    pub fn runner_dir(&self, info: &Value) -> PathBuf {
        harness::runner_dir(&self.home, info)
    }

    /// Terminates (timeout 0) and removes the task, retrying the remove while its start or
    /// release is in flight (bounded by [`BOUND`]).
    pub fn finish(&self, id: &str) -> Result<()> {
        Ok(self.api().finish(id, "terminated_by_user", "", BOUND)?)
    }

    /// How many tasks the list shows, and how many of them are running.
    pub fn counts(&self) -> Result<(usize, usize)> {
        let list = self.api().list()?;
        let running = list.values().filter(|s| *s == "running").count();
        Ok((list.len(), running))
    }
}

/// A diagnostic shim whose home is a new directory on tmpfs (in `/dev/shm`): its durable
/// writes cost no disk flush. The shim goes (its containers swept) before its home is removed.
pub struct TmpfsShim {
    /// The shim.
    pub shim: BenchShim,
    _home: tempfile::TempDir,
}

impl TmpfsShim {
    /// Starts one logging to `<scratch>/<name>.log`; `None` (with a printed note) where
    /// `/dev/shm` is not a tmpfs.
    pub fn start(binary: &Path, scratch: &Scratch, name: &str) -> Result<Option<Self>> {
        let home = match Self::home() {
            Ok(home) => home,
            Err(e) => {
                println!("(no shim home on tmpfs, its diagnostic is not measured: {e:#})");
                return Ok(None);
            }
        };
        let shim = BenchShim::start_at(binary, scratch, name, home.path().join("home"))?;
        Ok(Some(Self { shim, _home: home }))
    }

    fn home() -> Result<tempfile::TempDir> {
        let mounts = fs_err::read_to_string("/proc/mounts")?;
        let shm = mounts.lines().any(|line| {
            let mut fields = line.split_whitespace().skip(1);
            fields.next() == Some("/dev/shm") && fields.next() == Some("tmpfs")
        });
        anyhow::ensure!(shm, "/dev/shm is not a tmpfs");
        let dir = tempfile::Builder::new()
            .prefix("xtask-bench-home-")
            .tempdir_in("/dev/shm")?;
        // Containers read the runner directory below it as root; the mode only has to let
        // them in.
        fs_err::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        Ok(dir)
    }
}

/// The second shim of the diagnostic rows: by default a [`TmpfsShim`] (durable writes that
/// cost no disk flush); with `SHIM_BENCH_BASELINE=PATH`, another build of the shim (an
/// earlier commit's) on a disk home, so that a before/after runs interleaved with this build
/// and raw Docker on the same daemon in the same minutes.
pub struct SecondShim {
    /// The shim.
    pub shim: BenchShim,
    _home: Option<tempfile::TempDir>,
    /// What its rows say it is (`shim home on tmpfs`, `baseline build`).
    pub label: &'static str,
    /// Its rows' key suffix (`tmpfs_home`, `baseline`).
    pub key: &'static str,
    /// Its name in progress lines.
    pub short: &'static str,
    /// The prefix of its task ids.
    pub prefix: &'static str,
}

impl SecondShim {
    /// Starts the second shim (logging to `<scratch>/<name>.log`); `None` with a note where
    /// neither can run.
    pub fn start(binary: &Path, scratch: &Scratch, name: &str) -> Result<Option<Self>> {
        if let Some(baseline) = std::env::var_os("SHIM_BENCH_BASELINE") {
            let baseline = PathBuf::from(baseline);
            anyhow::ensure!(
                baseline.is_file(),
                "SHIM_BENCH_BASELINE: no file {}",
                baseline.display()
            );
            let shim = BenchShim::start(&baseline, scratch, name)?;
            return Ok(Some(Self {
                shim,
                _home: None,
                label: "baseline build",
                key: "baseline",
                short: "baseline shim",
                prefix: "base",
            }));
        }
        Ok(TmpfsShim::start(binary, scratch, name)?.map(|t| Self {
            shim: t.shim,
            _home: Some(t._home),
            label: "shim home on tmpfs",
            key: "tmpfs_home",
            short: "shim (tmpfs home)",
            prefix: "tmpfs",
        }))
    }
}

/// Watches a shim's task changes so that many clients can wait for their tasks to run without
/// polling the API: on a small machine, sixteen clients polling every few milliseconds would
/// take the CPU Docker needs, and the raw fleet's clients do not poll either (their start
/// returns when the container runs). One thread reads the shim's `GET /api/events` stream and
/// wakes every waiting client on each change, so a client learns of its task as soon as the
/// stream says so. (Until 2026-12-01 the waiting clients took turns reading the stream under a
/// lock in 20 ms slices; a client whose task ran had to wait for the reader's slice to end, a
/// few ms per task at concurrency 4, which the tasks/s figures counted against the shim.)
pub struct Watcher {
    shared: Arc<(Mutex<WatchState>, Condvar)>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct WatchState {
    running: std::collections::HashSet<String>,
    /// Why the stream ended, once it has.
    ended: Option<String>,
}

impl Watcher {
    /// Starts watching `shim` (its event stream opens now, before any submit).
    pub fn new(shim: &BenchShim) -> Result<Self> {
        let events = shim.events()?;
        let shared = Arc::new((Mutex::new(WatchState::default()), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::spawn(move || Self::read(&events, &shared, &stop))
        };
        Ok(Self {
            shared,
            stop,
            reader: Some(reader),
        })
    }

    /// The reader thread: records every task the stream says is running and wakes the waiters.
    fn read(events: &Events, shared: &(Mutex<WatchState>, Condvar), stop: &AtomicBool) {
        let (state, changed) = shared;
        while !stop.load(Ordering::Relaxed) {
            let event = events.next(Duration::from_millis(50));
            let Ok(mut st) = state.lock() else { return };
            match event {
                Ok(Some((event, _))) => {
                    if event["change"] == "status"
                        && event["status"] == "running"
                        && let Some(task) = event["task"].as_str()
                    {
                        st.running.insert(task.to_owned());
                    }
                    // A subscriber that lagged gets a snapshot of every task instead.
                    for t in event["tasks"].as_array().into_iter().flatten() {
                        if t["status"] == "running"
                            && let Some(task) = t["id"].as_str()
                        {
                            st.running.insert(task.to_owned());
                        }
                    }
                }
                Ok(None) => continue,
                Err(e) => {
                    st.ended = Some(format!("{e:#}"));
                    changed.notify_all();
                    return;
                }
            }
            changed.notify_all();
        }
    }

    /// Waits (bounded) until the stream says task `id` is running.
    pub fn wait_running(&self, id: &str) -> Result<()> {
        let started = Instant::now();
        let (state, changed) = &*self.shared;
        let mut st = state
            .lock()
            .map_err(|_| anyhow::anyhow!("the watcher failed"))?;
        loop {
            if st.running.contains(id) {
                return Ok(());
            }
            if let Some(why) = &st.ended {
                bail!("the shim's event stream ended before task {id} ran: {why}");
            }
            let Some(left) = BOUND.checked_sub(started.elapsed()) else {
                bail!("task {id} not running after {BOUND:?}");
            };
            st = changed
                .wait_timeout(st, left)
                .map_err(|_| anyhow::anyhow!("the watcher failed"))?
                .0;
        }
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(reader) = self.reader.take() {
            // It ends within one 50 ms slice; a panic in it has nothing left to report.
            let _ = reader.join();
        }
    }
}

/// CPU time of a process in seconds (user + system, all threads, from `/proc/<pid>/stat`).
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/stat");
    let stat = fs_err::read_to_string(&path)?;
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // After the command: state (field 3) is index 0, utime (14) index 11, stime (15) index 12.
    let ticks = |i: usize| -> Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("bad {path}: {stat:?}"))
    };
    Ok((ticks(11)? + ticks(12)?) as f64 / clock_ticks())
}

/// The resolution of [`cpu_seconds`].
pub fn tick_seconds() -> f64 {
    1.0 / clock_ticks()
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on Linux).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        procs::output(std::process::Command::new("getconf").arg("CLK_TCK"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The pid of the Docker daemon the bench uses: the `dockerd` whose command line names the
/// socket of `DOCKER_HOST`, or, for the default socket, the one started without a socket or
/// pid file of its own ([`procs::default_dockerds`]).
pub fn dockerd_pid() -> Result<u32> {
    let socket = raw::socket_path();
    let pids: Vec<u32> = if raw::private_daemon() {
        procs::find("dockerd", Some(&socket.to_string_lossy()))
    } else {
        // Not every dockerd naming the default socket: the conformance engines and the tests'
        // private daemons name sockets and pid files of their own.
        procs::default_dockerds()
    };
    match pids.as_slice() {
        [pid] => Ok(*pid),
        [] => bail!("no dockerd process serves {}", socket.display()),
        more => bail!(
            "several dockerd processes serve {}: {more:?}",
            socket.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_of_this_process_grows() {
        let me = std::process::id();
        let before = cpu_seconds(me).unwrap();
        let started = Instant::now();
        let mut x = 0u64;
        while started.elapsed() < Duration::from_millis(100) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        // 100 ms of spinning is ten 10 ms ticks: the counter moved.
        assert!(cpu_seconds(me).unwrap() > before);
    }

    #[test]
    fn raw_containers_get_the_settings_of_a_shim_task() {
        let body = |mode| {
            let body = create_body(Path::new("/s/runner"), Path::new("/s/raw/a"), "xb1", mode);
            serde_json::to_value(body).unwrap()
        };
        let host = json!({
            "Image": shim_e2e::image(),
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": [format!("{RUNNER_IN_CONTAINER} --log-level 4 start --temp-dir /tmp/runner")],
            "Labels": {RAW_LABEL: "xb1"},
            "HostConfig": {
                "NetworkMode": "host",
                "Binds": [format!("/s/runner:{RUNNER_IN_CONTAINER}:ro"), "/s/raw/a:/tmp/runner"],
            },
        });
        assert_eq!(body("host"), host);
        let mut bridge = host;
        let binding = json!([{"HostIp": "127.0.0.1", "HostPort": ""}]);
        bridge["ExposedPorts"] = json!({"10022/tcp": {}, "10999/tcp": {}});
        bridge["HostConfig"]["NetworkMode"] = json!("bridge");
        bridge["HostConfig"]["PortBindings"] = json!({"10022/tcp": binding, "10999/tcp": binding});
        assert_eq!(body("bridge"), bridge);
    }

    #[test]
    fn the_runner_exits_with_what_is_written_to_its_fifo() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("runner");
        fs_err::write(&script, RUNNER).unwrap();
        let temp = dir.path().join("temp");
        let child = std::process::Command::new("sh")
            .arg(&script)
            .args(["--log-level", "4", "start", "--temp-dir"])
            .arg(&temp)
            .spawn()
            .unwrap();
        trigger_exit(&temp, 7).unwrap();
        let status = child.wait_with_output().unwrap().status;
        assert_eq!(status.code(), Some(7));
    }
}
