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
#[non_exhaustive]
pub struct PoolStats {
    /// Chunks in the pool.
    pub chunks: usize,
    /// Chunks held by links (being encoded, or posted and not yet completed),
    /// counted per link.
    pub in_use: usize,
    /// Chunks on the free list, counted apart from `in_use`: with
    /// `set_aside` the three add up to `chunks` unless a chunk was lost or
    /// returned twice (or one is between the free list and a link).
    pub free: usize,
    /// Times a link found no chunk it could take and had to wait.
    pub waits: u64,
    /// Links (leases) that have the pool now.
    pub leases: usize,
    /// Free chunks set aside because the provider would not lend them
    /// (libibverbs lends none a posted WR names): offered again once
    /// another chunk comes back. Not counted in `free`.
    pub set_aside: usize,
    /// Times the provider would not lend a chunk the pool held free.
    pub refused_lends: u64,
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
    /// Free chunks the provider would not lend; back on `free` (below the
    /// rest) when a chunk returns, so a stuck one is not tried again and
    /// again in the meantime.
    set_aside: Vec<usize>,
    refused_lends: u64,
    /// `Empty` answers so far: a take in line that saw one come while its
    /// chunk was being lent wakes the line (that answer counted it ahead).
    empties: u64,
}

impl PoolState {
    /// Puts the chunks set aside back under the free ones: the provider
    /// may lend them now.
    fn offer_set_aside(&mut self) {
        if !self.set_aside.is_empty() {
            let aside = std::mem::take(&mut self.set_aside);
            self.free.splice(0..0, aside);
        }
    }

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
                    set_aside: Vec::new(),
                    refused_lends: 0,
                    empties: 0,
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
            set_aside: st.set_aside.len(),
            refused_lends: st.refused_lends,
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
    /// The provider would lend no chunk the pool holds free, and none is
    /// out to come back: the pool's account of what the provider holds is
    /// wrong, and waiting would wait forever.
    NotLent,
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

    /// A chunk the provider will not lend (libibverbs: a posted WR still
    /// names it; free should mean none does) is set aside and the next
    /// free one tried. The lease keeps its place in line until a chunk is
    /// lent; each chunk is tried at most once per return, so this ends.
    fn take(&self, queue: bool) -> Result<PoolChunk<D>, Blocked> {
        let shared = &self.pool.shared;
        loop {
            let (idx, in_line, empties) = {
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
                let in_line = ahead < st.waiting.len();
                if st.free.len() <= ahead {
                    if st.set_aside.len() == shared.mr.chunks() {
                        // Every chunk refused, none out to come back and
                        // offer them again: the next take tries them anew.
                        st.offer_set_aside();
                        st.leave(self.id);
                        drop(st);
                        shared.freed.notify_waiters();
                        return Err(Blocked::NotLent);
                    }
                    if queue && !in_line {
                        st.waiting.push_back(self.id);
                        st.waits += 1;
                    }
                    st.empties += 1;
                    return Err(Blocked::Empty);
                }
                let idx = st.free.pop().expect("more free chunks than leases ahead");
                if !in_line {
                    // Nobody counts this lease ahead of them: the chunk is
                    // its own now.
                    if let Some(entry) = st.leases.get_mut(&self.id) {
                        entry.held += 1;
                    }
                }
                (idx, in_line, st.empties)
            };
            let Some(guard) = shared.mr.lock_chunk(idx) else {
                let mut st = shared.lock();
                st.refused_lends += 1;
                st.set_aside.push(idx);
                if !in_line {
                    if let Some(entry) = st.leases.get_mut(&self.id) {
                        entry.held = entry.held.saturating_sub(1);
                    }
                }
                // One stuck chunk is offered again on every return: say so
                // at the 1st, 2nd, 4th, 8th... refusal, not each time.
                if st.refused_lends.is_power_of_two() {
                    tracing::warn!(
                        chunk = idx,
                        refused = st.refused_lends,
                        "the provider would not lend a free send buffer; set aside"
                    );
                }
                continue;
            };
            if in_line {
                let mut st = shared.lock();
                st.leave(self.id);
                if let Some(entry) = st.leases.get_mut(&self.id) {
                    entry.held += 1;
                }
                // A take that found no chunk meanwhile counted this lease
                // ahead of it while its chunk was off the free list.
                let misled = st.empties != empties;
                drop(st);
                if misled {
                    shared.freed.notify_waiters();
                }
            }
            return Ok(self.chunk(idx, guard));
        }
    }

