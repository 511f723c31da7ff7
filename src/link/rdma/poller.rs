//! The completion poller: the task that owns a link end's CQ, and the
//! handler a provider may run in its place.
//!
//! ```text
//!  loop { poll ─► on_completions ; empty? spin a few yields ;
//!         req_notify ─► poll once more (arm before the final drain) ─► notified().await }
//!  exits when the epoch has ended and every posted receive has completed,
//!  or when every user handle is gone
//!  soft driver, after its receive turn ─► completions_ready ─► poll ─► on_completions
//! ```
//!
//! Owner: whoever holds `Shared::polling` (this task, or the provider's
//! handler; both only try the lock) polls, so completions are handled in
//! CQ order; only this task arms and waits. Link state changes only under
//! `Shared::state`. Why the handler: docs/soft-provider.md § "Completions
//! handled in the driver's turn".

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use super::{RECV_TAG, Shared, State, fault_of, ibv_status};
use crate::link::{EpochEnd, LinkFault};
use crate::mux::engine::ProtocolError;
use crate::verbs::{
    CompletionHandler, CompletionQueue, Device, QpState, Qpn, QueuePair, WcOpcode, WcStatus,
    WorkCompletion,
};

/// Completions taken per `poll`.
const POLL_BATCH: usize = 32;
/// Empty polls (each after a `yield_now`) before arming the notification.
const BUSY_POLLS: usize = 4;

const EMPTY_WC: WorkCompletion = WorkCompletion {
    wr_id: 0,
    status: WcStatus::Success,
    opcode: WcOpcode::Send,
    byte_len: 0,
    imm: None,
    qp_num: Qpn::new(0),
};

/// The buffer completions are polled into; holding its lock is the right
/// to poll.
pub(super) struct PollBuf([WorkCompletion; POLL_BATCH]);

impl PollBuf {
    pub(super) fn new() -> Mutex<PollBuf> {
        Mutex::new(PollBuf([EMPTY_WC; POLL_BATCH]))
    }
}

enum Polled {
    Some,
    Empty,
    Failed,
}

