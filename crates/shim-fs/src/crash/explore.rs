//! The crash-state builder: every state a crash could leave after each prefix of a log.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::ControlFlow;

use super::record::{Log, NodeId, Op};
use super::tree::{Node, Tree};

/// How far [`explore`] goes at each crash point.
#[derive(Debug, Clone)]
pub struct Limits {
    /// A crash point whose pending items (operations not yet durable) combine into at most
    /// this many states is explored exhaustively.
    pub exhaustive: usize,
    /// Beyond that, at most this many combinations are built: everything applied, only what
    /// is durable, every item alone flipped from each of those two, then random ones.
    pub sampled: usize,
    /// The seed of the random combinations (the same seed builds the same states).
    pub seed: u64,
}

impl Default for Limits {
    /// 64 combinations exhaustively (six pending entry operations, or four and a write), 64
    /// sampled beyond.
    fn default() -> Self {
        Self {
            exhaustive: 64,
            sampled: 64,
            seed: 0x5eed_c0de,
        }
    }
}

/// What a crash state made of an operation that was not yet durable at its crash point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fate {
    /// The entry operation (create, mkdir, rename, link, unlink, rmdir) reached the disk.
    Applied,
    /// It did not: the directory entries are as before it.
    Undone,
    /// The write reached the disk whole.
    Kept,
    /// None of it did.
    Dropped,
    /// Only its first half did.
    Torn,
}

impl fmt::Display for Fate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Applied => "applied",
            Self::Undone => "undone",
            Self::Kept => "kept",
            Self::Dropped => "dropped",
            Self::Torn => "torn",
        })
    }
}

/// One state a crash could leave.
#[derive(Debug, Clone)]
pub struct CrashState {
    /// How many operations of the log ran before the crash (the crash point).
    pub point: usize,
    /// The fate of each operation that was not durable at that point (index in the log).
    /// Every other operation before the point is in its durable form.
    pub fates: Vec<(usize, Fate)>,
    /// What the disk holds.
    pub tree: Tree,
    /// [`Tree::digest`] of `tree`.
    pub digest: u64,
    /// Whether no earlier crash point of this exploration produced the same tree.
    pub fresh: bool,
}

impl CrashState {
    /// The crash point, its last operation, and the fate of each pending operation.
    pub fn describe(&self, log: &Log) -> String {
        let mut s = match self.point {
            0 => "crash before the first operation".to_owned(),
            p => format!("crash after operation {} ({})", p - 1, log.describe(p - 1)),
        };
        if self.fates.is_empty() {
            s.push_str("; everything before it durable");
        }
        for (i, fate) in &self.fates {
            s.push_str(&format!("\n    op {i} {fate}: {}", log.describe(*i)));
        }
        s
    }
}

/// How many crash states [`explore`] built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Crash points (the log's length plus one).
    pub points: usize,
    /// Combinations built.
    pub built: usize,
    /// States visited: distinct trees at each point.
    pub visited: usize,
    /// Distinct trees over all points.
    pub distinct: usize,
    /// Points explored exhaustively.
    pub exhaustive_points: usize,
    /// Points where combinations were sampled.
    pub sampled_points: usize,
    /// The most operations pending at one point.
    pub max_pending: usize,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} crash points ({} exhaustive, {} sampled, at most {} pending operations): \
             {} states built, {} visited, {} distinct",
            self.points,
            self.exhaustive_points,
            self.sampled_points,
            self.max_pending,
            self.built,
            self.visited,
            self.distinct
        )
    }
}

