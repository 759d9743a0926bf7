//! Figures (3) tasks per second for a batch of tasks started at a given concurrency and (4)
//! dockerd's CPU time per started task, through the shim and as raw create + start. Shim and
//! raw batches alternate. Shim clients learn that their task runs from one watcher that lists
//! the tasks every 5 ms (not each polling its task), so the bench's own polling stays small.

use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use super::Ctx;
use super::dockerapi::parallel;
use super::fleet::{BenchShim, Watcher, cpu_seconds, dockerd_pid};
use super::report::{Comparison, Goal};

/// One measured batch: tasks, seconds, dockerd CPU seconds.
#[derive(Debug, Default, Clone, Copy)]
struct Batch {
    tasks: usize,
    seconds: f64,
    dockerd_cpu: f64,
}

impl Batch {
    fn add(&mut self, other: Batch) {
        self.tasks += other.tasks;
        self.seconds += other.seconds;
        self.dockerd_cpu += other.dockerd_cpu;
    }

    fn per_second(&self) -> f64 {
        self.tasks as f64 / self.seconds
    }

    fn cpu_ms_per_task(&self) -> f64 {
        self.dockerd_cpu * 1e3 / self.tasks as f64
    }
}

/// Measures `start` over `tasks` items, `concurrency` at a time.
fn measure(
    tasks: &[String],
    concurrency: usize,
    start: impl Fn(&String) -> Result<()> + Sync,
) -> Result<Batch> {
    let dockerd = dockerd_pid()?;
    let cpu = cpu_seconds(dockerd)?;
    let t = Instant::now();
    let results = parallel(tasks, concurrency, start);
    let seconds = t.elapsed().as_secs_f64();
    let dockerd_cpu = cpu_seconds(dockerd)? - cpu;
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(Batch {
        tasks: tasks.len(),
        seconds,
        dockerd_cpu,
    })
}

/// Figures (3) and (4).
pub fn throughput(ctx: &Ctx, out: &mut Vec<Comparison>) -> Result<()> {
    let n = ctx.pick(8, 50);
    let rounds = ctx.pick(1, 5);
    let docker = &ctx.scratch.docker;
    let shim = BenchShim::start(&ctx.binary, &ctx.scratch, "load")?;
    for concurrency in [4, 16] {
        println!("\n--- {n} tasks at concurrency {concurrency}, {rounds} round(s) of shim and raw");
        let mut shim_total = Batch::default();
        let mut raw_total = Batch::default();
        for round in 0..rounds {
            let ids: Vec<String> = (0..n)
                .map(|i| format!("load-{concurrency}-{round}-{i}"))
                .collect();
            let shim_batch = || -> Result<Batch> {
                let watcher = Watcher::new(&shim)?;
                let batch = measure(&ids, concurrency, |id| {
                    shim.submit(id, "host")?;
                    watcher.wait_running(id)
                })?;
                drop(watcher);
                // Clean-up is not measured: 4 at a time. Many concurrent `docker stop -t 0`
                // on a loaded machine once lost exit events in dockerd 20.10 and wedged it.
                parallel(&ids, 4, |id| shim.finish(id))
                    .into_iter()
                    .collect::<Result<Vec<()>>>()?;
                Ok(batch)
            };
            let raw_batch = || -> Result<Batch> {
                let batch = measure(&ids, concurrency, |id| {
                    let raw = ctx.scratch.raw_create(id, "host")?;
                    docker.start(&raw.id)
                })?;
                ctx.scratch.raw_remove_all()?;
                Ok(batch)
            };
            let (s, r) = if round % 2 == 0 {
                let s = shim_batch()?;
                (s, raw_batch()?)
            } else {
                let r = raw_batch()?;
                (shim_batch()?, r)
            };
            println!(
                "  round {round}: shim {:.1} tasks/s ({:.0} ms dockerd CPU/task), raw {:.1} tasks/s ({:.0} ms/task)",
                s.per_second(),
                s.cpu_ms_per_task(),
                r.per_second(),
                r.cpu_ms_per_task()
            );
            shim_total.add(s);
            raw_total.add(r);
        }
        let detail = json!({
            "tasks": shim_total.tasks, "rounds": rounds,
            "shim_seconds": shim_total.seconds, "raw_seconds": raw_total.seconds,
            "shim_dockerd_cpu_s": shim_total.dockerd_cpu, "raw_dockerd_cpu_s": raw_total.dockerd_cpu,
        });
        out.push(
            Comparison::new(
                format!("tasks_per_second_c{concurrency}"),
                format!("tasks/s, {n} tasks at concurrency {concurrency} (raw: create + start)"),
                "tasks/s",
                shim_total.per_second(),
                Some(raw_total.per_second()),
                Goal::AtLeastRawTimes(0.97),
            )
            .with_detail(detail.clone()),
        );
        out.push(
            Comparison::new(
                format!("dockerd_cpu_per_task_c{concurrency}"),
                format!("dockerd CPU per started task, concurrency {concurrency}"),
                "ms",
                shim_total.cpu_ms_per_task(),
                Some(raw_total.cpu_ms_per_task()),
                Goal::AtMostRawTimes(1.05),
            )
            .with_detail(detail),
        );
    }
    Ok(())
}
