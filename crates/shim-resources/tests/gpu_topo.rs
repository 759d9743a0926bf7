//! GPU placement by interconnect: `nvidia-smi topo -m` matrices recorded on real machines
//! (`testdata/gpu/topo/`, each test names the thread it was copied from), the placement rule
//! on them, properties of `choose` on random matrices, and the detector running the tool.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)] // a test file: panics are failures

use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use shim_resources::gpu::{Link, SetScore, Topology, choose, parse_nvidia_topo};
use shim_resources::{GpuDetector, ResourcesError};
use shim_util::fake::ScriptedCommandRunner;
use shim_util::{CommandError, CommandOutput};

fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/gpu/topo")
        .join(name);
    fs_err::read_to_string(p).unwrap()
}

fn topo(name: &str) -> Topology {
    parse_nvidia_topo(&fixture(name)).unwrap()
}

/// `choose` with every GPU of `topo` free but those `taken`, in index order.
fn pick(topo: &Topology, taken: &[u32], k: usize) -> Vec<u32> {
    let free: Vec<u32> = topo
        .gpus()
        .iter()
        .copied()
        .filter(|g| !taken.contains(g))
        .collect();
    choose(Some(topo), &free, k).unwrap()
}

// ------------------------------------------------------------------------------ the fixtures

/// 8× H100 SXM on NVSwitch, two NUMA nodes, copied from
/// https://github.com/HazyResearch/ThunderKittens/issues/167
#[test]
fn h100_nvswitch_parses() {
    let t = topo("h100-nvswitch-8gpu.txt");
    assert_eq!(t.gpus(), [0, 1, 2, 3, 4, 5, 6, 7]);
    for a in 0..8 {
        for b in 0..8 {
            let want = (a != b).then_some(Link::NvLink(18));
            assert_eq!(t.link(a, b), want, "GPU{a}-GPU{b}");
        }
        assert_eq!(t.numa_nodes(a), Some(&[a / 4][..]));
    }
}

/// 4× A30 with NVLink bridges in pairs (and one NIC), copied from the `collect_env.py`
/// output in https://github.com/vllm-project/vllm/issues/29070
#[test]
fn a30_bridged_pairs_parse() {
    let t = topo("a30-nvlink-pairs-4gpu.txt");
    assert_eq!(t.gpus(), [0, 1, 2, 3]);
    assert_eq!(t.link(0, 1), Some(Link::NvLink(4)));
    assert_eq!(t.link(3, 2), Some(Link::NvLink(4)));
    for (a, b) in [(0, 2), (0, 3), (1, 2), (1, 3)] {
        assert_eq!(t.link(a, b), Some(Link::Sys), "GPU{a}-GPU{b}");
    }
    assert_eq!(t.link(0, 0), None);
    assert_eq!(t.link(0, 4), None, "NIC0 is not a GPU");
    let numa: Vec<_> = (0..4).map(|g| t.numa_nodes(g)).collect();
    assert_eq!(numa, [Some(&[0][..]), Some(&[0]), Some(&[1]), Some(&[1])]);
}

