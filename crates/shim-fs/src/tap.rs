//! The recording seam in the durable operations. Every system call of this crate that changes
//! what a crash leaves on disk (create, write, fsync, rename, link, unlink, mkdir, rmdir, a
//! mode change) runs through [`Tap::around`], which, when the directory handle carries a
//! [`crate::crash::Recorder`], runs it under the recorder's lock and logs what it did.
//!
//! Built without `cfg(test)` or the `test-support` feature, [`Tap`] and [`Session`] are
//! zero-sized and every method is an inlined no-op: production code pays nothing.

#[cfg(any(test, feature = "test-support"))]
pub(crate) use recording::Tap;

#[cfg(not(any(test, feature = "test-support")))]
pub(crate) use noop::Tap;

#[cfg(any(test, feature = "test-support"))]
mod recording {
    use std::sync::Arc;

    use crate::crash::{Bug, Recorder, Session};

    /// The recorder a directory handle carries, if any.
    #[derive(Debug, Clone, Default)]
    pub(crate) struct Tap(Option<Arc<Recorder>>);

    impl Tap {
        pub(crate) fn new(recorder: Arc<Recorder>) -> Self {
            Self(Some(recorder))
        }

        /// Runs `call`; when recording, under the recorder's lock (so that the log's order is
        /// the order in which concurrent writers' calls took effect), then `note`s what
        /// succeeded. A failed call is not logged.
        pub(crate) fn around<T, E>(
            &self,
            call: impl FnOnce() -> Result<T, E>,
            note: impl FnOnce(&mut Session<'_>, &T),
        ) -> Result<T, E> {
            let Some(recorder) = &self.0 else {
                return call();
            };
            let mut session = recorder.session();
            let out = call();
            if let Ok(v) = &out {
                note(&mut session, v);
            }
            out
        }

        /// Whether the recorder asks for `bug` (a step left out on purpose).
        fn skips(&self, bug: Bug) -> bool {
            self.0.as_ref().is_some_and(|r| r.injects(bug))
        }

        /// [`Bug::SkipFileFsync`] is injected.
        pub(crate) fn skips_file_fsync(&self) -> bool {
            self.skips(Bug::SkipFileFsync)
        }

        /// [`Bug::SkipPublishDirFsync`] is injected.
        pub(crate) fn skips_publish_dir_fsync(&self) -> bool {
            self.skips(Bug::SkipPublishDirFsync)
        }

        /// [`Bug::SkipDirFsync`] is injected.
        pub(crate) fn skips_dir_fsync(&self) -> bool {
            self.skips(Bug::SkipDirFsync)
        }
    }
}

#[cfg(not(any(test, feature = "test-support")))]
mod noop {
    use std::ffi::OsStr;
    use std::marker::PhantomData;
    use std::os::fd::BorrowedFd;

    use rustix::fs::OFlags;

    /// Nothing (a release build cannot record). Not a unit struct, so that the code handling
    /// it reads the same in both builds (`Tap::default()`, `tap.clone()`).
    #[derive(Debug, Clone, Default)]
    pub(crate) struct Tap {
        _nothing: (),
    }

    /// The no-op twin of the recording session; its methods mirror that one's.
    pub(crate) struct Session<'a>(PhantomData<&'a ()>);

    impl Tap {
        #[inline(always)]
        pub(crate) fn around<T, E>(
            &self,
            call: impl FnOnce() -> Result<T, E>,
            _note: impl FnOnce(&mut Session<'_>, &T),
        ) -> Result<T, E> {
            call()
        }

        #[inline(always)]
        pub(crate) fn skips_file_fsync(&self) -> bool {
            false
        }

        #[inline(always)]
        pub(crate) fn skips_publish_dir_fsync(&self) -> bool {
            false
        }

        #[inline(always)]
        pub(crate) fn skips_dir_fsync(&self) -> bool {
            false
        }
    }

    #[allow(
        clippy::unused_self,
        reason = "mirrors the recording session's methods"
    )]
    impl Session<'_> {
        #[inline(always)]
        pub(crate) fn create(
            &mut self,
            _dir: BorrowedFd<'_>,
            _name: &OsStr,
            _file: BorrowedFd<'_>,
            _flags: OFlags,
            _mode: u32,
        ) {
        }
        #[inline(always)]
        pub(crate) fn mkdir(&mut self, _dir: BorrowedFd<'_>, _name: &OsStr, _mode: u32) {}
        #[inline(always)]
        pub(crate) fn write(&mut self, _file: BorrowedFd<'_>, _offset: u64, _data: &[u8]) {}
        #[inline(always)]
        pub(crate) fn fsync(&mut self, _file: BorrowedFd<'_>) {}
        #[inline(always)]
        pub(crate) fn fsync_dir(&mut self, _dir: BorrowedFd<'_>) {}
        #[inline(always)]
        pub(crate) fn rename(
            &mut self,
            _from_dir: BorrowedFd<'_>,
            _from: &OsStr,
            _to_dir: BorrowedFd<'_>,
            _to: &OsStr,
        ) {
        }
        #[inline(always)]
        pub(crate) fn link(
            &mut self,
            _from_dir: BorrowedFd<'_>,
            _from: &OsStr,
            _to_dir: BorrowedFd<'_>,
            _to: &OsStr,
        ) {
        }
        #[inline(always)]
        pub(crate) fn unlink(&mut self, _dir: BorrowedFd<'_>, _name: &OsStr) {}
        #[inline(always)]
        pub(crate) fn rmdir(&mut self, _dir: BorrowedFd<'_>, _name: &OsStr) {}
        #[inline(always)]
        pub(crate) fn set_mode(&mut self, _node: BorrowedFd<'_>, _mode: u32) {}
    }
}
