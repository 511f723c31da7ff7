//! [`TcpLink`]: one epoch over one TCP connection.
//!
//! ```text
//!  reserve() ─► free send buffer ─ post() ─► writev(len|batch) now, when nothing is queued or being written
//!                                          └► else (or the rest of a partial write) ─► queue ─► writer task ─ writev(…) ─► socket
//!  recv() ◄─ inbox ◄─ reader task ◄─ read len|batch ◄─ socket   (stops while `recv_batches` are held)
//!            inbox ─► arrivals hook (the mux decodes in the reader's turn: try_recv); recv woken for what it left
//!  fail() / socket error ─► ended (first reason wins) ─► shutdown(Both)
//!  graceful end, the peer's EOF, replaced (with a read-out)
//!            ─► writer flushes, shutdown(Write); reader delivers to EOF, then recv() ends
//!  last handle dropped ─► a flushing end's reader discards to EOF (so our flush
//!            is not reset); a replaced one's is cut
//! ```
//!
//! TCP does its own flow control, so a link credit is a free send buffer and
//! nothing else. All state sits behind one mutex; waiters sleep on `Notify`s
//! and re-check state after `enable()`, so `reserve` and `recv` are cancel-safe.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::{Shutdown, SocketAddr};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::Duration;

use socket2::{SockRef, Socket, TcpKeepalive};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::Notify;

use crate::link::{
    Arrivals, EpochEnd, Link, LinkError, LinkFault, ReadOutBudget, ReadOutOwner, ReadOutTier,
};
use crate::mux::engine::ProtocolError;
use crate::mux::protocol::Epoch;
use crate::stages::{self, Stage};
use crate::unwind::spawn_catching;

/// Shape of a TCP link. Defaults are documented per field.
#[derive(Clone, Debug)]
pub struct TcpLinkConfig {
    /// Largest batch this end receives (advertised in the hello); the send
    /// limit is the smaller of ours and the peer's. Default 64 KiB.
    pub max_batch: usize,
    /// Send buffers per link: `reserve` waits while all are queued or being
    /// written. Default 16.
    pub send_buffers: usize,
    /// Received batches the consumer may hold (plus ones queued for it) before
    /// the reader stops reading the socket. Default 16.
    pub recv_batches: usize,
    /// Idle time before TCP keepalive probes, and their interval. Default 1 s.
    pub keepalive: Option<Duration>,
    /// `TCP_USER_TIMEOUT` (Linux): unacknowledged data older than this kills
    /// the connection. Default 5 s.
    pub user_timeout: Option<Duration>,
    /// How many links made with this config (one node's) may read out at
    /// once for a close their peer chose (its close, its newer link), shared
    /// by owner, and four times as many short read-outs for the peer's
    /// close past its share. Default 16.
    pub read_outs: ReadOutBudget,
}

impl Default for TcpLinkConfig {
    fn default() -> Self {
        TcpLinkConfig {
            max_batch: 64 * 1024,
            send_buffers: 16,
            recv_batches: 16,
            keepalive: Some(Duration::from_secs(1)),
            user_timeout: Some(Duration::from_secs(5)),
            read_outs: ReadOutBudget::default(),
        }
    }
}

/// Batches queued to the writer taken per `writev` (two slices each).
const WRITE_BATCHES: usize = 256;
/// How long a graceful close may keep flushing after the epoch ended.
const FLUSH_GRACE: Duration = Duration::from_secs(2);
/// How long a peer's close past its share of the read-outs may keep
/// flushing (else `FLUSH_GRACE`): a peer that stops reading holds the
/// socket no longer than this and [`UNBUDGETED_PEER_CLOSE`].
const UNBUDGETED_FLUSH_GRACE: Duration = Duration::from_secs(1);
/// How long the peer's close waits for its EOF after our flush when the
/// peer's share of the node's read-outs is spent (else `2 × FLUSH_GRACE`
/// from the end): an honest peer's FIN follows its Goodbye at once, and a
/// peer that never sends one holds the socket no longer than this past our
/// flush (itself bounded by [`UNBUDGETED_FLUSH_GRACE`]).
const UNBUDGETED_PEER_CLOSE: Duration = Duration::from_millis(100);

/// A posted batch waiting for the writer: its buffer, the batch's length,
/// and how many bytes of its frame (`len|batch`) are already written.
#[derive(Debug)]
struct Queued {
    buf: Vec<u8>,
    len: usize,
    written: usize,
}

