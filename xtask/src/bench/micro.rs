//! The figures that need no Docker daemon: durable `task.json` writes
//! (`crates/shim-store/examples/write_latency.rs`) and the engine on the fake runtime
//! (`crates/shim-engine/benches/engine.rs`), both release builds.

use anyhow::{Context as _, Result};
use serde_json::Value;
use shim_e2e::harness::{cargo, target_dir};

use super::report::Row;
use crate::cmd;

/// Durable writes with the `write_latency` example.
pub fn store(quick: bool) -> Result<Row> {
    let count = if quick { "50" } else { "500" };
    let mut command = cmd::cmd(cargo());
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
    println!("$ {}", cmd::display(&command));
    let out = cmd::output(&mut command)?;
    let mut json_line = None;
    for line in out.lines() {
        match line.strip_prefix("json ") {
            Some(json) => json_line = Some(json),
            None => println!("{line}"),
        }
    }
    let value: Value = serde_json::from_str(json_line.context("write_latency printed no json")?)?;
    Row::from_json("store", &value)
}

/// The engine bench on the fake runtime.
pub fn engine(quick: bool) -> Result<Vec<Row>> {
    let path = target_dir().join("bench-engine.json");
    let mut command = cmd::cmd(cargo());
    command
        .current_dir(shim_e2e::repo_root())
        .args(["bench", "-p", "shim-engine", "--bench", "engine", "--"])
        .arg("--json")
        .arg(&path);
    if quick {
        command.arg("--quick");
    }
    cmd::run(&mut command)?;
    let value: Value = serde_json::from_slice(&fs_err::read(&path)?)?;
    value["benchmarks"]
        .as_array()
        .with_context(|| format!("no benchmarks in {}", path.display()))?
        .iter()
        .map(|b| Row::from_json("engine", b))
        .collect()
}
