//! `qpmux`: runs the streaming demo and prints a comparison table.

use std::time::Duration;

use qpmux::demo::{self, Workload};
use qpmux::link::mem::{MemConfig, MemFabric};
use qpmux::mux::{Mux, MuxConfig, PeerId};

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async {
        println!("qpmux demo: X streams to one peer, forward-pass shape, 64 B records");
        println!("(in-process mem link: measures the mux alone; user-space numbers, loopback)");
        println!();
        println!(
            "{:<10} {:>8} {:>12} {:>14} {:>10} {:>10} {:>10}",
            "link", "streams", "records/s", "CPU µs/record", "rec/batch", "p50 µs", "p99 µs"
        );
        for (i, streams) in [1u64, 8, 64, 256].into_iter().enumerate() {
            let fabric = MemFabric::new(MemConfig::default());
            let (a, b) = (PeerId(1), PeerId(2));
            let tx = Mux::new(MuxConfig::default(), fabric.dialer(a));
            let rx = Mux::new(MuxConfig::default(), fabric.dialer(b));
            fabric.add(a, tx.clone());
            fabric.add(b, rx.clone());
            let workload = Workload {
                streams,
                passes: 20_000 / streams.max(1) + 50,
                record_size: 64,
                pace: Some(Duration::from_micros(200)).filter(|_| streams > 1),
            };
            let r = demo::run(&tx, &rx, b, i as u64, workload).await;
            println!(
                "{:<10} {:>8} {:>12.0} {:>14.2} {:>10.1} {:>10.1} {:>10.1}",
                "mem",
                streams,
                r.rate(),
                r.cpu_per_record_us(),
                r.records_per_batch,
                r.p50.as_secs_f64() * 1e6,
                r.p99.as_secs_f64() * 1e6
            );
            tx.shutdown();
            rx.shutdown();
        }
    });
}
