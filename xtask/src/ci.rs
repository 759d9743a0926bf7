//! `cargo xtask ci`: the whole check, as CI runs it (including a `bench --quick` smoke run). Every step runs even after a failure, so
//! one run reports all failures; a timing summary at the end shows where the time goes.

use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use shim_e2e::{ENV_TEST_DOCKER, ENV_TEST_ROOT};

use crate::cmd;
use crate::devenv::{self, Timings};
use shim_e2e::harness::cargo;

/// Runs dev-env (unless `skip_dev_env`), fmt, clippy, cargo-deny, the release artifacts
/// (`dist`), nextest, doctests, a quick bench and rustdoc.
pub fn ci(skip_dev_env: bool) -> Result<()> {
    let root = shim_e2e::repo_root();
    let mut timings = Timings::default();
    let mut failures: Vec<String> = Vec::new();
    let mut note = |name: &str, result: Result<()>| {
        if let Err(err) = result {
            eprintln!("\nci: step `{name}` FAILED: {err:#}");
            failures.push(format!("{name}: {err:#}"));
        }
    };

    if skip_dev_env {
        timings.record("dev-env", 0.0, "skipped");
    } else {
        let mut dev = Timings::default();
        let result = devenv::dev_env_timed(&mut dev);
        dev.print("dev-env timings:");
        let seconds = dev.total();
        timings.record(
            "dev-env",
            seconds,
            if result.is_ok() { "ok" } else { "FAILED" },
        );
        note("dev-env", result);
    }

    let result = timings.time("tools", ensure_tools);
    note("tools", result);

    let result = timings.time("fmt", || {
        cmd::run(cargo_in(&root).args(["fmt", "--all", "--", "--check"]))
    });
    note("fmt", result);

    let result = timings.time("clippy", || {
        cmd::run(cargo_in(&root).args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    });
    note("clippy", result);

    let result = timings.time("deny", || {
        cmd::run(cargo_in(&root).args(["deny", "check", "licenses", "bans", "sources"]))
    });
    note("deny", result);

    // A machine CI used before may hold stopped containers of an earlier run that was killed
    // before its clean-up (test names carry a per-run tag, so they no longer clash; this keeps
    // a reused machine from piling them up).
    let result = timings.time("stale test containers", remove_stale_test_containers);
    note("stale test containers", result);

    // The release artifacts (`target/dist/<release>/`) the tests check and run: the release
    // the tests use and the older one the server-driven tests replace and upgrade from. The
    // second build recompiles only the binary crate (its build script reads the release).
    for release in [shim_e2e::DSTACK_VERSION, shim_e2e::OLDER_DSTACK_VERSION] {
        let name = format!("dist {release}");
        let result = timings.time(&name, || {
            crate::dist::dist(&crate::dist::Options::for_release(release))
        });
        note(&name, result);
    }

    let result = timings.time("tests", || tests(&root));
    note("tests", result);

    // nextest does not run doctests: the embedding examples in the crate docs compile here.
    let result = timings.time("doctests", || {
        cmd::run(cargo_in(&root).args(["test", "--doc", "--workspace"]))
    });
    note("doctests", result);

    // A smoke run of the bench harness (few samples, no time asserted): fails only if the
    // harness itself breaks.
    let result = timings.time("bench --quick", || {
        crate::bench::bench(&crate::bench::Options::parse(&["--quick".to_owned()])?)
    });
    note("bench --quick", result);

    // Every public item of the library crates documented (missing docs are errors), and no
    // rustdoc warning anywhere.
    let result = timings.time("doc", || {
        cmd::run(
            cargo_in(&root)
                .args(["doc", "--workspace", "--no-deps"])
                .args(UNPUBLISHED.iter().flat_map(|p| ["--exclude", p]))
                .env("RUSTDOCFLAGS", "-D warnings -D missing_docs"),
        )?;
        cmd::run(
            cargo_in(&root)
                .args(["doc", "--no-deps"])
                .args(UNPUBLISHED.iter().flat_map(|p| ["-p", p]))
                .env("RUSTDOCFLAGS", "-D warnings"),
        )
    });
    note("doc", result);

    let result = timings.time("package", || package(&root));
    note("package", result);

    let result = timings.time("embed example", || embed_example(&root));
    note("embed example", result);

    timings.print("ci timings:");
    if failures.is_empty() {
        println!("\nci: all steps passed");
        Ok(())
    } else {
        eprintln!("\nci: {} step(s) failed:", failures.len());
        for failure in &failures {
            eprintln!("  - {failure}");
        }
        bail!("ci failed")
    }
}

/// The workspace's packages that are never published: the test package, the test runner and
/// xtask. (`dstack-shim` is not published either, but `cargo package` takes it: its
/// dependencies are the library crates.)
const UNPUBLISHED: [&str; 3] = ["xtask", "shim-e2e", "shim-test-runner"];

/// `cargo package --workspace` for everything but [`UNPUBLISHED`]: each crate is packaged as
/// crates.io would take it and built from its package alone, against the other crates'
/// packages (cargo resolves them locally), in `target/package-check`.
///
/// Cargo treats a registry crate of a given version as immutable: the unpacked sources of the
/// previous run's packages (under `$CARGO_HOME/registry/src/<local registry>/`) and their
/// compiled libraries would be reused as they are. Both are removed first, so each run checks
/// the crates as they are now; third-party dependencies stay compiled.
pub fn package(root: &Path) -> Result<()> {
    let metadata =
        cmd::output(cargo_in(root).args(["metadata", "--format-version", "1", "--no-deps"]))?;
    let metadata: serde_json::Value = serde_json::from_str(&metadata)?;
    let packages: Vec<(&str, &str)> = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["name"].as_str()?, p["version"].as_str()?)))
        .collect();
    let ours: Vec<String> = packages
        .iter()
        .map(|(name, version)| format!("{name}-{version}"))
        .collect();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cargo")));
    if let Some(home) = cargo_home {
        for kind in ["src", "cache"] {
            let dir = home.join("registry").join(kind);
            let Ok(registries) = fs_err::read_dir(&dir) else {
                continue;
            };
            for registry in registries.flatten() {
                if registry
                    .file_name()
                    .to_string_lossy()
                    .starts_with("index.crates.io-")
                {
                    continue;
                }
                for name in &ours {
                    for entry in [
                        registry.path().join(name),
                        registry.path().join(format!("{name}.crate")),
                    ] {
                        if entry.is_dir() {
                            fs_err::remove_dir_all(&entry)?;
                        } else if entry.exists() {
                            fs_err::remove_file(&entry)?;
                        }
                    }
                }
            }
        }
    }
    let target = root.join("target").join("package-check");
    let mut clean = cargo_in(root);
    clean.args(["clean", "--target-dir"]).arg(&target);
    for (package, _) in &packages {
        clean.args(["-p", package]);
    }
    if target.exists() {
        cmd::run(&mut clean)?;
    }
    cmd::run(
        cargo_in(root)
            .args(["package", "--workspace", "--target-dir"])
            .arg(&target)
            .args(UNPUBLISHED.iter().flat_map(|p| ["--exclude", p])),
    )
}

