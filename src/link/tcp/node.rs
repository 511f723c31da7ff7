//! [`Connector`]: the connection manager shared by the TCP and RDMA
//! transports. Listens, dials, runs the bootstrap handshake over TCP, and
//! hands each new epoch's link (made by an [`EpochMaker`]) to the mux.
//! [`TcpNode`] is the connector whose epochs are the TCP streams themselves.
//!
//! ```text
//!  mux ─ want_link(peer) ─► dial task (backoff) ─ connect ─ handshake(dialer) ─┐
//!  accept loop ─ accept ─► handshake task (bounded) ─ handshake(listener) ─────┼─► install ─► mux.attach(peer, link)
//!                              PeerHello ─► decide: respond / decline (crossed, stale)
//!  EpochMaker: prepare (dialer: before its hello; listener: after PeerHello passed)
//!              ─► arm (peer's endpoint known: listener before respond, dialer before ready)
//!              ─► finish (stream + epoch ─► link; under the table lock)
//! ```
//!
//! One table (`peers`, one mutex) says per peer: address, where our dial
//! stands, handshakes being accepted, last epoch, incarnation, current link,
//! backoff. A peer neither registered, linked, dialing nor being accepted
//! leaves it (its ended link with it); the newest epoch of those gone is a
//! floor under every peer's next. Crossed dials settle on the connection
//! dialed by the lower node id: a listener declines a higher-id dialer while
//! it is connecting to that peer itself (not while it only waits out a
//! backoff), declines any dial proposing an epoch older than the running
//! one (it predates it), and declines a process whose previous handshake here
//! is still under way (that one installs first). Declines are not errors.
//! Backoff rule:
//! docs/design.md § "Redial backoff"; the table's bounds: § "A peer counts
//! against `max_peers` while anything of it is kept".

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio::time::{Instant, sleep_until, timeout};

use super::link::{TcpLink, TcpLinkConfig};
use crate::link::bootstrap::{
    BootstrapError, ClusterKey, DeclineReason, Endpoint, EndpointKind, Established, Event,
    Handshake, HelloFields, TcpEndpoint, agreed_epoch, fresh_nonce,
};
use crate::link::{EpochEnd, Link, ReadOutOwner};
use crate::mux::protocol::Epoch;
use crate::mux::{Dialer, Mux, MuxConfig, PeerId, PeerTerms};
use crate::warn_gate::WarnGate;

/// Configuration of a TCP node. Defaults are documented per field.
#[derive(Clone, Debug)]
pub struct TcpNodeConfig {
    /// This node's id (sent in every hello).
    pub id: PeerId,
    /// The cluster key; `None` runs the handshake unauthenticated.
    pub key: Option<ClusterKey>,
    /// Shape of each link.
    pub link: TcpLinkConfig,
    /// Longest a connect plus handshake may take. Default 5 s.
    pub handshake_timeout: Duration,
    /// First backoff after a failed dial. Default 50 ms.
    pub backoff_min: Duration,
    /// Largest backoff (each wait adds up to half of it at random), at
    /// least `backoff_min` (itself above zero) and at most
    /// [`MAX_BACKOFF`]. Default 5 s.
    pub backoff_max: Duration,
    /// Handshakes accepted concurrently; more connections are closed at
    /// once. A quarter of them is kept for sources that are registered
    /// peers' addresses. Default 64.
    pub max_pending_handshakes: usize,
    /// Of those, handshakes from one source (an IPv4 address, or an IPv6
    /// /64); its further connections are closed at once, so one host's
    /// silent dialers cannot fill the pool. A source where more peers are
    /// registered may have one under way for each (at most half the pool).
    /// Default 16.
    pub max_pending_per_source: usize,
    /// Peers with a live link or a dial or handshake under way, and peers
    /// gone whose bytes are still held here unread; a new peer beyond this
    /// is refused ([`ConnectError::TooManyPeers`]). A registered peer is
    /// counted against registered peers only. Default 1024.
    pub max_peers: usize,
    /// Of those, peers not registered here that dialled in from one source;
    /// more are refused ([`ConnectError::TooManyPeersFromSource`]), so one
    /// host cannot take every place. Default 128.
    pub max_peers_per_source: usize,
}

/// What every connector needs, whatever its epochs are made of.
#[derive(Clone, Debug)]
pub struct ConnectorConfig {
    /// This node's id (sent in every hello).
    pub id: PeerId,
    /// The cluster key; `None` runs the handshake unauthenticated.
    pub key: Option<ClusterKey>,
    /// Longest a connect plus handshake may take.
    pub handshake_timeout: Duration,
    /// First backoff after a failed dial.
    pub backoff_min: Duration,
    /// Largest backoff (each wait adds up to half of it at random), at
    /// least `backoff_min` (itself above zero) and at most
    /// [`MAX_BACKOFF`].
    pub backoff_max: Duration,
    /// Handshakes accepted concurrently; more connections are closed at
    /// once (a quarter kept for registered peers' sources).
    pub max_pending_handshakes: usize,
    /// Handshakes from one source IP at once (a source where more peers
    /// are registered: one for each, up to half the pool); more are closed
    /// at once.
    pub max_pending_per_source: usize,
    /// Peers with a live link or a dial or handshake under way, and peers
    /// gone whose bytes are held here; a new peer beyond this is refused
    /// ([`ConnectError::TooManyPeers`]); registered peers count against
    /// registered peers only.
    pub max_peers: usize,
    /// Peers not registered here from one source IP; more are refused
    /// ([`ConnectError::TooManyPeersFromSource`]).
    pub max_peers_per_source: usize,
}

/// The largest `backoff_max` a connector binds with.
pub const MAX_BACKOFF: Duration = Duration::from_secs(86_400);

impl ConnectorConfig {
    /// The defaults of [`TcpNodeConfig::new`] for node `id`.
    pub fn new(id: PeerId) -> ConnectorConfig {
        TcpNodeConfig::new(id).split().0
    }

    /// Refuses backoff bounds out of order or past [`MAX_BACKOFF`] (the
    /// first failed dial would panic under the node's table lock, and every
    /// task of the node with it), or a zero first backoff (doubling it
    /// never waits: an offender would be redialled at once).
    fn check(&self) -> io::Result<()> {
        let (min, max) = (self.backoff_min, self.backoff_max);
        if min.is_zero() || min > max || max > MAX_BACKOFF {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "backoff_min {:?} and backoff_max {:?}: need 0 < min ≤ max ≤ {:?}",
                    self.backoff_min, self.backoff_max, MAX_BACKOFF
                ),
            ));
        }
        Ok(())
    }
}

impl TcpNodeConfig {
    fn split(self) -> (ConnectorConfig, TcpLinkConfig) {
        (
            ConnectorConfig {
                id: self.id,
                key: self.key,
                handshake_timeout: self.handshake_timeout,
                backoff_min: self.backoff_min,
                backoff_max: self.backoff_max,
                max_pending_handshakes: self.max_pending_handshakes,
                max_pending_per_source: self.max_pending_per_source,
                max_peers: self.max_peers,
                max_peers_per_source: self.max_peers_per_source,
            },
            self.link,
        )
    }

    /// Defaults for node `id`, without a cluster key.
    pub fn new(id: PeerId) -> TcpNodeConfig {
        TcpNodeConfig {
            id,
            key: None,
            link: TcpLinkConfig::default(),
            handshake_timeout: Duration::from_secs(5),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            max_pending_handshakes: 64,
            max_pending_per_source: 16,
            max_peers: 1024,
            max_peers_per_source: 128,
        }
    }
}

/// Our dials a peer declines `Unavailable` in a row before the dialer
/// warns (at most once a second per node): one is often a race.
const DECLINES_WORTH_A_WARNING: u32 = 5;

/// Handshakes one peer may have under way here at once: one, and a
/// restarted process's while its old one times out. An accepted hello makes
/// the epoch's resources before it is answered, so without a cap one peer
/// id could hold `max_pending_handshakes` of them (`max_peers` counts ids).
pub const MAX_ACCEPTS_PER_PEER: usize = 2;

/// Why a connection attempt (dialed or accepted) produced no link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum ConnectError {
    /// A socket error.
    #[error("i/o error: {0:?}")]
    Io(io::ErrorKind),
    /// Connect plus handshake took longer than `handshake_timeout`.
    #[error("handshake timed out")]
    Timeout,
    /// The handshake failed (the peer is broken, misconfigured or hostile).
    #[error("handshake failed: {0}")]
    Handshake(#[from] BootstrapError),
    /// The peer declined our dial (not a fault, unless for another
    /// transport or an incompatible endpoint: [`ConnectError::is_benign`]).
    #[error("declined by the peer: {0}")]
    DeclinedByPeer(DeclineReason),
    /// The dialer closed after our answer and before its ready: it gave
    /// the dial up there, superseded or its peer forgotten (not a fault).
    #[error("the dialer withdrew before its ready")]
    Withdrawn,
    /// We declined the peer's dial (not a fault).
    #[error("declined the peer's dial: {0}")]
    DeclinedLocally(DeclineReason),
    /// A newer epoch with the peer was installed while this one was set up.
    #[error("superseded by epoch {0}")]
    Superseded(Epoch),
    /// No address is registered for the peer.
    #[error("no address for peer {0:?}")]
    UnknownPeer(PeerId),
    /// The node is shut down or has no mux yet.
    #[error("node is not serving")]
    NotServing,
    /// The peer's endpoint cannot work with ours (e.g. different receive
    /// depth or buffer size); the named field disagrees.
    #[error("incompatible endpoint: {0}")]
    Incompatible(&'static str),
    /// Creating or connecting the epoch's local resources failed (logged).
    #[error("local transport resources failed")]
    Resources,
    /// A new peer would exceed `max_peers` (the peer is told `Unavailable`).
    #[error("peer limit of {limit} reached")]
    TooManyPeers {
        /// The configured `max_peers`.
        limit: usize,
    },
    /// A peer not registered here, dialling in from a source that already
    /// has `max_peers_per_source` such peers (the peer is told `Unavailable`).
    #[error("{limit} peers already in from {from}")]
    TooManyPeersFromSource {
        /// The hello's source: its IPv4 address, or its IPv6 /64.
        from: IpAddr,
        /// The configured `max_peers_per_source`.
        limit: usize,
    },
    /// An incoming connection found `max_pending_handshakes` under way (or
    /// all but the quarter kept for registered peers' sources, when it is
    /// not one) and was closed without a word.
    #[error("{limit} handshakes already pending")]
    TooManyHandshakes {
        /// The configured `max_pending_handshakes`.
        limit: usize,
    },
    /// A hello from a peer that already has [`MAX_ACCEPTS_PER_PEER`]
    /// handshakes under way here (each made its epoch's resources, a QP and
    /// a receive ring on RDMA, before answering); declined `Unavailable`.
    #[error("{limit} handshakes with {peer:?} already under way")]
    TooManyHandshakesFromPeer {
        /// The peer the hello named.
        peer: PeerId,
        /// [`MAX_ACCEPTS_PER_PEER`].
        limit: usize,
    },
    /// An incoming connection's source IP already had its limit of
    /// handshakes under way; closed without a word.
    #[error("{limit} handshakes already pending from {from}")]
    TooManyHandshakesFromSource {
        /// The connection's source: its IPv4 address, or its IPv6 /64.
        from: IpAddr,
        /// `max_pending_per_source`, or the number of peers registered at
        /// that source if larger (at most half of `max_pending_handshakes`).
        limit: usize,
    },
}

/// A dial that failed: why, and when it ended (so a caller can tell it
/// from one that ended before what it waits for began).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DialFailure {
    /// Why it failed.
    pub error: ConnectError,
    /// When it ended.
    pub at: std::time::Instant,
}

