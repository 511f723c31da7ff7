//! Provider-generic verbs properties: each body is written once against the
//! `Device` seam and instantiated per provider by `verbs_suite!` (soft over
//! loopback UDP, soft over the simulator; later libibverbs on kernel rxe).
//!
//! A `Harness` supplies two devices that reach each other and a way to make
//! progress until a state holds (the simulator steps virtual time; real
//! providers poll with a generous failsafe). Bodies wait for states, never
//! for durations.
#![allow(dead_code)]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use qpmux::verbs::{
    AccessFlags, CompletionQueue, Device, InitAttr, MemoryRegion, Mtu, QpAddress, QpCaps, QpState,
    QueuePair, RecvWr, RtrAttr, RtsAttr, SendOpcode, SendWr, Sge, VerbsError, WcOpcode, WcStatus,
    WorkCompletion,
};

/// What a provider under test must supply.
pub trait Harness {
    /// The provider's device.
    type Dev: Device;
    /// Two devices that can reach each other.
    fn devices(&mut self) -> impl Future<Output = (Self::Dev, Self::Dev)>;
    /// Make progress until `done()` holds; false if it never will (idle
    /// network, or the failsafe ran out).
    fn wait_until(&mut self, done: impl FnMut() -> bool) -> impl Future<Output = bool>;
    /// RNR NAKs a device has sent, when the provider counts them.
    fn rnr_naks_sent(dev: &Self::Dev) -> Option<u64>;
    /// Largest message and total bytes of `many_messages` (debug builds keep it small).
    fn bulk_plan(&self) -> BulkPlan;
    /// Kernel rxe before Linux 6.2-ish reports a too-long SEND as an operational
    /// error (receiver LOC_QP_OP_ERR, sender REM_OP_ERR) instead of the spec's
    /// length error; a harness over rxe may accept that pair (docs/rxe.md).
    fn tolerates_rxe_length_error(&self) -> bool {
        false
    }
}

/// Sizes of the bulk message test.
#[derive(Clone, Copy, Debug)]
pub struct BulkPlan {
    /// Messages (always 10,000 in the suite).
    pub count: usize,
    /// Largest message.
    pub max_size: usize,
    /// One message in `big_every` is large (between max_size/2 and max_size).
    pub big_every: usize,
    /// Small messages are 0..=small_max bytes.
    pub small_max: usize,
}

/// Connection knobs.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub caps: QpCaps,
    /// Entries of each endpoint's receive CQ.
    pub recv_cq_depth: usize,
    pub mr_len: usize,
    pub mtu: Mtu,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            caps: QpCaps {
                max_send_wr: 64,
                max_recv_wr: 64,
                max_sge: 4,
                max_inline_data: 128,
            },
            recv_cq_depth: 4096,
            mr_len: 1 << 16,
            mtu: Mtu::Mtu1024,
            min_rnr_timer: 1,
            timeout: 12,
            retry_cnt: 6,
            rnr_retry: 7,
        }
    }
}

/// One side of a connection.
pub struct Endpoint<D: Device> {
    pub dev: D,
    pub pd: D::Pd,
    pub send_cq: D::Cq,
    pub recv_cq: D::Cq,
    pub qp: D::Qp,
    pub mr: D::Mr,
    pub sends: Vec<WorkCompletion>,
    pub recvs: Vec<WorkCompletion>,
}

impl<D: Device> Endpoint<D> {
    fn new(dev: D, p: &Params) -> Endpoint<D> {
        let pd = dev.alloc_pd().expect("alloc_pd");
        let send_cq = dev.create_cq(4096).expect("create send cq");
        let recv_cq = dev.create_cq(p.recv_cq_depth).expect("create recv cq");
        let qp = dev
            .create_qp(&pd, &send_cq, &recv_cq, p.caps)
            .expect("create_qp");
        let mr = dev
            .reg_mr(&pd, p.mr_len, AccessFlags::LOCAL_WRITE)
            .expect("reg_mr");
        Endpoint {
            dev,
            pd,
            send_cq,
            recv_cq,
            qp,
            mr,
            sends: Vec::new(),
            recvs: Vec::new(),
        }
    }

