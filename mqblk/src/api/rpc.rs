//! The management API: JSON-RPC 2.0 over a unix socket, one JSON object per line, many
//! clients at once (a thread each).
//!
//! Methods (`params` is an object):
//! - `export_add {id?, socket, ...every export key but fd}`: starts an export; returns its
//!   status (an inherited descriptor, `fd`, is taken only at startup);
//! - `export_del {id, mode?: "safe"|"hard"}`: `safe` (the default) refuses while a frontend
//!   is connected; `hard` drains its in-flight I/O and disconnects it;
//! - `export_list {}`, `export_get {id}`, `export_stats {id?}`;
//! - `export_resize {id, size?}`: `size` in bytes (a number, or a string with a K/M/G/T
//!   suffix); without it, the backing file or device is measured again;
//! - `export_set_qos {id, ...QoS keys}`: replaces the export's limits (none: no limit) or
//!   moves it into a throttle group (`group`);
//! - `export_snapshot {id, overlay}`: an external snapshot of a qcow2 export while it runs:
//!   a new overlay at `overlay` over the image, which is read-only from then on;
//! - `save_config {path}`: writes the TOML that recreates the running exports;
//! - `version {}`, `shutdown {}`.
//!
//! The socket is created 0600 whatever the umask, and a peer whose uid (SO_PEERCRED) is
//! neither root nor the daemon's own is told no and disconnected.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use rustix::fs::Mode;
use rustix::net::Shutdown;
use serde_json::{json, Map, Value};

use super::control::{Control, ControlError, RemoveMode};
use crate::config::{
    config_toml, keys, parse_size, qos_from_pairs, write_atomically, ExportConfig, QosConfig,
};

/// Longest request line accepted; a longer one is answered with a parse error and skipped.
pub const MAX_REQUEST: usize = 64 * 1024;
/// Most clients served at once; more are told no.
pub const MAX_CLIENTS: usize = 64;

/// Why a line got an error reply instead of a result. Each message is the reply's `message`;
/// [`RpcError::code`] its `code`.
#[derive(Debug, thiserror::Error)]
enum RpcError {
    /// The line is not JSON.
    #[error("not JSON: {0}")]
    NotJson(serde_json::Error),
    /// The line is longer than [`MAX_REQUEST`].
    #[error("request longer than {MAX_REQUEST} bytes")]
    TooLong,
    /// A batch without requests.
    #[error("an empty batch")]
    EmptyBatch,
    /// A request that is not a JSON object.
    #[error("a request must be a JSON object")]
    NotAnObject,
    /// A request without `"jsonrpc": "2.0"`.
    #[error("\"jsonrpc\" must be \"2.0\"")]
    NotVersion2,
    /// A request whose method is missing or not a string.
    #[error("\"method\" must be a string")]
    NoMethod,
    /// A peer whose credentials (SO_PEERCRED) cannot be read.
    #[error("cannot read the peer's credentials: {0}")]
    PeerUnknown(rustix::io::Errno),
    /// A peer that is neither root nor the daemon's user.
    #[error("uid {uid} may not manage this daemon (only root and uid {me})")]
    PeerNotAllowed {
        /// The peer's uid.
        uid: u32,
        /// The daemon's.
        me: u32,
    },
    /// A client beyond [`MAX_CLIENTS`].
    #[error("more than {MAX_CLIENTS} management clients at once")]
    TooManyClients,
    /// A method the API does not have.
    #[error("no method '{0}' (methods: export_add, export_del, export_list, export_get, export_stats, export_resize, export_set_qos, export_snapshot, save_config, version, shutdown)")]
    NoSuchMethod(String),
    /// A parameter refused, or what the daemon answered.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// Handling the request panicked: a bug of the daemon's.
    #[error("the daemon hit a bug while handling this request (its log has the panic); the connection is closed")]
    Internal,
}

