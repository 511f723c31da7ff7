//! `qpmux demo`: the same streaming workload over each node kind, side by side.

use std::time::Duration;

use clap::Args as ClapArgs;
use rand::seq::SliceRandom;
use serde::Serialize;

use crate::demo::{self, Report, Workload};
use crate::link::Node;
use crate::link::mem::{MemConfig, MemFabric};
use crate::link::tcp::{TcpNodeConfig, TcpTransport};
use crate::mux::{MuxConfig, PeerId};

/// Shape of the demo run.
#[derive(Debug, Clone, ClapArgs)]
pub struct DemoArgs {
    /// Streams per peer.
    #[arg(long, default_value_t = 64)]
    pub streams: u64,
    /// Forward passes (each sends one record on every stream).
    #[arg(long, default_value_t = 400)]
    pub passes: u64,
    /// Record size in bytes (at least 16).
    #[arg(long, default_value_t = 64)]
    pub record_size: usize,
    /// Microseconds between passes (0: back to back).
    #[arg(long, default_value_t = 1000)]
    pub pace_us: u64,
}

impl Default for DemoArgs {
    fn default() -> Self {
        DemoArgs {
            streams: 64,
            passes: 400,
            record_size: 64,
            pace_us: 1000,
        }
    }
}

#[derive(Debug, Serialize)]
struct Row {
    path: &'static str,
    streams: u64,
    records: u64,
    records_per_sec: f64,
    cpu_us_per_record: f64,
    records_per_batch: f64,
    p50_us: f64,
    p99_us: f64,
    /// Open file descriptors at the end of the run (the whole process).
    fds: u64,
    /// RNR NAKs both soft devices sent; `None` on paths without RC.
    rnr_naks: Option<u64>,
    error: Option<String>,
    /// Where in the run this row ran, from 1 (rows run in a random order).
    ran: usize,
}

impl Row {
    fn new(path: &'static str, streams: u64, (r, rnr_naks): &(Report, Option<u64>)) -> Row {
        Row {
            path,
            streams,
            records: r.records,
            records_per_sec: r.rate(),
            cpu_us_per_record: r.cpu_per_record_us(),
            records_per_batch: r.records_per_batch,
            p50_us: r.p50.as_secs_f64() * 1e6,
            p99_us: r.p99.as_secs_f64() * 1e6,
            fds: r.fds,
            rnr_naks: *rnr_naks,
            error: None,
            ran: 0,
        }
    }

    fn failed(path: &'static str, streams: u64, err: &anyhow::Error) -> Row {
        Row {
            path,
            streams,
            records: 0,
            records_per_sec: f64::NAN,
            cpu_us_per_record: f64::NAN,
            records_per_batch: f64::NAN,
            p50_us: f64::NAN,
            p99_us: f64::NAN,
            fds: demo::open_fds(),
            rnr_naks: None,
            error: Some(format!("{err:#}")),
            ran: 0,
        }
    }
}

async fn mem_row(workload: Workload) -> anyhow::Result<Report> {
    let fabric = MemFabric::new(MemConfig::default());
    let a = fabric.node(PeerId(1), MuxConfig::default());
    let b = fabric.node(PeerId(2), MuxConfig::default());
    let report = demo::run_nodes(&a, &b, 1, workload).await;
    a.shutdown();
    b.shutdown();
    report
}

async fn tcp_row(workload: Workload) -> anyhow::Result<Report> {
    let loopback = "127.0.0.1:0".parse().expect("literal address");
    let a = TcpTransport::bind(
        TcpNodeConfig::new(PeerId(1)),
        loopback,
        MuxConfig::default(),
    )
    .await?;
    let b = TcpTransport::bind(
        TcpNodeConfig::new(PeerId(2)),
        loopback,
        MuxConfig::default(),
    )
    .await?;
    b.register(&a.address())?;
    let report = demo::run_nodes(&a, &b, 1, workload).await;
    a.shutdown();
    b.shutdown();
    report
}

/// The report, and the RNR NAKs both soft devices sent (read while the
/// QPs are still up: a device's counters are summed over its live QPs).
async fn rdma_row(workload: Workload) -> anyhow::Result<(Report, Option<u64>)> {
    let a = super::rdma_node(1).await?;
    let b = super::rdma_node(2).await?;
    b.register(&a.address())?;
    let report = demo::run_nodes(&a, &b, 1, workload).await;
    tracing::debug!(stats = ?a.device().stats(), "soft device after the rdma row");
    let rnr_naks = a.device().counters().rnr_naks_sent + b.device().counters().rnr_naks_sent;
    a.shutdown();
    b.shutdown();
    Ok((report?, Some(rnr_naks)))
}

