use proptest::prelude::*;

use super::*;

/// An owned record, for building batches in tests.
#[derive(Clone, Debug, PartialEq)]
enum Owned {
    Data(SlotId, FrameSeq, Vec<u8>, bool),
    Message(FrameSeq, Vec<u8>, bool),
    Open(SlotId, FrameSeq, u64, u64),
    Close(SlotId, FrameSeq, CloseReason),
    Credit(SlotId, u32),
    PeerCredit(u32),
    Heartbeat(SlotId, FrameSeq),
    Goodbye,
    Ping(u64),
    Pong(u64),
}

impl Owned {
    fn push(&self, enc: &mut BatchEncoder<'_>) -> Result<(), EncodeError> {
        match self {
            Owned::Data(s, q, b, m) => enc.push_data(*s, *q, b, *m),
            Owned::Message(q, b, m) => enc.push_message(*q, b, *m),
            Owned::Open(s, q, a, x) => enc.push_open(*s, *q, *a, *x),
            Owned::Close(s, q, r) => enc.push_close(*s, *q, *r),
            Owned::Credit(s, c) => enc.push_credit(*s, *c),
            Owned::PeerCredit(c) => enc.push_peer_credit(*c),
            Owned::Heartbeat(s, q) => enc.push_heartbeat(*s, *q),
            Owned::Goodbye => enc.push_goodbye(),
            Owned::Ping(n) => enc.push_ping(*n),
            Owned::Pong(n) => enc.push_pong(*n),
        }
    }

    fn from_record(r: &Record<'_>) -> Owned {
        match r.body {
            RecordBody::Data(b) => Owned::Data(r.slot, r.seq, b.to_vec(), r.more),
            RecordBody::Message(b) => Owned::Message(r.seq, b.to_vec(), r.more),
            RecordBody::Open { anchor, session } => Owned::Open(r.slot, r.seq, anchor, session),
            RecordBody::Close(reason) => Owned::Close(r.slot, r.seq, reason),
            RecordBody::Credit(c) => Owned::Credit(r.slot, c),
            RecordBody::PeerCredit(c) => Owned::PeerCredit(c),
            RecordBody::Heartbeat => Owned::Heartbeat(r.slot, r.seq),
            RecordBody::Goodbye => Owned::Goodbye,
            RecordBody::Ping(n) => Owned::Ping(n),
            RecordBody::Pong(n) => Owned::Pong(n),
        }
    }
}

fn slot_strategy() -> impl Strategy<Value = SlotId> {
    (0..=SlotId::MAX_INDEX, any::<u8>()).prop_map(|(i, g)| SlotId::new(i, g).expect("in range"))
}

fn reason_strategy() -> impl Strategy<Value = CloseReason> {
    (0u8..7).prop_map(|r| CloseReason::from_wire(r).expect("known reason"))
}

fn owned_strategy() -> impl Strategy<Value = Owned> {
    let seq = any::<u32>().prop_map(FrameSeq);
    let body = proptest::collection::vec(any::<u8>(), 0..300);
    prop_oneof![
        (slot_strategy(), seq.clone(), body.clone(), any::<bool>())
            .prop_map(|(s, q, b, m)| Owned::Data(s, q, b, m)),
        (seq.clone(), body, any::<bool>()).prop_map(|(q, b, m)| Owned::Message(q, b, m)),
        (slot_strategy(), seq.clone(), any::<u64>(), any::<u64>())
            .prop_map(|(s, q, a, x)| Owned::Open(s, q, a, x)),
        (slot_strategy(), seq.clone(), reason_strategy())
            .prop_map(|(s, q, r)| Owned::Close(s, q, r)),
        (slot_strategy(), any::<u32>()).prop_map(|(s, c)| Owned::Credit(s, c)),
        any::<u32>().prop_map(Owned::PeerCredit),
        (slot_strategy(), seq).prop_map(|(s, q)| Owned::Heartbeat(s, q)),
        Just(Owned::Goodbye),
        any::<u64>().prop_map(Owned::Ping),
        any::<u64>().prop_map(Owned::Pong),
    ]
}

fn encode(records: &[Owned], buf: &mut [u8], epoch: u64, seq: u32) -> (usize, usize) {
    let mut enc = BatchEncoder::new(buf, Epoch(epoch), seq, Lane(0)).expect("buffer fits a batch");
    let mut written = 0;
    for r in records {
        match r.push(&mut enc) {
            Ok(()) => written += 1,
            Err(EncodeError::NoRoom { .. }) => break,
            Err(e) => panic!("unexpected encode error {e}"),
        }
    }
    (enc.finish(), written)
}

