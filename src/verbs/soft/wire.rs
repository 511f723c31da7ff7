//! RoCEv2 RC wire format: BTH, AETH, ImmDt views and reprs, and the ICRC.
//!
//! ```text
//!  UDP payload = BTH(12) | AETH(4, ACK) | ImmDt(4, *_WITH_IMM) | payload | pad | ICRC(4)
//!  (an RC request not carried out, WRITE/READ/atomic: BTH(12) | rest unread | ICRC(4))
//!  ingress: bytes ─► Packet::parse(ctx) ─► checks length, opcode, pad, ICRC ─► Packet
//!  egress:  PacketRepr + payload ─► PacketRepr::emit(ctx, buf) ─► bytes
//! ```
//!
//! Views (`Bth<T>`, `Aeth<T>`) follow smoltcp: `new_checked` validates the
//! length so no accessor can panic; reprs carry the validated meaning. Every
//! byte from the wire is untrusted: a malformed packet is a [`WireError`].
//! The ICRC covers a pseudo IP/UDP header; over IPv4 the soft provider fixes
//! the Identification field to 0 because a UDP socket cannot see it
//! (docs/soft-provider.md, "ICRC over a fixed pseudo-header").

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::verbs::{Gid, Psn, Qpn};

/// Errors decoding a packet. One variant per way a packet can be wrong.
#[derive(Debug, thiserror::Error, Clone, Copy, PartialEq, Eq)]
pub enum WireError {
    /// Fewer bytes than the headers the opcode needs.
    #[error("truncated packet: {len} bytes, need at least {need}")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// An opcode this provider does not take: not RC, a READ or atomic
    /// response (it issues no READ or atomic), reserved.
    #[error("unsupported opcode {opcode:#04x}")]
    UnsupportedOpcode {
        /// The opcode byte.
        opcode: u8,
    },
    /// Transport header version other than 0.
    #[error("unsupported transport version {version}")]
    BadVersion {
        /// The TVer field.
        version: u8,
    },
    /// The payload plus pad is not a multiple of 4, or the pad does not fit.
    #[error("bad pad: pad count {pad} with {payload_and_pad} payload bytes")]
    BadPad {
        /// PadCnt field.
        pad: u8,
        /// Bytes between the headers and the ICRC.
        payload_and_pad: usize,
    },
    /// An ACK that carries payload.
    #[error("ACK carries {len} payload bytes")]
    AckWithPayload {
        /// Payload bytes.
        len: usize,
    },
    /// AETH syndrome with the reserved type `10` or a reserved NAK code.
    #[error("reserved AETH syndrome {syndrome:#04x}")]
    BadSyndrome {
        /// The syndrome byte.
        syndrome: u8,
    },
    /// ICRC mismatch.
    #[error("ICRC mismatch: computed {computed:#010x}, packet has {found:#010x}")]
    BadIcrc {
        /// CRC over the packet.
        computed: u32,
        /// CRC the packet carries.
        found: u32,
    },
}

/// RC opcodes the soft provider takes: the SENDs and ACK it speaks, and the
/// requests it parses only to NAK.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opcode {
    /// SEND First.
    SendFirst,
    /// SEND Middle.
    SendMiddle,
    /// SEND Last.
    SendLast,
    /// SEND Last with Immediate.
    SendLastImm,
    /// SEND Only.
    SendOnly,
    /// SEND Only with Immediate.
    SendOnlyImm,
    /// Acknowledge (carries an AETH).
    Ack,
    /// An RC request this responder does not carry out: RDMA WRITE, READ,
    /// atomics, SEND with Invalidate, FLUSH. Its headers past the BTH are
    /// not read (the payload is everything after the BTH); at the expected
    /// PSN it is NAKed as an invalid request. [`Opcode::from_byte`] makes
    /// one only for those opcode bytes; any other byte here emits a packet
    /// that does not parse back as this.
    UnsupportedRequest(u8),
}

impl Opcode {
    /// Decode an opcode byte.
    pub fn from_byte(b: u8) -> Result<Opcode, WireError> {
        Ok(match b {
            0x00 => Opcode::SendFirst,
            0x01 => Opcode::SendMiddle,
            0x02 => Opcode::SendLast,
            0x03 => Opcode::SendLastImm,
            0x04 => Opcode::SendOnly,
            0x05 => Opcode::SendOnlyImm,
            0x11 => Opcode::Ack,
            // WRITE First..Only Imm, READ request, CmpSwap, FetchAdd, SEND
            // Last/Only with Invalidate, FLUSH, ATOMIC WRITE.
            0x06..=0x0c | 0x13 | 0x14 | 0x16 | 0x17 | 0x1c | 0x1d => Opcode::UnsupportedRequest(b),
            opcode => return Err(WireError::UnsupportedOpcode { opcode }),
        })
    }

