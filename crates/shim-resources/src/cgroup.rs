//! What a container uses, read from its control group's own files: CPU seconds, memory in use
//! and its peak, OOM kills.
//!
//! The cheapest source there is: a few small in-memory files per container, no stats stream
//! and no request to the engine (whose per-container stats endpoint samples for a second and
//! costs the daemon CPU). A container's cgroup is found once, from its main process
//! ([`Cgroups::locate`] reads `/proc/<pid>/cgroup`), whatever the engine's cgroup driver or
//! parent (cgroupfs or systemd, Docker or Podman); its files are then read at each scrape
//! ([`Cgroup::usage`]).
//!
//! Both hierarchies are read, because GPU hosts run both:
//!
//! | | cgroup v2 (unified) | cgroup v1 |
//! |---|---|---|
//! | CPU | `cpu.stat` `usage_usec` | `cpuacct.usage` (ns) |
//! | memory | `memory.current` | `memory.usage_in_bytes` |
//! | peak | `memory.peak` (Linux 5.19+) | `memory.max_usage_in_bytes` |
//! | OOM kills | `memory.events` `oom_kill` | `memory.oom_control` `oom_kill` (4.13+) |
//!
//! A hybrid host (v1 controllers beside an empty unified hierarchy) is read as v1.

use std::path::{Path, PathBuf};

use crate::error::{ResourcesError, Result};

/// Where the control groups and the processes are (`/sys/fs/cgroup` and `/proc` on a host;
/// a directory tree of the same shape in tests).
#[derive(Debug, Clone)]
pub struct Cgroups {
    root: PathBuf,
    proc: PathBuf,
}

impl Default for Cgroups {
    fn default() -> Self {
        Self::system()
    }
}

/// One container's control group, found by [`Cgroups::locate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cgroup {
    /// The unified hierarchy: one directory holds every controller's files.
    V2 {
        /// The group's directory.
        dir: PathBuf,
    },
    /// The legacy hierarchies: one directory per controller.
    V1 {
        /// The group's directory under the `cpuacct` controller.
        cpuacct: PathBuf,
        /// The group's directory under the `memory` controller.
        memory: PathBuf,
    },
}

/// What a control group used, as its files say at the moment of reading.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Usage {
    /// CPU time consumed, in seconds (user and system, every CPU).
    pub cpu_seconds: f64,
    /// Memory charged to the group now, in bytes (page cache included, as the kernel counts).
    pub memory_bytes: u64,
    /// The most memory charged to it at once, in bytes (`None`: the kernel does not keep it,
    /// cgroup v2 before Linux 5.19).
    pub memory_peak_bytes: Option<u64>,
    /// Processes of the group the kernel's OOM killer ended (`None`: the kernel does not
    /// count them, cgroup v1 before Linux 4.13).
    pub oom_kills: Option<u64>,
}

impl Cgroups {
    /// The host's: `/sys/fs/cgroup` and `/proc`.
    pub fn system() -> Self {
        Self::at("/sys/fs/cgroup", "/proc")
    }

    /// Control groups mounted under `root`, processes under `proc`.
    pub fn at(root: impl Into<PathBuf>, proc: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            proc: proc.into(),
        }
    }

    /// The control group of process `pid` (a container's main process): its v1 `cpuacct` and
    /// `memory` groups when the host mounts those controllers, else its unified group.
    pub fn locate(&self, pid: u32) -> Result<Cgroup> {
        self.locate_container(pid, "")
    }

    /// [`Cgroups::locate`] for the main process `pid` of container `container_id` (its full
    /// id): the group is cut after the path component that names the container
    /// (`docker-<id>.scope`, `/docker/<id>`, `libpod-<id>.scope`), so a process the
    /// container moved into a subgroup of its own (Docker in Docker moves every process of
    /// its container to `init/`) still reads the whole container. A path that names no
    /// container is kept as it is.
    pub fn locate_container(&self, pid: u32, container_id: &str) -> Result<Cgroup> {
        let file = self.proc.join(pid.to_string()).join("cgroup");
        let text = fs_err::read_to_string(&file).map_err(|source| ResourcesError::Io {
            action: "read",
            path: file.clone(),
            source,
        })?;
        self.parse(&text, container_id)
            .ok_or_else(|| ResourcesError::Parse {
                tool: "cgroup",
                why: format!(
                    "{}: no cgroup v1 cpuacct and memory groups, nor a v2 group under {}",
                    file.display(),
                    self.root.display()
                ),
            })
    }

    fn parse(&self, text: &str, container_id: &str) -> Option<Cgroup> {
        let (mut cpuacct, mut memory, mut unified) = (None, None, None);
        for line in text.lines() {
            // hierarchy-id:controller-list:path
            let mut fields = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(path)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            let Some(relative) = relative(path).map(|r| cut_after(r, container_id)) else {
                continue;
            };
            if controllers.is_empty() {
                unified = Some(relative);
                continue;
            }
            let listed: Vec<&str> = controllers.split(',').collect();
            for (name, slot) in [("cpuacct", &mut cpuacct), ("memory", &mut memory)] {
                if listed.contains(&name) {
                    *slot = self.v1_dir(name, controllers).map(|d| d.join(&relative));
                }
            }
        }
        if let (Some(cpuacct), Some(memory)) = (cpuacct, memory) {
            return Some(Cgroup::V1 { cpuacct, memory });
        }
        let unified = unified?;
        // The unified hierarchy mounted at the root (not a hybrid host's empty one).
        self.root
            .join("cgroup.controllers")
            .exists()
            .then(|| Cgroup::V2 {
                dir: self.root.join(unified),
            })
    }

    /// Where a v1 controller is mounted: `<root>/<name>` (a mount or the usual link to a
    /// joint one like `cpu,cpuacct`), else `<root>/<controller list>`.
    fn v1_dir(&self, name: &str, controllers: &str) -> Option<PathBuf> {
        [self.root.join(name), self.root.join(controllers)]
            .into_iter()
            .find(|d| d.is_dir())
    }
}

