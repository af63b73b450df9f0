//! `mqblk ctl`: one request to a running daemon's management API, the reply printed as JSON
//! (or, with `--table`, as a table).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};

/// `mqblk ctl --help`'s list of methods.
pub const HELP: &str = "\
Methods and their parameters (key=value):
  export_add     id=NAME socket=PATH ... (every key of `mqblk serve --export`)
  export_del     id=NAME [mode=safe|hard]   safe refuses while a frontend is connected;
                                            hard drains its I/O and disconnects it
  export_list
  export_get     id=NAME
  export_stats   [id=NAME]
  export_resize  id=NAME [size=BYTES]       without size: re-read the file or device
  export_set_qos id=NAME [iops-total=N ...] the export's limits from now on (none: no limit)
  export_snapshot id=NAME overlay=PATH      qcow2: writes go to a new overlay at PATH over the
                                            image, which is read-only (a backup) from then on
  save_config    path=FILE.toml
  version
  shutdown

Example:
  mqblk ctl --api-socket /run/mqblk/api.sock export_add id=vm2 socket=/run/mqblk/vm2.sock \\
      path=/var/lib/images/vm2.raw queues=4
  mqblk ctl --api-socket /run/mqblk/api.sock --table export_list";

/// `mqblk ctl` arguments.
#[derive(clap::Args, Debug)]
pub struct CtlArgs {
    /// The daemon's management socket (`mqblk serve --api-socket`).
    #[arg(long, value_name = "PATH")]
    api_socket: PathBuf,
    /// Print a table instead of JSON.
    #[arg(long)]
    table: bool,
    /// The method to call.
    method: String,
    /// Its parameters, key=value.
    #[arg(value_name = "KEY=VALUE")]
    params: Vec<String>,
}

/// How long the daemon may take to answer (a hard export_del waits for a drain).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

pub fn run(args: &CtlArgs) -> anyhow::Result<()> {
    let mut params = Map::new();
    for p in &args.params {
        let (k, v) = p
            .split_once('=')
            .with_context(|| format!("parameter '{p}' has no value: write {p}=VALUE"))?;
        params.insert(k.to_string(), Value::String(v.to_string()));
    }
    let request = json!({"jsonrpc": "2.0", "id": 1, "method": args.method, "params": params});
    let mut stream = UnixStream::connect(&args.api_socket).with_context(|| {
        format!(
            "cannot connect to --api-socket {}",
            args.api_socket.display()
        )
    })?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let mut line = serde_json::to_vec(&request)?;
    line.push(b'\n');
    // A daemon that refuses this client answers and hangs up before reading: its answer is
    // still there to read.
    if let Err(e) = stream.write_all(&line) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e).context("sending the request");
        }
    }
    let mut reply = String::new();
    BufReader::new(&stream)
        .read_line(&mut reply)
        .context("reading the daemon's answer")?;
    let reply: Value = serde_json::from_str(&reply).context("the daemon's answer is not JSON")?;
    if let Some(e) = reply.get("error") {
        bail!(
            "{} (error {})",
            e["message"].as_str().unwrap_or("unknown error"),
            e["code"]
        );
    }
    let result = &reply["result"];
    if args.table {
        print!("{}", table(result));
    } else {
        println!("{}", serde_json::to_string_pretty(result)?);
    }
    Ok(())
}

/// A result as a table: a list of objects one row each (their scalar fields as columns), an
/// object one `key  value` line per field.
fn table(v: &Value) -> String {
    let cell = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        Value::Object(_) | Value::Array(_) => "…".into(),
        other => other.to_string(),
    };
    let mut out = String::new();
    match v {
        Value::Array(rows) if rows.iter().all(Value::is_object) && !rows.is_empty() => {
            let cols: Vec<&String> = rows[0]
                .as_object()
                .map(|o| {
                    o.iter()
                        .filter(|(_, v)| !v.is_object() && !v.is_array())
                        .map(|(k, _)| k)
                        .collect()
                })
                .unwrap_or_default();
            let cells: Vec<Vec<String>> = rows
                .iter()
                .map(|r| cols.iter().map(|c| cell(&r[c.as_str()])).collect())
                .collect();
            let widths: Vec<usize> = cols
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    cells
                        .iter()
                        .map(|r| r[i].len())
                        .chain([c.len()])
                        .max()
                        .unwrap_or(0)
                })
                .collect();
            let line = |items: Vec<String>| {
                items
                    .iter()
                    .zip(&widths)
                    .map(|(s, w)| format!("{s:<w$}"))
                    .collect::<Vec<_>>()
                    .join("  ")
                    .trim_end()
                    .to_string()
                    + "\n"
            };
            out += &line(cols.iter().map(|c| c.to_string()).collect());
            for r in cells {
                out += &line(r);
            }
        }
        Value::Object(o) => {
            let w = o.keys().map(String::len).max().unwrap_or(0);
            for (k, v) in o {
                match v {
                    Value::Object(inner) => {
                        out += &format!("{k}:\n");
                        for (ik, iv) in inner {
                            out += &format!("  {ik:<w$}  {}\n", cell(iv));
                        }
                    }
                    _ => out += &format!("{k:<w$}  {}\n", cell(v)),
                }
            }
        }
        other => out += &format!("{}\n", cell(other)),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables() {
        let v = json!([{"id": "a", "queues": 2, "counters": {"requests": 1}}, {"id": "bb", "queues": 16, "counters": {}}]);
        assert_eq!(table(&v), "id  queues\na   2\nbb  16\n");
        let v = json!({"config": {"socket": "/s"}, "status": {"id": "a"}});
        assert!(table(&v).contains("config:\n  socket"));
    }
}
