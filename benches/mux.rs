//! The mux over the in-process mem link: records/s for X streams to one peer
//! in the forward-pass shape (each pass, every stream sends one record).
//!
//! `cargo bench --bench mux`. Prints records per batch for each X after its
//! measurement; the mem link has no wire cost, so this isolates the mux.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qpmux::link::mem::{MemConfig, MemFabric, MemLink};
use qpmux::mux::{Frame, Mux, MuxConfig, MuxTransport, PeerId, SlotSender, StreamKey};
use tokio::sync::Notify;

const PASSES: u64 = 200;
const RECORD: usize = 64;

struct Setup {
    sender: Mux<MemLink>,
    txs: Vec<SlotSender>,
    received: Arc<AtomicU64>,
    progress: Arc<Notify>,
}

async fn setup(streams: u64) -> Setup {
    let fabric = MemFabric::new(MemConfig::default());
    let (a, b) = (PeerId(1), PeerId(2));
    let sender = Mux::new(MuxConfig::default(), fabric.dialer(a));
    let receiver = Mux::new(MuxConfig::default(), fabric.dialer(b));
    fabric.add(a, sender.clone());
    fabric.add(b, receiver.clone());
    let received = Arc::new(AtomicU64::new(0));
    let progress = Arc::new(Notify::new());
    let mut txs = Vec::new();
    for s in 0..streams {
        let key = StreamKey::new(1, s);
        let mut rx = receiver.bind(key).expect("bind");
        let (received, progress) = (received.clone(), progress.clone());
        tokio::spawn(async move {
            while let Some(Frame::Data(_)) = rx.recv().await {
                received.fetch_add(1, Ordering::Relaxed);
                progress.notify_one();
            }
        });
        txs.push(sender.open(b, key).expect("open"));
    }
    // Keep the fabric (and the receiving mux) alive with the sender.
    std::mem::forget(fabric);
    std::mem::forget(receiver);
    Setup {
        sender,
        txs,
        received,
        progress,
    }
}

async fn run_passes(setup: &mut Setup, passes: u64) -> Duration {
    let record = Bytes::from(vec![7u8; RECORD]);
    let start = Instant::now();
    let target = setup.received.load(Ordering::Relaxed) + passes * setup.txs.len() as u64;
    for _ in 0..passes {
        for tx in &mut setup.txs {
            tx.send(record.clone()).await.expect("send");
        }
    }
    while setup.received.load(Ordering::Relaxed) < target {
        setup.progress.notified().await;
    }
    start.elapsed()
}

fn mux(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("mux_mem");
    group.sample_size(10);
    for streams in [1u64, 8, 64, 256] {
        let mut setup = rt.block_on(setup(streams));
        // One stream sends as many records per pass-equivalent as 64 do.
        let passes = if streams == 1 {
            PASSES * 64
        } else {
            PASSES.max(12_800 / streams)
        };
        group.throughput(Throughput::Elements(passes * streams));
        group.bench_with_input(BenchmarkId::new("streams", streams), &streams, |b, _| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        total += run_passes(&mut setup, passes).await;
                    }
                    total
                })
            })
        });
        let stats = setup.sender.stats();
        eprintln!(
            "mux_mem/streams/{streams}: records per batch {:.1}, credit stalls {}",
            stats.records_per_batch(),
            stats.credit_stalls
        );
    }
    group.finish();
}

criterion_group!(benches, mux);
criterion_main!(benches);
