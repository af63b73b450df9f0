//! `engine=rbd` on a real Ceph cluster: one monitor and one OSD started by
//! [`support::ceph::Ceph`] from Debian's packages, on loopback, in a temporary directory.
//!
//! The tests that leave the cluster as they found it share one cluster (each with its own
//! image); the two that stop a daemon of the cluster get their own. Every check of what was
//! written reads the image back with the `rbd` tool as well, not only through mqblk.
//!
//! Needs the `rbd` feature (`cargo test --features rbd --test rbd`, which `.ci/run` runs) and
//! what `.ci/setup` installs (ceph-mon, ceph-osd, librbd-dev; QEMU and the guest kernel for the
//! guest test).
#![cfg(feature = "rbd")]

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use mqblk_client::{run, Client, RequestError};
use support::api::{daemon_with_api_allowing, Api};
use support::ceph::Ceph;
use support::daemon::*;
use support::proc::{tasks, Proc};
use support::qemu::{report_line, result_failure, word_value, GuestBoot, Qemu, WorkDir};
use support::raw::raw_write;
use support::wait::wait_until;

const BS: usize = 4096;
/// The images the tests create (mqblk creates them with `size=`).
const IMG_SIZE: u64 = 16 * MIB;

/// The cluster the non-disruptive tests share, started by the first of them. A static is never
/// dropped: an exit handler stops its daemons and removes its directory.
fn cluster() -> &'static Ceph {
    static CEPH: OnceLock<Ceph> = OnceLock::new();
    extern "C" fn at_exit() {
        if let Some(c) = CEPH.get() {
            c.kill_now();
        }
    }
    CEPH.get_or_init(|| {
        let c = Ceph::start();
        // SAFETY: registers a plain function with no arguments; it runs once, at exit.
        unsafe { libc::atexit(at_exit) };
        c
    })
}

/// An rbd export of `pool/image` on `ceph`.
fn rbd_export(ceph: &Ceph, socket: &Path, pool: &str, image: &str) -> Export {
    let mut e = Export::without_path(socket);
    for (k, v) in ceph.export_keys(pool, image) {
        e = e.set(&k, &v);
    }
    e
}

/// A pattern write + read-back with 2 jobs over the export's queues, then a write on each queue
/// read back on the other, then the whole image read by the `rbd` tool against what was written.
fn verify_mapping(mapping: Mapping, image: &str) {
    let ceph = cluster();
    let dir = TestDir::new();
    let sock = dir.join("vhost.sock");
    let export = rbd_export(ceph, &sock, "rbd", image)
        .mapping(mapping)
        .set("size", &IMG_SIZE.to_string());
    let daemon = Daemon::start(&dir, &[export]);
    let queues = mapping.queues();
    let (jobs, ops, seed) = (2usize, 128u64, 0x7bd0 + queues as u64);

    let mut w = verify_workload(&sock, queues, jobs, ops, seed);
    w.iodepth = 16;
    // An OSD on the same two vCPUs as everything else can be slow to answer.
    w.io_timeout = Duration::from_secs(30);
    let r = run(&w).expect("verify workload");
    assert!(r.clean(), "workload not clean: {r}");
    assert_eq!(r.verified_bytes, jobs as u64 * ops * BS as u64, "{r}");
    support::sandbox::assert_confined(daemon.pid(), 1); // librados's threads included
    let mut expected = vec![0u8; IMG_SIZE as usize];
    apply_verify(&mut expected, &r, seed);

    let mut c = Client::connect(&sock, queues).expect("connect");
    assert_eq!(c.capacity(), IMG_SIZE);
    for q in 0..queues {
        let off = IMG_SIZE - (q as u64 + 1) * 64 * KIB;
        let data = pattern(64 * KIB as usize, off, seed ^ 0xffff);
        c.write(q, off, &data).expect("write");
        let other = (q + 1) % queues;
        let back = c.read_vec(other, off, data.len()).expect("read back");
        assert_bytes_eq(
            &back,
            &data,
            off,
            &format!("written on queue {q}, read on {other}"),
        );
        expected[off as usize..][..data.len()].copy_from_slice(&data);
    }
    c.flush(0).expect("flush");
    drop(c);
    daemon.terminate();
    assert_bytes_eq(
        &ceph.read_image("rbd", image),
        &expected,
        0,
        &format!("{image} read by the rbd tool"),
    );
}

