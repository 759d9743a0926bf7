//! The on-disk form of a record: `{"schema_version": 1, "task": <TaskRecord>}`.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use shim_task::{TaskId, TaskRecord};

use crate::error::RecordError;

/// The schema version this shim writes and reads. A file with a larger version was written by a
/// newer shim: it is not understood and is moved aside, never overwritten in place.
pub const SCHEMA_VERSION: u64 = 1;

/// The largest state file the store reads; real records are a few KiB.
pub const MAX_RECORD_BYTES: u64 = 16 * 1024 * 1024;

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    schema_version: u64,
    task: Cow<'a, TaskRecord>,
}

#[derive(Deserialize)]
struct Version {
    schema_version: u64,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    task: TaskRecord,
}

/// The bytes of a record's state file. Registry credentials are stripped here too, whatever the
/// caller passed: they never reach the disk.
pub(crate) fn encode(record: &TaskRecord) -> serde_json::Result<Vec<u8>> {
    let task = match &record.config {
        Some(c) if !c.registry_password.is_empty() || !c.registry_username.is_empty() => {
            Cow::Owned(TaskRecord {
                config: Some(c.without_credentials()),
                ..record.clone()
            })
        }
        _ => Cow::Borrowed(record),
    };
    let mut bytes = serde_json::to_vec_pretty(&EnvelopeOut {
        schema_version: SCHEMA_VERSION,
        task,
    })?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// Parses a state file's bytes; `expected` is the id its directory is named after.
pub(crate) fn decode(bytes: &[u8], expected: &TaskId) -> Result<TaskRecord, RecordError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(RecordError::Empty);
    }
    let Version { schema_version } =
        serde_json::from_slice(bytes).map_err(RecordError::Malformed)?;
    match schema_version {
        SCHEMA_VERSION => {}
        0 => return Err(RecordError::UnknownSchema(0)),
        v => return Err(RecordError::NewerSchema(v)),
    }
    let EnvelopeIn { task } = serde_json::from_slice(bytes).map_err(RecordError::Malformed)?;
    if task.id != *expected {
        return Err(RecordError::WrongTask {
            expected: expected.clone(),
            found: task.id,
        });
    }
    Ok(task)
}
