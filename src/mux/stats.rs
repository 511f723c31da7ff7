//! Counters, shared by every task of one mux, and their snapshot; the
//! snapshot exports itself under stable `qpmux_*` names (docs/metrics.md).
//!
//! ```text
//!  peer tasks ─ Counters (atomics) ─ snapshot() ─► Stats ─ metrics() ─► [(qpmux_*, value)]
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (µs) of the reconnect-time histogram buckets; a last bucket
/// takes everything above the largest.
pub const RECONNECT_BUCKETS_US: [u64; 5] = [1_000, 10_000, 100_000, 1_000_000, 10_000_000];

/// Metric names of the histogram buckets (cumulative, Prometheus style).
const RECONNECT_BUCKET_NAMES: [&str; 6] = [
    "qpmux_reconnect_seconds_bucket{le=\"0.001\"}",
    "qpmux_reconnect_seconds_bucket{le=\"0.01\"}",
    "qpmux_reconnect_seconds_bucket{le=\"0.1\"}",
    "qpmux_reconnect_seconds_bucket{le=\"1\"}",
    "qpmux_reconnect_seconds_bucket{le=\"10\"}",
    "qpmux_reconnect_seconds_bucket{le=\"+Inf\"}",
];

/// Time from an epoch's death to the next epoch's start, over every peer
/// (a graceful end is not a death and starts no measurement).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconnectTimes {
    /// Deaths followed by a next epoch (each one measured).
    pub count: u64,
    /// The latest measurement, µs.
    pub last_us: u64,
    /// The largest, µs.
    pub max_us: u64,
    /// The sum of all, µs.
    pub total_us: u64,
    /// Measurements per bucket of [`RECONNECT_BUCKETS_US`] (not cumulative),
    /// the last one above every bound.
    pub buckets: [u64; 6],
}

/// Drops by reason (records or slots that did not reach a consumer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropCounts {
    /// Records for a slot index nobody opened.
    pub unknown_slot: u64,
    /// Records for a slot index at an older generation.
    pub stale_generation: u64,
    /// Records that arrived after the consumer went away.
    pub receiver_gone: u64,
    /// Message-class records with no handler installed.
    pub no_message_handler: u64,
}

/// A snapshot of a mux's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Batches posted.
    pub batches_sent: u64,
    /// Records posted (fragments count one each).
    pub records_sent: u64,
    /// Of `batches_sent`, those a producer wrote in its own turn while the
    /// peer task waited (a lone record: [`MuxConfig::inline_write_gap`](crate::mux::MuxConfig::inline_write_gap)).
    pub batches_inline: u64,
    /// Data bytes posted.
    pub data_bytes_sent: u64,
    /// Batches received.
    pub batches_received: u64,
    /// Records received.
    pub records_received: u64,
    /// Of `batches_received`, those the link's reader decoded in its own
    /// turn while the peer task waited ([`MuxConfig::inline_receive`](crate::mux::MuxConfig::inline_receive)).
    pub batches_received_inline: u64,
    /// Times a slot had data ready but no slot credit.
    pub credit_stalls: u64,
    /// CreditUpdate records sent.
    pub credit_updates_sent: u64,
    /// Times a slot had a record ready and slot credit, but the peer's
    /// credit (its `peer_window` less what it still holds of ours) was short.
    pub peer_credit_stalls: u64,
    /// PeerCredit records sent.
    pub peer_credit_updates_sent: u64,
    /// Bytes producers have queued that are not yet on the wire, each
    /// record counted with its [`RECORD_OVERHEAD`](crate::mux::RECORD_OVERHEAD)
    /// as the budgets count it (gauge).
    pub withheld_bytes: u64,
    /// Peers' data counted here against their peer windows (bytes, each
    /// record with its overhead): received and not yet given back as peer
    /// credit, in any epoch (gauge).
    pub peer_held_bytes: u64,
    /// Epochs that ended.
    pub epoch_deaths: u64,
    /// Slots that ended with `Dropped` because an epoch died (both directions)
    /// or, still waiting for a link, because their peer was unregistered.
    pub slots_dropped: u64,
    /// Egress slots whose Open never left a dying epoch, handed to the next
    /// one instead of dropped (each time it happens).
    pub slots_carried: u64,
    /// Protocol violations by peers (each also ends an epoch).
    pub protocol_violations: u64,
    /// Outbound messages larger than the peer's `max_record`, reported to
    /// their senders instead of written (the peer would end the epoch).
    pub messages_too_large: u64,
    /// Panics caught in a peer task (a bug here, or in the message sink it
    /// called); each ended its epoch ([`crate::link::EpochEnd::Internal`]),
    /// or, outside an epoch, restarted the task.
    pub peer_task_panics: u64,
    /// Links a peer replaced before they were served, dropped unread
    /// because more than four were waiting to be read out: what the peer
    /// had sent on them is lost.
    pub links_unread: u64,
    /// OpenSlot records refused: the peer's slot limit was reached, or the
    /// stream is already fed, ended, or the node's registry is full.
    pub opens_refused: u64,
    /// Closes a peer was owed and not kept, past what is kept for it (it
    /// let us write nothing while it kept naming unknown slots, or opening
    /// streams our consumers dropped): each record, heartbeat or dropped
    /// consumer that would have owed one counts.
    pub closes_untold: u64,
    /// Bindings given up before any peer fed them
    /// ([`SlotReceiver::abandon`](crate::mux::SlotReceiver::abandon)): a
    /// late OpenSlot for one of their keys is refused.
    pub bindings_abandoned: u64,
    /// Records dropped, by reason.
    pub drops: DropCounts,
    /// Time from each epoch death to the next epoch with that peer.
    pub reconnect: ReconnectTimes,
}

