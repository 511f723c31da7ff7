//! Which libibverbs device the ibverbs test binaries run on, or why they skip.
//!
//! `QPMUX_IBV=0` skips; `QPMUX_IBV_DEVICE` names the device (default: the
//! first); `QPMUX_IBV_REQUIRE=1` turns a skip into a failure (the rxe guest).

use qpmux::verbs::ibv::{IbvConfig, IbvDevice};

/// The device config for `suite`, or `None` after printing why it skips.
pub fn config_or_skip(suite: &str) -> Option<IbvConfig> {
    if std::env::var("QPMUX_IBV").is_ok_and(|v| v == "0") {
        eprintln!("skipping {suite}: QPMUX_IBV=0");
        return None;
    }
    let cfg = IbvConfig {
        device: std::env::var("QPMUX_IBV_DEVICE").ok(),
        ..IbvConfig::default()
    };
    match IbvDevice::open(cfg.clone()) {
        Ok(_) => Some(cfg),
        Err(e) => {
            let strict = std::env::var("QPMUX_IBV_REQUIRE").is_ok_and(|v| v == "1");
            assert!(!strict, "QPMUX_IBV_REQUIRE=1 but: {e}");
            eprintln!("skipping {suite}: {e}");
            None
        }
    }
}