fn good_batch() -> Vec<u8> {
    let mut buf = vec![0xa5; 256];
    let slot = SlotId::new(7, 3).expect("in range");
    let mut enc = BatchEncoder::new(&mut buf, Epoch(9), 4, Lane(0)).expect("fits");
    enc.push_open(slot, FrameSeq(0), 1, 2).expect("fits");
    enc.push_data(slot, FrameSeq(1), b"hello", false)
        .expect("fits");
    enc.push_close(slot, FrameSeq(2), CloseReason::Finalized)
        .expect("fits");
    let len = enc.finish();
    buf.truncate(len);
    buf
}

proptest! {
    #[test]
    fn batches_round_trip(
        records in proptest::collection::vec(owned_strategy(), 0..40),
        epoch in any::<u64>(),
        seq in any::<u32>(),
        cap in 29usize..4096,
    ) {
        // 0xa5 fill: a byte the encoder forgot to write would show up.
        let mut buf = vec![0xa5u8; cap];
        let (len, written) = encode(&records, &mut buf, epoch, seq);
        let view = BatchView::new_checked(&buf[..len]).expect("own output decodes");
        prop_assert_eq!(view.epoch(), Epoch(epoch));
        prop_assert_eq!(view.batch_seq(), seq);
        prop_assert_eq!(usize::from(view.record_count()), written);
        let decoded: Vec<Owned> = view.records().map(|r| Owned::from_record(&r)).collect();
        prop_assert_eq!(&decoded[..], &records[..written]);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(view) = BatchView::new_checked(&bytes) {
            prop_assert_eq!(view.records().count(), usize::from(view.record_count()));
        }
    }

    #[test]
    fn body_room_is_exact(cap in 29usize..2048, first in 0usize..1024) {
        let mut buf = vec![0u8; cap];
        let mut enc = BatchEncoder::new(&mut buf, Epoch(1), 0, Lane(0)).expect("fits");
        let slot = SlotId::new(1, 0).expect("in range");
        let body = vec![1u8; first.min(enc.body_room())];
        enc.push_data(slot, FrameSeq(0), &body, false).expect("fits by body_room");
        let room = enc.body_room();
        let exact = vec![2u8; room];
        // A body of exactly body_room fits when a record header fits at all.
        if room > 0 || cap - enc.len() >= RECORD_HEADER_LEN {
            prop_assert!(enc.push_data(slot, FrameSeq(1), &exact, false).is_ok());
        }
        let over = vec![3u8; enc.body_room() + 1];
        let is_no_room = matches!(
            enc.push_data(slot, FrameSeq(2), &over, false),
            Err(EncodeError::NoRoom { .. })
        );
        prop_assert!(is_no_room);
    }
}

#[test]
fn every_truncated_prefix_is_an_error() {
    let batch = good_batch();
    for cut in 0..batch.len() {
        assert!(
            BatchView::new_checked(&batch[..cut]).is_err(),
            "prefix of {cut} bytes accepted"
        );
    }
    assert!(BatchView::new_checked(&batch).is_ok());
}

#[test]
fn known_answer_bytes() {
    let batch = good_batch();
    #[rustfmt::skip]
    let expected: &[u8] = &[
        1, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 4,
        1, 0, 0, 7, 3, 0, 0, 0, 0, 0, 0, 0, 16,
        0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2,
        0, 0, 0, 7, 3, 0, 0, 0, 1, 0, 0, 0, 5, b'h', b'e', b'l', b'l', b'o',
        2, 0, 0, 7, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0,
    ];
    assert_eq!(batch, expected);
}

#[test]
fn bad_version_is_rejected() {
    let mut batch = good_batch();
    batch[0] = 2;
    assert_eq!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::BadVersion { got: 2 }
    );
}

#[test]
fn reserved_flags_and_lanes_are_rejected() {
    for flags in [0x10u8, 0x80, 0x01] {
        let mut batch = good_batch();
        batch[1] = flags;
        assert_eq!(
            BatchView::new_checked(&batch).unwrap_err(),
            DecodeError::BadFlags { flags }
        );
    }
}

