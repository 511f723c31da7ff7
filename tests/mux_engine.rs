//! The mux engine end to end over the in-process mem link.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::mem::{MemConfig, MemFabric, MemLink, pair};
use qpmux::link::{EpochEnd, Link, LinkFault};
use qpmux::mux::protocol::{BatchEncoder, BatchView, FrameSeq, Lane, RecordBody, SlotId};
use qpmux::mux::{
    CloseReason, DropReason, Epoch, FlushPolicy, Frame, Mux, MuxConfig, MuxTransport, PeerId,
    RECORD_OVERHEAD, SendError, StreamKey, Terminal,
};
use rand::Rng;

#[path = "common/arrivals.rs"]
mod arrivals;
#[path = "common/slots.rs"]
mod slots;
use slots::{
    Pause, Traffic, in_order_to_finalized, prefix_then_one_dropped, record, seq_of, stream_tasks,
};

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const C: PeerId = PeerId(3);

fn fabric(
    nodes: &[PeerId],
    config: MuxConfig,
    link: MemConfig,
) -> (Arc<MemFabric>, Vec<Mux<MemLink>>) {
    let fabric = MemFabric::new(link);
    let muxes = nodes
        .iter()
        .map(|&id| {
            let mux = Mux::new(config.clone(), fabric.dialer(id));
            fabric.add(id, mux.clone());
            mux
        })
        .collect();
    (fabric, muxes)
}

/// Waits (on state, polling) until `cond` holds.
async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_slots_to_several_peers_arrive_in_order_exactly_once() {
    let (_fabric, muxes) = fabric(&[A, B, C], MuxConfig::default(), MemConfig::default());
    let (a, b, c) = (&muxes[0], &muxes[1], &muxes[2]);
    let records = 12u32;
    let mut consumers = Vec::new();
    let mut producers = Vec::new();
    // 1,000 slots to B and 300 to C, all from A.
    let traffic = Traffic {
        records,
        len: |_, _, rng| rng.random_range(12..2000),
        pause: |rng| {
            if rng.random_bool(0.3) {
                Pause::Yield
            } else {
                Pause::No
            }
        },
    };
    for (peer, mux, slots) in [(B, b, 1_000u64), (C, c, 300)] {
        for s in 0..slots {
            let key = StreamKey::new(peer.0, s);
            let (consumer, producer) = stream_tasks(a, mux, peer, key, (s, s), traffic);
            consumers.push(consumer);
            producers.push(producer);
        }
    }
    for p in producers {
        p.await.expect("producer");
    }
    for c in consumers {
        assert_eq!(c.await.expect("consumer").0, records);
    }
    let stats = a.stats();
    assert_eq!(stats.slots_dropped, 0);
    assert!(
        stats.records_per_batch() > 1.0,
        "records were batched: {stats:?}"
    );
}

fn terminals_on_full_inlets(rt: tokio::runtime::Runtime) {
    rt.block_on(async {
        let config = MuxConfig {
            slot_window: 1,
            slot_budget: 64,
            ..MuxConfig::default()
        };
        let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
        let mut receivers = Vec::new();
        for s in 0..8 {
            let key = StreamKey::new(7, s);
            receivers.push(muxes[1].bind(key).expect("bind"));
            let mut tx = muxes[0].open(B, key).expect("open");
            // Fill the inlet until send would wait.
            let mut sent = 0u32;
            loop {
                let send = tx.send(record(s, sent, 32));
                tokio::pin!(send);
                let done = tokio::select! {
                    biased;
                    r = &mut send => { r.expect("send"); true }
                    _ = std::future::ready(()) => false,
                };
                if !done {
                    break;
                }
                sent += 1;
            }
            assert!(sent >= 1);
            // The terminal never waits, whatever the inlet holds.
            tx.finish(Terminal::Finalized)
                .expect("terminal is accepted at once");
        }
        for mut rx in receivers {
            let mut last = None;
            while let Some(frame) = rx.recv().await {
                last = Some(frame);
            }
            assert_eq!(last, Some(Frame::Finalized));
        }
    });
}

#[test]
fn terminal_sends_never_block_on_a_current_thread_runtime() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    terminals_on_full_inlets(rt);
}

#[test]
fn terminal_sends_never_block_on_a_one_worker_runtime() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("rt");
    terminals_on_full_inlets(rt);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_larger_than_the_slot_budget_waits_and_is_never_killed() {
    let config = MuxConfig {
        slot_budget: 16 * 1024,
        slot_window: 32 * 1024,
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let key = StreamKey::new(1, 1);
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    let producer = tokio::spawn(async move {
        for n in 0..10_000u32 {
            tx.send(record(1, n, 1024)).await.expect("never killed");
        }
        tx.finish(Terminal::Finalized).expect("finish");
    });
    let mut next = 0;
    while let Some(frame) = rx.recv().await {
        match frame {
            Frame::Data(d) => {
                assert_eq!(seq_of(&d), next);
                next += 1;
                if next % 1000 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            Frame::Finalized => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    producer.await.expect("producer");
    assert_eq!(next, 10_000);
    let stats = muxes[0].stats();
    assert!(
        stats.credit_stalls > 0,
        "the window was the limit: {stats:?}"
    );
    assert_eq!(stats.slots_dropped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_does_not_stall_a_fast_one_on_the_same_peer() {
    let config = MuxConfig {
        slot_window: 16 * 1024,
        slot_budget: 16 * 1024,
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let slow_key = StreamKey::new(1, 1);
    let fast_key = StreamKey::new(1, 2);
    let _slow_rx = muxes[1].bind(slow_key).expect("bind"); // never read
    let mut fast_rx = muxes[1].bind(fast_key).expect("bind");
    let mut slow_tx = muxes[0].open(B, slow_key).expect("open");
    let mut fast_tx = muxes[0].open(B, fast_key).expect("open");
    let slow = tokio::spawn(async move {
        let mut n = 0;
        loop {
            slow_tx.send(record(1, n, 1024)).await.expect("slow send");
            n += 1;
        }
    });
    let fast = tokio::spawn(async move {
        for n in 0..5_000u32 {
            fast_tx.send(record(2, n, 1024)).await.expect("fast send");
        }
        fast_tx.finish(Terminal::Finalized).expect("finish");
    });
    let mut got = 0;
    while let Some(frame) = fast_rx.recv().await {
        match frame {
            Frame::Data(_) => got += 1,
            Frame::Finalized => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, 5_000);
    fast.await.expect("fast producer");
    assert!(!slow.is_finished(), "the slow stream is parked, not dead");
    slow.abort();
}

/// Slow streams whose producers run ahead fill the peer budget with their
/// backlogs; a stream that keeps up (nothing queued when it sends) still
/// queues its records, so the backlog of others never holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backlogs_that_fill_the_peer_budget_do_not_hold_a_stream_that_keeps_up() {
    let config = MuxConfig {
        slot_window: 16 * 1024,
        slot_budget: 64 * 1024,
        peer_budget: 128 * 1024,
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let mut slow = Vec::new();
    let mut parked = Vec::new();
    for s in 0..4 {
        let key = StreamKey::new(2, s);
        parked.push(muxes[1].bind(key).expect("bind")); // never read
        let mut tx = muxes[0].open(B, key).expect("open");
        slow.push(tokio::spawn(async move {
            let mut n = 0;
            loop {
                tx.send(record(3, n, 1024)).await.expect("slow send");
                n += 1;
            }
        }));
    }
    // The backlogs fill the peer budget (4 × 64 KiB > 128 KiB): no room for
    // another record. Past it only by the one record a slot with nothing
    // queued may add, so waiting for the whole 128 KiB hung whenever no
    // slot got to (120 records of 1,088 bytes is 130,560). `withheld_bytes`
    // is node-wide: this holds while A has one peer.
    let cost = 1024 + RECORD_OVERHEAD as u64;
    until(|| muxes[0].stats().withheld_bytes + cost > 128 * 1024).await;
    let fast_key = StreamKey::new(2, 100);
    let mut fast_rx = muxes[1].bind(fast_key).expect("bind");
    let mut fast_tx = muxes[0].open(B, fast_key).expect("open");
    let got = tokio::time::timeout(Duration::from_secs(20), async {
        let mut got = 0;
        for n in 0..500u32 {
            fast_tx.send(record(4, n, 1024)).await.expect("fast send");
            assert!(matches!(fast_rx.recv().await, Some(Frame::Data(_))));
            got += 1;
        }
        got
    })
    .await
    .expect("the fast stream is not held by the backlogs");
    assert_eq!(got, 500);
    for task in &slow {
        assert!(!task.is_finished(), "the slow streams are parked, not dead");
        task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_failure_delivers_then_drops_every_live_slot_exactly_once() {
    let (fabric, muxes) = fabric(&[A, B], MuxConfig::default(), MemConfig::default());
    let n_slots = 32u64;
    let mut receivers = Vec::new();
    let mut senders = Vec::new();
    for s in 0..n_slots {
        let key = StreamKey::new(9, s);
        receivers.push(muxes[1].bind(key).expect("bind"));
        senders.push(muxes[0].open(B, key).expect("open"));
    }
    for (s, tx) in senders.iter_mut().enumerate() {
        for n in 0..10 {
            tx.send(record(s as u64, n, 100)).await.expect("send");
        }
    }
    // Wait until every slot's first records have been delivered.
    for rx in &mut receivers {
        match rx.recv().await {
            Some(Frame::Data(d)) => assert_eq!(seq_of(&d), 0),
            other => panic!("unexpected {other:?}"),
        }
    }
    let epoch = muxes[0].epoch(B).expect("link is up");
    assert!(fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected)));

    for rx in &mut receivers {
        prefix_then_one_dropped(rx, epoch).await;
    }
    // Each end learns of the death on its own task; wait for both.
    until(|| {
        muxes[0].stats().slots_dropped == n_slots && muxes[1].stats().slots_dropped == n_slots
    })
    .await;
    for tx in &mut senders {
        assert_eq!(
            tx.send(Bytes::from_static(b"late")).await,
            Err(SendError::Dropped(DropReason::EpochEnded { epoch }))
        );
    }
    // Counted after the slots are failed, on the peer task's thread.
    until(|| muxes[0].stats().epoch_deaths >= 1).await;
    assert_eq!(muxes[0].stats().epoch_deaths, 1);

    // The next epoch opens new slots normally.
    drop(senders);
    let key = StreamKey::new(10, 0);
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    tx.send(Bytes::from_static(b"again")).await.expect("send");
    tx.finish(Terminal::Finalized).expect("finish");
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"again")))
    );
    assert_eq!(rx.recv().await, Some(Frame::Finalized));
    assert_eq!(muxes[0].epoch(B), Some(epoch.next()));
    assert_eq!(
        muxes[0].stats().slots_dropped,
        n_slots,
        "nothing dropped twice"
    );
}

/// A producer with nothing to send learns its epoch died from `closed`,
/// and a fresh slot then brings the next epoch up: without it, an idle
/// producer (an acknowledgement stream, say) would wait for a link nobody asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_sender_learns_of_its_epochs_death_from_closed() {
    let (fabric, muxes) = fabric(&[A, B], MuxConfig::default(), MemConfig::default());
    let key = StreamKey::new(11, 0);
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    tx.send(Bytes::from_static(b"one")).await.expect("send");
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"one")))
    );
    let still_open = tokio::time::timeout(Duration::from_millis(50), tx.closed()).await;
    assert!(still_open.is_err(), "closed() resolved on a live slot");

    let epoch = muxes[0].epoch(B).expect("link is up");
    assert!(fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected)));
    let reason = tokio::time::timeout(Duration::from_secs(10), tx.closed())
        .await
        .expect("closed() after the epoch died");
    assert_eq!(reason, SendError::Dropped(DropReason::EpochEnded { epoch }));
    assert_eq!(tx.send(Bytes::from_static(b"late")).await, Err(reason));
    assert_eq!(
        rx.recv().await,
        Some(Frame::Dropped(DropReason::EpochEnded { epoch }))
    );

    drop(tx);
    let mut rx = muxes[1].bind(key).expect("rebind");
    let mut tx = muxes[0].open(B, key).expect("reopen");
    tx.send(Bytes::from_static(b"two")).await.expect("send");
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"two")))
    );
    assert_eq!(muxes[0].epoch(B), Some(epoch.next()));
}

