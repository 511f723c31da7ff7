//! Newtypes and enums shared by the encoder and decoder.

use std::fmt;

/// One queue pair's life, agreed by both ends at bootstrap. All slot state is
/// scoped to an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch after this one.
    pub fn next(self) -> Epoch {
        Epoch(self.0.wrapping_add(1))
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

/// A slot on the wire: a dense 24-bit index plus an 8-bit generation that
/// changes every time the index is reused, so a late record for a closed slot
/// cannot land in its successor.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(u32);

impl SlotId {
    /// The largest index a slot may have.
    pub const MAX_INDEX: u32 = (1 << 24) - 1;

    /// Builds a slot id. Returns `None` if `index` does not fit in 24 bits.
    pub fn new(index: u32, generation: u8) -> Option<SlotId> {
        (index <= Self::MAX_INDEX).then_some(SlotId((index << 8) | u32::from(generation)))
    }

    /// Reinterprets the 32-bit wire value.
    pub fn from_wire(raw: u32) -> SlotId {
        SlotId(raw)
    }

    /// The 32-bit wire value.
    pub fn to_wire(self) -> u32 {
        self.0
    }

    /// The dense index.
    pub fn index(self) -> u32 {
        self.0 >> 8
    }

    /// The generation of this use of the index.
    pub fn generation(self) -> u8 {
        self.0 as u8
    }
}

impl fmt::Debug for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot{}g{}", self.index(), self.generation())
    }
}

/// Per-slot record sequence number. Wraps at 2^32; the receiver expects
/// exactly the successor of the last one it accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FrameSeq(pub u32);

impl FrameSeq {
    /// The sequence number after this one, wrapping.
    pub fn next(self) -> FrameSeq {
        FrameSeq(self.0.wrapping_add(1))
    }
}

/// A lane: an independent queue pair to the same peer. Only lane 0 exists today;
/// the header keeps four bits for more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Lane(pub u8);

/// What a record is. Stable wire values; unknown values are a decode error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RecordKind {
    /// Slot payload bytes.
    Data = 0,
    /// Opens a slot for (anchor id, session id).
    OpenSlot = 1,
    /// Closes a slot, with a [`CloseReason`].
    CloseSlot = 2,
    /// Returns slot credit, in bytes, to the slot's sender.
    CreditUpdate = 3,
    /// Keeps an idle slot alive.
    Heartbeat = 4,
    /// The peer is closing the link gracefully; no records follow.
    Goodbye = 5,
    /// A message of the message class (velo active messages), not bound to a slot.
    Message = 6,
    /// Health probe; the peer answers with [`RecordKind::Pong`] and the same nonce.
    Ping = 7,
    /// Answer to a [`RecordKind::Ping`].
    Pong = 8,
    /// Returns peer credit, in bytes: data of any slot its receiver let go.
    PeerCredit = 9,
}

impl RecordKind {
    /// Parses the kind bits of a type byte.
    pub fn from_wire(kind: u8) -> Option<RecordKind> {
        Some(match kind {
            0 => RecordKind::Data,
            1 => RecordKind::OpenSlot,
            2 => RecordKind::CloseSlot,
            3 => RecordKind::CreditUpdate,
            4 => RecordKind::Heartbeat,
            5 => RecordKind::Goodbye,
            6 => RecordKind::Message,
            7 => RecordKind::Ping,
            8 => RecordKind::Pong,
            9 => RecordKind::PeerCredit,
            _ => return None,
        })
    }

    /// True for kinds whose body may be split across batches.
    pub fn can_fragment(self) -> bool {
        matches!(self, RecordKind::Data | RecordKind::Message)
    }
}

/// Why a slot closed. Stable wire values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CloseReason {
    /// The sender finished the stream normally.
    Finalized = 0,
    /// The sender detached: it stops sending, the stream may be resumed elsewhere.
    Detached = 1,
    /// The sender dropped its handle without a terminal.
    SenderDropped = 2,
    /// Receiver → sender: no such slot here (unknown index or stale generation).
    UnknownSlot = 3,
    /// Receiver → sender: the slot was refused (limit reached or no binding).
    Refused = 4,
    /// The receiver's consumer went away; stop sending.
    ReceiverGone = 5,
    /// Sender → receiver: the stream's next record is larger than the
    /// receiver takes (its `max_record`, or its whole window for us), so
    /// the stream ends here. Sent when the peer task finds it: a record past
    /// `max_record` queued before the receiver's terms were heard (later
    /// ones are refused at `send`), or any record past the window.
    TooLarge = 6,
}

impl CloseReason {
    /// Parses a wire value.
    pub fn from_wire(raw: u8) -> Option<CloseReason> {
        Some(match raw {
            0 => CloseReason::Finalized,
            1 => CloseReason::Detached,
            2 => CloseReason::SenderDropped,
            3 => CloseReason::UnknownSlot,
            4 => CloseReason::Refused,
            5 => CloseReason::ReceiverGone,
            6 => CloseReason::TooLarge,
            _ => return None,
        })
    }
}
