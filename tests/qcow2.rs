//! `format=qcow2`, checked against QEMU's own tools: what mqblk writes into a qcow2 image,
//! `qemu-img check` finds consistent and `qemu-img convert` / `qemu-io` read back byte for byte;
//! backing images are never written; discard and write-zeroes read as zeroes both ways; an image
//! mqblk must not serve is refused with one line that says what to do.
mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use mqblk_client::{Client, Concurrent, Pattern};
use support::daemon::*;
use support::mount::Mount;
use support::qemu_img::{
    assert_checks_clean, create_qcow2, dirty_bit, qemu_img_ok, qemu_io_ok, read_through_qemu,
};
use support::skip::has_test_hooks;

const SIZE: u64 = 32 << 20;
const CLUSTER: u64 = 64 << 10;
const BASE_SEED: u64 = 0xba5e;

/// A base image of `SIZE` seeded bytes in `format` (raw, or qcow2 converted from it).
fn base_image(dir: &TestDir, format: &str) -> std::path::PathBuf {
    let raw = dir.image("base.raw", SIZE, Some(BASE_SEED));
    if format == "raw" {
        return raw;
    }
    let q = dir.join("base.qcow2");
    qemu_img_ok(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        &raw.display().to_string(),
        &q.display().to_string(),
    ]);
    std::fs::remove_file(&raw).unwrap();
    q
}

/// An export of a new `SIZE` qcow2 image that mqblk creates, with `queues` queues: the image's
/// path, the socket's, and the export.
fn new_qcow2(dir: &TestDir, queues: usize) -> (PathBuf, PathBuf, Export) {
    let img = dir.join("disk.qcow2");
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img)
        .queues(queues)
        .set("format", "qcow2")
        .set("size", &SIZE.to_string());
    (img, sock, export)
}

/// Serves `img` as a one-queue qcow2 export on `dir/s.sock` (with `direct=` when given), and
/// connects to it.
fn serve_one_queue(dir: &TestDir, img: &Path, direct: Option<bool>) -> (Daemon, Client) {
    serve_one_queue_with(dir, img, direct, &[])
}

/// [`serve_one_queue`] with these keys set too.
fn serve_one_queue_with(
    dir: &TestDir,
    img: &Path,
    direct: Option<bool>,
    keys: &[(&str, &str)],
) -> (Daemon, Client) {
    let sock = dir.join("s.sock");
    let mut export = Export::file(&sock, img).queues(1).set("format", "qcow2");
    if let Some(on) = direct {
        export = export.direct(on);
    }
    for (key, value) in keys {
        export = export.set(key, value);
    }
    let d = Daemon::start(dir, &[export]);
    let c = Client::connect(&sock, 1).unwrap();
    (d, c)
}

fn overlay_export(sock: &Path, overlay: &Path, base: &Path, format: &str) -> Export {
    Export::file(sock, overlay)
        .queues(2)
        .set("format", "qcow2")
        .set("backing", &base.file_name().unwrap().to_string_lossy())
        .set("backing-format", format)
}

/// An overlay mqblk creates over a raw and over a qcow2 base: a verified
/// workload through the libblkio client (4 KiB writes into 64 KiB clusters: copy-on-write from
/// the base around each), then QEMU reads exactly the base patched with what was written,
/// `qemu-img check` is clean, and the base image is unchanged. The workload writes in order at
/// iodepth 16, so a cluster's 16 writes are in flight together: the copy-on-write's cluster
/// locks must order them (without them, 40 blocks came back stale).
///
/// Once more over a raw base with `metadata-commit=flush`, where a write completes before its
/// mapping reaches the file.
#[test]
fn overlays_over_raw_and_qcow2_bases_read_back_through_qemu() {
    for (format, commit) in [("raw", "write"), ("qcow2", "write"), ("raw", "flush")] {
        let dir = TestDir::new();
        let base = base_image(&dir, format);
        let base_before = std::fs::read(&base).unwrap();
        let overlay = dir.join("overlay.qcow2");
        let sock = dir.join("s.sock");
        let export = overlay_export(&sock, &overlay, &base, format).set("metadata-commit", commit);
        let mut d = Daemon::start(&dir, &[export]);
        let seed = 0x0dd;
        // 2 jobs x 1500 blocks of 4 KiB: each job's first ~5.9 MiB of its 16 MiB half.
        let mut w = verify_workload(&sock, 2, 2, 1500, seed);
        w.iodepth = 16;
        let r = mqblk_client::run(&w).expect("verify run");
        assert!(r.clean() && r.mismatches == 0, "{format}: {r}");
        {
            let mut c = Client::connect(&sock, 2).expect("connect");
            c.flush(0).expect("flush");
        }
        d.stop();

        assert_checks_clean(&overlay, false);
        let info = qemu_img_ok(&["info", &overlay.display().to_string()]);
        assert!(
            info.contains(&format!("backing file format: {format}")),
            "{info}"
        );
        let mut expected = pattern_bytes(SIZE, 0, Some(BASE_SEED));
        apply_verify(&mut expected, &r, seed);
        let actual = read_through_qemu(&overlay, &dir.join("converted.raw"));
        assert_bytes_eq(
            &actual,
            &expected,
            0,
            &format!("overlay over {format}, read by QEMU"),
        );
        assert!(
            std::fs::read(&base).unwrap() == base_before,
            "the {format} base image was written"
        );
    }
}

/// Discard and write-zeroes, whole clusters and parts of them, read back as zeroes through
/// mqblk and through qemu-io; the bytes around them keep the base's data; the punched
/// clusters give their blocks back to the filesystem.
#[test]
fn discard_and_write_zeroes_read_back_zeroes() {
    let dir = TestDir::new();
    let base = base_image(&dir, "raw");
    let overlay = dir.join("overlay.qcow2");
    let sock = dir.join("s.sock");
    let mut d = Daemon::start(&dir, &[overlay_export(&sock, &overlay, &base, "raw")]);
    let mut c = Client::connect(&sock, 2).expect("connect");
    // Allocate 32 clusters in the overlay (a write of our own data over them).
    let data = pattern_bytes(32 * CLUSTER, 0, Some(7));
    c.write(0, 0, &data).expect("write");
    c.flush(0).expect("flush");
    let allocated = std::fs::metadata(&overlay).unwrap();
    let ranges = [
        // (offset, len, discard?)
        (CLUSTER, 4 * CLUSTER, true),         // whole clusters
        (8 * CLUSTER + 4096, 8192, true),     // part of an allocated cluster
        (12 * CLUSTER, 2 * CLUSTER, false),   // whole clusters, write-zeroes
        (20 * CLUSTER + 512, CLUSTER, false), // across two clusters
        (100 * CLUSTER + 4096, 4096, false),  // an unallocated cluster: base data below
    ];
    for (i, &(off, len, discard)) in ranges.iter().enumerate() {
        let q = i % 2;
        if discard {
            c.discard(q, off, len).expect("discard");
        } else {
            c.write_zeroes(q, off, len, true).expect("write-zeroes");
        }
        // Read back on the other queue: its thread's cache must have forgotten the range.
        let back = c.read_vec(1 - q, off, len as usize).expect("read");
        assert!(
            back.iter().all(|&b| b == 0),
            "range {i} ({off}+{len}) not zero through mqblk"
        );
    }
    c.flush(0).expect("flush");
    drop(c);
    d.stop();

    assert_checks_clean(&overlay, false);
    let mut expected = pattern_bytes(SIZE, 0, Some(BASE_SEED));
    expected[..data.len()].copy_from_slice(&data);
    for &(off, len, _) in &ranges {
        expected[off as usize..(off + len) as usize].fill(0);
    }
    for &(off, len, _) in &ranges {
        let text = qemu_io_ok(&overlay, &format!("read -P 0 {off} {len}"));
        assert!(
            !text.contains("Pattern verification failed"),
            "qemu-io read -P 0 {off} {len}: {text}"
        );
    }
    assert_bytes_eq(
        &read_through_qemu(&overlay, &dir.join("converted.raw")),
        &expected,
        0,
        "after discard and write-zeroes",
    );
    use std::os::unix::fs::MetadataExt;
    let after = std::fs::metadata(&overlay).unwrap();
    assert!(
        after.blocks() < allocated.blocks(),
        "no block was given back: {} -> {} blocks",
        allocated.blocks(),
        after.blocks()
    );
}

