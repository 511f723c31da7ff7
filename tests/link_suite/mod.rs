//! Provider-generic RDMA link suite: the mux over [`RdmaLink`]s on any verbs
//! [`Device`], every link with `rnr_retry = 0`, so a credit bug ends an epoch
//! with RNR_RETRY_EXC_ERR instead of hiding behind retries.
//!
//! ```text
//!  LinkHarness::device() ×2 ─► Fabric: Mux A ─ RdmaLink (pair) ─ Mux B
//!  Mux::want_link ─► Fabric::connect ─► pair() on the next epoch ─► attach both ends
//! ```
//!
//! `tests/link_soft.rs` runs it on the soft provider (plain `cargo test`);
//! `tests/link_ibv.rs` on libibverbs, i.e. on kernel rxe in the QEMU guest
//! (`tests/rxe/run.sh`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::rdma::{CreditSnapshot, RdmaConfig, RdmaLink, pair};
use qpmux::mux::{Dialer, Epoch, Frame, Mux, MuxConfig, MuxTransport, PeerId, StreamKey, Terminal};
use qpmux::verbs::Device;
use rand::Rng;

#[path = "../common/slots.rs"]
mod slots;
use self::slots::{Traffic, never, prefix_then_one_dropped, record, seq_of, stream_tasks};

/// Failsafe for one wait: far above any expected time (rxe under QEMU TCG
/// included); it only turns a hang into a failure.
pub const FAILSAFE: Duration = Duration::from_secs(120);

/// What a provider supplies to the suite.
pub trait LinkHarness {
    /// The provider's device.
    type Dev: Device + Clone + 'static;
    /// A fresh device (or a fresh handle on the one device under test).
    fn device(&mut self) -> impl Future<Output = Self::Dev>;
    /// RNR NAKs sent so far by these devices, if the provider counts them;
    /// the suite asserts the count does not move.
    fn rnr_naks(devices: &[Self::Dev]) -> Option<u64>;
    /// Calls of the link's completion handler these devices made, if the
    /// provider runs one; the suite asserts that streaming made some.
    fn handler_calls(devices: &[Self::Dev]) -> Option<u64>;
    /// Slots in the streaming test (kernel rxe under TCG is slow).
    fn stream_slots(&self) -> u64;
}

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);

type Node<D> = (Mux<RdmaLink<D>>, D);

struct Nodes<D: Device + 'static> {
    nodes: HashMap<PeerId, Node<D>>,
    /// The current pair: the dialer's end, then the other.
    link: Option<(RdmaLink<D>, RdmaLink<D>)>,
    epoch: Epoch,
}

/// Two muxes joined by RDMA links, re-linked on demand by the muxes' dialers.
pub struct Fabric<D: Device + 'static> {
    config: RdmaConfig,
    nodes: Mutex<Nodes<D>>,
}

struct FabricDialer<D: Device + 'static> {
    fabric: Weak<Fabric<D>>,
    me: PeerId,
}

impl<D: Device + Clone + 'static> Dialer for FabricDialer<D> {
    fn want_link(&self, peer: PeerId) {
        if let Some(fabric) = self.fabric.upgrade() {
            fabric.connect(self.me, peer);
        }
    }
}

/// Muxes A and B on two of the harness's devices.
pub async fn fabric<H: LinkHarness>(
    h: &mut H,
    mux: MuxConfig,
) -> (
    Arc<Fabric<H::Dev>>,
    Mux<RdmaLink<H::Dev>>,
    Mux<RdmaLink<H::Dev>>,
) {
    let fabric = Arc::new(Fabric {
        config: link_config(),
        nodes: Mutex::new(Nodes {
            nodes: HashMap::new(),
            link: None,
            epoch: Epoch::default(),
        }),
    });
    let mut muxes = Vec::new();
    for id in [A, B] {
        let dialer = Arc::new(FabricDialer {
            fabric: Arc::downgrade(&fabric),
            me: id,
        });
        let m = Mux::new(mux.clone(), dialer);
        let dev = h.device().await;
        fabric.lock().nodes.insert(id, (m.clone(), dev));
        muxes.push(m);
    }
    let b = muxes.pop().expect("two");
    let a = muxes.pop().expect("two");
    (fabric, a, b)
}

impl<D: Device + Clone + 'static> Fabric<D> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Nodes<D>> {
        self.nodes.lock().expect("fabric lock")
    }

    fn connect(&self, me: PeerId, peer: PeerId) {
        let mut nodes = self.lock();
        if nodes
            .link
            .as_ref()
            .is_some_and(|(l, _)| l.end_reason().is_none())
        {
            return;
        }
        let (mux_me, dev_me) = nodes.nodes[&me].clone();
        let (mux_peer, dev_peer) = nodes.nodes[&peer].clone();
        nodes.epoch = nodes.epoch.next();
        let (mine, theirs) = pair(&dev_me, &dev_peer, nodes.epoch, self.config).expect("pair");
        nodes.link = Some((mine.clone(), theirs.clone()));
        drop(nodes);
        mux_me.attach(peer, mine);
        mux_peer.attach(me, theirs);
    }

    /// The current pair of link ends.
    pub fn links(&self) -> Option<(RdmaLink<D>, RdmaLink<D>)> {
        self.lock().link.clone()
    }

    /// Both devices, for counters.
    pub fn devices(&self) -> Vec<D> {
        self.lock().nodes.values().map(|(_, d)| d.clone()).collect()
    }
}

