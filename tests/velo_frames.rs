//! QpmuxFrameTransport: velo streams as native mux slots, on every node kind
//! (`mem::…`, `tcp::…`, `rdma::…`).
#![cfg(feature = "velo")]

#[macro_use]
#[path = "common/velo_nodes.rs"]
mod velo_nodes;

use std::sync::Arc;
use std::time::Duration;

use qpmux::link::Node;
use qpmux::mux::{AsMux, MuxTransport, PeerId};
use qpmux::velo::{QpmuxFrameTransport, QpmuxTransport, VeloConfig, velo_frames};
use velo::messenger::Messenger;
use velo::streaming::{AnchorManager, AnchorManagerBuilder, FrameTransport, StreamFrame};
use velo_ext::Transport;
use velo_nodes::{Kind, Shape, collect, until};

velo_kinds!(
    ten_thousand_items_through_the_native_mux_frame_transport,
    raw_channels_keep_fifo_and_epoch_death_is_velos_dropped,
);

struct Worker<N: Node> {
    messenger: Arc<Messenger>,
    transport: Arc<QpmuxTransport<N>>,
    frames: Arc<QpmuxFrameTransport<N>>,
}

async fn worker<K: Kind>(kind: &K, id: u64) -> Worker<K::Node> {
    worker_with(kind, id, velo_nodes::Options::default()).await
}

async fn worker_with<K: Kind>(kind: &K, id: u64, options: velo_nodes::Options) -> Worker<K::Node> {
    let transport = Arc::new(QpmuxTransport::new(
        kind.node_with(id, options).await,
        VeloConfig::default(),
    ));
    let frames = Arc::new(transport.frame_transport(VeloConfig::default()));
    let messenger = Messenger::builder()
        .add_transport(transport.clone() as Arc<dyn Transport>)
        .build()
        .await
        .expect("messenger over qpmux");
    Worker {
        messenger,
        transport,
        frames,
    }
}

fn join<N: Node>(a: &Worker<N>, b: &Worker<N>) {
    a.messenger
        .register_peer(b.messenger.peer_info())
        .expect("a registers b");
    b.messenger
        .register_peer(a.messenger.peer_info())
        .expect("b registers a");
}

fn anchors<N: Node>(w: &Worker<N>) -> Arc<AnchorManager> {
    let manager = Arc::new(
        AnchorManagerBuilder::default()
            .worker_id(w.messenger.instance_id().worker_id())
            .transport(w.frames.clone() as Arc<dyn FrameTransport>)
            .build()
            .expect("anchor manager"),
    );
    manager
        .register_handlers(w.messenger.clone())
        .expect("control-plane handlers");
    manager
}

async fn ten_thousand_items_through_the_native_mux_frame_transport<K: Kind>() {
    let kind = K::new(Shape::Default);
    let a = worker(&kind, 1).await;
    let b = worker(&kind, 2).await;
    join(&a, &b);
    let (am_a, am_b) = (anchors(&a), anchors(&b));
    let anchor = am_a.create_anchor::<u32>();
    let sender = am_b
        .attach_stream_anchor::<u32>(anchor.handle())
        .await
        .expect("remote attach over qpmux slots");
    let produce = tokio::spawn(async move {
        for i in 0..10_000u32 {
            sender.send(i).await.expect("send item");
        }
        sender.finalize().expect("finalize");
    });
    let items = collect(anchor).await;
    produce.await.expect("producer");
    assert_eq!(items, (0..10_000).collect::<Vec<_>>());
    // The items rode native slots, not velo's messenger mux.
    let stats = a.transport.as_mux().expect("mux").stats();
    assert!(stats.records_received >= 10_000, "{stats:?}");
    kind.assert_clean(a.transport.node());
    kind.assert_clean(b.transport.node());
}

