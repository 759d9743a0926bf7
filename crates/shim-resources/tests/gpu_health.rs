//! NVIDIA GPU health: `nvidia-smi -q` parsing, XIDs from the kernel log, the probe.
//!
//! The fixtures under `testdata/gpu/health/` are NOT captures from a host: they are written by
//! hand in the layout of the public recordings cited at each test (and in their README), with
//! invented UUIDs and serials; every fault in them was written in, as said at each test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::path::{Path, PathBuf};
use std::sync::Arc;

use UnhealthyReason::{RetiredPagesPending, RowRemapFailure, RowRemapPending};
use serde_json::json;
use shim_resources::gpu::health::{
    DEFAULT_SKIPPED_XIDS, GpuHealth, GpuHealthReport, GpuRef, KernelLog, Kmsg, UnhealthyReason,
    XidEvent, XidLine, XidMonitor, XidPolicy, XidTracker, parse_nvidia_smi_bus_ids,
    parse_nvidia_smi_query, parse_xid_line, probe_nvidia_health,
};
use shim_util::CommandOutput;
use shim_util::fake::ScriptedCommandRunner;

/// GPU 0 and 1 of the A100 fixtures.
const GPU0: &str = "GPU-5f3e2b1a-7c4d-4e8f-9a0b-1c2d3e4f5a6b";
const GPU1: &str = "GPU-0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
const BUS0: &str = "00000000:3B:00.0";
const BUS1: &str = "00000000:5E:00.0";

/// No errors, no GPU ids.
const NONE: &[String] = &[];

/// `testdata/gpu/health/<name>`.
fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/gpu/health")
        .join(name);
    fs_err::read_to_string(p).unwrap()
}

/// The first line of `text` that contains `needle`.
fn line_with<'a>(text: &'a str, needle: &str) -> &'a str {
    let line = text.lines().find(|l| l.contains(needle));
    line.unwrap_or_else(|| panic!("no line with {needle:?}"))
}

/// The two A100s of `nvidia-smi-q-a100x2.txt`.
fn a100s() -> Vec<GpuHealth> {
    parse_nvidia_smi_query(&fixture("nvidia-smi-q-a100x2.txt")).unwrap()
}

fn gpu(uuid: &str, index: u32, bus_id: &str, reasons: &[UnhealthyReason]) -> GpuHealth {
    GpuHealth {
        uuid: uuid.to_owned(),
        index,
        bus_id: bus_id.to_owned(),
        reasons: reasons.to_vec(),
    }
}

fn report(gpus: Vec<GpuHealth>) -> GpuHealthReport {
    GpuHealthReport {
        gpus,
        ..GpuHealthReport::default()
    }
}

/// A tracker with the default policy that knows the A100s.
fn tracker() -> XidTracker {
    tracker_with(XidPolicy::default())
}

fn tracker_with(policy: XidPolicy) -> XidTracker {
    let mut t = XidTracker::new(policy);
    t.learn(&a100s());
    t
}

fn xid(code: u32, message: &str) -> UnhealthyReason {
    UnhealthyReason::Xid {
        code,
        message: message.to_owned(),
    }
}

/// The XID 79 of `kmsg-xids.txt` (GPU 1).
fn fell_off() -> UnhealthyReason {
    xid(79, "GPU has fallen off the bus")
}

// ------------------------------------------------------------------------------ nvidia-smi -q

#[test]
fn healthy_output_has_no_reasons() {
    // nvidia-smi-q-a100x2.txt: hand-written in the layout of the 535.154.05 recording
    // https://github.com/leptonai/gpud/blob/a7cdf53da3fb277bfa0fe21518211a7d9f2befa4/components/accelerator/nvidia/query/testdata/nvidia-smi-query.535.154.05.out.0.valid
    // with A100 values. The MIG Mode, Driver Model, GPU Operation Mode and ECC Mode sections'
    // `Pending` fields are not read.
    let gpus = a100s();
    assert_eq!(gpus, [gpu(GPU0, 0, BUS0, &[]), gpu(GPU1, 1, BUS1, &[])]);
    assert!(gpus.iter().all(GpuHealth::is_healthy));
}

