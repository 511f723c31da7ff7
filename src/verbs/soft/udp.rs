//! UDP driver: one tokio task per device owns the socket and drives the core.
//!
//! ```text
//!  loop (biased select):  shutdown ─► exit
//!                         datagram ─► core.handle_datagram (drain up to a batch)
//!                         kick (a verbs call) / timer deadline ─► fall through
//!        then: core.handle_timeout(now); poll_transmit ─► send_to, bounded per turn
//! ```
//!
//! Owner: the driver task holds only a `Weak` to the device between turns,
//! so dropping the last handle ends it. Wall-clock time is mapped onto
//! [`Instant`] from the moment the device opened. `IP_PMTUDISC_DO` is not
//! set: neither std, tokio nor socket2 0.6 exposes it safely; the path MTU
//! is configured (default 1024, which fits a 1500-byte Ethernet MTU).

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Weak};

use tokio::net::UdpSocket;

use super::device::DeviceCore;
use super::wire::MAX_OVERHEAD;
use super::{DeviceShared, Instant, SoftConfig, SoftDevice};
use crate::verbs::{Gid, Mtu, VerbsError};

/// Datagrams handled per turn in each direction, so neither starves the other.
const BATCH: usize = 64;

/// Configuration of a UDP-driven soft device.
#[derive(Clone, Debug)]
pub struct UdpConfig {
    /// Address to bind; port 0 picks an ephemeral port (4791 would collide
    /// with kernel rxe). Must be a concrete IP: it is the device's GID.
    pub bind: SocketAddr,
    /// Device settings.
    pub soft: SoftConfig,
    /// `SO_RCVBUF` and `SO_SNDBUF` to ask for (the kernel caps them at
    /// `net.core.rmem_max`/`wmem_max`). A window of 128 packets must fit, or
    /// the receiving socket drops the tail of a burst and recovery waits
    /// for the local ACK timeout.
    pub socket_buffer: usize,
    /// MTU of the link under the bind address (e.g. from
    /// [`interface_mtu`]); caps the active MTU to what fits
    /// (1500 → 1024). `None` keeps `soft.active_mtu`.
    pub link_mtu: Option<usize>,
}

/// The MTU of network interface `name`, from `/sys/class/net/<name>/mtu`.
pub fn interface_mtu(name: &str) -> std::io::Result<usize> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))?;
    text.trim()
        .parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "MTU is not a number"))
}

impl Default for UdpConfig {
    fn default() -> Self {
        UdpConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            soft: SoftConfig::default(),
            socket_buffer: 4 << 20,
            link_mtu: None,
        }
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

fn bind(config: &UdpConfig) -> std::io::Result<UdpSocket> {
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
    UdpSocket::from_std(socket.into())
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
        let socket = bind(&config).map_err(io("bind"))?;
        let local = socket.local_addr().map_err(io("local_addr"))?;
        let seed = config.soft.seed.unwrap_or_else(rand::random);
        let active_mtu = match config.link_mtu {
            Some(link) => {
                let fits = Mtu::for_link_mtu(link).ok_or(VerbsError::InvalidAttr {
                    attr: "link_mtu below the smallest RoCE MTU",
                })?;
                fits.min(config.soft.active_mtu)
            }
            None => config.soft.active_mtu,
        };
        let core = DeviceCore::new(gid_of(local.ip()), local.port(), active_mtu, seed);
        let dev = SoftDevice::from_core(core);
        let weak = Arc::downgrade(dev.shared());
        let kick = dev.shared().kick.clone();
        let shutdown = dev.shared().shutdown.clone();
        tokio::spawn(run(socket, weak, kick, shutdown));
        Ok(dev)
    }
}

async fn run(
    socket: UdpSocket,
    dev: Weak<DeviceShared>,
    kick: Arc<tokio::sync::Notify>,
    shutdown: Arc<tokio::sync::Notify>,
) {
    let start = std::time::Instant::now();
    let now = || Instant::from_start(start.elapsed());
    let mut rx = vec![0u8; 65_536];
    const MAX_PACKET: usize = 4096 + MAX_OVERHEAD;
    // Packets of one turn are emitted straight into one arena.
    let mut arena: Vec<u8> = Vec::with_capacity(BATCH * MAX_PACKET);
    let mut out: Vec<(SocketAddr, std::ops::Range<usize>)> = Vec::with_capacity(BATCH);
    loop {
        // Handle timers and collect output under the lock; send without it.
        let deadline = {
            let Some(shared) = dev.upgrade() else { return };
            let mut core = shared.core();
            let t = now();
            core.handle_timeout(t);
            arena.clear();
            while out.len() < BATCH {
                let start = arena.len();
                arena.resize(start + MAX_PACKET, 0);
                let Some(x) = core.poll_transmit(t, &mut arena[start..]) else {
                    arena.truncate(start);
                    break;
                };
                arena.truncate(start + x.len);
                out.push((addr_of(x.dst, x.dst_port), start..start + x.len));
            }
            core.poll_timeout()
        };
        let more = out.len() == BATCH;
        for (addr, range) in out.drain(..) {
            if let Err(e) = socket.send_to(&arena[range], addr).await {
                tracing::debug!(error = %e, %addr, "soft RoCE send failed");
            }
        }
        if more {
            // Output is pending; take what arrived meanwhile, then send again.
            receive_ready(&socket, &dev, &mut rx, now());
            tokio::task::yield_now().await;
            continue;
        }
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
            r = socket.recv_from(&mut rx) => match r {
                Ok((n, from)) => {
                    let Some(shared) = dev.upgrade() else { return };
                    shared.core().handle_datagram(now(), gid_of(from.ip()), from.port(), &rx[..n]);
                    drop(shared);
                    receive_ready(&socket, &dev, &mut rx, now());
                }
                Err(e) => tracing::debug!(error = %e, "soft RoCE receive failed"),
            },
            _ = kick.notified() => {}
            _ = sleep => {}
        }
    }
}

/// Handle up to a batch of datagrams that are already queued, without waiting.
fn receive_ready(socket: &UdpSocket, dev: &Weak<DeviceShared>, rx: &mut [u8], now: Instant) {
    let Some(shared) = dev.upgrade() else { return };
    for _ in 0..BATCH {
        match socket.try_recv_from(rx) {
            Ok((n, from)) => {
                shared
                    .core()
                    .handle_datagram(now, gid_of(from.ip()), from.port(), &rx[..n]);
            }
            Err(_) => break,
        }
    }
}
