//! velo three ways, side by side in one run, two velo instances in one
//! process on a 2-worker tokio runtime:
//!
//! ```text
//!  tcp_messenger_mux    velo TCP transport (loopback)        ─ velo messenger mux ─ anchor streams
//!  qpmux_messenger_mux  QpmuxTransport<RdmaTransport<Soft>>  ─ velo messenger mux ─ anchor streams
//!  qpmux_native         QpmuxFrameTransport (same node kind) ─ one mux slot per stream
//! ```
//!
//! Workloads: one anchor stream of 64 B and of 4 KiB items (time per item),
//! and a 64 B unary echo loop (time per round trip; the native path has no
//! unary of its own, so its row is the messenger over qpmux, as is
//! `qpmux_mem`, the same over the mem link). The soft provider is user space
//! RoCEv2 over loopback UDP, not hardware. `cargo bench --bench velo`;
//! results in docs/benchmarks.md § "Velo three-way (issue 7)".

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures::StreamExt;
use qpmux::link::mem::{MemConfig, MemFabric};
use qpmux::link::rdma::{RdmaNodeConfig, RdmaTransport};
use qpmux::mux::{MuxConfig, PeerId};
use qpmux::velo::{QpmuxTransport, VeloConfig};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use velo::messenger::Messenger;
use velo::streaming::{AnchorManager, AnchorManagerBuilder, FrameTransport, StreamFrame};
use velo::transports::tcp::TcpTransportBuilder;
use velo::{Handler, Velo, ext::Transport};

/// One side of a pair: its messenger (active messages) and its anchors.
struct Side {
    messenger: Arc<Messenger>,
    anchors: Anchors,
}

enum Anchors {
    /// velo's own anchor manager (messenger mux streams).
    Velo(Velo),
    /// An anchor manager over qpmux's native slots.
    Native(Arc<AnchorManager>),
}

impl Side {
    fn anchors(&self) -> &AnchorManager {
        match &self.anchors {
            Anchors::Velo(velo) => velo.anchor_manager(),
            Anchors::Native(manager) => manager,
        }
    }
}

async fn velo_side(transport: Arc<dyn Transport>) -> Side {
    let velo = Velo::builder()
        .add_transport(transport)
        .build()
        .await
        .expect("velo");
    Side {
        messenger: velo.messenger().clone(),
        anchors: Anchors::Velo(velo),
    }
}

async fn rdma_node(id: u64) -> Arc<RdmaTransport<SoftDevice>> {
    let device = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device");
    Arc::new(
        RdmaTransport::start(device, RdmaNodeConfig::new(PeerId(id)))
            .await
            .expect("rdma node"),
    )
}

fn velo_tcp() -> Arc<dyn Transport> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    Arc::new(
        TcpTransportBuilder::new()
            .from_listener(listener)
            .expect("listener")
            .build()
            .expect("tcp"),
    )
}

async fn native_side(id: u64) -> Side {
    let transport = Arc::new(QpmuxTransport::new(
        rdma_node(id).await,
        VeloConfig::default(),
    ));
    let frames = Arc::new(transport.frame_transport(VeloConfig::default()));
    let messenger = Messenger::builder()
        .add_transport(transport as Arc<dyn Transport>)
        .build()
        .await
        .expect("messenger");
    let manager = Arc::new(
        AnchorManagerBuilder::default()
            .worker_id(messenger.instance_id().worker_id())
            .transport(frames as Arc<dyn FrameTransport>)
            .build()
            .expect("anchor manager"),
    );
    manager
        .register_handlers(messenger.clone())
        .expect("control plane");
    Side {
        messenger,
        anchors: Anchors::Native(manager),
    }
}

