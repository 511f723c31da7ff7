//! Link credit: how many SENDs this end may still post, and how many
//! receives it owes the peer.
//!
//! ```text
//!  reserve() ─► try_reserve ─► SendBuf ─ post() ─► on_post ─► imm = reposts (31 bits) | starved
//!  poller: peer's imm ─► on_peer_imm ─► held += new returns (a claim beyond `sent` is an error)
//!  poller: receive completed ─► on_receive ─► Batch dropped, receive re-posted ─► on_reposted
//!  owed ≥ threshold, or the peer said starved ─► try_credit_only ─► zero-length SEND_WITH_IMM
//! ```
//!
//! Owner: the link's state mutex; this struct is sans-IO (no clock, no verbs).
//! Invariant: `held + reserved + unreturned == R` for our sends, where
//! `unreturned` = SENDs the peer has not yet reported re-posting (in flight,
//! held by its consumer, or owed). The last credit is spent only by a message
//! that returns credit (docs/rdma-link.md § "The last credit returns credit").

/// The 31 bits of an immediate that carry the cumulative re-post count.
pub const COUNT_MASK: u32 = 0x7fff_ffff;
/// The immediate bit that says "the sender has a batch waiting for credit".
pub const STARVED: u32 = 1 << 31;

/// The peer reported re-posting more receives than we ever sent to. A
/// count that went backwards lands here too: counted mod 2^31 it claims
/// almost 2^31 new re-posts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overclaim {
    /// The cumulative count the peer claimed (31 bits).
    pub claimed: u32,
    /// The cumulative count of SENDs we posted (31 bits).
    pub granted: u32,
}

/// One end's link credit, both directions' halves of it.
#[derive(Clone, Debug)]
pub struct Credit {
    depth: u32,
    threshold: u32,
    /// Credits free to reserve.
    held: u32,
    /// Credits inside send buffers handed out and not yet posted.
    reserved: u32,
    /// SENDs posted (mod 2^31).
    sent: u32,
    /// Peer's latest cumulative re-post count (mod 2^31).
    returned: u32,
    /// Our receives completed and not yet re-posted.
    pending: u32,
    /// Our receives re-posted (mod 2^31).
    reposted: u32,
    /// `reposted` as last carried by one of our immediates.
    reported: u32,
    /// The peer's latest immediate had the starved bit and we have not
    /// returned credit since.
    peer_starved: bool,
}

impl Credit {
    /// Smallest receive depth: the threshold (≥ 2) must stay below R.
    pub const MIN_DEPTH: u32 = 4;

    /// Credit for a link whose both ends post `depth` receives
    /// (`MIN_DEPTH..=2^31 - 1`; the link's config check enforces it).
    pub fn new(depth: u32) -> Credit {
        assert!(
            (Self::MIN_DEPTH..=COUNT_MASK).contains(&depth),
            "receive depth {depth} out of range"
        );
        Credit {
            depth,
            // ≥ 2 so a credit-only message returns more than it costs and
            // two idle ends' exchange dies out; < R so a blocked peer is
            // always answered.
            threshold: (depth / 4).max(2),
            held: depth,
            reserved: 0,
            sent: 0,
            returned: 0,
            pending: 0,
            reposted: 0,
            reported: 0,
            peer_starved: false,
        }
    }

    /// Credits free to reserve.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Credits inside unposted send buffers.
    pub fn reserved(&self) -> u32 {
        self.reserved
    }

    /// SENDs the peer has not yet reported re-posting a receive for.
    pub fn unreturned(&self) -> u32 {
        self.sent.wrapping_sub(self.returned) & COUNT_MASK
    }

    /// Receives we re-posted and have not yet reported.
    pub fn owed(&self) -> u32 {
        self.reposted.wrapping_sub(self.reported) & COUNT_MASK
    }

    /// Our receives completed and not yet re-posted.
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// Owed count at which a credit-only message goes out unprompted (R/4).
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// `held + reserved + unreturned == R`.
    pub fn invariant_holds(&self) -> bool {
        self.held + self.reserved + self.unreturned() == self.depth
    }

    fn can_spend(&self, returns_credit: bool) -> bool {
        self.held >= 2 || (self.held == 1 && self.reserved == 0 && returns_credit)
    }

