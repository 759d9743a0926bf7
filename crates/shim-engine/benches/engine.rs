//! Engine overhead without Docker: the engine on the in-memory fake runtime and fake host
//! resources, with real durable state files in a temp home under `target/tmp`.
//!
//! `cargo bench -p shim-engine --bench engine -- [--quick] [--json PATH]`
//!
//! Measures, with `std::time::Instant` over many iterations (each benchmark bounded in time):
//! - one reconcile cycle (`Engine::reconcile_now`) with 0, 50 and 500 running tasks;
//! - submit → `running` (validation, task dir, durable state writes, start on the fake);
//! - exit → `terminated` (the fake's exit event wakes the reconciler);
//! - terminate (timeout 0) of a running task, and remove of a terminated one;
//! - one `/metrics` scrape (`Engine::encode_metrics`) with 300 running tasks whose usage is
//!   read from their control groups (a cgroup v2 tree of the same files under `/dev/shm`,
//!   in memory like the kernel's).
//!
//! Prints a table; with `--json PATH` also writes the figures as JSON (used by
//! `cargo xtask bench`). No figure is asserted. Run without `--bench` (as `cargo test
//! --all-targets` does), it makes a quick smoke run.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark program that reports to the person running it"
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shim_engine::{Deps, Engine, EngineConfig};
use shim_resources::HostGpus;
use shim_resources::fake::{FakeAuthorizedKeys, FakeVolumes};
use shim_runtime::fake::FakeRuntime;
use shim_task::{TaskConfig, TaskId, TaskName, TaskStatus, TerminationReason};

const IMAGE: &str = "img:1";

/// Command-line options.
struct Opts {
    quick: bool,
    json: Option<PathBuf>,
}

fn opts() -> Opts {
    let mut opts = Opts {
        quick: false,
        json: None,
    };
    // `cargo bench` passes `--bench`; without it (`cargo test --all-targets` runs this too)
    // only a quick smoke run is made.
    let mut benching = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => opts.quick = true,
            "--bench" => benching = true,
            "--json" => opts.json = Some(PathBuf::from(args.next().expect("--json PATH"))),
            _ => {}
        }
    }
    opts.quick |= !benching;
    opts
}

/// Summary of one series of timings.
struct Stats {
    name: String,
    samples: Vec<Duration>,
}

impl Stats {
    fn new(name: impl Into<String>, mut samples: Vec<Duration>) -> Stats {
        samples.sort();
        Stats {
            name: name.into(),
            samples,
        }
    }

    fn pct(&self, p: usize) -> Duration {
        if self.samples.is_empty() {
            return Duration::ZERO;
        }
        self.samples[(self.samples.len() - 1) * p / 100]
    }

    fn json(&self) -> Value {
        let us = |d: Duration| (d.as_secs_f64() * 1e6 * 10.0).round() / 10.0;
        json!({
            "name": self.name,
            "n": self.samples.len(),
            "min_us": us(self.pct(0)),
            "p50_us": us(self.pct(50)),
            "p90_us": us(self.pct(90)),
            "p99_us": us(self.pct(99)),
            "max_us": us(self.pct(100)),
        })
    }

    fn print(&self) {
        println!(
            "  {:<40} n={:<5} median {:>10.3?}  p90 {:>10.3?}  max {:>10.3?}",
            self.name,
            self.samples.len(),
            self.pct(50),
            self.pct(90),
            self.pct(100)
        );
    }
}

/// The fakes and the temp home of one engine.
struct World {
    home: tempfile::TempDir,
    runtime: FakeRuntime,
    host_gpus: HostGpus,
}

impl World {
    fn new() -> World {
        let runtime = FakeRuntime::new();
        runtime.add_image(IMAGE);
        // The home on the target dir's disk (a real file system, like the shim's home).
        let base = env!("CARGO_TARGET_TMPDIR");
        World {
            home: tempfile::Builder::new()
                .prefix("engine-bench-")
                .tempdir_in(base)
                .unwrap(),
            runtime,
            host_gpus: HostGpus::fake_nvidia(8),
        }
    }

    fn deps(&self) -> Deps {
        let mut deps = Deps::new(
            Arc::new(self.runtime.clone()),
            Arc::new(FakeAuthorizedKeys::new()),
            Arc::new(FakeVolumes::new("/fake/volumes")),
        );
        deps.host_gpus = self.host_gpus.clone();
        deps
    }

    async fn engine(&self) -> Engine {
        self.engine_with(self.deps()).await
    }

