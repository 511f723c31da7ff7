//! Soft memory regions: the provider owns the bytes, a row of chunks each
//! behind its own lock; callers reach them by (offset, len) or hold a chunk.
//!
//! ```text
//!  caller ─ with_mut(off, len, |buf| encode) ─► MrMem [chunk 0 | chunk 1 | ...] ◄─ gather (SEND)
//!  caller ◄ with(off, len, |buf| decode) ─────  each chunk: Arc<Mutex<bytes>>   ─► scatter (RECV)
//!  caller ─ lock_chunk(i) ─► SoftMrGuard (owned lock of chunk i, held across awaits)
//! ```
//!
//! Owner: shared by the `SoftMr` handle and every WR that names it (an `Arc`),
//! so a region outlives the WRs posted from it, as `ibv_dereg_mr` requires.
//! Chunks are separate allocations, so exclusivity needs no unsafe code; an
//! access spanning chunks locks them in ascending order.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{ArcMutexGuard, Mutex, MutexGuard, RawMutex};

use crate::verbs::{AccessFlags, Lkey, MemoryRegion, VerbsError};

/// Regions and bytes registered on one device and not yet released.
#[derive(Debug, Default)]
pub(crate) struct MrTally {
    pub regions: AtomicUsize,
    pub bytes: AtomicUsize,
}

type Chunk = Arc<Mutex<Box<[u8]>>>;

/// The bytes of one region.
#[derive(Debug)]
pub(crate) struct MrMem {
    // parking_lot for its owned guard (`SoftMrGuard`); it does not poison.
    chunks: Box<[Chunk]>,
    chunk_len: usize,
    len: usize,
    /// The device's tally, released when the last WR or handle lets go.
    tally: Option<Arc<MrTally>>,
    /// Test hook: bit `i` set, `lock_chunk` will not lend chunk `i`, as
    /// libibverbs lends none a posted WR names.
    #[cfg(test)]
    pub(crate) not_lent: std::sync::atomic::AtomicU64,
}

impl Drop for MrMem {
    fn drop(&mut self) {
        if let Some(tally) = &self.tally {
            tally.regions.fetch_sub(1, Ordering::Relaxed);
            tally.bytes.fetch_sub(self.len, Ordering::Relaxed);
        }
    }
}