    /// The opcode byte (RC transport, bits 7–5 = 0).
    pub fn byte(self) -> u8 {
        match self {
            Opcode::SendFirst => 0x00,
            Opcode::SendMiddle => 0x01,
            Opcode::SendLast => 0x02,
            Opcode::SendLastImm => 0x03,
            Opcode::SendOnly => 0x04,
            Opcode::SendOnlyImm => 0x05,
            Opcode::Ack => 0x11,
            Opcode::UnsupportedRequest(b) => b,
        }
    }

    /// True when an ImmDt header follows the BTH.
    pub fn has_imm(self) -> bool {
        matches!(self, Opcode::SendLastImm | Opcode::SendOnlyImm)
    }

    /// True when an AETH follows the BTH.
    pub fn has_aeth(self) -> bool {
        matches!(self, Opcode::Ack)
    }

    /// True for the first packet of a message.
    pub fn starts_message(self) -> bool {
        matches!(
            self,
            Opcode::SendFirst | Opcode::SendOnly | Opcode::SendOnlyImm
        )
    }

    /// True for the last packet of a message.
    pub fn ends_message(self) -> bool {
        matches!(
            self,
            Opcode::SendLast | Opcode::SendLastImm | Opcode::SendOnly | Opcode::SendOnlyImm
        )
    }
}

mod field {
    use std::ops::Range;
    pub const OPCODE: usize = 0;
    pub const FLAGS: usize = 1;
    pub const PKEY: Range<usize> = 2..4;
    pub const RESV8: usize = 4;
    pub const DEST_QP: Range<usize> = 5..8;
    pub const ACK_REQ: usize = 8;
    pub const PSN: Range<usize> = 9..12;
    pub const BTH_LEN: usize = 12;
    pub const AETH_LEN: usize = 4;
    pub const IMMDT_LEN: usize = 4;
    pub const ICRC_LEN: usize = 4;
}

/// Base transport header length.
pub const BTH_LEN: usize = field::BTH_LEN;
/// ICRC length.
pub const ICRC_LEN: usize = field::ICRC_LEN;
/// Largest header overhead of any packet the provider emits (BTH + ImmDt or AETH + ICRC).
pub const MAX_OVERHEAD: usize = BTH_LEN + 4 + ICRC_LEN + 3;
/// Default P_Key.
pub const DEFAULT_PKEY: u16 = 0xffff;
/// RoCEv2's UDP destination port (IANA). A peer listening on it (rxe, a
/// NIC) picks its source port per flow; a soft device elsewhere sends from
/// the port it listens on.
pub const ROCE_V2_PORT: u16 = 4791;

/// A view of a BTH over bytes.
#[derive(Debug, Clone)]
pub struct Bth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Bth<T> {
    /// Wrap without checks (for emission into a buffer known to be long enough).
    pub fn new_unchecked(buffer: T) -> Bth<T> {
        Bth { buffer }
    }

    /// Wrap untrusted bytes; fails when shorter than a BTH.
    pub fn new_checked(buffer: T) -> Result<Bth<T>, WireError> {
        let len = buffer.as_ref().len();
        if len < BTH_LEN {
            return Err(WireError::Truncated { len, need: BTH_LEN });
        }
        Ok(Bth { buffer })
    }

