//! GPU interconnect topology and placement (pure): the matrix `nvidia-smi topo -m` prints,
//! parsed into a [`Topology`] ([`parse_nvidia_topo`]), and [`choose`], which picks the `k`
//! free GPUs a task gets so that they sit on one NUMA node where they can and talk over the
//! best links among them.
//!
//! # The matrix
//!
//! `nvidia-smi topo -m` prints a header of device columns (`GPU0`, `GPU1`, …, then NICs:
//! `NIC0`, `mlx5_0`, …) followed by the columns "CPU Affinity", "NUMA Affinity" and "GPU NUMA
//! ID" (older drivers print fewer of them), one row per device, then a legend. Only the cells
//! between two GPUs (`GPU<N>` rows and columns, `N` the `nvidia-smi` index) and the "NUMA
//! Affinity" column are read: NIC rows and columns, the other columns and the legend are
//! skipped. Cells are separated by any run of blanks (spaces or tabs). Link kinds ([`Link`]),
//! best first: `NV<n>` (a bonded set of `n` NVLinks, through an NVSwitch or bridges; more
//! links are better), `PIX`, `PXB`, `PHB`, `NODE`, `SYS` (older drivers print `SOC` for it).
//! A NUMA affinity of `N/A`, or no such column, is unknown; `3`, `6-7` or `0,2` are the
//! nodes near the GPU. A table without a header of GPU columns, with a row shorter than the
//! header, a GPU's own cell other than `X`, a link of unknown kind, or GPU rows that do not
//! match the GPU columns is [`ResourcesError::TopoMatrix`]. Where the two cells of a pair differ (a
//! driver never prints that), the worse link is taken.
//!
//! # The placement rule
//!
//! Among the sets of `k` of the free GPUs, [`choose`] takes the best by, in this order:
//!
//! 1. the fewest distinct NUMA affinities among its members: a set within one NUMA node
//!    beats every set spanning nodes, as kubelet's Topology Manager prefers one NUMA node (an
//!    unknown affinity counts as one more);
//! 2. the highest sum, over its pairs, of the link score ([`Link::score`]: `SYS` 10, `NODE`
//!    20, `PHB` 30, `PXB` 40, `PIX` 50, `NV<n>` 100·n, the scale of the "best effort" policy
//!    of NVIDIA's go-gpuallocator, used by the k8s device plugin);
//! 3. the highest such sum among the free GPUs it leaves: a set that takes a whole island
//!    rather than breaking one, so the next task still finds a well-linked set;
//! 4. the earliest in the given order of the free GPUs (the allocation order; the lowest
//!    indexes when it is sorted), so the choice is deterministic and, where every set scores
//!    the same (an NVSwitch box within one NUMA node), it is the first-free choice.
//!
//! [`Topology::score`] gives (1) and (2) as a [`SetScore`]. When there are at most
//! [`EXHAUSTIVE_LIMIT`] candidate sets (C(n, k): every `k` on up to 16 free GPUs), every set
//! is scored and the result is the best. Above that, sets are grown greedily from several
//! seeds (each step adds the GPU that opens the fewest new NUMA nodes, then adds the most
//! link score), improved by swapping a member for a non-member while that scores better, and
//! the best of these and the first-free set is taken.
//!
//! It never refuses a request that first-free placement would meet: `k` at most the number
//! of free GPUs always yields a set, never worse by (1, 2) than the first `k` free. Without a
//! topology, or when a free GPU is not in it (its index unknown to the matrix), the result is
//! the first `k` free GPUs in the given order (first-free).

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::error::{ResourcesError, Result};

/// The most candidate sets (C(n, k)) [`choose`] scores one by one; above it, it searches
/// greedily. C(16, 8) = 12870: every request on up to 16 free GPUs is searched in full.
pub const EXHAUSTIVE_LIMIT: u64 = 20_000;

/// Seeds of the greedy search (above [`EXHAUSTIVE_LIMIT`]).
const MAX_SEEDS: usize = 32;

