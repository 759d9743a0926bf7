//! For tests (`cfg(test)` or the `test-support` feature): the check of the workspace's error
//! convention, and the gate of the tests that need root.

use std::error::Error;

/// Fails (panics) unless `e` has at least one cause (a test on an error without one could not
/// fail) and no level's `Display` contains its source's text, so that [`crate::error_chain`]
/// prints each cause once. Returns the chain.
#[allow(
    clippy::panic,
    reason = "test support: a violated convention fails the test"
)]
pub fn assert_each_cause_once(e: &dyn Error) -> String {
    let mut levels = vec![e.to_string()];
    let mut source = e.source();
    while let Some(cause) = source {
        levels.push(cause.to_string());
        source = cause.source();
    }
    assert!(
        levels.len() >= 2,
        "{:?} has no cause: nothing to check",
        levels[0]
    );
    for pair in levels.windows(2) {
        assert!(
            !pair[0].contains(pair[1].as_str()),
            "{:?} repeats the text of its source {:?}",
            pair[0],
            pair[1]
        );
    }
    let chain = crate::error_chain(e);
    assert_eq!(chain, levels.join(": "));
    chain
}

/// The first statement of a test that needs root (loop devices, mounts), which also carries the
/// workspace's root `#[ignore]` reason: panics unless `SHIM_TEST_ROOT=1`, so that the test, run
/// on purpose without its environment, fails instead of passing (`shim_e2e::require_root` for
/// the crates below the end-to-end tests).
#[track_caller]
pub fn require_root() {
    assert!(
        std::env::var("SHIM_TEST_ROOT").is_ok_and(|v| v == "1"),
        "this test needs root (loop devices, mounts): run it as root and set SHIM_TEST_ROOT=1 \
         (SHIM_TEST_ROOT is not 1)"
    );
}

/// A frozen file system (`fsfreeze`) of 16 MiB on a loop device, mounted at `mount` under the
/// directory it is made in: a write or a `mkdir` there blocks in the kernel, uninterruptibly,
/// as on a hung network file system, until it is thawed (at drop, before a lazy unmount: the
/// thawed writer may hold its file a moment longer). Needs root ([`require_root`] first).
#[derive(Debug)]
pub struct FrozenFs {
    /// Where it is mounted.
    pub mount: std::path::PathBuf,
}

impl FrozenFs {
    /// Makes, mounts and freezes it in `dir`.
    #[allow(
        clippy::panic,
        clippy::unwrap_used,
        reason = "test support: a set-up that fails fails the test"
    )]
    pub fn new(dir: &std::path::Path) -> Self {
        let image = dir.join("frozen.img");
        let mount = dir.join("frozen");
        fs_err::File::create(&image)
            .and_then(|f| f.set_len(16 << 20))
            .unwrap();
        fs_err::create_dir(&mount).unwrap();
        let run = |program: &str, args: &[&std::ffi::OsStr]| {
            let status = std::process::Command::new(program)
                .args(args)
                .status()
                .unwrap();
            assert!(status.success(), "{program} {args:?}: {status}");
        };
        run(
            "mkfs.ext4",
            &["-q".as_ref(), "-F".as_ref(), image.as_os_str()],
        );
        let loop_ = [
            "-o".as_ref(),
            "loop".as_ref(),
            image.as_os_str(),
            mount.as_os_str(),
        ];
        run("mount", &loop_);
        run("fsfreeze", &["-f".as_ref(), mount.as_os_str()]);
        Self { mount }
    }
}

impl Drop for FrozenFs {
    fn drop(&mut self) {
        for (program, arg) in [("fsfreeze", "-u"), ("umount", "-l")] {
            let _ = std::process::Command::new(program)
                .arg(arg)
                .arg(&self.mount)
                .status();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read x: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read x")]
    struct Describes(#[source] std::io::Error);

    #[test]
    fn a_level_that_repeats_its_source_fails() {
        let cause = || std::io::Error::other("gone");
        assert_eq!(
            assert_each_cause_once(&Describes(cause())),
            "cannot read x: gone"
        );
        assert!(std::panic::catch_unwind(|| assert_each_cause_once(&Repeats(cause()))).is_err());
        assert!(std::panic::catch_unwind(|| assert_each_cause_once(&cause())).is_err());
    }
}
