//! `cargo xtask dev-env`: make a Debian 12 machine (as root) ready for every test. Idempotent:
//! each step checks first and does only what is missing, so a rerun takes seconds.

use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use shim_e2e::{
    IMAGE, LARGE_LAYER_BYTES, REGISTRY, REGISTRY_LARGE_REPO, REGISTRY_SMALL_REPO, REGISTRY_TAG,
};

use crate::paths::{state_dir, tmp_dir};
use crate::{cmd, docker, image, packages, registry};

/// Serialises dev-env runs on this machine (several developers or CI jobs may run
/// `cargo xtask ci` at once): an exclusive `flock` on a file in the state directory, released
/// when the returned guard is dropped (or the process dies).
pub fn lock() -> Result<shim_fs::FileLock> {
    let dir = state_dir();
    fs_err::create_dir_all(&dir)?;
    let path = dir.join("dev-env.lock");
    if let Some(lock) = shim_fs::FileLock::try_exclusive(&path)? {
        return Ok(lock);
    }
    println!(
        "dev-env: another dev-env holds {}; waiting for it",
        path.display()
    );
    Ok(shim_fs::FileLock::exclusive(&path)?)
}

/// Removes what an interrupted earlier run may have left in [`tmp_dir`] (a 220 MiB payload,
/// a client config holding the registry password). Call only under [`lock`].
fn clean_tmp() -> Result<()> {
    let tmp = tmp_dir();
    if tmp.exists() {
        fs_err::remove_dir_all(&tmp)?;
    }
    fs_err::create_dir_all(&tmp)?;
    Ok(())
}

fn small_ref() -> String {
    format!("{REGISTRY}/{REGISTRY_SMALL_REPO}:{REGISTRY_TAG}")
}

fn large_ref() -> String {
    format!("{REGISTRY}/{REGISTRY_LARGE_REPO}:{REGISTRY_TAG}")
}

/// Timings of named phases, printed as a table.
#[derive(Default)]
pub struct Timings {
    rows: Vec<(String, f64, String)>,
}

impl Timings {
    /// Runs `phase`, recording how long it took and whether it failed.
    pub fn time<T>(&mut self, name: &str, phase: impl FnOnce() -> Result<T>) -> Result<T> {
        println!("\n=== {name}");
        let started = Instant::now();
        let result = phase();
        // The space left after each phase on the checkout's file system (the target
        // directory's): a full disk is a failure of its own.
        let free = shim_resources::host::fs_usage(&shim_e2e::repo_root()).map_or_else(
            |_| String::new(),
            |u| format!("  ({} GiB free)", u.available >> 30),
        );
        let outcome = format!("{}{free}", if result.is_ok() { "ok" } else { "FAILED" });
        self.rows
            .push((name.to_owned(), started.elapsed().as_secs_f64(), outcome));
        result
    }

    /// Records a phase that was measured elsewhere.
    pub fn record(&mut self, name: &str, seconds: f64, outcome: &str) {
        self.rows
            .push((name.to_owned(), seconds, outcome.to_owned()));
    }

    /// The sum of all recorded phases, in seconds.
    pub fn total(&self) -> f64 {
        self.rows.iter().map(|row| row.1).sum()
    }

    /// Prints the table with a total.
    pub fn print(&self, title: &str) {
        let width = self
            .rows
            .iter()
            .map(|r| r.0.len())
            .max()
            .unwrap_or(0)
            .max(5);
        println!("\n{title}");
        for (name, seconds, outcome) in &self.rows {
            println!("  {name:<width$}  {seconds:>8.1}s  {outcome}");
        }
        println!("  {:<width$}  {:>8.1}s", "total", self.total());
    }
}

/// Docker only (what `cargo xtask run` needs): the package and a running daemon.
pub fn ensure_docker() -> Result<()> {
    let _lock = lock()?;
    packages::ensure(packages::DOCKER)?;
    docker::ensure_daemon()
}

/// The whole dev environment; prints a timing summary.
pub fn dev_env() -> Result<()> {
    let mut timings = Timings::default();
    let result = dev_env_timed(&mut timings);
    timings.print("dev-env timings:");
    result
}

/// The whole dev environment, each phase recorded in `timings`.
pub fn dev_env_timed(timings: &mut Timings) -> Result<()> {
    let _lock = lock()?;
    clean_tmp()?;
    timings.time("packages", || packages::ensure(packages::ALL))?;
    timings.time("qemu-user (arm64 artifacts)", crate::qemu::ensure)?;
    timings.time("engine roots", crate::engines::ensure_roots)?;
    timings.time("docker daemon", docker::ensure_daemon)?;
    let rebuilt = timings.time("local image", ensure_local_image)?;
    timings.time("registry", registry::ensure_running)?;
    timings.time("registry small image", || push_small(rebuilt))?;
    timings.time("registry large image", push_large)?;
    timings.time("dstack server venv", ensure_dstack_venv)?;
    timings.time("old distribution rootfs", crate::rootfs::ensure)?;
    timings.time("git hooks", use_repo_hooks)?;
    println!(
        "\ndev-env ready: image {IMAGE}, registry {REGISTRY} ({} / {}), images {} and {}",
        shim_e2e::REGISTRY_USER,
        shim_e2e::REGISTRY_PASSWORD,
        small_ref(),
        large_ref()
    );
    Ok(())
}

