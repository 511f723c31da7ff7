//! One peer's connection, seen by the mux as an ordered, reliable,
//! message-preserving batch pipe that lives for exactly one epoch.
//!
//! ```text
//!  mux peer task ─ reserve() ─► SendBuf (link credit + buffer) ─ encode in place ─ post()
//!  mux peer task ◄─ recv() ◄─ Batch (borrowed; drop = buffer back = credit to the peer)
//!  link's reader ─► Arrivals::arrived ─► the mux, in the reader's turn: try_recv() ─► Batch
//!  any error ─► fail(EpochEnd) ─► both ends' waiters fail; delivered batches drain first
//! ```
//!
//! A [`Link`] object is one epoch: once it ends it never revives, and the next
//! epoch is a new object handed to the mux (docs/design.md § "A Link is one
//! epoch"). Link credit never reaches the slot layer.
//!
//! Implementations: [`mem`] (in-process pair for tests), [`rdma`] (one RC
//! queue pair through the verbs seam), [`tcp`] (one TCP connection per peer
//! per epoch: the baseline). [`bootstrap`] is the handshake that starts an
//! epoch, shared by the TCP and RDMA nodes.

pub mod address;
pub mod bootstrap;
pub mod mem;
pub mod rdma;
pub mod tcp;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::future::Future;
use std::net::IpAddr;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use thiserror::Error;

use crate::mux::engine::ProtocolError;
use crate::mux::protocol::Epoch;
use crate::mux::{Mux, PeerId};

/// Why an epoch ended. Decided once, in one place, per epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum EpochEnd {
    /// This end closed gracefully (after a Goodbye).
    #[error("closed locally")]
    Closed,
    /// The peer ended the epoch (its close, its fault, or its verdict on us).
    #[error("the peer ended the epoch")]
    PeerClosed,
    /// The peer stopped answering (liveness channel timed out or reset).
    #[error("the peer was lost")]
    PeerLost,
    /// The local transport failed (an error completion, a failed post).
    #[error("transport fault: {0}")]
    Fault(LinkFault),
    /// The peer broke the protocol: the mux's batches, or the link's
    /// framing, credit or liveness rules.
    #[error("peer violated the protocol: {0}")]
    Violation(#[from] ProtocolError),
    /// A newer connection to the same peer replaced this one.
    #[error("replaced by a newer connection")]
    Replaced,
    /// A task of this node serving the epoch panicked (a bug here, or in the
    /// message sink the peer task called): the mux's peer task, a TCP
    /// link's reader or writer, an RDMA link's completion poller, handler
    /// or liveness task. The epoch ended; the mux goes on with the next.
    #[error("a task serving the epoch panicked")]
    Internal,
    /// The transport is shutting down.
    #[error("transport shutdown")]
    Shutdown,
}

impl EpochEnd {
    /// A close one end chose (ours, the node's shutdown, the peer's, or a
    /// replacement): what the link completed is still delivered.
    pub fn is_close(&self) -> bool {
        matches!(
            self,
            EpochEnd::Closed | EpochEnd::Shutdown | EpochEnd::PeerClosed | EpochEnd::Replaced
        )
    }

    /// An end that may have dropped batches the link had completed: a
    /// received batch's buffer the provider would not lend, or any panic in
    /// a task serving the link (one that lost completions among them). A
    /// `recv` reporting it after a close makes the mux count the epoch
    /// lost, not closed.
    pub fn cut_delivery(&self) -> bool {
        matches!(
            self,
            EpochEnd::Internal | EpochEnd::Fault(LinkFault::BufferNotLent { receive: true })
        )
    }
}

