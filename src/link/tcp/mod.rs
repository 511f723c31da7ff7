//! The TCP link: one TCP connection per peer per epoch, the mux's baseline.
//!
//! ```text
//!  TcpNode ── listener ──┐                      ┌── mux.attach(peer, TcpLink)
//!          ── dialer ────┴─► bootstrap handshake ┤
//!                           (link::bootstrap)   └── epoch = max(proposals) + 1
//!  TcpLink: writer task (coalescing writev, TCP_NODELAY) + reader task (bounded)
//! ```
//!
//! Every connection starts with the sans-IO [`bootstrap`](crate::link::bootstrap)
//! handshake; what follows is `len: u32 BE | batch` frames until the epoch
//! ends. A socket error or EOF ends the epoch; the next epoch is a new
//! connection. The connector ([`TcpNode`]) is the mux's [`Dialer`](crate::mux::Dialer).

mod link;
mod node;
mod transport;

pub use crate::link::ReadOutBudget;
pub(crate) use link::configure;
pub use link::{TcpBatch, TcpLink, TcpLinkConfig, TcpLinkStats, TcpSendBuf};
pub use node::{
    ConnectError, Connector, ConnectorConfig, DialFailure, EpochMaker, MAX_ACCEPTS_PER_PEER,
    MAX_BACKOFF, NodeStats, TcpEpochs, TcpNode, TcpNodeConfig,
};
pub use transport::TcpTransport;