/// `path` up to its first component that contains `container_id` (all of it when none does,
/// or when the id is empty).
fn cut_after(path: PathBuf, container_id: &str) -> PathBuf {
    if container_id.is_empty() {
        return path;
    }
    let mut cut = PathBuf::new();
    for component in path.components() {
        cut.push(component);
        if component
            .as_os_str()
            .to_string_lossy()
            .contains(container_id)
        {
            return cut;
        }
    }
    path
}

/// The path of a cgroup line relative to its hierarchy's root, if it is one (`/` alone is
/// the root: a process there is not in a container's group).
fn relative(path: &str) -> Option<PathBuf> {
    let trimmed = path.trim().trim_start_matches('/');
    if trimmed.is_empty() || trimmed.split('/').any(|c| c == "..") {
        return None;
    }
    Some(PathBuf::from(trimmed))
}

impl Cgroup {
    /// Reads what the group used. Fails when the group is gone (its container ended) or a
    /// file cannot be read or understood.
    pub fn usage(&self) -> Result<Usage> {
        match self {
            Cgroup::V2 { dir } => Ok(Usage {
                cpu_seconds: keyed(&dir.join("cpu.stat"), "usage_usec")? as f64 / 1e6,
                memory_bytes: number(&dir.join("memory.current"))?,
                memory_peak_bytes: optional(number(&dir.join("memory.peak")))?,
                oom_kills: optional(keyed(&dir.join("memory.events"), "oom_kill"))?,
            }),
            Cgroup::V1 { cpuacct, memory } => Ok(Usage {
                cpu_seconds: number(&cpuacct.join("cpuacct.usage"))? as f64 / 1e9,
                memory_bytes: number(&memory.join("memory.usage_in_bytes"))?,
                memory_peak_bytes: optional(number(&memory.join("memory.max_usage_in_bytes")))?,
                oom_kills: optional(keyed(&memory.join("memory.oom_control"), "oom_kill"))?,
            }),
        }
    }

    /// The directory that holds the group's memory files.
    pub fn memory_dir(&self) -> &Path {
        match self {
            Cgroup::V2 { dir } => dir,
            Cgroup::V1 { memory, .. } => memory,
        }
    }
}

fn read(path: &Path) -> Result<String> {
    fs_err::read_to_string(path).map_err(|source| ResourcesError::Io {
        action: "read",
        path: path.to_owned(),
        source,
    })
}

fn parse_error(path: &Path, why: impl Into<String>) -> ResourcesError {
    ResourcesError::Parse {
        tool: "cgroup",
        why: format!("{}: {}", path.display(), why.into()),
    }
}

/// A file holding one number.
fn number(path: &Path) -> Result<u64> {
    let text = read(path)?;
    text.trim()
        .parse()
        .map_err(|e| parse_error(path, format!("{:?}: {e}", text.trim())))
}

/// The value of `key` in a flat keyed file (`key value` per line).
fn keyed(path: &Path, key: &str) -> Result<u64> {
    let text = read(path)?;
    let value = text
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .ok_or_else(|| parse_error(path, format!("no {key}")))?;
    value
        .trim()
        .parse()
        .map_err(|e| parse_error(path, format!("{key} {value:?}: {e}")))
}

