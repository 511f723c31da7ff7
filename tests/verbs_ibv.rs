//! The provider-generic verbs suite over libibverbs (feature `ibverbs`).
//!
//! Runs against the device named by `QPMUX_IBV_DEVICE` (default: the first
//! device with a RoCEv2 GID); both endpoints open that device, so their QPs
//! talk through the device's loopback (rxe and RoCE NICs both support it).
//! Skips, saying why, when libibverbs or a device is missing — the rxe
//! harness (`tests/rxe_guest.rs`) runs it for real inside a QEMU guest.
#![cfg(feature = "ibverbs")]

#[path = "common/ibv.rs"]
mod ibv_device;

#[macro_use]
mod verbs_suite;

use std::time::Duration;

use qpmux::verbs::ibv::{self, IbvConfig, IbvDevice, OpenError};
use verbs_suite::{BulkPlan, Harness};

/// Failsafe for one wait: far above any expected time (rxe under QEMU TCG
/// included), only there so a broken build fails instead of hanging CI.
const FAILSAFE: Duration = Duration::from_secs(60);

struct IbvHarness {
    cfg: IbvConfig,
}

impl IbvHarness {
    /// The harness, or `None` after printing why the tests skip.
    fn new() -> Option<IbvHarness> {
        ibv_device::config_or_skip("libibverbs suite").map(|cfg| IbvHarness { cfg })
    }
}

impl Harness for IbvHarness {
    type Dev = IbvDevice;

