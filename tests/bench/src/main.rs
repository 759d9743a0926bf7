//! The benchmark: the shim side by side with raw Docker, measured in one run, printed as a
//! table and written to `target/bench.json` (see `docs/BENCHMARKS.md`). Nothing is asserted;
//! every wait is bounded. `cargo xtask bench [--quick] [--no-docker] [FIGURE..]` makes the
//! fixtures ready (Docker, the test image, the registry) and runs this program with those
//! arguments; `cargo run -p shim-bench -- ARGS` runs it on a machine already set up.
//!
//! - [`micro`]: durable `task.json` writes and the engine on the fake runtime (no Docker);
//! - [`latency`]: (1) container exit → `terminated` against the raw `die` event, host and
//!   bridge network; (5) submit → running against a raw create + start;
//! - [`load`]: (3) tasks/s at concurrency 4 and 16 and (4) dockerd CPU per started task;
//! - [`scale`]: (2) idle dockerd CPU with 100 and 300 running tasks with and without the shim,
//!   (7) the shim's RSS at 300, (6) SIGKILL → all of 300 and 1,000 tasks `running` again;
//! - [`micro::pull`]: (8) a pull through the runtime against the raw API (issue 28, goal
//!   ≤ 1.02×), `crates/shim-runtime/benches/pull.rs`;
//! - [`micro::requests`]: (9) a Docker request on the runtime's pooled connections against
//!   a new connection each (issue 37), `crates/shim-runtime/benches/requests.rs`;
//! - [`fleet`]: the shim and the raw containers being compared (same image, same runner, a
//!   runner that waits on a FIFO at no cost), dockerd's CPU time;
//! - [`raw`]: the raw fleet's Docker client, bollard behind a blocking facade (create, start,
//!   inspect, list, remove, the `/events` stream);
//! - [`stream`]: event streams stamped as they arrive (Docker's `/events`, the shim's
//!   `GET /api/events`);
//! - [`report`], [`clock`]: figures, goals, tables, timestamps.
//!
//! Shim and raw samples alternate (shim, raw, raw, shim, …) so that a drift of the machine
//! touches both alike.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "the bench is a command-line program that reports to the person running it"
)]

mod clock;
mod fleet;
mod latency;
mod load;
mod micro;
mod raw;
mod report;
mod scale;
mod stream;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};
use shim_e2e::harness;

use report::{Comparison, Row};
use shim_e2e::harness::procs;

/// What `cargo xtask bench` can measure, by the name given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fig {
    /// `task.json` durable writes (no Docker).
    Store,
    /// The engine on the fake runtime (no Docker).
    Engine,
    /// (1) exit → terminated.
    ExitLatency,
    /// (2) idle dockerd CPU.
    IdleCpu,
    /// (3) and (4) tasks/s and dockerd CPU per task.
    Throughput,
    /// (5) submit → running.
    SubmitLatency,
    /// (6) SIGKILL → all running.
    Restart,
    /// (7) RSS.
    Rss,
    /// (8) a pull through the runtime against the raw API.
    Pull,
    /// (9) a Docker request on a pooled connection against a new connection each.
    Requests,
}

impl Fig {
    const ALL: [(Fig, &'static str); 10] = [
        (Fig::Store, "store"),
        (Fig::Engine, "engine"),
        (Fig::ExitLatency, "exit-latency"),
        (Fig::IdleCpu, "idle-cpu"),
        (Fig::Throughput, "throughput"),
        (Fig::SubmitLatency, "submit-latency"),
        (Fig::Restart, "restart"),
        (Fig::Rss, "rss"),
        (Fig::Pull, "pull"),
        (Fig::Requests, "requests"),
    ];

    fn needs_docker(self) -> bool {
        !matches!(self, Fig::Store | Fig::Engine)
    }

    /// The names, for the usage text.
    pub fn names() -> String {
        Self::ALL.map(|(_, name)| name).join(", ")
    }
}

/// Options of `cargo xtask bench`.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Few samples and small task counts, the debug build: a smoke run of the harness.
    pub quick: bool,
    /// Skip the figures that need Docker.
    pub no_docker: bool,
    /// The figures to measure (empty: all; with `--quick`, all that need Docker).
    pub figures: Vec<Fig>,
}

