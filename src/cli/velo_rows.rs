//! The velo rows of the demo and the sweep: the same forward-pass workload
//! through velo's own anchor streams over velo's TCP transports, either its
//! messenger mux (every stream to a peer on one connection) or its
//! per-stream path (`tcp-stream`: one connection per stream, selected with
//! `MuxConfig { enabled: false, .. }`), the baselines qpmux is measured
//! against.
//!
//! ```text
//!  attach every anchor ─► priming: one record per stream, all must arrive
//!  producer: per pass, every fast StreamSender sends one stamped item
//!  consumer per anchor: StreamAnchor::next_bytes ─► latency = now − stamp
//! ```
//!
//! A per-stream path out of descriptors does not fail loudly: the dialer's
//! socket opens but the listener cannot accept, so the stream is silent.
//! Priming turns that into a [`StreamWall`] naming how many streams did work.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Mutex;
use velo::Velo;
use velo::streaming::StreamFrame;
use velo::transports::tcp::TcpTransportBuilder;

use crate::demo::{
    Countdown, Pacer, Report, SIDE_FILL, StreamWall, Workload, open_fds, peak_rss, percentiles,
    process_cpu, process_runs, producer_watched, reset_peak_rss,
};

/// Which of velo's streaming paths carries the anchors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VeloPath {
    /// The messenger mux (`messenger-mux-v2`), velo's default.
    MessengerMux,
    /// One TCP connection per stream (`tcp-stream`).
    PerStream,
}

async fn tcp_instance(path: VeloPath) -> anyhow::Result<Velo> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let transport = TcpTransportBuilder::new()
        .from_listener(listener)?
        .build()?;
    let builder = Velo::builder()
        .add_transport(Arc::new(transport))
        .stream_bind_addr(std::net::Ipv4Addr::LOCALHOST.into());
    let builder = match path {
        VeloPath::MessengerMux => builder,
        VeloPath::PerStream => builder.messenger_mux(velo::streaming::MuxConfig {
            enabled: false,
            ..Default::default()
        })?,
    };
    builder.build().await
}

/// Runs `workload` from one velo instance to `peers` others over velo's TCP
/// transports (`workload.streams` anchors on each). Fails with a
/// [`StreamWall`] when the path cannot carry that many streams.
pub async fn velo_tcp(path: VeloPath, peers: u64, workload: Workload) -> anyhow::Result<Report> {
    let producer = tcp_instance(path).await?;
    let mut consumers = Vec::new();
    for _ in 0..peers {
        let consumer = tcp_instance(path).await?;
        consumer.register_peer(producer.peer_info())?;
        producer.register_peer(consumer.peer_info())?;
        consumers.push(consumer);
    }
    let report = run(&producer, &consumers, workload).await;
    let policy = || velo_ext::ShutdownPolicy::Timeout(Duration::from_secs(1));
    producer.graceful_shutdown(policy()).await;
    for consumer in &consumers {
        consumer.graceful_shutdown(policy()).await;
    }
    report
}

/// A record: 8-byte stamp (nanoseconds since `origin`), 1 byte "priming".
/// Stamped in `buf` just before it is sent: `send_bytes` then makes the
/// frame in one allocation and one copy, as the qpmux rows' send does.
fn stamp(buf: &mut [u8], origin: Instant, priming: bool) -> &[u8] {
    stamped(buf, origin.elapsed().as_nanos() as u64, priming)
}

/// A record stamped `stamp` in `buf`, as [`stamp`] writes it.
fn stamped(buf: &mut [u8], stamp: u64, priming: bool) -> &[u8] {
    buf[..8].copy_from_slice(&stamp.to_be_bytes());
    buf[8] = u8::from(priming);
    buf
}