/// Improving swaps the greedy search tries per seed, at most.
const MAX_SWAPS: usize = 64;

/// How two GPUs are connected, as `nvidia-smi topo -m` prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Link {
    /// `NV<n>`: a bonded set of `n` NVLinks (through an NVSwitch or NVLink bridges).
    NvLink(u32),
    /// `PIX`: through at most a single PCIe bridge.
    Pix,
    /// `PXB`: through several PCIe bridges, without the PCIe host bridge.
    Pxb,
    /// `PHB`: through PCIe and a PCIe host bridge (typically the CPU).
    Phb,
    /// `NODE`: through PCIe and the interconnect between the host bridges of one NUMA node.
    Node,
    /// `SYS` (older drivers: `SOC`): through PCIe and the interconnect between NUMA nodes
    /// (QPI/UPI).
    Sys,
}

impl Link {
    /// The link a cell names (`NV12`, `PIX`, `SOC`, …; any case), or `None`.
    pub fn parse(cell: &str) -> Option<Self> {
        let cell = cell.trim().to_ascii_uppercase();
        match cell.as_str() {
            "PIX" => Some(Self::Pix),
            "PXB" => Some(Self::Pxb),
            "PHB" => Some(Self::Phb),
            "NODE" => Some(Self::Node),
            "SYS" | "SOC" => Some(Self::Sys),
            other => parse_digits(other.strip_prefix("NV")?)
                .filter(|n| *n > 0)
                .map(Self::NvLink),
        }
    }

    /// The link's worth in the placement score, higher better: `SYS` 10, `NODE` 20, `PHB` 30,
    /// `PXB` 40, `PIX` 50, `NV<n>` 100 per link (go-gpuallocator's scale).
    pub fn score(self) -> u64 {
        match self {
            Self::Sys => 10,
            Self::Node => 20,
            Self::Phb => 30,
            Self::Pxb => 40,
            Self::Pix => 50,
            Self::NvLink(n) => 100 * u64::from(n),
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NvLink(n) => write!(f, "NV{n}"),
            Self::Pix => f.write_str("PIX"),
            Self::Pxb => f.write_str("PXB"),
            Self::Phb => f.write_str("PHB"),
            Self::Node => f.write_str("NODE"),
            Self::Sys => f.write_str("SYS"),
        }
    }
}

/// How good a set of GPUs is, by the first two keys of the placement rule (see the module
/// docs): **greater is better**, i.e. fewer distinct NUMA affinities, then a higher sum of
/// link scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SetScore {
    /// How many distinct NUMA affinities its members have (an unknown one counts as one).
    pub numa_nodes: usize,
    /// The sum of [`Link::score`] over its pairs.
    pub links: u64,
}

impl Ord for SetScore {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .numa_nodes
            .cmp(&self.numa_nodes)
            .then(self.links.cmp(&other.links))
    }
}

impl PartialOrd for SetScore {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// The GPUs of a host by `nvidia-smi` index, the link between every two of them and the
/// NUMA nodes near each (when known).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The GPU indexes, ascending.
    gpus: Vec<u32>,
    /// Per position in `gpus`: the NUMA nodes near it, ascending; `None` when unknown.
    numa: Vec<Option<Vec<u32>>>,
    /// `n × n` by position, row-major; `None` on the diagonal.
    links: Vec<Option<Link>>,
}

impl Topology {
    /// A topology of the GPUs `gpus` (duplicates ignored) with `link(a, b)` between `a < b`
    /// and each GPU near NUMA node `numa(gpu)` (`None`: unknown). For tests, benchmarks and
    /// hosts described otherwise than by `nvidia-smi topo -m`.
    pub fn from_fn(
        gpus: impl IntoIterator<Item = u32>,
        mut link: impl FnMut(u32, u32) -> Link,
        mut numa: impl FnMut(u32) -> Option<u32>,
    ) -> Self {
        let mut gpus: Vec<u32> = gpus.into_iter().collect();
        gpus.sort_unstable();
        gpus.dedup();
        let n = gpus.len();
        let mut links = vec![None; n * n];
        for (i, &a) in gpus.iter().enumerate() {
            for (j, &b) in gpus.iter().enumerate().skip(i + 1) {
                let l = link(a, b);
                links[i * n + j] = Some(l);
                links[j * n + i] = Some(l);
            }
        }
        let numa = gpus
            .iter()
            .map(|&g| numa(g).map(|node| vec![node]))
            .collect();
        Self { gpus, numa, links }
    }

