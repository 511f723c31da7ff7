//! [`RdmaTransport`]: the mux on RDMA links, each epoch bootstrapped over TCP
//! by the shared [`Connector`].
//!
//! ```text
//!  dialer:   connect TCP ─ PreparedEnd::on_pool (QP INIT, receives posted) ─ hello(QPN, PSN, ...)
//!            ◄─ listener hello ─ Established ─ connect: RTR/RTS ─ ready ─► mux.attach
//!  listener: challenge ─ dialer hello authenticated + decide ─ PreparedEnd::on_pool ─ RTR/RTS
//!            ─ hello ─► ◄─ ready ─ Established ─► mux.attach
//!  liveness: the bootstrap TCP connection stays open (keepalive, TCP_USER_TIMEOUT):
//!            EOF ─► peer_finished, fail(PeerClosed); error ─► fail(PeerLost);
//!            graceful end's last SEND done ─► shutdown(Write); teardown ─► close
//!            (reset, if no half-close came first)
//! ```
//!
//! Owner: [`RdmaEpochs`] makes each epoch's link and spawns one liveness
//! task per link, which holds the TCP connection until the epoch ends. It
//! also owns the device's send pool (one PD, one MR), made with the first
//! link; a link owns its QP, CQ and receive MRs and destroys them in verbs
//! order. Design and
//! rulings: docs/rdma-link.md § "The RDMA node".

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tracing::Instrument;

use super::pool::{DEFAULT_POOL_BUFFERS, PoolStats, SendPool};
use super::registered::{MemlockLimit, RegisteredBudget};
use super::{PreparedEnd, RdmaConfig, RdmaError, RdmaLink, Shared};
use crate::link::bootstrap::{BootstrapError, ClusterKey, Endpoint, EndpointKind, RdmaEndpoint};
use crate::link::tcp::{
    ConnectError, Connector, ConnectorConfig, DialFailure, EpochMaker, TcpLinkConfig, configure,
};
use crate::link::{EpochEnd, Link, Node, ReadOutBudget, ReadOutOwner, ReadOutTier, RegisterError};
use crate::mux::engine::ProtocolError;
use crate::mux::protocol::Epoch;
use crate::mux::{Mux, MuxConfig, PeerId};
use crate::unwind::spawn_catching;
use crate::verbs::{Device, Gid, Mtu, Psn, QpAddress, Qpn};

/// Configuration of an [`RdmaTransport`]. Defaults are documented per field.
#[derive(Clone, Debug)]
pub struct RdmaNodeConfig {
    /// Node id, cluster key, handshake timeout, dial backoff
    /// (defaults of [`ConnectorConfig::new`]).
    pub connector: ConnectorConfig,
    /// Where the bootstrap listener binds. Default 127.0.0.1:0.
    pub bind: SocketAddr,
    /// Shape and RC attributes of every link. Default [`RdmaConfig::default`].
    pub rdma: RdmaConfig,
    /// Keepalive and `TCP_USER_TIMEOUT` of the liveness connection (only
    /// those two fields are used). Default as [`TcpLinkConfig::default`]: 1 s, 5 s.
    pub liveness: TcpLinkConfig,
    /// The mux. Default [`MuxConfig::default`].
    pub mux: MuxConfig,
    /// Bytes of registered memory the node may hold at once: the send pool
    /// ([`RdmaNodeConfig::pool_bytes`]) plus each link end's receive ring
    /// ([`RdmaConfig::ring_bytes`]); a link past it is refused with
    /// [`RdmaError::RegisteredLimit`]. The links of peers the node did not
    /// register hold at most half of what the pool leaves
    /// ([`RdmaError::StrangersRegisteredLimit`]). Default 1 GiB.
    pub max_registered: usize,
    /// Send buffers of `rdma.max_batch` bytes in the device's send pool,
    /// one MR shared by every link; each link holds at most
    /// `rdma.send_buffers` of them, and at most half the pool (rounded up),
    /// at once. At least 1. Default 64 ([`DEFAULT_POOL_BUFFERS`]).
    pub pool_buffers: usize,
    /// Links closing gracefully at once for their peer's sake (its close,
    /// or its newer link replacing them), each keeping its QP and receive
    /// ring up for the peer's last SENDs, shared by owner; past its share
    /// a replaced link is torn down at once and the peer's close is short,
    /// on one of four times as many short read-outs. Default 16.
    pub read_outs: ReadOutBudget,
}

/// Default of [`RdmaNodeConfig::max_registered`].
pub const DEFAULT_MAX_REGISTERED: usize = 1 << 30;

