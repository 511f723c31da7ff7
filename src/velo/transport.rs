//! [`QpmuxTransport`] implements `velo_ext::Transport`: velo's active
//! messages ride a [`Node`]'s mux message class.
//!
//! ```text
//!  send_message ─► Envelope ─► AdmissionGate (per peer, per epoch) ─► bounded flume ─► mux peer task
//!  mux peer task ─► Inbound (MessageSink) ─► Envelope::decode ─► admit_message / response / event / shutdown
//!                                              └─ Draining ─► ShuttingDown echo on the sender's lane
//! ```
//!
//! A lane is one epoch's channel and the gate over it. When the mux ends the
//! epoch it drops the receiver; the next send sees `is_disconnected` and
//! builds a fresh lane, failing the stale gate. Every frame that never
//! reaches the wire comes back through its `on_error` once: from velo's
//! backend if its admission failed, from the `OutboundMessage` drop hook if
//! it reached the channel (see `fate`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use velo_ext::{
    AdmissionError, AdmissionGate, AdmitOutcome, Direction, HealthCheckError, InstanceId,
    MessageType, PeerInfo, SendOutcome, Transport, TransportAdapter, TransportErrorHandler,
    TransportKey, TransportObservability, TransportRejection, WorkerAddress,
};

use super::fate::{Fate, Report};
use super::wire::{self, Envelope};
use super::{AdapterError, TRANSPORT_KEY, VeloConfig, decode_endpoint, encode_address};
use crate::link::Node;
use crate::link::tcp::ConnectError;
use crate::mux::{AsMux, EpochLosses, MessageSink, MuxTransport, OutboundMessage, PeerId};
use crate::warn_gate::WarnGate;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().expect("velo transport state poisoned")
}

/// How often `closed` looks for the mux's peer tasks to be gone.
const CLOSE_POLL: Duration = Duration::from_millis(5);

/// How recent a lost epoch must be for a health check to tell it: three of
/// velo's 5 s probe intervals.
const LOSS_REPORT_WINDOW: Duration = Duration::from_secs(15);

/// Whether a health check at `now` has a lost epoch to tell: one that ended
/// after `told_up_to` (the instance's registration, or the latest loss an
/// earlier check saw) and within [`LOSS_REPORT_WINDOW`]. velo probes every
/// 5 s while it has live slots, so an older loss came before its streams now.
fn untold_loss(told_up_to: Instant, losses: EpochLosses, now: Instant) -> bool {
    losses.last.is_some_and(|at| {
        at > told_up_to && now.saturating_duration_since(at) <= LOSS_REPORT_WINDOW
    })
}

/// Sweeps the lanes every `lane_sweep` until the transport is gone or shut down.
async fn sweep_lanes<N: Node>(inner: Weak<Inner<N>>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if inner.shut_down.load(Ordering::Acquire) {
            return;
        }
        inner.sweep();
    }
}

/// A message channel the mux handed back unserved: dropped outside the
/// lanes lock (with the lane's senders gone too, each frame in it reports
/// itself).
type Unserved = Option<flume::Receiver<OutboundMessage>>;

/// One epoch's outbound channel and the admission gate over it.
struct Lane {
    tx: flume::Sender<OutboundMessage>,
    gate: AdmissionGate<OutboundMessage>,
    /// Since when frames have waited here with no epoch to the peer.
    unreached_since: Option<Instant>,
    /// When the lane was made: a failed dial that ended before it is not
    /// about its frames.
    made: Instant,
    /// The sweep has seen this lane's epoch up (the peer is connected).
    seen_up: bool,
}

impl Lane {
    fn has_frames(&self) -> bool {
        !self.tx.is_empty() || self.gate.queued_len() > 0
    }
}

/// What `start` hands us.
struct Started {
    rt: tokio::runtime::Handle,
}

