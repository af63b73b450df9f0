//! Soak: a mixed, verified workload on 4-queue exports with clients reconnecting concurrently,
//! checking zero errors, zero mismatches, and flat descriptor and memory counts.
//!
//! CI runs a short soak (`MQBLK_SOAK_SECS`, default 12 s). The long soak is
//! `MQBLK_SOAK_SECS=300 MQBLK_TEST_WATCHDOG_SECS=400 cargo test --release --test soak -- --nocapture`
//! (the test daemon's watchdog must outlast the soak).
mod support;

use std::time::{Duration, Instant};

use mqblk_client::{self as client, ConnectOptions, Pattern, Workload};
use support::daemon::*;

const SIZE: u64 = 32 << 20;

fn rss_anon_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[test]
fn soak_mixed_workload_with_concurrent_reconnects() {
    let secs: u64 = env_or("MQBLK_SOAK_SECS", 12);
    let dir = TestDir::new();
    let exports: Vec<Export> = (0..2)
        .map(|i| {
            let img = dir.image(&format!("disk{i}.img"), SIZE, None);
            Export::file(dir.join(&format!("s{i}.sock")), img).queues(4)
        })
        .collect();
    let d = Daemon::start(&dir, &exports);
    let pid = d.pid();
    // Warm up once per export so that the baseline includes the worker's steady state.
    for e in &exports {
        let mut w = Workload::new(&e.socket);
        w.num_queues = 4;
        w.jobs = 4;
        w.iodepth = 8;
        w.pattern = Pattern::Verify;
        let r = client::run(&w).expect("warm-up");
        assert!(r.clean(), "{r}");
    }
    // The baseline: read while a probe holds each export, so every earlier connection has been
    // torn down (see `probe`); the end is read the same way.
    let measure = || {
        let probes: Vec<_> = exports
            .iter()
            .map(|e| probe(&e.socket, &ConnectOptions::new(1)))
            .collect();
        let m = (fd_count(pid), rss_anon_kib(pid));
        drop(probes);
        m
    };
    let (fds0, rss0) = measure();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let threads: Vec<_> = exports
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let sock = e.socket.clone();
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                let mut ios = 0u64;
                let patterns = [
                    Pattern::Verify,
                    Pattern::RandWrite,
                    Pattern::RandRead,
                    Pattern::SeqRead,
                    Pattern::Verify,
                ];
                while Instant::now() < deadline {
                    // Every round is a new connection: reconnects run concurrently across exports.
                    let mut w = Workload::new(&sock);
                    w.num_queues = 1 + (rounds as usize + i) % 4;
                    w.jobs = w.num_queues + rounds as usize % 3;
                    w.iodepth = [1, 4, 16, 32][rounds as usize % 4];
                    w.block_size = [4096, 8192, 65536][rounds as usize % 3];
                    w.pattern = patterns[rounds as usize % patterns.len()];
                    w.seed = rounds * 31 + i as u64;
                    w.runtime = Some(Duration::from_millis(400));
                    if w.pattern == Pattern::Verify {
                        // Verify makes one pass: bound it to part of the disk.
                        w.runtime = None;
                        w.region = Some(((rounds % 8) * (SIZE / 8), SIZE / 8));
                    }
                    let r = client::run(&w)
                        .unwrap_or_else(|e| panic!("export {i} round {rounds}: {e:#}"));
                    assert!(
                        r.clean(),
                        "export {i} round {rounds} ({:?}): {r}",
                        w.pattern
                    );
                    ios += r.ios;
                    rounds += 1;
                }
                (rounds, ios)
            })
        })
        .collect();
    let mut total_rounds = 0;
    let mut total_ios = 0;
    for t in threads {
        let (r, n) = t.join().expect("soak thread");
        total_rounds += r;
        total_ios += n;
    }
    let (fds1, rss1) = measure();
    eprintln!(
        "soak: {secs} s, {total_rounds} connections, {total_ios} I/Os, 0 errors; fds {fds0} -> {fds1}, RssAnon {rss0} -> {rss1} KiB"
    );
    assert!(total_rounds >= 4, "only {total_rounds} rounds ran");
    assert_eq!(fds0, fds1, "descriptor count changed across the soak");
    assert!(
        rss1 <= rss0 + 4096,
        "RssAnon grew from {rss0} to {rss1} KiB"
    );
    d.terminate();
}
