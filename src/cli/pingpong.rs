//! `qpmux pingpong`: latency and bandwidth between two endpoints, shaped like
//! perftest's `ib_send_lat` / `ib_send_bw` tables.
//!
//! ```text
//!  client ─ slot (HELO, 0) ─► server: address blob, (run, sessions); open until the run ends
//!  server ─ slot (PONG, run) ─► client: "ok" (the run's first round trip); finished
//!                                        once the client has finished its hello
//!  per size n = 1..=sessions:
//!    client ─ slot (PING, run | n) ─► server: mode ("lat" | "bw"), then records
//!    server ─ slot (PONG, run | n) ─► client: echoes every record (lat) or one count (bw)
//! ```
//!
//! Both ends in one process by default; `--server` and `--client` (the
//! server's hex address blob) or `--connect` (its bootstrap address) run them
//! in two. A server serves one client run at a time, as many runs as come
//! (a second client while one runs is refused); a client that leaves
//! mid-run is forgotten and the next is served. `--provider` picks the verbs
//! provider under `--transport rdma`.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::{Args as ClapArgs, ValueEnum};
use indicatif::ProgressBar;
use serde::Serialize;

use super::{hex, unhex};
use crate::link::Node;
use crate::link::bootstrap::DeclineReason;
use crate::link::rdma::{RdmaNodeConfig, RdmaTransport};
use crate::link::tcp::{ConnectError, DialFailure, TcpNodeConfig, TcpTransport};
use crate::mux::{
    CloseReason, DropReason, Frame, MuxConfig, MuxError, MuxTransport, PeerId, SendError,
    SlotReceiver, SlotSender, StreamKey, Terminal,
};
use crate::verbs::Device;
use crate::verbs::soft::SoftDevice;
use crate::verbs::soft::udp::UdpConfig;

const HELLO_ANCHOR: u64 = 0x4845_4c4f; // "HELO"
const PING_ANCHOR: u64 = 0x5049_4e47; // "PING"
const PONG_ANCHOR: u64 = 0x504f_4e47; // "PONG"
/// A run's sessions are `run | n`: the run id keeps these bits clear.
const SESSION_BITS: u64 = 0xffff;
/// How long a server waits for a client to say its run is over once the
/// last session's reply is out, and for its link to go after that.
const CLIENT_LINGER: Duration = Duration::from_secs(10);
/// A client that sends no record for this long mid-run, or takes no echo,
/// is abandoned, so neither a frozen client nor a live idle one (its mux
/// sends heartbeats on an idle slot every 5 s) holds the server.
const CLIENT_SILENCE: Duration = Duration::from_secs(15);

/// The server's node id; a client started with `--connect` assumes it.
const SERVER_ID: u64 = 1;

/// A client's node id: random, so that a server tells its runs apart.
fn client_id() -> u64 {
    rand::random::<u64>().max(SERVER_ID + 1)
}
/// Iterations between progress-bar updates (an update reads the clock; the
/// bandwidth loop's records take about a microsecond each).
const PROGRESS_STEP: u64 = 1024;

/// Which transport carries the test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
pub enum TransportKind {
    /// The mux over an RC QP per peer (`--provider`), bootstrapped over TCP.
    Rdma,
    /// The mux over TCP links.
    Tcp,
}

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
pub enum Test {
    /// One record in flight, echoed: one-way latency = round trip / 2.
    Lat,
    /// A stream of records, one acknowledgement at the end.
    Bw,
}

/// The verbs provider under `--transport rdma`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
pub enum Provider {
    /// qpmux's soft RoCEv2 over UDP: no device needed.
    Soft,
    /// libibverbs (build with `--features ibverbs`): kernel rxe or a RoCE NIC.
    Ibverbs,
}

impl Provider {
    fn name(self) -> &'static str {
        match self {
            Provider::Soft => "soft",
            Provider::Ibverbs => "ibverbs",
        }
    }
}

/// Arguments of `qpmux pingpong`.
#[derive(Debug, Clone, ClapArgs)]
pub struct PingpongArgs {
    /// Transport under test.
    #[arg(long, value_enum, default_value_t = TransportKind::Rdma)]
    pub transport: TransportKind,
    /// Verbs provider of `--transport rdma`.
    #[arg(long, value_enum, default_value_t = Provider::Soft)]
    pub provider: Provider,
    /// Latency or bandwidth.
    #[arg(long, value_enum, default_value_t = Test::Lat)]
    pub test: Test,
    /// Message sizes in bytes (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', default_values_t = vec![64usize, 4096, 65536])]
    pub size: Vec<usize>,
    /// Iterations per size.
    #[arg(long, default_value_t = 2000)]
    pub iters: u64,
    /// Untimed round trips before the timed ones, at each size (latency
    /// test): the first ones pay for cold caches and buffer growth.
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,
    /// Run only the server, listening here; prints its address blob.
    #[arg(long, conflicts_with_all = ["client", "connect"])]
    pub server: Option<std::net::SocketAddr>,
    /// Run only the client, against a server's hex address blob.
    #[arg(long)]
    pub client: Option<String>,
    /// Run only the client, against the server listening at HOST:PORT.
    #[arg(long, conflicts_with = "client")]
    pub connect: Option<String>,
    /// Local IP of this end: the soft device's GID and the bootstrap
    /// listener (default: 127.0.0.1, the `--server` IP, or the source address
    /// toward `--connect`); with ibverbs, use this address's RoCEv2 GID.
    #[arg(long)]
    pub bind: Option<IpAddr>,
    /// libibverbs device, e.g. `rxe0` (default: the device routing to
    /// `--connect`, else the first with a RoCEv2 GID).
    #[arg(long)]
    pub ibv_device: Option<String>,
    /// libibverbs GID index (overrides the search for a RoCEv2 GID).
    #[arg(long)]
    pub gid_index: Option<u8>,
    /// Bootstrap handshake timeout in seconds (raise it on emulated machines).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub handshake_timeout: u64,
    /// With `--server`: the longest one client's run may hold the server,
    /// in seconds from its plan; past it the client is told why and
    /// abandoned (up to 10 s later, its word delivered), and the next one
    /// served (a run of huge `--iters` would hold it for good).
    #[arg(long, requires = "server", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=31_536_000))]
    pub max_run: u64,
}

