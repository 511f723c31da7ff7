//! Memory regions and RC queue pairs over libibverbs.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::VecDeque;
use std::ptr::{self, NonNull};
use std::sync::{Arc, Mutex};

use rdma_mummy_sys::{ibv_qp, ibv_recv_wr, ibv_send_wr, ibv_sge};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid as SwGid};
use sideway::ibverbs::completion::GenericCompletionQueue;
use sideway::ibverbs::memory_region::MemoryRegion as SwMr;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, QueuePair as _, QueuePairAttribute, QueuePairAttributeMask, QueuePairState,
};

use super::cq::{CqInner, RECV_BIT};
use super::{DevInner, IbvCq, IbvPd};
use crate::verbs::{
    AccessFlags, InitAttr, Lkey, MemoryRegion, Psn, QpCaps, QpOp, QpState, Qpn, QueuePair, RecvWr,
    RtrAttr, RtsAttr, SendOpcode, SendWr, Sge, VerbsError,
};
use crate::verbs::{PeerRequestError, PostError};

/// `IBV_WR_SEND`, `IBV_WR_SEND_WITH_IMM`.
const WR_SEND: u32 = 2;
const WR_SEND_WITH_IMM: u32 = 3;
/// `IBV_SEND_SIGNALED`, `IBV_SEND_INLINE`.
const SEND_SIGNALED: u32 = 1 << 1;
const SEND_INLINE: u32 = 1 << 3;

/// Page-aligned, zeroed bytes owned by an [`IbvMr`].
struct Buffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

// SAFETY: `Buffer` owns its allocation exclusively; its bytes are only
// reached through the region's chunk locks, which serialise every access
// from user code to a chunk.
unsafe impl Send for Buffer {}
// SAFETY: as above: a shared `Buffer` only lends its pointer; slices are
// made under the chunk locks.
unsafe impl Sync for Buffer {}

type ChunkLock = Arc<parking_lot::Mutex<()>>;

/// The byte ranges of one region that posted WRs name, each with whether
/// the device writes it (a receive) or only reads it (a send). The device
/// takes no lock, so user code is refused these bytes until the completion
/// that retires the WR (or the queue's reset) drops its [`Pin`].
#[derive(Default)]
struct Posted {
    ranges: Vec<PostedRange>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct PostedRange {
    start: usize,
    end: usize,
    device_writes: bool,
}

impl Posted {
    /// Whether user code may not have `start..end`: any posted range over it
    /// when writing, a receive's when reading.
    fn refuses(&self, start: usize, end: usize, writing: bool) -> bool {
        self.ranges
            .iter()
            .any(|r| r.start < end && start < r.end && (writing || r.device_writes))
    }

    fn remove(&mut self, range: PostedRange) {
        if let Some(at) = self.ranges.iter().position(|r| *r == range) {
            self.ranges.swap_remove(at);
        }
    }
}

/// One posted SGE's hold on its region, kept in the queue's ring until the
/// WR retires: the registration and the bytes stay alive, and the range
/// stays marked.
pub(crate) struct Pin {
    posted: Arc<parking_lot::Mutex<Posted>>,
    range: PostedRange,
    _mr: Arc<SwMr>,
    _buf: Arc<Buffer>,
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.posted.lock().remove(self.range);
    }
}

/// Exclusive access to one chunk of an [`IbvMr`], held without a closure
/// ([`MemoryRegion::lock_chunk`]). Keeps the bytes alive by itself: if the
/// region is dropped first, the registration is gone but the memory stays
/// valid until the guard goes.
pub struct IbvMrGuard {
    _lock: parking_lot::ArcMutexGuard<parking_lot::RawMutex, ()>,
    buf: Arc<Buffer>,
    offset: usize,
    len: usize,
}

impl std::ops::Deref for IbvMrGuard {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `offset + len` lies within the allocation (one chunk of
        // it), which lives as long as the guard's `Arc`; the guard holds
        // that chunk's lock, which every other slice of these bytes takes.
        unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr().add(self.offset), self.len) }
    }
}

impl std::ops::DerefMut for IbvMrGuard {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes it unique.
        unsafe { std::slice::from_raw_parts_mut(self.buf.ptr.as_ptr().add(self.offset), self.len) }
    }
}

