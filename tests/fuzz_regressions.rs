//! Stable replays for the fuzz targets (fuzz/, docs/fuzzing.md), under plain
//! `cargo test`: every saved input under `fuzz/regressions/<target>/` for the
//! byte-level targets, plus the hand-driven entry points the stateful targets
//! use (`verbs::soft::fuzzing`, `mux::fuzzing`), so they cannot rot unseen.

use std::path::Path;
use std::time::Duration;

use qpmux::link::bootstrap::{BootstrapError, EndpointKind, Handshake};
use qpmux::mux::fuzzing::PeerHarness;
use qpmux::mux::protocol::{BatchEncoder, BatchView, Epoch, FrameSeq, Lane, SlotId};
use qpmux::mux::{MuxConfig, PeerId};
use qpmux::verbs::soft::fuzzing;
use qpmux::verbs::soft::wire::{
    AethKind, AethRepr, BthRepr, DEFAULT_PKEY, ICRC_LEN, IcrcContext, MAX_OVERHEAD, NakCode,
    Opcode, Packet, PacketRepr, WireError, icrc,
};
use qpmux::verbs::soft::{Instant, SoftDevice};
use qpmux::verbs::{
    AccessFlags, CompletionQueue, Device, Gid, InitAttr, MemoryRegion, Mtu, Psn, QpCaps, QpState,
    Qpn, QueuePair, RecvWr, RtrAttr, RtsAttr, SendOpcode, SendWr, Sge, VerbsError, WcStatus,
    WorkCompletion,
};

/// Every file under `fuzz/regressions/<target>/` (none is fine).
fn saved_inputs(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut inputs: Vec<_> = entries
        .map(|e| std::fs::read(e.expect("dir entry").path()).expect("readable input"))
        .collect();
    inputs.sort();
    inputs
}

/// The `batch` target's property; true when the batch was accepted.
fn batch_property(data: &[u8]) -> bool {
    let Ok(view) = BatchView::new_checked(data) else {
        return false;
    };
    assert_eq!(view.records().count(), usize::from(view.record_count()));
    true
}

fn gid(n: u8) -> Gid {
    Gid::from_ipv4([10, 0, 0, n].into())
}

fn ctx(from: u8, to: u8) -> IcrcContext {
    IcrcContext {
        src: gid(from),
        dst: gid(to),
        src_port: 4791,
        dst_port: 4791,
    }
}

/// The `roce` target's ICRC contexts (`fuzz/fuzz_targets/roce.rs`).
fn roce_context(ipv6: bool) -> IcrcContext {
    let (src, dst) = if ipv6 {
        let mut a = [0u8; 16];
        a[0] = 0xfe;
        a[1] = 0x80;
        let mut b = a;
        a[15] = 1;
        b[15] = 2;
        (Gid(a), Gid(b))
    } else {
        (gid(1), gid(2))
    };
    IcrcContext {
        src,
        dst,
        src_port: 49152,
        dst_port: 4791,
    }
}

/// The `roce` target's input: a mode byte (bit 0: IPv6 context, bit 1:
/// re-seal the ICRC), then the UDP payload.
fn roce_target(data: &[u8]) -> bool {
    let Some((&mode, rest)) = data.split_first() else {
        return false;
    };
    let ctx = roce_context(mode & 1 != 0);
    let mut bytes = rest.to_vec();
    if mode & 2 != 0 && bytes.len() >= 12 + ICRC_LEN {
        let end = bytes.len() - ICRC_LEN;
        let crc = icrc(&ctx, &bytes[..end]);
        bytes[end..].copy_from_slice(&crc.to_le_bytes());
    }
    roce_property(&ctx, &bytes)
}