async fn run(producer: &Velo, targets: &[Velo], workload: Workload) -> anyhow::Result<Report> {
    workload.check(targets.len())?;
    let origin = Instant::now();
    let wanted = workload.streams * targets.len() as u64;
    let total = workload.timed_streams() * workload.passes * targets.len() as u64;
    let primed = Arc::new(Countdown::new(wanted));
    let received = Arc::new(Countdown::new(total));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(total as usize)));
    let mut senders = Vec::new();
    // Timed consumers (awaited at the end); untimed consumers and slow
    // producers (stopped at the end).
    let mut tasks = Vec::new();
    let mut slow_tasks = Vec::new();
    let mut slow_senders = Vec::new();
    let wall = |carried: u64, reason: String| StreamWall {
        carried,
        wanted,
        reason,
    };
    for (consumer, s) in targets
        .iter()
        .flat_map(|t| (0..workload.streams).map(move |s| (t, s)))
    {
        let untimed = s < workload.untimed_streams;
        // Bytes items on velo's serde-free path (`send_bytes`, `next_bytes`):
        // its fastest for records the application already encoded.
        let mut anchor = consumer.create_anchor::<Bytes>();
        let sender = match producer.attach_anchor::<Bytes>(anchor.handle()).await {
            Ok(sender) => sender,
            Err(err) => {
                abort_all(&tasks);
                abort_all(&slow_tasks);
                let carried = (senders.len() + slow_senders.len()) as u64;
                return Err(wall(carried, format!("attach: {err}")).into());
            }
        };
        let (primed, received, latencies) = (primed.clone(), received.clone(), latencies.clone());
        let delay = workload.slow_consumer;
        let consumer = tokio::spawn(async move {
            let mut local = Vec::new();
            while let Some(Ok(StreamFrame::Item(item))) = anchor.next_bytes().await {
                if item.get(8) == Some(&1) {
                    primed.tick();
                } else if untimed {
                    if let Some(delay) = delay {
                        tokio::time::sleep(delay).await;
                    }
                    continue;
                } else {
                    let stamp = u64::from_be_bytes(item[..8].try_into().expect("stamped"));
                    local.push((origin.elapsed().as_nanos() as u64).saturating_sub(stamp));
                    received.tick();
                }
            }
            latencies.lock().await.extend(local);
        });
        if untimed {
            slow_tasks.push(consumer);
            slow_senders.push(sender);
        } else {
            tasks.push(consumer);
            senders.push(sender);
        }
    }
    let mut buf = vec![0u8; workload.record_size.max(16)];
    for tx in senders.iter().chain(&slow_senders) {
        if let Err(err) = tx.send_bytes(stamp(&mut buf, origin, true)).await {
            abort_all(&tasks);
            abort_all(&slow_tasks);
            let carried = primed.count();
            return Err(wall(carried, format!("priming send: {err}")).into());
        }
    }
    let patience = workload.patience();
    if let Err(carried) = primed.reached(patience).await {
        abort_all(&tasks);
        abort_all(&slow_tasks);
        let reason = format!(
            "{} streams silent for {patience:?} ({} descriptors open)",
            wanted - carried,
            open_fds()
        );
        return Err(wall(carried, reason).into());
    }
    if workload.slow_consumer.is_some() {
        for tx in slow_senders {
            let mut buf = buf.clone();
            slow_tasks.push(tokio::spawn(async move {
                // Held by velo's pushback (its credit window, a socket's
                // buffer) while the consumer sleeps.
                while tx.send_bytes(stamp(&mut buf, origin, false)).await.is_ok() {}
            }));
        }
        tokio::time::sleep(SIDE_FILL).await;
    }
    let rss_before = reset_peak_rss();
    let cpu_before = process_cpu();
    let runs_before = process_runs();
    let start = Instant::now();
    // A runtime task, as in `demo::run` (the qpmux rows).
    let mut producer = tokio::spawn(async move {
        let mut pacer = Pacer::new(workload.pace);
        for _ in 0..workload.passes {
            pacer.start_pass().await;
            for tx in &senders {
                let at = pacer.stamp(origin);
                pacer
                    .send(tx.send_bytes(stamped(&mut buf, at, false)))
                    .await?;
            }
        }
        anyhow::Ok((senders, pacer.held()))
    });
    // Watched while the producer runs, as in `demo::run`.
    let (senders, held) = match producer_watched(&mut producer, &received, patience).await {
        Ok(senders) => senders?,
        Err(err) => {
            abort_all(&tasks);
            abort_all(&slow_tasks);
            return Err(err);
        }
    };
    if let Err(seen) = received.reached(patience).await {
        abort_all(&tasks);
        abort_all(&slow_tasks);
        anyhow::bail!("{seen} of {total} records arrived, then none for {patience:?}");
    }
    let elapsed = start.elapsed();
    let cpu = process_cpu().saturating_sub(cpu_before);
    let cpu_runs = process_runs().saturating_sub(runs_before);
    let (fds, rss) = (open_fds(), peak_rss());
    abort_all(&slow_tasks);
    for tx in senders {
        tx.finalize()?;
    }
    // A stream's end that does not come fails the cell, not the whole run:
    // no stream ending for `patience`, as every wait before this one. The
    // others are stopped on any failure.
    for i in 0..tasks.len() {
        let ended = match tokio::time::timeout(patience, &mut tasks[i]).await {
            Ok(Ok(())) => continue,
            Ok(Err(err)) => anyhow::Error::from(err),
            Err(_) => anyhow::anyhow!(
                "{} streams not ended, and none for {patience:?}",
                tasks.len() - i
            ),
        };
        abort_all(&tasks);
        return Err(ended);
    }
    let (p50, p99) = percentiles(std::mem::take(&mut *latencies.lock().await));
    Ok(Report {
        records: total,
        elapsed,
        cpu,
        cpu_runs,
        // velo does not expose its batches or its credit stalls: NaN,
        // printed as "–".
        records_per_batch: f64::NAN,
        credit_stalls: None,
        held,
        p50,
        p99,
        peak_rss: rss,
        rss_growth: rss.saturating_sub(rss_before),
        fds,
        // velo's internals carry no stage marks.
        stages: None,
        stages_slowest: None,
    })
}

fn abort_all(tasks: &[tokio::task::JoinHandle<()>]) {
    for task in tasks {
        task.abort();
    }
}
