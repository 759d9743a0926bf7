//! Docker requests through the runtime's keep-alive pool against the same requests each on a
//! new connection (bollard's own Unix client; issue 37), in one run.
//!
//! `cargo bench -p shim-runtime --bench requests -- [--quick] [--json PATH]`, with a Docker
//! daemon on a Unix socket (`DOCKER_HOST` picks it).
//!
//! One container of the test image is created (never started). Each round runs a batch of
//! the engine's most frequent small requests, `GET /containers/{id}/json` and a label-filtered
//! `GET /containers/json`, sequentially through [`DockerRuntime::connect_unix`] with the pool
//! (`POOL_MAX_IDLE`) and without it (a new connection per request), the order alternating.
//! Reported: the median wall time of a request and the client's own CPU time per request
//! (`/proc/self/stat`, this process is the client), pooled against fresh. Nothing is
//! asserted. Run without `--bench`, it says so and does nothing: it needs a daemon.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark program that reports to the person running it"
)]

mod common;

use std::path::PathBuf;
use std::time::Instant;

use bollard::models::ContainerCreateBody;
use bollard::query_parameters::{CreateContainerOptionsBuilder, RemoveContainerOptionsBuilder};
use serde_json::json;
use shim_runtime::{ContainerRuntime as _, DockerRuntime, POOL_MAX_IDLE};

/// The label of the bench's container.
const LABEL: &str = "dev.dstack-shim.bench-requests";

fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// This process's CPU time (user + system), seconds.
fn cpu_seconds() -> f64 {
    let stat = fs_err::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap();
    let ticks = |i: usize| fields[i].parse::<u64>().unwrap();
    (ticks(11) + ticks(12)) as f64 / 100.0
}

/// One batch: `n` requests (an inspect, every fifth a list); each request's seconds, and the
/// CPU seconds of the whole batch.
async fn batch(runtime: &DockerRuntime, id: &str, value: &str, n: usize) -> (Vec<f64>, f64) {
    let labels = [(LABEL.to_owned(), value.to_owned())];
    let cpu = cpu_seconds();
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        if i % 5 == 4 {
            let listed = runtime.list(&labels).await.unwrap();
            assert_eq!(listed.len(), 1);
        } else {
            runtime.inspect(id).await.unwrap();
        }
        times.push(t.elapsed().as_secs_f64());
    }
    (times, cpu_seconds() - cpu)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let common::Args {
        quick,
        benching,
        json: json_path,
    } = common::Args::parse();
    if !benching {
        println!("requests bench: needs a Docker daemon; run it with cargo bench");
        return;
    }
    let host = std::env::var("DOCKER_HOST")
        .unwrap_or_else(|_| shim_runtime::DEFAULT_DOCKER_HOST.to_owned());
    let socket = PathBuf::from(host.strip_prefix("unix://").expect("a unix:// DOCKER_HOST"));
    let pooled = DockerRuntime::connect_unix(&socket, POOL_MAX_IDLE)
        .await
        .expect("a Docker daemon");
    let fresh = DockerRuntime::connect_unix(&socket, 0)
        .await
        .expect("a Docker daemon");
    let value = format!("r{}", std::process::id());
    let name = format!("shim-bench-requests-{value}");
    let body = ContainerCreateBody {
        image: Some(shim_e2e::image()),
        cmd: Some(vec!["true".to_owned()]),
        labels: Some([(LABEL.to_owned(), value.clone())].into()),
        ..ContainerCreateBody::default()
    };
    let id = pooled
        .client()
        .create_container(
            Some(CreateContainerOptionsBuilder::new().name(&name).build()),
            body,
        )
        .await
        .expect("create the bench's container (cargo xtask dev-env makes the image)")
        .id;
    let (rounds, n) = if quick { (2, 100) } else { (8, 500) };
    let (mut p_times, mut f_times) = (Vec::new(), Vec::new());
    let (mut p_cpu, mut f_cpu) = (0.0, 0.0);
    for round in 0..rounds {
        let order: [bool; 2] = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_pooled in order {
            let runtime = if is_pooled { &pooled } else { &fresh };
            let (times, cpu) = batch(runtime, &id, &value, n).await;
            let mut sorted = times.clone();
            println!(
                "round {round}: {} median {:.0} µs, client CPU {:.0} µs/request",
                if is_pooled { "pooled" } else { "fresh " },
                median(&mut sorted) * 1e6,
                cpu / n as f64 * 1e6
            );
            if is_pooled {
                p_times.extend(times);
                p_cpu += cpu;
            } else {
                f_times.extend(times);
                f_cpu += cpu;
            }
        }
    }
    let options = RemoveContainerOptionsBuilder::new().force(true).build();
    pooled
        .client()
        .remove_container(&id, Some(options))
        .await
        .unwrap();
    let total = (rounds * n) as f64;
    let (m_p, m_f) = (median(&mut p_times), median(&mut f_times));
    let (c_p, c_f) = (p_cpu / total, f_cpu / total);
    println!(
        "a request (inspect, every fifth a label-filtered list), median of {total}: pooled {:.0} µs, \
         a new connection each {:.0} µs, ratio {:.3}; client CPU per request {:.0} µs against {:.0} µs",
        m_p * 1e6,
        m_f * 1e6,
        m_p / m_f,
        c_p * 1e6,
        c_f * 1e6
    );
    if let Some(path) = json_path {
        let out = json!({
            "requests": total,
            "pooled_median_us": m_p * 1e6,
            "fresh_median_us": m_f * 1e6,
            "pooled_cpu_us_per_request": c_p * 1e6,
            "fresh_cpu_us_per_request": c_f * 1e6,
        });
        fs_err::write(&path, serde_json::to_vec_pretty(&out).unwrap()).unwrap();
    }
}
