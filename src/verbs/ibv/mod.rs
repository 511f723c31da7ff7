//! The libibverbs provider (cargo feature `ibverbs`): the verbs seam over
//! kernel RDMA devices — hardware RoCE NICs and kernel soft-RoCE (`rdma_rxe`).
//!
//! ```text
//!  IbvDevice ── Arc<DevInner> ── sideway DeviceContext (ibv_context) ── async-event task
//!     ├─ IbvPd  ── sideway ProtectionDomain
//!     ├─ IbvMr  ── sideway MemoryRegion over a page-aligned buffer this crate owns
//!     ├─ IbvCq  ── sideway BasicCompletionQueue + CompletionChannel (fd under tokio AsyncFd)
//!     └─ IbvQp  ── sideway BasicQueuePair (modify/query); post and poll through rdma-mummy-sys
//! ```
//!
//! libibverbs is loaded at run time by `rdma-mummy-sys` (a `dlopen` of
//! `libibverbs.so.1`), so one binary runs on hosts with and without RDMA:
//! without the library [`list_devices`] and [`IbvDevice::open`] return
//! [`OpenError::NoLibibverbs`], naming the package to install.
//!
//! What the provider checks itself, so the seam's contract holds whatever the
//! kernel driver does: QP state transitions (RESET → INIT → RTR → RTS, any →
//! ERR/RESET), attribute ranges, SGE bounds, access flags, protection domains
//! and queue depths (drivers round depths up; the provider enforces the depth
//! asked for). Work request ids are translated (a per-QP sequence number is
//! posted) so error completions, whose opcode is undefined, are still
//! attributed to the right queue and user `wr_id`.
//!
//! Addressing is RoCE only (GRH with a RoCEv2 GID). Native InfiniBand needs
//! LID addressing, which the seam's [`QpAddress`](super::QpAddress) does not
//! carry: opening an InfiniBand port fails with
//! [`OpenError::InfinibandUnsupported`]. See docs/rxe.md.
#![deny(clippy::undocumented_unsafe_blocks)]

mod cq;
mod qp;

use std::net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use sideway::ibverbs::AccessFlags as SwAccess;
use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu as SwMtu};
use sideway::ibverbs::protection_domain::ProtectionDomain;

pub use cq::IbvCq;
pub use qp::{IbvMr, IbvQp};

use super::{AccessFlags, Device, Gid, Mtu, PortAttr, QpCaps, VerbsError};

/// The UDP port kernel RoCEv2 devices send to and receive on.
pub const ROCE_UDP_PORT: u16 = 4791;

/// How to pick the device, port and GID, and the path attributes QPs use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbvConfig {
    /// Device name (`rxe0`, `mlx5_0`); `None` picks by `peer`, `source` or the first device.
    pub device: Option<String>,
    /// Pick the device whose netdev owns the route to this peer, and the GID of
    /// the source address the kernel would use to reach it.
    pub peer: Option<IpAddr>,
    /// Use the RoCEv2 GID of this local address (IPv4-mapped or IPv6).
    pub source: Option<IpAddr>,
    /// Use this GID index, overriding the search.
    pub gid_index: Option<u8>,
    /// Port number (1-based).
    pub port: u8,
    /// GRH traffic class (DSCP << 2 | ECN) of every QP.
    pub traffic_class: u8,
    /// Service level (0..=15; PCP on RoCE).
    pub service_level: u8,
    /// P_Key table index of every QP.
    pub pkey_index: u16,
    /// GRH hop limit.
    pub hop_limit: u8,
}

impl Default for IbvConfig {
    fn default() -> Self {
        IbvConfig {
            device: None,
            peer: None,
            source: None,
            gid_index: None,
            port: 1,
            traffic_class: 0,
            service_level: 0,
            pkey_index: 0,
            hop_limit: 64,
        }
    }
}

