//! A client of mqblk's management API (JSON-RPC 2.0 over a unix socket, one object per line),
//! for the tests that add, remove and resize exports.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::daemon::{Daemon, Export, TestDir};

/// A daemon serving `exports` with the management API on `dir/api.sock`, and a client of it.
/// Exports the API adds may keep their images and sockets in `dir` (`--allow-dir`, as an
/// operator allows the directories of exports to come).
pub fn daemon_with_api(dir: &TestDir, exports: &[Export]) -> (Daemon, Api) {
    daemon_with_api_allowing(dir, &[], exports)
}

/// [`daemon_with_api`], allowing exports the API adds into `more` too (a Ceph cluster's
/// conf and keyring, say).
pub fn daemon_with_api_allowing(
    dir: &TestDir,
    more: &[&Path],
    exports: &[Export],
) -> (Daemon, Api) {
    daemon_with_api_and(dir, more, &[], exports)
}

/// [`daemon_with_api`], with more `serve` options.
pub fn daemon_with_api_args(dir: &TestDir, options: &[&str], exports: &[Export]) -> (Daemon, Api) {
    daemon_with_api_and(dir, &[], options, exports)
}

fn daemon_with_api_and(
    dir: &TestDir,
    more: &[&Path],
    options: &[&str],
    exports: &[Export],
) -> (Daemon, Api) {
    let api = dir.join("api.sock");
    let mut args = vec!["--api-socket", api.to_str().unwrap()];
    for d in std::iter::once(dir.path()).chain(more.iter().copied()) {
        args.extend(["--allow-dir", d.to_str().unwrap()]);
    }
    args.extend(options);
    let d = Daemon::start_args(dir, exports, &args);
    let a = Api::connect(&api);
    (d, a)
}

/// One connection to the API.
pub struct Api {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
    next_id: u64,
}

/// A JSON-RPC error: code and message.
pub type RpcError = (i64, String);

impl Api {
    /// Connects to `path`, waiting up to 10 s for the daemon to create it.
    pub fn connect(path: &Path) -> Api {
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("cannot connect to the API socket {}: {e}", path.display()),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("set a read timeout");
        let reader = BufReader::new(stream.try_clone().expect("clone the API stream"));
        Api {
            stream,
            reader,
            next_id: 1,
        }
    }

    /// Sends one line as it is and returns the reply line, parsed.
    pub fn raw(&mut self, line: &[u8]) -> Value {
        self.stream.write_all(line).expect("send to the API");
        self.stream.write_all(b"\n").expect("send to the API");
        self.reply()
    }

    fn reply(&mut self) -> Value {
        let mut reply = String::new();
        self.reader
            .read_line(&mut reply)
            .expect("read the API's reply");
        serde_json::from_str(&reply).unwrap_or_else(|e| panic!("API reply {reply:?}: {e}"))
    }

    /// Calls `method` with `params`; the result, or the error's code and message.
    pub fn call(&mut self, method: &str, params: Value) -> Result<Value, RpcError> {
        let id = self.next_id;
        self.next_id += 1;
        let req = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let reply = self.raw(req.to_string().as_bytes());
        assert_eq!(reply["id"], id, "reply to another request: {reply}");
        match reply.get("error") {
            Some(e) => Err((
                e["code"].as_i64().expect("an error code"),
                e["message"].as_str().expect("an error message").to_string(),
            )),
            None => Ok(reply["result"].clone()),
        }
    }

    /// Whether the daemon has closed this connection (its next read ends at once, with
    /// nothing).
    pub fn closed_by_daemon(&mut self) -> bool {
        let mut rest = String::new();
        matches!(self.reader.read_line(&mut rest), Ok(0))
    }

    /// [`Api::call`] that must succeed.
    pub fn ok(&mut self, method: &str, params: Value) -> Value {
        self.call(method, params)
            .unwrap_or_else(|e| panic!("{method}: error {e:?}"))
    }
}
