//! The release artifact `cargo xtask dist` lays out (`<dist>/<release>/dstack-shim-linux-<arch>`
//! with `.debug` and `.sha256` beside it) and the checks CI makes of it: the highest glibc
//! symbol version it needs, that it is stripped, that its checksum file matches, and the
//! version line it prints. Shared by `xtask dist` (it checks what it built) and
//! `tests/tests/dist.rs`.
//!
//! ELF facts are read with binutils' `readelf` (present wherever a C toolchain is, and it reads
//! every architecture's ELF files), so no ELF parser is added to the workspace.

use std::cmp::Ordering;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest as _, Sha256};

/// An architecture of the artifact, named as upstream's files name it (Go's `GOARCH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// x86_64.
    Amd64,
    /// aarch64 (e.g. GH200 hosts).
    Arm64,
}

impl Arch {
    /// This machine's architecture (amd64 on anything but aarch64).
    pub fn host() -> Self {
        match std::env::consts::ARCH {
            "aarch64" => Self::Arm64,
            _ => Self::Amd64,
        }
    }

    /// `amd64` or `arm64`, as in `DSTACK_SHIM_DOWNLOAD_URL`'s `{arch}`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "amd64" => Some(Self::Amd64),
            "arm64" => Some(Self::Arm64),
            _ => None,
        }
    }

    /// Go's name: `amd64`, `arm64`.
    pub fn go_name(self) -> &'static str {
        match self {
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    /// Rust's target triple.
    pub fn triple(self) -> &'static str {
        match self {
            Self::Amd64 => "x86_64-unknown-linux-gnu",
            Self::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// The artifact's file name, upstream's: `dstack-shim-linux-<arch>`.
    pub fn file_name(self) -> String {
        format!("dstack-shim-linux-{}", self.go_name())
    }
}

/// The artifact of `release` for `arch` under `dist` (see [`crate::dist_dir`]).
pub fn artifact_path(dist: &Path, release: &str, arch: Arch) -> PathBuf {
    dist.join(release).join(arch.file_name())
}

/// The debug file beside `artifact`: `<artifact>.debug`.
pub fn debug_file(artifact: &Path) -> PathBuf {
    with_suffix(artifact, ".debug")
}

/// The checksum file beside `artifact`: `<artifact>.sha256`.
pub fn sha256_file(artifact: &Path) -> PathBuf {
    with_suffix(artifact, ".sha256")
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// What `dstack-shim --version` of a build for `release` prints:
/// `dstack-shim version <release>+rust.<crate version>` (SPEC §3).
pub fn version_line(release: &str) -> String {
    format!(
        "dstack-shim version {release}+rust.{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// Whether `v` is a dstack release as `bins/shim/build.rs` takes it: three numbers.
pub fn is_release(v: &str) -> bool {
    let parts: Vec<&str> = v.split('.').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.len() <= 6 && p.bytes().all(|b| b.is_ascii_digit()))
}

/// Compares dotted version numbers numerically (`2.17` < `2.2.5` is false: 17 > 2).
pub fn compare_versions(a: &str, b: &str) -> Ordering {
    let parse = |v: &str| -> Vec<u64> { v.split('.').map(|p| p.parse().unwrap_or(0)).collect() };
    parse(a).cmp(&parse(b))
}

fn readelf(args: &[&str], path: &Path) -> io::Result<String> {
    let out = Command::new("readelf")
        .args(args)
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot run readelf (Debian: binutils): {e}"),
            )
        })?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "readelf {} {} failed: {}: {}",
            args.join(" "),
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The `GLIBC_x.y[.z]` versions in `readelf --version-info` output's version needs.
pub fn glibc_versions_needed(readelf_version_info: &str) -> Vec<String> {
    let mut needs = false;
    let mut versions: Vec<String> = Vec::new();
    for line in readelf_version_info.lines() {
        if line.starts_with("Version needs section") {
            needs = true;
            continue;
        }
        if line.starts_with("Version ") || line.starts_with("Histogram") {
            needs = false;
        }
        if !needs {
            continue;
        }
        let mut words = line.split_whitespace();
        while let Some(word) = words.next() {
            if word == "Name:"
                && let Some(name) = words.next()
                && let Some(version) = name.strip_prefix("GLIBC_")
                && version.bytes().all(|b| b.is_ascii_digit() || b == b'.')
                && !versions.iter().any(|v| v == version)
            {
                versions.push(version.to_owned());
            }
        }
    }
    versions.sort_by(|a, b| compare_versions(a, b));
    versions
}

/// The highest `GLIBC_` symbol version `binary` needs, `None` if it needs none (static, or
/// linked against no glibc).
pub fn highest_glibc(binary: &Path) -> io::Result<Option<String>> {
    let info = readelf(&["--version-info", "--wide"], binary)?;
    Ok(glibc_versions_needed(&info).pop())
}

/// The section names in `readelf --section-headers --wide` output.
pub fn section_names(readelf_sections: &str) -> Vec<String> {
    readelf_sections
        .lines()
        .filter_map(|line| {
            let (_, rest) = line.trim_start().strip_prefix('[')?.split_once(']')?;
            let name = rest.split_whitespace().next()?;
            name.starts_with('.').then(|| name.to_owned())
        })
        .collect()
}

/// The section names of the ELF file at `path`.
pub fn sections(path: &Path) -> io::Result<Vec<String>> {
    Ok(section_names(&readelf(
        &["--section-headers", "--wide"],
        path,
    )?))
}

/// The sections that make `binary` not stripped: the symbol table, and DWARF (`.debug_*`),
/// except `.debug_gdb_scripts`, which is loaded with the program (rustc puts gdb's
/// pretty-printer list there, a few dozen bytes) and which `strip --strip-all` keeps.
pub fn unstripped_sections(binary: &Path) -> io::Result<Vec<String>> {
    Ok(sections(binary)?
        .into_iter()
        .filter(|name| {
            name == ".symtab" || (name.starts_with(".debug_") && name != ".debug_gdb_scripts")
        })
        .collect())
}

/// The file name in `binary`'s `.gnu_debuglink` section, if it has one.
pub fn debuglink(binary: &Path) -> io::Result<Option<String>> {
    if !sections(binary)?.iter().any(|s| s == ".gnu_debuglink") {
        return Ok(None);
    }
    let dump = readelf(&["--string-dump=.gnu_debuglink"], binary)?;
    // `  [     0]  dstack-shim-linux-amd64.debug`
    Ok(dump.lines().find_map(|line| {
        let (_, name) = line.trim_start().strip_prefix('[')?.split_once(']')?;
        Some(name.trim().to_owned())
    }))
}

/// The hex SHA-256 of `path`.
pub fn sha256_hex(path: &Path) -> io::Result<String> {
    let mut file = fs_err::File::open(path)?;
    let mut hasher = Sha256::new();
    io::copy(&mut file, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The checksum line of `artifact` as `sha256sum` writes it (`<hex>  <file name>\n`), so
/// `sha256sum -c` in its directory checks it.
pub fn sha256_line(artifact: &Path) -> io::Result<String> {
    let name = artifact
        .file_name()
        .ok_or_else(|| io::Error::other(format!("{} has no file name", artifact.display())))?;
    Ok(format!(
        "{}  {}\n",
        sha256_hex(artifact)?,
        name.to_string_lossy()
    ))
}

/// Checks that `<artifact>.sha256` holds exactly the checksum line of `artifact`.
pub fn verify_sha256(artifact: &Path) -> io::Result<()> {
    let path = sha256_file(artifact);
    let written = fs_err::read_to_string(&path)?;
    let wanted = sha256_line(artifact)?;
    if written != wanted {
        return Err(io::Error::other(format!(
            "{} holds {written:?}; the file beside it hashes to {wanted:?}",
            path.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Trimmed from `readelf --version-info --wide` of a dstack-shim linked at glibc 2.17.
    const VERSION_INFO: &str = "\
Version symbols section '.gnu.version' contains 3 entries:
 Addr: 0x0000000000000a10  Offset: 0x000a10  Link: 6 (.dynsym)
  000:   0 (*local*)       2 (GLIBC_2.2.5)   3 (GLIBC_2.34)

Version needs section '.gnu.version_r' contains 2 entries:
 Addr: 0x0000000000000b10  Offset: 0x000b10  Link: 7 (.dynstr)
  000000: Version: 1  File: libc.so.6  Cnt: 3
  0x0010:   Name: GLIBC_2.2.5  Flags: none  Version: 2
  0x0020:   Name: GLIBC_2.17  Flags: none  Version: 4
  0x0030:   Name: GLIBC_2.3.4  Flags: none  Version: 5
  0x0040: Version: 1  File: ld-linux-x86-64.so.2  Cnt: 1
  0x0050:   Name: GLIBC_2.3  Flags: none  Version: 3
";

    #[test]
    fn the_highest_glibc_need_is_compared_numerically_and_only_needs_count() {
        // GLIBC_2.34 appears only in the symbol version list, not among the needs.
        assert_eq!(
            glibc_versions_needed(VERSION_INFO),
            ["2.2.5", "2.3", "2.3.4", "2.17"]
        );
        assert!(compare_versions("2.17", "2.2.5").is_gt());
        assert!(compare_versions("2.34", "2.17").is_gt());
        assert!(compare_versions("2.17", "2.17").is_eq());
        assert!(glibc_versions_needed("There are no version information.\n").is_empty());
    }

    #[test]
    fn section_names_are_read_from_the_header_table() {
        let sections = "\
Section Headers:
  [Nr] Name              Type            Address          Off    Size   ES Flg Lk Inf Al
  [ 0]                   NULL            0000000000000000 000000 000000 00      0   0  0
  [13] .debug_gdb_scripts PROGBITS       00000000001c3c54 1c3c54 000022 01 AMS  0   0  1
  [28] .debug_info       PROGBITS        0000000000000000 00031c 14 00      0   0  1
  [29] .gnu_debuglink    PROGBITS        0000000000000000 b5ade0 000024 00      0   0  4
  [30] .symtab           SYMTAB          0000000000000000 b5ae08 000030 18     31   1  8
";
        assert_eq!(
            section_names(sections),
            [
                ".debug_gdb_scripts",
                ".debug_info",
                ".gnu_debuglink",
                ".symtab"
            ]
        );
    }

    #[test]
    fn releases_are_three_numbers() {
        assert!(is_release("0.22.5"));
        assert!(!is_release("0.22"));
        assert!(!is_release("0.22.5+rust.0.1.0"));
        assert!(!is_release("v0.22.5"));
        assert_eq!(
            version_line("0.22.4"),
            format!(
                "dstack-shim version 0.22.4+rust.{}",
                env!("CARGO_PKG_VERSION")
            )
        );
    }

    #[test]
    fn a_checksum_file_must_describe_the_file_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let artifact = dir.path().join("dstack-shim-linux-amd64");
        fs_err::write(&artifact, b"abc").unwrap();
        // sha256("abc"), as `sha256sum` prints it.
        let line = sha256_line(&artifact).unwrap();
        assert_eq!(
            line,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad  \
             dstack-shim-linux-amd64\n"
        );
        fs_err::write(sha256_file(&artifact), &line).unwrap();
        verify_sha256(&artifact).unwrap();
        fs_err::write(&artifact, b"abd").unwrap();
        let err = verify_sha256(&artifact).unwrap_err();
        assert!(err.to_string().contains("hashes to"), "{err}");
    }

    #[test]
    fn the_real_readelf_reads_a_system_binary() {
        // Any dynamically linked program of the build machine needs some GLIBC_ version and
        // has a section table: this pins the parsing against the installed readelf.
        let ls = Path::new("/bin/ls");
        let highest = highest_glibc(ls).unwrap();
        assert!(highest.is_some(), "/bin/ls needs no GLIBC_ version?");
        let sections = section_names(&readelf(&["--section-headers", "--wide"], ls).unwrap());
        assert!(sections.iter().any(|s| s == ".text"), "{sections:?}");
    }
}
