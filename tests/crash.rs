//! Crash consistency and durability: what the daemon acknowledged survives its SIGKILL, and
//! what the guest asked to be durable is.
//!
//! A process crash cannot lose data the kernel already has, so the SIGKILL tests guard the
//! daemon's own promise: it acknowledges a write only after the engine completed it, and a flush
//! only after fdatasync returned. A daemon that acknowledged early (a write-back cache of its
//! own, an acknowledgement before the io_uring completion) would lose acknowledged blocks here.
//!
//! The cache-mode tests drive the daemon with the hand-written frontend of the hostile tests
//! (tests/support/frontend.rs), which can switch the guest's write cache (CONFIG_WCE) and hand
//! over an in-flight region: in write-through mode every write is durable when acknowledged,
//! that mode survives a crash of mqblk, and GET_VRING_BASE (a migration's switch-over) writes a
//! `direct=off` export's host page cache back.
mod support;

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mqblk_client::{check_pattern, fill_pattern, Client, Concurrent, Pattern, Workload};
use support::daemon::*;
use support::frontend::*;
use support::mem::memfd;
use support::qemu_img::read_through_qemu;
use support::skip::skip_unless_allowed;
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserInflight, VhostUserProtocolFeatures,
};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;

const SIZE: u64 = 16 << 20;
const BS: usize = 4096;
/// The seed of the cache-mode tests' images.
const IMG_SEED: u64 = 0x5eed;

fn sigkill(d: &mut Daemon) {
    d.signal(rustix::process::Signal::KILL);
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

// ---------------------------------------------------------------------------------------------
// Cache mode (CONFIG_WCE) and the host page cache
// ---------------------------------------------------------------------------------------------

/// The writeback byte of the config space (struct virtio_blk_config's `wce`).
const CONFIG_WCE_OFFSET: u32 = 32;

fn config_writeback(conn: &mut Conn) -> u8 {
    let flags = VhostUserConfigFlags::empty();
    let (_, payload) =
        answer(conn.fe.get_config(CONFIG_WCE_OFFSET, 1, flags, &[0])).expect("GET_CONFIG");
    assert_eq!(payload.len(), 1, "GET_CONFIG reply {payload:?}");
    payload[0]
}

fn set_config_writeback(conn: &mut Conn, on: bool) {
    let flags = VhostUserConfigFlags::empty();
    answer(
        conn.fe
            .set_config(CONFIG_WCE_OFFSET, flags, &[u8::from(on)]),
    )
    .expect("SET_CONFIG");
}

/// A daemon serving `img` on `sock`, writing its counters to `stats`.
fn serve_with_stats(dir: &TestDir, sock: &Path, img: &Path, stats: &Path) -> Daemon {
    let stats = stats.to_str().expect("a UTF-8 path");
    Daemon::start_args(dir, &[Export::file(sock, img)], &["--stats-file", stats])
}

/// The export's count of write-through writes, once its stats file counts the `requests` the
/// test has seen answered.
fn sync_writes(stats: &Path, requests: u64) -> u64 {
    let ready = |v: &serde_json::Value| v["exports"][0]["requests"].as_u64() >= Some(requests);
    let v = stats_when(stats, Duration::from_secs(10), ready).unwrap();
    assert!(
        ready(&v),
        "the stats file did not count the {requests} requests answered: {v}"
    );
    export_counter(&v, "sync_writes")
}

#[test]
fn guest_turning_the_write_cache_off_makes_writes_write_through() {
    let dir = TestDir::new();
    let img = dir.image("wce.img", SIZE, Some(IMG_SEED));
    let sock = dir.join("wce.sock");
    let stats = dir.join("stats.json");
    let daemon = serve_with_stats(&dir, &sock, &img, &stats);
    let mut s = Session::open_features(&sock, 64, None, F_BLK_FLUSH | F_BLK_CONFIG_WCE);
    assert_eq!(
        config_writeback(&mut s.conn),
        1,
        "write-back is the initial mode"
    );

    // Four 4 KiB writes at `sector`, each verified in the image afterwards.
    let write_some = |s: &mut Session, sector: u64, fill: u8| {
        for i in 0..4u64 {
            let sector = sector + 8 * i;
            s.good_write(0, sector, fill);
            let mut f = File::open(&img).unwrap();
            let mut got = vec![0u8; 4096];
            use std::io::{Seek, SeekFrom};
            f.seek(SeekFrom::Start(sector * 512)).unwrap();
            f.read_exact(&mut got).unwrap();
            assert!(got.iter().all(|&b| b == fill), "image at sector {sector}");
        }
    };

    write_some(&mut s, 0, 0x11);
    assert_eq!(sync_writes(&stats, 4), 0, "write-back mode wrote through");

    set_config_writeback(&mut s.conn, false);
    assert_eq!(
        config_writeback(&mut s.conn),
        0,
        "the cache mode did not stick"
    );
    write_some(&mut s, 64, 0x22);
    assert_eq!(
        sync_writes(&stats, 8),
        4,
        "write-through mode: every write must carry RWF_DSYNC"
    );

    set_config_writeback(&mut s.conn, true);
    assert_eq!(config_writeback(&mut s.conn), 1);
    write_some(&mut s, 128, 0x33);
    assert_eq!(sync_writes(&stats, 12), 4, "back in write-back mode");

    drop(s);
    daemon.terminate();
}

/// Pages of `file` in the page cache that are dirty or under writeback, from cachestat(2)
/// (Linux 6.5); `None` where the kernel lacks it.
fn unwritten_pages(file: &File) -> Option<u64> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct CacheStat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    const SYS_CACHESTAT: libc::c_long = 451;
    let range = Range { off: 0, len: 0 };
    let mut cs = CacheStat::default();
    // SAFETY: cachestat reads `range` and writes one `CacheStat` into `cs`, both live locals
    // laid out as the kernel's structs; `file` is open.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut cs as *mut CacheStat,
            0u32,
        )
    };
    match r {
        0 => Some(cs.nr_dirty + cs.nr_writeback),
        _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) => None,
        _ => panic!("cachestat: {}", std::io::Error::last_os_error()),
    }
}

