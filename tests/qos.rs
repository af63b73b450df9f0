//! QoS (issue #10): an export limited to N IOPS delivers N, a burst delivers its extra for its
//! length, an unlimited export beside a limited one keeps its rate, throttle groups share one
//! budget, and a limit changed at runtime takes effect within a second.
//!
//! The exports use the null engine, so that the device is never the limit. Rates are measured
//! by the libblkio client (whole runs) or by sampling the export's own request counter while
//! the client runs (for what happens when), over the time that actually passed between two
//! samples. The tests measure rates, so they run one at a time.
mod support;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mqblk::api::Control;
use mqblk::config::{parse_export_spec, ExportConfig, QosConfig};
use mqblk::daemon::{Export, Exports};
use mqblk_client::{self as client, Pattern, Report, Workload};
use support::daemon::{export_counter, stats_when, Daemon, Export as Spec, TestDir};
use support::proc::tasks;

/// Held by each test: rates measured while another test loads the CPUs mean little.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `jobs` jobs of 4 KiB random reads at iodepth 32 on as many queues, for `secs`.
fn randread(socket: &Path, jobs: usize, secs: f64) -> Workload {
    let mut w = Workload::new(socket);
    w.num_queues = jobs;
    w.jobs = jobs;
    w.iodepth = 32;
    w.block_size = 4096;
    w.pattern = Pattern::RandRead;
    w.runtime = Some(Duration::from_secs_f64(secs));
    w
}

fn run(w: &Workload) -> Report {
    let r = client::run(w).expect("workload");
    assert!(r.clean(), "{r}");
    r
}

/// A null export of `mqblk serve` on `dir/name.sock`.
fn null_spec(dir: &TestDir, name: &str, queues: usize) -> Spec {
    Spec::null(dir.join(&format!("{name}.sock")), 64 << 20).queues(queues)
}

/// A null export on `dir/name.sock` with further keys `opts`.
fn null_config(dir: &TestDir, name: &str, opts: &str) -> ExportConfig {
    let sock = dir.join(&format!("{name}.sock"));
    let spec = format!("socket={},engine=null,size=64M,{opts}", sock.display());
    parse_export_spec(&spec).unwrap()
}

/// An in-process null export on `dir/name.sock` with further keys `opts`.
fn null_export(dir: &TestDir, name: &str, opts: &str) -> Export {
    Export::start(null_config(dir, name, opts)).unwrap()
}

/// Requests the export has completed.
fn completed(e: &Export) -> u64 {
    e.device().counters().requests
}

/// Runs `w` against `e` in another thread; returns when its first request completed, and
/// the thread (which returns the client's report).
fn start_client(e: &Export, w: Workload) -> (Instant, std::thread::JoinHandle<Report>) {
    let before = completed(e);
    let h = std::thread::spawn(move || run(&w));
    let deadline = Instant::now() + Duration::from_secs(10);
    while completed(e) == before {
        assert!(Instant::now() < deadline, "the client never got going");
        std::thread::sleep(Duration::from_micros(500));
    }
    (Instant::now(), h)
}

/// A reading of the export's completed requests: the count and when it was read.
#[derive(Clone, Copy)]
struct Reading {
    completed: u64,
    at: Instant,
}

/// Sleeps until `t`, then reads the export's completed requests. On a busy machine the read
/// may come later than `t`: rates are computed from the time it came ([`per_second`]).
fn completed_at(e: &Export, t: Instant) -> Reading {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
    Reading {
        completed: completed(e),
        at: Instant::now(),
    }
}

/// Requests completed per second between two readings, over the time that actually passed
/// between them.
fn per_second(from: Reading, to: Reading) -> f64 {
    (to.completed - from.completed) as f64 / (to.at - from.at).as_secs_f64()
}

fn within(value: f64, target: f64, tolerance: f64) -> bool {
    (value - target).abs() <= target * tolerance
}

/// CPU seconds used so far by the threads of `pid` whose name starts with `prefix`.
fn thread_cpu(pid: u32, prefix: &str) -> f64 {
    tasks(pid)
        .iter()
        .filter(|t| t.name.starts_with(prefix))
        .map(|t| t.cpu_secs)
        .sum()
}