#[test]
fn length_past_end_is_rejected() {
    let mut batch = good_batch();
    // The Data record's length field sits at 16 + 29 + 9.
    batch[16 + 29 + 9..16 + 29 + 13].copy_from_slice(&1000u32.to_be_bytes());
    assert!(matches!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::LengthPastEnd {
            record: 1,
            len: 1000,
            ..
        }
    ));
    // A length of u32::MAX must not overflow anything.
    batch[16 + 29 + 9..16 + 29 + 13].copy_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::LengthPastEnd { record: 1, .. }
    ));
}

#[test]
fn unknown_type_and_reserved_type_bit_are_rejected() {
    for type_byte in [10u8, 0x3f, TYPE_RESERVED] {
        let mut batch = good_batch();
        batch[16] = type_byte;
        assert_eq!(
            BatchView::new_checked(&batch).unwrap_err(),
            DecodeError::UnknownType {
                record: 0,
                type_byte
            }
        );
    }
}

#[test]
fn record_count_mismatch_is_rejected() {
    let mut batch = good_batch();
    batch[3] = 2; // declares fewer records than present
    assert!(matches!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::TrailingBytes { declared: 2, .. }
    ));
    batch[3] = 4; // declares more records than present
    assert!(matches!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::ShortRecord { record: 3, have: 0 }
    ));
}

#[test]
fn fixed_bodies_must_have_their_size() {
    let mut batch = good_batch();
    // Make the Close record's body two bytes long: length 2, and a byte more.
    let close_len_at = batch.len() - 1 - 4;
    batch[close_len_at..close_len_at + 4].copy_from_slice(&2u32.to_be_bytes());
    batch.push(0);
    assert!(matches!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::BadBodyLength {
            record: 2,
            kind: RecordKind::CloseSlot,
            len: 2,
            expected: 1
        }
    ));
}

#[test]
fn unknown_close_reason_is_rejected() {
    let mut batch = good_batch();
    *batch.last_mut().expect("non-empty") = 77;
    assert_eq!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::UnknownCloseReason {
            record: 2,
            reason: 77
        }
    );
}

#[test]
fn more_bit_only_on_fragmentable_kinds() {
    let mut batch = good_batch();
    batch[16] |= TYPE_MORE; // the OpenSlot record
    assert_eq!(
        BatchView::new_checked(&batch).unwrap_err(),
        DecodeError::BadFragment {
            record: 0,
            kind: RecordKind::OpenSlot
        }
    );
}

#[test]
fn frame_seq_wraps() {
    assert_eq!(FrameSeq(u32::MAX).next(), FrameSeq(0));
    let mut buf = vec![0u8; 128];
    let slot = SlotId::new(SlotId::MAX_INDEX, 255).expect("max fits");
    let mut enc = BatchEncoder::new(&mut buf, Epoch(u64::MAX), u32::MAX, Lane(0)).expect("fits");
    enc.push_data(slot, FrameSeq(u32::MAX), b"a", false)
        .expect("fits");
    enc.push_data(slot, FrameSeq(u32::MAX).next(), b"b", false)
        .expect("fits");
    let len = enc.finish();
    let view = BatchView::new_checked(&buf[..len]).expect("decodes");
    let seqs: Vec<FrameSeq> = view.records().map(|r| r.seq).collect();
    assert_eq!(seqs, [FrameSeq(u32::MAX), FrameSeq(0)]);
    let r = view.records().next().expect("one record");
    assert_eq!(
        (r.slot.index(), r.slot.generation()),
        (SlotId::MAX_INDEX, 255)
    );
}

#[test]
fn slot_index_must_fit_24_bits() {
    assert!(SlotId::new(SlotId::MAX_INDEX + 1, 0).is_none());
}

#[test]
fn encoder_refuses_tiny_buffers_and_bad_lanes() {
    let mut small = [0u8; 28];
    assert_eq!(
        BatchEncoder::new(&mut small, Epoch(0), 0, Lane(0)).unwrap_err(),
        EncodeError::BufferTooSmall { len: 28 }
    );
    let mut buf = [0u8; 64];
    assert_eq!(
        BatchEncoder::new(&mut buf, Epoch(0), 0, Lane(1)).unwrap_err(),
        EncodeError::BadLane { lane: 1 }
    );
}

#[test]
fn empty_batch_is_valid() {
    let mut buf = [0u8; 64];
    let enc = BatchEncoder::new(&mut buf, Epoch(3), 1, Lane(0)).expect("fits");
    let len = enc.finish();
    let view = BatchView::new_checked(&buf[..len]).expect("empty batch decodes");
    assert_eq!(view.records().count(), 0);
}