#[derive(Debug, Serialize)]
struct LatRow {
    bytes: usize,
    iterations: u64,
    t_min_us: f64,
    t_typ_us: f64,
    t_avg_us: f64,
    t_99_us: f64,
    t_max_us: f64,
}

#[derive(Debug, Serialize)]
struct BwRow {
    bytes: usize,
    iterations: u64,
    bw_mib_s: f64,
    msg_rate_mpps: f64,
}

async fn tcp_node(id: u64, bind: SocketAddr, handshake: Duration) -> anyhow::Result<TcpTransport> {
    let mut config = TcpNodeConfig::new(PeerId(id));
    config.handshake_timeout = handshake;
    Ok(TcpTransport::bind(config, bind, MuxConfig::default()).await?)
}

/// Serves client runs one after another: `clients` of them, or forever.
/// With no bound, a client that misbehaves or leaves is logged and the next
/// is served.
async fn serve<N: Node>(
    node: &N,
    clients: Option<u64>,
    max_run: Option<Duration>,
) -> anyhow::Result<()> {
    let mut served = 0;
    while clients.is_none_or(|n| served < n) {
        let hello = bind_hello(node).await?;
        match serve_client(node, hello, max_run).await {
            Ok(()) => {}
            Err(err) if clients.is_none() => {
                tracing::warn!("pingpong client abandoned: {err:#}");
            }
            Err(err) => return Err(err),
        }
        served += 1;
    }
    Ok(())
}

/// Binds the hello key. An abandoned client's hello stays bound until its
/// peer task closes it, a moment after the peer is forgotten; only a mux
/// that is shut down ends the server.
async fn bind_hello<N: Node>(node: &N) -> anyhow::Result<SlotReceiver> {
    let key = StreamKey::new(HELLO_ANCHOR, 0);
    let mut warn_at = tokio::time::Instant::now() + CLIENT_LINGER;
    loop {
        match node.mux().bind(key) {
            Err(MuxError::AlreadyBound(_)) => {
                if tokio::time::Instant::now() >= warn_at {
                    tracing::warn!("the last pingpong client's hello is still bound; waiting");
                    warn_at += CLIENT_LINGER;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            bound => return Ok(bound?),
        }
    }
}

/// The next frame other than a heartbeat, within [`CLIENT_SILENCE`]:
/// heartbeats prove the client's mux alive, not that its run goes on.
async fn next_from_client(rx: &mut SlotReceiver) -> anyhow::Result<Option<Frame>> {
    match tokio::time::timeout(CLIENT_SILENCE, next_data(rx)).await {
        Ok(frame) => Ok(frame),
        Err(_) => anyhow::bail!("client silent for {CLIENT_SILENCE:?} (no record)"),
    }
}

/// Forgets a served client's peer however its run ended.
struct Forget<'a, N: Node>(&'a N, PeerId);

impl<N: Node> Drop for Forget<'_, N> {
    fn drop(&mut self) {
        self.0.unregister(self.1);
    }
}

/// One client's run: its sessions in order, while its hello stream stays
/// open; over when the client finishes that stream, or abandoned once it
/// has held the server for `max_run` from its plan.
async fn serve_client<N: Node>(
    node: &N,
    mut hello: SlotReceiver,
    max_run: Option<Duration>,
) -> anyhow::Result<()> {
    // Waiting for a client is idle, not a client gone silent: a peer that
    // opened the hello has one to two silences to say who it is.
    let mut opened_seen = false;
    let first = loop {
        match tokio::time::timeout(CLIENT_SILENCE, hello.recv()).await {
            Ok(Some(Frame::Heartbeat)) => break next_from_client(&mut hello).await?,
            Ok(first) => break first,
            Err(_) if hello.fed_by().is_none() => opened_seen = false,
            Err(_) if !opened_seen => opened_seen = true,
            Err(_) => anyhow::bail!("client silent for {CLIENT_SILENCE:?} (no address)"),
        }
    };
    let Some(Frame::Data(address)) = first else {
        anyhow::bail!("pingpong client sent no address");
    };
    let peer = node.register(&address)?;
    let _forget = Forget(node, peer);
    let Some(Frame::Data(plan)) = next_from_client(&mut hello).await? else {
        anyhow::bail!("pingpong client sent no plan");
    };
    let (run, sessions) = parse_plan(&plan)?;
    // Counted from the plan; the goodbye after the sessions is not cut
    // (forgetting the client then could cut the link under it).
    let deadline = max_run.map(|bound| (tokio::time::Instant::now() + bound, bound));
    // A client that dialled in has a link; an address it does not answer
    // at (it left while queued, or named another node) is not dialled.
    anyhow::ensure!(
        node.mux().epoch(peer).is_some(),
        "no link to the client its address names"
    );
    let mut welcome = node.mux().open(peer, StreamKey::new(PONG_ANCHOR, run))?;
    let served = async {
        welcome.send(Bytes::from_static(WELCOME)).await?;
        for n in 1..=sessions {
            tokio::select! {
                served = serve_session(node, peer, run | n) => served?,
                early = next_data(&mut hello) => anyhow::bail!("client left in session {n}: {early:?}"),
            }
        }
        Ok::<(), anyhow::Error>(())
    };
    match deadline {
        Some((at, bound)) => match tokio::time::timeout_at(at, served).await {
            Ok(served) => served?,
            Err(_) => {
                let why = format!("the client's run held the server past {bound:?} (--max-run)");
                // Queued on the welcome stream before the client is
                // forgotten, so it can tell why its run ended. The hello's
                // end (or its session's) tells it to look; its welcome end
                // going (or the linger, so a run holds a server at most
                // `--max-run` + 10 s) lets us forget it without cutting the
                // word off.
                let word = Bytes::from([ABANDONED, why.as_bytes()].concat());
                let told = async {
                    welcome.send(word).await?;
                    drop(hello);
                    Ok::<SendError, SendError>(welcome.closed().await)
                };
                let _ = tokio::time::timeout(CLIENT_LINGER, told).await;
                anyhow::bail!(why);
            }
        },
        None => served.await?,
    }
    match tokio::time::timeout(CLIENT_LINGER, next_data(&mut hello)).await {
        Ok(Some(Frame::Finalized)) => {
            // The client goes once it has this; forgetting it sooner could
            // cut the link under it.
            welcome.finish(Terminal::Finalized)?;
            client_gone(node, peer).await;
            Ok(())
        }
        Ok(other) => anyhow::bail!("client's run ended with {other:?}"),
        Err(_) => anyhow::bail!("client did not end its run within {CLIENT_LINGER:?}"),
    }
}