#[derive(Debug, Default)]
struct State {
    free: Vec<Vec<u8>>,
    queue: VecDeque<Queued>,
    /// The writer holds batches taken from the queue: a `post` writing
    /// now would overtake them.
    writer_busy: bool,
    inbox: VecDeque<Vec<u8>>,
    held: usize,
    /// The reader stopped for back-pressure and waits for a batch to drop.
    reader_stalled: bool,
    ended: Option<EpochEnd>,
    /// Ended, and still reading out: the reader delivers until the peer's EOF
    /// or `read_out_until` (a graceful end, the peer's close, or a
    /// replacement that got a read-out).
    reading_out: bool,
    /// The budget's read-out this link holds, and of which pool (for a
    /// close the peer chose).
    read_out_held: Option<ReadOutTier>,
    /// The peer's close found its share of full read-outs spent and took
    /// a short one: once our flush is out, it waits only
    /// [`UNBUDGETED_PEER_CLOSE`] more.
    short_read_out: bool,
    /// The reader met the peer's EOF: its close needs no read-out.
    peer_eof: bool,
    /// Cut at the end for want of a read-out: the writer flushes nothing
    /// and the reader discards nothing (the socket is shut).
    cut: bool,
    /// Past it, a link reading out stops waiting for the peer's EOF.
    read_out_until: Option<tokio::time::Instant>,
    /// The reader task is gone: a link reading out ends `recv` only then.
    reader_done: bool,
    batches_sent: u64,
    batches_received: u64,
    /// Batches `recv` and `try_recv` have handed out.
    handed_out: u64,
}

#[derive(Debug)]
struct Inner {
    epoch: Epoch,
    send_max: usize,
    recv_max: usize,
    recv_batches: usize,
    read_outs: ReadOutBudget,
    peer: Option<SocketAddr>,
    socket: Socket,
    /// Written by `post` itself when the writer is idle, else by the writer.
    wr: OwnedWriteHalf,
    state: Mutex<State>,
    /// `reserve` waiters (a buffer came free, or the epoch ended).
    wake_send: Notify,
    /// `recv` waiters (a batch arrived, or the epoch ended).
    wake_recv: Notify,
    /// `ended` waiters and the graceful writer.
    wake_end: Notify,
    /// The writer (queue grew, or the epoch ended).
    writer: Notify,
    /// The stalled reader (the consumer dropped a batch, or the epoch ended).
    reader: Notify,
    /// Told by the reader of each batch before `recv` is woken for it.
    arrivals: OnceLock<Weak<dyn Arrivals>>,
    /// Makes the reader panic on its next batch (unit tests).
    #[cfg(test)]
    panic_on_read: std::sync::atomic::AtomicBool,
}

impl Inner {
    /// Tells the arrivals hook, then wakes `recv` only if the hook left
    /// the batch.
    fn batch_arrived(&self) {
        if let Some(arrivals) = self.arrivals.get().and_then(Weak::upgrade) {
            arrivals.arrived();
            if self.lock().inbox.is_empty() {
                return;
            }
        }
        self.wake_recv.notify_waiters();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic under this lock is a bug here. The catch around the
        // panicking task ends the epoch (`end_after_panic`); the others go on.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ended_error(&self, state: &State) -> Option<LinkError> {
        state.ended.map(|reason| LinkError::Ended {
            epoch: self.epoch,
            reason,
        })
    }

    /// Ends the epoch (first reason wins). A graceful end, the peer's close
    /// and a replacement that gets a read-out let the writer flush what is
    /// queued and the reader deliver what the peer sent until its EOF: each
    /// side's last batches reach the other (docs/design.md § "A closed link
    /// delivers both ways"). Any other end shuts the socket now. A fault,
    /// violation or panic that comes later cuts a read-out short (the mux's
    /// own `Replaced`, or the peer's EOF, does not). The read-outs of the
    /// closes the peer chooses (its close, its newer link) come from its
    /// share of the node's budget; past it a replaced link is cut, and the
    /// peer's close takes a short read-out (a flush within
    /// [`UNBUDGETED_FLUSH_GRACE`], then [`UNBUDGETED_PEER_CLOSE`] for its
    /// EOF) or, past those too, is cut, flushing nothing. Our own closes'
    /// read-outs are ours, and take none.
    fn end(&self, reason: EpochEnd) {
        self.end_seen(reason, false);
    }

