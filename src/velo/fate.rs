//! Who reports a frame that never reached the wire, so velo hears it once.
//!
//! ```text
//!  send_message ─► AdmissionGate ──(admission Ok)──► channel ─► mux ─► wire
//!                      │                                  │
//!                  admission Err:                    dropped unwritten:
//!                  velo's backend reports            we report (Drop hook)
//! ```
//!
//! velo's backend wraps every `Pending` admission with a hook that calls
//! `on_error` when the admission fails; a frame dropped with its admission
//! still open (in the gate's queue, by `fail_all`, or refused by a closed
//! channel) is therefore velo's to report. Ours is a frame that reached
//! the channel and was then dropped unwritten. The two can race: the mux
//! may take a frame off the channel and drop it before the gate's driver
//! resolves its admission, so a drop with the verdict still open waits here
//! for it.

use std::sync::{Arc, Mutex};

/// The report to make if the frame is ours to report.
pub(super) type Report = Box<dyn FnOnce() + Send>;

enum State {
    /// Offered to the gate, verdict open, frame alive.
    Offered(Report),
    /// On the channel: a drop from now on is ours to report.
    Admitted(Report),
    /// Dropped before the verdict: reported only if it turns out admitted.
    DroppedOffered(Report),
    /// Reported, or left to velo.
    Settled,
}

/// One frame's fate, shared by its drop hook and its admission's verdict.
pub(super) struct Fate {
    state: Mutex<State>,
}

impl Fate {
    pub(super) fn new(report: Report) -> Arc<Fate> {
        Arc::new(Fate {
            state: Mutex::new(State::Offered(report)),
        })
    }

    /// The frame was dropped before it was written.
    pub(super) fn dropped(&self) {
        self.step(|state| match state {
            State::Offered(report) => (State::DroppedOffered(report), None),
            State::Admitted(report) => (State::Settled, Some(report)),
            other => (other, None),
        });
    }

    /// The frame reached the channel (the fast path, or the admission
    /// resolved `Ok`).
    pub(super) fn admitted(&self) {
        self.step(|state| match state {
            State::Offered(report) => (State::Admitted(report), None),
            State::DroppedOffered(report) => (State::Settled, Some(report)),
            other => (other, None),
        });
    }

    /// The admission failed: velo's backend reports the frame.
    pub(super) fn refused(&self) {
        self.step(|_| (State::Settled, None));
    }

    /// Runs `transition` on the state under the lock, then makes the report
    /// it returns, if any, after unlocking (the report calls into velo).
    fn step(&self, transition: impl FnOnce(State) -> (State, Option<Report>)) {
        let due = {
            let mut state = self
                .state
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            let (next, due) = transition(std::mem::replace(&mut *state, State::Settled));
            *state = next;
            due
        };
        if let Some(report) = due {
            report();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counted() -> (Arc<Fate>, Arc<AtomicUsize>) {
        let reports = Arc::new(AtomicUsize::new(0));
        let counter = reports.clone();
        let fate = Fate::new(Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        (fate, reports)
    }

    #[test]
    fn a_frame_dropped_after_admission_is_reported_once() {
        let (fate, reports) = counted();
        fate.admitted();
        fate.dropped();
        fate.dropped();
        assert_eq!(reports.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_frame_dropped_before_its_admission_resolved_ok_is_reported_at_the_verdict() {
        let (fate, reports) = counted();
        fate.dropped();
        assert_eq!(reports.load(Ordering::SeqCst), 0, "the verdict is open");
        fate.admitted();
        assert_eq!(reports.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_refused_frame_is_left_to_velo_whenever_it_is_dropped() {
        for drop_first in [true, false] {
            let (fate, reports) = counted();
            if drop_first {
                fate.dropped();
                fate.refused();
            } else {
                fate.refused();
                fate.dropped();
            }
            assert_eq!(reports.load(Ordering::SeqCst), 0);
        }
    }
}
