//! Sans-IO RC queue pair: requester, responder and completer of one QP.
//!
//! ```text
//!  post_send/post_recv ─► SQ/RQ ─► poll_transmit(now) ─► packets (SEND*, then ACK/NAK)
//!  handle_packet(now, pkt): SEND* ─► responder (in order, dup re-ACK, one NAK, RNR, LEN)
//!                           ACK/NAK ─► requester/completer (go-back-N, retry, RNR wait)
//!  handle_timeout(now) ─► Timer::{AckTimeout, RnrRetry, AckCoalesce};  poll_timeout() = next deadline
//!  poll_completion() ─► (CqSide, WorkCompletion), FIFO per queue
//! ```
//!
//! Owner: the device core (behind its lock); nothing here reads a clock,
//! opens a socket or spawns. Each `handle_*` and `poll_*` does bounded work.
//! Error model (roce-wire.md): the first error moves the QP to ERR, the failing
//! WR completes with its status, every other WR (signaled or not) with
//! `WrFlushErr`, in posting order.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::Instant;
use super::mr::MrMem;
use super::wire::{
    AethKind, AethRepr, BthRepr, DEFAULT_PKEY, IcrcContext, NakCode, Opcode, Packet, PacketRepr,
};
use crate::verbs::{
    Mtu, PeerRequestError, Psn, QpCaps, QpOp, QpState, Qpn, RtrAttr, RtsAttr, VerbsError, WcOpcode,
    WcStatus, WorkCompletion,
};

/// Most PSNs the requester keeps unacknowledged.
pub(crate) const MAX_UNACKED: u32 = 128;
/// PSNs the send queue may hold allocated (under half the 24-bit space).
pub(crate) const MAX_OUTSTANDING_PSNS: u32 = (1 << 23) - 1;
/// The requester asks for an ACK at least this often.
pub(crate) const ACK_REQ_EVERY: u32 = 64;
/// Responses (ACK/NAK) the responder queues; older ACKs are superseded.
const MAX_PENDING_RESPONSES: usize = 16;
/// A coalesced ACK goes at once when it covers this many PSNs: a quarter of
/// the requester's window, so a stream never stalls on a held ACK.
pub(crate) const ACK_COALESCE_PSNS: u32 = MAX_UNACKED / 4;
/// A held ACK waits at most this share of the QP's own local ACK timeout,
/// so a peer configured like it never times out on one.
const ACK_HOLD_SHARE_OF_TIMEOUT: u32 = 4;

/// Which CQ a completion goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CqSide {
    Send,
    Recv,
}

/// Timers of one QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timer {
    /// Local ACK timeout: no progress on outstanding PSNs.
    AckTimeout = 0,
    /// End of an RNR wait: resend from the NAKed PSN.
    RnrRetry = 1,
    /// A coalesced ACK is held until then (responder).
    AckCoalesce = 2,
}

const TIMERS: [Timer; 3] = [Timer::AckTimeout, Timer::RnrRetry, Timer::AckCoalesce];

#[derive(Debug, Default)]
struct TimerTable([Option<Instant>; 3]);

impl TimerTable {
    fn set(&mut self, t: Timer, at: Instant) {
        self.0[t as usize] = Some(at);
    }
    fn stop(&mut self, t: Timer) {
        self.0[t as usize] = None;
    }
    fn get(&self, t: Timer) -> Option<Instant> {
        self.0[t as usize]
    }
    fn next(&self) -> Option<Instant> {
        self.0.iter().flatten().min().copied()
    }
}

/// Bytes of a WR: a slice of a registered region, or a copy made at post time.
#[derive(Debug)]
pub(crate) enum Segment {
    Mr {
        mem: Arc<MrMem>,
        offset: usize,
        len: usize,
    },
    Inline(Box<[u8]>),
}

