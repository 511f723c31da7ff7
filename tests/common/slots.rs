//! Records that carry their slot and sequence number, and the check every
//! epoch-death test makes on a receiver: an in-order prefix, then exactly
//! one `Dropped` for the dead epoch.

#![allow(dead_code)] // each test binary uses its own subset

use bytes::Bytes;
use qpmux::mux::{
    DropReason, Epoch, Frame, MuxTransport, PeerId, SlotReceiver, StreamKey, Terminal,
};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::task::JoinHandle;

/// A record of `len` bytes (at least 12) naming `slot` and sequence `n`.
pub fn record(slot: u64, n: u32, len: usize) -> Bytes {
    let mut v = vec![(n % 251) as u8; len.max(12)];
    v[..8].copy_from_slice(&slot.to_be_bytes());
    v[8..12].copy_from_slice(&n.to_be_bytes());
    Bytes::from(v)
}

/// The sequence number a [`record`] carries.
pub fn seq_of(b: &Bytes) -> u32 {
    u32::from_be_bytes(b[8..12].try_into().expect("4 bytes"))
}

/// Reads `rx` to its end: records numbered from 1 in order, then exactly one
/// `Dropped(EpochEnded { epoch })`. Returns how many records came first.
pub async fn prefix_then_one_dropped(rx: &mut SlotReceiver, epoch: Epoch) -> u32 {
    let mut next = 1;
    let mut dropped = 0;
    while let Some(frame) = rx.recv().await {
        match frame {
            Frame::Data(d) => {
                assert_eq!(seq_of(&d), next, "the delivered prefix is in order");
                next += 1;
            }
            Frame::Dropped(DropReason::EpochEnded { epoch: e }) => {
                assert_eq!(e, epoch);
                dropped += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(dropped, 1, "exactly one Dropped per slot");
    next - 1
}

/// Reads `rx` to its `Finalized`: records numbered from 0 in order, each
/// intact (every byte after the header is the fill [`record`] wrote).
/// Returns the records and bytes read.
pub async fn in_order_to_finalized(rx: &mut SlotReceiver) -> (u32, usize) {
    let mut next = 0u32;
    let mut bytes = 0usize;
    while let Some(frame) = rx.recv().await {
        match frame {
            Frame::Data(d) => {
                assert_eq!(seq_of(&d), next, "in order, exactly once");
                assert!(d[12..].iter().all(|&b| b == (next % 251) as u8), "intact");
                bytes += d.len();
                next += 1;
            }
            Frame::Finalized => return (next, bytes),
            other => panic!("unexpected {other:?}"),
        }
    }
    panic!("the stream ended without Finalized after {next} records");
}

/// What a producer does after each record.
pub enum Pause {
    No,
    Yield,
    Sleep(std::time::Duration),
}

/// A producer's records: `records` of them, record `n` of slot `slot`
/// `len(slot, n, rng)` bytes long and followed by `pause(rng)`, from a
/// generator seeded per stream.
#[derive(Clone, Copy)]
pub struct Traffic {
    pub records: u32,
    pub len: fn(u64, u32, &mut SmallRng) -> usize,
    pub pause: fn(&mut SmallRng) -> Pause,
}

/// No pause after any record.
pub fn never(_: &mut SmallRng) -> Pause {
    Pause::No
}

/// Stream `key` from `from` to `to` (whose id is `peer`): a consumer task
/// reading it to its `Finalized` ([`in_order_to_finalized`]), and a
/// producer task sending `traffic`'s records tagged `slot`, its generator
/// seeded with `seed`, then finishing the stream.
pub fn stream_tasks(
    from: &impl MuxTransport,
    to: &impl MuxTransport,
    peer: PeerId,
    key: StreamKey,
    (slot, seed): (u64, u64),
    traffic: Traffic,
) -> (JoinHandle<(u32, usize)>, JoinHandle<()>) {
    let mut rx = to.bind(key).expect("bind");
    let consumer = tokio::spawn(async move { in_order_to_finalized(&mut rx).await });
    let mut tx = from.open(peer, key).expect("open");
    let producer = tokio::spawn(async move {
        let mut rng = SmallRng::seed_from_u64(seed);
        for n in 0..traffic.records {
            let len = (traffic.len)(slot, n, &mut rng);
            tx.send(record(slot, n, len)).await.expect("send");
            match (traffic.pause)(&mut rng) {
                Pause::No => {}
                Pause::Yield => tokio::task::yield_now().await,
                Pause::Sleep(d) => tokio::time::sleep(d).await,
            }
        }
        tx.finish(Terminal::Finalized).expect("finish");
    });
    (consumer, producer)
}

/// 64 records of 1 KiB on one slot from `from` to `peer` (whose mux is
/// `to`), the consumer starting 200 ms late so the sender meets its slot
/// window first; every record must arrive in order, then `Finalized`, and
/// both sides stay in epoch 1 (no epoch died on the way).
pub async fn late_consumer_stream(
    from: &impl MuxTransport,
    from_id: PeerId,
    to: &impl MuxTransport,
    peer: PeerId,
    slot: u64,
) {
    let key = StreamKey::new(slot, slot);
    let mut rx = to.bind(key).expect("bind");
    let mut tx = from.open(peer, key).expect("open");
    let records = 64u32;
    let producer = tokio::spawn(async move {
        for n in 0..records {
            tx.send(record(slot, n, 1024)).await.expect("send");
        }
        tx.finish(Terminal::Finalized).expect("finish");
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(in_order_to_finalized(&mut rx).await.0, records);
    producer.await.expect("producer");
    assert_eq!(from.epoch(peer), Some(Epoch(1)), "no epoch died");
    assert_eq!(to.epoch(from_id), Some(Epoch(1)), "no epoch died");
}
