//! `TcpTransport`: a [`TcpNode`] and its mux as one [`Node`].

use std::io;
use std::net::SocketAddr;

use super::{DialFailure, TcpLink, TcpNode, TcpNodeConfig};
use crate::link::{Node, RegisterError};
use crate::mux::{Mux, MuxConfig, PeerId};

/// The mux over TCP links: the baseline the RDMA transport is measured against.
pub struct TcpTransport {
    node: TcpNode,
    mux: Mux<TcpLink>,
}

impl TcpTransport {
    /// Binds on `addr` (port 0 picks one) and creates the mux.
    pub async fn bind(
        config: TcpNodeConfig,
        addr: SocketAddr,
        mux_config: MuxConfig,
    ) -> io::Result<TcpTransport> {
        let (node, mux) = TcpNode::start(config, addr, mux_config).await?;
        Ok(TcpTransport { node, mux })
    }

    /// The connector, for its counters and test hooks.
    pub fn node(&self) -> &TcpNode {
        &self.node
    }
}

impl Node for TcpTransport {
    type Link = TcpLink;

    fn mux(&self) -> &Mux<TcpLink> {
        &self.mux
    }

    fn address(&self) -> Vec<u8> {
        self.node.address_blob()
    }

    fn register(&self, blob: &[u8]) -> Result<PeerId, RegisterError> {
        self.node.register_blob(blob)
    }

    fn unregister(&self, peer: PeerId) {
        self.node.forget(peer);
    }

    fn shutdown(&self) {
        self.node.shutdown_after(&self.mux);
    }

    fn last_dial_failure(&self, peer: PeerId) -> Option<DialFailure> {
        self.node.last_dial_failure(peer)
    }
}