/// With `direct=off` a completed write may sit in this host's page cache, where a migration's
/// destination (another host on shared storage) would not see it: GET_VRING_BASE, which the
/// frontend sends when it stops the rings for the switch-over, writes the cache back before it
/// answers.
#[test]
fn get_vring_base_writes_back_the_host_cache_of_a_direct_off_export() {
    let dir = TestDir::new();
    let img = dir.image("cached.img", SIZE, Some(IMG_SEED));
    let sock = dir.join("cached.sock");
    let daemon = Daemon::start(&dir, &[Export::file(&sock, &img).direct(false)]);
    let image = File::open(&img).unwrap();
    let Some(before) = unwritten_pages(&image) else {
        skip_unless_allowed(
            "MQBLK_TEST_ALLOW_NO_CACHESTAT",
            "this kernel has no cachestat(2) (Linux 6.5) to see dirty pages with",
        );
        daemon.terminate();
        return;
    };
    assert_eq!(
        before, 0,
        "the image was written and synced before the daemon started"
    );
    let mut s = Session::open_features(&sock, 64, None, F_BLK_FLUSH);
    for i in 0..16u64 {
        s.good_write(0, 64 * i, 0x5c);
    }
    let dirty = unwritten_pages(&image).unwrap();
    eprintln!("dirty or under writeback before GET_VRING_BASE: {dirty} pages");
    assert!(
        dirty > 0,
        "16 writes in write-back mode with direct=off left no dirty page: nothing to show"
    );
    let state = answer(s.conn.fe.get_vring_base(0)).expect("GET_VRING_BASE");
    assert_eq!(state, 16, "next avail index after 16 requests");
    let left = unwritten_pages(&image).unwrap();
    assert_eq!(
        left, 0,
        "{dirty} dirty pages before GET_VRING_BASE, {left} still unwritten after its answer"
    );
    drop(s);
    daemon.terminate();
}

