//! The velo rows of the demo: the same forward-pass workload through velo's
//! own anchor streams, over velo's TCP transport (its messenger mux: the
//! baseline qpmux is measured against) or over qpmux's RDMA path.
//!
//! ```text
//!  producer: per pass, every attached StreamSender sends one stamped item
//!  consumer per anchor: StreamAnchor::next ─► latency = now − stamp
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures::StreamExt;
use tokio::sync::{Mutex, Notify};
use velo::Velo;
use velo::streaming::StreamFrame;
use velo::transports::tcp::TcpTransportBuilder;

use crate::demo::{Report, Workload, open_fds, peak_rss, process_cpu, reset_peak_rss};

async fn tcp_instance() -> anyhow::Result<Velo> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let transport = TcpTransportBuilder::new()
        .from_listener(listener)?
        .build()?;
    Velo::builder()
        .add_transport(Arc::new(transport))
        .build()
        .await
}

/// Runs `workload` from one velo instance to `peers` others over velo's TCP
/// transport (`workload.streams` anchors on each).
pub async fn velo_tcp(peers: u64, workload: Workload) -> anyhow::Result<Report> {
    let producer = tcp_instance().await?;
    let mut consumers = Vec::new();
    for _ in 0..peers {
        let consumer = tcp_instance().await?;
        consumer.register_peer(producer.peer_info())?;
        producer.register_peer(consumer.peer_info())?;
        consumers.push(consumer);
    }
    let report = run(&producer, &consumers, workload).await;
    let policy = || velo_ext::ShutdownPolicy::Timeout(std::time::Duration::from_secs(1));
    producer.graceful_shutdown(policy()).await;
    for consumer in &consumers {
        consumer.graceful_shutdown(policy()).await;
    }
    report
}

async fn run(producer: &Velo, targets: &[Velo], workload: Workload) -> anyhow::Result<Report> {
    let origin = Instant::now();
    let received = Arc::new(AtomicU64::new(0));
    let progress = Arc::new(Notify::new());
    let total = workload.streams * workload.passes * targets.len() as u64;
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(total as usize)));
    let mut senders = Vec::new();
    let mut consumers = Vec::new();
    for consumer in targets
        .iter()
        .flat_map(|t| std::iter::repeat_n(t, workload.streams as usize))
    {
        let mut anchor = consumer.create_anchor::<Vec<u8>>();
        senders.push(producer.attach_anchor::<Vec<u8>>(anchor.handle()).await?);
        let (received, progress, latencies) =
            (received.clone(), progress.clone(), latencies.clone());
        consumers.push(tokio::spawn(async move {
            let mut local = Vec::new();
            while let Some(Ok(StreamFrame::Item(item))) = anchor.next().await {
                let stamp = u64::from_be_bytes(item[..8].try_into().expect("stamped"));
                local.push((origin.elapsed().as_nanos() as u64).saturating_sub(stamp));
                received.fetch_add(1, Ordering::Relaxed);
                progress.notify_one();
            }
            latencies.lock().await.extend(local);
        }));
    }
    reset_peak_rss();
    let cpu_before = process_cpu();
    let start = Instant::now();
    let mut record = vec![0u8; workload.record_size.max(16)];
    for _ in 0..workload.passes {
        for tx in &senders {
            let stamp = origin.elapsed().as_nanos() as u64;
            record[..8].copy_from_slice(&stamp.to_be_bytes());
            tx.send(record.clone()).await?;
        }
        if let Some(pace) = workload.pace {
            tokio::time::sleep(pace).await;
        }
    }
    while received.load(Ordering::Relaxed) < total {
        progress.notified().await;
    }
    let elapsed = start.elapsed();
    let cpu = process_cpu().saturating_sub(cpu_before);
    let (fds, rss) = (open_fds(), peak_rss());
    for tx in senders {
        tx.finalize()?;
    }
    for c in consumers {
        c.await?;
    }
    let mut lat = std::mem::take(&mut *latencies.lock().await);
    lat.sort_unstable();
    let pick = |q: f64| {
        lat.get(((lat.len() as f64 - 1.0) * q) as usize)
            .map_or(std::time::Duration::ZERO, |&n| {
                std::time::Duration::from_nanos(n)
            })
    };
    Ok(Report {
        records: total,
        elapsed,
        cpu,
        // velo does not expose its batches; NaN prints as such.
        records_per_batch: f64::NAN,
        p50: pick(0.5),
        p99: pick(0.99),
        peak_rss: rss,
        fds,
    })
}
