//! `qpmux soak`: one node of a long-running stream check, for the fault
//! harness (tests/faults.rs, docs/faults.md).
//!
//! ```text
//!  sender ─ slot s: record (slot, stream id, seq, filler, crc32) ─► receiver
//!    on Dropped: reopen slot s (new stream id, seq from 0), send what is left
//!  receiver: per stream: same slot, one stream id, seq 0,1,2.. , crc ok
//!    on Dropped: rebind slot s and take the next stream; Finalized: slot done
//!  both: JSON-line events on stdout (epoch up/down, dropped, verdict)
//! ```
//!
//! Records of a stream that ends `Dropped` are "maybe delivered": the sender
//! sends the rest again on a fresh stream, so the check is per stream.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::{Args as ClapArgs, ValueEnum};
use serde::Serialize;

use crate::link::Node;
use crate::link::rdma::{RdmaConfig, RdmaNodeConfig, RdmaTransport};
use crate::mux::{
    CloseReason, DropReason, Frame, MuxError, MuxTransport, PeerId, SendError, StreamKey, Terminal,
};
use crate::verbs::soft::udp::UdpConfig;
use crate::verbs::soft::{QpCounters, SoftDevice};

/// The anchor every soak slot lives on; the session is the slot index.
const SOAK_ANCHOR: u64 = 0x534f_414b; // "SOAK"
/// slot u32, stream u32, seq u64.
const HEADER: usize = 16;
const CRC: usize = 4;
/// Violations listed in the verdict; beyond this only counted.
const LISTED_VIOLATIONS: usize = 32;

/// Which end of the streams this node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Opens the slots and streams records.
    Send,
    /// Binds the slots and verifies every record.
    Recv,
}

/// Arguments of `qpmux soak`.
#[derive(Debug, Clone, ClapArgs)]
pub struct SoakArgs {
    /// Sender or receiver.
    #[arg(long, value_enum)]
    pub role: Role,
    /// Node id (the peer's must differ).
    #[arg(long)]
    pub id: u64,
    /// Bootstrap TCP listener address; its IP is also the device's GID.
    #[arg(long)]
    pub bind: SocketAddr,
    /// UDP port of the soft device (fixed, so a restart comes back on it).
    #[arg(long, default_value_t = 0)]
    pub udp_port: u16,
    /// Where to write this node's address blob (hex).
    #[arg(long)]
    pub addr_file: PathBuf,
    /// The peer's address blob file; waited for.
    #[arg(long)]
    pub peer_file: PathBuf,
    /// The receiver writes its verdict here; the sender waits for it before
    /// it shuts down (records it accepted are not yet delivered).
    #[arg(long)]
    pub done_file: Option<PathBuf>,
    /// Slots (streams) in parallel.
    #[arg(long, default_value_t = 64)]
    pub slots: u32,
    /// Records per slot (0: until --duration-s).
    #[arg(long, default_value_t = 1000)]
    pub records: u64,
    /// Bytes per record (at least 20: header and checksum).
    #[arg(long, default_value_t = 64)]
    pub record_size: usize,
    /// Hard bound: the sender finishes its slots, the receiver gives up.
    #[arg(long, default_value_t = 60)]
    pub duration_s: u64,
    /// Pause between a sender's records on each slot, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub pace_us: u64,
    /// RC local ACK timeout exponent (4.096 µs × 2^n).
    #[arg(long, default_value_t = RdmaConfig::default().timeout)]
    pub rc_timeout: u8,
    /// RC retries after timeouts or sequence NAKs.
    #[arg(long, default_value_t = RdmaConfig::default().retry_cnt)]
    pub rc_retry: u8,
    /// `TCP_USER_TIMEOUT` of the liveness connection, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub liveness_timeout_ms: u64,
    /// Receiver: seconds without a record before a `stall` event reports
    /// the link's credit and the mux's counters (once per stall).
    #[arg(long, default_value_t = 10)]
    pub stall_s: u64,
    /// Largest dial backoff, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub backoff_max_ms: u64,
}

