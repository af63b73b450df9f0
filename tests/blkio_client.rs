//! Integration tests: start the real daemon (`mqblk serve`) and drive it with libblkio's
//! `virtio-blk-vhost-user` driver through `mqblk_client`.
//!
//! Every test has its own temp dir, image and socket, and checks the image file on the host as
//! well as through the daemon, so a daemon that only appears to work (answering from a cache,
//! writing to the wrong offset, past the end, or to a read-only file) fails.
//!
//! `MQBLK_TEST_BACKEND=qsd cargo test --test blkio_client` runs the same tests against
//! qemu-storage-daemon, the reference backend.

mod support;

use std::time::Duration;

use mqblk_client::{
    check_pattern, fill_pattern, run, Client, ConnectOptions, Pattern, Report, ReqFlags,
    RequestError, Workload,
};
use support::daemon::*;

const IMG_SIZE: u64 = 8 * MIB;
/// Seed of the data images start with, so that zeroes and stale data are both visible.
const OLD_SEED: u64 = 0x01d_da7a;
const BS: usize = 4096;

fn expect_errno(r: Result<(), RequestError>, errno: i32, what: &str) {
    match r {
        Err(RequestError::Failed { errno: e, .. }) if e == errno => {}
        other => panic!("{what}: expected a completion with errno {errno}, got {other:?}"),
    }
}

fn expect_failed(r: Result<(), RequestError>, what: &str) -> i32 {
    match r {
        Err(RequestError::Failed { errno, .. }) => errno,
        other => panic!("{what}: expected an error completion, got {other:?}"),
    }
}

fn assert_verify_clean(r: &Report, jobs: usize, ops: u64, queues: usize) {
    assert!(r.clean(), "workload not clean: {r}");
    assert_eq!(r.ios, jobs as u64 * ops * 2, "{r}");
    assert_eq!(r.writes, jobs as u64 * ops, "{r}");
    assert_eq!(r.verified_bytes, jobs as u64 * ops * BS as u64, "{r}");
    assert_eq!(r.jobs.len(), jobs);
    for (i, j) in r.jobs.iter().enumerate() {
        assert_eq!(j.job, i);
        assert_eq!(j.queue, i % queues, "job {i} ran on the wrong queue");
        assert_eq!(j.pattern_bytes, ops * BS as u64);
        assert_eq!(j.ios, ops * 2);
    }
}

/// Pattern write + read-back with concurrent jobs under one thread mapping, then single requests
/// written on each queue and read back on another, then the host-side check of the whole image.
fn verify_mapping(mapping: Mapping, jobs: usize) {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, Some(OLD_SEED));
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(&dir, &[Export::file(&sock, &img).mapping(mapping)]);
    let queues = mapping.queues();
    let mut expected = pattern_bytes(IMG_SIZE, 0, Some(OLD_SEED));

    let seed = 0x5eed_0000 + queues as u64 * 16 + jobs as u64;
    let ops = 96;
    let w = verify_workload(&sock, queues, jobs, ops, seed);
    let r = run(&w).expect("verify workload");
    assert_verify_clean(&r, jobs, ops, queues);
    apply_verify(&mut expected, &r, seed);

    // Each queue on its own: write on queue q, read back on queue q+1 (and on q itself).
    // The last 64 KiB of the disk are outside what the workload wrote (each job wrote 96 blocks
    // from the start of a region of at least 1 MiB).
    let mut c = Client::connect(&sock, queues).expect("connect");
    assert_eq!(c.capacity(), IMG_SIZE);
    assert!(!c.is_read_only());
    for q in 0..queues {
        let off = IMG_SIZE - (q as u64 + 1) * 16 * KIB;
        let data = pattern(16 * KIB as usize, off, seed ^ 0xffff);
        c.write(q, off, &data)
            .unwrap_or_else(|e| panic!("write on queue {q}: {e}"));
        let back = c
            .read_vec((q + 1) % queues, off, data.len())
            .expect("read back");
        assert_bytes_eq(
            &back,
            &data,
            off,
            &format!("written on queue {q}, read on queue {}", (q + 1) % queues),
        );
        assert_bytes_eq(
            &c.read_vec(q, off, data.len()).unwrap(),
            &data,
            off,
            "read on same queue",
        );
        expected[off as usize..off as usize + data.len()].copy_from_slice(&data);
    }
    drop(c);

    assert_file_eq(&img, &expected, "image after verify workload");
    daemon.terminate();
}

