//! The vhost-user side: what a frontend (QEMU, Cloud Hypervisor, libblkio) negotiates and sets
//! up, and the virtio-blk device it drives.
//!
//! - [`device`]: the export's device: configuration space and I/O threads, which outlive
//!   connections;
//! - [`session`]: one connection, the vhost-user request handler;
//! - [`disk_wait`]: rings whose start waits until the disk can be taken up;
//! - [`memory`]: the shared guest memory table; [`vring`]: a vring being set up;
//! - [`features`]: what is offered;
//! - [`backend_channel`]: telling the frontend about a config change (online resize);
//! - [`migration`]: the dirty log and what is logged while the frontend migrates the VM;
//! - [`error`]: why a message is refused;
//! - `test_hooks`: a panic a test can have a debug build's session make.

pub mod backend_channel;
pub mod device;
pub mod disk_wait;
pub mod error;
pub mod features;
pub mod memory;
pub mod migration;
pub mod session;
mod test_hooks;
pub mod vring;

pub use device::Device;
pub use error::Error;
pub use session::Session;
