//! Writing records in place into a caller's buffer.

use thiserror::Error;

use super::types::{CloseReason, Epoch, FrameSeq, Lane, RecordKind, SlotId};
use super::{
    BATCH_HEADER_LEN, CLOSE_BODY_LEN, CREDIT_BODY_LEN, OPEN_BODY_LEN, PING_BODY_LEN,
    RECORD_HEADER_LEN, TYPE_MORE, VERSION,
};

/// Why a record could not be encoded. The batch written so far stays valid.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum EncodeError {
    /// The record does not fit in what is left of the buffer: cut the batch.
    #[error("record needs {need} bytes, {have} left in the batch")]
    NoRoom {
        /// Bytes the record needs, header included.
        need: usize,
        /// Bytes left in the buffer.
        have: usize,
    },
    /// The record count field (u16) is full: cut the batch.
    #[error("batch already holds the maximum of {max} records")]
    TooManyRecords {
        /// The maximum record count.
        max: u16,
    },
    /// The buffer cannot hold a header and one empty record.
    #[error("buffer of {len} bytes cannot hold a batch")]
    BufferTooSmall {
        /// The buffer length.
        len: usize,
    },
    /// A body longer than a u32 length can describe.
    #[error("record body of {len} bytes exceeds the u32 length field")]
    BodyTooLong {
        /// The body length.
        len: usize,
    },
    /// A lane this build does not have (only lane 0 exists).
    #[error("lane {lane} does not exist")]
    BadLane {
        /// The lane asked for.
        lane: u8,
    },
}

/// Encodes one batch directly into `buf`.
///
/// The header is written up front and its record count patched by
/// [`BatchEncoder::finish`]; every `push_*` either writes a whole record or
/// leaves the buffer untouched and returns an error.
#[derive(Debug)]
pub struct BatchEncoder<'a> {
    buf: &'a mut [u8],
    pos: usize,
    count: u16,
}

impl<'a> BatchEncoder<'a> {
    /// Starts a batch in `buf` for `epoch`, numbered `batch_seq`, on `lane`.
    pub fn new(
        buf: &'a mut [u8],
        epoch: Epoch,
        batch_seq: u32,
        lane: Lane,
    ) -> Result<Self, EncodeError> {
        if buf.len() < BATCH_HEADER_LEN + RECORD_HEADER_LEN {
            return Err(EncodeError::BufferTooSmall { len: buf.len() });
        }
        // Only lane 0 exists today; the decoder refuses the others too.
        if lane.0 != 0 {
            return Err(EncodeError::BadLane { lane: lane.0 });
        }
        buf[0] = VERSION;
        buf[1] = lane.0;
        buf[2..4].copy_from_slice(&0u16.to_be_bytes());
        buf[4..12].copy_from_slice(&epoch.0.to_be_bytes());
        buf[12..16].copy_from_slice(&batch_seq.to_be_bytes());
        Ok(BatchEncoder {
            buf,
            pos: BATCH_HEADER_LEN,
            count: 0,
        })
    }

    /// Records written so far.
    pub fn record_count(&self) -> u16 {
        self.count
    }

    /// True when no record has been written.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Bytes written so far, header included.
    pub fn len(&self) -> usize {
        self.pos
    }

    /// The largest record body that would fit if pushed now (0 if none fits).
    pub fn body_room(&self) -> usize {
        if self.count == u16::MAX {
            return 0;
        }
        (self.buf.len() - self.pos).saturating_sub(RECORD_HEADER_LEN)
    }

    /// Appends a Data record, or one fragment of one (`more` = more follows).
    pub fn push_data(
        &mut self,
        slot: SlotId,
        seq: FrameSeq,
        body: &[u8],
        more: bool,
    ) -> Result<(), EncodeError> {
        self.push(RecordKind::Data, more, slot, seq, body.len(), |out| {
            out.copy_from_slice(body)
        })
    }

    /// Appends a Message-class record (or a fragment of one). `seq` numbers
    /// messages on the link; the slot field is unused and written as zero.
    pub fn push_message(
        &mut self,
        seq: FrameSeq,
        body: &[u8],
        more: bool,
    ) -> Result<(), EncodeError> {
        let slot = SlotId::from_wire(0);
        self.push(RecordKind::Message, more, slot, seq, body.len(), |out| {
            out.copy_from_slice(body)
        })
    }