/// A registered memory region: a page-aligned buffer this crate allocates and
/// registers with `ibv_reg_mr`, split into equal chunks, each behind its own
/// lock.
///
/// # Safety
///
/// Lifetime invariants:
/// - the registration is dropped before the buffer (field order: `mr` then
///   `buf`), and a posted WR's `Pin` holds both until the WR retires, so
///   the device never holds a key to freed or re-registered memory;
/// - user code makes a slice of the bytes only while holding the lock of
///   every chunk the slice covers (guards hold one, `with`/`with_mut` take
///   theirs in ascending order), so slices never alias, whoever the caller;
/// - the device may write the bytes of a posted receive, and read those of
///   a posted send, until the completion: a post marks them (`Posted`)
///   under the chunk locks, failing if user code holds one, and a slice is
///   refused over marked bytes (any mark when writing, a receive's when
///   reading), so no slice sees the device write under it.
///
/// Destroy order:
/// 1. `ibv_dereg_mr` (sideway `MemoryRegion` drop; it holds the PD's `Arc`);
/// 2. the buffer is freed (once no guard holds it).
pub struct IbvMr {
    mr: Arc<SwMr>,
    buf: Arc<Buffer>,
    locks: Box<[ChunkLock]>,
    posted: Arc<parking_lot::Mutex<Posted>>,
    chunk_len: usize,
    len: usize,
    access: AccessFlags,
    pd_id: u64,
}

pub(crate) fn reg_mr(
    pd: &IbvPd,
    chunk_len: usize,
    chunks: usize,
    access: AccessFlags,
) -> Result<IbvMr, VerbsError> {
    // A peer's RDMA WRITE lands with no WR of ours posted, so no mark could
    // keep it from a slice being read here; the seam posts no operation
    // that needs it.
    if access.contains(AccessFlags::REMOTE_WRITE) {
        return Err(VerbsError::InvalidAttr {
            attr: "REMOTE_WRITE: a peer's writes would bypass the posted-bytes marks",
        });
    }
    let len = chunk_len
        .checked_mul(chunks)
        .ok_or(VerbsError::InvalidAttr {
            attr: "memory region length",
        })?;
    let layout =
        Layout::from_size_align(len.max(1), 4096).map_err(|_| VerbsError::InvalidAttr {
            attr: "memory region length",
        })?;
    // SAFETY: the layout has a nonzero size.
    let raw = unsafe { alloc_zeroed(layout) };
    let Some(ptr) = NonNull::new(raw) else {
        return Err(VerbsError::Io {
            op: "allocate memory region",
            kind: std::io::ErrorKind::OutOfMemory,
        });
    };
    let buf = Buffer { ptr, layout };
    // SAFETY: `buf` is valid for `len.max(1)` bytes and lives as long as the
    // registration (IbvMr drops `mr` before its `Arc` of `buf`).
    let mr = unsafe {
        pd.pd.reg_mr(
            buf.ptr.as_ptr() as usize,
            len.max(1),
            super::access_to(access),
        )
    }
    .map_err(|e| super::io_err("ibv_reg_mr", &e))?;
    Ok(IbvMr {
        mr,
        buf: Arc::new(buf),
        locks: (0..chunks).map(|_| ChunkLock::default()).collect(),
        posted: Arc::default(),
        chunk_len,
        len,
        access,
        pd_id: pd.id,
    })
}

