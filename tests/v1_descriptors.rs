//! V1, resource ceiling: under a 1,024-descriptor limit the qpmux paths keep
//! O(peers) descriptors however many streams ride them (4 peers × 4,096
//! streams), while velo's per-stream path (`tcp-stream`, one connection per
//! stream) grows O(streams) and hits the wall; the test prints where.
//!
//! The tests count the whole process's descriptors, so they run one at a time.

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::Node;
use qpmux::link::rdma::{RdmaNodeConfig, RdmaTransport};
use qpmux::link::tcp::{TcpNodeConfig, TcpTransport};
use qpmux::mux::{Frame, MuxConfig, MuxTransport, PeerId, StreamKey, Terminal};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;

/// Machines differ; every test runs under this soft limit.
const NOFILE: u64 = 1024;
const PEERS: u64 = 4;
const STEPS: [u64; 3] = [1, 256, 4096];

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Sets the soft descriptor limit to [`NOFILE`] (or the hard limit, if
/// lower); returns the limit in force.
fn limit_descriptors() -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    let soft = now.maximum.map_or(NOFILE, |hard| hard.min(NOFILE));
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(soft),
            maximum: now.maximum,
        },
    )
    .expect("lowering the soft descriptor limit");
    soft
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count() as u64)
}

async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Opens [`STEPS`] streams per peer from `a` to every node of `others` (one
/// record and a finalize on each); returns (streams per peer, open fds).
async fn mux_descriptors<N: Node>(a: &N, others: &[N]) -> Vec<(u64, u64)> {
    let mut ids = Vec::new();
    for node in others {
        ids.push(a.register(&node.address()).expect("register"));
        node.register(&a.address()).expect("register");
    }
    let mut fds_at = Vec::new();
    let mut opened = 0u64;
    for streams_per_peer in STEPS {
        let mut receivers = Vec::new();
        for (p, (node, &id)) in others.iter().zip(&ids).enumerate() {
            for s in opened..streams_per_peer {
                let key = StreamKey::new(p as u64, s);
                receivers.push(node.mux().bind(key).expect("bind"));
                let mut tx = a.mux().open(id, key).expect("open");
                tx.send(Bytes::from_static(b"x")).await.expect("send");
                tx.finish(Terminal::Finalized).expect("finish");
            }
        }
        for mut rx in receivers {
            assert_eq!(rx.recv().await, Some(Frame::Data(Bytes::from_static(b"x"))));
            assert_eq!(rx.recv().await, Some(Frame::Finalized));
        }
        opened = streams_per_peer;
        until(|| a.mux().stats().slots_dropped == 0).await;
        fds_at.push((streams_per_peer, open_fds()));
    }
    fds_at
}

/// Every stream count uses the same descriptors: listeners, devices, one
/// connection per peer per side, the runtime's own. (A little slack for a
/// descriptor the runtime or a crossing dial holds for a moment.)
fn assert_o_peers(path: &str, fds_at: &[(u64, u64)]) {
    let (_, first) = fds_at[0];
    for &(streams, fds) in fds_at {
        assert!(
            fds <= first + 4,
            "{path}: descriptors grew at {streams} streams per peer: {fds_at:?}"
        );
    }
    let (_, last) = fds_at[fds_at.len() - 1];
    assert!(
        last < 64,
        "{path}: {last} descriptors for {PEERS} peers × 4096 streams"
    );
}

#[test]
fn tcp_mux_descriptors_do_not_grow_with_streams() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let limit = limit_descriptors();
    runtime().block_on(async {
        let loopback = "127.0.0.1:0".parse().expect("literal");
        let bind = |id| {
            TcpTransport::bind(
                TcpNodeConfig::new(PeerId(id)),
                loopback,
                MuxConfig::default(),
            )
        };
        let a = bind(100).await.expect("bind");
        let mut others = Vec::new();
        for p in 0..PEERS {
            others.push(bind(p + 1).await.expect("bind"));
        }
        let fds_at = mux_descriptors(&a, &others).await;
        eprintln!(
            "V1 qpmux-tcp, {PEERS} peers, limit {limit}: (streams per peer, open fds) = {fds_at:?}"
        );
        assert_o_peers("qpmux-tcp", &fds_at);
        a.shutdown();
        for node in &others {
            node.shutdown();
        }
    });
}

