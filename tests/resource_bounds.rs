//! Resource bounds, enforced with named errors and counters: slots per peer
//! (local opens), peers per node, pending handshakes, handshake timeout.
//! Waits are on states; the timeouts here only turn hangs into failures.

mod hostile;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hostile::{HostileDialer, bounded, read_to_close, until};
use qpmux::link::bootstrap::DeclineReason;
use qpmux::link::mem::{MemConfig, MemFabric};
use qpmux::link::tcp::{ConnectError, TcpLink, TcpNode, TcpNodeConfig};
use qpmux::link::{Link, Node};
use qpmux::mux::protocol::Epoch;
use qpmux::mux::{
    CloseReason, Frame, Mux, MuxConfig, MuxError, MuxTransport, PeerId, RECORD_OVERHEAD, SendError,
    SlotSender, StreamKey, Terminal,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const L: PeerId = PeerId(1);
const A: PeerId = PeerId(2);
const B: PeerId = PeerId(3);
const C: PeerId = PeerId(4);

#[tokio::test]
async fn local_opens_past_max_slots_per_peer_fail_by_name_and_free_up_when_slots_end() {
    bounded(async {
        let limit = 4;
        let config = MuxConfig {
            max_slots_per_peer: limit,
            ..MuxConfig::default()
        };
        let fabric = MemFabric::new(MemConfig::default());
        let l = fabric.node(L, config.clone()).mux().clone();
        let a = fabric.node(A, config.clone()).mux().clone();
        let _b = fabric.node(B, config);
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for s in 0..u64::from(limit) {
            let key = StreamKey::new(L.0, s);
            receivers.push(a.bind(key).expect("bind"));
            senders.push(l.open(A, key).expect("open within the limit"));
        }
        let over = StreamKey::new(L.0, 99);
        assert_eq!(
            l.open(A, over).map(|_| ()),
            Err(MuxError::SlotLimit { peer: A, limit })
        );
        // The limit is per peer.
        let tx = l.open(B, StreamKey::new(L.0, 0)).expect("another peer");
        tx.finish(Terminal::Finalized).expect("finish");
        // A slot that ends gives its place back once its terminal is out.
        senders
            .pop()
            .expect("a sender")
            .finish(Terminal::Finalized)
            .expect("finish");
        let mut last = receivers.pop().expect("a receiver");
        assert_eq!(last.recv().await, Some(Frame::Finalized));
        let mut rx = a.bind(over).expect("bind");
        let tx = open_when_room(&l, A, over).await;
        tx.finish(Terminal::Finalized).expect("finish");
        assert_eq!(rx.recv().await, Some(Frame::Finalized));
        let stats = l.stats();
        assert_eq!(stats.protocol_violations, 0);
        assert_eq!(stats.slots_dropped, 0);
        drop(senders);
    })
    .await;
}

/// Two nodes configured with different `max_slots_per_peer`: once an
/// epoch's hellos have told each the other's, opens stay within the smaller
/// at the opening end, failing there by name. Before the hello carried it,
/// L opened past A's limit and A refused the extras (`CloseSlot(Refused)`,
/// and past its cap of refusals owed at once, some went untold).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opens_toward_a_peer_with_a_smaller_slot_limit_stay_within_it() {
    bounded(async {
        let limit = 4;
        let mux_config = |max_slots_per_peer| MuxConfig {
            max_slots_per_peer,
            ..MuxConfig::default()
        };
        let (l_node, l) = mux_node(L, mux_config(64)).await;
        let (a_node, a) = mux_node(A, mux_config(limit)).await;
        l_node.register(A, a_node.local_addr());
        l_node.connect(A).await.expect("an epoch");
        // The peer task has taken the epoch's terms.
        until(|| l.epoch(A).is_some()).await;
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for s in 0..u64::from(limit) {
            let key = StreamKey::new(L.0, s);
            receivers.push(a.bind(key).expect("bind"));
            senders.push(l.open(A, key).expect("open within A's limit"));
        }
        let over = StreamKey::new(L.0, 99);
        let _unused = a.bind(over).expect("bind");
        assert_eq!(
            l.open(A, over).map(|_| ()),
            Err(MuxError::SlotLimit { peer: A, limit })
        );
        for (tx, mut rx) in senders.into_iter().zip(receivers) {
            tx.finish(Terminal::Finalized).expect("finish");
            assert_eq!(rx.recv().await, Some(Frame::Finalized));
        }
        assert_eq!(a.stats().opens_refused, 0);
    })
    .await;
}

