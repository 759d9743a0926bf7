//! The container engines the shim is checked on, side by side on one Debian 12 machine.
//!
//! Each engine is a Debian distribution's own package (`docker.io`, `podman`) run from that
//! distribution's root file system, made once with `debootstrap` under
//! [`roots_dir`] and kept: the engine's processes run in a mount namespace of their own in which
//! the root's `/usr` and `/etc` are bound over the host's, so they run the distribution's
//! programs and configuration while every other path (`/usr/local`, `/tmp`, `/root`, `/var`, `/run`, the
//! repository) is the host's. That is what the shim needs: it hands the engine host paths (its
//! home, the runner binary, volume mount points) that must mean the same inside. The host's `/`
//! is made a shared mount and the engine's namespace its slave, so what the tests mount later
//! (loop volumes, a small home) reaches the engine too, and nothing the engine mounts (container
//! root file systems) shows on the host.
//!
//! - The main engine ([`MAIN`]) serves the default socket in the host's network namespace; the
//!   whole suite runs against it.
//! - The conformance engines ([`CONFORMANCE`]) each get a network namespace of their own (host
//!   network tasks, bridges and firewall rules stay in it), their own socket, data and exec
//!   roots, and a copy of the test registry listening on `127.0.0.1` inside that namespace
//!   (same storage). The runtime crate's engine tests and the API lifecycle of the release
//!   binary run in that namespace against them, one engine at a time;
//!   [`crate::conformance`] prints the table.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use shim_e2e::harness::tail;
use shim_e2e::{
    IMAGE, REGISTRY, REGISTRY_PASSWORD, REGISTRY_SMALL_REPO, REGISTRY_TAG, REGISTRY_USER,
};

use crate::{cmd, mounts, paths};

/// The Debian mirror the roots come from.
const MIRROR: &str = "http://deb.debian.org/debian";
/// Written last into a finished root: the suite and the packages it was made with.
const DONE_MARKER: &str = ".dstack-shim-dev-engine-root";
/// How long an engine may take to answer after its start.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// A Debian distribution whose engine packages are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Suite {
    /// This machine's own Debian 12: `docker.io` 20.10 as installed by dev-env.
    Host,
    /// Debian 12 in a root of its own (Podman 4.3, kept off the host).
    Bookworm,
    /// Debian 13: Docker 26.1, Podman 5.4.
    Trixie,
    /// Debian sid: the newest Docker Debian has (28.5).
    Sid,
}

impl Suite {
    fn name(self) -> &'static str {
        match self {
            Suite::Host => "host",
            Suite::Bookworm => "bookworm",
            Suite::Trixie => "trixie",
            Suite::Sid => "sid",
        }
    }

    /// The root file system, `None` for the host's own.
    pub fn root(self) -> Option<PathBuf> {
        (self != Suite::Host).then(|| roots_dir().join(self.name()))
    }

    /// What is installed into the root besides `minbase`.
    fn packages(self) -> &'static [&'static str] {
        match self {
            Suite::Host => &[],
            Suite::Bookworm => &PODMAN_PACKAGES,
            Suite::Trixie => &[
                "docker.io",
                "iptables",
                "podman",
                "conmon",
                "runc",
                "netavark",
                "aardvark-dns",
                "nftables",
                "catatonit",
            ],
            Suite::Sid => &["docker.io", "iptables"],
        }
    }
}

/// Podman and what its Docker API service needs here (runc: crun refuses this machine's mixed
/// cgroup layout; netavark and aardvark-dns for bridge networks).
const PODMAN_PACKAGES: [&str; 7] = [
    "podman",
    "conmon",
    "runc",
    "netavark",
    "aardvark-dns",
    "iptables",
    "catatonit",
];

/// Docker's image store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// The graph drivers (overlay2): the default until Docker 29.
    Classic,
    /// The containerd image store (`containerd-snapshotter`): the default of new installs
    /// from Docker 29.
    Containerd,
}

/// Which engine program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `dockerd` with this image store.
    Docker(Store),
    /// `podman system service` (Podman's Docker-compatible API).
    Podman,
}

/// One engine.
#[derive(Debug, Clone, Copy)]
pub struct Engine {
    /// A short name: directories, the network namespace and the table use it.
    pub name: &'static str,
    /// Where its programs come from.
    pub suite: Suite,
    /// Which program, and for Docker which image store.
    pub kind: Kind,
}

/// The engine the whole suite runs on: the newest Docker with the containerd image store.
pub const MAIN: Engine = Engine {
    name: "docker-sid-containerd",
    suite: Suite::Sid,
    kind: Kind::Docker(Store::Containerd),
};

