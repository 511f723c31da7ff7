//! [`QpmuxFrameTransport`] implements `velo_ext::FrameTransport`: each velo
//! stream is one native mux slot.
//!
//! ```text
//!  connect: velo ─ Vec<u8> ─► flume (bounded) ─► egress pump ─► SlotSender::send / finish
//!  bind:    SlotReceiver::recv ─► ingress pump ─► flume (bounded) ─ Vec<u8> ─► velo
//! ```
//!
//! The channels carry velo-encoded `StreamFrame` bytes, FIFO, sentinels
//! included. Velo's `Finalized`/`Detached` take the slot's terminal path;
//! velo's `Dropped` (and a channel velo closes without a terminal) drops the
//! slot. On the ingress side the slot's terminal becomes velo's own bytes,
//! so epoch death (`Frame::Dropped`) reaches velo as its `Dropped` frame.
//! Credit: the ingress pump waits on the bounded channel, so a slow velo
//! consumer leaves frames in the slot and the sender's credit is not
//! returned (docs/velo.md § "A pump per slot").

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use velo::streaming::StreamFrame;
use velo_ext::{FrameTransport, InstanceId, PeerInfo, TransportKey, WorkerAddress, WorkerId};

use super::{AdapterError, QpmuxTransport, VeloConfig, encode_address};
use crate::link::Node;
use crate::mux::{
    AsMux, DropReason, Frame, MuxTransport, RecvError, SendError, SlotReceiver, SlotSender,
    StreamKey, Terminal,
};

/// velo's encodings of the frames the adapter writes or recognises: exactly
/// the bytes velo's own `StreamSender` writes (`rmp_serde::to_vec` of
/// `StreamFrame::<()>`).
pub mod velo_frames {
    use std::sync::OnceLock;

    use super::StreamFrame;

    fn cached(cell: &'static OnceLock<Vec<u8>>, frame: StreamFrame<()>) -> &'static [u8] {
        cell.get_or_init(|| rmp_serde::to_vec(&frame).expect("unit sentinels always encode"))
    }

    /// `StreamFrame::Dropped`.
    pub fn dropped() -> &'static [u8] {
        static CELL: OnceLock<Vec<u8>> = OnceLock::new();
        cached(&CELL, StreamFrame::Dropped)
    }

    /// `StreamFrame::Finalized`.
    pub fn finalized() -> &'static [u8] {
        static CELL: OnceLock<Vec<u8>> = OnceLock::new();
        cached(&CELL, StreamFrame::Finalized)
    }

    /// `StreamFrame::Detached`.
    pub fn detached() -> &'static [u8] {
        static CELL: OnceLock<Vec<u8>> = OnceLock::new();
        cached(&CELL, StreamFrame::Detached)
    }

    /// `StreamFrame::Heartbeat`.
    pub fn heartbeat() -> &'static [u8] {
        static CELL: OnceLock<Vec<u8>> = OnceLock::new();
        cached(&CELL, StreamFrame::Heartbeat)
    }

    /// `StreamFrame::TransportError(message)`.
    pub fn transport_error(message: String) -> Vec<u8> {
        rmp_serde::to_vec(&StreamFrame::<()>::TransportError(message))
            .expect("a string always encodes")
    }

    /// The prefix of every `StreamFrame::Item` (a one-entry map keyed "Item").
    pub const ITEM_PREFIX: &[u8] = &[0x81, 0xa4, b'I', b't', b'e', b'm'];

    /// What a velo frame means to the slot carrying it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        /// An item, heartbeat or sender error: data for the slot.
        Data,
        /// `Finalized`: the slot's Finalized terminal.
        Finalized,
        /// `Detached`: the slot's Detached terminal.
        Detached,
        /// `Dropped`: drop the slot.
        Dropped,
        /// `TransportError`: forwarded as data, then the slot is dropped.
        TransportError,
    }

    /// Classifies velo frame bytes (items by prefix, sentinels by velo's own
    /// encoding first, then anything else by decode).
    pub fn classify(bytes: &[u8]) -> Kind {
        if bytes.starts_with(ITEM_PREFIX) {
            return Kind::Data;
        }
        if bytes == finalized() {
            return Kind::Finalized;
        }
        if bytes == detached() {
            return Kind::Detached;
        }
        if bytes == dropped() {
            return Kind::Dropped;
        }
        // velo's decoder also takes other encodings of its sentinels (a
        // longer string type, the variant's number): it ends a stream on
        // those too (review 48e).
        match rmp_serde::from_slice::<StreamFrame<()>>(bytes) {
            Ok(StreamFrame::TransportError(_)) => Kind::TransportError,
            Ok(StreamFrame::Finalized) => Kind::Finalized,
            Ok(StreamFrame::Detached) => Kind::Detached,
            Ok(StreamFrame::Dropped) => Kind::Dropped,
            Ok(StreamFrame::Item(()) | StreamFrame::SenderError(_) | StreamFrame::Heartbeat)
            | Err(_) => Kind::Data,
        }
    }
}

