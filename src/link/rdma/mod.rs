//! The RDMA link: one epoch of [`Link`] over one RC queue pair.
//!
//! ```text
//!  mux ─ reserve() ─► credit + SQ slot + pool chunk (owned guard) ─ encode in place ─ post()
//!        post() ─► SEND_WITH_IMM(imm = receives re-posted, 31 bits | starved)
//!  poller / handler    ─► recv WC: imm ─► credit; data ─► ready; empty ─► re-post now
//!                       ─► send WC (every k-th signaled) ─► chunks to the pool, SQ slots back
//!  mux ◄─ recv() ◄─ ready ─ Batch (owned guard on a receive MR) ─ drop ─► re-post ─► owed
//!        ready ─► arrivals hook, if one is set (try_recv); recv woken for what it left
//!  error WC, failed post, fail() ─► QP to ERR ─► ended; completed receives drain first
//!  graceful end (Closed, Shutdown; PeerClosed, Replaced on one of the node's read-outs):
//!      posted SENDs complete ─► on_last_sent
//!      (the peer is told) ─► the peer's last SENDs land ─► peer_finished ─► QP to ERR
//! ```
//!
//! Owner: `Shared::state` (one mutex) holds credit, SQ slots, posted chunks
//! and the ready queue; the send pool (`pool.rs`, shared by a node's links)
//! owns free chunks; the poller task, or the provider's completion handler in
//! its place, polls the CQ (one at a time). Sends are posted under
//! that mutex, so immediates leave in the order they were counted. Design,
//! rulings and open hazards: docs/rdma-link.md.

mod connect;
pub mod credit;
mod node;
mod poller;
pub mod pool;
pub mod registered;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};

use thiserror::Error;
use tokio::sync::Notify;

pub use self::connect::{PreparedEnd, pair};
use self::credit::Credit;
pub use self::node::{DEFAULT_MAX_REGISTERED, RdmaEpochs, RdmaNodeConfig, RdmaTransport};
use self::pool::{Blocked, Lease, PoolChunk};
pub use self::pool::{DEFAULT_POOL_BUFFERS, PoolStats, SendPool};
pub use self::registered::{MemlockLimit, RegisteredBudget, Registration};
use super::{
    Arrivals, EpochEnd, Link, LinkError, LinkFault, ReadOut, ReadOutBudget, ReadOutOwner,
    ReadOutTier,
};
use crate::mux::protocol::Epoch;
use crate::verbs::{
    Device, MemoryRegion, PostError, QpAddress, QueuePair, RecvWr, SendOpcode, SendWr, Sge,
    VerbsError, WcStatus,
};

/// Receive WR ids carry this bit; send WR ids are a sequence number below it.
const RECV_TAG: u64 = 1 << 63;

/// Shape and RC attributes of an RDMA link. Both ends must agree on
/// `recv_depth` and `max_batch` (the bootstrap hello carries them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaConfig {
    /// Receives each end posts (R): the link credit a sender starts with.
    /// 4–65,536; default 32.
    pub recv_depth: usize,
    /// Bytes per send and receive buffer, the largest batch. 64 B–16 MiB;
    /// default 64 KiB.
    pub max_batch: usize,
    /// Send buffers one end may hold at once (encoding or in flight): its
    /// cap on the node's send pool, or the size of the private pool of
    /// [`PreparedEnd::new`]. At most [`MAX_QUEUE`]; default 16.
    pub send_buffers: usize,
    /// Signal every k-th send WR (and any WR that takes the last SQ slot or
    /// the end's last allowed buffer, or whose buffer the pool may be
    /// waiting for). At most [`MAX_QUEUE`]; default 8.
    pub signal_every: usize,
    /// RNR retries (7 = forever). Default 6: link credit is receive posts,
    /// so an honest peer never answers RNR, and one that announced receives
    /// it never posts would otherwise hold our sends, and their pool chunks,
    /// for as long as it keeps the connection. Tests use 0 so a credit bug
    /// fails loudly as RNR_RETRY_EXC_ERR.
    pub rnr_retry: u8,
    /// RNR NAK timer code this end asks senders to wait. Default 12 (0.64 ms).
    pub min_rnr_timer: u8,
    /// Local ACK timeout exponent. Default 14 (67 ms).
    pub timeout: u8,
    /// Retries after timeouts or sequence NAKs. Default 7.
    pub retry_cnt: u8,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            recv_depth: 32,
            max_batch: 64 * 1024,
            send_buffers: 16,
            signal_every: 8,
            rnr_retry: 6,
            min_rnr_timer: 12,
            timeout: 14,
            retry_cnt: 7,
        }
    }
}

/// The most `send_buffers` or `signal_every` a link end takes.
pub const MAX_QUEUE: usize = 1 << 16;

impl RdmaConfig {
    /// The defaults with `rnr_retry = 0`: credits must make RNR unreachable,
    /// and any RNR NAK ends the epoch with RNR_RETRY_EXC_ERR.
    pub fn strict() -> RdmaConfig {
        RdmaConfig {
            rnr_retry: 0,
            ..RdmaConfig::default()
        }
    }

    /// Send queue depth: every credit, every buffer, and one unsignaled run.
    pub fn sq_depth(&self) -> usize {
        self.recv_depth + self.send_buffers + self.signal_every
    }

    /// CQ depth: a full flush of both queues fits.
    pub fn cq_depth(&self) -> usize {
        self.sq_depth() + self.recv_depth
    }

    /// Bytes a stand-alone link end registers ([`PreparedEnd::new`]: a
    /// private pool of `send_buffers` plus its receive ring), saturating; an
    /// absurd config is refused by the budget, not wrapped.
    pub fn registered_bytes(&self) -> usize {
        self.send_buffers
            .saturating_add(self.recv_depth)
            .saturating_mul(self.max_batch)
    }

    /// Bytes of one end's receive ring: what a link on a node's shared send
    /// pool registers.
    pub fn ring_bytes(&self) -> usize {
        self.recv_depth.saturating_mul(self.max_batch)
    }

    /// The ranges a link end accepts. The ceilings are the hello's: a node
    /// that announced more would be refused by every peer as malformed and
    /// redial for ever, so it is refused here, at start.
    fn validate(&self) -> Result<(), RdmaError> {
        use crate::link::bootstrap::{RdmaEndpoint, TcpEndpoint};
        const _: () = assert!(RdmaEndpoint::MAX_RECV_DEPTH <= credit::COUNT_MASK);
        let depths = Credit::MIN_DEPTH as usize..=RdmaEndpoint::MAX_RECV_DEPTH as usize;
        // The floor: a smaller buffer holds no batch header and record.
        let batches = TcpEndpoint::MIN_BATCH as usize..=TcpEndpoint::MAX_BATCH as usize;
        // Bounded so the queue sizes (`sq_depth`, `cq_depth`) cannot wrap.
        let queue = 1..=MAX_QUEUE;
        let checks = [
            (
                "recv_depth",
                self.recv_depth,
                depths.contains(&self.recv_depth),
            ),
            (
                "max_batch",
                self.max_batch,
                batches.contains(&self.max_batch),
            ),
            (
                "send_buffers",
                self.send_buffers,
                queue.contains(&self.send_buffers),
            ),
            (
                "signal_every",
                self.signal_every,
                queue.contains(&self.signal_every),
            ),
        ];
        for (field, value, ok) in checks {
            if !ok {
                return Err(RdmaError::InvalidConfig { field, value });
            }
        }
        Ok(())
    }
}

