//! The provider-generic verbs suite over the soft provider's UDP driver on
//! loopback (127.0.0.1, ephemeral ports), plus a tshark decode check.

#[macro_use]
mod verbs_suite;

use std::time::Duration;

use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use verbs_suite::{BulkPlan, Harness};

/// Failsafe for one wait: far above any expected time, only there so a
/// broken build fails instead of hanging CI.
const FAILSAFE: Duration = Duration::from_secs(60);

struct UdpHarness {
    config: UdpConfig,
}

impl UdpHarness {
    /// The defaults: the MTU of `lo` (4096) and UDP GSO where the kernel has it.
    fn new() -> UdpHarness {
        UdpHarness {
            config: UdpConfig::default(),
        }
    }

    /// MTU 1024 and one packet per send: every RoCE packet is its own
    /// datagram on the wire (what a capture on `lo` can decode; GSO sends
    /// are captured before the kernel splits them) and the no-GSO fallback.
    /// Socket buffers of 64 KiB (the kernel doubles them): bulk sends find
    /// the socket full, so inline sends leave packets to the driver's
    /// backlog and the driver waits for room, while order must hold.
    fn small_buffers() -> UdpHarness {
        UdpHarness {
            config: UdpConfig {
                socket_buffer: 64 << 10,
                ..UdpConfig::default()
            },
        }
    }

    fn plain() -> UdpHarness {
        UdpHarness {
            config: UdpConfig {
                link_mtu: Some(1500),
                segmentation_offload: false,
                ..UdpConfig::default()
            },
        }
    }
}

impl Harness for UdpHarness {
    type Dev = SoftDevice;

    async fn devices(&mut self) -> (SoftDevice, SoftDevice) {
        let a = SoftDevice::open_udp(self.config.clone())
            .await
            .expect("open a");
        let b = SoftDevice::open_udp(self.config.clone())
            .await
            .expect("open b");
        (a, b)
    }

    async fn wait_until(&mut self, mut done: impl FnMut() -> bool) -> bool {
        let give_up = tokio::time::Instant::now() + FAILSAFE;
        loop {
            if done() {
                return true;
            }
            if tokio::time::Instant::now() > give_up {
                return false;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    fn rnr_naks_sent(dev: &SoftDevice) -> Option<u64> {
        Some(dev.counters().rnr_naks_sent)
    }

    fn bulk_plan(&self) -> BulkPlan {
        if cfg!(debug_assertions) {
            BulkPlan {
                count: 10_000,
                max_size: 256 << 10,
                big_every: 1000,
                small_max: 2048,
            }
        } else {
            BulkPlan {
                count: 10_000,
                max_size: 1 << 20,
                big_every: 250,
                small_max: 4096,
            }
        }
    }
}

verbs_suite!(UdpHarness::new());

/// The same suite at MTU 1024 with every packet sent alone (no GSO).
mod without_gso {
    use super::*;

    verbs_suite!(UdpHarness::plain());
}

/// The same suite with socket buffers too small for a burst.
mod small_socket_buffers {
    use super::*;

    verbs_suite!(UdpHarness::small_buffers());
}

/// Capture loopback traffic of two soft devices with tshark, decode it as
/// RoCEv2 and check every packet decodes (no malformed packets, the opcodes
/// and AETH syndromes we sent). Skips, saying why, without tshark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tshark_decodes_soft_roce() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    if Command::new("tshark").arg("--version").output().is_err() {
        eprintln!("skipping tshark_decodes_soft_roce: tshark is not installed");
        return;
    }
    let mut h = UdpHarness::plain();
    let params = verbs_suite::Params {
        rnr_retry: 7,
        min_rnr_timer: 1,
        ..verbs_suite::Params::default()
    };
    let (mut a, b) = verbs_suite::connect(&mut h, params).await;
    let ports = [a.dev.udp_port(), b.dev.udp_port()];
    let dir =
        std::env::temp_dir().join(format!("qpmux-tshark-{}-{}", std::process::id(), ports[0]));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let pcap = dir.join("soft-roce.pcapng");
    let filter = format!("udp port {} or udp port {}", ports[0], ports[1]);
    let child = Command::new("tshark")
        .args(["-i", "lo", "-f", &filter, "-w"])
        .arg(&pcap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipping tshark_decodes_soft_roce: cannot start tshark: {e}");
            return;
        }
    };
    // Wait for the capture to start (a state, not a duration).
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut started = false;
    while let Ok(line) = rx.recv_timeout(FAILSAFE) {
        if line.contains("Capturing on") {
            started = true;
            break;
        }
        eprintln!("tshark: {line}");
    }
    // The file appears once dumpcap really captures.
    let give_up = std::time::Instant::now() + FAILSAFE;
    while started && !pcap.exists() {
        let exited = matches!(child.try_wait(), Ok(Some(_)));
        started = !exited && std::time::Instant::now() < give_up;
        std::thread::sleep(Duration::from_millis(5));
    }
    if !started {
        if let Err(e) = child.kill() {
            eprintln!("could not stop tshark: {e}");
        }
        eprintln!("skipping tshark_decodes_soft_roce: tshark could not capture on lo");
        return;
    }