#[test]
fn rdma_mux_descriptors_do_not_grow_with_streams() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let limit = limit_descriptors();
    runtime().block_on(async {
        let node = |id| async move {
            let device = SoftDevice::open_udp(UdpConfig::default())
                .await
                .expect("soft device on loopback");
            RdmaTransport::start(device, RdmaNodeConfig::new(PeerId(id)))
                .await
                .expect("bind")
        };
        let a = node(100).await;
        let mut others = Vec::new();
        for p in 0..PEERS {
            others.push(node(p + 1).await);
        }
        let fds_at = mux_descriptors(&a, &others).await;
        eprintln!(
            "V1 qpmux-rdma, {PEERS} peers, limit {limit}: (streams per peer, open fds) = {fds_at:?}"
        );
        assert_o_peers("qpmux-rdma", &fds_at);
        a.shutdown();
        for node in &others {
            node.shutdown();
        }
    });
}

#[cfg(feature = "velo")]
mod per_stream {
    use std::sync::Arc;
    use std::time::Duration;

    use futures::StreamExt;
    use velo::Velo;
    use velo::streaming::StreamFrame;
    use velo::transports::tcp::TcpTransportBuilder;

    use super::{ONE_AT_A_TIME, STEPS, limit_descriptors, open_fds, runtime};

    /// A velo instance with the messenger mux off: every anchor stream gets
    /// its own TCP connection (`tcp-stream`).
    async fn per_stream_instance() -> Velo {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let transport = TcpTransportBuilder::new()
            .from_listener(listener)
            .expect("listener")
            .build()
            .expect("messenger transport");
        Velo::builder()
            .add_transport(Arc::new(transport))
            .stream_bind_addr(std::net::Ipv4Addr::LOCALHOST.into())
            .messenger_mux(velo::streaming::MuxConfig {
                enabled: false,
                ..Default::default()
            })
            .expect("first mux config")
            .build()
            .await
            .expect("velo")
    }

    /// Opens streams one by one (each delivers one item) until the path
    /// fails or [`STEPS`]' last count is reached.
    #[test]
    fn per_stream_descriptors_grow_with_streams_until_the_wall() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let limit = limit_descriptors();
        runtime().block_on(async {
            let producer = per_stream_instance().await;
            let consumer = per_stream_instance().await;
            producer
                .register_peer(consumer.peer_info())
                .expect("register");
            consumer
                .register_peer(producer.peer_info())
                .expect("register");
            let mut fds_at = Vec::new();
            let mut live = Vec::new();
            let mut wall = None;
            let mut fds_before_wall = open_fds();
            let want = STEPS[STEPS.len() - 1];
            for stream in 1..=want {
                let mut anchor = consumer.create_anchor::<u64>();
                // A silent stream (its connection never accepted) is a wall
                // too; the timeout turns it into one.
                let opened = tokio::time::timeout(Duration::from_secs(5), async {
                    let tx = producer
                        .attach_anchor::<u64>(anchor.handle())
                        .await
                        .map_err(|e| format!("attach: {e}"))?;
                    tx.send(stream).await.map_err(|e| format!("send: {e}"))?;
                    match anchor.next().await {
                        Some(Ok(StreamFrame::Item(n))) if n == stream => Ok(tx),
                        other => Err(format!("receive: {other:?}")),
                    }
                })
                .await
                .unwrap_or_else(|_| Err("silent for 5 s".to_string()));
                match opened {
                    Ok(tx) => {
                        live.push((anchor, tx));
                        fds_before_wall = open_fds();
                    }
                    Err(err) => {
                        // At the wall even listing /proc/self/fd can fail.
                        wall = Some((stream - 1, fds_before_wall, err));
                        break;
                    }
                }
                if STEPS.contains(&stream) {
                    fds_at.push((stream, open_fds()));
                }
            }
            eprintln!(
                "V1 velo-tcp-stream, 1 peer, limit {limit}: (streams, open fds) = {fds_at:?}; \
                 wall (streams carried, fds open then, what failed next): {wall:?}"
            );
            let (carried, _, _) = wall
                .clone()
                .expect("the per-stream path hits the descriptor wall");
            assert!(carried < want, "{carried}");
            if limit >= 1024 {
                // Both ends live in this process: two descriptors per stream.
                let (_, at1) = fds_at[0];
                let (_, at256) = fds_at[1];
                assert!(
                    at256 >= at1 + 255,
                    "per-stream descriptors did not grow with streams: {fds_at:?}"
                );
                assert!((256..1024).contains(&carried), "wall at {carried} streams");
            }
            drop(live);
            let policy = || velo_ext::ShutdownPolicy::Timeout(Duration::from_secs(1));
            producer.graceful_shutdown(policy()).await;
            consumer.graceful_shutdown(policy()).await;
        });
    }
}
