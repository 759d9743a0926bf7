//! GPU health from DCGM's passive health watches, read through `dcgmi`, in upstream's JSON
//! shape.
//!
//! Upstream links libdcgm (cgo), starts an embedded host engine, enables every health watch on
//! the group of all GPUs (`HealthSet(GroupAllGPUs, DCGM_HEALTH_WATCH_ALL)` and one initial
//! `HealthCheck`), and answers each `GET /api/instance/health` with a fresh `HealthCheck`
//! (`runner/internal/shim/dcgm/wrapper_cgo.go`). The same facts come from
//! `dcgmi health -s a` (enable all watches, group "all GPUs" by default) and
//! `dcgmi health -c -j` (check, JSON); `dcgmi` needs a host engine, so when no `--dcgm-address`
//! is given the shim runs a private `nv-hostengine` on a Unix socket, the counterpart of
//! upstream's embedded one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::DcgmError;
use crate::config::DcgmConfig;
use crate::supervisor::{ChildSpec, Supervisor};
use shim_util::{Command, CommandRunner, SystemCommandRunner, error_chain};

/// `DCGM_HEALTH_RESULT_PASS`.
pub const HEALTH_PASS: i32 = 0;
/// `DCGM_HEALTH_RESULT_WARN`.
pub const HEALTH_WARN: i32 = 10;
/// `DCGM_HEALTH_RESULT_FAIL`.
pub const HEALTH_FAIL: i32 = 20;

/// One health incident, as upstream's `HealthIncident` (`runner/internal/shim/dcgm/wrapper.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthIncident {
    /// The health watch system (`dcgmHealthSystems_t` bit): 0x1 PCIe, 0x2 NVLink, 0x10 memory,
    /// 0x20 SM, 0x40 InfoROM, 0x80 thermal, 0x100 power, 0x200 driver, 0x1000 ConnectX; 0 when
    /// dcgmi named a system this crate does not know.
    pub system: u32,
    /// [`HEALTH_PASS`], [`HEALTH_WARN`] or [`HEALTH_FAIL`].
    pub health: i32,
    /// DCGM's message. dcgmi joins the messages of one system of one entity with `, `.
    pub error_message: String,
    /// DCGM's error code (`dcgmError_t`). dcgmi does not print it: always 0 here.
    pub error_code: i32,
    /// The entity group (`dcgm_field_entity_group_t`): 1 GPU, 2 vGPU, 3 NvSwitch, 4 GPU
    /// instance, 5 compute instance, 6 link, 7 CPU, 8 CPU core, 9 ConnectX.
    pub entity_group_id: u32,
    /// The entity's id within its group (the DCGM GPU id for GPUs).
    pub entity_id: u32,
}

/// The host's GPU health, as upstream's `Health` (the `dcgm` member of
/// `GET /api/instance/health`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// The worst of all: [`HEALTH_PASS`], [`HEALTH_WARN`] or [`HEALTH_FAIL`].
    pub overall_health: i32,
    /// Every incident; `[]` when healthy.
    pub incidents: Vec<HealthIncident>,
}

/// The body of `GET /api/instance/health`: `{"dcgm": {...}}`, or `{"dcgm": null}` when GPU
/// health is unknown, as upstream's `InstanceHealthResponse` (`runner/internal/shim/api/
/// schemas.go`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceHealth {
    /// The DCGM health, when known.
    #[serde(default)]
    pub dcgm: Option<Health>,
}

fn health_value(text: &str) -> Option<i32> {
    // dcgmi/Health.cpp HelperHealthToString
    match text {
        "Healthy" => Some(HEALTH_PASS),
        "Warning" => Some(HEALTH_WARN),
        "Failure" => Some(HEALTH_FAIL),
        _ => None,
    }
}

fn system_bit(name: &str) -> Option<u32> {
    // dcgmi/Health.cpp HelperSystemToString; dcgmlib/dcgm_structs.h dcgmHealthSystems_enum
    Some(match name {
        "PCIe system" => 0x1,
        "NVLINK system" => 0x2,
        "PMU system" => 0x4,
        "MCU system" => 0x8,
        "Memory system" => 0x10,
        "SM system" => 0x20,
        "InfoROM system" => 0x40,
        "Thermal system" => 0x80,
        "Power system" => 0x100,
        "Driver" => 0x200,
        "ConnectX system" => 0x1000,
        _ => return None,
    })
}

