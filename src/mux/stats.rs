//! Counters, shared by every task of one mux, and their snapshot.

use std::sync::atomic::{AtomicU64, Ordering};

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
    /// Data bytes posted.
    pub data_bytes_sent: u64,
    /// Batches received.
    pub batches_received: u64,
    /// Records received.
    pub records_received: u64,
    /// Times a slot had data ready but no slot credit.
    pub credit_stalls: u64,
    /// CreditUpdate records sent.
    pub credit_updates_sent: u64,
    /// Bytes producers have queued that are not yet on the wire (gauge).
    pub withheld_bytes: u64,
    /// Epochs that ended.
    pub epoch_deaths: u64,
    /// Slots that ended with `Dropped` because an epoch died (both directions).
    pub slots_dropped: u64,
    /// Protocol violations by peers (each also ends an epoch).
    pub protocol_violations: u64,
    /// OpenSlot records refused: the peer's slot limit was reached, or the
    /// stream is already fed, ended, or the node's registry is full.
    pub opens_refused: u64,
    /// Records dropped, by reason.
    pub drops: DropCounts,
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
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub batches_sent: AtomicU64,
    pub records_sent: AtomicU64,
    pub data_bytes_sent: AtomicU64,
    pub batches_received: AtomicU64,
    pub records_received: AtomicU64,
    pub credit_stalls: AtomicU64,
    pub credit_updates_sent: AtomicU64,
    pub withheld_bytes: AtomicU64,
    pub epoch_deaths: AtomicU64,
    pub slots_dropped: AtomicU64,
    pub protocol_violations: AtomicU64,
    pub opens_refused: AtomicU64,
    pub unknown_slot: AtomicU64,
    pub stale_generation: AtomicU64,
    pub receiver_gone: AtomicU64,
    pub no_message_handler: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Stats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            batches_sent: get(&self.batches_sent),
            records_sent: get(&self.records_sent),
            data_bytes_sent: get(&self.data_bytes_sent),
            batches_received: get(&self.batches_received),
            records_received: get(&self.records_received),
            credit_stalls: get(&self.credit_stalls),
            credit_updates_sent: get(&self.credit_updates_sent),
            withheld_bytes: get(&self.withheld_bytes),
            epoch_deaths: get(&self.epoch_deaths),
            slots_dropped: get(&self.slots_dropped),
            protocol_violations: get(&self.protocol_violations),
            opens_refused: get(&self.opens_refused),
            drops: DropCounts {
                unknown_slot: get(&self.unknown_slot),
                stale_generation: get(&self.stale_generation),
                receiver_gone: get(&self.receiver_gone),
                no_message_handler: get(&self.no_message_handler),
            },
        }
    }
}
