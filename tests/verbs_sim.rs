//! The provider-generic verbs suite over the soft provider's simulated
//! network, plus seeded fault runs (loss, duplication, reordering, ACK delay).
//!
//! `QPMUX_SIM_SEEDS=N` runs N fault seeds (default 20); `QPMUX_SIM_SEED=S`
//! replays one. A failing seed prints its number.

#[macro_use]
mod verbs_suite;

use std::time::Duration;

use qpmux::verbs::soft::sim::{DriveOutcome, LinkConfig, SimNet};
use qpmux::verbs::soft::{SoftConfig, SoftDevice};
use verbs_suite::{BulkPlan, Harness, Params};

struct SimHarness {
    net: SimNet,
    max_steps: usize,
}

impl SimHarness {
    fn new(seed: u64) -> SimHarness {
        SimHarness {
            net: SimNet::new(seed),
            max_steps: 20_000_000,
        }
    }

    fn faulty(seed: u64) -> SimHarness {
        let mut h = SimHarness::new(seed);
        h.net.set_default_link(LinkConfig {
            delay: Duration::from_micros(20),
            jitter: Duration::ZERO,
            reorder: 0.05,
            reorder_delay: Duration::from_micros(30),
            loss: 0.05,
            duplicate: 0.05,
            ack_delay: Duration::from_micros(50),
            partitioned: false,
            ..LinkConfig::default()
        });
        h
    }
}

impl Harness for SimHarness {
    type Dev = SoftDevice;

    async fn devices(&mut self) -> (SoftDevice, SoftDevice) {
        let a = self.net.add_device(SoftConfig::default());
        let b = self.net.add_device(SoftConfig::default());
        (a, b)
    }

    async fn wait_until(&mut self, done: impl FnMut() -> bool) -> bool {
        match self.net.drive_until(self.max_steps, done) {
            DriveOutcome::Reached => true,
            DriveOutcome::Idle => false,
            DriveOutcome::BoundExceeded => panic!("simulation did not settle: livelock?"),
        }
    }

    fn rnr_naks_sent(dev: &SoftDevice) -> Option<u64> {
        Some(dev.counters().rnr_naks_sent)
    }

    fn bulk_plan(&self) -> BulkPlan {
        if cfg!(debug_assertions) {
            BulkPlan {
                count: 10_000,
                max_size: 256 << 10,
                big_every: 1000,
                small_max: 2048,
            }
        } else {
            BulkPlan {
                count: 10_000,
                max_size: 1 << 20,
                big_every: 250,
                small_max: 4096,
            }
        }
    }
}

verbs_suite!(SimHarness::new(1));

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("QPMUX_SIM_SEED") {
        return vec![s.parse().expect("QPMUX_SIM_SEED is a u64")];
    }
    let n = std::env::var("QPMUX_SIM_SEEDS")
        .ok()
        .map(|s| s.parse().expect("QPMUX_SIM_SEEDS is a count"))
        .unwrap_or(20);
    (0..n).collect()
}

/// Prints the seed when the run panics.
struct SeedGuard(u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "failing simulation seed: {} (replay: QPMUX_SIM_SEED={})",
                self.0, self.0
            );
        }
    }
}

fn fault_plan() -> BulkPlan {
    BulkPlan {
        count: 10_000,
        max_size: 8 << 10,
        big_every: 500,
        small_max: 256,
    }
}

#[tokio::test]
async fn messages_survive_loss_duplication_reordering_and_ack_delay() {
    for seed in seeds() {
        let _guard = SeedGuard(seed);
        let mut h = SimHarness::faulty(seed);
        let params = Params {
            retry_cnt: 7,
            timeout: 8,
            ..Params::default()
        };
        verbs_suite::many_messages(&mut h, fault_plan(), params).await;
        let stats = h.net.stats();
        assert!(
            stats.dropped > 0 && stats.duplicated > 0,
            "faults were injected: {stats:?}"
        );
    }
}

#[tokio::test]
async fn a_full_recv_cq_refuses_the_message_it_would_lose() {
    verbs_suite::a_full_recv_cq_refuses_the_message_it_would_lose(&mut SimHarness::new(1)).await;
}

#[tokio::test]
async fn same_seed_same_run() {
    let mut traces = Vec::new();
    for _ in 0..2 {
        let mut h = SimHarness::faulty(42);
        let plan = BulkPlan {
            count: 300,
            ..fault_plan()
        };
        let params = Params {
            retry_cnt: 7,
            timeout: 8,
            ..Params::default()
        };
        verbs_suite::many_messages(&mut h, plan, params).await;
        traces.push((h.net.now(), h.net.stats()));
    }
    assert_eq!(traces[0], traces[1]);
}

#[tokio::test]
async fn partition_then_heal_within_retries_delivers() {
    let mut h = SimHarness::new(3);
    let (mut a, mut b) = verbs_suite::connect(
        &mut h,
        Params {
            retry_cnt: 7,
            timeout: 10,
            ..Params::default()
        },
    )
    .await;
    b.post_recv(1, 0, 64);
    h.net.set_partition(0, 1, true);
    a.post_send(1, 0, 8, None, true).expect("send");
    // Two local ACK timeouts pass in the partition, then it heals.
    let until = h.net.now() + Duration::from_millis(10);
    let net = &mut h.net;
    while net.now() < until && net.step() {}
    net.set_partition(0, 1, false);
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 1, 0).await);
    assert_eq!(a.sends[0].status, qpmux::verbs::WcStatus::Success);
    assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, 1).await);
}

