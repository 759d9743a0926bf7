//! The recorder: the log of every durable operation made through directory handles that
//! carry it, in the order the operations took effect.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rustix::fs::{AtFlags, OFlags};

use super::tree::{Tree, capture};
use crate::error::Result;

/// One file or directory (one inode) of the recorded tree. Ids are never reused, even when
/// the file system reuses an inode number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub(crate) u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One recorded operation, as it took effect (a failed system call is not recorded).
///
/// Names are single path components in the directory named by a [`NodeId`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Op {
    /// `openat(dir, name, O_CREAT|…)` made a new file.
    Create {
        /// The directory it was created in.
        dir: NodeId,
        /// Its name there.
        name: OsString,
        /// The new file.
        node: NodeId,
        /// The `open(2)` flags (`O_CREAT|O_EXCL|O_NOFOLLOW|…`, raw bits).
        flags: u32,
        /// The mode asked for (before the umask).
        mode: u32,
    },
    /// `mkdirat(dir, name)`.
    Mkdir {
        /// The parent directory.
        dir: NodeId,
        /// The new directory's name.
        name: OsString,
        /// The new directory.
        node: NodeId,
        /// The mode asked for (before the umask).
        mode: u32,
    },
    /// `data` written at `offset` of the file `node`.
    Write {
        /// The file.
        node: NodeId,
        /// Where.
        offset: u64,
        /// What.
        data: Vec<u8>,
    },
    /// `fsync` of the file `node`: its data written so far is durable.
    Fsync {
        /// The file.
        node: NodeId,
    },
    /// `fsync` of the directory `dir`: its entries' changes so far are durable.
    FsyncDir {
        /// The directory.
        dir: NodeId,
    },
    /// `renameat(from_dir, from, to_dir, to)`, moving `node` (replacing what `to` named).
    Rename {
        /// The source directory.
        from_dir: NodeId,
        /// The source name.
        from: OsString,
        /// The target directory.
        to_dir: NodeId,
        /// The target name.
        to: OsString,
        /// What was moved.
        node: NodeId,
    },
    /// `linkat(from_dir, from, to_dir, to)`: a new name `to` for `node`.
    Link {
        /// The source directory.
        from_dir: NodeId,
        /// The source name.
        from: OsString,
        /// The directory of the new name.
        to_dir: NodeId,
        /// The new name.
        to: OsString,
        /// The file linked.
        node: NodeId,
    },
    /// `unlinkat(dir, name)` of a file or link.
    Unlink {
        /// The directory.
        dir: NodeId,
        /// The name removed.
        name: OsString,
    },
    /// `unlinkat(dir, name, AT_REMOVEDIR)`.
    Rmdir {
        /// The parent directory.
        dir: NodeId,
        /// The name of the directory removed.
        name: OsString,
    },
    /// `fchmod` of `node`. The model keeps modes but does not vary them across crash states.
    SetMode {
        /// The file or directory.
        node: NodeId,
        /// The new permission bits.
        mode: u32,
    },
}

impl Op {
    /// Whether this changes directory entries (made durable by an fsync of the directory).
    pub fn is_entry_op(&self) -> bool {
        matches!(
            self,
            Self::Create { .. }
                | Self::Mkdir { .. }
                | Self::Rename { .. }
                | Self::Link { .. }
                | Self::Unlink { .. }
                | Self::Rmdir { .. }
        )
    }

    /// The directories whose fsync makes this entry operation durable: its directory, or for a
    /// rename both directories (the model waits for both). Empty for other operations.
    pub fn entry_dirs(&self) -> Vec<NodeId> {
        match self {
            Self::Create { dir, .. }
            | Self::Mkdir { dir, .. }
            | Self::Unlink { dir, .. }
            | Self::Rmdir { dir, .. } => vec![*dir],
            Self::Link { to_dir, .. } => vec![*to_dir],
            Self::Rename {
                from_dir, to_dir, ..
            } if from_dir == to_dir => vec![*from_dir],
            Self::Rename {
                from_dir, to_dir, ..
            } => vec![*from_dir, *to_dir],
            Self::Write { .. }
            | Self::Fsync { .. }
            | Self::FsyncDir { .. }
            | Self::SetMode { .. } => Vec::new(),
        }
    }
}

