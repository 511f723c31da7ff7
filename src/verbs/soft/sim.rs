//! Deterministic simulated network for soft devices: virtual time, seeded faults.
//!
//! ```text
//!  step(): every core ─ handle_timeout(now), poll_transmit ─► Link faults
//!          (loss, duplication, capacity with tail drop, delay, jitter and
//!          hold-back reordering, ACK delay, partition)
//!          ─► in-flight heap ordered by (arrival, sequence)
//!          jump `now` to the next arrival or timer ─► handle_datagram / handle_timeout
//! ```
//!
//! Owner: the test that holds the `SimNet`. Device seeds come from the
//! network seed, each direction of each link has its own RNG derived from
//! it, and devices are visited in creation order, so a seed replays the same
//! run exactly. Nothing reads the wall clock.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::net::Ipv4Addr;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::device::DeviceCore;
use super::wire::{MAX_OVERHEAD, Opcode};
use super::{Instant, SoftConfig, SoftDevice};
use crate::verbs::Gid;

/// RoCEv2 port every simulated device listens on.
pub const SIM_UDP_PORT: u16 = 4791;

/// Impairments of one direction of a link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkConfig {
    /// One-way delay.
    pub delay: Duration,
    /// Extra delay drawn uniformly in `0..=jitter`; reorders packets.
    pub jitter: Duration,
    /// Probability a packet is held back by `reorder_delay`, so later ones overtake it.
    pub reorder: f64,
    /// Extra delay of a held-back packet.
    pub reorder_delay: Duration,
    /// Probability a packet is dropped.
    pub loss: f64,
    /// Probability a packet is delivered twice.
    pub duplicate: f64,
    /// Extra delay of ACK/NAK packets.
    pub ack_delay: Duration,
    /// Drop everything.
    pub partitioned: bool,
    /// Time the link is busy per packet (zero: unlimited capacity).
    pub packet_gap: Duration,
    /// Tail drop: a packet that would wait longer than this for the link is lost.
    pub max_backlog: Duration,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            delay: Duration::from_micros(5),
            jitter: Duration::ZERO,
            reorder: 0.0,
            reorder_delay: Duration::ZERO,
            loss: 0.0,
            duplicate: 0.0,
            ack_delay: Duration::ZERO,
            partitioned: false,
            packet_gap: Duration::ZERO,
            max_backlog: Duration::ZERO,
        }
    }
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: Instant,
    seq: u64,
    src: usize,
    dst: usize,
    bytes: Vec<u8>,
}

/// Counters of the simulated network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Packets handed to the network.
    pub sent: u64,
    /// Packets dropped by loss or partition.
    pub dropped: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Packets delivered.
    pub delivered: u64,
}

/// The outcome of a bounded drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriveOutcome {
    /// The condition held.
    Reached,
    /// Nothing left to happen: no packet in flight, no timer armed.
    Idle,
    /// The step bound ran out (a livelock, or a bound too small).
    BoundExceeded,
}

/// A simulated network of soft devices.
pub struct SimNet {
    now: Instant,
    seed: u64,
    rng: SmallRng,
    /// One RNG per direction, so faults on one link do not depend on
    /// traffic on another.
    link_rngs: BTreeMap<(usize, usize), SmallRng>,
    /// When each direction's link is next free (capacity-limited links).
    link_free: BTreeMap<(usize, usize), Instant>,
    devices: Vec<SoftDevice>,
    by_addr: BTreeMap<Gid, usize>,
    links: BTreeMap<(usize, usize), LinkConfig>,
    default_link: LinkConfig,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    buf: Vec<u8>,
    stats: SimStats,
}

impl SimNet {
    /// An empty network whose every random choice derives from `seed`.
    pub fn new(seed: u64) -> SimNet {
        SimNet {
            now: Instant::ZERO,
            seed,
            rng: SmallRng::seed_from_u64(seed),
            link_rngs: BTreeMap::new(),
            link_free: BTreeMap::new(),
            devices: Vec::new(),
            by_addr: BTreeMap::new(),
            links: BTreeMap::new(),
            default_link: LinkConfig::default(),
            queue: BinaryHeap::new(),
            seq: 0,
            buf: vec![0u8; 4096 + MAX_OVERHEAD],
            stats: SimStats::default(),
        }
    }

    /// Add a device at GID `::ffff:10.0.0.<n>`; its seed comes from the network's RNG.
    pub fn add_device(&mut self, config: SoftConfig) -> SoftDevice {
        let index = self.devices.len();
        let octets = u32::try_from(index + 1).expect("fewer than 2^32 devices");
        let ip = Ipv4Addr::from(0x0a00_0000 | octets);
        let gid = Gid::from_ipv4(ip);
        let seed = config.seed.unwrap_or_else(|| self.rng.random());
        let mut core = DeviceCore::new(gid, SIM_UDP_PORT, config.active_mtu, seed);
        core.ack_delay = config.ack_delay;
        let dev = SoftDevice::from_core(core);
        self.devices.push(dev.clone());
        self.by_addr.insert(gid, index);
        dev
    }

    /// Impairments for every link without its own configuration.
    pub fn set_default_link(&mut self, link: LinkConfig) {
        self.default_link = link;
    }

