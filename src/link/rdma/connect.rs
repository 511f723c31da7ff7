//! Bringing a link end up: resources, INIT, receives, then RTR and RTS.
//!
//! ```text
//!  PreparedEnd::on_pool   CQ, QP (RESET→INIT) on the send pool's PD, receive MRs
//!                         (local write), R receives posted, a lease on the pool
//!  PreparedEnd::new(dev)  the same on a private pool of send_buffers chunks
//!  .address()             QpAddress to publish (the QP part of the hello)
//!  .connect(peer, epoch)  RTR (receives already posted) → RTS → poller spawned
//!  pair(a, b, epoch)      both ends in process, addresses exchanged directly
//! ```
//!
//! Owner: the caller until `connect`, then the link. The TCP bootstrap
//! (another module) does what `pair` does across hosts and owns liveness.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tokio::sync::Notify;
use tracing::Instrument;

use super::credit::Credit;
use super::pool::SendPool;
use super::registered::{RegisteredBudget, Registration};
use super::{Handle, LinkStats, RECV_TAG, RdmaConfig, RdmaError, RdmaLink, Shared, State, poller};
use crate::link::{EpochEnd, Link, ReadOutBudget};
use crate::mux::protocol::Epoch;
use crate::unwind::spawn_catching;
use crate::verbs::{
    AccessFlags, CompletionHandler, CompletionQueue, Device, InitAttr, Mtu, QpAddress, QpCaps,
    QueuePair, RecvWr, RtrAttr, RtsAttr, Sge,
};

/// One link end with its resources created and receives posted, waiting for
/// the peer's address.
pub struct PreparedEnd<D: Device + 'static> {
    config: RdmaConfig,
    address: QpAddress,
    local_mtu: Mtu,
    qp: D::Qp,
    cq: D::Cq,
    recv_mrs: Vec<D::Mr>,
    pool: SendPool<D>,
    registration: Registration,
    read_outs: ReadOutBudget,
    receives_dropped: Arc<AtomicU64>,
}