/// The guest's cache mode survives a crash of mqblk: the frontend does not repeat CONFIG_WCE
/// after reconnecting, so mqblk keeps it in the in-flight region, which the frontend holds and
/// hands to the next mqblk.
#[test]
fn write_through_mode_survives_a_daemon_crash_via_the_inflight_region() {
    const QSIZE: u16 = 64;
    // One queue's region (header + descriptors, 64-byte aligned), then mqblk's 64-byte state.
    let queue_bytes = (16 + 16 * u64::from(QSIZE)).next_multiple_of(64);
    let region_len = queue_bytes + 64;
    let region = memfd("inflight", region_len);

    let dir = TestDir::new();
    let img = dir.image("wce.img", SIZE, Some(IMG_SEED));
    let sock = dir.join("wce.sock");
    let stats_a = dir.join("stats-a.json");
    let daemon = serve_with_stats(&dir, &sock, &img, &stats_a);

    // What a reconnecting frontend does: negotiate, hand over the in-flight region, set up.
    let connect = |region: &File| -> Session {
        let (mut conn, _) = Session::negotiate_features(
            &sock,
            VhostUserProtocolFeatures::INFLIGHT_SHMFD,
            F_BLK_FLUSH | F_BLK_CONFIG_WCE,
        )
        .expect("negotiation");
        let inflight = VhostUserInflight::new(region_len, 0, 1, QSIZE);
        answer(conn.fe.set_inflight_fd(&inflight, region.as_raw_fd())).expect("SET_INFLIGHT_FD");
        Session::start(conn, QSIZE, None)
    };

    let mut s = connect(&region);
    assert_eq!(config_writeback(&mut s.conn), 1);
    set_config_writeback(&mut s.conn, false);
    s.good_write(0, 0, 0x5a);
    assert_eq!(sync_writes(&stats_a, 1), 1);
    // The state is in the region, after the queue: magic, saved, write-through.
    let mut state = [0u8; 10];
    use std::os::unix::fs::FileExt;
    region.read_exact_at(&mut state, queue_bytes).unwrap();
    assert_eq!(&state[..8], b"mqblkst1", "no saved state in the region");
    assert_eq!(state[8..], [1, 0], "saved cache mode");

    // mqblk dies (SIGKILL); a new one serves the same socket and gets the same region back.
    drop(s);
    drop(daemon);
    let dir_b = TestDir::new();
    let stats_b = dir_b.join("stats-b.json");
    let _ = std::fs::remove_file(&sock);
    let daemon = serve_with_stats(&dir_b, &sock, &img, &stats_b);
    let mut s = connect(&region);
    assert_eq!(
        config_writeback(&mut s.conn),
        0,
        "the restarted mqblk forgot that the guest chose write-through"
    );
    s.good_write(0, 8, 0x5a);
    assert_eq!(
        sync_writes(&stats_b, 1),
        1,
        "the write after the restart was not durable"
    );
    drop(s);

    // A frontend without the region starts in write-back, as a new guest should.
    let mut s = Session::open_features(&sock, QSIZE, None, F_BLK_FLUSH | F_BLK_CONFIG_WCE);
    assert_eq!(config_writeback(&mut s.conn), 1);
    drop(s);
    daemon.terminate();
}

