//! The mux engine: a [`Mux`] per node and one task per peer driving a
//! [`PeerCore`](core::PeerCore) over that peer's current [`Link`].
//!
//! ```text
//!  Mux::open / bind / flush ──► PeerControl (coalesced) ──wake──┐
//!  Mux::attach(peer, link) ──► PeerEntry.incoming ──────────────┤
//!      (the link it replaces, unserved ──► PeerEntry.superseded) ▼
//!                     peer task: loop { wait for a link; read out superseded; run_epoch(link); fail_all }
//!                     run_epoch:  select { recv → handle_batch
//!                                          | wake → handle_control (→ poll_batch → post, room permitting)
//!                                          | reserve (if the gate says) → poll_batch → post
//!                                          | timer → handle_timeout | newer link → Replaced }
//!  SlotSender::send, the task waiting with nothing to write (EpochCell):
//!                     the producer's own turn: handle_control → try_reserve → poll_batch → post
//!  the link's reader, a batch ready and the task waiting (EpochCell as Arrivals):
//!                     the reader's own turn: try_recv → handle_batch → wake consumers
//! ```
//!
//! The link layer owns connecting: the mux asks through [`Dialer::want_link`]
//! and is handed each new epoch's link with [`Mux::attach`].

mod core;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod held;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until};
use tracing::Instrument;

use self::core::{PeerCore, SinkSlot};
pub use self::error::ProtocolError;
use self::held::Held;
use super::config::{FlushPolicy, MuxConfig, PeerTerms};
use super::message::{MessageSink, OutboundMessage};
use super::protocol::Epoch;
use super::slot::{Deferred, Inlet, InlineWriter, PeerControl, Registry, SlotReceiver, SlotSender};
use super::stats::{Counters, Stats};
use super::surface::{AsMux, DropReason, Frame, MuxError, MuxTransport, PeerId, StreamKey};
use crate::link::{Arrivals, EpochEnd, Link, LinkError, LinkFault};
use crate::stages::{self, Stage};
use crate::unwind::{CatchPanic, panic_message};

/// How often a peer with work and no link asks its dialer again.
const REDIAL_INTERVAL: Duration = Duration::from_secs(1);
/// The pause before a peer task that panicked outside an epoch runs again,
/// doubling while it keeps panicking.
const RESTART_MIN: Duration = Duration::from_millis(1);
const RESTART_MAX: Duration = Duration::from_secs(1);
/// Registry entries (bound or opened streams) per node.
const MAX_REGISTRY_ENTRIES: usize = 1 << 20;
/// Links kept to read out before the next is served (the oldest goes unread
/// past this).
const SUPERSEDED_MAX: usize = 4;

/// Brings links up on the mux's behalf.
pub trait Dialer: Send + Sync + 'static {
    /// The mux has work for `peer` and no link; connect and then call
    /// [`Mux::attach`]. Called again while no link arrives; must be idempotent.
    fn want_link(&self, peer: PeerId);

    /// The mux has let go of `peer`'s link: its epoch ended and the mux holds
    /// no handle to it any more. A connector may let go of what it keeps for
    /// the peer too. Default: nothing.
    fn link_released(&self, peer: PeerId) {
        let _ = peer;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().expect("mux engine state poisoned")
}

struct PeerEntry<L> {
    control: Arc<PeerControl>,
    /// The outbound message channel for the current (or next) epoch.
    messages: Mutex<Option<flume::Receiver<OutboundMessage>>>,
    incoming: Mutex<Option<Handed<L>>>,
    /// Links to read out, oldest first, before the next one is served: those
    /// a newer one replaced in `incoming` before the task took them up
    /// (docs/design.md § "A replaced link delivers what its peer sent"), and
    /// those handed over only to be read out ([`Mux::read_out_with_terms`]).
    superseded: Mutex<VecDeque<Handed<L>>>,
    link_arrived: Notify,
    epoch: Mutex<Option<Epoch>>,
    /// The last epoch this mux ended over the peer's protocol violation.
    violated_in: Mutex<Option<Epoch>>,
    /// The newest epoch handed to the peer task, and the newest it has
    /// served to its end (and judged): [`Mux::is_judging`].
    handed_through: Mutex<Option<Epoch>>,
    served_through: Mutex<Option<Epoch>>,
    /// Epochs that carried a message (or may have: a cut delivery) and
    /// ended without a Goodbye either way ([`Mux::epochs_lost`]).
    epochs_lost: Mutex<EpochLosses>,
}

/// A peer's epochs that carried a message, or may have, and ended without
/// a Goodbye ([`Mux::epochs_lost`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpochLosses {
    /// How many since the peer's task started.
    pub count: u64,
    /// When the latest of them ended; `None` before the first.
    pub last: Option<std::time::Instant>,
}

/// What the two hellos of an epoch said about peer credit and windows.
#[derive(Clone, Copy, Debug)]
struct Opening {
    theirs: PeerTerms,
    /// The peer credit our hello gave the peer to start with.
    granted: u32,
}

struct Shared<L> {
    config: Arc<MuxConfig>,
    counters: Arc<Counters>,
    registry: Arc<Registry>,
    peers: Mutex<HashMap<PeerId, Arc<PeerEntry<L>>>>,
    dialer: Arc<dyn Dialer>,
    runtime: tokio::runtime::Handle,
    shutdown: AtomicBool,
    shutdown_notify: Notify,
    sink: SinkSlot,
    /// Fires whenever a peer task retires.
    retired: Notify,
}

/// A node's slot mux over links of type `L`. Cheap to clone.
pub struct Mux<L: Link> {
    shared: Arc<Shared<L>>,
}

impl<L: Link> Clone for Mux<L> {
    fn clone(&self) -> Self {
        Mux {
            shared: self.shared.clone(),
        }
    }
}

