//! Fault injection for crash-safety tests (built with `cfg(test)` or the `test-support`
//! feature only): arm a [`Faults`] at one [`Step`] of an atomic write and pass it with
//! [`crate::WriteOptions::faults`].
//!
//! - [`FaultKind::Fail`]: the step fails with an error; the write cleans up (removes its temp
//!   file) and returns the error, as for a real failure.
//! - [`FaultKind::Crash`]: the process "dies" at this step: nothing after it runs and nothing is
//!   cleaned up. At [`Step::Write`] half the bytes are written first (for byte writes).
//!
//! Apart from the one armed fault, [`Faults::set_full`] makes the file system full until said
//! otherwise: every write step fails with the kernel's `ENOSPC` (as a full disk fails a write;
//! creating, renaming and fsyncing still succeed), and cleans up as for a real failure; and
//! [`Faults::hold_writes`] makes every write step wait until [`Faults::release_writes`] (a
//! slow disk: a test acts while a write is under way).

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use crate::Step;

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// The step fails with an error.
    Fail,
    /// The process stops at this step: no further step, no cleanup.
    Crash,
}

/// One armed fault. Shared between a test and the writes it passes it to.
#[derive(Debug, Default)]
pub struct Faults {
    state: Mutex<State>,
    /// Signalled when held writes are released.
    released: Condvar,
}

#[derive(Debug, Default)]
struct State {
    armed: Option<(Step, FaultKind)>,
    fired: Option<(Step, FaultKind)>,
    full: bool,
    held: bool,
    /// Writes waiting at their write step now.
    waiting: usize,
}

impl Faults {
    /// Nothing armed.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Arms one fault at `step` (replacing any armed one; forgets what fired before).
    pub fn arm(&self, step: Step, kind: FaultKind) {
        let mut s = self.state();
        s.armed = Some((step, kind));
        s.fired = None;
    }

    /// Makes the file system full (every write step fails with `ENOSPC`) or gives the space
    /// back. Independent of the armed fault.
    pub fn set_full(&self, full: bool) {
        self.state().full = full;
    }

    /// Makes every write step wait (on the writing thread) until [`Faults::release_writes`].
    pub fn hold_writes(&self) {
        self.state().held = true;
    }

    /// Lets the held writes go on.
    pub fn release_writes(&self) {
        self.state().held = false;
        self.released.notify_all();
    }

    /// How many writes wait at their write step now ([`Faults::hold_writes`]).
    pub fn writes_waiting(&self) -> usize {
        self.state().waiting
    }

    /// Waits while writes are held (a write step calls this first).
    pub(crate) fn wait_while_held(&self) {
        let mut s = self.state();
        if !s.held {
            return;
        }
        s.waiting += 1;
        while s.held {
            s = self
                .released
                .wait(s)
                .unwrap_or_else(PoisonError::into_inner);
        }
        s.waiting -= 1;
    }

    /// Whether the file system is full ([`Faults::set_full`]).
    pub fn is_full(&self) -> bool {
        self.state().full
    }

    /// The fault that fired, if the write reached its step.
    pub fn fired(&self) -> Option<(Step, FaultKind)> {
        self.state().fired
    }

    /// Whether a crash fired: the "process" is dead, nothing may be cleaned up.
    pub fn crashed(&self) -> bool {
        matches!(self.state().fired, Some((_, FaultKind::Crash)))
    }

    /// Fires the fault armed at `step`, if any, for a caller that injects at a step of its
    /// own (a store's fsync of a directory it shares): the injected error, naming `path`.
    pub fn fire(&self, step: Step, path: &std::path::Path) -> crate::Result<()> {
        match self.take(step) {
            None => Ok(()),
            Some(kind) => Err(crate::FsError::Io {
                step,
                path: path.to_owned(),
                source: std::io::Error::other(Injected { step, kind }),
            }),
        }
    }

    /// The armed fault's kind if it is armed at `step` (it fires once).
    pub(crate) fn take(&self, step: Step) -> Option<FaultKind> {
        let mut s = self.state();
        match s.armed {
            Some((at, kind)) if at == step => {
                s.armed = None;
                s.fired = Some((at, kind));
                Some(kind)
            }
            _ => None,
        }
    }
}

/// The source error of an injected fault (inside [`crate::FsError::Io`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Injected {
    /// Where it fired.
    pub step: Step,
    /// What it did.
    pub kind: FaultKind,
}

impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "injected {:?} at {:?}", self.kind, self.step)
    }
}

impl std::error::Error for Injected {}

/// The injected fault behind `err`, if it is one.
pub fn injected(err: &crate::FsError) -> Option<Injected> {
    match err {
        crate::FsError::Io { source, .. } => source
            .get_ref()
            .and_then(|e| e.downcast_ref::<Injected>())
            .copied(),
        _ => None,
    }
}
