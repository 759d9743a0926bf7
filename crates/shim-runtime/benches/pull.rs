//! A pull through the runtime against the same pull through the raw Engine API, in one run
//! (issue 28: watching progress must not slow a pull; goal ≤ 1.02×).
//!
//! `cargo bench -p shim-runtime --bench pull -- [--quick] [--json PATH]`, with a Docker daemon
//! and the dev-env registry (`cargo xtask dev-env`; `DOCKER_HOST` picks the daemon).
//!
//! Each round pushes two images of fresh random content to the test registry (so each pull
//! downloads its top layer, whatever the daemon's content store kept) and pulls one with
//! [`DockerRuntime::pull`] (the shim's pull: progress folded from every message, the stall
//! watchdog, the pull log written to disk, a progress callback) and the other with bollard's
//! bare `create_image` stream, read to its end and dropped; both straight from the registry on
//! loopback, the fastest link there is, where any cost of watching shows most. The order
//! alternates (runtime, raw, raw, runtime, …). Each image is removed after its pull.
//!
//! Prints the medians and their ratio; with `--json PATH` also writes them (used by
//! `cargo xtask bench`). Nothing is asserted. Run without `--bench` (as `cargo test
//! --all-targets` does), it says so and does nothing: it needs a daemon and the registry.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark program that reports to the person running it"
)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::auth::DockerCredentials;
use bollard::query_parameters::{CreateImageOptionsBuilder, RemoveImageOptionsBuilder};
use futures_util::StreamExt as _;
use serde_json::json;
use shim_e2e::harness::FreshImage;
use shim_runtime::{ContainerRuntime as _, DockerRuntime, PullRequest, RegistryAuth};
use shim_task::PullProgress;
use tokio_util::sync::CancellationToken;

/// Random bytes in each image's fresh layer.
const PAYLOAD: usize = 48 << 20;

fn auth() -> RegistryAuth {
    let var = |name: &str, default: &str| {
        std::env::var(name)
            .ok()
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| default.to_owned())
    };
    RegistryAuth {
        username: var("SHIM_TEST_REGISTRY_USER", "shimtest"),
        password: var("SHIM_TEST_REGISTRY_PASSWORD", "shimtest-pw"),
    }
}

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Pulls `image` through the runtime, as the engine does; seconds.
async fn through_runtime(runtime: &DockerRuntime, image: &str, log: PathBuf) -> f64 {
    let request = PullRequest::new(image)
        .with_auth(Some(auth()))
        .with_log_path(Some(log))
        .with_timeout(Some(Duration::from_secs(7200)))
        .with_stall_timeout(Some(Duration::from_secs(600)));
    let seen = std::sync::atomic::AtomicU64::new(0);
    let progress = |p: PullProgress| {
        seen.store(p.downloaded_bytes, std::sync::atomic::Ordering::Relaxed);
    };
    let started = Instant::now();
    runtime
        .pull(&request, &progress, CancellationToken::new())
        .await
        .unwrap_or_else(|e| panic!("pull {image}: {e}"));
    started.elapsed().as_secs_f64()
}

/// Pulls `image` with bollard's bare stream; seconds.
async fn raw(docker: &Docker, image: &str) -> f64 {
    let a = auth();
    let credentials = DockerCredentials {
        username: Some(a.username),
        password: Some(a.password),
        ..DockerCredentials::default()
    };
    let options = CreateImageOptionsBuilder::new().from_image(image).build();
    let started = Instant::now();
    let mut stream = docker.create_image(Some(options), None, Some(credentials));
    while let Some(item) = stream.next().await {
        item.unwrap_or_else(|e| panic!("raw pull {image}: {e}"));
    }
    started.elapsed().as_secs_f64()
}

async fn remove(docker: &Docker, image: &str) {
    let options = RemoveImageOptionsBuilder::new().force(true).build();
    docker
        .remove_image(image, Some(options), None)
        .await
        .unwrap_or_else(|e| panic!("remove {image}: {e}"));
}

#[tokio::main]
async fn main() {
    let common::Args {
        quick,
        benching,
        json: json_path,
    } = common::Args::parse();
    if !benching {
        println!("pull bench: needs a Docker daemon and the registry; run it with cargo bench");
        return;
    }
    let rounds = if quick { 2 } else { 12 };
    let runtime = DockerRuntime::connect().await.expect("a Docker daemon");
    let docker = Docker::connect_with_defaults().expect("a Docker daemon");
    let logs = tempfile::tempdir().unwrap();
    let (mut ours, mut bare) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let a = FreshImage::push("shim-bench-pull", PAYLOAD).unwrap();
        let b = FreshImage::push("shim-bench-pull", PAYLOAD).unwrap();
        let (ra, rb) = (a.direct_reference(), b.direct_reference());
        let log = logs.path().join(format!("pull-{round}.log"));
        let (t_ours, t_bare) = if round % 2 == 0 {
            let o = through_runtime(&runtime, &ra, log).await;
            (o, raw(&docker, &rb).await)
        } else {
            let r = raw(&docker, &rb).await;
            (through_runtime(&runtime, &ra, log).await, r)
        };
        println!(
            "round {round}: runtime {:.0} ms, raw {:.0} ms",
            t_ours * 1e3,
            t_bare * 1e3
        );
        ours.push(t_ours);
        bare.push(t_bare);
        remove(&docker, &ra).await;
        remove(&docker, &rb).await;
    }
    let (m_ours, m_bare) = (median(&mut ours), median(&mut bare));
    let mib = PAYLOAD as f64 / f64::from(1u32 << 20);
    println!(
        "pull of a {mib:.0} MiB layer from the registry on loopback, median of {rounds}: \
         runtime {:.0} ms, raw API {:.0} ms, ratio {:.3}",
        m_ours * 1e3,
        m_bare * 1e3,
        m_ours / m_bare
    );
    if let Some(path) = json_path {
        let out = json!({
            "payload_bytes": PAYLOAD,
            "rounds": rounds,
            "runtime_ms": ours.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
            "raw_ms": bare.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
            "runtime_median_ms": m_ours * 1e3,
            "raw_median_ms": m_bare * 1e3,
        });
        fs_err::write(&path, serde_json::to_vec_pretty(&out).unwrap()).unwrap();
    }
}