impl<L: Link> Mux<L> {
    /// Creates a mux whose peer tasks run on the current tokio runtime.
    /// A configuration [`MuxConfig::check`] refuses is logged, and its
    /// timers run clamped into range.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn new(config: MuxConfig, dialer: Arc<dyn Dialer>) -> Mux<L> {
        if let Err(err) = config.check() {
            // The nodes refuse to start on it; a mux made directly warns
            // (and runs its timers in range, so no deadline overflows).
            tracing::warn!(%err, "a mux configuration the nodes refuse");
        }
        let config = config.with_timers_in_range();
        let registry = Registry::new(
            config.slot_window,
            MAX_REGISTRY_ENTRIES,
            config.max_unbound_per_peer as usize,
        );
        Mux {
            shared: Arc::new(Shared {
                config: Arc::new(config),
                counters: Arc::new(Counters::default()),
                registry,
                peers: Mutex::new(HashMap::new()),
                dialer,
                runtime: tokio::runtime::Handle::current(),
                shutdown: AtomicBool::new(false),
                shutdown_notify: Notify::new(),
                sink: SinkSlot::default(),
                retired: Notify::new(),
            }),
        }
    }

    /// The configuration this mux runs with.
    pub fn config(&self) -> &MuxConfig {
        &self.shared.config
    }

    /// Hands the mux the link for a new epoch with `peer`. A link already
    /// running for that peer ends with [`EpochEnd::Replaced`]. With no
    /// handshake, the peer's terms are taken to be this mux's own and each
    /// side to start on the other's whole peer window, as a peer attached
    /// the same way assumes (tests with raw peers); so the peer window bounds
    /// each epoch, not the peer across epochs. A link layer that ran a
    /// handshake uses [`Mux::attach_with_terms`] with [`Mux::peer_room`].
    pub fn attach(&self, peer: PeerId, link: L) {
        let own = PeerTerms::announced_by(self.config());
        self.attach_with_terms(peer, link, own, own.peer_credit);
    }

    /// The peer credit to give `peer` at the start of its next epoch, for the
    /// hello: our peer window less what we still hold of its data (streams
    /// closed or dropped but not yet read) and, while an epoch with it is
    /// still live, less what that epoch may yet receive, and less what the
    /// links handed over but not yet served were granted. Counted per peer
    /// across epochs, so a reconnect does not bring a fresh window; room
    /// found free when the epoch starts is granted then.
    pub fn peer_room(&self, peer: PeerId) -> u32 {
        let window = self.shared.config.peer_window;
        let held = lock(&self.shared.peers).get(&peer).map_or(0, |entry| {
            // Unserved first: an epoch starting meanwhile publishes its grant
            // as committed before it leaves `unserved_grants`, so a grant is
            // counted twice rather than missed.
            let unserved = entry.control.unserved_grants.load(Ordering::Acquire);
            unserved.saturating_add(entry.control.peer_committed.load(Ordering::Acquire))
        });
        u32::try_from(u64::from(window).saturating_sub(held)).unwrap_or(window)
    }

    /// The largest record or message `peer` takes, as the terms of its
    /// latest epoch said (a limit of 0 reads 1); `None` before any epoch
    /// with it.
    pub fn peer_max_record(&self, peer: PeerId) -> Option<usize> {
        let max = lock(&self.shared.peers)
            .get(&peer)?
            .control
            .peer_max_record
            .load(Ordering::Acquire);
        (max > 0).then_some(max)
    }

    /// [`Mux::attach`] with what the handshake said: the epoch's slots send
    /// within the peer's windows (not ours) starting from the credit it
    /// gave us, and `granted` is the credit our hello gave it (what
    /// [`Mux::peer_room`] said when the hello was written).
    pub fn attach_with_terms(&self, peer: PeerId, link: L, terms: PeerTerms, granted: u32) {
        let opening = Opening {
            theirs: terms,
            granted,
        };
        self.hand_to_task(peer, link, opening, Self::hand_over);
    }

    /// Gives `link` to `peer`'s task with `hand`, making a fresh entry in
    /// place of a retired one. While shutting down, only a peer still
    /// draining its queue takes it; otherwise it ends `Shutdown`.
    fn hand_to_task(
        &self,
        peer: PeerId,
        mut link: L,
        opening: Opening,
        hand: fn(&PeerEntry<L>, L, Opening) -> Result<(), L>,
    ) {
        loop {
            let shutting_down = self.shared.shutdown.load(Ordering::Acquire);
            let entry = if shutting_down {
                // A peer still draining its queue may take a link; nobody else.
                match lock(&self.shared.peers).get(&peer).cloned() {
                    Some(entry) => entry,
                    None => {
                        link.fail(EpochEnd::Shutdown);
                        return;
                    }
                }
            } else {
                self.entry(peer)
            };
            match hand(&entry, link, opening) {
                Ok(()) => return,
                // Gone from the map: `entry` makes a fresh one.
                Err(back) if !shutting_down => link = back,
                Err(back) => {
                    back.fail(EpochEnd::Shutdown);
                    return;
                }
            }
        }
    }

    /// Hands over `link` to be read out, not served: what the peer sent on
    /// it is delivered and its streams end, and none of our slots or
    /// messages go out on it. For a link the connector must refuse after the
    /// peer may already have sent on it (the peer was forgotten while our
    /// dial finished); `link` should already be ended. The peer task reads
    /// it before the next link it serves (docs/design.md § "A closed link
    /// delivers both ways").
    pub fn read_out_with_terms(&self, peer: PeerId, link: L, terms: PeerTerms, granted: u32) {
        let opening = Opening {
            theirs: terms,
            granted,
        };
        self.hand_to_task(peer, link, opening, Self::hand_over_read_out);
    }

    /// Queues `link` among the links to read out before the next one is
    /// served, unless the entry has retired (then the link comes back).
    fn hand_over_read_out(entry: &PeerEntry<L>, link: L, opening: Opening) -> Result<(), L> {
        let control = entry.control.state();
        if control.retired {
            return Err(link);
        }
        // An older link waiting to be served is read out first, in epoch
        // order, and not served after this one; closed gracefully, so its
        // peer's last batches are read out too.
        let older = lock(&entry.incoming).take_if(|(waiting, ..)| waiting.epoch() < link.epoch());
        if let Some(older) = older {
            older.0.fail(EpochEnd::Closed);
            push_superseded(entry, older);
        }
        let grant = UnservedGrant::new(&entry.control, opening.granted);
        push_superseded(entry, (link, opening, grant));
        drop(control);
        entry.link_arrived.notify_one();
        Ok(())
    }

    /// Gives `entry`'s task its next link, unless the entry has retired
    /// (then the link comes back): decided under the lock `retire` decides
    /// under, since a link left in a retired entry would be neither served
    /// nor failed, and the node would count the peer linked.
    fn hand_over(entry: &PeerEntry<L>, link: L, opening: Opening) -> Result<(), L> {
        let mut control = entry.control.state();
        if control.retired {
            return Err(link);
        }
        control.let_go = false;
        let mut handed = lock(&entry.handed_through);
        *handed = (*handed).max(Some(link.epoch()));
        drop(handed);
        let grant = UnservedGrant::new(&entry.control, opening.granted);
        let previous = lock(&entry.incoming).replace((link, opening, grant));
        if let Some((stale, opening, grant)) = previous {
            // Ended (its read-out waits for that) and kept under the control
            // lock with the replace, so the task that takes up the newer link
            // finds the older one here.
            stale.fail(EpochEnd::Replaced);
            push_superseded(entry, (stale, opening, grant));
        }
        drop(control);
        entry.link_arrived.notify_one();
        Ok(())
    }

    /// The connector has forgotten `peer` (it was unregistered): no link to
    /// it comes unless it is registered again. Its slots opened before this
    /// call and waiting for a link end with [`DropReason::Unregistered`]
    /// once its peer task next waits for one: at once if it waits now, else
    /// when the epoch it serves ends (the slots whose Open never left that
    /// epoch then end so too). Slots opened after it wait as any do (the
    /// peer may be registered again). Messages keep their own deadlines.
    pub fn forget_peer(&self, peer: PeerId) {
        self.end_waiting_slots(peer, DropReason::Unregistered);
    }

    /// The connector found `peer` unreachable until a setting changes at
    /// one end (a dial no redial mends: another transport, an endpoint one
    /// end cannot use). As for [`Mux::forget_peer`], its slots opened
    /// before this call and waiting for a link end, with
    /// [`DropReason::Unreachable`]; later ones wait for a link, and end so
    /// too if the next dial (after the connector's backoff) fails the same
    /// way (the mux's or an explicit connect). Nothing while the mux serves
    /// or reads out an epoch with the peer: it is reachable.
    pub fn peer_unreachable(&self, peer: PeerId) {
        // A served epoch proves the peer reachable; its slots go on with it.
        if self.epoch(peer).is_none() {
            self.end_waiting_slots(peer, DropReason::Unreachable);
        }
    }

    fn end_waiting_slots(&self, peer: PeerId, reason: DropReason) {
        let Some(entry) = lock(&self.shared.peers).get(&peer).cloned() else {
            return;
        };
        let mut control = entry.control.state();
        entry.control.waits_ended.fetch_add(1, Ordering::AcqRel);
        control.end_waiting = Some(reason);
        drop(control);
        entry.control.wake.notify_one();
    }

    /// The connector has let `peer` go: it only dialled in, its last link
    /// is over, and nothing dials it back. Its task retires as soon as it
    /// holds nothing (no bytes of the peer's unread, no slot waiting for a
    /// link), where it would wait out `idle_retire` for a peer that may
    /// come back: a crowd of fresh ids that handshake and go leaves no
    /// entries and tasks behind (docs/design.md § "A peer counts against
    /// `max_peers` while anything of it is kept"). A link handed over
    /// before then keeps the entry, as for any peer.
    pub fn let_go_peer(&self, peer: PeerId) {
        let Some(entry) = lock(&self.shared.peers).get(&peer).cloned() else {
            return;
        };
        entry.control.state().let_go = true;
        entry.control.wake.notify_one();
    }

    /// Stops the mux: each peer task writes what producers already queued
    /// (bounded by `shutdown_linger`), says goodbye, and ends its epoch; live
    /// slots then get `Dropped(Shutdown)`. Does not wait; see [`Mux::closed`].
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared
            .registry
            .end_unfed(&Frame::Dropped(DropReason::Shutdown));
        self.shared.shutdown_notify.notify_waiters();
        for entry in lock(&self.shared.peers).values() {
            entry.control.wake.notify_one();
        }
    }

    /// Sets where inbound messages go (once; later calls are ignored and
    /// return false). Until then they are counted as `no_message_handler`.
    pub fn set_message_sink(&self, sink: Arc<dyn MessageSink>) -> bool {
        self.shared.sink.set(sink).is_ok()
    }

    /// Hands the peer task the channel its outbound messages come from. The
    /// channel lives for one epoch: when the epoch ends, what is left in it is
    /// dropped (reporting each message) and the receiver closes, so the
    /// sender knows to install a fresh one. A channel installed while no
    /// epoch runs serves the next one. Returns the channel it replaced if
    /// no epoch had taken it yet: once it and its senders are dropped, each
    /// message in it reports itself, which may call back into the caller,
    /// so drop it outside your locks.
    pub fn install_messages(
        &self,
        peer: PeerId,
        rx: flume::Receiver<OutboundMessage>,
    ) -> Option<flume::Receiver<OutboundMessage>> {
        loop {
            let entry = self.entry(peer);
            // As in `attach_with_terms`: never into an entry that retired.
            let control = entry.control.state();
            if control.retired {
                continue;
            }
            let stale = lock(&entry.messages).replace(rx);
            drop(control);
            if lock(&entry.epoch).is_none() {
                self.shared.dialer.want_link(peer);
            }
            entry.control.wake.notify_one();
            return stale;
        }
    }

    /// Whether this mux ended `peer`'s epoch `epoch` over a protocol
    /// violation: the link may have recorded another end first (the peer
    /// closed right after its offending batch), and a connector deciding
    /// how soon to redial wants the verdict.
    pub fn ended_in_violation(&self, peer: PeerId, epoch: Epoch) -> bool {
        lock(&self.shared.peers)
            .get(&peer)
            .is_some_and(|entry| *lock(&entry.violated_in) == Some(epoch))
    }

    /// Whether `peer`'s epoch `epoch` was handed to this mux and it has not
    /// yet served it to its end: until then [`Mux::ended_in_violation`] may
    /// not know the answer (a peer whose bad batch and close arrive with its
    /// handshake ends the link before the mux reads the batch), and
    /// [`Dialer::link_released`] comes when it is done.
    pub fn is_judging(&self, peer: PeerId, epoch: Epoch) -> bool {
        let Some(entry) = lock(&self.shared.peers).get(&peer).cloned() else {
            return false;
        };
        let handed = *lock(&entry.handed_through) >= Some(epoch);
        handed && *lock(&entry.served_through) < Some(epoch)
    }

    /// `peer`'s epochs that carried a message either way and ended without
    /// a Goodbye either way (the link failed or closed under us, the peer
    /// vanished or broke the protocol, a new link replaced it) since its
    /// peer task started; none without one. An epoch whose link dropped
    /// batches it had completed ([`EpochEnd::cut_delivery`], also after a
    /// Goodbye: the link's verdict on a close's read-out) counts too: what
    /// it dropped may have been a message. What was written into such an
    /// epoch may not have arrived, so a layer with state of its own over the
    /// messages (velo's messenger mux) must be told; an epoch that carried
    /// only streams' records lost nothing of that layer's. A peer task that
    /// retired and started again counts afresh.
    pub fn epochs_lost(&self, peer: PeerId) -> EpochLosses {
        lock(&self.shared.peers)
            .get(&peer)
            .map_or_else(EpochLosses::default, |entry| *lock(&entry.epochs_lost))
    }

    /// Withdraws `peer`'s message channel without asking for a link: the
    /// channel an epoch serves is dropped at the peer task's next turn, and
    /// one no epoch has taken yet is returned, to be dropped outside the
    /// caller's locks (with its senders gone, each message left in it
    /// reports itself).
    pub fn withdraw_messages(&self, peer: PeerId) -> Option<flume::Receiver<OutboundMessage>> {
        let entry = lock(&self.shared.peers).get(&peer).cloned()?;
        let (closed_tx, closed_rx) = flume::bounded(1);
        drop(closed_tx);
        let stale = lock(&entry.messages).replace(closed_rx);
        entry.control.wake.notify_one();
        stale
    }

    /// Round trip of a Ping control record to `peer` (connecting if needed).
    /// Pings ride ahead of data in the next batch, so a congested slot does
    /// not delay them; the caller bounds the wait (e.g. `tokio::time::timeout`).
    pub async fn ping(&self, peer: PeerId) -> Result<Duration, MuxError> {
        if self.shared.shutdown.load(Ordering::Acquire) {
            return Err(MuxError::Shutdown);
        }
        let entry = self.entry(peer);
        let start = Instant::now();
        if lock(&entry.epoch).is_none() {
            self.shared.dialer.want_link(peer);
        }
        entry.control.ping().await;
        Ok(start.elapsed())
    }

    /// Resolves once every peer task has retired (after [`Mux::shutdown`]:
    /// once queued records are written, bounded by `shutdown_linger`, and
    /// every epoch has ended).
    pub async fn closed(&self) {
        loop {
            let retired = self.shared.retired.notified();
            tokio::pin!(retired);
            retired.as_mut().enable();
            if lock(&self.shared.peers).is_empty() {
                return;
            }
            retired.await;
        }
    }

    /// Number of peers with a running task.
    pub fn peer_count(&self) -> usize {
        lock(&self.shared.peers).len()
    }

    /// The peers this node keeps something of, linked or not: bytes unread
    /// in their streams (a peer task does not retire while it holds any, so
    /// a peer gone keeps this memory until it is read), or streams their
    /// opens created that nobody has bound yet (registry entries, kept
    /// until a `bind`). Sorted, each once.
    pub fn peers_holding(&self) -> Vec<PeerId> {
        self.peers_kept()
            .into_iter()
            .filter_map(|(peer, holding)| holding.then_some(peer))
            .collect()
    }

    /// The peers this node has a task for or keeps unbound streams of, each
    /// with whether it holds something ([`Mux::peers_holding`]): a peer
    /// kept but holding nothing may still come to (its task is draining a
    /// link). Sorted by id, each once.
    pub fn peers_kept(&self) -> Vec<(PeerId, bool)> {
        let mut kept: Vec<(PeerId, bool)> = lock(&self.shared.peers)
            .iter()
            .map(|(peer, entry)| (*peer, entry.control.peer_held.load(Ordering::Acquire) > 0))
            .collect();
        kept.extend(
            self.shared
                .registry
                .peers_with_unbound()
                .into_iter()
                .map(|peer| (peer, true)),
        );
        // Holding first within an id, so the dedup keeps it.
        kept.sort_unstable_by_key(|(peer, holding)| (*peer, !*holding));
        kept.dedup_by_key(|(peer, _)| *peer);
        kept
    }

    fn entry(&self, peer: PeerId) -> Arc<PeerEntry<L>> {
        let mut peers = lock(&self.shared.peers);
        if let Some(entry) = peers.get(&peer) {
            return entry.clone();
        }
        let entry = Arc::new(PeerEntry {
            control: Arc::new(PeerControl::new(
                peer,
                self.shared.config.peer_budget,
                self.shared.counters.clone(),
            )),
            messages: Mutex::new(None),
            incoming: Mutex::new(None),
            superseded: Mutex::new(VecDeque::new()),
            link_arrived: Notify::new(),
            epoch: Mutex::new(None),
            violated_in: Mutex::new(None),
            handed_through: Mutex::new(None),
            served_through: Mutex::new(None),
            epochs_lost: Mutex::new(EpochLosses::default()),
        });
        peers.insert(peer, entry.clone());
        drop(peers);
        let shared = self.shared.clone();
        let task_entry = entry.clone();
        self.shared.runtime.spawn(async move {
            // What the peer's closed streams still hold here, from epoch to
            // epoch, and across a restart.
            let mut held = Held::default();
            let mut backoff = Duration::ZERO;
            loop {
                let started = Instant::now();
                let run = run_peer(shared.clone(), task_entry.clone(), &mut held);
                let Err(panic) = CatchPanic(Box::pin(run)).await else {
                    return;
                };
                // Outside an epoch's turns (an epoch's own panic ends only
                // the epoch): the entry, its control and the slots queued on
                // it stay, and a fresh run of the task serves them, after a
                // pause that doubles if the panic recurs. Not once the node
                // shuts down or the entry has left the map (retired).
                Counters::add(&shared.counters.peer_task_panics, 1);
                tracing::error!(
                    ?peer,
                    panic = panic_message(&*panic),
                    "mux peer task panicked outside an epoch"
                );
                let serving = task_entry
                    .epoch
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                task_entry.epoch.clear_poison();
                // What it served or had taken up is over, judged as far as
                // it got: a connector waiting on the verdict asks again.
                // Caught: a panic here (a poisoned lock) must not end the
                // restart loop, or the peer's slots would never hear.
                let released = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    release_after_panic(&shared, &task_entry, serving);
                }));
                if released.is_err() {
                    tracing::error!(?peer, "releasing the link after a panic panicked");
                }
                if !restart_after_panic(&shared, &task_entry) {
                    return;
                }
                backoff = if started.elapsed() > RESTART_MAX {
                    RESTART_MIN
                } else {
                    (backoff * 2).clamp(RESTART_MIN, RESTART_MAX)
                };
                let shutdown = shared.shutdown_notify.notified();
                tokio::pin!(shutdown);
                shutdown.as_mut().enable();
                if !shared.shutdown.load(Ordering::Acquire) {
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = shutdown => {}
                    }
                }
            }
        });
        entry
    }
}

