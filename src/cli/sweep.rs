//! `qpmux bench sweep` (V5, V6): X streams per peer × Y peers on each path
//! (qpmux over RDMA nodes and TCP nodes, velo's TCP messenger mux, velo's
//! per-stream TCP path), in one process, one cell after the other; then the
//! V6 criteria cells (one saturating stream, paced X = Y = 1 latency, mixed
//! fast and slow consumers); JSON, SVG plots (PNG when `rsvg-convert` is
//! installed) and the verdicts.
//!
//! ```text
//!  [--pin-cores/--nofile/--sched: re-exec under taskset/prlimit/chrt]
//!  for path, Y, X: fresh nodes ─► workload ─► Cell (or "failed at N streams")
//!  criteria cells ─► verdicts (ratios within this run)
//!  cells + verdicts ─► sweep.json ─► cpu_per_record, p50_latency, p99_latency (.svg/.png)
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Args as ClapArgs;
use serde::Serialize;

use super::plot;
use crate::demo::{self, Report, StreamWall, Workload};
use crate::link::tcp::{TcpNodeConfig, TcpTransport};
use crate::link::{Link, Node};
use crate::mux::{FlushPolicy, Mux, MuxConfig, PeerId};

/// Set in the environment of a sweep re-executed under taskset/prlimit.
const WRAPPED_ENV: &str = "QPMUX_SWEEP_WRAPPED";

/// Arguments of `qpmux bench sweep`.
#[derive(Debug, Clone, ClapArgs)]
pub struct SweepArgs {
    /// A ~2-minute subset: X ∈ {1, 64, 1024}, Y ∈ {1, 8}.
    #[arg(long)]
    pub quick: bool,
    /// Record size in bytes.
    #[arg(long, default_value_t = 64)]
    pub record_size: usize,
    /// Milliseconds between forward passes in the grid.
    #[arg(long, default_value_t = 5)]
    pub pace_ms: u64,
    /// Skip grid cells with more streams in total than this.
    #[arg(long, default_value_t = 32_768)]
    pub max_streams: u64,
    /// Where sweep.json and the plots go.
    #[arg(long, default_value = "target/sweep")]
    pub out: PathBuf,
    /// Run on CPUs 0..N only (the CPU-scarce case): the sweep re-executes
    /// itself under `taskset`.
    #[arg(long)]
    pub pin_cores: Option<usize>,
    /// Run with this many file descriptors at most (soft and hard limit):
    /// the sweep re-executes itself under `prlimit`.
    #[arg(long)]
    pub nofile: Option<u64>,
    /// Run under this Linux scheduling policy: the sweep re-executes itself
    /// under `chrt`. `batch` keeps a waking runtime worker from preempting
    /// the one that woke it on a shared CPU (docs/design.md § "Workers that
    /// preempt their waker").
    #[arg(long, value_enum)]
    pub sched: Option<SchedPolicy>,
    /// The soft provider's ACK coalescing delay on every qpmux-rdma node,
    /// microseconds (docs/soft-provider.md § "ACKs held across turns"; 0, the
    /// default, ACKs every A-bit packet at once, as rxe does).
    #[arg(long, default_value_t = 0)]
    pub soft_ack_delay_us: u64,
    /// Skip the V6 criteria cells.
    #[arg(long)]
    pub no_criteria: bool,
    /// Run only the cells matching one of these patterns, comma-separated
    /// `PATH[:MODE[:X[:Y]]]`, `*` or an omitted part matching anything
    /// (e.g. `qpmux-rdma:saturate,velo-tcp-stream:saturate,*:grid:64:1`).
    /// Verdicts whose cells did not run read "unknown".
    #[arg(long, value_delimiter = ',')]
    pub cells: Vec<CellFilter>,
    /// Measure every cell this many times, interleaved (every cell once,
    /// then every cell again, ...; within a round a shape's paths run back
    /// to back, in an order rotated every round). Each verdict is then the
    /// median of its per-round ratios, each ratio from two cells of the
    /// same round, and the plots show per-point medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub rounds: u32,
    /// In the `latency-1ms` cells (one record in flight at a time), time
    /// each record's stages on the qpmux paths: woken, encoded, posted,
    /// received, decoding, delivered (src/stages.rs). Off by default: the
    /// marks cost the qpmux paths a little the velo paths do not pay.
    #[arg(long)]
    pub stages: bool,
}

/// A Linux scheduling policy for `--sched`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedPolicy {
    /// `SCHED_OTHER`, the default.
    Normal,
    /// `SCHED_BATCH`: no wakeup preemption.
    Batch,
}

/// One `--cells` pattern: `PATH[:MODE[:X[:Y]]]`, `None` matching anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellFilter {
    path: Option<String>,
    mode: Option<String>,
    x: Option<u64>,
    y: Option<u64>,
}

impl std::str::FromStr for CellFilter {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let word = |p: Option<&str>| p.filter(|p| !p.is_empty() && *p != "*").map(str::to_string);
        let path = word(parts.next());
        let mode = word(parts.next());
        let number = |p: Option<String>| {
            p.map(|p| {
                p.parse::<u64>()
                    .map_err(|_| format!("{p:?} in {s:?} is not a number"))
            })
            .transpose()
        };
        let x = number(word(parts.next()))?;
        let y = number(word(parts.next()))?;
        if parts.next().is_some() {
            return Err(format!("{s:?} has more than PATH:MODE:X:Y"));
        }
        Ok(CellFilter { path, mode, x, y })
    }
}

impl CellFilter {
    fn matches(&self, path: &str, shape: &Shape) -> bool {
        self.path.as_deref().is_none_or(|p| p == path)
            && self.mode.as_deref().is_none_or(|m| m == shape.mode)
            && self.x.is_none_or(|x| x == shape.x)
            && self.y.is_none_or(|y| y == shape.y)
    }
}

