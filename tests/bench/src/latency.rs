//! Figures (1) container exit → `terminated` visible through the shim's API, against raw
//! Docker's `die` event, and (5) submit → running one task at a time, against a raw create
//! and start. Samples are interleaved (shim, raw, raw, shim, …) so that drifts of the machine
//! hit both alike.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use serde_json::{Value, json};

use super::Ctx;
use super::clock::ms_between;
use super::fleet::{BenchShim, RAW_LABEL, RawContainer, SecondShim, trigger_exit};
use super::report::{Comparison, Goal, median, percentile};
use super::stream::Events;

/// Figure (1), host and bridge network.
pub fn exit_latency(ctx: &Ctx, out: &mut Vec<Comparison>) -> Result<()> {
    let n = ctx.pick(3, 100);
    let docker = &ctx.scratch.docker;
    let shim = BenchShim::start(&ctx.binary, &ctx.scratch, "exit")?;
    // Pushed like the raw client's `die` events: the shim's own change stream, no polling.
    let changes = shim.events()?;
    let label = format!("{RAW_LABEL}={}", ctx.scratch.run);
    let events = docker.events(&[("type", "container"), ("event", "die"), ("label", &label)])?;
    for (mode, p50_goal, p99_goal) in [
        ("host", Goal::RawPlus(8.0), Goal::None),
        ("bridge", Goal::RawPlus(10.0), Goal::AtMost(60.0)),
    ] {
        println!("\n--- exit -> terminated, {mode} network: {n} shim tasks and {n} raw containers");
        let before = histogram(&shim, "dstack_shim_exit_to_terminated_seconds")?;
        let ids: Vec<String> = (0..n).map(|i| format!("exit-{mode}-{i}")).collect();
        let mut raws = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            shim.submit(id, mode)?;
            let raw = ctx.scratch.raw_create(&format!("exit-{mode}-{i}"), mode)?;
            docker.start(&raw.id)?;
            raws.push(raw);
        }
        let infos: Vec<Value> = ids
            .iter()
            .map(|id| shim.wait_running(id, Duration::from_millis(5)))
            .collect::<Result<_>>()?;
        let mut shim_ms = Vec::new();
        let mut raw_ms = Vec::new();
        for i in 0..n {
            let shim_sample = || -> Result<f64> {
                trigger_exit(&shim.runner_dir(&infos[i]), 0)?;
                let (_, seen) = changes.wait_until(super::fleet::BOUND, |c| {
                    c["task"] == ids[i].as_str() && c["change"] == "terminated"
                })?;
                let container = infos[i]["container_id"]
                    .as_str()
                    .with_context(|| format!("no container id: {}", infos[i]))?;
                Ok(ms_between(docker.finished_at(container)?, seen))
            };
            let raw_sample = |raw: &RawContainer| -> Result<f64> {
                trigger_exit(&raw.dir, 0)?;
                let (_, at) = events.wait_for(&raw.id, super::fleet::BOUND)?;
                Ok(ms_between(docker.finished_at(&raw.id)?, at))
            };
            if i % 2 == 0 {
                shim_ms.push(shim_sample()?);
                raw_ms.push(raw_sample(&raws[i])?);
            } else {
                raw_ms.push(raw_sample(&raws[i])?);
                shim_ms.push(shim_sample()?);
            }
            println!(
                "  sample {i}: shim {:.1} ms, raw die event {:.1} ms after FinishedAt",
                shim_ms[i], raw_ms[i]
            );
        }
        let metric = histogram(&shim, "dstack_shim_exit_to_terminated_seconds")?.since(before);
        println!("{}", metric.versus(&shim_ms));
        for id in &ids {
            shim.finish(id)?;
        }
        for raw in &raws {
            docker.remove(&raw.id)?;
        }
        let detail = json!({"n": n, "shim_ms": shim_ms, "raw_ms": raw_ms, "metric": metric.json()});
        out.push(
            Comparison::new(
                format!("exit_to_terminated_p50_{mode}"),
                format!("container exit → `terminated` p50, {mode} network (raw: `die` event)"),
                "ms",
                median(&shim_ms),
                Some(median(&raw_ms)),
                p50_goal,
            )
            .with_detail(detail),
        );
        out.push(Comparison::new(
            format!("exit_to_terminated_p99_{mode}"),
            format!("container exit → `terminated` p99, {mode} network (raw: `die` event)"),
            "ms",
            percentile(&shim_ms, 99),
            Some(percentile(&raw_ms, 99)),
            p99_goal,
        ));
    }
    Ok(())
}

