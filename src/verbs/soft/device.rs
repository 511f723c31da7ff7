//! The device core: routes datagrams to QP engines by destination QPN, owns
//! the QPN table, and moves engine completions onto CQs.
//!
//! ```text
//!  driver ─ handle_datagram(now, src, bytes) ─► parse (ICRC) ─► QpEngine::handle_packet
//!  driver ─ handle_timeout(now) ─────────────► every engine
//!  driver ◄ poll_transmit(now, buf) ◄──────── engines, round robin
//!  engines ─ poll_completion ─► CqShared::push (send or recv CQ of that QP)
//!  in the driver's turn ─► due CQs ─► take_due ─► driver dispatches, unlocked
//! ```
//!
//! Owner: `DeviceShared::core` (one mutex). The UDP driver task or the
//! simulator drives it; verbs calls lock it briefly to post or modify.
//! Iteration is over a `BTreeMap`, so the order is deterministic.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::Instant;
use super::cq::CqShared;
use super::engine::{CqSide, QpCounters, QpEngine};
use super::wire::{Bth, DEFAULT_PKEY, IcrcContext, Packet, ROCE_V2_PORT};
use crate::verbs::{Gid, Mtu, QpCaps, Qpn};

/// Datagram counters of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Datagrams received.
    pub rx_datagrams: u64,
    /// Datagrams dropped as malformed (bad length, opcode, pad, ICRC ...).
    pub rx_malformed: u64,
    /// Datagrams for a QPN this device does not have.
    pub rx_unknown_qp: u64,
    /// Datagrams for a connected QP from another address than its peer's
    /// GID (rxe's address check drops these too).
    pub rx_wrong_source: u64,
    /// Datagrams whose P_Key is not this port's partition.
    pub rx_bad_pkey: u64,
    /// Datagrams emitted.
    pub tx_datagrams: u64,
    /// Of those, put on the wire by `post_send` itself rather than the
    /// UDP driver task.
    pub tx_inline: u64,
    /// Datagrams `post_send` emitted but could not send (a full socket
    /// buffer, or one not yet known writable), or a dropped QP still owed
    /// while inline sends declined: handed to the driver, which sent them
    /// first.
    pub tx_backlogged: u64,
    /// Datagrams emitted (`tx_datagrams`, either path) that the kernel refused other than for a full buffer
    /// (a firewall's EPERM, EMSGSIZE past the path MTU): lost as on a wire,
    /// and retransmitted by RC; warned of at most once a second.
    pub tx_refused: u64,
    /// Datagrams dropped (either way) by the partition fault hook.
    pub fault_dropped: u64,
    /// Queue pairs ever created on this device.
    pub qps_created: u64,
    /// Completion handler calls the driver owed after its turns (one per CQ
    /// a turn added completions to, where a link installed a handler).
    pub cq_handler_calls: u64,
    /// Handler calls on this device's driver that panicked: the handler is
    /// not called again (its CQ notifies from then on), and the driver
    /// goes on serving every QP.
    pub cq_handler_panics: u64,
    /// Times the UDP driver stopped on a panic, its own or one under the
    /// device lock (a bug): each time every QP of the device went to ERR
    /// and a fresh driver took over.
    pub driver_panics: u64,
    /// Next-in-line receive buffers the driver read ahead after a receive
    /// completed (docs/soft-provider.md § "The next receive buffer is warmed").
    pub rx_buffers_warmed: u64,
}

pub(crate) struct QpEntry {
    pub engine: QpEngine,
    send_cq: Arc<CqShared>,
    recv_cq: Arc<CqShared>,
}

/// A P_Key matches the port's (the default, a full member) when the low 15
/// bits agree and are not the invalid key 0 (IBA 10.9.3).
fn pkey_matches(pkey: u16) -> bool {
    let key = pkey & 0x7fff;
    key != 0 && key == DEFAULT_PKEY & 0x7fff
}

/// One datagram `poll_transmit` produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Transmit {
    pub dst: Gid,
    pub dst_port: u16,
    pub len: usize,
}

pub(crate) struct DeviceCore {
    pub gid: Gid,
    pub udp_port: u16,
    pub active_mtu: Mtu,
    /// Each new QP's ACK coalescing delay ([`super::SoftConfig::ack_delay`]).
    pub ack_delay: std::time::Duration,
    rng: SmallRng,
    next_qpn: u32,
    qps: BTreeMap<Qpn, QpEntry>,
    rr_next: Qpn,
    pub stats: DeviceStats,
    /// Fault hook: drop every datagram in and out, as a cut cable would.
    pub partitioned: bool,
    /// The UDP driver's hand-off with inline sends (unused in simulation).
    pub inline: super::udp::InlineGate,
    completions: Completions,
    /// QPs that completed a receive since the driver last warmed their next
    /// receive buffer (each listed once).
    warm_due: Vec<Qpn>,
    /// Makes the UDP driver panic at its next turn (unit tests).
    #[cfg(test)]
    pub panic_driver: bool,
}