impl<D: Device + 'static> Shared<D> {
    /// Done once the epoch has ended, its teardown has run, and every
    /// posted receive has completed (receives always complete, so their
    /// flush is the last thing `recv` waits for). Sends need no wait: an
    /// unsignaled send that succeeded never completes, and after the end its
    /// buffer is never reused. Not before the teardown: during a graceful
    /// close the peer may use up every receive while our last SENDs still
    /// wait for their completions, and the chunks left posted go back only
    /// once the QP is in ERR ([`Shared::release_posted`]). Detached (every
    /// handle dropped), nobody waits on `recv`, but a graceful close still
    /// waits on its SENDs' completions, which only the poller sees where the
    /// provider has no completion handler (libibverbs): done at the teardown.
    fn finished(&self) -> bool {
        let detached = self.detached.load(Ordering::Acquire);
        let st = self.lock();
        st.ended.is_some() && st.torn_down && (detached || st.recv_posted == 0)
    }

    /// [`Shared::poll_once`] under the `polling` lock (the poller's way
    /// in); `Empty` while the handler holds it. The handler polls the CQ
    /// empty and, letting go, wakes a poller that asked meanwhile, so the
    /// poller loses nothing by not waiting, and never blocks a worker
    /// thread on the lock.
    fn poll_locked(&self) -> Polled {
        let mut buf = match self.polling.try_lock() {
            Ok(buf) => buf,
            // A buffer only: a panic while it was held leaves nothing to distrust.
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // Asked, then tried again: either this try finds it free or
                // the holder, letting go, sees the ask (the fences pair
                // with `let_go_of_polling`'s).
                self.poll_wanted.store(true, Ordering::Relaxed);
                fence(Ordering::SeqCst);
                match self.polling.try_lock() {
                    Ok(buf) => buf,
                    Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                    Err(TryLockError::WouldBlock) => return Polled::Empty,
                }
            }
        };
        self.poll_once(&mut buf)
    }

    /// Drops the handler's hold of `polling`, waking the poller if it found
    /// the lock taken meanwhile.
    pub(super) fn let_go_of_polling(&self, buf: MutexGuard<'_, PollBuf>) {
        drop(buf);
        fence(Ordering::SeqCst);
        if self.poll_wanted.swap(false, Ordering::Relaxed) {
            self.wake_poller.notify_one();
        }
    }

    fn poll_once(&self, buf: &mut PollBuf) -> Polled {
        let wcs = &mut buf.0;
        match self.cq.poll(wcs) {
            Ok(0) => Polled::Empty,
            Ok(n) => {
                self.on_completions(&wcs[..n]);
                Polled::Some
            }
            Err(err) => {
                // A CQ that failed stays failed (the ibverbs provider's is
                // sticky), and the stall sweep may look again after the end.
                if self.lock().ended.is_none() {
                    tracing::warn!(%err, "polling the CQ failed; ending the epoch");
                } else {
                    tracing::debug!(%err, "polling the CQ failed after the epoch ended");
                }
                self.end(EpochEnd::Fault(fault_of(&err)));
                Polled::Failed
            }
        }
    }

    pub(super) fn on_completions(&self, wcs: &[WorkCompletion]) {
        let mut st = self.lock();
        #[cfg(test)]
        assert!(
            !self.panic_on_completion.swap(false, Ordering::Relaxed),
            "injected completion panic"
        );
        let mut end = None;
        let mut reposts = Vec::new();
        let mut received = false;
        for wc in wcs {
            let fault = if wc.wr_id & RECV_TAG != 0 {
                // After a peer's violation nothing more from it is delivered.
                let hostile = st.violated;
                self.on_recv_completion(&mut st, wc, hostile, &mut reposts, &mut received)
            } else {
                on_send_completion(&mut st, wc).map(EpochEnd::Fault)
            };
            if let Some(reason) = fault {
                // Asked once a poll: a teardown flushes every receive.
                let reason = if end.is_none() {
                    self.blame_refused_request(reason)
                } else {
                    reason
                };
                // Noted at once: the rest of this batch is not delivered.
                st.violated |= matches!(reason, EpochEnd::Violation(_));
                end.get_or_insert(reason);
            }
        }
        if st.ended.is_none() && end.is_none() {
            for idx in reposts {
                if let Err(reason) = self.repost_locked(&mut st, idx) {
                    end = Some(reason);
                    break;
                }
            }
        }
        if end.is_none() {
            end = self.maybe_credit_only(&mut st).err();
        }
        debug_assert!(st.credit.invariant_holds());
        let ended_now = end.is_some_and(|reason| st.set_end(reason));
        let cut_grace = end.filter(|&reason| !ended_now && st.note_cut(reason));
        // A graceful close waits for this.
        let sends_done = st.ended.is_some() && !st.tearing_down && st.posted.is_empty();
        drop(st);
        if let Some(reason) = cut_grace {
            self.cut_grace(reason);
        }
        if sends_done {
            self.wake_close.notify_one();
        }
        self.wake_send.notify_waiters();
        if received {
            self.batches_arrived();
        }
        if let Some(reason) = end.filter(|_| ended_now) {
            self.after_end(reason);
        }
    }

    /// An error completion after our responder refused a request of the
    /// peer's (a WRITE, say) is only a flush, and the peer's liveness
    /// channel may end first: the provider knows the cause, and it is the
    /// peer's violation, redialled after a backoff.
    pub(super) fn blame_refused_request(&self, reason: EpochEnd) -> EpochEnd {
        match reason {
            EpochEnd::Fault(LinkFault::Completion { .. })
            | EpochEnd::PeerLost
            | EpochEnd::PeerClosed => self.qp.peer_request_error().map_or(reason, |cause| {
                EpochEnd::Violation(ProtocolError::RequestRefused(cause))
            }),
            other => other,
        }
    }

    /// One receive completion; returns how it ends the epoch, if it does.
    fn on_recv_completion(
        &self,
        st: &mut State<D>,
        wc: &WorkCompletion,
        hostile: bool,
        reposts: &mut Vec<usize>,
        received: &mut bool,
    ) -> Option<EpochEnd> {
        let idx = (wc.wr_id & !RECV_TAG) as usize;
        st.recv_posted = st.recv_posted.saturating_sub(1);
        if wc.status == WcStatus::LocLenErr {
            // Every receive buffer is the announced `max_batch` long: the
            // peer sent more than it was told it may.
            return Some(EpochEnd::Violation(ProtocolError::SendTooLarge {
                max: self.config.max_batch,
            }));
        }
        if wc.status != WcStatus::Success {
            return Some(EpochEnd::Fault(LinkFault::Completion {
                status: ibv_status(wc.status),
            }));
        }
        if st.end_reported || st.delivery_cut.is_some() {
            // A credit-only message carries no batch to lose.
            if wc.byte_len > 0 {
                self.count_dropped(st, 1);
            }
            return None;
        }
        if hostile {
            return None;
        }
        let len = wc.byte_len as usize;
        if idx >= self.recv_mrs.len() || len > self.config.max_batch {
            // The provider enforces both; a peer must never get past them.
            return Some(EpochEnd::Fault(LinkFault::Completion {
                status: ibv_status(WcStatus::LocLenErr),
            }));
        }
        let Some(imm) = wc.imm else {
            return Some(EpochEnd::Violation(ProtocolError::SendWithoutImmediate));
        };
        st.credit.on_receive();
        if let Err(over) = st.credit.on_peer_imm(imm) {
            return Some(EpochEnd::Violation(ProtocolError::LinkCreditOverclaim {
                claimed: over.claimed,
                granted: over.granted,
            }));
        }
        if len == 0 {
            st.stats.credit_only_received += 1;
            reposts.push(idx);
        } else {
            st.stats.batches_received += 1;
            st.ready.push_back((idx, len));
            *received = true;
        }
        None
    }
}