    /// Opcode byte.
    pub fn opcode(&self) -> u8 {
        self.buffer.as_ref()[field::OPCODE]
    }
    /// Solicited event bit.
    pub fn solicited(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x80 != 0
    }
    /// MigReq bit.
    pub fn mig_req(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x40 != 0
    }
    /// Pad count.
    pub fn pad_count(&self) -> u8 {
        (self.buffer.as_ref()[field::FLAGS] >> 4) & 0x3
    }
    /// Transport header version.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS] & 0x0f
    }
    /// P_Key.
    pub fn pkey(&self) -> u16 {
        let b = &self.buffer.as_ref()[field::PKEY];
        u16::from_be_bytes([b[0], b[1]])
    }
    /// Destination QP.
    pub fn dest_qp(&self) -> Qpn {
        let b = &self.buffer.as_ref()[field::DEST_QP];
        Qpn::new(u32::from_be_bytes([0, b[0], b[1], b[2]]))
    }
    /// AckReq bit.
    pub fn ack_req(&self) -> bool {
        self.buffer.as_ref()[field::ACK_REQ] & 0x80 != 0
    }
    /// PSN.
    pub fn psn(&self) -> Psn {
        let b = &self.buffer.as_ref()[field::PSN];
        Psn::new(u32::from_be_bytes([0, b[0], b[1], b[2]]))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Bth<T> {
    fn set_all(&mut self, r: &BthRepr) {
        let b = self.buffer.as_mut();
        b[field::OPCODE] = r.opcode.byte();
        b[field::FLAGS] =
            (u8::from(r.solicited) << 7) | (u8::from(r.mig_req) << 6) | ((r.pad_count & 3) << 4);
        b[field::PKEY].copy_from_slice(&r.pkey.to_be_bytes());
        b[field::RESV8] = 0;
        b[field::DEST_QP].copy_from_slice(&r.dest_qp.value().to_be_bytes()[1..]);
        b[field::ACK_REQ] = u8::from(r.ack_req) << 7;
        b[field::PSN].copy_from_slice(&r.psn.value().to_be_bytes()[1..]);
    }
}

/// The validated content of a BTH.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BthRepr {
    /// Operation.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// MigReq (the provider sets it, as NICs do when no migration is armed).
    pub mig_req: bool,
    /// Pad bytes after the payload.
    pub pad_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Destination QP.
    pub dest_qp: Qpn,
    /// Ask the responder for an ACK.
    pub ack_req: bool,
    /// Sequence number.
    pub psn: Psn,
}

impl BthRepr {
    /// Parse a checked view.
    pub fn parse<T: AsRef<[u8]>>(bth: &Bth<T>) -> Result<BthRepr, WireError> {
        let opcode = Opcode::from_byte(bth.opcode())?;
        if bth.version() != 0 {
            return Err(WireError::BadVersion {
                version: bth.version(),
            });
        }
        Ok(BthRepr {
            opcode,
            solicited: bth.solicited(),
            mig_req: bth.mig_req(),
            pad_count: bth.pad_count(),
            pkey: bth.pkey(),
            dest_qp: bth.dest_qp(),
            ack_req: bth.ack_req(),
            psn: bth.psn(),
        })
    }

    /// Write into the first 12 bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        Bth::new_unchecked(&mut buf[..BTH_LEN]).set_all(self);
    }
}

/// NAK codes of an AETH.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NakCode {
    /// PSN sequence error: the AETH's PSN is the one expected.
    PsnSequenceError,
    /// Invalid request (also: message longer than the receive buffer).
    InvalidRequest,
    /// Remote access error.
    RemoteAccessError,
    /// Remote operational error.
    RemoteOperationalError,
}

/// What an AETH says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AethKind {
    /// Positive acknowledgement with a credit code (0x1f: no flow control).
    Ack {
        /// Credit count code.
        credit: u8,
    },
    /// Receiver not ready; retry after the timer code's time.
    RnrNak {
        /// RNR timer code, 0..=31.
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
}

/// A view of an AETH.
#[derive(Debug, Clone)]
pub struct Aeth<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Aeth<T> {
    /// Wrap untrusted bytes; fails when shorter than an AETH.
    pub fn new_checked(buffer: T) -> Result<Aeth<T>, WireError> {
        let len = buffer.as_ref().len();
        if len < field::AETH_LEN {
            return Err(WireError::Truncated {
                len,
                need: field::AETH_LEN,
            });
        }
        Ok(Aeth { buffer })
    }
    /// Syndrome byte.
    pub fn syndrome(&self) -> u8 {
        self.buffer.as_ref()[0]
    }
    /// Message sequence number.
    pub fn msn(&self) -> u32 {
        let b = self.buffer.as_ref();
        u32::from_be_bytes([0, b[1], b[2], b[3]])
    }
}

