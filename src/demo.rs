//! A streaming workload any link can run, and the table the demo prints.
//!
//! ```text
//!  producer task ─ per pass: every timed stream sends one record (stamped) ─► Mux<L> ─► link
//!  one task per slow stream ─ back to back, held by the path's pushback ─────┘
//!  consumer per stream ◄─ Mux<L> ◄─ link;  latency = receive time − stamp (timed streams)
//! ```
//!
//! The same workload runs over every link kind, so the report's rows are
//! comparable when measured in one process, one after the other. Untimed
//! streams test head-of-line blocking: with slow consumers (each sleeps
//! after every record) their producers stay blocked on the path's pushback;
//! idle, they give the baseline the same streams. Only the timed streams
//! are counted and timed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Mutex, Notify};

use crate::link::{Link, Node};
use crate::mux::{Frame, Mux, MuxTransport, PeerId, StreamKey, Terminal};
use crate::stages::{self, STAGES, Stage};

/// Shape of one workload run.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Streams (slots) to the peer.
    pub streams: u64,
    /// Passes; each sends one record on every stream.
    pub passes: u64,
    /// Bytes per record (at least 16: the stamp).
    pub record_size: usize,
    /// One pass starts every `pace` ([`Pacer`]; `None`: back to back).
    pub pace: Option<Duration>,
    /// Of each target's streams, how many (the first, fewer than `streams`)
    /// are untimed: their records are neither counted nor timed.
    pub untimed_streams: u64,
    /// `Some(delay)`: after priming, each untimed stream's producer sends
    /// back to back, held only by the path's pushback, and its consumer
    /// sleeps `delay` after every record; [`SIDE_FILL`] passes before the
    /// clock starts, so their windows are full. `None`: the untimed streams
    /// stay idle after priming (the head-of-line baseline).
    pub slow_consumer: Option<Duration>,
    /// Call `flush(peer)` for every target after each pass: the forward-pass
    /// shape for a mux under [`crate::mux::FlushPolicy::Manual`].
    pub flush_each_pass: bool,
}

impl Workload {
    /// `streams` streams, `passes` passes of `record_size`-byte records,
    /// `pace` apart, every consumer fast.
    pub fn new(streams: u64, passes: u64, record_size: usize, pace: Option<Duration>) -> Self {
        Workload {
            streams,
            passes,
            record_size: record_size.max(16),
            pace,
            untimed_streams: 0,
            slow_consumer: None,
            flush_each_pass: false,
        }
    }

    /// Whether a run to `targets` targets measures anything: an empty one
    /// would report zeros that look like measurements.
    pub fn check(&self, targets: usize) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.timed_streams() > 0 && self.passes > 0 && targets > 0,
            "a run needs a timed stream, a pass and a target"
        );
        Ok(())
    }

    /// How long a run of this workload may go with nothing arriving before
    /// it is stuck: [`STALL`], or two paces when that is longer.
    pub fn patience(&self) -> Duration {
        STALL.max(self.pace.unwrap_or_default() * 2)
    }

    /// Streams per target whose records are counted and timed.
    pub fn timed_streams(&self) -> u64 {
        self.streams.saturating_sub(self.untimed_streams)
    }
}

/// How long slow consumers' producers run before the clock starts: enough
/// to fill a window of a few thousand records on every path.
pub const SIDE_FILL: Duration = Duration::from_millis(100);

/// A path that could not carry the workload's streams (typically a
/// per-stream transport out of file descriptors): how far it got.
#[derive(Debug, thiserror::Error)]
#[error("carried {carried} of {wanted} streams, then: {reason}")]
pub struct StreamWall {
    /// Streams that were open and delivering when it failed.
    pub carried: u64,
    /// Streams the workload asked for.
    pub wanted: u64,
    /// What failed.
    pub reason: String,
}

