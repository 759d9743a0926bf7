//! A group commit of one directory: concurrent callers that each need their changes in the
//! directory durable share one `fsync` of it ([`GroupSync`]), as a write-ahead log batches
//! the records of concurrent transactions into one flush.

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::dir::Dir;
use crate::error::{FsError, Result, Step};

/// fsyncs of one directory shared by concurrent callers.
///
/// [`GroupSync::sync`] returns once an fsync of the directory that *began after the call
/// began* has succeeded: whatever the caller changed in the directory before the call is then
/// durable. Only one fsync runs at a time; callers that arrive while one runs wait for it, and
/// the first of them then runs one fsync for all of them. Alone, a caller pays exactly one
/// fsync; `n` concurrent callers pay between one and `n`, usually two.
///
/// Every call must pass the same directory (the handle it was made for, or one of the same
/// directory).
#[derive(Debug, Default)]
pub struct GroupSync {
    state: Mutex<State>,
    done: Condvar,
}

/// How many callers and how many fsyncs a [`GroupSync`] had.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// Calls of [`GroupSync::sync`].
    pub callers: u64,
    /// fsyncs run for them.
    pub fsyncs: u64,
}

#[derive(Debug, Default)]
struct State {
    /// The generation of the last fsync begun (generations count from 1).
    started: u64,
    /// The generation of the last fsync finished.
    finished: u64,
    /// The last generation that succeeded.
    ok_through: u64,
    /// An fsync is being run (or gathered, in tests).
    leading: bool,
    /// Callers waiting for an fsync (tests gather them).
    waiting: usize,
    /// The last failure: its kind and message, for the callers that shared it.
    failure: Option<(std::io::ErrorKind, String)>,
    stats: GroupStats,
    /// Tests: the next fsync waits until this many callers share it (or the bound passes).
    #[cfg(any(test, feature = "test-support"))]
    gather: Option<(usize, std::time::Duration)>,
    /// Tests: a leader is gathering callers (each arrival wakes it).
    #[cfg(any(test, feature = "test-support"))]
    gathering: bool,
}

impl GroupSync {
    /// A group commit with nothing run yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes what the caller changed in `dir` so far durable: returns once an fsync of `dir`
    /// begun after this call began has succeeded, running it itself unless one is running
    /// (then it waits for that one to end and runs, or shares, the next). An fsync that
    /// failed fails every caller that shared it.
    pub fn sync(&self, dir: &Dir) -> Result<()> {
        let mut st = self.lock();
        st.stats.callers += 1;
        // The fsync that covers this call: the next one to begin.
        let target = st.started + 1;
        // Counted among the waiters (once per call: a gathering leader counts callers).
        let mut counted = false;
        loop {
            if st.finished >= target {
                if counted {
                    st.waiting -= 1;
                }
                if st.ok_through >= target {
                    return Ok(());
                }
                let (kind, message) = st
                    .failure
                    .clone()
                    .unwrap_or((std::io::ErrorKind::Other, "unknown".to_owned()));
                return Err(FsError::io(
                    Step::SyncDir,
                    dir.path(),
                    std::io::Error::new(kind, format!("the shared fsync failed: {message}")),
                ));
            }
            if !st.leading {
                if counted {
                    st.waiting -= 1;
                }
                st.leading = true;
                st = self.gather(st);
                st.started += 1;
                let generation = st.started;
                drop(st);
                let result = dir.sync();
                let mut st = self.lock();
                st.leading = false;
                st.finished = generation;
                st.stats.fsyncs += 1;
                match &result {
                    Ok(()) => st.ok_through = generation,
                    Err(e) => {
                        let kind = e.io_kind().unwrap_or(std::io::ErrorKind::Other);
                        st.failure = Some((kind, e.to_string()));
                    }
                }
                drop(st);
                self.done.notify_all();
                // This call led the fsync of its own target (nothing began in between: an
                // fsync begins only while no other runs, and this one waited for the last).
                return result;
            }
            if !counted {
                st.waiting += 1;
                counted = true;
                self.arrived(&st);
            }
            st = self.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// How many callers and fsyncs so far.
    pub fn stats(&self) -> GroupStats {
        self.lock().stats
    }

    /// Tests: the next fsync waits, at most `bound`, until `callers` callers (its leader
    /// included) share it, so that a test can make concurrent callers share one.
    #[cfg(any(test, feature = "test-support"))]
    pub fn gather_next(&self, callers: usize, bound: std::time::Duration) {
        self.lock().gather = Some((callers, bound));
    }

    /// Waits for the callers a test asked the next fsync to gather (none in production).
    #[cfg(any(test, feature = "test-support"))]
    fn gather<'a>(&'a self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        let Some((callers, bound)) = st.gather.take() else {
            return st;
        };
        let until = std::time::Instant::now() + bound;
        st.gathering = true;
        while st.waiting + 1 < callers {
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            st = self
                .done
                .wait_timeout(st, left)
                .map(|(st, _)| st)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        st.gathering = false;
        st
    }

    /// Tests: a caller began to wait; a gathering leader counts it.
    #[cfg(any(test, feature = "test-support"))]
    fn arrived(&self, st: &State) {
        if st.gathering {
            self.done.notify_all();
        }
    }

    #[cfg(not(any(test, feature = "test-support")))]
    #[inline(always)]
    fn arrived(&self, _st: &State) {}

    #[cfg(not(any(test, feature = "test-support")))]
    #[inline(always)]
    fn gather<'a>(&'a self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        st
    }
}
