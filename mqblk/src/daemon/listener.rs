//! An export's socket: binding it (or adopting one inherited), accepting one frontend at a
//! time, and serving that frontend's vhost-user messages until it goes away.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::io::{Errno, FdFlags};
use rustix::net::{sockopt, AddressFamily, SocketType};
use vhost::vhost_user::{BackendReqHandler, Error as VhuError};

use super::error::Error;
use crate::frontend::backend_channel::peek_backend_channel;
use crate::frontend::{disk_wait, Device, Session};

/// Locks a session (a panicked holder leaves it usable: its state is plain data).
fn lock(session: &Mutex<Session>) -> std::sync::MutexGuard<'_, Session> {
    session.lock().unwrap_or_else(|e| e.into_inner())
}

/// Binds a unix socket, refusing to steal one another process is listening on or to replace
/// anything that is not a socket.
pub fn bind(path: &Path) -> Result<UnixListener, Error> {
    crate::api::socket::remove_stale(path).map_err(|err| match err.kind() {
        io::ErrorKind::AddrInUse => Error::SocketBusy(path.into()),
        io::ErrorKind::InvalidInput => Error::NotASocket(path.into()),
        _ => Error::Socket {
            what: "cannot remove stale",
            path: path.into(),
            err,
        },
    })?;
    UnixListener::bind(path).map_err(|err| Error::Socket {
        what: "cannot listen on",
        path: path.into(),
        err,
    })
}

/// Takes over the listening unix stream socket inherited as `fd` (`fd=N`, or systemd socket
/// activation), after checking that it is one.
pub fn adopt(fd: RawFd) -> Result<UnixListener, Error> {
    let bad = |why: String| Error::InheritedFd { fd, why };
    // SAFETY: `fd` is not -1 (`fd=` takes 0 and up; socket activation starts at 3), and
    // nothing in this process owns it, so nothing closes it while borrowed here. It may not be
    // open at all: the socket options read below then fail with EBADF, which is all this
    // borrow is used for before the checks pass.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let domain = sockopt::socket_domain(borrowed).map_err(|e| {
        bad(match e {
            Errno::BADF => "no such open file descriptor".into(),
            Errno::NOTSOCK => "not a socket".into(),
            _ => e.to_string(),
        })
    })?;
    if domain != AddressFamily::UNIX {
        return Err(bad(
            "not a unix socket (vhost-user listens on AF_UNIX)".into()
        ));
    }
    if sockopt::socket_type(borrowed).map_err(|e| bad(e.to_string()))? != SocketType::STREAM {
        return Err(bad(
            "not a stream socket (vhost-user needs SOCK_STREAM)".into()
        ));
    }
    if !sockopt::socket_acceptconn(borrowed).map_err(|e| bad(e.to_string()))? {
        return Err(bad(
            "not listening (bind and listen(2) on it before handing it over)".into(),
        ));
    }
    // SAFETY: `fd` is an open listening unix stream socket (checked above) that this process
    // was handed at startup to serve; the daemon adopts each such descriptor for exactly one
    // export (config::clash, checked at startup and by Exports, and the socket-activation
    // assignment keep them distinct; the management API takes no fd=), so nothing else here
    // owns or closes it.
    let listener = unsafe { UnixListener::from_raw_fd(fd) };
    // A child process must not inherit (and hold open) the export's socket.
    let _ = rustix::io::fcntl_setfd(&listener, FdFlags::CLOEXEC);
    Ok(listener)
}

/// The path an inherited listener is bound to, if it has one (for logs and status).
pub fn bound_path(listener: &UnixListener) -> Option<PathBuf> {
    listener
        .local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(Path::to_path_buf))
}

