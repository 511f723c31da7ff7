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

use std::sync::{Arc, Mutex, MutexGuard};

use crate::verbs::{AccessFlags, Lkey, MemoryRegion, VerbsError};

/// The bytes of one region.
#[derive(Debug)]
pub(crate) struct MrMem {
    bytes: Mutex<Box<[u8]>>,
}

impl MrMem {
    pub fn new(len: usize) -> MrMem {
        MrMem {
            bytes: Mutex::new(vec![0u8; len].into_boxed_slice()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Box<[u8]>> {
        // A panic while holding the lock leaves plain bytes behind; keep going.
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
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

impl MemoryRegion for SoftMr {
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
