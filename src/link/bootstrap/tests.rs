//! The handshake machine driven byte by byte: happy paths, every hostile
//! input a typed error, and arbitrary bytes never panic.

use proptest::prelude::*;

use super::*;

const D: PeerId = PeerId(1);
const L: PeerId = PeerId(2);

fn key(b: u8) -> Option<ClusterKey> {
    ClusterKey::new(&[b; 32])
}

fn tcp(node: PeerId, proposed: u64) -> HelloFields {
    HelloFields {
        node,
        incarnation: 0xfeed_0000 + node.0,
        proposed: Epoch(proposed),
        endpoint: Endpoint::Tcp(TcpEndpoint { max_batch: 65536 }),
        // Differs per node, so the happy paths show it crossing intact.
        slot_window: 4096 * (node.0 as u32 + 1),
        peer_window: (1 << 20) * (node.0 as u32 + 1),
        peer_credit: (1 << 19) * (node.0 as u32 + 1),
        max_record: (1 << 18) * (node.0 as u32 + 1),
        max_slots: 65_536,
    }
}

fn rdma() -> RdmaEndpoint {
    RdmaEndpoint {
        qpn: 0x1234,
        psn: 0xabcdef,
        gid: [7; 16],
        gid_index: 3,
        mtu: 4096,
        recv_depth: 256,
        recv_buf_size: 65536,
        lanes: 4,
        udp_port: 4791,
    }
}

fn pair(dk: Option<ClusterKey>, lk: Option<ClusterKey>, d: HelloFields) -> (Handshake, Handshake) {
    let dialer = Handshake::dialer(dk, d, Some(L), [1; 32]);
    let listener = Handshake::listener(lk, L, d.endpoint.kind(), [2; 32]);
    (dialer, listener)
}

/// Moves bytes both ways until both sides are quiet; the listener answers
/// with `local`. Returns the first error per side.
fn drive(
    dialer: &mut Handshake,
    listener: &mut Handshake,
    local: HelloFields,
) -> (Result<(), BootstrapError>, Result<(), BootstrapError>) {
    let (mut d_res, mut l_res) = (Ok(()), Ok(()));
    for _ in 0..8 {
        if let Some(bytes) = listener.poll_transmit() {
            if let Err(e) = feed_all(dialer, &bytes) {
                d_res = Err(e);
            }
        }
        if let Some(bytes) = dialer.poll_transmit() {
            if let Err(e) = feed_all(listener, &bytes) {
                l_res = Err(e);
            }
        }
        if let State::AwaitLocal { .. } = listener.state {
            listener.respond(local).expect("respond in AwaitLocal");
        }
    }
    (d_res, l_res)
}

/// Feeds one byte at a time, so every split point of every message is exercised.
fn feed_all(hs: &mut Handshake, bytes: &[u8]) -> Result<(), BootstrapError> {
    for b in bytes {
        hs.handle_input(std::slice::from_ref(b))?;
    }
    Ok(())
}

fn established(hs: &mut Handshake) -> Option<Established> {
    let mut found = None;
    while let Some(ev) = hs.poll_event() {
        if let Event::Established(e) = ev {
            found = Some(e);
        }
    }
    found
}

fn happy(k: Option<ClusterKey>) {
    let (mut d, mut l) = pair(k.clone(), k, tcp(D, 7));
    let (dr, lr) = drive(&mut d, &mut l, tcp(L, 3));
    assert_eq!((dr, lr), (Ok(()), Ok(())));
    let de = established(&mut d).expect("dialer established");
    let le = established(&mut l).expect("listener established");
    assert_eq!(de.epoch, Epoch(8), "max(7, 3) + 1");
    assert_eq!(le.epoch, Epoch(8));
    assert_eq!(de.peer, tcp(L, 3));
    assert_eq!(le.peer, tcp(D, 7));
    assert!(d.is_finished() && l.is_finished());
}

#[test]
fn happy_path_with_a_key() {
    happy(key(9));
}

#[test]
fn happy_path_without_a_key() {
    happy(None);
}