    /// Move every available completion into `sends`/`recvs`.
    pub fn poll(&mut self) {
        let mut buf = [blank_wc(); 32];
        loop {
            let n = self.send_cq.poll(&mut buf).expect("poll send cq");
            self.sends.extend_from_slice(&buf[..n]);
            if n < buf.len() {
                break;
            }
        }
        loop {
            let n = self.recv_cq.poll(&mut buf).expect("poll recv cq");
            self.recvs.extend_from_slice(&buf[..n]);
            if n < buf.len() {
                break;
            }
        }
    }

    pub fn post_recv(&self, wr_id: u64, offset: usize, len: usize) {
        let sge = [Sge {
            mr: &self.mr,
            offset,
            len,
        }];
        self.qp
            .post_recv(&[RecvWr {
                wr_id,
                sg_list: &sge,
            }])
            .expect("post_recv");
    }

    pub fn post_send(
        &self,
        wr_id: u64,
        offset: usize,
        len: usize,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<(), VerbsError> {
        let sge = [Sge {
            mr: &self.mr,
            offset,
            len,
        }];
        let opcode = match imm {
            Some(i) => SendOpcode::SendWithImm(i),
            None => SendOpcode::Send,
        };
        self.qp
            .post_send(&[SendWr {
                wr_id,
                opcode,
                sg_list: &sge,
                signaled,
                inline: false,
            }])
            .map_err(|e| e.source)
    }
}

pub fn blank_wc() -> WorkCompletion {
    WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: qpmux::verbs::Qpn::new(0),
    }
}

/// Two endpoints moved to INIT, given `pre_post` receives on each, then to RTR and RTS.
pub async fn connect<H: Harness>(h: &mut H, p: Params) -> (Endpoint<H::Dev>, Endpoint<H::Dev>) {
    let (da, db) = h.devices().await;
    let a = Endpoint::new(da, &p);
    let b = Endpoint::new(db, &p);
    for e in [&a, &b] {
        e.qp.modify_to_init(InitAttr {
            access: AccessFlags::LOCAL_WRITE,
        })
        .expect("to INIT");
    }
    let link = |me: &Endpoint<H::Dev>, peer: &Endpoint<H::Dev>| {
        let addr = QpAddress::of(&peer.dev, &peer.qp);
        me.qp
            .modify_to_rtr(RtrAttr::for_peer(&addr, p.mtu, p.min_rnr_timer))
            .expect("to RTR");
        me.qp
            .modify_to_rts(RtsAttr {
                sq_psn: me.qp.initial_psn(),
                timeout: p.timeout,
                retry_cnt: p.retry_cnt,
                rnr_retry: p.rnr_retry,
            })
            .expect("to RTS");
    };
    link(&a, &b);
    link(&b, &a);
    (a, b)
}

/// Wait until `e` has at least `sends` send and `recvs` receive completions.
pub async fn wait_wcs<H: Harness>(
    h: &mut H,
    e: &mut Endpoint<H::Dev>,
    sends: usize,
    recvs: usize,
) -> bool {
    h.wait_until(|| {
        e.poll();
        e.sends.len() >= sends && e.recvs.len() >= recvs
    })
    .await
}

/// Both QPs reach RTS with distinct QPNs.
pub async fn connects_two_qps<H: Harness>(h: &mut H) {
    let (a, b) = connect(h, Params::default()).await;
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    let port = a.dev.query_port();
    assert!(port.max_qp_wr >= 64 && port.max_sge >= 1 && !port.gid_table.is_empty());
}