async fn raw_channels_keep_fifo_and_epoch_death_is_velos_dropped<K: Kind>() {
    let kind = K::new(Shape::Default);
    let a = worker(&kind, 1).await;
    let b = worker(&kind, 2).await;
    join(&a, &b);
    let worker_a = a.messenger.instance_id().worker_id();

    // A finalized stream: items and the sentinel in order, velo's own bytes.
    let rx = a.frames.bind(7, 1).await.expect("bind");
    let tx = b.frames.connect(worker_a, 7, 1).await.expect("connect");
    let items: Vec<Vec<u8>> = (0..100u32)
        .map(|i| rmp_serde::to_vec(&StreamFrame::Item(i)).expect("encodes"))
        .collect();
    for item in &items {
        tx.send_async(item.clone()).await.expect("open");
    }
    tx.send_async(velo_frames::heartbeat().to_vec())
        .await
        .expect("open");
    tx.send_async(velo_frames::finalized().to_vec())
        .await
        .expect("open");
    for item in &items {
        assert_eq!(&rx.recv_async().await.expect("item"), item);
    }
    assert_eq!(
        rx.recv_async().await.expect("heartbeat"),
        velo_frames::heartbeat()
    );
    assert_eq!(
        rx.recv_async().await.expect("terminal"),
        velo_frames::finalized()
    );
    assert!(rx.recv_async().await.is_err(), "nothing after the terminal");

    // A stream whose epoch dies: the consumer gets velo's Dropped.
    let rx = a.frames.bind(7, 2).await.expect("bind");
    let tx = b.frames.connect(worker_a, 7, 2).await.expect("connect");
    tx.send_async(items[0].clone()).await.expect("open");
    assert_eq!(rx.recv_async().await.expect("first item"), items[0]);
    assert!(
        kind.kill(a.transport.node(), PeerId(2)),
        "a live link to kill"
    );
    let last = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let frame = rx.recv_async().await.expect("a terminal comes");
            if frame != velo_frames::heartbeat() {
                return frame;
            }
        }
    })
    .await
    .expect("terminal arrives");
    assert_eq!(last, velo_frames::dropped());
    let decoded: StreamFrame<u32> = rmp_serde::from_slice(&last).expect("velo decodes it");
    assert!(matches!(decoded, StreamFrame::Dropped));
    // The idle sender's channel closes without another frame sent.
    until("B's idle sender saw its stream end", || {
        tx.is_disconnected()
    })
    .await;

    // A sender velo drops without a terminal also ends as Dropped (on the
    // next epoch: the node redials). B's mux may still be ending the dead
    // epoch: a slot opened then moves to the next one. Only B's link must
    // have ended: a batch posted on a link whose peer already closed it is
    // lost like any posted batch (docs/design.md § "A slot whose Open never
    // left").
    until("B's link saw the death", || {
        kind.link_ended(b.transport.node(), PeerId(1))
    })
    .await;
    let rx = a.frames.bind(7, 3).await.expect("bind");
    let tx = b.frames.connect(worker_a, 7, 3).await.expect("connect");
    drop(tx);
    assert_eq!(
        rx.recv_async().await.expect("terminal"),
        velo_frames::dropped()
    );

    // An unknown worker is an error, not a panic.
    assert!(
        b.frames
            .connect(velo_ext::InstanceId::new_v4().worker_id(), 7, 4)
            .await
            .is_err()
    );
}

/// A slow velo consumer of large frames: the frames waiting in velo's
/// channel are bounded in bytes, and the rest wait in the slot, where they
/// hold the sender's credit. Bounded in frames only, all 40 of 60 KB went
/// into velo's channel (the slot window is 256 KiB, and each frame taken
/// from the slot returned its credit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumers_channel_is_bounded_in_bytes_and_keeps_every_frame() {
    slow_consumer_under(256 * 1024).await;
}

/// A limit of 0 lets one frame at a time through; it used to stall the
/// stream for good (the channel was never under it, even empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_limit_of_zero_passes_one_frame_at_a_time() {
    slow_consumer_under(0).await;
}

