//! Slot handles and the per-slot state they share with the peer task.
//!
//! ```text
//!  SlotSender ─ send ─► Inlet{queue, terminal} ─ dirty ─► PeerControl ─ wake ─► peer task
//!  SlotReceiver ◄─ recv ─ RxSlot{frames} ◄─ push ─ peer task;  drained ─ dirty ─► grants
//! ```
//!
//! Owners: the producer appends to its inlet and the peer task pops from it;
//! the peer task appends to an `RxSlot` and the consumer pops. "The peer
//! task" includes whoever holds its turn: a producer writing in its own
//! turn, a link's reader decoding in its place (`engine::EpochCell`). Each slot is on
//! its peer's dirty list at most once (its `dirty` bit), so cross-task control
//! is bounded by the number of slots (docs/design.md § "Control is coalesced state").

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytes::Bytes;
use std::task::{Context, Poll, Waker};
use thiserror::Error;
use tokio::sync::Notify;

use super::protocol::CloseReason;
use super::stats::{Counters, Padded};
use super::surface::{DropReason, Frame, MuxError, PeerId, StreamKey, Terminal};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Critical sections here never panic; a poisoned lock is a bug to surface.
    mutex.lock().expect("mux slot state poisoned")
}

/// Why a send failed.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum SendError {
    /// The stream was lost (epoch death, shutdown). Earlier records: maybe delivered.
    #[error("stream dropped: {0:?}")]
    Dropped(DropReason),
    /// The receiving side closed the slot (gone, refused, or unknown to it).
    #[error("peer closed the slot: {0:?}")]
    PeerClosed(CloseReason),
    /// The record exceeds the largest one that may go: our `max_record` or
    /// the peer's as its latest hello said (at `send`), or, learned later,
    /// the peer's limit or its peer window less [`RECORD_OVERHEAD`].
    #[error("record of {len} bytes exceeds the {max}-byte maximum")]
    TooLarge {
        /// The record length.
        len: usize,
        /// The maximum.
        max: usize,
    },
}

/// Why `try_recv` returned nothing.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum RecvError {
    /// No frame is buffered now.
    #[error("no frame buffered")]
    Empty,
    /// The stream has ended; no frame will ever come.
    #[error("stream ended")]
    Ended,
}

/// What every record costs on top of its bytes, in every credit and budget
/// (slot and peer windows, the inlet's budgets): about what a held record
/// costs a receiver beyond its bytes (its queue entry and its allocation),
/// so what a peer can make a node hold stays near its window however small
/// its records are (docs/design.md § "A record costs its bytes and 64").
pub const RECORD_OVERHEAD: usize = 64;

/// What a record of `len` bytes takes from credit and budgets, on both
/// ends.
pub(crate) fn record_cost(len: usize) -> usize {
    len + RECORD_OVERHEAD
}

/// What one fragment of `len` bytes costs: its bytes, and the record's
/// overhead on its last fragment, which a receiver can tell without any
/// state for the slot (an unknown slot's data is counted too).
pub(crate) fn fragment_cost(len: usize, last: bool) -> usize {
    if last { record_cost(len) } else { len }
}

/// Per-peer control shared by every slot to that peer and its task.
#[derive(Debug)]
pub(crate) struct PeerControl {
    pub peer: PeerId,
    state: Mutex<ControlState>,
    /// Wakes the peer task (a stored permit: no wake is lost).
    pub wake: Notify,
    /// Producers waiting for the peer byte budget.
    budget_space: Notify,
    /// How many producers are in the wait for `budget_space`: a release with
    /// none skips `notify_waiters` and its waiter-list lock.
    budget_waiters: AtomicUsize,
    /// Bytes queued to this peer: every producer writes it per record.
    queued: Padded<AtomicUsize>,
    peer_budget: usize,
    pub counters: Arc<Counters>,
    next_ping: AtomicU64,
    /// The highest Ping nonce the peer has answered.
    pub pong_seen: tokio::sync::watch::Sender<u64>,
    /// Egress slots opened and not yet ended (counted at `open`, so the
    /// slot limit holds before the peer task adopts them).
    egress_live: AtomicUsize,
    /// Ingress slots in the current epoch's table, published by the peer task.
    pub ingress_live: AtomicUsize,
    /// The peer's data bytes held here, in any epoch, not yet let go of
    /// (published by the peer task).
    pub peer_held: AtomicU64,
    /// `peer_held` plus the credit the live epoch granted and the peer has
    /// not yet used (0 once the epoch is over): what the next hello's
    /// credit leaves out, so an epoch that replaces a live one adds nothing.
    pub peer_committed: AtomicU64,
    /// The credit the hellos of links handed to the peer task and not yet
    /// served granted the peer: the next hello's credit leaves it out too,
    /// since a link replaced unserved is still read out.
    pub unserved_grants: AtomicU64,
    /// The largest record or message the peer takes, as its latest epoch's
    /// terms said; 0 before any.
    pub peer_max_record: AtomicUsize,
    /// The peer's `max_slots_per_peer`, as its latest epoch's terms said;
    /// `usize::MAX` before any.
    pub peer_max_slots: AtomicUsize,
    /// How often the connector has said no link to the peer will come (it
    /// forgot the peer, or found it unreachable for good).
    pub waits_ended: AtomicU64,
}

/// A peer task's offer, while it waits with nothing to write, to let a
/// producer write its record in its own turn (docs/design.md § "A lone
/// record is written by its producer").
pub(crate) trait InlineWriter: Send + Sync + std::fmt::Debug {
    /// Takes the peer's coalesced control and writes what it brought, if
    /// the peer task is waiting and the link has room now. True: nothing is
    /// left for the peer task, which need not wake.
    fn try_write(&self) -> bool;
}

#[derive(Debug, Default)]
pub(crate) struct ControlState {
    /// The serving epoch's inline writer, while one is offered.
    pub inline: Option<Arc<dyn InlineWriter>>,
    pub dirty_inlets: Vec<Arc<Inlet>>,
    pub dirty_rx: Vec<Arc<RxSlot>>,
    pub flush_requested: bool,
    /// The newest Ping nonce callers wait on (coalesced: one Ping answers all).
    pub ping_wanted: Option<u64>,
    pub retired: bool,
    /// The connector said no link will come, and why: the peer task ends
    /// the slots opened before it and waiting for a link with this reason
    /// when it next waits for one ([`crate::mux::Mux::forget_peer`],
    /// [`crate::mux::Mux::peer_unreachable`]).
    pub end_waiting: Option<DropReason>,
    /// The connector let the peer go (it only dialled in, and its last link
    /// is over): the peer task retires as soon as it holds nothing, not an
    /// idle period later ([`crate::mux::Mux::let_go_peer`]). A link handed
    /// over to be served clears it (one to be read out does not: it is a
    /// forgotten peer's).
    pub let_go: bool,
}

impl PeerControl {
    pub fn new(peer: PeerId, peer_budget: usize, counters: Arc<Counters>) -> PeerControl {
        PeerControl {
            peer,
            state: Mutex::new(ControlState::default()),
            wake: Notify::new(),
            budget_space: Notify::new(),
            budget_waiters: AtomicUsize::new(0),
            queued: Padded(AtomicUsize::new(0)),
            peer_budget,
            counters,
            next_ping: AtomicU64::new(1),
            pong_seen: tokio::sync::watch::Sender::new(0),
            egress_live: AtomicUsize::new(0),
            ingress_live: AtomicUsize::new(0),
            peer_held: AtomicU64::new(0),
            peer_committed: AtomicU64::new(0),
            unserved_grants: AtomicU64::new(0),
            peer_max_record: AtomicUsize::new(0),
            peer_max_slots: AtomicUsize::new(usize::MAX),
            waits_ended: AtomicU64::new(0),
        }
    }