/// The engines the conformance part runs on.
pub const CONFORMANCE: [Engine; 6] = [
    Engine {
        name: "docker-bookworm",
        suite: Suite::Host,
        kind: Kind::Docker(Store::Classic),
    },
    Engine {
        name: "docker-trixie",
        suite: Suite::Trixie,
        kind: Kind::Docker(Store::Classic),
    },
    Engine {
        name: "docker-trixie-containerd",
        suite: Suite::Trixie,
        kind: Kind::Docker(Store::Containerd),
    },
    Engine {
        name: "docker-sid",
        suite: Suite::Sid,
        kind: Kind::Docker(Store::Classic),
    },
    Engine {
        name: "podman-bookworm",
        suite: Suite::Bookworm,
        kind: Kind::Podman,
    },
    Engine {
        name: "podman-trixie",
        suite: Suite::Trixie,
        kind: Kind::Podman,
    },
];

/// Where the roots live.
pub fn roots_dir() -> PathBuf {
    paths::state_dir().join("engines")
}

/// Every root the engines need, made (in parallel) unless ready.
pub fn ensure_roots() -> Result<()> {
    let suites = [Suite::Bookworm, Suite::Trixie, Suite::Sid];
    std::thread::scope(|scope| {
        let handles: Vec<_> = suites
            .iter()
            .map(|suite| scope.spawn(move || ensure_root(*suite)))
            .collect();
        let mut errors = Vec::new();
        for (suite, handle) in suites.iter().zip(handles) {
            match handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(err)) => errors.push(format!("{}: {err:#}", suite.name())),
                Err(_) => errors.push(format!("{}: the thread panicked", suite.name())),
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("engine roots: {}", errors.join("; "))
        }
    })
}

fn marker_text(suite: Suite) -> String {
    format!("{} {}\n", suite.name(), suite.packages().join(" "))
}

/// Whether `suite`'s root is there, finished, with the packages it should have.
pub fn root_ready(suite: Suite) -> bool {
    suite.root().is_none_or(|root| {
        fs_err::read_to_string(root.join(DONE_MARKER)).is_ok_and(|m| m == marker_text(suite))
    })
}

