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

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use error::Error;
pub use export::Export;
pub use exports::Exports;

use crate::api::rpc::ApiServer;
use crate::api::{systemd, Metrics};
use crate::config::ExportConfig;
use crate::engine::qcow2::table_budget;
use crate::sandbox::{self, SandboxOptions};

/// How `mqblk serve` runs, besides its exports.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    /// Rewrite this file with the exports' counters every [`stats::INTERVAL`], and at exit.
    pub stats_file: Option<PathBuf>,
    /// Serve the management API (JSON-RPC) on this unix socket.
    pub api_socket: Option<PathBuf>,
    /// Serve the Prometheus metrics over HTTP on this address.
    pub metrics: Option<SocketAddr>,
    /// What the qcow2 exports' tables may take together (`--table-memory-total`; `None`:
    /// [`table_budget::default_total`]).
    pub table_memory_total: Option<u64>,
    /// How the daemon confines itself.
    pub sandbox: SandboxOptions,
    /// `--state-dir` (`None`: [`state_dir`](crate::config::state_dir)'s default).
    pub state_dir: Option<PathBuf>,
}

/// How often the main thread looks at the management API's shutdown request.
const TICK: Duration = Duration::from_millis(100);

/// Runs `mqblk serve`: starts every export, the management API and the metrics, waits for
/// SIGINT or SIGTERM or the API's `shutdown`, drains, returns.
///
/// Under systemd it says READY=1 once every export listens, STOPPING=1 when it starts to
/// drain, and WATCHDOG=1 at half the unit's `WatchdogSec=` while every export is healthy;
/// exports take the sockets socket activation hands over (see [`systemd`]).
pub fn serve(exports: Vec<ExportConfig>, opts: &ServeOptions) -> Result<(), Error> {
    signals::block().map_err(Error::Signals)?;
    table_budget::set_total(
        opts.table_memory_total
            .unwrap_or_else(table_budget::default_total),
    );
    let named = systemd::listen_fds().map_err(Error::SocketActivation)?;
    let activation = systemd::assign(&exports, &named);
    for (fd, name, why) in &activation.unused {
        tracing::warn!(fd, name = %name, "socket-activated descriptor left unused: {why}");
    }
    // Before the first thread (the metrics server starts one): see `sandbox`.
    let needs = sandbox::Needs {
        exports: &exports,
        api_socket: opts.api_socket.as_deref(),
        stats_file: opts.stats_file.as_deref(),
        tcp_server: opts.metrics.is_some(),
    };
    // The boot id, which qcow2 journals record, is read before the sandbox closes /proc.
    crate::engine::qcow2::mapping_journal::prepare();
    crate::config::state_dir::set(opts.state_dir.clone());
    make_journal_directory(&exports, opts);
    sandbox::enter(&opts.sandbox, &needs)?;
    // Bound before the exports start, so that a busy port fails the start at once.
    let mut metrics = match opts.metrics {
        Some(addr) => Some(Metrics::bind(addr).map_err(|err| Error::Metrics { addr, err })?),
        None => None,
    };
    let running = Arc::new(Exports::default());
    let started = start_all(&running, exports, activation.fds).and_then(|()| {
        if let Some(m) = &mut metrics {
            let exports = running.clone();
            m.start(move || exports.statuses())
                .map_err(|err| Error::Thread {
                    what: "metrics thread",
                    err,
                })?;
            tracing::info!(addr = %m.local_addr(), "serving metrics at /metrics");
        }
        opts.api_socket
            .as_ref()
            .map(|path| {
                ApiServer::start(path, running.clone()).map_err(|err| Error::ApiSocket {
                    path: path.clone(),
                    err,
                })
            })
            .transpose()
    });
    let api = match started {
        Ok(api) => api,
        Err(e) => {
            if let Some(m) = metrics {
                m.stop();
            }
            running.stop_all();
            return Err(e);
        }
    };
    systemd::notify_ready(&format!("serving {} export(s)", running.statuses().len()));

    let why = wait_for_stop(&running, opts);
    tracing::info!(why, "shutting down: draining in-flight I/O");
    systemd::notify_stopping();
    if let Some(api) = api {
        api.stop();
    }
    // The metrics thread reads the exports: it goes first.
    if let Some(m) = metrics {
        m.stop();
    }
    if let Some(path) = &opts.stats_file {
        stats::write(path, &running.each(stats::render));
    }
    running.stop_all();
    tracing::info!("all exports drained; exiting");
    Ok(())
}

