//! Zero-copy, validate-once decoding of a received batch.

use thiserror::Error;

use super::types::{CloseReason, Epoch, FrameSeq, Lane, RecordKind, SlotId};
use super::{
    BATCH_HEADER_LEN, CLOSE_BODY_LEN, CREDIT_BODY_LEN, FLAGS_LANE_MASK, FLAGS_RESERVED_MASK,
    OPEN_BODY_LEN, PING_BODY_LEN, RECORD_HEADER_LEN, TYPE_KIND_MASK, TYPE_MORE, TYPE_RESERVED,
    VERSION,
};

/// A malformed batch. Each is a protocol violation by the peer.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum DecodeError {
    /// Shorter than a batch header.
    #[error("batch of {len} bytes is shorter than its {BATCH_HEADER_LEN}-byte header")]
    ShortHeader {
        /// Bytes received.
        len: usize,
    },
    /// A version this build does not speak.
    #[error("batch version {got}, expected {VERSION}")]
    BadVersion {
        /// The version byte received.
        got: u8,
    },
    /// Reserved flag bits set, or a lane that does not exist.
    #[error("batch flags {flags:#04x} use reserved bits or an unknown lane")]
    BadFlags {
        /// The flags byte received.
        flags: u8,
    },
    /// A record header cut off by the end of the batch.
    #[error("record {record} header truncated: {have} of {RECORD_HEADER_LEN} bytes")]
    ShortRecord {
        /// Index of the record in the batch.
        record: u16,
        /// Bytes left for the header.
        have: usize,
    },
    /// A record length running past the end of the batch.
    #[error("record {record} length {len} runs past the end ({have} bytes left)")]
    LengthPastEnd {
        /// Index of the record in the batch.
        record: u16,
        /// The length field.
        len: u32,
        /// Bytes left after the header.
        have: usize,
    },
    /// An unknown record kind or a reserved type bit.
    #[error("record {record} has unknown type byte {type_byte:#04x}")]
    UnknownType {
        /// Index of the record in the batch.
        record: u16,
        /// The type byte.
        type_byte: u8,
    },
    /// A fixed-size body of the wrong size.
    #[error("record {record} ({kind:?}) body is {len} bytes, expected {expected}")]
    BadBodyLength {
        /// Index of the record in the batch.
        record: u16,
        /// The kind.
        kind: RecordKind,
        /// The length received.
        len: u32,
        /// The length the kind requires.
        expected: usize,
    },
    /// A `more` bit on a kind that cannot be fragmented.
    #[error("record {record} ({kind:?}) claims fragments but cannot be fragmented")]
    BadFragment {
        /// Index of the record in the batch.
        record: u16,
        /// The kind.
        kind: RecordKind,
    },
    /// A CloseSlot reason this build does not know.
    #[error("record {record} has unknown close reason {reason}")]
    UnknownCloseReason {
        /// Index of the record in the batch.
        record: u16,
        /// The reason byte.
        reason: u8,
    },
    /// Bytes left after the declared records.
    #[error("batch declares {declared} records but {trailing} bytes follow them")]
    TrailingBytes {
        /// The header's record count.
        declared: u16,
        /// Bytes after the last declared record.
        trailing: usize,
    },
}

/// The meaning of one record's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordBody<'a> {
    /// Slot payload (or one fragment of it).
    Data(&'a [u8]),
    /// Opens the slot for a stream.
    Open {
        /// Anchor id of the stream.
        anchor: u64,
        /// Session id of the stream.
        session: u64,
    },
    /// Closes the slot.
    Close(CloseReason),
    /// Grants the slot's sender this many more bytes.
    Credit(u32),
    /// Grants the peer's sender this many more bytes, across its slots.
    PeerCredit(u32),
    /// Keeps an idle slot alive.
    Heartbeat,
    /// The peer is closing gracefully.
    Goodbye,
    /// A message-class record (or one fragment of it).
    Message(&'a [u8]),
    /// A health probe.
    Ping(u64),
    /// A health probe's answer.
    Pong(u64),
}

/// One validated record, borrowing from the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record<'a> {
    /// The slot (zero for link-level kinds).
    pub slot: SlotId,
    /// The per-slot sequence number (per-link for messages).
    pub seq: FrameSeq,
    /// More fragments of this record follow in later records of the slot.
    pub more: bool,
    /// The body.
    pub body: RecordBody<'a>,
}

impl Record<'_> {
    /// The record's kind.
    pub fn kind(&self) -> RecordKind {
        match self.body {
            RecordBody::Data(_) => RecordKind::Data,
            RecordBody::Open { .. } => RecordKind::OpenSlot,
            RecordBody::Close(_) => RecordKind::CloseSlot,
            RecordBody::Credit(_) => RecordKind::CreditUpdate,
            RecordBody::PeerCredit(_) => RecordKind::PeerCredit,
            RecordBody::Heartbeat => RecordKind::Heartbeat,
            RecordBody::Goodbye => RecordKind::Goodbye,
            RecordBody::Message(_) => RecordKind::Message,
            RecordBody::Ping(_) => RecordKind::Ping,
            RecordBody::Pong(_) => RecordKind::Pong,
        }
    }
}

/// A received batch, validated in full by [`BatchView::new_checked`].
#[derive(Clone, Copy, Debug)]
pub struct BatchView<'a> {
    buf: &'a [u8],
    count: u16,
}