    /// The GPU indexes, ascending.
    pub fn gpus(&self) -> &[u32] {
        &self.gpus
    }

    fn pos(&self, gpu: u32) -> Option<usize> {
        self.gpus.binary_search(&gpu).ok()
    }

    fn link_at(&self, i: usize, j: usize) -> Option<Link> {
        self.links.get(i * self.gpus.len() + j).copied().flatten()
    }

    /// The link between GPUs `a` and `b`; `None` when `a == b` or either is unknown.
    pub fn link(&self, a: u32, b: u32) -> Option<Link> {
        self.link_at(self.pos(a)?, self.pos(b)?)
    }

    /// The NUMA nodes near `gpu`, ascending; `None` when unknown (or `gpu` is).
    pub fn numa_nodes(&self, gpu: u32) -> Option<&[u32]> {
        self.numa.get(self.pos(gpu)?)?.as_deref()
    }

    /// The score of the set `gpus` by the first two keys of the placement rule; `None` when
    /// one of them is unknown or one is named twice.
    pub fn score(&self, gpus: &[u32]) -> Option<SetScore> {
        let pos: Vec<usize> = gpus.iter().map(|&g| self.pos(g)).collect::<Option<_>>()?;
        let distinct: BTreeSet<usize> = pos.iter().copied().collect();
        if distinct.len() != pos.len() {
            return None;
        }
        let numa: BTreeSet<&Option<Vec<u32>>> =
            pos.iter().filter_map(|&p| self.numa.get(p)).collect();
        let mut links = 0u64;
        for (x, &i) in pos.iter().enumerate() {
            for &j in pos.iter().skip(x + 1) {
                links = links.saturating_add(self.link_at(i, j).map_or(0, Link::score));
            }
        }
        Some(SetScore {
            numa_nodes: numa.len(),
            links,
        })
    }
}

/// `s` as a number when it is one or more ASCII digits (no sign, no blanks).
fn parse_digits(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// The index of a `GPU<N>` label.
fn gpu_label(s: &str) -> Option<u32> {
    parse_digits(s.strip_prefix("GPU")?)
}

/// A "NUMA Affinity" cell: `3`, `6-7`, `0,2-3`; `None` for `N/A` or anything else.
fn parse_numa(cell: &str) -> Option<Vec<u32>> {
    let mut nodes = Vec::new();
    for part in cell.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b) = (parse_digits(a)?, parse_digits(b)?);
        if b < a || b - a > 1024 {
            return None;
        }
        nodes.extend(a..=b);
    }
    nodes.sort_unstable();
    nodes.dedup();
    (!nodes.is_empty()).then_some(nodes)
}

/// The names of the columns after the devices: "CPU Affinity", "NUMA Affinity", "GPU NUMA
/// ID" are one column each; any other word is a column of its own.
fn column_names(words: &[&str]) -> Vec<String> {
    const KNOWN: [&[&str]; 3] = [
        &["CPU", "Affinity"],
        &["NUMA", "Affinity"],
        &["GPU", "NUMA", "ID"],
    ];
    let mut names = Vec::new();
    let mut rest = words;
    while !rest.is_empty() {
        let known = KNOWN
            .iter()
            .find(|k| rest.len() >= k.len() && rest.iter().zip(k.iter()).all(|(w, k)| w == k));
        let take = known.map_or(1, |k| k.len());
        let (name, tail) = rest.split_at(take);
        names.push(name.join(" "));
        rest = tail;
    }
    names
}

