//! Verbs provider seam: the subset of RDMA verbs one RC mux link needs.
//!
//! ```text
//!  link/rdma ── Device ──► ProtectionDomain ─► MemoryRegion (lkey, chunk guards, safe byte access)
//!                 │
//!                 ├──────► CompletionQueue  (poll into a slice; arm + await, one shot)
//!                 └──────► QueuePair (RC)   RESET ─► INIT ─► RTR ─► RTS, any ─► ERR
//!                                           post_send / post_recv ─► completions on the CQs
//! ```
//!
//! Static dispatch: a [`Device`] names its resource types as associated
//! types, so a libibverbs provider can wrap `ibv_*` handles one to one and the
//! link layer is generic over `D: Device` (docs/soft-provider.md, Rulings).
//! Providers: [`soft`] (userspace RoCEv2 RC over UDP, or over a simulated
//! network) is always present.
//!
//! One SEND_WITH_IMM between two QPs, over the simulated network (with
//! `SoftDevice::open_udp` instead, the driver task replaces `net.drive`):
//!
//! ```
//! use qpmux::verbs::soft::{sim::SimNet, SoftConfig};
//! use qpmux::verbs::*;
//!
//! let mut net = SimNet::new(7);
//! let devs = [net.add_device(SoftConfig::default()), net.add_device(SoftConfig::default())];
//! let mut ends = Vec::new();
//! for dev in &devs {
//!     let pd = dev.alloc_pd()?;
//!     let cq = dev.create_cq(64)?;
//!     let qp = dev.create_qp(&pd, &cq, &cq, QpCaps::default())?;
//!     let mr = dev.reg_mr(&pd, 4096, AccessFlags::LOCAL_WRITE)?;
//!     qp.modify_to_init(InitAttr { access: AccessFlags::LOCAL_WRITE })?;
//!     ends.push((cq, qp, mr));
//! }
//! // Exchange addresses (a bootstrap connection does this), then RTR and RTS.
//! let addrs = [QpAddress::of(&devs[0], &ends[0].1), QpAddress::of(&devs[1], &ends[1].1)];
//! for (i, (_, qp, _)) in ends.iter().enumerate() {
//!     qp.modify_to_rtr(RtrAttr::for_peer(&addrs[1 - i], Mtu::Mtu1024, 12))?;
//!     qp.modify_to_rts(RtsAttr { sq_psn: addrs[i].psn, timeout: 14, retry_cnt: 7, rnr_retry: 7 })?;
//! }
//! let (cq_b, qp_b, mr_b) = &ends[1];
//! qp_b.post_recv(&[RecvWr { wr_id: 1, sg_list: &[Sge { mr: mr_b, offset: 0, len: 4096 }] }])
//!     .map_err(|e| e.source)?;
//! let (_, qp_a, mr_a) = &ends[0];
//! mr_a.with_mut(0, 5, |buf| buf.copy_from_slice(b"hello"))?; // encode in place
//! qp_a.post_send(&[SendWr {
//!     wr_id: 9,
//!     opcode: SendOpcode::SendWithImm(42),
//!     sg_list: &[Sge { mr: mr_a, offset: 0, len: 5 }],
//!     signaled: true,
//!     inline: false,
//! }])
//! .map_err(|e| e.source)?;
//! net.drive(10_000);
//! let mut wcs = [WorkCompletion {
//!     wr_id: 0, status: WcStatus::Success, opcode: WcOpcode::Send,
//!     byte_len: 0, imm: None, qp_num: Qpn::new(0),
//! }; 4];
//! assert_eq!(cq_b.poll(&mut wcs)?, 1);
//! assert_eq!((wcs[0].status, wcs[0].imm, wcs[0].byte_len), (WcStatus::Success, Some(42), 5));
//! assert_eq!(mr_b.with(0, 5, |buf| buf == b"hello")?, true);
//! # Ok::<(), VerbsError>(())
//! ```