/// One line on stdout.
#[derive(Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event<'a> {
    Start {
        role: Role,
        id: u64,
        incarnation: u64,
        bind: SocketAddr,
        udp_port: u16,
        t_ms: u64,
    },
    EpochUp {
        epoch: u64,
        t_ms: u64,
    },
    EpochDown {
        epoch: u64,
        t_ms: u64,
    },
    PeerRestarted {
        restarts_seen: u64,
        t_ms: u64,
    },
    Dropped {
        slot: u32,
        epoch: u64,
        t_ms: u64,
    },
    Progress {
        records: u64,
        t_ms: u64,
    },
    Stall {
        records: u64,
        idle_s: u64,
        epoch: Option<u64>,
        link_credit: String,
        link_stats: String,
        link_end: String,
        mux: String,
        t_ms: u64,
    },
    Verdict(&'a Verdict),
}

/// Soft provider counters, summed over the epochs this process saw.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Counters {
    retransmit_rewinds: u64,
    ack_timeouts: u64,
    seq_naks_sent: u64,
    duplicates_received: u64,
    rnr_naks_sent: u64,
    rnr_naks_received: u64,
    rx_datagrams: u64,
    tx_datagrams: u64,
    rx_malformed: u64,
}

#[derive(Debug, Default, Serialize)]
struct Verdict {
    role: Option<Role>,
    /// No violation, and every slot finished (receiver: saw Finalized).
    ok: bool,
    elapsed_ms: u64,
    slots: u32,
    slots_finished: u32,
    /// Sender: records accepted by `send`; receiver: records verified.
    records: u64,
    /// Streams (one per slot per epoch that carried it).
    streams: u64,
    dropped: u64,
    /// Opens the peer refused (its slot not yet rebound); retried.
    refused: u64,
    duplicates: u64,
    gaps: u64,
    bad_records: u64,
    violations: Vec<String>,
    violation_count: u64,
    epochs_seen: Vec<u64>,
    epoch_deaths: u64,
    slots_dropped: u64,
    restarts_seen: u64,
    counters: Counters,
}

/// What every task of the run shares.
struct Shared {
    started: Instant,
    json: bool,
    verdict: Mutex<Verdict>,
    records: AtomicU64,
    counters: Mutex<CounterTrack>,
}

