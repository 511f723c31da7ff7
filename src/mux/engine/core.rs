//! One peer's mux state for one epoch, without I/O: batches and control in,
//! batches out. The peer task (`mod.rs`) adds the link and the clock.
//!
//! ```text
//!  handle_control ◄─ dirty inlets / dirty rx slots / flush kicks (PeerControl)
//!  handle_batch   ◄─ a received batch: deliver, grant, close, or a ProtocolError
//!  poll_batch     ─► control owed (pong, closes, grants, opens), then messages and
//!                     slot data (round-robin), taking turns to go first
//!  handle_timeout ◄─ credit sweep, heartbeats;  poll_timeout ─► next deadline
//!  credit: a record starts on slot credit > 0 and peer credit ≥ its cost
//!          (length + RECORD_OVERHEAD); what comes in counts the same against
//!          our windows until consumed
//! ```
//!
//! Owner: the peer task. Nothing here survives the epoch: the next one builds
//! a new `PeerCore` (docs/design.md § "A Link is one epoch").

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use tokio::time::Instant;

use super::ProtocolError;
use super::held::Held;
use crate::mux::config::{FlushPolicy, MuxConfig, PeerTerms};
use crate::mux::message::{MessageSink, OutboundMessage};
use crate::mux::protocol::{
    BatchEncoder, BatchView, CloseReason, Epoch, FrameSeq, Lane, Record, RecordBody, SlotId,
};
use crate::mux::slot::{
    Inlet, InletStatus, OpenOutcome, PeerControl, Pop, Pushed, RECORD_OVERHEAD, ReceiverWakes,
    Registry, RxSlot, RxVisit, SendError, fragment_cost, record_cost,
};
use crate::mux::stats::Counters;
use crate::mux::surface::{DropReason, Frame, StreamKey};

/// Smallest first fragment worth starting at the end of a batch (a batch
/// with no record yet starts any: a smaller one would never go).
const MIN_FRAGMENT: usize = 256;
/// Free slot indices held back from reuse: a freed index comes back only
/// after this many others were freed, so its (index, generation) returns
/// after 256 × this many slots, not 256 (a late close or grant for an
/// earlier use could otherwise land on a live slot: docs/design.md
/// § "Slot ids come back late").
const REUSE_AFTER: usize = 64;
/// Outbound messages the core pulls ahead of writing them.
const MESSAGES_HELD: usize = 64;

/// The maps a record looks its slot up in (twice per data record). foldhash
/// is seeded per map, so a peer choosing slot indices cannot aim collisions
/// without first learning the seed, and costs far less than SipHash
/// (docs/benchmarks.md § "The decode's allocations and hashing").
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

#[derive(Debug)]
struct EgressSlot {
    inlet: Arc<Inlet>,
    id: SlotId,
    credit: i64,
    seq: FrameSeq,
    /// The Open is encoded (in a batch being posted, or posted).
    open_sent: bool,
    /// The Open's batch was posted: from now on an epoch death drops the slot.
    open_left: bool,
    /// While the batch being posted holds the Open: what of the slot it holds.
    unposted: Option<Unposted>,
    /// The unsent rest of the current record.
    partial: Option<Bytes>,
    /// Whether the current record's first fragment is out (credit was spent).
    partial_started: bool,
    /// A popped terminal waiting for room in a batch.
    terminal: Option<CloseReason>,
    in_ready: bool,
    /// On `peer_blocked`: its next record waits for peer credit.
    awaiting_peer_credit: bool,
    heartbeat_owed: bool,
    sent_since_tick: bool,
    /// Under a manual flush: a flush found this slot out of credit, so the
    /// grant that unblocks it carries the flush on, for this slot only,
    /// until its queue is empty.
    flush_owed: bool,
}

/// The records and terminal a slot put into the batch that also carries its
/// Open. A failed post gives them back to the inlet, so the slot can move to
/// the next epoch whole (docs/design.md § "A slot whose Open never left").
#[derive(Debug, Default)]
struct Unposted {
    records: Vec<Bytes>,
    terminal: Option<CloseReason>,
}

#[derive(Debug)]
struct IngressSlot {
    id: SlotId,
    rx: Arc<RxSlot>,
    expected: FrameSeq,
    /// Bytes received and not yet granted back.
    outstanding: u64,
    /// A record's fragments so far ([`append_fragment`]).
    reassembly: Option<Vec<u8>>,
}

/// The slot table's per-index entry: the generation outlives the slot.
#[derive(Debug, Default)]
struct IndexEntry {
    generation: u8,
    slot: Option<EgressSlot>,
}

/// What filling one slot into the batch ended with.
enum Fill {
    /// The batch is full; the slot still has work.
    Full,
    /// The slot has records but no credit.
    Blocked,
    /// Nothing left to send for now.
    Idle,
    /// The terminal went out; the slot is gone.
    Closed,
}

/// The mux's message sink, set once, possibly after epochs have started.
pub(crate) type SinkSlot = Arc<OnceLock<Arc<dyn MessageSink>>>;

pub(crate) struct PeerCore {
    epoch: Epoch,
    config: Arc<MuxConfig>,
    control: Arc<PeerControl>,
    registry: Arc<Registry>,
    counters: Arc<Counters>,

    table: Vec<IndexEntry>,
    /// Freed indices, oldest first; reused only once [`REUSE_AFTER`] wait.
    free: VecDeque<u32>,
    by_inlet: FastMap<usize, u32>,
    live_egress: usize,
    ready: VecDeque<u32>,
    opens_owed: VecDeque<u32>,
    /// Slots whose Open is in the batch being posted.
    opened_in_batch: Vec<u32>,
    /// Of those, the ones whose terminal is in it too: freed once it is posted.
    closed_in_batch: Vec<u32>,

    /// Peer credit: what all our slots together may still start toward the
    /// peer (its peer window less what it holds of ours). A record takes its
    /// whole cost when it starts.
    peer_credit: i64,
    /// The peer's window, from its handshake (else ours).
    egress_peer_window: u32,
    /// The largest record or message the peer takes, from its handshake
    /// (else ours).
    egress_max_record: usize,
    /// Live slots both ways this epoch may hold: the smaller of our
    /// `max_slots_per_peer` and the peer's, from its handshake (else ours).
    slot_limit: u32,
    /// Slots whose next record waits for peer credit, in the order they met it.
    peer_blocked: Vec<u32>,

    ingress: FastMap<u32, IngressSlot>,
    by_rx: FastMap<usize, u32>,
    /// Closed ingress slots whose consumer has not yet taken all they hold,
    /// this epoch's and earlier ones'.
    held: Held,
    /// The peer's data bytes held here, in any epoch, not yet let go of.
    peer_outstanding: u64,
    /// Peer credit granted in this epoch (written or owed) that the peer has
    /// not yet used: what it may still send. `peer_outstanding` plus this
    /// never exceeds our peer window.
    peer_unspent: u64,
    /// Peer credit to grant in the next batch.
    peer_grant_owed: u64,
    /// No peer credit granted in a batch yet this epoch: the peer may be
    /// waiting on it (its hello can have said 0), so no flush policy holds
    /// the first grant back.
    opening_grant_owed: bool,
    grants_owed: BTreeMap<u32, (SlotId, u64)>,
    /// Keyed by the whole id, generation too: a stale generation's reply
    /// must not replace the live one's close at the same index.
    closes_owed: BTreeMap<SlotId, CloseReason>,
    pong_owed: Option<u64>,
    ping_owed: Option<u64>,
    /// The highest nonce this epoch wrote in a Ping: a Pong may answer no
    /// other (0: none written).
    ping_written: u64,

    messages_out: VecDeque<OutboundMessage>,
    /// The unsent rest of the message being written, and its sender's hook.
    message_partial: Option<(Bytes, OutboundMessage)>,
    /// Messages whose last fragment is in the batch being posted: still armed
    /// until the post succeeds, so a failed post reports them.
    messages_in_batch: Vec<OutboundMessage>,
    message_seq_out: FrameSeq,
    /// Messages and slot data take turns to go first in a batch while both
    /// wait, so a steady flow of either cannot hold the other back.
    data_goes_first: bool,
    message_seq_in: FrameSeq,
    /// A message fragment was written or taken in this epoch.
    carried_messages: bool,
    message_reassembly: Option<Vec<u8>>,
    /// Where inbound messages go: the mux's slot, read at each message, so
    /// a sink installed while this epoch runs gets the rest of it.
    sink: SinkSlot,

    batch_seq_out: u32,
    batch_seq_in: u32,
    /// Record bytes popped from inlets in this `poll_batch`, handed back to
    /// the peer budget once at its end: one write per batch to the counter
    /// every producer writes per record.
    popped_bytes: usize,
    /// Data bytes encoded in this `poll_batch`, counted once at its end.
    encoded_bytes: u64,
    goodbye_received: bool,
    /// A consumer got a frame or message since [`PeerCore::take_handed_over`].
    handed_over: bool,
    /// Receivers this batch's records found waiting, woken once it is
    /// decoded (at most one entry per slot: a woken receiver is no longer
    /// waiting).
    wake_after_batch: ReceiverWakes,
    /// Bytes each egress slot may have outstanding: the peer's slot window
    /// when its handshake said, else ours.
    egress_window: u32,
    flush_requested: bool,
    /// Under a manual flush: a slot that owes the rest of a flush got
    /// credit and is ready (see `EgressSlot::flush_owed`).
    flush_owed_ready: bool,
    control_since: Option<Instant>,
    data_since: Option<Instant>,
    /// When the last batch with data or messages was encoded, and how many
    /// such records it carried: the inline write's burst gate.
    last_data_batch: Option<(Instant, u16)>,
    sweep_at: Instant,
    heartbeat_at: Option<Instant>,
    idle_since: Instant,
}