#[test]
fn row_remap_failure_and_pending_are_reasons_of_their_gpu() {
    // nvidia-smi-q-a100x2.txt EDITED: GPU 0's `Remapping Failure Occurred` flipped to Yes; GPU
    // 1's `Pending` flipped to Yes, `Uncorrectable Error` 1, histogram Max 639 / High 1 as in
    // the recorded A100 excerpt with a pending remap in
    // https://github.com/stas00/ml-engineering/blob/15de338c6411c943fc083f7365017c1547acf9af/compute/accelerator/nvidia/debug.md
    let gpus = parse_nvidia_smi_query(&fixture("nvidia-smi-q-a100x2-row-remap.txt")).unwrap();
    let failure = gpu(GPU0, 0, BUS0, &[RowRemapFailure]);
    assert_eq!(gpus, [failure, gpu(GPU1, 1, BUS1, &[RowRemapPending])]);
    assert_eq!(RowRemapFailure.to_string(), "row remapping failed");
    let pending = "row remapping pending (GPU reset needed)";
    assert_eq!(RowRemapPending.to_string(), pending);
}

#[test]
fn retired_pages_pending_is_a_reason_and_remapped_rows_na_is_none() {
    // nvidia-smi-q-v100-retired-pending.txt: hand-written in the layout of the TITAN V
    // recording (`Remapped Rows : N/A` on one line)
    // https://github.com/leptonai/gpud/blob/5e217ececb9daf2adff67d96a0218d756e1e1021/components/accelerator/nvidia/query/testdata/nvidia-smi-query.560.35.03.out.0.valid
    // EDITED: `Double Bit ECC` 1 and `Pending Page Blacklist` flipped from N/A to Yes.
    let gpus = parse_nvidia_smi_query(&fixture("nvidia-smi-q-v100-retired-pending.txt")).unwrap();
    let uuid = "GPU-9c8b7a65-4321-4fed-8cba-0987654321fe";
    let pending = gpu(uuid, 0, "00000000:86:00.0", &[RetiredPagesPending]);
    assert_eq!(gpus, [pending]);
    assert_eq!(RetiredPagesPending.to_string(), "retired pages pending");
}

#[test]
fn unknown_values_and_gpus_without_uuid() {
    // A value that is neither Yes nor No is no reason; a GPU section without a UUID is left
    // out (the index still counts it).
    let text = fixture("nvidia-smi-q-a100x2-row-remap.txt")
        .replace(
            "Remapping Failure Occurred        : Yes",
            "Remapping Failure Occurred        : [Unknown Error]",
        )
        .replace(
            &format!("GPU UUID                              : {GPU1}"),
            "",
        );
    let gpus = parse_nvidia_smi_query(&text).unwrap();
    assert_eq!(gpus, [gpu(GPU0, 0, BUS0, &[])]);
}

#[test]
fn output_without_gpus() {
    assert!(parse_nvidia_smi_query("No devices were found\n").is_err());
    assert!(parse_nvidia_smi_query("").is_err());
    let none = "==============NVSMI LOG==============\n\n\
                Timestamp                                 : Tue Mar  4 10:12:45 2025\n\
                Driver Version                            : 535.129.03\n\n\
                Attached GPUs                             : 0\n";
    assert_eq!(parse_nvidia_smi_query(none).unwrap(), []);
}

#[test]
fn bus_ids_csv() {
    // `nvidia-smi --query-gpu=uuid,pci.bus_id --format=csv,noheader`
    let out = format!("{GPU0}, {BUS0}\n{GPU1}, {BUS1}\n");
    let gpus = parse_nvidia_smi_bus_ids(&out).unwrap();
    let mut expected = a100s();
    for g in &mut expected {
        g.reasons.clear();
    }
    assert_eq!(gpus, expected);
    assert!(parse_nvidia_smi_bus_ids("GPU-x\n").is_err());
    assert!(parse_nvidia_smi_bus_ids("GPU-x, nonsense\n").is_err());
}

