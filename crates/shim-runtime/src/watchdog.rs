//! A pull's two clocks: the wall-clock cap ([`PullRequest::timeout`]) and the stall watchdog
//! ([`PullRequest::stall_timeout`]), which fails a pull that nothing moves and lets a slow but
//! moving one go on (dstackai/dstack#3040: an 11.3 GB image at 9 MB/s failed at 100 % on a
//! 20-minute cap).
//!
//! What moves a pull is decided by the caller ([`Watchdog::moved`]): the Docker runtime calls
//! it on every message that says something new (`docker::progress::Activity`), not on every
//! message, because Docker 28 on the containerd image store repeats a layer's last
//! `Downloading` line every 100 ms while nothing arrives.
//!
//! Once every layer is downloaded, an engine may unpack in silence (Docker 26–27 on the
//! containerd image store and Podman send nothing between the last `Download complete` and
//! the end): then the engine's data on disk ([`crate::DiskProbe`], read every
//! [`EXTRACTION_POLL`]) moving counts as progress ([`DiskWatch`]), and where there is no
//! such measure the silence may last [`EXTRACTION_STALL_TIMEOUT`] (or the stall timeout, if
//! longer) before it is a stall.
//!
//! [`PullRequest::timeout`]: crate::PullRequest::timeout
//! [`PullRequest::stall_timeout`]: crate::PullRequest::stall_timeout

use std::time::Duration;

#[cfg(test)]
use futures_util::{Stream, StreamExt};
use tokio::time::Instant;

/// How often the engine's data on disk is read while it unpacks in silence.
pub const EXTRACTION_POLL: Duration = Duration::from_secs(1);

/// How long a pull may be silent after its last download when nothing on disk can be watched:
/// unpacking a large last layer at a slow disk's 50 MB/s takes minutes (20 GB: 7 minutes).
pub const EXTRACTION_STALL_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Sleeps for `limit`, or forever where there is none.
pub(crate) async fn expiry(limit: Option<Duration>) {
    match limit {
        Some(limit) => tokio::time::sleep(limit).await,
        None => std::future::pending().await,
    }
}

/// Fails a stream that does not move for `limit`.
#[derive(Debug)]
pub(crate) struct Watchdog {
    limit: Option<Duration>,
    started: Instant,
    moved: Instant,
}

impl Watchdog {
    /// A watchdog whose clock starts now; `None`: never fires.
    pub(crate) fn new(limit: Option<Duration>) -> Self {
        let now = Instant::now();
        Self {
            limit,
            started: now,
            moved: now,
        }
    }

    /// Something moved: the stall clock starts again.
    pub(crate) fn moved(&mut self) {
        self.moved = Instant::now();
    }

    /// Since the watchdog started.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The stall limit, or `limit` where it is longer (`None` stays `None`: no watchdog).
    pub(crate) fn limit_at_least(&self, limit: Duration) -> Option<Duration> {
        self.limit.map(|l| l.max(limit))
    }