pub async fn run(args: DemoArgs, json: bool) -> anyhow::Result<()> {
    let pace = (args.pace_us > 0).then(|| Duration::from_micros(args.pace_us));
    let workload = Workload::new(args.streams, args.passes, args.record_size, pace);
    let mut paths = vec!["qpmux-rdma", "qpmux-tcp", "mem"];
    if cfg!(feature = "velo") {
        paths.extend(["velo-tcp-mux", "velo-tcp-stream"]);
    }
    let bar = super::progress_bar(paths.len() as u64, json);
    // Run in a random order and shown in a fixed one: in one process each
    // row runs after the others' leftovers, and a fixed order would lean
    // the same way every time (the sweep balances its order for the same
    // reason: docs/benchmarks.md § "V6").
    let mut order: Vec<usize> = (0..paths.len()).collect();
    order.shuffle(&mut rand::rng());
    let mut rows: Vec<Option<Row>> = paths.iter().map(|_| None).collect();
    for (place, &index) in order.iter().enumerate() {
        let path = paths[index];
        bar.set_message(format!(
            "{path}: {} streams × {} passes",
            args.streams, args.passes
        ));
        let report = match path {
            "mem" => mem_row(workload).await.map(|r| (r, None)),
            "qpmux-rdma" => rdma_row(workload).await,
            #[cfg(feature = "velo")]
            "velo-tcp-mux" => {
                use super::velo_rows::{VeloPath, velo_tcp};
                velo_tcp(VeloPath::MessengerMux, 1, workload)
                    .await
                    .map(|r| (r, None))
            }
            #[cfg(feature = "velo")]
            "velo-tcp-stream" => {
                use super::velo_rows::{VeloPath, velo_tcp};
                velo_tcp(VeloPath::PerStream, 1, workload)
                    .await
                    .map(|r| (r, None))
            }
            "qpmux-tcp" => tcp_row(workload).await.map(|r| (r, None)),
            other => anyhow::bail!("unknown path {other}"),
        };
        let mut row = match report {
            Ok(report) => Row::new(path, args.streams, &report),
            // The per-stream path can run out of descriptors: a row, not a crash.
            Err(err) => Row::failed(path, args.streams, &err),
        };
        row.ran = place + 1;
        rows[index] = Some(row);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let rows: Vec<Row> = rows.into_iter().flatten().collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "qpmux demo: {} streams to one peer, {} B records, forward passes {}",
        args.streams,
        workload.record_size,
        pass_schedule(&args, &rows)
    );
    println!("(qpmux-rdma: the soft RoCEv2 provider, user space over loopback UDP, against");
    println!(" kernel TCP on loopback; mem: the mux with no wire; velo-tcp-mux: velo's own");
    println!(" anchor streams over its TCP transport and messenger mux; velo-tcp-stream: the");
    println!(
        " same over velo's per-stream path, one connection per stream. Not hardware numbers.)"
    );
    println!();
    println!(
        "{:<15} {:>12} {:>14} {:>10} {:>10} {:>10} {:>6} {:>9}",
        "path", "records/s", "CPU µs/record", "rec/batch", "p50 µs", "p99 µs", "fds", "RNR NAKs"
    );
    for r in &rows {
        if let Some(err) = &r.error {
            println!("{:<15} failed: {err}", r.path);
            continue;
        }
        let rnr = r.rnr_naks.map_or("–".to_string(), |n| n.to_string());
        println!(
            "{:<15} {:>12.0} {:>14.2} {:>10} {:>10.1} {:>10.1} {:>6} {:>9}",
            r.path,
            r.records_per_sec,
            r.cpu_us_per_record,
            super::records_per_batch_column(r.records_per_batch),
            r.p50_us,
            r.p99_us,
            r.fds,
            rnr
        );
    }
    println!("(fds: the whole process's descriptors at the end of the row; RNR NAKs: sent");
    println!(" by either soft device, none expected: link credit is receive posts)");
    let ran: Vec<&str> = order.iter().map(|&i| paths[i]).collect();
    println!("(rows ran in a random order, this time {})", ran.join(", "));
    Ok(())
}

/// The pace asked for and, when it is not back to back, the mean period the
/// rows ran at: under [`demo::SHORTEST_GRID`] tokio's millisecond timer
/// stretches it (one pass per ms runs about every 2 ms).
fn pass_schedule(args: &DemoArgs, rows: &[Row]) -> String {
    if args.pace_us == 0 {
        return "back to back".to_string();
    }
    let periods: Vec<f64> = rows
        .iter()
        .filter(|r| r.error.is_none() && r.records_per_sec > 0.0)
        .map(|r| args.streams as f64 / r.records_per_sec * 1e6)
        .collect();
    if periods.is_empty() {
        return format!("paced at {} µs", args.pace_us);
    }
    let mean = periods.iter().sum::<f64>() / periods.len() as f64;
    format!("paced at {} µs (ran one every {mean:.0} µs)", args.pace_us)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The RDMA row carries the soft devices' RNR NAK count (none: link
    /// credit is receive posts) and its descriptors; the TCP row has no RNR.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_rdma_row_reports_rnr_naks_and_descriptors() {
        let workload = Workload::new(8, 20, 64, None);
        let rdma = Row::new(
            "qpmux-rdma",
            8,
            &rdma_row(workload).await.expect("rdma row"),
        );
        assert_eq!(rdma.records, 8 * 20);
        assert_eq!(rdma.rnr_naks, Some(0));
        assert!(rdma.fds > 0);
        let tcp = tcp_row(workload).await.expect("tcp row");
        let tcp = Row::new("qpmux-tcp", 8, &(tcp, None));
        assert_eq!(tcp.rnr_naks, None);
    }

    /// The header says what schedule the rows ran: the pace asked for and
    /// the mean period of the rows that ran, a failed row left out.
    #[test]
    fn the_header_reports_the_period_the_rows_ran() {
        let args = DemoArgs::default();
        let ran = |records_per_sec: f64| Row {
            records_per_sec,
            ..Row::failed("qpmux-tcp", args.streams, &anyhow::anyhow!("x"))
        };
        let mut rows = vec![
            Row {
                error: None,
                ..ran(32_000.0)
            },
            Row {
                error: None,
                ..ran(32_000.0 / 1.5)
            },
        ];
        assert_eq!(
            pass_schedule(&args, &rows),
            "paced at 1000 µs (ran one every 2500 µs)"
        );
        rows.push(ran(f64::NAN));
        assert_eq!(
            pass_schedule(&args, &rows),
            "paced at 1000 µs (ran one every 2500 µs)"
        );
        assert_eq!(pass_schedule(&args, &rows[2..]), "paced at 1000 µs");
        let back_to_back = DemoArgs {
            pace_us: 0,
            ..DemoArgs::default()
        };
        assert_eq!(pass_schedule(&back_to_back, &rows), "back to back");
    }
}