/// A local transport fault that ends an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LinkFault {
    /// A work completion with an error status (provider's status code).
    #[error("work completion failed with status {status}")]
    Completion {
        /// The provider's completion status.
        status: u32,
    },
    /// Posting a work request failed.
    #[error("post failed")]
    PostFailed,
    /// A socket or device I/O error.
    #[error("i/o error: {0:?}")]
    Io(std::io::ErrorKind),
    /// An injected fault (tests).
    #[error("injected fault")]
    Injected,
    /// A signaled SEND of ours stayed posted past twice the RC retry
    /// budget (at least 2 s): the peer's RC layer acknowledges too little to finish it
    /// (an RNR NAK or a lone ACK now and then restarts the retry count)
    /// while our sends hold their share of the node's send pool.
    #[error("sends stalled: the peer acknowledges too little to complete them")]
    SendsStalled,
    /// A send completion for a work request this link never posted (a
    /// provider's bug): retiring up to it would give back buffers the
    /// device may still be gathering.
    #[error("a send completion for work request {wr_id}, never posted")]
    UnknownCompletion {
        /// The completion's work request id.
        wr_id: u64,
    },
    /// The provider would not lend a buffer the link held as its own (a
    /// received batch's, or every free send buffer with none out to come
    /// back; libibverbs lends none a posted WR names): the link's account
    /// of what the provider holds is wrong, so nothing is read from or sent
    /// out of it.
    #[error("the provider would not lend a {} buffer the link held as its own", if *receive { "receive" } else { "send" })]
    BufferNotLent {
        /// A receive buffer (else a send buffer).
        receive: bool,
    },
}

impl LinkFault {
    /// `IBV_WC_RNR_RETRY_EXC_ERR`, the status both providers report.
    pub const RNR_RETRY_EXCEEDED: u32 = 13;

    /// Our SENDs ran out of RNR retries: the peer did not post the receives
    /// its credit announced. An honest peer cannot cause it (our own credit
    /// bug could, so it is a fault, not a violation); a connector redials
    /// such a peer only after a backoff, as after a violation.
    pub fn is_rnr_exhausted(&self) -> bool {
        matches!(self, LinkFault::Completion { status } if *status == Self::RNR_RETRY_EXCEEDED)
    }

    /// `IBV_WC_REM_INV_REQ_ERR`: the responder refused our SEND as invalid
    /// (longer than the receive it had posted).
    pub const REMOTE_INVALID_REQUEST: u32 = 9;
    /// `IBV_WC_REM_ACCESS_ERR`: the responder could not write our SEND into
    /// its receive (its region not writable).
    pub const REMOTE_ACCESS: u32 = 10;

    /// A fault only a peer that breaks the link's rules causes (RNR
    /// retries run out, sends stalled, or receives shorter or less
    /// writable than the hello's `max_batch` promised, which we never
    /// exceed): redialled after a backoff.
    pub fn blames_peer(&self) -> bool {
        let refused_by_peer = matches!(
            self,
            LinkFault::Completion { status }
                if *status == Self::REMOTE_INVALID_REQUEST || *status == Self::REMOTE_ACCESS
        );
        self.is_rnr_exhausted() || refused_by_peer || *self == LinkFault::SendsStalled
    }
}

/// Errors of link operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum LinkError {
    /// The epoch is over; nothing more can be sent or received on this link.
    #[error("epoch {epoch} ended: {reason}")]
    Ended {
        /// The epoch that ended.
        epoch: Epoch,
        /// Why.
        reason: EpochEnd,
    },
    /// `post` was given more bytes than a batch may hold.
    #[error("batch of {len} bytes exceeds the link's {max} bytes")]
    BatchTooLarge {
        /// The length posted.
        len: usize,
        /// The link's `max_batch`.
        max: usize,
    },
}

/// Links closing on a peer's behalf at once, shared by the clones of one
/// node's link config: a TCP link replaced by its peer's newer one reading
/// out, an RDMA link so replaced keeping its QP up for the peer's last
/// SENDs. Past it such a link is cut at once, as a fault's link is: a peer
/// that never closes its old connections cannot make us hold sockets,
/// QPs and buffers for seconds each (docs/design.md § "A replaced link
/// delivers what its peer sent").
///
/// A link the connector made names its [`ReadOutOwner`], and the budget
/// shares itself out: one peer holds at most a quarter of it, peers this
/// node did not register (they only dialled in) at most half of it
/// together, and those from one source an eighth, so neither one peer
/// redialling nor a crowd of fresh ids can leave the registered peers
/// without a read-out, and one host's crowd cannot leave the other
/// strangers without one (docs/design.md § "A closed link delivers both
/// ways").
///
/// Past its share, a close for the peer's own close may still take a
/// short one ([`ReadOutTier::Short`]: our last batches flushed, the peer's
/// last word not waited for: at most 1.1 s on TCP, `close_wait` on RDMA),
/// from a second pool four times as large and shared the same way; past
/// that it is cut too.
#[derive(Clone, Debug)]
pub struct ReadOutBudget {
    counts: Arc<ReadOutCounts>,
    max: usize,
    /// Whose link this clone serves (`None`: a link made outside a
    /// connector, bound by the total alone).
    owner: Option<ReadOutOwner>,
}

