//! `qpmux soak`: one node of a long-running stream check, for the fault
//! harness (tests/faults.rs, docs/faults.md).
//!
//! ```text
//!  sender ─ slot s: record (slot, stream id, seq, index, filler, crc32) ─► receiver
//!  sender ◄─ ack slot: (slot, stream id, verified prefix, open|finalized|dropped) ─ receiver
//!  receiver: per stream: same slot, one stream id, seq 0,1,2.. , crc ok;
//!            per slot: indices verified once, again (redelivered) or past the prefix (hole)
//!  sender: keeps a slot until the receiver acknowledges it finalized; when the
//!          stream's epoch dies, resends from the acknowledged prefix on a new stream
//!  sender ─ done slot: "heard every slot's end" ─► receiver, which then closes it
//!  receiver: stays (re-sending its words on each new epoch) until it hears that
//!  both: JSON-line events on stdout (epoch up/down, dropped, verdict)
//! ```
//!
//! Accepted is not delivered: only the receiver's acknowledgement finishes a
//! slot. Records past the acknowledged prefix are "maybe delivered"; the
//! receiver counts those that arrive twice as redelivered, never silently.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::{Args as ClapArgs, ValueEnum};
use serde::Serialize;
use tokio::sync::{Notify, watch};

use super::{hex, unhex};
use crate::link::Node;
use crate::link::rdma::{RdmaConfig, RdmaNodeConfig, RdmaTransport};
use crate::mux::{
    CloseReason, DropReason, Frame, MuxError, MuxTransport, PeerId, SendError, StreamKey, Terminal,
};
use crate::verbs::soft::udp::UdpConfig;
use crate::verbs::soft::{QpCounters, SoftDevice};

/// The anchor every soak slot lives on; the session is the slot index.
const SOAK_ANCHOR: u64 = 0x534f_414b; // "SOAK"
/// The receiver's acknowledgements to the sender: one slot, session 0.
const ACK_ANCHOR: u64 = 0x534f_4143; // "SOAC"
/// The sender's word that it heard every slot's end: one slot, session 0.
const DONE_ANCHOR: u64 = 0x534f_4144; // "SOAD"
/// slot u32, stream u32, seq u64 (in the stream), index u64 (in the slot).
const HEADER: usize = 24;
const CRC: usize = 4;
/// slot u32, stream u32, verified prefix u64, state u8, crc32.
const ACK_LEN: usize = 21;
/// The receiver publishes a slot's verified prefix every this many records.
const ACK_EVERY: u64 = 256;
/// How often the receiver sends changed prefixes.
const ACK_INTERVAL: Duration = Duration::from_millis(250);
/// How long, with a new epoch up, the sender waits for the receiver to say
/// how a stream of a dead epoch ended before it resends from what it knows.
const ACK_GRACE: Duration = Duration::from_secs(2);
/// Violations listed in the verdict; beyond this only counted.
const LISTED_VIOLATIONS: usize = 32;
/// Epochs listed in the verdict, the first ones; beyond this only counted
/// (`epochs_up`), so a soak of days with an epoch a second keeps a bounded
/// verdict.
const LISTED_EPOCHS: usize = 1024;

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
    /// Bytes per record (at least 28: header and checksum).
    #[arg(long, default_value_t = 64)]
    pub record_size: usize,
    /// Hard bound: the sender finishes its slots, the receiver gives up.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(..=31_536_000))]
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
    /// Largest dial backoff, in milliseconds (at least the first backoff,
    /// 50 ms).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(50..=86_400_000))]
    pub backoff_max_ms: u64,
    /// Receiver: how long, its last acknowledgements queued, it waits for
    /// the sender to say it heard them (re-sending them on every new
    /// epoch). Sender: how long it tries to say so.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(..=86_400))]
    pub linger_s: u64,
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
    /// Sender: every slot has queued its last record and its end (only
    /// with `--records`); the receiver's words on them are still to come.
    AllSent {
        records: u64,
        t_ms: u64,
    },
    /// Receiver: no record for `--stall-s` (the tests fail on it).
    Stall(Diagnosis),
    /// Either role: no epoch for `--stall-s` (shown when a test fails).
    NoLink(Diagnosis),
    Verdict(&'a Verdict),
}