impl From<io::Error> for ConnectError {
    fn from(err: io::Error) -> Self {
        ConnectError::Io(err.kind())
    }
}

impl ConnectError {
    /// True for a failure no redial mends until a setting changes at one
    /// end: the peer declined our dial for another transport or an
    /// incompatible endpoint, or we found an endpoint one end cannot use.
    pub fn is_permanent(&self) -> bool {
        match self {
            ConnectError::DeclinedByPeer(reason) => reason.is_permanent(),
            ConnectError::Incompatible(_) => true,
            _ => false,
        }
    }

    /// True for outcomes that are part of normal operation (declines, races).
    /// A decline for another transport or an incompatible endpoint is not:
    /// asking again fails the same way until someone changes a setting.
    pub fn is_benign(&self) -> bool {
        match self {
            ConnectError::DeclinedByPeer(reason) | ConnectError::DeclinedLocally(reason) => {
                !reason.is_permanent()
            }
            ConnectError::Withdrawn | ConnectError::Superseded(_) => true,
            ConnectError::Io(_)
            | ConnectError::Timeout
            | ConnectError::Handshake(_)
            | ConnectError::UnknownPeer(_)
            | ConnectError::NotServing
            | ConnectError::Incompatible(_)
            | ConnectError::Resources
            | ConnectError::TooManyPeers { .. }
            | ConnectError::TooManyPeersFromSource { .. }
            | ConnectError::TooManyHandshakes { .. }
            | ConnectError::TooManyHandshakesFromSource { .. }
            | ConnectError::TooManyHandshakesFromPeer { .. } => false,
        }
    }
}

/// Counters of one node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Epochs installed (dialed or accepted).
    pub established: u64,
    /// Incoming connections refused with an error (bad handshake, timeout, overload).
    pub refused: u64,
    /// Dials that failed with an error.
    pub dial_failures: u64,
    /// Declines, sent or received. Our dials declined for another transport
    /// or an incompatible endpoint count in `dial_failures` too; such dials
    /// of the peer's count in `refused` only.
    pub declined: u64,
    /// Times a peer showed a new incarnation (it restarted).
    pub restarts_seen: u64,
    /// Dials and accepted handshakes refused at `max_peers`, and hellos
    /// from a peer with `MAX_ACCEPTS_PER_PEER` handshakes under way (also
    /// counted in `refused` or `dial_failures`).
    pub peer_limit_refusals: u64,
    /// Connections closed at once because `max_pending_handshakes` were
    /// under way, or `max_pending_per_source` from their source IP (also
    /// counted in `refused`).
    pub handshakes_shed: u64,
    /// Accepted handshakes whose dialer closed after our answer and before
    /// its ready ([`ConnectError::Withdrawn`]: superseded or forgotten on
    /// its side; benign, not counted in `refused`).
    pub withdrawn: u64,
    /// Peers the connection table holds now: registered, linked, dialing or
    /// being accepted. A peer that is none of these any more is let go.
    pub peers_known: u64,
}

#[derive(Default)]
struct Counters {
    established: AtomicU64,
    refused: AtomicU64,
    dial_failures: AtomicU64,
    declined: AtomicU64,
    restarts_seen: AtomicU64,
    peer_limit_refusals: AtomicU64,
    handshakes_shed: AtomicU64,
    withdrawn: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What an epoch's link is made from: the transport half of the connection
/// manager. The [`Connector`] drives the handshake and the peer table; an
/// `EpochMaker` creates the local resources at the moments the handshake
/// allows, and turns the established connection into a link.
///
/// Order, per connection: `prepare` (dialer: before its hello, which carries
/// the endpoint; listener: only after the dialer's hello authenticated and
/// passed `decide`), then `arm` once the peer's endpoint and the epoch are
/// known (listener: before it answers; dialer: before it sends ready), then
/// `finish` under the peer-table lock, right before the mux gets the link.
pub trait EpochMaker: Send + Sync + 'static {
    /// The link each epoch runs on.
    type Link: Link + Clone;
    /// Local resources made for one handshake, before the peer is known.
    type Prepared: Send + 'static;
    /// Resources connected toward the peer, waiting for the handshake to end.
    type Armed: Send + 'static;

    /// The endpoint kind this maker speaks (the listener refuses others).
    fn kind(&self) -> EndpointKind;

    /// Whether a link can be made toward the peer's `endpoint` at all
    /// (kind, sizes). The listener asks before `prepare`, so an incompatible
    /// dialer costs no resources; `arm` must check it again.
    fn accepts(&self, peer: &Endpoint) -> Result<(), ConnectError>;

    /// Creates this side's resources; returns them and the endpoint for our
    /// hello. `registered`: the peer is one this node registered (a dial is
    /// always to one), not a stranger that dialled in, whose links may hold
    /// only their share of what the node keeps for links.
    fn prepare(&self, registered: bool) -> Result<(Self::Prepared, Endpoint), ConnectError>;

    /// Connects `prepared` toward the peer's `endpoint` for `epoch`. After
    /// this returns the peer may send to us.
    fn arm(
        &self,
        prepared: Self::Prepared,
        peer: &Endpoint,
        epoch: Epoch,
    ) -> Result<Self::Armed, ConnectError>;

    /// Makes the link from the armed resources and the bootstrap connection
    /// (`prefix`: bytes read past the handshake); `owner` names its share of
    /// the node's [`ReadOutBudget`](crate::link::ReadOutBudget). Called
    /// under the peer table's lock: must not block.
    fn finish(
        &self,
        armed: Self::Armed,
        stream: TcpStream,
        prefix: Vec<u8>,
        epoch: Epoch,
        owner: ReadOutOwner,
    ) -> Result<Self::Link, ConnectError>;

    /// Why `link`'s epoch ended, once it has.
    fn end_reason(link: &Self::Link) -> Option<EpochEnd>;

    /// True if the peer sent a batch on `link`: it took part in the epoch,
    /// so the epoch's end is fresh news (no backoff). A batch we sent
    /// proves nothing: it only reached our own kernel or send queue.
    fn carried_traffic(link: &Self::Link) -> bool;
}

/// The TCP transport's epochs: the bootstrap stream itself becomes the link.
pub struct TcpEpochs {
    link: TcpLinkConfig,
}

impl EpochMaker for TcpEpochs {
    type Link = TcpLink;
    type Prepared = ();
    type Armed = usize;

    fn kind(&self) -> EndpointKind {
        EndpointKind::Tcp
    }

    fn accepts(&self, peer: &Endpoint) -> Result<(), ConnectError> {
        match peer {
            Endpoint::Tcp(_) => Ok(()),
            Endpoint::Rdma(_) => Err(BootstrapError::WrongTransport {
                expected: EndpointKind::Tcp,
                got: EndpointKind::Rdma,
            }
            .into()),
        }
    }

    fn prepare(&self, _registered: bool) -> Result<((), Endpoint), ConnectError> {
        let max_batch = u32::try_from(self.link.max_batch).unwrap_or(TcpEndpoint::MAX_BATCH);
        Ok(((), Endpoint::Tcp(TcpEndpoint { max_batch })))
    }

    fn arm(&self, (): (), peer: &Endpoint, _epoch: Epoch) -> Result<usize, ConnectError> {
        match peer {
            Endpoint::Tcp(t) => Ok(t.max_batch as usize),
            Endpoint::Rdma(_) => Err(BootstrapError::WrongTransport {
                expected: EndpointKind::Tcp,
                got: EndpointKind::Rdma,
            }
            .into()),
        }
    }

    fn finish(
        &self,
        peer_max: usize,
        stream: TcpStream,
        prefix: Vec<u8>,
        epoch: Epoch,
        owner: ReadOutOwner,
    ) -> Result<TcpLink, ConnectError> {
        let config = TcpLinkConfig {
            read_outs: self.link.read_outs.owned_by(owner),
            ..self.link.clone()
        };
        Ok(TcpLink::new(stream, prefix, epoch, &config, peer_max)?)
    }

    fn end_reason(link: &TcpLink) -> Option<EpochEnd> {
        link.end_reason()
    }

    fn carried_traffic(link: &TcpLink) -> bool {
        link.stats().batches_received > 0
    }
}

/// Where our dial to a peer stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Dial {
    /// No dial task.
    #[default]
    Idle,
    /// A dial task waits out the backoff; it looks again before connecting.
    Waiting,
    /// Connecting or handshaking: a crossing dial from the peer is settled
    /// against this one.
    Connecting,
}

struct PeerState<L> {
    addr: Option<SocketAddr>,
    dial: Dial,
    accepting: usize,
    /// The incarnation of the last handshake accepted (while `accepting`
    /// counts it, the one still to be installed).
    accepting_from: Option<u64>,
    /// The mux asked for a link while an accepted handshake was under way,
    /// or while it still judged the last link, so no dial went: the accept
    /// that ends last without a link dials, or the mux's release of the link.
    wanted: bool,
    last_epoch: Epoch,
    /// The most letting this entry go may raise the node's epoch floor to:
    /// the floor it started from, plus one per epoch installed. The epochs'
    /// values are partly the peer's choice; their count is not.
    floor_claim: Epoch,
    incarnation: Option<u64>,
    /// The source (see [`source_of`]) of the peer's last link accepted, or
    /// of its hello under way while it has no live link; `None` once
    /// registered. A stranger counts against that source's
    /// `max_peers_per_source`.
    source: Option<IpAddr>,
    /// The live link, or the last one until the mux has let go of it (its
    /// verdict then sets the backoff and it is dropped: a dead epoch must
    /// not hold its sockets, QP or registered ring for as long as nobody
    /// sends to the peer).
    current: Option<L>,
    /// How the last link dropped from `current` ended.
    last_end: Option<EpochEnd>,
    backoff: Duration,
    retry_at: Option<Instant>,
    /// Our dials the peer declined `Unavailable` in a row.
    declines: u32,
    /// Our last dial's failure (benign outcomes left out), until an epoch
    /// is installed or the address changes.
    last_failure: Option<DialFailure>,
}

