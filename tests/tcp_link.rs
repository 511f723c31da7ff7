//! Two (or three) `Mux<TcpLink>` nodes over real loopback sockets.
//! Every wait is on a state; the outer timeout only turns a hang into a failure.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::bootstrap::ClusterKey;
use qpmux::link::tcp::{
    ConnectError, ReadOutBudget, TcpLink, TcpLinkConfig, TcpNode, TcpNodeConfig,
};
use qpmux::link::{EpochEnd, Link, LinkError, LinkFault, ReadOutOwner, ReadOutTier};
use qpmux::mux::{
    DropReason, Epoch, Frame, Mux, MuxConfig, MuxTransport, PeerId, ProtocolError, SendError,
    SlotSender, StreamKey, Terminal,
};
use rand::Rng;

#[path = "common/slots.rs"]
mod slots;
use slots::{
    Traffic, in_order_to_finalized, never, prefix_then_one_dropped, record, seq_of, stream_tasks,
};
#[path = "common/arrivals.rs"]
mod arrivals;
#[path = "common/relink.rs"]
mod relink;
use relink::{Dialing, held_back, within};

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const C: PeerId = PeerId(3);

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().expect("addr")
}

fn config(id: PeerId, key: Option<&[u8]>) -> TcpNodeConfig {
    TcpNodeConfig {
        key: key.and_then(ClusterKey::new),
        link: TcpLinkConfig {
            max_batch: 16 * 1024,
            ..TcpLinkConfig::default()
        },
        ..TcpNodeConfig::new(id)
    }
}

async fn node(id: PeerId, key: Option<&[u8]>) -> (TcpNode, Mux<TcpLink>) {
    TcpNode::start(config(id, key), any_port(), MuxConfig::default())
        .await
        .expect("bind")
}

/// A node whose failed dials always wait `backoff` before the next.
async fn node_backing_off(id: PeerId, backoff: Duration) -> (TcpNode, Mux<TcpLink>) {
    let config = TcpNodeConfig {
        backoff_min: backoff,
        backoff_max: backoff,
        ..config(id, None)
    };
    TcpNode::start(config, any_port(), MuxConfig::default())
        .await
        .expect("bind")
}