/// The `roce` target's property on one payload; true when it parsed.
fn roce_property(ctx: &IcrcContext, data: &[u8]) -> bool {
    let Ok(pkt) = Packet::parse(ctx, data) else {
        return false;
    };
    let repr = pkt.repr;
    let pad = usize::from(repr.bth.pad_count);
    assert_eq!(
        repr.header_len() + pkt.payload.len() + pad + ICRC_LEN,
        data.len()
    );
    let mut out = vec![0xa5; repr.header_len() + pkt.payload.len() + 3 + ICRC_LEN];
    let n = repr.emit(ctx, pkt.payload, &mut out);
    let again = Packet::parse(ctx, &out[..n]).expect("an emitted packet parses");
    assert_eq!(again.repr, repr);
    assert_eq!(again.payload, pkt.payload);
    true
}

#[test]
fn saved_batch_inputs_hold_the_property() {
    let inputs = saved_inputs("batch");
    let accepted = inputs.iter().filter(|i| batch_property(i)).count();
    // The saved set reaches past the decoder's checks, not just its errors.
    assert!(inputs.is_empty() || accepted > 0);
}

#[test]
fn saved_roce_inputs_hold_the_property() {
    let inputs = saved_inputs("roce");
    let accepted = inputs.iter().filter(|i| roce_target(i)).count();
    assert!(inputs.is_empty() || accepted > 0);
}

fn request(opcode: Opcode, dest: Qpn, psn: Psn, imm: Option<u32>) -> PacketRepr {
    PacketRepr {
        bth: BthRepr {
            opcode,
            solicited: false,
            mig_req: true,
            pad_count: 0,
            pkey: DEFAULT_PKEY,
            dest_qp: dest,
            ack_req: true,
            psn,
        },
        aeth: None,
        imm,
    }
}

/// Emits `repr` + `payload` under `ctx`, applies `edit`, then re-seals the ICRC
/// so the checks behind it are what rejects the packet.
fn sealed(
    ctx: &IcrcContext,
    repr: PacketRepr,
    payload: &[u8],
    edit: impl Fn(&mut [u8]),
) -> Vec<u8> {
    let mut buf = vec![0u8; repr.header_len() + payload.len() + MAX_OVERHEAD];
    let n = repr.emit(ctx, payload, &mut buf);
    buf.truncate(n);
    edit(&mut buf);
    let end = buf.len() - ICRC_LEN;
    let crc = icrc(ctx, &buf[..end]);
    buf[end..].copy_from_slice(&crc.to_le_bytes());
    buf
}

#[test]
fn roce_parser_names_each_hostile_shape() {
    let ctx = ctx(1, 2);
    let to = Qpn::new(0x100);
    let send = request(Opcode::SendOnly, to, Psn::new(5), None);

    // Pad count larger than what precedes the ICRC.
    let bad_pad = sealed(&ctx, send, &[], |b| b[1] |= 0x30);
    assert!(matches!(
        Packet::parse(&ctx, &bad_pad),
        Err(WireError::BadPad { pad: 3, .. })
    ));
    // An ACK carrying payload.
    let ack = PacketRepr {
        aeth: Some(AethRepr {
            kind: AethKind::Ack { credit: 0x1f },
            msn: 1,
        }),
        ..request(Opcode::Ack, to, Psn::new(5), None)
    };
    let mut with_payload = sealed(&ctx, ack, &[], |_| {});
    with_payload.splice(16..16, [0u8; 4]);
    let end = with_payload.len() - ICRC_LEN;
    let crc = icrc(&ctx, &with_payload[..end]);
    with_payload[end..].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(
        Packet::parse(&ctx, &with_payload),
        Err(WireError::AckWithPayload { len: 4 })
    ));
    // Reserved AETH syndrome (type 10).
    let reserved = sealed(&ctx, ack, &[], |b| b[12] = 0x40);
    assert!(matches!(
        Packet::parse(&ctx, &reserved),
        Err(WireError::BadSyndrome { syndrome: 0x40 })
    ));
    // SEND_ONLY_WITH_IMM cut inside its ImmDt.
    let imm = sealed(
        &ctx,
        request(Opcode::SendOnlyImm, to, Psn::new(5), Some(7)),
        &[],
        |_| {},
    );
    assert!(matches!(
        Packet::parse(&ctx, &imm[..14]),
        Err(WireError::Truncated { len: 14, need: 20 })
    ));
    // Every prefix of a good packet is refused without a panic.
    let good = sealed(&ctx, send, b"hello", |_| {});
    for cut in 0..good.len() {
        assert!(Packet::parse(&ctx, &good[..cut]).is_err());
    }
    assert!(roce_property(&ctx, &good));
}

