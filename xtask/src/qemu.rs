//! Running the release artifact of the other architecture on this machine (the arm64 one of
//! `cargo xtask dist --arch arm64` on an amd64 machine), as CI does to run it, not only build
//! it (`tests/tests/dist.rs`):
//!
//! - Debian's `qemu-user-static` (`qemu-aarch64-static`, one static binary) and the other
//!   architecture's glibc from Debian's cross toolchain (`libc6-arm64-cross`, under
//!   `/usr/aarch64-linux-gnu`), which qemu takes as its sysroot (`-L` or `QEMU_LD_PREFIX`);
//! - the kernel's `binfmt_misc` entry `qemu-aarch64`, so that the artifact also runs when it
//!   is executed as it is: the shim runs `<its own binary> --version` for its components list,
//!   and the dstack server reads that. There is no systemd here to register it
//!   (`systemd-binfmt`), so this does what systemd-binfmt does: mounts `binfmt_misc` if it is
//!   not mounted, and writes the line the package ships for systemd
//!   (`/usr/lib/binfmt.d/qemu-aarch64.conf`, flags `F`: the interpreter is opened once, at
//!   registration, so the entry works in chroots and mount namespaces too) to its `register`
//!   file; a disabled entry is enabled;
//! - `/etc/qemu-binfmt/aarch64` → `/usr/aarch64-linux-gnu`: where Debian's qemu looks for the
//!   sysroot when neither `-L` nor `QEMU_LD_PREFIX` is given (so a plain
//!   `./dstack-shim-linux-arm64 --version` works). An existing one is left as it is.
//!
//! Idempotent (a rerun reads four files); call [`ensure`] under the dev-env lock, as root. The
//! registration is the kernel's, not the file system's: a reboot drops it and the next
//! `dev-env` makes it again.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use shim_e2e::harness::artifact::Arch;

use crate::{cmd, packages};

/// Where the kernel's `binfmt_misc` file system is mounted.
const BINFMT_DIR: &str = "/proc/sys/fs/binfmt_misc";
/// Where Debian's qemu-user-static looks for a sysroot by default (`--interp-prefix`).
const QEMU_SYSROOT_LINKS: &str = "/etc/qemu-binfmt";

/// The architecture this machine runs under emulation: the other one of the two the artifact
/// is built for.
pub fn foreign() -> Arch {
    match Arch::host() {
        Arch::Amd64 => Arch::Arm64,
        Arch::Arm64 => Arch::Amd64,
    }
}

/// qemu's name of `arch`'s CPU (`aarch64`, `x86_64`), as in `qemu-<cpu>-static`.
fn cpu(arch: Arch) -> &'static str {
    match arch {
        Arch::Amd64 => "x86_64",
        Arch::Arm64 => "aarch64",
    }
}

/// The Debian packages that run `arch`'s artifact here.
pub fn packages_for(arch: Arch) -> [&'static str; 2] {
    match arch {
        Arch::Amd64 => ["qemu-user-static", "libc6-amd64-cross"],
        Arch::Arm64 => ["qemu-user-static", "libc6-arm64-cross"],
    }
}

/// `qemu-<cpu>-static`.
pub fn qemu(arch: Arch) -> PathBuf {
    cmd::find_program(&format!("qemu-{}-static", cpu(arch)))
}

/// The cross glibc's root (`/usr/aarch64-linux-gnu`), qemu's sysroot.
pub fn sysroot(arch: Arch) -> PathBuf {
    Path::new("/usr").join(format!("{}-linux-gnu", cpu(arch)))
}

/// The program loader the artifact names (`PT_INTERP`), inside [`sysroot`].
fn loader(arch: Arch) -> PathBuf {
    sysroot(arch).join("lib").join(match arch {
        Arch::Amd64 => "ld-linux-x86-64.so.2",
        Arch::Arm64 => "ld-linux-aarch64.so.1",
    })
}

/// The `binfmt_misc` entry's name (`qemu-aarch64`), the package's.
fn entry_name(arch: Arch) -> String {
    format!("qemu-{}", cpu(arch))
}

/// The line the package ships for systemd-binfmt, which is what `register` takes.
fn registration_file(arch: Arch) -> PathBuf {
    Path::new("/usr/lib/binfmt.d").join(format!("{}.conf", entry_name(arch)))
}

/// The command that runs `binary` of `arch` here: itself for this machine's architecture,
/// else under qemu with the cross glibc as its sysroot; `None` when that is not installed.
pub fn command(arch: Arch, binary: &Path) -> Option<Command> {
    if arch == Arch::host() {
        return Some(cmd::cmd(binary));
    }
    let qemu = qemu(arch);
    if !qemu.is_absolute() || !loader(arch).is_file() {
        return None;
    }
    let mut command = cmd::cmd(qemu);
    command.arg("-L").arg(sysroot(arch)).arg(binary);
    Some(command)
}

/// The state of a `binfmt_misc` entry, from the first line of its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Missing,
    Enabled,
    Disabled,
}