impl Segment {
    fn len(&self) -> usize {
        match self {
            Segment::Mr { len, .. } => *len,
            Segment::Inline(b) => b.len(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct SendWqe {
    pub wr_id: u64,
    pub imm: Option<u32>,
    pub segs: Vec<Segment>,
    pub signaled: bool,
    len: usize,
    first_psn: Psn,
    npkts: u32,
}

impl SendWqe {
    pub fn new(wr_id: u64, imm: Option<u32>, segs: Vec<Segment>, signaled: bool) -> SendWqe {
        let len = segs.iter().map(Segment::len).sum();
        SendWqe {
            wr_id,
            imm,
            segs,
            signaled,
            len,
            first_psn: Psn::new(0),
            npkts: 0,
        }
    }
    fn last_psn(&self) -> Psn {
        self.first_psn.add(self.npkts - 1)
    }
}

/// Bytes of the next receive buffer [`QpEngine::warm_next_receive`] reads:
/// a small batch and its header.
const WARM_BYTES: usize = 256;

#[derive(Debug)]
pub(crate) struct RecvWqe {
    pub wr_id: u64,
    pub segs: Vec<Segment>,
    len: usize,
}

impl RecvWqe {
    pub fn new(wr_id: u64, segs: Vec<Segment>) -> RecvWqe {
        let len = segs.iter().map(Segment::len).sum();
        RecvWqe { wr_id, segs, len }
    }
}

/// Copy `out.len()` bytes starting at message offset `off` out of `segs`.
fn gather(segs: &[Segment], mut off: usize, out: &mut [u8]) {
    let mut done = 0;
    for seg in segs {
        let len = seg.len();
        if off >= len {
            off -= len;
            continue;
        }
        let n = (len - off).min(out.len() - done);
        match seg {
            Segment::Mr { mem, offset, .. } => {
                mem.read_into(offset + off, &mut out[done..done + n])
            }
            Segment::Inline(b) => out[done..done + n].copy_from_slice(&b[off..off + n]),
        }
        done += n;
        off = 0;
        if done == out.len() {
            break;
        }
    }
}

/// Copy `data` into `segs` at message offset `off` (the caller checked the length).
fn scatter(segs: &[Segment], mut off: usize, data: &[u8]) {
    let mut done = 0;
    for seg in segs {
        let len = seg.len();
        if off >= len {
            off -= len;
            continue;
        }
        let n = (len - off).min(data.len() - done);
        if let Segment::Mr { mem, offset, .. } = seg {
            mem.write_from(offset + off, &data[done..done + n]);
        }
        done += n;
        off = 0;
        if done == data.len() {
            break;
        }
    }
}

/// RNR NAK timer code → wait (roce-wire.md table).
pub(crate) fn rnr_timer_duration(code: u8) -> Duration {
    const MICROS: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    Duration::from_micros(MICROS[usize::from(code & 0x1f)])
}

/// A response the responder owes the requester.
#[derive(Clone, Copy, Debug)]
struct Response {
    psn: Psn,
    aeth: AethRepr,
}

/// Counters a test or operator may read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpCounters {
    /// RNR NAKs this QP's responder sent.
    pub rnr_naks_sent: u64,
    /// RNR NAKs this QP's requester received.
    pub rnr_naks_received: u64,
    /// Sequence-error NAKs sent.
    pub seq_naks_sent: u64,
    /// Go-back-N rewinds (timeouts and sequence NAKs).
    pub retransmit_rewinds: u64,
    /// Local ACK timeouts.
    pub ack_timeouts: u64,
    /// Duplicate request packets received (re-ACKed, not re-delivered).
    pub duplicates_received: u64,
    /// Messages refused because the receive CQ was full (the QP then errs).
    pub recv_cq_full_refusals: u64,
    /// RC requests this provider does not carry out (RDMA WRITE, READ,
    /// atomics) that reached the expected PSN: NAKed, and the QP errs.
    pub unsupported_requests: u64,
}

impl std::ops::AddAssign for QpCounters {
    fn add_assign(&mut self, more: QpCounters) {
        self.rnr_naks_sent += more.rnr_naks_sent;
        self.rnr_naks_received += more.rnr_naks_received;
        self.seq_naks_sent += more.seq_naks_sent;
        self.retransmit_rewinds += more.retransmit_rewinds;
        self.ack_timeouts += more.ack_timeouts;
        self.duplicates_received += more.duplicates_received;
        self.recv_cq_full_refusals += more.recv_cq_full_refusals;
        self.unsupported_requests += more.unsupported_requests;
    }
}

/// Where packets go once the QP is connected.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Path {
    pub dest_qpn: Qpn,
    pub mtu: Mtu,
    /// ICRC context for packets we send.
    pub tx_ctx: IcrcContext,
}

pub(crate) struct QpEngine {
    qpn: Qpn,
    state: QpState,
    caps: QpCaps,
    rng: SmallRng,
    /// How long the responder may hold a plain ACK to cover later packets.
    ack_delay: Duration,
    path: Option<Path>,
    rts: Option<RtsAttr>,
    min_rnr_timer: u8,
    timers: TimerTable,
    completions: VecDeque<(CqSide, WorkCompletion)>,
    pub counters: QpCounters,
    // Requester.
    sq: VecDeque<SendWqe>,
    una: Psn,
    next_psn: Psn,
    alloc_psn: Psn,
    sent_high: Psn,
    send_idx: usize,
    since_ack_req: u32,
    retry_left: u8,
    rnr_left: u8,
    rnr_waiting: bool,
    /// After an RNR wait, only `una` goes out (asking for an ACK) until an
    /// ACK shows progress: the responder dropped everything after the PSN
    /// it refused, and may still be stalled.
    rnr_probe: bool,
    /// PSN of the last sequence NAK acted on; a repeat without progress is a
    /// network duplicate (the responder NAKs once per gap).
    seq_nak_psn: Option<Psn>,
    // Responder.
    /// A receive completed since [`QpEngine::warm_next_receive`]: the new
    /// head of the receive queue is cold.
    rq_head_cold: bool,
    rq: VecDeque<RecvWqe>,
    epsn: Psn,
    msn: u32,
    nak_outstanding: bool,
    /// The receive CQ has no room (the device says so before each packet):
    /// a message that would complete into it is refused.
    recv_cq_full: bool,
    in_message: bool,
    msg_offset: usize,
    responses: VecDeque<Response>,
    /// In-order PSNs accepted since the last ACK went on the wire.
    psns_since_ack: u32,
    /// Why the responder erred the QP on a request of the peer's.
    peer_request_error: Option<PeerRequestError>,
}

impl QpEngine {
    /// `ack_delay`: how long a plain ACK may wait to cover later packets
    /// (zero: every A-bit packet is answered in the turn that took it).
    pub fn new(qpn: Qpn, caps: QpCaps, seed: u64, ack_delay: Duration) -> QpEngine {
        QpEngine {
            qpn,
            state: QpState::Reset,
            caps,
            rng: SmallRng::seed_from_u64(seed),
            ack_delay,
            path: None,
            rts: None,
            min_rnr_timer: 0,
            timers: TimerTable::default(),
            completions: VecDeque::new(),
            counters: QpCounters::default(),
            sq: VecDeque::new(),
            una: Psn::new(0),
            next_psn: Psn::new(0),
            alloc_psn: Psn::new(0),
            sent_high: Psn::new(0),
            send_idx: 0,
            since_ack_req: 0,
            retry_left: 0,
            rnr_left: 0,
            rnr_waiting: false,
            rnr_probe: false,
            seq_nak_psn: None,
            rq_head_cold: false,
            rq: VecDeque::new(),
            epsn: Psn::new(0),
            msn: 0,
            nak_outstanding: false,
            recv_cq_full: false,
            in_message: false,
            msg_offset: 0,
            responses: VecDeque::new(),
            psns_since_ack: 0,
            peer_request_error: None,
        }
    }

    pub fn state(&self) -> QpState {
        self.state
    }

    /// Why the responder moved the QP to ERR on a request of the peer's
    /// (`None` when something else erred it, or it is not in ERR).
    pub fn peer_request_error(&self) -> Option<PeerRequestError> {
        self.peer_request_error
    }

    fn invalid(&self, op: QpOp) -> VerbsError {
        VerbsError::InvalidState {
            qpn: self.qpn,
            state: self.state,
            op,
        }
    }

    // ---- commands -------------------------------------------------------

    pub fn modify_to_init(&mut self) -> Result<(), VerbsError> {
        if self.state != QpState::Reset {
            return Err(self.invalid(QpOp::ToInit));
        }
        self.state = QpState::Init;
        Ok(())
    }

    pub fn modify_to_rtr(&mut self, attr: &RtrAttr, tx_ctx: IcrcContext) -> Result<(), VerbsError> {
        if self.state != QpState::Init {
            return Err(self.invalid(QpOp::ToRtr));
        }
        if attr.min_rnr_timer > 31 {
            return Err(VerbsError::InvalidAttr {
                attr: "min_rnr_timer",
            });
        }
        self.path = Some(Path {
            dest_qpn: attr.dest_qpn,
            mtu: attr.path_mtu,
            tx_ctx,
        });
        self.min_rnr_timer = attr.min_rnr_timer;
        self.epsn = attr.rq_psn;
        self.msn = 0;
        self.state = QpState::Rtr;
        Ok(())
    }

    pub fn modify_to_rts(&mut self, attr: &RtsAttr) -> Result<(), VerbsError> {
        if self.state != QpState::Rtr {
            return Err(self.invalid(QpOp::ToRts));
        }
        if attr.timeout > 31 {
            return Err(VerbsError::InvalidAttr { attr: "timeout" });
        }
        if attr.retry_cnt > 7 {
            return Err(VerbsError::InvalidAttr { attr: "retry_cnt" });
        }
        if attr.rnr_retry > 7 {
            return Err(VerbsError::InvalidAttr { attr: "rnr_retry" });
        }
        self.rts = Some(*attr);
        self.una = attr.sq_psn;
        self.next_psn = attr.sq_psn;
        self.alloc_psn = attr.sq_psn;
        self.sent_high = attr.sq_psn;
        self.retry_left = attr.retry_cnt;
        self.rnr_left = attr.rnr_retry;
        self.state = QpState::Rts;
        Ok(())
    }

    /// Move to ERR (fault hook and `ibv_modify_qp(ERR)`): flush everything.
    pub fn modify_to_error(&mut self) {
        self.enter_error(None);
    }

    /// Move to RESET: discard WRs without completions.
    pub fn modify_to_reset(&mut self) {
        let fresh = QpEngine::new(self.qpn, self.caps, self.rng.random(), self.ack_delay);
        let counters = self.counters;
        let completions = std::mem::take(&mut self.completions);
        *self = fresh;
        self.counters = counters;
        self.completions = completions;
    }

    pub fn post_send(&mut self, mut wqe: SendWqe) -> Result<(), VerbsError> {
        match self.state {
            QpState::Rts => {}
            QpState::Err => {
                self.push_flush(CqSide::Send, wqe.wr_id);
                return Ok(());
            }
            QpState::Reset | QpState::Init | QpState::Rtr => {
                return Err(self.invalid(QpOp::PostSend));
            }
        }
        if self.sq.len() >= self.caps.max_send_wr {
            return Err(VerbsError::SendQueueFull {
                qpn: self.qpn,
                depth: self.caps.max_send_wr,
            });
        }
        let mtu = self.path.map_or(1024, |p| p.mtu.bytes());
        wqe.npkts = wqe.len.div_ceil(mtu).max(1) as u32;
        // Every allocated PSN must stay inside the ±2^23 comparison window.
        let allocated = self.alloc_psn.diff(self.una) as usize;
        let max = MAX_OUTSTANDING_PSNS as usize;
        if allocated + wqe.npkts as usize > max {
            return Err(VerbsError::TooLarge {
                cap: "outstanding packets",
                got: allocated + wqe.npkts as usize,
                max,
            });
        }
        wqe.first_psn = self.alloc_psn;
        self.alloc_psn = self.alloc_psn.add(wqe.npkts);
        self.sq.push_back(wqe);
        Ok(())
    }

    pub fn post_recv(&mut self, wqe: RecvWqe) -> Result<(), VerbsError> {
        match self.state {
            QpState::Init | QpState::Rtr | QpState::Rts => {}
            QpState::Err => {
                self.push_flush(CqSide::Recv, wqe.wr_id);
                return Ok(());
            }
            QpState::Reset => return Err(self.invalid(QpOp::PostRecv)),
        }
        if self.rq.len() >= self.caps.max_recv_wr {
            return Err(VerbsError::RecvQueueFull {
                qpn: self.qpn,
                depth: self.caps.max_recv_wr,
            });
        }
        self.rq.push_back(wqe);
        Ok(())
    }

    /// Lets a held ACK go now (the QP is about to be destroyed).
    pub fn release_held_ack(&mut self) {
        self.timers.stop(Timer::AckCoalesce);
    }

    // ---- outputs --------------------------------------------------------

    pub fn poll_completion(&mut self) -> Option<(CqSide, WorkCompletion)> {
        self.completions.pop_front()
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next()
    }

    /// Where `poll_transmit` output goes.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_ref()
    }

    /// Whether [`poll_transmit`](Self::poll_transmit) would emit a packet now.
    pub fn wants_transmit(&self) -> bool {
        self.path.is_some()
            && (self.response_ready()
                || self.state == QpState::Rts
                    && !self.rnr_waiting
                    && self.next_psn != self.alloc_psn
                    && self.next_psn.diff(self.una) < self.send_window()
                    && self.sq.get(self.send_idx).is_some())
    }

    /// PSNs that may be in flight: one while probing a responder that
    /// refused with an RNR NAK.
    fn send_window(&self) -> i32 {
        if self.rnr_probe {
            1
        } else {
            MAX_UNACKED as i32
        }
    }

    /// Emit the next packet into `buf` (which holds at least MTU + overhead
    /// bytes); returns its length. Responses go before new requests.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<usize> {
        let path = self.path?;
        // In ERR only the NAK that caused it is left to send. A held ACK
        // lets requests pass it.
        if self.response_ready()
            && let Some(r) = self.responses.pop_front()
        {
            if let AethKind::Ack { .. } = r.aeth.kind {
                self.psns_since_ack = 0;
            }
            let repr = PacketRepr {
                bth: BthRepr {
                    opcode: Opcode::Ack,
                    solicited: false,
                    mig_req: true,
                    pad_count: 0,
                    pkey: DEFAULT_PKEY,
                    dest_qp: path.dest_qpn,
                    ack_req: false,
                    psn: r.psn,
                },
                aeth: Some(r.aeth),
                imm: None,
            };
            return Some(repr.emit(&path.tx_ctx, &[], buf));
        }
        if self.state != QpState::Rts
            || self.rnr_waiting
            || self.next_psn == self.alloc_psn
            || self.next_psn.diff(self.una) >= self.send_window()
        {
            return None;
        }
        let wqe = self.sq.get(self.send_idx)?;
        let mtu = path.mtu.bytes();
        let pkt_index = self.next_psn.diff(wqe.first_psn) as u32;
        let offset = pkt_index as usize * mtu;
        let len = (wqe.len - offset).min(mtu);
        let first = pkt_index == 0;
        let last = pkt_index + 1 == wqe.npkts;
        let opcode = match (first, last, wqe.imm.is_some()) {
            (true, true, false) => Opcode::SendOnly,
            (true, true, true) => Opcode::SendOnlyImm,
            (true, false, _) => Opcode::SendFirst,
            (false, false, _) => Opcode::SendMiddle,
            (false, true, false) => Opcode::SendLast,
            (false, true, true) => Opcode::SendLastImm,
        };
        self.since_ack_req += 1;
        let ack_req = last || self.since_ack_req >= ACK_REQ_EVERY || self.rnr_probe;
        if ack_req {
            self.since_ack_req = 0;
        }
        let repr = PacketRepr {
            bth: BthRepr {
                opcode,
                solicited: false,
                mig_req: true,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                dest_qp: path.dest_qpn,
                ack_req,
                psn: self.next_psn,
            },
            aeth: None,
            imm: if last { wqe.imm } else { None },
        };
        // Gather straight into the packet buffer, after the headers.
        let header = repr.header_len();
        gather(&wqe.segs, offset, &mut buf[header..header + len]);
        let n = repr.emit_around(&path.tx_ctx, len, buf);
        self.next_psn = self.next_psn.add(1);
        if self.sent_high.before(self.next_psn) {
            self.sent_high = self.next_psn;
        }
        if last {
            self.send_idx += 1;
        }
        if self.timers.get(Timer::AckTimeout).is_none()
            && let Some(t) = self.rts.and_then(|r| r.ack_timeout())
        {
            self.timers.set(Timer::AckTimeout, now + t);
        }
        Some(n)
    }

