//! Host facts as dstack's Go shim computes them (runner/internal/shim/host/host.go,
//! runner/internal/shim/host_info.go), and `host_info.json`.
//!
//! - CPUs: the CPUs this process may run on (`sched_getaffinity`, Go's `runtime.NumCPU`);
//! - memory: `MemTotal` of `/proc/meminfo` in bytes (gopsutil's `VirtualMemory().Total`);
//! - disk size: `f_bavail * f_bsize` of `statfs(2)` on the path the caller passes, which is
//!   Docker's `DockerRootDir` (upstream's `GetDiskSize(dockerInfo.DockerRootDir)`);
//! - addresses: every address of every interface that is not a loopback address, IPv4 and
//!   IPv6, in CIDR notation (`10.0.0.5/24`, `fe80::1/64`), in interface order (Go's
//!   `net.Interfaces()` then `iface.Addrs()`), read with `getifaddrs(3)`, no tool spawned.
//!
//! As upstream, a fact that cannot be read is 0 (or no addresses) and logged; the file is still
//! written.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shim_fs::{Dir, WriteOptions};

use crate::error::{ResourcesError, Result};
use crate::gpu::HostGpus;

/// The name of the host info file in the shim's home.
pub const HOST_INFO_FILE: &str = "host_info.json";

/// What the host has, as written to `host_info.json`: the fields, names and order of upstream's
/// `hostInfo` (runner/internal/shim/host_info.go), which the server reads on SSH fleets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostInfo {
    /// The first GPU's vendor: `nvidia`, `amd`, `intel`, `tenstorrent`; `none` without GPUs.
    pub gpu_vendor: String,
    /// The first GPU's name; empty without GPUs.
    pub gpu_name: String,
    /// The first GPU's memory in MiB; 0 without GPUs.
    pub gpu_memory: u64,
    /// How many GPUs.
    pub gpu_count: usize,
    /// Non-loopback interface addresses in CIDR notation, IPv4 and IPv6 (`10.0.0.5/24`,
    /// `fe80::1/64`). Upstream writes `null` for none; we write `[]` (the server reads it with
    /// a default of `[]` and iterates it).
    pub addresses: Vec<String>,
    /// Bytes available to unprivileged users on the file system of Docker's root dir.
    pub disk_size: u64,
    /// CPUs this process may run on.
    pub cpus: usize,
    /// Total memory in bytes.
    pub memory: u64,
}

/// The CPUs this process may run on (Go's `runtime.NumCPU`: the affinity mask), at least 1.
pub fn cpu_count() -> usize {
    let from_affinity = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))
        .ok()
        .map(|set| {
            (0..nix::sched::CpuSet::count())
                .filter(|&i| set.is_set(i).unwrap_or(false))
                .count()
        })
        .filter(|&n| n > 0);
    from_affinity.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    })
}

/// Total memory in bytes, from `/proc/meminfo`.
pub fn total_memory() -> Result<u64> {
    let path = Path::new("/proc/meminfo");
    let text =
        fs_err::read_to_string(path).map_err(|source| ResourcesError::io("read", path, source))?;
    parse_meminfo_total(&text).ok_or_else(|| ResourcesError::Parse {
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

/// Bytes available to unprivileged users on the file system holding `path`: `f_bavail *
/// f_bsize` of `statfs(2)`, exactly upstream's `GetDiskSize`.
pub fn disk_size(path: &Path) -> Result<u64> {
    fs_usage(path).map(|u| u.available)
}

/// How full a file system is, from `statfs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FsUsage {
    /// Its size in bytes.
    pub capacity: u64,
    /// Bytes an unprivileged writer can still use.
    pub available: u64,
}

impl FsUsage {
    /// A file system of `capacity` bytes with `available` still usable.
    pub fn new(capacity: u64, available: u64) -> Self {
        Self {
            capacity,
            available,
        }
    }

    /// Bytes in use, as kubelet counts them: capacity less what is available (blocks
    /// reserved for root count as used).
    pub fn used(&self) -> u64 {
        self.capacity.saturating_sub(self.available)
    }

    /// [`FsUsage::used`] as a percentage of the capacity (0 for an empty capacity).
    pub fn used_percent(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.used() as f64 * 100.0 / self.capacity as f64
        }
    }
}

/// How full the file system holding a path is, as something that can be injected: [`HostFs`]
/// asks the kernel; a test answers with the figures it wants (the engine's image collection
/// measures the container engine's data root through one).
pub trait FsProbe: Send + Sync + 'static {
    /// How full the file system holding `path` is. Blocking (a `statfs`).
    fn usage(&self, path: &Path) -> Result<FsUsage>;
}

