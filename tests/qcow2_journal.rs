//! `metadata-commit=journal`: a write into a new cluster completes once its mapping is recorded
//! in the journal (in the state directory), the tables are written back at the guest's flush, and a
//! daemon that serves the image after a crash replays the journal. Checked against QEMU's own
//! tools: after the replay every acknowledged write reads back through mqblk and through
//! `qemu-img convert`, and `qemu-img check` finds no corruption. A journal of another boot is
//! not replayed (the image keeps its last flush), and a crashed image whose journal is gone is
//! refused in one line.
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mqblk::format::qcow2::header::{DIRTY, DIRTY_BYTE};
use mqblk_client::Client;
use support::daemon::*;
use support::qemu_img::{
    assert_checks_clean, dirty_bit, qemu_img_ok, qemu_io_ok, read_through_qemu,
};

/// Where the daemon keeps the journal of the image at `img` (in the default state directory).
fn journal_of(img: &Path) -> PathBuf {
    mqblk::format::qcow2::journal_path(img).unwrap()
}

const SIZE: u64 = 32 << 20;
const CLUSTER: u64 = 64 << 10;
const BLOCK: u64 = 4096;
const BASE_SEED: u64 = 0xba5e;

/// What a 4 KiB block holds after the writes acknowledged so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    /// The pattern of this seed.
    Written(u64),
    /// Zeros.
    Zeroed,
    /// Changed by the request under way at the kill, never acknowledged: either its old or its
    /// new bytes.
    Unsure,
}

/// An overlay mqblk creates over a seeded raw base, served with `metadata-commit=journal` on
/// two queues.
fn journal_overlay(dir: &TestDir) -> (PathBuf, PathBuf, Export) {
    dir.image("base.raw", SIZE, Some(BASE_SEED));
    let img = dir.join("disk.qcow2");
    let sock = dir.join("q.sock");
    let export = overlay(&sock, &img, "journal");
    (img, sock, export)
}

/// The overlay `img` over `base.raw` beside it, on two queues, in `metadata-commit=commit`.
fn overlay(sock: &Path, img: &Path, commit: &str) -> Export {
    default_overlay(sock, img).set("metadata-commit", commit)
}

/// The same in the default mode (`metadata-commit=auto`).
fn default_overlay(sock: &Path, img: &Path) -> Export {
    Export::file(sock, img)
        .queues(2)
        .set("format", "qcow2")
        .set("backing", "base.raw")
        .set("backing-format", "raw")
}

/// The bytes block `offset` should hold after `b` (the base's where nothing was written).
fn expected(b: Option<Block>, offset: u64) -> Vec<u8> {
    match b {
        Some(Block::Written(seed)) => pattern_bytes(BLOCK, offset, Some(seed)),
        Some(Block::Zeroed) => vec![0; BLOCK as usize],
        Some(Block::Unsure) => unreachable!("an unsure block has no one content to expect"),
        None => pattern_bytes(BLOCK, offset, Some(BASE_SEED)),
    }
}

/// One client on both queues writing, until `stop`: each step a 4 KiB write into a new
/// cluster (in an order of its own), every third also one into a cluster written before (in place), every seventh a
/// zeroing of a whole earlier cluster, and one flush after the first 40 steps. Every
/// acknowledged change goes into `acked`; `tried` names the blocks of the request under way.
fn write_until_stopped(
    sock: &Path,
    acked: &Mutex<BTreeMap<u64, Block>>,
    tried: &Mutex<Vec<u64>>,
    stop: &AtomicBool,
) {
    let mut c = Client::connect(sock, 2).expect("connect");
    c.set_timeout(Duration::from_secs(2));
    let clusters = SIZE / CLUSTER;
    // The clusters of step 0, 1, 2, .. far apart and out of order (37 is prime to their
    // count), so that a replay, which goes in guest order, allocates in another order than
    // the writes did.
    let cluster = |step: u64| (step * 37 % clusters) * CLUSTER;
    for step in 0..clusters {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let q = (step % 2) as usize;
        let mut ops = vec![(cluster(step) + (step % 16) * BLOCK, false)];
        if step % 3 == 2 {
            ops.push((cluster(step / 2) + ((step + 5) % 16) * BLOCK, false));
        }
        if step % 7 == 6 {
            ops.push((cluster(step / 3), true));
        }
        for (offset, zero) in ops {
            let blocks: Vec<u64> = match zero {
                true => (0..CLUSTER / BLOCK).map(|i| offset + i * BLOCK).collect(),
                false => vec![offset],
            };
            *tried.lock().unwrap() = blocks.clone();
            let seed = 1000 + step;
            let done = match zero {
                true => c.write_zeroes(q, offset, CLUSTER, false),
                false => c.write(q, offset, &pattern_bytes(BLOCK, offset, Some(seed))),
            };
            if done.is_err() {
                return; // the daemon is gone
            }
            let mut acked = acked.lock().unwrap();
            for b in blocks {
                acked.insert(
                    b,
                    if zero {
                        Block::Zeroed
                    } else {
                        Block::Written(seed)
                    },
                );
            }
        }
        if step == 40 && c.flush(q).is_err() {
            return;
        }
    }
}