// ---------------------------------------------------------------------------------- XID lines

#[test]
fn xid_line_shapes() {
    // kmsg-xids.txt: hand-written /dev/kmsg records in the format of the recording
    // https://github.com/leptonai/gpud/blob/505c54243f639c21cc865208c9e145f9757ab6af/pkg/kmsg/testdata/kmsg.1.log
    // and of NVIDIA DCGM's XID pattern (dcgmlib/src/DcgmKmsgReader.cpp at 72fa3feaa67d); XID
    // texts after https://docs.nvidia.com/deploy/xid-errors/. dmesg-xids.txt: the MIG shape of
    // https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/user-visible-statistics.html, the
    // `pid='<unknown>', name=<unknown>` of
    // https://github.com/leptonai/gpud/blob/4a8de33a3f02e207f39e9023d67125592d599731/components/accelerator/nvidia/sxid/README.md
    // Each parsed line as `XID <code> on <PCI address>: <message>`.
    let shape = |l: XidLine| format!("XID {} on {}: {}", l.code, l.pci, l.message);
    let kmsg = fixture("kmsg-xids.txt");
    for want in [
        "XID 79 on 0000:5e:00: GPU has fallen off the bus",
        "XID 109 on 0000:3b:00: Ch 00000010, errorString CTX SWITCH TIMEOUT, Info 0x2c014",
        "XID 13 on 0000:3b:00: Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): \
         Out Of Range Address",
    ] {
        let code = want.split(' ').nth(1).unwrap();
        let line = line_with(&kmsg, &format!("): {code},"));
        assert_eq!(parse_xid_line(line).map(shape).as_deref(), Some(want));
    }

    let dmesg = fixture("dmesg-xids.txt");
    let dmesg: Vec<_> = dmesg
        .lines()
        .map(|l| shape(parse_xid_line(l).unwrap()))
        .collect();
    assert_eq!(
        dmesg,
        [
            "XID 94 on 0000:3b:00: Contained: CE User Channel (0x9). RST: No, D-RST: No",
            // MIG: the parent GPU's address.
            "XID 63 on 0000:5e:00: Row Remapper: New row marked for remapping, \
             reset gpu to activate",
            // No `PCI:` tag.
            "XID 74 on 0000:3b:00: NVLink: fatal error detected on link 3\
             (0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
        ]
    );

    // A caller id after the timestamp (CONFIG_PRINTK_CALLER).
    let caller = "[ 7.5] [T1234] NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus";
    assert_eq!(parse_xid_line(caller).map(|l| l.code), Some(79));

    // The tag quoted inside another message: Yama's report of a ptrace attempt names the
    // command line of the process, which a container sets as it likes.
    let forged =
        r#"ptrace attach of "sh"[1] was attempted by "NVRM: Xid (PCI:0000:3b:00): 79, x"[42]"#;
    for not_xid in [
        &format!("5,2000,1,-;{forged}"),
        &format!("[ 7.5] {forged}"),
        // A record user space wrote to /dev/kmsg (facility 1, not the kernel's 0).
        "12,2001,1,-;NVRM: Xid (PCI:0000:3b:00): 79, x",
        "6,1386,120400001,-;NVRM: GPU at PCI:0000:5e:00: GPU-0a1b",
        "NVRM: Xid error: xyz, invalid data",
        "NVRM: Xid (PCI:zz): 79, x",
        "NVRM: Xid (PCI:0000:3b:00): x",
        "",
    ] {
        assert_eq!(parse_xid_line(not_xid), None, "{not_xid:?}");
    }
}

// ------------------------------------------------------------------------------- XID tracker

