//! `Link::try_recv` and `Link::set_arrivals` on any link: the reader tells
//! the hook, the hook takes batches in order, never past one in another
//! task's hands, and `recv` sees only what the hook left.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use qpmux::link::{Arrivals, EpochEnd, Link};

/// A hook that takes every batch it may, as the mux's does.
struct Taker<L: Link> {
    link: L,
    /// Batches handed out that the test counts as handled.
    handled: AtomicU64,
    told: AtomicUsize,
    taken: Mutex<Vec<Vec<u8>>>,
}

impl<L: Link> Arrivals for Taker<L> {
    fn arrived(&self) {
        self.told.fetch_add(1, Ordering::SeqCst);
        while let Some(batch) = self.link.try_recv(self.handled.load(Ordering::SeqCst)) {
            self.handled.fetch_add(1, Ordering::SeqCst);
            self.taken.lock().expect("taken").push(batch.to_vec());
        }
    }
}

async fn post<L: Link>(link: &L, payload: &[u8]) {
    let mut buf = link.reserve().await.expect("reserve");
    buf[..payload.len()].copy_from_slice(payload);
    link.post(buf, payload.len()).expect("post");
}

async fn within(what: &str, mut cond: impl FnMut() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting for {what}");
}

/// `tx` sends to `rx` (a fresh pair, nothing posted yet).
pub async fn the_reader_hands_batches_to_its_hook_in_order<L: Link + Clone>(tx: L, rx: L) {
    post(&tx, b"one").await;
    let one = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the first batch")
        .expect("recv");
    assert_eq!(&one[..], b"one");
    let taker = Arc::new(Taker {
        link: rx.clone(),
        handled: AtomicU64::new(0),
        told: AtomicUsize::new(0),
        taken: Mutex::new(Vec::new()),
    });
    let hook: std::sync::Weak<dyn Arrivals> = Arc::downgrade(&taker) as _;
    rx.set_arrivals(hook);
    // `one` is out, and the hook has not counted it handled: the next
    // batch is told of, left, and the `recv` already waiting is woken.
    let waiting = {
        let rx = rx.clone();
        tokio::spawn(async move { rx.recv().await.map(|batch| batch.to_vec()) })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    post(&tx, b"two").await;
    let two = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiting recv was woken")
        .expect("recv task")
        .expect("recv");
    assert_eq!(two, b"two");
    assert_eq!(taker.told.load(Ordering::SeqCst), 1);
    assert!(
        taker.taken.lock().expect("taken").is_empty(),
        "taken past a batch in other hands"
    );
    // Both handled now: the next arrivals are the hook's, in order.
    taker.handled.store(2, Ordering::SeqCst);
    drop(one);
    post(&tx, b"three").await;
    post(&tx, b"four").await;
    within("the hook took the next batches", || {
        taker.taken.lock().expect("taken").len() == 2
    })
    .await;
    assert_eq!(
        *taker.taken.lock().expect("taken"),
        [b"three".to_vec(), b"four".to_vec()]
    );
    // Nothing is left for `recv`.
    let left = tokio::time::timeout(Duration::from_millis(50), rx.recv()).await;
    assert!(left.is_err(), "recv got a batch the hook had taken");
    // After the end `try_recv` gives nothing.
    taker.handled.store(u64::MAX, Ordering::SeqCst);
    let told = taker.told.load(Ordering::SeqCst);
    post(&tx, b"five").await;
    within("the hook told of the fifth batch", || {
        taker.told.load(Ordering::SeqCst) > told
    })
    .await;
    rx.fail(EpochEnd::Closed);
    assert!(rx.try_recv(4).is_none(), "try_recv after the end");
}
