//! UDP driver: one tokio task per device drives the core; `post_send` may
//! put its own packets on the wire first.
//!
//! ```text
//!  loop (biased select):  shutdown ─► exit
//!                         readable ─► recvmmsg (+GRO) ─► core.handle_datagram × n, one lock
//!                                     ─► unlocked: CQ handlers (a link takes its batch)
//!                                     ─► yield: the woken receivers run before the ACKs go
//!                         kick (a verbs call) / timer deadline ─► fall through
//!        then: core.handle_timeout(now); backlog + poll_transmit ─► outbox ─► sendmsg (+GSO runs)
//!  post_send, core locked, driver not sending: poll_transmit ─► sendmsg now (no task wake);
//!        a full socket ─► backlog + kick; an earlier timer than the driver knows ─► kick
//! ```
//!
//! Owner: the driver task holds only a `Weak` to the device between turns,
//! so dropping the last handle ends it. The socket is shared (`Port`);
//! `InlineGate`, inside the core's lock, keeps packets in emission order.
//! Wall-clock time is mapped onto [`Instant`] from the moment the device
//! opened. Batched socket calls come
//! from `quinn-udp` (no `unsafe` here): one `sendmsg` carries a run of
//! equal-size packets to one peer (UDP GSO), one `recvmmsg` takes many
//! datagrams, GRO-merged or not. Without GSO every packet goes alone.
//! Rulings and measurements: docs/soft-provider.md § "The UDP driver batches".

use std::io::IoSliceMut;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Weak};
use std::time::Duration;

use quinn_udp::{RecvMeta, Transmit as UdpTransmit, UdpSocketState};
use tokio::io::Interest;
use tokio::net::UdpSocket;

use super::cq::CqShared;
use super::device::{DeviceCore, Transmit};
use super::wire::MAX_OVERHEAD;
use super::{DeviceShared, Instant, SoftConfig, SoftDevice};
use crate::stages::{self, Stage};
use crate::unwind::{CatchPanic, panic_message};
use crate::verbs::{Gid, Mtu, Qpn, VerbsError};

/// Packets emitted per turn, so receiving is not starved by a long send queue
/// (one requester window is 128 PSNs).
const BATCH: usize = 64;
/// Largest packet the provider emits.
const MAX_PACKET: usize = 4096 + MAX_OVERHEAD;
/// Largest packet a peer may send at MTU 4096: a WRITE First carries a
/// 16-byte RETH where a SEND has none, and must reach the QP whole to be
/// NAKed rather than dropped as a bad ICRC.
const MAX_RX_PACKET: usize = 4096 + 64;
/// Bytes one GSO send may carry (a UDP datagram's payload limit).
const MAX_GSO_BYTES: usize = 65_507;
/// Receive buffers per `recvmmsg`: with GRO each holds up to 64 KiB of merged
/// datagrams, without it one datagram.
const RX_SLOTS_GRO: usize = 8;
const RX_SLOTS_PLAIN: usize = 32;
/// `recvmmsg` calls per turn before the driver transmits again.
const RX_CALLS_PER_TURN: usize = 4;
/// Packets a `post_send` emits itself; more are left to the driver (one
/// 64 KiB batch at MTU 4096 is 16).
const INLINE_PACKETS: usize = 16;
/// While inline sends flow, the driver looks at the timers at least this
/// often, so a send that arms a later timer (the ACK timer: 67 ms by
/// default) need not wake it. Timers keep their precision: once one is due
/// within a tick, the driver sleeps until it exactly.
const IDLE_TICK: std::time::Duration = std::time::Duration::from_millis(5);
/// How long an ending driver waits for socket room for its device's
/// parting packets.
const PARTING_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// Configuration of a UDP-driven soft device.
#[derive(Clone, Debug)]
pub struct UdpConfig {
    /// Address to bind; port 0 picks an ephemeral port (4791 would collide
    /// with kernel rxe). Must be a concrete IP: it is the device's GID.
    pub bind: SocketAddr,
    /// Device settings; `soft.active_mtu` is the ceiling the link MTU may
    /// lower (default here 4096, the largest RoCE MTU).
    pub soft: SoftConfig,
    /// `SO_RCVBUF` and `SO_SNDBUF` to ask for (the kernel caps them at
    /// `net.core.rmem_max`/`wmem_max`). A window of 128 packets must fit, or
    /// the receiving socket drops the tail of a burst and recovery waits
    /// for the local ACK timeout.
    pub socket_buffer: usize,
    /// MTU of the link under the bind address. `None` reads it from the
    /// interface that holds the bind IP ([`bind_interface_mtu`]; loopback:
    /// 65536 → 4096); when that is unknown the active MTU is at most 1024,
    /// which fits a 1500-byte Ethernet link.
    pub link_mtu: Option<usize>,
    /// Batch a run of packets to one peer into one send (UDP GSO) when the
    /// kernel offers it. `false` sends every packet alone (the fallback
    /// the driver also takes when a GSO send fails).
    pub segmentation_offload: bool,
}

