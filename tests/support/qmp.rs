//! A QMP client: QEMU's JSON monitor on a unix socket (`-qmp unix:PATH,server=on,wait=off`).
//! Commands and their answers; asynchronous events are skipped.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long one command may take.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects to the monitor at `path` (waiting up to `timeout` for QEMU to create it) and
    /// leaves capabilities negotiation mode.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, String> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("QMP socket {}: {e}", path.display()))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream
            .set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(|e| format!("QMP socket: {e}"))?;
        let writer = stream.try_clone().map_err(|e| format!("QMP socket: {e}"))?;
        let mut q = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = q.line()?;
        if greeting.get("QMP").is_none() {
            return Err(format!("not a QMP greeting: {greeting}"));
        }
        q.cmd("qmp_capabilities", json!({}))?;
        Ok(q)
    }

    fn line(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Err("QMP: QEMU closed the monitor".into()),
            Ok(_) => serde_json::from_str(&line).map_err(|e| format!("QMP: {e}: {line:?}")),
            Err(e) => Err(format!("QMP: {e}")),
        }
    }

    /// Runs `name` with `args`; its "return" value, or its error as text.
    pub fn cmd(&mut self, name: &str, args: Value) -> Result<Value, String> {
        let msg = json!({ "execute": name, "arguments": args });
        writeln!(self.writer, "{msg}").map_err(|e| format!("QMP {name}: {e}"))?;
        loop {
            let v = self.line().map_err(|e| format!("{name}: {e}"))?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(format!("QMP {name} failed: {e}"));
            }
            // An event ("event": ...): not what we wait for.
        }
    }
}
