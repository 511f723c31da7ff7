//! `qpmux bench sweep` (V5): X streams per peer × Y peers on each path
//! (qpmux over RDMA and TCP, and velo's own TCP messenger mux), in
//! one process, one cell after the other; JSON plus SVG plots.
//!
//! ```text
//!  for path in paths, for Y, for X: fresh nodes ─► demo::run (paced passes) ─► Cell
//!  cells ─► sweep.json ─► cpu_per_record.svg, p99_latency.svg (one line per path and Y)
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args as ClapArgs;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::plot;
use crate::demo::{self, Report, Workload};
use crate::link::Node;
use crate::link::rdma::{self, RdmaConfig};
use crate::link::tcp::{TcpNodeConfig, TcpTransport};
use crate::mux::protocol::Epoch;
use crate::mux::{Dialer, Mux, MuxConfig, PeerId};
use crate::verbs::soft::SoftDevice;
use crate::verbs::soft::udp::UdpConfig;

/// Arguments of `qpmux bench sweep`.
#[derive(Debug, Clone, ClapArgs)]
pub struct SweepArgs {
    /// A ~2-minute subset: X ∈ {1, 64, 1024}, Y ∈ {1, 8}.
    #[arg(long)]
    pub quick: bool,
    /// Record size in bytes.
    #[arg(long, default_value_t = 64)]
    pub record_size: usize,
    /// Milliseconds between forward passes.
    #[arg(long, default_value_t = 5)]
    pub pace_ms: u64,
    /// Skip cells with more streams in total than this.
    #[arg(long, default_value_t = 32_768)]
    pub max_streams: u64,
    /// Where sweep.json and the plots go.
    #[arg(long, default_value = "target/sweep")]
    pub out: PathBuf,
}

/// One measured cell.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// The path measured.
    pub path: &'static str,
    /// Streams per peer.
    pub x: u64,
    /// Peers.
    pub y: u64,
    /// Records delivered.
    pub records: u64,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// Records per second.
    pub records_per_sec: f64,
    /// Process CPU per record, microseconds.
    pub cpu_us_per_record: f64,
    /// Records per batch on the sender.
    pub records_per_batch: f64,
    /// Median one-way latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile one-way latency, microseconds.
    pub p99_us: f64,
    /// Peak RSS during the cell, MiB.
    pub peak_rss_mib: f64,
    /// Open descriptors at the end of the cell.
    pub fds: u64,
}

impl Cell {
    fn new(path: &'static str, x: u64, y: u64, r: &Report) -> Cell {
        Cell {
            path,
            x,
            y,
            records: r.records,
            wall_s: r.elapsed.as_secs_f64(),
            records_per_sec: r.rate(),
            cpu_us_per_record: r.cpu_per_record_us(),
            records_per_batch: r.records_per_batch,
            p50_us: r.p50.as_secs_f64() * 1e6,
            p99_us: r.p99.as_secs_f64() * 1e6,
            peak_rss_mib: r.peak_rss as f64 / (1 << 20) as f64,
            fds: r.fds,
        }
    }
}

struct Attached;

impl Dialer for Attached {
    fn want_link(&self, _peer: PeerId) {}
}

async fn rdma_cell(y: u64, workload: Workload) -> anyhow::Result<Report> {
    // One device for the sender (one NIC), one per receiving peer.
    let sender_dev = SoftDevice::open_udp(UdpConfig::default()).await?;
    let sender = Mux::new(MuxConfig::default(), Arc::new(Attached));
    let mut receivers = Vec::new();
    for peer in 0..y {
        let dev = SoftDevice::open_udp(UdpConfig::default()).await?;
        let (ours, theirs) = rdma::pair(&sender_dev, &dev, Epoch(1), RdmaConfig::default())?;
        let mux = Mux::new(MuxConfig::default(), Arc::new(Attached));
        sender.attach(PeerId(peer + 1), ours);
        mux.attach(PeerId(0), theirs);
        receivers.push((mux, dev));
    }
    let targets: Vec<_> = receivers
        .iter()
        .enumerate()
        .map(|(i, (mux, _))| (mux, PeerId(i as u64 + 1)))
        .collect();
    let report = demo::run(&sender, &targets, 1, workload).await;
    sender.shutdown();
    for (mux, _) in &receivers {
        mux.shutdown();
    }
    Ok(report)
}

async fn tcp_cell(y: u64, workload: Workload) -> anyhow::Result<Report> {
    let loopback = "127.0.0.1:0".parse().expect("literal");
    let sender = TcpTransport::bind(
        TcpNodeConfig::new(PeerId(0)),
        loopback,
        MuxConfig::default(),
    )
    .await?;
    let mut receivers = Vec::new();
    for peer in 0..y {
        let node = TcpTransport::bind(
            TcpNodeConfig::new(PeerId(peer + 1)),
            loopback,
            MuxConfig::default(),
        )
        .await?;
        let id = sender.register(&node.address())?;
        node.register(&sender.address())?;
        receivers.push((node, id));
    }
    let targets: Vec<_> = receivers.iter().map(|(n, id)| (n.mux(), *id)).collect();
    let report = demo::run(sender.mux(), &targets, 1, workload).await;
    sender.shutdown();
    for (node, _) in &receivers {
        node.shutdown();
    }
    Ok(report)
}