/// `text` without its terminal escape sequences (`ESC [` parameters, then one final letter).
fn without_escapes(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains('\x1b') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
            continue;
        }
        if chars.clone().next() == Some('[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// One GPU's row of the matrix: its links to the other GPUs, its NUMA affinity.
type Row = (BTreeMap<u32, Link>, Option<Vec<u32>>);

fn matrix_error(line: Option<usize>, why: impl Into<String>) -> ResourcesError {
    ResourcesError::TopoMatrix {
        line,
        why: why.into(),
    }
}

/// Parses the output of `nvidia-smi topo -m` (see the module docs): the GPUs, the link
/// between every two and each one's NUMA affinity. NICs, CPU affinity and the legend are
/// ignored.
pub fn parse_nvidia_topo(out: &str) -> Result<Topology> {
    // Some drivers underline the header with terminal escapes (`\x1b[4mGPU0 … \x1b[0m`).
    let out = without_escapes(out);
    let lines: Vec<&str> = out.lines().collect();
    let first_field = |l: &str| l.split_whitespace().next().and_then(gpu_label);
    let (header_at, header) = lines
        .iter()
        .enumerate()
        .find(|(_, l)| first_field(l).is_some())
        .ok_or_else(|| matrix_error(None, "no header line of GPU columns"))?;
    let header_line = Some(header_at + 1);
    let fields: Vec<&str> = header.split_whitespace().collect();
    // Device columns end where the first named column ("CPU Affinity", "NUMA Affinity",
    // "GPU NUMA ID") begins.
    let devices = fields
        .iter()
        .position(|f| matches!(*f, "CPU" | "NUMA" | "GPU"))
        .unwrap_or(fields.len());
    let (device_fields, named) = fields.split_at(devices);
    let numa_column = column_names(named)
        .iter()
        .position(|c| c == "NUMA Affinity");
    let columns: Vec<Option<u32>> = device_fields.iter().map(|f| gpu_label(f)).collect();
    let mut column_gpus = BTreeSet::new();
    for gpu in columns.iter().flatten() {
        if !column_gpus.insert(*gpu) {
            return Err(matrix_error(
                header_line,
                format!("GPU{gpu} has two columns"),
            ));
        }
    }

    // Per GPU row: its cells towards each GPU column, and its NUMA affinity.
    let mut rows: BTreeMap<u32, Row> = BTreeMap::new();
    for (at, line) in lines.iter().enumerate().skip(header_at + 1) {
        let line_no = Some(at + 1);
        let mut cells = line.split_whitespace();
        let Some(gpu) = cells.next().and_then(gpu_label) else {
            continue; // a NIC row, a blank line, the legend
        };
        let cells: Vec<&str> = cells.collect();
        if cells.len() < devices {
            return Err(matrix_error(
                line_no,
                format!(
                    "the row of GPU{gpu} has {} cells, the header {devices} device columns",
                    cells.len()
                ),
            ));
        }
        let mut links = BTreeMap::new();
        for (cell, column) in cells.iter().zip(&columns) {
            let Some(other) = *column else { continue };
            if other == gpu {
                if *cell != "X" {
                    return Err(matrix_error(
                        line_no,
                        format!("GPU{gpu}'s own cell is {cell:?}, not \"X\""),
                    ));
                }
                continue;
            }
            let link = Link::parse(cell).ok_or_else(|| {
                matrix_error(
                    line_no,
                    format!("unknown link {cell:?} between GPU{gpu} and GPU{other}"),
                )
            })?;
            links.insert(other, link);
        }
        let numa = numa_column
            .and_then(|c| cells.get(devices + c))
            .and_then(|c| parse_numa(c));
        if rows.insert(gpu, (links, numa)).is_some() {
            return Err(matrix_error(line_no, format!("GPU{gpu} has two rows")));
        }
    }
    let row_gpus: BTreeSet<u32> = rows.keys().copied().collect();
    if row_gpus != column_gpus {
        return Err(matrix_error(
            header_line,
            format!("GPU rows {row_gpus:?} do not match GPU columns {column_gpus:?}"),
        ));
    }

    let gpus: Vec<u32> = row_gpus.into_iter().collect();
    let n = gpus.len();
    let mut links = vec![None; n * n];
    for (i, a) in gpus.iter().enumerate() {
        for (j, b) in gpus.iter().enumerate().skip(i + 1) {
            let ab = rows.get(a).and_then(|(l, _)| l.get(b)).copied();
            let ba = rows.get(b).and_then(|(l, _)| l.get(a)).copied();
            // The worse of the two cells (they are equal in every matrix seen).
            let link = match (ab, ba) {
                (Some(x), Some(y)) => Some(if x.score() <= y.score() { x } else { y }),
                (x, y) => x.or(y),
            };
            links[i * n + j] = link;
            links[j * n + i] = link;
        }
    }
    let numa = gpus
        .iter()
        .map(|g| rows.get_mut(g).and_then(|(_, numa)| numa.take()))
        .collect();
    Ok(Topology { gpus, numa, links })
}

// -------------------------------------------------------------------------------- placement

/// Chooses `k` of the `free` GPUs (indexes, in allocation order; a repeated index counts
/// once) by the placement rule of the module docs, best links within one NUMA node first.
/// Returns them in the order of `free`; `None` only when fewer than `k` are free. Without a
/// topology, or when a free GPU is not in it, returns the first `k` free (first-free).
pub fn choose(topo: Option<&Topology>, free: &[u32], k: usize) -> Option<Vec<u32>> {
    let mut seen = BTreeSet::new();
    let free: Vec<u32> = free.iter().copied().filter(|g| seen.insert(*g)).collect();
    if k > free.len() {
        return None;
    }
    let first_free = || free.iter().take(k).copied().collect();
    let Some(topo) = topo else {
        return Some(first_free());
    };
    if k == 0 || k == free.len() {
        return Some(first_free());
    }
    let Some(positions) = free
        .iter()
        .map(|&g| topo.pos(g))
        .collect::<Option<Vec<usize>>>()
    else {
        tracing::debug!(?free, gpus = ?topo.gpus(), "a free GPU is not in the topology: first-free placement");
        return Some(first_free());
    };
    let search = Search::new(topo, &positions, k);
    let picked = if at_most_combinations(free.len(), k, EXHAUSTIVE_LIMIT) {
        search.exhaustive()
    } else {
        search.greedy()
    };
    Some(
        picked
            .into_iter()
            .filter_map(|p| free.get(p).copied())
            .collect(),
    )
}

/// Whether C(n, k) <= `cap`.
fn at_most_combinations(n: usize, k: usize, cap: u64) -> bool {
    let k = k.min(n.saturating_sub(k));
    let mut c: u64 = 1;
    for i in 0..k {
        let (Ok(top), Ok(bottom)) = (u64::try_from(n - i), u64::try_from(i + 1)) else {
            return false;
        };
        // C(n, i + 1) = C(n, i) · (n − i) / (i + 1), exact at every step.
        match c.checked_mul(top) {
            Some(x) if x / bottom <= cap => c = x / bottom,
            _ => return false,
        }
    }
    true
}

/// A candidate's full sort key (rule keys 1–3); the 4th, the order, is the search's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    spread: usize,
    links: u64,
    rest: u64,
}