/// A step of the durable writes that a test leaves out on purpose, to show that the crash
/// states it enumerates catch the missing step ([`Recorder::inject`]). Only directory handles
/// that carry the recorder are affected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Bug {
    /// [`crate::Dir::write_atomic`], [`crate::Dir::write_atomic_with`] and
    /// [`crate::Dir::create_new_atomic`] skip the fsync of the temp file before publishing it.
    SkipFileFsync,
    /// The same writes skip the fsync of the directory after the rename (or link).
    SkipPublishDirFsync,
    /// Every [`crate::Dir::sync`] (and so also the atomic writes' directory fsync) is skipped.
    SkipDirFsync,
}

impl Bug {
    fn bit(self) -> u8 {
        match self {
            Self::SkipFileFsync => 1,
            Self::SkipPublishDirFsync => 2,
            Self::SkipDirFsync => 4,
        }
    }
}

/// Records the durable operations made through the directory handles that carry it
/// ([`crate::Dir::with_recorder`]; handles opened from such a handle carry it too). Created
/// on a root directory, which it snapshots first: the log and that snapshot are what
/// [`super::explore`] builds crash states from.
///
/// Each recorded system call runs under the recorder's lock, so the log's order is the order
/// in which concurrent writers' operations took effect.
#[derive(Debug)]
pub struct Recorder {
    root: PathBuf,
    state: Mutex<State>,
    bugs: AtomicU8,
}

#[derive(Debug)]
struct State {
    initial: Tree,
    ops: Vec<Op>,
    described: Vec<String>,
    /// Live inodes (device, inode number) to nodes.
    inodes: HashMap<(u64, u64), NodeId>,
    /// The last known path of each node, relative to the root (for messages).
    hints: HashMap<NodeId, String>,
    next: u64,
    problems: Vec<String>,
}

impl Recorder {
    /// Snapshots the tree under `root` (directories, regular files and symbolic links; its
    /// state is taken as durable) and starts an empty log.
    pub fn start(root: impl AsRef<Path>) -> Result<Arc<Self>> {
        let root = root.as_ref();
        let mut next = 0;
        let (initial, found) = capture(root, &mut next)?;
        let mut inodes = HashMap::new();
        let mut hints = HashMap::new();
        for (key, node, hint) in found {
            inodes.insert(key, node);
            hints.insert(node, hint);
        }
        Ok(Arc::new(Self {
            root: root.to_owned(),
            state: Mutex::new(State {
                initial,
                ops: Vec::new(),
                described: Vec::new(),
                inodes,
                hints,
                next,
                problems: Vec::new(),
            }),
            bugs: AtomicU8::new(0),
        }))
    }

    /// The root it snapshotted.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many operations are recorded so far: a crash point. A call that returned before
    /// this was read has all its operations before it.
    pub fn position(&self) -> usize {
        self.lock().ops.len()
    }

    /// A copy of the log so far, with the initial snapshot.
    pub fn log(&self) -> Log {
        let s = self.lock();
        Log {
            initial: s.initial.clone(),
            ops: s.ops.clone(),
            described: s.described.clone(),
            problems: s.problems.clone(),
        }
    }

    /// Leaves `bug`'s step out of the writes through handles that carry this recorder, from
    /// now on (tests that show the crash states catch it).
    pub fn inject(&self, bug: Bug) {
        self.bugs.fetch_or(bug.bit(), Ordering::SeqCst);
    }

    pub(crate) fn injects(&self, bug: Bug) -> bool {
        self.bugs.load(Ordering::SeqCst) & bug.bit() != 0
    }

    /// The lock under which one operation runs and is noted.
    pub(crate) fn session(&self) -> Session<'_> {
        Session { state: self.lock() }
    }
}

/// What [`Recorder::log`] returns: the initial snapshot and the operations since.
#[derive(Debug, Clone)]
pub struct Log {
    /// The tree when recording started (taken as durable).
    pub initial: Tree,
    /// The operations, in order.
    pub ops: Vec<Op>,
    described: Vec<String>,
    /// What the recorder could not attribute (an inode it could not stat, a directory outside
    /// the snapshot); empty when every operation was placed in the tree.
    pub problems: Vec<String>,
}