/// A value the kernel may not keep: a missing file or key is `None`, any other failure is
/// one.
fn optional(read: Result<u64>) -> Result<Option<u64>> {
    match read {
        Ok(v) => Ok(Some(v)),
        Err(ResourcesError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Ok(None)
        }
        Err(ResourcesError::Parse { why, .. }) if why.ends_with("no oom_kill") => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        fs_err::create_dir_all(path.parent().unwrap()).unwrap();
        fs_err::write(path, text).unwrap();
    }

    const V1_LINES: &str = "12:pids:/docker/abc\n4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n";

    #[test]
    fn a_v1_host_reads_cpuacct_and_memory() {
        let dir = tempfile::tempdir().unwrap();
        let (root, proc) = (dir.path().join("cg"), dir.path().join("proc"));
        write(&proc.join("42/cgroup"), V1_LINES);
        // The joint cpu,cpuacct mount, as systemd lays it out (no `cpuacct` link here: the
        // controller list is the fallback).
        let cpu = root.join("cpu,cpuacct/docker/abc");
        let mem = root.join("memory/docker/abc");
        write(&cpu.join("cpuacct.usage"), "2500000000\n");
        write(&mem.join("memory.usage_in_bytes"), "1048576\n");
        write(&mem.join("memory.max_usage_in_bytes"), "4194304\n");
        write(
            &mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        );
        // A hybrid host's unified hierarchy holds no controllers: v1 wins.
        fs_err::create_dir_all(root.join("unified/docker/abc")).unwrap();
        let cgroups = Cgroups::at(&root, &proc);
        let cg = cgroups.locate(42).unwrap();
        assert_eq!(
            cg,
            Cgroup::V1 {
                cpuacct: cpu.clone(),
                memory: mem.clone()
            }
        );
        assert_eq!(
            cg.usage().unwrap(),
            Usage {
                cpu_seconds: 2.5,
                memory_bytes: 1 << 20,
                memory_peak_bytes: Some(4 << 20),
                oom_kills: Some(2),
            }
        );
        // An older kernel without the OOM kill count.
        write(
            &mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\n",
        );
        assert_eq!(cg.usage().unwrap().oom_kills, None);
    }

    /// A container whose processes moved to a subgroup of their own (Docker in Docker:
    /// `start-dockerd` moves all of them to `init/`) is read whole, from the group that names
    /// it; a path naming no container is kept.
    #[test]
    fn a_container_that_moved_its_process_to_a_subgroup_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (root, proc) = (dir.path().join("cg"), dir.path().join("proc"));
        write(&root.join("cgroup.controllers"), "cpu memory\n");
        let id = "0123abcd".repeat(8);
        let scope = format!("system.slice/docker-{id}.scope");
        write(&proc.join("7/cgroup"), &format!("0::/{scope}/init\n"));
        let cgroups = Cgroups::at(&root, &proc);
        let whole = Cgroup::V2 {
            dir: root.join(&scope),
        };
        assert_eq!(cgroups.locate_container(7, &id).unwrap(), whole);
        let init = Cgroup::V2 {
            dir: root.join(&scope).join("init"),
        };
        assert_eq!(cgroups.locate(7).unwrap(), init);
        assert_eq!(cgroups.locate_container(7, &"f".repeat(64)).unwrap(), init);
        write(&proc.join("8/cgroup"), &format!("0::/docker/{id}/init\n"));
        let cgroupfs = Cgroup::V2 {
            dir: root.join("docker").join(&id),
        };
        assert_eq!(cgroups.locate_container(8, &id).unwrap(), cgroupfs);
    }

    #[test]
    fn a_v2_host_reads_the_unified_group() {
        let dir = tempfile::tempdir().unwrap();
        let (root, proc) = (dir.path().join("cg"), dir.path().join("proc"));
        write(
            &proc.join("7/cgroup"),
            "0::/system.slice/docker-abc.scope\n",
        );
        write(&root.join("cgroup.controllers"), "cpu memory pids\n");
        let group = root.join("system.slice/docker-abc.scope");
        write(
            &group.join("cpu.stat"),
            "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n",
        );
        write(&group.join("memory.current"), "8192\n");
        write(
            &group.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n",
        );
        let cg = Cgroups::at(&root, &proc).locate(7).unwrap();
        assert_eq!(cg, Cgroup::V2 { dir: group.clone() });
        assert_eq!(
            cg.usage().unwrap(),
            Usage {
                cpu_seconds: 1.5,
                memory_bytes: 8192,
                // No memory.peak before Linux 5.19.
                memory_peak_bytes: None,
                oom_kills: Some(1),
            }
        );
        write(&group.join("memory.peak"), "16384\n");
        assert_eq!(cg.usage().unwrap().memory_peak_bytes, Some(16384));
    }

    #[test]
    fn what_cannot_be_located_or_read_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (root, proc) = (dir.path().join("cg"), dir.path().join("proc"));
        fs_err::create_dir_all(&root).unwrap();
        let cgroups = Cgroups::at(&root, &proc);
        // No such process.
        let e = cgroups.locate(1).unwrap_err().to_string();
        assert!(e.contains("proc/1/cgroup"), "{e}");
        // A process in the root group, and a path that climbs: not a container's group.
        write(&proc.join("2/cgroup"), "0::/\n");
        write(&proc.join("3/cgroup"), "0::/../x\n");
        write(&root.join("cgroup.controllers"), "memory\n");
        for pid in [2, 3] {
            assert!(cgroups.locate(pid).is_err(), "{pid}");
        }
        // A group that went away with its container.
        write(&proc.join("4/cgroup"), "0::/gone\n");
        let e = cgroups.locate(4).unwrap().usage().unwrap_err().to_string();
        assert!(e.contains("gone/cpu.stat"), "{e}");
        // Garbage in a file.
        write(&root.join("bad/cpu.stat"), "usage_usec lots\n");
        write(&proc.join("5/cgroup"), "0::/bad\n");
        let e = cgroups.locate(5).unwrap().usage().unwrap_err().to_string();
        assert!(e.contains("cannot parse"), "{e}");
    }
}
