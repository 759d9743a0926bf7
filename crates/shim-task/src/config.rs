//! The task config: the body of a submit request, with SPEC's defaults and validation.
//!
//! Deserializing checks the types, ids and names, and that no SSH key could inject a line (no
//! line break, no NUL); [`TaskConfig::validate`] checks the ranges and paths. What the upstream
//! shim accepts at submit and only handles at start is accepted here too (SPEC §2): a host key
//! that is not one plain OpenSSH public key is skipped at start ([`TaskConfig::host_keys`]), and a
//! volume this shim cannot attach fails the task at start ([`VolumeSpec::problem`]). Unknown
//! fields are ignored (newer servers send more), `null` is the default of any optional field,
//! and the registry password never appears in `Debug` output or in serialized form.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

use crate::ids::{TaskId, TaskName};
use crate::ssh::{InvalidKey, PublicKey};

/// A config value the shim refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid task config: {field}: {why}")]
pub struct ConfigError {
    /// The offending field.
    pub field: String,
    /// What is wrong.
    pub why: String,
}

fn err(field: impl Into<String>, why: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        why: why.into(),
    }
}

/// `null` → `T::default()`.
fn null_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A secret string: deserialized as given, but never serialized and never shown in `Debug`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The secret itself, for the one place that needs it (registry auth).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the secret is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() {
            "\"\""
        } else {
            "<redacted>"
        })
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self(Option::<String>::deserialize(d)?.unwrap_or_default()))
    }
}

/// The container's network mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    /// The host's network namespace (the default).
    #[default]
    Host,
    /// Docker's bridge; the runner ports are published on 127.0.0.1.
    Bridge,
}

impl NetworkMode {
    /// Docker's name for the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Bridge => "bridge",
        }
    }
}

impl<'de> Deserialize<'de> for NetworkMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<String>::deserialize(d)?.as_deref() {
            None | Some("") | Some("host") => Ok(Self::Host),
            Some("bridge") => Ok(Self::Bridge),
            Some(other) => Err(serde::de::Error::custom(format!(
                "network_mode must be \"host\" or \"bridge\", not {other:?}"
            ))),
        }
    }
}

/// The cloud a volume lives in, which says how its device is found.
///
/// Any string is accepted at submit (upstream accepts any and fails at start); a backend this
/// shim cannot attach is [`VolumeBackend::Other`] and fails the task at start.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum VolumeBackend {
    /// AWS EBS: the device is found by the volume id in `lsblk` serials.
    Aws,
    /// GCP persistent disk: `/dev/disk/by-id/google-<device_name>`.
    Gcp,
    /// Any other backend, as sent (empty when missing): cannot be attached here.
    Other(String),
}

impl VolumeBackend {
    /// The wire name.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Aws => "aws",
            Self::Gcp => "gcp",
            Self::Other(s) => s,
        }
    }
}

impl Default for VolumeBackend {
    fn default() -> Self {
        Self::Other(String::new())
    }
}

impl Serialize for VolumeBackend {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for VolumeBackend {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(
            match Option::<String>::deserialize(d)?
                .unwrap_or_default()
                .as_str()
            {
                "aws" => Self::Aws,
                "gcp" => Self::Gcp,
                other => Self::Other(other.to_owned()),
            },
        )
    }
}

/// A network volume attached to the host, to be formatted (maybe) and mounted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VolumeSpec {
    /// Where the volume lives.
    #[serde(default)]
    pub backend: VolumeBackend,
    /// The volume's name: the mount point is `<volumes root>/<name>`.
    pub name: TaskName,
    /// The cloud's volume id.
    #[serde(default, deserialize_with = "null_default")]
    pub volume_id: String,
    /// Format the device if it has no filesystem.
    #[serde(default, deserialize_with = "null_default")]
    pub init_fs: bool,
    /// The device name the cloud attached it as (e.g. `/dev/sdf`, or GCP's device name).
    #[serde(default, deserialize_with = "null_default")]
    pub device_name: String,
}

/// Where a volume is mounted in the container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VolumeMountPoint {
    /// The volume's name (one of [`TaskConfig::volumes`]).
    pub name: TaskName,
    /// Absolute path in the container.
    pub path: String,
}

/// A host directory bind-mounted into the container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct InstanceMountPoint {
    /// Absolute host path; created (0777) if missing.
    pub instance_path: String,
    /// Absolute path in the container.
    pub path: String,
}

/// A host device mapped into the container, replacing the vendor GPU logic.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuDevice {
    /// Absolute device path on the host.
    pub path_on_host: String,
    /// Absolute device path in the container.
    pub path_in_container: String,
}

