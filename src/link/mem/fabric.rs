//! An in-process network of muxes joined by mem links, for tests and benches.
//!
//! Each node's [`Dialer`] asks the fabric for a link; the fabric makes a
//! pair for the next epoch of that node pair and attaches one end to each mux.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::{MemConfig, MemLink, pair};
use crate::link::{EpochEnd, Link, Node, RegisterError};
use crate::mux::protocol::Epoch;
use crate::mux::{Dialer, Mux, MuxConfig, PeerId, PeerTerms};

#[derive(Default)]
struct Nodes {
    muxes: HashMap<PeerId, Mux<MemLink>>,
    links: HashMap<(PeerId, PeerId), MemLink>,
    epochs: HashMap<(PeerId, PeerId), Epoch>,
    /// `(me, peer)`: `me` unregistered `peer` and has not registered it
    /// again, so `me`'s dialer does not reach for it.
    forgotten: HashSet<(PeerId, PeerId)>,
}

/// Muxes by node id, and the mem link currently joining each pair.
pub struct MemFabric {
    config: MemConfig,
    nodes: Mutex<Nodes>,
}

impl MemFabric {
    /// An empty fabric whose links have `config`'s shape.
    pub fn new(config: MemConfig) -> Arc<MemFabric> {
        Arc::new(MemFabric {
            config,
            nodes: Mutex::new(Nodes::default()),
        })
    }

    fn nodes(&self) -> MutexGuard<'_, Nodes> {
        self.nodes.lock().expect("fabric state poisoned")
    }

    /// The dialer node `me` should give its mux.
    pub fn dialer(self: &Arc<Self>, me: PeerId) -> Arc<dyn Dialer> {
        Arc::new(FabricDialer {
            fabric: Arc::downgrade(self),
            me,
        })
    }

    /// Adds node `me`'s mux to the fabric.
    pub fn add(&self, me: PeerId, mux: Mux<MemLink>) {
        self.nodes().muxes.insert(me, mux);
    }

    /// Joins `a` and `b` with a fresh link unless a live one exists; returns
    /// the new epoch.
    pub fn connect(&self, a: PeerId, b: PeerId) -> Option<Epoch> {
        let pair_key = if a < b { (a, b) } else { (b, a) };
        let mut nodes = self.nodes();
        if nodes.links.get(&pair_key).is_some_and(|l| !l.is_ended()) {
            return None;
        }
        let (mux_a, mux_b) = (nodes.muxes.get(&a)?.clone(), nodes.muxes.get(&b)?.clone());
        let epoch = nodes
            .epochs
            .get(&pair_key)
            .copied()
            .unwrap_or_default()
            .next();
        nodes.epochs.insert(pair_key, epoch);
        let (end_a, end_b) = pair(epoch, self.config);
        nodes.links.insert(pair_key, end_a.clone());
        drop(nodes);
        // Each side learns the other's windows and the credit it starts
        // with, as a node's hello tells it.
        let (room_for_b, room_for_a) = (mux_a.peer_room(b), mux_b.peer_room(a));
        let terms_of = |mux: &Mux<MemLink>, peer_credit| PeerTerms {
            peer_credit,
            ..PeerTerms::announced_by(mux.config())
        };
        mux_a.attach_with_terms(b, end_a, terms_of(&mux_b, room_for_a), room_for_b);
        mux_b.attach_with_terms(a, end_b, terms_of(&mux_a, room_for_b), room_for_a);
        Some(epoch)
    }

    /// What node `me`'s dialer asks for: a link to `peer`, unless `me`
    /// forgot it ([`Node::unregister`]). `peer` may still reach `me`.
    fn dial(&self, me: PeerId, peer: PeerId) {
        if !self.nodes().forgotten.contains(&(me, peer)) {
            self.connect(me, peer);
        }
    }

    /// Ends the current link between `a` and `b` with `reason` (seen by `a`).
    pub fn kill(&self, a: PeerId, b: PeerId, reason: EpochEnd) -> bool {
        let pair_key = if a < b { (a, b) } else { (b, a) };
        match self.nodes().links.get(&pair_key) {
            Some(link) if !link.is_ended() => {
                link.fail(reason);
                true
            }
            _ => false,
        }
    }

    /// Creates node `me` with its own mux, joined to this fabric.
    pub fn node(self: &Arc<Self>, me: PeerId, config: MuxConfig) -> MemNode {
        let mux = Mux::new(config, self.dialer(me));
        self.add(me, mux.clone());
        MemNode {
            fabric: self.clone(),
            me,
            mux,
        }
    }

    /// The current link between `a` and `b`, if any (for credit checks).
    pub fn link(&self, a: PeerId, b: PeerId) -> Option<MemLink> {
        let pair_key = if a < b { (a, b) } else { (b, a) };
        self.nodes().links.get(&pair_key).cloned()
    }
}

struct FabricDialer {
    fabric: Weak<MemFabric>,
    me: PeerId,
}

impl Dialer for FabricDialer {
    fn want_link(&self, peer: PeerId) {
        if let Some(fabric) = self.fabric.upgrade() {
            fabric.dial(self.me, peer);
        }
    }
}

/// A node on a [`MemFabric`]; its address is its id.
pub struct MemNode {
    fabric: Arc<MemFabric>,
    me: PeerId,
    mux: Mux<MemLink>,
}

impl MemNode {
    /// This node's id.
    pub fn id(&self) -> PeerId {
        self.me
    }
}

impl Node for MemNode {
    type Link = MemLink;

    fn mux(&self) -> &Mux<MemLink> {
        &self.mux
    }

    fn address(&self) -> Vec<u8> {
        self.me.0.to_be_bytes().to_vec()
    }

    fn register(&self, address: &[u8]) -> Result<PeerId, RegisterError> {
        let raw: [u8; 8] = address
            .try_into()
            .map_err(|_| RegisterError::Malformed { len: address.len() })?;
        let peer = PeerId(u64::from_be_bytes(raw));
        if peer == self.me {
            return Err(RegisterError::Own);
        }
        self.fabric.nodes().forgotten.remove(&(self.me, peer));
        Ok(peer)
    }

    fn unregister(&self, peer: PeerId) {
        self.fabric.nodes().forgotten.insert((self.me, peer));
        self.fabric.kill(self.me, peer, EpochEnd::Closed);
        self.mux.forget_peer(peer);
    }

    fn shutdown(&self) {
        self.mux.shutdown();
    }
}
