//! The crate's error type: every variant says which path, device, user or command it concerns.
//! Its `Display` describes its own level only; the cause is its `source()` (print the whole
//! with [`shim_util::error_chain`]).

use std::path::PathBuf;
use std::time::Duration;

/// Result with this crate's [`ResourcesError`].
pub type Result<T, E = ResourcesError> = std::result::Result<T, E>;

/// How [`ResourcesError::NotEnoughGpus`] names the free GPUs kept out as unhealthy.
fn unhealthy_suffix(unhealthy: &[String]) -> String {
    if unhealthy.is_empty() {
        String::new()
    } else {
        format!(
            " ({} kept out as unhealthy: {})",
            unhealthy.len(),
            unhealthy.join(", ")
        )
    }
}

/// What went wrong with a host resource.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResourcesError {
    /// A file system operation failed.
    #[error("{action} {}", path.display())]
    Io {
        /// What was being done (`read`, `rename`, …).
        action: &'static str,
        /// The path concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The user name is not acceptable: empty, `.`, `..`, or containing `/`, NUL or a line
    /// break.
    #[error("invalid user name {user:?}")]
    InvalidUser {
        /// The rejected name.
        user: String,
    },
    /// SSH keys were given for the host without a host user.
    #[error("{keys} SSH key(s) given for the host but no host user")]
    MissingUser {
        /// How many keys.
        keys: usize,
    },
    /// The user does not exist in the passwd database.
    #[error("user {user:?} does not exist")]
    UnknownUser {
        /// The user looked up.
        user: String,
    },
    /// The user's home directory does not exist (yet: a network home not mounted).
    #[error("the home {} of user {user:?} does not exist", home.display())]
    HomeMissing {
        /// The user.
        user: String,
        /// The home the passwd database names.
        home: std::path::PathBuf,
    },
    /// The passwd lookup itself failed.
    #[error("cannot look up user {user:?}")]
    UserLookup {
        /// The user looked up.
        user: String,
        /// The underlying error.
        #[source]
        source: nix::errno::Errno,
    },
    /// A file operation failed, or a path is not what it must be (a symbolic link where a
    /// directory or a regular file is required: nothing was read or written through it).
    #[error(transparent)]
    Fs(#[from] shim_fs::FsError),
    /// A host tool could not be started, ran past its time limit, or failed.
    #[error(transparent)]
    Command(#[from] shim_util::CommandError),
    /// A tool's output could not be understood.
    #[error("cannot parse the output of {tool}: {why}")]
    Parse {
        /// The tool (`nvidia-smi`, `lsblk`, …).
        tool: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The matrix printed by `nvidia-smi topo -m` could not be understood (no header of GPU
    /// columns, a row too short, a link of unknown kind, GPU rows and columns that do not
    /// match).
    #[error("cannot parse the nvidia-smi topo -m matrix{}: {why}", at_line(.line))]
    TopoMatrix {
        /// The line at fault (1-based), when one is.
        line: Option<usize>,
        /// What is wrong with it.
        why: String,
    },
    /// Fewer GPUs are free and healthy than requested; nothing was locked. Upstream's words
    /// (`runner/internal/shim/resources.go`, `ErrNoCapacity`), then the free GPUs kept out
    /// as unhealthy and why.
    #[error(
        "no capacity: {requested} GPUs requested, {free} available{}",
        unhealthy_suffix(unhealthy)
    )]
    NotEnoughGpus {
        /// How many were requested.
        requested: i64,
        /// How many are free and healthy.
        free: usize,
        /// How many the host has.
        total: usize,
        /// The free GPUs kept out as unhealthy, each as `id (why)`.
        unhealthy: Vec<String>,
    },
    /// The GPU count requested is invalid (below -1).
    #[error("invalid GPU count {requested}")]
    InvalidGpuCount {
        /// The count requested.
        requested: i64,
    },
    /// The volume cannot be attached by this shim: an unsupported backend, or a field its
    /// backend needs is missing (see `VolumeSpec::problem`).
    #[error("volume {volume:?} cannot be attached: {why}")]
    UnsupportedVolume {
        /// The volume name.
        volume: String,
        /// Why.
        why: String,
    },
    /// A volume's block device could not be found.
    #[error("device of volume {volume:?} not found within {waited:?}: {detail}")]
    DeviceNotFound {
        /// The volume name.
        volume: String,
        /// How long it was waited for.
        waited: Duration,
        /// What was looked for.
        detail: String,
    },
    /// The device path exists but is not a usable (non-empty) block device.
    #[error("{} is not a ready block device (waited {waited:?}): {detail}", device.display())]
    NotBlockDevice {
        /// The device path.
        device: PathBuf,
        /// How long it was waited for.
        waited: Duration,
        /// What is wrong with it.
        detail: String,
    },
    /// The device is blank and the volume did not ask for a file system to be created.
    #[error("volume {volume:?}: device {} has no file system and init_fs is false", device.display())]
    NoFilesystem {
        /// The volume name.
        volume: String,
        /// The device path.
        device: PathBuf,
    },
    /// The device carries a signature that is not a file system (e.g. a partition table).
    #[error("device {} has no file system but a {signature} signature; wrong device?", device.display())]
    NotAFilesystem {
        /// The device path.
        device: PathBuf,
        /// What `blkid` reported.
        signature: String,
    },
    /// Another file system than the volume's device is mounted where the volume goes (an
    /// operator's mount, a stale mount of an earlier volume of that name).
    #[error("{} holds another file system than volume {volume:?}'s device {}; unmount it first", mount_point.display(), device.display())]
    MountedElsewhere {
        /// The volume's name.
        volume: String,
        /// Where it goes.
        mount_point: PathBuf,
        /// Its device.
        device: PathBuf,
    },
    /// Mounting failed.
    #[error("cannot mount {} on {}", device.display(), target.display())]
    Mount {
        /// The device.
        device: PathBuf,
        /// The mount point.
        target: PathBuf,
        /// The underlying error.
        #[source]
        source: nix::errno::Errno,
    },
    /// Unmounting failed.
    #[error("cannot unmount {}", target.display())]
    Unmount {
        /// The mount point.
        target: PathBuf,
        /// The underlying error.
        #[source]
        source: nix::errno::Errno,
    },
    /// A system call other than mount failed.
    #[error("{action} {}", path.display())]
    Sys {
        /// What was being done.
        action: &'static str,
        /// The path concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: nix::errno::Errno,
    },
    /// JSON could not be produced.
    #[error("cannot encode {what}")]
    Json {
        /// What was being encoded.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A blocking job panicked or was cancelled.
    #[error("background job {what} failed")]
    Join {
        /// The job.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl ResourcesError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// ` at line N` for [`ResourcesError::TopoMatrix`]'s message, nothing without a line.
fn at_line(line: &Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

/// `map_err` helper: `.map_err(io_err("read", &path))`.
pub(crate) fn io_err<'a>(
    action: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(std::io::Error) -> ResourcesError + 'a {
    move |source| ResourcesError::io(action, path, source)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use shim_util::testing::assert_each_cause_once;

    use super::*;
    use crate::volumes::{Mounter as _, SystemMounter};

    /// Every variant with a cause, as a standard reporter prints it: each cause once.
    #[tokio::test]
    async fn a_reporter_prints_each_cause_once() {
        let io = || std::io::Error::from_raw_os_error(5);
        let errno = nix::errno::Errno::EBUSY;
        let job = tokio::spawn(std::future::pending::<()>());
        job.abort();
        let join = job.await.unwrap_err();
        let json = serde_json::from_str::<u8>("x").unwrap_err();
        let fs = shim_fs::read_file("/nonexistent/dir/file", 10).unwrap_err();
        let cases: Vec<ResourcesError> = vec![
            ResourcesError::io("read", "/x", io()),
            ResourcesError::UserLookup {
                user: "u".into(),
                source: errno,
            },
            ResourcesError::Fs(fs),
            ResourcesError::Command(shim_util::CommandError::Spawn {
                program: "mkfs.ext4".into(),
                source: io(),
            }),
            ResourcesError::Mount {
                device: "/dev/x".into(),
                target: "/m".into(),
                source: errno,
            },
            ResourcesError::Unmount {
                target: "/m".into(),
                source: errno,
            },
            ResourcesError::Sys {
                action: "stat",
                path: "/x".into(),
                source: errno,
            },
            ResourcesError::Json {
                what: "host info",
                source: json,
            },
            ResourcesError::Join {
                what: "mount",
                source: join,
            },
        ];
        for e in &cases {
            assert_each_cause_once(e);
        }
        // And one from a real failure, as the API and a task's message show it.
        let e = SystemMounter::new("/nonexistent/mountinfo")
            .is_mounted(Path::new("/m"))
            .unwrap_err();
        assert_eq!(
            assert_each_cause_once(&e),
            "read /nonexistent/mountinfo: failed to open file `/nonexistent/mountinfo`: No \
             such file or directory (os error 2)"
        );
    }
}