struct Inner<N: Node> {
    node: Arc<N>,
    config: VeloConfig,
    key: TransportKey,
    /// velo's instances as the node knows them.
    peers: Mutex<HashMap<InstanceId, PeerId>>,
    /// Where inbound messages go, from `start` on; dropped with the
    /// transport, which closes velo's inbound channels.
    adapter: Mutex<Option<TransportAdapter>>,
    /// Held through a whole `register` or `unregister`, node call and map
    /// update together: a restarted peer's `register` racing its old
    /// instance's `unregister` must not end with the node forgetting the
    /// address the new instance needs.
    registration: Mutex<()>,
    /// Peers that have had an epoch up at least once (for `NeverConnected`).
    connected: Mutex<HashMap<PeerId, bool>>,
    /// Per registered instance, up to when its peer's lost epochs are told
    /// ([`Mux::epochs_lost`](crate::mux::Mux::epochs_lost)): its
    /// registration (a restarted peer's new instance never hears of the old
    /// one's losses), then the latest loss a health check saw.
    lost_seen: Mutex<HashMap<InstanceId, Instant>>,
    /// Registered peers' `max_record`s as their latest epochs said: the mux
    /// forgets an idle peer's when the peer retires.
    limits: Mutex<HashMap<PeerId, usize>>,
    lanes: Mutex<HashMap<PeerId, Lane>>,
    started: OnceLock<Started>,
    observability: OnceLock<Arc<dyn TransportObservability>>,
    shut_down: AtomicBool,
}

/// velo's active-message transport over a qpmux [`Node`]. Cheap to share
/// (`Arc`); add it with `Velo::builder().add_transport(Arc::new(..))`.
pub struct QpmuxTransport<N: Node> {
    inner: Arc<Inner<N>>,
}

impl<N: Node> QpmuxTransport<N> {
    /// A transport over `node` with `config`.
    pub fn new(node: Arc<N>, config: VeloConfig) -> QpmuxTransport<N> {
        QpmuxTransport {
            inner: Arc::new(Inner {
                node,
                config: config.in_range(),
                key: TransportKey::new(TRANSPORT_KEY),
                peers: Mutex::new(HashMap::new()),
                adapter: Mutex::new(None),
                registration: Mutex::new(()),
                connected: Mutex::new(HashMap::new()),
                lost_seen: Mutex::new(HashMap::new()),
                limits: Mutex::new(HashMap::new()),
                lanes: Mutex::new(HashMap::new()),
                started: OnceLock::new(),
                observability: OnceLock::new(),
                shut_down: AtomicBool::new(false),
            }),
        }
    }

    /// The node this transport rides.
    pub fn node(&self) -> &Arc<N> {
        &self.inner.node
    }

    /// The qpmux peer of a registered instance whose worker id is `worker`.
    pub fn peer_of_worker(&self, worker: velo_ext::WorkerId) -> Option<PeerId> {
        lock(&self.inner.peers)
            .iter()
            .find(|(instance, _)| instance.worker_id() == worker)
            .map(|(_, peer)| *peer)
    }

    /// The qpmux peer a registered velo instance maps to.
    pub fn peer_id(&self, instance: InstanceId) -> Option<PeerId> {
        lock(&self.inner.peers).get(&instance).copied()
    }
}

impl<N: Node> AsMux for QpmuxTransport<N> {
    fn as_mux(&self) -> Option<&dyn MuxTransport> {
        Some(self.inner.node.mux())
    }
}

/// A frame's way back to velo when it never reaches the wire.
fn report(on_error: Arc<dyn TransportErrorHandler>, header: Bytes, payload: Bytes) -> Report {
    Box::new(move || {
        on_error.on_error(header, payload, AdapterError::NotWritten.to_string());
    })
}

fn label(message_type: MessageType) -> &'static str {
    match message_type {
        MessageType::Message => "message",
        MessageType::Response => "response",
        MessageType::Ack => "ack",
        MessageType::Event => "event",
        MessageType::ShuttingDown => "shutting_down",
    }
}

impl<N: Node> Inner<N> {
    /// The largest message (header and payload) `peer` takes: ours, or
    /// less where its latest epoch said it takes smaller records (the mux
    /// would refuse a larger one at our end).
    fn max_message_size(&self, peer: Option<PeerId>) -> usize {
        let theirs = peer
            .and_then(|peer| self.peer_max_record(peer))
            .map_or(usize::MAX, |max| max.saturating_sub(wire::OVERHEAD));
        self.config.max_message_size.min(theirs)
    }

    /// The peer's `max_record`: its live entry's, else the last one seen.
    fn peer_max_record(&self, peer: PeerId) -> Option<usize> {
        let live = self.node.mux().peer_max_record(peer);
        let mut limits = lock(&self.limits);
        match live {
            Some(max) => {
                limits.insert(peer, max);
                Some(max)
            }
            None => limits.get(&peer).copied(),
        }
    }

    fn metrics(&self) -> Option<&Arc<dyn TransportObservability>> {
        self.observability.get()
    }

