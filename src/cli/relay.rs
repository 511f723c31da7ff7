//! `qpmux relay`: a userspace UDP impairment relay for the fault harness
//! (docs/faults.md), where the kernel has no netem.
//!
//! ```text
//!  A:pa ─► [tproxy in R] ─► socket bound B:pb ─ loss / dup / delay+jitter / hold ─┐
//!                                                                                │
//!  B:pb ◄────────────────── socket bound A:pa (sends with A's source) ◄──────────┘
//! ```
//!
//! One `IP_TRANSPARENT` socket per peer, bound to the peer's own address, so
//! datagrams keep their source (the soft provider names the peer by it).
//! Every decision comes from one seeded RNG; the seed and the counts are
//! printed as JSON lines and rewritten to `--stats-file` as they change.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args as ClapArgs;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Arguments of `qpmux relay`.
#[derive(Debug, Clone, ClapArgs)]
pub struct RelayArgs {
    /// A peer's RoCE address (IP:UDP port); give each one (2 to 8).
    #[arg(long = "peer", required = true)]
    pub peers: Vec<SocketAddr>,
    /// Probability a datagram is dropped.
    #[arg(long, default_value_t = 0.0)]
    pub loss: f64,
    /// Probability a datagram is sent twice (each copy delayed on its own).
    #[arg(long, default_value_t = 0.0)]
    pub dup: f64,
    /// Probability a datagram is held back by `--hold-us` (reordering).
    #[arg(long, default_value_t = 0.0)]
    pub reorder: f64,
    /// Fixed delay of every datagram, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub delay_us: u64,
    /// Extra delay drawn uniformly from [0, jitter], in microseconds.
    #[arg(long, default_value_t = 0)]
    pub jitter_us: u64,
    /// How long a reordered datagram is held back, in microseconds.
    #[arg(long, default_value_t = 3000)]
    pub hold_us: u64,
    /// RNG seed (default: drawn, and printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Rewritten with the counts (JSON) while they change.
    #[arg(long)]
    pub stats_file: Option<PathBuf>,
    /// Stop after this many seconds (also stops on SIGTERM / SIGINT).
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(..=31_536_000))]
    pub duration_s: u64,
    /// Datagrams waiting for their departure time; beyond it they are dropped.
    #[arg(long, default_value_t = 65_536)]
    pub queue_limit: usize,
}

/// The relay's counts.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct RelayStats {
    seed: u64,
    received: u64,
    forwarded: u64,
    dropped: u64,
    duplicated: u64,
    held: u64,
    /// Datagrams that left after one that arrived later (same direction).
    reordered: u64,
    unknown_source: u64,
    overflow: u64,
    send_errors: u64,
    /// Receive errors (the socket keeps serving).
    recv_errors: u64,
}

/// What a socket's receive task hands the relay loop.
enum Arrival {
    /// A datagram on the socket of `.0` (the destination), from `.1`.
    Datagram(usize, SocketAddr, Arc<[u8]>),
    /// A receive error.
    Error,
}

/// One datagram waiting for its departure.
struct Pending {
    due: Instant,
    order: u64,
    /// Index of the socket bound to the source's address.
    via: usize,
    to: SocketAddr,
    /// Arrival number within its direction, for the reorder count.
    arrival: u64,
    direction: usize,
    bytes: Arc<[u8]>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.order) == (other.due, other.order)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.order).cmp(&(other.due, other.order))
    }
}

/// Impairment decisions, separate from the sockets so they can be tested.
struct Impairment {
    rng: SmallRng,
    loss: f64,
    dup: f64,
    reorder: f64,
    delay: Duration,
    jitter_us: u64,
    hold: Duration,
}

