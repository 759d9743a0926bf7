//! CDI, the Container Device Interface (CNCF, `cncf-tags/container-device-interface`): the
//! host's spec files, which name devices as `vendor.com/class=name` and say what a container
//! needs to use each (device nodes, environment, mounts, hooks). NVIDIA's Container Toolkit
//! (1.18+: `nvidia-cdi-refresh` writes `/var/run/cdi/nvidia.yaml` at boot; the GPU Operator by
//! default since v25.10) and AMD's container toolkit (`/etc/cdi/amd.json`) write them; Docker
//! 25+ (CDI on by default from 28.2) and Podman apply them to a container asked for the
//! devices by name. The engine's edits are the engine's business: this module only reads which
//! devices a spec names and which device nodes each has, so the shim can ask for exactly the
//! GPUs its lock gave a task.
//!
//! Read, not validated: the fields the shim needs (`kind`, `devices[].name`, the device nodes
//! of each and of the spec), in JSON or YAML (`*.json`, `*.yaml`: not `*.yml`, which the CDI
//! library the engines vendor skips, `pkg/cdi/spec-dirs.go`), from the engine's
//! spec directories in order of precedence (a later directory's device of the same kind and
//! name replaces an earlier one's: `/var/run/cdi` over `/etc/cdi`, as the CDI registry
//! resolves them). A file that cannot be read or parsed is reported in
//! [`CdiRegistry::errors`] and skipped, as the engines' own registry does.
//!
//! Why not the `container-device-interface` crate (cncf-tags/container-device-interface-rs):
//! it validates and applies specs (JSON schema, OCI spec edits), which the engine does here; it
//! pulls `jsonschema`, `oci-spec` and `clap` for it. The shim needs four fields.
//!
//! Which name means a GPU the lock hands out ([`CdiRegistry::name_for`]): the device named by
//! the GPU's id (NVIDIA's UUID, `GPU-…`, which `nvidia-ctk` names every device by), else by
//! its index in `nvidia-smi`'s list (`0`: NVIDIA Container Toolkit 1.14+; `gpu0`: earlier
//! `nvidia-ctk`), else — for AMD, whose ids are render node paths — the device whose nodes
//! include that render node.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{GpuInfo, GpuVendor};

/// The CDI kind of NVIDIA GPUs.
pub const NVIDIA_KIND: &str = "nvidia.com/gpu";
/// The CDI kind of AMD GPUs.
pub const AMD_KIND: &str = "amd.com/gpu";

/// The CDI kind of a vendor's GPUs, if it has one the shim uses (NVIDIA, AMD).
pub fn kind_of(vendor: GpuVendor) -> Option<&'static str> {
    match vendor {
        GpuVendor::Nvidia => Some(NVIDIA_KIND),
        GpuVendor::Amd => Some(AMD_KIND),
        GpuVendor::Intel | GpuVendor::Tenstorrent => None,
    }
}

/// What a spec file says, as far as the shim reads it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecFile {
    #[serde(default)]
    cdi_version: String,
    kind: String,
    #[serde(default)]
    devices: Vec<DeviceFile>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DeviceFile {
    name: String,
    #[serde(default)]
    container_edits: EditsFile,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EditsFile {
    #[serde(default)]
    device_nodes: Vec<NodeFile>,
    #[serde(default)]
    env: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NodeFile {
    path: String,
    #[serde(default)]
    host_path: Option<String>,
}

/// One device of a CDI spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CdiDevice {
    /// Its name within its kind (`0`, `GPU-…`, `all`).
    pub name: String,
    /// Its device nodes: (path in the container, path on the host).
    pub nodes: Vec<(String, String)>,
    /// The environment it sets (`NAME=value`).
    pub env: Vec<String>,
    /// The spec file it came from.
    pub spec: PathBuf,
}

impl CdiDevice {
    /// Whether one of its nodes is `path` (in the container or on the host).
    pub fn has_node(&self, path: &str) -> bool {
        self.nodes.iter().any(|(c, h)| c == path || h == path)
    }
}

/// The devices of the host's CDI specs, by kind and name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CdiRegistry {
    kinds: BTreeMap<String, BTreeMap<String, CdiDevice>>,
    errors: Vec<String>,
    files: Vec<PathBuf>,
}