    async fn engine_with(&self, deps: Deps) -> Engine {
        let mut cfg = EngineConfig::new(self.home.path());
        cfg.volumes_root = "/fake/volumes".into();
        // Only exit events and reconcile_now drive cycles, so the timed cycles run alone.
        cfg.reconcile_interval = Duration::from_secs(3600);
        Engine::open(cfg, deps).await.unwrap()
    }
}

fn tid(id: &str) -> TaskId {
    TaskId::new(id).unwrap()
}

fn config(id: &str) -> TaskConfig {
    TaskConfig::new(tid(id), TaskName::new("job").unwrap(), IMAGE)
}

/// Spins (yielding to the runtime) until the task has `status` and no start job owns it;
/// bounded at 30 s.
async fn until(engine: &Engine, id: &TaskId, status: TaskStatus) {
    until_shown(engine, id, status, true).await;
}

/// Yields until the API shows `status` for the task, and (with `settled`) its start job is
/// over (its last record written).
async fn until_shown(engine: &Engine, id: &TaskId, status: TaskStatus, settled: bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = engine.task_info(id).unwrap();
        if info.status == status && (!settled || !engine.is_starting(id).unwrap()) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "task {id} never became {status}: {info:?}"
        );
        tokio::task::yield_now().await;
    }
}

/// Runs `iteration` until `max` samples or `budget` is spent (at least 3 samples).
async fn measure<F, Fut>(max: usize, budget: Duration, mut iteration: F) -> Vec<Duration>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    let started = Instant::now();
    let mut samples = Vec::new();
    for i in 0..max {
        if i >= 3 && started.elapsed() > budget {
            break;
        }
        samples.push(iteration(i).await);
    }
    samples
}

/// One reconcile cycle with `n` running tasks.
async fn reconcile_cycle(n: usize, quick: bool) -> Stats {
    let w = World::new();
    let engine = w.engine().await;
    let setup = Instant::now();
    let mut joins = Vec::new();
    for i in 0..n {
        let e = engine.clone();
        joins.push(tokio::spawn(async move {
            e.submit(config(&format!("r{i}"))).await.unwrap();
        }));
    }
    for j in joins {
        j.await.unwrap();
    }
    for i in 0..n {
        until(&engine, &tid(&format!("r{i}")), TaskStatus::Running).await;
    }
    println!("  ({n} running tasks set up in {:.1?})", setup.elapsed());
    for _ in 0..3 {
        assert!(engine.reconcile_now().await);
    }
    let (max, budget) = if quick {
        (50, Duration::from_secs(1))
    } else {
        (500, Duration::from_secs(5))
    };
    let samples = measure(max, budget, |i| {
        let engine = engine.clone();
        let runtime = w.runtime.clone();
        async move {
            if i % 64 == 0 {
                // The fake records every call; keep that list short.
                runtime.clear_calls();
            }
            let t = Instant::now();
            assert!(engine.reconcile_now().await);
            t.elapsed()
        }
    })
    .await;
    engine
        .shutdown(shim_engine::Shutdown::Graceful(Duration::from_secs(5)))
        .await;
    Stats::new(format!("reconcile cycle, {n} running tasks"), samples)
}

