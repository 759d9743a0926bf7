//! The crate's one error type.

use std::io;
use std::path::PathBuf;

use crate::ComponentName;

/// Why reading a version or installing a component failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
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
    Fs(#[from] shim_fs::Error),
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
    /// `<binary> --version` failed or printed no version.
    #[error("{} does not report a version: {why}", path.display())]
    Version {
        /// The binary.
        path: PathBuf,
        /// What happened.
        why: String,
    },
}