/// Runs [`write_until_stopped`] on `sock` and SIGKILLs `d` once `acks` blocks are acknowledged;
/// returns what was acknowledged, the blocks of the request under way at the kill `Unsure`.
fn kill_under_writes(d: &mut Daemon, sock: &Path, acks: usize) -> BTreeMap<u64, Block> {
    let acked = Arc::new(Mutex::new(BTreeMap::new()));
    let tried = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (sock, acked, tried, stop) = (
            sock.to_path_buf(),
            acked.clone(),
            tried.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || write_until_stopped(&sock, &acked, &tried, &stop))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while acked.lock().unwrap().len() < acks && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    d.signal(rustix::process::Signal::KILL);
    assert!(
        d.wait_exit(Duration::from_secs(10)).is_some(),
        "survived SIGKILL"
    );
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("writer");
    let mut acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() >= acks,
        "only {} blocks acknowledged",
        acked.len()
    );
    for &b in tried.lock().unwrap().iter() {
        acked.insert(b, Block::Unsure);
    }
    acked
}

/// A journal overlay (`journal_overlay`) served, written to and SIGKILLed once `acks` blocks are
/// acknowledged ([`kill_under_writes`]): the directory, image, socket, export and what was
/// acknowledged.
fn crashed_journal_overlay(
    acks: usize,
) -> (TestDir, PathBuf, PathBuf, Export, BTreeMap<u64, Block>) {
    let dir = TestDir::new();
    let (img, sock, export) = journal_overlay(&dir);
    let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
    let acked = kill_under_writes(&mut d, &sock, acks);
    drop(d);
    (dir, img, sock, export, acked)
}

/// Every block of `acked` (and the base's data around them) as `read` returns it; an `Unsure`
/// block may hold either.
fn assert_reads_back(acked: &BTreeMap<u64, Block>, mut read: impl FnMut(u64) -> Vec<u8>) {
    let mut lost = Vec::new();
    for (&offset, &b) in acked {
        if b == Block::Unsure {
            continue;
        }
        if read(offset) != expected(Some(b), offset) {
            lost.push(offset);
        }
        // The rest of its cluster: the base's data, unless written too.
        let around = offset / CLUSTER * CLUSTER + (offset + BLOCK) % CLUSTER;
        if !acked.contains_key(&around) && read(around) != expected(None, around) {
            lost.push(around);
        }
    }
    assert!(lost.is_empty(), "blocks lost or wrong: {lost:?}");
}

/// Serves `export` again after its crash, which replays the journal (and says so).
fn start_replaying(dir: &TestDir, export: &Export) -> Daemon {
    let d = Daemon::start(dir, std::slice::from_ref(export));
    assert!(
        d.log().contains("mappings its metadata journal recorded"),
        "no replay logged:\n{}",
        d.log()
    );
    d
}

/// The image at `img`, no longer served, is unmarked, checks clean, and QEMU reads every block
/// of `acked` from it.
fn assert_qemu_reads_back(dir: &TestDir, img: &Path, acked: &BTreeMap<u64, Block>) {
    assert_eq!(dirty_bit(img), 0);
    assert_checks_clean(img, true);
    let back = read_through_qemu(img, &dir.join("back.raw"));
    assert_reads_back(acked, |offset| {
        back[offset as usize..(offset + BLOCK) as usize].to_vec()
    });
}

