//! Task configs and the names the shim derives from them, as the tests need them: a config as
//! the dstack server sends it, the container name of SPEC §6, the fake GPUs' ids, valid SSH
//! public keys, and what the answers about a task must look like.

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine as _;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

use super::shim::{FAKE_GPUS, RUNNER_HTTP_PORT, RUNNER_SSH_PORT};

/// A task config as the dstack server sends it: task `id` named `name`, `gpu` GPUs, bridge
/// network mode, the local test image ([`crate::image`]), run as root, nothing else set.
pub fn bridge_task(id: &str, name: &str, gpu: i64) -> Value {
    json!({
        "id": id,
        "name": name,
        "image_name": crate::image(),
        "gpu": gpu,
        "cpu": 0,
        "memory": 0,
        "shm_size": 0,
        "network_mode": "bridge",
        "container_user": "root",
        "privileged": false,
        "volumes": [],
        "volume_mounts": [],
        "instance_mounts": [],
        "host_ssh_user": "",
        "host_ssh_keys": [],
        "container_ssh_keys": [],
        "registry_username": "",
        "registry_password": "",
    })
}

/// [`bridge_task`] named for this run (`t-<id>-<run tag>`), with a field this shim does not
/// know, as newer servers send them (ignored).
pub fn server_task(id: &str, gpu: i64) -> Value {
    let mut config = bridge_task(id, &format!("t-{id}-{}", run_tag()), gpu);
    config["some_future_field"] = json!({"x": 1});
    config
}

/// The exact answer of a submit: the TaskInfo of the new task with the Go field names of
/// upstream's runner TaskInfo, which has no JSON tags (upstream:
/// runner/internal/shim/api/handlers.go, TaskSubmitHandler; runner/internal/shim/models.go).
pub fn pending_info(config: &Value) -> Value {
    let id = config["id"].as_str().unwrap_or_default();
    let name = config["name"].as_str().unwrap_or_default();
    json!({
        "ID": id,
        "Status": "pending",
        "TerminationReason": "",
        "TerminationMessage": "",
        "Ports": null,
        "ImagePullProgress": null,
        "ContainerName": container_name(name, id),
        "ContainerID": "",
        "GpuIDs": null,
    })
}

/// The published ports of a running bridge-mode task's `TaskInfo`, container port → host
/// port (never 0).
#[allow(
    clippy::panic,
    reason = "a test helper: an answer without ports fails the test"
)]
pub fn published_ports(info: &Value) -> BTreeMap<u16, u16> {
    let port = |p: &Value, key: &str| {
        let port = p[key].as_u64().and_then(|p| u16::try_from(p).ok());
        port.filter(|p| *p != 0)
            .unwrap_or_else(|| panic!("no {key} port in {info}"))
    };
    let ports = info["ports"].as_array();
    let ports = ports.unwrap_or_else(|| panic!("no ports: {info}"));
    ports
        .iter()
        .map(|p| (port(p, "container"), port(p, "host")))
        .collect()
}