/// The fault harness's relay impairment (docs/faults.md), both directions:
/// 1% loss, 1% duplication, 1% held back 3 ms, 0–5 ms per-packet jitter
/// (which reorders most packets).
fn relay_impairment(seed: u64) -> SimHarness {
    let mut h = SimHarness::new(seed);
    h.net.set_default_link(LinkConfig {
        delay: Duration::from_micros(50),
        jitter: Duration::from_millis(5),
        reorder: 0.01,
        reorder_delay: Duration::from_millis(3),
        loss: 0.01,
        duplicate: 0.01,
        ack_delay: Duration::ZERO,
        partitioned: false,
        packet_gap: Duration::from_micros(
            std::env::var("QPMUX_SIM_PACKET_GAP_US")
                .map_or(0, |s| s.parse().expect("QPMUX_SIM_PACKET_GAP_US is µs")),
        ),
        max_backlog: Duration::from_millis(2),
    });
    h
}

/// Default RC settings (timeout 14 ≈ 67 ms, retry_cnt 7) under the relay's
/// impairment: no RETRY_EXC_ERR, every message once and in order.
/// `QPMUX_SIM_REORDER_MESSAGES=N` sizes the run (default 1,000 per seed,
/// seeds 0 and 1, or `QPMUX_SIM_SEED`; `QPMUX_SIM_PACKET_GAP_US=G` limits
/// each direction to one packet per G µs with 2 ms of queue); it prints
/// virtual time and packets sent, the goodput measurement of
/// docs/soft-provider.md.
#[tokio::test]
async fn heavy_reordering_with_loss_never_exhausts_retries() {
    let count = std::env::var("QPMUX_SIM_REORDER_MESSAGES")
        .ok()
        .map(|s| s.parse().expect("QPMUX_SIM_REORDER_MESSAGES is a count"))
        .unwrap_or(1_000);
    let seeds = match std::env::var("QPMUX_SIM_SEED") {
        Ok(s) => vec![s.parse().expect("QPMUX_SIM_SEED is a u64")],
        Err(_) => vec![0, 1],
    };
    for seed in seeds {
        let _guard = SeedGuard(seed);
        let mut h = relay_impairment(seed);
        // Up to 8 packets a message and 16 messages in flight: the requester's
        // 128-PSN window fills, as in the soak.
        let plan = BulkPlan {
            count,
            max_size: 16 << 10,
            big_every: 7,
            small_max: 8 << 10,
        };
        let params = Params {
            retry_cnt: 7,
            timeout: 14,
            ..Params::default()
        };
        verbs_suite::many_messages(&mut h, plan, params).await;
        let stats = h.net.stats();
        assert!(stats.dropped > 0 && stats.duplicated > 0, "{stats:?}");
        eprintln!(
            "seed {seed}: {count} messages in {:?} virtual, {stats:?}",
            h.net.now()
        );
    }
}

/// A receiver without posted receives for 3 s under the relay impairment:
/// with rnr_retry = 7 the sender waits it out. Each lost RNR NAK (or lost
/// resend after an RNR wait) costs one local ACK timeout; before RNR NAKs
/// restored the retry budget, 8 of those over the stall ended the QP with
/// RETRY_EXC_ERR (4 of 5 seeds).
#[tokio::test]
async fn long_receiver_stall_under_loss_waits_on_rnr_not_retry_exceeded() {
    use qpmux::verbs::QueuePair;
    for seed in 0..5u64 {
        let _guard = SeedGuard(seed);
        let mut h = relay_impairment(seed);
        let params = Params {
            retry_cnt: 7,
            timeout: 14,
            min_rnr_timer: 12,
            ..Params::default()
        };
        let (mut a, mut b) = verbs_suite::connect(&mut h, params).await;
        for i in 0..8u64 {
            a.post_send(i, i as usize * 64, 64, Some(i as u32), true)
                .expect("post_send");
        }
        let until = h.net.now() + Duration::from_secs(3);
        while h.net.now() < until && h.net.step() {}
        a.poll();
        assert!(a.sends.is_empty(), "nothing completes during the stall");
        for i in 0..8u64 {
            b.post_recv(i, i as usize * 64, 64);
        }
        assert!(verbs_suite::wait_wcs(&mut h, &mut a, 8, 0).await);
        assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, 8).await);
        for (i, wc) in a.sends.iter().enumerate() {
            assert_eq!(wc.status, qpmux::verbs::WcStatus::Success, "send {i}");
        }
        for (i, wc) in b.recvs.iter().enumerate() {
            assert_eq!(wc.status, qpmux::verbs::WcStatus::Success, "recv {i}");
            assert_eq!(wc.imm, Some(i as u32), "in order");
        }
        assert_eq!(a.qp.state(), qpmux::verbs::QpState::Rts);
        assert_eq!(b.qp.state(), qpmux::verbs::QpState::Rts);
        assert!(h.net.stats().dropped > 0);
    }
}
