//! Real velo instances over qpmux in one process, on every node kind (mem,
//! TCP, RDMA on the soft provider): `mem::…`, `tcp::…`, `rdma::…`.
#![cfg(feature = "velo")]

#[macro_use]
#[path = "common/velo_nodes.rs"]
mod velo_nodes;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use qpmux::mux::{AsMux, PeerId};
use qpmux::velo::VeloConfig;
use velo::{Handler, Velo};
use velo_nodes::{Kind, Shape, collect, echo, join, unary, until, velo, velo_on};

velo_kinds!(
    an_active_message_a_unary_echo_and_a_600k_unary,
    eleven_hundred_messages_arrive_in_order_through_a_saturated_gate,
    ten_thousand_item_anchor_stream_over_velos_messenger_mux,
    a_link_killed_under_a_messenger_mux_stream_ends_it_without_a_hole,
    a_killed_link_leaves_the_survivor_working_with_a_third_instance,
    draining_refuses_new_messages_and_finishes_the_ones_in_flight,
    a_peer_with_only_tcp_is_reached_through_the_fallback,
);

async fn an_active_message_a_unary_echo_and_a_600k_unary<K: Kind>() {
    let kind = K::new(Shape::Default);
    let (server, _) = velo(&kind, 1, VeloConfig::default()).await;
    let (client, qp) = velo(&kind, 2, VeloConfig::default()).await;
    join(&client, &server);
    assert_eq!(
        client
            .primary_transport_key(server.instance_id())
            .as_deref(),
        Some("qpmux-rc")
    );

    let (seen_tx, seen_rx) = flume::unbounded();
    server
        .register_handler(
            Handler::am_handler("note", move |ctx| {
                seen_tx.send(ctx.payload).expect("test holds the receiver");
                Ok(())
            })
            .build(),
        )
        .expect("register note");
    server
        .register_handler(echo("echo"))
        .expect("register echo");
    client
        .wait_for_handler(server.instance_id(), "note")
        .await
        .expect("note visible");

    client
        .am_send("note")
        .expect("am builder")
        .raw_payload(Bytes::from_static(b"hello qpmux"))
        .instance(server.instance_id())
        .send()
        .await
        .expect("am admitted");
    assert_eq!(
        seen_rx.recv_async().await.expect("delivered"),
        Bytes::from_static(b"hello qpmux")
    );

    let small = unary(&client, &server, "echo", Bytes::from_static(b"ping")).await;
    assert_eq!(small.expect("echo"), Bytes::from_static(b"ping"));

    let big: Bytes = (0..600 * 1024)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    let back = unary(&client, &server, "echo", big.clone())
        .await
        .expect("600 KiB echo");
    assert_eq!(back, big);
    // Both directions rode the mux message class.
    assert!(qp.as_mux().expect("mux surface").epoch(PeerId(1)).is_some());
    kind.assert_clean(qp.node());
}

async fn eleven_hundred_messages_arrive_in_order_through_a_saturated_gate<K: Kind>() {
    const N: u32 = 1_100;
    let kind = K::new(Shape::Tight);
    let tiny = VeloConfig {
        message_channel: 2,
        ..VeloConfig::default()
    };
    let (server, _) = velo(&kind, 1, VeloConfig::default()).await;
    let (client, _) = velo(&kind, 2, tiny).await;
    join(&client, &server);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    server
        .register_handler(
            Handler::am_handler("seq", move |ctx| {
                let raw: [u8; 4] = ctx.payload.as_ref().try_into().expect("4-byte payload");
                sink.lock().expect("lock").push(u32::from_le_bytes(raw));
                Ok(())
            })
            .ordered()
            .build(),
        )
        .expect("register seq");
    client
        .wait_for_handler(server.instance_id(), "seq")
        .await
        .expect("seq visible");
    for seq in 0..N {
        client
            .am_send("seq")
            .expect("am builder")
            .raw_payload(Bytes::copy_from_slice(&seq.to_le_bytes()))
            .instance(server.instance_id())
            .send()
            .await
            .expect("admitted");
    }
    until("all messages handled", || {
        seen.lock().expect("lock").len() == N as usize
    })
    .await;
    assert_eq!(*seen.lock().expect("lock"), (0..N).collect::<Vec<_>>());
}