/// Opens made before the first epoch's hellos, toward a peer whose limit
/// turns out smaller: the peer task admits only that many when the epoch
/// comes up and closes the rest at once, so every sender learns its fate.
/// It used to write all their Opens; the peer refused the extras, but owes
/// at most its limit's worth of refusals at once, so with heartbeats off
/// two of these six senders never heard, and their places stayed taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opens_made_before_the_peers_limit_was_known_are_each_told_their_fate() {
    bounded(async {
        let limit = 4;
        let quiet = MuxConfig {
            heartbeat: None,
            ..MuxConfig::default()
        };
        let small = MuxConfig {
            max_slots_per_peer: limit,
            ..MuxConfig::default()
        };
        let (l_node, l) = mux_node(L, quiet).await;
        let (a_node, a) = mux_node(A, small).await;
        let mut senders = Vec::new();
        let mut receivers = Vec::new();
        for s in 0..10 {
            let key = StreamKey::new(L.0, s);
            receivers.push(a.bind(key).expect("bind"));
            senders.push(l.open(A, key).expect("our own limit allows it"));
        }
        // Now the link, and with it A's limit.
        l_node.register(A, a_node.local_addr());
        let mut open = senders;
        let mut refused = 0;
        while refused < 6 {
            let mut still = Vec::new();
            for tx in open {
                match tokio::time::timeout(Duration::from_millis(1), tx.closed()).await {
                    Ok(error) => {
                        assert_eq!(error, SendError::PeerClosed(CloseReason::Refused));
                        refused += 1;
                    }
                    Err(_) => still.push(tx),
                }
            }
            open = still;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(open.len(), limit as usize, "A's limit's worth live");
        for tx in open {
            let key = tx.key();
            tx.finish(Terminal::Finalized).expect("finish");
            let rx = receivers
                .iter_mut()
                .find(|rx| rx.key() == key)
                .expect("its receiver");
            assert_eq!(rx.recv().await, Some(Frame::Finalized));
        }
        // Every place came back.
        let later = StreamKey::new(L.0, 99);
        let mut rx = a.bind(later).expect("bind");
        let tx = open_when_room(&l, A, later).await;
        tx.finish(Terminal::Finalized).expect("finish");
        assert_eq!(rx.recv().await, Some(Frame::Finalized));
        assert_eq!(a.stats().opens_refused, 0, "A was asked for none past it");
    })
    .await;
}

async fn tcp_node(
    id: PeerId,
    shape: impl FnOnce(TcpNodeConfig) -> TcpNodeConfig,
) -> (TcpNode, Mux<TcpLink>) {
    start(shape(TcpNodeConfig::new(id)), MuxConfig::default()).await
}

/// A TCP node on loopback with default node settings and `mux` as its mux's.
async fn mux_node(id: PeerId, mux: MuxConfig) -> (TcpNode, Mux<TcpLink>) {
    start(TcpNodeConfig::new(id), mux).await
}

async fn start(node: TcpNodeConfig, mux: MuxConfig) -> (TcpNode, Mux<TcpLink>) {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    TcpNode::start(node, addr, mux).await.expect("bind")
}