#[test]
fn rdma_endpoint_round_trips() {
    let mut d_hello = tcp(D, 0);
    d_hello.endpoint = Endpoint::Rdma(rdma());
    let mut l_hello = tcp(L, 0);
    l_hello.endpoint = Endpoint::Rdma(RdmaEndpoint { qpn: 99, ..rdma() });
    let (mut d, mut l) = pair(key(1), key(1), d_hello);
    assert_eq!(drive(&mut d, &mut l, l_hello), (Ok(()), Ok(())));
    assert_eq!(established(&mut d).map(|e| e.peer), Some(l_hello));
    assert_eq!(established(&mut l).map(|e| e.peer), Some(d_hello));
}

#[test]
fn listener_sees_the_dialer_hello_before_it_commits_anything() {
    let (mut d, mut l) = pair(key(1), key(1), tcp(D, 0));
    let challenge = l.poll_transmit().expect("listener speaks first");
    feed_all(&mut d, &challenge).expect("challenge");
    let hello = d.poll_transmit().expect("hello");
    feed_all(&mut l, &hello).expect("hello");
    assert_eq!(l.poll_event(), Some(Event::PeerHello(tcp(D, 0))));
    assert!(l.poll_transmit().is_none(), "nothing sent before respond()");
    assert!(!l.wants_input());
}

#[test]
fn wrong_key_is_refused_at_the_first_hello() {
    let (mut d, mut l) = pair(key(1), key(2), tcp(D, 0));
    let (_, lr) = drive(&mut d, &mut l, tcp(L, 0));
    assert_eq!(lr, Err(BootstrapError::BadMac));
    assert!(
        l.poll_event().is_none(),
        "no PeerHello for an unproven dialer"
    );
}

#[test]
fn a_dialer_without_proof_is_refused() {
    let (mut d, mut l) = pair(None, key(1), tcp(D, 0));
    assert_eq!(
        drive(&mut d, &mut l, tcp(L, 0)).1,
        Err(BootstrapError::MissingMac)
    );
}

#[test]
fn a_dialer_with_a_key_the_listener_lacks_is_refused() {
    let (mut d, mut l) = pair(key(1), None, tcp(D, 0));
    assert_eq!(
        drive(&mut d, &mut l, tcp(L, 0)).1,
        Err(BootstrapError::UnexpectedMac)
    );
}