/// Where engine completions go: to their CQ, which notifies, or, while the
/// driver's turn defers them, also onto the list of CQs whose handler the
/// driver runs after it unlocks.
#[derive(Default)]
struct Completions {
    deferring: bool,
    due: Vec<Arc<CqShared>>,
}

impl Completions {
    fn push(&mut self, cq: &Arc<CqShared>, wc: crate::verbs::WorkCompletion) {
        if cq.push(wc, self.deferring) {
            self.due.push(cq.clone());
        }
    }
}

impl DeviceCore {
    pub fn new(gid: Gid, udp_port: u16, active_mtu: Mtu, seed: u64) -> DeviceCore {
        let mut rng = SmallRng::seed_from_u64(seed);
        let next_qpn = rng.random_range(0x10..0x00ff_0000);
        DeviceCore {
            gid,
            udp_port,
            active_mtu,
            ack_delay: std::time::Duration::ZERO,
            rng,
            next_qpn,
            qps: BTreeMap::new(),
            rr_next: Qpn::new(0),
            stats: DeviceStats::default(),
            partitioned: false,
            inline: Default::default(),
            completions: Completions::default(),
            warm_due: Vec::new(),
            #[cfg(test)]
            panic_driver: false,
        }
    }

    pub fn random_u64(&mut self) -> u64 {
        self.rng.random()
    }

    pub fn create_qp(
        &mut self,
        caps: QpCaps,
        send_cq: Arc<CqShared>,
        recv_cq: Arc<CqShared>,
    ) -> Qpn {
        let qpn = loop {
            let q = Qpn::new(self.next_qpn);
            self.next_qpn = (self.next_qpn + 1) & 0x00ff_ffff;
            if q.value() > 1 && !self.qps.contains_key(&q) {
                break q;
            }
        };
        self.stats.qps_created += 1;
        let engine = QpEngine::new(qpn, caps, self.rng.random(), self.ack_delay);
        self.qps.insert(
            qpn,
            QpEntry {
                engine,
                send_cq,
                recv_cq,
            },
        );
        qpn
    }

    pub fn qp_count(&self) -> usize {
        self.qps.len()
    }

    /// From now until [`DeviceCore::take_due`], completions for a CQ with a
    /// handler owe that handler a call instead of notifying (the driver's
    /// turn; verbs calls never defer).
    pub fn defer_completions(&mut self) {
        self.completions.deferring = true;
    }

    /// Ends deferring and moves the CQs owed a handler call into `out`; the
    /// caller runs `CqShared::dispatch` on each once it has unlocked.
    pub fn take_due(&mut self, out: &mut Vec<Arc<CqShared>>) {
        self.completions.deferring = false;
        self.stats.cq_handler_calls += self.completions.due.len() as u64;
        out.append(&mut self.completions.due);
    }

    /// After the driver panicked: every QP to ERR, its WRs flushed with
    /// errors onto its CQs. Call after [`DeviceCore::take_due`], so the
    /// flushes notify rather than wait for a handler call.
    pub fn fail_every_qp(&mut self) {
        let qpns: Vec<Qpn> = self.qps.keys().copied().collect();
        for qpn in qpns {
            self.with_qp(qpn, QpEngine::modify_to_error);
        }
    }

    /// The CQs of every QP, each once.
    pub fn every_cq(&self) -> Vec<Arc<CqShared>> {
        let mut cqs: Vec<Arc<CqShared>> = Vec::new();
        for entry in self.qps.values() {
            for cq in [&entry.send_cq, &entry.recv_cq] {
                if !cqs.iter().any(|seen| Arc::ptr_eq(seen, cq)) {
                    cqs.push(cq.clone());
                }
            }
        }
        cqs
    }

    pub fn destroy_qp(&mut self, qpn: Qpn) {
        self.qps.remove(&qpn);
        // Without a UDP driver (simulation) nothing drains the list.
        self.warm_due.retain(|&q| q != qpn);
    }

    /// Run a command on one engine, then move its completions to the CQs.
    pub fn with_qp<R>(&mut self, qpn: Qpn, f: impl FnOnce(&mut QpEngine) -> R) -> Option<R> {
        let entry = self.qps.get_mut(&qpn)?;
        let r = f(&mut entry.engine);
        drain(entry, &mut self.completions);
        Some(r)
    }

    pub fn qp_counters(&self, qpn: Qpn) -> Option<QpCounters> {
        self.qps.get(&qpn).map(|e| e.engine.counters)
    }

    /// Sum of every QP's counters.
    pub fn total_counters(&self) -> QpCounters {
        let mut t = QpCounters::default();
        for e in self.qps.values() {
            t += e.engine.counters;
        }
        t
    }