/// Builds every state a crash could leave at every point of `log` and hands each to `visit`
/// (which may stop the exploration with `ControlFlow::Break`).
///
/// The model (ALICE's weak persistence, ext4-like without its journal's ordering): an entry
/// operation (create, mkdir, rename, link, unlink, rmdir) is durable once its directory has
/// been fsynced after it (a rename across directories once both have); a write once its file
/// has been fsynced after it. At a crash point, each operation not yet durable is, on its own,
/// applied or undone (a write kept, dropped or torn: its first half kept). An applied entry
/// operation sets or clears its names whatever the operations before it did (a rename whose
/// source's creation was undone still places the file it moved). Modes are never varied.
///
/// States are built from the log's initial tree at each point `0..=ops.len()`; a point whose
/// combinations exceed [`Limits::exhaustive`] is sampled. Equal trees at one point are
/// visited once.
pub fn explore(
    log: &Log,
    limits: &Limits,
    mut visit: impl FnMut(&CrashState) -> ControlFlow<()>,
) -> Stats {
    let cover = covers(&log.ops);
    let mut seen = HashSet::new();
    let mut stats = Stats::default();
    let mut choice = vec![0u8; log.ops.len()];
    for point in 0..=log.ops.len() {
        stats.points += 1;
        let pending: Vec<usize> = (0..point)
            .filter(|&i| arity(&log.ops[i]) > 1 && cover[i] >= point)
            .collect();
        stats.max_pending = stats.max_pending.max(pending.len());
        let arities: Vec<u8> = pending.iter().map(|&i| arity(&log.ops[i])).collect();
        let (vectors, exhaustive) = combinations(&arities, limits, point);
        if exhaustive {
            stats.exhaustive_points += 1;
        } else {
            stats.sampled_points += 1;
        }
        let mut here = HashSet::new();
        for v in vectors {
            choice[..point].fill(0);
            for (k, &i) in pending.iter().enumerate() {
                choice[i] = v[k];
            }
            let tree = replay(log, point, |i| choice[i]);
            stats.built += 1;
            let digest = tree.digest();
            if !here.insert(digest) {
                continue;
            }
            let fresh = seen.insert(digest);
            if fresh {
                stats.distinct += 1;
            }
            stats.visited += 1;
            let state = CrashState {
                point,
                fates: pending
                    .iter()
                    .zip(&v)
                    .map(|(&i, &c)| (i, fate(&log.ops[i], c)))
                    .collect(),
                tree,
                digest,
                fresh,
            };
            if visit(&state).is_break() {
                return stats;
            }
        }
    }
    stats
}

/// How many fates an operation can have when it is not durable (1: it has no say).
fn arity(op: &Op) -> u8 {
    match op {
        Op::Write { data, .. } if data.len() >= 2 => 3,
        Op::Write { .. } => 2,
        op if op.is_entry_op() => 2,
        _ => 1,
    }
}

fn fate(op: &Op, choice: u8) -> Fate {
    match (op, choice) {
        (Op::Write { .. }, 0) => Fate::Kept,
        (Op::Write { .. }, 1) => Fate::Dropped,
        (Op::Write { .. }, _) => Fate::Torn,
        (_, 0) => Fate::Applied,
        _ => Fate::Undone,
    }
}

/// For each operation, the index of the first later operation that makes it durable
/// (`usize::MAX`: none in the log).
fn covers(ops: &[Op]) -> Vec<usize> {
    let mut dir_syncs: HashMap<NodeId, Vec<usize>> = HashMap::new();
    let mut file_syncs: HashMap<NodeId, Vec<usize>> = HashMap::new();
    for (j, op) in ops.iter().enumerate() {
        match op {
            Op::FsyncDir { dir } => dir_syncs.entry(*dir).or_default().push(j),
            Op::Fsync { node } => file_syncs.entry(*node).or_default().push(j),
            _ => {}
        }
    }
    let first_after = |syncs: Option<&Vec<usize>>, i: usize| {
        syncs
            .and_then(|v| v.get(v.partition_point(|&j| j <= i)).copied())
            .unwrap_or(usize::MAX)
    };
    ops.iter()
        .enumerate()
        .map(|(i, op)| match op {
            Op::Write { node, .. } => first_after(file_syncs.get(node), i),
            op if op.is_entry_op() => op
                .entry_dirs()
                .iter()
                .map(|d| first_after(dir_syncs.get(d), i))
                .max()
                .unwrap_or(usize::MAX),
            _ => usize::MAX,
        })
        .collect()
}