    /// Publishes what the peer task counts as held of the peer's data and
    /// what the live epoch may still receive (and moves the node's gauge).
    pub fn publish_held(&self, bytes: u64, unspent: u64) {
        self.peer_committed
            .store(bytes + unspent, Ordering::Release);
        let before = self.peer_held.swap(bytes, Ordering::AcqRel);
        let gauge = &self.counters.peer_held_bytes;
        if bytes >= before {
            gauge.fetch_add(bytes - before, Ordering::Relaxed);
        } else {
            gauge.fetch_sub(before - bytes, Ordering::Relaxed);
        }
    }

    /// Counts one more egress slot if both directions together stay within
    /// `limit`; false at the limit.
    pub fn admit_egress(&self, limit: usize) -> bool {
        let ingress = self.ingress_live.load(Ordering::Acquire);
        self.egress_live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n + ingress < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// Asks the peer task to send a Ping; resolves when a Pong for it (or a
    /// later one) arrives. Callers bound the wait themselves.
    pub async fn ping(&self) {
        let nonce = self.next_ping.fetch_add(1, Ordering::Relaxed);
        let mut seen = self.pong_seen.subscribe();
        {
            let mut state = self.state();
            state.ping_wanted = Some(state.ping_wanted.map_or(nonce, |n| n.max(nonce)));
        }
        self.wake.notify_one();
        // The sender lives as long as `self`, so the wait cannot fail.
        seen.wait_for(|&answered| answered >= nonce).await.ok();
    }

    pub fn state(&self) -> MutexGuard<'_, ControlState> {
        lock(&self.state)
    }

    /// Withdraws the inline writer offered (also while unwinding: a
    /// poisoned lock is taken as it is).
    pub fn withdraw_inline(&self) {
        let taken = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .inline
            .take();
        drop(taken);
    }

    /// Hands `bytes` back to the peer budget (the peer task calls it once
    /// per batch for the records it popped) and wakes waiting producers.
    pub fn release_budget(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        self.queued.fetch_sub(bytes, Ordering::AcqRel);
        self.counters
            .withheld_bytes
            .fetch_sub(bytes as u64, Ordering::Relaxed);
        // Pairs with the fence in `BudgetWait::new`: either this load sees
        // the waiter, or the waiter's re-check sees the bytes released.
        fence(Ordering::SeqCst);
        if self.budget_waiters.load(Ordering::Relaxed) > 0 {
            self.budget_space.notify_waiters();
        }
    }

    pub fn request_flush(&self) {
        self.state().flush_requested = true;
        self.wake.notify_one();
    }
}

/// Counts a producer in the wait for peer budget while it lives, so a
/// release notifies only when someone waits.
struct BudgetWait<'a>(&'a PeerControl);