#[test]
fn a_limited_export_delivers_its_iops_within_5_percent() {
    let _serial = serial();
    let dir = TestDir::new();
    const LIMIT: f64 = 4000.0;
    // Two queues on two I/O threads share the export's buckets.
    let spec = null_spec(&dir, "lim", 2).set("iops-total", "4000");
    let stats = dir.join("stats.json");
    let daemon = Daemon::start_args(
        &dir,
        std::slice::from_ref(&spec),
        &["--stats-file", stats.to_str().unwrap()],
    );
    let r = run(&randread(&spec.socket, 2, 10.0));
    let iops = r.iops();
    eprintln!(
        "limit {LIMIT} IOPS: delivered {iops:.0} IOPS over {:?} ({} requests)",
        r.elapsed, r.ios
    );
    assert!(
        within(iops, LIMIT, 0.05),
        "{iops:.0} IOPS with iops-total=4000 over {:?}",
        r.elapsed
    );
    // The waits were counted, and they were waits: about 64 requests always waiting. Read
    // once the stats file counts every request the client saw answered.
    let v = stats_when(&stats, Duration::from_secs(10), |v| {
        v["exports"][0]["requests"].as_u64() >= Some(r.ios)
    })
    .unwrap();
    let e = &v["exports"][0];
    assert!(
        export_counter(&v, "requests") >= r.ios,
        "the stats file did not count the client's {} requests: {e}",
        r.ios
    );
    let throttled = export_counter(&v, "throttled");
    let waited = export_counter(&v, "throttled_ns") as f64 / 1e9;
    assert!(throttled > r.ios / 2, "{e}");
    assert!(waited > 5.0, "{e}");
    daemon.terminate();
}

#[test]
fn a_burst_allows_its_extra_for_its_length() {
    let _serial = serial();
    let dir = TestDir::new();
    // Bursts at 3000/s above an average of 1000/s, for 2 s: the bucket holds 3000 * 2, and
    // fills at 3000 - 1000 per second, so the burst runs at 3000/s for about 3 s and lets
    // 6000 requests more through than the average would; then 1000/s.
    let e = null_export(
        &dir,
        "burst",
        "iops-total=1000,iops-total-max=3000,iops-total-max-length=2",
    );
    let sock = dir.join("burst.sock");
    // The client runs well past the last reading, so that a reading the machine delays still
    // falls while it runs.
    let runtime = 6.5;
    let (t0, client) = start_client(&e, randread(&sock, 1, runtime));
    let at = |s: f64| completed_at(&e, t0 + Duration::from_secs_f64(s));
    let (r05, r2, r35, r5) = (at(0.5), at(2.0), at(3.5), at(5.0));
    let report = client.join().unwrap();
    // Each window must lie in its phase (the burst until 3 s, the average after it, the client
    // running) for its rate to mean anything; a reading delayed by more than about a second
    // would break that.
    let since = |r: Reading| (r.at - t0).as_secs_f64();
    assert!(
        since(r2) < 2.9 && since(r35) > 3.1 && since(r5) < runtime - 0.2,
        "readings at {:.2}, {:.2}, {:.2} and {:.2} s: the machine was too busy to sample the \
         phases",
        since(r05),
        since(r2),
        since(r35),
        since(r5)
    );
    let burst = per_second(r05, r2);
    let after = per_second(r35, r5);
    // What came through by the last reading beyond the average over the time that passed.
    let extra = r5.completed as f64 - since(r5) * 1000.0;
    eprintln!(
        "burst {burst:.0}/s (limit 3000), after it {after:.0}/s (limit 1000), \
         extra {extra:.0} (configured 6000) in {:.2} s; client {:.0} IOPS",
        since(r5),
        report.iops()
    );
    assert!(within(burst, 3000.0, 0.1), "the burst ran at {burst:.0}/s");
    assert!(within(after, 1000.0, 0.1), "after the burst: {after:.0}/s");
    assert!(
        within(extra, 6000.0, 0.05),
        "{extra:.0} more than the average in {:.2} s",
        since(r5)
    );
    e.shutdown();
}