/// Why a device could not be listed or opened. Each message names the fix.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// `libibverbs.so.1` could not be loaded.
    #[error(
        "libibverbs.so.1 is not installed: install rdma-core userspace \
         (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers)"
    )]
    NoLibibverbs,
    /// libibverbs is there but lists no device.
    #[error(
        "no RDMA device: load a driver or create soft-RoCE \
         (modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0); \
         in a container pass --device /dev/infiniband"
    )]
    NoDevice,
    /// No device of that name.
    #[error("no RDMA device named {name:?} (have: {have})")]
    NoSuchDevice {
        /// Name asked for.
        name: String,
        /// Names present.
        have: String,
    },
    /// No GID matches the address asked for (or no RoCEv2 GID at all).
    #[error(
        "no RoCEv2 GID for {what} on any device: assign the address to the RDMA \
         device's netdev (the GID table follows it), or pass a GID index"
    )]
    NoGid {
        /// What was looked for.
        what: String,
    },
    /// The port is native InfiniBand.
    #[error("{name} port {port} is InfiniBand: LID addressing is not supported, only RoCE")]
    InfinibandUnsupported {
        /// Device.
        name: String,
        /// Port.
        port: u8,
    },
    /// `RLIMIT_MEMLOCK` is below what registration needs.
    #[error(
        "locked-memory limit is {limit} bytes, below {needed}: raise it \
         (ulimit -l unlimited; systemd LimitMEMLOCK=infinity; docker --ulimit memlock=-1 \
         or --cap-add IPC_LOCK)"
    )]
    Memlock {
        /// Current soft limit.
        limit: u64,
        /// Bytes needed.
        needed: u64,
    },
    /// A verbs call failed.
    #[error("{op}: {err}")]
    Verbs {
        /// The call.
        op: &'static str,
        /// Its error text.
        err: String,
    },
}

/// One RDMA device as libibverbs lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IbvDeviceInfo {
    /// Device name.
    pub name: String,
    /// Port 1 state, link layer and active MTU, when the device could be opened.
    pub port: Option<PortSummary>,
    /// RoCEv2 GIDs of port 1: (index, GID, netdev name).
    pub roce_v2_gids: Vec<(u8, Gid, String)>,
}

/// A port's state in a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSummary {
    /// True when the port is ACTIVE.
    pub active: bool,
    /// True for an Ethernet (RoCE) link layer.
    pub ethernet: bool,
    /// Active MTU.
    pub active_mtu: Mtu,
}

/// Fork safety of registered memory (`ibv_is_fork_initialized`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForkSafety {
    /// The kernel copies pinned pages on fork (Linux ≥ 5.13): fork is safe.
    Unneeded,
    /// `ibv_fork_init` ran (or `RDMAV_FORK_SAFE=1`): fork is safe, at a cost.
    Enabled,
    /// Neither: a child touching registered pages can corrupt DMA. Do not fork
    /// after registering memory, or set `RDMAV_FORK_SAFE=1`.
    Disabled,
}

/// What [`preflight`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preflight {
    /// Devices listed.
    pub devices: Vec<IbvDeviceInfo>,
    /// Soft `RLIMIT_MEMLOCK` in bytes (`None` = unlimited).
    pub memlock: Option<u64>,
    /// Fork safety.
    pub fork: ForkSafety,
}

/// Devices libibverbs lists, with their RoCEv2 GIDs (for `qpmux devices`).
pub fn list_devices() -> Result<Vec<IbvDeviceInfo>, OpenError> {
    let list = device_list()?;
    let mut out = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        let Ok(ctx) = dev.open() else {
            out.push(IbvDeviceInfo {
                name,
                port: None,
                roce_v2_gids: Vec::new(),
            });
            continue;
        };
        let port = ctx.query_port(1).ok().map(|p| PortSummary {
            active: matches!(
                p.port_state(),
                sideway::ibverbs::device_context::PortState::Active
            ),
            ethernet: matches!(p.link_layer(), LinkLayer::Ethernet),
            active_mtu: mtu_from(p.active_mtu()),
        });
        let gids = roce_v2_gids(&ctx, 1);
        out.push(IbvDeviceInfo {
            name,
            port,
            roce_v2_gids: gids,
        });
    }
    Ok(out)
}

