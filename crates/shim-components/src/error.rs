//! The crate's one error type. Its `Display` describes its own level only; the cause is its
//! `source()` (print the whole with [`shim_util::error_chain`]).

use std::io;
use std::path::PathBuf;

use crate::ComponentName;

/// Why reading a version or installing a component failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ComponentsError {
    /// An install of this component is already running.
    #[error("{name} is already installing")]
    AlreadyInstalling {
        /// The component.
        name: ComponentName,
    },
    /// The URL cannot be used.
    #[error("cannot install {name}: {why}")]
    BadUrl {
        /// The component.
        name: ComponentName,
        /// What is wrong.
        why: String,
    },
    /// The HTTP request failed (connection, TLS, status code, timeout).
    #[cfg(feature = "install")]
    #[error("cannot download {name} from {url}")]
    Download {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// Why.
        #[source]
        source: Box<ureq::Error>,
    },
    /// Reading the response body failed.
    #[error("cannot download {name} from {url}")]
    Body {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The download is larger than allowed, or empty.
    #[error("download of {name} from {url} has a bad size: {why}")]
    Size {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// What is wrong.
        why: String,
    },
    /// Writing the binary into place failed (the target is left as it was).
    #[error(transparent)]
    Fs(#[from] shim_fs::FsError),
    /// A file operation failed.
    #[error("cannot {op} {}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The downloaded shim is the binary an upgrade rolled back less than an hour ago (its
    /// [`crate::upgrade::RollbackRecord`]): it is not put at the path systemd starts.
    #[error(
        "{name} from {url} is the binary rolled back at {failed_at_unix} ({reason}); not installed for an hour after"
    )]
    Refused {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// When it failed (seconds since the Unix epoch).
        failed_at_unix: u64,
        /// Why it was rolled back.
        reason: String,
    },
    /// The downloaded shim does not answer `--version` here (another architecture, a
    /// truncated or HTML body): the running binary was put back at the path systemd starts.
    #[error("{name} from {url} does not run here: {why}; the running binary was put back")]
    Unusable {
        /// The component.
        name: ComponentName,
        /// The URL without its query string.
        url: String,
        /// What `--version` did.
        why: String,
    },
    /// The install was cancelled (shutdown).
    #[error("install of {name} was cancelled")]
    Cancelled {
        /// The component.
        name: ComponentName,
    },
    /// The background download task died.
    #[error("the install task of {name} failed")]
    Join {
        /// The component.
        name: ComponentName,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
    /// The record of a rolled-back upgrade cannot be read.
    #[error("cannot read {}", path.display())]
    Record {
        /// The record file.
        path: PathBuf,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// `<binary> --version` could not run, did not finish in time, or failed.
    #[error("{} does not report a version", path.display())]
    VersionRun {
        /// The binary.
        path: PathBuf,
        /// Why.
        #[source]
        source: shim_util::CommandError,
    },
    /// `<binary> --version` printed something else than `<component name> version X`.
    #[error("{} does not report a version: unexpected output {output:?}", path.display())]
    VersionOutput {
        /// The binary.
        path: PathBuf,
        /// What it printed (trimmed).
        output: String,
    },
}

#[cfg(test)]
mod tests {
    use shim_util::testing::assert_each_cause_once;

    use super::*;

    /// Every variant with a cause, as a standard reporter prints it: each cause once.
    #[tokio::test]
    async fn a_reporter_prints_each_cause_once() {
        let name = ComponentName::Runner;
        let url = || "https://example.com/dstack-runner".to_owned();
        let io = || io::Error::from_raw_os_error(28);
        let job = tokio::spawn(std::future::pending::<()>());
        job.abort();
        let join = job.await.unwrap_err();
        let fs = shim_fs::read_file("/nonexistent/dir/dstack-runner", 10).unwrap_err();
        for e in [
            #[cfg(feature = "install")]
            ComponentsError::Download {
                name,
                url: url(),
                source: Box::new(ureq::Error::StatusCode(404)),
            },
            ComponentsError::Body {
                name,
                url: url(),
                source: io(),
            },
            ComponentsError::Fs(fs),
            ComponentsError::Io {
                op: "chmod",
                path: "/x".into(),
                source: io(),
            },
            ComponentsError::Join { name, source: join },
            ComponentsError::Record {
                path: "/x/upgrade-rollback.json".into(),
                source: serde_json::from_str::<u8>("x").unwrap_err(),
            },
            ComponentsError::VersionRun {
                path: "/x/dstack-runner".into(),
                source: shim_util::CommandError::Spawn {
                    program: "/x/dstack-runner".into(),
                    source: io(),
                },
            },
        ] {
            assert_each_cause_once(&e);
        }
    }
}
