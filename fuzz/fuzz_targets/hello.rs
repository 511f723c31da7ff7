//! The bootstrap handshake under a hostile network.
//!
//! ```text
//!  raw bytes ─────────────────► fresh listener, fresh dialer (any state 0 input)
//!  dialer ◄─ wire ─► fuzzer ◄─ wire ─► listener   honest pair, fuzzer in the middle:
//!           deliver (in chunks), flip, truncate, inject, replay, EOF
//! ```
//!
//! Asserts: no panic; `handle_input` never reports more bytes than it got;
//! a failed handshake stays failed; each side establishes at most once; with
//! a cluster key, whatever a side establishes names exactly the other side's
//! fields and both agree on the epoch (a man in the middle cannot forge).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use qpmux::link::bootstrap::{
    BootstrapError, ClusterKey, DeclineReason, Endpoint, EndpointKind, Event, Handshake,
    HelloFields, RdmaEndpoint, TcpEndpoint,
};
use qpmux::mux::{Epoch, PeerId};

/// Bytes one side may have queued for the other before the harness stops
/// copying: a handshake sends three messages of at most 4 KiB.
const WIRE_CAP: usize = 64 << 10;
const STEPS_CAP: usize = 64;

#[derive(Arbitrary, Debug)]
struct Input {
    keyed: bool,
    rdma: bool,
    dialer_proposes: u64,
    listener_proposes: u64,
    /// The peer credit each hello starts the other side on (≤ the window).
    credit: u32,
    dialer_expects_listener: bool,
    self_dial: bool,
    decline: Option<u8>,
    raw_to_listener: Vec<u8>,
    raw_to_dialer: Vec<u8>,
    steps: Vec<Step>,
}

#[derive(Arbitrary, Debug)]
enum Step {
    /// Hand what is queued toward one side over in chunks of `chunk` bytes.
    Deliver { to_listener: bool, chunk: u8 },
    /// XOR one queued byte.
    Flip { to_listener: bool, at: u16, xor: u8 },
    /// Drop the queued tail after `keep` bytes.
    Truncate { to_listener: bool, keep: u16 },
    /// Append attacker bytes.
    Inject { to_listener: bool, bytes: Vec<u8> },
    /// Append a copy of something the other side sent earlier.
    Replay { to_listener: bool, index: u8 },
    /// Close the connection toward one side.
    Eof { to_listener: bool },
}

const LISTENER_NODE: PeerId = PeerId(0x4c);
const DIALER_NODE: PeerId = PeerId(0x44);
const KEY: &[u8] = b"fuzzing cluster key, 32 bytes..";

fn endpoint(rdma: bool) -> Endpoint {
    if rdma {
        Endpoint::Rdma(RdmaEndpoint {
            qpn: 0x1234,
            psn: 0x42,
            gid: [7; 16],
            gid_index: 0,
            mtu: 1024,
            recv_depth: 64,
            recv_buf_size: 4096,
            lanes: 2,
            udp_port: 4791,
        })
    } else {
        Endpoint::Tcp(TcpEndpoint { max_batch: 1 << 16 })
    }
}

fn fields(node: PeerId, proposes: u64, rdma: bool, credit: u32) -> HelloFields {
    HelloFields {
        node,
        incarnation: node.0 * 1000,
        // The driver never proposes u64::MAX (the decoder refuses it).
        proposed: Epoch(proposes.min(u64::MAX - 1)),
        endpoint: endpoint(rdma),
        slot_window: 256 * 1024,
        peer_window: 64 << 20,
        peer_credit: credit % ((64 << 20) + 1),
        max_record: 16 << 20,
        max_slots: 65_536,
    }
}

/// One side plus what the harness has seen of it.
struct Side {
    hs: Handshake,
    failed: bool,
    established: Option<qpmux::link::bootstrap::Established>,
    sent: Vec<Vec<u8>>,
}