#[test]
fn handshake_refuses_raw_garbage_in_its_first_state() {
    let mut listener = Handshake::listener(None, PeerId(1), EndpointKind::Tcp, [0x11; 32]);
    // A zero-length message.
    assert!(matches!(
        listener.handle_input(&[0, 0, 0, 0]),
        Err(BootstrapError::Truncated)
    ));
    assert!(matches!(
        listener.handle_input(b"more"),
        Err(BootstrapError::AlreadyFailed)
    ));
    let mut listener = Handshake::listener(None, PeerId(1), EndpointKind::Tcp, [0x11; 32]);
    // A length prefix past the cap is refused before any body is buffered.
    assert!(matches!(
        listener.handle_input(&[0xff, 0xff, 0xff, 0xff]),
        Err(BootstrapError::Oversized { .. })
    ));
}

struct HandDriven {
    dev: SoftDevice,
    qp: <SoftDevice as Device>::Qp,
    recv_cq: <SoftDevice as Device>::Cq,
    mr: <SoftDevice as Device>::Mr,
    peer_psn: Psn,
}

fn hand_driven() -> HandDriven {
    hand_driven_with_peer_on(4791)
}

/// A device at 10.0.0.1:4791 whose QP is connected to 10.0.0.2 on
/// `peer_port`.
fn hand_driven_with_peer_on(peer_port: u16) -> HandDriven {
    hand_driven_with(peer_port, None)
}

/// As [`hand_driven_with_peer_on`]; with `shared_cq` one CQ of that depth
/// takes both queues' completions (as the RDMA link's does), else each
/// queue has its own of depth 64.
fn hand_driven_with(peer_port: u16, shared_cq: Option<usize>) -> HandDriven {
    let dev = fuzzing::device(gid(1), 4791, Mtu::Mtu256, 7);
    let pd = dev.alloc_pd().expect("pd");
    let mr = dev.reg_mr(&pd, 4096, AccessFlags::LOCAL_WRITE).expect("mr");
    let send_cq = dev.create_cq(shared_cq.unwrap_or(64)).expect("cq");
    let recv_cq = match shared_cq {
        Some(_) => send_cq.clone(),
        None => dev.create_cq(64).expect("cq"),
    };
    let qp = dev
        .create_qp(&pd, &send_cq, &recv_cq, QpCaps::default())
        .expect("qp");
    let peer_psn = Psn::new(0x00ff_fffe);
    qp.modify_to_init(InitAttr {
        access: AccessFlags::LOCAL_WRITE,
    })
    .expect("init");
    qp.modify_to_rtr(RtrAttr {
        path_mtu: Mtu::Mtu256,
        dest_qpn: Qpn::new(0x200),
        rq_psn: peer_psn,
        remote_gid: gid(2),
        remote_udp_port: peer_port,
        min_rnr_timer: 1,
    })
    .expect("rtr");
    qp.modify_to_rts(RtsAttr {
        sq_psn: qp.initial_psn(),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
    })
    .expect("rts");
    HandDriven {
        dev,
        qp,
        recv_cq,
        mr,
        peer_psn,
    }
}

/// Posts one 64-byte receive on `h`'s QP.
fn post_one_recv(h: &HandDriven) {
    let sg = [Sge {
        mr: &h.mr,
        offset: 0,
        len: 64,
    }];
    h.qp.post_recv(&[RecvWr {
        wr_id: 9,
        sg_list: &sg,
    }])
    .expect("post");
}