/// Check what running over libibverbs needs: the library, a device, the
/// locked-memory limit for `memlock_needed` bytes of registrations, fork safety.
pub fn preflight(memlock_needed: u64) -> Result<Preflight, OpenError> {
    let devices = list_devices()?;
    if devices.is_empty() {
        return Err(OpenError::NoDevice);
    }
    let memlock = memlock_limit();
    if let Some(limit) = memlock {
        if limit < memlock_needed && !has_ipc_lock() {
            return Err(OpenError::Memlock {
                limit,
                needed: memlock_needed,
            });
        }
    }
    Ok(Preflight {
        devices,
        memlock,
        fork: fork_safety(),
    })
}

/// The soft `RLIMIT_MEMLOCK` in bytes, `None` when unlimited.
pub fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid, exclusively borrowed `lim`.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    }
}

/// True when this process has CAP_IPC_LOCK (the memlock limit then does not apply).
fn has_ipc_lock() -> bool {
    // CapEff in /proc/self/status, bit 14 = CAP_IPC_LOCK.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Fork safety as libibverbs reports it.
pub fn fork_safety() -> ForkSafety {
    if !libibverbs_loaded() {
        return ForkSafety::Disabled;
    }
    // SAFETY: takes no arguments; with libibverbs loaded it returns an enum value.
    let v = unsafe { rdma_mummy_sys::ibv_is_fork_initialized() };
    match v as u32 {
        1 => ForkSafety::Enabled,
        2 => ForkSafety::Unneeded,
        _ => ForkSafety::Disabled,
    }
}

/// True when `libibverbs.so.1` is loaded in this process (rdma-mummy-sys
/// opens it from a constructor at start-up).
pub fn libibverbs_loaded() -> bool {
    let name = c"libibverbs.so.1";
    // SAFETY: `name` is a NUL-terminated string; RTLD_NOLOAD only looks the
    // library up, and the handle it returns is released at once.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        if h.is_null() {
            false
        } else {
            libc::dlclose(h);
            true
        }
    }
}

