//! Bootstrap message formats: typed values, their encoding, and a checked
//! decoder that turns hostile bytes into a value or a [`BootstrapError`].
//!
//! Every message is `len: u32 BE` then `len` body bytes (1..=[`MAX_MESSAGE`]);
//! the body's first byte is its [`MessageKind`]. All integers are big-endian.
//! Byte layouts are tabled in `docs/bootstrap.md`.

use std::fmt;

use super::error::BootstrapError;
use crate::mux::PeerId;
use crate::mux::protocol::Epoch;

/// Largest message body accepted or sent.
pub const MAX_MESSAGE: usize = 4096;
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 7;
/// Leading bytes of a challenge and a hello.
pub const MAGIC: [u8; 4] = *b"QPMX";
/// Bytes in a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes in a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;

/// A handshake nonce.
pub type Nonce = [u8; NONCE_LEN];

/// What a message is, by its first body byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageKind {
    /// Listener → dialer: the listener's nonce.
    Challenge,
    /// Either way: who I am and where my endpoint is.
    Hello,
    /// Dialer → listener: the dialer agrees on the epoch.
    Ready,
    /// Listener → dialer: not this connection (not a fault).
    Decline,
}

impl MessageKind {
    fn code(self) -> u8 {
        match self {
            MessageKind::Challenge => 1,
            MessageKind::Hello => 2,
            MessageKind::Ready => 3,
            MessageKind::Decline => 4,
        }
    }

    fn from_code(code: u8) -> Result<MessageKind, BootstrapError> {
        match code {
            1 => Ok(MessageKind::Challenge),
            2 => Ok(MessageKind::Hello),
            3 => Ok(MessageKind::Ready),
            4 => Ok(MessageKind::Decline),
            other => Err(BootstrapError::UnknownMessage(other)),
        }
    }
}

/// Why a listener declined a well-formed, authenticated dial.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeclineReason {
    /// Both sides dialed at once and this connection lost the tie-break.
    CrossedDial,
    /// The dial predates the epoch already running between the two nodes.
    StaleDial,
    /// The listener is not ready to take connections (no mux yet, shutting
    /// down, at a limit, out of resources).
    Unavailable,
    /// The dialer's endpoint is for another transport (a TCP node dialed by
    /// an RDMA one, or the other way round). Asking again will not help.
    WrongTransport,
    /// The dialer's endpoint cannot work with the listener's (e.g. another
    /// receive depth or buffer size; the listener logs which field). Asking
    /// again will not help until one side is configured like the other.
    Incompatible,
}

impl fmt::Display for DeclineReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeclineReason::CrossedDial => "crossed dial",
            DeclineReason::StaleDial => "stale dial",
            DeclineReason::Unavailable => "unavailable",
            DeclineReason::WrongTransport => "the listener runs another transport",
            DeclineReason::Incompatible => "incompatible endpoint (see the listener's log)",
        })
    }
}

impl DeclineReason {
    /// True for a decline no redial mends until a setting changes (another
    /// transport, an incompatible endpoint); false for races and limits.
    pub fn is_permanent(self) -> bool {
        matches!(
            self,
            DeclineReason::WrongTransport | DeclineReason::Incompatible
        )
    }

    fn code(self) -> u8 {
        match self {
            DeclineReason::CrossedDial => 1,
            DeclineReason::StaleDial => 2,
            DeclineReason::Unavailable => 3,
            DeclineReason::WrongTransport => 4,
            DeclineReason::Incompatible => 5,
        }
    }

    fn from_code(code: u8) -> Result<DeclineReason, BootstrapError> {
        match code {
            1 => Ok(DeclineReason::CrossedDial),
            2 => Ok(DeclineReason::StaleDial),
            3 => Ok(DeclineReason::Unavailable),
            4 => Ok(DeclineReason::WrongTransport),
            5 => Ok(DeclineReason::Incompatible),
            _ => Err(BootstrapError::BadField("decline reason")),
        }
    }
}

/// Which transport an endpoint blob describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointKind {
    /// [`TcpEndpoint`].
    Tcp,
    /// [`RdmaEndpoint`].
    Rdma,
}

impl EndpointKind {
    fn code(self) -> u8 {
        match self {
            EndpointKind::Tcp => 1,
            EndpointKind::Rdma => 2,
        }
    }
}

/// The TCP link's endpoint: what the sender will accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpEndpoint {
    /// Largest batch the sender of this hello will receive.
    pub max_batch: u32,
}

