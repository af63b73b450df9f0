//! `mqblk serve --metrics`: the served text passes `promtool check metrics`, its counters match
//! what a client did request for request, and a real Prometheus server scrapes it.

mod support;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mqblk_client::{Client, RequestError};
use support::daemon::*;
use support::metrics::{http_get, metrics_addr, try_http_get};
use support::proc::{tool_version, Proc};
use support::qemu::SETUP_HINT;

const IMG_SIZE: u64 = 8 * MIB;

/// The samples of a scrape, by series: the name and its labels in sorted order, e.g.
/// `mqblk_requests_total{export="disk",op="read"}`.
struct Scrape {
    text: String,
    samples: BTreeMap<String, f64>,
}

impl Scrape {
    fn get(addr: SocketAddr) -> Scrape {
        let (status, headers, text) = http_get(addr, "/metrics");
        assert!(status.contains(" 200 "), "{status}\n{headers}\n{text}");
        assert!(
            headers
                .to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{headers}"
        );
        let mut samples = BTreeMap::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, value) = line.rsplit_once(' ').expect("a sample line");
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (series, ""),
            };
            let mut labels: Vec<&str> = labels.split(',').filter(|l| !l.is_empty()).collect();
            labels.sort();
            let key = format!("{name}{{{}}}", labels.join(","));
            let value = if value == "+Inf" {
                f64::INFINITY
            } else {
                value.parse().unwrap_or_else(|e| panic!("{line}: {e}"))
            };
            assert!(samples.insert(key, value).is_none(), "{line} twice");
        }
        Scrape { text, samples }
    }

    /// The value of `name` with `labels` (`key="value"` strings, any order); panics if absent.
    fn value(&self, name: &str, labels: &[&str]) -> f64 {
        let mut labels = labels.to_vec();
        labels.sort();
        let key = format!("{name}{{{}}}", labels.join(","));
        *self
            .samples
            .get(&key)
            .unwrap_or_else(|| panic!("no sample {key} in\n{}", self.text))
    }

    fn export(&self, name: &str, export: &str) -> f64 {
        self.value(name, &[&format!("export=\"{export}\"")])
    }

    fn op(&self, name: &str, export: &str, op: &str) -> f64 {
        self.value(
            name,
            &[&format!("export=\"{export}\""), &format!("op=\"{op}\"")],
        )
    }

    fn thread(&self, name: &str, export: &str, thread: usize) -> f64 {
        self.value(
            name,
            &[
                &format!("export=\"{export}\""),
                &format!("thread=\"{thread}\""),
            ],
        )
    }
}

/// `promtool check metrics` on `text`: its complaints, empty when it passes.
fn promtool_check(text: &str) -> Result<(), String> {
    tool_version("promtool");
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run promtool: {e}; {SETUP_HINT}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("promtool check metrics ({}): {said}", out.status))
    }
}

/// What the client did with one request type: requests sent, bytes of those that succeeded,
/// those that failed.
#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    requests: u64,
    bytes: u64,
    errors: u64,
}

/// The client's own counts, by type, and the requests each queue sent to the engine.
#[derive(Default, Debug)]
struct Counts {
    by_op: BTreeMap<&'static str, Tally>,
    /// Valid requests per queue (each reaches the engine; refused ones do not).
    submitted: [u64; 2],
}

impl Counts {
    fn book(&mut self, op: &'static str, q: usize, bytes: u64, r: Result<(), RequestError>) {
        let t = self.by_op.entry(op).or_default();
        t.requests += 1;
        match r {
            Ok(()) => {
                t.bytes += bytes;
                self.submitted[q] += 1;
            }
            Err(RequestError::Failed { .. }) => t.errors += 1,
            Err(e) => panic!("{op} on queue {q}: {e}"),
        }
    }
}

