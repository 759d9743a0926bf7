//! `cargo xtask bench`: speed and memory figures, printed as a table and written to
//! `target/bench.json`. Nothing is asserted; every benchmark is bounded in time.
//!
//! 1. store: durable `task.json` write latency (`crates/shim-store/examples/write_latency.rs`,
//!    release build, on the target directory's file system);
//! 2. engine: the engine on the fake runtime (`crates/shim-engine/benches/engine.rs`): one
//!    reconcile cycle with 0, 50 and 500 running tasks, submit → running, exit → terminated,
//!    terminate, remove;
//! 3. docker: the release `dstack-shim` binary over HTTP against the real daemon (bridge
//!    network, the local test image, the stub runner): submit → running, runner exit →
//!    terminated, terminate with timeout 0, remove, the shim's RSS idle and with 20 running
//!    tasks, and its restart time (SIGKILL → API answering with the 20 tasks restored).

use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use shim_e2e::harness::{self, Api, ContainerSweeper, ShimProcess, cargo, status_of};

use crate::{cmd, demo, docker, run};

/// Options of `cargo xtask bench`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Fewer iterations (a smoke run of the harness).
    pub quick: bool,
    /// Skip the benchmarks that need Docker.
    pub no_docker: bool,
}

/// One measured figure.
#[derive(Debug, Clone)]
enum Figure {
    /// A latency distribution, in microseconds.
    Time {
        n: usize,
        min: f64,
        p50: f64,
        p90: f64,
        p99: f64,
        max: f64,
    },
    /// A memory size in KiB.
    Memory { kib: u64 },
}

#[derive(Debug, Clone)]
struct Row {
    group: &'static str,
    name: String,
    figure: Figure,
}

impl Row {
    /// A latency row from samples in microseconds.
    fn times(group: &'static str, name: impl Into<String>, mut us: Vec<f64>) -> Row {
        us.sort_by(f64::total_cmp);
        let pct = |p: usize| {
            if us.is_empty() {
                0.0
            } else {
                us[(us.len() - 1) * p / 100]
            }
        };
        Row {
            group,
            name: name.into(),
            figure: Figure::Time {
                n: us.len(),
                min: pct(0),
                p50: pct(50),
                p90: pct(90),
                p99: pct(99),
                max: pct(100),
            },
        }
    }

    /// A latency row from durations.
    fn durations(group: &'static str, name: impl Into<String>, samples: &[Duration]) -> Row {
        Row::times(
            group,
            name,
            samples.iter().map(|d| d.as_secs_f64() * 1e6).collect(),
        )
    }

    /// A latency row from a `{"name","n","min_us","p50_us",..}` object.
    fn from_json(group: &'static str, value: &Value) -> Result<Row> {
        let f = |key: &str| {
            value[key]
                .as_f64()
                .with_context(|| format!("no {key} in {value}"))
        };
        Ok(Row {
            group,
            name: value["name"]
                .as_str()
                .with_context(|| format!("no name in {value}"))?
                .to_owned(),
            figure: Figure::Time {
                n: usize::try_from(value["n"].as_u64().unwrap_or(0)).unwrap_or(0),
                min: f("min_us")?,
                p50: f("p50_us")?,
                p90: f("p90_us")?,
                p99: f("p99_us")?,
                max: f("max_us")?,
            },
        })
    }

    fn json(&self) -> Value {
        let round = |us: f64| (us * 10.0).round() / 10.0;
        match self.figure {
            Figure::Time {
                n,
                min,
                p50,
                p90,
                p99,
                max,
            } => json!({
                "group": self.group, "name": self.name, "n": n,
                "min_us": round(min), "p50_us": round(p50), "p90_us": round(p90),
                "p99_us": round(p99), "max_us": round(max),
            }),
            Figure::Memory { kib } => json!({
                "group": self.group, "name": self.name, "rss_kib": kib,
            }),
        }
    }
}