impl RdmaNodeConfig {
    /// Defaults for node `id`, without a cluster key.
    pub fn new(id: PeerId) -> RdmaNodeConfig {
        RdmaNodeConfig {
            connector: ConnectorConfig::new(id),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            rdma: RdmaConfig::default(),
            liveness: TcpLinkConfig::default(),
            mux: MuxConfig::default(),
            max_registered: DEFAULT_MAX_REGISTERED,
            pool_buffers: DEFAULT_POOL_BUFFERS,
            read_outs: ReadOutBudget::default(),
        }
    }

    /// Bytes of the send pool: `pool_buffers × rdma.max_batch` (saturating).
    pub fn pool_bytes(&self) -> usize {
        self.pool_buffers.saturating_mul(self.rdma.max_batch)
    }

    /// What the node checks before it starts: the link config is in range
    /// (what its hello announces must pass the peer's check), `pool_buffers` is at least 1,
    /// the pool and one link's receive ring fit under `max_registered`, and
    /// `RLIMIT_MEMLOCK` (read from /proc/self/limits; skipped where
    /// unreadable) admits `max_registered` bytes. Providers that pin memory
    /// (ibverbs) fail registration past that limit; the soft provider does
    /// not pin, so [`RdmaTransport::start`] only warns.
    pub fn preflight(&self) -> Result<(), RdmaError> {
        self.rdma.validate()?;
        if self.pool_buffers == 0 {
            return Err(RdmaError::InvalidConfig {
                field: "pool_buffers",
                value: 0,
            });
        }
        let first = self.pool_bytes().saturating_add(self.rdma.ring_bytes());
        if first > self.max_registered {
            return Err(RdmaError::RegisteredLimit {
                needed: first,
                in_use: 0,
                max: self.max_registered,
            });
        }
        self.memlock_preflight(MemlockLimit::current())
    }

    /// The memlock half of [`RdmaNodeConfig::preflight`] against `limit`.
    pub fn memlock_preflight(&self, limit: Option<MemlockLimit>) -> Result<(), RdmaError> {
        limit.map_or(Ok(()), |limit| limit.check(self.max_registered))
    }

    /// Sets the cluster key (`None` if shorter than [`ClusterKey::MIN_LEN`]).
    pub fn with_key(mut self, key: Option<ClusterKey>) -> RdmaNodeConfig {
        self.connector.key = key;
        self
    }
}

/// One liveness task's controls: the link's graceful end has sent its last,
/// the link was torn down, or a test severs it.
#[derive(Default)]
struct Liveness {
    wake: Notify,
    last_sent: AtomicBool,
    torn_down: AtomicBool,
    sever: AtomicBool,
}

/// The RDMA transport's epochs: a [`PreparedEnd`] per handshake, connected
/// once the peer's endpoint is known; the bootstrap connection becomes the
/// link's liveness channel.
pub struct RdmaEpochs<D: Device + 'static> {
    device: D,
    config: RdmaConfig,
    liveness: TcpLinkConfig,
    /// Liveness controls by local QPN, while the link lives.
    live: Arc<Mutex<HashMap<u32, Arc<Liveness>>>>,
    registered: RegisteredBudget,
    read_outs: ReadOutBudget,
    /// Received batches the links made here dropped unread, all of them.
    receives_dropped: Arc<AtomicU64>,
    /// Every link made here, for the stall sweep (dead ones pruned by it).
    swept: Arc<Mutex<Vec<Weak<Shared<D>>>>>,
    /// The stall sweep's task is running (started by the first link).
    sweeping: AtomicBool,
    /// The stall sweep's task, ended with the epochs: left to its next
    /// tick, it outlived the node by up to a [`STALL_SWEEP`].
    sweep_task: Mutex<Option<tokio::task::AbortHandle>>,
    pool_buffers: usize,
    /// The device's send pool, made with the first link end (or by `pool`).
    pool: Mutex<Option<SendPool<D>>>,
    /// Why the last link end could not be made (the handshake reports only
    /// `Resources`).
    last_error: Mutex<Option<RdmaError>>,
}

impl<D: Device + 'static> Drop for RdmaEpochs<D> {
    fn drop(&mut self) {
        let task = self
            .sweep_task
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(task) = task.take() {
            task.abort();
        }
    }
}

