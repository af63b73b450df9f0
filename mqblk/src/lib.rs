//! mqblk: a multi-queue vhost-user-blk backend.
//!
//! A VMM or libblkio program connects to an export's unix socket and shares guest memory;
//! mqblk serves the guest's virtqueues straight from that memory to host storage, one I/O
//! thread (with its own io_uring) per queue or group of queues, with no lock shared between
//! them on the request path. See `DESIGN.md` in the shared folder and the README.

#![warn(missing_docs)]

pub mod blk;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod queue;
pub mod vhost;
