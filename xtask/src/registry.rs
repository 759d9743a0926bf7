//! The local test registry: Debian's `docker-registry` with htpasswd auth on 127.0.0.1.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use shim_e2e::{REGISTRY, REGISTRY_PASSWORD, REGISTRY_PORT, REGISTRY_USER};

use base64::Engine as _;
use shim_e2e::harness::{Request, tail};

use crate::{cmd, paths};

const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The registry's state directory (config, htpasswd, storage).
pub fn dir() -> PathBuf {
    paths::state_dir().join("registry")
}

fn config_path() -> PathBuf {
    dir().join("config.yml")
}

fn htpasswd_path() -> PathBuf {
    dir().join("htpasswd")
}

/// The registry's log.
pub fn log_path() -> PathBuf {
    paths::log_dir().join("registry.log")
}

fn addr() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, REGISTRY_PORT))
}

fn config() -> String {
    format!(
        "# Written by `cargo xtask dev-env`; the dstack-shim test registry.
version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: {REGISTRY}
  secret: dstack-shim-dev-registry-not-a-secret
auth:
  htpasswd:
    realm: dstack-shim-test
    path: {htpasswd}
",
        storage = dir().join("storage").display(),
        htpasswd = htpasswd_path().display(),
    )
}

/// Manifest media types a registry may hold for our images.
const MANIFEST_ACCEPT: &str = "application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json";

/// `method path` on the registry with the fixture credentials (basic auth); the status code.
/// Fails if nothing answers or the answer is not HTTP.
fn status(method: &str, path: &str) -> Result<u16> {
    let token = base64::engine::general_purpose::STANDARD
        .encode(format!("{REGISTRY_USER}:{REGISTRY_PASSWORD}"));
    let response = Request::new(method, path)
        .header("Accept", MANIFEST_ACCEPT)
        .header("Authorization", format!("Basic {token}"))
        .timeout(Duration::from_secs(10))
        .send(addr())?;
    Ok(response.status)
}

/// Status code of `GET /v2/` with the fixture credentials (`None`: nothing answers).
fn probe() -> Option<u16> {
    status("GET", "/v2/").ok()
}

/// Whether the registry answers `GET /v2/` with 200 for the fixture credentials.
pub fn answers() -> bool {
    probe() == Some(200)
}

/// Whether the registry holds `repo:tag` (`HEAD /v2/<repo>/manifests/<tag>` with basic auth).
pub fn has_tag(repo: &str, tag: &str) -> Result<bool> {
    let path = format!("/v2/{repo}/manifests/{tag}");
    let code = status("HEAD", &path)?;
    match code {
        200 => Ok(true),
        404 => Ok(false),
        other => bail!("HEAD {path} on {REGISTRY} answered {other}"),
    }
}