#[test]
fn an_unlimited_export_keeps_its_rate_beside_a_limited_one() {
    let _serial = serial();
    let dir = TestDir::new();
    // A low limit: the limited export's own work (its client and I/O thread, in a debug
    // build) then takes little of the 2 CPUs the unlimited export's two threads keep busy.
    let limited = null_spec(&dir, "lim", 1).set("iops-total", "1000");
    let free = null_spec(&dir, "free", 1);
    let stats = dir.join("stats.json");
    let daemon = Daemon::start_args(
        &dir,
        &[limited.clone(), free.clone()],
        &["--stats-file", stats.to_str().unwrap()],
    );
    // Short runs, several of each, best of each kind: the rate of a short run on a small
    // machine shared with other work varies by a third, and the best run is the one nothing
    // else disturbed.
    let best = |runs: usize| {
        (0..runs)
            .map(|_| run(&randread(&free.socket, 1, 0.5)).iops())
            .fold(0.0, f64::max)
    };
    let before = best(2);
    // The limited export's client keeps 32 requests waiting for admission throughout.
    let cpu0 = thread_cpu(daemon.pid(), "mqblk-io0-lim");
    let sock = limited.socket.clone();
    let busy = std::thread::spawn(move || run(&randread(&sock, 1, 3.0)));
    let waiting = stats_when(&stats, Duration::from_secs(10), |v| {
        v["exports"][0]["throttled"].as_u64() > Some(0)
    })
    .unwrap();
    assert!(
        export_counter(&waiting, "throttled") > 0,
        "the limited export's client never waited for admission: {waiting}"
    );
    let beside = best(3);
    assert!(
        !busy.is_finished(),
        "the limited export's client ended before the unlimited one was measured beside it"
    );
    let lim = busy.join().unwrap();
    let cpu = thread_cpu(daemon.pid(), "mqblk-io0-lim") - cpu0;
    let alone = before.max(best(2));
    eprintln!(
        "unlimited: {alone:.0} IOPS alone, {beside:.0} beside the limited export; limited: \
         {:.0} IOPS (limit 1000), its I/O thread used {cpu:.2} s of CPU in {:?}",
        lim.iops(),
        lim.elapsed
    );
    // A limit that leaked to it would hold it near 1000 IOPS, under 2% of its rate alone. A
    // thread spinning beside its two is caught by the CPU check below, not here: on the shared
    // 2-vCPU CI machine other work alone has cost a half-second run over half its rate (0.64x
    // in one CI run, 0.41x in another), so the bound leaves room for that, at still more than
    // 40 times the limit, and fails on a leak.
    assert!(
        beside >= 0.15 * alone,
        "the unlimited export fell from {alone:.0} to {beside:.0} IOPS"
    );
    // 1000 per second, after the bucket's initial tenth of a second's worth.
    let expected = 1000.0 + 100.0 / lim.elapsed.as_secs_f64();
    assert!(within(lim.iops(), expected, 0.05), "{}", lim.iops());
    // Waiting requests cost timer wake-ups, not a spinning thread (which, beside the two
    // busy threads of the unlimited export, would take most of a CPU).
    assert!(
        cpu < 0.4 * lim.elapsed.as_secs_f64(),
        "the limited export's I/O thread used {cpu:.2} s of CPU in {:?}",
        lim.elapsed
    );
    daemon.terminate();
}