    // ---- inputs ---------------------------------------------------------

    pub fn handle_timeout(&mut self, now: Instant) {
        for timer in TIMERS {
            match self.timers.get(timer) {
                Some(at) if at <= now => {}
                Some(_) | None => continue,
            }
            self.timers.stop(timer);
            match timer {
                Timer::AckTimeout => self.on_ack_timeout(now),
                Timer::RnrRetry => {
                    self.rnr_waiting = false;
                    self.rnr_probe = true;
                    self.rewind();
                }
                // Stopped above: the held ACK is ready.
                Timer::AckCoalesce => {}
            }
        }
    }

    fn on_ack_timeout(&mut self, now: Instant) {
        if self.state != QpState::Rts || self.una == self.next_psn {
            return;
        }
        self.counters.ack_timeouts += 1;
        if self.retry_left == 0 {
            self.enter_error(Some(WcStatus::RetryExcErr));
            return;
        }
        self.retry_left -= 1;
        self.rewind();
        if let Some(t) = self.rts.and_then(|r| r.ack_timeout()) {
            self.timers.set(Timer::AckTimeout, now + t);
        }
    }

    /// Go-back-N: resend from the oldest unacknowledged PSN.
    fn rewind(&mut self) {
        self.counters.retransmit_rewinds += 1;
        self.next_psn = self.una;
        self.send_idx = 0;
        self.since_ack_req = 0;
    }