/// A cluster one thread has mapped, zeroed through another queue's thread, then written and
/// read again through the first: the write lands (it is not lost behind the zero flag) and
/// both threads read it.
#[test]
fn a_zeroed_cluster_is_remapped_by_every_thread() {
    let dir = TestDir::new();
    let (img, sock, export) = new_qcow2(&dir, 2);
    let mut d = Daemon::start(&dir, &[export]);
    let mut c = Client::connect(&sock, 2).expect("connect");
    for round in 0..4u64 {
        let off = (round * 3) * CLUSTER;
        let first = pattern_bytes(CLUSTER, off, Some(round + 1));
        c.write(0, off, &first).expect("write q0");
        // The second access of a cluster goes through queue 0's cache.
        assert_eq!(c.read_vec(0, off, CLUSTER as usize).unwrap(), first);
        c.write_zeroes(1, off, CLUSTER, round % 2 == 0)
            .expect("zero q1");
        assert!(c
            .read_vec(0, off, CLUSTER as usize)
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        let second = pattern_bytes(4096, off + 8192, Some(round + 100));
        c.write(0, off + 8192, &second).expect("write q0 again");
        let mut expected = vec![0u8; CLUSTER as usize];
        expected[8192..8192 + 4096].copy_from_slice(&second);
        assert_eq!(
            c.read_vec(0, off, CLUSTER as usize).unwrap(),
            expected,
            "q0, round {round}"
        );
        assert_eq!(
            c.read_vec(1, off, CLUSTER as usize).unwrap(),
            expected,
            "q1, round {round}"
        );
    }
    c.flush(0).unwrap();
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
}

/// SIGKILL while writes allocate clusters: the image opens, `qemu-img check` finds no
/// corruption (leaked clusters are allowed, as in QEMU), and every block acknowledged before
/// the last completed flush reads back.
#[test]
fn flushed_data_survives_sigkill_mid_write() {
    let dir = TestDir::new();
    let (img, sock, export) = new_qcow2(&dir, 2);
    let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
    // The first half: verified, then flushed.
    let seed = 0xf1;
    let mut w = verify_workload(&sock, 2, 2, 1024, seed);
    w.region = Some((0, SIZE / 2));
    let r = mqblk_client::run(&w).expect("verify run");
    assert!(r.clean() && r.mismatches == 0, "{r}");
    Client::connect(&sock, 2).unwrap().flush(1).expect("flush");
    // The second half: random writes (each allocating), killed in the middle.
    let mut writer = w.clone();
    writer.pattern = Pattern::RandWrite;
    writer.region = Some((SIZE / 2, SIZE / 2));
    writer.ops_per_job = None;
    writer.runtime = Some(Duration::from_secs(20));
    let t = std::thread::spawn(move || mqblk_client::run(&writer));
    std::thread::sleep(Duration::from_millis(700));
    d.signal(rustix::process::Signal::KILL);
    let _ = d.wait_exit(Duration::from_secs(10));
    let _ = t.join();
    drop(d);

    assert_checks_clean(&img, true);
    // Served again: what was flushed reads back.
    let d2 = Daemon::start(&dir, &[export]);
    let mut check = w.clone();
    check.pattern = Pattern::Check;
    let r = mqblk_client::run(&check).expect("check run");
    assert!(r.clean() && r.mismatches == 0, "{r}");
    d2.terminate();
}

/// A new image of 16 clusters at `img`, served on `sock` with `metadata-commit=flush`.
fn flush_commit_export(sock: &Path, img: &Path) -> Export {
    sixteen_clusters(sock, img, "flush")
}

/// A new image of 16 clusters at `img`, served on `sock` with `metadata-commit=commit`.
fn sixteen_clusters(sock: &Path, img: &Path, commit: &str) -> Export {
    Export::file(sock, img)
        .set("format", "qcow2")
        .set("size", &(16 * CLUSTER).to_string())
        .set("metadata-commit", commit)
}

/// `metadata-commit=flush`: a write into a new cluster completes before its mapping is in the
/// image file, as with QEMU's qcow2 driver, and the image is marked dirty from the first such
/// write until a flush. A SIGKILL between flushes then leaves an image that is refused in one
/// line naming the loss, not one served behind what the guest was told; `qemu-img check -r all`
/// mends it, with every flushed write in place. A clean shutdown leaves it unmarked.
#[test]
fn with_metadata_commit_flush_a_crash_between_flushes_leaves_the_image_refused_not_stale() {
    let dir = TestDir::new();
    let img = dir.join("disk.qcow2");
    let sock = dir.join("q.sock");
    let export = flush_commit_export(&sock, &img);
    let dirty_bit = || dirty_bit(&img);
    let block = |k: u64, seed: u64| pattern_bytes(4096, k * CLUSTER, Some(seed));
    let write_clusters = |c: &mut Client, ks: std::ops::Range<u64>, seed: u64| {
        for k in ks {
            c.write(0, k * CLUSTER, &block(k, seed)).unwrap();
        }
    };

    let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
    assert_eq!(dirty_bit(), 0, "a new image is not marked");
    let mut c = Client::connect(&sock, 1).unwrap();
    write_clusters(&mut c, 0..4, 1);
    assert_eq!(
        dirty_bit(),
        1,
        "marked while new mappings are in memory only"
    );
    c.flush(0).unwrap();
    assert_eq!(
        dirty_bit(),
        0,
        "a flush writes them back and clears the mark"
    );
    write_clusters(&mut c, 4..8, 2);
    assert_eq!(dirty_bit(), 1, "marked again");
    d.signal(rustix::process::Signal::KILL);
    assert!(d.wait_exit(Duration::from_secs(10)).is_some());
    drop(c);
    drop(d);

    let e = serve_fails(&export_arg(export.spec()), Duration::from_secs(10));
    assert!(
        e.contains("marked dirty")
            && e.contains("metadata-commit=flush")
            && e.contains(&format!("qemu-img check -r all {}", img.display())),
        "{e}"
    );
    qemu_img_ok(&["check", "-r", "all", &img.display().to_string()]);
    assert_checks_clean(&img, false);
    let back = read_through_qemu(&img, &dir.join("back.raw"));
    for k in 0..4 {
        let at = (k * CLUSTER) as usize;
        assert!(
            back[at..at + 4096] == block(k, 1)[..],
            "flushed cluster {k} lost"
        );
    }

    // Served again: shut down cleanly, the image is unmarked and holds every write.
    let d = Daemon::start(&dir, std::slice::from_ref(&export));
    let mut c = Client::connect(&sock, 1).unwrap();
    write_clusters(&mut c, 8..12, 3);
    assert_eq!(dirty_bit(), 1);
    drop(c);
    d.terminate();
    assert_eq!(dirty_bit(), 0, "a clean shutdown clears the mark");
    assert_checks_clean(&img, false);
    let back = read_through_qemu(&img, &dir.join("back2.raw"));
    for k in 8..12 {
        let at = (k * CLUSTER) as usize;
        assert!(
            back[at..at + 4096] == block(k, 3)[..],
            "cluster {k} lost at shutdown"
        );
    }
}

/// `metadata-commit=flush`: a write into a new cluster that completes while a flush is under
/// way, its mapping made after the flush wrote the tables back, keeps the image marked. A
/// debug build's test delay (`MQBLK_TEST_ONLY_DIRTY_CLEAR_DELAY_MS`) holds the flush between
/// its sync and the clearing of the mark; the write completes inside that window, the flush
/// completes after it, and mqblk is killed: the image must still be marked (refused at the
/// next open), since the file lacks that write's mapping. (With the count of completions
/// taken out of the clearing, the flush unmarked it.)
#[test]
fn with_metadata_commit_flush_a_write_completed_during_a_flush_keeps_the_image_marked() {
    if !has_test_hooks() {
        return;
    }
    let dir = TestDir::new();
    let img = dir.join("disk.qcow2");
    let sock = dir.join("q.sock");
    let export = flush_commit_export(&sock, &img).queues(2);
    let mut cmd = std::process::Command::new(mqblk_bin());
    cmd.arg("serve").arg("--export").arg(export.spec());
    cmd.env("MQBLK_TEST_ONLY_DIRTY_CLEAR_DELAY_MS", "1500");
    let mut d = Daemon::spawn(&dir, cmd, &[&sock]);
    let dirty_bit = || dirty_bit(&img);
    let (first, second) = (
        pattern_bytes(4096, CLUSTER, Some(1)),
        pattern_bytes(4096, 5 * CLUSTER, Some(2)),
    );
    let mut c = Client::connect(&sock, 2).unwrap();
    c.write(0, CLUSTER, &first).unwrap();
    assert_eq!(dirty_bit(), 1);
    // The flush, left in flight: it writes the tables back, syncs, then waits 1.5 s.
    let sent = std::time::Instant::now();
    let none = c.together_until(&[Concurrent::Flush { q: 1 }], 0);
    assert!(none[0].is_none(), "the flush completed at once: {none:?}");
    std::thread::sleep(Duration::from_millis(500));
    c.write(0, 5 * CLUSTER, &second).unwrap();
    assert!(
        sent.elapsed() < Duration::from_millis(1400),
        "the write did not complete inside the flush's window"
    );
    // The flush completes (it is answered on queue 1, which nothing polls; its end is seen in
    // the log) and leaves the mark.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        dirty_bit(),
        1,
        "the flush unmarked an image lacking a completed write"
    );
    d.signal(rustix::process::Signal::KILL);
    assert!(d.wait_exit(Duration::from_secs(10)).is_some());
    drop(c);
    drop(d);
    let e = serve_fails(&export_arg(export.spec()), Duration::from_secs(10));
    assert!(e.contains("marked dirty"), "{e}");
    qemu_img_ok(&["check", "-r", "all", &img.display().to_string()]);
    let back = read_through_qemu(&img, &dir.join("back.raw"));
    let at = CLUSTER as usize;
    assert!(
        back[at..at + 4096] == first[..],
        "the flushed write is lost"
    );
}

/// `metadata-commit=flush` and a live migration's handover: a second daemon opens the image
/// while the first serves it marked (the first holds the serving lock), as a migration's
/// destination does; once the first has written its tables back and unmarked the image (here at
/// its shutdown; in a migration when QEMU stops its rings), the second serves everything the
/// first acknowledged. If the first dies instead, the mark stays: the second's queues do not
/// start, and a daemon started after the crash is refused at open.
#[test]
fn with_metadata_commit_flush_a_live_server_s_mark_lets_a_destination_open_and_a_crash_s_does_not()
{
    live_server_mark_handover(true);
}

/// The same handover with the destination in `metadata-commit=write`, as
/// when an operator changes the mode across a migration: the source's live mark lets it open,
/// and a crashed source's mark keeps its queues from starting.
#[test]
fn a_write_mode_destination_takes_over_from_a_live_flush_mode_source_and_not_from_a_crashed_one() {
    live_server_mark_handover(false);
}

/// The body of the two tests above; `destination_flush`: the destination's mode.
fn live_server_mark_handover(destination_flush: bool) {
    let dir = TestDir::new();
    // The destination's own directory, for a log of its own.
    let dir_b = TestDir::new();
    let img = dir.join("disk.qcow2");
    let (sock_a, sock_b) = (dir.join("a.sock"), dir_b.join("b.sock"));
    let export = |sock: &Path| flush_commit_export(sock, &img);
    let destination_commit = if destination_flush { "flush" } else { "write" };
    let destination = |sock: &Path| sixteen_clusters(sock, &img, destination_commit);
    let dirty_bit = || dirty_bit(&img);
    let block = |k: u64| pattern_bytes(4096, k * CLUSTER, Some(k + 3));

    // The handover.
    let a = Daemon::start(&dir, &[export(&sock_a)]);
    let mut c = Client::connect(&sock_a, 1).unwrap();
    for k in 0..4 {
        c.write(0, k * CLUSTER, &block(k)).unwrap();
    }
    assert_eq!(dirty_bit(), 1);
    let b = Daemon::start(&dir_b, &[destination(&sock_b)]);
    assert!(
        b.log().contains("marked dirty by a live server"),
        "{}",
        b.log()
    );
    drop(c);
    a.terminate();
    assert_eq!(dirty_bit(), 0, "the source unmarks the image as it ends");
    let mut c = Client::connect(&sock_b, 1).unwrap();
    for k in 0..4 {
        assert!(
            c.read_vec(0, k * CLUSTER, 4096).unwrap() == block(k),
            "cluster {k}, written through the source, read through the destination"
        );
    }
    for k in 4..8 {
        c.write(0, k * CLUSTER, &block(k)).unwrap();
    }
    drop(c);
    b.terminate();
    assert_eq!(dirty_bit(), 0);
    assert_checks_clean(&img, false);
    let back = read_through_qemu(&img, &dir.join("back.raw"));
    for k in 0..8 {
        let at = (k * CLUSTER) as usize;
        assert!(back[at..at + 4096] == block(k)[..], "cluster {k}");
    }

    // The source dies with the image marked.
    let mut a = Daemon::start(&dir, &[export(&sock_a)]);
    let mut c = Client::connect(&sock_a, 1).unwrap();
    c.write(0, 9 * CLUSTER, &block(9)).unwrap();
    assert_eq!(dirty_bit(), 1);
    let b = Daemon::start(&dir_b, &[destination(&sock_b)]);
    a.signal(rustix::process::Signal::KILL);
    assert!(a.wait_exit(Duration::from_secs(10)).is_some());
    drop(c);
    drop(a);
    let mut c = Client::connect(&sock_b, 1).unwrap();
    c.set_timeout(Duration::from_secs(2));
    assert!(
        c.read_vec(0, 0, 4096).is_err(),
        "the destination served an image its dead source left marked"
    );
    assert!(
        b.wait_for_log(
            "still marked dirty by the server it came from",
            Duration::from_secs(5)
        ),
        "{}",
        b.log()
    );
    drop(c);
    b.terminate();
    assert_eq!(
        dirty_bit(),
        1,
        "the destination unmarked what it never served"
    );
    let e = serve_fails(
        &export_arg(export(&dir.join("c.sock")).spec()),
        Duration::from_secs(10),
    );
    assert!(e.contains("marked dirty"), "{e}");
}

/// `metadata-commit=flush` needs the dirty bit of a version 3 header: a version 2 image is
/// refused in one line naming the key and the upgrade.
#[test]
fn metadata_commit_flush_on_a_version_2_image_is_refused_in_one_line() {
    let dir = TestDir::new();
    let img = dir.join("v2.qcow2").display().to_string();
    qemu_img_ok(&["create", "-f", "qcow2", "-o", "compat=0.10", &img, "16M"]);
    let sock = dir.join("s.sock").display().to_string();
    let e = serve_fails(
        &export_arg(format!(
            "socket={sock},path={img},format=qcow2,metadata-commit=flush"
        )),
        Duration::from_secs(10),
    );
    assert!(
        e.contains("version 2")
            && e.contains("metadata-commit=flush")
            && e.contains(&format!("qemu-img amend -o compat=1.1 {img}")),
        "{e}"
    );
}