/// What one run measured.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    /// Records delivered.
    pub records: u64,
    /// Wall time from first send to last delivery.
    pub elapsed: Duration,
    /// Process CPU time (user + system) spent meanwhile.
    pub cpu: Duration,
    /// Times the process's threads were put on a CPU meanwhile (each wake-up
    /// of a sleeping thread, each preemption's return): [`process_runs`].
    pub cpu_runs: u64,
    /// Records per batch on the sending mux: the workload's records sent
    /// meanwhile (timed and slow) over its batches, so a record cut into
    /// fragments counts once.
    pub records_per_batch: f64,
    /// Times the sending mux found a slot out of credit from when the slow
    /// producers started (`None` where the path does not say): above zero
    /// in a head-of-line cell shows the slow streams were held back.
    pub credit_stalls: Option<u64>,
    /// How much the timed records' sends waited on the path's pushback
    /// (the records behind a wait are stamped from when they were due:
    /// [`Pacer`]).
    pub held: Held,
    /// Median one-way record latency.
    pub p50: Duration,
    /// 99th percentile one-way record latency.
    pub p99: Duration,
    /// Peak resident set size during the run, bytes (the process's: it
    /// includes what earlier runs left allocated).
    pub peak_rss: u64,
    /// Peak RSS less the RSS when the clock started: what this run grew.
    pub rss_growth: u64,
    /// Open file descriptors at the end of the run.
    pub fds: u64,
    /// Where a record's time went, when [`crate::stages`] were on.
    pub stages: Option<StageMedians>,
    /// The same for the slowest 1% of records by delivery offset: where
    /// the tail's time went.
    pub stages_slowest: Option<StageMedians>,
}

/// Median offset from the producer's stamp, in microseconds, of each later
/// [`Stage`] (Woken, Encoded, Posted, Received,
/// Decoding) and then of the delivery; `None` where no record passed it.
pub type StageMedians = [Option<f64>; STAGES];

/// Per-stage medians of the offsets taken at each delivery.
pub fn stage_medians(samples: &[[Option<u64>; STAGES]]) -> StageMedians {
    std::array::from_fn(|i| {
        let mut at: Vec<u64> = samples.iter().filter_map(|s| s[i]).collect();
        at.sort_unstable();
        at.get(at.len() / 2).map(|&ns| ns as f64 / 1e3)
    })
}

/// [`stage_medians`] of the slowest 1% of records by delivery offset (at
/// least one record).
pub fn slowest_stage_medians(samples: &[[Option<u64>; STAGES]]) -> StageMedians {
    let mut delivered: Vec<&[Option<u64>; STAGES]> =
        samples.iter().filter(|s| s[STAGES - 1].is_some()).collect();
    delivered.sort_unstable_by_key(|s| s[STAGES - 1]);
    let keep = (delivered.len() / 100).max(1).min(delivered.len());
    let slowest: Vec<[Option<u64>; STAGES]> = delivered[delivered.len() - keep..]
        .iter()
        .map(|s| **s)
        .collect();
    stage_medians(&slowest)
}

impl Report {
    /// Records per second.
    pub fn rate(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// CPU microseconds per record.
    pub fn cpu_per_record_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.records.max(1) as f64
    }

    /// Threads put on a CPU per record.
    pub fn runs_per_record(&self) -> f64 {
        self.cpu_runs as f64 / self.records.max(1) as f64
    }
}

/// The shortest pace [`Pacer`] holds on a grid: two of tokio's timer ticks.
pub const SHORTEST_GRID: Duration = Duration::from_millis(2);

/// tokio's timer resolution: a sleep wakes up to this much past its deadline.
const TIMER_TICK: Duration = Duration::from_millis(1);

