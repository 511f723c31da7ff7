//! One velo scenario, three qpmux nodes: mem (in process), TCP, and RDMA on
//! the soft RoCEv2 provider over loopback UDP (`rnr_retry = 0`).
//!
//! ```text
//!  async fn scenario<K: Kind>() ─ velo_kinds!(scenario) ─► mem::scenario, tcp::scenario, rdma::scenario
//! ```
//!
//! Each test binary uses a subset of these helpers.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use qpmux::link::bootstrap::ClusterKey;
use qpmux::link::mem::{MemConfig, MemFabric, MemNode};
use qpmux::link::rdma::{RdmaConfig, RdmaNodeConfig, RdmaTransport};
use qpmux::link::tcp::{TcpLinkConfig, TcpNodeConfig, TcpTransport};
use qpmux::link::{EpochEnd, Link, LinkFault, Node};
use qpmux::mux::{MuxConfig, PeerId};
use qpmux::velo::{QpmuxTransport, VeloConfig};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use velo::streaming::{StreamAnchor, StreamFrame};
use velo::{Handler, Velo};
use velo_ext::TransportErrorHandler;

/// Link shape: the defaults, or a few small buffers so that senders wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Default,
    Tight,
}

/// What a node is built with beyond its id.
#[derive(Clone, Default)]
pub struct Options {
    pub mux: MuxConfig,
    pub key: Option<ClusterKey>,
}

/// A kind of qpmux node: how to build one and how to kill its link.
#[allow(async_fn_in_trait)]
pub trait Kind: Sized + 'static {
    type Node: Node;

    /// An environment whose links have `shape`.
    fn new(shape: Shape) -> Self;

    /// Node `id` built with `options`.
    async fn node_with(&self, id: u64, options: Options) -> Arc<Self::Node>;

    /// Node `id` with the defaults.
    async fn node(&self, id: u64) -> Arc<Self::Node> {
        self.node_with(id, Options::default()).await
    }

    /// Ends the current link from `node` to `peer` as a transport fault
    /// would. False if there was none.
    fn kill(&self, node: &Self::Node, peer: PeerId) -> bool;

    /// True once `node`'s current link to `peer` has ended (or it has none).
    fn link_ended(&self, node: &Self::Node, peer: PeerId) -> bool;

    /// Asserts `node` saw no epoch die (and, on RDMA, no RNR NAK: with
    /// `rnr_retry = 0` one would have killed the epoch).
    fn assert_clean(&self, node: &Self::Node) {
        use qpmux::mux::MuxTransport;
        assert_eq!(node.mux().stats().epoch_deaths, 0);
    }
}

pub struct Mem {
    fabric: Arc<MemFabric>,
}

impl Kind for Mem {
    type Node = MemNode;

    fn new(shape: Shape) -> Mem {
        let config = match shape {
            Shape::Default => MemConfig::default(),
            Shape::Tight => MemConfig {
                credits: 2,
                max_batch: 4 * 1024,
                send_buffers: 2,
            },
        };
        Mem {
            fabric: MemFabric::new(config),
        }
    }

    async fn node_with(&self, id: u64, options: Options) -> Arc<MemNode> {
        Arc::new(self.fabric.node(PeerId(id), options.mux))
    }

    fn kill(&self, node: &MemNode, peer: PeerId) -> bool {
        self.fabric
            .kill(node.id(), peer, EpochEnd::Fault(LinkFault::Injected))
    }

    fn link_ended(&self, node: &MemNode, peer: PeerId) -> bool {
        self.fabric
            .link(node.id(), peer)
            .is_none_or(|link| link.is_ended())
    }
}

pub struct Tcp {
    shape: Shape,
}

impl Kind for Tcp {
    type Node = TcpTransport;

    fn new(shape: Shape) -> Tcp {
        Tcp { shape }
    }

    async fn node_with(&self, id: u64, options: Options) -> Arc<TcpTransport> {
        let mut config = TcpNodeConfig::new(PeerId(id));
        config.key = options.key;
        if self.shape == Shape::Tight {
            config.link = TcpLinkConfig {
                max_batch: 4 * 1024,
                send_buffers: 2,
                recv_batches: 2,
                ..TcpLinkConfig::default()
            };
        }
        let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        Arc::new(
            TcpTransport::bind(config, loopback, options.mux)
                .await
                .expect("tcp node on loopback"),
        )
    }

    fn kill(&self, node: &TcpTransport, peer: PeerId) -> bool {
        node.node()
            .link(peer)
            .map(|link| link.fail(EpochEnd::Fault(LinkFault::Injected)))
            .is_some()
    }

    fn link_ended(&self, node: &TcpTransport, peer: PeerId) -> bool {
        node.node().link(peer).is_none_or(|link| link.is_ended())
    }
}

pub type SoftRdma = RdmaTransport<SoftDevice>;

pub struct Rdma {
    shape: Shape,
}

impl Kind for Rdma {
    type Node = SoftRdma;

    fn new(shape: Shape) -> Rdma {
        Rdma { shape }
    }

