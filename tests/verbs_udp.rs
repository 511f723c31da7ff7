//! The provider-generic verbs suite over the soft provider's UDP driver on
//! loopback (127.0.0.1, ephemeral ports), plus a tshark decode check.

#[macro_use]
mod verbs_suite;

use std::time::Duration;

use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use verbs_suite::{BulkPlan, Harness};

/// Failsafe for one wait: far above any expected time, only there so a
/// broken build fails instead of hanging CI.
const FAILSAFE: Duration = Duration::from_secs(60);

struct UdpHarness;

impl Harness for UdpHarness {
    type Dev = SoftDevice;

    async fn devices(&mut self) -> (SoftDevice, SoftDevice) {
        let a = SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("open a");
        let b = SoftDevice::open_udp(UdpConfig::default())
            .await
            .expect("open b");
        (a, b)
    }

    async fn wait_until(&mut self, mut done: impl FnMut() -> bool) -> bool {
        let give_up = tokio::time::Instant::now() + FAILSAFE;
        loop {
            if done() {
                return true;
            }
            if tokio::time::Instant::now() > give_up {
                return false;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }

    fn rnr_naks_sent(dev: &SoftDevice) -> Option<u64> {
        Some(dev.counters().rnr_naks_sent)
    }

    fn bulk_plan(&self) -> BulkPlan {
        if cfg!(debug_assertions) {
            BulkPlan {
                count: 10_000,
                max_size: 256 << 10,
                big_every: 1000,
                small_max: 2048,
            }
        } else {
            BulkPlan {
                count: 10_000,
                max_size: 1 << 20,
                big_every: 250,
                small_max: 8192,
            }
        }
    }
}

verbs_suite!(UdpHarness);