/// The validated content of an AETH.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AethRepr {
    /// ACK, RNR NAK or NAK.
    pub kind: AethKind,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl AethRepr {
    /// Parse a checked view.
    pub fn parse<T: AsRef<[u8]>>(aeth: &Aeth<T>) -> Result<AethRepr, WireError> {
        let syndrome = aeth.syndrome();
        let low = syndrome & 0x1f;
        let kind = match (syndrome >> 5) & 0x3 {
            0b00 => AethKind::Ack { credit: low },
            0b01 => AethKind::RnrNak { timer: low },
            0b11 => AethKind::Nak(match low {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                _ => return Err(WireError::BadSyndrome { syndrome }),
            }),
            _ => return Err(WireError::BadSyndrome { syndrome }),
        };
        if syndrome & 0x80 != 0 {
            return Err(WireError::BadSyndrome { syndrome });
        }
        Ok(AethRepr {
            kind,
            msn: aeth.msn(),
        })
    }

    /// The syndrome byte.
    pub fn syndrome(&self) -> u8 {
        match self.kind {
            AethKind::Ack { credit } => credit & 0x1f,
            AethKind::RnrNak { timer } => 0x20 | (timer & 0x1f),
            AethKind::Nak(code) => {
                0x60 | match code {
                    NakCode::PsnSequenceError => 0,
                    NakCode::InvalidRequest => 1,
                    NakCode::RemoteAccessError => 2,
                    NakCode::RemoteOperationalError => 3,
                }
            }
        }
    }

    /// Write into the first 4 bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        buf[0] = self.syndrome();
        buf[1..4].copy_from_slice(&(self.msn & Psn::MASK).to_be_bytes()[1..]);
    }
}

/// Addresses the ICRC pseudo-header is built from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcrcContext {
    /// Source GID (IP).
    pub src: Gid,
    /// Destination GID (IP).
    pub dst: Gid,
    /// UDP source port.
    pub src_port: u16,
    /// UDP destination port.
    pub dst_port: u16,
}

/// ICRC over a real IPv4 header, UDP header and the RoCE part (BTH up to,
/// not including, the ICRC), masked as RoCEv2 requires.
pub fn icrc_ipv4(ip: &[u8; 20], udp: &[u8; 8], roce: &[u8]) -> u32 {
    let mut staged = Staged::new();
    staged.put(&[0xff; 8]);
    let ip_at = staged.put(ip);
    staged.mask(ip_at + 1); // TOS
    staged.mask(ip_at + 8); // TTL
    staged.mask(ip_at + 10); // header checksum
    staged.mask(ip_at + 11);
    staged.put_udp(udp);
    staged.finish(roce)
}

/// ICRC over a real IPv6 header, UDP header and the RoCE part.
pub fn icrc_ipv6(ip: &[u8; 40], udp: &[u8; 8], roce: &[u8]) -> u32 {
    let mut staged = Staged::new();
    staged.put(&[0xff; 8]);
    let ip_at = staged.put(ip);
    // Traffic class (low nibble of byte 0, high of byte 1), flow label
    // (bytes 1-3) and hop limit (byte 7).
    staged.buf[ip_at] |= 0x0f;
    for at in [1, 2, 3, 7] {
        staged.mask(ip_at + at);
    }
    staged.put_udp(udp);
    staged.finish(roce)
}

/// The bytes the ICRC covers, masked, copied to the stack so the hash takes
/// them in one call (two where the pseudo-header and the RoCE part exceed
/// [`Staged::LEN`]): short pieces cost crc32fast its table path
/// (docs/soft-provider.md § "The ICRC in one call").
struct Staged {
    buf: [u8; Staged::LEN],
    len: usize,
}

impl Staged {
    /// The pseudo-header (56 bytes at most, over IPv6) and the RoCE part of
    /// a small packet: an ACK, a lone record's SEND.
    const LEN: usize = 256;

    fn new() -> Staged {
        Staged {
            buf: [0; Staged::LEN],
            len: 0,
        }
    }

