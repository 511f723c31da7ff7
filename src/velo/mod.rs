//! The velo plug-in: qpmux under velo's runtime, over any [`Node`].
//!
//! ```text
//!  velo Messenger ── Transport ──► QpmuxTransport ──► Node::mux() message class (active messages)
//!  velo AnchorManager ── FrameTransport ──► QpmuxFrameTransport ──► Node::mux() slots (streams)
//!  velo WorkerAddress { "qpmux-rc": Node::address() } ──► Node::register ──► PeerId
//! ```
//!
//! Adapters with no logic of their own: [`QpmuxTransport`] implements
//! `velo_ext::Transport`, [`QpmuxFrameTransport`] implements
//! `velo_ext::FrameTransport`; both implement [`AsMux`](crate::mux::AsMux).
//! Every failure is an [`AdapterError`], and it becomes velo's
//! `TransportError` in one `From` impl. Wiring and rulings: docs/velo.md.
//!
//! [`Node`]: crate::link::Node

mod fate;
mod stream;
mod transport;
pub mod wire;

use std::collections::HashMap;
use std::time::Duration;

use thiserror::Error;
use velo_ext::{InstanceId, TransportError, WorkerAddress};

pub use stream::{QpmuxFrameTransport, velo_frames};
pub use transport::QpmuxTransport;

use crate::link::RegisterError;
use crate::mux::MuxConfig;

/// The key qpmux publishes its node address under in velo's `WorkerAddress`
/// (does not collide with `tcp`, `tcp-stream`, `ucx`, `messenger-mux-v2`).
pub const TRANSPORT_KEY: &str = "qpmux-rc";

/// Knobs of the velo adapters. Defaults are documented per field.
#[derive(Clone, Debug)]
pub struct VeloConfig {
    /// Capacity of one peer's outbound message channel (per epoch), in
    /// messages; past it, sends queue in velo's admission gate. Default 256.
    pub message_channel: usize,
    /// Largest `header + payload` of one active message: the node's
    /// `MuxConfig::max_record` minus [`wire::OVERHEAD`] (a longer one is a
    /// protocol violation at the receiver). [`VeloConfig::for_mux`] derives
    /// it; the default is 16 MiB − 6, the mux default's limit. To a peer
    /// whose hello said it takes smaller records, the smaller limit
    /// (`Transport::max_message_size` says which, per target).
    pub max_message_size: usize,
    /// Longest `Transport::closed` waits for the mux's peer tasks. Default 1 s.
    pub close_wait: Duration,
    /// Capacity of the channel between a stream's slot and velo, in frames.
    /// Default 64.
    pub stream_channel: usize,
    /// Bytes of a bound stream's frames that may wait in the channel to
    /// velo: taking a frame from the slot returns its credit, so what waits
    /// there is outside the mux's windows. At or past it the pump leaves
    /// frames in the slot until velo takes some; the frame that reaches it
    /// goes, so the channel holds less than this plus one frame (one frame
    /// at a time at 0). Default 4 MiB, 64 frames of 64 KiB. velo's anchors
    /// drain this channel into one of their own (256 frames), which this
    /// limit does not cover (docs/velo.md § "A pump per slot").
    pub stream_channel_bytes: usize,
    /// How often dead lanes (epochs that ended with no send since) are
    /// retired, which reports any frame left in their channel. Default 20 ms;
    /// at least [`MIN_PERIOD`].
    pub lane_sweep: Duration,
    /// How long frames queued for a peer wait for an epoch when none is up
    /// (the node keeps redialing a refused or misconfigured peer forever);
    /// then they are reported through `on_error`, and the next send waits
    /// afresh. Default 10 s, two of the nodes' default handshake timeouts.
    /// A dial no redial mends (the peer runs another transport, or an
    /// incompatible endpoint) that ends after their lane was made reports
    /// them sooner, at the next sweep (a lane made while the node backs off
    /// from such a failure waits for its retry).
    pub dial_wait: Duration,
    /// How often a bound stream with no frame to hand over looks whether
    /// velo still holds its receiver: velo may abandon a bind whose sender
    /// never comes, and the pump and the mux's registry entry go with it.
    /// Default 1 s; at least [`MIN_PERIOD`].
    pub stream_watch: Duration,
}

/// The shortest `lane_sweep` and `stream_watch` the adapter runs on: a
/// zero would spin the sweep and panic every pump's timer.
pub const MIN_PERIOD: Duration = Duration::from_millis(1);

impl Default for VeloConfig {
    fn default() -> Self {
        VeloConfig::for_mux(&MuxConfig::default())
    }
}

impl VeloConfig {
    /// The defaults, with `max_message_size` the largest message a mux
    /// built with `mux` (the node's config) accepts.
    pub fn for_mux(mux: &MuxConfig) -> VeloConfig {
        VeloConfig {
            message_channel: 256,
            max_message_size: mux.max_record.saturating_sub(wire::OVERHEAD),
            close_wait: Duration::from_secs(1),
            stream_channel: 64,
            stream_channel_bytes: 4 * 1024 * 1024,
            lane_sweep: Duration::from_millis(20),
            dial_wait: Duration::from_secs(10),
            stream_watch: Duration::from_secs(1),
        }
    }