    fn chunk(&self, idx: usize, guard: <D::Mr as MemoryRegion>::Guard) -> PoolChunk<D> {
        PoolChunk {
            shared: self.pool.shared.clone(),
            lease: self.id,
            idx,
            unsignaled: false,
            guard: Some(guard),
        }
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
            !st.free.contains(&self.idx) && !st.set_aside.contains(&self.idx),
            "chunk {} returned twice",
            self.idx
        );
        st.free.push(self.idx);
        st.offer_set_aside();
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
                leases: 1,
                set_aside: 0,
                refused_lends: 0,
            }
        );
        drop(lease);
        assert_eq!(pool.stats().leases, 0);
    }

    /// Bit `i` set: the soft MR will not lend chunk `i`, as libibverbs
    /// lends none a posted WR names.
    fn refuse(pool: &SendPool<SoftDevice>, chunks: u64) {
        let hook = &pool.mr().mem.not_lent;
        hook.store(chunks, std::sync::atomic::Ordering::Relaxed);
    }

    /// In use, free, set aside, refusals so far.
    fn counts(pool: &SendPool<SoftDevice>) -> (usize, usize, usize, u64) {
        let stats = pool.stats();
        (
            stats.in_use,
            stats.free,
            stats.set_aside,
            stats.refused_lends,
        )
    }

    #[test]
    fn a_chunk_the_provider_will_not_lend_is_set_aside_until_another_comes_back() {
        let (_net, _dev, pool) = make(4, false);
        let lease = pool.lease(4);
        refuse(&pool, 1 << 0);
        let first = lease.try_take().expect("the next free chunk");
        assert_eq!(first.offset(), 64, "chunk 0 refused, chunk 1 lent");
        let second = lease.try_take().expect("free");
        assert_eq!(second.offset(), 128);
        assert_eq!(
            counts(&pool),
            (2, 1, 1, 1),
            "chunk 0 is not tried again meanwhile"
        );
        refuse(&pool, 0);
        drop(second);
        let stats = pool.stats();
        assert_eq!((stats.free, stats.set_aside), (3, 0), "offered again");
        let mut held = vec![first];
        held.extend((0..3).map(|_| lease.try_take().expect("free")));
        let offsets: Vec<_> = held.iter().map(PoolChunk::offset).collect();
        assert_eq!(offsets, [64, 128, 192, 0], "the refused chunk goes last");
    }

    #[test]
    fn a_refused_chunk_keeps_the_lease_its_place_in_line() {
        let (_net, _dev, pool) = make(3, false);
        let (a, b, c) = (pool.lease(3), pool.lease(3), pool.lease(3));
        let mut held: Vec<_> = (0..3).map(|_| a.try_take().expect("free")).collect();
        assert_eq!(b.try_take().err(), Some(Blocked::Empty), "b first in line");
        assert_eq!(c.try_take().err(), Some(Blocked::Empty), "c behind b");
        let stuck = held.pop().expect("held");
        refuse(&pool, 1 << (stuck.offset() / 64));
        drop(stuck);
        assert_eq!(
            b.try_take().err(),
            Some(Blocked::Empty),
            "refused, set aside"
        );
        assert_eq!(c.try_take().err(), Some(Blocked::Empty), "b is still first");
        drop(held.pop());
        let _b1 = b.try_take().expect("b's turn");
        assert_eq!(
            c.try_take().err(),
            Some(Blocked::Empty),
            "the stuck one again"
        );
        assert_eq!(pool.stats().refused_lends, 2);
    }

    /// A lease in line whose chunk is still being lent is counted ahead by
    /// a take that comes meanwhile and finds no chunk: once lent, it wakes
    /// the line, or the other would sleep beside a free chunk.
    #[test]
    fn a_take_misled_while_a_chunk_was_being_lent_is_woken() {
        let (_net, _dev, pool) = make(2, false);
        let (a, b, c) = (pool.lease(2), pool.lease(2), pool.lease(2));
        let (a0, a1) = (a.try_take().expect("0"), a.try_take().expect("1"));
        assert_eq!(b.try_take().err(), Some(Blocked::Empty), "b first in line");
        assert_eq!(c.try_take().err(), Some(Blocked::Empty), "c behind b");
        drop(a1);
        drop(a0);
        // b takes chunk 0 next; the soft MR makes its lend wait for this.
        let gather = pool.mr().lock_chunk(0).expect("chunk 0");
        std::thread::scope(|scope| {
            let taken = scope.spawn(|| b.try_take());
            while pool.stats().free != 1 {
                std::thread::yield_now();
            }
            let woken = c.notified();
            let mut woken = std::pin::pin!(woken);
            woken.as_mut().enable();
            assert_eq!(c.try_take().err(), Some(Blocked::Empty), "b counted ahead");
            drop(gather);
            let lent = taken.join().expect("b").expect("lent");
            assert_eq!(lent.offset(), 0);
            // Not by a return: b holds its chunk.
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(woken.as_mut().poll(&mut cx).is_ready(), "c was woken");
        });
        assert!(c.try_take().is_ok(), "chunk 1 is c's");
    }

    #[test]
    fn every_chunk_refused_and_none_out_is_not_lent_and_tried_anew() {
        let (_net, _dev, pool) = make(2, false);
        let (a, b) = (pool.lease(2), pool.lease(2));
        refuse(&pool, 1 << 1);
        let held = a.try_take().expect("chunk 0 lent");
        // One chunk is out: it comes back and offers the stuck one again.
        assert_eq!(b.try_take().err(), Some(Blocked::Empty));
        refuse(&pool, 0b11);
        drop(held);
        assert_eq!(b.try_take().err(), Some(Blocked::NotLent));
        assert_eq!(
            counts(&pool),
            (0, 2, 0, 3),
            "back on the free list for the next take"
        );
        assert_eq!(
            a.try_take_unqueued().map(|c| c.offset()),
            None,
            "a look too"
        );
        refuse(&pool, 0);
        // b left the line with its `NotLent`: else a, not in it, would get
        // one chunk only.
        let lent: Vec<_> = (0..2).map(|_| a.try_take().expect("lent")).collect();
        assert_eq!(lent.len(), 2, "both, once the provider lets go");
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
