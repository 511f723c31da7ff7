//! The RDMA link over the soft RoCEv2 provider on loopback UDP, with
//! `rnr_retry = 0` everywhere: a credit bug ends an epoch with
//! RNR_RETRY_EXC_ERR (status 13) instead of hiding behind retries.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use qpmux::link::rdma::{CreditSnapshot, PreparedEnd, RdmaConfig, RdmaLink, pair};
use qpmux::link::{Arrivals, EpochEnd, Link, LinkError, LinkFault};
use qpmux::mux::{Epoch, ProtocolError};
use qpmux::verbs::soft::udp::UdpConfig;
use qpmux::verbs::soft::{SoftCq, SoftDevice, SoftPd, SoftQp};
use qpmux::verbs::{
    AccessFlags, Device, InitAttr, MemoryRegion, QpAddress, QpCaps, QueuePair, RecvWr, RtrAttr,
    RtsAttr, SendOpcode, SendWr, Sge,
};
use rand::{Rng, SeedableRng};

type Soft = RdmaLink<SoftDevice>;

#[path = "common/arrivals.rs"]
mod arrivals;

async fn device() -> SoftDevice {
    SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback")
}

fn config(recv_depth: usize) -> RdmaConfig {
    RdmaConfig {
        recv_depth,
        max_batch: 4096,
        send_buffers: 8,
        ..RdmaConfig::strict()
    }
}

async fn linked(recv_depth: usize) -> (SoftDevice, SoftDevice, Soft, Soft) {
    let (da, db) = (device().await, device().await);
    let (a, b) = pair(&da, &db, Epoch(1), config(recv_depth)).expect("pair");
    (da, db, a, b)
}

/// Waits (on state, polling) until `cond` holds.
async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Nothing in flight from `from` to `to`: every credit is held by the sender
/// or accounted for at the receiver, and the sum is R.
fn settled(from: &Soft, to: &Soft) -> bool {
    let (s, r): (CreditSnapshot, CreditSnapshot) = (from.credit(), to.credit());
    s.unreturned == r.pending + r.owed
        && s.held + s.reserved + s.unreturned == from.config().recv_depth as u32
}

async fn send(link: &Soft, payload: &[u8]) {
    let mut buf = link.reserve().await.expect("reserve");
    buf[..payload.len()].copy_from_slice(payload);
    link.post(buf, payload.len()).expect("post");
}

