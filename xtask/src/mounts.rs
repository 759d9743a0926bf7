//! The mount table of this process's mount namespace (`/proc/self/mountinfo`).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt as _;
use std::path::PathBuf;

use anyhow::Result;

/// Every mount point, in the table's order.
pub fn mount_points() -> Result<Vec<PathBuf>> {
    Ok(fs_err::read_to_string("/proc/self/mountinfo")?
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape)
        .collect())
}

/// A mount point as the table writes it (space, tab, newline and backslash as `\ooo`) turned
/// back into a path, byte for byte.
fn unescape(field: &str) -> PathBuf {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| {
            bytes[i] == b'\\'
                && (b'0'..=b'3').contains(&d[0])
                && d.iter().all(|d| (b'0'..=b'7').contains(d))
        });
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_are_undone_byte_for_byte() {
        assert_eq!(unescape(r"/tmp/a\040b"), PathBuf::from("/tmp/a b"));
        assert_eq!(unescape("/proc"), PathBuf::from("/proc"));
        assert_eq!(unescape(r"/x\134y"), PathBuf::from(r"/x\y"));
        assert_eq!(unescape(r"/x\011y\012"), PathBuf::from("/x\ty\n"));
        // Not an escape: kept as written.
        assert_eq!(unescape(r"/x\09"), PathBuf::from(r"/x\09"));
        assert_eq!(unescape(r"/x\"), PathBuf::from(r"/x\"));
    }

    #[test]
    fn the_root_is_mounted() {
        assert!(mount_points().unwrap().contains(&PathBuf::from("/")));
    }
}
