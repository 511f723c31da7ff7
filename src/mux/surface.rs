//! The typed mux surface: what an application (velo) sees.
//!
//! [`AsMux::as_mux`] is the one method a transport adds; [`MuxTransport`] has
//! no defaulted methods, so an implementation states every behaviour it has.

use bytes::Bytes;
use thiserror::Error;

use super::protocol::Epoch;
use super::slot::{SlotReceiver, SlotSender};
use super::stats::Stats;

/// A remote node, as the transport that owns the links names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

/// The anchor a stream belongs to (velo's anchor id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AnchorId(pub u64);

/// One attachment to an anchor (velo's session id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

/// What names a stream on both ends: the receiver binds it, the sender opens it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamKey {
    /// The anchor.
    pub anchor: AnchorId,
    /// The session on that anchor.
    pub session: SessionId,
}

impl StreamKey {
    /// Builds a key from raw ids.
    pub fn new(anchor: u64, session: u64) -> StreamKey {
        StreamKey {
            anchor: AnchorId(anchor),
            session: SessionId(session),
        }
    }
}

/// How a sender ends its stream. Terminals never wait for credit or capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Terminal {
    /// The stream is complete.
    Finalized,
    /// The sender detached; the stream may continue from another sender.
    Detached,
}

/// Why a stream ended without its sender's terminal. `Dropped` means "maybe
/// delivered": records the sender saw accepted may or may not have arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DropReason {
    /// The link's epoch ended (QP error, peer loss, protocol violation).
    EpochEnded {
        /// The epoch that ended.
        epoch: Epoch,
    },
    /// The sender dropped its handle without a terminal.
    SenderDropped,
    /// The transport is shutting down.
    Shutdown,
    /// The peer was unregistered while the stream waited for a link to it:
    /// none will come, and nothing of the stream went out.
    Unregistered,
    /// No link to the peer can come until a setting changes at one end (it
    /// runs another transport, or one end cannot use the other's endpoint:
    /// `ConnectError::is_permanent`) while the stream waited for one;
    /// nothing of the stream went out.
    Unreachable,
    /// The sender's next record was larger than this end takes (its
    /// `max_record` or its window for that peer); the records before it
    /// were delivered, the stream ends here.
    RecordTooLarge,
}

/// One item on a slot's typed sink, in send order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Payload bytes.
    Data(Bytes),
    /// The sender is alive but idle.
    Heartbeat,
    /// Terminal: the sender finished the stream.
    Finalized,
    /// Terminal: the sender detached.
    Detached,
    /// Terminal: the stream was lost; see [`DropReason`].
    Dropped(DropReason),
    /// Terminal: the transport refused or broke the stream.
    TransportError(MuxError),
}

impl Frame {
    /// True for the frames after which nothing follows.
    pub fn is_terminal(&self) -> bool {
        match self {
            Frame::Data(_) | Frame::Heartbeat => false,
            Frame::Finalized | Frame::Detached | Frame::Dropped(_) | Frame::TransportError(_) => {
                true
            }
        }
    }
}

/// Errors of the mux surface.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum MuxError {
    /// No such peer is registered with the transport.
    #[error("unknown peer {0:?}")]
    UnknownPeer(PeerId),
    /// The stream key is already bound here.
    #[error("stream {0:?} is already bound")]
    AlreadyBound(StreamKey),
    /// The peer's slot table is full.
    #[error("slot limit of {limit} reached for peer {peer:?}")]
    SlotLimit {
        /// The peer.
        peer: PeerId,
        /// The limit met: our `max_slots_per_peer`, or the peer's if its
        /// hello said a smaller one.
        limit: u32,
    },
    /// The peer refused the slot (no binding, or its own limit).
    #[error("peer refused the slot")]
    Refused,
    /// The transport is shut down.
    #[error("transport is shut down")]
    Shutdown,
}

/// The typed mux: open egress slots, bind ingress slots, flush, observe.
pub trait MuxTransport: Send + Sync {
    /// Opens an egress slot to `peer` for `key`. Never blocks; the OpenSlot
    /// record goes out with the next batch (connecting the peer if needed).
    fn open(&self, peer: PeerId, key: StreamKey) -> Result<SlotSender, MuxError>;

    /// Binds the ingress side of `key`; frames from whichever peer opens it
    /// arrive on the receiver.
    fn bind(&self, key: StreamKey) -> Result<SlotReceiver, MuxError>;

    /// Cuts a batch for `peer` now (the [`FlushPolicy::Manual`] kick).
    ///
    /// [`FlushPolicy::Manual`]: super::FlushPolicy::Manual
    fn flush(&self, peer: PeerId) -> Result<(), MuxError>;

    /// The current epoch of the link to `peer`, if one is up.
    fn epoch(&self, peer: PeerId) -> Option<Epoch>;

    /// A snapshot of the counters.
    fn stats(&self) -> Stats;
}

/// The one method a transport adds to expose its typed mux.
pub trait AsMux {
    /// The mux surface, or `None` if this transport has none.
    fn as_mux(&self) -> Option<&dyn MuxTransport>;
}