    /// [`Inner::end`]; `eof`: the reader met the peer's EOF, said under the
    /// same lock, so no other end can come between.
    fn end_seen(&self, reason: EpochEnd, eof: bool) {
        let mut state = self.lock();
        state.peer_eof |= eof;
        if state.ended.is_some() {
            // A replacement of a link already closed (by us or the peer,
            // whose close took its read-out or its short wait) holds nothing
            // more; only a fault cuts the read-out.
            drop(state);
            if matches!(
                reason,
                EpochEnd::Fault(_) | EpochEnd::Violation(_) | EpochEnd::Internal
            ) {
                self.cut_read_out(Cut::Now);
            }
            return;
        }
        state.ended = Some(reason);
        // A reader already gone (its runtime dropped it) reads nothing out,
        // nor does one that met the peer's EOF.
        let peers_choice = matches!(reason, EpochEnd::Replaced | EpochEnd::PeerClosed)
            && !state.reader_done
            && !state.peer_eof;
        let held = peers_choice
            .then(|| {
                if self.read_outs.try_take(ReadOutTier::Full) {
                    Some(ReadOutTier::Full)
                } else {
                    (reason == EpochEnd::PeerClosed && self.read_outs.try_take(ReadOutTier::Short))
                        .then_some(ReadOutTier::Short)
                }
            })
            .flatten();
        // The peer's choice with no read-out left, even a short one: cut.
        let cut = peers_choice && held.is_none();
        state.cut = cut;
        let reading_out = !state.reader_done && !cut && (flushes(reason) || held.is_some());
        if reading_out {
            state.reading_out = true;
            state.read_out_held = held;
            state.short_read_out = held == Some(ReadOutTier::Short);
            let time = if state.short_read_out {
                UNBUDGETED_FLUSH_GRACE + UNBUDGETED_PEER_CLOSE
            } else {
                FLUSH_GRACE * 2
            };
            state.read_out_until = Some(tokio::time::Instant::now() + time);
        }
        drop(state);
        if cut || !flushes(reason) && !reading_out {
            self.shutdown_socket();
        }
        self.wake_send.notify_waiters();
        self.wake_recv.notify_waiters();
        self.wake_end.notify_waiters();
        self.writer.notify_one();
        self.reader.notify_one();
    }

    /// Ends a read-out, if one is under way: the reader stops delivering at
    /// its next look. `Cut::Now` shuts the socket; `Cut::Discard` lets a
    /// link that flushes read (and drop) what the peer still sends until its
    /// EOF, as a close with bytes unread would reset the connection and
    /// purge our flush.
    fn cut_read_out(&self, cut: Cut) {
        let mut state = self.lock();
        if !state.reading_out {
            return;
        }
        state.reading_out = false;
        let discard = cut == Cut::Discard && state.ended.is_some_and(flushes);
        drop(state);
        if !discard {
            self.shutdown_socket();
        }
        self.wake_end.notify_waiters();
        self.reader.notify_one();
    }

    /// Our flush is out (FIN sent): a short read-out waits only
    /// [`UNBUDGETED_PEER_CLOSE`] more for the peer's EOF.
    fn flushed(&self) {
        let mut state = self.lock();
        if !state.short_read_out {
            return;
        }
        let soon = tokio::time::Instant::now() + UNBUDGETED_PEER_CLOSE;
        state.read_out_until = state.read_out_until.map(|until| until.min(soon));
        drop(state);
        self.wake_end.notify_waiters();
    }

    /// A panic in the reader or writer (a bug here): the epoch ends as
    /// `Internal` rather than staying open with half its service gone.
    fn end_after_panic(&self) {
        tracing::error!(epoch = %self.epoch, "a tcp link task panicked; ending the epoch");
        self.end(EpochEnd::Internal);
    }

    fn shutdown_socket(&self) {
        self.shutdown(Shutdown::Both);
    }

    fn shutdown(&self, how: Shutdown) {
        if let Err(err) = self.socket.shutdown(how) {
            // Already shut or reset by the peer: nothing left to close.
            tracing::trace!(%err, "tcp link shutdown");
        }
    }
}

/// How [`Inner::cut_read_out`] ends a read-out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// A fault: shut the socket.
    Now,
    /// Nobody is left to deliver to: discard to the peer's EOF if the link
    /// flushes, else shut.
    Discard,
}

/// Whether an end lets the writer flush what is queued: our graceful close,
/// or the peer's (its FIN, or its Goodbye), whose read-out takes our last
/// batches as ours takes its.
fn flushes(reason: EpochEnd) -> bool {
    match reason {
        EpochEnd::Closed | EpochEnd::Shutdown | EpochEnd::PeerClosed => true,
        EpochEnd::PeerLost
        | EpochEnd::Fault(_)
        | EpochEnd::Violation(_)
        | EpochEnd::Replaced
        | EpochEnd::Internal => false,
    }
}

/// How a socket error ends the epoch.
fn end_of_io(err: &io::Error) -> EpochEnd {
    match err.kind() {
        io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::TimedOut
        // The stream ended inside a frame: the peer went mid-write.
        | io::ErrorKind::UnexpectedEof => EpochEnd::PeerLost,
        kind => EpochEnd::Fault(LinkFault::Io(kind)),
    }
}

