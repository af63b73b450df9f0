//! The per-queue I/O path: the worker loop and (later) its pure policies.

pub mod worker;