#[test]
fn verify_baseline_1_queue_2_jobs() {
    verify_mapping(Mapping::Baseline, 2);
}

#[test]
fn verify_mq_2_queues_1_thread() {
    verify_mapping(Mapping::Mq(2), 2);
}

#[test]
fn verify_mq_4_queues_1_thread_8_jobs() {
    verify_mapping(Mapping::Mq(4), 8);
}

#[test]
fn verify_per_queue_1_queue() {
    verify_mapping(Mapping::PerQueue(1), 1);
}

#[test]
fn verify_per_queue_2_queues() {
    verify_mapping(Mapping::PerQueue(2), 2);
}

#[test]
fn verify_per_queue_4_queues_8_jobs() {
    verify_mapping(Mapping::PerQueue(4), 8);
}

/// The workload API itself: Verify over 2 queues with 2 jobs at iodepth 8.
#[test]
fn run_verify_workload_2_queues() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, None);
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(
        &dir,
        &[Export::file(&sock, &img).mapping(Mapping::PerQueue(2))],
    );

    let mut w = Workload::new(&sock);
    w.num_queues = 2;
    w.jobs = 2;
    w.iodepth = 8;
    w.block_size = BS;
    w.pattern = Pattern::Verify;
    w.seed = 42;
    w.region = Some((MIB, 4 * MIB));
    let r = run(&w).expect("run");
    eprintln!("{r}");
    // No ops limit and no runtime: one pass over each job's 2 MiB.
    let blocks = 2 * MIB / BS as u64;
    assert_verify_clean(&r, 2, blocks, 2);
    assert!(r.ios > 0);
    assert_eq!(r.mismatches, 0);
    assert_eq!(r.latency.count(), r.ios);
    assert!(
        r.p50_us > 0.0 && r.p50_us <= r.p99_us && r.p99_us <= r.p999_us,
        "{r}"
    );
    assert!(r.elapsed > Duration::ZERO && r.iops() > 0.0 && r.mb_per_s() > 0.0);
    assert_eq!(r.jobs[0].region, (MIB, 2 * MIB));
    assert_eq!(r.jobs[1].region, (3 * MIB, 2 * MIB));

    // On the host: the pattern exactly in [1 MiB, 5 MiB), zeroes elsewhere.
    let mut expected = pattern_bytes(IMG_SIZE, 0, None);
    fill_pattern(&mut expected[MIB as usize..5 * MIB as usize], MIB, 42);
    assert_file_eq(&img, &expected, "image after run()");

    // Random reads and timed runs work too.
    w.pattern = Pattern::RandRead;
    w.region = None;
    w.ops_per_job = Some(200);
    let r = run(&w).expect("randread");
    assert!(
        r.clean() && r.reads == 400 && r.bytes == 400 * BS as u64,
        "{r}"
    );
    w.pattern = Pattern::RandWrite;
    w.ops_per_job = None;
    w.runtime = Some(Duration::from_millis(200));
    let r = run(&w).expect("randwrite");
    assert!(r.clean() && r.writes > 0 && r.reads == 0, "{r}");
    daemon.terminate();
}

