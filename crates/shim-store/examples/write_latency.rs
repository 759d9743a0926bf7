//! Measures one durable `Store::write` (temp file, write, fsync, rename, fsync dir).
//!
//! `cargo run -p shim-store --release --example write_latency -- [DIR] [COUNT]`
//! DIR must be on the filesystem to measure (default: a temp dir under the current directory).
//! A last line `json {...}` repeats the figures in microseconds for `cargo xtask bench`.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use shim_store::Store;
use shim_task::{TaskConfig, TaskId, TaskName, TaskRecord, TaskStatus};

fn main() {
    let mut args = std::env::args().skip(1);
    let base = args.next().unwrap_or_else(|| ".".into());
    let count: usize = args.next().map_or(200, |c| c.parse().expect("COUNT"));
    let dir = tempfile::tempdir_in(&base).expect("temp dir in DIR");
    let store = Store::open(dir.path()).unwrap();
    let id = TaskId::new("bench").unwrap();
    let config = TaskConfig::new(id.clone(), TaskName::new("job").unwrap(), "shim-test:1");
    let mut record = TaskRecord::new(&config, "job-01234567".into(), 0);
    store.create_task_dir(&record.container_name).unwrap();
    let size = {
        store.write(&record).unwrap();
        fs_err::metadata(store.paths(&record.container_name).unwrap().state_file)
            .unwrap()
            .len()
    };
    let mut times: Vec<Duration> = (0..count)
        .map(|i| {
            record.status = if i % 2 == 0 {
                TaskStatus::Running
            } else {
                TaskStatus::Pulling
            };
            record.updated_at_ms = i as u64;
            let t = Instant::now();
            store.write(&record).unwrap();
            t.elapsed()
        })
        .collect();
    times.sort();
    let pct = |p: usize| times[(times.len() - 1) * p / 100];
    println!(
        "{count} durable writes of a {size}-byte record under {}: min {:?}, median {:?}, p90 {:?}, p99 {:?}, max {:?}",
        dir.path().display(),
        times[0],
        pct(50),
        pct(90),
        pct(99),
        times[times.len() - 1],
    );
    let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
    let json = serde_json::json!({
        "name": "task.json durable write",
        "n": count,
        "bytes": size,
        "min_us": us(times[0]),
        "p50_us": us(pct(50)),
        "p90_us": us(pct(90)),
        "p99_us": us(pct(99)),
        "max_us": us(times[times.len() - 1]),
    });
    println!("json {json}");
}