impl Key {
    fn better_than(&self, other: &Key) -> bool {
        other
            .spread
            .cmp(&self.spread)
            .then(self.links.cmp(&other.links))
            .then(self.rest.cmp(&other.rest))
            == Ordering::Greater
    }
}

/// The free GPUs by position in the free list: pair scores, NUMA groups, and what each
/// contributes to the whole.
struct Search {
    n: usize,
    k: usize,
    /// `n × n` link scores, 0 on the diagonal.
    score: Vec<u64>,
    /// Per position: its NUMA affinity as a small group number.
    group: Vec<usize>,
    groups: usize,
    /// Per position: the sum of its scores to every other free GPU.
    reach: Vec<u64>,
    /// The sum of the scores of every free pair.
    total: u64,
    /// The best pair score.
    max_score: u64,
}

/// A set being built: its members and running sums.
struct Partial {
    members: Vec<usize>,
    in_set: Vec<bool>,
    /// Per position: the sum of its scores to the members.
    gain: Vec<u64>,
    counts: Vec<usize>,
    spread: usize,
    links: u64,
    reach: u64,
}

impl Search {
    fn new(topo: &Topology, positions: &[usize], k: usize) -> Self {
        let n = positions.len();
        let mut score = vec![0u64; n * n];
        for (i, &a) in positions.iter().enumerate() {
            for (j, &b) in positions.iter().enumerate() {
                if i != j {
                    score[i * n + j] = topo.link_at(a, b).map_or(0, Link::score);
                }
            }
        }
        let mut ids: BTreeMap<Option<&[u32]>, usize> = BTreeMap::new();
        let group = positions
            .iter()
            .map(|&p| {
                let affinity = topo.numa.get(p).and_then(|a| a.as_deref());
                let next = ids.len();
                *ids.entry(affinity).or_insert(next)
            })
            .collect();
        let reach: Vec<u64> = (0..n)
            .map(|i| {
                score[i * n..(i + 1) * n]
                    .iter()
                    .fold(0u64, |s, x| s.saturating_add(*x))
            })
            .collect();
        let total = reach.iter().fold(0u64, |s, x| s.saturating_add(*x)) / 2;
        let max_score = score.iter().copied().max().unwrap_or(0);
        Self {
            n,
            k,
            score,
            group,
            groups: ids.len(),
            reach,
            total,
            max_score,
        }
    }

