//! Completion queues with a completion channel driven by tokio `AsyncFd`, and
//! the device's async-event task.
//!
//! Notification order (the one that loses no completion): arm
//! ([`CompletionQueue::req_notify`]), poll until empty, then await
//! [`CompletionQueue::notified`]. A completion that lands between the last
//! poll and the await already fired the armed channel, so the await returns.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::Poll;

use rdma_mummy_sys::{ibv_comp_channel, ibv_cq, ibv_wc};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue as _};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::qp::QpShared;
use super::{AsyncEvent, DevInner};
use crate::verbs::{CompletionQueue, Qpn, VerbsError, WcOpcode, WcStatus, WorkCompletion};

/// `IBV_WC_WITH_IMM`.
const WC_WITH_IMM: u32 = 1 << 1;
/// `IBV_WC_RECV`: receive opcodes have this bit.
const WC_RECV: u32 = 1 << 7;
/// Posted `wr_id`s: bit 63 set for receive WRs, the rest is a per-queue sequence.
pub(crate) const RECV_BIT: u64 = 1 << 63;

/// A completion queue with its own completion channel.
///
/// # Safety
///
/// Lifetime invariants (the raw `ibv_cq` and `ibv_comp_channel` handles used
/// here are borrowed from the sideway objects this struct owns):
/// - the QPs using this CQ hold an `Arc` of the sideway CQ, so the CQ is
///   destroyed after its last QP;
/// - every CQ event taken with `ibv_get_cq_event` is acknowledged at once,
///   so `ibv_destroy_cq` never waits for unacknowledged events.
///
/// Destroy order, by field order of the shared `CqInner`:
/// 1. the `AsyncFd` deregisters the channel fd from the reactor;
/// 2. the sideway CQ is destroyed (`ibv_destroy_cq`) once no QP holds it;
/// 3. the channel (`ibv_destroy_comp_channel`), which the CQ also holds.
pub struct IbvCq {
    pub(crate) inner: Arc<CqInner>,
}

/// Borrowed fd of the completion channel, for `AsyncFd`.
struct ChannelFd(RawFd);

impl AsRawFd for ChannelFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

pub(crate) struct CqInner {
    afd: OnceLock<Result<AsyncFd<ChannelFd>, std::io::ErrorKind>>,
    pub(crate) cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    /// QPs posting to this CQ, by QPN: completions are translated through them.
    pub(crate) qps: Mutex<HashMap<u32, Weak<QpShared>>>,
    events_acked: AtomicU32,
    /// A poll failed: every later poll fails too. A provider consumes the
    /// entry it failed on (mlx5), so the next `ibv_poll_cq` would succeed
    /// past a completion nobody saw (review 48g).
    failed: AtomicBool,
    depth: usize,
}

impl IbvCq {
    pub(crate) fn new(dev: &Arc<DevInner>, depth: usize) -> Result<IbvCq, VerbsError> {
        let channel = dev
            .ctx
            .create_comp_channel()
            .map_err(|e| super::io_err("ibv_create_comp_channel", &e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| super::io_err("set completion channel nonblocking", &e))?;
        let cq = dev
            .ctx
            .create_cq_builder()
            .setup_cqe(depth.max(1) as u32)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| super::io_err("ibv_create_cq", &e))?;
        Ok(IbvCq {
            inner: Arc::new(CqInner {
                afd: OnceLock::new(),
                cq,
                channel,
                qps: Mutex::new(HashMap::new()),
                events_acked: AtomicU32::new(0),
                failed: AtomicBool::new(false),
                depth,
            }),
        })
    }

    /// Depth asked for at creation.
    pub fn depth(&self) -> usize {
        self.inner.depth
    }

    /// CQ events taken from the channel (and acknowledged) so far.
    pub fn events(&self) -> u32 {
        self.inner.events_acked.load(Ordering::Relaxed)
    }

    fn raw_cq(&self) -> NonNull<ibv_cq> {
        // SAFETY: only the pointer is copied; `self.inner.cq` keeps the CQ alive
        // for as long as `self` is borrowed.
        unsafe { self.inner.cq.cq() }
    }

    fn raw_channel(&self) -> NonNull<ibv_comp_channel> {
        // SAFETY: only the pointer is copied; `self.inner.channel` keeps it alive.
        unsafe { self.inner.channel.comp_channel() }
    }