async fn ten_thousand_item_anchor_stream_over_velos_messenger_mux<K: Kind>() {
    let kind = K::new(Shape::Default);
    let (consumer, consumer_qp) = velo(&kind, 1, VeloConfig::default()).await;
    let (producer, producer_qp) = velo(&kind, 2, VeloConfig::default()).await;
    join(&producer, &consumer);
    let anchor = consumer.create_anchor::<u32>();
    let sender = producer
        .attach_anchor::<u32>(anchor.handle())
        .await
        .expect("remote attach over qpmux");
    let produce = tokio::spawn(async move {
        for i in 0..10_000u32 {
            sender.send(i).await.expect("send item");
        }
        sender.finalize().expect("finalize");
    });
    let items = collect(anchor).await;
    produce.await.expect("producer");
    assert_eq!(items, (0..10_000).collect::<Vec<_>>());
    // velo's messenger mux grants a slot 32 records of credit, so 10,000
    // items took at least 10,000 / 32 qpmux messages; velo's per-stream TCP
    // path (its fallback) would have left qpmux nearly idle.
    let stats = consumer_qp.as_mux().expect("mux").stats();
    assert!(stats.records_received >= 10_000 / 32, "{stats:?}");
    kind.assert_clean(consumer_qp.node());
    kind.assert_clean(producer_qp.node());
}

/// qpmux redials at once, so the ping in velo's next health probe is
/// answered; the batches that died with the link must still end velo's
/// epoch (the check says `ConnectionFailed`), or the stream goes on with a
/// hole where they were.
async fn a_link_killed_under_a_messenger_mux_stream_ends_it_without_a_hole<K: Kind>() {
    let kind = K::new(Shape::Default);
    let (consumer, _) = velo(&kind, 1, VeloConfig::default()).await;
    let (producer, producer_qp) = velo(&kind, 2, VeloConfig::default()).await;
    join(&producer, &consumer);
    let mut anchor = consumer.create_anchor::<u32>();
    let sender = producer
        .attach_anchor::<u32>(anchor.handle())
        .await
        .expect("remote attach over qpmux");
    // Paced, and until a send fails: live whenever velo probes (every 5 s).
    let produce = tokio::spawn(async move {
        for i in 0u32.. {
            if sender.send(i).await.is_err() {
                return i;
            }
            if i % 16 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        unreachable!("a stream of 2^32 items")
    });
    let mut items = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(frame) = anchor.next().await {
            match frame {
                Ok(velo::StreamFrame::Item(v)) => items.push(v),
                other => return other,
            }
            if items.len() == 500 {
                assert!(
                    kind.kill(producer_qp.node(), PeerId(1)),
                    "a live link to kill"
                );
            }
        }
        panic!("the anchor closed without a last frame");
    })
    .await
    .expect("the stream ends within a minute of the kill");
    let n = items.len() as u32;
    assert_eq!(items, (0..n).collect::<Vec<_>>(), "no hole");
    assert!(
        matches!(ended, Err(velo::StreamError::SenderDropped)),
        "{ended:?}"
    );
    let stopped = produce.await.expect("producer");
    assert!(
        stopped >= n,
        "its send failed after the last item delivered"
    );
}

async fn a_killed_link_leaves_the_survivor_working_with_a_third_instance<K: Kind>() {
    let kind = K::new(Shape::Default);
    let (a, a_qp) = velo(&kind, 1, VeloConfig::default()).await;
    let (b, _) = velo(&kind, 2, VeloConfig::default()).await;
    join(&a, &b);
    b.register_handler(echo("echo")).expect("register echo");
    a.wait_for_handler(b.instance_id(), "echo")
        .await
        .expect("echo visible");
    // Keep a stream of requests in flight, kill the link under it.
    let mut inflight = Vec::new();
    for i in 0..64u32 {
        let fut = a
            .unary("echo")
            .expect("builder")
            .raw_payload(Bytes::from(vec![(i % 256) as u8; 64 * 1024]))
            .instance(b.instance_id())
            // A request written before the kill is "maybe delivered": only
            // velo's own timeout ends it. Queued ones fail through on_error.
            .timeout(Duration::from_secs(2))
            .send();
        inflight.push(tokio::spawn(fut));
    }
    assert!(kind.kill(a_qp.node(), PeerId(2)), "a live link to kill");
    for request in inflight {
        // Each resolves: answered before the kill, or failed by velo (no hang).
        let outcome = tokio::time::timeout(Duration::from_secs(30), request).await;
        let answered = outcome.expect("every request resolves").expect("task");
        if let Err(error) = answered {
            tracing::debug!(%error, "request lost with the link");
        }
    }
    let (c, _) = velo(&kind, 3, VeloConfig::default()).await;
    join(&a, &c);
    c.register_handler(echo("echo"))
        .expect("register echo on c");
    a.wait_for_handler(c.instance_id(), "echo")
        .await
        .expect("echo visible on c");
    let reply = unary(&a, &c, "echo", Bytes::from_static(b"survivor")).await;
    assert_eq!(reply.expect("a reaches c"), Bytes::from_static(b"survivor"));
    // b is alive, so the node redials: a new epoch serves later requests.
    let again = unary(&a, &b, "echo", Bytes::from_static(b"again")).await;
    assert_eq!(
        again.expect("a reaches b on a new epoch"),
        Bytes::from_static(b"again")
    );
}

