//! A snapshot of one export, as the management API returns it and the metrics expose it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::engine::qcow2::MetadataCounters;
use crate::io::IoCounters;

/// One export, at the moment it was asked about.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExportStatus {
    /// The export's id.
    pub id: String,
    /// Its vhost-user socket (for an inherited one, the path it is bound to; empty if none).
    pub socket: PathBuf,
    /// Storage engine (`uring`, `mem`, `null`).
    pub engine: String,
    /// Capacity in bytes.
    pub capacity: u64,
    /// Virtqueues offered.
    pub queues: u16,
    /// I/O threads.
    pub threads: usize,
    /// The thread mapping (`baseline`, `mq`, `per-queue`, `grouped`).
    pub mapping: String,
    /// Read-only export.
    pub readonly: bool,
    /// A frontend is connected now.
    pub connected: bool,
    /// Frontends that have connected since the export started.
    pub connections: u64,
    /// The connected frontend's queues are set up but wait to take up the disk (another
    /// process holds a conflicting image lock, or a live server's mark is on the image); they
    /// start once it is free.
    #[serde(default)]
    pub waiting_for_disk: bool,
    /// Requests in flight at the engine now.
    pub in_flight: u64,
    /// For a qcow2 export, the bytes of the daemon's `--table-memory-total` its chain holds
    /// (what its tables could take); absent for other exports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_memory: Option<u64>,
    /// For a qcow2 export, what its metadata path has done (requests, write-backs, syncs);
    /// absent for other exports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<MetadataCounters>,
    /// Why the export failed (an I/O thread died; `export_del` and `export_add` bring it
    /// back); null while it serves.
    pub failure: Option<String>,
    /// The I/O threads' counters, summed.
    pub counters: IoCounters,
    /// Each I/O thread's counters.
    pub per_thread: Vec<IoCounters>,
}
