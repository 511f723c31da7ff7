//! UDP driver: one tokio task per device owns the socket and drives the core.
//!
//! ```text
//!  loop (biased select):  shutdown ─► exit
//!                         readable ─► recvmmsg (+GRO) ─► core.handle_datagram × n, one lock
//!                         kick (a verbs call) / timer deadline ─► fall through
//!        then: core.handle_timeout(now); poll_transmit ─► arena ─► sendmsg (+GSO runs)
//! ```
//!
//! Owner: the driver task holds only a `Weak` to the device between turns,
//! so dropping the last handle ends it. Wall-clock time is mapped onto
//! [`Instant`] from the moment the device opened. Batched socket calls come
//! from `quinn-udp` (no `unsafe` here): one `sendmsg` carries a run of
//! equal-size packets to one peer (UDP GSO), one `recvmmsg` takes many
//! datagrams, GRO-merged or not. Without GSO every packet goes alone.
//! Rulings and measurements: docs/soft-provider.md § "The UDP driver batches".

use std::io::IoSliceMut;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Weak};

use quinn_udp::{RecvMeta, Transmit as UdpTransmit, UdpSocketState};
use tokio::io::Interest;
use tokio::net::UdpSocket;

use super::device::DeviceCore;
use super::wire::MAX_OVERHEAD;
use super::{DeviceShared, Instant, SoftConfig, SoftDevice};
use crate::verbs::{Gid, Mtu, VerbsError};

/// Packets emitted per turn, so receiving is not starved by a long send queue
/// (one requester window is 128 PSNs).
const BATCH: usize = 64;
/// Largest packet the provider emits.
const MAX_PACKET: usize = 4096 + MAX_OVERHEAD;
/// Bytes one GSO send may carry (a UDP datagram's payload limit).
const MAX_GSO_BYTES: usize = 65_507;
/// Receive buffers per `recvmmsg`: with GRO each holds up to 64 KiB of merged
/// datagrams, without it one datagram.
const RX_SLOTS_GRO: usize = 8;
const RX_SLOTS_PLAIN: usize = 32;
/// `recvmmsg` calls per turn before the driver transmits again.
const RX_CALLS_PER_TURN: usize = 4;

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
            let fits = Mtu::for_link_mtu(link).ok_or(VerbsError::InvalidAttr {
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
        let core = DeviceCore::new(gid_of(local.ip()), local.port(), active_mtu, seed);
        let dev = SoftDevice::from_core(core);
        let weak = Arc::downgrade(dev.shared());
        let kick = dev.shared().kick.clone();
        let shutdown = dev.shared().shutdown.clone();
        let driver = Driver::new(socket, state, config.segmentation_offload);
        tokio::spawn(driver.run(weak, kick, shutdown));
        Ok(dev)
    }
}

/// The socket side of the driver task: batched I/O and its buffers.
struct Driver {
    socket: UdpSocket,
    state: UdpSocketState,
    gso: bool,
    start: std::time::Instant,
    /// Packets of one turn, emitted back to back.
    arena: Vec<u8>,
    /// (destination, range in `arena`) per packet of the turn.
    out: Vec<(SocketAddr, std::ops::Range<usize>)>,
    rx: Vec<u8>,
    rx_slot: usize,
    meta: Vec<RecvMeta>,
}

impl Driver {
    fn new(socket: UdpSocket, state: UdpSocketState, gso: bool) -> Driver {
        let (slots, slot) = if state.gro_segments() > 1 {
            (RX_SLOTS_GRO, 1 << 16)
        } else {
            (RX_SLOTS_PLAIN, MAX_PACKET)
        };
        let slots = slots.clamp(1, quinn_udp::BATCH_SIZE.max(1));
        Driver {
            socket,
            state,
            gso,
            start: std::time::Instant::now(),
            arena: Vec::with_capacity(BATCH * MAX_PACKET),
            out: Vec::with_capacity(BATCH),
            rx: vec![0; slots * slot],
            rx_slot: slot,
            meta: vec![RecvMeta::default(); slots],
        }
    }

    fn now(&self) -> Instant {
        Instant::from_start(self.start.elapsed())
    }

