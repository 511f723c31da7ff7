//! Mux knobs and their defaults.

use std::time::Duration;

use thiserror::Error;

/// When the peer task cuts a batch. The flush gate decides, and nothing else does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushPolicy {
    /// Write at the end of each wake, after draining everything already
    /// queued. Never waits for work that has not arrived.
    Auto,
    /// Like `Auto`, but a batch that is not full may wait up to `max_linger`
    /// for more records.
    AutoLinger {
        /// Longest a partly filled batch waits.
        max_linger: Duration,
    },
    /// Write data only on `flush(peer)`. Control the peer is owed (credit,
    /// opens, closes, pongs) still goes out after `reply_linger`.
    Manual {
        /// Longest owed control waits for a flush.
        reply_linger: Duration,
    },
}

/// Configuration of a mux. Defaults are documented per field.
#[derive(Clone, Debug)]
pub struct MuxConfig {
    /// When batches are cut. Default: [`FlushPolicy::Auto`].
    pub flush: FlushPolicy,
    /// Slot credit a receiver grants a new slot, in bytes: what one stream may
    /// have in flight plus buffered at its consumer. Here and in the other
    /// windows and budgets, a record counts its length plus
    /// [`RECORD_OVERHEAD`](crate::mux::RECORD_OVERHEAD). Default 256 KiB, about
    /// the bandwidth-delay product of a soft-RoCE or 100 Gb/s link at tens of
    /// microseconds (docs/design.md § "Slot credit in bytes, sized to the BDP").
    pub slot_window: u32,
    /// Peer credit a receiver grants each peer, in bytes: what all of one
    /// peer's slots together may have here unconsumed (in flight, queued for
    /// consumers, reassembling), whatever the slot count. Bounds what a peer
    /// can make this node hold. At least `max_record` plus
    /// [`RECORD_OVERHEAD`](crate::mux::RECORD_OVERHEAD), or records between
    /// the two can never be sent to us; a peer refuses a hello whose window
    /// is not above the overhead. Default 64 MiB
    /// (docs/design.md § "Peer credit bounds what a peer can make us hold").
    pub peer_window: u32,
    /// Bytes a producer may queue on one slot before `send` waits. Default 1 MiB.
    pub slot_budget: usize,
    /// Bytes all producers may queue toward one peer. Default 8 MiB. A slot
    /// with nothing queued may pass it by one record, so a backlog on other
    /// slots never holds a stream that keeps up (docs/design.md § "A stream
    /// that keeps up is never held by another's backlog").
    pub peer_budget: usize,
    /// Backstop sweep that returns any drained-but-unreturned credit,
    /// 1 ms to [`MuxConfig::MAX_TIMER`] (as every timer here: at most
    /// that). Default 200 ms.
    pub credit_sweep: Duration,
    /// Heartbeat for slots idle this long (at least 1 ms); `None`
    /// disables. Default 5 s.
    pub heartbeat: Option<Duration>,
    /// A peer with no live slot for this long closes its link gracefully and
    /// its task retires. Default 60 s.
    pub idle_retire: Duration,
    /// Live egress plus ingress slots per peer. Default 65,536.
    pub max_slots_per_peer: u32,
    /// Streams one peer's OpenSlots may leave waiting for a `bind` here
    /// (opened for keys nobody has bound yet, live or ended, across its
    /// epochs); further opens for new keys are refused. Default 16,384, so
    /// no one peer can fill the node's registry of 2^20 streams.
    pub max_unbound_per_peer: u32,
    /// Largest logical record (reassembled from fragments); 0 acts as 1.
    /// Default 16 MiB.
    pub max_record: usize,
    /// On shutdown, how long a peer task keeps writing what producers had
    /// already queued before it says goodbye. Default 1 s.
    pub shutdown_linger: Duration,
    /// Under [`FlushPolicy::Auto`], a producer writes its record itself, in
    /// its own turn, when the peer task waits with nothing to write and the
    /// last batch with data sent to that peer carried one record and left
    /// at least this long ago: a lone record skips the hop to the peer
    /// task, while a burst still goes batched. `None`: every batch goes through the peer
    /// task. Default 50 µs (docs/design.md § "A lone record is written by
    /// its producer").
    pub inline_write_gap: Option<Duration>,
    /// A batch that finds the peer task waiting is decoded by the link's
    /// reader in its own turn (a TCP link's read task, the RDMA link's
    /// completion handling: the soft driver's turn, or the poller), which
    /// wakes the consumers itself: the hop to the peer task is skipped.
    /// `false`: every batch goes through the peer task. Default true
    /// (docs/design.md § "A batch is decoded by its reader").
    pub inline_receive: bool,
}

