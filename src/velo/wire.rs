//! The one message body an active message travels in over the mux's message
//! class: velo's `(message_type, header, payload)` triple, framed so the
//! header keeps its boundary.
//!
//! ```text
//!  [u8 version = 1][u8 message_type][u32 header_len, big-endian][header][payload]
//! ```
//!
//! [`Envelope::decode`] validates every field before it slices, so hostile
//! bytes produce an [`EnvelopeError`], never a panic.

use bytes::{BufMut, Bytes, BytesMut};
use thiserror::Error;
use velo_ext::MessageType;

/// The envelope format this build writes and accepts.
pub const VERSION: u8 = 1;
/// Bytes the envelope adds to `header.len() + payload.len()`.
pub const OVERHEAD: usize = 6;

mod field {
    use std::ops::Range;
    pub const VERSION: usize = 0;
    pub const TYPE: usize = 1;
    pub const HEADER_LEN: Range<usize> = 2..6;
}

/// A decoded active message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// velo's frame type.
    pub message_type: MessageType,
    /// velo's header, untouched.
    pub header: Bytes,
    /// velo's payload, untouched.
    pub payload: Bytes,
}

/// Why an inbound body is not a valid envelope (one variant per violation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum EnvelopeError {
    /// Shorter than the fixed prefix.
    #[error("body of {len} bytes is shorter than the {OVERHEAD}-byte prefix")]
    Truncated {
        /// The body length.
        len: usize,
    },
    /// A version this build does not speak.
    #[error("unknown envelope version {0}")]
    Version(u8),
    /// Not one of velo's message types.
    #[error("unknown message type {0}")]
    MessageType(u8),
    /// The header length runs past the end of the body.
    #[error("header length {header_len} exceeds the {available} bytes after the prefix")]
    HeaderLength {
        /// The claimed header length.
        header_len: u32,
        /// Bytes present after the prefix.
        available: usize,
    },
}

impl Envelope {
    /// Encodes `(message_type, header, payload)` into one body (one copy).
    pub fn encode(message_type: MessageType, header: &[u8], payload: &[u8]) -> Bytes {
        let header_len = u32::try_from(header.len())
            .expect("header length fits u32 (bounded by max_message_size)");
        let mut body = BytesMut::with_capacity(OVERHEAD + header.len() + payload.len());
        body.put_u8(VERSION);
        body.put_u8(message_type.as_u8());
        body.put_u32(header_len);
        body.put_slice(header);
        body.put_slice(payload);
        body.freeze()
    }

    /// Validates and splits a body without copying.
    pub fn decode(body: Bytes) -> Result<Envelope, EnvelopeError> {
        if body.len() < OVERHEAD {
            return Err(EnvelopeError::Truncated { len: body.len() });
        }
        let version = body[field::VERSION];
        if version != VERSION {
            return Err(EnvelopeError::Version(version));
        }
        let raw_type = body[field::TYPE];
        let message_type =
            MessageType::from_u8(raw_type).ok_or(EnvelopeError::MessageType(raw_type))?;
        let mut len_bytes = [0u8; 4];
        len_bytes.copy_from_slice(&body[field::HEADER_LEN]);
        let header_len = u32::from_be_bytes(len_bytes);
        let available = body.len() - OVERHEAD;
        let header_end = usize::try_from(header_len)
            .ok()
            .filter(|&len| len <= available)
            .ok_or(EnvelopeError::HeaderLength {
                header_len,
                available,
            })?
            + OVERHEAD;
        Ok(Envelope {
            message_type,
            header: body.slice(OVERHEAD..header_end),
            payload: body.slice(header_end..),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answer_bytes() {
        let body = Envelope::encode(MessageType::Response, b"hd", b"xyz");
        assert_eq!(&body[..], &[1, 1, 0, 0, 0, 2, b'h', b'd', b'x', b'y', b'z']);
        let env = Envelope::decode(body).expect("valid");
        assert_eq!(env.message_type, MessageType::Response);
        assert_eq!(&env.header[..], b"hd");
        assert_eq!(&env.payload[..], b"xyz");
    }

    #[test]
    fn every_message_type_round_trips_with_empty_parts() {
        for raw in 0..=4u8 {
            let ty = MessageType::from_u8(raw).expect("valid type");
            let env = Envelope::decode(Envelope::encode(ty, b"", b"")).expect("valid");
            assert_eq!(env.message_type, ty);
            assert!(env.header.is_empty() && env.payload.is_empty());
        }
    }

    #[test]
    fn hostile_bodies_are_errors() {
        let bad = |b: &[u8]| Envelope::decode(Bytes::copy_from_slice(b));
        assert_eq!(bad(&[1, 0, 0]), Err(EnvelopeError::Truncated { len: 3 }));
        assert_eq!(bad(&[9, 0, 0, 0, 0, 0]), Err(EnvelopeError::Version(9)));
        assert_eq!(bad(&[1, 5, 0, 0, 0, 0]), Err(EnvelopeError::MessageType(5)));
        assert_eq!(
            bad(&[1, 0, 0xff, 0xff, 0xff, 0xff, 1]),
            Err(EnvelopeError::HeaderLength {
                header_len: u32::MAX,
                available: 1
            })
        );
    }

    #[test]
    fn decode_never_panics_on_any_short_body() {
        for len in 0..12usize {
            for fill in [0u8, 1, 4, 0xa5, 0xff] {
                let mut body = vec![fill; len];
                if len > 0 {
                    body[0] = VERSION;
                }
                if let Ok(env) = Envelope::decode(Bytes::from(body)) {
                    assert!(env.header.len() + env.payload.len() + OVERHEAD == len);
                }
            }
        }
    }
}