    async fn devices(&mut self) -> (IbvDevice, IbvDevice) {
        let a = IbvDevice::open(self.cfg.clone()).expect("open a");
        let b = IbvDevice::open(self.cfg.clone()).expect("open b");
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

    fn rnr_naks_sent(_dev: &IbvDevice) -> Option<u64> {
        // Both endpoints share one device and tests run in parallel, so the
        // device-wide counter (rxe: hw_counters/send_rnr_err) cannot be
        // attributed to one responder; the suite then checks behaviour only.
        None
    }

    fn tolerates_rxe_length_error(&self) -> bool {
        // Only kernel soft-RoCE gets the allowance (see docs/rxe.md).
        std::fs::read_link(format!(
            "/sys/class/infiniband/{}/device/driver",
            self.cfg.device.as_deref().unwrap_or("rxe0")
        ))
        .is_err()
            && self
                .cfg
                .device
                .as_deref()
                .is_some_and(|d| d.starts_with("rxe"))
    }

    fn bulk_plan(&self) -> BulkPlan {
        // Sized for kernel rxe under QEMU TCG (a few MB/s): ~10 MiB in all.
        BulkPlan {
            count: 10_000,
            max_size: 256 << 10,
            big_every: 1000,
            small_max: 2048,
        }
    }
}

verbs_suite!(match IbvHarness::new() {
    Some(h) => h,
    None => return,
});

/// A NIC takes no lock: bytes a posted WR names are refused to user code
/// until the completion (a receive's for reading too, a send's for writing),
/// and a post over bytes user code holds locked fails (review 40e).
#[tokio::test]
async fn posted_bytes_are_refused_to_user_code_until_their_completion() {
    use qpmux::verbs::{AccessFlags, Device, MemoryRegion, VerbsError};
    let Some(mut h) = IbvHarness::new() else {
        return;
    };
    let (mut a, mut b) = verbs_suite::connect(&mut h, verbs_suite::Params::default()).await;
    // A peer's RDMA WRITE needs no WR of ours to mark: such regions are refused.
    assert!(matches!(
        a.dev.reg_mr(
            &a.pd,
            64,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE
        ),
        Err(VerbsError::InvalidAttr { .. })
    ));
    let busy = |r: Result<Vec<u8>, VerbsError>| matches!(r, Err(VerbsError::MemoryBusy { .. }));
    b.post_recv(1, 4096, 256);
    assert!(busy(b.mr.read(4096, 16)), "a posted receive's bytes");
    assert!(busy(b.mr.read(4000, 200)), "a slice over its edge");
    assert!(b.mr.read(0, 16).is_ok(), "bytes outside it");
    assert!(b.mr.write(0, b"free").is_ok());
    assert!(b.mr.try_lock_chunk(0).is_none(), "the region's one chunk");
    a.mr.write(0, b"hello").expect("write");
    let held = a.mr.try_lock_chunk(0).expect("the chunk");
    assert!(
        matches!(
            a.post_send(1, 0, 5, None, true),
            Err(VerbsError::MemoryBusy { .. })
        ),
        "a post over locked bytes"
    );
    drop(held);
    a.post_send(2, 0, 5, None, true).expect("send");
    assert_eq!(
        a.mr.read(0, 5).expect("a send's bytes may be read"),
        b"hello"
    );
    assert!(
        matches!(a.mr.write(0, b"x"), Err(VerbsError::MemoryBusy { .. })),
        "not written"
    );
    assert!(verbs_suite::wait_wcs(&mut h, &mut b, 0, 1).await);
    assert!(verbs_suite::wait_wcs(&mut h, &mut a, 1, 0).await);
    assert_eq!(b.mr.read(4096, 5).expect("completed"), b"hello");
    a.mr.write(0, b"again").expect("its send completed");
    assert!(b.mr.try_lock_chunk(0).is_some());
}

/// Listing never panics: without libibverbs or devices it says what to fix.
#[test]
fn list_devices_reports_or_names_the_fix() {
    match ibv::list_devices() {
        Ok(devs) => {
            for d in &devs {
                eprintln!("{d:?}");
            }
        }
        Err(e @ (OpenError::NoLibibverbs | OpenError::NoDevice)) => {
            let text = e.to_string();
            assert!(
                text.contains("apt-get install") || text.contains("rdma link add"),
                "{text}"
            );
        }
        Err(e) => panic!("unexpected: {e}"),
    }
    let _ = ibv::fork_safety();
}

/// Opening a device that does not exist names the devices that do.
#[test]
fn open_unknown_device_fails_cleanly() {
    let err = IbvDevice::open(IbvConfig {
        device: Some("no-such-device-7".into()),
        ..IbvConfig::default()
    })
    .expect_err("no such device");
    assert!(matches!(
        err,
        OpenError::NoLibibverbs | OpenError::NoDevice | OpenError::NoSuchDevice { .. }
    ));
}

/// Preflight: a memlock need above the limit is refused with the fix named.
#[test]
fn preflight_names_memlock_fix() {
    match ibv::preflight(u64::MAX) {
        Err(OpenError::Memlock { .. }) => {}
        Err(e @ (OpenError::NoLibibverbs | OpenError::NoDevice)) => eprintln!("skipping: {e}"),
        // Unlimited, or CAP_IPC_LOCK (root): the limit does not apply.
        Ok(p) => eprintln!("preflight passes: {p:?}"),
        Err(e) => panic!("unexpected: {e}"),
    }
    let msg = OpenError::Memlock {
        limit: 8 << 20,
        needed: 64 << 20,
    }
    .to_string();
    assert!(
        msg.contains("ulimit -l") && msg.contains("memlock=-1"),
        "{msg}"
    );
}

/// Device and GID selection by source address: the chosen GID is the
/// address's RoCEv2 GID (IPv4-mapped for IPv4).
#[tokio::test]
async fn gid_follows_source_address() {
    let Some(h) = IbvHarness::new() else { return };
    let dev = IbvDevice::open(h.cfg.clone()).expect("open");
    let ip = dev.gid_ip();
    let by_src = IbvDevice::open(IbvConfig {
        source: Some(ip),
        ..h.cfg.clone()
    })
    .expect("open by source address");
    assert_eq!(by_src.gid(), dev.gid());
    let by_peer = IbvDevice::open(IbvConfig {
        device: None,
        peer: Some(ip),
        ..h.cfg.clone()
    })
    .expect("open by route to peer");
    assert_eq!(by_peer.gid(), dev.gid());
    assert!(
        dev.async_events()
            .iter()
            .all(|e| !matches!(e, ibv::AsyncEvent::DeviceFatal))
    );
}

/// RoCEv2 over IPv6: QPs addressed by the device's IPv6 GID (the rxe guest
/// gives its netdev `fd00::15`) exchange messages like over IPv4-mapped GIDs.
#[tokio::test]
async fn ping_pong_over_ipv6_gid() {
    let Some(h) = IbvHarness::new() else { return };
    let dev = IbvDevice::open(h.cfg.clone()).expect("open");
    let name = qpmux::verbs::Device::name(&dev).to_string();
    let devs = ibv::list_devices().expect("list");
    let v6 = devs
        .iter()
        .filter(|d| d.name == name)
        .flat_map(|d| d.roce_v2_gids.iter())
        .map(|(_, gid, _)| std::net::Ipv6Addr::from(gid.0))
        .filter(|ip| ip.to_ipv4_mapped().is_none())
        .min_by_key(|ip| ip.is_unicast_link_local());
    let Some(v6) = v6 else {
        eprintln!("skipping ping_pong_over_ipv6_gid: {name} has no IPv6 RoCEv2 GID");
        return;
    };
    let mut h6 = IbvHarness {
        cfg: IbvConfig {
            source: Some(v6.into()),
            ..h.cfg.clone()
        },
    };
    let (a, _b) = h6.devices().await;
    assert_eq!(
        a.gid().0,
        v6.octets(),
        "the GID of the source address is used"
    );
    verbs_suite::ping_pong(&mut h6).await;
}

/// Async events: taking the netdev under the device down and up again is
/// reported as port error, then port active. Flaps a link, so it is ignored
/// by default; the rxe guest runs it alone after the suite with
/// `QPMUX_IBV_FLAP_NETDEV` set.
#[tokio::test]
#[ignore = "flaps a network link; run alone (the rxe guest does)"]
async fn async_events_report_port_flap() {
    let Some(h) = IbvHarness::new() else { return };
    let Ok(netdev) = std::env::var("QPMUX_IBV_FLAP_NETDEV") else {
        eprintln!("skipping: set QPMUX_IBV_FLAP_NETDEV to the device's netdev");
        return;
    };
    let dev = IbvDevice::open(h.cfg.clone()).expect("open");
    let mut seen = Vec::new();
    let mut h = h;
    for (state, want) in [("down", "PortError"), ("up", "PortActive")] {
        let ok = std::process::Command::new("ip")
            .args(["link", "set", &netdev, state])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "ip link set {netdev} {state}");
        let got = h
            .wait_until(|| {
                seen.extend(dev.async_events());
                seen.iter().any(|e| format!("{e:?}").starts_with(want))
            })
            .await;
        assert!(got, "{want} after link {state}; events: {seen:?}");
    }
    eprintln!("async events: {seen:?}");
}

