//! [`DcgmError`] and its [`DcgmErrorKind`], which tells the HTTP layer what to answer.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// The boxed source of a failed HTTP exchange (connection, protocol or body error).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Who is to blame for a [`DcgmError`]; decides the status code the API answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DcgmErrorKind {
    /// A DCGM program the shim relies on (the exporter, `dcgmi`, the host engine) failed or
    /// answered something unusable. `GET /metrics/tasks/{id}` answers 502 for these, as
    /// upstream does for every exporter fetch error.
    Upstream,
    /// The shim itself failed (a file it had to write, a program it had to start).
    Internal,
}

/// Everything that can go wrong in this crate. Every variant names what it was doing (URL,
/// program, command line) and keeps the underlying error as its source.
#[derive(Debug, thiserror::Error)]
pub enum DcgmError {
    /// The exporter's collectors file could not be written.
    #[error("write the dcgm-exporter collectors file: {source}")]
    CountersFile {
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// A temporary directory (for the private host engine's socket) could not be made.
    #[error("create a temporary directory for nv-hostengine: {source}")]
    TempDir {
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// The GET of the exporter's metrics failed below HTTP (refused, reset, bad response).
    #[error("fetch {url}: {source}")]
    Fetch {
        /// The URL fetched.
        url: String,
        /// What failed.
        #[source]
        source: BoxError,
    },
    /// The exporter answered, but not 200. Upstream's text: `status is not OK: <code>`.
    #[error("fetch {url}: status is not OK: {status}")]
    Status {
        /// The URL fetched.
        url: String,
        /// The status code received.
        status: u16,
    },
    /// The exporter did not answer in time.
    #[error("fetch {url}: no answer within {timeout:?}")]
    FetchTimeout {
        /// The URL fetched.
        url: String,
        /// The limit.
        timeout: Duration,
    },
    /// A program could not be started.
    #[error("start {program}: {source}", program = program.display())]
    Spawn {
        /// The program.
        program: PathBuf,
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// A program ran longer than allowed and was killed.
    #[error("`{command}` did not finish within {timeout:?}")]
    CommandTimeout {
        /// The command line.
        command: String,
        /// The limit.
        timeout: Duration,
    },
    /// A program exited unsuccessfully.
    #[error("`{command}` failed ({status}): {output}")]
    CommandFailed {
        /// The command line.
        command: String,
        /// The exit status, as text (`exit status: 1`, `signal: 9`).
        status: String,
        /// The start of its stdout and stderr (dcgmi prints its errors on stdout).
        output: String,
    },
    /// `dcgmi` answered something that is not the health report it should be.
    #[error("`{command}` printed an unexpected report: {reason}")]
    DcgmiOutput {
        /// The command line.
        command: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl DcgmError {
    /// Who is to blame, and so which status code the API answers.
    pub fn kind(&self) -> DcgmErrorKind {
        match self {
            Self::CountersFile { .. } | Self::TempDir { .. } | Self::Spawn { .. } => {
                DcgmErrorKind::Internal
            }
            Self::Fetch { .. }
            | Self::Status { .. }
            | Self::FetchTimeout { .. }
            | Self::CommandTimeout { .. }
            | Self::CommandFailed { .. }
            | Self::DcgmiOutput { .. } => DcgmErrorKind::Upstream,
        }
    }
}