use std::fmt;
use std::future::Future;
use std::net::Ipv6Addr;
use std::sync::Weak;
use std::time::Duration;

pub mod soft;

#[cfg(feature = "ibverbs")]
#[allow(unsafe_code)]
pub mod ibv;

/// A 24-bit packet sequence number with modular comparison.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Psn(u32);

impl Psn {
    /// Mask of the 24 significant bits.
    pub const MASK: u32 = 0x00ff_ffff;

    /// The PSN with the low 24 bits of `value`.
    pub const fn new(value: u32) -> Psn {
        Psn(value & Self::MASK)
    }

    /// The 24-bit value.
    pub const fn value(self) -> u32 {
        self.0
    }

    /// `self + n`, modulo 2^24.
    pub const fn add(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_add(n))
    }

    /// `self - n`, modulo 2^24.
    pub const fn sub(self, n: u32) -> Psn {
        Psn::new(self.0.wrapping_sub(n))
    }

    /// Signed distance `self - other` in the ±2^23 window.
    pub const fn diff(self, other: Psn) -> i32 {
        let d = self.0.wrapping_sub(other.0) & Self::MASK;
        ((d << 8) as i32) >> 8
    }

    /// True when `self` comes before `other` in the modular window.
    pub const fn before(self, other: Psn) -> bool {
        self.diff(other) < 0
    }
}

impl fmt::Debug for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psn({})", self.0)
    }
}

impl fmt::Display for Psn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A 24-bit queue pair number.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Qpn(u32);

impl Qpn {
    /// The QPN with the low 24 bits of `value`.
    pub const fn new(value: u32) -> Qpn {
        Qpn(value & Psn::MASK)
    }

    /// The 24-bit value.
    pub const fn value(self) -> u32 {
        self.0
    }
}

impl fmt::Debug for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Qpn({:#x})", self.0)
    }
}

impl fmt::Display for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A local key naming a registered memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lkey(pub u32);

/// A 128-bit global identifier; RoCEv2 over IPv4 uses `::ffff:a.b.c.d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The IPv4-mapped GID of `ip`.
    pub fn from_ipv4(ip: std::net::Ipv4Addr) -> Gid {
        Gid(ip.to_ipv6_mapped().octets())
    }

    /// The IPv4 address when this GID is IPv4-mapped.
    pub fn to_ipv4(self) -> Option<std::net::Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

/// An RC path MTU (IB MTU enumeration: 256 to 4096 bytes of payload).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes: the largest that fits a 1500-byte Ethernet frame.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// Payload bytes per packet.
    pub const fn bytes(self) -> usize {
        match self {
            Mtu::Mtu256 => 256,
            Mtu::Mtu512 => 512,
            Mtu::Mtu1024 => 1024,
            Mtu::Mtu2048 => 2048,
            Mtu::Mtu4096 => 4096,
        }
    }

    /// The largest IB MTU whose RoCEv2 packet (IPv4 20 or IPv6 40, UDP 8,
    /// BTH 12, ImmDt 4, ICRC 4) fits a link of `link_mtu` bytes.
    pub fn for_link_mtu(link_mtu: usize, ipv6: bool) -> Option<Mtu> {
        let ip = if ipv6 { 40 } else { 20 };
        let room = link_mtu.checked_sub(ip + 8 + 12 + 4 + 4)?;
        [
            Mtu::Mtu4096,
            Mtu::Mtu2048,
            Mtu::Mtu1024,
            Mtu::Mtu512,
            Mtu::Mtu256,
        ]
        .into_iter()
        .find(|m| m.bytes() <= room)
    }
}

/// Memory region access flags (a small bit set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AccessFlags(u32);

