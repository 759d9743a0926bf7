//! Task statuses and termination reasons, as they appear on the wire.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A task's status. The order of the variants is the order of the lifecycle: a status never
/// moves backwards, and [`TaskStatus::Terminated`] is final.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    /// Submitted and persisted; start has not begun.
    Pending,
    /// Acquiring host resources (GPUs, SSH keys, volumes, instance mounts).
    Preparing,
    /// Pulling the image.
    Pulling,
    /// Creating and starting the container.
    Creating,
    /// The container runs.
    Running,
    /// Final.
    Terminated,
}

impl TaskStatus {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Preparing => "preparing",
            Self::Pulling => "pulling",
            Self::Creating => "creating",
            Self::Running => "running",
            Self::Terminated => "terminated",
        }
    }
}

impl fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a task ended: one of the known reasons, or any string a terminate request brought.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TerminationReason {
    /// The shim could not prepare the task, or lost its container.
    ExecutorError,
    /// The image pull or the container creation failed.
    CreatingContainerError,
    /// The container exited with a non-zero code or failed to start.
    ContainerExitedWithError,
    /// The container exited with code 0.
    DoneByRunner,
    /// The user stopped the task (through the server).
    TerminatedByUser,
    /// The server stopped the task.
    TerminatedByServer,
    /// The task ran past its maximum duration.
    MaxDurationExceeded,
    /// The task's logs exceeded their quota.
    LogQuotaExceeded,
    /// Any other reason string a terminate request carried, kept as given.
    Other(String),
}

impl TerminationReason {
    /// The wire string.
    pub fn as_str(&self) -> &str {
        match self {
            Self::ExecutorError => "executor_error",
            Self::CreatingContainerError => "creating_container_error",
            Self::ContainerExitedWithError => "container_exited_with_error",
            Self::DoneByRunner => "done_by_runner",
            Self::TerminatedByUser => "terminated_by_user",
            Self::TerminatedByServer => "terminated_by_server",
            Self::MaxDurationExceeded => "max_duration_exceeded",
            Self::LogQuotaExceeded => "log_quota_exceeded",
            Self::Other(s) => s,
        }
    }

    /// Parses a wire string; unknown strings become [`TerminationReason::Other`].
    pub fn parse(s: &str) -> Self {
        match s {
            "executor_error" => Self::ExecutorError,
            "creating_container_error" => Self::CreatingContainerError,
            "container_exited_with_error" => Self::ContainerExitedWithError,
            "done_by_runner" => Self::DoneByRunner,
            "terminated_by_user" => Self::TerminatedByUser,
            "terminated_by_server" => Self::TerminatedByServer,
            "max_duration_exceeded" => Self::MaxDurationExceeded,
            "log_quota_exceeded" => Self::LogQuotaExceeded,
            other => Self::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for TerminationReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for TerminationReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for TerminationReason {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(Self::parse(&s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_round_trips() {
        for s in [
            "executor_error",
            "creating_container_error",
            "container_exited_with_error",
            "done_by_runner",
            "terminated_by_user",
            "terminated_by_server",
            "max_duration_exceeded",
            "log_quota_exceeded",
            "something_new",
        ] {
            assert_eq!(TerminationReason::parse(s).as_str(), s);
        }
        assert_eq!(
            TerminationReason::parse("x"),
            TerminationReason::Other("x".into())
        );
    }

    #[test]
    fn status_order_is_lifecycle() {
        assert!(TaskStatus::Pending < TaskStatus::Preparing);
        assert!(TaskStatus::Running < TaskStatus::Terminated);
        assert_eq!(
            serde_json::to_string(&TaskStatus::Pulling).unwrap(),
            "\"pulling\""
        );
    }
}