/// Makes `suite`'s root unless [`root_ready`]: `debootstrap --variant=minbase`, then its
/// packages with `apt-get` inside (`chroot`, in a mount namespace of its own for `/proc`).
fn ensure_root(suite: Suite) -> Result<()> {
    let Some(root) = suite.root() else {
        return Ok(());
    };
    if root_ready(suite) {
        println!("engines: {} is ready", root.display());
        return Ok(());
    }
    let partial = PathBuf::from(format!("{}.partial", root.display()));
    for tree in [&partial, &root] {
        mounts::remove_tree(tree)?;
    }
    fs_err::create_dir_all(roots_dir())?;
    let log = paths::log_dir().join(format!("engine-root-{}.log", suite.name()));
    fs_err::create_dir_all(paths::log_dir())?;
    println!(
        "engines: making {} (debootstrap {} and {}; log {})",
        root.display(),
        suite.name(),
        suite.packages().join(" "),
        log.display()
    );
    let started = Instant::now();
    let logged = |command: &mut Command| -> Result<()> {
        let out = shim_e2e::harness::open_log(&log)?;
        let err = shim_e2e::harness::open_log(&log)?;
        let line = cmd::display(command);
        let status = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .status()
            .with_context(|| format!("could not start `{line}`"))?;
        if !status.success() {
            bail!(
                "`{line}` failed: {status}; last lines of {}:\n{}",
                log.display(),
                tail(&log, 20)
            );
        }
        Ok(())
    };
    let result = logged(
        cmd::cmd(cmd::find_program("debootstrap"))
            .args(["--variant=minbase", suite.name()])
            .arg(&partial)
            .arg(MIRROR),
    )
    .and_then(|()| {
        let etc = partial.join("etc");
        fs_err::copy("/etc/resolv.conf", etc.join("resolv.conf"))?;
        // sid's index carries a Valid-Until this machine's clock may read as past.
        fs_err::write(
            etc.join("apt/apt.conf.d/99dstack-shim-dev"),
            "Acquire::Check-Valid-Until \"false\";\nAPT::Install-Recommends \"false\";\n",
        )?;
        // No service starts inside the root while packages install.
        let policy = partial.join("usr/sbin/policy-rc.d");
        fs_err::write(&policy, "#!/bin/sh\nexit 101\n")?;
        set_mode(&policy, 0o755)?;
        let script = format!(
            "mount -t proc proc /proc && apt-get update -q && \
             DEBIAN_FRONTEND=noninteractive apt-get install -y -q {}",
            suite.packages().join(" ")
        );
        logged(
            cmd::cmd("unshare")
                .args(["--mount", "--propagation", "private", "chroot"])
                .arg(&partial)
                .args(["sh", "-c", &script]),
        )
    });
    mounts::unmount_under(&partial)?;
    result?;
    fs_err::write(partial.join(DONE_MARKER), marker_text(suite))?;
    fs_err::rename(&partial, &root)?;
    println!(
        "engines: made {} in {:.0}s",
        root.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs_err::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Makes the host's `/` a shared mount (as systemd does on every boot), so that an engine's
/// namespace, a slave of it, sees what is mounted on the host after the engine started.
pub fn share_host_mounts() -> Result<()> {
    cmd::output(cmd::cmd("mount").args(["--make-rshared", "/"]))?;
    Ok(())
}

/// The script every engine process is started through (`sh -c`): in a fresh mount namespace
/// (a slave of the host's), with `$3 = 1` a sysfs of the engine's network namespace (keeping
/// the host's cgroup mounts), and with a root `$2` that root's `/usr` and `/etc` over the
/// host's, but for the host's `/usr/local` (where hosts keep `dstack-runner`, which the shim
/// binds into containers), with an exec root `$4` a tmpfs there (Docker's:
/// [`Engine::exec_root`]); then `exec "$@"`. `$1` is the engine's run directory.
const ENTER: &str = r#"set -e
run="$1"; root="$2"; netns="$3"; exec_root="$4"; shift 4
if [ -n "$exec_root" ]; then
  mkdir -p "$exec_root"
  mount -t tmpfs -o mode=0711 tmpfs "$exec_root"
fi
if [ "$netns" = 1 ]; then
  mkdir -p "$run/cgroup"
  mount --rbind /sys/fs/cgroup "$run/cgroup"
  mount -t sysfs sysfs /sys
  mount --rbind "$run/cgroup" /sys/fs/cgroup
  umount -l "$run/cgroup"
fi
if [ -n "$root" ]; then
  mkdir -p "$run/usr-local"
  mount --rbind /usr/local "$run/usr-local"
  mount --bind "$root/usr" /usr
  mount --rbind "$run/usr-local" /usr/local
  umount -l "$run/usr-local"
  mount --bind "$root/etc" /etc
fi
exec "$@"
"#;

impl Engine {
    /// Whether this is [`MAIN`].
    pub fn is_main(&self) -> bool {
        self.name == MAIN.name
    }

    /// Its network namespace (`None`: the host's).
    pub fn netns(&self) -> Option<String> {
        (!self.is_main()).then(|| format!("shim-{}", self.name))
    }

    /// Its state that outlives a run (images, containers): the main engine keeps Docker's
    /// defaults.
    fn data_dir(&self) -> PathBuf {
        roots_dir().join("state").join(self.name)
    }

    /// `main` for the main engine (the host's own paths), else the engine's `own`.
    fn main_or(&self, main: impl Into<PathBuf>, own: impl FnOnce() -> PathBuf) -> PathBuf {
        if self.is_main() { main.into() } else { own() }
    }

    /// Its sockets, pid file and exec root. Short: Podman 4.3 refuses a run root (below this)
    /// of more than 50 characters.
    fn run_dir(&self) -> PathBuf {
        PathBuf::from("/run/shim-engines").join(self.name)
    }

    /// Docker's exec root (its containerd's state, the container bundles and runtime mounts):
    /// a tmpfs of the engine's mount namespace, as `/run` is on a real host, so that it goes
    /// with the engine's processes: a daemon killed with everything it ran (a killed CI run, a
    /// restored machine snapshot) leaves no bundles for the next one to clean up before it
    /// answers.
    pub fn exec_root(&self) -> PathBuf {
        self.main_or("/var/run/docker", || self.run_dir().join("exec"))
    }

    /// The engine's API socket.
    pub fn socket(&self) -> PathBuf {
        self.main_or("/var/run/docker.sock", || {
            self.run_dir().join("engine.sock")
        })
    }

    /// `DOCKER_HOST` for it.
    pub fn docker_host(&self) -> String {
        format!("unix://{}", self.socket().display())
    }

    fn log(&self) -> PathBuf {
        self.main_or(main_log(), || {
            paths::log_dir().join(format!("engine-{}.log", self.name))
        })
    }

    /// The engine's program name (`/proc/<pid>/comm`).
    fn program(&self) -> &'static str {
        match self.kind {
            Kind::Docker(_) => "dockerd",
            Kind::Podman => "podman",
        }
    }

    /// The running processes of this engine: its program with its socket on the command
    /// line (the main engine: the default daemons).
    pub fn pids(&self) -> Vec<u32> {
        if self.is_main() {
            shim_e2e::harness::procs::default_dockerds()
        } else {
            shim_e2e::harness::procs::find(self.program(), Some(&self.socket().to_string_lossy()))
        }
    }

    /// The image store, as the table names it.
    pub fn store(&self) -> &'static str {
        match self.kind {
            Kind::Docker(Store::Classic) => "classic",
            Kind::Docker(Store::Containerd) => "containerd",
            Kind::Podman => "podman",
        }
    }

    /// Docker's `daemon.json`: the image store, and CDI (the Container Device Interface: a
    /// container asking for `nvidia.com/gpu=0` gets what a spec in `/etc/cdi` or
    /// `/var/run/cdi` says) on from Docker 25, where it needs `"cdi": true` until 28.2 turned it
    /// on by default (Debian 12's Docker 20.10 has no CDI and is left as it is).
    fn docker_config(&self, store: Store) -> String {
        let snapshotter = store == Store::Containerd;
        let cdi = if self.suite == Suite::Host {
            ""
        } else {
            ", \"cdi\": true"
        };
        format!("{{\"features\": {{\"containerd-snapshotter\": {snapshotter}{cdi}}}}}\n")
    }

    /// The command that runs the engine in the foreground (wrapped by [`ENTER`]).
    fn daemon_command(&self) -> Result<Vec<String>> {
        let data = self.data_dir();
        let run = self.run_dir();
        let s = |p: &Path| p.to_string_lossy().into_owned();
        Ok(match self.kind {
            Kind::Docker(store) => {
                let config = data.join("daemon.json");
                fs_err::create_dir_all(&data)?;
                fs_err::write(&config, self.docker_config(store))?;
                let mut args = vec!["dockerd".to_owned(), "--config-file".to_owned(), s(&config)];
                if !self.is_main() {
                    args.extend([
                        "--data-root".to_owned(),
                        s(&data.join("data")),
                        "--exec-root".to_owned(),
                        s(&self.exec_root()),
                        "--pidfile".to_owned(),
                        s(&run.join("docker.pid")),
                        "-H".to_owned(),
                        self.docker_host(),
                    ]);
                }
                args
            }
            Kind::Podman => {
                self.write_podman_config()?;
                vec![
                    "podman".to_owned(),
                    "system".to_owned(),
                    "service".to_owned(),
                    "--time=0".to_owned(),
                    self.docker_host(),
                ]
            }
        })
    }

    /// Podman's configuration, in files the environment names (`CONTAINERS_*`): storage and
    /// run state under this engine's directories, cgroupfs (no systemd here), events in a file,
    /// `k8s-file` logs, runc, and the test registry without TLS.
    fn write_podman_config(&self) -> Result<()> {
        let data = self.data_dir();
        let run = self.run_dir();
        fs_err::create_dir_all(&data)?;
        // Podman 4.3 raises the open-files and process limits of containers to its own defaults,
        // above this machine's hard limits, which its root (no CAP_SYS_RESOURCE) cannot raise:
        // name the hard limits it has.
        let ulimits = match self.suite {
            Suite::Bookworm => format!(
                "default_ulimits = [\"nofile={n}:{n}\", \"nproc={p}:{p}\"]\n",
                n = hard_limit("Max open files").unwrap_or(1024),
                // The service lowers its own process limit to 32768 (measured); a container
                // cannot be given more than its parent has.
                p = hard_limit("Max processes").unwrap_or(32768).min(32768),
            ),
            _ => String::new(),
        };
        let storage = format!(
            "[storage]\ndriver = \"overlay\"\ngraphroot = \"{}\"\nrunroot = \"{}\"\n",
            data.join("storage").display(),
            run.join("storage").display()
        );
        // Podman keeps the paths it was first started with in its database and refuses others:
        // storage made with another configuration starts afresh.
        let storage_conf = data.join("storage.conf");
        if fs_err::read_to_string(&storage_conf).is_ok_and(|old| old != storage) {
            for dir in ["storage", "networks", "volumes"] {
                let dir = data.join(dir);
                if dir.exists() {
                    println!(
                        "engines: {}: storage settings changed; removing {}",
                        self.name,
                        dir.display()
                    );
                    fs_err::remove_dir_all(&dir)?;
                }
            }
        }
        fs_err::write(
            data.join("containers.conf"),
            format!(
                "[containers]\nlog_driver = \"k8s-file\"\n{ulimits}\
                 [engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n\
                 events_logfile_path = \"{run}/events.log\"\nruntime = \"runc\"\n\
                 tmp_dir = \"{run}/tmp\"\nvolume_path = \"{data}/volumes\"\n\
                 [network]\nnetwork_config_dir = \"{data}/networks\"\n",
                run = run.display(),
                data = data.display(),
            ),
        )?;
        fs_err::write(&storage_conf, storage)?;
        // Every loopback registry without TLS, whatever its port: the test registry and the
        // slow proxies tests put in front of it (Docker treats 127.0.0.0/8 so by default).
        fs_err::write(
            data.join("registries.conf"),
            "unqualified-search-registries = []\n[[registry]]\nlocation = \"127.0.0.1\"\n\
             insecure = true\n",
        )?;
        Ok(())
    }

    /// The environment of the engine's process.
    fn daemon_env(&self) -> Vec<(String, String)> {
        let data = self.data_dir();
        match self.kind {
            Kind::Docker(_) => Vec::new(),
            Kind::Podman => [
                ("CONTAINERS_CONF", "containers.conf"),
                ("CONTAINERS_STORAGE_CONF", "storage.conf"),
                ("CONTAINERS_REGISTRIES_CONF", "registries.conf"),
            ]
            .iter()
            .map(|(k, f)| ((*k).to_owned(), data.join(f).to_string_lossy().into_owned()))
            .chain([("PODMAN_IGNORE_CGROUPSV1_WARNING".to_owned(), "1".to_owned())])
            .collect(),
        }
    }

    /// A command run inside this engine's network namespace (the host's for the main one),
    /// talking to it through `DOCKER_HOST`.
    pub fn command_in(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = match self.netns() {
            Some(netns) => {
                let mut c = cmd::cmd("nsenter");
                c.arg(format!("--net=/run/netns/{netns}")).arg(program);
                c
            }
            None => cmd::cmd(program),
        };
        command.env("DOCKER_HOST", self.docker_host());
        command
    }

    /// The server's version, if the engine answers within a few seconds.
    pub fn version(&self) -> Option<String> {
        let mut command = cmd::cmd("timeout");
        command
            .args(["10", "docker", "version", "--format", "{{.Server.Version}}"])
            .env("DOCKER_HOST", self.docker_host());
        cmd::output(&mut command)
            .ok()
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    /// The image store the running engine reports (`docker info`'s driver): `overlay2` on the
    /// classic store, `overlayfs` (a containerd snapshotter) on the containerd one, `overlay`
    /// on Podman.
    pub fn driver(&self) -> Option<String> {
        let mut command = cmd::cmd("timeout");
        command
            .args(["10", "docker", "info", "--format", "{{.Driver}}"])
            .env("DOCKER_HOST", self.docker_host());
        cmd::output(&mut command).ok().map(|v| v.trim().to_owned())
    }

    /// Whether the running engine is this one: it answers, and with the image store asked for.
    pub fn answers_as_itself(&self) -> bool {
        self.version().is_some()
            && self.driver().is_some_and(|driver| match self.kind {
                Kind::Docker(Store::Classic) => driver != "overlayfs",
                Kind::Docker(Store::Containerd) => driver == "overlayfs",
                Kind::Podman => true,
            })
    }

    /// Starts a conformance engine (and, in its own network namespace, a copy of the test
    /// registry) and waits for it to answer. Stops a leftover of an earlier run first.
    pub fn start(&self) -> Result<()> {
        if !self.is_main() && !self.pids().is_empty() {
            self.stop()?;
        }
        self.spawn()?;
        if self.netns().is_some() {
            self.start_registry()?;
        }
        self.wait(&self.log())
    }

    /// Starts the engine's process in the background (its namespaces, its root's programs);
    /// does not wait for it.
    pub fn spawn(&self) -> Result<()> {
        ensure_root(self.suite)?;
        share_host_mounts()?;
        let run = self.run_dir();
        fs_err::create_dir_all(&run)?;
        fs_err::create_dir_all(paths::log_dir())?;
        let log = self.log();
        if let Some(netns) = self.netns() {
            ensure_netns(&netns)?;
        }
        let root = self
            .suite
            .root()
            .map(|r| r.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut args: Vec<String> = Vec::new();
        if let Some(netns) = self.netns() {
            args.push(format!("--net=/run/netns/{netns}"));
        }
        args.extend(["unshare", "--mount", "--propagation", "slave", "env"].map(str::to_owned));
        args.extend(
            self.daemon_env()
                .into_iter()
                .map(|(k, v)| format!("{k}={v}")),
        );
        args.extend(["sh", "-c", ENTER, "sh"].map(str::to_owned));
        args.push(run.to_string_lossy().into_owned());
        args.push(root);
        args.push(if self.netns().is_some() { "1" } else { "0" }.to_owned());
        args.push(match self.kind {
            Kind::Docker(_) => self.exec_root().to_string_lossy().into_owned(),
            Kind::Podman => String::new(),
        });
        args.extend(self.daemon_command()?);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let program = if self.netns().is_some() {
            cmd::find_program("nsenter")
        } else {
            cmd::find_program("unshare")
        };
        let args = if self.netns().is_some() {
            &args[..]
        } else {
            // Without a network namespace the command starts at `unshare` itself.
            &args[1..]
        };
        println!(
            "engines: starting {} ({}, log {})",
            self.name,
            self.socket().display(),
            log.display()
        );
        cmd::spawn_daemon(&program, args, &log)
    }

    fn wait(&self, log: &Path) -> Result<()> {
        let started = Instant::now();
        loop {
            if let Some(version) = self.version() {
                println!(
                    "engines: {} answers (server {version}) after {:.1}s",
                    self.name,
                    started.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "{} did not answer within {}s; last lines of {}:\n{}",
                    self.name,
                    START_TIMEOUT.as_secs(),
                    log.display(),
                    tail(log, 30)
                );
            }
            if started.elapsed() > Duration::from_secs(3) && self.pids().is_empty() {
                bail!(
                    "{} exited during start-up; last lines of {}:\n{}",
                    self.name,
                    log.display(),
                    tail(log, 30)
                );
            }
            sleep(Duration::from_millis(300));
        }
    }

    /// The test registry inside the engine's network namespace, on the same storage and
    /// credentials as the host's.
    fn start_registry(&self) -> Result<()> {
        let Some(netns) = self.netns() else {
            return Ok(());
        };
        let config = crate::registry::dir().join("config.yml");
        let log = paths::log_dir().join(format!("registry-{}.log", self.name));
        cmd::spawn_daemon(
            &cmd::find_program("nsenter"),
            &[
                &format!("--net=/run/netns/{netns}"),
                &cmd::find_program("docker-registry").to_string_lossy(),
                "serve",
                &config.to_string_lossy(),
            ],
            &log,
        )
    }

    /// Stops the engine: its containers removed, the engine and its registry ended (SIGTERM,
    /// SIGKILL after 30 s), its network namespace deleted.
    pub fn stop(&self) -> Result<()> {
        if self.version().is_some() {
            let ids = self
                .command_in("docker")
                .args(["ps", "--all", "--quiet"])
                .output()
                .ok()
                .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
                .unwrap_or_default();
            let ids: Vec<&str> = ids.split_whitespace().collect();
            if !ids.is_empty() {
                let _ = cmd::output(self.command_in("docker").args(["rm", "--force"]).args(&ids));
            }
        }
        let mut doomed = self.pids();
        if let Some(netns) = self.netns() {
            doomed.extend(
                shim_e2e::harness::procs::find("docker-registry", None)
                    .into_iter()
                    .filter(|pid| in_netns(*pid, &netns)),
            );
        }
        terminate(&doomed);
        if let Some(netns) = self.netns() {
            // Whatever else still runs in it (a Podman container's conmon) goes with it.
            let rest: Vec<u32> = fs_err::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| in_netns(*pid, &netns))
                .collect();
            terminate(&rest);
            let _ = cmd::output(cmd::cmd("ip").args(["netns", "delete", &netns]));
        }
        Ok(())
    }

    /// Makes the test image ([`IMAGE`]) available in the engine: pulled from the registry
    /// copy in its namespace with the fixture credentials (through the engine's API, as the
    /// shim pulls) and tagged.
    pub fn load_test_image(&self) -> Result<()> {
        let auth = base64::Engine::encode(
            &base64::engine::general_purpose::URL_SAFE,
            format!(
                "{{\"username\":\"{REGISTRY_USER}\",\"password\":\"{REGISTRY_PASSWORD}\",\
                 \"serveraddress\":\"{REGISTRY}\"}}"
            ),
        );
        let socket = self.socket().to_string_lossy().into_owned();
        let api = |method: &str, path: &str, header: Option<String>| -> Result<String> {
            let mut command = self.command_in("curl");
            command.args(["--silent", "--show-error", "--fail", "--max-time", "300"]);
            command.args(["--unix-socket", &socket, "-X", method]);
            if let Some(header) = &header {
                command.args(["-H", header]);
            }
            command.arg(format!("http://engine{path}"));
            cmd::output(&mut command)
        };
        let source = format!("{REGISTRY}/{REGISTRY_SMALL_REPO}");
        let pulled = api(
            "POST",
            &format!("/images/create?fromImage={source}&tag={REGISTRY_TAG}"),
            Some(format!("X-Registry-Auth: {auth}")),
        )?;
        if pulled.contains("\"error") {
            bail!("{}: pulling {source}:{REGISTRY_TAG}: {pulled}", self.name);
        }
        let (repo, tag) = IMAGE.split_once(':').unwrap_or((IMAGE, "latest"));
        api(
            "POST",
            &format!("/images/{source}:{REGISTRY_TAG}/tag?repo={repo}&tag={tag}"),
            None,
        )?;
        Ok(())
    }
}

/// This process's hard limit named `name` in `/proc/self/limits` (`None`: unlimited or not
/// found).
fn hard_limit(name: &str) -> Option<u64> {
    let limits = fs_err::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|line| line.starts_with(name))?;
    line.get(name.len()..)?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn ensure_netns(netns: &str) -> Result<()> {
    if !Path::new("/run/netns").join(netns).exists() {
        cmd::run(cmd::cmd("ip").args(["netns", "add", netns]))?;
    }
    cmd::run(cmd::cmd("ip").args(["-n", netns, "link", "set", "lo", "up"]))
}

/// Whether process `pid` is in the network namespace `/run/netns/<netns>`.
fn in_netns(pid: u32, netns: &str) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(theirs) = fs_err::metadata(format!("/proc/{pid}/ns/net")) else {
        return false;
    };
    let Ok(named) = fs_err::metadata(Path::new("/run/netns").join(netns)) else {
        return false;
    };
    (theirs.dev(), theirs.ino()) == (named.dev(), named.ino())
}