use velo_frames::Kind;

/// velo's per-stream transport over a [`Node`]'s native mux. Built from the
/// [`QpmuxTransport`] it shares peers with ([`QpmuxTransport::frame_transport`]).
pub struct QpmuxFrameTransport<N: Node> {
    transport: Arc<QpmuxTransport<N>>,
    config: VeloConfig,
}

impl<N: Node> QpmuxTransport<N> {
    /// The FrameTransport for velo streams on this transport's node; it maps
    /// velo `WorkerId`s through the peers this transport has registered.
    pub fn frame_transport(self: &Arc<Self>, config: VeloConfig) -> QpmuxFrameTransport<N> {
        QpmuxFrameTransport {
            transport: self.clone(),
            config: config.in_range(),
        }
    }
}

impl<N: Node> AsMux for QpmuxFrameTransport<N> {
    fn as_mux(&self) -> Option<&dyn MuxTransport> {
        Some(self.transport.node().mux())
    }
}

/// velo bytes for a slot frame, and whether the stream ends with it.
fn to_velo(frame: Frame) -> (Vec<u8>, bool) {
    match frame {
        Frame::Data(bytes) => {
            // velo ends the stream on any of its terminals, however it came;
            // a peer that sent one as data gets nothing forwarded after it.
            let end = !matches!(velo_frames::classify(&bytes), Kind::Data);
            (Vec::from(bytes), end)
        }
        Frame::Heartbeat => (velo_frames::heartbeat().to_vec(), false),
        Frame::Finalized => (velo_frames::finalized().to_vec(), true),
        Frame::Detached => (velo_frames::detached().to_vec(), true),
        // velo has no frame for it: its consumer hears why as an error.
        Frame::Dropped(DropReason::RecordTooLarge) => (
            velo_frames::transport_error(
                "the sender's next item is larger than this receiver takes (its record limit or \
                 its window for the sender); the stream ends"
                    .to_string(),
            ),
            true,
        ),
        Frame::Dropped(reason) => {
            tracing::debug!(?reason, "qpmux stream dropped");
            (velo_frames::dropped().to_vec(), true)
        }
        Frame::TransportError(error) => (velo_frames::transport_error(error.to_string()), true),
    }
}

/// How soon a pump over its byte limit first looks again whether velo took
/// a frame (flume wakes a sender only when the channel is full in frames);
/// each look that finds none doubles the wait, up to [`ROOM_POLL_MAX`], so
/// many stalled streams cost few wake-ups.
const ROOM_POLL: Duration = Duration::from_millis(1);
/// The longest wait between looks.
const ROOM_POLL_MAX: Duration = Duration::from_millis(32);

/// The bytes of the frames a pump put in velo's channel that velo has not
/// taken yet. The channel is FIFO, so those are the newest `tx.len()`.
struct ChannelBytes {
    sizes: VecDeque<usize>,
    bytes: usize,
    limit: usize,
}

