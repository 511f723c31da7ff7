//! The transport-agnostic slot mux: many streams to one peer over one [`Link`].
//!
//! ```text
//!  SlotSender::send ─► inlet (per slot, byte budget) ─┐
//!                                                     ├─► peer task ─ encode in place ─► Link::post
//!  SlotReceiver::recv ◄─ rx queue (per slot, window) ◄┘        ▲
//!                                   consumer drains ─► grants ─┘ (coalesced, ride the next batch)
//! ```
//!
//! One task per peer owns that peer's slot tables (both directions) and the
//! epoch's [`Link`]; producers, consumers and the transport reach it only
//! through coalesced per-slot state and one wake-up. [`protocol`] is the wire
//! format; [`surface`] the typed API velo's design record asks for.
//!
//! [`Link`]: crate::link::Link

mod config;
pub(crate) mod engine;
mod message;
pub mod protocol;
mod slot;
mod stats;
pub mod surface;

pub use config::{FlushPolicy, MuxConfig, MuxConfigError, PeerTerms};
pub use engine::{Dialer, EpochLosses, Mux, ProtocolError};
pub use message::{MessageSink, OnFail, OutboundMessage};
pub use protocol::{CloseReason, Epoch};
pub use slot::{RECORD_OVERHEAD, RecvError, SendError, SlotReceiver, SlotSender};
pub use stats::{DropCounts, RECONNECT_BUCKETS_US, ReconnectTimes, Stats};
pub use surface::{
    AnchorId, AsMux, DropReason, Frame, MuxError, MuxTransport, PeerId, SessionId, StreamKey,
    Terminal,
};

#[doc(hidden)]
pub use engine::fuzzing;
