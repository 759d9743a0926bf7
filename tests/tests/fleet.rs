//! The dstack server's whole fleet path, as an operator runs it (issue 22): a real dstack
//! server (PyPI `dstack[server]`, the venv of `cargo xtask dev-env`) provisions an SSH fleet on
//! this machine and runs jobs through the shim's release artifact.
//!
//! - The host is `root@127.0.0.1`, Debian's `sshd` on a free loopback port with keys of the
//!   test's own (the client key authorized by `AuthorizedKeysFile`, never in `/root/.ssh`). The
//!   server provisions it as any host: keys into `~/.ssh/authorized_keys`, the shim `curl`ed
//!   from `DSTACK_SHIM_DOWNLOAD_URL` (a `file://` URL of the release layout), `shim.env`, the
//!   unit, `systemctl restart`, `host_info.json`, the healthcheck.
//! - No systemd as PID 1: `tests/fleet/systemctl.py` stands in for `systemctl`, honouring the
//!   unit (`EnvironmentFile`, `ExecStart`, `Restart=always`, `RestartSec=3`). sshd runs in a
//!   mount namespace where test directories cover `/usr/local/sbin` (first in sudo's
//!   `secure_path`: the stand-in) and `/etc/systemd/system` (the unit): the host's stay as
//!   they are.
//! - The runner is `shim-test-runner` (`tests/runner`), served over HTTP on loopback as
//!   `DSTACK_RUNNER_DOWNLOAD_URL`; it runs the job's commands with the image's busybox `sh`.
//! - Jobs (`dstack apply -d`; `user:` and `resources.cpu.arch` set so the server reads no
//!   registry): one ends `done`, one `failed` with its exit code, one is stopped with `dstack
//!   stop`, and during one the shim is SIGKILLed and restarted by the stand-in (the job ends
//!   `done` in the same, never restarted, container). Then `dstack fleet delete`.
//! - Asserted from the server's side (statuses, termination reasons, exit codes, logs, events;
//!   no warning or error in its log) and the host's: no task container, runner directory or
//!   shim line in `authorized_keys` is left.
//!
//! The shim's home, binaries and ports are the fixed ones of the server's unit (`/root/.dstack`,
//! `/usr/local/bin`, 10998, 10999, 10022): the test refuses to run where one is taken, runs
//! one at a time per machine, and undoes what it made (also what a killed run left:
//! `/var/lib/dstack-shim-dev/fleet-test`). It prints the time to an idle instance and each
//! job's submit → `running`, from the server's events.
//!
//! Run: `SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1 cargo nextest run -p shim-e2e --test fleet
//! --run-ignored all` after `cargo xtask dev-env` and `cargo xtask dist`.
//!
//! upstream: src/dstack/_internal/server/services/ssh_fleets/provisioning.py (every
//! provisioning step, the unit, shim.env), .../background/pipeline_tasks/instances/ssh_deploy.py
//! (their order), .../core/backends/base/compute.py (the download URLs, the pre-start
//! commands), .../background/pipeline_tasks/jobs_running.py and jobs_terminating.py (submit,
//! runner, pull, stop, terminate, remove), .../services/runner/client.py (the 9 s timeouts).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    reason = "test code: a failed unwrap is a failed test; figures and logs go to stderr"
)]

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use base64::{Engine as _, engine::general_purpose::STANDARD as BASE64};
use serde_json::{Value, json};
use shim_e2e::harness::gpu_host::output_within;
use shim_e2e::harness::{
    Api, ContainerSweeper, KEY_MARKER, LABEL_OWNER, Request, build_test_runner, free_port,
    open_log, owner_identity, tail, target_dir, task_entries, wait_for, wait_until,
};
use shim_e2e::{
    DSTACK_VERSION, dist_artifact, docker_ok, dstack_python, go_arch, image, repo_root,
    require_docker, require_root,
};

/// The shim's home, binary and the runner's binary, as the server's unit and `shim.env` have
/// them (upstream: core/backends/base/compute.py, get_dstack_working_dir & co).
const SHIM_HOME: &str = "/root/.dstack";
const SHIM_INSTALLED: &str = "/usr/local/bin/dstack-shim";
const RUNNER_INSTALLED: &str = "/usr/local/bin/dstack-runner";
const SSH_DIR: &str = "/root/.ssh";
const AUTHORIZED_KEYS: &str = "/root/.ssh/authorized_keys";
/// The fixed ports of the shim and the runner (upstream: core/consts.py).
const FIXED_PORTS: [u16; 3] = [10998, 10999, 10022];
const SHIM_PORT: u16 = 10998;
/// Where sshd wants its privilege separation directory (made by its service unit elsewhere).
const SSHD_RUN_DIR: &str = "/run/sshd";
/// What the test made on the host, so that a killed run is undone by the next one; its
/// existence also serialises fleet tests on one machine.
const CLAIM_DIR: &str = "/var/lib/dstack-shim-dev/fleet-test";
const UNIT: &str = "dstack-shim.service";
const TOKEN: &str = "shim-fleet-test-admin-token";
const PROJECT: &str = "main";
const FLEET: &str = "shim-fleet-test";
/// Makes the test runner exit after the last pull.
const EXIT_AFTER_PULL: &str = "SHIM_TEST_RUNNER_EXIT_AFTER_PULL";

/// Bounds of the waits (never timed assertions: generous, only there so a hang fails).
const SERVER_START_BOUND: Duration = Duration::from_secs(180);
const FLEET_BOUND: Duration = Duration::from_secs(300);
const JOB_BOUND: Duration = Duration::from_secs(300);
const CLI_BOUND: Duration = Duration::from_secs(300);
const DAEMON_STOP_GRACE: Duration = Duration::from_secs(20);

// ---- Processes

/// The fields of `/proc/<pid>/stat` after the process's name, from field 3 (its state) on;
/// `None` if there is no such process.
fn stat(pid: u32) -> Option<Vec<String>> {
    let stat = fs_err::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = stat.rsplit_once(')')?.1;
    Some(after_name.split_whitespace().map(str::to_owned).collect())
}

/// The start time of process `pid` (field 22), which tells a process from a later one that
/// reuses its id.
fn proc_start(pid: u32) -> Option<u64> {
    stat(pid)?.get(19)?.parse().ok()
}

/// Whether `pid` runs (a zombie does not).
fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|fields| fields.first().is_some_and(|state| state != "Z"))
}

/// Sends `signal` to `target` (a pid, or `-pgid` for a process group) with `kill(1)`.
fn kill(signal: &str, target: &str) {
    let mut command = Command::new("kill");
    let _ = output_within(
        command.args(["-s", signal, "--", target]),
        DAEMON_STOP_GRACE,
    );
}