/// Errors building an RDMA link.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RdmaError {
    /// A configuration value out of range.
    #[error("invalid link config: {field} = {value}")]
    InvalidConfig {
        /// Which field.
        field: &'static str,
        /// Its value.
        value: usize,
    },
    /// A verbs call failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    /// Posting the initial receives failed.
    #[error(transparent)]
    Post(#[from] PostError),
    /// The link's buffers would take the node past its registered-memory bound.
    #[error(
        "registering {needed} bytes (receive ring or send pool) would exceed max_registered = \
         {max} bytes ({in_use} already registered); raise RdmaNodeConfig::max_registered or \
         shrink recv_depth, pool_buffers or max_batch"
    )]
    RegisteredLimit {
        /// Bytes asked for (a receive ring, a send pool, or both).
        needed: usize,
        /// Bytes live links already hold.
        in_use: usize,
        /// The bound.
        max: usize,
    },
    /// A link for a peer the node did not register would take the links
    /// of such peers past half of what the send pool leaves of
    /// `max_registered`.
    #[error(
        "peers this node did not register hold {in_use} of the {max} registered bytes they \
         may; {needed} more refused"
    )]
    StrangersRegisteredLimit {
        /// Bytes asked for (a receive ring).
        needed: usize,
        /// Bytes strangers' links already hold.
        in_use: usize,
        /// Their bound: half of `max_registered` less the send pool.
        max: usize,
    },
    /// `RLIMIT_MEMLOCK` is below what the node may register.
    #[error(
        "ulimit -l (RLIMIT_MEMLOCK) is {limit} bytes but {needed} bytes may be registered: \
         raise it to at least {needed_kib} KiB (ulimit -l {needed_kib}, systemd LimitMEMLOCK=, \
         docker --ulimit memlock=) or lower max_registered"
    )]
    MemlockTooSmall {
        /// Bytes that may be registered.
        needed: usize,
        /// The soft limit, in bytes.
        limit: u64,
        /// `needed` in KiB, rounded up: the `ulimit -l` value that suffices.
        needed_kib: u64,
    },
}

/// Traffic counters of one link end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LinkStats {
    /// Batches posted.
    pub batches_sent: u64,
    /// Zero-length credit-only SENDs posted.
    pub credit_only_sent: u64,
    /// Empty signaled SENDs posted behind an unsignaled tail older than the
    /// stall limit, so the stall detector times it.
    pub tail_fences: u64,
    /// Signaled send WRs posted.
    pub signaled_sends: u64,
    /// Signaled send WRs that completed successfully: the peer's RC
    /// acknowledged them, and every SEND before them.
    pub sends_acked: u64,
    /// Batches received.
    pub batches_received: u64,
    /// Credit-only messages received.
    pub credit_only_received: u64,
    /// Successful receives dropped unread: a batch whose buffer the
    /// provider would not lend and those behind it, or ones completing
    /// after `recv` reported the end or a panic lost completions.
    pub receives_dropped: u64,
    /// Empty signaled SENDs posted at a graceful end to retire an
    /// unsignaled tail.
    pub closing_fences: u64,
    /// Waits of a graceful close (for our posted SENDs, or for the peer's
    /// last-sent word) that ran out their bound instead of ending on the
    /// event.
    pub close_waits_expired: u64,
    /// Closes for the peer's close made short (our posted SENDs waited
    /// for, the peer's last word not) on a short read-out, its share of
    /// the node's full ones being spent.
    pub short_closes: u64,
}

/// Where this end's credit stands (see [`credit::Credit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreditSnapshot {
    /// Credits free to reserve.
    pub held: u32,
    /// Credits inside unposted send buffers.
    pub reserved: u32,
    /// Our SENDs the peer has not reported re-posting a receive for.
    pub unreturned: u32,
    /// Receives we re-posted and have not reported to the peer.
    pub owed: u32,
    /// Our receives completed and not yet re-posted (queued or held as batches).
    pub pending: u32,
}

struct State<D: Device> {
    credit: Credit,
    sq_free: usize,
    /// Send WRs posted and not yet known complete: (wr_id, pool chunk).
    posted: VecDeque<(u64, Option<PoolChunk<D>>)>,
    /// The signaled ones among them, with when each was posted: the oldest
    /// must complete within [`stall_limit`].
    signaled: VecDeque<(u64, tokio::time::Instant)>,
    /// When the first unsignaled WR after the last signaled one was posted:
    /// a tail no signaled WR follows, which the stall detector cannot time
    /// until [`Shared::check_stall`] posts a fence behind it.
    tail_since: Option<tokio::time::Instant>,
    next_wr: u64,
    unsignaled: usize,
    /// Completed data receives not yet handed out: (buffer, length).
    ready: VecDeque<(usize, usize)>,
    /// Batches `recv` and `try_recv` have handed out.
    handed_out: u64,
    /// Receive buffers of batches the reader decoded and dropped, waiting
    /// to be re-posted after the tasks its turn woke ([`RepostLater`]); at
    /// most the receive depth.
    released: Vec<usize>,
    recv_posted: usize,
    /// `reserve` calls waiting for credit (their SENDs' starved bit).
    reserve_waiters: usize,
    ended: Option<EpochEnd>,
    /// A graceful end saw its posted SENDs complete (or gave up on them)
    /// and ran the last-sent hooks.
    last_sent: bool,
    /// A graceful end's closing fence found no credit or SQ slot: it goes
    /// when one comes back, unless the close has moved on meanwhile.
    fence_owed: bool,
    /// The end's teardown ran (the QP moved to ERR, or found gone): only
    /// then do the flushes come that end the poller's watch. A graceful
    /// close keeps the QP up a while after `ended` is set.
    torn_down: bool,
    /// The peer broke the link's rules in this epoch (the end may have been
    /// decided before, by a graceful close): nothing more from it is
    /// delivered.
    violated: bool,
    /// An abrupt end came while a graceful close waited: the close stops
    /// waiting, says no last-sent word, and tears down.
    cut: bool,
    /// A graceful close the peer chose or caused (`PeerClosed`,
    /// `Replaced`) holds one of the node's read-outs until its teardown.
    read_out: Option<ReadOut>,
    /// Whose share of the budget that read-out comes from, once the
    /// connector has named the peer.
    read_out_owner: Option<ReadOutOwner>,
    /// The teardown has begun: the flushes it makes are not a cut.
    tearing_down: bool,
    /// The poller is done: every completion the CQ will ever hold was handled.
    drained: bool,
    /// `recv` has reported the end: a receive completing after it (the QP
    /// left up by a failed move to ERR) is dropped, not handed out after.
    end_reported: bool,
    /// Received batches are dropped unread from here on, and `recv` reports
    /// this end in place of a close decided before (that close lost them
    /// too): a buffer not lent ([`Shared::refuse_delivery`]), or a panic that lost
    /// completions, after which the next batch would read as a gap the
    /// peer made.
    delivery_cut: Option<EpochEnd>,
    /// The stall deadline a look found passed, and when that look was: a
    /// look at least [`STALL_GRACE`] later finding the same deadline ends
    /// the epoch ([`Shared::check_stall`]).
    stall_suspect: Option<(tokio::time::Instant, tokio::time::Instant)>,
    stats: LinkStats,
}

impl<D: Device> State<D> {
    /// Records the end; true when this call decided it. A violation is
    /// noted either way.
    fn set_end(&mut self, reason: EpochEnd) -> bool {
        self.violated |= matches!(reason, EpochEnd::Violation(_));
        if self.ended.is_some() {
            return false;
        }
        self.ended = Some(reason);
        true
    }

    /// True when `reason`, met after a graceful end was decided and before
    /// the teardown, cuts the close short: a violation, the peer lost, a
    /// fault or a panic. Not a replacement: the peer moved on, and its last
    /// SENDs on this QP are what the close waits to deliver.
    fn note_cut(&mut self, reason: EpochEnd) -> bool {
        let abrupt = matches!(
            reason,
            EpochEnd::Violation(_) | EpochEnd::PeerLost | EpochEnd::Fault(_) | EpochEnd::Internal
        );
        let cuts = abrupt && !self.tearing_down && !self.cut;
        self.cut |= cuts;
        cuts
    }