    // Traffic: SEND Only, Only+Imm, First/Middle/Last+Imm, an RNR NAK, then a
    // length error (NAK invalid request).
    for (i, len) in [(0u64, 5usize), (1, 0), (2, 3000)].into_iter() {
        b.post_recv(i, i as usize * 4096, 4096);
        a.post_send(i, 0, len, (i > 0).then_some(i as u32), true)
            .expect("send");
    }
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 3, 0).await);
    a.post_send(3, 0, 100, None, true).expect("send");
    let dev = &b.dev;
    assert!(h.wait_until(|| dev.counters().rnr_naks_sent >= 1).await);
    b.post_recv(3, 0, 4096);
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 4, 0).await);
    b.post_recv(4, 0, 10);
    a.post_send(4, 0, 100, None, true).expect("send");
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 5, 0).await);

    // Stop only once dumpcap has written every datagram the devices sent.
    let sent = a.dev.stats().tx_datagrams + b.dev.stats().tx_datagrams;
    let give_up = std::time::Instant::now() + FAILSAFE;
    loop {
        let out = Command::new("tshark")
            .arg("-r")
            .arg(&pcap)
            .args(["-T", "fields", "-e", "frame.number"])
            .stderr(Stdio::null())
            .output()
            .expect("tshark -r");
        let seen = String::from_utf8_lossy(&out.stdout).lines().count() as u64;
        if seen >= sent || std::time::Instant::now() > give_up {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = child.id().to_string();
    let stopped = Command::new("kill").args(["-INT", &pid]).status();
    assert!(stopped.is_ok_and(|s| s.success()), "SIGINT to tshark");
    child.wait().expect("tshark exits");

    // Wireshark ≥ 4.2 names the RoCEv2 dissector `rroce`; 4.0 binds UDP
    // 4791 to `infiniband` directly.
    let decodes = Command::new("tshark")
        .args(["-G", "decodes"])
        .output()
        .expect("tshark -G");
    let dissector = if String::from_utf8_lossy(&decodes.stdout).contains("\trroce") {
        "rroce"
    } else {
        "infiniband"
    };
    let mut decode = Command::new("tshark");
    decode.arg("-r").arg(&pcap);
    for p in ports {
        decode.args(["-d", &format!("udp.port=={p},{dissector}")]);
    }
    decode.args([
        "--disable-protocol",
        "rpcordma",
        "-T",
        "fields",
        "-E",
        "separator=;",
        "-e",
        "infiniband.bth.opcode",
        "-e",
        "infiniband.bth.psn",
        "-e",
        "infiniband.aeth.syndrome",
        "-e",
        "_ws.malformed",
        "-e",
        "_ws.expert.severity",
    ]);
    let out = decode.output().expect("tshark -r");
    assert!(
        out.status.success(),
        "tshark -r failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split(';').collect()).collect();
    assert_eq!(rows.len() as u64, sent, "every datagram captured:\n{text}");
    let mut opcodes = std::collections::BTreeSet::new();
    let mut syndromes = std::collections::BTreeSet::new();
    for row in &rows {
        assert_eq!(row.len(), 5, "unexpected row {row:?}");
        assert!(
            !row[0].is_empty(),
            "packet not decoded as InfiniBand: {row:?}"
        );
        assert!(row[3].is_empty(), "malformed packet: {row:?}");
        opcodes.insert(row[0].to_string());
        if !row[2].is_empty() {
            syndromes.insert(row[2].to_string());
        }
    }
    // SEND First 0, Middle 1, Last+Imm 3, Only 4, Only+Imm 5, ACK 17.
    for op in ["0", "1", "3", "4", "5", "17"] {
        assert!(opcodes.contains(op), "opcode {op} missing from {opcodes:?}");
    }
    // ACK 0x1f (31), RNR NAK with timer 1 (0x21 = 33), NAK invalid request (0x61 = 97).
    for s in ["31", "33", "97"] {
        assert!(
            syndromes.contains(s),
            "syndrome {s} missing from {syndromes:?}"
        );
    }
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        eprintln!("leaving {}: {e}", dir.display());
    }
}

#[test]
fn soft_device_is_always_listed() {
    let devices = qpmux::verbs::list_devices();
    assert!(
        devices
            .iter()
            .any(|d| d.provider == qpmux::verbs::ProviderKind::Soft)
    );
}

/// The peer device is dropped (its socket closes): sends fail with
/// RETRY_EXC_ERR once the retries are spent.
#[tokio::test]
async fn peer_device_dropped_gives_retry_exceeded() {
    let mut h = UdpHarness::new();
    let params = verbs_suite::Params {
        retry_cnt: 2,
        timeout: 10,
        ..verbs_suite::Params::default()
    };
    let (mut a, b) = verbs_suite::connect(&mut h, params).await;
    drop(b);
    a.post_send(1, 0, 10, None, true).expect("send");
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 1, 0).await);
    assert_eq!(a.sends[0].status, qpmux::verbs::WcStatus::RetryExcErr);
    assert_eq!(
        qpmux::verbs::QueuePair::state(&a.qp),
        qpmux::verbs::QpState::Err
    );
}