impl RpcError {
    /// The JSON-RPC error code: the protocol's own for a line that is not a request (-32700,
    /// -32600) or names no method (-32601), the daemon's ([`ControlError::code`]) otherwise.
    fn code(&self) -> i64 {
        match self {
            RpcError::NotJson(_) | RpcError::TooLong => -32700,
            RpcError::EmptyBatch
            | RpcError::NotAnObject
            | RpcError::NotVersion2
            | RpcError::NoMethod
            | RpcError::PeerUnknown(_)
            | RpcError::PeerNotAllowed { .. }
            | RpcError::TooManyClients => -32600,
            RpcError::NoSuchMethod(_) => -32601,
            RpcError::Internal => -32603,
            RpcError::Control(e) => e.code(),
        }
    }
}

/// The running API server.
pub struct ApiServer {
    path: PathBuf,
    /// Shared with the accept thread, which serves it.
    listener: Arc<UnixListener>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Binds `path` (0600) and serves `control` on it from a thread of its own.
    pub fn start(path: &Path, control: Arc<dyn Control>) -> io::Result<ApiServer> {
        super::socket::remove_stale(path)?;
        // The socket file must never be connectable by others, not even between bind and
        // chmod: bind with a umask that leaves only the owner's bits.
        let old = rustix::process::umask(Mode::from_raw_mode(0o177));
        let bound = UnixListener::bind(path);
        rustix::process::umask(old);
        let listener = Arc::new(bound?);
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (listener, stop) = (listener.clone(), stop.clone());
            std::thread::Builder::new()
                .name("mqblk-api".into())
                .spawn(move || accept_loop(&listener, control, stop))?
        };
        Ok(ApiServer {
            path: path.to_path_buf(),
            listener,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops accepting and removes the socket file (clients being served finish their line).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Makes the accept thread's accept() return.
        let _ = rustix::net::shutdown(&*self.listener, Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn accept_loop(listener: &UnixListener, control: Arc<dyn Control>, stop: Arc<AtomicBool>) {
    let clients = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::SeqCst) {
        let Ok((stream, _)) = listener.accept() else {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            continue;
        };
        if let Err(e) = check_peer(&stream) {
            tracing::warn!(why = %e, "management API connection refused");
            let _ = reply_line(&stream, &error_reply(Value::Null, e));
            continue;
        }
        let Some(slot) = ClientSlot::take(&clients) else {
            let _ = reply_line(&stream, &error_reply(Value::Null, RpcError::TooManyClients));
            continue;
        };
        let control = control.clone();
        // Should the thread not start, the closure is dropped, and the slot with it.
        let _ = std::thread::Builder::new()
            .name("mqblk-api-client".into())
            .spawn(move || {
                let _slot = slot;
                serve_client(stream, &*control);
            });
    }
}

/// A client's place among the [`MAX_CLIENTS`]: given back when dropped, however its
/// connection ends (a panic included), so that no bug can use the places up.
struct ClientSlot(Arc<AtomicUsize>);

impl ClientSlot {
    /// A place, if fewer than [`MAX_CLIENTS`] are taken.
    fn take(clients: &Arc<AtomicUsize>) -> Option<ClientSlot> {
        if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            clients.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(ClientSlot(clients.clone()))
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Root and the daemon's own user may manage it; nobody else.
fn check_peer(stream: &UnixStream) -> Result<(), RpcError> {
    let cred = rustix::net::sockopt::socket_peercred(stream).map_err(RpcError::PeerUnknown)?;
    let (uid, me) = (cred.uid.as_raw(), rustix::process::geteuid().as_raw());
    if uid != 0 && uid != me {
        return Err(RpcError::PeerNotAllowed { uid, me });
    }
    Ok(())
}

fn reply_line(mut stream: &UnixStream, v: &Value) -> io::Result<()> {
    let mut line = serde_json::to_vec(v).expect("a Value serialises");
    line.push(b'\n');
    stream.write_all(&line)
}

/// Reads one request per line and answers it, until the client hangs up.
fn serve_client(stream: UnixStream, control: &dyn Control) {
    let mut reader = BufReader::new(match stream.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    });
    loop {
        let line = match read_line(&mut reader) {
            Ok(Some(Line::Text(l))) => l,
            Ok(Some(Line::TooLong)) => {
                if reply_line(&stream, &error_reply(Value::Null, RpcError::TooLong)).is_err() {
                    return;
                }
                continue;
            }
            Ok(None) | Err(_) => return,
        };
        if line.trim().is_empty() {
            continue;
        }
        // A bug reached through a request ends this connection, with an answer that says so,
        // and nothing else: the daemon's state is under locks that survive a panic.
        let handled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle_line(&line, control)));
        let Ok(reply) = handled else {
            tracing::error!("handling a management API request panicked; closing that connection");
            let _ = reply_line(&stream, &error_reply(request_id(&line), RpcError::Internal));
            return;
        };
        if let Some(r) = reply {
            if reply_line(&stream, &r).is_err() {
                return;
            }
        }
    }
}

enum Line {
    Text(String),
    TooLong,
}

/// The next line, without its newline; a line over [`MAX_REQUEST`] is consumed and reported.
fn read_line<R: BufRead>(r: &mut R) -> io::Result<Option<Line>> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(MAX_REQUEST as u64 + 1)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > MAX_REQUEST {
        // Skip the rest of the line.
        loop {
            let available = r.fill_buf()?;
            if available.is_empty() {
                break;
            }
            match available.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    r.consume(i + 1);
                    break;
                }
                None => {
                    let len = available.len();
                    r.consume(len);
                }
            }
        }
        return Ok(Some(Line::TooLong));
    }
    Ok(Some(Line::Text(String::from_utf8_lossy(&buf).into_owned())))
}

