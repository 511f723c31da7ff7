//! The latency stages (`qpmux::stages`) on the RDMA path over the soft
//! provider: every point of a record's path is marked, in path order. Its
//! own test binary, because the marks are process-wide.

use std::time::Duration;

use qpmux::demo::{self, Workload};
use qpmux::link::Node;
use qpmux::link::rdma::{RdmaNodeConfig, RdmaTransport};
use qpmux::mux::PeerId;
use qpmux::stages;
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;

async fn node(id: u64) -> RdmaTransport<SoftDevice> {
    let device = SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback");
    RdmaTransport::start(device, RdmaNodeConfig::new(PeerId(id)))
        .await
        .expect("node")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stage_of_a_paced_record_is_marked_in_path_order() {
    let (a, b) = (node(1).await, node(2).await);
    b.register(&a.address()).expect("register");
    let paced = Workload::new(1, 200, 64, Some(Duration::from_millis(1)));

    let unmarked = demo::run_nodes(&a, &b, 1, paced).await.expect("run");
    assert!(unmarked.stages.is_none(), "no offsets while stages are off");

    stages::set_enabled(true);
    let report = demo::run_nodes(&a, &b, 2, paced).await.expect("run");
    stages::set_enabled(false);
    let at = report.stages.expect("offsets while stages are on");
    let [woken, encoded, posted, received, decoding, delivered] =
        at.map(|stage| stage.expect("every stage is on the RDMA path"));
    // Sender's side, one task: in order. Receiver's side, one chain: in
    // order. `received` may precede `posted` (the other worker can take
    // the datagram while `post` returns), never `encoded`.
    assert!(woken <= encoded && encoded <= posted, "{at:?}");
    assert!(encoded <= received, "{at:?}");
    assert!(received <= decoding && decoding <= delivered, "{at:?}");
    a.shutdown();
    b.shutdown();
}