/// A under a manual flush whose control waits an hour (so only `flush`
/// writes), B with the defaults, on one mem fabric.
fn held_and_default() -> (Arc<MemFabric>, Mux<MemLink>, Mux<MemLink>) {
    let held = MuxConfig {
        flush: FlushPolicy::Manual {
            reply_linger: Duration::from_secs(3600),
        },
        ..MuxConfig::default()
    };
    let fabric = MemFabric::new(MemConfig::default());
    let a = Mux::new(held, fabric.dialer(A));
    fabric.add(A, a.clone());
    let b = Mux::new(MuxConfig::default(), fabric.dialer(B));
    fabric.add(B, b.clone());
    (fabric, a, b)
}

/// Under `FlushPolicy::Manual` records wait for `flush(peer)`: nothing is
/// written before it, and what was queued leaves as one batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_flush_holds_records_until_flushed_then_sends_one_batch() {
    let (_fabric, a, b) = held_and_default();
    let mut ends = Vec::new();
    for s in 0..8u64 {
        let key = StreamKey::new(31, s);
        ends.push((a.open(B, key).expect("open"), b.bind(key).expect("bind")));
    }
    tokio::time::timeout(Duration::from_secs(20), async {
        // The first record opens each slot; it too waits for a flush.
        for (s, (tx, _)) in ends.iter_mut().enumerate() {
            tx.send(record(s as u64, 0, 64)).await.expect("send");
        }
        a.flush(B).expect("flush");
        for (_, rx) in &mut ends {
            assert!(matches!(rx.recv().await, Some(Frame::Data(_))));
        }
        let before = a.stats();
        for (s, (tx, _)) in ends.iter_mut().enumerate() {
            tx.send(record(s as u64, 1, 64)).await.expect("send");
        }
        for _ in 0..50 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert_eq!(
                a.stats().batches_sent,
                before.batches_sent,
                "written before a flush"
            );
        }
        a.flush(B).expect("flush");
        for (_, rx) in &mut ends {
            assert!(matches!(rx.recv().await, Some(Frame::Data(_))));
        }
        let after = a.stats();
        assert_eq!(after.batches_sent - before.batches_sent, 1);
        assert_eq!(after.records_sent - before.records_sent, 8);
    })
    .await
    .expect("flushed records arrive");
}

/// docs/design.md § "A slot whose Open never left": a manual flush holds the
/// Open back, so both epochs die with the slot in their table, unannounced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_whose_open_never_left_two_dying_epochs_reaches_its_receiver_on_the_third() {
    let (fabric, a, b) = held_and_default();
    let key = StreamKey::new(21, 1);
    let mut rx = b.bind(key).expect("bind");
    let mut tx = a.open(B, key).expect("open");
    for n in 0..3 {
        tx.send(record(1, n, 100)).await.expect("send");
    }
    tx.finish(Terminal::Finalized).expect("finish");
    let delivered = tokio::time::timeout(Duration::from_secs(20), async {
        for round in 1..=2u64 {
            until(|| a.epoch(B) == Some(Epoch(round))).await;
            assert!(fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected)));
            until(|| a.stats().epoch_deaths == round).await;
        }
        until(|| a.epoch(B) == Some(Epoch(3))).await;
        a.flush(B).expect("flush");
        in_order_to_finalized(&mut rx).await.0
    })
    .await
    .expect("the slot wanted a third epoch and rode it");
    assert_eq!(delivered, 3);
    let stats = a.stats();
    assert_eq!(
        stats.slots_carried, 2,
        "adopted and carried by both dying epochs"
    );
    assert_eq!(stats.slots_dropped, 0, "its Open never left: never Dropped");
    assert_eq!(b.stats().slots_dropped, 0);
}

/// The race itself: a slot opened just after its link died lands in the
/// dying epoch's table, in its wait for a link, or in the next epoch; it
/// must reach its receiver every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_opened_while_its_epoch_dies_is_never_lost() {
    let (fabric, muxes) = fabric(&[A, B], MuxConfig::default(), MemConfig::default());
    let (a, b) = (&muxes[0], &muxes[1]);
    for round in 0..100u64 {
        let key = StreamKey::new(22, round);
        let mut rx = b.bind(key).expect("bind");
        if round > 0 {
            assert!(fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected)));
        }
        let mut tx = a.open(B, key).expect("open");
        tx.send(record(round, 0, 64)).await.expect("send");
        tx.finish(Terminal::Finalized).expect("finish");
        let got = tokio::time::timeout(Duration::from_secs(20), in_order_to_finalized(&mut rx))
            .await
            .unwrap_or_else(|_| panic!("round {round}: the stream never arrived"));
        assert_eq!(got.0, 1);
    }
    assert_eq!(a.stats().slots_dropped, 0, "no slot had an Open out");
}