/// One measured cell.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// Which round of `--rounds` measured it, from 0.
    pub round: u32,
    /// The path measured.
    pub path: &'static str,
    /// What the cell is for: `grid` (V5) or a V6 criterion's workload.
    pub mode: &'static str,
    /// Streams per peer.
    pub x: u64,
    /// Peers.
    pub y: u64,
    /// Of each peer's streams, how many are untimed (slow consumers, or
    /// idle in `hol-baseline`).
    pub untimed_streams: u64,
    /// Untimed streams' consumers sleep this long after each record, ms
    /// (null: the untimed streams are idle).
    pub slow_consumer_ms: Option<f64>,
    /// Times the sender found a slot out of credit (null where the path
    /// does not say): above zero in `hol-slow` shows the slow streams were
    /// held back.
    pub credit_stalls: Option<u64>,
    /// The timed records' sends that waited on the path's pushback; the
    /// records behind each were stamped from when they were due
    /// ([`demo::Pacer`]). Null where the cell failed.
    pub held_sends: Option<u64>,
    /// What those sends waited, together, ms.
    pub held_ms: f64,
    /// Grid starts a late pass skipped (their records never sent, so
    /// never timed). Null where the cell failed.
    pub passes_skipped: Option<u64>,
    /// Records delivered (fast streams).
    pub records: u64,
    /// Wall time, seconds.
    pub wall_s: f64,
    /// Records per second.
    pub records_per_sec: f64,
    /// Process CPU per record, microseconds.
    pub cpu_us_per_record: f64,
    /// Times the process's threads were put on a CPU, per record: a
    /// worker-to-worker wake-up ping-pong shows here (docs/design.md §
    /// "Workers that preempt their waker").
    pub runs_per_record: f64,
    /// Records per batch on the sender (null where the path does not say).
    pub records_per_batch: f64,
    /// Median one-way latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile one-way latency, microseconds.
    pub p99_us: f64,
    /// Peak RSS during the cell, MiB (the process's: it includes what
    /// earlier cells left allocated).
    pub peak_rss_mib: f64,
    /// Peak RSS less the RSS as the clock started, MiB: what the cell grew.
    pub rss_growth_mib: f64,
    /// Open descriptors at the end of the cell.
    pub fds: u64,
    /// Streams the path carried before it failed (set only when it failed
    /// for want of resources, e.g. descriptors).
    pub failed_at_streams: Option<u64>,
    /// Why the cell failed, if it did.
    pub error: Option<String>,
    /// With `--stages`: median microseconds from the producer's stamp to
    /// each stage (woken, encoded, posted, received, decoding, delivered),
    /// null where the path has no such point.
    pub stages_us: Option<demo::StageMedians>,
    /// With `--stages`: the same medians over the slowest 1% of records.
    pub stages_slowest_us: Option<demo::StageMedians>,
    /// Microseconds each CPU the sweep may run on took, just before the
    /// cell, for a fixed piece of the mux's user-space work, in CPU order
    /// ([`cpu_probes_us`]; null where a probe could not run): how fast the
    /// CPUs ran then, a snapshot, not the cell's own speed.
    pub cpu_probe_us: Vec<f64>,
    /// Tasks alive in the sweep's runtime just before the cell, after waiting
    /// up to 2 s for earlier cells' tasks to end: what they left running (0
    /// when all ended; the sweep itself runs in `block_on`, not in a task).
    pub tasks_before: Option<usize>,
    /// Threads in the process just before the cell (`/proc/self/status`):
    /// what earlier cells left running outside the runtime.
    pub threads_before: Option<usize>,
}

impl Cell {
    fn new(round: u32, path: &'static str, shape: Shape, r: &Report) -> Cell {
        Cell {
            round,
            path,
            mode: shape.mode,
            x: shape.x,
            y: shape.y,
            untimed_streams: shape.workload.untimed_streams,
            slow_consumer_ms: shape.workload.slow_consumer.map(|d| d.as_secs_f64() * 1e3),
            credit_stalls: r.credit_stalls,
            held_sends: Some(r.held.sends),
            held_ms: r.held.total.as_secs_f64() * 1e3,
            passes_skipped: Some(r.held.passes_skipped),
            records: r.records,
            wall_s: r.elapsed.as_secs_f64(),
            records_per_sec: r.rate(),
            cpu_us_per_record: r.cpu_per_record_us(),
            runs_per_record: r.runs_per_record(),
            records_per_batch: r.records_per_batch,
            p50_us: r.p50.as_secs_f64() * 1e6,
            p99_us: r.p99.as_secs_f64() * 1e6,
            peak_rss_mib: r.peak_rss as f64 / (1 << 20) as f64,
            rss_growth_mib: r.rss_growth as f64 / (1 << 20) as f64,
            fds: r.fds,
            failed_at_streams: None,
            error: None,
            stages_us: r.stages,
            stages_slowest_us: r.stages_slowest,
            cpu_probe_us: Vec::new(),
            tasks_before: None,
            threads_before: None,
        }
    }

    fn failed(round: u32, path: &'static str, shape: Shape, err: &anyhow::Error) -> Cell {
        Cell {
            round,
            path,
            mode: shape.mode,
            x: shape.x,
            y: shape.y,
            untimed_streams: shape.workload.untimed_streams,
            slow_consumer_ms: shape.workload.slow_consumer.map(|d| d.as_secs_f64() * 1e3),
            credit_stalls: None,
            held_sends: None,
            held_ms: f64::NAN,
            passes_skipped: None,
            records: 0,
            wall_s: f64::NAN,
            records_per_sec: f64::NAN,
            cpu_us_per_record: f64::NAN,
            runs_per_record: f64::NAN,
            records_per_batch: f64::NAN,
            p50_us: f64::NAN,
            p99_us: f64::NAN,
            peak_rss_mib: f64::NAN,
            rss_growth_mib: f64::NAN,
            fds: demo::open_fds(),
            failed_at_streams: err.downcast_ref::<StreamWall>().map(|w| w.carried),
            error: Some(format!("{err:#}")),
            stages_us: None,
            stages_slowest_us: None,
            cpu_probe_us: Vec::new(),
            tasks_before: None,
            threads_before: None,
        }
    }

    fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// The grid's cells grouped by shape, shapes and paths in grid order.
fn by_shape(grid: &[(&'static str, Shape)]) -> Vec<(Shape, Vec<&'static str>)> {
    let mut shapes: Vec<(Shape, Vec<&'static str>)> = Vec::new();
    for &(path, shape) in grid {
        let same = |s: &Shape| (s.mode, s.x, s.y) == (shape.mode, shape.x, shape.y);
        match shapes.iter_mut().find(|(s, _)| same(s)) {
            Some((_, paths)) => paths.push(path),
            None => shapes.push((shape, vec![path])),
        }
    }
    shapes
}

/// One round's cells: a shape's paths back to back, so the two cells of a
/// same-round ratio run seconds apart, not a round apart; their order
/// [`balanced_order`], so over n rounds (2n for an odd n) each path runs
/// first once and right before each other path once. A rotation by one
/// kept the cyclic order: of four paths, one ran right before another in 3
/// of 4 rounds, and a few percent of order effect leaned on the ratio.
fn round_order(shapes: &[(Shape, Vec<&'static str>)], round: u32) -> Vec<(&'static str, Shape)> {
    shapes
        .iter()
        .flat_map(|(shape, paths)| {
            balanced_order(paths.len(), round as usize)
                .into_iter()
                .map(move |i| (paths[i], *shape))
        })
        .collect()
}

/// Round `round`'s order of `n` items, a Williams design: the first row
/// 0, 1, n−1, 2, n−2, …, each next row the one before plus one (mod n), and
/// for an odd n the n rows after those reversed. Over a cycle each item
/// runs in each place once, and right before each other item once (twice
/// for an odd n).
fn balanced_order(n: usize, round: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let first = (0..n).map(|j| match j {
        0 => 0,
        j if j % 2 == 1 => j.div_ceil(2),
        j => n - j / 2,
    });
    let row = round % n;
    let mut order: Vec<usize> = first.map(|i| (i + row) % n).collect();
    if n % 2 == 1 && (round / n) % 2 == 1 {
        order.reverse();
    }
    order
}

/// What one cell runs.
#[derive(Clone, Copy, Debug)]
struct Shape {
    mode: &'static str,
    x: u64,
    y: u64,
    workload: Workload,
}

/// A V6 criterion or target, judged from cells of this run.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    /// The criterion, as docs/benchmarks.md states it.
    pub criterion: &'static str,
    /// The path judged.
    pub path: &'static str,
    /// The measured ratio: over several rounds, the median of `rounds`.
    pub ratio: f64,
    /// The ratio in each round that measured both of its cells, or whose
    /// judged cell failed (`failed_rounds`); a round whose baseline cell
    /// failed or that ran neither is left out.
    pub rounds: Vec<f64>,
    /// How many of `rounds` would hold on their own: a verdict carried by
    /// 6 of 10 rounds is at the edge, one carried by 10 is not.
    pub rounds_holding: usize,
    /// Rounds whose cell of the path judged failed: each is in `rounds` as
    /// the worst ratio (+∞, or −∞ where more is better; `null` in the
    /// JSON), and holds not.
    pub failed_rounds: usize,
    /// What the ratio is.
    pub measure: String,
    /// Whether the criterion holds (the design survives / the target is
    /// met); null when no round measured both of its cells.
    pub holds: Option<bool>,
}

/// The machine the sweep ran on, as far as it matters to the numbers.
#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    /// CPUs this process may run on (`Cpus_allowed_list`).
    pub cpus_allowed: String,
    /// Soft limit on open files.
    pub nofile_limit: String,
    /// Linux scheduling policy of this process (`normal`, `batch`, ...).
    pub sched_policy: String,
    /// Milliseconds between passes in the grid.
    pub grid_pace_ms: u64,
    /// Record size, bytes.
    pub record_size: usize,
    /// Times every cell was measured (`--rounds`).
    pub rounds: u32,
    /// The soft provider's ACK coalescing delay, µs (`--soft-ack-delay-us`).
    pub soft_ack_delay_us: u64,
}

#[derive(Serialize)]
struct SweepJson<'a> {
    environment: Environment,
    cells: &'a [Cell],
    verdicts: &'a [Verdict],
}

const QPMUX_PATHS: [&str; 2] = ["qpmux-rdma", "qpmux-tcp"];
const PER_STREAM: &str = "velo-tcp-stream";
const VELO_MUX: &str = "velo-tcp-mux";
/// Criteria mode: the grid's paced forward pass with `flush(peer)` after
/// each pass under `FlushPolicy::Manual`.
const FLUSHED: &str = "flush-pass";
/// Criteria mode: X = Y = 1, one record per millisecond.
const LATENCY: &str = "latency-1ms";

/// The sender's mux: a flushed forward pass cuts batches only on `flush`.
fn sender_mux(workload: &Workload) -> MuxConfig {
    let mut config = MuxConfig::default();
    if workload.flush_each_pass {
        config.flush = FlushPolicy::Manual {
            reply_linger: Duration::from_millis(1),
        };
    }
    config
}

async fn rdma_cell(y: u64, workload: Workload, ack_delay: Duration) -> anyhow::Result<Report> {
    // Each node: its own soft device (one NIC) and bootstrap listener.
    let sender = super::rdma_node_with(0, sender_mux(&workload), ack_delay).await?;
    let mut receivers = Vec::new();
    for peer in 0..y {
        let node = super::rdma_node_with(peer + 1, MuxConfig::default(), ack_delay).await?;
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
    closed(sender.mux(), receivers.iter().map(|(node, _)| node.mux())).await;
    report
}

async fn tcp_cell(y: u64, workload: Workload) -> anyhow::Result<Report> {
    let loopback = "127.0.0.1:0".parse().expect("literal");
    let sender = TcpTransport::bind(
        TcpNodeConfig::new(PeerId(0)),
        loopback,
        sender_mux(&workload),
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
    closed(sender.mux(), receivers.iter().map(|(node, _)| node.mux())).await;
    report
}

/// Waits (up to [`TEARDOWN`]) for the muxes of a cell to close, as the
/// velo rows await velo's graceful shutdown: a teardown still running must
/// not charge its CPU to the next cell.
async fn closed<'a, L: Link + 'a>(sender: &'a Mux<L>, receivers: impl Iterator<Item = &'a Mux<L>>) {
    let all = async {
        sender.closed().await;
        for mux in receivers {
            mux.closed().await;
        }
    };
    if tokio::time::timeout(TEARDOWN, all).await.is_err() {
        tracing::warn!("a cell's muxes did not close within {TEARDOWN:?}");
    }
}

/// How long a cell waits for its muxes to close.
const TEARDOWN: Duration = Duration::from_secs(2);

async fn measure(
    round: u32,
    path: &'static str,
    shape: Shape,
    stages: bool,
    ack_delay: Duration,
) -> Cell {
    let tasks_before = settle().await;
    let probe = cpu_probes_us();
    let threads_before = process_threads();
    crate::stages::set_enabled(stages && shape.mode == LATENCY);
    let result = match path {
        "qpmux-rdma" => rdma_cell(shape.y, shape.workload, ack_delay).await,
        "qpmux-tcp" => tcp_cell(shape.y, shape.workload).await,
        #[cfg(feature = "velo")]
        VELO_MUX => {
            use super::velo_rows::{VeloPath, velo_tcp};
            velo_tcp(VeloPath::MessengerMux, shape.y, shape.workload).await
        }
        #[cfg(feature = "velo")]
        PER_STREAM => {
            use super::velo_rows::{VeloPath, velo_tcp};
            velo_tcp(VeloPath::PerStream, shape.y, shape.workload).await
        }
        other => Err(anyhow::anyhow!("unknown path {other}")),
    };
    crate::stages::set_enabled(false);
    let mut cell = match result {
        Ok(report) => Cell::new(round, path, shape, &report),
        Err(err) => Cell::failed(round, path, shape, &err),
    };
    cell.cpu_probe_us = probe;
    cell.tasks_before = Some(tasks_before);
    cell.threads_before = threads_before;
    // Let the torn-down nodes' sockets close before the next cell counts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    cell
}

/// Microseconds for 100 batches of 64 records of 64 B, encoded and decoded,
/// each record copied out as a receive does: the mux's own user-space work
/// per pass at X = 64, with no task, lock or system call. The fastest of
/// five tries, so a preemption does not count. A VM's vCPU can run slower
/// for a while (docs/benchmarks.md § "A CPU probe beside each cell").
fn cpu_probe_us() -> f64 {
    use crate::mux::protocol::{
        BatchEncoder, BatchView, Epoch, FrameSeq, Lane, RecordBody, SlotId,
    };
    const BATCHES: usize = 100;
    const RECORDS: usize = 64;
    let payload = std::hint::black_box([0x5au8; 64]);
    let mut buf = vec![0u8; 16 + RECORDS * (16 + payload.len())];
    let mut copied = Vec::with_capacity(RECORDS);
    let mut fastest = Duration::MAX;
    for _ in 0..5 {
        let start = std::time::Instant::now();
        for batch in 0..BATCHES {
            let Ok(mut encoder) = BatchEncoder::new(&mut buf, Epoch(1), 0, Lane(0)) else {
                return f64::NAN;
            };
            for i in 0..RECORDS {
                let Some(slot) = SlotId::new(i as u32, 0) else {
                    return f64::NAN;
                };
                let seq = FrameSeq((batch * RECORDS + i) as u32);
                if encoder.push_data(slot, seq, &payload, false).is_err() {
                    return f64::NAN;
                }
            }
            let len = encoder.finish();
            let Ok(view) = BatchView::new_checked(&buf[..len]) else {
                return f64::NAN;
            };
            copied.clear();
            for record in view.records() {
                if let RecordBody::Data(data) = record.body {
                    copied.push(bytes::Bytes::copy_from_slice(data));
                }
            }
            std::hint::black_box(&copied);
        }
        fastest = fastest.min(start.elapsed());
    }
    fastest.as_secs_f64() * 1e6
}

/// Waits (up to [`TEARDOWN`]) until no task of an earlier cell is alive in
/// the sweep's runtime (a torn-down node's device drivers end once its last
/// handle goes, which can be after its mux closed), so the next cell is not
/// charged for them; returns how many are still alive.
async fn settle() -> usize {
    let alive = || {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    };
    let give_up = tokio::time::Instant::now() + TEARDOWN;
    while alive() > 0 && tokio::time::Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    alive()
}

/// Threads in this process (`Threads:` in `/proc/self/status`), if readable.
fn process_threads() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))?
        .trim()
        .parse()
        .ok()
}

/// [`cpu_probe_us`] on each CPU this process may run on, in CPU order: the
/// calling thread is pinned to each in turn, then given its CPUs back. Where
/// the CPUs cannot be listed, one probe wherever the thread runs.
#[cfg(target_os = "linux")]
fn cpu_probes_us() -> Vec<f64> {
    use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
    use nix::unistd::Pid;
    let this_thread = Pid::from_raw(0);
    let allowed = match sched_getaffinity(this_thread) {
        Ok(allowed) => allowed,
        Err(e) => {
            tracing::debug!(error = %e, "CPUs not listed; one CPU probe, unpinned");
            return vec![cpu_probe_us()];
        }
    };
    let probes = (0..CpuSet::count())
        .filter(|&cpu| allowed.is_set(cpu).unwrap_or(false))
        .map(|cpu| {
            let mut one = CpuSet::new();
            match one
                .set(cpu)
                .and_then(|()| sched_setaffinity(this_thread, &one))
            {
                Ok(()) => cpu_probe_us(),
                Err(_) => f64::NAN,
            }
        })
        .collect();
    if let Err(e) = sched_setaffinity(this_thread, &allowed) {
        tracing::warn!(error = %e, "the CPU probe could not give its thread its CPUs back");
    }
    probes
}

/// [`cpu_probe_us`] where the process's CPUs cannot be told apart.
#[cfg(not(target_os = "linux"))]
fn cpu_probes_us() -> Vec<f64> {
    vec![cpu_probe_us()]
}

/// With `--stages`: where each timed cell's records spent their time, the
/// median record's and the slowest 1%'s.
fn print_stages(cells: &[Cell]) {
    let timed: Vec<&Cell> = cells.iter().filter(|c| c.stages_us.is_some()).collect();
    if timed.is_empty() {
        return;
    }
    println!();
    println!("median µs from the producer's stamp to each stage (one record in flight):");
    println!(
        "{:<15} {:<12} {:>8} {:>8} {:>8} {:>9} {:>9} {:>10}",
        "path", "records", "woken", "encoded", "posted", "received", "decoding", "delivered"
    );
    let col = |v: Option<f64>| v.map_or_else(|| "–".to_string(), |v| format!("{v:.1}"));
    for c in timed {
        let rows = [("all", c.stages_us), ("slowest 1%", c.stages_slowest_us)];
        for (which, at) in rows {
            let Some(at) = at else { continue };
            println!(
                "{:<15} {:<12} {:>8} {:>8} {:>8} {:>9} {:>9} {:>10}",
                c.path,
                which,
                col(at[0]),
                col(at[1]),
                col(at[2]),
                col(at[3]),
                col(at[4]),
                col(at[5])
            );
        }
    }
}

/// The V6 criteria cells: every path on each shape.
fn criteria_shapes(args: &SweepArgs) -> Vec<Shape> {
    let size = args.record_size;
    let paced = Some(Duration::from_millis(1));
    // The same 56 streams are timed in both cells; the other 8 are idle in
    // the baseline and, in `hol-slow`, sent to back to back while their
    // consumers take one record per 20 ms.
    let hol = Workload {
        untimed_streams: 8,
        ..Workload::new(64, if args.quick { 200 } else { 1000 }, size, paced)
    };
    let flushed = Workload {
        flush_each_pass: true,
        ..Workload::new(
            64,
            if args.quick { 50 } else { 200 },
            size,
            Some(Duration::from_millis(args.pace_ms)),
        )
    };
    vec![
        Shape {
            mode: "saturate",
            x: 1,
            y: 1,
            workload: Workload::new(1, if args.quick { 20_000 } else { 100_000 }, size, None),
        },
        Shape {
            mode: LATENCY,
            x: 1,
            y: 1,
            workload: Workload::new(1, if args.quick { 500 } else { 2000 }, size, paced),
        },
        Shape {
            mode: FLUSHED,
            x: 64,
            y: 1,
            workload: flushed,
        },
        Shape {
            mode: FLUSHED,
            x: 64,
            y: 8,
            workload: flushed,
        },
        Shape {
            mode: "hol-baseline",
            x: 64,
            y: 1,
            workload: hol,
        },
        Shape {
            mode: "hol-slow",
            x: 64,
            y: 1,
            workload: Workload {
                slow_consumer: Some(Duration::from_millis(20)),
                ..hol
            },
        },
    ]
}

/// Re-executes this command under `prlimit`/`taskset` when asked to; returns
/// whether it did (and the child's outcome).
fn reexec_wrapped(args: &SweepArgs) -> Option<anyhow::Result<()>> {
    if std::env::var_os(WRAPPED_ENV).is_some()
        || (args.pin_cores.is_none() && args.nofile.is_none() && args.sched.is_none())
    {
        return None;
    }
    let run = || -> anyhow::Result<()> {
        let mut argv: Vec<std::ffi::OsString> = Vec::new();
        if let Some(n) = args.nofile {
            argv.extend([
                "prlimit".into(),
                format!("--nofile={n}").into(),
                "--".into(),
            ]);
        }
        if let Some(policy) = args.sched {
            let flag = match policy {
                SchedPolicy::Normal => "--other",
                SchedPolicy::Batch => "--batch",
            };
            argv.extend(["chrt".into(), flag.into(), "0".into()]);
        }
        if let Some(cores) = args.pin_cores {
            anyhow::ensure!(cores > 0, "--pin-cores needs at least one core");
            argv.extend([
                "taskset".into(),
                "-c".into(),
                format!("0-{}", cores - 1).into(),
            ]);
        }
        argv.push(std::env::current_exe()?.into());
        argv.extend(std::env::args_os().skip(1));
        let status = std::process::Command::new(&argv[0])
            .args(&argv[1..])
            .env(WRAPPED_ENV, "1")
            .status()
            .map_err(|e| anyhow::anyhow!("running {:?}: {e} (util-linux installed?)", argv[0]))?;
        anyhow::ensure!(status.success(), "the wrapped sweep exited with {status}");
        Ok(())
    };
    Some(run())
}

/// This process's scheduling policy, from the `policy` line of
/// `/proc/self/sched`.
fn sched_policy() -> String {
    std::fs::read_to_string("/proc/self/sched")
        .map_or_else(|_| "unknown".to_string(), |text| policy_name(&text))
}

fn policy_name(proc_sched: &str) -> String {
    let number = proc_sched
        .lines()
        .find(|l| l.starts_with("policy"))
        .and_then(|line| line.split(':').nth(1))
        .map(str::trim);
    match number {
        Some("0") => "normal".to_string(),
        Some("3") => "batch".to_string(),
        Some("5") => "idle".to_string(),
        Some(other) => format!("policy {other}"),
        None => "unknown".to_string(),
    }
}

fn proc_field(file: &str, prefix: &str) -> String {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with(prefix))?;
            Some(
                line[prefix.len()..]
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        })
        .unwrap_or_else(|| "unknown".to_string())
}

