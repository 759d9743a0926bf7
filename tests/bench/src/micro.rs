//! The figures that need no Docker daemon: durable `task.json` writes
//! (`crates/shim-store/examples/write_latency.rs`) and the engine on the fake runtime
//! (`crates/shim-engine/benches/engine.rs`), both release builds; and two of the runtime's
//! against the raw API, which need Docker: a pull (`crates/shim-runtime/benches/pull.rs`,
//! also the registry) and small requests through the keep-alive pool against a new
//! connection each (`crates/shim-runtime/benches/requests.rs`).

use std::path::PathBuf;

use anyhow::{Context as _, Result};
use serde_json::Value;
use shim_e2e::harness::{cargo, target_dir};
use std::process::Command;

use super::report::{Comparison, Goal, Row};
use shim_e2e::harness::{procs, scrub_cargo_env};

/// Durable writes with the `write_latency` example: a status write, and a submit's first
/// write alone (a spare directory ready or not) and 8 at a time.
pub fn store(quick: bool) -> Result<Vec<Row>> {
    let count = if quick { "50" } else { "500" };
    let mut command = Command::new(cargo());
    scrub_cargo_env(&mut command);
    command
        .current_dir(shim_e2e::repo_root())
        .args([
            "run",
            "--release",
            "-p",
            "shim-store",
            "--example",
            "write_latency",
            "--",
        ])
        .arg(target_dir())
        .arg(count);
    println!("$ {}", procs::command_line(&command));
    let out = procs::output(&mut command)?;
    let mut rows = Vec::new();
    for line in out.lines() {
        match line.strip_prefix("json ") {
            Some(json) => rows.push(Row::from_json("store", &serde_json::from_str(json)?)?),
            None => println!("{line}"),
        }
    }
    anyhow::ensure!(!rows.is_empty(), "write_latency printed no json");
    Ok(rows)
}

/// Runs `cargo bench -p <package> --bench <bench> -- --json <file> [--quick]` (a
/// criterion-style harness of this workspace) and reads the JSON it wrote.
fn bench_json(package: &str, bench: &str, quick: bool) -> Result<(Value, PathBuf)> {
    let path = target_dir().join(format!("bench-{bench}.json"));
    let mut command = Command::new(cargo());
    scrub_cargo_env(&mut command);
    command
        .current_dir(shim_e2e::repo_root())
        .args(["bench", "-p", package, "--bench", bench, "--"])
        .arg("--json")
        .arg(&path);
    if quick {
        command.arg("--quick");
    }
    let line = procs::command_line(&command);
    println!("$ {line}");
    let status = command
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    anyhow::ensure!(status.success(), "`{line}` failed: {status}");
    let value = serde_json::from_slice(&fs_err::read(&path)?)?;
    Ok((value, path))
}

/// The engine bench on the fake runtime.
pub fn engine(quick: bool) -> Result<Vec<Row>> {
    let (value, path) = bench_json("shim-engine", "engine", quick)?;
    value["benchmarks"]
        .as_array()
        .with_context(|| format!("no benchmarks in {}", path.display()))?
        .iter()
        .map(|b| Row::from_json("engine", b))
        .collect()
}

/// The pull bench: medians of the runtime's pull and of bollard's bare one, same images.
pub fn pull(quick: bool) -> Result<Comparison> {
    let (value, path) = bench_json("shim-runtime", "pull", quick)?;
    let ms = |key: &str| {
        value[key]
            .as_f64()
            .with_context(|| format!("no {key} in {}", path.display()))
    };
    let mib = value["payload_bytes"].as_f64().unwrap_or(0.0) / 1048576.0;
    Ok(Comparison::new(
        "pull_ms",
        format!("(8) pull of a {mib:.0} MiB layer on loopback, median"),
        "ms",
        ms("runtime_median_ms")?,
        Some(ms("raw_median_ms")?),
        Goal::AtMostRawTimes(1.02),
    )
    .with_detail(value))
}

/// The requests bench: a Docker request through the runtime's keep-alive pool against the
/// same request on a new connection each (bollard's own Unix client), medians.
pub fn requests(quick: bool) -> Result<Comparison> {
    let (value, path) = bench_json("shim-runtime", "requests", quick)?;
    let us = |key: &str| {
        value[key]
            .as_f64()
            .with_context(|| format!("no {key} in {}", path.display()))
    };
    Ok(Comparison::new(
        "docker_request_us",
        "(9) a Docker request (inspect; every fifth a list), pooled connection (raw: a new connection each), median",
        "µs",
        us("pooled_median_us")?,
        Some(us("fresh_median_us")?),
        Goal::AtMostRawTimes(1.0),
    )
    .with_detail(value))
}