impl<D: Device + 'static> PreparedEnd<D> {
    /// A stand-alone end (tests, benches, `pair`): a private send pool of
    /// `send_buffers` chunks in one MR, then as [`PreparedEnd::on_pool`].
    /// Not counted against any bound; a node uses [`PreparedEnd::on_pool`].
    pub fn new(dev: &D, config: RdmaConfig) -> Result<PreparedEnd<D>, RdmaError> {
        PreparedEnd::within(dev, config, &RegisteredBudget::unbounded())
    }

    /// As [`PreparedEnd::new`], first taking the private pool's and the
    /// receive ring's bytes ([`RdmaConfig::registered_bytes`]) from `budget`
    /// ([`RdmaError::RegisteredLimit`] before anything is created if they do
    /// not fit). The bytes go back when the link's resources are destroyed.
    pub fn within(
        dev: &D,
        config: RdmaConfig,
        budget: &RegisteredBudget,
    ) -> Result<PreparedEnd<D>, RdmaError> {
        config.validate()?;
        let registration = budget.reserve(config.registered_bytes())?;
        // Its bytes are in `registration`.
        let pool = SendPool::new(
            dev,
            config.max_batch,
            config.send_buffers,
            &RegisteredBudget::unbounded(),
        )?;
        PreparedEnd::build(dev, pool, config, registration)
    }

    /// Creates one CQ for both queues and the QP (to INIT) on `pool`'s PD,
    /// one MR per receive buffer (local write, no remote access), and posts
    /// every receive; sends take chunks of `pool` (at most `send_buffers` at
    /// once). The receive ring's bytes ([`RdmaConfig::ring_bytes`]) come
    /// from `budget` first. `pool` must be on `dev`, with chunks of
    /// `max_batch` bytes.
    pub fn on_pool(
        dev: &D,
        pool: &SendPool<D>,
        config: RdmaConfig,
        budget: &RegisteredBudget,
    ) -> Result<PreparedEnd<D>, RdmaError> {
        config.validate()?;
        if pool.chunk_len() != config.max_batch {
            return Err(RdmaError::InvalidConfig {
                field: "max_batch (differs from the send pool's chunk)",
                value: config.max_batch,
            });
        }
        let registration = budget.reserve(config.ring_bytes())?;
        PreparedEnd::build(dev, pool.clone(), config, registration)
    }

    fn build(
        dev: &D,
        pool: SendPool<D>,
        config: RdmaConfig,
        registration: Registration,
    ) -> Result<PreparedEnd<D>, RdmaError> {
        let port = dev.query_port();
        let pd = pool.pd();
        let cq = dev.create_cq(config.cq_depth())?;
        let caps = QpCaps {
            max_send_wr: config.sq_depth(),
            max_recv_wr: config.recv_depth,
            max_sge: 1,
            max_inline_data: 0,
        };
        let qp = dev.create_qp(pd, &cq, &cq, caps)?;
        let recv_mrs = (0..config.recv_depth)
            .map(|_| dev.reg_mr(pd, config.max_batch, AccessFlags::LOCAL_WRITE))
            .collect::<Result<Vec<_>, _>>()?;
        qp.modify_to_init(InitAttr {
            access: AccessFlags::LOCAL_READ,
        })?;
        let sges: Vec<_> = recv_mrs
            .iter()
            .map(|mr| {
                [Sge {
                    mr,
                    offset: 0,
                    len: config.max_batch,
                }]
            })
            .collect();
        let wrs: Vec<_> = sges
            .iter()
            .enumerate()
            .map(|(idx, sg_list)| RecvWr {
                wr_id: RECV_TAG | idx as u64,
                sg_list,
            })
            .collect();
        qp.post_recv(&wrs)?;
        let address = QpAddress::of(dev, &qp);
        Ok(PreparedEnd {
            config,
            address,
            local_mtu: port.active_mtu,
            qp,
            cq,
            recv_mrs,
            pool,
            registration,
            read_outs: ReadOutBudget::new(usize::MAX),
            receives_dropped: Arc::default(),
        })
    }

    /// Takes the graceful closes of this end's replacement and of the
    /// peer's close from `budget`, shared by a node's ends; past it a
    /// replaced end is torn down at once, and the peer's close is short
    /// (or, past the short ones too, torn down at once). A stand-alone
    /// end's budget is unbounded.
    pub fn with_read_outs(mut self, budget: ReadOutBudget) -> PreparedEnd<D> {
        self.read_outs = budget;
        self
    }

    /// Adds the received batches this end drops unread
    /// ([`LinkStats::receives_dropped`]) to `tally` as well, one shared by
    /// a node's ends, so its count outlives the link.
    pub fn with_drop_tally(mut self, tally: Arc<AtomicU64>) -> PreparedEnd<D> {
        self.receives_dropped = tally;
        self
    }

    /// What the peer needs to reach this QP.
    pub fn address(&self) -> QpAddress {
        self.address
    }

    /// Moves the QP to RTR toward `peer`, then RTS, and starts the poller.
    /// Nothing is sent until the mux posts.
    ///
    /// # Panics
    /// Outside a tokio runtime (the poller is spawned on the current one).
    pub fn connect(self, peer: &QpAddress, epoch: Epoch) -> Result<RdmaLink<D>, RdmaError> {
        let config = self.config;
        self.qp.modify_to_rtr(RtrAttr::for_peer(
            peer,
            self.local_mtu,
            config.min_rnr_timer,
        ))?;
        self.qp.modify_to_rts(RtsAttr {
            sq_psn: self.qp.initial_psn(),
            timeout: config.timeout,
            retry_cnt: config.retry_cnt,
            rnr_retry: config.rnr_retry,
        })?;
        let depth = u32::try_from(config.recv_depth).map_err(|_| RdmaError::InvalidConfig {
            field: "recv_depth",
            value: config.recv_depth,
        })?;
        let state = State {
            credit: Credit::new(depth),
            sq_free: config.sq_depth(),
            posted: VecDeque::new(),
            signaled: VecDeque::new(),
            tail_since: None,
            next_wr: 0,
            unsignaled: 0,
            ready: VecDeque::new(),
            handed_out: 0,
            released: Vec::with_capacity(config.recv_depth),
            recv_posted: config.recv_depth,
            reserve_waiters: 0,
            ended: None,
            last_sent: false,
            fence_owed: false,
            torn_down: false,
            violated: false,
            cut: false,
            read_out: None,
            read_out_owner: None,
            tearing_down: false,
            drained: false,
            end_reported: false,
            delivery_cut: None,
            stall_suspect: None,
            stats: LinkStats::default(),
        };
        let shared = Arc::new(Shared {
            qp: self.qp,
            cq: self.cq,
            recv_mrs: self.recv_mrs,
            state: Mutex::new(state),
            lease: self.pool.lease(config.send_buffers),
            _registration: self.registration,
            read_outs: self.read_outs,
            receives_dropped: self.receives_dropped,
            address: self.address,
            epoch,
            config,
            wake_send: Notify::new(),
            wake_recv: Notify::new(),
            wake_end: Notify::new(),
            wake_close: Notify::new(),
            wake_poller: Notify::new(),
            polling: poller::PollBuf::new(),
            poll_wanted: AtomicBool::new(false),
            detached: AtomicBool::new(false),
            on_end: Mutex::new(Vec::new()),
            on_last_sent: Mutex::new(Vec::new()),
            peer_finished: AtomicBool::new(false),
            arrivals: OnceLock::new(),
            span: tracing::debug_span!(
                "rdma_link",
                %epoch,
                qpn = self.address.qpn.value(),
                peer_qpn = peer.qpn.value()
            ),
            #[cfg(test)]
            panic_on_completion: AtomicBool::new(false),
        });
        // The soft provider hands completions to the link in its driver's
        // turn; libibverbs declines, and the poller alone takes them.
        let handler: Weak<dyn CompletionHandler> = Arc::downgrade(&shared) as _;
        shared.cq.set_handler(handler);
        let ended = shared.clone();
        spawn_catching(
            poller::run(shared.clone()).instrument(shared.span.clone()),
            move || {
                ended.end_after_panic(true);
                // The poller would have done it on its way out.
                ended.release_posted();
            },
        );
        Ok(RdmaLink {
            handle: Arc::new(Handle { shared }),
        })
    }
}