impl AccessFlags {
    /// Local read only: the region can be a send source and nothing else.
    pub const LOCAL_READ: AccessFlags = AccessFlags(0);
    /// The HCA may write the region (required for receive buffers).
    pub const LOCAL_WRITE: AccessFlags = AccessFlags(1);
    /// A peer may RDMA WRITE the region.
    pub const REMOTE_WRITE: AccessFlags = AccessFlags(2);
    /// A peer may RDMA READ the region.
    pub const REMOTE_READ: AccessFlags = AccessFlags(4);

    /// Union of two flag sets.
    pub const fn union(self, other: AccessFlags) -> AccessFlags {
        AccessFlags(self.0 | other.0)
    }

    /// True when every flag of `other` is set in `self`.
    pub const fn contains(self, other: AccessFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits (`IBV_ACCESS_*` values).
    pub const fn bits(self) -> u32 {
        self.0
    }
}

impl std::ops::BitOr for AccessFlags {
    type Output = AccessFlags;
    fn bitor(self, rhs: AccessFlags) -> AccessFlags {
        self.union(rhs)
    }
}

/// Port attributes (`ibv_query_port` plus the device limits a link needs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttr {
    /// Active MTU of the port.
    pub active_mtu: Mtu,
    /// GID table, never empty; index 0 is the RoCEv2 GID a link should use.
    pub gid_table: Vec<Gid>,
    /// UDP port the device receives RoCEv2 on (4791 on hardware).
    pub udp_port: u16,
    /// Largest send or receive queue depth.
    pub max_qp_wr: usize,
    /// Largest scatter-gather list.
    pub max_sge: usize,
    /// Largest inline payload in bytes.
    pub max_inline_data: usize,
    /// Largest completion queue depth.
    pub max_cqe: usize,
}

/// Queue sizes asked for at QP creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: usize,
    /// Receive queue depth.
    pub max_recv_wr: usize,
    /// Scatter-gather entries per WR.
    pub max_sge: usize,
    /// Inline bytes per send WR.
    pub max_inline_data: usize,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_sge: 4,
            max_inline_data: 256,
        }
    }
}

/// RC queue pair states (`ibv_qp_state`, minus SQD/SQE which RC never needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created; holds no WRs.
    Reset,
    /// Receives may be posted; nothing is received.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed: every WR completes with `WrFlushErr`.
    Err,
}

/// Attributes of the RESET → INIT transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitAttr {
    /// Remote access the QP allows (SEND/RECV needs none).
    pub access: AccessFlags,
}

/// Attributes of the INIT → RTR transition: who the peer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtrAttr {
    /// Path MTU; must not exceed the port's active MTU.
    pub path_mtu: Mtu,
    /// The peer's QPN.
    pub dest_qpn: Qpn,
    /// First PSN expected from the peer (the peer's `sq_psn`).
    pub rq_psn: Psn,
    /// The peer's GID.
    pub remote_gid: Gid,
    /// The peer's RoCEv2 UDP port (4791 on hardware; soft devices publish theirs).
    pub remote_udp_port: u16,
    /// RNR NAK timer code (0..=31) this responder asks senders to wait.
    pub min_rnr_timer: u8,
}

/// What one side publishes so the other can connect to its QP (the QP part
/// of a bootstrap hello).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpAddress {
    /// The QP's number.
    pub qpn: Qpn,
    /// The first PSN it will send (its `sq_psn`).
    pub psn: Psn,
    /// The device's GID.
    pub gid: Gid,
    /// The device's RoCEv2 UDP port.
    pub udp_port: u16,
    /// The device's active MTU.
    pub mtu: Mtu,
}

impl QpAddress {
    /// The address of `qp` on `dev` (GID index 0).
    pub fn of<D: Device>(dev: &D, qp: &D::Qp) -> QpAddress {
        let port = dev.query_port();
        QpAddress {
            qpn: qp.qp_num(),
            psn: qp.initial_psn(),
            gid: *port
                .gid_table
                .first()
                .expect("a port lists at least its RoCEv2 GID"),
            udp_port: port.udp_port,
            mtu: port.active_mtu,
        }
    }
}

