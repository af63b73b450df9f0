//! Exports, their lifecycle, signals, and the graceful drain.
//!
//! Each export has a listener thread that accepts one frontend at a time and serves its
//! vhost-user messages; the export's I/O threads outlive connections. A frontend that goes away
//! leaves the socket accepting the next one. SIGINT/SIGTERM drain in-flight I/O, then the
//! daemon exits 0.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vhost::vhost_user::{BackendReqHandler, Error as VhuError};

use crate::config::ExportConfig;
use crate::engine;
use crate::vhost::{Device, ExportShared};

/// A running export.
pub struct Export {
    shared: Arc<ExportShared>,
    socket: PathBuf,
    listener_fd: i32,
    conn: Arc<Mutex<Option<UnixStream>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Binds a unix socket, refusing to steal one another process is listening on.
fn bind_socket(path: &Path) -> Result<UnixListener, String> {
    if path.exists() {
        match UnixStream::connect(path) {
            Ok(_) => {
                return Err(format!(
                    "socket {} is busy: another process is listening on it",
                    path.display()
                ))
            }
            Err(_) => {
                // A stale socket from an earlier run (or another file): replace only sockets.
                use std::os::unix::fs::FileTypeExt;
                let meta = std::fs::symlink_metadata(path)
                    .map_err(|e| format!("cannot stat socket {}: {e}", path.display()))?;
                if !meta.file_type().is_socket() {
                    return Err(format!(
                        "socket path {} exists and is not a socket: choose another path",
                        path.display()
                    ));
                }
                std::fs::remove_file(path)
                    .map_err(|e| format!("cannot remove stale socket {}: {e}", path.display()))?;
            }
        }
    }
    UnixListener::bind(path).map_err(|e| format!("cannot listen on socket {}: {e}", path.display()))
}

impl Export {
    /// Opens the storage, starts the I/O threads and begins listening.
    pub fn start(cfg: ExportConfig) -> Result<Export, String> {
        let engine: Arc<dyn engine::Engine> =
            Arc::from(engine::open(&cfg).map_err(|e| e.to_string())?);
        let listener = bind_socket(&cfg.socket)?;
        let socket = cfg.socket.clone();
        tracing::info!(
            socket = %socket.display(),
            engine = engine.name(),
            capacity = engine.capacity(),
            queues = cfg.queues,
            threads = cfg.num_threads(),
            mapping = cfg.mapping_name(),
            readonly = cfg.readonly,
            "export ready"
        );
        let shared = Arc::new(
            ExportShared::new(cfg, engine).map_err(|e| format!("cannot start I/O threads: {e}"))?,
        );
        let conn: Arc<Mutex<Option<UnixStream>>> = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let listener_fd = listener.as_raw_fd();
        let thread = {
            let (shared, conn, stop) = (shared.clone(), conn.clone(), stop.clone());
            std::thread::Builder::new()
                .name("mqblk-vhost".into())
                .spawn(move || serve_connections(listener, shared, conn, stop))
                .map_err(|e| format!("cannot start listener thread: {e}"))?
        };
        Ok(Export {
            shared,
            socket,
            listener_fd,
            conn,
            stop,
            thread: Some(thread),
        })
    }

    /// The export's shared state (settings, engine, I/O thread counters).
    pub fn shared(&self) -> &Arc<ExportShared> {
        &self.shared
    }

    /// Stops accepting, drains the current connection's in-flight I/O, stops the I/O threads.
    pub fn shutdown(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the listener thread whether it is in accept() or reading a message.
        if let Some(s) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // SAFETY: shutdown(2) on the listening socket's descriptor, which the listener thread
        // still owns (it is closed only after that thread ends); it makes accept() return.
        unsafe {
            libc::shutdown(self.listener_fd, libc::SHUT_RDWR);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        match Arc::try_unwrap(self.shared) {
            Ok(mut s) => s.shutdown(),
            Err(_) => tracing::warn!("export still referenced at shutdown"),
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

fn serve_connections(
    listener: UnixListener,
    shared: Arc<ExportShared>,
    conn: Arc<Mutex<Option<UnixStream>>>,
    stop: Arc<AtomicBool>,
) {
    let mut served = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                tracing::warn!(err = %e, "accept failed");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        if stop.load(Ordering::SeqCst) {
            break;
        }
        served += 1;
        tracing::info!(socket = %shared.cfg.socket.display(), connection = served, "frontend connected");
        match stream.try_clone() {
            Ok(c) => *conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(c),
            Err(e) => {
                tracing::warn!(err = %e, "cannot clone connection");
                continue;
            }
        }
        let device = Arc::new(Mutex::new(Device::new(shared.clone())));
        let mut handler = BackendReqHandler::from_stream(stream, device.clone());
        loop {
            // vhost-user is one frontend per socket: while this one is connected, a second
            // one is told no at once (closed) instead of waiting unseen in the backlog.
            if !wait_for_message(&listener, &handler, served) {
                break;
            }
            match handler.handle_request() {
                Ok(()) => {}
                Err(VhuError::Disconnected) | Err(VhuError::PartialMessage) => {
                    tracing::info!(connection = served, "frontend disconnected");
                    break;
                }
                Err(e) => {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    // A malformed message or a failed request: drop this frontend, keep serving.
                    tracing::warn!(connection = served, err = %e, "vhost-user error; closing the connection");
                    break;
                }
            }
        }
        *conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
        drop(handler);
        // Drain in-flight I/O of this connection and forget its memory.
        device
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .disconnect();
    }
}

/// Waits until the connection has a message (true) or is closed/failed (false), turning away
/// any other frontend that connects meanwhile.
fn wait_for_message<S: vhost::vhost_user::VhostUserBackendReqHandler>(
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
            // The listening socket was shut down (daemon stopping): let the message loop see it.
            return true;
        }
    }
}

/// Blocks SIGINT and SIGTERM in this thread (and every thread it starts later).
pub fn block_signals() -> io::Result<()> {
    // SAFETY: plain sigset manipulation on a local set, then pthread_sigmask on this thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let r = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if r != 0 {
            return Err(io::Error::from_raw_os_error(r));
        }
    }
    Ok(())
}

