//! The JSON of the runner's API, as far as this runner reads and writes it.
//!
//! upstream: runner/internal/runner/schemas (Go's structs), and the server's side
//! dstack/_internal/server/schemas/runner.py (`SubmitBody`, `PullResponse`, ...). Members this
//! runner does not use are ignored; `null` reads as a missing member (pydantic writes
//! `None` as `null`).

use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `null` or missing: the type's default.
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Option::<T>::deserialize(deserializer).map(Option::unwrap_or_default)
}

/// `POST /api/submit`'s body (upstream's `SubmitBody`).
#[derive(Debug, Deserialize)]
pub struct SubmitBody {
    /// `run`.
    #[serde(default, deserialize_with = "nullable")]
    pub run: Run,
    /// `job_spec` (required).
    pub job_spec: JobSpec,
    /// `job_submission`.
    #[serde(default, deserialize_with = "nullable")]
    pub job_submission: JobSubmission,
}

/// `run`.
#[derive(Debug, Default, Deserialize)]
pub struct Run {
    /// `run.id`.
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
    /// `run.run_spec`.
    #[serde(default, deserialize_with = "nullable")]
    pub run_spec: RunSpec,
}

/// `run.run_spec`.
#[derive(Debug, Default, Deserialize)]
pub struct RunSpec {
    /// `run.run_spec.run_name`.
    #[serde(default, deserialize_with = "nullable")]
    pub run_name: String,
    /// `run.run_spec.repo_id`.
    #[serde(default, deserialize_with = "nullable")]
    pub repo_id: String,
}

/// `job_submission`.
#[derive(Debug, Default, Deserialize)]
pub struct JobSubmission {
    /// `job_submission.id`.
    #[serde(default, deserialize_with = "nullable")]
    pub id: String,
}

/// `job_spec`.
#[derive(Debug, Deserialize)]
pub struct JobSpec {
    /// The command line (the server sends the shell and its arguments; required).
    pub commands: Vec<String>,
    /// The job's variables; a member that is not a string is ignored.
    #[serde(default, deserialize_with = "nullable")]
    pub env: serde_json::Map<String, serde_json::Value>,
    /// The working directory, if set.
    #[serde(default)]
    pub working_dir: Option<String>,
    /// The user, if set.
    #[serde(default, deserialize_with = "nullable")]
    pub user: User,
    /// Seconds, if set.
    #[serde(default)]
    pub max_duration: Option<i64>,
    /// The node's rank.
    #[serde(default)]
    pub job_num: Option<i64>,
    /// The number of nodes.
    #[serde(default)]
    pub jobs_per_replica: Option<i64>,
}

/// `job_spec.user`.
#[derive(Debug, Default, Deserialize)]
pub struct User {
    /// `job_spec.user.username`, if set.
    #[serde(default)]
    pub username: Option<String>,
}

/// `GET /api/healthcheck`'s answer.
#[derive(Debug, Serialize)]
pub struct Healthcheck<'a> {
    /// Always `dstack-runner`.
    pub service: &'static str,
    /// The dstack release.
    pub version: &'a str,
}

/// `POST /api/run`'s answer (upstream's `JobInfoResponse`).
#[derive(Debug, Serialize)]
pub struct JobInfo<'a> {
    /// The job's working directory.
    pub working_dir: &'a str,
    /// The job's user.
    pub username: &'a str,
}

/// `GET /api/pull`'s answer (upstream's `PullResponse`).
#[derive(Debug, Serialize)]
pub struct PullResponse<'a> {
    /// Job states after the timestamp asked for.
    pub job_states: &'a [JobStateEvent],
    /// The job's output after it.
    pub job_logs: &'a [LogEvent],
    /// The runner's own log after it.
    pub runner_logs: &'a [LogEvent],
    /// The last timestamp handed out: the next pull's.
    pub last_updated: i64,
    /// Always 0 (upstream: seconds without a `/logs_ws` reader).
    pub no_connections_secs: i64,
    /// False once the job ended: this answer holds the last events.
    pub has_more: bool,
}

/// A job state (upstream's `JobStateEvent`).
#[derive(Debug, Clone, Serialize)]
pub struct JobStateEvent {
    /// `running`, `done`, `failed`, `terminated`.
    pub state: &'static str,
    /// When (milliseconds).
    pub timestamp: i64,
    /// Empty, `executor_error`, `max_duration_exceeded`.
    pub termination_reason: &'static str,
    /// Why, if it says.
    pub termination_message: String,
    /// The exit code, where there is one.
    pub exit_status: Option<i32>,
}

/// A piece of a log (upstream's `LogEvent`).
#[derive(Debug, Clone, Serialize)]
pub struct LogEvent {
    /// The bytes (Go's `[]byte`: standard base64 with padding in JSON).
    #[serde(serialize_with = "base64")]
    pub message: Vec<u8>,
    /// When (milliseconds).
    pub timestamp: i64,
}

fn base64<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
}
