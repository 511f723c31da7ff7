use std::time::Duration;

use super::*;

fn config(credits: usize) -> MemConfig {
    MemConfig {
        credits,
        max_batch: 256,
        send_buffers: credits + 2,
    }
}

/// Lets every runnable task run; waits on no clock.
async fn settle() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn sender_without_credit_waits_until_a_batch_is_dropped() {
    let (a, b) = pair(Epoch(1), config(2));
    for i in 0..2u8 {
        let mut buf = a.reserve().await.expect("credit available");
        buf[0] = i;
        a.post(buf, 1).expect("posted");
    }
    assert_eq!(
        a.credit_state(),
        CreditState {
            held: 0,
            in_flight: 2,
            consumer_held: 0
        }
    );

    let a2 = a.clone();
    let blocked = tokio::spawn(async move { a2.reserve().await.map(|_| ()) });
    settle().await;
    assert!(
        !blocked.is_finished(),
        "reserve with zero credits must wait"
    );

    let first = b.recv().await.expect("batch");
    assert_eq!(&first[..], &[0]);
    assert_eq!(
        a.credit_state(),
        CreditState {
            held: 0,
            in_flight: 1,
            consumer_held: 1
        }
    );
    settle().await;
    assert!(
        !blocked.is_finished(),
        "receiving is not returning: only drop returns credit"
    );

    drop(first);
    blocked.await.expect("task").expect("credit came back");
    assert_eq!(a.credit_state().total(), 2);
}

#[tokio::test]
async fn dropping_a_batch_returns_exactly_one_credit() {
    let (a, b) = pair(Epoch(1), config(4));
    for _ in 0..4 {
        let buf = a.reserve().await.expect("credit");
        a.post(buf, 0).expect("posted");
    }
    let batches: Vec<MemBatch> = [b.recv().await, b.recv().await]
        .into_iter()
        .map(|r| r.expect("batch"))
        .collect();
    assert_eq!(a.credit_state().held, 0);
    drop(batches);
    let state = a.credit_state();
    assert_eq!(
        state,
        CreditState {
            held: 2,
            in_flight: 2,
            consumer_held: 0
        }
    );
    assert_eq!(state.total(), 4);
}

#[tokio::test]
async fn unposted_send_buffer_returns_its_credit() {
    let (a, _b) = pair(Epoch(1), config(1));
    let buf = a.reserve().await.expect("credit");
    assert_eq!(a.credit_state().total(), 1);
    drop(buf);
    let again = a.reserve().await.expect("credit returned by drop");
    assert_eq!(again.len(), 256);
}

#[tokio::test]
async fn credits_are_never_exceeded_under_random_traffic() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let (a, b) = pair(Epoch(3), config(3));
    let mut held: Vec<MemBatch> = Vec::new();
    let mut sent = 0u32;
    let mut received = 0u32;
    for _ in 0..2_000 {
        match rng.random_range(0..3) {
            0 => {
                // Try to send without waiting: only possible with a credit.
                let before = a.credit_state();
                let attempt = tokio::time::timeout(Duration::ZERO, a.reserve()).await;
                match attempt {
                    Ok(Ok(mut buf)) => {
                        assert!(before.held > 0, "reserved without a credit");
                        buf[..4].copy_from_slice(&sent.to_be_bytes());
                        a.post(buf, 4).expect("posted");
                        sent += 1;
                    }
                    Ok(Err(e)) => panic!("link failed: {e}"),
                    Err(_) => assert_eq!(before.held, 0, "waited while holding a credit"),
                }
            }
            1 => {
                if let Ok(Ok(batch)) = tokio::time::timeout(Duration::ZERO, b.recv()).await {
                    assert_eq!(&batch[..], &received.to_be_bytes(), "in order");
                    received += 1;
                    held.push(batch);
                }
            }
            _ => {
                if !held.is_empty() {
                    held.remove(rng.random_range(0..held.len()));
                }
            }
        }
        let state = a.credit_state();
        assert_eq!(state.total(), 3, "{state:?}");
    }
    assert!(sent > 100 && received > 100);
}

