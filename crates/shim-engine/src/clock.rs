//! The engine's clock ([`Clock`]): wall time for records and metrics, and a monotonic stamp
//! that orders a list request against the end of a start. Injected through
//! [`Deps::clock`](crate::Deps::clock), so that tests on tokio's paused time stamp records with
//! the virtual time they advance.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The engine's clock. [`Clock::system`] (the default) reads the host's wall clock, which
/// may be stepped (NTP) while the shim runs; [`Clock::tokio_from`] is wall time that moves
/// only with tokio's clock, for tests whose runtime is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock(Source);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    System,
    Tokio {
        wall_ms: u64,
        start: tokio::time::Instant,
    },
}

impl Default for Clock {
    fn default() -> Self {
        Self::system()
    }
}

impl Clock {
    /// The host's wall clock and a monotonic clock of this process.
    pub fn system() -> Self {
        Self(Source::System)
    }

    /// Wall time that reads `wall_ms` (Unix milliseconds) now and moves with tokio's clock:
    /// under `tokio::time::pause`, only by what the test advances. Created inside a runtime.
    pub fn tokio_from(wall_ms: u64) -> Self {
        Self(Source::Tokio {
            wall_ms,
            start: tokio::time::Instant::now(),
        })
    }

    /// Unix milliseconds now (0 before 1970).
    pub fn now_ms(&self) -> u64 {
        match self.0 {
            Source::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                .unwrap_or(0),
            Source::Tokio { wall_ms, start } => {
                let elapsed = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
                wall_ms.saturating_add(elapsed)
            }
        }
    }

    /// Unix nanoseconds now (what Docker's event `since` takes).
    pub(crate) fn now_unix_ns(&self) -> i64 {
        let ns = match self.0 {
            Source::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            Source::Tokio { wall_ms, start } => {
                u128::from(wall_ms) * 1_000_000 + start.elapsed().as_nanos()
            }
        };
        i64::try_from(ns).unwrap_or(i64::MAX)
    }

    /// Nanoseconds on a monotonic clock (since the first call in this process, or since
    /// [`Clock::tokio_from`]), plus one (never 0): orders a list request against the end of a
    /// start, which milliseconds cannot (both may fall in the same one).
    pub(crate) fn mono_ns(&self) -> u64 {
        let elapsed = match self.0 {
            Source::System => {
                static BASE: OnceLock<Instant> = OnceLock::new();
                BASE.get_or_init(Instant::now).elapsed()
            }
            Source::Tokio { start, .. } => start.elapsed(),
        };
        u64::try_from(elapsed.as_nanos())
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: panics are failures

    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_moves_only_with_tokio_time() {
        let clock = Clock::tokio_from(1_700_000_000_000);
        let mono = clock.mono_ns();
        assert_eq!(clock.now_ms(), 1_700_000_000_000);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            clock.now_ms(),
            1_700_000_000_000,
            "real time does not count"
        );
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(clock.now_ms(), 1_700_000_090_000);
        assert_eq!(clock.now_unix_ns(), 1_700_000_090_000_000_000);
        assert_eq!(clock.mono_ns() - mono, 90_000_000_000);
    }

    #[test]
    fn the_system_clock_is_the_hosts() {
        let clock = Clock::system();
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let now = clock.now_ms();
        assert!(now >= u64::try_from(before.as_millis()).unwrap());
        let (a, b) = (clock.mono_ns(), clock.mono_ns());
        assert!(a > 0 && b >= a);
    }
}