    /// After a receive completed, reads the start of the next posted
    /// receive buffer, so the next message's copy into it does not miss
    /// (the buffer was last touched a whole receive queue ago).
    /// Returns whether there was a buffer to read.
    pub fn warm_next_receive(&mut self) -> bool {
        if !std::mem::take(&mut self.rq_head_cold) {
            return false;
        }
        match self.rq.front().and_then(|w| w.segs.first()) {
            Some(Segment::Mr { mem, offset, len }) => {
                mem.warm(*offset, (*len).min(WARM_BYTES));
                true
            }
            _ => false,
        }
    }

    /// Whether a receive completed since the last [`QpEngine::warm_next_receive`].
    pub fn rq_head_cold(&self) -> bool {
        self.rq_head_cold
    }

    /// Whether the receive CQ is full, for the next packet to see.
    pub fn set_recv_cq_full(&mut self, full: bool) {
        self.recv_cq_full = full;
    }

    pub fn handle_packet(&mut self, now: Instant, pkt: &Packet<'_>) {
        match self.state {
            QpState::Rtr | QpState::Rts => {}
            QpState::Reset | QpState::Init | QpState::Err => return,
        }
        match pkt.repr.aeth {
            Some(aeth) => self.on_response(now, pkt.repr.bth.psn, aeth),
            None => self.on_request(now, pkt),
        }
    }

