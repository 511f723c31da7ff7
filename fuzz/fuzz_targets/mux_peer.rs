//! One peer's mux core fed hostile batches.
//!
//! ```text
//!  fuzzer ─ Step ─► batch of records (valid framing; fuzzed slots, seqs,
//!          │        kinds, lengths, fragments) or raw bytes ─► handle_batch
//!          ├► bind a stream key / drain a receiver (returns credit)
//!          ├► reconnect: the next epoch, what closed streams hold carried over
//!          └► advance the clock ─► handle_timeout
//!  after each step: poll_batch until empty, check invariants
//! ```
//!
//! Invariants: no panic; a protocol violation is an error (the epoch dies,
//! `fail_all` ends every slot) and the peer reconnects (a few times, then
//! nothing more is fed); live slots never
//! exceed the configured limit; a receiver never holds more undrained data
//! than its window plus two records, nor than the peer window (credit bounds
//! memory), and the peer's held bytes never exceed the peer window, across
//! epochs too; every batch out
//! parses, names the epoch and counts up by one; one drain is bounded.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use qpmux::mux::fuzzing::PeerHarness;
use qpmux::mux::protocol::{BatchEncoder, BatchView, CloseReason, Epoch, FrameSeq, Lane, SlotId};
use qpmux::mux::{DropReason, Frame, MuxConfig, RECORD_OVERHEAD, SlotReceiver, StreamKey};
use tokio::time::Instant;

const EPOCH: Epoch = Epoch(7);
/// Epochs one input may run through (violations and reconnects).
const MAX_EPOCHS: u64 = 4;
const WINDOW: u32 = 4096;
const MAX_RECORD: usize = 8192;
/// Smaller than the slots' windows together, so peer credit is what binds.
const PEER_WINDOW: u32 = 2 * MAX_RECORD as u32;
const MAX_SLOTS: u32 = 16;
const BATCH_BUF: usize = 16 << 10;
const STEPS_CAP: usize = 128;
const DRAIN_CAP: usize = 4096;
/// Slot indices the fuzzer picks from (a few, so records meet their slots).
const INDICES: u32 = 24;

#[derive(Arbitrary, Debug)]
enum Seq {
    /// The next sequence number for that slot (tracked by the harness).
    Next,
    Raw(u32),
}

#[derive(Arbitrary, Debug)]
enum Rec {
    Open {
        index: u8,
        generation: u8,
        key: u8,
    },
    Data {
        index: u8,
        generation: u8,
        seq: Seq,
        len: u16,
        more: bool,
    },
    Close {
        index: u8,
        generation: u8,
        seq: Seq,
        reason: u8,
    },
    Credit {
        index: u8,
        generation: u8,
        bytes: u32,
    },
    PeerCredit(u32),
    Heartbeat {
        index: u8,
        generation: u8,
        seq: Seq,
    },
    Message {
        seq: Seq,
        len: u16,
        more: bool,
    },
    Ping(u64),
    Pong(u64),
    Goodbye,
}

#[derive(Arbitrary, Debug)]
enum Step {
    Batch {
        records: Vec<Rec>,
        seq: Option<u32>,
        epoch: Option<u64>,
    },
    Raw(Vec<u8>),
    Bind(u8),
    Drain(u8),
    Advance(u16),
    Reconnect,
}

fn key(k: u8) -> StreamKey {
    StreamKey::new(u64::from(k % 8), u64::from(k / 8 % 2))
}

fn slot(index: u8, generation: u8) -> SlotId {
    SlotId::new(u32::from(index) % INDICES + 1, generation % 2).expect("small index")
}

struct Run {
    peer: PeerHarness,
    epoch: Epoch,
    now: Instant,
    batch_seq: u32,
    out_seq: u32,
    slot_seq: [u32; INDICES as usize + 1],
    message_seq: u32,
    receivers: Vec<SlotReceiver>,
    dead: bool,
    violations: u32,
    buf: Vec<u8>,
    /// Data frames consumers drained (for `FUZZ_TRACE`).
    delivered: u64,
    max_live: usize,
}

