//! The daemon: starts every export, waits for SIGINT or SIGTERM, drains, exits.
//!
//! - [`export`]: one export's lifecycle (storage, device, socket);
//! - [`listener`]: the accept loop and the per-connection message loop;
//! - [`signals`]: blocking and waiting for the stop signals;
//! - [`stats`]: the `--stats-file` JSON;
//! - [`error`]: why something could not start.
//!
//! A frontend that disconnects leaves the socket accepting the next one; the export's I/O
//! threads outlive connections.

pub mod error;
pub mod export;
pub mod listener;
pub mod signals;
pub mod stats;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use error::Error;
pub use export::Export;

use crate::api::{systemd, Metrics};
use crate::config::ExportConfig;

/// How `mqblk serve` runs, besides its exports.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Rewrite this file with the exports' counters every [`stats::INTERVAL`], and at exit.
    pub stats_file: Option<PathBuf>,
    /// Serve the Prometheus metrics over HTTP on this address.
    pub metrics: Option<SocketAddr>,
}

/// Runs `mqblk serve`: starts every export, waits for a signal, drains, returns.
///
/// Under systemd it says READY=1 once every export listens, STOPPING=1 when it starts to
/// drain, and WATCHDOG=1 at half the unit's `WatchdogSec=` while every export is healthy;
/// exports take the sockets socket activation hands over (see [`systemd`]).
pub fn serve(exports: Vec<ExportConfig>, opts: &ServeOptions) -> Result<(), Error> {
    signals::block().map_err(Error::Signals)?;
    let named = systemd::listen_fds().map_err(Error::SocketActivation)?;
    let activation = systemd::assign(&exports, &named);
    for (fd, name, why) in &activation.unused {
        tracing::warn!(fd, name = %name, "socket-activated descriptor left unused: {why}");
    }
    // Bound before the exports start, so that a busy port fails the start at once.
    let mut metrics = match opts.metrics {
        Some(addr) => Some(Metrics::bind(addr).map_err(|err| Error::Metrics { addr, err })?),
        None => None,
    };
    let mut running = Vec::new();
    for (cfg, fd) in exports.into_iter().zip(activation.fds) {
        match Export::start_activated(cfg, fd) {
            Ok(e) => running.push(e),
            Err(e) => {
                for r in running {
                    r.shutdown();
                }
                return Err(e);
            }
        }
    }
    if let Some(m) = &mut metrics {
        let probes: Vec<_> = running.iter().map(Export::status_fn).collect();
        m.start(move || probes.iter().map(|p| p()).collect())
            .map_err(|err| Error::Thread {
                what: "metrics thread",
                err,
            })?;
        tracing::info!(addr = %m.local_addr(), "serving metrics at /metrics");
    }
    systemd::notify_ready(&format!("serving {} export(s)", running.len()));

    let sig = wait_for_signal(&running, opts);
    tracing::info!(signal = sig, "shutting down: draining in-flight I/O");
    systemd::notify_stopping();
    // The metrics thread holds the exports' devices: it goes first.
    if let Some(m) = metrics {
        m.stop();
    }
    if let Some(path) = &opts.stats_file {
        stats::write(&running, path);
    }
    for r in running {
        r.shutdown();
    }
    tracing::info!("all exports drained; exiting");
    Ok(())
}

/// Waits for SIGINT or SIGTERM, meanwhile rewriting the stats file and pinging the systemd
/// watchdog, each on its own period. The I/O threads only publish their counters; this thread
/// reads and writes them.
fn wait_for_signal(running: &[Export], opts: &ServeOptions) -> i32 {
    let watchdog = systemd::watchdog_interval();
    let stats = opts.stats_file.as_ref().map(|p| (p, stats::INTERVAL));
    let mut next_stats = Instant::now();
    let mut next_ping = Instant::now();
    let mut unhealthy_logged = false;
    loop {
        let now = Instant::now();
        if let Some((path, every)) = stats {
            if now >= next_stats {
                stats::write(running, path);
                next_stats = now + every;
            }
        }
        if let Some(every) = watchdog {
            if now >= next_ping {
                // A dead I/O thread or listener leaves its export unserved: stop pinging so
                // that systemd restarts the daemon.
                match running.iter().find(|e| !e.is_healthy()) {
                    None => systemd::notify_watchdog(),
                    Some(e) if !unhealthy_logged => {
                        unhealthy_logged = true;
                        tracing::error!(
                            export = %e.device().config().id,
                            "an I/O thread or listener of this export has stopped: no more \
                             watchdog pings"
                        );
                    }
                    Some(_) => {}
                }
                next_ping = now + every;
            }
        }
        let deadlines = [stats.map(|_| next_stats), watchdog.map(|_| next_ping)];
        let timeout = deadlines.iter().flatten().min().map(|&d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        if let Some(sig) = signals::wait(timeout) {
            return sig;
        }
    }
}