/// Opens `key` toward `peer` once a place is free (a slot that ended gives
/// its place back once its terminal is out).
async fn open_when_room<L: Link>(mux: &Mux<L>, peer: PeerId, key: StreamKey) -> SlotSender {
    loop {
        match mux.open(peer, key) {
            Ok(tx) => return tx,
            Err(MuxError::SlotLimit { .. }) => tokio::task::yield_now().await,
            Err(other) => panic!("{other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_at_max_peers_refuses_a_new_peer_by_name_both_ways() {
    bounded(async {
        let (l_node, l) = tcp_node(L, |c| TcpNodeConfig { max_peers: 1, ..c }).await;
        let (a_node, _a) = tcp_node(A, |c| c).await;
        let (b_node, _b) = tcp_node(B, |c| c).await;
        let (c_node, _c) = tcp_node(C, |c| c).await;
        for dialer in [&a_node, &b_node] {
            dialer.register(L, l_node.local_addr());
        }
        assert!(a_node.connect(L).await.is_ok());
        until(|| l.epoch(A).is_some()).await;
        // Accepting: B authenticates, then is declined as Unavailable.
        assert_eq!(
            b_node.connect(L).await,
            Err(ConnectError::DeclinedByPeer(DeclineReason::Unavailable))
        );
        until(|| l_node.stats().refused == 1).await;
        assert_eq!(
            l_node.last_refusal(),
            Some(ConnectError::TooManyPeers { limit: 1 })
        );
        // Dialing: L refuses before it connects. A registered peer counts
        // against registered peers only, so A is registered here first.
        l_node.register(A, a_node.local_addr());
        l_node.register(C, c_node.local_addr());
        assert_eq!(
            l_node.connect(C).await,
            Err(ConnectError::TooManyPeers { limit: 1 })
        );
        assert_eq!(l_node.stats().peer_limit_refusals, 2);
        assert_eq!(c_node.stats().established, 0);
        // The peer already in keeps its epoch and may reconnect.
        assert!(l.epoch(A).is_some());
        let again = a_node.connect(L).await.expect("reconnect");
        until(|| l.epoch(A) == Some(again)).await;
        // Once A's link is gone, B fits.
        l_node.close_link(A);
        until(|| l.epoch(A).is_none()).await;
        assert!(b_node.connect(L).await.is_ok());
        assert_eq!(l_node.stats().peer_limit_refusals, 2);
    })
    .await;
}

/// Loopback sources for the per-source tests (any of 127/8 works on
/// loopback; real nodes dial from `HOME`).
const HOME: &str = "127.0.0.1";
const X: &str = "127.0.0.2";
const Y: &str = "127.0.0.3";

fn ip(text: &str) -> IpAddr {
    text.parse().expect("an address")
}

/// L, shaped by the test, and strangers' handshakes with it.
struct Listener {
    node: TcpNode,
    mux: Mux<TcpLink>,
    addr: SocketAddr,
}

impl Listener {
    async fn new(shape: impl FnOnce(TcpNodeConfig) -> TcpNodeConfig) -> Listener {
        let (node, mux) = tcp_node(L, shape).await;
        let addr = node.local_addr();
        Listener { node, mux, addr }
    }

    /// L with at most `limit` strangers' places a source.
    async fn per_source(limit: usize) -> Listener {
        Listener::new(|c| TcpNodeConfig {
            max_peers_per_source: limit,
            ..c
        })
        .await
    }

    /// Stranger `id` links from `from`, proposing `proposed`: the link's
    /// connection, once L has installed it (L's mux may still be reading
    /// out a link it replaced).
    async fn link(&self, from: &str, id: u64, proposed: Epoch) -> TcpStream {
        let dialer = HostileDialer::connect_from(ip(from), self.addr).await;
        let (epoch, stream) = dialer
            .establish(None, PeerId(id), L, proposed)
            .await
            .expect("a place");
        until(|| {
            self.node
                .link(PeerId(id))
                .is_some_and(|k| k.epoch() == epoch)
        })
        .await;
        stream
    }

    /// Stranger `id`'s handshake from `from` is refused, and L records why:
    /// this refusal, the only one meanwhile.
    async fn refuses(&self, from: &str, id: u64, proposed: Epoch, why: ConnectError) {
        let before = self.node.stats().refused;
        let dialer = HostileDialer::connect_from(ip(from), self.addr).await;
        let refused = dialer.establish(None, PeerId(id), L, proposed).await;
        assert!(refused.is_err(), "{refused:?}");
        // (Recorded when L's side of the handshake ends, after the dialer heard.)
        until(|| self.node.stats().refused > before).await;
        assert_eq!(self.node.last_refusal(), Some(why));
        assert_eq!(self.node.stats().refused, before + 1);
    }
}

/// Why a stranger from `from` is refused when its source is full.
fn source_full(from: &str, limit: usize) -> ConnectError {
    ConnectError::TooManyPeersFromSource {
        from: ip(from),
        limit,
    }
}

/// Peers that dialled in unasked (strangers) count against everyone, but a
/// registered peer counts against registered peers only: strangers holding
/// every place cannot keep the node from the peers it chose, dialled or
/// dialling in, while another stranger is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_cannot_lock_a_node_out_of_its_registered_peers() {
    bounded(async {
        let room = 2;
        let l = Listener::new(|c| TcpNodeConfig {
            max_peers: room,
            ..c
        })
        .await;
        // Strangers take every place, with live links.
        let mut strangers = Vec::new();
        for id in 10..10 + room as u64 {
            strangers.push(l.link(HOME, id, Epoch::default()).await);
        }
        // L dials C, registered, past them.
        let (b_node, _b) = tcp_node(B, |c| c).await;
        let (c_node, _c) = tcp_node(C, |c| c).await;
        l.node.register(C, c_node.local_addr());
        assert!(l.node.connect(C).await.is_ok());
        // And B, registered, dials in.
        l.node.register(B, b_node.local_addr());
        b_node.register(L, l.addr);
        assert!(b_node.connect(L).await.is_ok());
        assert_eq!(l.node.stats().peer_limit_refusals, 0);
        // Another stranger is refused: the table holds twice `max_peers`.
        let full = ConnectError::TooManyPeers { limit: room };
        l.refuses(HOME, 20, Epoch::default(), full).await;
        drop(strangers);
    })
    .await;
}

/// Strangers from one source (an IPv4 address) hold at most
/// `max_peers_per_source` places: one host cannot take all of `max_peers`
/// with live links, while a stranger from another source still gets in, and
/// the source gets its place back when one of its links goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_cannot_take_every_peer_place() {
    bounded(async {
        let per_source = 2;
        let l = Listener::per_source(per_source).await;
        let mut links = Vec::new();
        for id in 10..10 + per_source as u64 {
            links.push(l.link(X, id, Epoch::default()).await);
        }
        let full = source_full(X, per_source);
        l.refuses(X, 20, Epoch::default(), full).await;
        // Another source (the honest node dials from HOME) gets in.
        let (a_node, _a) = tcp_node(A, |c| c).await;
        a_node.register(L, l.addr);
        assert!(a_node.connect(L).await.is_ok());
        // One of the source's links goes, and its place comes back.
        drop(links.pop());
        let gone = PeerId(10 + per_source as u64 - 1);
        until(|| l.node.link(gone).is_none_or(|k| k.end_reason().is_some())).await;
        l.link(X, 20, Epoch::default()).await;
        assert_eq!(l.node.stats().peer_limit_refusals, 1);
    })
    .await;
}

/// A hello under a live stranger's id from another host, abandoned after
/// the answer, does not move that peer's count to the other host: a
/// source's count follows the links installed, not hellos.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_under_a_live_id_does_not_move_its_source() {
    bounded(async {
        let l = Listener::per_source(1).await;
        let _live = l.link(X, 10, Epoch::default()).await;
        // From Y, a hello as that peer (a new incarnation), answered, then
        // abandoned before the ready.
        let mut claim = HostileDialer::connect_from(ip(Y), l.addr).await;
        let hello = claim.hello_of(None, PeerId(10), L, 99);
        claim.say(&hello).await;
        // The listener's hello, read whole, so our close is a FIN.
        let mut len = [0u8; 4];
        claim.stream.read_exact(&mut len).await.expect("answered");
        let mut answer = vec![0u8; u32::from_be_bytes(len) as usize];
        claim
            .stream
            .read_exact(&mut answer)
            .await
            .expect("answered");
        drop(claim);
        until(|| l.node.stats().withdrawn == 1).await;
        // X's place is still taken, and Y's is free.
        l.refuses(X, 11, Epoch::default(), source_full(X, 1)).await;
        l.link(Y, 12, Epoch::default()).await;
        let live = l.node.link(PeerId(10)).expect("its entry");
        assert_eq!(live.epoch(), Epoch(1));
        assert!(live.end_reason().is_none(), "the live link stands");
    })
    .await;
}

