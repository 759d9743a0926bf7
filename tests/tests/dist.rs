//! The release artifact (SPEC §9, issue 21), as `cargo xtask dist` lays it out under
//! [`shim_e2e::dist_dir`] and as the dstack server installs it: one stripped file per
//! architecture that needs glibc 2.17 at most, with its checksum and debug file beside it.
//!
//! - its ELF facts, checksum and version line, for the release the tests use and the older one
//!   CI also builds;
//! - it serves the API and runs a task (with a host SSH key for a user the old glibc looks up)
//!   from inside a Debian 11 root file system (glibc 2.31, as Ubuntu 20.04), entered with
//!   `chroot`, on this machine's Docker;
//! - the dstack server's own instance check (PyPI `dstack[server]`) keeps the artifact built
//!   for its release, replaces one built for an older release, and replaces the current one
//!   when the server is a release newer;
//! - the dstack server's own client and pipeline code drive each architecture's artifact
//!   through a task's lifecycle (`tests/dstack-server/lifecycle.py`): this machine's natively,
//!   the other one's under qemu-user (whose binfmt_misc entry also runs the shim's own
//!   `--version`; only the shim is emulated, the containers are this machine's).
//!
//! `cargo xtask ci` builds the artifacts before its test step (`cargo xtask dist --arch all`
//! and `cargo xtask dist --upstream-version 0.22.4`); a test whose artifact is missing fails
//! and says which command makes it. Like the dev-env fixtures (qemu-user-static, the cross
//! glibc, the binfmt_misc entry), they are expected with `SHIM_TEST_DOCKER=1` (CI).
//!
//! Run: `cargo xtask dist --arch all && cargo xtask dist --upstream-version 0.22.4 &&
//! SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1 cargo nextest run -p shim-e2e --test dist
//! --run-ignored all`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::print_stderr,
    reason = "test code: a failed unwrap is a failed test; logs go to stderr"
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use shim_e2e::harness::artifact::{self, Arch};
use shim_e2e::harness::{
    ContainerSweeper, Request, ShimProcess, bridge_task, container_running, docker_socket,
    free_port, open_log, run_tag, runner_dir, shim_binary, ssh_key, tail, wait_until,
    write_runner_exit,
};
use shim_e2e::{
    DSTACK_VERSION, OLD_ROOTFS_SUITE, OLDER_DSTACK_VERSION, dist_artifact, dist_dir, dstack_python,
    old_rootfs, registry_password, registry_small_image, registry_user, repo_root, require_docker,
    require_root, runner_path,
};

/// Bounds of the waits (never timed assertions: generous, only there so a hang fails).
const START_BOUND: Duration = Duration::from_secs(60);
const STATUS_BOUND: Duration = Duration::from_secs(90);
/// The glibc the artifact may need at most (SPEC §9).
const GLIBC_FLOOR: &str = "2.17";

/// `path`, an artifact which must exist (`make` is the command that builds it).
fn existing(path: PathBuf, make: &str) -> PathBuf {
    assert!(
        path.is_file(),
        "{} is missing: run `{make}` (or set {})",
        path.display(),
        shim_e2e::ENV_DIST_DIR
    );
    path
}

/// The artifact of `release` for this machine, which must exist.
fn artifact_for(release: &str) -> PathBuf {
    let make = format!("cargo xtask dist --upstream-version {release}");
    existing(dist_artifact(release), &make)
}

/// The Python with the dstack server package, which must exist.
fn python() -> PathBuf {
    let python = dstack_python();
    assert!(
        python.exists(),
        "{} is missing: run `cargo xtask dev-env` or set {}",
        python.display(),
        shim_e2e::ENV_DSTACK_PYTHON
    );
    python
}

/// The stdout and stderr of `out`, for messages.
fn text(out: &Output) -> String {
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    format!("{}\n{}", text(&out.stdout), text(&out.stderr))
}

/// Runs `command --version` (`how` names it), which must print the version line of `release`.
fn assert_version(command: &mut Command, release: &str, how: &str) {
    let out = command.arg("--version").output().unwrap();
    assert!(out.status.success(), "{how}: {}", text(&out));
    let line = String::from_utf8_lossy(&out.stdout);
    assert_eq!(line.trim_end(), artifact::version_line(release), "{how}");
}