impl<L: Link> MuxTransport for Mux<L> {
    fn open(&self, peer: PeerId, key: StreamKey) -> Result<SlotSender, MuxError> {
        loop {
            if self.shared.shutdown.load(Ordering::Acquire) {
                return Err(MuxError::Shutdown);
            }
            let entry = self.entry(peer);
            let config = &self.shared.config;
            // The peer's limit too, once an epoch's terms said it: opens
            // past it would only be refused there.
            let theirs = entry.control.peer_max_slots.load(Ordering::Acquire);
            let limit = u32::try_from(theirs).map_or(config.max_slots_per_peer, |theirs| {
                theirs.min(config.max_slots_per_peer)
            });
            // Every inlet is admitted first; it releases its count when it ends.
            if !entry.control.admit_egress(limit as usize) {
                return Err(MuxError::SlotLimit { peer, limit });
            }
            let inlet = Inlet::new(
                key,
                entry.control.clone(),
                config.slot_budget,
                config.max_record.max(1),
            );
            if inlet.announce() {
                return Ok(SlotSender::new(inlet));
            }
            // The peer's task retired between lookup and announce: its entry
            // is gone (or going); the next lookup spawns a fresh one.
            let mut peers = lock(&self.shared.peers);
            if peers.get(&peer).is_some_and(|e| Arc::ptr_eq(e, &entry)) {
                peers.remove(&peer);
            }
        }
    }