/// What the listener shares with the export that owns it.
pub struct ListenerState {
    /// The connection being served, so that a shutdown can wake its reads.
    pub conn: Mutex<Option<Arc<UnixStream>>>,
    /// Set when the export stops.
    pub stop: AtomicBool,
    /// An eventfd written when the export stops, to wake an accept. (The listening socket
    /// itself is not shut down for that: an inherited one is shared with whoever handed it
    /// over, e.g. systemd, which passes it on to the next instance.)
    pub wake: OwnedFd,
    /// Frontends accepted since the export started.
    pub connections: AtomicU64,
    /// The session of the connected frontend, for the control plane (resize).
    pub session: Mutex<Option<Arc<Mutex<Session>>>>,
    /// Whether the connected frontend's rings wait to take up the disk
    /// ([`disk_wait`]), as the listener last saw it.
    pub waiting_for_disk: AtomicBool,
    /// An eventfd written when rings were started off the listener's thread (a snapshot's
    /// quiesce), so that it looks again whether they wait for the disk.
    look_again: OwnedFd,
}

impl ListenerState {
    /// A listener's state before its first connection.
    pub fn new() -> io::Result<ListenerState> {
        Ok(ListenerState {
            conn: Mutex::new(None),
            stop: AtomicBool::new(false),
            wake: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            connections: AtomicU64::new(0),
            session: Mutex::new(None),
            waiting_for_disk: AtomicBool::new(false),
            look_again: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        })
    }

    /// Has the listener look again whether the connection's rings wait for the disk: after
    /// they were started on another thread, which may have found it busy.
    pub fn look_again(&self) {
        let _ = rustix::io::write(&self.look_again, &1u64.to_ne_bytes());
    }

    /// Asks the listener to stop, waking it wherever it waits.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        // Wake the message loop of a connection being served.
        if let Some(s) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

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
    let id = device.config().id.clone();
    while !state.stop.load(Ordering::SeqCst) {
        if !wait_for_frontend(&listener, &state.wake) {
            break;
        }
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            // Another holder of an inherited socket took the connection first.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
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
        if let Some(why) = device.failure().reason() {
            tracing::warn!(export = %id, failure = %why, "a frontend connected to a failed export; closing it (export_del and export_add serve it again)");
            drop(stream);
            continue;
        }
        served += 1;
        state.connections.fetch_add(1, Ordering::Relaxed);
        tracing::info!(export = %id, connection = served, "frontend connected");
        // The connection as the listener sees it: polled and peeked at here, shut down by
        // `stop`, while the handler owns the stream it reads messages from.
        let conn = match stream.try_clone() {
            Ok(c) => Arc::new(c),
            Err(e) => {
                tracing::warn!(err = %e, "cannot clone connection");
                continue;
            }
        };
        *state.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn.clone());
        let connection = stream.try_clone().ok().map(OwnedFd::from);
        let session = Arc::new(Mutex::new(Session::new(device.clone(), connection)));
        *state.session.lock().unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
        let mut handler = BackendReqHandler::from_stream(stream, session.clone());
        loop {
            // vhost-user is one frontend per socket: while this one is connected, a second
            // one is told no at once (closed) instead of waiting unseen in the backlog.
            let ends = [
                device.failure().event_fd(),
                state.wake.as_fd(),
                state.look_again.as_fd(),
            ];
            let waiting = lock(&session).waits_for_disk();
            state.waiting_for_disk.store(waiting, Ordering::Relaxed);
            let retry = waiting.then_some(RETRY_DISK);
            match wait_for_message(&listener, &conn, ends, served, retry.as_ref()) {
                Wait::Message => {}
                Wait::Retry => {
                    lock(&session).start_waiting_rings();
                    continue;
                }
                Wait::End => break,
            }
            if let Some(channel) = peek_backend_channel(&*conn) {
                lock(&session).set_backend_channel(channel);
            }
            // A bug reached through a message ends this connection, not the export: the
            // session is reset below as for any disconnect.
            let handled =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.handle_request()));
            let Ok(handled) = handled else {
                tracing::error!(
                    connection = served,
                    "handling a vhost-user message panicked; closing the connection"
                );
                break;
            };
            match handled {
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
        state.waiting_for_disk.store(false, Ordering::Relaxed);
        // The frontend sees the connection end now, before the drain: the session and its
        // fault guards hold copies of the socket until they are reset.
        let _ = conn.shutdown(std::net::Shutdown::Both);
        drop(handler);
        // Drain the connection's in-flight I/O and forget its memory.
        let reset =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lock(&session).disconnect()));
        if reset.is_err() {
            tracing::error!(connection = served, "resetting the session panicked");
        }
    }
}