/// True when `reserve` would wait right now.
async fn reserve_waits(link: &Soft) -> bool {
    tokio::select! {
        biased;
        r = link.reserve() => { drop(r.expect("reserve")); false }
        _ = std::future::ready(()) => true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_without_credit_waits_and_never_causes_rnr() {
    let (da, db, a, b) = linked(4).await;
    // The last credit only goes to a message that returns credit: 3 of 4.
    for n in 0..3u8 {
        send(&a, &[n; 100]).await;
    }
    assert!(reserve_waits(&a).await, "no credit left for a batch");
    let waiter = {
        let a = a.clone();
        tokio::spawn(async move { send(&a, b"after").await })
    };
    let mut held = Vec::new();
    for n in 0..3u8 {
        let batch = b.recv().await.expect("batch");
        assert_eq!(&batch[..], &[n; 100][..]);
        held.push(batch);
    }
    assert!(
        !waiter.is_finished(),
        "still waiting while B holds every batch"
    );
    drop(held); // three re-posts ≥ threshold 2: a credit-only message goes back
    waiter.await.expect("the waiter got credit");
    assert_eq!(&b.recv().await.expect("batch")[..], b"after");
    assert!(b.stats().credit_only_sent >= 1);
    assert_eq!(a.end_reason(), None);
    assert_eq!(da.counters().rnr_naks_received, 0);
    assert_eq!(db.counters().rnr_naks_sent, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_traffic_both_ways_arrives_in_order_without_rnr() {
    // R = 8, threshold 2: consumers holding up to R - threshold - 1 = 5
    // batches never stall their sender for good.
    let (da, db, a, b) = linked(8).await;
    const N: u32 = 300;
    let mut tasks = Vec::new();
    for (tx, rx, seed) in [(a.clone(), b.clone(), 1), (b.clone(), a.clone(), 2)] {
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            for n in 0..N {
                let len = rng.random_range(4..=4096);
                let mut buf = tx.reserve().await.expect("reserve");
                buf[..4].copy_from_slice(&n.to_be_bytes());
                buf[len - 1] = n as u8;
                tx.post(buf, len).expect("post");
                if rng.random_bool(0.2) {
                    tokio::task::yield_now().await;
                }
            }
        }));
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed + 10);
            let mut held = std::collections::VecDeque::new();
            for n in 0..N {
                let batch = rx.recv().await.expect("batch");
                let seq = u32::from_be_bytes(batch[..4].try_into().expect("4 bytes"));
                assert_eq!(seq, n, "in order, exactly once");
                assert_eq!(batch[batch.len() - 1], n as u8, "intact");
                held.push_back(batch);
                let keep = rng.random_range(0..=5);
                while held.len() > keep {
                    held.pop_front();
                }
                if rng.random_bool(0.3) {
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    until(|| settled(&a, &b) && settled(&b, &a)).await;
    assert_eq!((a.end_reason(), b.end_reason()), (None, None));
    assert_eq!(da.counters().rnr_naks_sent + db.counters().rnr_naks_sent, 0);
    let stats = a.stats();
    assert!(
        stats.signaled_sends < stats.batches_sent + stats.credit_only_sent,
        "selective signaling: {stats:?}"
    );
}

/// Both directions of random traffic over the simulated network with loss,
/// duplication and reordering: RC recovers, credit never overruns (no RNR
/// with `rnr_retry = 0`), everything arrives in order. The test task drives
/// the network in virtual time between polls of the link tasks.
async fn sim_traffic(seed: u64) {
    use qpmux::verbs::soft::SoftConfig;
    use qpmux::verbs::soft::sim::{LinkConfig, SimNet};
    let mut net = SimNet::new(seed);
    net.set_default_link(LinkConfig {
        loss: 0.03,
        duplicate: 0.03,
        reorder: 0.03,
        reorder_delay: Duration::from_micros(30),
        ..LinkConfig::default()
    });
    let (da, db) = (
        net.add_device(SoftConfig::default()),
        net.add_device(SoftConfig::default()),
    );
    let (a, b) = pair(&da, &db, Epoch(1), config(8)).expect("pair");
    const N: u32 = 120;
    let mut tasks = Vec::new();
    for (tx, rx, s) in [
        (a.clone(), b.clone(), seed),
        (b.clone(), a.clone(), seed + 1),
    ] {
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(s);
            for n in 0..N {
                let len = rng.random_range(4..=3000);
                let mut buf = tx.reserve().await.expect("reserve");
                buf[..4].copy_from_slice(&n.to_be_bytes());
                tx.post(buf, len).expect("post");
            }
        }));
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(s + 100);
            let mut held = std::collections::VecDeque::new();
            for n in 0..N {
                let batch = rx.recv().await.expect("batch");
                assert_eq!(&batch[..4], &n.to_be_bytes()[..], "in order");
                held.push_back(batch);
                let keep = rng.random_range(0..=5);
                while held.len() > keep {
                    held.pop_front();
                }
            }
        }));
    }
    let mut steps = 0u64;
    while !(tasks.iter().all(|t| t.is_finished()) && settled(&a, &b) && settled(&b, &a)) {
        net.step();
        tokio::task::yield_now().await;
        steps += 1;
        assert!(steps < 1_000_000, "failing simulation seed: {seed}");
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(
        (a.end_reason(), b.end_reason()),
        (None, None),
        "seed {seed}"
    );
    assert_eq!(da.counters().rnr_naks_sent + db.counters().rnr_naks_sent, 0);
    assert!(net.stats().dropped > 0, "the faults were exercised");
}