    /// A graceful close waits no longer (and its liveness word is a reset).
    fn close_cut(&self) -> bool {
        self.cut || self.violated
    }
}

type EndHook = Box<dyn FnOnce(EpochEnd) + Send>;
type LastSentHook = Box<dyn FnOnce() + Send>;

/// Least a graceful close keeps the QP up for SENDs already posted; it waits
/// up to the QP's own retry budget when that is longer ([`close_wait`]). The
/// Goodbye is posted signaled ([`Link::post_last`]), so on a live fabric the
/// wait ends when it lands; an unsignaled last SEND is never reported
/// complete, and then the bound is met.
const GRACEFUL_CLOSE: std::time::Duration = std::time::Duration::from_millis(200);

/// Most a graceful close waits, whatever the retry budget says.
const GRACEFUL_CLOSE_CAP: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a graceful close may wait for posted SENDs: the RC layer's own
/// budget for them (`4.096 µs × 2^timeout` per try, `retry_cnt + 1` tries;
/// `timeout` 0 waits forever), within [`GRACEFUL_CLOSE`] and
/// [`GRACEFUL_CLOSE_CAP`]. A shorter wait could tear the QP down while RC is
/// still resending the Goodbye or the batch before it.
fn close_wait(config: &RdmaConfig) -> std::time::Duration {
    if config.timeout == 0 || config.timeout > 31 {
        return GRACEFUL_CLOSE_CAP;
    }
    let per_try = std::time::Duration::from_nanos(4096u64 << config.timeout);
    (per_try * (u32::from(config.retry_cnt) + 1)).clamp(GRACEFUL_CLOSE, GRACEFUL_CLOSE_CAP)
}

/// Least [`stall_limit`]: room for a NIC that rounds its ACK timeout up,
/// and for loss that keeps restarting an honest retry count.
const STALL_FLOOR: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a stall verdict waits after the limit, for completions a
/// paused or starved process has not handled yet.
const STALL_GRACE: std::time::Duration = std::time::Duration::from_millis(50);

/// How long a signaled SEND may stay posted: twice the RC layer's own
/// retry budget (`4.096 µs × 2^timeout × (retry_cnt + 1)`, unclamped), at
/// least [`STALL_FLOOR`]. An honest peer's RC layer completes it within
/// the budget or the QP fails it; one that trickles acknowledgements (an
/// RNR NAK or a lone ACK each retry period restarts the count) never ends
/// it and keeps our share of the send pool. `timeout` 0 asked to wait
/// forever: no limit.
fn stall_limit(config: &RdmaConfig) -> Option<std::time::Duration> {
    if config.timeout == 0 || config.timeout > 31 {
        return None;
    }
    let per_try = std::time::Duration::from_nanos(4096u64 << config.timeout);
    let budget = per_try * (u32::from(config.retry_cnt) + 1);
    Some((budget * 2).max(STALL_FLOOR))
}

/// Everything one link end owns. Fields drop in declaration order, which is
/// the verbs destroy order: QP, CQ, receive MRs, then the chunks still
/// posted (in `state`) go back to the pool, whose MR and PD go last.
struct Shared<D: Device> {
    qp: D::Qp,
    cq: D::Cq,
    recv_mrs: Vec<D::Mr>,
    state: Mutex<State<D>>,
    /// This end's share of the send pool (its PD is the QP's).
    lease: Lease<D>,
    /// The node budget's bytes for the receive MRs, given back after them.
    _registration: Registration,
    /// The node's budget of closes the peer chose or caused (`PeerClosed`,
    /// `Replaced`) waiting at once.
    read_outs: ReadOutBudget,
    /// The node's tally of received batches dropped unread (this end's
    /// own count is `LinkStats::receives_dropped`).
    receives_dropped: Arc<AtomicU64>,
    address: QpAddress,
    epoch: Epoch,
    config: RdmaConfig,
    wake_send: Notify,
    wake_recv: Notify,
    wake_end: Notify,
    /// The graceful close's task (one waiter; a stored permit loses no
    /// wake): its posted SENDs completed, the peer finished, or it was cut.
    wake_close: Notify,
    wake_poller: Notify,
    /// Held by whoever polls the CQ: the poller task, or the provider's
    /// completion handler.
    polling: Mutex<poller::PollBuf>,
    /// The poller found `polling` taken: whoever lets go of it wakes the
    /// poller (a completion a verbs call adds just before the handler lets
    /// go notifies nobody yet).
    poll_wanted: AtomicBool,
    detached: AtomicBool,
    on_end: Mutex<Vec<EndHook>>,
    /// Told when a graceful end has nothing more to send: the channel that
    /// tells the peer (the liveness connection's half-close, or `pair`).
    on_last_sent: Mutex<Vec<LastSentHook>>,
    /// The peer said it sends nothing more on this QP ([`RdmaLink::peer_finished`]).
    peer_finished: AtomicBool,
    /// Told of received batches before `recv` is woken for them.
    arrivals: OnceLock<Weak<dyn Arrivals>>,
    /// `rdma_link{epoch, qpn, peer_qpn}`: the poller and liveness tasks run in it.
    span: tracing::Span,
    /// Makes the next completions handled panic (unit tests).
    #[cfg(test)]
    panic_on_completion: AtomicBool,
}

/// The completion status as `ibv_wc_status` numbers it.
pub fn ibv_status(status: WcStatus) -> u32 {
    match status {
        WcStatus::Success => 0,
        WcStatus::LocLenErr => 1,
        WcStatus::LocQpOpErr => 2,
        WcStatus::LocProtErr => 4,
        WcStatus::WrFlushErr => 5,
        WcStatus::RemInvReqErr => 9,
        WcStatus::RemAccessErr => 10,
        WcStatus::RemOpErr => 11,
        WcStatus::RetryExcErr => 12,
        WcStatus::RnrRetryExcErr => 13,
    }
}

fn fault_of(err: &VerbsError) -> LinkFault {
    match err {
        VerbsError::Io { kind, .. } => LinkFault::Io(*kind),
        VerbsError::DeviceClosed => LinkFault::Io(std::io::ErrorKind::BrokenPipe),
        VerbsError::CqOverrun => LinkFault::Io(std::io::ErrorKind::OutOfMemory),
        VerbsError::NoSuchDevice { .. }
        | VerbsError::InvalidState { .. }
        | VerbsError::InvalidAttr { .. }
        | VerbsError::SendQueueFull { .. }
        | VerbsError::RecvQueueFull { .. }
        | VerbsError::SgeOutOfBounds { .. }
        | VerbsError::AccessDenied { .. }
        | VerbsError::WrongPd { .. }
        | VerbsError::TooLarge { .. }
        | VerbsError::MemoryBusy { .. }
        | VerbsError::CapExceeded { .. } => LinkFault::PostFailed,
    }
}