const WELCOME: &[u8] = b"ok";
/// How a server's word on the welcome stream starts when it gives up on a
/// run (`--max-run`); the reason follows.
const ABANDONED: &[u8] = b"abandoned: ";

/// Why the server gave up on this run, if it said so on the welcome stream
/// as it ended it (waited for up to a second: the server queues the word
/// right after dropping the session, on the same link).
async fn server_word(welcome: &mut SlotReceiver) -> Option<String> {
    match tokio::time::timeout(Duration::from_secs(1), next_data(welcome)).await {
        Ok(Some(Frame::Data(word))) => word
            .strip_prefix(ABANDONED)
            .map(|why| String::from_utf8_lossy(why).into_owned()),
        _ => None,
    }
}

/// Waits until `peer` has no link (the client left), at most [`CLIENT_LINGER`].
async fn client_gone<N: Node>(node: &N, peer: PeerId) {
    let deadline = tokio::time::Instant::now() + CLIENT_LINGER;
    while node.mux().epoch(peer).is_some() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The client's plan: its run id and how many sessions follow (16 bytes).
fn encode_plan(run: u64, sessions: u64) -> Bytes {
    let mut plan = Vec::with_capacity(16);
    plan.extend_from_slice(&run.to_be_bytes());
    plan.extend_from_slice(&sessions.to_be_bytes());
    Bytes::from(plan)
}

fn parse_plan(plan: &[u8]) -> anyhow::Result<(u64, u64)> {
    anyhow::ensure!(
        plan.len() == 16,
        "pingpong plan of {} bytes, not 16",
        plan.len()
    );
    let (run, sessions) = plan.split_at(8);
    let run = u64::from_be_bytes(run.try_into().expect("8 bytes"));
    let sessions = u64::from_be_bytes(sessions.try_into().expect("8 bytes"));
    anyhow::ensure!(
        run & SESSION_BITS == 0 && (1..=SESSION_BITS).contains(&sessions),
        "pingpong plan out of range: run {run:#x}, {sessions} sessions"
    );
    Ok((run, sessions))
}

/// One session: the mode, then echoes (lat) or a count at the end (bw).
async fn serve_session<N: Node>(node: &N, peer: PeerId, session: u64) -> anyhow::Result<()> {
    let mut rx = node.mux().bind(StreamKey::new(PING_ANCHOR, session))?;
    let Some(Frame::Data(mode)) = next_from_client(&mut rx).await? else {
        anyhow::bail!("pingpong client sent no mode");
    };
    let mut tx = node
        .mux()
        .open(peer, StreamKey::new(PONG_ANCHOR, session))?;
    let echo = match mode.as_ref() {
        b"lat" => true,
        b"bw" => false,
        other => anyhow::bail!("unknown pingpong mode {:?}", String::from_utf8_lossy(other)),
    };
    let mut received = 0u64;
    while let Some(frame) = next_from_client(&mut rx).await? {
        match frame {
            Frame::Data(record) => {
                received += 1;
                if echo {
                    let sent = tokio::time::timeout(CLIENT_SILENCE, tx.send(record)).await;
                    sent.map_err(|_| {
                        anyhow::anyhow!("client took no echo for {CLIENT_SILENCE:?}")
                    })??;
                }
            }
            Frame::Finalized => break,
            other => anyhow::bail!("pingpong stream ended: {other:?}"),
        }
    }
    if !echo {
        tx.send(Bytes::copy_from_slice(&received.to_be_bytes()))
            .await?;
    }
    tx.finish(Terminal::Finalized)?;
    Ok(())
}

/// One size's run, as the client measures it.
#[derive(Clone, Copy, Debug)]
struct Measure {
    test: Test,
    size: usize,
    iters: u64,
    /// Untimed round trips first (latency test only).
    warmup: u64,
    /// How long the server may take each record, reply or end: a stuck
    /// server fails the run instead of holding it.
    patience: Duration,
}

async fn client<N: Node>(
    node: &N,
    server: PeerId,
    session: u64,
    measure: Measure,
    bar: &ProgressBar,
) -> anyhow::Result<(Vec<Duration>, Duration)> {
    let Measure {
        test,
        size,
        iters,
        warmup,
        patience,
    } = measure;
    let mut rx = node.mux().bind(StreamKey::new(PONG_ANCHOR, session))?;
    let mut tx = node
        .mux()
        .open(server, StreamKey::new(PING_ANCHOR, session))?;
    let mode: &'static [u8] = match test {
        Test::Lat => b"lat",
        Test::Bw => b"bw",
    };
    tx.send(Bytes::from_static(mode)).await?;
    let record = Bytes::from(vec![0xa5u8; size]);
    let dropped_before = node.mux().stats().slots_dropped;
    // Only the latency test keeps a sample per iteration.
    let samples = if test == Test::Lat {
        iters.min(1 << 20) as usize
    } else {
        0
    };
    let mut one_way = Vec::with_capacity(samples);
    let start = Instant::now();
    match test {
        Test::Lat => {
            // i = 0: one of `--warmup` untimed round trips (the server echoes it too).
            for i in std::iter::repeat_n(0, warmup as usize).chain(1..=iters) {
                let sent = Instant::now();
                to_server(&mut tx, record.clone(), patience).await?;
                match next_reply(node, dropped_before, &mut rx, patience).await? {
                    Some(Frame::Data(echo)) if echo.len() == size => {}
                    other => anyhow::bail!("bad echo: {other:?}"),
                }
                if i > 0 {
                    one_way.push(sent.elapsed() / 2);
                    step(bar, i);
                }
            }
            tx.finish(Terminal::Finalized)?;
        }
        Test::Bw => {
            for i in 1..=iters {
                to_server(&mut tx, record.clone(), patience).await?;
                step(bar, i);
            }
            tx.finish(Terminal::Finalized)?;
            match next_reply(node, dropped_before, &mut rx, patience).await? {
                Some(Frame::Data(count)) if count.as_ref() == iters.to_be_bytes() => {}
                other => anyhow::bail!("bad bandwidth acknowledgement: {other:?}"),
            }
        }
    }
    let elapsed = start.elapsed();
    bar.inc(iters % PROGRESS_STEP);
    let ended = tokio::time::timeout(patience, async { while rx.recv().await.is_some() {} });
    ended
        .await
        .map_err(|_| anyhow::anyhow!("the server did not end the session"))?;
    Ok((one_way, elapsed))
}