/// Registers every node with every other.
fn mesh(nodes: &[&TcpNode]) {
    for a in nodes {
        for b in nodes {
            if a.id() != b.id() {
                a.register(b.id(), b.local_addr());
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
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("test did not reach its state")
}

/// Opens `slots` streams from `from` to `to_mux`'s node and sends `records`
/// random-size records on each (some larger than a 16 KiB batch); returns
/// when every record arrived in order, exactly once, and every stream finished.
async fn stream(from: &Mux<TcpLink>, to: PeerId, to_mux: &Mux<TcpLink>, anchor: u64, slots: u64) {
    let records = 5u32;
    let mut consumers = Vec::new();
    let mut producers = Vec::new();
    let traffic = Traffic {
        records,
        len: |_, _, rng| {
            if rng.random_bool(0.1) {
                rng.random_range(20_000..40_000)
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

/// Records a few ms apart find B's peer task waiting: B's link read task
/// decodes their batches and wakes the consumer itself, and every record
/// arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spaced_records_are_decoded_by_the_links_read_task() {
    bounded(async {
        let (a_node, a) = node(A, None).await;
        let (b_node, b) = node(B, None).await;
        mesh(&[&a_node, &b_node]);
        let key = StreamKey::new(B.0, 1);
        let mut rx = b.bind(key).expect("bind");
        let mut tx = a.open(B, key).expect("open");
        for n in 0..20u32 {
            tx.send(record(1, n, 64)).await.expect("send");
            match rx.recv().await {
                Some(Frame::Data(d)) => assert_eq!(seq_of(&d), n),
                other => panic!("expected record {n}, got {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let inline = b.stats().batches_received_inline;
        assert!(inline >= 10, "{inline} of 20 decoded by the read task");
        assert_eq!(b.stats().protocol_violations, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_slots_of_random_records_arrive_in_order_exactly_once() {
    bounded(async {
        let (a_node, a) = node(A, Some(b"a cluster key of 32 bytes here!!")).await;
        let (b_node, b) = node(B, Some(b"a cluster key of 32 bytes here!!")).await;
        mesh(&[&a_node, &b_node]);
        stream(&a, B, &b, 1, 200).await;
        assert_eq!(a.epoch(B), Some(Epoch(1)));
        assert_eq!(a.stats().slots_dropped, 0);
        assert_eq!(b.stats().slots_dropped, 0);
        assert_eq!(a_node.stats().established, 1);
        assert_eq!(b_node.stats().established, 1);
        let link = a_node.link(B).expect("link");
        assert_eq!(link.max_batch(), 16 * 1024);
        assert!(link.stats().batches_sent > 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_dialing_at_once_settle_on_one_connection_without_error() {
    bounded(async {
        for round in 0..3u64 {
            let (a_node, a) = node(A, None).await;
            let (b_node, b) = node(B, None).await;
            mesh(&[&a_node, &b_node]);
            // Both muxes get work for each other at once: both dial.
            let (ab, ba) = tokio::join!(
                stream(&a, B, &b, 10 + round, 20),
                stream(&b, A, &a, 20 + round, 20)
            );
            let ((), ()) = (ab, ba);
            for (n, m, peer) in [(&a_node, &a, B), (&b_node, &b, A)] {
                let stats = n.stats();
                assert_eq!(stats.established, 1, "one connection: {stats:?}");
                assert_eq!(stats.refused, 0, "{stats:?}");
                assert_eq!(stats.dial_failures, 0, "{stats:?}");
                assert_eq!(m.epoch(peer), Some(Epoch(1)));
                assert_eq!(m.stats().slots_dropped, 0);
                assert_eq!(m.stats().epoch_deaths, 0);
            }
            a.shutdown();
            b.shutdown();
            a_node.shutdown();
            b_node.shutdown();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_drops_every_live_slot_once_and_the_next_epoch_carries_new_slots() {
    bounded(async {
        let (a_node, a) = node(A, None).await;
        let (b_node, b) = node(B, None).await;
        mesh(&[&a_node, &b_node]);
        let n_slots = 32u64;
        let mut receivers = Vec::new();
        let mut senders = Vec::new();
        for s in 0..n_slots {
            let key = StreamKey::new(9, s);
            receivers.push(b.bind(key).expect("bind"));
            senders.push(a.open(B, key).expect("open"));
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
        let epoch = a.epoch(B).expect("link is up");
        a_node
            .link(B)
            .expect("link")
            .fail(EpochEnd::Fault(LinkFault::Injected));

        for rx in &mut receivers {
            prefix_then_one_dropped(rx, epoch).await;
        }
        // B saw the end first (EOF); A's own peer task ends its slots too.
        until(|| a.stats().slots_dropped == n_slots && b.stats().slots_dropped == n_slots).await;
        for tx in &mut senders {
            assert_eq!(
                tx.send(Bytes::from_static(b"late")).await,
                Err(SendError::Dropped(DropReason::EpochEnded { epoch }))
            );
        }

        // The next epoch (a new connection) carries new slots.
        drop(senders);
        stream(&a, B, &b, 11, 8).await;
        let next = a.epoch(B).expect("relinked");
        assert!(next > epoch, "{next} after {epoch}");
        assert_eq!(b.epoch(A), Some(next));
        assert_eq!(a.stats().slots_dropped, n_slots, "nothing dropped twice");
        assert_eq!(b.stats().slots_dropped, n_slots, "nothing dropped twice");
        assert_eq!(a_node.stats().dial_failures, 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_is_refused_while_a_correct_peer_connects() {
    bounded(async {
        let key: &[u8] = b"the right cluster key, 32 bytes!";
        let (a_node, a) = node(A, Some(b"the WRONG cluster key, 32 bytes!")).await;
        let (b_node, b) = node(B, Some(key)).await;
        let (c_node, c) = node(C, Some(key)).await;
        mesh(&[&a_node, &b_node, &c_node]);
        let key_ab = StreamKey::new(5, 1);
        let _rx_ab = b.bind(key_ab).expect("bind");
        let mut tx_ab = a.open(B, key_ab).expect("open");
        tx_ab
            .send(Bytes::from_static(b"intruder"))
            .await
            .expect("queued");
        until(|| b_node.stats().refused >= 1 && a_node.stats().dial_failures >= 1).await;
        assert!(matches!(
            b_node.last_refusal(),
            Some(ConnectError::Handshake(_))
        ));
        assert_eq!(b.epoch(A), None, "no epoch with the intruder");
        // The listener keeps serving the correct peer.
        stream(&c, B, &b, 6, 10).await;
        assert_eq!(b.epoch(C), Some(Epoch(1)));
        assert_eq!(b_node.stats().established, 1);
    })
    .await;
}

/// Starts node `id` again on `addr`, once the port is free.
async fn restart_on(id: PeerId, addr: SocketAddr) -> (TcpNode, Mux<TcpLink>) {
    loop {
        match TcpNode::start(config(id, None), addr, MuxConfig::default()).await {
            Ok(started) => break started,
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_on_the_same_address_gets_a_new_epoch() {
    bounded(async {
        let (a_node, a) = node(A, None).await;
        let (b_node, b) = node(B, None).await;
        mesh(&[&a_node, &b_node]);
        stream(&a, B, &b, 1, 4).await;
        assert_eq!(a.epoch(B), Some(Epoch(1)));
        let addr = b_node.local_addr();
        let old_incarnation = b_node.incarnation();
        b.shutdown();
        b_node.shutdown();
        drop(b);
        drop(b_node);
        // Wait until A's mux saw the old epoch end, so new slots open in the next one.
        until(|| a_node.link_end(B).is_some() && a.epoch(B).is_none()).await;
        // The same node id restarts on the same address (once the port is free).
        let (b2_node, b2) = restart_on(B, addr).await;
        assert_ne!(b2_node.incarnation(), old_incarnation);
        stream(&a, B, &b2, 2, 4).await;
        assert_eq!(a.epoch(B), Some(Epoch(2)), "max(1, 0) + 1");
        assert_eq!(b2.epoch(A), Some(Epoch(2)));
        assert_eq!(a_node.stats().restarts_seen, 1);
    })
    .await;
}

// ---- The link alone, over a loopback connection (no handshake). ----

async fn link_pair(config: &TcpLinkConfig) -> (TcpLink, TcpLink) {
    link_pair_with_buffers(config, None).await
}

/// A link pair whose sockets ask for `buffers` bytes of send and receive
/// buffer (the kernel doubles and floors it), so a few batches fill them.
async fn link_pair_with_buffers(
    config: &TcpLinkConfig,
    buffers: Option<usize>,
) -> (TcpLink, TcpLink) {
    let listener = tokio::net::TcpListener::bind(any_port())
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (dialed, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let (dialed, accepted) = (dialed.expect("connect"), accepted.expect("accept").0);
    if let Some(bytes) = buffers {
        for stream in [&dialed, &accepted] {
            let sock = socket2::SockRef::from(stream);
            sock.set_send_buffer_size(bytes).expect("SO_SNDBUF");
            sock.set_recv_buffer_size(bytes).expect("SO_RCVBUF");
        }
    }
    let a = TcpLink::new(dialed, Vec::new(), Epoch(1), config, config.max_batch).expect("link");
    let b = TcpLink::new(accepted, Vec::new(), Epoch(1), config, config.max_batch).expect("link");
    (a, b)
}

async fn post(link: &TcpLink, payload: &[u8]) {
    let mut buf = link.reserve().await.expect("reserve");
    buf[..payload.len()].copy_from_slice(payload);
    link.post(buf, payload.len()).expect("post");
}

/// True if `f` is ready on its first poll.
async fn ready_now<T>(f: impl Future<Output = T>) -> Option<T> {
    tokio::select! {
        biased;
        v = f => Some(v),
        () = std::future::ready(()) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_hands_batches_to_its_hook_in_order() {
    let (a, b) = link_pair(&TcpLinkConfig::default()).await;
    arrivals::the_reader_hands_batches_to_its_hook_in_order(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_sent_before_a_close_arrive_first_then_the_end() {
    bounded(async {
        let (a, b) = link_pair(&TcpLinkConfig::default()).await;
        for i in 0..3u8 {
            post(&a, &[i; 100]).await;
        }
        a.fail(EpochEnd::Closed);
        for i in 0..3u8 {
            let batch = b.recv().await.expect("delivered before the end");
            assert_eq!(&batch[..], &[i; 100][..]);
        }
        let end = b.recv().await.map(|_| ()).expect_err("then the end");
        assert_eq!(
            end,
            qpmux::link::LinkError::Ended {
                epoch: Epoch(1),
                reason: EpochEnd::PeerClosed
            }
        );
        assert_eq!(b.ended().await, EpochEnd::PeerClosed);
        assert_eq!(a.ended().await, EpochEnd::Closed);
        assert!(a.reserve().await.is_err());
    })
    .await;
}

/// A graceful close whose tail is still in our send queue (the peer's
/// window is full) survives the peer sending after our FIN (a credit grant
/// for the drain it reads): Linux resets a connection that gets data after
/// `shutdown(SHUT_RDWR)`, or is closed with data unread, and purges the
/// unsent tail. So the close half-shuts the write side and reads on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_sends_after_our_close_still_gets_all_we_flushed() {
    bounded(async {
        let config = TcpLinkConfig {
            recv_batches: 1,
            send_buffers: 64,
            ..TcpLinkConfig::default()
        };
        let (a, b) = link_pair_with_buffers(&config, Some(16 * 1024)).await;
        // More than b's socket takes, not more than a's send buffer holds
        // besides: a's writer has it all in its kernel when the close comes.
        const N: u32 = 40;
        for i in 0..N {
            let mut body = [0u8; 1000];
            body[..4].copy_from_slice(&i.to_be_bytes());
            post(&a, &body).await;
        }
        // b holds its first batch: its reader stalls, its window fills, and
        // the rest waits in a's queues.
        let first = b.recv().await.expect("the first batch");
        a.fail(EpochEnd::Closed);
        // a's writer puts what fits into its kernel, then closes its side.
        tokio::time::sleep(Duration::from_millis(200)).await;
        post(&b, b"credit for what I read").await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(first);
        let mut got = 1u32;
        let end = loop {
            match b.recv().await {
                Ok(batch) => {
                    assert_eq!(&batch[..4], &got.to_be_bytes()[..], "in order");
                    got += 1;
                }
                Err(end) => break end,
            }
        };
        assert_eq!(got, N, "every batch posted before the close: {end:?}");
        assert_eq!(b.ended().await, EpochEnd::PeerClosed);
    })
    .await;
}

/// A graceful close delivers both ways: what each end had posted and not
/// yet written when the close came reaches the other. The closing end's
/// reader delivers what the peer sends until its EOF (it used to discard
/// it), and the peer, on our FIN, writes what it had queued before its own
/// (it used to drop it): docs/design.md § "A closed link delivers both
/// ways".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_close_delivers_what_both_ends_had_posted() {
    bounded(async {
        let config = TcpLinkConfig {
            recv_batches: 1,
            send_buffers: 128,
            ..TcpLinkConfig::default()
        };
        // Buffers not so small that one loopback segment overflows them
        // (the kernel then drops it and backs off its retransmits past the
        // flush's grace on a loaded machine).
        let (a, b) = link_pair_with_buffers(&config, Some(64 * 1024)).await;
        // Far more than both sockets hold: the rest waits in each end's queue.
        const N: u32 = 100;
        for i in 0..N {
            let mut body = [0u8; 4000];
            body[..4].copy_from_slice(&i.to_be_bytes());
            post(&a, &body).await;
            post(&b, &body).await;
        }
        // Each end holds its first batch, so both readers stall.
        let (a_first, b_first) = (
            a.recv().await.expect("a's first"),
            b.recv().await.expect("b's first"),
        );
        a.fail(EpochEnd::Closed);
        let drain = |link: TcpLink| async move {
            let mut got = 1u32;
            let end = loop {
                match link.recv().await {
                    Ok(batch) => {
                        assert_eq!(&batch[..4], &got.to_be_bytes()[..], "in order");
                        got += 1;
                    }
                    Err(end) => break end,
                }
            };
            (got, end)
        };
        // b reads all a flushed, and a's FIN, while a's reader still
        // stalls: b's tail is still queued when b sees the close.
        drop(b_first);
        let (at_b, b_end) = drain(b.clone()).await;
        assert_eq!(at_b, N, "all a posted reached b: {b_end:?}");
        assert_eq!(b.ended().await, EpochEnd::PeerClosed);
        assert!(
            b.stats().batches_sent < u64::from(N),
            "b still had batches queued when it saw the close"
        );
        drop(a_first);
        let (at_a, a_end) = drain(a.clone()).await;
        assert_eq!(at_a, N, "all b posted reached a: {a_end:?}");
        assert_eq!(a.ended().await, EpochEnd::Closed);
    })
    .await;
}

/// Our own graceful close's read-out takes no budget, so a `Replaced` that
/// follows it (the mux reading the link out) leaves it reading even with no
/// read-out left: a replacement after any close takes none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replacement_after_our_close_keeps_its_read_out_without_budget() {
    bounded(async {
        let config = TcpLinkConfig {
            recv_batches: 1,
            read_outs: ReadOutBudget::new(0),
            ..TcpLinkConfig::default()
        };
        let (a, b) = link_pair(&config).await;
        const N: u8 = 8;
        for i in 0..N {
            post(&b, &[i; 100]).await;
        }
        // a holds its first batch: the rest waits in its socket.
        let first = a.recv().await.expect("a's first");
        a.fail(EpochEnd::Closed);
        a.fail(EpochEnd::Replaced);
        drop(first);
        let (got, end) = read_until_end(&a, Duration::from_secs(10)).await;
        assert_eq!(got, (1..N).collect::<Vec<u8>>(), "{end:?}");
    })
    .await;
}

/// A post whose write fails before a byte leaves (the peer reset, and our
/// reader, stalled behind a held batch, has not seen it) is refused, so the
/// mux keeps the batch's messages to report, and the epoch ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_into_a_reset_connection_is_refused() {
    bounded(async {
        let config = TcpLinkConfig {
            recv_batches: 1,
            ..TcpLinkConfig::default()
        };
        let listener = tokio::net::TcpListener::bind(any_port())
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (dialed, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let dialed = dialed.expect("connect");
        // A second descriptor on a's socket, only to watch for the reset.
        let probe = socket2::SockRef::from(&dialed).try_clone().expect("dup");
        let a =
            TcpLink::new(dialed, Vec::new(), Epoch(1), &config, config.max_batch).expect("link");
        let peer = accepted.expect("accept").0.into_std().expect("std");
        peer.set_nonblocking(false).expect("blocking");
        std::io::Write::write_all(&mut &peer, &[0, 0, 0, 2, 7, 7]).expect("a frame");
        let held = a.recv().await.expect("the frame");
        socket2::SockRef::from(&peer)
            .set_linger(Some(Duration::ZERO))
            .expect("SO_LINGER 0");
        drop(peer);
        // The reset has reached a's kernel once its socket has no peer
        // (`getpeername` fails); unlike reading `SO_ERROR` this leaves the
        // error for the post to meet. A sleep here raced a busy softirq.
        until(|| probe.peer_addr().is_err()).await;
        let buf = a.reserve().await.expect("a free buffer");
        let posted = a.post(buf, 8);
        assert!(
            matches!(posted, Err(qpmux::link::LinkError::Ended { .. })),
            "{posted:?}"
        );
        assert_eq!(a.ended().await, EpochEnd::PeerLost);
        drop(held);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_link_ends_both_ends_with_their_reasons() {
    bounded(async {
        let (a, b) = link_pair(&TcpLinkConfig::default()).await;
        post(&a, b"hello").await;
        assert_eq!(&b.recv().await.expect("batch")[..], b"hello");
        a.fail(EpochEnd::Fault(LinkFault::Injected));
        assert_eq!(b.ended().await, EpochEnd::PeerClosed);
        assert_eq!(a.ended().await, EpochEnd::Fault(LinkFault::Injected));
        assert!(b.recv().await.is_err());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_waits_for_a_free_send_buffer_and_posts_are_bounded() {
    bounded(async {
        let config = TcpLinkConfig {
            send_buffers: 2,
            max_batch: 1024,
            ..TcpLinkConfig::default()
        };
        let (a, _b) = link_pair(&config).await;
        let first = a.reserve().await.expect("reserve");
        let second = a.reserve().await.expect("reserve");
        assert!(ready_now(a.reserve()).await.is_none(), "all buffers out");
        drop(first);
        let third = a.reserve().await.expect("a dropped buffer is free again");
        assert_eq!(third.len(), 1024);
        assert_eq!(
            a.post(second, 1025),
            Err(qpmux::link::LinkError::BatchTooLarge {
                len: 1025,
                max: 1024
            })
        );
        drop(third);
    })
    .await;
}

/// Batches bigger than the socket buffers, posted while the receiver holds
/// its quota: the writer's `writev`s stop mid-batch, resume where they
/// stopped, and every byte arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_cut_by_a_full_socket_arrive_whole_and_in_order() {
    bounded(async {
        const BATCHES: u8 = 24;
        let config = TcpLinkConfig {
            max_batch: 256 * 1024,
            send_buffers: 4,
            recv_batches: 1,
            ..TcpLinkConfig::default()
        };
        let (a, b) = link_pair(&config).await;
        let payload = |i: u8| -> Vec<u8> {
            (0..256 * 1024 - usize::from(i))
                .map(|k| (k as u8) ^ i)
                .collect()
        };
        let sender = {
            let a = a.clone();
            tokio::spawn(async move {
                for i in 0..BATCHES {
                    post(&a, &payload(i)).await;
                }
            })
        };
        // Hold the quota until the sender has run out of buffers: the
        // socket is full and later batches wait in the queue.
        let held = b.recv().await.expect("batch 0");
        until(|| a.stats().batches_sent >= 1).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(&held[..], &payload(0)[..]);
        drop(held);
        for i in 1..BATCHES {
            let batch = b.recv().await.expect("batch");
            assert_eq!(batch.len(), payload(i).len(), "batch {i}");
            assert!(batch[..] == payload(i)[..], "batch {i} corrupted");
        }
        sender.await.expect("sender");
        until(|| a.stats().batches_sent == u64::from(BATCHES)).await;
    })
    .await;
}

/// Two tasks posting at once, batches from 1 byte to 192 KiB over sockets
/// with small buffers: some go out from `post` itself, some from the
/// writer, many cut by a full socket and finished by the writer while later
/// posts arrive. Every batch arrives whole, and each poster's
/// batches in the order it posted them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posts_written_inline_or_by_the_writer_keep_each_posters_order() {
    bounded(async {
        const PER_POSTER: u32 = 300;
        let config = TcpLinkConfig {
            max_batch: 192 * 1024,
            send_buffers: 6,
            recv_batches: 2,
            ..TcpLinkConfig::default()
        };
        // 64 KiB (the kernel doubles it) is still under a 192 KiB batch, so
        // inline writes stop part-way; 16 KiB stalled loopback TCP in
        // zero-window episodes of ~200 ms each (95 in one run, past the bound).
        let (a, b) = link_pair_with_buffers(&config, Some(64 * 1024)).await;
        // Batch `seq` of `poster`: a header, then bytes derived from both.
        let batch = |poster: u8, seq: u32| -> Vec<u8> {
            let len = match seq % 5 {
                0 => 1,
                1 => 64,
                2 => 4096,
                3 => 64 * 1024 + seq as usize,
                _ => 192 * 1024,
            }
            .max(5);
            let mut v: Vec<u8> = (0..len).map(|k| (k as u8) ^ poster ^ (seq as u8)).collect();
            v[0] = poster;
            v[1..5].copy_from_slice(&seq.to_be_bytes());
            v
        };
        let posters: Vec<_> = (0..2u8)
            .map(|poster| {
                let a = a.clone();
                tokio::spawn(async move {
                    for seq in 0..PER_POSTER {
                        post(&a, &batch(poster, seq)).await;
                        if seq % 7 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u32; 2];
        for _ in 0..2 * PER_POSTER {
            let got = b.recv().await.expect("batch");
            let poster = got[0];
            let seq = u32::from_be_bytes(got[1..5].try_into().expect("header"));
            assert_eq!(seq, next[poster as usize], "poster {poster} out of order");
            assert!(
                got[..] == batch(poster, seq)[..],
                "batch {poster}/{seq} corrupted"
            );
            next[poster as usize] += 1;
            if seq % 11 == 0 {
                // Hold the quota a moment: the socket fills, posts queue.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        for p in posters {
            p.await.expect("poster");
        }
        assert_eq!(a.stats().batches_sent, u64::from(2 * PER_POSTER));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reader_stops_while_the_consumer_holds_its_quota() {
    bounded(async {
        let config = TcpLinkConfig {
            recv_batches: 2,
            ..TcpLinkConfig::default()
        };
        let (a, b) = link_pair(&config).await;
        for i in 0..10u8 {
            post(&a, &[i; 64]).await;
        }
        until(|| a.stats().batches_sent == 10).await;
        let held = [
            b.recv().await.expect("batch 0"),
            b.recv().await.expect("batch 1"),
        ];
        // Everything is in b's socket buffer, yet the reader holds at the quota.
        for _ in 0..100 {
            tokio::task::yield_now().await;
            assert_eq!(b.stats().batches_received, 2, "quota of 2 respected");
        }
        drop(held);
        for i in 2..10u8 {
            assert_eq!(&b.recv().await.expect("batch")[..], &[i; 64][..]);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_from_the_peer_ends_the_epoch() {
    bounded(async {
        let listener = tokio::net::TcpListener::bind(any_port())
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (dialed, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let config = TcpLinkConfig::default();
        let link = TcpLink::new(
            dialed.expect("connect"),
            Vec::new(),
            Epoch(3),
            &config,
            config.max_batch,
        )
        .expect("link");
        let mut raw = accepted.expect("accept").0;
        let mut frames = Vec::new();
        frames.extend_from_slice(&5u32.to_be_bytes());
        frames.extend_from_slice(b"fine!");
        frames.extend_from_slice(&u32::MAX.to_be_bytes());
        tokio::io::AsyncWriteExt::write_all(&mut raw, &frames)
            .await
            .expect("write");
        assert_eq!(&link.recv().await.expect("the good frame")[..], b"fine!");
        assert_eq!(
            link.ended().await,
            EpochEnd::Violation(ProtocolError::FrameTooLarge {
                len: u32::MAX as usize,
                max: config.max_batch,
            })
        );
    })
    .await;
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Arbitrary bytes from the network end the epoch with a reason; the
    /// link never panics and never delivers a batch over its limit.
    #[test]
    fn arbitrary_bytes_from_the_peer_never_panic_the_link(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(bounded(async {
            let listener = tokio::net::TcpListener::bind(any_port()).await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let (dialed, accepted) =
                tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
            let config = TcpLinkConfig { max_batch: 256, ..TcpLinkConfig::default() };
            let link = TcpLink::new(dialed.expect("connect"), Vec::new(), Epoch(1), &config, 256)
                .expect("link");
            let mut raw = accepted.expect("accept").0;
            tokio::io::AsyncWriteExt::write_all(&mut raw, &bytes).await.expect("write");
            drop(raw);
            while let Ok(batch) = link.recv().await {
                assert!(batch.len() <= 256);
            }
            link.ended().await;
        }));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_replaces_a_link_that_still_looks_alive() {
    bounded(async {
        let (a_node, a) = node(A, None).await;
        let (b1_node, b1) = node(B, None).await;
        mesh(&[&a_node, &b1_node]);
        stream(&a, B, &b1, 1, 2).await;
        let old = a_node.link(B).expect("link");
        // B "restarts" (new incarnation) while A's link to the old B is
        // still up, as after a host crash, and dials A first.
        let (b2_node, b2) = node(B, None).await;
        b2_node.register(A, a_node.local_addr());
        a_node.register(B, b2_node.local_addr());
        stream(&b2, A, &a, 2, 2).await;
        assert!(old.is_ended(), "the old link was replaced");
        // Cut, not read out: nobody behind it closes it.
        assert_eq!(old.ended().await, EpochEnd::PeerLost);
        assert_eq!(a.epoch(B), Some(Epoch(2)), "max(0, 1) + 1");
        assert_eq!(a_node.stats().restarts_seen, 1);
        b1.shutdown();
        b1_node.shutdown();
    })
    .await;
}

/// An address where nothing listens.
async fn dead_addr() -> SocketAddr {
    let gone = tokio::net::TcpListener::bind(any_port())
        .await
        .expect("bind");
    gone.local_addr().expect("addr")
}

/// Opens one stream of `records` from `from` to `to`, finished.
async fn one_stream(
    from: &Mux<TcpLink>,
    to: PeerId,
    to_mux: &Mux<TcpLink>,
    key: StreamKey,
    records: u32,
) -> qpmux::mux::SlotReceiver {
    let rx = to_mux.bind(key).expect("bind");
    let mut tx = from.open(to, key).expect("open");
    for n in 0..records {
        tx.send(record(key.session.0, n, 64)).await.expect("send");
    }
    tx.finish(Terminal::Finalized).expect("finish");
    rx
}

/// A waits out a long backoff toward B (its dials fail: A cannot reach B).
/// B can reach A, and its dial must not be declined as a crossing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_waiting_out_its_backoff_accepts_the_peers_dial() {
    let long_wait = Duration::from_secs(60);
    let (a_node, a) = node_backing_off(A, long_wait).await;
    let b_config = config(B, None);
    // One wait, up to half of it more as jitter, and one handshake.
    let b_bound = b_config.backoff_max * 3 / 2 + b_config.handshake_timeout;
    let (b_node, b) = TcpNode::start(b_config, any_port(), MuxConfig::default())
        .await
        .expect("bind");
    a_node.register(B, dead_addr().await);
    b_node.register(A, a_node.local_addr());

    let mut to_b = one_stream(&a, B, &b, StreamKey::new(41, 1), 3).await;
    within(b_bound, "A's dial fails", || {
        a_node.stats().dial_failures == 1
    })
    .await;
    // What A's mux does every second while it waits: A now waits 60 s.
    a_node.dialer().want_link(B);
    assert_eq!(a_node.backoff(B), long_wait);

    let mut to_a = one_stream(&b, A, &a, StreamKey::new(42, 1), 3).await;
    let arrived = tokio::time::timeout(b_bound, async {
        (
            in_order_to_finalized(&mut to_a).await.0,
            in_order_to_finalized(&mut to_b).await.0,
        )
    })
    .await
    .expect("B's dial is accepted while A only waits");
    assert_eq!(arrived, (3, 3), "one link carries both ways");
    assert_eq!(b_node.stats().declined, 0, "not declined as a crossed dial");
    assert_eq!(b_node.stats().established, 1);
}

/// A dial waiting out its backoff when the node shuts down ends then, not
/// when the wait is over, and is not counted as a failed dial (review 48c:
/// it woke, failed `NotServing`, counted and warned, and held the node
/// until then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_waiting_out_its_backoff_ends_with_the_node() {
    let alive = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    assert_eq!(alive(), 0, "the test's own runtime");
    let long_wait = Duration::from_secs(60);
    let (a_node, a) = node_backing_off(A, long_wait).await;
    a_node.register(B, dead_addr().await);
    let tx = a.open(B, StreamKey::new(43, 1)).expect("open");
    within(Duration::from_secs(10), "A's dial fails", || {
        a_node.stats().dial_failures == 1
    })
    .await;
    // What A's mux does every second while it waits.
    a_node.dialer().want_link(B);
    assert_eq!(a_node.backoff(B), long_wait);
    drop(tx);
    a.shutdown();
    a_node.shutdown();
    bounded(a.closed()).await;
    within(
        Duration::from_secs(10),
        "every task of the node ends",
        || alive() == 0,
    )
    .await;
    assert_eq!(
        a_node.stats().dial_failures,
        1,
        "the stop counted as a failure"
    );
}

/// A link asked for from a thread outside any runtime (velo's synchronous
/// sends reach `want_link` there) is dialled on the node's own runtime, and
/// a shutdown asked for from there runs on it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_from_outside_the_runtime_run_on_the_nodes_runtime() {
    let (a_node, a) = node(A, None).await;
    let (b_node, _b) = node(B, None).await;
    mesh(&[&a_node, &b_node]);
    let dialer = a_node.dialer();
    std::thread::spawn(move || dialer.want_link(B))
        .join()
        .expect("want_link off the runtime does not panic");
    bounded(until(|| a.epoch(B).is_some())).await;
    let (node, mux) = (a_node.clone(), a.clone());
    std::thread::spawn(move || node.shutdown_after(&mux))
        .join()
        .expect("shutdown_after off the runtime does not panic");
    bounded(a.closed()).await;
    // The node's part ran after the mux closed: its listener is gone.
    let addr = a_node.local_addr();
    bounded(async {
        while tokio::net::TcpStream::connect(addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

/// A dial that waited out its backoff does not replace the link its peer
/// brought up meanwhile: that would end a working epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_dial_does_not_replace_a_link_the_peer_brought_up() {
    let wait = Duration::from_millis(1500);
    let (a_node, a) = node_backing_off(A, wait).await;
    let (b_node, b) = node(B, None).await;
    a_node.register(B, dead_addr().await);
    b_node.register(A, a_node.local_addr());

    let mut to_b = one_stream(&a, B, &b, StreamKey::new(43, 1), 2).await;
    bounded(until(|| a_node.stats().dial_failures == 1)).await;
    a_node.dialer().want_link(B);
    let failed_at = tokio::time::Instant::now();
    // From now on A could reach B: its waiting dial would succeed.
    a_node.register(B, b_node.local_addr());
    let mut to_a = one_stream(&b, A, &a, StreamKey::new(44, 1), 2).await;
    assert_eq!(bounded(in_order_to_finalized(&mut to_a)).await.0, 2);
    assert_eq!(bounded(in_order_to_finalized(&mut to_b)).await.0, 2);
    let epoch = a.epoch(B).expect("up");

    // Past A's wait (and then some): its dial task has woken and looked.
    tokio::time::sleep_until(failed_at + wait * 2).await;
    let mut again = one_stream(&a, B, &b, StreamKey::new(45, 1), 2).await;
    assert_eq!(bounded(in_order_to_finalized(&mut again)).await.0, 2);
    assert_eq!(a.epoch(B), Some(epoch), "the link B brought up still runs");
    assert_eq!(a.stats().epoch_deaths, 0);
    assert_eq!(b.stats().epoch_deaths, 0);
    assert_eq!(a_node.stats().established + b_node.stats().established, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_killed_before_any_batch_back_off_within_bounds_and_traffic_resets_it() {
    let a_config = TcpNodeConfig {
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(160),
        handshake_timeout: Duration::from_secs(2),
        ..config(A, None)
    };
    let (a_node, a) = TcpNode::start(a_config.clone(), any_port(), held_back())
        .await
        .expect("bind");
    let (b_node, b) = node(B, None).await;
    mesh(&[&a_node, &b_node]);
    let dialing = Dialing {
        node: &a_node,
        mux: &a,
        backoff_min: a_config.backoff_min,
        backoff_max: a_config.backoff_max,
        handshake_timeout: a_config.handshake_timeout,
    };
    relink::traffic_less_epochs_back_off_and_the_held_slot_survives(dialing, B, &b, 6).await;
    assert_eq!(a_node.stats().dial_failures, 0);
    assert_eq!(b_node.stats().refused, 0);
}

/// Forwards connections to `to`. On the first one it holds back everything
/// the dialer writes after its first write (its hello): the ready reaches
/// the listener only once `release` is notified, when it has given up.
async fn hold_the_first_ready(
    listener: tokio::net::TcpListener,
    to: SocketAddr,
    release: std::sync::Arc<tokio::sync::Notify>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut first = true;
    while let Ok((dialer, _)) = listener.accept().await {
        let Ok(upstream) = tokio::net::TcpStream::connect(to).await else {
            continue;
        };
        let hold = std::mem::take(&mut first).then(|| release.clone());
        tokio::spawn(async move {
            let (mut from_dialer, mut to_dialer) = dialer.into_split();
            let (mut from_listener, mut to_listener) = upstream.into_split();
            let down = async {
                tokio::io::copy(&mut from_listener, &mut to_dialer)
                    .await
                    .ok();
                to_dialer.shutdown().await.ok();
            };
            let up = async {
                let mut buf = vec![0u8; 64 * 1024];
                let mut writes = 0;
                loop {
                    let n = match from_dialer.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    writes += 1;
                    if let (Some(release), 2) = (&hold, writes) {
                        release.notified().await;
                    }
                    if to_listener.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                to_listener.shutdown().await.ok();
            };
            tokio::join!(down, up);
        });
    }
}

/// docs/rxe.md's H7: the listener's handshake times out after the dialer
/// wrote its ready and installed the link. The dialer's epoch dies before
/// any batch; it relinks within one backoff and one handshake, and the slot
/// it held back rides the next epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_giving_up_after_the_dialers_ready_costs_one_relink() {
    // B's timeout also bounds the second, honest handshake: long enough for
    // a loaded machine. The first is held until B has given up, not for a
    // time.
    let b_timeout = Duration::from_secs(2);
    let (b_node, b) = TcpNode::start(
        TcpNodeConfig {
            handshake_timeout: b_timeout,
            ..config(B, None)
        },
        any_port(),
        MuxConfig::default(),
    )
    .await
    .expect("bind");
    let a_config = TcpNodeConfig {
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(160),
        handshake_timeout: Duration::from_secs(2),
        ..config(A, None)
    };
    let relink_bound = a_config.backoff_max * 3 / 2 + a_config.handshake_timeout;
    let (a_node, a) = TcpNode::start(a_config, any_port(), held_back())
        .await
        .expect("bind");
    let proxy = tokio::net::TcpListener::bind(any_port())
        .await
        .expect("bind");
    a_node.register(B, proxy.local_addr().expect("addr"));
    b_node.register(A, a_node.local_addr());
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    tokio::spawn(hold_the_first_ready(
        proxy,
        b_node.local_addr(),
        release.clone(),
    ));

    let key = StreamKey::new(46, 1);
    let mut rx = b.bind(key).expect("bind");
    let mut tx = a.open(B, key).expect("open");
    tx.send(record(1, 0, 64)).await.expect("send");
    tx.finish(Terminal::Finalized).expect("finish");
    within(
        b_timeout + relink_bound,
        "B gives up on the first handshake",
        || b_node.last_refusal() == Some(ConnectError::Timeout),
    )
    .await;
    release.notify_one();
    within(relink_bound, "A relinks after its half-made epoch", || {
        a_node.stats().established == 2 && a.epoch(B).is_some()
    })
    .await;
    a.flush(B).expect("flush");
    let got = tokio::time::timeout(relink_bound, in_order_to_finalized(&mut rx))
        .await
        .expect("the held slot arrives");
    assert_eq!(got.0, 1);
    assert_eq!(a.stats().slots_dropped, 0);
    assert!(a.stats().slots_carried >= 1);
    assert_eq!(b_node.stats().established, 1, "B installed only the second");
}

/// An epoch that ended in the peer's violation is not fresh news: the next
/// dial waits out a backoff although the epoch carried batches (a peer that
/// breaks the protocol after one good batch was redialled at once, every
/// epoch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_epoch_ended_in_a_violation_is_redialled_after_a_backoff() {
    redialled_after_a_backoff(EpochEnd::Violation(ProtocolError::FrameTooLarge {
        len: 1 << 30,
        max: 65536,
    }))
    .await;
}

/// Likewise an epoch whose SENDs ran out of RNR retries (on RDMA: a peer that
/// announced receives and posted none, which can end an epoch within
/// microseconds if it asks for a short RNR timer): it used to be redialled
/// at once, a handshake and a QP each time. The rule is the connector's,
/// shared by both node kinds; the TCP link stands in for the RDMA one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_sends_ran_out_of_rnr_retries_is_redialled_after_a_backoff() {
    redialled_after_a_backoff(EpochEnd::Fault(LinkFault::Completion {
        status: LinkFault::RNR_RETRY_EXCEEDED,
    }))
    .await;
}

/// Ends with `end` an epoch that carried batches both ways; the next ask for
/// a link must wait out the whole backoff.
async fn redialled_after_a_backoff(end: EpochEnd) {
    bounded(async {
        let wait = Duration::from_secs(60);
        let (a_node, a) = node_backing_off(A, wait).await;
        let (b_node, b) = node(B, None).await;
        a_node.register(B, b_node.local_addr());
        let mut rx = one_stream(&a, B, &b, StreamKey::new(44, 1), 3).await;
        assert_eq!(in_order_to_finalized(&mut rx).await.0, 3);
        let link = a_node.link(B).expect("the link");
        // B's grants for what it read: the epoch carried traffic both ways.
        until(|| link.stats().batches_received > 0).await;
        link.fail(end);
        until(|| a.epoch(B).is_none()).await;
        a_node.dialer().want_link(B);
        assert_eq!(a_node.backoff(B), wait);
    })
    .await;
}

/// A forgotten peer (`Node::unregister`) is not dialled again, also when the
/// forgetting comes while a dial waits out its backoff, and a slot to it
/// still wants a link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_peer_is_not_dialled_again_even_by_a_waiting_dial() {
    bounded(async {
        let wait = Duration::from_millis(200);
        let (a_node, a) = node_backing_off(A, wait).await;
        a_node.register(B, dead_addr().await);
        let mut tx = a.open(B, StreamKey::new(43, 1)).expect("open");
        tx.send(record(1, 0, 64)).await.expect("queued");
        until(|| a_node.stats().dial_failures == 1).await;
        // The mux asks again while the backoff runs: a dial now waits.
        a_node.dialer().want_link(B);
        a_node.forget(B);
        tokio::time::sleep(wait * 5).await;
        assert_eq!(a_node.stats().dial_failures, 1, "dialled a forgotten peer");
        assert_eq!(a_node.backoff(B), Duration::ZERO);
        drop(tx);
    })
    .await;
}

/// Sends stream `s`'s records from seq 1 on, a few ms apart, until the
/// slot ends; what it ended with.
async fn sent_until_ended(tx: &mut SlotSender, s: u64) -> SendError {
    let mut seq = 1;
    loop {
        if let Err(err) = tx.send(record(s, seq, 64)).await {
            return err;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        seq += 1;
    }
}

/// A stream still waiting for its first link when its peer is forgotten
/// ends with `Dropped(Unregistered)`: no link will come for it. Before, it
/// waited (and its peer task asked for a link every second) until its
/// producer dropped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waiting_for_a_forgotten_peer_ends() {
    bounded(async {
        let (a_node, a) = node_backing_off(A, Duration::from_millis(200)).await;
        a_node.register(B, dead_addr().await);
        let mut tx = a.open(B, StreamKey::new(44, 1)).expect("open");
        tx.send(record(1, 0, 64)).await.expect("queued");
        until(|| a_node.stats().dial_failures >= 1).await;
        a_node.forget(B);
        assert_eq!(
            sent_until_ended(&mut tx, 1).await,
            SendError::Dropped(DropReason::Unregistered)
        );
    })
    .await;
}

/// A forget ends only the slots opened before it: one opened after it (the
/// peer registered again at once) waits for its link as any does. On one
/// thread the peer task cannot run between the forget and the open.
#[tokio::test(flavor = "current_thread")]
async fn a_slot_opened_after_a_forget_is_not_ended_by_it() {
    bounded(async {
        let (a_node, a) = node_backing_off(A, Duration::from_millis(200)).await;
        let dead = dead_addr().await;
        a_node.register(B, dead);
        let mut before = a.open(B, StreamKey::new(45, 1)).expect("open");
        before.send(record(1, 0, 64)).await.expect("queued");
        until(|| a_node.stats().dial_failures >= 1).await;
        a_node.forget(B);
        a_node.register(B, dead);
        let mut after = a.open(B, StreamKey::new(45, 2)).expect("open");
        after.send(record(2, 0, 64)).await.expect("queued");
        assert_eq!(
            sent_until_ended(&mut before, 1).await,
            SendError::Dropped(DropReason::Unregistered)
        );
        let still = tokio::time::timeout(Duration::from_millis(300), after.closed()).await;
        assert!(still.is_err(), "the slot opened after the forget ended");
        after.send(record(2, 1, 64)).await.expect("still open");
    })
    .await;
}

/// A forgotten peer leaves the connection table once nothing is under way
/// for it, and a link with it after it returns (a fresh process proposing
/// epoch 0) still starts an epoch newer than any it had here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_peer_that_returns_starts_a_newer_epoch() {
    bounded(async {
        let (a_node, a) = node(A, None).await;
        let (b_node, b) = node(B, None).await;
        mesh(&[&a_node, &b_node]);
        stream(&a, B, &b, 1, 2).await;
        assert_eq!(a.epoch(B), Some(Epoch(1)));
        assert_eq!(a_node.stats().peers_known, 1);
        let addr = b_node.local_addr();
        b.shutdown();
        b_node.shutdown();
        drop(b);
        drop(b_node);
        until(|| a.epoch(B).is_none()).await;
        a_node.forget(B);
        until(|| a_node.stats().peers_known == 0).await;
        let (_b2_node, b2) = restart_on(B, addr).await;
        a_node.register(B, addr);
        stream(&a, B, &b2, 2, 2).await;
        assert_eq!(a.epoch(B), Some(Epoch(2)), "above the forgotten epoch 1");
        assert_eq!(b2.epoch(A), Some(Epoch(2)));
        assert_eq!(a_node.stats().peers_known, 1);
    })
    .await;
}

/// Clients under fresh ids dial one server concurrently, stream, and leave,
/// again and again: each departure lets an entry go (raising the epoch
/// floor) while other handshakes are under way, and none of those is
/// refused for it (when the floor was read at install instead, a handshake
/// agreed just below it was declined `Superseded` and its stream's slot
/// dropped: 2 of 3 runs hung); the server's table ends empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_coming_and_going_concurrently_are_all_served() {
    bounded(async {
        let (server_node, server) = node(A, None).await;
        let addr = server_node.local_addr();
        let mut loops = Vec::new();
        for lane in 0..4u64 {
            let server = server.clone();
            loops.push(tokio::spawn(async move {
                for round in 0..25u64 {
                    let id = PeerId(100 + lane * 100 + round);
                    let (client_node, client) = node(id, None).await;
                    client_node.register(A, addr);
                    stream(&client, A, &server, 1000 + id.0, 1).await;
                    client.shutdown();
                    client_node.shutdown();
                    until(|| server.epoch(id).is_none()).await;
                    assert_eq!(client_node.stats().dial_failures, 0, "{id:?}");
                }
            }));
        }
        for l in loops {
            l.await.expect("client loop");
        }
        assert_eq!(server_node.stats().refused, 0);
        until(|| server_node.stats().peers_known == 0).await;
    })
    .await;
}

/// A replaced link delivers what its peer sent before closing it: the
/// reader, stalled on back-pressure with the rest still in the socket, goes
/// on after the end, and `recv` ends only at the peer's EOF (it used to cut
/// the socket and return what the inbox held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_link_delivers_what_its_peer_sent_before_closing() {
    bounded(async {
        let config = TcpLinkConfig {
            recv_batches: 1,
            ..TcpLinkConfig::default()
        };
        let (a, b) = link_pair(&config).await;
        for i in 0..8u8 {
            post(&a, &[i; 100]).await;
        }
        a.fail(EpochEnd::Closed);
        until(|| a.stats().batches_sent == 8).await;
        b.fail(EpochEnd::Replaced);
        let (got, end) = read_until_end(&b, Duration::from_secs(10)).await;
        assert_eq!(got, (0..8).collect::<Vec<u8>>());
        assert_eq!(
            end,
            Some(LinkError::Ended {
                epoch: Epoch(1),
                reason: EpochEnd::Replaced
            })
        );
    })
    .await;
}

/// Every batch `link` returns until its end, or until `within` passes.
async fn read_until_end(link: &TcpLink, within: Duration) -> (Vec<u8>, Option<LinkError>) {
    let mut got = Vec::new();
    let end = tokio::time::timeout(within, async {
        loop {
            match link.recv().await {
                Ok(batch) => got.push(batch[0]),
                Err(err) => break err,
            }
        }
    })
    .await
    .ok();
    (got, end)
}

/// A link whose peer is a raw socket that has written four framed batches
/// (first bytes 0..4) and then neither reads nor closes.
async fn link_beside_a_silent_peer(config: &TcpLinkConfig) -> (TcpLink, tokio::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind(any_port())
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (dialed, accepted) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let mut raw = dialed.expect("connect");
    let link = TcpLink::new(
        accepted.expect("accept").0,
        Vec::new(),
        Epoch(1),
        config,
        256,
    )
    .expect("link");
    for i in 0..4u8 {
        let mut frame = 100u32.to_be_bytes().to_vec();
        frame.extend_from_slice(&[i; 100]);
        tokio::io::AsyncWriteExt::write_all(&mut raw, &frame)
            .await
            .expect("write");
    }
    (link, raw)
}

/// The peer's close reads out on the peer's share of the node's budget.
/// Past it the link still flushes ours and sends our FIN, however long the
/// flush takes (within its grace), and then waits only briefly for the
/// peer's EOF: a peer that says goodbye and never closes (here the end is
/// the mux's `PeerClosed` for its Goodbye, and a raw peer stays silent)
/// holds the socket no longer, not for the read-out's seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peers_close_past_its_read_out_share_flushes_then_waits_briefly() {
    bounded(async {
        // A quarter of four: one read-out for this peer.
        let budget = ReadOutBudget::new(4).owned_by(ReadOutOwner {
            peer: PeerId(9),
            registered: true,
            source: None,
        });
        let config = TcpLinkConfig {
            recv_batches: 1,
            send_buffers: 64,
            read_outs: budget.clone(),
            ..TcpLinkConfig::default()
        };
        let (kept, silent) = link_beside_a_silent_peer(&config).await;
        // The other's peer reads nothing yet, through small buffers, so our
        // flush is still under way when the close comes.
        let listener = tokio::net::TcpListener::bind(any_port())
            .await
            .expect("bind");
        let raw = tokio::net::TcpSocket::new_v4().expect("socket");
        raw.set_recv_buffer_size(1024).expect("SO_RCVBUF");
        let (dialed, accepted) = tokio::join!(
            raw.connect(listener.local_addr().expect("addr")),
            listener.accept()
        );
        let mut peer = dialed.expect("connect");
        let accepted = accepted.expect("accept").0;
        socket2::SockRef::from(&accepted)
            .set_send_buffer_size(1024)
            .expect("SO_SNDBUF");
        let brief = TcpLink::new(accepted, Vec::new(), Epoch(1), &config, 256).expect("link");
        const N: u8 = 48;
        for i in 0..N {
            post(&brief, &[i; 256]).await;
        }
        kept.fail(EpochEnd::PeerClosed);
        brief.fail(EpochEnd::PeerClosed);
        assert_eq!((budget.in_use(), budget.refused()), (1, 1));
        // Past the short wait, within the flush's 1 s grace: the flush is
        // not cut.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut got = Vec::new();
        let read = tokio::io::AsyncReadExt::read_to_end(&mut peer, &mut got);
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("our FIN after the flush")
            .expect("no reset");
        let frames: Vec<u8> = got.chunks(4 + 256).map(|frame| frame[4]).collect();
        assert_eq!(frames, (0..N).collect::<Vec<_>>());
        // Then the short wait from the flush's end, not from the flush's
        // grace (1.1 s from the close): the link ends without the peer's EOF.
        let (_, end) = read_until_end(&brief, Duration::from_millis(500)).await;
        assert!(end.is_some(), "waited out the flush's grace or a read-out");
        // The one on the budget delivers all its peer sent and waits on.
        for i in 0..4u8 {
            assert_eq!(kept.recv().await.expect("read out")[0], i);
        }
        let waiting = tokio::time::timeout(Duration::from_millis(500), kept.recv()).await;
        assert!(waiting.is_err(), "{waiting:?}");
        // The peer's EOF ends it, and the read-out comes back.
        drop(silent);
        let (rest, end) = read_until_end(&kept, Duration::from_secs(10)).await;
        assert_eq!((rest, end.is_some()), (Vec::new(), true));
        until(|| budget.in_use() == 0).await;
    })
    .await;
}

/// Past the full read-outs the peer's close takes a short one, from a pool
/// four times as large, given back to that pool once its short wait is
/// over; with none of those left either it is cut at once, as a replaced
/// link past the budget is, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peers_close_past_the_short_read_outs_too_is_cut() {
    bounded(async {
        let budget = ReadOutBudget::new(1);
        let config = TcpLinkConfig {
            recv_batches: 1,
            read_outs: budget.clone(),
            ..TcpLinkConfig::default()
        };
        let mut links = Vec::new();
        for _ in 0..6 {
            links.push(link_beside_a_silent_peer(&config).await);
        }
        for (link, _) in &links {
            link.fail(EpochEnd::PeerClosed);
        }
        let held = |tier| budget.in_use_of(tier);
        assert_eq!((held(ReadOutTier::Full), held(ReadOutTier::Short)), (1, 4));
        assert_eq!((budget.refused(), budget.short_refused()), (5, 1));
        // The last is cut: the silent peer's four batches are not read out.
        let (got, end) = read_until_end(&links[5].0, Duration::from_secs(2)).await;
        assert!(got.len() < 4 && end.is_some(), "{got:?} {end:?}");
        // The short ones end without the peer's EOF and give back to their
        // pool; the full one waits on.
        until(|| held(ReadOutTier::Short) == 0).await;
        assert_eq!(held(ReadOutTier::Full), 1);
    })
    .await;
}

/// Replaced links read out within their node's budget. Past it one is cut
/// at once, as before read-outs, so a peer that never closes its old
/// connections holds no more sockets open than the budget; a fault cuts a
/// read-out short, and its share of the budget comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_links_past_the_read_out_budget_are_cut() {
    bounded(async {
        let config = TcpLinkConfig {
            recv_batches: 1,
            read_outs: ReadOutBudget::new(1),
            ..TcpLinkConfig::default()
        };
        let (b1, _silent1) = link_beside_a_silent_peer(&config).await;
        let (b2, _silent2) = link_beside_a_silent_peer(&config).await;
        // Neither peer closes: b1 reads out, b2 finds no budget left.
        b1.fail(EpochEnd::Replaced);
        b2.fail(EpochEnd::Replaced);
        let (cut, end) = read_until_end(&b2, Duration::from_secs(2)).await;
        assert!(cut.len() < 4, "read out past the budget: {cut:?}");
        assert!(end.is_some(), "the link past the budget was not cut");
        for i in 0..4u8 {
            assert_eq!(b1.recv().await.expect("read out")[0], i);
        }
        // A fault cuts the read-out before its deadline.
        b1.fail(EpochEnd::Fault(LinkFault::Injected));
        let (rest, end) = read_until_end(&b1, Duration::from_secs(2)).await;
        assert_eq!((rest, end.is_some()), (Vec::new(), true));
        // Its share comes back when its reader is gone, which the error
        // from `recv` of a cut link does not wait for (under a loaded CPU
        // the next link's take came first in 7 of 8 runs of the binary).
        until(|| config.read_outs.in_use() == 0).await;
        // The next replaced link reads out.
        let (a3, b3) = link_pair(&config).await;
        for i in 0..4u8 {
            post(&a3, &[i; 100]).await;
        }
        until(|| a3.stats().batches_sent == 4).await;
        b3.fail(EpochEnd::Replaced);
        a3.fail(EpochEnd::Closed);
        let (all, end) = read_until_end(&b3, Duration::from_secs(10)).await;
        assert_eq!((all, end.is_some()), ((0..4).collect(), true));
    })
    .await;
}
