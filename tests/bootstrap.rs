//! The bootstrap handshake over real loopback sockets: node to node, and a
//! raw hostile client against a node's listener. Waits are on states.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::bootstrap::{
    BootstrapError, ClusterKey, DeclineReason, MAX_MESSAGE, PROTOCOL_VERSION as V,
};
use qpmux::link::tcp::{ConnectError, TcpLink, TcpNode, TcpNodeConfig};
use qpmux::link::{EpochEnd, Link, LinkFault, ReadOutOwner};
use qpmux::mux::{
    Epoch, Frame, Mux, MuxConfig, MuxTransport, PeerId, RECORD_OVERHEAD, StreamKey, Terminal,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "common/slots.rs"]
mod slots;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const KEY: &[u8] = b"cluster key for the bootstrap ok";

async fn node(id: PeerId, key: Option<&[u8]>) -> (TcpNode, Mux<TcpLink>) {
    node_with_timeout(id, key, Duration::from_secs(5)).await
}

async fn node_with_timeout(
    id: PeerId,
    key: Option<&[u8]>,
    handshake_timeout: Duration,
) -> (TcpNode, Mux<TcpLink>) {
    let config = TcpNodeConfig {
        key: key.and_then(ClusterKey::new),
        handshake_timeout,
        ..TcpNodeConfig::new(id)
    };
    node_with(config, MuxConfig::default()).await
}

async fn node_with(config: TcpNodeConfig, mux: MuxConfig) -> (TcpNode, Mux<TcpLink>) {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    TcpNode::start(config, addr, mux).await.expect("bind")
}

async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("test did not reach its state")
}

async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Connects raw and reads the listener's challenge; returns its nonce.
async fn raw(node: &TcpNode) -> (TcpStream, [u8; 32]) {
    let mut s = TcpStream::connect(node.local_addr())
        .await
        .expect("connect");
    let mut frame = [0u8; 4 + 39];
    s.read_exact(&mut frame).await.expect("challenge");
    assert_eq!(frame[..4], 39u32.to_be_bytes());
    assert_eq!(frame[4], 1, "challenge kind");
    assert_eq!(&frame[5..9], b"QPMX");
    assert_eq!(frame[9..11], V.to_be_bytes(), "version");
    let mut nonce = [0u8; 32];
    nonce.copy_from_slice(&frame[11..]);
    (s, nonce)
}

/// A keyless dialer hello, framed, byte by byte per docs/bootstrap.md.
fn hello(version: u16, node: PeerId, echo: &[u8; 32], max_batch: u32) -> Vec<u8> {
    hello_with_windows(
        version,
        node,
        echo,
        max_batch,
        (256 * 1024, 64 << 20, 64 << 20),
    )
}

/// A hello's slot window, peer window and peer credit.
type Windows = (u32, u32, u32);