impl Options {
    /// Parses `[--quick] [--no-docker] [FIGURE..]`.
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut opts = Options::default();
        for arg in args {
            match arg.as_str() {
                "--quick" => opts.quick = true,
                "--no-docker" => opts.no_docker = true,
                name => match Fig::ALL.iter().find(|(_, n)| *n == name) {
                    Some((fig, _)) => opts.figures.push(*fig),
                    None => bail!(
                        "unknown bench argument `{name}` (flags: --quick, --no-docker; figures: {})",
                        Fig::names()
                    ),
                },
            }
        }
        Ok(opts)
    }

    fn selected(&self) -> Vec<Fig> {
        let all: Vec<Fig> = if self.figures.is_empty() {
            Fig::ALL
                .iter()
                .map(|(f, _)| *f)
                .filter(|f| !self.quick || f.needs_docker())
                .collect()
        } else {
            self.figures.clone()
        };
        all.into_iter()
            .filter(|f| !(self.no_docker && f.needs_docker()))
            .collect()
    }
}

/// What the Docker figures share.
pub struct Ctx {
    quick: bool,
    figures: Vec<Fig>,
    binary: PathBuf,
    scratch: fleet::Scratch,
}

impl Ctx {
    /// `quick` or `full`, by mode.
    fn pick(&self, quick: usize, full: usize) -> usize {
        if self.quick { quick } else { full }
    }

    fn wants(&self, fig: Fig) -> bool {
        self.figures.contains(&fig)
    }
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!(
            "usage: shim-bench [--quick] [--no-docker] [FIGURE..]\nFIGURE: {}",
            Fig::names()
        );
        return std::process::ExitCode::SUCCESS;
    }
    match Options::parse(&args).and_then(|opts| bench(&opts)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// `shim-bench [--quick] [--no-docker] [FIGURE..]`.
pub fn bench(opts: &Options) -> Result<()> {
    let started = Instant::now();
    // Other work on the machine shows in every figure: the load average at start and end.
    let host_at_start = host();
    let figures = opts.selected();
    let mut rows: Vec<Row> = Vec::new();
    let mut comparisons: Vec<Comparison> = Vec::new();
    if figures.contains(&Fig::Store) {
        println!("=== store: durable task.json writes");
        rows.extend(micro::store(opts.quick)?);
    }
    if figures.contains(&Fig::Engine) {
        println!("\n=== engine on the fake runtime");
        rows.extend(micro::engine(opts.quick)?);
    }
    let mut context = Value::Null;
    let measured = docker_figures(opts, &figures, &mut comparisons, &mut context);

    report::print_rows(&rows);
    report::print_comparisons(&comparisons);
    let path = harness::target_dir().join("bench.json");
    let out = json!({
        "date": procs::output(std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]))
            .map(|d| d.trim().to_owned())
            .unwrap_or_default(),
        "host": host_at_start,
        "loadavg_at_end": fs_err::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "quick": opts.quick,
        "docker": context,
        "error": measured.as_ref().err().map(|e| format!("{e:#}")),
        "figures": comparisons.iter().map(Comparison::json).collect::<Vec<_>>(),
        "micro": report::rows_json(&rows),
    });
    fs_err::write(&path, serde_json::to_vec_pretty(&out)?)?;
    println!(
        "\nbench: wrote {} (took {:.0}s)",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    measured
}