/// 8 PCIe GPUs behind switches on two sockets, an `mlx5_0` NIC, no "NUMA Affinity" column,
/// tab-separated; copied from the comment of 2018-01-09 in
/// https://github.com/lattice/quda/issues/669
#[test]
fn pcie_two_sockets_parse() {
    let t = topo("pcie-2socket-8gpu.txt");
    assert_eq!(t.gpus(), [0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(t.link(0, 1), Some(Link::Pix));
    assert_eq!(t.link(2, 3), Some(Link::Pix));
    assert_eq!(t.link(0, 2), Some(Link::Pxb));
    assert_eq!(t.link(3, 4), Some(Link::Sys));
    assert_eq!(t.link(6, 7), Some(Link::Pix));
    assert_eq!(t.link(5, 7), Some(Link::Pxb));
    assert!((0..8).all(|g| t.numa_nodes(g).is_none()));
}

/// 8× RTX 4090, every pair `SYS`, NUMA 0 and 1, two NICs, tab-separated; copied from
/// https://github.com/NVIDIA/go-gpuallocator/issues/17
#[test]
fn rtx4090_all_sys_parses() {
    let t = topo("rtx4090-2numa-8gpu.txt");
    assert_eq!(t.gpus().len(), 8);
    assert!((1..8).all(|b| t.link(0, b) == Some(Link::Sys)));
    assert_eq!(t.numa_nodes(3), Some(&[0][..]));
    assert_eq!(t.numa_nodes(4), Some(&[1][..]));
}

/// The header some drivers underline with terminal escapes (litgpt parses `\x1b[4mGPU0` for
/// it): read as the plain one. It used to be taken for a row, and the matrix refused, so
/// GPUs went first-free, across sockets.
#[test]
fn an_underlined_header_parses() {
    let text = "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n\
                GPU0\t X \tNV4\tSYS\tSYS\t0-23,48-71\t0\t\tN/A\n\
                GPU1\tNV4\t X \tSYS\tSYS\t0-23,48-71\t0\t\tN/A\n\
                GPU2\tSYS\tSYS\t X \tNV4\t24-47,72-95\t1\t\tN/A\n\
                GPU3\tSYS\tSYS\tNV4\t X \t24-47,72-95\t1\t\tN/A\n";
    let t = parse_nvidia_topo(text).unwrap();
    assert_eq!(t.gpus(), [0, 1, 2, 3]);
    assert_eq!(t.link(2, 3), Some(Link::NvLink(4)));
    assert_eq!(t.numa_nodes(3), Some(&[1][..]));
    assert_eq!(pick(&t, &[0], 2), [2, 3]);
}

/// 5 PCIe GPUs: one alone on NUMA node 1, four on node 0 (`PHB` pairs joined by `NODE`);
/// copied from https://github.com/noonghunna/club-3090/issues/46
#[test]
fn mixed_five_parses() {
    let t = topo("mixed-2numa-5gpu.txt");
    assert_eq!(t.gpus(), [0, 1, 2, 3, 4]);
    assert_eq!(t.link(1, 2), Some(Link::Phb));
    assert_eq!(t.link(2, 3), Some(Link::Node));
    assert_eq!(t.link(4, 3), Some(Link::Phb));
    assert_eq!(t.link(0, 4), Some(Link::Sys));
    assert_eq!(t.numa_nodes(0), Some(&[1][..]));
    assert_eq!(t.numa_nodes(1), Some(&[0][..]));
}

/// A DGX A100 whose "NUMA Affinity" is a range (`6-7`), `mlx5_<n>` columns, tabs: the
/// header and GPU rows as published in https://github.com/rapidsai/ucx-py/issues/749 (the
/// NIC rows left out).
#[test]
fn numa_affinity_ranges_parse() {
    let out = "\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tmlx5_1\tmlx5_2\tmlx5_3\tmlx5_4\tmlx5_5\tmlx5_6\tmlx5_7\tmlx5_8\tmlx5_9\tmlx5_10\tmlx5_11\tCPU Affinity\tNUMA Affinity\n\
GPU0\t X \tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t112-127,240-255\t6-7\n\
GPU1\tPXB\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t112-127,240-255\t6-7\n\
GPU2\tSYS\tSYS\t X \tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t112-127,240-255\t6-7\n\
GPU3\tSYS\tSYS\tPXB\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t112-127,240-255\t6-7\n\
GPU4\tSYS\tSYS\tSYS\tSYS\t X \tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\t112-127,240-255\t6-7\n\
GPU5\tSYS\tSYS\tSYS\tSYS\tPXB\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\tSYS\tSYS\t112-127,240-255\t6-7\n\
GPU6\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\t X \tPXB\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\t112-127,240-255\t6-7\n\
GPU7\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\t X \tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tSYS\tPXB\tPXB\tSYS\tSYS\t112-127,240-255\t6-7\n";
    let t = parse_nvidia_topo(out).unwrap();
    assert_eq!(t.gpus().len(), 8);
    assert_eq!(t.numa_nodes(5), Some(&[6, 7][..]));
    assert_eq!(t.link(6, 7), Some(Link::Pxb));
    assert_eq!(t.link(1, 2), Some(Link::Sys));
    // One affinity for all: the PXB pairs decide.
    assert_eq!(pick(&t, &[0], 2), [2, 3]);
}

// ---------------------------------------------------------------------------- the placement

/// A row of `placement_on_recorded_boxes`: its name, the box, the GPUs taken, how many are
/// asked for, the GPUs chosen.
type Placement<'a> = (&'a str, &'a Topology, &'a [u32], usize, &'a [u32]);

/// `choose` on the recorded boxes above, GPUs free in index order but those taken.
#[test]
fn placement_on_recorded_boxes() {
    let a30 = topo("a30-nvlink-pairs-4gpu.txt");
    let pcie = topo("pcie-2socket-8gpu.txt");
    let h100 = topo("h100-nvswitch-8gpu.txt");
    let rtx = topo("rtx4090-2numa-8gpu.txt");
    let mixed = topo("mixed-2numa-5gpu.txt");
    let cases: [Placement<'_>; 18] = [
        // The links of the pairs chosen are checked by the `*_parse` tests above.
        ("a30_a_bridged_pair", &a30, &[], 2, &[0, 1]),
        // Not first-free's [1, 2] across sockets.
        ("a30_the_intact_pair", &a30, &[0], 2, &[2, 3]),
        // GPU1, which leaves the pair GPU2-GPU3 whole.
        ("a30_one_with_gpu0_taken", &a30, &[0], 1, &[1]),
        ("a30_all_four", &a30, &[], 4, &[0, 1, 2, 3]),
        ("pcie_4_on_a_socket", &pcie, &[], 4, &[0, 1, 2, 3]),
        // Not [1, 2, 3, 4] across the sockets.
        ("pcie_other_socket", &pcie, &[0], 4, &[4, 5, 6, 7]),
        ("pcie_two_a_pix_pair", &pcie, &[], 2, &[0, 1]),
        // The PIX pair GPU2-GPU3, not the PXB pair [1, 2].
        ("pcie_the_pix_pair", &pcie, &[0], 2, &[2, 3]),
        // All links equal: the NUMA preference still holds.
        ("nvswitch_4_of_node_1", &h100, &[1], 4, &[4, 5, 6, 7]),
        ("nvswitch_3_of_node_0", &h100, &[1], 3, &[0, 2, 3]),
        ("all_sys_4_on_a_node", &rtx, &[], 4, &[0, 1, 2, 3]),
        ("all_sys_4_of_node_1", &rtx, &[0], 4, &[4, 5, 6, 7]),
        ("all_sys_3_of_node_0", &rtx, &[0], 3, &[1, 2, 3]),
        ("all_sys_five", &rtx, &[], 5, &[0, 1, 2, 3, 4]),
        ("mixed_a_phb_pair", &mixed, &[], 2, &[1, 2]),
        ("mixed_other_phb_pair", &mixed, &[1], 2, &[3, 4]),
        ("mixed_4_of_node_0", &mixed, &[], 4, &[1, 2, 3, 4]),
        // The loner on node 1, which leaves node 0's four together.
        ("mixed_one_spares_node_0", &mixed, &[], 1, &[0]),
    ];
    for (name, t, taken, k, want) in cases {
        assert_eq!(pick(t, taken, k), want, "{name}");
    }
    // NVSwitch, all links equal: first-free for every k.
    let free: Vec<u32> = (0..8).collect();
    for k in 0..=8 {
        assert_eq!(choose(Some(&h100), &free, k).unwrap(), free[..k], "k={k}");
    }
    // The order of the free list breaks ties: the first socket in that order.
    let reversed: Vec<u32> = (0..8).rev().collect();
    assert_eq!(choose(Some(&pcie), &reversed, 4).unwrap(), [7, 6, 5, 4]);
}

#[test]
fn first_free_without_topology_or_with_unknown_gpus() {
    let t = topo("a30-nvlink-pairs-4gpu.txt");
    assert_eq!(choose(None, &[3, 1, 2], 2).unwrap(), [3, 1]);
    // GPU 9 is not in the matrix: first-free.
    assert_eq!(choose(Some(&t), &[1, 2, 9, 3], 2).unwrap(), [1, 2]);
    assert_eq!(choose(Some(&t), &[1, 2], 3), None);
    assert_eq!(choose(None, &[1, 2], 3), None);
    assert_eq!(choose(Some(&t), &[], 0).unwrap(), Vec::<u32>::new());
    // A repeated index counts once.
    assert_eq!(choose(Some(&t), &[0, 0, 1], 3), None);
    assert_eq!(choose(Some(&t), &[0, 2, 0, 3], 2).unwrap(), [2, 3]);
}

#[test]
fn set_scores_order() {
    let t = topo("a30-nvlink-pairs-4gpu.txt");
    let score = |numa_nodes, links| SetScore { numa_nodes, links };
    let pair = t.score(&[2, 3]).unwrap();
    let across = t.score(&[1, 2]).unwrap();
    assert_eq!(pair, score(1, 400));
    assert_eq!(across, score(2, 10));
    assert!(pair > across);
    assert_eq!(t.score(&[2, 2]), None);
    assert_eq!(t.score(&[2, 7]), None);
}

// --------------------------------------------------------------------------- parse failures

#[test]
fn unreadable_matrices_are_errors() {
    // The rows of a two-GPU matrix under its header.
    let two = |rows: &str| format!("\tGPU0\tGPU1\n{rows}");
    let cases = [
        (String::new(), None, "no header"),
        ("NVIDIA-SMI has failed\n".to_owned(), None, "no header"),
        (two("GPU0\t X \tNV4\nGPU1\tNV4\n"), Some(3), "1 cells"),
        (
            two("GPU0\t X \tABC\nGPU1\tABC\t X \n"),
            Some(2),
            "unknown link \"ABC\" between GPU0 and GPU1",
        ),
        (two("GPU0\tPIX\tPIX\nGPU1\tPIX\t X \n"), Some(2), "own cell"),
        (two("GPU0\t X \tPIX\n"), Some(1), "do not match"),
        (
            two("GPU0\t X \tPIX\nGPU0\t X \tPIX\nGPU1\tPIX\t X \n"),
            Some(3),
            "two rows",
        ),
    ];
    for (out, line, why) in cases {
        match parse_nvidia_topo(&out) {
            Err(ResourcesError::TopoMatrix { line: l, why: w }) => {
                assert_eq!(l, line, "{out:?}");
                assert!(w.contains(why), "{out:?}: {w}");
            }
            other => panic!("{out:?}: {other:?}"),
        }
    }
    let e = parse_nvidia_topo("\tGPU0\tGPU1\nGPU0\t X \tABC\nGPU1\tABC\t X \n").unwrap_err();
    assert_eq!(
        e.to_string(),
        "cannot parse the nvidia-smi topo -m matrix at line 2: unknown link \"ABC\" between \
         GPU0 and GPU1"
    );
}

#[test]
fn older_drivers_soc_and_one_gpu() {
    // Older drivers print SOC for SYS and no affinity columns at all.
    let t = parse_nvidia_topo("\tGPU0\tGPU1\nGPU0\t X \tSOC\nGPU1\tSOC\t X \n").unwrap();
    assert_eq!(t.link(0, 1), Some(Link::Sys));
    assert_eq!(t.numa_nodes(0), None);
    let one = parse_nvidia_topo(
        "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-7\t\tN/A\t\tN/A\n",
    )
    .unwrap();
    assert_eq!(one.gpus(), [0]);
    assert_eq!(one.numa_nodes(0), None);
}

// ---------------------------------------------------------------------------- the detector

#[tokio::test]
async fn detector_runs_nvidia_smi_topo() {
    let runner = Arc::new(ScriptedCommandRunner::new());
    let matrix = CommandOutput::ok(fixture("a30-nvlink-pairs-4gpu.txt"));
    runner.push("nvidia-smi", matrix);
    let detector = GpuDetector::new(runner.clone());
    let t = detector.topology().await.unwrap();
    assert_eq!(t.link(0, 1), Some(Link::NvLink(4)));
    assert_eq!(runner.calls(), [["nvidia-smi", "topo", "-m"]]);

    let failed = CommandOutput::exit(9, "NVIDIA-SMI has failed");
    runner.push("nvidia-smi", failed);
    assert!(matches!(
        detector.topology().await,
        Err(ResourcesError::Command(CommandError::Failed { .. }))
    ));
    runner.push("nvidia-smi", CommandOutput::ok("No devices were found\n"));
    assert!(matches!(
        detector.topology().await,
        Err(ResourcesError::TopoMatrix { line: None, .. })
    ));
}

// ------------------------------------------------------------------------------ properties

fn any_link() -> impl Strategy<Value = Link> {
    prop_oneof![
        Just(Link::Sys),
        Just(Link::Node),
        Just(Link::Phb),
        Just(Link::Pxb),
        Just(Link::Pix),
        (1u32..=18).prop_map(Link::NvLink),
    ]
}

/// A random topology of `0..n` (links and NUMA nodes, some unknown), a free list in random
/// order and a `k` up to two more than it.
fn any_request(max_gpus: usize) -> impl Strategy<Value = Request> {
    request(1..=max_gpus, |n| (0..=n, 0..=n + 2))
}

/// Like [`any_request`], every GPU free and `k` in the middle: more than
/// `EXHAUSTIVE_LIMIT` candidate sets, so the greedy search runs.
fn large_request() -> impl Strategy<Value = Request> {
    request(17..=24, |n| (n..=n, 6..=n - 6))
}

/// A topology, a free list and how many GPUs to choose.
type Request = (Topology, Vec<u32>, usize);
type Counts = std::ops::RangeInclusive<usize>;

fn request(
    gpus: Counts,
    free_and_k: fn(usize) -> (Counts, Counts),
) -> impl Strategy<Value = Request> {
    gpus.prop_flat_map(move |n| {
        let gpus: Vec<u32> = (0..u32::try_from(n).unwrap()).collect();
        let (free_count, k) = free_and_k(n);
        (
            prop::collection::vec(any_link(), n * (n - 1) / 2),
            prop::collection::vec(prop::option::of(0u32..3), n),
            Just(gpus).prop_shuffle(),
            free_count,
            k,
        )
    })
    .prop_map(|(links, numa, order, free_count, k)| {
        let n = numa.len();
        let topo = Topology::from_fn(
            0..u32::try_from(n).unwrap(),
            |a, b| {
                let (a, b) = (a as usize, b as usize);
                links[a * n - a * (a + 1) / 2 + (b - a - 1)]
            },
            |g| numa[g as usize],
        );
        (topo, order[..free_count].to_vec(), k)
    })
}

/// Every way of taking `k` of `items`.
fn combinations(items: &[u32], k: usize) -> Vec<Vec<u32>> {
    if k == 0 {
        return vec![Vec::new()];
    }
    let mut all = Vec::new();
    for (i, &first) in items.iter().enumerate() {
        for mut rest in combinations(&items[i + 1..], k - 1) {
            rest.insert(0, first);
            all.push(rest);
        }
    }
    all
}

proptest! {
    /// Never refuses what first-free would meet, returns k distinct free GPUs, and is never
    /// worse than first-free (up to 20 GPUs: the greedy search above 16 included).
    #[test]
    fn never_refuses_never_worse_than_first_free((topo, free, k) in any_request(20)) {
        let got = choose(Some(&topo), &free, k);
        prop_assert_eq!(got.is_some(), k <= free.len());
        let Some(got) = got else { return Ok(()) };
        prop_assert_eq!(got.len(), k);
        let mut sorted = got.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), k, "duplicates in {:?}", got);
        prop_assert!(got.iter().all(|g| free.contains(g)), "{:?} not within {:?}", got, free);
        // In the order of the free list.
        let positions: Vec<usize> = got.iter().map(|g| free.iter().position(|f| f == g).unwrap()).collect();
        prop_assert!(positions.windows(2).all(|w| w[0] < w[1]), "{:?}", got);
        let first_free = &free[..k];
        prop_assert!(
            topo.score(&got).unwrap() >= topo.score(first_free).unwrap(),
            "{:?} scores {:?} < first-free {:?} {:?}",
            got, topo.score(&got), first_free, topo.score(first_free)
        );
        // Without the topology, or with a GPU it does not know: first-free.
        prop_assert_eq!(choose(None, &free, k).unwrap(), first_free);
        let mut with_unknown = free.clone();
        with_unknown.push(1000);
        prop_assert_eq!(choose(Some(&topo), &with_unknown, k).unwrap(), first_free);
    }

    /// The same where the greedy search runs (17 to 24 GPUs, every one free, k in the
    /// middle).
    #[test]
    fn greedy_never_worse_than_first_free((topo, free, k) in large_request()) {
        prop_assert!(shim_resources::gpu::topo::EXHAUSTIVE_LIMIT < 24_310); // C(17, 8)
        let got = choose(Some(&topo), &free, k).unwrap();
        let mut sorted = got.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), k);
        prop_assert!(got.iter().all(|g| free.contains(g)));
        prop_assert!(topo.score(&got).unwrap() >= topo.score(&free[..k]).unwrap());
    }

    /// On up to 9 GPUs the result scores as well as the best of every set.
    #[test]
    fn best_of_all_sets_on_small_hosts((topo, free, k) in any_request(9)) {
        prop_assume!(k <= free.len());
        let got = choose(Some(&topo), &free, k).unwrap();
        let best = combinations(&free, k)
            .iter()
            .map(|s| topo.score(s).unwrap())
            .max()
            .unwrap();
        prop_assert_eq!(topo.score(&got).unwrap(), best);
    }
}