/// Whose link asks a [`ReadOutBudget`] for a read-out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadOutOwner {
    /// The peer the link is to.
    pub peer: PeerId,
    /// This node registered the peer's address, rather than only accepting
    /// its dial.
    pub registered: bool,
    /// Where an unregistered peer dialled in from (an IPv4 address, or an
    /// IPv6 /64); `None` if unknown.
    pub source: Option<IpAddr>,
}

/// Which of a [`ReadOutBudget`]'s two pools a read-out comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutTier {
    /// A whole read-out: the peer's last batches are waited for.
    Full,
    /// A short one, for the peer's close past its share of the full ones:
    /// our last batches go out, the peer's last word is not waited for.
    Short,
}

impl ReadOutTier {
    /// Its pool's place in `ReadOutCounts::held`.
    fn index(self) -> usize {
        match self {
            ReadOutTier::Full => 0,
            ReadOutTier::Short => 1,
        }
    }
}

#[derive(Debug, Default)]
struct ReadOutCounts {
    /// Held now, by tier (`Full`, `Short`).
    held: Mutex<[ReadOutsHeld; 2]>,
    refused: AtomicU64,
    short_refused: AtomicU64,
}

/// Read-outs of one tier held now. `by_peer` and `by_source` have an
/// entry only while that peer or source holds one, so they never outgrow
/// the pool.
#[derive(Debug, Default)]
struct ReadOutsHeld {
    total: usize,
    unregistered: usize,
    by_peer: HashMap<PeerId, usize>,
    /// Held by unregistered peers, per source.
    by_source: HashMap<IpAddr, usize>,
}

impl ReadOutsHeld {
    /// Whether `owner` may take one more of a pool of `max`: a quarter of
    /// it a peer, half for the unregistered, an eighth for the unregistered
    /// from one source, all of it in all.
    fn fits(&self, owner: Option<ReadOutOwner>, max: usize) -> bool {
        self.total < max
            && owner.is_none_or(|owner| {
                held_under(&self.by_peer, &owner.peer) < max.div_ceil(4)
                    && (owner.registered
                        || self.unregistered < max.div_ceil(2)
                            && owner.source.is_none_or(|from| {
                                held_under(&self.by_source, &from) < max.div_ceil(8)
                            }))
            })
    }

    /// The source `owner`'s read-outs count against, if any.
    fn source_of(owner: &ReadOutOwner) -> Option<IpAddr> {
        owner.source.filter(|_| !owner.registered)
    }

    fn take(&mut self, owner: Option<ReadOutOwner>) {
        self.total += 1;
        if let Some(owner) = owner {
            *self.by_peer.entry(owner.peer).or_default() += 1;
            self.unregistered += usize::from(!owner.registered);
            if let Some(from) = Self::source_of(&owner) {
                *self.by_source.entry(from).or_default() += 1;
            }
        }
    }

    /// Saturating, and no panic while unwinding: this runs in
    /// `ReadOut::drop`.
    fn give(&mut self, owner: Option<ReadOutOwner>) {
        debug_assert!(
            self.total > 0 || std::thread::panicking(),
            "a read-out given back that was not held"
        );
        self.total = self.total.saturating_sub(1);
        if let Some(owner) = owner {
            self.unregistered = self
                .unregistered
                .saturating_sub(usize::from(!owner.registered));
            release(&mut self.by_peer, owner.peer);
            if let Some(from) = Self::source_of(&owner) {
                release(&mut self.by_source, from);
            }
        }
    }
}

/// How many are held under `key`.
fn held_under<K: std::hash::Hash + Eq>(counts: &HashMap<K, usize>, key: &K) -> usize {
    counts.get(key).copied().unwrap_or(0)
}

/// One less held under `key`, its entry gone at none.
fn release<K: std::hash::Hash + Eq>(counts: &mut HashMap<K, usize>, key: K) {
    if let Entry::Occupied(mut count) = counts.entry(key) {
        *count.get_mut() -= 1;
        if *count.get() == 0 {
            count.remove();
        }
    }
}