impl RtrAttr {
    /// RTR attributes to reach `peer`: path MTU is the smaller of both
    /// sides' MTUs.
    pub fn for_peer(peer: &QpAddress, local_mtu: Mtu, min_rnr_timer: u8) -> RtrAttr {
        RtrAttr {
            path_mtu: peer.mtu.min(local_mtu),
            dest_qpn: peer.qpn,
            rq_psn: peer.psn,
            remote_gid: peer.gid,
            remote_udp_port: peer.udp_port,
            min_rnr_timer,
        }
    }
}

/// Attributes of the RTR → RTS transition: how this requester retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttr {
    /// First PSN this QP sends.
    pub sq_psn: Psn,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (0 = no timer; ≤ 31).
    pub timeout: u8,
    /// Retries after timeouts or sequence NAKs (0..=7, 7 is a plain count).
    pub retry_cnt: u8,
    /// Retries after RNR NAKs (0..=7, 7 = forever).
    pub rnr_retry: u8,
}

impl RtsAttr {
    /// The local ACK timeout this attribute encodes, `None` for "no timer".
    pub fn ack_timeout(&self) -> Option<Duration> {
        if self.timeout == 0 {
            None
        } else {
            Some(Duration::from_nanos(4096 << self.timeout.min(31)))
        }
    }
}

/// Work request opcodes a send WR may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOpcode {
    /// SEND.
    Send,
    /// SEND_WITH_IMM carrying a 32-bit immediate.
    SendWithImm(u32),
}

/// One scatter-gather entry: `len` bytes of `mr` starting at `offset`.
#[derive(Debug)]
pub struct Sge<'a, M> {
    /// Registered region holding the bytes.
    pub mr: &'a M,
    /// Offset into the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl<M> Clone for Sge<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M> Copy for Sge<'_, M> {}

/// A send work request.
#[derive(Debug)]
pub struct SendWr<'a, M> {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// SEND or SEND_WITH_IMM.
    pub opcode: SendOpcode,
    /// Gather list.
    pub sg_list: &'a [Sge<'a, M>],
    /// Ask for a completion on success (errors always complete).
    pub signaled: bool,
    /// Copy the payload at post time; the buffers may be reused at once.
    pub inline: bool,
}

/// A receive work request.
#[derive(Debug)]
pub struct RecvWr<'a, M> {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// Scatter list.
    pub sg_list: &'a [Sge<'a, M>],
}

/// Completion status (`ibv_wc_status`, the subset RC SEND/RECV produces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Completed.
    Success,
    /// The incoming message was longer than the receive buffer.
    LocLenErr,
    /// A local QP operation error (malformed WR seen too late).
    LocQpOpErr,
    /// A local protection error (bad lkey, offset, or access).
    LocProtErr,
    /// Flushed because the QP is in ERR.
    WrFlushErr,
    /// The peer NAKed with remote access error.
    RemAccessErr,
    /// The peer NAKed with invalid request (e.g. its buffer was too small).
    RemInvReqErr,
    /// The peer NAKed with remote operational error.
    RemOpErr,
    /// Timeouts or sequence NAKs exceeded `retry_cnt`.
    RetryExcErr,
    /// RNR NAKs exceeded `rnr_retry`.
    RnrRetryExcErr,
}

/// Why this QP's responder refused a request of the peer's and moved the QP
/// to ERR (a NAK invalid request, class C). The QP's own receives then only
/// flush, so the completions cannot say the peer caused it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerRequestError {
    /// An RC request this QP does not carry out (RDMA WRITE or READ, an
    /// atomic, SEND with invalidate, …), by its BTH opcode.
    #[error("an RC request not carried out here (opcode {0:#04x})")]
    Unsupported(u8),
    /// A SEND packet out of its message's opcode sequence, or of a length
    /// its place in the message does not allow.
    #[error("a SEND packet out of sequence or of a wrong length")]
    MalformedSend,
}

