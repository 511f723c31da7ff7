//! One peer's connection.
