//! The daemon: starts every export, waits for SIGINT or SIGTERM, drains, exits.
//!
//! - [`export`]: one export's lifecycle (storage, device, socket);
//! - [`listener`]: the accept loop and the per-connection message loop;
//! - [`qos`]: which QoS buckets each export uses, and the throttle groups;
//! - [`signals`]: blocking and waiting for the stop signals;
//! - [`stats`]: the `--stats-file` JSON;
//! - [`error`]: why something could not start.
//!
//! A frontend that disconnects leaves the socket accepting the next one; the export's I/O
//! threads outlive connections.

pub mod error;
pub mod export;
pub mod listener;
pub mod qos;
pub mod signals;
pub mod stats;

use std::path::PathBuf;

pub use error::Error;
pub use export::Export;

use crate::config::ExportConfig;

/// Runs `mqblk serve`: starts every export, waits for a signal, drains, returns.
///
/// With `stats_file`, the main thread also rewrites that file with the exports' counters
/// every [`stats::INTERVAL`] while serving, and once more after the signal.
pub fn serve(exports: Vec<ExportConfig>, stats_file: Option<PathBuf>) -> Result<(), Error> {
    signals::block().map_err(Error::Signals)?;
    let mut running = Vec::new();
    for cfg in exports {
        match Export::start(cfg) {
            Ok(e) => running.push(e),
            Err(e) => {
                for r in running {
                    r.shutdown();
                }
                return Err(e);
            }
        }
    }
    let sig = match &stats_file {
        None => signals::wait(None),
        Some(path) => loop {
            // The I/O threads only publish their counters; this thread reads and writes them.
            stats::write(&running, path);
            if let Some(sig) = signals::wait(Some(stats::INTERVAL)) {
                break Some(sig);
            }
        },
    };
    if let Some(path) = &stats_file {
        stats::write(&running, path);
    }
    tracing::info!(signal = sig, "shutting down: draining in-flight I/O");
    for r in running {
        r.shutdown();
    }
    tracing::info!("all exports drained; exiting");
    Ok(())
}