/// Both ends of a link in one process (one device twice is fine: two QPs),
/// addresses exchanged directly. Each end's end is told to the other as
/// [`EpochEnd::PeerClosed`], standing in for the bootstrap TCP connection's
/// close: a graceful end's last-sent point as the peer's graceful end and
/// [`RdmaLink::peer_finished`] (the half-close), its teardown as an end now.
///
/// # Panics
/// Outside a tokio runtime, as [`PreparedEnd::connect`].
pub fn pair<D: Device + 'static>(
    a: &D,
    b: &D,
    epoch: Epoch,
    config: RdmaConfig,
) -> Result<(RdmaLink<D>, RdmaLink<D>), RdmaError> {
    let end_a = PreparedEnd::new(a, config)?;
    let end_b = PreparedEnd::new(b, config)?;
    let (addr_a, addr_b) = (end_a.address(), end_b.address());
    let link_a = end_a.connect(&addr_b, epoch)?;
    let link_b = end_b.connect(&addr_a, epoch)?;
    for (me, peer) in [(&link_a, &link_b), (&link_b, &link_a)] {
        let (told, teller) = (Arc::downgrade(peer.shared()), Arc::downgrade(me.shared()));
        me.on_last_sent(move || match told.upgrade() {
            Some(peer) => {
                peer.set_peer_finished();
                peer.fail(EpochEnd::PeerClosed);
            }
            // Nobody is left to send to us.
            None => {
                if let Some(me) = teller.upgrade() {
                    me.set_peer_finished();
                }
            }
        });
        let peer = Arc::downgrade(peer.shared());
        me.on_end(move |_| {
            if let Some(peer) = peer.upgrade() {
                peer.end(EpochEnd::PeerClosed);
            }
        });
    }
    debug_assert_eq!(link_a.epoch(), link_b.epoch());
    Ok((link_a, link_b))
}