    /// The live lane to `peer`, building a fresh one if the last epoch's
    /// channel is gone; none before `start` or once shut down.
    fn gate(&self, peer: PeerId) -> Result<AdmissionGate<OutboundMessage>, AdapterError> {
        let rt = &self.started.get().ok_or(AdapterError::NotStarted)?.rt;
        let mut lanes = lock(&self.lanes);
        // Again under the lock `shutdown`'s `fail_lanes` takes after setting
        // the flag: a lane built after that would never be failed.
        if self.shut_down.load(Ordering::Acquire) {
            return Err(AdapterError::ShutDown);
        }
        if let Some(lane) = lanes.get(&peer)
            && !lane.tx.is_disconnected()
        {
            return Ok(lane.gate.clone());
        }
        let (tx, rx) = flume::bounded(self.config.message_channel);
        // Before the install, which asks for the lane's first dial.
        let made = Instant::now();
        let unserved = self.node.mux().install_messages(peer, rx);
        let gate = AdmissionGate::new(tx.clone(), rt.clone());
        let stale = lanes.insert(
            peer,
            Lane {
                tx,
                gate: gate.clone(),
                unreached_since: None,
                made,
                seen_up: false,
            },
        );
        drop(lanes);
        // Frames dropped here report themselves (velo's hook or `fate`),
        // which may send again: not under the lock.
        drop(unserved);
        if let Some(stale) = stale {
            stale.gate.fail_all(AdmissionError::ConnectionReplaced);
        }
        Ok(gate)
    }

    /// Retires every lane whose epoch ended, and every lane whose frames
    /// have waited `dial_wait` for an epoch that never came.
    ///
    /// Dead lanes: the mux drains the channel and drops its receiver, but a
    /// frame the gate's driver slips in between the two stays in the buffer
    /// until the last sender goes; dropping the lane frees it, and the frame
    /// reports itself. Unreached lanes: the node keeps redialing a refused
    /// or misconfigured peer forever, so this is where their frames end.
    fn sweep(&self) {
        let now = Instant::now();
        let mux = self.node.mux();
        let mut dead = Vec::new();
        let mut unreached = Vec::new();
        let mut up = Vec::new();
        let mut lanes = lock(&self.lanes);
        for (peer, lane) in lanes.iter_mut() {
            if lane.tx.is_disconnected() {
                dead.push(*peer);
                continue;
            }
            // Read before the epoch: an install clears it before the mux
            // holds the link, so a failure seen here with no epoch after it
            // was not answered by an epoch meanwhile.
            let failure = if lane.has_frames() {
                self.node.last_dial_failure(*peer)
            } else {
                None
            };
            // Asked once per lane until its epoch is seen, and while frames wait.
            let epoch_up = (!lane.seen_up || lane.has_frames()) && mux.epoch(*peer).is_some();
            if epoch_up && !lane.seen_up {
                lane.seen_up = true;
                up.push(*peer);
                if let Some(max) = mux.peer_max_record(*peer) {
                    lock(&self.limits).insert(*peer, max);
                }
            }
            if !lane.has_frames() || epoch_up {
                lane.unreached_since = None;
            } else {
                let since = *lane.unreached_since.get_or_insert(now);
                // A dial no redial mends, ended since the lane was made,
                // reports its frames at once, not after `dial_wait`.
                let for_good = failure
                    .filter(|failure| failure.at >= lane.made && failure.error.is_permanent())
                    .map(|failure| failure.error);
                if for_good.is_some() || now.duration_since(since) >= self.config.dial_wait {
                    unreached.push((*peer, for_good));
                }
            }
        }
        let dead: Vec<Lane> = dead.iter().filter_map(|peer| lanes.remove(peer)).collect();
        // The channel is withdrawn under the lock, so a send racing this
        // sweep builds its fresh lane after it, never before.
        let unreached: Vec<(PeerId, Option<ConnectError>, Lane, Unserved)> = unreached
            .into_iter()
            .filter_map(|(peer, for_good)| {
                let lane = lanes.remove(&peer)?;
                Some((peer, for_good, lane, mux.withdraw_messages(peer)))
            })
            .collect();
        // Failing a gate resolves velo's tickets, and a dropped frame
        // reports itself; either may send: not under the lock.
        drop(lanes);
        self.forget_unregistered();
        // A peer we only send to is seen connected here, so its health
        // checks after a loss say so instead of `NeverConnected`.
        if !up.is_empty() {
            lock(&self.connected).extend(up.into_iter().map(|peer| (peer, true)));
        }
        for lane in dead {
            lane.gate.fail_all(AdmissionError::ChannelClosed);
        }
        for (peer, for_good, lane, unserved) in unreached {
            match for_good {
                Some(err) => {
                    tracing::warn!(?peer, %err, "peer cannot be reached; its queued frames are reported")
                }
                None => {
                    tracing::warn!(?peer, wait = ?self.config.dial_wait, "peer not reached; its queued frames are reported")
                }
            }
            lane.gate.fail_all(AdmissionError::ChannelClosed);
            drop(unserved);
        }
    }

