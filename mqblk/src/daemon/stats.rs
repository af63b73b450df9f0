//! `mqblk serve --stats-file`: the exports' counters as JSON, rewritten atomically.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::export::Export;
use crate::config::write_atomically;
use crate::engine::qcow2::MetadataCounters;
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
    /// For a qcow2 export, what its metadata path has done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<MetadataCounters>,
}

/// The stats file: `{"exports": [...]}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsFile {
    /// Every export.
    pub exports: Vec<ExportStats>,
}

/// The stats of `running`.
pub fn collect(running: &[Arc<Export>]) -> StatsFile {
    StatsFile {
        exports: running
            .iter()
            .map(|e| ExportStats {
                id: e.device().config().id.clone(),
                socket: e.socket().to_path_buf(),
                threads: e.device().threads().len(),
                counters: e.device().counters(),
                metadata: e.device().engine().metadata_counters(),
            })
            .collect(),
    }
}

/// The stats of `running`, as the stats file holds them.
pub fn render(running: &[Arc<Export>]) -> String {
    serde_json::to_string(&collect(running)).expect("stats serialise")
}

/// Writes `text` (from [`render`]) to `path`; a reader never sees half a file.
pub fn write(path: &Path, text: &str) {
    if let Err(e) = write_atomically(path, text) {
        tracing::warn!(path = %path.display(), err = %e, "cannot write the stats file");
    }
}

/// Warns, once per export, when the stats file lies on the same filesystem as the export's
/// image file. Each rewrite (create, write, rename) is a metadata transaction of that
/// filesystem's journal, and an O_DIRECT write to the image updates the file's mtime, which
/// waits for the journal's commit (docs/PERFORMANCE.md 1a measures what that costs). A tmpfs
/// (`/run`) has no journal.
#[derive(Default)]
pub struct SharedFilesystemCheck {
    checked: HashSet<String>,
}

impl SharedFilesystemCheck {
    /// The image files of the exports of `running` not seen before, by export id.
    pub fn new_images(&mut self, running: &[Arc<Export>]) -> Vec<(String, PathBuf)> {
        running
            .iter()
            .map(|e| e.device().config())
            .filter(|cfg| self.checked.insert(cfg.id.clone()))
            .filter_map(|cfg| Some((cfg.id.clone(), cfg.path.clone()?)))
            .collect()
    }

    /// Warns for each of `images` (from [`SharedFilesystemCheck::new_images`]) that lies on the
    /// stats file `path`'s filesystem.
    pub fn warn_if_shared(images: &[(String, PathBuf)], path: &Path) {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        for (id, image) in images {
            if shares_filesystem(dir, image) {
                tracing::warn!(
                    export = %id,
                    stats_file = %path.display(),
                    image = %image.display(),
                    "the stats file is on the same filesystem as this export's image: its \
                     rewrites every 100 ms journal metadata, which stalls writes to the image; \
                     put the stats file on a tmpfs such as /run"
                );
            }
        }
    }
}

/// Whether the directory `dir` and the regular file `image` are on one filesystem.
fn shares_filesystem(dir: &Path, image: &Path) -> bool {
    match (std::fs::metadata(dir), std::fs::metadata(image)) {
        (Ok(d), Ok(i)) => i.is_file() && d.dev() == i.dev(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_shares_its_directorys_filesystem_and_not_procs() {
        let dir = std::env::temp_dir();
        let image = dir.join(format!("mqblk-stats-fs-{}", std::process::id()));
        std::fs::write(&image, b"x").unwrap();
        assert!(shares_filesystem(&dir, &image));
        assert!(!shares_filesystem(Path::new("/proc"), &image));
        // A device node or a missing path is not an image file on that filesystem.
        assert!(!shares_filesystem(
            Path::new("/dev"),
            Path::new("/dev/null")
        ));
        assert!(!shares_filesystem(&dir, &dir.join("mqblk-no-such-file")));
        std::fs::remove_file(&image).unwrap();
    }
}