/// The submit body. See SPEC §2 for the meaning and defaults of each field.
///
/// Built by deserializing a submit body, or with [`TaskConfig::new`] and then the fields
/// that differ from their defaults (`#[non_exhaustive]`: a field added in a later version
/// breaks no embedder).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TaskConfig {
    /// The task id.
    pub id: TaskId,
    /// The task name.
    pub name: TaskName,
    /// The image to run, as given (the engine adds `:latest` to a bare name).
    pub image_name: String,
    /// Registry user, if the image needs auth.
    #[serde(default, deserialize_with = "null_default")]
    pub registry_username: String,
    /// Registry password: never serialized, never logged.
    #[serde(default, skip_serializing)]
    pub registry_password: Secret,
    /// The container's user; empty means `root`.
    #[serde(default, deserialize_with = "null_default")]
    pub container_user: String,
    /// Run the container privileged.
    #[serde(default, deserialize_with = "null_default")]
    pub privileged: bool,
    /// `-1` all available (even if none), `0` none, `N` exactly N.
    #[serde(default, deserialize_with = "null_default")]
    pub gpu: i64,
    /// CPUs; `0` = all.
    #[serde(default, deserialize_with = "null_default")]
    pub cpu: f64,
    /// Memory in bytes; `0` = all.
    #[serde(default, deserialize_with = "null_default")]
    pub memory: i64,
    /// `/dev/shm` size in bytes; `0` = Docker's default.
    #[serde(default, deserialize_with = "null_default")]
    pub shm_size: i64,
    /// `host` (default) or `bridge`.
    #[serde(default)]
    pub network_mode: NetworkMode,
    /// Volumes to prepare on the host.
    #[serde(default, deserialize_with = "null_default")]
    pub volumes: Vec<VolumeSpec>,
    /// Where the volumes go in the container.
    #[serde(default, deserialize_with = "null_default")]
    pub volume_mounts: Vec<VolumeMountPoint>,
    /// Host directories to bind-mount.
    #[serde(default, deserialize_with = "null_default")]
    pub instance_mounts: Vec<InstanceMountPoint>,
    /// Plain device mappings replacing the vendor GPU logic.
    #[serde(default, deserialize_with = "null_default")]
    pub gpu_devices: Vec<GpuDevice>,
    /// The host user whose authorized_keys get [`TaskConfig::host_ssh_keys`].
    #[serde(default, deserialize_with = "null_default")]
    pub host_ssh_user: String,
    /// Keys added to the host user's authorized_keys while the task lives; those that are not
    /// one plain OpenSSH public key are skipped at start ([`TaskConfig::host_keys`]).
    #[serde(default, deserialize_with = "null_default")]
    pub host_ssh_keys: Vec<KeyLine>,
    /// Keys the runner authorizes inside the container, passed to it as given.
    #[serde(default, deserialize_with = "null_default")]
    pub container_ssh_keys: Vec<KeyLine>,
}

impl TaskConfig {
    /// A minimal config with every optional field at its default.
    pub fn new(id: TaskId, name: TaskName, image_name: impl Into<String>) -> Self {
        Self {
            id,
            name,
            image_name: image_name.into(),
            registry_username: String::new(),
            registry_password: Secret::default(),
            container_user: String::new(),
            privileged: false,
            gpu: 0,
            cpu: 0.0,
            memory: 0,
            shm_size: 0,
            network_mode: NetworkMode::Host,
            volumes: Vec::new(),
            volume_mounts: Vec::new(),
            instance_mounts: Vec::new(),
            gpu_devices: Vec::new(),
            host_ssh_user: String::new(),
            host_ssh_keys: Vec::new(),
            container_ssh_keys: Vec::new(),
        }
    }

