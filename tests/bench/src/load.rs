//! Figures (3) tasks per second for a batch of tasks started at concurrency 1, 4 and 16, (4)
//! dockerd's CPU time per started task, through the shim and as raw create + start, and the
//! shim's own CPU time per started task (`/proc/<pid>/stat` over its batches); and, as a
//! diagnostic, (3) through a second shim whose home is on tmpfs (or, with
//! `SHIM_BENCH_BASELINE`, another build: [`SecondShim`]). The fleets' batches take turns.
//! Shim clients learn that their task runs from one watcher on the shim's event stream
//! (`GET /api/events`, opened before the batch), so neither side polls.

use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use super::Ctx;
use super::fleet::{BenchShim, SecondShim, Watcher, cpu_seconds, dockerd_pid, tick_seconds};
use super::parallel;
use super::report::{Comparison, Goal};

/// One measured batch: tasks, seconds, dockerd CPU seconds, and the starting process's own
/// CPU seconds (the shim's; 0 for the raw fleet, whose client is the bench).
#[derive(Debug, Default, Clone, Copy)]
struct Batch {
    tasks: usize,
    seconds: f64,
    dockerd_cpu: f64,
    own_cpu: f64,
}

impl Batch {
    fn add(&mut self, other: Batch) {
        self.tasks += other.tasks;
        self.seconds += other.seconds;
        self.dockerd_cpu += other.dockerd_cpu;
        self.own_cpu += other.own_cpu;
    }

    fn per_second(&self) -> f64 {
        self.tasks as f64 / self.seconds
    }

    fn cpu_ms_per_task(&self) -> f64 {
        self.dockerd_cpu * 1e3 / self.tasks as f64
    }

    fn own_cpu_ms_per_task(&self) -> f64 {
        self.own_cpu * 1e3 / self.tasks as f64
    }
}

/// Measures `start` over `tasks` items, `concurrency` at a time; `own` is the process whose
/// CPU time is counted as the starter's (the shim), if any.
fn measure(
    tasks: &[String],
    concurrency: usize,
    own: Option<u32>,
    start: impl Fn(&String) -> Result<()> + Sync,
) -> Result<Batch> {
    let dockerd = dockerd_pid()?;
    let cpu = cpu_seconds(dockerd)?;
    let own_cpu = own.map(cpu_seconds).transpose()?;
    let t = Instant::now();
    let results = parallel(tasks, concurrency, start);
    let seconds = t.elapsed().as_secs_f64();
    let dockerd_cpu = cpu_seconds(dockerd)? - cpu;
    let own_cpu = match (own, own_cpu) {
        (Some(pid), Some(before)) => cpu_seconds(pid)? - before,
        _ => 0.0,
    };
    results.into_iter().collect::<Result<Vec<()>>>()?;
    Ok(Batch {
        tasks: tasks.len(),
        seconds,
        dockerd_cpu,
        own_cpu,
    })
}

/// Who starts a batch's tasks.
enum Fleet<'a> {
    /// A shim: its name in the output, and the prefix of its task ids.
    Shim(&'a BenchShim, &'static str, &'static str),
    /// The bench's own create + start.
    Raw,
}

