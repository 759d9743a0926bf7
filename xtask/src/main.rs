//! Developer tasks of the dstack-shim workspace, run as `cargo xtask <command>`.
//!
//! - `dev-env [--check]`: make this machine ready for the tests (Debian 12, as root): install
//!   Docker and the fixture tools, start `dockerd` if needed, build the local test image, run
//!   the local registry and push the registry images. Idempotent; `--check` only reports.
//! - `ci`: `dev-env`, then fmt, clippy, cargo-deny, the release artifacts (`dist` for two
//!   releases), all tests, `bench --quick`, docs, `package`; a timing summary at the end.
//! - `package`: `cargo package` of the publishable crates and the binary, each verified.
//! - `run [ARGS..]`: start Docker if needed and run the shim against it, with its home under
//!   `target/shim-home`; `ARGS` are passed to `dstack-shim`.
//! - `demo [--large]`: one task's life on the real shim and Docker (pull with credentials, GPUs,
//!   ports, runner exit, remove, shutdown), narrated: the fixtures, then the example
//!   `tests/examples/demo.rs`.
//! - `dist [--upstream-version V] [--arch amd64|arm64|all] [--out DIR]`: the release
//!   artifact (stripped, glibc 2.17, debug file, checksum) under `target/dist/<V>/`.
//! - `bench [--quick] [--no-docker] [FIGURE..]`: the shim side by side with raw Docker, a
//!   table and `target/bench.json` (see `docs/BENCHMARKS.md`): the fixtures, then the
//!   bench's own program (`tests/bench`, package `shim-bench`).
//! - `conformance [ENGINE..]`: the runtime crate's engine tests and the release binary's API
//!   lifecycle on each conformance engine (Docker 20.10, 26 and 28 with either image store,
//!   Podman 4.3 and 5), then the engine table.
//!
//! The fixture names live in the `shim-e2e` library (`tests/src/lib.rs`).

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "xtask is a command-line tool that reports to the person running it"
)]

mod ci;
mod cmd;
mod conformance;
mod devenv;
mod dist;
mod docker;
mod engines;
mod image;
mod mounts;
mod packages;
mod paths;
mod qemu;
mod registry;
mod rootfs;
mod run;

use std::process::ExitCode;