impl Impairment {
    /// Departure delays for one datagram: none (lost), one, or two (duplicated).
    fn delays(&mut self, stats: &mut RelayStats) -> Vec<Duration> {
        if self.rng.random_bool(self.loss) {
            stats.dropped += 1;
            return Vec::new();
        }
        let copies = if self.rng.random_bool(self.dup) {
            stats.duplicated += 1;
            2
        } else {
            1
        };
        (0..copies)
            .map(|_| {
                let mut d = self.delay;
                if self.jitter_us > 0 {
                    d += Duration::from_micros(self.rng.random_range(0..=self.jitter_us));
                }
                if self.rng.random_bool(self.reorder) {
                    stats.held += 1;
                    d += self.hold;
                }
                d
            })
            .collect()
    }
}

fn transparent_socket(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    match addr {
        SocketAddr::V4(_) => socket.set_ip_transparent_v4(true)?,
        SocketAddr::V6(_) => socket.set_ip_transparent_v6(true)?,
    }
    if let Err(err) = socket.set_recv_buffer_size(4 << 20) {
        tracing::debug!(%err, "SO_RCVBUF not set");
    }
    if let Err(err) = socket.set_send_buffer_size(4 << 20) {
        tracing::debug!(%err, "SO_SNDBUF not set");
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    UdpSocket::from_std(socket.into())
}

fn emit<T: Serialize>(event: &str, value: &T) {
    let mut json = serde_json::to_value(value).unwrap_or_default();
    if let Some(map) = json.as_object_mut() {
        map.insert("event".into(), event.into());
    }
    println!("{json}");
}

fn write_stats(path: &Option<PathBuf>, stats: &RelayStats) {
    let Some(path) = path else { return };
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string(stats).unwrap_or_default();
    if let Err(err) = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path)) {
        tracing::warn!(%err, "relay stats not written");
    }
}

