//! `TcpTransport`: a [`TcpNode`] and its mux as one [`Node`].

use std::io;
use std::net::SocketAddr;

use super::{TcpLink, TcpNode, TcpNodeConfig};
use crate::link::{EpochEnd, Link, Node, RegisterError, address};
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
        address::encode(self.node.id(), self.node.local_addr())
    }

    fn register(&self, blob: &[u8]) -> Result<PeerId, RegisterError> {
        let (peer, addr) = address::decode(blob)?;
        if peer == self.node.id() {
            return Err(RegisterError::Own);
        }
        self.node.register(peer, addr);
        Ok(peer)
    }

    fn unregister(&self, peer: PeerId) {
        if let Some(link) = self.node.link(peer) {
            link.fail(EpochEnd::Closed);
        }
    }

    fn shutdown(&self) {
        // The mux drains and says goodbye on the live links first; the
        // listener and any link left stop once it has closed.
        self.mux.shutdown();
        let (node, mux) = (self.node.clone(), self.mux.clone());
        tokio::spawn(async move {
            mux.closed().await;
            node.shutdown();
        });
    }
}