impl IbvMr {
    fn check(&self, offset: usize, len: usize) -> Result<(), VerbsError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(VerbsError::SgeOutOfBounds {
                offset,
                len,
                region_len: self.len,
            });
        }
        Ok(())
    }

    fn addr(&self, offset: usize) -> u64 {
        self.buf.ptr.as_ptr() as u64 + offset as u64
    }

    /// Locks every chunk `len` bytes at `offset` touch, in ascending order
    /// (the caller checked bounds).
    fn lock_range(&self, offset: usize, len: usize) -> Vec<parking_lot::MutexGuard<'_, ()>> {
        if len == 0 || self.chunk_len == 0 {
            return Vec::new();
        }
        let (first, last) = (offset / self.chunk_len, (offset + len - 1) / self.chunk_len);
        self.locks[first..=last].iter().map(|l| l.lock()).collect()
    }

    fn busy(&self, offset: usize, len: usize) -> VerbsError {
        VerbsError::MemoryBusy {
            lkey: Lkey(self.mr.lkey()),
            offset,
            len,
        }
    }

    /// Marks `len` bytes at `offset` as named by a posted WR (the caller
    /// checked bounds), under the locks of the chunks they cover; fails if
    /// user code holds one. `None` for no bytes.
    fn pin(
        &self,
        offset: usize,
        len: usize,
        device_writes: bool,
    ) -> Result<Option<Pin>, VerbsError> {
        if len == 0 || self.chunk_len == 0 {
            return Ok(None);
        }
        let (first, last) = (offset / self.chunk_len, (offset + len - 1) / self.chunk_len);
        let mut locks = Vec::with_capacity(last - first + 1);
        for lock in &self.locks[first..=last] {
            locks.push(lock.try_lock().ok_or_else(|| self.busy(offset, len))?);
        }
        let range = PostedRange {
            start: offset,
            end: offset + len,
            device_writes,
        };
        self.posted.lock().ranges.push(range);
        Ok(Some(Pin {
            posted: self.posted.clone(),
            range,
            _mr: self.mr.clone(),
            _buf: self.buf.clone(),
        }))
    }

    /// Whether user code may not have `len` bytes at `offset` now.
    fn refused(&self, offset: usize, len: usize, writing: bool) -> bool {
        self.posted.lock().refuses(offset, offset + len, writing)
    }

    /// A guard of chunk `index` under `lock`, unless a posted WR names it.
    fn guard(
        &self,
        index: usize,
        lock: parking_lot::ArcMutexGuard<parking_lot::RawMutex, ()>,
    ) -> Option<IbvMrGuard> {
        if self.refused(index * self.chunk_len, self.chunk_len, true) {
            return None;
        }
        Some(IbvMrGuard {
            _lock: lock,
            buf: self.buf.clone(),
            offset: index * self.chunk_len,
            len: self.chunk_len,
        })
    }
}

impl MemoryRegion for IbvMr {
    type Guard = IbvMrGuard;

    fn lock_chunk(&self, index: usize) -> Option<IbvMrGuard> {
        let lock = parking_lot::Mutex::lock_arc(self.locks.get(index)?);
        self.guard(index, lock)
    }

    fn try_lock_chunk(&self, index: usize) -> Option<IbvMrGuard> {
        let lock = parking_lot::Mutex::try_lock_arc(self.locks.get(index)?)?;
        self.guard(index, lock)
    }

    fn chunk_len(&self) -> usize {
        self.chunk_len
    }

    fn chunks(&self) -> usize {
        self.locks.len()
    }

    fn lkey(&self) -> Lkey {
        Lkey(self.mr.lkey())
    }

    fn len(&self) -> usize {
        self.len
    }

    fn access(&self) -> AccessFlags {
        self.access
    }

    fn with_mut<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, VerbsError> {
        self.check(offset, len)?;
        let _locks = self.lock_range(offset, len);
        if self.refused(offset, len, true) {
            return Err(self.busy(offset, len));
        }
        // SAFETY: offset + len is within the buffer (checked); the locks of
        // every chunk it covers are held, so no other slice of these bytes
        // exists, and no posted WR names them (a post marks its bytes under
        // the same locks, and a marked range was refused just above).
        let s = unsafe { std::slice::from_raw_parts_mut(self.buf.ptr.as_ptr().add(offset), len) };
        Ok(f(s))
    }

    fn with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, VerbsError> {
        self.check(offset, len)?;
        let _locks = self.lock_range(offset, len);
        if self.refused(offset, len, false) {
            return Err(self.busy(offset, len));
        }
        // SAFETY: as in `with_mut`; a posted send's bytes may be read, the
        // device only reads them too.
        let s = unsafe { std::slice::from_raw_parts(self.buf.ptr.as_ptr().add(offset), len) };
        Ok(f(s))
    }
}

/// Outstanding WRs of one queue, in posting order: the posted `wr_id` is the
/// sequence number, the user's `wr_id` is kept here, with the pins of the
/// bytes the WR names (dropped when it retires).
pub(crate) struct Ring {
    base: u64,
    ids: VecDeque<(u64, Vec<Pin>)>,
    depth: usize,
}

impl Ring {
    fn new(depth: usize) -> Ring {
        Ring {
            base: 0,
            ids: VecDeque::with_capacity(depth),
            depth,
        }
    }