/// Small buffers and few receives, so credit runs out often; `rnr_retry = 0`.
fn link_config() -> RdmaConfig {
    RdmaConfig {
        recv_depth: 16,
        max_batch: 16 * 1024,
        send_buffers: 8,
        ..RdmaConfig::strict()
    }
}

/// Polls `cond` until it holds; panics after [`FAILSAFE`].
pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let give_up = tokio::time::Instant::now() + FAILSAFE;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < give_up,
            "waited {FAILSAFE:?} for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// [`FAILSAFE`] around one future.
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(FAILSAFE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("waited {FAILSAFE:?} for: {what}"),
    }
}

/// Nothing in flight from `from` to `to`: every credit is held by the sender
/// or accounted for at the receiver, and the sum is R.
fn settled<D: Device + 'static>(from: &RdmaLink<D>, to: &RdmaLink<D>) -> bool {
    let (s, r): (CreditSnapshot, CreditSnapshot) = (from.credit(), to.credit());
    s.unreturned == r.pending + r.owed
        && s.held + s.reserved + s.unreturned == from.config().recv_depth as u32
}

/// Many slots stream through one link in order, exactly once, and credit
/// (receive posts) keeps RNR unreachable: no RNR NAK, no epoch death.
pub async fn many_slots_in_order_without_rnr<H: LinkHarness>(h: &mut H) {
    let slots = h.stream_slots();
    let (fabric, a, b) = fabric(h, MuxConfig::default()).await;
    let records = 4u32;
    let mut consumers = Vec::new();
    let mut producers = Vec::new();
    let traffic = Traffic {
        records,
        // Every 25th slot sends one record larger than a batch.
        len: |s, n, rng| {
            if s % 25 == 0 && n == 1 {
                40 * 1024
            } else {
                rng.random_range(12..3000)
            }
        },
        pause: never,
    };
    for s in 0..slots {
        let key = StreamKey::new(1, s);
        let (consumer, producer) = stream_tasks(&a, &b, B, key, (s, s), traffic);
        consumers.push(consumer);
        producers.push(producer);
    }
    let rnr_before = H::rnr_naks(&fabric.devices());
    for p in producers {
        bounded("producer", p).await.expect("producer");
    }
    for c in consumers {
        assert_eq!(bounded("consumer", c).await.expect("consumer").0, records);
    }
    assert_eq!(a.stats().slots_dropped, 0);
    assert_eq!(a.stats().epoch_deaths, 0);
    assert_eq!(
        H::rnr_naks(&fabric.devices()),
        rnr_before,
        "credit made RNR unreachable"
    );
    if let Some(calls) = H::handler_calls(&fabric.devices()) {
        assert!(calls > 0, "the provider handed completions to the link");
    }
    let (x, y) = fabric.links().expect("link");
    assert_eq!((x.end_reason(), y.end_reason()), (None, None));
    assert!(x.stats().batches_sent + y.stats().batches_sent > 0);
    until("credit settles both ways", || {
        settled(&x, &y) && settled(&y, &x)
    })
    .await;
}