/// Each image mqblk must not serve gives one line naming the problem and what to run.
#[test]
fn images_it_must_not_serve_are_refused_in_one_line() {
    let dir = TestDir::new();
    let p = |n: &str| dir.join(n).display().to_string();
    let make = |name: &str| {
        qemu_img_ok(&["create", "-f", "qcow2", &p(name), "16M"]);
        p(name)
    };
    // Sets incompatible feature bits (header offset 72, big-endian u64).
    let set_incompatible = |path: &str, bits: u64| write_at(path, 72, &bits.to_be_bytes());
    let sock = p("s.sock");
    let serve = |image: &str| {
        serve_fails(
            &export_arg(format!("socket={sock},path={image},format=qcow2")),
            Duration::from_secs(10),
        )
    };

    let dirty = make("dirty.qcow2");
    set_incompatible(&dirty, 1);
    let e = serve(&dirty);
    assert!(
        e.contains("dirty") && e.contains(&format!("qemu-img check -r all {dirty}")),
        "{e}"
    );

    let corrupt = make("corrupt.qcow2");
    set_incompatible(&corrupt, 2);
    let e = serve(&corrupt);
    assert!(
        e.contains("corrupt") && e.contains("qemu-img check -r all"),
        "{e}"
    );

    let unknown = make("unknown.qcow2");
    set_incompatible(&unknown, 1 << 40);
    let e = serve(&unknown);
    assert!(e.contains("unknown incompatible feature bit 40"), "{e}");

    // An L1 table that cannot map the whole disk (its size field, at 36, set to 0), which QEMU
    // refuses to open too.
    let small_l1 = make("small-l1.qcow2");
    write_at(&small_l1, 36, &0u32.to_be_bytes());
    let e = serve(&small_l1);
    assert!(
        e.contains(&small_l1)
            && e.contains("L1 table entries 0, where a disk of 16777216 bytes needs 1"),
        "{e}"
    );
    let qemu = std::process::Command::new("qemu-io")
        .args(["-c", "read 0 4k", &small_l1])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&qemu.stderr).contains("L1 table is too small"),
        "{qemu:?}"
    );

    // -u: qemu-img records the backing file without opening it.
    let orphan = p("orphan.qcow2");
    qemu_img_ok(&[
        "create", "-f", "qcow2", "-u", "-b", "gone.raw", "-F", "raw", &orphan, "16M",
    ]);
    let e = serve(&orphan);
    assert!(
        e.contains("gone.raw") && e.contains("does not exist"),
        "{e}"
    );

    let (a, b) = (p("a.qcow2"), p("b.qcow2"));
    qemu_img_ok(&[
        "create", "-f", "qcow2", "-u", "-b", "b.qcow2", "-F", "qcow2", &a, "16M",
    ]);
    qemu_img_ok(&[
        "create", "-f", "qcow2", "-u", "-b", "a.qcow2", "-F", "qcow2", &b, "16M",
    ]);
    let e = serve(&a);
    assert!(
        e.contains("loops") && e.contains("a.qcow2 -> ") && e.contains("b.qcow2"),
        "{e}"
    );

    // Eight overlays of 2 MiB clusters: their tables could take 2049 MiB in imago (128 L2
    // tables of 2 MiB each, and an L1 table each), more than a chain may.
    std::fs::write(p("small.raw"), vec![0u8; 1 << 20]).unwrap();
    let chain = overlay_chain(
        &dir,
        "small.raw",
        "big-clusters-",
        8,
        &["-o", "cluster_size=2M"],
    );
    let top = chain[7].display().to_string();
    let e = serve(&top);
    assert!(
        e.contains(&top)
            && e.contains("at least 2049 MiB of tables")
            && e.contains("qemu-img commit"),
        "{e}"
    );
    // The bound is the export's: one such image is past 256M, and the key's range is checked.
    let one = chain[0].display().to_string();
    for (max, says) in [
        ("256M", "more than table-memory-max=256M"),
        ("1M", "from 16M to 1T"),
    ] {
        let e = serve_fails(
            &export_arg(format!(
                "socket={sock},path={one},format=qcow2,table-memory-max={max}"
            )),
            Duration::from_secs(10),
        );
        assert!(e.contains("table-memory-max") && e.contains(says), "{e}");
    }

    let sized = make("sized.qcow2");
    let e = serve_fails(
        &export_arg(format!("socket={sock},path={sized},format=qcow2,size=32M")),
        Duration::from_secs(10),
    );
    assert!(e.contains("size=33554432") && e.contains("16777216"), "{e}");

    let raw = dir.image("plain.raw", 1 << 20, Some(1));
    let e = serve(&raw.display().to_string());
    assert!(
        e.contains("not a qcow2 image") && e.contains("format=raw"),
        "{e}"
    );

    // A raw image whose first bytes are a qcow2 header stays raw without format=qcow2: the
    // guest sees those bytes, nothing is interpreted.
    let lookalike = make("lookalike.img");
    let header = std::fs::read(&lookalike).unwrap()[..512].to_vec();
    let sock2 = dir.join("raw.sock");
    let mut d = Daemon::start(&dir, &[Export::file(&sock2, &lookalike)]);
    let mut c = Client::connect(&sock2, 1).unwrap();
    assert_eq!(c.read_vec(0, 0, 512).unwrap(), header);
    drop(c);
    d.stop();
}

/// An external snapshot under a running verified workload: no request fails, the data written
/// before reads back after it; the old image is from then on unchanged, `qemu-img check`
/// clean, standalone (no backing), and holds exactly what was written before the snapshot;
/// the new overlay records it as its backing file.
#[test]
fn a_runtime_snapshot_under_load_leaves_a_consistent_backup() {
    runtime_snapshot_under_load("write");
}

/// The same with `metadata-commit=flush`: the old image, whose tables the snapshot writes
/// back, is left unmarked, as the new top is at shutdown.
#[test]
fn a_runtime_snapshot_with_metadata_commit_flush_leaves_a_consistent_backup() {
    runtime_snapshot_under_load("flush");
}

/// The same with `metadata-commit=journal`: the snapshot writes the old image's tables back and
/// closes its journal; the new top records its mappings in a journal of its own.
#[test]
fn a_runtime_snapshot_with_metadata_commit_journal_leaves_a_consistent_backup() {
    runtime_snapshot_under_load("journal");
}

fn runtime_snapshot_under_load(commit: &str) {
    let dir = TestDir::new();
    let (img, sock, export) = new_qcow2(&dir, 2);
    // Writes held to 3000 a second, so that the second half (4096 blocks) is still being
    // written when the snapshot comes, 300 ms in, however fast allocation is.
    let export = export
        .set("id", "vm")
        .set("metadata-commit", commit)
        .set("iops-write", "3000");
    let (mut d, mut api) = support::api::daemon_with_api(&dir, &[export]);
    let seed_a = 0xaa;
    let mut first = verify_workload(&sock, 2, 2, 1024, seed_a);
    first.region = Some((0, SIZE / 2));
    let ra = mqblk_client::run(&first).expect("first half");
    assert!(ra.clean() && ra.mismatches == 0, "{ra}");

    // The second half is written (and verified) while the snapshot is taken.
    let seed_b = 0xbb;
    // One request at a time per job, so that it is still under way when the snapshot comes
    // on a loaded machine too (at iodepth 4 it could end first when the test shared the CPUs
    // with a build).
    let mut second = verify_workload(&sock, 2, 2, 2048, seed_b);
    second.region = Some((SIZE / 2, SIZE / 2));
    second.iodepth = 1;
    let load = std::thread::spawn(move || mqblk_client::run(&second));
    std::thread::sleep(Duration::from_millis(300));
    let overlay = dir.join("after.qcow2");
    let status = api.ok(
        "export_snapshot",
        serde_json::json!({"id": "vm", "overlay": overlay.display().to_string()}),
    );
    assert_eq!(status["id"], "vm", "{status}");
    let old_right_after = std::fs::read(&img).unwrap();
    let rb = load.join().unwrap().expect("second half");
    assert!(
        rb.clean() && rb.mismatches == 0,
        "the workload across the snapshot: {rb}"
    );
    // Everything reads back through the new top.
    let mut check = verify_workload(&sock, 2, 2, 1024, seed_a);
    check.region = Some((0, SIZE / 2));
    check.pattern = Pattern::Check;
    let r = mqblk_client::run(&check).expect("check first half");
    assert!(r.clean() && r.mismatches == 0, "{r}");
    let cfg = api.ok("export_get", serde_json::json!({"id": "vm"}));
    assert_eq!(
        cfg["config"]["path"],
        overlay.display().to_string(),
        "{cfg}"
    );
    // A second snapshot onto a taken path is refused, and changes nothing.
    let e = api
        .call(
            "export_snapshot",
            serde_json::json!({"id": "vm", "overlay": overlay.display().to_string()}),
        )
        .unwrap_err();
    assert!(e.1.contains("exists"), "{e:?}");
    d.stop();

    assert!(
        std::fs::read(&img).unwrap() == old_right_after,
        "the old image changed after the snapshot"
    );
    assert_eq!(dirty_bit(&img), 0, "the old image is marked dirty");
    assert_eq!(dirty_bit(&overlay), 0, "the new top is marked dirty");
    assert_checks_clean(&img, false);
    let info = qemu_img_ok(&["info", &img.display().to_string()]);
    assert!(!info.contains("backing file"), "{info}");
    let old = read_through_qemu(&img, &dir.join("converted.raw"));
    let mut expected_a = vec![0u8; SIZE as usize];
    apply_verify(&mut expected_a, &ra, seed_a);
    assert_bytes_eq(
        &old[..(SIZE / 2) as usize],
        &expected_a[..(SIZE / 2) as usize],
        0,
        "old image, first half",
    );
    // The second half: each block written before the snapshot has the pattern, the rest zero;
    // none is torn or foreign.
    let mut expected_b = vec![0u8; SIZE as usize];
    apply_verify(&mut expected_b, &rb, seed_b);
    let mut written_before = 0;
    for b in (SIZE / 2..SIZE).step_by(4096) {
        let (b, e) = (b as usize, b as usize + 4096);
        if old[b..e] == expected_b[b..e] && expected_b[b..e].iter().any(|&x| x != 0) {
            written_before += 1;
        } else {
            assert!(
                old[b..e].iter().all(|&x| x == 0),
                "old image block at {b}: neither zero nor the data written"
            );
        }
    }
    let written_total = rb.jobs.iter().map(|j| j.pattern_bytes / 4096).sum::<u64>();
    assert!(
        written_before > 0 && written_before < written_total,
        "{written_before} of {written_total} blocks written before the snapshot: it was not taken mid-workload"
    );
    assert_checks_clean(&overlay, false);
    let info = qemu_img_ok(&["info", &overlay.display().to_string()]);
    assert!(
        info.contains("backing file format: qcow2") && info.contains("disk.qcow2"),
        "{info}"
    );
    let mut expected = expected_a;
    apply_verify(&mut expected, &rb, seed_b);
    assert_bytes_eq(
        &read_through_qemu(&overlay, &dir.join("converted.raw")),
        &expected,
        0,
        "the new overlay",
    );
}

/// `export_resize` grows a qcow2 export (the image's virtual size, as QEMU reads it) and
/// refuses to shrink it, saying how.
#[test]
fn resize_grows_the_image_and_refuses_to_shrink() {
    let dir = TestDir::new();
    let img = dir.join("disk.qcow2");
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img)
        .set("format", "qcow2")
        .set("size", "16M")
        .set("id", "vm");
    let (mut d, mut api) = support::api::daemon_with_api(&dir, &[export]);
    let status = api.ok(
        "export_resize",
        serde_json::json!({"id": "vm", "size": "48M"}),
    );
    assert_eq!(status["capacity"], 48u64 << 20, "{status}");
    let mut c = Client::connect(&sock, 1).unwrap();
    let tail = pattern_bytes(4096, (48 << 20) - 4096, Some(3));
    c.write(0, (48 << 20) - 4096, &tail)
        .expect("a write in the new space");
    c.flush(0).unwrap();
    drop(c);
    let e = api
        .call(
            "export_resize",
            serde_json::json!({"id": "vm", "size": "8M"}),
        )
        .unwrap_err();
    assert!(e.1.contains("qemu-img resize --shrink"), "{e:?}");
    d.stop();
    let info = qemu_img_ok(&["info", &img.display().to_string()]);
    assert!(info.contains("virtual size: 48 MiB"), "{info}");
    assert_checks_clean(&img, false);
    let back = read_through_qemu(&img, &dir.join("converted.raw"));
    assert!(
        back[(48 << 20) - 4096..] == tail[..],
        "the write past the old end"
    );
}

/// Compressed clusters of a backing image read back (imago decompresses them on the metadata
/// path), as do the rest of the chain's clusters after writes next to them.
#[test]
fn compressed_backing_clusters_read_back() {
    let dir = TestDir::new();
    // Compressible: each 4 KiB block is one repeated byte.
    let data: Vec<u8> = (0..SIZE as usize)
        .map(|i| (i / 4096 % 251) as u8 + 1)
        .collect();
    let raw = dir.join("plain.raw");
    std::fs::write(&raw, &data).unwrap();
    let base = dir.join("base.qcow2");
    qemu_img_ok(&[
        "convert",
        "-c",
        "-f",
        "raw",
        "-O",
        "qcow2",
        &raw.display().to_string(),
        &base.display().to_string(),
    ]);
    let check = qemu_img_ok(&["check", &base.display().to_string()]);
    assert!(
        !check.contains(" 0.00% compressed"),
        "the base has no compressed cluster: {check}"
    );
    let overlay = dir.join("overlay.qcow2");
    let sock = dir.join("s.sock");
    let mut d = Daemon::start(&dir, &[overlay_export(&sock, &overlay, &base, "qcow2")]);
    let mut c = Client::connect(&sock, 2).unwrap();
    // A write into the middle of a compressed cluster: copy-on-write decompresses the rest.
    let mine = pattern_bytes(4096, 3 * CLUSTER + 8192, Some(9));
    c.write(1, 3 * CLUSTER + 8192, &mine).unwrap();
    let mut expected = data.clone();
    expected[(3 * CLUSTER + 8192) as usize..(3 * CLUSTER + 12288) as usize].copy_from_slice(&mine);
    for off in (0..SIZE).step_by(1 << 20) {
        let got = c.read_vec((off >> 20) as usize % 2, off, 1 << 20).unwrap();
        assert!(
            got[..] == expected[off as usize..(off + (1 << 20)) as usize],
            "MiB at {off}"
        );
    }
    drop(c);
    d.stop();
    assert_checks_clean(&overlay, false);
}