/// SIGKILL under a stream of writes into new clusters, writes in place and zeroings, with one
/// flush early on: the image is left marked, the journal beside it. Served again in the same
/// mode, the journal is replayed: every acknowledged block reads back through mqblk, the image
/// is unmarked, and after a clean shutdown `qemu-img check` finds no corruption and QEMU reads
/// the same bytes. Without the journal's records the writes after the flush would be lost (the
/// same image in `metadata-commit=flush` is refused for that).
#[test]
fn a_crash_loses_no_acknowledged_write_and_a_restart_replays_the_journal() {
    let (dir, img, sock, export, acked) = crashed_journal_overlay(400);
    assert_eq!(dirty_bit(&img), 1, "left marked by the crash");
    assert!(journal_of(&img).exists());
    // Another mode would not replay the journal, and the repair a dirty image is refused with
    // would drop it: said so, in one line.
    for mode in ["flush", "write"] {
        let other_mode = overlay(&sock, &img, mode);
        let e = serve_fails(&export_arg(other_mode.spec()), Duration::from_secs(10));
        assert!(
            e.contains("marked dirty")
                && e.contains("serve it with metadata-commit=journal")
                && !e.contains('\n'),
            "{mode}: {e}"
        );
    }

    let d = start_replaying(&dir, &export);
    assert_eq!(dirty_bit(&img), 0, "unmarked once replayed");
    let mut c = Client::connect(&sock, 1).unwrap();
    assert_reads_back(&acked, |offset| {
        c.read_vec(0, offset, BLOCK as usize).expect("read")
    });
    drop(c);
    d.terminate();
    assert_qemu_reads_back(&dir, &img, &acked);
}

/// The same crash, with the journal's boot id made another's: the machine went down with the
/// guest, so the records (whose data may never have reached the disk) are not replayed. The
/// image is served as its last write-back left it, unmarked, and `qemu-img check` finds no
/// corruption; what was flushed reads back.
#[test]
fn a_journal_of_another_boot_is_not_replayed_and_the_image_keeps_its_last_flush() {
    // Steps 0..=40 are flushed (the flush follows step 40).
    let (dir, img, _sock, export, acked) = crashed_journal_overlay(400);
    let journal = journal_of(&img);
    let mut bytes = std::fs::read(&journal).unwrap();
    // The boot id's first character (the header's byte 48).
    bytes[48] = if bytes[48] == b'0' { b'1' } else { b'0' };
    std::fs::write(&journal, &bytes).unwrap();

    let d = Daemon::start(&dir, std::slice::from_ref(&export));
    assert!(
        d.log().contains("before this boot"),
        "not said:\n{}",
        d.log()
    );
    assert_eq!(dirty_bit(&img), 0);
    d.terminate();
    assert_checks_clean(&img, true);
    let back = read_through_qemu(&img, &dir.join("back.raw"));
    // Only blocks no later step changed: a later zeroing or write may or may not be there.
    let flushed: BTreeMap<u64, Block> = acked
        .iter()
        .filter(|(_, &b)| matches!(b, Block::Written(seed) if seed <= 1040))
        .map(|(&o, &b)| (o, b))
        .collect();
    assert!(flushed.len() >= 30, "{} flushed blocks", flushed.len());
    for (&offset, &b) in &flushed {
        assert_eq!(
            back[offset as usize..(offset + BLOCK) as usize],
            expected(Some(b), offset)[..],
            "flushed block {offset} lost"
        );
    }
}

/// A crashed image whose journal is gone would be served behind what its guest was told: it is
/// refused, in one line naming the journal and the repair.
#[test]
fn a_crashed_image_without_its_journal_is_refused_in_one_line() {
    let (_dir, img, _sock, export, _) = crashed_journal_overlay(100);
    std::fs::remove_file(journal_of(&img)).unwrap();
    let e = serve_fails(&export_arg(export.spec()), Duration::from_secs(10));
    assert!(
        e.contains("metadata journal")
            && e.contains("missing")
            && e.contains(&format!("qemu-img check -r all {}", img.display()))
            && !e.contains('\n'),
        "{e}"
    );
}

