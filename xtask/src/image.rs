//! The test images, built offline with `docker import` from a busybox root.
//!
//! Root file system: the static busybox of Debian's `busybox-static` as `/bin/busybox` with a
//! symlink for every applet at its usual path (`busybox --install -s` style: `/bin/sh`,
//! `/usr/bin/httpd`, ...), a stub `/usr/sbin/sshd` (the shim's container command only checks
//! that sshd exists), `/tmp` (1777), `/root`, `/etc/passwd` and `/etc/group` with root, and an
//! empty `/usr/local/bin` for the runner's bind mount.

use std::io::Read as _;
use std::os::unix::fs::{PermissionsExt as _, symlink};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context as _, Result, bail};
use sha2::{Digest as _, Sha256};
use tempfile::TempDir;

use crate::cmd;

/// Image label holding the hash of the root file system an image was built from.
pub const HASH_LABEL: &str = "dev.dstack-shim.fixture-hash";

/// Bump to force a rebuild when the way images are built changes without changing the files.
const FORMAT: &str = "shim-test-image/1";

/// Where Debian's `busybox-static` installs the static busybox.
const BUSYBOX: &str = "/bin/busybox";

const SSHD_STUB: &str = "#!/bin/sh
# Stub sshd of the dstack-shim test image. The shim's container command only makes sure that
# sshd exists (so it does not try to install it); the stub runner never starts it.
echo \"stub sshd: $*\"
exit 0
";

const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
";

const GROUP: &str = "root:x:0:
nogroup:x:65534:
";

/// A root file system in a temporary directory and the hash of its content.
pub struct Rootfs {
    dir: TempDir,
    /// Hex SHA-256 over every path, type, mode and content (see [`hash_tree`]).
    pub hash: String,
}

