//! The on-disk form of a record: the upstream shim's `task.json`, format version 1, with this
//! shim's own records in one further field that upstream ignores.
//!
//! ```text
//! {
//!   "version": 1,
//!   "id": "<task id>",
//!   "config": { <TaskConfig as the API takes it, registry credentials empty> },
//!   "termination_reason": "",
//!   "termination_message": "",
//!   "cleaned_up": false,
//!   "rust_shim": { "schema": 1, "name": .., "container_name": .., "status": ..,
//!                  "container_id": .., "resources": {..}, "created_at_ms": ..,
//!                  "updated_at_ms": .. }
//! }
//! ```
//!
//! The upstream fields are what the upstream shim reads and writes (dstack PR #4220: the
//! config, the termination reason and message, whether the task's resources are cleaned up),
//! so a host can switch to the upstream binary with tasks running and back. The upstream
//! shim drops `rust_shim` when it rewrites the file: a file without it is read as upstream
//! wrote it ([`Origin::Upstream`]), and the engine derives what it needs from the config.
//! Files written by the first release of this shim (`{"schema_version": 1, "task": ..}`)
//! are read too ([`Origin::Legacy`]), so their homes can be migrated.

use std::borrow::Cow;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use shim_task::{
    GpuDevice, InstanceMountPoint, KeyLine, NetworkMode, Resources, TaskConfig, TaskId, TaskName,
    TaskRecord, TaskStatus, TerminationReason, VolumeMountPoint, VolumeSpec,
};
use shim_util::error_chain;

use crate::error::RecordError;

/// The upstream format version this shim writes and reads.
pub const FORMAT_VERSION: u64 = 1;

/// The version of this shim's own field (`rust_shim.schema`).
pub const EXTENSION_SCHEMA: u64 = 1;

/// The name of this shim's own field.
pub const EXTENSION_FIELD: &str = "rust_shim";

/// The largest state file the store reads; real records are a few KiB.
pub const MAX_RECORD_BYTES: u64 = 16 * 1024 * 1024;

/// Who wrote a state file last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// This shim: the record is complete.
    Ours,
    /// The upstream shim (no `rust_shim` field): status, container id and resources are not
    /// in the file. The record has the status `running` (or `terminated` when a reason is
    /// recorded) and the resources say only whether they were cleaned up; the caller derives
    /// the rest from the config and the container.
    Upstream,
    /// The first release of this shim (`tasks/<id>/task.json`), to be migrated.
    Legacy,
}

/// The config as upstream writes it: the Go struct's fields in its order (upstream
/// `runner/internal/shim/models.go`, `TaskConfig`), the registry credentials empty.
#[derive(Serialize)]
struct UpstreamConfig<'a> {
    id: &'a str,
    name: &'a str,
    registry_username: &'a str,
    registry_password: &'a str,
    image_name: &'a str,
    container_user: &'a str,
    privileged: bool,
    gpu: i64,
    cpu: f64,
    memory: i64,
    shm_size: i64,
    network_mode: NetworkMode,
    volumes: &'a [VolumeSpec],
    volume_mounts: &'a [VolumeMountPoint],
    instance_mounts: &'a [InstanceMountPoint],
    gpu_devices: &'a [GpuDevice],
    host_ssh_user: &'a str,
    host_ssh_keys: &'a [KeyLine],
    container_ssh_keys: &'a [KeyLine],
}

