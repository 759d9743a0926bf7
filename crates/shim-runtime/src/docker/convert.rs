//! Conversions between bollard's models and this crate's types.

use std::collections::{BTreeMap, HashMap};

use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, DeviceMapping as DockerDevice,
    DeviceRequest as DockerDeviceRequest, EventMessage, EventMessageTypeEnum, HostConfig,
    HostConfigLogConfig, Mount, MountType, PortBinding, PortMap, ResourcesUlimits,
};
use serde_json::Value;

use shim_task::NetworkMode;

use crate::spec::{ContainerSpec, DeviceMapping, DeviceRequest, LogLimits};
use crate::types::{
    ContainerDetails, ContainerEvent, ContainerState, ContainerSummary, EventKind, MountPoint,
    PublishedPort, has_labels,
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

/// The one server-side label filter a list asks for: a pre-filter that can only narrow
/// correctly, whatever the engine; [`has_labels`] then checks every label in the shim.
///
/// One filter, because Podman ORs several `label=` filters where Docker ANDs them (DESIGN,
/// "Engines beyond this machine's Docker"): with one, both mean the same. A `key=value` label
/// if there is one (exact match is what every engine implements); else `key` alone, which
/// Docker and Podman's list both read as "the label is present" (Podman 4.3:
/// vendor/github.com/containers/common/pkg/filters/filters.go, `MatchLabelFilters`). An
/// engine that ignored it would only answer more, which the shim's own check removes. No
/// labels: no filter.
pub(super) fn list_prefilter(labels: &[(String, String)]) -> HashMap<String, Vec<String>> {
    let pick = labels
        .iter()
        .find(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={v}"))
        .or_else(|| labels.first().map(|(k, _)| k.clone()));
    pick.map(|f| HashMap::from([("label".to_owned(), vec![f])]))
        .unwrap_or_default()
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
///
/// The log's bounds become `HostConfig.LogConfig` ([`log_config`]); without them the
/// container has none and the daemon's own log configuration applies.
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
        // In the host's IPC namespace (AMD, Gaudi) Docker ignores the size and Podman refuses
        // the create ("cannot set shmsize when running in the host IPC Namespace"): the
        // `/dev/shm` tmpfs below carries it.
        shm_size: spec
            .shm_size
            .filter(|_| spec.ipc_mode.as_deref() != Some("host")),
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
                    // A CDI request names devices only (`[[]]` would ask for a capability set).
                    capabilities: (!r.capabilities.is_empty())
                        .then(|| vec![r.capabilities.clone()]),
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
        log_config: spec.log.as_ref().map(log_config),
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

/// Docker's log configuration for bounded logs: the `json-file` driver with `max-size` (in
/// bytes, which Docker and Podman read alike) and `max-file`. Podman takes `json-file` as its
/// `k8s-file` and honours `max-size` there; `max-file` is an option it ignores.
fn log_config(limits: &LogLimits) -> HostConfigLogConfig {
    HostConfigLogConfig {
        typ: Some(LogLimits::DRIVER.to_owned()),
        config: Some(
            limits
                .options()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect(),
        ),
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
        pid: state
            .pid
            .and_then(|p| u32::try_from(p).ok())
            .filter(|&p| p > 0),
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

/// Takes the state string at `pointer` out of `value`, leaving `null` (which bollard reads as
/// "absent") in its place.
fn take_state(value: &mut Value, pointer: &str) -> Option<String> {
    let slot = value.pointer_mut(pointer)?;
    match slot.take() {
        Value::String(s) => Some(s),
        other => {
            *slot = other;
            None
        }
    }
}

/// An inspect answer that bollard could not read, read again without its state: bollard's
/// state enum fails on a state it does not know (Podman 4.3's `stopped` and `unknown`), which
/// would make the whole inspect an error. The state string is kept as this crate reads it
/// ([`ContainerState::parse`]: an unknown one is [`ContainerState::Other`], a state to wait
/// on). Errors only where more than the state is unreadable.
pub(super) fn details_from_json(json: &str) -> serde_json::Result<ContainerDetails> {
    let mut value: Value = serde_json::from_str(json)?;
    let state = take_state(&mut value, "/State/Status");
    let mut d = details(serde_json::from_value(value)?);
    if let Some(state) = state {
        d.state = ContainerState::parse(&state);
    }
    Ok(d)
}

/// A list answer that bollard could not read, read again without the entries' states (see
/// [`details_from_json`]): one container in a state bollard does not know, anyone's, would
/// otherwise make the whole list an error.
pub(super) fn summaries_from_json(json: &str) -> serde_json::Result<Vec<ContainerSummary>> {
    let mut value: Value = serde_json::from_str(json)?;
    let states: Vec<Option<String>> = match value.as_array_mut() {
        Some(entries) => entries
            .iter_mut()
            .map(|e| take_state(e, "/State"))
            .collect(),
        None => Vec::new(),
    };
    let entries: Vec<bollard::models::ContainerSummary> = serde_json::from_value(value)?;
    Ok(entries
        .into_iter()
        .zip(states.into_iter().chain(std::iter::repeat(None)))
        .map(|(c, state)| {
            let mut s = summary(c);
            if let Some(state) = state {
                s.state = ContainerState::parse(&state);
            }
            s
        })
        .collect())
}

/// The events a subscription asks the engine for: `type=container` and `type=image` (an image's
/// removal tells the engine's cache of images seen present that one may be gone), the one
/// event filter every engine honours; and on Docker (`by_name`) only the events
/// [`container_event`] keeps, by their names ([`DOCKER_ACTIONS`]), so that the daemon does not
/// encode, nor the shim decode, every container's `create`, `start`, `kill` and `stop` (two of
/// them a task start, with all the container's labels in each). The label filter stays the
/// shim's ([`container_event`]), and on Podman the names too: Podman's event filter on a label
/// key alone matches nothing (Podman 4.3: libpod/events/filters.go, a `label` filter without
/// `=` is false), and it matches event names against its own (`died`, not `die`).
pub(super) fn event_filters(by_name: bool) -> HashMap<String, Vec<String>> {
    let mut filters = HashMap::from([(
        "type".to_owned(),
        vec!["container".to_owned(), "image".to_owned()],
    )]);
    if by_name {
        let names = DOCKER_ACTIONS.iter().map(|a| (*a).to_owned()).collect();
        filters.insert("event".to_owned(), names);
    }
    filters
}

/// Docker's names of the events [`container_event`] keeps: a container's exit, OOM kill and
/// removal; an image's untag, deletion and prune. Docker matches an `event` filter against the
/// action exactly (daemon/events/filter.go, `matchEvent`), whatever the type, and the names of
/// the two types do not overlap.
const DOCKER_ACTIONS: [&str; 6] = ["die", "oom", "destroy", "untag", "delete", "prune"];

/// How much earlier than asked the engine is asked for events (see [`since_param`]).
const SINCE_MARGIN_NS: i64 = 1_000_000;

/// The `since` an event subscription sends for events from `since_ns` on (Unix nanoseconds,
/// the instant itself included): a millisecond earlier, as `seconds.nanoseconds`.
///
/// Engines differ at the edge: Docker keeps events at or after `since` (nanoseconds exact);
/// Podman reads `since` as a float (about 240 ns apart at today's times) and keeps only events
/// strictly after it (Podman 4.3 and 5.x: pkg/util/utils.go `ParseInputTime`,
/// libpod/events/filters.go `generateEventSinceOption`), so the event at `since_ns` itself, or
/// one a few hundred nanoseconds later, may be left out. The margin makes every engine send
/// them; [`container_event`] drops what is earlier than `since_ns`.
pub(super) fn since_param(since_ns: i64) -> String {
    let asked = since_ns.saturating_sub(SINCE_MARGIN_NS).max(0);
    format!(
        "{}.{:09}",
        asked.div_euclid(1_000_000_000),
        asked.rem_euclid(1_000_000_000)
    )
}

/// An event's time in Unix nanoseconds, or `None` when only the replay's margin brought it
/// (see [`since_param`]): earlier than `since_ns` by at most the margin. An event with seconds
/// only is dropped only in an earlier second that the margin reaches. An event earlier still
/// was not replayed (the engine was not asked for it): it is a live one, stamped by a clock
/// that was stepped back since the subscription's `since` was read, and it is kept.
fn event_time_ns(time_nano: Option<i64>, time: Option<i64>, since_ns: i64) -> Option<i64> {
    let asked = since_ns.saturating_sub(SINCE_MARGIN_NS);
    let early = match (time_nano, time) {
        (Some(ns), _) => asked <= ns && ns < since_ns,
        (None, Some(secs)) => {
            secs < since_ns.div_euclid(1_000_000_000) && secs >= asked.div_euclid(1_000_000_000)
        }
        (None, None) => false,
    };
    if early {
        return None;
    }
    Some(
        time_nano
            .or_else(|| time.map(|t| t.saturating_mul(1_000_000_000)))
            .unwrap_or(0),
    )
}

/// The keys of `labels` (an image's) that would stand for the exit code in a `die` event of a
/// container made of it on Docker, which copies the labels among the event's attributes after
/// its `exitCode` (moby daemon/events.go, `LogContainerEventWithAttributes`): `exitCode`,
/// and with it `containerExitCode`, which [`exit_code`] reads next. Empty when the image has
/// no `exitCode` label.
pub(super) fn shadowed_exit_labels(labels: Option<&HashMap<String, String>>) -> Vec<String> {
    let Some(labels) = labels.filter(|l| l.contains_key("exitCode")) else {
        return Vec::new();
    };
    EXIT_CODE_KEYS
        .iter()
        .filter(|key| labels.contains_key(**key))
        .map(|key| (*key).to_owned())
        .collect()
}

/// The attributes of a `die` event that may hold the exit code, in the order they are read.
const EXIT_CODE_KEYS: [&str; 2] = ["exitCode", "containerExitCode"];

/// The exit code of a `die` event: Docker's `exitCode` attribute, or Podman's
/// `containerExitCode` (Podman's compat API copies it into `exitCode` when it renames `died`
/// to `die`, pkg/api/handlers/compat/events.go; an event that kept its libpod name has only
/// `containerExitCode`).
fn exit_code(attributes: &HashMap<String, String>) -> Option<i64> {
    EXIT_CODE_KEYS
        .iter()
        .find_map(|key| attributes.get(*key)?.parse::<i64>().ok())
}

/// One engine event as the shim sees it: a container event among this subscription's
/// (`labels` checked as [`crate::ContainerRuntime::events`] says, on the labels the engine
/// puts among the actor's attributes; not earlier than `since_ns`, which the engine was asked
/// for with a margin: [`since_param`]) whose action is an exit, an OOM kill or a removal, in
/// Docker's names or Podman's (`died`, and `remove` for Docker's `destroy`: libpod's
/// events/config.go statuses `Exited` and `Remove`); or an image's removal
/// ([`EventKind::ImageRemoved`], whatever the labels). Anything else: `None`. An event without
/// a time is kept.
pub(super) fn container_event(
    msg: EventMessage,
    labels: &[(String, String)],
    since_ns: i64,
) -> Option<ContainerEvent> {
    let image = match msg.typ {
        Some(EventMessageTypeEnum::CONTAINER) | None => false,
        Some(EventMessageTypeEnum::IMAGE) => true,
        Some(_) => return None,
    };
    let mut actor = msg.actor?;
    let container_id = actor.id?;
    let attributes = actor.attributes.take().unwrap_or_default();
    if image {
        // An image's removal, whatever labels were asked for (an image carries none of a
        // task's): Docker `untag`, `delete`, `prune`; Podman `untag`, `remove`.
        if !matches!(
            msg.action.as_deref()?,
            "untag" | "delete" | "prune" | "remove"
        ) {
            return None;
        }
        let name = attributes
            .get("name")
            .cloned()
            .unwrap_or_else(|| container_id.clone());
        return Some(ContainerEvent {
            container_id,
            name,
            kind: EventKind::ImageRemoved,
            labels: BTreeMap::new(),
            time_ns: event_time_ns(msg.time_nano, msg.time, since_ns)?,
        });
    }
    let kind = match msg.action.as_deref()? {
        "die" | "died" => EventKind::Die {
            exit_code: exit_code(&attributes),
        },
        "oom" => EventKind::Oom,
        "destroy" | "remove" => EventKind::Destroy,
        _ => return None,
    };
    // Docker and Podman put the labels among the attributes, with name, image and the exit
    // code.
    let attributes: BTreeMap<String, String> = attributes.into_iter().collect();
    if !has_labels(&attributes, labels) {
        return None;
    }
    let name = attributes
        .get("name")
        .map(|n| strip_slash(n))
        .unwrap_or_default();
    Some(ContainerEvent {
        container_id,
        name,
        kind,
        labels: attributes,
        time_ns: event_time_ns(msg.time_nano, msg.time, since_ns)?,
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

        let host_ipc = create_body(&ContainerSpec {
            ipc_mode: Some("host".to_owned()),
            ..spec.clone()
        });
        let host_ipc = host_ipc.host_config.unwrap();
        assert_eq!(
            host_ipc.shm_size, None,
            "Podman refuses a size in the host's IPC"
        );
        assert_eq!(host_ipc.tmpfs.unwrap()["/dev/shm"], "exec,size=1048576");

        let host_mode = create_body(&ContainerSpec {
            network: NetworkMode::Host,
            ..spec
        });
        assert!(host_mode.exposed_ports.is_none());
        assert!(host_mode.host_config.unwrap().port_bindings.is_none());
    }

    /// Bounded logs are `json-file` with `max-size` in bytes and `max-file`; no bounds, no
    /// `LogConfig` at all (the daemon's own driver and options apply).
    #[test]
    fn body_log_config() {
        use std::num::{NonZeroU32, NonZeroU64};
        let mut spec = ContainerSpec::new("n", "i:1");
        assert_eq!(create_body(&spec).host_config.unwrap().log_config, None);
        spec.log = Some(LogLimits::new(
            NonZeroU64::new(100 << 20).unwrap(),
            NonZeroU32::new(3).unwrap(),
        ));
        let log = create_body(&spec).host_config.unwrap().log_config.unwrap();
        assert_eq!(log.typ.as_deref(), Some("json-file"));
        assert_eq!(
            log.config.unwrap(),
            HashMap::from([
                ("max-size".to_owned(), "104857600".to_owned()),
                ("max-file".to_owned(), "3".to_owned()),
            ])
        );
        // As the engine receives it.
        let json = serde_json::to_value(create_body(&spec)).unwrap();
        assert_eq!(
            json["HostConfig"]["LogConfig"],
            serde_json::json!({
                "Type": "json-file",
                "Config": {"max-size": "104857600", "max-file": "3"}
            })
        );
    }

    fn events_of(fixture: &str, labels: &[(String, String)]) -> Vec<ContainerEvent> {
        fixture
            .lines()
            .map(|line| serde_json::from_str::<EventMessage>(line).unwrap())
            .filter_map(|msg| container_event(msg, labels, 0))
            .collect()
    }

    fn any_task() -> Vec<(String, String)> {
        vec![("ai.dstack.shim.task-id".to_owned(), String::new())]
    }

    /// The engine is asked for container and image events only, and Docker (not Podman, whose
    /// names differ) only for those the shim keeps; no label reaches it.
    #[test]
    fn events_ask_the_engine_for_container_and_image_events_only() {
        let types = (
            "type".to_owned(),
            vec!["container".to_owned(), "image".to_owned()],
        );
        assert_eq!(event_filters(false), HashMap::from([types.clone()]));
        let names = ["die", "oom", "destroy", "untag", "delete", "prune"];
        let names = ("event".to_owned(), names.map(str::to_owned).to_vec());
        assert_eq!(event_filters(true), HashMap::from([types, names]));
    }

    /// What Docker is asked for by name is what the shim keeps: of the recorded Docker events
    /// (20.10's containers, 28.5's images), an event passes the filter exactly when
    /// [`container_event`] keeps it (no labels asked for).
    #[test]
    fn docker_is_asked_by_name_for_exactly_the_events_kept() {
        let fixtures = [
            include_str!("fixtures/events-docker-20.10.jsonl"),
            include_str!("fixtures/events-docker-28-images.jsonl"),
        ];
        let (mut kept, mut dropped) = (0, 0);
        for line in fixtures.iter().flat_map(|f| f.lines()) {
            let msg = serde_json::from_str::<EventMessage>(line).unwrap();
            let passes = DOCKER_ACTIONS.contains(&msg.action.as_deref().unwrap());
            let is_kept = container_event(msg, &[], 0).is_some();
            assert_eq!(is_kept, passes, "{line}");
            kept += usize::from(is_kept);
            dropped += usize::from(!is_kept);
        }
        assert!(kept >= 5 && dropped >= 5, "{kept} kept, {dropped} dropped");
    }

    /// Issue 39: Docker 28.5's image events (containerd store), recorded on this project's
    /// main engine while `docker tag`, `docker rmi` and `docker image import` ran: an
    /// untag and a delete are image removals whatever labels were asked for (an image
    /// carries none of a task's); a tag and an import are not.
    #[test]
    fn image_removals_are_events_whatever_the_labels() {
        let events = events_of(
            include_str!("fixtures/events-docker-28-images.jsonl"),
            &any_task(),
        );
        let seen: Vec<(&str, &EventKind)> =
            events.iter().map(|e| (e.name.as_str(), &e.kind)).collect();
        assert_eq!(
            seen,
            [
                ("evtest:1", &EventKind::ImageRemoved),
                ("evtest:2", &EventKind::ImageRemoved),
                ("evtest2:1", &EventKind::ImageRemoved),
                (
                    "sha256:f0a2d84bb46ed3b1aa61b18b1377072b47355a6fdd4d9a70a1b42fc751e26ab1",
                    &EventKind::ImageRemoved
                ),
            ]
        );
        assert!(events.iter().all(|e| e.container_id.starts_with("sha256:")));
        assert!(events.iter().all(|e| e.labels.is_empty()));
    }

    /// Docker 20.10's events, as the daemon streams them: the shim keeps the exits, OOM kills
    /// and removals of containers carrying the label (a label key alone: present), and drops
    /// the rest (a start, another container's exit, a network event).
    #[test]
    fn docker_events_are_filtered_in_the_shim() {
        let events = events_of(
            include_str!("fixtures/events-docker-20.10.jsonl"),
            &any_task(),
        );
        let kinds: Vec<_> = events
            .iter()
            .map(|e| (e.name.as_str(), e.kind.clone(), e.time_ns))
            .collect();
        assert_eq!(
            kinds,
            [
                ("t1-0-aaaa", EventKind::Oom, 1_700_000_001_200_000_000),
                (
                    "t1-0-aaaa",
                    EventKind::Die {
                        exit_code: Some(137)
                    },
                    1_700_000_001_300_000_000
                ),
                ("t1-0-aaaa", EventKind::Destroy, 1_700_000_003_000_000_000),
            ]
        );
        assert_eq!(events[1].labels["ai.dstack.shim.task-id"], "t1");
        // A label with a value must match it.
        let other = [("ai.dstack.shim.task-id".to_owned(), "t9".to_owned())];
        assert!(events_of(include_str!("fixtures/events-docker-20.10.jsonl"), &other).is_empty());
        let none = events_of(include_str!("fixtures/events-docker-20.10.jsonl"), &[]);
        assert_eq!(none.len(), 4, "no labels: every container's: {none:?}");
    }

    /// Podman 4.3's events: the exit comes as `died` with `containerExitCode` only, or
    /// renamed `die` by the compat API with `exitCode` too; a removal is `remove`. Labels are
    /// among the attributes, as with Docker.
    #[test]
    fn podman_events_died_and_remove_are_understood() {
        let events = events_of(
            include_str!("fixtures/events-podman-4.3.jsonl"),
            &any_task(),
        );
        let kinds: Vec<_> = events
            .iter()
            .map(|e| (e.name.as_str(), e.kind.clone()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("t2-0-bbbb", EventKind::Die { exit_code: Some(3) }),
                ("t3-0-cccc", EventKind::Die { exit_code: Some(1) }),
                ("t2-0-bbbb", EventKind::Destroy),
            ]
        );
        assert!(events[0].container_id.starts_with("e5e5e5e5"), "{events:?}");
    }

    /// A subscription since an instant asks the engine for a millisecond more (Podman keeps
    /// only events strictly after a `since` it reads as a float) and keeps the events at or
    /// after the instant: a replay since an exit's own time starts with that exit, on every
    /// engine.
    #[test]
    fn events_since_an_instant_include_it() {
        assert_eq!(
            since_param(1_700_000_001_300_000_000),
            "1700000001.299000000"
        );
        assert_eq!(
            since_param(1_700_000_001_000_500_000),
            "1700000000.999500000"
        );
        assert_eq!(since_param(500), "0.000000000");
        let fixture = include_str!("fixtures/events-docker-20.10.jsonl");
        let since = |since_ns: i64| -> Vec<EventKind> {
            fixture
                .lines()
                .map(|line| serde_json::from_str::<EventMessage>(line).unwrap())
                .filter_map(|msg| container_event(msg, &any_task(), since_ns))
                .map(|e| e.kind)
                .collect()
        };
        // Since half a millisecond after the OOM kill at 1.2 s: the kill, which only the
        // margin brought, is left out; the die at 1.3 s is in.
        let die = EventKind::Die {
            exit_code: Some(137),
        };
        assert_eq!(since(1_700_000_001_200_500_000), [die, EventKind::Destroy]);
        // Since just after the die: the die, in the margin, is left out. The OOM kill 100 ms
        // earlier was not asked for: had the engine sent it, it would be a live event
        // stamped by a clock stepped back since, and it is kept.
        assert_eq!(
            since(1_700_000_001_300_000_001),
            [EventKind::Oom, EventKind::Destroy]
        );
        assert_eq!(since(0).len(), 3);
        // An event with seconds only is dropped only in an earlier second the margin reaches.
        let line = |time: i64| {
            format!(
                r#"{{"Type":"container","Action":"die","Actor":{{"ID":"c1","Attributes":{{"ai.dstack.shim.task-id":"t1","exitCode":"1"}}}},"time":{time}}}"#
            )
        };
        let at = |time: i64, since_ns: i64| {
            container_event(
                serde_json::from_str(&line(time)).unwrap(),
                &any_task(),
                since_ns,
            )
            .is_some()
        };
        assert!(at(1_700_000_001, 1_700_000_001_300_000_000));
        assert!(
            !at(1_700_000_000, 1_700_000_001_000_500_000),
            "in the margin"
        );
        assert!(
            at(1_700_000_000, 1_700_000_001_300_000_000),
            "before the margin: live"
        );
    }

    /// An event of another type never becomes a container event, whatever its action.
    #[test]
    fn only_container_events_count() {
        let line = r#"{"Type":"volume","Action":"destroy","Actor":{"ID":"v1","Attributes":{"ai.dstack.shim.task-id":"t1","driver":"local"}},"scope":"local","time":1,"timeNano":1000000000}"#;
        let msg: EventMessage = serde_json::from_str(line).unwrap();
        assert_eq!(container_event(msg, &any_task(), 0), None);
    }

    /// The one label filter a list sends narrows correctly whether the engine ANDs or ORs
    /// several: a `key=value` label if there is one, else a key; the shim checks the rest.
    #[test]
    fn a_list_sends_one_label_filter() {
        let labels = vec![
            ("ai.dstack.shim.task-id".to_owned(), String::new()),
            ("ai.dstack.shim.owner".to_owned(), "me".to_owned()),
        ];
        assert_eq!(
            list_prefilter(&labels),
            HashMap::from([(
                "label".to_owned(),
                vec!["ai.dstack.shim.owner=me".to_owned()]
            )])
        );
        assert_eq!(
            list_prefilter(&any_task()),
            HashMap::from([(
                "label".to_owned(),
                vec!["ai.dstack.shim.task-id".to_owned()]
            )])
        );
        assert!(list_prefilter(&[]).is_empty());
    }

    /// Podman 4.3's inspect answer for a container that has just exited: `stopped`, which
    /// bollard's enum rejects. Read without it, the state is one to wait on (not exited: the
    /// exit code, 0 here, is not read yet), and everything else is read as usual.
    #[test]
    fn podman_stopped_inspect_is_a_state_to_wait_on() {
        let json = include_str!("fixtures/inspect-podman-4.3-stopped.json");
        let typed = serde_json::from_str::<ContainerInspectResponse>(json);
        assert!(
            typed
                .as_ref()
                .is_err_and(|e| e.to_string().contains("stopped")),
            "bollard reads it now: the fallback may be unneeded: {typed:?}"
        );
        let d = details_from_json(json).unwrap();
        assert_eq!(d.state, ContainerState::Other("stopped".to_owned()));
        assert!(d.state.is_running(), "an unknown state is waited on");
        assert_eq!(d.name, "t2-0-bbbb");
        assert_eq!(d.image, "localhost/shim-test:1");
        assert_eq!(d.labels["ai.dstack.shim.task-id"], "t2");
        assert_eq!(d.mounts[0].source, "/root/.dstack/runners/t2-0-bbbb");
        assert_eq!(d.finished_at, None);
        assert_eq!(d.shm_size, 65_536_000);
        for (state, expected) in [
            ("stopping", ContainerState::Other("stopping".to_owned())),
            ("unknown", ContainerState::Other("unknown".to_owned())),
            ("exited", ContainerState::Exited),
        ] {
            let json = json.replace("\"stopped\"", &format!("\"{state}\""));
            assert_eq!(details_from_json(&json).unwrap().state, expected);
        }
    }

    /// Podman 4.3's list: one entry `stopped` and one `stopping` (bollard rejects both) must
    /// not make the whole list an error.
    #[test]
    fn podman_list_with_unknown_states_is_read() {
        let json = include_str!("fixtures/list-podman-4.3.json");
        assert!(serde_json::from_str::<Vec<bollard::models::ContainerSummary>>(json).is_err());
        let list = summaries_from_json(json).unwrap();
        let states: Vec<_> = list
            .iter()
            .map(|c| (c.name.as_str(), c.state.clone(), c.state.is_running()))
            .collect();
        assert_eq!(
            states,
            [
                (
                    "t2-0-bbbb",
                    ContainerState::Other("stopped".to_owned()),
                    true
                ),
                (
                    "t4-0-dddd",
                    ContainerState::Other("stopping".to_owned()),
                    true
                ),
                ("someone-elses", ContainerState::Running, true),
            ]
        );
        assert_eq!(
            list[1].ports,
            [PublishedPort {
                container: 10999,
                host: 40123
            }]
        );
        assert_eq!(list[0].mounts[0].destination, "/tmp/runner");
    }
}
