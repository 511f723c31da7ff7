//! The `qpmux` command: argument parsing and the subcommands' logic.
//!
//! ```text
//!  bin/qpmux.rs ─► cli::main ─► demo     (default; streams over each node kind, one table)
//!                            ├► devices  (providers, devices, ports, GIDs)
//!                            ├► pingpong (latency / bandwidth, perftest-shaped)
//!                            ├► soak / relay (one node of the fault harness; UDP impairment)
//!                            └► bench sweep (V5 grid: JSON + SVG plots)
//! ```
//!
//! Every subcommand prints a human table, or JSON with `--json`.

mod demo;
mod devices;
mod pingpong;
mod plot;
mod relay;
mod soak;
mod sweep;
#[cfg(feature = "velo")]
mod velo_rows;

use std::io::IsTerminal;
use std::time::Duration;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use crate::link::rdma::{RdmaNodeConfig, RdmaTransport};
use crate::mux::{MuxConfig, PeerId};
use crate::verbs::soft::SoftDevice;
use crate::verbs::soft::udp::UdpConfig;

/// An RDMA node on a fresh soft device, both bound on 127.0.0.1.
async fn rdma_node(id: u64) -> anyhow::Result<RdmaTransport<SoftDevice>> {
    rdma_node_with(id, MuxConfig::default(), Duration::ZERO).await
}

/// As [`rdma_node`], its mux configured by `mux`, its device holding ACKs
/// up to `ack_delay` ([`crate::verbs::soft::SoftConfig::ack_delay`]).
async fn rdma_node_with(
    id: u64,
    mux: MuxConfig,
    ack_delay: Duration,
) -> anyhow::Result<RdmaTransport<SoftDevice>> {
    rdma_node_at(id, "127.0.0.1:0".parse().expect("literal"), mux, ack_delay).await
}

/// An RDMA node whose bootstrap listener binds `bind` (its soft device binds
/// the same IP).
async fn rdma_node_at(
    id: u64,
    bind: std::net::SocketAddr,
    mux: MuxConfig,
    ack_delay: Duration,
) -> anyhow::Result<RdmaTransport<SoftDevice>> {
    let mut config = UdpConfig {
        bind: std::net::SocketAddr::new(bind.ip(), 0),
        ..UdpConfig::default()
    };
    config.soft.ack_delay = ack_delay;
    let device = SoftDevice::open_udp(config).await?;
    let config = RdmaNodeConfig {
        bind,
        mux,
        ..RdmaNodeConfig::new(PeerId(id))
    };
    Ok(RdmaTransport::start(device, config).await?)
}

/// qpmux: many streams per peer over one RC queue pair.
#[derive(Debug, Parser)]
#[command(name = "qpmux", version, about)]
pub struct Args {
    /// What to run (default: the demo).
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Stream through the mux over every available node kind and compare.
    Demo(demo::DemoArgs),
    /// List providers, devices and ports.
    Devices,
    /// Latency or bandwidth between two endpoints (perftest-style table).
    Pingpong(pingpong::PingpongArgs),
    /// One node of a long stream check: per-slot order, JSON-line events.
    Soak(soak::SoakArgs),
    /// UDP impairment relay between peers (loss, duplication, jitter, reordering).
    Relay(relay::RelayArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

/// `qpmux bench` subcommands.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// V5: X streams per peer × Y peers on each path; JSON and SVG plots.
    Sweep(sweep::SweepArgs),
}

/// Parses the command line and runs it.
pub fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Plain text when stderr is a file (the fault harness keeps them).
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        match args.command {
            None => demo::run(demo::DemoArgs::default(), args.json).await,
            Some(Command::Demo(demo_args)) => demo::run(demo_args, args.json).await,
            Some(Command::Devices) => devices::run(args.json).await,
            Some(Command::Pingpong(pingpong_args)) => pingpong::run(pingpong_args, args.json).await,
            Some(Command::Soak(soak_args)) => soak::run(soak_args, args.json).await,
            Some(Command::Relay(relay_args)) => relay::run(relay_args).await,
            Some(Command::Bench(BenchCommand::Sweep(sweep_args))) => {
                sweep::run(sweep_args, args.json).await
            }
        }
    })
}

/// A node address as the hex blob the commands print and take.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex address blob (surrounding whitespace ignored).
fn unhex(text: &str) -> anyhow::Result<Vec<u8>> {
    let text = text.trim();
    anyhow::ensure!(
        text.len() % 2 == 0 && text.is_ascii(),
        "malformed hex address"
    );
    (0..text.len())
        .step_by(2)
        .map(|i| Ok(u8::from_str_radix(&text[i..i + 2], 16)?))
        .collect()
}

/// A progress bar on stderr over `len` steps; hidden under `--json`, and by
/// indicatif when stderr is not a terminal. It redraws only when a step
/// ends: a steady tick is a thread redrawing meanwhile, whose CPU the
/// process-wide CPU per record of the cell being measured would count.
fn progress_bar(len: u64, json: bool) -> ProgressBar {
    if json {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} {elapsed} {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar
}

/// Records per batch for a table: one decimal, or "–" where the path does
/// not count its batches (velo's rows carry NaN).
fn records_per_batch_column(per_batch: f64) -> String {
    if per_batch.is_finite() {
        format!("{per_batch:.1}")
    } else {
        "–".to_string()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn records_per_batch_prints_a_dash_where_a_path_does_not_count_batches() {
        assert_eq!(super::records_per_batch_column(64.0), "64.0");
        assert_eq!(super::records_per_batch_column(f64::NAN), "–");
    }
}