fn device_list() -> Result<DeviceList, OpenError> {
    if !libibverbs_loaded() {
        return Err(OpenError::NoLibibverbs);
    }
    match DeviceList::new() {
        Ok(l) => Ok(l),
        Err(e) => {
            let text = error_chain(&e);
            // ENOSYS: no kernel RDMA support at all; treat as "no device".
            if text.contains("os error 38") || text.contains("not implemented") {
                Err(OpenError::NoDevice)
            } else {
                Err(OpenError::Verbs {
                    op: "ibv_get_device_list",
                    err: text,
                })
            }
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

pub(crate) fn mtu_from(m: SwMtu) -> Mtu {
    match m {
        SwMtu::Mtu256 => Mtu::Mtu256,
        SwMtu::Mtu512 => Mtu::Mtu512,
        SwMtu::Mtu1024 => Mtu::Mtu1024,
        SwMtu::Mtu2048 => Mtu::Mtu2048,
        SwMtu::Mtu4096 => Mtu::Mtu4096,
    }
}

pub(crate) fn mtu_to(m: Mtu) -> SwMtu {
    match m {
        Mtu::Mtu256 => SwMtu::Mtu256,
        Mtu::Mtu512 => SwMtu::Mtu512,
        Mtu::Mtu1024 => SwMtu::Mtu1024,
        Mtu::Mtu2048 => SwMtu::Mtu2048,
        Mtu::Mtu4096 => SwMtu::Mtu4096,
    }
}

pub(crate) fn access_to(a: AccessFlags) -> SwAccess {
    let mut f = SwAccess::none();
    if a.contains(AccessFlags::LOCAL_WRITE) {
        f |= SwAccess::LocalWrite;
    }
    if a.contains(AccessFlags::REMOTE_WRITE) {
        f |= SwAccess::RemoteWrite;
    }
    if a.contains(AccessFlags::REMOTE_READ) {
        f |= SwAccess::RemoteRead;
    }
    f
}

fn roce_v2_gids(ctx: &Arc<DeviceContext>, port: u8) -> Vec<(u8, Gid, String)> {
    let Ok(table) = ctx.query_gid_table() else {
        return Vec::new();
    };
    table
        .iter()
        .filter(|e| e.port_num() == port as u32 && matches!(e.gid_type(), GidType::RoceV2))
        .filter(|e| !e.gid().is_zero())
        // An address handle names its source GID in a u8, and u8::MAX
        // means "none found" below: larger indices cannot be used.
        .filter_map(|e| {
            let index = u8::try_from(e.gid_index()).ok().filter(|&i| i != u8::MAX)?;
            Some((index, Gid(e.gid().raw), e.netdev_name().unwrap_or_default()))
        })
        .collect()
}

/// The local address the kernel would use to reach `peer` (a connected UDP
/// socket sends nothing).
pub fn source_address_for(peer: IpAddr) -> std::io::Result<IpAddr> {
    let bind: SocketAddr = match peer {
        IpAddr::V4(_) => "0.0.0.0:0".parse().expect("literal"),
        IpAddr::V6(_) => "[::]:0".parse().expect("literal"),
    };
    let sock = UdpSocket::bind(bind)?;
    sock.connect(SocketAddr::new(peer, ROCE_UDP_PORT))?;
    Ok(sock.local_addr()?.ip())
}

fn gid_of_ip(ip: IpAddr) -> Gid {
    match ip {
        IpAddr::V4(v4) => Gid::from_ipv4(v4),
        IpAddr::V6(v6) => Gid(v6.octets()),
    }
}

static NEXT_PD_ID: AtomicU64 = AtomicU64::new(1);

/// Events libibverbs reported asynchronously (`ibv_get_async_event`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    /// A QP hit a fatal error and is in ERR (`IBV_EVENT_QP_FATAL` and the
    /// request/access error variants).
    QpFatal {
        /// The QP.
        qpn: super::Qpn,
        /// The raw `ibv_event_type`.
        event: u32,
    },
    /// A CQ overran (`IBV_EVENT_CQ_ERR`).
    CqError,
    /// The port became active.
    PortActive {
        /// The port.
        port: u8,
    },
    /// The port went down.
    PortError {
        /// The port.
        port: u8,
    },
    /// The GID table changed (an address came or went): GID indices may now differ.
    GidChange {
        /// The port.
        port: u8,
    },
    /// The device failed; reopen it.
    DeviceFatal,
    /// Any other event type.
    Other {
        /// The raw `ibv_event_type`.
        event: u32,
    },
}

/// Async events [`IbvDevice::async_events`] keeps between drains. A node
/// nobody drains gets one per QP that errs (a peer can cause that once an
/// epoch), so the list keeps the newest, not all.
pub const EVENTS_KEPT: usize = 256;

/// The newest [`EVENTS_KEPT`] async events, oldest first. When full, the
/// oldest QP error goes first, so a peer erring QPs cannot push out the
/// events an operator must act on (`GidChange`, `DeviceFatal`, a port's).
#[derive(Debug, Default)]
pub(crate) struct EventLog {
    kept: std::collections::VecDeque<AsyncEvent>,
}

impl EventLog {
    pub(crate) fn push(&mut self, event: AsyncEvent) {
        if self.kept.len() == EVENTS_KEPT {
            let qp_error = self
                .kept
                .iter()
                .position(|e| matches!(e, AsyncEvent::QpFatal { .. }));
            self.kept.remove(qp_error.unwrap_or(0));
        }
        self.kept.push_back(event);
    }

    fn drain(&mut self) -> Vec<AsyncEvent> {
        self.kept.drain(..).collect()
    }
}

pub(crate) struct DevInner {
    /// A shared `Arc`: every PD, CQ, channel and QP holds its own, so the
    /// context closes after the last of them whatever the field order;
    /// nothing here holds raw handles.
    pub(crate) ctx: Arc<DeviceContext>,
    pub(crate) name: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) attr: PortAttr,
    pub(crate) cfg: IbvConfig,
    pub(crate) events: Mutex<EventLog>,
    pub(crate) stop_events: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

/// An opened libibverbs device, one port, one GID. Cheap to clone.
///
/// # Safety
///
/// Lifetime invariants: every PD, CQ, channel and QP holds an `Arc` of the
/// sideway `DeviceContext`, so `ibv_close_device` runs after the last of
/// them; the async-event task holds one too (see `cq::EventWatch`).
///
/// Destroy order when the last `IbvDevice` clone goes:
/// 1. the async-event task is told to stop, and goes when it next runs
///    (asynchronously, so possibly after the steps below): it deregisters
///    the context's async fd from the reactor, then drops its context `Arc`;
/// 2. QPs, then CQs and PDs, go as their owners drop them (each keeps what
///    it was created from);
/// 3. the context closes with its last `Arc`.
#[derive(Clone)]
pub struct IbvDevice {
    pub(crate) inner: Arc<DevInner>,
}

impl std::fmt::Debug for IbvDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbvDevice")
            .field("name", &self.inner.name)
            .field("port", &self.inner.port)
            .field("gid_index", &self.inner.gid_index)
            .finish()
    }
}