    fn pair(&self, i: usize, j: usize) -> u64 {
        self.score[i * self.n + j]
    }

    fn empty(&self) -> Partial {
        Partial {
            members: Vec::with_capacity(self.k),
            in_set: vec![false; self.n],
            gain: vec![0; self.n],
            counts: vec![0; self.groups],
            spread: 0,
            links: 0,
            reach: 0,
        }
    }

    fn push(&self, s: &mut Partial, p: usize) {
        s.links = s.links.saturating_add(s.gain[p]);
        s.reach = s.reach.saturating_add(self.reach[p]);
        s.counts[self.group[p]] += 1;
        if s.counts[self.group[p]] == 1 {
            s.spread += 1;
        }
        for (x, g) in s.gain.iter_mut().enumerate() {
            *g = g.saturating_add(self.pair(x, p));
        }
        s.in_set[p] = true;
        s.members.push(p);
    }

    fn pop(&self, s: &mut Partial) -> Option<usize> {
        let p = s.members.pop()?;
        s.in_set[p] = false;
        for (x, g) in s.gain.iter_mut().enumerate() {
            *g = g.saturating_sub(self.pair(x, p));
        }
        s.counts[self.group[p]] -= 1;
        if s.counts[self.group[p]] == 0 {
            s.spread -= 1;
        }
        s.reach = s.reach.saturating_sub(self.reach[p]);
        s.links = s.links.saturating_sub(s.gain[p]);
        Some(p)
    }

    /// The links among the free GPUs a set leaves: total − links − (reach − 2·links).
    fn rest(&self, links: u64, reach: u64) -> u64 {
        self.total.saturating_add(links).saturating_sub(reach)
    }

    fn key(&self, s: &Partial) -> Key {
        Key {
            spread: s.spread,
            links: s.links,
            rest: self.rest(s.links, s.reach),
        }
    }

    fn key_of(&self, members: &[usize]) -> Key {
        let mut s = self.empty();
        for &p in members {
            self.push(&mut s, p);
        }
        self.key(&s)
    }