/// A request over clusters that lie apart in the image file becomes one host I/O per run on
/// the I/O thread's ring (the `split_parts` counter), and reads and writes the right bytes.
#[test]
fn a_request_over_scattered_clusters_is_cut_into_runs() {
    let dir = TestDir::new();
    let (img, sock, export) = new_qcow2(&dir, 1);
    let stats = dir.join("stats.json");
    let mut d = Daemon::start_args(&dir, &[export], &["--stats-file", stats.to_str().unwrap()]);
    let mut c = Client::connect(&sock, 1).unwrap();
    // Clusters 7, 6, ..., 0 allocated in that order: each lies before the previous one's
    // neighbour in the file, so no two guest-adjacent clusters are file-adjacent.
    for k in (0..8u64).rev() {
        c.write(
            0,
            k * CLUSTER,
            &pattern_bytes(CLUSTER, k * CLUSTER, Some(1)),
        )
        .unwrap();
    }
    // Each cluster read once, so that the thread holds all eight.
    for k in 0..8u64 {
        c.read_vec(0, k * CLUSTER, 4096).unwrap();
    }
    let before = export_counter(
        &stats_when(&stats, Duration::from_secs(10), |_| true).unwrap(),
        "split_parts",
    );
    // 5 clusters' worth from 4 KiB into cluster 1: six runs.
    let (off, len) = (CLUSTER + 4096, 5 * CLUSTER as usize);
    let mine = pattern_bytes(len as u64, off, Some(2));
    c.write(0, off, &mine).unwrap();
    assert!(
        c.read_vec(0, off, len).unwrap() == mine,
        "the scattered write read back"
    );
    let want = |v: &serde_json::Value| export_counter(v, "split_parts") >= before + 12;
    let after = stats_when(&stats, Duration::from_secs(10), want).unwrap();
    assert!(
        want(&after),
        "split_parts {} -> {}: the write and the read were not cut into 6 runs each",
        before,
        export_counter(&after, "split_parts")
    );
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
    let mut expected = pattern_bytes(SIZE, 0, Some(1));
    expected[8 * CLUSTER as usize..].fill(0);
    expected[off as usize..off as usize + len].copy_from_slice(&mine);
    assert_bytes_eq(
        &read_through_qemu(&img, &dir.join("converted.raw")),
        &expected,
        0,
        "through QEMU",
    );
}

/// A cluster one thread holds as "in the backing file" (or "zeros", without one) is written
/// through another queue's thread, which allocates it in the overlay: the first thread reads
/// the new data at once, not the base's.
#[test]
fn a_cluster_allocated_by_one_thread_is_read_anew_by_the_others() {
    for with_base in [true, false] {
        let dir = TestDir::new();
        let (overlay, sock, export) = if with_base {
            let (overlay, sock) = (dir.join("overlay.qcow2"), dir.join("s.sock"));
            let base = base_image(&dir, "raw");
            let export = overlay_export(&sock, &overlay, &base, "raw");
            (overlay, sock, export)
        } else {
            new_qcow2(&dir, 2)
        };
        let mut d = Daemon::start(&dir, &[export]);
        let mut c = Client::connect(&sock, 2).unwrap();
        let base = if with_base {
            pattern_bytes(SIZE, 0, Some(BASE_SEED))
        } else {
            vec![0u8; SIZE as usize]
        };
        for round in 0..6u64 {
            let off = (round * 5 + 1) * CLUSTER + 8192;
            let range = off as usize..off as usize + 4096;
            // Twice on queue 0: the second read is served from its thread's cache.
            for _ in 0..2 {
                assert!(c.read_vec(0, off, 4096).unwrap()[..] == base[range.clone()]);
            }
            let mine = pattern_bytes(4096, off, Some(round + 50));
            c.write(1, off, &mine).unwrap();
            assert!(
                c.read_vec(0, off, 4096).unwrap() == mine,
                "base {with_base}, round {round}: queue 0 read the old data"
            );
            // The rest of the cluster kept the base's (copy-on-write).
            let next = off + 4096;
            assert!(
                c.read_vec(0, next, 4096).unwrap()[..] == base[next as usize..next as usize + 4096]
            );
        }
        drop(c);
        d.stop();
        assert_checks_clean(&overlay, false);
    }
}

/// `readonly=on` on a qcow2 overlay: the guest reads the chain's data (the overlay's own
/// clusters and the base's), the device is read-only, a write is refused, and neither file
/// changes.
#[test]
fn a_readonly_overlay_is_read_and_never_written() {
    let dir = TestDir::new();
    let base = base_image(&dir, "raw");
    let overlay = dir.join("overlay.qcow2");
    qemu_img_ok(&[
        "create",
        "-f",
        "qcow2",
        "-F",
        "raw",
        "-b",
        "base.raw",
        &overlay.display().to_string(),
    ]);
    // One cluster of the overlay's own.
    qemu_io_ok(&overlay, &format!("write -P 0x5a {CLUSTER} {CLUSTER}"));
    let (overlay_before, base_before) = (
        std::fs::read(&overlay).unwrap(),
        std::fs::read(&base).unwrap(),
    );
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &overlay)
        .set("format", "qcow2")
        .readonly();
    let mut d = Daemon::start(&dir, &[export]);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert!(c.is_read_only());
    let expected = pattern_bytes(SIZE, 0, Some(BASE_SEED));
    assert!(c.read_vec(0, 0, CLUSTER as usize).unwrap()[..] == expected[..CLUSTER as usize]);
    assert!(c
        .read_vec(0, CLUSTER, CLUSTER as usize)
        .unwrap()
        .iter()
        .all(|&b| b == 0x5a));
    assert!(
        c.write(0, 0, &[1u8; 4096]).is_err(),
        "a write to a read-only export succeeded"
    );
    drop(c);
    d.stop();
    assert!(
        std::fs::read(&overlay).unwrap() == overlay_before,
        "the overlay changed"
    );
    assert!(
        std::fs::read(&base).unwrap() == base_before,
        "the base changed"
    );
}

/// Under the sandbox, a snapshot's overlay must go where `--allow-dir` lets mqblk create files:
/// elsewhere `export_snapshot` is refused with the rule named, nothing is created, and the
/// export goes on serving its image.
#[test]
fn a_snapshot_outside_the_allowed_directories_is_refused_by_name() {
    let dir = TestDir::new();
    let img = dir.join("disk.qcow2");
    create_qcow2(&img, "16M");
    let sock = dir.join("s.sock");
    let api_sock = dir.join("api.sock");
    let export = Export::file(&sock, &img)
        .set("format", "qcow2")
        .set("id", "vm");
    // No --allow-dir: the sandbox grants the image file itself, not its directory.
    let mut d = Daemon::start_args(
        &dir,
        &[export],
        &["--api-socket", api_sock.to_str().unwrap()],
    );
    let mut api = support::api::Api::connect(&api_sock);
    let overlay = dir.join("after.qcow2");
    let e = api
        .call(
            "export_snapshot",
            serde_json::json!({"id": "vm", "overlay": overlay.display().to_string()}),
        )
        .unwrap_err();
    assert!(
        e.1.contains("outside what the sandbox lets mqblk reach") && e.1.contains("--allow-dir"),
        "{e:?}"
    );
    assert!(
        !overlay.exists(),
        "the refused snapshot created its overlay"
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    c.write(0, 0, &[7u8; 4096]).unwrap();
    assert_eq!(c.read_vec(0, 0, 4096).unwrap(), vec![7u8; 4096]);
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
}

/// `--table-memory-total` bounds what the tables of every qcow2 export's chain could take in
/// imago together, as `table-memory-max=` bounds one chain: with 20 MiB, two exports of
/// 64 KiB-cluster images (8 MiB each) are served; a third, added through the API, is refused
/// in one line, and so is a snapshot, whose overlay would add 8 MiB (nothing is created, the
/// export serves on). Once an export is removed, both fit.
#[test]
fn exports_and_snapshots_past_the_daemon_s_table_memory_total_are_refused() {
    let dir = TestDir::new();
    let export = |i: usize| {
        let img = dir.join(&format!("vm{i}.qcow2"));
        let name = img.display().to_string();
        qemu_img_ok(&["create", "-q", "-f", "qcow2", &name, &SIZE.to_string()]);
        let sock = dir.join(&format!("vm{i}.sock"));
        (img, sock)
    };
    let [(img0, sock0), (img1, sock1), (img2, sock2)] = [export(0), export(1), export(2)];
    let served = |img: &Path, sock: &Path, id: &str| {
        Export::file(sock, img)
            .queues(1)
            .set("format", "qcow2")
            .set("id", id)
    };
    let (mut d, mut api) = support::api::daemon_with_api_args(
        &dir,
        &["--table-memory-total", "20M"],
        &[served(&img0, &sock0, "vm0"), served(&img1, &sock1, "vm1")],
    );
    // Each holds its chain's bound: its L1 table (one entry) and 128 clusters of L2 tables.
    let held = 128 * CLUSTER + 8;
    let list = api.ok("export_list", serde_json::json!({}));
    for e in list.as_array().unwrap() {
        assert_eq!(e["table_memory"], held, "{e}");
    }
    let add = serde_json::json!({"id": "vm2", "socket": sock2, "path": img2, "format": "qcow2"});
    let e = api.call("export_add", add.clone()).unwrap_err();
    assert!(
        e.1.contains(&format!(
            "backing chain of {} could hold 9 MiB",
            img2.display()
        )) && e.1.contains("may hold 17 MiB of --table-memory-total=20M"),
        "{e:?}"
    );
    let overlay = dir.join("vm0-snap.qcow2");
    let snapshot = serde_json::json!({"id": "vm0", "overlay": overlay.display().to_string()});
    let e = api.call("export_snapshot", snapshot.clone()).unwrap_err();
    assert!(
        e.1.contains("could hold 17 MiB") && e.1.contains("--table-memory-total=20M"),
        "{e:?}"
    );
    assert!(!overlay.exists(), "the refused snapshot left its overlay");
    let mut c = Client::connect(&sock0, 1).unwrap();
    c.write(0, 0, &[7u8; 4096]).unwrap();
    assert_eq!(c.read_vec(0, 0, 4096).unwrap(), vec![7u8; 4096]);
    drop(c);
    // vm1 gone: vm0's snapshot fits, then nothing more; vm0 gone too: vm2 fits.
    api.ok("export_del", serde_json::json!({"id": "vm1"}));
    let status = api.ok("export_snapshot", snapshot);
    // The overlay's L1 table as imago made it (header field at 36), under the old chain's.
    let overlay_l1 = be64_at(&overlay, 32) & 0xffff_ffff;
    let overlay_held = 8 * overlay_l1 + 128 * CLUSTER;
    assert_eq!(status["table_memory"], held + overlay_held, "{status}");
    assert!(api.call("export_add", add.clone()).is_err());
    api.ok("export_del", serde_json::json!({"id": "vm0"}));
    api.ok("export_add", add);
    let mut c = Client::connect(&sock2, 1).unwrap();
    c.write(0, 0, &[9u8; 4096]).unwrap();
    drop(c);
    d.stop();
    assert_checks_clean(&img2, false);
    assert_checks_clean(&overlay, false);
}

/// A write-zeroes and a write into two blocks of the same new cluster, sent on two queues at
/// once, cluster after cluster: both land, and the rest of the cluster keeps the base's data.
/// The write's copy-on-write reads the rest of the cluster before it writes the whole cluster;
/// a zeroing that landed in between would be overwritten with the base's bytes, which the
/// zeroing lock prevents (without it, the first cluster's zeroed block read back the base's
/// bytes in 3 runs of 3).
#[test]
fn a_zeroing_and_a_write_into_one_new_cluster_at_once_both_land() {
    let dir = TestDir::new();
    let base = base_image(&dir, "raw");
    let (overlay, sock) = (dir.join("overlay.qcow2"), dir.join("s.sock"));
    let mut d = Daemon::start(&dir, &[overlay_export(&sock, &overlay, &base, "raw")]);
    let mut c = Client::connect(&sock, 2).unwrap();
    let mut expected = pattern_bytes(SIZE, 0, Some(BASE_SEED));
    let clusters = SIZE / CLUSTER;
    for k in 0..clusters {
        let at = k * CLUSTER;
        let (zeroed, written) = (at + (k % 8) * 4096, at + 32768 + (k % 4) * 4096);
        let data = pattern_bytes(4096, written, Some(k + 7));
        let results = c.together(&[
            Concurrent::WriteZeroes {
                q: 0,
                offset: zeroed,
                len: 4096,
            },
            Concurrent::Write {
                q: 1,
                offset: written,
                data: &data,
            },
        ]);
        for r in results {
            r.unwrap_or_else(|e| panic!("cluster {k}: {e}"));
        }
        expected[zeroed as usize..zeroed as usize + 4096].fill(0);
        expected[written as usize..written as usize + 4096].copy_from_slice(&data);
    }
    let through_mqblk = c.read_vec(0, 0, SIZE as usize).unwrap();
    assert_bytes_eq(&through_mqblk, &expected, 0, "read through mqblk");
    drop(c);
    d.stop();
    assert_checks_clean(&overlay, false);
    let through_qemu = read_through_qemu(&overlay, &dir.join("converted.raw"));
    assert_bytes_eq(&through_qemu, &expected, 0, "read by QEMU");
}

/// Dirty pages of `path` in `offset..offset + len`, by cachestat(2) (Linux 6.5).
fn dirty_pages(path: &Path, offset: u64, len: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    const SYS_CACHESTAT: libc::c_long = 451;
    let f = std::fs::File::open(path).unwrap();
    let range = [offset, len];
    let mut stat = [0u64; 5]; // cache, dirty, writeback, evicted, recently evicted
                              // SAFETY: an open descriptor, and buffers of the sizes the call reads and writes.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            f.as_raw_fd(),
            range.as_ptr(),
            stat.as_mut_ptr(),
            0,
        )
    };
    (r == 0).then_some(stat[1])
}