pub async fn run(args: SweepArgs, json: bool) -> anyhow::Result<()> {
    if let Some(outcome) = reexec_wrapped(&args) {
        return outcome;
    }
    let environment = Environment {
        cpus_allowed: proc_field("/proc/self/status", "Cpus_allowed_list:"),
        nofile_limit: proc_field("/proc/self/limits", "Max open files"),
        sched_policy: sched_policy(),
        grid_pace_ms: args.pace_ms,
        record_size: args.record_size.max(16),
        rounds: args.rounds,
        soft_ack_delay_us: args.soft_ack_delay_us,
    };
    let (xs, ys): (&[u64], &[u64]) = if args.quick {
        (&[1, 64, 1024], &[1, 8])
    } else {
        (&[1, 8, 64, 256, 1024, 4096], &[1, 2, 8, 32])
    };
    let mut paths = QPMUX_PATHS.to_vec();
    if cfg!(feature = "velo") {
        paths.extend([VELO_MUX, PER_STREAM]);
    }
    let mut grid = Vec::new();
    for &path in &paths {
        for &y in ys {
            for &x in xs {
                if x * y <= args.max_streams {
                    // About 20k records a cell, at least 10 passes.
                    let passes = (20_000 / (x * y)).clamp(10, 200);
                    let pace = Some(Duration::from_millis(args.pace_ms));
                    let workload = Workload::new(x, passes, args.record_size, pace);
                    let mode = "grid";
                    grid.push((
                        path,
                        Shape {
                            mode,
                            x,
                            y,
                            workload,
                        },
                    ));
                }
            }
        }
    }
    if !args.no_criteria {
        for shape in criteria_shapes(&args) {
            for &path in &paths {
                // velo's paths have no flush of their own to call.
                if shape.mode == FLUSHED && !QPMUX_PATHS.contains(&path) {
                    continue;
                }
                grid.push((path, shape));
            }
        }
    }
    if !args.cells.is_empty() {
        grid.retain(|(path, shape)| args.cells.iter().any(|f| f.matches(path, shape)));
        anyhow::ensure!(
            !grid.is_empty(),
            "--cells matched no cell{}",
            if args.no_criteria {
                " (--no-criteria leaves out the saturate, latency-1ms, hol-* and flush-pass cells)"
            } else {
                ""
            }
        );
    }
    let bar = super::progress_bar(grid.len() as u64 * u64::from(args.rounds), json);
    let shapes = by_shape(&grid);
    let mut cells = Vec::new();
    let ack_delay = Duration::from_micros(args.soft_ack_delay_us);
    for round in 0..args.rounds {
        for (path, shape) in round_order(&shapes, round) {
            bar.set_message(format!(
                "round {} {path} {} X={} Y={}",
                round + 1,
                shape.mode,
                shape.x,
                shape.y
            ));
            cells.push(measure(round, path, shape, args.stages, ack_delay).await);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let verdicts = verdicts(&cells, args.rounds);
    std::fs::create_dir_all(&args.out)?;
    let json_path = args.out.join("sweep.json");
    let document = SweepJson {
        environment: environment.clone(),
        cells: &cells,
        verdicts: &verdicts,
    };
    std::fs::write(&json_path, serde_json::to_string_pretty(&document)?)?;
    let grid_cells = medians(cells.iter().filter(|c| c.mode == "grid"));
    let plots = [
        (
            "cpu_per_record",
            "CPU per record vs streams per peer",
            "CPU µs per record",
            0,
        ),
        (
            "p50_latency",
            "p50 one-way latency vs streams per peer",
            "p50 latency µs",
            1,
        ),
        (
            "p99_latency",
            "p99 one-way latency vs streams per peer",
            "p99 latency µs",
            2,
        ),
    ];
    for (name, title, y_label, metric) in plots {
        let pick = |c: &Cell| match metric {
            0 => c.cpu_us_per_record,
            1 => c.p50_us,
            _ => c.p99_us,
        };
        let svg = plot::lines(
            title,
            "streams per peer (X)",
            y_label,
            &series(&grid_cells, pick),
            true,
        );
        std::fs::write(args.out.join(format!("{name}.svg")), svg)?;
    }
    let pngs = rasterize(&args.out, &plots.map(|p| p.0));
    if json {
        println!("{}", serde_json::to_string_pretty(&document)?);
        return Ok(());
    }
    println!(
        "CPUs {}, open files limit {}, scheduling policy {}; soft provider = user space on loopback, not hardware",
        environment.cpus_allowed, environment.nofile_limit, environment.sched_policy
    );
    let round_column = |round: &str| {
        if args.rounds > 1 {
            format!("{round:>5} ")
        } else {
            String::new()
        }
    };
    println!(
        "{}{:<15} {:<12} {:>5} {:>3} {:>10} {:>9} {:>7} {:>8} {:>9} {:>9} {:>8} {:>5} {:>8}",
        round_column("round"),
        "path",
        "mode",
        "X",
        "Y",
        "records/s",
        "CPU µs/r",
        "runs/r",
        "rec/bat",
        "p50 µs",
        "p99 µs",
        "RSS MiB",
        "fds",
        "held ms"
    );
    for c in &cells {
        if let Some(err) = &c.error {
            println!(
                "{}{:<15} {:<12} {:>5} {:>3} failed: {err}",
                round_column(&(c.round + 1).to_string()),
                c.path,
                c.mode,
                c.x,
                c.y
            );
            continue;
        }
        println!(
            "{}{:<15} {:<12} {:>5} {:>3} {:>10.0} {:>9.2} {:>7.2} {:>8} {:>9.1} {:>9.1} {:>8.1} {:>5} {:>8.1}",
            round_column(&(c.round + 1).to_string()),
            c.path,
            c.mode,
            c.x,
            c.y,
            c.records_per_sec,
            c.cpu_us_per_record,
            c.runs_per_record,
            super::records_per_batch_column(c.records_per_batch),
            c.p50_us,
            c.p99_us,
            c.peak_rss_mib,
            c.fds,
            c.held_ms
        );
    }
    print_stages(&cells);
    println!();
    for v in &verdicts {
        let holds = match v.holds {
            Some(true) => "holds",
            Some(false) => "DOES NOT HOLD",
            None => "unknown",
        };
        let failed = match v.failed_rounds {
            0 => String::new(),
            n => format!(", {n} failed"),
        };
        let spread = if v.rounds.len() > 1 {
            let each: Vec<String> = v.rounds.iter().map(|r| format!("{r:.2}")).collect();
            format!(
                ", median of rounds {}; {} of {} hold{failed}",
                each.join(" "),
                v.rounds_holding,
                v.rounds.len()
            )
        } else {
            failed
        };
        // Three places: a median at its line reads 0.500, not a bare 0.50
        // beside either verdict.
        println!(
            "{holds:<13} {:<15} {:.3} ({}{spread}): {}",
            v.path, v.ratio, v.measure, v.criterion
        );
    }
    println!(
        "wrote {} and the plots cpu_per_record, p50_latency, p99_latency (.svg) beside it ({pngs})",
        json_path.display()
    );
    Ok(())
}

fn find<'a>(
    cells: &'a [Cell],
    round: u32,
    path: &str,
    mode: &str,
    x: u64,
    y: u64,
) -> Option<&'a Cell> {
    cells.iter().find(|c| {
        c.round == round && c.path == path && c.mode == mode && c.x == x && c.y == y && c.ok()
    })
}