/// A duration in microseconds, readable.
fn human(us: f64) -> String {
    if us < 1.0 {
        format!("{:.0} ns", us * 1000.0)
    } else if us < 1000.0 {
        format!("{us:.1} µs")
    } else if us < 1_000_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

fn print_table(rows: &[Row]) {
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(0).max(10);
    println!(
        "\n{:<7} {:<width$} {:>5} {:>10} {:>10} {:>10} {:>10}",
        "group", "benchmark", "n", "median", "p90", "p99", "max"
    );
    for row in rows {
        match row.figure {
            Figure::Time {
                n,
                p50,
                p90,
                p99,
                max,
                ..
            } => println!(
                "{:<7} {:<width$} {n:>5} {:>10} {:>10} {:>10} {:>10}",
                row.group,
                row.name,
                human(p50),
                human(p90),
                human(p99),
                human(max)
            ),
            Figure::Memory { kib } => println!(
                "{:<7} {:<width$} {:>5} {:>10}",
                row.group,
                row.name,
                1,
                format!("{:.1} MiB", kib as f64 / 1024.0)
            ),
        }
    }
}

/// `cargo xtask bench [--quick] [--no-docker]`.
pub fn bench(opts: Options) -> Result<()> {
    let started = Instant::now();
    let mut rows = Vec::new();
    println!("=== store: durable task.json writes");
    rows.push(store(opts)?);
    println!("\n=== engine on the fake runtime");
    rows.extend(engine(opts)?);
    if opts.no_docker {
        println!("\n=== docker: skipped (--no-docker)");
    } else {
        println!("\n=== docker: the release binary over HTTP");
        demo::ensure_fixtures()?;
        rows.extend(docker_benches(opts)?);
    }
    print_table(&rows);

    let path = harness::target_dir().join("bench.json");
    let report = json!({
        "date": cmd::output(cmd::cmd("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]))
            .map(|d| d.trim().to_owned())
            .unwrap_or_default(),
        "host": host(),
        "quick": opts.quick,
        "profile": "release",
        "results": rows.iter().map(Row::json).collect::<Vec<_>>(),
    });
    fs_err::write(&path, serde_json::to_vec_pretty(&report)?)?;
    println!(
        "\nbench: wrote {} (took {:.0}s)",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
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
    let mem_kib = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|k| k.parse::<u64>().ok())
        .unwrap_or(0);
    json!({
        "cpus": std::thread::available_parallelism().map(usize::from).unwrap_or(0),
        "cpu_model": cpu_model,
        "mem_mib": mem_kib / 1024,
        "kernel": read("/proc/sys/kernel/osrelease"),
        "debian": read("/etc/debian_version"),
        "docker": docker::server_version().unwrap_or_default(),
    })
}

/// Durable writes with the `write_latency` example.
fn store(opts: Options) -> Result<Row> {
    let count = if opts.quick { "50" } else { "500" };
    let target = harness::target_dir();
    let mut command = cmd::cmd(cargo());
    command
        .current_dir(shim_e2e::repo_root())
        .args([
            "run",
            "--release",
            "-p",
            "shim-store",
            "--example",
            "write_latency",
            "--",
        ])
        .arg(&target)
        .arg(count);
    println!("$ {}", cmd::display(&command));
    let out = cmd::output(&mut command)?;
    let mut json_line = None;
    for line in out.lines() {
        match line.strip_prefix("json ") {
            Some(json) => json_line = Some(json),
            None => println!("{line}"),
        }
    }
    let value: Value = serde_json::from_str(json_line.context("write_latency printed no json")?)?;
    Row::from_json("store", &value)
}

/// The engine bench on the fake runtime.
fn engine(opts: Options) -> Result<Vec<Row>> {
    let path = harness::target_dir().join("bench-engine.json");
    let mut command = cmd::cmd(cargo());
    command
        .current_dir(shim_e2e::repo_root())
        .args(["bench", "-p", "shim-engine", "--bench", "engine", "--"])
        .arg("--json")
        .arg(&path);
    if opts.quick {
        command.arg("--quick");
    }
    cmd::run(&mut command)?;
    let value: Value = serde_json::from_slice(&fs_err::read(&path)?)?;
    value["benchmarks"]
        .as_array()
        .with_context(|| format!("no benchmarks in {}", path.display()))?
        .iter()
        .map(|b| Row::from_json("engine", b))
        .collect()
}

/// Polls a task every 5 ms until it has `status` (bounded); returns its TaskInfo and when the
/// status was first seen.
fn poll_until(api: &Api, id: &str, status: &str, limit: Duration) -> Result<(Value, SystemTime)> {
    let started = Instant::now();
    loop {
        let info = api.task(id)?;
        let now = status_of(&info);
        if now == status {
            return Ok((info, SystemTime::now()));
        }
        if now == "terminated" {
            bail!("task {id} ended while waiting for {status}: {info}");
        }
        if started.elapsed() > limit {
            bail!("task {id} not {status} after {limit:?}: {info}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A task of the local test image in network `mode`.
fn task_config(id: &str, mode: &str) -> Value {
    json!({
        "id": id,
        "name": id,
        "image_name": shim_e2e::image(),
        "network_mode": mode,
    })
}

/// When the container stopped, per Docker (`State.FinishedAt`).
fn finished_at(container: &str) -> Result<SystemTime> {
    let text = cmd::output(cmd::cmd("docker").args([
        "inspect",
        "--type",
        "container",
        "--format",
        "{{.State.FinishedAt}}",
        container,
    ]))?;
    parse_rfc3339_utc(text.trim()).with_context(|| format!("cannot parse FinishedAt {text:?}"))
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (what Docker writes).
fn parse_rfc3339_utc(text: &str) -> Option<SystemTime> {
    let (date, time) = text.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(str::parse::<i64>);
    let (year, month, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let (hms, fraction) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(str::parse::<i64>);
    let (h, m, s) = (t.next()?.ok()?, t.next()?.ok()?, t.next()?.ok()?);
    let nanos: u32 = if fraction.is_empty() {
        0
    } else {
        let digits: String = fraction
            .chars()
            .chain(std::iter::repeat('0'))
            .take(9)
            .collect();
        digits.parse().ok()?
    };
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) {
        return None;
    }
    // Days since 1970-01-01 (H. Hinnant's days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days * 86_400 + h * 3600 + m * 60 + s).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Microseconds from `earlier` to `later` (None if the clock says `later` came first).
fn us_between(earlier: SystemTime, later: SystemTime) -> Option<f64> {
    later
        .duration_since(earlier)
        .ok()
        .map(|d| d.as_secs_f64() * 1e6)
}

/// `n` tasks one at a time in network `mode`: submit -> running, runner exit -> terminated,
/// remove. Task ids are `<prefix><i>`.
fn sequential(api: &Api, home: &Path, prefix: &str, mode: &str, n: usize) -> Result<Vec<Row>> {
    const G: &str = "docker";
    println!(
        "\n=== {n} tasks one at a time ({mode} network): submit -> running -> runner exits -> terminated -> remove"
    );
    let mut submit = Vec::new();
    let mut exit_file = Vec::new();
    let mut exit_docker = Vec::new();
    let mut remove = Vec::new();
    for i in 0..n {
        let id = format!("{prefix}{i}");
        let t = Instant::now();
        api.post("/api/tasks", &task_config(&id, mode))?;
        let (running, _) = poll_until(api, &id, "running", Duration::from_secs(60))?;
        submit.push(t.elapsed());
        let t = Instant::now();
        harness::write_runner_exit(home, &running, 0)?;
        let (info, seen) = poll_until(api, &id, "terminated", Duration::from_secs(30))?;
        exit_file.push(t.elapsed());
        anyhow::ensure!(
            info["termination_reason"] == "done_by_runner",
            "task {id} ended unexpectedly: {info}"
        );
        let container = info["container_id"].as_str().unwrap_or_default();
        let after_exit = us_between(finished_at(container)?, seen);
        exit_docker.extend(after_exit);
        let t = Instant::now();
        api.post(&format!("/api/tasks/{id}/remove"), &json!({}))?;
        remove.push(t.elapsed());
        println!(
            "  {id}: running {:.0} ms after submit; terminated {:.0} ms after the exit file, {:.0} ms after the container exited",
            submit[i].as_secs_f64() * 1e3,
            exit_file[i].as_secs_f64() * 1e3,
            after_exit.unwrap_or(f64::NAN) / 1e3,
        );
    }
    Ok(vec![
        Row::durations(G, format!("submit -> running ({mode})"), &submit),
        Row::durations(
            G,
            format!("exit file -> terminated ({mode}; runner polls 100 ms)"),
            &exit_file,
        ),
        Row::times(
            G,
            format!("container exit (FinishedAt) -> terminated ({mode})"),
            exit_docker,
        ),
        Row::durations(G, format!("remove terminated ({mode})"), &remove),
    ])
}

/// The benchmarks against the real daemon.
fn docker_benches(opts: Options) -> Result<Vec<Row>> {
    println!("\n=== build (release)");
    let binary = run::build_shim(true)?;
    let tmp = tempfile::Builder::new()
        .prefix("xtask-bench-")
        .tempdir_in(harness::target_dir())?;
    let home = tmp.path().join("home");
    fs_err::create_dir_all(&home)?;
    let log = tmp.path().join("shim.log");
    let port = harness::free_port()?;
    // Free runner ports: host-network tasks listen on them on this machine.
    let http_port = harness::free_port()?;
    let ssh_port = loop {
        let port = harness::free_port()?;
        if port != http_port {
            break port;
        }
    };
    let args = vec![
        "--runner-binary-path".to_owned(),
        shim_e2e::runner_path().display().to_string(),
        "--runner-http-port".to_owned(),
        http_port.to_string(),
        "--runner-ssh-port".to_owned(),
        ssh_port.to_string(),
    ];
    let prefix = format!("xbench-{}-", std::process::id());
    let sweeper = ContainerSweeper::for_home(&home);
    let mut rows = Vec::new();
    const G: &str = "docker";

    println!("\n=== start");
    let t = Instant::now();
    let mut shim = ShimProcess::start(&binary, &home, port, &args, &log)?;
    rows.push(Row::durations(
        G,
        "start (spawn -> API answers), empty home",
        &[t.elapsed()],
    ));
    let api = shim.api();
    println!(
        "dstack-shim pid {} on {} (log {})",
        shim.pid(),
        api.addr,
        log.display()
    );
    std::thread::sleep(Duration::from_secs(1));
    let idle = shim.rss_kib()?;
    println!("idle RSS: {idle} KiB");
    rows.push(Row {
        group: G,
        name: "shim RSS, idle".into(),
        figure: Figure::Memory { kib: idle },
    });

    // Sequential tasks, in both network modes.
    let n = if opts.quick { 3 } else { 10 };
    for mode in ["bridge", "host"] {
        rows.extend(sequential(
            &api,
            &home,
            &format!("{prefix}{mode}"),
            mode,
            n,
        )?);
    }

    // 20 running tasks: memory, restart, terminate.
    let many = 20;
    println!("\n=== {many} running tasks: RSS, SIGKILL + restart, terminate");
    let t = Instant::now();
    let ids: Vec<String> = (0..many).map(|i| format!("{prefix}many{i}")).collect();
    for id in &ids {
        api.post("/api/tasks", &task_config(id, "bridge"))?;
    }
    for id in &ids {
        poll_until(&api, id, "running", Duration::from_secs(120))?;
    }
    let all_running = t.elapsed();
    println!("{many} tasks submitted at once all running after {all_running:.1?}");
    rows.push(Row::durations(
        G,
        "20 submits at once -> all running (bridge)",
        &[all_running],
    ));
    std::thread::sleep(Duration::from_secs(1));
    let busy = shim.rss_kib()?;
    println!("RSS with {many} running: {busy} KiB");
    rows.push(Row {
        group: G,
        name: format!("shim RSS, {many} running tasks"),
        figure: Figure::Memory { kib: busy },
    });

    let t = Instant::now();
    shim.kill()?;
    shim = ShimProcess::spawn(&binary, &home, port, &args, &log)?;
    shim.wait_answering(Duration::from_secs(60), Duration::from_millis(5))?;
    let restart = t.elapsed();
    let api = shim.api();
    let tasks = api.get("/api/tasks")?;
    let running = tasks["tasks"]
        .as_array()
        .map_or(0, |t| t.iter().filter(|t| t["status"] == "running").count());
    anyhow::ensure!(
        running == many,
        "after the restart {running} of {many} tasks are running: {tasks}"
    );
    println!("SIGKILL -> answering again with {running} running tasks restored: {restart:.1?}");
    rows.push(Row::durations(
        G,
        "restart: SIGKILL -> API answers, 20 tasks restored",
        &[restart],
    ));
    std::thread::sleep(Duration::from_secs(1));
    let restored = shim.rss_kib()?;
    rows.push(Row {
        group: G,
        name: format!("shim RSS, {many} restored tasks"),
        figure: Figure::Memory { kib: restored },
    });

    let mut terminate = Vec::new();
    for id in &ids {
        let t = Instant::now();
        let info = api.post(
            &format!("/api/tasks/{id}/terminate"),
            &json!({"termination_reason": "terminated_by_user", "termination_message": "", "timeout": 0}),
        )?;
        terminate.push(t.elapsed());
        anyhow::ensure!(info["status"] == "terminated", "terminate answered {info}");
        api.post(&format!("/api/tasks/{id}/remove"), &json!({}))?;
    }
    rows.push(Row::durations(
        G,
        "terminate running (timeout 0)",
        &terminate,
    ));

    let t = Instant::now();
    api.post("/api/shutdown", &json!({"force": false}))?;
    let status = shim.wait_exit(Duration::from_secs(30))?;
    anyhow::ensure!(status.success(), "dstack-shim exited with {status}");
    rows.push(Row::durations(
        G,
        "graceful shutdown (idle)",
        &[t.elapsed()],
    ));
    let left = sweeper.sweep();
    anyhow::ensure!(left == 0, "{left} containers were left after remove");
    let path = tmp.path().to_owned();
    tmp.close()
        .with_context(|| format!("could not delete {}", path.display()))?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_docker_timestamps() {
        let t = parse_rfc3339_utc("1970-01-01T00:00:01.5Z").unwrap();
        assert_eq!(t, UNIX_EPOCH + Duration::from_millis(1500));
        let t = parse_rfc3339_utc("2026-11-29T20:40:01.123456789Z").unwrap();
        // date -u -d 2026-11-29T20:40:01Z +%s
        assert_eq!(t, UNIX_EPOCH + Duration::new(1_795_984_801, 123_456_789));
        let t = parse_rfc3339_utc("2000-02-29T00:00:00Z").unwrap();
        assert_eq!(t, UNIX_EPOCH + Duration::from_secs(951_782_400));
        assert!(parse_rfc3339_utc("0001-01-01T00:00:00Z").is_none());
        assert!(parse_rfc3339_utc("2026-11-29T20:40:01+01:00").is_none());
        assert!(parse_rfc3339_utc("garbage").is_none());
    }

    #[test]
    fn percentiles_and_units() {
        let row = Row::times("g", "x", vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        match row.figure {
            Figure::Time {
                n, min, p50, max, ..
            } => {
                assert_eq!((n, min, p50, max), (5, 1.0, 3.0, 5.0));
            }
            Figure::Memory { .. } => panic!("not a time row"),
        }
        assert_eq!(human(0.41), "410 ns");
        assert_eq!(human(28.29), "28.3 µs");
        assert_eq!(human(3075.0), "3.08 ms");
        assert_eq!(human(2_500_000.0), "2.50 s");
        let back = Row::from_json("g", &row.json()).unwrap();
        assert_eq!(back.name, "x");
    }
}
