//! `cargo xtask run`: the shim against the local Docker daemon (started if needed).

use std::path::PathBuf;

use anyhow::{Context as _, Result};

use shim_e2e::harness::cargo;

use crate::{cmd, devenv};

/// Ensures Docker runs, then `cargo run -p dstack-shim --bin dstack-shim -- --shim-home
/// <repo>/target/shim-home ARGS..`.
pub fn run(args: &[String]) -> Result<()> {
    devenv::ensure_docker()?;
    let root = shim_e2e::repo_root();
    let home = root.join("target").join("shim-home");
    fs_err::create_dir_all(&home)?;
    cmd::run(
        cmd::cmd(cargo())
            .current_dir(&root)
            .args(["run", "-p", "dstack-shim", "--bin", "dstack-shim", "--"])
            .arg("--shim-home")
            .arg(&home)
            .args(args),
    )
    .context("the shim failed")
}

/// Builds `dstack-shim` (`release` or debug), saying so first, and returns the binary's path.
pub fn build_shim(release: bool) -> Result<PathBuf> {
    let profile = if release { " --release" } else { "" };
    println!("$ cargo build -p dstack-shim --bin dstack-shim{profile}");
    // Bounded only against a hang: a cold release build on a busy 2-core machine takes long.
    shim_e2e::harness::build_shim(release, std::time::Duration::from_secs(3600))
        .context("could not build dstack-shim")
}