impl TcpEndpoint {
    /// Smallest `max_batch` accepted.
    pub const MIN_BATCH: u32 = 64;
    /// Largest `max_batch` accepted.
    pub const MAX_BATCH: u32 = 16 << 20;
    const LEN: usize = 4;
}

/// The RDMA link's endpoint: enough to move a fresh RC QP to RTR/RTS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// Queue pair number (24 bits, not 0 or 1).
    pub qpn: u32,
    /// Starting packet sequence number (24 bits).
    pub psn: u32,
    /// Port GID.
    pub gid: [u8; 16],
    /// GID table index.
    pub gid_index: u8,
    /// Path MTU in bytes: 256, 512, 1024, 2048 or 4096.
    pub mtu: u16,
    /// Receives posted per lane.
    pub recv_depth: u32,
    /// Bytes per receive buffer (the largest batch the sender will take).
    pub recv_buf_size: u32,
    /// Lanes (independent credit streams) the sender offers.
    pub lanes: u16,
    /// The device's RoCEv2 UDP port (4791 on hardware; soft devices may use
    /// any, so the peer must be told).
    pub udp_port: u16,
}

impl RdmaEndpoint {
    /// Largest receive depth accepted.
    pub const MAX_RECV_DEPTH: u32 = 1 << 16;
    /// Largest lane count accepted.
    pub const MAX_LANES: u16 = 256;
    const LEN: usize = 4 + 4 + 16 + 1 + 2 + 4 + 4 + 2 + 2;
}

/// A transport-specific endpoint description carried in a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP link.
    Tcp(TcpEndpoint),
    /// An RDMA link.
    Rdma(RdmaEndpoint),
}

impl Endpoint {
    /// The transport this endpoint belongs to.
    pub fn kind(&self) -> EndpointKind {
        match self {
            Endpoint::Tcp(_) => EndpointKind::Tcp,
            Endpoint::Rdma(_) => EndpointKind::Rdma,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.kind().code());
        match self {
            Endpoint::Tcp(t) => {
                out.extend_from_slice(&(TcpEndpoint::LEN as u16).to_be_bytes());
                out.extend_from_slice(&t.max_batch.to_be_bytes());
            }
            Endpoint::Rdma(r) => {
                out.extend_from_slice(&(RdmaEndpoint::LEN as u16).to_be_bytes());
                out.extend_from_slice(&r.qpn.to_be_bytes());
                out.extend_from_slice(&r.psn.to_be_bytes());
                out.extend_from_slice(&r.gid);
                out.push(r.gid_index);
                out.extend_from_slice(&r.mtu.to_be_bytes());
                out.extend_from_slice(&r.recv_depth.to_be_bytes());
                out.extend_from_slice(&r.recv_buf_size.to_be_bytes());
                out.extend_from_slice(&r.lanes.to_be_bytes());
                out.extend_from_slice(&r.udp_port.to_be_bytes());
            }
        }
    }

    fn decode(r: &mut Reader<'_>) -> Result<Endpoint, BootstrapError> {
        let kind = r.u8()?;
        let len = usize::from(r.u16()?);
        let mut blob = Reader::new(r.bytes(len)?);
        let endpoint = match kind {
            1 => {
                if len != TcpEndpoint::LEN {
                    return Err(BootstrapError::BadField("tcp endpoint length"));
                }
                let max_batch = blob.u32()?;
                if !(TcpEndpoint::MIN_BATCH..=TcpEndpoint::MAX_BATCH).contains(&max_batch) {
                    return Err(BootstrapError::BadField("tcp max_batch"));
                }
                Endpoint::Tcp(TcpEndpoint { max_batch })
            }
            2 => {
                if len != RdmaEndpoint::LEN {
                    return Err(BootstrapError::BadField("rdma endpoint length"));
                }
                let e = RdmaEndpoint {
                    qpn: blob.u32()?,
                    psn: blob.u32()?,
                    gid: blob.array()?,
                    gid_index: blob.u8()?,
                    mtu: blob.u16()?,
                    recv_depth: blob.u32()?,
                    recv_buf_size: blob.u32()?,
                    lanes: blob.u16()?,
                    udp_port: blob.u16()?,
                };
                if !(2..=0x00ff_ffff).contains(&e.qpn) {
                    return Err(BootstrapError::BadField("rdma qpn"));
                }
                if e.psn > 0x00ff_ffff {
                    return Err(BootstrapError::BadField("rdma psn"));
                }
                if ![256, 512, 1024, 2048, 4096].contains(&e.mtu) {
                    return Err(BootstrapError::BadField("rdma mtu"));
                }
                if !(1..=RdmaEndpoint::MAX_RECV_DEPTH).contains(&e.recv_depth) {
                    return Err(BootstrapError::BadField("rdma recv_depth"));
                }
                if !(TcpEndpoint::MIN_BATCH..=TcpEndpoint::MAX_BATCH).contains(&e.recv_buf_size) {
                    return Err(BootstrapError::BadField("rdma recv_buf_size"));
                }
                if !(1..=RdmaEndpoint::MAX_LANES).contains(&e.lanes) {
                    return Err(BootstrapError::BadField("rdma lanes"));
                }
                if e.udp_port == 0 {
                    return Err(BootstrapError::BadField("rdma udp_port"));
                }
                Endpoint::Rdma(e)
            }
            _ => return Err(BootstrapError::BadField("endpoint kind")),
        };
        blob.finish()?;
        Ok(endpoint)
    }
}

