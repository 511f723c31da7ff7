//! The slot mux.