/// Ends the epoch when the last handle goes away, so tasks never outlive users.
#[derive(Debug)]
struct Handle(Arc<Inner>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.end(EpochEnd::Closed);
        // Nobody is left to take what a read-out would deliver.
        self.0.cut_read_out(Cut::Discard);
    }
}

/// One end of one epoch over one TCP connection. Cheap to clone; the epoch
/// ends (gracefully) when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct TcpLink {
    handle: Arc<Handle>,
}

/// Counters of one link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpLinkStats {
    /// Batches written to the socket.
    pub batches_sent: u64,
    /// Batches read from the socket.
    pub batches_received: u64,
}

impl TcpLink {
    /// Starts a link for `epoch` on a connected stream whose handshake is
    /// done. `prefix` holds bytes already read past the handshake (they are
    /// the first link bytes); `peer_max_batch` is the peer's advertised limit.
    /// Spawns the reader and writer on the current tokio runtime.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn new(
        stream: TcpStream,
        prefix: Vec<u8>,
        epoch: Epoch,
        config: &TcpLinkConfig,
        peer_max_batch: usize,
    ) -> io::Result<TcpLink> {
        configure(&stream, config)?;
        let socket = SockRef::from(&stream).try_clone()?;
        let peer = stream.peer_addr().ok();
        let send_max = config.max_batch.min(peer_max_batch);
        let (rd, wr) = stream.into_split();
        let inner = Arc::new(Inner {
            epoch,
            send_max,
            recv_max: config.max_batch,
            recv_batches: config.recv_batches.max(1),
            read_outs: config.read_outs.clone(),
            peer,
            socket,
            wr,
            state: Mutex::new(State {
                free: (0..config.send_buffers.max(1))
                    .map(|_| vec![0u8; send_max])
                    .collect(),
                ..State::default()
            }),
            wake_send: Notify::new(),
            wake_recv: Notify::new(),
            wake_end: Notify::new(),
            writer: Notify::new(),
            reader: Notify::new(),
            arrivals: OnceLock::new(),
            #[cfg(test)]
            panic_on_read: Default::default(),
        });
        let ended = inner.clone();
        let done = ReaderDone(inner.clone());
        spawn_catching(read_loop(inner.clone(), prefix, rd, done), move || {
            ended.end_after_panic();
        });
        let ended = inner.clone();
        spawn_catching(write_loop(inner.clone()), move || ended.end_after_panic());
        Ok(TcpLink {
            handle: Arc::new(Handle(inner)),
        })
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.handle.0
    }

    /// True once the epoch has ended.
    pub fn is_ended(&self) -> bool {
        self.end_reason().is_some()
    }

    /// Why the epoch ended, once it has.
    pub fn end_reason(&self) -> Option<EpochEnd> {
        self.inner().lock().ended
    }

    /// The remote address, if the socket knew it.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.inner().peer
    }

    /// Whose share of the node's read-outs this link's read-out would take.
    pub fn read_out_owner(&self) -> Option<ReadOutOwner> {
        self.inner().read_outs.owner()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> TcpLinkStats {
        let state = self.inner().lock();
        TcpLinkStats {
            batches_sent: state.batches_sent,
            batches_received: state.batches_received,
        }
    }

    /// True if both handles are the same link.
    pub fn same_link(&self, other: &TcpLink) -> bool {
        Arc::ptr_eq(self.inner(), other.inner())
    }
}

/// Sets TCP_NODELAY, keepalive and (Linux) TCP_USER_TIMEOUT.
pub(crate) fn configure(stream: &TcpStream, config: &TcpLinkConfig) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = SockRef::from(stream);
    if let Some(idle) = config.keepalive {
        let keepalive = TcpKeepalive::new().with_time(idle);
        #[cfg(any(target_os = "linux", target_os = "macos", target_os = "windows"))]
        let keepalive = keepalive.with_interval(idle);
        sock.set_tcp_keepalive(&keepalive)?;
    }
    #[cfg(target_os = "linux")]
    if let Some(timeout) = config.user_timeout {
        sock.set_tcp_user_timeout(Some(timeout))?;
    }
    Ok(())
}

/// Marks the reader gone however its task ends (returned, unwound,
/// dropped), and gives back its read-out, if it had one.
struct ReaderDone(Arc<Inner>);

impl Drop for ReaderDone {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.reader_done = true;
        // Under the lock: whoever sees the reader done finds the budget back.
        if let Some(tier) = state.read_out_held.take() {
            self.0.read_outs.give_back(tier);
        }
        drop(state);
        self.0.wake_recv.notify_waiters();
    }
}

