//! Each request-path mechanism, switched on and off, is active when on, silent when off, and
//! data still verifies either way. Counters are read from the export's I/O threads directly
//! (the export runs in this process).
mod support;

use std::time::{Duration, Instant};

use mqblk::config::parse_export_spec;
use mqblk::daemon::Export;
use mqblk::io::IoCounters as Totals;
use mqblk_client::{self as client, Pattern, Report, Workload};
use support::daemon::TestDir;
use support::wait::wait_until;

/// The export's I/O threads' counters, summed.
fn totals(e: &Export) -> Totals {
    e.device().counters()
}

/// Serves a 16 MiB image with `opts`, runs `w` against it, returns the report and counters.
fn run_with(opts: &str, w: Workload) -> (Report, Totals) {
    serve_and_run(&format!("direct=off,{opts}"), w)
}

/// Serves a 16 MiB export (an image file unless `opts` names another engine) with `opts`.
fn serve_and_run(opts: &str, w: Workload) -> (Report, Totals) {
    let (r, t, _) = serve_and_run_timed(opts, w);
    (r, t)
}

/// [`serve_and_run`], also returning how long the workload (`client::run`) took: not the
/// export's start or shutdown.
fn serve_and_run_timed(opts: &str, mut w: Workload) -> (Report, Totals, Duration) {
    let dir = TestDir::new();
    let sock = dir.path().join("s.sock");
    let img = dir.path().join("disk.img");
    let store = if opts.contains("engine=") {
        String::new()
    } else {
        format!("path={},", img.display())
    };
    let spec = format!("socket={},{store}size=16M,{opts}", sock.display());
    let export = Export::start(parse_export_spec(&spec).unwrap()).unwrap();
    w.socket = sock;
    let started = Instant::now();
    let r = client::run(&w).expect("workload");
    let took = started.elapsed();
    // Counters are published once per worker loop iteration, so the last requests' may come
    // a moment after the client saw them answered: wait until they count every one.
    wait_until(Duration::from_secs(10), || {
        totals(&export).requests >= r.ios
    });
    let t = totals(&export);
    assert!(
        t.requests >= r.ios,
        "the export's counters show {} requests, the client saw {} answered",
        t.requests,
        r.ios
    );
    export.shutdown();
    (r, t, took)
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
    // Rate trials (polling against sleeping) are adaptive polling's: a thread told to poll,
    // or not to, never runs one.
    assert_eq!(on.poll_trials, 0, "{on:?}");
    assert_eq!(off.poll_trials, 0, "{off:?}");
}

#[test]
fn a_poll_waits_past_its_window_for_requests_at_the_engine() {
    // A 1 µs window, which no read or write of a file with O_DIRECT completes within: allowed
    // 5 ms for the engine, polls wait for the request at the device and catch its completion;
    // with no engine wait they end at the window. (The test directory is on a filesystem that
    // takes O_DIRECT, as the image tests' are.)
    let opts = "direct=on,queues=1,poll=on,poll-max-us=1";
    let (r, on) = serve_and_run(&format!("{opts},poll-engine-us=5000"), verify(1, 1, 1));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert!(
        on.poll_engine_waits > 0,
        "no poll waited for the engine: {on:?}"
    );
    assert!(
        on.poll_engine_waits_missed * 2 < on.poll_engine_waits,
        "most waits for the engine saw nothing come: {on:?}"
    );
    let (r, off) = serve_and_run(&format!("{opts},poll-engine-us=0"), verify(1, 1, 1));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert_eq!(off.poll_engine_waits, 0, "{off:?}");
    assert!(off.poll_misses > 0, "{off:?}");
}

#[test]
fn adaptive_polling_weighs_polling_against_sleeping_while_it_polls() {
    // A 2 ms window: once the thread probes, its polls catch the client's next requests, so
    // it polls on. A rate trial starts 20 ms in, and the next 0.5 s after it (50 ms after a
    // first vote to sleep): 1.2 s of reads see at least two.
    let mut w = Workload::new("unset");
    w.iodepth = 8;
    w.ops_per_job = Some(u64::MAX);
    w.runtime = Some(Duration::from_millis(1200));
    let (r, t) = serve_and_run("engine=null,queues=1,poll=adaptive,poll-max-us=2000", w);
    assert!(r.clean() && r.ios > 0, "{r}");
    assert!(t.poll_hits > 0, "the thread never polled: {t:?}");
    assert!(
        t.poll_trials >= 2,
        "under two rate trials in 1.2 s of polling: {t:?}"
    );
    assert!(t.poll_sleep_votes <= t.poll_trials, "{t:?}");
}