    fn next_seq(&self) -> u64 {
        self.base + self.ids.len() as u64
    }

    /// The user id of `seq`; every earlier WR of this queue completed too
    /// (unsignaled sends complete silently with a later signaled one).
    pub(crate) fn complete(&mut self, seq: u64) -> Option<u64> {
        if seq < self.base || seq >= self.next_seq() {
            return None;
        }
        let skip = (seq - self.base) as usize;
        self.ids.drain(..skip);
        self.base = seq + 1;
        self.ids.pop_front().map(|(id, _pins)| id)
    }

    fn clear(&mut self) {
        self.base = self.next_seq();
        self.ids.clear();
    }
}

/// State shared with the CQs, which translate completions through it.
pub(crate) struct QpShared {
    pub(crate) sq: Mutex<Ring>,
    pub(crate) rq: Mutex<Ring>,
}

/// An RC queue pair.
///
/// # Safety
///
/// Lifetime invariants:
/// - the sideway QP holds `Arc`s of its PD and both CQs, so they are destroyed
///   after it; the raw `ibv_qp` pointer used to post is borrowed from it;
/// - SGEs are checked against their region's bounds, access and PD before a
///   post, and each posted SGE's `Pin` (in the ring) keeps its region
///   registered, its memory alive and its bytes marked until the WR retires
///   or the queue is reset; the QP is destroyed before the rings drop.
///
/// Destroy order:
/// 1. the QP is unregistered from its CQs (later completions for its QPN are
///    dropped);
/// 2. `ibv_destroy_qp` (sideway drop);
/// 3. the rings, and with them the pins of WRs never retired;
/// 4. the CQs and PD, when their last holder goes.
pub struct IbvQp {
    /// First: destroyed before the rings below let go of the bytes their
    /// WRs name (the drop has taken the QP out of its CQs' tables, so
    /// nothing else holds the rings then).
    qp: Mutex<BasicQueuePair>,
    shared: Arc<QpShared>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    raw: NonNull<ibv_qp>,
    qpn: Qpn,
    psn: Psn,
    caps: QpCaps,
    pd_id: u64,
    /// The state after our last successful modify (async ERR is not seen here).
    cached: Mutex<QpState>,
    dev: Arc<DevInner>,
}

// SAFETY: `raw` is only used for ibv_post_send/ibv_post_recv, which libibverbs
// makes thread-safe per QP (and which are serialised here anyway, each under
// its ring's mutex); everything else is behind mutexes or immutable.
unsafe impl Send for IbvQp {}
// SAFETY: as above.
unsafe impl Sync for IbvQp {}

impl Drop for IbvQp {
    fn drop(&mut self) {
        for cq in [&self.send_cq, &self.recv_cq] {
            // No panic in drop: a poisoned table still takes the removal.
            cq.qps
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&self.qpn.value());
        }
    }
}

impl IbvQp {
    pub(crate) fn new(
        dev: &Arc<DevInner>,
        pd: &IbvPd,
        send_cq: &IbvCq,
        recv_cq: &IbvCq,
        caps: QpCaps,
    ) -> Result<IbvQp, VerbsError> {
        // Capabilities the kernel takes as u32: a larger one is refused, not cut.
        let cap =
            |attr, value: usize| u32::try_from(value).map_err(|_| VerbsError::InvalidAttr { attr });
        let qp = pd
            .pd
            .create_qp_builder()
            .setup_max_send_wr(cap("max_send_wr", caps.max_send_wr)?)
            .setup_max_recv_wr(cap("max_recv_wr", caps.max_recv_wr)?)
            .setup_max_send_sge(cap("max_sge", caps.max_sge)?)
            .setup_max_recv_sge(cap("max_sge", caps.max_sge)?)
            .setup_max_inline_data(cap("max_inline_data", caps.max_inline_data)?)
            .setup_send_cq(GenericCompletionQueue::from(Arc::clone(&send_cq.inner.cq)))
            .setup_recv_cq(GenericCompletionQueue::from(Arc::clone(&recv_cq.inner.cq)))
            .build()
            .map_err(|e| super::io_err("ibv_create_qp", &e))?;
        // SAFETY: only the pointer is copied; the QP lives in `self.qp`.
        let raw = unsafe { qp.qp() };
        let qpn = Qpn::new(qp.qp_number());
        let shared = Arc::new(QpShared {
            sq: Mutex::new(Ring::new(caps.max_send_wr)),
            rq: Mutex::new(Ring::new(caps.max_recv_wr)),
        });
        for cq in [send_cq, recv_cq] {
            cq.inner
                .qps
                .lock()
                .expect("qps lock")
                .insert(qpn.value(), Arc::downgrade(&shared));
        }
        Ok(IbvQp {
            qp: Mutex::new(qp),
            shared,
            send_cq: Arc::clone(&send_cq.inner),
            recv_cq: Arc::clone(&recv_cq.inner),
            raw,
            qpn,
            psn: Psn::new(rand::random::<u32>()),
            caps,
            pd_id: pd.id,
            cached: Mutex::new(QpState::Reset),
            dev: Arc::clone(dev),
        })
    }

