//! The bootstrap handshake as a sans-IO state machine: bytes in, bytes and
//! events out. Opens no sockets and reads no clock; the TCP link drives it
//! today and the RDMA link will drive the same machine.
//!
//! ```text
//!  dialer                                   listener
//!    │ ◄──────────── challenge(nonce_L) ────── │  speaks first: nothing is created yet
//!    │ ── hello_D(echo nonce_L, nonce_D) + MAC_D ─► │  verify → Event::PeerHello → respond()/decline()
//!    │ ◄─ hello_L(echo nonce_D) + MAC_L ────── │  (or decline(reason): not a fault)
//!    │ ── ready(epoch) + MAC_R ──────────────► │  verify → Event::Established
//!  Event::Established (after sending ready)
//! ```
//!
//! MACs are HMAC-SHA256 under the cluster key over a per-message label and the
//! whole transcript so far (both nonces, both hellos); without a key the same
//! messages flow with an empty MAC. Epoch = max(both proposals) + 1. Inputs:
//! [`Handshake::handle_input`], [`Handshake::handle_eof`]; driver commands:
//! [`Handshake::respond`], [`Handshake::decline`]; outputs, polled after each
//! input or command: [`Handshake::poll_transmit`] and [`Handshake::poll_event`]
//! (an RDMA dialer handles `Established` — QP to RTR — before it flushes the
//! ready). Formats and rulings: `docs/bootstrap.md`.

mod error;
mod wire;

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub use self::error::BootstrapError;
pub use self::wire::{
    DeclineReason, Endpoint, EndpointKind, HelloFields, MAC_LEN, MAGIC, MAX_MESSAGE, MessageKind,
    NONCE_LEN, Nonce, PROTOCOL_VERSION, RdmaEndpoint, TcpEndpoint,
};
use self::wire::{HelloMessage, MAC_LEN as TAG_LEN, Message};
use crate::mux::PeerId;
use crate::mux::protocol::Epoch;

type HmacSha256 = Hmac<Sha256>;

const LABEL_DIALER_HELLO: &[u8] = b"qpmux bootstrap v1: dialer hello";
const LABEL_LISTENER_HELLO: &[u8] = b"qpmux bootstrap v1: listener hello";
const LABEL_READY: &[u8] = b"qpmux bootstrap v1: ready";

/// The shared secret that authenticates nodes of one cluster. Cheap to clone;
/// `Debug` never shows the bytes.
#[derive(Clone)]
pub struct ClusterKey(Arc<[u8]>);

impl ClusterKey {
    /// Smallest key accepted, in bytes.
    pub const MIN_LEN: usize = 16;

    /// A key from raw bytes; `None` if shorter than [`Self::MIN_LEN`].
    pub fn new(bytes: &[u8]) -> Option<ClusterKey> {
        (bytes.len() >= Self::MIN_LEN).then(|| ClusterKey(bytes.into()))
    }

    fn mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let mut mac = self.hmac();
        mac.update(label);
        for part in parts {
            mac.update(&(part.len() as u32).to_be_bytes());
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }

    fn verify(&self, label: &[u8], parts: &[&[u8]], tag: &[u8; TAG_LEN]) -> bool {
        let mut mac = self.hmac();
        mac.update(label);
        for part in parts {
            mac.update(&(part.len() as u32).to_be_bytes());
            mac.update(part);
        }
        mac.verify_slice(tag).is_ok()
    }

    fn hmac(&self) -> HmacSha256 {
        <HmacSha256 as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterKey(..)")
    }
}

/// Which side of the connection this machine is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Accepted the connection; speaks first.
    Listener,
    /// Opened the connection.
    Dialer,
}

/// What the handshake tells its driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Listener only: an authenticated dialer said hello. Create resources
    /// now, then call [`Handshake::respond`] (or [`Handshake::decline`]).
    PeerHello(HelloFields),
    /// Both hellos are verified and the epoch agreed; the link may start.
    Established(Established),
    /// Dialer only: the listener declined this connection (not a fault).
    Declined(DeclineReason),
}

