//! Crash consistency: what the daemon acknowledged survives its SIGKILL.
//!
//! A process crash cannot lose data the kernel already has, so these tests guard the daemon's
//! own promise: it acknowledges a write only after the engine completed it, and a flush only
//! after fdatasync returned. A daemon that acknowledged early (a write-back cache of its own, an
//! acknowledgement before the io_uring completion) would lose acknowledged blocks here.
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mqblk_client::{check_pattern, fill_pattern, Client, Pattern, Workload};
use support::daemon::*;

const SIZE: u64 = 16 << 20;
const BS: usize = 4096;

fn sigkill(d: &mut Daemon) {
    // SAFETY: plain syscall on our own, unreaped child.
    unsafe { libc::kill(d.pid() as libc::pid_t, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.has_exited().is_none() {
        assert!(Instant::now() < deadline, "daemon survived SIGKILL");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Writes + flush acknowledged, SIGKILL, restart: everything is there.
#[test]
fn flushed_data_survives_sigkill() {
    for direct in [true, false] {
        let dir = TestDir::new();
        let img = dir.image("disk.img", SIZE, None);
        let sock = dir.join("s.sock");
        let export = Export::file(&sock, &img).queues(2).direct(direct);
        let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
        let mut w = Workload::new(&sock);
        w.num_queues = 2;
        w.jobs = 2;
        w.iodepth = 16;
        w.block_size = BS;
        w.pattern = Pattern::Verify;
        w.seed = 77;
        let r = mqblk_client::run(&w).expect("verify run");
        assert!(r.clean() && r.mismatches == 0, "{r}");
        {
            let mut c = Client::connect(&sock, 2).expect("connect");
            c.flush(0).expect("flush q0");
            c.flush(1).expect("flush q1");
        }
        sigkill(&mut d);
        drop(d);
        // The socket file is stale now; a new daemon replaces it.
        let d2 = Daemon::start(&dir, &[export]);
        let mut check = w.clone();
        check.pattern = Pattern::Check;
        let r = mqblk_client::run(&check).expect("check run");
        assert!(r.clean(), "direct={direct}: {r}");
        assert_eq!(r.verified_bytes, SIZE, "direct={direct}: {r}");
        // And on the host, independently of the daemon.
        let data = read_file(&img, 0, SIZE as usize);
        assert_eq!(
            check_pattern(&data, 0, 77),
            None,
            "direct={direct}: image differs on the host"
        );
        d2.terminate();
    }
}

/// Writes in flight while the daemon is killed: every write that was acknowledged is on disk.
#[test]
fn acknowledged_writes_survive_sigkill_mid_stream() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", SIZE, None);
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img).queues(2);
    let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
    let acked: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    // One frontend per socket (vhost-user is 1:1): one client alternating its two queues.
    let writer = {
        let (sock, acked, stop) = (sock.clone(), acked.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = Client::connect(&sock, 2).expect("connect");
            c.set_timeout(Duration::from_secs(2));
            let mut buf = vec![0u8; BS];
            let mut block = 0u64;
            while !stop.load(Ordering::Relaxed) && (block + 1) * (BS as u64) <= SIZE {
                let off = block * BS as u64;
                fill_pattern(&mut buf, off, 99);
                match c.write((block % 2) as usize, off, &buf) {
                    Ok(()) => acked.lock().unwrap().push(off),
                    Err(_) => break, // the daemon is gone
                }
                block += 1;
            }
        })
    };
    // Let some writes complete, then kill the daemon under the writers.
    let deadline = Instant::now() + Duration::from_secs(10);
    while acked.lock().unwrap().len() < 200 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    sigkill(&mut d);
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer thread");
    drop(d);
    let acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() >= 200,
        "only {} writes acknowledged before the kill",
        acked.len()
    );
    let data = read_file(&img, 0, SIZE as usize);
    for &off in &acked {
        let blk = &data[off as usize..off as usize + BS];
        assert_eq!(
            check_pattern(blk, off, 99),
            None,
            "acknowledged write at {off} lost"
        );
    }
    // A restarted daemon serves the same data.
    let d2 = Daemon::start(&dir, &[export]);
    let mut c = Client::connect(&sock, 1).expect("reconnect");
    for &off in acked.iter().take(50) {
        let got = c.read_vec(0, off, BS).expect("read after restart");
        assert_eq!(
            check_pattern(&got, off, 99),
            None,
            "block {off} after restart"
        );
    }
    drop(c);
    d2.terminate();
}
