//! Soft completion queues with one-shot, edge-triggered notification, or a
//! handler that the driver runs after its turn.
//!
//! ```text
//!  device core ─ push(wc) ─► entries ─► poll(&mut [wc])   (caller)
//!                  ├─ armed? ─► disarm, Notify::notify_one ─► notified().await
//!                  └─ in the driver's turn, handler set ─► due ─► driver, unlocked:
//!                        dispatch ─► handler polls │ declined ─► armed? ─► notify
//! ```
//!
//! Owner: the device core pushes (under its lock), the caller polls. A
//! notification fires only for a completion pushed after `req_notify`, and at
//! most once per arm, like `ibv_req_notify_cq`. An un-awaited notification
//! stays pending (as an unread event in a completion channel would). Only
//! the driver dispatches a handler, holding no lock of its own or a link's:
//! a verbs call dispatching one could meet a second link's verbs call doing
//! the same, each holding the state lock the other's handler needs.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use tokio::sync::Notify;

use crate::verbs::{CompletionHandler, CompletionQueue, VerbsError, WorkCompletion};

#[derive(Debug)]
struct CqInner {
    entries: VecDeque<WorkCompletion>,
    depth: usize,
    armed: bool,
    overrun: bool,
    /// On the driver's list of CQs whose handler is owed a call.
    due: bool,
}

#[derive(Debug)]
pub(crate) struct CqShared {
    inner: Mutex<CqInner>,
    notify: Notify,
    handler: OnceLock<Weak<dyn CompletionHandler>>,
    /// The handler panicked once: it is not called again, and the CQ
    /// notifies as if it had none.
    handler_failed: AtomicBool,
}

impl CqShared {
    fn lock(&self) -> MutexGuard<'_, CqInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Add a completion; an overflowing CQ is marked overrun and the entry
    /// lost. What it holds stays pollable; then it reports the overrun.
    /// With `defer` (the driver's turn) and a handler installed, the handler
    /// is owed a call instead of the notification firing: returns true when
    /// this CQ just became due, and the caller must [`dispatch`] it once the
    /// device lock is released.
    ///
    /// [`dispatch`]: CqShared::dispatch
    pub fn push(&self, wc: WorkCompletion, defer: bool) -> bool {
        let mut inner = self.lock();
        if inner.entries.len() >= inner.depth {
            inner.overrun = true;
        } else {
            inner.entries.push_back(wc);
        }
        if defer && self.handler.get().is_some() && !self.handler_failed.load(Ordering::Acquire) {
            return !std::mem::replace(&mut inner.due, true);
        }
        Self::fire_if_armed(&mut inner, &self.notify);
        false
    }

    /// No room for another completion (or already overrun).
    pub fn is_full(&self) -> bool {
        let inner = self.lock();
        inner.overrun || inner.entries.len() >= inner.depth
    }

    /// As after a handler's panic: the CQ notifies from now on (tests).
    #[cfg(test)]
    pub fn disable_handler(&self) {
        self.handler_failed.store(true, Ordering::Release);
    }

    /// Runs the handler for what the driver's turn added; if it declines,
    /// or is gone with its link, the armed notification fires instead.
    ///
    /// A handler is its user's code running on the driver, which serves
    /// every QP of the device: its panic is caught here, the handler is
    /// never called again, and the CQ notifies from then on. Returns false
    /// when the handler panicked.
    pub fn dispatch(&self) -> bool {
        // Cleared first: a completion pushed while the handler runs makes
        // the CQ due again rather than being missed.
        self.lock().due = false;
        let handler = self
            .handler
            .get()
            .filter(|_| !self.handler_failed.load(Ordering::Acquire))
            .and_then(Weak::upgrade);
        let (taken, sound) = match handler {
            None => (false, true),
            Some(handler) => match catch_unwind(AssertUnwindSafe(|| handler.completions_ready())) {
                Ok(taken) => (taken, true),
                Err(_) => {
                    self.handler_failed.store(true, Ordering::Release);
                    tracing::error!("a completion handler panicked; its CQ notifies from now on");
                    (false, false)
                }
            },
        };
        if !taken {
            Self::fire_if_armed(&mut self.lock(), &self.notify);
        }
        sound
    }

    fn fire_if_armed(inner: &mut CqInner, notify: &Notify) {
        if inner.armed {
            inner.armed = false;
            notify.notify_one();
        }
    }
}

/// A completion queue of the soft provider.
#[derive(Debug, Clone)]
pub struct SoftCq {
    pub(crate) shared: Arc<CqShared>,
}

impl SoftCq {
    /// Armed: a waiter will hear the next completion (tests).
    #[cfg(test)]
    pub(crate) fn is_armed(&self) -> bool {
        self.shared.lock().armed
    }