    /// Appends an OpenSlot record naming the stream (anchor id, session id).
    pub fn push_open(
        &mut self,
        slot: SlotId,
        seq: FrameSeq,
        anchor: u64,
        session: u64,
    ) -> Result<(), EncodeError> {
        self.push(
            RecordKind::OpenSlot,
            false,
            slot,
            seq,
            OPEN_BODY_LEN,
            |out| {
                out[..8].copy_from_slice(&anchor.to_be_bytes());
                out[8..].copy_from_slice(&session.to_be_bytes());
            },
        )
    }

    /// Appends a CloseSlot record.
    pub fn push_close(
        &mut self,
        slot: SlotId,
        seq: FrameSeq,
        reason: CloseReason,
    ) -> Result<(), EncodeError> {
        self.push(
            RecordKind::CloseSlot,
            false,
            slot,
            seq,
            CLOSE_BODY_LEN,
            |out| out[0] = reason as u8,
        )
    }

    /// Appends a CreditUpdate granting `bytes` more to the slot's sender.
    pub fn push_credit(&mut self, slot: SlotId, bytes: u32) -> Result<(), EncodeError> {
        let seq = FrameSeq(0);
        self.push(
            RecordKind::CreditUpdate,
            false,
            slot,
            seq,
            CREDIT_BODY_LEN,
            |out| out.copy_from_slice(&bytes.to_be_bytes()),
        )
    }

    /// Appends a PeerCredit granting `bytes` more to the peer's sender.
    pub fn push_peer_credit(&mut self, bytes: u32) -> Result<(), EncodeError> {
        let slot = SlotId::from_wire(0);
        self.push(
            RecordKind::PeerCredit,
            false,
            slot,
            FrameSeq(0),
            CREDIT_BODY_LEN,
            |out| out.copy_from_slice(&bytes.to_be_bytes()),
        )
    }

    /// Appends a Heartbeat for an idle slot.
    pub fn push_heartbeat(&mut self, slot: SlotId, seq: FrameSeq) -> Result<(), EncodeError> {
        self.push(RecordKind::Heartbeat, false, slot, seq, 0, |_| {})
    }

    /// Appends a Goodbye: the sender will post nothing after this batch.
    pub fn push_goodbye(&mut self) -> Result<(), EncodeError> {
        let slot = SlotId::from_wire(0);
        self.push(RecordKind::Goodbye, false, slot, FrameSeq(0), 0, |_| {})
    }

    /// Appends a Ping carrying `nonce`.
    pub fn push_ping(&mut self, nonce: u64) -> Result<(), EncodeError> {
        self.push_nonce(RecordKind::Ping, nonce)
    }

    /// Appends a Pong answering the Ping that carried `nonce`.
    pub fn push_pong(&mut self, nonce: u64) -> Result<(), EncodeError> {
        self.push_nonce(RecordKind::Pong, nonce)
    }

    /// Patches the record count and returns the batch length in bytes.
    pub fn finish(self) -> usize {
        self.buf[2..4].copy_from_slice(&self.count.to_be_bytes());
        self.pos
    }

    fn push_nonce(&mut self, kind: RecordKind, nonce: u64) -> Result<(), EncodeError> {
        let slot = SlotId::from_wire(0);
        self.push(kind, false, slot, FrameSeq(0), PING_BODY_LEN, |out| {
            out.copy_from_slice(&nonce.to_be_bytes())
        })
    }

    fn push(
        &mut self,
        kind: RecordKind,
        more: bool,
        slot: SlotId,
        seq: FrameSeq,
        body_len: usize,
        write_body: impl FnOnce(&mut [u8]),
    ) -> Result<(), EncodeError> {
        if self.count == u16::MAX {
            return Err(EncodeError::TooManyRecords { max: u16::MAX });
        }
        let len =
            u32::try_from(body_len).map_err(|_| EncodeError::BodyTooLong { len: body_len })?;
        let need = RECORD_HEADER_LEN + body_len;
        let have = self.buf.len() - self.pos;
        if need > have {
            return Err(EncodeError::NoRoom { need, have });
        }
        let out = &mut self.buf[self.pos..self.pos + need];
        out[0] = kind as u8 | if more { TYPE_MORE } else { 0 };
        out[1..5].copy_from_slice(&slot.to_wire().to_be_bytes());
        out[5..9].copy_from_slice(&seq.0.to_be_bytes());
        out[9..13].copy_from_slice(&len.to_be_bytes());
        write_body(&mut out[RECORD_HEADER_LEN..]);
        self.pos += need;
        self.count += 1;
        Ok(())
    }
}