/// A live stranger re-handshaking from another source would move its
/// place there: that source's share is checked first, so one host cannot
/// empty its share by moving its peers onto a second address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_stranger_cannot_move_into_a_full_source() {
    bounded(async {
        let l = Listener::per_source(1).await;
        let _x = l.link(X, 10, Epoch::default()).await;
        let _y = l.link(Y, 11, Epoch::default()).await;
        // X's peer, from Y (proposing its running epoch, so not stale).
        l.refuses(Y, 10, Epoch(1), source_full(Y, 1)).await;
        // From X itself the same peer may reconnect.
        l.link(X, 10, Epoch(1)).await;
    })
    .await;
}

/// A live stranger that moves to a source with room takes its place
/// there and frees one at its old source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_moving_to_another_source_takes_its_place_there() {
    bounded(async {
        let l = Listener::per_source(1).await;
        let old = l.link(X, 10, Epoch::default()).await;
        let _moved = l.link(Y, 10, Epoch(1)).await;
        // (The replaced link is read out to its EOF before the new one.)
        drop(old);
        until(|| l.mux.epoch(PeerId(10)) == Some(Epoch(2))).await;
        // X has its place back; Y's is taken.
        l.link(X, 11, Epoch::default()).await;
        l.refuses(Y, 12, Epoch::default(), source_full(Y, 1)).await;
    })
    .await;
}

/// Moves under way at once into one source are each checked against the
/// others at install: two answered while the source had room for one, then
/// both readied, install one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_into_a_source_at_once_install_within_its_share() {
    moves_at_once(false).await;
}

/// As above, with the old links from X gone before the readies: the moves
/// are installs of peers no longer live, still checked against Y.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_whose_old_links_went_meanwhile_install_within_the_share() {
    moves_at_once(true).await;
}