    /// Take one CQ event from the (nonblocking) channel and acknowledge it.
    fn try_take_event(&self) -> bool {
        let mut cq: *mut ibv_cq = ptr::null_mut();
        let mut ctx: *mut std::ffi::c_void = ptr::null_mut();
        // SAFETY: the channel is alive (held by self) and its fd is nonblocking,
        // so this returns -1/EAGAIN instead of blocking when no event is queued;
        // `cq` and `ctx` are valid out-pointers.
        let rc = unsafe {
            rdma_mummy_sys::ibv_get_cq_event(self.raw_channel().as_ptr(), &mut cq, &mut ctx)
        };
        if rc != 0 {
            return false;
        }
        // SAFETY: `cq` is the CQ the event was for: this channel serves only
        // our CQ, which is alive; one event taken, one acknowledged.
        unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
        self.inner.events_acked.fetch_add(1, Ordering::Relaxed);
        true
    }

    fn async_fd(&self) -> Result<&AsyncFd<ChannelFd>, std::io::ErrorKind> {
        self.inner
            .afd
            .get_or_init(|| {
                let fd = self.inner.channel.as_raw_fd();
                if tokio::runtime::Handle::try_current().is_err() {
                    return Err(std::io::ErrorKind::Unsupported);
                }
                // SAFETY: the fd belongs to `self.inner.channel`, which is
                // destroyed only after this AsyncFd (field order of CqInner).
                unsafe { AsyncFd::register_with_interest(ChannelFd(fd), Interest::READABLE) }
                    .map_err(|e| std::io::Error::from(e).kind())
            })
            .as_ref()
            .map_err(|k| *k)
    }

    fn translate(
        &self,
        raw: &ibv_wc,
        qps: &HashMap<u32, Weak<QpShared>>,
    ) -> Option<WorkCompletion> {
        let qp = qps.get(&raw.qp_num).and_then(Weak::upgrade)?;
        let recv = raw.wr_id & RECV_BIT != 0;
        let seq = raw.wr_id & !RECV_BIT;
        let wr_id = if recv {
            qp.rq.lock().expect("rq lock").complete(seq)?
        } else {
            qp.sq.lock().expect("sq lock").complete(seq)?
        };
        let status = map_status(raw.status);
        if status != WcStatus::Success && trace_errors() {
            eprintln!(
                "qpmux ibv: qp {:#x} {} wr seq {}: ibv_wc_status {} vendor_err {:#x} opcode {}",
                raw.qp_num,
                if recv { "recv" } else { "send" },
                seq,
                raw.status,
                raw.vendor_err,
                raw.opcode
            );
        }
        let ok = status == WcStatus::Success;
        let opcode = if recv { WcOpcode::Recv } else { WcOpcode::Send };
        debug_assert!(!ok || recv == (raw.opcode & WC_RECV != 0));
        let imm = (ok && recv && raw.wc_flags & WC_WITH_IMM != 0).then(|| {
            // SAFETY: with IBV_WC_WITH_IMM set, the union holds the immediate
            // (network byte order); both members are plain u32.
            u32::from_be(unsafe { raw.imm_data_invalidated_rkey_union.imm_data })
        });
        Some(WorkCompletion {
            wr_id,
            status,
            opcode,
            byte_len: if ok { raw.byte_len } else { 0 },
            imm,
            qp_num: Qpn::new(raw.qp_num),
        })
    }
}

/// `QPMUX_IBV_TRACE=1`: print every error completion's raw status to stderr.
fn trace_errors() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("QPMUX_IBV_TRACE").is_ok_and(|v| v == "1"))
}

/// `ibv_wc_status` to the seam's subset; the rest are logged and reported as
/// the nearest local or remote error.
fn map_status(s: u32) -> WcStatus {
    match s {
        0 => WcStatus::Success,
        1 => WcStatus::LocLenErr,
        2 => WcStatus::LocQpOpErr,
        4 | 8 => WcStatus::LocProtErr, // LOC_PROT_ERR, LOC_ACCESS_ERR
        5 => WcStatus::WrFlushErr,
        9 => WcStatus::RemInvReqErr,
        10 => WcStatus::RemAccessErr,
        11 => WcStatus::RemOpErr,
        12 => WcStatus::RetryExcErr,
        13 => WcStatus::RnrRetryExcErr,
        other => {
            tracing::warn!(
                "ibv_wc_status {other} has no seam equivalent; reported as LOC_QP_OP_ERR"
            );
            WcStatus::LocQpOpErr
        }
    }
}