/// `done` is made with the task, so a task dropped before its first poll
/// still marks the reader gone.
async fn read_loop(inner: Arc<Inner>, prefix: Vec<u8>, rd: OwnedReadHalf, done: ReaderDone) {
    let _done = done;
    let mut rd = BufReader::with_capacity(64 * 1024, std::io::Cursor::new(prefix).chain(rd));
    let mut eof = false;
    let reason = loop {
        // Back-pressure: stop reading while the consumer holds enough. The
        // consumer's `notify_one` after it sees `reader_stalled` leaves a
        // permit if we are not waiting yet, so no waiter is registered
        // before the check (a stale permit costs one more look).
        loop {
            let (cut, stalled) = {
                let mut state = inner.lock();
                let stalled = state.inbox.len() + state.held >= inner.recv_batches;
                state.reader_stalled = stalled;
                (state.ended.is_some() && !state.reading_out, stalled)
            };
            if cut {
                return read_out_close(&inner, &mut rd).await;
            }
            if !stalled {
                break;
            }
            tokio::select! {
                () = inner.reader.notified() => {}
                () = until_cut(&inner) => return read_out_close(&inner, &mut rd).await,
            }
        }
        // A replaced link's read is not cancelled: what the peer sent before
        // its EOF is delivered, and a frame cut in half would be lost.
        let read = tokio::select! {
            read = read_batch(&mut rd, inner.recv_max) => read,
            () = until_cut(&inner) => return read_out_close(&inner, &mut rd).await,
        };
        match read {
            Ok(Some(batch)) => {
                stages::mark(Stage::Received);
                #[cfg(test)]
                assert!(
                    !inner
                        .panic_on_read
                        .swap(false, std::sync::atomic::Ordering::Relaxed),
                    "injected reader panic"
                );
                let delivered = {
                    let mut state = inner.lock();
                    let open = state.ended.is_none() || state.reading_out;
                    if open {
                        state.inbox.push_back(batch);
                        state.batches_received += 1;
                    }
                    open
                };
                if !delivered {
                    return read_out_close(&inner, &mut rd).await;
                }
                inner.batch_arrived();
            }
            Ok(None) => {
                eof = true;
                break EpochEnd::PeerClosed;
            }
            Err(ReadError::Io(err)) => {
                tracing::debug!(epoch = %inner.epoch, %err, "tcp link read failed");
                break end_of_io(&err);
            }
            Err(ReadError::TooLarge { len, max }) => {
                break EpochEnd::Violation(ProtocolError::FrameTooLarge { len, max });
            }
        }
    };
    inner.end_seen(reason, eof);
}

/// After a read-out was cut with nobody left to deliver to, a link that
/// flushes reads and discards what the peer still sends until its EOF,
/// within the read-out's time (`read_out_until`, which a short read-out
/// moves closer once our flush is out). Linux resets a connection that receives data
/// after `shutdown(SHUT_RD)`, or is closed with data unread, and purges what
/// our flush left in the send queue. Any other link here is cut: it ended
/// without a read-out, was cut for a fault, or waited its time for the
/// peer's EOF.
async fn read_out_close<R: tokio::io::AsyncRead + Unpin>(inner: &Inner, rd: &mut R) {
    let discards = {
        let state = inner.lock();
        let expired = state
            .read_out_until
            .is_some_and(|until| until <= tokio::time::Instant::now());
        state.ended.is_some_and(flushes) && !expired && !state.cut
    };
    if !discards {
        inner.shutdown_socket();
        return;
    }
    let fallback = tokio::time::Instant::now() + FLUSH_GRACE * 2;
    let mut scratch = vec![0u8; 16 * 1024];
    loop {
        // Made before the deadline is read: a move between the two is seen.
        let moved = inner.wake_end.notified();
        tokio::pin!(moved);
        moved.as_mut().enable();
        let until = inner.lock().read_out_until.unwrap_or(fallback);
        tokio::select! {
            read = rd.read(&mut scratch) => if !matches!(read, Ok(1..)) { break },
            () = tokio::time::sleep_until(until) => break,
            () = moved => {}
        }
    }
    // A peer that never closed its side is cut, not left half-open.
    inner.shutdown_socket();
}

/// Why reading a frame failed: the socket, or the peer's framing.
enum ReadError {
    Io(io::Error),
    TooLarge { len: usize, max: usize },
}

impl From<io::Error> for ReadError {
    fn from(err: io::Error) -> Self {
        ReadError::Io(err)
    }
}

