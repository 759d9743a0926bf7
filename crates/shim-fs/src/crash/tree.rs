//! The model of a directory tree: what a crash state holds, read from disk or built from a
//! log, and written back out to a directory.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::hash::{DefaultHasher, Hash as _, Hasher as _};
use std::io::Write as _;
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags};

use super::record::NodeId;
use crate::dir::{Dir, FileInfo, FileKind};
use crate::error::{FsError, Result, Step};

/// One file or directory of a [`Tree`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Node {
    /// A directory: its entries, by name.
    Dir {
        /// Name to node.
        entries: BTreeMap<OsString, NodeId>,
        /// Permission bits.
        mode: u32,
    },
    /// A regular file.
    File {
        /// Its content.
        data: Vec<u8>,
        /// Permission bits.
        mode: u32,
    },
    /// A symbolic link.
    Symlink {
        /// What it points to.
        target: OsString,
    },
}

/// A directory tree: nodes by id, and the root directory. A node not reachable from the root
/// is not part of what the tree shows (a file whose creation a crash undid, say).
#[derive(Debug, Clone)]
pub struct Tree {
    pub(crate) root: NodeId,
    pub(crate) nodes: HashMap<NodeId, Node>,
}

/// The deepest directory nesting walked (a guard against a malformed tree).
const MAX_DEPTH: usize = 64;

impl Tree {
    /// Reads the tree under `root` from disk (without following symbolic links).
    pub fn read(root: impl AsRef<Path>) -> Result<Self> {
        let mut next = 0;
        capture(root.as_ref(), &mut next).map(|(tree, _)| tree)
    }

    /// The node at `path` (components relative to the root, `/`-separated), if reachable.
    pub fn lookup(&self, path: impl AsRef<Path>) -> Option<&Node> {
        let mut at = self.root;
        for c in path.as_ref().components() {
            let std::path::Component::Normal(name) = c else {
                continue;
            };
            match self.nodes.get(&at)? {
                Node::Dir { entries, .. } => at = *entries.get(name)?,
                _ => return None,
            }
        }
        self.nodes.get(&at)
    }

    /// Calls `f` with the path (relative to the root; `.` for the root) and node of every node
    /// reachable from the root, parents before children, names in order.
    pub fn walk(&self, mut f: impl FnMut(&Path, &Node)) {
        self.walk_from(self.root, Path::new("."), 0, &mut f);
    }

    fn walk_from(&self, id: NodeId, path: &Path, depth: usize, f: &mut impl FnMut(&Path, &Node)) {
        let Some(node) = self.nodes.get(&id) else {
            return;
        };
        f(path, node);
        if let Node::Dir { entries, .. } = node
            && depth < MAX_DEPTH
        {
            for (name, child) in entries {
                let p = if path == Path::new(".") {
                    PathBuf::from(name)
                } else {
                    path.join(name)
                };
                self.walk_from(*child, &p, depth + 1, f);
            }
        }
    }

    /// One line per reachable node: its path, kind, mode and (for a file) length and a hash
    /// of its content. Equal listings mean equal trees (up to hard links).
    pub fn listing(&self) -> BTreeMap<PathBuf, String> {
        let mut out = BTreeMap::new();
        self.walk(|path, node| {
            let line = match node {
                Node::Dir { mode, .. } => format!("dir {mode:o}"),
                Node::File { data, mode } => {
                    let mut h = DefaultHasher::new();
                    data.hash(&mut h);
                    format!("file {mode:o} {} bytes {:016x}", data.len(), h.finish())
                }
                Node::Symlink { target } => format!("symlink -> {}", target.to_string_lossy()),
            };
            out.insert(path.to_owned(), line);
        });
        out
    }

    /// A hash of what the tree shows (paths, kinds, modes, contents): equal trees have equal
    /// digests.
    pub fn digest(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.walk(|path, node| {
            path.as_os_str().as_bytes().hash(&mut h);
            match node {
                Node::Dir { mode, .. } => (0u8, mode).hash(&mut h),
                Node::File { data, mode } => (1u8, mode, data).hash(&mut h),
                Node::Symlink { target } => (2u8, target.as_bytes()).hash(&mut h),
            }
        });
        h.finish()
    }

    /// Writes the tree out under `dest`, an existing empty directory that becomes its root
    /// (taking the root's mode). Hard links are made again as hard links.
    pub fn materialise(&self, dest: impl AsRef<Path>) -> Result<()> {
        let dest = dest.as_ref();
        let dir = Dir::open_nofollow(dest)?;
        let mut placed = HashMap::new();
        self.fill(&dir, self.root, 0, &mut placed)?;
        if let Some(Node::Dir { mode, .. }) = self.nodes.get(&self.root) {
            dir.set_mode(*mode)?;
        }
        Ok(())
    }