#[test]
fn client_verify_baseline() {
    verify_mapping(Mapping::Baseline, "verify-baseline");
}

#[test]
fn client_verify_mq_2_queues_1_thread() {
    verify_mapping(Mapping::Mq(2), "verify-mq");
}

#[test]
fn client_verify_per_queue_2_queues() {
    verify_mapping(Mapping::PerQueue(2), "verify-per-queue");
}

/// Discard and write-zeroes (with and without unmap) read back as zeroes, through mqblk and
/// through the `rbd` tool, and leave the data around them alone.
#[test]
fn discard_and_write_zeroes_read_back_as_zeroes() {
    let ceph = cluster();
    let dir = TestDir::new();
    let sock = dir.join("vhost.sock");
    let export = rbd_export(ceph, &sock, "rbd", "zeroes")
        .queues(2)
        .set("size", &IMG_SIZE.to_string());
    let daemon = Daemon::start(&dir, &[export]);
    let mut c = Client::connect(&sock, 2).expect("connect");
    let len = MIB as usize;
    let mut expected = vec![0u8; IMG_SIZE as usize];
    for (i, off) in [0u64, 4 * MIB, 8 * MIB].into_iter().enumerate() {
        let data = pattern(len, off, 99);
        c.write(i % 2, off, &data).expect("write");
        expected[off as usize..][..len].copy_from_slice(&data);
    }
    // Ranges inside the written data, not aligned to RBD's 4 MiB objects.
    let ranges = [
        (64 * KIB, 256 * KIB),
        (4 * MIB + 12 * KIB, 512 * KIB),
        (8 * MIB + 4 * KIB, 4 * KIB),
    ];
    c.discard(0, ranges[0].0, ranges[0].1).expect("discard");
    c.write_zeroes(1, ranges[1].0, ranges[1].1, true)
        .expect("write-zeroes (unmap)");
    c.write_zeroes(0, ranges[2].0, ranges[2].1, false)
        .expect("write-zeroes (no unmap)");
    for (off, n) in ranges {
        expected[off as usize..][..n as usize].fill(0);
        let back = c.read_vec(1, off, n as usize).expect("read");
        assert!(
            back.iter().all(|&b| b == 0),
            "{n} bytes at {off} are not zeroes through mqblk"
        );
    }
    for (off, _) in [(0u64, 0), (4 * MIB, 0), (8 * MIB, 0)] {
        let back = c.read_vec(0, off, len).expect("read");
        assert_bytes_eq(
            &back,
            &expected[off as usize..][..len],
            off,
            "around the zeroed ranges",
        );
    }
    drop(c);
    daemon.terminate();
    assert_bytes_eq(
        &ceph.read_image("rbd", "zeroes"),
        &expected,
        0,
        "read by the rbd tool",
    );
}

