//! [`DcgmError`] and its [`DcgmErrorKind`], which tells the HTTP layer what to answer.

use std::io;
use std::time::Duration;

use shim_util::CommandError;

use shim_util::BoxError;

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
/// program, command line) and keeps the underlying error as its source; its `Display`
/// describes its own level only (print the whole with [`shim_util::error_chain`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DcgmError {
    /// The exporter's collectors file could not be written.
    #[error("write the dcgm-exporter collectors file")]
    CountersFile {
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// A temporary directory (for the private host engine's socket) could not be made.
    #[error("create a temporary directory for nv-hostengine")]
    TempDir {
        /// The IO error.
        #[source]
        source: io::Error,
    },
    /// The GET of the exporter's metrics failed below HTTP (refused, reset, bad response).
    #[error("fetch {url}")]
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
    /// A program could not be started ([`CommandError::Spawn`]), ran longer than allowed and
    /// was killed, or exited unsuccessfully (with the end of what it said: dcgmi prints its
    /// errors on stdout).
    #[error(transparent)]
    Command(#[from] CommandError),
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
            Self::CountersFile { .. }
            | Self::TempDir { .. }
            | Self::Command(CommandError::Spawn { .. }) => DcgmErrorKind::Internal,
            Self::Fetch { .. }
            | Self::Status { .. }
            | Self::FetchTimeout { .. }
            | Self::Command(_)
            | Self::DcgmiOutput { .. } => DcgmErrorKind::Upstream,
        }
    }
}

#[cfg(test)]
mod tests {
    use shim_util::testing::assert_each_cause_once;
    use shim_util::{Command, CommandOutput};

    use super::*;

    fn spawn() -> DcgmError {
        DcgmError::Command(CommandError::Spawn {
            program: "/nonexistent/dcgmi".into(),
            source: io::Error::from_raw_os_error(2),
        })
    }

    /// Every variant with a cause, as a standard reporter prints it: each cause once.
    #[test]
    fn a_reporter_prints_each_cause_once() {
        let io = || io::Error::from_raw_os_error(28);
        for e in [
            DcgmError::CountersFile { source: io() },
            DcgmError::TempDir { source: io() },
            DcgmError::Fetch {
                url: "http://localhost:10997/metrics".into(),
                source: Box::new(io()),
            },
            spawn(),
        ] {
            assert_each_cause_once(&e);
        }
        assert_eq!(
            shim_util::error_chain(&spawn()),
            "cannot run /nonexistent/dcgmi: No such file or directory (os error 2)"
        );
    }

    /// A program the shim cannot start is its own fault; one that fails or hangs is DCGM's.
    #[test]
    fn command_errors_have_their_kinds() {
        let dcgmi = Command::new("dcgmi").arg("health");
        let failed = DcgmError::from(CommandOutput::exit(1, "").failure(&dcgmi));
        let timed_out = DcgmError::Command(CommandError::TimedOut {
            command: dcgmi.to_string(),
            timeout: Duration::from_secs(1),
        });
        assert_eq!(spawn().kind(), DcgmErrorKind::Internal);
        assert_eq!(failed.kind(), DcgmErrorKind::Upstream);
        assert_eq!(timed_out.kind(), DcgmErrorKind::Upstream);
    }
}