/// Why a node refuses a [`MuxConfig`] ([`MuxConfig::check`]): every peer
/// would refuse its hello, or a timer is out of range.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum MuxConfigError {
    /// No stream could send a byte.
    #[error("slot_window is 0: no stream could send a byte")]
    ZeroSlotWindow,
    /// No record fits: each costs its length plus the overhead.
    #[error(
        "peer_window {peer_window} holds no record (each costs its length plus {overhead}): peers refuse the hello"
    )]
    PeerWindowHoldsNoRecord {
        /// The configured window.
        peer_window: u32,
        /// [`RECORD_OVERHEAD`](crate::mux::RECORD_OVERHEAD).
        overhead: usize,
    },
    /// A timer past [`MuxConfig::MAX_TIMER`] (its deadline could overflow
    /// the clock), or a credit sweep or heartbeat period under
    /// [`MuxConfig::MIN_PERIOD`] (the peer task would spin on it).
    #[error("{name} of {value:?} is out of range (periods 1 ms to a year, waits at most a year)")]
    TimerOutOfRange {
        /// The field.
        name: &'static str,
        /// Its value.
        value: Duration,
    },
}

impl MuxConfig {
    /// The longest timer a mux runs (`credit_sweep`, `heartbeat`,
    /// `idle_retire`, `shutdown_linger`, `inline_write_gap`, the flush
    /// policy's linger): a year, for "never"; `Duration::MAX` would
    /// overflow the first deadline.
    pub const MAX_TIMER: Duration = Duration::from_secs(365 * 86_400);
    /// The shortest credit sweep or heartbeat period: 1 ms.
    pub const MIN_PERIOD: Duration = Duration::from_millis(1);

    /// The windows a peer's hello check would refuse, and timers out of
    /// range, found before a node starts rather than at every handshake
    /// or at the first deadline.
    pub fn check(&self) -> Result<(), MuxConfigError> {
        if self.slot_window == 0 {
            return Err(MuxConfigError::ZeroSlotWindow);
        }
        if let Some((name, value)) = self.timer_out_of_range() {
            return Err(MuxConfigError::TimerOutOfRange { name, value });
        }
        let overhead = crate::mux::RECORD_OVERHEAD;
        if self.peer_window as usize <= overhead {
            return Err(MuxConfigError::PeerWindowHoldsNoRecord {
                peer_window: self.peer_window,
                overhead,
            });
        }
        Ok(())
    }

    /// The first timer a deadline (`now + timer`) could overflow with, or a
    /// period of zero would spin on.
    fn timer_out_of_range(&self) -> Option<(&'static str, Duration)> {
        let periods = [
            ("credit_sweep", Some(self.credit_sweep)),
            ("heartbeat", self.heartbeat),
        ];
        let linger = match self.flush {
            FlushPolicy::Auto => None,
            FlushPolicy::AutoLinger { max_linger } => Some(("flush max_linger", max_linger)),
            FlushPolicy::Manual { reply_linger } => Some(("flush reply_linger", reply_linger)),
        };
        let waits = [
            ("idle_retire", Some(self.idle_retire)),
            ("shutdown_linger", Some(self.shutdown_linger)),
            ("inline_write_gap", self.inline_write_gap),
            linger.map_or(("flush linger", None), |(name, value)| (name, Some(value))),
        ];
        let range = Self::MIN_PERIOD..=Self::MAX_TIMER;
        let bad_period = periods
            .into_iter()
            .find_map(|(name, value)| value.filter(|v| !range.contains(v)).map(|v| (name, v)));
        bad_period.or_else(|| {
            waits
                .into_iter()
                .find_map(|(name, value)| value.filter(|v| *v > Self::MAX_TIMER).map(|v| (name, v)))
        })
    }

    /// This configuration with its timers brought into range (for a mux
    /// made directly, which warns rather than refuses).
    pub(crate) fn with_timers_in_range(mut self) -> MuxConfig {
        let (short, long) = (Self::MIN_PERIOD, Self::MAX_TIMER);
        self.credit_sweep = self.credit_sweep.clamp(short, long);
        self.heartbeat = self.heartbeat.map(|h| h.clamp(short, long));
        self.idle_retire = self.idle_retire.min(long);
        self.shutdown_linger = self.shutdown_linger.min(long);
        self.inline_write_gap = self.inline_write_gap.map(|g| g.min(long));
        self.flush = match self.flush {
            FlushPolicy::AutoLinger { max_linger } => FlushPolicy::AutoLinger {
                max_linger: max_linger.min(long),
            },
            FlushPolicy::Manual { reply_linger } => FlushPolicy::Manual {
                reply_linger: reply_linger.min(long),
            },
            FlushPolicy::Auto => FlushPolicy::Auto,
        };
        self
    }
}

