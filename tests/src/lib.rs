//! Shared test fixtures of the dstack-shim workspace, and the end-to-end tests (in `tests/`).
//!
//! This library is the one place where the names of the test fixtures are defined. `cargo xtask
//! dev-env` builds them under exactly these names, and tests of any crate find them through the
//! functions below (each reads an environment variable and falls back to the default constant):
//!
//! | fixture | default | env var |
//! |---|---|---|
//! | local busybox image (`docker import`, stub `/usr/sbin/sshd`) | [`IMAGE`] | [`ENV_IMAGE`] |
//! | registry with htpasswd auth | [`REGISTRY`] | [`ENV_REGISTRY`] |
//! | registry user | [`REGISTRY_USER`] | [`ENV_REGISTRY_USER`] |
//! | registry password | [`REGISTRY_PASSWORD`] | [`ENV_REGISTRY_PASSWORD`] |
//! | small image in the registry | `<registry>/`[`REGISTRY_SMALL_REPO`]`:`[`REGISTRY_TAG`] | — |
//! | large image (one layer >= [`LARGE_LAYER_BYTES`]) | `<registry>/`[`REGISTRY_LARGE_REPO`]`:`[`REGISTRY_TAG`] | — |
//! | stub runner script | [`RUNNER_PATH_IN_REPO`] | [`ENV_RUNNER`] |
//! | release artifacts (`cargo xtask dist`) | `<repo>/target/dist` | [`ENV_DIST_DIR`] |
//! | Debian 11 root file system (`debootstrap`) | [`OLD_ROOTFS`] | [`ENV_OLD_ROOTFS`] |
//! | a fake GPU host, made per test (`tests/gpu-host/fake_gpu_host.py`) | [`harness::FakeGpuHost`] | — |
//!
//! The registry images are *not* kept in the local Docker daemon after `dev-env` pushed them, so
//! a pull of the large image really downloads it. `dev-env` pushes with a throwaway Docker
//! client config, so `~/.docker/config.json` never holds the registry credentials: a pull
//! without credentials fails with `unauthorized: authentication required`.
//!
//! Test gating: a test that needs Docker or root (loop devices, mounts) is `#[ignore]`d with the
//! reason, so that nextest and `cargo test` show it as skipped, and starts with
//! [`require_docker`] / [`require_root`], which fail it unless [`ENV_TEST_DOCKER`]` = 1` /
//! [`ENV_TEST_ROOT`]` = 1`. Run them with `cargo xtask dev-env`, then
//! `SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1 cargo nextest run --workspace --run-ignored all`. The
//! reasons are these exact texts, the same in every crate:
//!
//! ```text
//! #[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
//! #[ignore = "needs root (loop devices, mounts): SHIM_TEST_ROOT=1, run with --run-ignored all"]
//! #[ignore = "needs Docker, the dev-env fixtures and root: SHIM_TEST_DOCKER=1 SHIM_TEST_ROOT=1, run with --run-ignored all"]
//! ```
//!
//! The [`harness`] module is the one test harness of the workspace (HTTP client, shim process
//! guard, the shim under test, host users, Docker helpers, task paths, bounded waits), used by
//! the end-to-end tests, the binary's tests and `xtask`.
//!
//! Keep this library's dependencies few and light (`xtask` and the tests of other crates
//! depend on it): `serde_json` (task configs and answers), `sha2` (the owner identity of a
//! home), `tempfile` (the temporary home of a [`harness::TestShim`]), `base64` (SSH keys) and
//! `fs-err`, all already used across the workspace; no async runtime, no HTTP library.

pub mod harness;

use std::path::PathBuf;

pub use harness::{docker, docker_ok};

/// Environment variable naming the local test image.
pub const ENV_IMAGE: &str = "SHIM_TEST_IMAGE";
/// Environment variable naming the test registry (`host:port`).
pub const ENV_REGISTRY: &str = "SHIM_TEST_REGISTRY";
/// Environment variable holding the test registry's user name.
pub const ENV_REGISTRY_USER: &str = "SHIM_TEST_REGISTRY_USER";
/// Environment variable holding the test registry's password.
pub const ENV_REGISTRY_PASSWORD: &str = "SHIM_TEST_REGISTRY_PASSWORD";
/// Environment variable holding the absolute path of the stub runner script.
pub const ENV_RUNNER: &str = "SHIM_TEST_RUNNER";
/// Environment variable holding the Python of a venv with the dstack server package
/// ([`DSTACK_VERSION`]); default [`DSTACK_PYTHON`] (made by `cargo xtask dev-env`).
pub const ENV_DSTACK_PYTHON: &str = "SHIM_TEST_DSTACK_PYTHON";
/// The dstack release whose server code checks the shim (PyPI `dstack[server]`), and the one a
/// default build of the binary speaks for: `bins/shim/upstream-version`, kept once.
pub const DSTACK_VERSION: &str = include_str!("../../bins/shim/upstream-version").trim_ascii();
/// The venv `cargo xtask dev-env` makes for it.
pub const DSTACK_VENV: &str = "/var/lib/dstack-shim-dev/venv-dstack";
/// Its Python.
pub const DSTACK_PYTHON: &str = "/var/lib/dstack-shim-dev/venv-dstack/bin/python";
/// Set to `1` to run the tests that need a Docker daemon (they then fail if it is unreachable).
pub const ENV_TEST_DOCKER: &str = "SHIM_TEST_DOCKER";
/// Set to `1` to run the tests that need root (loop devices, mounts).
pub const ENV_TEST_ROOT: &str = "SHIM_TEST_ROOT";

