//! One soft RC queue pair against a hostile peer, in virtual time.
//!
//! ```text
//!  fuzzer ─ Action ─► post_send / post_recv / modify_to_error
//!                   ├► structured packet (valid headers, fuzzed PSN, opcode,
//!                   │  length, QPN, AETH; optional byte flip; ICRC right or not)
//!                   ├► raw datagram
//!                   └► advance the clock ─► handle_timeout
//!  after each action: drain poll_transmit, poll both CQs, check invariants
//! ```
//!
//! Invariants: no panic; every datagram out is addressed to the peer, parses
//! under the path's ICRC context, names the peer's QPN and fits the MTU; one
//! drain emits a bounded number of packets (no livelock); completions name
//! only posted WRs, each at most once, in posting order per queue; a send
//! completes successfully only after its last packet went out; a receive
//! never reports more bytes than its buffer; in ERR every receive and every
//! signaled send has completed and no timer is armed; CQs never overrun.
#![no_main]

use std::collections::BTreeSet;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use qpmux::verbs::soft::fuzzing;
use qpmux::verbs::soft::wire::{
    AethRepr, BthRepr, DEFAULT_PKEY, ICRC_LEN, IcrcContext, MAX_OVERHEAD, Opcode, Packet,
    PacketRepr, icrc,
};
use qpmux::verbs::soft::{Instant, SoftCq, SoftDevice, SoftMr, SoftQp};
use qpmux::verbs::{
    AccessFlags, CompletionQueue, Device, Gid, InitAttr, Mtu, Psn, QpCaps, QpState, QueuePair,
    RecvWr, RtrAttr, RtsAttr, SendOpcode, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

const MTU: Mtu = Mtu::Mtu256;
const PORT: u16 = 4791;
const PEER_QPN: u32 = 0x200;
const MR_LEN: usize = 8 << 10;
const SEND_DEPTH: usize = 16;
const RECV_DEPTH: usize = 16;
const CQ_DEPTH: usize = 4096;
const STEPS_CAP: usize = 256;
/// Most packets one drain may emit: a full window of requests plus every
/// queued response, with room to spare; more means a livelock.
const DRAIN_CAP: usize = 128 + 16 + 64;

#[derive(Arbitrary, Debug)]
struct Input {
    seed: u64,
    peer_psn: u32,
    min_rnr_timer: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    actions: Vec<Action>,
}

#[derive(Arbitrary, Debug)]
enum PsnChoice {
    /// The next PSN the harness means to send (advances it).
    Next,
    /// Ahead of it (a gap).
    Ahead(u8),
    /// Behind it (a duplicate).
    Behind(u8),
    /// Anywhere.
    Raw(u32),
}

#[derive(Arbitrary, Debug)]
enum AckPsn {
    /// The last request PSN the QP sent, plus or minus a little.
    LastSent(i8),
    /// Anywhere.
    Raw(u32),
}

#[derive(Arbitrary, Debug)]
struct Tamper {
    /// QPN other than ours (else ours).
    qpn: Option<u32>,
    /// XOR one byte after emission.
    flip: Option<(u16, u8)>,
    /// Recompute the ICRC after the flip (so later checks see it).
    fix_icrc: bool,
    /// Arrive from another port (the ICRC context then differs).
    wrong_port: bool,
}

#[derive(Arbitrary, Debug)]
enum Action {
    PostRecv {
        len: u16,
        sges: u8,
    },
    PostSend {
        len: u16,
        sges: u8,
        imm: Option<u32>,
        signaled: bool,
        inline: bool,
    },
    Request {
        opcode: u8,
        psn: PsnChoice,
        payload: u16,
        ack_req: bool,
        imm: u32,
        tamper: Tamper,
    },
    Response {
        syndrome: u8,
        psn: AckPsn,
        msn: u32,
        tamper: Tamper,
    },
    Raw(Vec<u8>),
    Advance(u32),
    AdvanceToTimer,
    ToError,
}

const REQUEST_OPCODES: [Opcode; 8] = [
    Opcode::SendFirst,
    Opcode::SendMiddle,
    Opcode::SendLast,
    Opcode::SendLastImm,
    Opcode::SendOnly,
    Opcode::SendOnlyImm,
    // RDMA WRITE Only and READ request: NAKed, and the QP errs.
    Opcode::UnsupportedRequest(0x0a),
    Opcode::UnsupportedRequest(0x0c),
];

fn gid(n: u8) -> Gid {
    Gid::from_ipv4([10, 0, 0, n].into())
}

struct Harness {
    dev: SoftDevice,
    _pd: <SoftDevice as Device>::Pd,
    mr: SoftMr,
    send_cq: SoftCq,
    recv_cq: SoftCq,
    qp: SoftQp,
    now: Instant,
    /// Peer → QP ICRC context.
    rx_ctx: IcrcContext,
    /// QP → peer ICRC context.
    tx_ctx: IcrcContext,
    peer_next: Psn,
    last_sent: Option<Psn>,
    /// Sends in posting order: (wr_id, signaled).
    sends: Vec<(u64, bool)>,
    /// Receives in posting order: (wr_id, buffer length).
    recvs: Vec<(u64, usize)>,
    next_send_done: usize,
    next_recv_done: usize,
    completed_sends: BTreeSet<u64>,
    /// PSNs of message-ending request packets the QP sent.
    ends_sent: BTreeSet<u32>,
    /// Message-ending requests the harness handed in (an upper bound on
    /// successful receives).
    ends_delivered: usize,
    recv_successes: usize,
    buf: Vec<u8>,
}

impl Harness {
    fn new(input: &Input) -> Harness {
        let dev = fuzzing::device(gid(1), PORT, MTU, input.seed);
        let pd = dev.alloc_pd().expect("pd");
        let access = AccessFlags::LOCAL_READ | AccessFlags::LOCAL_WRITE;
        let mr = dev.reg_mr(&pd, MR_LEN, access).expect("mr");
        let send_cq = dev.create_cq(CQ_DEPTH).expect("cq");
        let recv_cq = dev.create_cq(CQ_DEPTH).expect("cq");
        let caps = QpCaps {
            max_send_wr: SEND_DEPTH,
            max_recv_wr: RECV_DEPTH,
            max_sge: 4,
            max_inline_data: 64,
        };
        let qp = dev.create_qp(&pd, &send_cq, &recv_cq, caps).expect("qp");
        let peer_next = Psn::new(input.peer_psn & Psn::MASK);
        qp.modify_to_init(InitAttr {
            access: AccessFlags::LOCAL_WRITE,
        })
        .expect("init");
        qp.modify_to_rtr(RtrAttr {
            path_mtu: MTU,
            dest_qpn: qpmux::verbs::Qpn::new(PEER_QPN),
            rq_psn: peer_next,
            remote_gid: gid(2),
            remote_udp_port: PORT,
            min_rnr_timer: input.min_rnr_timer % 32,
        })
        .expect("rtr");
        qp.modify_to_rts(RtsAttr {
            sq_psn: qp.initial_psn(),
            timeout: input.timeout % 32,
            retry_cnt: input.retry_cnt % 8,
            rnr_retry: input.rnr_retry % 8,
        })
        .expect("rts");
        let rx_ctx = IcrcContext {
            src: gid(2),
            dst: gid(1),
            src_port: PORT,
            dst_port: PORT,
        };
        let tx_ctx = IcrcContext {
            src: gid(1),
            dst: gid(2),
            src_port: PORT,
            dst_port: PORT,
        };
        Harness {
            dev,
            _pd: pd,
            mr,
            send_cq,
            recv_cq,
            qp,
            now: Instant::ZERO,
            rx_ctx,
            tx_ctx,
            peer_next,
            last_sent: None,
            sends: Vec::new(),
            recvs: Vec::new(),
            next_send_done: 0,
            next_recv_done: 0,
            completed_sends: BTreeSet::new(),
            ends_sent: BTreeSet::new(),
            ends_delivered: 0,
            recv_successes: 0,
            buf: vec![0; MTU.bytes() + MAX_OVERHEAD],
        }
    }

    fn sg_list(&self, len: usize, sges: u8) -> Vec<Sge<'_, SoftMr>> {
        let n = usize::from(sges % 4) + 1;
        let len = len % (MR_LEN + 1);
        let each = len / n;
        (0..n)
            .map(|i| Sge {
                mr: &self.mr,
                offset: i * each,
                len: if i + 1 == n { len - i * each } else { each },
            })
            .collect()
    }

    fn post_recv(&mut self, len: u16, sges: u8) {
        let wr_id = (1 << 32) | self.recvs.len() as u64;
        let sg = self.sg_list(usize::from(len), sges);
        let total = sg.iter().map(|s| s.len).sum();
        let r = self.qp.post_recv(&[RecvWr {
            wr_id,
            sg_list: &sg,
        }]);
        if r.is_ok() {
            self.recvs.push((wr_id, total));
        }
    }

    fn post_send(&mut self, len: u16, sges: u8, imm: Option<u32>, signaled: bool, inline: bool) {
        let wr_id = self.sends.len() as u64;
        let sg = self.sg_list(usize::from(len), sges);
        let wr = SendWr {
            wr_id,
            opcode: imm.map_or(SendOpcode::Send, SendOpcode::SendWithImm),
            sg_list: &sg,
            signaled,
            inline,
        };
        if self.qp.post_send(&[wr]).is_ok() {
            self.sends.push((wr_id, signaled));
        }
    }

    /// Emits `repr` + `payload` as the peer would, then tampers with it.
    fn deliver(&mut self, mut repr: PacketRepr, payload: &[u8], tamper: &Tamper) {
        if let Some(qpn) = tamper.qpn {
            repr.bth.dest_qp = qpmux::verbs::Qpn::new(qpn & 0x00ff_ffff);
        }
        let mut bytes = vec![0u8; repr.header_len() + payload.len() + 3 + ICRC_LEN];
        let n = repr.emit(&self.rx_ctx, payload, &mut bytes);
        bytes.truncate(n);
        if let Some((at, xor)) = tamper.flip {
            let at = usize::from(at) % bytes.len();
            bytes[at] ^= xor;
            if tamper.fix_icrc {
                let end = bytes.len() - ICRC_LEN;
                let crc = icrc(&self.rx_ctx, &bytes[..end]);
                bytes[end..].copy_from_slice(&crc.to_le_bytes());
            }
        }
        let untouched = tamper.qpn.is_none() && tamper.flip.is_none() && !tamper.wrong_port;
        if untouched && repr.bth.opcode.ends_message() && repr.aeth.is_none() {
            self.ends_delivered += 1;
        } else if !untouched {
            // A flipped byte may turn any packet into a message end.
            self.ends_delivered += 1;
        }
        let port = if tamper.wrong_port { PORT + 1 } else { PORT };
        fuzzing::handle_datagram(&self.dev, self.now, gid(2), port, &bytes);
    }

    fn request(
        &mut self,
        opcode: u8,
        psn: &PsnChoice,
        payload: u16,
        ack_req: bool,
        imm: u32,
    ) -> (PacketRepr, Vec<u8>) {
        let opcode = REQUEST_OPCODES[usize::from(opcode) % REQUEST_OPCODES.len()];
        let psn = match psn {
            PsnChoice::Next => {
                let p = self.peer_next;
                self.peer_next = p.add(1);
                p
            }
            PsnChoice::Ahead(d) => self.peer_next.add(u32::from(*d) + 1),
            PsnChoice::Behind(d) => self.peer_next.sub(u32::from(*d) + 1),
            PsnChoice::Raw(p) => Psn::new(p & Psn::MASK),
        };
        let repr = PacketRepr {
            bth: BthRepr {
                opcode,
                solicited: false,
                mig_req: true,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                dest_qp: qpmux::verbs::Qpn::new(self.qp.qp_num().value()),
                ack_req,
                psn,
            },
            aeth: None,
            imm: opcode.has_imm().then_some(imm),
        };
        // Up to two MTUs, so too-long packets are reachable.
        let len = usize::from(payload) % (2 * MTU.bytes() + 1);
        (repr, vec![0x5a; len])
    }

    fn response(&self, syndrome: u8, psn: &AckPsn, msn: u32) -> Option<PacketRepr> {
        let psn = match psn {
            AckPsn::LastSent(d) => {
                let base = self.last_sent.unwrap_or(self.qp.initial_psn());
                if *d >= 0 {
                    base.add(*d as u32)
                } else {
                    base.sub(d.unsigned_abs().into())
                }
            }
            AckPsn::Raw(p) => Psn::new(p & Psn::MASK),
        };
        // Only syndromes the parser accepts can be emitted.
        let mut aeth_bytes = [syndrome, 0, 0, 0];
        aeth_bytes[1..].copy_from_slice(&(msn & Psn::MASK).to_be_bytes()[1..]);
        let aeth = qpmux::verbs::soft::wire::Aeth::new_checked(&aeth_bytes[..]).ok()?;
        let aeth = AethRepr::parse(&aeth).ok()?;
        Some(PacketRepr {
            bth: BthRepr {
                opcode: Opcode::Ack,
                solicited: false,
                mig_req: true,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                dest_qp: self.qp.qp_num(),
                ack_req: false,
                psn,
            },
            aeth: Some(aeth),
            imm: None,
        })
    }

    fn act(&mut self, action: &Action) {
        match action {
            Action::PostRecv { len, sges } => self.post_recv(*len, *sges),
            Action::PostSend {
                len,
                sges,
                imm,
                signaled,
                inline,
            } => self.post_send(*len, *sges, *imm, *signaled, *inline),
            Action::Request {
                opcode,
                psn,
                payload,
                ack_req,
                imm,
                tamper,
            } => {
                let (repr, payload) = self.request(*opcode, psn, *payload, *ack_req, *imm);
                self.deliver(repr, &payload, tamper);
            }
            Action::Response {
                syndrome,
                psn,
                msn,
                tamper,
            } => {
                if let Some(repr) = self.response(*syndrome, psn, *msn) {
                    self.deliver(repr, &[], tamper);
                }
            }
            Action::Raw(bytes) => {
                fuzzing::handle_datagram(&self.dev, self.now, gid(2), PORT, bytes);
                // Raw bytes may happen to form a valid message end.
                self.ends_delivered += 1;
            }
            Action::Advance(micros) => {
                self.now = self.now + Duration::from_micros(u64::from(*micros));
            }
            Action::AdvanceToTimer => {
                if let Some(t) = fuzzing::poll_timeout(&self.dev) {
                    self.now = self.now.max(t);
                }
            }
            Action::ToError => {
                self.qp.modify_to_error().expect("to error");
            }
        }
        fuzzing::handle_timeout(&self.dev, self.now);
        self.drain();
        self.check_completions();
        self.check_error_state();
    }

    fn drain(&mut self) {
        let mut emitted = 0;
        while let Some(d) = fuzzing::poll_transmit(&self.dev, self.now, &mut self.buf) {
            emitted += 1;
            assert!(emitted <= DRAIN_CAP, "poll_transmit does not run dry");
            assert_eq!((d.dst, d.dst_port), (gid(2), PORT));
            let pkt = Packet::parse(&self.tx_ctx, &self.buf[..d.len]).expect("own packet parses");
            let bth = pkt.repr.bth;
            assert_eq!(bth.dest_qp.value(), PEER_QPN);
            assert!(pkt.payload.len() <= MTU.bytes());
            if bth.opcode != Opcode::Ack {
                self.last_sent = Some(bth.psn);
                if bth.opcode.ends_message() {
                    self.ends_sent.insert(bth.psn.value());
                }
            }
        }
    }

    fn check_completions(&mut self) {
        let mut wcs = [WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm: None,
            qp_num: self.qp.qp_num(),
        }; 64];
        loop {
            let n = self.send_cq.poll(&mut wcs).expect("send CQ never overruns");
            for wc in &wcs[..n] {
                assert_eq!(wc.qp_num, self.qp.qp_num());
                let index = usize::try_from(wc.wr_id).expect("small");
                assert!(index < self.sends.len(), "completion for an unposted send");
                assert!(
                    index >= self.next_send_done,
                    "send completed twice or out of order"
                );
                assert!(self.completed_sends.insert(wc.wr_id));
                self.next_send_done = index + 1;
                if wc.status == WcStatus::Success {
                    assert!(self.sends[index].1, "unsignaled send reported");
                    assert_eq!(wc.opcode, WcOpcode::Send);
                    assert!(
                        self.ends_sent.len() > index,
                        "send {index} completed before its last packet went out"
                    );
                }
            }
            if n == 0 {
                break;
            }
        }
        loop {
            let n = self.recv_cq.poll(&mut wcs).expect("recv CQ never overruns");
            for wc in &wcs[..n] {
                assert_eq!(wc.qp_num, self.qp.qp_num());
                let index = (wc.wr_id & 0xffff_ffff) as usize;
                assert_eq!(wc.wr_id >> 32, 1, "not a receive wr_id");
                assert!(
                    index < self.recvs.len(),
                    "completion for an unposted receive"
                );
                assert_eq!(
                    index, self.next_recv_done,
                    "receives complete in order, once"
                );
                self.next_recv_done += 1;
                if wc.status == WcStatus::Success {
                    assert_eq!(wc.opcode, WcOpcode::Recv);
                    assert!(wc.byte_len as usize <= self.recvs[index].1);
                    self.recv_successes += 1;
                    assert!(self.recv_successes <= self.ends_delivered);
                }
            }
            if n == 0 {
                break;
            }
        }
    }

    fn check_error_state(&self) {
        if self.qp.state() != QpState::Err {
            return;
        }
        assert_eq!(self.next_recv_done, self.recvs.len(), "ERR left a receive");
        for (wr_id, signaled) in &self.sends {
            if *signaled {
                assert!(self.completed_sends.contains(wr_id), "ERR left a send");
            }
        }
        assert!(
            fuzzing::poll_timeout(&self.dev).is_none(),
            "timer armed in ERR"
        );
    }
}

fuzz_target!(|input: Input| {
    let mut h = Harness::new(&input);
    for action in input.actions.iter().take(STEPS_CAP) {
        h.act(action);
    }
    if trace_on() {
        let c = h.qp.counters();
        let mut reached = Vec::new();
        for (name, hit) in [
            ("recv_ok", h.recv_successes > 0),
            (
                "send_ok",
                h.sends
                    .iter()
                    .any(|(id, s)| *s && h.completed_sends.contains(id)),
            ),
            ("err", h.qp.state() == QpState::Err),
            ("rnr_nak_sent", c.rnr_naks_sent > 0),
            ("rnr_nak_received", c.rnr_naks_received > 0),
            ("seq_nak_sent", c.seq_naks_sent > 0),
            ("rewind", c.retransmit_rewinds > 0),
            ("ack_timeout", c.ack_timeouts > 0),
            ("duplicate", c.duplicates_received > 0),
            ("request_out", h.last_sent.is_some()),
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
