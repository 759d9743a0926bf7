//! `cargo xtask conformance [ENGINE..]`: the runtime crate's engine tests and the API lifecycle
//! of the release binary (`tests/dstack-server/lifecycle.py`, dstack's own `ShimClient`) on
//! every conformance engine ([`engines::CONFORMANCE`]), one at a time, each started for its
//! run and stopped after it; then the engine table. `ci` runs it after the whole suite and
//! adds the main engine's row.

use std::io::{BufRead as _, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use shim_e2e::harness::cargo;
use shim_e2e::{ENV_TEST_DOCKER, dist_artifact, dstack_python, repo_root};

use crate::cmd;
use crate::engines::{self, Engine, Row};

/// Runs `command`, its output passed through as it comes and kept; the exit status and the
/// output.
pub fn run_teed(command: &mut Command) -> Result<(bool, String)> {
    let line = cmd::display(command);
    println!("$ {line}");
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{line}`"))?;
    let pass = |stream: Option<Box<dyn Read + Send>>, to_stderr: bool| {
        std::thread::spawn(move || {
            let mut kept = String::new();
            let Some(stream) = stream else { return kept };
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if to_stderr {
                    eprintln!("{line}");
                } else {
                    println!("{line}");
                }
                kept.push_str(&line);
                kept.push('\n');
            }
            kept
        })
    };
    let out = pass(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        false,
    );
    let err = pass(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        true,
    );
    let status = child
        .wait()
        .with_context(|| format!("could not wait for `{line}`"))?;
    let mut kept = out.join().unwrap_or_default();
    kept.push_str(&err.join().unwrap_or_default());
    Ok((status.success(), kept))
}

/// The runtime crate's engine tests on `engine` (in its network namespace): passed and
/// failed counts (a run that printed no closing line counts as one failure).
fn runtime_tests(engine: &Engine) -> Result<(u32, u32)> {
    let mut command = engine.command_in(cargo());
    command
        .current_dir(repo_root())
        .args([
            "nextest",
            "run",
            "-p",
            "shim-runtime",
            "--test",
            "docker",
            "--no-fail-fast",
            "--run-ignored",
            "all",
        ])
        .env(ENV_TEST_DOCKER, "1");
    let (ok, output) = run_teed(&mut command)?;
    let (passed, failed) = counted(ok, &output);
    // Every test of the file is an engine test: one skipped did not run on this engine.
    Ok((passed, failed + engines::skipped(&output).unwrap_or(0)))
}

/// The API lifecycle of the release binary against `engine`, driven by dstack's client.
pub fn lifecycle(engine: &Engine, shim: &Path) -> Result<(u32, u32)> {
    let work = tempfile::Builder::new()
        .prefix("lifecycle-")
        .tempdir_in(std::env::temp_dir())?;
    let mut command = engine.command_in(dstack_python());
    command
        .current_dir(repo_root())
        .arg(repo_root().join("tests/dstack-server/lifecycle.py"))
        .arg("--shim")
        .arg(shim)
        .args(["--docker-host", &engine.docker_host()])
        .arg("--work")
        .arg(work.path());
    let (ok, output) = run_teed(&mut command)?;
    Ok(counted(ok, &output))
}

/// GPU tasks of the release binary against `engine` on a fake NVIDIA host
/// (`tests/dstack-server/gpu_lifecycle.py`, dstack's client): the counts, and in `gpu` the
/// shim's way (`cdi`, `legacy`, `refused`) with why.
pub fn gpu_lifecycle(engine: &Engine, shim: &Path, gpu: &mut String) -> Result<(u32, u32)> {
    let mut command = engine.command_in(dstack_python());
    command
        .current_dir(repo_root())
        .arg(repo_root().join("tests/dstack-server/gpu_lifecycle.py"))
        .arg("--shim")
        .arg(shim)
        .args(["--docker-host", &engine.docker_host()]);
    let (ok, output) = run_teed(&mut command)?;
    if let Some(mode) = output
        .lines()
        .find_map(|line| line.strip_prefix("gpu-mode: "))
    {
        *gpu = mode.to_owned();
    }
    Ok(counted(ok, &output))
}

fn counted(ok: bool, output: &str) -> (u32, u32) {
    match engines::counts(output) {
        Some((passed, failed)) if ok || failed > 0 => (passed, failed),
        Some((passed, _)) => (passed, 1),
        None => (0, 1),
    }
}

/// One conformance engine: started, its image loaded, both parts run, stopped.
pub fn run_engine(engine: &Engine, shim: &Path) -> Row {
    let started = Instant::now();
    let mut row = Row {
        engine: engine.name.to_owned(),
        version: "-".to_owned(),
        store: engine.store().to_owned(),
        ..Row::default()
    };
    println!("\n=== conformance: {}", engine.name);
    match engine.start().and_then(|()| engine.load_test_image()) {
        Err(err) => {
            println!("conformance: {} did not start: {err:#}", engine.name);
            row.note = format!("did not start: {}", first_line(&format!("{err:#}")));
        }
        Ok(()) => {
            row.version = engine.version().unwrap_or_else(|| "-".to_owned());
            if let Some(driver) = engine.driver() {
                row.store = format!("{} ({driver})", engine.store());
            }
            for (part, result) in [
                ("runtime", runtime_tests(engine)),
                ("lifecycle", lifecycle(engine, shim)),
                ("gpu", gpu_lifecycle(engine, shim, &mut row.gpu)),
            ] {
                let (passed, failed) = result.unwrap_or_else(|err| {
                    println!("conformance: {part} on {}: {err:#}", engine.name);
                    (0, 1)
                });
                row.parts.push((part.to_owned(), passed, failed));
            }
        }
    }
    if let Err(err) = engine.stop() {
        println!("conformance: stopping {}: {err:#}", engine.name);
    }
    row.seconds = started.elapsed().as_secs_f64();
    row
}

fn first_line(text: &str) -> String {
    text.lines()
        .next()
        .unwrap_or_default()
        .chars()
        .take(80)
        .collect()
}

/// The engines named (all conformance engines when none is), run one after the other.
pub fn conformance(names: &[String]) -> Result<Vec<Row>> {
    let chosen: Vec<&Engine> = if names.is_empty() {
        engines::CONFORMANCE.iter().collect()
    } else {
        names
            .iter()
            .map(|name| {
                engines::CONFORMANCE
                    .iter()
                    .find(|e| e.name == name)
                    .with_context(|| {
                        format!(
                            "no conformance engine {name}; there are: {}",
                            engines::CONFORMANCE
                                .iter()
                                .map(|e| e.name)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    })
            })
            .collect::<Result<_>>()?
    };
    let shim = dist_artifact(shim_e2e::DSTACK_VERSION);
    if !shim.is_file() {
        bail!(
            "{} is missing: run `cargo xtask dist` first",
            shim.display()
        );
    }
    engines::ensure_roots()?;
    // The runtime tests are built once, before any engine runs.
    cmd::run(cmd::cmd(cargo()).current_dir(repo_root()).args([
        "nextest",
        "run",
        "--no-run",
        "-p",
        "shim-runtime",
        "--test",
        "docker",
    ]))?;
    Ok(chosen.into_iter().map(|e| run_engine(e, &shim)).collect())
}
