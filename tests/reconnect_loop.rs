//! 1000 connect / tiny I/O / disconnect cycles of a libblkio client against one daemon: the
//! daemon's open descriptors, threads and memory mappings must not grow, and its anonymous
//! memory must stay bounded. Set MQBLK_RECONNECT_CYCLES to run another number of cycles.
mod support;

use std::time::Instant;

use mqblk_client::{fill_pattern, Client, ConnectOptions};
use support::daemon::*;

/// What /proc says about a process.
#[derive(Debug, Clone, Copy)]
struct Usage {
    fds: usize,
    threads: usize,
    maps: usize,
    rss_anon_kib: u64,
}

fn usage(pid: u32) -> Usage {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("reading the daemon's fd table")
        .count();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("reading the daemon's maps")
        .lines()
        .count();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    Usage {
        fds,
        threads: field("Threads:") as usize,
        maps,
        rss_anon_kib: field("RssAnon:"),
    }
}

/// One client lifetime: connect (2 queues), write 4 KiB on queue 1, read it back on queue 0,
/// disconnect.
///
/// Returns how many connection attempts the daemon refused first: it serves one frontend per
/// socket, and may not have seen the previous client's close yet.
fn cycle(sock: &std::path::Path, i: u64) -> u32 {
    let deadline = Instant::now() + std::time::Duration::from_secs(2);
    let mut refused = 0;
    let mut c = loop {
        match Client::connect(sock, 2) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => {
                refused += 1;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("cycle {i}: connect: {e:#}"),
        }
    };
    let off = (i % 512) * 4096;
    let mut buf = vec![0u8; 4096];
    fill_pattern(&mut buf, off, i);
    c.write(1, off, &buf)
        .unwrap_or_else(|e| panic!("cycle {i}: write: {e}"));
    let got = c
        .read_vec(0, off, 4096)
        .unwrap_or_else(|e| panic!("cycle {i}: read: {e}"));
    assert!(got == buf, "cycle {i}: read back other data");
    refused
}

#[test]
fn reconnect_loop_leaks_no_descriptors_or_memory() {
    let cycles: u64 = env_or("MQBLK_RECONNECT_CYCLES", 1000).max(200);
    let warmup = 100;
    let dir = TestDir::new();
    let img = dir.image("disk.img", 4 * MIB, None);
    let sock = dir.join("vhost.sock");
    let mut daemon = Daemon::start(&dir, &[Export::file(&sock, &img).queues(2)]);
    let pid = daemon.pid();
    let start = usage(pid);
    let t0 = Instant::now();
    let mut refused = 0;
    for i in 0..warmup {
        refused += cycle(&sock, i);
    }
    // The daemon tears a connection down after the client has gone: read its usage while a
    // probe holds the export, which it accepts only once the last connection is torn down.
    let measure = || {
        let _probe = probe(&sock, &ConnectOptions::new(2));
        usage(pid)
    };
    let warm = measure();
    let t1 = Instant::now();
    for i in warmup..cycles {
        refused += cycle(&sock, i);
    }
    let end = measure();
    let per_cycle = t1.elapsed() / (cycles - warmup) as u32;
    eprintln!(
        "{cycles} cycles in {:.1} s ({per_cycle:?} per cycle, {refused} connection attempts refused first)\n  at start:        {start:?}\n  after {warmup}:       {warm:?}\n  after {cycles}:      {end:?}",
        t0.elapsed().as_secs_f64()
    );
    if let Some(st) = daemon.has_exited() {
        panic!("daemon exited during the loop: {st}");
    }
    assert_eq!(
        end.fds,
        warm.fds,
        "open descriptors grew from {} to {} over {} reconnects",
        warm.fds,
        end.fds,
        cycles - warmup
    );
    assert_eq!(end.threads, warm.threads, "threads grew");
    assert!(
        end.maps <= warm.maps + 2,
        "memory mappings grew from {} to {} (guest memory not unmapped?)",
        warm.maps,
        end.maps
    );
    let growth = end.rss_anon_kib.saturating_sub(warm.rss_anon_kib);
    assert!(
        growth < 2048,
        "anonymous memory grew by {growth} KiB over {} reconnects",
        cycles - warmup
    );
    daemon.terminate();
}
