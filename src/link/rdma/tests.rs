//! Node-level checks of the registered-memory bound, the memlock preflight,
//! the node's metric export and the graceful close's
//! wait, on soft devices over loopback UDP.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::link::Node;
use crate::mux::{Frame, MuxTransport, PeerId, StreamKey, Terminal};
use crate::verbs::soft::SoftDevice;
use crate::verbs::soft::udp::UdpConfig;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const C: PeerId = PeerId(3);

fn small() -> RdmaConfig {
    RdmaConfig {
        recv_depth: 16,
        max_batch: 16 * 1024,
        send_buffers: 8,
        ..RdmaConfig::strict()
    }
}

async fn device() -> SoftDevice {
    SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback")
}

/// Chunks in the test nodes' send pools.
const POOL: usize = 6;

fn node_config(id: PeerId, max_registered: usize) -> RdmaNodeConfig {
    RdmaNodeConfig {
        rdma: small(),
        max_registered,
        pool_buffers: POOL,
        ..RdmaNodeConfig::new(id)
    }
}

async fn node(id: PeerId, max_registered: usize) -> RdmaTransport<SoftDevice> {
    let config = node_config(id, max_registered);
    RdmaTransport::start(device().await, config)
        .await
        .expect("start")
}

fn metric(t: &RdmaTransport<SoftDevice>, name: &str) -> Option<u64> {
    t.metrics()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

#[test]
fn one_link_end_registers_its_send_and_receive_buffers() {
    assert_eq!(small().registered_bytes(), 24 * 16 * 1024);
    assert_eq!(small().ring_bytes(), 16 * 16 * 1024, "on a node's pool");
    assert_eq!(node_config(A, 0).pool_bytes(), POOL * 16 * 1024);
    let absurd = RdmaConfig {
        max_batch: usize::MAX,
        ..small()
    };
    assert_eq!(absurd.registered_bytes(), usize::MAX, "saturates");
}

#[test]
fn the_preflight_names_the_ulimit_a_node_needs() {
    let config = RdmaNodeConfig::new(A);
    let err = config
        .memlock_preflight(Some(MemlockLimit::Bytes(8 << 20)))
        .expect_err("8 MiB < 1 GiB");
    assert_eq!(
        err,
        RdmaError::MemlockTooSmall {
            needed: DEFAULT_MAX_REGISTERED,
            limit: 8 << 20,
            needed_kib: 1 << 20,
        }
    );
    assert!(err.to_string().contains("ulimit -l 1048576"), "{err}");
    assert_eq!(
        config.memlock_preflight(Some(MemlockLimit::Unlimited)),
        Ok(())
    );
    assert_eq!(config.memlock_preflight(None), Ok(()), "no procfs: skipped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_pool_and_one_link_exceed_max_registered_does_not_start() {
    let first = node_config(A, 0).pool_bytes() + small().ring_bytes();
    let config = node_config(A, first - 1);
    let err = match RdmaTransport::start(device().await, config).await {
        Ok(_) => panic!("a link can never fit"),
        Err(err) => err,
    };
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    let text = err.to_string();
    assert!(text.contains("max_registered"), "{text}");
    assert!(text.contains(&first.to_string()), "{text}");
    let no_pool = RdmaNodeConfig {
        pool_buffers: 0,
        ..node_config(A, usize::MAX)
    };
    assert_eq!(
        no_pool.preflight(),
        Err(RdmaError::InvalidConfig {
            field: "pool_buffers",
            value: 0
        })
    );
}

/// Peers the node did not register (they only dialled in) hold at most
/// half of what the send pool leaves of `max_registered` with their links:
/// past it a stranger's dial is declined, and peers the node registered
/// still get links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_links_leave_half_of_max_registered_to_the_registered() {
    let pool = node_config(A, 0).pool_bytes();
    let ring = small().ring_bytes();
    assert!(pool < ring, "the arithmetic below");
    // Room for the pool and four rings and a half; strangers' half of
    // what the pool leaves: two rings and a quarter.
    let max = pool + 4 * ring + ring / 2;
    let a = node(A, max).await;
    let mut strangers = Vec::new();
    for id in 2..5 {
        let peer = node(PeerId(id), usize::MAX).await;
        assert_eq!(peer.register(&a.address()), Ok(A));
        strangers.push(peer);
    }
    for peer in &strangers[..2] {
        peer.node()
            .connect(A)
            .await
            .expect("within the strangers' half");
    }
    assert!(strangers[2].node().connect(A).await.is_err(), "past it");
    assert_eq!(
        a.last_resource_error(),
        Some(RdmaError::StrangersRegisteredLimit {
            needed: ring,
            in_use: 2 * ring,
            max: (max - pool) / 2,
        })
    );
    assert_eq!(
        metric(&a, "qpmux_registered_strangers_bytes"),
        Some(2 * ring as u64)
    );
    // Registered peers still get links, by their dial or by ours.
    let chosen = node(PeerId(9), usize::MAX).await;
    assert_eq!(a.register(&chosen.address()), Ok(PeerId(9)));
    assert_eq!(chosen.register(&a.address()), Ok(A));
    chosen
        .node()
        .connect(A)
        .await
        .expect("a registered peer's dial");
    let dialled = node(PeerId(10), usize::MAX).await;
    assert_eq!(a.register(&dialled.address()), Ok(PeerId(10)));
    a.node().connect(PeerId(10)).await.expect("our dial");
    assert_eq!(
        metric(&a, "qpmux_registered_bytes"),
        Some((pool + 4 * ring) as u64)
    );
    assert_eq!(
        metric(&a, "qpmux_registered_strangers_bytes"),
        Some(2 * ring as u64)
    );
}

/// The node's list: the mux's metrics and its own, each name once, every
/// one `qpmux_`-prefixed (the mux's own test sees only its half).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_metric_names_are_unique_and_prefixed() {
    let a = node(A, usize::MAX).await;
    let names: Vec<&str> = a.metrics().into_iter().map(|(name, _)| name).collect();
    let unique: std::collections::HashSet<&str> = names.iter().copied().collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    assert!(
        names.iter().all(|name| name.starts_with("qpmux_")),
        "{names:?}"
    );
    assert_eq!(metric(&a, "qpmux_receives_dropped_total"), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_is_counted_once_and_a_link_past_max_registered_is_refused() {
    let pool = node_config(A, 0).pool_bytes();
    let ring = small().ring_bytes();
    // Room for the pool and two receive rings, not three.
    let max = pool + 2 * ring + ring / 2;
    let a = node(A, max).await;
    assert_eq!(metric(&a, "qpmux_registered_bytes"), Some(pool as u64));
    assert_eq!(metric(&a, "qpmux_send_pool_chunks"), Some(POOL as u64));
    assert_eq!(a.device().mr_count(), 1, "the pool: one MR before any link");
    let b = node(B, usize::MAX).await;
    let c = node(C, usize::MAX).await;
    let d = node(PeerId(4), usize::MAX).await;
    for peer in [&b, &c, &d] {
        assert_eq!(a.register(&peer.address()), Ok(peer.node().id()));
        assert_eq!(peer.register(&a.address()), Ok(A));
    }
    a.node().connect(B).await.expect("the first link fits");
    a.node().connect(C).await.expect("the second link fits");
    let in_use = pool + 2 * ring;
    assert_eq!(metric(&a, "qpmux_registered_bytes"), Some(in_use as u64));
    assert_eq!(
        a.device().mr_count(),
        1 + 2 * small().recv_depth,
        "one pool MR, no send MR per link"
    );
    assert!(
        a.node().connect(PeerId(4)).await.is_err(),
        "the third does not"
    );
    assert_eq!(
        a.last_resource_error(),
        Some(RdmaError::RegisteredLimit {
            needed: ring,
            in_use,
            max,
        })
    );
    assert_eq!(d.device().qp_count(), 0, "refused before the handshake");
    assert_eq!(metric(&a, "qpmux_registered_max_bytes"), Some(max as u64));
    // B's link still streams.
    let key = StreamKey::new(1, 1);
    let mut rx = b.mux().bind(key).expect("bind");
    let mut tx = a.mux().open(B, key).expect("open");
    tx.send(bytes::Bytes::from_static(b"fits"))
        .await
        .expect("send");
    tx.finish(Terminal::Finalized).expect("finish");
    assert_eq!(rx.recv().await, Some(Frame::Data("fits".into())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_end_gives_its_bytes_back_when_its_resources_are_destroyed() {
    let dev = device().await;
    let link = small().registered_bytes();
    let budget = RegisteredBudget::new(link);
    let end = PreparedEnd::within(&dev, small(), &budget).expect("fits");
    assert_eq!(budget.in_use(), link);
    let refused = PreparedEnd::within(&dev, small(), &budget).err();
    assert_eq!(
        refused,
        Some(RdmaError::RegisteredLimit {
            needed: link,
            in_use: link,
            max: link
        })
    );
    assert_eq!(dev.qp_count(), 1, "nothing created for the refused end");
    drop(end);
    assert_eq!((budget.in_use(), dev.qp_count(), dev.mr_count()), (0, 0, 0));
    assert!(PreparedEnd::within(&dev, small(), &budget).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_failure_past_the_memlock_limit_is_reported_as_the_limit() {
    let epochs = RdmaEpochs::new(
        device().await,
        small(),
        crate::link::tcp::TcpLinkConfig::default(),
    );
    // No pool yet: the first link end needs the pool and its ring.
    let link = DEFAULT_POOL_BUFFERS * small().max_batch + small().ring_bytes();
    let verbs = RdmaError::Verbs(crate::verbs::VerbsError::DeviceClosed);
    let tight = Some(MemlockLimit::Bytes(link as u64 - 1));
    assert_eq!(
        epochs.explain(verbs.clone(), tight),
        RdmaError::MemlockTooSmall {
            needed: link,
            limit: link as u64 - 1,
            needed_kib: (link as u64).div_ceil(1024),
        }
    );
    let roomy = Some(MemlockLimit::Bytes(link as u64));
    assert_eq!(epochs.explain(verbs.clone(), roomy), verbs, "not the limit");
    assert_eq!(epochs.explain(verbs.clone(), None), verbs);
    let limit = RdmaError::RegisteredLimit {
        needed: 1,
        in_use: 0,
        max: 0,
    };
    assert_eq!(
        epochs.explain(limit.clone(), tight),
        limit,
        "only verbs failures"
    );
}

#[test]
fn a_graceful_close_waits_up_to_the_qps_own_retry_budget_within_bounds() {
    let with = |timeout, retry_cnt| {
        close_wait(&RdmaConfig {
            timeout,
            retry_cnt,
            ..RdmaConfig::default()
        })
    };
    // 4.096 µs × 2^14 ≈ 67 ms per try.
    assert_eq!(with(14, 7), Duration::from_nanos(4096 << 14) * 8);
    assert_eq!(with(14, 3), Duration::from_nanos(4096 << 14) * 4);
    assert_eq!(
        with(8, 1),
        GRACEFUL_CLOSE,
        "a short budget still gets the floor"
    );
    assert_eq!(with(20, 7), GRACEFUL_CLOSE_CAP, "a long one is capped");
    assert_eq!(with(0, 7), GRACEFUL_CLOSE_CAP, "timeout 0 is forever");
}

async fn send_bytes(link: &RdmaLink<SoftDevice>, payload: &[u8]) {
    let mut buf = link.reserve().await.expect("reserve");
    buf[..payload.len()].copy_from_slice(payload);
    link.post(buf, payload.len()).expect("post");
}

/// Makes the driver take a turn: a send does, unless a timer's turn came
/// first and the link has already ended, so a refused send is fine here.
async fn kick(link: &RdmaLink<SoftDevice>) {
    if let Ok(mut buf) = link.reserve().await {
        buf[..4].copy_from_slice(b"kick");
        link.post(buf, 4).ok();
    }
}

/// The link ends as `Internal`, and `recv` says so rather than waiting.
async fn ends_internal(link: &RdmaLink<SoftDevice>) {
    let ended = tokio::time::timeout(Duration::from_secs(10), link.ended()).await;
    assert_eq!(ended, Ok(EpochEnd::Internal));
    let recv = tokio::time::timeout(Duration::from_secs(10), link.recv()).await;
    assert!(matches!(
        recv,
        Ok(Err(LinkError::Ended {
            reason: EpochEnd::Internal,
            ..
        }))
    ));
}

async fn recv_bytes(link: &RdmaLink<SoftDevice>) -> Vec<u8> {
    let batch = tokio::time::timeout(Duration::from_secs(10), link.recv())
        .await
        .expect("a batch within 10 s")
        .expect("recv");
    batch.to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_handling_completions_ends_that_epoch_and_the_device_serves_on() {
    let (da, db) = (device().await, device().await);
    let (a1, b1) = pair(&da, &db, Epoch(1), small()).expect("first pair");
    let (a2, b2) = pair(&da, &db, Epoch(1), small()).expect("second pair");
    // Once a1's poller is parked (its CQ armed), the driver's handler takes
    // the next completion, so the panic is on the device's own task.
    until(|| a1.shared().cq.is_armed()).await;
    a1.shared()
        .panic_on_completion
        .store(true, Ordering::Relaxed);
    send_bytes(&b1, b"boom").await;
    ends_internal(&a1).await;
    // Counted once the driver's catch returns, after the link has ended.
    until(|| da.stats().cq_handler_panics > 0).await;
    assert_eq!(da.stats().cq_handler_panics, 1, "caught on the driver");

    // The driver serves on: the device's other QP carries batches both ways.
    send_bytes(&b2, b"after").await;
    assert_eq!(recv_bytes(&a2).await, b"after");
    send_bytes(&a2, b"back").await;
    assert_eq!(recv_bytes(&b2).await, b"back");
    assert!(a2.end_reason().is_none() && b2.end_reason().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_soft_driver_ends_every_epoch_on_the_device_and_a_new_driver_serves() {
    let (da, db) = (device().await, device().await);
    let (a1, b1) = pair(&da, &db, Epoch(1), small()).expect("first pair");
    let (a2, b2) = pair(&da, &db, Epoch(1), small()).expect("second pair");
    da.shared().core().panic_driver = true;
    kick(&a1).await;
    for link in [&a1, &a2] {
        let ended = tokio::time::timeout(Duration::from_secs(10), link.ended())
            .await
            .expect("every QP on the device fails");
        assert!(
            matches!(ended, EpochEnd::Fault(LinkFault::Completion { .. })),
            "{ended:?}"
        );
    }
    assert_eq!(da.stats().driver_panics, 1);
    drop((a1, a2, b1, b2));

    // A fresh driver serves the QPs made after.
    let (a3, b3) = pair(&da, &db, Epoch(2), small()).expect("third pair");
    send_bytes(&a3, b"after").await;
    assert_eq!(recv_bytes(&b3).await, b"after");
    send_bytes(&b3, b"back").await;
    assert_eq!(recv_bytes(&a3).await, b"back");
}

async fn until(mut done: impl FnMut() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    assert!(waited.await.is_ok(), "not within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_under_the_device_lock_elsewhere_ends_every_epoch_on_it_and_the_driver_serves_on() {
    let (da, db) = (device().await, device().await);
    let (a1, b1) = pair(&da, &db, Epoch(1), small()).expect("first pair");
    // A bug in a verbs call on some other task, under the device lock: the
    // core may be half-updated, so every QP on it goes to ERR.
    let shared = da.shared().clone();
    let poisoner = std::thread::spawn(move || {
        let _core = shared.core();
        panic!("a bug under the device lock");
    });
    assert!(poisoner.join().is_err());
    kick(&a1).await;
    let ended = tokio::time::timeout(Duration::from_secs(10), a1.ended()).await;
    assert!(
        matches!(ended, Ok(EpochEnd::Fault(LinkFault::Completion { .. }))),
        "{ended:?}"
    );
    assert_eq!(da.stats().driver_panics, 1);
    drop((a1, b1));
    let (a2, b2) = pair(&da, &db, Epoch(2), small()).expect("second pair");
    send_bytes(&a2, b"after").await;
    assert_eq!(recv_bytes(&b2).await, b"after");
    assert_eq!(da.stats().driver_panics, 1, "the poison was cleared");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_completion_poller_ends_that_epoch() {
    let (da, db) = (device().await, device().await);
    let (a1, b1) = pair(&da, &db, Epoch(1), small()).expect("pair");
    // Without the driver's handler (as on libibverbs) the poller task takes
    // every completion, so the panic is on it.
    a1.shared().cq.shared.disable_handler();
    // Two unsignaled SENDs hold their chunks until a completion retires them.
    send_bytes(&a1, b"one").await;
    send_bytes(&a1, b"two").await;
    assert_eq!(a1.send_pool().stats().in_use, 2);
    a1.shared()
        .panic_on_completion
        .store(true, Ordering::Relaxed);
    send_bytes(&b1, b"boom").await;
    ends_internal(&a1).await;
    assert_eq!(da.stats().cq_handler_panics, 0, "not on the driver");
    // Nothing polls the flushes now: the panic's own cleanup gives the
    // chunks back to the node's pool while the link is still held
    // (review 40c).
    tokio::time::timeout(
        Duration::from_secs(10),
        until(|| a1.send_pool().stats().in_use == 0),
    )
    .await
    .expect("the chunks go back to the pool");
    let theirs = tokio::time::timeout(Duration::from_secs(10), b1.ended()).await;
    assert!(theirs.is_ok(), "the peer's epoch ends too: {theirs:?}");
}

/// A receive depth past what the credit counters hold is refused by the
/// config check, not by an assertion when the link is built (review 40c).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_depth_past_the_credit_counters_is_an_invalid_config() {
    let dev = device().await;
    let too_deep = 1usize << 31;
    let config = RdmaConfig {
        recv_depth: too_deep,
        ..small()
    };
    assert!(matches!(
        PreparedEnd::new(&dev, config),
        Err(RdmaError::InvalidConfig {
            field: "recv_depth",
            value
        }) if value == too_deep
    ));
}

/// What a node's hello would announce past the peer's check (review 48b:
/// every peer refused it as malformed and the node redialled for ever) is
/// refused at start; the ceilings themselves start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_the_peers_hello_check_would_refuse_is_refused_at_start() {
    use crate::link::bootstrap::{RdmaEndpoint, TcpEndpoint};
    let deepest = RdmaEndpoint::MAX_RECV_DEPTH as usize;
    let widest = TcpEndpoint::MAX_BATCH as usize;
    let past = [
        (
            "recv_depth",
            RdmaConfig {
                recv_depth: deepest + 1,
                ..small()
            },
        ),
        (
            "max_batch",
            RdmaConfig {
                max_batch: widest + 1,
                ..small()
            },
        ),
        (
            "send_buffers",
            RdmaConfig {
                send_buffers: MAX_QUEUE + 1,
                ..small()
            },
        ),
        (
            "signal_every",
            RdmaConfig {
                signal_every: usize::MAX,
                ..small()
            },
        ),
    ];
    for (field, rdma) in past {
        let config = RdmaNodeConfig {
            rdma,
            ..node_config(A, usize::MAX)
        };
        assert!(
            matches!(config.preflight(), Err(RdmaError::InvalidConfig { field: f, .. }) if f == field),
            "{field}: {:?}",
            config.preflight()
        );
        match RdmaTransport::start(device().await, config).await {
            Ok(_) => panic!("{field}: a node no peer would accept started"),
            Err(err) => assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{field}"),
        }
    }
    let ceilings = [
        RdmaConfig {
            recv_depth: deepest,
            ..small()
        },
        RdmaConfig {
            max_batch: widest,
            ..small()
        },
        RdmaConfig {
            send_buffers: MAX_QUEUE,
            signal_every: MAX_QUEUE,
            ..small()
        },
    ];
    for rdma in ceilings {
        assert_eq!(rdma.validate(), Ok(()), "{rdma:?}");
    }
}

/// A peer whose receives are shorter than the `max_batch` it announced
/// refuses our SEND; that is the peer's fault, so the connector backs off
/// before redialling it (review 40c: it used to redial at once, a QP and
/// its receive buffers per cycle).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_the_peers_short_receive_refused_blames_the_peer() {
    let (da, db) = (device().await, device().await);
    let end_a = PreparedEnd::new(&da, small()).expect("a");
    let short = RdmaConfig {
        max_batch: 4096,
        ..small()
    };
    let end_b = PreparedEnd::new(&db, short).expect("b");
    let (addr_a, addr_b) = (end_a.address(), end_b.address());
    let a = end_a.connect(&addr_b, Epoch(1)).expect("a up");
    let _b = end_b.connect(&addr_a, Epoch(1)).expect("b up");
    send_bytes(&a, &[7u8; 8192]).await;
    let ended = tokio::time::timeout(Duration::from_secs(10), a.ended())
        .await
        .expect("the SEND fails within 10 s");
    let EpochEnd::Fault(fault) = ended else {
        panic!("a fault, got {ended:?}");
    };
    assert_eq!(
        fault,
        LinkFault::Completion {
            status: LinkFault::REMOTE_INVALID_REQUEST
        }
    );
    assert!(fault.blames_peer());
}

/// One end hook panics: the hooks after it still run (each tells someone
/// the epoch ended, e.g. the liveness channel), and the panic goes on to
/// the caller once they have. Before, the later hooks never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_end_hook_does_not_keep_the_later_ones_from_running() {
    let (da, db) = (device().await, device().await);
    let (a, _b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    let heard = Arc::new(Mutex::new(Vec::new()));
    let first = heard.clone();
    a.on_end(move |reason| first.lock().expect("lock").push(("first", reason)));
    a.on_end(|_| panic!("a buggy hook"));
    let last = heard.clone();
    a.on_end(move |reason| last.lock().expect("lock").push(("last", reason)));
    let failed = std::panic::catch_unwind(AssertUnwindSafe(|| a.fail(EpochEnd::PeerLost)));
    assert!(failed.is_err(), "the hook's panic reaches the caller");
    assert_eq!(
        *heard.lock().expect("lock"),
        [("first", EpochEnd::PeerLost), ("last", EpochEnd::PeerLost)]
    );
    assert_eq!(a.end_reason(), Some(EpochEnd::PeerLost));
}

/// A graceful close whose last SENDs are unsignaled gives their chunks back:
/// the fence behind them retires them, the peer hears of the close, and
/// neither end waits out its bound. (Before the fence the chunks stayed
/// posted through the whole close, and the peer, still up, could use up
/// every receive meanwhile; the poller now waits for the teardown in any
/// case, docs/rdma-link.md § "Graceful close waits for posted SENDs".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_close_with_an_unsignaled_tail_gives_its_chunks_back() {
    let (da, db) = (device().await, device().await);
    // A close bound of about 2 s (4.096 µs × 2^16 × 8 tries), which an
    // unfenced unsignaled tail would wait out.
    let config = RdmaConfig {
        timeout: 16,
        ..small()
    };
    let (a, b) = pair(&da, &db, Epoch(1), config).expect("pair");
    // Without the driver's handler every completion is the poller's to see.
    a.shared().cq.shared.disable_handler();
    // b spends its credit while a is up; a re-posts and owes it all back.
    let early = send_all_credit(&b, &a, 0).await;
    assert!(early > 0);
    // a's last two batches return that credit; they are unsignaled, so
    // never reported complete by themselves.
    send_bytes(&a, b"one").await;
    send_bytes(&a, b"two").await;
    assert_eq!(a.send_pool().stats().in_use, 2);
    a.fail(EpochEnd::Closed);
    until(|| a.send_pool().stats().in_use == 0).await;
    assert_eq!(b.ended().await, EpochEnd::PeerClosed);
    assert_eq!(a.ended().await, EpochEnd::Closed);
    let stats = a.stats();
    assert_eq!((stats.closing_fences, stats.close_waits_expired), (1, 0));
    assert_eq!(&recv_bytes(&b).await[..], b"one");
    assert_eq!(&recv_bytes(&b).await[..], b"two");
}

/// A link `a` with a close bound of about 2 s and four credits: three SENDs
/// b has not taken (an unsignaled tail: more buffers than credits, so none
/// is signaled for the pool's sake), and a's last credit held in a
/// reserved buffer.
async fn an_unsignaled_tail_and_the_last_credit() -> (
    (SoftDevice, SoftDevice),
    RdmaLink<SoftDevice>,
    RdmaLink<SoftDevice>,
    RdmaSendBuf<SoftDevice>,
) {
    let (da, db) = (device().await, device().await);
    let config = RdmaConfig {
        timeout: 16,
        recv_depth: 4,
        send_buffers: 16,
        ..small()
    };
    let (a, b) = pair(&da, &db, Epoch(1), config).expect("pair");
    a.shared().cq.shared.disable_handler();
    // b takes none of them, so no credit comes back.
    for payload in [&b"one"[..], b"two", b"three"] {
        send_bytes(&a, payload).await;
    }
    assert_eq!(a.stats().signaled_sends, 0, "an unsignaled tail");
    // The last credit goes only to a post that returns credit: a owes one
    // (fewer than a credit-only message waits for).
    send_bytes(&b, b"owed").await;
    assert_eq!(&recv_bytes(&a).await[..], b"owed");
    let last_credit = tokio::time::timeout(Duration::from_secs(10), a.reserve())
        .await
        .expect("the last credit is free")
        .expect("reserve");
    ((da, db), a, b, last_credit)
}

/// A graceful close decided while a reserved buffer holds the last credit
/// finds none for its fence; the fence goes when the buffer comes back,
/// dropped or refused at its post, so the close does not wait out its
/// bound for an unsignaled tail.
#[tokio::test]
async fn a_closing_fence_that_found_no_credit_goes_when_a_reserved_buffer_comes_back() {
    for posted in [false, true] {
        let (_devices, a, b, mut last_credit) = an_unsignaled_tail_and_the_last_credit().await;
        a.fail(EpochEnd::Closed);
        assert_eq!(a.stats().closing_fences, 0, "no credit for it yet");
        if posted {
            last_credit[..4].copy_from_slice(b"late");
            assert!(a.post(last_credit, 4).is_err(), "refused: the link ended");
        } else {
            drop(last_credit);
        }
        until(|| a.send_pool().stats().in_use == 0).await;
        assert_eq!(a.ended().await, EpochEnd::Closed);
        let stats = a.stats();
        assert_eq!(
            (stats.closing_fences, stats.close_waits_expired),
            (1, 0),
            "posted: {posted}"
        );
        for payload in [&b"one"[..], b"two", b"three"] {
            assert_eq!(&recv_bytes(&b).await[..], payload);
        }
    }
}

/// A fence still owed when the close has moved on (cut short by an abrupt
/// end, or past its wait for the SENDs) is not posted when a credit comes
/// back: the QP is going to ERR, or the tail was given up.
#[tokio::test]
async fn a_fence_owed_after_the_close_moved_on_is_not_posted() {
    for cut in [true, false] {
        let (_devices, a, _b, last_credit) = an_unsignaled_tail_and_the_last_credit().await;
        a.fail(EpochEnd::Closed);
        assert!(a.shared().lock().fence_owed, "no credit for the fence");
        if cut {
            a.fail(EpochEnd::PeerLost);
            assert!(a.close_was_cut());
        } else {
            // b never completes the tail: the close waits out its bound.
            until(|| a.shared().lock().last_sent).await;
        }
        drop(last_credit);
        until(|| a.send_pool().stats().in_use == 0).await;
        assert_eq!(a.stats().closing_fences, 0, "cut: {cut}");
    }
}

/// A link whose every handle is dropped during its graceful close still
/// has its completions polled until the teardown, where the provider has
/// no completion handler (libibverbs): the close ends on its SENDs'
/// completion, not its bound.
#[tokio::test]
async fn a_detached_links_close_is_polled_until_its_teardown() {
    let (da, db) = (device().await, device().await);
    let config = RdmaConfig {
        timeout: 16,
        ..small()
    };
    let (a, b) = pair(&da, &db, Epoch(1), config).expect("pair");
    a.shared().cq.shared.disable_handler();
    // Nothing completes until every handle is gone: a poller that left at
    // the drop would never see it.
    da.set_partitioned(true);
    let mut buf = a.reserve().await.expect("reserve");
    buf[..4].copy_from_slice(b"last");
    a.post_last(buf, 4).expect("post");
    let (shared, pool) = (a.shared().clone(), a.send_pool().clone());
    a.fail(EpochEnd::Closed);
    drop(a);
    tokio::time::sleep(Duration::from_millis(20)).await;
    da.set_partitioned(false);
    until(|| pool.stats().in_use == 0).await;
    until(|| shared.lock().torn_down).await;
    assert_eq!(shared.lock().stats.close_waits_expired, 0);
    assert_eq!(&recv_bytes(&b).await[..], b"last");
}

/// A hook added while a graceful close keeps the QP up waits for the
/// teardown, as the hooks added before it do; it used to run at once,
/// and the node's closed the liveness connection with a reset mid-close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_hook_added_during_a_graceful_close_waits_for_the_teardown() {
    let (da, db) = (device().await, device().await);
    // Retries run out in about 2.1 s (4.096 µs × 2^17, four times): a
    // loaded runner may pause the test between the close and the hook.
    let config = RdmaConfig {
        timeout: 17,
        retry_cnt: 3,
        ..small()
    };
    let (a, _b) = pair(&da, &db, Epoch(1), config).expect("pair");
    // Nothing reaches b: the close waits for a SEND nobody acknowledges.
    da.set_partitioned(true);
    let mut buf = a.reserve().await.expect("reserve");
    buf[..4].copy_from_slice(b"lost");
    a.post_last(buf, 4).expect("post");
    a.fail(EpochEnd::Closed);
    let seen = Arc::new(Mutex::new(None));
    let (record, shared) = (seen.clone(), a.shared().clone());
    a.on_end(move |reason| {
        *record.lock().expect("not poisoned") = Some((reason, shared.lock().torn_down));
    });
    assert_eq!(*seen.lock().expect("not poisoned"), None, "the QP is up");
    until(|| seen.lock().expect("not poisoned").is_some()).await;
    assert_eq!(
        *seen.lock().expect("not poisoned"),
        Some((EpochEnd::Closed, true))
    );
}

/// A send completion for a work request never posted (a provider's bug)
/// is a fault, and retires nothing: the buffers posted before it may still
/// be on the wire.
#[tokio::test]
async fn a_completion_for_a_send_never_posted_retires_nothing() {
    let (da, db) = (device().await, device().await);
    let (a, _b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    a.shared().cq.shared.disable_handler();
    da.set_partitioned(true);
    send_bytes(&a, b"out").await;
    let mut st = a.shared().lock();
    let (posted, next) = (st.posted.len(), st.next_wr);
    let never = crate::verbs::WorkCompletion {
        wr_id: next + 5,
        status: crate::verbs::WcStatus::Success,
        opcode: crate::verbs::WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: a.address().qpn,
    };
    assert_eq!(
        poller::on_send_completion(&mut st, &never),
        Some(LinkFault::UnknownCompletion { wr_id: next + 5 })
    );
    assert_eq!(st.posted.len(), posted, "nothing retired");
}

/// Sends from `from` while it has credit for another batch, each batch
/// seen by `to` before the next; returns `to`'s batches received in all.
/// (While `to` is up, its credit returns may come after this stops.)
async fn send_all_credit(
    from: &RdmaLink<SoftDevice>,
    to: &RdmaLink<SoftDevice>,
    mut received: u64,
) -> u64 {
    while from.shared().lock().credit.can_reserve() {
        let reserved = tokio::time::timeout(Duration::from_secs(10), from.reserve()).await;
        let mut buf = reserved.expect("a send buffer").expect("reserve");
        buf[..4].copy_from_slice(b"data");
        from.post(buf, 4).expect("post");
        received += 1;
        until(|| to.shared().lock().stats.batches_received >= received).await;
    }
    received
}

/// A hook added after the end runs at once, and may use its own link.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_end_hook_added_after_the_end_may_use_its_link() {
    let (da, db) = (device().await, device().await);
    let (a, _b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    a.fail(EpochEnd::Fault(LinkFault::PostFailed));
    let (seen, same) = (Arc::new(Mutex::new(None)), a.clone());
    let record = seen.clone();
    // On a thread of its own: a hook run under the link's lock deadlocks.
    let (done, added) = std::sync::mpsc::channel();
    let adder = a.clone();
    std::thread::spawn(move || {
        adder.on_end(move |reason| {
            *record.lock().expect("lock") = Some((reason, same.end_reason()));
        });
        done.send(()).ok();
    });
    added
        .recv_timeout(Duration::from_secs(10))
        .expect("the hook ran without waiting on the link");
    let reason = EpochEnd::Fault(LinkFault::PostFailed);
    assert_eq!(*seen.lock().expect("lock"), Some((reason, Some(reason))));
}

/// [`small`] with each wait of a graceful close bounded at 5 s
/// (`timeout = 0`), far past any test's steps.
fn closes_bounded_at_5s() -> RdmaConfig {
    RdmaConfig {
        timeout: 0,
        ..small()
    }
}

/// An end on `budget` connected to a stand-alone end. Its graceful close
/// waits for the peer's word, which only the test gives
/// ([`RdmaLink::peer_finished`]).
fn on_budget(
    da: &SoftDevice,
    db: &SoftDevice,
    budget: &ReadOutBudget,
    config: RdmaConfig,
) -> (RdmaLink<SoftDevice>, RdmaLink<SoftDevice>) {
    let end_a = PreparedEnd::new(da, config)
        .expect("end a")
        .with_read_outs(budget.clone());
    let end_b = PreparedEnd::new(db, config).expect("end b");
    let (addr_a, addr_b) = (end_a.address(), end_b.address());
    let a = end_a.connect(&addr_b, Epoch(1)).expect("connect a");
    let b = end_b.connect(&addr_a, Epoch(1)).expect("connect b");
    a.on_last_sent(|| {});
    (a, b)
}

/// `recv` reports `reason` (the end is torn down and drained).
async fn torn_down(link: &RdmaLink<SoftDevice>, reason: EpochEnd) {
    let recv = tokio::time::timeout(Duration::from_secs(10), link.recv()).await;
    let got = recv.map(|r| r.map(drop));
    assert!(
        matches!(got, Ok(Err(LinkError::Ended { reason: r, .. })) if r == reason),
        "{got:?}"
    );
}

/// A replaced end, or one the peer closed, closes gracefully only on one of
/// the node's read-outs: past the budget a replaced one is torn down at
/// once, and one the peer closed waits only for our posted SENDs. The
/// read-out comes back at the close's teardown (docs/design.md § "A closed
/// link delivers both ways").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_ends_past_the_read_out_budget_are_torn_down_at_once() {
    let (da, db) = (device().await, device().await);
    let config = closes_bounded_at_5s();
    let budget = ReadOutBudget::new(1);
    let (a1, b1) = on_budget(&da, &db, &budget, config);
    let (a2, _b2) = on_budget(&da, &db, &budget, config);
    a1.fail(EpochEnd::Replaced);
    assert_eq!((budget.in_use(), budget.refused()), (1, 0));
    a2.fail(EpochEnd::Replaced);
    assert_eq!((budget.in_use(), budget.refused()), (1, 1));
    torn_down(&a2, EpochEnd::Replaced).await;
    // a1 still closes: what its peer sends lands.
    send_bytes(&b1, b"late").await;
    assert_eq!(recv_bytes(&a1).await, b"late");
    // The peer's word ends a1's wait on the event, not its 5 s bound: a
    // close begun now with a 2 s bound (8 tries of 268 ms), whose peer never
    // says it, is still waiting after.
    let two_seconds = RdmaConfig {
        timeout: 16,
        ..config
    };
    let (witness, _witness_peer) = on_budget(&da, &db, &budget, two_seconds);
    witness.fail(EpochEnd::Closed);
    a1.peer_finished();
    torn_down(&a1, EpochEnd::Replaced).await;
    assert!(
        !witness.shared().lock().torn_down,
        "a1 waited out its bound"
    );
    assert_eq!(budget.in_use(), 0, "the teardown gave the read-out back");

    // The budget serves the next close the peer chose, its `PeerClosed`
    // (a Goodbye, or the half-close) too; while it is held, the next is
    // short (no SEND of ours is in flight: torn down at once), and a
    // replacement after it takes nothing more.
    let (a3, b3) = on_budget(&da, &db, &budget, config);
    let (a4, _b4) = on_budget(&da, &db, &budget, config);
    a3.fail(EpochEnd::PeerClosed);
    a3.fail(EpochEnd::Replaced);
    assert_eq!((budget.in_use(), budget.refused()), (1, 1));
    a4.fail(EpochEnd::PeerClosed);
    assert_eq!((budget.in_use(), budget.refused()), (1, 2));
    torn_down(&a4, EpochEnd::PeerClosed).await;
    send_bytes(&b3, b"still").await;
    assert_eq!(recv_bytes(&a3).await, b"still");
    a3.peer_finished();
    torn_down(&a3, EpochEnd::PeerClosed).await;
    assert_eq!(budget.in_use(), 0);
}

/// A connector's link closes on its peer's share of the budget: past a
/// quarter of it for one peer, or past half of it for the peers the node
/// never registered, a replaced link is torn down at once and the peer's
/// close is short, while others still find read-outs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_closes_take_read_outs_from_its_share_alone() {
    let (da, db) = (device().await, device().await);
    let config = closes_bounded_at_5s();
    // A quarter: one a peer; half: two for the unregistered.
    let budget = ReadOutBudget::new(4);
    let owned = |peer: u64, registered| {
        let (a, b) = on_budget(&da, &db, &budget, config);
        a.set_read_out_owner(ReadOutOwner {
            peer: PeerId(peer),
            registered,
            source: None,
        });
        (a, b)
    };
    let (first, _p1) = owned(1, true);
    let (again, _p2) = owned(1, true);
    let (replaced_too, _p3) = owned(1, true);
    let told = |link: &RdmaLink<SoftDevice>| {
        let told = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = told.clone();
        link.on_last_sent(move || flag.store(true, std::sync::atomic::Ordering::Release));
        move || told.load(std::sync::atomic::Ordering::Acquire)
    };
    let (again_told, replaced_told) = (told(&again), told(&replaced_too));
    first.fail(EpochEnd::Replaced);
    again.fail(EpochEnd::PeerClosed);
    replaced_too.fail(EpochEnd::Replaced);
    assert_eq!((budget.in_use(), budget.refused()), (1, 2));
    // Past the share the peer's close is short: our posted SENDs are
    // waited for and the peer told so (no reset), its word is not; a
    // replacement is torn down at once, the peer told nothing.
    torn_down(&again, EpochEnd::PeerClosed).await;
    assert!(again_told(), "the short close said its last word");
    let stats = again.stats();
    assert_eq!((stats.short_closes, stats.close_waits_expired), (1, 0));
    // Its short read-out went back to the short pool.
    assert_eq!(
        (budget.in_use_of(ReadOutTier::Short), budget.short_refused()),
        (0, 0)
    );
    torn_down(&replaced_too, EpochEnd::Replaced).await;
    assert!(!replaced_told());
    let fresh: Vec<_> = (10..13).map(|id| owned(id, false)).collect();
    for (link, _) in &fresh {
        link.fail(EpochEnd::PeerClosed);
    }
    assert_eq!((budget.in_use(), budget.refused()), (3, 3));
    torn_down(&fresh[2].0, EpochEnd::PeerClosed).await;
    // The last read-out is still there for a registered peer.
    let (other, other_peer) = owned(2, true);
    other.fail(EpochEnd::Replaced);
    assert_eq!((budget.in_use(), budget.refused()), (4, 3));
    send_bytes(&other_peer, b"kept").await;
    assert_eq!(recv_bytes(&other).await, b"kept");
    other.peer_finished();
    torn_down(&other, EpochEnd::Replaced).await;
    assert_eq!(budget.held_by(PeerId(2)), 0, "given back at the teardown");
}

/// With no short read-out left either, the peer's close is torn down at
/// once, telling the peer nothing (a reset), and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_close_past_the_short_read_outs_too_is_torn_down_at_once() {
    let (da, db) = (device().await, device().await);
    let config = closes_bounded_at_5s();
    let budget = ReadOutBudget::new(0);
    let (link, _peer) = on_budget(&da, &db, &budget, config);
    let told = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = told.clone();
    link.on_last_sent(move || flag.store(true, std::sync::atomic::Ordering::Release));
    link.fail(EpochEnd::PeerClosed);
    assert_eq!((budget.refused(), budget.short_refused()), (1, 1));
    torn_down(&link, EpochEnd::PeerClosed).await;
    assert!(!told.load(std::sync::atomic::Ordering::Acquire));
    assert_eq!(link.stats().short_closes, 0);
}

/// An abrupt end met while a graceful close waits for its peer cuts the
/// close short (the QP goes down now, and the liveness word becomes a
/// reset); a replacement after our own close does not, and takes no
/// read-out: the peer's last SENDs on this QP are what the close waits for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abrupt_end_cuts_a_graceful_close_and_a_replacement_does_not() {
    let (da, db) = (device().await, device().await);
    let config = closes_bounded_at_5s();
    let budget = ReadOutBudget::new(0);
    let (kept, kept_peer) = on_budget(&da, &db, &budget, config);
    let (cut, _cut_peer) = on_budget(&da, &db, &budget, config);
    kept.fail(EpochEnd::Closed);
    cut.fail(EpochEnd::Closed);
    kept.fail(EpochEnd::Replaced);
    cut.fail(EpochEnd::PeerLost);
    torn_down(&cut, EpochEnd::Closed).await;
    assert!(cut.close_was_cut());
    // Our own close's replacement takes no read-out (none is left) and
    // cuts nothing: the peer's SEND still lands.
    send_bytes(&kept_peer, b"after").await;
    assert_eq!(recv_bytes(&kept).await, b"after");
    assert!(!kept.close_was_cut());
    assert_eq!(budget.refused(), 0);
    kept.peer_finished();
    torn_down(&kept, EpochEnd::Closed).await;
}

/// A node's links take their replacements' graceful closes from the
/// node's budget (`RdmaNodeConfig::read_outs`), and its metrics say so: with
/// none, a reconnect's replaced link is torn down at once (and its peer,
/// reset, may see it lost before its own replacement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_links_take_their_read_outs_from_the_nodes_budget() {
    let start = |id| {
        let config = RdmaNodeConfig {
            read_outs: ReadOutBudget::new(0),
            ..node_config(id, usize::MAX)
        };
        async move {
            RdmaTransport::start(device().await, config)
                .await
                .expect("start")
        }
    };
    let (a, b) = (start(A).await, start(B).await);
    assert_eq!(a.register(&b.address()), Ok(B));
    assert_eq!(b.register(&a.address()), Ok(A));
    assert_eq!(a.node().connect(B).await, Ok(Epoch(1)));
    assert_eq!(a.node().epochs().swept_links(), 1, "in the stall sweep");
    // B's accept is done too, or the next dial is asked to come again.
    until(|| b.mux().epoch(A) == Some(Epoch(1))).await;
    // Each close takes its read-out from the peer's share.
    let owner = |peer, registered| {
        Some(ReadOutOwner {
            peer,
            registered,
            source: None,
        })
    };
    let link_owner = |t: &RdmaTransport<SoftDevice>, peer| t.node().link(peer)?.read_out_owner();
    assert_eq!(link_owner(&a, B), owner(B, true));
    assert_eq!(link_owner(&b, A), owner(A, true));
    let firsts = [
        a.node().link(B).expect("a's epoch 1"),
        b.node().link(A).expect("b's epoch 1"),
    ];
    // A deliberate reconnect proposes the running epoch: 2 replaces it.
    assert_eq!(a.node().connect(B).await, Ok(Epoch(2)));
    until(|| firsts.iter().all(|link| link.end_reason().is_some())).await;
    for link in &firsts {
        let end = link.end_reason();
        assert!(
            matches!(end, Some(EpochEnd::Replaced | EpochEnd::PeerLost)),
            "{end:?}"
        );
    }
    let refused = |t: &RdmaTransport<SoftDevice>| metric(t, "qpmux_read_outs_refused_total");
    until(|| refused(&a).unwrap_or(0) + refused(&b).unwrap_or(0) >= 1).await;
    assert_eq!(metric(&a, "qpmux_read_outs"), Some(0));
    assert_eq!(metric(&b, "qpmux_read_outs"), Some(0));
}

/// Bit `i` set: the soft MR will not lend chunk `i`, as libibverbs lends
/// none a posted WR names.
fn refuse_chunks(mr: &crate::verbs::soft::SoftMr, chunks: u64) {
    mr.mem.not_lent.store(chunks, Ordering::Relaxed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_buffer_the_provider_will_not_lend_is_skipped_and_the_link_goes_on() {
    let (da, db) = (device().await, device().await);
    let (a, b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    let pool = a.shared().lease.pool();
    // A fresh pool lends chunk 0 first.
    refuse_chunks(pool.mr(), 1 << 0);
    for word in [b"one", b"two"] {
        send_bytes(&a, word).await;
        assert_eq!(recv_bytes(&b).await, word);
    }
    assert!(a.end_reason().is_none(), "{:?}", a.end_reason());
    assert!(pool.stats().refused_lends >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_buffers_the_provider_will_not_lend_end_the_epoch_and_stay_in_the_pool() {
    let (da, db) = (device().await, device().await);
    let (a, _b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    let pool = a.shared().lease.pool();
    let chunks = pool.stats().chunks;
    refuse_chunks(pool.mr(), u64::MAX);
    let refused = tokio::time::timeout(Duration::from_secs(10), a.reserve())
        .await
        .expect("reserve answers, not waits");
    let not_lent = EpochEnd::Fault(LinkFault::BufferNotLent { receive: false });
    assert!(
        matches!(refused, Err(LinkError::Ended { reason, .. }) if reason == not_lent),
        "no empty send buffer is handed out: {:?}",
        refused.map(drop)
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.in_use, stats.free, stats.set_aside),
        (0, chunks, 0),
        "every chunk is back for the next link to try"
    );
    assert_eq!(stats.refused_lends, chunks as u64, "each tried once");
}

/// Two batches from `a` queued at `b`, unread; the first one's buffer.
async fn two_batches_queued(a: &RdmaLink<SoftDevice>, b: &RdmaLink<SoftDevice>) -> usize {
    send_bytes(a, b"first").await;
    send_bytes(a, b"second").await;
    until(|| b.shared().lock().ready.len() == 2).await;
    let first = b.shared().lock().ready.front().map(|&(idx, _)| idx);
    first.expect("queued")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_received_batch_the_provider_will_not_lend_ends_the_epoch_and_none_behind_it_is_read() {
    let (da, db) = (device().await, device().await);
    let (a, b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    let first = two_batches_queued(&a, &b).await;
    refuse_chunks(&b.shared().recv_mrs[first], 1);
    let not_lent = EpochEnd::Fault(LinkFault::BufferNotLent { receive: true });
    // The second batch would read to the mux as a gap the peer made.
    torn_down(&b, not_lent).await;
    torn_down(&b, not_lent).await;
    assert_eq!(b.end_reason(), Some(not_lent));
    assert_eq!(b.stats().receives_dropped, 2, "counted");
}

/// Batches dropped during our own graceful close are no graceful end:
/// `recv` reports the fault, so the mux counts the epoch lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_received_batch_not_lent_during_our_close_is_reported_as_the_fault() {
    let (da, db) = (device().await, device().await);
    let (a, b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    let first = two_batches_queued(&a, &b).await;
    b.fail(EpochEnd::Closed);
    assert_eq!(b.end_reason(), Some(EpochEnd::Closed));
    refuse_chunks(&b.shared().recv_mrs[first], 1);
    torn_down(
        &b,
        EpochEnd::Fault(LinkFault::BufferNotLent { receive: true }),
    )
    .await;
}

/// Once `recv` has reported the end no batch follows it: a receive handled
/// after the link was drained (a failed move to ERR leaves the QP
/// receiving; a panic's lost completions leave later ones in the CQ) is
/// dropped. Handed to the link directly: neither is easy to stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_batch_follows_the_end_recv_reported() {
    let (da, db) = (device().await, device().await);
    let (a, _b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    a.fail(EpochEnd::Fault(LinkFault::Injected));
    let injected = EpochEnd::Fault(LinkFault::Injected);
    torn_down(&a, injected).await;
    let shared = a.shared();
    let late = crate::verbs::WorkCompletion {
        wr_id: RECV_TAG,
        status: crate::verbs::WcStatus::Success,
        opcode: crate::verbs::WcOpcode::Recv,
        byte_len: 4,
        imm: Some(0),
        qp_num: shared.address.qpn,
    };
    shared.on_completions(&[late]);
    assert!(shared.lock().ready.is_empty(), "not queued");
    assert_eq!(a.stats().receives_dropped, 1, "counted");
    torn_down(&a, injected).await;
}

/// A peer that RDMA WRITEs into our QP (no rkey ever leaves the process,
/// so no honest one does), or sends a SEND Middle with no First: the soft
/// provider NAKs it as an invalid request and errs the QP, and the link
/// ends the epoch on the flushed receives as the peer's violation, which
/// the provider names (docs/reliability-hostile.md). The peer here is a
/// bare UDP socket speaking RoCEv2 by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_rdma_write_or_malformed_send_is_naked_and_ends_the_epoch_as_a_violation() {
    use crate::verbs::soft::wire::{
        AethKind, BthRepr, DEFAULT_PKEY, IcrcContext, MAX_OVERHEAD, NakCode, Opcode, Packet,
        PacketRepr,
    };
    use crate::verbs::{PeerRequestError, Psn, Qpn};

    let dev = device().await;
    let ours = dev.query_port();
    let our_gid = ours.gid_table[0];
    let ip = our_gid.to_ipv4().expect("a soft device on IPv4 loopback");
    // RETH (VA, rkey, DMA length 16), then the 16 bytes it names.
    let reth = [[0x11; 8], [0, 0, 0, 0, 0, 0, 0, 16]].concat();
    let write = (
        Opcode::UnsupportedRequest(0x0a),
        [&reth[..], &[0xab; 16]].concat(),
        PeerRequestError::Unsupported(0x0a),
    );
    let middle = (
        Opcode::SendMiddle,
        vec![0x5a; ours.active_mtu.bytes()],
        PeerRequestError::MalformedSend,
    );
    // The peer's liveness channel may end before the poller sees the
    // flush: here the poll is held off until the link has been failed so.
    let cases = [
        (write.clone(), None),
        (middle, None),
        (write.clone(), Some(EpochEnd::PeerLost)),
        (write, Some(EpochEnd::PeerClosed)),
    ];
    for ((opcode, payload, cause), liveness_first) in cases {
        let socket = tokio::net::UdpSocket::bind((ip, 0))
            .await
            .expect("the peer's socket");
        let their_port = socket.local_addr().expect("addr").port();
        let (their_qpn, their_psn) = (Qpn::new(0x4242), Psn::new(77));
        let end = PreparedEnd::new(&dev, small()).expect("link end");
        let link = end
            .connect(
                &QpAddress {
                    qpn: their_qpn,
                    psn: their_psn,
                    gid: our_gid,
                    udp_port: their_port,
                    mtu: ours.active_mtu,
                },
                Epoch(1),
            )
            .expect("connect");
        let to_us = IcrcContext {
            src: our_gid,
            dst: our_gid,
            src_port: their_port,
            dst_port: ours.udp_port,
        };
        let request = PacketRepr {
            bth: BthRepr {
                opcode,
                solicited: false,
                mig_req: true,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                dest_qp: link.address().qpn,
                ack_req: true,
                psn: their_psn,
            },
            aeth: None,
            imm: None,
        };
        let mut buf = vec![0; 4096 + MAX_OVERHEAD];
        let n = request.emit(&to_us, &payload, &mut buf);
        let unpolled = liveness_first.map(|_| {
            let shared = link.shared();
            shared.polling.lock().expect("the poll buffer")
        });
        socket
            .send_to(&buf[..n], (ip, ours.udp_port))
            .await
            .expect("send");
        let from_us = IcrcContext {
            src: our_gid,
            dst: our_gid,
            src_port: ours.udp_port,
            dst_port: their_port,
        };
        let nak = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let len = socket.recv(&mut buf).await.expect("recv");
                if let Ok(pkt) = Packet::parse(&from_us, &buf[..len])
                    && let Some(aeth) = pkt.repr.aeth
                {
                    break (pkt.repr.bth.psn, aeth.kind);
                }
            }
        })
        .await
        .expect("an answer");
        assert_eq!(nak, (their_psn, AethKind::Nak(NakCode::InvalidRequest)));
        if let Some(end) = liveness_first {
            link.fail(end);
            drop(unpolled);
            // As the handler does before it lets go: the CQ polled empty.
            link.shared().take_completions_caught();
        }
        let recv = tokio::time::timeout(Duration::from_secs(10), link.recv()).await;
        let refused = EpochEnd::Violation(crate::mux::ProtocolError::RequestRefused(cause));
        assert!(
            matches!(recv, Ok(Err(LinkError::Ended { reason, .. })) if reason == refused),
            "{:?}",
            recv.map(|r| r.map(drop))
        );
        if let PeerRequestError::Unsupported(_) = cause {
            assert_eq!(link.shared().qp.counters().unsupported_requests, 1);
        }
    }
}

/// The race the poller's ask closes: completions a verbs call adds after
/// the holder's last poll, while the poller wakes, finds the poll taken,
/// arms again and sleeps. Letting go without polling again must still wake
/// the poller, which then reads the flushes and ends the epoch (without
/// the ask it slept on: the test waited out its bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::await_holding_lock,
    reason = "the test plays the handler, holding the poll while the poller runs"
)]
async fn completions_added_before_the_holder_lets_go_are_polled() {
    let (da, db) = (device().await, device().await);
    let (a, _b) = pair(&da, &db, Epoch(1), small()).expect("pair");
    let shared = a.shared();
    let armed = || shared.cq.is_armed();
    let asleep = tokio::time::timeout(Duration::from_secs(10), async {
        while !armed() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    asleep.await.expect("the idle poller sleeps armed");
    let held = shared.polling.lock().expect("the poll buffer");
    // The flushes fire the armed notification: the poller wakes, finds the
    // poll taken, asks, arms again and sleeps.
    shared.qp.modify_to_error().expect("to ERR");
    let asked = || {
        shared
            .poll_wanted
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    tokio::time::timeout(Duration::from_secs(10), async {
        while !(asked() && armed()) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the poller woke, asked, and armed again");
    // Past its last try before it waits.
    tokio::time::sleep(Duration::from_millis(50)).await;
    shared.let_go_of_polling(held);
    let ended = tokio::time::timeout(Duration::from_secs(5), a.recv()).await;
    assert!(
        matches!(ended, Ok(Err(LinkError::Ended { .. }))),
        "the woken poller read the flushes: {:?}",
        ended.map(|r| r.map(drop))
    );
}