fn hello_with_windows(
    version: u16,
    node: PeerId,
    echo: &[u8; 32],
    max_batch: u32,
    windows: Windows,
) -> Vec<u8> {
    let mut body = vec![2u8];
    body.extend_from_slice(b"QPMX");
    body.extend_from_slice(&version.to_be_bytes());
    body.extend_from_slice(&node.0.to_be_bytes());
    body.extend_from_slice(&7u64.to_be_bytes()); // incarnation
    body.extend_from_slice(&0u64.to_be_bytes()); // proposed epoch
    body.extend_from_slice(echo);
    body.extend_from_slice(&[0xd1; 32]); // dialer nonce
    body.push(1); // endpoint kind: tcp
    body.extend_from_slice(&4u16.to_be_bytes());
    body.extend_from_slice(&max_batch.to_be_bytes());
    body.extend_from_slice(&windows.0.to_be_bytes());
    body.extend_from_slice(&windows.1.to_be_bytes());
    body.extend_from_slice(&windows.2.to_be_bytes());
    body.extend_from_slice(&(16u32 << 20).to_be_bytes()); // max record
    body.extend_from_slice(&65_536u32.to_be_bytes()); // max slots
    body.push(0); // no MAC
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

/// Reads until the listener closes the connection (EOF or reset).
async fn closed(mut s: TcpStream) {
    let mut buf = [0u8; 256];
    while let Ok(n) = s.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}

/// Waits for refusal number `n` and returns its reason.
async fn refusal(node: &TcpNode, n: u64) -> Option<ConnectError> {
    until(|| node.stats().refused >= n).await;
    node.last_refusal()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_to_node_with_and_without_a_key() {
    bounded(async {
        for key in [Some(KEY), None] {
            let (a_node, a) = node(A, key).await;
            let (b_node, b) = node(B, key).await;
            a_node.register(B, b_node.local_addr());
            assert_eq!(a_node.connect(B).await, Ok(Epoch(1)));
            until(|| b.epoch(A).is_some() && a.epoch(B).is_some()).await;
            assert_eq!(b.epoch(A), Some(Epoch(1)));
            assert_eq!(a.epoch(B), Some(Epoch(1)));
            // Each link's read-out comes from its peer's share, and B never
            // registered A, which only dialled in.
            let owner = |node: &TcpNode, peer| node.link(peer).and_then(|l| l.read_out_owner());
            // Its read-outs count against the source it dialled in from.
            let registered = |peer, registered, source: Option<&str>| {
                Some(ReadOutOwner {
                    peer,
                    registered,
                    source: source.map(|ip| ip.parse().expect("an address")),
                })
            };
            assert_eq!(owner(&a_node, B), registered(B, true, None));
            until(|| b_node.link(A).is_some()).await;
            assert_eq!(owner(&b_node, A), registered(A, false, Some("127.0.0.1")));
            // A deliberate reconnect proposes the running epoch: epoch 2 replaces it.
            assert_eq!(a_node.connect(B).await, Ok(Epoch(2)));
            until(|| b.epoch(A) == Some(Epoch(2)) && a.epoch(B) == Some(Epoch(2))).await;
        }
    })
    .await;
}

/// A peer that only dialled in leaves the listener's mux with its last
/// link: the peer task retires as soon as it holds nothing, not
/// `idle_retire` (60 s here, past the test's bound) later, so ids that
/// handshake and go leave neither entries nor tasks behind. A registered
/// peer's entry waits out its idle period, as the peer may be dialled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_that_only_dialled_in_leave_the_mux_with_their_last_link() {
    bounded(async {
        let (b_node, b) = node(B, None).await;
        for id in 100..104 {
            let (node, mux) = node(PeerId(id), None).await;
            node.register(B, b_node.local_addr());
            // (Each later id's first epoch is above the let-go ids' last.)
            assert!(node.connect(B).await.is_ok());
            until(|| b.epoch(PeerId(id)).is_some()).await;
            node.shutdown();
            mux.shutdown();
        }
        until(|| b.peer_count() == 0).await;
        assert_eq!(
            b_node.stats().peers_known,
            0,
            "the connector let them go too"
        );
        // B registered A: its entry stays after A's link ends.
        let (a_node, a) = node(A, None).await;
        b_node.register(A, a_node.local_addr());
        assert!(b_node.connect(A).await.is_ok());
        let link = b_node.link(A).expect("b's link to a");
        a_node.shutdown();
        a.shutdown();
        until(|| link.is_ended()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(b.peer_count(), 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_is_refused_and_named_on_the_listener() {
    bounded(async {
        let (a_node, _a) = node(A, Some(b"another cluster's key, 32 bytes!")).await;
        let (b_node, b) = node(B, Some(KEY)).await;
        a_node.register(B, b_node.local_addr());
        let dialed = a_node.connect(B).await;
        assert!(
            matches!(
                dialed,
                Err(ConnectError::Handshake(_)) | Err(ConnectError::Io(_))
            ),
            "{dialed:?}"
        );
        assert_eq!(
            refusal(&b_node, 1).await,
            Some(ConnectError::Handshake(BootstrapError::BadMac))
        );
        assert_eq!(b.epoch(A), None);
    })
    .await;
}

/// One thread, so both dials are in flight before either listener answers:
/// on two, A's whole handshake could finish before B's `connect` first ran,
/// and B's would then be a deliberate reconnect (epoch 2), not a crossing.
#[tokio::test(flavor = "current_thread")]
async fn crossed_connects_settle_on_the_lower_ids_dial() {
    bounded(async {
        let (a_node, a) = node(A, Some(KEY)).await;
        let (b_node, b) = node(B, Some(KEY)).await;
        a_node.register(B, b_node.local_addr());
        b_node.register(A, a_node.local_addr());
        let (from_a, from_b) = tokio::join!(a_node.connect(B), b_node.connect(A));
        assert_eq!(from_a, Ok(Epoch(1)), "the lower id's dial wins");
        assert_eq!(
            from_b,
            Err(ConnectError::DeclinedByPeer(DeclineReason::CrossedDial))
        );
        until(|| b.epoch(A).is_some() && a.epoch(B).is_some()).await;
        assert_eq!((a.epoch(B), b.epoch(A)), (Some(Epoch(1)), Some(Epoch(1))));
        assert_eq!(a_node.stats().refused + b_node.stats().refused, 0);
        assert_eq!(a_node.stats().established, 1);
        assert_eq!(b_node.stats().established, 1);
    })
    .await;
}

/// A node does not start on windows every peer's hello check refuses: it
/// says why at once instead of failing every handshake.
#[tokio::test]
async fn a_node_refuses_to_start_on_windows_no_peer_accepts() {
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    for (slot_window, peer_window, named) in [
        (0, 1 << 20, "slot_window"),
        (1 << 20, RECORD_OVERHEAD as u32, "peer_window"),
    ] {
        let mux = MuxConfig {
            slot_window,
            peer_window,
            ..MuxConfig::default()
        };
        let err = TcpNode::start(TcpNodeConfig::new(A), addr, mux)
            .await
            .err()
            .expect("refused");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains(named), "{err}");
    }
    let smallest = MuxConfig {
        peer_window: RECORD_OVERHEAD as u32 + 1,
        ..MuxConfig::default()
    };
    assert!(
        TcpNode::start(TcpNodeConfig::new(A), addr, smallest)
            .await
            .is_ok()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_are_refused_with_named_errors_and_the_listener_keeps_serving() {
    bounded(async {
        // Short enough for the silent client below, long enough for a loaded CI box.
        let (l_node, l) = node_with_timeout(B, None, Duration::from_secs(3)).await;
        let mut n = 0;
        let mut expect = async |bytes: Vec<u8>, close: bool, want: BootstrapError| {
            let (mut s, _nonce) = raw(&l_node).await;
            s.write_all(&bytes).await.expect("write");
            if close {
                s.shutdown().await.expect("shutdown");
            }
            n += 1;
            assert_eq!(
                refusal(&l_node, n).await,
                Some(ConnectError::Handshake(want)),
                "case {n}"
            );
            closed(s).await;
        };
        expect(
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            false,
            BootstrapError::Oversized {
                len: u32::from_be_bytes(*b"GET "),
                max: MAX_MESSAGE,
            },
        )
        .await;
        expect(
            u32::MAX.to_be_bytes().to_vec(),
            false,
            BootstrapError::Oversized {
                len: u32::MAX,
                max: MAX_MESSAGE,
            },
        )
        .await;
        expect(
            vec![0, 0, 0, 3, 0x42, 0, 0],
            false,
            BootstrapError::UnknownMessage(0x42),
        )
        .await;
        // A ready before any hello.
        let mut ready = vec![0, 0, 0, 10, 3];
        ready.extend_from_slice(&1u64.to_be_bytes());
        ready.push(0);
        expect(
            ready,
            false,
            BootstrapError::Unexpected {
                expected: qpmux::link::bootstrap::MessageKind::Hello,
                got: qpmux::link::bootstrap::MessageKind::Ready,
            },
        )
        .await;
        // A hello echoing a nonce from some other connection (replay).
        expect(
            hello(V, A, &[0x55; 32], 65536),
            false,
            BootstrapError::StaleNonce,
        )
        .await;
        // Half a message, then EOF.
        let half = hello(V, A, &[0; 32], 65536)[..40].to_vec();
        expect(half, true, BootstrapError::Truncated).await;

        // Cases that need the connection's own nonce.
        let cases: [(u16, PeerId, u32, Windows, BootstrapError); 10] = [
            (
                1,
                A,
                65536,
                (1, 4096, 1),
                BootstrapError::BadVersion { got: 1 },
            ),
            // Version 2 started each epoch on the whole peer window.
            (
                2,
                A,
                65536,
                (1, 4096, 1),
                BootstrapError::BadVersion { got: 2 },
            ),
            // Version 4 counted records by their bytes alone.
            (
                4,
                A,
                65536,
                (1, 4096, 1),
                BootstrapError::BadVersion { got: 4 },
            ),
            // Version 5 did not say its slot limit.
            (
                5,
                A,
                65536,
                (1, 4096, 1),
                BootstrapError::BadVersion { got: 5 },
            ),
            (
                V,
                A,
                1,
                (1, 4096, 1),
                BootstrapError::BadField("tcp max_batch"),
            ),
            (
                V,
                A,
                65536,
                (0, 4096, 1),
                BootstrapError::BadField("slot window"),
            ),
            (
                V,
                A,
                65536,
                (1, 0, 0),
                BootstrapError::BadField("peer window"),
            ),
            // Too small for one record's overhead.
            (
                V,
                A,
                65536,
                (1, RECORD_OVERHEAD as u32, 0),
                BootstrapError::BadField("peer window"),
            ),
            (
                V,
                A,
                65536,
                (1, 4096, 4097),
                BootstrapError::BadField("peer credit"),
            ),
            (V, B, 65536, (1, 4096, 1), BootstrapError::SelfConnect),
        ];
        for (version, id, max_batch, windows, want) in cases {
            let (mut s, nonce) = raw(&l_node).await;
            s.write_all(&hello_with_windows(version, id, &nonce, max_batch, windows))
                .await
                .expect("write");
            n += 1;
            assert_eq!(
                refusal(&l_node, n).await,
                Some(ConnectError::Handshake(want))
            );
            closed(s).await;
        }
        // A client that never speaks is cut off by the handshake timeout.
        let (silent, _) = raw(&l_node).await;
        n += 1;
        assert_eq!(refusal(&l_node, n).await, Some(ConnectError::Timeout));
        closed(silent).await;

        // A well-behaved raw dialer still gets the listener's hello.
        let (mut s, nonce) = raw(&l_node).await;
        s.write_all(&hello(V, A, &nonce, 65536))
            .await
            .expect("write");
        let mut len = [0u8; 4];
        s.read_exact(&mut len).await.expect("listener hello");
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut body).await.expect("listener hello");
        assert_eq!(body[0], 2, "a hello");
        assert_eq!(
            body[7..15],
            B.0.to_be_bytes(),
            "from the listener's node id"
        );
        drop(s);
        assert_eq!(l.epoch(A), None, "no ready, no epoch");
        // Closing after the answer is a withdrawal, not a refusal.
        until(|| l_node.stats().withdrawn == 1).await;
        assert_eq!(l_node.stats().refused, n);

        // And a real node connects.
        let (a_node, _a) = node(A, None).await;
        a_node.register(B, l_node.local_addr());
        assert_eq!(a_node.connect(B).await, Ok(Epoch(1)));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_listener_refuses_a_dialer_without_proof() {
    bounded(async {
        let (l_node, _l) = node(B, Some(KEY)).await;
        let (mut s, nonce) = raw(&l_node).await;
        s.write_all(&hello(V, A, &nonce, 65536))
            .await
            .expect("write");
        assert_eq!(
            refusal(&l_node, 1).await,
            Some(ConnectError::Handshake(BootstrapError::MissingMac))
        );
        closed(s).await;
    })
    .await;
}

/// Sender and receiver with slot windows 16× apart and peer windows 8,192×
/// apart, each way round: the hello tells the sender the receiver's windows,
/// and its slots send within them. (Before the windows were in the hello, a
/// sender with the larger ones used its own, and its receiver ended every
/// epoch with a `CreditOverrun` or `PeerCreditOverrun`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_send_within_the_receivers_windows_either_way_round() {
    let small = MuxConfig {
        slot_window: 16 * 1024,
        peer_window: 8 * 1024,
        ..MuxConfig::default()
    };
    for (sender, receiver) in [
        (MuxConfig::default(), small.clone()),
        (small.clone(), MuxConfig::default()),
    ] {
        bounded(one_stream_between(sender, receiver)).await;
    }
}

/// Over real hellos: streams nobody here reads stay counted when the link
/// dies, so the next epoch's hello gives the peer only the room left. Its
/// sender waits there (a stall, not an epoch death) until a consumer here
/// reads one of the old streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_starts_on_the_room_the_last_epochs_unread_streams_left() {
    bounded(async {
        let receiver = MuxConfig {
            slot_window: 32 * 1024,
            peer_window: 64 * 1024,
            ..MuxConfig::default()
        };
        let (a_node, a) = node_with(TcpNodeConfig::new(A), MuxConfig::default()).await;
        let (b_node, b) = node_with(TcpNodeConfig::new(B), receiver).await;
        a_node.register(B, b_node.local_addr());
        b_node.register(A, a_node.local_addr());
        // Each record counts 16 KiB with its overhead.
        let chunk = Bytes::from(vec![7u8; 16 * 1024 - RECORD_OVERHEAD]);
        let key = |n: u64| StreamKey::new(A.0, 500 + n);
        for n in 0..3 {
            let mut tx = a.open(B, key(n)).expect("open");
            tx.send(chunk.clone()).await.expect("send");
            tx.finish(Terminal::Finalized).expect("finish");
        }
        until(|| b.stats().peer_held_bytes == 48 * 1024).await;
        assert_eq!(b.peer_room(A), 0, "the live epoch granted the rest");
        let first = b.epoch(A).expect("a live epoch");
        a_node
            .link(B)
            .expect("a link")
            .fail(EpochEnd::Fault(LinkFault::Injected));
        until(|| b.epoch(A).is_none()).await;
        assert_eq!(
            b.peer_room(A),
            16 * 1024,
            "the dead epoch's streams still count"
        );

        let mut tx = a.open(B, key(3)).expect("open");
        tx.send(chunk.clone()).await.expect("within the room");
        tx.send(chunk.clone()).await.expect("queued");
        until(|| a.stats().peer_credit_stalls > 0).await;
        // The sender may stall before this side's peer task has taken the
        // new link up: wait for it, do not sample it.
        until(|| b.epoch(A).is_some_and(|e| e > first)).await;
        let mut fresh = b.bind(key(3)).expect("bind");
        assert_eq!(fresh.recv().await, Some(Frame::Data(chunk.clone())));
        let mut old = b.bind(key(0)).expect("bind");
        assert_eq!(old.recv().await, Some(Frame::Data(chunk.clone())));
        assert_eq!(old.recv().await, Some(Frame::Finalized));
        assert_eq!(
            fresh.recv().await,
            Some(Frame::Data(chunk.clone())),
            "the read freed room for the stalled record"
        );
        assert_eq!(b.stats().protocol_violations, 0);
        assert_eq!(a.stats().protocol_violations, 0);
    })
    .await;
}

/// 64 KiB on one slot from a node with `sender`'s config to one with
/// `receiver`'s, the consumer starting late so the sender meets the window.
async fn one_stream_between(sender: MuxConfig, receiver: MuxConfig) {
    let (a_node, a) = node_with(TcpNodeConfig::new(A), sender).await;
    let (b_node, b) = node_with(TcpNodeConfig::new(B), receiver).await;
    a_node.register(B, b_node.local_addr());
    b_node.register(A, a_node.local_addr());
    slots::late_consumer_stream(&a, A, &b, B, 4).await;
}

/// Reads one framed handshake message and returns its body.
async fn message(s: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.expect("a message's length");
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).await.expect("a message's body");
    body
}

/// A second dial from the same process while its first is still finishing
/// the handshake here is declined as unavailable: the first installs, then
/// the redial replaces it, so what the peer sent on the first is read out
/// before the second epoch (it used to be accepted, and the first, installed
/// last, refused as superseded with what was sent on it).
#[tokio::test]
async fn a_dial_while_the_same_processs_last_one_finishes_its_handshake_is_declined() {
    bounded(async {
        let (b_node, _b) = node(B, None).await;
        let (mut first, nonce) = raw(&b_node).await;
        first
            .write_all(&hello(V, A, &nonce, 64 * 1024))
            .await
            .expect("hello");
        assert_eq!(message(&mut first).await[0], 2, "the listener's hello");
        let (mut second, nonce) = raw(&b_node).await;
        second
            .write_all(&hello(V, A, &nonce, 64 * 1024))
            .await
            .expect("hello");
        assert_eq!(
            message(&mut second).await,
            vec![4, 3],
            "declined: unavailable"
        );
        assert_eq!(b_node.stats().refused, 0, "a decline, not a refusal");
    })
    .await;
}