#[tokio::test]
async fn credit_holds_under_loss_duplication_and_reordering_in_the_sim() {
    let seeds = std::env::var("QPMUX_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(0..4, |s: u64| s..s + 1);
    for seed in seeds {
        sim_traffic(seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_batch_returns_exactly_one_credit() {
    let (_da, _db, a, b) = linked(8).await;
    for _ in 0..4 {
        send(&a, b"x").await;
    }
    let mut batches = Vec::new();
    for _ in 0..4 {
        batches.push(b.recv().await.expect("batch"));
    }
    assert_eq!(a.credit().unreturned, 4);
    drop(batches.pop());
    until(|| b.credit().owed == 1).await;
    assert_eq!(b.stats().credit_only_sent, 0, "1 owed < threshold 2");
    // The next batch B sends carries the count in its immediate.
    send(&b, b"carrier").await;
    drop(a.recv().await.expect("carrier"));
    assert_eq!(a.credit().unreturned, 3, "exactly one credit came back");
    assert_eq!(a.credit().held, 5);
    drop(batches);
    until(|| a.credit().unreturned == 0).await;
    assert!(settled(&a, &b) && settled(&b, &a));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_peers_send_no_credit_only_traffic() {
    let (_da, _db, a, b) = linked(32).await;
    for round in 0..3 {
        for n in 0..40u32 {
            send(&a, &n.to_be_bytes()).await;
            drop(b.recv().await.expect("batch"));
            if n % (round + 2) == 0 {
                send(&b, b"back").await;
                drop(a.recv().await.expect("batch"));
            }
        }
    }
    // Settle: nothing in flight either way, every owed count below threshold.
    until(|| settled(&a, &b) && settled(&b, &a)).await;
    let threshold = 32 / 4;
    assert!(a.credit().owed < threshold && b.credit().owed < threshold);
    // What each side posted (a late completion may still count an ACK).
    let sent =
        |s: qpmux::link::rdma::LinkStats| (s.batches_sent, s.credit_only_sent, s.signaled_sends);
    let before = (sent(a.stats()), sent(b.stats()));
    tokio::time::sleep(Duration::from_millis(50)).await; // a quiet period
    assert_eq!(
        (sent(a.stats()), sent(b.stats())),
        before,
        "no SEND while idle"
    );
    assert!(settled(&a, &b) && settled(&b, &a));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_ends_both_sides_after_completed_receives() {
    let (_da, _db, a, b) = linked(4).await;
    for n in 0..3u8 {
        send(&a, &[n; 10]).await;
    }
    until(|| b.stats().batches_received == 3).await;
    let blocked = {
        let a = a.clone();
        tokio::spawn(async move { a.reserve().await.map(drop) })
    };
    b.fail(EpochEnd::Fault(LinkFault::Injected));
    let epoch = Epoch(1);
    assert_eq!(
        blocked.await.expect("task"),
        Err(LinkError::Ended {
            epoch,
            reason: EpochEnd::PeerClosed
        })
    );
    for n in 0..3u8 {
        assert_eq!(&b.recv().await.expect("completed first")[..], &[n; 10][..]);
    }
    assert_eq!(
        b.recv().await.map(drop),
        Err(LinkError::Ended {
            epoch,
            reason: EpochEnd::Fault(LinkFault::Injected)
        })
    );
    assert_eq!(a.ended().await, EpochEnd::PeerClosed);
    assert_eq!(b.ended().await, EpochEnd::Fault(LinkFault::Injected));
    assert!(a.reserve().await.is_err() && a.recv().await.is_err());
}

/// A graceful close delivers both ways on RDMA too: the SENDs the peer
/// posted before it heard of our close land in our receives and are
/// delivered before the end, and the peer ends `PeerClosed`. `pair` tells
/// the peer at once, so the window in which the peer's SENDs are still in
/// flight is short here; over a liveness connection it is longer, and
/// `velo_transport::rdma::sends_both_ways_…` fails without the wait for
/// the peer's last SENDs (docs/design.md § "A closed link delivers both
/// ways").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_close_delivers_what_the_peer_had_posted() {
    closing_mid_stream_delivers_what_the_peer_had_posted(EpochEnd::Closed).await;
}

/// A link replaced by the same peer's newer one closes the same way: the
/// peer moved on, but what it posted here before it did still lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_link_delivers_what_the_peer_had_posted() {
    closing_mid_stream_delivers_what_the_peer_had_posted(EpochEnd::Replaced).await;
}

async fn closing_mid_stream_delivers_what_the_peer_had_posted(reason: EpochEnd) {
    let (_da, _db, a, b) = linked(16).await;
    let sender = {
        let b = b.clone();
        tokio::spawn(async move {
            let mut posted = 0u32;
            while let Ok(mut buf) = b.reserve().await {
                buf[..4].copy_from_slice(&posted.to_be_bytes());
                if b.post(buf, 4).is_err() {
                    break;
                }
                posted += 1;
            }
            posted
        })
    };
    // a reads a while, closes mid-stream, and reads on to the end.
    let mut got = 0u32;
    let end = loop {
        if got == 200 {
            a.fail(reason);
        }
        match a.recv().await {
            Ok(batch) => {
                assert_eq!(&batch[..4], &got.to_be_bytes()[..], "in order");
                got += 1;
            }
            Err(end) => break end,
        }
    };
    let posted = sender.await.expect("sender");
    assert_eq!(got, posted, "every SEND b posted was delivered: {end:?}");
    assert_eq!(a.ended().await, reason);
    assert_eq!(b.ended().await, EpochEnd::PeerClosed);
    // Each wait ended on its event, not its bound: the ends' last WRs
    // (credit returns, batches) were mostly unsignaled, and fences retired
    // them.
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!((sa.close_waits_expired, sb.close_waits_expired), (0, 0));
    assert!(sa.closing_fences + sb.closing_fences > 0, "{sa:?} {sb:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_qp_ends_the_epoch_and_delivers_completed_receives() {
    let (_da, _db, a, b) = linked(8).await;
    send(&a, b"one").await;
    send(&a, b"two").await;
    until(|| b.stats().batches_received == 2).await;
    let receiver = {
        let a = a.clone();
        tokio::spawn(async move { a.recv().await.map(drop) })
    };
    b.inject_qp_error().expect("modify_to_error");
    let flushed = EpochEnd::Fault(LinkFault::Completion { status: 5 });
    assert_eq!(b.ended().await, flushed);
    assert_eq!(&b.recv().await.expect("first")[..], b"one");
    assert_eq!(&b.recv().await.expect("second")[..], b"two");
    assert!(b.recv().await.is_err());
    assert!(matches!(
        receiver.await.expect("task"),
        Err(LinkError::Ended {
            reason: EpochEnd::PeerClosed,
            ..
        })
    ));
}

/// A link end on `config` connected to a hand-driven QP that never posts a
/// receive: every SEND meets an RNR NAK. The peer's QP, CQ and PD come back
/// to be dropped after the link.
fn linked_to_empty_receive_queue(
    dev: &SoftDevice,
    config: RdmaConfig,
) -> (Soft, (SoftQp, SoftCq, SoftPd)) {
    let end = PreparedEnd::new(dev, config).expect("link end");
    let pd = dev.alloc_pd().expect("pd");
    let cq = dev.create_cq(64).expect("cq");
    let qp = dev.create_qp(&pd, &cq, &cq, QpCaps::default()).expect("qp");
    qp.modify_to_init(InitAttr {
        access: AccessFlags::LOCAL_WRITE,
    })
    .expect("init");
    let link = end
        .connect(&QpAddress::of(dev, &qp), Epoch(7))
        .expect("connect");
    let port = dev.query_port();
    qp.modify_to_rtr(RtrAttr::for_peer(&link.address(), port.active_mtu, 12))
        .expect("rtr");
    (link, (qp, cq, pd))
}

/// A peer that announced receives and posts none answers every SEND with
/// an RNR NAK. With RNR retries unlimited (the old default) the link's
/// sends, and the pool chunks under them, waited for as long as the peer
/// kept its connection; four such peers held a node's whole send pool. Now
/// the retries run out and the epoch ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_posts_no_receives_ends_the_epoch_under_the_default_config() {
    let dev = device().await;
    let defaults = RdmaConfig {
        recv_depth: 8,
        max_batch: 4096,
        ..RdmaConfig::default()
    };
    let (link, peer) = linked_to_empty_receive_queue(&dev, defaults);
    send(&link, b"into a receive queue left empty").await;
    let ended = tokio::time::timeout(Duration::from_secs(20), link.ended()).await;
    assert_eq!(
        ended.expect("the epoch ends, not waits for ever"),
        EpochEnd::Fault(LinkFault::Completion {
            status: 13 // IBV_WC_RNR_RETRY_EXC_ERR
        })
    );
    assert_eq!(
        dev.counters().rnr_naks_received,
        7,
        "the first and six retries"
    );
    drop(peer);
}

/// A link end with RNR retries unlimited (`rnr_retry = 7`) facing an empty
/// receive queue, its two send buffers posted (the second, the last the
/// end may hold, signaled): its SENDs never complete and never fail. Its
/// stall limit is the 2 s floor (8 tries of 1 ms).
async fn stalled_at_its_cap(dev: &SoftDevice) -> (Soft, (SoftQp, SoftCq, SoftPd)) {
    let forever = RdmaConfig {
        recv_depth: 8,
        max_batch: 4096,
        send_buffers: 2,
        rnr_retry: 7,
        timeout: 8,
        ..RdmaConfig::default()
    };
    let (link, peer) = linked_to_empty_receive_queue(dev, forever);
    send(&link, b"one").await;
    send(&link, b"two: the last buffer, signaled").await;
    (link, peer)
}

/// A peer whose RC layer never completes our SENDs, and never lets the
/// retry budget run out either (here: RNR NAKs with `rnr_retry = 7`; a lone
/// ACK per retry period does the same), would hold our share of the send
/// pool for as long as it keeps the connection. A `reserve` that waits past
/// the stall limit (twice the retry budget) ends the epoch instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_a_peer_never_completes_end_the_epoch_at_the_stall_limit() {
    let dev = device().await;
    let (link, peer) = stalled_at_its_cap(&dev).await;
    let third = tokio::time::timeout(Duration::from_secs(20), link.reserve()).await;
    let stalled = EpochEnd::Fault(LinkFault::SendsStalled);
    assert!(
        matches!(
            third.expect("reserve ends, not waits for ever"),
            Err(LinkError::Ended { reason, .. }) if reason == stalled
        ),
        "the epoch ended as stalled"
    );
    assert_eq!(link.ended().await, stalled);
    assert!(dev.counters().rnr_naks_received > 7, "RNR NAKs went on");
    drop(peer);
}

/// The same stall on a link nothing more is written on: no `reserve`
/// waits, so only a look from outside (a node's sweep, once a second)
/// finds it, and ends the epoch at the second look past the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_link_nothing_waits_on_ends_at_a_sweeps_second_look() {
    let dev = device().await;
    let (link, peer) = stalled_at_its_cap(&dev).await;
    assert!(!link.check_stall(), "not past the limit yet");
    // Past the limit (its 2 s floor): the first look there is no verdict.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let first_look = std::time::Instant::now();
    assert!(
        !link.check_stall(),
        "one look past the limit is not a verdict"
    );
    // Nor is a second one at once (two lookers woken together after a
    // pause: the completions they both missed may still be unread), if
    // this thread was not held up across the two.
    let second = link.check_stall();
    if first_look.elapsed() < Duration::from_millis(40) {
        assert!(!second, "two looks at once are not a verdict");
        assert_eq!(link.end_reason(), None);
    }
    let looks = async {
        while !link.check_stall() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    if !second {
        tokio::time::timeout(Duration::from_secs(20), looks)
            .await
            .expect("a later look ends the epoch");
    }
    assert_eq!(link.ended().await, EpochEnd::Fault(LinkFault::SendsStalled));
    drop(peer);
}

/// A peer whose RC layer completes our last signaled SEND and holds the
/// unsignaled one behind it (here: receives for the first two messages
/// only, then RNR NAKs for ever) left nothing for the stall detector to
/// time, and the tail's pool chunk stayed out for the epoch's life. Past
/// the stall limit a look now posts a signaled fence behind the tail, and
/// the epoch ends at the limit after it (review 43d).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsignaled_tail_the_peer_holds_is_fenced_and_ends_at_the_stall_limit() {
    let dev = device().await;
    let every_other = RdmaConfig {
        recv_depth: 8,
        max_batch: 4096,
        send_buffers: 4,
        signal_every: 2,
        rnr_retry: 7,
        timeout: 8,
        ..RdmaConfig::default()
    };
    let (link, (qp, cq, pd)) = linked_to_empty_receive_queue(&dev, every_other);
    let mr = dev
        .reg_mr(&pd, 1 << 14, AccessFlags::LOCAL_WRITE)
        .expect("mr");
    let inboxes: Vec<[Sge<'_, _>; 1]> = (0..2)
        .map(|i| {
            [Sge {
                mr: &mr,
                offset: i * 4096,
                len: 4096,
            }]
        })
        .collect();
    let wrs: Vec<RecvWr<'_, _>> = inboxes
        .iter()
        .enumerate()
        .map(|(i, sg_list)| RecvWr {
            wr_id: i as u64,
            sg_list,
        })
        .collect();
    qp.post_recv(&wrs).expect("two receives");
    send(&link, b"one: unsignaled").await;
    send(&link, b"two: signaled").await;
    send(&link, b"three: unsignaled, the tail").await;
    // The signaled second completes, and with it the first.
    until(|| link.stats().sends_acked == 1).await;
    assert_eq!(link.stats().signaled_sends, 1);
    assert_eq!(link.send_pool().stats().in_use, 1, "the tail's chunk");
    assert!(!link.check_stall(), "before the limit");
    assert_eq!(link.stats().tail_fences, 0);
    let looks = async {
        while !link.check_stall() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), looks)
        .await
        .expect("a look ends the epoch");
    assert_eq!(link.ended().await, EpochEnd::Fault(LinkFault::SendsStalled));
    assert_eq!(link.stats().tail_fences, 1);
    tokio::time::timeout(
        Duration::from_secs(10),
        until(|| link.send_pool().stats().in_use == 0),
    )
    .await
    .expect("the tail's chunk goes back to the pool");
    drop((qp, cq, mr));
}

/// The same look on an honest link gone idle after an unsignaled SEND
/// (completed, unreported, its chunk held): the fence past the stall limit
/// completes, the chunk comes back, and the link carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_links_completed_tail_is_fenced_and_its_chunk_comes_back() {
    let (da, db) = (device().await, device().await);
    let every_fourth = RdmaConfig {
        signal_every: 4,
        timeout: 8,
        ..config(8)
    };
    let (a, b) = pair(&da, &db, Epoch(1), every_fourth).expect("pair");
    send(&a, b"one").await;
    assert_eq!(&b.recv().await.expect("a batch")[..], b"one");
    assert_eq!(a.stats().signaled_sends, 0);
    assert_eq!(a.send_pool().stats().in_use, 1, "completed, unreported");
    assert!(!a.check_stall());
    assert_eq!(a.stats().tail_fences, 0, "not before the limit");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert!(!a.check_stall(), "a fence, not a verdict");
    assert_eq!(a.stats().tail_fences, 1);
    tokio::time::timeout(
        Duration::from_secs(10),
        until(|| a.send_pool().stats().in_use == 0),
    )
    .await
    .expect("the chunk comes back");
    assert!(!a.check_stall());
    assert_eq!(a.stats().tail_fences, 1, "one fence a tail");
    // b answered with a credit-only message, unsignaled and holding no
    // chunk: no tail to fence, past the limit too (idle ends once answered
    // each other's fences for ever).
    assert!(b.stats().credit_only_sent > 0, "b answered");
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert!(!b.check_stall());
    assert_eq!(b.stats().tail_fences, 0, "a credit-only message is no tail");
    assert!(!a.check_stall());
    assert_eq!(a.stats().tail_fences, 1);
    send(&a, b"two").await;
    assert_eq!(&b.recv().await.expect("a batch")[..], b"two");
    assert_eq!((a.end_reason(), b.end_reason()), (None, None));
}

/// The stall limit judges SENDs the peer's RC layer never completes, not
/// a slow consumer: a receiver that holds every batch for longer than the
/// limit (2 s here) leaves the sender out of link credit, its `reserve`
/// waiting with nothing posted unacknowledged for it or a sweep to judge,
/// so nothing ends, and the rest arrives once it reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_slower_than_the_stall_limit_ends_nothing() {
    tokio::time::timeout(Duration::from_secs(30), slower_consumer())
        .await
        .expect("the test's steps took their time");
}