/// Sends one record, failing if the server takes none for `patience`
/// (its link alive, its run stuck).
async fn to_server(tx: &mut SlotSender, record: Bytes, patience: Duration) -> anyhow::Result<()> {
    match tokio::time::timeout(patience, tx.send(record)).await {
        Ok(sent) => Ok(sent?),
        Err(_) => anyhow::bail!("the server took no record for {patience:?}"),
    }
}

/// Moves the bar on after every [`PROGRESS_STEP`]th iteration `i` (from 1).
fn step(bar: &ProgressBar, i: u64) {
    if i % PROGRESS_STEP == 0 {
        bar.inc(PROGRESS_STEP);
    }
}

/// The server's next reply. Fails once the mux drops a slot (an epoch ended
/// under the run, the records it carried are gone, and no reply will come)
/// or after `within` without one (the link alive, the server stuck).
async fn next_reply<N: Node>(
    node: &N,
    dropped_before: u64,
    rx: &mut SlotReceiver,
    within: Duration,
) -> anyhow::Result<Option<Frame>> {
    let reply = tokio::time::timeout(within, next_data(rx));
    tokio::pin!(reply);
    let every = Duration::from_millis(50);
    let mut check = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            frame = &mut reply => {
                return frame.map_err(|_| anyhow::anyhow!("no reply from the server within {within:?}"));
            }
            _ = check.tick() => {
                let dropped = node.mux().stats().slots_dropped - dropped_before;
                anyhow::ensure!(
                    dropped == 0,
                    "the link to the server ended mid-run ({dropped} slot(s) dropped); no reply will come"
                );
            }
        }
    }
}

/// The next frame that is not a heartbeat (an idle slot's keepalive).
async fn next_data(rx: &mut SlotReceiver) -> Option<Frame> {
    loop {
        match rx.recv().await {
            Some(Frame::Heartbeat) => continue,
            other => return other,
        }
    }
}

fn lat_row(size: usize, mut samples: Vec<Duration>) -> LatRow {
    samples.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    // The median averages the middle two of an even count; t_99 is the
    // sample at floor(0.99 (n - 1)), perftest's index.
    let n = samples.len();
    let median = if n % 2 == 0 {
        (samples[n / 2 - 1] + samples[n / 2]) / 2
    } else {
        samples[n / 2]
    };
    let at = |q: f64| samples[((n - 1) as f64 * q) as usize];
    let total: Duration = samples.iter().sum();
    LatRow {
        bytes: size,
        iterations: samples.len() as u64,
        t_min_us: us(samples[0]),
        t_typ_us: us(median),
        t_avg_us: us(total / samples.len() as u32),
        t_99_us: us(at(0.99)),
        t_max_us: us(samples[samples.len() - 1]),
    }
}

/// Where the ends of one `qpmux pingpong` run live.
struct Plan {
    /// The local IP of every node this process starts.
    local: IpAddr,
    /// The remote server's bootstrap address (`--connect`).
    server: Option<SocketAddr>,
}

impl Plan {
    async fn of(args: &PingpongArgs) -> anyhow::Result<Plan> {
        let server = match &args.connect {
            Some(target) => Some(
                tokio::net::lookup_host(target.as_str())
                    .await?
                    .next()
                    .ok_or_else(|| anyhow::anyhow!("{target} resolves to no address"))?,
            ),
            None => None,
        };
        let local = match (args.bind, args.server, server) {
            (Some(ip), _, _) => ip,
            (None, Some(listen), _) => listen.ip(),
            (None, None, Some(server)) => source_address_toward(server)?,
            (None, None, None) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        };
        Ok(Plan { local, server })
    }
}