    /// Impairments from device `from` to device `to` (indices in creation order).
    pub fn set_link(&mut self, from: usize, to: usize, link: LinkConfig) {
        self.links.insert((from, to), link);
    }

    /// Cut or heal both directions between two devices.
    pub fn set_partition(&mut self, a: usize, b: usize, partitioned: bool) {
        for key in [(a, b), (b, a)] {
            let mut l = self.link(key.0, key.1);
            l.partitioned = partitioned;
            self.links.insert(key, l);
        }
    }

    fn link(&self, from: usize, to: usize) -> LinkConfig {
        self.links
            .get(&(from, to))
            .copied()
            .unwrap_or(self.default_link)
    }

    /// Current virtual time.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Network counters.
    pub fn stats(&self) -> SimStats {
        self.stats
    }

    /// Collect every device's output at `now` and put it on the wire.
    fn transmit_all(&mut self) {
        for src in 0..self.devices.len() {
            loop {
                let dev = self.devices[src].clone();
                let mut core = dev.shared().core();
                core.handle_timeout(self.now);
                let Some(t) = core.poll_transmit(self.now, &mut self.buf) else {
                    break;
                };
                drop(core);
                let bytes = self.buf[..t.len].to_vec();
                let Some(&dst) = self.by_addr.get(&t.dst) else {
                    self.stats.dropped += 1;
                    continue;
                };
                self.send(src, dst, bytes);
            }
        }
    }

    fn send(&mut self, src: usize, dst: usize, bytes: Vec<u8>) {
        self.stats.sent += 1;
        let link = self.link(src, dst);
        let seed = self.seed;
        let rng = self.link_rngs.entry((src, dst)).or_insert_with(|| {
            let direction = ((src as u64) << 32) | dst as u64;
            SmallRng::seed_from_u64(seed ^ direction.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        });
        if link.partitioned || rng.random_bool(link.loss.clamp(0.0, 1.0)) {
            self.stats.dropped += 1;
            return;
        }
        let copies = if rng.random_bool(link.duplicate.clamp(0.0, 1.0)) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        let is_ack = bytes.first() == Some(&Opcode::Ack.byte());
        for _ in 0..copies {
            let jitter = if link.jitter.is_zero() {
                Duration::ZERO
            } else {
                let nanos = u64::try_from(link.jitter.as_nanos()).unwrap_or(u64::MAX);
                Duration::from_nanos(rng.random_range(0..=nanos))
            };
            let mut extra = if is_ack {
                link.ack_delay
            } else {
                Duration::ZERO
            };
            if rng.random_bool(link.reorder.clamp(0.0, 1.0)) {
                extra += link.reorder_delay;
            }
            let mut depart = self.now;
            if !link.packet_gap.is_zero() {
                let free = self.link_free.entry((src, dst)).or_insert(self.now);
                depart = depart.max(*free);
                if depart.saturating_duration_since(self.now) > link.max_backlog {
                    self.stats.dropped += 1;
                    continue;
                }
                *free = depart + link.packet_gap;
            }
            self.seq += 1;
            self.queue.push(Reverse(InFlight {
                at: depart + link.delay + jitter + extra,
                seq: self.seq,
                src,
                dst,
                bytes: bytes.clone(),
            }));
        }
    }

    fn next_event(&self) -> Option<Instant> {
        let packet = self.queue.peek().map(|Reverse(p)| p.at);
        let timer = self
            .devices
            .iter()
            .filter_map(|d| d.shared().core().poll_timeout())
            .min();
        match (packet, timer) {
            (Some(p), Some(t)) => Some(p.min(t)),
            (Some(p), None) => Some(p),
            (None, Some(t)) => Some(t),
            (None, None) => None,
        }
    }

    /// Send what is ready, then advance to the next event and handle it.
    /// Returns false when the network is idle.
    pub fn step(&mut self) -> bool {
        self.transmit_all();
        let Some(next) = self.next_event() else {
            return false;
        };
        self.now = self.now.max(next);
        while let Some(Reverse(p)) = self.queue.peek() {
            if p.at > self.now {
                break;
            }
            let Reverse(p) = self.queue.pop().expect("peeked");
            self.stats.delivered += 1;
            let src = self.devices[p.src].gid();
            let dev = self.devices[p.dst].clone();
            dev.shared()
                .core()
                .handle_datagram(self.now, src, SIM_UDP_PORT, &p.bytes);
        }
        for dev in &self.devices {
            dev.shared().core().handle_timeout(self.now);
        }
        true
    }

    /// Step until `done()` holds, the network is idle, or `max_steps` pass.
    pub fn drive_until(
        &mut self,
        max_steps: usize,
        mut done: impl FnMut() -> bool,
    ) -> DriveOutcome {
        for _ in 0..max_steps {
            if done() {
                return DriveOutcome::Reached;
            }
            if !self.step() {
                return if done() {
                    DriveOutcome::Reached
                } else {
                    DriveOutcome::Idle
                };
            }
        }
        if done() {
            DriveOutcome::Reached
        } else {
            DriveOutcome::BoundExceeded
        }
    }

    /// Step until idle or `max_steps` pass; true when idle was reached.
    pub fn drive(&mut self, max_steps: usize) -> bool {
        self.drive_until(max_steps, || false) == DriveOutcome::Idle
    }
}
