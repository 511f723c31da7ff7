//! A stalled consumer under a fast producer: node B binds S slots and stops
//! reading; node A's producers send as fast as they can. Over the stall the
//! process's resident memory (/proc/self/status VmRSS, both nodes live in
//! this process) may grow by no more than the configured budgets plus the
//! link's rings plus a stated slack; the producers are back-pressured (their
//! sends pend, nothing is dropped or fails). When the consumer resumes,
//! every record arrives in order. Twice: 4 KiB records, and 12-byte ones,
//! where what each record costs beyond its bytes (a queue entry, an
//! allocation) would dominate if the budgets counted bytes alone.
//!
//! Stall length: `QPMUX_STALL_SECS` (default 3). Results:
//! docs/reliability-inproc.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::Node;
use qpmux::link::rdma::{RdmaConfig, RdmaNodeConfig, RdmaTransport};
use qpmux::mux::{Frame, MuxConfig, MuxTransport, PeerId, RECORD_OVERHEAD, StreamKey, Terminal};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;

type Transport = RdmaTransport<SoftDevice>;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const SLOTS: u64 = 4;
const RECV_DEPTH: usize = 16;
const SEND_BUFFERS: usize = 8;
const MAX_BATCH: usize = 16 * 1024;
/// Allocator arenas, tokio and the test's own bookkeeping: not a budget,
/// a stated allowance (measured growth is reported next to it).
const SLACK: u64 = 16 << 20;

/// The records and the budgets of one run.
#[derive(Clone, Copy)]
struct Shape {
    /// Record length, at least 12 (slot and sequence number).
    record: usize,
    /// Records per slot: many times what the budgets let through.
    records: u32,
    slot_window: u32,
    slot_budget: usize,
    peer_budget: usize,
    /// The stall, in multiples of `QPMUX_STALL_SECS`: time to fill the
    /// budgets in the first half (a slower fill stretches the stall).
    stall_factor: u32,
}

const LARGE: Shape = Shape {
    record: 4 * 1024,
    records: 1024,
    slot_window: 64 * 1024,
    slot_budget: 256 * 1024,
    peer_budget: 1024 * 1024,
    stall_factor: 1,
};

/// Budgets that, counted in bytes alone, would let the producers queue
/// 1.4 million records (some 90 MiB) and the receiver hold 350,000.
const TINY: Shape = Shape {
    record: 12,
    records: 128 * 1024,
    slot_window: 1024 * 1024,
    slot_budget: 4 * 1024 * 1024,
    peer_budget: 16 * 1024 * 1024,
    stall_factor: 2,
};

/// Both runs measure the process's RSS: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn config(id: PeerId, shape: Shape) -> RdmaNodeConfig {
    RdmaNodeConfig {
        rdma: RdmaConfig {
            recv_depth: RECV_DEPTH,
            max_batch: MAX_BATCH,
            send_buffers: SEND_BUFFERS,
            ..RdmaConfig::strict()
        },
        mux: MuxConfig {
            slot_window: shape.slot_window,
            slot_budget: shape.slot_budget,
            peer_budget: shape.peer_budget,
            ..MuxConfig::default()
        },
        ..RdmaNodeConfig::new(id)
    }
}

async fn transport(id: PeerId, shape: Shape) -> Transport {
    let device = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback");
    RdmaTransport::start(device, config(id, shape))
        .await
        .expect("bind")
}

/// Resident set size in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS line");
    kib * 1024
}