/// Makes the directory of the qcow2 metadata journals (in the state directory) for the sandbox
/// to grant (and to make the daemon's user's own in), where a startup export may keep a journal
/// or the API may add one that does. A failure is left for the exports' opens:
/// `metadata-commit=auto` then does without a journal, `journal` fails.
fn make_journal_directory(exports: &[ExportConfig], opts: &ServeOptions) {
    let startup = exports.iter().any(ExportConfig::may_keep_qcow2_journal);
    if !startup && opts.api_socket.is_none() {
        return;
    }
    if let Err(err) = crate::config::state_dir::make_qcow2_journals_root() {
        let dir = crate::config::state_dir::qcow2_journals_root();
        if startup {
            tracing::warn!(
                dir = %dir.display(),
                %err,
                "cannot make the directory of the qcow2 metadata journals (give mqblk serve a \
                 --state-dir it can write)"
            );
        } else {
            tracing::debug!(
                dir = %dir.display(),
                %err,
                "cannot make the directory of the qcow2 metadata journals"
            );
        }
    }
}

/// Starts the exports given at startup, each on its socket-activated descriptor if it has one.
fn start_all(
    running: &Exports,
    exports: Vec<ExportConfig>,
    fds: Vec<Option<RawFd>>,
) -> Result<(), Error> {
    for (cfg, fd) in exports.into_iter().zip(fds) {
        running.start_activated(cfg, fd)?;
    }
    Ok(())
}

/// Waits for SIGINT, SIGTERM or the API's `shutdown`, meanwhile rewriting the stats file and
/// pinging systemd's watchdog while every export is healthy; returns why it stopped.
fn wait_for_stop(running: &Exports, opts: &ServeOptions) -> String {
    let watchdog = systemd::watchdog_interval();
    let stats = opts.stats_file.as_ref().map(|p| (p, stats::INTERVAL));
    let mut shared_fs = stats::SharedFilesystemCheck::default();
    let mut next_stats = Instant::now();
    let mut next_ping = Instant::now();
    let mut unhealthy_logged = false;
    loop {
        let now = Instant::now();
        if let Some((path, every)) = stats {
            if now >= next_stats {
                // Rendered under the registry's lock, written (a file system's time) after.
                let (text, images) = running.each(|e| (stats::render(e), shared_fs.new_images(e)));
                stats::SharedFilesystemCheck::warn_if_shared(&images, path);
                stats::write(path, &text);
                next_stats = now + every;
            }
        }
        if let Some(every) = watchdog {
            if now >= next_ping {
                // A dead I/O thread or listener leaves its export unserved: stop pinging so
                // that systemd restarts the daemon.
                match running.unhealthy() {
                    None => systemd::notify_watchdog(),
                    Some(id) if !unhealthy_logged => {
                        unhealthy_logged = true;
                        tracing::error!(
                            export = %id,
                            "an I/O thread or listener of this export has stopped: no more \
                             watchdog pings"
                        );
                    }
                    Some(_) => {}
                }
                next_ping = now + every;
            }
        }
        if running.shutdown_requested() {
            return "the management API asked".into();
        }
        let deadlines = [
            stats.map(|_| next_stats),
            watchdog.map(|_| next_ping),
            Some(now + TICK),
        ];
        let timeout = deadlines.iter().flatten().min().map(|&d| {
            d.saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        });
        if let Some(sig) = signals::wait(timeout) {
            return format!("signal {sig}");
        }
    }
}
