//! Bounded waits for tests: poll a condition until it holds, and fail the test (panic) naming
//! what never happened once the bound has passed. The bounds are there so that a hang fails,
//! never to time anything.

use std::time::{Duration, Instant};

/// How often [`wait_for`] and [`wait_until`] poll.
pub const POLL: Duration = Duration::from_millis(50);

/// Polls `probe` every [`POLL`] until it returns `Ok`, and returns that value; panics with
/// the last `Err` (what was still wrong) once `bound` has passed.
#[allow(
    clippy::panic,
    reason = "a test helper: a condition that never holds fails the test"
)]
pub fn wait_for<T>(what: &str, bound: Duration, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let started = Instant::now();
    loop {
        match probe() {
            Ok(value) => return value,
            Err(why) => {
                assert!(
                    started.elapsed() < bound,
                    "{what}: not within {bound:?}: {why}"
                );
            }
        }
        std::thread::sleep(POLL);
    }
}

/// Polls `check` every [`POLL`] until it holds; panics naming `what` once `bound` has passed.
pub fn wait_until(what: &str, bound: Duration, mut check: impl FnMut() -> bool) {
    wait_for(what, bound, || {
        if check() {
            Ok(())
        } else {
            Err("still not".to_owned())
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_first_ok_and_fails_with_the_last_reason() {
        let mut n = 0;
        let got = wait_for("n reaches 3", Duration::from_secs(30), || {
            n += 1;
            if n == 3 {
                Ok(n)
            } else {
                Err(format!("n is {n}"))
            }
        });
        assert_eq!(got, 3);
        let failed = std::panic::catch_unwind(|| {
            wait_for::<()>("never", Duration::from_millis(120), || {
                Err("still 7".to_owned())
            })
        });
        let message = failed
            .err()
            .and_then(|e| e.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        assert!(
            message.starts_with("never: not within 120ms: still 7"),
            "{message}"
        );
    }
}
