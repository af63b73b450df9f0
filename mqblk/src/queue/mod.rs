//! The per-queue I/O path: the worker loop and (later) its pure policies.

pub mod batch;
pub mod merge;
pub mod poll;
pub mod worker;