/// Word that the peer is unreachable, given while an epoch with it is
/// live, is stale: a slot that epoch's death carries (its Open never left)
/// goes on to the next epoch and never ends `Unreachable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn word_of_an_unreachable_peer_during_a_live_epoch_ends_no_slot() {
    let (fabric, muxes) = fabric(&[A, B], MuxConfig::default(), MemConfig::default());
    let (a, b) = (&muxes[0], &muxes[1]);
    let mut delivered = 0;
    let mut killed = None;
    for round in 0..100u64 {
        let key = StreamKey::new(23, round);
        let mut rx = b.bind(key).expect("bind");
        // A slot of its own brings the next epoch up.
        let _pilot_rx = b.bind(StreamKey::new(24, round)).expect("bind");
        let mut pilot = a.open(B, StreamKey::new(24, round)).expect("open");
        pilot.send(record(round, 0, 64)).await.expect("send");
        // A new epoch, not the last round's while it is still being ended.
        let live = || a.epoch(B).filter(|&e| Some(e) != killed);
        tokio::time::timeout(Duration::from_secs(20), until(|| live().is_some()))
            .await
            .unwrap_or_else(|_| panic!("round {round}: no epoch"));
        killed = live();
        let mut tx = a.open(B, key).expect("open");
        tx.send(record(round, 0, 64)).await.expect("send");
        a.peer_unreachable(B);
        assert!(fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected)));
        let outcome = tokio::time::timeout(Duration::from_secs(20), async {
            tokio::select! {
                frame = rx.recv() => Ok(frame),
                ended = tx.closed() => Err(ended),
            }
        });
        match outcome.await.expect("an outcome") {
            Ok(Some(Frame::Data(_))) => delivered += 1,
            Ok(Some(Frame::Dropped(DropReason::EpochEnded { .. })))
            | Err(SendError::Dropped(DropReason::EpochEnded { .. })) => {}
            other => panic!("round {round}: {other:?}"),
        }
    }
    let carried = a.stats().slots_carried;
    println!("{delivered} of 100 delivered, {carried} carried to the next epoch");
    // Else no round reached the case the check is for (49-81 do).
    assert!(carried > 0, "no slot's Open was still owed at a kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_4_mib_record_crosses_64_kib_batches_intact() {
    let link = MemConfig {
        credits: 8,
        max_batch: 64 * 1024,
        send_buffers: 8,
    };
    let (_fabric, muxes) = fabric(&[A, B], MuxConfig::default(), link);
    let key = StreamKey::new(4, 4);
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    let big: Vec<u8> = (0..4 * 1024 * 1024u32)
        .map(|i| (i * 7 % 256) as u8)
        .collect();
    let big = Bytes::from(big);
    let sent = big.clone();
    // The producer waits for credit while the consumer has not drained.
    tokio::spawn(async move {
        for _ in 0..3 {
            tx.send(sent.clone()).await.expect("send");
        }
        tx.send(Bytes::from_static(b"small")).await.expect("send");
        tx.finish(Terminal::Finalized).expect("finish");
    });
    for _ in 0..3 {
        assert_eq!(rx.recv().await, Some(Frame::Data(big.clone())));
    }
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"small")))
    );
    assert_eq!(rx.recv().await, Some(Frame::Finalized));
    assert!(muxes[0].stats().batches_sent >= 3 * 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fragment_sequence_cut_by_epoch_death_yields_dropped_never_a_partial_record() {
    for round in 0..4u64 {
        let link = MemConfig {
            credits: 2,
            max_batch: 16 * 1024,
            send_buffers: 2,
        };
        let (fabric, muxes) = fabric(&[A, B], MuxConfig::default(), link);
        let key = StreamKey::new(5, round);
        let mut rx = muxes[1].bind(key).expect("bind");
        let mut tx = muxes[0].open(B, key).expect("open");
        let big = Bytes::from(vec![0x5a; 1024 * 1024]);
        tx.send(big.clone()).await.expect("send");
        until(|| muxes[1].stats().batches_received > round).await;
        fabric.kill(B, A, EpochEnd::Fault(LinkFault::Injected));
        let mut frames = Vec::new();
        while let Some(f) = rx.recv().await {
            frames.push(f);
        }
        let last = frames.pop().expect("a terminal");
        assert!(
            matches!(last, Frame::Dropped(DropReason::EpochEnded { .. })),
            "{last:?}"
        );
        for f in frames {
            assert_eq!(f, Frame::Data(big.clone()), "only whole records");
        }
    }
}

/// A raw peer: one end of a mem pair attached to a mux, the other driven by hand.
async fn raw_peer(config: MuxConfig) -> (Mux<MemLink>, MemLink) {
    raw_peer_with(config, MemConfig::default()).await
}

async fn raw_peer_with(config: MuxConfig, link: MemConfig) -> (Mux<MemLink>, MemLink) {
    let fabric = MemFabric::new(MemConfig::default());
    let mux = Mux::new(config, fabric.dialer(A));
    let (ours, theirs) = pair(Epoch(1), link);
    mux.attach(B, ours);
    (mux, theirs)
}

/// A shutdown that finds every link credit taken waits, within the linger,
/// for the peer to take a batch and so return one, then says goodbye: the
/// peer learns the epoch ended on purpose. (It used to end the epoch at
/// once without a goodbye.)
#[tokio::test]
async fn a_shutdown_goodbye_waits_within_the_linger_for_a_link_credit() {
    goodbye_after_credit_returns(MuxConfig::default(), |mux| mux.shutdown()).await;
}

/// The same for a peer retired for idleness.
#[tokio::test]
async fn an_idle_retirement_goodbye_waits_for_a_link_credit() {
    let config = MuxConfig {
        idle_retire: Duration::from_millis(5),
        ..MuxConfig::default()
    };
    goodbye_after_credit_returns(config, |_| {}).await;
}

/// One record and the stream's end in two batches that the raw peer holds
/// unread (both link credits with it), then `end_epoch`: the epoch waits for
/// a credit, and the batch it then writes carries the Goodbye.
async fn goodbye_after_credit_returns(config: MuxConfig, end_epoch: impl FnOnce(&Mux<MemLink>)) {
    let link = MemConfig {
        credits: 2,
        ..MemConfig::default()
    };
    let (mux, raw) = raw_peer_with(config, link).await;
    let mut tx = mux.open(B, StreamKey::new(6, 6)).expect("open");
    tx.send(record(6, 0, 100)).await.expect("send");
    let mut held = vec![raw.recv().await.expect("the record's batch")];
    tx.finish(Terminal::Finalized).expect("finish");
    held.push(raw.recv().await.expect("the end's batch"));
    end_epoch(&mux);
    // On this one thread the peer task now runs: quiet (or idle), with no
    // credit for the goodbye, and sleeps until one comes.
    assert_mostly_asleep(Duration::from_millis(60), "waiting to say goodbye").await;
    assert!(
        !raw.is_ended(),
        "the epoch ended without waiting for credit"
    );
    drop(held);
    let batch = raw.recv().await.expect("the goodbye's batch");
    let view = BatchView::new_checked(&batch).expect("valid");
    assert!(
        view.records()
            .any(|r| matches!(r.body, RecordBody::Goodbye)),
        "no goodbye in the batch after the credit came back"
    );
}

/// Nanoseconds this thread has run (schedstat's first field; 0 where the
/// kernel keeps none).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Sleeps `wait` on this (current-thread) runtime and asserts its tasks
/// ran for under half of it: a task whose timer keeps firing runs for
/// nearly all of it.
async fn assert_mostly_asleep(wait: Duration, what: &str) {
    let before = thread_cpu_ns();
    tokio::time::sleep(wait).await;
    let ran = Duration::from_nanos(thread_cpu_ns() - before);
    assert!(
        ran < wait / 2,
        "{what}: the runtime ran {ran:?} of {wait:?}"
    );
}

/// A batch whose flush gate opened while every link credit was out waits
/// for a credit asleep (review 48d: the gate's past deadline kept the peer
/// task's timer firing, a busy loop for as long as the link pushed back),
/// and goes once one returns.
#[tokio::test]
async fn a_batch_past_its_linger_waits_for_link_credit_without_spinning() {
    let config = MuxConfig {
        flush: FlushPolicy::AutoLinger {
            max_linger: Duration::from_millis(1),
        },
        ..MuxConfig::default()
    };
    let link = MemConfig {
        credits: 2,
        ..MemConfig::default()
    };
    let (mux, raw) = raw_peer_with(config, link).await;
    let mut tx = mux.open(B, StreamKey::new(6, 6)).expect("open");
    let mut held = Vec::new();
    for n in 0..2 {
        tx.send(record(6, n, 100)).await.expect("send");
        held.push(raw.recv().await.expect("a batch"));
    }
    tx.send(record(6, 2, 100)).await.expect("queued");
    assert_mostly_asleep(Duration::from_millis(60), "waiting for link credit").await;
    drop(held);
    let batch = raw.recv().await.expect("the third record's batch");
    let view = BatchView::new_checked(&batch).expect("valid");
    assert!(
        view.records()
            .any(|r| matches!(r.body, RecordBody::Data(_))),
        "no record in the batch after the credit came back"
    );
}

async fn post_batch(link: &MemLink, seq: u32, build: impl FnOnce(&mut BatchEncoder<'_>)) {
    let mut buf = link.reserve().await.expect("credit");
    let mut enc = BatchEncoder::new(&mut buf, Epoch(1), seq, Lane(0)).expect("fits");
    build(&mut enc);
    let len = enc.finish();
    link.post(buf, len).expect("post");
}

#[tokio::test]
async fn unknown_slots_and_stale_generations_are_dropped_and_counted() {
    let (mux, raw) = raw_peer(MuxConfig::default()).await;
    let key = StreamKey::new(3, 3);
    let mut rx = mux.bind(key).expect("bind");
    let gen0 = SlotId::new(0, 0).expect("slot");
    let gen1 = SlotId::new(0, 1).expect("slot");
    let unknown = SlotId::new(77, 0).expect("slot");
    post_batch(&raw, 0, |enc| {
        enc.push_data(unknown, FrameSeq(0), b"nobody", false)
            .expect("fits");
        enc.push_open(gen0, FrameSeq(0), 3, 3).expect("fits");
        enc.push_data(gen0, FrameSeq(1), b"one", false)
            .expect("fits");
        enc.push_close(gen0, FrameSeq(2), qpmux::mux::CloseReason::Detached)
            .expect("fits");
    })
    .await;
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"one")))
    );
    assert_eq!(rx.recv().await, Some(Frame::Detached));
    assert_eq!(rx.recv().await, None);
    let mut rx2 = mux.bind(key).expect("rebind after the terminal");
    post_batch(&raw, 1, |enc| {
        enc.push_open(gen1, FrameSeq(0), 3, 3).expect("fits");
        enc.push_data(gen0, FrameSeq(1), b"stale", false)
            .expect("fits");
        enc.push_data(gen1, FrameSeq(1), b"fresh", false)
            .expect("fits");
    })
    .await;
    assert_eq!(
        rx2.recv().await,
        Some(Frame::Data(Bytes::from_static(b"fresh")))
    );
    until(|| mux.stats().drops.stale_generation == 1).await;
    assert_eq!(mux.stats().drops.unknown_slot, 1);
    // The owner of the unknown slot is told.
    let mut told = Vec::new();
    while told.len() < 2 {
        let batch = raw.recv().await.expect("reply batch");
        let view = BatchView::new_checked(&batch).expect("valid");
        for r in view.records() {
            if let RecordBody::Close(reason) = r.body {
                told.push((r.slot, reason));
            }
        }
    }
    assert!(told.contains(&(unknown, qpmux::mux::CloseReason::UnknownSlot)));
    assert!(told.contains(&(gen0, qpmux::mux::CloseReason::UnknownSlot)));
    assert_eq!(mux.stats().protocol_violations, 0);
}

#[tokio::test]
async fn a_frame_seq_jump_is_epoch_death_for_that_peer() {
    let (mux, raw) = raw_peer(MuxConfig::default()).await;
    let key = StreamKey::new(8, 8);
    let mut rx = mux.bind(key).expect("bind");
    let slot = SlotId::new(0, 0).expect("slot");
    post_batch(&raw, 0, |enc| {
        enc.push_open(slot, FrameSeq(0), 8, 8).expect("fits");
        enc.push_data(slot, FrameSeq(1), b"ok", false)
            .expect("fits");
        enc.push_data(slot, FrameSeq(5), b"jump", false)
            .expect("fits");
    })
    .await;
    // Records before the violation were valid and are delivered; then Dropped.
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"ok")))
    );
    assert_eq!(
        rx.recv().await,
        Some(Frame::Dropped(DropReason::EpochEnded { epoch: Epoch(1) }))
    );
    assert_eq!(rx.recv().await, None);
    assert_eq!(mux.stats().protocol_violations, 1);
    until(|| raw.is_ended()).await;
}

#[tokio::test]
async fn a_credit_overrun_is_epoch_death() {
    let config = MuxConfig {
        slot_window: 100,
        ..MuxConfig::default()
    };
    let (mux, raw) = raw_peer(config).await;
    let _rx = mux.bind(StreamKey::new(2, 2)).expect("bind");
    let slot = SlotId::new(0, 0).expect("slot");
    post_batch(&raw, 0, |enc| {
        enc.push_open(slot, FrameSeq(0), 2, 2).expect("fits");
        enc.push_data(slot, FrameSeq(1), &[0; 100], false)
            .expect("fits");
        enc.push_data(slot, FrameSeq(2), &[0; 1], false)
            .expect("fits");
    })
    .await;
    until(|| mux.stats().protocol_violations == 1).await;
    until(|| raw.is_ended()).await;
}

