//! One WARN per interval for events a peer can repeat at line rate (refused
//! connections, malformed messages); the rest go to DEBUG, and the next
//! WARN says how many there were, so a flood cannot fill the log.

use std::time::Duration;

use tokio::time::Instant;

/// How often a [`WarnGate`] lets a WARN through.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(1);

/// At most one WARN per [`WARN_EVERY`].
#[derive(Debug, Default)]
pub(crate) struct WarnGate {
    quiet_until: Option<Instant>,
    suppressed: u64,
}

impl WarnGate {
    /// `Some(events not logged at WARN since the last WARN)` when this one
    /// should be.
    pub(crate) fn admit(&mut self, now: Instant) -> Option<u64> {
        if self.quiet_until.is_some_and(|until| now < until) {
            self.suppressed += 1;
            return None;
        }
        self.quiet_until = Some(now + WARN_EVERY);
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flood logs one WARN per interval, and the next says how many went
    /// to DEBUG.
    #[test]
    fn a_flood_warns_once_per_interval_and_counts_the_rest() {
        let mut gate = WarnGate::default();
        let start = Instant::now();
        assert_eq!(gate.admit(start), Some(0));
        for _ in 0..5 {
            assert_eq!(gate.admit(start), None);
        }
        assert_eq!(gate.admit(start + WARN_EVERY / 2), None);
        assert_eq!(gate.admit(start + WARN_EVERY), Some(6));
        assert_eq!(gate.admit(start + WARN_EVERY * 3), Some(0));
    }
}
