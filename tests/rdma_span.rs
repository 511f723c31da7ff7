//! The `rdma_link` span, alone in its process: tracing caches a callsite's
//! interest globally, and a test on another thread that met the callsite
//! first, with no subscriber, could leave this test's scoped subscriber
//! unasked (it failed 4 of 50 runs beside the other link tests).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use qpmux::link::rdma::{RdmaConfig, pair};
use qpmux::mux::Epoch;
use qpmux::verbs::soft::SoftDevice;
use qpmux::verbs::soft::udp::UdpConfig;
use tracing::Subscriber;
use tracing::field::Field;
use tracing::span::{Attributes, Id};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

fn small() -> RdmaConfig {
    RdmaConfig {
        recv_depth: 16,
        max_batch: 16 * 1024,
        send_buffers: 8,
        ..RdmaConfig::strict()
    }
}

async fn device() -> SoftDevice {
    SoftDevice::open_udp(UdpConfig::default())
        .await
        .expect("soft device on loopback")
}

/// Records each new span as "name field=value ...".
#[derive(Clone, Default)]
struct SpanLog(Arc<Mutex<Vec<String>>>);

impl<S: Subscriber> Layer<S> for SpanLog {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        let mut line = attrs.metadata().name().to_owned();
        attrs.record(&mut |field: &Field, value: &dyn std::fmt::Debug| {
            let _ = write!(line, " {}={:?}", field.name(), value);
        });
        self.0.lock().expect("span log").push(line);
    }
}

#[test]
fn each_link_runs_in_a_span_naming_its_epoch_and_both_qpns() {
    let log = SpanLog::default();
    let subscriber = tracing_subscriber::registry().with(log.clone());
    let (qpn_a, qpn_b) = tracing::subscriber::with_default(subscriber, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (da, db) = (device().await, device().await);
            let (a, b) = pair(&da, &db, Epoch(3), small()).expect("pair");
            (a.address().qpn.value(), b.address().qpn.value())
        })
    });
    let spans = log.0.lock().expect("span log").clone();
    for (me, peer) in [(qpn_a, qpn_b), (qpn_b, qpn_a)] {
        let want = format!("rdma_link epoch=e3 qpn={me} peer_qpn={peer}");
        assert!(spans.contains(&want), "{want} not in {spans:?}");
    }
}
