//! What operators and their tools talk to: the management API (JSON-RPC over a unix socket)
//! and the export status it and the metrics report.
//!
//! This layer sits below `daemon`: it defines what it needs from the running daemon (a status
//! snapshot, and for the management API a trait the daemon implements), so that the daemon
//! composes it without a dependency cycle.

pub mod control;
pub mod rpc;
pub mod status;

pub use control::{Control, ControlError, RemoveMode};
pub use status::ExportStatus;
