//! The mux wire protocol: batches of slot records, encoded in place.
//!
//! ```text
//!  batch  = header(16) record*
//!  header = version u8 | flags u8 | record_count u16 | epoch u64 | batch_seq u32
//!  record = type u8 | slot u32 (index:24 | generation:8) | frame_seq u32 | len u32 | body
//!  type   = more:1 | reserved:1 | kind:6
//! ```
//!
//! All integers are big-endian. [`BatchEncoder`] writes records straight into a
//! caller's buffer (the registered send buffer on RDMA) and says when the next
//! one will not fit; [`BatchView`] validates a received batch once, after which
//! iterating its records cannot fail or panic. A logical record larger than a
//! batch travels as fragments with the `more` bit set on all but the last.
//! Layout ruling: docs/design.md § "velo's wire shapes, measured before shrinking".

mod decode;
mod encode;
mod types;

pub use decode::{BatchView, DecodeError, Record, RecordBody, Records};
pub use encode::{BatchEncoder, EncodeError};
pub use types::{CloseReason, Epoch, FrameSeq, Lane, RecordKind, SlotId};

/// The only protocol version this build speaks.
pub const VERSION: u8 = 1;
/// Bytes in a batch header.
pub const BATCH_HEADER_LEN: usize = 16;
/// Bytes in a record header.
pub const RECORD_HEADER_LEN: usize = 13;
/// Body length of an OpenSlot record (anchor id, session id).
pub const OPEN_BODY_LEN: usize = 16;
/// Body length of a CloseSlot record (reason).
pub const CLOSE_BODY_LEN: usize = 1;
/// Body length of a CreditUpdate or PeerCredit record (bytes granted).
pub const CREDIT_BODY_LEN: usize = 4;
/// Body length of a Ping or Pong record (nonce).
pub const PING_BODY_LEN: usize = 8;

/// Type-byte bit: this record is a fragment and more of it follows.
pub const TYPE_MORE: u8 = 0x80;
/// Type-byte bit reserved for future use; must be zero.
pub const TYPE_RESERVED: u8 = 0x40;
/// Mask of the kind bits in the type byte.
pub const TYPE_KIND_MASK: u8 = 0x3f;

/// Flags bits 0..4: the lane (a second QP per peer, later). Only lane 0 exists.
pub const FLAGS_LANE_MASK: u8 = 0x0f;
/// Flags bits 4..8: reserved for memory kinds (host, device) and future use.
pub const FLAGS_RESERVED_MASK: u8 = 0xf0;

#[cfg(test)]
mod tests;