/// 40 frames of 60 KB and a terminal toward a consumer that reads only once
/// the pump has had time to overfill its channel: at most `limit` rounded up
/// to whole frames (one at least) wait there, and every frame arrives.
async fn slow_consumer_under(limit: usize) {
    const FRAMES: usize = 40;
    let kind = velo_nodes::Mem::new(Shape::Default);
    let a = worker(&kind, 1).await;
    let b = worker(&kind, 2).await;
    join(&a, &b);
    let frames = a.transport.frame_transport(VeloConfig {
        stream_channel_bytes: limit,
        ..VeloConfig::default()
    });
    let rx = frames.bind(11, 1).await.expect("bind");
    let worker_a = a.messenger.instance_id().worker_id();
    let tx = b.frames.connect(worker_a, 11, 1).await.expect("connect");
    let items: Vec<Vec<u8>> = (0..FRAMES)
        .map(|i| rmp_serde::to_vec(&StreamFrame::Item(vec![i as u8; 60_000])).expect("encodes"))
        .collect();
    let len = items[0].len();
    let sender = tokio::spawn(async move {
        for item in items {
            tx.send_async(item).await.expect("open");
        }
        tx.send_async(velo_frames::finalized().to_vec())
            .await
            .expect("open");
    });
    until("velo's channel has frames", || {
        !rx.is_empty() && rx.len() * len >= limit
    })
    .await;
    // Time for the pump to overfill, had it no limit.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = rx.len();
    assert!(
        waiting <= limit.div_ceil(len).max(1),
        "{waiting} frames of {len} bytes"
    );
    for i in 0..FRAMES {
        let frame = rx.recv_async().await.expect("item");
        let item: StreamFrame<Vec<u8>> = rmp_serde::from_slice(&frame).expect("decodes");
        assert!(matches!(item, StreamFrame::Item(v) if v == vec![i as u8; 60_000]));
    }
    assert_eq!(
        rx.recv_async().await.expect("terminal"),
        velo_frames::finalized()
    );
    sender.await.expect("sender");
}

/// velo binds, then abandons the bind (an attach that failed after it, a
/// sender that never came): the idle ingress pump sees its receiver gone,
/// ends, and the key can be bound again. It used to wait for a frame that
/// never came, keeping its task and the mux's registry entry for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_bind_frees_its_pump_and_its_key() {
    let kind = velo_nodes::Mem::new(Shape::Default);
    let transport = Arc::new(QpmuxTransport::new(
        kind.node(1).await,
        VeloConfig::default(),
    ));
    let frames = transport.frame_transport(VeloConfig {
        stream_watch: Duration::from_millis(5),
        ..VeloConfig::default()
    });
    let mux = transport.node().mux();
    let rx = frames.bind(9, 1).await.expect("bind");
    assert!(
        mux.bind(qpmux::mux::StreamKey::new(9, 1)).is_err(),
        "bound while velo holds it"
    );
    drop(rx);
    until("the key is free again", || {
        mux.bind(qpmux::mux::StreamKey::new(9, 1)).is_ok()
    })
    .await;
}

/// A zero `stream_watch` is taken as the 1 ms floor: it used to panic
/// every bound stream's pump at its first turn (a zero interval), so
/// velo's consumer got no frame and no terminal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_periods_are_floored_and_a_bound_stream_still_delivers() {
    let kind = velo_nodes::Mem::new(Shape::Default);
    let a = worker(&kind, 1).await;
    let b = worker(&kind, 2).await;
    join(&a, &b);
    let zero = VeloConfig {
        stream_watch: Duration::ZERO,
        ..VeloConfig::default()
    };
    let frames = a.transport.frame_transport(zero);
    let rx = frames.bind(8, 1).await.expect("bind");
    let tx = b
        .frames
        .connect(a.messenger.instance_id().worker_id(), 8, 1)
        .await
        .expect("connect");
    let item = rmp_serde::to_vec(&StreamFrame::Item(vec![3u8; 16])).expect("encodes");
    tx.send_async(item.clone()).await.expect("sent");
    tx.send_async(velo_frames_finalized()).await.expect("sent");
    for expected in [item, velo_frames_finalized()] {
        let got = tokio::time::timeout(Duration::from_secs(10), rx.recv_async())
            .await
            .expect("a frame within 10 s")
            .expect("the pump is alive");
        assert_eq!(got, expected);
    }
}

fn velo_frames_finalized() -> Vec<u8> {
    rmp_serde::to_vec(&StreamFrame::<Vec<u8>>::Finalized).expect("encodes")
}