impl ChannelBytes {
    fn new(limit: usize) -> ChannelBytes {
        ChannelBytes {
            sizes: VecDeque::new(),
            bytes: 0,
            limit,
        }
    }

    fn sent(&mut self, len: usize) {
        self.sizes.push_back(len);
        self.bytes += len;
    }

    /// Forgets the frames velo took: all but the last `in_channel`.
    fn settle(&mut self, in_channel: usize) {
        while self.sizes.len() > in_channel {
            self.bytes -= self.sizes.pop_front().unwrap_or(0);
        }
    }

    /// Returns once the channel holds less than the limit, or nothing (a
    /// limit of 0 still lets one frame at a time through), or velo has gone
    /// (which the next send finds).
    async fn room(&mut self, tx: &flume::Sender<Vec<u8>>) {
        let mut poll = ROOM_POLL;
        loop {
            self.settle(tx.len());
            if self.bytes < self.limit || self.sizes.is_empty() || tx.is_disconnected() {
                return;
            }
            tokio::time::sleep(poll).await;
            poll = (poll * 2).min(ROOM_POLL_MAX);
        }
    }
}

async fn ingress_pump(
    mut slot: SlotReceiver,
    tx: flume::Sender<Vec<u8>>,
    watch: Duration,
    byte_limit: usize,
) {
    // One timer for the pump's life: an idle turn polls it, not a new one.
    let mut watch = tokio::time::interval_at(tokio::time::Instant::now() + watch, watch);
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut waiting = ChannelBytes::new(byte_limit);
    loop {
        // Room before the frame leaves the slot: a frame left there holds
        // its credit, so the sender waits instead of this node's memory.
        waiting.room(&tx).await;
        let frame = match slot.try_recv() {
            Ok(frame) => frame,
            Err(RecvError::Ended) => break,
            // Only an idle pump watches velo's end of the channel: velo may
            // abandon a bind whose sender never comes (a failed attach, a
            // sender that died), and no frame would ever show it.
            Err(RecvError::Empty) => tokio::select! {
                frame = slot.recv() => match frame {
                    Some(frame) => frame,
                    None => break,
                },
                _ = watch.tick() => {
                    if tx.is_disconnected() {
                        // Closes the slot and frees its registry entry; velo
                        // mints session ids afresh, so a sender late for this
                        // one is refused rather than left to fill an entry.
                        tracing::debug!(key = ?slot.key(), "velo abandoned a bound stream");
                        slot.abandon();
                        return;
                    }
                    continue;
                }
            },
        };
        let (bytes, end) = to_velo(frame);
        let len = bytes.len();
        if tx.send_async(bytes).await.is_err() {
            // velo dropped the stream; dropping `slot` closes it.
            return;
        }
        waiting.sent(len);
        if end {
            return;
        }
    }
    // The slot ended without a terminal we forwarded: cannot happen (the
    // terminal is always returned once), but velo must still see an end.
    if tx
        .send_async(velo_frames::dropped().to_vec())
        .await
        .is_err()
    {
        tracing::debug!("velo stream gone before its end");
    }
}

