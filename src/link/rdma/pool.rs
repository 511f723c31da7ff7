//! The send-buffer pool: one PD and one local-read MR per device per node,
//! cut into `max_batch` chunks that links hold only while a batch is being
//! encoded or is in flight.
//!
//! ```text
//!  SendPool (PD, MR = [chunk 0 | chunk 1 | ... | chunk P-1], free list, waiting leases)
//!    link ─ Lease (cap ≤ send_buffers) ─ try_take ─► PoolChunk (owned chunk guard)
//!         ─ encode in place ─ post: guard dropped, SGE (MR, idx × max_batch, len)
//!         ─ send completion / flush / QP reset or destroy ─► PoolChunk dropped ─► free
//!  free chunk ─► every waiting reserve wakes; the oldest waiting leases go first
//! ```
//!
//! Owner: `PoolState` (one mutex) holds the free list, per-lease counts and
//! the FIFO of leases waiting for a chunk (at most one entry per lease). A
//! link takes it only under its own state lock, never the reverse. Design:
//! docs/rdma-link.md § "The send-buffer pool".

use std::collections::{HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;
use tokio::sync::futures::Notified;

use super::RdmaError;
use super::registered::{RegisteredBudget, Registration};
use crate::verbs::{AccessFlags, Device, MemoryRegion};

/// Default of [`super::RdmaNodeConfig::pool_buffers`]: chunks of `max_batch`
/// bytes in a node's send pool.
pub const DEFAULT_POOL_BUFFERS: usize = 64;

/// Where a pool stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Chunks in the pool.
    pub chunks: usize,
    /// Chunks held by links (being encoded, or posted and not yet completed),
    /// counted per link.
    pub in_use: usize,
    /// Chunks on the free list, counted apart from `in_use`: the two add up
    /// to `chunks` unless a chunk was lost or returned twice.
    pub free: usize,
    /// Times a link found no chunk it could take and had to wait.
    pub waits: u64,
    /// Links (leases) that have the pool now.
    pub leases: usize,
}

#[derive(Debug)]
struct LeaseEntry {
    held: usize,
    cap: usize,
    /// False once the lease is dropped; the entry goes with its last chunk.
    live: bool,
}

#[derive(Debug)]
struct PoolState {
    free: Vec<usize>,
    leases: HashMap<u64, LeaseEntry>,
    /// Leases whose `reserve` found only the pool in its way, oldest first.
    waiting: VecDeque<u64>,
    next_lease: u64,
    /// Chunks posted unsignaled and not yet returned.
    unsignaled: usize,
    waits: u64,
}

impl PoolState {
    fn leave(&mut self, lease: u64) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|&id| id != lease);
        self.waiting.len() != before
    }
}

/// Field order is the verbs destroy order: MR, then PD.
struct PoolShared<D: Device> {
    mr: D::Mr,
    /// Most chunks one lease may hold, whatever its own cap.
    max_share: usize,
    pd: D::Pd,
    /// The node budget's bytes for the MR, given back after it.
    _registration: Registration,
    state: Mutex<PoolState>,
    /// A chunk came back or the waiting order changed.
    freed: Notify,
}

impl<D: Device> PoolShared<D> {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // Every section leaves the state whole; chunks return from `Drop`,
        // which must not panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A device's send buffers in one registered region, shared by every link
/// a node runs on that device; links create their QPs on its PD. Cheap to
/// clone.
pub struct SendPool<D: Device> {
    shared: Arc<PoolShared<D>>,
}

impl<D: Device> Clone for SendPool<D> {
    fn clone(&self) -> Self {
        SendPool {
            shared: self.shared.clone(),
        }
    }
}

impl<D: Device> std::fmt::Debug for SendPool<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendPool")
            .field("chunk_len", &self.chunk_len())
            .field("stats", &self.stats())
            .finish()
    }
}

