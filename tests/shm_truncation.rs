//! A frontend truncates a file it shared with the daemon while requests run.
//!
//! Touching a mapped page past the new end of its file raises SIGBUS; unhandled, it kills the
//! daemon and every tenant's export with it. mqblk seals what it can against shrinking and
//! guards what it cannot (mqblk/src/shm): the truncating frontend loses its connection, the
//! daemon and its other exports go on. Each test runs a libblkio client verifying its data on a
//! second export throughout (support::hostile::Bystander), and then shows that the truncating frontend's export serves a new
//! connection.
mod support;

use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use support::daemon::*;
use support::frontend::*;
use support::hostile::Bystander;
use support::mem::{memfd, sealable_memfd, SharedMem};
use support::skip::has_test_hooks;
use vhost::vhost_user::message::{VhostUserInflight, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;

const IMG_SIZE: u64 = 8 * MIB;
/// What the daemon logs when it contained a truncation.
const CONTAINED: &str = "the frontend truncated a file it shared while it was mapped";

fn start_daemon(dir: &TestDir) -> (Daemon, PathBuf, PathBuf) {
    let img = dir.image("victim.img", IMG_SIZE, None);
    let other = dir.image("other.img", IMG_SIZE, None);
    let (a, b) = (dir.join("victim.sock"), dir.join("other.sock"));
    let daemon = Daemon::start(
        dir,
        &[
            Export::file(&a, &img).set("queue-size", "64"),
            Export::file(&b, &other),
        ],
    );
    (daemon, a, b)
}

/// Posts `n` 4 KiB writes (heads 0, 3, 6, ...) without waiting for them.
fn post_writes(s: &mut Session, n: u16) {
    post_writes_at(s, n, 8)
}

/// [`post_writes`], the `i`th at sector `stride * i`.
fn post_writes_at(s: &mut Session, n: u16, stride: u64) {
    for i in 0..n {
        let head = 3 * i;
        let hdr = HDR_GPA + 16 * u64::from(i);
        s.guest.write(hdr, &header(T_OUT, stride * u64::from(i)));
        s.write_descs(
            0,
            head,
            &[
                d(hdr, 16, VRING_F_NEXT, head + 1),
                d(DATA_GPA, 4096, VRING_F_NEXT, head + 2),
                d(STATUS_GPA + u64::from(i), 1, VRING_F_WRITE, 0),
            ],
        );
        s.post_raw(0, head, 0);
    }
}

/// Kicks queue 0 without touching guest memory (which may be gone).
fn kick(s: &Session) {
    s.rings[0].kick.write(1).unwrap();
}

/// The fault in `what` (as the log names it) was contained: the daemon closed the session's
/// connection, said why, and lives.
fn contained(daemon: &mut Daemon, s: &Session, what: &str) {
    assert!(
        s.conn.closed_by_peer(Duration::from_secs(10)),
        "the daemon kept the connection of a frontend that truncated {what}"
    );
    let found = daemon.wait_for_log(CONTAINED, Duration::from_secs(10));
    assert!(
        daemon.has_exited().is_none(),
        "the daemon died:\n{}",
        daemon.log()
    );
    let log = daemon.log();
    assert!(found, "no '{CONTAINED}' in the log:\n{log}");
    assert!(log.contains(&format!("what=\"{what}\"")), "{log}");
}

/// After a contained fault: the export serves a new frontend, the other export was served
/// throughout and after it, and the daemon stops cleanly.
fn others_unharmed(mut daemon: Daemon, victim: &Path, bystander: Bystander) {
    assert!(
        daemon.has_exited().is_none(),
        "daemon died:\n{}",
        daemon.log()
    );
    let mut s = Session::open(victim, 64, None);
    s.good_write(0, 16, 0x3c);
    bystander.wait_served_more(20);
    bystander.finish();
    daemon.stop();
}

fn truncate(f: impl AsFd) -> std::io::Result<()> {
    Ok(rustix::fs::ftruncate(f, 0)?)
}

#[test]
fn truncated_guest_memory_ends_only_its_own_connection() {
    let dir = TestDir::new();
    let (mut daemon, victim, other) = start_daemon(&dir);
    let bystander = Bystander::start(other, IMG_SIZE);
    bystander.wait_serving();

    // The hand-written frontend's guest memory is a memfd without MFD_ALLOW_SEALING: the
    // daemon cannot seal it, so it guards its mapping.
    let mut s = Session::open(&victim, 64, None);
    s.good_write(0, 0, 0x11);
    post_writes(&mut s, 16);
    truncate(s.guest.mem.file()).expect("truncating the guest memory");
    // From here on this process must not touch the guest memory either.
    kick(&s);
    contained(&mut daemon, &s, "guest memory");
    std::mem::forget(s); // its mapping faults now: leave it mapped, never read
    others_unharmed(daemon, &victim, bystander);
}

/// The same on a qcow2 overlay, where the image's metadata worker copies a write's data into
/// the new cluster it builds (copy-on-write from the base) in user space, on a thread of its
/// own. A debug build's test delay (`MQBLK_TEST_ONLY_COW_COPY_DELAY_MS`) holds the copy while
/// the memory is truncated, after the I/O thread read the requests: the worker's fault is the
/// first, and it is contained as the I/O thread's are.
#[test]
fn truncated_guest_memory_under_a_copy_on_write_ends_only_its_own_connection() {
    if !has_test_hooks() {
        return;
    }
    let dir = TestDir::new();
    dir.image("base.img", IMG_SIZE, Some(7));
    let other = dir.image("other.img", IMG_SIZE, None);
    let (victim, other_sock) = (dir.join("victim.sock"), dir.join("other.sock"));
    let overlay = Export::file(&victim, dir.join("victim.qcow2"))
        .set("queue-size", "64")
        .set("format", "qcow2")
        .set("backing", "base.img")
        .set("backing-format", "raw")
        // No poll of the rings (in guest memory) that could fault before the worker.
        .set("poll", "off");
    let mut daemon = Daemon::start_env(
        &dir,
        &[overlay, Export::file(&other_sock, &other)],
        &[],
        &[("MQBLK_TEST_ONLY_COW_COPY_DELAY_MS", "1500")],
    );
    let bystander = Bystander::start(other_sock, IMG_SIZE);
    bystander.wait_serving();

    let mut s = Session::open(&victim, 64, None);
    // 4 KiB into each of 16 clusters the overlay does not hold yet (64 KiB apart).
    post_writes_at(&mut s, 16, 128);
    kick(&s);
    // The I/O thread has read them and handed them to the worker, which waits to copy.
    std::thread::sleep(Duration::from_millis(500));
    truncate(s.guest.mem.file()).expect("truncating the guest memory");
    // Nothing touches the memory until the worker's copies, a second later.
    assert!(
        !s.conn.closed_by_peer(Duration::from_millis(300)),
        "a fault before the worker's copy: the test shows nothing about the worker"
    );
    contained(&mut daemon, &s, "guest memory");
    std::mem::forget(s); // its mapping faults now: leave it mapped, never read
    others_unharmed(daemon, &victim, bystander);
}

#[test]
fn a_truncated_inflight_region_ends_only_its_own_connection() {
    let dir = TestDir::new();
    let (mut daemon, victim, other) = start_daemon(&dir);
    let bystander = Bystander::start(other, IMG_SIZE);
    bystander.wait_serving();

    let (mut conn, _) = Session::negotiate_with(&victim, VhostUserProtocolFeatures::INFLIGHT_SHMFD)
        .expect("negotiation");
    // The frontend's own in-flight region, in a memfd that cannot be sealed.
    let region = memfd("inflight", 4096);
    let shape = VhostUserInflight {
        mmap_size: 4096,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: 64,
    };
    answer(conn.fe.set_inflight_fd(&shape, region.as_raw_fd())).expect("SET_INFLIGHT_FD");
    let mut s = Session::start(conn, 64, None);
    s.good_write(0, 0, 0x22);
    truncate(&region).expect("truncating the in-flight region");
    // Guest memory is intact: the next request's fetch writes the region, and faults.
    post_writes(&mut s, 4);
    contained(&mut daemon, &s, "the in-flight region");
    others_unharmed(daemon, &victim, bystander);
}

#[test]
fn files_that_can_be_sealed_are_sealed_and_cannot_be_truncated() {
    let dir = TestDir::new();
    let (mut daemon, victim, _) = start_daemon(&dir);

    // The in-flight region mqblk creates: sealed against any size change.
    let (mut conn, _) = Session::negotiate_with(&victim, VhostUserProtocolFeatures::INFLIGHT_SHMFD)
        .expect("negotiation");
    let shape = VhostUserInflight {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: 64,
    };
    let (_, region) = answer(conn.fe.get_inflight_fd(&shape)).expect("GET_INFLIGHT_FD");
    let seals = rustix::fs::fcntl_get_seals(&region).unwrap();
    use rustix::fs::SealFlags;
    assert!(
        seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL),
        "{seals:?}"
    );
    assert!(
        truncate(&region).is_err(),
        "the daemon's in-flight region shrank"
    );

    // Guest memory in a memfd that allows sealing (as QEMU's and Cloud Hypervisor's do): the
    // daemon seals it against shrinking when it maps it.
    let mem = SharedMem::map(sealable_memfd("guest", 2 * MIB), 2 * MIB_U);
    let mut guest = Guest::with_memory(mem);
    Session::set_mem_table(&conn, &guest).expect("SET_MEM_TABLE");
    let seals = rustix::fs::fcntl_get_seals(guest.mem.file()).unwrap();
    assert!(seals.contains(SealFlags::SHRINK), "{seals:?}");
    assert!(
        truncate(guest.mem.file()).is_err(),
        "sealed guest memory shrank"
    );
    guest.write(0, &[1]);
    drop(conn);
    assert!(daemon.has_exited().is_none());
    daemon.stop();
}