async fn egress_pump(mut slot: SlotSender, rx: flume::Receiver<Vec<u8>>) {
    loop {
        let bytes = match rx.try_recv() {
            Ok(bytes) => bytes,
            Err(flume::TryRecvError::Disconnected) => break,
            // Only an idle pump watches the slot (a waiter per frame cost
            // the 64 B stream about 16%): a slot that ends while velo has
            // nothing to send (its epoch died) closes velo's channel now,
            // not at velo's next frame.
            Err(flume::TryRecvError::Empty) => tokio::select! {
                received = rx.recv_async() => match received {
                    Ok(bytes) => bytes,
                    Err(_) => break,
                },
                error = slot.closed() => {
                    tracing::debug!(%error, "qpmux stream ended while idle");
                    return;
                }
            },
        };
        let kind = velo_frames::classify(&bytes);
        let terminal = match kind {
            Kind::Finalized => Terminal::Finalized,
            Kind::Detached => Terminal::Detached,
            // Dropping the slot ends it with Dropped at the receiver.
            Kind::Dropped => return,
            Kind::Data | Kind::TransportError => {
                if let Err(error) = slot.send(Bytes::from(bytes)).await {
                    if let SendError::TooLarge { len, max } = error {
                        // velo took the item as sent: its consumer hears
                        // why the stream ends, not a bare Dropped.
                        tracing::warn!(
                            len,
                            max,
                            "velo stream item past the mux's record limit; the stream ends"
                        );
                        let why = format!(
                            "item of {len} bytes exceeds the transport's {max}-byte record limit"
                        );
                        let said = velo_frames::transport_error(why);
                        if let Err(error) = slot.send(Bytes::from(said)).await {
                            tracing::debug!(%error, "qpmux stream's transport error not sent");
                        }
                    } else {
                        tracing::debug!(%error, "qpmux stream send failed");
                    }
                    return;
                }
                if kind == Kind::TransportError {
                    return;
                }
                continue;
            }
        };
        if let Err(error) = slot.finish(terminal) {
            tracing::debug!(%error, "qpmux stream terminal not sent");
        }
        return;
    }
    // velo closed the channel without a terminal: `slot` drops -> Dropped.
}

impl<N: Node> FrameTransport for QpmuxFrameTransport<N> {
    fn key(&self) -> TransportKey {
        TransportKey::new(super::TRANSPORT_KEY)
    }

    fn address(&self) -> WorkerAddress {
        encode_address(&self.transport.node().address())
    }

    fn register(&self, peer_info: &PeerInfo) -> anyhow::Result<()> {
        velo_ext::Transport::register(&*self.transport, peer_info.clone())
            .map_err(anyhow::Error::from)
    }

    fn unregister(&self, instance_id: InstanceId) {
        velo_ext::Transport::unregister(&*self.transport, instance_id);
    }