type SoftQp = <SoftDevice as qpmux::verbs::Device>::Qp;
type SoftMr = <SoftDevice as qpmux::verbs::Device>::Mr;

/// Takes `qp` from RESET to RTS toward `remote` (its QPN, first PSN, GID
/// and UDP port), with the RC attributes given.
fn connect_qp(
    qp: &SoftQp,
    remote: (qpmux::verbs::Qpn, qpmux::verbs::Psn, qpmux::verbs::Gid, u16),
    rts: qpmux::verbs::RtsAttr,
) {
    use qpmux::verbs::{AccessFlags, InitAttr, Mtu, QueuePair, RtrAttr};
    qp.modify_to_init(InitAttr {
        access: AccessFlags::LOCAL_WRITE,
    })
    .expect("init");
    let (dest_qpn, rq_psn, remote_gid, remote_udp_port) = remote;
    qp.modify_to_rtr(RtrAttr {
        path_mtu: Mtu::Mtu1024,
        dest_qpn,
        rq_psn,
        remote_gid,
        remote_udp_port,
        min_rnr_timer: 1,
    })
    .expect("rtr");
    qp.modify_to_rts(rts).expect("rts");
}

/// One signaled SEND (id 1) of `mr[..len]`.
fn send_one(qp: &SoftQp, mr: &SoftMr, len: usize) {
    use qpmux::verbs::{QueuePair, SendOpcode, SendWr, Sge};
    qp.post_send(&[SendWr {
        wr_id: 1,
        opcode: SendOpcode::Send,
        sg_list: &[Sge { mr, offset: 0, len }],
        signaled: true,
        inline: false,
    }])
    .expect("send");
}

