//! Where one record's time goes: timestamps at fixed points of its path,
//! taken only while a measurement has turned them on.
//!
//! ```text
//!  producer ── Stamped ──► sender's peer task: Woken ─► Encoded ─► post ─► Posted
//!     ── wire ──► receiving link or provider: Received ─► receiver's peer task (or reader): Decoding
//!     ──► consumer (the harness reads every stage's offset from Stamped)
//! ```
//!
//! One process-wide slot per stage, last writer wins, so a reading means
//! something only while one record is in flight at a time (the sweep's
//! `latency-1ms` cell: one record per millisecond, delivered in tens of
//! microseconds). Off, a mark costs one relaxed load.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A point on a record's path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The producer took the record's timestamp and is about to send it.
    Stamped = 0,
    /// The sender's peer task was woken for queued records.
    Woken,
    /// The batch is encoded and about to be posted.
    Encoded,
    /// `post` returned: the batch is on the wire or queued for it.
    Posted,
    /// The receiver took the batch off the wire (`recvmmsg` on the soft
    /// provider, a whole frame read on the TCP link).
    Received,
    /// The receiver's peer task, or its link's reader in the task's place,
    /// is about to decode the batch.
    Decoding,
}

/// Stages, [`Stage::Stamped`] included.
pub const STAGES: usize = 6;

static ON: AtomicBool = AtomicBool::new(false);
static AT: [AtomicU64; STAGES] = [const { AtomicU64::new(0) }; STAGES];
static ORIGIN: OnceLock<Instant> = OnceLock::new();

/// Turn marking on or off for the whole process.
pub fn set_enabled(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Whether marks are being taken.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

fn now_ns() -> u64 {
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Record that the record in flight reached `stage` now.
#[inline]
pub fn mark(stage: Stage) {
    if enabled() {
        AT[stage as usize].store(now_ns(), Ordering::Relaxed);
    }
}

/// At delivery: each later stage's offset from [`Stage::Stamped`] in
/// nanoseconds (`None` where the stage was not reached after the stamp,
/// e.g. a path without that point), then the delivery's own offset.
pub fn offsets_at_delivery() -> [Option<u64>; STAGES] {
    let now = now_ns();
    offsets(std::array::from_fn(|i| AT[i].load(Ordering::Relaxed)), now)
}

fn offsets(at: [u64; STAGES], now: u64) -> [Option<u64>; STAGES] {
    let stamped = at[Stage::Stamped as usize];
    std::array::from_fn(|i| {
        let t = if i + 1 == STAGES { now } else { at[i + 1] };
        t.checked_sub(stamped)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_count_only_stages_reached_after_the_stamp() {
        // Woken is a previous record's mark; Received never happened.
        let at = [1_000, 400, 1_300, 1_700, 0, 2_900];
        assert_eq!(
            offsets(at, 3_500),
            [None, Some(300), Some(700), None, Some(1_900), Some(2_500)]
        );
    }
}