impl<'a> BudgetWait<'a> {
    /// Counted before the caller registers its waiter and re-checks.
    fn new(control: &'a PeerControl) -> BudgetWait<'a> {
        control.budget_waiters.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        BudgetWait(control)
    }
}

impl Drop for BudgetWait<'_> {
    fn drop(&mut self) {
        self.0.budget_waiters.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What [`Inlet::try_push`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Room {
    /// Queued.
    Pushed,
    /// The slot's own budget is full: the slot's next pop makes room.
    SlotFull,
    /// The peer's budget is full: any of its slots' releases makes room.
    PeerFull,
}

/// The producer side of one egress slot.
#[derive(Debug)]
pub(crate) struct Inlet {
    pub key: StreamKey,
    pub control: Arc<PeerControl>,
    /// The peer's [`PeerControl::waits_ended`] when this slot opened: a
    /// later word that no link will come ends the slot if it still waits.
    pub opened_after_waits_ended: u64,
    slot_budget: usize,
    max_record: usize,
    state: Mutex<InletState>,
    space: Notify,
}

#[derive(Debug, Default)]
pub(crate) struct InletState {
    queue: VecDeque<Bytes>,
    queued: usize,
    terminal: Option<CloseReason>,
    closed: Option<SendError>,
    /// The producer waits for room: the next pop notifies `space`.
    producer_waiting: bool,
    dirty: bool,
    adopted: bool,
    /// The slot no longer counts toward the peer's slot limit.
    released: bool,
}

/// What [`Inlet::mark_dirty_unwoken`] did.
enum Marked {
    /// Already on the dirty list: its wake is on its way.
    Already,
    /// The peer task has retired.
    Retired,
    /// Put on the list: a wake is owed, or the inline writer offered.
    Fresh(Option<Arc<dyn InlineWriter>>),
}

/// What the peer task takes from an inlet.
#[derive(Debug)]
pub(crate) enum Pop {
    /// The next record.
    Record(Bytes),
    /// The sender's terminal; every record is already gone.
    Terminal(CloseReason),
    /// Records wait, but there is no credit for them.
    Blocked,
    /// Nothing waits.
    Empty,
}

impl Inlet {
    pub fn new(
        key: StreamKey,
        control: Arc<PeerControl>,
        slot_budget: usize,
        max_record: usize,
    ) -> Arc<Inlet> {
        Arc::new(Inlet {
            key,
            opened_after_waits_ended: control.waits_ended.load(Ordering::Acquire),
            control,
            slot_budget,
            max_record,
            state: Mutex::new(InletState::default()),
            space: Notify::new(),
        })
    }

    /// Puts this inlet on its peer's dirty list unless it is already there.
    /// Returns false if the peer task has retired (the caller must re-home it).
    fn mark_dirty(self: &Arc<Self>, state: &mut InletState) -> bool {
        match self.mark_dirty_unwoken(state) {
            Marked::Retired => false,
            Marked::Already => true,
            Marked::Fresh(_) => {
                self.control.wake.notify_one();
                true
            }
        }
    }

    /// [`Inlet::mark_dirty`] without the wake, which the caller owes on
    /// `Fresh` (after it lets go of the inlet's lock: an inline writer
    /// takes it).
    fn mark_dirty_unwoken(self: &Arc<Self>, state: &mut InletState) -> Marked {
        if state.dirty {
            return Marked::Already;
        }
        let mut control = self.control.state();
        if control.retired {
            return Marked::Retired;
        }
        state.dirty = true;
        control.dirty_inlets.push(self.clone());
        Marked::Fresh(control.inline.clone())
    }

    /// Registers a fresh inlet with its peer task.
    pub fn announce(self: &Arc<Self>) -> bool {
        let mut state = lock(&self.state);
        self.mark_dirty(&mut state)
    }

    async fn push(self: &Arc<Self>, data: Bytes) -> Result<(), SendError> {
        let len = data.len();
        // The peer's limit as its latest hello said (0: none heard yet):
        // refused here, the stream stays open for its sender to say why;
        // taken, the peer task could only end the slot.
        let max = match self.control.peer_max_record.load(Ordering::Acquire) {
            0 => self.max_record,
            peer => self.max_record.min(peer),
        };
        if len > max {
            return Err(SendError::TooLarge { len, max });
        }
        let mut data = Some(data);
        // With room, as almost always, no waiter is registered: that is four
        // waiter-list lock round trips per record saved.
        if self.try_push(&mut data, false)? == Room::Pushed {
            return Ok(());
        }
        // Counted as a peer-budget waiter only while that budget is what
        // holds it: a producer held by its own slot's backlog is woken by
        // that slot's pops, not by every batch of the peer's.
        let mut counted: Option<BudgetWait<'_>> = None;
        loop {
            let slot_space = self.space.notified();
            let peer_space = self.control.budget_space.notified();
            tokio::pin!(slot_space, peer_space);
            slot_space.as_mut().enable();
            if counted.is_some() {
                peer_space.as_mut().enable();
            }
            // Registered (and counted, and flagged below) before this check,
            // so room freed after it wakes us.
            match self.try_push(&mut data, true)? {
                Room::Pushed => return Ok(()),
                Room::SlotFull => {
                    counted = None;
                    slot_space.await;
                }
                Room::PeerFull if counted.is_none() => {
                    counted = Some(BudgetWait::new(&self.control));
                }
                Room::PeerFull => {
                    tokio::select! {
                        _ = slot_space => {}
                        _ = peer_space => {}
                    }
                }
            }
        }
    }

    /// Queues the record in `data` (taking it) if the slot's and the peer's
    /// budgets have room; if not, says which is full, leaves `data`
    /// untouched, and has the next pop notify a producer about to `wait`. A slot with
    /// nothing queued may always queue one record: the peer budget holds
    /// back slots whose backlog fills it, never one that keeps up
    /// (docs/design.md § "A stream that keeps up is never held by another's
    /// backlog").
    fn try_push(self: &Arc<Self>, data: &mut Option<Bytes>, wait: bool) -> Result<Room, SendError> {
        let len = record_cost(data.as_ref().map_or(0, Bytes::len));
        let mut state = lock(&self.state);
        if let Some(err) = state.closed {
            return Err(err);
        }
        let slot_ok = state.queued == 0 || state.queued + len <= self.slot_budget;
        let peer_queued = self.control.queued.load(Ordering::Acquire);
        let peer_ok = state.queued == 0 || peer_queued + len <= self.control.peer_budget;
        if !(slot_ok && peer_ok) {
            state.producer_waiting |= wait;
            return Ok(if slot_ok {
                Room::PeerFull
            } else {
                Room::SlotFull
            });
        }
        let Some(record) = data.take() else {
            return Ok(Room::Pushed);
        };
        state.queue.push_back(record);
        state.queued += len;
        self.control.queued.fetch_add(len, Ordering::AcqRel);
        Counters::add(&self.control.counters.withheld_bytes, len as u64);
        // A retired peer cannot happen here: the slot is live in its table.
        if let Marked::Fresh(inline) = self.mark_dirty_unwoken(&mut state) {
            drop(state);
            // The peer task waits with nothing to write: the record may go
            // in this turn, instead of after it (the batcher's hop).
            if !inline.is_some_and(|writer| writer.try_write()) {
                self.control.wake.notify_one();
            }
        }
        Ok(Room::Pushed)
    }

    async fn closed(&self) -> SendError {
        loop {
            // `close` notifies every waiter after it sets the reason.
            let notified = self.space.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(err) = lock(&self.state).closed {
                return err;
            }
            notified.await;
        }
    }

    fn finish(self: &Arc<Self>, reason: CloseReason) -> Result<(), SendError> {
        let mut state = lock(&self.state);
        if let Some(err) = state.closed {
            return Err(err);
        }
        state.terminal = Some(reason);
        self.mark_dirty(&mut state);
        Ok(())
    }

    // --- peer task side ---

    /// Clears the dirty bit and says how the current table should treat the
    /// inlet; a new one is marked adopted, so no later epoch adopts it again.
    pub fn take_dirty(&self) -> InletStatus {
        let mut state = lock(&self.state);
        state.dirty = false;
        if state.closed.is_some() {
            InletStatus::Closed
        } else if state.adopted {
            InletStatus::Known
        } else {
            state.adopted = true;
            InletStatus::New
        }
    }

    /// Records or a terminal wait to be popped.
    pub fn has_queued(&self) -> bool {
        let state = lock(&self.state);
        !state.queue.is_empty() || state.terminal.is_some()
    }

    /// Pops the next item. A record only if `may_start` allows one of its
    /// length (the caller's credit); the terminal only once every record
    /// before it is gone. A record's bytes leave the slot's budget here and
    /// the peer's when the caller releases them
    /// ([`PeerControl::release_budget`]).
    pub fn pop(&self, may_start: impl FnOnce(usize) -> bool) -> Pop {
        let mut state = lock(&self.state);
        let Some(next) = state.queue.front() else {
            return match state.terminal.take() {
                Some(reason) => Pop::Terminal(reason),
                None => Pop::Empty,
            };
        };
        if !may_start(next.len()) {
            return Pop::Blocked;
        }
        let data = state.queue.pop_front().expect("queue is not empty");
        state.queued -= record_cost(data.len());
        let producer_waiting = std::mem::take(&mut state.producer_waiting);
        drop(state);
        if producer_waiting {
            self.space.notify_waiters();
        }
        Pop::Record(data)
    }

    /// Puts records a failed post took back at the front of the queue, and
    /// the terminal if it was taken too, so the next epoch sends them again.
    /// May overshoot the byte budgets by that one batch.
    pub fn restore(&self, records: Vec<Bytes>, terminal: Option<CloseReason>) {
        let mut state = lock(&self.state);
        if state.closed.is_some() {
            return;
        }
        let bytes: usize = records.iter().map(|r| record_cost(r.len())).sum();
        for record in records.into_iter().rev() {
            state.queue.push_front(record);
        }
        state.queued += bytes;
        if terminal.is_some() {
            state.terminal = terminal;
        }
        drop(state);
        self.control.queued.fetch_add(bytes, Ordering::AcqRel);
        Counters::add(&self.control.counters.withheld_bytes, bytes as u64);
    }

    /// Hands a slot whose Open never left its dying epoch to the next one:
    /// it is new again and back on the peer's dirty list. False if it could
    /// not be (closed, or the peer task retired).
    pub fn carry(self: &Arc<Self>) -> bool {
        let mut state = lock(&self.state);
        if state.closed.is_some() {
            return false;
        }
        state.adopted = false;
        self.mark_dirty(&mut state)
    }

    /// Stops counting this slot toward the peer's limit (once): it ended,
    /// was refused, or its terminal went out.
    pub fn release_slot(&self) {
        let mut state = lock(&self.state);
        if !std::mem::replace(&mut state.released, true) {
            self.control.egress_live.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Ends the slot for its producer with `err` and discards what it had
    /// queued; false if it had ended already.
    pub fn close(&self, err: SendError) -> bool {
        let mut state = lock(&self.state);
        if state.closed.is_some() {
            return false;
        }
        state.closed = Some(err);
        state.terminal = None;
        let discarded = std::mem::take(&mut state.queued);
        state.queue.clear();
        if !std::mem::replace(&mut state.released, true) {
            self.control.egress_live.fetch_sub(1, Ordering::AcqRel);
        }
        drop(state);
        self.control.release_budget(discarded);
        self.space.notify_waiters();
        true
    }
}

impl Drop for Inlet {
    fn drop(&mut self) {
        // Backstop for an inlet that never reached a table (its peer retired).
        self.release_slot();
    }
}

/// How the peer task should treat a dirty inlet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum InletStatus {
    /// Not yet in any slot table: adopt it.
    New,
    /// Already in the current table.
    Known,
    /// Closed; ignore.
    Closed,
}

/// Sends records on one egress slot. Dropping it without [`SlotSender::finish`]
/// ends the stream with `Dropped` at the receiver.
#[derive(Debug)]
pub struct SlotSender {
    inlet: Arc<Inlet>,
    finished: bool,
}

impl SlotSender {
    pub(crate) fn new(inlet: Arc<Inlet>) -> SlotSender {
        SlotSender {
            inlet,
            finished: false,
        }
    }

    /// The stream this slot carries.
    pub fn key(&self) -> StreamKey {
        self.inlet.key
    }

    /// The peer this slot sends to.
    pub fn peer(&self) -> PeerId {
        self.inlet.control.peer
    }

    /// Queues one record; waits while the slot's or the peer's byte budget is full.
    pub async fn send(&mut self, data: Bytes) -> Result<(), SendError> {
        self.inlet.push(data).await
    }

    /// Resolves once the slot is closed for its producer (its epoch died,
    /// the peer closed it, the mux shut down) with the error the next
    /// [`SlotSender::send`] would return. A producer that sends only now and
    /// then learns of the end here, without sending.
    pub async fn closed(&self) -> SendError {
        self.inlet.closed().await
    }

    /// Ends the stream. Never waits: the terminal has reserved capacity.
    pub fn finish(mut self, terminal: Terminal) -> Result<(), SendError> {
        self.finished = true;
        let reason = match terminal {
            Terminal::Finalized => CloseReason::Finalized,
            Terminal::Detached => CloseReason::Detached,
        };
        self.inlet.finish(reason)
    }
}

impl Drop for SlotSender {
    fn drop(&mut self) {
        if !self.finished {
            // Already closed (dropped by the epoch) needs no terminal.
            self.inlet.finish(CloseReason::SenderDropped).ok();
        }
    }
}

/// Streams bound on this node, by key. A slot exists here from the first of
/// `bind` or the peer's OpenSlot until its terminal is consumed.
#[derive(Debug)]
pub(crate) struct Registry {
    slots: Mutex<HashMap<StreamKey, Arc<RxSlot>>>,
    /// Per peer, the entries its OpenSlots created that nobody has bound
    /// yet (across epochs): capped, so no one peer fills `max_entries`.
    unbound: Mutex<HashMap<PeerId, usize>>,
    /// Keys whose binding was given up ([`SlotReceiver::abandon`]) before
    /// any peer fed it, newest last (at most [`ABANDONED_KEPT`], none older
    /// than [`ABANDONED_FOR`]): a late OpenSlot for one is refused, so its
    /// sender hears, rather than filling an entry nobody will bind.
    abandoned: Mutex<Abandoned>,
    /// Bindings abandoned so far (for the stats).
    abandoned_total: AtomicU64,
    window: u32,
    max_entries: usize,
    max_unbound_per_peer: usize,
}

/// Abandoned bindings remembered: a late sender's OpenSlot usually comes
/// within a link outage of the bind it was meant for.
const ABANDONED_KEPT: usize = 16_384;

/// Entries a drained receive queue keeps allocated; a larger one (a burst)
/// is shrunk to this when its consumer finds it empty.
const KEPT_QUEUE: usize = 256;

/// How long an abandoned binding is remembered: far past any link outage
/// a late open could have waited out (a relink's retries, a dial wait);
/// an open later than that is a new stream that reuses the key.
const ABANDONED_FOR: std::time::Duration = std::time::Duration::from_secs(600);

/// Keys whose binding was abandoned, oldest first, with when.
#[derive(Debug, Default)]
struct Abandoned {
    keys: std::collections::HashSet<StreamKey>,
    order: VecDeque<(StreamKey, tokio::time::Instant)>,
}

impl Abandoned {
    fn insert(&mut self, key: StreamKey) {
        let now = tokio::time::Instant::now();
        if self.keys.insert(key) {
            self.order.push_back((key, now));
        }
        self.expire(now);
    }

    /// Whether an open for `key` is refused: abandoned, and not yet
    /// forgotten by age.
    fn refuses(&mut self, key: &StreamKey) -> bool {
        self.expire(tokio::time::Instant::now());
        self.keys.contains(key)
    }

    fn expire(&mut self, now: tokio::time::Instant) {
        while let Some(&(oldest, at)) = self.order.front() {
            if self.order.len() <= ABANDONED_KEPT && now.duration_since(at) < ABANDONED_FOR {
                break;
            }
            self.order.pop_front();
            self.keys.remove(&oldest);
        }
    }

    /// A bind claims the key again: forgotten (a scan, for a key that was
    /// given up and is bound again only).
    fn forget(&mut self, key: &StreamKey) {
        if self.keys.remove(key) {
            self.order.retain(|(kept, _)| kept != key);
        }
    }
}

/// What an OpenSlot found in the registry.
#[derive(Debug)]
pub(crate) enum OpenOutcome {
    Attached(Arc<RxSlot>),
    Refused,
}

impl Registry {
    pub fn new(window: u32, max_entries: usize, max_unbound_per_peer: usize) -> Arc<Registry> {
        Arc::new(Registry {
            slots: Mutex::new(HashMap::new()),
            unbound: Mutex::new(HashMap::new()),
            abandoned: Mutex::new(Abandoned::default()),
            abandoned_total: AtomicU64::new(0),
            window,
            max_entries,
            max_unbound_per_peer,
        })
    }

    /// Entries `peer`'s opens created that nobody has bound.
    #[cfg(test)]
    pub fn unbound_of(&self, peer: PeerId) -> usize {
        lock(&self.unbound).get(&peer).copied().unwrap_or(0)
    }

    /// Peers whose opens left entries here that nobody has bound.
    pub fn peers_with_unbound(&self) -> Vec<PeerId> {
        lock(&self.unbound).keys().copied().collect()
    }

    fn release_unbound(&self, peer: PeerId) {
        let mut unbound = lock(&self.unbound);
        if let Some(n) = unbound.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                unbound.remove(&peer);
            }
        }
    }

    pub fn bind(self: &Arc<Self>, key: StreamKey) -> Result<SlotReceiver, MuxError> {
        let mut slots = lock(&self.slots);
        let rx = slots
            .entry(key)
            .or_insert_with(|| RxSlot::new(key, self.window))
            .clone();
        let mut state = lock(&rx.state);
        if state.receiver_taken {
            return Err(MuxError::AlreadyBound(key));
        }
        state.receiver_taken = true;
        let opened_by = state.opened_by.take();
        drop(state);
        lock(&self.abandoned).forget(&key);
        if let Some(peer) = opened_by {
            self.release_unbound(peer);
        }
        Ok(SlotReceiver {
            rx,
            registry: self.clone(),
            done: false,
            abandoning: false,
        })
    }

    /// Attaches a peer's OpenSlot to the binding for `key`.
    pub fn open(&self, key: StreamKey, feeder: &Arc<PeerControl>) -> OpenOutcome {
        let mut slots = lock(&self.slots);
        let fresh = !slots.contains_key(&key);
        if fresh {
            if slots.len() >= self.max_entries || lock(&self.abandoned).refuses(&key) {
                return OpenOutcome::Refused;
            }
            // A refused open leaves no entry: at a cap of 0 every peer that
            // opened once would stay counted as holding something here.
            let mut unbound = lock(&self.unbound);
            let waiting = unbound.get(&feeder.peer).copied().unwrap_or(0);
            if waiting >= self.max_unbound_per_peer {
                return OpenOutcome::Refused;
            }
            *unbound.entry(feeder.peer).or_default() += 1;
        }
        let rx = slots
            .entry(key)
            .or_insert_with(|| RxSlot::new(key, self.window))
            .clone();
        let mut state = lock(&rx.state);
        if fresh {
            state.opened_by = Some(feeder.peer);
        }
        if state.feeder.is_some() || state.ended || state.receiver_gone {
            return OpenOutcome::Refused;
        }
        state.feeder = Some(Arc::downgrade(feeder));
        drop(state);
        OpenOutcome::Attached(rx)
    }

    /// Ends every slot no peer feeds with `frame`: at shutdown, a stream
    /// bound here whose sender never came would otherwise wait for good.
    /// A fed slot is left to its peer task, which ends it as it retires.
    pub fn end_unfed(&self, frame: &Frame) {
        let slots: Vec<Arc<RxSlot>> = lock(&self.slots).values().cloned().collect();
        for rx in slots {
            rx.end_unless_fed(frame);
        }
    }

    /// Forgets a binding given up before any peer fed it, and remembers
    /// its key as abandoned ([`Registry::open`] refuses it).
    fn abandon(&self, rx: &Arc<RxSlot>) {
        let mut slots = lock(&self.slots);
        if slots.get(&rx.key).is_some_and(|cur| Arc::ptr_eq(cur, rx)) {
            slots.remove(&rx.key);
            lock(&self.abandoned).insert(rx.key);
            self.abandoned_total.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Bindings abandoned so far.
    pub fn bindings_abandoned(&self) -> u64 {
        self.abandoned_total.load(Ordering::Relaxed)
    }

    /// Forgets `rx` if it is still the registered slot for its key.
    pub fn remove(&self, rx: &Arc<RxSlot>) {
        let mut slots = lock(&self.slots);
        if slots.get(&rx.key).is_some_and(|cur| Arc::ptr_eq(cur, rx)) {
            slots.remove(&rx.key);
            let opened_by = lock(&rx.state).opened_by.take();
            if let Some(peer) = opened_by {
                self.release_unbound(peer);
            }
        }
    }
}

/// The consumer side of one ingress slot.
#[derive(Debug)]
pub(crate) struct RxSlot {
    pub key: StreamKey,
    state: Mutex<RxState>,
    grant_threshold: u64,
}

#[derive(Debug, Default)]
struct RxState {
    frames: VecDeque<(Frame, u64)>,
    ended: bool,
    receiver_taken: bool,
    receiver_gone: bool,
    drained: u64,
    /// The peer feeding the slot. Weak, as `fed_by`: a slot on its peer's
    /// dirty list must not keep the peer's state alive in a cycle.
    feeder: Option<Weak<PeerControl>>,
    /// After the terminal, the peer that fed the slot, to hear what the
    /// consumer still takes (peer credit).
    fed_by: Option<Weak<PeerControl>>,
    dirty: bool,
    /// The receiver found nothing and waits: the next push or the terminal
    /// takes this and wakes it. One consumer per slot, so one waker, kept
    /// under the lock the frames are under (no second lock per record).
    waiter: Option<Waker>,
    /// The consumer took the terminal.
    terminal_taken: bool,
    /// The peer whose OpenSlot created this entry, until someone binds it.
    opened_by: Option<PeerId>,
}

/// What [`RxSlot::push_unwoken`] did with a frame.
#[derive(Debug)]
pub(crate) enum Pushed {
    /// The consumer is gone; the frame was dropped.
    Discarded,
    /// Queued; the receiver is not waiting (or a frame before it woke it).
    Buffered,
    /// Queued, and the receiver waits for it: the caller owes this wake-up.
    ReceiverWaiting(Waker),
}

/// Receivers a decoded batch found waiting. Dropping it wakes them at once;
/// [`ReceiverWakes::defer`] wakes the first now and the rest together once
/// the worker has run what it has queued (docs/design.md § "A batch wakes
/// its consumers together").
#[derive(Debug, Default)]
pub(crate) struct ReceiverWakes(Vec<Waker>);

impl ReceiverWakes {
    /// Room for `waiters` up front: a batch wakes one receiver per stream,
    /// and growing one push at a time cost a batch five reallocations.
    pub fn with_capacity(waiters: usize) -> Self {
        ReceiverWakes(Vec::with_capacity(waiters))
    }

    pub fn push(&mut self, waiter: Waker) {
        self.0.push(waiter);
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Wakes the first receiver now (a tokio worker's LIFO slot: no other
    /// worker unparked) and hands the rest to the runtime's deferred
    /// wake-ups, the list `yield_now` uses, which a worker runs together
    /// when it next polls its driver. Outside a runtime: all at once.
    pub fn defer(mut self) -> Deferred {
        if self.0.len() < 2 {
            return Deferred(None);
        }
        let first = self.0.remove(0);
        // The list itself moves; only the `Arc` is allocated.
        let rest = Arc::new(DeferredWakes(Mutex::new(std::mem::take(&mut self.0))));
        first.wake();
        crate::later::after_woken_tasks(&Waker::from(rest.clone()));
        Deferred(Some(rest))
    }
}

/// The receivers [`ReceiverWakes::defer`] handed to the runtime.
/// [`Deferred::wake_now`] wakes those it has not woken yet: the peer task
/// calls it on its next turn, so a worker kept busy (a saturating producer
/// on it) delays them by one turn, not until it next idles.
#[derive(Default)]
pub(crate) struct Deferred(Option<Arc<DeferredWakes>>);

impl Deferred {
    pub fn wake_now(&mut self) {
        if let Some(rest) = self.0.take() {
            rest.wake_all();
        }
    }
}

impl Drop for ReceiverWakes {
    fn drop(&mut self) {
        for waiter in self.0.drain(..) {
            waiter.wake();
        }
    }
}

/// The deferred part of a [`ReceiverWakes`]: woken by the runtime, or on
/// drop if the runtime lets its waker go unwoken, so no receiver is missed.
struct DeferredWakes(Mutex<Vec<Waker>>);

impl DeferredWakes {
    fn wake_all(&self) {
        let waiters = std::mem::take(&mut *lock(&self.0));
        for waiter in waiters {
            waiter.wake();
        }
    }
}

impl std::task::Wake for DeferredWakes {
    fn wake(self: Arc<Self>) {
        self.wake_all();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake_all();
    }
}

impl Drop for DeferredWakes {
    fn drop(&mut self) {
        self.wake_all();
    }
}

/// What the peer task learns when it visits a dirty `RxSlot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RxVisit {
    pub drained: u64,
    pub receiver_gone: bool,
    /// The terminal has been taken: nothing of the slot is held any more.
    pub finished: bool,
}

impl RxSlot {
    fn new(key: StreamKey, window: u32) -> Arc<RxSlot> {
        Arc::new(RxSlot {
            key,
            state: Mutex::new(RxState::default()),
            grant_threshold: (u64::from(window) / 4).max(1),
        })
    }

    /// Appends a frame whose consumption returns `credit` bytes. Returns false
    /// if the consumer is gone (the frame was discarded).
    pub fn push(&self, frame: Frame, credit: u64) -> bool {
        match self.push_unwoken(frame, credit) {
            Pushed::Discarded => false,
            Pushed::Buffered => true,
            Pushed::ReceiverWaiting(waiter) => {
                waiter.wake();
                true
            }
        }
    }

    /// [`RxSlot::push`] that leaves the waiting receiver's wake-up to the
    /// caller, who wakes a batch's receivers together ([`ReceiverWakes`]).
    pub fn push_unwoken(&self, frame: Frame, credit: u64) -> Pushed {
        let mut state = lock(&self.state);
        if state.receiver_gone {
            return Pushed::Discarded;
        }
        // A heartbeat costs no credit: one behind any queued frame would
        // let a peer queue entries no window counts (review 48d), and the
        // queued frame already shows the sender is alive.
        if frame == Frame::Heartbeat && !state.frames.is_empty() {
            return Pushed::Buffered;
        }
        state.frames.push_back((frame, credit));
        match state.waiter.take() {
            Some(waiter) => Pushed::ReceiverWaiting(waiter),
            None => Pushed::Buffered,
        }
    }

    /// Appends the terminal and detaches the feeder (still told, weakly,
    /// what the consumer takes). Returns false if a terminal was already
    /// there (exactly one per slot).
    pub fn end(&self, frame: Frame) -> bool {
        let mut state = lock(&self.state);
        if state.ended {
            return false;
        }
        state.ended = true;
        state.fed_by = state.feeder.take();
        if !state.receiver_gone {
            state.frames.push_back((frame, 0));
        }
        let waiter = state.waiter.take();
        drop(state);
        if let Some(waiter) = waiter {
            waiter.wake();
        }
        true
    }

    /// [`RxSlot::end`], unless a peer feeds the slot (checked under the same
    /// lock as the end, so an open cannot attach in between).
    fn end_unless_fed(&self, frame: &Frame) {
        let mut state = lock(&self.state);
        if state.ended || state.feeder.is_some() {
            return;
        }
        state.ended = true;
        if !state.receiver_gone {
            state.frames.push_back((frame.clone(), 0));
        }
        let waiter = state.waiter.take();
        drop(state);
        if let Some(waiter) = waiter {
            waiter.wake();
        }
    }

    /// True if no receiver will ever read this slot again.
    pub fn receiver_gone(&self) -> bool {
        lock(&self.state).receiver_gone
    }

    /// Clears the dirty bit and takes the drained-but-ungranted bytes.
    pub fn visit(&self) -> RxVisit {
        let mut state = lock(&self.state);
        state.dirty = false;
        RxVisit {
            drained: std::mem::take(&mut state.drained),
            receiver_gone: state.receiver_gone,
            finished: state.terminal_taken,
        }
    }

    fn mark_dirty(self: &Arc<Self>, state: &mut RxState) {
        if state.dirty {
            return;
        }
        let feeder = (state.feeder.as_ref().or(state.fed_by.as_ref())).and_then(Weak::upgrade);
        if let Some(feeder) = feeder {
            state.dirty = true;
            feeder.state().dirty_rx.push(self.clone());
            feeder.wake.notify_one();
        }
    }
}

/// Receives one stream's frames, in send order, exactly once. After a
/// terminal frame, `recv` returns `None`.
#[derive(Debug)]
pub struct SlotReceiver {
    rx: Arc<RxSlot>,
    registry: Arc<Registry>,
    done: bool,
    /// [`SlotReceiver::abandon`]: a late open for the key is refused.
    abandoning: bool,
}

impl SlotReceiver {
    /// Gives the binding up for good: if no peer has fed it, a later
    /// OpenSlot for its key is refused (until the key is bound again)
    /// instead of waiting for a bind. For keys no sender reuses, as velo's
    /// session ids: a sender late for the bind then hears, where its open
    /// would fill an entry nobody binds and block on its window. Dropping
    /// the receiver instead lets such an open wait for the next bind.
    pub fn abandon(mut self) {
        self.abandoning = true;
    }

    /// The stream this receiver is bound to.
    pub fn key(&self) -> StreamKey {
        self.rx.key
    }

    /// The peer whose open feeds this stream now, if any: a peer opened it
    /// and its epoch lives, whether or not a frame has come yet.
    pub fn fed_by(&self) -> Option<PeerId> {
        let state = lock(&self.rx.state);
        state.feeder.as_ref()?.upgrade().map(|feeder| feeder.peer)
    }

    /// The next frame, or `None` once the terminal has been returned.
    pub async fn recv(&mut self) -> Option<Frame> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// [`SlotReceiver::recv`] as a poll: on a miss the task's waker is kept
    /// (under the frames' lock) for the next push or the terminal to wake.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Frame>> {
        match self.take_frame(Some(cx.waker())) {
            Ok(frame) => Poll::Ready(Some(frame)),
            Err(RecvError::Ended) => Poll::Ready(None),
            Err(RecvError::Empty) => Poll::Pending,
        }
    }

    /// The next frame if one is buffered.
    pub fn try_recv(&mut self) -> Result<Frame, RecvError> {
        self.take_frame(None)
    }

    /// [`SlotReceiver::try_recv`]; on a miss, `waiter` (if any) is woken by
    /// the next push.
    fn take_frame(&mut self, waiter: Option<&Waker>) -> Result<Frame, RecvError> {
        if self.done {
            return Err(RecvError::Ended);
        }
        let mut state = lock(&self.rx.state);
        let Some((frame, credit)) = state.frames.pop_front() else {
            if state.frames.capacity() > KEPT_QUEUE {
                // A burst's queue is not kept for the stream's life: the
                // window bounds what is queued, not what stays allocated.
                state.frames.shrink_to(KEPT_QUEUE);
            }
            if state.ended {
                return Err(RecvError::Ended);
            }
            if let Some(waiter) = waiter {
                match &mut state.waiter {
                    Some(kept) if kept.will_wake(waiter) => {}
                    kept => *kept = Some(waiter.clone()),
                }
            }
            return Err(RecvError::Empty);
        };
        if credit > 0 {
            state.drained += credit;
            // A quarter window: the sender still holds three quarters, so it
            // never waits for this grant (docs/design.md § "Slot credit in bytes").
            if state.drained >= self.rx.grant_threshold {
                self.rx.mark_dirty(&mut state);
            }
        }
        if frame.is_terminal() {
            self.done = true;
            state.terminal_taken = true;
            if state.drained > 0 {
                // The feeder returns what the closed slot still counted as held.
                self.rx.mark_dirty(&mut state);
            }
            drop(state);
            self.registry.remove(&self.rx);
        }
        Ok(frame)
    }
}

impl Drop for SlotReceiver {
    fn drop(&mut self) {
        let mut state = lock(&self.rx.state);
        state.receiver_gone = true;
        state.waiter = None;
        let cleared: u64 = state.frames.drain(..).map(|(_, credit)| credit).sum();
        let feeding = state.feeder.is_some();
        if feeding || cleared > 0 || state.drained > 0 {
            // The feeder closes the slot, or returns what it held as peer credit.
            self.rx.mark_dirty(&mut state);
        }
        // Given up, and no peer ever fed it: a sender may yet come for it.
        let never_fed = !feeding && state.fed_by.is_none() && !state.ended;
        drop(state);
        if never_fed && self.abandoning {
            self.registry.abandon(&self.rx);
        } else if !feeding {
            self.registry.remove(&self.rx);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const WAIT: Duration = Duration::from_secs(5);

    fn control(peer_budget: usize) -> Arc<PeerControl> {
        Arc::new(PeerControl::new(
            PeerId(2),
            peer_budget,
            Arc::new(Counters::default()),
        ))
    }

    fn inlet(control: &Arc<PeerControl>, slot: u64, slot_budget: usize) -> Arc<Inlet> {
        let inlet = Inlet::new(StreamKey::new(1, slot), control.clone(), slot_budget, 1024);
        assert!(inlet.announce());
        inlet
    }

    fn record(len: usize) -> Bytes {
        Bytes::from(vec![7; len])
    }

    /// Whether `fut` is still waiting after the runtime has run everything
    /// else it can.
    async fn still_waiting<T>(fut: &mut tokio::task::JoinHandle<T>) -> bool {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        !fut.is_finished()
    }

    #[tokio::test]
    async fn a_producer_blocked_on_its_slot_budget_wakes_when_a_record_leaves() {
        let control = control(1 << 20);
        let slot = inlet(&control, 1, 100);
        slot.push(record(60)).await.unwrap();
        let blocked = slot.clone();
        let mut second = tokio::spawn(async move { blocked.push(record(60)).await });
        assert!(
            still_waiting(&mut second).await,
            "two records' costs pass 100"
        );
        assert!(matches!(slot.pop(|_| true), Pop::Record(r) if r.len() == 60));
        tokio::time::timeout(WAIT, second)
            .await
            .expect("woken by the pop")
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_producer_blocked_on_the_peer_budget_wakes_when_another_slot_drains() {
        // 100 bytes, and the overhead of the two records queued first.
        let control = control(100 + 2 * RECORD_OVERHEAD);
        let (full, other) = (inlet(&control, 1, 1000), inlet(&control, 2, 1000));
        full.push(record(70)).await.unwrap();
        other.push(record(10)).await.unwrap();
        let blocked = other.clone();
        let mut send = tokio::spawn(async move { blocked.push(record(80)).await });
        assert!(still_waiting(&mut send).await, "the peer holds 80 of 100");
        assert_eq!(control.budget_waiters.load(Ordering::Relaxed), 1);
        // A slot with nothing queued is not held by the others' backlog.
        let idle = inlet(&control, 3, 1000);
        idle.push(record(80)).await.unwrap();
        assert!(
            still_waiting(&mut send).await,
            "a backlogged slot still waits"
        );
        let Pop::Record(sent) = idle.pop(|_| true) else {
            panic!("a record is queued");
        };
        control.release_budget(record_cost(sent.len()));
        // A release from a different slot than the one waiting.
        let Pop::Record(popped) = full.pop(|_| true) else {
            panic!("a record is queued");
        };
        assert!(still_waiting(&mut send).await, "popped, not yet released");
        control.release_budget(record_cost(popped.len()));
        tokio::time::timeout(WAIT, send)
            .await
            .expect("woken by the other slot's pop")
            .unwrap()
            .unwrap();
        assert_eq!(control.budget_waiters.load(Ordering::Relaxed), 0);
    }

    /// A bound slot fed by a peer: its receiver, its state, and the peer's
    /// control (kept alive: the slot holds it weakly).
    fn bound_slot() -> (SlotReceiver, Arc<RxSlot>, Arc<PeerControl>) {
        let registry = Registry::new(64 * 1024, 16, 16);
        let key = StreamKey::new(1, 1);
        let receiver = registry.bind(key).unwrap();
        let control = control(1 << 20);
        let OpenOutcome::Attached(rx) = registry.open(key, &control) else {
            panic!("the binding takes the peer's open");
        };
        (receiver, rx, control)
    }

    #[tokio::test]
    async fn a_waiting_receiver_is_woken_by_the_next_frame_and_only_then_flagged() {
        let (mut receiver, rx, _control) = bound_slot();
        // A frame already there: no wait, no flag.
        assert!(rx.push(Frame::Data(record(4)), 4));
        assert!(matches!(receiver.recv().await, Some(Frame::Data(_))));
        assert!(lock(&rx.state).waiter.is_none());
        let mut next = tokio::spawn(async move { receiver.recv().await });
        assert!(still_waiting(&mut next).await);
        assert!(lock(&rx.state).waiter.is_some());
        assert!(rx.push(Frame::Data(record(4)), 4));
        assert!(lock(&rx.state).waiter.is_none(), "the push took the waker");
        let frame = tokio::time::timeout(WAIT, next)
            .await
            .expect("woken")
            .unwrap();
        assert!(matches!(frame, Some(Frame::Data(_))));
    }

    #[tokio::test]
    async fn a_receiver_dropped_while_waiting_leaves_no_waker_behind() {
        let (mut receiver, rx, _control) = bound_slot();
        let mut waiting = tokio::spawn(async move { receiver.recv().await });
        assert!(still_waiting(&mut waiting).await);
        assert!(lock(&rx.state).waiter.is_some());
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        // The waker would keep the finished task's allocation alive.
        assert!(lock(&rx.state).waiter.is_none());
        assert!(!rx.push(Frame::Data(record(4)), 4), "nobody reads it");
    }

    /// Bound slots, their consumer tasks, and the order in which the
    /// consumers got their first frame.
    type Consumers = (
        Vec<Arc<RxSlot>>,
        Vec<tokio::task::JoinHandle<()>>,
        Arc<Mutex<Vec<u64>>>,
    );

    /// `n` bound slots, each with a consumer task waiting for one frame.
    fn waiting_consumers(n: u64) -> Consumers {
        let registry = Registry::new(64 * 1024, 16, 16);
        let control = control(1 << 20);
        let order = Arc::new(Mutex::new(Vec::new()));
        let (mut slots, mut consumers) = (Vec::new(), Vec::new());
        for slot in 0..n {
            let key = StreamKey::new(1, slot);
            let mut receiver = registry.bind(key).unwrap();
            let OpenOutcome::Attached(rx) = registry.open(key, &control) else {
                panic!("the binding takes the peer's open");
            };
            slots.push(rx);
            let order = order.clone();
            consumers.push(tokio::spawn(async move {
                assert!(matches!(receiver.recv().await, Some(Frame::Data(_))));
                lock(&order).push(slot);
            }));
        }
        (slots, consumers, order)
    }

    /// Heartbeats queue only into an empty queue (each costs no credit, so
    /// behind data they were entries no window counted), and a burst's
    /// queue shrinks to `KEPT_QUEUE` once its consumer has read it all
    /// (review 48d).
    #[test]
    fn heartbeats_behind_frames_are_not_queued_and_a_read_burst_shrinks_its_queue() {
        let registry = Registry::new(64 * 1024, 16, 16);
        let control = control(1 << 20);
        let key = StreamKey::new(1, 1);
        let mut receiver = registry.bind(key).unwrap();
        let OpenOutcome::Attached(rx) = registry.open(key, &control) else {
            panic!("the binding takes the peer's open");
        };
        rx.push_unwoken(Frame::Heartbeat, 0);
        let burst = 4 * KEPT_QUEUE;
        for _ in 0..burst {
            rx.push_unwoken(Frame::Data(Bytes::new()), 64);
            rx.push_unwoken(Frame::Heartbeat, 0);
        }
        assert_eq!(
            lock(&rx.state).frames.len(),
            1 + burst,
            "one heartbeat, first"
        );
        assert_eq!(receiver.try_recv(), Ok(Frame::Heartbeat));
        for _ in 0..burst {
            assert_eq!(receiver.try_recv(), Ok(Frame::Data(Bytes::new())));
        }
        assert!(lock(&rx.state).frames.capacity() > KEPT_QUEUE);
        assert_eq!(receiver.try_recv(), Err(RecvError::Empty));
        assert_eq!(lock(&rx.state).frames.capacity(), KEPT_QUEUE);
        rx.push_unwoken(Frame::Heartbeat, 0);
        assert_eq!(receiver.try_recv(), Ok(Frame::Heartbeat), "alone, it goes");
    }

    /// Pushes one frame to each slot, unwoken, and collects the wake-ups owed.
    fn feed(slots: &[Arc<RxSlot>]) -> ReceiverWakes {
        let mut woken = ReceiverWakes::default();
        for rx in slots {
            assert!(lock(&rx.state).waiter.is_some(), "the consumer waits");
            let Pushed::ReceiverWaiting(waiter) = rx.push_unwoken(Frame::Data(record(4)), 4) else {
                panic!("the consumer waits");
            };
            woken.push(waiter);
        }
        woken
    }

    #[tokio::test]
    async fn deferred_receivers_run_after_the_task_that_deferred_them_yields_once() {
        let (slots, consumers, order) = waiting_consumers(8);
        for _ in 0..10 {
            tokio::task::yield_now().await; // every consumer now waits
        }
        feed(&slots).defer();
        assert!(lock(&order).is_empty(), "nothing runs before we yield");
        // The first went to the run queue; the rest wait for the runtime's
        // deferred wake-ups, which come after this task's own yield.
        tokio::task::yield_now().await;
        assert_eq!(*lock(&order), [0], "only the first was woken at once");
        for consumer in consumers {
            tokio::time::timeout(WAIT, consumer)
                .await
                .expect("every deferred receiver is woken")
                .unwrap();
        }
        assert_eq!(lock(&order).len(), 8);
    }

    #[tokio::test]
    async fn wake_now_wakes_what_the_runtime_has_not_yet() {
        let (slots, consumers, order) = waiting_consumers(8);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let mut deferred = feed(&slots).defer();
        // The next batch's turn comes before this worker ran its deferred
        // list: everyone is queued now, ahead of our yield.
        deferred.wake_now();
        tokio::task::yield_now().await;
        assert_eq!(lock(&order).len(), 8);
        deferred.wake_now(); // nothing left: a no-op
        for consumer in consumers {
            consumer.await.unwrap();
        }
    }

    #[tokio::test]
    async fn dropped_receiver_wakes_wake_everyone_at_once() {
        let (slots, consumers, order) = waiting_consumers(8);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        drop(feed(&slots));
        tokio::task::yield_now().await;
        assert_eq!(lock(&order).len(), 8, "all were queued before our yield");
        for consumer in consumers {
            consumer.await.unwrap();
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deferred_wakes_reach_every_receiver_on_a_multi_thread_runtime() {
        for _ in 0..50 {
            let (slots, consumers, order) = waiting_consumers(64);
            // Wait until every consumer is parked on its slot.
            for rx in &slots {
                while lock(&rx.state).waiter.is_none() {
                    tokio::task::yield_now().await;
                }
            }
            feed(&slots).defer();
            for consumer in consumers {
                tokio::time::timeout(WAIT, consumer)
                    .await
                    .expect("no deferred receiver is missed")
                    .unwrap();
            }
            assert_eq!(lock(&order).len(), 64);
        }
    }

    #[test]
    fn deferred_wakes_outside_a_runtime_wake_at_once() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let (slots, consumers, order) = rt.block_on(async {
            let spawned = waiting_consumers(4);
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            spawned
        });
        // No runtime context here: `defer` must not leave anyone asleep.
        feed(&slots).defer();
        rt.block_on(async {
            for consumer in consumers {
                tokio::time::timeout(WAIT, consumer).await.unwrap().unwrap();
            }
        });
        assert_eq!(lock(&order).len(), 4);
    }

    #[test]
    fn one_peer_leaves_at_most_its_cap_of_streams_waiting_for_a_bind() {
        let registry = Registry::new(64 * 1024, 64, 2);
        let (one, other) = (control(1 << 20), {
            let counters = Arc::new(Counters::default());
            Arc::new(PeerControl::new(PeerId(3), 1 << 20, counters))
        });
        let key = |n| StreamKey::new(5, n);
        for n in 0..2 {
            let OpenOutcome::Attached(rx) = registry.open(key(n), &one) else {
                panic!("under the cap");
            };
            rx.end(Frame::Finalized); // ended, still waiting for a bind
        }
        assert!(matches!(registry.open(key(2), &one), OpenOutcome::Refused));
        assert!(matches!(
            registry.open(key(3), &other),
            OpenOutcome::Attached(_)
        ));
        // A stream the node bound first is not waiting on anyone.
        let _bound = registry.bind(key(4)).unwrap();
        assert!(matches!(
            registry.open(key(4), &one),
            OpenOutcome::Attached(_)
        ));
        assert_eq!(registry.unbound_of(PeerId(2)), 2);
        // Binding one of the waiting streams makes room again.
        let mut late = registry.bind(key(0)).unwrap();
        assert_eq!(registry.unbound_of(PeerId(2)), 1);
        assert!(matches!(late.try_recv(), Ok(Frame::Finalized)));
        assert!(matches!(
            registry.open(key(2), &one),
            OpenOutcome::Attached(_)
        ));
        assert_eq!(registry.unbound_of(PeerId(2)), 2);
    }

    /// At a cap of 0 every open for a key nobody bound is refused, and the
    /// refusal leaves the peer no entry: it used to leave a count of 0 for
    /// good, so the node counted that peer as holding something here
    /// against `max_peers` after it left (audit 46c).
    #[test]
    fn an_open_refused_at_a_cap_of_zero_leaves_the_peer_nothing_here() {
        let registry = Registry::new(64 * 1024, 64, 0);
        let one = control(1 << 20);
        assert!(matches!(
            registry.open(StreamKey::new(5, 0), &one),
            OpenOutcome::Refused
        ));
        assert!(registry.peers_with_unbound().is_empty());
        assert_eq!(registry.unbound_of(PeerId(2)), 0);
    }

    /// A binding given up before any peer fed it (velo gave up on the
    /// stream): a late OpenSlot for its key is refused, so its sender
    /// hears, where it used to fill a fresh entry nobody would bind and
    /// block on its window for good; binding the key again takes opens.
    /// A binding only dropped lets a late open wait for the next bind.
    #[test]
    fn a_late_open_for_an_abandoned_binding_is_refused_until_a_bind() {
        let registry = Registry::new(64 * 1024, 16, 16);
        let control = control(1 << 20);
        let key = StreamKey::new(8, 1);
        registry.bind(key).unwrap().abandon();
        assert!(matches!(registry.open(key, &control), OpenOutcome::Refused));
        assert_eq!(registry.unbound_of(PeerId(2)), 0, "no entry left waiting");
        let dropped = StreamKey::new(8, 3);
        drop(registry.bind(dropped).unwrap());
        assert!(matches!(
            registry.open(dropped, &control),
            OpenOutcome::Attached(_)
        ));
        // A binding fed, then ended, is not abandoned: a new open is a new stream.
        let fed = StreamKey::new(8, 2);
        let rx = registry.bind(fed).unwrap();
        let OpenOutcome::Attached(slot) = registry.open(fed, &control) else {
            panic!("the binding takes the peer's open");
        };
        slot.end(Frame::Finalized);
        rx.abandon();
        assert!(matches!(
            registry.open(fed, &control),
            OpenOutcome::Attached(_)
        ));
        // Bound again, the abandoned key takes an open.
        let _again = registry.bind(key).unwrap();
        assert!(matches!(
            registry.open(key, &control),
            OpenOutcome::Attached(_)
        ));
    }

    /// An abandoned binding is remembered for [`ABANDONED_FOR`]: an open
    /// for its key within that is refused, one after it is a new stream.
    #[tokio::test(start_paused = true)]
    async fn an_abandoned_binding_is_forgotten_after_its_time() {
        let registry = Registry::new(64 * 1024, 16, 16);
        let control = control(1 << 20);
        let key = StreamKey::new(8, 1);
        registry.bind(key).unwrap().abandon();
        tokio::time::advance(ABANDONED_FOR - std::time::Duration::from_secs(1)).await;
        assert!(matches!(registry.open(key, &control), OpenOutcome::Refused));
        tokio::time::advance(std::time::Duration::from_secs(1)).await;
        assert!(matches!(
            registry.open(key, &control),
            OpenOutcome::Attached(_)
        ));
        assert_eq!(registry.bindings_abandoned(), 1);
    }

    /// Found by the `mux_peer` fuzz target (its RSS grew without end): a slot
    /// that marks itself dirty sits on its peer's list, and a strong
    /// reference back to the peer made a cycle nothing dropped. Both kinds:
    /// an ended slot whose consumer took the rest, a live one whose consumer
    /// left.
    #[test]
    fn a_slot_on_its_peers_dirty_list_does_not_keep_the_peer_alive() {
        let registry = Registry::new(64 * 1024, 16, 16);
        let control = control(1 << 20);
        let key = StreamKey::new(6, 1);
        let mut rx = registry.bind(key).unwrap();
        let OpenOutcome::Attached(slot) = registry.open(key, &control) else {
            panic!("the binding takes the peer's open");
        };
        assert!(slot.push(Frame::Data(record(4)), 4));
        assert!(slot.end(Frame::Finalized));
        assert!(matches!(rx.try_recv(), Ok(Frame::Data(_))));
        assert!(matches!(rx.try_recv(), Ok(Frame::Finalized)));
        assert_eq!(
            control.state().dirty_rx.len(),
            1,
            "the terminal told the peer"
        );
        let live_key = StreamKey::new(6, 2);
        let live_rx = registry.bind(live_key).unwrap();
        let OpenOutcome::Attached(live) = registry.open(live_key, &control) else {
            panic!("the binding takes the peer's open");
        };
        drop(live_rx);
        assert_eq!(
            control.state().dirty_rx.len(),
            2,
            "the consumer's leaving told the peer"
        );
        let peer = Arc::downgrade(&control);
        drop((rx, slot, live, control, registry));
        assert!(
            peer.upgrade().is_none(),
            "a cycle keeps the peer's state alive"
        );
    }
}