/// A sends "ping", B answers "pong"; bytes, lengths and QPNs are right.
pub async fn ping_pong<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(h, Params::default()).await;
    for round in 0..10u64 {
        b.post_recv(round, 4096, 256);
        a.post_recv(round, 4096, 256);
        let ping = format!("ping {round}");
        a.mr.write(0, ping.as_bytes()).expect("write");
        a.post_send(round, 0, ping.len(), None, true)
            .expect("send ping");
        assert!(
            wait_wcs(h, &mut b, 0, round as usize + 1).await,
            "ping arrives"
        );
        let wc = b.recvs[round as usize];
        assert_eq!(
            (wc.status, wc.opcode, wc.wr_id),
            (WcStatus::Success, WcOpcode::Recv, round)
        );
        assert_eq!(wc.byte_len as usize, ping.len());
        assert_eq!(wc.qp_num, b.qp.qp_num());
        assert_eq!(b.mr.read(4096, ping.len()).expect("read"), ping.as_bytes());
        // The last pong's buffer is free once its send completed (a NIC
        // may still read it before: libibverbs refuses the write then).
        assert!(wait_wcs(h, &mut b, round as usize, round as usize + 1).await);
        let pong = format!("pong {round}");
        b.mr.write(0, pong.as_bytes()).expect("write");
        b.post_send(round, 0, pong.len(), None, true)
            .expect("send pong");
        assert!(
            wait_wcs(h, &mut a, round as usize + 1, round as usize + 1).await,
            "pong arrives"
        );
        assert_eq!(a.mr.read(4096, pong.len()).expect("read"), pong.as_bytes());
        assert_eq!(a.sends[round as usize].status, WcStatus::Success);
        assert_eq!(a.sends[round as usize].qp_num, a.qp.qp_num());
    }
}

/// SEND_WITH_IMM delivers the immediate, also with no payload, and inline sends work.
pub async fn send_with_immediate<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(h, Params::default()).await;
    b.post_recv(1, 0, 4096);
    b.post_recv(2, 4096, 4096);
    b.post_recv(3, 8192, 4096);
    a.mr.write(0, b"with immediate").expect("write");
    a.post_send(10, 0, 14, Some(0xdead_beef), true)
        .expect("send imm");
    a.post_send(11, 0, 0, Some(7), true)
        .expect("zero-length imm");
    a.mr.write(100, b"inline!").expect("write");
    let sge = [Sge {
        mr: &a.mr,
        offset: 100,
        len: 7,
    }];
    a.qp.post_send(&[SendWr {
        wr_id: 12,
        opcode: SendOpcode::Send,
        sg_list: &sge,
        signaled: true,
        inline: true,
    }])
    .expect("inline send");
    // Inline: the buffer may be reused at once.
    a.mr.write(100, b"XXXXXXX").expect("write");
    assert!(wait_wcs(h, &mut b, 0, 3).await);
    assert!(wait_wcs(h, &mut a, 3, 0).await);
    assert_eq!(b.recvs[0].imm, Some(0xdead_beef));
    assert_eq!(b.recvs[0].byte_len, 14);
    assert_eq!(b.mr.read(0, 14).expect("read"), b"with immediate");
    assert_eq!(b.recvs[1].imm, Some(7));
    assert_eq!(b.recvs[1].byte_len, 0);
    assert_eq!(b.recvs[2].imm, None);
    assert_eq!(b.mr.read(8192, 7).expect("read"), b"inline!");
    assert!(a.sends.iter().all(|w| w.status == WcStatus::Success));
}

