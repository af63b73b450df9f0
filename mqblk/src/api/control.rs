//! What the management API asks of the running daemon. The daemon implements [`Control`]; the
//! JSON-RPC server ([`super::rpc`]) only turns requests into these calls and their results
//! into replies.

use crate::config::{ExportConfig, QosConfig};

use super::ExportStatus;

/// Why a management request failed. The message names the problem; the code is its JSON-RPC
/// error code.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A parameter is missing or wrong (its name is in the message).
    #[error("{0}")]
    InvalidParams(String),
    /// No export has this id.
    #[error("no export has id={0}")]
    NoSuchExport(String),
    /// The id or the socket is taken by another export.
    #[error("{0}")]
    Conflict(String),
    /// The export is in use (a frontend is connected) and the request would disturb it.
    #[error("{0}")]
    Busy(String),
    /// The request was valid but could not be carried out (storage, socket, threads).
    #[error("{0}")]
    Failed(String),
}

impl ControlError {
    /// The JSON-RPC error code: -32602 for invalid parameters, server errors otherwise.
    pub fn code(&self) -> i64 {
        match self {
            ControlError::InvalidParams(_) => -32602,
            ControlError::NoSuchExport(_) => -32001,
            ControlError::Conflict(_) => -32002,
            ControlError::Busy(_) => -32003,
            ControlError::Failed(_) => -32004,
        }
    }
}

/// How to remove an export that may have a frontend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveMode {
    /// Refuse while a frontend is connected.
    Safe,
    /// Drain the connected frontend's in-flight I/O, then disconnect it.
    Hard,
}

/// The running daemon, as the management API sees it.
pub trait Control: Send + Sync {
    /// Starts a new export.
    fn add(&self, cfg: ExportConfig) -> Result<ExportStatus, ControlError>;
    /// Stops and removes an export; its socket file goes too.
    fn remove(&self, id: &str, mode: RemoveMode) -> Result<(), ControlError>;
    /// Every export, in the order they were added.
    fn list(&self) -> Vec<ExportStatus>;
    /// One export's settings and status.
    fn get(&self, id: &str) -> Result<(ExportConfig, ExportStatus), ControlError>;
    /// Resizes an export to `size` bytes, or to what its backing store now holds, and tells its
    /// frontend.
    fn resize(&self, id: &str, size: Option<u64>) -> Result<ExportStatus, ControlError>;
    /// Replaces an export's QoS settings while it runs (all limits given; none given lifts
    /// them); returns the QoS now in force.
    fn set_qos(&self, id: &str, qos: QosConfig) -> Result<QosConfig, ControlError>;
    /// Takes an external snapshot of a qcow2 export while it runs: its queues quiesce (what
    /// is in flight completes, nothing new starts), a new overlay at `overlay` over the
    /// current image becomes the image written, and the queues resume. The old image is
    /// read-only and consistent from then on.
    fn snapshot(&self, id: &str, overlay: &std::path::Path) -> Result<ExportStatus, ControlError>;
    /// Every export's settings, in the order they were added.
    fn configs(&self) -> Vec<ExportConfig>;
    /// Asks the daemon to drain every export and exit.
    fn shutdown(&self);
    /// Makes I/O thread `thread` of export `id` suffer `fault` (tests of fault containment and
    /// the sandbox; debug builds only).
    #[cfg(debug_assertions)]
    fn inject_fault(
        &self,
        id: &str,
        thread: usize,
        fault: crate::io::fault_injection::Fault,
    ) -> Result<(), ControlError>;
}