impl Run {
    fn next_seq(counter: &mut u32, seq: &Seq) -> FrameSeq {
        match seq {
            Seq::Next => {
                let s = *counter;
                *counter = counter.wrapping_add(1);
                FrameSeq(s)
            }
            Seq::Raw(s) => FrameSeq(*s),
        }
    }

    fn encode(&mut self, records: &[Rec], seq: Option<u32>, epoch: Option<u64>) -> Vec<u8> {
        let mut buf = vec![0u8; BATCH_BUF];
        let epoch = epoch.map_or(self.epoch, Epoch);
        let batch_seq = seq.unwrap_or(self.batch_seq);
        let mut enc = BatchEncoder::new(&mut buf, epoch, batch_seq, Lane(0)).expect("big buffer");
        let filler = [0x5au8; MAX_RECORD + 64];
        for rec in records.iter().take(64) {
            let r = match rec {
                Rec::Open {
                    index,
                    generation,
                    key: k,
                } => {
                    let id = slot(*index, *generation);
                    self.slot_seq[id.index() as usize] = 1;
                    let k = key(*k);
                    enc.push_open(id, FrameSeq(0), k.anchor.0, k.session.0)
                }
                Rec::Data {
                    index,
                    generation,
                    seq,
                    len,
                    more,
                } => {
                    let id = slot(*index, *generation);
                    let s = Self::next_seq(&mut self.slot_seq[id.index() as usize], seq);
                    let len = usize::from(*len) % (MAX_RECORD + 64);
                    enc.push_data(id, s, &filler[..len], *more)
                }
                Rec::Close {
                    index,
                    generation,
                    seq,
                    reason,
                } => {
                    let id = slot(*index, *generation);
                    let s = Self::next_seq(&mut self.slot_seq[id.index() as usize], seq);
                    let reason = CloseReason::from_wire(reason % 7).expect("0..7 are reasons");
                    enc.push_close(id, s, reason)
                }
                Rec::Credit {
                    index,
                    generation,
                    bytes,
                } => enc.push_credit(slot(*index, *generation), *bytes),
                Rec::PeerCredit(bytes) => enc.push_peer_credit(*bytes),
                Rec::Heartbeat {
                    index,
                    generation,
                    seq,
                } => {
                    let id = slot(*index, *generation);
                    let s = Self::next_seq(&mut self.slot_seq[id.index() as usize], seq);
                    enc.push_heartbeat(id, s)
                }
                Rec::Message { seq, len, more } => {
                    let s = Self::next_seq(&mut self.message_seq, seq);
                    let len = usize::from(*len) % (MAX_RECORD + 64);
                    enc.push_message(s, &filler[..len], *more)
                }
                Rec::Ping(n) => enc.push_ping(*n),
                Rec::Pong(n) => enc.push_pong(*n),
                Rec::Goodbye => enc.push_goodbye(),
            };
            if r.is_err() {
                break; // the batch is full
            }
        }
        if seq.is_none() {
            self.batch_seq = self.batch_seq.wrapping_add(1);
        }
        let n = enc.finish();
        buf.truncate(n);
        buf
    }

    fn feed(&mut self, bytes: &[u8]) {
        if self.peer.handle_batch(bytes, self.now).is_err() {
            // A violation ends the epoch; the peer may come back.
            self.violations += 1;
            self.reconnect();
        }
    }

    /// Ends the epoch and, a few times per input, starts the next one.
    fn reconnect(&mut self) {
        if self.epoch.0 - EPOCH.0 + 1 >= MAX_EPOCHS {
            self.peer
                .fail_all(DropReason::EpochEnded { epoch: self.epoch });
            assert_eq!(self.peer.live_slots(), 0, "fail_all leaves a slot");
            self.dead = true;
            return;
        }
        self.epoch = Epoch(self.epoch.0 + 1);
        self.peer.next_epoch(self.epoch, self.now);
        assert_eq!(self.peer.live_slots(), 0, "a slot outlived its epoch");
        self.batch_seq = 0;
        self.out_seq = 0;
        self.slot_seq = [0; INDICES as usize + 1];
        self.message_seq = 0;
    }