    // ---- requester / completer -------------------------------------------

    fn on_response(&mut self, now: Instant, psn: Psn, aeth: AethRepr) {
        if self.state != QpState::Rts {
            return;
        }
        // Valid responses name a PSN in [una - 1, sent_high - 1].
        let lo = self.una.sub(1);
        if psn.before(lo) || !psn.before(self.sent_high) {
            return;
        }
        match aeth.kind {
            AethKind::Ack { .. } => self.ack_through(now, psn),
            AethKind::RnrNak { timer } => {
                self.counters.rnr_naks_received += 1;
                self.ack_through(now, psn.sub(1));
                if self.state != QpState::Rts || self.una != psn || self.rnr_waiting {
                    return;
                }
                if self.rnr_left == 0 {
                    self.enter_error(Some(WcStatus::RnrRetryExcErr));
                    return;
                }
                if self.rts.is_some_and(|r| r.rnr_retry != 7) {
                    self.rnr_left -= 1;
                }
                // The responder answered: the path works, so the budget for
                // unanswered retries starts over (else a long receiver stall
                // plus rare losses exhausts it while rnr_retry is unlimited).
                if let Some(r) = self.rts {
                    self.retry_left = r.retry_cnt;
                }
                self.rnr_waiting = true;
                self.timers.stop(Timer::AckTimeout);
                self.timers
                    .set(Timer::RnrRetry, now + rnr_timer_duration(timer));
                self.next_psn = self.una;
                self.send_idx = 0;
                self.since_ack_req = 0;
            }
            AethKind::Nak(NakCode::PsnSequenceError) => {
                self.ack_through(now, psn.sub(1));
                if self.state != QpState::Rts
                    || self.rnr_waiting
                    || self.una != psn
                    || self.seq_nak_psn == Some(psn)
                {
                    return;
                }
                self.seq_nak_psn = Some(psn);
                if self.retry_left == 0 {
                    self.enter_error(Some(WcStatus::RetryExcErr));
                    return;
                }
                self.retry_left -= 1;
                self.rewind();
            }
            AethKind::Nak(code) => {
                self.ack_through(now, psn.sub(1));
                // A fatal NAK names the request that failed: one outstanding,
                // not the last one acknowledged (the range's `una - 1`).
                if self.state != QpState::Rts || self.una != psn {
                    return;
                }
                let status = match code {
                    NakCode::InvalidRequest => WcStatus::RemInvReqErr,
                    NakCode::RemoteAccessError => WcStatus::RemAccessErr,
                    NakCode::RemoteOperationalError | NakCode::PsnSequenceError => {
                        WcStatus::RemOpErr
                    }
                };
                self.enter_error(Some(status));
            }
        }
    }