    /// Every set of `k`, in lexicographic order of positions (so the first of equals wins),
    /// with a bound: a set that already spans more NUMA nodes than the best, or whose links
    /// cannot reach the best's, is not completed. Lean on purpose (no per-position gains):
    /// adding a member costs one pass over the members.
    fn exhaustive(&self) -> Vec<usize> {
        let (n, k) = (self.n, self.k);
        if k == 0 || k > n {
            return (0..k.min(n)).collect();
        }
        let pairs = |m: usize| m * m.saturating_sub(1) / 2;
        let mut best: Option<(Key, Vec<usize>)> = None;
        let mut members: Vec<usize> = Vec::with_capacity(k);
        // Running sums after each member: links among the members, their reach.
        let mut links: Vec<u64> = Vec::with_capacity(k);
        let mut reach: Vec<u64> = Vec::with_capacity(k);
        let mut counts = vec![0usize; self.groups];
        let mut spread = 0usize;
        let mut next = 0;
        loop {
            if members.len() == k || next + (k - members.len()) > n {
                if members.len() == k {
                    let l = links.last().copied().unwrap_or(0);
                    let key = Key {
                        spread,
                        links: l,
                        rest: self.rest(l, reach.last().copied().unwrap_or(0)),
                    };
                    if best.as_ref().is_none_or(|(b, _)| key.better_than(b)) {
                        best = Some((key, members.clone()));
                    }
                }
                // Back up one member and try the next position in its place.
                let Some(p) = members.pop() else { break };
                links.pop();
                reach.pop();
                counts[self.group[p]] -= 1;
                if counts[self.group[p]] == 0 {
                    spread -= 1;
                }
                next = p + 1;
                continue;
            }
            let p = next;
            next += 1;
            let row = &self.score[p * n..(p + 1) * n];
            let added = members.iter().fold(0u64, |s, &c| s.saturating_add(row[c]));
            let l = links.last().copied().unwrap_or(0).saturating_add(added);
            let r = reach
                .last()
                .copied()
                .unwrap_or(0)
                .saturating_add(self.reach[p]);
            let g = self.group[p];
            let opens = usize::from(counts[g] == 0);
            if let Some((b, _)) = &best {
                let open = u64::try_from(pairs(k) - pairs(members.len() + 1)).unwrap_or(u64::MAX);
                let bound = l.saturating_add(open.saturating_mul(self.max_score));
                if spread + opens > b.spread || (spread + opens == b.spread && bound < b.links) {
                    continue; // no set with these members can win
                }
            }
            counts[g] += 1;
            spread += opens;
            members.push(p);
            links.push(l);
            reach.push(r);
        }
        best.map_or_else(|| (0..k).collect(), |(_, members)| members)
    }

    /// Greedy growth from several seeds, each improved by swaps; the best of those and of the
    /// first-free set (equal keys: the lexicographically first positions).
    fn greedy(&self) -> Vec<usize> {
        if self.k == 0 || self.k > self.n {
            return (0..self.k.min(self.n)).collect();
        }
        let mut seeds: Vec<usize> = Vec::new();
        let mut seen_groups = BTreeSet::new();
        for p in 0..self.n {
            if seen_groups.insert(self.group[p]) && seeds.len() < MAX_SEEDS {
                seeds.push(p);
            }
        }
        for p in 0..self.n {
            if seeds.len() >= MAX_SEEDS {
                break;
            }
            if !seeds.contains(&p) {
                seeds.push(p);
            }
        }
        let first: Vec<usize> = (0..self.k).collect();
        let mut best = (self.key_of(&first), first);
        for seed in seeds {
            let mut s = self.empty();
            self.push(&mut s, seed);
            while s.members.len() < self.k {
                let pick = (0..self.n).filter(|&j| !s.in_set[j]).min_by_key(|&j| {
                    let opens = usize::from(s.counts[self.group[j]] == 0);
                    (opens, std::cmp::Reverse(s.gain[j]), j)
                });
                match pick {
                    Some(j) => self.push(&mut s, j),
                    None => break,
                }
            }
            self.improve(&mut s);
            let key = self.key(&s);
            let mut members = s.members.clone();
            members.sort_unstable();
            if key.better_than(&best.0) || (key == best.0 && members < best.1) {
                best = (key, members);
            }
        }
        best.1
    }

