//! Guest memory and rings a hostile frontend describes so that serving them could take the whole
//! daemon down: a memory region larger than its file (SIGBUS), ring addresses misaligned in
//! guest-physical space, a forged in-flight region. The daemon refuses or survives each, writes
//! no guest memory it must not, and its other export, driven by a libblkio client throughout
//! (tests/support/hostile.rs), sees no error.
mod support;

use std::os::fd::AsRawFd;

use support::daemon::*;
use support::frontend::*;
use support::hostile::*;
use support::mem::memfd;
use vhost::vhost_user::message::{VhostUserInflight, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vmm_sys_util::eventfd::EventFd;

/// A region that claims more memory than its file holds: touching the part past the end of
/// the file raises SIGBUS in whoever maps it. The daemon must refuse the table (or at least
/// survive), and its other exports must keep serving.
#[test]
fn mem_region_larger_than_its_file_does_not_kill_the_daemon() {
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);

    let (mut c, _) = Session::negotiate(&sock).unwrap();
    let mut g = Guest::new();
    // Shrink the memfd to 64 KiB but keep claiming a full 1 MiB region. A well-formed message:
    // the Frontend sends it.
    // Shrinking the guest memfd is the hostile act here.
    rustix::fs::ftruncate(g.mem.file(), 64 * 1024).unwrap();
    g.regions = vec![(0, MIB, 0)];
    let r = answer(c.fe.set_mem_table(&g.mem_table(&[])));
    eprintln!("SET_MEM_TABLE of a 1 MiB region over a 64 KiB memfd: {r:?}");
    if r.is_ok() {
        // Rings past the end of the file: the first access is the worker reading avail->idx.
        let (desc, avail, used) = (0x8_0000u64, 0x8_1000u64, 0x8_2000u64);
        let base = g.base();
        let kick = EventFd::new(libc::EFD_CLOEXEC).unwrap();
        let ring = c
            .start_vring(0, 16, (base + desc, base + used, base + avail), None, &kick)
            .map(|()| kick.write(1).unwrap());
        eprintln!("vring past the end of the file: {ring:?}");
        // Time for the I/O thread to touch the ring (and fault, if it would): it may as well
        // refuse it silently, so there is no answer to wait for.
        std::thread::sleep(SILENCE);
    }
    drop(c);
    // A new client is served only once the daemon has dropped the bad connection.
    let client = fresh_client_works(&sock);
    assert_alive(&mut daemon, "a memory region larger than its file");
    client.expect("a new client after the bad region");
    by.finish();
    daemon.terminate();
}

/// Ring addresses that break the virtio alignment rules (descriptor table 16, avail 2, used
/// ring 4). The vhost crate checks the alignment of the frontend's *user* addresses, but a
/// frontend can declare a region whose user address is skewed against its guest-physical one,
/// so aligned user addresses translate to misaligned guest addresses. The daemon must refuse
/// such a ring, not serve it from somewhere else: virtio-queue's setters ignore a misaligned
/// address and keep the default, GPA 0.
#[test]
fn misaligned_ring_addresses_are_refused() {
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);

    let mut failures = Vec::new();
    // (what, user-address skew of region A, of region B, desc gpa, used gpa)
    let scenarios = [
        (
            "used ring at GPA 0x200002",
            0u64,
            2u64,
            0x1000u64,
            REGION_B_GPA + 2,
        ),
        // Region A declared 8 bytes below its real user address (not above: its user range
        // would then overlap region B's).
        (
            "descriptor table at GPA 0x1008",
            0u64.wrapping_sub(8),
            0,
            0x1008,
            REGION_B_GPA,
        ),
    ];
    for (what, skew_a, skew_b, desc, used) in scenarios {
        let (mut c, _) = Session::negotiate(&sock).unwrap();
        let mut g = Guest::new();
        answer(c.fe.set_mem_table(&g.mem_table(&[skew_a, skew_b]))).expect("SET_MEM_TABLE");
        let ua = |g: &Guest, gpa: u64| {
            let skew = if gpa >= REGION_B_GPA { skew_b } else { skew_a };
            g.user_addr(gpa).wrapping_add(skew)
        };
        let avail = 0x2000u64;
        g.write(desc, &[0u8; 256]);
        g.write(avail, &[0u8; 38]);
        g.write(used, &[0u8; 134]);
        g.write(HDR_GPA, &header(T_IN, 8));
        g.write(desc, &desc_bytes(&read_chain(512)));
        let kick = EventFd::new(libc::EFD_CLOEXEC).unwrap();
        let addrs = (ua(&g, desc), ua(&g, used), ua(&g, avail));
        let setup = c.start_vring(0, 16, addrs, None, &kick).map(|()| kick);
        let (obs, served) = match &setup {
            Ok(kick) => {
                g.write(avail + 4, &0u16.to_le_bytes());
                g.write(avail + 2, &1u16.to_le_bytes());
                kick.write(1).unwrap();
                std::thread::sleep(SILENCE);
                let used_idx = g.read_u16(used + 2);
                let changed = g.diff(&[(used, 134)]);
                let served = used_idx != 0 || changed.is_some();
                (
                    format!(
                        "setup acked; used idx at the given address {used_idx}; elsewhere: {}",
                        changed.unwrap_or_else(|| "nothing changed".into())
                    ),
                    served,
                )
            }
            Err(e) => (format!("refused: {e}"), false),
        };
        eprintln!("{what}: {obs}");
        if served {
            failures.push(format!("{what}: the ring was served: {obs}"));
        }
        drop(c);
        assert_alive(&mut daemon, what);
        if let Err(e) = fresh_client_works(&sock) {
            failures.push(format!("{what}: new client: {e}"));
        }
    }
    by.finish();
    if std::env::var_os("HOSTILE_LOG").is_some() {
        eprintln!("{}", daemon.log());
    }
    daemon.terminate();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A frontend hands over an in-flight region it forged: every head of a 64-entry queue marked