impl CdiRegistry {
    /// Reads every spec file of `dirs`, in order of increasing precedence (a missing
    /// directory is no error: a host without specs). Blocking (file IO).
    pub fn load(dirs: &[PathBuf]) -> Self {
        let mut registry = Self::default();
        // Which directory each device came from, and the devices two files of one directory
        // define: the CDI cache drops those (`resolveConflict`: same priority), so the engine
        // would refuse their names.
        let mut origins: BTreeMap<(String, String), usize> = BTreeMap::new();
        let mut conflicts: BTreeMap<(String, String), PathBuf> = BTreeMap::new();
        for (priority, dir) in dirs.iter().enumerate() {
            let entries = match fs_err::read_dir(dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    registry.errors.push(e.to_string());
                    continue;
                }
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    matches!(
                        p.extension().and_then(|x| x.to_str()),
                        Some("json" | "yaml")
                    )
                })
                .collect();
            files.sort();
            for file in files {
                for (kind, name) in registry.add_file(&file) {
                    // Once a conflict, always: the cache drops the device even where a
                    // directory of higher precedence defines it too (`refresh` deletes every
                    // conflicting name after its scan).
                    let key = (kind, name);
                    if origins.insert(key.clone(), priority) == Some(priority) {
                        conflicts.entry(key).or_insert_with(|| dir.clone());
                    }
                }
            }
        }
        for ((kind, name), dir) in conflicts {
            if let Some(devices) = registry.kinds.get_mut(&kind) {
                devices.remove(&name);
            }
            registry.errors.push(format!(
                "the CDI device {kind}={name} is defined by two spec files in {}: the engine \
                 refuses it",
                dir.display()
            ));
        }
        registry
    }

    /// Reads one spec file (a later one's device of the same kind and name replaces an
    /// earlier one's); the kinds and names of its devices.
    fn add_file(&mut self, path: &Path) -> Vec<(String, String)> {
        let text = match fs_err::read_to_string(path) {
            Ok(text) => text,
            Err(e) => {
                self.errors.push(e.to_string());
                return Vec::new();
            }
        };
        match parse_spec(path, &text) {
            Ok((kind, devices)) => {
                self.files.push(path.to_owned());
                let known = self.kinds.entry(kind.clone()).or_default();
                let mut names = Vec::new();
                for device in devices {
                    names.push((kind.clone(), device.name.clone()));
                    known.insert(device.name.clone(), device);
                }
                names
            }
            Err(why) => {
                self.errors.push(format!(
                    "cannot read the CDI spec {}: {why}",
                    path.display()
                ));
                Vec::new()
            }
        }
    }

    /// The devices of `kind`, by name (`None`: no spec names that kind).
    pub fn kind(&self, kind: &str) -> Option<&BTreeMap<String, CdiDevice>> {
        self.kinds.get(kind).filter(|d| !d.is_empty())
    }

    /// The spec files read.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// What could not be read (each a readable line).
    pub fn errors(&self) -> &[String] {
        &self.errors
    }

    /// The fully qualified CDI name (`kind=name`) that means `gpu` (see the module docs), if
    /// a spec of `kind` has one.
    pub fn name_for(&self, kind: &str, gpu: &GpuInfo) -> Option<String> {
        let devices = self.kind(kind)?;
        let by = |name: &str| devices.contains_key(name).then(|| format!("{kind}={name}"));
        if let Some(name) = by(&gpu.id) {
            return Some(name);
        }
        if gpu.vendor == GpuVendor::Amd
            && let Some(device) = devices.values().find(|d| d.has_node(&gpu.id))
        {
            return Some(format!("{kind}={}", device.name));
        }
        by(&gpu.index.to_string()).or_else(|| by(&format!("gpu{}", gpu.index)))
    }
}