impl<D: Device + 'static> Shared<D> {
    fn lock(&self) -> MutexGuard<'_, State<D>> {
        // A panic under this lock is a bug here. The catch around the
        // panicking task ends the epoch (`end_after_panic`); the others go on.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ended_error(&self, reason: EpochEnd) -> LinkError {
        LinkError::Ended {
            epoch: self.epoch,
            reason,
        }
    }

    /// Ends the epoch (first reason wins). A violation is noted even when
    /// the end was decided before (a graceful close): nothing more from the
    /// peer is delivered, and the close stops waiting for it.
    fn end(&self, reason: EpochEnd) {
        let mut st = self.lock();
        let decided = st.set_end(reason);
        let cut_grace = !decided && st.note_cut(reason);
        drop(st);
        if decided {
            self.after_end(reason);
        } else if cut_grace {
            self.cut_grace(reason);
        }
    }

    /// An abrupt end during a graceful close: the end is decided, but the QP
    /// need not stay up for a peer that is gone or breaks the rules.
    fn cut_grace(&self, reason: EpochEnd) {
        let _in_link = self.span.enter();
        tracing::debug!(%reason, "the close was cut short");
        if let Err(err) = self.qp.modify_to_error() {
            tracing::debug!(%err, "moving the QP to ERR failed; the device is gone");
        }
        self.wake_close.notify_one();
        self.wake_end.notify_waiters();
    }

    /// Ends the epoch: gracefully for our close (Closed, Shutdown), the
    /// peer's (PeerClosed), or a replacement by the same peer's newer link
    /// (it still closes this one, and what it sent here lands) when a
    /// runtime is there to wait in, else now. The last two each take one of
    /// the node's read-outs (the peer's close a short one past its share),
    /// or end now.
    fn fail(self: &Arc<Self>, reason: EpochEnd) {
        // A peer whose request our responder refused broke the rules,
        // however it left: its liveness channel may close before the
        // poller sees the flush.
        let reason = match reason {
            EpochEnd::PeerLost | EpochEnd::PeerClosed => self.blame_refused_request(reason),
            other => other,
        };
        match reason {
            EpochEnd::Closed | EpochEnd::Shutdown | EpochEnd::PeerClosed | EpochEnd::Replaced
                if tokio::runtime::Handle::try_current().is_ok() =>
            {
                self.end_gracefully(reason)
            }
            EpochEnd::Closed
            | EpochEnd::Shutdown
            | EpochEnd::PeerClosed
            | EpochEnd::Replaced
            | EpochEnd::PeerLost
            | EpochEnd::Fault(_)
            | EpochEnd::Violation(_)
            | EpochEnd::Internal => self.end(reason),
        }
    }

    /// A graceful end, ours or the peer's: nothing more may be posted, but
    /// the QP stays up until the SENDs already posted have completed, so our
    /// last batches (the Goodbye among them) are not flushed by our own
    /// teardown; then the last-sent hooks tell the peer, and the QP stays up
    /// until the peer says the same, so its last SENDs land in our receives
    /// and are delivered. Each wait is bounded by [`close_wait`]; a link
    /// with no last-sent hook has nobody to hear from and skips the second.
    /// A close the peer chose takes one of the node's read-outs from the
    /// peer's share; past it a replaced link is torn down at once, and the
    /// peer's close takes a short one, making the first wait only (after
    /// its Goodbye the peer owes no batch), or past those is torn down too.
    /// docs/rdma-link.md § "Graceful close waits for posted SENDs",
    /// docs/design.md § "A closed link delivers both ways".
    fn end_gracefully(self: &Arc<Self>, reason: EpochEnd) {
        let mut short = false;
        {
            let mut st = self.lock();
            if !st.set_end(reason) {
                return;
            }
            // A close the peer chose or caused holds the QP for it: one of
            // the node's read-outs, or none and torn down at once (our own
            // closes are ours to bound).
            if matches!(reason, EpochEnd::Replaced | EpochEnd::PeerClosed) {
                let budget = match st.read_out_owner {
                    Some(owner) => self.read_outs.owned_by(owner),
                    None => self.read_outs.clone(),
                };
                st.read_out = budget.hold(ReadOutTier::Full).or_else(|| {
                    (reason == EpochEnd::PeerClosed)
                        .then(|| budget.hold(ReadOutTier::Short))
                        .flatten()
                });
                short = st
                    .read_out
                    .as_ref()
                    .is_some_and(|r| r.tier() == ReadOutTier::Short);
                if st.read_out.is_none() {
                    // Decided under this lock, as torn down at once: no
                    // graceful end can slip in between.
                    drop(st);
                    tracing::debug!(parent: &self.span, %reason, "no read-out left: torn down at once");
                    self.after_end(reason);
                    return;
                }
            }
            st.stats.short_closes += u64::from(short);
            self.fence_locked(&mut st);
        }
        self.wake_send.notify_waiters();
        self.wake_end.notify_waiters();
        let shared = self.clone();
        tokio::spawn(async move {
            let wait = close_wait(&shared.config);
            let deadline = tokio::time::Instant::now() + wait;
            shared
                .wait_close(deadline, |shared| {
                    let st = shared.lock();
                    st.posted.is_empty() || st.close_cut()
                })
                .await;
            let (unfinished, cut) = {
                let st = shared.lock();
                (st.posted.len(), st.close_cut())
            };
            if unfinished > 0 && !cut {
                shared.lock().stats.close_waits_expired += 1;
                let _in_link = shared.span.enter();
                tracing::debug!(unfinished, "graceful close gave up on posted SENDs");
            }
            // Cut short: no last-sent word, so the peer hears a reset. A
            // short close says it and goes.
            if !cut && shared.run_last_sent() && !short {
                let deadline = tokio::time::Instant::now() + wait;
                shared
                    .wait_close(deadline, |shared| {
                        shared.peer_finished.load(Ordering::Acquire) || shared.lock().close_cut()
                    })
                    .await;
                if !shared.peer_finished.load(Ordering::Acquire) && !shared.lock().close_cut() {
                    shared.lock().stats.close_waits_expired += 1;
                    let _in_link = shared.span.enter();
                    tracing::debug!("graceful close gave up waiting for the peer's last SENDs");
                }
            }
            shared.after_end(reason);
        });
    }

    /// One look for stalled sends: if the oldest signaled SEND is past
    /// [`stall_limit`] once its completions are taken, and it was at a look
    /// [`STALL_GRACE`] or more before, the epoch ends as
    /// [`LinkFault::SendsStalled`]; true then. A poller at work, a first
    /// look, or a second one sooner (two lookers, the sweep and a waiting
    /// `reserve`, can wake together after a pause) defers the verdict.
    fn check_stall(&self) -> bool {
        let now = tokio::time::Instant::now();
        self.fence_an_old_tail(now);
        let over = |st: &State<D>| self.stall_at_locked(st).filter(|&at| at <= now);
        if over(&self.lock()).is_none() || !self.take_completions_caught() {
            return false;
        }
        let mut st = self.lock();
        let Some(at) = over(&st).filter(|_| st.ended.is_none()) else {
            return false;
        };
        // This look's time is after its drain: a pause before it does not
        // count toward the grace.
        let now = tokio::time::Instant::now();
        match st.stall_suspect {
            Some((suspect, first_look)) if suspect == at => {
                if now < first_look + STALL_GRACE {
                    return false;
                }
            }
            _ => {
                st.stall_suspect = Some((at, now));
                return false;
            }
        }
        drop(st);
        tracing::warn!(parent: &self.span, "a signaled SEND outlived the stall limit; ending the epoch");
        self.end(EpochEnd::Fault(LinkFault::SendsStalled));
        true
    }

    /// Posts an empty signaled SEND behind unsignaled WRs that no signaled
    /// one follows, once the oldest of them outlives [`stall_limit`]: a
    /// peer that completes our last signaled SEND and holds the tail behind
    /// it would otherwise keep the tail's pool chunks for the epoch's life
    /// (review 43d). The fence is timed as any signaled SEND. On an honest
    /// idle link it retires the completed tail, one credit-only message.
    fn fence_an_old_tail(&self, now: tokio::time::Instant) {
        let Some(limit) = stall_limit(&self.config) else {
            return;
        };
        let mut st = self.lock();
        let old = st.tail_since.is_some_and(|since| since + limit <= now);
        if !old || !st.signaled.is_empty() || st.ended.is_some() || st.sq_free == 0 {
            return;
        }
        let starved = st.reserve_waiters > 0;
        let Some(imm) = st.credit.try_tail_fence(starved) else {
            return;
        };
        st.sq_free -= 1;
        st.stats.tail_fences += 1;
        if let Err(reason) = self.post_send_locked(&mut st, None, imm, true) {
            drop(st);
            self.end(reason);
        }
    }

    /// When the oldest signaled SEND outlives [`stall_limit`], if one is
    /// posted.
    fn stall_at_locked(&self, st: &State<D>) -> Option<tokio::time::Instant> {
        let limit = stall_limit(&self.config)?;
        st.signaled.front().map(|&(_, posted)| posted + limit)
    }

    /// The peer sends nothing more on this QP: a graceful close stops
    /// waiting for it.
    fn set_peer_finished(&self) {
        self.peer_finished.store(true, Ordering::Release);
        self.wake_close.notify_one();
    }

    /// Waits until `done` holds or `deadline` passes, woken by `wake_close`.
    async fn wait_close(&self, deadline: tokio::time::Instant, done: impl Fn(&Self) -> bool) {
        loop {
            // Made before the check: a wake between the two is kept.
            let woken = self.wake_close.notified();
            if done(self) {
                return;
            }
            tokio::select! {
                () = woken => {}
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// Posts an empty signaled SEND behind an ended link's unsignaled tail,
    /// so its completion retires the tail (RC completes in order) and the
    /// close need not wait out its bound for SENDs nobody reports. Needs a
    /// credit and an SQ slot: a graceful end that finds none tries again as
    /// one comes back ([`Shared::maybe_credit_only`]); with none the bound
    /// is waited out.
    fn fence_locked(&self, st: &mut State<D>) {
        st.fence_owed = false;
        if st.unsignaled == 0 || st.torn_down {
            return;
        }
        let imm = match st.sq_free {
            0 => None,
            _ => st.credit.try_fence(),
        };
        let Some(imm) = imm else {
            st.fence_owed = true;
            return;
        };
        st.sq_free -= 1;
        st.stats.closing_fences += 1;
        if let Err(reason) = self.post_send_locked(st, None, imm, true) {
            let _in_link = self.span.enter();
            tracing::debug!(%reason, "the closing fence was not posted");
        }
    }

    /// Runs the last-sent hooks (once); true if there were any.
    fn run_last_sent(&self) -> bool {
        let hooks = {
            let mut hooks = self
                .on_last_sent
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.lock().last_sent = true;
            std::mem::take(&mut *hooks)
        };
        let any = !hooks.is_empty();
        for hook in hooks {
            if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(hook)) {
                tracing::error!(
                    panic = crate::unwind::panic_message(&*panic),
                    "a last-sent hook panicked"
                );
            }
        }
        any
    }

    /// The work of an end, outside the state lock: QP to ERR (flushing every
    /// WR), wake every waiter, tell the liveness hook.
    fn after_end(&self, reason: EpochEnd) {
        let _in_link = self.span.enter();
        tracing::debug!(%reason, "link end");
        let read_out = {
            let mut st = self.lock();
            st.tearing_down = true;
            st.read_out.take()
        };
        drop(read_out);
        if let Err(err) = self.qp.modify_to_error() {
            // No flush will come; do not let `recv` wait for one.
            tracing::debug!(%err, "moving the QP to ERR failed; the device is gone");
            self.mark_drained();
        }
        self.lock().torn_down = true;
        // A non-graceful end sends no last-sent word.
        drop(std::mem::take(
            &mut *self
                .on_last_sent
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        ));
        self.wake_send.notify_waiters();
        self.wake_recv.notify_waiters();
        self.wake_end.notify_waiters();
        self.wake_poller.notify_one();
        let hooks =
            std::mem::take(&mut *self.on_end.lock().unwrap_or_else(PoisonError::into_inner));
        // Every hook runs though one panics (each tells someone the epoch
        // ended); the first panic goes on once all have run.
        let mut first_panic = None;
        for hook in hooks {
            if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| hook(reason))) {
                tracing::error!(
                    panic = crate::unwind::panic_message(&*panic),
                    "a link end hook panicked"
                );
                first_panic.get_or_insert(panic);
            }
        }
        if let Some(panic) = first_panic {
            std::panic::resume_unwind(panic);
        }
    }

    /// A panic in this link's poller, completion handler or liveness task
    /// (a bug here), once its unwind is caught: the epoch ends as
    /// `Internal`. After a panic handling completions, their count is not
    /// to be trusted, so `recv` reports the end without waiting for the
    /// flushes (`completions_lost`).
    fn end_after_panic(&self, completions_lost: bool) {
        let _in_link = self.span.enter();
        tracing::error!("an rdma link task panicked; ending the epoch");
        let (first, cut) = {
            let mut st = self.lock();
            st.drained |= completions_lost;
            if completions_lost {
                st.delivery_cut.get_or_insert(EpochEnd::Internal);
            }
            let first = st.set_end(EpochEnd::Internal);
            (first, !first && st.note_cut(EpochEnd::Internal))
        };
        if first {
            self.after_end(EpochEnd::Internal);
        } else {
            if cut {
                self.cut_grace(EpochEnd::Internal);
            }
            self.wake_recv.notify_waiters();
        }
    }

    /// No more completions will be handled; `recv` may report the end.
    fn mark_drained(&self) {
        self.lock().drained = true;
        self.wake_recv.notify_waiters();
    }

    /// Posts one send WR (a batch in `buf`'s chunk, or credit-only) whose
    /// credit and SQ slot are already taken.
    fn post_send_locked(
        &self,
        st: &mut State<D>,
        buf: Option<(PoolChunk<D>, usize)>,
        imm: u32,
        last: bool,
    ) -> Result<(), EpochEnd> {
        let wr_id = st.next_wr;
        st.next_wr += 1;
        // A WR that takes the last credit is signaled too: an end that
        // comes next has no credit for a fence behind it.
        let link_wants = last
            || st.unsignaled + 1 >= self.config.signal_every
            || st.sq_free == 0
            || st.credit.held() == 0;
        let sge;
        let (sg_list, chunk): (&[Sge<'_, D::Mr>], _) = match buf {
            Some((mut chunk, len)) => {
                // The pool may need this completion even if the link does not.
                let signaled = self.lease.signal(&mut chunk, link_wants);
                sge = [Sge {
                    mr: self.lease.pool().mr(),
                    offset: chunk.offset(),
                    len,
                }];
                (&sge, Some((chunk, signaled)))
            }
            None => (&[], None),
        };
        let signaled = chunk.as_ref().map_or(link_wants, |&(_, signaled)| signaled);
        if signaled {
            st.unsignaled = 0;
            st.stats.signaled_sends += 1;
            st.signaled.push_back((wr_id, tokio::time::Instant::now()));
            st.tail_since = None;
        } else {
            st.unsignaled += 1;
            // Only a tail that holds pool chunks is fenced: a credit-only
            // message holds none, and fencing it would make each idle end
            // answer the other's fence for ever (review 43e).
            if chunk.is_some() {
                st.tail_since.get_or_insert_with(tokio::time::Instant::now);
            }
        }
        st.posted.push_back((wr_id, chunk.map(|(chunk, _)| chunk)));
        let wr = SendWr {
            wr_id,
            opcode: SendOpcode::SendWithImm(imm),
            sg_list,
            signaled,
            inline: false,
        };
        if let Err(err) = self.qp.post_send(&[wr]) {
            // The QP never took it: nothing will complete it, and a close
            // must not wait for it.
            st.posted.pop_back();
            if signaled {
                st.signaled.pop_back();
            }
            tracing::warn!(%err, qpn = self.address.qpn.value(), "post_send failed; ending the epoch");
            return Err(EpochEnd::Fault(LinkFault::PostFailed));
        }
        Ok(())
    }

    /// Sends a credit-only message if one is due and an SQ slot is free;
    /// after a graceful end, the closing fence if it is still owed.
    fn maybe_credit_only(&self, st: &mut State<D>) -> Result<(), EpochEnd> {
        if st.ended.is_some() {
            // A credit or SQ slot back while a graceful close waits for its
            // SENDs (a reserved buffer given back, a completion, the peer's
            // credit): the fence that found none may go now.
            if st.fence_owed && !st.tearing_down && !st.cut && !st.last_sent {
                self.fence_locked(st);
            }
            return Ok(());
        }
        if st.sq_free == 0 {
            return Ok(());
        }
        match st.credit.try_credit_only(st.reserve_waiters > 0) {
            Some(imm) => {
                st.sq_free -= 1;
                st.stats.credit_only_sent += 1;
                self.post_send_locked(st, None, imm, false)
            }
            None => Ok(()),
        }
    }

    /// Re-posts the receive buffers given back, `idx` and any the reader
    /// released, then wakes a `reserve` the freed credit lets through.
    fn repost_given_back(&self, idx: Option<usize>) {
        let mut st = self.lock();
        let mut released = std::mem::take(&mut st.released);
        if st.ended.is_some() {
            return;
        }
        let mut end = None;
        for idx in idx.into_iter().chain(released.drain(..)) {
            if let Err(reason) = self.repost_locked(&mut st, idx) {
                end = Some(reason);
                break;
            }
        }
        released.clear();
        st.released = released;
        debug_assert!(st.credit.invariant_holds());
        let ended_now = end.is_some_and(|reason| st.set_end(reason));
        // A re-post can free the last credit (it now has credit to carry):
        // a `reserve` short of credit looks again now, not at the peer's
        // next return.
        let freed = end.is_none() && st.reserve_waiters > 0 && st.credit.can_reserve();
        drop(st);
        if freed {
            self.wake_send.notify_waiters();
        }
        if let Some(reason) = end.filter(|_| ended_now) {
            self.after_end(reason);
        }
    }

    /// Re-posts receive buffer `idx` (the peer's credit back), then returns
    /// credit if enough is owed.
    fn repost_locked(&self, st: &mut State<D>, idx: usize) -> Result<(), EpochEnd> {
        let wr = RecvWr {
            wr_id: RECV_TAG | idx as u64,
            sg_list: &[Sge {
                mr: &self.recv_mrs[idx],
                offset: 0,
                len: self.config.max_batch,
            }],
        };
        if let Err(err) = self.qp.post_recv(&[wr]) {
            tracing::warn!(%err, qpn = self.address.qpn.value(), "post_recv failed; ending the epoch");
            return Err(EpochEnd::Fault(LinkFault::PostFailed));
        }
        st.recv_posted += 1;
        st.credit.on_reposted();
        self.maybe_credit_only(st)
    }

    /// The received batch in receive buffer `idx`, handed out; one `later`
    /// is re-posted after the tasks woken in the turn that drops it. `None`
    /// if the provider will not lend the buffer.
    fn batch_of(self: &Arc<Self>, idx: usize, len: usize, later: bool) -> Option<RdmaBatch<D>> {
        // Completed, not re-posted: the provider should be done with it. A
        // receive MR is one chunk.
        let guard = self.recv_mrs[idx].lock_chunk(0)?;
        Some(RdmaBatch {
            guard: Some(guard),
            idx,
            len,
            later,
            shared: self.clone(),
        })
    }

    /// Counts `n` received batches dropped unread, here and in the node's
    /// tally.
    fn count_dropped(&self, st: &mut State<D>, n: u64) {
        st.stats.receives_dropped += n;
        self.receives_dropped.fetch_add(n, Ordering::Relaxed);
    }

    /// A completed receive whose buffer the provider would not lend (the
    /// link's account of what it holds is wrong): that batch and every one
    /// queued or completing behind it are dropped unread, since the mux
    /// would take the next one's sequence number for a gap the peer made,
    /// and the epoch ends as a local fault.
    fn refuse_delivery(&self, mut st: MutexGuard<'_, State<D>>) {
        let dropped = st.ready.len() as u64 + 1;
        tracing::warn!(
            parent: &self.span,
            dropped,
            "the provider would not lend a received batch's buffer; ending the epoch"
        );
        let reason = EpochEnd::Fault(LinkFault::BufferNotLent { receive: true });
        st.delivery_cut.get_or_insert(reason);
        self.count_dropped(&mut st, dropped);
        st.ready.clear();
        drop(st);
        self.end(reason);
    }

    /// Tells the arrivals hook of received batches, then wakes `recv` only
    /// if the hook left one.
    fn batches_arrived(&self) {
        if let Some(arrivals) = self.arrivals.get().and_then(Weak::upgrade) {
            arrivals.arrived();
            if self.lock().ready.is_empty() {
                return;
            }
        }
        self.wake_recv.notify_waiters();
    }

    fn snapshot(&self) -> CreditSnapshot {
        let st = self.lock();
        CreditSnapshot {
            held: st.credit.held(),
            reserved: st.credit.reserved(),
            unreturned: st.credit.unreturned(),
            owed: st.credit.owed(),
            pending: st.credit.pending(),
        }
    }
}

