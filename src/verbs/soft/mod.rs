//! The soft provider: RoCEv2 RC in userspace, over UDP or a simulated network.
//!
//! ```text
//!  SoftDevice ── Arc<DeviceShared> ── Mutex<DeviceCore> ── QpEngine per QP (sans-IO)
//!     │ verbs calls lock the core briefly, then kick the driver
//!     ├─ udp: one tokio task per device drives the core; post_send sends inline
//!     └─ sim: SimNet drives every core in virtual time (seeded faults)
//! ```
//!
//! `wire` is the packet format, `engine` one QP's requester/responder/completer,
//! `device` the QPN routing and CQ delivery. Time enters only as
//! [`Instant`]: the UDP driver maps the wall clock onto it, the simulator
//! advances it. Design notes: docs/soft-provider.md.

use std::fmt;
use std::ops::Add;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;

mod cq;
mod device;
mod engine;
#[doc(hidden)]
pub mod fuzzing;
mod mr;
pub mod sim;
pub mod udp;
pub mod wire;

pub use cq::SoftCq;
pub use device::DeviceStats;
pub use engine::QpCounters;
pub use mr::{SoftMr, SoftMrGuard};

use device::DeviceCore;
use engine::{RecvWqe, Segment, SendWqe};

use super::{
    AccessFlags, Device, Gid, InitAttr, Lkey, MemoryRegion, Mtu, PeerRequestError, PortAttr,
    PostError, Psn, QpCaps, QpState, Qpn, QueuePair, RecvWr, RtrAttr, RtsAttr, SendOpcode, SendWr,
    Sge, VerbsError,
};

/// Name under which the soft device is listed.
pub const SOFT_DEVICE_NAME: &str = "qpmux_soft0";

/// Device limits of the soft provider.
pub const MAX_QP_WR: usize = 16_384;
/// Largest scatter-gather list.
pub const MAX_SGE: usize = 16;
/// Largest inline payload.
pub const MAX_INLINE_DATA: usize = 4096;
/// Largest CQ.
pub const MAX_CQE: usize = 1 << 20;
/// Largest message (the RC limit is 2^31 bytes).
pub const MAX_MESSAGE: usize = 1 << 31;

/// A point in the provider's time (virtual in the simulator, the wall clock
/// since device start under UDP).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Instant(Duration);

impl Instant {
    /// The start of time.
    pub const ZERO: Instant = Instant(Duration::ZERO);

    /// The instant `d` after [`Instant::ZERO`].
    pub const fn from_start(d: Duration) -> Instant {
        Instant(d)
    }

    /// Time since [`Instant::ZERO`].
    pub const fn since_start(self) -> Duration {
        self.0
    }

    /// `self - earlier`, zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        Instant(self.0 + d)
    }
}

impl fmt::Debug for Instant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t+{:?}", self.0)
    }
}

/// Configuration shared by both drivers.
#[derive(Clone, Debug)]
pub struct SoftConfig {
    /// Seed of the device RNG (starting QPN, PSNs, scrambling); `None` draws one.
    pub seed: Option<u64>,
    /// Active MTU of the port (256–4096). Default 1024, the standard
    /// Ethernet value, also on loopback.
    pub active_mtu: Mtu,
    /// How long a responder may hold a plain ACK so that one ACK answers
    /// several requests, as a NIC coalesces them. A held ACK goes at once
    /// when it covers a quarter of the requester's window, when a NAK
    /// follows it, or for a resent packet, and it waits at most a quarter
    /// of the QP's own local ACK timeout (keep the peer's timeout at least
    /// as long). Zero, the default, answers every A-bit packet in the turn
    /// that took it, as rxe does: docs/soft-provider.md § "ACKs held across turns"
    /// has what a delay costs and saves.
    pub ack_delay: std::time::Duration,
}

impl Default for SoftConfig {
    fn default() -> Self {
        SoftConfig {
            seed: None,
            active_mtu: Mtu::Mtu1024,
            ack_delay: std::time::Duration::ZERO,
        }
    }
}

static NEXT_PD: AtomicU64 = AtomicU64::new(1);

