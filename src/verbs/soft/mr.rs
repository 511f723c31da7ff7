//! Soft memory regions: the provider owns the bytes, callers reach them by
//! (offset, len) under a lock.
//!
//! ```text
//!  caller ─ with_mut(off, len, |buf| encode) ─► MrMem ◄─ gather (SEND packets)
//!  caller ◄ with(off, len, |buf| decode) ─────  MrMem ◄─ scatter (received packets)
//! ```
//!
//! Owner: shared by the `SoftMr` handle and every WR that names it (an `Arc`),
//! so a region outlives the WRs posted from it, as `ibv_dereg_mr` requires.

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

/// The bytes of one region.
#[derive(Debug)]
pub(crate) struct MrMem {
    // parking_lot for its owned guard (`SoftMrGuard`); it does not poison.
    bytes: Arc<Mutex<Box<[u8]>>>,
    len: usize,
    /// The device's tally, released when the last WR or handle lets go.
    tally: Option<Arc<MrTally>>,
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
    /// An uncounted region (engine unit tests, which have no device).
    #[cfg(test)]
    pub fn new(len: usize) -> MrMem {
        MrMem {
            bytes: Arc::new(Mutex::new(vec![0u8; len].into_boxed_slice())),
            len,
            tally: None,
        }
    }

    /// A region counted in `tally` until it is released.
    pub fn counted(len: usize, tally: Arc<MrTally>) -> MrMem {
        tally.regions.fetch_add(1, Ordering::Relaxed);
        tally.bytes.fetch_add(len, Ordering::Relaxed);
        MrMem {
            bytes: Arc::new(Mutex::new(vec![0u8; len].into_boxed_slice())),
            len,
            tally: Some(tally),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Box<[u8]>> {
        self.bytes.lock()
    }

    /// Copy out; the caller checked bounds at post time.
    pub fn read_into(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self.lock()[offset..offset + out.len()]);
    }

    /// Copy in; the caller checked bounds at post time.
    pub fn write_from(&self, offset: usize, data: &[u8]) {
        self.lock()[offset..offset + data.len()].copy_from_slice(data);
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

/// Exclusive access to a whole soft region without a closure; see
/// [`MemoryRegion::lock_owned`].
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

    fn lock_owned(&self) -> SoftMrGuard {
        SoftMrGuard(Mutex::lock_arc(&self.mem.bytes))
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
        Ok(f(&mut self.mem.lock()[offset..offset + len]))
    }

    fn with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, VerbsError> {
        self.check(offset, len)?;
        Ok(f(&self.mem.lock()[offset..offset + len]))
    }
}
