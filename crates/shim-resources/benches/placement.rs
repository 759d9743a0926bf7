//! GPU placement by interconnect: the cost of one `gpu::choose` call.
//!
//! `cargo bench -p shim-resources --bench placement -- [--quick] [--json PATH]`
//!
//! Measures, with `std::time::Instant` around each call over many calls (each series bounded
//! in time), `choose(Some(&topology), free, k)` with every GPU free:
//! - on 8 GPUs, k = 1, 2, 4, 8: the recorded H100 NVSwitch matrix (`NV18` everywhere, two
//!   NUMA nodes: nothing prunes the search) and the recorded two-socket PCIe matrix
//!   (`PIX`/`PXB`/`SYS`), both from `testdata/gpu/topo/`;
//! - on 16 GPUs, k = 2, 4, 8, 12: a synthetic two-socket PCIe box (`PIX` pairs, `PXB`
//!   quads, `NODE` within a socket, `SYS` across; NUMA node = socket) and a synthetic
//!   NVSwitch box (`NV12` everywhere, two NUMA nodes).
//!
//! Prints a table (mean, median, p99, max in ns, and the set chosen); with `--json PATH`
//! also writes the figures as JSON. No figure is asserted. Run without `--bench` (as `cargo
//! test --all-targets` does), it makes a quick smoke run.
#![allow(
    clippy::print_stdout,
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark program that reports to the person running it"
)]

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use shim_resources::gpu::{Link, Topology, choose, parse_nvidia_topo};

/// Command-line options.
struct Opts {
    quick: bool,
    json: Option<PathBuf>,
}

fn opts() -> Opts {
    let mut opts = Opts {
        quick: false,
        json: None,
    };
    // `cargo bench` passes `--bench`; without it (`cargo test --all-targets` runs this too)
    // only a quick smoke run is made.
    let mut benching = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => opts.quick = true,
            "--bench" => benching = true,
            "--json" => opts.json = Some(PathBuf::from(args.next().expect("--json PATH"))),
            _ => {}
        }
    }
    opts.quick |= !benching;
    opts
}

/// One series: the timings of `choose` on one topology and one `k`.
struct Stats {
    topology: &'static str,
    gpus: usize,
    k: usize,
    chosen: Vec<u32>,
    samples: Vec<Duration>,
}

impl Stats {
    fn pct(&self, p: usize) -> Duration {
        if self.samples.is_empty() {
            return Duration::ZERO;
        }
        self.samples[(self.samples.len() - 1) * p / 100]
    }

    fn mean(&self) -> Duration {
        let n = u32::try_from(self.samples.len().max(1)).unwrap_or(u32::MAX);
        self.samples.iter().sum::<Duration>() / n
    }

    fn json(&self) -> Value {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        json!({
            "topology": self.topology,
            "gpus": self.gpus,
            "k": self.k,
            "chosen": self.chosen,
            "n": self.samples.len(),
            "mean_ns": ns(self.mean()),
            "p50_ns": ns(self.pct(50)),
            "p99_ns": ns(self.pct(99)),
            "max_ns": ns(self.pct(100)),
        })
    }

    fn print(&self) {
        let ns = |d: Duration| d.as_nanos();
        println!(
            "  {:<24} {:>4} {:>3} {:>7} {:>10} {:>10} {:>10} {:>10}  {:?}",
            self.topology,
            self.gpus,
            self.k,
            self.samples.len(),
            ns(self.mean()),
            ns(self.pct(50)),
            ns(self.pct(99)),
            ns(self.pct(100)),
            self.chosen,
        );
    }
}

fn fixture(name: &str) -> Topology {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/gpu/topo")
        .join(name);
    parse_nvidia_topo(&fs_err::read_to_string(path).unwrap()).unwrap()
}

/// 16 PCIe GPUs on two sockets: `PIX` pairs, `PXB` quads, `NODE` within a socket, `SYS`
/// across; NUMA node = socket.
fn pcie_16() -> Topology {
    Topology::from_fn(
        0..16,
        |a, b| {
            if a / 2 == b / 2 {
                Link::Pix
            } else if a / 4 == b / 4 {
                Link::Pxb
            } else if a / 8 == b / 8 {
                Link::Node
            } else {
                Link::Sys
            }
        },
        |g| Some(g / 8),
    )
}

/// 16 GPUs on an NVSwitch (`NV12` everywhere), two NUMA nodes.
fn nvswitch_16() -> Topology {
    Topology::from_fn(0..16, |_, _| Link::NvLink(12), |g| Some(g / 8))
}

fn series(topology: &'static str, topo: &Topology, k: usize, quick: bool) -> Stats {
    let free: Vec<u32> = topo.gpus().to_vec();
    let (max_calls, budget) = if quick {
        (200, Duration::from_millis(50))
    } else {
        (20_000, Duration::from_secs(2))
    };
    let chosen = choose(Some(topo), &free, k).unwrap();
    let mut samples = Vec::with_capacity(max_calls);
    let started = Instant::now();
    for i in 0..max_calls {
        if i >= 10 && started.elapsed() > budget {
            break;
        }
        let t = Instant::now();
        let out = choose(black_box(Some(topo)), black_box(&free), black_box(k));
        samples.push(t.elapsed());
        black_box(out);
    }
    samples.sort();
    Stats {
        topology,
        gpus: free.len(),
        k,
        chosen,
        samples,
    }
}

fn main() {
    let opts = opts();
    let h100 = fixture("h100-nvswitch-8gpu.txt");
    let pcie8 = fixture("pcie-2socket-8gpu.txt");
    let pcie16 = pcie_16();
    let nv16 = nvswitch_16();
    let cases: [(&'static str, &Topology, &[usize]); 4] = [
        ("8 H100 NVSwitch", &h100, &[1, 2, 4, 8]),
        ("8 PCIe 2-socket", &pcie8, &[1, 2, 4, 8]),
        ("16 PCIe 2-socket (syn.)", &pcie16, &[2, 4, 8, 12]),
        ("16 NVSwitch (syn.)", &nv16, &[2, 4, 8, 12]),
    ];
    let started = Instant::now();
    println!("gpu::choose, every GPU free (times in ns):");
    println!(
        "  {:<24} {:>4} {:>3} {:>7} {:>10} {:>10} {:>10} {:>10}  chosen",
        "topology", "gpus", "k", "calls", "mean", "p50", "p99", "max"
    );
    let mut all = Vec::new();
    for (name, topo, ks) in cases {
        for &k in ks {
            let stats = series(name, topo, k, opts.quick);
            stats.print();
            all.push(stats);
        }
    }
    println!("  (total {:.1?})", started.elapsed());
    if let Some(path) = opts.json {
        let value = json!({
            "benchmarks": all.iter().map(Stats::json).collect::<Vec<_>>(),
        });
        fs_err::write(&path, serde_json::to_vec_pretty(&value).unwrap()).unwrap();
    }
}