impl<'a> BatchView<'a> {
    /// Validates the header and every record. After this, iterating the
    /// records cannot fail.
    pub fn new_checked(buf: &'a [u8]) -> Result<Self, DecodeError> {
        if buf.len() < BATCH_HEADER_LEN {
            return Err(DecodeError::ShortHeader { len: buf.len() });
        }
        if buf[0] != VERSION {
            return Err(DecodeError::BadVersion { got: buf[0] });
        }
        let flags = buf[1];
        if flags & FLAGS_RESERVED_MASK != 0 || flags & FLAGS_LANE_MASK != 0 {
            return Err(DecodeError::BadFlags { flags });
        }
        let count = u16::from_be_bytes([buf[2], buf[3]]);
        let mut pos = BATCH_HEADER_LEN;
        for record in 0..count {
            let (_, next) = parse_record(buf, pos, record)?;
            pos = next;
        }
        if pos != buf.len() {
            return Err(DecodeError::TrailingBytes {
                declared: count,
                trailing: buf.len() - pos,
            });
        }
        Ok(BatchView { buf, count })
    }

    /// The epoch the sender wrote this batch in.
    pub fn epoch(&self) -> Epoch {
        Epoch(u64::from_be_bytes(array(&self.buf[4..12])))
    }

    /// The sender's batch sequence number.
    pub fn batch_seq(&self) -> u32 {
        u32::from_be_bytes(array(&self.buf[12..16]))
    }

    /// The lane the batch travelled on.
    pub fn lane(&self) -> Lane {
        Lane(self.buf[1] & FLAGS_LANE_MASK)
    }

    /// Number of records.
    pub fn record_count(&self) -> u16 {
        self.count
    }

    /// Iterates the records in wire order.
    pub fn records(&self) -> Records<'a> {
        Records {
            buf: self.buf,
            pos: BATCH_HEADER_LEN,
            index: 0,
            count: self.count,
        }
    }
}

/// Iterator over the records of a validated batch.
#[derive(Clone, Debug)]
pub struct Records<'a> {
    buf: &'a [u8],
    pos: usize,
    index: u16,
    count: u16,
}

impl<'a> Iterator for Records<'a> {
    type Item = Record<'a>;

    fn next(&mut self) -> Option<Record<'a>> {
        if self.index == self.count {
            return None;
        }
        // Validated in `new_checked`; an error here would be a bug, and ending
        // the iteration is the non-panicking answer.
        let (record, next) = parse_record(self.buf, self.pos, self.index).ok()?;
        self.pos = next;
        self.index += 1;
        Some(record)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::from(self.count - self.index);
        (left, Some(left))
    }
}

fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[..N]);
    out
}

fn parse_record(buf: &[u8], pos: usize, record: u16) -> Result<(Record<'_>, usize), DecodeError> {
    let rest = &buf[pos..];
    if rest.len() < RECORD_HEADER_LEN {
        return Err(DecodeError::ShortRecord {
            record,
            have: rest.len(),
        });
    }
    let type_byte = rest[0];
    let kind = RecordKind::from_wire(type_byte & TYPE_KIND_MASK)
        .filter(|_| type_byte & TYPE_RESERVED == 0)
        .ok_or(DecodeError::UnknownType { record, type_byte })?;
    let more = type_byte & TYPE_MORE != 0;
    let slot = SlotId::from_wire(u32::from_be_bytes(array(&rest[1..5])));
    let seq = FrameSeq(u32::from_be_bytes(array(&rest[5..9])));
    let len = u32::from_be_bytes(array(&rest[9..13]));
    let have = rest.len() - RECORD_HEADER_LEN;
    let body_len = usize::try_from(len)
        .ok()
        .filter(|&l| l <= have)
        .ok_or(DecodeError::LengthPastEnd { record, len, have })?;
    if more && !kind.can_fragment() {
        return Err(DecodeError::BadFragment { record, kind });
    }
    let body = &rest[RECORD_HEADER_LEN..RECORD_HEADER_LEN + body_len];
    let fixed = |expected: usize| {
        if body_len == expected {
            Ok(())
        } else {
            Err(DecodeError::BadBodyLength {
                record,
                kind,
                len,
                expected,
            })
        }
    };
    let body = match kind {
        RecordKind::Data => RecordBody::Data(body),
        RecordKind::Message => RecordBody::Message(body),
        RecordKind::OpenSlot => {
            fixed(OPEN_BODY_LEN)?;
            RecordBody::Open {
                anchor: u64::from_be_bytes(array(&body[..8])),
                session: u64::from_be_bytes(array(&body[8..])),
            }
        }
        RecordKind::CloseSlot => {
            fixed(CLOSE_BODY_LEN)?;
            let reason =
                CloseReason::from_wire(body[0]).ok_or(DecodeError::UnknownCloseReason {
                    record,
                    reason: body[0],
                })?;
            RecordBody::Close(reason)
        }
        RecordKind::CreditUpdate => {
            fixed(CREDIT_BODY_LEN)?;
            RecordBody::Credit(u32::from_be_bytes(array(body)))
        }
        RecordKind::PeerCredit => {
            fixed(CREDIT_BODY_LEN)?;
            RecordBody::PeerCredit(u32::from_be_bytes(array(body)))
        }
        RecordKind::Heartbeat => {
            fixed(0)?;
            RecordBody::Heartbeat
        }
        RecordKind::Goodbye => {
            fixed(0)?;
            RecordBody::Goodbye
        }
        RecordKind::Ping => {
            fixed(PING_BODY_LEN)?;
            RecordBody::Ping(u64::from_be_bytes(array(body)))
        }
        RecordKind::Pong => {
            fixed(PING_BODY_LEN)?;
            RecordBody::Pong(u64::from_be_bytes(array(body)))
        }
    };
    let record = Record {
        slot,
        seq,
        more,
        body,
    };
    Ok((record, pos + RECORD_HEADER_LEN + body_len))
}