fn pattern_byte(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

fn size_of_message(plan: &BulkPlan, i: usize) -> usize {
    let mix = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 33;
    if i % plan.big_every == plan.big_every / 2 {
        plan.max_size / 2 + (mix as usize % (plan.max_size / 2 + 1))
    } else {
        mix as usize % (plan.small_max + 1)
    }
}

/// `plan.count` messages of mixed sizes arrive intact, once, in order.
/// Returns the number of payload bytes moved.
pub async fn many_messages<H: Harness>(h: &mut H, plan: BulkPlan, p: Params) -> usize {
    const WINDOW: usize = 16;
    let slot = plan.max_size.next_multiple_of(64);
    let params = Params {
        mr_len: slot * WINDOW,
        ..p
    };
    let (mut a, mut b) = connect(h, params).await;
    let pattern: Vec<u8> = (0..slot + 256).map(pattern_byte).collect();
    for k in 0..WINDOW.min(plan.count) {
        b.post_recv(k as u64, (k % WINDOW) * slot, slot);
    }
    let mut posted = 0usize;
    let mut send_done = 0usize; // messages whose send completed (signaled ones imply earlier)
    let mut received = 0usize;
    let mut bytes = 0usize;
    while received < plan.count {
        while posted < plan.count && posted - send_done < WINDOW && posted < received + WINDOW {
            let len = size_of_message(&plan, posted);
            let off = (posted % WINDOW) * slot;
            let start = posted % 256;
            a.mr.write(off, &pattern[start..start + len])
                .expect("write");
            let signaled = posted % 4 == 3 || posted + 1 == plan.count;
            a.post_send(posted as u64, off, len, Some(posted as u32), signaled)
                .expect("post_send");
            posted += 1;
        }
        let (want_s, want_r) = (a.sends.len() + 1, b.recvs.len() + 1);
        let progressed = h
            .wait_until(|| {
                a.poll();
                b.poll();
                a.sends.len() >= want_s || b.recvs.len() >= want_r
            })
            .await;
        assert!(
            progressed,
            "stalled after {received} messages ({posted} posted)"
        );
        for wc in a.sends.drain(..) {
            assert_eq!(wc.status, WcStatus::Success, "send {}", wc.wr_id);
            send_done = send_done.max(wc.wr_id as usize + 1);
        }
        let recvs: Vec<_> = b.recvs.drain(..).collect();
        for wc in recvs {
            assert_eq!(wc.status, WcStatus::Success, "recv {}", wc.wr_id);
            let k = wc.wr_id as usize;
            assert_eq!(k, received, "messages complete in order");
            assert_eq!(wc.imm, Some(k as u32), "message {k} carries its own number");
            let len = size_of_message(&plan, k);
            assert_eq!(wc.byte_len as usize, len, "length of message {k}");
            let start = k % 256;
            let ok =
                b.mr.with((k % WINDOW) * slot, len, |got| {
                    got == &pattern[start..start + len]
                })
                .expect("read");
            assert!(ok, "payload of message {k} intact");
            bytes += len;
            received += 1;
            let next = k + WINDOW;
            if next < plan.count {
                b.post_recv(next as u64, (next % WINDOW) * slot, slot);
            }
        }
    }
    assert!(wait_wcs(h, &mut a, 0, 0).await);
    assert!(
        bytes <= 64 << 20,
        "the plan stays within 64 MiB ({bytes} bytes)"
    );
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    bytes
}

/// Without a posted receive the responder RNR-NAKs; once one is posted the
/// send succeeds (rnr_retry > 0).
pub async fn rnr_then_success<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(
        h,
        Params {
            rnr_retry: 7,
            min_rnr_timer: 1,
            ..Params::default()
        },
    )
    .await;
    a.mr.write(0, b"early").expect("write");
    a.post_send(1, 0, 5, None, true).expect("send");
    if H::rnr_naks_sent(&b.dev).is_some() {
        let dev = &b.dev;
        assert!(
            h.wait_until(|| H::rnr_naks_sent(dev).unwrap_or(0) >= 2)
                .await,
            "responder RNR-NAKs while no receive is posted"
        );
    }
    a.poll();
    assert!(
        a.sends.is_empty(),
        "send does not complete before a receive exists"
    );
    b.post_recv(9, 0, 64);
    assert!(wait_wcs(h, &mut b, 0, 1).await);
    assert!(wait_wcs(h, &mut a, 1, 0).await);
    assert_eq!(a.sends[0].status, WcStatus::Success);
    assert_eq!(b.recvs[0].status, WcStatus::Success);
    assert_eq!(b.mr.read(0, 5).expect("read"), b"early");
    assert_eq!(b.qp.state(), QpState::Rts);
}

/// rnr_retry = 0: the first RNR NAK fails the send with RNR_RETRY_EXC_ERR;
/// later WRs flush; the responder is unaffected.
pub async fn rnr_retry_zero_fails<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(
        h,
        Params {
            rnr_retry: 0,
            ..Params::default()
        },
    )
    .await;
    a.post_send(1, 0, 5, None, false).expect("send");
    a.post_send(2, 0, 5, None, false).expect("send");
    assert!(wait_wcs(h, &mut a, 2, 0).await);
    assert_eq!(
        (a.sends[0].wr_id, a.sends[0].status),
        (1, WcStatus::RnrRetryExcErr)
    );
    assert_eq!(
        (a.sends[1].wr_id, a.sends[1].status),
        (2, WcStatus::WrFlushErr)
    );
    assert_eq!(a.sends[0].qp_num, a.qp.qp_num());
    assert_eq!(a.qp.state(), QpState::Err);
    // Posting in ERR completes at once with a flush.
    a.post_send(3, 0, 5, None, false)
        .expect("post in ERR is accepted");
    assert!(wait_wcs(h, &mut a, 3, 0).await);
    assert_eq!(
        (a.sends[2].wr_id, a.sends[2].status),
        (3, WcStatus::WrFlushErr)
    );
    b.poll();
    assert_eq!(b.qp.state(), QpState::Rts, "RNR changes no responder state");
}

