//! Pure parsers of the tools' outputs: `blkid -p -o export`, `lsblk -J`, and the mount table
//! (`/proc/self/mountinfo`).

use std::os::unix::ffi::OsStringExt as _;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{ResourcesError, Result};

/// What `blkid -p` found on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No signature at all (exit code 2).
    Blank,
    /// A file system of this type.
    Filesystem(String),
    /// A signature that is not a file system (partition table, RAID member, crypto).
    Other(String),
}

/// Parses `blkid -p -o export <dev>` output with its exit code.
pub fn parse_blkid(code: Option<i32>, stdout: &str) -> Option<Probe> {
    match code {
        Some(2) => Some(Probe::Blank),
        Some(0) => {
            let mut ty = None;
            let mut usage = None;
            let mut pttype = None;
            let mut part_scheme = None;
            for line in stdout.lines() {
                if let Some((k, v)) = line.split_once('=') {
                    match k.trim() {
                        "TYPE" => ty = Some(v.trim().to_owned()),
                        "USAGE" => usage = Some(v.trim().to_owned()),
                        "PTTYPE" => pttype = Some(v.trim().to_owned()),
                        "PART_ENTRY_SCHEME" => part_scheme = Some(v.trim().to_owned()),
                        _ => {}
                    }
                }
            }
            Some(match (ty.filter(|t| !t.is_empty()), usage.as_deref()) {
                (Some(t), None | Some("filesystem")) => Probe::Filesystem(t),
                (Some(t), Some(u)) => Probe::Other(format!("{t} ({u})")),
                // A partition is reported by its entry in the table even when it holds
                // nothing: never "blank" (upstream refuses it too).
                (None, _) => Probe::Other(match (pttype, part_scheme) {
                    (Some(p), _) => format!("partition table {p}"),
                    (None, Some(s)) => format!("a partition ({s}) without a file system"),
                    (None, None) => "unknown".to_owned(),
                }),
            })
        }
        _ => None,
    }
}

#[derive(Debug, Deserialize)]
struct Lsblk {
    blockdevices: Vec<LsblkDev>,
}

#[derive(Debug, Deserialize)]
struct LsblkDev {
    name: String,
    #[serde(default)]
    serial: Option<String>,
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    children: Vec<LsblkDev>,
}

impl LsblkDev {
    /// The first partition's name, or the device's own name when it has none.
    fn first_partition_or_self(&self) -> &str {
        self.children
            .iter()
            .find(|c| c.kind.as_deref() == Some("part"))
            .map_or(self.name.as_str(), |c| c.name.as_str())
    }
}

fn normalize_vol(id: &str) -> String {
    id.trim().replace('-', "").to_ascii_lowercase()
}

/// From `lsblk -J -o NAME,SERIAL,TYPE` output: the kernel name of the device (its first
/// partition if partitioned) whose serial is the AWS volume id without its dash (`vol0abc` for
/// `vol-0abc`), or whose name is `fallback_name` (e.g. `xvdf`) when no serial matches.
pub fn find_aws_device(
    lsblk_json: &str,
    volume_id: &str,
    fallbacks: &[String],
) -> Result<Option<String>> {
    let parsed: Lsblk = serde_json::from_str(lsblk_json).map_err(|e| ResourcesError::Parse {
        tool: "lsblk",
        why: e.to_string(),
    })?;
    let want = normalize_vol(volume_id);
    if !want.is_empty()
        && let Some(d) = parsed.blockdevices.iter().find(|d| {
            d.serial
                .as_deref()
                .is_some_and(|s| s.trim().starts_with("vol") && normalize_vol(s) == want)
        })
    {
        return Ok(Some(d.first_partition_or_self().to_owned()));
    }
    for name in fallbacks {
        if let Some(d) = parsed.blockdevices.iter().find(|d| &d.name == name) {
            return Ok(Some(d.first_partition_or_self().to_owned()));
        }
    }
    Ok(None)
}

/// The kernel names an AWS `device_name` may appear as: `/dev/sdf` → `sdf`, `xvdf`.
pub fn aws_fallback_names(device_name: &str) -> Vec<String> {
    let Some(rest) = device_name.strip_prefix("/dev/") else {
        return Vec::new();
    };
    if rest.is_empty() || rest.contains('/') || rest.contains("..") {
        return Vec::new();
    }
    let mut names = vec![rest.to_owned()];
    if let Some(letter) = rest.strip_prefix("sd") {
        names.push(format!("xvd{letter}"));
    }
    names
}

/// Whether `path` is a mount point according to a mountinfo table's content.
pub fn is_mount_point_in(mountinfo: &str, path: &Path) -> bool {
    mount_points(mountinfo).any(|mp| mp == path)
}

/// What is mounted at `path` (the topmost mount there, the table's last line for it): its
/// device number (`major:minor`, the table's third field) and its source (after the ` - `
/// separator and the type), octal escapes undone.
pub fn mount_at(mountinfo: &str, path: &Path) -> Option<((u64, u64), PathBuf)> {
    mountinfo.lines().rev().find_map(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        if unescape_mountinfo(fields.get(4)?) != path {
            return None;
        }
        let (major, minor) = fields.get(2)?.split_once(':')?;
        let number = (major.parse().ok()?, minor.parse().ok()?);
        let dash = fields.iter().position(|f| *f == "-")?;
        Some((number, unescape_mountinfo(fields.get(dash + 2)?)))
    })
}

/// The mount points of a mountinfo table's content (`/proc/<pid>/mountinfo`), in its order,
/// byte for byte: its octal escapes (`\040` for a space, …) undone, no UTF-8 required.
pub fn mount_points(mountinfo: &str) -> impl Iterator<Item = PathBuf> + '_ {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mountinfo)
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape_mountinfo(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && let Some(oct) = b.get(i + 1..i + 4)
            && oct.iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = oct
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}