impl Stats {
    /// Mean records per batch sent.
    pub fn records_per_batch(&self) -> f64 {
        if self.batches_sent == 0 {
            0.0
        } else {
            self.records_sent as f64 / self.batches_sent as f64
        }
    }

    /// Every counter under its stable `qpmux_*` name (docs/metrics.md):
    /// `_total` names are monotonic counters, the rest gauges; the reconnect
    /// histogram is cumulative, as Prometheus exposes one.
    pub fn metrics(&self) -> Vec<(&'static str, u64)> {
        let mut out = vec![
            ("qpmux_batches_sent_total", self.batches_sent),
            ("qpmux_records_sent_total", self.records_sent),
            ("qpmux_batches_inline_total", self.batches_inline),
            ("qpmux_data_bytes_sent_total", self.data_bytes_sent),
            ("qpmux_batches_received_total", self.batches_received),
            ("qpmux_records_received_total", self.records_received),
            (
                "qpmux_batches_received_inline_total",
                self.batches_received_inline,
            ),
            ("qpmux_credit_stalls_total", self.credit_stalls),
            ("qpmux_credit_updates_sent_total", self.credit_updates_sent),
            ("qpmux_peer_credit_stalls_total", self.peer_credit_stalls),
            (
                "qpmux_peer_credit_updates_sent_total",
                self.peer_credit_updates_sent,
            ),
            ("qpmux_withheld_bytes", self.withheld_bytes),
            ("qpmux_peer_held_bytes", self.peer_held_bytes),
            ("qpmux_epoch_deaths_total", self.epoch_deaths),
            ("qpmux_slots_dropped_total", self.slots_dropped),
            ("qpmux_slots_carried_total", self.slots_carried),
            ("qpmux_protocol_violations_total", self.protocol_violations),
            ("qpmux_messages_too_large_total", self.messages_too_large),
            ("qpmux_peer_task_panics_total", self.peer_task_panics),
            ("qpmux_links_unread_total", self.links_unread),
            ("qpmux_opens_refused_total", self.opens_refused),
            ("qpmux_closes_untold_total", self.closes_untold),
            ("qpmux_bindings_abandoned_total", self.bindings_abandoned),
            ("qpmux_drops_unknown_slot_total", self.drops.unknown_slot),
            (
                "qpmux_drops_stale_generation_total",
                self.drops.stale_generation,
            ),
            ("qpmux_drops_receiver_gone_total", self.drops.receiver_gone),
            (
                "qpmux_drops_no_message_handler_total",
                self.drops.no_message_handler,
            ),
            ("qpmux_reconnects_total", self.reconnect.count),
            ("qpmux_reconnect_last_microseconds", self.reconnect.last_us),
            ("qpmux_reconnect_max_microseconds", self.reconnect.max_us),
            ("qpmux_reconnect_seconds_count", self.reconnect.count),
            ("qpmux_reconnect_microseconds_sum", self.reconnect.total_us),
        ];
        let mut cumulative = 0;
        for (name, n) in RECONNECT_BUCKET_NAMES.iter().zip(self.reconnect.buckets) {
            cumulative += n;
            out.push((name, cumulative));
        }
        out
    }
}