use anyhow::{Context as _, Result, bail};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  dev-env [--check]   install and start Docker, build the test image, run the test registry
                      (idempotent); --check only reports what is missing
  ci [--skip-dev-env] dev-env, fmt, clippy, cargo-deny, dist (two releases), tests (nextest),
                      bench --quick, docs (missing docs denied), package; timing summary
  package             cargo package of every crate but the test ones, each built from its
                      package alone (as crates.io would take it)
  run [ARGS..]        start Docker if needed, then run dstack-shim with
                      --shim-home <repo>/target/shim-home and ARGS
  demo [--large]      start dstack-shim on a temp home with the stub runner and 2 fake GPUs,
                      run one task (registry pull with credentials, bridge ports, 1 GPU)
                      to done_by_runner, remove it, shut down; prints every step;
                      --large pulls the 220 MiB registry image (pull progress moves)
  dist [--upstream-version V] [--arch amd64|arm64|all] [--out DIR]
                      the release artifact for dstack release V (default: the one the tests
                      use): stripped, needs glibc <= 2.17, debug info beside it, .sha256;
                      in DIR/V/dstack-shim-linux-<arch> (default DIR: target/dist)
  bench [--quick] [--no-docker] [FIGURE..]
                      the release shim side by side with raw Docker in one run, plus store
                      writes and the engine on the fake runtime: a table and
                      target/bench.json. FIGURE: store, engine, exit-latency, idle-cpu,
                      throughput, submit-latency, restart, rss (default: all; --quick: few
                      samples, small task counts, the debug build, Docker figures only)
  engine start|stop ENGINE
                      start a conformance engine (in its own network namespace, with the
                      test image and a registry copy) and leave it running, or stop it
  conformance [ENGINE..]
                      the runtime crate's engine tests and the release binary's API
                      lifecycle (dstack's client) on each conformance engine, or those
                      named: docker-bookworm (20.10), docker-trixie[-containerd] (26),
                      docker-sid (28, classic store), podman-bookworm (4.3), podman-trixie
                      (5); needs `cargo xtask dist`; prints the engine table
  help                this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match dispatch(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn dispatch(args: &[String]) -> Result<()> {
    let (command, rest) = match args.split_first() {
        Some((command, rest)) => (command.as_str(), rest),
        None => {
            print!("{USAGE}");
            bail!("no command given");
        }
    };
    match command {
        "dev-env" => match flags(rest, &["--check"])?.as_slice() {
            [] => devenv::dev_env(),
            _ => devenv::check(),
        },
        "ci" => {
            let skip_dev_env = !flags(rest, &["--skip-dev-env"])?.is_empty();
            ci::ci(skip_dev_env)
        }
        "package" => {
            flags(rest, &[])?;
            ci::package(&shim_e2e::repo_root())
        }
        "run" => run::run(rest),
        "demo" => {
            flags(rest, &["--large"])?;
            devenv::ensure_fixtures()?;
            cmd::run(
                cmd::cmd(shim_e2e::harness::cargo())
                    .current_dir(shim_e2e::repo_root())
                    .args(["run", "-q", "-p", "shim-e2e", "--example", "demo", "--"])
                    .args(rest),
            )
        }
        "dist" => dist::dist(&dist::Options::parse(rest)?),
        "bench" => bench(rest),
        "engine" => match rest {
            [verb, name] if verb == "start" || verb == "stop" => {
                let engine = engines::CONFORMANCE
                    .iter()
                    .find(|e| e.name == name)
                    .with_context(|| format!("no conformance engine {name}"))?;
                if verb == "stop" {
                    return engine.stop();
                }
                engine.start()?;
                engine.load_test_image()?;
                println!(
                    "engine {name} runs: DOCKER_HOST={} in network namespace {}\n\
                     run tests with: nsenter --net=/run/netns/{} env DOCKER_HOST={} \
                     SHIM_TEST_DOCKER=1 cargo nextest run --run-ignored all ...",
                    engine.docker_host(),
                    engine.netns().unwrap_or_default(),
                    engine.netns().unwrap_or_default(),
                    engine.docker_host()
                );
                Ok(())
            }
            _ => bail!("usage: cargo xtask engine start|stop ENGINE"),
        },
        "conformance" => {
            let rows = conformance::conformance(rest)?;
            println!("\n{}", engines::table(&rows));
            let failed: Vec<&str> = rows
                .iter()
                .filter(|row| !row.passed())
                .map(|row| row.engine.as_str())
                .collect();
            if failed.is_empty() {
                Ok(())
            } else {
                bail!("conformance failed on {}", failed.join(", "))
            }
        }
        "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            print!("{USAGE}");
            bail!("unknown command `{other}`")
        }
    }
}

/// `cargo xtask bench ARGS`: the fixtures (unless `--no-docker`), then the bench's own
/// program (`tests/bench`), which parses `ARGS`.
fn bench(args: &[String]) -> Result<()> {
    if !args.iter().any(|arg| arg == "--no-docker") {
        devenv::ensure_fixtures()?;
    }
    cmd::run(
        cmd::cmd(shim_e2e::harness::cargo())
            .current_dir(shim_e2e::repo_root())
            .args(["run", "-q", "-p", "shim-bench", "--"])
            .args(args),
    )
}

/// The given `args`, each of which must be one of `allowed`.
fn flags<'a>(args: &'a [String], allowed: &[&str]) -> Result<Vec<&'a str>> {
    args.iter()
        .map(|arg| {
            if allowed.contains(&arg.as_str()) {
                Ok(arg.as_str())
            } else {
                bail!(
                    "unexpected argument `{arg}` (allowed: {})",
                    allowed.join(", ")
                )
            }
        })
        .collect()
}