/// The MTU of network interface `name`, from `/sys/class/net/<name>/mtu`.
pub fn interface_mtu(name: &str) -> std::io::Result<usize> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))?;
    text.trim()
        .parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "MTU is not a number"))
}

/// The name of the interface that holds address `ip` (`getifaddrs`): the one
/// with that address, else the one whose subnet contains it (127.0.0.2 is on
/// `lo` by way of 127.0.0.1/8).
#[cfg(target_os = "linux")]
pub fn interface_of(ip: IpAddr) -> Option<String> {
    let as_ip = |a: &nix::sys::socket::SockaddrStorage| -> Option<IpAddr> {
        a.as_sockaddr_in()
            .map(|s| IpAddr::V4(s.ip()))
            .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
    };
    let mut subnet = None;
    for a in nix::ifaddrs::getifaddrs().ok()? {
        let Some(addr) = a.address.as_ref().and_then(as_ip) else {
            continue;
        };
        if addr == ip {
            return Some(a.interface_name);
        }
        let mask = a.netmask.as_ref().and_then(as_ip);
        if subnet.is_none() && mask.is_some_and(|m| same_subnet(addr, ip, m)) {
            subnet = Some(a.interface_name);
        }
    }
    subnet
}

/// Whether `a` and `b` agree on every bit set in `mask` (same family only).
fn same_subnet(a: IpAddr, b: IpAddr, mask: IpAddr) -> bool {
    let bits = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => (4, u128::from(u32::from(v4))),
        IpAddr::V6(v6) => (6, u128::from(v6)),
    };
    let ((fa, a), (fb, b), (fm, m)) = (bits(a), bits(b), bits(mask));
    fa == fb && fb == fm && m != 0 && a & m == b & m
}

/// The name of the interface that holds address `ip` (not known off Linux).
#[cfg(not(target_os = "linux"))]
pub fn interface_of(_ip: IpAddr) -> Option<String> {
    None
}

/// The MTU of the interface that holds `ip`, if it can be found.
pub fn bind_interface_mtu(ip: IpAddr) -> Option<usize> {
    interface_mtu(&interface_of(ip)?).ok()
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            soft: SoftConfig {
                active_mtu: Mtu::Mtu4096,
                ..SoftConfig::default()
            },
            socket_buffer: 4 << 20,
            link_mtu: None,
            segmentation_offload: true,
        }
    }
}

/// The active MTU: the largest RoCE MTU the link fits, at most the configured one.
fn active_mtu(config: &UdpConfig) -> Result<Mtu, VerbsError> {
    let link = config
        .link_mtu
        .or_else(|| bind_interface_mtu(config.bind.ip()));
    match link {
        Some(link) => {
            let ip = config.bind.ip();
            let ipv6 = matches!(ip, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none());
            let fits = Mtu::for_link_mtu(link, ipv6).ok_or(VerbsError::InvalidAttr {
                attr: "link_mtu below the smallest RoCE MTU",
            })?;
            Ok(fits.min(config.soft.active_mtu))
        }
        None => Ok(config.soft.active_mtu.min(Mtu::Mtu1024)),
    }
}

fn gid_of(ip: IpAddr) -> Gid {
    match ip {
        IpAddr::V4(v4) => Gid::from_ipv4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => Gid::from_ipv4(v4),
            None => Gid(v6.octets()),
        },
    }
}

fn addr_of(gid: Gid, port: u16) -> SocketAddr {
    match gid.to_ipv4() {
        Some(v4) => SocketAddr::from((v4, port)),
        None => SocketAddr::from((Ipv6Addr::from(gid.0), port)),
    }
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> VerbsError {
    move |e| VerbsError::Io { op, kind: e.kind() }
}

fn bind(config: &UdpConfig) -> std::io::Result<(UdpSocket, UdpSocketState)> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(config.bind),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    // Best effort: a smaller buffer only costs throughput.
    if let Err(e) = socket.set_recv_buffer_size(config.socket_buffer) {
        tracing::debug!(error = %e, "SO_RCVBUF not set");
    }
    if let Err(e) = socket.set_send_buffer_size(config.socket_buffer) {
        tracing::debug!(error = %e, "SO_SNDBUF not set");
    }
    socket.set_nonblocking(true)?;
    socket.bind(&config.bind.into())?;
    // Turns on GRO and DF (IP_PMTUDISC_PROBE) where the kernel has them.
    let state = UdpSocketState::new((&socket).into())?;
    Ok((UdpSocket::from_std(socket.into())?, state))
}

