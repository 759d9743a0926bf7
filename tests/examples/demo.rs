//! One task's whole life on the real shim and Docker, narrated: `cargo xtask demo [--large]`
//! (which makes the fixtures ready first: Docker, the test image, the registry), or
//! `cargo run -p shim-e2e --example demo [-- --large]` on a machine already set up.
//!
//! Starts `dstack-shim` on a temporary home and a free port with the stub runner and two fake
//! GPUs, submits a task that pulls the small registry image with credentials (bridge network,
//! one GPU), prints every change it sees while polling, makes the runner exit with 0, checks
//! that the task ends `done_by_runner`, removes it and shuts the shim down over the API. Any
//! unexpected answer fails the demo.

#![allow(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "the demo narrates to the person running it"
)]

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

use shim_e2e::harness::{self, Api, ContainerSweeper, Request, ShimProcess, status_of};

fn main() -> std::process::ExitCode {
    let large = match std::env::args().skip(1).collect::<Vec<_>>().as_slice() {
        [] => false,
        [flag] if flag == "--large" => true,
        _ => {
            eprintln!("usage: demo [--large]");
            return std::process::ExitCode::FAILURE;
        }
    };
    match demo(large) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Removes `image` from the local daemon (an error when it is not there).
fn rmi(image: &str) -> Result<()> {
    let out = harness::try_docker(&["rmi", image])?;
    anyhow::ensure!(
        out.status.success(),
        "docker rmi {image}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Prints `text` prefixed with the seconds since `t0`.
fn say(t0: Instant, text: &str) {
    println!("[{:>7.3}s] {text}", t0.elapsed().as_secs_f64());
}

/// The demo; with `large`, the task pulls the large registry image (one
/// layer of 220 MiB, so the pull progress moves), which is removed from the local daemon
/// again at the end.
pub fn demo(large: bool) -> Result<()> {
    println!("=== build");
    println!("$ cargo build -p dstack-shim --bin dstack-shim");
    let binary = harness::build_shim(false, Duration::from_secs(3600))
        .context("could not build dstack-shim")?;

    let pid = std::process::id();
    let id = format!("demo-{pid}");
    let name = format!("shim-demo-{pid}");
    let tmp = tempfile::Builder::new()
        .prefix("shim-demo-")
        .tempdir_in(harness::target_dir())?;
    let home = tmp.path().join("home");
    fs_err::create_dir_all(&home)?;
    let _sweeper = ContainerSweeper::for_home(&home);
    let log = tmp.path().join("shim.log");
    let port = harness::free_port()?;
    let runner = shim_e2e::runner_path();
    let args = vec![
        "--runner-binary-path".to_owned(),
        runner.display().to_string(),
        "--fake-gpus".to_owned(),
        "2".to_owned(),
    ];

    println!("\n=== start the shim");
    let t0 = Instant::now();
    let shim = ShimProcess::start(&binary, &home, port, &args, &log)?;
    let api = shim.api();
    say(
        t0,
        &format!(
            "dstack-shim pid {} answers on {} (home {}, log {})",
            shim.pid(),
            api.addr,
            home.display(),
            log.display()
        ),
    );
    say(
        t0,
        &format!("healthcheck: {}", api.get("/api/healthcheck")?),
    );
    say(
        t0,
        &format!("instance info: {}", api.get("/api/instance/info")?),
    );

    let image_ref = if large {
        shim_e2e::registry_large_image()
    } else {
        shim_e2e::registry_small_image()
    };
    if harness::try_docker(&["image", "inspect", &image_ref])?
        .status
        .success()
    {
        // For the small image this only untags: its layers are shared with the local test
        // image, but the shim must still fetch the manifest from the registry with the
        // credentials. The large image's layer is downloaded again.
        match rmi(&image_ref) {
            Ok(_) => say(t0, &format!("removed {image_ref} from the local daemon")),
            Err(err) => say(
                t0,
                &format!("warning: could not remove {image_ref}: {err:#}"),
            ),
        }
    }

    println!("\n=== submit");
    let config = json!({
        "id": id,
        "name": name,
        "image_name": image_ref,
        "registry_username": shim_e2e::registry_user(),
        "registry_password": shim_e2e::registry_password(),
        "gpu": 1,
        "network_mode": "bridge",
    });
    // Submit answers with the Go field names of upstream's runner TaskInfo (`Status`).
    let info = api.post("/api/tasks", &config)?;
    say(
        t0,
        &format!(
            "POST /api/tasks {id} ({image_ref}, gpu 1, bridge) -> {}",
            info["Status"].as_str().unwrap_or("?")
        ),
    );
    expect_eq(&info["Status"], "pending", "status after submit")?;

    let mut watch = Watch::default();
    let info = watch.until(t0, &api, &id, "running", Duration::from_secs(120))?;
    check_running(&info)?;
    runner_health(t0, &info)?;
    let pull_log = harness::task_dir(&home, &id).join("pull.log");
    let text = fs_err::read_to_string(&pull_log).unwrap_or_default();
    say(
        t0,
        &format!(
            "pull.log ({} lines; the daemon's raw progress stream):",
            text.lines().count()
        ),
    );
    for line in text.lines().take(8) {
        println!("             {line}");
    }
    anyhow::ensure!(
        !text.contains(&shim_e2e::registry_password()),
        "the registry password is in pull.log"
    );

    println!("\n=== the runner exits with 0");
    harness::write_runner_exit(&home, &info, 0)?;
    say(
        t0,
        &format!(
            "wrote 0 to {}",
            harness::runner_dir(&home, &info)
                .join(shim_e2e::RUNNER_EXIT_FILE)
                .display()
        ),
    );
    let info = watch.until(t0, &api, &id, "terminated", Duration::from_secs(60))?;
    expect_eq(
        &info["termination_reason"],
        "done_by_runner",
        "termination reason",
    )?;
    expect_eq(&info["termination_message"], "", "termination message")?;
    say(t0, "terminated done_by_runner");
    say(t0, &format!("GET /api/tasks: {}", api.get("/api/tasks")?));

    println!("\n=== remove and shut down");
    api.post(&format!("/api/tasks/{id}/remove"), &json!({}))?;
    say(t0, &format!("POST /api/tasks/{id}/remove -> 200"));
    let gone = api.call("GET", &format!("/api/tasks/{id}"), None, 404)?;
    say(
        t0,
        &format!("GET /api/tasks/{id} -> 404 {}", gone.body.trim()),
    );
    let container = info["container_name"].as_str().unwrap_or_default();
    anyhow::ensure!(
        !harness::container_exists(container),
        "container {container} still exists after remove"
    );
    say(t0, &format!("container {container} is gone"));
    api.post("/api/shutdown", &json!({"force": false}))?;
    say(t0, "POST /api/shutdown {\"force\":false} -> 200");
    let status = shim.wait_exit(Duration::from_secs(30))?;
    anyhow::ensure!(status.success(), "dstack-shim exited with {status}");
    say(t0, "dstack-shim exited with 0");
    if large {
        // So that pull tests download it again (dev-env leaves it out of the daemon).
        match rmi(&image_ref) {
            Ok(_) => say(
                t0,
                &format!("removed {image_ref} from the local daemon again"),
            ),
            Err(err) => say(
                t0,
                &format!("warning: could not remove {image_ref}: {err:#}"),
            ),
        }
    }
    println!("\ndemo: ok");
    Ok(())
}

/// Fails unless `value` is the string `want`.
fn expect_eq(value: &Value, want: &str, what: &str) -> Result<()> {
    if value.as_str() != Some(want) {
        bail!("{what}: expected {want:?}, got {value}");
    }
    Ok(())
}

/// Checks what a running bridge-mode task with one GPU must show.
fn check_running(info: &Value) -> Result<()> {
    let gpus = info["gpus_ids"].as_array().map_or(0, Vec::len);
    anyhow::ensure!(gpus == 1, "expected 1 GPU id, got {}", info["gpus_ids"]);
    anyhow::ensure!(
        !info["container_id"].as_str().unwrap_or_default().is_empty(),
        "no container id: {info}"
    );
    for port in [10999, 10022] {
        anyhow::ensure!(
            host_port(info, port).is_some(),
            "container port {port} is not published: {}",
            info["ports"]
        );
    }
    Ok(())
}

/// The host port published for `container` port.
fn host_port(info: &Value, container: u64) -> Option<u16> {
    info["ports"]
        .as_array()?
        .iter()
        .find(|p| p["container"].as_u64() == Some(container))
        .and_then(|p| p["host"].as_u64())
        .and_then(|h| u16::try_from(h).ok())
}

/// Asks the stub runner's HTTP server in the container, through the published port.
fn runner_health(t0: Instant, info: &Value) -> Result<()> {
    let port = host_port(info, 10999).context("no runner port")?;
    let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
    let started = Instant::now();
    // docker-proxy accepts before the runner listens: retry for a few seconds.
    loop {
        match Request::get("/api/healthcheck").send(addr) {
            Ok(r) if r.status == 200 => {
                say(
                    t0,
                    &format!(
                        "runner in the container answers on 127.0.0.1:{port}: {}",
                        r.body.trim()
                    ),
                );
                return Ok(());
            }
            Ok(r) if started.elapsed() > Duration::from_secs(10) => {
                bail!("the runner answered {}: {}", r.status, r.body)
            }
            Err(err) if started.elapsed() > Duration::from_secs(10) => {
                return Err(anyhow::Error::new(err).context("the runner never answered"));
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Prints what changes between polls of a task.
#[derive(Default)]
struct Watch {
    last: Vec<(&'static str, String)>,
}

impl Watch {
    const FIELDS: [&'static str; 8] = [
        "status",
        "image_pull_progress",
        "gpus_ids",
        "container_name",
        "container_id",
        "ports",
        "termination_reason",
        "termination_message",
    ];

    /// Polls the task every 20 ms, printing changed fields, until it has `status`; fails if it
    /// ends otherwise or `limit` passes.
    fn until(
        &mut self,
        t0: Instant,
        api: &Api,
        id: &str,
        status: &str,
        limit: Duration,
    ) -> Result<Value> {
        let started = Instant::now();
        loop {
            let info = api.task(id)?;
            self.show(t0, &info);
            let now = status_of(&info);
            if now == status {
                return Ok(info);
            }
            if now == "terminated" {
                bail!("task {id} ended while waiting for {status}: {info}");
            }
            if started.elapsed() > limit {
                bail!("task {id} not {status} after {limit:?}: {info}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn show(&mut self, t0: Instant, info: &Value) {
        for field in Self::FIELDS {
            let value = match &info[field] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let seen = self.last.iter_mut().find(|(f, _)| *f == field);
            let changed = match seen {
                Some((_, old)) if *old == value => false,
                Some((_, old)) => {
                    *old = value.clone();
                    true
                }
                None => {
                    self.last.push((field, value.clone()));
                    value != "null" && !value.is_empty()
                }
            };
            if changed {
                match pull_progress(&info[field]) {
                    Some(progress) if field == "image_pull_progress" => {
                        say(t0, &format!("pull progress: {progress}"));
                    }
                    _ => say(t0, &format!("{field}: {value}")),
                }
            }
        }
    }
}

/// `image_pull_progress` in MiB, e.g. `downloaded 24.3 / 221.1 MiB, extracted 0.0 MiB`.
fn pull_progress(progress: &Value) -> Option<String> {
    let mib = |key: &str| progress[key].as_u64().map(|b| b as f64 / (1024.0 * 1024.0));
    let total = mib("total_bytes")?;
    let approx = if progress["is_total_bytes_final"] == true {
        ""
    } else {
        " so far"
    };
    Some(format!(
        "downloaded {:.1} / {total:.1} MiB{approx}, extracted {:.1} MiB",
        mib("downloaded_bytes")?,
        mib("extracted_bytes")?
    ))
}
