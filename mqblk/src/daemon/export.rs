//! An export: a disk served on one vhost-user socket, from start to drain.

use std::os::fd::RawFd;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::error::Error;
use super::listener::{self, ListenerState};
use super::qos::groups::ThrottleGroups;
use super::qos::ExportQos;
use crate::api::ExportStatus;
use crate::config::{ExportConfig, QosConfig};
use crate::engine::{self, Engine};
use crate::frontend::{Device, Session};

/// A running export.
pub struct Export {
    device: Arc<Device>,
    qos: ExportQos,
    socket: PathBuf,
    /// Whether this process bound `socket` (and so removes it at shutdown). An inherited
    /// socket belongs to whoever handed it over and outlives this process.
    bound: bool,
    state: Arc<ListenerState>,
    thread: Option<JoinHandle<()>>,
    /// Held through a resize, the frontend's acknowledgement included: two resizes at once
    /// would interleave the threads' capacity and the store's, and read each other's acks.
    /// Held through a snapshot too: a resize must not land between a snapshot's flush and
    /// its switch.
    resizing: Mutex<()>,
    /// The image written since the last snapshot, if one was taken (the export's `path` from
    /// then on).
    snapshot_path: Mutex<Option<PathBuf>>,
}

impl Export {
    /// Opens the storage, starts the I/O threads and begins listening on the export's
    /// `socket=` path or its `fd=` descriptor. The export runs on its own: a throttle group it
    /// names has no other member (the exports of an [`Exports`](super::Exports) share theirs).
    pub fn start(cfg: ExportConfig) -> Result<Export, Error> {
        Export::start_activated(cfg, None, &Arc::default())
    }

    /// [`Export::start`], serving `activated` (a socket handed over by systemd socket
    /// activation) when the export is not given `fd=` itself, in the throttle groups `groups`.
    pub fn start_activated(
        cfg: ExportConfig,
        activated: Option<RawFd>,
        groups: &Arc<ThrottleGroups>,
    ) -> Result<Export, Error> {
        let engine: Arc<dyn Engine> = Arc::from(engine::open(&cfg)?);
        let (listener, socket, bound) = listen(&cfg, activated)?;
        tracing::info!(
            export = %cfg.id,
            socket = %socket.display(),
            inherited = !bound,
            engine = engine.name(),
            capacity = engine.capacity(),
            queues = cfg.queues,
            threads = cfg.num_threads(),
            mapping = cfg.mapping_name(),
            readonly = cfg.readonly,
            "export ready"
        );
        let qos = cfg.qos.clone();
        let (device, qos) = ExportQos::start(groups, qos.as_ref(), |throttle| {
            Device::new(cfg, engine, throttle)
                .map(Arc::new)
                .map_err(|err| Error::Thread {
                    what: "I/O threads",
                    err,
                })
        })
        .inspect_err(|_| {
            // Nobody will serve it: a later start may bind it afresh. (An inherited socket
            // is not ours to remove.)
            if bound {
                let _ = std::fs::remove_file(&socket);
            }
        })?;
        let state = Arc::new(ListenerState::new().map_err(|err| Error::Thread {
            what: "listener (its wake eventfd)",
            err,
        })?);
        let thread = {
            let (device, state) = (device.clone(), state.clone());
            std::thread::Builder::new()
                .name("mqblk-vhost".into())
                .spawn(move || listener::serve(listener, device, state))
                .map_err(|err| Error::Thread {
                    what: "listener thread",
                    err,
                })?
        };
        Ok(Export {
            device,
            qos,
            socket,
            bound,
            state,
            thread: Some(thread),
            resizing: Mutex::new(()),
            snapshot_path: Mutex::new(None),
        })
    }

