//! Repeated QP deaths while streaming: two `RdmaTransport` nodes on soft
//! RoCEv2 devices (loopback UDP), S slots streaming from A to B; each round
//! moves a QP to ERR through the provider's fault hook (A's, B's, or both)
//! and checks that every live slot got exactly one `Dropped` for that epoch,
//! that the next round runs on a newer epoch, and at the end that no QP, MR,
//! tokio task or file descriptor leaked.
//!
//! Rounds: `QPMUX_QP_DEATHS` (default [`DEFAULT_ROUNDS`]). Waits are on
//! state; each round's timeout only turns a hang into a failure.
//! Results: docs/reliability-inproc.md.

use std::time::{Duration, Instant};

use bytes::Bytes;
use qpmux::link::rdma::{RdmaConfig, RdmaNodeConfig, RdmaTransport};
use qpmux::link::{Link, Node};
use qpmux::mux::{DropReason, Epoch, Frame, MuxTransport, PeerId, SendError, StreamKey};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;

type Transport = RdmaTransport<SoftDevice>;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
/// Slots streaming in every round.
const SLOTS: u64 = 8;
/// Rounds when `QPMUX_QP_DEATHS` is unset (CI).
const DEFAULT_ROUNDS: u64 = 60;
const ROUND_TIMEOUT: Duration = Duration::from_secs(30);

fn config(id: PeerId) -> RdmaNodeConfig {
    RdmaNodeConfig {
        rdma: RdmaConfig {
            recv_depth: 16,
            max_batch: 16 * 1024,
            send_buffers: 8,
            ..RdmaConfig::strict()
        },
        ..RdmaNodeConfig::new(id)
    }
}

async fn transport(id: PeerId) -> Transport {
    let device = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback");
    RdmaTransport::start(device, config(id))
        .await
        .expect("bind")
}

async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn record(n: u32) -> Bytes {
    let mut v = vec![(n % 251) as u8; 64 + (n as usize * 37) % 1500];
    v[..4].copy_from_slice(&n.to_be_bytes());
    Bytes::from(v)
}

fn seq_of(b: &Bytes) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}

/// Which QP the round moves to ERR.
#[derive(Clone, Copy, Debug)]
enum Victim {
    Sender,
    Receiver,
    Both,
}

/// What must come back to its value before the rounds once they are over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Resources {
    qps: (usize, usize),
    mrs: (usize, usize),
    /// Send-pool chunks held plus free (each node's pool size unless one was
    /// lost or returned twice), and links holding a lease on it.
    pool: ((usize, usize), (usize, usize)),
    tasks: usize,
    fds: usize,
}

fn resources(a: &Transport, b: &Transport) -> Resources {
    Resources {
        qps: (a.device().qp_count(), b.device().qp_count()),
        mrs: (a.device().mr_count(), b.device().mr_count()),
        pool: (pool(a), pool(b)),
        tasks: tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks(),
        fds: std::fs::read_dir("/proc/self/fd").expect("procfs").count(),
    }
}

fn pool(t: &Transport) -> (usize, usize) {
    let p = t.pool_stats();
    (p.in_use + p.free, p.leases)
}

/// One round: S slots stream until `victim`'s QP dies under them. Returns
/// the epoch that died.
async fn round(
    a: &Transport,
    b: &Transport,
    n: u64,
    victim: Victim,
    dropped: &mut u64,
    phases: &mut [Duration; 3],
    spontaneous: &mut Vec<String>,
) -> Epoch {
    let t0 = Instant::now();
    let mut receivers = Vec::new();
    let mut producers = Vec::new();
    for s in 0..SLOTS {
        let key = StreamKey::new(n, s);
        receivers.push(b.mux().bind(key).expect("bind"));
        let mut tx = a.mux().open(B, key).expect("open");
        producers.push(tokio::spawn(async move {
            let mut next = 0u32;
            loop {
                if let Err(err) = tx.send(record(next)).await {
                    return (next, err);
                }
                next += 1;
                tokio::task::yield_now().await;
            }
        }));
    }
    // Every slot carries data on the current epoch before the fault, unless
    // the epoch died by itself first (counted and reported, not injected).
    let mut first_terminal = [false; SLOTS as usize];
    for (s, rx) in receivers.iter_mut().enumerate() {
        match rx.recv().await {
            Some(Frame::Data(d)) => assert_eq!(seq_of(&d), 0),
            Some(Frame::Dropped(DropReason::EpochEnded { .. })) => first_terminal[s] = true,
            other => panic!("round {n}: unexpected {other:?}"),
        }
    }
    let t1 = Instant::now();
    let a_link = a.node().link(B).expect("a's link");
    let b_link = b.node().link(A).expect("b's link");
    let epoch = a_link.epoch();
    assert_eq!(b_link.epoch(), epoch);
    let died_alone = first_terminal.contains(&true) || a_link.end_reason().is_some();
    if died_alone {
        until(|| a_link.end_reason().is_some() && b_link.end_reason().is_some()).await;
        let line = format!(
            "round {n}: epoch {epoch:?} died before the fault: A {:?}, B {:?}; counters A {:?}, B {:?}",
            a_link.end_reason(),
            b_link.end_reason(),
            a.device().counters(),
            b.device().counters()
        );
        eprintln!("{line}");
        spontaneous.push(line);
    } else {
        if matches!(victim, Victim::Sender | Victim::Both) {
            a_link.inject_qp_error().expect("QP to ERR");
        }
        if matches!(victim, Victim::Receiver | Victim::Both) {
            b_link.inject_qp_error().expect("QP to ERR");
        }
    }
    drop((a_link, b_link));

    for (s, rx) in receivers.iter_mut().enumerate() {
        let mut next = 1;
        let mut terminals = u32::from(first_terminal[s]);
        while let Some(frame) = rx.recv().await {
            match frame {
                Frame::Data(d) => {
                    assert_eq!(seq_of(&d), next, "round {n}: delivered prefix in order");
                    next += 1;
                }
                Frame::Dropped(DropReason::EpochEnded { epoch: e }) => {
                    assert_eq!(e, epoch, "round {n}");
                    terminals += 1;
                }
                other => panic!("round {n}: unexpected {other:?}"),
            }
        }
        assert_eq!(terminals, 1, "round {n} ({victim:?}): exactly one Dropped");
    }
    for p in producers {
        let (sent, err) = p.await.expect("producer");
        assert!(sent >= 1, "round {n}");
        assert_eq!(
            err,
            SendError::Dropped(DropReason::EpochEnded { epoch }),
            "round {n}"
        );
    }
    let t2 = Instant::now();
    *dropped += SLOTS;
    until(|| {
        a.mux().stats().slots_dropped >= *dropped && b.mux().stats().slots_dropped >= *dropped
    })
    .await;
    assert_eq!(
        a.mux().stats().slots_dropped,
        *dropped,
        "round {n}: none twice"
    );
    assert_eq!(
        b.mux().stats().slots_dropped,
        *dropped,
        "round {n}: none twice"
    );
    phases[0] += t1 - t0;
    phases[1] += t2 - t1;
    phases[2] += t2.elapsed();
    epoch
}