impl<L> Default for PeerState<L> {
    fn default() -> Self {
        PeerState {
            addr: None,
            dial: Dial::Idle,
            accepting: 0,
            accepting_from: None,
            wanted: false,
            last_epoch: Epoch::default(),
            floor_claim: Epoch::default(),
            incarnation: None,
            source: None,
            current: None,
            last_end: None,
            backoff: Duration::ZERO,
            retry_at: None,
            declines: 0,
            last_failure: None,
        }
    }
}

/// The mux has yet to serve a link to its end (see [`Mux::is_judging`]).
struct Judging;

type Peers<E> = HashMap<PeerId, PeerState<<E as EpochMaker>::Link>>;

struct NodeInner<E: EpochMaker> {
    config: ConnectorConfig,
    epochs: E,
    incarnation: u64,
    local_addr: SocketAddr,
    peers: Mutex<Peers<E>>,
    /// The newest epoch of any peer whose entry was let go; changed only
    /// under the `peers` lock. Every entry's epochs start above it, so a
    /// link with a peer that comes back still starts a newer epoch.
    epoch_floor: AtomicU64,
    mux: OnceLock<Mux<E::Link>>,
    counters: Counters,
    refusals: Mutex<Refusals>,
    shutdown: AtomicBool,
    shutdown_notify: Notify,
    handshakes: Arc<Semaphore>,
    /// Handshakes under way per source IP (an entry only while one is).
    pending_by_source: Mutex<HashMap<IpAddr, usize>>,
    /// Where strangers let go of had last dialled in from, kept while the
    /// mux keeps a task or streams of theirs (pruned at each stranger's
    /// hello); locked under the `peers` lock only.
    departed: Mutex<HashMap<PeerId, IpAddr>>,
    /// The sources of registered peers' addresses, with how many peers
    /// each; changed only under the `peers` lock. Connections from them may
    /// take the quarter of the handshakes kept back from other sources.
    registered_sources: Mutex<HashMap<IpAddr, usize>>,
    /// The runtime the node started on. Dials and the shutdown's wait are
    /// spawned here: `want_link` and `shutdown_after` may be called from a
    /// thread outside any runtime (velo's synchronous sends reach them).
    runtime: tokio::runtime::Handle,
}

/// The last refused incoming connection, and a WARN gate per kind: a
/// flood of shed connections does not hide a refused handshake.
#[derive(Debug, Default)]
struct Refusals {
    last: Option<ConnectError>,
    refused: WarnGate,
    shed: WarnGate,
    accept_failed: WarnGate,
    /// Our dials a peer declined as `Unavailable`.
    unavailable: WarnGate,
}

/// The source a handshake's share is counted against: an IPv4 address
/// (also when mapped into IPv6), or an IPv6 address's /64, since one host
/// is usually given a whole /64 and could otherwise be many sources.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        },
    }
}

/// One handshake counted against its source IP until dropped. Entries exist
/// only while counted, and each holds a global handshake permit, so the map
/// never has more than `max_pending_handshakes` entries.
struct SourcePermit<E: EpochMaker> {
    inner: Arc<NodeInner<E>>,
    source: IpAddr,
}

impl<E: EpochMaker> SourcePermit<E> {
    fn take(inner: &Arc<NodeInner<E>>, source: IpAddr) -> Option<SourcePermit<E>> {
        let limit = inner.pending_limit(source);
        let mut pending = inner.pending_by_source.lock().expect("node state poisoned");
        let count = pending.entry(source).or_insert(0);
        if *count >= limit {
            return None;
        }
        *count += 1;
        Some(SourcePermit {
            inner: inner.clone(),
            source,
        })
    }
}

impl<E: EpochMaker> Drop for SourcePermit<E> {
    fn drop(&mut self) {
        let mut pending = self
            .inner
            .pending_by_source
            .lock()
            .expect("node state poisoned");
        if let Some(count) = pending.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                pending.remove(&self.source);
            }
        }
    }
}

impl<E: EpochMaker> NodeInner<E> {
    /// Closes an accepted connection without a word, counted and logged.
    fn shed(&self, err: ConnectError, remote: SocketAddr) {
        bump(&self.counters.handshakes_shed);
        self.refuse(err, remote, true);
    }

    /// Counts and logs a refused incoming connection (`shed`: closed before
    /// its challenge): at WARN at most once per [`WARN_EVERY`](crate::warn_gate::WARN_EVERY) per
    /// kind, so a flood of them cannot flood the log.
    fn refuse(&self, err: ConnectError, remote: SocketAddr, shed: bool) {
        let warn = {
            let mut refusals = self.refusals.lock().expect("node state poisoned");
            refusals.last = Some(err);
            // Counted once the reason is stored: whoever sees the count
            // reads this refusal's reason, not the one before.
            bump(&self.counters.refused);
            let gate = if shed {
                &mut refusals.shed
            } else {
                &mut refusals.refused
            };
            gate.admit(Instant::now())
        };
        let what = if shed {
            "handshake shed; connection closed"
        } else {
            "refused an incoming connection"
        };
        match warn {
            Some(suppressed) => tracing::warn!(%remote, %err, suppressed, "{what}"),
            None => tracing::debug!(%remote, %err, "{what}"),
        }
    }

    /// Whether an event counted by `gate` is logged at WARN now (`Some`:
    /// how many went to DEBUG since the last).
    fn admit(&self, gate: impl FnOnce(&mut Refusals) -> &mut WarnGate) -> Option<u64> {
        let mut refusals = self.refusals.lock().expect("node state poisoned");
        gate(&mut refusals).admit(Instant::now())
    }

    fn registered_sources(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.registered_sources.lock().expect("node state poisoned")
    }