/// Points this checkout's git hooks at the versioned `.githooks/` (a pre-commit `cargo fmt
/// --check`), unless they point elsewhere already; nothing outside a git checkout, and only a
/// warning where `git` cannot set it.
fn use_repo_hooks() -> Result<()> {
    let root = shim_e2e::repo_root();
    if !root.join(".git").exists() || !root.join(".githooks/pre-commit").exists() {
        return Ok(());
    }
    let current =
        cmd::output(
            cmd::cmd("git")
                .current_dir(&root)
                .args(["config", "--get", "core.hooksPath"]),
        )
        .unwrap_or_default();
    match current.trim() {
        ".githooks" => {}
        "" => {
            // A convenience for whoever commits here: never a reason for dev-env to fail.
            let set = cmd::cmd("git")
                .current_dir(&root)
                .args(["config", "core.hooksPath", ".githooks"])
                .status();
            match set {
                Ok(status) if status.success() => {
                    println!(
                        "git hooks: core.hooksPath = .githooks (pre-commit: cargo fmt --check)"
                    );
                }
                other => println!("git hooks: warning: core.hooksPath left unset ({other:?})"),
            }
        }
        other => println!("git hooks: core.hooksPath is {other:?}; left as it is"),
    }
    Ok(())
}

/// What the dstack server's own requirements leave open and its code cannot run with:
/// `dstack[server]` asks for `sentry-sdk[fastapi]>=2.27.0`, and its background tasks call
/// `sentry_sdk.start_transaction` (`server/utils/tracing.py`), which sentry-sdk 3.0 (on PyPI
/// since 2026-12) no longer has: every pipeline fetch fails and no job is ever provisioned.
const DSTACK_CONSTRAINTS: [&str; 1] = ["sentry-sdk<3"];

/// Makes the venv with the dstack server package ([`shim_e2e::DSTACK_VERSION`] from PyPI,
/// within [`DSTACK_CONSTRAINTS`]) that the tests run the server's own code from, unless it has
/// that version already (and a sentry-sdk it runs with).
fn ensure_dstack_venv() -> Result<()> {
    let venv = std::path::Path::new(shim_e2e::DSTACK_VENV);
    let python = venv.join("bin/python");
    let version = shim_e2e::DSTACK_VERSION;
    let probe = format!(
        "import importlib.metadata as m, sys; import dstack._internal.server.services.runner.client; \
         sys.exit(m.version('dstack') != '{version}' \
         or int(m.version('sentry-sdk').split('.')[0]) >= 3)"
    );
    if python.exists() && cmd::succeeds(cmd::cmd(&python).args(["-c", &probe])) {
        println!("dstack venv: {} has dstack {version}", venv.display());
        return Ok(());
    }
    if venv.exists() {
        println!(
            "dstack venv: {} is incomplete; making it again",
            venv.display()
        );
        fs_err::remove_dir_all(venv)?;
    }
    cmd::run(cmd::cmd("python3").args(["-m", "venv"]).arg(venv))?;
    cmd::run(
        cmd::cmd(venv.join("bin/pip"))
            .args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                &format!("dstack[server]=={version}"),
            ])
            .args(DSTACK_CONSTRAINTS),
    )?;
    if !cmd::succeeds(cmd::cmd(&python).args(["-c", &probe])) {
        bail!(
            "dstack venv: {} lacks dstack {version} after pip install",
            venv.display()
        );
    }
    println!("dstack venv: installed dstack[server]=={version}");
    Ok(())
}

/// Builds [`IMAGE`] unless it exists with the hash of the current root file system.
/// Returns whether it was (re)built.
fn ensure_local_image() -> Result<bool> {
    let rootfs = image::build_rootfs(&tmp_dir())?;
    match image::local_hash(IMAGE) {
        Some(hash) if hash == rootfs.hash => {
            println!("image: {IMAGE} is up to date ({})", short(&rootfs.hash));
            Ok(false)
        }
        found => {
            match found {
                None => println!("image: {IMAGE} missing; building it"),
                Some(_) => println!("image: {IMAGE} is out of date; rebuilding it"),
            }
            image::import(rootfs.path(), IMAGE, &rootfs.hash)?;
            Ok(true)
        }
    }
}

/// Pushes [`IMAGE`] as the small registry image unless the registry has it already (and
/// [`IMAGE`] was not just rebuilt); the registry tag is then removed from the local daemon.
fn push_small(rebuilt: bool) -> Result<()> {
    let reference = small_ref();
    if !rebuilt && registry::has_tag(REGISTRY_SMALL_REPO, REGISTRY_TAG)? {
        println!("registry: has {reference}");
        return Ok(());
    }
    cmd::run(cmd::cmd("docker").args(["tag", IMAGE, &reference]))?;
    let login = registry::Login::new()?;
    login.push(&reference)?;
    // Only untags: the content stays as IMAGE.
    cmd::run(cmd::cmd("docker").args(["rmi", &reference]))?;
    Ok(())
}