fn entry(arch: Arch) -> Result<Entry> {
    let path = Path::new(BINFMT_DIR).join(entry_name(arch));
    match fs_err::read_to_string(&path) {
        Ok(text) => Ok(parse_entry(&text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Entry::Missing),
        Err(e) => Err(e.into()),
    }
}

fn parse_entry(text: &str) -> Entry {
    match text.lines().next().map(str::trim) {
        Some("enabled") => Entry::Enabled,
        _ => Entry::Disabled,
    }
}

/// The registration line of a binfmt.d file: its first line that is not empty or a comment.
fn registration_line(text: &str) -> Option<&str> {
    text.lines()
        .map(str::trim)
        .find(|line| !line.is_empty() && !line.starts_with('#') && !line.starts_with(';'))
}

fn binfmt_mounted() -> bool {
    Path::new(BINFMT_DIR).join("register").exists()
}

/// Whether [`ensure`]'s registration is in place, and what that is, for `dev-env --check`
/// (the packages are in [`packages::ALL`] on an amd64 machine).
pub fn status() -> (bool, String) {
    let arch = foreign();
    (
        binfmt_mounted() && entry(arch).is_ok_and(|e| e == Entry::Enabled),
        format!(
            "binfmt_misc entry {} enabled ({} artifacts run here)",
            entry_name(arch),
            arch.go_name()
        ),
    )
}

/// Installs and registers what runs [`foreign`] artifacts here (see the module's
/// documentation). Call under the dev-env lock, as root.
pub fn ensure() -> Result<()> {
    let arch = foreign();
    packages::ensure(&packages_for(arch))?;
    let qemu = qemu(arch);
    if !qemu.is_absolute() {
        bail!(
            "{} is missing after installing qemu-user-static",
            qemu.display()
        );
    }
    if !loader(arch).is_file() {
        bail!(
            "{} is missing after installing the cross libc",
            loader(arch).display()
        );
    }

    if !binfmt_mounted() {
        println!("qemu: mounting binfmt_misc on {BINFMT_DIR}");
        cmd::run(cmd::cmd("mount").args(["-t", "binfmt_misc", "binfmt_misc", BINFMT_DIR]))
            .context("cannot mount binfmt_misc (a container without privileges cannot)")?;
    }
    let name = entry_name(arch);
    match entry(arch)? {
        Entry::Enabled => println!("qemu: binfmt_misc entry {name} is enabled"),
        Entry::Disabled => {
            println!("qemu: enabling the binfmt_misc entry {name}");
            fs_err::write(Path::new(BINFMT_DIR).join(&name), "1")?;
        }
        Entry::Missing => {
            let file = registration_file(arch);
            let text = fs_err::read_to_string(&file)?;
            let line = registration_line(&text)
                .with_context(|| format!("{} holds no registration line", file.display()))?;
            println!(
                "qemu: registering the binfmt_misc entry {name} from {}",
                file.display()
            );
            fs_err::write(Path::new(BINFMT_DIR).join("register"), line)
                .with_context(|| format!("registering {name} with binfmt_misc"))?;
        }
    }
    if entry(arch)? != Entry::Enabled {
        bail!("the binfmt_misc entry {name} is not enabled after registering it");
    }

    let link = Path::new(QEMU_SYSROOT_LINKS).join(cpu(arch));
    if fs_err::symlink_metadata(&link).is_err() {
        fs_err::create_dir_all(QEMU_SYSROOT_LINKS)?;
        std::os::unix::fs::symlink(sysroot(arch), &link)
            .with_context(|| format!("could not create the symlink {}", link.display()))?;
        println!(
            "qemu: {} -> {} (qemu's default sysroot)",
            link.display(),
            sysroot(arch).display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_and_registration_lines_are_read_as_the_kernel_and_systemd_write_them() {
        let enabled = "enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\n\
                       flags: POCF\noffset 0\nmagic 7f454c46\n";
        assert_eq!(parse_entry(enabled), Entry::Enabled);
        assert_eq!(parse_entry("disabled\ninterpreter x\n"), Entry::Disabled);
        let conf = "# comment\n\n:qemu-aarch64:M::\\x7f\\x45:\\xff\\xff:/usr/libexec/qemu-binfmt/aarch64-binfmt-P:OPF\n";
        assert_eq!(
            registration_line(conf),
            Some(
                ":qemu-aarch64:M::\\x7f\\x45:\\xff\\xff:/usr/libexec/qemu-binfmt/aarch64-binfmt-P:OPF"
            )
        );
        assert_eq!(registration_line("# only a comment\n"), None);
    }

    #[test]
    fn the_other_architecture_has_its_names() {
        assert_ne!(foreign(), Arch::host());
        assert_eq!(entry_name(Arch::Arm64), "qemu-aarch64");
        assert_eq!(sysroot(Arch::Arm64), Path::new("/usr/aarch64-linux-gnu"));
        assert_eq!(
            registration_file(Arch::Arm64),
            Path::new("/usr/lib/binfmt.d/qemu-aarch64.conf")
        );
        assert_eq!(
            packages_for(Arch::Arm64),
            ["qemu-user-static", "libc6-arm64-cross"]
        );
    }
}