impl Rootfs {
    /// The root directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Builds the busybox root file system of the test images in a new directory under `parent`.
pub fn build_rootfs(parent: &Path) -> Result<Rootfs> {
    fs_err::create_dir_all(parent)?;
    let dir = tempfile::Builder::new()
        .prefix("rootfs-")
        .tempdir_in(parent)
        .with_context(|| {
            format!(
                "could not create a temporary directory in {}",
                parent.display()
            )
        })?;
    let root = dir.path();
    set_mode(root, 0o755)?;

    for (path, mode) in [
        ("bin", 0o755),
        ("sbin", 0o755),
        ("usr", 0o755),
        ("usr/bin", 0o755),
        ("usr/sbin", 0o755),
        ("usr/local", 0o755),
        ("usr/local/bin", 0o755),
        ("etc", 0o755),
        ("root", 0o700),
        ("tmp", 0o1777),
        ("var", 0o755),
        ("var/run", 0o755),
    ] {
        let path = root.join(path);
        fs_err::create_dir_all(&path)?;
        set_mode(&path, mode)?;
    }

    if !Path::new(BUSYBOX).is_file() {
        bail!("{BUSYBOX} is missing (package busybox-static)");
    }
    fs_err::copy(BUSYBOX, root.join("bin/busybox"))?;
    set_mode(&root.join("bin/busybox"), 0o755)?;
    let applets = cmd::output(cmd::cmd(BUSYBOX).arg("--list-full"))?;
    for applet in applets.lines().map(str::trim).filter(|a| !a.is_empty()) {
        let relative = applet.trim_start_matches('/');
        if relative.contains("..") || relative == "bin/busybox" {
            continue;
        }
        let link = root.join(relative);
        if let Some(dir) = link.parent() {
            fs_err::create_dir_all(dir)?;
        }
        symlink("/bin/busybox", &link)
            .with_context(|| format!("could not create the symlink {}", link.display()))?;
    }

    write(root, "usr/sbin/sshd", SSHD_STUB, 0o755)?;
    write(root, "etc/passwd", PASSWD, 0o644)?;
    write(root, "etc/group", GROUP, 0o644)?;

    let hash = hash_tree(root)?;
    Ok(Rootfs { dir, hash })
}

/// Adds the large image's payload: `payload.bin`, `bytes` bytes from `/dev/urandom`
/// (incompressible, so the pushed layer is as large as the file).
pub fn add_random_payload(root: &Path, bytes: u64) -> Result<()> {
    let path = root.join("payload.bin");
    let mut out = fs_err::File::create(&path)?;
    let mut random = fs_err::File::open("/dev/urandom")?.take(bytes);
    let copied = std::io::copy(&mut random, &mut out)
        .with_context(|| format!("could not write {}", path.display()))?;
    if copied != bytes {
        bail!("/dev/urandom gave {copied} bytes, wanted {bytes}");
    }
    Ok(())
}

fn write(root: &Path, relative: &str, content: &str, mode: u32) -> Result<()> {
    let path = root.join(relative);
    fs_err::write(&path, content)?;
    set_mode(&path, mode)
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    fs_err::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Hex SHA-256 over [`FORMAT`] and, for every entry under `root` in sorted order, its relative
/// path, type, permission bits and content (file bytes or symlink target).
pub fn hash_tree(root: &Path) -> Result<String> {
    let mut hasher = Sha256::new();
    field(&mut hasher, FORMAT.as_bytes());
    let mut stack: Vec<PathBuf> = vec![root.to_path_buf()];
    let mut entries: Vec<PathBuf> = Vec::new();
    while let Some(dir) = stack.pop() {
        for entry in fs_err::read_dir(&dir)? {
            let path = entry?.path();
            if fs_err::symlink_metadata(&path)?.is_dir() {
                stack.push(path.clone());
            }
            entries.push(path);
        }
    }
    entries.sort();
    for path in entries {
        let relative = path.strip_prefix(root).unwrap_or(&path);
        field(&mut hasher, relative.as_os_str().as_encoded_bytes());
        let meta = fs_err::symlink_metadata(&path)?;
        field(
            &mut hasher,
            &(meta.permissions().mode() & 0o7777).to_le_bytes(),
        );
        if meta.file_type().is_symlink() {
            field(&mut hasher, b"link");
            let target = fs_err::read_link(&path)?;
            field(&mut hasher, target.as_os_str().as_encoded_bytes());
        } else if meta.is_dir() {
            field(&mut hasher, b"dir");
        } else {
            field(&mut hasher, b"file");
            field(&mut hasher, &fs_err::read(&path)?);
        }
    }
    Ok(hex(&hasher.finalize()))
}

fn field(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_le_bytes());
    hasher.update(bytes);
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The value of [`HASH_LABEL`] on the local image `reference`: `None` if the image does not
/// exist, `Some("")` if it has no such label.
pub fn local_hash(reference: &str) -> Option<String> {
    let format = format!("{{{{index .Config.Labels \"{HASH_LABEL}\"}}}}");
    cmd::output(cmd::cmd("docker").args(["image", "inspect", "--format", &format, reference]))
        .ok()
        .map(|label| label.trim().replace("<no value>", ""))
}

/// Whether the local daemon has an image `reference`.
pub fn exists_locally(reference: &str) -> bool {
    cmd::succeeds(cmd::cmd("docker").args(["image", "inspect", reference]))
}

/// Imports the directory `root` as the single-layer image `reference` (tar piped into
/// `docker import`), labelled with `hash` and with `/bin/sh` as its command.
pub fn import(root: &Path, reference: &str, hash: &str) -> Result<()> {
    let mut tar = cmd::cmd("tar");
    tar.args(["--numeric-owner", "--owner=0", "--group=0", "-C"])
        .arg(root)
        .args(["-cf", "-", "."])
        .stdout(Stdio::piped());
    let tar_line = cmd::display(&tar);
    let mut tar_child = tar
        .spawn()
        .with_context(|| format!("could not start `{tar_line}`"))?;
    let Some(tar_out) = tar_child.stdout.take() else {
        bail!("`{tar_line}` has no stdout");
    };
    let mut import = cmd::cmd("docker");
    import
        .args(["import", "--change"])
        .arg(format!("LABEL {HASH_LABEL}={hash}"))
        .args(["--change", "CMD [\"/bin/sh\"]"])
        .args([
            "--message",
            "dstack-shim test fixture (cargo xtask dev-env)",
        ])
        .args(["-", reference])
        .stdin(Stdio::from(tar_out));
    let import_result = cmd::run(&mut import);
    let tar_status = tar_child
        .wait()
        .with_context(|| format!("could not wait for `{tar_line}`"))?;
    if !tar_status.success() {
        bail!("`{tar_line}` failed: {tar_status}");
    }
    import_result.with_context(|| format!("could not import the image {reference}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs_err::create_dir_all(dir.path().join("a/b")).unwrap();
        fs_err::write(dir.path().join("a/b/file"), "content").unwrap();
        symlink("/bin/busybox", dir.path().join("a/sh")).unwrap();
        dir
    }

    #[test]
    fn hash_is_stable_and_sees_content_mode_and_links() {
        let dir = tree();
        let root = dir.path();
        let first = hash_tree(root).unwrap();
        assert_eq!(first.len(), 64);
        assert_eq!(hash_tree(root).unwrap(), first);
        assert_eq!(
            hash_tree(tree().path()).unwrap(),
            first,
            "same tree elsewhere"
        );

        fs_err::write(root.join("a/b/file"), "other").unwrap();
        let content_changed = hash_tree(root).unwrap();
        assert_ne!(content_changed, first);

        set_mode(&root.join("a/b/file"), 0o700).unwrap();
        let mode_changed = hash_tree(root).unwrap();
        assert_ne!(mode_changed, content_changed);

        fs_err::remove_file(root.join("a/sh")).unwrap();
        symlink("/bin/other", root.join("a/sh")).unwrap();
        assert_ne!(hash_tree(root).unwrap(), mode_changed);
    }

    #[test]
    #[ignore = "needs Docker and the dev-env fixtures: SHIM_TEST_DOCKER=1, run with --run-ignored all"]
    fn rootfs_has_what_the_runner_and_the_shim_need() {
        shim_e2e::require_docker();
        assert!(
            Path::new(BUSYBOX).is_file(),
            "{BUSYBOX} missing: run `cargo xtask dev-env`"
        );
        let parent = tempfile::tempdir().unwrap();
        let rootfs = build_rootfs(parent.path()).unwrap();
        let root = rootfs.path();
        for applet in [
            "bin/sh",
            "bin/sleep",
            "bin/cat",
            "bin/mkdir",
            "usr/sbin/httpd",
            "bin/kill",
        ] {
            let link = fs_err::read_link(root.join(applet)).unwrap();
            assert_eq!(link, Path::new("/bin/busybox"), "{applet}");
        }
        let sshd = fs_err::metadata(root.join("usr/sbin/sshd")).unwrap();
        assert_eq!(sshd.permissions().mode() & 0o777, 0o755);
        let tmp = fs_err::metadata(root.join("tmp")).unwrap();
        assert_eq!(tmp.permissions().mode() & 0o7777, 0o1777);
        let passwd = fs_err::read_to_string(root.join("etc/passwd")).unwrap();
        assert!(passwd.starts_with("root:x:0:0:"));
        assert_eq!(rootfs.hash, hash_tree(root).unwrap());
    }
}