/// The local test image: a busybox root made with `docker import` (never pulled).
pub const IMAGE: &str = "shim-test:1";
/// The local test registry, plain HTTP on loopback (Docker treats 127.0.0.1 as insecure).
pub const REGISTRY: &str = "127.0.0.1:5799";
/// The port of [`REGISTRY`].
pub const REGISTRY_PORT: u16 = 5799;
/// The test registry's user (htpasswd auth).
pub const REGISTRY_USER: &str = "shimtest";
/// The test registry's password (a test fixture, not a secret).
pub const REGISTRY_PASSWORD: &str = "shimtest-pw";
/// Repository of the small image in the registry (same content as [`IMAGE`]).
pub const REGISTRY_SMALL_REPO: &str = "shim-test";
/// Repository of the large image in the registry (one layer of incompressible data).
pub const REGISTRY_LARGE_REPO: &str = "shim-test-large";
/// Tag of both registry images.
pub const REGISTRY_TAG: &str = "1";
/// Size of the random payload in the large image's single layer (220 MiB).
pub const LARGE_LAYER_BYTES: u64 = 220 * 1024 * 1024;
/// The stub runner script, relative to the repository root.
pub const RUNNER_PATH_IN_REPO: &str = "testdata/runner/dstack-runner";
/// Where the shim bind-mounts the runner in the container.
pub const RUNNER_PATH_IN_CONTAINER: &str = "/usr/local/bin/dstack-runner";
/// The file the stub runner waits for: its content is the exit code (relative to the runner's
/// `--temp-dir`, which is the task's runner directory mounted at `/tmp/runner`).
pub const RUNNER_EXIT_FILE: &str = "exit";

fn env_or(name: &str, default: &str) -> String {
    match std::env::var(name) {
        Ok(value) if !value.is_empty() => value,
        _ => default.to_owned(),
    }
}

/// The local test image ([`ENV_IMAGE`] or [`IMAGE`]).
pub fn image() -> String {
    env_or(ENV_IMAGE, IMAGE)
}

/// The test registry `host:port` ([`ENV_REGISTRY`] or [`REGISTRY`]).
pub fn registry() -> String {
    env_or(ENV_REGISTRY, REGISTRY)
}

/// The test registry's user ([`ENV_REGISTRY_USER`] or [`REGISTRY_USER`]).
pub fn registry_user() -> String {
    env_or(ENV_REGISTRY_USER, REGISTRY_USER)
}

/// The test registry's password ([`ENV_REGISTRY_PASSWORD`] or [`REGISTRY_PASSWORD`]).
pub fn registry_password() -> String {
    env_or(ENV_REGISTRY_PASSWORD, REGISTRY_PASSWORD)
}

/// The small registry image, e.g. `127.0.0.1:5799/shim-test:1`.
pub fn registry_small_image() -> String {
    format!("{}/{REGISTRY_SMALL_REPO}:{REGISTRY_TAG}", registry())
}

/// The large registry image, e.g. `127.0.0.1:5799/shim-test-large:1`.
pub fn registry_large_image() -> String {
    format!("{}/{REGISTRY_LARGE_REPO}:{REGISTRY_TAG}", registry())
}

/// The repository root (this package lives in `<root>/tests`).
pub fn repo_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest_dir)
}

/// Environment variable naming the directory of release artifacts, laid out as `cargo xtask
/// dist` writes them: `<dir>/<release>/dstack-shim-linux-<arch>` (with a `.sha256` beside).
pub const ENV_DIST_DIR: &str = "SHIM_TEST_DIST_DIR";
/// An older dstack release than [`DSTACK_VERSION`] that CI also builds an artifact for (the
/// server replaces it; an upgrade goes from it to the current one).
pub const OLDER_DSTACK_VERSION: &str = "0.22.4";