    /// Whether [`Credit::try_reserve`] would take a credit now.
    pub fn can_reserve(&self) -> bool {
        self.can_spend(self.owed() > 0)
    }

    /// Takes a credit into a send buffer; false when none may be spent now.
    ///
    /// The last credit goes only to a buffer whose post will return credit:
    /// nothing else can post before it (no credit is left), so `owed` only
    /// grows until then.
    pub fn try_reserve(&mut self) -> bool {
        if self.can_reserve() {
            self.held -= 1;
            self.reserved += 1;
            true
        } else {
            false
        }
    }

    /// A send buffer was dropped unposted: its credit is free again.
    pub fn unreserve(&mut self) {
        self.reserved -= 1;
        self.held += 1;
    }

    /// A reserved buffer is being posted; returns its immediate. `starved`:
    /// a `reserve` is waiting for credit right now.
    pub fn on_post(&mut self, starved: bool) -> u32 {
        self.reserved -= 1;
        self.spend(starved)
    }

    fn spend(&mut self, starved: bool) -> u32 {
        self.sent = self.sent.wrapping_add(1) & COUNT_MASK;
        if self.owed() > 0 {
            self.peer_starved = false;
        }
        self.reported = self.reposted;
        self.reposted | if starved { STARVED } else { 0 }
    }

    /// True when a credit-only message should go out now.
    pub fn wants_credit_only(&self) -> bool {
        let owed = self.owed();
        owed > 0 && (owed >= self.threshold || self.peer_starved) && self.can_spend(true)
    }

    /// Spends a credit on a credit-only message when one is due; returns its
    /// immediate (`starved` as for [`Credit::on_post`]).
    pub fn try_credit_only(&mut self, starved: bool) -> Option<u32> {
        if self.wants_credit_only() {
            self.held -= 1;
            Some(self.spend(starved))
        } else {
            None
        }
    }

    /// Spends a credit on an empty, signaled SEND behind a live link's old
    /// unsignaled tail, never the last one: that goes only to a post that
    /// returns credit, and a fence on it could leave both ends with none
    /// (review 43e). `None` when fewer than two are held. `starved` as for
    /// [`Credit::on_post`].
    pub fn try_tail_fence(&mut self, starved: bool) -> Option<u32> {
        if !self.can_spend(false) {
            return None;
        }
        self.held -= 1;
        Some(self.spend(starved))
    }

    /// Spends a credit on the empty, signaled SEND that retires an ended
    /// link's unsignaled tail: nothing of ours follows it, so the last
    /// credit may go too. Returns its immediate, or `None` with no credit.
    pub fn try_fence(&mut self) -> Option<u32> {
        if self.held == 0 {
            return None;
        }
        self.held -= 1;
        Some(self.spend(false))
    }

    /// The immediate of a message from the peer: its cumulative re-post count
    /// and starved bit. A claim beyond what we sent is an error and changes nothing.
    pub fn on_peer_imm(&mut self, imm: u32) -> Result<(), Overclaim> {
        let claimed = imm & COUNT_MASK;
        let new = claimed.wrapping_sub(self.returned) & COUNT_MASK;
        if new > self.unreturned() {
            return Err(Overclaim {
                claimed,
                granted: self.sent,
            });
        }
        self.returned = claimed;
        self.held += new;
        self.peer_starved = imm & STARVED != 0;
        Ok(())
    }

    /// One of our receives completed (a message from the peer took it).
    pub fn on_receive(&mut self) {
        self.pending += 1;
    }

