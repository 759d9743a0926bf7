//! The dev-env fixtures themselves, against the real Docker daemon and registry: the test image
//! runs the stub runner the way the shim does, and the registry demands the test credentials and
//! holds both images. If these fail, every Docker test of the workspace is suspect.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shim_e2e::{
    REGISTRY_LARGE_REPO, REGISTRY_SMALL_REPO, REGISTRY_TAG, RUNNER_EXIT_FILE,
    RUNNER_PATH_IN_CONTAINER, image, registry, registry_password, registry_small_image,
    registry_user, require_docker, runner_path,
};

use shim_e2e::harness::{NamedContainer, Request, Response};
use shim_e2e::{docker, docker_ok};

/// Manifest media types a registry may hold for our images.
const MANIFEST_ACCEPT: &str = "application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.oci.image.manifest.v1+json";

/// One request to the registry with an optional basic-auth token; the answer.
fn try_http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    auth: Option<&str>,
) -> std::io::Result<Response> {
    let mut request = Request::new(method, path)
        .header("Accept", MANIFEST_ACCEPT)
        .timeout(Duration::from_secs(10));
    if let Some(basic) = auth {
        request = request.header("Authorization", format!("Basic {basic}"));
    }
    request.send(addr)
}

/// [`try_http`]'s status code; panics if nothing answers.
fn status(addr: SocketAddr, method: &str, path: &str, auth: Option<&str>) -> u16 {
    let answer = try_http(addr, method, path, auth);
    answer.unwrap_or_else(|e| panic!("{e}")).status
}

fn base64(input: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(input)
}

#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn stub_runner_serves_http_and_exits_with_the_code_from_the_exit_file() {
    require_docker();
    let runner = runner_path();
    assert!(runner.is_file(), "{} missing", runner.display());
    let temp_dir = tempfile::tempdir().unwrap();
    let name = format!("shim-e2e-fixture-runner-{}", std::process::id());
    let _ = docker(&["rm", "-f", &name]);
    let container = NamedContainer(name);
    let runner_mount = format!("{}:{RUNNER_PATH_IN_CONTAINER}:ro", runner.display());
    let temp_mount = format!("{}:/tmp/runner", temp_dir.path().display());
    // The command the shim runs (SPEC §6), with the stub sshd in place of the package install.
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0 test@fixture";
    let script = format!(
        "command -v sshd >/dev/null || exit 11; {RUNNER_PATH_IN_CONTAINER} --log-level 6 start \
         --temp-dir /tmp/runner --http-port 10999 --ssh-port 10022 --ssh-authorized-key '{key}'"
    );
    let options = [
        ("--name", container.0.as_str()),
        ("--label", "dev.dstack-shim.test=fixtures"),
        ("-v", &runner_mount),
        ("-v", &temp_mount),
        ("-p", "127.0.0.1::10999"),
        ("--entrypoint", "/bin/sh"),
    ];
    let mut run = vec!["run", "-d"];
    run.extend(options.into_iter().flat_map(|(o, value)| [o, value]));
    docker_ok(&[&run[..], &[&image(), "-c", &script]].concat());
    let port_line = docker_ok(&["port", &container.0, "10999/tcp"]);
    let port = port_line.lines().next().and_then(|l| l.rsplit(':').next());
    let port = port.and_then(|p| p.trim().parse::<u16>().ok());
    let port = port.unwrap_or_else(|| panic!("no published port in {port_line:?}"));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));

    // docker-proxy accepts before the runner listens: retry until the runner answers (bounded).
    let started = Instant::now();
    let body = loop {
        match try_http(addr, "GET", "/api/healthcheck", None) {
            Ok(r) if r.status == 200 => break r.body,
            _ if started.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(100));
            }
            other => panic!("the stub runner's HTTP server did not answer: {other:?}"),
        }
    };
    assert!(body.contains("dstack-runner"), "{body}");
    let args = fs_err::read_to_string(temp_dir.path().join("stub-runner.args")).unwrap();
    for arg in ["--http-port\n10999\n".to_owned(), format!("{key}\n")] {
        assert!(args.contains(&arg), "{arg:?} in {args}");
    }

    fs_err::write(temp_dir.path().join(RUNNER_EXIT_FILE), "7\n").unwrap();
    let code = docker_ok(&["wait", &container.0]);
    assert_eq!(code.trim(), "7");
    let logs = docker(&["logs", &container.0]);
    let stdout = String::from_utf8_lossy(&logs.stdout);
    let stderr = String::from_utf8_lossy(&logs.stderr);
    assert!(stdout.contains("--http-port 10999"), "{stdout}");
    assert!(stdout.contains("runner exiting with 7"), "{stdout}");
    assert!(stderr.contains("stub runner"), "{stderr}");
}

#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn registry_demands_the_credentials_and_holds_both_images() {
    require_docker();
    let addr: SocketAddr = registry().parse().expect("registry is host:port");
    let good = base64(&format!("{}:{}", registry_user(), registry_password()));
    let bad = base64(&format!("{}:wrong", registry_user()));
    assert_eq!(status(addr, "GET", "/v2/", None), 401);
    assert_eq!(status(addr, "GET", "/v2/", Some(&bad)), 401);
    assert_eq!(status(addr, "GET", "/v2/", Some(&good)), 200);
    for repo in [REGISTRY_SMALL_REPO, REGISTRY_LARGE_REPO] {
        let path = format!("/v2/{repo}/manifests/{REGISTRY_TAG}");
        assert_eq!(status(addr, "HEAD", &path, Some(&good)), 200, "{path}");
        assert_eq!(status(addr, "HEAD", &path, None), 401, "{path}");
    }
}

#[test]
#[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
fn pulling_from_the_registry_without_credentials_is_refused() {
    require_docker();
    // An empty client config: whatever the user's ~/.docker holds does not count.
    let config = tempfile::tempdir().unwrap();
    let mut pull = Command::new("docker");
    let pull = pull
        .args(["pull", &registry_small_image()])
        .stdin(Stdio::null());
    let output = pull.env("DOCKER_CONFIG", config.path()).output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no basic auth credentials") || stderr.contains("unauthorized"),
        "{stderr}"
    );
}