    fn query_state(&self) -> QpState {
        let qp = self.qp.lock().expect("qp lock");
        match qp.query(QueuePairAttributeMask::State) {
            Ok((attr, _)) => match attr.state() {
                QueuePairState::Reset => QpState::Reset,
                QueuePairState::Init => QpState::Init,
                QueuePairState::ReadyToReceive => QpState::Rtr,
                QueuePairState::ReadyToSend => QpState::Rts,
                _ => QpState::Err,
            },
            Err(e) => {
                tracing::warn!("ibv_query_qp {}: {e}", self.qpn);
                *self.cached.lock().expect("state lock")
            }
        }
    }

    fn modify(&self, attr: &QueuePairAttribute, to: QpState) -> Result<(), VerbsError> {
        let mut qp = self.qp.lock().expect("qp lock");
        qp.modify(attr)
            .map_err(|e| super::io_err("ibv_modify_qp", &e))?;
        *self.cached.lock().expect("state lock") = to;
        Ok(())
    }

    fn require(&self, op: QpOp, ok: &[QpState]) -> Result<(), VerbsError> {
        let state = self.query_state();
        if ok.contains(&state) {
            Ok(())
        } else {
            Err(VerbsError::InvalidState {
                qpn: self.qpn,
                state,
                op,
            })
        }
    }

    fn check_sge(&self, sge: &Sge<'_, IbvMr>, need: AccessFlags) -> Result<ibv_sge, VerbsError> {
        let mr = sge.mr;
        mr.check(sge.offset, sge.len)?;
        let length = u32::try_from(sge.len).map_err(|_| VerbsError::TooLarge {
            cap: "sge length",
            got: sge.len,
            max: u32::MAX as usize,
        })?;
        if mr.pd_id != self.pd_id {
            return Err(VerbsError::WrongPd { lkey: mr.lkey() });
        }
        if !mr.access.contains(need) {
            return Err(VerbsError::AccessDenied {
                lkey: mr.lkey(),
                needed: need,
            });
        }
        Ok(ibv_sge {
            addr: mr.addr(sge.offset),
            length,
            lkey: mr.mr.lkey(),
        })
    }

    /// The pins of a WR's SGEs (checked already); a failed post drops them.
    fn pins(sg_list: &[Sge<'_, IbvMr>], device_writes: bool) -> Result<Vec<Pin>, VerbsError> {
        let mut pins = Vec::with_capacity(sg_list.len());
        for sge in sg_list {
            pins.extend(sge.mr.pin(sge.offset, sge.len, device_writes)?);
        }
        Ok(pins)
    }

    fn post_err(posted: usize, source: VerbsError) -> PostError {
        PostError { posted, source }
    }
}

impl QueuePair for IbvQp {
    type Mr = IbvMr;

    fn qp_num(&self) -> Qpn {
        self.qpn
    }

    fn initial_psn(&self) -> Psn {
        self.psn
    }

    fn state(&self) -> QpState {
        self.query_state()
    }

    fn modify_to_init(&self, attr: InitAttr) -> Result<(), VerbsError> {
        self.require(QpOp::ToInit, &[QpState::Reset])?;
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Init)
            .setup_pkey_index(self.dev.cfg.pkey_index)
            .setup_port(self.dev.port)
            .setup_access_flags(super::access_to(attr.access));
        self.modify(&a, QpState::Init)
    }