async fn slower_consumer() {
    let (da, db) = (device().await, device().await);
    // Every SEND signaled, so each is judged (and each completes).
    let every = RdmaConfig {
        signal_every: 1,
        ..config(4)
    };
    let (a, b) = pair(&da, &db, Epoch(1), every).expect("pair");
    let mut sent = 0u8;
    while !reserve_waits(&a).await {
        send(&a, &[sent; 64]).await;
        sent += 1;
    }
    assert!(sent > 0);
    until(|| a.stats().sends_acked == u64::from(sent)).await;
    let mut held = Vec::new();
    for i in 0..sent {
        let batch = b.recv().await.expect("batch");
        assert_eq!(batch[0], i);
        held.push(batch);
    }
    let next = tokio::spawn({
        let a = a.clone();
        async move { send(&a, &[sent; 64]).await }
    });
    // Past the limit, every credit still held at b.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    assert!(!next.is_finished(), "a had credit to send");
    assert!(!a.check_stall() && !a.check_stall(), "a verdict");
    assert_eq!(a.end_reason(), None);
    drop(held);
    tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("credit came back")
        .expect("the send");
    assert_eq!(b.recv().await.expect("the next")[0], sent);
    assert_eq!((a.end_reason(), b.end_reason()), (None, None));
}

/// A hand-driven verbs QP connected to a link end, playing a hostile peer:
/// before it posts `sends` (payload length, immediate), `first` runs on the
/// link. Returns the epoch's end and the batches the link delivered.
async fn hostile_peer_after(
    first: impl AsyncFnOnce(&Soft),
    payload_len: usize,
    sends: &[Option<u32>],
) -> (EpochEnd, usize) {
    let dev = device().await;
    let end = PreparedEnd::new(&dev, config(8)).expect("link end");
    let pd = dev.alloc_pd().expect("pd");
    let cq = dev.create_cq(64).expect("cq");
    let qp = dev.create_qp(&pd, &cq, &cq, QpCaps::default()).expect("qp");
    let mr = dev
        .reg_mr(&pd, 1 << 16, AccessFlags::LOCAL_WRITE)
        .expect("mr");
    qp.modify_to_init(InitAttr {
        access: AccessFlags::LOCAL_READ,
    })
    .expect("init");
    let theirs = QpAddress::of(&dev, &qp);
    let link = end.connect(&theirs, Epoch(7)).expect("connect");
    let port = dev.query_port();
    qp.modify_to_rtr(RtrAttr::for_peer(&link.address(), port.active_mtu, 12))
        .expect("rtr");
    qp.modify_to_rts(RtsAttr {
        sq_psn: qp.initial_psn(),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 0,
    })
    .expect("rts");
    let inbox = [Sge {
        mr: &mr,
        offset: 1 << 15,
        len: 1 << 14,
    }];
    let fence_inbox = [Sge {
        mr: &mr,
        offset: (1 << 15) + (1 << 14),
        len: 1 << 14,
    }];
    qp.post_recv(&[
        RecvWr {
            wr_id: 100,
            sg_list: &inbox,
        },
        // A graceful close's fence (an empty SEND) takes one more.
        RecvWr {
            wr_id: 101,
            sg_list: &fence_inbox,
        },
    ])
    .expect("receives for the link's batch and its fence");
    first(&link).await;
    mr.write(0, &vec![0xa5; payload_len]).expect("write");
    let sge = [Sge {
        mr: &mr,
        offset: 0,
        len: payload_len,
    }];
    let wrs: Vec<SendWr<'_, _>> = sends
        .iter()
        .enumerate()
        .map(|(i, &imm)| SendWr {
            wr_id: i as u64 + 1,
            opcode: imm.map_or(SendOpcode::Send, SendOpcode::SendWithImm),
            sg_list: &sge,
            signaled: true,
            inline: false,
        })
        .collect();
    qp.post_send(&wrs).expect("post");
    let end = link.ended().await;
    let mut delivered = 0;
    while tokio::time::timeout(Duration::from_secs(10), link.recv())
        .await
        .expect("recv ends within 10 s")
        .is_ok()
    {
        delivered += 1;
    }
    drop((qp, cq, mr));
    (end, delivered)
}