impl Log {
    /// Operation `i` with the paths (relative to the root) its nodes had then.
    pub fn describe(&self, i: usize) -> &str {
        self.described
            .get(i)
            .map_or("(no such operation)", String::as_str)
    }

    /// The tree with every operation applied and every write kept: what the disk shows now,
    /// if every operation went through the recorder. Compare it with [`Tree::read`] of the
    /// root to check that none bypassed it.
    pub fn live(&self) -> Tree {
        super::explore::replay(self, self.ops.len(), |_| 0)
    }
}

/// The recorder's lock, held around one system call; notes what it did.
pub(crate) struct Session<'a> {
    state: MutexGuard<'a, State>,
}

type Key = (u64, u64);

fn key_of(st: &rustix::fs::Stat) -> Key {
    #[allow(
        clippy::unnecessary_cast,
        clippy::useless_conversion,
        reason = "st_dev and st_ino differ between platforms"
    )]
    (st.st_dev as u64, st.st_ino as u64)
}

impl Session<'_> {
    fn fresh_id(&mut self) -> NodeId {
        self.state.next += 1;
        NodeId(self.state.next)
    }

    /// The node of an existing inode (a stranger outside the snapshot gets a fresh id and is
    /// reported).
    fn known(&mut self, key: Option<Key>, what: &str) -> NodeId {
        if let Some(k) = key
            && let Some(n) = self.state.inodes.get(&k)
        {
            return *n;
        }
        let id = self.fresh_id();
        let problem = match key {
            Some((dev, ino)) => format!("{what}: inode {dev}:{ino} is outside the snapshot"),
            None => format!("{what}: cannot stat it"),
        };
        self.state.problems.push(problem);
        if let Some(k) = key {
            self.state.inodes.insert(k, id);
        }
        self.state.hints.insert(id, format!("?{}", id.0));
        id
    }

    fn node_of_fd(&mut self, fd: BorrowedFd<'_>, what: &str) -> NodeId {
        let key = rustix::fs::fstat(fd).ok().map(|st| key_of(&st));
        self.known(key, what)
    }

    fn node_at(&mut self, dir: BorrowedFd<'_>, name: &OsStr, what: &str) -> NodeId {
        let key = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .ok()
            .map(|st| key_of(&st));
        self.known(key, what)
    }

    /// A new inode: a fresh node, whatever an earlier inode of the same number was.
    fn fresh(&mut self, key: Option<Key>, hint: String) -> NodeId {
        let id = self.fresh_id();
        match key {
            Some(k) => {
                self.state.inodes.insert(k, id);
            }
            None => self.state.problems.push(format!("cannot stat new {hint}")),
        }
        self.state.hints.insert(id, hint);
        id
    }

    fn hint(&self, node: NodeId) -> String {
        self.state
            .hints
            .get(&node)
            .cloned()
            .unwrap_or_else(|| format!("?{}", node.0))
    }

    fn child_hint(&self, dir: NodeId, name: &OsStr) -> String {
        let parent = self.hint(dir);
        let name = name.to_string_lossy();
        if parent == "." {
            name.into_owned()
        } else {
            format!("{parent}/{name}")
        }
    }

    fn push(&mut self, op: Op, description: String) {
        self.state.ops.push(op);
        self.state.described.push(description);
    }

    pub(crate) fn create(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &OsStr,
        file: BorrowedFd<'_>,
        flags: OFlags,
        mode: u32,
    ) {
        let dir = self.node_of_fd(dir, "create");
        let hint = self.child_hint(dir, name);
        let key = rustix::fs::fstat(file).ok().map(|st| key_of(&st));
        let node = self.fresh(key, hint.clone());
        let description = format!("create {hint} ({node}, flags {flags:?}, mode {mode:o})");
        self.push(
            Op::Create {
                dir,
                name: name.to_owned(),
                node,
                flags: flags.bits(),
                mode,
            },
            description,
        );
    }

    pub(crate) fn mkdir(&mut self, dir: BorrowedFd<'_>, name: &OsStr, mode: u32) {
        let parent = self.node_of_fd(dir, "mkdir");
        let hint = self.child_hint(parent, name);
        let key = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
            .ok()
            .map(|st| key_of(&st));
        let node = self.fresh(key, hint.clone());
        self.push(
            Op::Mkdir {
                dir: parent,
                name: name.to_owned(),
                node,
                mode,
            },
            format!("mkdir {hint} ({node}, mode {mode:o})"),
        );
    }

    pub(crate) fn write(&mut self, file: BorrowedFd<'_>, offset: u64, data: &[u8]) {
        let node = self.node_of_fd(file, "write");
        let description = format!(
            "write {} ({node}) at {offset}: {} bytes",
            self.hint(node),
            data.len()
        );
        self.push(
            Op::Write {
                node,
                offset,
                data: data.to_vec(),
            },
            description,
        );
    }

    pub(crate) fn fsync(&mut self, file: BorrowedFd<'_>) {
        let node = self.node_of_fd(file, "fsync");
        let description = format!("fsync {} ({node})", self.hint(node));
        self.push(Op::Fsync { node }, description);
    }

    pub(crate) fn fsync_dir(&mut self, dir: BorrowedFd<'_>) {
        let dir = self.node_of_fd(dir, "fsync of a directory");
        let description = format!("fsync directory {} ({dir})", self.hint(dir));
        self.push(Op::FsyncDir { dir }, description);
    }

    pub(crate) fn rename(
        &mut self,
        from_dir: BorrowedFd<'_>,
        from: &OsStr,
        to_dir: BorrowedFd<'_>,
        to: &OsStr,
    ) {
        let from_node = self.node_of_fd(from_dir, "rename");
        let to_node = self.node_of_fd(to_dir, "rename");
        // After the rename, `to` names what was moved.
        let node = self.node_at(to_dir, to, "rename");
        let (old, new) = (
            self.child_hint(from_node, from),
            self.child_hint(to_node, to),
        );
        self.state.hints.insert(node, new.clone());
        self.push(
            Op::Rename {
                from_dir: from_node,
                from: from.to_owned(),
                to_dir: to_node,
                to: to.to_owned(),
                node,
            },
            format!("rename {old} -> {new} ({node})"),
        );
    }

    pub(crate) fn link(
        &mut self,
        from_dir: BorrowedFd<'_>,
        from: &OsStr,
        to_dir: BorrowedFd<'_>,
        to: &OsStr,
    ) {
        let from_node = self.node_of_fd(from_dir, "link");
        let to_node = self.node_of_fd(to_dir, "link");
        let node = self.node_at(to_dir, to, "link");
        let (old, new) = (
            self.child_hint(from_node, from),
            self.child_hint(to_node, to),
        );
        self.push(
            Op::Link {
                from_dir: from_node,
                from: from.to_owned(),
                to_dir: to_node,
                to: to.to_owned(),
                node,
            },
            format!("link {old} -> {new} ({node})"),
        );
    }

    pub(crate) fn unlink(&mut self, dir: BorrowedFd<'_>, name: &OsStr) {
        let dir = self.node_of_fd(dir, "unlink");
        let description = format!("unlink {}", self.child_hint(dir, name));
        self.push(
            Op::Unlink {
                dir,
                name: name.to_owned(),
            },
            description,
        );
    }

    pub(crate) fn rmdir(&mut self, dir: BorrowedFd<'_>, name: &OsStr) {
        let dir = self.node_of_fd(dir, "rmdir");
        let description = format!("rmdir {}", self.child_hint(dir, name));
        self.push(
            Op::Rmdir {
                dir,
                name: name.to_owned(),
            },
            description,
        );
    }

    pub(crate) fn set_mode(&mut self, fd: BorrowedFd<'_>, mode: u32) {
        let node = self.node_of_fd(fd, "chmod");
        let description = format!("chmod {} ({node}) {mode:o}", self.hint(node));
        self.push(Op::SetMode { node, mode }, description);
    }
}