/// A test directory whose files' dirty pages can be told from clean ones (not a tmpfs, whose
/// pages are never clean); `None` (the test skips) where the environment allows that.
fn page_cache_dir() -> Option<TestDir> {
    let dir = TestDir::new();
    if rustix::fs::statfs(dir.path()).unwrap().f_type == libc::TMPFS_MAGIC {
        support::skip::skip_unless_allowed(
            "MQBLK_TEST_ALLOW_TMPFS_TMP",
            "the test directory is on a tmpfs, whose pages are never clean",
        );
        return None;
    }
    Some(dir)
}

/// Whether this kernel shows `path`'s dirty pages (false: the test skips, where the
/// environment allows that).
fn sees_dirty_pages(path: &Path) -> bool {
    if dirty_pages(path, 0, 4096).is_some() {
        return true;
    }
    support::skip::skip_unless_allowed(
        "MQBLK_TEST_ALLOW_NO_CACHESTAT",
        "this kernel has no cachestat(2) to see dirty pages with",
    );
    false
}

/// The offset bits of an L1, L2 or refcount table entry.
const ENTRY_OFFSET: u64 = 0x00ff_ffff_ffff_fe00;

/// Where the first L2 table and the first refcount block of `img` are (header fields at 40
/// and 48: the L1 table's offset and the refcount table's).
fn first_tables(img: &Path) -> (u64, u64) {
    let l2 = be64_at(img, be64_at(img, 40)) & ENTRY_OFFSET;
    let refblock = be64_at(img, be64_at(img, 48)) & ENTRY_OFFSET;
    (l2, refblock)
}

/// Overwrites `bytes` at `offset` of `path` (an image patched by hand).
fn write_at(path: impl AsRef<Path>, offset: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(bytes, offset)
        .unwrap();
}

/// The big-endian u64 at `offset` of `path`, as the page cache holds it.
fn be64_at(path: &Path, offset: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut b, offset)
        .unwrap();
    u64::from_be_bytes(b)
}

/// qcow2's ordering holds on stable storage, not only in the kernel: when a write into a new
/// cluster completes, the refcount block that counts the cluster is durable (a power loss
/// cannot keep the L2 entry without it, which would let the cluster be handed out twice), so
/// is the L1 table that points at a new L2 table, and so is the new cluster's data (the
/// guest's and the rest the copy-on-write put around it: an L2 entry on disk without it would
/// make the cluster read as whatever the file held there). The entries of an L2 table stay in
/// the cache until the guest flushes. Seen in the page cache of an image served with
/// `direct=off` on a disk filesystem: durable pages are clean. This is `metadata-commit=write`'s
/// promise (the default `auto` keeps a journal instead, and writes the tables at the flush).
#[test]
fn refcounts_the_l1_table_and_new_data_are_durable_when_a_write_into_a_new_cluster_completes() {
    let Some(dir) = page_cache_dir() else {
        return;
    };
    let (img, sock, export) = new_qcow2(&dir, 1);
    let export = export.direct(false).set("metadata-commit", "write");
    let mut d = Daemon::start(&dir, &[export]);
    let mut c = Client::connect(&sock, 1).unwrap();
    if !sees_dirty_pages(&img) {
        return;
    }
    let dirty = |offset: u64| dirty_pages(&img, offset, CLUSTER).unwrap();
    // The first write allocates the L2 table of the first 512 MiB, then its data cluster.
    c.write(0, 3 * CLUSTER + 4096, &[0x5a; 4096]).unwrap();
    let l1 = be64_at(&img, 40);
    let (l2, refblock) = first_tables(&img);
    let data = |guest_cluster: u64| be64_at(&img, l2 + 8 * guest_cluster) & ENTRY_OFFSET;
    assert!(l2 != 0 && refblock != 0 && data(3) != 0);
    assert_eq!(dirty(refblock), 0, "the refcount block is durable");
    assert_eq!(dirty(l1), 0, "the L1 table is durable");
    assert_eq!(dirty(data(3)), 0, "the data is durable before its L2 entry");
    // The second allocates only a data cluster.
    c.write(0, 9 * CLUSTER, &[0xa5; 4096]).unwrap();
    assert!(data(9) != 0);
    assert_eq!(dirty(refblock), 0, "the refcount block is durable again");
    assert_eq!(dirty(data(9)), 0, "the data is durable again");
    assert!(dirty(l2) > 0, "the L2 table's entries wait for a flush");
    c.flush(0).unwrap();
    assert_eq!(dirty(l2), 0, "the L2 table is durable after a flush");
    // A write into an allocated cluster waits for the flush (it changes no mapping).
    c.write(0, 9 * CLUSTER + 8192, &[0x11; 4096]).unwrap();
    assert!(dirty(data(9)) > 0, "a write in place waits for a flush");
    c.flush(0).unwrap();
    assert_eq!(dirty(data(9)), 0, "durable after a flush");
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
}

/// A new cluster is mapped in imago's cache before its data is written (`early_maps.rs`), and
/// no L2 table may reach the image file while such a data write is under way: otherwise a
/// crash leaves the file mapping the cluster to a place without its data, and the base's bytes
/// around the guest's write read as zeros. A debug build's test delay holds a copy-on-write's
/// data write back for 4 s after its mapping (`test_hooks.rs`); meanwhile a whole-cluster
/// write elsewhere (imago's own write, which maps after its data) makes a group commit write
/// the L2 table that holds the first cluster's mapping. mqblk is killed inside the window: the
/// first cluster must read as the base, and the second write, whose commit waits for that
/// data, must not have completed. (Without the wait, the second write completed and the first
/// cluster read back as zeros.)
#[test]
fn an_l2_table_holding_a_cluster_mapped_ahead_of_its_data_waits_for_the_data() {
    use support::frontend::*;
    if !has_test_hooks() {
        return;
    }
    let dir = TestDir::new();
    let base = base_image(&dir, "raw");
    let overlay = dir.join("overlay.qcow2");
    let sock = dir.join("s.sock");
    // The group commit's write-back of `metadata-commit=write`.
    let export = overlay_export(&sock, &overlay, &base, "raw")
        .queues(1)
        .set("metadata-commit", "write");
    let mut cmd = std::process::Command::new(mqblk_bin());
    cmd.arg("serve").arg("--export").arg(export.spec());
    cmd.env("MQBLK_TEST_ONLY_EARLY_DATA_DELAY_MS", "4000");
    let mut daemon = Daemon::spawn(&dir, cmd, &[&sock]);
    let mut s = Session::open_features(&sock, 16, None, F_BLK_FLUSH);
    let (first, second) = (3 * CLUSTER, 9 * CLUSTER);
    // Into the first cluster, 4 KiB in: a copy-on-write, mapped ahead of its data.
    s.guest.write(HDR_GPA, &header(T_OUT, (first + 4096) / 512));
    s.guest.write(DATA_GPA, &[0x5a; 4096]);
    s.write_descs(
        0,
        0,
        &[
            d(HDR_GPA, 16, VRING_F_NEXT, 1),
            d(DATA_GPA, 4096, VRING_F_NEXT, 2),
            d(STATUS_GPA, 1, VRING_F_WRITE, 0),
        ],
    );
    s.post_raw(0, 0, 0);
    assert_eq!(s.wait_used(0, Duration::from_millis(500)), Answer::Nothing);
    // All of the second cluster: imago writes the data, maps it, and the group commit then
    // writes the L2 table both clusters are in.
    const DATA2_GPA: u64 = 0x8_0000;
    s.guest.write(HDR_GPA + 0x100, &header(T_OUT, second / 512));
    s.guest.write(DATA2_GPA, &[0xa7; CLUSTER as usize]);
    s.write_descs(
        0,
        3,
        &[
            d(HDR_GPA + 0x100, 16, VRING_F_NEXT, 4),
            d(DATA2_GPA, CLUSTER as u32, VRING_F_NEXT, 5),
            d(STATUS_GPA + 0x10, 1, VRING_F_WRITE, 3),
        ],
    );
    s.post_raw(0, 3, 0);
    let answer = s.wait_used(0, Duration::from_millis(1000));
    daemon.signal(rustix::process::Signal::KILL);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while daemon.has_exited().is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "daemon survived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(daemon.log().contains("a test's delay"), "{}", daemon.log());
    drop(s);
    let back = read_through_qemu(&overlay, &dir.join("back.raw"));
    let base_bytes = std::fs::read(&base).unwrap();
    let at = first as usize..(first + CLUSTER) as usize;
    assert!(
        back[at.clone()] == base_bytes[at],
        "the first cluster's mapping reached the file before its data"
    );
    assert_eq!(
        answer,
        Answer::Nothing,
        "the second write waited for the table"
    );
    assert_checks_clean(&overlay, true);
}

