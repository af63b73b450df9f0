//! What the integration tests share. Each test file is its own crate and pulls this folder in
//! with `mod support;`; a test uses only part of it, hence `dead_code` is allowed here.
//!
//! - [`api`]: a client of the management API (JSON-RPC on `--api-socket`).
//! - [`ceph`]: a single-node Ceph cluster (one monitor, one memstore OSD) for the rbd tests.
//! - [`console`]: a QEMU guest's serial console, watched while the guest runs.
//! - [`daemon`]: temp dirs, disk images and data patterns, `mqblk serve` as a [`daemon::Daemon`]
//!   with its `--export` specs.
//! - [`demo_report`]: what `mqblk demo` printed, and what the disk it drove must hold.
//! - [`frontend`]: the hand-written vhost-user frontend of the hostile tests, with hand-written
//!   guest memory and rings.
//! - [`hostile`]: the daemon that the hostile tests attack, and a client that must go on being
//!   served beside them.
//! - [`mem`]: memfds and shared mappings, memory as a vhost-user frontend shares it.
//! - [`metrics`]: the `--metrics` endpoint's address (from the log) and an HTTP GET.
//! - [`mount`]: a filesystem mounted for one test (needs root, or the skip allowed).
//! - [`proc`]: child processes that are killed when dropped, and tool checks.
//! - [`qemu`]: the guest tests' kernel, initramfs, QEMU command line, work directory and console.
//! - [`qemu_img`]: `qemu-img` and its checks, the reference for qcow2 images mqblk wrote.
//! - [`qmp`]: QEMU's JSON monitor (the migration test drives QEMU through it).
//! - [`raw`]: one write bypassing libblkio's read-only check.
//! - [`rng`]: a seeded generator for randomized tests.
//! - [`skip`]: a test that cannot run here fails, unless the environment allows the skip.
//! - [`sandbox`]: the daemon's threads' confinement, as /proc shows it.
//! - [`systemd`]: a notify socket and inherited listening sockets, as systemd gives them.
//! - [`wait`]: [`wait::wait_until`], waiting for a condition with a deadline instead of a
//!   fixed sleep.
#![allow(dead_code)]

pub mod api;
pub mod ceph;
pub mod console;
pub mod daemon;
pub mod demo_report;
pub mod frontend;
pub mod hostile;
pub mod mem;
pub mod metrics;
pub mod mount;
pub mod proc;
pub mod qemu;
pub mod qemu_img;
pub mod qmp;
pub mod raw;
pub mod rng;
pub mod sandbox;
pub mod skip;
pub mod systemd;
pub mod wait;
