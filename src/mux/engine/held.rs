//! The peer's data that closed receive slots still hold, counted against its
//! peer window until their consumers take it: within an epoch, and across
//! epochs, since a new link must not bring a fresh window while the old
//! one's bytes sit unread (docs/design.md § "Peer credit bounds what a peer
//! can make us hold").
//!
//! ```text
//!  PeerCore (epoch n) ─ close / fail_all ─► Held ─► PeerCore (epoch n+1)
//!                          bytes published ──┤     hello's peer credit = window − bytes
//!            consumer takes ─ dirty rx ──────┘ (also while no link: wait_for_link)
//! ```
//!
//! Owner: the peer task, handed from each epoch's core to the next.

use std::collections::HashMap;
use std::sync::Arc;

use crate::mux::slot::{RxSlot, RxVisit};

/// Closed receive slots and the peer's bytes each still holds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Held {
    /// By receiver: the slot and the bytes it still counts as held.
    slots: HashMap<usize, (Arc<RxSlot>, u64)>,
    bytes: u64,
}

impl Held {
    /// Bytes all the slots hold together.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Starts counting `bytes` of a closed slot (none: nothing to count).
    pub fn insert(&mut self, rx: Arc<RxSlot>, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let previous = self.slots.insert(Self::key(&rx), (rx, bytes));
        debug_assert!(previous.is_none(), "a slot closes once");
        self.bytes += bytes;
    }

    /// Applies what a consumer did to a held slot; returns the bytes it let
    /// go of (taken, or dropped with the receiver). Unknown slots free nothing.
    pub fn visit(&mut self, key: usize, visit: RxVisit) -> u64 {
        let Some((_, held)) = self.slots.get_mut(&key) else {
            return 0;
        };
        let taken = visit.drained.min(*held);
        *held -= taken;
        let freed = if visit.finished || visit.receiver_gone || *held == 0 {
            let left = *held;
            self.slots.remove(&key);
            taken + left
        } else {
            taken
        };
        self.bytes -= freed;
        freed
    }

    /// Visits every held slot (drains below a slot's grant threshold mark
    /// nothing dirty); returns the bytes let go of.
    pub fn settle(&mut self) -> u64 {
        let slots: Vec<Arc<RxSlot>> = self.slots.values().map(|(rx, _)| rx.clone()).collect();
        slots
            .iter()
            .map(|rx| self.visit(Self::key(rx), rx.visit()))
            .sum()
    }

    /// The held slots, for a sweep.
    pub fn receivers(&self) -> impl Iterator<Item = &Arc<RxSlot>> {
        self.slots.values().map(|(rx, _)| rx)
    }

    /// An `RxSlot`'s key here (and in the core's `by_rx`): its address.
    pub fn key(rx: &Arc<RxSlot>) -> usize {
        Arc::as_ptr(rx) as usize
    }
}