    /// An untrusted datagram from `src`:`src_port`.
    pub fn handle_datagram(&mut self, now: Instant, src: Gid, src_port: u16, bytes: &[u8]) {
        self.stats.rx_datagrams += 1;
        if self.partitioned {
            self.stats.fault_dropped += 1;
            return;
        }
        let Ok(bth) = Bth::new_checked(bytes) else {
            self.stats.rx_malformed += 1;
            return;
        };
        let Some(entry) = self.qps.get_mut(&bth.dest_qp()) else {
            self.stats.rx_unknown_qp += 1;
            return;
        };
        // An RC QP hears only the peer it was connected to, on our partition.
        // A soft peer off RoCEv2's port sends from the port it named, which
        // tells it from other sockets on its address (loopback, a shared
        // host); a peer on that port picks its source port per flow.
        if entry.engine.path().is_some_and(|path| {
            let peer = &path.tx_ctx;
            peer.dst != src || (peer.dst_port != ROCE_V2_PORT && peer.dst_port != src_port)
        }) {
            self.stats.rx_wrong_source += 1;
            return;
        }
        if !pkey_matches(bth.pkey()) {
            self.stats.rx_bad_pkey += 1;
            return;
        }
        let ctx = IcrcContext {
            src,
            dst: self.gid,
            src_port,
            dst_port: self.udp_port,
        };
        match Packet::parse(&ctx, bytes) {
            Ok(pkt) => {
                let was_cold = entry.engine.rq_head_cold();
                // Only a request that ends a message completes a receive.
                let completes = pkt.repr.bth.opcode.ends_message();
                entry
                    .engine
                    .set_recv_cq_full(completes && entry.recv_cq.is_full());
                entry.engine.handle_packet(now, &pkt);
                if !was_cold && entry.engine.rq_head_cold() {
                    self.warm_due.push(bth.dest_qp());
                }
                drain(entry, &mut self.completions);
            }
            Err(e) => {
                tracing::trace!(error = %e, "dropping malformed RoCE datagram");
                self.stats.rx_malformed += 1;
            }
        }
    }

    /// Reads ahead the next receive buffer of each QP that completed a
    /// receive since the last call (see `QpEngine::warm_next_receive`). The
    /// UDP driver calls it after the receivers ran, off the record's path.
    pub fn warm_next_receives(&mut self) {
        while let Some(qpn) = self.warm_due.pop() {
            if let Some(entry) = self.qps.get_mut(&qpn) {
                if entry.engine.warm_next_receive() {
                    self.stats.rx_buffers_warmed += 1;
                }
            }
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        for entry in self.qps.values_mut() {
            if entry.engine.poll_timeout().is_some_and(|t| t <= now) {
                entry.engine.handle_timeout(now);
                drain(entry, &mut self.completions);
            }
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.qps
            .values()
            .filter_map(|e| e.engine.poll_timeout())
            .min()
    }

    /// Whether some QP has a packet to emit now.
    pub fn wants_transmit(&self) -> bool {
        self.qps.values().any(|e| e.engine.wants_transmit())
    }

    /// Next datagram of any QP, round robin from the QP after the last sender.
    pub fn poll_transmit(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        loop {
            let t = self.poll_transmit_any(now, buf)?;
            if !self.partitioned {
                return Some(t);
            }
            self.stats.fault_dropped += 1;
        }
    }

    /// [`DeviceCore::poll_transmit`] for one QP only.
    pub fn poll_transmit_qp(&mut self, qpn: Qpn, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        let entry = self.qps.get_mut(&qpn)?;
        loop {
            let len = entry.engine.poll_transmit(now, buf)?;
            drain(entry, &mut self.completions);
            self.stats.tx_datagrams += 1;
            if self.partitioned {
                self.stats.fault_dropped += 1;
                continue;
            }
            let path = entry.engine.path().expect("a QP that transmits has a path");
            return Some(Transmit {
                dst: path.tx_ctx.dst,
                dst_port: path.tx_ctx.dst_port,
                len,
            });
        }
    }

    fn poll_transmit_any(&mut self, now: Instant, buf: &mut [u8]) -> Option<Transmit> {
        let first = |qps: &BTreeMap<Qpn, QpEntry>, from: Bound<Qpn>| {
            qps.range((from, Bound::Unbounded))
                .next()
                .or_else(|| qps.iter().next())
                .map(|(q, _)| *q)
        };
        let mut qpn = first(&self.qps, Bound::Included(self.rr_next))?;
        for _ in 0..self.qps.len() {
            let entry = self.qps.get_mut(&qpn).expect("key taken from the map");
            if let Some(len) = entry.engine.poll_transmit(now, buf) {
                drain(entry, &mut self.completions);
                let path = entry.engine.path().expect("a QP that transmits has a path");
                self.rr_next = Qpn::new(qpn.value() + 1);
                self.stats.tx_datagrams += 1;
                return Some(Transmit {
                    dst: path.tx_ctx.dst,
                    dst_port: path.tx_ctx.dst_port,
                    len,
                });
            }
            qpn = first(&self.qps, Bound::Excluded(qpn))?;
        }
        None
    }
}

fn drain(entry: &mut QpEntry, completions: &mut Completions) {
    while let Some((side, wc)) = entry.engine.poll_completion() {
        match side {
            CqSide::Send => completions.push(&entry.send_cq, wc),
            CqSide::Recv => completions.push(&entry.recv_cq, wc),
        }
    }
}