/// Joins the sides and installs the echo handler on the server.
async fn pair(server: Side, client: Side) -> (Side, Side) {
    client
        .messenger
        .register_peer(server.messenger.peer_info())
        .expect("register");
    server
        .messenger
        .register_peer(client.messenger.peer_info())
        .expect("register");
    server
        .messenger
        .register_handler(Handler::unary_handler("echo", |ctx| Ok(Some(ctx.payload))).build())
        .expect("handler");
    client
        .messenger
        .wait_for_handler(server.messenger.instance_id(), "echo")
        .await
        .expect("visible");
    (server, client)
}

async fn round_trips(server: &Side, client: &Side, n: u64) -> Duration {
    let payload = Bytes::from_static(&[7; 64]);
    let target = server.messenger.instance_id();
    let start = Instant::now();
    for _ in 0..n {
        client
            .messenger
            .unary("echo")
            .expect("builder")
            .raw_payload(payload.clone())
            .instance(target)
            .send()
            .await
            .expect("echo");
    }
    start.elapsed()
}

/// One stream of `n` copies of `item` from `producer` to `consumer`'s
/// anchor, up to its `Finalized` (attach not timed).
async fn stream(consumer: &Side, producer: &Side, item: &str, n: u64) -> Duration {
    let mut anchor = consumer.anchors().create_anchor::<String>();
    let sender = producer
        .anchors()
        .attach_stream_anchor::<String>(anchor.handle())
        .await
        .expect("attach");
    let item = item.to_owned();
    let start = Instant::now();
    let produce = tokio::spawn(async move {
        for _ in 0..n {
            sender.send(item.clone()).await.expect("send");
        }
        sender.finalize().expect("finalize");
    });
    let mut seen = 0u64;
    while let Some(frame) = anchor.next().await {
        match frame.expect("no stream error") {
            StreamFrame::Item(_) => seen += 1,
            StreamFrame::Finalized => break,
            other => panic!("unexpected frame {other:?}"),
        }
    }
    produce.await.expect("producer");
    assert_eq!(seen, n);
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let paths: Vec<(&str, Side, Side)> = rt.block_on(async {
        let (tcp_server, tcp_client) =
            pair(velo_side(velo_tcp()).await, velo_side(velo_tcp()).await).await;
        let qpmux = |id| async move {
            let node = rdma_node(id).await;
            velo_side(Arc::new(QpmuxTransport::new(node, VeloConfig::default()))).await
        };
        let (mm_server, mm_client) = pair(qpmux(1).await, qpmux(2).await).await;
        let (native_server, native_client) = pair(native_side(3).await, native_side(4).await).await;
        vec![
            ("tcp_messenger_mux", tcp_server, tcp_client),
            ("qpmux_messenger_mux", mm_server, mm_client),
            ("qpmux_native", native_server, native_client),
        ]
    });

    for (label, size) in [("stream_64B", 64), ("stream_4KiB", 4096)] {
        let item = "x".repeat(size);
        let mut group = c.benchmark_group(format!("velo_{label}"));
        group.throughput(Throughput::Elements(1));
        for (path, consumer, producer) in &paths {
            group.bench_function(*path, |b| {
                b.iter_custom(|n| rt.block_on(stream(consumer, producer, &item, n)))
            });
        }
        group.finish();
    }

    let mut group = c.benchmark_group("velo_unary_64B");
    for (path, server, client) in &paths[..2] {
        group.bench_function(*path, |b| {
            b.iter_custom(|n| rt.block_on(round_trips(server, client, n)))
        });
    }
    let fabric = rt.block_on(async { MemFabric::new(MemConfig::default()) });
    let (server, client) = rt.block_on(async {
        let mem = |id| {
            let node = Arc::new(fabric.node(PeerId(id), MuxConfig::default()));
            velo_side(Arc::new(QpmuxTransport::new(node, VeloConfig::default())))
        };
        pair(mem(11).await, mem(12).await).await
    });
    group.bench_function("qpmux_mem", |b| {
        b.iter_custom(|n| rt.block_on(round_trips(&server, &client, n)))
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