/// X holds peers 10 and 11, Y holds 12 of its 2 places; both of X's
/// peers re-link from Y at once (answered, then readied), X's old links
/// closed before the readies if `old_gone_first`. One move installs.
async fn moves_at_once(old_gone_first: bool) {
    bounded(async {
        let l = Listener::per_source(2).await;
        let mut from_x = Vec::new();
        for id in [10, 11] {
            from_x.push(Some(l.link(X, id, Epoch::default()).await));
        }
        let _y = l.link(Y, 12, Epoch::default()).await;
        // Both of X's peers, from Y, answered while Y has one place left.
        let mut answered = Vec::new();
        for id in [10, 11] {
            let dialer = HostileDialer::connect_from(ip(Y), l.addr).await;
            let (dialer, hs, epoch) = dialer
                .answered(None, PeerId(id), L, Epoch(1))
                .await
                .expect("Y had room at the hello");
            assert_eq!(epoch, Epoch(2));
            answered.push((dialer, hs));
        }
        if old_gone_first {
            from_x.clear();
            for id in [10, 11] {
                until(|| l.node.link_end(PeerId(id)).is_some()).await;
            }
        }
        let mut moves = Vec::new();
        for (dialer, hs) in answered {
            moves.push(dialer.send_ready(hs).await);
        }
        until(|| l.node.stats().peer_limit_refusals == 1).await;
        until(|| l.node.last_refusal().is_some()).await;
        assert_eq!(l.node.last_refusal(), Some(source_full(Y, 2)));
        // One moved.
        let moved: Vec<usize> = (0..2)
            .filter(|at| {
                let link = l.node.link(PeerId(10 + *at as u64));
                link.is_some_and(|link| link.epoch() == Epoch(2))
            })
            .collect();
        assert_eq!(moved.len(), 1, "{moved:?}");
        let (moved, stayed) = (moved[0], 1 - moved[0]);
        // (A replaced link is read out to its EOF before the new one.)
        if let Some(old) = from_x.get_mut(moved) {
            drop(old.take());
        }
        until(|| l.mux.epoch(PeerId(10 + moved as u64)) == Some(Epoch(2))).await;
        if !old_gone_first {
            // The other keeps its link from X.
            let stayed = PeerId(10 + stayed as u64);
            until(|| l.mux.epoch(stayed) == Some(Epoch(1))).await;
            let link = l.node.link(stayed).expect("its entry");
            assert!(link.epoch() == Epoch(1) && link.end_reason().is_none());
        }
    })
    .await;
}

/// What a departed stranger left here counts against its source's
/// `max_peers_per_source` too: one host cannot take every place with ids
/// that open a stream nobody binds and leave, while another source still
/// gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_departed_strangers_left_counts_against_their_source() {
    bounded(async {
        let l = Listener::per_source(1).await;
        let (a_node, a) = tcp_node(A, |c| c).await;
        let (b_node, _b) = tcp_node(B, |c| c).await;
        for dialer in [&a_node, &b_node] {
            dialer.register(L, l.addr);
        }
        assert!(a_node.connect(L).await.is_ok());
        until(|| l.mux.epoch(A).is_some()).await;
        // A (from HOME) leaves an unbound stream and goes; B, from the same
        // source, is refused by it.
        a_leaves_an_unbound_stream(&l.node, &l.mux, &a_node, &a, &b_node).await;
        until(|| l.node.last_refusal().is_some()).await;
        assert_eq!(l.node.last_refusal(), Some(source_full(HOME, 1)));
        // A hello under A's id from a full source is refused, and does not
        // wipe the record: a fresh id from A's source is still refused.
        let _held = l.link(Y, 30, Epoch::default()).await;
        l.refuses(Y, A.0, Epoch::default(), source_full(Y, 1)).await;
        l.refuses(HOME, 31, Epoch::default(), source_full(HOME, 1))
            .await;
        assert_eq!(l.node.stats().peer_limit_refusals, 3);
        // Another source gets in.
        l.link(X, 20, Epoch::default()).await;
    })
    .await;
}

/// L with room for one peer, and A and B, which know L's address.
async fn one_peer_room_and_two_dialers() -> ([TcpNode; 3], [Mux<TcpLink>; 3]) {
    let (l_node, l) = tcp_node(L, |c| TcpNodeConfig { max_peers: 1, ..c }).await;
    let (a_node, a) = tcp_node(A, |c| c).await;
    let (b_node, b) = tcp_node(B, |c| c).await;
    for dialer in [&a_node, &b_node] {
        dialer.register(L, l_node.local_addr());
    }
    ([l_node, a_node, b_node], [l, a, b])
}

/// A shuts down; L still keeps something of it, so B is refused as new.
async fn a_leaves_and_b_is_refused(
    l_node: &TcpNode,
    l: &Mux<TcpLink>,
    a_node: &TcpNode,
    a: &Mux<TcpLink>,
    b_node: &TcpNode,
) {
    a.shutdown();
    a_node.shutdown();
    until(|| l.epoch(A).is_none()).await;
    assert_eq!(
        b_node.connect(L).await,
        Err(ConnectError::DeclinedByPeer(DeclineReason::Unavailable))
    );
    assert_eq!(l_node.stats().peer_limit_refusals, 1);
}