/// Provider counters of QPs that are gone, and the live ones' last sample
/// (the device sums live QPs only).
#[derive(Default)]
struct CounterTrack {
    gone: QpCounters,
    last: QpCounters,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Shared {
    fn emit(&self, event: &Event<'_>) {
        if self.json {
            match serde_json::to_string(event) {
                Ok(line) => println!("{line}"),
                Err(err) => eprintln!("soak: event not encoded: {err}"),
            }
        } else {
            println!("{event:?}");
        }
    }

    fn violation(&self, what: String) {
        let mut v = self.verdict.lock().expect("verdict");
        v.violation_count += 1;
        if v.violations.len() < LISTED_VIOLATIONS {
            v.violations.push(what);
        }
    }

    fn tally(&self, f: impl FnOnce(&mut Verdict)) {
        f(&mut self.verdict.lock().expect("verdict"));
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

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

/// Writes via a temporary name, so a reader never sees half a blob.
fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

async fn read_peer_blob(path: &Path, deadline: Instant) -> anyhow::Result<Vec<u8>> {
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if !text.trim().is_empty() {
                return unhex(&text);
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no peer address in {}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Record `seq` of `stream` on `slot`: header, filler derived from the
/// header, CRC32 of everything before it.
fn record(slot: u32, stream: u32, seq: u64, size: usize) -> Bytes {
    let mut v = vec![0u8; size.max(HEADER + CRC)];
    v[..4].copy_from_slice(&slot.to_be_bytes());
    v[4..8].copy_from_slice(&stream.to_be_bytes());
    v[8..16].copy_from_slice(&seq.to_be_bytes());
    let body = v.len() - CRC;
    let fill = (seq as u8) ^ (slot as u8);
    v[HEADER..body].fill(fill);
    let crc = crc32fast::hash(&v[..body]);
    v[body..].copy_from_slice(&crc.to_be_bytes());
    Bytes::from(v)
}

/// (slot, stream, seq) of an intact record; `None` if short or corrupt.
fn parse(record: &[u8]) -> Option<(u32, u32, u64)> {
    if record.len() < HEADER + CRC {
        return None;
    }
    let body = record.len() - CRC;
    let crc = u32::from_be_bytes(record[body..].try_into().ok()?);
    if crc32fast::hash(&record[..body]) != crc {
        return None;
    }
    let slot = u32::from_be_bytes(record[..4].try_into().ok()?);
    let stream = u32::from_be_bytes(record[4..8].try_into().ok()?);
    let seq = u64::from_be_bytes(record[8..16].try_into().ok()?);
    Some((slot, stream, seq))
}

type Soft = RdmaTransport<SoftDevice>;

async fn start_node(args: &SoakArgs) -> anyhow::Result<Soft> {
    let device = SoftDevice::open_udp(UdpConfig {
        bind: SocketAddr::new(args.bind.ip(), args.udp_port),
        ..UdpConfig::default()
    })
    .await?;
    let mut config = RdmaNodeConfig::new(PeerId(args.id));
    config.bind = args.bind;
    config.rdma.timeout = args.rc_timeout;
    config.rdma.retry_cnt = args.rc_retry;
    config.liveness.user_timeout = Some(Duration::from_millis(args.liveness_timeout_ms));
    config.connector.backoff_max = Duration::from_millis(args.backoff_max_ms);
    Ok(RdmaTransport::start(device, config).await?)
}

/// Runs one soak node until its slots finish or `--duration-s` passes.
pub async fn run(args: SoakArgs, json: bool) -> anyhow::Result<()> {
    anyhow::ensure!(args.slots > 0, "--slots must be positive");
    anyhow::ensure!(
        args.record_size >= HEADER + CRC,
        "--record-size must be at least {}",
        HEADER + CRC
    );
    let shared = Arc::new(Shared {
        started: Instant::now(),
        json,
        verdict: Mutex::new(Verdict {
            role: Some(args.role),
            slots: args.slots,
            ..Verdict::default()
        }),
        records: AtomicU64::new(0),
        counters: Mutex::new(CounterTrack::default()),
    });
    let deadline = shared.started + Duration::from_secs(args.duration_s);
    // A restarted process may find its ports still held for a moment.
    let node = loop {
        match start_node(&args).await {
            Ok(node) => break Arc::new(node),
            Err(err) if Instant::now() < deadline => {
                tracing::debug!(%err, "binding the soak node; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => return Err(err),
        }
    };
    shared.emit(&Event::Start {
        role: args.role,
        id: args.id,
        incarnation: node.node().incarnation(),
        bind: args.bind,
        udp_port: node.device().udp_port(),
        t_ms: unix_ms(),
    });
    // The receiver binds before anyone can reach it.
    let receivers = match args.role {
        Role::Recv => (0..args.slots)
            .map(|s| node.mux().bind(StreamKey::new(SOAK_ANCHOR, u64::from(s))))
            .collect::<Result<Vec<_>, _>>()?,
        Role::Send => Vec::new(),
    };
    write_atomically(&args.addr_file, &hex(&node.address()))?;
    let blob = read_peer_blob(&args.peer_file, deadline).await?;
    let peer = node.register(&blob)?;
    let watcher = tokio::spawn(watch(
        node.clone(),
        peer,
        shared.clone(),
        // A sender's count stops once its slots are queued; only the
        // receiver's count stops for a stall.
        match args.role {
            Role::Recv => Some(Duration::from_secs(args.stall_s)),
            Role::Send => None,
        },
    ));

    let mut tasks = Vec::new();
    match args.role {
        Role::Send => {
            for slot in 0..args.slots {
                tasks.push(tokio::spawn(send_slot(
                    node.clone(),
                    peer,
                    slot,
                    args.clone(),
                    deadline,
                    shared.clone(),
                )));
            }
        }
        Role::Recv => {
            for (slot, rx) in receivers.into_iter().enumerate() {
                tasks.push(tokio::spawn(recv_slot(
                    node.clone(),
                    slot as u32,
                    rx,
                    shared.clone(),
                )));
            }
        }
    }
    // Senders stop at the deadline by themselves (a send may still wait a
    // moment for credit); the receiver gives up a little after that.
    let finished = Arc::new(AtomicU64::new(0));
    let all = futures_join(tasks, finished.clone());
    let _ = tokio::time::timeout_at((deadline + Duration::from_secs(5)).into(), all).await;
    let finished = finished.load(Ordering::Relaxed) as u32;
    if let (Role::Send, Some(done)) = (args.role, &args.done_file) {
        // Accepted is not delivered: stay up until the receiver is done
        // (it gives up 5 s past the deadline, so this wait ends too).
        let until = deadline + Duration::from_secs(10);
        while !done.exists() && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    watcher.abort();
    sample_counters(&node, &shared);
    if args.role == Role::Send {
        // Drain queued records and say goodbye before the process exits.
        node.shutdown();
        let _ = tokio::time::timeout(Duration::from_secs(5), node.mux().closed()).await;
    }
    let stats = node.mux().stats();
    let restarts_seen = node.node().stats().restarts_seen;
    let line = {
        let mut v = shared.verdict.lock().expect("verdict");
        v.elapsed_ms = shared.started.elapsed().as_millis() as u64;
        v.slots_finished = finished;
        v.records = shared.records.load(Ordering::Relaxed);
        v.epoch_deaths = stats.epoch_deaths;
        v.slots_dropped = stats.slots_dropped;
        v.restarts_seen = restarts_seen;
        v.ok = v.violation_count == 0 && finished == args.slots;
        serde_json::to_string(&Event::Verdict(&v))?
    };
    if json {
        println!("{line}");
    } else {
        println!("{}", line.replace(',', ", "));
    }
    if let (Role::Recv, Some(done)) = (args.role, &args.done_file) {
        write_atomically(done, &line)?;
    }
    Ok(())
}

/// Awaits every slot task, counting those that finished their slot.
async fn futures_join(tasks: Vec<tokio::task::JoinHandle<bool>>, finished: Arc<AtomicU64>) {
    for task in tasks {
        if task.await.unwrap_or(false) {
            finished.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Reports epoch changes, peer restarts, progress and provider counters.
async fn watch(node: Arc<Soft>, peer: PeerId, shared: Arc<Shared>, stall_after: Option<Duration>) {
    let mut epoch: Option<u64> = None;
    let mut moved = (0u64, Instant::now());
    let mut stall_reported = false;
    let mut restarts = 0;
    let mut last_progress = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    loop {
        tick.tick().await;
        let now_epoch = node.mux().epoch(peer).map(|e| e.0);
        if now_epoch != epoch {
            if let Some(old) = epoch {
                shared.emit(&Event::EpochDown {
                    epoch: old,
                    t_ms: unix_ms(),
                });
            }
            if let Some(new) = now_epoch {
                shared.tally(|v| v.epochs_seen.push(new));
                shared.emit(&Event::EpochUp {
                    epoch: new,
                    t_ms: unix_ms(),
                });
            }
            epoch = now_epoch;
        }
        let seen = node.node().stats().restarts_seen;
        if seen != restarts {
            restarts = seen;
            shared.emit(&Event::PeerRestarted {
                restarts_seen: seen,
                t_ms: unix_ms(),
            });
        }
        sample_counters(&node, &shared);
        let records = shared.records.load(Ordering::Relaxed);
        if records != moved.0 {
            moved = (records, Instant::now());
            stall_reported = false;
        } else if !stall_reported && stall_after.is_some_and(|after| moved.1.elapsed() >= after) {
            stall_reported = true;
            let link = node.node().link(peer);
            shared.emit(&Event::Stall {
                records,
                idle_s: moved.1.elapsed().as_secs(),
                epoch,
                link_credit: format!("{:?}", link.as_ref().map(|l| l.credit())),
                link_stats: format!("{:?}", link.as_ref().map(|l| l.stats())),
                link_end: format!("{:?}", link.as_ref().map(|l| l.end_reason())),
                mux: format!("{:?}", node.mux().stats()),
                t_ms: unix_ms(),
            });
        }
        if last_progress.elapsed() >= Duration::from_millis(250) {
            last_progress = Instant::now();
            shared.emit(&Event::Progress {
                records: shared.records.load(Ordering::Relaxed),
                t_ms: unix_ms(),
            });
        }
    }
}

fn sample_counters(node: &Soft, shared: &Shared) {
    let live = node.device().counters();
    let device = node.device().stats();
    let total = {
        let mut track = shared.counters.lock().expect("counters");
        let last = track.last;
        if live.retransmit_rewinds < last.retransmit_rewinds
            || live.duplicates_received < last.duplicates_received
            || live.seq_naks_sent < last.seq_naks_sent
            || live.ack_timeouts < last.ack_timeouts
        {
            add(&mut track.gone, &last);
        }
        track.last = live;
        let mut total = track.gone;
        add(&mut total, &live);
        total
    };
    shared.tally(|v| {
        v.counters = Counters {
            retransmit_rewinds: total.retransmit_rewinds,
            ack_timeouts: total.ack_timeouts,
            seq_naks_sent: total.seq_naks_sent,
            duplicates_received: total.duplicates_received,
            rnr_naks_sent: total.rnr_naks_sent,
            rnr_naks_received: total.rnr_naks_received,
            rx_datagrams: device.rx_datagrams,
            tx_datagrams: device.tx_datagrams,
            rx_malformed: device.rx_malformed,
        }
    });
}

fn add(sum: &mut QpCounters, more: &QpCounters) {
    sum.rnr_naks_sent += more.rnr_naks_sent;
    sum.rnr_naks_received += more.rnr_naks_received;
    sum.seq_naks_sent += more.seq_naks_sent;
    sum.retransmit_rewinds += more.retransmit_rewinds;
    sum.ack_timeouts += more.ack_timeouts;
    sum.duplicates_received += more.duplicates_received;
}

/// Streams one slot's records, reopening it after each epoch death; true
/// once it finished with `Finalized`.
async fn send_slot(
    node: Arc<Soft>,
    peer: PeerId,
    slot: u32,
    args: SoakArgs,
    deadline: Instant,
    shared: Arc<Shared>,
) -> bool {
    let key = StreamKey::new(SOAK_ANCHOR, u64::from(slot));
    // Records accepted by streams that ended Dropped are maybe delivered:
    // the next stream sends from where the dead one stopped.
    let mut done = 0u64;
    let pace = Duration::from_micros(args.pace_us);
    loop {
        let mut tx = match node.mux().open(peer, key) {
            Ok(tx) => tx,
            Err(MuxError::Shutdown) => return false,
            Err(err) => {
                shared.violation(format!("slot {slot}: open failed: {err}"));
                return false;
            }
        };
        let stream: u32 = rand::random();
        shared.tally(|v| v.streams += 1);
        let mut seq = 0u64;
        let ended = loop {
            let more = args.records == 0 || done + seq < args.records;
            if !more || Instant::now() >= deadline {
                break tx.finish(Terminal::Finalized).err();
            }
            let sent = tokio::time::timeout_at(
                deadline.into(),
                tx.send(record(slot, stream, seq, args.record_size)),
            );
            match sent.await {
                // Waited for credit past the deadline: finish now.
                Err(_) => break tx.finish(Terminal::Finalized).err(),
                Ok(Ok(())) => {
                    seq += 1;
                    shared.records.fetch_add(1, Ordering::Relaxed);
                    if seq % 64 == 0 {
                        // send() may never suspend; let the watcher run.
                        tokio::task::yield_now().await;
                    }
                }
                Ok(Err(err)) => break Some(err),
            }
            if !pace.is_zero() {
                tokio::time::sleep(pace).await;
            }
        };
        match ended {
            None => return true,
            Some(SendError::Dropped(DropReason::EpochEnded { epoch })) => {
                done += seq;
                shared.tally(|v| v.dropped += 1);
                shared.emit(&Event::Dropped {
                    slot,
                    epoch: epoch.0,
                    t_ms: unix_ms(),
                });
            }
            Some(SendError::PeerClosed(CloseReason::Refused | CloseReason::UnknownSlot)) => {
                // The receiver has not rebound the slot yet; nothing of
                // this stream was delivered.
                shared.tally(|v| v.refused += 1);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Some(other) => {
                shared.violation(format!("slot {slot}: stream ended: {other}"));
                return false;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
    }
}

/// Verifies one slot's streams until one finishes; true if one did.
async fn recv_slot(
    node: Arc<Soft>,
    slot: u32,
    mut rx: crate::mux::SlotReceiver,
    shared: Arc<Shared>,
) -> bool {
    let key = StreamKey::new(SOAK_ANCHOR, u64::from(slot));
    loop {
        shared.tally(|v| v.streams += 1);
        let mut stream: Option<u32> = None;
        let mut next = 0u64;
        let terminal = loop {
            let Some(frame) = rx.recv().await else {
                break None;
            };
            let data = match frame {
                Frame::Data(data) => data,
                Frame::Heartbeat => continue,
                terminal => break Some(terminal),
            };
            let Some((from_slot, from_stream, seq)) = parse(&data) else {
                shared.tally(|v| v.bad_records += 1);
                shared.violation(format!("slot {slot}: corrupt record at seq {next}"));
                continue;
            };
            if from_slot != slot || stream.is_some_and(|s| s != from_stream) {
                shared.tally(|v| v.bad_records += 1);
                shared.violation(format!(
                    "slot {slot}: record of slot {from_slot} stream {from_stream:08x}"
                ));
                continue;
            }
            stream = Some(from_stream);
            if seq < next {
                shared.tally(|v| v.duplicates += 1);
                shared.violation(format!("slot {slot}: seq {seq} again (expected {next})"));
                continue;
            }
            if seq > next {
                shared.tally(|v| v.gaps += 1);
                shared.violation(format!("slot {slot}: seq {seq}, expected {next}"));
            }
            next = seq + 1;
            shared.records.fetch_add(1, Ordering::Relaxed);
        };
        match terminal {
            Some(Frame::Finalized) => return true,
            Some(Frame::Dropped(DropReason::EpochEnded { epoch })) => {
                shared.tally(|v| v.dropped += 1);
                shared.emit(&Event::Dropped {
                    slot,
                    epoch: epoch.0,
                    t_ms: unix_ms(),
                });
            }
            other => {
                shared.violation(format!("slot {slot}: stream ended with {other:?}"));
                return false;
            }
        }
        // The next epoch's stream for this slot.
        rx = loop {
            match node.mux().bind(key) {
                Ok(rx) => break rx,
                Err(MuxError::AlreadyBound(_)) => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(err) => {
                    shared.violation(format!("slot {slot}: rebind failed: {err}"));
                    return false;
                }
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_corruption_is_caught() {
        let r = record(7, 0xdead_beef, 42, 64);
        assert_eq!(parse(&r), Some((7, 0xdead_beef, 42)));
        let mut bad = r.to_vec();
        bad[30] ^= 1;
        assert_eq!(parse(&bad), None);
        assert_eq!(parse(&r[..10]), None);
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        assert_eq!(unhex(&hex(&[0, 1, 0xff])).unwrap(), vec![0, 1, 0xff]);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
        assert!(unhex("é1").is_err());
    }
}