/// A fixed workload over both queues, every request type, some refused: what the client
/// counted.
fn fixed_workload(c: &mut Client) -> Counts {
    let cap = c.capacity();
    let mut n = Counts::default();
    for q in 0..2 {
        let reads = 6 + 3 * q as u64;
        for i in 0..reads {
            let mut buf = vec![0u8; 4096];
            let r = c.read(q, i * 4096, &mut buf);
            n.book("read", q, 4096, r);
        }
        for i in 0..5 - q as u64 {
            let r = c.write(q, MIB + i * 8192, &[0x5a; 8192]);
            n.book("write", q, 8192, r);
        }
        for _ in 0..3 {
            n.book("flush", q, 0, c.flush(q));
        }
        for i in 0..2 {
            let r = c.discard(q, 2 * MIB + i * 65536, 65536);
            n.book("discard", q, 65536, r);
        }
        for i in 0..1 + q as u64 {
            let r = c.write_zeroes(q, 3 * MIB + i * 16384, 16384, false);
            n.book("write_zeroes", q, 16384, r);
        }
        // Refused by the daemon as it parses them: errors of their type.
        for _ in 0..2 {
            let mut buf = vec![0u8; 4096];
            let r = c.read(q, cap, &mut buf);
            assert!(r.is_err(), "a read at the capacity succeeded");
            n.book("read", q, 4096, r);
        }
        let r = c.write(q, cap - 512, &[1; 4096]);
        assert!(r.is_err(), "a write across the end succeeded");
        n.book("write", q, 4096, r);
    }
    n
}

/// Scrapes until the daemon has answered `total` requests (the I/O threads publish their
/// counters once per loop iteration, just after answering), or 5 s have passed.
fn scrape_after(addr: SocketAddr, total: u64) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = Scrape::get(addr);
        let answered: f64 = ["read", "write", "flush", "discard", "write_zeroes"]
            .iter()
            .map(|op| s.op("mqblk_requests_total", "disk", op))
            .sum();
        if answered as u64 >= total || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The metrics count exactly what the client did, per type and per I/O thread, and the text
