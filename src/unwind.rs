//! What a panic in one task may take down, and what it may not.
//!
//! ```text
//!  CatchPanic(task)  ─ poll under catch_unwind ─► Ok(output) │ Err(panic): the owner winds the task's work up
//!  EndOnPanic(close) ─ dropped while unwinding ─► close()   (the epoch ends; the task is gone)
//! ```
//!
//! A task that serves many (a peer's epoch, a device's QPs) must not leave
//! them waiting for good because of one bug: the mux's peer task and the
//! soft provider's driver are polled under [`CatchPanic`], and a link's tasks
//! hold an [`EndOnPanic`] that ends their epoch. Rulings: docs/design.md
//! § "A panic ends an epoch, not a peer".

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Polls a boxed future inside `catch_unwind`: a panic while polling it
/// resolves to `Err(panic)` instead of unwinding into the runtime, which
/// would end the task silently.
pub(crate) struct CatchPanic<F>(pub(crate) Pin<Box<F>>);

impl<F: Future> Future for CatchPanic<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.get_mut().0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

/// The message a panic was raised with, where it is text.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not text)")
}

/// Runs its closure if the scope holding it unwinds: a link's task or
/// handler that panics ends its epoch as `EpochEnd::Internal` instead of
/// leaving it open with nobody serving it. Declare it before any lock guard
/// of the scope, so those are released (and poisoned) before it runs.
pub(crate) struct EndOnPanic<F: FnMut()>(pub(crate) F);

impl<F: FnMut()> Drop for EndOnPanic<F> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            (self.0)();
        }
    }
}
