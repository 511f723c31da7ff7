//! An in-process link pair for tests, holding to the rules RDMA will.
//!
//! ```text
//!  end A ─ reserve (takes A's credit) ─ post ─► B.inbox ─ recv ─► Batch ─ drop ─► credit back to A
//! ```
//!
//! Each direction has `credits` receive "buffers": the sender holds a credit
//! per free one, so `held + in flight + held by the consumer == credits`
//! always ([`MemLink::credit_state`] shows it). All state sits behind one
//! mutex owned by the pair; waiters sleep on their end's `Notify`.

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use tokio::sync::Notify;

use super::{Arrivals, EpochEnd, Link, LinkError};
use crate::mux::protocol::Epoch;

/// Shape of a mem link pair.
#[derive(Clone, Copy, Debug)]
pub struct MemConfig {
    /// Receive buffers per direction, i.e. link credits a sender starts with.
    pub credits: usize,
    /// Bytes per batch.
    pub max_batch: usize,
    /// Send buffers per end.
    pub send_buffers: usize,
}

impl Default for MemConfig {
    fn default() -> Self {
        MemConfig {
            credits: 16,
            max_batch: 64 * 1024,
            send_buffers: 16,
        }
    }
}

/// Where one direction's credits are, for invariant checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CreditState {
    /// Credits the sender holds (including ones inside unposted send buffers).
    pub held: usize,
    /// Batches posted and not yet received.
    pub in_flight: usize,
    /// Batches received and not yet dropped by the consumer.
    pub consumer_held: usize,
}

impl CreditState {
    /// Sum of all three; always equals the configured credits.
    pub fn total(&self) -> usize {
        self.held + self.in_flight + self.consumer_held
    }
}

#[derive(Debug)]
struct EndState {
    credits: usize,
    free_buffers: Vec<Vec<u8>>,
    inbox: VecDeque<Vec<u8>>,
    consumer_held: usize,
    /// Batches `recv` and `try_recv` have handed out.
    handed_out: u64,
}

#[derive(Debug)]
struct State {
    ends: [EndState; 2],
    ended: Option<(EpochEnd, usize)>,
}

#[derive(Debug)]
struct Shared {
    epoch: Epoch,
    config: MemConfig,
    state: Mutex<State>,
    wake: [Notify; 2],
    /// Each end's arrivals hook, told by the peer's `post`.
    arrivals: [OnceLock<Weak<dyn Arrivals>>; 2],
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock is a bug in this file; surviving it
        // would hide the bug, so propagate.
        self.state.lock().expect("mem link state poisoned")
    }

    fn ended_for(&self, state: &State, end: usize) -> Option<LinkError> {
        state.ended.map(|(reason, by)| LinkError::Ended {
            epoch: self.epoch,
            reason: if by == end {
                reason
            } else {
                EpochEnd::PeerClosed
            },
        })
    }

    fn wake_all(&self) {
        self.wake[0].notify_waiters();
        self.wake[1].notify_waiters();
    }
}

/// One end of an in-process link.
#[derive(Debug, Clone)]
pub struct MemLink {
    shared: Arc<Shared>,
    end: usize,
}

/// Creates a connected pair for `epoch`.
pub fn pair(epoch: Epoch, config: MemConfig) -> (MemLink, MemLink) {
    let end_state = || EndState {
        credits: config.credits,
        free_buffers: (0..config.send_buffers)
            .map(|_| vec![0u8; config.max_batch])
            .collect(),
        inbox: VecDeque::new(),
        consumer_held: 0,
        handed_out: 0,
    };
    let shared = Arc::new(Shared {
        epoch,
        config,
        state: Mutex::new(State {
            ends: [end_state(), end_state()],
            ended: None,
        }),
        wake: [Notify::new(), Notify::new()],
        arrivals: [OnceLock::new(), OnceLock::new()],
    });
    (
        MemLink {
            shared: shared.clone(),
            end: 0,
        },
        MemLink { shared, end: 1 },
    )
}

impl MemLink {
    /// True once the epoch has ended (either end failed it).
    pub fn is_ended(&self) -> bool {
        self.shared.lock().ended.is_some()
    }

    /// Where the credits of the direction this end sends on are.
    pub fn credit_state(&self) -> CreditState {
        let state = self.shared.lock();
        let peer = 1 - self.end;
        let mine = &state.ends[self.end];
        let outstanding_bufs = self.shared.config.send_buffers - mine.free_buffers.len();
        // Credits inside unposted send buffers are still held by this end.
        CreditState {
            held: mine.credits + outstanding_bufs,
            in_flight: state.ends[peer].inbox.len(),
            consumer_held: state.ends[peer].consumer_held,
        }
    }
}

/// A send buffer holding one link credit.
#[derive(Debug)]
pub struct MemSendBuf {
    data: Option<Vec<u8>>,
    link: MemLink,
}

impl Deref for MemSendBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.data.as_deref().unwrap_or(&[])
    }
}

impl DerefMut for MemSendBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.data.as_deref_mut().unwrap_or(&mut [])
    }
}

impl Drop for MemSendBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.data.take() {
            let mut state = self.link.shared.lock();
            let end = &mut state.ends[self.link.end];
            end.free_buffers.push(buf);
            end.credits += 1;
            drop(state);
            self.link.shared.wake[self.link.end].notify_waiters();
        }
    }
}

