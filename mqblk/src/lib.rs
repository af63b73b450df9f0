//! mqblk: a multi-queue vhost-user-blk backend.
//!
//! A VMM or libblkio program connects to an export's unix socket and shares guest memory;
//! mqblk serves the guest's virtqueues straight from that memory to host storage, one I/O
//! thread (with its own io_uring) per queue or group of queues, with no lock shared between
//! them on the request path.
//!
//! The layers, each depending only on those listed after it:
//! - [`daemon`]: exports, sockets, signals, the stats file;
//! - [`frontend`]: the vhost-user session and the virtio-blk device;
//! - [`io`]: the I/O threads and the request path;
//! - [`engine`]: storage engines (io_uring on a file or block device, RAM, null);
//! - [`blk`]: virtio-blk request parsing and the configuration space (pure);
//! - [`config`]: export settings and the one table of export keys.
//!
//! docs/ARCHITECTURE.md walks a request through these files.

#![warn(missing_docs)]

pub mod blk;
pub mod config;
pub mod daemon;
pub mod engine;
pub mod frontend;
pub mod io;