async fn draining_refuses_new_messages_and_finishes_the_ones_in_flight<K: Kind>() {
    let kind = K::new(Shape::Default);
    let (server, server_qp) = velo(&kind, 1, VeloConfig::default()).await;
    let (client, _) = velo(&kind, 2, VeloConfig::default()).await;
    join(&client, &server);
    let (started_tx, started_rx) = flume::unbounded::<()>();
    let (release_tx, release_rx) = flume::unbounded::<()>();
    server
        .register_handler(
            Handler::unary_handler_async("slow", move |ctx| {
                let started = started_tx.clone();
                let release = release_rx.clone();
                async move {
                    started.send(()).expect("test holds the receiver");
                    release.recv_async().await.expect("test releases");
                    Ok(Some(ctx.payload))
                }
            })
            .build(),
        )
        .expect("register slow");
    server
        .register_handler(echo("echo"))
        .expect("register echo");
    client
        .wait_for_handler(server.instance_id(), "slow")
        .await
        .expect("slow visible");
    client
        .wait_for_handler(server.instance_id(), "echo")
        .await
        .expect("echo visible");

    let slow = tokio::spawn(
        client
            .unary("slow")
            .expect("builder")
            .raw_payload(Bytes::from_static(b"in flight"))
            .instance(server.instance_id())
            .send(),
    );
    started_rx
        .recv_async()
        .await
        .expect("the slow request is in its handler");
    server.begin_drain();
    let refused = unary(&client, &server, "echo", Bytes::from_static(b"new")).await;
    let refusal = refused.expect_err("a draining instance refuses new messages");
    // velo's words for a ShuttingDown echo (not a timeout, not a send failure).
    assert!(refusal.to_string().contains("shutting down"), "{refusal:#}");
    release_tx.send(()).expect("handler waits");
    let done = slow
        .await
        .expect("task")
        .expect("the in-flight request completes");
    assert_eq!(done, Bytes::from_static(b"in flight"));
    // velo's graceful shutdown runs our shutdown hook and awaits `closed`.
    server
        .graceful_shutdown(velo::ShutdownPolicy::Timeout(Duration::from_secs(5)))
        .await;
    use qpmux::link::Node;
    until("every peer task retired", || {
        server_qp.node().mux().peer_count() == 0
    })
    .await;
}

async fn a_peer_with_only_tcp_is_reached_through_the_fallback<K: Kind>() {
    use velo::transports::tcp::TcpTransportBuilder;
    let tcp = || {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        Arc::new(
            TcpTransportBuilder::new()
                .from_listener(listener)
                .expect("listener")
                .build()
                .expect("tcp transport"),
        )
    };
    let kind = K::new(Shape::Default);
    let qpmux = Arc::new(qpmux::velo::QpmuxTransport::new(
        kind.node(1).await,
        VeloConfig::default(),
    ));
    let both = Velo::builder()
        .add_transport(qpmux)
        .add_transport(tcp())
        .build()
        .await
        .expect("qpmux first, tcp second");
    let tcp_only = Velo::builder()
        .add_transport(tcp())
        .build()
        .await
        .expect("tcp only");
    join(&both, &tcp_only);
    assert_eq!(
        both.primary_transport_key(tcp_only.instance_id())
            .as_deref(),
        Some("tcp")
    );
    tcp_only
        .register_handler(echo("echo"))
        .expect("register echo");
    both.wait_for_handler(tcp_only.instance_id(), "echo")
        .await
        .expect("echo visible");
    let reply = unary(&both, &tcp_only, "echo", Bytes::from_static(b"fallback")).await;
    assert_eq!(
        reply.expect("reached over tcp"),
        Bytes::from_static(b"fallback")
    );
    // The same instance still reaches a qpmux peer over qpmux.
    let (peer, _) = velo_on(kind.node(2).await, VeloConfig::default()).await;
    join(&both, &peer);
    assert_eq!(
        both.primary_transport_key(peer.instance_id()).as_deref(),
        Some("qpmux-rc")
    );
    peer.register_handler(echo("echo")).expect("register echo");
    both.wait_for_handler(peer.instance_id(), "echo")
        .await
        .expect("echo visible");
    let reply = unary(&both, &peer, "echo", Bytes::from_static(b"qpmux")).await;
    assert_eq!(
        reply.expect("reached over qpmux"),
        Bytes::from_static(b"qpmux")
    );
}