/// A background process of the test in a process group of its own (its log in a file),
/// recorded in the claim so that a killed run's next run ends it; dropped, the group gets
/// SIGTERM, then SIGKILL after a grace period.
struct Daemon {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Daemon {
    fn spawn(name: &'static str, mut command: Command, log: &Path, claim: &Claim) -> Self {
        let out = || Stdio::from(open_log(log).unwrap());
        command.stdin(Stdio::null()).stdout(out()).stderr(out());
        let child = command.process_group(0).spawn();
        let child = child.unwrap_or_else(|e| panic!("cannot start {name} ({command:?}): {e}"));
        claim.record_pid(child.id(), name);
        let log = log.to_owned();
        Self { name, child, log }
    }

    /// Fails the test (with the end of its log) if it has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            let (name, log) = (self.name, self.log.display());
            panic!(
                "{name} exited ({status}); end of {log}:\n{}",
                tail(&self.log, 40)
            );
        }
    }

    /// Waits until it listens on loopback `port` (fails the test if it exits).
    fn wait_listening(&mut self, port: u16) {
        let what = format!("{} listens", self.name);
        wait_until(&what, Duration::from_secs(30), || {
            self.assert_running();
            TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok()
        });
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_some()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.exited() {
            return;
        }
        let group = format!("-{}", self.child.id());
        kill("TERM", &group);
        let started = Instant::now();
        while !self.exited() && started.elapsed() < DAEMON_STOP_GRACE {
            std::thread::sleep(Duration::from_millis(50));
        }
        if !self.exited() {
            eprintln!("fleet: {} did not stop on SIGTERM: SIGKILL", self.name);
        }
        // Also whatever else of its group is left.
        kill("KILL", &group);
        let _ = self.child.wait();
    }
}

/// Runs `command` (no stdin, killed after `bound`) and returns its stdout; fails the test
/// unless it exits 0 (`context` is added to the message).
fn run_ok(command: &mut Command, bound: Duration, context: impl FnOnce() -> String) -> String {
    let out = output_within(command, bound);
    let out = out.unwrap_or_else(|e| panic!("{e}"));
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    let status = out.status;
    assert!(
        status.success(),
        "{command:?}: {status}\n{stdout}\n{stderr}{}",
        context()
    );
    stdout
}

/// [`run_ok`] of `program args`.
fn run(program: impl AsRef<OsStr>, args: &[&str]) -> String {
    let bound = Duration::from_secs(120);
    run_ok(Command::new(program).args(args), bound, String::new)
}

fn port_free(port: u16) -> bool {
    let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let answers = || TcpStream::connect_timeout(&loopback, Duration::from_millis(300)).is_ok();
    TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).is_ok() && !answers()
}