    fn fill(
        &self,
        dir: &Dir,
        id: NodeId,
        depth: usize,
        placed: &mut HashMap<NodeId, PathBuf>,
    ) -> Result<()> {
        let Some(Node::Dir { entries, .. }) = self.nodes.get(&id) else {
            return Ok(());
        };
        if depth >= MAX_DEPTH {
            return Ok(());
        }
        for (name, child) in entries {
            let path = dir.join(name);
            match self.nodes.get(child) {
                None => {}
                Some(Node::Dir { mode, .. }) => {
                    rustix::fs::mkdirat(dir, name.as_os_str(), Mode::from_raw_mode(0o700))
                        .map_err(|e| FsError::sys(Step::CreateDir, &path, e))?;
                    let Some(sub) = dir.open_dir(name)? else {
                        continue;
                    };
                    self.fill(&sub, *child, depth + 1, placed)?;
                    sub.set_mode(*mode)?;
                }
                Some(Node::File { data, mode }) => {
                    if let Some(first) = placed.get(child) {
                        rustix::fs::linkat(
                            rustix::fs::CWD,
                            first,
                            dir,
                            name.as_os_str(),
                            AtFlags::empty(),
                        )
                        .map_err(|e| FsError::sys(Step::Link, &path, e))?;
                        continue;
                    }
                    let flags = OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC;
                    let fd = rustix::fs::openat(
                        dir,
                        name.as_os_str(),
                        flags,
                        Mode::from_raw_mode(0o600),
                    )
                    .map_err(|e| FsError::sys(Step::Create, &path, e))?;
                    rustix::fs::fchmod(&fd, Mode::from_raw_mode(*mode as _))
                        .map_err(|e| FsError::sys(Step::SetMode, &path, e))?;
                    std::fs::File::from(fd)
                        .write_all(data)
                        .map_err(|e| FsError::io(Step::Write, &path, e))?;
                    placed.insert(*child, path);
                }
                Some(Node::Symlink { target }) => {
                    rustix::fs::symlinkat(target.as_os_str(), dir, name.as_os_str())
                        .map_err(|e| FsError::sys(Step::Create, &path, e))?;
                }
            }
        }
        Ok(())
    }
}

type Found = Vec<((u64, u64), NodeId, String)>;

/// Reads the tree under `root`, numbering its nodes from `next + 1`; also returns each node's
/// inode (device, number) and path relative to the root.
pub(crate) fn capture(root: &Path, next: &mut u64) -> Result<(Tree, Found)> {
    let dir = Dir::open_nofollow(root)?;
    let st = rustix::fs::fstat(&dir).map_err(|e| FsError::sys(Step::Stat, root, e))?;
    let mut by_key = HashMap::new();
    let mut tree = Tree {
        root: NodeId(0),
        nodes: HashMap::new(),
    };
    let mut found = Vec::new();
    let root_id = new_id(next);
    tree.root = root_id;
    by_key.insert(stat_key(&st), root_id);
    found.push((stat_key(&st), root_id, ".".to_owned()));
    let entries = capture_dir(&dir, "", 0, next, &mut tree, &mut by_key, &mut found)?;
    tree.nodes.insert(
        root_id,
        Node::Dir {
            entries,
            mode: FileInfo::from_stat(&st).mode,
        },
    );
    Ok((tree, found))
}

fn new_id(next: &mut u64) -> NodeId {
    *next += 1;
    NodeId(*next)
}

fn stat_key(st: &rustix::fs::Stat) -> (u64, u64) {
    #[allow(
        clippy::unnecessary_cast,
        clippy::useless_conversion,
        reason = "st_dev and st_ino differ between platforms"
    )]
    (st.st_dev as u64, st.st_ino as u64)
}

fn capture_dir(
    dir: &Dir,
    prefix: &str,
    depth: usize,
    next: &mut u64,
    tree: &mut Tree,
    by_key: &mut HashMap<(u64, u64), NodeId>,
    found: &mut Found,
) -> Result<BTreeMap<OsString, NodeId>> {
    let mut entries = BTreeMap::new();
    for name in dir.names()? {
        let path = dir.join(&name);
        let st = rustix::fs::statat(dir, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| FsError::sys(Step::Stat, &path, e))?;
        let key = stat_key(&st);
        let hint = format!("{prefix}{}", name.to_string_lossy());
        if let Some(id) = by_key.get(&key) {
            // A hard link to a file seen already.
            entries.insert(name, *id);
            continue;
        }
        let id = new_id(next);
        by_key.insert(key, id);
        found.push((key, id, hint.clone()));
        let info = FileInfo::from_stat(&st);
        let node = match info.kind {
            FileKind::Directory if depth < MAX_DEPTH => {
                let Some(sub) = dir.open_dir(&name)? else {
                    continue;
                };
                let inner = capture_dir(
                    &sub,
                    &format!("{hint}/"),
                    depth + 1,
                    next,
                    tree,
                    by_key,
                    found,
                )?;
                Node::Dir {
                    entries: inner,
                    mode: info.mode,
                }
            }
            FileKind::Regular => {
                let Some((data, _)) = dir.read_file(&name, u64::MAX)? else {
                    continue;
                };
                Node::File {
                    data,
                    mode: info.mode,
                }
            }
            FileKind::Symlink => {
                let target = rustix::fs::readlinkat(dir, name.as_os_str(), Vec::new())
                    .map_err(|e| FsError::sys(Step::Read, &path, e))?;
                Node::Symlink {
                    target: OsStr::from_bytes(target.as_bytes()).to_owned(),
                }
            }
            kind => {
                return Err(FsError::WrongType {
                    step: Step::Stat,
                    path,
                    found: kind.describe(),
                    expected: "a directory, a regular file or a symbolic link",
                });
            }
        };
        tree.nodes.insert(id, node);
        entries.insert(name, id);
    }
    Ok(entries)
}