/// Waits for SIGINT or SIGTERM (blocked beforehand with [`block_signals`]); returns its number.
pub fn wait_for_signal() -> i32 {
    // SAFETY: sigwait on a local set of blocked signals; `sig` outlives the call.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        let mut sig: libc::c_int = 0;
        loop {
            if libc::sigwait(&set, &mut sig) == 0 {
                return sig;
            }
        }
    }
}

/// Runs `mqblk serve`: starts every export, waits for a signal, drains, returns.
///
/// With `stats_file`, the main thread also rewrites that file with the exports' counters
/// (see [`write_stats_file`]) every 100 ms while serving, and once more after the signal.
pub fn serve(exports: Vec<ExportConfig>, stats_file: Option<PathBuf>) -> Result<(), String> {
    block_signals().map_err(|e| format!("cannot block signals: {e}"))?;
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
        None => wait_for_signal(),
        Some(path) => wait_writing_stats(&running, path),
    };
    if let Some(path) = &stats_file {
        write_stats_file(&running, path);
    }
    tracing::info!(signal = sig, "shutting down: draining in-flight I/O");
    for r in running {
        r.shutdown();
    }
    tracing::info!("all exports drained; exiting");
    Ok(())
}

/// How often `mqblk serve --stats-file` rewrites the file.
const STATS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Like [`wait_for_signal`], rewriting the stats file every [`STATS_INTERVAL`] meanwhile.
/// Runs on the main thread: the I/O threads only publish their counters as relaxed atomics.
fn wait_writing_stats(running: &[Export], path: &Path) -> i32 {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: STATS_INTERVAL.as_nanos() as libc::c_long,
    };
    loop {
        write_stats_file(running, path);
        // SAFETY: sigtimedwait on a local set of signals blocked beforehand; the info pointer
        // may be null; `ts` outlives the call.
        let sig = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigtimedwait(&set, std::ptr::null_mut(), &ts)
        };
        if sig > 0 {
            return sig;
        }
    }
}

/// The exports' counters as JSON: `{"exports": [{"socket": ..., "requests": ..., ...}]}`,
/// each export's I/O threads summed.
pub fn stats_json(running: &[Export]) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let exports: Vec<serde_json::Value> = running
        .iter()
        .map(|e| {
            let mut t = [0u64; 16];
            for w in &e.shared.workers {
                let s = &w.stats;
                let v = [
                    &s.requests,
                    &s.errors,
                    &s.submits,
                    &s.submitted,
                    &s.notifies,
                    &s.bytes,
                    &s.merges,
                    &s.kicks,
                    &s.poll_hits,
                    &s.poll_misses,
                    &s.sleeps,
                    &s.batch_waits,
                    &s.enters,
                    &s.fixed_buf_ios,
                    &s.fixed_file_ios,
                    &s.sync_writes,
                ];
                for (acc, a) in t.iter_mut().zip(v) {
                    *acc += a.load(Relaxed);
                }
            }
            serde_json::json!({
                "socket": e.socket.display().to_string(),
                "threads": e.shared.workers.len(),
                "requests": t[0], "errors": t[1], "submits": t[2], "submitted": t[3],
                "notifies": t[4], "bytes": t[5], "merges": t[6], "kicks": t[7],
                "poll_hits": t[8], "poll_misses": t[9], "sleeps": t[10], "batch_waits": t[11],
                "enters": t[12], "fixed_buf_ios": t[13], "fixed_file_ios": t[14],
                "sync_writes": t[15],
            })
        })
        .collect();
    serde_json::json!({ "exports": exports })
}

/// Writes [`stats_json`] to `path` atomically (a temporary file beside it, then a rename).
pub fn write_stats_file(running: &[Export], path: &Path) {
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    let text = stats_json(running).to_string();
    let r = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        tracing::warn!(path = %path.display(), err = %e, "cannot write the stats file");
    }
}