impl Drop for DevInner {
    fn drop(&mut self) {
        if let Some(tx) = self.stop_events.get_mut().ok().and_then(|s| s.take()) {
            let _ = tx.send(());
        }
    }
}

/// A protection domain of an [`IbvDevice`].
pub struct IbvPd {
    pub(crate) pd: Arc<ProtectionDomain>,
    pub(crate) id: u64,
}

impl IbvDevice {
    /// Open a device as `cfg` says. Called inside a tokio runtime, it also
    /// starts a task that reports async events ([`IbvDevice::async_events`]).
    pub fn open(cfg: IbvConfig) -> Result<IbvDevice, OpenError> {
        let list = device_list()?;
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        if names.is_empty() {
            return Err(OpenError::NoDevice);
        }
        let want_ip = match (cfg.source, cfg.peer) {
            (Some(ip), _) => Some(ip),
            (None, Some(peer)) => Some(source_address_for(peer).map_err(|e| OpenError::Verbs {
                op: "route to peer",
                err: e.to_string(),
            })?),
            (None, None) => None,
        };
        // Candidates: the named device, or all of them.
        let mut chosen = None;
        for dev in list.iter() {
            let name = dev.name();
            if cfg.device.as_ref().is_some_and(|n| *n != name) {
                continue;
            }
            let ctx = dev.open().map_err(|e| OpenError::Verbs {
                op: "ibv_open_device",
                err: error_chain(&e),
            })?;
            let gids = roce_v2_gids(&ctx, cfg.port);
            let index = match (cfg.gid_index, want_ip) {
                (Some(i), _) => Some(i),
                (None, Some(ip)) => {
                    let want = gid_of_ip(ip);
                    gids.iter().find(|g| g.1 == want).map(|g| g.0)
                }
                (None, None) => gids
                    .iter()
                    .find(|g| g.1.to_ipv4().is_some())
                    .or(gids.first())
                    .map(|g| g.0),
            };
            if let Some(i) = index {
                chosen = Some((name, ctx, i));
                break;
            }
            if cfg.device.is_some() {
                chosen = Some((name, ctx, u8::MAX));
                break;
            }
        }
        let Some((name, ctx, gid_index)) = chosen else {
            if let Some(n) = cfg.device.clone() {
                return Err(OpenError::NoSuchDevice {
                    name: n,
                    have: names.join(", "),
                });
            }
            return Err(OpenError::NoGid {
                what: want_ip.map_or("the default address".into(), |ip| ip.to_string()),
            });
        };
        let port = ctx.query_port(cfg.port).map_err(|e| OpenError::Verbs {
            op: "ibv_query_port",
            err: error_chain(&e),
        })?;
        if !matches!(port.link_layer(), LinkLayer::Ethernet) {
            return Err(OpenError::InfinibandUnsupported {
                name,
                port: cfg.port,
            });
        }
        if gid_index == u8::MAX {
            return Err(OpenError::NoGid {
                what: want_ip.map_or(name.clone(), |ip| format!("{ip} on {name}")),
            });
        }
        let dattr = ctx.query_device().map_err(|e| OpenError::Verbs {
            op: "ibv_query_device",
            err: error_chain(&e),
        })?;
        let sgid = ctx
            .query_gid(cfg.port, gid_index as u32)
            .map_err(|e| OpenError::Verbs {
                op: "ibv_query_gid",
                err: error_chain(&e),
            })?;
        let mut gid_table = vec![Gid(sgid.raw)];
        for (_, g, _) in roce_v2_gids(&ctx, cfg.port) {
            if !gid_table.contains(&g) {
                gid_table.push(g);
            }
        }
        let attr = PortAttr {
            active_mtu: mtu_from(port.active_mtu()),
            gid_table,
            udp_port: ROCE_UDP_PORT,
            max_qp_wr: dattr.max_qp_wr().max(0) as usize,
            max_sge: dattr.max_sge().max(0) as usize,
            // libibverbs reports no device-wide inline limit; QPs report theirs.
            max_inline_data: 256,
            max_cqe: dattr.max_cqe().max(0) as usize,
        };
        let inner = Arc::new(DevInner {
            ctx,
            name,
            port: cfg.port,
            gid_index,
            attr,
            cfg,
            events: Mutex::new(EventLog::default()),
            stop_events: Mutex::new(None),
        });
        cq::spawn_async_events(&inner);
        Ok(IbvDevice { inner })
    }