/// The outcome of a completed handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Established {
    /// What the peer said about itself.
    pub peer: HelloFields,
    /// The agreed epoch: max(both proposals) + 1.
    pub epoch: Epoch,
}

#[derive(Debug)]
enum State {
    /// Dialer: waiting for the listener's challenge.
    AwaitChallenge,
    /// Listener: challenge sent, waiting for the dialer's hello.
    AwaitDialerHello,
    /// Listener: the driver owes `respond` or `decline`.
    AwaitLocal { peer: HelloFields },
    /// Dialer: hello sent, waiting for the listener's hello (or decline).
    AwaitListenerHello,
    /// Listener: hello sent, waiting for the dialer's ready.
    AwaitReady {
        peer: HelloFields,
        epoch: Epoch,
        listener_hello: Vec<u8>,
    },
    /// Finished (established or declined); takes no more input.
    Done,
    /// Failed; takes no more input.
    Failed,
}

/// One side of one bootstrap handshake.
#[derive(Debug)]
pub struct Handshake {
    role: Role,
    key: Option<ClusterKey>,
    transport: EndpointKind,
    /// Dialer: our hello; listener: filled by `respond`.
    local: Option<HelloFields>,
    /// Dialer: the node we mean to reach.
    expect: Option<PeerId>,
    /// Listener only: our own node id (to refuse a self-dial).
    me: Option<PeerId>,
    my_nonce: Nonce,
    peer_nonce: Option<Nonce>,
    /// Transcript: the challenge body and the dialer hello's signed part.
    challenge: Vec<u8>,
    dialer_hello: Vec<u8>,
    state: State,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    events: VecDeque<Event>,
}

impl Handshake {
    /// The listener's side: queues the challenge carrying `nonce` (which must
    /// be fresh and random per connection). `me` is this node's id.
    pub fn listener(
        key: Option<ClusterKey>,
        me: PeerId,
        transport: EndpointKind,
        nonce: Nonce,
    ) -> Handshake {
        let challenge = wire::challenge(&nonce);
        let mut out = Vec::new();
        wire::frame(&mut out, &challenge);
        Handshake {
            role: Role::Listener,
            key,
            transport,
            local: None,
            expect: None,
            me: Some(me),
            my_nonce: nonce,
            peer_nonce: None,
            challenge,
            dialer_hello: Vec::new(),
            state: State::AwaitDialerHello,
            inbuf: Vec::new(),
            out,
            events: VecDeque::new(),
        }
    }

    /// The dialer's side: says `local` once the challenge arrives; `expect`
    /// is the node it means to reach (`None`: anyone but itself).
    pub fn dialer(
        key: Option<ClusterKey>,
        local: HelloFields,
        expect: Option<PeerId>,
        nonce: Nonce,
    ) -> Handshake {
        Handshake {
            role: Role::Dialer,
            key,
            transport: local.endpoint.kind(),
            local: Some(local),
            expect,
            me: Some(local.node),
            my_nonce: nonce,
            peer_nonce: None,
            challenge: Vec::new(),
            dialer_hello: Vec::new(),
            state: State::AwaitChallenge,
            inbuf: Vec::new(),
            out: Vec::new(),
            events: VecDeque::new(),
        }
    }

    /// This side's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// True once established, declined or failed.
    pub fn is_finished(&self) -> bool {
        match self.state {
            State::Done | State::Failed => true,
            State::AwaitChallenge
            | State::AwaitDialerHello
            | State::AwaitLocal { .. }
            | State::AwaitListenerHello
            | State::AwaitReady { .. } => false,
        }
    }

    /// True while the machine can use more input (not waiting on the driver,
    /// not finished).
    pub fn wants_input(&self) -> bool {
        match self.state {
            State::AwaitChallenge
            | State::AwaitDialerHello
            | State::AwaitListenerHello
            | State::AwaitReady { .. } => true,
            State::AwaitLocal { .. } | State::Done | State::Failed => false,
        }
    }