#[tokio::test(start_paused = true)]
async fn manual_flush_writes_the_records_sent_before_it() {
    let config = MuxConfig {
        flush: FlushPolicy::Manual {
            reply_linger: Duration::from_secs(3600),
        },
        ..MuxConfig::default()
    };
    let (mux, raw) = raw_peer(config).await;
    let mut tx = mux.open(B, StreamKey::new(6, 6)).expect("open");
    for n in 0..3 {
        tx.send(record(6, n, 20)).await.expect("send");
    }
    // Without a flush nothing goes out (the Open waits for the reply linger).
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    let nothing =
        tokio::select! { biased; b = raw.recv() => Some(b), _ = std::future::ready(()) => None };
    assert!(nothing.is_none(), "manual policy wrote before flush");
    mux.flush(B).expect("flush");
    let batch = raw.recv().await.expect("the flushed batch");
    let view = BatchView::new_checked(&batch).expect("valid");
    let data: Vec<u32> = view
        .records()
        .filter_map(|r| match r.body {
            RecordBody::Data(d) => Some(u32::from_be_bytes(d[8..12].try_into().expect("4"))),
            _ => None,
        })
        .collect();
    assert_eq!(data, [0, 1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_returns_on_drain_not_on_a_timer() {
    // A sweep of an hour: any progress beyond one window proves grants are
    // sent when the consumer drains.
    let config = MuxConfig {
        slot_window: 8 * 1024,
        credit_sweep: Duration::from_secs(3600),
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let key = StreamKey::new(1, 9);
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    tokio::spawn(async move {
        for n in 0..2_000 {
            tx.send(record(9, n, 512)).await.expect("send");
        }
        tx.finish(Terminal::Finalized).expect("finish");
    });
    let mut n = 0;
    while let Some(Frame::Data(_)) = rx.recv().await {
        n += 1;
    }
    assert_eq!(n, 2_000);
    assert!(muxes[1].stats().credit_updates_sent > 10);
}

/// One record on a fresh stream from A (`muxes[0]`) to B, finished and read.
async fn short_stream(muxes: &[Mux<MemLink>], key: StreamKey) {
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    tx.send(Bytes::from_static(b"hi")).await.expect("send");
    tx.finish(Terminal::Finalized).expect("finish");
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"hi")))
    );
    assert_eq!(rx.recv().await, Some(Frame::Finalized));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_peer_retires_and_a_later_open_is_not_lost() {
    let config = MuxConfig {
        idle_retire: Duration::from_millis(20),
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    for round in 0..3u64 {
        short_stream(&muxes, StreamKey::new(11, round)).await;
        // Both ends go idle, close the link gracefully and retire their tasks.
        until(|| muxes[0].peer_count() == 0 && muxes[1].peer_count() == 0).await;
    }
    let stats = muxes[0].stats();
    assert_eq!(
        stats.slots_dropped, 0,
        "graceful retirement drops nothing: {stats:?}"
    );
    assert!(stats.epoch_deaths >= 3);
}

/// Idle retirement counts our own streams too: a node that only opens short
/// streams toward its peer (the peer opens none back) keeps one epoch for
/// as long as it does, well past `idle_retire`. On the paused clock: idle
/// time is virtual, so a test thread descheduled for `idle_retire` between
/// two streams cannot retire a peer that is not idle.
#[tokio::test(start_paused = true)]
async fn a_peer_sent_short_streams_back_to_back_does_not_retire() {
    let config = MuxConfig {
        idle_retire: Duration::from_millis(100),
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let started = tokio::time::Instant::now();
    let mut round = 0u64;
    while started.elapsed() < Duration::from_millis(600) {
        short_stream(&muxes, StreamKey::new(17, round)).await;
        round += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(muxes[0].epoch(B), Some(Epoch(1)), "after {round} streams");
    assert_eq!(muxes[0].stats().epoch_deaths, 0);
}

/// A peer task whose peer's closed streams still hold data does not retire
/// when idle (the count would go with it, and the next epoch would start on
/// a whole window); once a consumer reads them, it retires as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_unread_streams_hold_its_bytes_retires_only_once_they_are_read() {
    let config = MuxConfig {
        idle_retire: Duration::from_millis(20),
        ..MuxConfig::default()
    };
    let window = config.peer_window;
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let key = StreamKey::new(13, 0);
    let body = Bytes::from(vec![1u8; 1000]);
    let mut tx = muxes[0].open(B, key).expect("open");
    tx.send(body.clone()).await.expect("send");
    tx.finish(Terminal::Finalized).expect("finish");
    // The record's bytes and its overhead.
    let held = 1000 + RECORD_OVERHEAD as u64;
    until(|| muxes[1].stats().peer_held_bytes == held).await;
    until(|| muxes[0].peer_count() == 0 && muxes[1].epoch(A).is_none()).await;
    // Five idle periods with nobody reading.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(muxes[1].peer_count(), 1, "retired while holding A's bytes");
    assert_eq!(u64::from(muxes[1].peer_room(A)), u64::from(window) - held);
    assert_eq!(muxes[1].stats().peer_held_bytes, held);
    let mut rx = muxes[1].bind(key).expect("bind");
    assert_eq!(rx.recv().await, Some(Frame::Data(body)));
    assert_eq!(rx.recv().await, Some(Frame::Finalized));
    until(|| muxes[1].peer_count() == 0).await;
    assert_eq!(muxes[1].peer_room(A), window);
    assert_eq!(muxes[1].stats().peer_held_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_is_answered_ahead_of_a_congested_slot() {
    let config = MuxConfig {
        slot_window: 1024,
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let key = StreamKey::new(12, 0);
    let _stalled_rx = muxes[1].bind(key).expect("bind"); // never drained
    let mut tx = muxes[0].open(B, key).expect("open");
    tokio::spawn(async move {
        loop {
            if tx.send(Bytes::from(vec![0u8; 512])).await.is_err() {
                break;
            }
        }
    });
    until(|| muxes[0].stats().credit_stalls > 0).await;
    for _ in 0..3 {
        muxes[0].ping(B).await.expect("pong");
    }
    muxes[1].ping(A).await.expect("pong the other way");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_writes_what_was_queued_then_says_goodbye() {
    shutdown_drains().await;
}

/// On one thread nothing runs until the test yields: the shutdown lands
/// before the peer task has even asked for its link.
#[tokio::test]
async fn shutdown_before_the_link_is_up_still_writes_what_was_queued() {
    shutdown_drains().await;
}

/// Records still waiting for slot credit when the shutdown comes go out as
/// the receiver returns credit within the linger: a peer whose slot is
/// blocked on credit is not quiet (once, it said goodbye over soak's last
/// acknowledgements).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_within_the_linger_for_the_credit_a_blocked_slot_needs() {
    let config = MuxConfig {
        slot_window: 4096,
        ..MuxConfig::default()
    };
    shutdown_drains_with(config).await;
}

/// Under a manual flush, the drain writes what waited for a flush too: it
/// waited out the linger and dropped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_under_a_manual_flush_writes_what_was_never_flushed() {
    let config = MuxConfig {
        flush: FlushPolicy::Manual {
            reply_linger: Duration::from_millis(1),
        },
        ..MuxConfig::default()
    };
    shutdown_drains_with(config).await;
}

async fn shutdown_drains() {
    shutdown_drains_with(MuxConfig::default()).await;
}

/// A stream bound here whose sender never came hears `Dropped(Shutdown)`
/// when the mux shuts down, as every fed slot does; it used to wait in
/// `recv` for good (velo's ingress pump with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_stream_nobody_opened_is_dropped_at_shutdown() {
    let (_fabric, muxes) = fabric(&[A, B], MuxConfig::default(), MemConfig::default());
    let mut waiting = muxes[1].bind(StreamKey::new(14, 0)).expect("bind");
    let mut unread = muxes[1].bind(StreamKey::new(14, 1)).expect("bind");
    let receiver = tokio::spawn(async move { waiting.recv().await });
    tokio::task::yield_now().await;
    muxes[1].shutdown();
    let heard = tokio::time::timeout(Duration::from_secs(20), receiver)
        .await
        .expect("recv returns")
        .expect("task");
    assert_eq!(heard, Some(Frame::Dropped(DropReason::Shutdown)));
    assert_eq!(
        unread.recv().await,
        Some(Frame::Dropped(DropReason::Shutdown))
    );
    assert_eq!(unread.recv().await, None, "exactly one terminal");
}

/// 100 records of 300 bytes and a Finalized queued, then the shutdown: the
/// receiver gets all of them.
async fn shutdown_drains_with(config: MuxConfig) {
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let key = StreamKey::new(13, 0);
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    for n in 0..100 {
        tx.send(record(13, n, 300)).await.expect("send");
    }
    tx.finish(Terminal::Finalized).expect("finish");
    muxes[0].shutdown();
    let mut got = 0;
    while let Some(frame) = rx.recv().await {
        match frame {
            Frame::Data(_) => got += 1,
            Frame::Finalized => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, 100);
    muxes[0].closed().await;
    assert!(
        muxes[0].open(B, StreamKey::new(13, 1)).is_err(),
        "shut down"
    );
}

/// A wrapper link's methods that go straight to its `inner` mem link.
macro_rules! delegate_to_inner {
    () => {
        fn epoch(&self) -> Epoch {
            self.inner.epoch()
        }
        fn max_batch(&self) -> usize {
            self.inner.max_batch()
        }
        async fn reserve(&self) -> Result<Self::SendBuf, qpmux::link::LinkError> {
            self.inner.reserve().await
        }
        fn post(&self, buf: Self::SendBuf, len: usize) -> Result<(), qpmux::link::LinkError> {
            self.inner.post(buf, len)
        }
        fn post_last(&self, buf: Self::SendBuf, len: usize) -> Result<(), qpmux::link::LinkError> {
            self.inner.post_last(buf, len)
        }
        async fn ended(&self) -> EpochEnd {
            self.inner.ended().await
        }
    };
}

/// A mem link whose batch release stands for a provider call, as an RDMA
/// receive re-post is; every release goes into `log`.
struct RepostingLink {
    inner: MemLink,
    log: Arc<std::sync::Mutex<Vec<&'static str>>>,
}

struct RepostingBatch {
    inner: qpmux::link::mem::MemBatch,
    log: Arc<std::sync::Mutex<Vec<&'static str>>>,
}

impl std::ops::Deref for RepostingBatch {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.inner
    }
}

impl Drop for RepostingBatch {
    fn drop(&mut self) {
        self.log.lock().expect("log").push("released");
    }
}

impl Link for RepostingLink {
    type SendBuf = <MemLink as Link>::SendBuf;
    type Batch = RepostingBatch;
    const RELEASE_POSTS: bool = true;

    delegate_to_inner!();
    async fn recv(&self) -> Result<RepostingBatch, qpmux::link::LinkError> {
        let inner = self.inner.recv().await?;
        Ok(RepostingBatch {
            inner,
            log: self.log.clone(),
        })
    }
    fn fail(&self, reason: EpochEnd) {
        self.inner.fail(reason)
    }
}

struct NoDialer;

/// A mem link that, once the mux has closed it, reports its end as a
/// delivery the link cut, as the RDMA link does when a received batch's
/// buffer is not lent while our close reads the peer out.
struct CuttingLink {
    inner: MemLink,
    closed: std::sync::atomic::AtomicBool,
}

impl Link for CuttingLink {
    type SendBuf = <MemLink as Link>::SendBuf;
    type Batch = <MemLink as Link>::Batch;
    const RELEASE_POSTS: bool = false;

    delegate_to_inner!();
    async fn recv(&self) -> Result<Self::Batch, qpmux::link::LinkError> {
        use std::sync::atomic::Ordering;
        match self.inner.recv().await {
            Err(qpmux::link::LinkError::Ended { epoch, .. })
                if self.closed.load(Ordering::Acquire) =>
            {
                Err(qpmux::link::LinkError::Ended {
                    epoch,
                    reason: EpochEnd::Fault(LinkFault::BufferNotLent { receive: true }),
                })
            }
            other => other,
        }
    }
    fn fail(&self, reason: EpochEnd) {
        if reason.is_close() {
            self.closed
                .store(true, std::sync::atomic::Ordering::Release);
        }
        self.inner.fail(reason)
    }
}

/// A mux with one peer, B, on a `CuttingLink`, and B's raw end.
fn cutting_mux() -> (Mux<CuttingLink>, MemLink) {
    let mux = Mux::new(MuxConfig::default(), Arc::new(NoDialer));
    let (ours, raw) = pair(Epoch(1), MemConfig::default());
    mux.attach(
        B,
        CuttingLink {
            inner: ours,
            closed: std::sync::atomic::AtomicBool::new(false),
        },
    );
    (mux, raw)
}

/// A close whose read-out the link cut (batches it completed, dropped) is
/// no graceful end: the epoch counts as lost (the peer's Goodbye would
/// count it closed), though no message was seen to ride it, since the
/// dropped batches may have held one.
#[tokio::test]
async fn a_close_whose_read_out_the_link_cut_counts_the_epoch_lost() {
    let (mux, raw) = cutting_mux();
    until(|| mux.epoch(B).is_some()).await;
    // The peer's Goodbye: a close, which the mux then reads out.
    post_batch(&raw, 0, |enc| enc.push_goodbye().expect("fits")).await;
    until(|| mux.epoch(B).is_none()).await;
    assert_eq!(mux.epochs_lost(B).count, 1, "a cut read-out loses");
}

/// An epoch that ends on a cut delivery while served counts as lost,
/// though no message was seen to ride it: the dropped batches may have
/// held one.
#[tokio::test]
async fn an_epoch_ended_on_a_cut_delivery_counts_lost_without_a_message_seen() {
    let mux: Mux<MemLink> = Mux::new(MuxConfig::default(), Arc::new(NoDialer));
    let (ours, _raw) = pair(Epoch(1), MemConfig::default());
    let handle = ours.clone();
    mux.attach(B, ours);
    until(|| mux.epoch(B).is_some()).await;
    handle.fail(EpochEnd::Fault(LinkFault::BufferNotLent { receive: true }));
    until(|| mux.epoch(B).is_none()).await;
    assert_eq!(mux.epochs_lost(B).count, 1, "a cut delivery loses");
}

/// A shutdown whose read-out the link cut still ends its slots
/// `Dropped(Shutdown)`, as `Mux::shutdown` promises: the cut makes the
/// epoch lost, not the slots' reason.
#[tokio::test]
async fn a_shutdown_whose_read_out_the_link_cut_still_drops_slots_as_shutdown() {
    let (mux, raw) = cutting_mux();
    let mut rx = mux.bind(StreamKey::new(9, 9)).expect("bind");
    let slot = SlotId::new(0, 0).expect("slot");
    post_batch(&raw, 0, |enc| {
        enc.push_open(slot, FrameSeq(0), 9, 9).expect("fits");
        enc.push_data(slot, FrameSeq(1), b"one", false)
            .expect("fits");
    })
    .await;
    assert_eq!(
        rx.recv().await,
        Some(Frame::Data(Bytes::from_static(b"one")))
    );
    mux.shutdown();
    assert_eq!(rx.recv().await, Some(Frame::Dropped(DropReason::Shutdown)));
}

impl qpmux::mux::Dialer for NoDialer {
    fn want_link(&self, _: PeerId) {}
}

/// On a link whose batch release is a provider call, the consumer a batch
/// woke runs before the batch is released: the re-post is not on the
/// record's path (it used to come first, in the peer task's same turn).
#[tokio::test]
async fn a_consumer_runs_before_its_batch_is_released_to_the_provider() {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mux: Mux<RepostingLink> = Mux::new(MuxConfig::default(), Arc::new(NoDialer));
    let (ours, raw) = pair(Epoch(1), MemConfig::default());
    mux.attach(
        B,
        RepostingLink {
            inner: ours,
            log: log.clone(),
        },
    );
    let mut rx = mux.bind(StreamKey::new(5, 5)).expect("bind");
    let consumer_log = log.clone();
    let consumer = tokio::spawn(async move {
        let frame = rx.recv().await;
        consumer_log.lock().expect("log").push("consumed");
        frame
    });
    let slot = SlotId::new(0, 0).expect("slot");
    post_batch(&raw, 0, |enc| {
        enc.push_open(slot, FrameSeq(0), 5, 5).expect("fits");
        enc.push_data(slot, FrameSeq(1), b"first", false)
            .expect("fits");
    })
    .await;
    assert_eq!(
        consumer.await.expect("consumer"),
        Some(Frame::Data(Bytes::from_static(b"first")))
    );
    until(|| log.lock().expect("log").len() == 2).await;
    assert_eq!(*log.lock().expect("log"), ["consumed", "released"]);
}

/// The mem fabric tells each mux the other's windows, as a node's hello
/// does: a sender with 16× its receiver's slot window and 8,192× its peer
/// window sends within the receiver's, and the epoch lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_mem_fabric_slots_send_within_the_receivers_windows() {
    let fabric = MemFabric::new(MemConfig::default());
    let small = MuxConfig {
        slot_window: 16 * 1024,
        peer_window: 8 * 1024,
        ..MuxConfig::default()
    };
    let a = Mux::new(MuxConfig::default(), fabric.dialer(A));
    fabric.add(A, a.clone());
    let b = Mux::new(small, fabric.dialer(B));
    fabric.add(B, b.clone());
    slots::late_consumer_stream(&a, A, &b, B, 7).await;
}

/// Eight slots whose consumers start late, each within its slot window, more
/// than the receiver's peer window together: the sender waits for peer
/// credit (counted), every record arrives in order, and no epoch dies. The
/// slots finish before their consumers read, so the bytes of closed slots
/// come back as peer credit too. The consumers read side by side: one that
/// waited for its stream while others held the whole peer window would
/// wait for ever (docs/design.md § "Peer credit bounds what a peer can make
/// us hold").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_together_send_within_the_receivers_peer_window() {
    tokio::time::timeout(
        Duration::from_secs(20),
        eight_late_slots_against_a_peer_window(),
    )
    .await
    .expect("every record within 20 s");
}

async fn eight_late_slots_against_a_peer_window() {
    let fabric = MemFabric::new(MemConfig::default());
    let a = Mux::new(MuxConfig::default(), fabric.dialer(A));
    fabric.add(A, a.clone());
    let b = Mux::new(
        MuxConfig {
            slot_window: 32 * 1024,
            peer_window: 64 * 1024,
            ..MuxConfig::default()
        },
        fabric.dialer(B),
    );
    fabric.add(B, b.clone());
    let (slots, records) = (8u64, 32u32);
    let mut receivers = Vec::new();
    for s in 0..slots {
        let key = StreamKey::new(9, s);
        receivers.push(b.bind(key).expect("bind"));
        let mut tx = a.open(B, key).expect("open");
        tokio::spawn(async move {
            for n in 0..records {
                tx.send(record(s, n, 1024)).await.expect("send");
            }
            tx.finish(Terminal::Finalized).expect("finish");
        });
    }
    // 256 KiB offered against a 64 KiB peer window: the sender meets it.
    until(|| a.stats().peer_credit_stalls > 0).await;
    let readers: Vec<_> = receivers
        .into_iter()
        .map(|mut rx| tokio::spawn(async move { in_order_to_finalized(&mut rx).await.0 }))
        .collect();
    for reader in readers {
        assert_eq!(reader.await.expect("reader"), records);
    }
    assert_eq!((a.epoch(B), b.epoch(A)), (Some(Epoch(1)), Some(Epoch(1))));
    assert_eq!(b.stats().protocol_violations, 0);
    assert!(b.stats().peer_credit_updates_sent > 0);
}

/// Consumers that leave while a large record is on its way, over and over:
/// each record cut short gives back what never went (its unsent rest, and
/// the 64 its last fragment would have carried), fragments that arrive
/// after the consumer left come back as the sender counted them, so the
/// sender's peer credit comes back whole, and a record costing the whole
/// peer window still crosses at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_cut_short_by_departing_consumers_give_all_their_peer_credit_back() {
    let peer_window = 64 * 1024;
    let config = MuxConfig {
        slot_window: peer_window,
        peer_window,
        max_record: peer_window as usize,
        ..MuxConfig::default()
    };
    // Small batches, two in flight: a record is many batches long and is
    // still going out when its consumer leaves.
    let small_batches = MemConfig {
        max_batch: 1024,
        credits: 2,
        ..MemConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, small_batches);
    let body = Bytes::from(vec![9u8; 40 * 1024]);
    tokio::time::timeout(Duration::from_secs(30), async {
        for s in 0..64u64 {
            let key = StreamKey::new(21, s);
            let rx = muxes[1].bind(key).expect("bind");
            let tx = {
                let mut tx = muxes[0].open(B, key).expect("open");
                tx.send(body.clone()).await.expect("queued");
                tx
            };
            // Leave once the record has begun to arrive, at once or a few
            // turns later: mid-record, mostly.
            until(|| muxes[1].stats().peer_held_bytes > 0).await;
            for _ in 0..s % 4 {
                tokio::task::yield_now().await;
            }
            drop(rx);
            assert_eq!(
                tx.closed().await,
                SendError::PeerClosed(CloseReason::ReceiverGone)
            );
        }
        // A record costing the whole window needs all of it back.
        let key = StreamKey::new(21, 1000);
        let mut rx = muxes[1].bind(key).expect("bind");
        let mut tx = muxes[0].open(B, key).expect("open");
        let whole = Bytes::from(vec![7u8; peer_window as usize - RECORD_OVERHEAD]);
        tx.send(whole.clone()).await.expect("queued");
        assert_eq!(rx.recv().await, Some(Frame::Data(whole)));
    })
    .await
    .expect("the peer credit came back whole");
    assert_eq!(muxes[1].stats().protocol_violations, 0);
}

/// A record larger than the receiver's whole peer window (though within
/// its `max_record`) can never go: its slot ends for the producer with
/// `TooLarge` naming what the window holds, the consumer hears why
/// (`RecordTooLarge`, not a bare `SenderDropped`), and the epoch lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_larger_than_the_receivers_peer_window_ends_only_its_slot() {
    tokio::time::timeout(Duration::from_secs(20), a_record_past_the_peer_window())
        .await
        .expect("the slot ends within 20 s");
}

