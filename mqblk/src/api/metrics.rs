//! `mqblk serve --metrics ADDR:PORT`: the exports' counters in the Prometheus text format, over
//! HTTP at `/metrics`.
//!
//! Nothing is counted here: each scrape takes the exports' status (the I/O threads' own
//! counters, summed when read) through the function the daemon hands over, and writes it out.
//! A metric that shows an I/O thread counter takes its help from the counter's description
//! (`IoCounters::HELP`). The HTTP server is `tiny_http`, answered by one thread; the text is
//! written with `prometheus-client`'s encoders.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, NoLabelSet,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::ExportStatus;
use crate::blk::ReqType;
use crate::io::stats::{latency_bucket_bound, LATENCY_BUCKETS};
use crate::io::IoCounters;

/// The content type of the Prometheus text format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The metrics endpoint: bound at once (so that a busy port fails the start), answering once
/// [`Metrics::start`] hands it the exports.
pub struct Metrics {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Metrics {
    /// Listens on `addr` (port 0: any free port; see [`Metrics::local_addr`]).
    pub fn bind(addr: SocketAddr) -> io::Result<Metrics> {
        let server = tiny_http::Server::http(addr).map_err(|e| {
            // tiny_http boxes the bind error; keep its kind when it is an io::Error.
            match e.downcast::<io::Error>() {
                Ok(e) => *e,
                Err(e) => io::Error::other(e.to_string()),
            }
        })?;
        let addr = server.server_addr().to_ip().unwrap_or(addr);
        Ok(Metrics {
            server: Arc::new(server),
            addr,
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts answering scrapes with what `exports` returns at each one.
    pub fn start<F>(&mut self, exports: F) -> io::Result<()>
    where
        F: Fn() -> Vec<ExportStatus> + Send + 'static,
    {
        let (server, stop) = (self.server.clone(), self.stop.clone());
        let thread = std::thread::Builder::new()
            .name("mqblk-metrics".into())
            .spawn(move || serve(&server, &stop, exports))?;
        self.thread = Some(thread);
        Ok(())
    }

    /// Stops answering; returns once the serving thread (and with it `exports`) is gone.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(server: &tiny_http::Server, stop: &AtomicBool, exports: impl Fn() -> Vec<ExportStatus>) {
    loop {
        let rq = match server.recv() {
            Ok(rq) => rq,
            Err(_) if stop.load(Ordering::SeqCst) => return,
            Err(e) => {
                tracing::warn!(err = %e, "metrics endpoint: accept failed");
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        let path = rq.url().split('?').next().unwrap_or_default();
        let get = matches!(
            rq.method(),
            tiny_http::Method::Get | tiny_http::Method::Head
        );
        let response = match (path, get) {
            ("/metrics", true) => match encode(&exports()) {
                Ok(text) => tiny_http::Response::from_string(text).with_header(
                    tiny_http::Header::from_bytes("Content-Type", CONTENT_TYPE)
                        .expect("a valid header"),
                ),
                Err(_) => {
                    tiny_http::Response::from_string("encoding failed\n").with_status_code(500)
                }
            },
            ("/metrics", false) => {
                tiny_http::Response::from_string("GET only\n").with_status_code(405)
            }
            _ => tiny_http::Response::from_string("mqblk serves its metrics at /metrics\n")
                .with_status_code(404),
        };
        if let Err(e) = rq.respond(response) {
            tracing::debug!(err = %e, "metrics endpoint: cannot answer a scrape");
        }
    }
}

/// The exports in the Prometheus text format.
pub fn encode(exports: &[ExportStatus]) -> Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(exports.to_vec())));
    let mut text = String::new();
    prometheus_client::encoding::text::encode_registry(&mut text, &registry)?;
    Ok(text)
}

/// One scrape's exports.
#[derive(Debug)]
struct Snapshot(Vec<ExportStatus>);

/// Labels of one export.
fn export(e: &ExportStatus) -> [(&'static str, &str); 1] {
    [("export", e.id.as_str())]
}

/// Writes a counter family of the Prometheus text format, whose name carries the `_total`
/// suffix on its HELP and TYPE lines as on its samples. (prometheus-client's own
/// `encode_counter` writes OpenMetrics, which names the family without the suffix; `promtool`
/// and Prometheus's text parser then see untyped samples without help.) The plain sample
/// writer is the one its gauges use.
fn counter<L: EncodeLabelSet, V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) -> fmt::Result {
    family(enc, name, help, MetricType::Counter, samples)
}

fn gauge<L: EncodeLabelSet, V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) -> fmt::Result {
    family(enc, name, help, MetricType::Gauge, samples)
}

fn family<L: EncodeLabelSet, V: EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    ty: MetricType,
    samples: impl IntoIterator<Item = (L, V)>,
) -> fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, ty)?;
    for (labels, v) in samples {
        m.encode_family(&labels)?.encode_gauge(&v)?;
    }
    Ok(())
}