/// The checks CI makes of one artifact; `run` also runs its `--version` (this architecture).
fn check_artifact(path: &Path, release: &str, run: bool) {
    let shown = path.display();
    // The artifact is linked against glibc (zig, not a static build): no GLIBC_ version at
    // all would mean the reading broke, not that the floor is met.
    let highest = artifact::highest_glibc(path).unwrap();
    let highest = highest.unwrap_or_else(|| panic!("{shown}: no GLIBC_ symbol version found"));
    eprintln!("{shown}: highest GLIBC_ version needed: {highest}");
    assert!(
        artifact::compare_versions(&highest, GLIBC_FLOOR).is_le(),
        "{shown} needs GLIBC_{highest}, above {GLIBC_FLOOR}"
    );
    let unstripped = artifact::unstripped_sections(path).unwrap();
    let stripped = unstripped.is_empty();
    assert!(stripped, "{shown} is not stripped: {unstripped:?}");

    // The checksum file, as the file module checks it and as an operator does.
    artifact::verify_sha256(path).unwrap();
    let sha = artifact::sha256_file(path);
    let mut check = Command::new("sha256sum");
    check
        .arg("--check")
        .arg(sha.file_name().unwrap())
        .current_dir(path.parent().unwrap());
    let checked = check.output().unwrap();
    assert!(checked.status.success(), "sha256sum --check: {checked:?}");

    // The debug info is beside it, and the binary names it.
    let debug = artifact::debug_file(path);
    assert_eq!(
        artifact::debuglink(path).unwrap().as_deref(),
        debug.file_name().and_then(|n| n.to_str()),
        "{shown}: .gnu_debuglink"
    );
    let debug_sections = artifact::sections(&debug).unwrap();
    assert!(
        debug_sections.iter().any(|s| s == ".debug_line"),
        "{}: {debug_sections:?}",
        debug.display()
    );

    if run {
        let how = format!("{shown} --version");
        assert_version(&mut Command::new(path), release, &how);
    }
}

/// Issue 21 (Prove): each artifact CI builds needs GLIBC_2.17 at most, is stripped, matches
/// its checksum (also by `sha256sum --check`), names its debug file, and prints the version
/// string of the release it was built for. The artifact of the other architecture, which CI
/// builds too (`cargo xtask dist --arch all`), gets the same checks; it is run under qemu by
/// [`the_other_architectures_artifact_runs_under_qemu_through_a_task_lifecycle`].
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn artifacts_need_glibc_2_17_at_most_are_stripped_and_say_their_release() {
    require_docker();
    for release in [DSTACK_VERSION, OLDER_DSTACK_VERSION] {
        check_artifact(&artifact_for(release), release, true);
    }
    check_artifact(&other_artifact(), DSTACK_VERSION, false);
}

/// The architecture of the artifact this machine runs under emulation: the other one.
fn other_arch() -> Arch {
    match Arch::host() {
        Arch::Amd64 => Arch::Arm64,
        Arch::Arm64 => Arch::Amd64,
    }
}

/// The artifact of [`other_arch`] for [`DSTACK_VERSION`], which must exist.
fn other_artifact() -> PathBuf {
    let path = artifact::artifact_path(&dist_dir(), DSTACK_VERSION, other_arch());
    existing(path, "cargo xtask dist --arch all")
}

// ---- An older distribution

/// Runs `program args..` inside `rootfs` with `chroot`, in a mount namespace of its own (so
/// every mount below goes away with the process, however the test ends): a private `/tmp` with
/// `work` bound at its own path (Docker resolves bind-mount sources on the host, so the shim's
/// home and the runner must have the same paths inside and out), `work/root-home` as root's
/// home there (`/root`, so host SSH keys written there are the test's to read and the kept
/// tree is not written), a private `/run` holding Docker's socket (`/var/run` is a link to
/// `/run` there), `/proc` and `/dev`.
fn in_rootfs(rootfs: &Path, work: &Path, program: &Path) -> Command {
    const SCRIPT: &str = r#"set -e
root=$1; work=$2; socket=$3; shift 3
mount -t tmpfs -o mode=1777 dstack-shim-test "$root/tmp"
mkdir -p "$root$work"
mount --bind "$work" "$root$work"
mount --bind "$work/root-home" "$root/root"
mount -t tmpfs -o mode=0755 dstack-shim-test "$root/run"
touch "$root/run/docker.sock"
mount --bind "$socket" "$root/run/docker.sock"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
exec chroot "$root" "$@"
"#;
    let mut command = Command::new("unshare");
    command
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            SCRIPT,
            "sh",
        ])
        .arg(rootfs)
        .arg(work)
        .arg(docker_socket())
        .arg(program)
        .env_remove("DOCKER_HOST")
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1");
    command
}

