//! qpmux — many logical streams ("slots") to one peer over one reliable
//! connected RDMA queue pair.
//!
//! ```text
//!  velo/   velo_ext::Transport + FrameTransport adapters
//!    │
//!  mux/    typed surface (Frame, MuxTransport, AsMux), wire protocol,
//!    │     per-peer batcher, ingress, slot credit, epochs
//!    │     ── talks to the wire only through the `Link` seam ──
//!  link/   one peer's connection: rdma (RC QP), tcp (baseline), mem (tests)
//!    │     ── talks to RDMA only through the verbs seam ──
//!  verbs/  provider seam: soft (userspace RoCEv2 over UDP), ibv (libibverbs)
//! ```
//!
//! Dependencies point down only: `mux` never names a verbs type and `verbs`
//! never names a slot. Design rulings live in `docs/design.md`.
#![deny(missing_docs)]
#![deny(unsafe_code)]

pub mod cli;
pub mod demo;
mod later;
pub mod link;
pub mod mux;
pub mod stages;
mod unwind;
#[cfg(feature = "velo")]
pub mod velo;
pub mod verbs;
mod warn_gate;
