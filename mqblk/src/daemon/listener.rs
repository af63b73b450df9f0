//! An export's socket: binding it, accepting one frontend at a time, and serving that
//! frontend's vhost-user messages until it goes away.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::{BackendReqHandler, Error as VhuError, VhostUserBackendReqHandler};

use super::error::Error;
use crate::frontend::backend_channel::peek_backend_channel;
use crate::frontend::{Device, Session};

/// Locks a session (a panicked holder leaves it usable: its state is plain data).
fn lock(session: &Mutex<Session>) -> std::sync::MutexGuard<'_, Session> {
    session.lock().unwrap_or_else(|e| e.into_inner())
}

/// Binds a unix socket, refusing to steal one another process is listening on.
pub fn bind(path: &Path) -> Result<UnixListener, Error> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(Error::SocketBusy(path.into()));
        }
        // A stale socket from an earlier run (or another file): replace only sockets.
        use std::os::unix::fs::FileTypeExt;
        let meta = std::fs::symlink_metadata(path).map_err(|err| Error::Socket {
            what: "cannot stat",
            path: path.into(),
            err,
        })?;
        if !meta.file_type().is_socket() {
            return Err(Error::NotASocket(path.into()));
        }
        std::fs::remove_file(path).map_err(|err| Error::Socket {
            what: "cannot remove stale",
            path: path.into(),
            err,
        })?;
    }
    UnixListener::bind(path).map_err(|err| Error::Socket {
        what: "cannot listen on",
        path: path.into(),
        err,
    })
}

/// What the listener shares with the export that owns it.
#[derive(Default)]
pub struct ListenerState {
    /// The connection being served, so that a shutdown can wake its reads.
    pub conn: Mutex<Option<UnixStream>>,
    /// Set when the export stops.
    pub stop: AtomicBool,
    /// Frontends accepted since the export started.
    pub connections: AtomicU64,
    /// The session of the connected frontend, for the control plane (resize).
    pub session: Mutex<Option<Arc<Mutex<Session>>>>,
}

impl ListenerState {
    /// Whether a frontend is connected now.
    pub fn connected(&self) -> bool {
        self.conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

/// Accepts frontends one at a time until the export stops; each connection gets a fresh
/// [`Session`] on the export's device, and its in-flight I/O is drained when it ends.
pub fn serve(listener: UnixListener, device: Arc<Device>, state: Arc<ListenerState>) {
    let mut served = 0u64;
    while !state.stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if state.stop.load(Ordering::SeqCst) {
                    break;
                }
                tracing::warn!(err = %e, "accept failed");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        if state.stop.load(Ordering::SeqCst) {
            break;
        }
        served += 1;
        state.connections.fetch_add(1, Ordering::Relaxed);
        let socket = device.config().socket.display().to_string();
        tracing::info!(socket, connection = served, "frontend connected");
        match stream.try_clone() {
            Ok(c) => *state.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(c),
            Err(e) => {
                tracing::warn!(err = %e, "cannot clone connection");
                continue;
            }
        }
        let session = Arc::new(Mutex::new(Session::new(device.clone())));
        *state.session.lock().unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
        let mut handler = BackendReqHandler::from_stream(stream, session.clone());
        loop {
            // vhost-user is one frontend per socket: while this one is connected, a second
            // one is told no at once (closed) instead of waiting unseen in the backlog.
            if !wait_for_message(&listener, &handler, served) {
                break;
            }
            if let Some(channel) = peek_backend_channel(handler.as_raw_fd()) {
                lock(&session).set_backend_channel(channel);
            }
            match handler.handle_request() {
                Ok(()) => {}
                Err(VhuError::Disconnected) | Err(VhuError::PartialMessage) => {
                    tracing::info!(connection = served, "frontend disconnected");
                    break;
                }
                Err(e) => {
                    if state.stop.load(Ordering::SeqCst) {
                        break;
                    }
                    // A malformed message or a failed request: drop this frontend, keep serving.
                    tracing::warn!(connection = served, err = %e, "vhost-user error; closing the connection");
                    break;
                }
            }
        }
        *state.conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *state.session.lock().unwrap_or_else(|e| e.into_inner()) = None;
        drop(handler);
        // Drain the connection's in-flight I/O and forget its memory.
        lock(&session).disconnect();
    }
}

/// Waits until the connection has a message (true) or is closed or failed (false), turning
/// away any other frontend that connects meanwhile.
fn wait_for_message<S: VhostUserBackendReqHandler>(
    listener: &UnixListener,
    handler: &BackendReqHandler<S>,
    served: u64,
) -> bool {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: handler.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll on two valid descriptors in a live local array.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if r < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        // The frontend's own events (a message, or its hang-up) come first, so that a frontend
        // that reconnects right after closing is not mistaken for a second one.
        if fds[0].revents != 0 {
            return true;
        }
        if fds[1].revents & libc::POLLIN != 0 {
            // A frontend reconnecting right after closing may reach us before its old
            // connection's hang-up does (e.g. a copy of the old socket lived on briefly in a
            // forked child): give the current connection a moment to hang up first.
            let mut cur = [libc::pollfd {
                fd: handler.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: poll on one valid descriptor in a live local array.
            if unsafe { libc::poll(cur.as_mut_ptr(), 1, 500) } > 0 {
                return true;
            }
            if let Ok((extra, _)) = listener.accept() {
                tracing::warn!(
                    connection = served,
                    "a second frontend connected while one is being served; closing it (one frontend per socket)"
                );
                drop(extra);
            }
        } else if fds[1].revents != 0 {
            // The listening socket was shut down (the export is stopping): let the message
            // loop see it.
            return true;
        }
    }
}