impl CompletionQueue for IbvCq {
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        let mut n = 0;
        // SAFETY: ibv_wc is plain old data (integers and a union of integers);
        // all-zero is a valid value.
        let mut raw: [ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        // Held across the poll and the translation: a completion polled
        // here retires every earlier one of its queue (`Ring::complete`),
        // so two threads translating out of poll order would lose one.
        let qps = self
            .inner
            .qps
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.inner.failed.load(Ordering::Relaxed) {
            return Err(VerbsError::CqOverrun);
        }
        while n < out.len() {
            let want = (out.len() - n).min(BATCH);
            // SAFETY: the CQ is alive (held by self); `raw` has room for `want`
            // entries and the provider writes at most that many.
            let got = unsafe {
                rdma_mummy_sys::ibv_poll_cq(self.raw_cq().as_ptr(), want as i32, raw.as_mut_ptr())
            };
            if got < 0 {
                self.inner.failed.store(true, Ordering::Relaxed);
                if n > 0 {
                    // Those already translated are retired from their rings:
                    // hand them out; the next poll reports the failure.
                    break;
                }
                return Err(VerbsError::CqOverrun);
            }
            if got == 0 {
                break;
            }
            for wc in &raw[..got as usize] {
                // Completions of destroyed QPs (or already-reset queues) are dropped.
                if let Some(wc) = self.translate(wc, &qps) {
                    out[n] = wc;
                    n += 1;
                }
            }
            if (got as usize) < want {
                break;
            }
        }
        Ok(n)
    }