/// Completion opcodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A send WR completed.
    Send,
    /// A receive WR completed.
    Recv,
}

/// A work completion. On an error status only `wr_id`, `status` and `qp_num`
/// are meaningful; the soft provider scrambles the rest on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The WR's `wr_id`.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Which kind of WR completed.
    pub opcode: WcOpcode,
    /// Bytes received (receive completions).
    pub byte_len: u32,
    /// Immediate data of a SEND_WITH_IMM (receive completions).
    pub imm: Option<u32>,
    /// The local QP the WR was posted on.
    pub qp_num: Qpn,
}

/// Errors returned by verbs calls (not by completions: those carry [`WcStatus`]).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum VerbsError {
    /// No device with this name.
    #[error("no RDMA device named {name:?}")]
    NoSuchDevice {
        /// Name asked for.
        name: String,
    },
    /// An illegal QP state transition or an operation illegal in this state.
    #[error("QP {qpn}: {op} is not allowed in state {state:?}")]
    InvalidState {
        /// The QP.
        qpn: Qpn,
        /// Current state.
        state: QpState,
        /// What was attempted.
        op: QpOp,
    },
    /// An attribute out of range for the transition.
    #[error("invalid QP attribute: {attr}")]
    InvalidAttr {
        /// Which attribute.
        attr: &'static str,
    },
    /// The send queue has no free slot.
    #[error("send queue of QP {qpn} is full ({depth} WRs)")]
    SendQueueFull {
        /// The QP.
        qpn: Qpn,
        /// Its depth.
        depth: usize,
    },
    /// The receive queue has no free slot.
    #[error("receive queue of QP {qpn} is full ({depth} WRs)")]
    RecvQueueFull {
        /// The QP.
        qpn: Qpn,
        /// Its depth.
        depth: usize,
    },
    /// A scatter-gather entry lies outside its memory region.
    #[error("SGE out of bounds: offset {offset} + len {len} > region length {region_len}")]
    SgeOutOfBounds {
        /// Offset asked.
        offset: usize,
        /// Length asked.
        len: usize,
        /// Region length.
        region_len: usize,
    },
    /// A memory region lacks an access flag the operation needs.
    #[error("memory region {lkey:?} lacks access {needed:?}")]
    AccessDenied {
        /// The region.
        lkey: Lkey,
        /// Flags needed.
        needed: AccessFlags,
    },
    /// An object belongs to another protection domain or device.
    #[error("memory region {lkey:?} belongs to another protection domain")]
    WrongPd {
        /// The region.
        lkey: Lkey,
    },
    /// A WR exceeds a queue pair capability.
    #[error("work request exceeds {cap}: {got} > {max}")]
    TooLarge {
        /// Which capability.
        cap: &'static str,
        /// Value asked.
        got: usize,
        /// Limit.
        max: usize,
    },
    /// Bytes a posted WR names, or that user code holds locked (libibverbs,
    /// where the device takes no lock): a receive's until its completion,
    /// a send's for writing until its completion.
    #[error("bytes {offset}..+{len} of memory region {lkey:?} are in use by a posted WR or a lock")]
    MemoryBusy {
        /// The region.
        lkey: Lkey,
        /// Start of the bytes asked for.
        offset: usize,
        /// How many.
        len: usize,
    },
    /// A capability exceeds the device's limits.
    #[error("capability {cap} = {got} exceeds device limit {max}")]
    CapExceeded {
        /// Which capability.
        cap: &'static str,
        /// Value asked.
        got: usize,
        /// Limit.
        max: usize,
    },
    /// The completion queue overflowed; it is unusable.
    #[error("completion queue overrun")]
    CqOverrun,
    /// The device (its driver task or socket) is gone.
    #[error("device is closed")]
    DeviceClosed,
    /// An OS error from the driver.
    #[error("{op}: {kind:?}")]
    Io {
        /// What the driver was doing.
        op: &'static str,
        /// The error kind.
        kind: std::io::ErrorKind,
    },
}