/// The local address the kernel routes from toward `peer` (nothing is sent).
fn source_address_toward(peer: SocketAddr) -> anyhow::Result<IpAddr> {
    let any: SocketAddr = match peer {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let probe = std::net::UdpSocket::bind(any)?;
    probe.connect(peer)?;
    Ok(probe.local_addr()?.ip())
}

pub async fn run(args: PingpongArgs, json: bool) -> anyhow::Result<()> {
    anyhow::ensure!(args.iters > 0, "--iters must be positive");
    let max = MuxConfig::default().max_record;
    if let Some(size) = args.size.iter().find(|&&size| size > max) {
        anyhow::bail!("--size {size} is past the mux's record limit of {max} bytes");
    }
    let plan = Plan::of(&args).await?;
    let handshake = Duration::from_secs(args.handshake_timeout);
    match (args.transport, args.provider) {
        (TransportKind::Tcp, Provider::Soft) => {
            let local = SocketAddr::new(plan.local, 0);
            if let Some(bind) = args.server {
                return serve_forever(
                    tcp_node(SERVER_ID, bind, handshake).await?,
                    json,
                    args.max_run,
                )
                .await;
            }
            let client = tcp_node(client_id(), local, handshake).await?;
            let remote = args.client.is_some() || plan.server.is_some();
            let server = if remote {
                None
            } else {
                Some(tcp_node(SERVER_ID, local, handshake).await?)
            };
            run_client(args, json, plan, client, server).await
        }
        (TransportKind::Tcp, Provider::Ibverbs) => {
            anyhow::bail!("--provider applies to --transport rdma only")
        }
        (TransportKind::Rdma, Provider::Soft) => {
            run_rdma(args, json, plan, |ip| async move {
                let config = UdpConfig {
                    bind: SocketAddr::new(ip, 0),
                    ..UdpConfig::default()
                };
                Ok(SoftDevice::open_udp(config).await?)
            })
            .await
        }
        (TransportKind::Rdma, Provider::Ibverbs) => {
            #[cfg(feature = "ibverbs")]
            {
                use crate::verbs::ibv::{IbvConfig, IbvDevice};
                let config = IbvConfig {
                    device: args.ibv_device.clone(),
                    gid_index: args.gid_index,
                    source: args.bind,
                    // A loopback server shares this host's devices: no route picks one.
                    peer: plan.server.map(|s| s.ip()).filter(|ip| !ip.is_loopback()),
                    ..IbvConfig::default()
                };
                run_rdma(args, json, plan, move |_| {
                    let config = config.clone();
                    async move { Ok(IbvDevice::open(config)?) }
                })
                .await
            }
            #[cfg(not(feature = "ibverbs"))]
            anyhow::bail!("--provider ibverbs needs a build with --features ibverbs")
        }
    }
}

/// `--transport rdma` on devices from `open(local IP)`.
async fn run_rdma<D, F, Fut>(
    args: PingpongArgs,
    json: bool,
    plan: Plan,
    open: F,
) -> anyhow::Result<()>
where
    D: Device + 'static,
    F: Fn(IpAddr) -> Fut,
    Fut: Future<Output = anyhow::Result<D>>,
{
    let handshake = Duration::from_secs(args.handshake_timeout);
    if let Some(bind) = args.server {
        let node = rdma_node(open(bind.ip()).await?, SERVER_ID, bind, handshake).await?;
        return serve_forever(node, json, args.max_run).await;
    }
    let local = SocketAddr::new(plan.local, 0);
    let client = rdma_node(open(plan.local).await?, client_id(), local, handshake).await?;
    let remote = args.client.is_some() || plan.server.is_some();
    let server = if remote {
        None
    } else {
        Some(rdma_node(open(plan.local).await?, SERVER_ID, local, handshake).await?)
    };
    run_client(args, json, plan, client, server).await
}

async fn rdma_node<D: Device + 'static>(
    device: D,
    id: u64,
    bind: SocketAddr,
    handshake_timeout: Duration,
) -> anyhow::Result<RdmaTransport<D>> {
    let mut config = RdmaNodeConfig {
        bind,
        ..RdmaNodeConfig::new(PeerId(id))
    };
    config.connector.handshake_timeout = handshake_timeout;
    Ok(RdmaTransport::start(device, config).await?)
}

async fn serve_forever<N: Node>(node: N, json: bool, max_run: u64) -> anyhow::Result<()> {
    let address = hex(&node.address());
    if json {
        println!("{}", serde_json::json!({ "address": address }));
    } else {
        println!("pingpong server; address: {address}");
    }
    serve(&node, None, Some(Duration::from_secs(max_run))).await
}

/// Says hello (address, run id, session count) and waits for the welcome;
/// returns the hello stream, to be finished when the run is over, and the
/// welcome stream, which the server then finishes.
async fn start_run<N: Node>(
    node: &N,
    server: PeerId,
    run: u64,
    sessions: u64,
    wait: Duration,
) -> anyhow::Result<(SlotSender, SlotReceiver)> {
    let mut welcome = node.mux().bind(StreamKey::new(PONG_ANCHOR, run))?;
    let mut hello = node.mux().open(server, StreamKey::new(HELLO_ANCHOR, 0))?;
    // The server's refusal can arrive before the second send.
    for part in [Bytes::from(node.address()), encode_plan(run, sessions)] {
        if let Err(err) = hello.send(part).await {
            return Err(hello_closed(node, server, err));
        }
    }
    let dropped_before = node.mux().stats().slots_dropped;
    let no_welcome = |why: String| match node.last_dial_failure(server) {
        Some(dial) => {
            anyhow::anyhow!(
                "no welcome from the pingpong server: {why} (last dial: {})",
                dial.error
            )
        }
        None => anyhow::anyhow!("no welcome from the pingpong server: {why}"),
    };
    tokio::select! {
        // First: a hello ended as unreachable also counts a dropped slot,
        // which `next_reply` would report as a link lost.
        biased;
        closed = hello.closed() => Err(hello_closed(node, server, closed)),
        reply = next_reply(node, dropped_before, &mut welcome, wait) => match reply {
            Ok(Some(Frame::Data(ok))) if ok.as_ref() == WELCOME => Ok((hello, welcome)),
            Ok(other) => Err(no_welcome(format!("{other:?}"))),
            Err(err) => Err(no_welcome(format!("{err:#}"))),
        },
    }
}

