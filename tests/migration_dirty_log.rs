//! The dirty log of a live migration, through the vhost-user socket: a frontend that migrates
//! hands mqblk a log, and mqblk marks exactly the guest pages it writes; a frontend that abuses
//! the log (too small, unmappable, past its file's end, shrunk afterwards) is refused or
//! survived, and the daemon never faults. (tests/migration.rs migrates a QEMU guest, end to
//! end.)
//!
//! The frontend is the hand-written one of the hostile tests (tests/support/frontend.rs), and so
//! is the daemon, whose second export a libblkio client drives throughout
//! (tests/support/hostile.rs).
mod support;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use support::daemon::*;
use support::frontend::*;
use support::hostile::*;
use support::mem::memfd;
use support::wait::wait_until;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::VhostBackend;

/// VHOST_F_LOG_ALL.
const F_LOG_ALL: u64 = 1 << 26;
/// VHOST_VRING_F_LOG.
const VRING_F_LOG: u32 = 1;
/// Bytes of dirty log for the test guest's memory (3 MiB of guest-physical space: 768 pages).
const LOG_BYTES: u64 = 96;

/// The features `Session::negotiate_features` acks, with `extra`.
fn acked_features(extra: u64) -> u64 {
    F_VERSION_1
        | vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
        | F_INDIRECT_DESC
        | extra
}

fn log_region(f: &File, size: u64, offset: u64) -> vhost::VhostUserDirtyLogRegion {
    vhost::VhostUserDirtyLogRegion {
        mmap_size: size,
        mmap_offset: offset,
        mmap_handle: f.as_raw_fd(),
    }
}

/// Sets ring `q` of `s` up again at the same addresses, with VHOST_VRING_F_LOG and
/// `log_guest_addr` (or without, for `None`).
fn set_used_log(s: &mut Session, q: usize, log_addr: Option<u64>) -> Result<(), String> {
    let r = &s.rings[q];
    let addrs = vhost::VringConfigData {
        queue_max_size: r.size,
        queue_size: r.size,
        flags: if log_addr.is_some() { VRING_F_LOG } else { 0 },
        desc_table_addr: s.guest.user_addr(r.desc),
        used_ring_addr: s.guest.user_addr(r.used),
        avail_ring_addr: s.guest.user_addr(r.avail),
        log_addr,
    };
    answer(s.conn.fe.set_vring_addr(q, &addrs))
}

/// The pages marked in `len` bytes of log at `offset` of `f`, and whether any byte of `f`
/// outside them changed from zero.
fn marked_pages(f: &File, offset: u64, len: u64) -> (Vec<u64>, bool) {
    let all = read_file_fd(f);
    let outside = all
        .iter()
        .enumerate()
        .any(|(i, &b)| b != 0 && !(offset..offset + len).contains(&(i as u64)));
    let log = &all[offset as usize..(offset + len) as usize];
    let pages = (0..len * 8)
        .filter(|&p| log[(p / 8) as usize] & (1 << (p % 8)) != 0)
        .collect();
    (pages, outside)
}

fn read_file_fd(f: &File) -> Vec<u8> {
    let len = f.metadata().unwrap().len() as usize;
    let mut v = vec![0u8; len];
    std::os::unix::fs::FileExt::read_exact_at(f, &mut v, 0).unwrap();
    v
}

/// A frontend that migrates: it hands over a dirty log (at an unaligned offset in its memfd),
/// switches VHOST_F_LOG_ALL and VHOST_VRING_F_LOG on and off on a live ring, and checks the log
/// after each request: exactly the pages the daemon wrote (the read's data, the status byte,
/// the used ring) are marked, nothing while logging is off, and nothing outside the log.
#[test]
fn dirty_log_marks_every_page_the_daemon_writes_and_nothing_else() {
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);

    let (c, _) = Session::negotiate_with(&sock, VhostUserProtocolFeatures::LOG_SHMFD).unwrap();
    let mut s = Session::start(c, 16, Some(IMG_SEED));
    let (_, _, used) = ring_gpas(0);
    let log = support::mem::sealable_memfd("dirty-log", 4096);
    let at = 100;
    answer(
        s.conn
            .fe
            .set_log_base(0, Some(log_region(&log, LOG_BYTES, at))),
    )
    .expect("SET_LOG_BASE");
    s.good_read(0).expect("read with a log but no LOG_ALL");
    assert_eq!(
        marked_pages(&log, at, LOG_BYTES),
        (vec![], false),
        "marked without LOG_ALL"
    );

    // Logging on, on the live ring.
    answer(s.conn.fe.set_features(acked_features(F_LOG_ALL))).expect("SET_FEATURES LOG_ALL");
    set_used_log(&mut s, 0, Some(used)).expect("SET_VRING_ADDR with VRING_F_LOG");
    s.good_read(0).expect("read while logging");
    // Pages ascending: the used ring (3), the status byte (8), the data (0x20).
    assert_eq!(
        marked_pages(&log, at, LOG_BYTES),
        (vec![used >> 12, STATUS_GPA >> 12, DATA_GPA >> 12], false),
        "the used ring, the status byte and the data, nothing else"
    );

    // A write: its data is only read by the daemon; the status byte and used ring are written.
    std::os::unix::fs::FileExt::write_all_at(&log, &[0u8; 4096], 0).unwrap();
    s.guest.write(HDR_GPA, &header(T_OUT, 64));
    s.guest.write(DATA_GPA + 0x1000, &[0x5a; 512]);
    let a = s.submit(
        0,
        &[
            d(HDR_GPA, 16, VRING_F_NEXT, 1),
            d(DATA_GPA + 0x1000, 512, VRING_F_NEXT, 2),
            d(STATUS_GPA, 1, VRING_F_WRITE, 0),
        ],
    );
    assert_eq!(a, Answer::Used(0, 1));
    assert_eq!(
        marked_pages(&log, at, LOG_BYTES),
        (vec![used >> 12, STATUS_GPA >> 12], false)
    );

    // Logging off again: nothing more is marked.
    std::os::unix::fs::FileExt::write_all_at(&log, &[0u8; 4096], 0).unwrap();
    answer(s.conn.fe.set_features(acked_features(0))).expect("SET_FEATURES without LOG_ALL");
    set_used_log(&mut s, 0, None).expect("SET_VRING_ADDR without VRING_F_LOG");
    s.guest.expect(STATUS_GPA, &[S_OK]);
    s.good_read(0).expect("read after logging stopped");
    assert_eq!(marked_pages(&log, at, LOG_BYTES), (vec![], false));
    drop(s);
    assert_alive(&mut daemon, "a migrating frontend");
    by.finish();
    daemon.terminate();
}

