//! Records that carry their slot and sequence number, and the check every
//! epoch-death test makes on a receiver: an in-order prefix, then exactly
//! one `Dropped` for the dead epoch.

#![allow(dead_code)] // each test binary uses its own subset

use bytes::Bytes;
use qpmux::mux::{DropReason, Epoch, Frame, SlotReceiver};

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