pub(crate) struct DeviceShared {
    core: Mutex<DeviceCore>,
    /// Wakes the driver after a command that may have output.
    kick: Arc<Notify>,
    /// The UDP socket, when a UDP driver runs this device.
    port: OnceLock<Arc<udp::Port>>,
    /// Wakes the driver when the last handle is gone.
    shutdown: Arc<Notify>,
    next_lkey: AtomicU32,
    /// Regions registered and not yet released (fault tests count leaks).
    mrs: Arc<mr::MrTally>,
}

impl DeviceShared {
    fn new(core: DeviceCore) -> DeviceShared {
        DeviceShared {
            core: Mutex::new(core),
            kick: Arc::new(Notify::new()),
            port: OnceLock::new(),
            shutdown: Arc::new(Notify::new()),
            next_lkey: AtomicU32::new(0x100),
            mrs: Arc::default(),
        }
    }

    pub(crate) fn core(&self) -> MutexGuard<'_, DeviceCore> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for DeviceShared {
    fn drop(&mut self) {
        if let Some(port) = self.port.get() {
            let core = self.core.get_mut().unwrap_or_else(|e| e.into_inner());
            udp::leave_parting(port, core);
        }
        self.shutdown.notify_one();
    }
}

/// The soft device. Cheap to clone; resources keep it alive.
#[derive(Clone)]
pub struct SoftDevice {
    shared: Arc<DeviceShared>,
}

impl fmt::Debug for SoftDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let core = self.shared.core();
        f.debug_struct("SoftDevice")
            .field("gid", &core.gid)
            .field("udp_port", &core.udp_port)
            .finish()
    }
}

/// A protection domain of the soft device.
#[derive(Debug, Clone)]
pub struct SoftPd {
    id: u64,
}

/// An RC queue pair of the soft device. Dropping it destroys the QP.
pub struct SoftQp {
    qpn: Qpn,
    initial_psn: Psn,
    pd_id: u64,
    caps: QpCaps,
    dev: Arc<DeviceShared>,
}

impl fmt::Debug for SoftQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SoftQp").field("qpn", &self.qpn).finish()
    }
}

impl Drop for SoftQp {
    fn drop(&mut self) {
        let mut core = self.dev.core();
        // What the core already owes the wire leaves first, an ACK held
        // to coalesce included: the driver sends a receive turn's ACKs
        // after the receivers ran, so a peer's last message may be
        // completed here and its ACK still unsent.
        core.with_qp(self.qpn, |e| e.release_held_ack());
        let kick = match self.dev.port.get() {
            Some(port) => {
                // What an inline send left (it declines while the driver
                // sends) goes to the driver's backlog, not down with the QP.
                let kick = udp::transmit_inline(port, &mut core);
                udp::backlog_owed(port, &mut core, self.qpn) || kick
            }
            None => false,
        };
        core.destroy_qp(self.qpn);
        drop(core);
        if kick {
            self.dev.kick.notify_one();
        }
    }
}

impl SoftDevice {
    pub(crate) fn from_core(core: DeviceCore) -> SoftDevice {
        SoftDevice {
            shared: Arc::new(DeviceShared::new(core)),
        }
    }

    pub(crate) fn shared(&self) -> &Arc<DeviceShared> {
        &self.shared
    }

    /// The GID (IP) the device is reached at.
    pub fn gid(&self) -> Gid {
        self.shared.core().gid
    }

    /// The UDP port the device receives on.
    pub fn udp_port(&self) -> u16 {
        self.shared.core().udp_port
    }

    /// Datagram counters.
    pub fn stats(&self) -> DeviceStats {
        let mut stats = self.shared.core().stats;
        if let Some(port) = self.shared.port.get() {
            stats.tx_refused = port.send_errors();
        }
        stats
    }

    /// Fault hook: while partitioned the device drops every datagram it would
    /// send or receive (QPs stay up; their peers see silence and retry).
    /// Killing one QP instead is `QueuePair::modify_to_error`.
    pub fn set_partitioned(&self, partitioned: bool) {
        self.shared.core().partitioned = partitioned;
        self.shared.kick.notify_one();
    }

