//! Message rate and bandwidth of two soft-provider QPs on loopback UDP,
//! beside a plain tokio TCP loopback stream in the same run.
//!
//! `cargo bench --bench soft_provider`. Each iteration batch sends n messages
//! of one size, keeping a window in flight; time stops when the receiver has
//! them all.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qpmux::verbs::soft::udp::UdpConfig;
use qpmux::verbs::soft::{SoftConfig, SoftDevice};
use qpmux::verbs::{
    AccessFlags, CompletionQueue, Device, InitAttr, Mtu, QpCaps, QueuePair, RecvWr, RtrAttr,
    RtsAttr, SendOpcode, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

const SIZES: [usize; 3] = [64, 4096, 65536];
const WINDOW: usize = 64;

type Mr = <SoftDevice as Device>::Mr;
type Cq = <SoftDevice as Device>::Cq;
type Qp = <SoftDevice as Device>::Qp;

struct Side {
    _dev: SoftDevice,
    send_cq: Cq,
    recv_cq: Cq,
    qp: Qp,
    mr: Mr,
}

fn blank() -> WorkCompletion {
    WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        imm: None,
        qp_num: qpmux::verbs::Qpn::new(0),
    }
}

async fn soft_pair(size: usize, mtu: Mtu) -> (Side, Side) {
    let mut sides = Vec::new();
    for _ in 0..2 {
        let config = UdpConfig {
            soft: SoftConfig {
                active_mtu: mtu,
                ..SoftConfig::default()
            },
            ..UdpConfig::default()
        };
        let dev = SoftDevice::open_udp(config).await.expect("open");
        let pd = dev.alloc_pd().expect("pd");
        let send_cq = dev.create_cq(4 * WINDOW).expect("cq");
        let recv_cq = dev.create_cq(4 * WINDOW).expect("cq");
        let caps = QpCaps {
            max_send_wr: WINDOW,
            max_recv_wr: WINDOW,
            max_sge: 1,
            max_inline_data: 0,
        };
        let qp = dev.create_qp(&pd, &send_cq, &recv_cq, caps).expect("qp");
        let mr = dev
            .reg_mr(&pd, size * WINDOW, AccessFlags::LOCAL_WRITE)
            .expect("mr");
        qp.modify_to_init(InitAttr {
            access: AccessFlags::LOCAL_WRITE,
        })
        .expect("init");
        sides.push(Side {
            _dev: dev,
            send_cq,
            recv_cq,
            qp,
            mr,
        });
    }
    let b = sides.pop().expect("two");
    let a = sides.pop().expect("two");
    for (me, peer) in [(&a, &b), (&b, &a)] {
        let port = peer._dev.query_port();
        me.qp
            .modify_to_rtr(RtrAttr {
                path_mtu: mtu,
                dest_qpn: peer.qp.qp_num(),
                rq_psn: peer.qp.initial_psn(),
                remote_gid: port.gid_table[0],
                remote_udp_port: port.udp_port,
                min_rnr_timer: 1,
            })
            .expect("rtr");
        me.qp
            .modify_to_rts(RtsAttr {
                sq_psn: me.qp.initial_psn(),
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
            })
            .expect("rts");
    }
    for k in 0..WINDOW {
        post_recv(&b, k, size);
    }
    (a, b)
}

fn post_recv(b: &Side, k: usize, size: usize) {
    let slot = k % WINDOW;
    let sge = [Sge {
        mr: &b.mr,
        offset: slot * size,
        len: size,
    }];
    b.qp.post_recv(&[RecvWr {
        wr_id: k as u64,
        sg_list: &sge,
    }])
    .expect("post_recv");
}