    /// Checks what deserialization cannot: ranges, paths, references between fields.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.image_name.trim().is_empty() {
            return Err(err("image_name", "must not be empty"));
        }
        if self.gpu < -1 {
            return Err(err("gpu", "must be -1 (all), 0 or a positive count"));
        }
        if !self.cpu.is_finite() || self.cpu < 0.0 {
            return Err(err("cpu", "must be a finite number >= 0"));
        }
        if self.memory < 0 {
            return Err(err("memory", "must be >= 0"));
        }
        if self.shm_size < 0 {
            return Err(err("shm_size", "must be >= 0"));
        }
        if !valid_user_name(&self.host_ssh_user) {
            return Err(err(
                "host_ssh_user",
                "must not contain '/', a line break or NUL, nor be \".\" or \"..\"",
            ));
        }
        for (i, m) in self.volume_mounts.iter().enumerate() {
            absolute(&format!("volume_mounts[{i}].path"), &m.path)?;
            if !self.volumes.iter().any(|v| v.name == m.name) {
                return Err(err(
                    format!("volume_mounts[{i}].name"),
                    format!("no volume named {:?} in volumes", m.name.as_str()),
                ));
            }
        }
        for (i, m) in self.instance_mounts.iter().enumerate() {
            absolute(
                &format!("instance_mounts[{i}].instance_path"),
                &m.instance_path,
            )?;
            absolute(&format!("instance_mounts[{i}].path"), &m.path)?;
        }
        for (i, d) in self.gpu_devices.iter().enumerate() {
            absolute(&format!("gpu_devices[{i}].path_on_host"), &d.path_on_host)?;
            absolute(
                &format!("gpu_devices[{i}].path_in_container"),
                &d.path_in_container,
            )?;
        }
        for (i, v) in self.volumes.iter().enumerate() {
            // A backend this shim cannot attach, or a missing field, fails the task at start
            // (`VolumeSpec::problem`): only what could reach a path or a command is refused here.
            if v.volume_id.contains(['/', '\0', '\n']) || v.device_name.contains(['\0', '\n']) {
                return Err(err(
                    format!("volumes[{i}]"),
                    "contains a forbidden character",
                ));
            }
        }
        Ok(())
    }

    /// The same config without registry credentials: what may be persisted.
    pub fn without_credentials(&self) -> Self {
        Self {
            registry_username: String::new(),
            registry_password: Secret::default(),
            ..self.clone()
        }
    }

    /// The container user: `root` when empty.
    pub fn effective_user(&self) -> &str {
        if self.container_user.is_empty() {
            "root"
        } else {
            &self.container_user
        }
    }

    /// The host keys that are one plain OpenSSH public key each (written to authorized_keys),
    /// and the rejected ones with why (skipped and logged, never written: upstream skips them
    /// too, and a 400 would make the server retry the submit for minutes).
    pub fn host_keys(&self) -> (Vec<PublicKey>, Vec<InvalidKey>) {
        let mut valid = Vec::new();
        let mut invalid = Vec::new();
        for k in &self.host_ssh_keys {
            match k.parse() {
                Ok(key) => valid.push(key),
                Err(e) => invalid.push(e),
            }
        }
        (valid, invalid)
    }
}

fn absolute(field: &str, path: &str) -> Result<(), ConfigError> {
    if !path.starts_with('/') {
        return Err(err(field, format!("{path:?} is not an absolute path")));
    }
    if path.contains('\0') {
        return Err(err(field, "contains NUL"));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(err(field, format!("{path:?} contains '..'")));
    }
    Ok(())
}

/// A host user name as upstream takes it (any name the passwd database may hold, looked up at
/// start): only what could reach a path or a line is refused. Empty means "no user".
fn valid_user_name(s: &str) -> bool {
    !s.contains(['/', '\n', '\r', '\0']) && s != "." && s != ".."
}

/// An SSH key line as the server sends it (read from users' files without validation): any
/// text without a line break or NUL, so it can never inject a second line into a file or a
/// command.
#[derive(Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct KeyLine(String);

impl KeyLine {
    /// Checks that `s` holds no line break and no NUL.
    pub fn new(s: impl Into<String>) -> Result<Self, InvalidKey> {
        let s = s.into();
        if s.contains(['\n', '\r', '\0']) {
            return Err(InvalidKey {
                shown: s.chars().take(40).collect(),
                why: "contains a line break or NUL".to_owned(),
            });
        }
        Ok(Self(s))
    }

    /// The line as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The line as one plain OpenSSH public key, if it is one (no options, a known type,
    /// matching key data).
    pub fn parse(&self) -> Result<PublicKey, InvalidKey> {
        PublicKey::parse(&self.0)
    }
}

impl fmt::Debug for KeyLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl From<PublicKey> for KeyLine {
    fn from(k: PublicKey) -> Self {
        Self(k.line().to_owned())
    }
}