/// A received batch; dropping it returns one credit to the sender.
#[derive(Debug)]
pub struct MemBatch {
    data: Vec<u8>,
    link: MemLink,
}

impl Deref for MemBatch {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for MemBatch {
    fn drop(&mut self) {
        let peer = 1 - self.link.end;
        let mut state = self.link.shared.lock();
        state.ends[self.link.end].consumer_held -= 1;
        state.ends[peer].credits += 1;
        drop(state);
        self.link.shared.wake[peer].notify_waiters();
    }
}

impl Link for MemLink {
    type SendBuf = MemSendBuf;
    type Batch = MemBatch;
    const RELEASE_POSTS: bool = false;
    const TRY_RESERVE: bool = true;
    const TRY_RECV: bool = true;

    fn epoch(&self) -> Epoch {
        self.shared.epoch
    }

    fn max_batch(&self) -> usize {
        self.shared.config.max_batch
    }

    async fn reserve(&self) -> Result<MemSendBuf, LinkError> {
        loop {
            let notified = self.shared.wake[self.end].notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.shared.lock();
                if let Some(err) = self.shared.ended_for(&state, self.end) {
                    return Err(err);
                }
                let end = &mut state.ends[self.end];
                if end.credits > 0 {
                    if let Some(buf) = end.free_buffers.pop() {
                        end.credits -= 1;
                        return Ok(MemSendBuf {
                            data: Some(buf),
                            link: self.clone(),
                        });
                    }
                }
            }
            notified.await;
        }
    }

    fn try_reserve(&self) -> Option<Result<MemSendBuf, LinkError>> {
        let mut state = self.shared.lock();
        if let Some(err) = self.shared.ended_for(&state, self.end) {
            return Some(Err(err));
        }
        let end = &mut state.ends[self.end];
        if end.credits == 0 {
            return None;
        }
        let buf = end.free_buffers.pop()?;
        end.credits -= 1;
        Some(Ok(MemSendBuf {
            data: Some(buf),
            link: self.clone(),
        }))
    }

    fn post(&self, mut buf: MemSendBuf, len: usize) -> Result<(), LinkError> {
        let max = self.shared.config.max_batch;
        if len > max {
            return Err(LinkError::BatchTooLarge { len, max });
        }
        let data = buf.data.take().expect("a send buffer is posted once");
        let mut state = self.shared.lock();
        if let Some(err) = self.shared.ended_for(&state, self.end) {
            // Not posted: the buffer and its credit stay with this end.
            let end = &mut state.ends[self.end];
            end.free_buffers.push(data);
            end.credits += 1;
            return Err(err);
        }
        let peer = 1 - self.end;
        state.ends[peer].inbox.push_back(data[..len].to_vec());
        state.ends[self.end].free_buffers.push(data);
        drop(state);
        // The peer's hook runs in this turn, as a reader's would.
        if let Some(arrivals) = self.shared.arrivals[peer].get().and_then(Weak::upgrade) {
            arrivals.arrived();
            if self.shared.lock().ends[peer].inbox.is_empty() {
                return Ok(());
            }
        }
        self.shared.wake[peer].notify_waiters();
        Ok(())
    }

    fn post_last(&self, buf: MemSendBuf, len: usize) -> Result<(), LinkError> {
        // Delivery is immediate: nothing to wait for.
        self.post(buf, len)
    }

    async fn recv(&self) -> Result<MemBatch, LinkError> {
        loop {
            let notified = self.shared.wake[self.end].notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.shared.lock();
                let end = &mut state.ends[self.end];
                if let Some(data) = end.inbox.pop_front() {
                    end.consumer_held += 1;
                    end.handed_out += 1;
                    return Ok(MemBatch {
                        data,
                        link: self.clone(),
                    });
                }
                if let Some(err) = self.shared.ended_for(&state, self.end) {
                    return Err(err);
                }
            }
            notified.await;
        }
    }

    fn try_recv(&self, handled: u64) -> Option<MemBatch> {
        let mut state = self.shared.lock();
        if state.ended.is_some() {
            return None;
        }
        let end = &mut state.ends[self.end];
        if end.handed_out != handled {
            return None;
        }
        let data = end.inbox.pop_front()?;
        end.consumer_held += 1;
        end.handed_out += 1;
        Some(MemBatch {
            data,
            link: self.clone(),
        })
    }

    fn set_arrivals(&self, arrivals: Weak<dyn Arrivals>) {
        let _ = self.shared.arrivals[self.end].set(arrivals);
    }

    fn fail(&self, reason: EpochEnd) {
        let mut state = self.shared.lock();
        if state.ended.is_none() {
            state.ended = Some((reason, self.end));
        }
        drop(state);
        self.shared.wake_all();
    }

    async fn ended(&self) -> EpochEnd {
        loop {
            let notified = self.shared.wake[self.end].notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let state = self.shared.lock();
                if let Some(LinkError::Ended { reason, .. }) =
                    self.shared.ended_for(&state, self.end)
                {
                    return reason;
                }
            }
            notified.await;
        }
    }
}

mod fabric;

pub use fabric::{MemFabric, MemNode};

#[cfg(test)]
mod tests;