#[test]
fn a_forged_listener_hello_is_refused_by_the_dialer() {
    // The listener has a different key: the dialer must not accept its hello.
    let mut d = Handshake::dialer(key(1), tcp(D, 0), Some(L), [1; 32]);
    let mut l = Handshake::listener(key(1), L, EndpointKind::Tcp, [2; 32]);
    feed_all(&mut d, &l.poll_transmit().expect("challenge")).expect("challenge");
    feed_all(&mut l, &d.poll_transmit().expect("hello")).expect("hello");
    l.key = key(5);
    l.respond(tcp(L, 0)).expect("respond");
    let reply = l.poll_transmit().expect("hello");
    assert_eq!(feed_all(&mut d, &reply), Err(BootstrapError::BadMac));
    assert_eq!(d.handle_input(&[0]), Err(BootstrapError::AlreadyFailed));
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// The dialer's (unsigned, keyless) hello to a listener whose nonce is [2; 32].
fn dialer_hello_body(fields: &HelloFields) -> Vec<u8> {
    wire::with_mac(wire::hello_signed(fields, &[2; 32], &[1; 32]), None)
}

fn listener_after_challenge() -> Handshake {
    let mut l = Handshake::listener(None, L, EndpointKind::Tcp, [2; 32]);
    assert!(l.poll_transmit().is_some());
    l
}

fn listener_error(bytes: &[u8]) -> BootstrapError {
    let mut l = listener_after_challenge();
    match l.handle_input(bytes) {
        Err(e) => e,
        Ok(_) => l.handle_eof(),
    }
}

#[test]
fn bad_version_is_named() {
    let mut body = dialer_hello_body(&tcp(D, 0));
    body[5..7].copy_from_slice(&1u16.to_be_bytes());
    assert_eq!(
        listener_error(&framed(&body)),
        BootstrapError::BadVersion { got: 1 }
    );
    let mut d = Handshake::dialer(None, tcp(D, 0), Some(L), [1; 32]);
    let mut challenge = wire::challenge(&[2; 32]);
    challenge[5..7].copy_from_slice(&9u16.to_be_bytes());
    assert_eq!(
        d.handle_input(&framed(&challenge)),
        Err(BootstrapError::BadVersion { got: 9 })
    );
}

#[test]
fn a_peer_credit_past_the_peer_window_is_named() {
    let mut fields = tcp(D, 0);
    fields.peer_credit = fields.peer_window + 1;
    assert_eq!(
        listener_error(&framed(&dialer_hello_body(&fields))),
        BootstrapError::BadField("peer credit")
    );
    // Zero is a valid start: the peer waits for the first grant.
    let mut fields = tcp(D, 0);
    fields.peer_credit = 0;
    assert_eq!(
        wire::decode(&dialer_hello_body(&fields)).map(|m| match m {
            Message::Hello(hello) => hello.fields.peer_credit,
            _ => u32::MAX,
        }),
        Ok(0)
    );
}

#[test]
fn zero_windows_and_a_peer_window_that_holds_no_record_are_named() {
    let mut fields = tcp(D, 0);
    fields.slot_window = 0;
    assert_eq!(
        listener_error(&framed(&dialer_hello_body(&fields))),
        BootstrapError::BadField("slot window")
    );

    for window in [0, crate::mux::RECORD_OVERHEAD as u32] {
        let mut fields = tcp(D, 0);
        fields.peer_window = window;
        fields.peer_credit = 0;
        assert_eq!(
            listener_error(&framed(&dialer_hello_body(&fields))),
            BootstrapError::BadField("peer window"),
            "{window}"
        );
    }
}

#[test]
fn oversized_and_empty_messages_are_refused_before_buffering() {
    assert_eq!(
        listener_error(&4097u32.to_be_bytes()),
        BootstrapError::Oversized {
            len: 4097,
            max: MAX_MESSAGE
        }
    );
    assert_eq!(
        listener_error(b"GET / HTTP/1.1\r\n\r\n"),
        BootstrapError::Oversized {
            len: u32::from_be_bytes(*b"GET "),
            max: MAX_MESSAGE
        }
    );
    assert_eq!(
        listener_error(&0u32.to_be_bytes()),
        BootstrapError::Truncated
    );
}

#[test]
fn truncated_fields_and_streams_are_named() {
    let body = dialer_hello_body(&tcp(D, 0));
    assert_eq!(
        listener_error(&framed(&body[..body.len() - 3])),
        BootstrapError::Truncated
    );
    let whole = framed(&body);
    assert_eq!(
        listener_error(&whole[..whole.len() - 1]),
        BootstrapError::Truncated,
        "EOF mid-message"
    );
    assert_eq!(listener_error(&[]), BootstrapError::Closed);
}

#[test]
fn garbage_is_named() {
    assert_eq!(
        listener_error(&framed(&[0x77, 1, 2])),
        BootstrapError::UnknownMessage(0x77)
    );
    let mut body = dialer_hello_body(&tcp(D, 0));
    body[1] = b'X';
    assert_eq!(listener_error(&framed(&body)), BootstrapError::BadMagic);
    let mut body = dialer_hello_body(&tcp(D, 0));
    body.push(0);
    assert_eq!(
        listener_error(&framed(&body)),
        BootstrapError::TrailingBytes
    );
    let mut body = dialer_hello_body(&tcp(D, 0));
    let last = body.len() - 1;
    body[last] = 5; // MAC length 5
    assert_eq!(
        listener_error(&framed(&body)),
        BootstrapError::BadField("mac length")
    );
}

#[test]
fn invalid_endpoint_fields_are_named() {
    let cases: [(Endpoint, &str); 6] = [
        (Endpoint::Tcp(TcpEndpoint { max_batch: 1 }), "tcp max_batch"),
        (
            Endpoint::Rdma(RdmaEndpoint { qpn: 1, ..rdma() }),
            "rdma qpn",
        ),
        (
            Endpoint::Rdma(RdmaEndpoint {
                psn: 1 << 24,
                ..rdma()
            }),
            "rdma psn",
        ),
        (
            Endpoint::Rdma(RdmaEndpoint {
                mtu: 1000,
                ..rdma()
            }),
            "rdma mtu",
        ),
        (
            Endpoint::Rdma(RdmaEndpoint {
                recv_depth: 0,
                ..rdma()
            }),
            "rdma recv_depth",
        ),
        (
            Endpoint::Rdma(RdmaEndpoint { lanes: 0, ..rdma() }),
            "rdma lanes",
        ),
    ];
    for (endpoint, field) in cases {
        let mut fields = tcp(D, 0);
        fields.endpoint = endpoint;
        let mut l = Handshake::listener(None, L, endpoint.kind(), [2; 32]);
        assert!(l.poll_transmit().is_some());
        assert_eq!(
            l.handle_input(&framed(&dialer_hello_body(&fields))),
            Err(BootstrapError::BadField(field))
        );
    }
}

#[test]
fn a_replayed_hello_echoing_a_stale_nonce_is_refused() {
    for k in [None, key(4)] {
        // Record a complete, valid exchange...
        let (mut d, mut l) = pair(k.clone(), k.clone(), tcp(D, 0));
        let challenge = l.poll_transmit().expect("challenge");
        feed_all(&mut d, &challenge).expect("challenge");
        let recorded = d.poll_transmit().expect("hello");
        // ...and replay the dialer's hello to a listener with a fresh nonce.
        let mut fresh = Handshake::listener(k, L, EndpointKind::Tcp, [3; 32]);
        assert!(fresh.poll_transmit().is_some());
        assert_eq!(
            fresh.handle_input(&recorded),
            Err(BootstrapError::StaleNonce)
        );
    }
}

#[test]
fn a_reflected_nonce_is_refused() {
    let body = wire::with_mac(wire::hello_signed(&tcp(D, 0), &[2; 32], &[2; 32]), None);
    assert_eq!(
        listener_error(&framed(&body)),
        BootstrapError::ReflectedNonce
    );
}

#[test]
fn unexpected_messages_are_named() {
    assert_eq!(
        listener_error(&framed(&wire::with_mac(wire::ready_signed(Epoch(1)), None))),
        BootstrapError::Unexpected {
            expected: MessageKind::Hello,
            got: MessageKind::Ready
        }
    );
    let mut d = Handshake::dialer(None, tcp(D, 0), Some(L), [1; 32]);
    assert_eq!(
        d.handle_input(&framed(&dialer_hello_body(&tcp(L, 0)))),
        Err(BootstrapError::Unexpected {
            expected: MessageKind::Challenge,
            got: MessageKind::Hello
        })
    );
}

#[test]
fn identity_checks() {
    // The listener refuses a dialer claiming the listener's own id.
    assert_eq!(
        listener_error(&framed(&dialer_hello_body(&tcp(L, 0)))),
        BootstrapError::SelfConnect
    );
    // The dialer refuses a listener that is not the node it dialed.
    let mut d = Handshake::dialer(None, tcp(D, 0), Some(L), [1; 32]);
    let mut l = Handshake::listener(None, PeerId(77), EndpointKind::Tcp, [2; 32]);
    assert_eq!(
        drive(&mut d, &mut l, tcp(PeerId(77), 0)).0,
        Err(BootstrapError::WrongPeer {
            expected: L,
            got: PeerId(77)
        })
    );
    // A TCP listener refuses an RDMA dialer, and leaves it a decline that
    // says why: keyless, as it answers anyone, and to a dialer that proved
    // the key.
    let mut fields = tcp(D, 0);
    fields.endpoint = Endpoint::Rdma(rdma());
    let wrong_transport = BootstrapError::WrongTransport {
        expected: EndpointKind::Tcp,
        got: EndpointKind::Rdma,
    };
    let mut l = listener_after_challenge();
    assert_eq!(
        l.handle_input(&framed(&dialer_hello_body(&fields))),
        Err(wrong_transport)
    );
    let decline = framed(&wire::decline(DeclineReason::WrongTransport));
    assert_eq!(l.poll_transmit(), Some(decline.clone()));
    let mut d = Handshake::dialer(key(1), fields, Some(L), [1; 32]);
    let mut l = Handshake::listener(key(1), L, EndpointKind::Tcp, [2; 32]);
    feed_all(&mut d, &l.poll_transmit().expect("challenge")).expect("challenge");
    assert_eq!(
        feed_all(&mut l, &d.poll_transmit().expect("hello")),
        Err(wrong_transport)
    );
    assert_eq!(l.poll_transmit(), Some(decline.clone()));
    feed_all(&mut d, &decline).expect("a decline");
    assert_eq!(
        d.poll_event(),
        Some(Event::Declined(DeclineReason::WrongTransport))
    );
    // A dialer that proves nothing under a key is told nothing.
    let mut d = Handshake::dialer(key(1), fields, Some(L), [1; 32]);
    let mut l = Handshake::listener(key(2), L, EndpointKind::Tcp, [2; 32]);
    feed_all(&mut d, &l.poll_transmit().expect("challenge")).expect("challenge");
    assert_eq!(
        feed_all(&mut l, &d.poll_transmit().expect("hello")),
        Err(BootstrapError::BadMac)
    );
    assert_eq!(l.poll_transmit(), None);
}

/// What was queued when input failed stays unsent: a dialer whose
/// challenge came with garbage does not send its hello.
#[test]
fn a_failure_leaves_nothing_to_send() {
    let mut d = Handshake::dialer(None, tcp(D, 0), Some(L), [1; 32]);
    let mut l = Handshake::listener(None, L, EndpointKind::Tcp, [2; 32]);
    let mut input = l.poll_transmit().expect("challenge");
    input.extend_from_slice(&framed(&[0xee; 8]));
    assert!(d.handle_input(&input).is_err());
    assert_eq!(d.poll_transmit(), None);
}

#[test]
fn every_decline_reason_round_trips_and_an_unknown_one_is_named() {
    for reason in [
        DeclineReason::CrossedDial,
        DeclineReason::StaleDial,
        DeclineReason::Unavailable,
        DeclineReason::WrongTransport,
        DeclineReason::Incompatible,
    ] {
        let (mut d, mut l) = pair(None, None, tcp(D, 0));
        feed_all(&mut d, &l.poll_transmit().expect("challenge")).expect("challenge");
        feed_all(&mut l, &d.poll_transmit().expect("hello")).expect("hello");
        l.decline(reason).expect("decline");
        feed_all(&mut d, &l.poll_transmit().expect("decline")).expect("decline");
        assert_eq!(d.poll_event(), Some(Event::Declined(reason)));
    }
    let (mut d, mut l) = pair(None, None, tcp(D, 0));
    feed_all(&mut d, &l.poll_transmit().expect("challenge")).expect("challenge");
    let mut decline = wire::decline(DeclineReason::Unavailable);
    *decline.last_mut().expect("a reason byte") = 6;
    assert_eq!(
        feed_all(&mut d, &framed(&decline)),
        Err(BootstrapError::BadField("decline reason"))
    );
}

#[test]
fn a_ready_for_another_epoch_is_refused() {
    let mut l = listener_after_challenge();
    feed_all(&mut l, &framed(&dialer_hello_body(&tcp(D, 4)))).expect("hello");
    l.respond(tcp(L, 1)).expect("respond");
    let ready = wire::with_mac(wire::ready_signed(Epoch(3)), None);
    assert_eq!(
        l.handle_input(&framed(&ready)),
        Err(BootstrapError::EpochMismatch {
            ours: Epoch(5),
            theirs: Epoch(3)
        })
    );
}

#[test]
fn a_declined_dial_ends_quietly() {
    let (mut d, mut l) = pair(key(1), key(1), tcp(D, 0));
    feed_all(&mut d, &l.poll_transmit().expect("challenge")).expect("challenge");
    feed_all(&mut l, &d.poll_transmit().expect("hello")).expect("hello");
    assert_eq!(l.decline(DeclineReason::CrossedDial), Ok(()));
    feed_all(&mut d, &l.poll_transmit().expect("decline")).expect("decline");
    assert_eq!(
        d.poll_event(),
        Some(Event::Declined(DeclineReason::CrossedDial))
    );
    assert!(d.is_finished() && l.is_finished());
    assert_eq!(
        l.respond(tcp(L, 0)),
        Err(BootstrapError::OutOfOrder),
        "no respond after a decline"
    );
}

#[test]
fn bytes_after_the_handshake_stay_with_the_caller() {
    let (mut d, mut l) = pair(None, None, tcp(D, 0));
    feed_all(&mut d, &l.poll_transmit().expect("challenge")).expect("challenge");
    feed_all(&mut l, &d.poll_transmit().expect("hello")).expect("hello");
    l.respond(tcp(L, 0)).expect("respond");
    feed_all(&mut d, &l.poll_transmit().expect("hello")).expect("hello");
    let mut ready = d.poll_transmit().expect("ready");
    let ready_len = ready.len();
    ready.extend_from_slice(b"link data");
    assert_eq!(l.handle_input(&ready), Ok(ready_len));
    assert!(established(&mut l).is_some());
}

fn listener_at_ready() -> Handshake {
    let mut l = listener_after_challenge();
    feed_all(&mut l, &framed(&dialer_hello_body(&tcp(D, 0)))).expect("hello");
    l.respond(tcp(L, 0)).expect("respond");
    l
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic_either_side(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
        split in 0usize..600,
        with_key in any::<bool>(),
    ) {
        let k = if with_key { key(1) } else { None };
        let split = split.min(bytes.len());
        let mut machines = vec![
            Handshake::listener(k.clone(), L, EndpointKind::Tcp, [2; 32]),
            Handshake::dialer(k, tcp(D, 0), Some(L), [1; 32]),
            listener_at_ready(),
        ];
        for hs in &mut machines {
            hs.poll_transmit();
            let first = hs.handle_input(&bytes[..split]);
            if first.is_ok() {
                let rest = hs.handle_input(&bytes[split..]);
                if rest.is_ok() {
                    hs.handle_eof();
                }
            }
            while hs.poll_event().is_some() {}
        }
    }

    #[test]
    fn arbitrary_bodies_in_valid_frames_never_panic(
        kind in 0u8..6,
        tail in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut body = vec![kind];
        body.extend_from_slice(&tail);
        let mut l = listener_after_challenge();
        prop_assert!(l.handle_input(&framed(&body)).is_err() || l.poll_event().is_some() || !l.is_finished());
        let mut d = Handshake::dialer(None, tcp(D, 0), Some(L), [1; 32]);
        let handled = d.handle_input(&framed(&body));
        prop_assert!(handled.is_err() || handled == Ok(body.len() + 4));
    }
}

#[test]
fn the_agreed_epoch_is_above_both_proposals_and_never_wraps() {
    assert_eq!(agreed_epoch(Epoch(3), Epoch(7)), Ok(Epoch(8)));
    assert_eq!(agreed_epoch(Epoch(7), Epoch(3)), Ok(Epoch(8)));
    assert_eq!(
        agreed_epoch(Epoch(u64::MAX - 1), Epoch(0)),
        Ok(Epoch(u64::MAX))
    );
    assert_eq!(
        agreed_epoch(Epoch(0), Epoch(u64::MAX)),
        Err(BootstrapError::EpochsExhausted(Epoch(u64::MAX)))
    );
}

/// Our own proposal at the top (a peer once agreed the top epoch with us):
/// the listener's answer fails by name instead of agreeing a wrapped epoch 0.
#[test]
fn a_listener_at_the_top_epoch_fails_instead_of_wrapping() {
    let (mut dialer, mut listener) = pair(None, None, tcp(D, 0));
    feed_all(&mut dialer, &listener.poll_transmit().expect("challenge")).expect("challenge");
    feed_all(&mut listener, &dialer.poll_transmit().expect("hello")).expect("hello");
    assert!(matches!(listener.poll_event(), Some(Event::PeerHello(_))));
    assert_eq!(
        listener.respond(tcp(L, u64::MAX)),
        Err(BootstrapError::EpochsExhausted(Epoch(u64::MAX)))
    );
}