/// A message longer than the posted buffer: LOC_LEN_ERR at the receiver,
/// REM_INV_REQ_ERR at the sender, both QPs in ERR, everything else flushed in order.
pub async fn message_too_long<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(h, Params::default()).await;
    b.post_recv(1, 0, 100);
    b.post_recv(2, 1000, 100);
    b.post_recv(3, 2000, 100);
    a.post_send(10, 0, 3000, None, false).expect("send");
    a.post_send(11, 0, 10, None, true).expect("send");
    a.post_send(12, 0, 10, None, false).expect("send");
    assert!(wait_wcs(h, &mut b, 0, 3).await);
    assert!(wait_wcs(h, &mut a, 3, 0).await);
    let recv: Vec<_> = b.recvs.iter().map(|w| (w.wr_id, w.status)).collect();
    // The spec's verdict: LOC_LEN_ERR at the receiver, NAK invalid request.
    let (mut loc, mut rem) = (WcStatus::LocLenErr, WcStatus::RemInvReqErr);
    if h.tolerates_rxe_length_error() && recv[0].1 == WcStatus::LocQpOpErr {
        eprintln!("rxe deviation: a too-long SEND completes as LOC_QP_OP_ERR / REM_OP_ERR");
        (loc, rem) = (WcStatus::LocQpOpErr, WcStatus::RemOpErr);
    }
    assert_eq!(
        recv,
        [
            (1, loc),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    let send: Vec<_> = a.sends.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        send,
        [
            (10, rem),
            (11, WcStatus::WrFlushErr),
            (12, WcStatus::WrFlushErr)
        ]
    );
    assert!(b.recvs.iter().all(|w| w.qp_num == b.qp.qp_num()));
    assert_eq!(a.qp.state(), QpState::Err);
    assert_eq!(b.qp.state(), QpState::Err);
}