    fn bind(&self, key: StreamKey) -> Result<SlotReceiver, MuxError> {
        if self.shared.shutdown.load(Ordering::Acquire) {
            return Err(MuxError::Shutdown);
        }
        self.shared.registry.bind(key)
    }

    fn flush(&self, peer: PeerId) -> Result<(), MuxError> {
        let entry = lock(&self.shared.peers).get(&peer).cloned();
        if let Some(entry) = entry {
            entry.control.request_flush();
        }
        Ok(())
    }

    fn epoch(&self, peer: PeerId) -> Option<Epoch> {
        let entry = lock(&self.shared.peers).get(&peer).cloned()?;
        *lock(&entry.epoch)
    }

    fn stats(&self) -> Stats {
        let mut stats = self.shared.counters.snapshot();
        stats.bindings_abandoned = self.shared.registry.bindings_abandoned();
        stats
    }
}

impl<L: Link> AsMux for Mux<L> {
    fn as_mux(&self) -> Option<&dyn MuxTransport> {
        Some(self)
    }
}

async fn run_peer<L: Link>(shared: Arc<Shared<L>>, entry: Arc<PeerEntry<L>>, held: &mut Held) {
    let peer = entry.control.peer;
    // When the last epoch died (not a graceful end): the reconnect clock.
    let mut died: Option<Instant> = None;
    loop {
        let Some((newest, superseded)) = wait_for_link(&shared, &entry, held).await else {
            tracing::debug!(?peer, "mux peer task retired");
            return;
        };
        if let Some(at) = died.take_if(|_| newest.is_some()) {
            shared.counters.record_reconnect(at.elapsed());
        }
        // Should a read-out panic past its catch, the newest link, which the
        // connector counts live, is ended too.
        let mut waiting = newest.as_ref().map(|(link, ..)| FailUnlessFinished {
            link,
            finished: false,
        });
        for (old, opening, grant) in superseded {
            let span = tracing::debug_span!("epoch", ?peer, epoch = %old.epoch());
            let old = (old, opening, grant);
            (_, *held) = run_epoch(&shared, &entry, old, held.clone(), Serve::ReadOut)
                .instrument(span)
                .await;
        }
        if let Some(waiting) = &mut waiting {
            waiting.finished = true;
        }
        drop(waiting);
        let Some((link, opening, grant)) = newest else {
            continue;
        };
        let epoch = link.epoch();
        let span = tracing::debug_span!("epoch", ?peer, %epoch);
        // Instrumented, not entered: a guard held across an await leaks the
        // span into whatever else runs on this thread.
        let end;
        // A copy: should the epoch panic outside its own catch (a bug of
        // ours; senders' hooks are caught where they run), the restart keeps
        // what was held before this epoch, not nothing (it misses slots
        // closed during the epoch, and counts bytes read meanwhile until
        // their slots finish).
        let link = (link, opening, grant);
        (end, *held) = run_epoch(&shared, &entry, link, held.clone(), Serve::Whole)
            .instrument(span)
            .await;
        tracing::debug!(?peer, %epoch, %end, "epoch ended");
        shared.dialer.link_released(peer);
        if !matches!(end, EpochEnd::Closed | EpochEnd::Shutdown) {
            died = Some(Instant::now());
        }
    }
}

/// Waits for the next link, keeping count of what consumers take from the
/// peer's closed streams meanwhile. Returns it with the links it replaced
/// unserved, oldest first, to read out before it. Returns `None` when the
/// task should retire: never while those streams hold the peer's data
/// (unless shutting down), since the count would go with it.
async fn wait_for_link<L: Link>(
    shared: &Shared<L>,
    entry: &PeerEntry<L>,
    held: &mut Held,
) -> Option<Taken<L>> {
    let peer = entry.control.peer;
    let mut idle_since = Instant::now();
    let mut drain_until: Option<Instant> = None;
    loop {
        let shutdown = shared.shutdown_notify.notified();
        tokio::pin!(shutdown);
        shutdown.as_mut().enable();
        end_waiting(entry);
        let now = Instant::now();
        let (wants_link, let_go) = {
            let control = entry.control.state();
            (!control.dirty_inlets.is_empty(), control.let_go)
        };
        let wants_link = wants_link
            || lock(&entry.messages)
                .as_ref()
                .is_some_and(|rx| !rx.is_empty());
        if shared.shutdown.load(Ordering::Acquire) {
            // Work queued before the shutdown still goes out if a link comes
            // within the linger; the epoch then drains and says goodbye.
            let until = *drain_until.get_or_insert(now + shared.config.shutdown_linger);
            if !wants_link || now >= until {
                retire(shared, entry, true);
                return None;
            }
        }
        // Both under the control lock, as `hand_over` stores them: a link
        // installed meanwhile is not read out before the one taken here.
        let (incoming, superseded) = {
            let _control = entry.control.state();
            let incoming = lock(&entry.incoming).take();
            let superseded: Vec<_> = lock(&entry.superseded).drain(..).collect();
            (incoming, superseded)
        };
        if incoming.is_some() || !superseded.is_empty() {
            return Some((incoming, superseded));
        }
        let visited = std::mem::take(&mut entry.control.state().dirty_rx);
        for rx in visited {
            held.visit(Held::key(&rx), rx.visit());
        }
        entry.control.publish_held(held.bytes(), 0);
        if wants_link {
            idle_since = now;
            shared.dialer.want_link(peer);
        } else if let_go || now >= idle_since + shared.config.idle_retire {
            held.settle();
            entry.control.publish_held(held.bytes(), 0);
            if held.is_empty() && retire(shared, entry, false) {
                return None;
            }
            // Still holding: look again an idle period from now.
            idle_since = now;
        }
        let mut next_check = if wants_link {
            now + REDIAL_INTERVAL
        } else if held.is_empty() {
            idle_since + shared.config.idle_retire
        } else {
            // What is held goes as consumers read, and their reads wake
            // this task: a zero idle period must not look every tick.
            idle_since + shared.config.idle_retire.max(shared.config.credit_sweep)
        };
        if let Some(until) = drain_until {
            next_check = next_check.min(until);
        }
        tokio::select! {
            _ = entry.link_arrived.notified() => {}
            _ = entry.control.wake.notified() => {}
            _ = sleep_until(next_check) => {}
            _ = shutdown => {}
        }
    }
}

/// Queues a link to be read out before the next one is served (under the
/// control lock); past [`SUPERSEDED_MAX`] the oldest goes unread.
fn push_superseded<L: Link>(entry: &PeerEntry<L>, handed: Handed<L>) {
    let mut superseded = lock(&entry.superseded);
    if let Some((unread, ..)) = (superseded.len() == SUPERSEDED_MAX)
        .then(|| superseded.pop_front())
        .flatten()
    {
        Counters::add(&entry.control.counters.links_unread, 1);
        tracing::debug!(peer = ?entry.control.peer, epoch = %unread.epoch(),
            "too many links replaced unserved; the oldest goes unread");
    }
    superseded.push_back(handed);
}

/// The next link to serve, if one came, and the links to read out before
/// it (replaced before they were served, or handed over to be read out).
type Taken<L> = (Option<Handed<L>>, Vec<Handed<L>>);

/// A link handed to the peer task, with what its hello said and its grant.
type Handed<L> = (L, Opening, UnservedGrant);

/// A handed link's grant, counted in `unserved_grants` (and so left out of
/// the next hello's credit, [`Mux::peer_room`]) from the hand-over until
/// its epoch's core counts it, or the link goes unserved (dropped).
struct UnservedGrant {
    control: Arc<PeerControl>,
    granted: u64,
}