fn entity_group(name: &str) -> Option<u32> {
    // dcgmlib/src/dcgm_fields.cpp DcgmFieldsGetEntityGroupString; dcgm_fields.h order
    Some(match name {
        "None" => 0,
        "GPU" => 1,
        "vGPU" => 2,
        "Switch" => 3,
        "GPU_I" => 4,
        "GPU_CI" => 5,
        "LINK" => 6,
        "CPU" => 7,
        "CPU_CORE" => 8,
        "ConnectX" => 9,
        _ => return None,
    })
}

const OVERALL: &str = "Overall Health";

/// Reads the report `dcgmi health -c -j` prints.
///
/// Its layout (dcgmi's `DcgmiOutputJson`): `{"header": ["Health Monitor Report"], "body":
/// {"Overall Health": {"value": H}, <group>: {"children": {<entity id>: {"value": H,
/// "children": {"Errors": {"children": {<system>: {"value": H, "overflow": [parts...]}}}}}}}}}`
/// where H is `Healthy`, `Warning` or `Failure` and a message longer than dcgmi's column is
/// split into `overflow` parts at spaces (joined back with a space here). Incidents come out
/// ordered by group, entity and system. Unknown group or system names are kept with 0.
pub fn parse_dcgmi_health(stdout: &str) -> Result<Health, String> {
    let start = stdout.find('{').ok_or("no JSON object")?;
    let root: Value = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter::<Value>()
        .next()
        .ok_or("no JSON object")?
        .map_err(|e| format!("invalid JSON: {e}"))?;
    let body = root
        .get("body")
        .and_then(Value::as_object)
        .ok_or("no \"body\" object")?;
    let overall = body
        .get(OVERALL)
        .and_then(|o| o.get("value"))
        .and_then(Value::as_str)
        .ok_or("no \"Overall Health\" value")?;
    let overall_health =
        health_value(overall).ok_or_else(|| format!("unknown overall health {overall:?}"))?;

    let mut incidents = Vec::new();
    for (group_name, group) in body.iter().filter(|(k, _)| *k != OVERALL) {
        let entity_group_id = entity_group(group_name).unwrap_or_else(|| {
            tracing::warn!(group = %group_name, "unknown DCGM entity group in dcgmi's report");
            0
        });
        let entities = children(group).ok_or_else(|| format!("{group_name:?} has no children"))?;
        for (entity_key, entity) in entities {
            let entity_id: u32 = entity_key
                .parse()
                .map_err(|_| format!("{group_name:?} entity id {entity_key:?} is not a number"))?;
            let systems = entity
                .get("children")
                .and_then(|c| c.get("Errors"))
                .and_then(children)
                .ok_or_else(|| format!("{group_name:?} {entity_key} has no errors"))?;
            for (system_name, system) in systems {
                let health_text = system.get("value").and_then(Value::as_str).unwrap_or("");
                let health = health_value(health_text).ok_or_else(|| {
                    format!(
                        "{group_name} {entity_key} {system_name}: unknown health {health_text:?}"
                    )
                })?;
                let parts: Vec<&str> = system
                    .get("overflow")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let system_id = system_bit(system_name).unwrap_or_else(|| {
                    tracing::warn!(system = %system_name, "unknown DCGM health system in dcgmi's report");
                    0
                });
                incidents.push(HealthIncident {
                    system: system_id,
                    health,
                    error_message: parts.join(" "),
                    error_code: 0,
                    entity_group_id,
                    entity_id,
                });
            }
        }
    }
    incidents.sort_by_key(|i| (i.entity_group_id, i.entity_id, i.system));
    Ok(Health {
        overall_health,
        incidents,
    })
}

fn children(node: &Value) -> Option<&serde_json::Map<String, Value>> {
    node.get("children").and_then(Value::as_object)
}

/// What dcgmi prints when the watches are off (for instance after the host engine restarted).
const NOT_ENABLED: &str = "Health watches not enabled";