    fn modify_to_rtr(&self, attr: RtrAttr) -> Result<(), VerbsError> {
        self.require(QpOp::ToRtr, &[QpState::Init])?;
        if attr.min_rnr_timer > 31 {
            return Err(VerbsError::InvalidAttr {
                attr: "min_rnr_timer",
            });
        }
        let active = super::mtu_from(
            self.dev
                .ctx
                .query_port(self.dev.port)
                .map_err(|e| super::io_err("ibv_query_port", &e))?
                .active_mtu(),
        );
        if attr.path_mtu > active {
            return Err(VerbsError::InvalidAttr {
                attr: "path_mtu above the port's active MTU",
            });
        }
        if attr.remote_udp_port != super::ROCE_UDP_PORT {
            return Err(VerbsError::InvalidAttr {
                attr: "remote_udp_port: kernel RoCEv2 sends to 4791 only",
            });
        }
        let cfg = &self.dev.cfg;
        let mut ah = AddressHandleAttribute::new();
        ah.setup_port(self.dev.port)
            .setup_service_level(cfg.service_level)
            .setup_grh(
                &SwGid {
                    raw: attr.remote_gid.0,
                },
                0,
                self.dev.gid_index,
                cfg.hop_limit,
                cfg.traffic_class,
            );
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(super::mtu_to(attr.path_mtu))
            .setup_dest_qp_num(attr.dest_qpn.value())
            .setup_rq_psn(attr.rq_psn.value())
            .setup_max_dest_read_atomic(1)
            .setup_min_rnr_timer(attr.min_rnr_timer)
            .setup_address_vector(&ah);
        self.modify(&a, QpState::Rtr)
    }

    fn modify_to_rts(&self, attr: RtsAttr) -> Result<(), VerbsError> {
        self.require(QpOp::ToRts, &[QpState::Rtr])?;
        if attr.timeout > 31 {
            return Err(VerbsError::InvalidAttr { attr: "timeout" });
        }
        if attr.retry_cnt > 7 {
            return Err(VerbsError::InvalidAttr { attr: "retry_cnt" });
        }
        if attr.rnr_retry > 7 {
            return Err(VerbsError::InvalidAttr { attr: "rnr_retry" });
        }
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(attr.sq_psn.value())
            .setup_timeout(attr.timeout)
            .setup_retry_cnt(attr.retry_cnt)
            .setup_rnr_retry(attr.rnr_retry)
            .setup_max_read_atomic(1);
        self.modify(&a, QpState::Rts)
    }

