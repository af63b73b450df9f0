//! QoS (issue #10): an export limited to N IOPS delivers N, a burst delivers its extra for its
//! length, an unlimited export beside a limited one keeps its rate, throttle groups share one
//! budget, and a limit changed at runtime takes effect within a second.
//!
//! The exports use the null engine, so that the device is never the limit. Rates are measured
//! by the libblkio client (whole runs) or by sampling the export's own request counter while
//! the client runs (for what happens when). The tests measure rates, so they run one at a
//! time.
mod support;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mqblk::api::Control;
use mqblk::config::{parse_export_spec, ExportConfig, QosConfig};
use mqblk::daemon::{Export, Exports};
use mqblk_client::{self as client, Pattern, Report, Workload};
use support::daemon::{Daemon, Export as Spec, TestDir};

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

/// Sleeps until `t`, then reads the export's completed requests.
fn completed_at(e: &Export, t: Instant) -> u64 {
    if let Some(d) = t.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
    completed(e)
}

fn within(value: f64, target: f64, tolerance: f64) -> bool {
    (value - target).abs() <= target * tolerance
}

/// CPU seconds used so far by the threads of `pid` whose name starts with `prefix`.
fn thread_cpu(pid: u32, prefix: &str) -> f64 {
    let ticks = 100.0; // USER_HZ
    let mut total = 0.0;
    for e in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let Ok(comm) = std::fs::read_to_string(e.path().join("comm")) else {
            continue;
        };
        if !comm.trim().starts_with(prefix) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // Fields after the parenthesised name: state is field 3; utime and stime are 14, 15.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split(' ').collect();
        total += (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / ticks;
    }
    total
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
    // The waits were counted, and they were waits: about 64 requests always waiting.
    std::thread::sleep(Duration::from_millis(300));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let e = &v["exports"][0];
    let throttled = e["throttled"].as_u64().unwrap();
    let waited = e["throttled_ns"].as_u64().unwrap() as f64 / 1e9;
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
    let (t0, client) = start_client(&e, randread(&sock, 1, 5.2));
    let at = |s: f64| completed_at(&e, t0 + Duration::from_secs_f64(s));
    let (c05, c2, c35, c5) = (at(0.5), at(2.0), at(3.5), at(5.0));
    let report = client.join().unwrap();
    let burst = (c2 - c05) as f64 / 1.5;
    let after = (c5 - c35) as f64 / 1.5;
    let extra = c5 as f64 - 5.0 * 1000.0;
    eprintln!(
        "burst {burst:.0}/s (limit 3000), after it {after:.0}/s (limit 1000), \
         extra {extra:.0} (configured 6000); client {:.0} IOPS",
        report.iops()
    );
    assert!(within(burst, 3000.0, 0.1), "the burst ran at {burst:.0}/s");
    assert!(within(after, 1000.0, 0.1), "after the burst: {after:.0}/s");
    assert!(
        within(extra, 6000.0, 0.05),
        "{extra:.0} more than the average in 5 s"
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
    let daemon = Daemon::start(&dir, &[limited.clone(), free.clone()]);
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
    let busy = std::thread::spawn(move || run(&randread(&sock, 1, 2.2)));
    std::thread::sleep(Duration::from_millis(200));
    let beside = best(3);
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
    // thread spinning beside its two is caught by the CPU check below, not here: on this
    // shared 2-vCPU machine other work alone has cost a half-second run a third of its rate
    // (0.64x in one CI run), so the bound leaves room for that and still fails on a leak.
    assert!(
        beside >= 0.5 * alone,
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
    let (t0, client) = start_client(&e, randread(&sock, 1, 5.6));
    let t = |s: f64| t0 + Duration::from_secs_f64(s);
    let rate = |from: u64, to: u64, secs: f64| (to - from) as f64 / secs;
    let iops = |n: u64| {
        let mut q = QosConfig::default();
        q.iops_total.rate = n;
        q
    };
    let (u0, u1) = (completed_at(&e, t(0.2)), completed_at(&e, t(1.0)));
    e.set_qos(iops(1000)).unwrap();
    let (a0, a1) = (completed_at(&e, t(2.0)), completed_at(&e, t(2.5)));
    e.set_qos(iops(4000)).unwrap();
    let (b0, b1) = (completed_at(&e, t(3.5)), completed_at(&e, t(4.0)));
    e.set_qos(QosConfig::default()).unwrap();
    let (c0, c1) = (completed_at(&e, t(5.0)), completed_at(&e, t(5.5)));
    client.join().unwrap();
    let (free, low, high, lifted) = (
        rate(u0, u1, 0.8),
        rate(a0, a1, 0.5),
        rate(b0, b1, 0.5),
        rate(c0, c1, 0.5),
    );
    eprintln!(
        "unlimited {free:.0}/s; 1 s after iops-total=1000: {low:.0}/s; 1 s after \
         iops-total=4000: {high:.0}/s; 1 s after lifting it: {lifted:.0}/s"
    );
    assert!(within(low, 1000.0, 0.1), "{low:.0}/s with iops-total=1000");
    assert!(
        within(high, 4000.0, 0.1),
        "{high:.0}/s with iops-total=4000"
    );
    assert!(
        free > 8000.0 && lifted > 8000.0,
        "unlimited: {free:.0}/s before, {lifted:.0}/s after"
    );
    // An invalid change is refused, names the key, and changes nothing.
    let mut bad = iops(100);
    bad.iops_total.max = 10;
    let err = e.set_qos(bad).unwrap_err().to_string();
    assert!(err.contains("iops-total-max=10"), "{err}");
    assert!(!e.qos().is_limited());
    e.shutdown();
}