/// GPU health through `dcgmi`.
#[derive(Debug)]
pub struct DcgmHealth {
    inner: Arc<Inner>,
    enabler: std::sync::Mutex<Option<JoinHandle<()>>>,
    hostengine: Option<Supervisor>,
    /// The private host engine's directory, removed when dropped; taken by shutdown.
    socket_dir: std::sync::Mutex<Option<tempfile::TempDir>>,
}

struct Inner {
    runner: Arc<dyn CommandRunner>,
    dcgmi: PathBuf,
    /// `--host` for dcgmi; `None`: dcgmi's default (`localhost`).
    host: Option<String>,
    timeout: Duration,
    /// Whether the watches were enabled (and initialised) through this host engine. Also
    /// serialises the dcgmi runs.
    enabled: Mutex<bool>,
    /// The last health a check read, and when ([`DcgmHealth::instance_health_within`]).
    last: std::sync::Mutex<Option<(Health, tokio::time::Instant)>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("dcgmi", &self.dcgmi)
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

/// How old the last health read may be to answer for a check that is late
/// ([`DcgmHealth::instance_health_within`]).
pub const LAST_HEALTH_MAX_AGE: Duration = Duration::from_secs(5 * 60);

/// How long start-up keeps trying to enable the watches (the host engine needs a moment).
const ENABLE_ATTEMPTS: u32 = 30;
const ENABLE_RETRY: Duration = Duration::from_secs(1);

impl DcgmHealth {
    /// Upstream's start-up, with dcgmi: `None` (logged) when `dcgmi` is not found, so that
    /// `/api/instance/health` answers `{"dcgm":null}`. Otherwise picks the host engine:
    /// `--dcgm-address` when given; else a private `nv-hostengine` (found as
    /// [`DcgmConfig::find_hostengine`]) on a Unix socket in a temporary directory, supervised
    /// like the exporter; else dcgmi's default. Then enables the watches in the background (retrying for a while, since the
    /// host engine starts asynchronously). Call it on NVIDIA hosts only, as upstream does.
    pub async fn start(config: &DcgmConfig) -> Option<Self> {
        let Some(dcgmi) = config.find_dcgmi() else {
            tracing::info!("not using DCGM health checks: dcgmi not found");
            return None;
        };
        let mut hostengine = None;
        let mut socket_dir = None;
        let host = match config.address() {
            Some(address) => Some(address.to_owned()),
            None => match config.find_hostengine() {
                Some(program) => match start_hostengine(&program, config) {
                    Ok((supervisor, dir, socket)) => {
                        hostengine = Some(supervisor);
                        socket_dir = Some(dir);
                        Some(format!("unix://{}", socket.display()))
                    }
                    Err(e) => {
                        tracing::warn!(error = %error_chain(&e), "not starting nv-hostengine; dcgmi will ask localhost");
                        None
                    }
                },
                None => None,
            },
        };
        tracing::info!(dcgmi = %dcgmi.display(), host = host.as_deref().unwrap_or("localhost"), "using DCGM health checks");
        let mut health = Self::with_runner(
            Arc::new(SystemCommandRunner::default()),
            dcgmi,
            host,
            config.command_timeout,
        );
        health.hostengine = hostengine;
        health.socket_dir = std::sync::Mutex::new(socket_dir);
        let inner = health.inner.clone();
        health.enabler = std::sync::Mutex::new(Some(tokio::spawn(async move {
            for attempt in 1..=ENABLE_ATTEMPTS {
                match inner.enable().await {
                    Ok(()) => return,
                    Err(e) if attempt == ENABLE_ATTEMPTS => {
                        tracing::error!(error = %error_chain(&e), "failed to enable DCGM health checks");
                    }
                    Err(e) => {
                        tracing::debug!(error = %error_chain(&e), attempt, "enabling DCGM health checks")
                    }
                }
                tokio::time::sleep(ENABLE_RETRY).await;
            }
        })));
        Some(health)
    }