/// `mqblk replay-journal IMAGE`: its exit status and output.
fn replay_journal(img: &Path) -> (bool, String) {
    let out = std::process::Command::new(mqblk_bin())
        .arg("replay-journal")
        .arg(img)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The crash's image handed to QEMU instead of being served again: `mqblk replay-journal`
/// replays the journal without serving it, and leaves the image unmarked, checking clean, with
/// every acknowledged block as QEMU reads it. Run again, it has nothing to do; on an image
/// another program marked dirty it refuses, as serving would.
#[test]
fn replay_journal_hands_a_crashed_image_to_qemu_with_every_acknowledged_write() {
    let (dir, img, _sock, _export, acked) = crashed_journal_overlay(300);
    let (ok, out) = replay_journal(&img);
    assert!(
        ok && out.contains("unmarked") && out.contains("mappings its metadata journal recorded"),
        "{out}"
    );
    assert_qemu_reads_back(&dir, &img, &acked);
    let (ok, out) = replay_journal(&img);
    assert!(ok && out.contains("nothing to replay"), "{out}");
    // QEMU writes the image (clearing the journal's autoclear bit) and leaves it marked.
    qemu_io_ok(&img, "write -P 7 0 4k");
    set_header_bits(&img, DIRTY_BYTE, 1 << DIRTY);
    let (ok, out) = replay_journal(&img);
    assert!(
        !ok && out.contains("marked dirty") && out.contains("qemu-img check -r all"),
        "{out}"
    );
}

/// A marked image a daemon still serves is not a crash's: `mqblk replay-journal` refuses it.
#[test]
fn replay_journal_leaves_an_image_a_daemon_serves() {
    let dir = TestDir::new();
    let (img, sock, export) = journal_overlay(&dir);
    let d = Daemon::start(&dir, std::slice::from_ref(&export));
    let mut c = Client::connect(&sock, 1).unwrap();
    c.write(0, 0, &pattern_bytes(BLOCK, 0, Some(1))).unwrap();
    assert_eq!(dirty_bit(&img), 1, "marked until the guest flushes");
    let (ok, out) = replay_journal(&img);
    assert!(!ok && out.contains("in use by another process"), "{out}");
    assert_eq!(dirty_bit(&img), 1);
    drop(c);
    d.terminate();
    assert_eq!(dirty_bit(&img), 0);
}

/// Sets the bits `mask` of byte `at` of `img`'s header, as another program's write would.
fn set_header_bits(img: &Path, at: u64, mask: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .unwrap();
    let mut byte = [0];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[byte[0] | mask], at).unwrap();
}

/// Whether `img`'s header says its dirty mark is the metadata journal's (the autoclear bit).
fn journal_owns_mark(img: &Path) -> bool {
    mqblk::format::qcow2::header::journal_owns_mark(&std::fs::read(img).unwrap())
}