/// A opens a stream at L that nobody binds, finishes it with no bytes, and
/// leaves; B, new, is refused. Returns the stream's key.
async fn a_leaves_an_unbound_stream(
    l_node: &TcpNode,
    l: &Mux<TcpLink>,
    a_node: &TcpNode,
    a: &Mux<TcpLink>,
    b_node: &TcpNode,
) -> StreamKey {
    let empty = StreamKey::new(A.0, 2);
    let tx = a.open(L, empty).expect("open");
    tx.finish(Terminal::Finalized).expect("finish");
    until(|| l.peers_holding() == [A]).await;
    assert_eq!(l.stats().peer_held_bytes, 0, "nothing but the entry");
    a_leaves_and_b_is_refused(l_node, l, a_node, a, b_node).await;
    empty
}

/// A peer that left bytes here in a stream nobody has bound still counts
/// against `max_peers` after its link is gone: peers that come and go under
/// fresh ids cannot pile up memory. Once its stream is read, a new peer
/// fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_gone_with_unread_bytes_here_still_counts_against_max_peers() {
    bounded(async {
        let ([l_node, a_node, b_node], [l, a, b]) = one_peer_room_and_two_dialers().await;
        let unread = StreamKey::new(A.0, 1);
        let mut tx = a.open(L, unread).expect("open");
        tx.send(bytes::Bytes::from_static(b"left for later"))
            .await
            .expect("send");
        tx.finish(Terminal::Finalized).expect("finish");
        let held = (b"left for later".len() + RECORD_OVERHEAD) as u64;
        until(|| l.stats().peer_held_bytes == held).await;
        // A is gone, its record held: B is refused.
        a_leaves_and_b_is_refused(&l_node, &l, &a_node, &a, &b_node).await;
        // Read: A's task retires, and B fits.
        let mut rx = l.bind(unread).expect("bind");
        assert_eq!(
            rx.recv().await,
            Some(Frame::Data(bytes::Bytes::from_static(b"left for later")))
        );
        assert_eq!(rx.recv().await, Some(Frame::Finalized));
        until(|| l.stats().peer_held_bytes == 0).await;
        assert!(b_node.connect(L).await.is_ok());
        drop(b);
    })
    .await;
}

/// A peer whose opens left streams here that nobody has bound still counts
/// against `max_peers` after its link is gone, though they hold no bytes:
/// peers coming and going under fresh ids cannot fill the node's registry
/// (each may leave `max_unbound_per_peer` entries). A bind lets a new peer in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_gone_with_unbound_streams_here_still_counts_against_max_peers() {
    bounded(async {
        let ([l_node, a_node, b_node], [l, a, b]) = one_peer_room_and_two_dialers().await;
        let empty = a_leaves_an_unbound_stream(&l_node, &l, &a_node, &a, &b_node).await;
        // Bound and read: A keeps nothing here, and B fits.
        let mut rx = l.bind(empty).expect("bind");
        assert_eq!(rx.recv().await, Some(Frame::Finalized));
        assert!(l.peers_holding().is_empty());
        assert!(b_node.connect(L).await.is_ok());
        drop(b);
    })
    .await;
}