    /// The GID index QPs use as source.
    pub fn gid_index(&self) -> u8 {
        self.inner.gid_index
    }

    /// The source GID.
    pub fn gid(&self) -> Gid {
        self.inner.attr.gid_table[0]
    }

    /// The source GID as an IP address.
    pub fn gid_ip(&self) -> IpAddr {
        let v6 = Ipv6Addr::from(self.gid().0);
        v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
    }

    /// Drain the async events seen so far, the newest [`EVENTS_KEPT`] of
    /// them (each is also logged with `tracing` as it comes).
    pub fn async_events(&self) -> Vec<AsyncEvent> {
        self.inner.events.lock().expect("events lock").drain()
    }

    /// Read a port counter from sysfs (`hw_counters/<name>`, e.g. rxe's
    /// `send_rnr_err`), when the driver exposes it.
    pub fn hw_counter(&self, name: &str) -> Option<u64> {
        let path = format!(
            "/sys/class/infiniband/{}/ports/{}/hw_counters/{name}",
            self.inner.name, self.inner.port
        );
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    }
}

impl Device for IbvDevice {
    type Pd = IbvPd;
    type Mr = IbvMr;
    type Cq = IbvCq;
    type Qp = IbvQp;

    fn name(&self) -> &str {
        &self.inner.name
    }

    fn pins_memory(&self) -> bool {
        true
    }

    fn query_port(&self) -> PortAttr {
        let mut attr = self.inner.attr.clone();
        // The active MTU follows the netdev MTU; re-read it.
        if let Ok(p) = self.inner.ctx.query_port(self.inner.port) {
            attr.active_mtu = mtu_from(p.active_mtu());
        }
        attr
    }