/// A `reserve` perhaps counted in `reserve_waiters` (waiting for credit)
/// and perhaps in the pool's line; cancelling it uncounts it and leaves the
/// line.
struct Waiter<'a, D: Device + 'static> {
    shared: &'a Shared<D>,
    registered: bool,
    queued: bool,
}

impl<D: Device + 'static> Drop for Waiter<'_, D> {
    fn drop(&mut self) {
        if self.registered {
            self.shared.lock().reserve_waiters -= 1;
        }
        if self.queued {
            self.shared.lease.leave_queue();
        }
    }
}

/// The user handle: dropping the last one ends the epoch (`Closed`) and lets
/// the poller go.
struct Handle<D: Device + 'static> {
    shared: Arc<Shared<D>>,
}

impl<D: Device + 'static> Drop for Handle<D> {
    fn drop(&mut self) {
        self.shared.detached.store(true, Ordering::Release);
        self.shared.end(EpochEnd::Closed);
        self.shared.wake_poller.notify_one();
    }
}

/// One end of an RDMA link for one epoch. Cheap to clone; dropping every
/// clone ends the epoch with [`EpochEnd::Closed`].
pub struct RdmaLink<D: Device + 'static> {
    handle: Arc<Handle<D>>,
}

impl<D: Device + 'static> Clone for RdmaLink<D> {
    fn clone(&self) -> Self {
        RdmaLink {
            handle: self.handle.clone(),
        }
    }
}