/// `format=qcow2`: a SIGKILL with no flush loses no acknowledged write, in write-back and in
/// write-through mode, whether it allocated its cluster (the metadata path) or went to a
/// cluster the thread had cached (its ring; `RWF_DSYNC` in write-through mode). imago keeps L2
/// tables and refcounts in memory until written back: mqblk writes them to the image file
/// before it completes a write that changed them (synced, too, in write-through mode), since a
/// guest outlives mqblk (it reconnects, and only what had not completed is resubmitted). With
/// `metadata-commit=journal` it records the mappings in the journal instead, which a daemon
/// serving the image again replays.
#[test]
fn qcow2_acknowledged_writes_survive_sigkill_without_a_flush() {
    let modes = [
        (false, "write"),
        (true, "write"),
        (false, "journal"),
        (true, "journal"),
    ];
    for (write_through, commit) in modes {
        let dir = TestDir::new();
        let img = dir.join("disk.qcow2");
        let sock = dir.join("q.sock");
        let export = Export::file(&sock, &img)
            .set("format", "qcow2")
            .set("size", &SIZE.to_string())
            .set("metadata-commit", commit);
        let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
        let mut s = Session::open_features(&sock, 64, None, F_BLK_FLUSH | F_BLK_CONFIG_WCE);
        if write_through {
            set_config_writeback(&mut s.conn, false);
            assert_eq!(config_writeback(&mut s.conn), 0);
        }
        // Eight fresh 64 KiB clusters, then a second block in each (cached by then).
        let blocks: Vec<(u64, u8)> = (0..8u64)
            .map(|c| (c * 128, 0x40 + c as u8))
            .chain((0..8u64).map(|c| (c * 128 + 64, 0x60 + c as u8)))
            .collect();
        for &(sector, fill) in &blocks {
            s.good_write(0, sector, fill);
        }
        sigkill(&mut d);
        drop(s);
        drop(d);
        if commit == "journal" {
            // Replayed as it is served again.
            Daemon::start(&dir, std::slice::from_ref(&export)).terminate();
        }
        let back = read_through_qemu(&img, &dir.join("back.raw"));
        let lost: Vec<u64> = blocks
            .iter()
            .filter(|&&(sector, fill)| {
                let at = (sector * 512) as usize;
                back[at..at + 4096].iter().any(|&b| b != fill)
            })
            .map(|&(sector, _)| sector)
            .collect();
        assert!(
            lost.is_empty(),
            "metadata-commit={commit}, write-through {write_through}: acknowledged writes \
             lost at sectors {lost:?}"
        );
    }
}

/// Two writes into one new qcow2 cluster on two queues at once: one allocates the cluster, the
/// other (whose thread has not seen it) then writes into it in place through the metadata
/// worker. The first completion to arrive is followed at once by a SIGKILL: what completed must
/// read back. The in-place write relies on the mapping the other made, so it may complete only
/// once that mapping is in the image file (before the fix, it completed first and its block
/// read back as zeros after the kill), or, with `metadata-commit=journal`, in the journal,
/// which a daemon serving the image again replays.
#[test]
fn qcow2_a_write_into_a_cluster_being_allocated_survives_sigkill() {
    for (round, commit) in (0..6u64).zip(["write", "journal"].into_iter().cycle()) {
        let dir = TestDir::new();
        let img = dir.join("disk.qcow2");
        let sock = dir.join("q.sock");
        let export = Export::file(&sock, &img)
            .queues(2)
            .set("format", "qcow2")
            .set("size", &SIZE.to_string())
            .set("metadata-commit", commit);
        let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
        let mut c = Client::connect(&sock, 2).unwrap();
        let cluster = (round + 1) * (64 << 10);
        let writes = [
            (cluster, pattern_bytes(4096, cluster, Some(round + 1))),
            (
                cluster + 32768,
                pattern_bytes(4096, cluster + 32768, Some(round + 50)),
            ),
        ];
        let done = c.together_until(
            &[
                Concurrent::Write {
                    q: 0,
                    offset: writes[0].0,
                    data: &writes[0].1,
                },
                Concurrent::Write {
                    q: 1,
                    offset: writes[1].0,
                    data: &writes[1].1,
                },
            ],
            1,
        );
        sigkill(&mut d);
        drop(c);
        drop(d);
        if commit == "journal" {
            // Replayed as it is served again.
            Daemon::start(&dir, std::slice::from_ref(&export)).terminate();
        }
        let back = read_through_qemu(&img, &dir.join("back.raw"));
        let mut completed = 0;
        for (i, r) in done.iter().enumerate() {
            let Some(r) = r else { continue };
            r.as_ref()
                .unwrap_or_else(|e| panic!("round {round}: write {i}: {e}"));
            completed += 1;
            let (at, data) = (writes[i].0 as usize, &writes[i].1);
            assert!(
                back[at..at + 4096] == data[..],
                "round {round}: write {i} completed before the kill and was lost"
            );
        }
        assert!(completed > 0, "round {round}: nothing completed");
    }
}
