//! `RdmaTransport` nodes: each epoch bootstrapped over loopback TCP, the mux
//! on one RC QP per peer over soft RoCEv2 devices on loopback UDP, with
//! `rnr_retry = 0` everywhere (a credit bug ends an epoch instead of hiding).
//! Every wait is on a state; the outer timeout only turns a hang into a failure.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::bootstrap::{
    BootstrapError, ClusterKey, DeclineReason, Endpoint, Handshake, HelloFields, RdmaEndpoint,
    fresh_nonce,
};
use qpmux::link::rdma::{RdmaConfig, RdmaLink, RdmaNodeConfig, RdmaTransport};
use qpmux::link::tcp::{ConnectError, TcpNodeConfig, TcpTransport};
use qpmux::link::{EpochEnd, Node};
use qpmux::mux::{
    DropReason, Epoch, Frame, Mux, MuxConfig, MuxTransport, PeerId, SendError, StreamKey, Terminal,
};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "common/slots.rs"]
mod slots;
use slots::{
    Traffic, in_order_to_finalized, never, prefix_then_one_dropped, record, seq_of, stream_tasks,
};
#[path = "common/relink.rs"]
mod relink;

type Transport = RdmaTransport<SoftDevice>;
type SoftMux = Mux<RdmaLink<SoftDevice>>;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const C: PeerId = PeerId(3);
const D: PeerId = PeerId(4);
const E: PeerId = PeerId(5);
const KEY: &[u8] = b"a cluster key of 32 bytes here!!";
const MAX_BATCH: usize = 16 * 1024;

fn config(id: PeerId, key: Option<&[u8]>) -> RdmaNodeConfig {
    RdmaNodeConfig {
        rdma: RdmaConfig {
            recv_depth: 16,
            max_batch: MAX_BATCH,
            send_buffers: 8,
            ..RdmaConfig::strict()
        },
        ..RdmaNodeConfig::new(id).with_key(key.and_then(ClusterKey::new))
    }
}

async fn device() -> SoftDevice {
    SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback")
}

async fn transport(id: PeerId, key: Option<&[u8]>) -> Transport {
    RdmaTransport::start(device().await, config(id, key))
        .await
        .expect("bind")
}

/// Registers every node's address blob with every other.
fn mesh(nodes: &[&Transport]) {
    for a in nodes {
        for b in nodes {
            if a.node().id() != b.node().id() {
                assert_eq!(a.register(&b.address()), Ok(b.node().id()));
            }
        }
    }
}

/// Waits (on state, polling) until `cond` holds.
async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A hang becomes a failure instead of a stuck test run.
async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(25), f)
        .await
        .expect("test did not reach its state")
}

/// Opens `slots` streams from `from` to `to_mux`'s node and sends `records`
/// random-size records on each (about one in ten larger than a batch);
/// returns when every record arrived in order, exactly once, intact, and
/// every stream finished.
async fn stream(from: &SoftMux, to: PeerId, to_mux: &SoftMux, anchor: u64, slots: u64) {
    let records = 3u32;
    let mut consumers = Vec::new();
    let mut producers = Vec::new();
    let traffic = Traffic {
        records,
        len: |_, _, rng| {
            if rng.random_bool(0.1) {
                rng.random_range(MAX_BATCH + 1..2 * MAX_BATCH)
            } else {
                rng.random_range(12..2_000)
            }
        },
        pause: never,
    };
    for s in 0..slots {
        let key = StreamKey::new(anchor, s);
        let seeds = (s, anchor * 1000 + s);
        let (consumer, producer) = stream_tasks(from, to_mux, to, key, seeds, traffic);
        consumers.push(consumer);
        producers.push(producer);
    }
    for p in producers {
        p.await.expect("producer");
    }
    for c in consumers {
        assert_eq!(c.await.expect("consumer").0, records);
    }
}

fn no_rnr(t: &Transport) {
    let c = t.device().counters();
    assert_eq!(
        (c.rnr_naks_sent, c.rnr_naks_received),
        (0, 0),
        "credit makes RNR unreachable: {c:?}"
    );
}