#[test]
fn batch_wait_engages_under_load_and_data_verifies() {
    // The policy waits only when a batch is smaller than recent ones, which depends on how
    // the two client threads interleave; on a loaded machine a run can happen to bring full
    // batches only. Up to three runs, each verified, must show it engaging at least once.
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (r, on) = run_with("queues=1,batch-wait-us=50,merge=off", verify(1, 2, 32));
        assert!(r.clean() && r.verified_bytes > 0, "{r}");
        assert!(on.requests > on.submits, "no batching at all: {on:?}");
        seen.push(on);
        if on.batch_waits > 0 {
            break;
        }
    }
    assert!(
        seen.iter().any(|t| t.batch_waits > 0),
        "batch wait never engaged: {seen:?}"
    );
    let (r, off) = run_with("queues=1,batch-wait-us=0,merge=off", verify(1, 2, 32));
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert_eq!(off.batch_waits, 0, "{off:?}");
}

#[test]
fn one_syscall_per_request_at_iodepth_1() {
    // With the null engine each request costs the I/O thread one io_uring_enter: the one that
    // hands the guest notification to the kernel and sleeps until the next kick. (Before the
    // notification skipped its completion entry and the sleep carried the submission, it was
    // two or three.)
    let mut w = Workload::new("unset");
    w.ops_per_job = Some(3000);
    let (r, t) = serve_and_run("engine=null,queues=1,poll=off", w);
    assert!(r.clean(), "{r}");
    assert!(t.requests >= 3000, "{t:?}");
    // Slack for the setup messages (memory table, queue starts) and the final drain.
    assert!(
        t.enters <= t.requests + t.requests / 10 + 50,
        "more than one syscall per request at iodepth 1: {t:?}"
    );
}

#[test]
fn registered_file_and_buffers_carry_the_io_and_data_verifies() {
    // merge=off: a merged I/O has several iovecs and goes through readv/writev by design.
    let (r, on) = run_with(
        "queues=2,merge=off,fixed-files=on,fixed-buffers=on",
        verify(2, 2, 16),
    );
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    // Every host I/O names the registered file; every 4 KiB request is one iovec inside guest
    // memory, so every read and write uses a registered buffer.
    assert!(on.fixed_file_ios >= on.requests, "{on:?}");
    assert!(on.fixed_buf_ios >= on.requests, "{on:?}");
    let (r, off) = run_with(
        "queues=2,merge=off,fixed-files=off,fixed-buffers=off",
        verify(2, 2, 16),
    );
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert_eq!((off.fixed_file_ios, off.fixed_buf_ios), (0, 0), "{off:?}");
}

/// Names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

#[test]
fn sqpoll_runs_a_kernel_submission_thread_and_data_verifies() {
    let sqp = |names: &[String]| names.iter().filter(|n| n.starts_with("iou-sqp")).count();
    let before = sqp(&thread_names());
    let dir = TestDir::new();
    let sock = dir.path().join("s.sock");
    let spec = format!(
        "socket={},path={},size=16M,direct=off,queues=2,sqpoll-idle-ms=5",
        sock.display(),
        dir.path().join("disk.img").display()
    );
    let export = Export::start(parse_export_spec(&spec).unwrap()).unwrap();
    // One SQPOLL thread per I/O thread's ring (2 queues, per-queue mapping). Tests run in
    // parallel threads of this process, so count ours as the increase. A new SQPOLL thread
    // names itself once it first runs: give it a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut during = sqp(&thread_names());
    while during < before + 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        during = sqp(&thread_names());
    }
    let mut w = verify(2, 2, 16);
    w.socket = sock;
    let r = client::run(&w).expect("workload");
    export.shutdown();
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert!(
        during >= before + 2,
        "no SQPOLL threads: {before} before, {during} with the export"
    );
}

#[test]
fn in_flight_and_notification_counters_describe_the_pipeline() {
    // A file through io_uring keeps requests at the engine for a while: the time-integrated
    // in-flight counter grows, and its mean over the run stays within what the client allows.
    let mut w = verify(1, 1, 16);
    w.pattern = Pattern::RandRead;
    w.runtime = Some(Duration::from_millis(500));
    // Timed over the workload alone: the export's start and shutdown would dilute the mean.
    let (r, t, wall) = serve_and_run_timed("direct=off,queues=1,poll=off", w);
    assert!(r.clean() && r.ios > 0, "{r}");
    assert!(
        t.engine_in_flight_ns > 0,
        "nothing was ever in flight at the engine: {t:?}"
    );
    let mean = t.engine_in_flight_ns as f64 / wall.as_nanos() as f64;
    assert!(
        mean <= 16.0,
        "more in flight than iodepth 16: {mean} ({t:?})"
    );
    // Every notification lands in one bucket of the histogram, and the buckets' lower bounds
    // account for at most the requests completed.
    let h = t.used_per_notify();
    assert_eq!(h.iter().map(|b| b.1).sum::<u64>(), t.notifies, "{t:?}");
    assert!(
        h.iter().map(|b| u64::from(b.0) * b.1).sum::<u64>() <= t.requests,
        "{t:?}"
    );

    // The null engine completes at once: nothing is ever in flight at it.
    let mut w = Workload::new("unset");
    w.ops_per_job = Some(2000);
    let (r, t) = serve_and_run("engine=null,queues=1", w);
    assert!(r.clean(), "{r}");
    assert_eq!(t.engine_in_flight_ns, 0, "{t:?}");
    // One job at iodepth 1 has one request in flight at a time, and the client (libblkio, not
    // polling) asks to be notified of each completion before it sleeps: most notifications
    // carry one used entry. Not all: when the client finds a completion before it re-arms its
    // used_event, it reaps it without a notification (EVENT_IDX says none is due), and the
    // next notification counts every entry since the last one. CI runs saw one notification
    // of 2 entries in 2000 requests, and once a streak that ended in one of 10.
    assert!(t.notifies > 0, "{t:?}");
    assert!(
        t.used_per_notify_1 * 10 >= t.notifies * 9,
        "iodepth 1: most notifications carry one used entry: {t:?}"
    );
}

