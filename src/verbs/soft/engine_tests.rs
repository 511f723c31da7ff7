//! One-QP and two-QP engine tests with explicit virtual times.

use std::net::Ipv4Addr;

use super::*;
use crate::verbs::{Gid, Mtu};

const MTU: Mtu = Mtu::Mtu256;

struct Side {
    qp: QpEngine,
    mem: Arc<MrMem>,
}

/// Two engines wired back to back; packets move only when a test says so.
struct Pair {
    a: Side,
    b: Side,
    now: Instant,
    buf: Vec<u8>,
}

fn gid(n: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, n))
}

fn ctx(from: u8, to: u8) -> IcrcContext {
    IcrcContext {
        src: gid(from),
        dst: gid(to),
        src_port: 4791,
        dst_port: 4791,
    }
}

impl Pair {
    fn new(rts: RtsAttr, min_rnr_timer: u8) -> Pair {
        Pair::with_ack_delay(rts, min_rnr_timer, Duration::ZERO)
    }

    fn with_ack_delay(rts: RtsAttr, min_rnr_timer: u8, ack_delay: Duration) -> Pair {
        let caps = QpCaps {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_sge: 4,
            max_inline_data: 64,
        };
        let mut a = QpEngine::new(Qpn::new(0x100), caps, 1, ack_delay);
        let mut b = QpEngine::new(Qpn::new(0x200), caps, 2, ack_delay);
        let (psn_a, psn_b) = (Psn::new(0xff_fff0), Psn::new(77));
        for (qp, peer, me, other, psn_in, psn_out) in [
            (&mut a, Qpn::new(0x200), 1, 2, psn_b, psn_a),
            (&mut b, Qpn::new(0x100), 2, 1, psn_a, psn_b),
        ] {
            qp.modify_to_init().expect("init");
            let rtr = RtrAttr {
                path_mtu: MTU,
                dest_qpn: peer,
                rq_psn: psn_in,
                remote_gid: gid(other),
                remote_udp_port: 4791,
                min_rnr_timer,
            };
            qp.modify_to_rtr(&rtr, ctx(me, other)).expect("rtr");
            qp.modify_to_rts(&RtsAttr {
                sq_psn: psn_out,
                ..rts
            })
            .expect("rts");
        }
        Pair {
            a: Side {
                qp: a,
                mem: Arc::new(MrMem::new(1 << 20)),
            },
            b: Side {
                qp: b,
                mem: Arc::new(MrMem::new(1 << 20)),
            },
            now: Instant::ZERO,
            buf: vec![0; 8192],
        }
    }

    fn send(&mut self, wr_id: u64, len: usize) {
        let segs = vec![Segment::Mr {
            mem: self.a.mem.clone(),
            offset: 0,
            len,
        }];
        self.a
            .qp
            .post_send(SendWqe::new(wr_id, None, segs, true))
            .expect("post_send");
    }

    fn recv(&mut self, wr_id: u64, len: usize) {
        let segs = vec![Segment::Mr {
            mem: self.b.mem.clone(),
            offset: 0,
            len,
        }];
        self.b
            .qp
            .post_recv(RecvWqe::new(wr_id, segs))
            .expect("post_recv");
    }

    /// Everything A would transmit now.
    fn transmit_a(&mut self) -> Vec<Vec<u8>> {
        Pair::transmit(&mut self.a.qp, self.now, &mut self.buf)
    }

    fn transmit_b(&mut self) -> Vec<Vec<u8>> {
        Pair::transmit(&mut self.b.qp, self.now, &mut self.buf)
    }

    /// Everything `qp` would transmit now; `wants_transmit` must agree
    /// before every packet and after the last.
    fn transmit(qp: &mut QpEngine, now: Instant, buf: &mut [u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            let wants = qp.wants_transmit();
            let Some(n) = qp.poll_transmit(now, buf) else {
                assert!(!wants, "wants_transmit promised a packet");
                return out;
            };
            assert!(wants, "a packet that wants_transmit did not announce");
            out.push(buf[..n].to_vec());
        }
    }

    fn deliver_b(&mut self, pkts: &[Vec<u8>]) {
        for p in pkts {
            let pkt = Packet::parse(&ctx(1, 2), p).expect("A's packet parses");
            self.b.qp.handle_packet(self.now, &pkt);
        }
    }

    fn deliver_a(&mut self, pkts: &[Vec<u8>]) {
        for p in pkts {
            let pkt = Packet::parse(&ctx(2, 1), p).expect("B's packet parses");
            self.a.qp.handle_packet(self.now, &pkt);
        }
    }

    /// Jump to A's next timer and fire it.
    fn fire_a_timer(&mut self) -> Instant {
        let t = self.a.qp.poll_timeout().expect("a timer is armed");
        self.now = t;
        self.a.qp.handle_timeout(t);
        t
    }

    fn completions(qp: &mut QpEngine) -> Vec<(CqSide, WorkCompletion)> {
        std::iter::from_fn(|| qp.poll_completion()).collect()
    }

    /// Each completion's WR id and status, in order.
    fn statuses(qp: &mut QpEngine) -> Vec<(u64, WcStatus)> {
        Pair::completions(qp)
            .into_iter()
            .map(|(_, wc)| (wc.wr_id, wc.status))
            .collect()
    }
}

fn rts(timeout: u8, retry_cnt: u8, rnr_retry: u8) -> RtsAttr {
    RtsAttr {
        sq_psn: Psn::new(0),
        timeout,
        retry_cnt,
        rnr_retry,
    }
}

fn parse(p: &[u8]) -> PacketRepr {
    Packet::parse(&ctx(1, 2), p)
        .or_else(|_| Packet::parse(&ctx(2, 1), p))
        .expect("parses")
        .repr
}