/// The host's file systems: [`fs_usage`].
#[derive(Debug, Clone, Copy, Default)]
pub struct HostFs;

impl FsProbe for HostFs {
    fn usage(&self, path: &Path) -> Result<FsUsage> {
        fs_usage(path)
    }
}

/// How full the file system holding `path` is.
pub fn fs_usage(path: &Path) -> Result<FsUsage> {
    let st = nix::sys::statfs::statfs(path).map_err(|source| ResourcesError::Sys {
        action: "statfs",
        path: path.to_owned(),
        source,
    })?;
    #[allow(
        clippy::unnecessary_cast,
        reason = "the field types differ between platforms"
    )]
    let (blocks, avail, bsize) = (
        st.blocks() as u64,
        st.blocks_available() as u64,
        st.block_size() as u64,
    );
    Ok(FsUsage {
        capacity: blocks.saturating_mul(bsize),
        available: avail.saturating_mul(bsize),
    })
}

/// One address of an interface, as `getifaddrs` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceAddr {
    /// The interface name.
    pub interface: String,
    /// The address.
    pub ip: IpAddr,
    /// The prefix length of its netmask.
    pub prefix: u8,
}

/// `ip/prefix` as Go's `net.IPNet.String()` writes it, or `None` for a loopback address
/// (`127.0.0.0/8`, `::1`, and an IPv4-mapped loopback, which Go's `IsLoopback` also skips).
pub fn format_address(ip: IpAddr, prefix: u8) -> Option<String> {
    let loopback = match ip {
        IpAddr::V4(a) => a.is_loopback(),
        IpAddr::V6(a) => a.is_loopback() || a.to_ipv4_mapped().is_some_and(|m| m.is_loopback()),
    };
    if loopback {
        return None;
    }
    // Go prints an IPv4-mapped IPv6 address in dotted form.
    let shown = match ip {
        IpAddr::V6(a) => a
            .to_ipv4_mapped()
            .map_or_else(|| a.to_string(), |m| m.to_string()),
        IpAddr::V4(a) => a.to_string(),
    };
    Some(format!("{shown}/{prefix}"))
}

/// The addresses of `entries` (in `getifaddrs` order) grouped by interface, interfaces in the
/// order they first appear in `interfaces` (the link order), then formatted; loopback
/// addresses left out.
pub fn order_addresses(interfaces: &[String], entries: &[InterfaceAddr]) -> Vec<String> {
    let mut order: Vec<&str> = Vec::new();
    for name in interfaces
        .iter()
        .map(String::as_str)
        .chain(entries.iter().map(|e| e.interface.as_str()))
    {
        if !order.contains(&name) {
            order.push(name);
        }
    }
    let mut out = Vec::new();
    for name in order {
        for e in entries.iter().filter(|e| e.interface == name) {
            if let Some(a) = format_address(e.ip, e.prefix) {
                out.push(a);
            }
        }
    }
    out
}

fn prefix_len(mask: Option<IpAddr>) -> u8 {
    let ones = match mask {
        Some(IpAddr::V4(m)) => u32::from(m).count_ones(),
        Some(IpAddr::V6(m)) => u128::from(m).count_ones(),
        None => 0,
    };
    u8::try_from(ones).unwrap_or(0)
}

/// Every non-loopback address of every interface, IPv4 and IPv6, in CIDR notation (upstream's
/// `GetNetworkAddresses`), read with `getifaddrs(3)`.
pub fn network_addresses() -> Result<Vec<String>> {
    let list = nix::ifaddrs::getifaddrs().map_err(|source| ResourcesError::Sys {
        action: "getifaddrs",
        path: PathBuf::new(),
        source,
    })?;
    let mut links = Vec::new();
    let mut entries = Vec::new();
    for ifa in list {
        let Some(addr) = ifa.address else { continue };
        if addr.as_link_addr().is_some() {
            links.push(ifa.interface_name);
            continue;
        }
        let ip = if let Some(v4) = addr.as_sockaddr_in() {
            IpAddr::V4(v4.ip())
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            IpAddr::V6(v6.ip())
        } else {
            continue;
        };
        let mask = ifa.netmask.as_ref().and_then(|m| {
            m.as_sockaddr_in()
                .map(|a| IpAddr::V4(a.ip()))
                .or_else(|| m.as_sockaddr_in6().map(|a| IpAddr::V6(a.ip())))
        });
        entries.push(InterfaceAddr {
            interface: ifa.interface_name,
            ip,
            prefix: prefix_len(mask),
        });
    }
    Ok(order_addresses(&links, &entries))
}