    fn peers(&self) -> MutexGuard<'_, Peers<E>> {
        self.peers.lock().expect("node state poisoned")
    }

    fn live(state: &PeerState<E::Link>) -> bool {
        state
            .current
            .as_ref()
            .is_some_and(|l| E::end_reason(l).is_none())
    }

    /// Keeps a failed dial's verdict (benign outcomes left out) while it is
    /// still about the peer: dialled at the address it has now (a dial to
    /// an old one says nothing of the new), with no link up or being
    /// accepted when the dial ended. A dial that succeeded is answered by its install,
    /// which clears it. True when the kept verdict is permanent: the caller
    /// then tells the mux ([`NodeInner::unreachable`]).
    fn note_failed_dial(
        state: &mut PeerState<E::Link>,
        result: &Result<Epoch, ConnectError>,
        dialed: Option<SocketAddr>,
    ) -> bool {
        let Err(err) = result else {
            return false;
        };
        if err.is_benign()
            || dialed.is_none()
            || state.addr != dialed
            || Self::live(state)
            || state.accepting > 0
        {
            return false;
        }
        state.last_failure = Some(DialFailure {
            error: *err,
            at: std::time::Instant::now(),
        });
        err.is_permanent()
    }

    /// `peer`'s entry, made if there is none. A new entry's epochs start
    /// above the floor of let-go peers', read once here: an epoch agreed
    /// for it stays valid when another peer is let go meanwhile.
    fn entry<'a>(&self, peers: &'a mut Peers<E>, peer: PeerId) -> &'a mut PeerState<E::Link> {
        let floor = Epoch(self.epoch_floor.load(Ordering::Relaxed));
        peers.entry(peer).or_insert_with(|| PeerState {
            last_epoch: floor,
            floor_claim: floor,
            ..PeerState::default()
        })
    }

    /// [`NodeInner::let_go`], telling the mux so (its task for the peer
    /// then retires as soon as it holds nothing), and drops what was let go
    /// after unlocking. The mux hears it under the table's lock, before any
    /// newer link of the peer's is installed, so the word cannot land on
    /// an epoch that began after it.
    fn release(&self, mut peers: MutexGuard<'_, Peers<E>>, peer: PeerId) {
        let entry = self.let_go_told(&mut peers, peer);
        drop(peers);
        drop(entry);
    }

    /// [`NodeInner::let_go`], and the mux told if the peer went.
    fn let_go_told(&self, peers: &mut Peers<E>, peer: PeerId) -> Option<PeerState<E::Link>> {
        let entry = self.let_go(peers, peer);
        if entry.is_some()
            && let Some(mux) = self.mux.get()
        {
            mux.let_go_peer(peer);
        }
        entry
    }

    /// Takes `peer`'s entry out of the table if nothing is left in it: not
    /// registered, no live link, no dial, no handshake under way. Its last
    /// epoch raises the floor, by at most one per epoch it installed: a peer
    /// that proposed an epoch near `u64::MAX` would otherwise lift every
    /// later entry's proposals out of reach. The caller drops what is returned (an ended
    /// link, whose resources may go with it) after unlocking.
    fn let_go(&self, peers: &mut Peers<E>, peer: PeerId) -> Option<PeerState<E::Link>> {
        let state = peers.get(&peer)?;
        if state.addr.is_some()
            || Self::live(state)
            || state.dial != Dial::Idle
            || state.accepting > 0
        {
            return None;
        }
        let claim = state.last_epoch.min(state.floor_claim);
        self.epoch_floor.fetch_max(claim.0, Ordering::Relaxed);
        if let Some(from) = state.source {
            self.departed().insert(peer, from);
        }
        peers.remove(&peer)
    }

    fn departed(&self) -> MutexGuard<'_, HashMap<PeerId, IpAddr>> {
        self.departed.lock().expect("node state poisoned")
    }

    /// Why taking `peer` on would exceed a peer limit, if it would. A peer
    /// already live is never new; others count while live, dialing or
    /// accepting, and a peer gone from the table while the mux still holds
    /// bytes it sent or streams it opened that nobody has bound (so peers
    /// coming and going under fresh ids cannot pile up memory or registry
    /// entries: each counts until what it left is read or bound).
    ///
    /// A registered peer counts against registered peers only: strangers
    /// (and what departed ones left behind) cannot lock the node out of the
    /// peers it chose, and those are bounded by what the application
    /// registers, so the table holds at most twice `max_peers`. A stranger
    /// counts against everyone, and against the strangers that dialled in
    /// from its `source` (`max_peers_per_source`), live or departed with
    /// something left here, so one host cannot take every place.
    fn peer_limit(
        &self,
        peers: &Peers<E>,
        peer: PeerId,
        source: Option<IpAddr>,
    ) -> Option<ConnectError> {
        let state = peers.get(&peer);
        let registered = state.is_some_and(|s| s.addr.is_some());
        let live = state.is_some_and(Self::live);
        // A live stranger's handshake from another source would move its
        // place there: checked against that source, not against the total.
        let moving = live
            && !registered
            && source.is_some_and(|from| state.and_then(|s| s.source) != Some(from));
        if live && !moving {
            return None;
        }
        // The peers the mux keeps (sorted), and whether each holds
        // something: asked for strangers only, whom leftovers count against.
        let kept = match self.mux.get() {
            Some(mux) if !registered => mux.peers_kept(),
            _ => Vec::new(),
        };
        let holding = |id: &PeerId| {
            kept.binary_search_by_key(id, |(kept, _)| *kept)
                .is_ok_and(|at| kept[at].1)
        };
        let mut in_table = 0;
        let mut from_source = 0;
        for (id, s) in peers {
            // A stranger whose ended link the mux has not yet let go may
            // leave something behind meanwhile.
            let held = Self::live(s)
                || s.dial != Dial::Idle
                || s.accepting > 0
                || (s.addr.is_none() && holding(id));
            if *id == peer || !held || (registered && s.addr.is_none()) {
                continue;
            }
            in_table += 1;
            from_source += usize::from(s.addr.is_none() && source.is_some() && s.source == source);
        }
        let gone_holding = |id: &PeerId| *id != peer && !peers.contains_key(id) && holding(id);
        let gone = kept.iter().filter(|(id, _)| gone_holding(id)).count();
        if let Some(from) = source.filter(|_| !registered) {
            // A record goes once the mux keeps nothing of its peer (a task
            // still draining may yet come to hold) or the peer is back in
            // the table; the hello's own peer keeps its record, refused or
            // not.
            let mut departed = self.departed();
            departed.retain(|id, _| {
                !peers.contains_key(id) && kept.binary_search_by_key(id, |(kept, _)| *kept).is_ok()
            });
            from_source += departed
                .iter()
                .filter(|(id, left)| **left == from && gone_holding(id))
                .count();
        }
        let config = &self.config;
        if !live && in_table + gone >= config.max_peers {
            return Some(ConnectError::TooManyPeers {
                limit: config.max_peers,
            });
        }
        let limit = config.max_peers_per_source.max(1);
        match source {
            Some(from) if !registered && from_source >= limit => {
                Some(ConnectError::TooManyPeersFromSource { from, limit })
            }
            _ => None,
        }
    }

    /// Handshakes `source` may have under way: `max_pending_per_source`, or
    /// as many as peers registered there (up to half the pool, so one
    /// source cannot take every handshake), so a host or subnet of
    /// registered peers that all dial at once is not shed.
    fn pending_limit(&self, source: IpAddr) -> usize {
        let registered = self.registered_sources().get(&source).copied().unwrap_or(0);
        let per_source = self.config.max_pending_per_source.max(1);
        per_source.max(registered.min(self.config.max_pending_handshakes.max(1) / 2))
    }

    /// Handshakes kept for connections from registered peers' sources.
    fn handshakes_kept(&self) -> usize {
        self.config.max_pending_handshakes.max(1) / 4
    }

    /// True if `source` is the source of a registered peer's address.
    fn is_registered_source(&self, source: IpAddr) -> bool {
        self.registered_sources().contains_key(&source)
    }

    /// Moves `state`'s address to `addr`, keeping `registered_sources`
    /// counted. Called under the `peers` lock.
    fn readdress(&self, state: &mut PeerState<E::Link>, addr: Option<SocketAddr>) {
        let old = std::mem::replace(&mut state.addr, addr);
        if old != addr {
            // Failures at the old address say nothing about the new one:
            // neither their verdict nor their backoff carries over.
            state.last_failure = None;
            state.backoff = Duration::ZERO;
            state.retry_at = None;
        }
        if addr.is_some() {
            // A registered peer counts against no source.
            state.source = None;
        }
        let mut sources = self.registered_sources();
        if let Some(old) = old {
            let from = source_of(old.ip());
            debug_assert!(sources.contains_key(&from), "a registered source uncounted");
            if let Some(count) = sources.get_mut(&from) {
                *count -= 1;
                if *count == 0 {
                    sources.remove(&from);
                }
            }
        }
        if let Some(new) = addr {
            *sources.entry(source_of(new.ip())).or_insert(0) += 1;
        }
    }

    /// A dial to `peer` failed in a way no redial mends: the mux ends the
    /// slots waiting for a link to it. Called with no table lock held, as
    /// `forget` calls the mux (the mux's tasks call the dialer, which takes
    /// that lock).
    fn unreachable(&self, peer: PeerId) {
        if let Some(mux) = self.mux.get() {
            mux.peer_unreachable(peer);
        }
    }

    /// One more failed attempt: the wait doubles, within the configured
    /// bounds, and up to half of it more at random, so dialers shed or
    /// refused together do not come back in step.
    fn back_off(&self, state: &mut PeerState<E::Link>) {
        let config = &self.config;
        state.backoff = (state.backoff * 2).clamp(config.backoff_min, config.backoff_max);
        let jitter = state.backoff.mul_f64(rand::random::<f64>() / 2.0);
        state.retry_at = Some(Instant::now() + state.backoff + jitter);
    }

    /// The mux wants a link to `peer`: marks a dial started and returns when
    /// it may connect (`None`: at once), for the caller to spawn once the
    /// table lock is released. No dial while a link is live or one is under
    /// way; while an accepted handshake is, the ask is kept for its end, and
    /// while the mux still judges the last link, for its release.
    fn dial_for(&self, peer: PeerId, state: &mut PeerState<E::Link>) -> Option<Option<Instant>> {
        if state.dial != Dial::Idle && !Self::live(state) {
            // An ask kept for an accept under way stays kept (review 48c:
            // cleared here, a failed accept left nobody to dial): our dial
            // under way answers this one, or the kept ask does.
            return None;
        }
        state.wanted = false;
        if self.shutdown.load(Ordering::Acquire) || Self::live(state) || state.addr.is_none() {
            return None;
        }
        if state.accepting > 0 {
            state.wanted = true;
            return None;
        }
        match self.settle_ended(peer, state) {
            // The mux has yet to read what the epoch carried, and its
            // verdict sets the wait: its release of the link asks again.
            Err(Judging) => {
                state.wanted = true;
                return None;
            }
            Ok(previous) => drop(previous),
        }
        let wait = state.retry_at.filter(|at| *at > Instant::now());
        state.dial = if wait.is_some() {
            Dial::Waiting
        } else {
            Dial::Connecting
        };
        Some(wait)
    }

    /// Takes the ended link out of `state.current`, its verdict set in the
    /// backoff, for the caller to drop (after unlocking, where it can);
    /// `Err` while the mux still judges it: its release comes later.
    fn settle_ended(
        &self,
        peer: PeerId,
        state: &mut PeerState<E::Link>,
    ) -> Result<Option<E::Link>, Judging> {
        let Some(previous) = state.current.take_if(|link| E::end_reason(link).is_some()) else {
            return Ok(None);
        };
        if (self.mux.get()).is_some_and(|mux| mux.is_judging(peer, previous.epoch())) {
            state.current = Some(previous);
            return Err(Judging);
        }
        let end = E::end_reason(&previous);
        let violated = match &end {
            Some(EpochEnd::Violation(_)) => true,
            Some(EpochEnd::Fault(fault)) => fault.blames_peer(),
            _ => false,
        } || self
            .mux
            .get()
            .is_some_and(|mux| mux.ended_in_violation(peer, previous.epoch()));
        if E::carried_traffic(&previous) && !violated {
            // The path worked: this is a fresh failure, redial at once.
            state.backoff = Duration::ZERO;
            state.retry_at = None;
        } else {
            // Up and dead before a batch, or the peer broke the protocol
            // or left its receives unposted (it would again): a failed
            // attempt like a failed dial.
            self.back_off(state);
        }
        state.last_end = end;
        Ok(Some(previous))
    }

    /// Our hello to `peer`; its `peer_credit` is what the epoch's install
    /// must tell the mux it granted.
    fn hello(&self, peer: PeerId, proposed: Epoch, endpoint: Endpoint) -> HelloFields {
        // Without a mux the handshake ends in a decline or `NotServing`.
        let default = MuxConfig::default();
        let mux = self.mux.get();
        let config = mux.map_or(&default, |mux| mux.config());
        HelloFields {
            node: self.config.id,
            incarnation: self.incarnation,
            proposed,
            endpoint,
            slot_window: config.slot_window,
            peer_window: config.peer_window,
            peer_credit: mux.map_or(config.peer_window, |mux| mux.peer_room(peer)),
            max_record: PeerTerms::announced_by(config).max_record,
            max_slots: config.max_slots_per_peer,
        }
    }
}

/// A connection manager: a listener, a peer table and a mux [`Dialer`],
/// with epochs made by `E`. Cheap to clone.
pub struct Connector<E: EpochMaker> {
    inner: Arc<NodeInner<E>>,
}

impl<E: EpochMaker> Clone for Connector<E> {
    fn clone(&self) -> Self {
        Connector {
            inner: self.inner.clone(),
        }
    }
}

/// A node of the TCP transport: a listener, a peer table and a mux [`Dialer`].
/// Cheap to clone.
pub type TcpNode = Connector<TcpEpochs>;

impl Connector<TcpEpochs> {
    /// Binds the listener on `addr` (port 0 picks one) and starts accepting.
    /// Connections are declined until [`Connector::set_mux`] is called.
    pub async fn bind(config: TcpNodeConfig, addr: SocketAddr) -> io::Result<TcpNode> {
        let (config, mut link) = config.split();
        // What we advertise must pass the peer's validation.
        link.max_batch = link.max_batch.clamp(
            TcpEndpoint::MIN_BATCH as usize,
            TcpEndpoint::MAX_BATCH as usize,
        );
        Connector::bind_with(config, TcpEpochs { link }, addr).await
    }

    /// Binds a node and creates its mux, wired both ways. Fails with
    /// `InvalidInput` on a mux configuration [`MuxConfig::check`] refuses
    /// ([`MuxConfig::check`]).
    pub async fn start(
        config: TcpNodeConfig,
        addr: SocketAddr,
        mux_config: MuxConfig,
    ) -> io::Result<(TcpNode, Mux<TcpLink>)> {
        mux_config
            .check()
            .map_err(|err| io::Error::new(io::ErrorKind::InvalidInput, err))?;
        let node = TcpNode::bind(config, addr).await?;
        let mux = Mux::new(mux_config, node.dialer());
        node.set_mux(mux.clone());
        Ok((node, mux))
    }
}