impl PeerCore {
    /// The core of `epoch`. `held` is what earlier epochs' slots still hold
    /// of the peer's data. Until [`PeerCore::set_peer_terms`], the peer is
    /// taken to have announced our own terms and been granted our window
    /// less `held`.
    pub fn new(
        epoch: Epoch,
        config: Arc<MuxConfig>,
        control: Arc<PeerControl>,
        registry: Arc<Registry>,
        mut held: Held,
        now: Instant,
    ) -> PeerCore {
        let counters = control.counters.clone();
        let egress_window = config.slot_window;
        let egress_peer_window = config.peer_window;
        let egress_max_record = config.max_record;
        let slot_limit = config.max_slots_per_peer;
        held.settle();
        let core = PeerCore {
            epoch,
            sweep_at: now + config.credit_sweep,
            heartbeat_at: config.heartbeat.map(|h| now + h),
            config,
            control,
            registry,
            counters,
            table: Vec::new(),
            free: VecDeque::new(),
            by_inlet: FastMap::default(),
            live_egress: 0,
            ready: VecDeque::new(),
            opens_owed: VecDeque::new(),
            opened_in_batch: Vec::new(),
            closed_in_batch: Vec::new(),
            peer_credit: i64::from(egress_peer_window),
            egress_peer_window,
            egress_max_record,
            slot_limit,
            peer_blocked: Vec::new(),
            ingress: FastMap::default(),
            by_rx: FastMap::default(),
            peer_outstanding: held.bytes(),
            peer_unspent: u64::from(egress_peer_window).saturating_sub(held.bytes()),
            held,
            peer_grant_owed: 0,
            opening_grant_owed: true,
            grants_owed: BTreeMap::new(),
            closes_owed: BTreeMap::new(),
            pong_owed: None,
            ping_owed: None,
            ping_written: 0,
            messages_out: VecDeque::new(),
            message_partial: None,
            messages_in_batch: Vec::new(),
            message_seq_out: FrameSeq(0),
            message_seq_in: FrameSeq(0),
            carried_messages: false,
            message_reassembly: None,
            sink: SinkSlot::default(),
            batch_seq_out: 0,
            batch_seq_in: 0,
            popped_bytes: 0,
            encoded_bytes: 0,
            goodbye_received: false,
            handed_over: false,
            wake_after_batch: ReceiverWakes::default(),
            egress_window,
            flush_requested: false,
            flush_owed_ready: false,
            data_goes_first: false,
            control_since: None,
            data_since: None,
            last_data_batch: None,
            idle_since: now,
        };
        core.publish_held();
        core
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Where inbound messages go (the mux's one slot for its sink).
    pub fn set_sink(&mut self, sink: SinkSlot) {
        self.sink = sink;
    }

    /// True while the core would take another outbound message.
    pub fn wants_messages(&self) -> bool {
        self.messages_out.len() < MESSAGES_HELD
    }

    /// Queues an outbound message (the driver pulls from the epoch's channel).
    pub fn handle_message(&mut self, message: OutboundMessage, now: Instant) {
        let (len, max) = (message.body.len(), self.egress_max_record.max(1));
        if len > max {
            // The peer would end the epoch on it: reported to its sender
            // (dropped armed) instead.
            Counters::add(&self.counters.messages_too_large, 1);
            tracing::debug!(len, max, "message larger than the peer's max_record");
            return;
        }
        self.messages_out.push_back(message);
        self.data_since.get_or_insert(now);
    }

    /// Live slots in both directions.
    pub fn live_slots(&self) -> usize {
        self.live_egress + self.ingress.len()
    }

    /// The peer's data bytes held or in flight here, not yet returned as
    /// peer credit.
    pub fn peer_outstanding(&self) -> u64 {
        self.peer_outstanding
    }

    pub fn goodbye_received(&self) -> bool {
        self.goodbye_received
    }

    /// Whether a message went into a batch or came out of one this epoch:
    /// an epoch without one lost no message, unless its link dropped
    /// batches unread (`EpochEnd::cut_delivery`).
    pub fn carried_messages(&self) -> bool {
        self.carried_messages
    }

    /// What the epoch's two hellos said: the peer's windows and the credit
    /// it gave us (what our slots send within), and the credit our hello
    /// `granted` it. Set before the epoch's first batch either way. If
    /// consumers freed room since our hello was written, it is granted now.
    pub fn set_peer_terms(&mut self, terms: PeerTerms, granted: u32, now: Instant) {
        debug_assert!(self.live_egress == 0, "set before any slot opens");
        self.egress_window = terms.slot_window;
        self.egress_peer_window = terms.peer_window;
        self.egress_max_record = terms.max_record as usize;
        self.control.peer_max_record.store(
            self.egress_max_record.max(1),
            std::sync::atomic::Ordering::Release,
        );
        self.control.peer_max_slots.store(
            terms.max_slots as usize,
            std::sync::atomic::Ordering::Release,
        );
        self.slot_limit = terms.max_slots.min(self.config.max_slots_per_peer);
        self.peer_credit = i64::from(terms.peer_credit.min(terms.peer_window));
        self.peer_unspent = u64::from(granted);
        self.grant_peer_room(now);
        self.publish_held();
    }

    /// What the closed slots (and the slots `fail_all` closed) still hold of
    /// the peer's data, for the next epoch's core. Called once the epoch is over.
    pub fn take_held(&mut self) -> Held {
        std::mem::take(&mut self.held)
    }

    /// Whether a consumer was handed a frame or a message since the last
    /// call: the batch just handled woke someone.
    pub fn take_handed_over(&mut self) -> bool {
        std::mem::take(&mut self.handed_over)
    }

    // ---- inputs ----

    /// Flushes as `Mux::flush` does (a shutdown drain writes what waited
    /// for a flush).
    pub fn request_flush(&mut self) {
        self.flush_requested = true;
    }

    /// Takes the coalesced control that producers, consumers and `flush` left.
    pub fn handle_control(&mut self, now: Instant) {
        let (inlets, rxs, flush, ping) = {
            let mut state = self.control.state();
            (
                std::mem::take(&mut state.dirty_inlets),
                std::mem::take(&mut state.dirty_rx),
                std::mem::take(&mut state.flush_requested),
                state.ping_wanted.take(),
            )
        };
        self.flush_requested |= flush;
        if let Some(nonce) = ping {
            self.ping_owed = Some(nonce);
            self.control_since.get_or_insert(now);
        }
        for inlet in inlets {
            match inlet.take_dirty() {
                InletStatus::New => self.adopt(inlet, now),
                InletStatus::Known => {
                    let key = Arc::as_ptr(&inlet) as usize;
                    if let Some(&index) = self.by_inlet.get(&key) {
                        self.make_ready(index, now);
                    }
                }
                InletStatus::Closed => {}
            }
        }
        for rx in rxs {
            self.visit_rx(&rx, now);
        }
    }

    /// Processes one received batch and wakes the receivers it fed. An
    /// error is the peer's protocol violation.
    pub fn handle_batch(&mut self, bytes: &[u8], now: Instant) -> Result<(), ProtocolError> {
        let (handled, _woken_on_drop) = self.handle_batch_unwoken(bytes, now);
        handled
    }

    /// [`PeerCore::handle_batch`] that hands back the receivers the batch
    /// found waiting, for the caller to wake together.
    pub fn handle_batch_unwoken(
        &mut self,
        bytes: &[u8],
        now: Instant,
    ) -> (Result<(), ProtocolError>, ReceiverWakes) {
        let handled = self.decode_batch(bytes, now);
        // Room for as many as this batch woke; none allocated for one or none.
        let woke = self.wake_after_batch.len();
        let next = ReceiverWakes::with_capacity(if woke > 1 { woke } else { 0 });
        (handled, std::mem::replace(&mut self.wake_after_batch, next))
    }

    fn decode_batch(&mut self, bytes: &[u8], now: Instant) -> Result<(), ProtocolError> {
        let view = BatchView::new_checked(bytes)?;
        if view.epoch() != self.epoch {
            return Err(ProtocolError::WrongEpoch {
                expected: self.epoch,
                got: view.epoch(),
            });
        }
        if view.batch_seq() != self.batch_seq_in {
            return Err(ProtocolError::BatchSeqGap {
                expected: self.batch_seq_in,
                got: view.batch_seq(),
            });
        }
        self.batch_seq_in = self.batch_seq_in.wrapping_add(1);
        Counters::add(&self.counters.batches_received, 1);
        Counters::add(
            &self.counters.records_received,
            u64::from(view.record_count()),
        );
        let handled = self.handle_records(&view, now);
        self.publish_held();
        handled
    }

    fn handle_records(&mut self, view: &BatchView<'_>, now: Instant) -> Result<(), ProtocolError> {
        for record in view.records() {
            if self.goodbye_received {
                return Err(ProtocolError::AfterGoodbye);
            }
            self.handle_record(record, now)?;
        }
        Ok(())
    }

    /// Fires the timers that are due.
    pub fn handle_timeout(&mut self, now: Instant) {
        if now >= self.sweep_at {
            self.sweep_at = now + self.config.credit_sweep;
            let slots: Vec<Arc<RxSlot>> = (self.ingress.values().map(|s| s.rx.clone()))
                .chain(self.held.receivers().cloned())
                .collect();
            for rx in slots {
                self.visit_rx(&rx, now);
            }
        }
        if let (Some(at), Some(interval)) = (self.heartbeat_at, self.config.heartbeat) {
            if now >= at {
                self.heartbeat_at = Some(now + interval);
                let mut owed = Vec::new();
                for (index, entry) in self.table.iter_mut().enumerate() {
                    let Some(slot) = entry.slot.as_mut() else {
                        continue;
                    };
                    let idle = !std::mem::take(&mut slot.sent_since_tick);
                    if idle && slot.open_sent {
                        slot.heartbeat_owed = true;
                        owed.push(index as u32);
                    }
                }
                for index in owed {
                    self.make_ready(index, now);
                }
            }
        }
    }

    // ---- outputs ----

    /// The earliest time `handle_timeout` or the flush gate needs attention.
    /// A gate already open at `now` needs none: its batch waits for a send
    /// buffer, whose arrival wakes the task (a past deadline kept the
    /// timer firing for as long as the link pushed back, a busy loop).
    pub fn poll_timeout(&self, now: Instant) -> Instant {
        let mut at = self.sweep_at;
        if let Some(h) = self.heartbeat_at {
            at = at.min(h);
        }
        if let Some(gate) = self.gate_deadline().filter(|gate| *gate > now) {
            at = at.min(gate);
        }
        at
    }

    /// The flush gate: should a batch be written now?
    pub fn wants_write(&self, now: Instant) -> bool {
        let control = self.has_control_owed();
        let data = !self.ready.is_empty() || self.has_messages();
        if self.opening_grant_owed && self.peer_grant_owed > 0 {
            return true;
        }
        match self.config.flush {
            FlushPolicy::Auto => control || data,
            FlushPolicy::AutoLinger { max_linger } => {
                control || (data && self.data_since.is_some_and(|t| now >= t + max_linger))
            }
            FlushPolicy::Manual { reply_linger } => {
                ((self.flush_requested || self.flush_owed_ready) && (control || data))
                    || (control && self.control_since.is_some_and(|t| now >= t + reply_linger))
            }
        }
    }

    /// Whether a producer may write in its own turn now
    /// ([`MuxConfig::inline_write_gap`]): under the automatic flush, while
    /// the last batch with data carried one record and left at least the
    /// gap ago. A burst's first record may go alone; the rest go batched
    /// through the peer task, and from then on the burst's batches keep it
    /// off until a lone record goes through the peer task again.
    pub fn inline_ok(&self, now: Instant) -> bool {
        let Some(gap) = self.config.inline_write_gap else {
            return false;
        };
        self.inline_candidate() && self.last_data_batch.is_none_or(|(at, _)| now >= at + gap)
    }

    /// [`PeerCore::inline_ok`] but for the time: whether a producer should
    /// look at all (the peer task publishes it when it waits).
    pub fn inline_candidate(&self) -> bool {
        self.config.inline_write_gap.is_some()
            && self.config.flush == FlushPolicy::Auto
            && self.last_data_batch.is_none_or(|(_, records)| records <= 1)
    }

    /// True when the peer is owed nothing and no slot has data ready.
    pub fn is_quiet(&self) -> bool {
        !self.has_control_owed() && self.ready.is_empty() && !self.has_messages()
    }

    /// True while an egress slot still holds something to write that waits
    /// only for slot credit (a blocked slot is off the ready list, so
    /// [`PeerCore::is_quiet`] does not see it). A shutdown drain waits for it.
    pub fn has_withheld(&self) -> bool {
        self.table
            .iter()
            .filter_map(|entry| entry.slot.as_ref())
            .any(|slot| {
                slot.partial.is_some() || slot.terminal.is_some() || slot.inlet.has_queued()
            })
    }

    fn has_messages(&self) -> bool {
        !self.messages_out.is_empty() || self.message_partial.is_some()
    }

    /// Since when this peer has had no live slot and no message or slot
    /// data either way, for idle retirement.
    pub fn idle_since(&self) -> Option<Instant> {
        (self.live_slots() == 0 && self.is_quiet()).then_some(self.idle_since)
    }

    /// Encodes the next batch into `buf`; returns its length, 0 if nothing to send.
    pub fn poll_batch(&mut self, buf: &mut [u8], now: Instant) -> usize {
        let len = self.encode_batch(buf, now);
        self.control
            .release_budget(std::mem::take(&mut self.popped_bytes));
        Counters::add(
            &self.counters.data_bytes_sent,
            std::mem::take(&mut self.encoded_bytes),
        );
        len
    }

    fn encode_batch(&mut self, buf: &mut [u8], now: Instant) -> usize {
        let include_data = match self.config.flush {
            FlushPolicy::Auto => true,
            FlushPolicy::AutoLinger { max_linger } => {
                self.data_since.is_some_and(|t| now >= t + max_linger)
            }
            FlushPolicy::Manual { .. } => self.flush_requested || self.flush_owed_ready,
        };
        // A carried flush sends only the slots that owe one, no messages.
        let only_owed =
            matches!(self.config.flush, FlushPolicy::Manual { .. }) && !self.flush_requested;
        let mut enc = match BatchEncoder::new(buf, self.epoch, self.batch_seq_out, Lane(0)) {
            Ok(enc) => enc,
            Err(err) => {
                tracing::error!(%err, "link buffer cannot hold a batch");
                return 0;
            }
        };
        let control_done = self.write_control(&mut enc);
        if control_done {
            self.control_since = None;
        }
        let control_records = enc.record_count();
        if include_data && control_done {
            let messages = !only_owed && self.has_messages();
            let data = !self.ready.is_empty();
            let data_first = self.data_goes_first || !messages;
            if messages && data {
                self.data_goes_first = !self.data_goes_first;
            }
            if messages && !data_first {
                self.write_messages(&mut enc);
            }
            // Small records, heartbeats and closes may still fit where a
            // message was too short to start.
            let full = self.write_data(&mut enc, now, only_owed);
            if only_owed && !full {
                self.flush_owed_ready = false;
            }
            if messages && data_first {
                self.write_messages(&mut enc);
            }
            if self.ready.is_empty() && !self.has_messages() {
                self.data_since = None;
                // A flush that met no peer credit holds until a grant comes.
                self.flush_requested &= !self.peer_blocked.is_empty();
            }
        }
        if enc.is_empty() {
            return 0;
        }
        if enc.record_count() > control_records {
            // Messages or slot data went out: not idle (§ "Idle retirement").
            self.idle_since = now;
            self.last_data_batch = Some((now, enc.record_count() - control_records));
        }
        self.batch_seq_out = self.batch_seq_out.wrapping_add(1);
        Counters::add(&self.counters.batches_sent, 1);
        Counters::add(&self.counters.records_sent, u64::from(enc.record_count()));
        enc.finish()
    }

    /// The batch from the last `poll_batch` is on the link: its messages are
    /// no longer the sender's to report, and the Opens in it have left.
    /// Without this call (a failed post) the messages stay armed and
    /// `fail_all` reports them, and the slots opened in it move on.
    pub fn batch_posted(&mut self) {
        self.messages_in_batch
            .drain(..)
            .for_each(OutboundMessage::written);
        for index in std::mem::take(&mut self.opened_in_batch) {
            if let Some(slot) = self.table[index as usize].slot.as_mut() {
                slot.unposted = None;
                slot.open_left = true;
            }
        }
        for index in std::mem::take(&mut self.closed_in_batch) {
            self.free_slot(index);
        }
    }

    /// Writes a Goodbye as the last batch of the epoch.
    pub fn poll_goodbye(&mut self, buf: &mut [u8]) -> usize {
        let Ok(mut enc) = BatchEncoder::new(buf, self.epoch, self.batch_seq_out, Lane(0)) else {
            return 0;
        };
        if enc.push_goodbye().is_err() {
            return 0;
        }
        self.batch_seq_out = self.batch_seq_out.wrapping_add(1);
        enc.finish()
    }

    /// Ends the epoch for every live slot: exactly one `Dropped` each for
    /// slots whose Open left. A slot whose Open never left (not written, or
    /// in a batch whose post failed) is handed to the next epoch whole,
    /// unless the mux is shutting down.
    pub fn fail_all(&mut self, reason: DropReason) {
        let carry = !matches!(reason, DropReason::Shutdown);
        let (mut dropped, mut carried) = (0u64, 0u64);
        for entry in &mut self.table {
            let Some(slot) = entry.slot.take() else {
                continue;
            };
            if carry && !slot.open_left {
                let unposted = slot.unposted.unwrap_or_default();
                slot.inlet.restore(unposted.records, unposted.terminal);
                if slot.inlet.carry() {
                    carried += 1;
                    continue;
                }
            }
            // A producer already ended (`TooLarge`) has had its one terminal.
            if slot.inlet.close(SendError::Dropped(reason)) {
                dropped += 1;
            }
        }
        self.opened_in_batch.clear();
        self.closed_in_batch.clear();
        Counters::add(&self.counters.slots_carried, carried);
        for (_, slot) in self.ingress.drain() {
            if slot.rx.end(Frame::Dropped(reason)) {
                dropped += 1;
            }
            if slot.rx.receiver_gone() {
                self.registry.remove(&slot.rx);
            } else {
                // What it delivered stays readable, and counted, into the
                // next epoch; a record still reassembling is gone.
                let partial = slot.reassembly.as_ref().map_or(0, |r| r.len() as u64);
                self.held.insert(slot.rx, slot.outstanding - partial);
            }
        }
        // What this epoch still held of the peer's data is the held set now.
        self.peer_outstanding = self.held.bytes();
        self.peer_unspent = 0;
        self.publish_held();
        self.publish_ingress();
        self.peer_blocked.clear();
        self.live_egress = 0;
        self.by_inlet.clear();
        self.by_rx.clear();
        self.ready.clear();
        self.opens_owed.clear();
        Counters::add(&self.counters.slots_dropped, dropped);
        // Dropping unwritten messages reports them to their senders; a
        // partly written one is reported too.
        self.message_partial = None;
        self.messages_out.clear();
        self.messages_in_batch.clear();
    }

    /// Writes queued messages; returns true if all of them fit.
    fn write_messages(&mut self, enc: &mut BatchEncoder<'_>) -> bool {
        loop {
            let (rest, message) = match self.message_partial.take() {
                Some(partial) => partial,
                None => match self.messages_out.pop_front() {
                    Some(message) => (message.body.clone(), message),
                    None => return true,
                },
            };
            let room = enc.body_room();
            let started = rest.len() != message.body.len();
            let too_small_to_start =
                !started && !enc.is_empty() && room < MIN_FRAGMENT.min(rest.len());
            if room == 0 || too_small_to_start {
                self.message_partial = Some((rest, message));
                return false;
            }
            let n = room.min(rest.len());
            let more = n < rest.len();
            enc.push_message(self.message_seq_out, &rest[..n], more)
                .expect("body_room said it fits");
            self.message_seq_out = self.message_seq_out.next();
            self.carried_messages = true;
            if more {
                self.message_partial = Some((rest.slice(n..), message));
                return false;
            }
            self.messages_in_batch.push(message);
        }
    }

    // ---- egress internals ----

    fn adopt(&mut self, inlet: Arc<Inlet>, now: Instant) {
        // The peer's limit too: an Open past it would only be refused
        // there, and past its cap on refusals owed, never told.
        if self.live_slots() >= self.slot_limit as usize {
            inlet.close(SendError::PeerClosed(CloseReason::Refused));
            return;
        }
        // A fresh index while there are few free ones; the oldest free one
        // otherwise, or when the table cannot grow.
        let fresh = self.table.len() as u32;
        let index = if self.free.len() < REUSE_AFTER && fresh <= SlotId::MAX_INDEX {
            self.table.push(IndexEntry::default());
            fresh
        } else if let Some(index) = self.free.pop_front() {
            index
        } else {
            inlet.close(SendError::PeerClosed(CloseReason::Refused));
            return;
        };
        let entry = &mut self.table[index as usize];
        let id = SlotId::new(index, entry.generation).expect("index checked above");
        self.by_inlet.insert(Arc::as_ptr(&inlet) as usize, index);
        entry.slot = Some(EgressSlot {
            inlet,
            id,
            credit: i64::from(self.egress_window),
            seq: FrameSeq(0),
            open_sent: false,
            open_left: false,
            unposted: None,
            partial: None,
            partial_started: false,
            terminal: None,
            in_ready: false,
            awaiting_peer_credit: false,
            heartbeat_owed: false,
            sent_since_tick: false,
            flush_owed: false,
        });
        self.live_egress += 1;
        self.opens_owed.push_back(index);
        self.control_since.get_or_insert(now);
        self.make_ready(index, now);
    }

    fn make_ready(&mut self, index: u32, now: Instant) {
        if let Some(slot) = self.table[index as usize].slot.as_mut() {
            if !slot.in_ready {
                slot.in_ready = true;
                self.ready.push_back(index);
                self.data_since.get_or_insert(now);
            }
        }
    }

    fn free_slot(&mut self, index: u32) {
        let entry = &mut self.table[index as usize];
        if let Some(slot) = entry.slot.take() {
            slot.inlet.release_slot();
            self.by_inlet.remove(&(Arc::as_ptr(&slot.inlet) as usize));
            entry.generation = entry.generation.wrapping_add(1);
            self.free.push_back(index);
            self.live_egress -= 1;
            if self.live_egress == 0 {
                // Only freed slots are left on the lists: nothing would pop
                // them under a manual flush until the next, and the peer
                // would not read as idle meanwhile.
                self.ready.clear();
                self.opens_owed.clear();
                self.peer_blocked.clear();
                // Their waits end with them, or the next record or control
                // owed would inherit an old start and skip its linger.
                if !self.has_messages() {
                    self.data_since = None;
                }
                if !self.has_control_owed() {
                    self.control_since = None;
                }
            }
        }
    }

    fn egress_slot(&mut self, id: SlotId) -> Option<&mut EgressSlot> {
        self.table
            .get_mut(id.index() as usize)
            .and_then(|e| e.slot.as_mut())
            .filter(|s| s.id == id)
    }

    fn has_control_owed(&self) -> bool {
        self.pong_owed.is_some()
            || self.ping_owed.is_some()
            || !self.closes_owed.is_empty()
            || !self.grants_owed.is_empty()
            || self.peer_grant_owed > 0
            || !self.opens_owed.is_empty()
    }

    /// When the flush gate opens by itself; `None` with nothing it waits
    /// for (a deadline past with nothing to write would fire again at once).
    fn gate_deadline(&self) -> Option<Instant> {
        match self.config.flush {
            FlushPolicy::AutoLinger { max_linger }
                if !self.ready.is_empty() || self.has_messages() =>
            {
                self.data_since.map(|t| t + max_linger)
            }
            FlushPolicy::Manual { reply_linger } if self.has_control_owed() => {
                self.control_since.map(|t| t + reply_linger)
            }
            _ => None,
        }
    }

    /// Writes owed control; returns true if all of it fit.
    fn write_control(&mut self, enc: &mut BatchEncoder<'_>) -> bool {
        if let Some(nonce) = self.pong_owed {
            if enc.push_pong(nonce).is_err() {
                return false;
            }
            self.pong_owed = None;
        }
        if let Some(nonce) = self.ping_owed {
            if enc.push_ping(nonce).is_err() {
                return false;
            }
            self.ping_owed = None;
            self.ping_written = self.ping_written.max(nonce);
        }
        while let Some((&slot, &reason)) = self.closes_owed.first_key_value() {
            if enc.push_close(slot, FrameSeq(0), reason).is_err() {
                return false;
            }
            self.closes_owed.remove(&slot);
        }
        while let Some((&index, &(slot, bytes))) = self.grants_owed.first_key_value() {
            let grant = u32::try_from(bytes).unwrap_or(u32::MAX);
            if enc.push_credit(slot, grant).is_err() {
                return false;
            }
            Counters::add(&self.counters.credit_updates_sent, 1);
            let rest = bytes - u64::from(grant);
            if rest == 0 {
                self.grants_owed.remove(&index);
            } else {
                self.grants_owed.insert(index, (slot, rest));
            }
        }
        while self.peer_grant_owed > 0 {
            let grant = u32::try_from(self.peer_grant_owed).unwrap_or(u32::MAX);
            if enc.push_peer_credit(grant).is_err() {
                return false;
            }
            Counters::add(&self.counters.peer_credit_updates_sent, 1);
            self.peer_grant_owed -= u64::from(grant);
            self.opening_grant_owed = false;
        }
        while let Some(&index) = self.opens_owed.front() {
            // A slot the peer closed before its Open went leaves its index
            // here; reused, the index is owed twice, and its Open goes once.
            let slot = self.table[index as usize].slot.as_mut();
            if let Some(slot) = slot.filter(|slot| !slot.open_sent) {
                let key = slot.inlet.key;
                if enc
                    .push_open(slot.id, slot.seq, key.anchor.0, key.session.0)
                    .is_err()
                {
                    return false;
                }
                slot.open_sent = true;
                slot.unposted = Some(Unposted::default());
                slot.sent_since_tick = true;
                slot.seq = slot.seq.next();
                self.opened_in_batch.push(index);
            }
            self.opens_owed.pop_front();
        }
        true
    }

    /// Fills the batch from the ready slots in turn (`only_owed`: only those
    /// that owe a flush); true if it stopped because the batch is full.
    fn write_data(&mut self, enc: &mut BatchEncoder<'_>, now: Instant, only_owed: bool) -> bool {
        let rounds = self.ready.len();
        for _ in 0..rounds {
            let Some(index) = self.ready.pop_front() else {
                break;
            };
            let Some(slot) = self.table[index as usize].slot.as_ref() else {
                // The peer closed it: nothing of it is left to write.
                continue;
            };
            if only_owed && !slot.flush_owed {
                // Waits, ready, for the next flush.
                self.ready.push_back(index);
                continue;
            }
            let records_before = enc.record_count();
            match self.fill_slot(index, enc) {
                Fill::Full if enc.record_count() == records_before => {
                    // No room for it at all: it keeps its turn for the next
                    // batch (a message may have filled this one).
                    self.ready.push_front(index);
                    return true;
                }
                Fill::Full => {
                    // To the back: a long record takes turns with the other
                    // ready slots instead of holding the link until it ends.
                    self.ready.push_back(index);
                    return true;
                }
                Fill::Blocked | Fill::Idle => {
                    if let Some(slot) = self.table[index as usize].slot.as_mut() {
                        slot.in_ready = false;
                    }
                }
                Fill::Closed => {
                    let unposted = self.table[index as usize]
                        .slot
                        .as_ref()
                        .is_some_and(|slot| slot.unposted.is_some());
                    if unposted {
                        self.closed_in_batch.push(index);
                    } else {
                        self.free_slot(index);
                    }
                }
            }
        }
        if !self.ready.is_empty() {
            self.data_since.get_or_insert(now);
        }
        false
    }

    fn fill_slot(&mut self, index: u32, enc: &mut BatchEncoder<'_>) -> Fill {
        let counters = &self.counters;
        let popped_bytes = &mut self.popped_bytes;
        let encoded_bytes = &mut self.encoded_bytes;
        let peer_credit = &mut self.peer_credit;
        let peer_blocked = &mut self.peer_blocked;
        let peer_window = self.egress_peer_window;
        // A limit of 0 acts as 1 on both ends.
        let max_record = self.egress_max_record.max(1);
        let flushing =
            matches!(self.config.flush, FlushPolicy::Manual { .. }) && self.flush_requested;
        let Some(slot) = self.table[index as usize].slot.as_mut() else {
            return Fill::Idle;
        };
        if !slot.open_sent {
            return Fill::Full;
        }
        loop {
            if let Some(rest) = slot.partial.take() {
                let room = enc.body_room();
                let too_small_to_start =
                    !slot.partial_started && !enc.is_empty() && room < MIN_FRAGMENT.min(rest.len());
                if room == 0 || too_small_to_start {
                    slot.partial = Some(rest);
                    return Fill::Full;
                }
                let n = room.min(rest.len());
                let more = n < rest.len();
                enc.push_data(slot.id, slot.seq, &rest[..n], more)
                    .expect("body_room said it fits");
                slot.seq = slot.seq.next();
                slot.credit -= fragment_cost(n, !more) as i64;
                slot.sent_since_tick = true;
                slot.heartbeat_owed = false;
                *encoded_bytes += n as u64;
                if more {
                    slot.partial = Some(rest.slice(n..));
                    slot.partial_started = true;
                    return Fill::Full;
                }
                slot.partial_started = false;
                continue;
            }
            if let Some(reason) = slot.terminal.take() {
                if enc.push_close(slot.id, slot.seq, reason).is_err() {
                    slot.terminal = Some(reason);
                    return Fill::Full;
                }
                return Fill::Closed;
            }
            // Slot credit gates the start of a record, and its fragments then
            // flow (docs/design.md § "Credit gates the start of a record");
            // peer credit takes the whole record as it starts (§ "Peer credit
            // bounds what a peer can make us hold").
            let slot_credit = slot.credit > 0;
            let mut short = None;
            let mut too_large = None;
            let gate = |len: usize| {
                if len > max_record {
                    too_large = Some(len);
                    return false;
                }
                let fits = (record_cost(len) as i64) <= *peer_credit;
                if slot_credit && !fits {
                    short = Some(len);
                }
                slot_credit && fits
            };
            let popped = slot.inlet.pop(gate);
            // More than the peer takes as one record, or will ever hold of
            // ours: it can never go.
            let never = too_large.map(|len| (len, max_record)).or_else(|| {
                let max = (peer_window as usize).saturating_sub(RECORD_OVERHEAD);
                short
                    .filter(|&len| record_cost(len) > peer_window as usize)
                    .map(|len| (len, max))
            });
            match popped {
                Pop::Blocked if never.is_some() => {
                    let (len, max) = never.expect("checked");
                    slot.inlet.close(SendError::TooLarge { len, max });
                    // The receiver hears why, not a bare drop.
                    slot.terminal = Some(CloseReason::TooLarge);
                }
                Pop::Blocked if short.is_some() => {
                    Counters::add(&counters.peer_credit_stalls, 1);
                    if !slot.awaiting_peer_credit {
                        slot.awaiting_peer_credit = true;
                        peer_blocked.push(index);
                    }
                    return Fill::Blocked;
                }
                Pop::Record(data) => {
                    *peer_credit -= record_cost(data.len()) as i64;
                    *popped_bytes += record_cost(data.len());
                    if let Some(unposted) = slot.unposted.as_mut() {
                        unposted.records.push(data.clone());
                    }
                    slot.partial = Some(data);
                }
                Pop::Terminal(reason) => {
                    if let Some(unposted) = slot.unposted.as_mut() {
                        unposted.terminal = Some(reason);
                    }
                    slot.terminal = Some(reason);
                }
                Pop::Blocked => {
                    Counters::add(&counters.credit_stalls, 1);
                    slot.flush_owed |= flushing;
                    return Fill::Blocked;
                }
                Pop::Empty => {
                    slot.flush_owed = false;
                    if slot.heartbeat_owed {
                        // No room, or no record left in this batch: the next.
                        if enc.push_heartbeat(slot.id, slot.seq).is_err() {
                            return Fill::Full;
                        }
                        slot.seq = slot.seq.next();
                        slot.heartbeat_owed = false;
                    }
                    return Fill::Idle;
                }
            }
        }
    }

    // ---- ingress internals ----

    fn visit_rx(&mut self, rx: &Arc<RxSlot>, now: Instant) {
        let visit = rx.visit();
        let key = Arc::as_ptr(rx) as usize;
        let Some(&index) = self.by_rx.get(&key) else {
            self.visit_draining(key, visit, now);
            return;
        };
        let Some(slot) = self.ingress.get_mut(&index) else {
            return;
        };
        let id = slot.id;
        if visit.drained > 0 {
            slot.outstanding = slot.outstanding.saturating_sub(visit.drained);
            let owed = self.grants_owed.entry(index).or_insert((id, 0));
            owed.1 += visit.drained;
            self.return_peer_credit(visit.drained, now);
        }
        if visit.receiver_gone {
            // What the consumer left behind was discarded with it.
            let left = self
                .remove_ingress(index)
                .map_or(0, |slot| slot.outstanding);
            self.return_peer_credit(left, now);
            self.grants_owed.remove(&index);
            // Past twice the slot limit only while the peer lets us write
            // nothing and keeps opening streams our consumers drop: that
            // close goes untold; its stream hears `UnknownSlot` if it sends
            // again, or waits for its epoch's end (it stalls only itself).
            if self.closes_owed.len() < 2 * self.config.max_slots_per_peer as usize {
                self.closes_owed.insert(id, CloseReason::ReceiverGone);
            } else {
                Counters::add(&self.counters.closes_untold, 1);
            }
            self.registry.remove(rx);
            self.control_since.get_or_insert(now);
        }
    }

    /// A closed slot's consumer took or dropped what it held: peer credit.
    fn visit_draining(&mut self, key: usize, visit: RxVisit, now: Instant) {
        let freed = self.held.visit(key, visit);
        self.return_peer_credit(freed, now);
    }

    fn remove_ingress(&mut self, index: u32) -> Option<IngressSlot> {
        let slot = self.ingress.remove(&index)?;
        self.by_rx.remove(&(Arc::as_ptr(&slot.rx) as usize));
        self.publish_ingress();
        Some(slot)
    }

    /// Lets `open` see this peer's ingress slots when it checks the limit.
    fn publish_ingress(&self) {
        self.control
            .ingress_live
            .store(self.ingress.len(), std::sync::atomic::Ordering::Release);
    }

    /// The peer reuses an index only once it has closed the generation
    /// before: closes still owed for other generations of `opened`'s index
    /// are moot, and kept, one could reach a generation 256 reuses on.
    fn forget_closes_before(&mut self, opened: SlotId) {
        let index = opened.index() << 8;
        let moot: Vec<SlotId> = (self.closes_owed)
            .range(SlotId::from_wire(index)..=SlotId::from_wire(index | 0xff))
            .map(|(&slot, _)| slot)
            .filter(|&slot| slot != opened)
            .collect();
        for slot in moot {
            self.closes_owed.remove(&slot);
        }
    }

    fn owe_close(&mut self, slot: SlotId, reason: CloseReason, now: Instant) {
        // The first reason owed for a slot stands: a refused open's records,
        // behind it in the same batch, find no slot, and the sender must
        // still hear "refused".
        if self.closes_owed.contains_key(&slot) {
            return;
        }
        // Bounded by the slot limit: a peer spraying unknown slots is told
        // about as many as could exist, the rest are only counted. The
        // closes of slots that were live here have the other half.
        if self.closes_owed.len() < self.config.max_slots_per_peer as usize {
            self.closes_owed.insert(slot, reason);
            self.control_since.get_or_insert(now);
        } else {
            Counters::add(&self.counters.closes_untold, 1);
        }
    }

    /// The ingress slot a record names, or `None` after counting the drop.
    fn ingress_for(&mut self, id: SlotId, now: Instant) -> Option<u32> {
        let index = id.index();
        match self.ingress.get(&index) {
            Some(slot) if slot.id == id => Some(index),
            Some(_) => {
                Counters::add(&self.counters.stale_generation, 1);
                self.owe_close(id, CloseReason::UnknownSlot, now);
                None
            }
            None => {
                Counters::add(&self.counters.unknown_slot, 1);
                self.owe_close(id, CloseReason::UnknownSlot, now);
                None
            }
        }
    }

    fn check_seq(slot: &mut IngressSlot, got: FrameSeq) -> Result<(), ProtocolError> {
        if got != slot.expected {
            return Err(ProtocolError::FrameSeqGap {
                slot: slot.id,
                expected: slot.expected,
                got,
            });
        }
        slot.expected = slot.expected.next();
        Ok(())
    }

    fn handle_record(&mut self, record: Record<'_>, now: Instant) -> Result<(), ProtocolError> {
        match record.body {
            RecordBody::Data(body) => self.on_data(record.slot, record.seq, body, record.more, now),
            RecordBody::Open { anchor, session } => self.on_open(
                record.slot,
                record.seq,
                StreamKey::new(anchor, session),
                now,
            ),
            RecordBody::Close(reason) => self.on_close(record.slot, record.seq, reason, now),
            RecordBody::Credit(bytes) => self.on_credit(record.slot, bytes, now),
            RecordBody::PeerCredit(bytes) => self.on_peer_credit(bytes, now),
            RecordBody::Heartbeat => {
                let Some(index) = self.ingress_for(record.slot, now) else {
                    return Ok(());
                };
                let slot = self.ingress.get_mut(&index).expect("looked up");
                Self::check_seq(slot, record.seq)?;
                if slot.reassembly.is_some() {
                    return Err(ProtocolError::BrokenFragment { slot: slot.id });
                }
                slot.rx.push(Frame::Heartbeat, 0);
                Ok(())
            }
            RecordBody::Goodbye => {
                self.goodbye_received = true;
                Ok(())
            }
            RecordBody::Message(body) => {
                self.idle_since = now;
                self.on_message(record.seq, body, record.more)
            }
            RecordBody::Ping(nonce) => {
                // One Pong answers every ping up to its nonce, and pings
                // can come out of order: the highest is owed.
                self.pong_owed = Some(self.pong_owed.map_or(nonce, |owed| owed.max(nonce)));
                self.control_since.get_or_insert(now);
                Ok(())
            }
            RecordBody::Pong(nonce) => {
                // An answer to a Ping never written would answer pings yet
                // to come: a health check would hear a peer long gone.
                if nonce > self.ping_written {
                    return Err(ProtocolError::UnaskedPong {
                        nonce,
                        asked: self.ping_written,
                    });
                }
                self.control
                    .pong_seen
                    .send_if_modified(|seen| std::mem::replace(seen, (*seen).max(nonce)) < nonce);
                Ok(())
            }
        }
    }

    fn on_message(&mut self, seq: FrameSeq, body: &[u8], more: bool) -> Result<(), ProtocolError> {
        let zero = SlotId::from_wire(0);
        if seq != self.message_seq_in {
            return Err(ProtocolError::FrameSeqGap {
                slot: zero,
                expected: self.message_seq_in,
                got: seq,
            });
        }
        self.message_seq_in = seq.next();
        self.carried_messages = true;
        // As on a slot: a fragment carries bytes (only a whole message may
        // be empty), so a peer cannot spin us on empty pieces.
        if body.is_empty() && (more || self.message_reassembly.is_some()) {
            return Err(ProtocolError::BrokenFragment { slot: zero });
        }
        let max = self.config.max_record.max(1);
        if self.message_reassembly.is_none() && body.len() > max {
            return Err(ProtocolError::RecordTooLarge {
                slot: zero,
                len: body.len(),
                max,
            });
        }
        let message = match self.message_reassembly.take() {
            None if more => {
                self.message_reassembly = Some(body.to_vec());
                return Ok(());
            }
            None => Bytes::copy_from_slice(body),
            Some(mut partial) => {
                if partial.len() + body.len() > max {
                    return Err(ProtocolError::RecordTooLarge {
                        slot: zero,
                        len: partial.len() + body.len(),
                        max,
                    });
                }
                append_fragment(&mut partial, body);
                if more {
                    self.message_reassembly = Some(partial);
                    return Ok(());
                }
                reassembled(partial)
            }
        };
        match self.sink.get() {
            Some(sink) => {
                sink.deliver(self.control.peer, message);
                self.handed_over = true;
            }
            None => Counters::add(&self.counters.no_message_handler, 1),
        }
        Ok(())
    }

    fn on_open(
        &mut self,
        id: SlotId,
        seq: FrameSeq,
        key: StreamKey,
        now: Instant,
    ) -> Result<(), ProtocolError> {
        let index = id.index();
        if self.ingress.contains_key(&index) {
            return Err(ProtocolError::SlotInUse { slot: id });
        }
        if seq != FrameSeq(0) {
            return Err(ProtocolError::FrameSeqGap {
                slot: id,
                expected: FrameSeq(0),
                got: seq,
            });
        }
        self.forget_closes_before(id);
        if self.live_slots() >= self.config.max_slots_per_peer as usize {
            Counters::add(&self.counters.opens_refused, 1);
            self.owe_close(id, CloseReason::Refused, now);
            return Ok(());
        }
        match self.registry.open(key, &self.control) {
            OpenOutcome::Attached(rx) => {
                self.by_rx.insert(Arc::as_ptr(&rx) as usize, index);
                self.ingress.insert(
                    index,
                    IngressSlot {
                        id,
                        rx,
                        expected: seq.next(),
                        outstanding: 0,
                        reassembly: None,
                    },
                );
                self.publish_ingress();
                self.idle_since = now;
            }
            OpenOutcome::Refused => {
                Counters::add(&self.counters.opens_refused, 1);
                self.owe_close(id, CloseReason::Refused, now);
            }
        }
        Ok(())
    }

    fn on_data(
        &mut self,
        id: SlotId,
        seq: FrameSeq,
        body: &[u8],
        more: bool,
        now: Instant,
    ) -> Result<(), ProtocolError> {
        // Every data byte counts against the peer window, held or not: the
        // sender took it from its peer credit either way. The last fragment
        // carries the record's overhead.
        let len = fragment_cost(body.len(), !more) as u64;
        let peer_window = self.config.peer_window;
        if len > self.peer_unspent {
            return Err(ProtocolError::PeerCreditOverrun {
                outstanding: self.peer_outstanding,
                len: body.len(),
                cost: len,
                window: peer_window,
            });
        }
        self.peer_unspent -= len;
        self.peer_outstanding += len;
        if self.peer_outstanding > u64::from(peer_window) / 2 {
            // Under pressure, collect drains below the grant threshold sooner
            // than the sweep would (each sweep visits every slot: not often).
            self.sweep_at = self.sweep_at.min(now + self.config.credit_sweep / 4);
        }
        let Some(index) = self.ingress_for(id, now) else {
            self.return_peer_credit(len, now);
            return Ok(());
        };
        let window = self.config.slot_window;
        let max = self.config.max_record.max(1);
        let slot = self.ingress.get_mut(&index).expect("looked up");
        Self::check_seq(slot, seq)?;
        if body.is_empty() && (more || slot.reassembly.is_some()) {
            return Err(ProtocolError::BrokenFragment { slot: id });
        }
        let record = match slot.reassembly.take() {
            None => {
                if slot.outstanding >= u64::from(window) {
                    return Err(ProtocolError::CreditOverrun {
                        slot: id,
                        outstanding: slot.outstanding,
                        window,
                    });
                }
                if body.len() > max {
                    return Err(ProtocolError::RecordTooLarge {
                        slot: id,
                        len: body.len(),
                        max,
                    });
                }
                slot.outstanding += len;
                if more {
                    slot.reassembly = Some(body.to_vec());
                    return Ok(());
                }
                Bytes::copy_from_slice(body)
            }
            Some(mut partial) => {
                if partial.len() + body.len() > max {
                    let len = partial.len() + body.len();
                    // Left as it was: the epoch's end counts what it holds.
                    slot.reassembly = Some(partial);
                    return Err(ProtocolError::RecordTooLarge { slot: id, len, max });
                }
                slot.outstanding += len;
                append_fragment(&mut partial, body);
                if more {
                    slot.reassembly = Some(partial);
                    return Ok(());
                }
                reassembled(partial)
            }
        };
        let cost = record_cost(record.len()) as u64;
        match slot.rx.push_unwoken(Frame::Data(record), cost) {
            Pushed::ReceiverWaiting(waiter) => {
                self.wake_after_batch.push(waiter);
                self.handed_over = true;
            }
            Pushed::Buffered => self.handed_over = true,
            Pushed::Discarded => Counters::add(&self.counters.receiver_gone, 1),
        }
        Ok(())
    }

    fn on_close(
        &mut self,
        id: SlotId,
        seq: FrameSeq,
        reason: CloseReason,
        now: Instant,
    ) -> Result<(), ProtocolError> {
        let frame = match reason {
            CloseReason::Finalized => Frame::Finalized,
            CloseReason::Detached => Frame::Detached,
            CloseReason::SenderDropped => Frame::Dropped(DropReason::SenderDropped),
            CloseReason::TooLarge => Frame::Dropped(DropReason::RecordTooLarge),
            CloseReason::UnknownSlot | CloseReason::Refused | CloseReason::ReceiverGone => {
                // Receiver → sender: about one of our egress slots.
                let index = id.index();
                if let Some(slot) = self.egress_slot(id) {
                    slot.inlet.close(SendError::PeerClosed(reason));
                    // A record cut short took all of itself from peer credit
                    // as it started; the peer counts only what arrives.
                    // Started or not, its last fragment, which carries the
                    // overhead, never went.
                    slot.partial_started = false;
                    let unsent = slot
                        .partial
                        .take()
                        .map_or(0, |rest| record_cost(rest.len()));
                    self.free_slot(index);
                    if unsent > 0 {
                        self.peer_credit += unsent as i64;
                        self.wake_peer_blocked(now);
                    }
                    if self.live_slots() == 0 {
                        // As when our own last close goes out: idle from
                        // now, however long the slot sat quiet.
                        self.idle_since = now;
                    }
                }
                return Ok(());
            }
        };
        let Some(index) = self.ingress_for(id, now) else {
            return Ok(());
        };
        let slot = self.ingress.get_mut(&index).expect("looked up");
        Self::check_seq(slot, seq)?;
        if slot.reassembly.is_some() {
            return Err(ProtocolError::BrokenFragment { slot: id });
        }
        let slot = self.remove_ingress(index).expect("looked up");
        self.grants_owed.remove(&index);
        slot.rx.end(frame);
        self.handed_over = true;
        if slot.rx.receiver_gone() {
            self.registry.remove(&slot.rx);
            self.return_peer_credit(slot.outstanding, now);
        } else {
            // Until its consumer takes the rest, it counts against the window.
            self.held.insert(slot.rx, slot.outstanding);
        }

        if self.live_slots() == 0 {
            self.idle_since = now;
        }
        Ok(())
    }

    fn on_credit(&mut self, id: SlotId, bytes: u32, now: Instant) -> Result<(), ProtocolError> {
        let window = self.egress_window;
        let index = id.index();
        let Some(slot) = self.egress_slot(id) else {
            // A late grant for a slot that closed: harmless.
            return Ok(());
        };
        slot.credit += i64::from(bytes);
        if slot.credit > i64::from(window) {
            return Err(ProtocolError::CreditOverGrant {
                slot: id,
                credit: slot.credit,
                window,
            });
        }
        // What a flush could not send for want of credit goes when it comes.
        self.flush_owed_ready |= slot.flush_owed;
        self.make_ready(index, now);
        Ok(())
    }

    fn on_peer_credit(&mut self, bytes: u32, now: Instant) -> Result<(), ProtocolError> {
        let window = self.egress_peer_window;
        self.peer_credit += i64::from(bytes);
        if self.peer_credit > i64::from(window) {
            return Err(ProtocolError::PeerCreditOverGrant {
                credit: self.peer_credit,
                window,
            });
        }
        self.wake_peer_blocked(now);
        Ok(())
    }

    /// Peer credit came back: the slots that waited for it are ready.
    fn wake_peer_blocked(&mut self, now: Instant) {
        for index in std::mem::take(&mut self.peer_blocked) {
            if let Some(slot) = self.table[index as usize].slot.as_mut() {
                slot.awaiting_peer_credit = false;
            }
            self.make_ready(index, now);
        }
    }

    /// Data the peer sent that we let go of (consumed, discarded, or never
    /// held): returned as peer credit in the next batch.
    fn return_peer_credit(&mut self, bytes: u64, now: Instant) {
        if bytes == 0 {
            return;
        }
        self.peer_outstanding = self.peer_outstanding.saturating_sub(bytes);
        self.grant_peer_room(now);
        self.publish_held();
    }

    fn publish_held(&self) {
        self.control
            .publish_held(self.peer_outstanding, self.peer_unspent);
    }

    /// Grants the peer what our window has room for: the window less what
    /// we hold of its data and what it may still send.
    fn grant_peer_room(&mut self, now: Instant) {
        let room = u64::from(self.config.peer_window)
            .saturating_sub(self.peer_outstanding + self.peer_unspent);
        if room == 0 {
            return;
        }
        self.peer_unspent += room;
        self.peer_grant_owed += room;
        self.control_since.get_or_insert(now);
    }
}

/// Appends a fragment to a record reassembling, growing its buffer to at
/// most an eighth past its length. Credit counts a record's length while it
/// reassembles, for as long as the peer leaves its last fragment unsent;
/// doubling (`Vec` or `BytesMut` growth) pinned up to twice that.
fn append_fragment(partial: &mut Vec<u8>, body: &[u8]) {
    let needed = partial.len() + body.len();
    if needed > partial.capacity() {
        partial.reserve_exact(needed + needed / 8 - partial.len());
    }
    partial.extend_from_slice(body);
}

/// A reassembled record as it will be held: one whose buffer has much room
/// to spare is copied to its length, since `Bytes` keeps the whole buffer.
fn reassembled(partial: Vec<u8>) -> Bytes {
    if partial.capacity() - partial.len() > partial.len() / 8 {
        Bytes::copy_from_slice(&partial)
    } else {
        Bytes::from(partial)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::mux::slot::SlotSender;
    use crate::mux::{PeerId, Terminal};

    fn core() -> PeerCore {
        let config = MuxConfig::default();
        let control = Arc::new(PeerControl::new(
            PeerId(2),
            config.peer_budget,
            Arc::new(Counters::default()),
        ));
        next_core(Epoch(1), &control)
    }

    /// The core of epoch `epoch` for the peer that `control` belongs to.
    fn next_core(epoch: Epoch, control: &Arc<PeerControl>) -> PeerCore {
        let config = Arc::new(MuxConfig::default());
        let registry = Registry::new(config.slot_window, 16, 16);
        PeerCore::new(
            epoch,
            config,
            control.clone(),
            registry,
            Held::default(),
            Instant::now(),
        )
    }

    /// Hands the core the peer's next batch, written by `records`.
    fn feed(
        core: &mut PeerCore,
        records: impl FnOnce(&mut BatchEncoder<'_>) -> Result<(), crate::mux::protocol::EncodeError>,
    ) -> Result<(), ProtocolError> {
        let mut buf = vec![0u8; 1 << 16];
        let mut enc = BatchEncoder::new(&mut buf, core.epoch, core.batch_seq_in, Lane(0))
            .expect("room for a header");
        records(&mut enc).expect("the records fit");
        let len = enc.finish();
        core.handle_batch(&buf[..len], Instant::now())
    }

    /// Opens a slot toward the core's peer, as `Mux::open` does.
    fn open(core: &PeerCore, session: u64) -> SlotSender {
        assert!(core.control.admit_egress(16));
        let inlet = Inlet::new(
            StreamKey::new(7, session),
            core.control.clone(),
            1 << 20,
            1 << 20,
        );
        assert!(inlet.announce());
        SlotSender::new(inlet)
    }

    /// The next batch the core writes, one line per record (empty: none).
    fn next_batch(core: &mut PeerCore) -> Vec<String> {
        let mut buf = vec![0u8; 4096];
        let len = core.poll_batch(&mut buf, Instant::now());
        if len == 0 {
            return Vec::new();
        }
        let view = BatchView::new_checked(&buf[..len]).expect("the core writes valid batches");
        assert_eq!(view.epoch(), core.epoch());
        view.records()
            .map(|r| match r.body {
                RecordBody::Open { session, .. } => format!("open {session} seq {}", r.seq.0),
                RecordBody::Data(d) => {
                    format!("data {:?} seq {}", Bytes::copy_from_slice(d), r.seq.0)
                }
                RecordBody::Close(reason) => format!("close {reason:?} seq {}", r.seq.0),
                other => format!("{other:?}"),
            })
            .collect()
    }

    /// A core whose peer granted it its whole peer window.
    fn credited_core() -> PeerCore {
        let mut core = core();
        credit_whole_window(&mut core);
        core
    }

    /// The peer grants `core` its whole peer window, on terms like its own.
    fn credit_whole_window(core: &mut PeerCore) {
        let window = core.config.peer_window;
        core.set_peer_terms(
            PeerTerms::announced_by(&core.config),
            window,
            Instant::now(),
        );
    }

    /// A core under `FlushPolicy::Manual` (owed control waits an hour).
    fn manual_core() -> PeerCore {
        let mut core = next_core(Epoch(1), &peer_control());
        core.config = Arc::new(MuxConfig {
            flush: FlushPolicy::Manual {
                reply_linger: std::time::Duration::from_secs(3600),
            },
            ..(*core.config).clone()
        });
        core
    }

    fn ended(epoch: u64) -> DropReason {
        DropReason::EpochEnded {
            epoch: Epoch(epoch),
        }
    }

    #[tokio::test]
    async fn a_slot_adopted_by_a_dying_epoch_moves_to_the_next_one_whole() {
        let mut dying = core();
        let mut tx = open(&dying, 1);
        tx.send(Bytes::from_static(b"one")).await.expect("queued");
        // Adopted, its Open owed: the epoch dies before any batch is written.
        dying.handle_control(Instant::now());
        dying.fail_all(ended(1));
        let stats = dying.counters.snapshot();
        assert_eq!((stats.slots_dropped, stats.slots_carried), (0, 1));
        tx.send(Bytes::from_static(b"two"))
            .await
            .expect("the slot lives on");
        tx.finish(Terminal::Finalized).expect("finish");

        let mut next = next_core(Epoch(2), &dying.control);
        next.handle_control(Instant::now());
        assert_eq!(
            next_batch(&mut next),
            [
                "open 1 seq 0",
                "data b\"one\" seq 1",
                "data b\"two\" seq 2",
                "close Finalized seq 3"
            ]
        );
        next.batch_posted();
        assert_eq!(next.live_slots(), 0, "its terminal is out");
    }

    #[tokio::test]
    async fn a_slot_whose_open_was_in_a_failed_post_moves_on_with_its_records() {
        let mut dying = core();
        let mut tx = open(&dying, 2);
        for record in [b"one", b"two"] {
            tx.send(Bytes::from_static(record)).await.expect("queued");
        }
        tx.finish(Terminal::Finalized).expect("finish");
        dying.handle_control(Instant::now());
        let written = next_batch(&mut dying);
        assert_eq!(written.len(), 4, "{written:?}");
        // No batch_posted: the post failed because the link had died.
        dying.fail_all(ended(1));
        let stats = dying.counters.snapshot();
        assert_eq!((stats.slots_dropped, stats.slots_carried), (0, 1));

        let mut next = next_core(Epoch(2), &dying.control);
        next.handle_control(Instant::now());
        assert_eq!(
            next_batch(&mut next),
            written,
            "the same records, from seq 0"
        );
        next.batch_posted();
        assert_eq!(next.live_slots(), 0);
        assert_eq!(next.counters.snapshot().withheld_bytes, 0);
    }

    #[tokio::test]
    async fn a_slot_whose_open_left_gets_exactly_one_dropped() {
        let mut dying = core();
        let mut tx = open(&dying, 3);
        tx.send(Bytes::from_static(b"one")).await.expect("queued");
        dying.handle_control(Instant::now());
        assert_eq!(next_batch(&mut dying).len(), 2);
        dying.batch_posted();
        dying.fail_all(ended(1));
        let stats = dying.counters.snapshot();
        assert_eq!((stats.slots_dropped, stats.slots_carried), (1, 0));
        assert_eq!(
            tx.send(Bytes::from_static(b"late")).await,
            Err(SendError::Dropped(ended(1)))
        );
        drop(tx);
        let mut next = next_core(Epoch(2), &dying.control);
        next.handle_control(Instant::now());
        assert!(
            next_batch(&mut next).is_empty(),
            "nothing of it reaches epoch 2"
        );
    }

    /// A small peer window, and the registry consumers bind from.
    fn held_core(
        epoch: Epoch,
        control: &Arc<PeerControl>,
        registry: &Arc<Registry>,
        held: Held,
    ) -> PeerCore {
        let config = MuxConfig {
            slot_window: 8192,
            peer_window: 8192,
            ..MuxConfig::default()
        };
        PeerCore::new(
            epoch,
            Arc::new(config),
            control.clone(),
            registry.clone(),
            held,
            Instant::now(),
        )
    }

    /// The peer opens slot `index` for session `session` and sends `len`
    /// bytes on it (`more`: the record goes on), then closes it if `close`.
    fn peer_sends(
        core: &mut PeerCore,
        index: u32,
        session: u64,
        len: usize,
        more: bool,
        close: bool,
    ) -> Result<(), ProtocolError> {
        let slot = SlotId::new(index, 0).expect("a valid index");
        let body = vec![5u8; len];
        feed(core, |enc| {
            enc.push_open(slot, FrameSeq(0), 7, session)?;
            enc.push_data(slot, FrameSeq(1), &body, more)?;
            if close {
                enc.push_close(slot, FrameSeq(2), CloseReason::Finalized)?;
            }
            Ok(())
        })
    }

    fn peer_control() -> Arc<PeerControl> {
        Arc::new(PeerControl::new(
            PeerId(2),
            1 << 20,
            Arc::new(Counters::default()),
        ))
    }

    /// A record that grows past `max_record` while it reassembles ends the
    /// epoch, and the end counts as held only what was delivered: the
    /// record thrown away leaves nothing counted against the next window.
    #[tokio::test]
    async fn a_record_cut_off_past_max_record_leaves_nothing_held() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let config = MuxConfig {
            slot_window: 8192,
            peer_window: 8192,
            max_record: 1000,
            ..MuxConfig::default()
        };
        let mut core = PeerCore::new(
            Epoch(1),
            Arc::new(config),
            control.clone(),
            registry.clone(),
            Held::default(),
            Instant::now(),
        );
        peer_sends(&mut core, 1, 1, 600, true, false).expect("a first fragment");
        let slot = SlotId::new(1, 0).expect("a valid index");
        let past = feed(&mut core, |enc| {
            enc.push_data(slot, FrameSeq(2), &[6u8; 600], false)
        });
        let too_large = ProtocolError::RecordTooLarge {
            slot,
            len: 1200,
            max: 1000,
        };
        assert_eq!(past, Err(too_large));
        core.fail_all(ended(1));
        assert_eq!(control.peer_held.load(Ordering::Acquire), 0);
    }

    /// A reassembled record with much room to spare is held at its length.
    #[test]
    fn a_reassembled_record_is_held_at_its_length() {
        let mut grown = vec![1u8; 1000];
        grown.reserve_exact(1000);
        grown.extend_from_slice(&[2u8; 100]);
        let at = grown.as_ptr();
        let record = reassembled(grown);
        assert_eq!(record.len(), 1100);
        assert_ne!(record.as_ptr(), at, "copied to its length");
        let mut snug = Vec::with_capacity(1100);
        snug.extend_from_slice(&[3u8; 1050]);
        let at = snug.as_ptr();
        assert_eq!(reassembled(snug).as_ptr(), at, "kept: little to spare");
    }

    /// A record the peer leaves reassembling, its last fragment never sent,
    /// pins at most an eighth more than its length, which is what its
    /// stream's and the peer's credit count; a message likewise.
    #[test]
    fn a_record_left_reassembling_pins_about_its_length() {
        let mut core = credited_core();
        let slot = SlotId::new(1, 0).expect("a valid index");
        let fragment = vec![5u8; 1500];
        feed(&mut core, |enc| {
            enc.push_open(slot, FrameSeq(0), 7, 1)?;
            enc.push_data(slot, FrameSeq(1), &fragment, true)
        })
        .expect("a first fragment");
        for message_seq in 0..98 {
            feed(&mut core, |enc| {
                enc.push_data(slot, FrameSeq(message_seq + 2), &fragment, true)?;
                enc.push_message(FrameSeq(message_seq), &fragment, true)
            })
            .expect("fragments within the window");
            let partial = core.ingress[&1].reassembly.as_ref().expect("reassembling");
            assert!(
                partial.capacity() <= partial.len() + partial.len() / 8,
                "{} pinned for {}",
                partial.capacity(),
                partial.len()
            );
            let message = core.message_reassembly.as_ref().expect("reassembling");
            assert!(message.capacity() <= message.len() + message.len() / 8);
        }
    }

    #[tokio::test]
    async fn a_new_epoch_grants_only_the_room_earlier_epochs_streams_left() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut first = held_core(Epoch(1), &control, &registry, Held::default());
        // Closed and unread, then live at the epoch's death with a record
        // still reassembling (which dies with the epoch).
        peer_sends(&mut first, 1, 1, 3000, false, true).expect("within the window");
        peer_sends(&mut first, 2, 2, 2000, false, false).expect("within the window");
        peer_sends(&mut first, 3, 3, 1000, true, false).expect("within the window");
        // Two whole records, each with its overhead, and a fragment.
        let whole = (5000 + 2 * RECORD_OVERHEAD) as u64;
        assert_eq!(first.peer_outstanding(), whole + 1000);
        assert_eq!(control.peer_held.load(Ordering::Acquire), whole + 1000);
        assert_eq!(
            control.peer_committed.load(Ordering::Acquire),
            8192,
            "held plus what the live epoch may still receive"
        );
        first.fail_all(ended(1));
        assert_eq!(
            control.peer_held.load(Ordering::Acquire),
            whole,
            "what the next hello leaves out"
        );
        assert_eq!(control.counters.snapshot().peer_held_bytes, whole);
        assert_eq!(control.peer_committed.load(Ordering::Acquire), whole);

        let mut second = held_core(Epoch(2), &control, &registry, first.take_held());
        assert_eq!(second.peer_outstanding(), whole);
        let room = 8192 - whole as usize;
        second.set_peer_terms(
            PeerTerms::announced_by(&second.config),
            room as u32,
            Instant::now(),
        );
        assert!(
            next_batch(&mut second).is_empty(),
            "the hello granted it all"
        );
        peer_sends(&mut second, 1, 4, room - RECORD_OVERHEAD, false, true)
            .expect("within the room");
        assert_eq!(
            peer_sends(&mut second, 2, 5, 1, false, false),
            Err(ProtocolError::PeerCreditOverrun {
                outstanding: 8192,
                len: 1,
                cost: 1 + RECORD_OVERHEAD as u64,
                window: 8192,
            }),
            "the room left, not a fresh window"
        );
    }

    #[tokio::test]
    async fn what_a_consumer_takes_from_an_earlier_epoch_comes_back_in_the_next() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut first = held_core(Epoch(1), &control, &registry, Held::default());
        peer_sends(&mut first, 1, 1, 3000, false, true).expect("within the window");
        peer_sends(&mut first, 2, 2, 2000, false, false).expect("within the window");
        first.fail_all(ended(1));
        let held = 5000 + 2 * RECORD_OVERHEAD;
        let mut second = held_core(Epoch(2), &control, &registry, first.take_held());
        second.set_peer_terms(
            PeerTerms::announced_by(&second.config),
            (8192 - held) as u32,
            Instant::now(),
        );

        let mut closed = registry.bind(StreamKey::new(7, 1)).expect("bind");
        assert_eq!(closed.try_recv(), Ok(Frame::Data(vec![5u8; 3000].into())));
        assert_eq!(closed.try_recv(), Ok(Frame::Finalized));
        let mut dropped = registry.bind(StreamKey::new(7, 2)).expect("bind");
        assert_eq!(dropped.try_recv(), Ok(Frame::Data(vec![5u8; 2000].into())));
        assert_eq!(dropped.try_recv(), Ok(Frame::Dropped(ended(1))));
        second.handle_control(Instant::now());
        assert_eq!(second.peer_outstanding(), 0);
        assert_eq!(control.peer_held.load(Ordering::Acquire), 0);
        assert_eq!(next_batch(&mut second), [format!("PeerCredit({held})")]);
    }

    /// Room a consumer frees between our hello and the epoch's start is
    /// granted at once, whatever the flush policy.
    #[tokio::test]
    async fn room_freed_after_the_hello_is_the_epochs_first_batch() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut first = held_core(Epoch(1), &control, &registry, Held::default());
        peer_sends(&mut first, 1, 1, 3000, false, true).expect("within the window");
        first.fail_all(ended(1));
        let mut rx = registry.bind(StreamKey::new(7, 1)).expect("bind");
        assert!(rx.try_recv().is_ok() && rx.try_recv().is_ok(), "read whole");
        let mut second = held_core(Epoch(2), &control, &registry, first.take_held());
        let manual = FlushPolicy::Manual {
            reply_linger: std::time::Duration::from_secs(3600),
        };
        second.config = Arc::new(MuxConfig {
            flush: manual,
            ..(*second.config).clone()
        });
        // The hello gave the window less the record (written before the
        // read).
        let held = 3000 + RECORD_OVERHEAD;
        second.set_peer_terms(
            PeerTerms::announced_by(&second.config),
            (8192 - held) as u32,
            Instant::now(),
        );
        assert!(second.wants_write(Instant::now()));
        assert_eq!(next_batch(&mut second), [format!("PeerCredit({held})")]);
    }