impl SoftDevice {
    /// Open a soft device on a UDP socket and start its driver task.
    /// Must be called inside a tokio runtime.
    pub async fn open_udp(config: UdpConfig) -> Result<SoftDevice, VerbsError> {
        if config.bind.ip().is_unspecified() {
            return Err(VerbsError::InvalidAttr {
                attr: "bind address must be a concrete IP (it is the GID)",
            });
        }
        let (socket, state) = bind(&config).map_err(io("bind"))?;
        let local = socket.local_addr().map_err(io("local_addr"))?;
        let seed = config.soft.seed.unwrap_or_else(rand::random);
        let active_mtu = active_mtu(&config)?;
        let mut core = DeviceCore::new(gid_of(local.ip()), local.port(), active_mtu, seed);
        core.ack_delay = config.soft.ack_delay;
        let dev = SoftDevice::from_core(core);
        let port = Arc::new(Port {
            socket,
            state,
            gso: config.segmentation_offload,
            start: std::time::Instant::now(),
            parting: std::sync::Mutex::new(None),
            parted: tokio::sync::Notify::new(),
            send_errors: Default::default(),
            send_error_warning: Default::default(),
        });
        if dev.shared().port.set(port.clone()).is_err() {
            unreachable!("a new device has no port");
        }
        let weak = Arc::downgrade(dev.shared());
        let kick = dev.shared().kick.clone();
        let shutdown = dev.shared().shutdown.clone();
        tokio::spawn(supervise(port, weak, kick, shutdown));
        Ok(dev)
    }
}

/// Why a driver stopped.
enum DriverEnd {
    /// The last handle to the device is gone.
    DeviceGone,
    /// A panic under the device lock left the core possibly half-updated.
    CorePoisoned,
}

/// Runs the device's driver. A panic in it, or one under the device lock
/// anywhere (a bug in the driver or the core), leaves every QP's protocol
/// state suspect: each goes to ERR, as on a NIC's fatal error, so its link
/// ends and its peer hears, and a fresh driver serves the QPs made after.
/// Restarts back off (1 ms doubling to 1 s, reset by a driver that ran a
/// second), so a panic that recurs does not spin a core.
async fn supervise(
    port: Arc<Port>,
    dev: Weak<DeviceShared>,
    kick: Arc<tokio::sync::Notify>,
    shutdown: Arc<tokio::sync::Notify>,
) {
    let mut backoff = Duration::ZERO;
    loop {
        let started = std::time::Instant::now();
        let driver = Driver::new(port.clone()).run(dev.clone(), kick.clone(), shutdown.clone());
        let cause = match CatchPanic(Box::pin(driver)).await {
            Ok(DriverEnd::DeviceGone) => return send_parting(&port).await,
            Ok(DriverEnd::CorePoisoned) => "a panic under the device lock".to_owned(),
            Err(panic) => panic_message(&*panic).to_owned(),
        };
        let Some(shared) = dev.upgrade() else {
            return send_parting(&port).await;
        };
        tracing::error!(
            cause,
            "the soft device's driver stopped on a panic; every QP goes to ERR and a new driver starts"
        );
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| recover_after_panic(&shared))) {
            tracing::error!(
                panic = panic_message(&*panic),
                "failing the device's QPs panicked; the new driver starts anyway"
            );
        }
        drop(shared);
        backoff = if started.elapsed() > Duration::from_secs(1) {
            Duration::from_millis(1)
        } else {
            (backoff * 2).clamp(Duration::from_millis(1), Duration::from_secs(1))
        };
        tokio::time::sleep(backoff).await;
    }
}

/// After a driver's panic: every QP to ERR, the core's lock cleared of its
/// poison, and every CQ of the device dispatched once (unlocked, as always),
/// so none stays owed a handler call a dead driver took with it.
fn recover_after_panic(shared: &DeviceShared) {
    let mut owed = Vec::new();
    let mut core = shared.core();
    core.stats.driver_panics += 1;
    core.take_due(&mut owed);
    core.fail_every_qp();
    owed.extend(core.every_cq());
    core.inline.driver_sending = false;
    core.inline.driver_wakes_at = None;
    drop(core);
    shared.core.clear_poison();
    let panicked = owed.iter().filter(|cq| !cq.dispatch()).count() as u64;
    shared.core().stats.cq_handler_panics += panicked;
}