impl UnservedGrant {
    fn new(control: &Arc<PeerControl>, granted: u32) -> UnservedGrant {
        let granted = u64::from(granted);
        control.unserved_grants.fetch_add(granted, Ordering::AcqRel);
        UnservedGrant {
            control: control.clone(),
            granted,
        }
    }
}

impl Drop for UnservedGrant {
    fn drop(&mut self) {
        self.control
            .unserved_grants
            .fetch_sub(self.granted, Ordering::AcqRel);
    }
}

/// How much of an epoch the peer task runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Serve {
    /// Its whole life: our slots and messages go out on it.
    Whole,
    /// A link replaced before it was taken up: only what the peer already
    /// sent on it is delivered, then its slots end.
    ReadOut,
}

/// Fails the link it holds if dropped before the epoch finished: a future
/// that panicked is dropped after the panic was caught, so `panicking()`
/// would not tell.
struct FailUnlessFinished<'a, L: Link> {
    link: &'a L,
    finished: bool,
}

impl<L: Link> Drop for FailUnlessFinished<'_, L> {
    fn drop(&mut self) {
        if !self.finished {
            self.link.fail(EpochEnd::Internal);
        }
    }
}

/// Records that the peer task is done with `epoch` ([`Mux::is_judging`]).
fn mark_served<L: Link>(entry: &PeerEntry<L>, epoch: Epoch) {
    let mut served = lock(&entry.served_through);
    *served = (*served).max(Some(epoch));
}

/// Ends what waits for a link to a peer the connector said none will come
/// to ([`Mux::forget_peer`], [`Mux::peer_unreachable`]).
fn end_waiting<L: Link>(entry: &PeerEntry<L>) {
    let mut control = entry.control.state();
    let Some(reason) = control.end_waiting.take() else {
        return;
    };
    // A link waiting to be served (the peer dialled in, or was registered
    // again and dialled): the peer is back, and the slots go with it.
    if lock(&entry.incoming).is_some() {
        return;
    }
    let ended = entry.control.waits_ended.load(Ordering::Acquire);
    let (before, after) = std::mem::take(&mut control.dirty_inlets)
        .into_iter()
        .partition::<Vec<_>, _>(|inlet| inlet.opened_after_waits_ended < ended);
    control.dirty_inlets = after;
    drop(control);
    // Closed first, then counted: whoever sees the count finds the slots
    // ended; one that had ended already is not counted again.
    let closed = before
        .into_iter()
        .filter(|inlet| inlet.close(crate::mux::SendError::Dropped(reason)))
        .count();
    Counters::add(&entry.control.counters.slots_dropped, closed as u64);
}

/// After a peer task panicked outside an epoch's catch: the epoch it served
/// (`serving`), or else the link it had taken up, is over and judged as far
/// as it got, and the connector is told, so an ask it keeps for the verdict
/// is answered. A link still waiting in `incoming` is the restart's to serve.
fn release_after_panic<L: Link>(shared: &Shared<L>, entry: &PeerEntry<L>, serving: Option<Epoch>) {
    let taken_up = serving.or_else(|| {
        // Under the control lock, as `hand_over` stores both.
        let _control = entry.control.state();
        let waiting = lock(&entry.incoming).is_some();
        (!waiting).then(|| *lock(&entry.handed_through)).flatten()
    });
    if let Some(epoch) = taken_up {
        mark_served(entry, epoch);
    }
    shared.dialer.link_released(entry.control.peer);
}

/// After a peer task panicked outside an epoch: true if it should run
/// again. Not if its entry has left the map (retired: producers went to a
/// new one), and not once the node shuts down: then it retires here, so
/// `closed` resolves and its queued slots hear, even if what panicked would
/// panic again. If retiring panics too, the entry leaves the map anyway.
fn restart_after_panic<L: Link>(shared: &Shared<L>, entry: &Arc<PeerEntry<L>>) -> bool {
    let peer = entry.control.peer;
    let current = shared
        .peers
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&peer)
        .is_some_and(|e| Arc::ptr_eq(e, entry));
    if !current {
        return false;
    }
    if !shared.shutdown.load(Ordering::Acquire) {
        return true;
    }
    let retired = std::panic::catch_unwind(AssertUnwindSafe(|| retire(shared, entry, true)));
    if retired.is_err() {
        let mut peers = shared.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if peers.get(&peer).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            peers.remove(&peer);
        }
        drop(peers);
        shared.retired.notify_waiters();
    }
    false
}

/// Retires the peer task if nothing is pending (or unconditionally on
/// shutdown). Producers racing an open see `retired` and re-home.
fn retire<L: Link>(shared: &Shared<L>, entry: &PeerEntry<L>, force: bool) -> bool {
    let mut peers = lock(&shared.peers);
    let mut control = entry.control.state();
    let links_waiting = lock(&entry.incoming).is_some() || !lock(&entry.superseded).is_empty();
    // A channel `install_messages` filled since the caller looked (it
    // installs under the control lock, into no retired entry).
    let messages_waiting = lock(&entry.messages)
        .as_ref()
        .is_some_and(|rx| !rx.is_empty());
    if !force && (!control.dirty_inlets.is_empty() || links_waiting || messages_waiting) {
        return false;
    }
    control.retired = true;
    let orphans = std::mem::take(&mut control.dirty_inlets);
    drop(control);
    // Held only when forced (shutdown): no window is counted any more.
    entry.control.publish_held(0, 0);
    let peer = entry.control.peer;
    if peers
        .get(&peer)
        .is_some_and(|e| std::ptr::eq(Arc::as_ptr(e), entry))
    {
        peers.remove(&peer);
    }
    drop(peers);
    shared.retired.notify_waiters();
    for inlet in orphans {
        inlet.close(crate::mux::SendError::Dropped(DropReason::Shutdown));
    }
    // Out of their locks first: a link's end runs its hooks in the caller.
    let incoming = lock(&entry.incoming).take();
    if let Some((link, ..)) = incoming {
        link.fail(EpochEnd::Shutdown);
    }
    let superseded = std::mem::take(&mut *lock(&entry.superseded));
    drop(superseded);
    true
}

/// Writes the Goodbye into `buf` and posts it as the epoch's last batch.
fn post_goodbye<L: Link>(link: &L, core: &mut PeerCore, mut buf: L::SendBuf) {
    let len = core.poll_goodbye(&mut buf);
    if len > 0 {
        link.post_last(buf, len).ok();
    }
}