    /// Under a manual flush policy, a flush that finds the slot short of
    /// peer credit (the epoch started at 0: its hello replaced a live one)
    /// stays pending, and the record goes out when the grant comes.
    #[tokio::test]
    async fn a_manual_flush_that_meets_no_peer_credit_holds_until_the_grant() {
        let mut core = manual_core();
        let window = core.config.peer_window;
        let terms = PeerTerms {
            peer_credit: 0,
            ..PeerTerms::announced_by(&core.config)
        };
        core.set_peer_terms(terms, window, Instant::now());
        let mut tx = open(&core, 1);
        tx.send(Bytes::from_static(b"one")).await.expect("queued");
        core.control.request_flush();
        core.handle_control(Instant::now());
        assert!(core.wants_write(Instant::now()));
        assert_eq!(
            next_batch(&mut core),
            ["open 1 seq 0"],
            "no peer credit yet"
        );
        core.batch_posted();
        feed(&mut core, |enc| enc.push_peer_credit(window)).expect("within the window");
        assert!(core.wants_write(Instant::now()), "the flush still stands");
        assert_eq!(next_batch(&mut core), ["data b\"one\" seq 1"]);
    }

    /// A record cut short by the receiver (its consumer left mid-record)
    /// took all of itself from peer credit as it started; the unsent rest
    /// comes back, so cancelled transfers do not shrink the window for good.
    #[tokio::test]
    async fn a_record_the_receiver_cut_short_returns_its_unsent_peer_credit() {
        let mut core = credited_core();
        let full = i64::from(core.config.peer_window);
        assert_eq!(core.peer_credit, full);
        let mut tx = open(&core, 1);
        tx.send(Bytes::from(vec![1u8; 10_000]))
            .await
            .expect("queued");
        core.handle_control(Instant::now());
        let batch = next_batch(&mut core);
        assert_eq!(batch.len(), 2, "the Open and a first fragment: {batch:?}");
        core.batch_posted();
        let sent = core.counters.snapshot().data_bytes_sent as i64;
        assert!(0 < sent && sent < 10_000);
        assert_eq!(
            core.peer_credit,
            full - record_cost(10_000) as i64,
            "taken whole as it started"
        );
        let slot = SlotId::new(0, 0).expect("the first slot");
        feed(&mut core, |enc| {
            enc.push_close(slot, FrameSeq(0), CloseReason::ReceiverGone)
        })
        .expect("a close for our slot");
        assert_eq!(
            core.peer_credit,
            full - sent,
            "only what reached the peer stays out"
        );
    }