/// A SEND_ONLY at the QP's expected PSN from 10.0.0.2 on `port`, sealed for
/// that port (so the ICRC holds).
fn send_from_port(h: &HandDriven, port: u16, payload: &[u8]) -> Vec<u8> {
    let mut from = ctx(2, 1);
    from.src_port = port;
    sealed(
        &from,
        request(Opcode::SendOnly, h.qp.qp_num(), h.peer_psn, None),
        payload,
        |_| {},
    )
}

/// A completion slot for `poll` to fill.
fn blank_completion() -> WorkCompletion {
    WorkCompletion {
        wr_id: 0,
        status: WcStatus::WrFlushErr,
        opcode: qpmux::verbs::WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: Qpn::new(0),
    }
}

fn received(h: &HandDriven) -> Option<Vec<u8>> {
    let mut wc = [blank_completion()];
    match h.recv_cq.poll(&mut wc).expect("poll") {
        0 => None,
        _ => {
            assert_eq!(wc[0].status, WcStatus::Success);
            Some(h.mr.read(0, wc[0].byte_len as usize).expect("read"))
        }
    }
}

/// A soft peer off RoCEv2's port sends from the port it named: another
/// socket on its address (loopback, a shared host) cannot inject into the
/// QP with a packet sealed for its own port. A peer on RoCEv2's port (rxe,
/// a NIC) picks its source port per flow, and is heard from any.
#[test]
fn a_soft_peer_is_heard_only_from_the_port_it_named() {
    let h = hand_driven_with_peer_on(4792);
    post_one_recv(&h);
    let now = Instant::ZERO;
    let injected = send_from_port(&h, 4793, b"evil");
    fuzzing::handle_datagram(&h.dev, now, gid(2), 4793, &injected);
    assert_eq!(h.dev.stats().rx_wrong_source, 1);
    assert_eq!(received(&h), None);
    let peer = send_from_port(&h, 4792, b"peer");
    fuzzing::handle_datagram(&h.dev, now, gid(2), 4792, &peer);
    assert_eq!(received(&h).as_deref(), Some(&b"peer"[..]));

    let h = hand_driven_with_peer_on(4791);
    post_one_recv(&h);
    let entropy = send_from_port(&h, 50_123, b"rxe");
    fuzzing::handle_datagram(&h.dev, now, gid(2), 50_123, &entropy);
    assert_eq!(h.dev.stats().rx_wrong_source, 0);
    assert_eq!(received(&h).as_deref(), Some(&b"rxe"[..]));
}

/// One CQ for both queues, full with a send's completion: the peer's next
/// message would lose its receive completion there, so it is refused
/// (NAK remote operational error, never ACKed) and the QP errs, as with a
/// full receive CQ of its own.
#[test]
fn a_shared_cq_full_of_send_completions_refuses_the_message_it_would_lose() {
    let h = hand_driven_with(4791, Some(1));
    let now = Instant::ZERO;
    post_one_recv(&h);
    let sg = [Sge {
        mr: &h.mr,
        offset: 0,
        len: 8,
    }];
    h.qp.post_send(&[SendWr {
        wr_id: 5,
        opcode: SendOpcode::Send,
        sg_list: &sg,
        signaled: true,
        inline: false,
    }])
    .expect("post");
    let mut buf = vec![0u8; 256 + MAX_OVERHEAD];
    let out = fuzzing::poll_transmit(&h.dev, now, &mut buf).expect("our SEND");
    let ours = Packet::parse(&ctx(1, 2), &buf[..out.len]).expect("parses");
    let ack = PacketRepr {
        aeth: Some(AethRepr {
            kind: AethKind::Ack { credit: 0x1f },
            msn: 1,
        }),
        ..request(Opcode::Ack, h.qp.qp_num(), ours.repr.bth.psn, None)
    };
    fuzzing::handle_datagram(
        &h.dev,
        now,
        gid(2),
        4791,
        &sealed(&ctx(2, 1), ack, &[], |_| {}),
    );
    // The send's completion now fills the one CQ; the peer's SEND arrives.
    fuzzing::handle_datagram(
        &h.dev,
        now,
        gid(2),
        4791,
        &send_from_port(&h, 4791, b"lost?"),
    );
    let out = fuzzing::poll_transmit(&h.dev, now, &mut buf).expect("a NAK");
    let nak = Packet::parse(&ctx(1, 2), &buf[..out.len]).expect("parses");
    assert_eq!(
        (nak.repr.bth.psn, nak.repr.aeth.map(|a| a.kind)),
        (
            h.peer_psn,
            Some(AethKind::Nak(NakCode::RemoteOperationalError))
        )
    );
    assert_eq!(h.qp.state(), QpState::Err);
    assert_eq!(h.dev.counters().recv_cq_full_refusals, 1);
    // The CQ hands out the send's completion, then the overrun the
    // receive's flush caused.
    let mut wc = [blank_completion()];
    assert_eq!(h.recv_cq.poll(&mut wc), Ok(1));
    assert_eq!((wc[0].wr_id, wc[0].status), (5, WcStatus::Success));
    assert_eq!(h.recv_cq.poll(&mut wc), Err(VerbsError::CqOverrun));
}