    /// Bytes to send, if any (all that is queued). After an error only a
    /// listener's decline of a dialer that passed every check but its
    /// transport, to be written before the connection closes.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        (!self.out.is_empty()).then(|| std::mem::take(&mut self.out))
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Feeds bytes from the peer. Returns how many were consumed: input stops
    /// being consumed when the machine waits on the driver or has finished,
    /// so bytes after the handshake stay with the caller (they belong to the link).
    pub fn handle_input(&mut self, input: &[u8]) -> Result<usize, BootstrapError> {
        if matches!(self.state, State::Failed) {
            return Err(BootstrapError::AlreadyFailed);
        }
        let mut consumed = 0;
        while self.wants_input() && consumed < input.len() {
            // Take just enough for the length prefix, then the body.
            let need = if self.inbuf.len() < 4 {
                4 - self.inbuf.len()
            } else {
                let len = u32::from_be_bytes([
                    self.inbuf[0],
                    self.inbuf[1],
                    self.inbuf[2],
                    self.inbuf[3],
                ]);
                4 + len as usize - self.inbuf.len()
            };
            let take = need.min(input.len() - consumed);
            self.inbuf
                .extend_from_slice(&input[consumed..consumed + take]);
            consumed += take;
            if self.inbuf.len() == 4 {
                let len = u32::from_be_bytes([
                    self.inbuf[0],
                    self.inbuf[1],
                    self.inbuf[2],
                    self.inbuf[3],
                ]);
                if len as usize > MAX_MESSAGE {
                    return Err(self.fail(BootstrapError::Oversized {
                        len,
                        max: MAX_MESSAGE,
                    }));
                }
                if len == 0 {
                    return Err(self.fail(BootstrapError::Truncated));
                }
                continue;
            }
            if self.inbuf.len() > 4 && take == need {
                let body = std::mem::take(&mut self.inbuf);
                if let Err(err) = self.handle_message(&body[4..]) {
                    return Err(self.fail(err));
                }
            }
        }
        Ok(consumed)
    }

    /// The peer closed its side. Returns why that ends the handshake
    /// (`Truncated` mid-message, `Closed` between messages); after `Done` the
    /// handshake is unaffected and this returns `Closed`.
    pub fn handle_eof(&mut self) -> BootstrapError {
        let err = if self.inbuf.is_empty() {
            BootstrapError::Closed
        } else {
            BootstrapError::Truncated
        };
        match self.state {
            State::Done => BootstrapError::Closed,
            State::Failed => BootstrapError::AlreadyFailed,
            State::AwaitChallenge
            | State::AwaitDialerHello
            | State::AwaitLocal { .. }
            | State::AwaitListenerHello
            | State::AwaitReady { .. } => self.fail(err),
        }
    }

    /// Listener: answers an authenticated dialer with our hello (`local`
    /// proposes the last epoch we ran with that peer).
    pub fn respond(&mut self, local: HelloFields) -> Result<(), BootstrapError> {
        let State::AwaitLocal { peer } = self.state else {
            return Err(BootstrapError::OutOfOrder);
        };
        let peer_nonce = self.peer_nonce.ok_or(BootstrapError::OutOfOrder)?;
        let signed = wire::hello_signed(&local, &peer_nonce, &self.my_nonce);
        let mac = self.key.as_ref().map(|k| {
            k.mac(
                LABEL_LISTENER_HELLO,
                &[&self.challenge, &self.dialer_hello, &signed],
            )
        });
        let epoch = agreed_epoch(peer.proposed, local.proposed)?;
        wire::frame(&mut self.out, &wire::with_mac(signed.clone(), mac));
        self.local = Some(local);
        self.state = State::AwaitReady {
            peer,
            epoch,
            listener_hello: signed,
        };
        Ok(())
    }