/// Where a node stands when it stopped moving: its link, mux, connector and
/// device.
#[derive(Debug, Serialize)]
struct Diagnosis {
    records: u64,
    idle_s: u64,
    epoch: Option<u64>,
    link_credit: String,
    link_stats: String,
    link_end: String,
    mux: String,
    connector: String,
    backoff_ms: u128,
    device: String,
    /// Sender: each slot whose task is not over, and what it does
    /// (`streaming`, `awaiting` the receiver's word, or `refused` and
    /// retrying its open).
    unfinished: Vec<(u32, &'static str)>,
    t_ms: u64,
}

impl Diagnosis {
    fn of(node: &Soft, peer: PeerId, shared: &Shared, idle: Duration, epoch: Option<u64>) -> Self {
        let link = node.node().link(peer);
        Diagnosis {
            records: shared.records.load(Ordering::Relaxed),
            idle_s: idle.as_secs(),
            epoch,
            link_credit: format!("{:?}", link.as_ref().map(|l| l.credit())),
            link_stats: format!("{:?}", link.as_ref().map(|l| l.stats())),
            link_end: format!("{:?}", node.node().link_end(peer)),
            mux: format!("{:?}", node.mux().stats()),
            connector: format!("{:?}", node.node().stats()),
            backoff_ms: node.node().backoff(peer).as_millis(),
            device: format!("{:?}", node.device().stats()),
            unfinished: shared.unfinished(),
            t_ms: unix_ms(),
        }
    }
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
    /// Datagrams for a QP from another address than its peer's.
    rx_wrong_source: u64,
    /// Datagrams outside the port's partition.
    rx_bad_pkey: u64,
    /// Datagrams the kernel refused to send (a firewall, the path MTU).
    tx_refused: u64,
}

#[derive(Debug, Default, Serialize)]
struct Verdict {
    role: Option<Role>,
    /// No violation, and every slot finished (receiver: saw Finalized).
    ok: bool,
    elapsed_ms: u64,
    slots: u32,
    slots_finished: u32,
    /// Sender: records accepted by `send`; receiver: records verified
    /// (`records_unique` + `redelivered`).
    records: u64,
    /// Receiver: distinct (slot, index) pairs verified.
    records_unique: u64,
    /// Receiver: records whose (slot, index) a stream of an earlier epoch
    /// had already verified (maybe-delivered duplicates across epochs).
    redelivered: u64,
    /// Receiver: streams whose first index lay past the slot's verified
    /// prefix (records between would be lost).
    holes: u64,
    /// Receiver: records of slots finalized short of `--records`.
    missing: u64,
    /// Sender: records accepted again after their stream's epoch died.
    resent: u64,
    /// Sender: streams given up on after `ACK_GRACE` with no word from the
    /// receiver (resent from the acknowledged prefix).
    abandoned: u64,
    /// Acknowledgement streams (one per epoch that carried one).
    ack_streams: u64,
    /// Sender: acknowledgements that were corrupt or named no slot.
    bad_acks: u64,
    /// Receiver: the sender said it heard every slot's end before the
    /// receiver left.
    sender_done: bool,
    /// Sender: the receiver took that word (it closed the done slot).
    receiver_heard_done: bool,
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
    /// The first [`LISTED_EPOCHS`] epochs this node saw come up.
    epochs_seen: Vec<u64>,
    /// Every epoch seen come up, listed or not.
    epochs_up: u64,
    /// The newest of them (listed or not).
    last_epoch: Option<u64>,
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
    unique: AtomicU64,
    redelivered: AtomicU64,
    counters: Mutex<CounterTrack>,
    /// Sender: where each slot stands (`SlotPhase`), for the diagnosis.
    phases: Vec<AtomicU8>,
    /// Sender: slots that have queued their last record.
    slots_sent: AtomicU64,
    /// Receiver: every slot is over; no record is expected, so none missing
    /// is a stall.
    finishing: AtomicBool,
}

/// Where a sender's slot stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum SlotPhase {
    /// Opening or streaming.
    Streaming = 0,
    /// Its stream ended here; the receiver's word on it is awaited.
    Awaiting = 1,
    /// Its open was refused; it retries.
    Refused = 2,
    /// Its task is over.
    Done = 3,
}

impl SlotPhase {
    fn name(phase: u8) -> Option<&'static str> {
        match phase {
            0 => Some("streaming"),
            1 => Some("awaiting"),
            2 => Some("refused"),
            _ => None,
        }
    }
}

/// A sender's slot task: marks the slot done when the task ends, however
/// it ends.
struct SlotTask<'a> {
    shared: &'a Shared,
    slot: u32,
}

impl SlotTask<'_> {
    fn set(&self, phase: SlotPhase) {
        if let Some(p) = self.shared.phases.get(self.slot as usize) {
            p.store(phase as u8, Ordering::Relaxed);
        }
    }
}

impl Drop for SlotTask<'_> {
    fn drop(&mut self) {
        self.set(SlotPhase::Done);
    }
}

impl Shared {
    /// The sender's slots whose task is not over, with their phase.
    fn unfinished(&self) -> Vec<(u32, &'static str)> {
        (0u32..)
            .zip(&self.phases)
            .filter_map(|(slot, p)| SlotPhase::name(p.load(Ordering::Relaxed)).map(|n| (slot, n)))
            .collect()
    }
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

    /// Sender: one more slot queued its last record; the last one says so.
    fn slot_sent(&self) {
        let sent = self.slots_sent.fetch_add(1, Ordering::Relaxed) + 1;
        if sent == self.phases.len() as u64 {
            self.emit(&Event::AllSent {
                records: self.records.load(Ordering::Relaxed),
                t_ms: unix_ms(),
            });
        }
    }

    fn tally(&self, f: impl FnOnce(&mut Verdict)) {
        f(&mut self.verdict.lock().expect("verdict"));
    }
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

/// One record's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rec {
    slot: u32,
    stream: u32,
    /// Position in its stream, from 0.
    seq: u64,
    /// Position in its slot, across streams.
    index: u64,
}

/// Record `rec`: header, filler derived from the header, CRC32 of
/// everything before it.
fn record(rec: Rec, size: usize) -> Bytes {
    let mut v = vec![0u8; size.max(HEADER + CRC)];
    v[..4].copy_from_slice(&rec.slot.to_be_bytes());
    v[4..8].copy_from_slice(&rec.stream.to_be_bytes());
    v[8..16].copy_from_slice(&rec.seq.to_be_bytes());
    v[16..24].copy_from_slice(&rec.index.to_be_bytes());
    let body = v.len() - CRC;
    let fill = (rec.index as u8) ^ (rec.slot as u8);
    v[HEADER..body].fill(fill);
    let crc = crc32fast::hash(&v[..body]);
    v[body..].copy_from_slice(&crc.to_be_bytes());
    Bytes::from(v)
}