/// Parses a spec file's text (JSON, or YAML of which JSON is a subset): its kind and devices.
fn parse_spec(path: &Path, text: &str) -> Result<(String, Vec<CdiDevice>), String> {
    let file: SpecFile = if path.extension().and_then(|x| x.to_str()) == Some("json") {
        serde_json::from_str(text).map_err(|e| e.to_string())?
    } else {
        yaml_serde::from_str(text).map_err(|e| e.to_string())?
    };
    if file.cdi_version.is_empty() {
        return Err("no cdiVersion".to_owned());
    }
    let valid_kind = file
        .kind
        .split_once('/')
        .is_some_and(|(vendor, class)| !vendor.is_empty() && !class.is_empty());
    if !valid_kind {
        return Err(format!("invalid kind {:?}", file.kind));
    }
    let devices = file
        .devices
        .into_iter()
        .map(|d| CdiDevice {
            nodes: d
                .container_edits
                .device_nodes
                .into_iter()
                .map(|n| {
                    let host = n.host_path.unwrap_or_else(|| n.path.clone());
                    (n.path, host)
                })
                .collect(),
            env: d.container_edits.env,
            name: d.name,
            spec: path.to_owned(),
        })
        .collect();
    Ok((file.kind, devices))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(vendor: GpuVendor, id: &str, index: u32) -> GpuInfo {
        GpuInfo {
            vendor,
            name: "x".into(),
            memory_mib: 0,
            id: id.into(),
            index,
        }
    }

    fn registry(files: &[(&str, &str)]) -> (tempfile::TempDir, CdiRegistry) {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            fs_err::write(dir.path().join(name), text).unwrap();
        }
        let r = CdiRegistry::load(&[dir.path().to_owned()]);
        (dir, r)
    }

    const BY_INDEX_AND_UUID: &str = "---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n- name: GPU-aaaa\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n- name: \"1\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia1\n- name: all\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n    - path: /dev/nvidia1\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/nvidiactl\n";

    #[test]
    fn the_uuid_first_then_the_index_then_the_old_name() {
        let (_d, r) = registry(&[("nvidia.yaml", BY_INDEX_AND_UUID)]);
        assert!(r.errors().is_empty(), "{:?}", r.errors());
        let nv = |id: &str, i| r.name_for(NVIDIA_KIND, &gpu(GpuVendor::Nvidia, id, i));
        assert_eq!(
            nv("GPU-aaaa", 0).as_deref(),
            Some("nvidia.com/gpu=GPU-aaaa")
        );
        assert_eq!(nv("GPU-bbbb", 1).as_deref(), Some("nvidia.com/gpu=1"));
        assert_eq!(nv("GPU-cccc", 2), None, "not in the spec");
        let (_d, old) = registry(&[(
            "nvidia.yaml",
            "cdiVersion: 0.3.0\nkind: nvidia.com/gpu\ndevices:\n- name: gpu0\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n",
        )]);
        assert_eq!(
            old.name_for(NVIDIA_KIND, &gpu(GpuVendor::Nvidia, "GPU-x", 0))
                .as_deref(),
            Some("nvidia.com/gpu=gpu0")
        );
        assert_eq!(
            r.name_for(AMD_KIND, &gpu(GpuVendor::Amd, "/dev/dri/renderD128", 0)),
            None
        );
    }

    /// A spec named `*.yml` is not read, as the engines' CDI library does not read it
    /// (`pkg/cdi/spec-dirs.go`: `.json` and `.yaml` only): read, it made the shim ask for
    /// devices the engine cannot resolve, or, beside a `*.yaml` with the same names, dropped
    /// them all as conflicts.
    #[test]
    fn a_yml_spec_is_not_read_as_the_engines_do_not_read_it() {
        let (_d, r) = registry(&[("nvidia.yml", BY_INDEX_AND_UUID)]);
        assert!(r.kind(NVIDIA_KIND).is_none());
        let both = [
            ("nvidia.yml", BY_INDEX_AND_UUID),
            ("nvidia.yaml", BY_INDEX_AND_UUID),
        ];
        let (_d, r) = registry(&both);
        let nv = r.name_for(NVIDIA_KIND, &gpu(GpuVendor::Nvidia, "GPU-aaaa", 0));
        assert_eq!(nv.as_deref(), Some("nvidia.com/gpu=GPU-aaaa"));
    }

    #[test]
    fn amd_devices_by_their_render_node() {
        let (_d, r) = registry(&[(
            "amd.json",
            r#"{"cdiVersion":"0.6.0","kind":"amd.com/gpu","devices":[
              {"name":"0","containerEdits":{"deviceNodes":[{"path":"/dev/dri/card1"},{"path":"/dev/dri/renderD129"}]}},
              {"name":"1","containerEdits":{"deviceNodes":[{"path":"/dev/dri/card0"},{"path":"/dev/dri/renderD128"}]}}],
              "containerEdits":{"deviceNodes":[{"path":"/dev/kfd"}]}}"#,
        )]);
        assert!(r.errors().is_empty(), "{:?}", r.errors());
        let amd = |node: &str, i| r.name_for(AMD_KIND, &gpu(GpuVendor::Amd, node, i));
        assert_eq!(
            amd("/dev/dri/renderD128", 0).as_deref(),
            Some("amd.com/gpu=1")
        );
        assert_eq!(
            amd("/dev/dri/renderD129", 1).as_deref(),
            Some("amd.com/gpu=0")
        );
    }

    #[test]
    fn later_dirs_win_and_bad_files_are_reported_not_fatal() {
        let low = tempfile::tempdir().unwrap();
        let high = tempfile::tempdir().unwrap();
        let spec = |host: &str| {
            format!(
                "{{\"cdiVersion\":\"0.5.0\",\"kind\":\"nvidia.com/gpu\",\"devices\":[{{\"name\":\"0\",\"containerEdits\":{{\"deviceNodes\":[{{\"path\":\"/dev/nvidia0\",\"hostPath\":\"{host}\"}}]}}}}]}}"
            )
        };
        fs_err::write(low.path().join("a.json"), spec("/low")).unwrap();
        fs_err::write(high.path().join("b.json"), spec("/high")).unwrap();
        fs_err::write(high.path().join("broken.yaml"), "kind: [").unwrap();
        fs_err::write(high.path().join("notes.txt"), "not a spec").unwrap();
        let r = CdiRegistry::load(&[
            low.path().to_owned(),
            high.path().to_owned(),
            "/nonexistent/cdi".into(),
        ]);
        let device = &r.kind(NVIDIA_KIND).unwrap()["0"];
        assert_eq!(
            device.nodes,
            [("/dev/nvidia0".to_owned(), "/high".to_owned())]
        );
        assert_eq!(r.errors().len(), 1, "{:?}", r.errors());
        assert!(r.errors()[0].contains("broken.yaml"), "{:?}", r.errors());
        assert_eq!(r.files().len(), 2);
        assert!(r.kind(AMD_KIND).is_none());
    }

    /// Two spec files of one directory naming one device (`nvidia.yaml` and `nvidia.json`
    /// both written): the CDI cache drops such a device (same priority: a conflict), so the
    /// engine would refuse its name; it is not offered, and the error says why. A directory
    /// of higher precedence that names it too does not settle it: the cache deletes every
    /// conflicting name after its scan (container-device-interface `cache.go`, `refresh`).
    #[test]
    fn a_device_two_files_of_one_directory_name_is_not_offered() {
        let dir = tempfile::tempdir().unwrap();
        let spec = "{\"cdiVersion\":\"0.5.0\",\"kind\":\"nvidia.com/gpu\",\"devices\":[{\"name\":\"0\",\"containerEdits\":{\"deviceNodes\":[{\"path\":\"/dev/nvidia0\"}]}},{\"name\":\"1\",\"containerEdits\":{\"deviceNodes\":[{\"path\":\"/dev/nvidia1\"}]}}]}";
        let only_one = spec.replace(
            ",{\"name\":\"1\",\"containerEdits\":{\"deviceNodes\":[{\"path\":\"/dev/nvidia1\"}]}}",
            "",
        );
        fs_err::write(dir.path().join("nvidia.json"), spec).unwrap();
        fs_err::write(dir.path().join("other.json"), &only_one).unwrap();
        let higher = tempfile::tempdir().unwrap();
        fs_err::write(higher.path().join("nvidia.json"), &only_one).unwrap();
        for dirs in [
            vec![dir.path().to_owned()],
            vec![dir.path().to_owned(), higher.path().to_owned()],
        ] {
            let r = CdiRegistry::load(&dirs);
            let names: Vec<&String> = r.kind(NVIDIA_KIND).unwrap().keys().collect();
            assert_eq!(names, ["1"], "{dirs:?}");
            let said = r.errors().iter().any(|e| e.contains("nvidia.com/gpu=0"));
            assert!(said, "{dirs:?}: {:?}", r.errors());
        }
    }
}