async fn a_record_past_the_peer_window() {
    let fabric = MemFabric::new(MemConfig::default());
    let a = Mux::new(MuxConfig::default(), fabric.dialer(A));
    fabric.add(A, a.clone());
    let peer_window = 64 * 1024;
    let b = Mux::new(
        MuxConfig {
            peer_window,
            max_record: 2 * peer_window as usize,
            ..MuxConfig::default()
        },
        fabric.dialer(B),
    );
    fabric.add(B, b.clone());
    let key = StreamKey::new(10, 1);
    let mut rx = b.bind(key).expect("bind");
    let mut tx = a.open(B, key).expect("open");
    tx.send(record(1, 0, 100)).await.expect("send");
    tx.send(record(1, 1, 100 * 1024)).await.expect("queued");
    assert_eq!(
        tx.closed().await,
        SendError::TooLarge {
            len: 100 * 1024,
            max: peer_window as usize - RECORD_OVERHEAD
        }
    );
    assert!(matches!(rx.recv().await, Some(Frame::Data(d)) if seq_of(&d) == 0));
    assert_eq!(
        rx.recv().await,
        Some(Frame::Dropped(DropReason::RecordTooLarge))
    );
    assert_eq!((a.epoch(B), b.epoch(A)), (Some(Epoch(1)), Some(Epoch(1))));
    // The peer and its other streams go on.
    slots::late_consumer_stream(&a, A, &b, B, 11).await;
}