    /// Listener: declines an authenticated dialer (crossed or stale dial).
    pub fn decline(&mut self, reason: DeclineReason) -> Result<(), BootstrapError> {
        let State::AwaitLocal { .. } = self.state else {
            return Err(BootstrapError::OutOfOrder);
        };
        wire::frame(&mut self.out, &wire::decline(reason));
        self.state = State::Done;
        Ok(())
    }

    fn fail(&mut self, err: BootstrapError) -> BootstrapError {
        self.state = State::Failed;
        self.inbuf = Vec::new();
        // Nothing queued before the failure goes out, except a listener's
        // word to a dialer that passed every check but its transport: told
        // nothing, it would redial into the same refusal.
        self.out.clear();
        if let (Role::Listener, BootstrapError::WrongTransport { .. }) = (&self.role, &err) {
            wire::frame(&mut self.out, &wire::decline(DeclineReason::WrongTransport));
        }
        err
    }

    /// Checks the MAC trailer against the key configuration.
    fn check_mac(
        &self,
        label: &[u8],
        parts: &[&[u8]],
        mac: Option<[u8; TAG_LEN]>,
    ) -> Result<(), BootstrapError> {
        match (&self.key, mac) {
            (Some(key), Some(tag)) => {
                if key.verify(label, parts, &tag) {
                    Ok(())
                } else {
                    Err(BootstrapError::BadMac)
                }
            }
            (Some(_), None) => Err(BootstrapError::MissingMac),
            (None, Some(_)) => Err(BootstrapError::UnexpectedMac),
            (None, None) => Ok(()),
        }
    }

    fn check_peer(&self, fields: &HelloFields) -> Result<(), BootstrapError> {
        if self.me == Some(fields.node) {
            return Err(BootstrapError::SelfConnect);
        }
        if let Some(expected) = self.expect {
            if expected != fields.node {
                return Err(BootstrapError::WrongPeer {
                    expected,
                    got: fields.node,
                });
            }
        }
        let got = fields.endpoint.kind();
        if got != self.transport {
            return Err(BootstrapError::WrongTransport {
                expected: self.transport,
                got,
            });
        }
        Ok(())
    }

    fn handle_message(&mut self, body: &[u8]) -> Result<(), BootstrapError> {
        let message = wire::decode(body)?;
        let got = message.kind();
        let unexpected = |expected| Err(BootstrapError::Unexpected { expected, got });
        let state = std::mem::replace(&mut self.state, State::Failed);
        match state {
            State::AwaitChallenge => match message {
                Message::Challenge { version: _, nonce } => self.on_challenge(body, nonce),
                Message::Hello(_) | Message::Ready { .. } | Message::Decline(_) => {
                    unexpected(MessageKind::Challenge)
                }
            },
            State::AwaitDialerHello => match message {
                Message::Hello(hello) => self.on_dialer_hello(body, hello),
                Message::Challenge { .. } | Message::Ready { .. } | Message::Decline(_) => {
                    unexpected(MessageKind::Hello)
                }
            },
            State::AwaitListenerHello => match message {
                Message::Hello(hello) => self.on_listener_hello(body, hello),
                Message::Decline(reason) => {
                    self.events.push_back(Event::Declined(reason));
                    self.state = State::Done;
                    Ok(())
                }
                Message::Challenge { .. } | Message::Ready { .. } => unexpected(MessageKind::Hello),
            },
            State::AwaitReady {
                peer,
                epoch,
                listener_hello,
            } => match message {
                Message::Ready {
                    epoch: theirs,
                    mac,
                    signed_len,
                } => {
                    self.check_mac(
                        LABEL_READY,
                        &[
                            &self.challenge,
                            &self.dialer_hello,
                            &listener_hello,
                            &body[..signed_len],
                        ],
                        mac,
                    )?;
                    if theirs != epoch {
                        return Err(BootstrapError::EpochMismatch {
                            ours: epoch,
                            theirs,
                        });
                    }
                    self.events
                        .push_back(Event::Established(Established { peer, epoch }));
                    self.state = State::Done;
                    Ok(())
                }
                Message::Challenge { .. } | Message::Hello(_) | Message::Decline(_) => {
                    unexpected(MessageKind::Ready)
                }
            },
            // `handle_input` feeds no message in these states.
            State::AwaitLocal { .. } | State::Done | State::Failed => {
                Err(BootstrapError::OutOfOrder)
            }
        }
    }

