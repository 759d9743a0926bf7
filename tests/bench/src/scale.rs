//! Figures with many running tasks, on one shim home that grows step by step: (2) idle
//! dockerd CPU with the shim running versus stopped (the tasks keep running either way),
//! (7) the shim's RSS (and its peak), and (6) SIGKILL → every task answers `running` again,
//! against one raw list of the same containers by label (list + inspect in the details).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::json;
use shim_e2e::harness::{LABEL_OWNER, owner_identity};

use super::fleet::{BOUND, BenchShim, Watcher, cpu_seconds, dockerd_pid, tick_seconds};
use super::parallel;
use super::report::{Comparison, Goal, median};
use super::{Ctx, Fig};

/// Steps of the scale phase: what to measure at how many running tasks.
struct Plan {
    idle_at: Vec<usize>,
    rss_at: usize,
    restart_at: Vec<usize>,
    /// Seconds of one CPU window.
    window: Duration,
    /// Rounds of (with shim, without shim) windows.
    rounds: usize,
    /// Rounds of restarts (each a few hundred milliseconds; the list's own spread is ±20 %).
    restart_rounds: usize,
}

/// Figures (2), (6), (7), as selected.
pub fn scale(ctx: &Ctx, out: &mut Vec<Comparison>) -> Result<()> {
    let plan = if ctx.quick {
        Plan {
            idle_at: vec![5, 10],
            rss_at: 10,
            restart_at: vec![10],
            window: Duration::from_secs(2),
            rounds: 1,
            restart_rounds: 1,
        }
    } else {
        Plan {
            idle_at: vec![100, 300],
            rss_at: 300,
            restart_at: vec![300, 1000],
            window: Duration::from_secs(20),
            rounds: 2,
            restart_rounds: 8,
        }
    };
    let mut steps = BTreeSet::new();
    if ctx.wants(Fig::IdleCpu) {
        steps.extend(plan.idle_at.iter().copied());
    }
    if ctx.wants(Fig::Rss) {
        steps.insert(plan.rss_at);
    }
    if ctx.wants(Fig::Restart) {
        steps.extend(plan.restart_at.iter().copied());
    }
    let mut shim = BenchShim::start(&ctx.binary, &ctx.scratch, "scale")?;
    let result = (|| -> Result<()> {
        let mut have = 0;
        for step in steps {
            have = fill(&shim, have, step)?;
            if ctx.wants(Fig::IdleCpu) && plan.idle_at.contains(&step) {
                out.push(idle_cpu(&mut shim, step, &plan)?);
            }
            if ctx.wants(Fig::Rss) && plan.rss_at == step {
                std::thread::sleep(Duration::from_secs(1));
                let kib = shim.rss_kib()?;
                let peak = shim.rss_peak_kib()?;
                println!(
                    "\n--- shim RSS with {step} running tasks: {kib} KiB (peak {peak} KiB, while they started)"
                );
                out.push(
                    Comparison::new(
                        format!("rss_{step}"),
                        format!("shim RSS, {step} running tasks"),
                        "MiB",
                        kib as f64 / 1024.0,
                        None,
                        Goal::AtMost(12.0),
                    )
                    .with_detail(json!({"rss_kib": kib, "peak_kib": peak})),
                );
                out.push(Comparison::new(
                    format!("rss_peak_{step}"),
                    format!("shim peak RSS (VmHWM), {step} tasks started 16 at a time"),
                    "MiB",
                    peak as f64 / 1024.0,
                    None,
                    Goal::AtMost(12.0),
                ));
            }
            if ctx.wants(Fig::Restart) && plan.restart_at.contains(&step) {
                out.push(restart(ctx, &mut shim, step, plan.restart_rounds)?);
            }
        }
        Ok(())
    })();
    // Removing a thousand containers one by one through the sweeper's CLI is slow: the raw
    // API, 4 at a time, first.
    let owner = owner_identity(&shim.home);
    let _ = shim.kill();
    let removed = ctx.scratch.docker.remove_all(LABEL_OWNER, &owner, 4);
    println!("\nscale: removed {} task containers", removed.unwrap_or(0));
    result
}

/// Submits tasks `have..want` (host network), 16 at a time, and waits until all run.
fn fill(shim: &BenchShim, have: usize, want: usize) -> Result<usize> {
    if want <= have {
        return Ok(have);
    }
    println!("\n--- starting tasks {have}..{want}");
    let t = Instant::now();
    let ids: Vec<String> = (have..want).map(|i| format!("scale-{i}")).collect();
    let watcher = Watcher::new(shim)?;
    parallel(&ids, 16, |id| {
        shim.submit(id, "host")?;
        watcher.wait_running(id)
    })
    .into_iter()
    .collect::<Result<Vec<()>>>()?;
    let (total, running) = shim.counts()?;
    anyhow::ensure!(
        (total, running) == (want, want),
        "{running} of {total} tasks running, {want} expected"
    );
    println!(
        "  {want} tasks running ({:.1}s for {})",
        t.elapsed().as_secs_f64(),
        want - have
    );
    Ok(want)
}

/// dockerd's CPU over one window, as % of one core.
fn dockerd_percent(window: Duration) -> Result<f64> {
    let pid = dockerd_pid()?;
    let before = cpu_seconds(pid)?;
    let t = Instant::now();
    std::thread::sleep(window);
    let used = cpu_seconds(pid)? - before;
    Ok(used / t.elapsed().as_secs_f64() * 100.0)
}

