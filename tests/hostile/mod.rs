//! A peer that speaks the wire correctly but lies, and an honest peer to
//! prove the lie hurt nobody else. Shared by `hostile_peer.rs` and
//! `resource_bounds.rs`.
//!
//! ```text
//!  Arena:  honest node H ══ MemFabric link ══╗
//!                                            ╠══ target mux T (under test)
//!  HostileMem: raw MemLink end ─ BatchEncoder ╝   (lies crafted with the real encoder)
//!  HostileDialer: raw TcpStream ─ Handshake (real machine, wrong key / replay / silence) ─► TcpNode
//! ```
//!
//! Waits are on states; the callers bound them with `bounded`.
#![allow(dead_code)] // each test binary uses its own part of the kit

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use qpmux::link::bootstrap::{
    BootstrapError, ClusterKey, Endpoint, Event, Handshake, HelloFields, MAX_MESSAGE, TcpEndpoint,
    fresh_nonce,
};
use qpmux::link::mem::{MemConfig, MemFabric, MemLink, pair};
use qpmux::link::{EpochEnd, Link, LinkError, Node};
use qpmux::mux::protocol::{
    BATCH_HEADER_LEN, BatchEncoder, BatchView, CloseReason, FrameSeq, Lane, RecordBody, SlotId,
};
use qpmux::mux::{
    Epoch, Frame, Mux, MuxConfig, MuxTransport, PeerId, PeerTerms, SlotReceiver, SlotSender,
    StreamKey, Terminal,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The node under test.
pub const TARGET: PeerId = PeerId(1);
/// The honest peer.
pub const HONEST: PeerId = PeerId(2);
/// The liar.
pub const EVIL: PeerId = PeerId(66);
/// The epoch of the liar's link.
pub const EVIL_EPOCH: Epoch = Epoch(1);

/// Turns a hang into a failure (never a measurement).
pub async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), f)
        .await
        .expect("test did not reach its state")
}

/// Waits (on state, polling) until `cond` holds.
pub async fn until(mut cond: impl FnMut() -> bool) {
    while !cond() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// What the liar heard from the target, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Heard {
    /// The target opened an egress slot to us.
    Open(SlotId, StreamKey),
    /// The target closed (or refused) a slot.
    Close(SlotId, CloseReason),
    /// The target granted credit.
    Credit(SlotId, u32),
    /// The target returned peer credit.
    PeerCredit(u32),
    /// Slot data of this many bytes.
    Data(SlotId, usize),
    /// A Pong with its nonce.
    Pong(u64),
    /// Anything else (ping, heartbeat, goodbye, message).
    Other,
}

/// The far end of a mem link attached to the target, driven by hand.
pub struct HostileMem {
    /// The liar's end.
    pub link: MemLink,
    /// The target's end (to read the target's verdict).
    target_end: MemLink,
    epoch: Epoch,
    batch_seq: u32,
    next_seq: HashMap<SlotId, FrameSeq>,
}

impl HostileMem {
    /// Attaches a fresh mem link to `target` as peer `me`, on the terms a
    /// node's hello would carry: the target's windows for both sides, and
    /// the target granting us its `peer_room`.
    pub fn attach(target: &Mux<MemLink>, me: PeerId, epoch: Epoch) -> HostileMem {
        let (ours, theirs) = pair(epoch, MemConfig::default());
        let terms = PeerTerms::announced_by(target.config());
        target.attach_with_terms(me, ours.clone(), terms, target.peer_room(me));
        HostileMem {
            link: theirs,
            target_end: ours,
            epoch,
            batch_seq: 0,
            next_seq: HashMap::new(),
        }
    }