/// A datagram the kernel refuses (here a broadcast address, refused without
/// SO_BROADCAST) is counted and its send retried by RC until the retry
/// budget ends the QP, rather than lost unseen (review 48h).
#[tokio::test]
async fn a_send_the_kernel_refuses_is_counted_and_retried() {
    use qpmux::verbs::{
        AccessFlags, CompletionQueue, Device, Gid, MemoryRegion, QpCaps, QueuePair, RtsAttr,
        WcStatus,
    };
    let dev = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("device");
    let pd = dev.alloc_pd().expect("pd");
    let cq = dev.create_cq(16).expect("cq");
    let qp = dev.create_qp(&pd, &cq, &cq, QpCaps::default()).expect("qp");
    let mr = dev.reg_mr(&pd, 4096, AccessFlags::LOCAL_WRITE).expect("mr");
    let broadcast = Gid::from_ipv4(std::net::Ipv4Addr::BROADCAST);
    let rts = RtsAttr {
        sq_psn: qp.initial_psn(),
        timeout: 8,
        retry_cnt: 1,
        rnr_retry: 0,
    };
    connect_qp(&qp, (qp.qp_num(), qp.initial_psn(), broadcast, 4791), rts);
    mr.write(0, b"refused").expect("write");
    send_one(&qp, &mr, 7);
    let mut wc = [verbs_suite::blank_wc()];
    let mut h = UdpHarness::new();
    assert!(h.wait_until(|| cq.poll(&mut wc).expect("poll") == 1).await);
    assert_eq!(wc[0].status, WcStatus::RetryExcErr);
    let stats = dev.stats();
    assert!(stats.tx_refused >= 2, "the send and its retry: {stats:?}");
}

/// Over IPv6 loopback the GID is the IPv6 address and the ICRC covers the
/// IPv6 pseudo-header. Skips when `::1` cannot be bound.
#[tokio::test]
async fn ping_over_ipv6_loopback() {
    use qpmux::verbs::{
        AccessFlags, CompletionQueue, Device, MemoryRegion, QpCaps, QueuePair, RecvWr, RtsAttr, Sge,
    };
    let config = UdpConfig {
        bind: "[::1]:0".parse().expect("addr"),
        ..UdpConfig::default()
    };
    let (Ok(a), Ok(b)) = (
        SoftDevice::open_udp(config.clone()).await,
        SoftDevice::open_udp(config).await,
    ) else {
        eprintln!("skipping ping_over_ipv6_loopback: cannot bind [::1]");
        return;
    };
    assert_eq!(a.gid().to_ipv4(), None);
    let mut ends = Vec::new();
    for dev in [&a, &b] {
        let pd = dev.alloc_pd().expect("pd");
        let cq = dev.create_cq(16).expect("cq");
        let qp = dev.create_qp(&pd, &cq, &cq, QpCaps::default()).expect("qp");
        let mr = dev.reg_mr(&pd, 4096, AccessFlags::LOCAL_WRITE).expect("mr");
        ends.push((cq, qp, mr));
    }
    for (me, peer, dev) in [(0, 1, &b), (1, 0, &a)] {
        let port = dev.query_port();
        let qp = &ends[me].1;
        let theirs = &ends[peer].1;
        let remote = (
            theirs.qp_num(),
            theirs.initial_psn(),
            port.gid_table[0],
            port.udp_port,
        );
        let rts = RtsAttr {
            sq_psn: qp.initial_psn(),
            timeout: 12,
            retry_cnt: 3,
            rnr_retry: 3,
        };
        connect_qp(qp, remote, rts);
    }
    let (cq_b, qp_b, mr_b) = &ends[1];
    qp_b.post_recv(&[RecvWr {
        wr_id: 1,
        sg_list: &[Sge {
            mr: mr_b,
            offset: 0,
            len: 4096,
        }],
    }])
    .expect("recv");
    let (_, qp_a, mr_a) = &ends[0];
    mr_a.write(0, b"over ipv6").expect("write");
    send_one(qp_a, mr_a, 9);
    let mut wc = [verbs_suite::blank_wc()];
    let mut h = UdpHarness::new();
    assert!(
        h.wait_until(|| cq_b.poll(&mut wc).expect("poll") == 1)
            .await
    );
    assert_eq!(wc[0].status, qpmux::verbs::WcStatus::Success);
    assert_eq!(mr_b.read(0, 9).expect("read"), b"over ipv6");
    assert_eq!(b.stats().rx_malformed, 0);
}

