//! Measures the store's durable writes: one `Store::write` (temp file, write, fsync, rename,
//! fsync dir), and a submit's `Store::create` (a spare directory made ahead gets the record:
//! fsync of the file, rename, fsync of `runners/` shared by concurrent creates), one at a
//! time with a spare ready, one at a time with none (the spare made on the spot), and 8 at a
//! time.
//!
//! `cargo run -p shim-store --release --example write_latency -- [DIR] [COUNT]`
//! DIR must be on the filesystem to measure (default: a temp dir under the current directory).
//! Lines `json {...}` repeat the figures in microseconds for `cargo xtask bench`.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use shim_store::Store;
use shim_task::{TaskConfig, TaskId, TaskName, TaskRecord, TaskStatus};

/// Concurrent creates in the last figure.
const THREADS: usize = 8;

fn record(i: usize) -> TaskRecord {
    let id = TaskId::new(format!("bench-{i}")).unwrap();
    let config = TaskConfig::new(id, TaskName::new("job").unwrap(), "shim-test:1");
    TaskRecord::new(&config, format!("job-{i:08x}"), 0)
}

/// Prints one figure and its `json` line; `extra` adds fields.
fn report(name: &str, mut times: Vec<Duration>, bytes: u64, extra: serde_json::Value) {
    times.sort();
    let pct = |p: usize| times[(times.len() - 1) * p / 100];
    println!(
        "{} x {name} ({bytes}-byte record): min {:?}, median {:?}, p90 {:?}, p99 {:?}, max {:?} {extra}",
        times.len(),
        times[0],
        pct(50),
        pct(90),
        pct(99),
        times[times.len() - 1],
    );
    let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
    let mut json = serde_json::json!({
        "name": name,
        "n": times.len(),
        "bytes": bytes,
        "min_us": us(times[0]),
        "p50_us": us(pct(50)),
        "p90_us": us(pct(90)),
        "p99_us": us(pct(99)),
        "max_us": us(times[times.len() - 1]),
    });
    if let (Some(json), Some(extra)) = (json.as_object_mut(), extra.as_object()) {
        json.extend(extra.clone());
    }
    println!("json {json}");
}

fn main() {
    let mut args = std::env::args().skip(1);
    let base = args.next().unwrap_or_else(|| ".".into());
    let count: usize = args.next().map_or(200, |c| c.parse().expect("COUNT"));
    let dir = tempfile::tempdir_in(&base).expect("temp dir in DIR");
    println!("under {}", dir.path().display());
    let store = Store::open(dir.path()).unwrap();
    let mut r = record(0);
    store.create_task_dir(&r.container_name).unwrap();
    let size = {
        store.write(&r).unwrap();
        fs_err::metadata(store.paths(&r.container_name).unwrap().state_file)
            .unwrap()
            .len()
    };
    let times = (0..count)
        .map(|i| {
            r.status = if i % 2 == 0 {
                TaskStatus::Running
            } else {
                TaskStatus::Pulling
            };
            r.updated_at_ms = i as u64;
            let t = Instant::now();
            store.write(&r).unwrap();
            t.elapsed()
        })
        .collect();
    report(
        "task.json durable write",
        times,
        size,
        serde_json::json!({}),
    );

    // Submits one at a time, a spare ready (made in between, untimed, as the engine makes
    // them in the background): one fsync of the file, one of the runners directory.
    let creates = count.min(200);
    let mut next = 1;
    let before = store.runners_commits();
    let times = (0..creates)
        .map(|_| {
            store.prepare_spares_up_to(1).unwrap();
            let r = record(next);
            next += 1;
            let t = Instant::now();
            store.create(&r).unwrap();
            t.elapsed()
        })
        .collect();
    let commits = store.runners_commits();
    report(
        "submit's first write (Store::create), a spare ready",
        times,
        size,
        serde_json::json!({
            "runners_fsyncs_per_create":
                (commits.fsyncs - before.fsyncs) as f64 / creates as f64,
        }),
    );

    // None ready: the spare is made on the spot (one fsync more).
    let times = (0..creates)
        .map(|_| {
            let r = record(next);
            next += 1;
            let t = Instant::now();
            store.create(&r).unwrap();
            t.elapsed()
        })
        .collect();
    report(
        "submit's first write (Store::create), no spare ready",
        times,
        size,
        serde_json::json!({}),
    );

    // THREADS at a time, spares made ahead (untimed) for each round: the runners directory's
    // fsync is shared.
    let rounds = (creates / THREADS).max(1);
    let before = store.runners_commits();
    let mut times = Vec::new();
    let mut wall = Duration::ZERO;
    for _ in 0..rounds {
        store.prepare_spares_up_to(THREADS).unwrap();
        let records: Vec<TaskRecord> = (0..THREADS).map(|k| record(next + k)).collect();
        next += THREADS;
        let t = Instant::now();
        let round: Vec<Duration> = std::thread::scope(|s| {
            let handles: Vec<_> = records
                .iter()
                .map(|r| {
                    let store = &store;
                    s.spawn(move || {
                        let t = Instant::now();
                        store.create(r).unwrap();
                        t.elapsed()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        wall += t.elapsed();
        times.extend(round);
    }
    let commits = store.runners_commits();
    let n = rounds * THREADS;
    report(
        &format!("submit's first write (Store::create), {THREADS} at a time"),
        times,
        size,
        serde_json::json!({
            "creates_per_second": n as f64 / wall.as_secs_f64(),
            "runners_fsyncs_per_create": (commits.fsyncs - before.fsyncs) as f64 / n as f64,
        }),
    );
}
