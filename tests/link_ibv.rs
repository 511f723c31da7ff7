//! The provider-generic RDMA link suite (`tests/link_suite/`) over libibverbs
//! (feature `ibverbs`): the mux on RdmaLinks whose QPs live on the device
//! named by `QPMUX_IBV_DEVICE` (both ends on it, through its loopback).
//! Skips, saying why, without libibverbs or a device; the rxe harness
//! (`tests/rxe/run.sh`) runs it on kernel rxe inside a QEMU guest.
#![cfg(feature = "ibverbs")]

#[path = "common/ibv.rs"]
mod ibv_device;

#[macro_use]
mod link_suite;

use link_suite::LinkHarness;
use qpmux::verbs::ibv::{IbvConfig, IbvDevice};

struct IbvHarness {
    cfg: IbvConfig,
}

impl IbvHarness {
    /// The harness, or `None` after printing why the tests skip.
    fn new() -> Option<IbvHarness> {
        ibv_device::config_or_skip("the link suite over libibverbs").map(|cfg| IbvHarness { cfg })
    }
}

impl LinkHarness for IbvHarness {
    type Dev = IbvDevice;

    async fn device(&mut self) -> IbvDevice {
        IbvDevice::open(self.cfg.clone()).expect("open")
    }

    fn handler_calls(_devices: &[IbvDevice]) -> Option<u64> {
        // libibverbs only notifies: the poller takes every completion.
        None
    }

    fn rnr_naks(devices: &[IbvDevice]) -> Option<u64> {
        // rxe's counter is device-wide: both ends share it, and this binary's
        // tests must run one at a time for it to mean anything (the guest
        // runs them with --test-threads=1). rnr_retry = 0 fails loudly anyway.
        devices.first()?.hw_counter("send_rnr_err")
    }

    fn stream_slots(&self) -> u64 {
        // Kernel rxe under QEMU TCG moves a few MB/s.
        64
    }
}

link_suite!(match IbvHarness::new() {
    Some(h) => h,
    None => return,
});