/// A panic of an image's metadata worker (a bug of imago's or ours that a crafted image or
/// request reaches; here a debug build's test hook, `MQBLK_TEST_ONLY_WORKER_PANIC_AT`) fails
/// that export alone, as an I/O thread's panic does. Two allocating writes are in flight on
/// the worker when it panics: one inside the test delay between its early mapping and its data
/// (`MQBLK_TEST_ONLY_EARLY_DATA_DELAY_MS`), and the one that panics. Both get IOERR; the export
/// reports the failure and drops its frontend; the daemon and its other export go on; removed
/// and added again, the export serves the image from its file, which holds every acknowledged
/// write and no mapping without its data (`qemu-img check`: no corruption). Before, the worker
/// died with its jobs: both requests and every later one on the metadata path stayed
/// unanswered, nothing reported it, and the shutdown wrote the early mapping to the file
/// without its data.
#[test]
fn a_panic_of_the_metadata_worker_fails_its_export_only_and_the_image_keeps_what_was_acknowledged()
{
    use serde_json::{json, Value};
    use support::api::Api;
    use support::frontend::*;
    if !has_test_hooks() {
        return;
    }
    let dir = TestDir::new();
    let base = base_image(&dir, "raw");
    let overlay = dir.join("overlay.qcow2");
    let (sock, other_sock, api_sock) =
        (dir.join("s.sock"), dir.join("o.sock"), dir.join("api.sock"));
    let (before, delayed, panics, after) = (CLUSTER, 3 * CLUSTER, 9 * CLUSTER, 12 * CLUSTER);
    let mut cmd = std::process::Command::new(mqblk_bin());
    cmd.arg("serve")
        .arg("--api-socket")
        .arg(&api_sock)
        .arg("--export")
        .arg(
            overlay_export(&sock, &overlay, &base, "raw")
                .queues(1)
                .spec(),
        )
        .arg("--export")
        .arg(Export::null(&other_sock, 1 << 20).queues(1).spec());
    cmd.env("MQBLK_TEST_ONLY_EARLY_DATA_DELAY_MS", "1500");
    cmd.env(
        "MQBLK_TEST_ONLY_WORKER_PANIC_AT",
        (panics + 4096).to_string(),
    );
    let mut daemon = Daemon::spawn(&dir, cmd, &[&sock, &other_sock]);
    let mut api = Api::connect(&api_sock);
    let failure = |api: &mut Api, id: &str| -> Value {
        let list = api.ok("export_list", json!({}));
        list.as_array()
            .unwrap()
            .iter()
            .find(|e| e["id"] == id)
            .unwrap()["failure"]
            .clone()
    };
    let mut s = Session::open_features(&sock, 16, None, F_BLK_FLUSH);
    // Request `head` (descriptors head..head + 2): a 4 KiB write at `offset`, its header and
    // status at their own places.
    let post = |s: &mut Session, head: u16, offset: u64, byte: u8| {
        let at = u64::from(head) * 0x100;
        s.guest.write(HDR_GPA + at, &header(T_OUT, offset / 512));
        s.guest.write(DATA_GPA + at * 16, &[byte; 4096]);
        s.write_descs(
            0,
            head,
            &[
                d(HDR_GPA + at, 16, VRING_F_NEXT, head + 1),
                d(DATA_GPA + at * 16, 4096, VRING_F_NEXT, head + 2),
                d(STATUS_GPA + at, 1, VRING_F_WRITE, head),
            ],
        );
        s.post_raw(0, head, 0);
    };
    let status =
        |s: &mut Session, head: u16| s.guest.read(STATUS_GPA + u64::from(head) * 0x100, 1)[0];
    // Acknowledged before the panic: an allocating write (its data waits out the delay).
    post(&mut s, 0, before + 4096, 0x11);
    assert_eq!(s.wait_used(0, Duration::from_secs(10)), Answer::Used(0, 1));
    assert_eq!(status(&mut s, 0), S_OK);
    // In flight on the worker: one inside the delay, then the one that panics.
    post(&mut s, 3, delayed + 4096, 0x22);
    assert_eq!(s.wait_used(0, Duration::from_millis(300)), Answer::Nothing);
    post(&mut s, 6, panics + 4096, 0x33);
    let mut answered = Vec::new();
    for _ in 0..2 {
        match s.wait_used(0, Duration::from_secs(10)) {
            Answer::Used(head, _) => answered.push(head),
            Answer::Nothing => panic!(
                "a request the worker held was never answered: {}",
                daemon.log()
            ),
        }
    }
    answered.sort_unstable();
    assert_eq!(answered, [3, 6]);
    assert_eq!((status(&mut s, 3), status(&mut s, 6)), (S_IOERR, S_IOERR));
    // Reported, and the frontend dropped and turned away, as for an I/O thread's panic.
    assert!(
        s.conn.closed_by_peer(Duration::from_secs(10)),
        "the frontend of a failed export stayed connected"
    );
    let why = failure(&mut api, "s");
    let why = why
        .as_str()
        .unwrap_or_else(|| panic!("export s not failed: {why}"));
    assert!(
        why.contains("qcow2-s") && why.contains("panicked") && why.contains("given up"),
        "{why}"
    );
    assert_eq!(failure(&mut api, "o"), Value::Null);
    assert!(
        Session::negotiate(&sock).is_err(),
        "a failed export accepted a frontend"
    );
    let log = daemon.log();
    assert!(
        log.contains("a test's panic") && log.contains("the qcow2 image is given up"),
        "{log}"
    );
    assert_the_daemon_serves_on(&mut daemon, &other_sock);
    drop(s);
    // Removed and added again, it serves the image as its file holds it.
    api.ok("export_del", json!({"id": "s"}));
    api.ok(
        "export_add",
        json!({"socket": sock, "path": overlay, "format": "qcow2", "queues": 1}),
    );
    assert_eq!(failure(&mut api, "s"), Value::Null);
    let base_bytes = std::fs::read(&base).unwrap();
    let cluster_of = |bytes: &[u8], c: u64| bytes[c as usize..(c + CLUSTER) as usize].to_vec();
    let mut acknowledged = cluster_of(&base_bytes, before);
    acknowledged[4096..8192].fill(0x11);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert!(
        c.read_vec(0, before, CLUSTER as usize).unwrap() == acknowledged,
        "the acknowledged write"
    );
    assert!(c.read_vec(0, delayed, CLUSTER as usize).unwrap() == cluster_of(&base_bytes, delayed));
    c.write(0, after + 4096, &[0x44; 4096]).unwrap();
    c.flush(0).unwrap();
    drop(c);
    daemon.stop();
    // What reached the file: the acknowledged writes, and no mapping without its data.
    let back = read_through_qemu(&overlay, &dir.join("back.raw"));
    assert!(
        cluster_of(&back, before) == acknowledged,
        "the acknowledged write"
    );
    for c in [delayed, panics] {
        assert!(
            cluster_of(&back, c) == cluster_of(&base_bytes, c),
            "cluster at {c} is not the base's"
        );
    }
    assert!(back[(after + 4096) as usize..(after + 8192) as usize] == [0x44; 4096]);
    assert_checks_clean(&overlay, true);
}

/// An image whose own metadata no refcount block covers is corrupt, and imago would allocate
/// the header's cluster as free. Two such images: one made by `qemu-img` with its refcount
/// table emptied by hand (a guest's write went through and overwrote the header), and one the
/// `qcow2_image` fuzz target found (its seed corpus keeps it), on which imago's allocator
/// recursed until it overflowed the metadata worker's stack at the guest's first write and
/// ended the daemon (SIGABRT), every export with it. The image's queue now does not start,
/// with one line naming the image and `qemu-img check -r all`; the daemon lives on and its
/// other export serves.
#[test]
fn an_image_whose_metadata_no_refcount_block_covers_does_not_start_and_the_daemon_serves_on() {
    let dir = TestDir::new();
    let emptied = small_written_image(&dir, "emptied.qcow2");
    write_at(&emptied, be64_at(&emptied, 48), &[0; 8]);
    let found = dir.join("found.qcow2");
    let seed = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/corpus/qcow2_image/uncounted-metadata-recursion"
    );
    std::fs::copy(seed, &found).unwrap();
    for img in [emptied, found] {
        serve_a_corrupt_image(&dir, &img, "counted by no refcount block");
    }
}

/// Two entries of an image's refcount table that point at one refcount block make the
/// block's counts stand for two ranges of clusters (`qemu-img check` finds it corrupt), and
/// are how a small crafted file could count clusters in use by the billion, which imago's
/// allocator walks one at a time at the first write. The export's queue does not start, one
/// line names the image and `qemu-img check -r all`, and the daemon's other export serves.
#[test]
fn an_image_whose_refcount_table_names_one_block_twice_does_not_start() {
    let dir = TestDir::new();
    let img = small_written_image(&dir, "shared.qcow2");
    let name = img.display().to_string();
    let reftable = be64_at(&img, 48);
    let first = be64_at(&img, reftable);
    write_at(&img, reftable + 8, &first.to_be_bytes());
    let (code, check) = support::qemu_img::qemu_img(&["check", &name]).unwrap();
    assert!(
        code != 0 && check.contains("refcount=2"),
        "qemu-img check finds the image sound: {check}"
    );
    serve_a_corrupt_image(
        &dir,
        &img,
        "two refcount table entries point at the refcount block",
    );
}

/// A refcount block that counts clusters in use far past the end of the image's file is how a
/// crafted file counts them by the billion with every block a cluster of its own, which
/// imago's allocator walks one at a time at the first write (`scripts/crafted-refcount-walk.sh`:
/// 16 MiB of one-bit blocks held the first write 18 s). Here the image's second refcount block
/// (clusters from 2 GiB on, 64 KiB clusters and 16-bit refcounts) counts them all: the queue
/// does not start, one line names the image and `qemu-img check -r all`, and the daemon's
/// other export serves on. After that repair the image serves.
#[test]
fn an_image_counting_clusters_in_use_far_past_its_end_does_not_start_until_repaired() {
    let dir = TestDir::new();
    let img = dir.join("counted.qcow2");
    let name = img.display().to_string();
    qemu_img_ok(&["create", "-q", "-f", "qcow2", &name, &SIZE.to_string()]);
    let far_block = std::fs::metadata(&img)
        .unwrap()
        .len()
        .next_multiple_of(CLUSTER);
    write_at(&img, far_block, &[0, 1].repeat((CLUSTER / 2) as usize));
    write_at(&img, be64_at(&img, 48) + 8, &far_block.to_be_bytes());
    serve_a_corrupt_image(
        &dir,
        &img,
        &format!(
            "refcount block at offset {far_block} counts the cluster at offset 2147483648 in use"
        ),
    );
    qemu_img_ok(&["check", "-q", "-r", "all", &name]);
    let (mut d, mut c) = serve_one_queue(&dir, &img, Some(false));
    c.write(0, 0, &[0x5a; 4096]).unwrap();
    c.flush(0).unwrap();
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
    qemu_io_ok(&img, "read -P 0x5a 0 4k");
}

/// Growing a qcow2 image allocates (a new L1 table), and an export is as often resized
/// before its frontend connects as after: before any ring's start has mended the image. On an
/// image whose header no refcount block covers, `export_resize` sent imago's allocator into
/// the recursion above, on the API thread: it wrote a refcount block over the image's header,
/// then overflowed the thread's stack and ended the daemon. A resize now mends the image
/// first, as a ring's start does: refused with the same one line, before a frontend connects
/// and after its queue was refused; the file is untouched and the daemon serves on.
#[test]
fn resizing_an_image_whose_header_no_refcount_block_covers_is_refused() {
    let dir = TestDir::new();
    let img = small_written_image(&dir, "emptied.qcow2");
    write_at(&img, be64_at(&img, 48), &[0; 8]);
    let before = std::fs::read(&img).unwrap();
    let (exports, sock, other_sock) = beside_a_null_export(&dir, &img);
    let (mut d, mut api) = support::api::daemon_with_api(&dir, &exports);
    let refused = |api: &mut support::api::Api| {
        let e = api
            .call(
                "export_resize",
                serde_json::json!({"id": "bad", "size": "2M"}),
            )
            .expect_err("the resize must be refused");
        assert!(
            e.1.contains("counted by no refcount block") && e.1.contains("qemu-img check -r all"),
            "{e:?}"
        );
    };
    refused(&mut api);
    let c = assert_the_queue_does_not_start(&sock);
    refused(&mut api);
    assert_the_daemon_serves_on(&mut d, &other_sock);
    drop(c);
    d.stop();
    // Save for the autoclear bit that says a journal's daemon took the image (the default
    // `metadata-commit=auto` keeps a journal), which it sets when it opens the image.
    let mut after = std::fs::read(&img).unwrap();
    let (at, bit) = mqblk::format::qcow2::header::JOURNAL_OWNS_MARK_BYTE;
    after[at as usize] &= !bit;
    assert!(after == before, "the image was written");
}

/// A resize before the frontend connects allocates before any ring's start has mended the
/// image, so it mends it first: the L1 table it grows must not land on an L2 table that a
/// crash left counted free (the damage of
/// `a_table_left_counted_free_by_a_crash_is_counted_again_before_anything_is_allocated`).
#[test]
fn a_resize_before_any_ring_starts_mends_the_tables_first() {
    let dir = TestDir::new();
    let img = an_image_with_a_table_counted_free(&dir);
    let export = Export::file(dir.join("s.sock"), &img)
        .set("format", "qcow2")
        .set("id", "vm");
    let (mut d, mut api) = support::api::daemon_with_api(&dir, &[export]);
    let grown = 1u64 << 30;
    let status = api.ok(
        "export_resize",
        serde_json::json!({"id": "vm", "size": grown}),
    );
    assert_eq!(status["capacity"], grown, "{status}");
    d.stop();
    assert_checks_clean(&img, false);
    qemu_io_ok(&img, "read -P 0x5a 0 4k");
    assert!(d.log().contains("counted in use again"), "{}", d.log());
}

/// A qcow2 image whose first 4 KiB qemu-io wrote (0x5a), with its first L2 table counted free
/// by hand, as a crash between imago's write of the table and of its refcount leaves it;
/// `qemu-img check` finds the error.
fn an_image_with_a_table_counted_free(dir: &TestDir) -> PathBuf {
    let img = dir.join("disk.qcow2");
    let name = img.display().to_string();
    qemu_img_ok(&["create", "-q", "-f", "qcow2", &name, &SIZE.to_string()]);
    qemu_io_ok(&img, "write -P 0x5a 0 4k");
    let (l2, refblock) = first_tables(&img);
    // 16-bit refcounts: entry `cluster` of the first refcount block.
    write_at(&img, refblock + 2 * (l2 / CLUSTER), &[0, 0]);
    let (code, text) = support::qemu_img::qemu_img(&["check", &name]).unwrap();
    assert_eq!(code, 2, "the damage must be there first: {text}");
    img
}

/// A 1 MiB qcow2 image `name` in `dir` with 512-byte clusters (a refcount block then covers
/// 128 KiB: the image has 8 ranges of them), its first 4 KiB written by qemu-io: what the
/// tests of corrupt refcount tables patch by hand.
fn small_written_image(dir: &TestDir, name: &str) -> PathBuf {
    let img = dir.join(name);
    qemu_img_ok(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=512",
        &img.display().to_string(),
        "1M",
    ]);
    qemu_io_ok(&img, "write -P 0x5a 0 4k");
    img
}