    fn modify_to_error(&self) -> Result<(), VerbsError> {
        // The kernel's transition table has no RESET -> ERR (IBA allows it):
        // pass through INIT, which holds no WRs either.
        if self.query_state() == QpState::Reset {
            let mut a = QueuePairAttribute::new();
            a.setup_state(QueuePairState::Init)
                .setup_pkey_index(self.dev.cfg.pkey_index)
                .setup_port(self.dev.port)
                .setup_access_flags(super::access_to(AccessFlags::LOCAL_WRITE));
            self.modify(&a, QpState::Init)?;
        }
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Error);
        self.modify(&a, QpState::Err)
    }

    fn modify_to_reset(&self) -> Result<(), VerbsError> {
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Reset);
        // Hold both rings across the modify so no completion is translated
        // against a half-cleared queue.
        let mut sq = self.shared.sq.lock().expect("sq lock");
        let mut rq = self.shared.rq.lock().expect("rq lock");
        self.modify(&a, QpState::Reset)?;
        sq.clear();
        rq.clear();
        Ok(())
    }

    fn peer_request_error(&self) -> Option<PeerRequestError> {
        // A NIC reports it as IBV_EVENT_QP_REQ_ERR / QP_ACCESS_ERR on the
        // device's async fd, with no order against the CQ: not used.
        None
    }

    fn post_send(&self, wrs: &[SendWr<'_, IbvMr>]) -> Result<(), PostError> {
        let state = *self.cached.lock().expect("state lock");
        if !matches!(state, QpState::Rts | QpState::Err) {
            return Err(Self::post_err(
                0,
                VerbsError::InvalidState {
                    qpn: self.qpn,
                    state,
                    op: QpOp::PostSend,
                },
            ));
        }
        let mut sq = self.shared.sq.lock().expect("sq lock");
        for (i, wr) in wrs.iter().enumerate() {
            if sq.ids.len() >= sq.depth {
                return Err(Self::post_err(
                    i,
                    VerbsError::SendQueueFull {
                        qpn: self.qpn,
                        depth: sq.depth,
                    },
                ));
            }
            if wr.sg_list.len() > self.caps.max_sge {
                return Err(Self::post_err(
                    i,
                    VerbsError::TooLarge {
                        cap: "max_sge",
                        got: wr.sg_list.len(),
                        max: self.caps.max_sge,
                    },
                ));
            }
            let mut sges = [ibv_sge {
                addr: 0,
                length: 0,
                lkey: 0,
            }; 16];
            if wr.sg_list.len() > sges.len() {
                return Err(Self::post_err(
                    i,
                    VerbsError::TooLarge {
                        cap: "sge list",
                        got: wr.sg_list.len(),
                        max: sges.len(),
                    },
                ));
            }
            let mut total = 0usize;
            for (k, sge) in wr.sg_list.iter().enumerate() {
                sges[k] = self
                    .check_sge(sge, AccessFlags::LOCAL_READ)
                    .map_err(|e| Self::post_err(i, e))?;
                total += sge.len;
            }
            // Marked for the call, and after it unless inline (the library
            // copies inline data during the call).
            let pins = Self::pins(wr.sg_list, false).map_err(|e| Self::post_err(i, e))?;
            if wr.inline && total > self.caps.max_inline_data {
                return Err(Self::post_err(
                    i,
                    VerbsError::TooLarge {
                        cap: "max_inline_data",
                        got: total,
                        max: self.caps.max_inline_data,
                    },
                ));
            }
            let seq = sq.next_seq();
            // SAFETY: ibv_send_wr is plain data (integers, pointers, unions of
            // them); all-zero is valid and the fields that matter are set below.
            let mut raw: ibv_send_wr = unsafe { std::mem::zeroed() };
            raw.wr_id = seq;
            raw.next = ptr::null_mut();
            raw.sg_list = sges.as_mut_ptr();
            raw.num_sge = wr.sg_list.len() as i32;
            let (opcode, imm) = match wr.opcode {
                SendOpcode::Send => (WR_SEND, 0),
                SendOpcode::SendWithImm(imm) => (WR_SEND_WITH_IMM, imm.to_be()),
            };
            raw.opcode = opcode as _;
            raw.imm_data_invalidated_rkey_union.imm_data = imm;
            raw.send_flags = if wr.signaled { SEND_SIGNALED } else { 0 }
                | if wr.inline { SEND_INLINE } else { 0 };
            let mut bad: *mut ibv_send_wr = ptr::null_mut();
            // SAFETY: the QP is alive (held in self.qp); `raw` and `sges` are
            // valid for the call (inline data is copied during it); every SGE
            // lies inside a registered region of this QP's PD (checked above).
            let rc =
                unsafe { rdma_mummy_sys::ibv_post_send(self.raw.as_ptr(), &mut raw, &mut bad) };
            if rc != 0 {
                let source = if rc == libc::ENOMEM {
                    VerbsError::SendQueueFull {
                        qpn: self.qpn,
                        depth: sq.depth,
                    }
                } else {
                    VerbsError::Io {
                        op: "ibv_post_send",
                        kind: std::io::Error::from_raw_os_error(rc).kind(),
                    }
                };
                return Err(Self::post_err(i, source));
            }
            sq.ids
                .push_back((wr.wr_id, if wr.inline { Vec::new() } else { pins }));
        }
        Ok(())
    }

    fn post_recv(&self, wrs: &[RecvWr<'_, IbvMr>]) -> Result<(), PostError> {
        let state = *self.cached.lock().expect("state lock");
        if state == QpState::Reset {
            return Err(Self::post_err(
                0,
                VerbsError::InvalidState {
                    qpn: self.qpn,
                    state,
                    op: QpOp::PostRecv,
                },
            ));
        }
        let mut rq = self.shared.rq.lock().expect("rq lock");
        for (i, wr) in wrs.iter().enumerate() {
            if rq.ids.len() >= rq.depth {
                return Err(Self::post_err(
                    i,
                    VerbsError::RecvQueueFull {
                        qpn: self.qpn,
                        depth: rq.depth,
                    },
                ));
            }
            if wr.sg_list.len() > self.caps.max_sge || wr.sg_list.len() > 16 {
                return Err(Self::post_err(
                    i,
                    VerbsError::TooLarge {
                        cap: "max_sge",
                        got: wr.sg_list.len(),
                        max: self.caps.max_sge.min(16),
                    },
                ));
            }
            let mut sges = [ibv_sge {
                addr: 0,
                length: 0,
                lkey: 0,
            }; 16];
            for (k, sge) in wr.sg_list.iter().enumerate() {
                sges[k] = self
                    .check_sge(sge, AccessFlags::LOCAL_WRITE)
                    .map_err(|e| Self::post_err(i, e))?;
            }
            let pins = Self::pins(wr.sg_list, true).map_err(|e| Self::post_err(i, e))?;
            let mut raw = ibv_recv_wr {
                wr_id: RECV_BIT | rq.next_seq(),
                next: ptr::null_mut(),
                sg_list: sges.as_mut_ptr(),
                num_sge: wr.sg_list.len() as i32,
            };
            let mut bad: *mut ibv_recv_wr = ptr::null_mut();
            // SAFETY: the QP is alive; `raw` and `sges` are valid for the call;
            // every SGE lies inside a registered, locally writable region of
            // this QP's PD (checked above).
            let rc =
                unsafe { rdma_mummy_sys::ibv_post_recv(self.raw.as_ptr(), &mut raw, &mut bad) };
            if rc != 0 {
                let source = if rc == libc::ENOMEM {
                    VerbsError::RecvQueueFull {
                        qpn: self.qpn,
                        depth: rq.depth,
                    }
                } else {
                    VerbsError::Io {
                        op: "ibv_post_recv",
                        kind: std::io::Error::from_raw_os_error(rc).kind(),
                    }
                };
                return Err(Self::post_err(i, source));
            }
            rq.ids.push_back((wr.wr_id, pins));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Posted, PostedRange, Ring};

    fn ring_with(ids: &[u64]) -> Ring {
        let mut r = Ring::new(8);
        for &id in ids {
            r.ids.push_back((id, Vec::new()));
        }
        r
    }

    #[test]
    fn a_signaled_completion_retires_earlier_unsignaled_wrs() {
        let mut r = ring_with(&[10, 11, 12, 13]);
        assert_eq!(r.complete(2), Some(12), "seq 2 carries user id 12");
        assert_eq!(r.ids.len(), 1, "seqs 0 and 1 retired silently");
        assert_eq!(r.next_seq(), 4);
        assert_eq!(r.complete(1), None, "an already retired seq is ignored");
        assert_eq!(r.complete(3), Some(13));
        assert!(r.ids.is_empty());
    }

    #[test]
    fn unknown_or_cleared_sequences_are_dropped() {
        let mut r = ring_with(&[1, 2]);
        assert_eq!(r.complete(5), None, "beyond what was posted");
        r.clear();
        assert_eq!(r.complete(0), None, "discarded by a reset");
        assert_eq!(r.next_seq(), 2, "sequences keep counting after a reset");
        r.ids.push_back((7, Vec::new()));
        assert_eq!(r.complete(2), Some(7));
    }

    #[test]
    fn posted_receives_refuse_reads_and_writes_posted_sends_only_writes() {
        let recv = PostedRange {
            start: 100,
            end: 200,
            device_writes: true,
        };
        let send = PostedRange {
            start: 300,
            end: 400,
            device_writes: false,
        };
        let mut posted = Posted::default();
        posted.ranges.extend([recv, send, send]);
        for writing in [false, true] {
            assert!(posted.refuses(150, 160, writing), "inside a receive");
            assert!(posted.refuses(50, 101, writing), "over its first byte");
            assert!(posted.refuses(199, 250, writing), "over its last byte");
            assert!(!posted.refuses(0, 100, writing), "just before it");
            assert!(!posted.refuses(200, 300, writing), "between the two");
        }
        assert!(
            !posted.refuses(350, 360, false),
            "a send's bytes may be read"
        );
        assert!(posted.refuses(350, 360, true), "not written");
        // Two sends of the same bytes: the second still marks them.
        posted.remove(send);
        assert!(posted.refuses(350, 360, true));
        posted.remove(send);
        assert!(!posted.refuses(350, 360, true));
        posted.remove(recv);
        assert!(posted.ranges.is_empty());
    }
}