#[tokio::test]
async fn fail_wakes_every_waiter_on_both_ends_with_the_dead_epoch() {
    let (a, b) = pair(Epoch(42), config(1));
    let buf = a.reserve().await.expect("credit");
    a.post(buf, 0).expect("posted");

    let waiting_reserve = tokio::spawn({
        let a = a.clone();
        async move { a.reserve().await.map(|_| ()) }
    });
    let waiting_recv = tokio::spawn({
        let a = a.clone();
        async move { a.recv().await.map(|_| ()) }
    });
    let waiting_ended = tokio::spawn({
        let b = b.clone();
        async move { b.ended().await }
    });
    settle().await;

    b.fail(EpochEnd::Fault(super::super::LinkFault::Injected));

    let ended_a = LinkError::Ended {
        epoch: Epoch(42),
        reason: EpochEnd::PeerClosed,
    };
    assert_eq!(waiting_reserve.await.expect("task"), Err(ended_a));
    assert_eq!(waiting_recv.await.expect("task"), Err(ended_a));
    let reason_b = EpochEnd::Fault(super::super::LinkFault::Injected);
    assert_eq!(waiting_ended.await.expect("task"), reason_b);

    // The batch b had already received is still delivered, then the error.
    let delivered = b
        .recv()
        .await
        .expect("completed receive survives the failure");
    assert_eq!(delivered.len(), 0);
    assert_eq!(
        b.recv().await.unwrap_err(),
        LinkError::Ended {
            epoch: Epoch(42),
            reason: reason_b
        }
    );
    assert!(matches!(
        a.reserve().await,
        Err(LinkError::Ended {
            epoch: Epoch(42),
            ..
        })
    ));
    let first_reason_wins = EpochEnd::Closed;
    a.fail(first_reason_wins);
    assert_eq!(a.ended().await, EpochEnd::PeerClosed);
}

#[tokio::test]
async fn oversized_post_is_refused() {
    let (a, _b) = pair(Epoch(1), config(1));
    let buf = a.reserve().await.expect("credit");
    assert_eq!(
        a.post(buf, 257).unwrap_err(),
        LinkError::BatchTooLarge { len: 257, max: 256 }
    );
    // The refused buffer's credit came back.
    assert_eq!(a.credit_state().held, 1);
}

#[tokio::test]
async fn a_post_into_an_ended_epoch_keeps_its_credit() {
    let (a, _b) = pair(Epoch(1), config(2));
    let buf = a.reserve().await.expect("credit");
    a.fail(EpochEnd::PeerLost);
    assert!(matches!(
        a.post(buf, 8),
        Err(LinkError::Ended {
            reason: EpochEnd::PeerLost,
            ..
        })
    ));
    assert_eq!(a.credit_state().held, 2);
}

mod node {
    use std::time::Duration;

    use bytes::Bytes;

    use crate::link::Node;
    use crate::link::mem::MemFabric;
    use crate::mux::protocol::Epoch;
    use crate::mux::{
        DropReason, Frame, MuxConfig, MuxTransport, PeerId, SendError, SlotSender, StreamKey,
    };

    const A: PeerId = PeerId(1);
    const B: PeerId = PeerId(2);