/// Serves `img`, which mqblk must refuse when its queue starts (`why` in the log), beside a
/// null export that must serve on.
fn serve_a_corrupt_image(dir: &TestDir, img: &Path, why: &str) {
    let (exports, sock, other_sock) = beside_a_null_export(dir, img);
    let mut d = Daemon::start(dir, &exports);
    let c = assert_the_queue_does_not_start(&sock);
    assert!(d.wait_for_log(why, Duration::from_secs(5)), "{}", d.log());
    let log = d.log();
    assert!(
        log.contains(&img.display().to_string()) && log.contains("qemu-img check -r all"),
        "{log}"
    );
    assert_the_daemon_serves_on(&mut d, &other_sock);
    drop(c);
    d.stop();
}

/// `img` exported with one queue (id `bad`, `direct=off`) beside a null export, and the two
/// sockets: what the tests of images mqblk must refuse serve.
fn beside_a_null_export(dir: &TestDir, img: &Path) -> ([Export; 2], PathBuf, PathBuf) {
    let stem = img.file_stem().unwrap().to_string_lossy();
    let (sock, other_sock) = (
        dir.join(&format!("{stem}.sock")),
        dir.join(&format!("{stem}-o.sock")),
    );
    let exports = [
        Export::file(&sock, img)
            .queues(1)
            .set("format", "qcow2")
            .set("id", "bad")
            .direct(false),
        Export::null(&other_sock, 1 << 20).queues(1),
    ];
    (exports, sock, other_sock)
}

/// A client of the export at `sock` whose write fails: its queue did not start.
fn assert_the_queue_does_not_start(sock: &Path) -> Client {
    let mut c = Client::connect(sock, 1).unwrap();
    c.set_timeout(Duration::from_secs(2));
    assert!(
        c.write(0, 0, &[0xa5; 4096]).is_err(),
        "the queue must not start"
    );
    c
}

/// The daemon still runs, and its other export (at `other_sock`) takes a write and a read.
fn assert_the_daemon_serves_on(d: &mut Daemon, other_sock: &Path) {
    assert!(d.has_exited().is_none(), "the daemon died: {}", d.log());
    let mut other = Client::connect(other_sock, 1).unwrap();
    other.write(0, 0, &[1; 4096]).unwrap();
    other.read_vec(0, 0, 4096).unwrap();
}

/// A crash between imago's write of a new L2 table's L1 entry and the write-back of the
/// refcount that counts the table leaves the table's cluster counted free (imago writes the
/// refcount after; QEMU before). Served again, mqblk counts it in use before anything is
/// allocated: otherwise the next new cluster would be that one, and guest data would
/// overwrite the table. The image is made so with qemu-io and one refcount set to 0 by hand.
/// (It is mended when the first ring starts, not at open: until then the source of a live
/// migration may still be writing the image.)
#[test]
fn a_table_left_counted_free_by_a_crash_is_counted_again_before_anything_is_allocated() {
    let dir = TestDir::new();
    let img = an_image_with_a_table_counted_free(&dir);
    let (mut d, mut c) = serve_one_queue(&dir, &img, None);
    assert_eq!(c.read_vec(0, 0, 4096).unwrap(), vec![0x5a; 4096]);
    // Mended when the first ring started (a migration's source may write the image until
    // then).
    assert!(
        d.wait_for_log("counted in use again", Duration::from_secs(5)),
        "{}",
        d.log()
    );
    // New clusters, none of them the table's.
    for k in 1..8u64 {
        c.write(0, k * CLUSTER, &[0xa0 + k as u8; 4096]).unwrap();
    }
    c.flush(0).unwrap();
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
    qemu_io_ok(&img, "read -P 0x5a 0 4k");
    qemu_io_ok(&img, "read -P 0xa7 458752 4k");
}

/// Zeroing a compressed cluster frees it (imago keeps the allocation of any other zeroed
/// cluster), and its refcount may only drop once the L2 entry that stopped using it is
/// durable: from then on a refcount block is written only after a sync of the L2 entries
/// written plain before it. So when the zeroing completes, the L2 table is clean (an L2 table
/// is otherwise left in the cache until the guest flushes:
/// `refcounts_the_l1_table_and_new_data_are_durable_...`).
#[test]
fn once_a_zeroing_frees_a_cluster_refcounts_are_written_after_a_sync() {
    let Some(dir) = page_cache_dir() else {
        return;
    };
    // Data in the first half only, compressed (so it must compress): the second half is
    // unallocated.
    let raw = dir.join("half.raw");
    std::fs::write(&raw, vec![0x11u8; (SIZE / 2) as usize]).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&raw)
        .unwrap()
        .set_len(SIZE)
        .unwrap();
    let img = dir.join("disk.qcow2");
    qemu_img_ok(&[
        "convert",
        "-c",
        "-f",
        "raw",
        "-O",
        "qcow2",
        &raw.display().to_string(),
        &img.display().to_string(),
    ]);
    let (_, info) = support::qemu_img::qemu_img(&["check", &img.display().to_string()]).unwrap();
    assert!(info.contains("100.00% compressed"), "{info}");
    // The write-back of `metadata-commit=write`, which follows the zeroing.
    let (mut d, mut c) =
        serve_one_queue_with(&dir, &img, Some(false), &[("metadata-commit", "write")]);
    if !sees_dirty_pages(&img) {
        return;
    }
    let (l2, _) = first_tables(&img);
    c.write_zeroes(0, 0, CLUSTER, false).unwrap();
    assert_eq!(
        dirty_pages(&img, l2, CLUSTER).unwrap(),
        0,
        "the L2 entry was synced before the refcount block that frees its old cluster"
    );
    assert_eq!(c.read_vec(0, 0, 4096).unwrap(), vec![0; 4096]);
    // Later allocations keep their order too.
    c.write(0, SIZE / 2 + 4 * CLUSTER, &[0x66; 4096]).unwrap();
    assert_eq!(
        c.read_vec(0, SIZE / 2 + 4 * CLUSTER, 4096).unwrap(),
        vec![0x66; 4096]
    );
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
}

/// An image whose refcounts count its first 2 GiB of clusters in use (leaked clusters: valid
/// qcow2, which QEMU opens) has its first free cluster 2 GiB into a file of a few hundred KiB.
/// The guest's first write lands there. The file grows to reach it, but only the new cluster's
/// neighbourhood takes room: the gap stays a hole, as it does under QEMU. Before, the file was
/// grown with `fallocate` from its old end, so the 2 GiB gap took 2 GiB of the filesystem (on a
/// tmpfs, of memory). An uploaded image could ask for more than the filesystem holds, and fill
/// it for every other image on it.
#[test]
fn a_first_free_cluster_far_past_the_end_takes_no_room_up_to_it() {
    use std::os::unix::fs::MetadataExt;
    let dir = TestDir::new();
    let img = dir.join("leaky.qcow2");
    let name = img.display().to_string();
    qemu_img_ok(&["create", "-q", "-f", "qcow2", &name, "4G"]);
    // The first refcount block (16-bit refcounts, 32768 of them: 2 GiB of 64 KiB clusters),
    // every entry 1.
    let reftable = be64_at(&img, 48);
    let refblock = be64_at(&img, reftable);
    write_at(&img, refblock, &[0, 1].repeat(32768));
    let (mut d, mut c) = serve_one_queue(&dir, &img, Some(false));
    c.write(0, 0, &[0x5a; 4096]).unwrap();
    c.flush(0).unwrap();
    assert_eq!(c.read_vec(0, 0, 4096).unwrap(), vec![0x5a; 4096]);
    drop(c);
    d.stop();
    let meta = std::fs::metadata(&img).unwrap();
    assert!(
        meta.len() > 2 << 30,
        "the new cluster lies 2 GiB in: {}",
        meta.len()
    );
    let taken = meta.blocks() * 512;
    assert!(
        taken < 64 << 20,
        "the image file takes {taken} bytes of its filesystem"
    );
    qemu_io_ok(&img, "read -P 0x5a 0 4k");
}

/// A full filesystem fails only the writes that need a new cluster (IOERR), before their
/// mapping is made (a cluster is mapped ahead of its data, so its room is taken first): the
/// export goes on serving reads, writes into allocated clusters and flushes, and the image
/// checks clean with every acknowledged write in it. (The image file grows ahead of its
/// allocations, by its own size from 1 to 16 MiB, where it can, and by what a write needs where
/// it cannot.)
#[test]
fn a_full_filesystem_fails_only_the_writes_into_new_clusters() {
    let dir = TestDir::new();
    let Some(m) = Mount::new(&dir, "small", "tmpfs", "size=2m") else {
        return; // reported as SKIPPED by Mount::new
    };
    let img = m.path().join("disk.qcow2");
    let name = img.display().to_string();
    qemu_img_ok(&["create", "-q", "-f", "qcow2", &name, &SIZE.to_string()]);
    let (mut d, mut c) = serve_one_queue(&dir, &img, Some(false));
    // 4 KiB into each 64 KiB cluster in turn: the filesystem holds about 28 of the 512.
    let byte = |k: u64| (k % 250) as u8 + 1;
    let (mut written, mut failed) = (Vec::new(), 0);
    for k in 0..SIZE / CLUSTER {
        match c.write(0, k * CLUSTER, &[byte(k); 4096]) {
            Ok(()) => written.push(k),
            Err(e) => {
                assert_eq!(e.errno(), Some(libc::EIO), "cluster {k}: {e}");
                failed += 1;
            }
        }
    }
    assert!(
        !written.is_empty() && failed > 0,
        "the filesystem should fill part way: {} written, {failed} failed",
        written.len()
    );
    for &k in &written {
        assert_eq!(
            c.read_vec(0, k * CLUSTER, 4096).unwrap(),
            vec![byte(k); 4096]
        );
    }
    c.write(0, written[0] * CLUSTER + 8192, &[0xee; 4096])
        .expect("a write into an allocated cluster on a full filesystem");
    c.flush(0).expect("a flush on a full filesystem");
    drop(c);
    d.stop();
    assert_checks_clean(&img, false);
    let k = written[written.len() - 1];
    qemu_io_ok(&img, &format!("read -P {} {} 4k", byte(k), k * CLUSTER));
    qemu_io_ok(
        &img,
        &format!("read -P 0xee {} 4k", written[0] * CLUSTER + 8192),
    );
}

/// A backing chain is followed by imago by recursion, a stack frame or more per image (when a
/// queue starts, and in reads through the chain), and a stack overflow aborts the whole
/// daemon: served to a frontend, a chain of 500 images did so in a debug build and one of
/// 2,000 in a release build. A chain of `MAX_CHAIN` images (a raw base under 126 qemu-img
/// overlays) is served, in the debug build the tests run: the base's bytes read through every
/// overlay, and a write into a new cluster of the top copies the rest of it from the base
/// (imago reads it through the whole chain) and reads back. One more overlay is refused at
/// start in one line naming it and the remedy.
#[test]
fn a_chain_of_max_chain_images_is_served_and_a_deeper_one_refused() {
    const MAX_CHAIN: usize = mqblk::format::qcow2::MAX_CHAIN;
    let dir = TestDir::new();
    base_image(&dir, "raw");
    let chain = overlay_chain(&dir, "base.raw", "layer", MAX_CHAIN, &[]);
    let (deepest, too_deep) = (&chain[MAX_CHAIN - 2], &chain[MAX_CHAIN - 1]);

    let (mut d, mut c) = serve_one_queue(&dir, deepest, None);
    let expected = pattern_bytes(SIZE, 0, Some(BASE_SEED));
    for off in [0, SIZE / 2, SIZE - CLUSTER] {
        let got = c.read_vec(0, off, CLUSTER as usize).expect("read");
        assert_bytes_eq(
            &got,
            &expected[off as usize..(off + CLUSTER) as usize],
            off,
            "the base read through the chain",
        );
    }
    let off = 5 * CLUSTER;
    let block = vec![0x5au8; 4096];
    c.write(0, off + 8192, &block)
        .expect("a write into a new cluster");
    let mut cluster = expected[off as usize..(off + CLUSTER) as usize].to_vec();
    cluster[8192..8192 + 4096].copy_from_slice(&block);
    let got = c.read_vec(0, off, CLUSTER as usize).expect("read back");
    assert_bytes_eq(&got, &cluster, off, "the written cluster");
    drop(c);
    d.stop();

    let sock = dir.join("deep.sock").display().to_string();
    let e = serve_fails(
        &export_arg(format!(
            "socket={sock},path={},format=qcow2",
            too_deep.display()
        )),
        Duration::from_secs(10),
    );
    assert!(
        e.contains(&too_deep.display().to_string())
            && e.contains(&format!("more than {MAX_CHAIN} images"))
            && e.contains("qemu-img commit"),
        "{e}"
    );
}