#[test]
fn early_submission_splits_a_batch_for_an_idle_device_and_data_verifies() {
    // On: a batch reaches the engine in several syscalls while the device holds fewer I/Os
    // than are queued; off: one syscall per batch. Either way the data verifies. Without
    // polling, each batch is what the client queued before its kick woke the thread: a
    // polling thread takes requests as the client adds them, in batches of a few whose size
    // depends on the two threads' timing (a loaded CI machine once gave 5.0 per submit with
    // early submission off, 5.1 with it on).
    let per_submit = |t: &Totals| t.submitted as f64 / t.submits.max(1) as f64;
    let (r, on) = run_with(
        "queues=1,poll=off,submit-early=on,merge=off",
        verify(1, 1, 32),
    );
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    let (r, off) = run_with(
        "queues=1,poll=off,submit-early=off,merge=off",
        verify(1, 1, 32),
    );
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert!(
        per_submit(&on) < per_submit(&off),
        "early submission did not split batches: on {:.1} vs off {:.1} requests per submit ({on:?} / {off:?})",
        per_submit(&on),
        per_submit(&off)
    );
}

#[test]
fn early_notification_is_counted_and_off_sends_none() {
    // The mem engine completes at once, so a round answers a whole batch: the case early
    // notification is for. Whether a thread notifies early depends on whether it had its CPU to
    // itself (tests run in parallel here), so with it on the test asserts what always holds: the
    // data verifies and the early notifications are among all notifications, each counted in
    // the histogram once. Off, none is sent early.
    let mut w = verify(1, 1, 32);
    w.runtime = Some(Duration::from_millis(300));
    let (r, off) = serve_and_run("engine=mem,queues=1,notify-early=off", w.clone());
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert_eq!(off.early_notifies, 0, "{off:?}");
    let (r, on) = serve_and_run("engine=mem,queues=1,notify-early=on", w);
    assert!(r.clean() && r.verified_bytes > 0, "{r}");
    assert!(on.early_notifies <= on.notifies, "{on:?}");
    let h = on.used_per_notify();
    assert_eq!(h.iter().map(|b| b.1).sum::<u64>(), on.notifies, "{on:?}");
}

#[test]
fn a_polling_thread_notifies_requests_answered_at_once_with_a_write_of_its_own() {
    // At iodepth 1 a round answers one request and queues nothing else. The null engine
    // answers at once, so a polling thread signals the call eventfd with write(2) instead of
    // an io_uring_enter that would carry the notification alone; a thread that sleeps after
    // each round (poll=off) lets its sleep's enter carry it. The mem engine answers through
    // the ring (the device's completion), and keeps the entry.
    let mut w = Workload::new("unset");
    w.num_queues = 1;
    w.jobs = 1;
    w.iodepth = 1;
    w.block_size = 4096;
    w.runtime = Some(Duration::from_millis(300));
    let null = "engine=null,queues=1,notify-early=off";
    let (r, polled) = serve_and_run(&format!("{null},poll=on"), w.clone());
    assert!(r.clean() && r.ios > 0, "{r}");
    assert!(polled.alone_notifies > 0, "{polled:?}");
    assert!(polled.alone_notifies <= polled.notifies, "{polled:?}");
    let (r, off) = serve_and_run(&format!("{null},poll=off"), w.clone());
    assert!(r.clean() && r.ios > 0, "{r}");
    assert!(off.notifies > 0, "{off:?}");
    assert_eq!(off.alone_notifies, 0, "{off:?}");
    let (r, ring) = serve_and_run("engine=mem,queues=1,notify-early=off,poll=on", w);
    assert!(r.clean() && r.ios > 0, "{r}");
    assert!(ring.notifies > 0, "{ring:?}");
    assert_eq!(ring.alone_notifies, 0, "{ring:?}");
}