fn write_file(path: &Path, content: &str, mode: u32) {
    fs_err::write(path, content).unwrap();
    fs_err::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

// ---- The claim on the host: what the test makes outside its temporary directory, undone
// however the test ends (and by the next run if this one was killed)

/// The claim: [`CLAIM_DIR`] holds `owner` (this process: pid and start time), `undo` (one
/// action per line, appended before the change it undoes: `remove <path>` or `restore <path>`
/// from `saved/<n>`), `pids` (the test's daemons), and `systemd/` (the stand-in systemctl's
/// state: its supervisor's and the shim's pids).
struct Claim {
    dir: PathBuf,
}

impl Claim {
    /// Takes the claim, waiting while another fleet test holds it, and undoing what a killed
    /// earlier one left.
    fn take() -> Self {
        let dir = PathBuf::from(CLAIM_DIR);
        fs_err::create_dir_all(dir.parent().unwrap()).unwrap();
        let started = Instant::now();
        let mut said = false;
        // 0700: it holds copies of authorized_keys. Made atomically: the claim is a lock.
        while let Err(e) = std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{CLAIM_DIR}: {e}");
            // Just made by another test that has not written its owner yet?
            let age = fs_err::metadata(&dir).and_then(|m| m.modified());
            let age = age.map(|t| t.elapsed().unwrap_or_default());
            let fresh = !dir.join("owner").exists() && age.is_ok_and(|a| a.as_secs() < 30);
            if let Some(pid) = Self::live_owner(&dir) {
                if !said {
                    eprintln!("fleet: waiting for the fleet test of pid {pid} to end");
                    said = true;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(3600),
                    "the fleet test of pid {pid} holds {CLAIM_DIR} for an hour"
                );
            } else if !fresh {
                eprintln!("fleet: undoing what an earlier, killed fleet test left");
                Self::undo(&dir);
                continue;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        let me = std::process::id();
        let owner = format!("{me} {}\n", proc_start(me).unwrap_or(0));
        write_file(&dir.join("owner"), &owner, 0o600);
        fs_err::create_dir_all(dir.join("saved")).unwrap();
        fs_err::create_dir_all(dir.join("systemd")).unwrap();
        Self { dir }
    }

    /// The pid of the live process that holds the claim in `dir`, if any.
    fn live_owner(dir: &Path) -> Option<u32> {
        let owner = fs_err::read_to_string(dir.join("owner")).ok()?;
        let (pid, start) = pid_and_start(&owner)?;
        (alive(pid) && proc_start(pid) == Some(start)).then_some(pid)
    }

    fn append(&self, file: &str, line: &str) {
        use std::io::Write as _;
        let (path, mut options) = (self.dir.join(file), fs_err::OpenOptions::new());
        let mut f = options.create(true).append(true).open(path).unwrap();
        writeln!(f, "{line}").unwrap();
        f.sync_all().unwrap();
    }

    fn record_pid(&self, pid: u32, what: &str) {
        let start = proc_start(pid).unwrap_or(0);
        self.append("pids", &format!("{pid} {start} {what}"));
    }

    /// Records that `path`, which does not exist yet, is the test's: removed when undone.
    fn will_create(&self, path: &str) {
        self.append("undo", &format!("remove {path}"));
    }

    /// Records `path` as it is now (its content and mode, or its absence), to be put back.
    fn save(&self, path: &str) {
        match fs_err::metadata(path) {
            Ok(meta) if meta.is_file() => {
                let undo = fs_err::read_to_string(self.dir.join("undo"));
                let n = undo.map(|u| u.lines().count()).unwrap_or(0);
                // (`copy` copies the mode too.)
                fs_err::copy(path, self.dir.join("saved").join(n.to_string())).unwrap();
                self.append("undo", &format!("restore {path} {n}"));
            }
            Ok(_) => panic!("{path} is not a file"),
            Err(_) => self.will_create(path),
        }
    }

    /// The stand-in systemctl's state directory.
    fn systemd_dir(&self) -> PathBuf {
        self.dir.join("systemd")
    }

    /// Undoes a claim: ends its processes, removes the shim's containers, puts back what was
    /// saved and removes what was made (in reverse order), then the claim itself.
    fn undo(dir: &Path) {
        // The stand-in's supervisor and the shim it runs, then the test's daemons.
        let mut pids: Vec<(u32, Option<u64>)> = Vec::new();
        for kind in ["supervisor", "pid"] {
            let text = fs_err::read_to_string(dir.join(format!("systemd/{UNIT}.{kind}")));
            let pid = text.ok().and_then(|t| t.trim().parse().ok());
            pids.extend(pid.map(|pid| (pid, None)));
        }
        let recorded = fs_err::read_to_string(dir.join("pids")).unwrap_or_default();
        let recorded = recorded.lines().filter_map(pid_and_start);
        pids.extend(recorded.map(|(pid, start)| (pid, Some(start))));
        for (pid, start) in pids {
            // A recorded start time guards against a reused pid; the stand-in's files are
            // removed by it when its processes end, so a pid found there is still theirs.
            if alive(pid) && start.is_none_or(|s| proc_start(pid) == Some(s)) {
                kill("KILL", &format!("-{pid}"));
                kill("KILL", &pid.to_string());
            }
        }
        if Path::new(SHIM_HOME).join("owner-id").exists() {
            ContainerSweeper::for_home(Path::new(SHIM_HOME)).sweep();
        }
        let undo = fs_err::read_to_string(dir.join("undo")).unwrap_or_default();
        for line in undo.lines().rev() {
            let mut words = line.splitn(3, ' ');
            match (words.next(), words.next(), words.next()) {
                (Some("remove"), Some(path), None) => {
                    let p = Path::new(path);
                    let _ = if p.is_dir() && !p.is_symlink() {
                        fs_err::remove_dir_all(p)
                    } else {
                        fs_err::remove_file(p)
                    };
                }
                (Some("restore"), Some(path), Some(n)) => {
                    if let Some(parent) = Path::new(path).parent() {
                        let _ = fs_err::create_dir_all(parent);
                    }
                    let _ = fs_err::copy(dir.join("saved").join(n), path);
                }
                _ => eprintln!("fleet: unknown undo record {line:?}"),
            }
        }
        let _ = fs_err::remove_dir_all(dir);
    }
}

/// `<pid> <start time> …` (a claim's owner, a line of its `pids`).
fn pid_and_start(line: &str) -> Option<(u32, u64)> {
    let mut words = line.split_whitespace();
    Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
}

impl Drop for Claim {
    fn drop(&mut self) {
        Self::undo(&self.dir);
    }
}

/// Checks that the host has what the test needs and nothing it would clobber, and records
/// what it will make. Panics with what to do otherwise.
fn prepare_host(claim: &Claim) {
    for program in "sshd ssh-keygen ssh sudo curl unshare nsenter".split(' ') {
        assert!(
            shim_e2e::harness::procs::which_program(program).is_some(),
            "{program} is missing: run `cargo xtask dev-env` (it installs openssh-server, sudo \
             and curl)"
        );
    }
    for path in [SHIM_HOME, SHIM_INSTALLED, RUNNER_INSTALLED] {
        assert!(
            !Path::new(path).exists(),
            "{path} exists and was not made by the fleet test (a shim may be installed on this \
             host): the test installs the shim as the dstack server does, there; move it away \
             to run the test"
        );
    }
    for port in FIXED_PORTS {
        assert!(
            port_free(port),
            "port {port} is taken (a shim or runner may run on this host): the fleet test \
             needs the fixed ports {FIXED_PORTS:?}"
        );
    }
    for path in [SHIM_HOME, SHIM_INSTALLED, RUNNER_INSTALLED] {
        claim.will_create(path);
    }
    if Path::new(SSH_DIR).exists() {
        claim.save(AUTHORIZED_KEYS);
        claim.save(&format!("{AUTHORIZED_KEYS}.bak"));
    } else {
        claim.will_create(SSH_DIR);
    }
    if !Path::new(SSHD_RUN_DIR).exists() {
        claim.will_create(SSHD_RUN_DIR);
        make_dir(Path::new(SSHD_RUN_DIR));
    }
}

/// Makes directory `dir` (and its parents), mode 0755.
fn make_dir(dir: &Path) {
    fs_err::create_dir_all(dir).unwrap();
    fs_err::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
}

// ---- The fleet's host: sshd in a mount namespace of its own, the stand-in systemctl

struct SshHost {
    port: u16,
    /// The client key the fleet configuration names.
    identity: PathBuf,
    /// The stand-in systemctl (its real path) and its state directory.
    systemctl: PathBuf,
    systemd: PathBuf,
    /// Where the units the server writes to /etc/systemd/system land.
    units: PathBuf,
    _sshd: Daemon,
}

impl SshHost {
    fn start(dir: &Path, claim: &Claim) -> Self {
        let (sbin, units) = (dir.join("sbin"), dir.join("units"));
        make_dir(&sbin);
        make_dir(&units);
        let (host_key, identity) = (dir.join("ssh_host_ed25519_key"), dir.join("id_ed25519"));
        for (key, comment) in [
            (&host_key, "fleet-test-host"),
            (&identity, "fleet-test-client"),
        ] {
            let args = ["-q", "-t", "ed25519", "-N", "", "-C", comment, "-f"];
            run(
                "ssh-keygen",
                &[&args[..], &[key.to_str().unwrap()]].concat(),
            );
        }
        let authorized = dir.join("authorized_keys");
        let client_key = fs_err::read_to_string(identity.with_extension("pub")).unwrap();
        write_file(&authorized, &client_key, 0o600);

        // The stand-in systemctl, run by the venv's Python, with its configuration beside it.
        let systemctl = sbin.join("systemctl");
        let script = fs_err::read_to_string(repo_root().join("tests/fleet/systemctl.py")).unwrap();
        let body = script.split_once('\n').unwrap().1;
        let shebang = format!("#!{}", dstack_python().display());
        write_file(&systemctl, &format!("{shebang}\n{body}"), 0o755);
        let systemd = claim.systemd_dir();
        let mount_ns = format!("/proc/{}/ns/mnt", std::process::id());
        let json = json!({"script": systemctl, "unit_dir": units, "state_dir": systemd,
                          "mount_ns": mount_ns});
        write_file(&sbin.join("systemctl.json"), &json.to_string(), 0o644);

        let port = free_port().unwrap();
        let config = dir.join("sshd_config");
        let pid_file = dir.join("sshd.pid");
        let (key, pid_file, keys) = (host_key.display(), pid_file.display(), authorized.display());
        let sshd_config = format!(
            "ListenAddress 127.0.0.1\nPort {port}\nHostKey {key}\nPidFile {pid_file}\n\
             AuthorizedKeysFile .ssh/authorized_keys {keys}\n\
             # The test's files live under /tmp (world-writable).\nStrictModes no\n\
             PermitRootLogin prohibit-password\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nPrintMotd no\n\
             Subsystem sftp internal-sftp\n"
        );
        write_file(&config, &sshd_config, 0o644);
        // sshd checks its configuration before it daemonises: a bad one fails here, readably.
        run("/usr/sbin/sshd", &["-t", "-f", config.to_str().unwrap()]);
        let mut command = Command::new("unshare");
        command
            .args(["--mount", "--propagation", "slave", "--", "sh", "-c"])
            .arg(
                "mount --bind \"$1\" /usr/local/sbin && mount --bind \"$2\" /etc/systemd/system \
             && exec /usr/sbin/sshd -D -e -f \"$3\"",
            );
        command.arg("sh").arg(&sbin).arg(&units).arg(&config);
        let log = dir.join("sshd.log");
        let mut sshd = Daemon::spawn("the test sshd", command, &log, claim);
        sshd.wait_listening(port);
        Self {
            port,
            identity,
            systemctl,
            systemd,
            units,
            _sshd: sshd,
        }
    }

    /// Runs the stand-in systemctl here (outside the sshd's namespace: it keeps its state by
    /// real paths).
    fn systemctl(&self, args: &[&str]) -> String {
        run(&self.systemctl, args)
    }

    /// The stand-in's file `<unit>.<kind>`: `pid` (the shim's as the stand-in's supervisor
    /// started it last), `starts` (a line per start of the shim), `journal` (its output).
    fn unit_file(&self, kind: &str) -> PathBuf {
        self.systemd.join(format!("{UNIT}.{kind}"))
    }

    fn shim_pid(&self) -> Option<u32> {
        let text = fs_err::read_to_string(self.unit_file("pid")).ok();
        text.and_then(|t| t.trim().parse().ok())
    }

    fn shim_starts(&self) -> usize {
        let text = fs_err::read_to_string(self.unit_file("starts")).unwrap_or_default();
        let pid = |l: &str| l.split_whitespace().next()?.parse::<u32>().ok();
        text.lines().filter_map(pid).count()
    }
}

// ---- The dstack server

struct DstackServer {
    port: u16,
    /// Its HOME (its state in `.dstack/server`, the CLI's `.dstack/config.yml`).
    home: PathBuf,
    /// The directory the CLI runs in (the configurations).
    project: PathBuf,
    log: PathBuf,
    daemon: Daemon,
}

impl DstackServer {
    fn start(dir: &Path, claim: &Claim, env: &[(&str, String)]) -> Self {
        let home = dir.join("server-home");
        let project = dir.join("project");
        fs_err::create_dir_all(&home).unwrap();
        fs_err::create_dir_all(&project).unwrap();
        let port = free_port().unwrap();
        let mut command = dstack(&home, &home);
        command
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--token", TOKEN, "--log-level", "DEBUG"])
            .env("DSTACK_SERVER_LOG_FORMAT", "standard")
            // Its log's times are compared with the test's clock.
            .env("TZ", "UTC")
            .env("DSTACK_SERVER_LOG_LEVEL", "DEBUG")
            .envs(env.iter().map(|(k, v)| (k, v)));
        let log = dir.join("server.log");
        let mut daemon = Daemon::spawn("the dstack server", command, &log, claim);
        let healthcheck = Request::get("/healthcheck").timeout(Duration::from_secs(5));
        wait_until("the dstack server answers", SERVER_START_BOUND, || {
            daemon.assert_running();
            let answer = healthcheck.send((Ipv4Addr::LOCALHOST, port).into());
            answer.is_ok_and(|r| r.status == 200) && home.join(".dstack/config.yml").exists()
        });
        Self {
            port,
            home,
            project,
            log,
            daemon,
        }
    }

    /// `POST path` with the admin token; the JSON answer (the test fails on another status).
    fn api(&self, path: &str, body: &Value) -> Value {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let answer = Request::post(path)
            .header("Authorization", format!("Bearer {TOKEN}"))
            .json(body)
            .timeout(Duration::from_secs(60))
            .send(addr)
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        assert_eq!(answer.status, 200, "POST {path} {body}: {}", answer.body);
        answer.json_body()
    }

    /// [`Self::api`] of `/api/project/<PROJECT>/<path>`.
    fn project_api(&self, path: &str, body: &Value) -> Value {
        self.api(&format!("/api/project/{PROJECT}/{path}"), body)
    }

    /// Runs the `dstack` CLI against this server in the project directory; its stdout.
    fn cli(&self, args: &[&str]) -> String {
        let mut command = dstack(&self.home, &self.project);
        command.args(args).env("DSTACK_CLI_LOG_LEVEL", "INFO");
        let log = || format!("\nend of the server's log:\n{}", tail(&self.log, 60));
        run_ok(&mut command, CLI_BOUND, log)
    }

    /// `dstack apply -f <name>.dstack.yml -y -d` of task `name` ([`task_yaml`]).
    fn apply(&self, name: &str, env: &[&str], commands: &[&str]) -> String {
        let file = format!("{name}.dstack.yml");
        fs_err::write(self.project.join(&file), task_yaml(name, env, commands)).unwrap();
        self.cli(&["apply", "-f", &file, "-y", "-d"])
    }

    /// The run `name` as the server has it.
    fn run(&self, name: &str) -> Value {
        self.project_api("runs/get", &json!({"run_name": name}))
    }

    /// Waits until the latest submission of run `name`'s job is `running` and the shim runs its
    /// task; the task's id (the submission's).
    fn wait_running_task(&mut self, name: &str) -> String {
        let run = self.wait_run(name, |run| submission(run)["status"] == "running");
        let id = submission(&run)["id"].as_str().unwrap().to_owned();
        wait_until(&format!("{name}'s task runs"), JOB_BOUND, || {
            shim_api().task(&id).is_ok_and(|t| t["status"] == "running")
        });
        id
    }

    /// Waits until run `name` has ended (its status and its job's are final); the run.
    fn wait_ended(&mut self, name: &str) -> Value {
        const FINAL: [&str; 4] = ["done", "failed", "terminated", "aborted"];
        self.wait_run(name, |run| {
            FINAL.contains(&run["status"].as_str().unwrap_or(""))
                && FINAL.contains(&submission(run)["status"].as_str().unwrap_or(""))
        })
    }

    fn wait_run(&mut self, name: &str, done: impl Fn(&Value) -> bool) -> Value {
        wait_for(&format!("run {name}"), JOB_BOUND, || {
            self.daemon.assert_running();
            let run = self.run(name);
            let state = format!("run {}, job {}", run["status"], submission(&run));
            done(&run).then_some(run).ok_or(state)
        })
    }

    /// The job logs of run `name`'s latest submission (`diagnose`: the runner's own logs).
    fn logs(&self, name: &str, diagnose: bool) -> String {
        let run = self.run(name);
        let id = submission(&run)["id"].as_str().unwrap().to_owned();
        let mut text = String::new();
        let mut next_token = Value::Null;
        loop {
            let page = self.project_api(
                "logs/poll",
                &json!({"run_name": name, "job_submission_id": id, "limit": 1000,
                        "diagnose": diagnose, "next_token": next_token}),
            );
            for event in page["logs"].as_array().unwrap() {
                let bytes = BASE64.decode(event["message"].as_str().unwrap()).unwrap();
                text.push_str(&String::from_utf8_lossy(&bytes));
            }
            next_token = page["next_token"].clone();
            if next_token.is_null() {
                return text;
            }
        }
    }

    /// Fails the test unless the job logs of run `name` ([`Self::logs`]) hold each of `needles`.
    fn assert_logged(&self, name: &str, diagnose: bool, needles: &[&str]) {
        let logs = self.logs(name, diagnose);
        for needle in needles {
            assert!(logs.contains(needle), "{name}: no {needle:?} in {logs}");
        }
    }

    /// Every event the server recorded, oldest first: `(recorded_at, message, targets)`.
    fn events(&self) -> Vec<Value> {
        let mut all: Vec<Value> = Vec::new();
        loop {
            let mut request = json!({"ascending": true, "limit": 100});
            if let Some(last) = all.last() {
                request["prev_recorded_at"] = last["recorded_at"].clone();
                request["prev_id"] = last["id"].clone();
            }
            let page = self.api("/api/events/list", &request);
            let page = page.as_array().unwrap();
            if page.is_empty() {
                return all;
            }
            all.extend(page.iter().cloned());
        }
    }

    /// The log's warnings and errors (with the lines that follow them up to the next record).
    fn problems(&self) -> Vec<String> {
        let log = fs_err::read_to_string(&self.log).unwrap();
        let mut problems: Vec<String> = Vec::new();
        let mut current: Option<String> = None;
        for line in log.lines() {
            let level = line.split(' ').next().unwrap_or("");
            let is_record = matches!(level, "DEBUG" | "INFO" | "WARNING" | "ERROR" | "CRITICAL");
            if is_record {
                problems.extend(current.take());
                if matches!(level, "WARNING" | "ERROR" | "CRITICAL") {
                    current = Some(line.to_owned());
                }
            } else if let Some(problem) = current.as_mut() {
                problem.push('\n');
                problem.push_str(line);
            }
        }
        problems.extend(current);
        problems
    }
}

fn dstack_cli() -> PathBuf {
    dstack_python().with_file_name("dstack")
}

/// The `dstack` CLI (or server) with `home` as HOME, run in `dir`, with nothing of the
/// caller's environment (a developer's `DSTACK_*` must not leak in) but `PATH` (`ssh`).
fn dstack(home: &Path, dir: &Path) -> Command {
    let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".to_owned());
    let mut command = Command::new(dstack_cli());
    command
        .current_dir(dir)
        .env_clear()
        .env("PATH", path)
        .env("HOME", home);
    let settings = [
        ("LANG", "C.UTF-8"),
        ("PYTHONUNBUFFERED", "1"),
        ("NO_COLOR", "1"),
    ];
    command.envs(settings).env("COLUMNS", "200");
    command
}

/// Fails the test unless each of `lines` is a whole line of `text`.
fn assert_has_lines<'a>(text: &str, lines: impl IntoIterator<Item = &'a str>) {
    for line in lines {
        assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
    }
}

/// The latest submission of a run's (only) job.
fn submission(run: &Value) -> &Value {
    let submissions = run["jobs"][0]["job_submissions"].as_array();
    submissions.and_then(|s| s.last()).unwrap_or(&Value::Null)
}

/// Checks how run `run` ended: its status and its job's `status`, the job's termination
/// `reason` and (when given) its `exit_status`; the job's submission id.
fn assert_ended(run: &Value, status: &str, reason: &str, exit_status: Option<i64>) -> String {
    let job = submission(run);
    let got = [&run["status"], &job["status"], &job["termination_reason"]];
    assert_eq!(got, [status, status, reason], "{run}");
    if let Some(code) = exit_status {
        assert_eq!(job["exit_status"], code, "{job}");
    }
    job["id"].as_str().unwrap().to_owned()
}

/// When an event was recorded, from its `recorded_at` (RFC 3339, UTC).
fn recorded_at(event: &Value) -> SystemTime {
    parse_rfc3339(event["recorded_at"].as_str().unwrap())
}

/// An RFC 3339 time (`YYYY-MM-DDTHH:MM:SS[.ffffff](Z|+00:00)`), read by GNU `date`.
fn parse_rfc3339(text: &str) -> SystemTime {
    let secs = run("date", &["-u", "-d", text, "+%s.%N"]);
    SystemTime::UNIX_EPOCH + Duration::from_secs_f64(secs.trim().parse().unwrap())
}

/// Seconds from the first event matching `from` to the first later one matching `to`.
fn between(events: &[Value], from: impl Fn(&Value) -> bool, to: impl Fn(&Value) -> bool) -> f64 {
    let start = events.iter().position(&from);
    let start = start.unwrap_or_else(|| panic!("no such event in {events:#?}"));
    let end = events[start..].iter().find(|e| to(e));
    let end = end.unwrap_or_else(|| panic!("no later event in {events:#?}"));
    let took = recorded_at(end).duration_since(recorded_at(&events[start]));
    took.unwrap().as_secs_f64()
}

fn message(event: &Value) -> &str {
    event["message"].as_str().unwrap()
}

fn targets(event: &Value, kind: &str, name: &str) -> bool {
    let target = |t: &Value| t["type"] == kind && t["name"] == name;
    event["targets"]
        .as_array()
        .is_some_and(|t| t.iter().any(target))
}

/// Seconds from `dstack apply` of run `name` (its "Run submitted" event) to its job `running`,
/// as the server recorded them.
fn submit_to_running(events: &[Value], name: &str) -> f64 {
    let job = format!("{name}-0-0");
    between(
        events,
        |e| targets(e, "run", name) && message(e).starts_with("Run submitted"),
        |e| targets(e, "job", &job) && message(e).ends_with("-> RUNNING"),
    )
}

// ---- Tasks and what the host shows of them

/// A task configuration for the fleet's host: the local test image, `user:` and the CPU
/// architecture set (otherwise the server reads the image's config from its registry), small
/// resources (the defaults ask for a 100 GB disk).
fn task_yaml(name: &str, env: &[&str], commands: &[&str]) -> String {
    let arch = if go_arch() == "arm64" { "arm" } else { "x86" };
    let item = |i: &&str| format!("  - {}\n", serde_json::to_string(i).unwrap());
    let list = |items: &[&str]| items.iter().map(item).collect::<String>();
    let env = if env.is_empty() {
        String::new()
    } else {
        format!("env:\n{}", list(env))
    };
    format!(
        "type: task\nname: {name}\nimage: {}\nuser: root\n{env}commands:\n{}\
         resources:\n  cpu:\n    arch: {arch}\n    count: 1..\n  memory: 0.5GB..\n  disk: 1GB..\n",
        image(),
        list(commands)
    )
}

/// The shim's API on its fixed port.
fn shim_api() -> Api {
    let addr = (Ipv4Addr::LOCALHOST, SHIM_PORT).into();
    Api { addr }
}

/// The container the shim runs for task `id` (the server's job submission id), by upstream's
/// task label: `(id, name)`, or `None`.
fn task_container(id: &str) -> Option<(String, String)> {
    let label = format!("label=ai.dstack.shim.task-id={id}");
    let out = docker_ok(&[
        "ps",
        "-a",
        "--no-trunc",
        "--filter",
        &label,
        "--format",
        "{{.ID}} {{.Names}}",
    ]);
    let (cid, name) = out.lines().next()?.split_once(' ')?;
    Some((cid.to_owned(), name.to_owned()))
}

fn inspect(cid: &str, format: &str) -> String {
    docker_ok(&["inspect", "-f", format, cid]).trim().to_owned()
}

fn shim_key_lines() -> usize {
    let keys = fs_err::read_to_string(AUTHORIZED_KEYS).unwrap_or_default();
    let shims = |l: &&str| l.trim_end().ends_with(KEY_MARKER);
    keys.lines().filter(shims).count()
}

fn runner_dirs() -> BTreeSet<String> {
    task_entries(&Path::new(SHIM_HOME).join("runners"))
}

/// What the host shows of a running job's task: the shim reports it running with the
/// container Docker runs (never restarted), its directory exists, and its host key is in
/// `authorized_keys`. Returns the container id.
fn assert_task_running(id: &str) -> String {
    let info = shim_api().task(id).unwrap();
    assert_eq!(info["status"], "running", "{info}");
    let (cid, name) = task_container(id).unwrap_or_else(|| panic!("no container for task {id}"));
    assert_eq!(info["container_id"], cid.as_str(), "{info}");
    let state = "{{.State.Running}} {{.RestartCount}} {{.HostConfig.NetworkMode}}";
    assert_eq!(
        inspect(&cid, state),
        "true 0 host",
        "running, restarts, network mode"
    );
    assert!(runner_dirs().contains(&name), "{:?}", runner_dirs());
    assert_eq!(shim_key_lines(), 1, "the task's host key");
    cid
}

/// Waits until the server removed the task of job submission `id` from the shim; then the
/// host shows nothing of it.
fn wait_task_removed(id: &str) {
    let get = || shim_api().request("GET", &format!("/api/tasks/{id}"), None);
    wait_until(&format!("the server removes task {id}"), JOB_BOUND, || {
        get().is_ok_and(|r| r.status == 404)
    });
    let answer = get().unwrap();
    assert_eq!(answer.status, 404, "{answer:?}");
    assert_eq!(task_container(id), None);
    assert!(runner_dirs().is_empty(), "{:?}", runner_dirs());
    let keys = fs_err::read_to_string(AUTHORIZED_KEYS).unwrap_or_default();
    assert_eq!(shim_key_lines(), 0, "{keys}");
}

// ---- The run's logs

/// The logs of a run (the server's, the shim's output, the stand-in's and sshd's): when
/// dropped, copied to `<target>/fleet-test/` (replacing an earlier run's) and, if the test
/// fails, their ends printed. Also prints the phases of the test as they pass.
struct Logs {
    started: Instant,
    files: Vec<(&'static str, PathBuf, usize)>,
}

impl Logs {
    fn phase(&self, what: &str) {
        let at = self.started.elapsed().as_secs_f64();
        eprintln!("fleet: [{at:6.1} s] {what}");
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        let keep = target_dir().join("fleet-test");
        let _ = fs_err::remove_dir_all(&keep);
        let _ = fs_err::create_dir_all(&keep);
        for (name, path, lines) in &self.files {
            let _ = fs_err::copy(path, keep.join(name));
            if std::thread::panicking() {
                eprintln!(
                    "----- end of {name} ({}):\n{}",
                    path.display(),
                    tail(path, *lines)
                );
            }
        }
        eprintln!("fleet: logs kept in {}", keep.display());
    }
}

#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn a_dstack_server_provisions_an_ssh_fleet_and_runs_jobs_through_the_shim() {
    require_docker();
    require_root();
    let test_started = Instant::now();
    let python = dstack_python();
    assert!(
        python.exists() && dstack_cli().exists(),
        "{} is missing: run `cargo xtask dev-env` (it installs dstack[server]=={DSTACK_VERSION} \
         in a venv) or set {}",
        python.display(),
        shim_e2e::ENV_DSTACK_PYTHON
    );
    let artifact = std::path::absolute(dist_artifact(DSTACK_VERSION)).unwrap();
    assert!(
        artifact.is_file(),
        "the release artifact {} is missing: build it with `cargo xtask dist \
         --upstream-version {DSTACK_VERSION}` (or point {} at a directory laid out as \
         <release>/dstack-shim-linux-<arch>)",
        artifact.display(),
        shim_e2e::ENV_DIST_DIR
    );
    let dist = artifact.parent().unwrap().parent().unwrap().to_owned();

    let claim = Claim::take();
    prepare_host(&claim);
    let dir = tempfile::Builder::new().prefix("shim-fleet-").tempdir();
    let dir = dir.unwrap();
    let dir = dir.path();
    // A killed run leaves it behind: the next one removes it.
    claim.will_create(dir.to_str().unwrap());
    let systemd = claim.systemd_dir();
    let journal = systemd.join(format!("{UNIT}.journal"));
    let files = vec![
        ("server.log", dir.join("server.log"), 80),
        ("dstack-shim.journal", journal, 60),
        ("systemctl.log", systemd.join("systemctl.log"), 20),
        ("sshd.log", dir.join("sshd.log"), 20),
    ];
    let started = test_started;
    let logs = Logs { started, files };

    // The runner download: the test runner, laid out as the server's URL template wants it,
    // served over HTTP on loopback.
    let runner = build_test_runner(Duration::from_secs(600)).unwrap_or_else(|e| panic!("{e}"));
    let downloads = dir.join("downloads");
    let runner_path = format!("{DSTACK_VERSION}/dstack-runner-linux-{}", go_arch());
    fs_err::create_dir_all(downloads.join(DSTACK_VERSION)).unwrap();
    fs_err::copy(&runner, downloads.join(&runner_path)).unwrap();
    let files_port = free_port().unwrap();
    let mut files_command = Command::new(&python);
    files_command
        .args(["-m", "http.server", "--bind", "127.0.0.1", "--directory"])
        .arg(&downloads)
        .arg(files_port.to_string());
    let log = dir.join("files.log");
    let mut files = Daemon::spawn("the runner download server", files_command, &log, &claim);
    files.wait_listening(files_port);

    // An empty offers catalog: the server's scheduled catalog download needs the internet.
    let catalog = dir.join("catalog");
    let script = repo_root().join("tests/fleet/offline_catalog.py");
    let args = [script.to_str().unwrap(), catalog.to_str().unwrap()];
    run(&python, &args);

    logs.phase("the runner built and served, the offline catalog made");
    let host = SshHost::start(dir, &claim);
    let files_url = format!("http://127.0.0.1:{files_port}");
    let shim_url = format!(
        "file://{}/{{version}}/dstack-shim-linux-{{arch}}",
        dist.display()
    );
    let runner_url = format!("{files_url}/{{version}}/dstack-runner-linux-{{arch}}");
    let catalog_url = format!("file://{}", catalog.display());
    let env = [
        ("DSTACK_SHIM_DOWNLOAD_URL", shim_url),
        ("DSTACK_RUNNER_DOWNLOAD_URL", runner_url),
        ("GPUHUNT_CATALOG_URL", catalog_url),
    ];
    let mut server = DstackServer::start(dir, &claim, &env);
    let addrs = format!(
        "server on 127.0.0.1:{}, sshd on 127.0.0.1:{}",
        server.port, host.port
    );
    eprintln!("fleet: {addrs}, files in {}", dir.display());

    logs.phase("sshd and the dstack server started");

    // ---- The fleet: provisioned over SSH, the shim installed from the artifact, idle.
    let fleet_yaml = format!(
        "type: fleet\nname: {FLEET}\nssh_config:\n  user: root\n  port: {}\n  \
         identity_file: {}\n  hosts:\n    - 127.0.0.1\n",
        host.port,
        host.identity.display()
    );
    fs_err::write(server.project.join("fleet.dstack.yml"), &fleet_yaml).unwrap();
    server.cli(&["apply", "-f", "fleet.dstack.yml", "-y"]);
    let instance = wait_for("the fleet's instance is idle", FLEET_BOUND, || {
        server.daemon.assert_running();
        let fleet = server.project_api("fleets/get", &json!({"name": FLEET}));
        let instance = fleet["instances"][0].clone();
        match instance["status"].as_str() {
            Some("idle") => Ok(instance),
            Some("terminated" | "terminating") => panic!(
                "the fleet's instance failed: {instance}\nend of the server's log:\n{}",
                tail(&server.log, 80)
            ),
            _ => Err(format!("{instance}")),
        }
    });
    eprintln!("fleet: instance idle: {}", instance["instance_type"]);

    // The host as the server left it: the artifact installed, the unit, shim.env, host info,
    // the shim answering with the server's release, the runner downloaded from its URL.
    let same = |a: &Path, b: &Path| fs_err::read(a).unwrap() == fs_err::read(b).unwrap();
    let installed = same(Path::new(SHIM_INSTALLED), &artifact);
    assert!(installed, "{SHIM_INSTALLED} is the artifact, by bytes");
    let unit = fs_err::read_to_string(host.units.join(UNIT)).unwrap();
    let unit_lines = [
        "Restart=always",
        "RestartSec=3",
        "User=root",
        "WorkingDirectory=/root/.dstack",
        "EnvironmentFile=/root/.dstack/shim.env",
        "ExecStart=/usr/local/bin/dstack-shim",
    ];
    assert_has_lines(&unit, unit_lines);
    let env = fs_err::read_to_string(Path::new(SHIM_HOME).join("shim.env")).unwrap();
    let env_lines = [
        "DSTACK_SHIM_HOME=\"/root/.dstack\"",
        "DSTACK_SHIM_HTTP_PORT=\"10998\"",
        "DSTACK_SERVICE_MODE=\"1\"",
        &format!("DSTACK_RUNNER_DOWNLOAD_URL=\"{files_url}/{runner_path}\""),
    ];
    assert_has_lines(&env, env_lines);
    let host_info = fs_err::read(Path::new(SHIM_HOME).join("host_info.json")).unwrap();
    let host_info: Value = serde_json::from_slice(&host_info).unwrap();
    assert_eq!(
        instance["instance_type"]["resources"]["cpus"], host_info["cpus"],
        "the server read host_info.json: {host_info}"
    );
    let health = shim_api().get("/api/healthcheck").unwrap();
    let version = health["version"].as_str().unwrap();
    assert!(version.starts_with(DSTACK_VERSION), "{health}");
    let components = shim_api().get("/api/components").unwrap();
    let listed = components["components"].as_array().unwrap();
    let component = |name: &str| {
        let found = listed.iter().find(|c| c["name"] == name);
        found.unwrap_or_else(|| panic!("{components}"))
    };
    assert_eq!(component("dstack-shim")["version"], health["version"]);
    assert_eq!(component("dstack-runner")["version"], DSTACK_VERSION);
    let downloaded = same(Path::new(RUNNER_INSTALLED), &runner);
    assert!(
        downloaded,
        "the shim downloaded the runner from DSTACK_RUNNER_DOWNLOAD_URL"
    );
    assert_eq!(
        host.shim_starts(),
        1,
        "started once, by `systemctl restart`"
    );

    logs.phase("the fleet is idle");

    // ---- A job that ends `done`; its runner exits after the last pull (as with an attached
    // CLI), so its container ends by itself.
    let exit_after_pull = format!("{EXIT_AFTER_PULL}=1");
    let env = [exit_after_pull.as_str(), "GREETING=hello from the fleet"];
    let commands = ["echo \"$GREETING\"", "echo \"run $DSTACK_RUN_NAME\""];
    server.apply("fleet-done", &env, &commands);
    let run = server.wait_ended("fleet-done");
    let id = assert_ended(&run, "done", "done_by_runner", Some(0));
    server.assert_logged(
        "fleet-done",
        false,
        &["hello from the fleet", "run fleet-done"],
    );
    server.assert_logged("fleet-done", true, &["Job state changed new=done"]);
    wait_task_removed(&id);

    logs.phase("fleet-done ended");

    // ---- A job that fails with exit code 7; the server stops its container.
    server.apply("fleet-failed", &[], &["echo about to fail", "exit 7"]);
    let run = server.wait_ended("fleet-failed");
    let id = assert_ended(&run, "failed", "container_exited_with_error", Some(7));
    server.assert_logged("fleet-failed", false, &["about to fail"]);
    wait_task_removed(&id);

    logs.phase("fleet-failed ended");

    // ---- A job stopped with `dstack stop` while it runs.
    server.apply("fleet-stopped", &[], &["echo started", "sleep 600"]);
    let id = server.wait_running_task("fleet-stopped");
    assert_task_running(&id);
    server.cli(&["stop", "fleet-stopped", "-y"]);
    let run = server.wait_ended("fleet-stopped");
    assert_ended(&run, "terminated", "terminated_by_user", None);
    server.assert_logged("fleet-stopped", false, &["started"]);
    wait_task_removed(&id);

    logs.phase("fleet-stopped ended");

    // ---- A job during which the shim is SIGKILLed: the stand-in restarts it after
    // RestartSec, the job ends `done` in the same container, never restarted.
    let commands = ["echo before the kill", "sleep 25", "echo after the restart"];
    server.apply("fleet-killed", &[], &commands);
    let id = server.wait_running_task("fleet-killed");
    let cid = assert_task_running(&id);
    let started_at = inspect(&cid, "{{.State.StartedAt}}");
    let old = host.shim_pid().unwrap();
    kill("KILL", &old.to_string());
    let (killed, down_since) = (Instant::now(), SystemTime::now());
    wait_until(
        "the stand-in restarts the shim",
        Duration::from_secs(60),
        || host.shim_pid().is_some_and(|pid| pid != old) && shim_api().answers(),
    );
    let (restart, down) = (killed.elapsed(), (down_since, SystemTime::now()));
    assert_eq!(assert_task_running(&id), cid, "the same container");
    let started_again = inspect(&cid, "{{.State.StartedAt}}");
    assert_eq!(started_again, started_at, "never restarted");
    let run = server.wait_ended("fleet-killed");
    assert_ended(&run, "done", "done_by_runner", Some(0));
    server.assert_logged(
        "fleet-killed",
        false,
        &["before the kill", "after the restart"],
    );
    wait_task_removed(&id);
    assert_eq!(
        host.shim_starts(),
        2,
        "once by the server, once after the SIGKILL"
    );

    logs.phase("fleet-killed ended");

    // ---- The fleet deleted; the shim stopped as its service would be.
    server.cli(&["fleet", "delete", FLEET, "-y"]);
    wait_until("the fleet is deleted", FLEET_BOUND, || {
        let fleets = server.project_api("fleets/list", &json!({}));
        let fleets = fleets.as_array().unwrap();
        fleets.iter().all(|f| f["name"] != FLEET)
    });
    let events = server.events();
    host.systemctl(&["stop", UNIT]);
    assert!(host.shim_pid().is_none());

    // Nothing left: no task container, no task directory, no shim line in authorized_keys.
    let owner = owner_identity(Path::new(SHIM_HOME));
    let leftovers = ContainerSweeper::for_label(LABEL_OWNER, &owner).containers();
    assert!(leftovers.is_empty(), "task containers left: {leftovers:?}");
    assert!(runner_dirs().is_empty(), "{:?}", runner_dirs());
    assert_eq!(shim_key_lines(), 0);
    let journal = fs_err::read_to_string(host.unit_file("journal")).unwrap();
    // The journal names the paths of requests that change something (the server runs the
    // shim at debug level; reads are at trace): the submits it made show it does, so the
    // absence below means something.
    assert!(
        journal.contains("path=/api/tasks "),
        "the shim's journal logs no request paths"
    );
    assert!(
        !journal.contains("/api/components/install") && !journal.contains("/api/shutdown"),
        "the server neither reinstalled nor restarted the shim"
    );

    // The server's log: no warning, no error (about the shim or anything else).
    // The one kind allowed: the instance check that found the shim down while it was (a
    // periodic check may fall into those seconds; the server tunnels to the shim's port, and
    // with nothing listening there the connection is reset).
    let while_down = |at: SystemTime| {
        at + Duration::from_secs(1) >= down.0 && at <= down.1 + Duration::from_secs(15)
    };
    let (expected, problems): (Vec<String>, Vec<String>) =
        server.problems().into_iter().partition(|problem| {
            let at = problem.split(' ').nth(1).filter(|t| t.contains('T'));
            problem.starts_with("WARNING ")
                && problem.contains("instances.check Instance ")
                && problem.contains("reachable=False")
                && at.map(parse_rfc3339).is_some_and(while_down)
        });
    for line in &expected {
        eprintln!("fleet: expected, while the shim was down: {line}");
    }
    assert!(
        problems.is_empty(),
        "the server logged {} warnings or errors:\n{}",
        problems.len(),
        problems.join("\n")
    );

    // Figures, from the server's events.
    let idle = between(
        &events,
        |e| targets(e, "fleet", FLEET) && message(e).starts_with("Fleet created"),
        |e| message(e).starts_with("Instance status changed PENDING -> IDLE"),
    );
    eprintln!("fleet: apply of the fleet -> instance idle: {idle:.1} s");
    for run in [
        "fleet-done",
        "fleet-failed",
        "fleet-stopped",
        "fleet-killed",
    ] {
        let took = submit_to_running(&events, run);
        eprintln!("fleet: {run}: submit -> running: {took:.1} s");
    }
    let restart = restart.as_secs_f64();
    eprintln!("fleet: the shim answered {restart:.1} s after its SIGKILL");
    logs.phase("the fleet deleted, the shim stopped, nothing left");
    // In this order (a tuple's fields drop first to last): the claim's undo comes last.
    drop((server, host, files, logs, claim));
    let took = test_started.elapsed().as_secs_f64();
    eprintln!("fleet: the whole test: {took:.0} s");
}
