//! The message class: ordered, fragmented, reported when never written.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::mem::{MemConfig, MemFabric, MemLink};
use qpmux::link::{EpochEnd, LinkFault};
use qpmux::mux::{
    DropReason, Epoch, Frame, MessageSink, Mux, MuxConfig, MuxTransport, OnFail, OutboundMessage,
    PeerId, SendError, StreamKey,
};

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);

#[derive(Default)]
struct Collect(Mutex<Vec<(PeerId, Bytes)>>);

impl MessageSink for Collect {
    fn deliver(&self, peer: PeerId, message: Bytes) {
        self.0.lock().expect("lock").push((peer, message));
    }
}

impl Collect {
    fn len(&self) -> usize {
        self.0.lock().expect("lock").len()
    }
}

async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A sink that holds the receiving peer task inside `deliver` until opened,
/// so the receiver takes no more batches and the sender's queue stays full.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
    entered: AtomicBool,
}

impl MessageSink for Gate {
    fn deliver(&self, _peer: PeerId, _message: Bytes) {
        self.entered.store(true, Ordering::Release);
        let mut open = self.open.lock().expect("lock");
        while !*open {
            open = self.opened.wait(open).expect("lock");
        }
    }
}

impl Gate {
    fn open(&self) {
        *self.open.lock().expect("lock") = true;
        self.opened.notify_all();
    }
}

fn nodes() -> (Arc<MemFabric>, Mux<MemLink>, Mux<MemLink>, Arc<Collect>) {
    let sink = Arc::new(Collect::default());
    let (fabric, a, b) = nodes_with(sink.clone());
    (fabric, a, b, sink)
}

fn nodes_with(sink: Arc<dyn MessageSink>) -> (Arc<MemFabric>, Mux<MemLink>, Mux<MemLink>) {
    nodes_configured(sink, MuxConfig::default())
}