impl<'a> UpstreamConfig<'a> {
    /// Every field of [`TaskConfig`] (`#[non_exhaustive]`, so this destructuring cannot be
    /// exhaustive; the store's test `every_config_field_is_written_in_upstreams_config` fails
    /// until a new field is written here, or deliberately left out).
    fn of(c: &'a TaskConfig) -> Self {
        let TaskConfig {
            id,
            name,
            image_name,
            // Credentials never reach the disk (SPEC §5).
            registry_username: _,
            registry_password: _,
            container_user,
            privileged,
            gpu,
            cpu,
            memory,
            shm_size,
            network_mode,
            volumes,
            volume_mounts,
            instance_mounts,
            gpu_devices,
            host_ssh_user,
            host_ssh_keys,
            container_ssh_keys,
            ..
        } = c;
        Self {
            id: id.as_str(),
            name: name.as_str(),
            registry_username: "",
            registry_password: "",
            image_name,
            container_user,
            privileged: *privileged,
            gpu: *gpu,
            cpu: *cpu,
            memory: *memory,
            shm_size: *shm_size,
            network_mode: *network_mode,
            volumes,
            volume_mounts,
            instance_mounts,
            gpu_devices,
            host_ssh_user,
            host_ssh_keys,
            container_ssh_keys,
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Extension<'a> {
    schema: u64,
    name: Cow<'a, TaskName>,
    container_name: Cow<'a, str>,
    status: TaskStatus,
    #[serde(default)]
    container_id: Cow<'a, str>,
    #[serde(default)]
    resources: Cow<'a, Resources>,
    #[serde(default)]
    created_at_ms: u64,
    #[serde(default)]
    updated_at_ms: u64,
}

#[derive(Serialize)]
struct FileOut<'a> {
    version: u64,
    id: &'a str,
    config: Option<UpstreamConfig<'a>>,
    termination_reason: &'a str,
    termination_message: &'a str,
    cleaned_up: bool,
    rust_shim: Extension<'a>,
}

/// The bytes of a record's state file.
pub(crate) fn encode(record: &TaskRecord) -> serde_json::Result<Vec<u8>> {
    let file = FileOut {
        version: FORMAT_VERSION,
        id: record.id.as_str(),
        config: record.config.as_deref().map(UpstreamConfig::of),
        // Upstream reads an empty reason as "not terminated": a reason is only written once
        // the task is terminated.
        termination_reason: match (&record.termination_reason, record.status) {
            (Some(r), TaskStatus::Terminated) => r.as_str(),
            _ => "",
        },
        termination_message: &record.termination_message,
        cleaned_up: record.resources.released,
        rust_shim: Extension {
            schema: EXTENSION_SCHEMA,
            name: Cow::Borrowed(&record.name),
            container_name: Cow::Borrowed(&record.container_name),
            status: record.status,
            container_id: Cow::Borrowed(record.container_id.as_deref().unwrap_or_default()),
            resources: Cow::Borrowed(&record.resources),
            created_at_ms: record.created_at_ms,
            updated_at_ms: record.updated_at_ms,
        },
    };
    let mut bytes = serde_json::to_vec_pretty(&file)?;
    bytes.push(b'\n');
    Ok(bytes)
}

#[derive(Deserialize)]
struct FileIn {
    id: TaskId,
    #[serde(default)]
    config: Option<Value>,
    #[serde(default)]
    termination_reason: Option<String>,
    #[serde(default)]
    termination_message: Option<String>,
    #[serde(default)]
    cleaned_up: bool,
    #[serde(default)]
    rust_shim: Option<Extension<'static>>,
}

#[derive(Deserialize)]
struct LegacyEnvelope {
    task: TaskRecord,
}

/// What a state file's directory says about the task in it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Expect<'a> {
    /// A task directory of this layout, named after the task's container.
    Container(&'a str),
    /// A directory of the first release's layout, named after the task id.
    TaskId(&'a str),
}

/// Parses a state file's bytes, checking them against their directory's name.
pub(crate) fn decode(
    bytes: &[u8],
    expect: Expect<'_>,
) -> Result<(TaskRecord, Origin), RecordError> {
    let (dir_name, legacy_dir) = match expect {
        Expect::Container(n) => (n, false),
        Expect::TaskId(n) => (n, true),
    };
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(RecordError::Empty);
    }
    let value: Value = serde_json::from_slice(bytes).map_err(RecordError::Malformed)?;
    let version = |key: &str| value.get(key).and_then(Value::as_u64);
    if let Some(v) = version("schema_version") {
        // The first release of this shim.
        if v != 1 {
            return Err(if v == 0 {
                RecordError::UnknownSchema(v)
            } else {
                RecordError::NewerSchema(v)
            });
        }
        let LegacyEnvelope { task } =
            serde_json::from_value(value).map_err(RecordError::Malformed)?;
        if task.id.as_str() != dir_name {
            return Err(RecordError::WrongTask {
                expected: dir_name.to_owned(),
                found: task.id,
            });
        }
        return Ok((task, Origin::Legacy));
    }
    match version("version") {
        Some(FORMAT_VERSION) => {}
        Some(0) | None => return Err(RecordError::UnknownSchema(0)),
        Some(v) => return Err(RecordError::NewerSchema(v)),
    }
    let file: FileIn = serde_json::from_value(value).map_err(RecordError::Malformed)?;
    let config = match file.config {
        None | Some(Value::Null) => None,
        Some(v) => match serde_json::from_value::<TaskConfig>(v) {
            Ok(c) => Some(c.without_credentials()),
            // The upstream shim stores whatever the server sent (e.g. a key with a line
            // break, which this shim refuses at submit): the task is still adopted, without
            // its config, rather than its state file being moved aside.
            Err(e) if file.rust_shim.is_none() => {
                tracing::warn!(task = %file.id, error = %error_chain(&e), "config written by the upstream shim not understood; adopting the task without it");
                None
            }
            Err(e) => return Err(RecordError::Malformed(e)),
        },
    };
    if let Some(c) = &config
        && c.id != file.id
    {
        return Err(RecordError::WrongTask {
            expected: file.id.to_string(),
            found: c.id.clone(),
        });
    }
    let reason = file.termination_reason.unwrap_or_default();
    let message = file.termination_message.unwrap_or_default();
    match file.rust_shim {
        Some(ext) if ext.schema > EXTENSION_SCHEMA => Err(RecordError::NewerSchema(ext.schema)),
        Some(ext) => {
            let wrong = if legacy_dir {
                file.id.as_str() != dir_name
            } else {
                ext.container_name != dir_name
            };
            if wrong {
                return Err(RecordError::WrongTask {
                    expected: dir_name.to_owned(),
                    found: file.id,
                });
            }
            let terminated = ext.status == TaskStatus::Terminated;
            let mut resources = ext.resources.into_owned();
            resources.released = file.cleaned_up;
            Ok((
                TaskRecord {
                    id: file.id,
                    name: ext.name.into_owned(),
                    container_name: ext.container_name.into_owned(),
                    config: config.map(Arc::new),
                    status: ext.status,
                    termination_reason: terminated.then(|| TerminationReason::parse(&reason)),
                    termination_message: message,
                    container_id: Some(ext.container_id.into_owned()).filter(|id| !id.is_empty()),
                    resources,
                    created_at_ms: ext.created_at_ms,
                    updated_at_ms: ext.updated_at_ms,
                },
                Origin::Ours,
            ))
        }
        None if legacy_dir => Err(RecordError::WrongTask {
            expected: dir_name.to_owned(),
            found: file.id,
        }),
        None => {
            // Written by the upstream shim.
            let name = match &config {
                Some(c) => c.name.clone(),
                None => shim_task::naming::task_name_of_container(dir_name).ok_or_else(|| {
                    RecordError::WrongTask {
                        expected: dir_name.to_owned(),
                        found: file.id.clone(),
                    }
                })?,
            };
            if shim_task::naming::container_name(&name, &file.id) != dir_name {
                return Err(RecordError::WrongTask {
                    expected: dir_name.to_owned(),
                    found: file.id,
                });
            }
            let terminated = !reason.is_empty();
            Ok((
                TaskRecord {
                    id: file.id,
                    name,
                    container_name: dir_name.to_owned(),
                    config: config.map(Arc::new),
                    status: if terminated {
                        TaskStatus::Terminated
                    } else {
                        TaskStatus::Running
                    },
                    termination_reason: terminated.then(|| TerminationReason::parse(&reason)),
                    termination_message: message,
                    container_id: None,
                    resources: Resources {
                        released: file.cleaned_up,
                        ..Resources::default()
                    },
                    created_at_ms: 0,
                    updated_at_ms: 0,
                },
                Origin::Upstream,
            ))
        }
    }
}