/// An image mqblk creates (`size=`) has `layering` only; serving an image that has the
/// exclusive lock warns when several I/O threads would write through their own handles, and
/// only then (one thread, or read-only, does not). Writes through both queues still land.
#[test]
fn exclusive_lock_warns_only_when_several_threads_write() {
    const WARNING: &str = "the image has the exclusive-lock feature";
    let ceph = cluster();
    let dir = TestDir::new();
    let sock = dir.join("vhost.sock");

    let created = rbd_export(ceph, &sock, "rbd", "created-by-mqblk")
        .mapping(Mapping::PerQueue(2))
        .set("size", &IMG_SIZE.to_string());
    let daemon = Daemon::start(&dir, &[created]);
    let log = daemon.log();
    daemon.terminate();
    let features = ceph.features("rbd", "created-by-mqblk");
    assert!(
        features.contains("layering") && !features.contains("exclusive-lock"),
        "an image mqblk created: {features}"
    );
    assert!(!log.contains(WARNING), "warned about its own image:\n{log}");

    ceph.create_image("rbd", "xlock", IMG_SIZE, true);
    let features = ceph.features("rbd", "xlock");
    assert!(features.contains("exclusive-lock"), "{features}");
    let cases = [
        (Mapping::PerQueue(2), false, true),
        (Mapping::Mq(2), false, false),
        (Mapping::PerQueue(2), true, false),
    ];
    for (mapping, readonly, warns) in cases {
        let mut export = rbd_export(ceph, &sock, "rbd", "xlock").mapping(mapping);
        if readonly {
            export = export.readonly();
        }
        let daemon = Daemon::start(&dir, &[export]);
        if !readonly {
            let mut c = Client::connect(&sock, 2).expect("connect");
            for q in 0..2 {
                let off = q as u64 * MIB;
                let data = pattern(64 * KIB as usize, off, 0x10c + q as u64);
                c.write(q, off, &data).expect("write");
                let back = c.read_vec(1 - q, off, data.len()).expect("read back");
                assert_bytes_eq(&back, &data, off, &format!("{mapping:?}, queue {q}"));
            }
        }
        let log = daemon.log();
        daemon.terminate();
        assert_eq!(
            log.contains(WARNING),
            warns,
            "{mapping:?}, readonly={readonly}: warned {} expected {warns}\n{log}",
            !warns
        );
    }
}

/// A read-only export offers VIRTIO_BLK_F_RO, serves reads, and refuses a write that bypasses
/// libblkio's own check; the image is unchanged.
#[test]
fn readonly_refuses_writes() {
    let ceph = cluster();
    ceph.create_image("rbd", "ro", IMG_SIZE, false);
    let dir = TestDir::new();
    // Content first, through a writable export.
    let sock = dir.join("rw.sock");
    let daemon = Daemon::start(&dir, &[rbd_export(ceph, &sock, "rbd", "ro")]);
    let data = pattern(MIB as usize, 0, 7);
    let mut c = Client::connect(&sock, 1).expect("connect");
    c.write(0, 0, &data).expect("write");
    drop(c);
    daemon.terminate();
    let before = ceph.read_image("rbd", "ro");

    let sock = dir.join("ro.sock");
    let daemon = Daemon::start(&dir, &[rbd_export(ceph, &sock, "rbd", "ro").readonly()]);
    let mut c = Client::connect(&sock, 1).expect("connect");
    assert!(c.is_read_only(), "a read-only rbd export does not say so");
    assert_bytes_eq(
        &c.read_vec(0, 0, data.len()).unwrap(),
        &data,
        0,
        "read-only read",
    );
    match c.write(0, 0, &[0x55; BS]) {
        Err(RequestError::Failed { .. }) => {}
        other => panic!("libblkio write to a read-only export: {other:?}"),
    }
    drop(c);
    let (ro, ret) = raw_write(&sock, 0, &[0x55; BS]);
    assert!(ro, "read-only export does not offer VIRTIO_BLK_F_RO");
    assert_ne!(ret, 0, "read-only rbd export accepted a write");
    daemon.terminate();
    assert!(
        ceph.read_image("rbd", "ro") == before,
        "a read-only export changed the image"
    );
}

/// The export spec of `ceph`'s `pool/image` with `extra` keys.
fn spec(ceph: &Ceph, sock: &Path, pool: &str, image: &str, extra: &str) -> String {
    let mut s = rbd_export(ceph, sock, pool, image).spec();
    if !extra.is_empty() {
        s.push(',');
        s.push_str(extra);
    }
    s
}

