//! What operators and their tools talk to: the export status the management API and the
//! metrics report.
//!
//! This layer sits below `daemon`: it defines what it needs from the running daemon (a status
//! snapshot, and for the management API a trait the daemon implements), so that the daemon
//! composes it without a dependency cycle.

pub mod status;

pub use status::ExportStatus;