/// Wire interop: qpmux's soft provider (userspace RoCEv2 on UDP 4791, in its
/// own network namespace) and kernel rxe exchange SENDs both ways, single- and
/// multi-packet, with immediates. Needs a guest setup (the rxe guest makes
/// netns `QPMUX_INTEROP_NETNS` with a veth pair and rxe on the host end), so
/// it is ignored by default. The soft side runs as a child process of this
/// test inside that namespace; the two exchange QP addresses through files.
#[tokio::test]
#[ignore = "needs the rxe guest's netns + veth setup"]
async fn interop_soft_provider_with_kernel_rxe() {
    use qpmux::verbs::soft::SoftDevice;
    use qpmux::verbs::soft::udp::UdpConfig;
    let var = |k: &str| std::env::var(k).ok();
    let (Some(dir), Some(netns), Some(rxe_ip), Some(soft_ip)) = (
        var("QPMUX_INTEROP_DIR"),
        var("QPMUX_INTEROP_NETNS"),
        var("QPMUX_INTEROP_RXE_IP"),
        var("QPMUX_INTEROP_SOFT_IP"),
    ) else {
        eprintln!("skipping: QPMUX_INTEROP_{{DIR,NETNS,RXE_IP,SOFT_IP}} not set");
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    if var("QPMUX_INTEROP_ROLE").as_deref() == Some("soft") {
        let dev = SoftDevice::open_udp(UdpConfig {
            bind: std::net::SocketAddr::new(soft_ip.parse().expect("soft ip"), 4791),
            link_mtu: Some(1500),
            ..UdpConfig::default()
        })
        .await
        .expect("open soft device on UDP 4791");
        let stats = dev.clone();
        let run = std::panic::AssertUnwindSafe(interop::side(dev, &dir, "soft", "rxe", true));
        let outcome = futures_catch(run).await;
        eprintln!("soft device stats: {:?}", stats.stats());
        if let Err(p) = outcome {
            std::panic::resume_unwind(p);
        }
        return;
    }
    std::fs::create_dir_all(&dir).expect("interop dir");
    let exe = std::env::current_exe().expect("current exe");
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", &netns])
        .arg(exe)
        .args([
            "--ignored",
            "--exact",
            "interop_soft_provider_with_kernel_rxe",
            "--nocapture",
        ])
        .env("QPMUX_INTEROP_ROLE", "soft")
        .spawn()
        .expect("start the soft side");
    let dev = IbvDevice::open(IbvConfig {
        device: var("QPMUX_IBV_DEVICE"),
        source: Some(rxe_ip.parse().expect("rxe ip")),
        ..IbvConfig::default()
    })
    .expect("open the rxe device");
    let rxe = tokio::time::timeout(
        Duration::from_secs(90),
        interop::side(dev, &dir, "rxe", "soft", false),
    )
    .await;
    let status = child.wait().expect("soft side exits");
    assert!(rxe.is_ok(), "rxe side timed out; soft side: {status}");
    assert!(status.success(), "soft side failed: {status}");
}

/// Run a future, catching a panic (std only: poll it under catch_unwind).
async fn futures_catch<F: std::future::Future>(
    fut: std::panic::AssertUnwindSafe<F>,
) -> std::thread::Result<F::Output> {
    let mut fut = std::pin::pin!(fut.0);
    std::future::poll_fn(|cx| {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(v)) => std::task::Poll::Ready(Ok(v)),
            Err(p) => std::task::Poll::Ready(Err(p)),
        }
    })
    .await
}

