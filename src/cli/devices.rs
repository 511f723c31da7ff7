//! `qpmux devices`: what `ibv_devices` and `ibv_devinfo` show, per provider:
//! the soft device always; with `--features ibverbs`, every libibverbs device
//! (or why there is none).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::Serialize;

use crate::verbs::soft::SoftDevice;
use crate::verbs::soft::udp::UdpConfig;
use crate::verbs::{Device, PortAttr, list_devices};

#[derive(Debug, Serialize)]
struct DeviceReport {
    /// Why the device could not be opened (its port then reads as zeros).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    name: String,
    provider: String,
    port: u8,
    active_mtu: usize,
    udp_port: u16,
    max_qp_wr: usize,
    max_sge: usize,
    max_inline_data: usize,
    max_cqe: usize,
    gids: Vec<String>,
}

pub async fn run(json: bool) -> anyhow::Result<()> {
    let mut reports = Vec::new();
    for info in list_devices() {
        // The soft device binds a UDP socket to show its real port and GID.
        let config = UdpConfig {
            bind: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            ..UdpConfig::default()
        };
        let device = SoftDevice::open_udp(config).await?;
        reports.push(report(
            info.name,
            &format!("{:?}", info.provider),
            Ok(device.query_port()),
        ));
    }
    #[cfg(feature = "ibverbs")]
    ibverbs_reports(&mut reports);
    if json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(());
    }
    print_reports(&reports);
    Ok(())
}

fn report(name: &str, provider: &str, port: Result<PortAttr, String>) -> DeviceReport {
    let (port, error) = match port {
        Ok(port) => (Some(port), None),
        Err(error) => (None, Some(error)),
    };
    DeviceReport {
        error,
        name: name.to_string(),
        provider: provider.to_string(),
        port: 1,
        active_mtu: port.as_ref().map_or(0, |p| p.active_mtu.bytes()),
        udp_port: port.as_ref().map_or(0, |p| p.udp_port),
        max_qp_wr: port.as_ref().map_or(0, |p| p.max_qp_wr),
        max_sge: port.as_ref().map_or(0, |p| p.max_sge),
        max_inline_data: port.as_ref().map_or(0, |p| p.max_inline_data),
        max_cqe: port.as_ref().map_or(0, |p| p.max_cqe),
        gids: port.map_or_else(Vec::new, |p| {
            p.gid_table
                .iter()
                .map(|gid| Ipv6Addr::from(gid.0).to_string())
                .collect()
        }),
    }
}

/// Every libibverbs device, opened by name; a listing failure becomes one
/// entry naming the fix.
#[cfg(feature = "ibverbs")]
fn ibverbs_reports(reports: &mut Vec<DeviceReport>) {
    use crate::verbs::ibv::{self, IbvConfig, IbvDevice};
    match ibv::list_devices() {
        Ok(devices) => {
            for info in devices {
                let cfg = IbvConfig {
                    device: Some(info.name.clone()),
                    ..IbvConfig::default()
                };
                let port = IbvDevice::open(cfg)
                    .map(|d| d.query_port())
                    .map_err(|e| e.to_string());
                reports.push(report(&info.name, "Ibverbs", port));
            }
        }
        Err(e) => reports.push(report("-", "Ibverbs", Err(e.to_string()))),
    }
}

fn print_reports(reports: &[DeviceReport]) {
    for r in reports {
        println!("device {} (provider {})", r.name, r.provider);
        if let Some(error) = &r.error {
            println!("  unavailable: {error}");
            continue;
        }
        println!(
            "  port {}: active_mtu {}  RoCEv2 over UDP port {}",
            r.port, r.active_mtu, r.udp_port
        );
        println!(
            "  max_qp_wr {}  max_sge {}  max_inline_data {}  max_cqe {}",
            r.max_qp_wr, r.max_sge, r.max_inline_data, r.max_cqe
        );
        for (index, gid) in r.gids.iter().enumerate() {
            println!("  GID[{index}] {gid}");
        }
    }
}