    /// Health through the given `dcgmi` (`--host host` when given), run by `runner`; nothing is
    /// started and the watches are enabled on the first [`DcgmHealth::check`].
    pub fn with_runner(
        runner: Arc<dyn CommandRunner>,
        dcgmi: PathBuf,
        host: Option<String>,
        timeout: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                runner,
                dcgmi,
                host,
                timeout,
                enabled: Mutex::new(false),
                last: std::sync::Mutex::new(None),
            }),
            enabler: std::sync::Mutex::new(None),
            hostengine: None,
            socket_dir: std::sync::Mutex::new(None),
        }
    }

    /// The `--host` given to dcgmi (`unix://…` for the private host engine).
    pub fn host(&self) -> Option<&str> {
        self.inner.host.as_deref()
    }

    /// The private host engine's pid, when the shim runs one.
    pub fn hostengine_pid(&self) -> Option<u32> {
        self.hostengine.as_ref().and_then(Supervisor::pid)
    }

    /// Enables every health watch and initialises their state (`dcgmi health -s a`, then one
    /// `dcgmi health -c -j` whose result is dropped, as upstream's `EnableHealthChecks`).
    pub async fn enable(&self) -> Result<(), DcgmError> {
        self.inner.enable().await
    }

    /// The current health (`dcgmi health -c -j`). Enables the watches first when that has not
    /// happened yet, and again (once) when dcgmi says they are off. Upstream answers `null`
    /// for the DCGM part when this fails and logs the error; see
    /// [`DcgmHealth::instance_health`].
    pub async fn check(&self) -> Result<Health, DcgmError> {
        self.inner.check().await
    }

    /// The body of `GET /api/instance/health`: `{"dcgm": ...}`, or `{"dcgm": null}` (error
    /// logged) when the check fails.
    pub async fn instance_health(&self) -> InstanceHealth {
        match self.check().await {
            Ok(health) => {
                let now = tokio::time::Instant::now();
                *self.inner.last.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((health.clone(), now));
                InstanceHealth { dcgm: Some(health) }
            }
            Err(e) => {
                tracing::error!(error = %error_chain(&e), "failed to get health from DCGM");
                InstanceHealth::default()
            }
        }
    }

    /// [`DcgmHealth::instance_health`] within `budget`: a check that takes longer (a host
    /// engine that hangs with a wedged GPU, each `dcgmi` run killed only after its own
    /// timeout) answers with the last health read, when it is at most [`LAST_HEALTH_MAX_AGE`]
    /// old, else `{"dcgm": null}`. The dstack server gives the request 9 s, and an instance
    /// whose health it cannot read counts as unreachable (terminated after 20 minutes).
    pub async fn instance_health_within(&self, budget: Duration) -> InstanceHealth {
        if let Ok(health) = tokio::time::timeout(budget, self.instance_health()).await {
            return health;
        }
        let last = self
            .inner
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let fresh = last.filter(|(_, at)| at.elapsed() <= LAST_HEALTH_MAX_AGE);
        tracing::warn!(
            ?budget,
            answered_last = fresh.is_some(),
            "DCGM's health check is late; answering the last one read, if recent"
        );
        InstanceHealth {
            dcgm: fresh.map(|(health, _)| health),
        }
    }

    fn stop_enabling(&self) {
        if let Some(enabler) = crate::take(&self.enabler) {
            enabler.abort();
        }
    }

    /// Stops the background enabling and the private host engine (SIGTERM, SIGKILL after the
    /// grace period) and removes its directory. Later calls do nothing.
    pub async fn shutdown(&self) {
        self.stop_enabling();
        if let Some(hostengine) = &self.hostengine {
            hostengine.shutdown().await;
        }
        if let Some(Err(e)) = crate::take(&self.socket_dir).map(tempfile::TempDir::close) {
            tracing::warn!(error = %e, "failed to remove nv-hostengine's directory");
        }
    }
}

impl Drop for DcgmHealth {
    fn drop(&mut self) {
        self.stop_enabling();
    }
}

impl Inner {
    /// `dcgmi health [--host H] <op>`, killed after the configured time.
    fn command(&self, op: &[&str]) -> Command {
        let mut dcgmi = Command::new(&self.dcgmi).arg("health");
        if let Some(host) = &self.host {
            dcgmi = dcgmi.arg("--host").arg(host.as_str());
        }
        dcgmi.args(op.iter().copied()).timeout(self.timeout)
    }

    /// Runs dcgmi; a non-zero exit is an error carrying the end of its output.
    async fn dcgmi(&self, op: &[&str]) -> Result<String, DcgmError> {
        let dcgmi = self.command(op);
        Ok(self.runner.run(&dcgmi).await?.check(&dcgmi)?.stdout)
    }