    /// Appends `bytes` (the pseudo-header's, which always fit); where they start.
    fn put(&mut self, bytes: &[u8]) -> usize {
        let at = self.len;
        self.buf[at..at + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
        at
    }

    fn mask(&mut self, at: usize) {
        self.buf[at] = 0xff;
    }

    /// The UDP header, its checksum masked.
    fn put_udp(&mut self, udp: &[u8; 8]) {
        let at = self.put(udp);
        self.mask(at + 6);
        self.mask(at + 7);
    }

    /// Hashes what is staged and `roce`, BTH byte 4 (FECN, BECN, reserved)
    /// masked; the caller guarantees a BTH.
    fn finish(mut self, roce: &[u8]) -> u32 {
        debug_assert!(roce.len() >= BTH_LEN, "the ICRC covers a BTH");
        let head = roce.len().min(Staged::LEN - self.len);
        let bth_at = self.put(&roce[..head]);
        self.mask(bth_at + 4);
        let mut h = hasher();
        h.update(&self.buf[..self.len]);
        h.update(&roce[head..]);
        h.finalize()
    }
}

/// A fresh CRC-32 hasher: a copy of one made once, as making one looks up
/// the CPU's features each time.
fn hasher() -> crc32fast::Hasher {
    static MADE: std::sync::OnceLock<crc32fast::Hasher> = std::sync::OnceLock::new();
    MADE.get_or_init(crc32fast::Hasher::new).clone()
}

/// ICRC over the soft provider's fixed pseudo-header for `roce` (BTH .. pad).
pub fn icrc(ctx: &IcrcContext, roce: &[u8]) -> u32 {
    let udp_len = 8 + roce.len() + ICRC_LEN;
    let mut udp = [0u8; 8];
    udp[0..2].copy_from_slice(&ctx.src_port.to_be_bytes());
    udp[2..4].copy_from_slice(&ctx.dst_port.to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    match (ctx.src.to_ipv4(), ctx.dst.to_ipv4()) {
        (Some(src), Some(dst)) => icrc_ipv4(&ipv4_header(src, dst, 20 + udp_len), &udp, roce),
        _ => {
            let mut ip = [0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
            ip[6] = 17;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&Ipv6Addr::from(ctx.src.0).octets());
            ip[24..40].copy_from_slice(&Ipv6Addr::from(ctx.dst.0).octets());
            icrc_ipv6(&ip, &udp, roce)
        }
    }
}

fn ipv4_header(src: Ipv4Addr, dst: Ipv4Addr, total_len: usize) -> [u8; 20] {
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&(total_len as u16).to_be_bytes());
    // Identification 0 (a UDP socket cannot see the real one), DF set.
    ip[6] = 0x40;
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    ip
}

/// The validated headers of a packet; the payload stays in the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketRepr {
    /// Base transport header.
    pub bth: BthRepr,
    /// AETH, present exactly on ACKs.
    pub aeth: Option<AethRepr>,
    /// Immediate data, present exactly on SEND *_WITH_IMM (a WRITE with
    /// immediate is an [`Opcode::UnsupportedRequest`], its ImmDt unread).
    pub imm: Option<u32>,
}

impl PacketRepr {
    /// Header bytes before the payload.
    pub fn header_len(&self) -> usize {
        BTH_LEN
            + self.aeth.map_or(0, |_| field::AETH_LEN)
            + self.imm.map_or(0, |_| field::IMMDT_LEN)
    }

    /// Emit headers, `payload`, pad and ICRC into `buf`; returns the length.
    /// Sets `bth.pad_count` from the payload length. `buf` must hold
    /// `header_len() + payload.len() + 3 + 4` bytes.
    pub fn emit(&self, ctx: &IcrcContext, payload: &[u8], buf: &mut [u8]) -> usize {
        let at = self.header_len();
        buf[at..at + payload.len()].copy_from_slice(payload);
        self.emit_around(ctx, payload.len(), buf)
    }

    /// Like [`PacketRepr::emit`] for a payload of `payload_len` bytes that the
    /// caller already placed at `buf[header_len()..]` (gathered in place).
    pub fn emit_around(&self, ctx: &IcrcContext, payload_len: usize, buf: &mut [u8]) -> usize {
        let pad = (4 - payload_len % 4) % 4;
        let mut bth = self.bth;
        bth.pad_count = pad as u8;
        bth.emit(buf);
        let mut at = BTH_LEN;
        if let Some(aeth) = &self.aeth {
            aeth.emit(&mut buf[at..]);
            at += field::AETH_LEN;
        }
        if let Some(imm) = self.imm {
            buf[at..at + 4].copy_from_slice(&imm.to_be_bytes());
            at += field::IMMDT_LEN;
        }
        at += payload_len;
        buf[at..at + pad].fill(0);
        at += pad;
        let crc = icrc(ctx, &buf[..at]);
        buf[at..at + ICRC_LEN].copy_from_slice(&crc.to_le_bytes());
        at + ICRC_LEN
    }
}

/// A parsed, validated packet borrowing its payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet<'a> {
    /// Headers.
    pub repr: PacketRepr,
    /// Payload without pad.
    pub payload: &'a [u8],
}