    async fn run(
        mut self,
        dev: Weak<DeviceShared>,
        kick: Arc<tokio::sync::Notify>,
        shutdown: Arc<tokio::sync::Notify>,
    ) {
        loop {
            // Handle timers and collect output under the lock; send without it.
            let deadline = {
                let Some(shared) = dev.upgrade() else { return };
                let mut core = shared.core();
                let t = self.now();
                core.handle_timeout(t);
                self.collect(&mut core, t);
                core.poll_timeout()
            };
            let more = self.out.len() == BATCH;
            self.send_all().await;
            if more {
                // Output is pending; take what arrived meanwhile, then send again.
                if !self.receive_ready(&dev) {
                    return;
                }
                tokio::task::yield_now().await;
                continue;
            }
            let start = self.start;
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
                        return;
                    }
                }
                r = self.socket.readable() => match r {
                    Ok(()) => {
                        if !self.receive_ready(&dev) {
                            return;
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "soft RoCE receive failed"),
                },
                _ = kick.notified() => {}
                _ = sleep => {}
            }
        }
    }

    /// Emit up to a batch of packets into the arena.
    fn collect(&mut self, core: &mut DeviceCore, now: Instant) {
        self.arena.clear();
        self.out.clear();
        while self.out.len() < BATCH {
            let start = self.arena.len();
            self.arena.resize(start + MAX_PACKET, 0);
            let Some(x) = core.poll_transmit(now, &mut self.arena[start..]) else {
                self.arena.truncate(start);
                break;
            };
            self.arena.truncate(start + x.len);
            self.out
                .push((addr_of(x.dst, x.dst_port), start..start + x.len));
        }
    }

    /// Send the turn's packets, a GSO run per `sendmsg` where possible.
    async fn send_all(&mut self) {
        let mut i = 0;
        while i < self.out.len() {
            let max_segments = if self.gso {
                self.state.max_gso_segments()
            } else {
                1
            };
            let n = gso_run(&self.out[i..], max_segments);
            let (dst, first) = self.out[i].clone();
            let end = self.out[i + n - 1].1.end;
            let segment = first.len();
            let sent = self.send(dst, first.start..end, segment).await;
            if !sent && n > 1 {
                // GSO refused (the state has turned it off): one by one.
                for (dst, range) in self.out[i..i + n].iter().cloned() {
                    let len = range.len();
                    self.send(dst, range, len).await;
                }
            }
            i += n;
        }
    }

    /// One `sendmsg`; false when it failed for a reason other than a full buffer.
    async fn send(&self, dst: SocketAddr, range: std::ops::Range<usize>, segment: usize) -> bool {
        let transmit = UdpTransmit {
            destination: dst,
            ecn: None,
            contents: &self.arena[range],
            segment_size: Some(segment),
            src_ip: None,
        };
        loop {
            let r = self.socket.try_io(Interest::WRITABLE, || {
                self.state.try_send((&self.socket).into(), &transmit)
            });
            match r {
                Ok(()) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Err(e) = self.socket.writable().await {
                        tracing::debug!(error = %e, "soft RoCE send failed");
                        return false;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, %dst, "soft RoCE send failed");
                    return false;
                }
            }
        }
    }

    /// Handle what is already queued, a `recvmmsg` at a time, without
    /// waiting; false once the device is gone.
    fn receive_ready(&mut self, dev: &Weak<DeviceShared>) -> bool {
        for _ in 0..RX_CALLS_PER_TURN {
            let mut bufs: Vec<IoSliceMut<'_>> = self
                .rx
                .chunks_mut(self.rx_slot)
                .map(IoSliceMut::new)
                .collect();
            let r = self.socket.try_io(Interest::READABLE, || {
                self.state
                    .recv((&self.socket).into(), &mut bufs, &mut self.meta)
            });
            drop(bufs);
            let n = match r {
                Ok(n) => n,
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::WouldBlock {
                        tracing::debug!(error = %e, "soft RoCE receive failed");
                    }
                    return true;
                }
            };
            let Some(shared) = dev.upgrade() else {
                return false;
            };
            let now = self.now();
            let mut core = shared.core();
            for (meta, buf) in self.meta[..n].iter().zip(self.rx.chunks(self.rx_slot)) {
                let from = meta.addr;
                let src = gid_of(from.ip());
                let len = meta.len.min(buf.len());
                let stride = if meta.stride == 0 { len } else { meta.stride };
                for datagram in buf[..len].chunks(stride.max(1)) {
                    core.handle_datagram(now, src, from.port(), datagram);
                }
            }
            if n < self.meta.len() {
                return true;
            }
        }
        true
    }
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
