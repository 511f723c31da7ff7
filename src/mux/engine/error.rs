//! How a peer can break the mux protocol. Each one ends that peer's epoch.

use thiserror::Error;

use crate::mux::protocol::{DecodeError, Epoch, FrameSeq, SlotId};
use crate::verbs::PeerRequestError;

/// A protocol violation by the peer, one variant per distinct offence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum ProtocolError {
    /// The batch did not decode.
    #[error(transparent)]
    Malformed(#[from] DecodeError),
    /// A batch stamped with another epoch than the link's.
    #[error("batch from epoch {got}, link is epoch {expected}")]
    WrongEpoch {
        /// The link's epoch.
        expected: Epoch,
        /// The batch's epoch.
        got: Epoch,
    },
    /// Batches must be numbered consecutively.
    #[error("batch sequence {got}, expected {expected}")]
    BatchSeqGap {
        /// The next expected batch number.
        expected: u32,
        /// The number received.
        got: u32,
    },
    /// A slot record out of sequence.
    #[error("{slot:?}: frame_seq {got:?}, expected {expected:?}")]
    FrameSeqGap {
        /// The slot.
        slot: SlotId,
        /// The expected sequence number.
        expected: FrameSeq,
        /// The received one.
        got: FrameSeq,
    },
    /// A record started while the slot had no credit left.
    #[error("{slot:?}: record started with {outstanding} bytes outstanding, window {window}")]
    CreditOverrun {
        /// The slot.
        slot: SlotId,
        /// Bytes received and not yet returned.
        outstanding: u64,
        /// The slot's window.
        window: u32,
    },
    /// Credit returned beyond the window (we would hold more than we were given).
    #[error("{slot:?}: credit grant raises credit to {credit}, window {window}")]
    CreditOverGrant {
        /// The slot.
        slot: SlotId,
        /// Credit after the grant.
        credit: i64,
        /// The slot's window.
        window: u32,
    },
    /// Data beyond the peer credit this node granted across all slots.
    #[error(
        "data of {len} bytes, counting {cost}, with {outstanding} bytes outstanding, peer window {window}"
    )]
    PeerCreditOverrun {
        /// Bytes of the peer's data held or in flight here, not yet returned.
        outstanding: u64,
        /// The data record's length.
        len: usize,
        /// What it counts: its length, plus `RECORD_OVERHEAD` on a record's
        /// last fragment.
        cost: u64,
        /// Our peer window.
        window: u32,
    },
    /// Peer credit returned beyond the peer's window.
    #[error("peer credit grant raises credit to {credit}, peer window {window}")]
    PeerCreditOverGrant {
        /// Credit after the grant.
        credit: i64,
        /// The peer's window.
        window: u32,
    },
    /// An OpenSlot for an index that is still live.
    #[error("{slot:?} opened while index is live")]
    SlotInUse {
        /// The slot.
        slot: SlotId,
    },
    /// A reassembled record larger than the maximum.
    #[error("{slot:?}: record of at least {len} bytes exceeds the {max}-byte maximum")]
    RecordTooLarge {
        /// The slot (zero for messages).
        slot: SlotId,
        /// Bytes so far.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// A slot closed or heartbeat arrived in the middle of a fragmented record.
    #[error("{slot:?}: fragment sequence interrupted")]
    BrokenFragment {
        /// The slot.
        slot: SlotId,
    },
    /// Records after a Goodbye.
    #[error("records after goodbye")]
    AfterGoodbye,
    /// A Pong for a nonce above any this epoch wrote in a Ping (nonces
    /// count up, so one above answers pings not yet asked).
    #[error("pong {nonce} answers no ping (the highest sent was {asked})")]
    UnaskedPong {
        /// The nonce the Pong carried.
        nonce: u64,
        /// The highest nonce this epoch sent in a Ping (0: none).
        asked: u64,
    },
    /// The link's framing, not a batch: a TCP frame header announcing more
    /// bytes than this end's receive buffers hold.
    #[error("link frame of {len} bytes exceeds the {max}-byte receive buffer")]
    FrameTooLarge {
        /// The length the frame announced.
        len: usize,
        /// The receive buffer's length.
        max: usize,
    },
    /// An RDMA SEND longer than the receive buffers this end announced (the
    /// receive completed with a local length error).
    #[error("RDMA send longer than the {max}-byte receive buffers")]
    SendTooLarge {
        /// The receive buffer's length.
        max: usize,
    },
    /// The link's credit: the peer returned more RDMA link credit (receive
    /// posts) than it was ever given.
    #[error("peer returned {claimed} link credits, at most {granted} were granted")]
    LinkCreditOverclaim {
        /// Cumulative credits the peer claimed.
        claimed: u32,
        /// Cumulative credits we ever granted.
        granted: u32,
    },
    /// An RDMA SEND without an immediate: every message of the link
    /// carries its cumulative credit count there.
    #[error("RDMA send without an immediate (its credit count)")]
    SendWithoutImmediate,
    /// Bytes on the RDMA link's liveness connection, where nothing may
    /// follow the handshake's ready.
    #[error("bytes on the liveness connection")]
    LivenessTraffic,
    /// An RC request our QP's responder refused (the link only SENDs with
    /// an immediate): the provider NAKed it and moved the QP to ERR.
    #[error("RC request refused: {0}")]
    RequestRefused(PeerRequestError),
}

impl ProtocolError {
    /// Whether a link found it (framing, link credit, liveness) rather than
    /// the mux in a batch: the batches the link completed before it are
    /// sound.
    pub fn is_link_level(&self) -> bool {
        matches!(
            self,
            ProtocolError::FrameTooLarge { .. }
                | ProtocolError::SendTooLarge { .. }
                | ProtocolError::LinkCreditOverclaim { .. }
                | ProtocolError::SendWithoutImmediate
                | ProtocolError::LivenessTraffic
                | ProtocolError::RequestRefused(_)
        )
    }
}