/// Figure (2) at `tasks` running tasks: windows with the shim running and stopped,
/// alternating.
fn idle_cpu(shim: &mut BenchShim, tasks: usize, plan: &Plan) -> Result<Comparison> {
    println!(
        "\n--- idle dockerd CPU with {tasks} running tasks: {} round(s) of {:?} with and without the shim",
        plan.rounds, plan.window
    );
    let settle = plan.window / 4;
    let mut with = Vec::new();
    let mut without = Vec::new();
    let mut shim_cpu = Vec::new();
    for round in 0..plan.rounds {
        for running in if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        } {
            if running {
                shim.ensure_running()?;
                std::thread::sleep(settle);
                let pid = shim.pid()?;
                let own = cpu_seconds(pid)?;
                let t = Instant::now();
                with.push(dockerd_percent(plan.window)?);
                shim_cpu.push((cpu_seconds(pid)? - own) / t.elapsed().as_secs_f64() * 100.0);
                println!(
                    "  with the shim: dockerd {:.3}% of a core (the shim itself {:.3}%)",
                    with[with.len() - 1],
                    shim_cpu[shim_cpu.len() - 1]
                );
            } else {
                shim.stop()?;
                std::thread::sleep(settle);
                without.push(dockerd_percent(plan.window)?);
                println!(
                    "  without:       dockerd {:.3}% of a core",
                    without[without.len() - 1]
                );
            }
        }
    }
    // The shim runs again for what follows; all tasks must have survived the stops.
    shim.ensure_running()?;
    let (total, running) = shim.counts()?;
    anyhow::ensure!(
        (total, running) == (tasks, tasks),
        "after the idle windows {running} of {total} tasks run, {tasks} expected"
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let goal = if tasks >= 300 { 0.1 } else { 0.05 };
    Ok(Comparison::new(
        format!("idle_dockerd_cpu_{tasks}"),
        format!("idle dockerd CPU, {tasks} running tasks (raw: same containers, no shim)"),
        "%",
        mean(&with),
        Some(mean(&without)),
        Goal::ExtraAtMost(goal),
    )
    .with_detail(json!({
        "window_s": plan.window.as_secs_f64(), "with_shim": with, "without_shim": without,
        "shim_own_cpu_percent": shim_cpu,
        "resolution_percent": tick_seconds() / plan.window.as_secs_f64() * 100.0,
    })))
}

/// Figure (6) at `tasks` running tasks.
fn restart(ctx: &Ctx, shim: &mut BenchShim, tasks: usize, rounds: usize) -> Result<Comparison> {
    println!("\n--- SIGKILL with {tasks} running tasks -> all answer running; {rounds} round(s)");
    let owner = owner_identity(&shim.home);
    let docker = &ctx.scratch.docker;
    let mut shim_s = Vec::new();
    let mut raw_s = Vec::new();
    let mut inspect_s = Vec::new();
    let mut ratios = Vec::new();
    for round in 0..rounds {
        let shim_sample = |shim: &mut BenchShim| -> Result<f64> {
            let t = Instant::now();
            shim.kill()?;
            shim.spawn()?;
            loop {
                // Refused until the restarted shim listens (after restoring every task).
                if let Ok(list) = shim.api().get("/api/tasks") {
                    let running = list["tasks"]
                        .as_array()
                        .map_or(0, |l| l.iter().filter(|t| t["status"] == "running").count());
                    if running == tasks {
                        return Ok(t.elapsed().as_secs_f64());
                    }
                }
                if t.elapsed() > BOUND {
                    bail!("not all {tasks} tasks running {BOUND:?} after the restart");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        // What a program needs to learn the same from Docker: one list by label (its states
        // say running); until 2026-12-08 the raw side also inspected each container.
        // With `inspect`, also the time to list and then inspect each container (the raw
        // figure before 2026-12-05); else that time is `None`.
        let raw_sample = |inspect: bool| -> Result<(f64, Option<f64>)> {
            let t = Instant::now();
            let running = docker.running(LABEL_OWNER, &owner)?;
            let listed = t.elapsed().as_secs_f64();
            anyhow::ensure!(
                running.len() == tasks,
                "raw: {} of {tasks} running",
                running.len()
            );
            if !inspect {
                return Ok((listed, None));
            }
            let inspected: Vec<_> = parallel(&running, 8, |id| docker.inspect(id))
                .into_iter()
                .collect::<Result<_>>()?;
            let inspected_too = t.elapsed().as_secs_f64();
            anyhow::ensure!(
                inspected.len() == tasks,
                "raw: inspected {}",
                inspected.len()
            );
            Ok((listed, Some(inspected_too)))
        };
        // Paired: one list right before and one right after the shim's sample; the round's
        // reference is their mean (the list's own spread from one minute to the next is
        // larger than the shim's share, so a list taken at another moment says little).
        let (before, _) = raw_sample(false)?;
        let shim_round = shim_sample(shim)?;
        let (after, inspected) = raw_sample(true)?;
        let inspected = inspected.unwrap_or_default();
        let raw_round = (before + after) / 2.0;
        shim_s.push(shim_round);
        raw_s.push(raw_round);
        inspect_s.push(inspected);
        ratios.push(shim_round / raw_round);
        println!(
            "  round {round}: shim {shim_round:.3} s, raw list {before:.3} / {after:.3} s \
             before / after ({:.2}x; list + inspect, 8 at a time, {inspected:.3} s)",
            ratios[round]
        );
    }
    Ok(Comparison::new(
        format!("sigkill_to_all_running_{tasks}"),
        format!("SIGKILL → all {tasks} tasks answer `running` (raw: one list by label)"),
        "s",
        median(&shim_s),
        Some(median(&raw_s)),
        Goal::AtMostRawTimes(1.0),
    )
    .with_detail(json!({
        "tasks": tasks, "shim_s": shim_s, "raw_list_s": raw_s,
        "raw_list_and_inspect_s": inspect_s, "paired_ratios": ratios,
        "paired_ratio_median": median(&ratios),
    })))
}
