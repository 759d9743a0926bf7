//! `cargo xtask dist [--upstream-version V] [--arch amd64|arm64|all] [--out DIR]`: the release
//! artifact the dstack server installs with `curl` (SPEC §9). Per architecture, one stripped
//! file that needs glibc 2.17 or newer, its debug info in a separate file, and a checksum:
//!
//! ```text
//! <out>/<V>/dstack-shim-linux-<amd64|arm64>          stripped, .gnu_debuglink -> the .debug
//! <out>/<V>/dstack-shim-linux-<amd64|arm64>.debug    its DWARF (objcopy --only-keep-debug)
//! <out>/<V>/dstack-shim-linux-<amd64|arm64>.sha256   `sha256sum -c` format
//! ```
//!
//! The glibc floor comes from linking with zig through `cargo-zigbuild` (the target
//! `<triple>.2.17`, zig's glibc stubs of that version), as maturin builds manylinux2014 wheels;
//! both tools come from PyPI into a venv of pinned versions under
//! `/var/lib/dstack-shim-dev/venv-zig` (made once, under the dev-env lock). Why not a static
//! glibc build, and the figures: `docs/OPERATIONS.md` ("Release artifacts").

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use shim_e2e::harness::artifact::{self, Arch};

use crate::cmd;
use crate::paths::state_dir;

/// cargo-zigbuild from PyPI (a wheel with the prebuilt binary).
const ZIGBUILD_VERSION: &str = "0.24.1";
/// zig from PyPI (`ziglang`, the toolchain in a wheel): the version this was tried with (zig
/// changes its command line between minor versions; 0.16 and 0.17 were not tried).
const ZIG_VERSION: &str = "0.15.2";
/// The oldest glibc the artifact may need (`<triple>.2.17`: CentOS 7, manylinux2014).
const GLIBC_FLOOR: &str = "2.17";

/// What `cargo xtask dist` builds.
#[derive(Debug, Clone)]
pub struct Options {
    /// The dstack release the binary speaks for (`N.N.N`).
    pub upstream_version: String,
    /// The architectures to build.
    pub arches: Vec<Arch>,
    /// The directory the `<V>/` directory goes into.
    pub out: PathBuf,
}

impl Options {
    /// The default: the release in `bins/shim/upstream-version`, this machine's architecture,
    /// [`shim_e2e::dist_dir`].
    pub fn for_release(release: &str) -> Self {
        Self {
            upstream_version: release.to_owned(),
            arches: vec![Arch::host()],
            out: shim_e2e::dist_dir(),
        }
    }

    /// Parses `[--upstream-version V] [--arch amd64|arm64|all] [--out DIR]`.
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut options = Self::for_release(shim_e2e::DSTACK_VERSION);
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((flag, value)) => (flag, Some(value.to_owned())),
                None => (arg.as_str(), None),
            };
            let mut value = || -> Result<String> {
                match inline.clone().or_else(|| args.next().cloned()) {
                    Some(value) => Ok(value),
                    None => bail!("{flag} needs a value"),
                }
            };
            match flag {
                "--upstream-version" => options.upstream_version = value()?,
                "--arch" => {
                    options.arches = match value()?.as_str() {
                        "all" => vec![Arch::Amd64, Arch::Arm64],
                        one => vec![Arch::parse(one).with_context(|| {
                            format!("--arch {one}: expected amd64, arm64 or all")
                        })?],
                    }
                }
                "--out" => options.out = PathBuf::from(value()?),
                other => bail!(
                    "unexpected argument `{other}` (allowed: --upstream-version V, --arch \
                     amd64|arm64|all, --out DIR)"
                ),
            }
        }
        if !artifact::is_release(&options.upstream_version) {
            bail!(
                "--upstream-version {:?}: expected a dstack release such as 0.22.5 (three \
                 numbers)",
                options.upstream_version
            );
        }
        Ok(options)
    }
}

/// Builds and lays out the artifacts of `options`, checks each, and prints where they are and
/// the server's `DSTACK_SHIM_DOWNLOAD_URL` template.
pub fn dist(options: &Options) -> Result<()> {
    for &arch in &options.arches {
        if !have_std(arch) {
            bail!(
                "the Rust standard library for {} is not installed: `rustup target add {}`",
                arch.triple(),
                arch.triple()
            );
        }
    }
    let zig = ensure_zig()?;
    let release = &options.upstream_version;
    let dir = options.out.join(release);
    fs_err::create_dir_all(&dir)?;
    let dir = std::path::absolute(&dir)?;
    for &arch in &options.arches {
        let started = Instant::now();
        let built = build(&zig, arch, release)?;
        let built_in = started.elapsed().as_secs_f64();
        let artifact = dir.join(arch.file_name());
        lay_out(&built, &artifact, arch)?;
        let report = check(&artifact, arch, release)?;
        println!(
            "dist: {} ({:.1} MiB; debug info {:.1} MiB; built in {built_in:.0} s; {report})",
            artifact.display(),
            mib(&artifact)?,
            mib(&artifact::debug_file(&artifact))?,
        );
    }
    println!(
        "\ndist: serve {} over HTTP(S) and set on the dstack server (release {release}):\n  \
         DSTACK_SHIM_DOWNLOAD_URL='https://<host serving {}>/{{version}}/dstack-shim-linux-{{arch}}'",
        options.out.display(),
        options.out.display(),
    );
    Ok(())
}