    fn alloc_pd(&self) -> Result<IbvPd, VerbsError> {
        let pd = self
            .inner
            .ctx
            .alloc_pd()
            .map_err(|e| io_err("ibv_alloc_pd", &e))?;
        Ok(IbvPd {
            pd,
            id: NEXT_PD_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    fn reg_mr(&self, pd: &IbvPd, len: usize, access: AccessFlags) -> Result<IbvMr, VerbsError> {
        qp::reg_mr(pd, len, 1, access)
    }

    fn reg_chunked_mr(
        &self,
        pd: &IbvPd,
        chunk_len: usize,
        chunks: usize,
        access: AccessFlags,
    ) -> Result<IbvMr, VerbsError> {
        if chunk_len == 0 {
            return Err(VerbsError::InvalidAttr { attr: "chunk_len" });
        }
        if chunks == 0 {
            return Err(VerbsError::InvalidAttr { attr: "chunks" });
        }
        qp::reg_mr(pd, chunk_len, chunks, access)
    }

    fn create_cq(&self, depth: usize) -> Result<IbvCq, VerbsError> {
        if depth > self.inner.attr.max_cqe {
            return Err(VerbsError::CapExceeded {
                cap: "cq depth",
                got: depth,
                max: self.inner.attr.max_cqe,
            });
        }
        IbvCq::new(&self.inner, depth)
    }

    fn create_qp(
        &self,
        pd: &IbvPd,
        send_cq: &IbvCq,
        recv_cq: &IbvCq,
        caps: QpCaps,
    ) -> Result<IbvQp, VerbsError> {
        let a = &self.inner.attr;
        for (cap, got, max) in [
            ("max_send_wr", caps.max_send_wr, a.max_qp_wr),
            ("max_recv_wr", caps.max_recv_wr, a.max_qp_wr),
            ("max_sge", caps.max_sge, a.max_sge),
        ] {
            if got > max {
                return Err(VerbsError::CapExceeded { cap, got, max });
            }
        }
        IbvQp::new(&self.inner, pd, send_cq, recv_cq, caps)
    }
}

/// Map a verbs error to the seam's `Io` error (the kind carries the errno).
pub(crate) fn io_err(op: &'static str, e: &(dyn std::error::Error + 'static)) -> VerbsError {
    let mut src: Option<&dyn std::error::Error> = Some(e);
    let mut kind = std::io::ErrorKind::Other;
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            kind = io.kind();
            if io.raw_os_error() == Some(libc::ENOMEM) && op == "ibv_reg_mr" {
                return VerbsError::Io {
                    op: "ibv_reg_mr: cannot pin memory; raise the memlock limit \
                         (ulimit -l unlimited, docker --ulimit memlock=-1)",
                    kind,
                };
            }
            break;
        }
        src = s.source();
    }
    tracing::debug!("{op}: {}", error_chain(e));
    VerbsError::Io { op, kind }
}

#[cfg(test)]
mod tests {
    use super::{AsyncEvent, EVENTS_KEPT, EventLog};

    /// Undrained, the log keeps the newest events and no more, and QP
    /// errors make room before anything else does.
    #[test]
    fn the_event_log_keeps_the_newest_and_is_bounded() {
        let mut log = EventLog::default();
        log.push(AsyncEvent::GidChange { port: 1 });
        for qpn in 0..(EVENTS_KEPT as u32 + 10) {
            log.push(AsyncEvent::QpFatal {
                qpn: super::super::Qpn::new(qpn),
                event: 1,
            });
        }
        let kept = log.drain();
        assert_eq!(kept.len(), EVENTS_KEPT);
        assert_eq!(kept[0], AsyncEvent::GidChange { port: 1 });
        assert_eq!(
            kept[1],
            AsyncEvent::QpFatal {
                qpn: super::super::Qpn::new(11),
                event: 1
            }
        );
        let mut log = EventLog::default();
        for event in 0..(EVENTS_KEPT as u32 + 10) {
            log.push(AsyncEvent::Other { event });
        }
        let kept = log.drain();
        assert_eq!(kept.len(), EVENTS_KEPT);
        assert_eq!(kept.first(), Some(&AsyncEvent::Other { event: 10 }));
        assert_eq!(
            kept.last(),
            Some(&AsyncEvent::Other {
                event: EVENTS_KEPT as u32 + 9
            })
        );
        assert!(log.drain().is_empty(), "drained");
    }
}