/// Why a round gives a verdict no ratio.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NoRatio {
    /// A cell of the path judged ran and failed (a stall past the
    /// patience, an error): the round counts against it.
    Failed,
    /// A cell was not run, or only the baseline's failed: the round is left out.
    Missing,
}

/// The judged path's cell of a round: `Failed` if it ran and failed.
fn judged<'a>(
    cells: &'a [Cell],
    round: u32,
    path: &str,
    mode: &str,
    x: u64,
    y: u64,
) -> Result<&'a Cell, NoRatio> {
    let ran =
        |c: &&Cell| c.round == round && c.path == path && c.mode == mode && c.x == x && c.y == y;
    match find(cells, round, path, mode, x, y) {
        Some(cell) => Ok(cell),
        None if cells.iter().any(|c| ran(&c)) => Err(NoRatio::Failed),
        None => Err(NoRatio::Missing),
    }
}

/// The baseline's cell of a round (another path's): one that failed only
/// leaves the round out.
fn baseline<'a>(
    cells: &'a [Cell],
    round: u32,
    path: &str,
    mode: &str,
    x: u64,
    y: u64,
) -> Result<&'a Cell, NoRatio> {
    find(cells, round, path, mode, x, y).ok_or(NoRatio::Missing)
}

/// The median of the finite values; NaN when there are none.
fn median(mut values: Vec<f64>) -> f64 {
    values.retain(|v| v.is_finite());
    median_keeping_infinities(values)
}