impl<D: Device> SendPool<D> {
    /// Allocates a PD and registers `chunks × chunk_len` bytes (local read
    /// only) as one MR, first taking those bytes from `budget`. One link may
    /// hold every chunk (a link's private pool).
    pub fn new(
        dev: &D,
        chunk_len: usize,
        chunks: usize,
        budget: &RegisteredBudget,
    ) -> Result<SendPool<D>, RdmaError> {
        SendPool::with_max_share(dev, chunk_len, chunks, chunks, budget)
    }

    /// As [`SendPool::new`] for a pool links share: one link holds at most
    /// half the chunks (rounded up), so a link whose SENDs cannot complete
    /// (a partitioned peer) leaves the others room even when the pool is
    /// smaller than a link's `send_buffers`.
    pub fn shared(
        dev: &D,
        chunk_len: usize,
        chunks: usize,
        budget: &RegisteredBudget,
    ) -> Result<SendPool<D>, RdmaError> {
        SendPool::with_max_share(dev, chunk_len, chunks, chunks.div_ceil(2), budget)
    }

    fn with_max_share(
        dev: &D,
        chunk_len: usize,
        chunks: usize,
        max_share: usize,
        budget: &RegisteredBudget,
    ) -> Result<SendPool<D>, RdmaError> {
        for (field, value) in [("max_batch", chunk_len), ("pool_buffers", chunks)] {
            if value == 0 {
                return Err(RdmaError::InvalidConfig { field, value });
            }
        }
        let registration = budget.reserve(chunk_len.saturating_mul(chunks))?;
        let pd = dev.alloc_pd()?;
        let mr = dev.reg_chunked_mr(&pd, chunk_len, chunks, AccessFlags::LOCAL_READ)?;
        Ok(SendPool {
            shared: Arc::new(PoolShared {
                mr,
                max_share: max_share.max(1),
                pd,
                _registration: registration,
                state: Mutex::new(PoolState {
                    free: (0..chunks).rev().collect(),
                    leases: HashMap::new(),
                    waiting: VecDeque::new(),
                    next_lease: 0,
                    unsignaled: 0,
                    waits: 0,
                }),
                freed: Notify::new(),
            }),
        })
    }

    /// The protection domain every link on this pool lives in.
    pub fn pd(&self) -> &D::Pd {
        &self.shared.pd
    }

    /// The one registered region.
    pub(super) fn mr(&self) -> &D::Mr {
        &self.shared.mr
    }

    /// Bytes per chunk: the links' `max_batch`.
    pub fn chunk_len(&self) -> usize {
        self.shared.mr.chunk_len()
    }

    /// Where the pool stands.
    pub fn stats(&self) -> PoolStats {
        let st = self.shared.lock();
        PoolStats {
            chunks: self.shared.mr.chunks(),
            in_use: st.leases.values().map(|l| l.held).sum(),
            free: st.free.len(),
            waits: st.waits,
            leases: st.leases.values().filter(|l| l.live).count(),
        }
    }

    /// Most chunks one link may hold at once (its lease's cap is the
    /// smaller of this and its `send_buffers`).
    pub fn max_share(&self) -> usize {
        self.shared.max_share
    }

    /// A link's right to hold at most `cap` chunks at once (never more than
    /// [`SendPool::max_share`]).
    pub(super) fn lease(&self, cap: usize) -> Lease<D> {
        let cap = cap.min(self.shared.max_share);
        let mut st = self.shared.lock();
        let id = st.next_lease;
        st.next_lease += 1;
        st.leases.insert(
            id,
            LeaseEntry {
                held: 0,
                cap,
                live: true,
            },
        );
        Lease {
            pool: self.clone(),
            id,
        }
    }
}

/// Why [`Lease::try_take`] gave no chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Blocked {
    /// The link holds its cap; its own completions free one.
    Cap,
    /// No chunk is free for this link now; it waits in line.
    Empty,
}