/// Collects the host's facts like upstream's `Resources()`: `docker_root_dir` is Docker's
/// `DockerRootDir` (the disk size is measured there); GPUs come from an earlier detection.
/// Never fails: what cannot be read is 0 (or no addresses) and logged. Blocking (a few system
/// calls and `/proc/meminfo`).
pub fn collect(docker_root_dir: &Path, gpus: &HostGpus) -> HostInfo {
    let first = gpus.gpus.first();
    HostInfo {
        // Upstream takes the vendor from the first GPU: a vendor whose tool listed no GPU is
        // "none".
        gpu_vendor: first.map_or_else(|| "none".to_owned(), |g| g.vendor.as_str().to_owned()),
        gpu_name: first.map(|g| g.name.clone()).unwrap_or_default(),
        gpu_memory: first.map_or(0, |g| g.memory_mib),
        gpu_count: gpus.gpus.len(),
        addresses: network_addresses().unwrap_or_else(|e| {
            tracing::error!(error = %shim_util::error_chain(&e), "cannot list the network addresses");
            Vec::new()
        }),
        disk_size: disk_size(docker_root_dir).unwrap_or_else(|e| {
            tracing::error!(error = %shim_util::error_chain(&e), "cannot get the disk size");
            0
        }),
        cpus: cpu_count(),
        memory: total_memory().unwrap_or_else(|e| {
            tracing::error!(error = %shim_util::error_chain(&e), "cannot get the total memory");
            0
        }),
    }
}

/// Writes `info` to `<dir>/host_info.json` unless that file exists (the first write wins, as
/// upstream's `WriteHostInfo`). Atomic and durable (temp file in `dir`, fsync, link, fsync of
/// `dir`; mode 0644). Returns the path and whether it was written.
pub fn write_host_info_once(dir: &Path, info: &HostInfo) -> Result<(PathBuf, bool)> {
    let d = Dir::open(dir)?;
    let path = d.join(HOST_INFO_FILE);
    if d.stat(HOST_INFO_FILE)?.is_some() {
        return Ok((path, false));
    }
    let data = serde_json::to_vec(info).map_err(|source| ResourcesError::Json {
        what: "host info",
        source,
    })?;
    let written = d.create_new_atomic(HOST_INFO_FILE, &data, &WriteOptions::new(0o644))?;
    Ok((path, written))
}