/// The body of an intact CRC-trailed message; `None` if short or corrupt.
fn checked(message: &[u8], min: usize) -> Option<&[u8]> {
    if message.len() < min {
        return None;
    }
    let body = message.len() - CRC;
    let crc = u32::from_be_bytes(message[body..].try_into().ok()?);
    (crc32fast::hash(&message[..body]) == crc).then_some(&message[..body])
}

/// The header of an intact record; `None` if short or corrupt.
fn parse(record: &[u8]) -> Option<Rec> {
    let body = checked(record, HEADER + CRC)?;
    Some(Rec {
        slot: u32::from_be_bytes(body[..4].try_into().ok()?),
        stream: u32::from_be_bytes(body[4..8].try_into().ok()?),
        seq: u64::from_be_bytes(body[8..16].try_into().ok()?),
        index: u64::from_be_bytes(body[16..24].try_into().ok()?),
    })
}

/// How the receiver last saw a slot's stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum AckState {
    /// In progress (or none yet): the prefix only.
    #[default]
    Open,
    /// The slot is complete; the receiver takes no more streams on it.
    Finalized,
    /// `stream` ended with its epoch.
    Dropped,
}

/// What the receiver tells the sender about one slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Ack {
    slot: u32,
    /// The stream it last took records from (0: none yet).
    stream: u32,
    /// Every index below this is verified.
    verified: u64,
    state: AckState,
}

fn encode_ack(ack: &Ack) -> Bytes {
    let mut v = Vec::with_capacity(ACK_LEN);
    v.extend_from_slice(&ack.slot.to_be_bytes());
    v.extend_from_slice(&ack.stream.to_be_bytes());
    v.extend_from_slice(&ack.verified.to_be_bytes());
    v.push(match ack.state {
        AckState::Open => 0,
        AckState::Finalized => 1,
        AckState::Dropped => 2,
    });
    v.extend_from_slice(&crc32fast::hash(&v).to_be_bytes());
    Bytes::from(v)
}