impl<D: Device + 'static> RdmaEpochs<D> {
    /// Epochs on `device`, every link shaped by `config`.
    pub fn new(device: D, config: RdmaConfig, liveness: TcpLinkConfig) -> RdmaEpochs<D> {
        RdmaEpochs {
            device,
            config,
            liveness,
            live: Arc::new(Mutex::new(HashMap::new())),
            registered: RegisteredBudget::unbounded(),
            read_outs: ReadOutBudget::default(),
            receives_dropped: Arc::default(),
            swept: Arc::default(),
            sweeping: AtomicBool::new(false),
            sweep_task: Mutex::new(None),
            pool_buffers: DEFAULT_POOL_BUFFERS,
            pool: Mutex::new(None),
            last_error: Mutex::new(None),
        }
    }

    /// Sets the send pool's size in chunks of `max_batch` (before the
    /// first link end is made).
    pub fn with_pool_buffers(mut self, chunks: usize) -> RdmaEpochs<D> {
        self.pool_buffers = chunks;
        self
    }

    /// The device's send pool, made (and its bytes taken from the budget)
    /// on the first call.
    pub fn pool(&self) -> Result<SendPool<D>, RdmaError> {
        let mut slot = self.pool.lock().expect("pool slot poisoned");
        if let Some(pool) = slot.as_ref() {
            return Ok(pool.clone());
        }
        let pool = SendPool::shared(
            &self.device,
            self.config.max_batch,
            self.pool_buffers,
            &self.registered,
        )?;
        // The pool is the node's for its life: strangers' links share half
        // of what it leaves.
        self.registered
            .keep_for_the_node(self.config.max_batch.saturating_mul(self.pool_buffers));
        *slot = Some(pool.clone());
        Ok(pool)
    }

    /// Where the send pool stands (`None` before it is made).
    pub fn pool_stats(&self) -> Option<PoolStats> {
        let slot = self.pool.lock().expect("pool slot poisoned");
        slot.as_ref().map(SendPool::stats)
    }

    /// Bounds what live links may register together at `max` bytes.
    pub fn with_max_registered(mut self, max: usize) -> RdmaEpochs<D> {
        self.registered = RegisteredBudget::new(max);
        self
    }

    /// Takes replaced links' graceful closes from `budget`
    /// ([`RdmaNodeConfig::read_outs`]).
    pub fn with_read_outs(mut self, budget: ReadOutBudget) -> RdmaEpochs<D> {
        self.read_outs = budget;
        self
    }

    /// The budget replaced links' graceful closes are taken from.
    pub fn read_outs(&self) -> &ReadOutBudget {
        &self.read_outs
    }

    /// Received batches every link made here dropped unread (the sum of
    /// their [`LinkStats::receives_dropped`](super::LinkStats), ended
    /// links included).
    pub fn receives_dropped(&self) -> u64 {
        self.receives_dropped.load(Ordering::Relaxed)
    }

    /// Adds `link` to the stall sweep, starting the sweep with the first.
    fn sweep(&self, link: &RdmaLink<D>) {
        let mut swept = self.swept.lock().unwrap_or_else(PoisonError::into_inner);
        swept.push(Arc::downgrade(link.shared()));
        drop(swept);
        if !self.sweeping.swap(true, Ordering::AcqRel) {
            let task = spawn_stall_sweep(Arc::downgrade(&self.swept));
            *self
                .sweep_task
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(task);
        }
    }

    /// Links in the stall sweep, the ended ones not yet pruned included.
    pub fn swept_links(&self) -> usize {
        self.swept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The registered-memory budget links are taken from.
    pub fn registered(&self) -> &RegisteredBudget {
        &self.registered
    }

    /// Why the last link end could not be created, if one could not.
    pub fn last_error(&self) -> Option<RdmaError> {
        self.last_error.lock().expect("error slot poisoned").clone()
    }

    /// A verbs failure while the node's registered bytes, this link's
    /// included, exceed `limit` is most likely the memlock limit: that is
    /// the error worth reporting (the verbs error is logged by the caller).
    pub fn explain(&self, err: RdmaError, limit: Option<MemlockLimit>) -> RdmaError {
        let RdmaError::Verbs(_) = err else {
            return err;
        };
        let pool_missing = self.pool.lock().expect("pool slot poisoned").is_none();
        let pool = if pool_missing {
            self.pool_buffers.saturating_mul(self.config.max_batch)
        } else {
            0
        };
        let needed = self
            .registered
            .in_use()
            .saturating_add(self.config.ring_bytes())
            .saturating_add(pool);
        match limit.map(|limit| limit.check(needed)) {
            Some(Err(memlock)) => memlock,
            Some(Ok(())) | None => err,
        }
    }

    /// The device links are made on.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Test hook: closes `link`'s bootstrap TCP connection abortively (RST),
    /// as a lost host's would end. The link ends with `PeerLost`; its peer
    /// learns it from the reset. False if the link has no liveness task.
    pub fn sever(&self, link: &RdmaLink<D>) -> bool {
        let qpn = link.address().qpn.value();
        let ctl = self.lock().get(&qpn).cloned();
        match ctl {
            Some(ctl) => {
                ctl.sever.store(true, Ordering::Release);
                ctl.wake.notify_one();
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Liveness>>> {
        self.live.lock().expect("liveness table poisoned")
    }
}

impl<D: Device + 'static> RdmaEpochs<D> {
    /// The peer's QP address, if a link toward its endpoint can work.
    fn peer_address(&self, peer: &Endpoint) -> Result<QpAddress, ConnectError> {
        let Endpoint::Rdma(peer) = peer else {
            return Err(BootstrapError::WrongTransport {
                expected: EndpointKind::Rdma,
                got: peer.kind(),
            }
            .into());
        };
        // Credit is receive posts: both ends must post the same R buffers
        // of the same size (docs/rdma-link.md).
        if peer.recv_depth as usize != self.config.recv_depth {
            return Err(ConnectError::Incompatible("recv_depth"));
        }
        if peer.recv_buf_size as usize != self.config.max_batch {
            return Err(ConnectError::Incompatible("recv_buf_size"));
        }
        if peer.lanes != 1 {
            return Err(ConnectError::Incompatible("lanes"));
        }
        Ok(QpAddress {
            qpn: Qpn::new(peer.qpn),
            psn: Psn::new(peer.psn),
            gid: Gid(peer.gid),
            udp_port: peer.udp_port,
            mtu: mtu_of(peer.mtu).ok_or(ConnectError::Incompatible("mtu"))?,
        })
    }
}

fn mtu_of(bytes: u16) -> Option<Mtu> {
    [
        Mtu::Mtu256,
        Mtu::Mtu512,
        Mtu::Mtu1024,
        Mtu::Mtu2048,
        Mtu::Mtu4096,
    ]
    .into_iter()
    .find(|m| m.bytes() == usize::from(bytes))
}

impl<D: Device + 'static> EpochMaker for RdmaEpochs<D> {
    type Link = RdmaLink<D>;
    type Prepared = PreparedEnd<D>;
    type Armed = RdmaLink<D>;

    fn kind(&self) -> EndpointKind {
        EndpointKind::Rdma
    }

    fn accepts(&self, peer: &Endpoint) -> Result<(), ConnectError> {
        self.peer_address(peer).map(|_| ())
    }

    fn prepare(&self, registered: bool) -> Result<(PreparedEnd<D>, Endpoint), ConnectError> {
        let budget = if registered {
            self.registered.clone()
        } else {
            self.registered.for_strangers()
        };
        let end = self
            .pool()
            .and_then(|pool| PreparedEnd::on_pool(&self.device, &pool, self.config, &budget))
            .map(|end| {
                end.with_read_outs(self.read_outs.clone())
                    .with_drop_tally(self.receives_dropped.clone())
            })
            .map_err(|err| {
                if let RdmaError::StrangersRegisteredLimit { .. } = err {
                    // A stranger at its share: the connector's refusal
                    // says so, at most once a second.
                    tracing::debug!(%err, "a stranger's link refused");
                } else {
                    tracing::warn!(%err, "creating the link's QP, CQ and MRs failed");
                }
                let err = self.explain(err, MemlockLimit::current());
                *self.last_error.lock().expect("error slot poisoned") = Some(err);
                ConnectError::Resources
            })?;
        let qp = end.address();
        let (Ok(recv_depth), Ok(recv_buf_size)) = (
            u32::try_from(self.config.recv_depth),
            u32::try_from(self.config.max_batch),
        ) else {
            return Err(ConnectError::Incompatible("rdma config out of range"));
        };
        let endpoint = RdmaEndpoint {
            qpn: qp.qpn.value(),
            psn: qp.psn.value(),
            gid: qp.gid.0,
            gid_index: 0,
            mtu: qp.mtu.bytes() as u16,
            recv_depth,
            recv_buf_size,
            lanes: 1,
            udp_port: qp.udp_port,
        };
        Ok((end, Endpoint::Rdma(endpoint)))
    }

    fn arm(
        &self,
        prepared: PreparedEnd<D>,
        peer: &Endpoint,
        epoch: Epoch,
    ) -> Result<RdmaLink<D>, ConnectError> {
        let address = self.peer_address(peer)?;
        prepared.connect(&address, epoch).map_err(|err| {
            tracing::warn!(%err, "moving the link's QP to RTR/RTS failed");
            ConnectError::Resources
        })
    }

    fn finish(
        &self,
        link: RdmaLink<D>,
        stream: TcpStream,
        prefix: Vec<u8>,
        _epoch: Epoch,
        owner: ReadOutOwner,
    ) -> Result<RdmaLink<D>, ConnectError> {
        if !prefix.is_empty() {
            // Nothing follows the ready on the liveness channel.
            return Err(BootstrapError::BadField("bytes after ready").into());
        }
        configure(&stream, &self.liveness)?;
        link.set_read_out_owner(owner);
        self.sweep(&link);
        let ctl = Arc::new(Liveness::default());
        let qpn = link.address().qpn.value();
        self.lock().insert(qpn, ctl.clone());
        let wake = ctl.clone();
        link.on_last_sent(move || {
            wake.last_sent.store(true, Ordering::Release);
            wake.wake.notify_one();
        });
        let wake = ctl.clone();
        link.on_end(move |_| {
            wake.torn_down.store(true, Ordering::Release);
            wake.wake.notify_one();
        });
        let span = link.span().clone();
        let (ended, table) = (link.clone(), self.live.clone());
        spawn_catching(
            liveness(link.clone(), stream, ctl, qpn, self.live.clone()).instrument(span),
            move || {
                ended.shared().end_after_panic(false);
                table
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&qpn);
            },
        );
        Ok(link)
    }

    fn end_reason(link: &RdmaLink<D>) -> Option<EpochEnd> {
        link.end_reason()
    }

    fn carried_traffic(link: &RdmaLink<D>) -> bool {
        // A SEND the peer's RC acknowledged proves it too (our posts alone
        // do not).
        let stats = link.stats();
        stats.batches_received > 0 || stats.sends_acked > 0
    }
}