fn nodes_configured(
    sink: Arc<dyn MessageSink>,
    config: MuxConfig,
) -> (Arc<MemFabric>, Mux<MemLink>, Mux<MemLink>) {
    let fabric = MemFabric::new(MemConfig {
        credits: 4,
        max_batch: 16 * 1024,
        send_buffers: 4,
    });
    let a = Mux::new(config.clone(), fabric.dialer(A));
    let b = Mux::new(config, fabric.dialer(B));
    fabric.add(A, a.clone());
    fabric.add(B, b.clone());
    assert!(b.set_message_sink(sink));
    (fabric, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arrive_in_order_whole_including_ones_larger_than_a_batch() {
    let (_fabric, a, _b, sink) = nodes();
    let (tx, rx) = flume::bounded(8);
    a.install_messages(B, rx);
    let mut sent = Vec::new();
    for i in 0..300u32 {
        let len = if i % 50 == 7 {
            900 * 1024
        } else {
            8 + (i as usize * 37) % 3000
        };
        let mut body = vec![(i % 256) as u8; len];
        body[..4].copy_from_slice(&i.to_be_bytes());
        let body = Bytes::from(body);
        sent.push(body.clone());
        tx.send_async(OutboundMessage::new(body))
            .await
            .expect("channel open");
    }
    until(|| sink.len() == sent.len()).await;
    let got = sink.0.lock().expect("lock");
    for ((peer, message), expected) in got.iter().zip(&sent) {
        assert_eq!(*peer, A);
        assert_eq!(message, expected);
    }
}

/// Idle retirement counts messages: two peers that only exchange messages
/// (velo's RPC shape, no streams) keep one epoch well past `idle_retire`.
/// On the paused clock, so a descheduled test thread is not idleness; a
/// message lost to a retirement fails the timeout rather than hanging.
#[tokio::test(start_paused = true)]
async fn messages_alone_keep_a_peer_from_retiring() {
    tokio::time::timeout(Duration::from_secs(30), messages_alone())
        .await
        .expect("every message delivered");
}

async fn messages_alone() {
    let fabric = MemFabric::new(MemConfig::default());
    let config = MuxConfig {
        idle_retire: Duration::from_millis(100),
        ..MuxConfig::default()
    };
    let a = Mux::new(config.clone(), fabric.dialer(A));
    let b = Mux::new(config, fabric.dialer(B));
    fabric.add(A, a.clone());
    fabric.add(B, b.clone());
    let sink = Arc::new(Collect::default());
    assert!(b.set_message_sink(sink.clone()));
    let (tx, rx) = flume::bounded(8);
    a.install_messages(B, rx);
    let started = tokio::time::Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_millis(600) {
        tx.send_async(OutboundMessage::new(Bytes::from_static(b"ping")))
            .await
            .expect("channel open");
        sent += 1;
        until(|| sink.len() == sent).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(a.epoch(B), Some(Epoch(1)), "after {sent} messages");
    assert_eq!(a.stats().epoch_deaths, 0);
}

/// The epoch comes up before the receiving side has a sink (velo's
/// transport installs it at `start`, and a redial may beat that): messages
/// before the sink are counted as unhandled, and once it is set the same
/// epoch delivers the rest. The sink used to be read once per epoch, so
/// that whole epoch's messages were dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_set_while_an_epoch_runs_gets_the_rest_of_it() {
    tokio::time::timeout(Duration::from_secs(20), sink_set_while_an_epoch_runs())
        .await
        .expect("the later message is delivered in the same epoch");
}

async fn sink_set_while_an_epoch_runs() {
    let fabric = MemFabric::new(MemConfig::default());
    let a = Mux::new(MuxConfig::default(), fabric.dialer(A));
    let b = Mux::new(MuxConfig::default(), fabric.dialer(B));
    fabric.add(A, a.clone());
    fabric.add(B, b.clone());
    let (tx, rx) = flume::bounded(8);
    a.install_messages(B, rx);
    tx.send_async(OutboundMessage::new(Bytes::from_static(b"early")))
        .await
        .expect("channel open");
    until(|| b.stats().drops.no_message_handler == 1).await;
    let epoch = b.epoch(A).expect("the epoch is up");
    let sink = Arc::new(Collect::default());
    assert!(b.set_message_sink(sink.clone()));
    tx.send_async(OutboundMessage::new(Bytes::from_static(b"after")))
        .await
        .expect("channel open");
    until(|| sink.len() == 1).await;
    assert_eq!(b.epoch(A), Some(epoch), "the same epoch");
    assert_eq!(
        *sink.0.lock().expect("lock"),
        [(A, Bytes::from_static(b"after"))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_never_written_are_reported_when_the_epoch_dies() {
    let (fabric, a, _b, sink) = nodes();
    let failed = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = flume::bounded(1024);
    a.install_messages(B, rx);
    tx.send_async(OutboundMessage::new(Bytes::from_static(b"first")))
        .await
        .expect("open");
    until(|| sink.len() == 1).await;
    assert!(fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected)));
    until(|| a.epoch(B).is_none() || tx.is_disconnected()).await;
    // The old epoch's channel is closed; what is sent into it is reported.
    until(|| tx.is_disconnected()).await;
    let report = failed.clone();
    let message = OutboundMessage {
        body: Bytes::from_static(b"late"),
        on_fail: Some(Box::new(move |body| {
            report.lock().expect("lock").push(body)
        })),
    };
    assert!(
        tx.send(message).is_err(),
        "a closed channel hands the message back"
    );
    // The handed-back message was dropped with the error: reported once.
    assert_eq!(
        failed.lock().expect("lock").as_slice(),
        [Bytes::from_static(b"late")]
    );
    // A fresh channel serves the next epoch.
    let (tx2, rx2) = flume::bounded(8);
    a.install_messages(B, rx2);
    tx2.send_async(OutboundMessage::new(Bytes::from_static(b"again")))
        .await
        .expect("open");
    until(|| sink.len() == 2).await;
    assert_eq!(a.stats().epoch_deaths, 1);
}

/// B's peer task held inside its first delivery, so it takes no more
/// batches and A's link credit runs out: `total` messages of 4000 bytes
/// queued at A (message `n` with the failure hook `hook(n)`), then the link
/// killed. Returns once A's channel has closed and B is let go.
async fn queue_then_kill(
    total: usize,
    hook: impl Fn(usize) -> OnFail,
) -> (Arc<MemFabric>, Mux<MemLink>, Mux<MemLink>) {
    let gate = Arc::new(Gate::default());
    // The gate stalls B's peer task on purpose (a sink must not block):
    // decoding in the mem link's reader, A's `post`, it would stall A.
    let config = MuxConfig {
        inline_receive: false,
        ..MuxConfig::default()
    };
    let (fabric, a, b) = nodes_configured(gate.clone(), config);
    let (tx, rx) = flume::bounded(4096);
    a.install_messages(B, rx);
    for n in 0..total {
        tx.send_async(OutboundMessage {
            body: Bytes::from(vec![1u8; 4000]),
            on_fail: Some(hook(n)),
        })
        .await
        .expect("open");
    }
    until(|| gate.entered.load(Ordering::Acquire)).await;
    fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected));
    until(|| tx.is_disconnected()).await;
    gate.open();
    (fabric, a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_messages_are_reported_exactly_once_on_epoch_death() {
    let failed = Arc::new(Mutex::new(0usize));
    let total = 2_000usize;
    let (_fabric, _a, b) = queue_then_kill(total, |_| {
        let report = failed.clone();
        Box::new(move |_| *report.lock().expect("lock") += 1)
    })
    .await;
    let reported = *failed.lock().expect("lock");
    // At most credits (4) batches of 16 KiB reached B: 4 messages each.
    assert!(
        reported >= total - 4 * 4,
        "the queued messages were reported: {reported}"
    );
    until(|| b.stats().epoch_deaths == 1).await;
    let delivered = b.stats().records_received; // upper bound on messages delivered
    assert!(
        reported as u64 + delivered >= total as u64,
        "none lost silently"
    );
    assert!(reported <= total, "none reported twice");
}

/// The sender's failure hook panics for one queued message when the epoch
/// dies: the panic stops at that message, so every other queued message is
/// still reported, the epoch's end is bookkept (no peer task panic), and
/// the next epoch carries messages. Before, the panic unwound through the
/// end of the epoch, leaving the rest unreported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_failure_hook_stops_at_its_message() {
    tokio::time::timeout(Duration::from_secs(20), failure_hook_panics())
        .await
        .expect("the next epoch takes the next message");
}

async fn failure_hook_panics() {
    let failed = Arc::new(Mutex::new(0usize));
    let total = 200usize;
    let (_fabric, a, _b) = queue_then_kill(total, |n| {
        let report = failed.clone();
        Box::new(move |_| {
            if n == total / 2 {
                panic!("a sender's hook bug");
            }
            *report.lock().expect("lock") += 1;
        })
    })
    .await;
    let reported = *failed.lock().expect("lock");
    // At most credits (4) batches of 16 KiB reached B: 4 messages each; one
    // of the rest panicked instead of reporting.
    assert!(
        reported >= total - 4 * 4 - 1,
        "the other queued messages were reported: {reported}"
    );
    assert_eq!(a.stats().peer_task_panics, 0, "caught at the message");
    until(|| a.epoch(B).is_none()).await;
    let (tx2, rx2) = flume::bounded(8);
    a.install_messages(B, rx2);
    let report = failed.clone();
    tx2.send_async(OutboundMessage {
        body: Bytes::from_static(b"next epoch"),
        on_fail: Some(Box::new(move |_| *report.lock().expect("lock") += 1000)),
    })
    .await
    .expect("open");
    until(|| a.epoch(B).is_some() && tx2.is_empty()).await;
}

/// A sink that panics on its first message, then collects.
#[derive(Default)]
struct PanicsOnce {
    panicked: AtomicBool,
    got: Collect,
}

impl MessageSink for PanicsOnce {
    fn deliver(&self, peer: PeerId, message: Bytes) {
        if !self.panicked.swap(true, Ordering::AcqRel) {
            panic!("a message sink's bug");
        }
        self.got.deliver(peer, message);
    }
}

/// Opens stream `session` from `a` to `b`, sees one record through it, then
/// sends `message` to `b` on a fresh message channel; returns the stream.
async fn slot_and_message(
    a: &Mux<MemLink>,
    b: &Mux<MemLink>,
    session: u64,
    message: &'static [u8],
) -> (qpmux::mux::SlotSender, qpmux::mux::SlotReceiver) {
    let key = StreamKey::new(5, session);
    let mut rx = b.bind(key).expect("bind");
    let mut tx = a.open(B, key).expect("open");
    tx.send(Bytes::from_static(b"record")).await.expect("send");
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"record")))
    );
    let (messages, rx_messages) = flume::bounded(8);
    a.install_messages(B, rx_messages);
    messages
        .send_async(OutboundMessage::new(Bytes::from_static(message)))
        .await
        .expect("open");
    (tx, rx)
}