#[test]
fn xid_79_on_a_known_bus_marks_that_gpu() {
    let mut t = tracker();
    let events = t.scan(&fixture("kmsg-xids.txt"));
    // The application XIDs on GPU 0 are skipped; XID 48 on 0000:af:00 (no known GPU) is
    // logged and ignored.
    let (uuid, message) = (GPU1.to_owned(), "GPU has fallen off the bus".to_owned());
    assert_eq!(
        events,
        [XidEvent {
            uuid,
            code: 79,
            message
        }]
    );
    assert_eq!(t.reasons(), [(GPU1.to_owned(), vec![fell_off()])].into());
    let words = "XID 79 (GPU has fallen off the bus)";
    assert_eq!(fell_off().to_string(), words);

    let mut report = report(a100s());
    t.apply(&mut report);
    assert!(report.get(GPU0).unwrap().is_healthy());
    assert_eq!(report.unhealthy_ids(), [GPU1]);
}

#[test]
fn application_xids_are_skipped_by_default() {
    assert_eq!(DEFAULT_SKIPPED_XIDS, [13, 31, 43, 45, 68, 109]);
    let kmsg = fixture("kmsg-xids.txt");
    for code in DEFAULT_SKIPPED_XIDS {
        let line = line_with(&kmsg, &format!("): {code}, "));
        let mut t = tracker();
        assert_eq!(t.scan(line), [], "XID {code}");
        assert!(t.reasons().is_empty(), "XID {code}");
        // Another code in the same record counts.
        let other = line.replace(&format!("): {code}, "), "): 48, ");
        assert_eq!(tracker().scan(&other).len(), 1, "{other}");
    }
}

#[test]
fn an_xid_on_an_unknown_bus_is_ignored() {
    let kmsg = fixture("kmsg-xids.txt");
    let mut t = tracker();
    assert_eq!(t.scan(line_with(&kmsg, "PCI:0000:af:00")), []);
    assert!(t.reasons().is_empty());
    // A tracker that knows no GPU ignores every XID.
    let mut blind = XidTracker::new(XidPolicy::default());
    assert_eq!(blind.scan(&kmsg), []);
}

#[test]
fn operator_skip_list() {
    let policy = XidPolicy::parse_skip_list(" 79, 48 ,,oops");
    assert!(!policy.counts(79) && !policy.counts(48) && !policy.counts(13));
    assert!(policy.counts(94));
    assert_eq!(policy.skipped(), [13, 31, 43, 45, 48, 68, 79, 109]);
    let mut t = tracker_with(policy);
    assert_eq!(t.scan(&fixture("kmsg-xids.txt")), []);
    let events = t.scan(&fixture("dmesg-xids.txt"));
    let events: Vec<_> = events.iter().map(|e| (e.uuid.as_str(), e.code)).collect();
    assert_eq!(events, [(GPU0, 94), (GPU1, 63), (GPU0, 74)]);

    assert_eq!(XidPolicy::skipping([79]), XidPolicy::parse_skip_list("79"));
    for off in ["all", "XIDs", "48,all"] {
        let policy = XidPolicy::parse_skip_list(off);
        assert!(policy.is_disabled(), "{off}");
        assert!(!policy.counts(79), "{off}");
    }
    assert_eq!(XidPolicy::parse_skip_list(""), XidPolicy::default());
}

#[test]
fn a_record_read_twice_counts_once() {
    let kmsg = fixture("kmsg-xids.txt");
    let mut t = tracker();
    assert_eq!(t.scan(&kmsg).len(), 1);
    // The same records again (a new reader of /dev/kmsg starts at the oldest): nothing new.
    assert_eq!(t.scan(&kmsg), []);
    let line = line_with(&kmsg, "): 79,");
    assert_eq!(t.scan(line), []);
    // A later record with the same XID is new; the reason stays single.
    let later = line.replace("4,1388,120400015,", "4,1390,130000000,");
    assert_eq!(t.scan(&format!("{kmsg}{later}\n")).len(), 1);
    assert_eq!(t.reasons()[GPU1].len(), 1);

    // dmesg lines: the timestamp is the cursor; the same line twice counts once, another
    // line of the same microsecond counts.
    let mut t = tracker();
    let line = "[ 9123.456789] NVRM: Xid (PCI:0000:3b:00): 94, pid=7194, Contained: x";
    assert_eq!(t.scan(line).len(), 1);
    assert_eq!(t.scan(&format!("{line}\n{line}\n")), []);
    let twin = "[ 9123.456789] NVRM: Xid (PCI:0000:5e:00): 94, pid=7194, Contained: x";
    assert_eq!(t.scan(&format!("{line}\n{twin}\n")).len(), 1);
    let earlier = "[ 9000.000000] NVRM: Xid (PCI:0000:5e:00): 48, pid=1, DBE";
    assert_eq!(t.scan(earlier), []);
}