impl<D: Device + 'static> std::fmt::Debug for RdmaLink<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaLink")
            .field("epoch", &self.shared().epoch)
            .field("qpn", &self.shared().address.qpn)
            .finish()
    }
}

impl<D: Device + 'static> RdmaLink<D> {
    /// Posts a reserved batch; `last` (the Goodbye) is signaled, so a
    /// graceful close learns when it landed.
    fn post_batch(&self, mut buf: RdmaSendBuf<D>, len: usize, last: bool) -> Result<(), LinkError> {
        let shared = buf.shared.clone();
        debug_assert!(
            Arc::ptr_eq(&shared, self.shared()),
            "a send buffer is posted on the link that reserved it"
        );
        let max = shared.config.max_batch;
        if len > max {
            return Err(LinkError::BatchTooLarge { len, max });
        }
        if len == 0 {
            return Ok(()); // dropping `buf` gives its credit back
        }
        let Some(mut chunk) = buf.chunk.take() else {
            return Ok(());
        };
        // Unlock the chunk before the WR names it (the provider gathers under that lock).
        chunk.unlock();
        let mut st = shared.lock();
        if let Some(reason) = st.ended {
            drop(chunk);
            st.sq_free += 1;
            st.credit.unreserve();
            shared.maybe_credit_only(&mut st).ok();
            return Err(shared.ended_error(reason));
        }
        let starved = st.reserve_waiters > 0;
        let imm = st.credit.on_post(starved);
        st.stats.batches_sent += 1;
        let result = shared.post_send_locked(&mut st, Some((chunk, len)), imm, last);
        debug_assert!(st.credit.invariant_holds());
        match result {
            Ok(()) => Ok(()),
            Err(reason) => {
                let ended_now = st.set_end(reason);
                let reason = st.ended.unwrap_or(reason);
                drop(st);
                if ended_now {
                    shared.after_end(reason);
                }
                Err(shared.ended_error(reason))
            }
        }
    }

    fn shared(&self) -> &Arc<Shared<D>> {
        &self.handle.shared
    }

    /// Traffic counters.
    pub fn stats(&self) -> LinkStats {
        self.shared().lock().stats
    }

    /// Where this end's credit stands.
    pub fn credit(&self) -> CreditSnapshot {
        self.shared().snapshot()
    }

    /// Why the epoch ended, once it has.
    pub fn end_reason(&self) -> Option<EpochEnd> {
        self.shared().lock().ended
    }

    /// The configuration this end runs with.
    pub fn config(&self) -> RdmaConfig {
        self.shared().config
    }

    /// This end's QP address (what its peer connected to).
    pub fn address(&self) -> QpAddress {
        self.shared().address
    }

    /// The link's tracing span, `rdma_link{epoch, qpn, peer_qpn}`: tasks
    /// serving this link run in it, so their events carry the QPNs.
    pub fn span(&self) -> &tracing::Span {
        &self.shared().span
    }

    /// Calls `hook` once with the reason when the epoch ends and its QP is
    /// torn down (at once if it already is; a graceful close keeps the QP
    /// up a while after the end), after any hooks added before it. The bootstrap
    /// connection uses it to close its liveness channel; the in-process
    /// [`pair`] uses it to end the other side.
    ///
    /// A hook may run inside whichever call ends the link (`fail`, a
    /// replacement), under that caller's locks: the connector's peer table,
    /// the mux's control lock. So it must not call into the connector or
    /// the mux; set a flag, notify, or end another link.
    pub fn on_end(&self, hook: impl FnOnce(EpochEnd) + Send + 'static) {
        let shared = self.shared();
        let mut hooks = shared.on_end.lock().unwrap_or_else(PoisonError::into_inner);
        // Read apart from the match: a hook run at once may use this link.
        // At once only after the teardown, which sets `torn_down` before it
        // takes the hooks: during a graceful close the QP is still up, and
        // the hooks wait for it like those added before.
        let ended = {
            let st = shared.lock();
            st.ended.filter(|_| st.torn_down)
        };
        match ended {
            Some(reason) => {
                drop(hooks);
                hook(reason);
            }
            None => hooks.push(Box::new(hook)),
        }
    }

    /// Takes the read-out of a graceful close the peer chooses or causes
    /// from `owner`'s share of the node's budget (unset: the budget's total
    /// alone bounds it).
    pub fn set_read_out_owner(&self, owner: ReadOutOwner) {
        self.shared().lock().read_out_owner = Some(owner);
    }

    /// Whose share of the node's read-outs this link's close would take.
    pub fn read_out_owner(&self) -> Option<ReadOutOwner> {
        self.shared().lock().read_out_owner
    }

    /// Calls `hook` once when a graceful end (ours or the peer's) has seen
    /// its posted SENDs complete, or given up on them: nothing more will be
    /// sent on this QP, and the peer may be told so (at once if that point
    /// has passed). A non-graceful end never calls it. A link with such a
    /// hook keeps its QP up after that point until [`RdmaLink::peer_finished`]
    /// (bounded), so the peer's last SENDs land. The bootstrap connection
    /// half-closes its liveness channel; the in-process [`pair`] tells the
    /// other side.
    pub fn on_last_sent(&self, hook: impl FnOnce() + Send + 'static) {
        let shared = self.shared();
        let mut hooks = shared
            .on_last_sent
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (passed, torn_down) = {
            let st = shared.lock();
            (st.last_sent, st.torn_down)
        };
        if passed {
            drop(hooks);
            if !torn_down {
                hook();
            }
        } else {
            hooks.push(Box::new(hook));
        }
    }

    /// One look for stalled sends: true if it ended the epoch as
    /// [`LinkFault::SendsStalled`] (the oldest signaled SEND was past the
    /// stall limit at this look and at one at least 50 ms before, its
    /// completions taken). A look also fences an unsignaled tail past the
    /// limit that no signaled SEND follows, so it can be timed. A waiting
    /// `reserve` looks (only at signaled SENDs past the limit), and a
    /// node's links get a look every second; a link made without a node
    /// is looked at by its own `reserve` only, unless its owner calls this.
    pub fn check_stall(&self) -> bool {
        self.shared().check_stall()
    }

    /// Whether a graceful close was cut short by an abrupt end: the peer is
    /// then told with a reset, whatever was said before.
    pub fn close_was_cut(&self) -> bool {
        self.shared().lock().close_cut()
    }

    /// The peer will send nothing more on this QP (it said so after its own
    /// posted SENDs completed): a graceful close stops waiting for its last
    /// SENDs and tears the QP down.
    pub fn peer_finished(&self) {
        self.shared().set_peer_finished();
    }

    /// The send pool this end takes its buffers from (the node's, or the
    /// private one of [`PreparedEnd::new`]).
    pub fn send_pool(&self) -> &SendPool<D> {
        self.shared().lease.pool()
    }

    /// Fault hook for tests: moves the QP to ERR behind the link's back, as a
    /// fatal device error would. The link learns it from the flushed
    /// completions.
    pub fn inject_qp_error(&self) -> Result<(), VerbsError> {
        self.shared().qp.modify_to_error()
    }
}

