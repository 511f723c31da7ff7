//! Why a handshake failed: one variant per way a peer can misbehave.

use thiserror::Error;

use super::wire::{DeclineReason, EndpointKind, MessageKind};
use crate::mux::PeerId;
use crate::mux::protocol::Epoch;

/// A failed handshake. Every variant but [`Declined`](Self::Declined) and
/// [`Closed`](Self::Closed) means the peer is broken, misconfigured or hostile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum BootstrapError {
    /// The peer speaks another protocol version.
    #[error(
        "peer speaks bootstrap version {got}, we speak {}",
        super::wire::PROTOCOL_VERSION
    )]
    BadVersion {
        /// The version it sent.
        got: u16,
    },
    /// The bytes are not a qpmux bootstrap (wrong magic).
    #[error("not a qpmux bootstrap message (bad magic)")]
    BadMagic,
    /// A length prefix beyond the limit.
    #[error("message of {len} bytes exceeds the {max}-byte limit")]
    Oversized {
        /// The announced length.
        len: u32,
        /// The limit.
        max: usize,
    },
    /// A message ended before its fields did (or the stream ended mid-message).
    #[error("truncated message")]
    Truncated,
    /// Bytes after the last field of a message.
    #[error("trailing bytes after a message")]
    TrailingBytes,
    /// An unknown message type byte.
    #[error("unknown message type {0}")]
    UnknownMessage(u8),
    /// A field with an invalid value.
    #[error("invalid field: {0}")]
    BadField(&'static str),
    /// A valid message at the wrong point of the exchange.
    #[error("expected {expected:?}, got {got:?}")]
    Unexpected {
        /// What this state accepts.
        expected: MessageKind,
        /// What arrived.
        got: MessageKind,
    },
    /// The MAC does not verify: the peer has another cluster key (or forged it).
    #[error("bad MAC: wrong cluster key or forged message")]
    BadMac,
    /// A cluster key is configured and the peer sent no proof.
    #[error("peer sent no MAC but a cluster key is configured")]
    MissingMac,
    /// No cluster key is configured and the peer sent a MAC (it has a key we lack).
    #[error("peer sent a MAC but no cluster key is configured")]
    UnexpectedMac,
    /// The peer echoed a nonce other than the one sent on this connection (replay).
    #[error("peer echoed a stale nonce (replay)")]
    StaleNonce,
    /// The peer sent back our own nonce as its own (reflection).
    #[error("peer reflected our nonce")]
    ReflectedNonce,
    /// The listener is not the node we dialed.
    #[error("dialed {expected:?}, reached {got:?}")]
    WrongPeer {
        /// The node we meant to reach.
        expected: PeerId,
        /// The node that answered.
        got: PeerId,
    },
    /// Both proposals sit at the top of the epoch space: no epoch is left
    /// above them (only a peer that proposed one near `u64::MAX` gets here).
    #[error("no epoch is left above {0}")]
    EpochsExhausted(Epoch),
    /// The peer claims our own node id.
    #[error("peer claims our own node id")]
    SelfConnect,
    /// The peer's endpoint is for another transport.
    #[error("peer offers a {got:?} endpoint, this is a {expected:?} link")]
    WrongTransport {
        /// Our transport.
        expected: EndpointKind,
        /// The peer's.
        got: EndpointKind,
    },
    /// The dialer's ready names another epoch than the one both hellos imply.
    #[error("peer agreed on {theirs}, the hellos give {ours}")]
    EpochMismatch {
        /// The epoch we computed.
        ours: Epoch,
        /// The epoch the peer sent.
        theirs: Epoch,
    },
    /// The listener declined this connection (not a fault).
    #[error("declined by the listener: {0:?}")]
    Declined(DeclineReason),
    /// The stream ended at a message boundary before the handshake finished.
    #[error("peer closed the connection during the handshake")]
    Closed,
    /// The driver called a method the current state does not take (a local bug).
    #[error("handshake method called out of order")]
    OutOfOrder,
    /// The handshake already failed; it takes no more input.
    #[error("the handshake already failed")]
    AlreadyFailed,
}