/// The driver lets the receivers run before it sends a receive turn's ACKs.
/// A responder that destroys its QP the moment its last receive completes
/// (woken by the CQ, before the driver's next turn) still sends the ACK it
/// owes, so the requester's send completes `Success`, not `RetryExcErr`.
#[tokio::test]
async fn a_qp_dropped_as_its_last_receive_completes_still_acknowledges_it() {
    acknowledged_after_the_last_receive(drop).await;
}

/// The same when the responder moves its QP to ERR instead (the RDMA link
/// does on reading the peer's Goodbye): the ACK already owed still goes.
#[tokio::test]
async fn a_qp_moved_to_error_as_its_last_receive_completes_still_acknowledges_it() {
    use qpmux::verbs::QueuePair as _;
    acknowledged_after_the_last_receive(|b| b.qp.modify_to_error().expect("to ERR")).await;
}

/// The responder sees its receive complete, then `end`s its QP before the
/// driver's next turn; the requester's send must still complete `Success`.
async fn acknowledged_after_the_last_receive(end: impl FnOnce(verbs_suite::Endpoint<SoftDevice>)) {
    use qpmux::verbs::CompletionQueue as _;
    let mut h = UdpHarness::new();
    let params = verbs_suite::Params {
        retry_cnt: 1,
        timeout: 10,
        ..verbs_suite::Params::default()
    };
    let (mut a, b) = verbs_suite::connect(&mut h, params).await;
    b.post_recv(1, 0, 64);
    b.recv_cq.req_notify().expect("arm");
    let notified = b.recv_cq.notified();
    a.post_send(1, 0, 8, None, true).expect("send");
    notified.await;
    let mut wc = [verbs_suite::blank_wc()];
    assert_eq!(b.recv_cq.poll(&mut wc).expect("poll"), 1);
    assert_eq!(wc[0].status, qpmux::verbs::WcStatus::Success);
    end(b);
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 1, 0).await);
    assert_eq!(a.sends[0].status, qpmux::verbs::WcStatus::Success);
}

/// The same with the responder holding its ACKs to coalesce them
/// (`SoftConfig::ack_delay`, 120 s: capped at a quarter of a 550 s local
/// ACK timeout, longer than the harness's 60 s failsafe): dropping the QP
/// lets the held ACK go before the flush.
#[tokio::test]
async fn a_qp_dropped_with_an_ack_held_to_coalesce_still_sends_it() {
    held_ack_sent_on_drop(false, false).await;
}

/// The same while inline sends decline (as they do while the driver is
/// mid-send or holds a backlog): the owed ACK goes to the driver's backlog
/// instead of down with the QP.
#[tokio::test]
async fn a_qp_dropped_while_the_driver_sends_still_sends_its_held_ack() {
    held_ack_sent_on_drop(true, false).await;
}

/// The same with the device's last handle dropped right after the QP: the
/// ending driver sends the backlog the device left (`leave_parting`). On
/// two workers, so the driver may find the device gone before its drop
/// has left the backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qp_dropped_with_its_device_while_the_driver_sends_still_sends_its_held_ack() {
    held_ack_sent_on_drop(true, true).await;
}

async fn held_ack_sent_on_drop(inline_declined: bool, last_handle: bool) {
    use qpmux::verbs::CompletionQueue as _;
    let mut config = UdpConfig::default();
    config.soft.ack_delay = Duration::from_secs(120);
    let mut h = UdpHarness { config };
    let params = verbs_suite::Params {
        timeout: 27,
        ..verbs_suite::Params::default()
    };
    let (mut a, mut b) = verbs_suite::connect(&mut h, params).await;
    b.post_recv(1, 0, 64);
    a.post_send(1, 0, 8, None, true).expect("send");
    assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, 1).await);
    tokio::task::yield_now().await;
    let mut wc = [verbs_suite::blank_wc()];
    assert_eq!(a.send_cq.poll(&mut wc).expect("poll"), 0, "the ACK is held");
    let dev = b.dev.clone();
    dev.decline_inline_sends(inline_declined);
    let backlogged = dev.stats().tx_backlogged;
    drop(b);
    assert_eq!(
        dev.stats().tx_backlogged - backlogged,
        u64::from(inline_declined),
        "the ACK left to the driver"
    );
    if last_handle {
        // The driver holds one only during its turns.
        assert!(
            h.wait_until(|| dev.handle_count() == 1).await,
            "this is the last lasting handle"
        );
        drop(dev);
    }
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 1, 0).await);
    assert_eq!(a.sends[0].status, qpmux::verbs::WcStatus::Success);
}

