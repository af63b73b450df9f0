//! Why the daemon or an export could not start. Each message is one line for the operator.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::config::ConfigError;
use crate::engine::OpenError;

/// A failure to start serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The storage could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// Another process listens on the socket.
    #[error("socket {0} is busy: another process is listening on it")]
    SocketBusy(PathBuf),
    /// The socket path holds something that is not a socket.
    #[error("socket path {0} exists and is not a socket: choose another path")]
    NotASocket(PathBuf),
    /// An inherited descriptor (`fd=N` or socket activation) that is not a listening unix
    /// stream socket.
    #[error("fd={fd}: {why}")]
    InheritedFd {
        /// The descriptor.
        fd: i32,
        /// What is wrong with it.
        why: String,
    },
    /// Anything else about the socket.
    #[error("{what} socket {path}: {err}")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The socket path.
        path: PathBuf,
        /// The error.
        err: std::io::Error,
    },
    /// A thread could not be started.
    #[error("cannot start {what}: {err}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// The error.
        err: std::io::Error,
    },
    /// The metrics endpoint could not listen.
    #[error("cannot serve metrics on {addr}: {err}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// The error.
        err: std::io::Error,
    },
    /// The socket-activation environment (`LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES`) is
    /// malformed.
    #[error("socket activation (LISTEN_FDS, LISTEN_FDNAMES): {0}")]
    SocketActivation(std::io::Error),
    /// QoS settings that are invalid, or that conflict with the export's throttle group.
    #[error(transparent)]
    Qos(ConfigError),
    /// Signals could not be blocked.
    #[error("cannot block signals: {0}")]
    Signals(std::io::Error),
    /// The management API's socket could not be set up.
    #[error("--api-socket {path}: {err}")]
    ApiSocket {
        /// The socket path.
        path: PathBuf,
        /// The error.
        err: std::io::Error,
    },
    /// No export has this id.
    #[error("no export has id={0}")]
    NoSuchExport(String),
    /// A running export already has this id.
    #[error("an export with id={0} is already running: give another id=")]
    IdTaken(String),
    /// A running export already listens on this socket.
    #[error("an export is already listening on socket={}: each export needs its own socket", .0.display())]
    SocketTaken(PathBuf),
    /// A running export already serves this inherited descriptor.
    #[error("an export is already serving fd={0}: each export needs its own listening socket")]
    FdTaken(i32),
    /// An export was to start after the daemon began shutting down.
    #[error("the daemon is shutting down: no export can be added")]
    ShuttingDown,
    /// A frontend is connected and the request would cut it off.
    #[error("export {0} has a frontend connected: detach it first, or use mode=hard to drain and disconnect it")]
    InUse(String),
    /// The export could not be resized.
    #[error("cannot resize: {0}")]
    Resize(#[from] crate::engine::ResizeError),
    /// A snapshot was not taken.
    #[error(transparent)]
    Snapshot(#[from] crate::engine::SnapshotError),
    /// The daemon could not confine itself.
    #[error(transparent)]
    Sandbox(#[from] crate::sandbox::Error),
    /// An export names a path the confined daemon cannot reach.
    #[error(transparent)]
    OutsideSandbox(#[from] crate::sandbox::PathRefused),
}