/// One link's share of a pool. Dropping it leaves the line; chunks it still
/// holds come back on their own.
pub(super) struct Lease<D: Device> {
    pool: SendPool<D>,
    id: u64,
}

impl<D: Device> Lease<D> {
    pub(super) fn pool(&self) -> &SendPool<D> {
        &self.pool
    }

    /// A chunk, if the link is under its cap and one is free for it: free
    /// chunks go first to leases waiting longer. On `Empty` the lease joins
    /// the line (once).
    pub(super) fn try_take(&self) -> Result<PoolChunk<D>, Blocked> {
        self.take(true)
    }

    /// [`Lease::try_take`] that never joins the line: a look, for a
    /// producer's write in its own turn.
    pub(super) fn try_take_unqueued(&self) -> Option<PoolChunk<D>> {
        self.take(false).ok()
    }

    fn take(&self, queue: bool) -> Result<PoolChunk<D>, Blocked> {
        let shared = &self.pool.shared;
        let idx = {
            let mut st = shared.lock();
            let Some(entry) = st.leases.get(&self.id) else {
                return Err(Blocked::Cap); // unreachable while the lease lives
            };
            if entry.held >= entry.cap {
                return Err(Blocked::Cap);
            }
            let ahead = st
                .waiting
                .iter()
                .position(|&id| id == self.id)
                .unwrap_or(st.waiting.len());
            if st.free.len() <= ahead {
                if queue && ahead == st.waiting.len() {
                    st.waiting.push_back(self.id);
                    st.waits += 1;
                }
                return Err(Blocked::Empty);
            }
            let idx = st.free.pop().expect("more free chunks than leases ahead");
            st.leave(self.id);
            if let Some(entry) = st.leases.get_mut(&self.id) {
                entry.held += 1;
            }
            idx
        };
        // Free means no WR names it, so only a closing gather can hold it.
        let guard = shared.mr.lock_chunk(idx);
        debug_assert!(
            guard.is_some(),
            "a free chunk is lent (no posted WR names it)"
        );
        Ok(PoolChunk {
            shared: shared.clone(),
            lease: self.id,
            idx,
            unsignaled: false,
            guard,
        })
    }

    /// Leaves the line (the link's `reserve` is blocked by something else,
    /// or gone); the leases behind move up.
    pub(super) fn leave_queue(&self) {
        if self.pool.shared.lock().leave(self.id) {
            self.pool.shared.freed.notify_waiters();
        }
    }

    /// Resolves after a chunk comes back or the line moves. Enable it
    /// before looking at the pool.
    pub(super) fn notified(&self) -> Notified<'_> {
        self.pool.shared.freed.notified()
    }

    /// Decides whether posting `chunk` is signaled (`link_wants`: the link's
    /// own rule). A chunk whose completion someone may wait for is always
    /// signaled: the lease's last chunk, the pool's last chunk, any chunk
    /// while a lease waits, and any past half the pool posted unsignaled,
    /// so idle links cannot sit on unreturned chunks.
    pub(super) fn signal(&self, chunk: &mut PoolChunk<D>, link_wants: bool) -> bool {
        let mut st = self.pool.shared.lock();
        let at_cap = st
            .leases
            .get(&self.id)
            .is_none_or(|entry| entry.held >= entry.cap);
        let signaled = link_wants
            || at_cap
            || st.free.is_empty()
            || !st.waiting.is_empty()
            || 2 * (st.unsignaled + 1) > self.pool.shared.mr.chunks();
        if !signaled && !chunk.unsignaled {
            chunk.unsignaled = true;
            st.unsignaled += 1;
        }
        signaled
    }
}

impl<D: Device> Drop for Lease<D> {
    fn drop(&mut self) {
        let mut st = self.pool.shared.lock();
        let moved = st.leave(self.id);
        if let Some(entry) = st.leases.get_mut(&self.id) {
            entry.live = false;
            if entry.held == 0 {
                st.leases.remove(&self.id);
            }
        }
        drop(st);
        if moved {
            self.pool.shared.freed.notify_waiters();
        }
    }
}

