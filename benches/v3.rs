//! V3: the cost model's constants measured directly.
//!
//! `cargo bench --bench v3`:
//! - `wake/round_trip`: one task wakes another and is woken back (w, twice);
//! - `tcp/write_each` vs `tcp/write_once`: N 64 B writes vs one N×64 B write on
//!   loopback TCP (s, the per-write syscall and TCP cost);
//! - encode e and framing p come from `--bench codec`.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn wake(c: &mut Criterion) {
    let rt = runtime();
    let (ping_tx, ping_rx) = flume::bounded::<u64>(1);
    let (pong_tx, pong_rx) = flume::bounded::<u64>(1);
    rt.spawn(async move {
        while let Ok(n) = ping_rx.recv_async().await {
            if pong_tx.send_async(n).await.is_err() {
                break;
            }
        }
    });
    let mut group = c.benchmark_group("wake");
    group.throughput(Throughput::Elements(1));
    group.bench_function("round_trip", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for n in 0..iters {
                    ping_tx.send_async(n).await.expect("echo task");
                    pong_rx.recv_async().await.expect("echo task");
                }
                start.elapsed()
            })
        })
    });
    group.finish();
}

async fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
    let client = client.expect("connect");
    client.set_nodelay(true).expect("nodelay");
    (client, server.expect("accept").0)
}

fn tcp(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("tcp");
    for n in [1usize, 16, 256] {
        let record = [0x42u8; 64];
        let batch = vec![0x42u8; 64 * n];
        group.throughput(Throughput::Elements(n as u64));
        for once in [false, true] {
            let name = if once { "write_once" } else { "write_each" };
            group.bench_with_input(BenchmarkId::new(name, n), &n, |b, &n| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let (mut tx, mut rx) = tcp_pair().await;
                        let total = 64 * n * iters as usize;
                        let reader = tokio::spawn(async move {
                            let mut buf = vec![0u8; 1 << 16];
                            let mut got = 0;
                            while got < total {
                                got += rx.read(&mut buf).await.expect("read");
                            }
                        });
                        let start = Instant::now();
                        for _ in 0..iters {
                            if once {
                                tx.write_all(&batch).await.expect("write");
                            } else {
                                for _ in 0..n {
                                    tx.write_all(&record).await.expect("write");
                                }
                            }
                        }
                        reader.await.expect("reader");
                        start.elapsed()
                    })
                })
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = wake, tcp
}
criterion_main!(benches);