/// The median of the values, infinities included (a failed round's worst
/// ratio); NaN when there are none.
fn median_keeping_infinities(mut values: Vec<f64>) -> f64 {
    values.retain(|v| !v.is_nan());
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// One cell per (path, mode, X, Y), in first-seen order, whose CPU and
/// latencies are the medians over its rounds that succeeded; a point whose
/// every round failed stays failed.
fn medians<'a>(cells: impl Iterator<Item = &'a Cell>) -> Vec<Cell> {
    let cells: Vec<&Cell> = cells.collect();
    let mut out: Vec<Cell> = Vec::new();
    for c in &cells {
        let same = |d: &Cell| d.path == c.path && d.mode == c.mode && d.x == c.x && d.y == c.y;
        if out.iter().any(same) {
            continue;
        }
        let rounds: Vec<&Cell> = cells
            .iter()
            .copied()
            .filter(|d| same(d) && d.ok())
            .collect();
        let Some(first) = rounds.first() else {
            out.push((*c).clone());
            continue;
        };
        let of = |metric: fn(&Cell) -> f64| median(rounds.iter().map(|d| metric(d)).collect());
        out.push(Cell {
            cpu_us_per_record: of(|d| d.cpu_us_per_record),
            runs_per_record: of(|d| d.runs_per_record),
            p50_us: of(|d| d.p50_us),
            p99_us: of(|d| d.p99_us),
            ..(*first).clone()
        });
    }
    out
}

/// The V6 criteria and targets, each a ratio of two cells of one round;
/// over several rounds, the median of the rounds' ratios.
fn verdicts(cells: &[Cell], rounds: u32) -> Vec<Verdict> {
    let mut out = Vec::new();
    let mut judge = |criterion,
                     path,
                     measure: String,
                     pair: &dyn Fn(u32) -> Result<(f64, f64), NoRatio>,
                     holds: fn(f64) -> bool| {
        // A round whose judged cell failed counts as the worst ratio, so a
        // path that stalls is not judged on its rounds that did not (an
        // infinity either way, so half the rounds failed fails the median).
        let worst = if holds(f64::INFINITY) {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        };
        let mut failed_rounds = 0;
        let ratios: Vec<f64> = (0..rounds)
            .filter_map(|round| match pair(round) {
                Ok((a, b)) => Some(a / b),
                Err(NoRatio::Failed) => {
                    failed_rounds += 1;
                    Some(worst)
                }
                Err(NoRatio::Missing) => None,
            })
            .collect();
        let measured: Vec<f64> = ratios.iter().copied().filter(|r| !r.is_nan()).collect();
        let ratio = median_keeping_infinities(measured);
        out.push(Verdict {
            criterion,
            path,
            ratio,
            measure,
            holds: (!ratio.is_nan()).then(|| holds(ratio)),
            rounds_holding: ratios.iter().filter(|&&r| holds(r)).count(),
            failed_rounds,
            rounds: ratios,
        });
    };
    for path in QPMUX_PATHS {
        for y in [1, 8] {
            let pair = |round, metric: fn(&Cell) -> f64| {
                // X = 1 first: a round that did not run it says nothing.
                let at1 = judged(cells, round, path, "grid", 1, y)?;
                let at64 = judged(cells, round, path, "grid", 64, y)?;
                Ok((metric(at64), metric(at1)))
            };
            judge(
                "batching improves at X/Y = 64",
                path,
                format!("records per batch, X = 64 ÷ X = 1, Y = {y}"),
                &|round| pair(round, |c| c.records_per_batch),
                |r| r > 4.0,
            );
            judge(
                "CPU falls at X/Y = 64",
                path,
                format!("CPU per record, X = 64 ÷ X = 1, Y = {y}"),
                &|round| pair(round, |c| c.cpu_us_per_record),
                |r| r < 0.5,
            );
            judge(
                "target: records per batch at X/Y = 64 paced = 64 (a flush per forward pass)",
                path,
                format!("records per batch ÷ 64, X = 64, Y = {y}, {FLUSHED}"),
                &|round| {
                    judged(cells, round, path, FLUSHED, 64, y).map(|c| (c.records_per_batch, 64.0))
                },
                |r| r >= 0.99,
            );
            judge(
                "target: CPU per record ≤ 0.5× velo's messenger mux at X/Y = 64",
                path,
                format!("CPU per record ÷ {VELO_MUX}'s, X = 64, Y = {y}"),
                &|round| {
                    // The baseline first: without it the round says nothing.
                    let mux = baseline(cells, round, VELO_MUX, "grid", 64, y)?;
                    let ours = judged(cells, round, path, "grid", 64, y)?;
                    Ok((ours.cpu_us_per_record, mux.cpu_us_per_record))
                },
                |r| r <= 0.5,
            );
        }
    }
    let against_per_stream = |round, path: &str, mode: &str, metric: fn(&Cell) -> f64| {
        let theirs = baseline(cells, round, PER_STREAM, mode, 1, 1)?;
        let ours = judged(cells, round, path, mode, 1, 1)?;
        Ok((metric(ours), metric(theirs)))
    };
    for path in QPMUX_PATHS {
        judge(
            "p99 at X/Y = 1 within 2× the per-stream path",
            path,
            format!("p99 ÷ {PER_STREAM}'s, X = Y = 1, one pass per ms"),
            &|round| against_per_stream(round, path, LATENCY, |c| c.p99_us),
            |r| r <= 2.0,
        );
        judge(
            "target: one saturating stream ≥ the per-stream path's records/s",
            path,
            format!("records/s ÷ {PER_STREAM}'s, X = Y = 1, back to back"),
            &|round| against_per_stream(round, path, "saturate", |c| c.records_per_sec),
            |r| r >= 1.0,
        );
        judge(
            "target: p50 at X/Y = 1 ≤ the per-stream path's",
            path,
            format!("p50 ÷ {PER_STREAM}'s, X = Y = 1, one pass per ms"),
            &|round| against_per_stream(round, path, LATENCY, |c| c.p50_us),
            |r| r <= 1.0,
        );
        judge(
            "target: p99 at X/Y = 1 ≤ the per-stream path's",
            path,
            format!("p99 ÷ {PER_STREAM}'s, X = Y = 1, one pass per ms"),
            &|round| against_per_stream(round, path, LATENCY, |c| c.p99_us),
            |r| r <= 1.0,
        );
    }
    for path in [QPMUX_PATHS[0], QPMUX_PATHS[1], VELO_MUX, PER_STREAM] {
        judge(
            "no head-of-line blocking with mixed fast and slow consumers",
            path,
            "56 timed streams' p99 beside 8 backlogged ones whose consumers take one record per 20 ms ÷ beside 8 idle ones".into(),
            &|round| {
                let slow = judged(cells, round, path, "hol-slow", 64, 1)?;
                let base = judged(cells, round, path, "hol-baseline", 64, 1)?;
                // A qpmux round whose slow streams never ran out of credit
                // tested nothing.
                if slow.credit_stalls == Some(0) {
                    return Err(NoRatio::Missing);
                }
                Ok((slow.p99_us, base.p99_us))
            },
            |r| r <= 2.0,
        );
    }
    out
}

