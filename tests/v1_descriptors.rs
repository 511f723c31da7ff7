//! V1, resource ceiling: file descriptors stay O(peers) on the mux paths
//! however many streams ride them. (The per-stream comparison with velo's
//! `tcp-stream` path lives with the velo plug-in tests.)

use std::time::Duration;

use bytes::Bytes;
use qpmux::link::Node;
use qpmux::link::tcp::{TcpNodeConfig, TcpTransport};
use qpmux::mux::{Frame, MuxConfig, MuxTransport, PeerId, StreamKey, Terminal};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count())
}

async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_mux_descriptors_do_not_grow_with_streams() {
    let loopback = "127.0.0.1:0".parse().expect("literal");
    let peers = 4u64;
    let a = TcpTransport::bind(
        TcpNodeConfig::new(PeerId(100)),
        loopback,
        MuxConfig::default(),
    )
    .await
    .expect("bind");
    let mut others = Vec::new();
    for p in 0..peers {
        let node = TcpTransport::bind(
            TcpNodeConfig::new(PeerId(p + 1)),
            loopback,
            MuxConfig::default(),
        )
        .await
        .expect("bind");
        a.register(&node.address()).expect("register");
        others.push(node);
    }
    let mut fds_at = Vec::new();
    let mut opened = 0u64;
    for streams_per_peer in [1u64, 256, 4096] {
        let mut receivers = Vec::new();
        for (p, node) in others.iter().enumerate() {
            for s in opened..streams_per_peer {
                let key = StreamKey::new(p as u64, s);
                receivers.push(node.mux().bind(key).expect("bind"));
                let mut tx = a.mux().open(PeerId(p as u64 + 1), key).expect("open");
                tx.send(Bytes::from_static(b"x")).await.expect("send");
                tx.finish(Terminal::Finalized).expect("finish");
            }
        }
        for mut rx in receivers {
            assert_eq!(rx.recv().await, Some(Frame::Data(Bytes::from_static(b"x"))));
            assert_eq!(rx.recv().await, Some(Frame::Finalized));
        }
        opened = streams_per_peer;
        until(|| a.mux().stats().slots_dropped == 0).await;
        fds_at.push((streams_per_peer, open_fds()));
    }
    eprintln!("V1 qpmux-tcp, {peers} peers: (streams per peer, open fds) = {fds_at:?}");
    // Every stream count uses the same descriptors: listeners, one
    // connection per peer per side, the runtime's own. (A little slack for a
    // descriptor the runtime or a crossing dial holds for a moment.)
    let (_, first) = fds_at[0];
    for &(streams, fds) in &fds_at {
        assert!(
            fds <= first + 4,
            "descriptors grew at {streams} streams per peer: {fds_at:?}"
        );
    }
    assert!(first < 64, "{first} descriptors for {peers} peers");
    a.shutdown();
    for node in &others {
        node.shutdown();
    }
}