/// One framed batch; `None` on EOF at a frame boundary.
async fn read_batch<R: tokio::io::AsyncBufRead + Unpin>(
    rd: &mut R,
    max: usize,
) -> Result<Option<Vec<u8>>, ReadError> {
    if rd.fill_buf().await?.is_empty() {
        return Ok(None);
    }
    let len = rd.read_u32().await? as usize;
    if len > max {
        return Err(ReadError::TooLarge { len, max });
    }
    let mut batch = vec![0u8; len];
    rd.read_exact(&mut batch).await?;
    Ok(Some(batch))
}

/// Resolves once the reader must stop delivering: the epoch ended, and for
/// a link reading out, once its time to read out has passed or the
/// read-out was cut.
async fn until_cut(inner: &Inner) {
    loop {
        let notified = inner.wake_end.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (ended, read_out_until) = {
            let state = inner.lock();
            let until = state.read_out_until.filter(|_| state.reading_out);
            (state.ended.is_some(), until)
        };
        match (ended, read_out_until) {
            (false, _) => notified.await,
            (true, None) => return,
            (true, Some(deadline)) => tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(deadline) => return,
            },
        }
    }
}

async fn write_loop(inner: Arc<Inner>) {
    loop {
        let notified = inner.writer.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (work, ended) = {
            let mut state = inner.lock();
            // Whether to flush: an end that flushes, or a replaced link
            // reading out, whose peer reads it out too.
            let ended = state
                .ended
                .map(|reason| !state.cut && (flushes(reason) || state.reading_out));
            let n = state.queue.len().min(WRITE_BATCHES);
            let work: Vec<Queued> = match ended {
                Some(false) => Vec::new(),
                Some(true) | None => state.queue.drain(..n).collect(),
            };
            state.writer_busy = !work.is_empty();
            (work, ended)
        };
        if work.is_empty() {
            if let Some(flushes) = ended {
                if flushes {
                    // Flushed: send our FIN and let the reader take the
                    // peer's last bytes (`read_out_close`).
                    inner.shutdown(Shutdown::Write);
                    inner.flushed();
                    return;
                }
                break;
            }
            notified.await;
            continue;
        }
        let written = tokio::select! {
            written = write_batches(&inner.wr, &work) => written,
            () = ended_then_grace(&inner) => Err(io::ErrorKind::TimedOut.into()),
        };
        let mut state = inner.lock();
        state.writer_busy = false;
        if written.is_ok() {
            state.batches_sent += work.len() as u64;
        }
        state.free.extend(work.into_iter().map(|q| q.buf));
        drop(state);
        inner.wake_send.notify_waiters();
        if let Err(err) = written {
            tracing::debug!(epoch = %inner.epoch, %err, "tcp link write failed");
            inner.end(end_of_io(&err));
            break;
        }
    }
    inner.shutdown_socket();
}

/// Resolves `FLUSH_GRACE` (a short read-out's: `UNBUDGETED_FLUSH_GRACE`)
/// after the epoch ended: a graceful close may flush
/// that long into a peer that stopped reading (a zero window, which
/// `TCP_USER_TIMEOUT` does not cover), then the socket is cut.
async fn ended_then_grace(inner: &Inner) {
    loop {
        let notified = inner.wake_end.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if inner.lock().ended.is_some() {
            break;
        }
        notified.await;
    }
    let grace = if inner.lock().short_read_out {
        UNBUDGETED_FLUSH_GRACE
    } else {
        FLUSH_GRACE
    };
    tokio::time::sleep(grace).await;
}

/// The unwritten rest of each batch's frame (`len|batch`), as slices.
fn frame_slices<'a>(work: &'a [Queued], headers: &'a [[u8; 4]]) -> Vec<IoSlice<'a>> {
    let mut slices = Vec::with_capacity(work.len() * 2);
    for (q, header) in work.iter().zip(headers) {
        let body = &q.buf[..q.len];
        if q.written < header.len() {
            slices.push(IoSlice::new(&header[q.written..]));
            slices.push(IoSlice::new(body));
        } else {
            slices.push(IoSlice::new(&body[q.written - header.len()..]));
        }
    }
    slices
}

