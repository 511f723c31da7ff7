//! velo over qpmux mem nodes vs velo's own TCP transport on loopback: unary
//! echo round trips, one at a time.
//!
//! `cargo bench --bench velo`. The mem link has no wire cost, so the qpmux
//! number is the adapter plus the mux plus velo; TCP adds the kernel.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use qpmux::link::mem::{MemConfig, MemFabric};
use qpmux::mux::{MuxConfig, PeerId};
use qpmux::velo::{QpmuxTransport, VeloConfig};
use velo::transports::tcp::TcpTransportBuilder;
use velo::{Handler, Velo, ext::Transport};

async fn pair(make: &mut dyn FnMut(u64) -> Arc<dyn Transport>) -> (Velo, Velo) {
    let server = Velo::builder()
        .add_transport(make(1))
        .build()
        .await
        .expect("server");
    let client = Velo::builder()
        .add_transport(make(2))
        .build()
        .await
        .expect("client");
    client.register_peer(server.peer_info()).expect("register");
    server.register_peer(client.peer_info()).expect("register");
    server
        .register_handler(Handler::unary_handler("echo", |ctx| Ok(Some(ctx.payload))).build())
        .expect("handler");
    client
        .wait_for_handler(server.instance_id(), "echo")
        .await
        .expect("visible");
    (server, client)
}

async fn round_trips(server: &Velo, client: &Velo, n: u64) -> Duration {
    let payload = Bytes::from_static(&[7; 64]);
    let start = Instant::now();
    for _ in 0..n {
        client
            .unary("echo")
            .expect("builder")
            .raw_payload(payload.clone())
            .instance(server.instance_id())
            .send()
            .await
            .expect("echo");
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("velo_unary_64B");
    let fabric = rt.block_on(async { MemFabric::new(MemConfig::default()) });
    let (server, client) = rt.block_on(pair(&mut |id| {
        let node = Arc::new(fabric.node(PeerId(id), MuxConfig::default()));
        Arc::new(QpmuxTransport::new(node, VeloConfig::default())) as Arc<dyn Transport>
    }));
    group.bench_function("qpmux_mem", |b| {
        b.iter_custom(|n| rt.block_on(round_trips(&server, &client, n)))
    });
    let (server, client) = rt.block_on(pair(&mut |_| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let tcp = TcpTransportBuilder::new()
            .from_listener(listener)
            .expect("listener")
            .build()
            .expect("tcp");
        Arc::new(tcp) as Arc<dyn Transport>
    }));
    group.bench_function("velo_tcp_loopback", |b| {
        b.iter_custom(|n| rt.block_on(round_trips(&server, &client, n)))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