    /// Every PSN up to and including `psn` is acknowledged.
    fn ack_through(&mut self, now: Instant, psn: Psn) {
        if psn.before(self.una) {
            return;
        }
        let progressed = psn.diff(self.una) >= 0;
        self.una = psn.add(1);
        while let Some(front) = self.sq.front() {
            if front.last_psn().before(self.una) {
                let wqe = self.sq.pop_front().expect("front exists");
                self.send_idx = self.send_idx.saturating_sub(1);
                if wqe.signaled {
                    let wc = WorkCompletion {
                        wr_id: wqe.wr_id,
                        status: WcStatus::Success,
                        opcode: WcOpcode::Send,
                        byte_len: wqe.len as u32,
                        imm: None,
                        qp_num: self.qpn,
                    };
                    self.completions.push_back((CqSide::Send, wc));
                }
            } else {
                break;
            }
        }
        if self.next_psn.before(self.una) {
            self.next_psn = self.una;
            self.send_idx = 0;
        }
        if progressed {
            self.seq_nak_psn = None;
            self.rnr_probe = false;
            // The refused PSN got through (a copy reached the responder
            // after it posted): the RNR wait is over.
            if self.rnr_waiting {
                self.rnr_waiting = false;
                self.timers.stop(Timer::RnrRetry);
            }
            if let Some(r) = self.rts {
                self.retry_left = r.retry_cnt;
                self.rnr_left = r.rnr_retry;
            }
            if self.una == self.next_psn {
                self.timers.stop(Timer::AckTimeout);
            } else if let Some(t) = self.rts.and_then(|r| r.ack_timeout()) {
                self.timers.set(Timer::AckTimeout, now + t);
            }
        }
    }

