//! What operators and their tools talk to: the management API (JSON-RPC over a unix socket),
//! the export status it and the metrics report, the metrics endpoint, and systemd's
//! notifications and socket activation.
//!
//! This layer sits below `daemon`: it defines what it needs from the running daemon (a status
//! snapshot, handed over as a function; for the management API a trait the daemon
//! implements), so that the daemon composes it without a dependency cycle.
//!
//! - [`control`]: what the management API asks of the daemon;
//! - [`rpc`]: the JSON-RPC server on `--api-socket`;
//! - [`socket`]: clearing a stale socket path before binding it (here and for exports);
//! - [`status`]: one export's snapshot;
//! - [`metrics`]: `--metrics ADDR:PORT`, the Prometheus text format over HTTP;
//! - [`systemd`]: `sd_notify` (ready, stopping, watchdog) and socket activation.

pub mod control;
pub mod metrics;
pub mod rpc;
pub mod socket;
pub mod status;
pub mod systemd;

pub use control::{Control, ControlError, RemoveMode};
pub use metrics::Metrics;
pub use status::ExportStatus;