/// Starts forward passes at a fixed rate: one every `pace`, on a grid from
/// the first. A pass that ends late starts the next at once, and one that
/// ends later than the start after that skips to the grid's next point, so
/// passes never burst to catch up.
///
/// tokio's timer has millisecond ticks and wakes up to a tick late, so a
/// grid finer than [`SHORTEST_GRID`] loses a varying share of its points,
/// and the rate would differ between the paths compared. A shorter pace
/// starts each pass `pace` after the last one started, as the timer allows
/// (one pass per ms runs about every 2 ms).
///
/// Either way the next start is armed as a pass starts: armed once the pass
/// is done, it is earlier than the deadline a parked worker sleeps towards,
/// and tokio wakes that worker to re-arm. On the grid the start after that
/// is armed too, so a worker that parked in the I/O driver as the pass began
/// sleeps towards the next start, and the one armed now is later still
/// (docs/benchmarks.md § "The pacer").
///
/// Records are stamped through it ([`Pacer::stamp`]), and sends go through
/// it ([`Pacer::send`]), so a producer held by the path's pushback does not
/// hide the hold from the records behind it (coordinated omission): a record
/// is stamped from when it was due, not from when the held producer got to
/// it. Lateness that was not pushback (a late timer, a preempted producer)
/// is not charged (docs/benchmarks.md § "Records stamped from when they
/// were due").
pub struct Pacer {
    pace: Option<Duration>,
    /// How far before now this pass's next record was due: the producer's
    /// lateness past the pass's start that its sends' waits explain, then
    /// each wait of an earlier send in the pass.
    owed: Duration,
    /// What this pass's sends waited, together.
    waited_this_pass: Duration,
    held: Held,
    next: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// On the grid: the start after `next`, a pace later.
    after: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl Pacer {
    /// A pacer whose first pass starts at once; `None` or zero: back to back.
    pub fn new(pace: Option<Duration>) -> Self {
        Pacer {
            pace: pace.filter(|p| !p.is_zero()),
            next: Box::pin(tokio::time::sleep(Duration::ZERO)),
            after: Box::pin(tokio::time::sleep(Duration::ZERO)),
            owed: Duration::ZERO,
            waited_this_pass: Duration::ZERO,
            held: Held::default(),
        }
    }

    /// Waits for the next pass's start and arms the one after it.
    pub async fn start_pass(&mut self) {
        let waited = std::mem::take(&mut self.waited_this_pass);
        let owed_at_end = std::mem::take(&mut self.owed);
        let Some(pace) = self.pace else { return };
        let ready = tokio::time::Instant::now();
        // A pass the producer reaches after its start owes its records the
        // lateness past a timer tick (the timer would have woken that late
        // anyway), as far as holds explain it: the last pass's waits under a
        // short pace, whose schedule slides with each start; on the grid,
        // which does not slide, the holds carried into that pass too. A
        // producer late for other reasons owes nothing, and a skipped grid
        // start is counted, not owed: its records are never sent.
        let owe = |due: tokio::time::Instant, explained: Duration| {
            ready
                .saturating_duration_since(due + TIMER_TICK)
                .min(explained)
        };
        if pace < SHORTEST_GRID {
            self.owed = owe(self.next.deadline(), waited);
            self.next.as_mut().await;
            let after_this = tokio::time::Instant::now() + pace;
            self.next.as_mut().reset(after_this);
            return;
        }
        if self.next.deadline() + pace <= tokio::time::Instant::now() {
            let back_on_grid = self.grid_point_after(pace, tokio::time::Instant::now());
            let skipped = (back_on_grid - self.next.deadline()).as_nanos() / pace.as_nanos();
            self.held.passes_skipped += u64::try_from(skipped).unwrap_or(u64::MAX);
            self.next.as_mut().reset(back_on_grid);
        }
        self.owed = owe(self.next.deadline(), owed_at_end);
        self.next.as_mut().await;
        let after_this = self.grid_point_after(pace, tokio::time::Instant::now());
        // `after` is already there unless this is the first pass or one skipped.
        if self.after.deadline() != after_this {
            self.after.as_mut().reset(after_this);
        }
        std::mem::swap(&mut self.next, &mut self.after);
        self.after.as_mut().reset(after_this + pace);
    }

    /// Runs one record's `send`. If it waits (the path's pushback), the
    /// records after it in the pass, and the next pass's if this one ends
    /// late, are stamped that much earlier: they were due then. Without a
    /// pace nothing was due at any time: the wait is only counted.
    pub async fn send<F: std::future::Future>(&mut self, send: F) -> F::Output {
        let mut send = std::pin::pin!(send);
        let mut waiting_since = None;
        let out = std::future::poll_fn(|cx| {
            let poll = send.as_mut().poll(cx);
            if poll.is_pending() && waiting_since.is_none() {
                waiting_since = Some(tokio::time::Instant::now());
            }
            poll
        })
        .await;
        if let Some(since) = waiting_since {
            let waited = since.elapsed();
            self.held.sends += 1;
            self.held.total += waited;
            self.waited_this_pass += waited;
            if self.pace.is_some() {
                self.owed += waited;
            }
        }
        out
    }

    /// The next record's stamp, nanoseconds since `origin`: when it was due
    /// (now, less what pushback held the producer since, [`Pacer::send`]).
    pub fn stamp(&self, origin: Instant) -> u64 {
        self.stamp_at(origin.elapsed())
    }

    /// [`Pacer::stamp`] with the time since the origin given.
    fn stamp_at(&self, since_origin: Duration) -> u64 {
        since_origin.saturating_sub(self.owed).as_nanos() as u64
    }

    /// How much the sends made through [`Pacer::send`] waited.
    pub fn held(&self) -> Held {
        self.held
    }

    /// The first point of the grid after the armed deadline that is later
    /// than `now`.
    fn grid_point_after(&self, pace: Duration, now: tokio::time::Instant) -> tokio::time::Instant {
        let mut due = self.next.deadline() + pace;
        if due <= now {
            let missed = (now - due).as_nanos() / pace.as_nanos() + 1;
            due += pace * u32::try_from(missed).unwrap_or(u32::MAX);
        }
        due
    }
}

/// How much a producer's sends waited on the path's pushback.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Sends that waited.
    pub sends: u64,
    /// Their waits, together.
    pub total: Duration,
    /// Grid starts a late pass skipped: records never sent, so never timed.
    pub passes_skipped: u64,
}