/// A send buffer: one pool chunk held exclusively, one link credit and one
/// SQ slot. Dropping it unposted gives all three back.
pub struct RdmaSendBuf<D: Device + 'static> {
    chunk: Option<PoolChunk<D>>,
    shared: Arc<Shared<D>>,
}

impl<D: Device + 'static> Deref for RdmaSendBuf<D> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.chunk.as_deref().unwrap_or(&[])
    }
}

impl<D: Device + 'static> DerefMut for RdmaSendBuf<D> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.chunk.as_deref_mut().unwrap_or(&mut [])
    }
}

impl<D: Device + 'static> Drop for RdmaSendBuf<D> {
    fn drop(&mut self) {
        let Some(chunk) = self.chunk.take() else {
            return; // posted
        };
        drop(chunk); // back to the pool
        let shared = &self.shared;
        let mut st = shared.lock();
        st.sq_free += 1;
        st.credit.unreserve();
        let end = shared.maybe_credit_only(&mut st).err();
        debug_assert!(st.credit.invariant_holds());
        let ended_now = end.is_some_and(|reason| st.set_end(reason));
        drop(st);
        shared.wake_send.notify_waiters();
        if let Some(reason) = end.filter(|_| ended_now) {
            shared.after_end(reason);
        }
    }
}

/// A received batch: a registered receive MR held exclusively. Dropping it
/// re-posts the receive, which is the credit the peer gets back; one the
/// reader took ([`Link::try_recv`]) is re-posted after the first consumer
/// its turn woke has run.
pub struct RdmaBatch<D: Device + 'static> {
    guard: Option<<D::Mr as MemoryRegion>::Guard>,
    idx: usize,
    len: usize,
    /// Taken by the reader: the re-post waits for [`RepostLater`].
    later: bool,
    shared: Arc<Shared<D>>,
}

/// Re-posts the receive buffers the reader released once the worker has
/// run the tasks the reader's turn woke (its deferred list,
/// [`crate::later`]): the first consumer a batch woke runs before the
/// provider call (docs/design.md § "A batch is decoded by its reader").
/// Runs when dropped: the runtime holds the only clone and drops it as it
/// wakes it, or as it shuts down; outside a worker, at once. An ordinary
/// batch's drop re-posts the released ones too.
struct RepostLater<D: Device + 'static>(Arc<Shared<D>>);

impl<D: Device + 'static> std::task::Wake for RepostLater<D> {
    fn wake(self: Arc<Self>) {}
}

impl<D: Device + 'static> Drop for RepostLater<D> {
    fn drop(&mut self) {
        // This runs inside the runtime's park: no panic may unwind there,
        // not even one from an end hook the epoch's end runs.
        let shared = &self.0;
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
            if std::panic::catch_unwind(AssertUnwindSafe(|| shared.repost_given_back(None)))
                .is_err()
            {
                shared.end_after_panic(false);
            }
        }));
    }
}

