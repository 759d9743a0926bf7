//! `cargo xtask run`: the shim against the local Docker daemon (started if needed).

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