/// One line per (path, Y): points (X, metric), a colour per path and a dash
/// per Y; a path that failed at some X says so in its legend.
fn series(cells: &[Cell], metric: impl Fn(&Cell) -> f64) -> Vec<plot::Series> {
    let mut out: Vec<plot::Series> = Vec::new();
    let mut paths: Vec<&str> = Vec::new();
    let mut ys: Vec<u64> = Vec::new();
    for c in cells {
        let base = format!("{} Y={}", c.path, c.y);
        let index = match out.iter().position(|s| s.name.starts_with(&base)) {
            Some(i) => i,
            None => {
                let group = paths.iter().position(|p| *p == c.path).unwrap_or_else(|| {
                    paths.push(c.path);
                    paths.len() - 1
                });
                let dash = ys.iter().position(|y| *y == c.y).unwrap_or_else(|| {
                    ys.push(c.y);
                    ys.len() - 1
                });
                out.push(plot::Series {
                    name: base,
                    points: Vec::new(),
                    group,
                    dash,
                });
                out.len() - 1
            }
        };
        let line = &mut out[index];
        // The legend says where; how many streams it carried is in the JSON.
        if c.ok() {
            line.points.push((c.x as f64, metric(c)));
        } else {
            line.name += &format!(" (failed at X={})", c.x);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(mode: &'static str, x: u64, y: u64) -> Shape {
        Shape {
            mode,
            x,
            y,
            workload: Workload::new(x, 1, 64, None),
        }
    }

    #[test]
    fn cell_filters_match_path_mode_and_shape() {
        let f: CellFilter = "qpmux-rdma:grid:64".parse().expect("parses");
        assert!(f.matches("qpmux-rdma", &shape("grid", 64, 1)));
        assert!(f.matches("qpmux-rdma", &shape("grid", 64, 8)));
        assert!(!f.matches("qpmux-rdma", &shape("grid", 1, 1)));
        assert!(!f.matches("qpmux-tcp", &shape("grid", 64, 1)));
        assert!(!f.matches("qpmux-rdma", &shape("saturate", 64, 1)));
        let any_path: CellFilter = "*:saturate".parse().expect("parses");
        assert!(any_path.matches("velo-tcp-stream", &shape("saturate", 1, 1)));
        let y8: CellFilter = ":grid::8".parse().expect("parses");
        assert!(y8.matches("velo-tcp-mux", &shape("grid", 1024, 8)));
        assert!(!y8.matches("velo-tcp-mux", &shape("grid", 1024, 1)));
    }

    #[test]
    fn a_rounds_cells_run_by_shape_in_a_balanced_order() {
        let grid = [
            ("a", shape("grid", 1, 1)),
            ("a", shape("grid", 64, 1)),
            ("b", shape("grid", 1, 1)),
            ("b", shape("grid", 64, 1)),
            ("c", shape("grid", 1, 1)),
            ("c", shape("grid", 64, 1)),
            ("a", shape("saturate", 1, 1)),
        ];
        let shapes = by_shape(&grid);
        let order = |round| -> Vec<(&str, u64, &str)> {
            round_order(&shapes, round)
                .into_iter()
                .map(|(path, s)| (s.mode, s.x, path))
                .collect()
        };
        assert_eq!(
            order(0),
            [
                ("grid", 1, "a"),
                ("grid", 1, "b"),
                ("grid", 1, "c"),
                ("grid", 64, "a"),
                ("grid", 64, "b"),
                ("grid", 64, "c"),
                ("saturate", 1, "a"),
            ]
        );
        assert_eq!(
            order(1),
            [
                ("grid", 1, "b"),
                ("grid", 1, "c"),
                ("grid", 1, "a"),
                ("grid", 64, "b"),
                ("grid", 64, "c"),
                ("grid", 64, "a"),
                ("saturate", 1, "a"),
            ]
        );
        // Every cell once a round, and each path first twice in six rounds
        // (three paths: the second three rounds run reversed).
        for round in 0..6 {
            assert_eq!(order(round).len(), grid.len());
        }
        let firsts: Vec<&str> = (0..6).map(|r| order(r)[0].2).collect();
        assert_eq!(firsts, ["a", "b", "c", "c", "a", "b"]);
    }

    /// Over a cycle (n rounds, 2n for an odd n) each item runs in each place
    /// equally often and right before each other item equally often; a
    /// rotation by one had one of four paths right before another in 3 of
    /// 4 rounds.
    #[test]
    fn the_balanced_order_puts_each_path_before_each_other_equally_often() {
        for n in 1..=6 {
            let cycle = if n % 2 == 0 { n } else { 2 * n };
            let mut places = vec![vec![0; n]; n];
            let mut before = vec![vec![0; n]; n];
            for round in 0..cycle {
                let order = balanced_order(n, round);
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n {n} round {round}");
                for (place, &item) in order.iter().enumerate() {
                    places[item][place] += 1;
                }
                for pair in order.windows(2) {
                    before[pair[0]][pair[1]] += 1;
                }
            }
            let each_place = cycle / n;
            assert!(
                places.iter().flatten().all(|&k| k == each_place),
                "n {n}: {places:?}"
            );
            let each_pair = if n % 2 == 0 { 1 } else { 2 };
            for (a, row) in before.iter().enumerate() {
                for (b, &k) in row.iter().enumerate() {
                    assert_eq!(
                        k,
                        if a == b { 0 } else { each_pair },
                        "n {n}: {a} before {b}"
                    );
                }
            }
        }
    }

    fn cell(round: u32, path: &'static str, x: u64, cpu: f64) -> Cell {
        let report = Report {
            records: 1000,
            elapsed: Duration::from_secs(1),
            cpu: Duration::from_secs_f64(cpu * 1e-3),
            cpu_runs: 500,
            records_per_batch: x as f64,
            credit_stalls: None,
            held: Default::default(),
            p50: Duration::from_micros(50),
            p99: Duration::from_micros(100),
            peak_rss: 0,
            rss_growth: 0,
            fds: 3,
            stages: None,
            stages_slowest: None,
        };
        Cell::new(round, path, shape("grid", x, 1), &report)
    }

    #[test]
    fn a_verdict_over_rounds_is_the_median_of_same_round_ratios() {
        let mut cells = Vec::new();
        // CPU µs per record at X = 64, Y = 1: ours ÷ velo's mux is 0.4, 0.9,
        // 0.45 by round; round 3 has no velo cell and is skipped.
        for (round, ours, theirs) in [(0, 2.0, 5.0), (1, 4.5, 5.0), (2, 1.8, 4.0)] {
            cells.push(cell(round, "qpmux-rdma", 64, ours));
            cells.push(cell(round, VELO_MUX, 64, theirs));
        }
        cells.push(cell(3, "qpmux-rdma", 64, 9.0));
        let verdicts = verdicts(&cells, 4);
        let cpu = verdicts
            .iter()
            .find(|v| {
                v.path == "qpmux-rdma"
                    && v.measure.contains("X = 64, Y = 1")
                    && v.criterion.contains("0.5×")
            })
            .expect("the CPU target is judged");
        assert_eq!(cpu.rounds.len(), 3);
        assert!((cpu.ratio - 0.45).abs() < 1e-9, "{cpu:?}");
        assert_eq!(cpu.holds, Some(true));
        assert_eq!(cpu.rounds_holding, 2, "0.4 and 0.45 hold, 0.9 does not");
        // A verdict none of whose rounds has both cells is unknown.
        let saturate = verdicts
            .iter()
            .find(|v| v.path == "qpmux-rdma" && v.measure.contains("back to back"))
            .expect("judged");
        assert_eq!((saturate.holds, saturate.rounds.len()), (None, 0));
    }

    /// A round whose judged cell failed counts against the path, as its
    /// worst ratio; one whose baseline cell failed is left out. A path that
    /// stalls in every round does not hold; it used to read "unknown", and
    /// one that stalled in some rounds was judged on the rest alone.
    #[test]
    fn a_failed_cell_of_the_path_judged_counts_against_it() {
        let failed = |round, path, mode| {
            Cell::failed(
                round,
                path,
                shape(mode, 64, 1),
                &anyhow::anyhow!("no progress"),
            )
        };
        let mut cells = Vec::new();
        // Ours ÷ velo's mux: 0.4 and 0.45 measured, round 2 ours failed,
        // round 3 velo's failed.
        for (round, ours, theirs) in [(0, 2.0, 5.0), (1, 1.8, 4.0)] {
            cells.push(cell(round, "qpmux-rdma", 64, ours));
            cells.push(cell(round, VELO_MUX, 64, theirs));
        }
        cells.push(failed(2, "qpmux-rdma", "grid"));
        cells.push(cell(2, VELO_MUX, 64, 5.0));
        cells.push(cell(3, "qpmux-rdma", 64, 2.0));
        cells.push(failed(3, VELO_MUX, "grid"));
        // The other path failed in every round it ran; in round 3, where
        // velo's cell failed too, that says nothing.
        for round in 0..4 {
            cells.push(failed(round, "qpmux-tcp", "grid"));
        }
        // A cell judged alone, where more is better.
        cells.push(failed(0, "qpmux-tcp", FLUSHED));
        let verdicts = verdicts(&cells, 4);
        let cpu = |path| {
            verdicts
                .iter()
                .find(|v| {
                    v.path == path
                        && v.measure.contains("X = 64, Y = 1")
                        && v.criterion.contains("0.5×")
                })
                .expect("the CPU target is judged")
        };
        let rdma = cpu("qpmux-rdma");
        assert_eq!((rdma.rounds.len(), rdma.failed_rounds), (3, 1), "{rdma:?}");
        assert_eq!(rdma.rounds_holding, 2);
        assert!((rdma.ratio - 0.45).abs() < 1e-9, "{rdma:?}");
        let tcp = cpu("qpmux-tcp");
        assert_eq!((tcp.failed_rounds, tcp.holds), (3, Some(false)), "{tcp:?}");
        // Where more is better, a failed round counts as −∞.
        let flushed = verdicts
            .iter()
            .find(|v| {
                v.path == "qpmux-tcp" && v.measure.contains(FLUSHED) && v.measure.contains("Y = 1")
            })
            .expect("judged");
        assert_eq!((flushed.failed_rounds, flushed.holds), (1, Some(false)));
        assert_eq!(flushed.rounds, [f64::NEG_INFINITY]);
        // Batching compares X = 64 with X = 1, never run here: nothing said.
        let batching = verdicts
            .iter()
            .find(|v| v.path == "qpmux-tcp" && v.criterion.starts_with("batching"))
            .expect("judged");
        assert_eq!((batching.failed_rounds, batching.holds), (0, None));
    }

    #[test]
    fn plotted_points_are_medians_over_rounds_and_failures_are_skipped() {
        let mut cells: Vec<Cell> = [3.0, 1.0, 2.0]
            .into_iter()
            .enumerate()
            .map(|(round, cpu)| cell(round as u32, "qpmux-tcp", 8, cpu))
            .collect();
        cells.push(Cell::failed(
            3,
            "qpmux-tcp",
            shape("grid", 8, 1),
            &anyhow::anyhow!("lost"),
        ));
        cells.push(Cell::failed(
            0,
            "qpmux-rdma",
            shape("grid", 8, 1),
            &anyhow::anyhow!("lost"),
        ));
        let points = medians(cells.iter());
        assert_eq!(points.len(), 2);
        assert!((points[0].cpu_us_per_record - 2.0).abs() < 1e-9);
        assert!((points[0].runs_per_record - 0.5).abs() < 1e-9);
        assert!(points[0].ok());
        assert!(!points[1].ok());
        assert!(median(vec![f64::NAN, 4.0, 1.0, 2.0, 3.0]).eq(&2.5));
    }

    #[test]
    fn the_scheduling_policy_is_named_from_proc_self_sched() {
        let text = |n: &str| {
            format!(
                "se.nr_migrations : 3\npolicy{:>40}\nprio : 120\n",
                format!(": {n}")
            )
        };
        assert_eq!(policy_name(&text("0")), "normal");
        assert_eq!(policy_name(&text("3")), "batch");
        assert_eq!(policy_name(&text("7")), "policy 7");
        assert_eq!(policy_name("prio : 120\n"), "unknown");
    }

    #[test]
    fn bad_cell_filters_are_refused() {
        assert!("a:b:x".parse::<CellFilter>().is_err());
        assert!("a:b:1:2:3".parse::<CellFilter>().is_err());
        assert!("a:b:1:-2".parse::<CellFilter>().is_err());
    }
}
