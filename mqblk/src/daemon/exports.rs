//! The running exports, by id: what `serve` starts and the management API adds, removes and
//! resizes. Each export is independent; adding or removing one never touches another's I/O
//! threads or connection.
//!
//! The registry's lock is held only to look exports up, never across slow work: an export's
//! start (an rbd connect may take up to its `timeout=`), a resize (it waits for the requests in
//! flight) or a drain runs with the lock released, so that listing, metrics scrapes and the
//! watchdog's health check never wait behind them.

use std::os::fd::RawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::error::Error;
use super::export::Export;
use super::qos::groups::ThrottleGroups;
use crate::api::{Control, ControlError, ExportStatus, RemoveMode};
use crate::config::{self, ConfigError, EngineKind, ExportConfig, QosConfig};

/// The daemon's exports.
#[derive(Default)]
pub struct Exports {
    running: Mutex<Running>,
    /// The throttle groups its exports share by naming them.
    groups: Arc<ThrottleGroups>,
    /// Signalled when a reservation is given up or a management request lets go of an
    /// export (see [`Exports::drain`]).
    changed: Condvar,
    /// Set by the API's `shutdown`; the main thread drains and exits.
    shutdown: AtomicBool,
}

/// The exports and whether more may start.
#[derive(Default)]
struct Running {
    /// In the order they were added. A management request that works on one holds a clone
    /// while it runs.
    exports: Vec<Arc<Export>>,
    /// The settings of exports being started or drained: their ids and sockets are taken
    /// until the start has ended or the drain has removed the socket.
    reserved: Vec<ExportConfig>,
    /// Set by [`Exports::stop_all`]: the daemon is shutting down and starts no more exports
    /// (an API client connected before the API stopped may still ask).
    closed: bool,
}

impl Exports {
    fn lock(&self) -> MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, running: MutexGuard<'a, Running>) -> MutexGuard<'a, Running> {
        self.changed
            .wait(running)
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Starts an export whose id and socket no running export has.
    pub fn start(&self, cfg: ExportConfig) -> Result<ExportStatus, Error> {
        self.start_activated(cfg, None)
    }

    /// [`Exports::start`] on a socket handed over by socket activation, if there is one.
    pub fn start_activated(
        &self,
        cfg: ExportConfig,
        activated: Option<RawFd>,
    ) -> Result<ExportStatus, Error> {
        crate::sandbox::check_export(&cfg)?;
        let reservation = {
            let mut running = self.lock();
            if running.closed {
                return Err(Error::ShuttingDown);
            }
            let taken = running.exports.iter().map(|e| e.device().config());
            if let Some(e) = taken
                .chain(&running.reserved)
                .find_map(|other| config::clash(&cfg, other))
            {
                return Err(match e {
                    ConfigError::SharedSocket(_) => Error::SocketTaken(cfg.socket),
                    ConfigError::SharedFd(fd) => Error::FdTaken(fd),
                    _ => Error::IdTaken(cfg.id),
                });
            }
            self.reserve(&mut running, cfg.clone())
        };
        let export = Export::start_activated(cfg, activated, &self.groups)?;
        let status = export.status();
        // The reservation goes in the same step as the export joins the running ones: no
        // other start can take its id or socket in between, and stop_all, which waits for
        // every reservation, drains it with the rest.
        let mut running = self.lock();
        reservation.give_up(&mut running);
        running.exports.push(Arc::new(export));
        Ok(status)
    }

    /// Removes an export, draining it; with [`RemoveMode::Safe`] only when no frontend is
    /// connected. Its id and socket stay taken until its socket is gone.
    pub fn stop(&self, id: &str, mode: RemoveMode) -> Result<(), Error> {
        let (export, reservation) = {
            let mut running = self.lock();
            let i = running
                .exports
                .iter()
                .position(|e| e.device().config().id == id)
                .ok_or_else(|| Error::NoSuchExport(id.into()))?;
            if mode == RemoveMode::Safe && running.exports[i].status().connected {
                return Err(Error::InUse(id.into()));
            }
            let export = running.exports.remove(i);
            let reservation = self.reserve(&mut running, export.device().config().clone());
            (export, reservation)
        };
        tracing::info!(id, ?mode, "removing export");
        self.drain(export);
        drop(reservation);
        Ok(())
    }

    /// Every export's status.
    pub fn statuses(&self) -> Vec<ExportStatus> {
        self.lock().exports.iter().map(|e| e.status()).collect()
    }

    /// Runs `f` on the export `id`, with the registry unlocked.
    fn with<T>(&self, id: &str, f: impl FnOnce(&Export) -> T) -> Result<T, Error> {
        let export = self
            .lock()
            .exports
            .iter()
            .find(|e| e.device().config().id == id)
            .cloned()
            .ok_or_else(|| Error::NoSuchExport(id.into()))?;
        let held = Held {
            exports: self,
            export: Some(export),
        };
        Ok(f(held.export.as_deref().expect("held until dropped")))
    }

    /// The id of an export whose listener or an I/O thread has stopped, if any.
    pub fn unhealthy(&self) -> Option<String> {
        self.lock()
            .exports
            .iter()
            .find(|e| !e.is_healthy())
            .map(|e| e.device().config().id.clone())
    }

    /// Whether the API asked the daemon to exit.
    pub fn shutdown_requested(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// Drains and removes every export, the last added first, once the exports still starting
    /// have started (they are drained too) and those being removed are gone; no export starts
    /// afterwards.
    pub fn stop_all(&self) {
        let all = {
            let mut running = self.lock();
            running.closed = true;
            while !running.reserved.is_empty() {
                running = self.wait(running);
            }
            std::mem::take(&mut running.exports)
        };
        for e in all.into_iter().rev() {
            self.drain(e);
        }
    }

    /// Runs `f` with the running exports (for the stats file: `f` only reads them).
    pub fn each<T>(&self, f: impl FnOnce(&[Arc<Export>]) -> T) -> T {
        f(&self.lock().exports)
    }

    /// Takes `cfg`'s id and socket until the returned reservation is given up or dropped.
    fn reserve(&self, running: &mut Running, cfg: ExportConfig) -> Reservation<'_> {
        let id = cfg.id.clone();
        running.reserved.push(cfg);
        Reservation {
            exports: self,
            id,
            given_up: false,
        }
    }

    /// Drains an export already taken out of the registry, once the management requests
    /// still working on it (a resize, say) are done: no new one can find it.
    fn drain(&self, mut export: Arc<Export>) {
        let mut running = self.lock();
        let export = loop {
            match Arc::try_unwrap(export) {
                Ok(e) => break e,
                Err(in_use) => {
                    export = in_use;
                    running = self.wait(running);
                }
            }
        };
        drop(running);
        export.shutdown();
    }
}

/// An export's id and socket, taken while it starts or drains. Given up when dropped,
/// however the work ended (an error or a panic included: [`Exports::stop_all`] waits for
/// every reservation).
struct Reservation<'a> {
    exports: &'a Exports,
    id: String,
    given_up: bool,
}