#[test]
fn a_driver_load_clears_the_xids_and_an_operator_can() {
    let kmsg = fixture("kmsg-xids.txt");
    let mut t = tracker();
    t.scan(&kmsg);
    assert!(!t.reasons().is_empty());
    let reload = "6,2000,900000000,-;NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  \
                  550.127.05  Release Build  (dvs-builder@U16-I2-C03-12-4)  Tue Oct 15 00:13:24 \
                  UTC 2024";
    // Quoted in another message (see `xid_line_shapes`), it clears nothing.
    t.scan(&format!(
        r#"5,1999,899000000,-;ptrace attach of "sh"[1] was attempted by "{}"[42]"#,
        reload.split_once(';').unwrap().1
    ));
    assert!(!t.reasons().is_empty());
    t.scan(reload);
    assert!(t.reasons().is_empty());
    // Records before the load stay read.
    assert_eq!(t.scan(&kmsg), []);

    let mut t = tracker();
    t.scan(&kmsg);
    assert!(!t.clear(GPU0));
    assert!(t.clear(GPU1));
    assert!(t.reasons().is_empty());
    assert_eq!(t.scan(&kmsg), [], "a cleared XID is not read again");
    t.scan("4,3000,990000000,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE");
    assert_eq!(t.reasons()[GPU0], [xid(48, "DBE")]);
    t.clear_all();
    assert!(t.reasons().is_empty());
}

#[test]
fn a_gpu_learnt_once_keeps_its_xids_when_missing_from_the_report() {
    // A GPU that fell off the bus may be missing from the next nvidia-smi: its XIDs still
    // find it, and the report lists it.
    let mut t = tracker();
    t.scan(&fixture("kmsg-xids.txt"));
    let mut report = report(a100s().into_iter().take(1).collect());
    t.apply(&mut report);
    let want = [gpu(GPU0, 0, BUS0, &[]), gpu(GPU1, 1, BUS1, &[fell_off()])];
    assert_eq!(report.gpus, want);
}

// --------------------------------------------------------------------------- report and DCGM

#[test]
fn dcgm_incidents_join_the_report_by_index_or_uuid() {
    let mut report = report(a100s());
    let memory = UnhealthyReason::dcgm("memory", "GPU 1 had uncorrectable memory errors");
    assert!(report.add_reason(GpuRef::Index(1), memory.clone()));
    assert!(report.add_reason(GpuRef::Uuid(GPU1), memory.clone()));
    assert!(!report.add_reason(GpuRef::Index(7), memory.clone()));
    assert!(!report.add_reason(GpuRef::Uuid("GPU-nope"), memory.clone()));
    let words = "DCGM memory: GPU 1 had uncorrectable memory errors";
    assert_eq!(memory.to_string(), words);
    assert_eq!(report.get(GPU1).unwrap().reasons, [memory]);
    assert_eq!(report.unhealthy().count(), 1);
}

/// Asserts that `reason` is `wire` in JSON, both ways.
#[track_caller]
fn assert_on_the_wire(reason: UnhealthyReason, wire: serde_json::Value) {
    assert_eq!(serde_json::to_value(&reason).unwrap(), wire);
    let back: UnhealthyReason = serde_json::from_value(wire).unwrap();
    assert_eq!(back, reason);
}