/// in flight (on a 16-entry ring whose descriptors are all zero), a last_batch_head out of
/// range and a used_idx that disagrees with the ring. The daemon resubmits what it can, answers
/// nothing it cannot, writes nothing outside the used ring, and keeps running.
#[test]
fn forged_inflight_region_is_survived() {
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);

    let (mut c, _) =
        Session::negotiate_with(&sock, VhostUserProtocolFeatures::INFLIGHT_SHMFD).unwrap();
    // Per queue: u64 features; u16 version, desc_num, last_batch_head, used_idx; then
    // desc[queue_size] { u8 inflight; u8 pad[5]; u16 next; u64 counter }, 64-byte aligned.
    let qs = 64u16;
    let size = (16 + 16 * u64::from(qs)).next_multiple_of(64);
    let mut region = vec![0u8; size as usize];
    region[8..10].copy_from_slice(&1u16.to_le_bytes()); // version
    region[10..12].copy_from_slice(&qs.to_le_bytes());
    region[12..14].copy_from_slice(&0xffffu16.to_le_bytes()); // last_batch_head
    region[14..16].copy_from_slice(&5u16.to_le_bytes()); // used_idx
    for h in 0..qs as usize {
        let o = 16 + 16 * h;
        region[o] = 1;
        region[o + 6..o + 8].copy_from_slice(&0xffffu16.to_le_bytes());
        region[o + 8..o + 16].copy_from_slice(&((h as u64 * 7919) % 1000).to_le_bytes());
    }
    let f = memfd("forged-inflight", size);
    std::os::unix::fs::FileExt::write_all_at(&f, &region, 0).unwrap();
    // A well-formed message (only the region's content is forged): the Frontend sends it.
    let r = answer(c.fe.set_inflight_fd(&VhostUserInflight::new(size, 0, 1, qs), f.as_raw_fd()));
    eprintln!("SET_INFLIGHT_FD of a forged region: {r:?}");
    let mut g = Guest::new();
    Session::set_mem_table(&c, &g).expect("SET_MEM_TABLE");
    let ring = Session::setup_ring(&mut c, &mut g, 0, 16);
    eprintln!(
        "vring setup with the forged region: {:?}",
        ring.as_ref().map(|_| ())
    );
    std::thread::sleep(SILENCE);
    assert_alive(&mut daemon, "a forged in-flight region");
    let used = ring.as_ref().map(|r| r.used_area());
    let skip: Vec<(u64, usize)> = used.iter().copied().collect();
    let changed = g.diff(&skip);
    let used_idx = ring.as_ref().map(|r| g.read_u16(r.used + 2)).ok();
    eprintln!("after the resubmission: used idx {used_idx:?}; other changes: {changed:?}");
    assert!(
        changed.is_none(),
        "guest memory changed outside the used ring: {changed:?}"
    );
    drop(ring);
    drop(c);
    fresh_client_works(&sock).expect("a new client after the forged region");
    by.finish();
    daemon.terminate();
}