    async fn enable(&self) -> Result<(), DcgmError> {
        let mut enabled = self.enabled.lock().await;
        self.enable_locked(&mut enabled).await
    }

    async fn enable_locked(&self, enabled: &mut bool) -> Result<(), DcgmError> {
        self.dcgmi(&["-s", "a"]).await?;
        // "On the first call, stateful information about all of the enabled watches within a
        // group is created but no error results are provided" (upstream's comment on
        // dcgmHealthCheck).
        self.dcgmi(&["-c", "-j"]).await?;
        *enabled = true;
        tracing::info!("DCGM health watches enabled");
        Ok(())
    }

    async fn check(&self) -> Result<Health, DcgmError> {
        let mut enabled = self.enabled.lock().await;
        if !*enabled {
            self.enable_locked(&mut enabled).await?;
        }
        let check = self.command(&["-c", "-j"]);
        let out = self.runner.run(&check).await?;
        let off = |text: &str| text.contains(NOT_ENABLED);
        let stdout = if !out.success() && (off(&out.stdout) || off(&out.stderr)) {
            tracing::info!("DCGM health watches are off (host engine restarted?); enabling");
            *enabled = false;
            self.enable_locked(&mut enabled).await?;
            self.dcgmi(&["-c", "-j"]).await?
        } else {
            out.check(&check)?.stdout
        };
        parse_dcgmi_health(&stdout).map_err(|reason| DcgmError::DcgmiOutput {
            command: check.to_string(),
            reason,
        })
    }
}

/// `nv-hostengine -n -d <dir>/nv-hostengine.sock --pid <dir>/nv-hostengine.pid -f <log>`: in
/// the foreground (so it can be supervised), on a Unix socket only (no TCP port to clash with
/// a system host engine), with its own pid file.
fn start_hostengine(
    program: &Path,
    config: &DcgmConfig,
) -> Result<(Supervisor, tempfile::TempDir, PathBuf), DcgmError> {
    let state_dir = config.state_dir.as_deref();
    crate::scratch::sweep(state_dir, "nv-hostengine");
    let dir = tempfile::Builder::new()
        .prefix(crate::scratch::PREFIX)
        .tempdir()
        .map_err(|source| DcgmError::TempDir { source })?;
    crate::scratch::record(state_dir, "nv-hostengine", dir.path());
    let socket = dir.path().join("nv-hostengine.sock");
    let log = config
        .log_dir
        .as_deref()
        .unwrap_or(dir.path())
        .join("nv-hostengine.log");
    let args = vec![
        "-n".into(),
        "-d".into(),
        socket.clone().into_os_string(),
        "--pid".into(),
        dir.path().join("nv-hostengine.pid").into_os_string(),
        "-f".into(),
        log.into_os_string(),
    ];
    let supervisor = Supervisor::spawn(ChildSpec::new("nv-hostengine", program, args, config));
    Ok((supervisor, dir, socket))
}

#[cfg(test)]
mod tests {
    use shim_util::CommandOutput;
    use shim_util::fake::ScriptedCommandRunner;

    use super::*;