/// Figure (5): submit → running, one task at a time, host network. 120 samples: one start
/// varies by ±20 % on 2 cores, so thirty left the median ratio uncertain by about 5 %, and the
/// median of sixty paired differences still moved by ±3 ms between runs. As a
/// diagnostic, the same through a second shim whose home is on tmpfs (durable writes without
/// disk flushes); each sample's three starts take turns at going first.
pub fn submit_latency(ctx: &Ctx, out: &mut Vec<Comparison>) -> Result<()> {
    let n = ctx.pick(3, 120);
    let docker = &ctx.scratch.docker;
    let shim = BenchShim::start(&ctx.binary, &ctx.scratch, "submit")?;
    let tmpfs = SecondShim::start(&ctx.binary, &ctx.scratch, "submit-second")?;
    let (label, key, short, prefix) = tmpfs
        .as_ref()
        .map_or(("", "", "", ""), |t| (t.label, t.key, t.short, t.prefix));
    let shim_tmpfs = tmpfs.as_ref().map(|t| &t.shim);
    println!("\n--- submit -> running one at a time: {n} shim tasks, {n} raw create+start");
    let before = histogram(&shim, "dstack_shim_submit_to_running_seconds")?;
    // Pushed news on both sides: the shim's `running` arrives on its event stream, as the
    // raw side learns it from its start's answer; polling would cost the shim (and the 2 CPUs
    // Docker needs) what the raw side does not pay.
    let changes = shim.events()?;
    let tmpfs_changes = shim_tmpfs.map(BenchShim::events).transpose()?;
    let shim_sample = |shim: &BenchShim, changes: &Events, id: &str| -> Result<f64> {
        let t = Instant::now();
        shim.submit(id, "host")?;
        changes.wait_until(super::fleet::BOUND, |c| {
            c["task"] == id && c["change"] == "status" && c["status"] == "running"
        })?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    let mut shim_ms = Vec::new();
    let mut tmpfs_ms = Vec::new();
    let mut raw_ms = Vec::new();
    let mut raws = Vec::new();
    for i in 0..n {
        let id = format!("submit-{i}");
        let mut line = format!("  sample {i}:");
        for k in 0..3 {
            match (i + k) % 3 {
                0 => {
                    shim_ms.push(shim_sample(&shim, &changes, &id)?);
                    line += &format!(" shim {:.1} ms", shim_ms[i]);
                }
                1 => {
                    let (Some(s), Some(c)) = (shim_tmpfs, &tmpfs_changes) else {
                        continue;
                    };
                    // Its own ids: the container names come from them.
                    tmpfs_ms.push(shim_sample(s, c, &format!("{prefix}-{id}"))?);
                    line += &format!(" {short} {:.1} ms", tmpfs_ms[i]);
                }
                _ => {
                    let t = Instant::now();
                    let raw = ctx.scratch.raw_create(&id, "host")?;
                    docker.start(&raw.id)?;
                    raw_ms.push(t.elapsed().as_secs_f64() * 1e3);
                    raws.push(raw);
                    line += &format!(" raw {:.1} ms", raw_ms[i]);
                }
            }
        }
        println!("{line}");
    }
    let metric = histogram(&shim, "dstack_shim_submit_to_running_seconds")?.since(before);
    println!("{}", metric.versus(&shim_ms));
    // Each sample's starts ran back to back, so a difference is what the shim added to that
    // start; the ratio of the two medians (the goal's figure) also carries the spread of the
    // starts.
    let paired = |ms: &[f64]| {
        median(
            &ms.iter()
                .zip(&raw_ms)
                .map(|(s, r)| s - r)
                .collect::<Vec<_>>(),
        )
    };
    let paired_median = paired(&shim_ms);
    println!("  median of the {n} paired differences (shim − raw): {paired_median:+.1} ms");
    if !tmpfs_ms.is_empty() {
        println!("  the same, {label}: {:+.1} ms", paired(&tmpfs_ms));
    }
    for i in 0..n {
        let id = format!("submit-{i}");
        shim.finish(&id)?;
        if let Some(s) = shim_tmpfs {
            s.finish(&format!("{prefix}-{id}"))?;
        }
    }
    for raw in &raws {
        docker.remove(&raw.id)?;
    }
    out.push(
        Comparison::new(
            "submit_to_running_p50",
            "submit → `running` p50, one at a time (raw: create + start)",
            "ms",
            median(&shim_ms),
            Some(median(&raw_ms)),
            Goal::AtMostRawTimes(1.02),
        )
        .with_detail(
            json!({"n": n, "shim_ms": shim_ms, "raw_ms": raw_ms, "metric": metric.json(),
                   "paired_difference_median_ms": paired_median}),
        ),
    );
    if !tmpfs_ms.is_empty() {
        out.push(
            Comparison::new(
                format!("submit_to_running_p50_{key}"),
                format!("submit → `running` p50, one at a time, {label} (diagnostic)"),
                "ms",
                median(&tmpfs_ms),
                Some(median(&raw_ms)),
                Goal::None,
            )
            .with_detail(json!({"n": n, "shim_ms": tmpfs_ms, "raw_ms": raw_ms,
                                "paired_difference_median_ms": paired(&tmpfs_ms)})),
        );
    }
    Ok(())
}

/// Count and sum (seconds) of one of the shim's latency histograms, from its `/metrics`.
#[derive(Debug, Clone, Copy)]
struct Histogram {
    name: &'static str,
    count: f64,
    sum: f64,
}

impl Histogram {
    /// What was observed since `before`.
    fn since(self, before: Histogram) -> Histogram {
        Histogram {
            count: self.count - before.count,
            sum: self.sum - before.sum,
            ..self
        }
    }

    /// Its mean in ms.
    fn mean_ms(&self) -> f64 {
        if self.count > 0.0 {
            self.sum / self.count * 1e3
        } else {
            f64::NAN
        }
    }

    /// A line comparing it with the bench's own samples of the same span (the bench's also
    /// include its 1 ms polling of the API).
    fn versus(&self, bench_ms: &[f64]) -> String {
        let bench_mean = bench_ms.iter().sum::<f64>() / bench_ms.len().max(1) as f64;
        format!(
            "  the shim's {}: {} samples, mean {:.1} ms; the bench measured {} samples, mean {:.1} ms",
            self.name,
            self.count,
            self.mean_ms(),
            bench_ms.len(),
            bench_mean
        )
    }

    fn json(&self) -> Value {
        json!({"name": self.name, "count": self.count, "mean_ms": self.mean_ms()})
    }
}

/// Reads `name`'s `_count` and `_sum` from the shim's `/metrics` (OpenMetrics text).
fn histogram(shim: &BenchShim, name: &'static str) -> Result<Histogram> {
    let answer = shim
        .api()
        .request("GET", "/metrics", None)
        .context("GET /metrics")?;
    anyhow::ensure!(answer.status == 200, "GET /metrics: {answer:?}");
    let value = |suffix: &str| -> Result<f64> {
        let sample = format!("{name}{suffix}");
        answer
            .body
            .lines()
            .filter_map(|line| {
                let rest = line.strip_prefix(&sample)?;
                let rest = match rest.strip_prefix('{') {
                    Some(labelled) => labelled.split_once('}')?.1,
                    None => rest,
                };
                rest.split_whitespace().next()?.parse::<f64>().ok()
            })
            .reduce(|a, b| a + b)
            .with_context(|| format!("no {sample} in the shim's /metrics"))
    };
    Ok(Histogram {
        name,
        count: value("_count")?,
        sum: value("_sum")?,
    })
}