    /// The peer closing our last slot starts the idle clock, as our own last
    /// close does: the epoch retires `idle_retire` after the close, not at
    /// once because the slot sat quiet that long.
    #[tokio::test(start_paused = true)]
    async fn the_peer_closing_our_last_slot_starts_the_idle_clock() {
        let mut core = credited_core();
        let _tx = open(&core, 1);
        core.handle_control(Instant::now());
        assert_eq!(next_batch(&mut core).len(), 1, "the Open");
        core.batch_posted();
        assert_eq!(core.idle_since(), None, "a live slot");
        tokio::time::advance(core.config.idle_retire * 2).await;
        let closed_at = Instant::now();
        let slot = SlotId::new(0, 0).expect("the first slot");
        feed(&mut core, |enc| {
            enc.push_close(slot, FrameSeq(0), CloseReason::ReceiverGone)
        })
        .expect("a close for our slot");
        assert_eq!(core.idle_since(), Some(closed_at));
    }

    /// Empty records cost their overhead on the receiving side too: a peer
    /// cannot queue them past the slot window. The peer window, 128 times
    /// larger, is left far behind (`hostile_peer` tests that one).
    #[tokio::test]
    async fn empty_records_are_bounded_by_the_slot_window() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let config = MuxConfig {
            slot_window: 8192,
            peer_window: 1 << 20,
            ..MuxConfig::default()
        };
        let mut core = PeerCore::new(
            Epoch(1),
            Arc::new(config),
            control,
            registry,
            Held::default(),
            Instant::now(),
        );
        let slot = SlotId::new(0, 0).expect("a valid index");
        let mut seq = 0u32;
        let outcome = (0..10).try_for_each(|_| {
            feed(&mut core, |enc| {
                if seq == 0 {
                    enc.push_open(slot, FrameSeq(0), 7, 1)?;
                    seq = 1;
                }
                for _ in 0..1000 {
                    enc.push_data(slot, FrameSeq(seq), &[], false)?;
                    seq += 1;
                }
                Ok(())
            })
        });
        assert!(
            matches!(
                outcome,
                Err(ProtocolError::CreditOverrun {
                    outstanding: 8192,
                    window: 8192,
                    ..
                })
            ),
            "128 records of 64 fill the window, the next one dies: {outcome:?}"
        );
    }

    /// Data for a slot the receiver has no state for is counted as its
    /// sender counted it, fragments and all (the overhead on the last
    /// fragment), and all of it comes back as peer credit.
    #[tokio::test]
    async fn a_fragmented_record_for_an_unknown_slot_comes_back_as_its_sender_counted_it() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut core = held_core(Epoch(1), &control, &registry, Held::default());
        let unknown = SlotId::new(9, 0).expect("a valid index");
        let fragments = [
            (1, &[1u8; 700][..], true, 700),
            (2, &[2u8; 300][..], false, 300 + RECORD_OVERHEAD),
        ];
        for (seq, body, more, counted) in fragments {
            feed(&mut core, |enc| {
                enc.push_data(unknown, FrameSeq(seq), body, more)
            })
            .expect("dropped, not an offence");
            let returned = next_batch(&mut core)
                .iter()
                .filter_map(|r| r.strip_prefix("PeerCredit(")?.strip_suffix(')'))
                .map(|n| n.parse::<usize>().expect("a number"))
                .sum::<usize>();
            assert_eq!(returned, counted, "fragment {seq}");
        }
        assert_eq!(core.peer_outstanding(), 0);
    }

    /// A record for a stale generation of an index whose live slot's
    /// consumer just left is answered beside that slot's close, not in its
    /// place (review 40a): both closes are owed at once.
    #[tokio::test]
    async fn a_stale_generations_reply_does_not_replace_the_live_slots_close() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut core = held_core(Epoch(1), &control, &registry, Held::default());
        let live = SlotId::new(0, 4).expect("a valid index");
        let stale = SlotId::new(0, 3).expect("a valid index");
        open_then_consumer_leaves(&mut core, &registry, live);
        stray_record(&mut core, stale);
        assert_eq!(
            owed_closes(&mut core),
            [
                (stale, CloseReason::UnknownSlot),
                (live, CloseReason::ReceiverGone)
            ]
        );
    }

    /// Replies to unknown slots past the slot limit are counted, not kept:
    /// a peer that lets us write nothing cannot grow what we owe it.
    #[tokio::test]
    async fn replies_past_the_slot_limit_are_counted_untold() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let config = MuxConfig {
            max_slots_per_peer: 2,
            ..MuxConfig::default()
        };
        let mut core = PeerCore::new(
            Epoch(1),
            Arc::new(config),
            control.clone(),
            registry,
            Held::default(),
            Instant::now(),
        );
        for index in 0..5 {
            stray_record(&mut core, SlotId::new(index, 0).expect("a valid index"));
        }
        let stats = core.counters.snapshot();
        assert_eq!((stats.drops.unknown_slot, stats.closes_untold), (5, 3));
        assert_eq!(owed_closes(&mut core).len(), 2);
    }

    /// A new generation's open makes the closes owed for the index's older
    /// generations moot: they are not written.
    #[tokio::test]
    async fn an_open_of_a_new_generation_drops_the_closes_owed_for_older_ones() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut core = held_core(Epoch(1), &control, &registry, Held::default());
        let old = SlotId::new(0, 4).expect("a valid index");
        let new = SlotId::new(0, 5).expect("a valid index");
        let other = SlotId::new(1, 9).expect("a valid index");
        open_then_consumer_leaves(&mut core, &registry, old);
        stray_record(&mut core, other);
        feed(&mut core, |enc| enc.push_open(new, FrameSeq(0), 7, 2)).expect("an open");
        assert_eq!(
            owed_closes(&mut core),
            [(other, CloseReason::UnknownSlot)],
            "generation 4's close went with its index's reuse"
        );
    }

    /// The peer opens `slot` for key (7, 1), whose consumer then leaves: a
    /// `ReceiverGone` is owed for it.
    fn open_then_consumer_leaves(core: &mut PeerCore, registry: &Arc<Registry>, slot: SlotId) {
        let rx = registry.bind(StreamKey::new(7, 1)).expect("bind");
        feed(core, |enc| enc.push_open(slot, FrameSeq(0), 7, 1)).expect("an open");
        drop(rx);
        core.handle_control(Instant::now());
    }

    /// A record for `slot`, which the core does not know: dropped, and an
    /// `UnknownSlot` owed.
    fn stray_record(core: &mut PeerCore, slot: SlotId) {
        feed(core, |enc| enc.push_data(slot, FrameSeq(1), b"?", false))
            .expect("dropped, not an offence");
    }

    /// The closes in the core's next batch, with their slots.
    fn owed_closes(core: &mut PeerCore) -> Vec<(SlotId, CloseReason)> {
        let mut buf = vec![0u8; 4096];
        let len = core.poll_batch(&mut buf, Instant::now());
        let view = BatchView::new_checked(&buf[..len]).expect("the core writes valid batches");
        view.records()
            .filter_map(|r| match r.body {
                RecordBody::Close(reason) => Some((r.slot, reason)),
                _ => None,
            })
            .collect()
    }

    /// An empty fragment is only ever a whole empty record.
    #[tokio::test]
    async fn an_empty_fragment_inside_a_record_is_a_protocol_error() {
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut core = held_core(Epoch(1), &control, &registry, Held::default());
        let slot = SlotId::new(0, 0).expect("a valid index");
        let outcome = feed(&mut core, |enc| {
            enc.push_open(slot, FrameSeq(0), 7, 1)?;
            enc.push_data(slot, FrameSeq(1), &[], true)
        });
        assert_eq!(outcome, Err(ProtocolError::BrokenFragment { slot }));
    }

    /// The same for messages: a peer cannot spin the task on empty pieces
    /// of one (review 40a). A whole empty message is a message.
    #[tokio::test]
    async fn an_empty_message_fragment_is_a_protocol_error() {
        let zero = SlotId::from_wire(0);
        for (name, pieces) in [
            ("an empty first piece", &[(&[][..], true)][..]),
            (
                "an empty middle piece",
                &[(&[1u8; 8][..], true), (&[], true)],
            ),
            (
                "an empty last piece",
                &[(&[1u8; 8][..], true), (&[], false)],
            ),
        ] {
            let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
            let mut core = held_core(Epoch(1), &control, &registry, Held::default());
            let outcome = feed(&mut core, |enc| {
                for (seq, (body, more)) in pieces.iter().enumerate() {
                    enc.push_message(FrameSeq(seq as u32), body, *more)?;
                }
                Ok(())
            });
            assert_eq!(
                outcome,
                Err(ProtocolError::BrokenFragment { slot: zero }),
                "{name}"
            );
        }
        let (control, registry) = (peer_control(), Registry::new(8192, 16, 16));
        let mut core = held_core(Epoch(1), &control, &registry, Held::default());
        feed(&mut core, |enc| enc.push_message(FrameSeq(0), &[], false))
            .expect("a whole empty message is no offence");
    }

    /// An empty record a producer sends takes its overhead of slot budget,
    /// so a producer of empty records meets backpressure too.
    #[tokio::test]
    async fn empty_records_fill_the_slot_budget() {
        let core = core();
        let budget = 16 * RECORD_OVERHEAD;
        let inlet = Inlet::new(StreamKey::new(7, 1), core.control.clone(), budget, 1 << 20);
        assert!(core.control.admit_egress(16));
        assert!(inlet.announce());
        let mut tx = SlotSender::new(inlet);
        for _ in 0..16 {
            tx.send(Bytes::new()).await.expect("within the budget");
        }
        let seventeenth =
            tokio::time::timeout(std::time::Duration::from_millis(50), tx.send(Bytes::new())).await;
        assert!(seventeenth.is_err(), "the budget is full");
    }

    /// A batch buffer smaller than `MIN_FRAGMENT` still carries records:
    /// the rule only keeps a batch that already holds one from starting a
    /// record with little room.
    #[tokio::test]
    async fn a_small_batch_buffer_still_starts_records() {
        let mut core = credited_core();
        let mut tx = open(&core, 1);
        tx.send(Bytes::from(vec![3u8; 300])).await.expect("queued");
        core.handle_control(Instant::now());
        let mut buf = vec![0u8; 128];
        let mut batches = 0;
        let mut data = 0;
        while core.wants_write(Instant::now()) && batches < 100 {
            let len = core.poll_batch(&mut buf, Instant::now());
            assert!(len > 0, "a batch that wants writing writes");
            core.batch_posted();
            let view = BatchView::new_checked(&buf[..len]).expect("valid");
            data += view
                .records()
                .map(|r| match r.body {
                    RecordBody::Data(d) => d.len(),
                    _ => 0,
                })
                .sum::<usize>();
            batches += 1;
        }
        assert_eq!(data, 300, "the record went out in {batches} batches");
    }

    /// A record sent in fragments takes its cost from slot credit once: its
    /// bytes, and the overhead with the last fragment, as the receiver
    /// counts it.
    #[tokio::test]
    async fn a_fragmented_record_takes_its_cost_from_slot_credit_once() {
        let mut core = credited_core();
        let window = i64::from(core.config.slot_window);
        let mut tx = open(&core, 1);
        tx.send(Bytes::from(vec![3u8; 300])).await.expect("queued");
        core.handle_control(Instant::now());
        let mut buf = vec![0u8; 128];
        let (mut fragments, mut batches, mut expected) = (0, 0, window);
        while core.wants_write(Instant::now()) && batches < 100 {
            let len = core.poll_batch(&mut buf, Instant::now());
            core.batch_posted();
            let view = BatchView::new_checked(&buf[..len]).expect("valid");
            for r in view.records() {
                if let RecordBody::Data(d) = r.body {
                    fragments += 1;
                    expected -= fragment_cost(d.len(), !r.more) as i64;
                }
            }
            let slot = core.table[0].slot.as_ref().expect("still open");
            assert_eq!(slot.credit, expected, "after batch {batches}");
            batches += 1;
        }
        assert!(fragments > 1, "{fragments} fragments");
        assert_eq!(expected, window - record_cost(300) as i64);
    }

    /// A core under a manual flush whose peer grants 1 KiB per slot, with
    /// one flush written: the Open and two of three 600-byte records; the
    /// third waits for slot credit.
    async fn a_flush_short_of_slot_credit() -> (PeerCore, SlotSender) {
        let mut core = manual_core();
        let terms = PeerTerms {
            slot_window: 1024,
            ..PeerTerms::announced_by(&core.config)
        };
        core.set_peer_terms(terms, core.config.peer_window, Instant::now());
        let mut tx = open(&core, 1);
        for byte in [1u8, 2, 3] {
            tx.send(Bytes::from(vec![byte; 600])).await.expect("queued");
        }
        core.control.request_flush();
        core.handle_control(Instant::now());
        let first = next_batch(&mut core);
        assert_eq!(first.len(), 3, "the Open and two records: {first:?}");
        core.batch_posted();
        (core, tx)
    }

    /// Under a manual flush, records a flush found short of slot credit go
    /// when the grant comes, without another flush.
    #[tokio::test]
    async fn a_manual_flush_that_meets_no_slot_credit_holds_until_the_grant() {
        let (mut core, _tx) = a_flush_short_of_slot_credit().await;
        assert!(
            !core.wants_write(Instant::now()),
            "the third waits for credit"
        );
        // Queued after the flush on another slot: it waits for the next one.
        let mut later = open(&core, 2);
        later
            .send(Bytes::from_static(b"later"))
            .await
            .expect("queued");
        core.handle_control(Instant::now());
        let slot = SlotId::new(0, 0).expect("the first slot");
        feed(&mut core, |enc| enc.push_credit(slot, 1024)).expect("within the window");
        assert!(core.wants_write(Instant::now()), "the flush carries on");
        let second = next_batch(&mut core);
        let data: Vec<&String> = second.iter().filter(|r| r.starts_with("data")).collect();
        assert_eq!(data.len(), 1, "the third record only");
        assert!(data[0].starts_with("data b\"\\x03"), "{second:?}");
        core.batch_posted();
        assert!(next_batch(&mut core).is_empty(), "the later slot waits");
        core.control.request_flush();
        core.handle_control(Instant::now());
        let third = next_batch(&mut core);
        assert!(
            third.iter().any(|r| r.starts_with("data b\"later\"")),
            "{third:?}"
        );
    }

    /// A record many batches long takes turns with the other ready slots:
    /// a small record queued behind it goes in the next batch, not after it.
    #[tokio::test]
    async fn a_long_record_takes_turns_with_other_slots() {
        let mut core = credited_core();
        let mut long = open(&core, 1);
        let mut short = open(&core, 2);
        long.send(Bytes::from(vec![1u8; 40_000]))
            .await
            .expect("queued");
        short
            .send(Bytes::from_static(b"small"))
            .await
            .expect("queued");
        core.handle_control(Instant::now());
        let mut batches = Vec::new();
        for _ in 0..3 {
            batches.push(next_batch(&mut core));
            core.batch_posted();
        }
        assert!(
            batches
                .concat()
                .iter()
                .any(|r| r.starts_with("data b\"small\"")),
            "{batches:?}"
        );
    }

    fn message(len: usize) -> OutboundMessage {
        OutboundMessage {
            body: Bytes::from(vec![7u8; len]),
            on_fail: None,
        }
    }

    /// Slots `sessions`, each with one record of `len` bytes of its session
    /// number queued, then `messages` messages of 40,000 bytes (ten batches
    /// each): both kinds wait, each enough to fill every batch.
    async fn records_and_long_messages(
        core: &mut PeerCore,
        sessions: std::ops::RangeInclusive<u8>,
        len: usize,
        messages: usize,
    ) -> Vec<SlotSender> {
        let mut senders = Vec::new();
        for session in sessions {
            let mut tx = open(core, u64::from(session));
            tx.send(Bytes::from(vec![session; len]))
                .await
                .expect("queued");
            senders.push(tx);
        }
        core.handle_control(Instant::now());
        for _ in 0..messages {
            core.handle_message(message(40_000), Instant::now());
        }
        senders
    }

    fn has_message(batch: &[String]) -> bool {
        batch.iter().any(|r| r.starts_with("Message("))
    }

    /// A flow of messages that fills every batch does not hold slot data
    /// back: the two take turns to go first.
    #[tokio::test]
    async fn a_flood_of_messages_does_not_hold_slot_data_back() {
        let mut core = credited_core();
        let mut tx = open(&core, 1);
        tx.send(Bytes::from_static(b"small")).await.expect("queued");
        core.handle_control(Instant::now());
        // Each fills every batch it is in, to the last byte.
        for _ in 0..2 {
            core.handle_message(message(40_000), Instant::now());
        }
        let first = next_batch(&mut core);
        core.batch_posted();
        let second = next_batch(&mut core);
        core.batch_posted();
        assert!(
            has_message(&first) && has_message(&second),
            "{first:?} {second:?}"
        );
        assert!(
            [first, second]
                .concat()
                .iter()
                .any(|r| r.starts_with("data b\"small\"")),
            "the record waited behind the messages"
        );
    }

    /// Slot data that fills every batch does not hold messages back either,
    /// and the turn passes back and forth while both wait.
    #[tokio::test]
    async fn slot_data_that_fills_every_batch_does_not_hold_messages_back() {
        let mut core = credited_core();
        let _senders = records_and_long_messages(&mut core, 1..=8, 4000, 2).await;
        let mut batches = Vec::new();
        for _ in 0..6 {
            batches.push(next_batch(&mut core));
            core.batch_posted();
        }
        let with_messages = batches.iter().filter(|b| has_message(b)).count();
        let with_data = batches
            .iter()
            .filter(|b| b.iter().any(|r| r.starts_with("data")))
            .count();
        assert!(with_messages >= 3 && with_data >= 3, "{batches:?}");
    }

    /// Batches that messages fill to the last byte do not cost a slot its
    /// turn: with two long records and long messages, both slots send.
    #[tokio::test]
    async fn every_slot_keeps_its_turn_beside_messages_that_fill_batches() {
        let mut core = credited_core();
        let _senders = records_and_long_messages(&mut core, 1..=2, 40_000, 2).await;
        let mut written = Vec::new();
        for _ in 0..8 {
            written.extend(next_batch(&mut core));
            core.batch_posted();
        }
        for byte in ["\\x01", "\\x02"] {
            assert!(
                written
                    .iter()
                    .any(|r| r.starts_with(&format!("data b\"{byte}"))),
                "no data from the slot of {byte}: {written:?}"
            );
        }
    }

    /// A record or message larger than the peer's `max_record` (the peer
    /// would end the epoch on it) is refused here: a record queued before
    /// the peer's terms were heard closes its stream with `TooLarge`, the
    /// message is reported to its sender, neither is written.
    #[tokio::test]
    async fn a_record_or_message_past_the_peers_max_record_is_refused_here() {
        let mut core = core();
        let mut tx = open(&core, 1);
        tx.send(Bytes::from(vec![1u8; 1001]))
            .await
            .expect("queued: no peer limit heard yet, our own is larger");
        let terms = PeerTerms {
            max_record: 1000,
            ..PeerTerms::announced_by(&core.config)
        };
        core.set_peer_terms(terms, core.config.peer_window, Instant::now());
        let reports = Arc::new(AtomicUsize::new(0));
        let mut big = counted(&reports);
        big.body = Bytes::from(vec![2u8; 1001]);
        core.handle_message(big, Instant::now());
        assert_eq!(reports.load(Ordering::SeqCst), 1, "reported at once");
        core.handle_message(message(1000), Instant::now());
        core.handle_control(Instant::now());
        let mut written = Vec::new();
        for _ in 0..3 {
            written.extend(next_batch(&mut core));
            core.batch_posted();
        }
        assert!(
            !written.iter().any(|r| r.starts_with("data")),
            "{written:?}"
        );
        assert!(
            written.iter().any(|r| r.starts_with("close TooLarge")),
            "the receiver hears why: {written:?}"
        );
        assert_eq!(
            written.iter().filter(|r| r.starts_with("Message(")).count(),
            1,
            "only the message that fits"
        );
        assert_eq!(
            tx.send(Bytes::from_static(b"x")).await,
            Err(SendError::TooLarge {
                len: 1001,
                max: 1000
            })
        );
        assert_eq!(core.counters.snapshot().messages_too_large, 1);
    }

    /// A stream already ended `TooLarge`, its close not yet written when
    /// the epoch dies, is not counted among the slots dropped: its producer
    /// had its one terminal (review 48d).
    #[tokio::test]
    async fn a_stream_ended_too_large_is_not_counted_dropped_with_its_epoch() {
        let mut core = core();
        let mut tx = open(&core, 1);
        tx.send(Bytes::from(vec![1u8; 1001]))
            .await
            .expect("queued: no peer limit heard yet");
        let terms = PeerTerms {
            max_record: 1000,
            ..PeerTerms::announced_by(&core.config)
        };
        core.set_peer_terms(terms, core.config.peer_window, Instant::now());
        core.handle_control(Instant::now());
        // A batch with room for the Open but not the close that follows.
        let mut buf = vec![0u8; 48];
        let len = core.poll_batch(&mut buf, Instant::now());
        let view = BatchView::new_checked(&buf[..len]).expect("valid");
        let written: Vec<_> = view.records().map(|r| format!("{:?}", r.body)).collect();
        assert!(
            written.iter().all(|r| !r.starts_with("Close")),
            "{written:?}"
        );
        let ended = tx.send(Bytes::from_static(b"x")).await;
        assert!(
            matches!(ended, Err(SendError::TooLarge { .. })),
            "{ended:?}"
        );
        core.fail_all(DropReason::EpochEnded { epoch: Epoch(1) });
        assert_eq!(core.counters.snapshot().slots_dropped, 0);
    }

    /// Once the peer's terms are heard, a record past its `max_record` is
    /// refused at `send`, and the stream stays open: its sender can still
    /// say why, or go on with records that fit.
    #[tokio::test]
    async fn a_record_past_the_peers_limit_heard_is_refused_at_send_and_the_stream_lives() {
        let mut core = core();
        let terms = PeerTerms {
            max_record: 1000,
            ..PeerTerms::announced_by(&core.config)
        };
        core.set_peer_terms(terms, core.config.peer_window, Instant::now());
        let mut tx = open(&core, 1);
        assert_eq!(
            tx.send(Bytes::from(vec![1u8; 1001])).await,
            Err(SendError::TooLarge {
                len: 1001,
                max: 1000
            })
        );
        tx.send(Bytes::from(vec![2u8; 1000]))
            .await
            .expect("one that fits goes");
        core.handle_control(Instant::now());
        let batch = next_batch(&mut core);
        assert_eq!(
            batch.iter().filter(|r| r.starts_with("data")).count(),
            1,
            "{batch:?}"
        );
        assert!(!batch.iter().any(|r| r.starts_with("close")), "{batch:?}");
    }

    /// A peer whose `max_record` is 0 takes records of 0 and 1 byte (0 acts
    /// as 1 on both ends), and nothing longer.
    #[tokio::test]
    async fn a_max_record_of_zero_acts_as_one() {
        let mut core = core();
        let mut tx = open(&core, 1);
        for record in [&b""[..], b"x", b"xy"] {
            tx.send(Bytes::copy_from_slice(record))
                .await
                .expect("queued");
        }
        let terms = PeerTerms {
            max_record: 0,
            ..PeerTerms::announced_by(&core.config)
        };
        core.set_peer_terms(terms, core.config.peer_window, Instant::now());
        core.handle_control(Instant::now());
        let batch = next_batch(&mut core);
        let data = batch.iter().filter(|r| r.starts_with("data")).count();
        assert_eq!(data, 2, "{batch:?}");
        assert!(batch.iter().any(|r| r.starts_with("close")), "{batch:?}");
    }

    /// Short streams one after another do not bring a slot id back soon: a
    /// late close or grant for an earlier stream cannot land on a live one.
    #[tokio::test]
    async fn slot_ids_come_back_only_after_many_streams() {
        let mut core = credited_core();
        let mut seen = std::collections::HashSet::new();
        for session in 0..600 {
            let mut tx = open(&core, session);
            tx.send(Bytes::from_static(b"x")).await.expect("queued");
            tx.finish(Terminal::Finalized).expect("finish");
            core.handle_control(Instant::now());
            let mut buf = vec![0u8; 4096];
            let len = core.poll_batch(&mut buf, Instant::now());
            core.batch_posted();
            let view = BatchView::new_checked(&buf[..len]).expect("valid");
            let opened: Vec<SlotId> = view
                .records()
                .filter(|r| matches!(r.body, RecordBody::Open { .. }))
                .map(|r| r.slot)
                .collect();
            assert_eq!(opened.len(), 1);
            assert!(
                seen.insert(opened[0]),
                "stream {session} reused {:?}",
                opened[0]
            );
            assert_eq!(core.live_slots(), 0, "its terminal is out");
        }
        assert!(core.table.len() <= 1 + REUSE_AFTER, "the table stays small");
    }

    #[tokio::test]
    async fn on_shutdown_a_slot_whose_open_never_left_is_dropped() {
        let mut dying = core();
        let mut tx = open(&dying, 4);
        dying.handle_control(Instant::now());
        dying.fail_all(DropReason::Shutdown);
        assert_eq!(dying.counters.snapshot().slots_dropped, 1);
        assert_eq!(
            tx.send(Bytes::from_static(b"late")).await,
            Err(SendError::Dropped(DropReason::Shutdown))
        );
    }

    fn counted(reports: &Arc<AtomicUsize>) -> OutboundMessage {
        let reports = reports.clone();
        OutboundMessage {
            body: Bytes::from_static(b"hello"),
            on_fail: Some(Box::new(move |_| {
                reports.fetch_add(1, Ordering::SeqCst);
            })),
        }
    }

    #[test]
    fn a_message_in_a_batch_whose_post_failed_is_reported_once() {
        let reports = Arc::new(AtomicUsize::new(0));
        let mut core = core();
        core.handle_message(counted(&reports), Instant::now());
        let mut buf = vec![0u8; 4096];
        assert!(core.poll_batch(&mut buf, Instant::now()) > 0);
        // No batch_posted: the post failed and the epoch ends.
        core.fail_all(DropReason::EpochEnded { epoch: Epoch(1) });
        assert_eq!(reports.load(Ordering::SeqCst), 1);
        drop(core);
        assert_eq!(reports.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_posted_message_is_not_reported() {
        let reports = Arc::new(AtomicUsize::new(0));
        let mut core = core();
        core.handle_message(counted(&reports), Instant::now());
        let mut buf = vec![0u8; 4096];
        assert!(core.poll_batch(&mut buf, Instant::now()) > 0);
        core.batch_posted();
        core.fail_all(DropReason::EpochEnded { epoch: Epoch(1) });
        drop(core);
        assert_eq!(reports.load(Ordering::SeqCst), 0);
    }

    /// A Pong answers a Ping this epoch wrote, none other: one for a nonce
    /// never sent would answer every ping up to it before it is asked, so a
    /// health check would hear a peer long gone.
    #[tokio::test]
    async fn a_pong_for_a_ping_never_written_is_a_violation() {
        let mut core = credited_core();
        let unasked = feed(&mut core, |enc| enc.push_pong(u64::MAX));
        assert!(
            matches!(
                unasked,
                Err(ProtocolError::UnaskedPong {
                    nonce: u64::MAX,
                    asked: 0
                })
            ),
            "{unasked:?}"
        );

        let mut core = credited_core();
        let control = core.control.clone();
        let ping = tokio::spawn(async move { control.ping().await });
        tokio::task::yield_now().await;
        core.handle_control(Instant::now());
        assert_eq!(next_batch(&mut core), vec!["Ping(1)".to_string()]);
        // The next nonce is not asked yet: answering it ahead is a lie too.
        let ahead = feed(&mut core, |enc| enc.push_pong(2));
        assert!(
            matches!(
                ahead,
                Err(ProtocolError::UnaskedPong { nonce: 2, asked: 1 })
            ),
            "{ahead:?}"
        );

        drop(ping);
        let mut core = credited_core();
        let control = core.control.clone();
        let ping = tokio::spawn(async move { control.ping().await });
        tokio::task::yield_now().await;
        core.handle_control(Instant::now());
        assert_eq!(next_batch(&mut core), vec!["Ping(1)".to_string()]);
        feed(&mut core, |enc| enc.push_pong(1)).expect("the answer to our ping");
        tokio::time::timeout(std::time::Duration::from_secs(5), ping)
            .await
            .expect("the ping is answered")
            .expect("the ping task");
    }

    /// A slot the peer closes while it waits, ready, for a manual flush
    /// leaves nothing behind that keeps the peer from reading as quiet.
    #[tokio::test]
    async fn a_slot_the_peer_closes_while_it_waits_for_a_flush_leaves_the_core_quiet() {
        let mut core = manual_core();
        credit_whole_window(&mut core);
        let mut tx = open(&core, 1);
        tx.send(Bytes::from_static(b"first")).await.expect("queued");
        core.control.request_flush();
        core.handle_control(Instant::now());
        assert_eq!(next_batch(&mut core).len(), 2, "the Open and the record");
        core.batch_posted();
        tx.send(Bytes::from_static(b"waits")).await.expect("queued");
        core.handle_control(Instant::now());
        assert!(next_batch(&mut core).is_empty(), "it waits for a flush");
        assert!(!core.is_quiet());
        let slot = SlotId::new(0, 0).expect("the first slot");
        feed(&mut core, |enc| {
            enc.push_close(slot, FrameSeq(0), CloseReason::ReceiverGone)
        })
        .expect("the peer's consumer left");
        // A write that takes only what a flush is owed looks at the ready
        // list once, as the driver's next turn does.
        assert!(next_batch(&mut core).is_empty());
        assert!(core.is_quiet(), "nothing left to write");
    }

    /// The peer may close a slot before its Open went; a slot reusing the
    /// index then has it owed twice, and its Open still goes once.
    #[tokio::test]
    async fn an_open_owed_twice_under_a_reused_index_goes_once() {
        let mut core = credited_core();
        // A live slot keeps the lists from being cleared as empty of any.
        let mut keeper = open(&core, 1);
        keeper.send(Bytes::from_static(b"k")).await.expect("queued");
        let _first = open(&core, 2);
        core.handle_control(Instant::now());
        let slot = SlotId::new(1, 0).expect("the second slot");
        feed(&mut core, |enc| {
            enc.push_close(slot, FrameSeq(0), CloseReason::Refused)
        })
        .expect("a close for a slot whose Open has not gone");
        // The index comes back first, with enough free ones behind it that
        // the table reuses one rather than growing.
        assert_eq!(core.free.iter().collect::<Vec<_>>(), [&1]);
        for _ in 0..REUSE_AFTER {
            core.free.push_back(core.table.len() as u32);
            core.table.push(IndexEntry::default());
        }
        let mut second = open(&core, 3);
        second.send(Bytes::from_static(b"x")).await.expect("queued");
        core.handle_control(Instant::now());
        let batch = next_batch(&mut core);
        let opens: Vec<&String> = batch.iter().filter(|r| r.starts_with("open")).collect();
        assert_eq!(opens.len(), 2, "the keeper's and the second's: {batch:?}");
        assert!(opens[1].starts_with("open 3"), "{batch:?}");
    }

    /// A flush a grant carries on (under a manual flush) drops a slot the
    /// peer closed meanwhile from the ready list, instead of keeping it
    /// there until the next flush the application asks for.
    #[tokio::test]
    async fn a_carried_flush_drops_a_slot_the_peer_closed() {
        let (mut core, _tx) = a_flush_short_of_slot_credit().await;
        let mut gone = open(&core, 2);
        gone.send(Bytes::from_static(b"gone"))
            .await
            .expect("queued");
        core.handle_control(Instant::now());
        let closed = SlotId::new(1, 0).expect("the second slot");
        feed(&mut core, |enc| {
            enc.push_close(closed, FrameSeq(0), CloseReason::Refused)
        })
        .expect("the peer refuses it");
        let first = SlotId::new(0, 0).expect("the first slot");
        feed(&mut core, |enc| enc.push_credit(first, 1024)).expect("within the window");
        let carried = next_batch(&mut core);
        assert_eq!(carried.len(), 1, "the third record: {carried:?}");
        assert!(!core.ready.contains(&1), "{:?}", core.ready);
    }

    /// A stream the peer refuses while its record waits out the flush gate
    /// leaves no gate deadline behind: one past with nothing to write fired
    /// the peer task's timer again and again, a busy loop.
    #[tokio::test]
    async fn a_slot_the_peer_closes_while_the_gate_waits_leaves_no_deadline() {
        let wait = std::time::Duration::from_millis(5);
        for flush in [
            FlushPolicy::AutoLinger { max_linger: wait },
            FlushPolicy::Manual { reply_linger: wait },
        ] {
            let mut core = next_core(Epoch(1), &peer_control());
            core.config = Arc::new(MuxConfig {
                flush,
                ..(*core.config).clone()
            });
            credit_whole_window(&mut core);
            let mut tx = open(&core, 1);
            tx.send(Bytes::from_static(b"waits")).await.expect("queued");
            core.handle_control(Instant::now());
            assert!(core.gate_deadline().is_some(), "{flush:?}: the gate waits");
            let slot = SlotId::new(0, 0).expect("the first slot");
            feed(&mut core, |enc| {
                enc.push_close(slot, FrameSeq(0), CloseReason::Refused)
            })
            .expect("the peer refuses it");
            assert_eq!(core.gate_deadline(), None, "{flush:?}");
            let later = Instant::now() + std::time::Duration::from_secs(1);
            assert!(!core.wants_write(later), "{flush:?}");
        }
    }

    /// Pings can arrive out of order (two callers' nonces taken apart from
    /// their writes); the Pong owed answers the highest, which answers both.
    #[test]
    fn the_pong_owed_answers_the_highest_ping() {
        let mut core = credited_core();
        feed(&mut core, |enc| {
            enc.push_ping(3)?;
            enc.push_ping(2)
        })
        .expect("pings");
        assert_eq!(next_batch(&mut core), vec!["Pong(3)".to_string()]);
    }
}