impl<E: EpochMaker> Connector<E> {
    /// Binds the listener on `addr` (port 0 picks one) with epochs made by
    /// `epochs`, and starts accepting. Connections are declined until
    /// [`Connector::set_mux`] is called. Fails with `InvalidInput` on
    /// backoff bounds out of order, from zero, or past [`MAX_BACKOFF`].
    pub async fn bind_with(
        config: ConnectorConfig,
        epochs: E,
        addr: SocketAddr,
    ) -> io::Result<Connector<E>> {
        config.check()?;
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        socket.set_reuse_address(true)?;
        socket.set_nonblocking(true)?;
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        let listener = TcpListener::from_std(socket.into())?;
        let local_addr = listener.local_addr()?;
        let max_pending = config.max_pending_handshakes.max(1);
        let inner = Arc::new(NodeInner {
            config,
            epochs,
            incarnation: rand::random(),
            local_addr,
            peers: Mutex::new(HashMap::new()),
            epoch_floor: AtomicU64::new(0),
            mux: OnceLock::new(),
            counters: Counters::default(),
            refusals: Mutex::default(),
            shutdown: AtomicBool::new(false),
            shutdown_notify: Notify::new(),
            handshakes: Arc::new(Semaphore::new(max_pending)),
            pending_by_source: Mutex::new(HashMap::new()),
            registered_sources: Mutex::new(HashMap::new()),
            departed: Mutex::new(HashMap::new()),
            runtime: tokio::runtime::Handle::current(),
        });
        tokio::spawn(accept_loop(inner.clone(), listener));
        Ok(Connector { inner })
    }

    /// The epoch maker this connector runs with.
    pub fn epochs(&self) -> &E {
        &self.inner.epochs
    }

    /// The dialer to give this node's mux (holds the node weakly).
    pub fn dialer(&self) -> Arc<dyn Dialer> {
        Arc::new(NodeDialer {
            node: Arc::downgrade(&self.inner),
        })
    }

    /// Sets the mux new links are attached to. Returns false if one was set already.
    pub fn set_mux(&self, mux: Mux<E::Link>) -> bool {
        self.inner.mux.set(mux).is_ok()
    }

    /// This node's id.
    pub fn id(&self) -> PeerId {
        self.inner.config.id
    }

    /// This process's incarnation of the node (random per start).
    pub fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// Tells the node where `peer` listens.
    pub fn register(&self, peer: PeerId, addr: SocketAddr) {
        let mut peers = self.inner.peers();
        let state = self.inner.entry(&mut peers, peer);
        self.inner.readdress(state, Some(addr));
    }

    /// The current link to `peer`, if any: a test hook to fail it. An ended
    /// one is kept only until the mux has let go of it.
    pub fn link(&self, peer: PeerId) -> Option<E::Link> {
        self.inner.peers().get(&peer)?.current.clone()
    }

    /// How `peer`'s current link ended, or else the last one the node let
    /// go of; `None` while it is live or before its first link.
    pub fn link_end(&self, peer: PeerId) -> Option<EpochEnd> {
        let peers = self.inner.peers();
        let state = peers.get(&peer)?;
        match &state.current {
            Some(link) => E::end_reason(link),
            None => state.last_end,
        }
    }

    /// The address blob peers need to reach this node ([`crate::link::address`]).
    pub fn address_blob(&self) -> Vec<u8> {
        crate::link::address::encode(self.id(), self.local_addr())
    }

    /// Registers the node a blob names; what a transport's `Node::register` does.
    pub fn register_blob(&self, blob: &[u8]) -> Result<PeerId, crate::link::RegisterError> {
        let (peer, addr) = crate::link::address::decode(blob)?;
        if peer == self.id() {
            return Err(crate::link::RegisterError::Own);
        }
        self.register(peer, addr);
        Ok(peer)
    }

    /// Forgets `peer` (what a transport's `Node::unregister` does): ends its
    /// current link and lets go of it, so the link's resources (a QP, its
    /// receive ring) go once the mux has too, and drops its address, so
    /// nothing dials it again until it is registered again. Its entry goes
    /// once no dial or handshake for it is under way; a later link with it
    /// still starts a newer epoch (the table keeps the newest epoch of any
    /// peer it let go), but a restart of the peer meanwhile is not counted.
    /// The mux's slots opened before this and still waiting for a link to
    /// it end with `Dropped(Unregistered)` ([`Mux::forget_peer`]).
    pub fn forget(&self, peer: PeerId) {
        let (link, entry) = {
            let mut peers = self.inner.peers();
            let link = peers.get_mut(&peer).and_then(|state| {
                self.inner.readdress(state, None);
                state.backoff = Duration::ZERO;
                state.retry_at = None;
                state.wanted = false;
                state.declines = 0;
                state.current.take()
            });
            (link, self.inner.let_go_told(&mut peers, peer))
        };
        if let Some(link) = link {
            link.fail(EpochEnd::Closed);
        }
        drop(entry);
        if let Some(mux) = self.inner.mux.get() {
            mux.forget_peer(peer);
        }
    }

    /// Ends the current link to `peer` gracefully, if there is one.
    pub fn close_link(&self, peer: PeerId) {
        if let Some(link) = self.link(peer) {
            link.fail(EpochEnd::Closed);
        }
    }

    /// Shuts `mux` down first (it drains and says goodbye on the live links),
    /// then this connector once the mux has closed. Does not wait.
    pub fn shutdown_after(&self, mux: &Mux<E::Link>) {
        mux.shutdown();
        let (node, mux) = (self.clone(), mux.clone());
        self.inner.runtime.spawn(async move {
            mux.closed().await;
            node.shutdown();
        });
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> NodeStats {
        let c = &self.inner.counters;
        NodeStats {
            established: c.established.load(Ordering::Relaxed),
            refused: c.refused.load(Ordering::Relaxed),
            dial_failures: c.dial_failures.load(Ordering::Relaxed),
            declined: c.declined.load(Ordering::Relaxed),
            restarts_seen: c.restarts_seen.load(Ordering::Relaxed),
            peer_limit_refusals: c.peer_limit_refusals.load(Ordering::Relaxed),
            handshakes_shed: c.handshakes_shed.load(Ordering::Relaxed),
            withdrawn: c.withdrawn.load(Ordering::Relaxed),
            peers_known: self.inner.peers().len() as u64,
        }
    }

    /// How long the next dial to `peer` waits after a failure: zero until an
    /// attempt fails, doubled by each failed dial and each epoch that ended
    /// without carrying a batch, zero again once an epoch carried one (the
    /// wait itself adds up to half of it at random).
    pub fn backoff(&self, peer: PeerId) -> Duration {
        self.inner
            .peers()
            .get(&peer)
            .map_or(Duration::ZERO, |state| state.backoff)
    }

    /// Why the last refused incoming connection was refused.
    pub fn last_refusal(&self) -> Option<ConnectError> {
        self.inner
            .refusals
            .lock()
            .expect("node state poisoned")
            .last
    }

    /// Why the node's last dial to `peer` failed (its mux's or
    /// [`Connector::connect`]'s), until an epoch with the peer is installed
    /// (dialed or accepted) or its address changes (benign outcomes such as
    /// a crossed dial left out), e.g. the peer declining it for another
    /// transport. The mux's dials run in the background, so this is where a
    /// caller waiting on a peer learns why no link comes.
    pub fn last_dial_failure(&self, peer: PeerId) -> Option<DialFailure> {
        self.inner
            .peers()
            .get(&peer)
            .and_then(|state| state.last_failure)
    }

    /// Dials `peer` now (ignoring backoff) and installs the link. While it
    /// runs, the peer's crossing dials are settled as for mux-driven dials.
    /// Its failure is kept for the peer ([`Connector::last_dial_failure`])
    /// as a mux-driven dial's is, and a permanent one ends the mux's slots
    /// waiting for a link to the peer ([`crate::mux::Mux::peer_unreachable`]);
    /// it is not counted in `dial_failures` (a decline is, in `declined`)
    /// and starts no backoff.
    pub async fn connect(&self, peer: PeerId) -> Result<Epoch, ConnectError> {
        let owned = {
            let mut peers = self.inner.peers();
            let state = self.inner.entry(&mut peers, peer);
            let idle = state.dial == Dial::Idle;
            if idle {
                state.dial = Dial::Connecting;
            }
            idle
        };
        let mut dialed = None;
        let result = dial_once(&self.inner, peer, &mut dialed).await;
        let mut peers = self.inner.peers();
        let mut permanent = false;
        if let Some(state) = peers.get_mut(&peer) {
            if owned {
                state.dial = Dial::Idle;
            }
            permanent = NodeInner::<E>::note_failed_dial(state, &result, dialed);
        }
        if owned {
            // A peer connected without being registered leaves with its link.
            self.inner.release(peers, peer);
        } else {
            drop(peers);
        }
        if permanent {
            self.inner.unreachable(peer);
        }
        if let Err(ConnectError::DeclinedByPeer(_)) = result {
            bump(&self.inner.counters.declined);
        }
        result
    }

    /// Stops the listener and ends every link with [`EpochEnd::Shutdown`].
    /// Does not shut the mux down.
    pub fn shutdown(&self) {
        self.inner.shutdown.store(true, Ordering::Release);
        self.inner.shutdown_notify.notify_waiters();
        let links: Vec<E::Link> = self
            .inner
            .peers()
            .values_mut()
            .filter_map(|p| p.current.take())
            .collect();
        for link in links {
            link.fail(EpochEnd::Shutdown);
        }
    }
}

struct NodeDialer<E: EpochMaker> {
    node: Weak<NodeInner<E>>,
}

impl<E: EpochMaker> Dialer for NodeDialer<E> {
    fn want_link(&self, peer: PeerId) {
        let Some(inner) = self.node.upgrade() else {
            return;
        };
        let mut peers = inner.peers();
        let Some(state) = peers.get_mut(&peer) else {
            tracing::debug!(?peer, "mux wants a link to an unregistered peer");
            return;
        };
        let dial = inner.dial_for(peer, state);
        drop(peers);
        if let Some(wait) = dial {
            inner.runtime.spawn(dial_task(inner.clone(), peer, wait));
        }
    }

