//! Conversions between bollard's models and this crate's types.

use std::collections::HashMap;

use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, DeviceMapping as DockerDevice,
    DeviceRequest as DockerDeviceRequest, EventMessage, HostConfig, Mount, MountType, PortBinding,
    PortMap, ResourcesUlimits,
};

use crate::spec::{ContainerSpec, DeviceMapping, DeviceRequest, NetworkMode};
use crate::types::{
    ContainerDetails, ContainerEvent, ContainerState, ContainerSummary, EventKind, MountPoint,
    PublishedPort,
};

/// A container list entry.
pub(super) fn summary(c: bollard::models::ContainerSummary) -> ContainerSummary {
    ContainerSummary {
        id: c.id.unwrap_or_default(),
        name: c
            .names
            .and_then(|n| n.into_iter().next())
            .map(|n| strip_slash(&n))
            .unwrap_or_default(),
        state: c.state.map_or(ContainerState::Other(String::new()), |s| {
            ContainerState::parse(s.as_ref())
        }),
        labels: c.labels.unwrap_or_default().into_iter().collect(),
        ports: summary_ports(c.ports.as_deref().unwrap_or_default()),
        mounts: mounts(c.mounts),
    }
}

/// A container's mounts (list entry and inspect alike).
fn mounts(mounts: Option<Vec<bollard::models::MountPoint>>) -> Vec<MountPoint> {
    mounts
        .unwrap_or_default()
        .into_iter()
        .map(|m| MountPoint {
            source: m.source.unwrap_or_default(),
            destination: m.destination.unwrap_or_default(),
            read_write: m.rw.unwrap_or(false),
        })
        .collect()
}

/// Docker's label filters: `key=value`, or `key` alone (the label is present) for an empty
/// value.
pub(super) fn label_filters(labels: &[(String, String)]) -> HashMap<String, Vec<String>> {
    let values = labels
        .iter()
        .map(|(k, v)| {
            if v.is_empty() {
                k.clone()
            } else {
                format!("{k}={v}")
            }
        })
        .collect();
    HashMap::from([("label".to_owned(), values)])
}