/// One send completion: it and every WR before it are done (RC completes in
/// order), so their chunks go back to the pool and their SQ slots come back.
pub(super) fn on_send_completion<D: Device>(
    st: &mut State<D>,
    wc: &WorkCompletion,
) -> Option<LinkFault> {
    if wc.wr_id >= st.next_wr {
        return Some(LinkFault::UnknownCompletion { wr_id: wc.wr_id });
    }
    while st
        .posted
        .front()
        .is_some_and(|&(wr_id, _)| wr_id <= wc.wr_id)
    {
        let chunk = st.posted.pop_front();
        st.sq_free += 1;
        drop(chunk); // back to the pool
    }
    while st
        .signaled
        .front()
        .is_some_and(|&(wr_id, _)| wr_id <= wc.wr_id)
    {
        st.signaled.pop_front();
    }
    match wc.status {
        WcStatus::Success => {
            st.stats.sends_acked += 1;
            None
        }
        status @ (WcStatus::LocLenErr
        | WcStatus::LocQpOpErr
        | WcStatus::LocProtErr
        | WcStatus::WrFlushErr
        | WcStatus::RemAccessErr
        | WcStatus::RemInvReqErr
        | WcStatus::RemOpErr
        | WcStatus::RetryExcErr
        | WcStatus::RnrRetryExcErr) => Some(LinkFault::Completion {
            status: ibv_status(status),
        }),
    }
}

/// Runs until the epoch is over and drained, or the link is dropped.
pub(super) async fn run<D: Device + 'static>(shared: Arc<Shared<D>>) {
    poll_until_done(&shared).await;
    shared.release_posted();
    shared.mark_drained();
}

impl<D: Device + 'static> Shared<D> {
    /// After the end: chunks of WRs no completion will report (an unsignaled
    /// SEND that succeeded last, or a flush still to come) go back to the
    /// pool once the QP is in RESET, where the device holds no WR. Only from
    /// ERR: a graceful close keeps the QP in RTS for its last SENDs. If the
    /// reset does not happen they go when the QP is destroyed (`Shared`'s
    /// field order). Also after the poller panicked: nothing polls the
    /// flushes then where the provider has no completion handler.
    pub(super) fn release_posted(&self) {
        let mut st = self.lock();
        if st.ended.is_none()
            || st.posted.iter().all(|(_, chunk)| chunk.is_none())
            || self.qp.state() != QpState::Err
        {
            return;
        }
        match self.qp.modify_to_reset() {
            Ok(()) => {
                let n = st.posted.len();
                st.posted.clear();
                st.sq_free += n;
            }
            Err(err) => {
                tracing::debug!(%err, "resetting the dead QP failed; chunks wait for its destruction")
            }
        }
    }
}

impl<D: Device + 'static> CompletionHandler for Shared<D> {
    fn completions_ready(&self) -> bool {
        // This runs on the provider's driver, which survives a panic here;
        // the epoch does not. Ended once the unwind is caught, then raised
        // again for the provider to count and retire the handler.
        match catch_unwind(AssertUnwindSafe(|| self.take_completions())) {
            Ok(taken) => taken,
            Err(panic) => {
                self.end_after_panic(true);
                resume_unwind(panic)
            }
        }
    }
}

impl<D: Device + 'static> Shared<D> {
    /// [`Shared::take_completions`] from a link call: a panic ends the
    /// epoch as the handler's would, and is not raised in the caller.
    pub(super) fn take_completions_caught(&self) -> bool {
        catch_unwind(AssertUnwindSafe(|| self.take_completions())).unwrap_or_else(|_| {
            self.end_after_panic(true);
            true
        })
    }

    /// The handler's work: poll the CQ empty, unless the poller is at it.
    fn take_completions(&self) -> bool {
        // The poller holds it only while polling, and it polls again before
        // it waits: declining then loses nothing.
        let mut buf = match self.polling.try_lock() {
            Ok(buf) => buf,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        let _in_link = self.span.enter();
        while let Polled::Some = self.poll_once(&mut buf) {}
        self.let_go_of_polling(buf);
        if self.finished() {
            self.wake_poller.notify_one();
        }
        true
    }
}

async fn poll_until_done<D: Device + 'static>(shared: &Shared<D>) {
    let mut empty_polls = 0;
    loop {
        match shared.poll_locked() {
            Polled::Some => {
                empty_polls = 0;
                // A peer that keeps the CQ fed (credit-only SENDs, each
                // re-posted and answered here) must not hold the worker.
                tokio::task::consume_budget().await;
                continue;
            }
            Polled::Failed => return,
            Polled::Empty => {}
        }
        if shared.finished() {
            return;
        }
        if empty_polls < BUSY_POLLS {
            empty_polls += 1;
            tokio::task::yield_now().await;
            continue;
        }
        empty_polls = 0;
        if let Err(err) = shared.cq.req_notify() {
            tracing::warn!(%err, "arming the CQ failed; ending the epoch");
            shared.end(EpochEnd::Fault(fault_of(&err)));
            return;
        }
        match shared.poll_locked() {
            Polled::Some => continue,
            Polled::Failed => return,
            Polled::Empty => {}
        }
        tokio::select! {
            biased;
            _ = shared.wake_poller.notified() => {}
            _ = shared.cq.notified() => {}
        }
    }
}
