//! Host facts: CPUs, memory, disk size, IPv4 addresses, GPUs; and `host_info.json`.

use fs_err::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, io_err};
use crate::gpu::HostGpus;

/// The name of the host info file in the shim's home.
pub const HOST_INFO_FILE: &str = "host_info.json";

/// What the host has, as written to `host_info.json` (the fields dstack's Go shim writes, which
/// the server reads on SSH fleets).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    /// `nvidia`, `amd`, `intel`, `tenstorrent` or `none`.
    pub gpu_vendor: String,
    /// The first GPU's name; empty without GPUs.
    pub gpu_name: String,
    /// The first GPU's memory in MiB; 0 without GPUs.
    pub gpu_memory: u64,
    /// How many GPUs.
    pub gpu_count: usize,
    /// Non-loopback IPv4 addresses with prefix length, e.g. `10.0.0.5/24`.
    pub addresses: Vec<String>,
    /// Bytes available on the disk holding the measured path (Docker's root dir).
    pub disk_size: u64,
    /// Online CPUs.
    pub cpus: usize,
    /// Total memory in bytes.
    pub memory: u64,
}

/// Online CPUs (at least 1).
pub fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// Total memory in bytes, from `/proc/meminfo`.
pub fn total_memory() -> Result<u64> {
    let path = Path::new("/proc/meminfo");
    let text = fs_err::read_to_string(path).map_err(io_err("read", path))?;
    parse_meminfo_total(&text).ok_or_else(|| Error::Parse {
        tool: "/proc/meminfo",
        why: "no MemTotal line".to_owned(),
    })
}

/// `MemTotal: N kB` → bytes.
pub fn parse_meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Bytes available to unprivileged users on the file system holding `path` (what dstack's Go
/// shim reports as disk size: `f_bavail * f_bsize`).
pub fn disk_size(path: &Path) -> Result<u64> {
    let st = nix::sys::statvfs::statvfs(path).map_err(|source| Error::Sys {
        action: "statvfs",
        path: path.to_owned(),
        source,
    })?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
}

/// Non-loopback IPv4 addresses with their prefix length (`ip -4 -o addr show`).
pub async fn ipv4_addresses(runner: &dyn crate::cmd::CommandRunner) -> Result<Vec<String>> {
    let args = ["-4", "-o", "addr", "show"];
    let out = runner.run("ip", &args).await?.check("ip", &args)?;
    Ok(parse_ip_addr(&out.stdout))
}

/// Parses `ip -4 -o addr show`: `2: eth0    inet 10.0.0.5/24 brd … scope global eth0 …`.
pub fn parse_ip_addr(out: &str) -> Vec<String> {
    let mut addrs = Vec::new();
    for line in out.lines() {
        let mut it = line.split_whitespace();
        while let Some(tok) = it.next() {
            if tok == "inet" {
                if let Some(cidr) = it.next() {
                    let ip = cidr.split('/').next().unwrap_or(cidr);
                    let loopback = ip
                        .parse::<std::net::Ipv4Addr>()
                        .map_or(true, |a| a.is_loopback());
                    if !loopback && !addrs.iter().any(|a| a == cidr) {
                        addrs.push(cidr.to_owned());
                    }
                }
                break;
            }
        }
    }
    addrs
}

/// Collects the host's facts. `disk_path` is Docker's root dir (or any path on the disk that
/// matters); GPUs come from an earlier detection.
pub async fn collect(
    runner: &dyn crate::cmd::CommandRunner,
    disk_path: &Path,
    gpus: &HostGpus,
) -> Result<HostInfo> {
    let first = gpus.gpus.first();
    Ok(HostInfo {
        gpu_vendor: gpus
            .vendor
            .map_or_else(|| "none".to_owned(), |v| v.as_str().to_owned()),
        gpu_name: first.map(|g| g.name.clone()).unwrap_or_default(),
        gpu_memory: first.map_or(0, |g| g.memory_mib),
        gpu_count: gpus.gpus.len(),
        addresses: ipv4_addresses(runner).await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot list IPv4 addresses");
            Vec::new()
        }),
        disk_size: disk_size(disk_path)?,
        cpus: cpu_count(),
        memory: total_memory()?,
    })
}

