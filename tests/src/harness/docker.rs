//! The `docker` CLI for tests and developer tasks: running it, the containers of one shim
//! home (its owner label), and a guard that force-removes containers however a run ends.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use sha2::{Digest as _, Sha256};

/// The label holding a container's owner identity (see [`owner_identity`]).
pub const LABEL_OWNER: &str = "ai.dstack.shim.owner";

/// Runs the `docker` CLI (no stdin) and returns its output; panics if the CLI cannot run at
/// all. For tests.
#[allow(
    clippy::expect_used,
    reason = "a test helper: a missing docker CLI fails the test"
)]
pub fn docker(args: &[&str]) -> Output {
    try_docker(args).expect("the docker CLI runs")
}

/// Runs the `docker` CLI (no stdin) and returns its output, whatever its exit status.
pub fn try_docker(args: &[&str]) -> std::io::Result<Output> {
    Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
}

/// Like [`try_docker`], but kills the CLI if it has not finished within `limit` (a wedged
/// daemon must not hang a clean-up forever).
pub fn try_docker_within(args: &[&str], limit: std::time::Duration) -> std::io::Result<Output> {
    let mut child = Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let started = std::time::Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("docker {args:?} did not finish within {limit:?}"),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output()
}

/// The version of the daemon the `docker` CLI talks to (`DOCKER_HOST` or the default socket),
/// or `None` if it does not answer within 10 s (a daemon that takes the connection and hangs
/// must not hang the caller).
pub fn server_version() -> Option<String> {
    let args = ["version", "--format", "{{.Server.Version}}"];
    let out = try_docker_within(&args, std::time::Duration::from_secs(10)).ok()?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    (out.status.success() && !version.is_empty()).then_some(version)
}

/// Runs the `docker` CLI and returns its stdout; panics (failing the test) unless it exits 0.
#[allow(
    clippy::panic,
    reason = "a test helper: a failed docker command fails the test"
)]
pub fn docker_ok(args: &[&str]) -> String {
    let output = docker(args);
    assert!(
        output.status.success(),
        "docker {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// How long one `docker` command of [`docker_at`] may take before it is killed.
pub const DOCKER_BOUND: std::time::Duration = std::time::Duration::from_secs(120);

/// The `docker` CLI against the daemon at `host` (`unix:///…`; `None`: the default one),
/// killed after [`DOCKER_BOUND`]; its output whatever its exit status. Panics if the CLI
/// cannot run or hangs.
#[allow(
    clippy::panic,
    reason = "a test helper: a docker CLI that cannot run fails the test"
)]
pub fn docker_at(host: Option<&str>, args: &[&str]) -> Output {
    let mut all: Vec<&str> = Vec::new();
    if let Some(h) = host {
        all.extend(["-H", h]);
    }
    all.extend_from_slice(args);
    try_docker_within(&all, DOCKER_BOUND).unwrap_or_else(|e| panic!("{e}"))
}

/// [`docker_at`], which must exit 0 (else the test fails); its stdout.
pub fn docker_at_ok(host: Option<&str>, args: &[&str]) -> String {
    let out = docker_at(host, args);
    assert!(
        out.status.success(),
        "docker {args:?} on {host:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Whether the container named (or with the id) `id` on the daemon at `host` runs:
/// `Some(running)`, or `None` if there is no such container. Any other failure of
/// `docker inspect` fails the test.
#[allow(
    clippy::panic,
    reason = "a test helper: an unexpected answer of docker fails the test"
)]
pub fn container_running(host: Option<&str>, id: &str) -> Option<bool> {
    let out = docker_at(host, &["inspect", "-f", "{{.State.Running}}", id]);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("No such"), "docker inspect {id}: {stderr}");
        return None;
    }
    match String::from_utf8_lossy(&out.stdout).trim() {
        "true" => Some(true),
        "false" => Some(false),
        other => panic!("docker inspect {id}: unexpected {other:?}"),
    }
}

/// Waits until the container on the default daemon no longer runs (gone or stopped).
#[allow(
    clippy::panic,
    reason = "a test helper: a container that keeps running fails the test"
)]
pub fn wait_container_stopped(id: &str) {
    super::wait_until(
        &format!("container {id} stops"),
        std::time::Duration::from_secs(90),
        || container_running(None, id) != Some(true),
    );
}

/// Force-removes the container of this name (`docker rm -f`, on the default daemon) when
/// dropped, however the test ends: for containers a test makes without the owner label a
/// [`ContainerSweeper`] finds (fixtures of the upstream shim, of older releases).
#[derive(Debug)]
pub struct NamedContainer(pub String);

impl Drop for NamedContainer {
    fn drop(&mut self) {
        let _ = try_docker_within(&["rm", "-f", &self.0], DOCKER_BOUND);
    }
}

/// Removes a local image (`docker rmi -f`, on the default daemon) when dropped.
#[derive(Debug)]
pub struct RemoveImage(pub String);