/// Writes what is left of every batch with as few `writev`s as the kernel allows.
async fn write_batches(wr: &OwnedWriteHalf, work: &[Queued]) -> io::Result<()> {
    let headers: Vec<[u8; 4]> = work.iter().map(|q| (q.len as u32).to_be_bytes()).collect();
    let mut slices = frame_slices(work, &headers);
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        wr.writable().await?;
        match wr.try_write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// Writes one batch's frame without waiting; how many bytes went out
/// (fewer than the frame on a full socket, or one tokio has not yet seen
/// writable).
fn write_now(wr: &OwnedWriteHalf, q: &Queued) -> io::Result<usize> {
    let headers = [(q.len as u32).to_be_bytes()];
    let mut slices = frame_slices(std::slice::from_ref(q), &headers);
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    let mut written = 0;
    while !rest.is_empty() {
        match wr.try_write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                written += n;
                IoSlice::advance_slices(&mut rest, n);
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => break,
            Err(err) if written == 0 => return Err(err),
            // Some bytes left: the writer meets the error and ends the epoch.
            Err(_) => break,
        }
    }
    Ok(written)
}

/// A send buffer holding one link credit (a free buffer of the pool).
#[derive(Debug)]
pub struct TcpSendBuf {
    data: Option<Vec<u8>>,
    inner: Arc<Inner>,
}

impl Deref for TcpSendBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.data.as_deref().unwrap_or(&[])
    }
}

impl DerefMut for TcpSendBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.data.as_deref_mut().unwrap_or(&mut [])
    }
}

impl Drop for TcpSendBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.data.take() {
            self.inner.lock().free.push(buf);
            self.inner.wake_send.notify_waiters();
        }
    }
}

/// A received batch; it owns its bytes. Dropping it lets the reader read on.
#[derive(Debug)]
pub struct TcpBatch {
    data: Vec<u8>,
    inner: Arc<Inner>,
}

impl Deref for TcpBatch {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for TcpBatch {
    fn drop(&mut self) {
        let mut state = self.inner.lock();
        state.held = state.held.saturating_sub(1);
        // Only a stalled reader is woken: waking one that sits in `read`
        // costs the consumer's task its turn (and, on tokio, a worker's
        // futex wake-up) on every batch.
        let stalled = std::mem::take(&mut state.reader_stalled);
        drop(state);
        if stalled {
            self.inner.reader.notify_one();
        }
    }
}

impl Link for TcpLink {
    type SendBuf = TcpSendBuf;
    type Batch = TcpBatch;
    const RELEASE_POSTS: bool = false;
    const TRY_RESERVE: bool = true;
    const TRY_RECV: bool = true;

    fn epoch(&self) -> Epoch {
        self.inner().epoch
    }

    fn max_batch(&self) -> usize {
        self.inner().send_max
    }

    async fn reserve(&self) -> Result<TcpSendBuf, LinkError> {
        let inner = self.inner();
        // The first look registers no waiter; a miss registers, then looks again.
        let mut armed = false;
        loop {
            let notified = inner.wake_send.notified();
            tokio::pin!(notified);
            if armed {
                notified.as_mut().enable();
            }
            {
                let mut state = inner.lock();
                if let Some(err) = inner.ended_error(&state) {
                    return Err(err);
                }
                if let Some(buf) = state.free.pop() {
                    return Ok(TcpSendBuf {
                        data: Some(buf),
                        inner: inner.clone(),
                    });
                }
            }
            if std::mem::replace(&mut armed, true) {
                notified.await;
            }
        }
    }

    fn try_reserve(&self) -> Option<Result<TcpSendBuf, LinkError>> {
        let inner = self.inner();
        let mut state = inner.lock();
        if let Some(err) = inner.ended_error(&state) {
            return Some(Err(err));
        }
        let buf = state.free.pop()?;
        Some(Ok(TcpSendBuf {
            data: Some(buf),
            inner: inner.clone(),
        }))
    }

    fn post(&self, mut buf: TcpSendBuf, len: usize) -> Result<(), LinkError> {
        let inner = self.inner();
        let max = inner.send_max;
        if len > max {
            return Err(LinkError::BatchTooLarge { len, max });
        }
        let mut state = inner.lock();
        if let Some(err) = inner.ended_error(&state) {
            return Err(err);
        }
        let mut queued = Queued {
            buf: buf.data.take().expect("a send buffer is posted once"),
            len,
            written: 0,
        };
        if !state.writer_busy && state.queue.is_empty() {
            // Nothing ahead of this batch: write it from here, under the lock
            // that keeps the writer from starting meanwhile (docs/design.md §
            // "Wake only a waiter, and let the receiver run first").
            match write_now(&inner.wr, &queued) {
                Ok(n) if n == len + 4 => {
                    state.batches_sent += 1;
                    state.free.push(queued.buf);
                    drop(state);
                    inner.wake_send.notify_waiters();
                    return Ok(());
                }
                Ok(n) => queued.written = n,
                // Not a byte left: the batch is not posted (its messages
                // stay the sender's to report), and the epoch ends.
                Err(err) => {
                    state.free.push(queued.buf);
                    drop(state);
                    tracing::debug!(epoch = %inner.epoch, %err, "tcp link write failed");
                    inner.end(end_of_io(&err));
                    return Err(inner.ended_error(&inner.lock()).expect("ended just now"));
                }
            }
        }
        state.queue.push_back(queued);
        drop(state);
        inner.writer.notify_one();
        Ok(())
    }