/// The zig toolchain: cargo-zigbuild and zig itself.
struct Zig {
    cargo_zigbuild: PathBuf,
    zig: PathBuf,
}

/// Makes (once) the venv with the pinned cargo-zigbuild and ziglang from PyPI.
fn ensure_zig() -> Result<Zig> {
    let venv = state_dir().join("venv-zig");
    let python = venv.join("bin/python");
    let probe = format!(
        "import importlib.metadata as m, sys; \
         sys.exit(m.version('cargo-zigbuild') != '{ZIGBUILD_VERSION}' \
         or m.version('ziglang') != '{ZIG_VERSION}')"
    );
    let ready = || python.exists() && cmd::succeeds(cmd::cmd(&python).args(["-c", &probe]));
    if !ready() {
        // Under the dev-env lock: two checkouts may run `dist` at once.
        let _lock = crate::devenv::lock()?;
        if !ready() {
            if venv.exists() {
                println!("dist: {} is out of date; making it again", venv.display());
                fs_err::remove_dir_all(&venv)?;
            }
            cmd::run(cmd::cmd("python3").args(["-m", "venv"]).arg(&venv)).context(
                "could not make a Python venv (Debian: python3-venv, which `cargo xtask \
                 dev-env` installs)",
            )?;
            cmd::run(cmd::cmd(venv.join("bin/pip")).args([
                "install",
                "--quiet",
                "--disable-pip-version-check",
                &format!("cargo-zigbuild=={ZIGBUILD_VERSION}"),
                &format!("ziglang=={ZIG_VERSION}"),
            ]))?;
            if !ready() {
                bail!(
                    "{} lacks cargo-zigbuild {ZIGBUILD_VERSION} or ziglang {ZIG_VERSION} \
                     after pip install",
                    venv.display()
                );
            }
        }
    }
    let zig = cmd::output(cmd::cmd(&python).args([
        "-c",
        "import pathlib, ziglang; print(pathlib.Path(ziglang.__file__).with_name('zig'))",
    ]))?;
    Ok(Zig {
        cargo_zigbuild: venv.join("bin/cargo-zigbuild"),
        zig: PathBuf::from(zig.trim()),
    })
}

/// `cargo zigbuild --release` of `dstack-shim` for `arch` at the glibc floor, speaking for
/// `release`; returns the linked (unstripped) binary.
fn build(zig: &Zig, arch: Arch, release: &str) -> Result<PathBuf> {
    let root = shim_e2e::repo_root();
    let target = format!("{}.{GLIBC_FLOOR}", arch.triple());
    cmd::run(
        cmd::cmd(&zig.cargo_zigbuild)
            .current_dir(&root)
            .args(["zigbuild", "--release", "--locked", "-p", "dstack-shim"])
            .args(["--target", &target])
            .env("CARGO", shim_e2e::harness::cargo())
            .env("CARGO_ZIGBUILD_ZIG_PATH", &zig.zig)
            .env("DSTACK_SHIM_UPSTREAM_VERSION", release),
    )
    .with_context(|| format!("building dstack-shim for {target}"))?;
    let binary = shim_e2e::harness::target_dir()
        .join(arch.triple())
        .join("release")
        .join("dstack-shim");
    if !binary.is_file() {
        bail!("the build did not leave {}", binary.display());
    }
    Ok(binary)
}

/// Splits `built` into the stripped `artifact` (with a `.gnu_debuglink` to its debug file)
/// and its debug file, then writes the checksum. Each file is written beside its final name and
/// renamed into place, the checksum last, so a server fetching from the directory meanwhile
/// never gets a half-written file, and a checksum always describes the file beside it.
fn lay_out(built: &Path, artifact: &Path, arch: Arch) -> Result<()> {
    let debug = artifact::debug_file(artifact);
    let sha = artifact::sha256_file(artifact);
    let partial = |path: &Path| {
        let mut name = path.as_os_str().to_owned();
        name.push(".partial");
        PathBuf::from(name)
    };
    let objcopy = objcopy(arch)?;
    cmd::run(
        cmd::cmd(&objcopy)
            .arg("--only-keep-debug")
            .arg(built)
            .arg(partial(&debug)),
    )?;
    // Data, not a program (objcopy keeps the input's mode).
    fs_err::set_permissions(partial(&debug), std::fs::Permissions::from_mode(0o644))?;
    fs_err::rename(partial(&debug), &debug)?;
    // --add-gnu-debuglink takes the debug file's name (and its CRC) as found; gdb looks for it
    // beside the binary or under /usr/lib/debug.
    cmd::run(
        cmd::cmd(&objcopy)
            .current_dir(debug.parent().unwrap_or(Path::new(".")))
            .arg("--strip-all")
            .arg(format!(
                "--add-gnu-debuglink={}",
                debug.file_name().unwrap_or_default().to_string_lossy()
            ))
            .arg(built)
            .arg(partial(artifact)),
    )?;
    fs_err::rename(partial(artifact), artifact)?;
    let line = artifact::sha256_line(artifact)?;
    fs_err::write(partial(&sha), line)?;
    fs_err::rename(partial(&sha), &sha)?;
    Ok(())
}