/// The fields of a hello: who the sender is and what it offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloFields {
    /// The sender's node id.
    pub node: PeerId,
    /// The sender's incarnation: random per process start, so a restart shows.
    pub incarnation: u64,
    /// The sender's proposal: the last epoch it ran with this peer.
    pub proposed: Epoch,
    /// The sender's transport endpoint.
    pub endpoint: Endpoint,
    /// Bytes the sender lets each slot have outstanding toward it (its
    /// `MuxConfig::slot_window`): the peer's egress window. Never 0.
    pub slot_window: u32,
    /// Bytes the sender lets all slots together have outstanding toward it
    /// (its `MuxConfig::peer_window`), and the most peer credit it ever
    /// grants. Never 0.
    pub peer_window: u32,
    /// The peer credit the receiver of the hello starts the epoch with: the
    /// window less what the sender still holds of the receiver's data, or
    /// may yet receive on a live epoch (`Mux::peer_room`). At most
    /// `peer_window`.
    pub peer_credit: u32,
    /// The largest record or message the sender accepts (its
    /// `MuxConfig::max_record`); the receiver of the hello sends none
    /// larger (0 acts as 1).
    pub max_record: u32,
    /// The live slots, both ways, the sender allows with the receiver (its
    /// `MuxConfig::max_slots_per_peer`); the receiver opens no more than
    /// the smaller of this and its own limit.
    pub max_slots: u32,
}

/// A decoded hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct HelloMessage {
    pub(crate) fields: HelloFields,
    pub(crate) echo: Nonce,
    pub(crate) nonce: Nonce,
    pub(crate) mac: Option<[u8; MAC_LEN]>,
    /// Length of the body before the MAC trailer (what the MAC covers).
    pub(crate) signed_len: usize,
}

/// A decoded message body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Message {
    Challenge {
        version: u16,
        nonce: Nonce,
    },
    Hello(HelloMessage),
    Ready {
        epoch: Epoch,
        mac: Option<[u8; MAC_LEN]>,
        signed_len: usize,
    },
    Decline(DeclineReason),
}

impl Message {
    pub(crate) fn kind(&self) -> MessageKind {
        match self {
            Message::Challenge { .. } => MessageKind::Challenge,
            Message::Hello(_) => MessageKind::Hello,
            Message::Ready { .. } => MessageKind::Ready,
            Message::Decline(_) => MessageKind::Decline,
        }
    }
}

/// A bounds-checked cursor; every accessor fails with `Truncated` instead of panicking.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf }
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], BootstrapError> {
        if self.buf.len() < n {
            return Err(BootstrapError::Truncated);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], BootstrapError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, BootstrapError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, BootstrapError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, BootstrapError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, BootstrapError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn remaining(&self) -> usize {
        self.buf.len()
    }

    fn finish(&self) -> Result<(), BootstrapError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(BootstrapError::TrailingBytes)
        }
    }
}

fn magic_and_version(r: &mut Reader<'_>) -> Result<u16, BootstrapError> {
    if r.array::<4>()? != MAGIC {
        return Err(BootstrapError::BadMagic);
    }
    let version = r.u16()?;
    if version != PROTOCOL_VERSION {
        return Err(BootstrapError::BadVersion { got: version });
    }
    Ok(version)
}

/// The MAC trailer: `mac_len: u8` (0 or 32) then the MAC. Returns the MAC and
/// the signed length (body bytes before the trailer).
fn mac_trailer(
    body: &[u8],
    r: &mut Reader<'_>,
) -> Result<(Option<[u8; MAC_LEN]>, usize), BootstrapError> {
    let signed_len = body.len() - r.remaining();
    let mac = match r.u8()? {
        0 => None,
        32 => Some(r.array::<MAC_LEN>()?),
        _ => return Err(BootstrapError::BadField("mac length")),
    };
    r.finish()?;
    Ok((mac, signed_len))
}