    // ---- responder --------------------------------------------------------

    /// Whether the front response may go now: a NAK always, a plain ACK
    /// once it is no longer held.
    fn response_ready(&self) -> bool {
        match self.responses.front() {
            None => false,
            Some(r) => {
                !matches!(r.aeth.kind, AethKind::Ack { .. })
                    || self.timers.get(Timer::AckCoalesce).is_none()
            }
        }
    }

    /// ACKs every PSN through `psn`. Unless `now_due`, the ACK may be held
    /// up to the coalescing delay to cover what arrives meanwhile (the
    /// spec lets one ACK answer many requests); it goes at once when it
    /// covers [`ACK_COALESCE_PSNS`] or merges into an ACK already due.
    fn respond_ack(&mut self, now: Instant, psn: Psn, now_due: bool) {
        let due_ack_queued = self.timers.get(Timer::AckCoalesce).is_none()
            && self
                .responses
                .back()
                .is_some_and(|r| matches!(r.aeth.kind, AethKind::Ack { .. }));
        self.respond(psn, AethKind::Ack { credit: 0x1f });
        let hold = self.ack_hold();
        // A NAK queued ahead is due (see `respond`), and a hold armed now
        // would keep it, behind the ACKs before it, for the whole delay.
        let nak_queued = || {
            self.responses
                .iter()
                .any(|r| !matches!(r.aeth.kind, AethKind::Ack { .. }))
        };
        if now_due
            || due_ack_queued
            || hold.is_zero()
            || self.psns_since_ack >= ACK_COALESCE_PSNS
            || nak_queued()
        {
            self.timers.stop(Timer::AckCoalesce);
        } else if self.timers.get(Timer::AckCoalesce).is_none() {
            self.timers.set(Timer::AckCoalesce, now + hold);
        }
    }

    /// The coalescing delay, at most a share of this QP's local ACK timeout.
    fn ack_hold(&self) -> Duration {
        match self.rts.and_then(|r| r.ack_timeout()) {
            Some(t) => self.ack_delay.min(t / ACK_HOLD_SHARE_OF_TIMEOUT),
            None => self.ack_delay,
        }
    }

    /// Queues an ACK or NAK. A NAK releases a held ACK ahead of it.
    fn respond(&mut self, psn: Psn, kind: AethKind) {
        if !matches!(kind, AethKind::Ack { .. }) {
            self.timers.stop(Timer::AckCoalesce);
        }
        // An ACK covers every PSN before it, so a newer one replaces a plain
        // ACK at the tail of the queue: a burst handled in one driver turn
        // costs one ACK on the wire (NAKs keep their place and order).
        if let AethKind::Ack { .. } = kind
            && let Some(last) = self.responses.back_mut()
            && matches!(last.aeth.kind, AethKind::Ack { .. })
            && !psn.before(last.psn)
        {
            *last = Response {
                psn,
                aeth: AethRepr {
                    kind,
                    msn: self.msn & Psn::MASK,
                },
            };
            return;
        }
        if self.responses.len() >= MAX_PENDING_RESPONSES {
            // A newer ACK covers an older one; drop the oldest plain ACK.
            if let Some(i) = self
                .responses
                .iter()
                .position(|r| matches!(r.aeth.kind, AethKind::Ack { .. }))
            {
                self.responses.remove(i);
            } else {
                self.responses.pop_front();
            }
        }
        self.responses.push_back(Response {
            psn,
            aeth: AethRepr {
                kind,
                msn: self.msn & Psn::MASK,
            },
        });
    }