impl Side {
    fn new(hs: Handshake) -> Side {
        Side {
            hs,
            failed: false,
            established: None,
            sent: Vec::new(),
        }
    }

    fn feed(&mut self, bytes: &[u8]) -> usize {
        match self.hs.handle_input(bytes) {
            Ok(n) => {
                assert!(!self.failed, "input accepted after failure");
                assert!(n <= bytes.len());
                n
            }
            Err(BootstrapError::AlreadyFailed) => {
                assert!(self.failed, "AlreadyFailed before any failure");
                bytes.len()
            }
            Err(_) => {
                assert!(self.hs.is_finished());
                self.failed = true;
                bytes.len()
            }
        }
    }

    fn eof(&mut self) {
        let was_done = self.hs.is_finished() && !self.failed;
        let err = self.hs.handle_eof();
        if self.failed {
            assert!(matches!(err, BootstrapError::AlreadyFailed));
        } else if was_done {
            assert!(matches!(err, BootstrapError::Closed));
        } else {
            self.failed = true;
        }
        assert!(self.hs.is_finished());
    }
}

/// Drain both sides: outputs onto the wire, events to the driver logic.
fn pump(input: &Input, listener: &mut Side, dialer: &mut Side, wires: &mut [Vec<u8>; 2]) {
    for (i, side) in [&mut *listener, &mut *dialer].into_iter().enumerate() {
        while let Some(event) = side.hs.poll_event() {
            match event {
                Event::PeerHello(peer) => {
                    assert_eq!(i, 0, "only a listener sees PeerHello");
                    if input.keyed {
                        assert_eq!(peer, dialer_fields(input));
                    }
                    let r = match input.decline.map(|c| c % 5) {
                        Some(0) => side.hs.decline(DeclineReason::CrossedDial),
                        Some(1) => side.hs.decline(DeclineReason::StaleDial),
                        Some(2) => side.hs.decline(DeclineReason::Unavailable),
                        Some(3) => side.hs.decline(DeclineReason::WrongTransport),
                        Some(_) => side.hs.decline(DeclineReason::Incompatible),
                        None => side.hs.respond(listener_fields(input)),
                    };
                    r.expect("the driver's answer is in order after PeerHello");
                }
                Event::Established(e) => {
                    assert!(side.established.is_none(), "established twice");
                    side.established = Some(e);
                }
                Event::Declined(_) => assert_eq!(i, 1, "only a dialer is declined"),
            }
        }
        if let Some(out) = side.hs.poll_transmit() {
            // wires[0] flows to the listener, wires[1] to the dialer.
            let wire = &mut wires[1 - i];
            if wire.len() + out.len() <= WIRE_CAP {
                wire.extend_from_slice(&out);
            }
            side.sent.push(out);
        }
    }
}

fn dialer_fields(input: &Input) -> HelloFields {
    let node = if input.self_dial {
        LISTENER_NODE
    } else {
        DIALER_NODE
    };
    fields(node, input.dialer_proposes, input.rdma, input.credit)
}

fn listener_fields(input: &Input) -> HelloFields {
    fields(
        LISTENER_NODE,
        input.listener_proposes,
        input.rdma,
        input.credit.rotate_left(16),
    )
}

fn new_pair(input: &Input) -> (Side, Side) {
    let key = || {
        input
            .keyed
            .then(|| ClusterKey::new(KEY).expect("long enough"))
    };
    let transport = if input.rdma {
        EndpointKind::Rdma
    } else {
        EndpointKind::Tcp
    };
    let listener = Handshake::listener(key(), LISTENER_NODE, transport, [0x11; 32]);
    let expect = input.dialer_expects_listener.then_some(LISTENER_NODE);
    let dialer = Handshake::dialer(key(), dialer_fields(input), expect, [0x22; 32]);
    (Side::new(listener), Side::new(dialer))
}