/// Flush on every queue succeeds, also with FUA writes, on a buffered (direct=off) export where
/// flushing matters; the data is in the file.
#[test]
fn flush() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, Some(OLD_SEED));
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(
        &dir,
        &[Export::file(&sock, &img)
            .mapping(Mapping::PerQueue(2))
            .direct(false)],
    );
    let mut expected = pattern_bytes(IMG_SIZE, 0, Some(OLD_SEED));
    let mut c = Client::connect(&sock, 2).expect("connect");
    for q in 0..2 {
        // Flush with nothing to flush, after a write, and FUA writes (libblkio sends them as
        // write + flush).
        c.flush(q)
            .unwrap_or_else(|e| panic!("flush on queue {q}: {e}"));
        let off = (q as u64 + 1) * MIB;
        let data = pattern(64 * KIB as usize, off, 7);
        c.write(q, off, &data).expect("write");
        c.flush(q)
            .unwrap_or_else(|e| panic!("flush after write on queue {q}: {e}"));
        let off2 = off + 512 * KIB;
        let data2 = pattern(8 * KIB as usize, off2, 8);
        c.write_flags(q, off2, &data2, ReqFlags::FUA)
            .expect("FUA write");
        for (o, d) in [(off, &data), (off2, &data2)] {
            expected[o as usize..o as usize + d.len()].copy_from_slice(d);
            assert_bytes_eq(
                &read_file(&img, o, d.len()),
                d,
                o,
                "flushed data in the file",
            );
        }
    }
    drop(c);
    daemon.terminate();
    assert_file_eq(&img, &expected, "image after flushes");
}

/// Write-zeroes (with and without unmap) and discard, then the ranges read as zeroes through the
/// daemon and on the host, and the neighbouring data is intact.
#[test]
fn discard_and_write_zeroes_read_zeros() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, Some(OLD_SEED));
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(
        &dir,
        &[Export::file(&sock, &img).mapping(Mapping::PerQueue(2))],
    );
    let mut expected = pattern_bytes(IMG_SIZE, 0, Some(OLD_SEED));
    let mut c = Client::connect(&sock, 2).expect("connect");
    assert!(
        c.prop_u64("max-write-zeroes-len").unwrap_or(0) > 0,
        "device does not offer WRITE_ZEROES"
    );
    assert!(
        c.prop_u64("max-discard-len").unwrap_or(0) > 0,
        "device does not offer DISCARD"
    );

    // (queue, offset, len, op)
    #[derive(Clone, Copy, Debug)]
    enum Op {
        Zeroes,
        ZeroesUnmap,
        Discard,
    }
    let cases = [
        (0, MIB, 256 * KIB, Op::Zeroes),
        (1, 2 * MIB, 256 * KIB, Op::ZeroesUnmap),
        (0, 3 * MIB, MIB, Op::Discard),
        // Sector-granular, not 4 KiB aligned.
        (1, 5 * MIB + 512, 1536, Op::Zeroes),
        (0, 6 * MIB + 1024, 3072, Op::ZeroesUnmap),
    ];
    for (q, off, len, op) in cases {
        let r = match op {
            Op::Zeroes => c.write_zeroes(q, off, len, false),
            Op::ZeroesUnmap => c.write_zeroes(q, off, len, true),
            // Discard leaves the content undefined by the virtio spec; on a raw file it punches
            // a hole (as qemu-storage-daemon does), which reads as zeroes.
            Op::Discard => c.discard(q, off, len),
        };
        r.unwrap_or_else(|e| panic!("{op:?} {off}+{len} on queue {q}: {e}"));
        expected[off as usize..(off + len) as usize].fill(0);
        // Read a bit around the range on the other queue: zeroes inside, old data outside.
        let (lo, hi) = (off - 4 * KIB, off + len + 4 * KIB);
        let got = c
            .read_vec(1 - q, lo, (hi - lo) as usize)
            .expect("read back");
        assert_bytes_eq(
            &got,
            &expected[lo as usize..hi as usize],
            lo,
            &format!("after {op:?} {off}+{len}"),
        );
    }
    drop(c);
    assert_file_eq(&img, &expected, "image after write-zeroes/discard");
    daemon.terminate();
}