/// A peer's RDMA WRITE reaches the QP (it used to be dropped as malformed,
/// leaving the peer to retry until `RETRY_EXC_ERR`): NAKed as an invalid
/// request, and the responder errs with its receive flushed.
#[test]
fn hand_driven_device_naks_an_rdma_write_and_errs_the_qp() {
    let h = hand_driven();
    let now = Instant::ZERO;
    post_one_recv(&h);
    let mut reth = [0u8; 16];
    reth[..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_be_bytes());
    reth[12..].copy_from_slice(&4u32.to_be_bytes());
    let write = sealed(
        &ctx(2, 1),
        request(
            Opcode::UnsupportedRequest(0x0a),
            h.qp.qp_num(),
            h.peer_psn,
            None,
        ),
        &[&reth[..], b"evil"].concat(),
        |_| {},
    );
    fuzzing::handle_datagram(&h.dev, now, gid(2), 4791, &write);
    assert_eq!(h.dev.stats().rx_malformed, 0);
    let mut buf = vec![0u8; 256 + MAX_OVERHEAD];
    let out = fuzzing::poll_transmit(&h.dev, now, &mut buf).expect("a NAK");
    let nak = Packet::parse(&ctx(1, 2), &buf[..out.len]).expect("parses");
    assert_eq!(
        (nak.repr.bth.psn, nak.repr.aeth.map(|a| a.kind)),
        (h.peer_psn, Some(AethKind::Nak(NakCode::InvalidRequest)))
    );
    assert_eq!(h.qp.state(), QpState::Err);
    let mut wc = [blank_completion()];
    assert_eq!(h.recv_cq.poll(&mut wc).expect("poll"), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (9, WcStatus::WrFlushErr));
    assert_eq!(h.mr.read(0, 20).expect("read"), [0; 20], "nothing written");
    assert_eq!(h.dev.counters().unsupported_requests, 1);
}