/// Makes sure the registry answers on [`REGISTRY`] with the fixture credentials: writes its
/// config and htpasswd file if needed and starts it in the background unless it already answers
/// (or a registry with our config is already starting). Never starts a second one.
pub fn ensure_running() -> Result<()> {
    match probe() {
        Some(200) => {
            println!("registry: answers on {REGISTRY}");
            return Ok(());
        }
        Some(401) => bail!(
            "a registry answers on {REGISTRY} but rejects {REGISTRY_USER}:{REGISTRY_PASSWORD}; \
             it was not started with {} (stop it, then rerun)",
            htpasswd_path().display()
        ),
        Some(code) => bail!(
            "something answers on {REGISTRY} with HTTP {code} to GET /v2/; \
             not the test registry (stop it, then rerun)"
        ),
        None => {}
    }

    fs_err::create_dir_all(dir().join("storage"))?;
    let config_path = config_path();
    let config = config();
    if fs_err::read_to_string(&config_path).ok().as_deref() != Some(config.as_str()) {
        fs_err::write(&config_path, &config)?;
    }
    ensure_htpasswd()?;

    let config_arg = config_path.to_string_lossy().into_owned();
    let running = shim_e2e::harness::procs::find("docker-registry", Some(&config_arg));
    if running.is_empty() {
        // Each test run pushes fresh random layers (`FreshImage`, about 1.7 GB) and deletes
        // their manifests; the blobs stay until a garbage collection, which must not run
        // beside uploads: now, before the registry starts, is the safe moment.
        // A failed collection only leaves the disk as it was: said, not fatal.
        match cmd::output(cmd::cmd("docker-registry").args(["garbage-collect", &config_arg])) {
            Ok(out) => {
                let summary = out.lines().find(|l| l.contains("blobs marked"));
                println!("registry: collected: {}", summary.unwrap_or("-"));
            }
            Err(e) => println!("registry: garbage collection failed, blobs kept: {e:#}"),
        }
        println!("registry: starting docker-registry on {REGISTRY}");
        cmd::spawn_daemon(
            &cmd::find_program("docker-registry"),
            &["serve", &config_arg],
            &log_path(),
        )?;
    } else {
        println!("registry: docker-registry is running (pid {running:?}); waiting for it");
    }

    let started = Instant::now();
    loop {
        match probe() {
            Some(200) => {
                println!(
                    "registry: answers after {:.1}s",
                    started.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            Some(code) => bail!(
                "the registry answers GET /v2/ with HTTP {code}; last lines of {}:\n{}",
                log_path().display(),
                tail(&log_path(), 20)
            ),
            None => {}
        }
        if started.elapsed() > START_TIMEOUT {
            bail!(
                "the registry did not answer on {REGISTRY} within {}s; last lines of {}:\n{}",
                START_TIMEOUT.as_secs(),
                log_path().display(),
                tail(&log_path(), 20)
            );
        }
        sleep(Duration::from_millis(200));
    }
}

/// Writes the htpasswd file (bcrypt, which the registry requires) unless it already verifies.
fn ensure_htpasswd() -> Result<()> {
    let path = htpasswd_path();
    let verifies = path.is_file()
        && cmd::succeeds(
            cmd::cmd("htpasswd")
                .arg("-vb")
                .arg(&path)
                .args([REGISTRY_USER, REGISTRY_PASSWORD]),
        );
    if verifies {
        return Ok(());
    }
    let line = cmd::output(cmd::cmd("htpasswd").args(["-Bbn", REGISTRY_USER, REGISTRY_PASSWORD]))
        .context("could not run htpasswd (package apache2-utils)")?;
    fs_err::write(&path, format!("{}\n", line.trim()))?;
    Ok(())
}

/// A Docker client configuration in a temporary directory, logged in to the registry. Pushing
/// with it (env `DOCKER_CONFIG`) leaves `~/.docker/config.json` untouched, so the credentials
/// are never stored for the user and tests must pass their own.
pub struct Login {
    dir: tempfile::TempDir,
}

impl Login {
    /// Logs in to [`REGISTRY`] with the fixture credentials in a throwaway client config.
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("docker-config-")
            .tempdir_in(paths::tmp_dir())
            .context("could not create a temporary Docker client config directory")?;
        cmd::run_with_stdin(
            cmd::cmd("docker").env("DOCKER_CONFIG", dir.path()).args([
                "login",
                "--username",
                REGISTRY_USER,
                "--password-stdin",
                REGISTRY,
            ]),
            REGISTRY_PASSWORD.as_bytes(),
        )
        .with_context(|| format!("could not log in to {REGISTRY}"))?;
        Ok(Self { dir })
    }

    /// Pushes the local image `reference` with this login.
    pub fn push(&self, reference: &str) -> Result<()> {
        cmd::run(
            cmd::cmd("docker")
                .env("DOCKER_CONFIG", self.dir.path())
                .args(["push", reference]),
        )
        .with_context(|| format!("could not push {reference}"))
    }
}