/// The journal outlives a repair by another program, and must not speak for a later mark that
/// is not its daemon's. A crashed image is repaired with `qemu-img check -r all` (which drops
/// what the journal holds, and, like every writer that does not know mqblk's autoclear bit,
/// clears it), and QEMU writes every cluster anew. Then:
/// - a dirty mark of another program (QEMU with lazy refcounts, crashed) is refused as dirty,
///   not taken for the journal's and "replayed" with the records of the first crash;
/// - once the image is served again, the journal is emptied of those records: a mark mqblk
///   makes and leaves at a crash before its first record is served as it is, with QEMU's
///   bytes in every cluster.
#[test]
fn a_mark_made_after_a_repair_is_not_replayed_from_the_journal_of_the_crash_before() {
    let (dir, img, sock, export, _) = crashed_journal_overlay(200);
    assert!(journal_owns_mark(&img), "marked by mqblk's journal");
    qemu_img_ok(&["check", "-r", "all", &img.display().to_string()]);
    assert_eq!(dirty_bit(&img), 0);
    assert!(!journal_owns_mark(&img), "cleared by QEMU");
    let written = dir.image("qemu.raw", SIZE, Some(0x9e5));
    qemu_io_ok(&img, &format!("write -s {} 0 {SIZE}", written.display()));
    let journal = std::fs::read(journal_of(&img)).unwrap();
    // The journal's state (the header's byte 96): records pending still.
    assert_eq!(journal[96], 1, "the first crash's records");

    set_header_bits(&img, DIRTY_BYTE, 1 << DIRTY);
    let e = serve_fails(&export_arg(export.spec()), Duration::from_secs(10));
    assert!(
        e.contains("marked dirty") && e.contains("qemu-img check -r all"),
        "{e}"
    );

    qemu_img_ok(&["check", "-r", "all", &img.display().to_string()]);
    let d = Daemon::start(&dir, std::slice::from_ref(&export));
    d.terminate();
    assert_eq!(std::fs::read(journal_of(&img)).unwrap()[96], 0, "emptied");
    assert!(journal_owns_mark(&img), "claimed by the journal's daemon");
    // A mark of that daemon, which died before its first record.
    set_header_bits(&img, DIRTY_BYTE, 1 << DIRTY);
    let d = Daemon::start(&dir, std::slice::from_ref(&export));
    let log = d.log();
    assert!(
        log.contains("before its metadata journal held a record")
            && !log.contains("mappings its metadata journal recorded"),
        "{log}"
    );
    assert_eq!(dirty_bit(&img), 0);
    let expected = std::fs::read(&written).unwrap();
    let mut c = Client::connect(&sock, 1).unwrap();
    let mut wrong = Vec::new();
    for offset in (0..SIZE).step_by(CLUSTER as usize) {
        let read = c.read_vec(0, offset, CLUSTER as usize).expect("read");
        if read[..] != expected[offset as usize..(offset + CLUSTER) as usize] {
            wrong.push(offset);
        }
    }
    assert!(
        wrong.is_empty(),
        "clusters not as QEMU wrote them: {wrong:?}"
    );
    drop(c);
    d.terminate();
    assert_checks_clean(&img, true);
}

/// A replay cut short (a debug build's hook aborts the daemon once the replay has written a few
/// clusters through imago) runs again when the image is served next, from what it staged: the
/// clusters its first run allocated may be the very ones the records name, so their data comes
/// from the staging area, not from where the records point. Every acknowledged block reads
/// back, and the image checks clean.
#[test]
fn a_replay_cut_short_runs_again_from_what_it_staged() {
    if !support::skip::has_test_hooks() {
        return;
    }
    let (dir, img, sock, export, acked) = crashed_journal_overlay(400);
    // A third of the records (the header's head and tail, bytes 104 and 112), so that the
    // replay has allocated clusters before it stops (its first records may be zeroings).
    let header = std::fs::read(journal_of(&img)).unwrap();
    let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap());
    let after = (word(112) - word(104)) / 3;
    assert!(after >= 10, "{after}");
    let mut child = std::process::Command::new(mqblk_bin())
        .arg("serve")
        .args(export_arg(export.spec()))
        .env("MQBLK_TEST_ONLY_REPLAY_ABORT_AFTER", after.to_string())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code().is_none() && stderr.contains("the replay aborts"),
        "the replay was to abort: {:?}\n{stderr}",
        out.status
    );
    assert_eq!(dirty_bit(&img), 1, "still marked");
    // The journal's state (the header's byte 96): staged.
    assert_eq!(std::fs::read(journal_of(&img)).unwrap()[96], 2, "staged");

    let d = start_replaying(&dir, &export);
    let mut c = Client::connect(&sock, 1).unwrap();
    assert_reads_back(&acked, |offset| {
        c.read_vec(0, offset, BLOCK as usize).expect("read")
    });
    drop(c);
    d.terminate();
    assert_checks_clean(&img, true);
}