/// After each receive completes, the driver reads ahead the receive buffer
/// next in line (it was last touched a whole receive queue ago), once per
/// completion; with no receive left posted there is nothing to read.
#[tokio::test]
async fn each_completed_receive_warms_the_next_posted_buffer() {
    let mut h = UdpHarness::new();
    let (a, mut b) = verbs_suite::connect(&mut h, verbs_suite::Params::default()).await;
    for i in 0..3 {
        b.post_recv(i + 1, i as usize * 64, 64);
    }
    for i in 1..=3u64 {
        a.post_send(i, 0, 8, None, true).expect("send");
        assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, i as usize).await);
        let warmed = i.min(2); // the third receive leaves none posted
        let dev = b.dev.clone();
        assert!(
            h.wait_until(|| dev.stats().rx_buffers_warmed == warmed)
                .await,
            "after receive {i}: {:?}",
            b.dev.stats()
        );
    }
    assert_eq!(b.dev.stats().rx_buffers_warmed, 2);
}

/// `post_send` puts its packets on the wire itself once the socket is known
/// writable. Before that (a fresh device on a current-thread runtime whose
/// reactor has not run yet) they go to the driver's backlog, and arrive all
/// the same.
#[tokio::test]
async fn a_send_goes_inline_once_the_socket_is_known_writable() {
    let mut h = UdpHarness::new();
    let (mut a, mut b) = verbs_suite::connect(&mut h, verbs_suite::Params::default()).await;
    b.post_recv(1, 0, 64);
    b.post_recv(2, 64, 64);
    a.post_send(1, 0, 8, None, true).expect("send 1");
    let first = a.dev.stats();
    assert_eq!((first.tx_inline, first.tx_backlogged), (0, 1), "{first:?}");
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 1, 0).await);
    a.post_send(2, 8, 8, None, true).expect("send 2");
    let second = a.dev.stats();
    assert_eq!(
        (second.tx_inline, second.tx_backlogged),
        (1, 1),
        "{second:?}"
    );
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 2, 0).await);
    assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, 2).await);
    let ids: Vec<u64> = b.recvs.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(ids, [1, 2]);
    assert!(
        a.sends
            .iter()
            .chain(&b.recvs)
            .all(|wc| wc.status == qpmux::verbs::WcStatus::Success)
    );
}

/// Back-to-back 16 KiB SENDs into 64 KiB socket buffers: the receiving
/// socket drops bursts, so the driver's retransmissions interleave with
/// fresh inline sends; every message still arrives whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_sends_and_retransmissions_keep_their_order() {
    const MESSAGES: u64 = 256;
    const LEN: usize = 16 << 10;
    let mut h = UdpHarness::small_buffers();
    let params = verbs_suite::Params {
        mr_len: 4 * LEN,
        mtu: qpmux::verbs::Mtu::Mtu4096,
        caps: qpmux::verbs::QpCaps {
            max_send_wr: 512,
            max_recv_wr: 512,
            ..verbs_suite::Params::default().caps
        },
        ..verbs_suite::Params::default()
    };
    let (mut a, mut b) = verbs_suite::connect(&mut h, params).await;
    for i in 0..MESSAGES {
        b.post_recv(i, 0, LEN);
    }
    for round in 0..8 {
        for i in 0..MESSAGES {
            let imm = (round * MESSAGES + i) as u32;
            a.post_send(i, (i as usize % 4) * LEN, LEN, Some(imm), true)
                .expect("send");
        }
        assert!(verbs_suite::wait_wcs(&mut h, &mut a, 0, 0).await);
        let want = ((round + 1) * MESSAGES) as usize;
        assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, want).await);
        assert!(verbs_suite::wait_wcs(&mut h, &mut a, want, 0).await);
        for i in 0..MESSAGES {
            b.post_recv(i, 0, LEN);
        }
    }
    for (k, wc) in b.recvs.iter().enumerate() {
        assert_eq!(wc.status, qpmux::verbs::WcStatus::Success);
        assert_eq!(wc.imm, Some(k as u32), "message {k} out of order");
        assert_eq!(wc.byte_len as usize, LEN);
    }
    assert!(
        a.sends
            .iter()
            .all(|wc| wc.status == qpmux::verbs::WcStatus::Success)
    );
    assert!(a.dev.stats().tx_inline > 0, "{:?}", a.dev.stats());
}