/// One metrics scrape with `n` running tasks, each with a control group to read.
async fn metrics_scrape(n: usize, quick: bool) -> Stats {
    let w = World::new();
    let shm = std::path::Path::new("/dev/shm");
    let tree = if shm.is_dir() {
        tempfile::Builder::new()
            .prefix("engine-bench-cgroup-")
            .tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
    .unwrap();
    let (root, proc) = (tree.path().join("cgroup"), tree.path().join("proc"));
    fs_err::create_dir_all(&root).unwrap();
    fs_err::write(root.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
    let mut deps = w.deps();
    deps.cgroups = shim_resources::cgroup::Cgroups::at(&root, &proc);
    let engine = w.engine_with(deps).await;
    for i in 0..n {
        engine.submit(config(&format!("m{i}"))).await.unwrap();
    }
    for i in 0..n {
        let id = tid(&format!("m{i}"));
        until(&engine, &id, TaskStatus::Running).await;
        let info = engine.task_info(&id).unwrap();
        let pid = 100_000 + u32::try_from(i).unwrap();
        let group = root.join(format!("system.slice/docker-{}.scope", info.container_id));
        fs_err::create_dir_all(&group).unwrap();
        fs_err::create_dir_all(proc.join(pid.to_string())).unwrap();
        fs_err::write(
            proc.join(format!("{pid}/cgroup")),
            format!("0::/system.slice/docker-{}.scope\n", info.container_id),
        )
        .unwrap();
        fs_err::write(
            group.join("cpu.stat"),
            "usage_usec 123456789\nuser_usec 100000000\nsystem_usec 23456789\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n",
        )
        .unwrap();
        fs_err::write(group.join("memory.current"), "1073741824\n").unwrap();
        fs_err::write(group.join("memory.peak"), "2147483648\n").unwrap();
        fs_err::write(
            group.join("memory.events"),
            "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        )
        .unwrap();
        w.runtime.set_pid(&info.container_id, Some(pid));
    }
    // The first scrapes have the groups located; then every task shows.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut text = String::new();
        engine.encode_metrics(&mut text).unwrap();
        let shown = text
            .lines()
            .filter(|l| l.starts_with("dstack_shim_task_cpu_seconds_total{"))
            .count();
        if shown == n {
            break;
        }
        assert!(Instant::now() < deadline, "{shown} of {n} tasks located");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (max, budget) = if quick {
        (20, Duration::from_secs(1))
    } else {
        (200, Duration::from_secs(5))
    };
    let samples = measure(max, budget, |_| {
        let engine = engine.clone();
        async move {
            let t = Instant::now();
            let mut text = String::with_capacity(64 << 10);
            engine.encode_metrics(&mut text).unwrap();
            std::hint::black_box(&text);
            t.elapsed()
        }
    })
    .await;
    engine
        .shutdown(shim_engine::Shutdown::Graceful(Duration::from_secs(5)))
        .await;
    Stats::new(
        format!("metrics scrape, {n} running tasks with usage"),
        samples,
    )
}

/// Submit → running (as the API shows it, and until the start job is done: its `running`
/// record written), exit → terminated, terminate and remove, one task at a time.
async fn lifecycle(quick: bool) -> Vec<Stats> {
    let w = World::new();
    let engine = w.engine().await;
    let (max, budget) = if quick {
        (30, Duration::from_secs(2))
    } else {
        (300, Duration::from_secs(8))
    };
    let mut submit = Vec::new();
    let mut settled = Vec::new();
    let mut exit = Vec::new();
    let mut terminate = Vec::new();
    let mut remove = Vec::new();
    let started = Instant::now();
    for i in 0..max {
        if i >= 3 && started.elapsed() > budget {
            break;
        }
        if i % 64 == 0 {
            w.runtime.clear_calls();
        }
        // Submit → running.
        let id = tid(&format!("s{i}"));
        let t = Instant::now();
        engine.submit(config(id.as_str())).await.unwrap();
        until_shown(&engine, &id, TaskStatus::Running, false).await;
        submit.push(t.elapsed());
        until(&engine, &id, TaskStatus::Running).await;
        settled.push(t.elapsed());
        let info = engine.task_info(&id).unwrap();
        // Even tasks end by a container exit, odd ones by terminate.
        if i % 2 == 0 {
            let t = Instant::now();
            assert!(w.runtime.exit(&info.container_id, 0));
            until(&engine, &id, TaskStatus::Terminated).await;
            exit.push(t.elapsed());
        } else {
            let t = Instant::now();
            let info = engine
                .terminate(
                    &id,
                    TerminationReason::TerminatedByServer,
                    String::new(),
                    Duration::ZERO,
                )
                .await
                .unwrap();
            terminate.push(t.elapsed());
            assert_eq!(info.status, TaskStatus::Terminated);
        }
        // The reconciler releases ended tasks; remove releases whatever is left anyway.
        let t = Instant::now();
        engine.remove(&id).await.unwrap();
        remove.push(t.elapsed());
    }
    engine
        .shutdown(shim_engine::Shutdown::Graceful(Duration::from_secs(5)))
        .await;
    vec![
        Stats::new("submit -> running (shown)", submit),
        Stats::new("submit -> start done (running written)", settled),
        Stats::new("container exit -> terminated (event)", exit),
        Stats::new("terminate running (timeout 0)", terminate),
        Stats::new("remove terminated", remove),
    ]
}

fn main() {
    let opts = opts();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    println!(
        "engine on the fake runtime (state files under {}):",
        env!("CARGO_TARGET_TMPDIR")
    );
    let mut all = Vec::new();
    runtime.block_on(async {
        for n in [0, 50, 500] {
            let stats = reconcile_cycle(n, opts.quick).await;
            stats.print();
            all.push(stats);
        }
        let stats = metrics_scrape(300, opts.quick).await;
        stats.print();
        all.push(stats);
        for stats in lifecycle(opts.quick).await {
            stats.print();
            all.push(stats);
        }
    });
    println!("  (total {:.1?})", started.elapsed());
    if let Some(path) = opts.json {
        let value = json!({
            "benchmarks": all.iter().map(Stats::json).collect::<Vec<_>>(),
        });
        fs_err::write(&path, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
    }
}