    fn link_released(&self, peer: PeerId) {
        let Some(inner) = self.node.upgrade() else {
            return;
        };
        let mut peers = inner.peers();
        // An ask that came while the mux was still judging the link is
        // answered now, with its verdict; without one the verdict is kept
        // for the next ask and the link dropped.
        let (dial, ended) = match peers.get_mut(&peer) {
            Some(state) => {
                // Settled first: an ask that finds a dial under way dials
                // nothing, and the link must not wait for the next ask.
                let ended = inner.settle_ended(peer, state).ok().flatten();
                let dial = (state.wanted && !NodeInner::<E>::live(state))
                    .then(|| inner.dial_for(peer, state))
                    .flatten();
                (dial, ended)
            }
            None => (None, None),
        };
        // A peer that only dialled in is let go with its last link; one
        // registered here stays until it is unregistered.
        inner.release(peers, peer);
        drop(ended);
        if let Some(wait) = dial {
            inner.runtime.spawn(dial_task(inner.clone(), peer, wait));
        }
    }
}

async fn dial_task<E: EpochMaker>(inner: Arc<NodeInner<E>>, peer: PeerId, wait: Option<Instant>) {
    if let Some(at) = wait {
        let shutdown = inner.shutdown_notify.notified();
        tokio::pin!(shutdown);
        shutdown.as_mut().enable();
        if !inner.shutdown.load(Ordering::Acquire) {
            tokio::select! {
                () = sleep_until(at) => {}
                () = shutdown => {}
            }
        }
        let mut peers = inner.peers();
        let state = inner.entry(&mut peers, peer);
        if inner.shutdown.load(Ordering::Acquire) {
            // Not a failed dial: the node stopped while this one waited,
            // and the task lets go of the node now, not after the backoff.
            state.dial = Dial::Idle;
            inner.release(peers, peer);
            return;
        }
        if NodeInner::<E>::live(state) || state.accepting > 0 {
            // The peer's dial got (or is getting) there first: replacing its
            // link would end a working epoch. The mux asks again if it dies;
            // an accept that ends without a link dials in our place.
            state.wanted = state.accepting > 0 && !NodeInner::<E>::live(state);
            state.dial = Dial::Idle;
            return;
        }
        if state.addr.is_none() {
            // Forgotten while waiting.
            state.dial = Dial::Idle;
            inner.release(peers, peer);
            return;
        }
        state.dial = Dial::Connecting;
    }
    let mut dialed = None;
    let result = dial_once(&inner, peer, &mut dialed).await;
    let mut peers = inner.peers();
    let state = inner.entry(&mut peers, peer);
    state.dial = Dial::Idle;
    if result.is_err() && state.addr.is_none() {
        // Forgotten mid-dial: nothing to back off from or warn about.
        tracing::debug!(?peer, "dial to a forgotten peer abandoned");
        inner.release(peers, peer);
        return;
    }
    if !matches!(
        result,
        Err(ConnectError::DeclinedByPeer(DeclineReason::Unavailable))
    ) {
        state.declines = 0;
    }
    // Kept (where still about the peer) before anything is counted: whoever
    // sees a count reads this dial's outcome.
    let permanent = NodeInner::<E>::note_failed_dial(state, &result, dialed);
    if let Err(ConnectError::DeclinedByPeer(_)) = result {
        bump(&inner.counters.declined);
    }
    match result {
        Ok(epoch) => tracing::debug!(?peer, %epoch, "dialed"),
        Err(err) if err.is_benign() => {
            let mut warned = false;
            if let ConnectError::DeclinedByPeer(reason) = err {
                if reason == DeclineReason::Unavailable {
                    // Not a fault, but asking again at once would spin
                    // (shutting down, no mux, at one of its limits, or no
                    // resources for us). A peer that keeps refusing us is
                    // likely at a limit an operator may need to see (one
                    // decline is often a race).
                    inner.back_off(state);
                    state.declines = state.declines.saturating_add(1);
                    let warn = (state.declines >= DECLINES_WORTH_A_WARNING)
                        .then(|| inner.admit(|gates| &mut gates.unavailable));
                    if let Some(Some(suppressed)) = warn {
                        warned = true;
                        tracing::warn!(
                            ?peer,
                            suppressed,
                            backoff = ?state.backoff,
                            declines = state.declines,
                            "the peer keeps declining our dials as unavailable (shutting down, at \
                             a peer limit, or out of resources for us); retrying"
                        );
                    }
                }
            }
            if !warned {
                tracing::debug!(?peer, %err, "dial settled elsewhere");
            }
        }
        Err(err) if dialed.is_some() && state.addr != dialed => {
            // Dialled at an address since replaced: the new one owes nothing.
            bump(&inner.counters.dial_failures);
            tracing::debug!(?peer, %err, "a dial to a replaced address failed");
        }
        Err(err) => {
            bump(&inner.counters.dial_failures);
            inner.back_off(state);
            tracing::warn!(?peer, %err, backoff = ?state.backoff, "dial failed");
        }
    }
    // Forgotten after the install, its link already released: nothing else
    // would let it go.
    inner.release(peers, peer);
    if permanent {
        inner.unreachable(peer);
    }
}

/// One dial to `peer`'s registered address, set in `dialed` once read.
async fn dial_once<E: EpochMaker>(
    inner: &Arc<NodeInner<E>>,
    peer: PeerId,
    dialed: &mut Option<SocketAddr>,
) -> Result<Epoch, ConnectError> {
    if inner.shutdown.load(Ordering::Acquire) {
        return Err(ConnectError::NotServing);
    }
    let (addr, proposed) = {
        let peers = inner.peers();
        let state = peers.get(&peer).ok_or(ConnectError::UnknownPeer(peer))?;
        let addr = state.addr.ok_or(ConnectError::UnknownPeer(peer))?;
        *dialed = Some(addr);
        if let Some(refusal) = inner.peer_limit(&peers, peer, None) {
            bump(&inner.counters.peer_limit_refusals);
            return Err(refusal);
        }
        (addr, state.last_epoch)
    };
    // The credit our hello gives the peer, for the mux at install.
    let mut granted = 0;
    let attempt = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        // The dialer's hello carries its endpoint, so its resources come first.
        let (prepared, endpoint) = inner.epochs.prepare(true)?;
        let hello = inner.hello(peer, proposed, endpoint);
        granted = hello.peer_credit;
        let mut hs = Handshake::dialer(inner.config.key.clone(), hello, Some(peer), fresh_nonce());
        let mut prepared = Some(prepared);
        let mut armed = None;
        let (established, prefix) = drive(
            &mut stream,
            &mut hs,
            |_| None,
            |established| {
                // The last moment to give up: after the ready the listener
                // installs and may send, and a link we then refused would
                // drop what it sent. An accept from the same peer under way
                // here, or a newer epoch installed, would supersede this one
                // (docs/design.md § "A closed link delivers both ways").
                {
                    let mut peers = inner.peers();
                    let state = peers.get_mut(&peer).filter(|state| state.addr.is_some());
                    let state = state.ok_or(ConnectError::UnknownPeer(peer))?;
                    if state.accepting > 0 || established.epoch <= state.last_epoch {
                        // An accept that ends without a link dials in our place.
                        state.wanted |= state.accepting > 0;
                        return Err(ConnectError::Superseded(state.last_epoch));
                    }
                }
                let prepared = prepared.take().ok_or(BootstrapError::OutOfOrder)?;
                armed = Some(inner.epochs.arm(
                    prepared,
                    &established.peer.endpoint,
                    established.epoch,
                )?);
                Ok(())
            },
        )
        .await?;
        let armed = armed.ok_or(BootstrapError::OutOfOrder)?;
        Ok::<_, ConnectError>((stream, established, prefix, armed))
    };
    let (stream, established, prefix, armed) = timeout(inner.config.handshake_timeout, attempt)
        .await
        .map_err(|_| ConnectError::Timeout)??;
    debug_assert_eq!(
        established.peer.node, peer,
        "the dialer's handshake checks it"
    );
    install(
        inner,
        Side::Dialed,
        established,
        armed,
        stream,
        prefix,
        granted,
    )
}

/// Runs `hs` over `stream` to the end. `on_hello` answers a listener's
/// `PeerHello`: `Some(Ok(hello))` responds, `Some(Err(reason))` declines.
/// `on_established` runs when the handshake is established and before any
/// output it queued (the dialer's ready) is written.
/// Returns the result and the bytes read past the handshake.
async fn drive(
    stream: &mut TcpStream,
    hs: &mut Handshake,
    mut on_hello: impl FnMut(&HelloFields) -> Option<Result<HelloFields, DeclineReason>>,
    mut on_established: impl FnMut(&Established) -> Result<(), ConnectError>,
) -> Result<(Established, Vec<u8>), ConnectError> {
    let mut pending = Vec::new();
    let mut buf = [0u8; 4096];
    let mut declined = None;
    loop {
        // Events first: an `Established` must be acted on before the bytes
        // queued with it (the dialer's ready) leave.
        match hs.poll_event() {
            Some(Event::PeerHello(hello)) => {
                match on_hello(&hello) {
                    Some(Ok(local)) => hs.respond(local)?,
                    Some(Err(reason)) => {
                        hs.decline(reason)?;
                        declined = Some(reason);
                    }
                    None => return Err(BootstrapError::OutOfOrder.into()),
                }
                continue;
            }
            Some(Event::Established(established)) => {
                on_established(&established)?;
                if let Some(out) = hs.poll_transmit() {
                    stream.write_all(&out).await?;
                }
                return Ok((established, pending));
            }
            Some(Event::Declined(reason)) => return Err(ConnectError::DeclinedByPeer(reason)),
            None => {}
        }
        if let Some(out) = hs.poll_transmit() {
            stream.write_all(&out).await?;
        }
        if hs.is_finished() {
            return Err(match declined {
                Some(reason) => ConnectError::DeclinedLocally(reason),
                None => ConnectError::Handshake(BootstrapError::AlreadyFailed),
            });
        }
        if hs.wants_input() && !pending.is_empty() {
            let used = match hs.handle_input(&pending) {
                Ok(used) => used,
                Err(err) => {
                    // A refusal the peer may hear (a decline) goes out first;
                    // the connection closes either way.
                    if let Some(out) = hs.poll_transmit() {
                        let _ = stream.write_all(&out).await;
                    }
                    return Err(err.into());
                }
            };
            pending.drain(..used);
            continue;
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(hs.handle_eof().into());
        }
        pending.extend_from_slice(&buf[..n]);
    }
}

/// Which end of the bootstrap connection this node was; an accepting end
/// carries its handshake's count, for the install to settle, and the
/// connection's source.
enum Side<'a> {
    Dialed,
    Accepted {
        counted: &'a mut bool,
        source: IpAddr,
    },
}