/// Process CPU time so far: the sum over its threads of the nanoseconds each
/// spent on a CPU (`/proc/self/task/*/schedstat`, nanosecond resolution).
/// Threads that already exited are not counted; the tokio workers live on.
pub fn process_cpu() -> Duration {
    Duration::from_nanos(schedstat_sum(0))
}

/// How many times this process's threads have been put on a CPU (the third
/// field of each thread's `schedstat`: timeslices run).
pub fn process_runs() -> u64 {
    schedstat_sum(2)
}

/// Field `field` of `/proc/self/task/*/schedstat`, summed over the threads.
fn schedstat_sum(field: usize) -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|task| {
            let path = task.ok()?.path().join("schedstat");
            let text = std::fs::read_to_string(path).ok()?;
            text.split_whitespace().nth(field)?.parse::<u64>().ok()
        })
        .sum()
}

/// Peak resident set size of the process in bytes (`VmHWM`).
pub fn peak_rss() -> u64 {
    status_kib("VmHWM:") * 1024
}

/// A `… kB` field of `/proc/self/status`, 0 where there is none.
fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Resident set size of the process now, bytes (`VmRSS`).
pub fn current_rss() -> u64 {
    status_kib("VmRSS:") * 1024
}

/// Resets the peak RSS to the current RSS, so the next cell's peak is its
/// own, and returns that RSS (the base of [`Report::rss_growth`]).
pub fn reset_peak_rss() -> u64 {
    // Linux: writing 5 to clear_refs resets VmHWM. Failure only means the
    // next peak includes earlier ones.
    if let Err(err) = std::fs::write("/proc/self/clear_refs", "5") {
        tracing::debug!(%err, "cannot reset peak RSS");
    }
    current_rss()
}

/// Open file descriptors of the process.
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count() as u64)
}

/// The stamp of a priming record, which is neither counted nor timed.
const PRIMING_STAMP: u64 = u64::MAX;

/// Runs `workload` from node `a` to node `b` (registering `b` with `a`).
pub async fn run_nodes<N: Node>(
    a: &N,
    b: &N,
    anchor: u64,
    workload: Workload,
) -> anyhow::Result<Report> {
    let peer = a.register(&b.address())?;
    run(a.mux(), &[(b.mux(), peer)], anchor, workload).await
}