/// velo abandons a bind before its sender's OpenSlot arrives (the attach
/// raced a link outage longer than velo's consumer timeout): the late
/// sender is refused and hears, and the receiving node keeps nothing of
/// it. The pump's cleanup used to forget the key, so the late open made a
/// fresh entry nobody would bind, and the sender blocked on its window for
/// good, its bytes counted against its peer window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_late_for_an_abandoned_bind_is_refused() {
    let kind = velo_nodes::Mem::new(Shape::Default);
    let a = worker(&kind, 1).await;
    let b = worker(&kind, 2).await;
    join(&a, &b);
    let frames_a = a.transport.frame_transport(VeloConfig {
        stream_watch: Duration::from_millis(5),
        ..VeloConfig::default()
    });
    let mux_a = a.transport.node().mux();
    let rx = frames_a.bind(9, 1).await.expect("bind");
    drop(rx);
    // The idle pump looks every 5 ms and lets the key go.
    until("the pump abandons the binding", || {
        mux_a.stats().bindings_abandoned == 1
    })
    .await;
    let worker_a = a.messenger.instance_id().worker_id();
    let tx = b.frames.connect(worker_a, 9, 1).await.expect("connect");
    let item = rmp_serde::to_vec(&StreamFrame::Item(vec![0u8; 1024])).expect("encodes");
    for _ in 0..4 {
        if tx.send_async(item.clone()).await.is_err() {
            break;
        }
    }
    until("the late sender hears its stream refused", || {
        tx.is_disconnected()
    })
    .await;
    until("the receiving node keeps nothing of the sender", || {
        mux_a.peers_holding().is_empty()
    })
    .await;
    assert!(
        mux_a.stats().opens_refused >= 1,
        "refused, not fed and dropped"
    );
}

/// An item past the node's `max_record` (smaller than velo's own item
/// limit): velo took it as sent, so the consumer hears a transport error
/// that says why, not a bare `Dropped`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_past_the_record_limit_ends_its_stream_with_a_transport_error() {
    an_item_past_a_record_limit_is_said(4096, 4096, 8192, "4096").await;
}

/// The same for an item within the sender's `max_record` but past the
/// receiver's (its hello said so): the sender refuses it at `send`, while
/// the stream can still say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_past_the_receivers_record_limit_ends_its_stream_with_a_transport_error() {
    an_item_past_a_record_limit_is_said(4096, 1 << 20, 8192, "4096").await;
}

/// An item within the receiver's `max_record` but larger than its whole
/// window for this peer can never go; the sender's peer task finds that
/// only when it comes to write it, and the stream's Close says why, so
/// velo's consumer hears an error, not a bare `Dropped`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_past_the_receivers_peer_window_ends_its_stream_with_a_transport_error() {
    an_item_past_a_record_limit_is_said(1 << 20, 1 << 20, 100 * 1024, "its window").await;
}

async fn an_item_past_a_record_limit_is_said(
    receiver_max: usize,
    sender_max: usize,
    large_len: usize,
    said: &str,
) {
    let kind = velo_nodes::Mem::new(Shape::Default);
    let options = |max_record, peer_window| velo_nodes::Options {
        mux: qpmux::mux::MuxConfig {
            max_record,
            peer_window,
            ..qpmux::mux::MuxConfig::default()
        },
        ..velo_nodes::Options::default()
    };
    // The receiver's window for its peer: 64 KiB, so the case past it is
    // not a 64 MiB item.
    let a = worker_with(&kind, 1, options(receiver_max, 64 * 1024)).await;
    let b = worker_with(&kind, 2, options(sender_max, 64 * 1024)).await;
    join(&a, &b);
    let worker_a = a.messenger.instance_id().worker_id();
    let rx = a.frames.bind(7, 1).await.expect("bind");
    let tx = b.frames.connect(worker_a, 7, 1).await.expect("connect");
    let small = rmp_serde::to_vec(&StreamFrame::Item(vec![1u8; 16])).expect("encodes");
    let large = rmp_serde::to_vec(&StreamFrame::Item(vec![2u8; large_len])).expect("encodes");
    let next = || async {
        tokio::time::timeout(Duration::from_secs(10), rx.recv_async())
            .await
            .expect("a frame within 10 s")
            .expect("a frame")
    };
    tx.send_async(small.clone()).await.expect("open");
    // Delivered: the epoch's hellos are in, the receiver's limit known.
    assert_eq!(next().await, small);
    tx.send_async(large).await.expect("velo takes it");
    let last = next().await;
    let decoded: StreamFrame<Vec<u8>> = rmp_serde::from_slice(&last).expect("velo decodes it");
    match decoded {
        StreamFrame::TransportError(why) => assert!(why.contains(said), "{why}"),
        other => panic!("expected a transport error, got {other:?}"),
    }
}
