//! `cargo xtask ci`: the whole check, as CI runs it (including a `bench --quick` smoke run). Every step runs even after a failure, so
//! one run reports all failures; a timing summary at the end shows where the time goes.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};
use shim_e2e::{ENV_TEST_DOCKER, ENV_TEST_ROOT};

use crate::cmd;
use crate::devenv::{self, Timings};
use crate::engines::{self, Row};
use shim_e2e::harness::artifact::Arch;
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
            let mut options = crate::dist::Options::for_release(release);
            // The release the tests use is built for both architectures: the other one runs
            // under qemu-user in the dist tests.
            if release == shim_e2e::DSTACK_VERSION {
                options.arches = vec![Arch::Amd64, Arch::Arm64];
            }
            crate::dist::dist(&options)
        });
        note(&name, result);
    }

    let main = engines::MAIN;
    let mut main_row = Row {
        engine: main.name.to_owned(),
        version: main.version().unwrap_or_else(|| "-".to_owned()),
        store: main.driver().map_or_else(
            || main.store().to_owned(),
            |d| format!("{} ({d})", main.store()),
        ),
        ..Row::default()
    };
    let started = std::time::Instant::now();
    let result = timings.time("tests", || tests(&root, &mut main_row));
    note("tests", result);
    let result = timings.time("lifecycle (main engine)", || {
        let shim = shim_e2e::dist_artifact(shim_e2e::DSTACK_VERSION);
        let (passed, failed) = crate::conformance::lifecycle(&main, &shim)?;
        main_row
            .parts
            .push(("lifecycle".to_owned(), passed, failed));
        anyhow::ensure!(failed == 0, "{failed} lifecycle check(s) failed");
        Ok(())
    });
    note("lifecycle (main engine)", result);
    let result = timings.time("gpu lifecycle (main engine)", || {
        let shim = shim_e2e::dist_artifact(shim_e2e::DSTACK_VERSION);
        let (passed, failed) = crate::conformance::gpu_lifecycle(&main, &shim, &mut main_row.gpu)?;
        main_row.parts.push(("gpu".to_owned(), passed, failed));
        anyhow::ensure!(failed == 0, "{failed} GPU check(s) failed");
        Ok(())
    });
    note("gpu lifecycle (main engine)", result);
    main_row.seconds = started.elapsed().as_secs_f64();

    // The conformance part: the runtime tests and the lifecycle on every other engine.
    let mut rows = vec![main_row];
    let result = timings.time("conformance", || {
        let conformance = crate::conformance::conformance(&[])?;
        let failed: Vec<String> = conformance
            .iter()
            .filter(|row| !row.passed())
            .map(|row| row.engine.clone())
            .collect();
        rows.extend(conformance);
        anyhow::ensure!(failed.is_empty(), "failed on {}", failed.join(", "));
        Ok(())
    });
    note("conformance", result);

    // nextest does not run doctests: the embedding examples in the crate docs compile here.
    let result = timings.time("doctests", || {
        cmd::run(cargo_in(&root).args(["test", "--doc", "--workspace"]))
    });
    note("doctests", result);

    // A smoke run of the bench harness (few samples, no time asserted): fails only if the
    // harness itself breaks.
    let result = timings.time("bench --quick", || crate::bench(&["--quick".to_owned()]));
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
    println!("\n{}", engines::table(&rows));
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

/// The workspace's packages that are never published: the test package, the test runner, the
/// bench and xtask. (`dstack-shim` is not published either, but `cargo package` takes it: its
/// dependencies are the library crates.)
const UNPUBLISHED: [&str; 4] = ["xtask", "shim-e2e", "shim-test-runner", "shim-bench"];

/// `cargo package --workspace` for everything but [`UNPUBLISHED`]: each crate is packaged as
/// crates.io would take it and built from its package alone, against the other crates'
/// packages (cargo resolves them locally), in `target/package-check`.
///
/// Cargo treats a registry crate of a given version as immutable: the unpacked sources of the
/// previous run's packages (under `$CARGO_HOME/registry/src/<local registry>/`) and their
/// compiled libraries would be reused as they are. Both are removed first, so each run checks
/// the crates as they are now. The build directory is removed after (GiBs: a second copy of
/// every dependency, built when the disk is fullest).
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
    if target.exists() {
        fs_err::remove_dir_all(&target)?;
    }
    let result = cmd::run(
        cargo_in(root)
            .args(["package", "--workspace", "--target-dir"])
            .arg(&target)
            .args(UNPUBLISHED.iter().flat_map(|p| ["--exclude", p])),
    );
    fs_err::remove_dir_all(&target)?;
    result
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
    for docker in ["", "1"] {
        cmd::run(
            example("run")
                .args(["--locked", "--target-dir"])
                .arg(&target)
                .env(ENV_TEST_DOCKER, docker),
        )?;
    }
    Ok(())
}

/// Every test (Docker and root ones included) on the main engine; the row of the engine
/// table for it (the suite's counts and the release binary's lifecycle).
fn tests(root: &Path, row: &mut Row) -> Result<()> {
    let mut command = cargo_in(root);
    command
        .args([
            "nextest",
            "run",
            "--workspace",
            "--no-fail-fast",
            "--run-ignored",
            "all",
        ])
        .env(ENV_TEST_DOCKER, "1")
        .env(ENV_TEST_ROOT, "1");
    let (ok, output) = crate::conformance::run_teed(&mut command)?;
    let (passed, failed) = engines::counts(&output).unwrap_or((0, 1));
    row.parts.push(("suite".to_owned(), passed, failed));
    if !ok {
        bail!("`{}` failed", cmd::display(&command));
    }
    // The gates are open: a test that still skipped did not run what it is there for.
    match engines::skipped(&output) {
        Some(0) => Ok(()),
        Some(n) => bail!("{n} test(s) skipped although every gate is open"),
        None => bail!("nextest printed no closing line to count skipped tests from"),
    }
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
    // The other architecture's standard library, for `dist --arch all`.
    let target = "aarch64-unknown-linux-gnu";
    let installed = cmd::output(cmd::cmd("rustup").args(["target", "list", "--installed"]))?;
    if installed.lines().any(|line| line.trim() == target) {
        println!("tools: rust target {target} present");
    } else {
        cmd::run(cmd::cmd("rustup").args(["target", "add", target]))?;
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