/// is one `promtool check metrics` accepts.
#[test]
fn metrics_match_the_clients_own_counts_and_pass_promtool() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, None);
    let sock = dir.join("disk.sock");
    let other = dir.join("idle.sock");
    let d = Daemon::start_args(
        &dir,
        &[
            Export::file(&sock, &img)
                .direct(false)
                .mapping(Mapping::PerQueue(2)),
            Export {
                path: None,
                engine: Some("null".into()),
                size: Some(MIB),
                ..Export::file(&other, "")
            },
        ],
        &["--metrics", "127.0.0.1:0"],
    );
    let addr = metrics_addr(&d);

    let before = Scrape::get(addr);
    promtool_check(&before.text).unwrap();
    assert_eq!(before.export("mqblk_connected_frontends", "disk"), 0.0);
    assert_eq!(
        before.export("mqblk_capacity_bytes", "disk"),
        IMG_SIZE as f64
    );
    assert_eq!(before.export("mqblk_capacity_bytes", "idle"), MIB as f64);

    let mut client = Client::connect(&sock, 2).expect("connect");
    let counts = fixed_workload(&mut client);
    let total: u64 = counts.by_op.values().map(|t| t.requests).sum();
    let s = scrape_after(addr, total);
    promtool_check(&s.text).unwrap();
    for (op, t) in &counts.by_op {
        let what = format!("{op}: the client counted {t:?}");
        assert_eq!(
            s.op("mqblk_requests_total", "disk", op),
            t.requests as f64,
            "{what}"
        );
        assert_eq!(
            s.op("mqblk_request_bytes_total", "disk", op),
            t.bytes as f64,
            "{what}"
        );
        assert_eq!(
            s.op("mqblk_request_errors_total", "disk", op),
            t.errors as f64,
            "{what}"
        );
        // Every answered request is in the latency histogram once.
        let h = "mqblk_request_latency_seconds";
        assert_eq!(
            s.op(&format!("{h}_count"), "disk", op),
            t.requests as f64,
            "{what}"
        );
        let inf = s.value(
            &format!("{h}_bucket"),
            &["export=\"disk\"", &format!("op=\"{op}\""), "le=\"+Inf\""],
        );
        assert_eq!(inf, t.requests as f64, "{what}");
        assert_eq!(s.op("mqblk_requests_total", "idle", op), 0.0);
    }
    assert_eq!(counts.by_op["read"].errors, 4);
    assert_eq!(s.export("mqblk_connected_frontends", "disk"), 1.0);
    assert_eq!(s.export("mqblk_in_flight_requests", "disk"), 0.0);
    assert_eq!(s.export("mqblk_reconnects_total", "disk"), 0.0);
    // Queue q is served by I/O thread q: each thread handed exactly its queue's valid
    // requests to the engine, was kicked, and notified the client.
    for q in 0..2 {
        let sent = s.thread("mqblk_thread_submitted_requests_total", "disk", q);
        assert_eq!(sent, counts.submitted[q] as f64, "thread {q}");
        for name in [
            "mqblk_thread_submits_total",
            "mqblk_thread_kicks_total",
            "mqblk_thread_notifications_total",
        ] {
            assert!(s.thread(name, "disk", q) >= 1.0, "{name} of thread {q}");
        }
        // Early notifications (notify-early) are some of the notifications: how many depends on
        // whether the thread had its CPU to itself, but never more than all of them.
        // So are those written alone (a polling thread with nothing else for the ring).
        let early = s.thread("mqblk_thread_early_notifications_total", "disk", q);
        let alone = s.thread("mqblk_thread_alone_notifications_total", "disk", q);
        let all = s.thread("mqblk_thread_notifications_total", "disk", q);
        assert!(
            early + alone <= all,
            "thread {q}: {early} early and {alone} alone of {all} notifications"
        );
    }

    // A second connection is a reconnect; after it leaves, nobody is connected.
    drop(client);
    let c = Client::connect(&sock, 2).expect("reconnect");
    let deadline = Instant::now() + Duration::from_secs(5);
    while Scrape::get(addr).export("mqblk_reconnects_total", "disk") < 1.0 {
        assert!(Instant::now() < deadline, "the reconnect was not counted");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Scrape::get(addr).export("mqblk_connected_frontends", "disk") != 0.0 {
        assert!(
            Instant::now() < deadline,
            "still connected after the client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, _, _) = http_get(addr, "/");
    assert!(status.contains(" 404 "), "{status}");
    d.terminate();
}

/// Prometheus's query API: the value of the one series `query` selects, once it has one.
fn prometheus_value(api: SocketAddr, query: &str) -> Option<f64> {
    let encoded: String = query
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    // Nothing yet while the server starts.
    let (status, _, body) = try_http_get(api, &format!("/api/v1/query?query={encoded}")).ok()?;
    if !status.contains(" 200 ") {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    let result = v["data"]["result"].as_array()?;
    let [one] = result.as_slice() else {
        return None;
    };
    one["value"][1].as_str()?.parse().ok()
}

/// A real Prometheus server scrapes the endpoint and stores what the client did.
#[test]
fn a_prometheus_server_scrapes_the_endpoint() {
    tool_version("prometheus");
    let dir = TestDir::new();
    let sock = dir.join("disk.sock");
    let d = Daemon::start_args(
        &dir,
        &[Export {
            path: None,
            engine: Some("null".into()),
            size: Some(IMG_SIZE),
            ..Export::file(&sock, "")
        }],
        &["--metrics", "127.0.0.1:0"],
    );
    let target = metrics_addr(&d);
    let mut c = Client::connect(&sock, 1).expect("connect");
    for i in 0..7u64 {
        c.write(0, i * 4096, &[7; 4096]).expect("write");
    }

    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: mqblk\n    static_configs:\n      \
             - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let api: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut cmd = Command::new("prometheus");
    cmd.arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={api}"));
    let log = dir.join("prometheus.log");
    let mut prom = Proc::spawn_logged("prometheus".into(), &mut cmd, &log);

    let query = r#"mqblk_requests_total{job="mqblk",export="disk",op="write"}"#;
    let deadline = Instant::now() + Duration::from_secs(60);
    let writes = loop {
        if let Some(v) = prometheus_value(api, query) {
            break v;
        }
        if let Ok(Some(status)) = prom.try_wait() {
            panic!(
                "prometheus exited ({status}):\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "prometheus stored no {query} within 60 s:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(writes, 7.0);
    assert_eq!(prometheus_value(api, r#"up{job="mqblk"}"#), Some(1.0));
    // Histograms parse too.
    assert_eq!(
        prometheus_value(
            api,
            r#"mqblk_request_latency_seconds_count{export="disk",op="write"}"#
        ),
        Some(7.0)
    );
    prom.kill();
    drop(c);
    d.terminate();
}