    /// Posts one batch stamped `epoch` / `batch_seq`, then lets `patch`
    /// rewrite the encoded bytes (for lies the encoder refuses to write).
    pub async fn post_raw(
        &mut self,
        epoch: Epoch,
        batch_seq: u32,
        build: impl FnOnce(&mut BatchEncoder<'_>),
        patch: impl FnOnce(&mut [u8]),
    ) -> Result<(), LinkError> {
        let mut buf = self.link.reserve().await?;
        let mut enc = BatchEncoder::new(&mut buf, epoch, batch_seq, Lane(0)).expect("fits");
        build(&mut enc);
        let len = enc.finish();
        patch(&mut buf[..len]);
        self.link.post(buf, len)
    }

    /// Posts the next correctly numbered batch; an error once the epoch is over.
    pub async fn post_checked(
        &mut self,
        build: impl FnOnce(&mut BatchEncoder<'_>),
    ) -> Result<(), LinkError> {
        let (epoch, seq) = (self.epoch, self.batch_seq);
        self.batch_seq += 1;
        self.post_raw(epoch, seq, build, |_| {}).await
    }

    /// Posts the next correctly numbered batch of this epoch.
    pub async fn post(&mut self, build: impl FnOnce(&mut BatchEncoder<'_>)) {
        let (epoch, seq) = (self.epoch, self.batch_seq);
        self.batch_seq += 1;
        self.post_raw(epoch, seq, build, |_| {})
            .await
            .expect("post");
    }

    fn take_seq(&mut self, slot: SlotId) -> FrameSeq {
        let seq = self.next_seq.entry(slot).or_default();
        let now = *seq;
        *seq = seq.next();
        now
    }

    /// An honest OpenSlot for `key` on `slot`.
    pub async fn open(&mut self, slot: SlotId, key: StreamKey) {
        self.next_seq.insert(slot, FrameSeq(0));
        let seq = self.take_seq(slot);
        self.post(|enc| {
            enc.push_open(slot, seq, key.anchor.0, key.session.0)
                .expect("fits")
        })
        .await;
    }

    /// An honest Data record on `slot` (in sequence).
    pub async fn data(&mut self, slot: SlotId, body: &[u8]) {
        let seq = self.take_seq(slot);
        self.post(|enc| enc.push_data(slot, seq, body, false).expect("fits"))
            .await;
    }

    /// `n` Data records of one byte each on `slot` (in sequence), as many
    /// to a batch as fit.
    pub async fn one_byte_records(&mut self, slot: SlotId, mut n: usize) {
        while n > 0 {
            let start = self.next_seq.get(&slot).copied().unwrap_or_default();
            let mut pushed = 0u32;
            self.post(|enc| {
                while (pushed as usize) < n
                    && enc
                        .push_data(slot, FrameSeq(start.0.wrapping_add(pushed)), &[7], false)
                        .is_ok()
                {
                    pushed += 1;
                }
            })
            .await;
            assert!(pushed > 0, "a batch holds a one-byte record");
            self.next_seq
                .insert(slot, FrameSeq(start.0.wrapping_add(pushed)));
            n -= pushed as usize;
        }
    }

    /// An honest CloseSlot on `slot` (in sequence).
    pub async fn close(&mut self, slot: SlotId, reason: CloseReason) {
        let seq = self.take_seq(slot);
        self.post(|enc| enc.push_close(slot, seq, reason).expect("fits"))
            .await;
    }

    /// A Ping, then waits for a Pong at or past its nonce (one Pong answers
    /// every ping up to its own): the target has handled every batch posted
    /// before it.
    pub async fn ping(&mut self, nonce: u64) {
        self.post(|enc| enc.push_ping(nonce).expect("fits")).await;
        self.hear_until(|h| matches!(h, Heard::Pong(n) if *n >= nonce))
            .await;
    }

    // ---- the lies ----

    /// Data for a slot index nobody opened.
    pub async fn lie_unopened_slot(&mut self, slot: SlotId) {
        self.post(|enc| {
            enc.push_data(slot, FrameSeq(0), b"never opened", false)
                .expect("fits")
        })
        .await;
    }

    /// Data for `live`'s index at another generation.
    pub async fn lie_stale_generation(&mut self, live: SlotId) {
        let stale = SlotId::new(live.index(), live.generation().wrapping_sub(1)).expect("slot");
        self.post(|enc| {
            enc.push_data(stale, FrameSeq(1), b"stale", false)
                .expect("fits")
        })
        .await;
    }

    /// Fills `window` bytes of slot credit in one record, then starts
    /// another record that no credit covers.
    pub async fn lie_past_slot_credit(&mut self, slot: SlotId, window: usize) {
        let (first, second) = (self.take_seq(slot), self.take_seq(slot));
        let body = vec![7u8; window];
        self.post(|enc| {
            enc.push_data(slot, first, &body, false).expect("fits");
            enc.push_data(slot, second, b"uncovered", false)
                .expect("fits");
        })
        .await;
    }

    /// A PeerCredit returning `bytes` the target never sent.
    pub async fn lie_peer_credit_overgrant(&mut self, bytes: u32) {
        self.post(|enc| enc.push_peer_credit(bytes).expect("fits"))
            .await;
    }

    /// A CreditUpdate for the target's egress `slot` larger than any window.
    pub async fn lie_credit_overgrant(&mut self, slot: SlotId, bytes: u32) {
        self.post(|enc| enc.push_credit(slot, bytes).expect("fits"))
            .await;
    }

    /// Skips `skip` frame sequence numbers on `slot`.
    pub async fn lie_frame_seq_jump(&mut self, slot: SlotId, skip: u32) {
        let seq = FrameSeq(self.take_seq(slot).0.wrapping_add(skip));
        self.post(|enc| enc.push_data(slot, seq, b"jump", false).expect("fits"))
            .await;
    }

    /// One unfragmented Data record of `len` bytes.
    pub async fn lie_record_of(&mut self, slot: SlotId, len: usize) {
        let seq = self.take_seq(slot);
        let body = vec![1u8; len];
        self.post(|enc| enc.push_data(slot, seq, &body, false).expect("fits"))
            .await;
    }

    /// One unfragmented message-class record of `len` bytes (first message
    /// of the epoch).
    pub async fn lie_message_of(&mut self, len: usize) {
        let body = vec![2u8; len];
        self.post(|enc| enc.push_message(FrameSeq(0), &body, false).expect("fits"))
            .await;
    }

    /// A Data record whose length field claims `claim` bytes, past the batch end.
    pub async fn lie_length_past_end(&mut self, slot: SlotId, claim: u32) {
        let seq = self.take_seq(slot);
        let (epoch, batch_seq) = (self.epoch, self.batch_seq);
        self.batch_seq += 1;
        self.post_raw(
            epoch,
            batch_seq,
            |enc| enc.push_data(slot, seq, b"short", false).expect("fits"),
            |bytes| {
                // The first record's length field: type(1) slot(4) seq(4).
                let len_at = BATCH_HEADER_LEN + 9;
                bytes[len_at..len_at + 4].copy_from_slice(&claim.to_be_bytes());
            },
        )
        .await
        .expect("post");
    }

    /// A well-formed batch stamped with `epoch` instead of the link's.
    pub async fn lie_old_epoch(&mut self, epoch: Epoch) {
        let seq = self.batch_seq;
        self.batch_seq += 1;
        self.post_raw(epoch, seq, |enc| enc.push_ping(1).expect("fits"), |_| {})
            .await
            .expect("post");
    }

    /// A well-formed batch numbered `skip` past the next one.
    pub async fn lie_batch_seq_jump(&mut self, skip: u32) {
        let seq = self.batch_seq + skip;
        self.batch_seq = seq + 1;
        let epoch = self.epoch;
        self.post_raw(epoch, seq, |enc| enc.push_ping(1).expect("fits"), |_| {})
            .await
            .expect("post");
    }

    /// Goodbye, then (in the next batch) more data on `slot`.
    pub async fn lie_goodbye_then_data(&mut self, slot: SlotId) {
        self.post(|enc| enc.push_goodbye().expect("fits")).await;
        let seq = self.take_seq(slot);
        // The target may have ended the epoch already; then the post fails,
        // which is the same verdict.
        let batch_seq = self.batch_seq;
        self.batch_seq += 1;
        let epoch = self.epoch;
        self.post_raw(
            epoch,
            batch_seq,
            |enc| {
                enc.push_data(slot, seq, b"after goodbye", false)
                    .expect("fits")
            },
            |_| {},
        )
        .await
        .ok();
    }

    /// OpenSlot records for `count` fresh slots starting at index `from`,
    /// all for `anchor` with sessions `0..count`, as few batches as fit.
    pub async fn lie_open_flood(&mut self, from: u32, count: u32, anchor: u64) {
        let mut next = 0;
        while next < count {
            let start = next;
            let mut wrote = 0;
            self.post(|enc| {
                while start + wrote < count {
                    let slot = SlotId::new(from + start + wrote, 0).expect("slot");
                    if enc
                        .push_open(slot, FrameSeq(0), anchor, u64::from(start + wrote))
                        .is_err()
                    {
                        break;
                    }
                    wrote += 1;
                }
            })
            .await;
            next += wrote;
        }
    }

    // ---- listening ----

    /// Every record of the next batch from the target.
    pub async fn hear(&self) -> Result<Vec<Heard>, LinkError> {
        let batch = self.link.recv().await?;
        let view = BatchView::new_checked(&batch).expect("the target writes valid batches");
        Ok(view
            .records()
            .map(|r| match r.body {
                RecordBody::Open { anchor, session } => {
                    Heard::Open(r.slot, StreamKey::new(anchor, session))
                }
                RecordBody::Close(reason) => Heard::Close(r.slot, reason),
                RecordBody::Credit(bytes) => Heard::Credit(r.slot, bytes),
                RecordBody::PeerCredit(bytes) => Heard::PeerCredit(bytes),
                RecordBody::Data(body) => Heard::Data(r.slot, body.len()),
                RecordBody::Pong(nonce) => Heard::Pong(nonce),
                _ => Heard::Other,
            })
            .collect())
    }

    /// Listens until `want` matches a record; returns it.
    pub async fn hear_until(&self, mut want: impl FnMut(&Heard) -> bool) -> Heard {
        loop {
            for heard in self.hear().await.expect("link alive") {
                if want(&heard) {
                    return heard;
                }
            }
        }
    }

    /// How the target ended the liar's epoch.
    pub async fn verdict(&self) -> EpochEnd {
        self.target_end.ended().await
    }

    /// The target's link ends the epoch itself with `reason`, as a link
    /// does on a violation of its own rules (framing, link credit).
    pub fn link_verdict(&self, reason: EpochEnd) {
        self.target_end.fail(reason);
    }

    /// True once the liar's epoch is over.
    pub fn is_ended(&self) -> bool {
        self.link.is_ended()
    }
}

/// An honest node streaming to the target over the fabric, on one slot
/// that stays open across whatever the liar does.
pub struct Honest {
    /// The honest node's mux.
    pub mux: Mux<MemLink>,
    target: Mux<MemLink>,
    tx: SlotSender,
    rx: SlotReceiver,
    sent: u32,
    got: u32,
    epoch: Epoch,
}

impl Honest {
    /// Opens the long-lived slot and streams a first round through it.
    /// `config` must match the target's: slot windows are not negotiated.
    pub async fn start(
        fabric: &Arc<MemFabric>,
        target: &Mux<MemLink>,
        config: MuxConfig,
    ) -> Honest {
        let mux = fabric.node(HONEST, config).mux().clone();
        let key = StreamKey::new(HONEST.0, 1);
        let rx = target.bind(key).expect("bind");
        let tx = mux.open(TARGET, key).expect("open");
        let mut honest = Honest {
            mux,
            target: target.clone(),
            tx,
            rx,
            sent: 0,
            got: 0,
            epoch: Epoch::default(),
        };
        honest.round(20).await;
        honest.epoch = target.epoch(HONEST).expect("honest epoch is up");
        honest
    }

    /// Sends `n` records and receives them, in order, nothing else in between.
    pub async fn round(&mut self, n: u32) {
        for _ in 0..n {
            let mut body = vec![0u8; 64];
            body[..4].copy_from_slice(&self.sent.to_be_bytes());
            self.tx.send(Bytes::from(body)).await.expect("honest send");
            self.sent += 1;
        }
        for _ in 0..n {
            match self.rx.recv().await {
                Some(Frame::Data(d)) => {
                    let n = u32::from_be_bytes(d[..4].try_into().expect("4 bytes"));
                    assert_eq!(n, self.got, "honest records in order, exactly once");
                    self.got += 1;
                }
                other => panic!("honest stream saw {other:?}"),
            }
        }
    }

    /// Streams another round, finishes, and checks the honest epoch and
    /// counters: the liar cost this peer nothing.
    pub async fn still_unaffected(mut self) {
        self.round(20).await;
        assert_eq!(
            self.target.epoch(HONEST),
            Some(self.epoch),
            "honest epoch kept"
        );
        self.tx.finish(Terminal::Finalized).expect("finish");
        assert_eq!(self.rx.recv().await, Some(Frame::Finalized));
        let theirs = self.mux.stats();
        assert_eq!(theirs.protocol_violations, 0);
        assert_eq!(theirs.epoch_deaths, 0);
        assert_eq!(theirs.slots_dropped, 0);
    }
}

/// The target mux, an honest peer streaming to it, and an attached liar.
pub struct Arena {
    /// Keeps the fabric's links alive.
    pub fabric: Arc<MemFabric>,
    /// The mux under test.
    pub target: Mux<MemLink>,
    /// The honest peer.
    pub honest: Honest,
    /// The liar.
    pub evil: HostileMem,
}

impl Arena {
    /// Builds the arena with `config` on the target.
    pub async fn new(config: MuxConfig) -> Arena {
        let fabric = MemFabric::new(MemConfig::default());
        let target = fabric.node(TARGET, config.clone()).mux().clone();
        let honest = Honest::start(&fabric, &target, config).await;
        let evil = HostileMem::attach(&target, EVIL, EVIL_EPOCH);
        Arena {
            fabric,
            target,
            honest,
            evil,
        }
    }
}

// ---- the bootstrap side ----

/// A raw TCP client of a node's listener that runs the real handshake
/// machine where a lie needs a correct transcript.
pub struct HostileDialer {
    /// The connection.
    pub stream: TcpStream,
    /// The listener's challenge frame, as received.
    pub challenge: Vec<u8>,
}

impl HostileDialer {
    /// Connects and reads the listener's challenge.
    pub async fn connect(addr: SocketAddr) -> HostileDialer {
        let stream = TcpStream::connect(addr).await.expect("connect");
        HostileDialer::challenged(stream).await
    }

    /// As [`HostileDialer::connect`], from source IP `from`.
    pub async fn connect_from(from: IpAddr, addr: SocketAddr) -> HostileDialer {
        HostileDialer::challenged(HostileDialer::silent_from(from, addr).await).await
    }

    async fn challenged(mut stream: TcpStream) -> HostileDialer {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).await.expect("challenge");
        let mut challenge = len.to_vec();
        challenge.resize(4 + u32::from_be_bytes(len) as usize, 0);
        stream
            .read_exact(&mut challenge[4..])
            .await
            .expect("challenge");
        HostileDialer { stream, challenge }
    }

    /// Connects and says nothing (slowloris).
    pub async fn silent(addr: SocketAddr) -> TcpStream {
        TcpStream::connect(addr).await.expect("connect")
    }

    /// As [`HostileDialer::silent`], from source IP `from` (any of 127/8
    /// works on loopback).
    pub async fn silent_from(from: IpAddr, addr: SocketAddr) -> TcpStream {
        let socket = match from {
            IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .expect("socket");
        socket.bind(SocketAddr::new(from, 0)).expect("bind source");
        socket.connect(addr).await.expect("connect")
    }

    /// The hello a real dialer `me` with `key` would send to `to` on this
    /// connection (its MAC is under `key`, whatever the listener's is).
    pub fn hello(&self, key: Option<&[u8]>, me: PeerId, to: PeerId) -> Vec<u8> {
        self.hello_of(key, me, to, 7)
    }

    /// [`HostileDialer::hello`] from process incarnation `incarnation` (a
    /// liar may claim a restart on every connection).
    pub fn hello_of(
        &self,
        key: Option<&[u8]>,
        me: PeerId,
        to: PeerId,
        incarnation: u64,
    ) -> Vec<u8> {
        let mut hs = self.handshake(key, me, to, Epoch::default(), incarnation);
        hs.poll_transmit().expect("the hello")
    }

    /// A real dialer's handshake machine on this connection, its hello (which
    /// proposes `proposed`) queued.
    fn handshake(
        &self,
        key: Option<&[u8]>,
        me: PeerId,
        to: PeerId,
        proposed: Epoch,
        incarnation: u64,
    ) -> Handshake {
        let fields = HelloFields {
            node: me,
            incarnation,
            proposed,
            endpoint: Endpoint::Tcp(TcpEndpoint { max_batch: 65536 }),
            slot_window: 256 * 1024,
            peer_window: 64 << 20,
            peer_credit: 64 << 20,
            max_record: 16 << 20,
            max_slots: 65_536,
        };
        let key = key.map(|k| ClusterKey::new(k).expect("key length"));
        let mut hs = Handshake::dialer(key, fields, Some(to), fresh_nonce());
        hs.handle_input(&self.challenge).expect("a valid challenge");
        hs
    }

    /// Runs the whole handshake as `me`, proposing `proposed` (any value the
    /// wire allows), and returns the agreed epoch with the connection, now
    /// the link's; or why it did not get one.
    pub async fn establish(
        self,
        key: Option<&[u8]>,
        me: PeerId,
        to: PeerId,
        proposed: Epoch,
    ) -> Result<(Epoch, TcpStream), BootstrapError> {
        let (dialer, hs, epoch) = self.answered(key, me, to, proposed).await?;
        Ok((epoch, dialer.send_ready(hs).await))
    }

    /// Runs the handshake as `me` up to the listener's answer and stops
    /// before the ready: returns the connection and the agreed epoch, with
    /// the ready still to send ([`HostileDialer::send_ready`]), or why not.
    pub async fn answered(
        mut self,
        key: Option<&[u8]>,
        me: PeerId,
        to: PeerId,
        proposed: Epoch,
    ) -> Result<(HostileDialer, Handshake, Epoch), BootstrapError> {
        let mut hs = self.handshake(key, me, to, proposed, 7);
        let hello = hs.poll_transmit().expect("the hello");
        self.stream.write_all(&hello).await.ok();
        let mut buf = [0u8; 1024];
        loop {
            match hs.poll_event() {
                Some(Event::Established(done)) => return Ok((self, hs, done.epoch)),
                Some(Event::Declined(reason)) => return Err(BootstrapError::Declined(reason)),
                Some(Event::PeerHello(_)) | None => {}
            }
            match self.stream.read(&mut buf).await {
                Ok(0) | Err(_) => return Err(hs.handle_eof()),
                Ok(n) => {
                    hs.handle_input(&buf[..n])?;
                }
            }
        }
    }

    /// Sends the ready [`HostileDialer::answered`] held back; the connection
    /// is then the link's.
    pub async fn send_ready(mut self, mut hs: Handshake) -> TcpStream {
        let ready = hs.poll_transmit().expect("the ready");
        // (A reset is the test's to see on the link.)
        self.stream.write_all(&ready).await.ok();
        self.stream
    }

    /// Writes `bytes` (ignoring a reset: the listener may have cut us already).
    pub async fn say(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.ok();
    }

    /// A length prefix beyond the bootstrap's message limit.
    pub fn oversized_prefix() -> Vec<u8> {
        ((MAX_MESSAGE as u32) + 1).to_be_bytes().to_vec()
    }

    /// Reads until the listener closes the connection; true if it said
    /// nothing at all before closing.
    pub async fn closed(mut self) -> bool {
        read_to_close(&mut self.stream).await == 0
    }
}

/// Reads until EOF or reset; returns the bytes read.
pub async fn read_to_close(stream: &mut TcpStream) -> usize {
    let mut buf = [0u8; 512];
    let mut total = 0;
    while let Ok(n) = stream.read(&mut buf).await {
        if n == 0 {
            break;
        }
        total += n;
    }
    total
}