/// The id of the request on `line`, if it is one (null otherwise, as for a line that cannot
/// be read).
fn request_id(line: &str) -> Value {
    serde_json::from_str::<Value>(line)
        .ok()
        .and_then(|v| v.get("id").cloned())
        .unwrap_or(Value::Null)
}

fn error_reply(id: Value, e: RpcError) -> Value {
    json!({"jsonrpc": "2.0", "error": {"code": e.code(), "message": e.to_string()}, "id": id})
}

/// Answers one line: a request, a notification (no answer) or a batch.
pub fn handle_line(line: &str, control: &dyn Control) -> Option<Value> {
    let v: Value = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return Some(error_reply(Value::Null, RpcError::NotJson(e))),
    };
    match v {
        Value::Array(batch) if batch.is_empty() => {
            Some(error_reply(Value::Null, RpcError::EmptyBatch))
        }
        Value::Array(batch) => {
            let replies: Vec<Value> = batch
                .into_iter()
                .filter_map(|r| handle_request(r, control))
                .collect();
            (!replies.is_empty()).then_some(Value::Array(replies))
        }
        other => handle_request(other, control),
    }
}

fn handle_request(v: Value, control: &dyn Control) -> Option<Value> {
    let Value::Object(mut req) = v else {
        return Some(error_reply(Value::Null, RpcError::NotAnObject));
    };
    let id = req.remove("id");
    let reply_id = id.clone().unwrap_or(Value::Null);
    if req.get("jsonrpc") != Some(&Value::from("2.0")) {
        return Some(error_reply(reply_id, RpcError::NotVersion2));
    }
    let Some(Value::String(method)) = req.remove("method") else {
        return Some(error_reply(reply_id, RpcError::NoMethod));
    };
    let params = match req.remove("params") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Some(error_reply(
                reply_id,
                invalid("\"params\" must be an object of named parameters"),
            ))
        }
    };
    let result = call(&method, params, control);
    // A request without an id is a notification: no answer, even to an error.
    id.as_ref()?;
    Some(match result {
        Ok(r) => json!({"jsonrpc": "2.0", "result": r, "id": reply_id}),
        Err(e) => error_reply(reply_id, e),
    })
}

fn invalid(msg: impl Into<String>) -> RpcError {
    RpcError::Control(ControlError::InvalidParams(msg.into()))
}

/// Checks that `params` has only the names in `allowed`.
fn only(params: &Map<String, Value>, method: &str, allowed: &[&str]) -> Result<(), RpcError> {
    match params.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(invalid(format!(
            "{method} has no parameter '{k}' (it takes: {})",
            if allowed.is_empty() {
                "none".to_string()
            } else {
                allowed.join(", ")
            }
        ))),
        None => Ok(()),
    }
}

