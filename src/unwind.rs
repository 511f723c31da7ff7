//! What a panic in one task may take down, and what it may not.
//!
//! ```text
//!  CatchPanic(task)              ─ poll under catch_unwind ─► Ok(output) │ Err(panic): the owner winds up
//!  spawn_catching(task, on_panic) ─ the task panicked, the unwind is over ─► on_panic()  (ends its epoch)
//! ```
//!
//! A task that serves many (a peer's epoch, a device's QPs) must not leave
//! them waiting for good because of one bug: the mux's peer task and the
//! soft provider's driver are polled under [`CatchPanic`], and a link's tasks
//! are spawned with [`spawn_catching`], whose `on_panic` ends their epoch.
//! Rulings: docs/design.md § "A panic ends an epoch, not a peer".

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

/// Spawns `task`; if a poll of it panics, the unwind is caught and
/// `on_panic` runs after it, on the same task. Never while unwinding: a
/// second panic there would abort the process, and a drop guard would also
/// fire for a task merely dropped during another's unwind.
pub(crate) fn spawn_catching<F, P>(task: F, on_panic: P) -> tokio::task::JoinHandle<()>
where
    F: Future<Output = ()> + Send + 'static,
    P: FnOnce() + Send + 'static,
{
    tokio::spawn(async move {
        if CatchPanic(Box::pin(task)).await.is_err() {
            on_panic();
        }
    })
}
