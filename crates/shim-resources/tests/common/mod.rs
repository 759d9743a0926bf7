//! Helpers shared by this crate's integration tests.

/// The first statement of a test that needs root (loop devices, mounts), which also carries the
/// workspace's root `#[ignore]` reason: panics unless `SHIM_TEST_ROOT=1`, so that the test, run
/// on purpose without its environment, fails instead of passing (the local copy of
/// `shim_e2e::require_root`: this crate's tests do not depend on `shim-e2e`).
#[track_caller]
pub fn require_root() {
    assert!(
        std::env::var("SHIM_TEST_ROOT").is_ok_and(|v| v == "1"),
        "this test needs root (loop devices, mounts): run it as root and set SHIM_TEST_ROOT=1 \
         (SHIM_TEST_ROOT is not 1)"
    );
}