#[test]
fn ack_requested_on_last_packet_and_every_64_with_at_most_128_unacked() {
    let mut p = Pair::new(rts(14, 7, 7), 12);
    p.recv(1, 1 << 20);
    p.send(1, 200 * MTU.bytes());
    let first = p.transmit_a();
    assert_eq!(
        first.len(),
        MAX_UNACKED as usize,
        "window of 128 unacked PSNs"
    );
    let areq: Vec<usize> = first
        .iter()
        .enumerate()
        .filter(|(_, b)| parse(b).bth.ack_req)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(areq, [63, 127]);
    // PSNs wrap from 0xffffff to 0 inside the message.
    assert_eq!(parse(&first[15]).bth.psn, Psn::new(0xff_ffff));
    assert_eq!(parse(&first[16]).bth.psn, Psn::new(0));
    p.deliver_b(&first);
    let acks = p.transmit_b();
    assert_eq!(
        acks.len(),
        1,
        "the second A-bit packet's ACK covers the first's"
    );
    assert_eq!(parse(&acks[0]).bth.psn, parse(&first[127]).bth.psn);
    p.deliver_a(&acks);
    let rest = p.transmit_a();
    assert_eq!(rest.len(), 72);
    assert_eq!(parse(&rest[0]).bth.opcode, Opcode::SendMiddle);
    assert_eq!(parse(&rest[71]).bth.opcode, Opcode::SendLast);
    let areq: Vec<usize> = rest
        .iter()
        .enumerate()
        .filter(|(_, b)| parse(b).bth.ack_req)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(areq, [63, 71]);
    p.deliver_b(&rest);
    let acks = p.transmit_b();
    p.deliver_a(&acks);
    let a = Pair::completions(&mut p.a.qp);
    let b = Pair::completions(&mut p.b.qp);
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].1.status, WcStatus::Success);
    assert_eq!(b[0].1.byte_len as usize, 200 * MTU.bytes());
    assert_eq!(p.a.qp.poll_timeout(), None, "nothing outstanding, no timer");
}

#[test]
fn one_nak_per_sequence_error_and_duplicates_are_reacked_not_redelivered() {
    let mut p = Pair::new(rts(14, 7, 7), 12);
    for i in 0..3 {
        p.recv(i, 64);
        p.send(i, 8);
    }
    let pkts = p.transmit_a();
    assert_eq!(pkts.len(), 3);
    p.deliver_b(&pkts[1..]);
    let naks = p.transmit_b();
    assert_eq!(naks.len(), 1, "one NAK for the whole gap");
    let nak = parse(&naks[0]);
    assert_eq!(
        nak.aeth.map(|a| a.kind),
        Some(AethKind::Nak(NakCode::PsnSequenceError))
    );
    assert_eq!(
        nak.bth.psn,
        parse(&pkts[0]).bth.psn,
        "NAK names the expected PSN"
    );
    // The requester goes back N on the NAK.
    p.deliver_a(&naks);
    let resent = p.transmit_a();
    assert_eq!(resent, pkts, "go-back-N resends the same packets");
    p.deliver_a(&naks);
    assert!(
        p.transmit_a().is_empty(),
        "a duplicated NAK does not rewind again"
    );
    p.deliver_b(&resent);
    assert_eq!(Pair::completions(&mut p.b.qp).len(), 3);
    let acks = p.transmit_b();
    assert_eq!(acks.len(), 1, "one ACK covers the three");
    assert_eq!(parse(&acks[0]).bth.psn, parse(&pkts[2]).bth.psn);
    assert_eq!(parse(&acks[0]).aeth.map(|a| a.msn), Some(3));
    // A duplicate is ACKed again but not delivered again.
    p.deliver_b(&pkts[..1]);
    let reack = p.transmit_b();
    assert_eq!(reack.len(), 1);
    assert_eq!(
        parse(&reack[0]).aeth.map(|a| a.kind),
        Some(AethKind::Ack { credit: 0x1f })
    );
    assert!(Pair::completions(&mut p.b.qp).is_empty());
    assert_eq!(p.b.qp.counters.duplicates_received, 1);
}

/// An RDMA WRITE Only from A at `psn`, as a peer that writes without
/// asking would send it: a RETH (a nonzero VA) and data, one MTU in all,
/// the length a SEND Middle would have.
fn rdma_write_from_a(psn: Psn, like: &[u8]) -> Vec<u8> {
    let mut repr = parse(like);
    repr.bth.opcode = Opcode::UnsupportedRequest(0x0a);
    repr.bth.psn = psn;
    repr.imm = None;
    let data = MTU.bytes() - 16;
    let mut payload = vec![0; 16]; // RETH: VA, rkey, DMA length
    payload[..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_be_bytes());
    payload[12..].copy_from_slice(&(data as u32).to_be_bytes());
    payload.extend(std::iter::repeat_n(0xab, data));
    let mut buf = vec![0; repr.header_len() + payload.len() + 7];
    let n = repr.emit(&ctx(1, 2), &payload, &mut buf);
    buf.truncate(n);
    buf
}