/// A missing pool, a missing image and a keyring with the wrong key each give their own line.
#[test]
fn bad_pool_image_and_keyring_fail_with_one_line() {
    let ceph = cluster();
    ceph.create_image("rbd", "exists", IMG_SIZE, false);
    let dir = TestDir::new();
    let sock = dir.join("vhost.sock");
    // `mqblk serve --export SPEC`, which must fail within 20 s: its error line.
    let fails = |export: String| serve_fails(&export_arg(export), Duration::from_secs(20));

    let e = fails(spec(ceph, &sock, "nosuchpool", "exists", ""));
    assert!(e.contains("pool nosuchpool does not exist"), "{e}");

    let e = fails(spec(ceph, &sock, "rbd", "nosuchimage", ""));
    assert!(
        e.contains("image rbd/nosuchimage does not exist") && e.contains("size="),
        "{e}"
    );

    // client.admin with another key: the monitors refuse it.
    let bad = dir.join("bad.keyring");
    let out = Command::new("ceph-authtool")
        .args(["--create-keyring", "--gen-key", "-n", "client.admin"])
        .arg(&bad)
        .output()
        .expect("ceph-authtool");
    assert!(out.status.success(), "{out:?}");
    let s = spec(ceph, &sock, "rbd", "exists", "timeout=10").replace(
        &format!("keyring={}", ceph.keyring.display()),
        &format!("keyring={}", bad.display()),
    );
    let e = fails(s);
    assert!(
        e.contains("refused client.admin's credentials") && e.contains("keyring="),
        "{e}"
    );

    // A keyring that is not there.
    let s = spec(ceph, &sock, "rbd", "exists", "").replace(
        &format!("keyring={}", ceph.keyring.display()),
        "keyring=/nonexistent/ceph.keyring",
    );
    let e = fails(s);
    assert!(
        e.contains("cannot read the keyring /nonexistent/ceph.keyring"),
        "{e}"
    );

    // librbd's cache with several writing I/O threads (each would have its own cache).
    let e = fails(spec(ceph, &sock, "rbd", "exists", "direct=off,queues=2"));
    assert!(
        e.contains("direct=off") && e.contains("needs threads=1"),
        "{e}"
    );

    // A keyring without the user's key at all.
    let s = spec(ceph, &sock, "rbd", "exists", "user=nobody");
    let e = fails(s);
    assert!(e.contains("client.nobody"), "{e}");
    assert!(!sock.exists(), "a failed start left its socket behind");
}

/// With the monitor stopped, the start fails within about `timeout=` with the line that says
/// no monitor answered, naming the monitors it tried.
#[test]
fn stopped_monitor_fails_start_within_the_timeout() {
    let mut ceph = Ceph::start();
    ceph.stop_mon();
    let dir = TestDir::new();
    let sock = dir.join("vhost.sock");
    let t = Instant::now();
    let e = serve_fails(
        &export_arg(spec(&ceph, &sock, "rbd", "any", "timeout=5")),
        Duration::from_secs(20),
    );
    assert!(e.contains("no Ceph monitor answered within 5 s"), "{e}");
    assert!(e.contains(&format!("127.0.0.1:{}", ceph.mon_port)), "{e}");
    assert!(
        t.elapsed() >= Duration::from_secs(4),
        "gave up before the timeout: {e}"
    );

    // The same export added through the management API fails the same way, and while it
    // tries, the API answers everything else at once.
    let (mut d, mut api) = daemon_with_api_allowing(
        &dir,
        &[ceph.dir()],
        &[Export::null(dir.join("other.sock"), MIB)],
    );
    let api_sock = dir.join("api.sock");
    let mut params = serde_json::Map::new();
    for (k, v) in ceph.export_keys("rbd", "any") {
        params.insert(k, v.into());
    }
    params.insert("socket".into(), sock.to_str().unwrap().into());
    params.insert("timeout".into(), "5".into());
    let add = {
        let api_sock = api_sock.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            let r = Api::connect(&api_sock).call("export_add", params.into());
            (r, t.elapsed())
        })
    };
    // The add is under way once librados runs in the daemon (its messenger threads, which the
    // null export beside it does not start).
    let connecting = || {
        tasks(d.pid())
            .iter()
            .any(|t| t.name.starts_with("msgr-worker"))
    };
    assert!(
        wait_until(Duration::from_secs(10), connecting),
        "export_add did not start connecting to Ceph: {:?}",
        tasks(d.pid())
    );
    let t = Instant::now();
    let list = api.ok("export_list", serde_json::json!({}));
    let answered = t.elapsed();
    assert!(
        !add.is_finished(),
        "export_add ended before export_list was answered: the test shows nothing"
    );
    let (added, took) = add.join().unwrap();
    let e = added.expect_err("an export on a stopped monitor started");
    assert!(e.1.contains("no Ceph monitor answered within 5 s"), "{e:?}");
    assert!(
        took >= Duration::from_secs(4),
        "export_add gave up after {took:?}: too soon to show anything"
    );
    assert!(
        answered < Duration::from_secs(1),
        "export_list took {answered:?} while export_add waited for the monitor"
    );
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert!(!sock.exists(), "a failed export_add left its socket behind");
    assert!(d.stop().success());
}