fn record(shape: Shape, slot: u64, n: u32) -> Bytes {
    let mut v = vec![(n % 251) as u8; shape.record];
    v[..8].copy_from_slice(&slot.to_be_bytes());
    v[8..12].copy_from_slice(&n.to_be_bytes());
    Bytes::from(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_back_pressures_the_producer_within_the_byte_budgets() {
    let _alone = ONE_AT_A_TIME.lock().await;
    stall_then_resume(LARGE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_records_to_a_stalled_consumer_stay_within_the_budgets() {
    let _alone = ONE_AT_A_TIME.lock().await;
    stall_then_resume(TINY).await;
}

async fn stall_then_resume(shape: Shape) {
    let Shape {
        record: record_len,
        records,
        slot_window,
        slot_budget,
        peer_budget,
        stall_factor,
    } = shape;
    let stall = Duration::from_secs(
        std::env::var("QPMUX_STALL_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3),
    ) * stall_factor;
    let a = transport(A, shape).await;
    let b = transport(B, shape).await;
    assert_eq!(a.register(&b.address()), Ok(B));
    assert_eq!(b.register(&a.address()), Ok(A));

    let mut receivers = Vec::new();
    let mut senders = Vec::new();
    for s in 0..SLOTS {
        let key = StreamKey::new(7, s);
        receivers.push(b.mux().bind(key).expect("bind"));
        senders.push(a.mux().open(B, key).expect("open"));
    }
    // Link up and every slot open before the baseline.
    for (s, tx) in senders.iter_mut().enumerate() {
        tx.send(record(shape, s as u64, 0)).await.expect("send");
    }
    for rx in &mut receivers {
        assert!(matches!(rx.recv().await, Some(Frame::Data(_))));
    }
    let baseline = rss();

    let accepted = Arc::new(AtomicU64::new(0));
    let producers: Vec<_> = senders
        .into_iter()
        .enumerate()
        .map(|(s, mut tx)| {
            let accepted = accepted.clone();
            tokio::spawn(async move {
                for n in 1..records {
                    tx.send(record(shape, s as u64, n)).await?;
                    // Counted as the budgets count it.
                    accepted.fetch_add((record_len + RECORD_OVERHEAD) as u64, Ordering::Relaxed);
                }
                tx.finish(Terminal::Finalized)
            })
        })
        .collect();

    // The stall: nobody reads on B. The no-progress window (half the
    // stall) starts once the budgets are all but full, so a slow machine
    // filling them late is not mistaken for a leak.
    let record_cost = record_len + RECORD_OVERHEAD;
    // The producers' queues can hold the whole peer budget, so the fill
    // line below is reachable.
    assert!(SLOTS as usize * slot_budget >= peer_budget);
    let nearly_full = (peer_budget + SLOTS as usize * (slot_window as usize - record_cost)) as u64;
    let mut peak = baseline;
    let mut window: Option<(u64, tokio::time::Instant)> = None;
    let mut filled_at = None;
    let start = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        peak = peak.max(rss());
        let now = tokio::time::Instant::now();
        let so_far = accepted.load(Ordering::Relaxed);
        if filled_at.is_none() && so_far >= nearly_full {
            filled_at = Some(now);
        }
        // The last records of the fill land microseconds after the line;
        // a second is a wide margin.
        let settled = filled_at.is_some_and(|at| now >= at + Duration::from_secs(1));
        if window.is_none() && settled && now >= start + stall / 2 {
            window = Some((so_far, now));
        }
        if window.is_some_and(|(_, from)| now >= from + stall / 2) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the budgets never filled: {so_far} of {nearly_full} bytes accepted"
        );
    }
    let halfway = window.map(|(accepted, _)| accepted);
    let at_end = accepted.load(Ordering::Relaxed);
    let stats = a.mux().stats();
    assert!(
        producers.iter().all(|p| !p.is_finished()),
        "producers wait, none failed"
    );
    assert_eq!(
        halfway,
        Some(at_end),
        "no progress once the budgets are full and the consumer stalls"
    );
    assert!(stats.withheld_bytes > 0, "sends pending: {stats:?}");
    assert_eq!(stats.slots_dropped, 0);
    assert_eq!(b.mux().stats().slots_dropped, 0);
    let accepted_bound =
        (peer_budget + SLOTS as usize * (slot_window as usize + record_cost)) as u64;
    assert!(
        at_end <= accepted_bound,
        "accepted {at_end} bytes (counted with the overhead), budgets allow {accepted_bound}"
    );

    let budgets = peer_budget
        + SLOTS as usize * (slot_budget + slot_window as usize)
        + 2 * (config(A, shape).pool_bytes() + config(A, shape).rdma.ring_bytes());
    let bound = budgets as u64 + SLACK;
    let growth = peak.saturating_sub(baseline);
    eprintln!(
        "stalled_consumer: {record_len}-byte records, stall {} s, accepted {} records ({} KiB \
         counted) then pending, RSS baseline {} KiB, peak growth {} KiB, bound {} KiB \
         (budgets {} KiB + slack {} KiB)",
        stall.as_secs(),
        at_end / record_cost as u64,
        at_end / 1024,
        baseline / 1024,
        growth / 1024,
        bound / 1024,
        budgets / 1024,
        SLACK / 1024,
    );
    assert!(growth <= bound, "RSS grew {growth} bytes, bound {bound}");

    // Resume: everything arrives, in order, then the terminal.
    let consumers: Vec<_> = receivers
        .into_iter()
        .enumerate()
        .map(|(s, mut rx)| {
            tokio::spawn(async move {
                let mut next = 1u32;
                loop {
                    match rx.recv().await {
                        Some(Frame::Data(d)) => {
                            assert_eq!(d[..8], (s as u64).to_be_bytes());
                            assert_eq!(u32::from_be_bytes(d[8..12].try_into().unwrap()), next);
                            next += 1;
                        }
                        Some(Frame::Finalized) => return next,
                        other => panic!("slot {s}: unexpected {other:?}"),
                    }
                }
            })
        })
        .collect();
    tokio::time::timeout(Duration::from_secs(60), async {
        for p in producers {
            p.await.expect("producer").expect("no send failed");
        }
        for c in consumers {
            assert_eq!(c.await.expect("consumer"), records);
        }
    })
    .await
    .expect("the resumed consumer drains everything");
    assert_eq!(a.mux().stats().slots_dropped, 0);
}