/// An intact acknowledgement; `None` if malformed.
fn parse_ack(message: &[u8]) -> Option<Ack> {
    if message.len() != ACK_LEN {
        return None;
    }
    let body = checked(message, ACK_LEN)?;
    Some(Ack {
        slot: u32::from_be_bytes(body[..4].try_into().ok()?),
        stream: u32::from_be_bytes(body[4..8].try_into().ok()?),
        verified: u64::from_be_bytes(body[8..16].try_into().ok()?),
        state: match body[16] {
            0 => AckState::Open,
            1 => AckState::Finalized,
            2 => AckState::Dropped,
            _ => return None,
        },
    })
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
        unique: AtomicU64::new(0),
        redelivered: AtomicU64::new(0),
        counters: Mutex::new(CounterTrack::default()),
        slots_sent: AtomicU64::new(0),
        finishing: AtomicBool::new(false),
        phases: (0..args.slots)
            .map(|_| match args.role {
                Role::Send => AtomicU8::new(SlotPhase::Streaming as u8),
                Role::Recv => AtomicU8::new(SlotPhase::Done as u8),
            })
            .collect(),
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
    // Each side binds before anyone can reach it: the receiver its slots
    // and the done slot, the sender the acknowledgement slot.
    let ack_key = StreamKey::new(ACK_ANCHOR, 0);
    let (receivers, ack_rx, done_rx) = match args.role {
        Role::Recv => (
            (0..args.slots)
                .map(|s| node.mux().bind(StreamKey::new(SOAK_ANCHOR, u64::from(s))))
                .collect::<Result<Vec<_>, _>>()?,
            None,
            Some(node.mux().bind(StreamKey::new(DONE_ANCHOR, 0))?),
        ),
        Role::Send => (Vec::new(), Some(node.mux().bind(ack_key)?), None),
    };
    write_atomically(&args.addr_file, &hex(&node.address()))?;
    let blob = read_peer_blob(&args.peer_file, deadline).await?;
    let peer = node.register(&blob)?;
    let watcher = tokio::spawn(watch(
        node.clone(),
        peer,
        shared.clone(),
        Duration::from_secs(args.stall_s),
        // A sender's count stops once its slots are queued; only the
        // receiver's count stops for a stall.
        args.role == Role::Recv,
    ));

    let mut tasks = Vec::new();
    let board = Arc::new(AckBoard::new(args.slots));
    let mut sender_done = done_rx.map(|rx| tokio::spawn(hear_done(node.clone(), rx)));
    let mut ack_task = match args.role {
        Role::Send => {
            let (heard_tx, heard_rx): (Vec<_>, Vec<_>) = (0..args.slots)
                .map(|_| watch::channel(Heard::default()))
                .unzip();
            for (slot, heard) in heard_rx.into_iter().enumerate() {
                tasks.push(tokio::spawn(send_slot(
                    node.clone(),
                    peer,
                    slot as u32,
                    args.clone(),
                    deadline,
                    shared.clone(),
                    heard,
                )));
            }
            let rx = ack_rx.expect("bound above");
            tokio::spawn(read_acks(
                node.clone(),
                rx,
                heard_tx,
                args.records,
                shared.clone(),
            ))
        }
        Role::Recv => {
            for (slot, rx) in receivers.into_iter().enumerate() {
                tasks.push(tokio::spawn(recv_slot(
                    node.clone(),
                    slot as u32,
                    rx,
                    args.records,
                    board.clone(),
                    shared.clone(),
                )));
            }
            tokio::spawn(send_acks(node.clone(), peer, board.clone(), shared.clone()))
        }
    };
    // Senders stop resending at the deadline (a send may still wait a
    // moment for credit); both give up on their slots a little after that.
    let finished = Arc::new(AtomicU64::new(0));
    let all = futures_join(tasks, finished.clone());
    let _ = tokio::time::timeout_at((deadline + Duration::from_secs(5)).into(), all).await;
    let finished = finished.load(Ordering::Relaxed) as u32;
    let linger = Duration::from_secs(args.linger_s);
    match args.role {
        Role::Send => {
            let heard = tokio::time::timeout(linger, say_done(node.clone(), peer)).await;
            shared.tally(|v| v.receiver_heard_done = heard.unwrap_or(false));
            if let Some(done) = &args.done_file {
                // The receiver's verdict names what it verified; stay up
                // until it is written.
                let until = Instant::now() + linger + Duration::from_secs(5);
                while !done.exists() && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        Role::Recv => {
            shared.finishing.store(true, Ordering::Relaxed);
            // The last acknowledgements go out before the goodbye.
            board.closing.store(true, Ordering::Release);
            board.changed.notify_one();
            let flushed = async {
                while !board.flushed.load(Ordering::Acquire) && !ack_task.is_finished() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(5), flushed).await;
            // Queued is not heard: an epoch that dies now takes the last
            // words with it, and only the sender knows whether they came.
            if let Some(done) = sender_done.as_mut() {
                let heard = tokio::time::timeout(linger, done).await;
                shared.tally(|v| v.sender_done = matches!(heard, Ok(Ok(true))));
            }
            board.stop.store(true, Ordering::Release);
            board.changed.notify_one();
            let _ = tokio::time::timeout(Duration::from_secs(1), &mut ack_task).await;
        }
    }
    if let Some(done) = sender_done {
        done.abort();
    }
    ack_task.abort();
    watcher.abort();
    sample_counters(&node, &shared);
    // Taken before the goodbye, which ends the epoch too.
    let stats = node.mux().stats();
    let restarts_seen = node.node().stats().restarts_seen;
    // Drain queued records and say goodbye before the process exits.
    node.shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(5), node.mux().closed()).await;
    let line = {
        let mut v = shared.verdict.lock().expect("verdict");
        v.elapsed_ms = shared.started.elapsed().as_millis() as u64;
        v.slots_finished = finished;
        v.records = shared.records.load(Ordering::Relaxed);
        v.records_unique = shared.unique.load(Ordering::Relaxed);
        v.redelivered = shared.redelivered.load(Ordering::Relaxed);
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

/// Reports epoch changes, peer restarts, progress and provider counters; a
/// stall (`records_stall`: no record) or no epoch for `stall_after`.
async fn watch(
    node: Arc<Soft>,
    peer: PeerId,
    shared: Arc<Shared>,
    stall_after: Duration,
    records_stall: bool,
) {
    let mut epoch: Option<u64> = None;
    let mut moved = (0u64, Instant::now());
    let mut stall_reported = false;
    // Since when no epoch has been up, and whether that was reported.
    let mut no_link = (Instant::now(), false);
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
                shared.tally(|v| {
                    v.epochs_up += 1;
                    v.last_epoch = Some(new);
                    if v.epochs_seen.len() < LISTED_EPOCHS {
                        v.epochs_seen.push(new);
                    }
                });
                shared.emit(&Event::EpochUp {
                    epoch: new,
                    t_ms: unix_ms(),
                });
            }
            epoch = now_epoch;
            no_link = (Instant::now(), false);
        }
        if epoch.is_none() && !no_link.1 && no_link.0.elapsed() >= stall_after {
            no_link.1 = true;
            let diagnosis = Diagnosis::of(&node, peer, &shared, no_link.0.elapsed(), epoch);
            shared.emit(&Event::NoLink(diagnosis));
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
        } else if records_stall
            && !stall_reported
            && !shared.finishing.load(Ordering::Relaxed)
            && moved.1.elapsed() >= stall_after
        {
            stall_reported = true;
            let diagnosis = Diagnosis::of(&node, peer, &shared, moved.1.elapsed(), epoch);
            shared.emit(&Event::Stall(diagnosis));
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
            track.gone += last;
        }
        track.last = live;
        let mut total = track.gone;
        total += live;
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
            rx_wrong_source: device.rx_wrong_source,
            rx_bad_pkey: device.rx_bad_pkey,
            tx_refused: device.tx_refused,
        }
    });
}

/// What the sender has heard from the receiver about one slot.
#[derive(Clone, Copy, Debug, Default)]
struct Heard {
    /// The receiver's verified prefix: the next stream starts here.
    verified: u64,
    /// The receiver finalized the slot.
    finalized: bool,
    /// The last stream the receiver saw end with its epoch.
    dropped_stream: Option<u32>,
}

/// A fresh stream id; 0 means "none" in acknowledgements.
fn stream_id() -> u32 {
    loop {
        let id: u32 = rand::random();
        if id != 0 {
            return id;
        }
    }
}