/// QP operations named in [`VerbsError::InvalidState`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpOp {
    /// Modify to INIT.
    ToInit,
    /// Modify to RTR.
    ToRtr,
    /// Modify to RTS.
    ToRts,
    /// `post_send`.
    PostSend,
    /// `post_recv`.
    PostRecv,
}

impl fmt::Display for QpOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            QpOp::ToInit => "modify to INIT",
            QpOp::ToRtr => "modify to RTR",
            QpOp::ToRts => "modify to RTS",
            QpOp::PostSend => "post_send",
            QpOp::PostRecv => "post_recv",
        };
        f.write_str(s)
    }
}

/// Which provider implements a listed device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderKind {
    /// The userspace RoCEv2 provider ([`soft`]); always present.
    Soft,
}

/// One entry of [`list_devices`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name (`ibv_get_device_name`).
    pub name: &'static str,
    /// Provider that opens it.
    pub provider: ProviderKind,
}

/// Devices this build can open (`ibv_get_device_list`); the soft device is
/// always present. Open it with [`soft::SoftDevice::open_udp`].
pub fn list_devices() -> Vec<DeviceInfo> {
    vec![DeviceInfo {
        name: soft::SOFT_DEVICE_NAME,
        provider: ProviderKind::Soft,
    }]
}

/// An opened RDMA device and the factory of its resources.
pub trait Device: Send + Sync + Sized {
    /// Protection domain.
    type Pd: Send + Sync;
    /// Memory region.
    type Mr: MemoryRegion;
    /// Completion queue.
    type Cq: CompletionQueue;
    /// RC queue pair.
    type Qp: QueuePair<Mr = Self::Mr>;

    /// Device name (`ibv_get_device_name`).
    fn name(&self) -> &str;
    /// True if registration pins pages against `RLIMIT_MEMLOCK` (a kernel
    /// provider); the soft provider's regions are ordinary heap memory.
    fn pins_memory(&self) -> bool;
    /// Port attributes.
    fn query_port(&self) -> PortAttr;
    /// Allocate a protection domain.
    fn alloc_pd(&self) -> Result<Self::Pd, VerbsError>;
    /// Register `len` zeroed bytes under `pd` with `access`: one chunk.
    fn reg_mr(
        &self,
        pd: &Self::Pd,
        len: usize,
        access: AccessFlags,
    ) -> Result<Self::Mr, VerbsError>;
    /// Register `chunks × chunk_len` zeroed bytes under `pd` as ONE region
    /// (one lkey) whose chunks are locked independently
    /// ([`MemoryRegion::try_lock_chunk`]): a pool of buffers in one MR.
    /// Both counts must be at least 1.
    fn reg_chunked_mr(
        &self,
        pd: &Self::Pd,
        chunk_len: usize,
        chunks: usize,
        access: AccessFlags,
    ) -> Result<Self::Mr, VerbsError>;
    /// Create a completion queue of `depth` entries.
    fn create_cq(&self, depth: usize) -> Result<Self::Cq, VerbsError>;
    /// Create an RC queue pair in RESET.
    fn create_qp(
        &self,
        pd: &Self::Pd,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
        caps: QpCaps,
    ) -> Result<Self::Qp, VerbsError>;
}

/// A registered memory region with safe, bounds-checked byte access.
///
/// A region is a row of equal chunks, each behind its own lock: one chunk
/// (the whole region) from [`Device::reg_mr`], `chunks` of them from
/// [`Device::reg_chunked_mr`]. Chunk guards are owned, `'static` and
/// exclusive: the region itself refuses a second guard on a held chunk, and
/// `with`/`with_mut` (and the provider's gather and scatter) lock every
/// chunk they touch. The closures run under those locks: do not call other
/// verbs inside them.
pub trait MemoryRegion: Send + Sync {
    /// Owned, exclusive access to one chunk (see [`Self::lock_chunk`]).
    type Guard: std::ops::DerefMut<Target = [u8]> + Send + 'static;