    async fn sent_until_ended(tx: &mut SlotSender) -> SendError {
        loop {
            if let Err(err) = tx.send(Bytes::from_static(b"more")).await {
                return err;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// An unregistered peer is not dialled again until it is registered
    /// again: a slot opened in between waits, and its record goes once the
    /// peer is back. The live link's slot ends with its epoch.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unregistered_peer_is_not_dialled_until_registered_again() {
        let bounded = tokio::time::timeout(Duration::from_secs(20), async {
            let fabric = MemFabric::new(crate::link::mem::MemConfig::default());
            let a = fabric.node(A, MuxConfig::default());
            let b = fabric.node(B, MuxConfig::default());
            let (first, second) = (StreamKey::new(9, 1), StreamKey::new(9, 2));
            let (mut rx1, mut rx2) = (
                b.mux().bind(first).expect("bind"),
                b.mux().bind(second).expect("bind"),
            );
            assert_eq!(a.register(&b.address()), Ok(B));
            let mut tx1 = a.mux().open(B, first).expect("open");
            tx1.send(Bytes::from_static(b"one")).await.expect("send");
            assert_eq!(
                rx1.recv().await,
                Some(Frame::Data(Bytes::from_static(b"one")))
            );

            a.unregister(B);
            assert_eq!(
                sent_until_ended(&mut tx1).await,
                SendError::Dropped(DropReason::EpochEnded { epoch: Epoch(1) })
            );
            let mut tx2 = a.mux().open(B, second).expect("open");
            tx2.send(Bytes::from_static(b"two")).await.expect("queued");
            let waited = tokio::time::timeout(Duration::from_millis(1_500), rx2.recv()).await;
            assert!(waited.is_err(), "a forgotten peer was dialled: {waited:?}");
            assert!(fabric.link(A, B).is_some_and(|link| link.is_ended()));

            assert_eq!(a.register(&b.address()), Ok(B));
            assert_eq!(
                rx2.recv().await,
                Some(Frame::Data(Bytes::from_static(b"two")))
            );
            assert_eq!(a.mux().epoch(B), Some(Epoch(2)));
        })
        .await;
        bounded.expect("timed out");
    }

    /// A slot waiting for a link to a peer that is not on the fabric ends
    /// with `Dropped(Unregistered)` when the peer is unregistered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slot_waiting_for_an_unregistered_peer_ends() {
        let bounded = tokio::time::timeout(Duration::from_secs(20), async {
            let fabric = MemFabric::new(crate::link::mem::MemConfig::default());
            let a = fabric.node(A, MuxConfig::default());
            let absent = PeerId(77);
            assert_eq!(a.register(&absent.0.to_be_bytes()), Ok(absent));
            let mut tx = a.mux().open(absent, StreamKey::new(9, 3)).expect("open");
            tx.send(Bytes::from_static(b"never")).await.expect("queued");
            a.unregister(absent);
            assert_eq!(
                sent_until_ended(&mut tx).await,
                SendError::Dropped(DropReason::Unregistered)
            );
        })
        .await;
        bounded.expect("timed out");
    }

    /// The connector's word that a peer is unreachable for good ends the
    /// slots already waiting for a link to it with `Dropped(Unreachable)`;
    /// one opened after waits, and a live epoch makes the word nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slot_waiting_for_an_unreachable_peer_ends_and_a_later_one_waits() {
        let bounded = tokio::time::timeout(Duration::from_secs(20), async {
            let fabric = MemFabric::new(crate::link::mem::MemConfig::default());
            let a = fabric.node(A, MuxConfig::default());
            let absent = PeerId(77);
            assert_eq!(a.register(&absent.0.to_be_bytes()), Ok(absent));
            let mut early = a.mux().open(absent, StreamKey::new(9, 3)).expect("open");
            early
                .send(Bytes::from_static(b"never"))
                .await
                .expect("queued");
            let dropped = a.mux().stats().slots_dropped;
            a.mux().peer_unreachable(absent);
            assert_eq!(
                sent_until_ended(&mut early).await,
                SendError::Dropped(DropReason::Unreachable)
            );
            // Counted just after the close.
            while a.mux().stats().slots_dropped == dropped {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert_eq!(a.mux().stats().slots_dropped, dropped + 1);
            let mut later = a.mux().open(absent, StreamKey::new(9, 4)).expect("open");
            later
                .send(Bytes::from_static(b"wait"))
                .await
                .expect("queued");
            let waited = tokio::time::timeout(Duration::from_millis(200), later.closed()).await;
            assert!(
                waited.is_err(),
                "a slot opened after the word ended: {waited:?}"
            );

            // With an epoch up the peer is reachable: its slots go on.
            let b = fabric.node(B, MuxConfig::default());
            assert_eq!(a.register(&b.address()), Ok(B));
            let mut rx = b.mux().bind(StreamKey::new(9, 5)).expect("bind");
            let mut tx = a.mux().open(B, StreamKey::new(9, 5)).expect("open");
            tx.send(Bytes::from_static(b"one")).await.expect("queued");
            assert_eq!(
                rx.recv().await,
                Some(Frame::Data(Bytes::from_static(b"one")))
            );
            a.mux().peer_unreachable(B);
            tx.send(Bytes::from_static(b"two"))
                .await
                .expect("still open");
            assert_eq!(
                rx.recv().await,
                Some(Frame::Data(Bytes::from_static(b"two")))
            );
        })
        .await;
        bounded.expect("timed out");
    }
}