/// The choice vectors for a point with these arities, and whether they are all of them.
fn combinations(arities: &[u8], limits: &Limits, point: usize) -> (Vec<Vec<u8>>, bool) {
    let total = arities
        .iter()
        .fold(1u64, |acc, &a| acc.saturating_mul(u64::from(a)));
    let n = arities.len();
    if total <= limits.exhaustive as u64 {
        let mut out = Vec::new();
        let mut v = vec![0u8; n];
        loop {
            out.push(v.clone());
            let mut k = 0;
            loop {
                if k == n {
                    return (out, true);
                }
                v[k] += 1;
                if v[k] < arities[k] {
                    break;
                }
                v[k] = 0;
                k += 1;
            }
        }
    }
    let mut out = Vec::new();
    let mut have = HashSet::new();
    let mut push = |v: Vec<u8>, out: &mut Vec<Vec<u8>>| {
        if out.len() < limits.sampled && have.insert(v.clone()) {
            out.push(v);
        }
    };
    let all_applied = vec![0u8; n];
    let durable_only = vec![1u8; n];
    push(all_applied.clone(), &mut out);
    push(durable_only.clone(), &mut out);
    push(arities.iter().map(|a| a - 1).collect(), &mut out);
    for base in [&all_applied, &durable_only] {
        for k in 0..n {
            for alt in 0..arities[k] {
                if alt != base[k] {
                    let mut v = base.clone();
                    v[k] = alt;
                    push(v, &mut out);
                }
            }
        }
    }
    let mut rng = SplitMix(limits.seed ^ (point as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut tries = 0;
    while out.len() < limits.sampled && tries < limits.sampled * 8 {
        tries += 1;
        let v = arities
            .iter()
            .map(|&a| (rng.next() % u64::from(a)) as u8)
            .collect();
        push(v, &mut out);
    }
    (out, false)
}

/// A small deterministic generator (SplitMix64).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The tree after the first `point` operations of `log`, operation `i` taking its fate from
/// `choice(i)` (0: applied or kept; 1: undone or dropped; 2: torn).
pub(crate) fn replay(log: &Log, point: usize, choice: impl Fn(usize) -> u8) -> Tree {
    let mut tree = log.initial.clone();
    for (i, op) in log.ops.iter().take(point).enumerate() {
        let applied = choice(i) == 0;
        match op {
            Op::Create {
                dir,
                name,
                node,
                mode,
                ..
            } => {
                tree.nodes.entry(*node).or_insert_with(|| Node::File {
                    data: Vec::new(),
                    mode: mode & 0o7777,
                });
                if applied {
                    set_entry(&mut tree, *dir, name, Some(*node));
                }
            }
            Op::Mkdir {
                dir,
                name,
                node,
                mode,
            } => {
                tree.nodes.entry(*node).or_insert_with(|| Node::Dir {
                    entries: Default::default(),
                    mode: mode & 0o7777,
                });
                if applied {
                    set_entry(&mut tree, *dir, name, Some(*node));
                }
            }
            Op::Write { node, offset, data } => {
                let kept = match choice(i) {
                    0 => data.len(),
                    1 => 0,
                    _ => data.len() / 2,
                };
                if kept > 0 {
                    write(&mut tree, *node, *offset, &data[..kept]);
                }
            }
            Op::Rename {
                from_dir,
                from,
                to_dir,
                to,
                node,
            } => {
                if applied {
                    set_entry(&mut tree, *from_dir, from, None);
                    set_entry(&mut tree, *to_dir, to, Some(*node));
                }
            }
            Op::Link {
                to_dir, to, node, ..
            } => {
                if applied {
                    set_entry(&mut tree, *to_dir, to, Some(*node));
                }
            }
            Op::Unlink { dir, name } | Op::Rmdir { dir, name } => {
                if applied {
                    set_entry(&mut tree, *dir, name, None);
                }
            }
            Op::SetMode { node, mode } => {
                if let Some(Node::Dir { mode: m, .. } | Node::File { mode: m, .. }) =
                    tree.nodes.get_mut(node)
                {
                    *m = mode & 0o7777;
                }
            }
            Op::Fsync { .. } | Op::FsyncDir { .. } => {}
        }
    }
    tree
}

fn set_entry(tree: &mut Tree, dir: NodeId, name: &std::ffi::OsStr, to: Option<NodeId>) {
    let node = tree.nodes.entry(dir).or_insert_with(|| Node::Dir {
        entries: Default::default(),
        mode: 0o700,
    });
    if let Node::Dir { entries, .. } = node {
        match to {
            Some(n) => {
                entries.insert(name.to_owned(), n);
            }
            None => {
                entries.remove(name);
            }
        }
    }
}

fn write(tree: &mut Tree, node: NodeId, offset: u64, data: &[u8]) {
    let file = tree.nodes.entry(node).or_insert_with(|| Node::File {
        data: Vec::new(),
        mode: 0o600,
    });
    if let Node::File { data: content, .. } = file {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let end = start.saturating_add(data.len());
        if end > 1 << 32 {
            // Not a write this crate makes; a model of it is not worth the memory.
            return;
        }
        if content.len() < end {
            content.resize(end, 0);
        }
        content[start..end].copy_from_slice(data);
    }
}
