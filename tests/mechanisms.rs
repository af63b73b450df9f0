//! Each request-path mechanism, switched on and off, is active when on, silent when off, and
//! data still verifies either way. Counters are read from the export's I/O threads directly
//! (the export runs in this process).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use mqblk::client::{self, Pattern, Report, Workload};
use mqblk::config::parse_export_spec;
use mqblk::daemon::Export;

#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    requests: u64,
    submits: u64,
    merges: u64,
    kicks: u64,
    poll_hits: u64,
    batch_waits: u64,
}

fn totals(e: &Export) -> Totals {
    let mut t = Totals::default();
    for w in &e.shared().workers {
        let s = &w.stats;
        t.requests += s.requests.load(Relaxed);
        t.submits += s.submits.load(Relaxed);
        t.merges += s.merges.load(Relaxed);
        t.kicks += s.kicks.load(Relaxed);
        t.poll_hits += s.poll_hits.load(Relaxed);
        t.batch_waits += s.batch_waits.load(Relaxed);
    }
    t
}

/// Serves a 16 MiB image with `opts`, runs `w` against it, returns the report and counters.
fn run_with(opts: &str, mut w: Workload) -> (Report, Totals) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let img = dir.path().join("disk.img");
    let spec = format!(
        "socket={},path={},size=16M,direct=off,{opts}",
        sock.display(),
        img.display()
    );
    let export = Export::start(parse_export_spec(&spec).unwrap()).unwrap();
    w.socket = sock;
    let r = client::run(&w).expect("workload");
    // Counters are published once per worker loop iteration: give the last one a moment.
    std::thread::sleep(Duration::from_millis(50));
    let t = totals(&export);
    export.shutdown();
    (r, t)
}

fn verify(queues: usize, jobs: usize, iodepth: usize) -> Workload {
    let mut w = Workload::new("unset");
    w.num_queues = queues;
    w.jobs = jobs;
    w.iodepth = iodepth;
    w.block_size = 4096;
    w.pattern = Pattern::Verify;
    w.seed = 5;
    w
}

#[test]
fn merging_joins_sequential_requests_and_data_verifies() {
    let (r, on) = run_with("queues=1,merge=on", verify(1, 1, 32));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert!(on.merges > 0, "no merges on a sequential workload: {on:?}");
    let (r, off) = run_with("queues=1,merge=off", verify(1, 1, 32));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert_eq!(off.merges, 0, "{off:?}");
}

#[test]
fn polling_finds_work_without_kicks_and_data_verifies() {
    // A long window so that polls reliably catch the client's next requests.
    let (r, on) = run_with("queues=1,poll=on,poll-max-us=2000", verify(1, 1, 8));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert!(on.poll_hits > 0, "{on:?}");
    assert!(
        on.kicks < on.requests,
        "notifications were not suppressed while polling: {on:?}"
    );
    let (r, off) = run_with("queues=1,poll=off", verify(1, 1, 8));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert_eq!(off.poll_hits, 0, "{off:?}");
}

#[test]
fn batch_wait_engages_under_load_and_data_verifies() {
    let (r, on) = run_with("queues=1,batch-wait-us=50,merge=off", verify(1, 2, 32));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert!(on.batch_waits > 0, "{on:?}");
    assert!(on.requests > on.submits, "no batching at all: {on:?}");
    let (r, off) = run_with("queues=1,batch-wait-us=0,merge=off", verify(1, 2, 32));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert_eq!(off.batch_waits, 0, "{off:?}");
}
