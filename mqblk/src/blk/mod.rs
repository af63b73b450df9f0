//! virtio-blk: request parsing and validation, and the device's configuration space.
//! Nothing here does I/O; the parsers are fuzzed (fuzz/) and everything is unit-tested.

pub mod chain;
pub mod config_space;
pub mod guest_bytes;
pub mod request;

pub use config_space::{ConfigSpace, Geometry, CONFIG_SPACE_LEN, CONFIG_WRITEBACK_OFFSET};
pub use request::{parse, Kind, Limits, Rejected, ReqType, Request, Scratch, Segment, Status};