    fn bind(
        &self,
        anchor_id: u64,
        session_id: u64,
    ) -> BoxFuture<'_, anyhow::Result<flume::Receiver<Vec<u8>>>> {
        let bound = self
            .transport
            .node()
            .mux()
            .bind(StreamKey::new(anchor_id, session_id))
            .map_err(AdapterError::Mux);
        let config = &self.config;
        let (capacity, watch, bytes) = (
            config.stream_channel,
            config.stream_watch,
            config.stream_channel_bytes,
        );
        Box::pin(async move {
            let slot = bound?;
            let (tx, rx) = flume::bounded(capacity);
            tokio::spawn(ingress_pump(slot, tx, watch, bytes));
            Ok(rx)
        })
    }

    fn connect(
        &self,
        peer: WorkerId,
        anchor_id: u64,
        session_id: u64,
    ) -> BoxFuture<'_, anyhow::Result<flume::Sender<Vec<u8>>>> {
        let opened = self
            .transport
            .peer_of_worker(peer)
            .ok_or(AdapterError::UnknownWorker(peer.as_u64()))
            .and_then(|peer| {
                self.transport
                    .node()
                    .mux()
                    .open(peer, StreamKey::new(anchor_id, session_id))
                    .map_err(AdapterError::Mux)
            });
        let capacity = self.config.stream_channel;
        Box::pin(async move {
            let slot = opened?;
            let (tx, rx) = flume::bounded(capacity);
            tokio::spawn(egress_pump(slot, rx));
            Ok(tx)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::velo_frames::{self, Kind};
    use super::*;

    #[test]
    fn sentinels_are_velos_own_bytes() {
        let enc = |f: &StreamFrame<String>| rmp_serde::to_vec(f).expect("encodes");
        assert_eq!(velo_frames::dropped(), enc(&StreamFrame::Dropped));
        assert_eq!(velo_frames::finalized(), enc(&StreamFrame::Finalized));
        assert_eq!(velo_frames::detached(), enc(&StreamFrame::Detached));
        assert_eq!(velo_frames::heartbeat(), enc(&StreamFrame::Heartbeat));
    }

    #[test]
    fn classification_matches_velo_for_every_variant() {
        let enc = |f: &StreamFrame<String>| rmp_serde::to_vec(f).expect("encodes");
        let cases = [
            (StreamFrame::Item("x".to_string()), Kind::Data),
            (StreamFrame::Item("Finalized".to_string()), Kind::Data),
            (StreamFrame::SenderError("e".to_string()), Kind::Data),
            (StreamFrame::Heartbeat, Kind::Data),
            (StreamFrame::Dropped, Kind::Dropped),
            (StreamFrame::Detached, Kind::Detached),
            (StreamFrame::Finalized, Kind::Finalized),
            (
                StreamFrame::TransportError("t".to_string()),
                Kind::TransportError,
            ),
        ];
        for (frame, kind) in cases {
            assert_eq!(velo_frames::classify(&enc(&frame)), kind, "{frame:?}");
        }
        let nested = rmp_serde::to_vec(&StreamFrame::Item(velo_frames::finalized().to_vec()))
            .expect("encodes");
        assert_eq!(velo_frames::classify(&nested), Kind::Data);
        assert_eq!(velo_frames::classify(&[0xc1, 0xff]), Kind::Data);
    }

    #[test]
    fn a_record_too_large_for_the_receiver_becomes_velos_transport_error() {
        let (bytes, end) = to_velo(Frame::Dropped(DropReason::RecordTooLarge));
        assert!(end);
        let decoded: StreamFrame<()> = rmp_serde::from_slice(&bytes).expect("velo decodes it");
        match decoded {
            StreamFrame::TransportError(why) => {
                assert!(why.contains("record limit or its window"), "{why}")
            }
            other => panic!("expected a transport error, got {other:?}"),
        }
    }

    #[test]
    fn epoch_death_becomes_velos_dropped_and_ends_the_pump() {
        let reason = crate::mux::DropReason::EpochEnded {
            epoch: crate::mux::Epoch(1),
        };
        let (bytes, end) = to_velo(Frame::Dropped(reason));
        assert!(end);
        let decoded: StreamFrame<()> = rmp_serde::from_slice(&bytes).expect("velo decodes it");
        assert!(matches!(decoded, StreamFrame::Dropped));
        let (bytes, end) = to_velo(Frame::Finalized);
        assert!(end && bytes == velo_frames::finalized());
        let (_, end) = to_velo(Frame::Heartbeat);
        assert!(!end);
    }

    /// A record whose bytes are one of velo's terminals (a peer that does
    /// not run our egress pump) ends the pump as velo ends the stream
    /// (review 48a); items and heartbeats sent as data do not.
    #[test]
    fn a_terminal_sent_as_data_ends_the_pump() {
        for terminal in [
            velo_frames::finalized().to_vec(),
            velo_frames::detached().to_vec(),
            velo_frames::dropped().to_vec(),
            velo_frames::transport_error("t".to_string()),
        ] {
            let (bytes, end) = to_velo(Frame::Data(Bytes::from(terminal.clone())));
            assert!(end && bytes == terminal, "{terminal:?}");
        }
        // The same terminal as velo's decoder also reads it: the variant
        // name as a str8 rather than a fixstr.
        let mut str8 = vec![0xd9, 9];
        str8.extend_from_slice(b"Finalized");
        let decoded: StreamFrame<()> = rmp_serde::from_slice(&str8).expect("velo reads it");
        assert!(matches!(decoded, StreamFrame::Finalized));
        assert_eq!(velo_frames::classify(&str8), Kind::Finalized);
        assert!(to_velo(Frame::Data(Bytes::from(str8))).1);
        let item = rmp_serde::to_vec(&StreamFrame::Item("Finalized".to_string())).expect("item");
        for data in [item, velo_frames::heartbeat().to_vec()] {
            assert!(!to_velo(Frame::Data(Bytes::from(data))).1);
        }
    }
}