#[test]
fn a_throttle_group_shares_one_budget() {
    let _serial = serial();
    let dir = TestDir::new();
    // The groups are the export registry's, as in `mqblk serve`.
    let exports = Exports::default();
    let start = |name: &str, opts: &str| exports.start(null_config(&dir, name, opts));
    let qos = |id: &str| exports.get(id).unwrap().0.qos.unwrap();
    start("ga", "iops-total=2000,group=shared-2000").unwrap();
    // Only the group: its limits are the group's.
    start("gb", "group=shared-2000").unwrap();
    assert_eq!(qos("gb").iops_total.rate, 2000);
    // A member with other limits is refused, naming the key.
    let err = start("gc", "iops-total=10,group=shared-2000")
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("group=shared-2000"), "{err}");
    let (wa, wb) = (
        randread(&dir.join("ga.sock"), 1, 2.5),
        randread(&dir.join("gb.sock"), 1, 2.5),
    );
    let ha = std::thread::spawn(move || run(&wa));
    let rb = run(&wb);
    let ra = ha.join().unwrap();
    let sum = (ra.ios + rb.ios) as f64 / ra.elapsed.max(rb.elapsed).as_secs_f64();
    eprintln!(
        "group of two: {:.0} + {:.0} = {sum:.0} IOPS (limit 2000)",
        ra.iops(),
        rb.iops()
    );
    assert!(within(sum, 2000.0, 0.1), "{sum:.0} IOPS for the group");
    assert!(
        ra.iops() > 500.0 && rb.iops() > 500.0,
        "one member starved the other"
    );
    // Limits given to a member at runtime are the group's; a member given no group leaves it.
    let mut q = QosConfig::default();
    q.iops_total.rate = 3000;
    q.group = Some("shared-2000".into());
    exports.set_qos("gb", q).unwrap();
    assert_eq!(qos("ga").iops_total.rate, 3000);
    exports.set_qos("gb", QosConfig::default()).unwrap();
    assert_eq!((qos("gb").group, qos("gb").is_limited()), (None, false));
    assert_eq!(qos("ga").iops_total.rate, 3000);
    exports.stop_all();
}

#[test]
fn a_limit_changed_at_runtime_takes_effect_within_a_second() {
    let _serial = serial();
    let dir = TestDir::new();
    // Started without QoS keys: the I/O threads have no buckets at all.
    let e = null_export(&dir, "rt", "queues=1");
    let sock = dir.join("rt.sock");
    // The client runs past the last window even when the machine delays the readings.
    let runtime = 8.5;
    let (t0, client) = start_client(&e, randread(&sock, 1, runtime));
    let iops = |n: u64| {
        let mut q = QosConfig::default();
        q.iops_total.rate = n;
        q
    };
    // The rate over a second from `from` on (from its reading on, if that came late): long
    // enough that a moment in which other work on the machine holds up the client costs the
    // rate little.
    let window = |from: Instant| {
        let start = completed_at(&e, from);
        let end = completed_at(&e, start.at + Duration::from_secs(1));
        (per_second(start, end), end.at)
    };
    // Changes the limit; the rate in the window from 1 s after the change was made.
    let after_change = |q: QosConfig| {
        e.set_qos(q).unwrap();
        window(Instant::now() + Duration::from_secs(1))
    };
    let (free, _) = window(t0 + Duration::from_millis(200));
    let (low, _) = after_change(iops(1000));
    let (high, _) = after_change(iops(4000));
    let (lifted, last) = after_change(QosConfig::default());
    let client_running = last < t0 + Duration::from_secs_f64(runtime - 0.2);
    client.join().unwrap();
    eprintln!(
        "unlimited {free:.0}/s; 1 s after iops-total=1000: {low:.0}/s; 1 s after \
         iops-total=4000: {high:.0}/s; 1 s after lifting it: {lifted:.0}/s"
    );
    assert!(
        client_running,
        "the last window ended {:.2} s after the client started, past its {runtime} s: the \
         machine was too busy to sample",
        (last - t0).as_secs_f64()
    );
    assert!(within(low, 1000.0, 0.1), "{low:.0}/s with iops-total=1000");
    assert!(
        within(high, 4000.0, 0.1),
        "{high:.0}/s with iops-total=4000"
    );
    // Unlimited, the export must run well above the highest limit, or the rates above could be
    // the machine's and not the limits'. Lifted, it must run at twice that limit at least (as
    // it must unlimited), and come back to the unlimited rate measured in this test, within a
    // factor of 4 for what other work on a shared 2-CPU machine can cost a window (2.2 once
    // here).
    assert!(
        free > 2.0 * 4000.0,
        "unlimited, the export ran at only {free:.0}/s: too slow to show a 4000/s limit"
    );
    assert!(
        lifted > 2.0 * 4000.0 && lifted > free / 4.0,
        "unlimited: {free:.0}/s before, {lifted:.0}/s after the limit was lifted"
    );
    // An invalid change is refused, names the key, and changes nothing.
    let mut bad = iops(100);
    bad.iops_total.max = 10;
    let err = e.set_qos(bad).unwrap_err().to_string();
    assert!(err.contains("iops-total-max=10"), "{err}");
    assert!(!e.qos().is_limited());
    e.shutdown();
}