impl Reservation<'_> {
    /// Gives the reservation up under the registry's lock, which the caller holds.
    fn give_up(mut self, running: &mut Running) {
        running.reserved.retain(|c| c.id != self.id);
        self.exports.changed.notify_all();
        self.given_up = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.given_up {
            self.exports.lock().reserved.retain(|c| c.id != self.id);
            self.exports.changed.notify_all();
        }
    }
}

/// A management request's hold on an export. Letting go wakes a drain waiting for it, also
/// when the request panicked.
struct Held<'a> {
    exports: &'a Exports,
    export: Option<Arc<Export>>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        drop(self.export.take());
        // Under the lock: a drain between its try_unwrap and its wait cannot miss this.
        let _running = self.exports.lock();
        self.exports.changed.notify_all();
    }
}

impl From<Error> for ControlError {
    fn from(e: Error) -> Self {
        match e {
            Error::NoSuchExport(id) => ControlError::NoSuchExport(id),
            Error::IdTaken(_)
            | Error::SocketTaken(_)
            | Error::FdTaken(_)
            | Error::SocketBusy(_) => ControlError::Conflict(e.to_string()),
            Error::InUse(_) => ControlError::Busy(e.to_string()),
            Error::Qos(_) => ControlError::InvalidParams(e.to_string()),
            Error::Snapshot(crate::engine::SnapshotError::Unsupported(_)) => {
                ControlError::InvalidParams(e.to_string())
            }
            other => ControlError::Failed(other.to_string()),
        }
    }
}

impl Control for Exports {
    fn add(&self, cfg: ExportConfig) -> Result<ExportStatus, ControlError> {
        Ok(self.start(cfg)?)
    }

    fn remove(&self, id: &str, mode: RemoveMode) -> Result<(), ControlError> {
        Ok(self.stop(id, mode)?)
    }

    fn list(&self) -> Vec<ExportStatus> {
        self.statuses()
    }

    fn get(&self, id: &str) -> Result<(ExportConfig, ExportStatus), ControlError> {
        Ok(self.with(id, |e| (e.config(), e.status()))?)
    }

    fn resize(&self, id: &str, size: Option<u64>) -> Result<ExportStatus, ControlError> {
        Ok(self.with(id, |e| e.resize(size))??)
    }

    fn set_qos(&self, id: &str, qos: QosConfig) -> Result<QosConfig, ControlError> {
        Ok(self.with(id, |e| e.set_qos(qos).map(|()| e.qos()))??)
    }

