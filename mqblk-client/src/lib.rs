//! Built-in vhost-user-blk client: connect to a vhost-user-blk socket with libblkio's
//! `virtio-blk-vhost-user` driver and run a workload or single requests against it.
//!
//! Two entry points:
//!
//! * [`run`] drives a [`Workload`]: `jobs` jobs, each with `iodepth` requests in flight on its own
//!   slice of the disk, over `num_queues` virtqueues of one connection. It is what `mqblk demo` and
//!   `mqblk bench` use, and it reports IOPS, throughput and latency percentiles ([`Report`]).
//! * [`Client`] issues one request at a time on a chosen queue and returns its status. It is what
//!   the integration tests use to probe the daemon's behaviour request by request.
//!
//! Data written by [`Pattern::Verify`] is a function of the absolute byte offset and a seed
//! ([`fill_pattern`]/[`check_pattern`]), so data that lands at the wrong offset, stale data and
//! data from another run are all detected, also when the image file is read directly on the host.
//!
//! # libblkio facts this crate relies on
//!
//! * libblkio's virtio-blk driver uses 3 descriptors per request (header, data, status; discard and
//!   write-zeroes: header, segment, status) and no indirect descriptors, so a queue of size `n`
//!   holds `n / 3` requests; more are kept on libblkio's own backlog (which allocates).
//! * Buffers must lie in memory regions mapped with [`Blkio::map_mem_region`](blkio::Blkio::map_mem_region): the backend can
//!   only access memory it was told about.
//! * If the device offers `VIRTIO_BLK_F_RO`, `start()` fails with `EROFS` unless the `read-only`
//!   property was set before `connect()`; libblkio then fails writes, discards and write-zeroes
//!   itself (`EBADF`) without sending them to the device.
//! * libblkio does not check requests against the capacity; out-of-range requests reach the
//!   device. Device status `IOERR` completes with `-EIO`, `UNSUPP` with `-ENOTSUP`, anything else
//!   with `-EPROTO`.
//!
//! # Files
//!
//! * `connect.rs`: connecting and starting ([`ConnectOptions`]), buffers, libblkio's errors;
//! * `client.rs`: [`Client`] and [`RequestError`], why one of its requests did not succeed;
//! * `data_pattern.rs`: the verify pattern ([`fill_pattern`], [`check_pattern`]);
//! * `histogram.rs`: [`LatencyHistogram`];
//! * `workload.rs`: [`Pattern`], [`Workload`], [`job_regions`];
//! * `report.rs`: [`Report`], [`JobReport`], and [`FailedRequest`], a run's first failed request;
//! * `runner/`: [`run`]: `mod.rs` connects, lays out the queues' jobs and slots and starts a
//!   thread per queue; `queue.rs` is one queue's thread (submit, wait, complete); `job.rs` one
//!   job (its next request, its phases, what it counts); `request_queue.rs` what a thread needs
//!   from either driver's queue;
//! * `frontend/`: mqblk's own vhost-user frontend ([`Driver::Frontend`]), for backends libblkio
//!   refuses (SPDK's vhost target): `mod.rs` negotiation and guest memory, `vring.rs` a split
//!   virtqueue.

mod client;
mod connect;
mod data_pattern;
mod frontend;
mod histogram;
mod report;
mod runner;
mod workload;

/// Request flags for [`Client::write_flags`] (libblkio's).
pub use blkio::ReqFlags;

pub use client::{Client, Concurrent, RequestError};
pub use connect::{ConnectOptions, DRIVER};
pub use data_pattern::{check_pattern, fill_pattern};
pub use histogram::LatencyHistogram;
pub use report::{FailedRequest, JobReport, Report};
pub use runner::run;
pub use workload::{job_regions, Driver, Pattern, Workload};