#[test]
fn reasons_on_the_wire() {
    assert_on_the_wire(
        fell_off(),
        json!({"kind": "xid", "code": 79, "message": "GPU has fallen off the bus"}),
    );
    assert_on_the_wire(
        UnhealthyReason::dcgm("PCIe", "x"),
        json!({"kind": "dcgm", "system": "PCIe", "message": "x"}),
    );
    for (reason, kind) in [
        (RowRemapPending, "row_remap_pending"),
        (RowRemapFailure, "row_remap_failure"),
        (RetiredPagesPending, "retired_pages_pending"),
    ] {
        assert_on_the_wire(reason, json!({ "kind": kind }));
    }
    assert_eq!(xid(43, "").to_string(), "XID 43");
}

// ------------------------------------------------------------------------------------ probe

/// A monitor of the kernel log at `kmsg`.
fn monitor(kmsg: &Path, policy: XidPolicy) -> XidMonitor {
    XidMonitor::new(Arc::new(Kmsg::at(kmsg)), policy)
}

/// `nvidia-smi -q` printing the fixture `name`.
fn smi_q(name: &str) -> CommandOutput {
    CommandOutput::ok(fixture(name))
}

/// A kernel log file the test appends records to.
struct LogFile {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl LogFile {
    fn new(text: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kmsg");
        fs_err::write(&path, text).unwrap();
        Self { _dir: dir, path }
    }

    fn append(&self, text: &str) {
        let old = fs_err::read_to_string(&self.path).unwrap();
        fs_err::write(&self.path, format!("{old}{text}")).unwrap();
    }

    /// A monitor of this log with the default policy.
    fn monitor(&self) -> XidMonitor {
        monitor(&self.path, XidPolicy::default())
    }
}

/// A runner with nothing scripted yet, a kernel log holding `log`, a monitor of it.
fn probed_host(log: &str) -> (ScriptedCommandRunner, LogFile, XidMonitor) {
    let log = LogFile::new(log);
    let xids = log.monitor();
    (ScriptedCommandRunner::new(), log, xids)
}

#[tokio::test]
async fn probe_reports_nvidia_smi_reasons_and_xids() {
    let (runner, log, xids) = probed_host(&fixture("kmsg-xids.txt"));
    runner.push("nvidia-smi", smi_q("nvidia-smi-q-a100x2-row-remap.txt"));
    let report = probe_nvidia_health(&runner, &xids).await;
    assert_eq!(runner.calls(), [["nvidia-smi", "-q"]]);
    assert_eq!(report.errors, NONE);
    let gpu1 = gpu(GPU1, 1, BUS1, &[RowRemapPending, fell_off()]);
    assert_eq!(report.gpus, [gpu(GPU0, 0, BUS0, &[RowRemapFailure]), gpu1]);

    // Recovery: the GPUs were reset and the driver reloaded; nvidia-smi shows them clean.
    runner.push("nvidia-smi", smi_q("nvidia-smi-q-a100x2.txt"));
    log.append("6,5000,999000000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.129.03\n");
    let report = probe_nvidia_health(&runner, &xids).await;
    assert_eq!(report.errors, NONE);
    assert_eq!(report.unhealthy_ids(), NONE);
}

#[tokio::test]
async fn probe_counts_an_xid_once_across_probes() {
    let (runner, log, xids) = probed_host(&fixture("kmsg-xids.txt"));
    runner.always("nvidia-smi", smi_q("nvidia-smi-q-a100x2.txt"));
    probe_nvidia_health(&runner, &xids).await;
    // Only records written after the first probe are new.
    assert_eq!(xids.poll().await.unwrap(), []);
    log.append("4,1400,200000000,-;NVRM: Xid (PCI:0000:3b:00): 94, pid=7, Contained: SM (0x1)\n");
    let events = xids.poll().await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].uuid, GPU0);
    let report = probe_nvidia_health(&runner, &xids).await;
    assert_eq!(report.unhealthy_ids(), [GPU0, GPU1]);
    let contained = xid(94, "Contained: SM (0x1)");
    assert_eq!(report.get(GPU0).unwrap().reasons, [contained]);
    // An operator puts GPU 1 back; the record is not read again.
    assert!(xids.clear(GPU1));
    let report = probe_nvidia_health(&runner, &xids).await;
    assert_eq!(report.unhealthy_ids(), [GPU0]);
}