    /// One completed receive was re-posted.
    pub fn on_reposted(&mut self) {
        self.pending -= 1;
        self.reposted = self.reposted.wrapping_add(1) & COUNT_MASK;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn last_credit_needs_owed() {
        let mut c = Credit::new(4);
        for _ in 0..3 {
            assert!(c.try_reserve());
            c.on_post(false);
        }
        assert!(!c.try_reserve(), "the last credit waits for something owed");
        c.on_receive();
        c.on_reposted();
        assert!(c.try_reserve(), "owed > 0: the last credit may go");
        assert_eq!(c.on_post(true), 1 | STARVED);
        assert_eq!(c.owed(), 0);
        assert!(c.invariant_holds());
    }

    #[test]
    fn a_tail_fence_never_takes_the_last_credit() {
        let mut c = Credit::new(4);
        for _ in 0..2 {
            assert!(c.try_reserve());
            c.on_post(false);
        }
        assert_eq!(c.try_tail_fence(false), Some(0), "two held: one may go");
        assert_eq!(c.held(), 1);
        c.on_receive();
        c.on_reposted();
        assert_eq!(c.try_tail_fence(true), None, "not the last, even with owed");
        assert!(
            c.try_reserve(),
            "which stays for a post that returns credit"
        );
        assert!(c.invariant_holds());
    }

    #[test]
    fn overclaim_is_refused_and_changes_nothing() {
        let mut c = Credit::new(8);
        assert!(c.try_reserve());
        c.on_post(false);
        assert_eq!(
            c.on_peer_imm(2),
            Err(Overclaim {
                claimed: 2,
                granted: 1
            })
        );
        assert_eq!(c.held(), 7);
        assert_eq!(c.on_peer_imm(1), Ok(()));
        assert_eq!(c.held(), 8);
        assert_eq!(
            c.on_peer_imm(1),
            Ok(()),
            "cumulative: a repeat is idempotent"
        );
        assert_eq!(c.held(), 8);
    }

    #[test]
    fn counts_wrap_at_31_bits() {
        let mut c = Credit::new(4);
        c.sent = COUNT_MASK;
        c.returned = COUNT_MASK;
        assert!(c.try_reserve());
        c.on_post(false);
        assert_eq!(c.unreturned(), 1);
        assert_eq!(c.on_peer_imm(0), Ok(()));
        assert_eq!(c.held(), 4);
    }

    #[test]
    fn credit_only_waits_for_threshold_or_starved_peer() {
        let mut c = Credit::new(16);
        for _ in 0..3 {
            c.on_receive();
            c.on_reposted();
        }
        assert!(c.try_credit_only(false).is_none(), "3 < 16 / 4");
        c.on_receive();
        c.on_reposted();
        assert_eq!(c.try_credit_only(false), Some(4));
        c.on_receive();
        c.on_reposted();
        assert!(c.try_credit_only(false).is_none());
        c.on_peer_imm(STARVED).expect("no claim");
        assert_eq!(c.try_credit_only(false).map(|i| i & COUNT_MASK), Some(5));
        c.on_receive();
        c.on_reposted();
        assert!(
            c.try_credit_only(false).is_none(),
            "starved is answered once"
        );
    }

    #[test]
    fn holding_r_minus_threshold_batches_stalls_the_sender() {
        // The bound the proptest below shows is tight: R = 4, threshold 2.
        let (mut a, mut b) = (Credit::new(4), Credit::new(4));
        for _ in 0..3 {
            assert!(a.try_reserve());
            let imm = a.on_post(false);
            b.on_peer_imm(imm).expect("no claim");
            b.on_receive();
        }
        b.on_reposted(); // the consumer keeps 2 = R - threshold batches
        assert_eq!(b.try_credit_only(false), None, "1 owed < threshold");
        assert!(
            !a.try_reserve(),
            "a waits until the consumer drops one more"
        );
        b.on_reposted();
        let imm = b.try_credit_only(false).expect("2 owed");
        a.on_peer_imm(imm).expect("no claim");
        assert!(a.try_reserve());
    }

    #[derive(Debug, Clone, Copy)]
    struct Msg {
        data: bool,
        imm: u32,
    }

    struct End {
        credit: Credit,
        bufs: u32,
        batches: u32,
        waiting: bool,
    }

    struct Model {
        depth: u32,
        ends: [End; 2],
        /// Messages on their way to end `i`.
        net: [VecDeque<Msg>; 2],
        credit_only_sent: u32,
    }

    impl Model {
        fn new(depth: u32) -> Model {
            let end = || End {
                credit: Credit::new(depth),
                bufs: 0,
                batches: 0,
                waiting: false,
            };
            Model {
                depth,
                ends: [end(), end()],
                net: [VecDeque::new(), VecDeque::new()],
                credit_only_sent: 0,
            }
        }

        /// What the link does after every state change.
        fn credit_only(&mut self) {
            for s in 0..2 {
                let waiting = self.ends[s].waiting;
                if let Some(imm) = self.ends[s].credit.try_credit_only(waiting) {
                    self.net[1 - s].push_back(Msg { data: false, imm });
                    self.credit_only_sent += 1;
                }
            }
        }

        /// Applies one action; returns whether anything changed.
        fn act(&mut self, action: u8, s: usize) -> bool {
            let p = 1 - s;
            let changed = match action % 7 {
                0 => {
                    let ok = self.ends[s].credit.try_reserve();
                    self.ends[s].bufs += u32::from(ok);
                    self.ends[s].waiting = !ok;
                    ok
                }
                1 if self.ends[s].bufs > 0 => {
                    self.ends[s].bufs -= 1;
                    let waiting = self.ends[s].waiting;
                    let imm = self.ends[s].credit.on_post(waiting);
                    self.net[p].push_back(Msg { data: true, imm });
                    true
                }
                2 if self.ends[s].bufs > 0 => {
                    self.ends[s].bufs -= 1;
                    self.ends[s].credit.unreserve();
                    true
                }
                3 => match self.net[s].pop_front() {
                    Some(msg) => {
                        let end = &mut self.ends[s];
                        end.credit.on_peer_imm(msg.imm).expect("no overclaim");
                        end.credit.on_receive();
                        if msg.data {
                            end.batches += 1;
                        } else {
                            end.credit.on_reposted();
                        }
                        true
                    }
                    None => false,
                },
                4 if self.ends[s].batches > 0 => {
                    self.ends[s].batches -= 1;
                    self.ends[s].credit.on_reposted();
                    true
                }
                5 => std::mem::take(&mut self.ends[s].waiting),
                // A tail fence: an empty message, as a credit-only one.
                6 => {
                    let waiting = self.ends[s].waiting;
                    match self.ends[s].credit.try_tail_fence(waiting) {
                        Some(imm) => {
                            self.net[p].push_back(Msg { data: false, imm });
                            true
                        }
                        None => false,
                    }
                }
                _ => false,
            };
            self.credit_only();
            self.check();
            changed
        }

        fn check(&self) {
            for s in 0..2 {
                let (me, peer) = (&self.ends[s].credit, &self.ends[1 - s].credit);
                assert!(me.invariant_holds(), "held + reserved + unreturned == R");
                let returning = peer.reposted.wrapping_sub(me.returned) & COUNT_MASK;
                assert_eq!(
                    me.unreturned(),
                    self.net[1 - s].len() as u32 + peer.pending() + returning,
                    "unreturned = in flight + at the peer's consumer + owed + returning"
                );
                assert!(
                    self.net[1 - s].len() as u32 + peer.pending() <= self.depth,
                    "a message never finds no posted receive (no RNR)"
                );
            }
        }

        /// Posts every buffer, then delivers until nothing moves, each
        /// consumer keeping up to `hold` batches.
        fn quiesce(&mut self, hold: u32) {
            for s in 0..2 {
                self.ends[s].waiting = false;
                while self.act(1, s) {}
            }
            for round in 0.. {
                assert!(round < 10 * self.depth, "credit-only traffic must stop");
                let mut moved = false;
                for s in 0..2 {
                    moved |= self.act(3, s);
                    if self.ends[s].batches > hold {
                        moved |= self.act(4, s);
                    }
                }
                if !moved && self.net.iter().all(VecDeque::is_empty) {
                    break;
                }
            }
        }
    }

    proptest! {
        #[test]
        fn invariant_holds_and_no_deadlock(
            depth in Credit::MIN_DEPTH..40,
            hold in 0u32..40,
            actions in proptest::collection::vec((0u8..7, 0usize..2), 0..400),
        ) {
            let mut model = Model::new(depth);
            for (action, side) in actions {
                model.act(action, side);
            }
            // A consumer holding fewer than R - threshold batches never
            // stalls its sender (docs/rdma-link.md § "Credit-only messages
            // only at the threshold").
            let hold = hold % (depth - Credit::new(depth).threshold());
            for hold in [hold, 0] {
                model.quiesce(hold);
                for s in 0..2 {
                    let credit = &mut model.ends[s].credit;
                    prop_assert!(credit.try_reserve(), "hold {hold}: the end can send: {credit:?}");
                    credit.unreserve();
                }
            }
            // Idle: nothing more goes out.
            let sent = model.credit_only_sent;
            model.credit_only();
            prop_assert_eq!(model.credit_only_sent, sent);
        }
    }
}