/// `reserve`'s outcome if it is ready at once (a free buffer and a link
/// credit); `None` leaves it waiting, for the `select!`.
async fn reserve_now<F, B>(reserve: Pin<&mut F>) -> Option<Result<B, LinkError>>
where
    F: Future<Output = Result<B, LinkError>>,
{
    let mut reserve = reserve;
    std::future::poll_fn(|cx| match reserve.as_mut().poll(cx) {
        std::task::Poll::Ready(reserved) => std::task::Poll::Ready(Some(reserved)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

/// Encodes what the core has to send into `buf` and posts it.
/// True if there was one to post.
fn write_batch<L: Link>(
    link: &L,
    core: &mut PeerCore,
    mut buf: L::SendBuf,
) -> Result<bool, EpochEnd> {
    let len = core.poll_batch(&mut buf, Instant::now());
    if len == 0 {
        return Ok(false);
    }
    stages::mark(Stage::Encoded);
    link.post(buf, len).map_err(end_of)?;
    stages::mark(Stage::Posted);
    core.batch_posted();
    Ok(true)
}

fn end_of(err: LinkError) -> EpochEnd {
    match err {
        LinkError::Ended { reason, .. } => reason,
        LinkError::BatchTooLarge { .. } => EpochEnd::Fault(LinkFault::PostFailed),
    }
}

/// One epoch's link and core. The peer task owns the turn and lends it
/// out while it waits in its `select!`: to a producer when it has nothing
/// to write (`open`), which then writes its batch itself (docs/design.md
/// § "A lone record is written by its producer"), and to the link's reader
/// when no end is in sight (`receiving`), which then decodes what arrived
/// (§ "A batch is decoded by its reader").
///
/// ```text
///  send ─► inlet ─► dirty list ─► try_lock(turn), open, inline_ok?
///                                   ├─ yes: handle_control → try_reserve → encode → post
///                                   └─ no:  wake the peer task (as always)
///  reader ─► inbox ─► arrived ─► try_lock(turn), receiving?
///                                   ├─ yes: try_recv → decode; wake the task if it owes something
///                                   └─ no:  recv's waiter woken (as always)
/// ```
struct EpochCell<L: Link> {
    link: L,
    counters: Arc<Counters>,
    /// The peer task's wake-up, for what a reader's decode leaves it.
    control: Arc<PeerControl>,
    /// `Turn::open` as the peer task last left it, and a lone record may go:
    /// a producer looks here first, so a burst's records cost a load, not
    /// a lock.
    inviting: AtomicBool,
    turn: tokio::sync::Mutex<Turn>,
}

/// What the peer task lends a producer, or the link's reader, while it
/// waits.
struct Turn {
    core: PeerCore,
    /// The peer task waits with nothing to write: a producer may write.
    open: bool,
    /// The peer task waits: the link's reader may decode.
    receiving: bool,
    /// Batches the link handed out that the core has taken, for
    /// [`Link::try_recv`].
    handled: u64,
    /// The waiting peer task's timer: a producer's write that brings the
    /// core's deadline before it wakes the task.
    parked_until: Instant,
    /// The waiting task waits for a send buffer: a decode that leaves a
    /// write owed need not wake it.
    parked_writing: bool,
    /// The waiting task's timer counts the idle retirement: a decode that
    /// leaves the core idle wakes it otherwise.
    parked_idle: bool,
    /// The last batch's consumers that the runtime has not woken yet.
    deferred: Deferred,
    /// How a producer's write ended the epoch, for the peer task.
    failed: Option<Failure>,
}

impl Turn {
    /// Lent to nobody: the peer task has it, or the epoch is over.
    fn close(&mut self) {
        self.open = false;
        self.receiving = false;
    }

    /// Decodes a batch, in the peer task's turn or a reader's: the
    /// consumers it found waiting are woken together
    /// ([`super::slot::ReceiverWakes::defer`]), after what the runtime has
    /// not yet woken of the batch before (a busy worker runs its deferred
    /// list late).
    fn decode(&mut self, batch: &[u8]) -> Result<(), ProtocolError> {
        stages::mark(Stage::Decoding);
        self.deferred.wake_now();
        let (handled, woken) = self.core.handle_batch_unwoken(batch, Instant::now());
        handled?;
        self.deferred = woken.defer();
        Ok(())
    }
}

/// How a producer's write ended the epoch.
enum Failure {
    /// The link's end (a post or a reserve that found it ended).
    Ended(EpochEnd),
    /// A panic, raised again in the peer task: the epoch ends as if the
    /// task had panicked (its core may be half-updated).
    Panicked(Box<dyn std::any::Any + Send>),
}

/// Withdraws the epoch's inline writer on every way out of `run_epoch`, a
/// dropped task included: the writer holds the core, which holds the
/// peer's control, which holds the writer.
struct Offered<'a>(&'a PeerControl);

impl Drop for Offered<'_> {
    fn drop(&mut self) {
        self.0.withdraw_inline();
    }
}

impl<L: Link> std::fmt::Debug for EpochCell<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochCell")
            .field("epoch", &self.link.epoch())
            .finish_non_exhaustive()
    }
}

impl<L: Link> EpochCell<L> {
    /// How work done in a lent turn ended: true when it left the waiting
    /// task nothing to see to. A failure closes the turn, and the task,
    /// woken by the link's end, ends the epoch with it.
    fn settle(&self, turn: &mut Turn, done: std::thread::Result<Result<bool, EpochEnd>>) -> bool {
        let failure = match done {
            Ok(Ok(done)) => return done,
            Ok(Err(end)) => Failure::Ended(end),
            Err(panic) => {
                // No more I/O on this epoch; the peer task raises the panic
                // again, counts and logs it.
                self.link.fail(EpochEnd::Internal);
                Failure::Panicked(panic)
            }
        };
        self.inviting.store(false, Ordering::Relaxed);
        turn.close();
        turn.failed = Some(failure);
        false
    }
}

impl<L: Link> InlineWriter for EpochCell<L> {
    fn try_write(&self) -> bool {
        if !self.inviting.load(Ordering::Acquire) {
            return false;
        }
        // Never waits: the peer task, or another producer, in its turn
        // means the wake goes as always.
        let Ok(mut guard) = self.turn.try_lock() else {
            return false;
        };
        let turn = &mut *guard;
        let now = Instant::now();
        if !turn.open || !turn.core.inline_ok(now) {
            return false;
        }
        let written = std::panic::catch_unwind(AssertUnwindSafe(|| {
            stages::mark(Stage::Woken);
            turn.core.handle_control(now);
            if turn.core.wants_write(now) {
                match self.link.try_reserve() {
                    Some(Ok(buf)) => {
                        if write_batch(&self.link, &mut turn.core, buf)? {
                            Counters::add(&self.counters.batches_inline, 1);
                        }
                    }
                    Some(Err(err)) => return Err(end_of(err)),
                    None => return Ok(false),
                }
            }
            // Anything left, a deadline before the waiting task's timer, or
            // an idle core whose retirement that timer does not count, is
            // the task's to see to.
            Ok(!turn.core.wants_write(now)
                && turn.core.poll_timeout(now) >= turn.parked_until
                && (turn.parked_idle || turn.core.idle_since().is_none()))
        }));
        self.settle(turn, written)
    }
}

impl<L: Link> Arrivals for EpochCell<L> {
    fn arrived(&self) {
        // Never waits: the peer task in its turn takes the batch from
        // `recv`, as always.
        let Ok(mut guard) = self.turn.try_lock() else {
            return;
        };
        let turn = &mut *guard;
        if !turn.receiving {
            return;
        }
        let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let mut any = false;
            while let Some(batch) = self.link.try_recv(turn.handled) {
                turn.handled += 1;
                any = true;
                if let Err(violation) = turn.decode(&batch) {
                    let end = EpochEnd::Violation(violation);
                    self.link.fail(end);
                    return Err(end);
                }
                Counters::add(&self.counters.batches_received_inline, 1);
                turn.core.take_handed_over();
                if turn.core.goodbye_received() {
                    // The epoch is ending: nothing more is written or
                    // decoded but by the task (what follows a Goodbye is
                    // the drain's to judge).
                    self.inviting.store(false, Ordering::Relaxed);
                    turn.close();
                    return Ok(false);
                }
            }
            // A write the batches asked for, a deadline before the task's
            // timer, or an idle core whose retirement the timer does not
            // count: the task's to see to.
            let now = Instant::now();
            Ok(!any
                || (turn.parked_writing || !turn.core.wants_write(now))
                    && turn.core.poll_timeout(now) >= turn.parked_until
                    && (turn.parked_idle || turn.core.idle_since().is_none()))
        }));
        if !self.settle(turn, decoded) {
            self.control.wake.notify_one();
        }
    }
}

/// Whether the link's reader decodes batches that find the peer task
/// waiting (docs/design.md § "A batch is decoded by its reader").
fn receives_inline<L: Link>(config: &MuxConfig) -> bool {
    L::TRY_RECV && config.inline_receive
}