impl<'a> Packet<'a> {
    /// Parse and validate an untrusted UDP payload, checking the ICRC under `ctx`.
    pub fn parse(ctx: &IcrcContext, bytes: &'a [u8]) -> Result<Packet<'a>, WireError> {
        let bth = Bth::new_checked(bytes)?;
        let bth = BthRepr::parse(&bth)?;
        let mut at = BTH_LEN;
        let need_headers =
            at + if bth.opcode.has_aeth() {
                field::AETH_LEN
            } else {
                0
            } + if bth.opcode.has_imm() {
                field::IMMDT_LEN
            } else {
                0
            };
        let need = need_headers + ICRC_LEN;
        if bytes.len() < need {
            return Err(WireError::Truncated {
                len: bytes.len(),
                need,
            });
        }
        let aeth = if bth.opcode.has_aeth() {
            let a = AethRepr::parse(&Aeth::new_checked(&bytes[at..at + field::AETH_LEN])?)?;
            at += field::AETH_LEN;
            Some(a)
        } else {
            None
        };
        let imm = if bth.opcode.has_imm() {
            let b = &bytes[at..at + 4];
            at += field::IMMDT_LEN;
            Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        } else {
            None
        };
        let end = bytes.len() - ICRC_LEN;
        let payload_and_pad = end - at;
        let pad = usize::from(bth.pad_count);
        if payload_and_pad % 4 != 0 || pad > payload_and_pad {
            return Err(WireError::BadPad {
                pad: bth.pad_count,
                payload_and_pad,
            });
        }
        if bth.opcode == Opcode::Ack && payload_and_pad != 0 {
            return Err(WireError::AckWithPayload {
                len: payload_and_pad,
            });
        }
        let i = &bytes[end..];
        let found = u32::from_le_bytes([i[0], i[1], i[2], i[3]]);
        let computed = icrc(ctx, &bytes[..end]);
        if computed != found {
            return Err(WireError::BadIcrc { computed, found });
        }
        Ok(Packet {
            repr: PacketRepr { bth, aeth, imm },
            payload: &bytes[at..end - pad],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // ConnectX-4 Lx CNP capture from scapy's test/contrib/roce.uts: the IPv4
    // header, UDP header, BTH + 16 bytes of CNP padding, and ICRC 82 fd 00 2a.
    const CX4_IP: [u8; 20] = [
        0x45, 0xc2, 0x00, 0x3c, 0x71, 0x8c, 0x40, 0x00, 0x40, 0x11, 0x91, 0x61, 0x0a, 0x00, 0x11,
        0x01, 0x0a, 0x00, 0x12, 0x01,
    ];
    const CX4_UDP: [u8; 8] = [0x00, 0x00, 0x12, 0xb7, 0x00, 0x28, 0x00, 0x00];
    const CX4_BTH: [u8; 12] = [
        0x81, 0x00, 0xff, 0xff, 0x40, 0x00, 0x01, 0x18, 0x00, 0x00, 0x00, 0x00,
    ];
    const CX4_ICRC: [u8; 4] = [0x82, 0xfd, 0x00, 0x2a];

    /// The ICRC as RoCEv2 defines it: one CRC-32 over the masked bytes laid
    /// end to end.
    fn icrc_reference(ip: &[u8], udp: &[u8; 8], roce: &[u8]) -> u32 {
        let mut ip = ip.to_vec();
        let masked: &[usize] = if ip.len() == 20 {
            &[1, 8, 10, 11]
        } else {
            ip[0] |= 0x0f;
            &[1, 2, 3, 7]
        };
        for &at in masked {
            ip[at] = 0xff;
        }
        let mut all = vec![0xff; 8];
        all.extend_from_slice(&ip);
        all.extend_from_slice(&udp[..6]);
        all.extend_from_slice(&[0xff, 0xff]);
        all.extend_from_slice(roce);
        all[8 + ip.len() + 8 + 4] = 0xff;
        crc32fast::hash(&all)
    }

    #[test]
    fn the_staged_icrc_is_the_crc_of_the_masked_bytes_at_every_length() {
        let mut ip6 = [0u8; 40];
        ip6[0] = 0x6a;
        for (i, b) in ip6.iter_mut().enumerate().skip(1) {
            *b = (i * 7) as u8;
        }
        let roce: Vec<u8> = (0..700u32).map(|i| (i * 31 + 5) as u8).collect();
        // Across the stage's end (256 less a 36- or 56-byte pseudo-header),
        // with tails shorter and longer than one 16-byte block.
        for len in BTH_LEN..roce.len() {
            let roce = &roce[..len];
            assert_eq!(
                icrc_ipv4(&CX4_IP, &CX4_UDP, roce),
                icrc_reference(&CX4_IP, &CX4_UDP, roce),
                "IPv4, {len} bytes"
            );
            assert_eq!(
                icrc_ipv6(&ip6, &CX4_UDP, roce),
                icrc_reference(&ip6, &CX4_UDP, roce),
                "IPv6, {len} bytes"
            );
        }
    }

    #[test]
    fn icrc_matches_connectx_capture() {
        let mut roce = CX4_BTH.to_vec();
        roce.extend_from_slice(&[0u8; 16]);
        let crc = icrc_ipv4(&CX4_IP, &CX4_UDP, &roce);
        assert_eq!(crc.to_le_bytes(), CX4_ICRC);
    }

    fn ctx() -> IcrcContext {
        IcrcContext {
            src: Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1)),
            dst: Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 2)),
            src_port: 40000,
            dst_port: 40001,
        }
    }