/// A read-only export: the device advertises read-only, reads work, writes (and write-zeroes,
/// discard, write workloads) fail, and the file is unchanged.
#[test]
fn read_only_export_rejects_writes_and_file_is_unchanged() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, Some(OLD_SEED));
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(
        &dir,
        &[Export::file(&sock, &img)
            .mapping(Mapping::PerQueue(2))
            .readonly()],
    );
    let expected = pattern_bytes(IMG_SIZE, 0, Some(OLD_SEED));

    // libblkio refuses a read-write connection only if the device offers VIRTIO_BLK_F_RO.
    let mut rw = ConnectOptions::new(2);
    rw.read_only = Some(false);
    let Err(err) = Client::connect_with(&sock, &rw) else {
        panic!("read-write connection to a read-only export succeeded");
    };
    assert!(format!("{err:#}").contains("read-only"), "{err:#}");

    let mut c = Client::connect(&sock, 2).expect("connect");
    assert!(c.is_read_only());
    assert_eq!(c.capacity(), IMG_SIZE);
    for q in 0..2 {
        let got = c.read_vec(q, MIB, 64 * KIB as usize).expect("read");
        assert_bytes_eq(
            &got,
            &expected[MIB as usize..(MIB + 64 * KIB) as usize],
            MIB,
            "read-only read",
        );
        // With VIRTIO_BLK_F_RO negotiated, libblkio fails these itself (EBADF), as a guest
        // driver would; they must fail one way or another.
        expect_failed(c.write(q, 0, &[0xaa; BS]), "write to read-only export");
        expect_failed(
            c.write_zeroes(q, 0, 64 * KIB, false),
            "write-zeroes to read-only export",
        );
        expect_failed(c.discard(q, 0, 64 * KIB), "discard on read-only export");
    }
    drop(c);

    let mut w = Workload::new(&sock);
    w.num_queues = 2;
    w.jobs = 2;
    w.pattern = Pattern::RandWrite;
    w.ops_per_job = Some(16);
    let Err(werr) = run(&w) else {
        panic!("write workload on a read-only export succeeded");
    };
    assert!(format!("{werr:#}").contains("read-only"), "{werr:#}");
    w.pattern = Pattern::RandRead;
    let r = run(&w).expect("read workload on a read-only export");
    assert!(r.clean() && r.reads == 32 && r.read_only, "{r}");

    daemon.terminate();
    assert_file_eq(&img, &expected, "read-only image");
}

/// Requests at and across the end of the disk fail with IOERR, change nothing, and the daemon
/// keeps serving every queue afterwards.
#[test]
fn out_of_range_io_errors_and_daemon_keeps_serving() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, Some(OLD_SEED));
    let sock = dir.join("vhost.sock");
    let daemon = Daemon::start(
        &dir,
        &[Export::file(&sock, &img).mapping(Mapping::PerQueue(2))],
    );
    let mut expected = pattern_bytes(IMG_SIZE, 0, Some(OLD_SEED));
    let mut c = Client::connect(&sock, 2).expect("connect");
    let cap = c.capacity();
    assert_eq!(cap, IMG_SIZE);
    let eio = libc::EIO;
    let mut buf = vec![0u8; BS];
    for q in 0..2 {
        let ctx = |s: &str| format!("{s} on queue {q}");
        expect_errno(c.read(q, cap, &mut buf), eio, &ctx("read at capacity"));
        expect_errno(c.write(q, cap, &buf), eio, &ctx("write at capacity"));
        expect_errno(
            c.read(q, cap - 512, &mut buf),
            eio,
            &ctx("read straddling the end"),
        );
        expect_errno(
            c.write(q, cap - 512, &[0xee; BS]),
            eio,
            &ctx("write straddling the end"),
        );
        expect_errno(
            c.read(q, 1 << 60, &mut buf[..512]),
            eio,
            &ctx("read at 2^60"),
        );
        expect_errno(
            c.write(q, u64::MAX - 511, &buf[..512]),
            eio,
            &ctx("write at the last sector number"),
        );
        let e = expect_failed(
            c.write_zeroes(q, cap - 4096, 8192, false),
            &ctx("write-zeroes straddling the end"),
        );
        assert!(
            e == eio || e == libc::ENOTSUP,
            "write-zeroes straddling the end: errno {e}"
        );
        let e = expect_failed(c.discard(q, cap, 4096), &ctx("discard at capacity"));
        assert!(
            e == eio || e == libc::ENOTSUP,
            "discard at capacity: errno {e}"
        );
        // The last block itself is fine.
        c.read(q, cap - BS as u64, &mut buf)
            .unwrap_or_else(|e| panic!("{}: {e}", ctx("read of the last block")));
        assert_bytes_eq(
            &buf,
            &expected[(cap as usize - BS)..],
            cap - BS as u64,
            "last block",
        );
    }
    // Nothing was written: not the in-range part of a straddling request, not past the end.
    assert_file_eq(&img, &expected, "image after out-of-range requests");

    // Still serving, on every queue.
    for q in 0..2 {
        let off = q as u64 * MIB;
        let data = pattern(BS, off, 99);
        c.write(q, off, &data)
            .unwrap_or_else(|e| panic!("good write on queue {q} after errors: {e}"));
        assert_bytes_eq(
            &c.read_vec(1 - q, off, BS).unwrap(),
            &data,
            off,
            "good read after errors",
        );
        expected[off as usize..off as usize + BS].copy_from_slice(&data);
    }
    drop(c);
    let r = run(&verify_workload(&sock, 2, 2, 32, 5)).expect("workload after errors");
    assert_verify_clean(&r, 2, 32, 2);
    apply_verify(&mut expected, &r, 5);
    assert_file_eq(&img, &expected, "image after good I/O");
    daemon.terminate();
}