    /// Exclusive access to chunk `index` (bytes `index × chunk_len ..` of
    /// the region) that can be held across awaits without a closure: a send
    /// buffer the mux encodes into in place. Waits while another guard, a
    /// closure or the provider holds the chunk; `None` past the last chunk.
    /// The soft provider gathers and scatters under the same lock; a NIC
    /// (libibverbs) takes none, so there a posted WR marks the bytes it
    /// names until its completion, a post finding them locked fails with
    /// [`VerbsError::MemoryBusy`], and a chunk a posted WR names is not lent
    /// (`None`; `with` and `with_mut` fail with `MemoryBusy`). Drop the
    /// guard before naming the chunk in a posted WR, and lock it again only
    /// once the WR completed.
    fn lock_chunk(&self, index: usize) -> Option<Self::Guard>;
    /// As [`Self::lock_chunk`] without waiting: `None` while the chunk is
    /// held, or past the last chunk.
    fn try_lock_chunk(&self, index: usize) -> Option<Self::Guard>;
    /// Bytes per chunk (the whole length for a region from `reg_mr`).
    fn chunk_len(&self) -> usize;
    /// How many chunks (1 for a region from `reg_mr`).
    fn chunks(&self) -> usize;
    /// Local key.
    fn lkey(&self) -> Lkey;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True for a zero-length region.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Access flags it was registered with.
    fn access(&self) -> AccessFlags;
    /// Run `f` over `len` bytes at `offset` for writing (e.g. encode a batch in place).
    fn with_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, VerbsError>;
    /// Run `f` over `len` bytes at `offset` for reading (e.g. decode a received batch).
    fn with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, VerbsError>;
    /// Copy `data` into the region at `offset`.
    fn write(&self, offset: usize, data: &[u8]) -> Result<(), VerbsError> {
        self.with_mut(offset, data.len(), |b| b.copy_from_slice(data))
    }
    /// Copy `len` bytes at `offset` out of the region.
    fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, VerbsError> {
        self.with(offset, len, |b| b.to_vec())
    }
}

/// A completion queue.
pub trait CompletionQueue: Send + Sync {
    /// Move up to `out.len()` completions into `out`; returns how many.
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError>;
    /// Arm the notification (`ibv_req_notify_cq`): the next completion added
    /// after this call fires it once. Arming an armed CQ changes nothing.
    fn req_notify(&self) -> Result<(), VerbsError>;
    /// Resolves once per arm, after a completion arrived following the arm.
    /// Usage: arm, poll until empty, then await; repeat.
    fn notified(&self) -> impl Future<Output = ()> + Send;
    /// Installs a handler that the provider calls from its own progress
    /// context with completions that context added, in place of the
    /// notification (kernel verbs' `ib_comp_handler`). A completion the
    /// handler takes fires no notification; one it declines (it returned
    /// false) fires it as usual. Completions added by a verbs call (a flush
    /// on `modify_to_error`) are only ever notified. Returns false, and
    /// keeps nothing, where the provider has no such context (libibverbs).
    fn set_handler(&self, handler: Weak<dyn CompletionHandler>) -> bool;
}

/// Takes completions in a provider's progress context; see
/// [`CompletionQueue::set_handler`].
pub trait CompletionHandler: Send + Sync {
    /// Completions were added. Called with no provider lock held; may post
    /// and poll. Returns true if it polled the CQ empty, false if it could
    /// not poll now (someone else is polling), so the provider notifies.
    fn completions_ready(&self) -> bool;
}

/// A reliable-connected queue pair.
pub trait QueuePair: Send + Sync {
    /// Memory region type of the scatter-gather lists.
    type Mr: MemoryRegion;