/// [`collect`] then [`write_host_info_once`] into the shim's home.
pub fn write_host_info(
    home: &Path,
    docker_root_dir: &Path,
    gpus: &HostGpus,
) -> Result<(PathBuf, bool)> {
    write_host_info_once(home, &collect(docker_root_dir, gpus))
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    #[test]
    fn parses_meminfo() {
        assert_eq!(
            parse_meminfo_total("MemTotal:       16314012 kB\nMemFree: 1 kB\n"),
            Some(16_314_012 * 1024)
        );
        assert_eq!(parse_meminfo_total("MemFree: 1 kB\n"), None);
    }

    fn a(interface: &str, ip: IpAddr, prefix: u8) -> InterfaceAddr {
        InterfaceAddr {
            interface: interface.to_owned(),
            ip,
            prefix,
        }
    }

    #[test]
    fn addresses_are_go_ipnet_strings_grouped_by_interface() {
        // upstream: runner/internal/shim/host/host.go (GetNetworkAddresses): every
        // *net.IPNet of every interface, skipped only if IP.IsLoopback(), written with
        // IPNet.String() ("ip/prefixlen"; IPv6 in RFC 5952 form; IPv4-mapped as dotted).
        let v6 = |s: &str| IpAddr::V6(s.parse::<Ipv6Addr>().unwrap());
        let v4 = |s: &str| IpAddr::V4(s.parse::<Ipv4Addr>().unwrap());
        let links = ["lo", "eth0", "docker0"].map(String::from);
        // getifaddrs lists every IPv4 address before any IPv6 one.
        let entries = [
            a("lo", v4("127.0.0.1"), 8),
            a("eth0", v4("10.0.0.5"), 24),
            a("docker0", v4("172.17.0.1"), 16),
            a("lo", v6("::1"), 128),
            a("eth0", v6("2001:0db8:0000:0000:0000:0000:0000:0005"), 64),
            a("eth0", v6("fe80::a00:27ff:fe4e:66a1"), 64),
            a("docker0", v6("::ffff:192.168.1.9"), 120),
            a("lo", v4("127.0.0.2"), 8),
            a("lo", v6("::ffff:127.0.0.1"), 104),
            a("tun9", v4("10.8.0.1"), 32),
        ];
        assert_eq!(
            order_addresses(&links, &entries),
            vec![
                "10.0.0.5/24",
                "2001:db8::5/64",
                "fe80::a00:27ff:fe4e:66a1/64",
                "172.17.0.1/16",
                "192.168.1.9/120",
                "10.8.0.1/32",
            ]
        );
        assert_eq!(prefix_len(Some(v4("255.255.240.0"))), 20);
        assert_eq!(prefix_len(Some(v6("ffff:ffff:ffff:ffff::"))), 64);
    }

    #[test]
    fn real_addresses_match_what_ip_reports() {
        // The same addresses, in the same order, as `ip -o addr show` lists them on this
        // machine (which has at least one non-loopback interface).
        let ours = network_addresses().unwrap();
        let out = std::process::Command::new("ip")
            .args(["-o", "addr", "show"])
            .output()
            .expect("running ip");
        assert!(out.status.success());
        let mut theirs: Vec<(u32, bool, String)> = Vec::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut f = line.split_whitespace();
            let index: u32 = f.next().unwrap().trim_end_matches(':').parse().unwrap();
            let _name = f.next();
            let family = f.next().unwrap();
            let cidr = f.next().unwrap().to_owned();
            let ip: IpAddr = cidr.split('/').next().unwrap().parse().unwrap();
            if !ip.is_loopback() {
                theirs.push((index, family == "inet6", cidr));
            }
        }
        // ip lists by family first; Go (and we) by interface, IPv4 before IPv6.
        theirs.sort_by_key(|(i, v6, _)| (*i, *v6));
        let theirs: Vec<String> = theirs.into_iter().map(|(_, _, c)| c).collect();
        assert!(!ours.is_empty());
        assert_eq!(ours, theirs);
    }

    #[test]
    fn collects_real_host_facts() {
        let info = collect(Path::new("/"), &HostGpus::fake_nvidia(2));
        assert!(info.cpus >= 1);
        assert!(info.memory > 64 * 1024 * 1024, "{info:?}");
        assert!(info.disk_size > 0, "{info:?}");
        assert_eq!(
            (info.gpu_vendor.as_str(), info.gpu_count, info.gpu_memory),
            ("nvidia", 2, 16 * 1024)
        );
        assert!(info.addresses.iter().all(|a| !a.starts_with("127.")));
        // The disk size is statfs's f_bavail * f_bsize on the path given.
        let st = nix::sys::statfs::statfs("/").unwrap();
        #[allow(clippy::unnecessary_cast)]
        let expected = st.blocks_available() as u64 * st.block_size() as u64;
        let diff = info.disk_size.abs_diff(expected);
        assert!(diff < 64 << 20, "{} vs {expected}", info.disk_size);
    }

    #[test]
    fn unreadable_disk_is_zero_and_the_file_is_still_written() {
        let tmp = tempfile::tempdir().unwrap();
        let (path, written) = write_host_info(
            tmp.path(),
            &tmp.path().join("no-docker-here"),
            &HostGpus::none(),
        )
        .unwrap();
        assert!(written);
        let back: HostInfo = serde_json::from_str(&fs_err::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back.disk_size, 0);
        assert_eq!(back.gpu_vendor, "none");
        assert!(back.memory > 0);
    }

    #[test]
    fn vendor_without_gpus_is_none_as_upstream() {
        // upstream: runner/internal/shim/host_info.go (WriteHostInfo) takes the vendor from
        // gpus[0], "none" when the list is empty.
        let mut gpus = HostGpus::fake_nvidia(1);
        gpus.gpus.clear();
        assert_eq!(collect(Path::new("/"), &gpus).gpu_vendor, "none");
    }

    #[test]
    fn host_info_is_written_once_atomically_with_upstreams_fields() {
        let tmp = tempfile::tempdir().unwrap();
        let info = HostInfo {
            gpu_vendor: "nvidia".into(),
            gpu_name: "H100".into(),
            gpu_memory: 81559,
            gpu_count: 8,
            addresses: vec!["10.1.2.3/16".into(), "fe80::1/64".into()],
            disk_size: 1 << 40,
            cpus: 96,
            memory: 1 << 41,
        };
        let (path, written) = write_host_info_once(tmp.path(), &info).unwrap();
        assert!(written);
        let text = fs_err::read_to_string(&path).unwrap();
        // upstream: runner/internal/shim/host_info.go (hostInfo): these JSON names, in this
        // order, numbers as numbers.
        assert_eq!(
            text,
            r#"{"gpu_vendor":"nvidia","gpu_name":"H100","gpu_memory":81559,"gpu_count":8,"addresses":["10.1.2.3/16","fe80::1/64"],"disk_size":1099511627776,"cpus":96,"memory":2199023255552}"#
        );
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
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            fs_err::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
    }
}
