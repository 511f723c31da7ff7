//! The connector's redial rule (docs/design.md § "Redial backoff"), driven
//! the same way on every transport: node A's links are killed right after
//! their handshake, before any batch, while a slot of A's waits with its
//! Open held back by a manual flush.
//!
//! ```text
//!  A: open(B) ─ Open held ─► link up ─ kill ─► backoff doubles ─► link up ─ kill … ─► flush ─► B: in order
//! ```

#![allow(dead_code)] // each test binary uses its own subset

use std::time::Duration;

use qpmux::link::tcp::{Connector, EpochMaker};
use qpmux::link::{EpochEnd, Link, LinkFault};
use qpmux::mux::{FlushPolicy, Mux, MuxConfig, MuxTransport, PeerId, StreamKey, Terminal};

use super::slots::{in_order_to_finalized, record};

/// A mux that writes nothing until `flush`: its slots' Opens wait.
pub fn held_back() -> MuxConfig {
    MuxConfig {
        flush: FlushPolicy::Manual {
            reply_linger: Duration::from_secs(3600),
        },
        ..MuxConfig::default()
    }
}

/// Waits for `cond`, failing after `bound` with `what`.
pub async fn within(bound: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    tokio::time::timeout(bound, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not within {bound:?}: {what}"));
}

/// A's side of the scenario: its connector and its mux (built with
/// [`held_back`]), and the backoff bounds and handshake timeout it was
/// configured with.
pub struct Dialing<'a, E: EpochMaker> {
    pub node: &'a Connector<E>,
    pub mux: &'a Mux<E::Link>,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    pub handshake_timeout: Duration,
}

impl<E: EpochMaker> Dialing<'_, E> {
    /// One wait (up to half of it more as jitter) plus one attempt: the
    /// longest a relink may take.
    fn relink_bound(&self) -> Duration {
        self.backoff_max * 3 / 2 + self.handshake_timeout
    }

    async fn live_link(&self, peer: PeerId, what: &str) -> E::Link {
        let mut live = None;
        within(self.relink_bound(), what, || {
            live = self
                .node
                .link(peer)
                .filter(|link| E::end_reason(link).is_none());
            live.is_some()
        })
        .await;
        live.expect("checked")
    }
}

/// Kills `rounds` of A's links to B before any batch: each relink comes
/// within 1.5 × `backoff_max` (the wait's jitter) + `handshake_timeout`, the backoff doubles per epoch
/// from `backoff_min` to `backoff_max`, and A's slot, carried through every
/// dead epoch, arrives whole once flushed. Then an epoch that carried
/// traffic dies, and the backoff starts over at zero.
pub async fn traffic_less_epochs_back_off_and_the_held_slot_survives<E: EpochMaker>(
    a: Dialing<'_, E>,
    b_id: PeerId,
    b: &Mux<E::Link>,
    rounds: u32,
) {
    let open = |session: u64| {
        let key = StreamKey::new(31, session);
        (
            b.bind(key).expect("bind"),
            a.mux.open(b_id, key).expect("open"),
        )
    };
    let (mut rx, mut tx) = open(1);
    for n in 0..3 {
        tx.send(record(1, n, 100)).await.expect("send");
    }
    tx.finish(Terminal::Finalized).expect("finish");

    let mut expected = Duration::ZERO;
    for round in 0..rounds {
        let link = a.live_link(b_id, "A relinks for its held slot").await;
        assert!(
            !E::carried_traffic(&link),
            "round {round}: nothing was written"
        );
        link.fail(EpochEnd::Fault(LinkFault::Injected));
        expected = (expected * 2).clamp(a.backoff_min, a.backoff_max);
        within(
            a.relink_bound(),
            "the dead epoch counted as a failure",
            || a.node.backoff(b_id) == expected,
        )
        .await;
    }
    assert_eq!(expected, a.backoff_max, "enough rounds to reach the bound");

    a.live_link(b_id, "a link after the last kill").await;
    a.mux.flush(b_id).expect("flush");
    let got = tokio::time::timeout(a.relink_bound(), in_order_to_finalized(&mut rx))
        .await
        .expect("the carried slot arrives");
    assert_eq!(got.0, 3);
    let stats = a.mux.stats();
    assert_eq!(stats.slots_dropped, 0, "its Open never left a dying epoch");
    assert!(stats.slots_carried >= u64::from(rounds), "{stats:?}");

    // A second slot, held back, so that A wants a link after this death too.
    let (mut rx, tx) = open(2);
    tx.finish(Terminal::Finalized).expect("finish");
    let link = a.live_link(b_id, "the epoch that carried the slot").await;
    // The writer counts a batch once its write returned, maybe after B read it.
    within(a.relink_bound(), "the link counted its batch", || {
        E::carried_traffic(&link)
    })
    .await;
    link.fail(EpochEnd::Fault(LinkFault::Injected));
    within(a.relink_bound(), "traffic resets the backoff", || {
        a.node.backoff(b_id) == Duration::ZERO
    })
    .await;
    a.live_link(b_id, "a redial without a wait").await;
    a.mux.flush(b_id).expect("flush");
    let got = tokio::time::timeout(a.relink_bound(), in_order_to_finalized(&mut rx))
        .await
        .expect("the second slot arrives");
    assert_eq!(got.0, 0);
}
