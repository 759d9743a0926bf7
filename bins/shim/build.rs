//! Chooses the dstack release this build speaks for (SPEC §3, §9): `DSTACK_SHIM_UPSTREAM_VERSION`
//! when set (`cargo xtask dist --upstream-version V` sets it), else the release the tests run
//! against, kept once in `upstream-version` beside this file. The binary reads it as
//! `env!("DSTACK_SHIM_UPSTREAM_VERSION")`; its one version string is
//! `<release>+rust.<crate version>`.

// A build script talks to cargo through its standard streams.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::env;
use std::process::ExitCode;

fn main() -> ExitCode {
    println!("cargo:rerun-if-env-changed=DSTACK_SHIM_UPSTREAM_VERSION");
    println!("cargo:rerun-if-changed=upstream-version");
    let (version, origin) = match env::var("DSTACK_SHIM_UPSTREAM_VERSION") {
        Ok(v) if !v.is_empty() => (v, "DSTACK_SHIM_UPSTREAM_VERSION"),
        _ => match fs_err::read_to_string("upstream-version") {
            Ok(v) => (v.trim().to_owned(), "bins/shim/upstream-version"),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    if !is_release(&version) {
        eprintln!(
            "error: {origin} is {version:?}: expected a dstack release such as 0.22.5 \
             (digits and dots, three parts)"
        );
        return ExitCode::FAILURE;
    }
    println!("cargo:rustc-env=DSTACK_SHIM_UPSTREAM_VERSION={version}");
    ExitCode::SUCCESS
}

/// `N.N.N`: what dstack's server compares as a release (`packaging.version`); no local part
/// (this build adds `+rust.…`), no whitespace (`--version` prints three words).
fn is_release(v: &str) -> bool {
    let parts: Vec<&str> = v.split('.').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.len() <= 6 && p.bytes().all(|b| b.is_ascii_digit()))
}