/// The embedder's example (`examples/embed-agent`, a project of its own that takes the library
/// crates by name and version): formatted, clippy-clean, and run once on the fake runtime and
/// once on Docker (it fails unless its task runs and ends as it asked).
fn embed_example(root: &Path) -> Result<()> {
    let manifest = root.join("examples/embed-agent/Cargo.toml");
    let target = root.join("target");
    let example = |subcommand: &str| {
        let mut command = cargo_in(root);
        command
            .arg(subcommand)
            .arg("--manifest-path")
            .arg(&manifest);
        command
    };
    cmd::run(example("fmt").args(["--", "--check"]))?;
    cmd::run(
        example("clippy")
            .args(["--locked", "--all-targets", "--target-dir"])
            .arg(&target)
            .args(["--", "-D", "warnings"]),
    )?;
    cmd::run(
        example("run")
            .args(["--locked", "--target-dir"])
            .arg(&target)
            .env_remove(ENV_TEST_DOCKER),
    )?;
    cmd::run(
        example("run")
            .args(["--locked", "--target-dir"])
            .arg(&target)
            .env(ENV_TEST_DOCKER, "1"),
    )
}

/// Every test (Docker and root ones included), watched for the daemon deadlock of Debian 12's
/// Docker ([`deadlock`](crate::deadlock)): on it, the run is ended, the daemon replaced and the
/// whole run started once more. Any other failure fails the step at once.
fn tests(root: &Path) -> Result<()> {
    for attempt in 1..=2 {
        let mut command = cargo_in(root);
        command
            .args(["nextest", "run", "--workspace", "--no-fail-fast"])
            .env(ENV_TEST_DOCKER, "1")
            .env(ENV_TEST_ROOT, "1");
        let line = cmd::display(&command);
        println!("$ {line}");
        let mut child = command
            .spawn()
            .with_context(|| format!("could not start `{line}`"))?;
        let watch = crate::deadlock::Watch::start(&child);
        let status = child.wait();
        let deadlocked = watch.finish();
        let status = status.with_context(|| format!("could not wait for `{line}`"))?;
        match deadlocked {
            None if status.success() => return Ok(()),
            None => bail!("`{line}` failed: {status}"),
            Some(minutes) if attempt == 1 => {
                println!(
                    "ci: the test run was ended because dockerd deadlocked ({minutes} min); \
                     replacing the daemon and running every test once more"
                );
                crate::deadlock::restart_daemon()?;
            }
            Some(minutes) => {
                bail!("dockerd deadlocked again in the second run ({minutes} min): moby/moby#46661")
            }
        }
    }
    unreachable!("the second attempt returns")
}

fn cargo_in(root: &Path) -> Command {
    let mut command = cmd::cmd(cargo());
    command.current_dir(root);
    command
}

/// Installs what the steps need and CI may lack: the rustfmt and clippy components,
/// cargo-nextest and cargo-deny (`cargo install --locked`, a few minutes each on 2 cores).
fn ensure_tools() -> Result<()> {
    for (probe, component) in [("fmt", "rustfmt"), ("clippy", "clippy")] {
        if cmd::succeeds(cmd::cmd(cargo()).args([probe, "--version"])) {
            println!("tools: cargo {probe} present");
        } else {
            cmd::run(cmd::cmd("rustup").args(["component", "add", component]))?;
        }
    }
    for (probe, krate) in [("nextest", "cargo-nextest"), ("deny", "cargo-deny")] {
        if cmd::succeeds(cmd::cmd(cargo()).args([probe, "--version"])) {
            println!("tools: cargo {probe} present");
        } else {
            cmd::run(cmd::cmd(cargo()).args(["install", "--locked", krate]))?;
        }
    }
    Ok(())
}

/// Removes the stopped containers made from a test image (they carry the image's
/// [`HASH_LABEL`](crate::image::HASH_LABEL); no real task does) that were created more than an
/// hour ago: no test runs that long, so another run's containers on the same daemon stay.
fn remove_stale_test_containers() -> Result<()> {
    let label = format!("label={}", crate::image::HASH_LABEL);
    cmd::run(Command::new("docker").args([
        "container",
        "prune",
        "--force",
        "--filter",
        &label,
        "--filter",
        "until=1h",
    ]))
}
