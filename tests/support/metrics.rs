//! The `--metrics` endpoint from outside: where the daemon serves it, and a plain HTTP GET.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use super::daemon::{Daemon, STARTUP_TIMEOUT};

/// Where the daemon serves its metrics: it was asked for port 0 and logs the one it got.
pub fn metrics_addr(d: &Daemon) -> SocketAddr {
    assert!(
        d.wait_for_log("serving metrics", STARTUP_TIMEOUT),
        "the daemon did not log its metrics address\n{}",
        d.log()
    );
    let log = d.log();
    let line = log.lines().find(|l| l.contains("serving metrics")).unwrap();
    let addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("addr="))
        .unwrap_or_else(|| panic!("no addr= in {line}"));
    addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"))
}

/// An HTTP GET of `path`: (status line, headers, body).
pub fn try_http_get(addr: SocketAddr, path: &str) -> std::io::Result<(String, String, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (head, body) = out
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {out}")))?;
    let (status, headers) = head.split_once("\r\n").unwrap_or((head, ""));
    Ok((status.to_string(), headers.to_string(), body.to_string()))
}

/// [`try_http_get`], panicking on failure.
pub fn http_get(addr: SocketAddr, path: &str) -> (String, String, String) {
    try_http_get(addr, path).unwrap_or_else(|e| panic!("GET http://{addr}{path}: {e}"))
}