    /// Drops what `connected` and `limits` keep of peers not registered:
    /// a dial-in peer's messages, one that came after its unregister, a
    /// Draining echo each add one, and a node that outlives many clients'
    /// ids would keep one for each.
    /// Each sweep looks at the sizes only: maps no larger than the
    /// registrations are bounded by them, and are left for a later sweep.
    fn forget_unregistered(&self) {
        let instances = lock(&self.peers).len();
        if lock(&self.connected).len() <= instances && lock(&self.limits).len() <= instances {
            return;
        }
        // Held from the snapshot to the retain: a peer registered between
        // them, and at once sent to, would lose what it just recorded.
        let _registering = lock(&self.registration);
        let registered: std::collections::HashSet<PeerId> =
            lock(&self.peers).values().copied().collect();
        lock(&self.connected).retain(|peer, _| registered.contains(peer));
        lock(&self.limits).retain(|peer, _| registered.contains(peer));
    }

    fn note_connected(&self, peer: PeerId) {
        if self.node.mux().epoch(peer).is_some() {
            lock(&self.connected).insert(peer, true);
        }
    }

    /// Sends one frame to `peer` through its gate. Pre-wire failures report
    /// through `on_error` and return `Admitted`.
    fn send(
        &self,
        peer: Result<PeerId, AdapterError>,
        header: Bytes,
        payload: Bytes,
        message_type: MessageType,
        on_error: Arc<dyn TransportErrorHandler>,
    ) -> SendOutcome {
        let len = header.len() + payload.len();
        let checked = peer.and_then(|peer| {
            if self.shut_down.load(Ordering::Acquire) {
                return Err(AdapterError::ShutDown);
            }
            let max = self.max_message_size(Some(peer));
            if len > max {
                return Err(AdapterError::TooLarge { len, max });
            }
            self.gate(peer)
        });
        let gate = match checked {
            Ok(gate) => gate,
            Err(error) => {
                // velo's backend counts it (its handler records `SendError`).
                on_error.on_error(header, payload, error.to_string());
                return SendOutcome::Admitted;
            }
        };
        let body = Envelope::encode(message_type, &header, &payload);
        let fate = Fate::new(report(on_error, header, payload));
        let dropped = fate.clone();
        let message = OutboundMessage {
            body,
            on_fail: Some(Box::new(move |_| dropped.dropped())),
        };
        // velo's backend counts the outbound frame (at once, or when the
        // admission resolves `Ok`); only the queued case is counted here.
        match gate.send(message) {
            SendOutcome::Admitted => {
                fate.admitted();
                SendOutcome::Admitted
            }
            SendOutcome::Pending(admission) => {
                if let Some(metrics) = self.metrics() {
                    metrics.record_send_backpressure();
                }
                SendOutcome::Pending(admission.on_resolved(move |verdict| match verdict {
                    Ok(()) => fate.admitted(),
                    Err(_) => fate.refused(),
                }))
            }
        }
    }

    fn fail_lanes(&self, error: AdmissionError) {
        let lanes: Vec<Lane> = lock(&self.lanes).drain().map(|(_, lane)| lane).collect();
        for lane in lanes {
            lane.gate.fail_all(error.clone());
        }
    }

    fn registered_gauge(&self) {
        if let Some(metrics) = self.metrics() {
            // Counted first: the callback is velo's, not run under our lock.
            let registered = lock(&self.peers).len();
            metrics.set_registered_peers(registered);
        }
    }
}

/// Logs the failure of a reply nobody waits on (the ShuttingDown echo).
struct LogOnly;

impl TransportErrorHandler for LogOnly {
    fn on_error(&self, _header: Bytes, _payload: Bytes, error: String) {
        tracing::debug!(%error, "ShuttingDown echo not sent");
    }
}