/// Environment variable naming the root file system of an older distribution the release
/// artifact must run in ([`OLD_ROOTFS`] by default).
pub const ENV_OLD_ROOTFS: &str = "SHIM_TEST_OLD_ROOTFS";
/// The Debian suite of [`OLD_ROOTFS`]: bullseye (Debian 11, glibc 2.31, as Ubuntu 20.04), the
/// oldest suite the Debian mirror still serves (buster moved to the archive).
pub const OLD_ROOTFS_SUITE: &str = "bullseye";
/// The older distribution's root file system `cargo xtask dev-env` makes (`debootstrap
/// --variant=minbase`, once, a few minutes).
pub const OLD_ROOTFS: &str = "/var/lib/dstack-shim-dev/rootfs-bullseye";

/// The older distribution's root file system ([`ENV_OLD_ROOTFS`] or [`OLD_ROOTFS`]).
pub fn old_rootfs() -> PathBuf {
    PathBuf::from(env_or(ENV_OLD_ROOTFS, OLD_ROOTFS))
}

/// The release artifacts' directory ([`ENV_DIST_DIR`] or `<repo>/target/dist`).
pub fn dist_dir() -> PathBuf {
    match std::env::var_os(ENV_DIST_DIR) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => repo_root().join("target").join("dist"),
    }
}

/// The architecture as upstream's artifact names spell it (Go's `GOARCH`: `amd64`, `arm64`).
pub fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The release artifact built for `release` for this machine's architecture:
/// `<dist_dir>/<release>/dstack-shim-linux-<go arch>`. It may not exist: tests that need it
/// fail and say to run `cargo xtask dist --upstream-version <release>`.
pub fn dist_artifact(release: &str) -> PathBuf {
    dist_dir()
        .join(release)
        .join(format!("dstack-shim-linux-{}", go_arch()))
}

/// The Python with the dstack server package ([`ENV_DSTACK_PYTHON`] or [`DSTACK_PYTHON`]).
pub fn dstack_python() -> PathBuf {
    PathBuf::from(env_or(ENV_DSTACK_PYTHON, DSTACK_PYTHON))
}

/// Absolute path of the stub runner script ([`ENV_RUNNER`] or [`RUNNER_PATH_IN_REPO`]).
pub fn runner_path() -> PathBuf {
    match std::env::var_os(ENV_RUNNER) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => repo_root().join(RUNNER_PATH_IN_REPO),
    }
}

/// Fails the calling test unless `var` is `1`: an ignored test run without its environment
/// fails with `message` instead of passing without having done anything.
#[track_caller]
fn require(var: &str, message: &str) {
    assert!(
        std::env::var(var).is_ok_and(|v| v == "1"),
        "{message} ({var} is not 1)"
    );
}

/// The first statement of a test that needs Docker and the dev-env fixtures (the test also
/// carries the Docker `#[ignore]` reason of this crate's docs): panics unless
/// [`ENV_TEST_DOCKER`]` = 1`. With it set, the test must fail, not skip, if Docker or a fixture
/// is missing.
#[track_caller]
pub fn require_docker() {
    require(
        ENV_TEST_DOCKER,
        "this test needs Docker and the dev-env fixtures: run `cargo xtask dev-env` and set \
         SHIM_TEST_DOCKER=1",
    );
}

/// The first statement of a test that needs root (loop devices, mounts; the test also carries
/// the root `#[ignore]` reason of this crate's docs): panics unless [`ENV_TEST_ROOT`]` = 1`.
#[track_caller]
pub fn require_root() {
    require(
        ENV_TEST_ROOT,
        "this test needs root (loop devices, mounts): run it as root and set SHIM_TEST_ROOT=1",
    );
}

/// [`require_docker`] and [`require_root`], for a test that needs both.
#[track_caller]
pub fn require_docker_and_root() {
    require_docker();
    require_root();
}

/// Fails unless `value` matches `pattern` (with its guard), showing the value and the
/// context, if given.
#[macro_export]
macro_rules! assert_matches {
    ($value:expr, $pattern:pat $(if $guard:expr)?) => {
        $crate::assert_matches!($value, $pattern $(if $guard)?, "")
    };
    ($value:expr, $pattern:pat $(if $guard:expr)?, $($context:tt)+) => {
        match &$value {
            $pattern $(if $guard)? => {}
            other => panic!(
                "{}: {other:?} does not match {}",
                format_args!($($context)+),
                stringify!($pattern)
            ),
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_images_are_under_the_registry() {
        // Unless overridden by the environment, the names are the documented ones.
        if std::env::var_os(ENV_REGISTRY).is_none() {
            assert_eq!(registry_small_image(), "127.0.0.1:5799/shim-test:1");
            assert_eq!(registry_large_image(), "127.0.0.1:5799/shim-test-large:1");
        }
        assert!(REGISTRY.ends_with(&format!(":{REGISTRY_PORT}")));
    }

    #[test]
    fn runner_script_is_in_the_repository() {
        let path = repo_root().join(RUNNER_PATH_IN_REPO);
        assert!(path.is_file(), "{} missing", path.display());
    }
}