/// Runs the relay until `--duration-s`, SIGTERM or SIGINT.
pub async fn run(args: RelayArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (2..=8).contains(&args.peers.len()),
        "give 2 to 8 --peer addresses"
    );
    for p in [args.loss, args.dup, args.reorder] {
        anyhow::ensure!((0.0..=1.0).contains(&p), "probabilities are in [0, 1]");
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut impair = Impairment {
        rng: SmallRng::seed_from_u64(seed),
        loss: args.loss,
        dup: args.dup,
        reorder: args.reorder,
        delay: Duration::from_micros(args.delay_us),
        jitter_us: args.jitter_us,
        hold: Duration::from_micros(args.hold_us),
    };
    let mut stats = RelayStats {
        seed,
        ..RelayStats::default()
    };
    let sockets: Vec<Arc<UdpSocket>> = args
        .peers
        .iter()
        .map(|&a| transparent_socket(a).map(Arc::new))
        .collect::<Result<_, _>>()?;
    let (arrived_tx, mut arrived) = mpsc::channel::<Arrival>(4096);
    for (index, socket) in sockets.iter().enumerate() {
        let (socket, arrived_tx) = (socket.clone(), arrived_tx.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 65_536];
            loop {
                let arrival = match socket.recv_from(&mut buf).await {
                    Ok((n, from)) => Arrival::Datagram(index, from, buf[..n].into()),
                    // An error (an ICMP report, say) ends no direction:
                    // counted, and the socket keeps serving.
                    Err(err) => {
                        tracing::debug!(%err, "relay receive failed");
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        Arrival::Error
                    }
                };
                if arrived_tx.send(arrival).await.is_err() {
                    break;
                }
            }
        });
    }
    drop(arrived_tx);
    emit(
        "relay_start",
        &serde_json::json!({ "seed": seed, "peers": args.peers }),
    );
    write_stats(&args.stats_file, &stats);

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let stop_at = Instant::now() + Duration::from_secs(args.duration_s);
    let mut queue: BinaryHeap<Reverse<Pending>> = BinaryHeap::new();
    let mut order = 0u64;
    // Per destination: arrivals counted, and the latest arrival sent.
    let n = sockets.len();
    let mut arrivals = vec![0u64; n];
    let mut latest_sent: Vec<Option<u64>> = vec![None; n];
    let mut dirty = false;
    let mut report = tokio::time::interval(Duration::from_millis(200));
    loop {
        let next_due = queue.peek().map(|Reverse(p)| p.due);
        let due = async {
            match next_due {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            () = tokio::time::sleep_until(stop_at) => break,
            _ = report.tick() => {
                if dirty {
                    write_stats(&args.stats_file, &stats);
                    dirty = false;
                }
            }
            arrival = arrived.recv() => {
                let (direction, from, bytes) = match arrival {
                    None => break,
                    Some(Arrival::Error) => {
                        stats.recv_errors += 1;
                        dirty = true;
                        continue;
                    }
                    Some(Arrival::Datagram(direction, from, bytes)) => (direction, from, bytes),
                };
                stats.received += 1;
                dirty = true;
                let Some(via) = args.peers.iter().position(|&p| p == from) else {
                    stats.unknown_source += 1;
                    continue;
                };
                let number = arrivals[direction];
                arrivals[direction] += 1;
                let now = Instant::now();
                for delay in impair.delays(&mut stats) {
                    if queue.len() >= args.queue_limit {
                        stats.overflow += 1;
                        continue;
                    }
                    order += 1;
                    queue.push(Reverse(Pending {
                        due: now + delay,
                        order,
                        via,
                        to: args.peers[direction],
                        arrival: number,
                        direction,
                        bytes: bytes.clone(),
                    }));
                }
            }
            () = due => {
                let now = Instant::now();
                while queue.peek().is_some_and(|Reverse(p)| p.due <= now) {
                    let Some(Reverse(p)) = queue.pop() else { break };
                    match latest_sent[p.direction] {
                        Some(latest) if p.arrival < latest => stats.reordered += 1,
                        _ => latest_sent[p.direction] = Some(p.arrival),
                    }
                    match sockets[p.via].send_to(&p.bytes, p.to).await {
                        Ok(_) => stats.forwarded += 1,
                        Err(err) => {
                            stats.send_errors += 1;
                            tracing::debug!(%err, to = %p.to, "relay send failed");
                        }
                    }
                }
                dirty = true;
            }
        }
    }
    write_stats(&args.stats_file, &stats);
    emit("relay_stats", &stats);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn impairment(seed: u64, loss: f64, dup: f64, reorder: f64) -> Impairment {
        Impairment {
            rng: SmallRng::seed_from_u64(seed),
            loss,
            dup,
            reorder,
            delay: Duration::from_micros(100),
            jitter_us: 50,
            hold: Duration::from_millis(3),
        }
    }

    #[test]
    fn the_same_seed_makes_the_same_decisions() {
        let run = |seed| {
            let mut imp = impairment(seed, 0.1, 0.1, 0.1);
            let mut stats = RelayStats::default();
            let delays: Vec<_> = (0..1000).map(|_| imp.delays(&mut stats)).collect();
            (delays, stats.dropped, stats.duplicated, stats.held)
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7).0, run(8).0);
    }

    #[test]
    fn rates_are_near_what_was_asked() {
        let mut imp = impairment(1, 0.01, 0.01, 0.0);
        let mut stats = RelayStats::default();
        let copies: usize = (0..100_000).map(|_| imp.delays(&mut stats).len()).sum();
        assert!((500..1500).contains(&stats.dropped), "{stats:?}");
        assert!((500..1500).contains(&stats.duplicated), "{stats:?}");
        assert_eq!(
            copies as u64,
            100_000 - stats.dropped + stats.duplicated,
            "one copy each, two for a duplicate, none for a loss"
        );
    }

    #[test]
    fn delays_stay_within_delay_plus_jitter_plus_hold() {
        let mut imp = impairment(3, 0.0, 0.5, 0.5);
        let mut stats = RelayStats::default();
        for _ in 0..10_000 {
            for d in imp.delays(&mut stats) {
                assert!(d >= Duration::from_micros(100));
                assert!(d <= Duration::from_micros(150) + Duration::from_millis(3));
            }
        }
        assert!(stats.held > 0);
    }
}