/// The mux's message sink: decodes and routes inbound active messages.
struct Inbound<N: Node> {
    inner: Weak<Inner<N>>,
    /// A peer can send malformed messages at line rate: one WARN a second.
    malformed: Mutex<WarnGate>,
}

impl<N: Node> MessageSink for Inbound<N> {
    fn deliver(&self, peer: PeerId, message: Bytes) {
        let Some(inner) = self.inner.upgrade() else {
            return;
        };
        let Some(adapter) = lock(&inner.adapter).clone() else {
            return;
        };
        lock(&inner.connected).insert(peer, true);
        let metrics = inner.metrics();
        let envelope = match Envelope::decode(message) {
            Ok(envelope) => envelope,
            Err(error) => {
                let warn = lock(&self.malformed).admit(tokio::time::Instant::now());
                match warn {
                    Some(suppressed) => tracing::warn!(
                        ?peer,
                        %error,
                        suppressed,
                        "dropping a malformed active message"
                    ),
                    None => tracing::debug!(?peer, %error, "dropping a malformed active message"),
                }
                if let Some(metrics) = metrics {
                    metrics.record_rejection(TransportRejection::DecodeError);
                }
                return;
            }
        };
        let Envelope {
            message_type,
            header,
            payload,
        } = envelope;
        let len = header.len() + payload.len();
        let stream = match message_type {
            MessageType::Message => {
                match adapter.admit_message(header, payload) {
                    AdmitOutcome::Admitted => {
                        if let Some(metrics) = metrics {
                            metrics.record_frame(Direction::Inbound, label(message_type), len);
                        }
                    }
                    AdmitOutcome::Draining { header, .. } => {
                        if let Some(metrics) = metrics {
                            metrics.record_rejection(TransportRejection::DrainRejected);
                        }
                        let outcome = inner.send(
                            Ok(peer),
                            header,
                            Bytes::new(),
                            MessageType::ShuttingDown,
                            Arc::new(LogOnly),
                        );
                        // The echo is fire-and-forget: a Pending ticket needs no polling.
                        drop(outcome);
                    }
                    AdmitOutcome::Disconnected { .. } => {
                        if let Some(metrics) = metrics {
                            metrics.record_rejection(TransportRejection::RouteFailed);
                        }
                        tracing::debug!(?peer, "velo's inbound queue is gone; message dropped");
                    }
                }
                return;
            }
            MessageType::Response => &adapter.response_stream,
            MessageType::Ack | MessageType::Event => &adapter.event_stream,
            MessageType::ShuttingDown => &adapter.shutdown_stream,
        };
        // velo's inbound streams are unbounded: this send never blocks.
        match stream.send((header, payload)) {
            Ok(()) => {
                if let Some(metrics) = metrics {
                    metrics.record_frame(Direction::Inbound, label(message_type), len);
                }
            }
            Err(_) => {
                if let Some(metrics) = metrics {
                    metrics.record_rejection(TransportRejection::RouteFailed);
                }
                tracing::debug!(?peer, ?message_type, "velo's inbound stream is gone");
            }
        }
    }
}

impl<N: Node> Transport for QpmuxTransport<N> {
    fn key(&self) -> TransportKey {
        self.inner.key.clone()
    }

    fn address(&self) -> WorkerAddress {
        encode_address(&self.inner.node.address())
    }

    fn register(&self, peer_info: PeerInfo) -> Result<(), velo_ext::TransportError> {
        let endpoint = decode_endpoint(peer_info.worker_address())?;
        let registering = lock(&self.inner.registration);
        let peer = self
            .inner
            .node
            .register(&endpoint)
            .map_err(AdapterError::Register)?;
        // Before the instance is known: a check that finds it finds its entry.
        lock(&self.inner.lost_seen)
            .entry(peer_info.instance_id())
            .or_insert_with(Instant::now);
        lock(&self.inner.peers).insert(peer_info.instance_id(), peer);
        drop(registering);
        // The gauge calls into velo's metrics: unlocked.
        self.inner.registered_gauge();
        Ok(())
    }