/// Checks what a running task of a [`super::TestShim`] must look like, on the wire and in
/// Docker: the task of `config`, `running` with no reason, its container name and 64-digit id,
/// the runner's two ports published, `gpus` distinct fake GPUs; Docker runs the container under
/// that name with the task's label.
#[allow(
    clippy::panic,
    reason = "a test helper: a task that does not look running fails the test"
)]
pub fn assert_running(info: &Value, config: &Value, gpus: usize) {
    let id = config["id"].as_str().unwrap_or_default();
    let name = container_name(config["name"].as_str().unwrap_or_default(), id);
    assert_eq!(info["id"], id, "{info}");
    assert_eq!(info["status"], "running", "{info}");
    assert_eq!(info["termination_reason"], "", "{info}");
    assert_eq!(info["termination_message"], "", "{info}");
    assert_eq!(info["container_name"], name.as_str(), "{info}");
    let cid = info["container_id"].as_str().unwrap_or_default();
    assert_eq!(cid.len(), 64, "{info}");
    let published = published_ports(info);
    let published: Vec<u16> = published.keys().copied().collect();
    assert_eq!(published, [RUNNER_SSH_PORT, RUNNER_HTTP_PORT], "{info}");
    let ids = info["gpus_ids"].as_array();
    let ids: Vec<&str> = ids
        .unwrap_or_else(|| panic!("{info}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let distinct: BTreeSet<String> = ids.iter().map(|&g| g.to_owned()).collect();
    assert_eq!((ids.len(), distinct.len()), (gpus, gpus), "{info}");
    assert!(
        distinct.is_subset(&fake_gpu_ids()),
        "unknown GPU ids: {info}"
    );
    let format = "{{.Name}} {{.State.Running}} {{index .Config.Labels \"ai.dstack.shim.task-id\"}}";
    let inspected = super::docker_ok(&["inspect", "-f", format, cid]);
    assert_eq!(inspected.trim(), format!("/{name} true {id}"));
}

/// A tag unique to this test process (8 hex digits of its pid and start time): task names
/// carry it so that container names never clash with those an earlier, killed run left on the
/// daemon, or with another run's.
pub fn run_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let digest = Sha256::digest(format!("{}/{nanos}", std::process::id()).as_bytes());
        digest.iter().take(4).map(|b| format!("{b:02x}")).collect()
    })
}

/// The container name of task `id` named `name`: `<name>-<first 8 hex digits of
/// sha256("<name>/<id>")>` (SPEC §6).
pub fn container_name(name: &str, id: &str) -> String {
    let digest = Sha256::digest(format!("{name}/{id}").as_bytes());
    let hex: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    format!("{name}-{hex}")
}

/// The container name of the task of `config` (a task config as JSON).
pub fn container_name_of(config: &serde_json::Value) -> String {
    container_name(
        config["name"].as_str().unwrap_or_default(),
        config["id"].as_str().unwrap_or_default(),
    )
}

/// What ends every line the shim writes into `authorized_keys` (shim-resources' `MARKER`).
pub const KEY_MARKER: &str = "# added by dstack-shim";

/// The ids of the [`FAKE_GPUS`] fake GPUs of a [`super::TestShim`] (`--fake-gpus`).
pub fn fake_gpu_ids() -> BTreeSet<String> {
    (0..FAKE_GPUS)
        .map(|i| format!("GPU-00000000-0000-4000-8000-{i:012x}"))
        .collect()
}

/// A valid OpenSSH ed25519 public key line whose 32 key bytes derive from `comment`, which
/// ends the line.
pub fn ssh_key(comment: &str) -> String {
    let mut blob = Vec::new();
    blob.extend_from_slice(&11u32.to_be_bytes());
    blob.extend_from_slice(b"ssh-ed25519");
    blob.extend_from_slice(&32u32.to_be_bytes());
    blob.extend_from_slice(&Sha256::digest(comment.as_bytes()));
    let b64 = base64::engine::general_purpose::STANDARD.encode(blob);
    format!("ssh-ed25519 {b64} {comment}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keys_and_gpus_are_the_documented_ones() {
        // printf 'a/t1' | sha256sum | cut -c1-8
        assert_eq!(container_name("a", "t1"), "a-665b47b4");
        assert_eq!(fake_gpu_ids().len(), FAKE_GPUS);
        assert!(fake_gpu_ids().contains("GPU-00000000-0000-4000-8000-000000000003"));
        let key = ssh_key("me@host");
        let fields: Vec<&str> = key.split(' ').collect();
        assert_eq!((fields[0], fields[2]), ("ssh-ed25519", "me@host"));
        let blob = base64::engine::general_purpose::STANDARD
            .decode(fields[1])
            .unwrap_or_default();
        assert_eq!(blob.len(), 4 + 11 + 4 + 32);
        assert_eq!(bridge_task("t1", "a", 2)["gpu"], 2);
    }
}