/// Why the hello ended before the welcome: the server busy, or no link to
/// it for good (the mux ends the hello when a dial fails so; the node says
/// why), or whatever else ended it.
fn hello_closed<N: Node>(node: &N, server: PeerId, err: SendError) -> anyhow::Error {
    match err {
        SendError::PeerClosed(CloseReason::Refused | CloseReason::UnknownSlot) => refused_or(err),
        SendError::Dropped(DropReason::Unreachable) => match node.last_dial_failure(server) {
            Some(DialFailure {
                error: ConnectError::DeclinedByPeer(DeclineReason::WrongTransport),
                ..
            }) => anyhow::anyhow!(
                "the pingpong server runs the other transport: give the client the server's --transport"
            ),
            Some(failure) => anyhow::anyhow!(
                "no link to the pingpong server: {}; give both ends the same settings",
                failure.error
            ),
            None => anyhow::anyhow!("no link to the pingpong server: {err}"),
        },
        other => anyhow::anyhow!("the pingpong server ended the run before its welcome: {other}"),
    }
}

/// A hello the server closed as refused (or never knew) means it is busy
/// with another client; any other send error is passed on.
fn refused_or(err: SendError) -> anyhow::Error {
    match err {
        SendError::PeerClosed(CloseReason::Refused | CloseReason::UnknownSlot) => anyhow::anyhow!(
            "the pingpong server refused this run ({err}): it serves one client at a time"
        ),
        other => other.into(),
    }
}