/// Decodes one message body (without its length prefix).
pub(crate) fn decode(body: &[u8]) -> Result<Message, BootstrapError> {
    let mut r = Reader::new(body);
    let kind = MessageKind::from_code(r.u8()?)?;
    match kind {
        MessageKind::Challenge => {
            let version = magic_and_version(&mut r)?;
            let nonce = r.array()?;
            r.finish()?;
            Ok(Message::Challenge { version, nonce })
        }
        MessageKind::Hello => {
            magic_and_version(&mut r)?;
            let node = PeerId(r.u64()?);
            let incarnation = r.u64()?;
            let proposed = Epoch(r.u64()?);
            if proposed.0 == u64::MAX {
                return Err(BootstrapError::BadField("proposed epoch"));
            }
            let echo = r.array()?;
            let nonce = r.array()?;
            let endpoint = Endpoint::decode(&mut r)?;
            let slot_window = r.u32()?;
            if slot_window == 0 {
                return Err(BootstrapError::BadField("slot window"));
            }
            let peer_window = r.u32()?;
            // One no larger than a record's overhead carries no data at all.
            if peer_window as usize <= crate::mux::RECORD_OVERHEAD {
                return Err(BootstrapError::BadField("peer window"));
            }
            let peer_credit = r.u32()?;
            if peer_credit > peer_window {
                return Err(BootstrapError::BadField("peer credit"));
            }
            let max_record = r.u32()?;
            let max_slots = r.u32()?;
            let (mac, signed_len) = mac_trailer(body, &mut r)?;
            Ok(Message::Hello(HelloMessage {
                fields: HelloFields {
                    node,
                    incarnation,
                    proposed,
                    endpoint,
                    slot_window,
                    peer_window,
                    peer_credit,
                    max_record,
                    max_slots,
                },
                echo,
                nonce,
                mac,
                signed_len,
            }))
        }
        MessageKind::Ready => {
            let epoch = Epoch(r.u64()?);
            let (mac, signed_len) = mac_trailer(body, &mut r)?;
            Ok(Message::Ready {
                epoch,
                mac,
                signed_len,
            })
        }
        MessageKind::Decline => {
            let reason = DeclineReason::from_code(r.u8()?)?;
            r.finish()?;
            Ok(Message::Decline(reason))
        }
    }
}

/// Encodes a challenge body.
pub(crate) fn challenge(nonce: &Nonce) -> Vec<u8> {
    let mut out = vec![MessageKind::Challenge.code()];
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.extend_from_slice(nonce);
    out
}

/// Encodes the signed part of a hello body (the MAC trailer is appended later).
pub(crate) fn hello_signed(fields: &HelloFields, echo: &Nonce, nonce: &Nonce) -> Vec<u8> {
    let mut out = vec![MessageKind::Hello.code()];
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.extend_from_slice(&fields.node.0.to_be_bytes());
    out.extend_from_slice(&fields.incarnation.to_be_bytes());
    out.extend_from_slice(&fields.proposed.0.to_be_bytes());
    out.extend_from_slice(echo);
    out.extend_from_slice(nonce);
    fields.endpoint.encode(&mut out);
    out.extend_from_slice(&fields.slot_window.to_be_bytes());
    out.extend_from_slice(&fields.peer_window.to_be_bytes());
    out.extend_from_slice(&fields.peer_credit.to_be_bytes());
    out.extend_from_slice(&fields.max_record.to_be_bytes());
    out.extend_from_slice(&fields.max_slots.to_be_bytes());
    out
}

/// Encodes the signed part of a ready body.
pub(crate) fn ready_signed(epoch: Epoch) -> Vec<u8> {
    let mut out = vec![MessageKind::Ready.code()];
    out.extend_from_slice(&epoch.0.to_be_bytes());
    out
}

/// Encodes a decline body.
pub(crate) fn decline(reason: DeclineReason) -> Vec<u8> {
    vec![MessageKind::Decline.code(), reason.code()]
}

/// Appends the MAC trailer to a signed body.
pub(crate) fn with_mac(mut signed: Vec<u8>, mac: Option<[u8; MAC_LEN]>) -> Vec<u8> {
    match mac {
        Some(mac) => {
            signed.push(MAC_LEN as u8);
            signed.extend_from_slice(&mac);
        }
        None => signed.push(0),
    }
    signed
}

/// Appends `body` to `out` with its length prefix.
pub(crate) fn frame(out: &mut Vec<u8>, body: &[u8]) {
    debug_assert!(!body.is_empty() && body.len() <= MAX_MESSAGE);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
}