fuzz_target!(|input: Input| {
    // Raw bytes straight into each side's first state.
    let (mut listener, mut dialer) = new_pair(&input);
    listener.feed(&input.raw_to_listener);
    dialer.feed(&input.raw_to_dialer);

    // An honest pair with the fuzzer on the wire.
    let (mut listener, mut dialer) = new_pair(&input);
    let mut wires = [Vec::new(), Vec::new()];
    pump(&input, &mut listener, &mut dialer, &mut wires);
    let mut tampered = false;
    for step in input.steps.iter().take(STEPS_CAP) {
        match step {
            Step::Deliver { to_listener, chunk } => {
                let (side, wire) = if *to_listener {
                    (&mut listener, &mut wires[0])
                } else {
                    (&mut dialer, &mut wires[1])
                };
                let chunk = usize::from(*chunk).max(1);
                let mut at = 0;
                while at < wire.len() {
                    let piece = &wire[at..(at + chunk).min(wire.len())];
                    let n = side.feed(piece);
                    at += n;
                    if n < piece.len() {
                        break; // the machine waits on its driver or is done
                    }
                }
                wire.drain(..at);
            }
            Step::Flip {
                to_listener,
                at,
                xor,
            } => {
                let wire = &mut wires[usize::from(!*to_listener)];
                if let Some(b) = wire.get_mut(usize::from(*at)) {
                    tampered |= *xor != 0;
                    *b ^= xor;
                }
            }
            Step::Truncate { to_listener, keep } => {
                let wire = &mut wires[usize::from(!*to_listener)];
                tampered |= usize::from(*keep) < wire.len();
                wire.truncate(usize::from(*keep));
            }
            Step::Inject { to_listener, bytes } => {
                let wire = &mut wires[usize::from(!*to_listener)];
                if wire.len() + bytes.len() <= WIRE_CAP {
                    tampered |= !bytes.is_empty();
                    wire.extend_from_slice(bytes);
                }
            }
            Step::Replay { to_listener, index } => {
                let from = if *to_listener { &dialer } else { &listener };
                if !from.sent.is_empty() {
                    let copy = from.sent[usize::from(*index) % from.sent.len()].clone();
                    let wire = &mut wires[usize::from(!*to_listener)];
                    if wire.len() + copy.len() <= WIRE_CAP {
                        tampered = true;
                        wire.extend_from_slice(&copy);
                    }
                }
            }
            Step::Eof { to_listener } => {
                if *to_listener {
                    listener.eof();
                } else {
                    dialer.eof();
                }
            }
        }
        pump(&input, &mut listener, &mut dialer, &mut wires);
    }

    if trace_on() {
        let mut reached = Vec::new();
        for (name, hit) in [
            ("listener_established", listener.established.is_some()),
            ("dialer_established", dialer.established.is_some()),
            ("listener_failed", listener.failed),
            ("dialer_failed", dialer.failed),
            ("keyed", input.keyed),
            ("tampered", tampered),
        ] {
            if hit {
                reached.push(name);
            }
        }
        eprintln!("reached: {}", reached.join(" "));
    }

    // Authentication: under a key, what a side established is the other side.
    if input.keyed {
        if let Some(e) = &dialer.established {
            assert_eq!(e.peer, listener_fields(&input));
        }
        if let Some(e) = &listener.established {
            assert_eq!(e.peer, dialer_fields(&input));
        }
    }
    if let (Some(d), Some(l)) = (&dialer.established, &listener.established)
        && (input.keyed || !tampered)
    {
        assert_eq!(d.epoch, l.epoch);
        let proposals = input.dialer_proposes.max(input.listener_proposes);
        assert_eq!(d.epoch, Epoch(proposals.min(u64::MAX - 1)).next());
    }
});

/// `FUZZ_TRACE=1` prints what each run reached (replay a corpus with
/// `-runs=0` to see how deep it goes).
fn trace_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("FUZZ_TRACE").is_some())
}