    /// This QP's number.
    fn qp_num(&self) -> Qpn;
    /// A starting PSN for this QP's send queue, drawn at creation (seeded
    /// per device in the soft provider); publish it to the peer as `rq_psn`.
    fn initial_psn(&self) -> Psn;
    /// Current state.
    fn state(&self) -> QpState;
    /// RESET → INIT.
    fn modify_to_init(&self, attr: InitAttr) -> Result<(), VerbsError>;
    /// INIT → RTR.
    fn modify_to_rtr(&self, attr: RtrAttr) -> Result<(), VerbsError>;
    /// RTR → RTS.
    fn modify_to_rts(&self, attr: RtsAttr) -> Result<(), VerbsError>;
    /// Any state → ERR: outstanding WRs flush. Also the fault hook tests use
    /// to kill a QP.
    fn modify_to_error(&self) -> Result<(), VerbsError>;
    /// Any state → RESET: WRs are discarded without completions.
    fn modify_to_reset(&self) -> Result<(), VerbsError>;
    /// Why the responder moved this QP to ERR on a request of the peer's,
    /// where the provider knows it by the time the QP's flushes are polled:
    /// the soft provider does; libibverbs tells it only as an async event
    /// that races the flush (and rxe raises none), so it answers `None`.
    fn peer_request_error(&self) -> Option<PeerRequestError>;
    /// Post send WRs in order; stops at the first failure, returning its
    /// error and leaving earlier WRs posted (like `bad_wr`).
    fn post_send(&self, wrs: &[SendWr<'_, Self::Mr>]) -> Result<(), PostError>;
    /// Post receive WRs in order, same contract as `post_send`.
    fn post_recv(&self, wrs: &[RecvWr<'_, Self::Mr>]) -> Result<(), PostError>;
}

/// A failed post: how many WRs of the list were posted, and why the next was not.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[error("posted {posted} WRs, then: {source}")]
pub struct PostError {
    /// WRs posted before the failure.
    pub posted: usize,
    /// Why the next WR was refused.
    #[source]
    pub source: VerbsError,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_compares_modulo_2_pow_24() {
        let top = Psn::new(0xff_ffff);
        assert_eq!(top.add(1), Psn::new(0));
        assert_eq!(Psn::new(0).sub(1), top);
        assert_eq!(Psn::new(0).diff(top), 1);
        assert_eq!(top.diff(Psn::new(0)), -1);
        assert!(top.before(Psn::new(5)));
        assert!(!Psn::new(5).before(top));
        assert_eq!(Psn::new(0x80_0000).diff(Psn::new(0)), -(1 << 23));
        assert_eq!(Psn::new(0x7f_ffff).diff(Psn::new(0)), (1 << 23) - 1);
        assert_eq!(Psn::new(0x1ff_ffff), top, "only 24 bits are kept");
    }

    #[test]
    fn mtu_for_link_mtu() {
        assert_eq!(Mtu::for_link_mtu(1500, false), Some(Mtu::Mtu1024));
        assert_eq!(Mtu::for_link_mtu(9000, false), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::for_link_mtu(65536, true), Some(Mtu::Mtu4096));
        assert_eq!(Mtu::for_link_mtu(100, false), None);
        // 2100 fits 2048 + 48 over IPv4, not the 20 more IPv6 needs.
        assert_eq!(Mtu::for_link_mtu(2100, false), Some(Mtu::Mtu2048));
        assert_eq!(Mtu::for_link_mtu(2100, true), Some(Mtu::Mtu1024));
    }

    #[test]
    fn ack_timeout_is_4096ns_times_2_pow_timeout() {
        let attr = |timeout| RtsAttr {
            sq_psn: Psn::new(0),
            timeout,
            retry_cnt: 0,
            rnr_retry: 0,
        };
        assert_eq!(attr(0).ack_timeout(), None);
        assert_eq!(attr(1).ack_timeout(), Some(Duration::from_nanos(8192)));
        assert_eq!(
            attr(14).ack_timeout(),
            Some(Duration::from_nanos(4096 << 14))
        );
    }
}