/// The partition fault hook: while the peer device is cut off the sender's
/// local ACK timeouts fire; after healing the send completes.
#[tokio::test]
async fn partition_hook_then_heal_delivers() {
    let mut h = UdpHarness::new();
    let params = verbs_suite::Params {
        retry_cnt: 7,
        timeout: 12,
        ..verbs_suite::Params::default()
    };
    let (mut a, mut b) = verbs_suite::connect(&mut h, params).await;
    b.post_recv(1, 0, 64);
    b.dev.set_partitioned(true);
    a.post_send(1, 0, 8, None, true).expect("send");
    let dev = &a.dev;
    assert!(h.wait_until(|| dev.counters().ack_timeouts >= 1).await);
    b.dev.set_partitioned(false);
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 1, 0).await);
    assert_eq!(a.sends[0].status, qpmux::verbs::WcStatus::Success);
    assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, 1).await);
    assert!(b.dev.stats().fault_dropped >= 1);
}

/// The active MTU follows the link MTU it is given (1500 → 1024).
#[tokio::test]
async fn active_mtu_follows_link_mtu() {
    use qpmux::verbs::soft::{SoftConfig, udp::interface_mtu};
    use qpmux::verbs::{Device, Mtu};
    let config = UdpConfig {
        soft: SoftConfig {
            active_mtu: Mtu::Mtu4096,
            ..SoftConfig::default()
        },
        link_mtu: Some(1500),
        ..UdpConfig::default()
    };
    let dev = SoftDevice::open_udp(config).await.expect("open");
    assert_eq!(dev.query_port().active_mtu, Mtu::Mtu1024);
    if let Ok(lo) = interface_mtu("lo") {
        assert!(lo >= 1500, "loopback MTU {lo}");
        assert!(Mtu::for_link_mtu(lo, false).is_some());
    }
}

/// Without a link MTU given, the device reads it from the interface that
/// holds the bind address: on loopback (MTU 65536 on Linux) that is RoCE's
/// largest, 4096; and a ceiling in `soft.active_mtu` still applies.
#[tokio::test]
async fn active_mtu_follows_the_bind_interface() {
    use qpmux::verbs::soft::SoftConfig;
    use qpmux::verbs::soft::udp::{bind_interface_mtu, interface_mtu};
    use qpmux::verbs::{Device, Mtu};
    let Ok(lo) = interface_mtu("lo") else {
        eprintln!("skipping active_mtu_follows_the_bind_interface: no /sys/class/net/lo");
        return;
    };
    let localhost = "127.0.0.1".parse().expect("literal");
    assert_eq!(bind_interface_mtu(localhost), Some(lo));
    let other = "127.0.0.2".parse().expect("literal");
    assert_eq!(bind_interface_mtu(other), Some(lo), "127/8 is on lo");
    let expected = Mtu::for_link_mtu(lo, false)
        .expect("lo fits a RoCE MTU")
        .min(Mtu::Mtu4096);
    let dev = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("open");
    assert_eq!(dev.query_port().active_mtu, expected);
    let capped = UdpConfig {
        soft: SoftConfig {
            active_mtu: Mtu::Mtu2048,
            ..SoftConfig::default()
        },
        ..UdpConfig::default()
    };
    let dev = SoftDevice::open_udp(capped).await.expect("open");
    assert_eq!(dev.query_port().active_mtu, expected.min(Mtu::Mtu2048));
}