/// Builds and pushes the large registry image unless the registry has it, and makes sure the
/// local daemon does not have it, so that pulling it really downloads it.
fn push_large() -> Result<()> {
    let reference = large_ref();
    if registry::has_tag(REGISTRY_LARGE_REPO, REGISTRY_TAG)? {
        println!("registry: has {reference}");
        if image::exists_locally(&reference) {
            // A pull test left it behind; remove it so the next pull downloads it again.
            // Best effort: a container still using it keeps it.
            if let Err(err) = cmd::run(cmd::cmd("docker").args(["rmi", &reference])) {
                println!("registry: warning: could not remove the local {reference}: {err:#}");
            }
        }
        return Ok(());
    }
    println!(
        "registry: building {reference} with a {} MiB random layer",
        LARGE_LAYER_BYTES / (1024 * 1024)
    );
    let rootfs = image::build_rootfs(&tmp_dir())?;
    image::add_random_payload(rootfs.path(), LARGE_LAYER_BYTES)?;
    image::import(rootfs.path(), &reference, &rootfs.hash)?;
    drop(rootfs);
    let login = registry::Login::new()?;
    login.push(&reference)?;
    cmd::run(cmd::cmd("docker").args(["rmi", &reference]))?;
    Ok(())
}

fn short(hash: &str) -> &str {
    hash.get(..12).unwrap_or(hash)
}

/// `cargo xtask dev-env --check`: reports what is ready and what is missing; changes nothing.
pub fn check() -> Result<()> {
    let mut missing: Vec<String> = Vec::new();
    let mut line = |ok: bool, what: String| {
        println!("[{}] {what}", if ok { " ok " } else { "MISS" });
        if !ok {
            missing.push(what);
        }
    };
    for package in packages::ALL {
        line(packages::installed(package), format!("package {package}"));
    }
    let version = shim_e2e::harness::docker::server_version();
    let docker_ok = version.is_some();
    line(
        docker_ok,
        format!(
            "docker daemon answers{}",
            version
                .map(|v| format!(" (server {v})"))
                .unwrap_or_default()
        ),
    );
    if docker_ok {
        let current = image::build_rootfs(&std::env::temp_dir())
            .map(|rootfs| rootfs.hash)
            .context("could not build the image root file system to compare hashes")?;
        line(
            image::local_hash(IMAGE).as_deref() == Some(current.as_str()),
            format!("image {IMAGE} up to date"),
        );
        line(
            !image::exists_locally(&large_ref()),
            format!(
                "{} not in the local daemon (pulls download it)",
                large_ref()
            ),
        );
    }
    let registry_ok = registry::answers();
    line(
        registry_ok,
        format!("registry answers on {REGISTRY} with auth"),
    );
    if registry_ok {
        for repo in [REGISTRY_SMALL_REPO, REGISTRY_LARGE_REPO] {
            line(
                registry::has_tag(repo, REGISTRY_TAG).unwrap_or(false),
                format!("registry has {REGISTRY}/{repo}:{REGISTRY_TAG}"),
            );
        }
    }
    let (ok, what) = crate::qemu::status();
    line(ok, what);
    for suite in [
        crate::engines::Suite::Bookworm,
        crate::engines::Suite::Trixie,
        crate::engines::Suite::Sid,
    ] {
        line(
            crate::engines::root_ready(suite),
            format!("engine root {suite:?}"),
        );
    }
    line(
        crate::rootfs::ready(),
        format!(
            "Debian {} root file system at {}",
            shim_e2e::OLD_ROOTFS_SUITE,
            shim_e2e::old_rootfs().display()
        ),
    );
    if missing.is_empty() {
        println!("dev-env: ready");
        Ok(())
    } else {
        bail!(
            "dev-env not ready ({} missing); run `cargo xtask dev-env`",
            missing.len()
        )
    }
}

/// Makes sure Docker runs and the fixtures the demo and the bench use are there (the local
/// image, the registry with the small image); runs `dev-env` if one is missing. Leaves the
/// large registry image alone (a pull test of someone else may be using it).
pub fn ensure_fixtures() -> Result<()> {
    ensure_docker()?;
    let ready = image::exists_locally(shim_e2e::IMAGE)
        && registry::answers()
        && registry::has_tag(shim_e2e::REGISTRY_SMALL_REPO, shim_e2e::REGISTRY_TAG)
            .unwrap_or(false)
        && registry::has_tag(shim_e2e::REGISTRY_LARGE_REPO, shim_e2e::REGISTRY_TAG)
            .unwrap_or(false);
    if ready {
        println!(
            "fixtures: image {} and registry {} ready",
            shim_e2e::IMAGE,
            shim_e2e::REGISTRY
        );
    } else {
        println!("fixtures: something is missing; running dev-env");
        dev_env()?;
    }
    Ok(())
}
