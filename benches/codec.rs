//! Encode and decode cost of mux batches, per record.
//!
//! `cargo bench --bench codec`. Throughput is reported in records, so
//! criterion's "elem/s" inverts to ns per record.

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use qpmux::mux::protocol::{BatchEncoder, BatchView, Epoch, FrameSeq, Lane, RecordBody, SlotId};

fn encode(buf: &mut [u8], payload: &[u8], n: usize) -> usize {
    let mut enc = BatchEncoder::new(buf, Epoch(1), 0, Lane(0)).expect("buffer fits a batch");
    for i in 0..n {
        let slot = SlotId::new(i as u32, 0).expect("index fits");
        enc.push_data(slot, FrameSeq(i as u32), payload, false)
            .expect("sized to fit");
    }
    enc.finish()
}

fn codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("codec");
    for size in [64usize, 1024] {
        let payload = vec![0x42u8; size];
        for n in [1usize, 16, 256] {
            let mut buf = vec![0u8; 16 + n * (13 + size)];
            group.throughput(Throughput::Elements(n as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("encode/{size}B"), n),
                &n,
                |b, &n| b.iter(|| black_box(encode(&mut buf, &payload, n))),
            );
            let len = encode(&mut buf, &payload, n);
            let batch = buf[..len].to_vec();
            group.bench_with_input(
                BenchmarkId::new(format!("decode/{size}B"), n),
                &n,
                |b, _| {
                    b.iter(|| {
                        let view = BatchView::new_checked(black_box(&batch)).expect("valid");
                        let mut bytes = 0usize;
                        for record in view.records() {
                            if let RecordBody::Data(d) = record.body {
                                bytes += d.len();
                            }
                        }
                        black_box(bytes)
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, codec);
criterion_main!(benches);