    /// Test hook: while on, `post_send` and the like leave every packet to
    /// the UDP driver, as they do while it is mid-send.
    #[doc(hidden)]
    pub fn decline_inline_sends(&self, decline: bool) {
        self.shared.core().inline.decline = decline;
        self.shared.kick.notify_one();
    }

    /// Test hook: the handles that keep the device alive (this one, its
    /// clones, and its resources'); its driver holds one only during a turn.
    #[doc(hidden)]
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.shared)
    }

    /// Queue pairs alive on this device now.
    pub fn qp_count(&self) -> usize {
        self.shared.core().qp_count()
    }

    /// Memory regions registered on this device and not yet released (a
    /// region lives until its last handle and every WR naming it are gone).
    pub fn mr_count(&self) -> usize {
        self.shared.mrs.regions.load(Ordering::Relaxed)
    }

    /// Bytes in those regions.
    pub fn mr_bytes(&self) -> usize {
        self.shared.mrs.bytes.load(Ordering::Relaxed)
    }

    /// Counters summed over every live QP (RNR NAKs, rewinds, ...).
    pub fn counters(&self) -> QpCounters {
        self.shared.core().total_counters()
    }
}

impl SoftDevice {
    /// A region of `chunks × chunk_len` bytes (sizes already checked).
    fn register(
        &self,
        pd: &SoftPd,
        chunk_len: usize,
        chunks: usize,
        access: AccessFlags,
    ) -> SoftMr {
        SoftMr {
            mem: Arc::new(mr::MrMem::counted(
                chunk_len,
                chunks,
                self.shared.mrs.clone(),
            )),
            lkey: Lkey(self.shared.next_lkey.fetch_add(1, Ordering::Relaxed)),
            len: chunk_len * chunks,
            access,
            pd_id: pd.id,
        }
    }
}

impl Device for SoftDevice {
    type Pd = SoftPd;
    type Mr = SoftMr;
    type Cq = SoftCq;
    type Qp = SoftQp;

    fn name(&self) -> &str {
        SOFT_DEVICE_NAME
    }

    fn pins_memory(&self) -> bool {
        false
    }

    fn query_port(&self) -> PortAttr {
        let core = self.shared.core();
        PortAttr {
            active_mtu: core.active_mtu,
            gid_table: vec![core.gid],
            udp_port: core.udp_port,
            max_qp_wr: MAX_QP_WR,
            max_sge: MAX_SGE,
            max_inline_data: MAX_INLINE_DATA,
            max_cqe: MAX_CQE,
        }
    }

    fn alloc_pd(&self) -> Result<SoftPd, VerbsError> {
        Ok(SoftPd {
            id: NEXT_PD.fetch_add(1, Ordering::Relaxed),
        })
    }

    fn reg_mr(&self, pd: &SoftPd, len: usize, access: AccessFlags) -> Result<SoftMr, VerbsError> {
        if len > MAX_MESSAGE {
            return Err(VerbsError::CapExceeded {
                cap: "mr length",
                got: len,
                max: MAX_MESSAGE,
            });
        }
        Ok(self.register(pd, len, 1, access))
    }

    fn reg_chunked_mr(
        &self,
        pd: &SoftPd,
        chunk_len: usize,
        chunks: usize,
        access: AccessFlags,
    ) -> Result<SoftMr, VerbsError> {
        if chunk_len == 0 {
            return Err(VerbsError::InvalidAttr { attr: "chunk_len" });
        }
        if chunks == 0 {
            return Err(VerbsError::InvalidAttr { attr: "chunks" });
        }
        let len = chunk_len.saturating_mul(chunks);
        if len > MAX_MESSAGE {
            return Err(VerbsError::CapExceeded {
                cap: "mr length",
                got: len,
                max: MAX_MESSAGE,
            });
        }
        Ok(self.register(pd, chunk_len, chunks, access))
    }

    fn create_cq(&self, depth: usize) -> Result<SoftCq, VerbsError> {
        if depth == 0 || depth > MAX_CQE {
            return Err(VerbsError::CapExceeded {
                cap: "cq depth",
                got: depth,
                max: MAX_CQE,
            });
        }
        Ok(SoftCq::new(depth))
    }