/// How often a node looks at its links for stalled sends.
const STALL_SWEEP: Duration = Duration::from_secs(1);

/// Once a [`STALL_SWEEP`], every live link made by a node gets a look for
/// stalled sends ([`Shared::check_stall`]): a link nothing more is written
/// on would otherwise keep its share of the send pool until its idle
/// retire, since only a waiting `reserve` looks. Two looks in a row end a
/// stalled epoch. Ends when the node's epochs drop.
fn spawn_stall_sweep<D: Device + 'static>(
    swept: Weak<Mutex<Vec<Weak<Shared<D>>>>>,
) -> tokio::task::AbortHandle {
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(STALL_SWEEP);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(swept) = swept.upgrade() else {
                return;
            };
            let live: Vec<_> = {
                let mut links = swept.lock().unwrap_or_else(PoisonError::into_inner);
                links.retain(|link| link.strong_count() > 0);
                links.iter().filter_map(Weak::upgrade).collect()
            };
            drop(swept);
            for link in live {
                link.check_stall();
            }
        }
    });
    task.abort_handle()
}

/// Holds the bootstrap connection for the link's epoch. Its EOF is the
/// peer's word that it sends nothing more on the QP (its graceful end, or
/// its teardown) and its error a lost peer; either ends the link. Our
/// graceful end's last SEND done half-closes it; our teardown closes it,
/// with a reset when no half-close came first, so a peer does not wait for
/// SENDs our QP will never take (docs/design.md § "A closed link delivers
/// both ways").
async fn liveness<D: Device + 'static>(
    link: RdmaLink<D>,
    mut stream: TcpStream,
    ctl: Arc<Liveness>,
    qpn: u32,
    table: Arc<Mutex<HashMap<u32, Arc<Liveness>>>>,
) {
    let mut buf = [0u8; 64];
    let (mut peer_done, mut half_closed) = (false, false);
    let abortive = loop {
        let woken = ctl.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        if ctl.sever.load(Ordering::Acquire) {
            // As from a lost host: the peer sees a reset.
            link.fail(EpochEnd::PeerLost);
            break true;
        }
        if ctl.last_sent.load(Ordering::Acquire) && !half_closed {
            half_closed = true;
            if let Err(err) = stream.shutdown().await {
                tracing::debug!(%err, "liveness half-close failed");
            }
        }
        if ctl.torn_down.load(Ordering::Acquire) {
            break !half_closed || link.close_was_cut();
        }
        tokio::select! {
            () = woken => {}
            read = stream.read(&mut buf), if !peer_done => match read {
                Ok(0) => {
                    peer_done = true;
                    link.peer_finished();
                    link.fail(EpochEnd::PeerClosed);
                }
                // Nothing may follow the ready on this connection.
                Ok(_) => {
                    link.fail(EpochEnd::Violation(ProtocolError::LivenessTraffic));
                    break true;
                }
                Err(err) => {
                    tracing::debug!(%err, "liveness connection failed");
                    link.fail(EpochEnd::PeerLost);
                    break true;
                }
            },
        }
    };
    if abortive {
        if let Err(err) = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO)) {
            tracing::debug!(%err, "SO_LINGER failed");
        }
    }
    table.lock().expect("liveness table poisoned").remove(&qpn);
    drop(stream);
}

