//! Hand-driven soft devices for the fuzz targets (`fuzz/`) and their
//! regression tests: no UDP task and no simulator, the caller moves
//! datagrams and time itself. Not a stable API.
//!
//! ```text
//!  caller ─ handle_datagram(now, src, bytes) ─► DeviceCore ─► QP engines ─► CQs
//!  caller ─ handle_timeout(now) ─────────────►
//!  caller ◄ poll_transmit(now, buf) ◄─────────
//! ```

use super::device::DeviceCore;
use super::{Instant, SoftDevice};
use crate::verbs::{Gid, Mtu};

/// A datagram [`poll_transmit`] wrote into the caller's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Datagram {
    /// Destination GID.
    pub dst: Gid,
    /// Destination UDP port.
    pub dst_port: u16,
    /// Bytes written at the start of the buffer.
    pub len: usize,
}

/// A device no driver runs; verbs calls on it work as usual.
pub fn device(gid: Gid, udp_port: u16, active_mtu: Mtu, seed: u64) -> SoftDevice {
    SoftDevice::from_core(DeviceCore::new(gid, udp_port, active_mtu, seed))
}

/// An untrusted datagram from `src`:`src_port` arrives at `now`.
pub fn handle_datagram(dev: &SoftDevice, now: Instant, src: Gid, src_port: u16, bytes: &[u8]) {
    dev.shared()
        .core()
        .handle_datagram(now, src, src_port, bytes);
}

/// Fires every timer due at `now`.
pub fn handle_timeout(dev: &SoftDevice, now: Instant) {
    dev.shared().core().handle_timeout(now);
}

/// The earliest armed timer.
pub fn poll_timeout(dev: &SoftDevice) -> Option<Instant> {
    dev.shared().core().poll_timeout()
}

/// The next datagram any QP has to send; `buf` must hold the path MTU plus
/// [`super::wire::MAX_OVERHEAD`] bytes.
pub fn poll_transmit(dev: &SoftDevice, now: Instant, buf: &mut [u8]) -> Option<Datagram> {
    dev.shared()
        .core()
        .poll_transmit(now, buf)
        .map(|t| Datagram {
            dst: t.dst,
            dst_port: t.dst_port,
            len: t.len,
        })
}