/// Runs `workload` from `sender` to every target: each target's mux
/// receives `workload.streams` streams, which the sender reaches as its
/// `PeerId`. Every pass sends one record on every timed stream of every
/// target. One priming record per stream crosses first, outside the clock,
/// CPU and batch counts, so links are up and slots open when timing starts.
/// Fails when a send fails or nothing arrives for [`Workload::patience`].
pub async fn run<L: Link>(
    sender: &Mux<L>,
    targets: &[(&Mux<L>, PeerId)],
    anchor: u64,
    workload: Workload,
) -> anyhow::Result<Report> {
    workload.check(targets.len())?;
    let origin = Instant::now();
    let total = workload.timed_streams() * workload.passes * targets.len() as u64;
    let every_stream = workload.streams * targets.len() as u64;
    let received = Arc::new(Countdown::new(total));
    let primed = Arc::new(Countdown::new(every_stream));
    let slow_sent = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(total as usize)));
    let stage_samples = Arc::new(Mutex::new(Vec::new()));
    let record_size = workload.record_size.max(16);
    // Both abort their tasks when dropped, so a run that fails leaves none.
    let mut consumers = tokio::task::JoinSet::new();
    let mut senders = Vec::new();
    let mut untimed_senders = Vec::new();
    let mut side_tasks = tokio::task::JoinSet::new();
    for &(receiver, peer) in targets {
        for s in 0..workload.streams {
            let key = StreamKey::new(anchor, s);
            let mut rx = receiver.bind(key)?;
            let tx = sender.open(peer, key)?;
            let primed = primed.clone();
            if s < workload.untimed_streams {
                let delay = workload.slow_consumer;
                side_tasks.spawn(async move {
                    while let Some(frame) = rx.recv().await {
                        match frame {
                            Frame::Data(record) if stamp_of(&record) == PRIMING_STAMP => {
                                primed.tick();
                            }
                            Frame::Data(_) | Frame::Heartbeat => {
                                if let Some(delay) = delay {
                                    tokio::time::sleep(delay).await;
                                }
                            }
                            _ => break,
                        }
                    }
                });
                untimed_senders.push(tx);
                continue;
            }
            let (received, latencies, stage_samples) =
                (received.clone(), latencies.clone(), stage_samples.clone());
            consumers.spawn(async move {
                let mut local = Vec::new();
                let mut offsets = Vec::new();
                while let Some(frame) = rx.recv().await {
                    let record = match frame {
                        Frame::Data(record) => record,
                        // A slot idle for a heartbeat interval (a long pace).
                        Frame::Heartbeat => continue,
                        _ => break,
                    };
                    let stamp = stamp_of(&record);
                    if stamp == PRIMING_STAMP {
                        primed.tick();
                        continue;
                    }
                    if stages::enabled() {
                        offsets.push(stages::offsets_at_delivery());
                    }
                    let now = origin.elapsed().as_nanos() as u64;
                    local.push(now.saturating_sub(stamp));
                    received.tick();
                }
                latencies.lock().await.extend(local);
                stage_samples.lock().await.extend(offsets);
            });
            senders.push(tx);
        }
    }
    // Every stream carries one record end to end before the clock starts,
    // so no measured record waits on a dial or a slot's first Open.
    let mut record = vec![0u8; record_size];
    record[..8].copy_from_slice(&PRIMING_STAMP.to_be_bytes());
    for tx in senders.iter_mut().chain(&mut untimed_senders) {
        tx.send(Bytes::copy_from_slice(&record)).await?;
    }
    let peers: Vec<PeerId> = targets.iter().map(|&(_, peer)| peer).collect();
    let end_pass = || flush_all(sender, &peers, workload.flush_each_pass);
    end_pass()?;
    let patience = workload.patience();
    if let Err(seen) = primed.reached(patience).await {
        anyhow::bail!("{seen} of {every_stream} streams primed, then none for {patience:?}");
    }
    let stalls_before = sender.stats().credit_stalls;
    if workload.slow_consumer.is_some() {
        for mut tx in untimed_senders.drain(..) {
            let slow_sent = slow_sent.clone();
            let record = Bytes::from(vec![0u8; record_size]);
            side_tasks.spawn(async move {
                // Ends when aborted, or when the run tears the slot down.
                while tx.send(record.clone()).await.is_ok() {
                    slow_sent.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        tokio::time::sleep(SIDE_FILL).await;
    }
    let before = sender.stats();
    let slow_before = slow_sent.load(Ordering::Relaxed);
    let rss_before = reset_peak_rss();
    let cpu_before = process_cpu();
    let runs_before = process_runs();
    let start = Instant::now();
    // The producer is a runtime task, as an application's is, not the
    // thread blocked in `block_on` (whose every send would wake a worker
    // from another thread): docs/benchmarks.md § "The producer is a task".
    let mut producer = {
        let (sender, peers) = (sender.clone(), peers.clone());
        tokio::spawn(async move {
            let mut pacer = Pacer::new(workload.pace);
            for _ in 0..workload.passes {
                pacer.start_pass().await;
                for tx in &mut senders {
                    let stamp = pacer.stamp(origin);
                    stages::mark(Stage::Stamped);
                    record[..8].copy_from_slice(&stamp.to_be_bytes());
                    pacer.send(tx.send(Bytes::copy_from_slice(&record))).await?;
                }
                flush_all(&sender, &peers, workload.flush_each_pass)?;
            }
            anyhow::Ok((senders, pacer.held()))
        })
    };
    // Watched while the producer runs: a producer held for good (a
    // backlog it cannot pass) is a failed cell, not a hang, and a producer
    // that fails says why at once.
    let (senders, held) = producer_watched(&mut producer, &received, patience).await??;
    if let Err(seen) = received.reached(patience).await {
        anyhow::bail!("{seen} of {total} records arrived, then none for {patience:?}");
    }
    let elapsed = start.elapsed();
    let cpu = process_cpu().saturating_sub(cpu_before);
    let cpu_runs = process_runs().saturating_sub(runs_before);
    let fds = open_fds();
    let rss = peak_rss();
    let after = sender.stats();
    let slow_records = slow_sent.load(Ordering::Relaxed) - slow_before;
    side_tasks.abort_all();
    for tx in senders {
        tx.finish(Terminal::Finalized)?;
    }
    // Under a manual flush the terminals wait for one too.
    end_pass()?;
    // A stream's end that does not come fails the cell, not the whole run:
    // no stream ending for `patience`, as every wait before this one.
    loop {
        match tokio::time::timeout(patience, consumers.join_next()).await {
            Ok(Some(consumer)) => consumer?,
            Ok(None) => break,
            Err(_) => anyhow::bail!(
                "{} streams not ended, and none for {patience:?}",
                consumers.len()
            ),
        }
    }
    let lat = std::mem::take(&mut *latencies.lock().await);
    let (p50, p99) = percentiles(lat);
    let stage_samples = std::mem::take(&mut *stage_samples.lock().await);
    let stages = (!stage_samples.is_empty()).then(|| stage_medians(&stage_samples));
    let stages_slowest = (!stage_samples.is_empty()).then(|| slowest_stage_medians(&stage_samples));
    let batches = after.batches_sent - before.batches_sent;
    Ok(Report {
        records: total,
        elapsed,
        cpu,
        cpu_runs,
        records_per_batch: if batches == 0 {
            0.0
        } else {
            (total + slow_records) as f64 / batches as f64
        },
        credit_stalls: Some(after.credit_stalls - stalls_before),
        held,
        p50,
        p99,
        peak_rss: rss,
        rss_growth: rss.saturating_sub(rss_before),
        fds,
        stages,
        stages_slowest,
    })
}

/// The shortest a run waits with nothing arriving before it gives up.
pub const STALL: Duration = Duration::from_secs(5);

/// A count the consumers tick and the run awaits. Only the tick that
/// reaches the target wakes the waiter: a wake-up per record would put the
/// harness's cost into the cell's CPU (docs/benchmarks.md § "The harness
/// wakes once a phase").
pub struct Countdown {
    count: AtomicU64,
    target: u64,
    reached: Notify,
}

impl Countdown {
    /// A count from zero toward `target`.
    pub fn new(target: u64) -> Self {
        Countdown {
            count: AtomicU64::new(0),
            target,
            reached: Notify::new(),
        }
    }

    /// Counts one.
    pub fn tick(&self) {
        if self.count.fetch_add(1, Ordering::Relaxed) + 1 == self.target {
            self.reached.notify_one();
        }
    }

    /// The count so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Waits until the count reaches its target; `Err(seen)` once it has not
    /// moved for `patience` (a hang turned into a failure, not a
    /// measurement).
    pub async fn reached(&self, patience: Duration) -> Result<(), u64> {
        loop {
            let seen = self.count();
            if seen >= self.target {
                return Ok(());
            }
            if tokio::time::timeout(patience, self.reached.notified())
                .await
                .is_err()
                && self.count() == seen
            {
                return Err(seen);
            }
        }
    }
}

/// Awaits the producer, failing when `received` stops moving for
/// `patience` meanwhile (then the producer is aborted). The count is read
/// on a timer, not woken per record: a waiter on every delivery is a
/// wake-up per record in the cell's CPU (it cost the saturating TCP stream
/// ~20% of its rate).
pub async fn producer_watched<T>(
    producer: &mut tokio::task::JoinHandle<T>,
    received: &Countdown,
    patience: Duration,
) -> anyhow::Result<T> {
    let mut seen = received.count();
    loop {
        tokio::select! {
            done = &mut *producer => return Ok(done?),
            () = tokio::time::sleep(patience) => {
                let now = received.count();
                if now == seen {
                    producer.abort();
                    anyhow::bail!("{now} records arrived, then none for {patience:?}");
                }
                seen = now;
            }
        }
    }
}

/// A record's stamp: its first 8 bytes.
fn stamp_of(record: &[u8]) -> u64 {
    u64::from_be_bytes(record[..8].try_into().expect("records carry a stamp"))
}

/// `flush(peer)` for every peer, when the workload flushes its passes.
fn flush_all<L: Link>(sender: &Mux<L>, peers: &[PeerId], on: bool) -> anyhow::Result<()> {
    if on {
        for &peer in peers {
            sender.flush(peer)?;
        }
    }
    Ok(())
}

/// The median and 99th percentile of latencies in nanoseconds.
pub fn percentiles(mut nanos: Vec<u64>) -> (Duration, Duration) {
    nanos.sort_unstable();
    let pick = |q: f64| {
        nanos
            .get(((nanos.len() as f64 - 1.0) * q) as usize)
            .map_or(Duration::ZERO, |&n| Duration::from_nanos(n))
    };
    (pick(0.50), pick(0.99))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::mem::{MemConfig, MemFabric};
    use crate::mux::MuxConfig;

    #[tokio::test(start_paused = true)]
    async fn passes_start_on_a_fixed_grid_and_an_overrun_skips_to_its_next_point() {
        let pace = Duration::from_millis(5);
        let origin = tokio::time::Instant::now();
        let mut pacer = Pacer::new(Some(pace));
        let mut starts = Vec::new();
        for pass in 0..6 {
            pacer.start_pass().await;
            starts.push((tokio::time::Instant::now() - origin).as_micros());
            // Each pass works 1 ms, the third 13.5 ms: it misses the starts at
            // 15 and 20 ms.
            let work = if pass == 2 { 13_500 } else { 1_000 };
            tokio::time::sleep(Duration::from_micros(work)).await;
        }
        assert_eq!(starts, [0, 5_000, 10_000, 25_000, 30_000, 35_000]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pace_finer_than_the_grid_starts_each_pass_a_pace_after_the_last_start() {
        let pace = Duration::from_millis(1);
        let origin = tokio::time::Instant::now();
        let mut pacer = Pacer::new(Some(pace));
        let mut starts = Vec::new();
        for pass in 0..4 {
            pacer.start_pass().await;
            starts.push((tokio::time::Instant::now() - origin).as_micros());
            // The second pass overruns by a period: the third starts as it
            // ends, and the grid it missed does not bring the fourth forward.
            if pass == 1 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        assert_eq!(starts, [0, 1_000, 3_000, 4_000]);
    }

    #[tokio::test(start_paused = true)]
    async fn records_behind_a_held_send_are_stamped_from_when_they_were_due() {
        let ms = Duration::from_millis;
        let t0 = tokio::time::Instant::now();
        let mut pacer = Pacer::new(Some(ms(1)));
        pacer.start_pass().await;
        pacer.send(async {}).await;
        assert_eq!(pacer.owed, Duration::ZERO, "a send that did not wait");
        // Pushback holds the producer 3 ms.
        pacer.send(tokio::time::sleep(ms(3))).await;
        assert_eq!(pacer.owed, ms(3), "the pass's next record was due 3 ms ago");
        assert_eq!(pacer.stamp_at(ms(10)), ms(7).as_nanos() as u64);
        // The next pass was due at 1 ms, the timer would have woken by 2,
        // and the producer got to it at 3.
        pacer.start_pass().await;
        assert_eq!(tokio::time::Instant::now() - t0, ms(3), "not held back");
        assert_eq!(pacer.owed, ms(1));
        // A hold that ends as the next pass is due delays nothing.
        pacer.send(tokio::time::sleep(ms(1))).await;
        assert_eq!(pacer.owed, ms(2));
        pacer.start_pass().await;
        assert_eq!(pacer.owed, Duration::ZERO);
        // A producer late for its own reasons owes nothing: not pushback.
        tokio::time::sleep(ms(5)).await;
        pacer.start_pass().await;
        assert_eq!(pacer.owed, Duration::ZERO);
        assert_eq!(
            pacer.held(),
            Held {
                sends: 2,
                total: ms(4),
                passes_skipped: 0
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn on_the_grid_a_hold_is_owed_until_the_grid_catches_up_and_a_skipped_start_counted() {
        let ms = Duration::from_millis;
        let t0 = tokio::time::Instant::now();
        let mut pacer = Pacer::new(Some(ms(5)));
        pacer.start_pass().await;
        pacer.send(tokio::time::sleep(ms(7))).await;
        // Due at 5, reached at 7: on at once, owing what is past a tick.
        pacer.start_pass().await;
        assert_eq!(pacer.owed, ms(1));
        // The producer's own work makes it late again: the grid did not
        // slide, so the hold carried into this pass still explains 1 ms.
        tokio::time::sleep(ms(6)).await;
        pacer.start_pass().await;
        assert_eq!(pacer.owed, ms(1));
        pacer.send(tokio::time::sleep(ms(12))).await;
        // Due at 15, reached at 25: 15, 20 and 25 (not later than now) are
        // skipped and the pass starts on its own point, 30, owing nothing.
        pacer.start_pass().await;
        assert_eq!(pacer.owed, Duration::ZERO);
        assert_eq!(tokio::time::Instant::now() - t0, ms(30));
        assert_eq!(
            pacer.held(),
            Held {
                sends: 2,
                total: ms(19),
                passes_skipped: 3
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_pace_passes_run_back_to_back() {
        let origin = tokio::time::Instant::now();
        for pace in [None, Some(Duration::ZERO)] {
            let mut pacer = Pacer::new(pace);
            for _ in 0..3 {
                pacer.start_pass().await;
            }
        }
        assert_eq!(tokio::time::Instant::now(), origin);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_pace_a_wait_is_counted_and_stamps_nothing_earlier() {
        let ms = Duration::from_millis;
        let mut pacer = Pacer::new(None);
        pacer.start_pass().await;
        pacer.send(tokio::time::sleep(ms(2))).await;
        assert_eq!(pacer.stamp_at(ms(4)), ms(4).as_nanos() as u64);
        pacer.start_pass().await;
        assert_eq!(pacer.stamp_at(ms(4)), ms(4).as_nanos() as u64);
        assert_eq!(
            pacer.held(),
            Held {
                sends: 1,
                total: ms(2),
                passes_skipped: 0
            }
        );
    }

    #[test]
    fn the_slowest_percent_is_the_records_delivered_last() {
        // 200 records delivered at 10 µs, two at 50 µs whose post took 40.
        let fast = [
            None,
            Some(1_000),
            Some(2_000),
            Some(3_000),
            Some(8_000),
            Some(10_000),
        ];
        let slow = [
            None,
            Some(1_000),
            Some(2_000),
            Some(42_000),
            Some(48_000),
            Some(50_000),
        ];
        let mut samples = vec![fast; 200];
        samples.insert(50, slow);
        samples.push(slow);
        let us = |ns: u64| Some(ns as f64 / 1e3);
        assert_eq!(stage_medians(&samples)[3], us(3_000));
        let slowest = slowest_stage_medians(&samples);
        assert_eq!(slowest[3], us(42_000), "the two slow records are the tail");
        assert_eq!(slowest[5], us(50_000));
        assert_eq!(slowest_stage_medians(&[]), [None; STAGES]);
    }

    /// Slow consumers whose producers are blocked on credit do not keep the
    /// fast streams of the same peer from finishing; only fast records count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fast_streams_finish_beside_slow_consumers() {
        let fabric = MemFabric::new(MemConfig::default());
        let a = fabric.node(PeerId(1), MuxConfig::default());
        let b = fabric.node(PeerId(2), MuxConfig::default());
        let workload = Workload {
            untimed_streams: 2,
            slow_consumer: Some(Duration::from_secs(3600)),
            ..Workload::new(8, 200, 64, Some(Duration::from_micros(100)))
        };
        let report = tokio::time::timeout(Duration::from_secs(60), run_nodes(&a, &b, 1, workload))
            .await
            .expect("the fast streams finish")
            .expect("the run");
        assert_eq!(report.records, 6 * 200);
        let stalls = report.credit_stalls.expect("a mux says");
        assert!(
            stalls >= 2,
            "each slow stream ran out of credit: {report:?}"
        );
        a.shutdown();
        b.shutdown();
    }

    /// Under `FlushPolicy::Manual` a flushed forward pass is never cut into
    /// several batches: 64 records a batch, or more where a late peer task
    /// found the next pass queued too (seen once under CI load: 19 batches
    /// for 20 passes); a flush that wrote nothing until the end would leave
    /// one or two batches. (With the producer a task, `Auto` also sends
    /// these passes whole; that Manual waits for the flush is
    /// `a_manual_flush_holds_records_until_flushed_then_sends_one_batch`.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flushed_forward_pass_is_one_batch() {
        let fabric = MemFabric::new(MemConfig::default());
        let manual = MuxConfig {
            flush: crate::mux::FlushPolicy::Manual {
                reply_linger: Duration::from_millis(1),
            },
            ..MuxConfig::default()
        };
        let a = fabric.node(PeerId(1), manual);
        let b = fabric.node(PeerId(2), MuxConfig::default());
        let workload = Workload {
            flush_each_pass: true,
            ..Workload::new(64, 20, 64, Some(Duration::from_millis(2)))
        };
        let report = tokio::time::timeout(Duration::from_secs(60), run_nodes(&a, &b, 1, workload))
            .await
            .expect("every pass is flushed")
            .expect("the run");
        assert_eq!(report.records, 64 * 20);
        let batches = report.records as f64 / report.records_per_batch;
        assert!(batches <= 20.0, "a pass was cut: {report:?}");
        assert!(batches >= 10.0, "flushes did not write: {report:?}");
        a.shutdown();
        b.shutdown();
    }
}