/// The mux over RDMA links, one RC QP per peer per epoch, bootstrapped over
/// TCP: one [`Connector`] (listener, dialer, peer table) and one mux.
pub struct RdmaTransport<D: Device + 'static> {
    node: Connector<RdmaEpochs<D>>,
    mux: Mux<RdmaLink<D>>,
}

impl<D: Device + 'static> RdmaTransport<D> {
    /// Binds the bootstrap listener, creates the mux, and wires them. Links
    /// are made on `device` lazily, when the mux first has work for a peer.
    ///
    /// Fails with `InvalidInput` when one link alone exceeds
    /// `max_registered`, on a mux configuration
    /// [`MuxConfig::check`](crate::mux::MuxConfig::check) refuses, or on
    /// connector backoff bounds out of order; a memlock limit below it is logged as a warning
    /// on a device that pins memory (see [`RdmaNodeConfig::preflight`]).
    pub async fn start(device: D, config: RdmaNodeConfig) -> io::Result<RdmaTransport<D>> {
        config
            .mux
            .check()
            .map_err(|err| io::Error::new(io::ErrorKind::InvalidInput, err))?;
        match config.preflight() {
            Ok(()) => {}
            Err(err @ RdmaError::MemlockTooSmall { .. }) if device.pins_memory() => {
                tracing::warn!(%err, "memlock preflight: registration may fail");
            }
            // Nothing is pinned: the limit does not apply to this device.
            Err(RdmaError::MemlockTooSmall { .. }) => {}
            Err(err) => return Err(io::Error::new(io::ErrorKind::InvalidInput, err)),
        }
        let epochs = RdmaEpochs::new(device, config.rdma, config.liveness)
            .with_max_registered(config.max_registered)
            .with_pool_buffers(config.pool_buffers)
            .with_read_outs(config.read_outs);
        if let Err(err) = epochs.pool() {
            let err = epochs.explain(err, MemlockLimit::current());
            return Err(io::Error::other(err));
        }
        let strangers = epochs.registered().strangers_max();
        if strangers < config.rdma.ring_bytes() {
            tracing::warn!(
                strangers,
                ring = config.rdma.ring_bytes(),
                "half of max_registered after the send pool holds no receive ring: peers this \
                 node does not register cannot link; raise max_registered"
            );
        }
        let node = Connector::bind_with(config.connector, epochs, config.bind).await?;
        let mux = Mux::new(config.mux, node.dialer());
        node.set_mux(mux.clone());
        Ok(RdmaTransport { node, mux })
    }

    /// The connection manager, for its counters and test hooks
    /// (`link(peer)`, `stats()`, `connect(peer)`).
    pub fn node(&self) -> &Connector<RdmaEpochs<D>> {
        &self.node
    }

    /// The device this transport's links run on.
    pub fn device(&self) -> &D {
        self.node.epochs().device()
    }

    /// Where the device's send pool stands (chunks, in use, waits).
    pub fn pool_stats(&self) -> PoolStats {
        self.node.epochs().pool_stats().unwrap_or_default()
    }

    /// Every counter of this node under its stable `qpmux_*` name
    /// (docs/metrics.md): the mux's [`crate::mux::Stats::metrics`], the
    /// connection manager's, the registered-memory, send-pool and read-out
    /// gauges.
    pub fn metrics(&self) -> Vec<(&'static str, u64)> {
        use crate::mux::MuxTransport;
        let mut out = self.mux.stats().metrics();
        let node = self.node.stats();
        let registered = self.node.epochs().registered();
        let as_u64 = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        out.extend([
            ("qpmux_epochs_established_total", node.established),
            ("qpmux_connections_refused_total", node.refused),
            ("qpmux_dial_failures_total", node.dial_failures),
            ("qpmux_dials_declined_total", node.declined),
            ("qpmux_dials_withdrawn_total", node.withdrawn),
            ("qpmux_peer_restarts_total", node.restarts_seen),
            ("qpmux_peers_known", node.peers_known),
            ("qpmux_registered_bytes", as_u64(registered.in_use())),
            ("qpmux_registered_max_bytes", as_u64(registered.max())),
            (
                "qpmux_registered_strangers_bytes",
                as_u64(registered.strangers_in_use()),
            ),
        ]);
        let pool = self.pool_stats();
        out.extend([
            ("qpmux_send_pool_chunks", as_u64(pool.chunks)),
            ("qpmux_send_pool_chunks_in_use", as_u64(pool.in_use)),
            ("qpmux_send_pool_waits_total", pool.waits),
            ("qpmux_send_pool_set_aside", as_u64(pool.set_aside)),
            ("qpmux_send_pool_refused_lends_total", pool.refused_lends),
            (
                "qpmux_receives_dropped_total",
                self.node.epochs().receives_dropped(),
            ),
        ]);
        let read_outs = self.node.epochs().read_outs();
        out.extend([
            ("qpmux_read_outs", as_u64(read_outs.in_use())),
            ("qpmux_read_outs_refused_total", read_outs.refused()),
            (
                "qpmux_read_outs_short",
                as_u64(read_outs.in_use_of(ReadOutTier::Short)),
            ),
            (
                "qpmux_read_outs_short_refused_total",
                read_outs.short_refused(),
            ),
        ]);
        out
    }

    /// Why the last link end could not be created (e.g. the
    /// registered-memory bound), if one could not.
    pub fn last_resource_error(&self) -> Option<RdmaError> {
        self.node.epochs().last_error()
    }

    /// Test hook: abortively closes the bootstrap TCP connection of the
    /// current link to `peer`. False if there is no live link.
    pub fn sever_bootstrap(&self, peer: PeerId) -> bool {
        self.node
            .link(peer)
            .is_some_and(|link| self.node.epochs().sever(&link))
    }
}