/// A client writes and disconnects; a second client (with a different number of queues) connects
/// and sees the same data; the daemon keeps running between clients.
#[test]
fn second_client_sees_same_data() {
    let dir = TestDir::new();
    let img = dir.image("disk.img", IMG_SIZE, None);
    let sock = dir.join("vhost.sock");
    let mut daemon = Daemon::start(
        &dir,
        &[Export::file(&sock, &img).mapping(Mapping::PerQueue(4))],
    );
    let mut expected = pattern_bytes(IMG_SIZE, 0, None);
    let seed = 0xc11e;

    // First client: a Verify workload on 4 queues, then single writes, then it disconnects.
    let w = verify_workload(&sock, 4, 4, 64, seed);
    let r = run(&w).expect("first client's workload");
    assert_verify_clean(&r, 4, 64, 4);
    apply_verify(&mut expected, &r, seed);
    let marker_off = IMG_SIZE - 64 * KIB;
    let marker = pattern(64 * KIB as usize, marker_off, seed + 1);
    {
        let mut c = Client::connect(&sock, 4).expect("first client");
        c.write(3, marker_off, &marker).expect("marker write");
    }
    expected[marker_off as usize..].copy_from_slice(&marker);
    assert!(
        daemon.has_exited().is_none(),
        "daemon exited after the first client disconnected"
    );

    // Second client, 1 queue: sees the marker.
    let mut c = Client::connect(&sock, 1).expect("second client");
    assert_eq!(c.capacity(), IMG_SIZE);
    assert_bytes_eq(
        &c.read_vec(0, marker_off, marker.len()).unwrap(),
        &marker,
        marker_off,
        "second client",
    );
    drop(c);

    // Third client, 2 queues: checks everything the first one wrote without writing.
    let mut check = w.clone();
    check.pattern = Pattern::Check;
    check.num_queues = 2;
    let r2 = run(&check).expect("check run");
    assert!(r2.clean(), "{r2}");
    assert_eq!(r2.writes, 0);
    assert_eq!(r2.verified_bytes, 4 * 64 * BS as u64, "{r2}");
    // ...and the check is real: the wrong seed finds every block wrong.
    check.seed = seed + 2;
    let bad = run(&check).expect("check run with the wrong seed");
    assert_eq!(bad.mismatches, 4 * 64, "{bad}");

    assert_file_eq(&img, &expected, "image after several clients");
    daemon.terminate();
}

/// The host-side check helpers themselves catch misplaced data (guards the tests above).
#[test]
fn host_pattern_check_detects_misplaced_data() {
    let a = pattern(BS, 8 * KIB, 1);
    assert_eq!(check_pattern(&a, 8 * KIB, 1), None);
    assert!(check_pattern(&a, 12 * KIB, 1).is_some());
    assert!(check_pattern(&a, 8 * KIB, 2).is_some());
}