/// One epoch on `link`; returns how it ended (a close whose read-out the
/// link cut as that cut) and what the peer's closed streams still hold for
/// the next.
async fn run_epoch<L: Link>(
    shared: &Shared<L>,
    entry: &PeerEntry<L>,
    (link, opening, grant): Handed<L>,
    held: Held,
    serve: Serve,
) -> (EpochEnd, Held) {
    let config = shared.config.clone();
    let mut core = PeerCore::new(
        link.epoch(),
        config.clone(),
        entry.control.clone(),
        shared.registry.clone(),
        held,
        Instant::now(),
    );
    core.set_peer_terms(opening.theirs, opening.granted, Instant::now());
    // The core counts the grant now (`peer_committed`).
    drop(grant);
    *lock(&entry.epoch) = Some(link.epoch());
    core.set_sink(shared.sink.clone());
    // A link read out only takes none of our slots or messages: they wait
    // for the link that replaced it.
    let mut messages: Option<flume::Receiver<OutboundMessage>> = None;
    if serve == Serve::Whole {
        core.handle_control(Instant::now());
        messages = lock(&entry.messages).take();
    }
    let cell = Arc::new(EpochCell {
        link,
        counters: shared.counters.clone(),
        control: entry.control.clone(),
        inviting: AtomicBool::new(false),
        turn: tokio::sync::Mutex::new(Turn {
            core,
            open: false,
            receiving: false,
            handled: 0,
            parked_until: Instant::now(),
            parked_writing: false,
            parked_idle: false,
            deferred: Deferred::default(),
            failed: None,
        }),
    });
    // A panic past the epoch's own catch, or a runtime dropping the task,
    // still ends the link, so the connector, which holds it too, does not
    // count it live.
    let mut unfinished = FailUnlessFinished {
        link: &cell.link,
        finished: false,
    };
    let link = &cell.link;
    let offered = Offered(&entry.control);
    if serve == Serve::Whole
        && L::TRY_RESERVE
        && config.flush == FlushPolicy::Auto
        && config.inline_write_gap.is_some()
    {
        entry.control.state().inline = Some(cell.clone());
    }
    if serve == Serve::Whole && receives_inline::<L>(&config) {
        let arrivals: std::sync::Weak<dyn Arrivals> = Arc::downgrade(&cell) as _;
        link.set_arrivals(arrivals);
    }
    // A batch the task took off the link as a producer's write ended the
    // epoch: the drain's first.
    let mut taken: Option<L::Batch> = None;
    // The link dropped batches it completed while a close read it out.
    let mut read_out_cut: Option<EpochEnd> = None;
    let served = CatchPanic(Box::pin(async {
        let end = match serve {
            Serve::Whole => serve_epoch(shared, entry, &cell, &mut messages, &mut taken).await,
            Serve::ReadOut => EpochEnd::Replaced,
        };
        // No producer writes from here on.
        entry.control.withdraw_inline();
        let mut turn = cell.turn.lock().await;
        turn.close();
        let core = &mut turn.core;
        if let EpochEnd::Violation(violation) = end {
            *lock(&entry.violated_in) = Some(core.epoch());
            Counters::add(&shared.counters.protocol_violations, 1);
            tracing::warn!(peer = ?entry.control.peer, epoch = %core.epoch(), %violation,
                "peer violated the protocol; ending the epoch");
        }
        link.fail(end);
        // Every batch the link completed is delivered before any Dropped; not
        // after a violation in one of them, since the peer is no longer
        // trusted. A link's own verdict came after the batches it completed
        // (it delivers none past the offence), so those are delivered.
        if !matches!(end, EpochEnd::Violation(v) if !v.is_link_level()) {
            loop {
                let batch = match taken.take() {
                    Some(batch) => batch,
                    None => match link.recv().await {
                        Ok(batch) => batch,
                        // Batches the link completed and dropped (a buffer
                        // not lent, a panic): a close that lost them is no
                        // graceful end (the slots still hear the close's).
                        Err(LinkError::Ended { reason, .. })
                            if end.is_close() && reason.cut_delivery() =>
                        {
                            read_out_cut = Some(reason);
                            break;
                        }
                        Err(_) => break,
                    },
                };
                if let Err(violation) = core.handle_batch(&batch, Instant::now()) {
                    // E.g. records after a Goodbye: the epoch is over already,
                    // but the offence is still the peer's, counted, and the
                    // verdict a connector asks for before it redials.
                    *lock(&entry.violated_in) = Some(core.epoch());
                    Counters::add(&shared.counters.protocol_violations, 1);
                    tracing::warn!(peer = ?entry.control.peer, epoch = %core.epoch(), %violation,
                        "peer violated the mux protocol while its epoch ended");
                    // A read-out of an offender is cut, not waited out.
                    link.fail(EpochEnd::Violation(violation));
                    break;
                }
            }
        }
        end
    }))
    .await;
    cell.inviting.store(false, Ordering::Release);
    drop(offered);
    // Closed before a panic's `fail` below: no producer writes, and no
    // reader decodes, past it.
    let mut turn = cell.turn.lock().await;
    turn.close();
    let end = served.unwrap_or_else(|panic| {
        // A bug here or in the sink: the task and the node go on, the epoch
        // does not (its state may be half-updated), and every live slot
        // still hears once.
        Counters::add(&shared.counters.peer_task_panics, 1);
        tracing::error!(peer = ?entry.control.peer, epoch = %link.epoch(),
            panic = panic_message(&*panic), "mux peer task panicked; ending the epoch");
        link.fail(EpochEnd::Internal);
        EpochEnd::Internal
    });
    let core = &mut turn.core;
    let reason = match end {
        EpochEnd::Shutdown => DropReason::Shutdown,
        EpochEnd::Closed
        | EpochEnd::PeerClosed
        | EpochEnd::PeerLost
        | EpochEnd::Fault(_)
        | EpochEnd::Violation(_)
        | EpochEnd::Replaced
        | EpochEnd::Internal => DropReason::EpochEnded {
            epoch: core.epoch(),
        },
    };
    core.fail_all(reason);
    if let Some(rx) = messages {
        // Each dropped message reports itself to its sender, which may send
        // again. The receiver goes right after a drain that found nothing:
        // flume 0.12 panics, and poisons the channel, when a sender parked
        // on a full channel is polled while the receiver drops
        // (docs/design.md § "Open hazards"), and an empty one parks none.
        for _ in 0..4 {
            let left: Vec<OutboundMessage> = rx.drain().collect();
            if left.is_empty() {
                break;
            }
            drop(left);
        }
        drop(rx);
    }
    Counters::add(&shared.counters.epoch_deaths, 1);
    // Graceful: our Goodbye or the peer's. A `PeerClosed` without one is
    // the link's: the peer's connection ended under it.
    let graceful = read_out_cut.is_none()
        && match end {
            EpochEnd::Closed | EpochEnd::Shutdown => true,
            EpochEnd::PeerClosed => core.goodbye_received(),
            _ => false,
        };
    // A read-out delivers up to the peer's close: nothing of ours rode it.
    // A cut one may have dropped the peer's message unseen.
    let carried = core.carried_messages() || read_out_cut.is_some() || end.cut_delivery();
    if !graceful && serve == Serve::Whole && carried {
        let mut losses = lock(&entry.epochs_lost);
        losses.count += 1;
        losses.last = Some(std::time::Instant::now());
    }
    // Judged before it reads as over: a caller that sees no epoch finds
    // the verdict in.
    mark_served(entry, core.epoch());
    *lock(&entry.epoch) = None;
    let held = core.take_held();
    drop(turn);
    unfinished.finished = true;
    drop(unfinished);
    // The link goes here, in the peer task, as before: a producer that
    // took the cell before it was withdrawn only looks, and lets go.
    let mut cell = cell;
    while let Err(shared_still) = Arc::try_unwrap(cell) {
        cell = shared_still;
        tokio::task::yield_now().await;
    }
    (read_out_cut.unwrap_or(end), held)
}

/// What woke a peer task's turn.
enum Event<B, S> {
    Message(Option<OutboundMessage>),
    Batch(Result<B, LinkError>),
    Wake,
    Arrived,
    Reserved(Result<S, LinkError>),
    Timer,
    Shutdown,
}