    fn req_notify(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is alive (held by self); solicited_only = 0.
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.raw_cq().as_ptr(), 0) };
        if rc != 0 {
            return Err(VerbsError::Io {
                op: "ibv_req_notify_cq",
                kind: std::io::Error::from_raw_os_error(rc).kind(),
            });
        }
        Ok(())
    }

    fn notified(&self) -> impl Future<Output = ()> + Send {
        std::future::poll_fn(move |cx| {
            loop {
                if self.try_take_event() {
                    return Poll::Ready(());
                }
                let afd = match self.async_fd() {
                    Ok(a) => a,
                    Err(kind) => {
                        // No reactor (outside tokio) or fd registration failed:
                        // resolve spuriously; callers poll the CQ anyway.
                        tracing::warn!("completion channel cannot be awaited: {kind:?}");
                        return Poll::Ready(());
                    }
                };
                match afd.poll_read_ready(cx) {
                    Poll::Ready(Ok(mut guard)) => {
                        if self.try_take_event() {
                            return Poll::Ready(());
                        }
                        guard.clear_ready();
                    }
                    Poll::Ready(Err(e)) => {
                        tracing::warn!("completion channel: {e}");
                        return Poll::Ready(());
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
    }

    fn set_handler(&self, _handler: std::sync::Weak<dyn crate::verbs::CompletionHandler>) -> bool {
        // libibverbs reports completions through the channel fd only.
        false
    }
}

/// Borrowed fd of the device's async-event queue.
struct EventFd(RawFd);

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Start the async-event task when a tokio runtime is current. It holds a
/// weak reference to the device and stops when told to or when the device is
/// gone; it holds the context `Arc` so the fd outlives its registration.
pub(crate) fn spawn_async_events(dev: &Arc<DevInner>) {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return;
    };
    // SAFETY: only the pointer is copied; `dev.ctx` keeps the context alive.
    let raw = unsafe { dev.ctx.context() };
    // SAFETY: the context is alive; async_fd is a plain int field set at open.
    let fd = unsafe { raw.as_ref().async_fd };
    // SAFETY: fcntl on an fd this context owns; only O_NONBLOCK is added.
    let nonblock = unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) == 0
    };
    if !nonblock {
        tracing::warn!("{}: async events not reported (fcntl failed)", dev.name);
        return;
    }
    let _guard = handle.enter();
    // SAFETY: the fd belongs to the context, whose Arc the task below holds
    // and drops only after dropping this AsyncFd.
    let Ok(afd) = (unsafe { AsyncFd::register_with_interest(EventFd(fd), Interest::READABLE) })
    else {
        tracing::warn!(
            "{}: async events not reported (fd registration failed)",
            dev.name
        );
        return;
    };
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    *dev.stop_events.lock().expect("stop lock") = Some(tx);
    let weak = Arc::downgrade(dev);
    let watch = EventWatch {
        afd,
        ctx: Arc::clone(&dev.ctx),
    };
    let name = dev.name.clone();
    handle.spawn(async move {
        // A peer can err a QP once an epoch: those go to WARN once a second.
        let mut qp_errors = crate::warn_gate::WarnGate::default();
        loop {
            tokio::select! {
                _ = &mut rx => break,
                ready = watch.afd.readable() => {
                    let Ok(mut guard) = ready else { break };
                    while let Some(event) = watch.next_event() {
                        let warn = match event {
                            AsyncEvent::QpFatal { .. } => {
                                qp_errors.admit(tokio::time::Instant::now())
                            }
                            _ => Some(0),
                        };
                        match warn {
                            Some(0) => tracing::warn!("{name}: async event {event:?}"),
                            Some(quiet) => tracing::warn!(
                                "{name}: async event {event:?} ({quiet} QP errors before it logged at debug)"
                            ),
                            None => tracing::debug!("{name}: async event {event:?}"),
                        }
                        if let Some(dev) = weak.upgrade() {
                            dev.events.lock().expect("events lock").push(event);
                        }
                    }
                    // Drained to EAGAIN: wait for the next edge.
                    guard.clear_ready();
                }
            }
        }
    });
}

/// The async-event fd under the reactor, and the context that owns the fd.
///
/// Destroy order (field order):
/// 1. `afd` deregisters the fd from the reactor;
/// 2. `ctx` drops its reference; the context (and its fd) closes with the last one.
struct EventWatch {
    afd: AsyncFd<EventFd>,
    ctx: Arc<sideway::ibverbs::device_context::DeviceContext>,
}

impl EventWatch {
    /// Take and acknowledge one queued async event, `None` when none is queued.
    fn next_event(&self) -> Option<AsyncEvent> {
        // SAFETY: ibv_async_event is plain data (a union of pointers/ints and
        // an enum); all-zero is valid and the call overwrites it.
        let mut ev: rdma_mummy_sys::ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: the context is alive (`self.ctx`); its async fd is
        // nonblocking, so this returns -1 instead of blocking when empty.
        let rc =
            unsafe { rdma_mummy_sys::ibv_get_async_event(self.ctx.context().as_ptr(), &mut ev) };
        if rc != 0 {
            return None;
        }
        let event = decode_event(&ev);
        // SAFETY: `ev` was filled by ibv_get_async_event above and is
        // acknowledged exactly once, after decoding.
        unsafe { rdma_mummy_sys::ibv_ack_async_event(&mut ev) };
        Some(event)
    }
}

fn decode_event(ev: &rdma_mummy_sys::ibv_async_event) -> AsyncEvent {
    let t = ev.event_type as u32;
    match t {
        0 => AsyncEvent::CqError,
        1..=3 => {
            // SAFETY: for QP events the element is the QP pointer, valid until
            // the event is acknowledged (which happens after this call).
            let qpn = unsafe { ev.element.qp.as_ref().map_or(0, |q| q.qp_num) };
            AsyncEvent::QpFatal {
                qpn: Qpn::new(qpn),
                event: t,
            }
        }
        8 => AsyncEvent::DeviceFatal,
        // SAFETY (three arms): for port events the element is the port number.
        9 => AsyncEvent::PortActive { port: port_of(ev) },
        10 => AsyncEvent::PortError { port: port_of(ev) },
        18 => AsyncEvent::GidChange { port: port_of(ev) },
        other => AsyncEvent::Other { event: other },
    }
}

fn port_of(ev: &rdma_mummy_sys::ibv_async_event) -> u8 {
    // SAFETY: called only for port events, whose element is the port number (an int).
    unsafe { ev.element.port_num as u8 }
}