/// Installs an established epoch: a new link, attached to the mux.
fn install<E: EpochMaker>(
    inner: &NodeInner<E>,
    side: Side<'_>,
    established: Established,
    armed: E::Armed,
    stream: TcpStream,
    prefix: Vec<u8>,
    granted: u32,
) -> Result<Epoch, ConnectError> {
    let peer = established.peer.node;
    let mux = inner.mux.get().ok_or(ConnectError::NotServing)?;
    let mut peers = inner.peers();
    if inner.shutdown.load(Ordering::Acquire) {
        return Err(ConnectError::NotServing);
    }
    if let Side::Accepted { source, .. } = &side
        && peers
            .get(&peer)
            .is_some_and(|s| s.addr.is_none() && s.source != Some(*source))
        && let Some(refusal) = inner.peer_limit(&peers, peer, Some(*source))
    {
        // A stranger moving to another source (its hello left a live
        // peer's count where it was) was checked at its hello, but moves
        // under way at once were not counted against one another: checked
        // again here, under the lock installs take in turn. Nothing was
        // read from the link yet, and the peer hears its death.
        bump(&inner.counters.peer_limit_refusals);
        return Err(refusal);
    }
    let terms = PeerTerms {
        slot_window: established.peer.slot_window,
        peer_window: established.peer.peer_window,
        peer_credit: established.peer.peer_credit,
        max_record: established.peer.max_record,
        max_slots: established.peer.max_slots,
    };
    let state = match side {
        Side::Accepted { .. } => inner.entry(&mut peers, peer),
        Side::Dialed => match peers.get_mut(&peer) {
            Some(state) if state.addr.is_some() => state,
            // Forgotten while the dial was under way (no address, or no
            // entry), but our ready has left and the peer may send on the
            // link: it is closed and read out, not dropped with what the
            // peer sent (docs/design.md § "A closed link delivers both ways").
            forgotten => {
                // Ours to propose above when the peer is registered again.
                if let Some(state) = forgotten {
                    state.last_epoch = state.last_epoch.max(established.epoch);
                }
                let owner = ReadOutOwner {
                    peer,
                    registered: false,
                    source: None,
                };
                let link = inner
                    .epochs
                    .finish(armed, stream, prefix, established.epoch, owner)?;
                link.fail(EpochEnd::Closed);
                mux.read_out_with_terms(peer, link, terms, granted);
                return Err(ConnectError::UnknownPeer(peer));
            }
        },
    };
    if established.epoch <= state.last_epoch {
        return Err(ConnectError::Superseded(state.last_epoch));
    }
    // The source of the link being installed: a hello alone does not move
    // a live peer's, or one host could shift its peers' count onto another.
    let source = match &side {
        Side::Accepted { source, .. } => Some(*source),
        Side::Dialed => state.source,
    };
    // A stranger counts, and its read-outs, against the source it dialled
    // in from; a registered peer has none.
    let source = source.filter(|_| state.addr.is_none());
    let owner = ReadOutOwner {
        peer,
        registered: state.addr.is_some(),
        source,
    };
    let link = inner
        .epochs
        .finish(armed, stream, prefix, established.epoch, owner)?;
    state.source = source;
    let incarnation = established.peer.incarnation;
    let restarted = state.incarnation.is_some_and(|known| known != incarnation);
    if restarted {
        bump(&inner.counters.restarts_seen);
        tracing::info!(?peer, "peer restarted (new incarnation)");
    }
    state.incarnation = Some(incarnation);
    state.last_epoch = established.epoch;
    state.floor_claim = Epoch(state.floor_claim.0.saturating_add(1));
    if let Some(old) = state.current.replace(link.clone()) {
        // The same process moved on: it closes the old link after its flush,
        // and what it sent there is read out. A restarted one's old link
        // has nobody behind it: cut now.
        old.fail(if restarted {
            EpochEnd::PeerLost
        } else {
            EpochEnd::Replaced
        });
    }
    state.wanted = false;
    state.declines = 0;
    // Any epoch, dialed or accepted, answers the last failed dial.
    state.last_failure = None;
    if let Side::Accepted { counted, .. } = side {
        // Settled with the install: a mux asking for a link once this one
        // dies must not find the handshake still under way and be ignored.
        state.accepting = state.accepting.saturating_sub(1);
        *counted = false;
    }
    bump(&inner.counters.established);
    // Under the table lock, so two installs for one peer attach in epoch order.
    mux.attach_with_terms(peer, link, terms, granted);
    Ok(established.epoch)
}

async fn accept_loop<E: EpochMaker>(inner: Arc<NodeInner<E>>, listener: TcpListener) {
    loop {
        let shutdown = inner.shutdown_notify.notified();
        tokio::pin!(shutdown);
        shutdown.as_mut().enable();
        if inner.shutdown.load(Ordering::Acquire) {
            return;
        }
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => return,
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Per-connection failures (aborted, fd limits): keep serving,
                // and warn at most once per gate period.
                match inner.admit(|gates| &mut gates.accept_failed) {
                    Some(suppressed) => tracing::warn!(%err, suppressed, "accept failed"),
                    None => tracing::debug!(%err, "accept failed"),
                }
                // Out of descriptors would fail again at once: do not spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let from = source_of(remote.ip());
        // The last quarter of the pool is kept for registered peers'
        // sources: strangers' silent dialers cannot shut them out. Permits
        // are taken only here, so the count cannot fall between the look
        // and the take.
        let kept = inner.handshakes_kept();
        let strangers_full =
            inner.handshakes.available_permits() <= kept && !inner.is_registered_source(from);
        let permit = match inner.handshakes.clone().try_acquire_owned() {
            Ok(permit) if !strangers_full => permit,
            _ => {
                let limit = inner.config.max_pending_handshakes.max(1);
                let limit = if strangers_full { limit - kept } else { limit };
                inner.shed(ConnectError::TooManyHandshakes { limit }, remote);
                continue;
            }
        };
        let Some(source) = SourcePermit::take(&inner, from) else {
            let limit = inner.pending_limit(from);
            inner.shed(
                ConnectError::TooManyHandshakesFromSource { from, limit },
                remote,
            );
            continue;
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            let handshake = accept_once(&inner, stream, from);
            let result = timeout(inner.config.handshake_timeout, handshake)
                .await
                .unwrap_or(Err(ConnectError::Timeout));
            drop(source);
            drop(permit);
            match result {
                Ok(epoch) => tracing::debug!(%remote, %epoch, "accepted"),
                Err(err) if err.is_benign() => tracing::debug!(%remote, %err, "declined"),
                Err(err) => inner.refuse(err, remote, false),
            }
        });
    }
}

/// Decrements the peer's `accepting` count when an accepted handshake ends
/// without an install (an install settles it under the table lock itself,
/// so no one sees the link installed and the handshake still under way),
/// and dials if the mux asked for a link meanwhile and this was the last.
struct Accepting<'a, E: EpochMaker> {
    inner: &'a Arc<NodeInner<E>>,
    peer: Option<PeerId>,
    counted: bool,
}

impl<E: EpochMaker> Drop for Accepting<'_, E> {
    fn drop(&mut self) {
        if let Some(peer) = self.peer {
            let mut peers = self.inner.peers();
            let mut dial = None;
            if let Some(state) = peers.get_mut(&peer)
                && self.counted
            {
                state.accepting = state.accepting.saturating_sub(1);
                if state.wanted && state.accepting == 0 {
                    dial = self.inner.dial_for(peer, state);
                }
            }
            self.inner.release(peers, peer);
            if let Some(wait) = dial {
                let dial = dial_task(self.inner.clone(), peer, wait);
                self.inner.runtime.spawn(dial);
            }
        }
    }
}

async fn accept_once<E: EpochMaker>(
    inner: &Arc<NodeInner<E>>,
    mut stream: TcpStream,
    source: IpAddr,
) -> Result<Epoch, ConnectError> {
    stream.set_nodelay(true)?;
    let mut hs = Handshake::listener(
        inner.config.key.clone(),
        inner.config.id,
        inner.epochs.kind(),
        fresh_nonce(),
    );
    let mut guard = Accepting {
        inner,
        peer: None,
        counted: false,
    };
    let mut armed = None;
    let mut local_failure = None;
    let mut granted = 0;
    let result = drive(
        &mut stream,
        &mut hs,
        |hello| {
            let (proposed, registered) = match decide(inner, hello, source) {
                Ok(decided) => decided,
                Err((reason, refusal)) => {
                    local_failure = refusal;
                    return Some(Err(reason));
                }
            };
            guard.peer = Some(hello.node);
            guard.counted = true;
            // Only now, for an authenticated and wanted dialer, are resources
            // made, and connected (RDMA: RTR) before we answer.
            let made = inner.epochs.accepts(&hello.endpoint).and_then(|()| {
                let epoch = agreed_epoch(hello.proposed, proposed)?;
                let (prepared, endpoint) = inner.epochs.prepare(registered)?;
                let a = inner.epochs.arm(prepared, &hello.endpoint, epoch)?;
                Ok((a, endpoint))
            });
            match made {
                Ok((a, endpoint)) => {
                    armed = Some(a);
                    let ours = inner.hello(hello.node, proposed, endpoint);
                    granted = ours.peer_credit;
                    Some(Ok(ours))
                }
                Err(err) => {
                    local_failure = Some(err);
                    Some(Err(match err {
                        ConnectError::Incompatible(_) => DeclineReason::Incompatible,
                        _ => DeclineReason::Unavailable,
                    }))
                }
            }
        },
        |_| Ok(()),
    )
    .await;
    let (established, prefix) = match result {
        Ok(done) => done,
        Err(ConnectError::DeclinedLocally(_)) if local_failure.is_some() => {
            return Err(local_failure.expect("checked"));
        }
        // Answered, then the connection closed cleanly before the ready.
        Err(ConnectError::Handshake(BootstrapError::Closed)) if armed.is_some() => {
            bump(&inner.counters.withdrawn);
            return Err(ConnectError::Withdrawn);
        }
        Err(err) => {
            if let ConnectError::DeclinedLocally(_) = err {
                bump(&inner.counters.declined);
            }
            return Err(err);
        }
    };
    let armed = armed.ok_or(BootstrapError::OutOfOrder)?;
    let epoch = install(
        inner,
        Side::Accepted {
            counted: &mut guard.counted,
            source,
        },
        established,
        armed,
        stream,
        prefix,
        granted,
    );
    drop(guard);
    epoch
}