    fn create_qp(
        &self,
        pd: &SoftPd,
        send_cq: &SoftCq,
        recv_cq: &SoftCq,
        caps: QpCaps,
    ) -> Result<SoftQp, VerbsError> {
        let checks = [
            ("max_send_wr", caps.max_send_wr, MAX_QP_WR),
            ("max_recv_wr", caps.max_recv_wr, MAX_QP_WR),
            ("max_sge", caps.max_sge, MAX_SGE),
            ("max_inline_data", caps.max_inline_data, MAX_INLINE_DATA),
        ];
        for (cap, got, max) in checks {
            if got > max {
                return Err(VerbsError::CapExceeded { cap, got, max });
            }
        }
        let mut core = self.shared.core();
        let qpn = core.create_qp(caps, send_cq.shared.clone(), recv_cq.shared.clone());
        let initial_psn = Psn::new(core.random_u64() as u32);
        drop(core);
        Ok(SoftQp {
            qpn,
            initial_psn,
            pd_id: pd.id,
            caps,
            dev: self.shared.clone(),
        })
    }
}

impl SoftQp {
    /// Runs a command that queued work for the wire (a send), then puts the
    /// packets out from this thread where the driver allows, or kicks it.
    fn with_engine_transmit<R>(
        &self,
        f: impl FnOnce(&mut engine::QpEngine) -> Result<R, VerbsError>,
    ) -> Result<R, VerbsError> {
        let mut core = self.dev.core();
        let r = core
            .with_qp(self.qpn, f)
            .unwrap_or(Err(VerbsError::DeviceClosed));
        let kick = match self.dev.port.get() {
            Some(port) => udp::transmit_inline(port, &mut core),
            None => true,
        };
        drop(core);
        if kick {
            self.dev.kick.notify_one();
        }
        r
    }

    /// Runs a command that leaves nothing for the wire or the timers (a
    /// receive post): the driver is not woken.
    fn with_engine_quiet<R>(
        &self,
        f: impl FnOnce(&mut engine::QpEngine) -> Result<R, VerbsError>,
    ) -> Result<R, VerbsError> {
        self.dev
            .core()
            .with_qp(self.qpn, f)
            .unwrap_or(Err(VerbsError::DeviceClosed))
    }

    fn with_engine<R>(
        &self,
        f: impl FnOnce(&mut engine::QpEngine) -> Result<R, VerbsError>,
    ) -> Result<R, VerbsError> {
        let r = self
            .dev
            .core()
            .with_qp(self.qpn, f)
            .unwrap_or(Err(VerbsError::DeviceClosed));
        self.dev.kick.notify_one();
        r
    }

    /// Counters of this QP.
    pub fn counters(&self) -> QpCounters {
        self.dev.core().qp_counters(self.qpn).unwrap_or_default()
    }

    fn segments(
        &self,
        sg: &[Sge<'_, SoftMr>],
        needed: AccessFlags,
    ) -> Result<Vec<Segment>, VerbsError> {
        if sg.len() > self.caps.max_sge {
            return Err(VerbsError::TooLarge {
                cap: "max_sge",
                got: sg.len(),
                max: self.caps.max_sge,
            });
        }
        let mut total = 0usize;
        let mut segs = Vec::with_capacity(sg.len());
        for s in sg {
            if s.mr.pd_id != self.pd_id {
                return Err(VerbsError::WrongPd { lkey: s.mr.lkey });
            }
            if !s.mr.access.contains(needed) {
                return Err(VerbsError::AccessDenied {
                    lkey: s.mr.lkey,
                    needed,
                });
            }
            s.mr.check(s.offset, s.len)?;
            total += s.len;
            segs.push(Segment::Mr {
                mem: s.mr.mem.clone(),
                offset: s.offset,
                len: s.len,
            });
        }
        if total > MAX_MESSAGE {
            return Err(VerbsError::TooLarge {
                cap: "message length",
                got: total,
                max: MAX_MESSAGE,
            });
        }
        Ok(segs)
    }

    fn send_wqe(&self, wr: &SendWr<'_, SoftMr>) -> Result<SendWqe, VerbsError> {
        let mut segs = self.segments(wr.sg_list, AccessFlags::LOCAL_READ)?;
        if wr.inline {
            let total: usize = wr.sg_list.iter().map(|s| s.len).sum();
            if total > self.caps.max_inline_data {
                return Err(VerbsError::TooLarge {
                    cap: "max_inline_data",
                    got: total,
                    max: self.caps.max_inline_data,
                });
            }
            let mut bytes = Vec::with_capacity(total);
            for s in wr.sg_list {
                s.mr.with(s.offset, s.len, |b| bytes.extend_from_slice(b))?;
            }
            segs = vec![Segment::Inline(bytes.into_boxed_slice())];
        }
        let imm = match wr.opcode {
            SendOpcode::Send => None,
            SendOpcode::SendWithImm(imm) => Some(imm),
        };
        Ok(SendWqe::new(wr.wr_id, imm, segs, wr.signaled))
    }
}

impl QueuePair for SoftQp {
    type Mr = SoftMr;