/// The figures that need Docker (what was measured stays in `comparisons` if one fails).
fn docker_figures(
    opts: &Options,
    figures: &[Fig],
    comparisons: &mut Vec<Comparison>,
    context: &mut Value,
) -> Result<()> {
    if figures.iter().any(|f| f.needs_docker()) {
        println!("\n=== docker: the shim against raw Docker");
        let private = raw::private_daemon();
        // Another build of the shim (an earlier commit's, to compare on the same daemon in the
        // same hour) instead of this tree's.
        let binary = match std::env::var_os("SHIM_BENCH_BINARY") {
            Some(path) => {
                let path = PathBuf::from(path);
                anyhow::ensure!(
                    path.is_file(),
                    "SHIM_BENCH_BINARY: no file {}",
                    path.display()
                );
                println!("bench: the shim is {} (SHIM_BENCH_BINARY)", path.display());
                path
            }
            None => {
                let profile = if opts.quick { "" } else { " --release" };
                println!("$ cargo build -p dstack-shim --bin dstack-shim{profile}");
                // Bounded only against a hang: a cold release build on a busy 2-core
                // machine takes long.
                harness::build_shim(!opts.quick, std::time::Duration::from_secs(3600))
                    .context("could not build dstack-shim")?
            }
        };
        let scratch = fleet::Scratch::new()?;
        scratch.docker.ping()?;
        if private && !scratch.docker.has_image(&shim_e2e::image())? {
            bail!(
                "the daemon of DOCKER_HOST lacks {0}: docker save {0} | DOCKER_HOST=… docker load",
                shim_e2e::image()
            );
        }
        let others_before = foreign_containers(&scratch)?;
        if others_before > 0 {
            println!(
                "bench: warning: {others_before} other container(s) on this daemon; their \
                 activity is part of dockerd's CPU time"
            );
        }
        *context = json!({
            "profile": if opts.quick { "debug" } else { "release" },
            "binary": binary,
            "socket": raw::socket_path(),
            "dockerd_pid": fleet::dockerd_pid()?,
            "other_containers_at_start": others_before,
        });
        let ctx = Ctx {
            quick: opts.quick,
            figures: figures.to_vec(),
            binary,
            scratch,
        };
        if ctx.wants(Fig::ExitLatency) {
            latency::exit_latency(&ctx, comparisons)?;
        }
        if ctx.wants(Fig::SubmitLatency) {
            latency::submit_latency(&ctx, comparisons)?;
        }
        if ctx.wants(Fig::Throughput) {
            load::throughput(&ctx, comparisons)?;
        }
        if ctx.wants(Fig::IdleCpu) || ctx.wants(Fig::Restart) || ctx.wants(Fig::Rss) {
            scale::scale(&ctx, comparisons)?;
        }
        if ctx.wants(Fig::Pull) {
            println!("\n=== (8) a pull through the runtime against the raw API");
            comparisons.push(micro::pull(ctx.quick)?);
        }
        if ctx.wants(Fig::Requests) {
            println!("\n=== (9) Docker requests: the runtime's pool against a new connection each");
            comparisons.push(micro::requests(ctx.quick)?);
        }
        let left = ctx.scratch.raw_remove_all()?;
        anyhow::ensure!(left == 0, "{left} raw containers were left behind");
        context["other_containers_at_end"] = json!(foreign_containers(&ctx.scratch)?);
    }
    Ok(())
}

/// Containers on the daemon that are not this run's (other users of the daemon).
fn foreign_containers(scratch: &fleet::Scratch) -> Result<usize> {
    let all = harness::try_docker(&["ps", "-aq"])?;
    let mine = scratch.docker.list(fleet::RAW_LABEL, &scratch.run)?.len();
    Ok(String::from_utf8_lossy(&all.stdout)
        .lines()
        .count()
        .saturating_sub(mine))
}

/// Runs `f` on every item, `threads` at a time, and returns the results in order.
pub fn parallel<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<R>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(items.len().max(1)) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(item) = items.get(i) else { return };
                    let result = f(item);
                    if let Ok(mut slot) = results[i].lock() {
                        *slot = Some(result);
                    }
                }
            });
        }
    });
    results
        .into_iter()
        .filter_map(|slot| slot.into_inner().ok().flatten())
        .collect()
}

/// What the figures were measured on.
fn host() -> Value {
    let read = |path: &str| {
        fs_err::read_to_string(path)
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    };
    let cpu_model = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, m)| m.trim().to_owned())
        .unwrap_or_default();
    let mem_kib = |key: &str| {
        read("/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|k| k.parse::<u64>().ok())
            .unwrap_or(0)
    };
    json!({
        "cpus": std::thread::available_parallelism().map(usize::from).unwrap_or(0),
        "cpu_model": cpu_model,
        "mem_mib": mem_kib("MemTotal:") / 1024,
        "mem_available_mib": mem_kib("MemAvailable:") / 1024,
        "kernel": read("/proc/sys/kernel/osrelease"),
        "loadavg": read("/proc/loadavg"),
        "debian": read("/etc/debian_version"),
        "docker": harness::docker::server_version().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_picked_by_name_and_mode() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let all = Options::parse(&[]).unwrap().selected();
        assert_eq!(all.len(), 10);
        let quick = Options::parse(&args(&["--quick"])).unwrap().selected();
        assert!(!quick.contains(&Fig::Store) && quick.contains(&Fig::Restart));
        let picked = Options::parse(&args(&["exit-latency", "rss"])).unwrap();
        assert_eq!(picked.selected(), [Fig::ExitLatency, Fig::Rss]);
        let no_docker = Options::parse(&args(&["--no-docker"])).unwrap().selected();
        assert_eq!(no_docker, [Fig::Store, Fig::Engine]);
        assert!(Options::parse(&args(&["--fast"])).is_err());
    }

    #[test]
    fn parallel_keeps_the_order() {
        let items: Vec<u32> = (0..50).collect();
        let out = parallel(&items, 7, |i| i * 2);
        assert_eq!(out, items.iter().map(|i| i * 2).collect::<Vec<_>>());
    }
}