/// A device's socket, shared by its driver task and inline sends.
pub(crate) struct Port {
    socket: UdpSocket,
    state: UdpSocketState,
    gso: bool,
    start: std::time::Instant,
    /// What the device still owed the wire when its last handle went
    /// (`leave_parting`): the driver sends it before it ends. `None` until
    /// the device's drop has run, which can be after the driver already
    /// finds the device gone (a `Weak` fails as the count reaches zero).
    parting: std::sync::Mutex<Option<Outbox>>,
    /// Signalled once `parting` is set.
    parted: tokio::sync::Notify,
    /// Datagrams the kernel refused other than for a full buffer (a
    /// firewall's EPERM, EMSGSIZE past the path MTU): lost, as on a wire,
    /// and retransmitted by RC; counted and warned of, since otherwise
    /// they show only as `RETRY_EXC_ERR` epoch deaths.
    send_errors: std::sync::atomic::AtomicU64,
    send_error_warning: std::sync::Mutex<crate::warn_gate::WarnGate>,
}

impl Port {
    fn now(&self) -> Instant {
        Instant::from_start(self.start.elapsed())
    }

    fn max_segments(&self) -> usize {
        if self.gso {
            self.state.max_gso_segments()
        } else {
            1
        }
    }

    /// A datagram the kernel refused (not for a full buffer): counted, and
    /// warned of at most once a second.
    fn send_refused(&self, err: &std::io::Error, dst: SocketAddr) {
        self.send_errors
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let admitted = self
            .send_error_warning
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .admit(tokio::time::Instant::now());
        match admitted {
            Some(suppressed) => {
                tracing::warn!(error = %err, %dst, suppressed, "soft RoCE send refused; RC retransmits it")
            }
            None => tracing::debug!(error = %err, %dst, "soft RoCE send refused"),
        }
    }

    /// Datagrams the kernel refused so far ([`DeviceStats::tx_refused`]).
    pub(crate) fn send_errors(&self) -> u64 {
        self.send_errors.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One non-blocking `sendmsg` of `contents`, cut into `segment`-byte
    /// datagrams (GSO) when longer.
    fn try_send(&self, dst: SocketAddr, contents: &[u8], segment: usize) -> std::io::Result<()> {
        let transmit = UdpTransmit {
            destination: dst,
            ecn: None,
            contents,
            segment_size: Some(segment),
            src_ip: None,
        };
        self.socket.try_io(Interest::WRITABLE, || {
            self.state.try_send((&self.socket).into(), &transmit)
        })
    }
}

/// Packets taken from the core and not yet on the wire, in emission order.
#[derive(Default)]
pub(crate) struct Outbox {
    /// The packets, back to back in `arena[..used]`. The arena only grows:
    /// bytes past `used` are stale, and a packet is written over them, so
    /// emitting one zeroes nothing (a fill of `MAX_PACKET` per packet was a
    /// 4 KiB `memset` on every post and ACK).
    arena: Vec<u8>,
    used: usize,
    /// (destination, range in `arena`) per packet.
    out: Vec<(SocketAddr, std::ops::Range<usize>)>,
}

impl Outbox {
    fn with_capacity(packets: usize) -> Outbox {
        Outbox {
            arena: Vec::with_capacity(packets * MAX_PACKET),
            used: 0,
            out: Vec::with_capacity(packets),
        }
    }

    fn clear(&mut self) {
        self.used = 0;
        self.out.clear();
    }

    fn len(&self) -> usize {
        self.out.len()
    }

    fn is_empty(&self) -> bool {
        self.out.is_empty()
    }

    /// Room for `len` more bytes after `used`: zeroed once, when first grown.
    fn room(&mut self, len: usize) -> &mut [u8] {
        let end = self.used + len;
        if self.arena.len() < end {
            self.arena.resize(end, 0);
        }
        &mut self.arena[self.used..end]
    }

    /// Emits packets from the core until it has none or `limit` are held.
    fn collect(&mut self, core: &mut DeviceCore, now: Instant, limit: usize) {
        self.collect_from(limit, |buf| core.poll_transmit(now, buf));
    }

    /// Emits packets from `poll` until it has none or `limit` are held.
    fn collect_from(&mut self, limit: usize, mut poll: impl FnMut(&mut [u8]) -> Option<Transmit>) {
        while self.out.len() < limit {
            let start = self.used;
            let Some(x) = poll(self.room(MAX_PACKET)) else {
                break;
            };
            self.used = start + x.len;
            self.out
                .push((addr_of(x.dst, x.dst_port), start..self.used));
        }
    }