impl<D: Device + 'static> Deref for RdmaBatch<D> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.guard.as_deref().map_or(&[], |b| &b[..self.len])
    }
}

impl<D: Device + 'static> Drop for RdmaBatch<D> {
    fn drop(&mut self) {
        // The guard must go before the receive is posted: the provider
        // scatters into the region under the same lock.
        drop(self.guard.take());
        if !self.later {
            self.shared.repost_given_back(Some(self.idx));
            return;
        }
        let mut st = self.shared.lock();
        if st.ended.is_some() {
            return;
        }
        st.released.push(self.idx);
        let first = st.released.len() == 1;
        drop(st);
        if first {
            let later = Arc::new(RepostLater(self.shared.clone()));
            crate::later::after_woken_tasks(&std::task::Waker::from(later));
        }
    }
}

impl<D: Device + 'static> Link for RdmaLink<D> {
    type SendBuf = RdmaSendBuf<D>;
    type Batch = RdmaBatch<D>;
    const RELEASE_POSTS: bool = true;
    const TRY_RESERVE: bool = true;
    const TRY_RECV: bool = true;

    fn epoch(&self) -> Epoch {
        self.shared().epoch
    }

    fn max_batch(&self) -> usize {
        self.shared().config.max_batch
    }

    async fn reserve(&self) -> Result<RdmaSendBuf<D>, LinkError> {
        let shared = self.shared();
        let mut waiter = Waiter {
            shared,
            registered: false,
            queued: false,
        };
        // The first look registers no waiter (a buffer is usually free);
        // a miss registers both and looks again before waiting.
        let mut armed = false;
        let mut stall_at;
        loop {
            let notified = shared.wake_send.notified();
            tokio::pin!(notified);
            let freed = shared.lease.notified();
            tokio::pin!(freed);
            if armed {
                notified.as_mut().enable();
                freed.as_mut().enable();
            }
            {
                let mut st = shared.lock();
                if let Some(reason) = st.ended {
                    return Err(shared.ended_error(reason));
                }
                let mut blocked = None;
                let mut credit_short = false;
                if st.sq_free == 0 {
                    // An SQ slot comes back with a completion.
                } else if !st.credit.try_reserve() {
                    credit_short = true;
                } else {
                    match shared.lease.try_take() {
                        Ok(chunk) => {
                            st.sq_free -= 1;
                            if std::mem::take(&mut waiter.registered) {
                                st.reserve_waiters -= 1;
                            }
                            waiter.queued = false; // taking left the line
                            debug_assert!(st.credit.invariant_holds());
                            return Ok(RdmaSendBuf {
                                chunk: Some(chunk),
                                shared: shared.clone(),
                            });
                        }
                        Err(Blocked::NotLent) => {
                            st.credit.unreserve();
                            drop(st);
                            tracing::warn!(
                                parent: &shared.span,
                                "the provider would lend no free send buffer; ending the epoch"
                            );
                            let reason =
                                EpochEnd::Fault(LinkFault::BufferNotLent { receive: false });
                            shared.end(reason);
                            let reason = shared.lock().ended.unwrap_or(reason);
                            return Err(shared.ended_error(reason));
                        }
                        Err(why) => {
                            st.credit.unreserve();
                            blocked = Some(why);
                        }
                    }
                }
                if blocked == Some(Blocked::Empty) {
                    waiter.queued = true;
                } else if std::mem::take(&mut waiter.queued) {
                    // Not waiting for the pool now: do not hold up the line.
                    shared.lease.leave_queue();
                }
                // The starved bit asks the peer for credit: counted only
                // while credit is what this `reserve` waits for, not a
                // chunk or an SQ slot (both ends short of chunks would
                // otherwise answer each other's credit-only messages).
                if credit_short != waiter.registered {
                    waiter.registered = credit_short;
                    if credit_short {
                        st.reserve_waiters += 1;
                    } else {
                        st.reserve_waiters -= 1;
                    }
                }
                stall_at = shared.stall_at_locked(&st);
            }
            if !std::mem::replace(&mut armed, true) {
                continue;
            }
            if stall_at.is_some_and(|at| at <= tokio::time::Instant::now()) {
                // Completions not yet handed over are no stall: the first
                // look takes them, and the provider gets a grace to read
                // what a pause left in its sockets before the second.
                if !shared.check_stall() {
                    tokio::time::sleep(STALL_GRACE).await;
                }
                continue;
            }
            let stalled = async {
                match stall_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = &mut notified => {}
                () = &mut freed => {}
                () = stalled => {}
            }
        }
    }

    fn try_reserve(&self) -> Option<Result<RdmaSendBuf<D>, LinkError>> {
        let shared = self.shared();
        let mut st = shared.lock();
        if let Some(reason) = st.ended {
            return Some(Err(shared.ended_error(reason)));
        }
        // A look only: no starved bit (that asks the peer for credit), and
        // no place in the pool's line.
        if st.sq_free == 0 || !st.credit.try_reserve() {
            return None;
        }
        match shared.lease.try_take_unqueued() {
            Some(chunk) => {
                st.sq_free -= 1;
                debug_assert!(st.credit.invariant_holds());
                Some(Ok(RdmaSendBuf {
                    chunk: Some(chunk),
                    shared: shared.clone(),
                }))
            }
            None => {
                st.credit.unreserve();
                None
            }
        }
    }

    fn post(&self, buf: RdmaSendBuf<D>, len: usize) -> Result<(), LinkError> {
        self.post_batch(buf, len, false)
    }

    fn post_last(&self, buf: RdmaSendBuf<D>, len: usize) -> Result<(), LinkError> {
        self.post_batch(buf, len, true)
    }

    async fn recv(&self) -> Result<RdmaBatch<D>, LinkError> {
        let shared = self.shared();
        let mut armed = false;
        loop {
            let notified = shared.wake_recv.notified();
            tokio::pin!(notified);
            if armed {
                notified.as_mut().enable();
            }
            {
                let mut st = shared.lock();
                if let Some((idx, len)) = st.ready.pop_front() {
                    let Some(batch) = shared.batch_of(idx, len, false) else {
                        shared.refuse_delivery(st);
                        continue;
                    };
                    st.handed_out += 1;
                    return Ok(batch);
                }
                // Completions still in the CQ come before the end.
                if let Some(reason) = st.ended.filter(|_| st.drained) {
                    st.end_reported = true;
                    // A cut in place of a close only: a violation or fault
                    // decided first stays the verdict.
                    let reason = match st.delivery_cut {
                        Some(cut) if reason.is_close() => cut,
                        _ => reason,
                    };
                    return Err(shared.ended_error(reason));
                }
            }
            if std::mem::replace(&mut armed, true) {
                notified.await;
            }
        }
    }

    fn try_recv(&self, handled: u64) -> Option<RdmaBatch<D>> {
        let shared = self.shared();
        let mut st = shared.lock();
        if st.ended.is_some() || st.handed_out != handled {
            return None;
        }
        let (idx, len) = st.ready.pop_front()?;
        let Some(batch) = shared.batch_of(idx, len, true) else {
            // `recv` reports the end once the flushes are in.
            shared.refuse_delivery(st);
            return None;
        };
        st.handed_out += 1;
        Some(batch)
    }

    fn set_arrivals(&self, arrivals: Weak<dyn Arrivals>) {
        let _ = self.shared().arrivals.set(arrivals);
    }

    fn fail(&self, reason: EpochEnd) {
        self.shared().fail(reason);
    }

    async fn ended(&self) -> EpochEnd {
        let shared = self.shared();
        loop {
            let notified = shared.wake_end.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = shared.lock().ended {
                return reason;
            }
            notified.await;
        }
    }
}