    /// Resolves when nothing moved for `limit` (the limit in force now: [`Self::limit`] or
    /// a longer one), with how long nothing moved; never where there is no limit.
    pub(crate) async fn stalled(&self, limit: Option<Duration>) -> Duration {
        match limit {
            // A limit past the clock's range is no limit.
            Some(limit) => match self.moved.checked_add(limit) {
                Some(deadline) => {
                    tokio::time::sleep_until(deadline).await;
                    self.moved.elapsed()
                }
                None => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    }

    /// The stall limit.
    pub(crate) fn limit(&self) -> Option<Duration> {
        self.limit
    }

    /// The stream's next item, or `Err(how long nothing moved)` where none came before
    /// `limit` after the last move (an item that did not move anything does not put that
    /// off: call [`Watchdog::moved`] for one that did).
    #[cfg(test)]
    pub(crate) async fn next<S>(&self, stream: &mut S) -> Result<Option<S::Item>, Duration>
    where
        S: Stream + Unpin,
    {
        tokio::select! {
            item = stream.next() => Ok(item),
            stalled = self.stalled(self.limit) => Err(stalled),
        }
    }
}

/// How much the engine's data on disk must grow to count as an unpack's progress: other
/// writers on that file system (a running task's log, journald) move it by kilobytes, and
/// must not keep a hung unpack from ever stalling; an unpack writes megabytes a second.
pub const EXTRACTION_GROWTH_MIN: u64 = 8 << 20;

/// Watches the engine's data on disk while it unpacks in silence: [`DiskWatch::moved`] reads
/// the probe every [`EXTRACTION_POLL`] and tells whether the measure grew by
/// [`EXTRACTION_GROWTH_MIN`] since the last growth it counted (or since its lowest reading
/// after that: space freed meanwhile lowers the mark).
pub(crate) struct DiskWatch {
    probe: crate::DiskProbe,
    every: tokio::time::Interval,
    mark: Option<u64>,
}

impl DiskWatch {
    /// A watch over `probe`, if there is one, read every [`EXTRACTION_POLL`] or a quarter of
    /// the stall limit `limit`, whichever is shorter (so a moving disk is seen well before the
    /// limit).
    pub(crate) fn new(probe: Option<crate::DiskProbe>, limit: Option<Duration>) -> Option<Self> {
        let probe = probe?;
        let period = limit.map_or(EXTRACTION_POLL, |l| {
            (l / 4).clamp(Duration::from_millis(10), EXTRACTION_POLL)
        });
        let mut every = tokio::time::interval(period);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Some(Self {
            probe,
            every,
            mark: None,
        })
    }

    /// Waits for the next reading; whether the measure grew by [`EXTRACTION_GROWTH_MIN`] from
    /// the mark (the first reading only sets it).
    pub(crate) async fn moved(&mut self) -> bool {
        self.every.tick().await;
        let probe = self.probe.clone();
        let now = tokio::task::spawn_blocking(move || probe.read())
            .await
            .ok()
            .flatten();
        let Some(now) = now else {
            return false;
        };
        match self.mark {
            Some(mark) if now >= mark.saturating_add(EXTRACTION_GROWTH_MIN) => {
                self.mark = Some(now);
                true
            }
            Some(mark) if now >= mark => false,
            _ => {
                self.mark = Some(now);
                false
            }
        }
    }
}

/// The average rate, bytes per second, of `bytes` over `elapsed` (0 over no time).
pub(crate) fn rate(bytes: u64, elapsed: Duration) -> u64 {
    let millis = elapsed.as_millis();
    if millis == 0 {
        return 0;
    }
    u64::try_from(u128::from(bytes) * 1000 / millis).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;

    /// Items `gaps` apart (each the wait before it), then silence; an item is `(index,
    /// moved)`.
    fn ticking(gaps: Vec<(Duration, bool)>) -> impl Stream<Item = (usize, bool)> + Unpin {
        let items =
            stream::iter(gaps.into_iter().enumerate()).then(|(i, (gap, moved))| async move {
                tokio::time::sleep(gap).await;
                (i, moved)
            });
        Box::pin(items.chain(stream::pending()))
    }

    /// Drives `s` through `dog` to its first stall; the items seen, and the stall.
    async fn drive(
        dog: &mut Watchdog,
        s: &mut (impl Stream<Item = (usize, bool)> + Unpin),
    ) -> (usize, Duration) {
        let mut seen = 0;
        loop {
            match dog.next(s).await {
                Ok(Some((_, moved))) => {
                    seen += 1;
                    if moved {
                        dog.moved();
                    }
                }
                Ok(None) => panic!("the stream ended"),
                Err(stalled) => return (seen, stalled),
            }
        }
    }

    /// A slow stream whose every gap is under the limit runs far past it and is not stalled;
    /// the silence after it is, exactly `limit` after the last item.
    #[tokio::test(start_paused = true)]
    async fn a_slow_stream_runs_on_and_a_silent_one_stalls() {
        let limit = Duration::from_secs(300);
        let mut dog = Watchdog::new(Some(limit));
        let mut s = ticking(vec![(Duration::from_secs(299), true); 20]);
        let (seen, stalled) = drive(&mut dog, &mut s).await;
        assert_eq!((seen, stalled), (20, limit));
        assert_eq!(dog.elapsed(), Duration::from_secs(299 * 20 + 300));
    }

    /// Items that move nothing (Docker 28 repeating a layer's last line every 100 ms) do not
    /// put the stall off: it comes `limit` after the last item that moved.
    #[tokio::test(start_paused = true)]
    async fn repeated_lines_do_not_hide_a_stall() {
        let limit = Duration::from_secs(5);
        let mut dog = Watchdog::new(Some(limit));
        let mut gaps = vec![(Duration::from_secs(1), true); 3];
        gaps.extend(vec![(Duration::from_millis(300), false); 200]);
        let mut s = ticking(gaps);
        let (seen, stalled) = drive(&mut dog, &mut s).await;
        assert_eq!(stalled, limit);
        assert_eq!(seen, 3 + 16, "the repeats within the limit, 3.3 s to 7.8 s");
        assert_eq!(dog.elapsed(), Duration::from_secs(3 + 5));
    }

    /// A limit past the clock's range is no limit (the deadline's sum panicked the pull).
    #[tokio::test(start_paused = true)]
    async fn a_limit_past_the_clocks_range_never_fires() {
        let dog = Watchdog::new(Some(Duration::MAX));
        let year = Duration::from_secs(365 * 86_400);
        let fired = tokio::time::timeout(year, dog.stalled(Some(Duration::MAX))).await;
        assert!(fired.is_err(), "{fired:?}");
    }

    /// A gap longer than the limit is a stall even after many items.
    #[tokio::test(start_paused = true)]
    async fn one_long_gap_stalls() {
        let limit = Duration::from_secs(5);
        let mut dog = Watchdog::new(Some(limit));
        let mut s = ticking(vec![
            (Duration::from_secs(1), true),
            (Duration::from_secs(4), true),
            (Duration::from_secs(6), true),
        ]);
        assert_eq!(drive(&mut dog, &mut s).await, (2, limit));
        assert_eq!(dog.elapsed(), Duration::from_secs(10));
    }

    /// Without a limit, nothing stalls: an hour's silence is waited out.
    #[tokio::test(start_paused = true)]
    async fn no_limit_no_stall() {
        let dog = Watchdog::new(None);
        let mut s = ticking(vec![(Duration::from_secs(3600), false)]);
        assert_eq!(dog.next(&mut s).await, Ok(Some((0, false))));
        let mut empty = stream::empty::<()>();
        assert_eq!(dog.next(&mut empty).await, Ok(None));
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_waits_its_limit_or_forever() {
        let start = Instant::now();
        expiry(Some(Duration::from_secs(7200))).await;
        assert_eq!(start.elapsed(), Duration::from_secs(7200));
        let never = tokio::time::timeout(Duration::from_secs(86_400 * 365), expiry(None)).await;
        assert!(never.is_err());
    }

    /// A disk that moves is unpacking: the watch says so at each change, not when it stands
    /// still, and the first reading only sets the mark.
    #[tokio::test(start_paused = true)]
    async fn a_moving_disk_moves_and_a_still_one_does_not() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};
        let used = Arc::new(AtomicU64::new(100));
        let read = used.clone();
        let mut watch = DiskWatch::new(
            Some(crate::DiskProbe::new(move || {
                Some(read.load(Ordering::SeqCst))
            })),
            None,
        )
        .unwrap();
        assert!(!watch.moved().await, "the first reading sets the mark");
        assert!(!watch.moved().await);
        used.store(100 + EXTRACTION_GROWTH_MIN, Ordering::SeqCst);
        assert!(watch.moved().await);
        assert!(!watch.moved().await);
        // Another writer's kilobytes, however many readings they last, are not an unpack's
        // progress (a hung unpack must stall); they add up to it only once they reach the
        // floor.
        let base = used.load(Ordering::SeqCst);
        for step in 1..=100 {
            used.store(base + step * 4096, Ordering::SeqCst);
            assert!(!watch.moved().await, "{step}");
        }
        // Space freed lowers the mark; growth counts from there.
        used.store(50, Ordering::SeqCst);
        assert!(!watch.moved().await);
        used.store(50 + EXTRACTION_GROWTH_MIN, Ordering::SeqCst);
        assert!(watch.moved().await);
        assert!(DiskWatch::new(None, None).is_none());
    }

    /// The stall limit in force can be made longer, never shorter, and none stays none.
    #[test]
    fn a_longer_limit_for_the_silent_phase() {
        let dog = Watchdog::new(Some(Duration::from_secs(600)));
        assert_eq!(
            dog.limit_at_least(EXTRACTION_STALL_TIMEOUT),
            Some(EXTRACTION_STALL_TIMEOUT)
        );
        assert_eq!(
            dog.limit_at_least(Duration::from_secs(1)),
            Some(Duration::from_secs(600))
        );
        assert_eq!(
            Watchdog::new(None).limit_at_least(EXTRACTION_STALL_TIMEOUT),
            None
        );
    }

    #[test]
    fn rates() {
        assert_eq!(rate(9 << 20, Duration::from_secs(1)), 9 << 20);
        assert_eq!(rate(1000, Duration::from_millis(500)), 2000);
        assert_eq!(rate(1000, Duration::ZERO), 0);
    }
}
