//! Debian packages the dev environment needs.

use anyhow::{Context as _, Result, bail};

use crate::cmd;

/// Docker itself (Debian 12's daemon `dockerd` and client `docker`), and debootstrap, which makes
/// the root the main engine runs from.
pub const DOCKER: &[&str] = &["docker.io", "debootstrap"];

/// Everything `dev-env` needs: Docker, the static busybox of the test image, the registry and
/// `htpasswd` for its auth file, Python's venv for the dstack server package (and the zig
/// toolchain of `dist`), debootstrap for the older distribution the artifact is run in, and
/// what the fleet test's host needs for the server's SSH provisioning: sshd
/// (`openssh-server`; the test starts its own on a loopback port, the package's service is not
/// started here), `sudo` and `curl` (the provisioning runs `sudo curl ...`); and what runs the
/// arm64 release artifact on an amd64 machine (`tests/tests/dist.rs`): qemu-user as one static
/// binary and the arm64 glibc of Debian's cross toolchain as its sysroot (`qemu.rs` registers
/// it with `binfmt_misc`).
pub const ALL: &[&str] = &[
    "docker.io",
    "busybox-static",
    "docker-registry",
    "apache2-utils",
    "python3-venv",
    "openssh-server",
    "sudo",
    "curl",
    "debootstrap",
    "qemu-user-static",
    "libc6-arm64-cross",
];

/// Wait for the dpkg lock (a fresh VM may be running unattended upgrades) instead of failing.
const APT_LOCK_WAIT: [&str; 2] = ["-o", "DPkg::Lock::Timeout=300"];

/// Whether the Debian package `name` is installed (`dpkg-query` status `install ok installed`).
pub fn installed(name: &str) -> bool {
    cmd::output(cmd::cmd("dpkg-query").args(["-W", "-f", "${Status}", name]))
        .is_ok_and(|status| status.trim() == "install ok installed")
}

/// The packages of `names` that are not installed.
pub fn missing(names: &[&str]) -> Vec<String> {
    names
        .iter()
        .filter(|name| !installed(name))
        .map(|name| (*name).to_owned())
        .collect()
}

/// Installs the packages of `names` that are missing; `apt-get update` runs only if one is.
pub fn ensure(names: &[&str]) -> Result<()> {
    let missing = missing(names);
    if missing.is_empty() {
        println!("packages: all installed ({})", names.join(", "));
        return Ok(());
    }
    if !cmd::have_program("apt-get") {
        bail!(
            "packages {} are missing and there is no apt-get: dev-env supports Debian 12; \
             install them by hand",
            missing.join(", ")
        );
    }
    println!("packages: installing {}", missing.join(", "));
    cmd::run(
        cmd::cmd("apt-get")
            .args(APT_LOCK_WAIT)
            .arg("update")
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .context(
        "apt-get update failed (dev-env must run as root, with the Debian mirrors reachable)",
    )?;
    cmd::run(
        cmd::cmd("apt-get")
            .args(APT_LOCK_WAIT)
            .args(["install", "-y"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
    .with_context(|| format!("could not install {}", missing.join(", ")))?;
    let still = self::missing(names);
    if !still.is_empty() {
        bail!(
            "apt-get succeeded but {} still not installed",
            still.join(", ")
        );
    }
    Ok(())
}
