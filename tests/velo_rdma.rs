//! Real velo instances over the RDMA node: the soft RoCEv2 provider on
//! loopback UDP, bootstrapped over TCP, `rnr_retry = 0`.
#![cfg(feature = "velo")]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use qpmux::link::Node;
use qpmux::link::rdma::{RdmaConfig, RdmaNodeConfig, RdmaTransport};
use qpmux::mux::{MuxTransport, PeerId};
use qpmux::velo::{QpmuxTransport, VeloConfig};
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use velo::streaming::StreamFrame;
use velo::{Handler, Velo};

type Rdma = RdmaTransport<SoftDevice>;

async fn instance(id: u64) -> (Velo, Arc<Rdma>) {
    let device = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback");
    let config = RdmaNodeConfig {
        rdma: RdmaConfig::strict(),
        ..RdmaNodeConfig::new(PeerId(id))
    };
    let node = Arc::new(
        RdmaTransport::start(device, config)
            .await
            .expect("rdma node"),
    );
    let transport = Arc::new(QpmuxTransport::new(node.clone(), VeloConfig::default()));
    let velo = Velo::builder()
        .add_transport(transport)
        .build()
        .await
        .expect("velo builds over qpmux rdma");
    (velo, node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn velo_unary_and_a_ten_thousand_item_stream_over_the_rdma_node() {
    let (server, server_node) = instance(1).await;
    let (client, client_node) = instance(2).await;
    client
        .register_peer(server.peer_info())
        .expect("client registers server");
    server
        .register_peer(client.peer_info())
        .expect("server registers client");
    assert_eq!(
        client
            .primary_transport_key(server.instance_id())
            .as_deref(),
        Some("qpmux-rc")
    );

    server
        .register_handler(Handler::unary_handler("echo", |ctx| Ok(Some(ctx.payload))).build())
        .expect("register echo");
    client
        .wait_for_handler(server.instance_id(), "echo")
        .await
        .expect("echo visible");
    let big: Bytes = (0..600 * 1024)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    let back = client
        .unary("echo")
        .expect("builder")
        .raw_payload(big.clone())
        .instance(server.instance_id())
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("600 KiB echo over RDMA");
    assert_eq!(back, big);

    let mut anchor = server.create_anchor::<u32>();
    let sender = client
        .attach_anchor::<u32>(anchor.handle())
        .await
        .expect("remote attach over qpmux rdma");
    let produce = tokio::spawn(async move {
        for i in 0..10_000u32 {
            sender.send(i).await.expect("send item");
        }
        sender.finalize().expect("finalize");
    });
    let mut items = Vec::with_capacity(10_000);
    while let Some(frame) = anchor.next().await {
        match frame.expect("no stream error") {
            StreamFrame::Item(v) => items.push(v),
            StreamFrame::Finalized => break,
            other => panic!("unexpected frame {other:?}"),
        }
    }
    produce.await.expect("producer");
    assert_eq!(items, (0..10_000).collect::<Vec<_>>());
    // Credit held: with rnr_retry = 0 a single RNR would have killed the epoch.
    for node in [&server_node, &client_node] {
        assert_eq!(node.device().counters().rnr_naks_sent, 0);
        assert_eq!(node.mux().stats().epoch_deaths, 0);
    }
}