/// With the OSD stopped while a client writes, requests fail with IOERR within `timeout=` (no
/// hang); mqblk keeps running, and once the OSD is back the same connection reads and writes
/// again, and what was written before the outage is still there.
#[test]
fn osd_outage_gives_errors_then_io_resumes() {
    const TIMEOUT_S: u64 = 5;
    let mut ceph = Ceph::start();
    let dir = TestDir::new();
    let sock = dir.join("vhost.sock");
    let export = rbd_export(&ceph, &sock, "rbd", "outage")
        .queues(2)
        .set("size", &IMG_SIZE.to_string())
        .set("timeout", &TIMEOUT_S.to_string());
    let mut daemon = Daemon::start(&dir, &[export]);
    let mut c = Client::connect(&sock, 2).expect("connect");
    // The client waits longer than mqblk's timeout: a hang shows as RequestError::Timeout.
    c.set_timeout(Duration::from_secs(TIMEOUT_S * 4));
    let before = pattern(MIB as usize, 0, 1);
    c.write(0, 0, &before).expect("write before the outage");

    // Mid-run: the OSD stops while the client keeps writing.
    let mut written = 0u64;
    let stopper = std::thread::scope(|s| {
        let stopper = s.spawn(|| {
            // Let the client write for a moment first: whenever it comes, the stop falls while
            // the client writes (nothing waits for it).
            std::thread::sleep(Duration::from_millis(500));
            ceph.stop_osd();
            Instant::now()
        });
        let mut failed = None;
        let deadline = Instant::now() + Duration::from_secs(60);
        while failed.is_none() && Instant::now() < deadline {
            let off = 2 * MIB + (written % 64) * BS as u64;
            let t = Instant::now();
            match c.write((written % 2) as usize, off, &pattern(BS, off, 2)) {
                Ok(()) => written += 1,
                Err(RequestError::Failed { errno, .. }) => failed = Some((errno, t.elapsed())),
                Err(e) => panic!("write during the outage: {e} (expected an I/O error)"),
            }
        }
        let (errno, took) = failed.expect("no write failed while the OSD was down");
        assert_eq!(errno, libc::EIO, "expected IOERR");
        assert!(
            took <= Duration::from_secs(TIMEOUT_S + 5),
            "the failed write took {took:?}, more than timeout={TIMEOUT_S} s"
        );
        eprintln!("{written} writes before the outage; the first failure after {took:?}");
        stopper.join().unwrap()
    });
    // A read fails too, within the timeout.
    let t = Instant::now();
    match c.read_vec(1, 0, BS) {
        Err(RequestError::Failed { errno, .. }) => assert_eq!(errno, libc::EIO),
        other => panic!("read with the OSD down: {other:?}"),
    }
    assert!(
        t.elapsed() <= Duration::from_secs(TIMEOUT_S + 5),
        "read took {:?}",
        t.elapsed()
    );
    assert!(
        daemon.has_exited().is_none(),
        "mqblk exited during the outage"
    );
    eprintln!(
        "outage: errors for {:.1} s",
        stopper.elapsed().as_secs_f64()
    );

    ceph.start_osd();
    // The OSD is up in the map; the client's next requests may still meet the old map for a
    // moment: retry for a bounded time, on the same connection, without restarting mqblk.
    let after = pattern(MIB as usize, 4 * MIB, 3);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match c.write(1, 4 * MIB, &after) {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                eprintln!("write after the OSD restart: {e}; retrying");
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => panic!("no write succeeded within 60 s of the OSD's return: {e}"),
        }
    }
    assert_bytes_eq(
        &c.read_vec(0, 4 * MIB, after.len()).unwrap(),
        &after,
        4 * MIB,
        "after",
    );
    assert_bytes_eq(
        &c.read_vec(1, 0, before.len()).unwrap(),
        &before,
        0,
        "before the outage",
    );
    drop(c);
    daemon.terminate();
}