/// A refused open reaches its sender as refused, even when the records sent
/// behind it in the same batch arrive for a slot the receiver never made
/// (their "unknown slot" used to overwrite the refusal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_open_reaches_its_sender_as_refused() {
    let config = MuxConfig {
        flush: FlushPolicy::Manual {
            reply_linger: Duration::from_millis(1),
        },
        // Every open for a key nobody bound is refused.
        max_unbound_per_peer: 0,
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let a = &muxes[0];
    let mut tx = a.open(B, StreamKey::new(9, 0)).expect("open");
    for n in 0..4 {
        tx.send(record(0, n, 100)).await.expect("queued");
    }
    a.flush(B).expect("flush");
    let closed = tokio::time::timeout(Duration::from_secs(10), tx.closed())
        .await
        .expect("the refusal arrives");
    assert_eq!(closed, SendError::PeerClosed(CloseReason::Refused));
}

/// Muxes A and B on a mem fabric, A asking for links through the dialer
/// `wrap` makes of the fabric's own.
fn a_dialing_through(
    wrap: impl FnOnce(Arc<dyn qpmux::mux::Dialer>) -> Arc<dyn qpmux::mux::Dialer>,
) -> (Arc<MemFabric>, Mux<MemLink>, Mux<MemLink>) {
    let fabric = MemFabric::new(MemConfig::default());
    let a = Mux::new(MuxConfig::default(), wrap(fabric.dialer(A)));
    let b = Mux::new(MuxConfig::default(), fabric.dialer(B));
    fabric.add(A, a.clone());
    fabric.add(B, b.clone());
    (fabric, a, b)
}

/// A dialer whose first call panics: a bug outside any epoch's turns.
struct PanicsOnceDialer {
    inner: Arc<dyn qpmux::mux::Dialer>,
    panicked: std::sync::atomic::AtomicBool,
}

impl qpmux::mux::Dialer for PanicsOnceDialer {
    fn want_link(&self, peer: PeerId) {
        let first = !self
            .panicked
            .swap(true, std::sync::atomic::Ordering::Relaxed);
        assert!(!first, "a bug in the dialer");
        self.inner.want_link(peer);
    }
}

/// A panic in a peer task outside an epoch (here, asking for a link) does
/// not strand the slots queued on it: the task runs again and serves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_task_that_panics_outside_an_epoch_runs_again_and_serves_its_slots() {
    let served = tokio::time::timeout(Duration::from_secs(20), async {
        let (_fabric, a, b) = a_dialing_through(|inner| {
            Arc::new(PanicsOnceDialer {
                inner,
                panicked: Default::default(),
            })
        });
        let key = StreamKey::new(7, 1);
        let mut rx = b.bind(key).expect("bind");
        let mut tx = a.open(B, key).expect("open");
        tx.send(Bytes::from_static(b"queued")).await.expect("send");
        tx.finish(Terminal::Finalized).expect("finish");
        assert_eq!(
            rx.recv().await,
            Some(Frame::Data(Bytes::from_static(b"queued")))
        );
        assert_eq!(rx.recv().await, Some(Frame::Finalized));
        assert_eq!(a.stats().peer_task_panics, 1);
        assert_eq!(a.epoch(B), Some(Epoch(1)));
    })
    .await;
    served.expect("the slot queued on the panicked task never left");
}

/// A dialer whose `link_released` always panics: the peer task's restart
/// tells the dialer again, and that panic too must not end the task.
struct PanicsOnReleaseDialer {
    inner: Arc<dyn qpmux::mux::Dialer>,
}

impl qpmux::mux::Dialer for PanicsOnReleaseDialer {
    fn want_link(&self, peer: PeerId) {
        self.inner.want_link(peer);
    }

    fn link_released(&self, _: PeerId) {
        panic!("a bug in the dialer's release");
    }
}

/// A release that panics, and panics again when the restart tells the
/// dialer once more, leaves the peer task restarting: the next epoch comes
/// up and `closed` resolves at shutdown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_panics_twice_does_not_end_the_peer_task() {
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        let (fabric, a, b) = a_dialing_through(|inner| Arc::new(PanicsOnReleaseDialer { inner }));
        let key = StreamKey::new(7, 3);
        let mut rx = b.bind(key).expect("bind");
        let mut tx = a.open(B, key).expect("open");
        tx.send(Bytes::from_static(b"first")).await.expect("send");
        assert_eq!(
            rx.recv().await,
            Some(Frame::Data(Bytes::from_static(b"first")))
        );
        assert!(fabric.kill(A, B, EpochEnd::Fault(LinkFault::Injected)));
        until(|| a.stats().peer_task_panics >= 1).await;
        let mut again = a.open(B, StreamKey::new(7, 4)).expect("open");
        again
            .send(Bytes::from_static(b"again"))
            .await
            .expect("send");
        until(|| a.epoch(B).is_some_and(|epoch| epoch > Epoch(1))).await;
        a.shutdown();
        a.closed().await;
    })
    .await;
    closed.expect("the peer task ended for good");
}

/// A dialer that always panics: what panicked would panic again.
struct AlwaysPanicsDialer;

impl qpmux::mux::Dialer for AlwaysPanicsDialer {
    fn want_link(&self, _: PeerId) {
        panic!("a bug in the dialer, every time");
    }
}

/// A peer task that keeps panicking outside an epoch stops restarting at
/// shutdown: `closed` resolves and its queued slot hears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_task_that_keeps_panicking_retires_at_shutdown() {
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        let a: Mux<MemLink> = Mux::new(MuxConfig::default(), Arc::new(AlwaysPanicsDialer));
        let mut tx = a.open(B, StreamKey::new(7, 2)).expect("open");
        tx.send(Bytes::from_static(b"never")).await.expect("send");
        until(|| a.stats().peer_task_panics >= 2).await;
        a.shutdown();
        a.closed().await;
        assert_eq!(tx.closed().await, SendError::Dropped(DropReason::Shutdown));
    })
    .await;
    closed.expect("the restarting task kept the mux from closing");
}

/// A runtime that goes away mid-epoch drops its peer tasks unfinished; the
/// links they served end with them, so the peer's slots hear `Dropped`
/// instead of waiting on a link nobody serves (the fabric still holds it).
#[test]
fn a_peer_task_dropped_mid_epoch_ends_its_link() {
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime")
    };
    let (a_runtime, b_runtime) = (runtime(), runtime());
    let fabric = MemFabric::new(MemConfig::default());
    let on = |runtime: &tokio::runtime::Runtime, id| {
        let _entered = runtime.enter();
        let mux = Mux::new(MuxConfig::default(), fabric.dialer(id));
        fabric.add(id, mux.clone());
        mux
    };
    let (a, b) = (on(&a_runtime, A), on(&b_runtime, B));
    let key = StreamKey::new(7, 9);
    let mut rx = b.bind(key).expect("bind");
    let tx = a_runtime.block_on(async {
        let mut tx = a.open(B, key).expect("open");
        tx.send(Bytes::from_static(b"before")).await.expect("send");
        tx
    });
    b_runtime.block_on(async {
        let first = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
        assert_eq!(
            first.expect("delivered"),
            Some(Frame::Data(Bytes::from_static(b"before")))
        );
    });
    drop(a_runtime);
    assert!(fabric.link(A, B).is_some_and(|link| link.is_ended()));
    b_runtime.block_on(async {
        let end = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
        assert_eq!(
            end.expect("the epoch ended at B"),
            Some(Frame::Dropped(DropReason::EpochEnded { epoch: Epoch(1) }))
        );
    });
    drop(tx);
}

/// A link replaced before the peer task took it up is read out first: what
/// the peer sent on it is delivered, its streams end, then the newer link
/// is served (it used to be failed unread).
#[tokio::test]
async fn a_link_replaced_before_it_was_served_is_read_out_first() {
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        let fabric = MemFabric::new(MemConfig::default());
        let mux = Mux::new(MuxConfig::default(), fabric.dialer(A));
        let key = StreamKey::new(4, 4);
        let mut rx = mux.bind(key).expect("bind");
        let (ours1, theirs1) = pair(Epoch(1), MemConfig::default());
        let (ours2, _theirs2) = pair(Epoch(2), MemConfig::default());
        let slot = SlotId::new(0, 0).expect("slot");
        post_batch(&theirs1, 0, |enc| {
            enc.push_open(slot, FrameSeq(0), 4, 4).expect("fits");
            enc.push_data(slot, FrameSeq(1), b"early", false)
                .expect("fits");
        })
        .await;
        // Link 2 comes before the peer task can run (no await between).
        mux.attach(B, ours1);
        mux.attach(B, ours2);
        assert_eq!(
            rx.recv().await,
            Some(Frame::Data(Bytes::from_static(b"early")))
        );
        assert_eq!(
            rx.recv().await,
            Some(Frame::Dropped(DropReason::EpochEnded { epoch: Epoch(1) }))
        );
        until(|| mux.epoch(B) == Some(Epoch(2))).await;
    })
    .await;
    outcome.expect("the replaced link's record never came");
}

/// Past the four links kept to read out, a fifth replaced before the peer
/// task ran evicts the oldest unread, and the node counts it: what the peer
/// sent there is lost, and only the counter says so.
#[tokio::test]
async fn links_replaced_past_the_four_kept_are_counted_unread() {
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        let fabric = MemFabric::new(MemConfig::default());
        let mux = Mux::new(MuxConfig::default(), fabric.dialer(A));
        let mut peers = Vec::new();
        // Six links before the peer task can run (no await between): the
        // newest is served, four are read out, one goes unread.
        for epoch in 1..=6 {
            let (ours, theirs) = pair(Epoch(epoch), MemConfig::default());
            mux.attach(B, ours);
            peers.push(theirs);
        }
        assert_eq!(mux.stats().links_unread, 1);
        until(|| mux.epoch(B) == Some(Epoch(6))).await;
        assert_eq!(mux.stats().links_unread, 1);
    })
    .await;
    outcome.expect("the newest link was never served");
}

