//! Pieces of a host a test makes for itself, as root: [`LoopFs`], a small ext4 file system
//! on a loop device (to fill a disk for real), and [`PrivateDocker`], a Docker daemon of the
//! test's own (to freeze, stop and restart, or to give a data root on a small disk), with the
//! measures tests take of them ([`fs_usage`], [`take`], [`images_at`]). Made only for tests:
//! whatever goes wrong fails the test (a panic with what went wrong).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    reason = "test helpers: a failure fails the test; clean-up problems go to stderr"
)]

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{docker_at_ok, try_docker_within, wait_for};

/// Bound of the waits here (never a timed assertion).
const WAIT: Duration = Duration::from_secs(60);

/// Runs a command to its end (no stdin) and returns its output; panics if it cannot run.
pub fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
}

/// Runs a command and returns its stdout; panics unless it exits 0.
pub fn run_ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sends `signal` (`TERM`, `STOP`, …) to process `pid`.
fn signal(pid: u32, signal: &str) {
    run_ok("kill", &[&format!("-{signal}"), &pid.to_string()]);
}

/// An ext4 filesystem in an image file, loop-mounted (no reserved blocks: root fills it
/// too); unmounted when dropped.
pub struct LoopFs {
    /// Where it is mounted.
    pub mount: PathBuf,
}

impl LoopFs {
    /// A file system of `size_mib` MiB in `dir/fs.img`, mounted on `dir/fs`.
    pub fn create(dir: &Path, size_mib: u64) -> Self {
        let image = dir.join("fs.img");
        let mount = dir.join("fs");
        fs_err::File::create(&image)
            .unwrap()
            .set_len(size_mib << 20)
            .unwrap();
        let image_str = image.display().to_string();
        run_ok("mkfs.ext4", &["-q", "-F", "-m", "0", &image_str]);
        fs_err::create_dir_all(&mount).unwrap();
        run_ok(
            "mount",
            &["-o", "loop", &image_str, &mount.display().to_string()],
        );
        Self { mount }
    }