/// A value alone on its cache lines (two: x86's adjacent-line prefetch
/// pairs them), for an atomic that producers write per record while other
/// threads write its neighbours.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub batches_sent: AtomicU64,
    pub records_sent: AtomicU64,
    pub batches_inline: AtomicU64,
    pub data_bytes_sent: AtomicU64,
    pub batches_received: AtomicU64,
    pub records_received: AtomicU64,
    pub batches_received_inline: AtomicU64,
    pub credit_stalls: AtomicU64,
    pub credit_updates_sent: AtomicU64,
    pub peer_credit_stalls: AtomicU64,
    pub peer_credit_updates_sent: AtomicU64,
    /// Written by every producer per record: kept off the lines the peer
    /// tasks write.
    pub withheld_bytes: Padded<AtomicU64>,
    pub peer_held_bytes: AtomicU64,
    pub epoch_deaths: AtomicU64,
    pub slots_dropped: AtomicU64,
    pub slots_carried: AtomicU64,
    pub protocol_violations: AtomicU64,
    pub messages_too_large: AtomicU64,
    pub peer_task_panics: AtomicU64,
    pub links_unread: AtomicU64,
    pub opens_refused: AtomicU64,
    pub closes_untold: AtomicU64,
    pub unknown_slot: AtomicU64,
    pub stale_generation: AtomicU64,
    pub receiver_gone: AtomicU64,
    pub no_message_handler: AtomicU64,
    pub reconnects: AtomicU64,
    pub reconnect_last_us: AtomicU64,
    pub reconnect_max_us: AtomicU64,
    pub reconnect_total_us: AtomicU64,
    pub reconnect_buckets: [AtomicU64; 6],
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// One epoch death to next epoch start.
    pub fn record_reconnect(&self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = RECONNECT_BUCKETS_US
            .iter()
            .position(|&bound| us <= bound)
            .unwrap_or(RECONNECT_BUCKETS_US.len());
        Counters::add(&self.reconnect_buckets[bucket], 1);
        Counters::add(&self.reconnect_total_us, us);
        self.reconnect_last_us.store(us, Ordering::Relaxed);
        self.reconnect_max_us.fetch_max(us, Ordering::Relaxed);
        Counters::add(&self.reconnects, 1);
    }

    pub fn snapshot(&self) -> Stats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            batches_sent: get(&self.batches_sent),
            records_sent: get(&self.records_sent),
            batches_inline: get(&self.batches_inline),
            data_bytes_sent: get(&self.data_bytes_sent),
            batches_received: get(&self.batches_received),
            records_received: get(&self.records_received),
            batches_received_inline: get(&self.batches_received_inline),
            credit_stalls: get(&self.credit_stalls),
            credit_updates_sent: get(&self.credit_updates_sent),
            peer_credit_stalls: get(&self.peer_credit_stalls),
            peer_credit_updates_sent: get(&self.peer_credit_updates_sent),
            withheld_bytes: get(&self.withheld_bytes),
            peer_held_bytes: get(&self.peer_held_bytes),
            epoch_deaths: get(&self.epoch_deaths),
            slots_dropped: get(&self.slots_dropped),
            slots_carried: get(&self.slots_carried),
            protocol_violations: get(&self.protocol_violations),
            messages_too_large: get(&self.messages_too_large),
            peer_task_panics: get(&self.peer_task_panics),
            links_unread: get(&self.links_unread),
            opens_refused: get(&self.opens_refused),
            closes_untold: get(&self.closes_untold),
            // The registry's own count, filled in by `Mux::stats`.
            bindings_abandoned: 0,
            drops: DropCounts {
                unknown_slot: get(&self.unknown_slot),
                stale_generation: get(&self.stale_generation),
                receiver_gone: get(&self.receiver_gone),
                no_message_handler: get(&self.no_message_handler),
            },
            reconnect: ReconnectTimes {
                count: get(&self.reconnects),
                last_us: get(&self.reconnect_last_us),
                max_us: get(&self.reconnect_max_us),
                total_us: get(&self.reconnect_total_us),
                buckets: self.reconnect_buckets.each_ref().map(get),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_times_land_in_last_max_sum_and_one_bucket() {
        let counters = Counters::default();
        counters.record_reconnect(Duration::from_micros(500));
        counters.record_reconnect(Duration::from_millis(50));
        counters.record_reconnect(Duration::from_secs(60));
        counters.record_reconnect(Duration::from_millis(2));
        let r = counters.snapshot().reconnect;
        assert_eq!(r.count, 4);
        assert_eq!(r.last_us, 2_000);
        assert_eq!(r.max_us, 60_000_000);
        assert_eq!(r.total_us, 500 + 50_000 + 60_000_000 + 2_000);
        assert_eq!(r.buckets, [1, 1, 1, 0, 0, 1]);
    }

    #[test]
    fn metric_names_are_unique_prefixed_and_the_histogram_is_cumulative() {
        let counters = Counters::default();
        Counters::add(&counters.slots_dropped, 7);
        counters.record_reconnect(Duration::from_micros(500));
        counters.record_reconnect(Duration::from_millis(50));
        let metrics = counters.snapshot().metrics();
        let mut names: Vec<_> = metrics.iter().map(|(n, _)| *n).collect();
        assert!(names.iter().all(|n| n.starts_with("qpmux_")), "{names:?}");
        let total = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), total, "no name twice");
        let value = |name: &str| metrics.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        assert_eq!(value("qpmux_slots_dropped_total"), Some(7));
        assert_eq!(value("qpmux_reconnects_total"), Some(2));
        assert_eq!(
            value("qpmux_reconnect_seconds_bucket{le=\"0.001\"}"),
            Some(1)
        );
        assert_eq!(
            value("qpmux_reconnect_seconds_bucket{le=\"0.01\"}"),
            Some(1)
        );
        assert_eq!(value("qpmux_reconnect_seconds_bucket{le=\"0.1\"}"), Some(2));
        assert_eq!(
            value("qpmux_reconnect_seconds_bucket{le=\"+Inf\"}"),
            Some(2)
        );
    }
}