/// A Linux guest (QEMU, 2 queues) writes its pattern to an rbd export, drops its caches, reads
/// it all back with O_DIRECT and buffered reads, and reports PASS. The export runs with
/// librbd's cache on (`direct=off`, one I/O thread), so the guest's flushes and its
/// write-through phase (each write followed by a flush before it completes) go through it.
#[test]
fn guest_verifies_an_rbd_disk() {
    const QUEUES: usize = 2;
    const SECTORS: u64 = 128 * 1024; // 64 MiB, the guest's layout
    let ceph = cluster();
    let boot = GuestBoot::prepare("tests/guest/mkinitramfs.sh");
    let wd = WorkDir::new("mqblk-rbd-guest.");
    let log = wd.path.join("mqblk.log");
    let mut spec = rbd_export(ceph, &wd.socket, "rbd", "guest")
        .queues(QUEUES)
        .direct(false)
        // librbd's cache is per image handle, so per I/O thread: one thread for both queues.
        .set("threads", "1")
        .set("size", &(SECTORS * 512).to_string())
        .spec();
    spec.push_str(",serial=rbd");
    let mut cmd = Command::new(mqblk_bin());
    cmd.env("NO_COLOR", "1").args(["serve", "--export", &spec]);
    let mut server = Proc::spawn_logged("mqblk".into(), &mut cmd, &log);
    server
        .wait_for_socket(&wd.socket, STARTUP_TIMEOUT, || true)
        .unwrap_or_else(|e| panic!("{e}\n{}", std::fs::read_to_string(&log).unwrap_or_default()));
    let seed = 12345;
    let mut qemu = boot.spawn_qemu(
        &wd,
        Qemu {
            smp: 2,
            cpu: None,
            chardev_extra: String::new(),
            queues: QUEUES,
            append: format!(
                "console=ttyS0 panic=-1 loglevel=4 mqblk.seed={seed} mqblk.expect_queues={QUEUES}"
            ),
        },
    );
    let status = qemu
        .wait_timeout(Duration::from_secs(180))
        .expect("wait for QEMU");
    let console = std::fs::read_to_string(&wd.console).unwrap_or_default();
    let mqblk_log = std::fs::read_to_string(&log).unwrap_or_default();
    if status.is_none() {
        qemu.kill();
    }
    let report: Vec<&str> = console.lines().filter_map(report_line).collect();
    let failure = if status.is_none() {
        Some("the guest did not power off within 180 s".to_string())
    } else {
        result_failure(report.iter().copied())
    };
    assert!(
        failure.is_none(),
        "{}\n--- console ---\n{console}\n--- mqblk ---\n{mqblk_log}",
        failure.unwrap()
    );
    let value = |key: &str| report.iter().find_map(|l| word_value(l, key));
    assert_eq!(value("queues"), Some(QUEUES as u64), "{console}");
    assert_eq!(value("size-sectors"), Some(SECTORS), "{console}");
    for region in ["Z", "A", "B", "C"] {
        for mode in ["direct", "buffered"] {
            let ok = format!("verify-{mode} {region} OK ");
            assert!(
                report.iter().any(|l| l.starts_with(&ok)),
                "no `{ok}` line:\n{console}"
            );
        }
    }
    assert!(
        console.contains("MQBLK-GUEST: write-through t="),
        "the guest did not switch the disk to write-through:\n{console}"
    );
    server.signal(rustix::process::Signal::TERM).unwrap();
    let exit = server.wait_timeout(SHUTDOWN_TIMEOUT).unwrap();
    assert!(
        exit.is_some_and(|s| s.success()),
        "mqblk after SIGTERM: {exit:?}\n{mqblk_log}"
    );
}