    /// This config with its periods raised to [`MIN_PERIOD`] and
    /// `max_message_size` cut to what the envelope's 32-bit header length
    /// can describe (above it, encoding a message would panic).
    fn in_range(self) -> VeloConfig {
        VeloConfig {
            lane_sweep: self.lane_sweep.max(MIN_PERIOD),
            stream_watch: self.stream_watch.max(MIN_PERIOD),
            max_message_size: self.max_message_size.min(u32::MAX as usize),
            ..self
        }
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;

    /// Both periods a transport runs on are floored (`stream_watch` is also
    /// checked end to end in `velo_frames`; `lane_sweep` drives a loop that
    /// would spin at zero).
    #[test]
    fn zero_periods_are_raised_to_the_floor_and_others_kept() {
        let zero = VeloConfig {
            lane_sweep: Duration::ZERO,
            stream_watch: Duration::ZERO,
            ..VeloConfig::default()
        }
        .in_range();
        assert_eq!(
            (zero.lane_sweep, zero.stream_watch),
            (MIN_PERIOD, MIN_PERIOD)
        );
        let default = VeloConfig::default();
        let kept = default.clone().in_range();
        assert_eq!(
            (kept.lane_sweep, kept.stream_watch, kept.max_message_size),
            (
                default.lane_sweep,
                default.stream_watch,
                default.max_message_size
            )
        );
    }

    /// A message size the envelope cannot describe is cut to what it can
    /// (review 48a: past it, encoding a header panicked).
    #[test]
    fn a_message_size_past_the_envelopes_length_field_is_cut_to_it() {
        let huge = VeloConfig {
            max_message_size: usize::MAX,
            ..VeloConfig::default()
        }
        .in_range();
        assert_eq!(huge.max_message_size, u32::MAX as usize);
    }
}

/// Why an adapter operation failed.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum AdapterError {
    /// The peer's `WorkerAddress` has no `qpmux-rc` entry (velo falls back
    /// to its next transport).
    #[error("peer has no {TRANSPORT_KEY} endpoint")]
    NoEndpoint,
    /// The peer's `WorkerAddress` does not decode.
    #[error("peer's worker address does not decode")]
    BadAddress,
    /// The node refused the endpoint.
    #[error(transparent)]
    Register(RegisterError),
    /// The instance was never registered (or was unregistered).
    #[error("peer {0} is not registered with qpmux")]
    UnknownPeer(InstanceId),
    /// A velo worker id that no registered peer has.
    #[error("worker {0} is not registered with qpmux")]
    UnknownWorker(u64),
    /// `header + payload` exceeds `max_message_size`, or the smaller limit
    /// of the peer it is for.
    #[error("frame of {len} bytes exceeds qpmux's {max}-byte maximum")]
    TooLarge {
        /// `header.len() + payload.len()`.
        len: usize,
        /// The maximum toward that peer.
        max: usize,
    },
    /// Sent before `start`.
    #[error("qpmux transport not started")]
    NotStarted,
    /// `start` ran twice.
    #[error("qpmux transport already started")]
    AlreadyStarted,
    /// The node's mux already has a message sink (one transport per node).
    #[error("the node's message sink is taken by another transport")]
    SinkTaken,
    /// Sent after `shutdown`.
    #[error("qpmux transport is shut down")]
    ShutDown,
    /// The message was never written: its epoch ended, no epoch reached the
    /// peer within `dial_wait`, or the peer was unregistered or shut down.
    #[error("qpmux did not write the message (epoch ended, peer unreachable, or peer gone)")]
    NotWritten,
    /// The mux refused the stream.
    #[error(transparent)]
    Mux(#[from] crate::mux::MuxError),
}

/// The one mapping into velo's error type. Only `register` returns a
/// `TransportError`; send-path errors reach velo as `on_error` text and
/// FrameTransport errors as `anyhow`, so the last arm is a catch-up for
/// variants velo has no word for.
impl From<AdapterError> for TransportError {
    fn from(error: AdapterError) -> TransportError {
        match error {
            AdapterError::NoEndpoint => TransportError::NoEndpoint,
            AdapterError::BadAddress | AdapterError::Register(_) => TransportError::InvalidEndpoint,
            AdapterError::UnknownPeer(instance) => TransportError::PeerNotRegistered(instance),
            AdapterError::NotStarted
            | AdapterError::AlreadyStarted
            | AdapterError::SinkTaken
            | AdapterError::ShutDown => TransportError::NotStarted,
            AdapterError::UnknownWorker(_)
            | AdapterError::TooLarge { .. }
            | AdapterError::NotWritten
            | AdapterError::Mux(_) => TransportError::NoResponders,
        }
    }
}

/// `{ "qpmux-rc": address }` as velo's MessagePack map.
fn encode_address(address: &[u8]) -> WorkerAddress {
    let map: HashMap<String, Vec<u8>> =
        HashMap::from([(TRANSPORT_KEY.to_owned(), address.to_vec())]);
    let encoded = rmp_serde::to_vec(&map).expect("a string-to-bytes map always encodes");
    WorkerAddress::from_encoded(encoded)
}

/// The node address a peer published under our key.
fn decode_endpoint(address: &WorkerAddress) -> Result<bytes::Bytes, AdapterError> {
    address
        .get_entry(TRANSPORT_KEY)
        .map_err(|_| AdapterError::BadAddress)?
        .ok_or(AdapterError::NoEndpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_round_trips_under_our_key_only() {
        let address = encode_address(&[0, 0, 0, 0, 0, 0, 0, 7]);
        assert_eq!(
            decode_endpoint(&address).expect("our key"),
            bytes::Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 7])
        );
        let other: HashMap<String, Vec<u8>> = HashMap::from([("tcp".to_owned(), vec![1, 2])]);
        let other = WorkerAddress::from_encoded(rmp_serde::to_vec(&other).expect("encodes"));
        assert_eq!(decode_endpoint(&other), Err(AdapterError::NoEndpoint));
    }
}