impl<'de> Deserialize<'de> for KeyLine {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::new(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl VolumeSpec {
    /// Why this shim cannot attach the volume, if it cannot: an unsupported backend, or a field
    /// its backend needs that is missing. Checked at start (the task then ends with
    /// `executor_error` naming the volume), not at submit, as upstream does.
    pub fn problem(&self) -> Option<String> {
        match &self.backend {
            VolumeBackend::Aws if self.volume_id.is_empty() => {
                Some("volume_id is required for the aws backend".to_owned())
            }
            VolumeBackend::Gcp if self.device_name.is_empty() => {
                Some("device_name is required for the gcp backend".to_owned())
            }
            VolumeBackend::Aws | VolumeBackend::Gcp => None,
            VolumeBackend::Other(b) if b.is_empty() => Some("no backend given".to_owned()),
            VolumeBackend::Other(b) => Some(format!(
                "backend {b:?} is not supported by this shim (aws and gcp are)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1C4oAsnzrPpqMilIIwxvatSq1HhXjaqM9ge9X3BgAe user@host";

    fn parse(v: serde_json::Value) -> Result<TaskConfig, String> {
        let c: TaskConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn defaults_and_unknown_fields() {
        let c = parse(serde_json::json!({
            "id": "t1", "name": "job", "image_name": "ubuntu",
            "volumes": null, "future_field": 1, "network_mode": "",
        }))
        .unwrap();
        assert_eq!(c.network_mode, NetworkMode::Host);
        assert_eq!(c.effective_user(), "root");
        assert_eq!(c.image_name, "ubuntu");
        assert!(c.volumes.is_empty());
    }

    #[test]
    fn rejects_bad_fields() {
        let base = serde_json::json!({"id": "t1", "name": "job", "image_name": "img"});
        let cases: &[(&str, serde_json::Value)] = &[
            ("id", serde_json::json!("../x")),
            ("name", serde_json::json!("a/b")),
            ("image_name", serde_json::json!("")),
            ("gpu", serde_json::json!(-2)),
            ("cpu", serde_json::json!(-0.5)),
            ("memory", serde_json::json!(-1)),
            ("shm_size", serde_json::json!(-1)),
            ("network_mode", serde_json::json!("none")),
            ("host_ssh_keys", serde_json::json!([format!("{KEY}\r")])),
            ("host_ssh_user", serde_json::json!("../root")),
            (
                "container_ssh_keys",
                serde_json::json!([format!("{KEY}\n{KEY}")]),
            ),
            (
                "instance_mounts",
                serde_json::json!([{"instance_path": "rel", "path": "/x"}]),
            ),
            (
                "gpu_devices",
                serde_json::json!([{"path_on_host": "/dev/x", "path_in_container": "x"}]),
            ),
        ];
        for (field, value) in cases {
            let mut v = base.clone();
            v[field] = value.clone();
            assert!(parse(v).is_err(), "{field} = {value}");
        }
        for missing in ["id", "name", "image_name"] {
            let mut v = base.clone();
            v.as_object_mut().unwrap().remove(missing);
            assert!(parse(v).is_err(), "missing {missing}");
        }
        // Upstream accepts these at submit and handles them at start (SPEC §2): keys that do
        // not parse are skipped, a missing user fails the key step, a volume this shim cannot
        // attach fails the task. upstream: runner/internal/shim/docker.go (Run: AppendPublicKeys
        // with user.Lookup at start), runner/internal/shim/backends (backend chosen at start).
        let mut v = base.clone();
        v["host_ssh_keys"] = serde_json::json!([KEY, "garbage", format!("command=\"x\" {KEY}")]);
        let c = parse(v.clone()).unwrap();
        let (valid, invalid) = c.host_keys();
        assert_eq!(valid.len(), 1);
        assert_eq!(invalid.len(), 2);
        v["host_ssh_user"] = serde_json::json!("john.doe@corp.example");
        parse(v).unwrap();
        let mut v = base.clone();
        v["volumes"] = serde_json::json!([
            {"backend": "azure", "name": "v1", "volume_id": "x"},
            {"backend": "gcp", "name": "v2"},
            {"name": "v3"},
            {"backend": "aws", "name": "v4", "volume_id": "vol-1"},
        ]);
        let c = parse(v).unwrap();
        let problems: Vec<Option<String>> = c.volumes.iter().map(VolumeSpec::problem).collect();
        assert!(
            problems[0]
                .as_deref()
                .unwrap()
                .contains("\"azure\" is not supported")
        );
        assert!(problems[1].as_deref().unwrap().contains("device_name"));
        assert!(problems[2].as_deref().unwrap().contains("no backend"));
        assert_eq!(problems[3], None);
    }

    #[test]
    fn password_never_serialized_or_shown() {
        let c = parse(serde_json::json!({
            "id": "t1", "name": "job", "image_name": "img",
            "registry_username": "u", "registry_password": "hunter2",
        }))
        .unwrap();
        assert_eq!(c.registry_password.expose(), "hunter2");
        assert!(!format!("{c:?}").contains("hunter2"));
        assert!(!serde_json::to_string(&c).unwrap().contains("hunter2"));
        let stripped = c.without_credentials();
        assert!(stripped.registry_username.is_empty());
        // A persisted config reads back.
        let back: TaskConfig =
            serde_json::from_str(&serde_json::to_string(&stripped).unwrap()).unwrap();
        assert_eq!(back, stripped);
    }
}