impl ReadOutBudget {
    /// A budget of `max` read-outs at once, and `4 × max` short ones (0:
    /// every close the peer chooses is cut at once, our flush with it).
    pub fn new(max: usize) -> ReadOutBudget {
        ReadOutBudget {
            counts: Arc::default(),
            max,
            owner: None,
        }
    }

    /// This budget, for the links of `owner`.
    pub fn owned_by(&self, owner: ReadOutOwner) -> ReadOutBudget {
        ReadOutBudget {
            owner: Some(owner),
            ..self.clone()
        }
    }

    /// Whose links this clone serves, if a connector named them.
    pub fn owner(&self) -> Option<ReadOutOwner> {
        self.owner
    }

    /// The most full read-outs one peer holds at once: a quarter of the
    /// budget (of the short pool, a quarter of it likewise).
    pub fn per_peer(&self) -> usize {
        self.max.div_ceil(4)
    }

    /// The most full read-outs the peers this node did not register hold
    /// together: half of the budget (of the short pool, half likewise).
    pub fn unregistered(&self) -> usize {
        self.max.div_ceil(2)
    }

    /// The most full read-outs the unregistered peers from one source hold
    /// together: an eighth of the budget (of the short pool likewise).
    pub fn per_source(&self) -> usize {
        self.max.div_ceil(8)
    }

    /// How many of `tier` may be held at once.
    pub fn max(&self, tier: ReadOutTier) -> usize {
        match tier {
            ReadOutTier::Full => self.max,
            ReadOutTier::Short => self.max.saturating_mul(4),
        }
    }

    /// Full read-outs held now.
    pub fn in_use(&self) -> usize {
        self.in_use_of(ReadOutTier::Full)
    }

    /// Read-outs of `tier` held now.
    pub fn in_use_of(&self, tier: ReadOutTier) -> usize {
        self.held()[tier.index()].total
    }

    /// Full read-outs `peer`'s links hold now.
    pub fn held_by(&self, peer: PeerId) -> usize {
        self.held()[ReadOutTier::Full.index()]
            .by_peer
            .get(&peer)
            .copied()
            .unwrap_or(0)
    }

    /// Closes that found no full read-out in their share: a replaced link
    /// is then cut at once; the peer's close asks for a short one.
    pub fn refused(&self) -> u64 {
        self.counts.refused.load(Ordering::Relaxed)
    }

    /// Closes for the peer's close that found no short read-out either,
    /// and were cut at once.
    pub fn short_refused(&self) -> u64 {
        self.counts.short_refused.load(Ordering::Relaxed)
    }

    fn held(&self) -> MutexGuard<'_, [ReadOutsHeld; 2]> {
        self.counts
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// One read-out of `tier`, given back when the guard drops; `None` past
    /// the pool or the owner's share of it.
    pub(crate) fn hold(&self, tier: ReadOutTier) -> Option<ReadOut> {
        self.try_take(tier).then(|| ReadOut(self.clone(), tier))
    }