/// Send `n` messages A → B with a window of `WINDOW`; return the elapsed time.
async fn soft_run(a: &Side, b: &Side, size: usize, n: usize) -> Duration {
    let start = Instant::now();
    let mut wcs = [blank(); 64];
    let (mut posted, mut sent, mut received) = (0usize, 0usize, 0usize);
    while received < n {
        while posted < n && posted - sent < WINDOW && posted < received + WINDOW {
            let slot = posted % WINDOW;
            let sge = [Sge {
                mr: &a.mr,
                offset: slot * size,
                len: size,
            }];
            a.qp.post_send(&[SendWr {
                wr_id: posted as u64,
                opcode: SendOpcode::Send,
                sg_list: &sge,
                signaled: true,
                inline: false,
            }])
            .expect("post_send");
            posted += 1;
        }
        let ns = a.send_cq.poll(&mut wcs).expect("poll");
        sent += ns;
        let nr = b.recv_cq.poll(&mut wcs).expect("poll");
        for wc in &wcs[..nr] {
            assert_eq!(wc.status, WcStatus::Success);
            received += 1;
            post_recv(b, wc.wr_id as usize + WINDOW, size);
        }
        if ns == 0 && nr == 0 {
            // Arm both CQs: with coalesced ACKs the sender's completions can
            // be all that is left to wait for (the window is full, every
            // receive done), and a wait on the receive CQ alone would sleep
            // out the timeout.
            a.send_cq.req_notify().expect("arm");
            b.recv_cq.req_notify().expect("arm");
            let ns = a.send_cq.poll(&mut wcs).expect("poll");
            sent += ns;
            let nr = b.recv_cq.poll(&mut wcs).expect("poll");
            for wc in &wcs[..nr] {
                received += 1;
                post_recv(b, wc.wr_id as usize + WINDOW, size);
            }
            if ns == 0 && nr == 0 {
                // The timeout only bounds a lost wake-up.
                let either = async {
                    tokio::select! {
                        _ = a.send_cq.notified() => {}
                        _ = b.recv_cq.notified() => {}
                    }
                };
                if tokio::time::timeout(Duration::from_millis(1), either)
                    .await
                    .is_err()
                {
                    tokio::task::yield_now().await;
                }
            }
        }
    }
    // Drain the sender's completions so the next batch starts clean.
    while sent < n {
        sent += a.send_cq.poll(&mut wcs).expect("poll");
        tokio::task::yield_now().await;
    }
    start.elapsed()
}

async fn tcp_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (client, server) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
    let client = client.expect("connect");
    client.set_nodelay(true).expect("nodelay");
    (client, server.expect("accept").0)
}

/// Send `n` length-prefixed messages over TCP; return the elapsed time.
async fn tcp_run(
    w: &mut tokio::net::TcpStream,
    r: &mut tokio::net::TcpStream,
    size: usize,
    n: usize,
) -> Duration {
    let msg = vec![7u8; size + 4];
    let start = Instant::now();
    let writer = async {
        for _ in 0..n {
            w.write_all(&msg).await.expect("write");
        }
    };
    let reader = async {
        let mut buf = vec![0u8; size + 4];
        for _ in 0..n {
            r.read_exact(&mut buf).await.expect("read");
        }
    };
    tokio::join!(writer, reader);
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let rt = Runtime::new().expect("runtime");
    let mut group = c.benchmark_group("loopback");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(3));
    group.warm_up_time(Duration::from_millis(500));
    for size in SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        // MTU 1024 is what Ethernet allows; 4096 shows the per-packet cost
        // on loopback (non-standard for RoCE over a 1500-byte link).
        for (name, mtu) in [
            ("soft_udp", Mtu::Mtu1024),
            ("soft_udp_mtu4096", Mtu::Mtu4096),
        ] {
            if mtu == Mtu::Mtu4096 && size < 4096 {
                continue;
            }
            let (a, b) = rt.block_on(soft_pair(size, mtu));
            group.bench_with_input(BenchmarkId::new(name, size), &size, |bench, &size| {
                bench.iter_custom(|n| rt.block_on(soft_run(&a, &b, size, n as usize)));
            });
        }
        let (mut w, mut r) = rt.block_on(tcp_pair());
        group.bench_with_input(
            BenchmarkId::new("tokio_tcp", size),
            &size,
            |bench, &size| {
                bench.iter_custom(|n| rt.block_on(tcp_run(&mut w, &mut r, size, n as usize)));
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
