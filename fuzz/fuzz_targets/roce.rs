//! The soft provider's RoCEv2 parser: BTH/AETH views, reprs, pad and ICRC.
//!
//! ```text
//!  data = mode | udp payload
//!  mode bit 0: ICRC context over IPv6 instead of IPv4
//!  mode bit 1: rewrite the last 4 bytes with the right ICRC (reach the checks behind it)
//! ```
//!
//! Asserts: no panic in any view, repr or the parser; an accepted packet
//! accounts for every byte (headers + payload + pad + ICRC), carries an AETH
//! exactly on ACK and ImmDt exactly on SEND *_WITH_IMM (a WRITE with
//! immediate is an unsupported request, its ImmDt unread), and re-emits into bytes
//! that parse back to the same packet.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qpmux::verbs::Gid;
use qpmux::verbs::soft::wire::{
    Aeth, AethRepr, Bth, BthRepr, ICRC_LEN, IcrcContext, Opcode, Packet, icrc,
};

fn context(ipv6: bool) -> IcrcContext {
    let (src, dst) = if ipv6 {
        let mut a = [0u8; 16];
        a[0] = 0xfe;
        a[1] = 0x80;
        let mut b = a;
        a[15] = 1;
        b[15] = 2;
        (Gid(a), Gid(b))
    } else {
        (
            Gid::from_ipv4([10, 0, 0, 1].into()),
            Gid::from_ipv4([10, 0, 0, 2].into()),
        )
    };
    IcrcContext {
        src,
        dst,
        src_port: 49152,
        dst_port: 4791,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let ctx = context(mode & 1 != 0);
    let mut bytes = rest.to_vec();
    if mode & 2 != 0 && bytes.len() >= 12 + ICRC_LEN {
        let end = bytes.len() - ICRC_LEN;
        let crc = icrc(&ctx, &bytes[..end]);
        bytes[end..].copy_from_slice(&crc.to_le_bytes());
    }

    // The views alone, on anything long enough.
    if let Ok(bth) = Bth::new_checked(&bytes[..]) {
        let _ = (bth.solicited(), bth.mig_req(), bth.pkey(), bth.ack_req());
        let _ = (bth.dest_qp(), bth.psn(), bth.pad_count(), bth.version());
        let _ = BthRepr::parse(&bth);
    }
    if let Ok(aeth) = Aeth::new_checked(&bytes[..]) {
        let _ = aeth.msn();
        if let Ok(repr) = AethRepr::parse(&aeth) {
            assert_eq!(repr.syndrome(), aeth.syndrome());
        }
    }

    let Ok(pkt) = Packet::parse(&ctx, &bytes) else {
        return;
    };
    let repr = pkt.repr;
    assert_eq!(repr.aeth.is_some(), repr.bth.opcode == Opcode::Ack);
    assert_eq!(repr.imm.is_some(), repr.bth.opcode.has_imm());
    let pad = usize::from(repr.bth.pad_count);
    assert_eq!(
        repr.header_len() + pkt.payload.len() + pad + ICRC_LEN,
        bytes.len()
    );

    // Re-emit: reserved bits and pad bytes may differ, the meaning may not
    // (the pad count follows from the payload length, so it matches too).
    let mut out = vec![0xa5u8; repr.header_len() + pkt.payload.len() + 3 + ICRC_LEN];
    let n = repr.emit(&ctx, pkt.payload, &mut out);
    let again = Packet::parse(&ctx, &out[..n]).expect("an emitted packet parses");
    assert_eq!(again.payload, pkt.payload);
    assert_eq!(again.repr.aeth, repr.aeth);
    assert_eq!(again.repr.imm, repr.imm);
    assert_eq!(again.repr.bth, repr.bth);
});
