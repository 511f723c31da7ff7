//! Registered memory: what a node's links pin, bounded per node, and the
//! memlock preflight that says `ulimit -l` is too small before registration
//! fails.
//!
//! ```text
//!  PreparedEnd ─ RdmaConfig::registered_bytes ─► RegisteredBudget::reserve ─► Registration
//!                (over max_registered: RdmaError::RegisteredLimit)   (released when the link's
//!                                                                    resources are destroyed)
//!  /proc/self/limits ─► MemlockLimit ─► check_memlock(needed) ─► RdmaError::MemlockTooSmall
//! ```
//!
//! Provider-independent: the bound counts what the link asks to register,
//! whatever the device does with it. Design: docs/rdma-link.md
//! § "Registered memory: bound and preflight".

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::RdmaError;

/// Where the kernel's per-process limits are listed.
const PROC_LIMITS: &str = "/proc/self/limits";

/// The bytes of registered memory one node may hold at once, shared by every
/// link end it creates. Cheap to clone. The links of peers the node did not
/// register (they only dialled in) reserve through
/// [`RegisteredBudget::for_strangers`] and hold at most half of what the
/// node's own registrations leave ([`RegisteredBudget::keep_for_the_node`])
/// together, so strangers cannot leave the registered peers without room.
#[derive(Clone, Debug)]
pub struct RegisteredBudget {
    max: usize,
    in_use: Arc<AtomicUsize>,
    /// Bytes held by strangers' links, shared by every clone.
    strangers_in_use: Arc<AtomicUsize>,
    /// Their bound, shared by every clone.
    strangers_max: Arc<AtomicUsize>,
    /// This clone reserves for a stranger's link.
    stranger: bool,
}

impl RegisteredBudget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> RegisteredBudget {
        RegisteredBudget {
            max,
            in_use: Arc::default(),
            strangers_in_use: Arc::default(),
            strangers_max: Arc::new(AtomicUsize::new(max / 2)),
            stranger: false,
        }
    }

    /// `bytes` of the bound go to the node itself for its life (its send
    /// pool): strangers' links hold at most half of the rest.
    pub fn keep_for_the_node(&self, bytes: usize) {
        let rest = self.max.saturating_sub(bytes);
        self.strangers_max.store(rest / 2, Ordering::Release);
    }

    /// This budget, for the link of a peer the node did not register: its
    /// bytes count against the strangers' half as well.
    pub fn for_strangers(&self) -> RegisteredBudget {
        RegisteredBudget {
            stranger: true,
            ..self.clone()
        }
    }

    /// The most bytes strangers' links hold together: half of the bound,
    /// less what is kept for the node.
    pub fn strangers_max(&self) -> usize {
        self.strangers_max.load(Ordering::Acquire)
    }

    /// Bytes held by strangers' live registrations.
    pub fn strangers_in_use(&self) -> usize {
        self.strangers_in_use.load(Ordering::Acquire)
    }

    /// A budget that never refuses (the in-process [`super::pair`]).
    pub fn unbounded() -> RegisteredBudget {
        RegisteredBudget::new(usize::MAX)
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Bytes held by live registrations.
    pub fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Acquire)
    }

    /// Takes `needed` bytes, or says how far over the bound that would go
    /// (for a stranger's link, first over the strangers' half).
    pub fn reserve(&self, needed: usize) -> Result<Registration, RdmaError> {
        let strangers = if self.stranger {
            let max = self.strangers_max();
            take(&self.strangers_in_use, needed, max).map_err(|in_use| {
                RdmaError::StrangersRegisteredLimit {
                    needed,
                    in_use,
                    max,
                }
            })?;
            Some(self.strangers_in_use.clone())
        } else {
            None
        };
        if let Err(in_use) = take(&self.in_use, needed, self.max) {
            if let Some(strangers) = strangers {
                strangers.fetch_sub(needed, Ordering::AcqRel);
            }
            return Err(RdmaError::RegisteredLimit {
                needed,
                in_use,
                max: self.max,
            });
        }
        Ok(Registration {
            bytes: needed,
            in_use: self.in_use.clone(),
            strangers,
        })
    }
}

/// Adds `needed` to `in_use` if the sum stays within `max`; else the count
/// seen.
fn take(in_use: &AtomicUsize, needed: usize, max: usize) -> Result<(), usize> {
    let mut current = in_use.load(Ordering::Acquire);
    loop {
        let next = current
            .checked_add(needed)
            .filter(|&next| next <= max)
            .ok_or(current)?;
        match in_use.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok(()),
            Err(seen) => current = seen,
        }
    }
}

/// Bytes taken from a [`RegisteredBudget`]; dropping it gives them back.
#[derive(Debug)]
pub struct Registration {
    bytes: usize,
    in_use: Arc<AtomicUsize>,
    /// The strangers' count, for a stranger's link.
    strangers: Option<Arc<AtomicUsize>>,
}