    /// Swaps a member for a non-member while that makes a better key (at most
    /// [`MAX_SWAPS`] times).
    fn improve(&self, s: &mut Partial) {
        for _ in 0..MAX_SWAPS {
            let current = self.key(s);
            let mut swap = None;
            'search: for (mi, &i) in s.members.iter().enumerate() {
                for j in (0..self.n).filter(|&j| !s.in_set[j]) {
                    let (gi, gj) = (self.group[i], self.group[j]);
                    let spread = if gi == gj {
                        s.spread
                    } else {
                        s.spread - usize::from(s.counts[gi] == 1) + usize::from(s.counts[gj] == 0)
                    };
                    let links = s
                        .links
                        .saturating_add(s.gain[j])
                        .saturating_sub(self.pair(i, j))
                        .saturating_sub(s.gain[i]);
                    let reach = s
                        .reach
                        .saturating_add(self.reach[j])
                        .saturating_sub(self.reach[i]);
                    let key = Key {
                        spread,
                        links,
                        rest: self.rest(links, reach),
                    };
                    if key.better_than(&current) {
                        swap = Some((mi, j));
                        break 'search;
                    }
                }
            }
            let Some((mi, j)) = swap else { return };
            // Take the member out (moving the last into its place), then put j in.
            let last = s.members.len() - 1;
            s.members.swap(mi, last);
            self.pop(s);
            self.push(s, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_parse_and_rank() {
        assert_eq!(Link::parse("NV12"), Some(Link::NvLink(12)));
        assert_eq!(Link::parse("nv4"), Some(Link::NvLink(4)));
        assert_eq!(Link::parse(" SOC "), Some(Link::Sys));
        for bad in ["NV", "NV0", "NV+1", "X", "N/A", "", "PCI"] {
            assert_eq!(Link::parse(bad), None, "{bad:?}");
        }
        let ranked = [
            Link::NvLink(2),
            Link::NvLink(1),
            Link::Pix,
            Link::Pxb,
            Link::Phb,
            Link::Node,
            Link::Sys,
        ];
        for w in ranked.windows(2) {
            assert!(w[0].score() > w[1].score(), "{} > {}", w[0], w[1]);
        }
        for l in ranked {
            assert_eq!(Link::parse(&l.to_string()), Some(l));
        }
    }

    #[test]
    fn numa_cells() {
        assert_eq!(parse_numa("3"), Some(vec![3]));
        assert_eq!(parse_numa("6-7"), Some(vec![6, 7]));
        assert_eq!(parse_numa("2,0-1"), Some(vec![0, 1, 2]));
        for bad in ["N/A", "", "7-6", "0-99999", "a", "1,"] {
            assert_eq!(parse_numa(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn combination_counts() {
        assert!(at_most_combinations(16, 8, 12_870));
        assert!(!at_most_combinations(16, 8, 12_869));
        assert!(at_most_combinations(20_000, 1, 20_000));
        assert!(at_most_combinations(20_000, 19_999, 20_000));
        assert!(!at_most_combinations(17, 8, EXHAUSTIVE_LIMIT));
        assert!(at_most_combinations(5, 0, 1));
        assert!(!at_most_combinations(usize::MAX, 3, EXHAUSTIVE_LIMIT));
    }

    /// On the same topology the greedy search finds what the full search finds where the
    /// best set is plain (islands of NVLink pairs on two NUMA nodes).
    #[test]
    fn greedy_agrees_on_islands() {
        let topo = Topology::from_fn(
            0..8,
            |a, b| {
                if a / 2 == b / 2 {
                    Link::NvLink(4)
                } else if a / 4 == b / 4 {
                    Link::Node
                } else {
                    Link::Sys
                }
            },
            |g| Some(g / 4),
        );
        let free: Vec<usize> = (1..8).collect();
        for k in 1..7 {
            let search = Search::new(&topo, &free, k);
            let full = search.exhaustive();
            let greedy = search.greedy();
            assert_eq!(search.key_of(&greedy), search.key_of(&full), "k={k}");
        }
    }
}