#[test]
fn an_rdma_write_is_naked_as_an_invalid_request_at_its_psn_only() {
    let mut p = Pair::new(rts(14, 7, 7), 12);
    for i in 0..3 {
        p.recv(i, 64);
        p.send(i, 8);
    }
    let pkts = p.transmit_a();
    let psns: Vec<Psn> = pkts.iter().map(|b| parse(b).bth.psn).collect();
    let write = rdma_write_from_a(psns[1], &pkts[1]);
    // Ahead of the expected PSN it is a gap, as any request would be.
    p.deliver_b(std::slice::from_ref(&write));
    assert_eq!(
        kinds(&p.transmit_b()),
        [(Some(AethKind::Nak(NakCode::PsnSequenceError)), psns[0])]
    );
    p.deliver_b(&pkts[..1]);
    assert_eq!(kinds(&p.transmit_b()), [(ACK, psns[0])]);
    let first: Vec<_> = Pair::completions(&mut p.b.qp)
        .into_iter()
        .map(|(_, wc)| (wc.wr_id, wc.status, wc.byte_len))
        .collect();
    assert_eq!(first, [(0, WcStatus::Success, 8)]);
    // Behind it, a duplicate: ACKed again, nothing written, the QP goes on.
    p.deliver_b(&[rdma_write_from_a(psns[0], &pkts[0])]);
    assert_eq!(kinds(&p.transmit_b()), [(ACK, psns[0])]);
    assert_eq!(p.b.qp.state(), QpState::Rts);
    assert!(Pair::completions(&mut p.b.qp).is_empty());
    assert_eq!(p.b.qp.counters.unsupported_requests, 0);
    assert_eq!(p.b.qp.peer_request_error(), None);
    // At it: NAK invalid request, and the responder's QP errs (class C).
    p.deliver_b(&[write]);
    let answers = p.transmit_b();
    assert_eq!(
        kinds(&answers),
        [(Some(AethKind::Nak(NakCode::InvalidRequest)), psns[1])]
    );
    assert_eq!(p.b.qp.state(), QpState::Err);
    assert_eq!(p.b.qp.counters.unsupported_requests, 1);
    assert_eq!(
        p.b.qp.peer_request_error(),
        Some(PeerRequestError::Unsupported(0x0a))
    );
    p.deliver_b(&pkts[2..]);
    assert!(p.transmit_b().is_empty(), "an errored QP answers nothing");
    let received = Pair::statuses(&mut p.b.qp);
    assert_eq!(
        received,
        [(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]
    );
    // The requester whose PSN the WRITE took fails that WR as rxe's would.
    p.deliver_a(&answers);
    let sent = Pair::statuses(&mut p.a.qp);
    assert_eq!(
        sent,
        [
            (0, WcStatus::Success),
            (1, WcStatus::RemInvReqErr),
            (2, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(
        p.a.qp.peer_request_error(),
        None,
        "the requester's QP erred on the NAK, not on a request of B's"
    );
}

/// Inside a SEND message (after its First packet) a WRITE passes the
/// opcode-sequence check; it must still be NAKed, not taken as the SEND's
/// Middle.
#[test]
fn an_rdma_write_inside_a_send_message_is_naked_not_scattered() {
    let mut p = Pair::new(rts(14, 7, 7), 12);
    p.recv(0, 4 * MTU.bytes());
    p.send(0, 2 * MTU.bytes() + 8);
    let pkts = p.transmit_a();
    assert_eq!(pkts.len(), 3);
    p.deliver_b(&pkts[..1]);
    let write = rdma_write_from_a(parse(&pkts[1]).bth.psn, &pkts[1]);
    p.deliver_b(&[write]);
    assert_eq!(
        kinds(&p.transmit_b()),
        [(
            Some(AethKind::Nak(NakCode::InvalidRequest)),
            parse(&pkts[1]).bth.psn
        )]
    );
    assert_eq!(p.b.qp.state(), QpState::Err);
    assert_eq!(p.b.qp.counters.unsupported_requests, 1);
    assert_eq!(
        p.b.qp.peer_request_error(),
        Some(PeerRequestError::Unsupported(0x0a))
    );
    let received = Pair::statuses(&mut p.b.qp);
    assert_eq!(received, [(0, WcStatus::WrFlushErr)]);
    let mut landed = [0xffu8; 8];
    p.b.mem.read_into(MTU.bytes(), &mut landed);
    assert_eq!(
        landed, [0; 8],
        "the WRITE's bytes did not land where the SEND's Middle would"
    );
}

/// A SEND packet out of its message's sequence, or of a length its place
/// does not allow, is the peer's malformed request: NAKed invalid, and the
/// QP says why it erred. A QP erred locally, or reset after, says nothing.
#[test]
fn a_malformed_send_errs_the_qp_as_the_peers_request() {
    let mtu = MTU.bytes();
    let reshaped = |opcode: Opcode, len: usize| {
        move |p: &mut Pair| {
            p.recv(0, 4 * mtu);
            p.send(0, 8);
            let mut repr = parse(&p.transmit_a()[0]);
            repr.bth.opcode = opcode;
            repr.imm = None;
            let mut buf = vec![0; repr.header_len() + len + 7];
            let n = repr.emit(&ctx(1, 2), &vec![0x5a; len], &mut buf);
            buf.truncate(n);
            buf
        }
    };
    // A Middle with no First before it; a First shorter than the MTU.
    for make in [
        reshaped(Opcode::SendMiddle, mtu),
        reshaped(Opcode::SendFirst, 8),
    ] {
        let mut p = Pair::new(rts(14, 7, 7), 12);
        let pkt = make(&mut p);
        p.deliver_b(&[pkt]);
        let answers = p.transmit_b();
        assert_eq!(
            answers
                .iter()
                .map(|b| parse(b).aeth.map(|a| a.kind))
                .collect::<Vec<_>>(),
            [Some(AethKind::Nak(NakCode::InvalidRequest))]
        );
        assert_eq!(p.b.qp.state(), QpState::Err);
        assert_eq!(
            p.b.qp.peer_request_error(),
            Some(PeerRequestError::MalformedSend)
        );
        assert_eq!(p.b.qp.counters.unsupported_requests, 0);
        p.b.qp.modify_to_reset();
        assert_eq!(p.b.qp.peer_request_error(), None, "a reset forgets it");
    }
    let mut p = Pair::new(rts(14, 7, 7), 12);
    p.recv(0, 64);
    p.b.qp.modify_to_error();
    assert_eq!(p.b.qp.state(), QpState::Err);
    assert_eq!(p.b.qp.peer_request_error(), None, "erred here, not by A");
}

/// What an honest requester does mid-message never reads as a malformed
/// request: go-back-N from a lost Middle, a duplicate First, a message
/// refused with an RNR NAK and sent again.
#[test]
fn go_back_n_duplicates_and_rnr_mid_message_leave_no_peer_cause() {
    let mtu = MTU.bytes();
    let mut p = Pair::new(rts(14, 7, 7), 12);
    p.recv(0, 4 * mtu);
    p.send(0, 2 * mtu + 8);
    let pkts = p.transmit_a();
    assert_eq!(pkts.len(), 3);
    p.deliver_b(&[pkts[0].clone(), pkts[2].clone()]);
    let nak = p.transmit_b();
    assert_eq!(
        kinds(&nak),
        [(
            Some(AethKind::Nak(NakCode::PsnSequenceError)),
            parse(&pkts[1]).bth.psn
        )]
    );
    p.deliver_a(&nak);
    let resent = p.transmit_a();
    assert_eq!(resent, pkts[1..], "go-back-N from the lost Middle");
    p.deliver_b(&pkts[..1]);
    p.deliver_b(&resent);
    let acks = p.transmit_b();
    p.deliver_a(&acks);
    assert_eq!(Pair::statuses(&mut p.b.qp), [(0, WcStatus::Success)]);
    assert_eq!(Pair::statuses(&mut p.a.qp), [(0, WcStatus::Success)]);
    assert_eq!(p.b.qp.state(), QpState::Rts);
    assert_eq!(p.b.qp.peer_request_error(), None);

    let mut p = Pair::new(rts(14, 7, 7), 12);
    p.send(1, 2 * mtu);
    let first = p.transmit_a();
    p.deliver_b(&first);
    let rnr = p.transmit_b();
    assert_eq!(
        parse(&rnr[0]).aeth.map(|a| a.kind),
        Some(AethKind::RnrNak { timer: 12 })
    );
    p.deliver_a(&rnr);
    p.recv(1, 2 * mtu);
    p.fire_a_timer();
    // The probe, then the rest once an ACK shows progress.
    for _ in 0..3 {
        let pkts = p.transmit_a();
        p.deliver_b(&pkts);
        let acks = p.transmit_b();
        p.deliver_a(&acks);
    }
    assert_eq!(Pair::statuses(&mut p.b.qp), [(1, WcStatus::Success)]);
    assert_eq!(p.b.qp.state(), QpState::Rts);
    assert_eq!(p.b.qp.peer_request_error(), None);
}

#[test]
fn acks_coalesce_between_transmits_but_never_across_a_nak() {
    let mut p = Pair::new(rts(14, 7, 7), 12);
    for i in 0..3 {
        p.recv(i, 64);
        p.send(i, 8);
    }
    let pkts = p.transmit_a();
    let psn = |i: usize| parse(&pkts[i]).bth.psn;
    // Transmitted in between: an ACK per A-bit packet.
    p.deliver_b(&pkts[..1]);
    let one = p.transmit_b();
    assert_eq!(one.len(), 1);
    assert_eq!(parse(&one[0]).bth.psn, psn(0));
    // A gap, then the missing packet and the one after it, in one turn.
    p.deliver_b(&pkts[2..]);
    p.deliver_b(&pkts[1..]);
    let out: Vec<_> = p.transmit_b().iter().map(|b| parse(b)).collect();
    let kinds: Vec<_> = out
        .iter()
        .map(|r| (r.aeth.map(|a| a.kind), r.bth.psn))
        .collect();
    assert_eq!(
        kinds,
        [
            (Some(AethKind::Nak(NakCode::PsnSequenceError)), psn(1)),
            (Some(AethKind::Ack { credit: 0x1f }), psn(2)),
        ],
        "the NAK keeps its place; the two ACKs after it are one"
    );
    assert_eq!(Pair::completions(&mut p.b.qp).len(), 3);
}

/// (AETH kind, PSN) of each packet.
fn kinds(pkts: &[Vec<u8>]) -> Vec<(Option<AethKind>, Psn)> {
    pkts.iter()
        .map(|b| parse(b))
        .map(|r| (r.aeth.map(|a| a.kind), r.bth.psn))
        .collect()
}

const ACK: Option<AethKind> = Some(AethKind::Ack { credit: 0x1f });
const HOLD: Duration = Duration::from_micros(500);

/// A pair whose responder holds ACKs up to [`HOLD`], and the packets of
/// `messages` 8-byte SENDs from A (each with a receive posted at B).
fn held_pair(timeout: u8, messages: u64) -> (Pair, Vec<Vec<u8>>) {
    let mut p = Pair::with_ack_delay(rts(timeout, 7, 7), 12, HOLD);
    for i in 0..messages {
        p.recv(i, 64);
        p.send(i, 8);
    }
    let pkts = p.transmit_a();
    (p, pkts)
}

#[test]
fn a_held_ack_covers_later_packets_and_goes_when_its_timer_fires() {
    let (mut p, pkts) = held_pair(14, 2);
    let start = p.now;
    p.deliver_b(&pkts[..1]);
    assert!(p.transmit_b().is_empty(), "the ACK is held");
    assert_eq!(p.b.qp.poll_timeout(), Some(start + HOLD));
    p.now = start + HOLD / 2;
    p.deliver_b(&pkts[1..]);
    assert!(p.transmit_b().is_empty());
    assert_eq!(p.b.qp.poll_timeout(), Some(start + HOLD), "not pushed back");
    p.now = start + HOLD;
    p.b.qp.handle_timeout(p.now);
    let acks = p.transmit_b();
    assert_eq!(
        kinds(&acks),
        [(ACK, parse(&pkts[1]).bth.psn)],
        "one ACK for both"
    );
    p.deliver_a(&acks);
    let done = Pair::completions(&mut p.a.qp);
    assert_eq!(done.len(), 2);
    assert!(done.iter().all(|(_, wc)| wc.status == WcStatus::Success));
    assert_eq!(Pair::completions(&mut p.b.qp).len(), 2);
}

#[test]
fn an_ack_after_a_queued_nak_does_not_hold_it_back() {
    let (mut p, pkts) = held_pair(14, 3);
    // One receive turn: the first request (its ACK held), the third (out of
    // order: a sequence NAK, which releases the hold), then the second.
    p.deliver_b(&pkts[..1]);
    p.deliver_b(&pkts[2..]);
    p.deliver_b(&pkts[1..2]);
    assert_eq!(
        kinds(&p.transmit_b()),
        [
            (ACK, parse(&pkts[0]).bth.psn),
            (
                Some(AethKind::Nak(NakCode::PsnSequenceError)),
                parse(&pkts[1]).bth.psn
            ),
            (ACK, parse(&pkts[1]).bth.psn),
        ],
        "nothing waits out the hold behind the NAK"
    );
}

#[test]
fn a_message_a_full_receive_cq_would_lose_fails_alone_at_its_last_packet() {
    // One single-packet message, then a three-packet one whose last packet
    // finds the receive CQ full; the first message's ACK is being held.
    let mut p = Pair::with_ack_delay(rts(14, 7, 7), 12, HOLD);
    p.recv(1, 64);
    p.recv(2, 4 * MTU.bytes());
    p.send(1, 8);
    p.send(2, 2 * MTU.bytes() + 8);
    let pkts = p.transmit_a();
    assert_eq!(pkts.len(), 4);
    p.deliver_b(&pkts[..3]);
    p.b.qp.set_recv_cq_full(true);
    p.deliver_b(&pkts[3..]);
    let answers = p.transmit_b();
    assert_eq!(
        kinds(&answers),
        [
            (ACK, parse(&pkts[0]).bth.psn),
            (
                Some(AethKind::Nak(NakCode::RemoteOperationalError)),
                parse(&pkts[3]).bth.psn
            ),
        ],
        "the held ACK first, then the NAK at the refused message's last PSN"
    );
    assert_eq!(p.b.qp.state(), QpState::Err);
    assert_eq!(p.b.qp.counters.recv_cq_full_refusals, 1);
    let received = Pair::statuses(&mut p.b.qp);
    assert_eq!(
        received,
        [(1, WcStatus::Success), (2, WcStatus::WrFlushErr)]
    );
    // The sender: the first message succeeded, the refused one failed.
    p.deliver_a(&answers);
    let sent = Pair::statuses(&mut p.a.qp);
    assert_eq!(sent, [(1, WcStatus::Success), (2, WcStatus::RemOpErr)]);
}

#[test]
fn a_held_ack_goes_at_once_when_it_covers_a_quarter_window() {
    let (mut p, pkts) = held_pair(14, ACK_COALESCE_PSNS as u64);
    assert_eq!(pkts.len() as u32, ACK_COALESCE_PSNS);
    p.deliver_b(&pkts[..pkts.len() - 1]);
    assert!(p.transmit_b().is_empty());
    p.deliver_b(&pkts[pkts.len() - 1..]);
    let acks = p.transmit_b();
    assert_eq!(kinds(&acks), [(ACK, parse(&pkts[pkts.len() - 1]).bth.psn)]);
    assert_eq!(p.b.qp.poll_timeout(), None, "no timer left behind");
}

#[test]
fn a_nak_or_a_resend_releases_the_held_ack() {
    let (mut p, pkts) = held_pair(14, 3);
    let psn = |i: usize| parse(&pkts[i]).bth.psn;
    // A gap after a held ACK: the ACK goes first, then the NAK.
    p.deliver_b(&pkts[..1]);
    p.deliver_b(&pkts[2..]);
    assert_eq!(
        kinds(&p.transmit_b()),
        [
            (ACK, psn(0)),
            (Some(AethKind::Nak(NakCode::PsnSequenceError)), psn(1)),
        ]
    );
    // The resent packets: in order again, held again.
    p.deliver_b(&pkts[1..]);
    assert!(p.transmit_b().is_empty());
    // A packet seen twice means the requester is waiting: answered now.
    p.deliver_b(&pkts[2..]);
    assert_eq!(kinds(&p.transmit_b()), [(ACK, psn(2))]);
}

#[test]
fn requests_pass_a_held_ack() {
    let (mut p, to_b) = held_pair(14, 1);
    p.deliver_b(&to_b);
    // B sends back while its ACK for A is held.
    let segs = vec![Segment::Mr {
        mem: p.a.mem.clone(),
        offset: 0,
        len: 64,
    }];
    p.a.qp.post_recv(RecvWqe::new(9, segs)).expect("post_recv");
    let segs = vec![Segment::Mr {
        mem: p.b.mem.clone(),
        offset: 0,
        len: 8,
    }];
    p.b.qp
        .post_send(SendWqe::new(9, None, segs, true))
        .expect("post_send");
    let out = p.transmit_b();
    assert_eq!(out.len(), 1);
    assert_eq!(parse(&out[0]).aeth, None, "the SEND, not the ACK");
    assert!(p.b.qp.poll_timeout().is_some(), "the ACK still waits");
}

#[test]
fn the_hold_is_at_most_a_quarter_of_the_qps_ack_timeout() {
    // timeout 1: 8.192 µs, far below the configured hold.
    let (mut p, pkts) = held_pair(1, 1);
    p.deliver_b(&pkts);
    let limit = rts(1, 7, 7).ack_timeout().expect("timer") / 4;
    assert_eq!(p.b.qp.poll_timeout(), Some(p.now + limit));
}

#[test]
fn dead_peer_fails_after_retry_cnt_plus_one_timeouts() {
    let timeout = 10u8;
    let retry_cnt = 3u8;
    let mut p = Pair::new(rts(timeout, retry_cnt, 7), 12);
    p.send(1, 8);
    p.send(2, 8);
    let t = rts(timeout, retry_cnt, 7).ack_timeout().expect("timer");
    let mut transmissions = p.transmit_a().len();
    let mut fired = Vec::new();
    while p.a.qp.state() == QpState::Rts {
        fired.push(p.fire_a_timer());
        transmissions += p.transmit_a().len();
    }
    assert_eq!(fired.len(), usize::from(retry_cnt) + 1);
    assert_eq!(
        fired.last().copied(),
        Some(Instant::ZERO + t * (u32::from(retry_cnt) + 1))
    );
    assert_eq!(transmissions, 2 * (usize::from(retry_cnt) + 1));
    let wcs = Pair::completions(&mut p.a.qp);
    let st: Vec<_> = wcs.iter().map(|(_, w)| (w.wr_id, w.status)).collect();
    assert_eq!(st, [(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]);
}

#[test]
fn retry_cnt_seven_is_a_count_not_forever() {
    let mut p = Pair::new(rts(8, 7, 7), 12);
    p.send(1, 8);
    p.transmit_a();
    let mut fired = 0;
    while p.a.qp.state() == QpState::Rts {
        p.fire_a_timer();
        p.transmit_a();
        fired += 1;
    }
    assert_eq!(fired, 8);
}

#[test]
fn rnr_waits_the_timer_and_rnr_retry_seven_is_forever() {
    let mut p = Pair::new(rts(14, 7, 7), 14);
    p.send(1, 8);
    for round in 0..20 {
        let pkts = p.transmit_a();
        assert_eq!(pkts.len(), 1, "round {round}");
        p.deliver_b(&pkts);
        let rnr = p.transmit_b();
        assert_eq!(
            parse(&rnr[0]).aeth.map(|a| a.kind),
            Some(AethKind::RnrNak { timer: 14 })
        );
        let at = p.now;
        p.deliver_a(&rnr);
        assert!(
            p.transmit_a().is_empty(),
            "nothing is resent during the RNR wait"
        );
        let t = p.fire_a_timer();
        assert_eq!(t, at + rnr_timer_duration(14));
    }
    assert_eq!(p.a.qp.state(), QpState::Rts);
    p.recv(1, 64);
    let pkts = p.transmit_a();
    p.deliver_b(&pkts);
    let ack = p.transmit_b();
    p.deliver_a(&ack);
    assert_eq!(
        Pair::completions(&mut p.a.qp)[0].1.status,
        WcStatus::Success
    );
}

#[test]
fn after_an_rnr_wait_one_packet_probes_until_an_ack_shows_progress() {
    // Two 64-packet messages fill the 128-PSN window; B has no receive.
    let mut p = Pair::new(rts(14, 7, 7), 14);
    let len = 64 * MTU.bytes();
    p.send(1, len);
    p.send(2, len);
    let burst = p.transmit_a();
    assert_eq!(burst.len(), 128);
    let first = parse(&burst[0]).bth.psn;
    p.deliver_b(&burst);
    let mut rnr = p.transmit_b();
    assert_eq!(rnr.len(), 1, "one RNR NAK, the rest of the burst dropped");
    for round in 0..10 {
        p.deliver_a(&rnr);
        assert!(p.transmit_a().is_empty(), "round {round}: waiting");
        p.fire_a_timer();
        let probe = p.transmit_a();
        assert_eq!(probe.len(), 1, "round {round}: one packet, not the window");
        let bth = parse(&probe[0]).bth;
        assert_eq!((bth.psn, bth.ack_req), (first, true), "round {round}");
        p.deliver_b(&probe);
        rnr = p.transmit_b();
    }
    // Ready now: the probe is ACKed and the window opens again.
    p.recv(1, len);
    p.recv(2, len);
    p.deliver_a(&rnr);
    p.fire_a_timer();
    let probe = p.transmit_a();
    assert_eq!(probe.len(), 1);
    p.deliver_b(&probe);
    let ack = p.transmit_b();
    p.deliver_a(&ack);
    let rest = p.transmit_a();
    assert_eq!(rest.len(), 127, "the whole window after progress");
    p.deliver_b(&rest);
    let acks = p.transmit_b();
    p.deliver_a(&acks);
    let sent = Pair::statuses(&mut p.a.qp);
    assert_eq!(sent, [(1, WcStatus::Success), (2, WcStatus::Success)]);
    let received: Vec<_> = Pair::completions(&mut p.b.qp)
        .into_iter()
        .map(|(_, wc)| (wc.wr_id, wc.status, wc.byte_len as usize))
        .collect();
    assert_eq!(
        received,
        [(1, WcStatus::Success, len), (2, WcStatus::Success, len)],
        "each message delivered once, in order"
    );
}

#[test]
fn an_ack_past_the_refused_psn_ends_the_rnr_wait() {
    // B's RNR timer is the longest (code 0, 655 ms): nothing else moves A.
    let mut p = Pair::new(rts(14, 7, 7), 0);
    p.send(1, 8);
    p.send(2, 8);
    let burst = p.transmit_a();
    assert_eq!(burst.len(), 2);
    p.deliver_b(&burst[..1]);
    let rnr = p.transmit_b();
    // B posts, and a copy of the first request (a network duplicate or a
    // resend) reaches it before the RNR NAK reaches A.
    p.recv(1, 64);
    p.recv(2, 64);
    p.deliver_b(&burst[..1]);
    let ack = p.transmit_b();
    p.deliver_a(&rnr);
    assert!(p.transmit_a().is_empty(), "waiting on the RNR NAK");
    p.deliver_a(&ack);
    let rest = p.transmit_a();
    assert_eq!(rest.len(), 1, "the second request goes at once");
    assert_eq!(parse(&rest[0]).bth.psn, parse(&burst[1]).bth.psn);
    p.deliver_b(&rest);
    let ack = p.transmit_b();
    p.deliver_a(&ack);
    let sent = Pair::statuses(&mut p.a.qp);
    assert_eq!(sent, [(1, WcStatus::Success), (2, WcStatus::Success)]);
    assert_eq!(p.a.qp.poll_timeout(), None, "no RNR timer left armed");
}

#[test]
fn an_answered_rnr_nak_restores_the_retry_budget() {
    // retry_cnt 1: two unanswered timeouts in a row would end the QP.
    let mut p = Pair::new(rts(14, 1, 7), 14);
    p.send(1, 8);
    let mut pkts = p.transmit_a();
    for round in 0..10 {
        // This RNR NAK is lost: the local ACK timeout resends.
        p.deliver_b(&pkts);
        p.transmit_b();
        p.fire_a_timer();
        pkts = p.transmit_a();
        assert_eq!(pkts.len(), 1, "round {round}: resent after the timeout");
        // The next one arrives: the responder is alive, only not ready.
        p.deliver_b(&pkts);
        let rnr = p.transmit_b();
        p.deliver_a(&rnr);
        p.fire_a_timer();
        pkts = p.transmit_a();
        assert_eq!(p.a.qp.state(), QpState::Rts, "round {round}");
    }
    p.recv(1, 64);
    p.deliver_b(&pkts);
    let ack = p.transmit_b();
    p.deliver_a(&ack);
    assert_eq!(
        Pair::completions(&mut p.a.qp)[0].1.status,
        WcStatus::Success
    );
}

#[test]
fn errors_scramble_all_but_wr_id_status_and_qp_num() {
    let mut p = Pair::new(rts(14, 7, 7), 12);
    for i in 0..32 {
        p.send(i, 8);
    }
    p.a.qp.modify_to_error();
    let wcs = Pair::completions(&mut p.a.qp);
    assert_eq!(wcs.len(), 32);
    for (i, (side, wc)) in wcs.iter().enumerate() {
        assert_eq!(*side, CqSide::Send);
        assert_eq!(
            (wc.wr_id, wc.status, wc.qp_num),
            (i as u64, WcStatus::WrFlushErr, Qpn::new(0x100))
        );
    }
    assert!(
        wcs.iter().any(|(_, w)| w.opcode == WcOpcode::Recv),
        "opcode is scrambled"
    );
    assert!(wcs.iter().any(|(_, w)| w.byte_len != 0 && w.byte_len != 8));
}

#[test]
fn stale_and_bogus_acks_are_ignored() {
    let mut p = Pair::new(rts(14, 7, 7), 12);
    p.recv(1, 64);
    p.send(1, 8);
    let pkts = p.transmit_a();
    // An ACK for a PSN never sent changes nothing.
    let bogus = response(Psn::new(1000), AethKind::Ack { credit: 0x1f });
    p.deliver_a(&[bogus]);
    assert!(Pair::completions(&mut p.a.qp).is_empty());
    p.deliver_b(&pkts);
    let acks = p.transmit_b();
    p.deliver_a(&acks);
    assert_eq!(Pair::completions(&mut p.a.qp).len(), 1);
}

/// A response from B to A with `kind`, naming `psn`.
fn response(psn: Psn, kind: AethKind) -> Vec<u8> {
    let repr = PacketRepr {
        bth: BthRepr {
            opcode: Opcode::Ack,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            dest_qp: Qpn::new(0x100),
            ack_req: false,
            psn,
        },
        aeth: Some(AethRepr { kind, msn: 0 }),
        imm: None,
    };
    let mut buf = vec![0u8; 64];
    let n = repr.emit(&ctx(2, 1), &[], &mut buf);
    buf.truncate(n);
    buf
}

/// A fatal NAK names a request outstanding. One naming the PSN last
/// acknowledged (inside the range a duplicate ACK may name) neither kills
/// an idle QP nor fails a WR the responder never refused.
#[test]
fn a_fatal_nak_for_an_acknowledged_psn_is_ignored() {
    let fatal = [
        NakCode::InvalidRequest,
        NakCode::RemoteAccessError,
        NakCode::RemoteOperationalError,
    ];
    for code in fatal {
        let mut p = Pair::new(rts(14, 7, 7), 12);
        p.recv(1, 64);
        p.send(1, 8);
        let pkts = p.transmit_a();
        p.deliver_b(&pkts);
        let acks = p.transmit_b();
        p.deliver_a(&acks);
        assert_eq!(Pair::completions(&mut p.a.qp).len(), 1);
        // A is idle; its one PSN sent, 0xff_fff0, is acknowledged.
        let acknowledged = Psn::new(0xff_fff0);
        p.deliver_a(&[response(acknowledged, AethKind::Nak(code))]);
        assert_eq!(p.a.qp.state(), QpState::Rts, "{code:?} on an idle QP");

        // Busy: the next send is outstanding; a NAK for the one before it
        // fails nothing, and the send still completes.
        p.recv(2, 64);
        p.send(2, 8);
        let pkts = p.transmit_a();
        p.deliver_a(&[response(acknowledged, AethKind::Nak(code))]);
        assert_eq!(p.a.qp.state(), QpState::Rts, "{code:?} on a busy QP");
        assert!(Pair::completions(&mut p.a.qp).is_empty());
        p.deliver_b(&pkts);
        let acks = p.transmit_b();
        p.deliver_a(&acks);
        let done = Pair::completions(&mut p.a.qp);
        assert_eq!(done.len(), 1);
        assert_eq!((done[0].1.wr_id, done[0].1.status), (2, WcStatus::Success));

        // The one outstanding is the one a NAK may fail.
        p.send(3, 8);
        let _ = p.transmit_a();
        p.deliver_a(&[response(acknowledged.add(2), AethKind::Nak(code))]);
        assert_eq!(
            p.a.qp.state(),
            QpState::Err,
            "{code:?} for the outstanding PSN"
        );
    }
}

fn forged(
    psn: u32,
    opcode: u8,
    syndrome: u8,
    ack_req: bool,
    payload_len: usize,
) -> Option<Vec<u8>> {
    let opcode = Opcode::from_byte(opcode).ok()?;
    let aeth = if opcode.has_aeth() {
        let b = [syndrome, 0, 0, 1];
        Some(AethRepr::parse(&super::super::wire::Aeth::new_checked(&b[..]).ok()?).ok()?)
    } else {
        None
    };
    let repr = PacketRepr {
        bth: BthRepr {
            opcode,
            solicited: false,
            mig_req: false,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            dest_qp: Qpn::new(0),
            ack_req,
            psn: Psn::new(psn),
        },
        aeth,
        imm: opcode.has_imm().then_some(9),
    };
    let payload = if opcode.has_aeth() { 0 } else { payload_len };
    let mut buf = vec![0u8; 64 + payload];
    let n = repr.emit(&ctx(2, 1), &vec![0x5a; payload], &mut buf);
    buf.truncate(n);
    Some(buf)
}

proptest::proptest! {
    /// Forged packets (valid ICRC, arbitrary opcode sequence, PSN, syndrome,
    /// length) thrown at both directions of a live pair, interleaved with
    /// the real traffic and timers: nothing panics and completions never
    /// outnumber posted WRs.
    #[test]
    fn hostile_packets_never_panic(
        steps in proptest::collection::vec(
            (0u8..0x12, 0u32..64, proptest::num::u8::ANY, proptest::bool::ANY, 0usize..600, 0u8..4),
            1..200,
        ),
        held in proptest::bool::ANY,
    ) {
        let delay = if held { HOLD } else { Duration::ZERO };
        let mut p = Pair::with_ack_delay(rts(8, 3, 3), 1, delay);
        for i in 0..4 {
            p.recv(i, 700);
            p.send(i, 300 * i as usize);
        }
        let base_a = Psn::new(0xff_fff0).value();
        let base_b = Psn::new(77).value();
        let mut posted = 8usize;
        for (op, off, syndrome, ack_req, len, action) in steps {
            match action {
                0 => {
                    if let Some(pkt) = forged(base_a.wrapping_add(off), op, syndrome, ack_req, len) {
                        if let Ok(pk) = Packet::parse(&ctx(2, 1), &pkt) {
                            p.b.qp.handle_packet(p.now, &pk);
                            p.a.qp.handle_packet(p.now, &pk);
                        }
                    }
                }
                1 => {
                    let pkts = p.transmit_a();
                    p.deliver_b(&pkts);
                    let acks = p.transmit_b();
                    p.deliver_a(&acks);
                }
                2 => {
                    if let Some(t) = p.a.qp.poll_timeout().into_iter().chain(p.b.qp.poll_timeout()).min() {
                        p.now = t;
                        p.a.qp.handle_timeout(t);
                        p.b.qp.handle_timeout(t);
                    }
                }
                _ => {
                    if let Some(pkt) = forged(base_b.wrapping_add(off), op, syndrome, ack_req, len) {
                        if let Ok(pk) = Packet::parse(&ctx(2, 1), &pkt) {
                            p.a.qp.handle_packet(p.now, &pk);
                        }
                    }
                    if p.a.qp.state() == QpState::Rts && p.a.qp.sq.len() < 8 {
                        p.send(100 + off as u64, len);
                        posted += 1;
                    }
                }
            }
        }
        let done = Pair::completions(&mut p.a.qp).len() + Pair::completions(&mut p.b.qp).len();
        proptest::prop_assert!(done <= posted);
    }
}

#[test]
fn an_ack_merged_into_one_already_due_is_not_held_again() {
    let (mut p, pkts) = held_pair(14, 2);
    p.deliver_b(&pkts[..1]);
    p.now = p.now + HOLD;
    p.b.qp.handle_timeout(p.now);
    // Due, not yet on the wire, when the next request arrives.
    p.deliver_b(&pkts[1..]);
    assert_eq!(kinds(&p.transmit_b()), [(ACK, parse(&pkts[1]).bth.psn)]);
    assert_eq!(p.b.qp.poll_timeout(), None);
}