    fn drain_receiver(&mut self, which: u8) {
        if self.receivers.is_empty() {
            return;
        }
        let i = usize::from(which) % self.receivers.len();
        let rx = &mut self.receivers[i];
        let mut bytes = 0u64;
        while let Ok(frame) = rx.try_recv() {
            if let Frame::Data(d) = frame {
                // As the windows count it: empty records are bounded too.
                bytes += (d.len() + RECORD_OVERHEAD) as u64;
                self.delivered += 1;
            }
        }
        assert!(
            bytes <= u64::from(WINDOW) + 2 * (MAX_RECORD + RECORD_OVERHEAD) as u64,
            "{bytes} undrained bytes: credit does not bound the receiver"
        );
        assert!(
            bytes <= u64::from(PEER_WINDOW),
            "{bytes} undrained bytes: peer credit does not bound the receiver"
        );
        self.peer.handle_control(self.now);
    }

    fn step(&mut self, step: &Step) {
        match step {
            Step::Batch {
                records,
                seq,
                epoch,
            } => {
                let bytes = self.encode(records, *seq, *epoch);
                self.feed(&bytes);
            }
            Step::Raw(bytes) => self.feed(bytes),
            Step::Bind(k) => {
                let k = key(*k);
                if let Ok(rx) = self.peer.bind(k) {
                    self.receivers.push(rx);
                }
            }
            Step::Drain(which) => self.drain_receiver(*which),
            Step::Advance(ms) => {
                self.now += Duration::from_millis(u64::from(*ms));
                self.peer.handle_timeout(self.now);
            }
            Step::Reconnect => self.reconnect(),
        }
        assert!(self.peer.live_slots() <= MAX_SLOTS as usize);
        assert!(self.peer.peer_outstanding() <= u64::from(PEER_WINDOW));
        self.max_live = self.max_live.max(self.peer.live_slots());
        self.poll_out();
    }

    fn poll_out(&mut self) {
        for _ in 0..DRAIN_CAP {
            let n = self.peer.poll_batch(&mut self.buf, self.now);
            if n == 0 {
                return;
            }
            let view = BatchView::new_checked(&self.buf[..n]).expect("own batch parses");
            assert_eq!(view.epoch(), self.epoch);
            assert_eq!(view.batch_seq(), self.out_seq);
            assert_eq!(view.records().count(), usize::from(view.record_count()));
            self.out_seq = self.out_seq.wrapping_add(1);
        }
        panic!("poll_batch does not run dry");
    }
}

fuzz_target!(|input: (Vec<u8>, Vec<Step>)| {
    let (binds, steps) = input;
    let now = Instant::now();
    let config = MuxConfig {
        slot_window: WINDOW,
        peer_window: PEER_WINDOW,
        max_record: MAX_RECORD,
        max_slots_per_peer: MAX_SLOTS,
        heartbeat: Some(Duration::from_secs(1)),
        ..MuxConfig::default()
    };
    let mut run = Run {
        peer: PeerHarness::new(config, EPOCH, 64, now),
        epoch: EPOCH,
        now,
        batch_seq: 0,
        out_seq: 0,
        slot_seq: [0; INDICES as usize + 1],
        message_seq: 0,
        receivers: Vec::new(),
        dead: false,
        violations: 0,
        buf: vec![0; BATCH_BUF],
        delivered: 0,
        max_live: 0,
    };
    for k in binds.iter().take(16) {
        run.step(&Step::Bind(*k));
    }
    for step in steps.iter().take(STEPS_CAP) {
        if run.dead {
            break;
        }
        run.step(step);
    }
    if trace_on() {
        let mut reached = Vec::new();
        for (name, hit) in [
            ("violation", run.violations > 0),
            ("next_epoch", run.epoch != EPOCH),
            ("delivered", run.delivered > 0),
            ("slot_limit", run.max_live == MAX_SLOTS as usize),
            ("goodbye", run.peer.goodbye_received()),
            ("batch_out", run.out_seq > 0),
        ] {
            if hit {
                reached.push(name);
            }
        }
        eprintln!("reached: {}", reached.join(" "));
    }
});

/// `FUZZ_TRACE=1` prints what each run reached (replay a corpus with
/// `-runs=0` to see how deep it goes).
fn trace_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FUZZ_TRACE").is_some())
}