    fn qp_num(&self) -> Qpn {
        self.qpn
    }

    fn initial_psn(&self) -> Psn {
        self.initial_psn
    }

    fn state(&self) -> QpState {
        self.dev
            .core()
            .with_qp(self.qpn, |e| e.state())
            .unwrap_or(QpState::Err)
    }

    fn modify_to_init(&self, _attr: InitAttr) -> Result<(), VerbsError> {
        self.with_engine(|e| e.modify_to_init())
    }

    fn modify_to_rtr(&self, attr: RtrAttr) -> Result<(), VerbsError> {
        let mut core = self.dev.core();
        if attr.path_mtu > core.active_mtu {
            return Err(VerbsError::InvalidAttr { attr: "path_mtu" });
        }
        let ctx = wire::IcrcContext {
            src: core.gid,
            dst: attr.remote_gid,
            src_port: core.udp_port,
            dst_port: attr.remote_udp_port,
        };
        core.with_qp(self.qpn, |e| e.modify_to_rtr(&attr, ctx))
            .unwrap_or(Err(VerbsError::DeviceClosed))
    }

    fn modify_to_rts(&self, attr: RtsAttr) -> Result<(), VerbsError> {
        self.with_engine(|e| e.modify_to_rts(&attr))
    }

    fn modify_to_error(&self) -> Result<(), VerbsError> {
        self.with_engine(|e| {
            e.modify_to_error();
            Ok(())
        })
    }

    fn modify_to_reset(&self) -> Result<(), VerbsError> {
        self.with_engine(|e| {
            e.modify_to_reset();
            Ok(())
        })
    }

    fn peer_request_error(&self) -> Option<PeerRequestError> {
        self.dev
            .core()
            .with_qp(self.qpn, |e| e.peer_request_error())
            .flatten()
    }

    fn post_send(&self, wrs: &[SendWr<'_, SoftMr>]) -> Result<(), PostError> {
        // Resolve outside the core lock (inline WRs read MRs).
        let mut wqes = Vec::with_capacity(wrs.len());
        let mut failure = None;
        for wr in wrs {
            match self.send_wqe(wr) {
                Ok(w) => wqes.push(w),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let mut posted = 0;
        let r = self.with_engine_transmit(|e| {
            for w in wqes {
                e.post_send(w)?;
                posted += 1;
            }
            Ok(())
        });
        match (r, failure) {
            (Err(source), _) | (Ok(()), Some(source)) => Err(PostError { posted, source }),
            (Ok(()), None) => Ok(()),
        }
    }

    fn post_recv(&self, wrs: &[RecvWr<'_, SoftMr>]) -> Result<(), PostError> {
        let mut wqes = Vec::with_capacity(wrs.len());
        let mut failure = None;
        for wr in wrs {
            match self.segments(wr.sg_list, AccessFlags::LOCAL_WRITE) {
                Ok(segs) => wqes.push(RecvWqe::new(wr.wr_id, segs)),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let mut posted = 0;
        let r = self.with_engine_quiet(|e| {
            for w in wqes {
                e.post_recv(w)?;
                posted += 1;
            }
            Ok(())
        });
        match (r, failure) {
            (Err(source), _) | (Ok(()), Some(source)) => Err(PostError { posted, source }),
            (Ok(()), None) => Ok(()),
        }
    }
}