/// XIDs logged before the shim started count once the GPUs' buses are known, also when the
/// first `nvidia-smi -q` fails: the kernel log is not read before (its records would be
/// passed over as XIDs of no known GPU, and never read again).
#[tokio::test]
async fn xids_before_the_first_complete_probe_are_not_lost() {
    let (runner, _log, xids) = probed_host(&fixture("kmsg-xids.txt"));
    runner.push("nvidia-smi", CommandOutput::exit(255, "Unknown Error"));
    runner.push("nvidia-smi", smi_q("nvidia-smi-q-a100x2.txt"));
    let first = probe_nvidia_health(&runner, &xids).await;
    assert!(!first.errors.is_empty());
    let report = probe_nvidia_health(&runner, &xids).await;
    assert_eq!(report.errors, NONE);
    assert_eq!(report.unhealthy_ids(), [GPU1]);
}

#[tokio::test]
async fn probe_with_failing_nvidia_smi_still_reports_xids() {
    let (runner, log, xids) = probed_host("");
    runner.push("nvidia-smi", smi_q("nvidia-smi-q-a100x2.txt"));
    let report = probe_nvidia_health(&runner, &xids).await;
    assert_eq!(report.unhealthy_ids(), NONE);

    // GPU 1 falls off the bus; nvidia-smi now fails.
    log.append(&fixture("kmsg-xids.txt"));
    let failure = "Unable to determine the device handle for GPU0000:5E:00.0: Unknown Error";
    runner.push("nvidia-smi", CommandOutput::exit(255, failure));
    let report = probe_nvidia_health(&runner, &xids).await;
    let errors = &report.errors;
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].starts_with("nvidia-smi -q failed"), "{errors:?}");
    assert!(errors[0].contains("Unknown Error"));
    assert_eq!(report.gpus, [gpu(GPU1, 1, BUS1, &[fell_off()])]);

    // nvidia-smi cannot even start.
    runner.push_spawn_error("nvidia-smi", "No such file or directory");
    let report = probe_nvidia_health(&runner, &xids).await;
    let cannot_run = "cannot run nvidia-smi: No such file or directory";
    assert_eq!(report.errors, [cannot_run]);
    assert_eq!(report.unhealthy_ids(), [GPU1]);
}

#[tokio::test]
async fn probe_with_unreadable_kernel_log_reports_nvidia_smi() {
    let runner = ScriptedCommandRunner::new();
    runner.always("nvidia-smi", smi_q("nvidia-smi-q-v100-retired-pending.txt"));
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-kmsg");
    let xids = monitor(&missing, XidPolicy::default());
    let report = probe_nvidia_health(&runner, &xids).await;
    let errors = &report.errors;
    assert_eq!(errors.len(), 1);
    let open_error = format!("open {}", missing.display());
    assert!(errors[0].starts_with(&open_error), "{errors:?}");
    assert_eq!(report.gpus[0].reasons, [RetiredPagesPending]);

    // With XID checks off, the log is not read at all.
    let xids = monitor(&missing, XidPolicy::disabled());
    let report = probe_nvidia_health(&runner, &xids).await;
    assert_eq!(report.errors, NONE);
}

#[tokio::test]
async fn reads_the_real_kernel_log_without_blocking() {
    // /dev/kmsg where the test may read it: every record, then no block at the end.
    let kmsg = Kmsg::default();
    if let Err(e) = fs_err::File::open(kmsg.path()) {
        // Where the test command says it runs as root (SHIM_TEST_ROOT=1), it must not skip.
        let root = std::env::var("SHIM_TEST_ROOT").is_ok_and(|v| v == "1");
        assert!(!root, "SHIM_TEST_ROOT=1, but {e}");
        eprintln!("skipped: {e}");
        return;
    }
    let text = kmsg.read().await.unwrap();
    let records = text.lines().all(|l| l.starts_with(' ') || l.contains(';'));
    assert!(records, "{text}");
}