/// The glibc release of `rootfs`, from `ldd --version` run there (`ldd (Debian GLIBC
/// 2.31-13+deb11u11) 2.31`).
fn rootfs_glibc(rootfs: &Path) -> String {
    let mut ldd = Command::new("chroot");
    let out = ldd.arg(rootfs).args(["ldd", "--version"]).output().unwrap();
    assert!(out.status.success(), "ldd --version in the rootfs: {out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let first = stdout.lines().next().unwrap_or_default();
    let version = first.split_whitespace().last();
    version.unwrap_or_default().to_owned()
}

/// Issue 21 (Prove): the artifact serves the API and runs a task on this machine's Docker from
/// inside a Debian 11 root file system (`debootstrap --variant=minbase bullseye`, made by
/// `cargo xtask dev-env`), whose glibc 2.31 is the one of Ubuntu 20.04 and older than the 2.34
/// an ordinary build on this machine needs: that build does not even start there (checked
/// first, so the test shows that the root file system makes a difference).
#[test]
#[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
fn the_artifact_serves_and_runs_a_task_inside_a_debian_11_root() {
    require_docker();
    require_root();
    let artifact = artifact_for(DSTACK_VERSION);
    let rootfs = old_rootfs();
    assert!(
        rootfs.join("bin/sh").exists(),
        "{} is not a root file system: run `cargo xtask dev-env` (it makes the Debian \
         {OLD_ROOTFS_SUITE} one) or set {}",
        rootfs.display(),
        shim_e2e::ENV_OLD_ROOTFS
    );
    let glibc = rootfs_glibc(&rootfs);
    eprintln!("glibc in {}: {glibc}", rootfs.display());
    assert!(
        artifact::compare_versions(&glibc, "2.34").is_lt(),
        "the rootfs has glibc {glibc}: it proves nothing about older hosts"
    );

    // Under /tmp (the namespace's private /tmp holds its mount point).
    let work = tempfile::Builder::new()
        .prefix("shim-e2e-dist-")
        .tempdir_in("/tmp");
    let work = work.unwrap();
    let work_path = work.path().to_owned();
    let (home, root_home) = (work_path.join("home"), work_path.join("root-home"));
    fs_err::create_dir_all(&home).unwrap();
    fs_err::create_dir_all(&root_home).unwrap();
    let _sweeper = ContainerSweeper::for_home(&home);
    let copy = |from: &Path, name: &str| {
        let to = work_path.join(name);
        fs_err::copy(from, &to).unwrap();
        to
    };
    let shim = copy(&artifact, "dstack-shim");
    let runner = copy(&runner_path(), "dstack-runner");

    // The ordinary build of this machine does not start there.
    let host_build = copy(shim_binary(), "dstack-shim-host-build");
    let mut version = in_rootfs(&rootfs, &work_path, &host_build);
    let out = version.arg("--version").output().unwrap();
    assert!(
        !out.status.success() && text(&out).contains("GLIBC_2.3"),
        "the host build should need a newer glibc than the rootfs has: {}",
        text(&out)
    );
    fs_err::remove_file(&host_build).unwrap();

    // The artifact prints its version there.
    let how = format!("{} --version in the rootfs", shim.display());
    assert_version(
        &mut in_rootfs(&rootfs, &work_path, &shim),
        DSTACK_VERSION,
        &how,
    );

    // It serves the API there and runs a task on the host's Docker.
    let port = free_port().unwrap();
    let log = work_path.join("shim.log");
    let mut command = in_rootfs(&rootfs, &work_path, &shim);
    command
        .arg("--shim-home")
        .arg(&home)
        .args(["--shim-http-port", &port.to_string()]);
    command.arg("--runner-binary-path").arg(&runner);
    command.arg("--volumes-root").arg(work_path.join("volumes"));
    command.args(["--shim-log-level", "5"]);
    let mut process = ShimProcess::from_command(command, port, &log).unwrap();
    // A failure shows the end of the shim's log.
    let dump = |what: &str| format!("{what}\n{}", tail(&log, 80));
    let fail = |e: std::io::Error| -> ! { panic!("{}", dump(&e.to_string())) };
    let answering = process.wait_answering(START_BOUND, Duration::from_millis(20));
    answering.unwrap_or_else(|e| panic!("{e}"));
    let api = process.api();
    let get = |path: &str| Request::get(path).send(api.addr).unwrap().ok();
    let version = artifact::version_line(DSTACK_VERSION);
    let version = version.rsplit(' ').next().unwrap();
    assert_eq!(get("/api/healthcheck")["version"], version);
    let components = get("/api/components");
    let listed = components["components"].as_array().unwrap();
    let shim_component = listed.iter().find(|c| c["name"] == "dstack-shim");
    assert_eq!(
        shim_component,
        Some(&json!({"name": "dstack-shim", "version": version, "status": "installed"})),
        "read from `{} --version` inside the rootfs: {components}",
        shim.display()
    );

    // A host key for root: the shim looks the user up with getpwnam_r, which the rootfs's
    // glibc 2.31 answers through its NSS module (libnss_files, loaded at run time), and
    // writes the key into that user's home.
    let id = "in-bullseye";
    let host_key = ssh_key("dist-in-bullseye");
    let mut config = bridge_task(id, &format!("e2e-dist-{}", run_tag()), 0);
    config["host_ssh_user"] = json!("root");
    config["host_ssh_keys"] = json!([host_key]);
    let key_body = host_key.split(' ').nth(1).unwrap().to_owned();
    let authorized_keys = root_home.join(".ssh/authorized_keys");
    let has_key =
        || fs_err::read_to_string(&authorized_keys).is_ok_and(|keys| keys.contains(&key_body));
    let wait_status = |status: &str| {
        let waited = api.wait_status(id, status, Duration::from_millis(50), STATUS_BOUND);
        waited.unwrap_or_else(|e| fail(e)).0
    };
    let submitted = api.call("POST", "/api/tasks", Some(&config), 200);
    submitted.unwrap_or_else(|e| fail(e));
    let running = wait_status("running");
    let cid = running["container_id"].as_str().unwrap().to_owned();
    assert_eq!(container_running(None, &cid), Some(true), "{running}");
    // The runner's directory the container sees is the home's, on the host.
    let args_file = runner_dir(&home, &running).join("stub-runner.args");
    let started = || args_file.exists();
    wait_until("the runner writes its arguments", STATUS_BOUND, started);
    assert!(
        has_key(),
        "root's authorized_keys in the rootfs lacks the task's host key: {}",
        dump(&fs_err::read_to_string(&authorized_keys).unwrap_or_default())
    );

    write_runner_exit(&home, &running, 0).unwrap();
    let done = wait_status("terminated");
    assert_eq!(done["termination_reason"], "done_by_runner", "{done}");
    let removed = api.remove_retrying(id, STATUS_BOUND);
    removed.unwrap_or_else(|e| fail(e));
    assert_eq!(
        container_running(None, &cid),
        None,
        "the container is removed"
    );
    let task_dir = runner_dir(&home, &running);
    assert!(!task_dir.exists(), "the task directory is removed");
    assert!(!has_key(), "the host key is released with the task");

    process.sigterm().unwrap();
    let status = process.wait_exit(START_BOUND).unwrap();
    assert!(status.success(), "{}", dump(&format!("{status:?}")));
}

// ---- The dstack server's instance check

/// The server's `DSTACK_SHIM_DOWNLOAD_URL` in these runs (nothing is fetched: the check
/// records install requests instead of sending them).
const DOWNLOAD_TEMPLATE: &str = "http://127.0.0.1:9/dstack-shim/{version}/dstack-shim-linux-{arch}";

/// What [`DOWNLOAD_TEMPLATE`] makes for `release`. The check's instance has no provisioning
/// data, so the server's `normalize_arch(None)` picks `amd64` whatever this machine is.
fn download_url(release: &str) -> String {
    let url = DOWNLOAD_TEMPLATE.replace("{version}", release);
    url.replace("{arch}", "amd64")
}

/// The release after `release` (`0.22.5` -> `0.22.6`).
fn next_release(release: &str) -> String {
    let (head, patch) = release.rsplit_once('.').unwrap();
    format!("{head}.{}", patch.parse::<u32>().unwrap() + 1)
}

/// Starts `binary` as the shim, its components list reporting `installed` as the dstack-shim
/// binary on disk; the stub runner reports `runner_version`.
fn start_shim(binary: &Path, installed: &Path, runner_version: &str, root: &Path) -> ShimProcess {
    let home = root.join(format!("home-{}", free_port().unwrap()));
    let port = free_port().unwrap();
    let args: Vec<std::ffi::OsString> = vec![
        "--runner-binary-path".into(),
        runner_path().into(),
        "--shim-binary-path".into(),
        installed.into(),
        "--volumes-root".into(),
        root.join("volumes").into(),
    ];
    let env = [("STUB_RUNNER_VERSION", std::ffi::OsStr::new(runner_version))];
    let log = home.with_extension("log");
    let mut process = ShimProcess::spawn_with_env(binary, &home, port, &args, &env, &log).unwrap();
    let answering = process.wait_answering(START_BOUND, Duration::from_millis(20));
    answering.unwrap_or_else(|e| panic!("{e}"));
    process
}

/// Runs `tests/dstack-server/check_shim.py` against `shim` as a release server at
/// `server_version` (the `DOWNLOAD_TEMPLATE` set), which must decide `expect` (`keep`, also as
/// a dev server; `install-shim` from the URL [`download_url`] makes for `install`; `restart`),
/// and fails the test unless every check passes.
fn server_check(shim: &ShimProcess, server_version: &str, expect: &str, install: Option<&str>) {
    let url = install.map(download_url);
    let mut command = Command::new(python());
    command
        .arg(repo_root().join("tests/dstack-server/check_shim.py"))
        .arg(format!("http://{}", shim.addr()))
        .args(["--server-version", server_version])
        .args(["--shim-download-url", DOWNLOAD_TEMPLATE])
        .args(["--expect", expect]);
    if let Some(url) = &url {
        command.args(["--expect-url", url]);
    }
    if expect != "keep" {
        command.arg("--no-dev");
    }
    let expect = url.map_or(expect.to_owned(), |url| format!("{expect} from {url}"));
    let out = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("check_shim.py --server-version {server_version}, {expect}:\n{stdout}");
    assert!(
        out.status.success(),
        "the dstack server {server_version} does not decide {expect} ({}):\n{stdout}\n{}\n\
         shim log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        tail(shim.log(), 40)
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.ends_with(" passed, 0 failed"), "{last}");
}

/// Issue 21 (Prove), SPEC §3 (the version paragraph): the dstack server's own instance check
/// (`_maybe_install_components` and `_check_instance_inner`, PyPI `dstack[server]`) decides:
/// - the artifact of the server's release: kept (no install, no restart), also by a dev server;
/// - the same, the server one release newer: it installs its own release's shim from its
///   `DSTACK_SHIM_DOWNLOAD_URL` (a host whose server was upgraded first);
/// - the older release's artifact: replaced by the server's release, from the template's URL;
/// - the older artifact running, the current one on disk (right after that install):
///   restarted, gracefully, nothing installed.
///
/// The stub runner reports the newest of these releases: every request the check records is
/// about the shim.
///
/// upstream: src/dstack/_internal/server/background/pipeline_tasks/instances/check.py
/// (`_maybe_install_components`, `_maybe_install_shim`, `_should_install_component`),
/// src/dstack/_internal/core/backends/base/compute.py (`get_dstack_shim_download_url`).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn the_dstack_server_keeps_the_artifact_of_its_release_and_replaces_older_ones() {
    require_docker();
    python();
    let current = artifact_for(DSTACK_VERSION);
    let older = artifact_for(OLDER_DSTACK_VERSION);
    let newer = next_release(DSTACK_VERSION);
    let root = tempfile::Builder::new()
        .prefix("shim-e2e-dist-server-")
        .tempdir();
    let root = root.unwrap();

    let start = |running: &Path, on_disk: &Path| start_shim(running, on_disk, &newer, root.path());

    let shim = start(&current, &current);
    server_check(&shim, DSTACK_VERSION, "keep", None);
    server_check(&shim, &newer, "install-shim", Some(&newer));
    drop(shim);
    let shim = start(&older, &older);
    server_check(&shim, DSTACK_VERSION, "install-shim", Some(DSTACK_VERSION));
    drop(shim);
    let shim = start(&older, &current);
    server_check(&shim, DSTACK_VERSION, "restart", None);
}