    fn on_request(&mut self, now: Instant, pkt: &Packet<'_>) {
        let bth = pkt.repr.bth;
        let d = bth.psn.diff(self.epsn);
        if d < 0 {
            self.counters.duplicates_received += 1;
            // A resend means the requester is waiting: answer now.
            if bth.ack_req {
                self.respond_ack(now, self.epsn.sub(1), true);
            }
            return;
        }
        if d > 0 {
            if !self.nak_outstanding {
                self.nak_outstanding = true;
                self.counters.seq_naks_sent += 1;
                self.respond(self.epsn, AethKind::Nak(NakCode::PsnSequenceError));
            }
            return;
        }
        let mtu = self.path.map_or(1024, |p| p.mtu.bytes());
        let op = bth.opcode;
        let len = pkt.payload.len();
        let sequence_ok = self.in_message != op.starts_message();
        let length_ok = match op {
            Opcode::SendFirst | Opcode::SendMiddle => len == mtu,
            Opcode::SendLast | Opcode::SendLastImm => (1..=mtu).contains(&len),
            Opcode::SendOnly | Opcode::SendOnlyImm => len <= mtu,
            // WRITE, READ, atomics: NAKed at their PSN as invalid requests
            // (rxe: `check_op_valid`, class C), even inside a SEND message.
            Opcode::Ack | Opcode::UnsupportedRequest(_) => false,
        };
        if !sequence_ok || !length_ok {
            let cause = if let Opcode::UnsupportedRequest(opcode) = op {
                self.counters.unsupported_requests += 1;
                tracing::debug!(
                    qpn = self.qpn.value(),
                    opcode,
                    "peer's RC request not carried out: NAK invalid request"
                );
                PeerRequestError::Unsupported(opcode)
            } else {
                PeerRequestError::MalformedSend
            };
            self.peer_request_error = Some(cause);
            self.enter_error(None);
            self.respond(bth.psn, AethKind::Nak(NakCode::InvalidRequest));
            return;
        }
        if op.starts_message() {
            if self.rq.is_empty() {
                // Later packets of this burst are dropped silently (no sequence
                // NAK) so the requester's RNR wait is not cut short.
                self.nak_outstanding = true;
                self.counters.rnr_naks_sent += 1;
                self.respond(
                    bth.psn,
                    AethKind::RnrNak {
                        timer: self.min_rnr_timer,
                    },
                );
                return;
            }
            self.msg_offset = 0;
        }
        self.nak_outstanding = false;
        let recv = self
            .rq
            .front()
            .expect("a receive is posted for this message");
        if self.msg_offset + len > recv.len {
            let wr_id = recv.wr_id;
            self.rq.pop_front();
            self.push_error(CqSide::Recv, wr_id, WcStatus::LocLenErr);
            self.enter_error(None);
            self.respond(bth.psn, AethKind::Nak(NakCode::InvalidRequest));
            return;
        }
        if op.ends_message() && self.recv_cq_full {
            // Its completion would be lost: the message is refused, never
            // ACKed; what came before keeps its ACKs. The requester's WR
            // ends REM_OP_ERR (rxe errs the QP and stays silent instead).
            self.counters.recv_cq_full_refusals += 1;
            self.enter_error(None);
            self.respond(bth.psn, AethKind::Nak(NakCode::RemoteOperationalError));
            return;
        }
        scatter(&recv.segs, self.msg_offset, pkt.payload);
        self.msg_offset += len;
        self.epsn = self.epsn.add(1);
        self.psns_since_ack = self.psns_since_ack.saturating_add(1);
        self.in_message = !op.ends_message();
        if op.ends_message() {
            self.msn = self.msn.wrapping_add(1);
            let recv = self.rq.pop_front().expect("front exists");
            self.rq_head_cold = true;
            let wc = WorkCompletion {
                wr_id: recv.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::Recv,
                byte_len: self.msg_offset as u32,
                imm: pkt.repr.imm,
                qp_num: self.qpn,
            };
            self.completions.push_back((CqSide::Recv, wc));
        }
        if bth.ack_req {
            self.respond_ack(now, bth.psn, false);
        }
    }

    // ---- errors -----------------------------------------------------------

    /// An error completion: only wr_id, status and qp_num are meaningful, so
    /// the rest is scrambled to catch callers that read it.
    fn push_error(&mut self, side: CqSide, wr_id: u64, status: WcStatus) {
        let opcode = if self.rng.random() {
            WcOpcode::Send
        } else {
            WcOpcode::Recv
        };
        let wc = WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: self.rng.random(),
            imm: self.rng.random::<bool>().then(|| self.rng.random()),
            qp_num: self.qpn,
        };
        self.completions.push_back((side, wc));
    }

    fn push_flush(&mut self, side: CqSide, wr_id: u64) {
        self.push_error(side, wr_id, WcStatus::WrFlushErr);
    }

    /// First error: the front send WR gets `status` (when given), everything
    /// else flushes, in order. Later posts flush at once.
    fn enter_error(&mut self, status: Option<WcStatus>) {
        if self.state == QpState::Err {
            return;
        }
        self.state = QpState::Err;
        self.timers = TimerTable::default();
        // ACKs for what was received stay owed (their receives completed;
        // the sender must not retry into a dead QP), now unheld.
        self.responses
            .retain(|r| matches!(r.aeth.kind, AethKind::Ack { .. }));
        let mut first = status;
        while let Some(wqe) = self.sq.pop_front() {
            match first.take() {
                Some(s) => self.push_error(CqSide::Send, wqe.wr_id, s),
                None => self.push_flush(CqSide::Send, wqe.wr_id),
            }
        }
        while let Some(wqe) = self.rq.pop_front() {
            self.push_flush(CqSide::Recv, wqe.wr_id);
        }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