/// One chunk of a pool, held by one link: the owned guard while the batch
/// is encoded, then (guard dropped) while the WR naming it is in flight.
/// Dropping it returns the chunk, exactly once.
pub(super) struct PoolChunk<D: Device> {
    shared: Arc<PoolShared<D>>,
    lease: u64,
    idx: usize,
    unsignaled: bool,
    guard: Option<<D::Mr as MemoryRegion>::Guard>,
}

impl<D: Device> PoolChunk<D> {
    /// Offset of the chunk in the pool's MR (an SGE's `offset`).
    pub(super) fn offset(&self) -> usize {
        self.idx * self.shared.mr.chunk_len()
    }

    /// Gives up byte access before the chunk is posted (the provider gathers
    /// under the same lock).
    pub(super) fn unlock(&mut self) {
        self.guard = None;
    }
}

impl<D: Device> Deref for PoolChunk<D> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.guard.as_deref().unwrap_or(&[])
    }
}

impl<D: Device> DerefMut for PoolChunk<D> {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.guard.as_deref_mut().unwrap_or(&mut [])
    }
}

impl<D: Device> Drop for PoolChunk<D> {
    fn drop(&mut self) {
        self.guard = None;
        let mut st = self.shared.lock();
        debug_assert!(
            !st.free.contains(&self.idx),
            "chunk {} returned twice",
            self.idx
        );
        st.free.push(self.idx);
        if self.unsignaled {
            st.unsignaled = st.unsignaled.saturating_sub(1);
        }
        if let Some(entry) = st.leases.get_mut(&self.lease) {
            entry.held = entry.held.saturating_sub(1);
            if !entry.live && entry.held == 0 {
                st.leases.remove(&self.lease);
            }
        }
        drop(st);
        self.shared.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::soft::sim::SimNet;
    use crate::verbs::soft::{SoftConfig, SoftDevice};

    fn make(chunks: usize, shared: bool) -> (SimNet, SoftDevice, SendPool<SoftDevice>) {
        let mut net = SimNet::new(5);
        let dev = net.add_device(SoftConfig::default());
        let budget = RegisteredBudget::unbounded();
        let pool = if shared {
            SendPool::shared(&dev, 64, chunks, &budget)
        } else {
            SendPool::new(&dev, 64, chunks, &budget)
        }
        .expect("pool");
        (net, dev, pool)
    }

    #[test]
    fn one_mr_of_chunks_and_every_chunk_comes_back_once() {
        let (_net, dev, pool) = make(4, false);
        assert_eq!((dev.mr_count(), dev.mr_bytes()), (1, 4 * 64));
        let lease = pool.lease(4);
        let mut held: Vec<_> = (0..4).map(|_| lease.try_take().expect("free")).collect();
        let mut offsets: Vec<_> = held.iter().map(PoolChunk::offset).collect();
        offsets.sort_unstable();
        assert_eq!(offsets, [0, 64, 128, 192], "disjoint chunks of one MR");
        for (i, chunk) in held.iter_mut().enumerate() {
            assert_eq!(chunk.len(), 64);
            chunk.fill(i as u8 + 1);
        }
        assert_eq!(pool.stats().in_use, 4);
        assert_eq!(lease.try_take().err(), Some(Blocked::Cap));
        held.truncate(1);
        assert_eq!(pool.stats().in_use, 1);
        drop(held);
        assert_eq!(
            pool.stats(),
            PoolStats {
                chunks: 4,
                in_use: 0,
                free: 4,
                waits: 0,
                leases: 1
            }
        );
        drop(lease);
        assert_eq!(pool.stats().leases, 0);
    }

    #[test]
    fn a_lease_at_its_cap_cannot_take_and_the_oldest_waiter_goes_first() {
        let (_net, _dev, pool) = make(3, false);
        let (a, b, c) = (pool.lease(2), pool.lease(2), pool.lease(2));
        let a1 = a.try_take().expect("free");
        let a2 = a.try_take().expect("free");
        assert_eq!(a.try_take().err(), Some(Blocked::Cap), "a holds its cap");
        let b1 = b.try_take().expect("the third chunk");
        assert_eq!(c.try_take().err(), Some(Blocked::Empty), "c waits");
        assert_eq!(b.try_take().err(), Some(Blocked::Empty), "b waits behind c");
        assert_eq!(pool.stats().waits, 2);
        drop(a1);
        // One chunk is free and c is first in line: a, not in line, and b,
        // second, must leave it.
        assert_eq!(a.try_take().err(), Some(Blocked::Empty));
        assert_eq!(b.try_take().err(), Some(Blocked::Empty));
        let c1 = c.try_take().expect("c's turn");
        drop(a2);
        let b2 = b.try_take().expect("b's turn");
        drop((b1, b2, c1));
        assert_eq!(pool.stats().in_use, 0);
    }

    #[test]
    fn leaving_the_line_lets_the_next_lease_take() {
        let (_net, _dev, pool) = make(1, false);
        let (a, b, c) = (pool.lease(1), pool.lease(1), pool.lease(1));
        let held = a.try_take().expect("free");
        assert_eq!(b.try_take().err(), Some(Blocked::Empty));
        assert_eq!(c.try_take().err(), Some(Blocked::Empty));
        drop(held);
        assert_eq!(c.try_take().err(), Some(Blocked::Empty), "b is first");
        b.leave_queue();
        let held = c.try_take().expect("b left the line");
        assert_eq!(a.try_take().err(), Some(Blocked::Empty));
        drop(a); // a dropped lease leaves the line too
        drop(held);
        assert!(b.try_take().is_ok());
    }

    #[test]
    fn a_shared_pool_caps_one_link_at_half() {
        let (_net, _dev, pool) = make(5, true);
        assert_eq!(pool.max_share(), 3);
        let lease = pool.lease(16);
        let held: Vec<_> = (0..3).map(|_| lease.try_take().expect("free")).collect();
        assert_eq!(lease.try_take().err(), Some(Blocked::Cap));
        let other = pool.lease(16);
        assert!(other.try_take().is_ok(), "room for another link");
        drop(held);
    }

    #[test]
    fn a_chunk_someone_may_wait_for_is_signaled() {
        let (_net, _dev, pool) = make(8, false);
        let lease = pool.lease(8);
        let mut c0 = lease.try_take().expect("free");
        assert!(!lease.signal(&mut c0, false), "plenty free, nobody waits");
        assert!(lease.signal(&mut c0, true), "the link's own rule wins");
        let mut more: Vec<_> = (0..3).map(|_| lease.try_take().expect("free")).collect();
        for chunk in &mut more {
            assert!(!lease.signal(chunk, false));
        }
        // Four of eight posted unsignaled: a fifth would pass half the pool.
        let mut c4 = lease.try_take().expect("free");
        assert!(lease.signal(&mut c4, false));
        drop(more);
        assert!(!lease.signal(&mut c4, false), "returned chunks uncount");
        drop((c0, c4));

        let (_net, _dev, pool) = make(4, false);
        let (a, b, c) = (pool.lease(4), pool.lease(3), pool.lease(1));
        let mut a1 = a.try_take().expect("free");
        let mut b_held: Vec<_> = (0..3).map(|_| b.try_take().expect("free")).collect();
        assert!(
            b.signal(&mut b_held[0], false),
            "b at its cap, the pool empty"
        );
        assert_eq!(c.try_take().err(), Some(Blocked::Empty));
        b_held.pop();
        assert!(a.signal(&mut a1, false), "c waits for a chunk");
        assert!(c.try_take().is_ok());
        drop((a1, b_held));
    }
}