/// Polls `fds` for input for up to `timeout` (None: no limit), retrying when a signal
/// interrupts; returns each descriptor's events, or None when poll fails.
fn poll_in<const N: usize>(
    fds: [BorrowedFd<'_>; N],
    timeout: Option<&Timespec>,
) -> Option<[PollFlags; N]> {
    let mut p = fds.map(|fd| PollFd::from_borrowed_fd(fd, PollFlags::IN));
    loop {
        match poll(&mut p, timeout) {
            Ok(_) => return Some(p.map(|p| p.revents())),
            Err(Errno::INTR) => continue,
            Err(_) => return None,
        }
    }
}

/// Waits until a frontend connects (true) or the export stops (false).
fn wait_for_frontend(listener: &UnixListener, wake: &OwnedFd) -> bool {
    loop {
        let Some([conn, stop]) = poll_in([listener.as_fd(), wake.as_fd()], None) else {
            return false;
        };
        if !stop.is_empty() {
            return false;
        }
        if !conn.is_empty() {
            return true;
        }
    }
}

/// How long a frontend that reconnects has for its old connection's hang-up to arrive.
const HANG_UP_GRACE: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 500_000_000,
};

/// How often a connection whose rings wait for the disk tries again to start them
/// ([`disk_wait::RETRY`]).
const RETRY_DISK: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: disk_wait::RETRY.as_nanos() as i64,
};

/// What [`wait_for_message`] waited for.
enum Wait {
    /// The connection has a message.
    Message,
    /// The retry interval passed: try again to start the rings that wait for the disk.
    Retry,
    /// The connection is closed or failed, or the export failed or stops.
    End,
}

/// Waits until the connection has a message, or is closed or failed, or the export failed
/// (`failed` readable) or stops (`stopping` readable), or `retry` passes or `look_again` is
/// readable, turning away any other frontend that connects meanwhile.
fn wait_for_message(
    listener: &UnixListener,
    conn: &UnixStream,
    [failed, stopping, look_again]: [BorrowedFd<'_>; 3],
    served: u64,
    retry: Option<&Timespec>,
) -> Wait {
    loop {
        let fds = [conn.as_fd(), listener.as_fd(), failed, stopping, look_again];
        let Some(events) = poll_in(fds, retry) else {
            return Wait::End;
        };
        if !events[4].is_empty() {
            let mut count = [0u8; 8];
            let _ = rustix::io::read(look_again, &mut count);
            return Wait::Retry;
        }
        if events.iter().all(|e| e.is_empty()) {
            return Wait::Retry;
        }
        if !events[2].is_empty() {
            tracing::warn!(
                connection = served,
                "an I/O thread of this export died; closing the connection"
            );
            return Wait::End;
        }
        // The export stops: `stop` may have come before this connection was stored where it
        // could shut it down, so the wake eventfd is watched too.
        if !events[3].is_empty() {
            return Wait::End;
        }
        // The frontend's own events (a message, or its hang-up) come first, so that a frontend
        // that reconnects right after closing is not mistaken for a second one.
        if !events[0].is_empty() {
            return Wait::Message;
        }
        if events[1].contains(PollFlags::IN) {
            // A frontend reconnecting right after closing may reach us before its old
            // connection's hang-up does (e.g. a copy of the old socket lived on briefly in a
            // forked child): give the current connection a moment to hang up first.
            if poll_in([conn.as_fd()], Some(&HANG_UP_GRACE)).is_some_and(|[cur]| !cur.is_empty()) {
                return Wait::Message;
            }
            if let Ok((extra, _)) = listener.accept() {
                tracing::warn!(
                    connection = served,
                    "a second frontend connected while one is being served; closing it (one frontend per socket)"
                );
                drop(extra);
            }
        } else if !events[1].is_empty() {
            // The listening socket was shut down (the export is stopping): let the message
            // loop see it.
            return Wait::Message;
        }
    }
}