/// SIGTERM to every pid, SIGKILL to those still there after 30 s.
fn terminate(pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    let alive = |pid: &u32| Path::new(&format!("/proc/{pid}")).exists();
    for pid in pids {
        let _ = cmd::output(cmd::cmd("kill").args(["-TERM", &pid.to_string()]));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline && pids.iter().any(alive) {
        sleep(Duration::from_millis(200));
    }
    for pid in pids.iter().filter(|p| alive(p)) {
        let _ = cmd::output(cmd::cmd("kill").args(["-KILL", &pid.to_string()]));
    }
}

/// One row of the engine table.
#[derive(Debug, Clone, Default)]
pub struct Row {
    /// The engine's name.
    pub engine: String,
    /// The server version it reported.
    pub version: String,
    /// Its image store.
    pub store: String,
    /// What ran on it: `(part, passed, failed)`.
    pub parts: Vec<(String, u32, u32)>,
    /// How long the whole row took.
    pub seconds: f64,
    /// Anything to say (why nothing ran).
    pub note: String,
    /// How GPU tasks get their GPUs there, as the shim decided on a fake NVIDIA host
    /// (`tests/dstack-server/gpu_lifecycle.py`): `cdi`, `legacy` or `refused`, with why;
    /// empty where it did not run.
    pub gpu: String,
}

impl Row {
    /// Whether everything on this engine passed (and something ran).
    pub fn passed(&self) -> bool {
        !self.parts.is_empty() && self.parts.iter().all(|(_, _, failed)| *failed == 0)
    }
}

/// The engine table, then each engine's GPU way and why.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from("engine table:\n");
    let _ = writeln!(
        out,
        "  {:<25} {:<15} {:<23} {:<8} {:<42} {:>6}  result",
        "engine", "version", "store", "gpu", "passed/failed", "time"
    );
    for row in rows {
        let parts = if row.parts.is_empty() {
            "nothing ran".to_owned()
        } else {
            row.parts
                .iter()
                .map(|(part, p, f)| format!("{part} {p}/{f}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let gpu = row.gpu.split_whitespace().next().unwrap_or("-");
        let _ = writeln!(
            out,
            "  {:<25} {:<15} {:<23} {:<8} {:<42} {:>5.0}s  {}{}",
            row.engine,
            row.version,
            row.store,
            gpu,
            parts,
            row.seconds,
            if row.passed() { "ok" } else { "FAILED" },
            if row.note.is_empty() {
                String::new()
            } else {
                format!(" ({})", row.note)
            }
        );
    }
    let gpus: Vec<&Row> = rows.iter().filter(|r| !r.gpu.is_empty()).collect();
    if !gpus.is_empty() {
        let _ = writeln!(
            out,
            "GPU tasks (a fake NVIDIA host with a CDI spec), per engine:"
        );
        for row in gpus {
            let _ = writeln!(out, "  {:<25} {}", row.engine, row.gpu);
        }
    }
    out
}

/// The counts of a test run's closing line: nextest's `N tests run: P passed, F failed, ...`,
/// lifecycle.py's `lifecycle: P passed, F failed`, or gpu_lifecycle.py's `gpus: P passed, F
/// failed`.
pub fn counts(output: &str) -> Option<(u32, u32)> {
    output.lines().rev().find_map(|line| {
        let rest = line
            .split_once("tests run: ")
            .or_else(|| line.split_once("test run: "))
            .or_else(|| line.split_once("lifecycle: "))
            .or_else(|| line.split_once("gpus: "))?
            .1;
        let mut passed = None;
        let mut failed = 0;
        for item in rest.split(", ") {
            let mut words = item.split_whitespace();
            let (Some(n), Some(what)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u32>() else { continue };
            match what {
                "passed" => passed = Some(n),
                "failed" | "timed" => failed += n,
                _ => {}
            }
        }
        Some((passed?, failed))
    })
}

/// The number of skipped tests nextest's closing line reports (`..., N skipped`).
pub fn skipped(output: &str) -> Option<u32> {
    output.lines().rev().find_map(|line| {
        let rest = line.split_once(" run: ")?.1;
        rest.split(", ").find_map(|item| {
            let (n, what) = item.trim().split_once(' ')?;
            what.starts_with("skipped")
                .then(|| n.parse().ok())
                .flatten()
        })
    })
}

/// The log of a `dockerd` started by xtask.
pub fn main_log() -> PathBuf {
    paths::log_dir().join("dockerd.log")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_from_25_has_cdi_on() {
        let config = |engine: &Engine| {
            let Kind::Docker(store) = engine.kind else {
                return None;
            };
            Some(serde_json::from_str::<serde_json::Value>(&engine.docker_config(store)).unwrap())
        };
        for engine in std::iter::once(MAIN).chain(CONFORMANCE) {
            let Some(config) = config(&engine) else {
                continue;
            };
            let features = &config["features"];
            assert_eq!(
                features["containerd-snapshotter"],
                engine.kind == Kind::Docker(Store::Containerd),
                "{}",
                engine.name
            );
            let cdi = engine.suite != Suite::Host;
            assert_eq!(
                features["cdi"].as_bool().unwrap_or(false),
                cdi,
                "{}",
                engine.name
            );
        }
    }

    #[test]
    fn hard_limits_are_read() {
        let files = hard_limit("Max open files").unwrap();
        assert!(files >= 1024, "{files}");
        assert_eq!(hard_limit("No such limit"), None);
    }

    #[test]
    fn run_roots_are_short_enough_for_podman_4_3() {
        for engine in CONFORMANCE {
            let runroot = engine.run_dir().join("storage");
            assert!(runroot.as_os_str().len() <= 50, "{}", runroot.display());
        }
    }

    #[test]
    fn skipped_tests_are_counted() {
        assert_eq!(
            skipped("Summary [  12.3s] 45 tests run: 43 passed, 2 failed, 3 skipped"),
            Some(3)
        );
        assert_eq!(
            skipped("Summary [ 1.0s] 1 test run: 1 passed (1 slow), 0 skipped"),
            Some(0)
        );
        assert_eq!(skipped("lifecycle: 11 passed, 0 failed"), None);
    }

    #[test]
    fn closing_lines_are_counted() {
        assert_eq!(
            counts("x\n     Summary [  12.3s] 45 tests run: 43 passed, 2 failed, 0 skipped\n"),
            Some((43, 2))
        );
        assert_eq!(
            counts("Summary [ 1.0s] 1 test run: 1 passed, 0 skipped"),
            Some((1, 0))
        );
        assert_eq!(
            counts("Summary [ 1.0s] 3 tests run: 1 passed, 1 failed, 1 timed out, 0 skipped"),
            Some((1, 2))
        );
        assert_eq!(
            counts("gpu-mode: cdi (x)\nok mode\ngpus: 5 passed, 0 failed\n"),
            Some((5, 0))
        );
        assert_eq!(
            counts("ok a\nlifecycle: 11 passed, 0 failed\n"),
            Some((11, 0))
        );
        assert_eq!(counts("nothing here"), None);
    }

    #[test]
    fn engines_have_distinct_names_sockets_and_namespaces() {
        let all: Vec<Engine> = std::iter::once(MAIN).chain(CONFORMANCE).collect();
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.socket(), b.socket());
                assert_ne!(a.netns(), b.netns());
            }
        }
        assert_eq!(MAIN.socket(), Path::new("/var/run/docker.sock"));
        assert!(CONFORMANCE.iter().all(|e| e.netns().is_some()));
    }

    #[test]
    fn a_row_with_a_failure_a_note_or_nothing_run_did_not_pass() {
        let mut row = Row {
            engine: "e".into(),
            version: "1".into(),
            store: "classic".into(),
            parts: vec![("runtime".into(), 45, 0)],
            seconds: 1.0,
            gpu: "cdi (Docker 28.5.2 applies CDI)".into(),
            ..Row::default()
        };
        assert!(table(std::slice::from_ref(&row)).contains("Docker 28.5.2 applies CDI"));
        assert!(row.passed());
        row.parts.push(("lifecycle".into(), 10, 1));
        assert!(!row.passed());
        row.parts.clear();
        assert!(!row.passed());
        assert!(table(&[row]).contains("nothing ran"));
    }
}