async fn run_client<N: Node>(
    args: PingpongArgs,
    json: bool,
    plan: Plan,
    client_node: N,
    local_server: Option<N>,
) -> anyhow::Result<()> {
    let server_blob = match (&args.client, plan.server, &local_server) {
        (Some(blob), _, _) => unhex(blob)?,
        (None, Some(addr), _) => crate::link::address::encode(PeerId(SERVER_ID), addr),
        (None, None, Some(server)) => server.address(),
        (None, None, None) => anyhow::bail!("no server to measure against"),
    };
    let server_peer = client_node.register(&server_blob)?;
    let where_ = match local_server {
        Some(_) => format!("both ends in this process on {}", plan.local),
        None => format!("client {} to a remote server", plan.local),
    };
    anyhow::ensure!(
        (1..=SESSION_BITS as usize).contains(&args.size.len()),
        "between 1 and {SESSION_BITS} sizes"
    );
    let server_task = local_server.map(|server| {
        tokio::spawn(async move {
            let served = serve(&server, Some(1), None).await;
            server.shutdown();
            served
        })
    });
    // The hello and its welcome pay for the link (bootstrap handshake, QP
    // setup), so no measured row does.
    let run = rand::random::<u64>() & !SESSION_BITS;
    // Dialling, the handshake, and a server finishing the run before.
    let welcome_wait = Duration::from_secs(args.handshake_timeout) + 2 * CLIENT_LINGER;
    let (hello, mut welcome) = start_run(
        &client_node,
        server_peer,
        run,
        args.size.len() as u64,
        welcome_wait,
    )
    .await?;
    let bar = super::progress_bar((args.size.len() as u64).saturating_mul(args.iters), json);
    let mut lat_rows = Vec::new();
    let mut bw_rows = Vec::new();
    for (n, &size) in (1u64..).zip(&args.size) {
        bar.set_message(format!("{size} B"));
        let measured = client(
            &client_node,
            server_peer,
            run | n,
            Measure {
                test: args.test,
                size,
                iters: args.iters,
                warmup: args.warmup,
                patience: welcome_wait,
            },
            &bar,
        );
        let (samples, elapsed) = tokio::select! {
            // A server giving up drops the session first: its word may
            // come just after the session's own error.
            measured = measured => match measured {
                Ok(measured) => measured,
                Err(err) => match server_word(&mut welcome).await {
                    Some(why) => anyhow::bail!("the server gave up on the run: {why}"),
                    None => return Err(err),
                },
            },
            closed = hello.closed() => match server_word(&mut welcome).await {
                Some(why) => anyhow::bail!("the server gave up on the run: {why}"),
                None => anyhow::bail!("the server ended the run: {closed}"),
            },
        };
        match args.test {
            Test::Lat => lat_rows.push(lat_row(size, samples)),
            Test::Bw => {
                let secs = elapsed.as_secs_f64().max(1e-9);
                bw_rows.push(BwRow {
                    bytes: size,
                    iterations: args.iters,
                    bw_mib_s: (size as f64 * args.iters as f64) / secs / (1 << 20) as f64,
                    msg_rate_mpps: args.iters as f64 / secs / 1e6,
                });
            }
        }
    }
    bar.finish_and_clear();
    hello.finish(Terminal::Finalized)?;
    // Going before the server heard the end would leave it a dropped run.
    match tokio::time::timeout(CLIENT_LINGER, next_data(&mut welcome)).await {
        Ok(Some(Frame::Finalized)) => {}
        other => tracing::warn!("the pingpong server did not confirm the run's end: {other:?}"),
    }
    // The server forgets this client once its link has gone.
    client_node.shutdown();
    if let Some(task) = server_task {
        task.await??;
    }
    if json {
        match args.test {
            Test::Lat => println!("{}", serde_json::to_string_pretty(&lat_rows)?),
            Test::Bw => println!("{}", serde_json::to_string_pretty(&bw_rows)?),
        }
        return Ok(());
    }
    let carrier = match args.transport {
        TransportKind::Rdma => format!("rdma, provider {}", args.provider.name()),
        TransportKind::Tcp => "tcp".to_string(),
    };
    println!("qpmux pingpong over {carrier} (the mux's slot path; {where_})");
    match args.test {
        Test::Lat => {
            println!(
                " {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
                "#bytes", "#iters", "t_min[µs]", "t_typ[µs]", "t_avg[µs]", "t_99[µs]", "t_max[µs]"
            );
            for r in &lat_rows {
                println!(
                    " {:>8} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                    r.bytes,
                    r.iterations,
                    r.t_min_us,
                    r.t_typ_us,
                    r.t_avg_us,
                    r.t_99_us,
                    r.t_max_us
                );
            }
        }
        Test::Bw => {
            println!(
                " {:>8} {:>10} {:>14} {:>14}",
                "#bytes", "#iters", "BW avg[MiB/s]", "MsgRate[Mpps]"
            );
            for r in &bw_rows {
                println!(
                    " {:>8} {:>10} {:>14.3} {:>14.6}",
                    r.bytes, r.iterations, r.bw_mib_s, r.msg_rate_mpps
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::mem::{MemConfig, MemFabric, MemNode};

    /// A server and a client node on one in-memory fabric; the client's
    /// mux heartbeats an idle slot every second.
    fn fabric_pair() -> (MemNode, MemNode) {
        let fabric = MemFabric::new(MemConfig::default());
        let server = fabric.node(PeerId(SERVER_ID), MuxConfig::default());
        let chatty = MuxConfig {
            heartbeat: Some(Duration::from_secs(1)),
            ..MuxConfig::default()
        };
        (server, fabric.node(PeerId(7), chatty))
    }

    /// The server's hello bound, and a client's hello stream that has sent
    /// its address.
    async fn hello_with_address(server: &MemNode, client: &MemNode) -> (SlotReceiver, SlotSender) {
        let hello = bind_hello(server).await.expect("bind");
        let mut tx = (client.mux())
            .open(PeerId(SERVER_ID), StreamKey::new(HELLO_ANCHOR, 0))
            .expect("open");
        tx.send(Bytes::from(client.address())).await.expect("sent");
        (hello, tx)
    }

    /// A client whose process lives (its mux heartbeats the hello slot)
    /// but whose run does not go on is abandoned at the silence bound
    /// (review 41b: heartbeats used to restart it, so it held the server).
    #[tokio::test(start_paused = true)]
    async fn a_live_client_that_sends_nothing_is_abandoned_despite_its_heartbeats() {
        let (server, client) = fabric_pair();
        let (hello, _tx) = hello_with_address(&server, &client).await;
        let served =
            tokio::time::timeout(CLIENT_SILENCE * 4, serve_client(&server, hello, None)).await;
        let err = served.expect("abandoned within its bound").unwrap_err();
        assert!(err.to_string().contains("silent"), "{err:#}");
    }

    /// A peer that opens the hello and says nothing at all (its heartbeats
    /// off) is abandoned too.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_opens_the_hello_and_says_nothing_is_abandoned() {
        let fabric = MemFabric::new(MemConfig::default());
        let server = fabric.node(PeerId(SERVER_ID), MuxConfig::default());
        let mute = MuxConfig {
            heartbeat: None,
            ..MuxConfig::default()
        };
        let client = fabric.node(PeerId(7), mute);
        let hello = bind_hello(&server).await.expect("bind");
        let _tx = (client.mux())
            .open(PeerId(SERVER_ID), StreamKey::new(HELLO_ANCHOR, 0))
            .expect("open");
        let served =
            tokio::time::timeout(CLIENT_SILENCE * 4, serve_client(&server, hello, None)).await;
        let err = served.expect("abandoned within its bound").unwrap_err();
        assert!(err.to_string().contains("no address"), "{err:#}");
    }

    /// `--max-run` binds a `--server` only, so it is refused without one
    /// rather than ignored; its default asks for nothing.
    #[test]
    fn max_run_is_a_server_flag() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: PingpongArgs,
        }
        let parse =
            |args: &[&str]| <Cli as clap::Parser>::try_parse_from(args).map(|c| c.args.max_run);
        assert_eq!(parse(&["pingpong"]).ok(), Some(3600));
        assert!(parse(&["pingpong", "--max-run", "5"]).is_err());
        let server = ["pingpong", "--server", "127.0.0.1:7000", "--max-run", "5"];
        assert_eq!(parse(&server).ok(), Some(5));
    }

    /// A client whose run goes on and on (a record a second, never silent)
    /// is abandoned once it has held the server for `--max-run`.
    #[tokio::test(start_paused = true)]
    async fn a_run_past_the_bound_is_abandoned() {
        let (server, client) = fabric_pair();
        let (hello, mut tx) = hello_with_address(&server, &client).await;
        let run = 1 << 16;
        let mut welcome = (client.mux())
            .bind(StreamKey::new(PONG_ANCHOR, run))
            .expect("bind");
        tx.send(encode_plan(run, 1)).await.expect("sent");
        let mut session = (client.mux())
            .open(PeerId(SERVER_ID), StreamKey::new(PING_ANCHOR, run | 1))
            .expect("open");
        let bound = Duration::from_secs(60);
        let served = tokio::time::timeout(bound * 2, serve_client(&server, hello, Some(bound)));
        let feed = async {
            session.send(Bytes::from_static(b"bw")).await.expect("sent");
            // Until the server drops the session, abandoning the run.
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if session.send(Bytes::from_static(b"a record")).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        let err = tokio::select! {
            served = served => served.expect("abandoned within twice its bound").unwrap_err(),
            () = feed => unreachable!("the feed never ends"),
        };
        assert!(err.to_string().contains("--max-run"), "{err:#}");
        // The client is told why, after its welcome.
        let ok = next_data(&mut welcome).await;
        assert!(
            matches!(ok, Some(Frame::Data(ref w)) if w.as_ref() == WELCOME),
            "{ok:?}"
        );
        let why = server_word(&mut welcome).await.expect("the server's word");
        assert!(why.contains("--max-run"), "{why}");
    }

    /// Waiting for the first client is idle, not a client gone silent.
    #[tokio::test(start_paused = true)]
    async fn a_server_waits_for_its_first_client_without_a_bound() {
        let (server, _client) = fabric_pair();
        let hello = bind_hello(&server).await.expect("bind");
        let served =
            tokio::time::timeout(CLIENT_SILENCE * 4, serve_client(&server, hello, None)).await;
        assert!(served.is_err(), "gave up on nobody: {served:?}");
    }

    /// A mode the server does not know ends the session by name, not as a
    /// bandwidth run both ends then wait on for ever.
    #[tokio::test(start_paused = true)]
    async fn an_unknown_mode_ends_the_session_by_name() {
        let (server, client) = fabric_pair();
        let peer = server.register(&client.address()).expect("register");
        let session = 1 << 16 | 1;
        let mut tx = (client.mux())
            .open(PeerId(SERVER_ID), StreamKey::new(PING_ANCHOR, session))
            .expect("open");
        tx.send(Bytes::from_static(b"latency")).await.expect("sent");
        tx.send(Bytes::from_static(b"a record"))
            .await
            .expect("sent");
        let served = tokio::time::timeout(CLIENT_SILENCE, serve_session(&server, peer, session));
        let err = served.await.expect("ends at once").unwrap_err();
        assert!(err.to_string().contains("unknown pingpong mode"), "{err:#}");
    }

    /// A client that sends records and takes no echo (its pong stream bound
    /// and never read) is abandoned once an echo has waited for the
    /// silence bound; it used to hold the server for good.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_takes_no_echo_is_abandoned() {
        let (server, client) = fabric_pair();
        let peer = server.register(&client.address()).expect("register");
        let session = 1 << 16 | 1;
        let _unread = (client.mux())
            .bind(StreamKey::new(PONG_ANCHOR, session))
            .expect("bind");
        let mut tx = (client.mux())
            .open(PeerId(SERVER_ID), StreamKey::new(PING_ANCHOR, session))
            .expect("open");
        tx.send(Bytes::from_static(b"lat")).await.expect("sent");
        let record = Bytes::from(vec![7u8; 64 * 1024]);
        // Sends until the server, stuck on an echo, takes no more.
        let feed = async { while tx.send(record.clone()).await.is_ok() {} };
        let served =
            tokio::time::timeout(CLIENT_SILENCE * 4, serve_session(&server, peer, session));
        let err = tokio::select! {
            served = served => served.expect("abandoned within its bound").unwrap_err(),
            () = feed => panic!("the client's stream ended first"),
        };
        assert!(err.to_string().contains("took no echo"), "{err:#}");
    }

    /// A client run of `test` at `size` against a server that binds the
    /// session's ping stream and never reads it or answers: its error.
    async fn run_against_a_stuck_server(test: Test, size: usize) -> anyhow::Error {
        let (server, node) = fabric_pair();
        let server_peer = node.register(&server.address()).expect("register");
        let session = 1 << 16 | 1;
        let _stuck = (server.mux())
            .bind(StreamKey::new(PING_ANCHOR, session))
            .expect("bind");
        let measure = Measure {
            test,
            size,
            iters: 1000,
            warmup: 0,
            patience: Duration::from_secs(20),
        };
        let bar = ProgressBar::hidden();
        let run = client(&node, server_peer, session, measure, &bar);
        tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("fails within its patience")
            .unwrap_err()
    }

    /// A latency run against a server that takes its records and never
    /// answers fails after its patience, naming the missing reply.
    #[tokio::test(start_paused = true)]
    async fn a_server_that_never_echoes_fails_the_latency_run() {
        let err = run_against_a_stuck_server(Test::Lat, 64).await;
        assert!(err.to_string().contains("no reply"), "{err:#}");
    }

    /// A bandwidth run against a server that takes no record fails once a
    /// send has waited its patience, not held for good.
    #[tokio::test(start_paused = true)]
    async fn a_server_that_takes_no_record_fails_the_bandwidth_run() {
        let err = run_against_a_stuck_server(Test::Bw, 64 * 1024).await;
        assert!(err.to_string().contains("took no record"), "{err:#}");
    }

    /// t_typ is the median, averaging the middle two; t_99 the sample at
    /// perftest's index, floor(0.99 (n - 1)) (of 100, the second largest).
    #[test]
    fn t_typ_is_the_median_and_t_99_at_perftests_index() {
        let samples: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let row = lat_row(64, samples);
        assert_eq!((row.t_min_us, row.t_max_us), (1.0, 100.0));
        assert_eq!(row.t_typ_us, 50.5);
        assert_eq!(row.t_99_us, 99.0);
        let odd: Vec<Duration> = (1..=5).map(Duration::from_micros).collect();
        assert_eq!(lat_row(64, odd).t_typ_us, 3.0);
    }

    /// A refusal reads the same whether it closed the hello before its
    /// second send or after: scripts retry on "one client at a time".
    #[test]
    fn a_refused_hello_says_the_server_is_busy_however_it_is_met() {
        for reason in [CloseReason::Refused, CloseReason::UnknownSlot] {
            let said = refused_or(SendError::PeerClosed(reason)).to_string();
            assert!(said.contains("one client at a time"), "{said}");
        }
        let said = refused_or(SendError::PeerClosed(CloseReason::ReceiverGone)).to_string();
        assert!(!said.contains("one client at a time"), "{said}");
    }

    #[test]
    fn a_plan_round_trips() {
        let run = 0x1234_5678_9abc_0000;
        assert_eq!(parse_plan(&encode_plan(run, 3)).unwrap(), (run, 3));
        assert_eq!(
            parse_plan(&encode_plan(run, SESSION_BITS)).unwrap(),
            (run, SESSION_BITS)
        );
    }

    #[test]
    fn a_client_s_plan_is_checked_before_the_server_serves_it() {
        // Wrong length.
        assert!(parse_plan(&[0; 15]).is_err());
        assert!(parse_plan(&[0; 17]).is_err());
        // A run id that overlaps the session numbers, no sessions, too many.
        assert!(parse_plan(&encode_plan(0x1_0001, 1)).is_err());
        assert!(parse_plan(&encode_plan(0x1_0000, 0)).is_err());
        assert!(parse_plan(&encode_plan(0x1_0000, SESSION_BITS + 1)).is_err());
    }
}