    /// A peer restarted at the same address is a new instance on the same
    /// `PeerId`: forgetting the old instance leaves the node's peer alone.
    fn unregister(&self, instance_id: InstanceId) {
        let registering = lock(&self.inner.registration);
        let peer = {
            let mut peers = lock(&self.inner.peers);
            let Some(peer) = peers.remove(&instance_id) else {
                return;
            };
            // Per instance, so also when another instance keeps the peer.
            lock(&self.inner.lost_seen).remove(&instance_id);
            if peers.values().any(|other| *other == peer) {
                drop(peers);
                drop(registering);
                self.inner.registered_gauge();
                return;
            }
            peer
        };
        let (lane, unserved) = {
            let mut lanes = lock(&self.inner.lanes);
            let lane = lanes.remove(&peer);
            let unserved = lane
                .is_some()
                .then(|| self.inner.node.mux().withdraw_messages(peer))
                .flatten();
            (lane, unserved)
        };
        lock(&self.inner.connected).remove(&peer);
        lock(&self.inner.limits).remove(&peer);
        self.inner.node.unregister(peer);
        drop(registering);
        // Reports go to velo's handler, which may register again: unlocked.
        if let Some(lane) = lane {
            lane.gate.fail_all(AdmissionError::ChannelClosed);
        }
        drop(unserved);
        self.inner.registered_gauge();
    }

    fn send_message(
        &self,
        instance_id: InstanceId,
        header: Bytes,
        payload: Bytes,
        message_type: MessageType,
        on_error: Arc<dyn TransportErrorHandler>,
    ) -> SendOutcome {
        let peer = self
            .peer_id(instance_id)
            .ok_or(AdapterError::UnknownPeer(instance_id));
        self.inner
            .send(peer, header, payload, message_type, on_error)
    }

    fn max_message_size(&self, target: InstanceId) -> Option<usize> {
        Some(self.inner.max_message_size(self.peer_id(target)))
    }