/// GNU objcopy for `arch`'s ELF files: the system's for this machine's architecture, the cross
/// binutils' for the other (Debian's `objcopy` reads only its own architecture; zig's
/// `objcopy` cannot split these files: "unimplemented"), installed if missing.
fn objcopy(arch: Arch) -> Result<PathBuf> {
    let (program, package) = if arch == Arch::host() {
        ("objcopy".to_owned(), "binutils".to_owned())
    } else {
        let prefix = gnu_triple(arch);
        (
            format!("{prefix}-objcopy"),
            format!("binutils-{}", prefix.replace('_', "-")),
        )
    };
    if !cmd::have_program(&program) {
        let _lock = crate::devenv::lock()?;
        crate::packages::ensure(&[&package])?;
    }
    let objcopy = cmd::find_program(&program);
    if !cmd::succeeds(cmd::cmd(&objcopy).arg("--version")) {
        bail!("{program} (Debian: {package}) is needed to split the debug info off");
    }
    Ok(objcopy)
}

/// The GNU triple of `arch`'s Debian cross tools (`aarch64-linux-gnu`, `x86_64-linux-gnu`).
fn gnu_triple(arch: Arch) -> &'static str {
    match arch {
        Arch::Amd64 => "x86_64-linux-gnu",
        Arch::Arm64 => "aarch64-linux-gnu",
    }
}

/// How to run a binary of `arch` here: itself on this architecture, under qemu-user with the
/// cross libc as its sysroot for the other one ([`crate::qemu::command`]; `None` if that is not
/// installed).
fn runner(arch: Arch, binary: &Path) -> Option<std::process::Command> {
    crate::qemu::command(arch, binary)
}

/// Whether rustup has the standard library of `arch`'s target.
fn have_std(arch: Arch) -> bool {
    cmd::output(cmd::cmd("rustc").args(["--print", "sysroot"])).is_ok_and(|sysroot| {
        Path::new(sysroot.trim())
            .join("lib/rustlib")
            .join(arch.triple())
            .join("lib")
            .is_dir()
    })
}

/// Checks the laid-out artifact as CI does (`tests/tests/dist.rs`); returns a summary.
fn check(artifact: &Path, arch: Arch, release: &str) -> Result<String> {
    let glibc = match artifact::highest_glibc(artifact)? {
        Some(highest) if artifact::compare_versions(&highest, GLIBC_FLOOR).is_gt() => bail!(
            "{} needs GLIBC_{highest}, above {GLIBC_FLOOR}",
            artifact.display()
        ),
        Some(highest) => format!("needs GLIBC_{highest} at most"),
        None => "needs no glibc symbol version".to_owned(),
    };
    let unstripped = artifact::unstripped_sections(artifact)?;
    if !unstripped.is_empty() {
        bail!(
            "{} is not stripped: {}",
            artifact.display(),
            unstripped.join(", ")
        );
    }
    artifact::verify_sha256(artifact)?;
    let debug = artifact::debug_file(artifact);
    let name = debug.file_name().map(|n| n.to_string_lossy().into_owned());
    if artifact::debuglink(artifact)? != name {
        bail!(
            "{} has no .gnu_debuglink to {}",
            artifact.display(),
            debug.display()
        );
    }
    let version = if let Some(mut command) = runner(arch, artifact) {
        let printed = cmd::output(command.arg("--version"))?;
        let wanted = artifact::version_line(release);
        if printed.trim() != wanted {
            bail!(
                "{} --version printed {printed:?}, not {wanted:?}",
                artifact.display()
            );
        }
        let how = if arch == Arch::host() {
            ""
        } else {
            " (under qemu)"
        };
        format!("`--version`{how}: {wanted}")
    } else {
        "`--version` not run (another architecture; no qemu-user and cross libc here)".to_owned()
    };
    Ok(format!("{glibc}; stripped; checksum ok; {version}"))
}

fn mib(path: &Path) -> Result<f64> {
    let bytes = fs_err::metadata(path)?.len();
    #[allow(clippy::cast_precision_loss, reason = "a size for people to read")]
    Ok(bytes as f64 / (1024.0 * 1024.0))
}
