//! The collectors file given to the exporter (`-f`): upstream's list of DCGM fields, written as
//! CSV the way Go's `encoding/csv` writes it.

/// One line of the exporter's collectors CSV (dcgm-exporter calls them "counters"; any
/// Prometheus type is allowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    /// The DCGM field, e.g. `DCGM_FI_DEV_GPU_UTIL`.
    pub name: &'static str,
    /// The Prometheus type: `gauge` or `counter`.
    pub kind: &'static str,
    /// The `# HELP` text.
    pub help: &'static str,
}

const fn c(name: &'static str, kind: &'static str, help: &'static str) -> Counter {
    Counter { name, kind, help }
}

/// The fields upstream collects, in upstream's order (`runner/internal/shim/dcgm/exporter.go`,
/// `counters`; full list of fields:
/// <https://docs.nvidia.com/datacenter/dcgm/latest/dcgm-api/dcgm-api-field-ids.html>).
pub const COUNTERS: &[Counter] = &[
    c("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    c(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "gauge",
        "Memory utilization (in %).",
    ),
    c(
        "DCGM_FI_DEV_ENC_UTIL",
        "gauge",
        "Encoder utilization (in %).",
    ),
    c(
        "DCGM_FI_DEV_DEC_UTIL",
        "gauge",
        "Decoder utilization (in %).",
    ),
    c(
        "DCGM_FI_DEV_FB_FREE",
        "gauge",
        "Framebuffer memory free (in MiB).",
    ),
    c(
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Framebuffer memory used (in MiB).",
    ),
    c(
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "The ratio of cycles during which a graphics engine or compute engine remains active.",
    ),
    c(
        "DCGM_FI_PROF_SM_ACTIVE",
        "gauge",
        "The ratio of cycles an SM has at least 1 warp assigned.",
    ),
    c(
        "DCGM_FI_PROF_SM_OCCUPANCY",
        "gauge",
        "The ratio of number of warps resident on an SM.",
    ),
    c(
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
    ),
    c(
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
        "gauge",
        "Ratio of cycles the fp64 pipes are active.",
    ),
    c(
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
        "gauge",
        "Ratio of cycles the fp32 pipes are active.",
    ),
    c(
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
        "gauge",
        "Ratio of cycles the fp16 pipes are active.",
    ),
    c(
        "DCGM_FI_PROF_PIPE_INT_ACTIVE",
        "gauge",
        "Ratio of cycles the integer pipe is active.",
    ),
    c(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
    ),
    c(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "counter",
        "The number of bytes of active PCIe tx (transmit) data including both header and payload.",
    ),
    c(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "counter",
        "The number of bytes of active PCIe rx (read) data including both header and payload.",
    ),
    c(
        "DCGM_FI_DEV_SM_CLOCK",
        "gauge",
        "SM clock frequency (in MHz).",
    ),
    c(
        "DCGM_FI_DEV_MEM_CLOCK",
        "gauge",
        "Memory clock frequency (in MHz).",
    ),
    c(
        "DCGM_FI_DEV_MEMORY_TEMP",
        "gauge",
        "Memory temperature (in C).",
    ),
    c("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    c("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    c(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
    ),
    c(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "counter",
        "Total number of PCIe retries.",
    ),
    c(
        "DCGM_FI_DEV_XID_ERRORS",
        "gauge",
        "Value of the last XID error encountered.",
    ),
    c(
        "DCGM_FI_DEV_POWER_VIOLATION",
        "counter",
        "Throttling duration due to power constraints (in us).",
    ),
    c(
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in us).",
    ),
    c(
        "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
        "counter",
        "Throttling duration due to sync-boost constraints (in us).",
    ),
    c(
        "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
        "counter",
        "Throttling duration due to board limit constraints (in us).",
    ),
    c(
        "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
        "counter",
        "Throttling duration due to low utilization (in us).",
    ),
    c(
        "DCGM_FI_DEV_RELIABILITY_VIOLATION",
        "counter",
        "Throttling duration due to reliability constraints (in us).",
    ),
    c(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Total number of single-bit volatile ECC errors.",
    ),
    c(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors.",
    ),
    c(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "counter",
        "Total number of single-bit persistent ECC errors.",
    ),
    c(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "counter",
        "Total number of double-bit persistent ECC errors.",
    ),
    c(
        "DCGM_FI_DEV_RETIRED_SBE",
        "counter",
        "Total number of retired pages due to single-bit errors.",
    ),
    c(
        "DCGM_FI_DEV_RETIRED_DBE",
        "counter",
        "Total number of retired pages due to double-bit errors.",
    ),
    c(
        "DCGM_FI_DEV_RETIRED_PENDING",
        "counter",
        "Total number of pages pending retirement.",
    ),
    c(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    c(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
    ),
    c(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed",
    ),
    c(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink flow-control CRC errors.",
    ),
    c(
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink data CRC errors.",
    ),
    c(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink retries.",
    ),
    c(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink recovery errors.",
    ),
    c(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes.",
    ),
    c(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_L0",
        "counter",
        "The number of bytes of active NVLink rx or tx data including both header and payload.",
    ),
    c(
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "counter",
        "The number of bytes of active PCIe rx (read) data including both header and payload. ",
    ),
    c(
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "counter",
        "The number of bytes of active NvLink tx (transmit) data including both header and payload. ",
    ),
];

/// The collectors file's content: one `name,type,help` record per counter, each ending in
/// `\n`, quoted where Go's `csv.Writer` quotes (`fieldNeedsQuotes`).
pub fn counters_csv(counters: &[Counter]) -> String {
    let mut out = String::new();
    for counter in counters {
        for (i, field) in [counter.name, counter.kind, counter.help]
            .iter()
            .enumerate()
        {
            if i > 0 {
                out.push(',');
            }
            push_csv_field(&mut out, field);
        }
        out.push('\n');
    }
    out
}

fn push_csv_field(out: &mut String, field: &str) {
    let needs_quotes = !field.is_empty()
        && (field == r"\."
            || field.contains([',', '"', '\r', '\n'])
            || field.starts_with(char::is_whitespace));
    if !needs_quotes {
        out.push_str(field);
        return;
    }
    out.push('"');
    for ch in field.chars() {
        if ch == '"' {
            out.push('"');
        }
        out.push(ch);
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    // upstream: runner/internal/shim/dcgm/exporter.go (counters: 49 fields, GPU_UTIL first,
    // NVLINK_TX_BYTES last, written with encoding/csv)
    #[test]
    fn upstreams_list_as_csv() {
        assert_eq!(COUNTERS.len(), 49);
        let csv = counters_csv(COUNTERS);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 49);
        assert_eq!(
            lines[0],
            "DCGM_FI_DEV_GPU_UTIL,gauge,GPU utilization (in %)."
        );
        assert_eq!(
            lines[48],
            "DCGM_FI_PROF_NVLINK_TX_BYTES,counter,The number of bytes of active NvLink tx \
             (transmit) data including both header and payload. "
        );
        assert!(csv.ends_with('\n'));
    }

    #[test]
    fn fields_are_quoted_like_go_csv() {
        let csv = counters_csv(&[
            c("A", "gauge", "x, y"),
            c("B", "gauge", "say \"hi\""),
            c("C", "gauge", " leading space"),
            c("D", "gauge", ""),
        ]);
        assert_eq!(
            csv,
            "A,gauge,\"x, y\"\nB,gauge,\"say \"\"hi\"\"\"\nC,gauge,\" leading space\"\nD,gauge,\n"
        );
    }
}