#[test]
fn hand_driven_device_receives_acks_and_drops_garbage() {
    let h = hand_driven();
    let now = Instant::ZERO;
    post_one_recv(&h);

    // Garbage and a packet for another QP are counted and dropped.
    fuzzing::handle_datagram(&h.dev, now, gid(2), 4791, b"short");
    let stray = sealed(
        &ctx(2, 1),
        request(Opcode::SendOnly, Qpn::new(0x777), h.peer_psn, None),
        b"x",
        |_| {},
    );
    fuzzing::handle_datagram(&h.dev, now, gid(2), 4791, &stray);
    let stats = h.dev.stats();
    assert_eq!((stats.rx_malformed, stats.rx_unknown_qp), (1, 1));

    // A well-formed SEND for our QP at the expected PSN, but from another
    // address than the connected peer's, or outside our partition, is
    // dropped before it reaches the QP: the good one below still finds the
    // PSN and the buffer unused.
    let spoofed = sealed(
        &ctx(3, 1),
        request(Opcode::SendOnly, h.qp.qp_num(), h.peer_psn, None),
        b"evil",
        |_| {},
    );
    fuzzing::handle_datagram(&h.dev, now, gid(3), 4791, &spoofed);
    let mut other_partition = request(Opcode::SendOnly, h.qp.qp_num(), h.peer_psn, None);
    other_partition.bth.pkey = 0x8001;
    let foreign = sealed(&ctx(2, 1), other_partition, b"evil", |_| {});
    fuzzing::handle_datagram(&h.dev, now, gid(2), 4791, &foreign);
    let stats = h.dev.stats();
    assert_eq!((stats.rx_wrong_source, stats.rx_bad_pkey), (1, 1));

    // A good SEND_ONLY lands in the posted buffer and is acknowledged.
    let good = sealed(
        &ctx(2, 1),
        request(Opcode::SendOnly, h.qp.qp_num(), h.peer_psn, None),
        b"hello",
        |_| {},
    );
    fuzzing::handle_datagram(&h.dev, now, gid(2), 4791, &good);
    let mut wc = [blank_completion()];
    assert_eq!(h.recv_cq.poll(&mut wc).expect("poll"), 1);
    assert_eq!(
        (wc[0].wr_id, wc[0].status, wc[0].byte_len),
        (9, WcStatus::Success, 5)
    );
    assert_eq!(h.mr.read(0, 5).expect("read"), b"hello");
    let mut buf = vec![0u8; 256 + MAX_OVERHEAD];
    let out = fuzzing::poll_transmit(&h.dev, now, &mut buf).expect("an ACK");
    assert_eq!((out.dst, out.dst_port), (gid(2), 4791));
    let ack = Packet::parse(&ctx(1, 2), &buf[..out.len]).expect("parses");
    assert_eq!(ack.repr.bth.opcode, Opcode::Ack);
    assert_eq!(ack.repr.bth.psn, h.peer_psn);
    assert!(fuzzing::poll_transmit(&h.dev, now, &mut buf).is_none());
    assert_eq!(h.qp.state(), QpState::Rts);
    assert!(fuzzing::poll_timeout(&h.dev).is_none());
    fuzzing::handle_timeout(&h.dev, now + Duration::from_secs(1));
}

#[test]
fn hand_driven_mux_peer_kills_the_epoch_on_violations() {
    let now = tokio::time::Instant::now();
    let epoch = Epoch(3);
    let mut peer = PeerHarness::new(MuxConfig::default(), epoch, 16, now);
    let mut buf = vec![0u8; 4096];

    // A well-formed ping is answered with a pong.
    let mut enc = BatchEncoder::new(&mut buf, epoch, 0, Lane(0)).expect("encoder");
    enc.push_ping(42).expect("room");
    let n = enc.finish();
    let ping = buf[..n].to_vec();
    peer.handle_batch(&ping, now).expect("a ping is fine");
    let n = peer.poll_batch(&mut buf, now);
    assert!(n > 0, "a pong is owed");
    assert_eq!(
        BatchView::new_checked(&buf[..n]).expect("parses").epoch(),
        epoch
    );

    // The same batch again is a sequence gap; raw garbage is malformed.
    assert!(peer.handle_batch(&ping, now).is_err());
    let mut peer = PeerHarness::new(MuxConfig::default(), epoch, 16, now);
    assert!(peer.handle_batch(b"\x01garbage", now).is_err());

    // Data for a slot never opened is not an error and opens nothing.
    let mut peer = PeerHarness::new(MuxConfig::default(), epoch, 16, now);
    let mut enc = BatchEncoder::new(&mut buf, epoch, 0, Lane(0)).expect("encoder");
    let slot = SlotId::new(5, 0).expect("small");
    enc.push_data(slot, FrameSeq(1), b"stray", false)
        .expect("room");
    let n = enc.finish();
    let stray = buf[..n].to_vec();
    peer.handle_batch(&stray, now)
        .expect("stray data is tolerated");
    assert_eq!(peer.live_slots(), 0);
}