/// Streams one clean round (no fault) and waits until the link is idle.
async fn clean_round(a: &Transport, b: &Transport, n: u64) {
    for s in 0..SLOTS {
        let key = StreamKey::new(n, s);
        let mut rx = b.mux().bind(key).expect("bind");
        let mut tx = a.mux().open(B, key).expect("open");
        for i in 0..3 {
            tx.send(record(i)).await.expect("send");
        }
        tx.finish(qpmux::mux::Terminal::Finalized).expect("finish");
        for i in 0..3 {
            match rx.recv().await {
                Some(Frame::Data(d)) => assert_eq!(seq_of(&d), i),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(rx.recv().await, Some(Frame::Finalized));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_qp_deaths_drop_each_live_slot_once_and_leak_nothing() {
    let rounds: u64 = std::env::var("QPMUX_QP_DEATHS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ROUNDS);
    let a = transport(A).await;
    let b = transport(B).await;
    assert_eq!(a.register(&b.address()), Ok(B));
    assert_eq!(b.register(&a.address()), Ok(A));
    tokio::time::timeout(ROUND_TIMEOUT, clean_round(&a, &b, 0))
        .await
        .expect("first epoch");
    let before = resources(&a, &b);
    assert_eq!(before.qps, (1, 1), "one QP per side");
    let chunks = a.pool_stats().chunks;
    assert_eq!(
        before.pool,
        ((chunks, 1), (chunks, 1)),
        "one lease per side"
    );

    let started = Instant::now();
    let mut dropped = 0;
    let mut last = Epoch(0);
    // Open to first record (includes the reconnect), fault to every
    // terminal, counters settled.
    let mut phases = [Duration::ZERO; 3];
    // Epochs that ended before the round's fault (a finding, not a failure
    // of the invariant, which is checked for them too).
    let mut spontaneous = Vec::new();
    for n in 1..=rounds {
        let victim = match n % 3 {
            0 => Victim::Sender,
            1 => Victim::Receiver,
            _ => Victim::Both,
        };
        let epoch = tokio::time::timeout(
            ROUND_TIMEOUT,
            round(
                &a,
                &b,
                n,
                victim,
                &mut dropped,
                &mut phases,
                &mut spontaneous,
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("round {n} ({victim:?}) hung"));
        assert!(epoch > last, "round {n}: epoch {epoch:?} after {last:?}");
        last = epoch;
    }
    let elapsed = started.elapsed();
    // The next epoch streams; then everything of the dead ones is gone.
    tokio::time::timeout(ROUND_TIMEOUT, clean_round(&a, &b, rounds + 1))
        .await
        .expect("epoch after the last death");
    let settled = tokio::time::timeout(ROUND_TIMEOUT, async {
        loop {
            let now = resources(&a, &b);
            if now == before {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let after = resources(&a, &b);
    assert_eq!(
        settled.ok(),
        Some(before),
        "leaked: before {before:?}, after {after:?}"
    );

    let (sa, sb) = (a.mux().stats(), b.mux().stats());
    assert_eq!(sa.epoch_deaths, rounds, "{sa:?}");
    assert_eq!(sb.epoch_deaths, rounds, "{sb:?}");
    assert_eq!(sa.reconnect.count, rounds, "each death then a next epoch");
    let mean_us = sa.reconnect.total_us / rounds.max(1);
    eprintln!(
        "qp_deaths: {rounds} rounds x {SLOTS} slots in {:.1} s ({:.1} ms/round); \
         reconnect (A) mean {mean_us} us, max {} us, buckets {:?}; \
         phases per round (open→data, fault→terminals, counters) {:?}; \
         resources before = after = {before:?}; {} epochs died before their fault",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1000.0 / rounds.max(1) as f64,
        sa.reconnect.max_us,
        sa.reconnect.buckets,
        phases.map(|p| p / rounds.max(1) as u32),
        spontaneous.len(),
    );
}