/// The bad message, then one that would look fine on its own: nothing is
/// delivered.
async fn hostile_peer(payload_len: usize, imm: u32) -> EpochEnd {
    let (end, delivered) =
        hostile_peer_after(async |_| {}, payload_len, &[Some(imm), Some(0)]).await;
    assert_eq!(delivered, 0, "nothing from a hostile peer");
    end
}

/// A peer that breaks the credit rule while we close gracefully (the QP
/// stays up for our last SEND): the end stays ours, but nothing after the
/// offence is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_overclaims_while_we_close_gets_nothing_more_delivered() {
    let close = async |link: &Soft| {
        send(link, b"unsignaled: the close waits for it").await;
        // Someone to tell: the close then waits for the peer's word (which
        // this raw peer never gives), not only for the fence behind our SEND.
        link.on_last_sent(|| {});
        link.fail(EpochEnd::Closed);
    };
    // Credit 0 claimed (fine), then 5 of the 1 it was granted, then 0.
    let (end, delivered) = hostile_peer_after(close, 16, &[Some(0), Some(5), Some(0)]).await;
    assert_eq!(end, EpochEnd::Closed);
    assert_eq!(delivered, 1, "only the batch before the offence");
}

/// The same for an offence found outside the completions (the node's
/// liveness channel reports one through `fail`): during a graceful close
/// it still stops delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offence_reported_while_we_close_stops_delivery() {
    let close = async |link: &Soft| {
        send(link, b"unsignaled: the close waits for it").await;
        link.fail(EpochEnd::Closed);
        link.fail(EpochEnd::Violation(ProtocolError::LivenessTraffic));
    };
    let (end, delivered) = hostile_peer_after(close, 16, &[Some(0), Some(0)]).await;
    assert_eq!(end, EpochEnd::Closed);
    assert_eq!(delivered, 0, "nothing after the offence");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_claiming_credit_it_never_had_ends_the_epoch() {
    assert_eq!(
        hostile_peer(16, 5).await,
        EpochEnd::Violation(ProtocolError::LinkCreditOverclaim {
            claimed: 5,
            granted: 0
        })
    );
}

