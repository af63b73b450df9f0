//! The daemon: starts every export and the management API, waits for SIGINT or SIGTERM (or the
//! API's `shutdown`), drains, exits.
//!
//! - [`exports`]: the running exports by id, which the management API drives;
//! - [`export`]: one export's lifecycle (storage, device, socket, resize);
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
pub mod exports;
pub mod listener;
pub mod qos;
pub mod signals;
pub mod stats;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use error::Error;
pub use export::Export;
pub use exports::Exports;

use crate::api::rpc::ApiServer;
use crate::config::ExportConfig;

/// How `mqblk serve` runs, besides its exports.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Rewrite this file with the exports' counters every [`stats::INTERVAL`], and at exit.
    pub stats_file: Option<PathBuf>,
    /// Serve the management API (JSON-RPC) on this unix socket.
    pub api_socket: Option<PathBuf>,
}

/// How often the main thread looks at the API's shutdown request between signals.
const TICK: Duration = Duration::from_millis(100);

/// Runs `mqblk serve`: starts every export (and the management API), waits for SIGINT or
/// SIGTERM or the API's `shutdown`, drains, returns.
pub fn serve(exports: Vec<ExportConfig>, opts: ServeOptions) -> Result<(), Error> {
    signals::block().map_err(Error::Signals)?;
    let running = Arc::new(Exports::default());
    for cfg in exports {
        if let Err(e) = running.start(cfg) {
            running.stop_all();
            return Err(e);
        }
    }
    let api = match &opts.api_socket {
        Some(path) => match ApiServer::start(path, running.clone()) {
            Ok(a) => Some(a),
            Err(err) => {
                running.stop_all();
                return Err(Error::ApiSocket {
                    path: path.clone(),
                    err,
                });
            }
        },
        None => None,
    };
    // The I/O threads only publish their counters; this thread reads and writes them.
    let why = loop {
        if let Some(path) = &opts.stats_file {
            running.each(|e| stats::write(e, path));
        }
        if let Some(sig) = signals::wait(Some(TICK)) {
            break format!("signal {sig}");
        }
        if running.shutdown_requested() {
            break "the management API asked".to_string();
        }
    };
    if let Some(path) = &opts.stats_file {
        running.each(|e| stats::write(e, path));
    }
    tracing::info!(why, "shutting down: draining in-flight I/O");
    if let Some(api) = api {
        api.stop();
    }
    running.stop_all();
    tracing::info!("all exports drained; exiting");
    Ok(())
}