    pub(crate) fn try_take(&self, tier: ReadOutTier) -> bool {
        let mut held = self.held();
        let pool = &mut held[tier.index()];
        if pool.fits(self.owner, self.max(tier)) {
            pool.take(self.owner);
            return true;
        }
        drop(held);
        let refused = match tier {
            ReadOutTier::Full => &self.counts.refused,
            ReadOutTier::Short => &self.counts.short_refused,
        };
        refused.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Gives back a read-out of `tier` this clone took.
    pub(crate) fn give_back(&self, tier: ReadOutTier) {
        self.held()[tier.index()].give(self.owner);
    }
}

/// One read-out of a [`ReadOutBudget`], given back on drop.
#[derive(Debug)]
pub(crate) struct ReadOut(ReadOutBudget, ReadOutTier);

impl ReadOut {
    /// Which pool it came from.
    pub(crate) fn tier(&self) -> ReadOutTier {
        self.1
    }
}

impl Drop for ReadOut {
    fn drop(&mut self) {
        self.0.give_back(self.1);
    }
}

impl Default for ReadOutBudget {
    /// 16 read-outs at once: 4 a peer, 8 for the unregistered, 2 for the
    /// unregistered from one source.
    fn default() -> Self {
        ReadOutBudget::new(16)
    }
}

/// An ordered, reliable batch pipe to one peer for one epoch.
///
/// `reserve` and `recv` are cancel-safe: dropping their futures loses no
/// credit and no batch, so the mux can `select!` over them.
pub trait Link: Send + Sync + 'static {
    /// A writable send buffer holding one link credit until posted or dropped.
    type SendBuf: DerefMut<Target = [u8]> + Send + 'static;
    /// A received batch; dropping it gives the buffer back (and the peer its credit).
    type Batch: Deref<Target = [u8]> + Send + 'static;
    /// Whether dropping a [`Link::Batch`] is a provider call (an RDMA
    /// receive re-post) rather than a buffer going back to a free list: the
    /// mux then lets the consumers a batch woke run before it releases it.
    const RELEASE_POSTS: bool;
    /// Whether [`Link::try_reserve`] can give a buffer: only then does the
    /// mux let a producer write in its own turn.
    const TRY_RESERVE: bool = false;
    /// Whether [`Link::try_recv`] can give a batch and the link's reader
    /// tells [`Link::set_arrivals`]' hook: only then does the mux decode a
    /// batch in the reader's turn.
    const TRY_RECV: bool = false;

    /// The epoch this link is.
    fn epoch(&self) -> Epoch;

    /// Largest batch `post` accepts, and the length of every `SendBuf`.
    fn max_batch(&self) -> usize;

    /// Waits for a link credit and a free send buffer.
    fn reserve(&self) -> impl Future<Output = Result<Self::SendBuf, LinkError>> + Send;

    /// A link credit and a send buffer if both are free now, for a producer
    /// writing in its own turn: never waits, registers no waiter and joins
    /// no line. `None`: not now. Default: always `None` (such a link's
    /// batches all go through its peer task).
    fn try_reserve(&self) -> Option<Result<Self::SendBuf, LinkError>> {
        None
    }

    /// Sends the first `len` bytes of `buf`, in order after every earlier post.
    fn post(&self, buf: Self::SendBuf, len: usize) -> Result<(), LinkError>;

    /// [`Link::post`] for the epoch's last batch (the Goodbye): a link whose
    /// graceful end waits for its posts to land asks for this one's
    /// completion, so the wait ends when it has landed.
    fn post_last(&self, buf: Self::SendBuf, len: usize) -> Result<(), LinkError>;

    /// The next batch from the peer. After the epoch ends, batches the link
    /// had already received are still returned, then the error. A graceful
    /// end (ours or the peer's) also returns what the peer sent until it
    /// said it sends nothing more (its FIN, or the RDMA link's half-close),
    /// and so may a link ended as [`EpochEnd::Replaced`] while its node's
    /// [`ReadOutBudget`] has a read-out for it. A link that had to drop
    /// batches it received (the RDMA link, when the provider will not lend
    /// a received batch's buffer) returns none after them, and its error
    /// names that end ([`EpochEnd::cut_delivery`]) even where
    /// [`Link::ended`] says a close came first.
    fn recv(&self) -> impl Future<Output = Result<Self::Batch, LinkError>> + Send;

    /// The next batch if one is ready, the epoch has not ended, and the
    /// caller has handled every batch handed out before it: `handled` is
    /// how many of those ([`Link::recv`]'s and `try_recv`'s together) it
    /// has. One in another task's hands makes this `None`, so a batch
    /// taken here never overtakes an earlier one. Never waits. Where
    /// releasing a batch is a provider call ([`Link::RELEASE_POSTS`]), one
    /// taken here is released once the worker has run the tasks its
    /// reader's turn woke. Default: always `None`.
    fn try_recv(&self, handled: u64) -> Option<Self::Batch> {
        let _ = handled;
        None
    }

    /// Whom the link's reader tells, in its own turn, that a batch is
    /// ready, before it wakes the task waiting in [`Link::recv`]; that task
    /// is woken only for what the hook left. Batches that arrived before
    /// it was set wait for `recv`. Set once; later calls are ignored.
    /// Default: ignored.
    fn set_arrivals(&self, arrivals: Weak<dyn Arrivals>) {
        let _ = arrivals;
    }