    fn snapshot(&self, id: &str, overlay: &Path) -> Result<ExportStatus, ControlError> {
        Ok(self.with(id, |e| e.snapshot(overlay))??)
    }

    #[cfg(debug_assertions)]
    fn inject_fault(
        &self,
        id: &str,
        thread: usize,
        fault: crate::io::fault_injection::Fault,
    ) -> Result<(), ControlError> {
        self.with(id, |e| match e.device().threads().get(thread) {
            Some(t) => {
                t.send(crate::io::Command::InjectFault(fault));
                Ok(())
            }
            None => Err(ControlError::InvalidParams(format!(
                "'thread' is {thread}: export {id} has {} I/O threads",
                e.device().threads().len()
            ))),
        })?
    }

    /// The settings that recreate the running exports: as they were given, with the size an
    /// export has now (after a resize) wherever a size was given or is needed, and its QoS as
    /// it is now.
    fn configs(&self) -> Vec<ExportConfig> {
        self.lock()
            .exports
            .iter()
            .map(|e| {
                let mut cfg = e.config();
                if cfg.size.is_some() || cfg.engine != EngineKind::Uring {
                    cfg.size = Some(e.device().engine().capacity());
                }
                cfg
            })
            .collect()
    }

    fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;
    use std::os::unix::net::UnixListener;

    fn spec(s: &str) -> ExportConfig {
        crate::config::parse_export_spec(s).unwrap()
    }

    #[test]
    fn exports_on_inherited_descriptors_do_not_clash_on_their_empty_socket_path() {
        let dir = tempfile::tempdir().unwrap();
        let fds: Vec<RawFd> = ["a.sock", "b.sock"]
            .iter()
            .map(|n| {
                UnixListener::bind(dir.path().join(n))
                    .unwrap()
                    .into_raw_fd()
            })
            .collect();
        let exports = Exports::default();
        for fd in &fds {
            exports
                .start(spec(&format!("fd={fd},engine=null,size=1M")))
                .unwrap_or_else(|e| panic!("fd={fd}: {e}"));
        }
        let again = spec(&format!("fd={},id=other,engine=null,size=1M", fds[0]));
        let e = exports.start(again).unwrap_err();
        assert!(matches!(e, Error::FdTaken(fd) if fd == fds[0]), "{e}");
        assert_eq!(exports.statuses().len(), 2);
        exports.stop_all();
    }

    #[test]
    fn a_failed_start_gives_its_id_and_socket_back() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("a.sock");
        let exports = Exports::default();
        let missing = dir.path().join("missing.img");
        let bad = spec(&format!(
            "socket={},id=a,path={}",
            sock.display(),
            missing.display()
        ));
        exports.start(bad).unwrap_err();
        exports
            .start(spec(&format!(
                "socket={},id=a,engine=null,size=1M",
                sock.display()
            )))
            .expect("the id and socket of a failed start are free again");
        // Nothing is left starting: stop_all does not wait.
        exports.stop_all();
        assert!(exports.statuses().is_empty());
    }

    #[test]
    fn throttle_groups_are_the_registry_s() {
        let dir = tempfile::tempdir().unwrap();
        let spec_on = |name: &str, qos: &str| {
            let sock = dir.path().join(format!("{name}.sock"));
            spec(&format!(
                "socket={},engine=null,size=1M,{qos}",
                sock.display()
            ))
        };
        let (one, other) = (Exports::default(), Exports::default());
        one.start(spec_on("a", "iops-total=100,group=g")).unwrap();
        // Another registry's group of the same name is another group.
        other
            .start(spec_on("b", "iops-total=200,group=g"))
            .expect("no conflict with another registry's group");
        // Within one registry, a member takes the group's limits, or gives the same ones.
        let e = one
            .start(spec_on("c", "iops-total=300,group=g"))
            .unwrap_err();
        assert!(matches!(e, Error::Qos(_)), "{e}");
        one.start(spec_on("d", "group=g")).unwrap();
        let (cfg, _) = one.get("d").unwrap();
        assert_eq!(cfg.qos.unwrap().iops_total.rate, 100);
        one.stop_all();
        other.stop_all();
    }

    #[test]
    fn no_export_starts_once_all_were_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let exports = Exports::default();
        let a = dir.path().join("a.sock");
        exports
            .start(spec(&format!("socket={},engine=null,size=1M", a.display())))
            .unwrap();
        exports.stop_all();
        assert!(!a.exists(), "stop_all removes the export's socket");
        let b = dir.path().join("b.sock");
        let e = exports
            .start(spec(&format!("socket={},engine=null,size=1M", b.display())))
            .unwrap_err();
        assert!(matches!(e, Error::ShuttingDown), "{e}");
        assert!(e.to_string().contains("the daemon is shutting down"), "{e}");
        assert!(!b.exists(), "a refused export binds nothing");
        assert!(exports.statuses().is_empty());
    }
}