impl Drop for RemoveImage {
    fn drop(&mut self) {
        let _ = try_docker_within(&["rmi", "-f", &self.0], DOCKER_BOUND);
    }
}

/// The owner identity the shim gives the containers of `home`: the one it stored in the home
/// (`<home>/owner-id`, created at its first start; SPEC §5), or, before that, the identity the
/// first release derived from the home's absolute path (what an older home keeps).
pub fn owner_identity(home: &Path) -> String {
    if let Ok(id) = fs_err::read_to_string(home.join("owner-id")) {
        return id.trim().to_owned();
    }
    let abs = std::path::absolute(home).unwrap_or_else(|_| home.to_path_buf());
    let digest = Sha256::digest(abs.as_os_str().as_encoded_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Full ids of the containers (running or not) that carry the label `key=value`; empty if
/// the CLI fails.
pub fn containers_labelled(key: &str, value: &str) -> Vec<String> {
    let filter = format!("label={key}={value}");
    match try_docker_within(
        &["ps", "-aq", "--no-trunc", "--filter", &filter],
        std::time::Duration::from_secs(60),
    ) {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    }
}

/// Whether Docker knows a container named (or with the id) `name`.
pub fn container_exists(name: &str) -> bool {
    try_docker_within(
        &["inspect", "--type", "container", name],
        std::time::Duration::from_secs(60),
    )
    .is_ok_and(|out| out.status.success())
}

/// Force-removes every container carrying one label when [`ContainerSweeper::sweep`] is
/// called and when dropped, so a failed run leaves nothing behind. Best effort.
#[derive(Debug, Clone)]
pub struct ContainerSweeper {
    key: String,
    value: Value,
}

/// The label value a sweeper looks for.
#[derive(Debug, Clone)]
enum Value {
    Fixed(String),
    /// The owner identity of a home, read when sweeping (the shim creates it at its first
    /// start, after the sweeper was made) and kept once the home has it, so a sweep after the
    /// home is gone still finds the containers.
    OwnerOf(std::path::PathBuf, std::sync::OnceLock<String>),
}

impl ContainerSweeper {
    /// The containers of the shim whose home is `home` (its owner label).
    pub fn for_home(home: &Path) -> Self {
        Self {
            key: LABEL_OWNER.to_owned(),
            value: Value::OwnerOf(home.to_path_buf(), std::sync::OnceLock::new()),
        }
    }

    /// The containers labelled `key=value`.
    pub fn for_label(key: &str, value: &str) -> Self {
        Self {
            key: key.to_owned(),
            value: Value::Fixed(value.to_owned()),
        }
    }

    /// The label value (for a home, its owner identity now).
    pub fn value(&self) -> String {
        match &self.value {
            Value::Fixed(v) => v.clone(),
            Value::OwnerOf(_, known) if known.get().is_some() => {
                known.get().cloned().unwrap_or_default()
            }
            Value::OwnerOf(home, known) => {
                let id = owner_identity(home);
                if home.join("owner-id").exists() {
                    let _ = known.set(id.clone());
                }
                id
            }
        }
    }

    /// Full ids of the containers now carrying the label.
    pub fn containers(&self) -> Vec<String> {
        containers_labelled(&self.key, &self.value())
    }

    /// Force-removes them now (each `docker rm` bounded to two minutes); returns how many
    /// there were.
    pub fn sweep(&self) -> usize {
        let ids = self.containers();
        for batch in ids.chunks(200) {
            let mut args = vec!["rm", "-f"];
            args.extend(batch.iter().map(String::as_str));
            let _ = try_docker_within(&args, std::time::Duration::from_secs(120));
        }
        ids.len()
    }
}

impl Drop for ContainerSweeper {
    #[allow(
        clippy::print_stderr,
        reason = "tells the person running the tests or the task what was cleaned up"
    )]
    fn drop(&mut self) {
        let n = self.sweep();
        if n > 0 {
            eprintln!(
                "cleanup: removed {n} leftover container(s) labelled {}={}",
                self.key,
                self.value()
            );
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
    fn a_docker_cli_that_hangs_is_killed_after_the_limit() {
        // `docker events` never ends by itself while a daemon answers.
        crate::require_docker();
        let out = try_docker_within(&["events"], std::time::Duration::from_millis(300));
        let err = out.expect_err("docker events ended by itself");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
    }

    #[test]
    fn owner_identity_is_16_hex_of_the_absolute_home() {
        let a = owner_identity(Path::new("/a/home"));
        assert_eq!(a.len(), 16);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, owner_identity(Path::new("/b/home")));
        // echo -n /a/home | sha256sum | cut -c1-16
        assert_eq!(a, "3221d432f3836218");
        // A home the shim started in holds its identity.
        let home = tempfile::tempdir().unwrap();
        fs_err::write(home.path().join("owner-id"), "0123abcd0123abcd\n").unwrap();
        assert_eq!(owner_identity(home.path()), "0123abcd0123abcd");
    }
}