    /// Appends `other`'s packets from index `from` on.
    fn append(&mut self, other: &Outbox, from: usize) {
        for (dst, range) in &other.out[from..] {
            let start = self.used;
            self.room(range.len())
                .copy_from_slice(&other.arena[range.clone()]);
            self.used = start + range.len();
            self.out.push((*dst, start..self.used));
        }
    }

    /// The packets `i..i + n` as one GSO run: (destination, bytes, segment).
    fn gso_slice(&self, i: usize, n: usize) -> (SocketAddr, &[u8], usize) {
        let (dst, first) = &self.out[i];
        let end = self.out[i + n - 1].1.end;
        (*dst, &self.arena[first.start..end], first.len())
    }

    /// Sends packets `from..` without waiting, a GSO run per `sendmsg`; on
    /// a full socket buffer (or one tokio has not yet seen writable), the
    /// index of the first packet not sent. A packet the kernel refuses
    /// otherwise is lost, as on a wire (RC retransmits it).
    fn try_send_from(&self, port: &Port, from: usize) -> Result<(), usize> {
        let mut i = from;
        while i < self.out.len() {
            let n = gso_run(&self.out[i..], port.max_segments());
            let (dst, bytes, segment) = self.gso_slice(i, n);
            match port.try_send(dst, bytes, segment) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Err(i),
                Err(e) if n > 1 => {
                    tracing::debug!(error = %e, %dst, "soft RoCE GSO send refused; one by one");
                    for k in i..i + n {
                        let (dst, bytes, segment) = self.gso_slice(k, 1);
                        match port.try_send(dst, bytes, segment) {
                            Ok(()) => {}
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Err(k),
                            Err(e) => port.send_refused(&e, dst),
                        }
                    }
                }
                Err(e) => port.send_refused(&e, dst),
            }
            i += n;
        }
        Ok(())
    }
}

/// How the driver and inline sends share the socket without reordering a
/// QP's packets. It lives in the device core, so it changes only under the
/// core's lock; the simulator never touches it.
#[derive(Default)]
pub(crate) struct InlineGate {
    /// The driver holds packets taken from the core and not yet sent: an
    /// inline send now could overtake them.
    driver_sending: bool,
    /// When the sleeping driver next looks at the core's timers.
    driver_wakes_at: Option<Instant>,
    /// The last inline send (the driver ticks while they flow).
    last_inline: Option<Instant>,
    /// Packets an inline send found no room for: the driver sends them first.
    backlog: Outbox,
    /// Reused by inline sends.
    scratch: Outbox,
    /// Test hook: inline sends decline as if the driver were sending.
    pub decline: bool,
}

/// After a verbs call queued work, with the core locked: puts the core's
/// packets on the wire from the caller's thread when the driver is not
/// sending. True when the driver must still be woken (packets left, a full
/// socket, or a timer earlier than the driver knows of).
pub(crate) fn transmit_inline(port: &Port, core: &mut DeviceCore) -> bool {
    if core.inline.driver_sending || !core.inline.backlog.is_empty() || core.inline.decline {
        return true;
    }
    let now = port.now();
    let mut outbox = std::mem::take(&mut core.inline.scratch);
    outbox.clear();
    outbox.collect(core, now, INLINE_PACKETS);
    let mut kick = outbox.len() == INLINE_PACKETS;
    if !outbox.is_empty() {
        core.inline.last_inline = Some(now);
        let sent = match outbox.try_send_from(port, 0) {
            Ok(()) => outbox.len(),
            Err(unsent) => {
                core.inline.backlog.append(&outbox, unsent);
                core.stats.tx_backlogged += (outbox.len() - unsent) as u64;
                kick = true;
                unsent
            }
        };
        core.stats.tx_inline += sent as u64;
    }
    core.inline.scratch = outbox;
    let driver_wakes_at = core.inline.driver_wakes_at;
    kick || core
        .poll_timeout()
        .is_some_and(|t| driver_wakes_at.is_none_or(|at| t < at))
}

/// Before a QP is destroyed, with the core locked: moves what it still owes
/// the wire (an ACK for a message already completed, above all) to the
/// driver's backlog, so destroying it loses nothing an inline send had to
/// leave to the driver (the driver mid-send, or a backlog ahead). At most
/// one inline burst: a NIC stops a destroyed QP's requests too. True when
/// the driver must be woken.
pub(crate) fn backlog_owed(port: &Port, core: &mut DeviceCore, qpn: Qpn) -> bool {
    let now = port.now();
    let mut outbox = std::mem::take(&mut core.inline.scratch);
    outbox.clear();
    outbox.collect_from(INLINE_PACKETS, |buf| core.poll_transmit_qp(qpn, now, buf));
    let owed = outbox.len();
    core.inline.backlog.append(&outbox, 0);
    core.stats.tx_backlogged += owed as u64;
    core.inline.scratch = outbox;
    owed > 0
}