/// A receiver that stops draining stalls its sender on credit, without RNR
/// and without loss; draining resumes the stream in order.
pub async fn stalled_receiver_resumes_without_rnr<H: LinkHarness>(h: &mut H) {
    let mux_config = MuxConfig {
        slot_window: 32 * 1024,
        slot_budget: 64 * 1024,
        ..MuxConfig::default()
    };
    let (fabric, a, b) = fabric(h, mux_config).await;
    let rnr_before = H::rnr_naks(&fabric.devices());
    let key = StreamKey::new(2, 2);
    let mut rx = b.bind(key).expect("bind");
    let mut tx = a.open(B, key).expect("open");
    let total = 400u32;
    let producer = tokio::spawn(async move {
        for n in 0..total {
            tx.send(record(2, n, 1024)).await.expect("never dropped");
        }
        tx.finish(Terminal::Finalized).expect("finish");
    });
    until("the sender stalls on credit", || {
        a.stats().credit_stalls > 0 && a.stats().withheld_bytes > 0
    })
    .await;
    assert!(!producer.is_finished());
    assert_eq!(H::rnr_naks(&fabric.devices()), rnr_before);
    let (x, _) = fabric.links().expect("link");
    assert_eq!(x.end_reason(), None);
    let mut next = 0;
    while let Some(frame) = bounded("the next record", rx.recv()).await {
        match frame {
            Frame::Data(d) => {
                assert_eq!(seq_of(&d), next);
                next += 1;
            }
            Frame::Finalized => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    bounded("producer", producer).await.expect("producer");
    assert_eq!(next, total);
    assert_eq!(a.stats().slots_dropped, 0);
    assert_eq!(a.stats().epoch_deaths, 0);
    assert_eq!(H::rnr_naks(&fabric.devices()), rnr_before);
}

/// Records a few ms apart find B's peer task waiting: the link's reader
/// (the provider's completion handler, or the poller) decodes their
/// batches, and the receive buffers it takes come back to the sender, three
/// times the receive depth over.
pub async fn spaced_records_are_decoded_by_the_reader<H: LinkHarness>(h: &mut H) {
    let (fabric, a, b) = fabric(h, MuxConfig::default()).await;
    let key = StreamKey::new(4, 1);
    let mut rx = b.bind(key).expect("bind");
    let mut tx = a.open(B, key).expect("open");
    let records = 3 * link_config().recv_depth as u32;
    for n in 0..records {
        tx.send(record(4, n, 64)).await.expect("send");
        match bounded("the next record", rx.recv()).await {
            Some(Frame::Data(d)) => assert_eq!(seq_of(&d), n),
            other => panic!("expected record {n}, got {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let inline = b.stats().batches_received_inline;
    assert!(
        inline >= u64::from(records) / 2,
        "{inline} of {records} decoded by the reader"
    );
    assert_eq!(b.stats().protocol_violations, 0);
    let (x, y) = fabric.links().expect("link");
    assert_eq!((x.end_reason(), y.end_reason()), (None, None));
    until("credit settles both ways", || {
        settled(&x, &y) && settled(&y, &x)
    })
    .await;
}

/// The QP dies mid-stream: every live slot gets exactly one Dropped naming
/// the dead epoch, and the next epoch, on a fresh QP, carries new slots.
pub async fn qp_death_drops_each_slot_once_then_new_epoch<H: LinkHarness>(h: &mut H) {
    let (fabric, a, b) = fabric(h, MuxConfig::default()).await;
    let n_slots = 24u64;
    let mut receivers = Vec::new();
    let mut senders = Vec::new();
    for s in 0..n_slots {
        let key = StreamKey::new(3, s);
        receivers.push(b.bind(key).expect("bind"));
        senders.push(a.open(B, key).expect("open"));
    }
    for (s, tx) in senders.iter_mut().enumerate() {
        tx.send(record(s as u64, 0, 200)).await.expect("send");
    }
    for rx in &mut receivers {
        match bounded("the first record", rx.recv()).await {
            Some(Frame::Data(d)) => assert_eq!(seq_of(&d), 0),
            other => panic!("unexpected {other:?}"),
        }
    }
    let epoch = a.epoch(B).expect("link is up");
    for (s, tx) in senders.iter_mut().enumerate() {
        for n in 1..4 {
            tx.send(record(s as u64, n, 500)).await.expect("send");
        }
    }
    let (x, _) = fabric.links().expect("link");
    x.inject_qp_error().expect("modify_to_error");
    for rx in &mut receivers {
        bounded("the slot's end", prefix_then_one_dropped(rx, epoch)).await;
    }
    until("both muxes count every slot dropped", || {
        a.stats().slots_dropped == n_slots && b.stats().slots_dropped == n_slots
    })
    .await;
    drop(senders);
    let key = StreamKey::new(4, 0);
    let mut rx = b.bind(key).expect("bind");
    let mut tx = a.open(B, key).expect("open");
    tx.send(Bytes::from_static(b"again")).await.expect("send");
    tx.finish(Terminal::Finalized).expect("finish");
    assert_eq!(
        bounded("a record on the new epoch", rx.recv()).await,
        Some(Frame::Data(Bytes::from_static(b"again")))
    );
    assert_eq!(
        bounded("the new slot's end", rx.recv()).await,
        Some(Frame::Finalized)
    );
    assert_eq!(a.epoch(B), Some(epoch.next()));
    assert_eq!(a.stats().slots_dropped, n_slots, "nothing dropped twice");
}

/// Instantiate every property for a harness constructor.
#[macro_export]
macro_rules! link_suite {
    ($make:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn many_slots_in_order_without_rnr() {
            link_suite::many_slots_in_order_without_rnr(&mut $make).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn stalled_receiver_resumes_without_rnr() {
            link_suite::stalled_receiver_resumes_without_rnr(&mut $make).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn spaced_records_are_decoded_by_the_reader() {
            link_suite::spaced_records_are_decoded_by_the_reader(&mut $make).await;
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn qp_death_drops_each_slot_once_then_new_epoch() {
            link_suite::qp_death_drops_each_slot_once_then_new_epoch(&mut $make).await;
        }
    };
}