/// Writes `info` to `<dir>/host_info.json` unless that file exists (the first write wins).
/// Atomic: temp file in `dir`, fsync, rename, fsync of `dir`. Returns the path and whether it
/// was written.
pub fn write_host_info_once(dir: &Path, info: &HostInfo) -> Result<(PathBuf, bool)> {
    let path = dir.join(HOST_INFO_FILE);
    match fs_err::symlink_metadata(&path) {
        Ok(_) => return Ok((path, false)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("stat", &path, e)),
    }
    let data = serde_json::to_vec(info).map_err(|source| Error::Json {
        what: "host info",
        source,
    })?;
    let tmp = dir.join(format!(".{HOST_INFO_FILE}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = fs_err::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(io_err("create", &tmp))?;
        std::io::Write::write_all(&mut f, &data).map_err(io_err("write", &tmp))?;
        f.sync_all().map_err(io_err("fsync", &tmp))?;
        drop(f);
        // A link that fails if the file appeared meanwhile keeps "first write wins".
        match fs_err::hard_link(&tmp, &path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
            Err(e) => return Err(Error::io("link", &path, e)),
        }
        fs_err::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("fsync", dir))?;
        Ok(true)
    })();
    let _ = fs_err::remove_file(&tmp);
    Ok((path, result?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::{
        CommandOutput, CommandRunner as _, ScriptedCommandRunner, SystemCommandRunner,
    };

    #[test]
    fn parses_meminfo_and_ip() {
        assert_eq!(
            parse_meminfo_total("MemTotal:       16314012 kB\nMemFree: 1 kB\n"),
            Some(16_314_012 * 1024)
        );
        assert_eq!(parse_meminfo_total("MemFree: 1 kB\n"), None);
        let ip = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n\
                  2: eth0    inet 10.0.0.5/24 brd 10.0.0.255 scope global eth0\\ valid\n\
                  3: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\n";
        assert_eq!(parse_ip_addr(ip), vec!["10.0.0.5/24", "172.17.0.1/16"]);
    }

    #[tokio::test]
    async fn collects_real_host_facts() {
        let runner = SystemCommandRunner::default();
        let info = collect(&runner, Path::new("/"), &HostGpus::fake_nvidia(2))
            .await
            .unwrap();
        assert!(info.cpus >= 1);
        assert!(info.memory > 64 * 1024 * 1024, "{info:?}");
        assert!(info.disk_size > 0, "{info:?}");
        assert_eq!(info.gpu_vendor, "nvidia");
        assert_eq!(info.gpu_count, 2);
        assert!(
            info.addresses.iter().all(|a| !a.starts_with("127.")),
            "{info:?}"
        );
        // The same as the real tool says (this machine has at least one interface address).
        let out = runner
            .run("ip", &["-4", "-o", "addr", "show"])
            .await
            .unwrap();
        assert_eq!(info.addresses, parse_ip_addr(&out.stdout));
    }

    #[tokio::test]
    async fn host_info_is_written_once_atomically() {
        let tmp = tempfile::tempdir().unwrap();
        let runner = ScriptedCommandRunner::new();
        runner.always("ip", CommandOutput::ok("2: eth0 inet 10.1.2.3/16 brd x\n"));
        let info = collect(&runner, tmp.path(), &HostGpus::none())
            .await
            .unwrap();
        assert_eq!(info.gpu_vendor, "none");
        assert_eq!(info.addresses, vec!["10.1.2.3/16"]);
        let (path, written) = write_host_info_once(tmp.path(), &info).unwrap();
        assert!(written);
        let v: serde_json::Value =
            serde_json::from_str(&fs_err::read_to_string(&path).unwrap()).unwrap();
        for k in [
            "gpu_vendor",
            "gpu_name",
            "gpu_memory",
            "gpu_count",
            "addresses",
            "disk_size",
            "cpus",
            "memory",
        ] {
            assert!(v.get(k).is_some(), "{k} missing in {v}");
        }
        let mut other = info.clone();
        other.cpus += 1;
        let (_, again) = write_host_info_once(tmp.path(), &other).unwrap();
        assert!(!again);
        let back: HostInfo = serde_json::from_str(&fs_err::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back, info);
        // No temp file left behind.
        let names: Vec<_> = fs_err::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(HOST_INFO_FILE)]);
    }
}