    fn testdata(name: &str) -> String {
        fs_err::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("testdata")
                .join(name),
        )
        .unwrap()
    }

    // upstream: runner/internal/shim/dcgm/wrapper_cgo_test.go (healthy: overall 0, no incidents)
    #[test]
    fn a_recorded_healthy_report_is_pass_without_incidents() {
        let h = parse_dcgmi_health(&testdata("dcgmi-health-healthy.json")).unwrap();
        assert_eq!(
            h,
            Health {
                overall_health: HEALTH_PASS,
                incidents: vec![]
            }
        );
        assert_eq!(
            serde_json::to_string(&InstanceHealth { dcgm: Some(h) }).unwrap(),
            r#"{"dcgm":{"overall_health":0,"incidents":[]}}"#
        );
    }

    // upstream: runner/internal/shim/dcgm/wrapper_cgo_test.go (after injecting a DBE and PCIe
    // replays: overall 20, PCIe 0x1 warn "PCIe replay", memory 0x10 fail "volatile
    // double-bit ECC error", entity group 1, entity id = GPU id); wrapper.go (field names)
    #[test]
    fn incidents_map_to_upstreams_shape() {
        let h = parse_dcgmi_health(&testdata("dcgmi-health-incidents.json")).unwrap();
        assert_eq!(h.overall_health, HEALTH_FAIL);
        let gpu = |entity_id, system, health, msg: &str| HealthIncident {
            system,
            health,
            error_message: msg.to_owned(),
            error_code: 0,
            entity_group_id: 1,
            entity_id,
        };
        assert_eq!(
            h.incidents,
            vec![
                gpu(
                    0,
                    0x1,
                    HEALTH_WARN,
                    "Detected more than 8 PCIe replays per minute for GPU 0 : 999"
                ),
                gpu(
                    0,
                    0x10,
                    HEALTH_FAIL,
                    "Detected 888 volatile double-bit ECC error(s) in GPU 0."
                ),
                gpu(
                    1,
                    0x2,
                    HEALTH_WARN,
                    "Detected 12 CRC FLIT NvLink errors on GPU 1's NVLink which exceeds threshold of 5"
                ),
            ]
        );
        let json = serde_json::to_value(&h).unwrap();
        assert_eq!(
            json["incidents"][1],
            serde_json::json!({
                "system": 16, "health": 20,
                "error_message": "Detected 888 volatile double-bit ECC error(s) in GPU 0.",
                "error_code": 0, "entity_group_id": 1, "entity_id": 0
            })
        );
    }

    #[test]
    fn tolerates_noise_around_the_report_and_unknown_names() {
        let out = "Connecting...\n{\"body\":{\"Overall Health\":{\"value\":\"Warning\"},\
                   \"Gizmo\":{\"children\":{\"3\":{\"value\":\"Warning\",\"children\":{\"Errors\":\
                   {\"children\":{\"NvSwitch F\":{\"value\":\"Warning\",\"overflow\":[\"x\"]}}}}}}}}}\n";
        let h = parse_dcgmi_health(out).unwrap();
        assert_eq!(h.overall_health, HEALTH_WARN);
        assert_eq!(h.incidents.len(), 1);
        assert_eq!(
            (h.incidents[0].entity_group_id, h.incidents[0].system),
            (0, 0)
        );
        assert_eq!(h.incidents[0].entity_id, 3);
    }

    #[test]
    fn rejects_what_is_not_a_report() {
        for out in [
            "",
            "Error: unable to establish a connection to the specified host: localhost",
            "{}",
            r#"{"body":{}}"#,
            r#"{"body":{"Overall Health":{"value":"Internal error"}}}"#,
            r#"{"body":{"Overall Health":{"value":"Healthy"},"GPU":{"children":{"x":{}}}}}"#,
            r#"{"body":{"Overall Health":{"value":"Healthy"},"GPU":{"children":{"0":{"children":{"Errors":{"children":{"PCIe system":{"value":"?"}}}}}}}}}"#,
        ] {
            assert!(parse_dcgmi_health(out).is_err(), "{out:?} parsed");
        }
    }

    /// upstream: runner/internal/shim/api/schemas.go (`InstanceHealthResponse`: `DCGM
    /// *dcgm.Health \`json:"dcgm"\``, no `omitempty`).
    #[test]
    fn instance_health_is_null_when_unknown() {
        assert_eq!(
            serde_json::to_string(&InstanceHealth::default()).unwrap(),
            r#"{"dcgm":null}"#
        );
    }

    #[tokio::test]
    async fn the_host_is_passed_before_the_operation() {
        let runner = Arc::new(ScriptedCommandRunner::new());
        runner.always(
            "dcgmi",
            CommandOutput::ok(testdata("dcgmi-health-healthy.json")),
        );
        let health = DcgmHealth::with_runner(
            runner.clone(),
            PathBuf::from("dcgmi"),
            Some("10.0.0.5".into()),
            Duration::from_secs(1),
        );
        health.check().await.unwrap();
        let calls: Vec<String> = runner.calls().iter().map(|c| c[1..].join(" ")).collect();
        assert_eq!(
            calls,
            [
                "health --host 10.0.0.5 -s a",
                "health --host 10.0.0.5 -c -j",
                "health --host 10.0.0.5 -c -j"
            ]
        );
    }
}