/// What a frontend does with its dirty log, and what the daemon made of it.
type LogAbuse = fn(&Path) -> String;

/// A session with guest memory and ring 0, LOG_SHMFD acked.
fn logging_session(p: &Path) -> Session {
    let (c, _) = Session::negotiate_with(p, VhostUserProtocolFeatures::LOG_SHMFD).unwrap();
    Session::start(c, 16, Some(IMG_SEED))
}

fn refused_or_not(r: Result<(), String>) -> String {
    match r {
        Ok(()) => "ACCEPTED".into(),
        Err(e) => format!("refused ({e})"),
    }
}

/// A logging session offers `size` bytes of `f` at `offset` as its dirty log (SET_LOG_BASE).
fn offer_log(p: &Path, f: &File, size: u64, offset: u64) -> String {
    let s = logging_session(p);
    refused_or_not(answer(
        s.conn.fe.set_log_base(0, Some(log_region(f, size, offset))),
    ))
}

fn log_smaller_than_memory(p: &Path) -> String {
    let f = support::mem::sealable_memfd("small-log", 4096);
    offer_log(p, &f, 64, 0)
}

fn log_is_a_pipe(p: &Path) -> String {
    let (r, _w) = rustix::pipe::pipe().unwrap();
    offer_log(p, &File::from(r), LOG_BYTES, 0)
}

fn log_sealed_against_writes(p: &Path) -> String {
    let f = support::mem::sealable_memfd("read-only-log", 4096);
    rustix::fs::fcntl_add_seals(&f, rustix::fs::SealFlags::WRITE).expect("F_SEAL_WRITE");
    offer_log(p, &f, LOG_BYTES, 0)
}

fn log_offset_past_its_end(p: &Path) -> String {
    let f = support::mem::sealable_memfd("short-log", 4096);
    offer_log(p, &f, LOG_BYTES, 8192)
}

fn log_offset_wraps(p: &Path) -> String {
    let f = support::mem::sealable_memfd("wrapping-log", 4096);
    offer_log(p, &f, LOG_BYTES, u64::MAX - 10)
}

fn log_that_cannot_be_sealed(p: &Path) -> String {
    // Without MFD_ALLOW_SEALING a memfd carries F_SEAL_SEAL: nothing keeps it from shrinking.
    let f = memfd("unsealable-log", 4096);
    offer_log(p, &f, LOG_BYTES, 0)
}

/// The frontend truncates its log after the daemon mapped it, then logs I/O: a write to a
/// mapping past the end of its file would SIGBUS the daemon.
fn log_truncated_afterwards(p: &Path) -> String {
    let mut s = logging_session(p);
    let f = support::mem::sealable_memfd("truncated-log", 4096);
    if let Err(e) = answer(s.conn.fe.set_log_base(0, Some(log_region(&f, 4096, 0)))) {
        return format!("SET_LOG_BASE refused ({e})");
    }
    let truncate = match f.set_len(0) {
        Ok(()) => "the truncate succeeded".to_string(),
        Err(e) => format!("the truncate failed: {e}"),
    };
    let logging = answer(s.conn.fe.set_features(acked_features(F_LOG_ALL)))
        .and_then(|()| set_used_log(&mut s, 0, Some(ring_gpas(0).2)));
    let io = logging.and_then(|()| s.good_read(0).and_then(|()| s.good_read(0)));
    format!("{truncate}; logged reads: {}", refused_or_not(io))
}