    /// Dialer: the listener's challenge arrived; say hello with our proof.
    fn on_challenge(&mut self, body: &[u8], nonce: Nonce) -> Result<(), BootstrapError> {
        let local = self.local.ok_or(BootstrapError::OutOfOrder)?;
        self.challenge = body.to_vec();
        self.peer_nonce = Some(nonce);
        let signed = wire::hello_signed(&local, &nonce, &self.my_nonce);
        let mac = self
            .key
            .as_ref()
            .map(|k| k.mac(LABEL_DIALER_HELLO, &[&self.challenge, &signed]));
        wire::frame(&mut self.out, &wire::with_mac(signed.clone(), mac));
        self.dialer_hello = signed;
        self.state = State::AwaitListenerHello;
        Ok(())
    }

    /// Listener: verify the dialer before anything is created for it.
    fn on_dialer_hello(&mut self, body: &[u8], hello: HelloMessage) -> Result<(), BootstrapError> {
        let signed = &body[..hello.signed_len];
        // The echo first (a replay is named as such), then the MAC, before
        // anything else is looked at or created.
        if hello.echo != self.my_nonce {
            return Err(BootstrapError::StaleNonce);
        }
        self.check_mac(LABEL_DIALER_HELLO, &[&self.challenge, signed], hello.mac)?;
        if hello.nonce == self.my_nonce {
            return Err(BootstrapError::ReflectedNonce);
        }
        // A wrong transport fails here and is declined by `fail`.
        self.check_peer(&hello.fields)?;
        self.dialer_hello = signed.to_vec();
        self.peer_nonce = Some(hello.nonce);
        self.events.push_back(Event::PeerHello(hello.fields));
        self.state = State::AwaitLocal { peer: hello.fields };
        Ok(())
    }

    /// Dialer: verify the listener, agree on the epoch, send ready.
    fn on_listener_hello(
        &mut self,
        body: &[u8],
        hello: HelloMessage,
    ) -> Result<(), BootstrapError> {
        let signed = &body[..hello.signed_len];
        if hello.echo != self.my_nonce {
            return Err(BootstrapError::StaleNonce);
        }
        self.check_mac(
            LABEL_LISTENER_HELLO,
            &[&self.challenge, &self.dialer_hello, signed],
            hello.mac,
        )?;
        if Some(hello.nonce) != self.peer_nonce {
            return Err(BootstrapError::BadField("listener nonce"));
        }
        self.check_peer(&hello.fields)?;
        let local = self.local.ok_or(BootstrapError::OutOfOrder)?;
        let epoch = agreed_epoch(local.proposed, hello.fields.proposed)?;
        let ready = wire::ready_signed(epoch);
        let mac = self.key.as_ref().map(|k| {
            k.mac(
                LABEL_READY,
                &[&self.challenge, &self.dialer_hello, signed, &ready],
            )
        });
        wire::frame(&mut self.out, &wire::with_mac(ready, mac));
        self.events.push_back(Event::Established(Established {
            peer: hello.fields,
            epoch,
        }));
        self.state = State::Done;
        Ok(())
    }
}

/// Epoch = max(both proposals) + 1; none if that would wrap (a wrapped
/// epoch would run below the ones it must supersede).
pub fn agreed_epoch(a: Epoch, b: Epoch) -> Result<Epoch, BootstrapError> {
    let top = a.max(b);
    top.0
        .checked_add(1)
        .map(Epoch)
        .ok_or(BootstrapError::EpochsExhausted(top))
}

/// A fresh random nonce (from the thread's CSPRNG).
pub fn fresh_nonce() -> Nonce {
    rand::random()
}