/// Every message of the link carries its credit count in the immediate: a
/// SEND without one is a violation, not a batch taken on trust.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_without_an_immediate_ends_the_epoch() {
    let (end, delivered) = hostile_peer_after(async |_| {}, 16, &[None, Some(0)]).await;
    assert_eq!(
        end,
        EpochEnd::Violation(ProtocolError::SendWithoutImmediate)
    );
    assert_eq!(delivered, 0, "nothing from a hostile peer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_the_receive_buffer_ends_the_epoch() {
    assert_eq!(
        hostile_peer(8192, 0).await,
        EpochEnd::Violation(ProtocolError::SendTooLarge { max: 4096 })
    );
}

// The mux over the RDMA link (many slots, a stalled receiver, a QP death)
// is the provider-generic suite in tests/link_suite/, run here by
// tests/link_soft.rs and on kernel rxe by tests/link_ibv.rs.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_returns_while_every_send_buffer_is_held() {
    // One send buffer, held unposted: A's credit-only messages need none.
    let (da, db) = (device().await, device().await);
    let one = RdmaConfig {
        send_buffers: 1,
        ..config(4)
    };
    let (a, b) = pair(&da, &db, Epoch(1), one).expect("pair");
    let held = a.reserve().await.expect("A's only buffer");
    assert_eq!(a.send_pool().stats().free, 0, "the pool is empty");
    assert!(reserve_waits(&a).await);
    for n in 0..20u8 {
        send(&b, &[n; 64]).await;
        let batch = a.recv().await.expect("batch");
        assert_eq!(&batch[..], &[n; 64][..]);
    }
    assert!(
        a.stats().credit_only_sent >= 5,
        "20 batches on 4 credits came back as credit-only messages: {:?}",
        a.stats()
    );
    drop(held);
    send(&a, b"after").await;
    assert_eq!(&b.recv().await.expect("batch")[..], b"after");
    assert_eq!((a.end_reason(), b.end_reason()), (None, None));
    assert_eq!(db.counters().rnr_naks_received, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_link_returns_every_chunk_even_those_no_completion_reports() {
    let (_da, _db, a, b) = linked(8).await;
    let pool = a.send_pool().clone();
    assert_eq!(pool.stats().chunks, 8, "a private pool of send_buffers");
    for n in 0..3u8 {
        send(&a, &[n; 100]).await;
    }
    for n in 0..3u8 {
        assert_eq!(b.recv().await.expect("batch")[0], n);
    }
    // Delivered, but posted unsignaled (3 of 8, nobody waiting): no
    // completion reports them, so the chunks stay with the link for now.
    assert_eq!((pool.stats().in_use, pool.stats().free), (3, 5));
    a.inject_qp_error().expect("QP to ERR");
    until(|| a.end_reason().is_some()).await;
    // The QP's flush cannot report them either; the reset after it does.
    tokio::time::timeout(Duration::from_secs(20), until(|| pool.stats().in_use == 0))
        .await
        .expect("every chunk comes back");
    assert_eq!(pool.stats().free, 8, "each chunk back exactly once");
}

/// The Goodbye is posted with `post_last`: signaled, so its completion
/// reports it and every unsignaled batch before it, and a graceful close
/// ends once it landed, with nothing left posted; the peer gets every batch
/// and then the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_close_after_post_last_waits_for_the_last_batch_to_land() {
    let (_da, _db, a, b) = linked(8).await;
    let pool = a.send_pool().clone();
    for n in 0..3u8 {
        send(&a, &[n; 100]).await;
    }
    let mut buf = a.reserve().await.expect("reserve");
    buf[..7].copy_from_slice(b"goodbye");
    a.post_last(buf, 7).expect("post_last");
    assert_eq!(a.stats().signaled_sends, 1, "only the last one asked");
    // Its completion frees its chunk and the three before it.
    until(|| pool.stats().in_use == 0).await;
    a.fail(EpochEnd::Closed);
    for n in 0..3u8 {
        assert_eq!(b.recv().await.expect("batch")[0], n);
    }
    assert_eq!(&b.recv().await.expect("the last")[..], b"goodbye");
    assert_eq!(a.ended().await, EpochEnd::Closed);
    assert_eq!(b.ended().await, EpochEnd::PeerClosed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completion_handler_hands_batches_to_the_hook_in_order() {
    let (_da, _db, a, b) = linked(8).await;
    arrivals::the_reader_hands_batches_to_its_hook_in_order(a, b).await;
}

/// Takes each batch as the mux's reader does: wakes the batch's consumer,
/// then drops the batch.
struct WakeThenDrop {
    link: Soft,
    handled: AtomicU64,
    consumer: tokio::sync::Notify,
}

impl Arrivals for WakeThenDrop {
    fn arrived(&self) {
        while let Some(batch) = self.link.try_recv(self.handled.load(Ordering::SeqCst)) {
            self.handled.fetch_add(1, Ordering::SeqCst);
            self.consumer.notify_one();
            drop(batch);
        }
    }
}

/// A batch the reader took is re-posted after the consumer it woke has
/// run, not as the reader drops it; and every such receive comes back:
/// three times the receive depth of batches go through.
#[tokio::test]
async fn a_batch_the_reader_took_is_re_posted_after_the_consumer_it_woke() {
    let (_da, _db, a, b) = linked(8).await;
    let hook = Arc::new(WakeThenDrop {
        link: b.clone(),
        handled: AtomicU64::new(0),
        consumer: tokio::sync::Notify::new(),
    });
    b.set_arrivals(Arc::downgrade(&hook) as _);
    let (pending_tx, mut pending_seen) = tokio::sync::mpsc::unbounded_channel();
    let consumer = tokio::spawn({
        let (hook, b) = (hook.clone(), b.clone());
        async move {
            loop {
                hook.consumer.notified().await;
                if pending_tx.send(b.credit().pending).is_err() {
                    break;
                }
            }
        }
    });
    for n in 0..24u8 {
        tokio::time::timeout(Duration::from_secs(10), send(&a, &[n]))
            .await
            .expect("credit for the next batch");
        let pending = tokio::time::timeout(Duration::from_secs(10), pending_seen.recv())
            .await
            .expect("the consumer's wake")
            .expect("consumer");
        assert_eq!(
            pending, 1,
            "batch {n} was re-posted before its consumer ran"
        );
    }
    assert_eq!(hook.handled.load(Ordering::SeqCst), 24);
    let settles = until(|| b.credit().pending == 0 && settled(&a, &b) && settled(&b, &a));
    tokio::time::timeout(Duration::from_secs(10), settles)
        .await
        .expect("every receive re-posted");
    consumer.abort();
}

/// A batch `recv` hands out, dropped while one the reader took still waits
/// for its re-post, re-posts both at once; the reader's later re-post then
/// finds nothing left to do.
#[tokio::test]
async fn an_ordinary_drop_re_posts_what_the_reader_released() {
    let (_da, _db, a, b) = linked(8).await;
    send(&a, b"x").await;
    send(&a, b"y").await;
    let both_ready = until(|| b.credit().pending == 2);
    tokio::time::timeout(Duration::from_secs(10), both_ready)
        .await
        .expect("both batches received");
    let taken = b.try_recv(0).expect("the reader's batch");
    let received = b.recv().await.expect("recv's batch");
    assert_eq!((&taken[..], &received[..]), (&b"x"[..], &b"y"[..]));
    drop(taken);
    assert_eq!(
        b.credit().pending,
        2,
        "the reader's batch waits for its re-post"
    );
    drop(received);
    assert_eq!(b.credit().pending, 0, "both re-posted by the ordinary drop");
    tokio::task::yield_now().await;
    assert_eq!(b.credit().pending, 0);
    let settles = until(|| settled(&a, &b) && settled(&b, &a));
    tokio::time::timeout(Duration::from_secs(10), settles)
        .await
        .expect("credit settles");
}