/// The default, `metadata-commit=auto`, keeps a journal for a version 3 image (in the state
/// directory, not beside the image), so a crash under it loses no acknowledged write: a daemon
/// in the default mode replays the journal, and QEMU then reads every acknowledged block.
#[test]
fn the_default_mode_journals_a_version_3_image_and_replays_it_after_a_crash() {
    let dir = TestDir::new();
    dir.image("base.raw", SIZE, Some(BASE_SEED));
    let img = dir.join("disk.qcow2");
    let sock = dir.join("q.sock");
    let export = default_overlay(&sock, &img);
    let mut d = Daemon::start(&dir, std::slice::from_ref(&export));
    assert!(
        d.log()
            .contains("metadata-commit=auto: new clusters' mappings are journaled"),
        "not said:\n{}",
        d.log()
    );
    let acked = kill_under_writes(&mut d, &sock, 300);
    drop(d);
    assert_eq!(dirty_bit(&img), 1, "left marked by the crash");
    assert!(journal_of(&img).starts_with(mqblk::config::state_dir::get()));
    let beside: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("journal"))
        .collect();
    assert!(beside.is_empty(), "beside the image: {beside:?}");

    let d = start_replaying(&dir, &export);
    d.terminate();
    assert_qemu_reads_back(&dir, &img, &acked);
}

/// Where no journal can be kept, the default takes `metadata-commit=write` and says so at the
/// image's open: a version 2 image (which cannot be marked dirty), and a state directory mqblk
/// cannot make. Either way a crash loses no acknowledged write, with no journal to replay, and
/// the image is never left marked. `metadata-commit=journal`, asked for, refuses to start
/// instead, naming the directory.
#[test]
fn the_default_mode_writes_the_tables_back_where_no_journal_can_be_kept() {
    let dir = TestDir::new();
    let blocked = dir.join("not-a-directory");
    std::fs::write(&blocked, b"").unwrap();
    let state_dir = ["--state-dir", blocked.to_str().unwrap()];
    for (case, compat, args, said) in [
        (
            "version 2",
            "0.10",
            &[][..],
            "a version 2 image cannot be marked",
        ),
        (
            "no state directory",
            "1.1",
            &state_dir[..],
            "no metadata journal",
        ),
    ] {
        let img = dir.join("disk.qcow2");
        let _ = std::fs::remove_file(&img);
        qemu_img_ok(&[
            "create",
            "-f",
            "qcow2",
            "-o",
            &format!("compat={compat}"),
            img.to_str().unwrap(),
            &SIZE.to_string(),
        ]);
        // One a deleted image with this inode left in the state directory.
        let _ = std::fs::remove_file(journal_of(&img));
        let sock = dir.join("v.sock");
        let export = Export::file(&sock, &img).set("format", "qcow2");
        let mut d = Daemon::start_args(&dir, std::slice::from_ref(&export), args);
        assert!(d.log().contains(said), "{case}: not said:\n{}", d.log());
        let mut c = Client::connect(&sock, 1).unwrap();
        let blocks: Vec<u64> = (0..8).map(|i| i * 3 * CLUSTER + 4096).collect();
        for &at in &blocks {
            c.write(0, at, &pattern_bytes(BLOCK, at, Some(7))).unwrap();
        }
        d.signal(rustix::process::Signal::KILL);
        assert!(d.wait_exit(Duration::from_secs(10)).is_some());
        drop(c);
        drop(d);
        assert_eq!(dirty_bit(&img), 0, "{case}: marked");
        assert!(!journal_of(&img).exists(), "{case}: a journal was kept");
        assert_checks_clean(&img, true);
        let back = read_through_qemu(&img, &dir.join("back.raw"));
        for &at in &blocks {
            assert_eq!(
                back[at as usize..(at + BLOCK) as usize],
                pattern_bytes(BLOCK, at, Some(7))[..],
                "{case}: acknowledged block {at} lost"
            );
        }
    }
    let img = dir.join("disk.qcow2");
    let journal = Export::file(dir.join("j.sock"), &img)
        .set("format", "qcow2")
        .set("metadata-commit", "journal");
    let mut args = export_arg(journal.spec());
    args.extend(state_dir.iter().map(|a| a.to_string()));
    let e = serve_fails(&args, Duration::from_secs(10));
    assert!(
        e.contains("metadata journal") && e.contains(blocked.to_str().unwrap()),
        "{e}"
    );
}