pub async fn run(args: SweepArgs, json: bool) -> anyhow::Result<()> {
    let (xs, ys): (&[u64], &[u64]) = if args.quick {
        (&[1, 64, 1024], &[1, 8])
    } else {
        (&[1, 8, 64, 256, 1024, 4096], &[1, 2, 8, 32])
    };
    let mut paths = vec!["qpmux-rdma", "qpmux-tcp"];
    if cfg!(feature = "velo") {
        paths.push("velo-tcp-mux");
    }
    let mut grid = Vec::new();
    for &path in &paths {
        for &y in ys {
            for &x in xs {
                if x * y <= args.max_streams {
                    grid.push((path, x, y));
                }
            }
        }
    }
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(grid.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {elapsed} {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let mut cells = Vec::new();
    for (path, x, y) in grid {
        bar.set_message(format!("{path} X={x} Y={y}"));
        // About 20k records a cell, at least 10 passes.
        let passes = (20_000 / (x * y)).clamp(10, 200);
        let workload = Workload {
            streams: x,
            passes,
            record_size: args.record_size.max(16),
            pace: Some(Duration::from_millis(args.pace_ms)),
        };
        let report = match path {
            "qpmux-rdma" => rdma_cell(y, workload).await?,
            "qpmux-tcp" => tcp_cell(y, workload).await?,
            #[cfg(feature = "velo")]
            "velo-tcp-mux" => super::velo_rows::velo_tcp(y, workload).await?,
            other => anyhow::bail!("unknown path {other}"),
        };
        cells.push(Cell::new(path, x, y, &report));
        bar.inc(1);
    }
    bar.finish_and_clear();
    std::fs::create_dir_all(&args.out)?;
    let json_path = args.out.join("sweep.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&cells)?)?;
    let cpu = plot::lines(
        "CPU per record vs streams per peer",
        "streams per peer (X)",
        "CPU µs per record",
        &series(&cells, |c| c.cpu_us_per_record),
        true,
    );
    std::fs::write(args.out.join("cpu_per_record.svg"), cpu)?;
    let p99 = plot::lines(
        "p99 one-way latency vs streams per peer",
        "streams per peer (X)",
        "p99 latency µs",
        &series(&cells, |c| c.p99_us),
        true,
    );
    std::fs::write(args.out.join("p99_latency.svg"), p99)?;
    let pngs = rasterize(&args.out, &["cpu_per_record", "p99_latency"]);
    if json {
        println!("{}", serde_json::to_string_pretty(&cells)?);
        return Ok(());
    }
    println!(
        "{:<11} {:>5} {:>3} {:>10} {:>9} {:>8} {:>9} {:>9} {:>8} {:>5}",
        "path", "X", "Y", "records/s", "CPU µs/r", "rec/bat", "p50 µs", "p99 µs", "RSS MiB", "fds"
    );
    for c in &cells {
        println!(
            "{:<11} {:>5} {:>3} {:>10.0} {:>9.2} {:>8.1} {:>9.1} {:>9.1} {:>8.1} {:>5}",
            c.path,
            c.x,
            c.y,
            c.records_per_sec,
            c.cpu_us_per_record,
            c.records_per_batch,
            c.p50_us,
            c.p99_us,
            c.peak_rss_mib,
            c.fds
        );
    }
    println!(
        "wrote {} and the plots cpu_per_record.svg, p99_latency.svg beside it ({pngs})",
        json_path.display()
    );
    Ok(())
}

/// One line per (path, Y): points (X, metric).
fn series(cells: &[Cell], metric: impl Fn(&Cell) -> f64) -> Vec<plot::Series> {
    let mut out: Vec<plot::Series> = Vec::new();
    for c in cells {
        let name = format!("{} Y={}", c.path, c.y);
        match out.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((c.x as f64, metric(c))),
            None => out.push(plot::Series {
                name,
                points: vec![(c.x as f64, metric(c))],
            }),
        }
    }
    out
}

/// Writes PNG copies of the SVG plots with `rsvg-convert` when it is
/// installed (Debian: librsvg2-bin); says what happened.
fn rasterize(dir: &std::path::Path, names: &[&str]) -> String {
    for name in names {
        let svg = dir.join(format!("{name}.svg"));
        let png = dir.join(format!("{name}.png"));
        match std::process::Command::new("rsvg-convert")
            .arg(&svg)
            .arg("-o")
            .arg(&png)
            .status()
        {
            Ok(status) if status.success() => {}
            Ok(status) => return format!("no PNG: rsvg-convert exited with {status}"),
            Err(_) => return "no PNG: install librsvg2-bin for rsvg-convert".to_string(),
        }
    }
    "PNG copies too".to_string()
}