impl Registration {
    /// Bytes this registration holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.in_use.fetch_sub(self.bytes, Ordering::AcqRel);
        if let Some(strangers) = &self.strangers {
            strangers.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

/// The soft `RLIMIT_MEMLOCK` (what `ulimit -l` shows, in bytes here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemlockLimit {
    /// No limit.
    Unlimited,
    /// At most this many bytes may be locked.
    Bytes(u64),
}

impl MemlockLimit {
    /// The soft limit from the text of `/proc/<pid>/limits`; `None` when the
    /// "Max locked memory" line is missing or unreadable.
    pub fn parse(limits: &str) -> Option<MemlockLimit> {
        let line = limits
            .lines()
            .find_map(|line| line.strip_prefix("Max locked memory"))?;
        match line.split_whitespace().next()? {
            "unlimited" => Some(MemlockLimit::Unlimited),
            soft => soft.parse().ok().map(MemlockLimit::Bytes),
        }
    }

    /// This process's limit; `None` where `/proc/self/limits` is unreadable
    /// (not Linux, or no procfs).
    pub fn current() -> Option<MemlockLimit> {
        let text = std::fs::read_to_string(PROC_LIMITS).ok()?;
        MemlockLimit::parse(&text)
    }

    /// Ok when `needed` bytes may be locked under this limit; otherwise the
    /// error names the limit and the `ulimit -l` value (KiB) that would do.
    pub fn check(self, needed: usize) -> Result<(), RdmaError> {
        match self {
            MemlockLimit::Unlimited => Ok(()),
            MemlockLimit::Bytes(limit) if needed as u64 <= limit => Ok(()),
            MemlockLimit::Bytes(limit) => Err(RdmaError::MemlockTooSmall {
                needed,
                limit,
                needed_kib: (needed as u64).div_ceil(1024),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: &str = "\
Limit                     Soft Limit           Hard Limit           Units
Max cpu time              unlimited            unlimited            seconds
Max locked memory         8388608              16777216             bytes
Max address space         unlimited            unlimited            bytes
";

    /// Strangers' links hold at most half of the bound together, and give
    /// it back with their registrations; the registered peers' links may
    /// use the rest, and the whole bound once strangers hold nothing.
    #[test]
    fn strangers_hold_at_most_half_of_the_registered_bound() {
        let budget = RegisteredBudget::new(100);
        let strangers = budget.for_strangers();
        let first = strangers.reserve(30).expect("within half");
        assert_eq!(
            strangers.reserve(30).map(|_| ()),
            Err(RdmaError::StrangersRegisteredLimit {
                needed: 30,
                in_use: 30,
                max: 50
            })
        );
        assert_eq!((budget.in_use(), budget.strangers_in_use()), (30, 30));
        let chosen = budget
            .reserve(70)
            .expect("the rest is the registered peers'");
        // Kept for the node's pool, the strangers' half shrinks with it.
        budget.keep_for_the_node(20);
        assert_eq!(budget.strangers_max(), 40);
        budget.keep_for_the_node(0);
        // The whole bound refuses a stranger inside its half too, and the
        // strangers' count comes back.
        assert!(matches!(
            strangers.reserve(10),
            Err(RdmaError::RegisteredLimit { .. })
        ));
        assert_eq!(budget.strangers_in_use(), 30);
        drop((first, chosen));
        assert_eq!((budget.in_use(), budget.strangers_in_use()), (0, 0));
        assert!(budget.reserve(100).is_ok());
    }

    #[test]
    fn the_soft_memlock_limit_is_read_from_proc_limits() {
        assert_eq!(
            MemlockLimit::parse(LIMITS),
            Some(MemlockLimit::Bytes(8 << 20))
        );
        let unlimited = LIMITS.replace("8388608     ", "unlimited   ");
        assert_eq!(
            MemlockLimit::parse(&unlimited),
            Some(MemlockLimit::Unlimited)
        );
        assert_eq!(MemlockLimit::parse("Max cpu time unlimited"), None);
        assert_eq!(MemlockLimit::parse("Max locked memory    lots"), None);
    }

    #[test]
    fn a_memlock_limit_too_small_names_the_ulimit_needed() {
        let limit = MemlockLimit::parse(LIMITS).expect("fixture parses");
        assert_eq!(limit.check(8 << 20), Ok(()));
        let err = limit.check((8 << 20) + 1).expect_err("one byte over");
        assert_eq!(
            err,
            RdmaError::MemlockTooSmall {
                needed: (8 << 20) + 1,
                limit: 8 << 20,
                needed_kib: 8193,
            }
        );
        let text = err.to_string();
        assert!(text.contains("ulimit -l 8193"), "{text}");
        assert!(text.contains("8388608"), "{text}");
        assert_eq!(MemlockLimit::Unlimited.check(usize::MAX), Ok(()));
    }

    #[test]
    fn the_current_process_limit_is_readable_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(MemlockLimit::current().is_some());
        }
    }

    #[test]
    fn the_budget_refuses_past_its_bound_and_frees_on_drop() {
        let budget = RegisteredBudget::new(100);
        let first = budget.reserve(60).expect("fits");
        assert_eq!(budget.in_use(), 60);
        let err = budget.reserve(41).expect_err("over");
        assert_eq!(
            err,
            RdmaError::RegisteredLimit {
                needed: 41,
                in_use: 60,
                max: 100
            }
        );
        assert!(err.to_string().contains("max_registered"), "{err}");
        let second = budget.reserve(40).expect("exactly fits");
        drop(first);
        assert_eq!(budget.in_use(), 40);
        drop(second);
        assert_eq!(budget.in_use(), 0);
        assert!(RegisteredBudget::unbounded().reserve(usize::MAX).is_ok());
    }
}