    fn send_repr(opcode: Opcode, imm: Option<u32>) -> PacketRepr {
        PacketRepr {
            bth: BthRepr {
                opcode,
                solicited: false,
                mig_req: true,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                dest_qp: Qpn::new(0x12_3456),
                ack_req: true,
                psn: Psn::new(0xab_cdef),
            },
            aeth: None,
            imm,
        }
    }

    fn ack_repr(kind: AethKind) -> PacketRepr {
        PacketRepr {
            bth: BthRepr {
                opcode: Opcode::Ack,
                solicited: false,
                mig_req: false,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                dest_qp: Qpn::new(7),
                ack_req: false,
                psn: Psn::new(5),
            },
            aeth: Some(AethRepr {
                kind,
                msn: 0x01_0203,
            }),
            imm: None,
        }
    }

    fn emit(repr: &PacketRepr, payload: &[u8]) -> Vec<u8> {
        let mut buf = vec![0xa5u8; repr.header_len() + payload.len() + 7];
        let n = repr.emit(&ctx(), payload, &mut buf);
        buf.truncate(n);
        buf
    }

    #[test]
    fn send_only_imm_known_bytes() {
        let bytes = emit(&send_repr(Opcode::SendOnlyImm, Some(0xdead_beef)), b"abcde");
        assert_eq!(
            &bytes[..16],
            &[
                0x05, 0x70, 0xff, 0xff, 0x00, 0x12, 0x34, 0x56, 0x80, 0xab, 0xcd, 0xef, 0xde, 0xad,
                0xbe, 0xef
            ]
        );
        assert_eq!(&bytes[16..24], b"abcde\0\0\0");
        assert_eq!(bytes.len(), 28);
        let p = Packet::parse(&ctx(), &bytes).expect("valid");
        assert_eq!(p.payload, b"abcde");
        assert_eq!(p.repr.imm, Some(0xdead_beef));
        assert_eq!(p.repr.bth.pad_count, 3);
    }

    #[test]
    fn ack_round_trips_every_kind() {
        let kinds = [
            AethKind::Ack { credit: 0x1f },
            AethKind::RnrNak { timer: 12 },
            AethKind::Nak(NakCode::PsnSequenceError),
            AethKind::Nak(NakCode::InvalidRequest),
            AethKind::Nak(NakCode::RemoteAccessError),
            AethKind::Nak(NakCode::RemoteOperationalError),
        ];
        for kind in kinds {
            let repr = ack_repr(kind);
            let bytes = emit(&repr, &[]);
            let p = Packet::parse(&ctx(), &bytes).expect("valid");
            assert_eq!(p.repr, repr);
            assert!(p.payload.is_empty());
        }
    }

    #[test]
    fn every_truncated_prefix_is_an_error() {
        let cases = [
            emit(&send_repr(Opcode::SendOnlyImm, Some(1)), b"hello world"),
            emit(&send_repr(Opcode::SendMiddle, None), &[7u8; 64]),
            emit(&ack_repr(AethKind::Ack { credit: 0x1f }), &[]),
        ];
        for bytes in cases {
            for n in 0..bytes.len() {
                assert!(
                    Packet::parse(&ctx(), &bytes[..n]).is_err(),
                    "prefix {n} accepted"
                );
            }
        }
    }