    /// Ends the epoch on both ends (idempotent; the first reason wins).
    fn fail(&self, reason: EpochEnd);

    /// Resolves once the epoch has ended, with the reason.
    fn ended(&self) -> impl Future<Output = EpochEnd> + Send;
}

/// Told by a link's reader that batches are ready ([`Link::set_arrivals`]).
pub trait Arrivals: Send + Sync {
    /// Batches are ready for [`Link::try_recv`]; called in the reader's
    /// turn (a TCP link's read task, an RDMA link's completion handler, the
    /// peer's `post` on a mem link), so it must not block.
    fn arrived(&self);
}

/// Why a peer's address could not be registered.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum RegisterError {
    /// The address bytes do not parse for this kind of node.
    #[error("malformed peer address ({len} bytes)")]
    Malformed {
        /// Length of the address given.
        len: usize,
    },
    /// The address is this node's own.
    #[error("address is this node's own")]
    Own,
    /// The node has shut down.
    #[error("node is shut down")]
    Shutdown,
}

/// A transport endpoint: a mux plus whatever brings its links up (listener,
/// dialer, bootstrap). What the velo adapters and the CLI are written against.
pub trait Node: Send + Sync + 'static {
    /// The link type this node's epochs run on.
    type Link: Link;

    /// The mux carrying every slot and message of this node.
    fn mux(&self) -> &Mux<Self::Link>;

    /// The bytes a peer needs to reach this node (published by velo in its
    /// `WorkerAddress` under the transport's key).
    fn address(&self) -> Vec<u8>;

    /// Learns how to reach the node whose [`Node::address`] is `address`;
    /// returns the id the mux knows it by. Idempotent.
    fn register(&self, address: &[u8]) -> Result<PeerId, RegisterError>;

    /// Forgets `peer`: its link is torn down and released, and nothing dials
    /// it again until it is registered again (only what keeps its epochs
    /// increasing is kept).
    fn unregister(&self, peer: PeerId);

    /// Stops accepting, ends every epoch, and stops the mux. Does not wait.
    fn shutdown(&self);

    /// The node's last failed dial to `peer`, unless one succeeded since
    /// (links come up in the background, so a caller waiting on a peer asks
    /// here). `None` where the node does not dial.
    fn last_dial_failure(&self, _peer: PeerId) -> Option<tcp::DialFailure> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::ReadOutTier::{Full, Short};
    use super::*;

    fn owner(peer: u64, registered: bool) -> ReadOutOwner {
        ReadOutOwner {
            peer: PeerId(peer),
            registered,
            source: None,
        }
    }

    fn stranger_from(peer: u64, source: &str) -> ReadOutOwner {
        ReadOutOwner {
            source: Some(source.parse().expect("an address")),
            ..owner(peer, false)
        }
    }

    /// One peer holds at most a quarter of the budget and the peers this
    /// node never registered half of it together, so the registered ones
    /// always find read-outs left; each share comes back with its guards,
    /// and the table of holders empties with them.
    #[test]
    fn the_read_out_budget_keeps_shares_for_each_peer_and_the_registered() {
        let budget = ReadOutBudget::new(16);
        assert_eq!((budget.per_peer(), budget.unregistered()), (4, 8));
        let redialler = budget.owned_by(owner(1, true));
        let mut held: Vec<ReadOut> = (0..4).filter_map(|_| redialler.hold(Full)).collect();
        assert_eq!(held.len(), 4);
        assert!(redialler.hold(Full).is_none(), "a fifth for one peer");
        assert_eq!((budget.held_by(PeerId(1)), budget.refused()), (4, 1));
        // Fresh ids, one read-out each, fill the unregistered half and no more.
        let fresh: Vec<ReadOut> = (100..112)
            .filter_map(|id| budget.owned_by(owner(id, false)).hold(Full))
            .collect();
        assert_eq!(fresh.len(), 8);
        assert_eq!(budget.refused(), 5);
        // The registered peers still have the rest, a quarter each.
        let honest = budget.owned_by(owner(2, true));
        held.extend((0..4).filter_map(|_| honest.hold(Full)));
        assert_eq!((budget.in_use(), budget.held_by(PeerId(2))), (16, 4));
        // The total still bounds everyone.
        assert!(budget.owned_by(owner(3, true)).hold(Full).is_none());
        assert!(budget.hold(Full).is_none(), "an unowned link");
        drop(fresh);
        assert_eq!(budget.in_use(), 8);
        assert!(budget.owned_by(owner(200, false)).hold(Full).is_some());
        drop(held);
        assert_eq!(budget.in_use(), 0);
        assert!(budget.held()[0].by_peer.is_empty());
        assert_eq!(budget.held()[0].unregistered, 0);
    }

    /// Strangers from one source hold at most an eighth of each pool
    /// together, so one host's crowd of fresh ids leaves the other
    /// strangers' share; a registered peer's source is not counted.
    #[test]
    fn strangers_from_one_source_share_an_eighth_of_each_pool() {
        let budget = ReadOutBudget::new(16);
        assert_eq!(budget.per_source(), 2);
        let crowd: Vec<ReadOut> = (100..110)
            .filter_map(|id| budget.owned_by(stranger_from(id, "10.0.0.9")).hold(Full))
            .collect();
        assert_eq!((crowd.len(), budget.refused()), (2, 8));
        let short: Vec<ReadOut> = (100..120)
            .filter_map(|id| budget.owned_by(stranger_from(id, "10.0.0.9")).hold(Short))
            .collect();
        assert_eq!(short.len(), 8, "an eighth of the short pool");
        let elsewhere = budget.owned_by(stranger_from(200, "10.0.0.7"));
        let other = elsewhere.hold(Full).expect("another source's share");
        let registered = ReadOutOwner {
            registered: true,
            ..stranger_from(300, "10.0.0.9")
        };
        let chosen: Vec<ReadOut> = (0..4)
            .filter_map(|_| budget.owned_by(registered).hold(Full))
            .collect();
        assert_eq!(chosen.len(), 4, "a registered peer's quarter");
        drop((crowd, short, other, chosen));
        assert!(budget.held().iter().all(|pool| pool.by_source.is_empty()));
        assert!(
            budget
                .owned_by(stranger_from(101, "10.0.0.9"))
                .hold(Full)
                .is_some()
        );
    }

    /// The shares round up, so a small budget still serves a peer: one
    /// read-out is one for anybody; none is none.
    #[test]
    fn a_small_read_out_budget_still_serves_one_peer() {
        let one = ReadOutBudget::new(1);
        let fresh = one.owned_by(owner(9, false)).hold(Full);
        assert!(fresh.is_some());
        assert!(one.owned_by(owner(1, true)).hold(Full).is_none());
        drop(fresh);
        assert!(one.owned_by(owner(1, true)).hold(Full).is_some());
        let none = ReadOutBudget::new(0);
        assert!(none.owned_by(owner(1, true)).hold(Full).is_none());
        assert!(none.hold(Full).is_none());
        assert_eq!(none.refused(), 2);
    }

    /// Past its share of full read-outs, a peer's close takes a short one
    /// from the second pool (four times as large, shared the same way),
    /// counted apart; past that it is refused too, and each tier's guard
    /// gives back to its own pool.
    #[test]
    fn short_read_outs_have_their_own_pool_and_shares() {
        let budget = ReadOutBudget::new(4);
        assert_eq!((budget.max(Full), budget.max(Short)), (4, 16));
        let peer = budget.owned_by(owner(1, true));
        let full = peer.hold(Full).expect("its one full read-out");
        assert!(peer.hold(Full).is_none());
        let short: Vec<ReadOut> = (0..5).filter_map(|_| peer.hold(Short)).collect();
        assert_eq!(short.len(), 4, "a quarter of the short pool");
        assert_eq!((budget.refused(), budget.short_refused()), (1, 1));
        let crowd: Vec<ReadOut> = (100..120)
            .filter_map(|id| budget.owned_by(owner(id, false)).hold(Short))
            .collect();
        assert_eq!(crowd.len(), 8, "half of it for the unregistered");
        assert_eq!((budget.in_use_of(Full), budget.in_use_of(Short)), (1, 12));
        assert!(short.iter().all(|r| r.tier() == Short));
        drop((full, short, crowd));
        assert_eq!((budget.in_use_of(Full), budget.in_use_of(Short)), (0, 0));
        assert!(budget.held().iter().all(|pool| pool.by_peer.is_empty()));
    }
}
