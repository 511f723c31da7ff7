//! The message class: unslotted, ordered messages to a peer (velo's active
//! messages) on the same link as the slots.
//!
//! ```text
//!  sender ─► flume (bounded, one per epoch; velo's AdmissionGate wraps it) ─► peer task
//!  peer task ─ Message records (fragmented like data) ─► link ─► peer task ─► MessageSink
//! ```
//!
//! No slot credit: the receiving side hands each message to its sink at once
//! (velo's inbound queues are unbounded by design), so link credit alone
//! paces them. A message dropped before it is written — in the channel, in
//! the peer task, or in velo's admission gate — calls its `on_fail` from
//! `Drop`, so none is lost silently; written ones are "maybe delivered".

use std::panic::AssertUnwindSafe;

use bytes::Bytes;

use super::surface::PeerId;

/// Called with a message that never reached the wire. A panic in it is
/// caught and logged where the message is dropped.
pub type OnFail = Box<dyn FnOnce(Bytes) + Send>;

/// One outbound message and what to do if its epoch ends before it is written.
pub struct OutboundMessage {
    /// The bytes, delivered whole to the peer's sink.
    pub body: Bytes,
    /// Receives `body` back if the message is never written.
    pub on_fail: Option<OnFail>,
}

impl OutboundMessage {
    /// A message with no failure hook.
    pub fn new(body: Bytes) -> OutboundMessage {
        OutboundMessage {
            body,
            on_fail: None,
        }
    }

    /// Disarms `on_fail`: the message is on the wire.
    pub(crate) fn written(mut self) {
        self.on_fail = None;
    }
}

impl Drop for OutboundMessage {
    fn drop(&mut self) {
        if let Some(on_fail) = self.on_fail.take() {
            // The hook is the sender's code, and messages are dropped in the
            // middle of the mux's own bookkeeping (an epoch's end, a
            // channel's drain): its panic stops here, logged, not there.
            let body = self.body.clone();
            if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| on_fail(body))) {
                tracing::error!(
                    panic = crate::unwind::panic_message(&*panic),
                    "an outbound message's failure hook panicked"
                );
            }
        }
    }
}

impl std::fmt::Debug for OutboundMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboundMessage")
            .field("len", &self.body.len())
            .field("on_fail", &self.on_fail.is_some())
            .finish()
    }
}

/// Receives inbound messages. Called from the peer task, or from the
/// link's reader decoding in its place (a TCP link's read task, the soft
/// RDMA device's driver, which serves every QP of the device, a mem link
/// peer's `post`: [`MuxConfig::inline_receive`](crate::mux::MuxConfig::inline_receive)):
/// must not block; a sink that does stalls that reader too (on the soft
/// device, every link of it, ACKs included). A panic in it ends the peer's
/// epoch (counted as `peer_task_panics`).
pub trait MessageSink: Send + Sync {
    /// A whole message from `peer`, in the order the peer sent them.
    fn deliver(&self, peer: PeerId, message: Bytes);
}