#[test]
fn the_next_release_and_its_url() {
    assert_eq!(next_release("0.22.5"), "0.22.6");
    assert_eq!(next_release("0.9.19"), "0.9.20");
    assert_eq!(
        download_url("0.22.5"),
        "http://127.0.0.1:9/dstack-shim/0.22.5/dstack-shim-linux-amd64"
    );
}

// ---- A task's lifecycle, driven by the dstack server's client, natively and under qemu

/// The checks `tests/dstack-server/lifecycle.py` makes (its last line counts them).
const LIFECYCLE_CHECKS: usize = 11;
/// Bound of one run of it (its own waits are bounded; this only stops a hang). Under qemu a
/// run takes about ten times as long as natively.
const LIFECYCLE_BOUND: Duration = Duration::from_secs(900);

/// Runs `tests/dstack-server/lifecycle.py` on `shim` (under `prefix`, with `env` added) against
/// this machine's Docker and the dev-env registry, and fails the test unless every check
/// passed. Its home is swept of containers whatever happens. Returns how long it took.
fn lifecycle(shim: &Path, prefix: Option<&Path>, env: &[(&str, &Path)]) -> Duration {
    let python = python();
    let work = tempfile::Builder::new()
        .prefix("shim-e2e-lifecycle-")
        .tempdir();
    let work = work.unwrap();
    // The script removes what it made; this is for a run that was killed.
    let _sweeper = ContainerSweeper::for_home(&work.path().join("home"));
    let output = work.path().join("lifecycle.out");
    let mut command = Command::new(python);
    let log = || Stdio::from(open_log(&output).unwrap());
    command
        .arg(repo_root().join("tests/dstack-server/lifecycle.py"))
        .arg(format!("--shim={}", shim.display()))
        .arg(format!("--work={}", work.path().display()))
        .arg(format!("--runner={}", runner_path().display()))
        .arg(format!(
            "--docker-host=unix://{}",
            docker_socket().display()
        ))
        .arg(format!("--image={}", registry_small_image()))
        .arg(format!("--registry-username={}", registry_user()))
        .arg(format!("--registry-password={}", registry_password()))
        .stdin(Stdio::null())
        .stdout(log())
        .stderr(log());
    if let Some(prefix) = prefix {
        command.arg(format!("--prefix={}", prefix.display()));
    }
    for (name, value) in env {
        command.env(name, value);
    }
    let started = Instant::now();
    let mut child = command.spawn().unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > LIFECYCLE_BOUND {
            // SIGTERM: the script still removes what it made.
            let mut term = Command::new("kill");
            let _ = term.args(["-TERM", &child.id().to_string()]).status();
            let stopping = Instant::now();
            while child.try_wait().unwrap().is_none() && stopping.elapsed() < START_BOUND {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let took = started.elapsed();
    let text = fs_err::read_to_string(&output).unwrap_or_default();
    eprintln!("lifecycle.py on {} ({took:.1?}):\n{text}", shim.display());
    let late = || panic!("lifecycle.py did not end within {LIFECYCLE_BOUND:?}:\n{text}");
    let status = status.unwrap_or_else(late);
    assert!(status.success(), "lifecycle.py: {status}:\n{text}");
    let last = text.lines().last().unwrap_or_default();
    assert_eq!(
        last,
        format!("lifecycle: {LIFECYCLE_CHECKS} passed, 0 failed"),
        "{text}"
    );
    took
}

/// The dstack server's client (`ShimClient`) and pipeline code (`_sync_shim_pulling_state`,
/// `remove_dangling_tasks_from_instance`) drive this machine's artifact through a task's
/// lifecycle: a pull with credentials, `done_by_runner`, a failure with its log, terminate with
/// a timeout, remove, a restart and a shutdown with tasks running, a container that exits while
/// the shim is down; no container is left (`tests/dstack-server/lifecycle.py`).
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn the_dstack_servers_client_drives_the_artifact_through_a_task_lifecycle() {
    require_docker();
    let took = lifecycle(&artifact_for(DSTACK_VERSION), None, &[]);
    let arch = Arch::host().go_name();
    eprintln!("MEASURED the lifecycle of the {arch} artifact: {took:.1?}");
}

/// qemu's name of `arch`'s CPU (`qemu-aarch64-static`, `/usr/aarch64-linux-gnu`).
fn qemu_cpu(arch: Arch) -> &'static str {
    match arch {
        Arch::Amd64 => "x86_64",
        Arch::Arm64 => "aarch64",
    }
}

/// The other architecture's artifact (arm64 on an amd64 machine) runs, not only builds: under
/// `qemu-<cpu>-static` with Debian's cross glibc as its sysroot it prints its version line, it
/// also runs when executed as it is (the binfmt_misc entry `cargo xtask dev-env` registers: the
/// shim runs its own binary's `--version` for the components list the server reads), and the
/// dstack server's client drives it through the whole lifecycle
/// ([`the_dstack_servers_client_drives_the_artifact_through_a_task_lifecycle`]) on this
/// machine's Docker: only the shim is emulated, the containers are native.
#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn the_other_architectures_artifact_runs_under_qemu_through_a_task_lifecycle() {
    require_docker();
    let arch = other_arch();
    let artifact = other_artifact();
    let cpu = qemu_cpu(arch);
    let dev_env = "run `cargo xtask dev-env` (it installs qemu-user-static and the cross glibc \
                   and registers the binfmt_misc entry)";
    let qemu = ["/usr/bin", "/usr/local/bin"].map(|dir| format!("{dir}/qemu-{cpu}-static"));
    let qemu = qemu
        .into_iter()
        .map(PathBuf::from)
        .find(|path| path.is_file());
    let qemu = qemu.unwrap_or_else(|| panic!("qemu-{cpu}-static is missing: {dev_env}"));
    let sysroot = PathBuf::from(format!("/usr/{cpu}-linux-gnu"));
    assert!(
        sysroot.join("lib").is_dir(),
        "{} (the cross glibc) is missing: {dev_env}",
        sysroot.display()
    );
    let entry = Path::new("/proc/sys/fs/binfmt_misc").join(format!("qemu-{cpu}"));
    let registered = fs_err::read_to_string(&entry).unwrap_or_default();
    assert!(
        registered.lines().next() == Some("enabled"),
        "{} is not an enabled binfmt_misc entry ({registered:?}): {dev_env}",
        entry.display()
    );
    let (shown, sysroot_shown) = (artifact.display(), sysroot.display());
    let mut under_qemu = Command::new(&qemu);
    under_qemu.arg("-L").arg(&sysroot).arg(&artifact);
    let how = format!("{} -L {sysroot_shown} {shown}", qemu.display());
    assert_version(&mut under_qemu, DSTACK_VERSION, &how);
    let mut through_binfmt = Command::new(&artifact);
    through_binfmt.env("QEMU_LD_PREFIX", &sysroot);
    let how = format!("{shown} through binfmt_misc");
    assert_version(&mut through_binfmt, DSTACK_VERSION, &how);

    let took = lifecycle(&artifact, Some(&qemu), &[("QEMU_LD_PREFIX", &sysroot)]);
    let (arch, qemu) = (arch.go_name(), qemu.display());
    eprintln!("MEASURED the lifecycle of the {arch} artifact under {qemu}: {took:.1?}");
}