impl Default for MuxConfig {
    fn default() -> Self {
        MuxConfig {
            flush: FlushPolicy::Auto,
            slot_window: 256 * 1024,
            peer_window: 64 * 1024 * 1024,
            slot_budget: 1024 * 1024,
            peer_budget: 8 * 1024 * 1024,
            credit_sweep: Duration::from_millis(200),
            heartbeat: Some(Duration::from_secs(5)),
            idle_retire: Duration::from_secs(60),
            max_slots_per_peer: 65_536,
            max_unbound_per_peer: 16_384,
            max_record: 16 * 1024 * 1024,
            shutdown_linger: Duration::from_secs(1),
            inline_write_gap: Some(Duration::from_micros(50)),
            inline_receive: true,
        }
    }
}

/// What a peer announced about itself at the handshake of an epoch
/// ([`Mux::attach_with_terms`](crate::mux::Mux::attach_with_terms)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerTerms {
    /// The peer's [`MuxConfig::slot_window`]: bytes each of our slots may
    /// have outstanding toward it. Never 0.
    pub slot_window: u32,
    /// The peer's [`MuxConfig::peer_window`]: bytes all of our slots together
    /// may have outstanding toward it, and the most peer credit it may ever
    /// grant. Never 0.
    pub peer_window: u32,
    /// The peer credit our slots start the epoch with: the peer's window
    /// less what it still holds of our data, or may yet receive on a live
    /// epoch ([`Mux::peer_room`](crate::mux::Mux::peer_room) on its side).
    /// At most `peer_window`; 0 is allowed (we wait for its first grant).
    pub peer_credit: u32,
    /// The peer's [`MuxConfig::max_record`]: the largest record or message
    /// we may send it (a larger one would end the epoch there); 0 acts as 1.
    pub max_record: u32,
    /// The peer's [`MuxConfig::max_slots_per_peer`]: our opens toward it
    /// stay within the smaller of its limit and ours (it counts the same
    /// slots, its ingress being our egress), so it is not asked for slots
    /// it would refuse.
    pub max_slots: u32,
}

impl PeerTerms {
    /// What a node with `config` that holds nothing of ours announces.
    pub fn announced_by(config: &MuxConfig) -> PeerTerms {
        PeerTerms {
            slot_window: config.slot_window,
            peer_window: config.peer_window,
            peer_credit: config.peer_window,
            max_record: u32::try_from(config.max_record.max(1)).unwrap_or(u32::MAX),
            max_slots: config.max_slots_per_peer,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Timers whose deadline could overflow the clock, or periods the peer
    /// task would spin on, are refused by name; a mux made directly runs
    /// them clamped into range.
    #[test]
    fn timers_out_of_range_are_refused_and_clamped_for_a_direct_mux() {
        assert_eq!(MuxConfig::default().check(), Ok(()));
        let never = Duration::MAX;
        type Set = fn(&mut MuxConfig, Duration);
        let cases: [(&str, Duration, Set); 8] = [
            ("credit_sweep", Duration::ZERO, |c, v| c.credit_sweep = v),
            ("credit_sweep", never, |c, v| c.credit_sweep = v),
            ("heartbeat", Duration::ZERO, |c, v| c.heartbeat = Some(v)),
            ("idle_retire", never, |c, v| c.idle_retire = v),
            ("shutdown_linger", never, |c, v| c.shutdown_linger = v),
            ("inline_write_gap", never, |c, v| {
                c.inline_write_gap = Some(v)
            }),
            ("flush max_linger", never, |c, v| {
                c.flush = FlushPolicy::AutoLinger { max_linger: v }
            }),
            ("flush reply_linger", never, |c, v| {
                c.flush = FlushPolicy::Manual { reply_linger: v }
            }),
        ];
        for (name, value, set) in cases {
            let mut config = MuxConfig::default();
            set(&mut config, value);
            assert_eq!(
                config.check(),
                Err(MuxConfigError::TimerOutOfRange { name, value })
            );
            let clamped = config.with_timers_in_range();
            assert_eq!(clamped.check(), Ok(()), "{name} clamped");
        }
        let edges = MuxConfig {
            credit_sweep: MuxConfig::MIN_PERIOD,
            heartbeat: None,
            idle_retire: Duration::ZERO,
            shutdown_linger: MuxConfig::MAX_TIMER,
            inline_write_gap: Some(Duration::ZERO),
            ..MuxConfig::default()
        };
        assert_eq!(edges.check(), Ok(()));
        let kept = edges.clone().with_timers_in_range();
        assert_eq!(
            (kept.credit_sweep, kept.heartbeat, kept.idle_retire),
            (edges.credit_sweep, None, Duration::ZERO)
        );
    }
}
