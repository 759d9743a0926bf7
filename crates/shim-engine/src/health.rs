//! Readiness: whether the engine keeps up with the container runtime, with the one rule and
//! the reasons spelled out ([`crate::Engine::health`]).

use std::time::Duration;

/// What [`crate::Engine::health`] reports: the engine's readiness, independent of whether the
/// process answers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineHealth {
    /// Docker's event stream is connected (exits are seen as they happen).
    pub events_connected: bool,
    /// How long ago the last successful full container list was (`None`: none yet).
    pub last_cycle_age: Option<Duration>,
    /// The period of the full list ([`crate::EngineConfig::reconcile_interval`]).
    pub backstop: Duration,
}

impl EngineHealth {
    /// The health of an engine whose stream is connected or not, whose last full list was
    /// `last_cycle_age` ago, and whose backstop period is `backstop`.
    pub fn new(
        events_connected: bool,
        last_cycle_age: Option<Duration>,
        backstop: Duration,
    ) -> Self {
        Self {
            events_connected,
            last_cycle_age,
            backstop,
        }
    }

    /// The oldest the last full list may be while the engine is ready: two backstop periods
    /// (one list may fail; the next must succeed).
    pub fn max_cycle_age(&self) -> Duration {
        self.backstop.saturating_mul(2)
    }

    /// Ready: the event stream is connected and a full list succeeded within
    /// [`EngineHealth::max_cycle_age`]. An engine that is not ready answers from what it knew
    /// last; exits it has not seen yet are seen once Docker answers again.
    pub fn is_ready(&self) -> bool {
        self.reasons().is_empty()
    }

    /// Why the engine is not ready, as sentences (empty when it is ready).
    pub fn reasons(&self) -> Vec<String> {
        let mut reasons = Vec::new();
        if !self.events_connected {
            reasons.push("Docker's event stream is disconnected".to_owned());
        }
        let max_age = self.max_cycle_age();
        match self.last_cycle_age {
            None => reasons.push("no full container list has succeeded yet".to_owned()),
            Some(age) if age > max_age => reasons.push(format!(
                "the last successful full container list was {:.1}s ago (more than {:.1}s)",
                age.as_secs_f64(),
                max_age.as_secs_f64()
            )),
            Some(_) => {}
        }
        reasons
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(events: bool, age_s: Option<u64>) -> EngineHealth {
        EngineHealth::new(
            events,
            age_s.map(Duration::from_secs),
            Duration::from_secs(300),
        )
    }

    #[test]
    fn one_rule_with_its_reasons() {
        let ok = health(true, Some(1));
        assert!(ok.is_ready());
        assert!(ok.reasons().is_empty());
        assert_eq!(ok.max_cycle_age(), Duration::from_secs(600));

        let r = health(false, None);
        assert!(!r.is_ready());
        assert_eq!(
            r.reasons(),
            [
                "Docker's event stream is disconnected",
                "no full container list has succeeded yet"
            ]
        );

        let r = health(true, Some(601));
        assert!(!r.is_ready());
        assert_eq!(
            r.reasons(),
            ["the last successful full container list was 601.0s ago (more than 600.0s)"]
        );
        // At the limit it is still ready.
        assert!(health(true, Some(600)).is_ready());
    }
}