/// A link handed over only to be read out (the connector refused it after
/// the peer may have sent on it: docs/design.md § "A closed link delivers
/// both ways") delivers what the peer sent and ends its streams, though no
/// newer link comes to be served after it.
#[tokio::test]
async fn a_link_handed_over_to_be_read_out_delivers_what_the_peer_sent() {
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        let fabric = MemFabric::new(MemConfig::default());
        let config = MuxConfig::default();
        let mux = Mux::new(config.clone(), fabric.dialer(A));
        let key = StreamKey::new(4, 4);
        let mut rx = mux.bind(key).expect("bind");
        let (ours, theirs) = pair(Epoch(1), MemConfig::default());
        let slot = SlotId::new(0, 0).expect("slot");
        post_batch(&theirs, 0, |enc| {
            enc.push_open(slot, FrameSeq(0), 4, 4).expect("fits");
            enc.push_data(slot, FrameSeq(1), b"sent before the refusal", false)
                .expect("fits");
        })
        .await;
        ours.fail(EpochEnd::Closed);
        let terms = qpmux::mux::PeerTerms::announced_by(&config);
        mux.read_out_with_terms(B, ours, terms, 0);
        assert_eq!(
            rx.recv().await,
            Some(Frame::Data(Bytes::from_static(b"sent before the refusal")))
        );
        assert_eq!(
            rx.recv().await,
            Some(Frame::Dropped(DropReason::EpochEnded { epoch: Epoch(1) }))
        );
    })
    .await;
    outcome.expect("the read-out never ran");
}

/// A link handed over but not yet served has its grant left out of the
/// next hello's credit: two links that arrive before the peer task runs
/// cannot each be granted the whole window (the first is read out too).
/// Every grant comes back once both epochs are over.
#[tokio::test]
async fn a_grant_to_a_link_not_yet_served_is_left_out_of_the_next() {
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        let fabric = MemFabric::new(MemConfig::default());
        let config = MuxConfig::default();
        let mux = Mux::new(config.clone(), fabric.dialer(A));
        let terms = qpmux::mux::PeerTerms::announced_by(&config);
        let (ours1, _theirs1) = pair(Epoch(1), MemConfig::default());
        let (ours2, theirs2) = pair(Epoch(2), MemConfig::default());
        let whole = mux.peer_room(B);
        assert_eq!(whole, config.peer_window);
        mux.attach_with_terms(B, ours1, terms, whole);
        assert_eq!(mux.peer_room(B), 0, "the unserved link's grant was free");
        mux.attach_with_terms(B, ours2, terms, mux.peer_room(B));
        until(|| mux.epoch(B) == Some(Epoch(2))).await;
        theirs2.fail(EpochEnd::Closed);
        until(|| mux.epoch(B).is_none()).await;
        assert_eq!(
            mux.peer_room(B),
            config.peer_window,
            "a grant never came back"
        );
    })
    .await;
    outcome.expect("the epochs never ended");
}

// ---- a lone record written by its producer ----