fn log_all_without_a_log(p: &Path) -> String {
    let (c, _) =
        Session::negotiate_features(p, VhostUserProtocolFeatures::LOG_SHMFD, F_LOG_ALL).unwrap();
    let mut s = Session::start(c, 16, Some(IMG_SEED));
    format!(
        "reads: {}",
        refused_or_not(s.good_read(0).and_then(|()| s.good_read(0)))
    )
}

fn used_log_outside_memory_and_log(p: &Path) -> String {
    let mut s = logging_session(p);
    let f = support::mem::sealable_memfd("log", 4096);
    answer(
        s.conn
            .fe
            .set_log_base(0, Some(log_region(&f, LOG_BYTES, 0))),
    )
    .unwrap();
    answer(s.conn.fe.set_features(acked_features(F_LOG_ALL))).unwrap();
    refused_or_not(set_used_log(&mut s, 0, Some(1 << 40)))
}

/// Dirty logs a frontend could use to crash the daemon or make it write outside the log: each
/// is refused (the connection closes) or survived, the daemon never faults, a new frontend is
/// served, and the other export serves throughout.
#[test]
fn dirty_log_abuse_is_refused_and_never_faults() {
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);
    fresh_client_works(&sock).expect("first client");

    // (what, abuse, the outcome it must have, what the daemon must log for it: the message of
    // that very refusal, so that a case refused for another reason fails)
    let cases: Vec<(&str, LogAbuse, &str, &str)> = vec![
        (
            "SET_LOG_BASE: 64 bytes for 96 bytes of guest memory",
            log_smaller_than_memory,
            "refused",
            "dirty log refused: it covers 0x200000 bytes of guest memory, which reaches",
        ),
        (
            "SET_LOG_BASE with a pipe",
            log_is_a_pipe,
            "refused",
            "dirty log refused: its file cannot be sealed against shrinking",
        ),
        (
            "SET_LOG_BASE with a memfd sealed against writes",
            log_sealed_against_writes,
            "refused",
            "dirty log refused: cannot map it",
        ),
        (
            "SET_LOG_BASE at offset 8192 of a 4 KiB memfd",
            log_offset_past_its_end,
            "refused",
            "dirty log refused: 96 bytes at offset 8192 extend past the end of its 4096-byte file",
        ),
        (
            "SET_LOG_BASE at an offset that wraps",
            log_offset_wraps,
            "refused",
            // vhost's message check (offset + size must not overflow) refuses it before
            // mqblk's own: the connection closes as for any invalid message (mqblk's own
            // refusals log their own reason as the error instead).
            "err=invalid message",
        ),
        (
            "SET_LOG_BASE with a memfd that cannot be sealed",
            log_that_cannot_be_sealed,
            "refused",
            "dirty log refused: its file cannot be sealed against shrinking",
        ),
        (
            "log truncated after SET_LOG_BASE, then I/O with LOG_ALL",
            log_truncated_afterwards,
            "the truncate failed: Operation not permitted (os error 1); logged reads: ACCEPTED",
            "dirty log set up for live migration",
        ),
        (
            "LOG_ALL acked with no log base",
            log_all_without_a_log,
            "reads: ACCEPTED",
            "VHOST_F_LOG_ALL acked without a log",
        ),
        (
            "VRING_F_LOG with log_guest_addr 2^40",
            used_log_outside_memory_and_log,
            "refused",
            "its used ring logged at 0x10000000000",
        ),
    ];
    let mut failures = Vec::new();
    for (name, f, want, want_logged) in cases {
        let log_before = daemon.log().len();
        let obs = f(&sock);
        // A new client is served only once the daemon has dropped the abusing connection.
        let client = fresh_client_works(&sock);
        assert_alive(&mut daemon, name);
        let ok = obs.starts_with(want);
        // The daemon logs as it refuses; the line may take a moment to reach the file.
        let new_log = || daemon.log().get(log_before..).unwrap_or("").to_string();
        wait_until(Duration::from_secs(5), || new_log().contains(want_logged));
        let logged = new_log();
        let logged_ok = logged.contains(want_logged);
        let line = format!(
            "{} {name}: {obs}; logged {want_logged:?}: {logged_ok}; a new client: {}",
            if ok && logged_ok && client.is_ok() {
                "ok  "
            } else {
                "FAIL"
            },
            client
                .as_ref()
                .map_or_else(|e| e.clone(), |()| "works".into())
        );
        eprintln!("{line}");
        if !ok || !logged_ok || client.is_err() {
            failures.push(format!(
                "{line} (expected: {want}, and the log line {want_logged:?}; the daemon logged \
                 meanwhile:\n{logged})"
            ));
        }
    }
    let log = daemon.log();
    for line in [
        "dirty log refused",
        "VHOST_F_LOG_ALL acked without a log",
        "lies beyond the dirty log",
    ] {
        if !log.contains(line) {
            failures.push(format!("the daemon's log has no line with {line:?}"));
        }
    }
    let ops = by.finish();
    eprintln!("bystander export served {ops} requests meanwhile");
    assert_alive(&mut daemon, "everything");
    daemon.terminate();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
