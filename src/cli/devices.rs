//! `qpmux devices`: what `ibv_devices` and `ibv_devinfo` show, per provider.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::Serialize;

use crate::verbs::soft::SoftDevice;
use crate::verbs::soft::udp::UdpConfig;
use crate::verbs::{Device, list_devices};

#[derive(Debug, Serialize)]
struct DeviceReport {
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
        let port = device.query_port();
        reports.push(DeviceReport {
            name: info.name.to_string(),
            provider: format!("{:?}", info.provider),
            port: 1,
            active_mtu: port.active_mtu.bytes(),
            udp_port: port.udp_port,
            max_qp_wr: port.max_qp_wr,
            max_sge: port.max_sge,
            max_inline_data: port.max_inline_data,
            max_cqe: port.max_cqe,
            gids: port
                .gid_table
                .iter()
                .map(|gid| Ipv6Addr::from(gid.0).to_string())
                .collect(),
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
        return Ok(());
    }
    for r in &reports {
        println!("device {} (provider {})", r.name, r.provider);
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
    Ok(())
}