/// The IPv4 host bindings of a container list entry, sorted.
fn summary_ports(ports: &[bollard::models::PortSummary]) -> Vec<PublishedPort> {
    let mut out: Vec<PublishedPort> = ports
        .iter()
        .filter(|p| {
            p.ip.as_deref()
                .is_some_and(|ip| ip.parse::<std::net::Ipv4Addr>().is_ok())
        })
        .filter_map(|p| {
            Some(PublishedPort {
                container: p.private_port,
                host: p.public_port?,
            })
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Docker's "zero time" for never started/finished containers.
fn docker_time(t: Option<String>) -> Option<String> {
    t.filter(|t| !t.is_empty() && !t.starts_with("0001-01-01"))
}

fn strip_slash(name: &str) -> String {
    name.strip_prefix('/').unwrap_or(name).to_owned()
}

/// The IPv4 port bindings of a port map, as (container, host) pairs, sorted.
fn published_ports(ports: Option<&PortMap>) -> Vec<PublishedPort> {
    let mut out = Vec::new();
    for (key, bindings) in ports.into_iter().flatten() {
        let Some(container) = key.split('/').next().and_then(|p| p.parse::<u16>().ok()) else {
            continue;
        };
        for binding in bindings.iter().flatten() {
            let ipv4 = binding
                .host_ip
                .as_deref()
                .is_none_or(|ip| ip.is_empty() || ip.parse::<std::net::Ipv4Addr>().is_ok());
            let host = binding
                .host_port
                .as_deref()
                .and_then(|p| p.parse::<u16>().ok());
            if let (true, Some(host)) = (ipv4, host) {
                out.push(PublishedPort { container, host });
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Builds Docker's create body from a spec.
///
/// Bind mounts go in `HostConfig.Mounts` with type `bind`, as upstream makes them
/// (runner/internal/shim/docker.go: `mount.Mount{Type: mount.TypeBind, ..}`), never in
/// `HostConfig.Binds`: for a `Binds` entry whose source is missing, Docker creates a directory
/// there (a missing runner binary would become a directory at its path, and every later
/// install of it would fail); for a `Mounts` entry it refuses the create ("bind source path
/// does not exist"), which fails the task with its cause. `/dev/shm` stays in
/// `HostConfig.Tmpfs`: tmpfs options in `Mounts` need API 1.46, and Docker 20.10 ignores them.
pub(super) fn create_body(spec: &ContainerSpec) -> ContainerCreateBody {
    let mounts: Vec<Mount> = spec
        .mounts
        .iter()
        .map(|m| Mount {
            typ: Some(MountType::BIND),
            source: Some(m.source.to_string_lossy().into_owned()),
            target: Some(m.target.clone()),
            read_only: Some(m.read_only),
            ..Mount::default()
        })
        .collect();
    let bridge = spec.network == NetworkMode::Bridge;
    let exposed: Vec<String> = if bridge {
        spec.published_ports
            .iter()
            .map(|p| format!("{p}/tcp"))
            .collect()
    } else {
        Vec::new()
    };
    let port_bindings: PortMap = exposed
        .iter()
        .map(|key| {
            (
                key.clone(),
                Some(vec![PortBinding {
                    host_ip: Some("127.0.0.1".to_owned()),
                    host_port: Some(String::new()),
                }]),
            )
        })
        .collect();
    let opt_vec = |v: Vec<String>| (!v.is_empty()).then_some(v);
    let host_config = HostConfig {
        mounts: (!mounts.is_empty()).then_some(mounts),
        network_mode: Some(spec.network.as_str().to_owned()),
        port_bindings: (!port_bindings.is_empty()).then_some(port_bindings),
        nano_cpus: (spec.nano_cpus > 0).then_some(spec.nano_cpus),
        memory: (spec.memory > 0).then_some(spec.memory),
        privileged: Some(spec.privileged),
        shm_size: spec.shm_size,
        tmpfs: (!spec.tmpfs.is_empty()).then(|| {
            spec.tmpfs
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        }),
        devices: (!spec.devices.is_empty()).then(|| {
            spec.devices
                .iter()
                .map(|d| DockerDevice {
                    path_on_host: Some(d.path_on_host.clone()),
                    path_in_container: Some(d.path_in_container.clone()),
                    cgroup_permissions: Some(d.cgroup_permissions.clone()),
                })
                .collect()
        }),
        device_requests: (!spec.device_requests.is_empty()).then(|| {
            spec.device_requests
                .iter()
                .map(|r| DockerDeviceRequest {
                    driver: Some(r.driver.clone()),
                    device_ids: Some(r.device_ids.clone()),
                    capabilities: Some(vec![r.capabilities.clone()]),
                    ..DockerDeviceRequest::default()
                })
                .collect()
        }),
        cap_add: opt_vec(spec.cap_add.clone()),
        ipc_mode: spec.ipc_mode.clone(),
        security_opt: opt_vec(spec.security_opt.clone()),
        runtime: spec.runtime.clone(),
        ulimits: (!spec.ulimits.is_empty()).then(|| {
            spec.ulimits
                .iter()
                .map(|u| ResourcesUlimits {
                    name: Some(u.name.clone()),
                    soft: Some(u.soft),
                    hard: Some(u.hard),
                })
                .collect()
        }),
        ..HostConfig::default()
    };
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        entrypoint: opt_vec(spec.entrypoint.clone()),
        cmd: opt_vec(spec.cmd.clone()),
        labels: Some(
            spec.labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
        env: opt_vec(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        user: (!spec.user.is_empty()).then(|| spec.user.clone()),
        exposed_ports: opt_vec(exposed),
        host_config: Some(host_config),
        ..ContainerCreateBody::default()
    }
}

pub(super) fn details(resp: ContainerInspectResponse) -> ContainerDetails {
    let state = resp.state.unwrap_or_default();
    let host = resp.host_config.unwrap_or_default();
    let config = resp.config.unwrap_or_default();
    ContainerDetails {
        id: resp.id.unwrap_or_default(),
        name: strip_slash(resp.name.as_deref().unwrap_or_default()),
        image: config.image.unwrap_or_default(),
        state: state
            .status
            .map_or(ContainerState::Other(String::new()), |s| {
                ContainerState::parse(s.as_ref())
            }),
        exit_code: state.exit_code,
        error: state.error.unwrap_or_default(),
        oom_killed: state.oom_killed.unwrap_or(false),
        started_at: docker_time(state.started_at),
        finished_at: docker_time(state.finished_at),
        labels: config.labels.unwrap_or_default().into_iter().collect(),
        ports: published_ports(
            resp.network_settings
                .as_ref()
                .and_then(|n| n.ports.as_ref()),
        ),
        mounts: mounts(resp.mounts),
        env: config.env.unwrap_or_default(),
        device_requests: host
            .device_requests
            .unwrap_or_default()
            .into_iter()
            .map(|r| DeviceRequest {
                driver: r.driver.unwrap_or_default(),
                device_ids: r.device_ids.unwrap_or_default(),
                capabilities: r
                    .capabilities
                    .unwrap_or_default()
                    .into_iter()
                    .flatten()
                    .collect(),
            })
            .collect(),
        devices: host
            .devices
            .unwrap_or_default()
            .into_iter()
            .map(|d| DeviceMapping {
                path_on_host: d.path_on_host.unwrap_or_default(),
                path_in_container: d.path_in_container.unwrap_or_default(),
                cgroup_permissions: d.cgroup_permissions.unwrap_or_default(),
            })
            .collect(),
        network_mode: host.network_mode.unwrap_or_default(),
        nano_cpus: host.nano_cpus.unwrap_or(0),
        memory: host.memory.unwrap_or(0),
        privileged: host.privileged.unwrap_or(false),
        shm_size: host.shm_size.unwrap_or(0),
        tmpfs: host.tmpfs.unwrap_or_default().into_iter().collect(),
        user: config.user.unwrap_or_default(),
    }
}

pub(super) fn container_event(msg: EventMessage) -> Option<ContainerEvent> {
    let mut actor = msg.actor?;
    let container_id = actor.id?;
    let attributes = actor.attributes.take().unwrap_or_default();
    let kind = match msg.action.as_deref()? {
        "die" => EventKind::Die {
            exit_code: attributes
                .get("exitCode")
                .and_then(|c| c.parse::<i64>().ok()),
        },
        "oom" => EventKind::Oom,
        "destroy" => EventKind::Destroy,
        _ => return None,
    };
    let name = attributes
        .get("name")
        .map(|n| strip_slash(n))
        .unwrap_or_default();
    let time_ns = msg
        .time_nano
        .or_else(|| msg.time.map(|t| t.saturating_mul(1_000_000_000)))
        .unwrap_or(0);
    Some(ContainerEvent {
        container_id,
        name,
        kind,
        // Docker puts the labels among the attributes, with name, image and exitCode.
        labels: attributes.into_iter().collect(),
        time_ns,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn ports_ipv4_only() {
        let map: PortMap = HashMap::from([
            (
                "10999/tcp".to_owned(),
                Some(vec![
                    PortBinding {
                        host_ip: Some("127.0.0.1".to_owned()),
                        host_port: Some("32770".to_owned()),
                    },
                    PortBinding {
                        host_ip: Some("::1".to_owned()),
                        host_port: Some("32771".to_owned()),
                    },
                ]),
            ),
            ("10022/tcp".to_owned(), None),
        ]);
        assert_eq!(
            published_ports(Some(&map)),
            [PublishedPort {
                container: 10999,
                host: 32770
            }]
        );
        assert!(published_ports(None).is_empty());
    }

    #[test]
    fn body_bridge_and_shm() {
        let spec = ContainerSpec {
            name: "n".to_owned(),
            image: "i:1".to_owned(),
            network: NetworkMode::Bridge,
            published_ports: vec![10999],
            shm_size: Some(1 << 20),
            tmpfs: BTreeMap::from([("/dev/shm".to_owned(), "exec,size=1048576".to_owned())]),
            mounts: vec![crate::spec::BindMount {
                source: "/a".into(),
                target: "/b".to_owned(),
                read_only: true,
            }],
            ..ContainerSpec::default()
        };
        let body = create_body(&spec);
        let host = body.host_config.unwrap();
        assert_eq!(
            host.binds, None,
            "never Binds: Docker would create a missing source"
        );
        let mounts = host.mounts.unwrap();
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].typ, Some(MountType::BIND));
        assert_eq!(mounts[0].source.as_deref(), Some("/a"));
        assert_eq!(mounts[0].target.as_deref(), Some("/b"));
        assert_eq!(mounts[0].read_only, Some(true));
        assert_eq!(host.shm_size, Some(1 << 20));
        assert_eq!(host.tmpfs.unwrap()["/dev/shm"], "exec,size=1048576");
        let bindings = host.port_bindings.unwrap();
        let b = &bindings["10999/tcp"].as_ref().unwrap()[0];
        assert_eq!(b.host_ip.as_deref(), Some("127.0.0.1"));
        assert_eq!(b.host_port.as_deref(), Some(""));
        assert_eq!(body.exposed_ports.unwrap(), ["10999/tcp"]);

        let host_mode = create_body(&ContainerSpec {
            network: NetworkMode::Host,
            ..spec
        });
        assert!(host_mode.exposed_ports.is_none());
        assert!(host_mode.host_config.unwrap().port_bindings.is_none());
    }
}