/// Streams one slot's records until the receiver acknowledges the slot
/// finalized; after each epoch death it resends from the acknowledged
/// prefix on a new stream. True once acknowledged.
async fn send_slot(
    node: Arc<Soft>,
    peer: PeerId,
    slot: u32,
    args: SoakArgs,
    deadline: Instant,
    shared: Arc<Shared>,
    mut heard: watch::Receiver<Heard>,
) -> bool {
    let key = StreamKey::new(SOAK_ANCHOR, u64::from(slot));
    let task = SlotTask {
        shared: &shared,
        slot,
    };
    let pace = Duration::from_micros(args.pace_us);
    // One past the highest index accepted so far, to count resends.
    let mut accepted_to = 0u64;
    let mut all_queued = false;
    loop {
        let known = *heard.borrow_and_update();
        if known.finalized {
            return true;
        }
        let mut tx = match node.mux().open(peer, key) {
            Ok(tx) => tx,
            Err(MuxError::Shutdown) => return false,
            Err(err) => {
                shared.violation(format!("slot {slot}: open failed: {err}"));
                return false;
            }
        };
        let stream = stream_id();
        shared.tally(|v| v.streams += 1);
        let mut index = known.verified;
        let mut seq = 0u64;
        let ended = loop {
            let more = args.records == 0 || index < args.records;
            if !more || Instant::now() >= deadline {
                if !more && !all_queued {
                    all_queued = true;
                    shared.slot_sent();
                }
                break tx.finish(Terminal::Finalized).err();
            }
            let rec = Rec {
                slot,
                stream,
                seq,
                index,
            };
            let sent =
                tokio::time::timeout_at(deadline.into(), tx.send(record(rec, args.record_size)));
            match sent.await {
                // Waited for credit past the deadline: finish now.
                Err(_) => break tx.finish(Terminal::Finalized).err(),
                Ok(Ok(())) => {
                    if index < accepted_to {
                        shared.tally(|v| v.resent += 1);
                    }
                    seq += 1;
                    // A peer's acknowledgement may name any prefix (a
                    // restarted sender's included): no wrap past the top.
                    index = index.saturating_add(1);
                    accepted_to = accepted_to.max(index);
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
        // Taken when the stream ended here: a later death is its epoch's.
        let deaths = node.mux().stats().epoch_deaths;
        let epoch = node.mux().epoch(peer);
        let dead = match ended {
            None => false,
            Some(SendError::Dropped(DropReason::EpochEnded { epoch })) => {
                shared.tally(|v| v.dropped += 1);
                shared.emit(&Event::Dropped {
                    slot,
                    epoch: epoch.0,
                    t_ms: unix_ms(),
                });
                true
            }
            Some(SendError::PeerClosed(CloseReason::Refused | CloseReason::UnknownSlot)) => {
                // Not rebound yet, or already finalized (the next turn of
                // the loop sees that); nothing of this stream was delivered.
                shared.tally(|v| v.refused += 1);
                task.set(SlotPhase::Refused);
                tokio::time::sleep(Duration::from_millis(20)).await;
                if Instant::now() >= deadline {
                    return heard.borrow().finalized;
                }
                task.set(SlotPhase::Streaming);
                continue;
            }
            Some(other) => {
                shared.violation(format!("slot {slot}: stream ended: {other}"));
                return false;
            }
        };
        let watch = EpochWatch {
            node: &node,
            peer,
            deaths,
            epoch,
            dead,
        };
        task.set(SlotPhase::Awaiting);
        if await_outcome(watch, stream, &mut heard, &shared).await {
            return true;
        }
        task.set(SlotPhase::Streaming);
        if Instant::now() >= deadline {
            return false;
        }
    }
}

/// The epoch a finished stream was carried in, and whether it is known dead.
struct EpochWatch<'a> {
    node: &'a Soft,
    peer: PeerId,
    /// The mux's epoch deaths when the stream ended here.
    deaths: u64,
    epoch: Option<crate::mux::Epoch>,
    dead: bool,
}

impl EpochWatch<'_> {
    fn dead(&mut self) -> bool {
        if !self.dead {
            let mux = self.node.mux();
            self.dead = mux.stats().epoch_deaths > self.deaths
                || (self.epoch.is_some() && mux.epoch(self.peer) != self.epoch);
        }
        self.dead
    }
}

/// Waits until the receiver says how `stream` ended: true when the slot is
/// finalized, false when it must be resent (the receiver reported the stream
/// dropped, or its epoch died and a new epoch stayed silent for `ACK_GRACE`).
async fn await_outcome(
    mut epoch: EpochWatch<'_>,
    stream: u32,
    heard: &mut watch::Receiver<Heard>,
    shared: &Shared,
) -> bool {
    let mut silent_since: Option<Instant> = None;
    loop {
        let known = *heard.borrow_and_update();
        if known.finalized {
            return true;
        }
        if known.dropped_stream == Some(stream) {
            return false;
        }
        if epoch.dead() && epoch.node.mux().epoch(epoch.peer).is_some() {
            let since = *silent_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= ACK_GRACE {
                shared.tally(|v| v.abandoned += 1);
                return false;
            }
        }
        let changed = tokio::time::timeout(Duration::from_millis(20), heard.changed()).await;
        if let Ok(Err(_)) = changed {
            // The acknowledgement reader is gone: poll.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Sender: takes the receiver's acknowledgements, rebinding the slot after
/// each epoch, and publishes them per slot.
async fn read_acks(
    node: Arc<Soft>,
    mut rx: crate::mux::SlotReceiver,
    heard: Vec<watch::Sender<Heard>>,
    records: u64,
    shared: Arc<Shared>,
) {
    let key = rx.key();
    loop {
        while let Some(frame) = rx.recv().await {
            let data = match frame {
                Frame::Data(data) => data,
                Frame::Heartbeat => continue,
                _ => break,
            };
            let Some(ack) = parse_ack(&data).filter(|a| (a.slot as usize) < heard.len()) else {
                shared.tally(|v| v.bad_acks += 1);
                shared.violation(format!("malformed acknowledgement ({} bytes)", data.len()));
                continue;
            };
            heard[ack.slot as usize].send_modify(|h| {
                // A peer's claim past the end would skip nothing real.
                let cap = if records == 0 { u64::MAX } else { records };
                h.verified = h.verified.max(ack.verified.min(cap));
                match ack.state {
                    AckState::Open => {}
                    AckState::Finalized => h.finalized = true,
                    AckState::Dropped => h.dropped_stream = Some(ack.stream),
                }
            });
        }
        shared.tally(|v| v.ack_streams += 1);
        rx = loop {
            match node.mux().bind(key) {
                Ok(rx) => break rx,
                Err(MuxError::AlreadyBound(_)) => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(_) => return,
            }
        };
    }
}

/// The receiver's latest word per slot, for the acknowledgement task.
struct AckBoard {
    slots: Mutex<Vec<Ack>>,
    changed: Notify,
    /// Set when the receiver is done: send what is left, and everything
    /// again on each new epoch.
    closing: AtomicBool,
    /// The final acknowledgements are queued.
    flushed: AtomicBool,
    /// Set once the sender heard them (or the wait is over): finish.
    stop: AtomicBool,
}

impl AckBoard {
    fn new(slots: u32) -> AckBoard {
        AckBoard {
            slots: Mutex::new(
                (0..slots)
                    .map(|slot| Ack {
                        slot,
                        ..Ack::default()
                    })
                    .collect(),
            ),
            changed: Notify::new(),
            closing: AtomicBool::new(false),
            flushed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        }
    }

    fn publish(&self, ack: Ack, urgent: bool) {
        self.slots.lock().expect("acks")[ack.slot as usize] = ack;
        if urgent {
            self.changed.notify_one();
        }
    }

    fn snapshot(&self) -> Vec<Ack> {
        self.slots.lock().expect("acks").clone()
    }
}

/// Receiver: sends every slot's word once per epoch, then what changed
/// (stream ends at once, prefixes every `ACK_INTERVAL`), until told to stop.
async fn send_acks(node: Arc<Soft>, peer: PeerId, board: Arc<AckBoard>, shared: Arc<Shared>) {
    let key = StreamKey::new(ACK_ANCHOR, 0);
    loop {
        let Ok(mut tx) = node.mux().open(peer, key) else {
            return;
        };
        let mut sent: Vec<Option<Ack>> = vec![None; board.snapshot().len()];
        let failed = 'stream: loop {
            let closing = board.closing.load(Ordering::Acquire);
            for ack in board.snapshot() {
                if sent[ack.slot as usize] != Some(ack) {
                    if let Err(err) = tx.send(encode_ack(&ack)).await {
                        break 'stream err;
                    }
                    sent[ack.slot as usize] = Some(ack);
                }
            }
            if closing {
                board.flushed.store(true, Ordering::Release);
                if board.stop.load(Ordering::Acquire) {
                    let _ = tx.finish(Terminal::Finalized);
                    return;
                }
            }
            // An idle ack stream must see its epoch die: it is what asks
            // for the next link while the sender waits for its words.
            tokio::select! {
                err = tx.closed() => break 'stream err,
                _ = tokio::time::timeout(ACK_INTERVAL, board.changed.notified()) => {}
            }
        };
        shared.tally(|v| v.ack_streams += 1);
        match failed {
            SendError::Dropped(_) => {}
            // Refused (the sender has not rebound yet) and the rest: retry.
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Sender: tells the receiver it heard every slot's end, again on each new
/// epoch until the receiver closes the done slot; true once it has.
async fn say_done(node: Arc<Soft>, peer: PeerId) -> bool {
    let key = StreamKey::new(DONE_ANCHOR, 0);
    loop {
        let Ok(mut tx) = node.mux().open(peer, key) else {
            return false;
        };
        let ended = match tx.send(Bytes::from_static(b"done")).await {
            Ok(()) => tx.closed().await,
            Err(err) => err,
        };
        match ended {
            SendError::PeerClosed(CloseReason::ReceiverGone) => return true,
            SendError::Dropped(DropReason::EpochEnded { .. }) => {}
            // Not bound again yet after an epoch died: retry.
            SendError::PeerClosed(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            _ => return false,
        }
    }
}

/// Receiver: true once the sender says it heard every slot's end; the slot
/// is closed then, which tells the sender its word arrived.
async fn hear_done(node: Arc<Soft>, mut rx: crate::mux::SlotReceiver) -> bool {
    let key = rx.key();
    loop {
        while let Some(frame) = rx.recv().await {
            match frame {
                Frame::Data(_) => return true,
                Frame::Heartbeat => {}
                _ => break,
            }
        }
        rx = loop {
            match node.mux().bind(key) {
                Ok(rx) => break rx,
                Err(MuxError::AlreadyBound(_)) => {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Err(_) => return false,
            }
        };
    }
}

/// One stream's place in its slot's check: the stream id and numbering its
/// first good record fixed, and the seq it owes next.
#[derive(Debug, Default)]
struct StreamCheck {
    stream: Option<u32>,
    next: u64,
    /// The stream's index minus its seq.
    base: Option<u64>,
}

impl StreamCheck {
    /// Checks one record on slot `slot`, whose indices below `verified` are
    /// verified (by this stream or an earlier one), and tallies what it
    /// finds; returns the acknowledgement due, if any. A hostile or broken
    /// sender's record is a violation, never a panic.
    fn take(&mut self, shared: &Shared, slot: u32, verified: &mut u64, data: &[u8]) -> Option<Ack> {
        let Some(rec) = parse(data) else {
            shared.tally(|v| v.bad_records += 1);
            shared.violation(format!("slot {slot}: corrupt record at seq {}", self.next));
            return None;
        };
        if rec.slot != slot || self.stream.is_some_and(|s| s != rec.stream) {
            shared.tally(|v| v.bad_records += 1);
            shared.violation(format!(
                "slot {slot}: record of slot {} stream {:08x}",
                rec.slot, rec.stream
            ));
            return None;
        }
        let rec_base = rec.index.checked_sub(rec.seq);
        if rec_base.is_none() || self.base.is_some_and(|b| Some(b) != rec_base) {
            shared.tally(|v| v.bad_records += 1);
            shared.violation(format!(
                "slot {slot}: seq {} at index {} breaks the stream's numbering",
                rec.seq, rec.index
            ));
            return None;
        }
        let Some(after) = rec.seq.checked_add(1) else {
            shared.tally(|v| v.bad_records += 1);
            shared.violation(format!("slot {slot}: seq {} has no successor", rec.seq));
            return None;
        };
        self.stream = Some(rec.stream);
        self.base = rec_base;
        if rec.seq < self.next {
            shared.tally(|v| v.duplicates += 1);
            shared.violation(format!(
                "slot {slot}: seq {} again (expected {})",
                rec.seq, self.next
            ));
            return None;
        }
        if rec.seq > self.next {
            shared.tally(|v| v.gaps += 1);
            shared.violation(format!(
                "slot {slot}: seq {}, expected {}",
                rec.seq, self.next
            ));
        } else if rec.index > *verified {
            // In order within its stream, but the stream started past what
            // this slot has verified.
            shared.tally(|v| v.holes += 1);
            shared.violation(format!(
                "slot {slot}: stream starts at index {}, verified only below {}",
                rec.index, *verified
            ));
        }
        self.next = after;
        shared.records.fetch_add(1, Ordering::Relaxed);
        if rec.index < *verified {
            shared.redelivered.fetch_add(1, Ordering::Relaxed);
        } else if rec.index == *verified {
            *verified += 1;
            shared.unique.fetch_add(1, Ordering::Relaxed);
            if *verified % ACK_EVERY == 0 {
                return Some(Ack {
                    slot,
                    stream: rec.stream,
                    verified: *verified,
                    state: AckState::Open,
                });
            }
        }
        None
    }
}

/// Verifies one slot's streams until one ends `Finalized`; true if one did.
async fn recv_slot(
    node: Arc<Soft>,
    slot: u32,
    mut rx: crate::mux::SlotReceiver,
    records: u64,
    board: Arc<AckBoard>,
    shared: Arc<Shared>,
) -> bool {
    let key = StreamKey::new(SOAK_ANCHOR, u64::from(slot));
    // Every index below this is verified, by this stream or an earlier one.
    let mut verified = 0u64;
    loop {
        shared.tally(|v| v.streams += 1);
        let mut check = StreamCheck::default();
        let terminal = loop {
            let Some(frame) = rx.recv().await else {
                break None;
            };
            match frame {
                Frame::Data(data) => {
                    if let Some(ack) = check.take(&shared, slot, &mut verified, &data) {
                        board.publish(ack, false);
                    }
                }
                Frame::Heartbeat => continue,
                terminal => break Some(terminal),
            }
        };
        let mut ack = Ack {
            slot,
            stream: check.stream.unwrap_or(0),
            verified,
            state: AckState::Dropped,
        };
        match terminal {
            Some(Frame::Finalized) => {
                if records > 0 && verified < records {
                    shared.tally(|v| v.missing += records - verified);
                    shared.violation(format!(
                        "slot {slot}: finalized with {verified} of {records} records verified"
                    ));
                }
                ack.state = AckState::Finalized;
                board.publish(ack, true);
                return true;
            }
            Some(Frame::Dropped(DropReason::EpochEnded { epoch })) => {
                board.publish(ack, true);
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
        let rec = Rec {
            slot: 7,
            stream: 0xdead_beef,
            seq: 42,
            index: 1042,
        };
        let r = record(rec, 64);
        assert_eq!(parse(&r), Some(rec));
        let mut bad = r.to_vec();
        bad[30] ^= 1;
        assert_eq!(parse(&bad), None);
        assert_eq!(parse(&r[..10]), None);
    }

    #[test]
    fn acks_round_trip_and_garbage_is_refused() {
        let ack = Ack {
            slot: 3,
            stream: 9,
            verified: 15_625,
            state: AckState::Dropped,
        };
        let bytes = encode_ack(&ack);
        assert_eq!(parse_ack(&bytes), Some(ack));
        let mut bad = bytes.to_vec();
        bad[16] = 7;
        let crc = crc32fast::hash(&bad[..ACK_LEN - CRC]);
        bad[ACK_LEN - CRC..].copy_from_slice(&crc.to_be_bytes());
        assert_eq!(parse_ack(&bad), None, "unknown state");
        assert_eq!(parse_ack(&bytes[..ACK_LEN - 1]), None);
        let mut flipped = bytes.to_vec();
        flipped[5] ^= 1;
        assert_eq!(parse_ack(&flipped), None);
    }

    fn receiver() -> Shared {
        Shared {
            started: Instant::now(),
            json: true,
            verdict: Mutex::default(),
            records: AtomicU64::new(0),
            unique: AtomicU64::new(0),
            redelivered: AtomicU64::new(0),
            counters: Mutex::default(),
            phases: Vec::new(),
            slots_sent: AtomicU64::new(0),
            finishing: AtomicBool::new(false),
        }
    }

    fn rec(slot: u32, stream: u32, seq: u64, index: u64) -> Bytes {
        record(
            Rec {
                slot,
                stream,
                seq,
                index,
            },
            64,
        )
    }

    /// (bad records, duplicates, gaps, holes, violations) so far.
    fn faults(shared: &Shared) -> (u64, u64, u64, u64, u64) {
        let v = shared.verdict.lock().expect("verdict");
        (
            v.bad_records,
            v.duplicates,
            v.gaps,
            v.holes,
            v.violation_count,
        )
    }

    /// A slot's streams verified record by record: in order, acknowledged
    /// every `ACK_EVERY`; an earlier epoch's records again are counted
    /// redelivered, not faults.
    #[test]
    fn in_order_streams_verify_their_slot_and_repeats_across_streams_are_redelivered() {
        let shared = receiver();
        let mut verified = 0;
        let mut first = StreamCheck::default();
        let acks: Vec<Ack> = (0..ACK_EVERY + 10)
            .filter_map(|i| first.take(&shared, 3, &mut verified, &rec(3, 1, i, i)))
            .collect();
        assert_eq!(verified, ACK_EVERY + 10);
        assert_eq!(acks.len(), 1);
        assert_eq!(
            (acks[0].verified, acks[0].state),
            (ACK_EVERY, AckState::Open)
        );
        // The next epoch's stream resends from the acknowledged prefix.
        let mut second = StreamCheck::default();
        for seq in 0..20 {
            second.take(&shared, 3, &mut verified, &rec(3, 2, seq, ACK_EVERY + seq));
        }
        assert_eq!(verified, ACK_EVERY + 20);
        assert_eq!(shared.redelivered.load(Ordering::Relaxed), 10);
        assert_eq!(shared.unique.load(Ordering::Relaxed), ACK_EVERY + 20);
        assert_eq!(faults(&shared), (0, 0, 0, 0, 0));
    }

    /// Every way a sender can get a record wrong is a counted violation;
    /// a seq at `u64::MAX` (no successor) included, which used to overflow.
    #[test]
    fn a_broken_or_hostile_senders_records_are_violations_never_a_panic() {
        let shared = receiver();
        let mut verified = 0;
        let mut check = StreamCheck::default();
        check.take(&shared, 3, &mut verified, &rec(3, 1, 0, 0));
        let mut corrupt = rec(3, 1, 1, 1).to_vec();
        corrupt[30] ^= 1;
        check.take(&shared, 3, &mut verified, &corrupt);
        check.take(&shared, 3, &mut verified, &rec(4, 1, 1, 1)); // another slot's
        check.take(&shared, 3, &mut verified, &rec(3, 9, 1, 1)); // another stream's
        check.take(&shared, 3, &mut verified, &rec(3, 1, 1, 7)); // index - seq moved
        check.take(&shared, 3, &mut verified, &rec(3, 1, 5, 2)); // index below seq
        assert_eq!(faults(&shared), (5, 0, 0, 0, 5));
        check.take(&shared, 3, &mut verified, &rec(3, 1, 0, 0));
        assert_eq!(faults(&shared), (5, 1, 0, 0, 6), "a duplicate");
        check.take(&shared, 3, &mut verified, &rec(3, 1, 2, 2));
        assert_eq!(faults(&shared), (5, 1, 1, 0, 7), "a gap");
        assert_eq!(verified, 1, "index 1 never came");
        // A stream numbered to the top of u64 (its base 0 keeps index = seq).
        let mut top = StreamCheck::default();
        let mut top_verified = u64::MAX;
        top.take(
            &shared,
            5,
            &mut top_verified,
            &rec(5, 1, u64::MAX, u64::MAX),
        );
        assert_eq!(faults(&shared), (6, 1, 1, 0, 8), "no successor");
        // A new stream that starts past the verified prefix leaves a hole.
        let mut late = StreamCheck::default();
        let mut slot_verified = 4;
        late.take(&shared, 6, &mut slot_verified, &rec(6, 2, 0, 9));
        assert_eq!(faults(&shared), (6, 1, 1, 1, 9), "a hole");
        assert_eq!(slot_verified, 4);
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        assert_eq!(unhex(&hex(&[0, 1, 0xff])).unwrap(), vec![0, 1, 0xff]);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
        assert!(unhex("é1").is_err());
    }
}