mod interop {
    use std::path::Path;
    use std::time::Duration;

    use qpmux::verbs::*;

    const MESSAGES: u64 = 24;
    const SLOT: usize = 4096;

    fn size(k: u64) -> usize {
        // 0, 1 and multi-packet (First/Middle/Last at MTU 1024) sizes.
        [0, 1, 100, 1024, 1025, 3000, 4096][k as usize % 7]
    }

    fn byte(k: u64, i: usize) -> u8 {
        (k as usize * 31 + i * 7) as u8
    }

    fn write_addr(path: &Path, a: &QpAddress) {
        let text = format!(
            "{} {} {} {} {}",
            a.qpn.value(),
            a.psn.value(),
            std::net::Ipv6Addr::from(a.gid.0),
            a.udp_port,
            a.mtu.bytes()
        );
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).expect("write address");
        std::fs::rename(&tmp, path).expect("publish address");
    }

    async fn read_addr(path: &Path) -> QpAddress {
        for _ in 0..6000 {
            if let Ok(text) = std::fs::read_to_string(path) {
                let f: Vec<&str> = text.split_whitespace().collect();
                let mtu = match f[4] {
                    "256" => Mtu::Mtu256,
                    "512" => Mtu::Mtu512,
                    "1024" => Mtu::Mtu1024,
                    "2048" => Mtu::Mtu2048,
                    _ => Mtu::Mtu4096,
                };
                let ip: std::net::Ipv6Addr = f[2].parse().expect("gid");
                return QpAddress {
                    qpn: Qpn::new(f[0].parse().expect("qpn")),
                    psn: Psn::new(f[1].parse().expect("psn")),
                    gid: Gid(ip.octets()),
                    udp_port: f[3].parse().expect("port"),
                    mtu,
                };
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no peer address at {}", path.display());
    }

    async fn wait_wc<C: CompletionQueue>(cq: &C, who: &str) -> WorkCompletion {
        let mut wc = [WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm: None,
            qp_num: Qpn::new(0),
        }];
        let give_up = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < give_up {
            if cq.poll(&mut wc).expect("poll") == 1 {
                return wc[0];
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        panic!("{who}: no completion within 20 s");
    }

    /// One side: receive `MESSAGES` and send `MESSAGES`, in the order `first` says.
    pub async fn side<D: Device>(dev: D, dir: &Path, me: &str, peer: &str, first: bool) {
        let pd = dev.alloc_pd().expect("pd");
        let scq = dev.create_cq(256).expect("send cq");
        let rcq = dev.create_cq(256).expect("recv cq");
        let qp = dev
            .create_qp(&pd, &scq, &rcq, QpCaps::default())
            .expect("qp");
        let mr = dev
            .reg_mr(&pd, 2 * MESSAGES as usize * SLOT, AccessFlags::LOCAL_WRITE)
            .expect("mr");
        qp.modify_to_init(InitAttr {
            access: AccessFlags::LOCAL_WRITE,
        })
        .expect("init");
        for k in 0..MESSAGES {
            let sge = [Sge {
                mr: &mr,
                offset: k as usize * SLOT,
                len: SLOT,
            }];
            qp.post_recv(&[RecvWr {
                wr_id: k,
                sg_list: &sge,
            }])
            .expect("post_recv");
        }
        write_addr(&dir.join(format!("{me}.addr")), &QpAddress::of(&dev, &qp));
        let theirs = read_addr(&dir.join(format!("{peer}.addr"))).await;
        let mine = dev.query_port();
        eprintln!("{me}: {} -> peer {theirs:?}", dev.name());
        qp.modify_to_rtr(RtrAttr::for_peer(&theirs, mine.active_mtu, 1))
            .expect("rtr");
        qp.modify_to_rts(RtsAttr {
            sq_psn: qp.initial_psn(),
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 7,
        })
        .expect("rts");
        // Nobody sends before both QPs can receive (as the bootstrap's "ready").
        std::fs::write(dir.join(format!("{me}.ready")), b"").expect("ready");
        let peer_ready = dir.join(format!("{peer}.ready"));
        for _ in 0..6000 {
            if peer_ready.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(peer_ready.exists(), "{me}: {peer} never became ready");
        let send_all = async || {
            for k in 0..MESSAGES {
                let off = (MESSAGES + k) as usize * SLOT;
                let len = size(k);
                mr.with_mut(off, len, |b| {
                    for (i, x) in b.iter_mut().enumerate() {
                        *x = byte(k, i);
                    }
                })
                .expect("fill");
                let sge = [Sge {
                    mr: &mr,
                    offset: off,
                    len,
                }];
                qp.post_send(&[SendWr {
                    wr_id: 100 + k,
                    opcode: SendOpcode::SendWithImm(k as u32 ^ 0xabcd_0000),
                    sg_list: &sge,
                    signaled: true,
                    inline: false,
                }])
                .expect("post_send");
                let wc = wait_wc(&scq, me).await;
                assert_eq!(
                    (wc.wr_id, wc.status),
                    (100 + k, WcStatus::Success),
                    "{me} send {k}"
                );
            }
        };
        let recv_all = async || {
            for k in 0..MESSAGES {
                let wc = wait_wc(&rcq, me).await;
                assert_eq!(
                    (wc.wr_id, wc.status),
                    (k, WcStatus::Success),
                    "{me} recv {k}"
                );
                assert_eq!(wc.byte_len as usize, size(k), "{me} length of {k}");
                assert_eq!(wc.imm, Some(k as u32 ^ 0xabcd_0000), "{me} imm of {k}");
                let ok = mr
                    .with(k as usize * SLOT, size(k), |b| {
                        b.iter().enumerate().all(|(i, x)| *x == byte(k, i))
                    })
                    .expect("read");
                assert!(ok, "{me}: payload of {k} intact");
            }
        };
        if first {
            send_all().await;
            recv_all().await;
        } else {
            recv_all().await;
            send_all().await;
        }
        eprintln!("{me}: {MESSAGES} messages each way verified");
    }
}