/// `count` qemu-img overlays of `SIZE` in `dir`, `{prefix}1.qcow2` over the raw `base` (a name
/// in `dir`) and each `{prefix}i.qcow2` over the one before, made with `options` too; their
/// paths, bottom first. (`-u`: qemu-img records each backing file without opening the chain
/// under it.)
fn overlay_chain(
    dir: &TestDir,
    base: &str,
    prefix: &str,
    count: usize,
    options: &[&str],
) -> Vec<PathBuf> {
    let mut below = (base.to_string(), "raw");
    (1..=count)
        .map(|i| {
            let name = format!("{prefix}{i}.qcow2");
            let path = dir.join(&name);
            let size = SIZE.to_string();
            let mut args = vec!["create", "-q", "-f", "qcow2", "-u"];
            args.extend_from_slice(options);
            args.extend(["-b", &below.0, "-F", below.1, path.to_str().unwrap(), &size]);
            qemu_img_ok(&args);
            below = (name, "qcow2");
            path
        })
        .collect()
}

/// An image whose refcount table points its refcount blocks at offsets terabytes apart, far
/// past the end of its 1,294-byte file (the `qcow2_image` fuzz target found it; its seed
/// corpus keeps it): an `export_resize` before a frontend connects mends the image first,
/// counting its tables in those blocks, each written where the table points. Each such write
/// grew the file ahead by up to 16 MiB that nothing was ever written into: 274 MiB of the
/// filesystem, which every other image on it shares, for one small upload. What the file
/// takes ahead of its writes is now bounded by what is written past its end
/// (`RingFile::grow_for`).
#[test]
fn an_image_whose_refcount_blocks_lie_far_apart_past_its_end_takes_little_of_its_filesystem() {
    use std::os::unix::fs::MetadataExt;
    // On ext4 the first block far out fails (past its 16 TiB file size limit), and the rest
    // with it; a tmpfs takes them all.
    let dir = TestDir::on_tmpfs();
    let img = dir.join("far.qcow2");
    let seed = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/corpus/qcow2_image/far-apart-refcount-blocks"
    );
    std::fs::copy(seed, &img).unwrap();
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img)
        .queues(1)
        .direct(false)
        .set("format", "qcow2")
        .set("id", "far");
    let (mut d, mut api) = support::api::daemon_with_api(&dir, &[export]);
    // The image is corrupt: whether the resize and the write succeed does not matter, what
    // they take does.
    let _ = api.call(
        "export_resize",
        serde_json::json!({"id": "far", "size": 2 << 20}),
    );
    let mut c = Client::connect(&sock, 1).unwrap();
    c.set_timeout(Duration::from_secs(5));
    let _ = c.write(0, 0, &[0x5a; 4096]);
    let _ = c.flush(0);
    drop(c);
    d.stop();
    let taken = std::fs::metadata(&img).unwrap().blocks() * 512;
    // The new L1 table the resize writes (16 MiB) and the room taken ahead of what was written:
    // without the bound, 274 MiB.
    assert!(
        taken <= 64 << 20,
        "a 1294-byte image took {taken} bytes of its filesystem"
    );
    // imago warns for each of the thousands of clusters it cannot free: its lines are limited
    // (2,133 of them before), and the count of those dropped is written.
    let log = d.log();
    assert!(
        log.matches("Failed to free").count() <= 2 * 11,
        "{} lines of imago's",
        log.matches("Failed to free").count()
    );
    assert!(
        log.contains("lines of imago this second: the rest of the second's are dropped"),
        "{log}"
    );
}

/// The metadata path's counters (`metadata` in `export_get`; `mqblk_qcow2_*` in the metrics)
/// count what it does, and a guest flush after writes into new clusters syncs the image file
/// only as often as qcow2's order needs: with `metadata-commit=flush`, once before the L2
/// tables (covering the new clusters' data and the refcount blocks that count them) and once
/// at the end; with `write`, where each write's tables were written back (after a sync)
/// before it completed, once.
#[test]
fn the_metadata_counters_count_write_backs_and_a_flush_syncs_only_as_qcow2_s_order_needs() {
    for (commit, flush_syncs) in [("write", 1), ("flush", 2)] {
        let dir = TestDir::new();
        let base = base_image(&dir, "raw");
        let overlay = dir.join("overlay.qcow2");
        let sock = dir.join("s.sock");
        let export = overlay_export(&sock, &overlay, &base, "raw")
            .set("id", "ov")
            .set("metadata-commit", commit);
        let (d, mut api) = support::api::daemon_with_api(&dir, &[export]);
        let mut c = Client::connect(&sock, 2).unwrap();
        let mut counters = || {
            let got = api.ok("export_get", serde_json::json!({"id": "ov"}));
            let m = &got["status"]["metadata"];
            let n = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("no {k}: {got}"));
            [n("requests"), n("write_backs"), n("syncs"), n("sync_ns")]
        };
        let before = counters();
        // One write at a time, each into a new cluster (a copy-on-write from the base).
        const WRITES: u64 = 8;
        for i in 0..WRITES {
            let at = (2 * i + 1) * CLUSTER + 4096;
            c.write(0, at, &pattern(4096, at, 7)).unwrap();
        }
        let written = counters();
        let delta = |a: [u64; 4], b: [u64; 4], i: usize| a[i] - b[i];
        assert!(delta(written, before, 0) >= WRITES, "{commit}: {written:?}");
        if commit == "write" {
            // Each write alone in its group commit: one write-back and one sync each.
            assert_eq!(delta(written, before, 1), WRITES, "{commit}: {written:?}");
            assert_eq!(delta(written, before, 2), WRITES, "{commit}: {written:?}");
            assert!(delta(written, before, 3) > 0, "{commit}: a sync takes time");
        } else {
            // Nothing reaches the file before the guest's flush.
            assert_eq!(delta(written, before, 1), 0, "{commit}: {written:?}");
            assert_eq!(delta(written, before, 2), 0, "{commit}: {written:?}");
        }
        c.flush(0).expect("flush");
        let flushed = counters();
        assert_eq!(
            delta(flushed, written, 2),
            flush_syncs,
            "{commit}: the flush's syncs ({before:?} -> {written:?} -> {flushed:?})"
        );
        drop(c);
        d.terminate();
        assert_checks_clean(&overlay, false);
        let mut expected = std::fs::read(&base).unwrap();
        for i in 0..WRITES {
            let at = (2 * i + 1) * CLUSTER + 4096;
            expected[at as usize..at as usize + 4096].copy_from_slice(&pattern(4096, at, 7));
        }
        let read = read_through_qemu(&overlay, &dir.join("read.raw"));
        assert!(
            read == expected,
            "{commit}: QEMU reads what was written over the base"
        );
    }
}

/// The copy-on-write counters of export `id`: `[cow_writes, cow_writes_in_part]`.
fn cow_counters(api: &mut support::api::Api, id: &str) -> [u64; 2] {
    let got = api.ok("export_get", serde_json::json!({ "id": id }));
    let m = &got["status"]["metadata"];
    let n = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("no {k}: {got}"));
    [n("cow_writes"), n("cow_writes_in_part")]
}

/// A 4 KiB write into each of `clusters` (guest cluster numbers), one at a time, 4 KiB into
/// the cluster; the bytes QEMU must then read: `before` patched with them.
fn write_into_clusters(c: &mut Client, clusters: &[u64], before: &mut [u8]) {
    for &n in clusters {
        let at = n * CLUSTER + 4096;
        let data = pattern(4096, at, 0xc0);
        c.write(0, at, &data).unwrap();
        before[at as usize..at as usize + 4096].copy_from_slice(&data);
    }
}

/// Each of `clusters` (guest cluster numbers) reads back through `c` as `expected` holds it:
/// the writes, and around them the base's data or zeros (never stale bytes).
fn assert_clusters_read_back(c: &mut Client, clusters: &[u64], expected: &[u8]) {
    let mut got = vec![0u8; CLUSTER as usize];
    for &n in clusters {
        let start = n * CLUSTER;
        c.read(0, start, &mut got).unwrap();
        assert!(
            got == expected[start as usize..(start + CLUSTER) as usize],
            "cluster {n} reads back through mqblk"
        );
    }
}

/// A write into part of a new cluster whose rest is zeros (past the end of a shorter base, or
/// over zeros in it) is written alone, without the zeros, where the cluster lands in file
/// space the daemon grew the file over; where the rest comes from the base, the cluster is
/// written whole. Both read back exactly, through mqblk and through QEMU. Then the hazard: an
/// image whose file held bytes past its last cluster when the daemon opened it (a stale tail,
/// as a run that grew the file ahead and crashed leaves) gets its new clusters there, and those
/// must be written whole, or the stale bytes would show around the guest's write.
#[test]
fn a_new_cluster_reads_zeros_around_a_write_past_a_shorter_base_and_over_a_stale_file_tail() {
    let dir = TestDir::new();
    // An overlay twice the size of its raw base: its second half has no backing data.
    let base = dir.image("base.raw", SIZE / 2, Some(BASE_SEED));
    // And one cluster of zeros in the base (as a hole in a raw base reads).
    let zeros_in_base = 7;
    write_at(&base, zeros_in_base * CLUSTER, &vec![0; CLUSTER as usize]);
    let overlay = dir.join("overlay.qcow2");
    let sock = dir.join("s.sock");
    let half = SIZE / 2 / CLUSTER;
    let export = overlay_export(&sock, &overlay, &base, "raw")
        .queues(1)
        .set("size", &SIZE.to_string());
    let (d, mut api) = support::api::daemon_with_api(&dir, &[export.set("id", "ov")]);
    let mut c = Client::connect(&sock, 1).unwrap();
    let mut expected = std::fs::read(&base).unwrap();
    expected.resize(SIZE as usize, 0);
    let before = cow_counters(&mut api, "ov");
    let over_base = [1, 3, 5, half - 2];
    let past_base = [half, half + 3, half + 9, 2 * half - 1];
    write_into_clusters(&mut c, &over_base, &mut expected);
    write_into_clusters(&mut c, &past_base, &mut expected);
    write_into_clusters(&mut c, &[zeros_in_base], &mut expected);
    let after = cow_counters(&mut api, "ov");
    assert_eq!(
        [after[0] - before[0], after[1] - before[1]],
        [9, 5],
        "the clusters over the base's data written whole, those past it or over its zeros in \
         part: {before:?} -> {after:?}"
    );
    let written: Vec<u64> = past_base.iter().chain(&over_base).copied().collect();
    assert_clusters_read_back(&mut c, &written, &expected);
    assert_clusters_read_back(&mut c, &[zeros_in_base], &expected);
    c.flush(0).unwrap();
    drop(c);
    d.terminate();
    assert_checks_clean(&overlay, false);
    let read = read_through_qemu(&overlay, &dir.join("read.raw"));
    assert!(
        read == expected,
        "QEMU reads the base, zeros past it, and the writes"
    );

    // A stale tail: 16 clusters of 0xaa past the image's last cluster, counted free.
    let img = dir.join("stale.qcow2");
    create_qcow2(&img, &SIZE.to_string());
    let len = std::fs::metadata(&img).unwrap().len();
    write_at(
        &img,
        len.next_multiple_of(CLUSTER),
        &vec![0xaa; 16 * CLUSTER as usize],
    );
    let sock = dir.join("stale.sock");
    let export = Export::file(&sock, &img)
        .queues(1)
        .set("format", "qcow2")
        .set("id", "stale");
    let (d, mut api) = support::api::daemon_with_api(&dir, &[export]);
    let mut c = Client::connect(&sock, 1).unwrap();
    let mut expected = vec![0u8; SIZE as usize];
    let clusters: Vec<u64> = (0..24).map(|i| 2 * i + 1).collect();
    write_into_clusters(&mut c, &clusters, &mut expected);
    let counted = cow_counters(&mut api, "stale");
    assert_clusters_read_back(&mut c, &clusters, &expected);
    c.flush(0).unwrap();
    drop(c);
    d.terminate();
    assert_checks_clean(&img, false);
    let read = read_through_qemu(&img, &dir.join("read.raw"));
    assert!(read == expected, "QEMU reads zeros around each write");
    // The stale tail was used (and is counted in use: qemu-img check is clean).
    let tail = len.next_multiple_of(CLUSTER)..len.next_multiple_of(CLUSTER) + 16 * CLUSTER;
    let map = qemu_img_ok(&["map", "--output=json", &img.display().to_string()]);
    let map: Vec<serde_json::Value> = serde_json::from_str(&map).unwrap();
    let in_tail = map
        .iter()
        .filter_map(|m| m["offset"].as_u64())
        .filter(|o| tail.contains(o))
        .count();
    assert!(
        in_tail > 0,
        "no write landed in the stale tail {tail:?}: {map:?}"
    );
    // Those written whole, and the clusters past the tail (the file grown by the daemon) in
    // part.
    assert_eq!(counted[0], 24, "{counted:?}");
    assert_eq!(
        counted[1],
        24 - in_tail as u64,
        "{in_tail} new clusters in the stale tail written whole, the others in part: {counted:?}"
    );
}
