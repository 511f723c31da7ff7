//! Soft completion queues with one-shot, edge-triggered notification.
//!
//! ```text
//!  device core ─ push(wc) ─► entries ─► poll(&mut [wc])   (caller)
//!                  └─ armed? ─► disarm, Notify::notify_one ─► notified().await
//! ```
//!
//! Owner: the device core pushes (under its lock), the caller polls. A
//! notification fires only for a completion pushed after `req_notify`, and at
//! most once per arm, like `ibv_req_notify_cq`. An un-awaited notification
//! stays pending (as an unread event in a completion channel would).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::verbs::{CompletionQueue, VerbsError, WorkCompletion};

#[derive(Debug)]
struct CqInner {
    entries: VecDeque<WorkCompletion>,
    depth: usize,
    armed: bool,
    overrun: bool,
}

#[derive(Debug)]
pub(crate) struct CqShared {
    inner: Mutex<CqInner>,
    notify: Notify,
}

impl CqShared {
    fn lock(&self) -> MutexGuard<'_, CqInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Add a completion; an overflowing CQ is marked overrun and unusable.
    pub fn push(&self, wc: WorkCompletion) {
        let mut inner = self.lock();
        if inner.entries.len() >= inner.depth {
            inner.overrun = true;
        } else {
            inner.entries.push_back(wc);
        }
        if inner.armed {
            inner.armed = false;
            self.notify.notify_one();
        }
    }
}

/// A completion queue of the soft provider.
#[derive(Debug, Clone)]
pub struct SoftCq {
    pub(crate) shared: Arc<CqShared>,
}

impl SoftCq {
    pub(crate) fn new(depth: usize) -> SoftCq {
        SoftCq {
            shared: Arc::new(CqShared {
                inner: Mutex::new(CqInner {
                    entries: VecDeque::new(),
                    depth,
                    armed: false,
                    overrun: false,
                }),
                notify: Notify::new(),
            }),
        }
    }

    /// Completions waiting to be polled.
    pub fn len(&self) -> usize {
        self.shared.lock().entries.len()
    }

    /// True when nothing waits to be polled.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        let mut inner = self.shared.lock();
        if inner.overrun {
            return Err(VerbsError::CqOverrun);
        }
        let n = out.len().min(inner.entries.len());
        for (slot, wc) in out.iter_mut().zip(inner.entries.drain(..n)) {
            *slot = wc;
        }
        Ok(n)
    }

    fn req_notify(&self) -> Result<(), VerbsError> {
        let mut inner = self.shared.lock();
        if inner.overrun {
            return Err(VerbsError::CqOverrun);
        }
        inner.armed = true;
        Ok(())
    }

    fn notified(&self) -> impl Future<Output = ()> + Send {
        let shared = self.shared.clone();
        async move { shared.notify.notified().await }
    }
}
