//! Work for after the tasks a turn woke: handed to the tokio runtime's
//! deferred list, the one `yield_now` uses.
//!
//! ```text
//!  a turn ─ wakes tasks (the worker's queue) ─ after_woken_tasks(waker) ─► the deferred list
//!  the worker: runs its queue ─► polls its driver ─► wakes the deferred list ─► waker.wake()
//! ```
//!
//! A worker wakes that list when it runs out of queued tasks, and at the
//! latest every `event_interval` (61) scheduler ticks, which may come first.
//! Tasks woken into the worker's LIFO slot before the hand-off (the first
//! consumer a batch wakes) run before it; others may not (the list pops
//! last first; another worker may steal a queued task). Outside a worker
//! (a `block_on` thread, `spawn_blocking`, `block_in_place`) tokio wakes
//! the waker at once, and a runtime shutting down drops it unwoken: work
//! done in the waker's `Drop` runs either way.
//!
//! The waker is woken inside the worker's park with tokio's deferred list
//! borrowed: what it runs must not hand anything to the list again
//! (`yield_now`, this function), or tokio panics.

use std::future::Future;
use std::task::{Context, Waker};

/// Hands `waker` to the current worker's deferred list (see the module
/// doc for when it is woken).
pub(crate) fn after_woken_tasks(waker: &Waker) {
    let mut yielded = std::pin::pin!(tokio::task::yield_now());
    let _pending = yielded.as_mut().poll(&mut Context::from_waker(waker));
}