    /// The export's device (settings, storage, I/O threads and their counters).
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The export's settings now: as given, with its QoS as it is now (it may have been changed
    /// at runtime, or by another member of its throttle group).
    pub fn config(&self) -> ExportConfig {
        let mut cfg = self.device.config().clone();
        cfg.qos = self.qos.current();
        if let Some(top) = self
            .snapshot_path
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            // The overlay exists and records its own backing file.
            cfg.path = Some(top);
            cfg.qcow2.backing = None;
            cfg.qcow2.backing_format = None;
            cfg.size = None;
        }
        cfg
    }

    /// The session of the connected frontend, if one is.
    fn session(&self) -> Option<Arc<Mutex<Session>>> {
        self.state
            .session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Takes an external snapshot (see [`Control::snapshot`](crate::api::Control::snapshot)):
    /// the frontend's rings stop once their requests complete, the engine switches to the new
    /// overlay, the rings start again where they stopped. The guest sees a pause, no error.
    pub fn snapshot(&self, overlay: &Path) -> Result<ExportStatus, Error> {
        let _one_at_a_time = self.resizing.lock().unwrap_or_else(|e| e.into_inner());
        let id = self.device.config().id.clone();
        // The overlay is a new image in its directory: under the sandbox, one that
        // `--allow-dir` names (refused here by name, not by the kernel's EACCES).
        let mut with_overlay = self.config();
        with_overlay.path = Some(overlay.to_path_buf());
        crate::sandbox::check_export(&with_overlay)?;
        let session = self.session();
        let engine = self.device.engine();
        match session {
            Some(s) => {
                let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
                let taken = s.quiesced(|| engine.snapshot(overlay));
                if s.waits_for_disk() {
                    // The rings started again here, not on the listener's thread, which
                    // tries again only while it knows they wait.
                    self.state.look_again();
                }
                taken?
            }
            None => engine.snapshot(overlay)?,
        }
        *self.snapshot_path.lock().unwrap_or_else(|e| e.into_inner()) = Some(overlay.to_path_buf());
        tracing::info!(id, overlay = %overlay.display(), "snapshot taken: the old image is read-only from now on");
        Ok(self.status())
    }

    /// The export's QoS now: its limits (its throttle group's, if in one) and its group.
    pub fn qos(&self) -> QosConfig {
        self.qos.config()
    }

    /// Changes the export's QoS while it runs (the management API's `export_set_qos`): each
    /// I/O thread applies the limits when the command wakes it; with `group`, the export joins that throttle group,
    /// and limits given with it become the group's. An invalid setting changes nothing and
    /// names the offending key.
    pub fn set_qos(&self, qos: QosConfig) -> Result<(), Error> {
        self.qos.set(&self.device, &qos)
    }

    /// The export as the management API and the metrics report it.
    pub fn status(&self) -> ExportStatus {
        let d = &self.device;
        let cfg = d.config();
        ExportStatus {
            id: cfg.id.clone(),
            socket: self.socket.clone(),
            engine: d.engine().name().to_string(),
            capacity: d.engine().capacity(),
            queues: cfg.queues,
            threads: cfg.num_threads(),
            mapping: cfg.mapping_name().to_string(),
            readonly: cfg.readonly,
            connected: self.state.connected(),
            connections: self.state.connections.load(Ordering::Relaxed),
            waiting_for_disk: self.state.waiting_for_disk.load(Ordering::Relaxed),
            in_flight: d.threads().iter().map(|t| t.counters().in_flight()).sum(),
            table_memory: d.engine().table_memory(),
            metadata: d.engine().metadata_counters(),
            failure: d.failure().reason(),
            counters: d.counters(),
            per_thread: d.threads().iter().map(|t| t.counters().load()).collect(),
        }
    }

    /// Resizes the export (to `size` bytes, or to what its store now holds) and tells a
    /// connected frontend, which then raises a config interrupt in the guest.
    pub fn resize(&self, size: Option<u64>) -> Result<ExportStatus, Error> {
        let _one_at_a_time = self.resizing.lock().unwrap_or_else(|e| e.into_inner());
        let id = self.device.config().id.clone();
        let new = self.device.resize(size)?;
        tracing::info!(id, capacity = new, "export resized");
        let session = self.session();
        if let Some(session) = session {
            // The session's lock is held only to take the channel: the frontend reads the new
            // configuration (GET_CONFIG, served under that lock) before it acknowledges.
            let channel = session
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .config_change_channel();
            match channel.map(|c| c.and_then(|(mut ch, ack)| ch.config_changed(ack))) {
                Some(Ok(())) => {}
                None => tracing::info!(id, "the frontend gave no channel for config changes: the guest sees the new size when it reads the configuration again"),
                Some(Err(e)) => tracing::warn!(id, err = %e, "could not tell the frontend about the new size"),
            }
        }
        Ok(self.status())
    }

    /// Whether it still serves, or failed in a way that was contained: its listener runs, and
    /// every I/O thread runs unless the export is marked failed. (A failed export is reported
    /// in its status and metrics; it is no reason for a watchdog to restart the daemon and
    /// every other export with it.)
    pub fn is_healthy(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
            && (self.device.threads_running() || self.device.failure().is_failed())
    }

    /// The socket it listens on (for an inherited socket, the path it is bound to, if any).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stops accepting, drains the current connection's in-flight I/O, stops the I/O threads,
    /// removes the socket if this process bound it.
    pub fn shutdown(mut self) {
        self.state.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.qos.leave(&self.device);
        match Arc::try_unwrap(self.device) {
            Ok(mut d) => d.shutdown(),
            Err(_) => tracing::warn!("export still referenced at shutdown"),
        }
        if self.bound {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// The export's listening socket, its path, and whether this process bound it. An explicit
/// `fd=` comes first, then a socket-activated descriptor, then binding `socket=`.
fn listen(
    cfg: &ExportConfig,
    activated: Option<RawFd>,
) -> Result<(UnixListener, PathBuf, bool), Error> {
    match cfg.fd.or(activated) {
        Some(fd) => {
            let l = listener::adopt(fd)?;
            let path = listener::bound_path(&l).unwrap_or_else(|| cfg.socket.clone());
            Ok((l, path, false))
        }
        None => Ok((listener::bind(&cfg.socket)?, cfg.socket.clone(), true)),
    }
}