impl<D: Device + 'static> Node for RdmaTransport<D> {
    type Link = RdmaLink<D>;

    fn mux(&self) -> &Mux<RdmaLink<D>> {
        &self.mux
    }

    fn address(&self) -> Vec<u8> {
        self.node.address_blob()
    }

    fn register(&self, blob: &[u8]) -> Result<PeerId, RegisterError> {
        self.node.register_blob(blob)
    }

    fn unregister(&self, peer: PeerId) {
        self.node.forget(peer);
    }

    fn shutdown(&self) {
        self.node.shutdown_after(&self.mux);
    }

    fn last_dial_failure(&self, peer: PeerId) -> Option<DialFailure> {
        self.node.last_dial_failure(peer)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::link::rdma::pair;
    use crate::verbs::soft::SoftDevice;
    use crate::verbs::soft::udp::UdpConfig;

    /// Nothing may follow the ready on the liveness connection: a byte there
    /// is the peer's violation, not a fault of this end.
    #[tokio::test]
    async fn a_byte_on_the_liveness_connection_is_the_peers_violation() {
        let device = || SoftDevice::open_udp(UdpConfig::default());
        let (da, db) = (
            device().await.expect("device"),
            device().await.expect("device"),
        );
        let (link, _peer) = pair(&da, &db, Epoch(1), RdmaConfig::strict()).expect("pair");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (dialed, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let ctl = Arc::new(Liveness::default());
        let table = Arc::new(Mutex::new(HashMap::new()));
        let held = accepted.expect("accept").0;
        let task = tokio::spawn(liveness(link.clone(), held, ctl, 1, table));
        let mut remote = dialed.expect("connect");
        remote.write_all(b"x").await.expect("write");
        task.await.expect("the liveness task ends");
        assert_eq!(
            link.ended().await,
            EpochEnd::Violation(ProtocolError::LivenessTraffic)
        );
    }

    /// A batch a node's link drops unread (here: its buffer not lent)
    /// stays counted on the node after the link is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_node_tallies_what_its_links_dropped_unread() {
        use crate::link::{Link, LinkError, LinkFault};
        let device = || SoftDevice::open_udp(UdpConfig::default());
        let (da, db) = (
            device().await.expect("device"),
            device().await.expect("device"),
        );
        let config = RdmaConfig {
            recv_depth: 8,
            max_batch: 4096,
            send_buffers: 2,
            ..RdmaConfig::default()
        };
        let epochs = RdmaEpochs::new(da, config, TcpLinkConfig::default());
        let (ours, _) = epochs.prepare(true).expect("a node's end");
        let theirs = PreparedEnd::new(&db, config).expect("peer end");
        let (ours_at, theirs_at) = (ours.address(), theirs.address());
        let link = ours.connect(&theirs_at, Epoch(1)).expect("connect");
        let peer = theirs.connect(&ours_at, Epoch(1)).expect("connect");
        for mr in &link.shared().recv_mrs {
            mr.mem.not_lent.store(u64::MAX, Ordering::Relaxed);
        }
        let mut buf = peer.reserve().await.expect("reserve");
        buf[..5].copy_from_slice(b"hello");
        peer.post(buf, 5).expect("post");
        // The batch's buffer is refused where `recv` would hand it out.
        let recv = tokio::time::timeout(Duration::from_secs(10), link.recv()).await;
        let not_lent = EpochEnd::Fault(LinkFault::BufferNotLent { receive: true });
        assert!(
            matches!(recv, Ok(Err(LinkError::Ended { reason, .. })) if reason == not_lent),
            "{:?}",
            recv.map(|r| r.map(drop))
        );
        assert_eq!(link.stats().receives_dropped, 1);
        drop(link);
        assert_eq!(epochs.receives_dropped(), 1, "kept past the link");
    }

    /// The stall sweep's task ends when the epochs drop, not at its next
    /// one-second tick (the sweep harness counted these as leftover tasks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_stall_sweep_ends_with_the_epochs() {
        let dev = SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("device");
        let config = RdmaConfig {
            recv_depth: 8,
            max_batch: 4096,
            send_buffers: 2,
            ..RdmaConfig::default()
        };
        let epochs = RdmaEpochs::new(dev.clone(), config, TcpLinkConfig::default());
        let pd = dev.alloc_pd().expect("pd");
        let cq = dev.create_cq(64).expect("cq");
        let qp = dev
            .create_qp(&pd, &cq, &cq, crate::verbs::QpCaps::default())
            .expect("qp");
        let end = PreparedEnd::new(&dev, config).expect("link end");
        let link = end
            .connect(&QpAddress::of(&dev, &qp), Epoch(7))
            .expect("connect");
        epochs.sweep(&link);
        let sweep = (epochs.sweep_task.lock().expect("sweep task").clone())
            .expect("the first link started the sweep");
        // The sweep's first tick prunes the dropped link: from then on it
        // waits a whole tick.
        drop(link);
        tokio::time::timeout(Duration::from_secs(5), async {
            while epochs.swept_links() > 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the first tick pruned the link");
        assert!(!sweep.is_finished(), "sweeping while the epochs live");
        drop(epochs);
        tokio::time::timeout(Duration::from_millis(500), async {
            while !sweep.is_finished() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the sweep ended with the epochs, before its next tick");
        drop((qp, cq, pd));
    }

    /// The node's sweep task, not a waiting `reserve`, finds a link whose
    /// SENDs its peer never completes (RNR NAKs for ever, `rnr_retry = 7`)
    /// and that nothing writes on any more: the epoch ends at the stall
    /// limit, and the sweep prunes the link once it is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_nodes_sweep_ends_a_stalled_link_nothing_waits_on() {
        use crate::link::LinkFault;
        use crate::verbs::{AccessFlags, InitAttr, QpCaps, QueuePair, RtrAttr};

        let dev = SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("device");
        let forever = RdmaConfig {
            recv_depth: 8,
            max_batch: 4096,
            send_buffers: 2,
            rnr_retry: 7,
            timeout: 8,
            ..RdmaConfig::default()
        };
        let epochs = RdmaEpochs::new(dev.clone(), forever, TcpLinkConfig::default());
        // The peer: a QP that announced receives and never posts one.
        let pd = dev.alloc_pd().expect("pd");
        let cq = dev.create_cq(64).expect("cq");
        let qp = dev.create_qp(&pd, &cq, &cq, QpCaps::default()).expect("qp");
        qp.modify_to_init(InitAttr {
            access: AccessFlags::LOCAL_WRITE,
        })
        .expect("init");
        let end = PreparedEnd::new(&dev, forever).expect("link end");
        let link = end
            .connect(&QpAddress::of(&dev, &qp), Epoch(7))
            .expect("connect");
        let mtu = dev.query_port().active_mtu;
        qp.modify_to_rtr(RtrAttr::for_peer(&link.address(), mtu, 12))
            .expect("rtr");
        epochs.sweep(&link);
        for payload in [&b"one"[..], b"two: the last buffer, signaled"] {
            let mut buf = link.reserve().await.expect("reserve");
            buf[..payload.len()].copy_from_slice(payload);
            link.post(buf, payload.len()).expect("post");
        }
        let ended = tokio::time::timeout(Duration::from_secs(20), link.ended()).await;
        assert_eq!(
            ended.expect("the sweep ended it"),
            EpochEnd::Fault(LinkFault::SendsStalled)
        );
        assert_eq!(epochs.swept_links(), 1);
        drop(link);
        let pruned = async {
            while epochs.swept_links() > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), pruned)
            .await
            .expect("the sweep pruned the link once it was gone");
        drop((qp, cq, pd));
    }
}