/// A message whose receive completion the full CQ could not take is
/// refused, not ACKed: its send ends in error (never `Success`), what came
/// before keeps its ACK, and the receiver's QP errs.
pub async fn a_full_recv_cq_refuses_the_message_it_would_lose<H: Harness>(h: &mut H) {
    let (mut a, b) = connect(
        h,
        Params {
            recv_cq_depth: 1,
            ..Params::default()
        },
    )
    .await;
    for i in 0..3 {
        b.post_recv(i, i as usize * 100, 100);
    }
    for i in 0..3 {
        a.post_send(10 + i, 0, 10, None, true).expect("send");
    }
    assert!(wait_wcs(h, &mut a, 3, 0).await);
    let sent: Vec<_> = a.sends.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        sent,
        [
            (10, WcStatus::Success),
            (11, WcStatus::RemOpErr),
            (12, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(b.qp.state(), QpState::Err);
    // The receiver reads the one completion the CQ had room for (the
    // message its sender saw succeed), then the overrun: the error's
    // flushes found no room either.
    let mut buf = [blank_wc(); 4];
    assert_eq!(b.recv_cq.poll(&mut buf), Ok(1));
    assert_eq!((buf[0].wr_id, buf[0].status), (0, WcStatus::Success));
    assert_eq!(b.recv_cq.poll(&mut buf), Err(VerbsError::CqOverrun));
}

/// The peer's QP is killed: sends fail with RETRY_EXC_ERR after the retries.
pub async fn peer_gone_retry_exceeded<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(
        h,
        Params {
            retry_cnt: 2,
            timeout: 10,
            ..Params::default()
        },
    )
    .await;
    b.post_recv(1, 0, 100);
    b.qp.modify_to_error()
        .expect("fault hook: kill the peer QP");
    assert!(wait_wcs(h, &mut b, 0, 1).await);
    assert_eq!(b.recvs[0].status, WcStatus::WrFlushErr);
    a.post_send(5, 0, 10, None, true).expect("send");
    a.post_send(6, 0, 10, None, false).expect("send");
    assert!(wait_wcs(h, &mut a, 2, 0).await);
    assert_eq!(
        (a.sends[0].wr_id, a.sends[0].status),
        (5, WcStatus::RetryExcErr)
    );
    assert_eq!(
        (a.sends[1].wr_id, a.sends[1].status),
        (6, WcStatus::WrFlushErr)
    );
    assert_eq!(a.qp.state(), QpState::Err);
}

/// Misuse of the state machine and queues returns errors and changes nothing.
pub async fn state_machine_misuse<H: Harness>(h: &mut H) {
    let (da, db) = h.devices().await;
    let p = Params::default();
    let a = Endpoint::new(da, &p);
    let b = Endpoint::new(db, &p);
    let port = b.dev.query_port();
    let rtr = RtrAttr {
        path_mtu: Mtu::Mtu1024,
        dest_qpn: b.qp.qp_num(),
        rq_psn: b.qp.initial_psn(),
        remote_gid: port.gid_table[0],
        remote_udp_port: port.udp_port,
        min_rnr_timer: 1,
    };
    // timeout 0: no local ACK timer, so the unanswered sends below can never
    // fail the QP before the send queue fills.
    let rts = RtsAttr {
        sq_psn: a.qp.initial_psn(),
        timeout: 0,
        retry_cnt: 3,
        rnr_retry: 3,
    };
    let init = InitAttr {
        access: AccessFlags::LOCAL_WRITE,
    };
    assert_eq!(a.qp.state(), QpState::Reset);
    assert!(a.post_send(1, 0, 1, None, true).is_err(), "send in RESET");
    let sge = [Sge {
        mr: &a.mr,
        offset: 0,
        len: 1,
    }];
    assert!(
        a.qp.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &sge
        }])
        .is_err(),
        "recv in RESET"
    );
    assert!(a.qp.modify_to_rtr(rtr).is_err(), "RESET -> RTR");
    assert!(a.qp.modify_to_rts(rts).is_err(), "RESET -> RTS");
    assert_eq!(a.qp.state(), QpState::Reset);
    a.qp.modify_to_init(init).expect("RESET -> INIT");
    assert!(
        a.qp.modify_to_init(init).is_err(),
        "INIT -> INIT is refused here"
    );
    assert!(a.qp.modify_to_rts(rts).is_err(), "INIT -> RTS");
    assert!(a.post_send(1, 0, 1, None, true).is_err(), "send in INIT");
    a.post_recv(1, 0, 16);
    let too_big = RtrAttr {
        path_mtu: Mtu::Mtu4096,
        ..rtr
    };
    if a.dev.query_port().active_mtu < Mtu::Mtu4096 {
        assert!(
            a.qp.modify_to_rtr(too_big).is_err(),
            "path MTU above the active MTU"
        );
    }
    let bad_rtr = RtrAttr {
        min_rnr_timer: 32,
        ..rtr
    };
    assert!(
        a.qp.modify_to_rtr(bad_rtr).is_err(),
        "min_rnr_timer out of range"
    );
    assert_eq!(
        a.qp.state(),
        QpState::Init,
        "a failed modify changes nothing"
    );
    a.qp.modify_to_rtr(rtr).expect("INIT -> RTR");
    assert!(a.post_send(1, 0, 1, None, true).is_err(), "send in RTR");
    assert!(
        a.qp.modify_to_rts(RtsAttr {
            retry_cnt: 8,
            ..rts
        })
        .is_err(),
        "retry_cnt 8"
    );
    assert!(
        a.qp.modify_to_rts(RtsAttr {
            rnr_retry: 8,
            ..rts
        })
        .is_err(),
        "rnr_retry 8"
    );
    assert_eq!(a.qp.state(), QpState::Rtr);
    a.qp.modify_to_rts(rts).expect("RTR -> RTS");
    // Bad scatter-gather entries.
    assert!(
        a.post_send(1, p.mr_len - 1, 2, None, true).is_err(),
        "SGE beyond the region"
    );
    let ro = a
        .dev
        .reg_mr(&a.pd, 64, AccessFlags::LOCAL_READ)
        .expect("reg_mr");
    let sge = [Sge {
        mr: &ro,
        offset: 0,
        len: 8,
    }];
    assert!(
        a.qp.post_recv(&[RecvWr {
            wr_id: 2,
            sg_list: &sge
        }])
        .is_err(),
        "a receive into a local-read-only region"
    );
    // A region of another protection domain.
    let other_pd = a.dev.alloc_pd().expect("pd");
    let foreign = a
        .dev
        .reg_mr(&other_pd, 64, AccessFlags::LOCAL_WRITE)
        .expect("reg_mr");
    let sge = [Sge {
        mr: &foreign,
        offset: 0,
        len: 8,
    }];
    assert!(
        a.qp.post_recv(&[RecvWr {
            wr_id: 3,
            sg_list: &sge
        }])
        .is_err(),
        "a region of another PD"
    );
    // The send queue fills: nothing acknowledges (the peer is still in RESET).
    let mut full = None;
    for i in 0..=p.caps.max_send_wr {
        if let Err(e) = a.post_send(100 + i as u64, 0, 8, None, false) {
            full = Some((i, e));
            break;
        }
    }
    let (i, e) = full.expect("the send queue fills");
    assert_eq!(i, p.caps.max_send_wr);
    assert!(matches!(e, VerbsError::SendQueueFull { .. }), "{e:?}");
    // Reset discards WRs without completions.
    a.qp.modify_to_reset().expect("any -> RESET");
    assert_eq!(a.qp.state(), QpState::Reset);
    let mut a = a;
    a.poll();
    assert!(a.sends.is_empty() && a.recvs.is_empty());
    a.qp.modify_to_error().expect("RESET -> ERR");
    assert_eq!(a.qp.state(), QpState::Err);
    assert!(a.qp.modify_to_init(init).is_err(), "ERR -> INIT");
}