/// A sender on A and a bound receiver on B, the epoch up and A's peer task
/// waiting with nothing to write.
async fn settled_stream(
    config: MuxConfig,
) -> (
    Arc<MemFabric>,
    Vec<Mux<MemLink>>,
    qpmux::mux::SlotSender,
    qpmux::mux::SlotReceiver,
) {
    let (fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let key = StreamKey::new(B.0, 1);
    let mut rx = muxes[1].bind(key).expect("bind");
    let mut tx = muxes[0].open(B, key).expect("open");
    tx.send(record(1, 0, 64)).await.expect("send");
    assert!(matches!(rx.recv().await, Some(Frame::Data(d)) if seq_of(&d) == 0));
    // B's grants handled, any gap of the tests past.
    tokio::time::sleep(Duration::from_millis(210)).await;
    (fabric, muxes, tx, rx)
}

async fn next_seq(rx: &mut qpmux::mux::SlotReceiver) -> u32 {
    match rx.recv().await {
        Some(Frame::Data(d)) => seq_of(&d),
        other => panic!("expected data, got {other:?}"),
    }
}

/// A lone record finds A's peer task waiting with nothing to write: the
/// producer's own `send` writes and posts its batch (on a current-thread
/// runtime nothing else runs during a `send` that does not wait). A burst
/// sends its first record so and the rest batched through the peer task,
/// and the burst's batch keeps the next lone record on the task too, until
/// a lone batch has gone that way; records arrive in order throughout.
#[tokio::test]
async fn a_lone_record_is_written_by_its_producer_and_a_burst_goes_batched() {
    // Long enough that no stall of the runner between a burst's sends
    // passes it.
    let gap = Duration::from_millis(200);
    let config = MuxConfig {
        inline_write_gap: Some(gap),
        ..MuxConfig::default()
    };
    let (_fabric, muxes, mut tx, mut rx) = settled_stream(config).await;
    let a = &muxes[0];
    let before = a.stats();
    tx.send(record(1, 1, 64)).await.expect("send");
    let after = a.stats();
    assert_eq!(
        after.batches_inline,
        before.batches_inline + 1,
        "in the send"
    );
    assert_eq!(after.batches_sent, before.batches_sent + 1);
    assert_eq!(next_seq(&mut rx).await, 1);

    tokio::time::sleep(gap + Duration::from_millis(10)).await;
    let before = a.stats();
    for n in 2..66 {
        tx.send(record(1, n, 64)).await.expect("send");
    }
    assert_eq!(
        a.stats().batches_inline,
        before.batches_inline + 1,
        "the first only"
    );
    for n in 2..66 {
        assert_eq!(next_seq(&mut rx).await, n);
    }
    let burst = a.stats();
    assert!(
        burst.batches_sent - before.batches_sent <= 3,
        "batched: {} batches",
        burst.batches_sent - before.batches_sent
    );

    tokio::time::sleep(gap + Duration::from_millis(10)).await;
    tx.send(record(1, 66, 64)).await.expect("send");
    assert_eq!(
        a.stats().batches_inline,
        burst.batches_inline,
        "after a burst"
    );
    assert_eq!(next_seq(&mut rx).await, 66);
    tokio::time::sleep(gap + Duration::from_millis(10)).await;
    tx.send(record(1, 67, 64)).await.expect("send");
    assert_eq!(
        a.stats().batches_inline,
        burst.batches_inline + 1,
        "lone again"
    );
    assert_eq!(next_seq(&mut rx).await, 67);
    assert_eq!(
        a.stats().protocol_violations + muxes[1].stats().protocol_violations,
        0
    );
}

/// With no gap configured every batch goes through the peer task.
#[tokio::test]
async fn no_inline_write_gap_keeps_every_batch_on_the_peer_task() {
    let config = MuxConfig {
        inline_write_gap: None,
        ..MuxConfig::default()
    };
    let (_fabric, muxes, mut tx, mut rx) = settled_stream(config).await;
    for n in 1..4 {
        tx.send(record(1, n, 64)).await.expect("send");
        assert_eq!(next_seq(&mut rx).await, n);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(muxes[0].stats().batches_inline, 0);
}

/// Producers on several threads racing each other and the peer task for
/// the core, each writing in its own turn whenever it finds the task
/// waiting: every record arrives once, in order per stream, the batch
/// numbers stay gapless (no violation), and the epoch lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producers_racing_for_the_core_keep_every_stream_whole() {
    let config = MuxConfig {
        inline_write_gap: Some(Duration::ZERO),
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let (a, b) = (&muxes[0], &muxes[1]);
    let records = 300u32;
    let mut consumers = Vec::new();
    let mut producers = Vec::new();
    let traffic = Traffic {
        records,
        len: |_, _, rng| rng.random_range(12..300),
        pause: |rng| match rng.random_range(0..4) {
            0 => Pause::Sleep(Duration::from_micros(100)),
            1 => Pause::Yield,
            _ => Pause::No,
        },
    };
    for s in 0..8u64 {
        let key = StreamKey::new(B.0, s);
        let (consumer, producer) = stream_tasks(a, b, B, key, (s, s), traffic);
        consumers.push(consumer);
        producers.push(producer);
    }
    every_stream_whole(producers, consumers, records).await;
    assert!(a.stats().batches_inline > 0, "some batches went inline");
    assert_eq!(
        a.stats().protocol_violations + b.stats().protocol_violations,
        0
    );
    assert_eq!((a.epoch(B), b.epoch(A)), (Some(Epoch(1)), Some(Epoch(1))));
}

/// Waits (at most 60 s) for every producer to finish and every consumer
/// to count `records` in order.
async fn every_stream_whole(
    producers: Vec<tokio::task::JoinHandle<()>>,
    consumers: Vec<tokio::task::JoinHandle<(u32, usize)>>,
    records: u32,
) {
    let all = async {
        for p in producers {
            p.await.expect("producer");
        }
        for c in consumers {
            assert_eq!(c.await.expect("consumer").0, records);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("every stream ends within 60 s");
}

/// A producer's lone record finds the link ended: the peer closed it right
/// after its last batch. That batch, which the peer task may take off the
/// link in the same turn as it learns of the failed write (a coin flip in
/// its `select!`, so sixteen rounds), is still delivered, the stream's end
/// with it, never dropped for the write.
#[tokio::test]
async fn the_peers_last_batch_is_delivered_when_a_producers_write_finds_the_link_ended() {
    for round in 0..16u64 {
        let config = MuxConfig {
            inline_write_gap: Some(Duration::ZERO),
            ..MuxConfig::default()
        };
        let (mux, raw) = raw_peer(config).await;
        // Our stream to the peer, its Open out: then the task waits with
        // nothing to write.
        let mut tx = mux.open(B, StreamKey::new(6, round)).expect("open");
        tx.send(record(6, 0, 100)).await.expect("send");
        drop(raw.recv().await.expect("the record's batch"));
        tokio::time::sleep(Duration::from_millis(2)).await;
        let key = StreamKey::new(7, round);
        let mut rx = mux.bind(key).expect("bind");
        let slot = SlotId::new(0, 0).expect("slot");
        post_batch(&raw, 0, |enc| {
            enc.push_open(slot, FrameSeq(0), 7, round).expect("fits");
            enc.push_data(slot, FrameSeq(1), b"last", false)
                .expect("fits");
            enc.push_close(slot, FrameSeq(2), CloseReason::Finalized)
                .expect("fits");
        })
        .await;
        raw.fail(EpochEnd::PeerLost);
        // Nothing else has run since: this send writes, and fails.
        let before = mux.stats().batches_inline;
        tx.send(record(6, 1, 100)).await.expect("taken");
        assert_eq!(mux.stats().batches_inline, before, "round {round}");
        let delivered = tokio::time::timeout(Duration::from_secs(10), async {
            (rx.recv().await, rx.recv().await)
        })
        .await
        .expect("the peer's last batch is delivered or dropped within 10 s");
        assert_eq!(
            delivered,
            (
                Some(Frame::Data(Bytes::from_static(b"last"))),
                Some(Frame::Finalized)
            ),
            "round {round}"
        );
        assert_eq!(rx.recv().await, None, "once, round {round}");
    }
}

/// A mem link that offers `try_reserve` and panics in it, as a provider
/// bug would.
struct PanickingReserveLink(MemLink);

impl Link for PanickingReserveLink {
    type SendBuf = <MemLink as Link>::SendBuf;
    type Batch = <MemLink as Link>::Batch;
    const RELEASE_POSTS: bool = false;
    const TRY_RESERVE: bool = true;

    fn epoch(&self) -> Epoch {
        self.0.epoch()
    }
    fn max_batch(&self) -> usize {
        self.0.max_batch()
    }
    async fn reserve(&self) -> Result<Self::SendBuf, qpmux::link::LinkError> {
        self.0.reserve().await
    }
    fn try_reserve(&self) -> Option<Result<Self::SendBuf, qpmux::link::LinkError>> {
        panic!("a provider bug in try_reserve");
    }
    fn post(&self, buf: Self::SendBuf, len: usize) -> Result<(), qpmux::link::LinkError> {
        self.0.post(buf, len)
    }
    fn post_last(&self, buf: Self::SendBuf, len: usize) -> Result<(), qpmux::link::LinkError> {
        self.0.post_last(buf, len)
    }
    async fn recv(&self) -> Result<Self::Batch, qpmux::link::LinkError> {
        self.0.recv().await
    }
    fn fail(&self, reason: EpochEnd) {
        self.0.fail(reason)
    }
    async fn ended(&self) -> EpochEnd {
        self.0.ended().await
    }
}

/// A panic in a producer's write ends the epoch as a panic in the peer
/// task does: counted once, the link failed, the producer's stream dropped
/// for the epoch.
#[tokio::test]
async fn a_panic_in_a_producers_write_ends_the_epoch_as_a_task_panic_does() {
    let config = MuxConfig {
        inline_write_gap: Some(Duration::ZERO),
        ..MuxConfig::default()
    };
    let mux: Mux<PanickingReserveLink> = Mux::new(config, Arc::new(NoDialer));
    let (ours, raw) = pair(Epoch(1), MemConfig::default());
    mux.attach(B, PanickingReserveLink(ours));
    let mut tx = mux.open(B, StreamKey::new(6, 6)).expect("open");
    tx.send(record(6, 0, 100)).await.expect("send");
    drop(
        raw.recv()
            .await
            .expect("the record's batch, through the task"),
    );
    tokio::time::sleep(Duration::from_millis(2)).await;
    // The task waits with nothing to write: this send writes, and panics.
    tx.send(record(6, 1, 100)).await.expect("taken");
    let closed = tokio::time::timeout(Duration::from_secs(10), tx.closed())
        .await
        .expect("the stream ends within 10 s");
    assert_eq!(
        closed,
        SendError::Dropped(DropReason::EpochEnded { epoch: Epoch(1) })
    );
    // The far end hears its peer close the link.
    assert_eq!(raw.ended().await, EpochEnd::PeerClosed);
    let stats = mux.stats();
    assert_eq!((stats.peer_task_panics, stats.batches_inline), (1, 0));
    assert_eq!(mux.epoch(B), None);
}

/// A link without `try_reserve`, and a flush that is not automatic, never
/// offer producers the write: every batch goes through the peer task.
#[tokio::test]
async fn links_without_try_reserve_and_lingering_flushes_never_write_inline() {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let config = MuxConfig {
        inline_write_gap: Some(Duration::ZERO),
        ..MuxConfig::default()
    };
    let mux: Mux<RepostingLink> = Mux::new(config.clone(), Arc::new(NoDialer));
    let (ours, raw) = pair(Epoch(1), MemConfig::default());
    mux.attach(B, RepostingLink { inner: ours, log });
    let mut tx = mux.open(B, StreamKey::new(6, 6)).expect("open");
    for n in 0..4 {
        tx.send(record(6, n, 100)).await.expect("send");
        drop(raw.recv().await.expect("a batch"));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(mux.stats().batches_inline, 0, "no try_reserve");

    let lingering = MuxConfig {
        flush: FlushPolicy::AutoLinger {
            max_linger: Duration::from_micros(10),
        },
        ..config
    };
    let (mux, raw) = raw_peer(lingering).await;
    let mut tx = mux.open(B, StreamKey::new(6, 7)).expect("open");
    for n in 0..4 {
        tx.send(record(6, n, 100)).await.expect("send");
        drop(raw.recv().await.expect("a batch"));
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(mux.stats().batches_inline, 0, "a lingering flush");
}

#[tokio::test]
async fn the_mem_link_hands_batches_to_its_hook_in_order() {
    let (a, b) = pair(Epoch(1), MemConfig::default());
    arrivals::the_reader_hands_batches_to_its_hook_in_order(a, b).await;
}

/// A batch that finds B's peer task waiting is decoded in the sender's
/// `post` (the mem link's reader) and its consumer woken from there; with
/// `inline_receive` off, every batch goes through the peer task.
#[tokio::test]
async fn a_batch_finding_the_peer_task_waiting_is_decoded_by_its_reader() {
    for inline_receive in [true, false] {
        let config = MuxConfig {
            inline_receive,
            ..MuxConfig::default()
        };
        let (_fabric, muxes, mut tx, mut rx) = settled_stream(config).await;
        let b = &muxes[1];
        let before = b.stats();
        for n in 1..5 {
            tx.send(record(1, n, 64)).await.expect("send");
            assert_eq!(next_seq(&mut rx).await, n);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let after = b.stats();
        assert_eq!(after.batches_received - before.batches_received, 4);
        let inline = after.batches_received_inline - before.batches_received_inline;
        if inline_receive {
            assert_eq!(inline, 4, "each found the task waiting");
        } else {
            assert_eq!(inline, 0, "inline receive is off");
        }
        assert_eq!(after.protocol_violations, 0);
    }
}

/// Batches race between the reader's decode and the peer task's (B's task
/// busy returning credit and writing its own streams back): every stream
/// both ways arrives whole and in order, with no violation (a batch taken
/// past an earlier one would jump a frame sequence), and some batches went
/// each way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_decoded_by_reader_and_task_keep_their_order() {
    let config = MuxConfig {
        slot_window: 4 * 1024,
        ..MuxConfig::default()
    };
    let (_fabric, muxes) = fabric(&[A, B], config, MemConfig::default());
    let records = 400u32;
    let mut consumers = Vec::new();
    let mut producers = Vec::new();
    let traffic = Traffic {
        records,
        len: |_, _, rng| rng.random_range(12..600),
        pause: |rng| {
            if rng.random_range(0..3) == 0 {
                Pause::Yield
            } else {
                Pause::No
            }
        },
    };
    for s in 0..8u64 {
        // Streams both ways, so each peer task has its own work.
        let (from, to, to_id) = if s % 2 == 0 {
            (&muxes[0], &muxes[1], B)
        } else {
            (&muxes[1], &muxes[0], A)
        };
        let key = StreamKey::new(to_id.0, s);
        let (consumer, producer) = stream_tasks(from, to, to_id, key, (s, s), traffic);
        consumers.push(consumer);
        producers.push(producer);
    }
    every_stream_whole(producers, consumers, records).await;
    let (a, b) = (muxes[0].stats(), muxes[1].stats());
    assert_eq!(a.protocol_violations + b.protocol_violations, 0);
    let inline = a.batches_received_inline + b.batches_received_inline;
    let received = a.batches_received + b.batches_received;
    assert!(inline > 0, "no batch was decoded by its reader");
    assert!(inline < received, "every batch was decoded by its reader");
    assert_eq!(
        (muxes[0].epoch(B), muxes[1].epoch(A)),
        (Some(Epoch(1)), Some(Epoch(1)))
    );
}

/// The peer's Goodbye, decoded by the reader (the raw peer's `post`) while
/// A's peer task waits, closes the turn: a producer's record right after it
/// is not written past the Goodbye in the producer's own turn, and the
/// epoch ends as the peer's close, the record dropped, not lost unseen.
#[tokio::test]
async fn a_goodbye_decoded_by_the_reader_stops_the_producers_writing() {
    let (mux, raw) = raw_peer(MuxConfig::default()).await;
    let mut tx = mux.open(B, StreamKey::new(4, 4)).expect("open");
    tx.send(record(4, 0, 64)).await.expect("send");
    drop(raw.recv().await.expect("the first record's batch"));
    tokio::time::sleep(Duration::from_millis(5)).await;
    let inline_before = mux.stats().batches_inline;
    post_batch(&raw, 0, |enc| {
        enc.push_goodbye().expect("fits");
    })
    .await;
    assert_eq!(
        mux.stats().batches_received_inline,
        1,
        "decoded by the reader"
    );
    // No await between the Goodbye and this send: nothing else has run.
    let _ = tx.send(record(4, 1, 64)).await;
    assert_eq!(
        mux.stats().batches_inline,
        inline_before,
        "written past the Goodbye"
    );
    nothing_written_past_the_goodbye(&mux, &raw, &tx, "").await;
}

/// What the raw peer reads after its Goodbye carries no record, the epoch
/// ends, and the stream's sender hears `Dropped`.
async fn nothing_written_past_the_goodbye(
    mux: &Mux<MemLink>,
    raw: &MemLink,
    tx: &qpmux::mux::SlotSender,
    what: &str,
) {
    while let Ok(batch) = raw.recv().await {
        let view = BatchView::new_checked(&batch).expect("valid");
        assert!(
            !view
                .records()
                .any(|r| matches!(r.body, RecordBody::Data(_))),
            "{what}a record went out after the peer's Goodbye"
        );
    }
    assert_eq!(
        tx.closed().await,
        SendError::Dropped(DropReason::EpochEnded { epoch: Epoch(1) })
    );
    assert_eq!(mux.stats().protocol_violations, 0);
}

/// The peer's Goodbye, decoded by the reader while A's task waits for a
/// link credit, and the credit coming back in the same turn: whichever the
/// task's `select!` takes first, nothing is written past the Goodbye, and
/// the records still queued are dropped to their sender.
#[tokio::test]
async fn a_goodbye_decoded_while_the_task_waits_for_credit_ends_the_writing() {
    for round in 0..8u64 {
        let link = MemConfig {
            credits: 2,
            ..MemConfig::default()
        };
        let (mux, raw) = raw_peer_with(MuxConfig::default(), link).await;
        let mut tx = mux.open(B, StreamKey::new(4, round)).expect("open");
        let mut held = Vec::new();
        for n in 0..2 {
            tx.send(record(4, n, 64)).await.expect("send");
            held.push(raw.recv().await.expect("a batch"));
        }
        // Both credits with the raw peer: this one waits in A's core.
        tx.send(record(4, 2, 64)).await.expect("send");
        tokio::time::sleep(Duration::from_millis(2)).await;
        post_batch(&raw, 0, |enc| {
            enc.push_goodbye().expect("fits");
        })
        .await;
        assert!(mux.stats().batches_received_inline >= 1, "round {round}");
        drop(held);
        nothing_written_past_the_goodbye(&mux, &raw, &tx, &format!("round {round}: ")).await;
    }
}
