//! Provider seam (device, PD, MR, CQ, RC QP). See issue: soft provider.