    /// Fills the filesystem with a file until a write fails with ENOSPC; returns the file.
    pub fn fill(&self) -> PathBuf {
        let filler = self.mount.join("filler");
        let mut file = fs_err::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&filler)
            .unwrap();
        for chunk in [1 << 20, 64 << 10, 4 << 10, 1 << 10, 512] {
            let buf = vec![0u8; chunk];
            loop {
                match file.write_all(&buf) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                    Err(e) => panic!("filling {}: {e}", filler.display()),
                }
            }
        }
        let _ = file.sync_all();
        // Full: a new file cannot hold a byte.
        let probe = self.mount.join("probe");
        let written = fs_err::write(&probe, [0u8; 4096])
            .and_then(|()| fs_err::File::open(&probe)?.sync_all());
        let _ = fs_err::remove_file(&probe);
        assert!(
            written
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::StorageFull),
            "the filesystem is not full: {written:?}"
        );
        filler
    }

    /// Frees what [`LoopFs::fill`] took.
    pub fn free(&self, filler: &Path) {
        fs_err::remove_file(filler).unwrap();
        run_ok("sync", &["-f", &self.mount.display().to_string()]);
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let mount = self.mount.display().to_string();
        if !run("umount", &[&mount]).status.success() {
            // Something still holds it: detach it now, the kernel finishes when it is free.
            let out = run("umount", &["-l", &mount]);
            if !out.status.success() {
                eprintln!(
                    "cleanup: cannot unmount {mount}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A Docker daemon of the test's own
// ---------------------------------------------------------------------------------------------

/// A second `dockerd` beside the shared one: its own socket, data root, exec root (so its own
/// containerd), pid file and bridge (`--iptables=false`: the shared daemon's rules are not
/// touched), `--live-restore` so containers outlive a daemon restart as on a production host.
/// The test image is loaded into it from the default daemon. Dropped: thawed, its containers
/// removed, stopped, its mounts and files removed, its bridge deleted.
pub struct PrivateDocker {
    root: PathBuf,
    bridge: String,
    host: String,
    child: Option<Child>,
    starts: u32,
}

impl PrivateDocker {
    /// A daemon with its data under `root`, the test image loaded.
    pub fn start(root: &Path) -> Self {
        fs_err::create_dir_all(root).unwrap();
        let root = std::path::absolute(root).unwrap();
        // An interface name (at most 15 bytes) and a /24 nobody on this host uses.
        let pid = std::process::id();
        let bridge = format!("shflt{}", pid % 1_000_000);
        let used = run_ok("ip", &["-4", "-o", "addr"]);
        let net = (0..250u32)
            .map(|i| (pid + i) % 250 + 1)
            .map(|x| format!("10.213.{x}."))
            .find(|prefix| !used.contains(prefix.as_str()))
            .expect("a free 10.213.x.0/24");
        let _ = run("ip", &["link", "del", &bridge]);
        run_ok("ip", &["link", "add", &bridge, "type", "bridge"]);
        run_ok(
            "ip",
            &["addr", "add", &format!("{net}1/24"), "dev", &bridge],
        );
        run_ok("ip", &["link", "set", &bridge, "up"]);
        let host = format!("unix://{}", root.join("docker.sock").display());
        let mut daemon = Self {
            root,
            bridge,
            host,
            child: None,
            starts: 0,
        };
        daemon.start_daemon();
        // The test image, from the shared daemon.
        let mut save = Command::new("docker")
            .args(["save", &crate::image()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let load = Command::new("docker")
            .args(["-H", &daemon.host, "load"])
            .stdin(save.stdout.take().unwrap())
            .output()
            .unwrap();
        assert!(
            save.wait().unwrap().success(),
            "docker save {}",
            crate::image()
        );
        assert!(
            load.status.success(),
            "docker load: {}",
            String::from_utf8_lossy(&load.stderr)
        );
        daemon
    }

    /// Its `DOCKER_HOST`.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the daemon runs").id()
    }

    /// Starts `dockerd` and waits until it answers.
    pub fn start_daemon(&mut self) {
        assert!(self.child.is_none(), "the daemon runs already");
        self.starts += 1;
        let r = &self.root;
        let config = r.join("daemon.json");
        fs_err::write(&config, "{}\n").unwrap();
        let log = super::open_log(&r.join(format!("dockerd-{}.log", self.starts))).unwrap();
        let child = Command::new("dockerd")
            .arg("--config-file")
            .arg(&config)
            .arg("--data-root")
            .arg(r.join("data"))
            .arg("--exec-root")
            .arg(r.join("exec"))
            .arg("--pidfile")
            .arg(r.join("docker.pid"))
            .args(["-H", &self.host, "--bridge", &self.bridge])
            .args(["--iptables=false", "--ip-masq=false", "--live-restore"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start dockerd: {e}"));
        self.child = Some(child);
        let host = self.host.clone();
        wait_for("the private dockerd answers", WAIT, || {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "dockerd exited ({status}): {}",
                    super::tail(&self.root.join(format!("dockerd-{}.log", self.starts)), 30)
                );
            }
            match try_docker_within(&["-H", &host, "version"], Duration::from_secs(10)) {
                Ok(o) if o.status.success() => Ok(()),
                other => Err(format!("{other:?}")),
            }
        });
    }

    /// SIGTERM and waits for the daemon to exit (containers keep running: live restore).
    pub fn stop(&mut self) {
        let mut child = self.child.take().expect("the daemon runs");
        signal(child.id(), "CONT");
        signal(child.id(), "TERM");
        let started = Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > WAIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("dockerd did not stop within {WAIT:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGSTOP.
    pub fn freeze(&self) {
        signal(self.pid(), "STOP");
    }

    /// SIGCONT.
    pub fn thaw(&self) {
        signal(self.pid(), "CONT");
    }
}

impl Drop for PrivateDocker {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            let _ = run("kill", &["-CONT", &child.id().to_string()]);
        } else {
            // Containers outlive a stopped daemon (live restore): start it to remove them.
            let restarted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.start_daemon();
            }));
            if restarted.is_err() {
                eprintln!("cleanup: cannot restart the private dockerd to clean up");
            }
        }
        if self.child.is_some() {
            let ids = try_docker_within(&["-H", &self.host, "ps", "-aq"], WAIT)
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            let ids: Vec<&str> = ids.split_whitespace().collect();
            if !ids.is_empty() {
                let mut args = vec!["-H", self.host.as_str(), "rm", "-f"];
                args.extend(ids);
                let _ = try_docker_within(&args, Duration::from_secs(120));
            }
            if let Some(mut child) = self.child.take() {
                let _ = run("kill", &["-TERM", &child.id().to_string()]);
                let started = Instant::now();
                while matches!(child.try_wait(), Ok(None)) {
                    if started.elapsed() > WAIT {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        // The daemon leaves mounts under its roots (its data root bind-mounted on itself).
        let mountinfo = fs_err::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<&str> = mountinfo
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4))
            .filter(|p| Path::new(p).starts_with(&self.root))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            if !run("umount", &[p]).status.success() {
                let _ = run("umount", &["-l", p]);
            }
        }
        if let Err(e) = fs_err::remove_dir_all(&self.root) {
            eprintln!("cleanup: {e}");
        }
        let _ = run("ip", &["link", "del", &self.bridge]);
    }
}

/// The file system holding `path`: (capacity, available) in bytes, as `statfs` counts them
/// (no reserved blocks on a [`LoopFs`]).
pub fn fs_usage(path: &Path) -> (u64, u64) {
    let out = run_ok(
        "stat",
        &["-f", "-c", "%b %a %S", &path.display().to_string()],
    );
    let n: Vec<u64> = out.split_whitespace().map(|n| n.parse().unwrap()).collect();
    (n[0] * n[2], n[1] * n[2])
}

/// Takes `bytes` of `fs` in a file of its own (real blocks, not a hole).
pub fn take(fs: &LoopFs, name: &str, bytes: u64) -> PathBuf {
    let file = fs.mount.join(name);
    run_ok(
        "fallocate",
        &["-l", &bytes.to_string(), &file.display().to_string()],
    );
    run_ok("sync", &["-f", &fs.mount.display().to_string()]);
    file
}

/// The images of the daemon at `host`, as `repository:tag`.
pub fn images_at(host: &str) -> BTreeSet<String> {
    docker_at_ok(
        Some(host),
        &["images", "--format", "{{.Repository}}:{{.Tag}}"],
    )
    .lines()
    .map(str::to_owned)
    .collect()
}