/// A panic in the receiving peer task (here the message sink's) ends that
/// epoch like a fault: each live slot on both sides hears `Dropped` once,
/// the panic is counted, and the next epoch carries new slots and messages.
/// Before, the task died with the panic and both muxes stayed in epoch 1
/// with every slot waiting for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_peer_task_ends_its_epoch_not_the_peer() {
    let served = tokio::time::timeout(Duration::from_secs(20), async {
        let sink = Arc::new(PanicsOnce::default());
        let (_fabric, a, b) = nodes_with(sink.clone());
        let (tx, mut rx) = slot_and_message(&a, &b, 1, b"boom").await;
        let ended = Some(Frame::Dropped(DropReason::EpochEnded { epoch: Epoch(1) }));
        assert_eq!(rx.recv().await, ended);
        assert_eq!(rx.recv().await, None);
        assert_eq!(
            tx.closed().await,
            SendError::Dropped(DropReason::EpochEnded { epoch: Epoch(1) })
        );
        assert_eq!(b.stats().peer_task_panics, 1);
        // The next epoch serves.
        let _next = slot_and_message(&a, &b, 2, b"again").await;
        until(|| sink.got.len() == 1).await;
        assert_eq!(b.epoch(A), Some(Epoch(2)));
        assert_eq!(b.stats().epoch_deaths, 1);
    })
    .await;
    served.expect("a panicked task left its slots waiting");
}