/// Figures (3) and (4), and (as a diagnostic without a goal) (3) once more with the shim's home
/// on tmpfs, where a durable write costs no disk flush: the three fleets' batches take turns.
pub fn throughput(ctx: &Ctx, out: &mut Vec<Comparison>) -> Result<()> {
    let n = ctx.pick(8, 50);
    let rounds = ctx.pick(1, 10);
    let docker = &ctx.scratch.docker;
    let shim = BenchShim::start(&ctx.binary, &ctx.scratch, "load")?;
    let shim_tmpfs = SecondShim::start(&ctx.binary, &ctx.scratch, "load-second")?;
    let (label, key) = shim_tmpfs.as_ref().map_or(("", ""), |t| (t.label, t.key));
    let mut fleets = vec![Fleet::Shim(&shim, "shim", "load")];
    if let Some(t) = &shim_tmpfs {
        fleets.push(Fleet::Shim(&t.shim, t.short, t.prefix));
    }
    fleets.push(Fleet::Raw);
    for concurrency in [1, 4, 16] {
        println!(
            "\n--- {n} tasks at concurrency {concurrency}, {rounds} round(s) of each of {} fleets",
            fleets.len()
        );
        let mut totals = vec![Batch::default(); fleets.len()];
        for round in 0..rounds {
            let batch = |fleet: &Fleet<'_>| -> Result<Batch> {
                match *fleet {
                    Fleet::Shim(shim, _, prefix) => {
                        let ids: Vec<String> = (0..n)
                            .map(|i| format!("{prefix}-{concurrency}-{round}-{i}"))
                            .collect();
                        let watcher = Watcher::new(shim)?;
                        let batch = measure(&ids, concurrency, Some(shim.pid()?), |id| {
                            shim.submit(id, "host")?;
                            watcher.wait_running(id)
                        })?;
                        drop(watcher);
                        // Clean-up is not measured: 4 at a time. Many concurrent `docker stop
                        // -t 0` on a loaded machine once lost exit events in dockerd 20.10 and
                        // wedged it.
                        parallel(&ids, 4, |id| shim.finish(id))
                            .into_iter()
                            .collect::<Result<Vec<()>>>()?;
                        Ok(batch)
                    }
                    Fleet::Raw => {
                        let ids: Vec<String> = (0..n)
                            .map(|i| format!("load-{concurrency}-{round}-{i}"))
                            .collect();
                        let batch = measure(&ids, concurrency, None, |id| {
                            let raw = ctx.scratch.raw_create(id, "host")?;
                            docker.start(&raw.id)
                        })?;
                        ctx.scratch.raw_remove_all()?;
                        Ok(batch)
                    }
                }
            };
            // Each round starts with the next fleet, so each leads as often as the others.
            let mut line = format!("  round {round}:");
            for k in 0..fleets.len() {
                let f = (round + k) % fleets.len();
                let b = batch(&fleets[f])?;
                totals[f].add(b);
                let name = match fleets[f] {
                    Fleet::Shim(_, name, _) => name,
                    Fleet::Raw => "raw",
                };
                line += &format!(
                    " {name} {:.1} tasks/s ({:.0} ms dockerd CPU/task{});",
                    b.per_second(),
                    b.cpu_ms_per_task(),
                    match fleets[f] {
                        Fleet::Shim(..) => format!(", {:.2} ms own", b.own_cpu_ms_per_task()),
                        Fleet::Raw => String::new(),
                    }
                );
            }
            println!("{}", line.trim_end_matches(';'));
        }
        let (shim_total, raw_total) = (totals[0], totals[fleets.len() - 1]);
        let detail = json!({
            "tasks": shim_total.tasks, "rounds": rounds,
            "shim_seconds": shim_total.seconds, "raw_seconds": raw_total.seconds,
            "shim_dockerd_cpu_s": shim_total.dockerd_cpu, "raw_dockerd_cpu_s": raw_total.dockerd_cpu,
            "shim_own_cpu_s": shim_total.own_cpu,
        });
        out.push(
            Comparison::new(
                format!("tasks_per_second_c{concurrency}"),
                format!("tasks/s, {n} tasks at concurrency {concurrency} (raw: create + start)"),
                "tasks/s",
                shim_total.per_second(),
                Some(raw_total.per_second()),
                Goal::AtLeastRawTimes(1.0),
            )
            .with_detail(detail.clone()),
        );
        if shim_tmpfs.is_some() {
            let t = totals[1];
            out.push(
                Comparison::new(
                    format!("tasks_per_second_c{concurrency}_{key}"),
                    format!(
                        "tasks/s, {n} tasks at concurrency {concurrency}, {label} (diagnostic)"
                    ),
                    "tasks/s",
                    t.per_second(),
                    Some(raw_total.per_second()),
                    Goal::None,
                )
                .with_detail(json!({
                    "tasks": t.tasks, "rounds": rounds, "shim_seconds": t.seconds,
                    "raw_seconds": raw_total.seconds, "shim_dockerd_cpu_s": t.dockerd_cpu,
                })),
            );
        }
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
        out.push(
            Comparison::new(
                format!("shim_cpu_per_task_c{concurrency}"),
                format!("the shim's own CPU per started task, concurrency {concurrency}"),
                "ms",
                shim_total.own_cpu_ms_per_task(),
                None,
                Goal::AtMost(0.5),
            )
            .with_detail(json!({
                "shim_own_cpu_s": shim_total.own_cpu, "tasks": shim_total.tasks,
                "resolution_ms_per_task": tick_seconds() * 1e3 / shim_total.tasks as f64,
            })),
        );
        if shim_tmpfs.is_some() {
            out.push(Comparison::new(
                format!("dockerd_cpu_per_task_c{concurrency}_{key}"),
                format!(
                    "dockerd CPU per started task, concurrency {concurrency}, {label} (diagnostic)"
                ),
                "ms",
                totals[1].cpu_ms_per_task(),
                Some(raw_total.cpu_ms_per_task()),
                Goal::None,
            ));
            out.push(Comparison::new(
                format!("shim_cpu_per_task_c{concurrency}_{key}"),
                format!("the shim's own CPU per started task, concurrency {concurrency}, {label} (diagnostic)"),
                "ms",
                totals[1].own_cpu_ms_per_task(),
                None,
                Goal::None,
            ));
        }
    }
    Ok(())
}
