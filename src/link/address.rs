//! The address blob a node publishes: who it is and where it listens.
//!
//! ```text
//!  version u8 (1) | node id u64 | port u16 | family u8 (4 | 6) | ip (4 | 16 bytes)
//! ```
//!
//! Shared by the TCP and RDMA nodes (both bootstrap over TCP). Parsing is
//! strict: a blob of the wrong length or version is `Malformed`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::RegisterError;
use crate::mux::PeerId;

const VERSION: u8 = 1;

/// Encodes a node's id and listening address.
pub fn encode(id: PeerId, addr: SocketAddr) -> Vec<u8> {
    let mut out = Vec::with_capacity(28);
    out.push(VERSION);
    out.extend_from_slice(&id.0.to_be_bytes());
    out.extend_from_slice(&addr.port().to_be_bytes());
    match addr.ip() {
        IpAddr::V4(ip) => {
            out.push(4);
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(6);
            out.extend_from_slice(&ip.octets());
        }
    }
    out
}

/// Decodes what [`encode`] wrote.
pub fn decode(blob: &[u8]) -> Result<(PeerId, SocketAddr), RegisterError> {
    let malformed = RegisterError::Malformed { len: blob.len() };
    let (&version, rest) = blob.split_first().ok_or(malformed.clone())?;
    if version != VERSION || rest.len() < 11 {
        return Err(malformed);
    }
    let id = PeerId(u64::from_be_bytes(rest[..8].try_into().expect("8 bytes")));
    let port = u16::from_be_bytes([rest[8], rest[9]]);
    let ip = match (rest[10], &rest[11..]) {
        (4, octets) if octets.len() == 4 => {
            IpAddr::V4(Ipv4Addr::new(octets[0], octets[1], octets[2], octets[3]))
        }
        (6, octets) if octets.len() == 16 => {
            let octets: [u8; 16] = octets.try_into().expect("16 bytes");
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return Err(malformed),
    };
    Ok((id, SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_v4_and_v6() {
        for addr in ["127.0.0.1:4000", "[::1]:65535"] {
            let addr: SocketAddr = addr.parse().expect("literal");
            let blob = encode(PeerId(77), addr);
            assert_eq!(decode(&blob), Ok((PeerId(77), addr)));
        }
    }

    #[test]
    fn every_truncation_and_bad_version_is_malformed() {
        let blob = encode(PeerId(1), "10.0.0.1:1".parse().expect("literal"));
        for cut in 0..blob.len() {
            assert!(decode(&blob[..cut]).is_err());
        }
        let mut bad = blob.clone();
        bad[0] = 2;
        assert!(decode(&bad).is_err());
        let mut long = blob;
        long.push(0);
        assert!(decode(&long).is_err());
    }
}