/// Poll a future once without a runtime waker.
pub fn ready_now<F: Future>(fut: std::pin::Pin<&mut F>) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    matches!(fut.poll(&mut cx), Poll::Ready(_))
}

/// CQ notification is one-shot and edge-triggered.
pub async fn cq_notify_is_one_shot<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(h, Params::default()).await;
    for k in 0..4 {
        b.post_recv(k, k as usize * 64, 64);
    }
    // Armed, nothing arrived: no notification.
    b.recv_cq.req_notify().expect("arm");
    {
        let mut n = pin!(b.recv_cq.notified());
        assert!(!ready_now(n.as_mut()));
        a.post_send(1, 0, 8, None, true).expect("send");
        assert!(
            h.wait_until(|| ready_now(n.as_mut())).await,
            "armed CQ notifies"
        );
    }
    assert!(wait_wcs(h, &mut b, 0, 1).await);
    // Not re-armed: a second completion does not notify.
    a.post_send(2, 0, 8, None, true).expect("send");
    assert!(wait_wcs(h, &mut b, 0, 2).await);
    assert!(
        !ready_now(pin!(b.recv_cq.notified())),
        "one notification per arm"
    );
    // A completion that is already there when arming does not notify either.
    // (The responder completes the receive before it ACKs, so once the send
    // completed the receive completion sits unpolled in B's CQ.)
    a.post_send(3, 0, 8, None, true).expect("send");
    assert!(wait_wcs(h, &mut a, 3, 0).await);
    b.recv_cq.req_notify().expect("arm");
    assert!(
        !ready_now(pin!(b.recv_cq.notified())),
        "edge-triggered: nothing new since arming"
    );
    a.post_send(4, 0, 8, None, true).expect("send");
    let mut n = pin!(b.recv_cq.notified());
    assert!(
        h.wait_until(|| ready_now(n.as_mut())).await,
        "new completion after arming notifies"
    );
}