/// As the device's last handle goes, with its core: what inline sends left
/// to the driver (the dropped QPs' owed packets, `backlog_owed`) moves to
/// the port, for the ending driver to send.
pub(crate) fn leave_parting(port: &Port, core: &mut DeviceCore) {
    let backlog = std::mem::take(&mut core.inline.backlog);
    *port.parting.lock().unwrap_or_else(|e| e.into_inner()) = Some(backlog);
    port.parted.notify_one();
}

/// The device's parting packets, after its driver's last turn (which sent
/// what it had collected first, so each QP's packets keep their order).
/// Waits for the device's drop to leave them; both the wait and the send
/// are bounded by `PARTING_GRACE`: a full socket does not keep a task alive.
async fn send_parting(port: &Port) {
    let send = async {
        let parting = loop {
            let parted = port.parted.notified();
            if let Some(parting) = port
                .parting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                break parting;
            }
            parted.await;
        };
        send_outbox(port, &parting).await;
    };
    if tokio::time::timeout(PARTING_GRACE, send).await.is_err() {
        tracing::debug!("soft RoCE: a departed device's last packets were not all sent");
    }
}

/// Sends `outbox`, waiting for room in the socket buffer.
async fn send_outbox(port: &Port, outbox: &Outbox) {
    let mut from = 0;
    while let Err(unsent) = outbox.try_send_from(port, from) {
        if let Err(e) = port.socket.writable().await {
            tracing::debug!(error = %e, "soft RoCE send failed");
            return;
        }
        from = unsent;
    }
}

/// The driver task's side: batched I/O and its buffers.
struct Driver {
    port: Arc<Port>,
    /// Packets of one turn.
    outbox: Outbox,
    rx: Vec<u8>,
    rx_slot: usize,
    meta: Vec<RecvMeta>,
    /// CQs owed a handler call, reused across turns.
    due: Vec<Arc<CqShared>>,
}

impl Driver {
    fn new(port: Arc<Port>) -> Driver {
        let (slots, slot) = if port.state.gro_segments() > 1 {
            (RX_SLOTS_GRO, 1 << 16)
        } else {
            (RX_SLOTS_PLAIN, MAX_RX_PACKET)
        };
        let slots = slots.clamp(1, quinn_udp::BATCH_SIZE.max(1));
        Driver {
            port,
            outbox: Outbox::with_capacity(BATCH),
            rx: vec![0; slots * slot],
            rx_slot: slot,
            meta: vec![RecvMeta::default(); slots],
            due: Vec::new(),
        }
    }

    fn now(&self) -> Instant {
        self.port.now()
    }