impl MrMem {
    fn zeroed(chunk_len: usize, chunks: usize, tally: Option<Arc<MrTally>>) -> MrMem {
        let len = chunk_len * chunks;
        if let Some(tally) = &tally {
            tally.regions.fetch_add(1, Ordering::Relaxed);
            tally.bytes.fetch_add(len, Ordering::Relaxed);
        }
        MrMem {
            chunks: (0..chunks)
                .map(|_| Arc::new(Mutex::new(vec![0u8; chunk_len].into_boxed_slice())))
                .collect(),
            chunk_len,
            len,
            tally,
            #[cfg(test)]
            not_lent: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// An uncounted one-chunk region (engine unit tests, which have no device).
    #[cfg(test)]
    pub fn new(len: usize) -> MrMem {
        MrMem::zeroed(len, 1, None)
    }

    /// A region of `chunks` chunks counted in `tally` until it is released.
    pub fn counted(chunk_len: usize, chunks: usize, tally: Arc<MrTally>) -> MrMem {
        MrMem::zeroed(chunk_len, chunks, Some(tally))
    }

    /// The pieces of `len` bytes at `offset`: (chunk, offset in it, length).
    /// The caller checked bounds, so `chunk_len` is nonzero when `len` is.
    fn pieces(&self, offset: usize, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let chunk_len = self.chunk_len;
        let mut done = 0;
        std::iter::from_fn(move || {
            if done >= len {
                return None;
            }
            let pos = offset + done;
            let (idx, at) = (pos / chunk_len, pos % chunk_len);
            let n = (chunk_len - at).min(len - done);
            done += n;
            Some((idx, at, n))
        })
    }

    /// Copy out; the caller checked bounds at post time.
    pub fn read_into(&self, offset: usize, out: &mut [u8]) {
        let mut done = 0;
        for (idx, at, n) in self.pieces(offset, out.len()) {
            out[done..done + n].copy_from_slice(&self.chunks[idx].lock()[at..at + n]);
            done += n;
        }
    }

    /// Copy in; the caller checked bounds at post time.
    pub fn write_from(&self, offset: usize, data: &[u8]) {
        let mut done = 0;
        for (idx, at, n) in self.pieces(offset, data.len()) {
            self.chunks[idx].lock()[at..at + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
    }

    /// Reads the first lines of `len` bytes at `offset` (and their chunk's
    /// lock), so a write that lands there soon finds them cached.
    pub fn warm(&self, offset: usize, len: usize) {
        if let Some((idx, at, n)) = self.pieces(offset, len).next() {
            let chunk = self.chunks[idx].lock();
            let sum = chunk[at..at + n]
                .iter()
                .step_by(64)
                .fold(0u8, |acc, &b| acc ^ b);
            std::hint::black_box(sum);
        }
    }

    /// Runs `f` over `len` bytes at `offset` with every chunk they touch
    /// locked (in ascending order); bytes spanning chunks go through a copy.
    fn with_locked<R>(
        &self,
        offset: usize,
        len: usize,
        write: bool,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> R {
        let pieces: Vec<_> = self.pieces(offset, len).collect();
        let mut guards: Vec<MutexGuard<'_, Box<[u8]>>> = pieces
            .iter()
            .map(|&(idx, _, _)| self.chunks[idx].lock())
            .collect();
        match (pieces.as_slice(), guards.as_mut_slice()) {
            ([], _) => f(&mut []),
            ([(_, at, n)], [guard]) => f(&mut guard[*at..*at + *n]),
            _ => {
                let mut copy = Vec::with_capacity(len);
                for (&(_, at, n), guard) in pieces.iter().zip(&guards) {
                    copy.extend_from_slice(&guard[at..at + n]);
                }
                let r = f(&mut copy);
                if write {
                    let mut done = 0;
                    for (&(_, at, n), guard) in pieces.iter().zip(&mut guards) {
                        guard[at..at + n].copy_from_slice(&copy[done..done + n]);
                        done += n;
                    }
                }
                r
            }
        }
    }
}

/// A registered region of the soft provider.
#[derive(Debug, Clone)]
pub struct SoftMr {
    pub(crate) mem: Arc<MrMem>,
    pub(crate) lkey: Lkey,
    pub(crate) len: usize,
    pub(crate) access: AccessFlags,
    pub(crate) pd_id: u64,
}

impl SoftMr {
    pub(crate) fn check(&self, offset: usize, len: usize) -> Result<(), VerbsError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            Some(_) | None => Err(VerbsError::SgeOutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

/// Exclusive access to one chunk of a soft region without a closure; see
/// [`MemoryRegion::lock_chunk`].
pub struct SoftMrGuard(ArcMutexGuard<RawMutex, Box<[u8]>>);

impl std::fmt::Debug for SoftMrGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftMrGuard")
            .field("len", &self.0.len())
            .finish()
    }
}

impl Deref for SoftMrGuard {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl DerefMut for SoftMrGuard {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl MemoryRegion for SoftMr {
    type Guard = SoftMrGuard;

    fn lock_chunk(&self, index: usize) -> Option<SoftMrGuard> {
        #[cfg(test)]
        if index < 64 && self.mem.not_lent.load(Ordering::Relaxed) & (1 << index) != 0 {
            return None;
        }
        self.mem
            .chunks
            .get(index)
            .map(|chunk| SoftMrGuard(Mutex::lock_arc(chunk)))
    }

    fn try_lock_chunk(&self, index: usize) -> Option<SoftMrGuard> {
        Mutex::try_lock_arc(self.mem.chunks.get(index)?).map(SoftMrGuard)
    }

    fn chunk_len(&self) -> usize {
        self.mem.chunk_len
    }

    fn chunks(&self) -> usize {
        self.mem.chunks.len()
    }

    fn lkey(&self) -> Lkey {
        self.lkey
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
        Ok(self.mem.with_locked(offset, len, true, f))
    }

    fn with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, VerbsError> {
        self.check(offset, len)?;
        Ok(self.mem.with_locked(offset, len, false, |b| f(b)))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn region(chunk_len: usize, chunks: usize) -> SoftMr {
        SoftMr {
            mem: Arc::new(MrMem::zeroed(chunk_len, chunks, None)),
            lkey: Lkey(1),
            len: chunk_len * chunks,
            access: AccessFlags::LOCAL_READ,
            pd_id: 1,
        }
    }

    #[test]
    fn a_plain_region_is_one_chunk() {
        let mr = region(100, 1);
        assert_eq!((mr.chunk_len(), mr.chunks()), (100, 1));
        let guard = mr.lock_chunk(0).expect("chunk 0");
        assert_eq!(guard.len(), 100);
        assert!(mr.try_lock_chunk(0).is_none(), "held");
        assert!(mr.lock_chunk(1).is_none(), "past the end");
        drop(guard);
        let empty = region(0, 1);
        assert_eq!(empty.lock_chunk(0).map(|g| g.len()), Some(0));
        assert_eq!(empty.with(0, 0, <[u8]>::len), Ok(0));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Lock(usize),
        Unlock(usize),
        WriteGuard(usize, u8),
        Write { offset: usize, len: usize, byte: u8 },
        Gather { offset: usize, len: usize },
    }

    fn op(chunks: usize, len: usize) -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..chunks + 1).prop_map(Op::Lock),
            (0..chunks).prop_map(Op::Unlock),
            (0..chunks, any::<u8>()).prop_map(|(i, b)| Op::WriteGuard(i, b)),
            (0..len, 0..len, any::<u8>()).prop_map(move |(o, l, byte)| Op::Write {
                offset: o,
                len: l.min(len - o),
                byte
            }),
            (0..len, 0..len).prop_map(move |(o, l)| Op::Gather {
                offset: o,
                len: l.min(len - o)
            }),
        ]
    }

    fn case() -> impl Strategy<Value = (usize, usize, Vec<Op>)> {
        (1usize..40, 1usize..6).prop_flat_map(|(chunk_len, chunks)| {
            let ops = proptest::collection::vec(op(chunks, chunk_len * chunks), 0..120);
            (Just(chunk_len), Just(chunks), ops)
        })
    }

    proptest! {
        /// Against a model (a flat byte array and the set of held chunks):
        /// a chunk guard is granted iff the chunk is not held, covers
        /// exactly its chunk, and writes through any path land only where
        /// they were aimed.
        #[test]
        fn chunk_guards_are_disjoint_and_exclusive((chunk_len, chunks, ops) in case()) {
            let len = chunk_len * chunks;
            let mr = region(chunk_len, chunks);
            let mut model = vec![0u8; len];
            let mut guards: Vec<Option<SoftMrGuard>> = (0..chunks).map(|_| None).collect();
            for step in ops {
                let busy = |guards: &[Option<SoftMrGuard>], o: usize, l: usize| {
                    l > 0 && (o / chunk_len..=(o + l - 1) / chunk_len).any(|i| guards[i].is_some())
                };
                match step {
                    Op::Lock(i) => {
                        let got = mr.try_lock_chunk(i);
                        let free = i < chunks && guards[i].is_none();
                        prop_assert_eq!(got.is_some(), free, "chunk {} held: {}", i, !free);
                        if let Some(g) = got {
                            prop_assert_eq!(&g[..], &model[i * chunk_len..(i + 1) * chunk_len]);
                            guards[i] = Some(g);
                        }
                    }
                    Op::Unlock(i) => guards[i] = None,
                    Op::WriteGuard(i, b) => {
                        if let Some(g) = guards[i].as_mut() {
                            g.fill(b);
                            model[i * chunk_len..(i + 1) * chunk_len].fill(b);
                        }
                    }
                    // A closure would wait for a held chunk; the model only
                    // runs it where nothing it touches is held.
                    Op::Write { offset, len: l, byte } if !busy(&guards, offset, l) => {
                        mr.with_mut(offset, l, |b| b.fill(byte)).expect("in bounds");
                        model[offset..offset + l].fill(byte);
                    }
                    Op::Gather { offset, len: l } if !busy(&guards, offset, l) => {
                        let mut out = vec![0u8; l];
                        mr.mem.read_into(offset, &mut out);
                        prop_assert_eq!(&out[..], &model[offset..offset + l]);
                        prop_assert_eq!(mr.read(offset, l).expect("in bounds"), out);
                    }
                    Op::Write { .. } | Op::Gather { .. } => {}
                }
            }
            drop(guards);
            prop_assert_eq!(mr.read(0, len).expect("whole"), model);
        }
    }
}