/// What departed peers left behind counts against peers the node did not
/// register only: ids that open a stream nobody binds and leave (a
/// thousand of them would fill the default `max_peers`) cannot lock the
/// node out of the peers it chose, dialling in or dialled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_departed_peers_left_does_not_lock_out_a_registered_peer() {
    bounded(async {
        let ([l_node, a_node, b_node], [l, a, b]) = one_peer_room_and_two_dialers().await;
        a_leaves_an_unbound_stream(&l_node, &l, &a_node, &a, &b_node).await;
        // Registered here, B is let in while A's entry still waits.
        l_node.register(B, b_node.local_addr());
        assert!(b_node.connect(L).await.is_ok());
        assert_eq!(l.peers_holding(), [A]);
        assert_eq!(l_node.stats().peer_limit_refusals, 1);
        drop(b);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_dialers_are_cut_at_the_handshake_timeout() {
    bounded(async {
        // Long enough for the honest dialer at the end on a loaded machine;
        // the trickled hello would take 15 s.
        let (l_node, _l) = tcp_node(L, |c| TcpNodeConfig {
            handshake_timeout: Duration::from_secs(2),
            ..c
        })
        .await;
        let addr = l_node.local_addr();
        // One says nothing at all; one trickles a hello a byte at a time.
        let silent = HostileDialer::connect(addr).await;
        let mut trickler = HostileDialer::connect(addr).await;
        let hello = trickler.hello(None, A, L);
        let trickle = tokio::spawn(async move {
            for byte in hello {
                if trickler.stream.write_all(&[byte]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            read_to_close(&mut trickler.stream).await
        });
        assert!(silent.closed().await, "cut without a word");
        assert_eq!(trickle.await.expect("trickler"), 0, "cut without a word");
        until(|| l_node.stats().refused == 2).await;
        assert_eq!(l_node.last_refusal(), Some(ConnectError::Timeout));
        assert_eq!(l_node.stats().established, 0);
        // An honest dialer still connects.
        let (a_node, _a) = tcp_node(A, |c| c).await;
        a_node.register(L, addr);
        assert!(a_node.connect(L).await.is_ok());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_pending_handshakes_are_closed_at_once() {
    bounded(async {
        let pending = 2;
        let (l_node, l) = tcp_node(L, |c| TcpNodeConfig {
            max_pending_handshakes: pending,
            // Long enough that both holders are in before the first is cut.
            handshake_timeout: Duration::from_secs(2),
            ..c
        })
        .await;
        let addr = l_node.local_addr();
        // Each has its challenge: both hold a handshake slot.
        let holders = [
            HostileDialer::connect(addr).await,
            HostileDialer::connect(addr).await,
        ];
        let mut shed = HostileDialer::silent(addr).await;
        assert_eq!(
            read_to_close(&mut shed).await,
            0,
            "closed without a challenge"
        );
        assert_eq!(l_node.stats().handshakes_shed, 1);
        assert_eq!(
            l_node.last_refusal(),
            Some(ConnectError::TooManyHandshakes { limit: pending })
        );
        // The holders are cut at the timeout; then an honest dialer gets in.
        for holder in holders {
            assert!(holder.closed().await);
        }
        let (a_node, _a) = tcp_node(A, |c| c).await;
        a_node.register(L, addr);
        assert!(a_node.connect(L).await.is_ok());
        until(|| l.epoch(A).is_some()).await;
        assert_eq!(l_node.stats().handshakes_shed, 1);
        assert_eq!(l_node.stats().refused, 3);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_source_cannot_fill_the_handshake_pool() {
    bounded(async {
        let per_source = 2;
        let (l_node, _l) = tcp_node(L, |c| TcpNodeConfig {
            max_pending_handshakes: 8,
            max_pending_per_source: per_source,
            // Far beyond the 500 ms look below: a stall between the two
            // cannot let the timeout close `beside` first.
            handshake_timeout: Duration::from_secs(5),
            ..c
        })
        .await;
        let addr = l_node.local_addr();
        let loud: std::net::IpAddr = "127.0.0.1".parse().expect("literal");
        let other: std::net::IpAddr = "127.0.0.2".parse().expect("literal");
        // Two silent connections from one source hold its share...
        let mut held = Vec::new();
        for _ in 0..per_source {
            held.push(HostileDialer::silent_from(loud, addr).await);
        }
        // ...so its third is closed at once,
        let mut shed = HostileDialer::silent_from(loud, addr).await;
        assert_eq!(read_to_close(&mut shed).await, 0, "closed without a word");
        assert_eq!(l_node.stats().handshakes_shed, 1);
        assert_eq!(
            l_node.last_refusal(),
            Some(ConnectError::TooManyHandshakesFromSource {
                from: loud,
                limit: per_source
            })
        );
        // ...while another source still gets a handshake slot: its
        // connection stays open until the handshake timeout cuts it.
        let mut beside = HostileDialer::silent_from(other, addr).await;
        let early = tokio::time::timeout(Duration::from_millis(500), read_to_close(&mut beside));
        assert!(early.await.is_err(), "another source is not shed");
        assert_eq!(l_node.stats().handshakes_shed, 1);
        // When the held ones time out, the source's share is free again.
        for mut stream in held {
            read_to_close(&mut stream).await;
        }
        let (a_node, _a) = tcp_node(A, |c| c).await;
        a_node.register(L, addr);
        assert!(
            a_node.connect(L).await.is_ok(),
            "{:?}",
            l_node.last_refusal()
        );
        assert_eq!(l_node.stats().handshakes_shed, 1);
    })
    .await;
}

/// A quarter of the handshake pool is kept for connections from the
/// sources of registered peers' addresses: silent dialers elsewhere fill
/// the rest and are shed past it, and a registered peer still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_strangers_leave_handshakes_for_registered_peers() {
    bounded(async {
        let (l_node, _l) = tcp_node(L, |c| TcpNodeConfig {
            max_pending_handshakes: 4,
            max_pending_per_source: 8,
            handshake_timeout: Duration::from_secs(5),
            ..c
        })
        .await;
        let addr = l_node.local_addr();
        let (a_node, _a) = tcp_node(A, |c| c).await;
        l_node.register(A, a_node.local_addr());
        a_node.register(L, addr);
        let stranger: std::net::IpAddr = "127.0.0.2".parse().expect("literal");
        // Three of the four are the strangers' to take.
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(HostileDialer::connect_from(stranger, addr).await);
        }
        let mut shed = HostileDialer::silent_from(stranger, addr).await;
        assert_eq!(read_to_close(&mut shed).await, 0, "closed without a word");
        assert_eq!(l_node.stats().handshakes_shed, 1);
        assert_eq!(
            l_node.last_refusal(),
            Some(ConnectError::TooManyHandshakes { limit: 3 })
        );
        // The fourth is kept for A, which dials from 127.0.0.1.
        assert!(
            a_node.connect(L).await.is_ok(),
            "{:?}",
            l_node.last_refusal()
        );
        assert_eq!(l_node.stats().handshakes_shed, 1);
        drop(held);
    })
    .await;
}

/// A source where several registered peers live may have a handshake
/// under way for each of them, past `max_pending_per_source`: a host or
/// subnet of registered peers dialling at once is not shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_of_registered_peers_may_handshake_for_each_of_them() {
    bounded(async {
        let (l_node, _l) = tcp_node(L, |c| TcpNodeConfig {
            max_pending_handshakes: 12,
            max_pending_per_source: 2,
            handshake_timeout: Duration::from_secs(5),
            ..c
        })
        .await;
        let addr = l_node.local_addr();
        let shed_past = |l_node: &TcpNode, limit: usize| {
            assert_eq!(
                l_node.last_refusal(),
                Some(ConnectError::TooManyHandshakesFromSource {
                    from: addr.ip(),
                    limit
                })
            );
        };
        for id in 100..103 {
            l_node.register(PeerId(id), SocketAddr::new(addr.ip(), 1));
        }
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(HostileDialer::connect(addr).await);
        }
        let mut shed = HostileDialer::silent(addr).await;
        assert_eq!(read_to_close(&mut shed).await, 0, "closed without a word");
        assert_eq!(l_node.stats().handshakes_shed, 1);
        shed_past(&l_node, 3);
        // More registered there: the raise stops at half the pool (6).
        for id in 103..110 {
            l_node.register(PeerId(id), SocketAddr::new(addr.ip(), 1));
        }
        for _ in 0..3 {
            held.push(HostileDialer::connect(addr).await);
        }
        let mut shed = HostileDialer::silent(addr).await;
        assert_eq!(read_to_close(&mut shed).await, 0, "closed without a word");
        assert_eq!(l_node.stats().handshakes_shed, 2);
        shed_past(&l_node, 6);
        // Another registered source still gets one.
        let other = ip(X);
        l_node.register(PeerId(200), SocketAddr::new(other, 1));
        held.push(HostileDialer::connect_from(other, addr).await);
        assert_eq!(l_node.stats().handshakes_shed, 2);
        drop(held);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_to_a_listener_that_never_speaks_times_out() {
    bounded(async {
        let (a_node, _a) = tcp_node(A, |c| TcpNodeConfig {
            handshake_timeout: Duration::from_millis(300),
            ..c
        })
        .await;
        let mute = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        a_node.register(L, mute.local_addr().expect("addr"));
        let (dialed, accepted) = tokio::join!(a_node.connect(L), mute.accept());
        assert_eq!(dialed, Err(ConnectError::Timeout));
        let (mut held, _) = accepted.expect("accept");
        assert_eq!(
            read_to_close(&mut held).await,
            0,
            "the dialer left without a word"
        );
    })
    .await;
}

#[tokio::test]
async fn slots_dropped_by_an_epoch_death_give_their_places_back() {
    bounded(async {
        let limit = 3;
        let config = MuxConfig {
            max_slots_per_peer: limit,
            ..MuxConfig::default()
        };
        let fabric = MemFabric::new(MemConfig::default());
        let l = fabric.node(L, config.clone()).mux().clone();
        let a = fabric.node(A, config).mux().clone();
        let mut held = Vec::new();
        for s in 0..u64::from(limit) {
            let key = StreamKey::new(L.0, s);
            let mut rx = a.bind(key).expect("bind");
            let mut tx = l.open(A, key).expect("open");
            tx.send(bytes::Bytes::from_static(b"x"))
                .await
                .expect("send");
            assert!(matches!(rx.recv().await, Some(Frame::Data(_))));
            held.push((tx, rx));
        }
        assert!(l.open(A, StreamKey::new(L.0, 9)).is_err());
        assert!(fabric.kill(L, A, qpmux::link::EpochEnd::PeerLost));
        for (_, rx) in &mut held {
            assert!(matches!(rx.recv().await, Some(Frame::Dropped(_))));
        }
        // The dead slots' senders are still held, yet count no more.
        until(|| l.epoch(A).is_none()).await;
        let key = StreamKey::new(L.0, 10);
        let mut rx = a.bind(key).expect("bind");
        let tx = l.open(A, key).expect("a place after the epoch died");
        tx.finish(Terminal::Finalized).expect("finish");
        assert_eq!(rx.recv().await, Some(Frame::Finalized));
        drop(held);
    })
    .await;
}