fn string_param(params: &Map<String, Value>, name: &str) -> Result<Option<String>, RpcError> {
    match params.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(invalid(format!("'{name}' must be a string, not {other}"))),
    }
}

fn required(params: &Map<String, Value>, name: &str) -> Result<String, RpcError> {
    string_param(params, name)?.ok_or_else(|| invalid(format!("'{name}' is required")))
}

/// A parameter as an export key's value: strings as they are, numbers and booleans written out.
fn key_value(name: &str, v: &Value) -> Result<String, RpcError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Bool(b) => Ok(if *b { "on" } else { "off" }.into()),
        other => Err(invalid(format!(
            "'{name}' must be a string, a number or a boolean, not {other}"
        ))),
    }
}

/// QoS settings as the keys that set them.
fn qos_pairs(qos: &QosConfig) -> Map<String, Value> {
    let cfg = ExportConfig {
        qos: Some(qos.clone()),
        ..ExportConfig::default()
    };
    keys::pairs(&cfg)
        .into_iter()
        .filter(|(k, _)| keys::is_qos_key(k))
        .map(|(k, v)| (k.to_string(), Value::String(v)))
        .collect()
}

fn call(
    method: &str,
    params: Map<String, Value>,
    control: &dyn Control,
) -> Result<Value, RpcError> {
    match method {
        "export_add" => {
            // An inherited descriptor is the daemon's to hand out at startup only: taken here,
            // it could be one the daemon already owns (this socket, another export's), which
            // would then have two owners closing it.
            if params.contains_key("fd") {
                return Err(invalid(
                    "'fd' is accepted only at startup (--export / --config): the management API cannot hand over a descriptor",
                ));
            }
            let mut pairs = Vec::with_capacity(params.len());
            for (k, v) in &params {
                pairs.push((k.as_str(), key_value(k, v)?));
            }
            let cfg = ExportConfig::from_pairs(pairs).map_err(|e| invalid(e.to_string()))?;
            Ok(json!(control.add(cfg)?))
        }
        "export_del" => {
            only(&params, method, &["id", "mode"])?;
            let id = required(&params, "id")?;
            let mode = match string_param(&params, "mode")?.as_deref() {
                None | Some("safe") => RemoveMode::Safe,
                Some("hard") => RemoveMode::Hard,
                Some(m) => return Err(invalid(format!("'mode' is '{m}': safe or hard"))),
            };
            control.remove(&id, mode)?;
            Ok(json!({"id": id, "removed": true}))
        }
        "export_list" => {
            only(&params, method, &[])?;
            Ok(json!(control.list()))
        }
        "export_get" => {
            only(&params, method, &["id"])?;
            let id = required(&params, "id")?;
            let (cfg, status) = control.get(&id)?;
            let config: Map<String, Value> = keys::pairs(&cfg)
                .into_iter()
                .map(|(k, v)| (k.to_string(), Value::String(v)))
                .collect();
            Ok(json!({"config": config, "status": status}))
        }
        "export_stats" => {
            only(&params, method, &["id"])?;
            let list = control.list();
            let list = match string_param(&params, "id")? {
                Some(id) => {
                    let one: Vec<_> = list.into_iter().filter(|s| s.id == id).collect();
                    if one.is_empty() {
                        return Err(ControlError::NoSuchExport(id).into());
                    }
                    one
                }
                None => list,
            };
            let stats: Vec<Value> = list
                .into_iter()
                .map(|s| json!({"id": s.id, "counters": s.counters, "per_thread": s.per_thread}))
                .collect();
            Ok(json!(stats))
        }
        "export_resize" => {
            only(&params, method, &["id", "size"])?;
            let id = required(&params, "id")?;
            let size = match params.get("size") {
                None | Some(Value::Null) => None,
                Some(v) => {
                    let text = key_value("size", v)?;
                    Some(parse_size(&text).filter(|n| *n > 0 && n % 512 == 0).ok_or_else(|| {
                        invalid(format!("'size' is {text}: a positive multiple of 512 bytes, with an optional K/M/G/T suffix"))
                    })?)
                }
            };
            Ok(json!(control.resize(&id, size)?))
        }
        "export_snapshot" => {
            only(&params, method, &["id", "overlay"])?;
            let id = required(&params, "id")?;
            let overlay = PathBuf::from(required(&params, "overlay")?);
            Ok(json!(control.snapshot(&id, &overlay)?))
        }
        "export_set_qos" => {
            let id = required(&params, "id")?;
            let mut pairs = Vec::new();
            for (k, v) in params.iter().filter(|(k, _)| k.as_str() != "id") {
                pairs.push((k.as_str(), key_value(k, v)?));
            }
            let qos = qos_from_pairs(pairs).map_err(|e| invalid(e.to_string()))?;
            let now = control.set_qos(&id, qos)?;
            Ok(json!({"id": id, "qos": qos_pairs(&now)}))
        }
        "save_config" => {
            only(&params, method, &["path"])?;
            let path = PathBuf::from(required(&params, "path")?);
            let text = config_toml(&control.configs());
            write_atomically(&path, &text).map_err(|e| {
                ControlError::Failed(format!("cannot write {}: {e}", path.display()))
            })?;
            Ok(json!({"path": path, "exports": control.configs().len()}))
        }
        #[cfg(debug_assertions)]
        "debug_inject_fault" => {
            only(&params, method, &["id", "thread", "fault"])?;
            let id = required(&params, "id")?;
            let fault = required(&params, "fault")?
                .parse()
                .map_err(|e: crate::io::fault_injection::UnknownFault| invalid(e.to_string()))?;
            let thread = match params.get("thread") {
                None => 0,
                Some(v) => v
                    .as_u64()
                    .and_then(|t| usize::try_from(t).ok())
                    .ok_or_else(|| invalid(format!("'thread' is {v}: an I/O thread's index")))?,
            };
            control.inject_fault(&id, thread, fault)?;
            Ok(json!({"id": id, "thread": thread, "injected": true}))
        }
        #[cfg(debug_assertions)]
        "debug_panic" => {
            only(&params, method, &[])?;
            panic!("debug_panic: a test's panic on a management API thread");
        }
        "version" => {
            only(&params, method, &[])?;
            Ok(json!({"name": "mqblk", "version": env!("CARGO_PKG_VERSION")}))
        }
        "shutdown" => {
            only(&params, method, &[])?;
            control.shutdown();
            Ok(json!({"shutting_down": true}))
        }
        other => Err(RpcError::NoSuchMethod(other.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ExportStatus;
    use std::sync::Mutex;

    /// A daemon that only records what it was asked.
    #[derive(Default)]
    struct Recorder {
        added: Mutex<Vec<ExportConfig>>,
        #[cfg(debug_assertions)]
        faults: Mutex<Vec<(String, usize, crate::io::fault_injection::Fault)>>,
    }

    fn status(cfg: &ExportConfig) -> ExportStatus {
        ExportStatus {
            id: cfg.id.clone(),
            socket: cfg.socket.clone(),
            engine: "null".into(),
            capacity: cfg.size.unwrap_or(0),
            queues: cfg.queues,
            threads: cfg.num_threads(),
            mapping: cfg.mapping_name().into(),
            readonly: cfg.readonly,
            connected: false,
            connections: 0,
            waiting_for_disk: false,
            in_flight: 0,
            table_memory: None,
            metadata: None,
            failure: None,
            counters: Default::default(),
            per_thread: Vec::new(),
        }
    }

    impl Control for Recorder {
        fn add(&self, cfg: ExportConfig) -> Result<ExportStatus, ControlError> {
            let mut added = self.added.lock().unwrap();
            if added.iter().any(|c| c.id == cfg.id) {
                return Err(ControlError::Conflict(format!("id={} is taken", cfg.id)));
            }
            added.push(cfg.clone());
            Ok(status(&cfg))
        }
        fn remove(&self, id: &str, _mode: RemoveMode) -> Result<(), ControlError> {
            let mut added = self.added.lock().unwrap();
            let n = added.len();
            added.retain(|c| c.id != id);
            if added.len() == n {
                return Err(ControlError::NoSuchExport(id.into()));
            }
            Ok(())
        }
        fn list(&self) -> Vec<ExportStatus> {
            self.added.lock().unwrap().iter().map(status).collect()
        }
        fn get(&self, id: &str) -> Result<(ExportConfig, ExportStatus), ControlError> {
            let added = self.added.lock().unwrap();
            let c = added
                .iter()
                .find(|c| c.id == id)
                .ok_or_else(|| ControlError::NoSuchExport(id.into()))?;
            Ok((c.clone(), status(c)))
        }
        fn resize(&self, id: &str, _size: Option<u64>) -> Result<ExportStatus, ControlError> {
            self.get(id).map(|(_, s)| s)
        }
        fn set_qos(&self, id: &str, qos: QosConfig) -> Result<QosConfig, ControlError> {
            self.get(id).map(|_| qos)
        }
        fn snapshot(
            &self,
            id: &str,
            _overlay: &std::path::Path,
        ) -> Result<ExportStatus, ControlError> {
            self.get(id).map(|(_, s)| s)
        }
        fn configs(&self) -> Vec<ExportConfig> {
            self.added.lock().unwrap().clone()
        }
        fn shutdown(&self) {}
        #[cfg(debug_assertions)]
        fn inject_fault(
            &self,
            id: &str,
            thread: usize,
            fault: crate::io::fault_injection::Fault,
        ) -> Result<(), ControlError> {
            self.get(id)?;
            self.faults.lock().unwrap().push((id.into(), thread, fault));
            Ok(())
        }
    }

    #[test]
    fn client_places_are_given_back_however_a_client_ends() {
        let clients = Arc::new(AtomicUsize::new(0));
        let mut held: Vec<ClientSlot> = (0..MAX_CLIENTS)
            .map(|_| ClientSlot::take(&clients).expect("a place"))
            .collect();
        assert!(ClientSlot::take(&clients).is_none(), "one place too many");
        held.pop();
        let again = ClientSlot::take(&clients).expect("the place given back");
        // A client thread that panics drops its place as it unwinds.
        let r = std::thread::spawn(move || {
            let _slot = again;
            panic!("a client's bug");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(clients.load(Ordering::SeqCst), MAX_CLIENTS - 1);
        drop(held);
        assert_eq!(clients.load(Ordering::SeqCst), 0);
    }

    #[cfg(debug_assertions)]
    #[test]
    fn debug_inject_fault_checks_its_parameters() {
        use crate::io::fault_injection::Fault;
        let c = Recorder::default();
        ask(
            &c,
            r#"{"jsonrpc":"2.0","id":1,"method":"export_add","params":{"socket":"/tmp/a.sock","engine":"null","size":"1M"}}"#,
        );
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":2,"method":"debug_inject_fault","params":{"id":"a","fault":"explode"}}"#,
        );
        assert_eq!(code(&r), -32602, "{r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("panic or forbidden-syscall"),
            "{r}"
        );
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":3,"method":"debug_inject_fault","params":{"id":"b","fault":"panic"}}"#,
        );
        assert_eq!(code(&r), -32001, "{r}");
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":4,"method":"debug_inject_fault","params":{"id":"a","thread":1,"fault":"forbidden-syscall"}}"#,
        );
        assert_eq!(r["result"]["injected"], true, "{r}");
        assert_eq!(
            *c.faults.lock().unwrap(),
            vec![("a".to_string(), 1, Fault::ForbiddenSyscall)]
        );
    }

    fn ask(c: &Recorder, line: &str) -> Value {
        handle_line(line, c).expect("a reply")
    }

    fn code(v: &Value) -> i64 {
        v["error"]["code"]
            .as_i64()
            .unwrap_or_else(|| panic!("no error in {v}"))
    }

    #[test]
    fn requests_and_their_errors() {
        let c = Recorder::default();
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":1,"method":"export_add","params":{"socket":"/tmp/a.sock","engine":"null","size":"1M","queues":2,"readonly":true}}"#,
        );
        assert_eq!(r["result"]["id"], "a", "{r}");
        assert_eq!(r["result"]["queues"], 2);
        assert_eq!(r["id"], 1);
        // Errors name the problem, with JSON-RPC codes.
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":2,"method":"export_add","params":{"socket":"/tmp/a.sock","engine":"null","size":"1M"}}"#,
        );
        assert_eq!(code(&r), -32002, "{r}");
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":3,"method":"export_add","params":{"socket":"/tmp/b.sock","queues":"many"}}"#,
        );
        assert_eq!(code(&r), -32602);
        assert!(
            r["error"]["message"].as_str().unwrap().contains("queues"),
            "{r}"
        );
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":4,"method":"export_add","params":{"socket":"/tmp/b.sock","queues":[1]}}"#,
        );
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("'queues' must be"),
            "{r}"
        );
        assert_eq!(
            code(&ask(&c, r#"{"jsonrpc":"2.0","id":5,"method":"fly"}"#)),
            -32601
        );
        assert_eq!(code(&ask(&c, "{not json")), -32700);
        assert_eq!(
            code(&ask(&c, r#"{"jsonrpc":"1.0","id":6,"method":"version"}"#)),
            -32600
        );
        assert_eq!(code(&ask(&c, r#"[1]"#)[0]), -32600);
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":7,"method":"export_del","params":{"id":"a","mode":"gentle"}}"#,
        );
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("safe or hard"),
            "{r}"
        );
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":8,"method":"export_del","params":{"id":"a"}}"#,
        );
        assert_eq!(r["result"]["removed"], true, "{r}");
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":9,"method":"export_del","params":{"id":"a"}}"#,
        );
        assert_eq!(code(&r), -32001, "a second delete: {r}");
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":10,"method":"export_list","params":{"verbose":1}}"#,
        );
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("no parameter 'verbose'"),
            "{r}"
        );
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":11,"method":"export_resize","params":{"id":"x","size":"7"}}"#,
        );
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("'size' is 7"),
            "{r}"
        );
        let r = ask(
            &c,
            r#"{"jsonrpc":"2.0","id":12,"method":"export_add","params":{"socket":"/tmp/c.sock","engine":"null","size":"1M","fd":3}}"#,
        );
        assert_eq!(code(&r), -32602, "{r}");
        assert!(
            r["error"]["message"]
                .as_str()
                .unwrap()
                .contains("'fd' is accepted only at startup"),
            "{r}"
        );
        assert!(c.configs().iter().all(|cfg| cfg.fd.is_none()));
        // A notification gets no answer; a batch gets one per request.
        assert!(handle_line(r#"{"jsonrpc":"2.0","method":"version"}"#, &c).is_none());
        let r = ask(
            &c,
            r#"[{"jsonrpc":"2.0","id":1,"method":"version"},{"jsonrpc":"2.0","id":2,"method":"export_list"}]"#,
        );
        assert_eq!(r.as_array().unwrap().len(), 2);
    }

    #[test]
    fn saved_config_recreates_the_exports() {
        let c = Recorder::default();
        for line in [
            r#"{"jsonrpc":"2.0","id":1,"method":"export_add","params":{"socket":"/tmp/a.sock","path":"/img","queues":4,"direct":false,"cpus":"0-3"}}"#,
            r#"{"jsonrpc":"2.0","id":2,"method":"export_add","params":{"socket":"/tmp/b.sock","engine":"mem","size":"64M","id":"scratch"}}"#,
        ] {
            assert!(ask(&c, line).get("result").is_some());
        }
        let text = config_toml(&c.configs());
        let (again, _) = crate::config::parse_config_file(&text).unwrap();
        assert_eq!(again, c.configs(), "{text}");
    }

    #[test]
    fn over_long_lines_are_refused_and_skipped() {
        let mut input = vec![b'x'; MAX_REQUEST * 3];
        input.extend_from_slice(b"\n{\"after\":1}\n");
        let mut r = std::io::Cursor::new(input);
        assert!(matches!(read_line(&mut r).unwrap(), Some(Line::TooLong)));
        match read_line(&mut r).unwrap() {
            Some(Line::Text(t)) => assert_eq!(t, "{\"after\":1}"),
            _ => panic!("the next line is read whole"),
        }
        assert!(read_line(&mut r).unwrap().is_none());
    }
}
