//! `filter_metrics`: upstream's own test case, the recorded payload, and the parsing corners
//! upstream's substring match does not care about.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test file: panics are failures

mod common;

use common::testdata;
use shim_dcgm::filter_metrics;

fn ids(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|s| (*s).to_owned()).collect()
}

// upstream: runner/internal/shim/dcgm/metrics_test.go (TestFilterMetrics), verbatim input and
// expected output: comments and blank lines dropped, HELP then TYPE once before the family's
// first kept sample, a family without HELP/TYPE kept bare, lines trimmed.
#[test]
fn upstreams_test_case() {
    let body = r#"
# Comment
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-0781f3bb-da15-f334-d5db-37b3f19542d0",pci_bus_id="00000000:00:1B.0",device="nvidia0",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 1365
DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-41cc2907-3249-5a6b-f0e4-d04063b183a9",pci_bus_id="00000000:00:1C.0",device="nvidia1",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 300
DCGM_FI_DEV_SM_CLOCK{gpu="2",UUID="GPU-cc8e8c03-ebaa-f217-8e4c-d9cd98e20aed",pci_bus_id="00000000:00:1D.0",device="nvidia2",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 300
DCGM_FI_DEV_SM_CLOCK{gpu="3",UUID="GPU-fb615fb7-3f5a-5600-0ab1-debad8dc80ee",pci_bus_id="00000000:00:1E.0",device="nvidia3",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 300

# HELP DCGM_FI_DEV_MEM_CLOCK Memory clock frequency (in MHz).
DCGM_FI_DEV_MEM_CLOCK{gpu="0",UUID="GPU-0781f3bb-da15-f334-d5db-37b3f19542d0",pci_bus_id="00000000:00:1B.0",device="nvidia0",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 5000
DCGM_FI_DEV_MEM_CLOCK{gpu="1",UUID="GPU-41cc2907-3249-5a6b-f0e4-d04063b183a9",pci_bus_id="00000000:00:1C.0",device="nvidia1",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 405
# comment
DCGM_FI_DEV_MEM_CLOCK{gpu="2",UUID="GPU-cc8e8c03-ebaa-f217-8e4c-d9cd98e20aed",pci_bus_id="00000000:00:1D.0",device="nvidia2",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 405
DCGM_FI_DEV_MEM_CLOCK{gpu="3",UUID="GPU-fb615fb7-3f5a-5600-0ab1-debad8dc80ee",pci_bus_id="00000000:00:1E.0",device="nvidia3",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 405
DCGM_FI_DEV_MEMORY_TEMP{gpu="0",UUID="GPU-0781f3bb-da15-f334-d5db-37b3f19542d0",pci_bus_id="00000000:00:1B.0",device="nvidia0",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 0
DCGM_FI_DEV_MEMORY_TEMP{gpu="1",UUID="GPU-41cc2907-3249-5a6b-f0e4-d04063b183a9",pci_bus_id="00000000:00:1C.0",device="nvidia1",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 0

DCGM_FI_DEV_MEMORY_TEMP{gpu="2",UUID="GPU-cc8e8c03-ebaa-f217-8e4c-d9cd98e20aed",pci_bus_id="00000000:00:1D.0",device="nvidia2",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 0
DCGM_FI_DEV_MEMORY_TEMP{gpu="3",UUID="GPU-fb615fb7-3f5a-5600-0ab1-debad8dc80ee",pci_bus_id="00000000:00:1E.0",device="nvidia3",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 0
	"#;
    let filtered = filter_metrics(
        body,
        &ids(&[
            "GPU-41cc2907-3249-5a6b-f0e4-d04063b183a9",
            "GPU-fb615fb7-3f5a-5600-0ab1-debad8dc80ee",
        ]),
    );
    let expected = r#"# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-41cc2907-3249-5a6b-f0e4-d04063b183a9",pci_bus_id="00000000:00:1C.0",device="nvidia1",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 300
DCGM_FI_DEV_SM_CLOCK{gpu="3",UUID="GPU-fb615fb7-3f5a-5600-0ab1-debad8dc80ee",pci_bus_id="00000000:00:1E.0",device="nvidia3",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 300
# HELP DCGM_FI_DEV_MEM_CLOCK Memory clock frequency (in MHz).
DCGM_FI_DEV_MEM_CLOCK{gpu="1",UUID="GPU-41cc2907-3249-5a6b-f0e4-d04063b183a9",pci_bus_id="00000000:00:1C.0",device="nvidia1",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 405
DCGM_FI_DEV_MEM_CLOCK{gpu="3",UUID="GPU-fb615fb7-3f5a-5600-0ab1-debad8dc80ee",pci_bus_id="00000000:00:1E.0",device="nvidia3",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 405
DCGM_FI_DEV_MEMORY_TEMP{gpu="1",UUID="GPU-41cc2907-3249-5a6b-f0e4-d04063b183a9",pci_bus_id="00000000:00:1C.0",device="nvidia1",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 0
DCGM_FI_DEV_MEMORY_TEMP{gpu="3",UUID="GPU-fb615fb7-3f5a-5600-0ab1-debad8dc80ee",pci_bus_id="00000000:00:1E.0",device="nvidia3",modelName="Tesla T4",Hostname="ip-172-31-16-106",DCGM_FI_DRIVER_VERSION="535.183.06"} 0
"#;
    assert_eq!(filtered, expected);
}

#[test]
fn families_whose_samples_are_all_dropped_leave_no_metadata() {
    let text = "\
# HELP a_metric Only GPU-B has it.
# TYPE a_metric gauge
a_metric{gpu=\"1\",UUID=\"GPU-B\"} 1
# HELP b_metric Both.
# TYPE b_metric counter
b_metric{gpu=\"0\",UUID=\"GPU-A\"} 2
b_metric{gpu=\"1\",UUID=\"GPU-B\"} 3
# HELP c_metric Nobody: no samples at all.
# TYPE c_metric gauge
# TYPE d_metric gauge
d_metric{UUID=\"GPU-A\"} 4
";
    assert_eq!(
        filter_metrics(text, &ids(&["GPU-A"])),
        "\
# HELP b_metric Both.
# TYPE b_metric counter
b_metric{gpu=\"0\",UUID=\"GPU-A\"} 2
# TYPE d_metric gauge
d_metric{UUID=\"GPU-A\"} 4
"
    );
}

#[test]
fn label_values_are_parsed_not_searched() {
    let text = r#"# HELP m Escapes and lookalikes.
# TYPE m gauge
m{UUID="GPU-A",err_msg="a \"quoted\" } brace, comma \\ and\nnewline"} 1
m{UUID="GPU-AB",Hostname="GPU-A"} 2
m{Hostname="host-GPU-A",UUID="GPU-B"} 3
m{ UUID = "GPU-A" , pod = "x" , } 4 1700000000000
m{uuid="GPU-A"} 5
m{UUID="GPU-A" 6
garbage line with GPU-A
"#;
    assert_eq!(
        filter_metrics(text, &ids(&["GPU-A"])),
        r#"# HELP m Escapes and lookalikes.
# TYPE m gauge
m{UUID="GPU-A",err_msg="a \"quoted\" } brace, comma \\ and\nnewline"} 1
m{ UUID = "GPU-A" , pod = "x" , } 4 1700000000000
m{uuid="GPU-A"} 5
"#
    );
}

#[test]
fn each_sample_once_even_when_ids_repeat() {
    let text = "m{UUID=\"GPU-A\"} 1\r\nm{UUID=\"GPU-B\"} 2\r\n";
    assert_eq!(
        filter_metrics(text, &ids(&["GPU-A", "GPU-A", "GPU-B"])),
        "m{UUID=\"GPU-A\"} 1\nm{UUID=\"GPU-B\"} 2\n"
    );
}

#[test]
fn every_sample_of_the_recorded_payload_parses() {
    let payload = testdata("dcgm-exporter-8xA800-mig.prom");
    let mut samples = 0;
    for line in payload.lines().filter(|l| !l.starts_with('#')) {
        let s = shim_dcgm::parse_sample(line).unwrap();
        assert!(s.label("UUID").unwrap().starts_with("GPU-"));
        assert_eq!(s.label("modelName"), Some("NVIDIA A800-SXM4-80GB"));
        samples += 1;
    }
    assert_eq!(samples, 7 * 10 + 2 * 7);
    // All eight GPUs together keep everything.
    let all: Vec<String> = payload
        .lines()
        .filter_map(|l| shim_dcgm::parse_sample(l).ok())
        .map(|s| s.label("UUID").unwrap().to_owned())
        .collect();
    assert_eq!(filter_metrics(&payload, &all), payload);
}