    fn start(
        &self,
        _instance_id: InstanceId,
        channels: TransportAdapter,
        rt: tokio::runtime::Handle,
    ) -> BoxFuture<'_, anyhow::Result<()>> {
        // All of it when polled: a start future dropped unpolled leaves
        // nothing behind, and a failed one nothing half set.
        Box::pin(async move {
            if self.inner.started.get().is_some() {
                return Err(AdapterError::AlreadyStarted.into());
            }
            let sink = Arc::new(Inbound {
                inner: Arc::downgrade(&self.inner),
                malformed: Mutex::default(),
            });
            // Before the sink: a message can arrive as soon as it is set,
            // before `started` is.
            {
                let mut adapter = lock(&self.inner.adapter);
                if adapter.is_some() {
                    return Err(AdapterError::AlreadyStarted.into());
                }
                *adapter = Some(channels);
            }
            if !self.inner.node.mux().set_message_sink(sink) {
                *lock(&self.inner.adapter) = None;
                return Err(AdapterError::SinkTaken.into());
            }
            let started = Started { rt };
            if self.inner.started.set(started).is_err() {
                // Only the start that set the sink gets here; kept as an error.
                return Err(AdapterError::AlreadyStarted.into());
            }
            let started = self.inner.started.get().expect("set just above");
            started.rt.spawn(sweep_lanes(
                Arc::downgrade(&self.inner),
                self.inner.config.lane_sweep,
            ));
            Ok(())
        })
    }

    fn shutdown(&self) {
        self.inner.shut_down.store(true, Ordering::Release);
        self.inner.fail_lanes(AdmissionError::ChannelClosed);
        self.inner.node.shutdown();
    }

    fn closed(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if !self.inner.shut_down.load(Ordering::Acquire) {
                return;
            }
            let mux = self.inner.node.mux();
            let waited = tokio::time::timeout(self.inner.config.close_wait, async {
                while mux.peer_count() > 0 {
                    tokio::time::sleep(CLOSE_POLL).await;
                }
            })
            .await;
            if waited.is_err() {
                tracing::debug!(
                    peers = mux.peer_count(),
                    "qpmux peer tasks still running after close_wait"
                );
            }
        })
    }

    fn set_observability(&self, observability: Arc<dyn TransportObservability>) {
        if self.inner.observability.set(observability).is_err() {
            tracing::debug!("observability handle already installed; keeping the first");
        }
        self.inner.registered_gauge();
    }

    fn begin_drain(&self) {
        // The drain gate is per frame, in `admit_message` on the inbound path.
    }

    fn check_health(
        &self,
        instance_id: InstanceId,
        timeout: Duration,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<(), HealthCheckError>> + Send + '_>> {
        Box::pin(async move {
            if self.inner.started.get().is_none() {
                return Err(HealthCheckError::TransportNotStarted);
            }
            // As velo's own transports answer: its messenger mux ends that
            // peer's epoch, as it should for a peer it no longer knows.
            let Some(peer) = self.peer_id(instance_id) else {
                return Err(HealthCheckError::PeerNotRegistered);
            };
            self.inner.note_connected(peer);
            let ever = lock(&self.inner.connected)
                .get(&peer)
                .copied()
                .unwrap_or(false);
            if !ever {
                return Err(HealthCheckError::NeverConnected);
            }
            let ping = tokio::time::timeout(timeout, self.inner.node.mux().ping(peer)).await;
            // A lost epoch may have taken velo's messenger-mux batches with
            // it, and a quick redial hides that from the ping: say so once,
            // so velo ends its own epoch. Read after the ping, so a death it
            // found is not told again.
            let losses = self.inner.node.mux().epochs_lost(peer);
            let died = {
                let mut seen = lock(&self.inner.lost_seen);
                // Unregistered meanwhile: nobody to tell.
                seen.get_mut(&instance_id).is_some_and(|told_up_to| {
                    let died = untold_loss(*told_up_to, losses, Instant::now());
                    // The max: a concurrent check may have seen a later loss.
                    if let Some(last) = losses.last {
                        *told_up_to = (*told_up_to).max(last);
                    }
                    died
                })
            };
            match ping {
                Ok(Ok(_rtt)) if died => {
                    tracing::debug!(?peer, "an epoch was lost since the last health check");
                    Err(HealthCheckError::ConnectionFailed)
                }
                Ok(Ok(_rtt)) => Ok(()),
                Ok(Err(error)) => {
                    tracing::debug!(?peer, %error, "health ping failed");
                    Err(HealthCheckError::ConnectionFailed)
                }
                Err(_elapsed) => Err(HealthCheckError::Timeout),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_epoch_is_told_once_while_recent_and_only_to_instances_registered_before_it() {
        // Counted from 100 s on, so the arithmetic cannot go below the clock's zero.
        let now = Instant::now() + Duration::from_secs(100);
        let ago = |secs: u64| now - Duration::from_secs(secs);
        let lost_at = |at: Instant, count: u64| EpochLosses {
            count,
            last: Some(at),
        };
        let registered = ago(30);
        let none = EpochLosses::default();
        assert!(!untold_loss(registered, none, now), "none lost");
        assert!(
            untold_loss(registered, lost_at(ago(2), 1), now),
            "first check"
        );
        assert!(!untold_loss(ago(2), lost_at(ago(2), 1), now), "told");
        assert!(untold_loss(ago(9), lost_at(ago(2), 3), now), "a newer one");
        assert!(
            !untold_loss(registered, lost_at(ago(16), 1), now),
            "too old"
        );
        // A restarted peer's new instance: the loss came before it.
        assert!(!untold_loss(ago(1), lost_at(ago(2), 1), now), "before it");
        // A peer task that retired and came back counts afresh; the time
        // still says the loss is new.
        assert!(untold_loss(ago(9), lost_at(ago(2), 1), now));
    }

    /// What `connected` and `limits` keep of a peer goes with its
    /// registration at the next sweep, however it came back.
    #[tokio::test]
    async fn the_sweep_forgets_what_it_keeps_of_unregistered_peers() {
        let fabric = crate::link::mem::MemFabric::new(crate::link::mem::MemConfig::default());
        let node = Arc::new(fabric.node(PeerId(1), crate::mux::MuxConfig::default()));
        let transport = QpmuxTransport::new(node, VeloConfig::default());
        let inner = &transport.inner;
        let registered = InstanceId::new_v4();
        lock(&inner.peers).insert(registered, PeerId(2));
        for peer in [PeerId(2), PeerId(3)] {
            lock(&inner.connected).insert(peer, true);
            lock(&inner.limits).insert(peer, 4096);
        }
        inner.sweep();
        assert_eq!(
            lock(&inner.connected).keys().collect::<Vec<_>>(),
            [&PeerId(2)]
        );
        assert_eq!(lock(&inner.limits).keys().collect::<Vec<_>>(), [&PeerId(2)]);
    }

    #[test]
    fn overhead_is_what_the_default_leaves_room_for() {
        assert_eq!(
            VeloConfig::default().max_message_size + super::super::wire::OVERHEAD,
            crate::mux::MuxConfig::default().max_record
        );
    }
}