    pub(crate) fn new(depth: usize) -> SoftCq {
        SoftCq {
            shared: Arc::new(CqShared {
                inner: Mutex::new(CqInner {
                    entries: VecDeque::new(),
                    depth,
                    armed: false,
                    overrun: false,
                    due: false,
                }),
                notify: Notify::new(),
                handler: OnceLock::new(),
                handler_failed: AtomicBool::new(false),
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
        // What was stored before the overrun is delivered first (as rxe
        // keeps it pollable): a completion the peer saw ACKed is not lost.
        if inner.overrun && inner.entries.is_empty() {
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
        if inner.overrun && inner.entries.is_empty() {
            return Err(VerbsError::CqOverrun);
        }
        inner.armed = true;
        Ok(())
    }

    fn notified(&self) -> impl Future<Output = ()> + Send {
        let shared = self.shared.clone();
        async move { shared.notify.notified().await }
    }

    /// Kept for the CQ's life; a second handler is refused (false).
    fn set_handler(&self, handler: Weak<dyn CompletionHandler>) -> bool {
        self.shared.handler.set(handler).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::verbs::{Qpn, WcOpcode, WcStatus};

    fn wc(wr_id: u64) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm: None,
            qp_num: Qpn::new(1),
        }
    }

    /// Polls the CQ empty when called, unless told to decline.
    struct Drainer {
        cq: SoftCq,
        decline: AtomicBool,
        panic: AtomicBool,
        calls: AtomicUsize,
        taken: AtomicUsize,
    }

    impl CompletionHandler for Drainer {
        fn completions_ready(&self) -> bool {
            self.calls.fetch_add(1, Ordering::Relaxed);
            assert!(!self.panic.load(Ordering::Relaxed), "a bug in the handler");
            if self.decline.load(Ordering::Relaxed) {
                return false;
            }
            let mut out = [wc(0); 4];
            while let Ok(n @ 1..) = self.cq.poll(&mut out) {
                self.taken.fetch_add(n, Ordering::Relaxed);
            }
            true
        }
    }

    fn with_handler() -> (SoftCq, Arc<Drainer>) {
        let cq = SoftCq::new(16);
        let drainer = Arc::new(Drainer {
            cq: cq.clone(),
            decline: AtomicBool::new(false),
            panic: AtomicBool::new(false),
            calls: AtomicUsize::new(0),
            taken: AtomicUsize::new(0),
        });
        let handler: Weak<dyn CompletionHandler> = Arc::downgrade(&drainer) as _;
        assert!(cq.set_handler(handler.clone()));
        assert!(!cq.set_handler(handler), "a second handler is refused");
        (cq, drainer)
    }

    async fn fired(cq: &SoftCq) -> bool {
        tokio::time::timeout(Duration::from_millis(20), cq.notified())
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_deferred_completion_goes_to_the_handler_and_fires_nothing() {
        let (cq, drainer) = with_handler();
        cq.req_notify().unwrap();
        assert!(cq.shared.push(wc(1), true), "the first makes the CQ due");
        assert!(!cq.shared.push(wc(2), true), "already due");
        cq.shared.dispatch();
        assert_eq!(drainer.calls.load(Ordering::Relaxed), 1);
        assert_eq!(drainer.taken.load(Ordering::Relaxed), 2);
        assert!(!fired(&cq).await);
        // Still armed: a completion from a verbs call (not deferred) fires.
        assert!(!cq.shared.push(wc(3), false));
        assert!(fired(&cq).await);
        assert_eq!(cq.len(), 1);
    }

    #[tokio::test]
    async fn a_declined_or_orphaned_dispatch_fires_the_armed_notification() {
        let (cq, drainer) = with_handler();
        drainer.decline.store(true, Ordering::Relaxed);
        cq.req_notify().unwrap();
        assert!(cq.shared.push(wc(1), true));
        cq.shared.dispatch();
        assert!(fired(&cq).await, "declined: the waiter is told");
        assert_eq!(cq.len(), 1, "nothing was taken");

        // The due flag was cleared: the next turn owes a call again.
        cq.req_notify().unwrap();
        assert!(cq.shared.push(wc(2), true));
        drop(drainer);
        cq.shared.dispatch();
        assert!(fired(&cq).await, "no handler left: the waiter is told");
        assert_eq!(cq.len(), 2);
    }

    #[tokio::test]
    async fn a_panicking_handler_is_caught_and_its_cq_notifies_from_then_on() {
        let (cq, drainer) = with_handler();
        drainer.panic.store(true, Ordering::Relaxed);
        cq.req_notify().unwrap();
        assert!(cq.shared.push(wc(1), true));
        assert!(!cq.shared.dispatch(), "the panic is reported, not raised");
        assert!(fired(&cq).await, "the waiter is told");

        drainer.panic.store(false, Ordering::Relaxed);
        cq.req_notify().unwrap();
        assert!(
            !cq.shared.push(wc(2), true),
            "nothing is owed to a handler that panicked"
        );
        assert!(fired(&cq).await);
        assert!(cq.shared.dispatch(), "a stray dispatch calls nobody");
        assert_eq!(drainer.calls.load(Ordering::Relaxed), 1);
        assert_eq!(cq.len(), 2, "the completions stay for a poller");
    }

    #[tokio::test]
    async fn without_a_handler_a_deferred_push_notifies_as_before() {
        let cq = SoftCq::new(16);
        cq.req_notify().unwrap();
        assert!(
            !cq.shared.push(wc(1), true),
            "nothing is owed without a handler"
        );
        assert!(fired(&cq).await);
    }
}
