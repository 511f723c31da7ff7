//! The provider-generic RDMA link suite (`tests/link_suite/`) on the soft
//! provider over loopback UDP. `tests/link_ibv.rs` runs the same properties
//! on libibverbs (kernel rxe in the QEMU guest).

#[macro_use]
mod link_suite;

use link_suite::LinkHarness;
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;

struct SoftHarness;

impl LinkHarness for SoftHarness {
    type Dev = SoftDevice;

    async fn device(&mut self) -> SoftDevice {
        SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("soft device on loopback")
    }

    fn rnr_naks(devices: &[SoftDevice]) -> Option<u64> {
        Some(devices.iter().map(|d| d.counters().rnr_naks_sent).sum())
    }

    fn handler_calls(devices: &[SoftDevice]) -> Option<u64> {
        Some(devices.iter().map(|d| d.stats().cq_handler_calls).sum())
    }

    fn stream_slots(&self) -> u64 {
        200
    }
}

link_suite!(SoftHarness);