    async fn run(
        mut self,
        dev: Weak<DeviceShared>,
        kick: Arc<tokio::sync::Notify>,
        shutdown: Arc<tokio::sync::Notify>,
    ) -> DriverEnd {
        loop {
            // A socket kept readable (a flood of datagrams that leave nothing
            // to send: unknown QPNs, wrong sources) must not hold the worker:
            // nothing else in a turn spends tokio's budget (review 48h).
            tokio::task::consume_budget().await;
            // Handle timers and collect output under the lock; send without it.
            let deadline = {
                let Some(shared) = dev.upgrade() else {
                    return DriverEnd::DeviceGone;
                };
                if shared.core.is_poisoned() {
                    // A panic under the device lock, on a verbs call's task
                    // or in a handler's: the core may be half-updated.
                    return DriverEnd::CorePoisoned;
                }
                let mut core = shared.core();
                #[cfg(test)]
                assert!(
                    !std::mem::take(&mut core.panic_driver),
                    "injected driver panic"
                );
                let t = self.now();
                core.defer_completions();
                core.handle_timeout(t);
                core.warm_next_receives();
                self.outbox.clear();
                // What inline sends could not place goes first.
                let backlog = std::mem::take(&mut core.inline.backlog);
                self.outbox.append(&backlog, 0);
                core.inline.backlog = backlog;
                core.inline.backlog.clear();
                self.outbox.collect(&mut core, t, BATCH);
                core.inline.driver_sending = !self.outbox.is_empty();
                let mut deadline = core.poll_timeout();
                let inline_recently = core
                    .inline
                    .last_inline
                    .is_some_and(|at| t.saturating_duration_since(at) < IDLE_TICK);
                if inline_recently {
                    let tick = t + IDLE_TICK;
                    deadline = Some(deadline.map_or(tick, |d| d.min(tick)));
                }
                core.inline.driver_wakes_at = deadline;
                core.take_due(&mut self.due);
                deadline
            };
            self.dispatch_due(&dev);
            let more = self.outbox.len() >= BATCH;
            if !self.outbox.is_empty() {
                self.send_all().await;
                let Some(shared) = dev.upgrade() else {
                    return DriverEnd::DeviceGone;
                };
                shared.core().inline.driver_sending = false;
            }
            if more {
                // Output is pending; take what arrived meanwhile, then send again.
                if self.receive_ready(&dev).is_none() {
                    return DriverEnd::DeviceGone;
                }
                tokio::task::yield_now().await;
                continue;
            }
            let start = self.port.start;
            let sleep = async {
                match deadline {
                    Some(d) => {
                        let at = start + d.since_start();
                        tokio::time::sleep_until(at.into()).await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                _ = shutdown.notified() => {
                    if dev.strong_count() == 0 {
                        return DriverEnd::DeviceGone;
                    }
                }
                r = self.port.socket.readable() => match r {
                    Ok(()) => match self.receive_ready(&dev) {
                        None => return DriverEnd::DeviceGone,
                        // What arrived went to the links' CQ handlers,
                        // which woke a mux task (and it a consumer): they
                        // run before this turn's ACKs are sent (docs/soft-provider.md §
                        // "ACKs after the receivers").
                        // With nothing to send the yield orders nothing,
                        // and it would cost a worker wake-up (§ "A yield
                        // only before output").
                        Some(handled) if handled > 0 && output_pending(&dev) => {
                            tokio::task::yield_now().await
                        }
                        Some(_) => {}
                    },
                    Err(e) => tracing::debug!(error = %e, "soft RoCE receive failed"),
                },
                _ = kick.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// Runs the handlers of the CQs this turn added completions to, with no
    /// lock held: the receiving link takes its batch now, not a task hop
    /// later (docs/soft-provider.md § "Completions handled in the driver's
    /// turn"). One that panics is counted and left out from then on.
    fn dispatch_due(&mut self, dev: &Weak<DeviceShared>) {
        let panicked = self.due.drain(..).filter(|cq| !cq.dispatch()).count() as u64;
        if let Some(shared) = dev.upgrade().filter(|_| panicked > 0) {
            shared.core().stats.cq_handler_panics += panicked;
        }
    }

    /// Sends the turn's packets, waiting for room in the socket buffer.
    async fn send_all(&mut self) {
        send_outbox(&self.port, &self.outbox).await;
    }

    /// Handle what is already queued, a `recvmmsg` at a time, without
    /// waiting; how many datagrams, or `None` once the device is gone.
    fn receive_ready(&mut self, dev: &Weak<DeviceShared>) -> Option<usize> {
        let mut handled = 0;
        for _ in 0..RX_CALLS_PER_TURN {
            let mut bufs: Vec<IoSliceMut<'_>> = self
                .rx
                .chunks_mut(self.rx_slot)
                .map(IoSliceMut::new)
                .collect();
            let port = &self.port;
            // Where the platform takes one datagram per call, a full call
            // says nothing about the queue.
            let slots = self.meta.len().min(quinn_udp::BATCH_SIZE);
            let mut received = 0;
            let r = port.socket.try_io(Interest::READABLE, || {
                received = port
                    .state
                    .recv((&port.socket).into(), &mut bufs, &mut self.meta)?;
                if received < slots {
                    // Fewer than one call can take: the queue was empty. Reported as
                    // `WouldBlock` so tokio clears the readiness now, instead
                    // of one more turn and `recvmmsg` to learn it; a datagram
                    // that lands after the call raises a new edge (epoll is
                    // edge-triggered per arrival), and tokio keeps a
                    // readiness set by an event newer than the one this read
                    // consumed.
                    return Err(std::io::ErrorKind::WouldBlock.into());
                }
                Ok(received)
            });
            drop(bufs);
            let drained = match r {
                Ok(_) => false,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => true,
                Err(e) => {
                    tracing::debug!(error = %e, "soft RoCE receive failed");
                    return Some(handled);
                }
            };
            let n = received;
            if n == 0 {
                return Some(handled);
            }
            stages::mark(Stage::Received);
            let shared = dev.upgrade()?;
            let now = self.now();
            let mut core = shared.core();
            core.defer_completions();
            for (meta, buf) in self.meta[..n].iter().zip(self.rx.chunks(self.rx_slot)) {
                let from = meta.addr;
                let src = gid_of(from.ip());
                let len = meta.len.min(buf.len());
                let stride = if meta.stride == 0 { len } else { meta.stride };
                for datagram in buf[..len].chunks(stride.max(1)) {
                    core.handle_datagram(now, src, from.port(), datagram);
                    handled += 1;
                }
            }
            core.take_due(&mut self.due);
            drop(core);
            self.dispatch_due(dev);
            if drained {
                break;
            }
        }
        Some(handled)
    }
}

/// Whether the device has packets for the wire: a backlog, or a QP's.
fn output_pending(dev: &Weak<DeviceShared>) -> bool {
    dev.upgrade().is_some_and(|shared| {
        let core = shared.core();
        !core.inline.backlog.is_empty() || core.wants_transmit()
    })
}

/// How many packets from the front of `out` one GSO send can carry: same
/// destination, every one but the last exactly the first's size, the last no
/// larger, at most `max_segments` and [`MAX_GSO_BYTES`].
fn gso_run(out: &[(SocketAddr, std::ops::Range<usize>)], max_segments: usize) -> usize {
    let Some((dst, first)) = out.first() else {
        return 0;
    };
    let segment = first.len();
    let mut n = 1;
    let mut bytes = segment;
    while n < out.len().min(max_segments) {
        let (d, r) = &out[n];
        if d != dst || r.len() > segment || bytes + r.len() > MAX_GSO_BYTES {
            break;
        }
        bytes += r.len();
        n += 1;
        if r.len() < segment {
            break;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packets(spec: &[(u16, usize)]) -> Vec<(SocketAddr, std::ops::Range<usize>)> {
        let mut at = 0;
        spec.iter()
            .map(|&(port, len)| {
                let r = at..at + len;
                at += len;
                (SocketAddr::from(([127, 0, 0, 1], port)), r)
            })
            .collect()
    }

    #[test]
    fn a_gso_run_is_equal_segments_to_one_peer_then_one_shorter() {
        // First, Middle, Middle, Last (shorter), then the next message.
        let out = packets(&[(1, 1080), (1, 1080), (1, 1080), (1, 500), (1, 1080)]);
        assert_eq!(gso_run(&out, 64), 4);
        assert_eq!(gso_run(&out[4..], 64), 1);
        assert_eq!(gso_run(&out, 2), 2, "capped by the kernel's segment limit");
        assert_eq!(gso_run(&out, 1), 1, "no GSO: one packet a send");
        assert_eq!(gso_run(&[], 64), 0);
    }

    #[test]
    fn a_gso_run_stops_at_another_peer_a_longer_packet_or_64_kib() {
        let out = packets(&[(1, 1080), (2, 1080)]);
        assert_eq!(gso_run(&out, 64), 1, "another destination");
        let out = packets(&[(1, 20), (1, 1080)]);
        assert_eq!(gso_run(&out, 64), 1, "a segment longer than the first");
        let out = packets(&[(1, 4152); 20]);
        let n = gso_run(&out, 64);
        assert_eq!(n, MAX_GSO_BYTES / 4152);
        assert!(n * 4152 <= MAX_GSO_BYTES);
    }

    #[test]
    fn subnets_match_by_mask_and_family() {
        let ip = |s: &str| s.parse::<IpAddr>().expect("literal");
        assert!(same_subnet(
            ip("127.0.0.1"),
            ip("127.0.0.2"),
            ip("255.0.0.0")
        ));
        assert!(!same_subnet(
            ip("10.0.0.1"),
            ip("10.0.1.1"),
            ip("255.255.255.0")
        ));
        assert!(!same_subnet(ip("10.0.0.1"), ip("10.0.0.1"), ip("0.0.0.0")));
        assert!(!same_subnet(ip("::1"), ip("127.0.0.1"), ip("255.0.0.0")));
        assert!(same_subnet(ip("fd00::1"), ip("fd00::2"), ip("ffff:ffff::")));
    }

    #[test]
    fn without_a_known_link_the_active_mtu_fits_ethernet() {
        let config = |link_mtu| UdpConfig {
            link_mtu,
            // 192.0.2.0/24 is TEST-NET-1: on no interface here.
            bind: SocketAddr::from(([192, 0, 2, 1], 0)),
            ..UdpConfig::default()
        };
        assert_eq!(active_mtu(&config(None)).ok(), Some(Mtu::Mtu1024));
        assert_eq!(active_mtu(&config(Some(9000))).ok(), Some(Mtu::Mtu4096));
        assert_eq!(active_mtu(&config(Some(1500))).ok(), Some(Mtu::Mtu1024));
        assert!(active_mtu(&config(Some(100))).is_err());
    }
}