impl Snapshot {
    /// Every (export, request type) pair with `f` of the export's counters for that type.
    fn per_type(&self, f: impl Fn(&IoCounters, usize) -> u64) -> Vec<([(&str, &str); 2], u64)> {
        let mut out = Vec::new();
        for e in &self.0 {
            for t in ReqType::ALL {
                let labels = [("export", e.id.as_str()), ("op", t.name())];
                out.push((labels, f(&e.counters, t as usize)));
            }
        }
        out
    }

    /// Every (export, I/O thread) pair with `f` of that thread's counters.
    fn per_thread(&self, f: impl Fn(&IoCounters) -> u64) -> Vec<([(&str, String); 2], u64)> {
        let mut out = Vec::new();
        for e in &self.0 {
            for (i, c) in e.per_thread.iter().enumerate() {
                let labels = [("export", e.id.clone()), ("thread", i.to_string())];
                out.push((labels, f(c)));
            }
        }
        out
    }
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let enc = &mut enc;
        let exports = &self.0;
        // The counters' help is their own description, defined with them.
        let help = &IoCounters::HELP;
        counter(
            enc,
            "mqblk_requests_total",
            help.op_requests,
            self.per_type(|c, t| c.op_requests[t]),
        )?;
        counter(
            enc,
            "mqblk_request_bytes_total",
            help.op_bytes,
            self.per_type(|c, t| c.op_bytes[t]),
        )?;
        counter(
            enc,
            "mqblk_request_errors_total",
            help.op_errors,
            self.per_type(|c, t| c.op_errors[t]),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "mqblk_request_latency_seconds",
                help.op_latency,
                None,
                MetricType::Histogram,
            )?;
            for e in exports {
                for t in ReqType::ALL {
                    let i = t as usize;
                    let buckets: Vec<(f64, u64)> = (0..LATENCY_BUCKETS)
                        .map(|b| {
                            let bound = latency_bucket_bound(b).unwrap_or(f64::INFINITY);
                            (bound, e.counters.op_latency[i][b])
                        })
                        .collect();
                    // The count from the buckets themselves, so that a scrape racing with a
                    // publish still shows a consistent histogram.
                    let count = buckets.iter().map(|b| b.1).sum();
                    let sum = e.counters.op_latency_ns[i] as f64 * 1e-9;
                    let labels = [("export", e.id.as_str()), ("op", t.name())];
                    m.encode_family(&labels)?
                        .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
                }
            }
        }
        gauge(
            enc,
            "mqblk_in_flight_requests",
            "Requests in flight at the storage engine now.",
            exports.iter().map(|e| (export(e), e.in_flight)),
        )?;
        counter(
            enc,
            "mqblk_in_flight_request_seconds_total",
            help.engine_in_flight_ns,
            exports
                .iter()
                .map(|e| (export(e), e.counters.engine_in_flight_ns as f64 * 1e-9)),
        )?;
        gauge(
            enc,
            "mqblk_capacity_bytes",
            "The export's capacity.",
            exports.iter().map(|e| (export(e), e.capacity)),
        )?;
        gauge(
            enc,
            "mqblk_table_memory_bytes",
            "A qcow2 export's share of --table-memory-total: what the tables of its backing chain could take in memory.",
            exports
                .iter()
                .filter_map(|e| Some((export(e), e.table_memory?))),
        )?;
        let qcow2 = || {
            exports
                .iter()
                .filter_map(|e| Some((export(e), e.metadata?)))
        };
        let seconds = |ns: u64| ns as f64 * 1e-9;
        counter(
            enc,
            "mqblk_qcow2_metadata_requests_total",
            "Requests a qcow2 export's metadata worker performed (what the I/O threads' mapping caches could not serve: allocating writes, backing reads, zero or compressed clusters, a neighbourhood's first access, flushes, discards, write-zeroes).",
            qcow2().map(|(l, m)| (l, m.requests)),
        )?;
        counter(
            enc,
            "mqblk_qcow2_write_backs_total",
            "Group commits that wrote a qcow2 image's tables back before their requests completed (metadata-commit=write).",
            qcow2().map(|(l, m)| (l, m.write_backs)),
        )?;
        counter(
            enc,
            "mqblk_qcow2_write_back_seconds_total",
            "Time in those write-backs, their syncs included: what allocating writes waited for.",
            qcow2().map(|(l, m)| (l, seconds(m.write_back_ns))),
        )?;
        counter(
            enc,
            "mqblk_qcow2_syncs_total",
            "fdatasyncs and fsyncs of a qcow2 image file: before a write-back's L2 tables, and a guest flush's.",
            qcow2().map(|(l, m)| (l, m.syncs)),
        )?;
        counter(
            enc,
            "mqblk_qcow2_sync_seconds_total",
            "Time in those syncs (the store's sync latency).",
            qcow2().map(|(l, m)| (l, seconds(m.sync_ns))),
        )?;
        counter(
            enc,
            "mqblk_qcow2_cow_writes_total",
            "New clusters a qcow2 export's worker built for a guest write of part of them (the rest copied from the backing image, or zeros).",
            qcow2().map(|(l, m)| (l, m.cow_writes)),
        )?;
        counter(
            enc,
            "mqblk_qcow2_cow_writes_in_part_total",
            "Of those, the ones written only in the guest's part: the rest was zeros, in file space that reads as zeros.",
            qcow2().map(|(l, m)| (l, m.cow_writes_in_part)),
        )?;
        gauge(
            enc,
            "mqblk_connected_frontends",
            "Frontends (VMMs, libblkio programs) connected now: 0 or 1.",
            exports.iter().map(|e| (export(e), u64::from(e.connected))),
        )?;
        gauge(
            enc,
            "mqblk_export_waiting_for_disk",
            "1 while the connected frontend's queues wait to take up the disk (another process holds a conflicting image lock, or a live server's mark is on the image): its guest's requests wait until it is free.",
            exports
                .iter()
                .map(|e| (export(e), u64::from(e.waiting_for_disk))),
        )?;
        gauge(
            enc,
            "mqblk_export_failed",
            "1 when an I/O thread of the export died (a panic, or a failed io_uring), or its engine failed (a qcow2 image given up): the export serves nothing until it is removed and added again.",
            exports
                .iter()
                .map(|e| (export(e), u64::from(e.failure.is_some()))),
        )?;
        counter(
            enc,
            "mqblk_throttled_seconds_total",
            help.throttled_ns,
            exports
                .iter()
                .map(|e| (export(e), e.counters.throttled_ns as f64 * 1e-9)),
        )?;
        counter(
            enc,
            "mqblk_reconnects_total",
            "Frontend connections after the first since the export started.",
            exports
                .iter()
                .map(|e| (export(e), e.connections.saturating_sub(1))),
        )?;
        counter(
            enc,
            "mqblk_dirty_pages_total",
            help.dirty_pages,
            exports.iter().map(|e| (export(e), e.counters.dirty_pages)),
        )?;
        counter(
            enc,
            "mqblk_dirty_log_misses_total",
            help.dirty_log_misses,
            exports
                .iter()
                .map(|e| (export(e), e.counters.dirty_log_misses)),
        )?;
        counter(
            enc,
            "mqblk_thread_submits_total",
            help.submits,
            self.per_thread(|c| c.submits),
        )?;
        counter(
            enc,
            "mqblk_thread_submitted_requests_total",
            help.submitted,
            self.per_thread(|c| c.submitted),
        )?;
        counter(
            enc,
            "mqblk_thread_enters_total",
            help.enters,
            self.per_thread(|c| c.enters),
        )?;
        {
            let mut m = enc.encode_descriptor(
                "mqblk_thread_polls_total",
                &format!(
                    "result=hit: {} result=miss: {}",
                    help.poll_hits, help.poll_misses
                ),
                None,
                MetricType::Counter,
            )?;
            for e in exports {
                for (i, c) in e.per_thread.iter().enumerate() {
                    let thread = i.to_string();
                    for (result, v) in [("hit", c.poll_hits), ("miss", c.poll_misses)] {
                        let labels = [
                            ("export", e.id.as_str()),
                            ("thread", thread.as_str()),
                            ("result", result),
                        ];
                        m.encode_family(&labels)?.encode_gauge(&v)?;
                    }
                }
            }
        }
        counter(
            enc,
            "mqblk_thread_notifications_total",
            help.notifies,
            self.per_thread(|c| c.notifies),
        )?;
        counter(
            enc,
            "mqblk_thread_early_notifications_total",
            help.early_notifies,
            self.per_thread(|c| c.early_notifies),
        )?;
        counter(
            enc,
            "mqblk_thread_alone_notifications_total",
            help.alone_notifies,
            self.per_thread(|c| c.alone_notifies),
        )?;
        counter(
            enc,
            "mqblk_thread_kicks_total",
            help.kicks,
            self.per_thread(|c| c.kicks),
        )?;
        counter(
            enc,
            "mqblk_thread_sleeps_total",
            help.sleeps,
            self.per_thread(|c| c.sleeps),
        )?;
        counter(
            enc,
            "mqblk_thread_poll_engine_waits_total",
            help.poll_engine_waits,
            self.per_thread(|c| c.poll_engine_waits),
        )?;
        counter(
            enc,
            "mqblk_thread_poll_engine_waits_missed_total",
            help.poll_engine_waits_missed,
            self.per_thread(|c| c.poll_engine_waits_missed),
        )?;
        counter(
            enc,
            "mqblk_thread_poll_trials_total",
            help.poll_trials,
            self.per_thread(|c| c.poll_trials),
        )?;
        counter(
            enc,
            "mqblk_thread_poll_sleep_votes_total",
            help.poll_sleep_votes,
            self.per_thread(|c| c.poll_sleep_votes),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::qcow2::MetadataCounters;

    fn status(id: &str, threads: usize) -> ExportStatus {
        ExportStatus {
            id: id.into(),
            socket: "/run/x.sock".into(),
            engine: "null".into(),
            capacity: 1 << 30,
            queues: threads as u16,
            threads,
            mapping: "per-queue".into(),
            readonly: false,
            connected: true,
            connections: 3,
            waiting_for_disk: false,
            in_flight: 2,
            table_memory: (id == "b").then_some(9 << 20),
            metadata: (id == "b").then_some(MetadataCounters {
                requests: 40,
                write_backs: 3,
                write_back_ns: 1_500_000_000,
                syncs: 4,
                sync_ns: 250_000_000,
                cow_writes: 30,
                cow_writes_in_part: 20,
            }),
            failure: (id == "b").then(|| "mqblk-io0-b: panicked: test".into()),
            counters: IoCounters::default(),
            per_thread: vec![IoCounters::default(); threads],
        }
    }

    /// The sample lines of `text` named `name` (exactly), as (labels, value).
    fn samples<'a>(text: &'a str, name: &str) -> Vec<(&'a str, &'a str)> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, value) = l.rsplit_once(' ')?;
                let (n, labels) = series.split_once('{').unwrap_or((series, ""));
                (n == name).then_some((labels, value))
            })
            .collect()
    }

    #[test]
    fn text_format_names_values_and_histograms() {
        let mut a = status("vm-1", 2);
        a.counters.count_request(ReqType::Read, true, 4096, 1500);
        a.counters
            .count_request(ReqType::Read, false, 4096, 3_000_000);
        a.counters.engine_in_flight_ns = 2_500_000_000;
        a.counters.dirty_pages = 7;
        a.per_thread[1].poll_hits = 9;
        a.per_thread[0].poll_trials = 4;
        a.per_thread[0].poll_engine_waits = 6;
        a.per_thread[0].poll_engine_waits_missed = 2;
        a.per_thread[0].poll_sleep_votes = 3;
        let b = status("b", 1);
        let text = encode(&[a, b]).unwrap();

        // Prometheus text format: counter families are named with their _total suffix, and
        // there is no OpenMetrics EOF marker.
        assert!(
            text.contains("# TYPE mqblk_requests_total counter\n"),
            "{text}"
        );
        // A counter's metric has the counter's description for its help.
        let help = IoCounters::HELP.op_requests;
        assert!(help.starts_with("Requests answered"), "{help}");
        assert!(
            text.contains(&format!("# HELP mqblk_requests_total {help}\n")),
            "{text}"
        );
        assert!(
            !text.contains("_total_total") && !text.contains("# EOF"),
            "{text}"
        );
        let reads = samples(&text, "mqblk_requests_total");
        assert_eq!(reads.len(), 2 * ReqType::COUNT, "every export, every type");
        assert!(
            reads.contains(&(r#"export="vm-1",op="read"}"#, "2")),
            "{reads:?}"
        );
        assert!(reads.contains(&(r#"export="b",op="write_zeroes"}"#, "0")));
        assert_eq!(
            samples(&text, "mqblk_request_bytes_total")[0],
            (r#"export="vm-1",op="read"}"#, "4096")
        );
        assert_eq!(
            samples(&text, "mqblk_request_errors_total")[0],
            (r#"export="vm-1",op="read"}"#, "1")
        );
        // The histogram: cumulative buckets from 1 µs, +Inf, count and sum in seconds.
        let buckets = samples(&text, "mqblk_request_latency_seconds_bucket");
        let vm1_read: Vec<_> = buckets
            .iter()
            .filter(|(l, _)| l.contains(r#"export="vm-1",op="read""#))
            .collect();
        assert_eq!(vm1_read.len(), LATENCY_BUCKETS);
        assert!(
            vm1_read[0].0.contains(r#"le="0.000001""#),
            "{:?}",
            vm1_read[0]
        );
        assert_eq!(vm1_read[0].1, "0");
        assert_eq!(vm1_read[1].1, "1", "1.5 µs is in the 2 µs bucket");
        assert_eq!(vm1_read[11].1, "1", "3 ms is not in the 2.048 ms bucket");
        assert!(
            vm1_read[12].0.contains(r#"le="0.004096""#),
            "{:?}",
            vm1_read[12]
        );
        assert_eq!(vm1_read[12].1, "2");
        assert!(vm1_read[LATENCY_BUCKETS - 1].0.contains(r#"le="+Inf""#));
        assert!(samples(&text, "mqblk_request_latency_seconds_count")
            .contains(&(r#"export="vm-1",op="read"}"#, "2")));
        let sum = samples(&text, "mqblk_request_latency_seconds_sum")[0].1;
        assert!(
            (sum.parse::<f64>().unwrap() - 0.0030015).abs() < 1e-12,
            "{sum}"
        );
        // Per export.
        assert_eq!(
            samples(&text, "mqblk_in_flight_request_seconds_total")[0],
            (r#"export="vm-1"}"#, "2.5")
        );
        assert_eq!(
            samples(&text, "mqblk_reconnects_total")[0],
            (r#"export="vm-1"}"#, "2")
        );
        assert_eq!(
            samples(&text, "mqblk_capacity_bytes")[1],
            (r#"export="b"}"#, "1073741824")
        );
        assert_eq!(
            samples(&text, "mqblk_dirty_pages_total")[0],
            (r#"export="vm-1"}"#, "7")
        );
        assert_eq!(
            samples(&text, "mqblk_dirty_log_misses_total")[1],
            (r#"export="b"}"#, "0")
        );
        assert_eq!(samples(&text, "mqblk_connected_frontends").len(), 2);
        assert_eq!(
            samples(&text, "mqblk_export_failed"),
            vec![(r#"export="vm-1"}"#, "0"), (r#"export="b"}"#, "1")]
        );
        assert_eq!(samples(&text, "mqblk_in_flight_requests")[0].1, "2");
        // Only for a qcow2 export (b here).
        assert_eq!(
            samples(&text, "mqblk_table_memory_bytes"),
            vec![(r#"export="b"}"#, "9437184")]
        );
        for (name, v) in [
            ("mqblk_qcow2_metadata_requests_total", "40"),
            ("mqblk_qcow2_write_backs_total", "3"),
            ("mqblk_qcow2_write_back_seconds_total", "1.5"),
            ("mqblk_qcow2_syncs_total", "4"),
            ("mqblk_qcow2_sync_seconds_total", "0.25"),
            ("mqblk_qcow2_cow_writes_total", "30"),
            ("mqblk_qcow2_cow_writes_in_part_total", "20"),
        ] {
            assert_eq!(samples(&text, name), vec![(r#"export="b"}"#, v)], "{name}");
        }
        // Per thread.
        let polls = samples(&text, "mqblk_thread_polls_total");
        assert_eq!(polls.len(), 2 * 3, "hit and miss for each of 3 threads");
        assert!(polls.contains(&(r#"export="vm-1",thread="1",result="hit"}"#, "9")));
        assert_eq!(samples(&text, "mqblk_thread_submits_total").len(), 3);
        let trials = samples(&text, "mqblk_thread_poll_trials_total");
        assert!(
            trials.contains(&(r#"export="vm-1",thread="0"}"#, "4")),
            "{trials:?}"
        );
        for (name, v) in [
            ("mqblk_thread_poll_engine_waits_total", "6"),
            ("mqblk_thread_poll_engine_waits_missed_total", "2"),
        ] {
            let s = samples(&text, name);
            assert!(
                s.contains(&(r#"export="vm-1",thread="0"}"#, v)),
                "{name}: {s:?}"
            );
        }
        let slept = samples(&text, "mqblk_thread_poll_sleep_votes_total");
        assert!(
            slept.contains(&(r#"export="vm-1",thread="0"}"#, "3")),
            "{slept:?}"
        );
    }

    #[test]
    fn endpoint_answers_metrics_and_refuses_the_rest() {
        use std::io::{Read, Write};
        let mut m = Metrics::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = m.local_addr();
        assert_ne!(addr.port(), 0);
        m.start(|| vec![status("x", 1)]).unwrap();
        let get = |req: &str| {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.write_all(req.as_bytes()).unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).unwrap();
            out
        };
        let ok = get("GET /metrics HTTP/1.0\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.0 200"), "{ok}");
        assert!(ok.contains(CONTENT_TYPE), "{ok}");
        assert!(
            ok.contains(r#"mqblk_capacity_bytes{export="x"} 1073741824"#),
            "{ok}"
        );
        let ok = get("GET /metrics?name[]=x HTTP/1.0\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.0 200"), "{ok}");
        assert!(get("GET / HTTP/1.0\r\n\r\n").starts_with("HTTP/1.0 404"));
        assert!(get("POST /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.0 405"));
        m.stop();
        // tiny_http closes its listening socket from its own accept thread, just after.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::net::TcpStream::connect(addr).is_ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "still listening after stop"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
