//! Records per second through the mux over the RDMA link (soft provider,
//! loopback UDP) against the mux over the in-process mem link.
//!
//! `cargo bench --bench link`. X streams in {1, 8, 64} from node A to node
//! B, 64-byte records, 4,096 records per iteration split evenly over the
//! streams; time stops when B's consumers have them all.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qpmux::link::Link;
use qpmux::link::mem::{MemConfig, MemFabric};
use qpmux::link::rdma::{RdmaConfig, RdmaLink, pair};
use qpmux::mux::{
    Dialer, Epoch, Frame, Mux, MuxConfig, MuxTransport, PeerId, SlotSender, StreamKey,
};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use tokio::runtime::Runtime;
use tokio::sync::Notify;

const A: PeerId = PeerId(1);
const B: PeerId = PeerId(2);
const RECORDS: u64 = 4096;
const RECORD: usize = 64;

/// Dials nothing: the bench attaches one link pair up front.
struct NoDialer;

impl Dialer for NoDialer {
    fn want_link(&self, _peer: PeerId) {}
}

struct Counter {
    got: AtomicU64,
    notify: Notify,
}

impl Counter {
    async fn wait_for(&self, target: u64) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.got.load(Ordering::Acquire) >= target {
                return;
            }
            notified.await;
        }
    }
}

/// Opens `streams` slots A → B with consumers counting records.
fn streams<L: Link>(a: &Mux<L>, b: &Mux<L>, streams: u64) -> (Vec<SlotSender>, Arc<Counter>) {
    let counter = Arc::new(Counter {
        got: AtomicU64::new(0),
        notify: Notify::new(),
    });
    let mut senders = Vec::new();
    for s in 0..streams {
        let key = StreamKey::new(9, s);
        let mut rx = b.bind(key).expect("bind");
        let counter = counter.clone();
        tokio::spawn(async move {
            while let Some(frame) = rx.recv().await {
                if let Frame::Data(_) = frame {
                    counter.got.fetch_add(1, Ordering::AcqRel);
                    counter.notify.notify_waiters();
                }
            }
        });
        senders.push(a.open(B, key).expect("open"));
    }
    (senders, counter)
}

async fn run(senders: &mut [SlotSender], counter: &Counter, iters: u64) -> Duration {
    let per_stream = RECORDS / senders.len() as u64;
    let record = Bytes::from(vec![0x5a; RECORD]);
    let start = Instant::now();
    for _ in 0..iters {
        let target = counter.got.load(Ordering::Acquire) + per_stream * senders.len() as u64;
        for _ in 0..per_stream {
            for tx in senders.iter_mut() {
                tx.send(record.clone()).await.expect("send");
            }
        }
        counter.wait_for(target).await;
    }
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("mux_64B_records");
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Elements(RECORDS));
    for x in [1u64, 8, 64] {
        bench_mem(&rt, &mut group, x);
        bench_rdma(&rt, &mut group, x);
    }
    group.finish();
}

fn bench_mem(
    rt: &Runtime,
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    x: u64,
) {
    let (mut senders, counter, _keep) = rt.block_on(async {
        let fabric = MemFabric::new(MemConfig::default());
        let a = Mux::new(MuxConfig::default(), fabric.dialer(A));
        let b = Mux::new(MuxConfig::default(), fabric.dialer(B));
        fabric.add(A, a.clone());
        fabric.add(B, b.clone());
        fabric.connect(A, B);
        let (senders, counter) = streams(&a, &b, x);
        (senders, counter, (fabric, a, b))
    });
    group.bench_function(BenchmarkId::new("mem", x), |bench| {
        bench.iter_custom(|iters| rt.block_on(run(&mut senders, &counter, iters)));
    });
}

fn bench_rdma(
    rt: &Runtime,
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    x: u64,
) {
    let (mut senders, counter, _keep) = rt.block_on(async {
        let da = SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("dev");
        let db = SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("dev");
        let a: Mux<RdmaLink<SoftDevice>> = Mux::new(MuxConfig::default(), Arc::new(NoDialer));
        let b = Mux::new(MuxConfig::default(), Arc::new(NoDialer));
        let (la, lb) = pair(&da, &db, Epoch(1), RdmaConfig::default()).expect("pair");
        a.attach(B, la);
        b.attach(A, lb);
        let (senders, counter) = streams(&a, &b, x);
        (senders, counter, (da, db, a, b))
    });
    group.bench_function(BenchmarkId::new("rdma_soft_udp", x), |bench| {
        bench.iter_custom(|iters| rt.block_on(run(&mut senders, &counter, iters)));
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
