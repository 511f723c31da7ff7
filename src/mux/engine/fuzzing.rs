//! One peer's mux core without a link or a task, for the fuzz targets
//! (`fuzz/`) and their regression tests: the caller hands in batches and
//! time and reads batches out. Not a stable API.
//!
//! ```text
//!  caller ─ handle_batch(bytes, now) ─► PeerCore ─► registry ─► SlotReceiver (bind)
//!  caller ─ handle_timeout(now) / handle_control(now)
//!  caller ◄ poll_batch(buf, now) ◄──────
//! ```

use std::sync::Arc;

use tokio::time::Instant;

use super::ProtocolError;
use super::core::PeerCore;
use super::held::Held;
use crate::mux::config::MuxConfig;
use crate::mux::protocol::Epoch;
use crate::mux::slot::{PeerControl, Registry, SlotReceiver};
use crate::mux::stats::Counters;
use crate::mux::surface::{DropReason, MuxError, PeerId, StreamKey};

/// A `PeerCore` with its own slot registry.
pub struct PeerHarness {
    core: PeerCore,
    registry: Arc<Registry>,
    config: Arc<MuxConfig>,
    control: Arc<PeerControl>,
}

impl PeerHarness {
    /// A core for `epoch`; its registry holds at most `max_streams` keys.
    pub fn new(config: MuxConfig, epoch: Epoch, max_streams: usize, now: Instant) -> PeerHarness {
        let config = Arc::new(config);
        let registry = Registry::new(
            config.slot_window,
            max_streams,
            config.max_unbound_per_peer as usize,
        );
        let counters = Arc::new(Counters::default());
        let control = Arc::new(PeerControl::new(PeerId(1), config.peer_budget, counters));
        let core = PeerCore::new(
            epoch,
            config.clone(),
            control.clone(),
            registry.clone(),
            Held::default(),
            now,
        );
        PeerHarness {
            core,
            registry,
            config,
            control,
        }
    }

    /// Ends this epoch (every live slot `Dropped`) and starts `epoch` for
    /// the same peer, as a reconnect does: what closed streams still hold of
    /// the peer's data carries over, and receivers stay bound.
    pub fn next_epoch(&mut self, epoch: Epoch, now: Instant) {
        self.core.fail_all(DropReason::EpochEnded {
            epoch: self.core.epoch(),
        });
        self.core = PeerCore::new(
            epoch,
            self.config.clone(),
            self.control.clone(),
            self.registry.clone(),
            self.core.take_held(),
            now,
        );
    }

    /// Binds a consumer to `key` (before or after the peer opens it).
    pub fn bind(&self, key: StreamKey) -> Result<SlotReceiver, MuxError> {
        self.registry.bind(key)
    }

    /// A received batch; an error is the peer's protocol violation.
    pub fn handle_batch(&mut self, bytes: &[u8], now: Instant) -> Result<(), ProtocolError> {
        self.core.handle_batch(bytes, now)
    }

    /// Picks up what consumers left (credit to return, closes).
    pub fn handle_control(&mut self, now: Instant) {
        self.core.handle_control(now);
    }

    /// Fires the timers due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.core.handle_timeout(now);
    }

    /// The next deadline, as of `now`.
    pub fn poll_timeout(&self, now: Instant) -> Instant {
        self.core.poll_timeout(now)
    }

    /// The next batch to send, written into `buf`; 0 when nothing is owed.
    pub fn poll_batch(&mut self, buf: &mut [u8], now: Instant) -> usize {
        self.core.poll_batch(buf, now)
    }

    /// Live slots in both directions.
    pub fn live_slots(&self) -> usize {
        self.core.live_slots()
    }

    /// The peer's data bytes this node counts as held (not yet returned as
    /// peer credit), in this epoch and earlier ones: never above
    /// `MuxConfig::peer_window`.
    pub fn peer_outstanding(&self) -> u64 {
        self.core.peer_outstanding()
    }

    /// True once the peer said goodbye.
    pub fn goodbye_received(&self) -> bool {
        self.core.goodbye_received()
    }

    /// Ends the epoch for every live slot.
    pub fn fail_all(&mut self, reason: DropReason) {
        self.core.fail_all(reason);
    }
}