    #[test]
    fn an_rc_request_not_carried_out_parses_with_its_icrc_checked() {
        // RDMA WRITE Only: RETH (16 bytes) and 8 bytes of data.
        let repr = send_repr(Opcode::UnsupportedRequest(0x0a), None);
        let good = emit(&repr, &[7; 24]);
        let pkt = Packet::parse(&ctx(), &good).unwrap();
        assert_eq!(pkt.repr.bth.opcode, Opcode::UnsupportedRequest(0x0a));
        assert!(!pkt.repr.bth.opcode.starts_message() && !pkt.repr.bth.opcode.ends_message());
        let mut corrupt = good.clone();
        corrupt[BTH_LEN] ^= 1;
        assert!(matches!(
            Packet::parse(&ctx(), &corrupt),
            Err(WireError::BadIcrc { .. })
        ));
        // Every byte: the SENDs and ACK spoken, the RC requests NAKed, the
        // rest (READ and atomic responses, reserved, other transports) refused.
        for b in 0..=u8::MAX {
            let request = matches!(b, 0x06..=0x0c | 0x13 | 0x14 | 0x16 | 0x17 | 0x1c | 0x1d);
            match Opcode::from_byte(b) {
                Ok(Opcode::UnsupportedRequest(byte)) => assert!(request && byte == b, "{b:#04x}"),
                Ok(op) => assert!(
                    matches!(b, 0x00..=0x05 | 0x11) && op.byte() == b,
                    "{b:#04x}"
                ),
                Err(e) => {
                    assert!(!request && !matches!(b, 0x00..=0x05 | 0x11), "{b:#04x}");
                    assert_eq!(e, WireError::UnsupportedOpcode { opcode: b });
                }
            }
        }
    }

    #[test]
    fn bad_opcode_pad_syndrome_and_icrc_are_errors() {
        let good = emit(&send_repr(Opcode::SendOnly, None), b"12345678");
        let mut b = good.clone();
        b[0] = 0x10; // RDMA READ Response Only: no READ is ever issued
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::UnsupportedOpcode { opcode: 0x10 })
        ));
        let mut b = good.clone();
        b[0] = 0x64; // UD SEND Only
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::UnsupportedOpcode { .. })
        ));
        // Pad bigger than what is there: a 2-byte payload region is not aligned.
        let mut b = good[..BTH_LEN].to_vec();
        b.extend_from_slice(&[1, 2]);
        b.extend_from_slice(&[0; 4]);
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::BadPad { .. })
        ));
        // Pad count 3 with no payload at all.
        let mut b = emit(&send_repr(Opcode::SendOnly, None), &[]);
        b[1] |= 0x30;
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::BadPad { .. })
        ));
        // Version 1.
        let mut b = good.clone();
        b[1] |= 0x01;
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::BadVersion { version: 1 })
        ));
        // Corrupt one payload byte.
        let mut b = good.clone();
        b[13] ^= 1;
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::BadIcrc { .. })
        ));
        // Another context (different port) does not validate.
        let mut other = ctx();
        other.dst_port += 1;
        assert!(Packet::parse(&other, &good).is_err());
        // Reserved syndrome.
        let mut b = emit(&ack_repr(AethKind::Ack { credit: 0 }), &[]);
        b[BTH_LEN] = 0x40;
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::BadSyndrome { .. })
        ));
        // ACK with payload.
        let mut b = emit(&ack_repr(AethKind::Ack { credit: 0 }), &[]);
        b.splice(BTH_LEN + 4..BTH_LEN + 4, [0u8; 4]);
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::AckWithPayload { .. })
        ));
    }

    #[test]
    fn pad_is_covered_by_icrc() {
        let mut b = emit(&send_repr(Opcode::SendOnly, None), b"abc");
        let pad_at = BTH_LEN + 3;
        b[pad_at] = 9;
        assert!(matches!(
            Packet::parse(&ctx(), &b),
            Err(WireError::BadIcrc { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn send_round_trip(op in 0u8..6, psn in 0u32..(1 << 24), qp in 0u32..(1 << 24),
                           ack in proptest::bool::ANY, imm in proptest::num::u32::ANY,
                           payload in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let opcode = Opcode::from_byte(op).expect("send opcode");
            let mut repr = send_repr(opcode, opcode.has_imm().then_some(imm));
            repr.bth.psn = Psn::new(psn);
            repr.bth.dest_qp = Qpn::new(qp);
            repr.bth.ack_req = ack;
            let bytes = emit(&repr, &payload);
            let p = Packet::parse(&ctx(), &bytes).expect("valid");
            repr.bth.pad_count = ((4 - payload.len() % 4) % 4) as u8;
            proptest::prop_assert_eq!(p.repr, repr);
            proptest::prop_assert_eq!(p.payload, &payload[..]);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..80)) {
            if let Ok(p) = Packet::parse(&ctx(), &bytes) {
                proptest::prop_assert!(p.payload.len() <= bytes.len());
            }
        }
    }
}