/// The listener's answer to an authenticated dialer's hello: the epoch we
/// propose and whether we registered the peer, or why we decline (with the
/// error to log when it is a refusal).
fn decide<E: EpochMaker>(
    inner: &NodeInner<E>,
    hello: &HelloFields,
    source: IpAddr,
) -> Result<(Epoch, bool), (DeclineReason, Option<ConnectError>)> {
    if inner.shutdown.load(Ordering::Acquire) || inner.mux.get().is_none() {
        return Err((DeclineReason::Unavailable, None));
    }
    let mut peers = inner.peers();
    if let Some(refusal) = inner.peer_limit(&peers, hello.node, Some(source)) {
        bump(&inner.counters.peer_limit_refusals);
        return Err((DeclineReason::Unavailable, Some(refusal)));
    }
    let state = inner.entry(&mut peers, hello.node);
    if state.dial == Dial::Connecting && hello.node > inner.config.id {
        return Err((DeclineReason::CrossedDial, None));
    }
    if NodeInner::<E>::live(state)
        && state.incarnation == Some(hello.incarnation)
        && hello.proposed < state.last_epoch
    {
        return Err((DeclineReason::StaleDial, None));
    }
    if state.accepting > 0 && state.accepting_from == Some(hello.incarnation) {
        // An earlier connection of the same process still finishes its
        // handshake here, and the peer may already send on it: it installs
        // first, and this dial, asked again, replaces it, so what was sent
        // there is read out before this epoch (docs/design.md § "A replaced
        // link delivers what its peer sent").
        return Err((DeclineReason::Unavailable, None));
    }
    if state.accepting >= MAX_ACCEPTS_PER_PEER {
        bump(&inner.counters.peer_limit_refusals);
        return Err((
            DeclineReason::Unavailable,
            Some(ConnectError::TooManyHandshakesFromPeer {
                peer: hello.node,
                limit: MAX_ACCEPTS_PER_PEER,
            }),
        ));
    }
    state.accepting += 1;
    state.accepting_from = Some(hello.incarnation);
    if !NodeInner::<E>::live(state) && state.addr.is_none() {
        // Counted against this source while the handshake is under way; a
        // live peer's moves only when this link installs.
        state.source = Some(source);
    }
    Ok((state.last_epoch, state.addr.is_some()))
}

#[cfg(test)]
mod tests {
    use super::source_of;
    use std::net::IpAddr;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("an address")
    }

    /// Only a refusal no redial mends is permanent; races, limits and
    /// transient faults are asked again.
    #[test]
    fn permanent_failures_are_the_other_transport_and_incompatible_endpoints() {
        use super::{ConnectError, DeclineReason};
        for reason in [DeclineReason::WrongTransport, DeclineReason::Incompatible] {
            assert!(ConnectError::DeclinedByPeer(reason).is_permanent());
            assert!(!ConnectError::DeclinedByPeer(reason).is_benign());
        }
        for reason in [
            DeclineReason::CrossedDial,
            DeclineReason::StaleDial,
            DeclineReason::Unavailable,
        ] {
            assert!(!ConnectError::DeclinedByPeer(reason).is_permanent());
            assert!(ConnectError::DeclinedByPeer(reason).is_benign());
        }
        assert!(ConnectError::Incompatible("recv_depth").is_permanent());
        for transient in [
            ConnectError::Timeout,
            ConnectError::Io(std::io::ErrorKind::ConnectionRefused),
            ConnectError::Resources,
            ConnectError::Handshake(crate::link::bootstrap::BootstrapError::BadMac),
        ] {
            assert!(!transient.is_permanent(), "{transient}");
        }
    }

    /// Backoff bounds out of order (the first failed dial's `clamp` would
    /// panic under the node's table lock), past `MAX_BACKOFF`, or from zero
    /// (which never grows) are refused at bind; equal bounds bind.
    #[tokio::test]
    async fn backoff_bounds_out_of_order_or_too_long_are_refused_at_bind() {
        use super::{MAX_BACKOFF, TcpNode, TcpNodeConfig};
        use std::time::Duration;
        let local: std::net::SocketAddr = "127.0.0.1:0".parse().expect("an address");
        let with = |min: Duration, max: Duration| TcpNodeConfig {
            backoff_min: min,
            backoff_max: max,
            ..TcpNodeConfig::new(crate::mux::PeerId(7))
        };
        let ms = Duration::from_millis;
        for (min, max) in [
            (ms(50), ms(20)),
            (ms(50), MAX_BACKOFF + ms(1)),
            (ms(0), ms(50)),
        ] {
            let err = TcpNode::bind(with(min, max), local).await.err();
            assert_eq!(
                err.map(|e| e.kind()),
                Some(std::io::ErrorKind::InvalidInput),
                "{min:?}..{max:?}"
            );
        }
        for (min, max) in [(ms(50), ms(50)), (ms(1), MAX_BACKOFF)] {
            assert!(TcpNode::bind(with(min, max), local).await.is_ok());
        }
    }

    /// A node (no mux) with one peer registered at an address nothing dials.
    async fn node_with_a_registered_peer() -> (super::TcpNode, crate::mux::PeerId) {
        use crate::mux::PeerId;
        let local = "127.0.0.1:0".parse().expect("an address");
        let node = super::TcpNode::bind(super::TcpNodeConfig::new(PeerId(7)), local)
            .await
            .expect("bind");
        let peer = PeerId(8);
        node.register(peer, "127.0.0.1:9".parse().expect("an address"));
        (node, peer)
    }

    /// A re-ask while our own dial is under way leaves an ask kept for an
    /// accept under way kept (review 48c: it was cleared, and the accept's
    /// failure then left nobody to dial).
    #[tokio::test]
    async fn an_ask_while_our_dial_is_under_way_keeps_the_ask_kept_for_an_accept() {
        use super::Dial;
        let (node, peer) = node_with_a_registered_peer().await;
        let mut peers = node.inner.peers();
        let state = peers.get_mut(&peer).expect("registered");
        state.dial = Dial::Connecting;
        state.accepting = 1;
        state.wanted = true;
        assert_eq!(node.inner.dial_for(peer, state), None, "no second dial");
        assert!(state.wanted, "the kept ask stays kept");
    }

    /// An ended link is dropped when the mux lets go of it though an ask
    /// waits and our dial is under way (review 48e: the ask went to
    /// `dial_for`, which dials nothing then, and the link stayed).
    #[tokio::test]
    async fn a_released_link_is_dropped_while_our_dial_is_under_way() {
        use super::Dial;
        use crate::link::Link;
        use crate::link::tcp::{TcpLink, TcpLinkConfig};
        use crate::mux::protocol::Epoch;
        let (node, peer) = node_with_a_registered_peer().await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let dialing = tokio::net::TcpStream::connect(listener.local_addr().expect("address"));
        let (dialed, accepted) = tokio::join!(dialing, listener.accept());
        let config = TcpLinkConfig::default();
        let link = TcpLink::new(
            dialed.expect("connect"),
            Vec::new(),
            Epoch(2),
            &config,
            1 << 16,
        )
        .expect("link");
        drop(accepted.expect("accept"));
        tokio::time::timeout(std::time::Duration::from_secs(10), link.ended())
            .await
            .expect("the link ends with its peer's socket");
        {
            let mut peers = node.inner.peers();
            let state = peers.get_mut(&peer).expect("registered");
            state.current = Some(link);
            state.wanted = true;
            state.dial = Dial::Connecting;
        }
        node.dialer().link_released(peer);
        assert!(node.link(peer).is_none(), "the ended link was kept");
        assert!(node.link_end(peer).is_some());
    }

    /// A failed dial's verdict is kept only while it is about the peer as
    /// it is now, and only a permanent one is reported to the mux.
    #[tokio::test]
    async fn a_failed_dials_verdict_is_kept_only_while_it_speaks_for_the_peer() {
        use super::{ConnectError, DeclineReason, NodeInner, PeerState, TcpEpochs};
        use crate::link::tcp::{TcpLink, TcpLinkConfig};
        use crate::mux::protocol::Epoch;
        type Inner = NodeInner<TcpEpochs>;
        let here: std::net::SocketAddr = "10.0.0.7:4000".parse().expect("an address");
        let moved: std::net::SocketAddr = "10.0.0.8:4000".parse().expect("an address");
        let declined = Err(ConnectError::DeclinedByPeer(DeclineReason::WrongTransport));
        let refused = Err(ConnectError::Io(std::io::ErrorKind::ConnectionRefused));
        let at_here = || PeerState::<TcpLink> {
            addr: Some(here),
            ..PeerState::default()
        };

        // Kept: permanent and transient failures at the present address.
        let mut state = at_here();
        assert!(Inner::note_failed_dial(&mut state, &declined, Some(here)));
        assert_eq!(state.last_failure.map(|f| f.error), declined.err());
        let mut state = at_here();
        assert!(!Inner::note_failed_dial(&mut state, &refused, Some(here)));
        assert_eq!(state.last_failure.map(|f| f.error), refused.err());

        // Not kept: a success, a benign outcome, no address dialled, a dial
        // to an address the peer has since left, an accept under way.
        let crossed = Err(ConnectError::DeclinedByPeer(DeclineReason::CrossedDial));
        let cases = [
            ("success", at_here(), Ok(Epoch(3)), Some(here)),
            ("benign", at_here(), crossed, Some(here)),
            ("no address to dial", PeerState::default(), refused, None),
            ("moved", at_here(), declined, Some(moved)),
            (
                "accepting",
                PeerState {
                    accepting: 1,
                    ..at_here()
                },
                declined,
                Some(here),
            ),
        ];
        for (name, mut state, result, dialed) in cases {
            assert!(
                !Inner::note_failed_dial(&mut state, &result, dialed),
                "{name}"
            );
            assert!(state.last_failure.is_none(), "{name}");
        }

        // Not kept while a link is live: the peer is reachable.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let dialing = tokio::net::TcpStream::connect(listener.local_addr().expect("address"));
        let (dialed, accepted) = tokio::join!(dialing, listener.accept());
        let other_end = accepted.expect("accept");
        let link = TcpLink::new(
            dialed.expect("connect"),
            Vec::new(),
            Epoch(2),
            &TcpLinkConfig::default(),
            usize::MAX,
        )
        .expect("link");
        let mut state = PeerState {
            current: Some(link),
            ..at_here()
        };
        assert!(!Inner::note_failed_dial(&mut state, &declined, Some(here)));
        assert!(state.last_failure.is_none());

        // Kept once that link has ended.
        drop(other_end);
        let link = state.current.as_ref().expect("the link");
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while link.end_reason().is_none() {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the link ends with its peer's socket");
        assert!(Inner::note_failed_dial(&mut state, &declined, Some(here)));
        assert_eq!(state.last_failure.map(|f| f.error), declined.err());
    }

    #[test]
    fn a_handshake_source_is_an_ipv4_address_or_an_ipv6_slash_64() {
        assert_eq!(source_of(ip("10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(source_of(ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(
            source_of(ip("2001:db8:1:2:aaaa:bbbb:cccc:dddd")),
            ip("2001:db8:1:2::")
        );
        assert_eq!(
            source_of(ip("2001:db8:1:2::1")),
            source_of(ip("2001:db8:1:2:ffff::9"))
        );
        assert_ne!(
            source_of(ip("2001:db8:1:2::1")),
            source_of(ip("2001:db8:1:3::1"))
        );
    }
}