/// One epoch's turns until it ends: a `select!` over the link's `recv`, the
/// producers' wake-up, the flush gate's `reserve`, the timer and shutdown.
/// The core is the task's during a turn, and lent between turns to
/// producers when there is nothing to write, to the link's reader when no
/// end is in sight ([`EpochCell`]).
async fn serve_epoch<L: Link>(
    shared: &Shared<L>,
    entry: &PeerEntry<L>,
    cell: &EpochCell<L>,
    messages: &mut Option<flume::Receiver<OutboundMessage>>,
    taken: &mut Option<L::Batch>,
) -> EpochEnd {
    let config = &shared.config;
    let link = &cell.link;
    let receive_inline = receives_inline::<L>(config);
    let mut turn = cell.turn.lock().await;
    let mut drain_until: Option<Instant> = None;
    // Set while an idle peer waits for a link credit for its goodbye: until when.
    let mut idle_goodbye_until: Option<Instant> = None;
    // The waits live across turns and are renewed only when they fire: a
    // turn then costs no waiter-list or timer-wheel round trips for the
    // waits that did not (docs/design.md § "Wake only a waiter, and let the
    // receiver run first").
    let shutdown = shared.shutdown_notify.notified();
    let wake = entry.control.wake.notified();
    let arrived = entry.link_arrived.notified();
    let received = link.recv();
    let timer = sleep_until(turn.core.poll_timeout(Instant::now()));
    // The wait for a send buffer lives across turns too, for as long as
    // the core has something to write: a link waiting on an exhausted pool
    // keeps its place in the pool's line while batches come in.
    let reserving = None;
    tokio::pin!(shutdown, wake, arrived, received, timer, reserving);
    loop {
        let core = &mut turn.core;
        let fresh = lock(&entry.messages).take();
        if let Some(fresh) = fresh {
            // Outside the lock: dropping the old channel may report its
            // messages, and a report may install a channel again.
            *messages = Some(fresh);
        }
        shutdown.as_mut().enable();
        let now = Instant::now();
        // The end this turn has reached, and how long its goodbye may wait
        // for a link credit (the peer returns them as it takes our batches).
        let mut ending: Option<(EpochEnd, Instant)> = None;
        if shared.shutdown.load(Ordering::Acquire) {
            // Write what is already queued (bounded by the linger), then say goodbye.
            let until = *drain_until.get_or_insert(now + config.shutdown_linger);
            // Take what producers queued before the shutdown, then judge;
            // under a manual flush, what waits for one goes too.
            core.handle_control(now);
            core.request_flush();
            // A slot waiting for credit is not done: the peer's consumer
            // may return it within the linger.
            let quiet = core.is_quiet() && !core.has_withheld();
            if quiet || now >= until {
                if !quiet {
                    tracing::debug!("shutdown linger over with records unwritten");
                }
                ending = Some((EpochEnd::Shutdown, until));
            }
        }
        if core.goodbye_received() {
            break EpochEnd::PeerClosed;
        }
        let mut deadline = core.poll_timeout(now);
        if let Some(until) = drain_until {
            deadline = deadline.min(until);
        }
        // Messages waiting in the channel are work the core has not seen.
        let messages_waiting = messages.as_ref().is_some_and(|rx| !rx.is_empty());
        match core.idle_since() {
            Some(since) if ending.is_none() && !messages_waiting => {
                let retire_at = since + config.idle_retire;
                if now < retire_at {
                    deadline = deadline.min(retire_at);
                } else if entry.control.state().dirty_inlets.is_empty() {
                    let until = *idle_goodbye_until.get_or_insert(now + config.shutdown_linger);
                    ending = Some((EpochEnd::Closed, until));
                }
            }
            // Work came back while the goodbye waited: no longer idle.
            _ => idle_goodbye_until = None,
        }
        if let Some((end, until)) = ending {
            // Asked through the kept `reserve` (made here if none is): one
            // from an earlier turn may be ready, woken and not yet polled,
            // and a second would take the link out of the pool's line.
            if reserving.is_none() {
                reserving.set(Some(link.reserve()));
            }
            let kept = reserving.as_mut().as_pin_mut().expect("just set");
            match reserve_now(kept).await {
                Some(Ok(buf)) => {
                    post_goodbye(link, core, buf);
                    break end;
                }
                // The link ended under the goodbye: its end, as elsewhere.
                Some(Err(err)) => break end_of(err),
                None => {}
            }
            if now >= until {
                tracing::debug!("no link credit came for the goodbye; the epoch ends without one");
                break end;
            }
            deadline = deadline.min(until);
        }
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        let write = core.wants_write(now) || ending.is_some();
        if !write {
            // Out of the pool's line: a buffer now would sit unused.
            reserving.set(None);
        } else if reserving.is_none() {
            reserving.set(Some(link.reserve()));
        }
        let take_message = messages.is_some() && core.wants_messages();
        // Nothing to write and no drain: a lone record's producer may
        // write while the task waits. No end in sight: the link's reader
        // may decode. Otherwise the task keeps its turn.
        let lend_write =
            L::TRY_RESERVE && !write && drain_until.is_none() && core.inline_candidate();
        let lend_receive = receive_inline && drain_until.is_none() && ending.is_none();
        let parked_idle = core.idle_since().is_some();
        turn.open = lend_write;
        turn.receiving = lend_receive;
        turn.parked_until = deadline;
        turn.parked_writing = write;
        turn.parked_idle = parked_idle;
        let kept = if lend_write || lend_receive {
            cell.inviting.store(lend_write, Ordering::Release);
            drop(turn);
            None
        } else {
            Some(turn)
        };
        let next_message = async {
            match &*messages {
                Some(rx) => rx.recv_async().await.ok(),
                None => std::future::pending().await,
            }
        };
        let event = tokio::select! {
            message = next_message, if take_message => Event::Message(message),
            batch = &mut received => {
                received.set(link.recv());
                Event::Batch(batch)
            },
            () = &mut wake => {
                wake.set(entry.control.wake.notified());
                Event::Wake
            },
            // The permit may predate this link (stored while we were waiting).
            () = &mut arrived => {
                arrived.set(entry.link_arrived.notified());
                Event::Arrived
            },
            reserved = async {
                reserving.as_mut().as_pin_mut().expect("set while writing").await
            }, if write => {
                reserving.set(None);
                Event::Reserved(reserved)
            },
            () = &mut timer => Event::Timer,
            () = &mut shutdown => {
                shutdown.set(shared.shutdown_notify.notified());
                Event::Shutdown
            },
        };
        turn = match kept {
            Some(turn) => turn,
            None => {
                cell.inviting.store(false, Ordering::Relaxed);
                let mut turn = cell.turn.lock().await;
                turn.close();
                turn
            }
        };
        if let Event::Batch(Ok(_)) = event {
            turn.handled += 1;
        }
        // A producer's write ended the epoch, or a reader decoded the
        // peer's Goodbye, while the task waited.
        let over = match turn.failed.take() {
            None => turn.core.goodbye_received().then_some(EpochEnd::PeerClosed),
            Some(Failure::Panicked(panic)) => std::panic::resume_unwind(panic),
            Some(Failure::Ended(end)) => Some(end),
        };
        if let Some(end) = over {
            // A batch already taken off the link is still delivered (after
            // a Goodbye, judged by the drain), and a message taken is
            // reported with the rest; nothing else of this turn runs (a
            // wake or a reserve would write again).
            match event {
                Event::Batch(Ok(batch)) => *taken = Some(batch),
                Event::Message(Some(message)) => {
                    turn.core.handle_message(message, Instant::now());
                }
                _ => {}
            }
            break end;
        }
        let core = &mut turn.core;
        match event {
            Event::Message(Some(message)) => core.handle_message(message, Instant::now()),
            Event::Message(None) => *messages = None,
            Event::Batch(Ok(batch)) => {
                if let Err(violation) = turn.decode(&batch) {
                    break EpochEnd::Violation(violation);
                }
                // The consumers this batch woke run before its
                // buffer is re-posted (docs/design.md § "The
                // consumer runs before the receive buffer is re-posted").
                if turn.core.take_handed_over() && L::RELEASE_POSTS {
                    tokio::task::yield_now().await;
                }
                drop(batch);
            }
            Event::Batch(Err(err)) => break end_of(err),
            Event::Wake => {
                stages::mark(Stage::Woken);
                let now = Instant::now();
                core.handle_control(now);
                // What a wake-up brought usually goes out now: with a buffer
                // free, write it in this turn instead of the next turn's
                // `reserve` (docs/design.md § "A wake-up writes in its own
                // turn"). A miss keeps the `reserve`, and its place in line.
                if ending.is_none() && core.wants_write(now) {
                    if reserving.is_none() {
                        reserving.set(Some(link.reserve()));
                    }
                    let pending = reserving.as_mut().as_pin_mut().expect("just set");
                    match reserve_now(pending).await {
                        Some(Ok(buf)) => {
                            reserving.set(None);
                            if let Err(end) = write_batch(link, core, buf) {
                                break end;
                            }
                        }
                        Some(Err(err)) => break end_of(err),
                        None => {}
                    }
                }
            }
            Event::Arrived => {
                if lock(&entry.incoming).is_some() {
                    break EpochEnd::Replaced;
                }
            }
            Event::Reserved(Ok(buf)) => {
                if let Some((end, _)) = ending {
                    post_goodbye(link, core, buf);
                    break end;
                }
                if let Err(end) = write_batch(link, core, buf) {
                    break end;
                }
            }
            Event::Reserved(Err(err)) => break end_of(err),
            Event::Timer => core.handle_timeout(Instant::now()),
            Event::Shutdown => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::mem::{MemConfig, MemFabric, pair};

    const A: PeerId = PeerId(1);
    const B: PeerId = PeerId(2);

    /// A link attached to an entry whose task retired for idleness just
    /// after the attach looked it up comes back, and the attach hands it to
    /// a fresh entry, whose task serves it.
    #[tokio::test]
    async fn a_link_meeting_a_retired_entry_goes_to_a_fresh_one() {
        let fabric = MemFabric::new(MemConfig::default());
        let mux = Mux::new(MuxConfig::default(), fabric.dialer(A));
        let looked_up = mux.entry(B);
        assert!(retire(&mux.shared, &looked_up, false), "idle: it retires");
        let own = PeerTerms::announced_by(mux.config());
        let opening = Opening {
            theirs: own,
            granted: own.peer_credit,
        };
        let (ours, theirs) = pair(Epoch(1), MemConfig::default());
        let back = Mux::hand_over(&looked_up, ours, opening);
        let ours = back.expect_err("a retired entry takes no link");
        assert!(lock(&looked_up.incoming).is_none());
        mux.attach(B, ours);
        let served = tokio::time::timeout(Duration::from_secs(10), async {
            while mux.epoch(B) != Some(Epoch(1)) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        assert!(served.await.is_ok(), "a fresh task serves the link");
        drop(theirs);
    }
}