    async fn node_with(&self, id: u64, options: Options) -> Arc<SoftRdma> {
        let device = SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("soft device on loopback");
        let rdma = match self.shape {
            Shape::Default => RdmaConfig::strict(),
            Shape::Tight => RdmaConfig {
                recv_depth: 8,
                max_batch: 4 * 1024,
                send_buffers: 2,
                ..RdmaConfig::strict()
            },
        };
        let config = RdmaNodeConfig {
            rdma,
            mux: options.mux,
            ..RdmaNodeConfig::new(PeerId(id))
        }
        .with_key(options.key);
        Arc::new(
            RdmaTransport::start(device, config)
                .await
                .expect("rdma node"),
        )
    }

    fn kill(&self, node: &SoftRdma, peer: PeerId) -> bool {
        node.node()
            .link(peer)
            .map(|link| link.fail(EpochEnd::Fault(LinkFault::Injected)))
            .is_some()
    }

    fn link_ended(&self, node: &SoftRdma, peer: PeerId) -> bool {
        node.node()
            .link(peer)
            .is_none_or(|link| link.end_reason().is_some())
    }

    fn assert_clean(&self, node: &SoftRdma) {
        use qpmux::mux::MuxTransport;
        assert_eq!(node.device().counters().rnr_naks_sent, 0);
        assert_eq!(node.mux().stats().epoch_deaths, 0);
    }
}

/// One `#[tokio::test]` per node kind for each generic `async fn name<K: Kind>()`:
/// `mem::name`, `tcp::name`, `rdma::name`.
macro_rules! velo_kinds {
    ($($scenario:ident),* $(,)?) => {
        velo_kinds!(@kind mem, Mem, $($scenario),*);
        velo_kinds!(@kind tcp, Tcp, $($scenario),*);
        velo_kinds!(@kind rdma, Rdma, $($scenario),*);
    };
    (@kind $module:ident, $kind:ident, $($scenario:ident),*) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario::<crate::velo_nodes::$kind>().await;
                }
            )*
        }
    };
}

pub type Qp<K> = Arc<QpmuxTransport<<K as Kind>::Node>>;

/// A velo instance whose only transport is qpmux on `node`.
pub async fn velo_on<N: Node>(node: Arc<N>, config: VeloConfig) -> (Velo, Arc<QpmuxTransport<N>>) {
    let transport = Arc::new(QpmuxTransport::new(node, config));
    let velo = Velo::builder()
        .add_transport(transport.clone())
        .build()
        .await
        .expect("velo builds over qpmux");
    (velo, transport)
}

/// A velo instance on a fresh node `id` of `kind`.
pub async fn velo<K: Kind>(kind: &K, id: u64, config: VeloConfig) -> (Velo, Qp<K>) {
    velo_on(kind.node(id).await, config).await
}

/// Registers each instance with the other.
pub fn join(a: &Velo, b: &Velo) {
    a.register_peer(b.peer_info()).expect("a registers b");
    b.register_peer(a.peer_info()).expect("b registers a");
}

/// Waits for `cond`, failing (not hanging) after a generous bound.
pub async fn until(label: &str, mut cond: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(30), async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("never reached: {label}"));
}

/// A unary handler that answers with the request's payload.
pub fn echo(name: &str) -> Handler {
    Handler::unary_handler(name, |ctx| Ok(Some(ctx.payload))).build()
}

/// One unary request from `client` to `server`'s handler `name`.
pub async fn unary(
    client: &Velo,
    server: &Velo,
    name: &str,
    payload: Bytes,
) -> anyhow::Result<Bytes> {
    client
        .unary(name)?
        .raw_payload(payload)
        .instance(server.instance_id())
        .timeout(Duration::from_secs(30))
        .send()
        .await
}

/// Counts the frames a transport reports through `on_error`.
#[derive(Default)]
pub struct Errors {
    count: AtomicUsize,
    pub last: Mutex<Option<String>>,
    /// Payloads reported so far; a second report of one is counted.
    seen: Mutex<std::collections::HashSet<Bytes>>,
    twice: AtomicUsize,
}

impl TransportErrorHandler for Errors {
    fn on_error(&self, _header: Bytes, payload: Bytes, error: String) {
        *self.last.lock().expect("lock") = Some(error);
        if !self.seen.lock().expect("lock").insert(payload) {
            self.twice.fetch_add(1, Ordering::SeqCst);
        }
        self.count.fetch_add(1, Ordering::SeqCst);
    }
}

impl Errors {
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Reports of a payload already reported (tests give each frame its own).
    pub fn twice(&self) -> usize {
        self.twice.load(Ordering::SeqCst)
    }

    /// What the last report said ("" before any).
    pub fn last_said(&self) -> String {
        self.last.lock().expect("lock").clone().unwrap_or_default()
    }

    /// The payloads reported so far.
    pub fn reported(&self) -> std::collections::HashSet<Bytes> {
        self.seen.lock().expect("lock").clone()
    }
}

/// Consumes a `u32` anchor stream up to its `Finalized`.
pub async fn collect(mut anchor: StreamAnchor<u32>) -> Vec<u32> {
    let mut items = Vec::new();
    while let Some(frame) = anchor.next().await {
        match frame.expect("no stream error") {
            StreamFrame::Item(v) => items.push(v),
            StreamFrame::Finalized => break,
            other => panic!("unexpected frame {other:?}"),
        }
    }
    items
}
