//! Guards the crate's defining absence: `shim-task` does no IO, has no async runtime and no
//! clock of its own. Fails if a dependency that brings one in, or a source line that uses one,
//! ever enters the crate.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

use std::path::Path;
use std::process::Command;

/// Crates that mean IO, async or a runtime: none may be a normal dependency of shim-task.
const FORBIDDEN_CRATES: &str = "tokio tokio-util bollard hyper hyper-util mio reqwest nix libc \
    fs-err async-trait futures-util tracing";

/// Source fragments that mean IO, processes, the environment or a clock.
const FORBIDDEN_SOURCE: &str = "std::fs fs:: std::net std::process process:: std::env env::var \
    std::thread thread:: SystemTime Instant::now tokio bollard hyper std::io io::";

#[test]
fn no_io_or_async_crate_is_a_normal_dependency() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_owned());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
    let out = Command::new(cargo)
        .args("tree --offline -e normal --prefix none --manifest-path".split(' '))
        .arg(&manifest)
        .args(["-p", "shim-task"])
        .output()
        .expect("run cargo tree");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cargo tree failed: {stderr}");
    let crates: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    // The listing is real: the crate itself and its known dependencies are in it.
    for expected in ["shim-task", "serde", "sha2", "thiserror"] {
        let listed = crates.contains(&expected);
        assert!(listed, "{expected} missing in:\n{stdout}");
    }
    for name in FORBIDDEN_CRATES.split_whitespace() {
        let forbidden = crates.contains(&name);
        assert!(!forbidden, "{name} is a dependency of shim-task:\n{stdout}");
    }
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in fs_err::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn sources_use_no_io_clock_or_runtime() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // The scan sees the crate: its core modules are there.
    for module in ["lib.rs", "machine/mod.rs", "restore.rs", "record.rs"] {
        let scanned = files.iter().any(|f| f.ends_with(module));
        assert!(scanned, "{module} not scanned");
    }
    let mut found = Vec::new();
    for file in &files {
        let text = fs_err::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            for pattern in FORBIDDEN_SOURCE.split_whitespace() {
                if line.contains(pattern) {
                    found.push(format!("{}:{}: {pattern}: {line}", file.display(), n + 1));
                }
            }
        }
    }
    assert!(found.is_empty(), "IO in shim-task:\n{}", found.join("\n"));
}