    fn post_last(&self, buf: TcpSendBuf, len: usize) -> Result<(), LinkError> {
        // The stream's own close orders it after every earlier byte.
        self.post(buf, len)
    }

    async fn recv(&self) -> Result<TcpBatch, LinkError> {
        let inner = self.inner();
        let mut armed = false;
        loop {
            let notified = inner.wake_recv.notified();
            tokio::pin!(notified);
            if armed {
                notified.as_mut().enable();
            }
            {
                let mut state = inner.lock();
                if let Some(data) = state.inbox.pop_front() {
                    state.held += 1;
                    state.handed_out += 1;
                    return Ok(TcpBatch {
                        data,
                        inner: inner.clone(),
                    });
                }
                let reading_out = state.reading_out && !state.reader_done;
                if let Some(err) = inner.ended_error(&state).filter(|_| !reading_out) {
                    return Err(err);
                }
            }
            if std::mem::replace(&mut armed, true) {
                notified.await;
            }
        }
    }

    fn try_recv(&self, handled: u64) -> Option<TcpBatch> {
        let inner = self.inner();
        let mut state = inner.lock();
        if state.ended.is_some() || state.handed_out != handled {
            return None;
        }
        let data = state.inbox.pop_front()?;
        state.held += 1;
        state.handed_out += 1;
        Some(TcpBatch {
            data,
            inner: inner.clone(),
        })
    }

    fn set_arrivals(&self, arrivals: Weak<dyn Arrivals>) {
        let _ = self.inner().arrivals.set(arrivals);
    }

    fn fail(&self, reason: EpochEnd) {
        self.inner().end(reason);
    }

    async fn ended(&self) -> EpochEnd {
        let inner = self.inner();
        loop {
            let notified = inner.wake_end.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(reason) = inner.lock().ended {
                return reason;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use tokio::net::TcpListener;

    use super::*;

    async fn pair() -> (TcpLink, TcpLink) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (dialed, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let config = TcpLinkConfig::default();
        let max = config.max_batch;
        let a = TcpLink::new(dialed.expect("connect"), Vec::new(), Epoch(1), &config, max);
        let b = TcpLink::new(
            accepted.expect("accept").0,
            Vec::new(),
            Epoch(1),
            &config,
            max,
        );
        (a.expect("link a"), b.expect("link b"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_reader_ends_the_epoch_on_both_ends() {
        let (a, b) = pair().await;
        a.inner().panic_on_read.store(true, Ordering::Relaxed);
        let mut buf = b.reserve().await.expect("reserve");
        buf[..4].copy_from_slice(b"ping");
        b.post(buf, 4).expect("post");
        let bound = Duration::from_secs(10);
        let ended = tokio::time::timeout(bound, a.ended()).await;
        assert_eq!(
            ended,
            Ok(EpochEnd::Internal),
            "the reader's panic ends its epoch"
        );
        let recv = tokio::time::timeout(bound, a.recv()).await;
        assert!(matches!(
            recv,
            Ok(Err(LinkError::Ended {
                reason: EpochEnd::Internal,
                ..
            }))
        ));
        let theirs = tokio::time::timeout(bound, b.ended()).await;
        assert!(
            matches!(theirs, Ok(EpochEnd::PeerClosed | EpochEnd::PeerLost)),
            "the socket was shut, so the peer hears: {theirs:?}"
        );
    }

    /// A stream that ends inside a frame is the peer gone mid-write, not a
    /// fault of ours (review 48c).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_ending_inside_a_frame_is_the_peer_lost() {
        use tokio::io::AsyncWriteExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (dialed, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let config = TcpLinkConfig::default();
        let link = TcpLink::new(
            dialed.expect("connect"),
            Vec::new(),
            Epoch(1),
            &config,
            config.max_batch,
        )
        .expect("link");
        let mut raw = accepted.expect("accept").0;
        // A 100-byte frame's length, ten of its bytes, then the FIN.
        raw.write_all(&100u32.to_be_bytes()).await.expect("write");
        raw.write_all(&[7; 10]).await.expect("write");
        raw.shutdown().await.expect("fin");
        let ended = tokio::time::timeout(Duration::from_secs(10), link.ended()).await;
        assert_eq!(ended, Ok(EpochEnd::PeerLost));
    }
}