/// [`stream`]s `slots` streams from `a` to each of four peers at once
/// (anchor = the peer's id).
async fn stream_to_four(a: &Transport, peers: &[Transport], slots: u64) {
    let [b, c, d, e] = peers else {
        panic!("four peers")
    };
    tokio::join!(
        stream(a.mux(), b.node().id(), b.mux(), b.node().id().0, slots),
        stream(a.mux(), c.node().id(), c.mux(), c.node().id().0, slots),
        stream(a.mux(), d.node().id(), d.mux(), d.node().id().0, slots),
        stream(a.mux(), e.node().id(), e.mux(), e.node().id().0, slots)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_slots_over_four_peers_arrive_in_order_exactly_once_without_rnr() {
    bounded(async {
        let a = transport(A, Some(KEY)).await;
        let mut peers = Vec::new();
        for id in [B, C, D, E] {
            peers.push(transport(id, Some(KEY)).await);
        }
        let mut all: Vec<&Transport> = peers.iter().collect();
        all.push(&a);
        mesh(&all);
        stream_to_four(&a, &peers, 250).await;
        for p in &peers {
            let id = p.node().id();
            assert_eq!(a.mux().epoch(id), Some(Epoch(1)));
            assert_eq!(p.mux().epoch(A), Some(Epoch(1)));
            assert_eq!(p.mux().stats().slots_dropped, 0);
            assert_eq!(p.node().stats().established, 1);
            let link = a.node().link(id).expect("link");
            assert_eq!(link.end_reason(), None);
            assert!(link.stats().batches_sent > 1);
            no_rnr(p);
        }
        assert_eq!(a.mux().stats().slots_dropped, 0);
        assert_eq!(a.node().stats().established, 4);
        assert_eq!(a.device().qp_count(), 4, "one QP per peer");
        no_rnr(&a);
    })
    .await;
}

/// How a test ends the first epoch.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// The sender's QP goes to ERR behind the link's back.
    KillQp,
    /// The sender's bootstrap TCP connection is reset.
    SeverTcp,
}

async fn a_fault_drops_every_live_slot_once_then_the_next_epoch_works(fault: Fault) {
    let a = transport(A, None).await;
    let b = transport(B, None).await;
    mesh(&[&a, &b]);
    let n_slots = 32u64;
    let mut receivers = Vec::new();
    let mut senders = Vec::new();
    for s in 0..n_slots {
        let key = StreamKey::new(9, s);
        receivers.push(b.mux().bind(key).expect("bind"));
        senders.push(a.mux().open(B, key).expect("open"));
    }
    for (s, tx) in senders.iter_mut().enumerate() {
        for n in 0..3 {
            tx.send(record(s as u64, n, 100)).await.expect("send");
        }
    }
    for rx in &mut receivers {
        match rx.recv().await {
            Some(Frame::Data(d)) => assert_eq!(seq_of(&d), 0),
            other => panic!("unexpected {other:?}"),
        }
    }
    let epoch = a.mux().epoch(B).expect("link is up");
    let link = a.node().link(B).expect("link");
    // Taken while live: a node keeps an ended link only until its mux lets go.
    let b_link = b.node().link(A).expect("b's link");
    match fault {
        Fault::KillQp => link.inject_qp_error().expect("QP to ERR"),
        Fault::SeverTcp => assert!(a.sever_bootstrap(B), "a live link has a liveness task"),
    }

    for rx in &mut receivers {
        prefix_then_one_dropped(rx, epoch).await;
    }
    until(|| a.mux().stats().slots_dropped == n_slots && b.mux().stats().slots_dropped == n_slots)
        .await;
    // Both ends of the epoch ended, each with a reason of its own.
    until(|| link.end_reason().is_some() && b_link.end_reason().is_some()).await;
    let expected_a = match fault {
        Fault::KillQp => matches!(link.end_reason(), Some(EpochEnd::Fault(_))),
        Fault::SeverTcp => link.end_reason() == Some(EpochEnd::PeerLost),
    };
    assert!(
        expected_a,
        "{fault:?}: a ended with {:?}",
        link.end_reason()
    );
    assert!(
        matches!(
            b_link.end_reason(),
            Some(EpochEnd::PeerClosed | EpochEnd::PeerLost | EpochEnd::Fault(_))
        ),
        "{:?}",
        b_link.end_reason()
    );
    for tx in &mut senders {
        assert_eq!(
            tx.send(Bytes::from_static(b"late")).await,
            Err(SendError::Dropped(DropReason::EpochEnded { epoch }))
        );
    }

    // The next epoch (a new TCP connection, new QPs) carries new slots.
    drop((senders, link, b_link));
    stream(a.mux(), B, b.mux(), 11, 8).await;
    let next = a.mux().epoch(B).expect("relinked");
    assert_eq!(next, epoch.next(), "max(1, 1) + 1");
    assert_eq!(b.mux().epoch(A), Some(next));
    assert_eq!(
        a.mux().stats().slots_dropped,
        n_slots,
        "nothing dropped twice"
    );
    assert_eq!(
        b.mux().stats().slots_dropped,
        n_slots,
        "nothing dropped twice"
    );
    assert_eq!(a.node().stats().dial_failures, 0);
    // The old epoch's QPs are destroyed once nothing holds its links.
    until(|| a.device().qp_count() == 1 && b.device().qp_count() == 1).await;
    no_rnr(&a);
    no_rnr(&b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_qp_drops_every_live_slot_once_and_the_next_epoch_carries_new_slots() {
    bounded(a_fault_drops_every_live_slot_once_then_the_next_epoch_works(Fault::KillQp)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_bootstrap_connection_drops_every_live_slot_once_and_relinks() {
    bounded(a_fault_drops_every_live_slot_once_then_the_next_epoch_works(Fault::SeverTcp)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_on_the_same_address_is_detected_and_gets_a_new_epoch() {
    bounded(async {
        let a = transport(A, None).await;
        let b = transport(B, None).await;
        mesh(&[&a, &b]);
        stream(a.mux(), B, b.mux(), 1, 4).await;
        assert_eq!(a.mux().epoch(B), Some(Epoch(1)));
        let addr = b.node().local_addr();
        let old_incarnation = b.node().incarnation();
        b.shutdown();
        until(|| a.node().link_end(B).is_some()).await;
        until(|| a.mux().epoch(B).is_none()).await;
        drop(b);
        // The same node id restarts on the same address (once the port is free).
        let b2 = loop {
            let config = RdmaNodeConfig {
                bind: addr,
                ..config(B, None)
            };
            match RdmaTransport::start(device().await, config).await {
                Ok(started) => break started,
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        assert_ne!(b2.node().incarnation(), old_incarnation);
        stream(a.mux(), B, b2.mux(), 2, 4).await;
        assert_eq!(a.mux().epoch(B), Some(Epoch(2)), "max(1, 0) + 1");
        assert_eq!(b2.mux().epoch(A), Some(Epoch(2)));
        assert_eq!(a.node().stats().restarts_seen, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_dialing_at_once_settle_on_one_connection_without_error() {
    bounded(async {
        for round in 0..3u64 {
            let a = transport(A, None).await;
            let b = transport(B, None).await;
            mesh(&[&a, &b]);
            // Both muxes get work for each other at once: both dial.
            tokio::join!(
                stream(a.mux(), B, b.mux(), 10 + round, 20),
                stream(b.mux(), A, a.mux(), 20 + round, 20)
            );
            for (t, peer) in [(&a, B), (&b, A)] {
                let stats = t.node().stats();
                assert_eq!(stats.established, 1, "one connection: {stats:?}");
                assert_eq!(stats.refused, 0, "{stats:?}");
                assert_eq!(stats.dial_failures, 0, "{stats:?}");
                assert_eq!(t.mux().epoch(peer), Some(Epoch(1)));
                assert_eq!(t.mux().stats().slots_dropped, 0);
                assert_eq!(t.mux().stats().epoch_deaths, 0);
            }
            // The losing dial's QP is gone; one QP per side remains.
            until(|| a.device().qp_count() == 1 && b.device().qp_count() == 1).await;
            a.shutdown();
            b.shutdown();
        }
    })
    .await;
}

/// Reads the listener's challenge frame (4-byte length + body).
async fn read_frame(stream: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await.expect("length");
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    stream.read_exact(&mut body).await.expect("body");
    let mut frame = len.to_vec();
    frame.extend_from_slice(&body);
    frame
}

/// True once the listener has closed `stream` (EOF or reset).
async fn closed_by_listener(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return true,
            Ok(_) => {}
        }
    }
}

/// A valid unauthenticated dialer hello (endpoint of a QP that does not exist).
fn hello_to(listener: PeerId) -> Handshake {
    Handshake::dialer(
        None,
        HelloFields {
            node: PeerId(99),
            incarnation: 7,
            proposed: Epoch(0),
            endpoint: Endpoint::Rdma(RdmaEndpoint {
                qpn: 0x1234,
                psn: 1,
                gid: [0; 16],
                gid_index: 0,
                mtu: 1024,
                recv_depth: 16,
                recv_buf_size: MAX_BATCH as u32,
                lanes: 1,
                udp_port: 9,
            }),
            slot_window: 256 * 1024,
            peer_window: 64 << 20,
            peer_credit: 64 << 20,
            max_record: 16 << 20,
            max_slots: 65_536,
        },
        Some(listener),
        fresh_nonce(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_hellos_are_refused_before_any_qp_exists_and_the_listener_keeps_serving() {
    bounded(async {
        let a = transport(A, Some(b"the WRONG cluster key, 32 bytes!")).await;
        let b = transport(B, Some(KEY)).await;
        let c = transport(C, Some(KEY)).await;
        mesh(&[&a, &b, &c]);
        let listener = b.node().local_addr();

        // 1. A wrong cluster key: A's mux dials and is refused.
        let key_ab = StreamKey::new(5, 1);
        let _rx_ab = b.mux().bind(key_ab).expect("bind");
        let mut tx_ab = a.mux().open(B, key_ab).expect("open");
        tx_ab
            .send(Bytes::from_static(b"intruder"))
            .await
            .expect("queued");
        until(|| b.node().stats().refused >= 1 && a.node().stats().dial_failures >= 1).await;
        assert!(matches!(
            b.node().last_refusal(),
            Some(ConnectError::Handshake(_))
        ));

        // 2. A hello of another protocol version.
        let refused = b.node().stats().refused;
        let mut raw = TcpStream::connect(listener).await.expect("connect");
        let challenge = read_frame(&mut raw).await;
        let mut hs = hello_to(B);
        hs.handle_input(&challenge).expect("a valid challenge");
        let mut hello = hs.poll_transmit().expect("dialer hello");
        hello[4 + 5..4 + 7].copy_from_slice(&99u16.to_be_bytes());
        raw.write_all(&hello).await.expect("write");
        assert!(closed_by_listener(&mut raw).await);
        until(|| b.node().stats().refused > refused).await;

        // 3. Garbage after the challenge.
        let refused = b.node().stats().refused;
        let mut raw = TcpStream::connect(listener).await.expect("connect");
        let _ = read_frame(&mut raw).await;
        let garbage: Vec<u8> = (0..200).map(|_| rand::random::<u8>()).collect();
        raw.write_all(&garbage).await.expect("write");
        assert!(closed_by_listener(&mut raw).await);
        until(|| b.node().stats().refused > refused).await;

        // No QP was ever created on the listener for any of them.
        assert_eq!(
            b.device().stats().qps_created,
            0,
            "refused before resources"
        );
        assert_eq!(b.mux().epoch(A), None, "no epoch with the intruder");

        // The listener keeps serving a correct peer.
        stream(c.mux(), B, b.mux(), 6, 10).await;
        assert_eq!(b.mux().epoch(C), Some(Epoch(1)));
        assert_eq!(b.node().stats().established, 1);
        assert_eq!(b.device().stats().qps_created, 1, "one QP, for C");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_another_receive_depth_is_refused_without_a_qp_and_not_hammered() {
    bounded(async {
        let a = transport(A, None).await;
        let mut b_config = config(B, None);
        b_config.rdma.recv_depth = 32;
        let b = RdmaTransport::start(device().await, b_config)
            .await
            .expect("bind");
        mesh(&[&a, &b]);
        let key = StreamKey::new(3, 1);
        let _rx = b.mux().bind(key).expect("bind");
        let mut tx = a.mux().open(B, key).expect("open");
        tx.send(Bytes::from_static(b"x")).await.expect("queued");
        until(|| b.node().stats().refused >= 1 && a.node().stats().declined >= 1).await;
        assert_eq!(
            b.node().last_refusal(),
            Some(ConnectError::Incompatible("recv_depth"))
        );
        assert_eq!(
            b.device().stats().qps_created,
            0,
            "checked before resources"
        );
        // The dialer hears why, not a bare close or "unavailable", and
        // counts it a failed dial.
        assert_eq!(
            a.last_dial_failure(B).map(|failure| failure.error),
            Some(ConnectError::DeclinedByPeer(DeclineReason::Incompatible))
        );
        assert!(a.node().stats().dial_failures >= 1);
        // The decline backs the dialer off (50 ms doubling) instead of spinning.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(a.node().stats().declined < 20, "{:?}", a.node().stats());
        assert_eq!(a.mux().epoch(B), None);
    })
    .await;
}

/// A TCP node on loopback, for a peer of the other transport.
async fn tcp_node(id: PeerId) -> TcpTransport {
    TcpTransport::bind(
        TcpNodeConfig::new(id),
        "127.0.0.1:0".parse().expect("an address"),
        MuxConfig::default(),
    )
    .await
    .expect("bind")
}

/// A TCP node given an RDMA node's address (the blobs do not say which
/// transport) is told so, makes nothing there, and backs off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_node_dialing_an_rdma_node_is_declined_as_another_transport() {
    bounded(async {
        let b = transport(B, None).await;
        let a = tcp_node(A).await;
        assert_eq!(a.register(&b.address()), Ok(B));
        let declined = ConnectError::DeclinedByPeer(DeclineReason::WrongTransport);
        // An explicit dial hears it, and leaves it for whoever waits on B.
        assert_eq!(a.node().connect(B).await, Err(declined));
        assert_eq!(a.last_dial_failure(B).map(|f| f.error), Some(declined));
        let mut tx = a.mux().open(B, StreamKey::new(3, 1)).expect("open");
        tx.send(Bytes::from_static(b"x")).await.expect("queued");
        // The stream waiting for a link that cannot come ends, told why.
        assert_eq!(
            tx.closed().await,
            SendError::Dropped(DropReason::Unreachable)
        );
        assert_eq!(
            a.last_dial_failure(B).map(|failure| failure.error),
            Some(ConnectError::DeclinedByPeer(DeclineReason::WrongTransport))
        );
        until(|| b.node().stats().refused >= 1).await;
        assert!(matches!(
            b.node().last_refusal(),
            Some(ConnectError::Handshake(
                BootstrapError::WrongTransport { .. }
            ))
        ));
        assert_eq!(b.device().stats().qps_created, 0, "nothing made for it");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            a.node().stats().dial_failures < 20,
            "{:?}",
            a.node().stats()
        );
        assert_eq!(a.mux().epoch(B), None);
        // B comes back as a TCP node at another address: the failure at
        // the old one is forgotten, and a new stream gets its link.
        let b_tcp = tcp_node(B).await;
        assert!(a.node().backoff(B) > Duration::ZERO);
        assert_eq!(a.register(&b_tcp.address()), Ok(B));
        assert_eq!(a.last_dial_failure(B), None);
        assert_eq!(
            a.node().backoff(B),
            Duration::ZERO,
            "no backoff carried over"
        );
        let mut again = a.mux().open(B, StreamKey::new(3, 2)).expect("open");
        again.send(Bytes::from_static(b"y")).await.expect("queued");
        until(|| a.mux().epoch(B).is_some()).await;
        assert_eq!(a.last_dial_failure(B), None);
    })
    .await;
}

/// A node whose send pool holds `pool_buffers` chunks; links retransmit
/// only every ~2 s (`timeout` 19), so a partitioned peer's SENDs stay in
/// flight, holding their chunks, for the whole test.
async fn pooled(id: PeerId, pool_buffers: usize) -> Transport {
    let base = config(id, None);
    let config = RdmaNodeConfig {
        pool_buffers,
        rdma: RdmaConfig {
            timeout: 19,
            ..base.rdma
        },
        ..base
    };
    RdmaTransport::start(device().await, config)
        .await
        .expect("start")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_peers_stream_through_a_send_pool_smaller_than_their_send_buffers() {
    bounded(async {
        // 3 chunks for 4 links of 8 send buffers; one link holds at most 2.
        let a = pooled(A, 3).await;
        let mut peers = Vec::new();
        for id in [B, C, D, E] {
            peers.push(transport(id, None).await);
        }
        let mut all: Vec<&Transport> = peers.iter().collect();
        all.push(&a);
        mesh(&all);
        stream_to_four(&a, &peers, 100).await;
        for p in &peers {
            assert_eq!(a.mux().epoch(p.node().id()), Some(Epoch(1)));
            assert_eq!(p.mux().stats().slots_dropped, 0);
            no_rnr(p);
        }
        let pool = a.pool_stats();
        assert_eq!((pool.chunks, pool.leases), (3, 4));
        assert_eq!(pool.in_use + pool.free, 3);
        assert_eq!(
            a.device().mr_count(),
            1 + 4 * 16,
            "one pool MR and four receive rings"
        );
        no_rnr(&a);
    })
    .await;
}

/// Binds a slot on `to` and floods it from `from` with six records larger
/// than a batch; the producer runs on its own and says whether every record
/// and the finish were accepted.
fn flood(
    from: &Transport,
    to: &Transport,
    anchor: u64,
) -> (qpmux::mux::SlotReceiver, tokio::task::JoinHandle<bool>) {
    let key = StreamKey::new(anchor, 0);
    let rx = to.mux().bind(key).expect("bind");
    let mut tx = from.mux().open(to.node().id(), key).expect("open");
    let producer = tokio::spawn(async move {
        for n in 0..6 {
            if tx.send(record(0, n, 20_000)).await.is_err() {
                return false;
            }
        }
        tx.finish(Terminal::Finalized).is_ok()
    });
    (rx, producer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_sends_cannot_complete_does_not_starve_another() {
    bounded(async {
        // 4 chunks: a link holds at most 2 of them, below its 8 send buffers.
        let a = pooled(A, 4).await;
        let b = pooled(B, 4).await;
        let c = pooled(C, 4).await;
        mesh(&[&a, &b, &c]);
        a.node().connect(B).await.expect("link to B");
        a.node().connect(C).await.expect("link to C");
        b.device().set_partitioned(true);
        let (mut rx_b, producer) = flood(&a, &b, 1);
        // B's link takes its share and keeps it: nothing it sends completes.
        until(|| a.pool_stats().in_use >= 2).await;
        let to_b = a.node().link(B).expect("link to B");
        stream(a.mux(), C, c.mux(), 3, 50).await;
        assert_eq!(to_b.end_reason(), None, "B's link was stuck, not dead");
        assert_eq!(to_b.stats().batches_received, 0, "B stayed cut off");
        b.device().set_partitioned(false);
        assert_eq!(in_order_to_finalized(&mut rx_b).await.0, 6);
        assert!(producer.await.expect("producer"), "all accepted");
        assert_eq!(a.mux().epoch(B), Some(Epoch(1)), "no epoch died");
        assert_eq!(a.mux().epoch(C), Some(Epoch(1)));
        for t in [&a, &b, &c] {
            no_rnr(t);
        }
    })
    .await;
}

/// The pool's line is first come, first served: a link waiting on an
/// exhausted pool keeps its place while its peer's batches come in. Its
/// peer task used to make a fresh `reserve` every turn, so each batch
/// received put it at the back of the line again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_waiting_on_an_empty_pool_keeps_its_place_while_batches_arrive() {
    const BATCHES: u32 = 40;
    bounded(async {
        // 4 chunks, 2 a link: B's and C's stuck links take them all.
        let a = pooled(A, 4).await;
        let b = pooled(B, 4).await;
        let c = pooled(C, 4).await;
        let d = pooled(D, 4).await;
        mesh(&[&a, &b, &c, &d]);
        for peer in [B, C, D] {
            a.node().connect(peer).await.expect("link");
        }
        b.device().set_partitioned(true);
        c.device().set_partitioned(true);
        let (mut rx_b, to_b) = flood(&a, &b, 1);
        let (mut rx_c, to_c) = flood(&a, &c, 2);
        until(|| a.pool_stats().free == 0).await;
        // A has records for D and no chunk to write them in.
        let waits = a.pool_stats().waits;
        let (mut rx_d, to_d) = flood(&a, &d, 3);
        until(|| a.pool_stats().waits > waits).await;
        // D's batches come in one by one, each a turn of A's peer task.
        let key = StreamKey::new(4, 0);
        let mut from_d = a.mux().bind(key).expect("bind");
        let mut tx = d.mux().open(A, key).expect("open");
        for n in 0..BATCHES {
            tx.send(record(0, n, 100)).await.expect("send");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        tx.finish(Terminal::Finalized).expect("finish");
        assert_eq!(in_order_to_finalized(&mut from_d).await.0, BATCHES);
        let a_to_d = a.node().link(D).expect("link to D").stats();
        assert!(
            a_to_d.batches_received >= u64::from(BATCHES / 2),
            "{a_to_d:?}"
        );
        assert_eq!(a.pool_stats().free, 0, "still stuck behind B and C");
        // A returned D's credit alone, short of chunks, not of credit: its
        // waiting `reserve` does not ask D to hurry credit back, and D does
        // not answer each of A's credit-only messages with one (13 of 13
        // when a wait for a chunk set the starved bit; 0 of 10 now).
        let d_to_a = d.node().link(A).expect("link to A").stats();
        assert!(a_to_d.credit_only_sent > 0, "{a_to_d:?}");
        assert!(
            d_to_a.credit_only_sent <= a_to_d.credit_only_sent / 4 + 1,
            "{d_to_a:?}"
        );
        assert_eq!(
            a.pool_stats().waits,
            waits + 1,
            "one wait, in line throughout"
        );
        b.device().set_partitioned(false);
        c.device().set_partitioned(false);
        for (rx, producer) in [(&mut rx_b, to_b), (&mut rx_c, to_c), (&mut rx_d, to_d)] {
            assert_eq!(in_order_to_finalized(rx).await.0, 6);
            assert!(producer.await.expect("producer"), "all accepted");
        }
        for t in [&a, &b, &c, &d] {
            no_rnr(t);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_epoch_death_returns_every_chunk_and_the_next_epoch_works() {
    bounded(async {
        let a = pooled(A, 4).await;
        let b = pooled(B, 4).await;
        mesh(&[&a, &b]);
        a.node().connect(B).await.expect("link");
        b.device().set_partitioned(true);
        let (_rx_b, producer) = flood(&a, &b, 1);
        until(|| a.pool_stats().in_use == 2).await;
        let link = a.node().link(B).expect("link");
        link.inject_qp_error().expect("QP to ERR");
        // The flushed SENDs give their chunks back, each exactly once.
        until(|| a.pool_stats().in_use == 0).await;
        assert_eq!(a.pool_stats().free, 4);
        assert!(matches!(link.end_reason(), Some(EpochEnd::Fault(_))));
        drop(producer); // its records were queued; the dead epoch dropped them
        b.device().set_partitioned(false);
        drop(link);
        stream(a.mux(), B, b.mux(), 7, 8).await;
        assert_eq!(a.mux().epoch(B), Some(Epoch(2)));
        let pool = a.pool_stats();
        assert_eq!(pool.in_use + pool.free, 4);
        no_rnr(&a);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qps_killed_before_any_batch_back_off_within_bounds_and_traffic_resets_it() {
    let mut a_config = config(A, None);
    a_config.connector.backoff_min = Duration::from_millis(20);
    a_config.connector.backoff_max = Duration::from_millis(160);
    a_config.connector.handshake_timeout = Duration::from_secs(2);
    a_config.mux = relink::held_back();
    let connector = a_config.connector.clone();
    let a = RdmaTransport::start(device().await, a_config)
        .await
        .expect("bind");
    let b = transport(B, None).await;
    mesh(&[&a, &b]);
    let dialing = relink::Dialing {
        node: a.node(),
        mux: a.mux(),
        backoff_min: connector.backoff_min,
        backoff_max: connector.backoff_max,
        handshake_timeout: connector.handshake_timeout,
    };
    relink::traffic_less_epochs_back_off_and_the_held_slot_survives(dialing, B, b.mux(), 6).await;
    assert_eq!(a.node().stats().dial_failures, 0);
    no_rnr(&a);
    no_rnr(&b);
}

/// The RDMA node's hello carries its windows too: a sender with 16× the
/// receiver's slot window and 8,192× its peer window sends within the
/// receiver's, and no epoch dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rdma_sender_sends_within_its_receivers_smaller_windows() {
    bounded(async {
        let a = transport(A, None).await;
        let b_config = RdmaNodeConfig {
            mux: MuxConfig {
                slot_window: 16 * 1024,
                peer_window: 8 * 1024,
                ..MuxConfig::default()
            },
            ..config(B, None)
        };
        let b = RdmaTransport::start(device().await, b_config)
            .await
            .expect("bind");
        mesh(&[&a, &b]);
        slots::late_consumer_stream(a.mux(), A, b.mux(), B, 9).await;
    })
    .await;
}

fn registered_bytes(t: &Transport) -> u64 {
    t.metrics()
        .into_iter()
        .find(|(name, _)| *name == "qpmux_registered_bytes")
        .expect("gauge")
        .1
}

/// A and B linked, a stream carried A → B; with A's registered bytes
/// before the link, which its receive ring now adds to.
async fn a_linked_to_b() -> (Transport, Transport, u64) {
    let a = transport(A, None).await;
    let b = transport(B, None).await;
    mesh(&[&a, &b]);
    let idle = registered_bytes(&a);
    stream(a.mux(), B, b.mux(), 7, 2).await;
    assert!(registered_bytes(&a) > idle, "a link end holds its ring");
    (a, b, idle)
}

/// `unregister` forgets a peer for good (what a server that serves many
/// short-lived clients relies on): its link ends and is released, its
/// receive ring leaving the registered-memory gauge, and a slot opened to it
/// afterwards gets no dial, so a peer that has gone is not dialled forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unregistered_peer_is_released_and_not_dialled_again() {
    bounded(async {
        let (a, b, idle) = a_linked_to_b().await;
        // The peer goes away; then it is forgotten.
        b.shutdown();
        drop(b);
        until(|| a.mux().epoch(B).is_none()).await;
        a.unregister(B);
        until(|| registered_bytes(&a) == idle).await;
        let dials = |t: &Transport| {
            let s = t.node().stats();
            s.established + s.dial_failures
        };
        let before = dials(&a);
        let tx = a.mux().open(B, StreamKey::new(8, 0));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(dials(&a), before, "dialled a forgotten peer");
        drop(tx);
    })
    .await;
}

/// A registered peer's dead link is let go once the mux is done with it,
/// though nothing is queued for the peer (review 48c: the connector kept it,
/// its QP and its registered ring, until the application sent to the peer
/// again); how it ended stays readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_peers_dead_link_is_let_go_without_waiting_for_work() {
    bounded(async {
        let (a, b, idle) = a_linked_to_b().await;
        assert_eq!(a.node().link_end(B), None, "live");
        b.shutdown();
        drop(b);
        until(|| a.mux().epoch(B).is_none()).await;
        until(|| registered_bytes(&a) == idle && a.device().qp_count() == 0).await;
        assert!(a.node().link(B).is_none());
        assert!(
            matches!(
                a.node().link_end(B),
                Some(EpochEnd::PeerClosed | EpochEnd::PeerLost)
            ),
            "{:?}",
            a.node().link_end(B)
        );
    })
    .await;
}

/// A peer that only ever dialled in (never registered here, so never
/// unregistered either) is let go when its link ends: a server that many
/// short-lived clients dial gets its receive rings back without a call per
/// client, and its connection table does not keep one entry per client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_only_dialled_in_is_released_when_its_link_ends() {
    bounded(async {
        let a = transport(A, None).await;
        let idle = registered_bytes(&a);
        for (round, id) in [B, C, D].into_iter().enumerate() {
            let client = transport(id, None).await;
            assert_eq!(client.register(&a.address()), Ok(A));
            stream(client.mux(), A, a.mux(), 10 + round as u64, 2).await;
            assert!(registered_bytes(&a) > idle, "a link end holds its ring");
            client.shutdown();
            drop(client);
            until(|| a.mux().epoch(id).is_none()).await;
            until(|| registered_bytes(&a) == idle).await;
            until(|| a.node().stats().peers_known == 0).await;
        }
    })
    .await;
}

/// The RDMA node refuses a mux configuration no peer would accept, before
/// it binds or registers anything.
#[tokio::test]
async fn an_rdma_node_refuses_to_start_on_a_peer_window_that_holds_no_record() {
    let device = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback");
    let config = RdmaNodeConfig {
        mux: MuxConfig {
            peer_window: 64,
            ..MuxConfig::default()
        },
        ..RdmaNodeConfig::new(PeerId(1))
    };
    let err = RdmaTransport::start(device, config)
        .await
        .err()
        .expect("refused");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("peer_window"), "{err}");
}

/// Two nodes shut down and dropped leave no task behind: listeners,
/// liveness, the soft drivers, the stall sweeps (whose prompt end is
/// `node::tests::the_stall_sweep_ends_with_the_epochs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_nodes_leave_no_task_behind() {
    let alive = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    assert_eq!(alive(), 0, "the test's own runtime");
    let (a, b) = (transport(A, None).await, transport(B, None).await);
    mesh(&[&a, &b]);
    bounded(stream(a.mux(), B, b.mux(), 1, 2)).await;
    assert!(a.node().epochs().swept_links() > 0, "a link is being swept");
    a.shutdown();
    b.shutdown();
    bounded(async {
        a.mux().closed().await;
        b.mux().closed().await;
    })
    .await;
    drop((a, b));
    bounded(until(|| alive() == 0)).await;
}
