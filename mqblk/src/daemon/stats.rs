//! `mqblk serve --stats-file`: the exports' counters as JSON, rewritten atomically.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::export::Export;
use crate::io::IoCounters;

/// How often the stats file is rewritten.
pub const INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// One export in the stats file: its socket, its I/O threads, and their counters summed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExportStats {
    /// The export's id.
    #[serde(default)]
    pub id: String,
    /// The export's socket.
    pub socket: PathBuf,
    /// I/O threads.
    pub threads: usize,
    /// The counters, summed over the threads.
    #[serde(flatten)]
    pub counters: IoCounters,
}

/// The stats file: `{"exports": [...]}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsFile {
    /// Every export.
    pub exports: Vec<ExportStats>,
}

/// The stats of `running`.
pub fn collect(running: &[Export]) -> StatsFile {
    StatsFile {
        exports: running
            .iter()
            .map(|e| ExportStats {
                id: e.device().config().id.clone(),
                socket: e.socket().to_path_buf(),
                threads: e.device().threads().len(),
                counters: e.device().counters(),
            })
            .collect(),
    }
}

/// Writes the stats of `running` to `path` atomically (a temporary file beside it, then a
/// rename), so that a reader never sees half a file.
pub fn write(running: &[Export], path: &Path) {
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let text = serde_json::to_string(&collect(running)).expect("stats serialise");
    let r = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        tracing::warn!(path = %path.display(), err = %e, "cannot write the stats file");
    }
}