/// One region of chunks (`reg_chunked_mr`): chunk guards are exclusive and
/// cover their own bytes, and SGEs naming (region, offset, len) send exactly
/// those bytes, inside one chunk or across two.
pub async fn chunked_region<H: Harness>(h: &mut H) {
    let (mut a, mut b) = connect(h, Params::default()).await;
    assert_eq!(
        a.dev
            .reg_chunked_mr(&a.pd, 1000, 0, AccessFlags::LOCAL_READ)
            .err(),
        Some(VerbsError::InvalidAttr { attr: "chunks" })
    );
    let pool = a
        .dev
        .reg_chunked_mr(&a.pd, 1000, 4, AccessFlags::LOCAL_READ)
        .expect("reg_chunked_mr");
    assert_eq!(
        (pool.len(), pool.chunk_len(), pool.chunks()),
        (4000, 1000, 4)
    );
    let mut guards: Vec<_> = (0..4)
        .map(|i| pool.try_lock_chunk(i).expect("free chunk"))
        .collect();
    assert!(pool.try_lock_chunk(4).is_none(), "past the last chunk");
    for (i, g) in guards.iter_mut().enumerate() {
        assert!(pool.try_lock_chunk(i).is_none(), "chunk {i} is held");
        assert_eq!(g.len(), 1000);
        g.fill(b'a' + i as u8);
    }
    drop(guards);
    assert_eq!(
        pool.read(999, 2).expect("read"),
        b"ab",
        "chunks are adjacent"
    );
    let sends = [(2000, 1000), (1500, 1000)]; // one chunk; half of two
    for (n, &(offset, len)) in sends.iter().enumerate() {
        b.post_recv(10 + n as u64, n * 1000, 1000);
        let sge = [Sge {
            mr: &pool,
            offset,
            len,
        }];
        a.qp.post_send(&[SendWr {
            wr_id: n as u64,
            opcode: SendOpcode::Send,
            sg_list: &sge,
            signaled: true,
            inline: false,
        }])
        .expect("post from a chunk");
    }
    assert!(wait_wcs(h, &mut a, 2, 0).await);
    assert!(wait_wcs(h, &mut b, 0, 2).await);
    assert!(a.sends.iter().all(|wc| wc.status == WcStatus::Success));
    assert_eq!(b.mr.read(0, 1000).expect("read"), vec![b'c'; 1000]);
    let mut spanning = vec![b'b'; 500];
    spanning.extend_from_slice(&[b'c'; 500]);
    assert_eq!(b.mr.read(1000, 1000).expect("read"), spanning);
}

/// Instantiate every property for a harness constructor.
#[macro_export]
macro_rules! verbs_suite {
    ($make:expr) => {
        #[tokio::test]
        async fn connects_two_qps() {
            verbs_suite::connects_two_qps(&mut $make).await;
        }
        #[tokio::test]
        async fn ping_pong() {
            verbs_suite::ping_pong(&mut $make).await;
        }
        #[tokio::test]
        async fn send_with_immediate() {
            verbs_suite::send_with_immediate(&mut $make).await;
        }
        #[tokio::test]
        async fn ten_thousand_messages_in_order() {
            let mut h = $make;
            let plan = verbs_suite::Harness::bulk_plan(&h);
            verbs_suite::many_messages(&mut h, plan, verbs_suite::Params::default()).await;
        }
        #[tokio::test]
        async fn rnr_then_success() {
            verbs_suite::rnr_then_success(&mut $make).await;
        }
        #[tokio::test]
        async fn rnr_retry_zero_fails() {
            verbs_suite::rnr_retry_zero_fails(&mut $make).await;
        }
        #[tokio::test]
        async fn message_too_long() {
            verbs_suite::message_too_long(&mut $make).await;
        }
        #[tokio::test]
        async fn peer_gone_retry_exceeded() {
            verbs_suite::peer_gone_retry_exceeded(&mut $make).await;
        }
        #[tokio::test]
        async fn state_machine_misuse() {
            verbs_suite::state_machine_misuse(&mut $make).await;
        }
        #[tokio::test]
        async fn chunked_region() {
            verbs_suite::chunked_region(&mut $make).await;
        }
        #[tokio::test]
        async fn cq_notify_is_one_shot() {
            verbs_suite::cq_notify_is_one_shot(&mut $make).await;
        }
    };
}
