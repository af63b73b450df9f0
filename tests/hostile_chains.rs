//! A hostile frontend's descriptor chains against the real daemon: a table of bad chains, each
//! with the exact answer it must get, and random chains by the thousand.
//!
//! The frontend (tests/support/frontend.rs) writes the descriptor table, avail ring and
//! requests by hand into guest memory that is filled with a canary and shadowed, so after every
//! request the test checks that the daemon wrote exactly what it should (the status byte, the
//! read data, the used ring) and nothing else. The queue must keep working after each bad
//! chain, and a second export of the same daemon is driven by a libblkio client for the whole
//! test and must see no error (tests/support/hostile.rs).
mod support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::daemon::*;
use support::frontend::*;
use support::hostile::*;
use support::rng::XorShift;

// ---------------------------------------------------------------------------------------------
// Hostile chains
// ---------------------------------------------------------------------------------------------

/// What a bad chain must get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Returned with used len 0, nothing written.
    Dropped,
    /// This status byte at STATUS_GPA, used len 1.
    Status(u8),
}

struct Case {
    name: &'static str,
    /// Extra guest memory to write first: (gpa, bytes).
    setup: Vec<(u64, Vec<u8>)>,
    chain: Vec<D>,
    expect: Expect,
}

fn cases() -> Vec<Case> {
    let n = VRING_F_NEXT;
    let w = VRING_F_WRITE;
    let read_hdr = (HDR_GPA, header(T_IN, 8));
    let mut v = vec![
        Case {
            name: "descriptor loop (0 -> 1 -> 2 -> 0)",
            setup: vec![read_hdr.clone()],
            chain: vec![
                hdr_desc(),
                d(DATA_GPA, 512, w | n, 2),
                d(STATUS_GPA, 1, w | n, 0),
            ],
            expect: Expect::Dropped,
        },
        Case {
            name: "descriptor points at itself",
            setup: vec![read_hdr.clone()],
            chain: vec![d(HDR_GPA, 16, n, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "next index past the queue size",
            setup: vec![read_hdr.clone()],
            chain: vec![d(HDR_GPA, 16, n, 60_000)],
            expect: Expect::Dropped,
        },
        Case {
            name: "indirect table outside guest memory (in the hole)",
            setup: vec![],
            chain: vec![d(HOLE, 48, VRING_F_INDIRECT, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "indirect table past the end of guest memory",
            setup: vec![],
            chain: vec![d(0xffff_ffff_ffff_fff0, 48, VRING_F_INDIRECT, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "indirect table length not a multiple of 16",
            setup: vec![],
            chain: vec![d(INDIRECT_GPA, 40, VRING_F_INDIRECT, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "nested indirect table",
            setup: vec![
                read_hdr.clone(),
                (
                    INDIRECT_GPA,
                    desc_bytes(&[
                        d(HDR_GPA, 16, n, 1),
                        d(INDIRECT2_GPA, 32, VRING_F_INDIRECT | n, 2),
                        d(STATUS_GPA, 1, w, 0),
                    ]),
                ),
                (
                    INDIRECT2_GPA,
                    desc_bytes(&[d(DATA_GPA, 512, w | n, 1), d(STATUS_GPA, 1, w, 0)]),
                ),
            ],
            chain: vec![d(INDIRECT_GPA, 48, VRING_F_INDIRECT, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "indirect table with a loop",
            setup: vec![
                read_hdr.clone(),
                (
                    INDIRECT_GPA,
                    desc_bytes(&[d(HDR_GPA, 16, n, 1), d(DATA_GPA, 512, w | n, 0)]),
                ),
            ],
            chain: vec![d(INDIRECT_GPA, 32, VRING_F_INDIRECT, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "chain longer than the queue size and seg_max (70-entry indirect table)",
            setup: vec![
                read_hdr.clone(),
                (INDIRECT_GPA, {
                    let mut t = vec![d(HDR_GPA, 16, n, 1)];
                    for i in 1..69u16 {
                        t.push(d(DATA_GPA + 512 * u64::from(i), 512, w | n, i + 1));
                    }
                    t.push(d(STATUS_GPA, 1, w, 0));
                    desc_bytes(&t)
                }),
            ],
            chain: vec![d(INDIRECT_GPA, 70 * 16, VRING_F_INDIRECT, 0)],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "header outside guest memory (in the hole)",
            setup: vec![],
            chain: vec![d(HOLE, 16, n, 1), d(DATA_GPA, 512, w | n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "header shorter than 16 bytes",
            setup: vec![read_hdr.clone()],
            chain: vec![d(HDR_GPA, 8, n, 1), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "header device-writable",
            setup: vec![read_hdr.clone()],
            chain: vec![d(HDR_GPA, 16, w | n, 1), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "status descriptor read-only",
            setup: vec![read_hdr.clone()],
            chain: vec![
                hdr_desc(),
                d(DATA_GPA, 512, w | n, 2),
                d(STATUS_GPA, 1, 0, 0),
            ],
            expect: Expect::Dropped,
        },
        Case {
            name: "status descriptor of length 0",
            setup: vec![read_hdr.clone()],
            chain: vec![
                hdr_desc(),
                d(DATA_GPA, 512, w | n, 2),
                d(STATUS_GPA, 0, w, 0),
            ],
            expect: Expect::Dropped,
        },
        Case {
            name: "status byte outside guest memory (in the hole)",
            setup: vec![read_hdr.clone()],
            chain: vec![hdr_desc(), d(DATA_GPA, 512, w | n, 2), d(HOLE, 1, w, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "status byte address wraps past 2^64",
            setup: vec![read_hdr.clone()],
            chain: vec![hdr_desc(), d(u64::MAX, 2, w, 0)],
            expect: Expect::Dropped,
        },
        Case {
            name: "read into a buffer in the hole",
            setup: vec![read_hdr.clone()],
            chain: vec![hdr_desc(), d(HOLE, 4096, w | n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "read into a buffer that runs from region A into the hole",
            setup: vec![read_hdr.clone()],
            chain: vec![
                hdr_desc(),
                d(0x10_0000 - 4096, 8192, w | n, 2),
                status_desc(),
            ],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "read into a second buffer past the end of guest memory",
            setup: vec![read_hdr.clone()],
            chain: vec![
                hdr_desc(),
                d(DATA_GPA, 4096, w | n, 2),
                d(REGION_B_GPA + MIB - 512, 1024, w | n, 3),
                status_desc(),
            ],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "write from a buffer in the hole",
            setup: vec![(HDR_GPA, header(T_OUT, 8))],
            chain: vec![hdr_desc(), d(HOLE, 4096, n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "read with a buffer address that wraps past 2^64",
            setup: vec![read_hdr.clone()],
            chain: vec![hdr_desc(), d(u64::MAX - 511, 1024, w | n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "sector past the capacity",
            setup: vec![(HDR_GPA, header(T_IN, IMG_SIZE / 512 - 1))],
            chain: vec![hdr_desc(), d(DATA_GPA, 1024, w | n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "sector u64::MAX (offset overflows)",
            setup: vec![(HDR_GPA, header(T_OUT, u64::MAX))],
            chain: vec![hdr_desc(), d(DATA_GPA, 512, n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "unaligned length (write of 511 bytes)",
            setup: vec![(HDR_GPA, header(T_OUT, 0))],
            chain: vec![hdr_desc(), d(DATA_GPA, 511, n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "read with a device-readable data buffer",
            setup: vec![read_hdr.clone()],
            chain: vec![hdr_desc(), d(DATA_GPA, 512, n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "unknown request type 0xdead",
            setup: vec![(HDR_GPA, header(0xdead, 0))],
            chain: vec![hdr_desc(), d(DATA_GPA, 512, w | n, 2), status_desc()],
            expect: Expect::Status(S_UNSUPP),
        },
        Case {
            name: "two discard segments",
            setup: vec![
                (HDR_GPA, header(T_DISCARD, 0)),
                (
                    DATA_GPA,
                    [dwz_segment(0, 8, 0), dwz_segment(64, 8, 0)].concat(),
                ),
            ],
            chain: vec![hdr_desc(), d(DATA_GPA, 32, n, 2), status_desc()],
            expect: Expect::Status(S_UNSUPP),
        },
        Case {
            name: "discard with reserved flag bits",
            setup: vec![
                (HDR_GPA, header(T_DISCARD, 0)),
                (DATA_GPA, dwz_segment(0, 8, 1)),
            ],
            chain: vec![hdr_desc(), d(DATA_GPA, 16, n, 2), status_desc()],
            expect: Expect::Status(S_UNSUPP),
        },
        Case {
            name: "write-zeroes with reserved flag bits",
            setup: vec![
                (HDR_GPA, header(T_WRITE_ZEROES, 0)),
                (DATA_GPA, dwz_segment(0, 8, 0x8000_0002)),
            ],
            chain: vec![hdr_desc(), d(DATA_GPA, 16, n, 2), status_desc()],
            expect: Expect::Status(S_UNSUPP),
        },
        Case {
            name: "discard segment past the capacity",
            setup: vec![
                (HDR_GPA, header(T_DISCARD, 0)),
                (DATA_GPA, dwz_segment(IMG_SIZE / 512 - 4, 8, 0)),
            ],
            chain: vec![hdr_desc(), d(DATA_GPA, 16, n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "discard segment in the hole",
            setup: vec![(HDR_GPA, header(T_DISCARD, 0))],
            chain: vec![hdr_desc(), d(HOLE, 16, n, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
        Case {
            name: "GET_ID without a writable buffer",
            setup: vec![(HDR_GPA, header(T_GET_ID, 0))],
            chain: vec![hdr_desc(), status_desc()],
            expect: Expect::Status(S_IOERR),
        },
    ];
    // A flush with a data buffer is still a flush: not a hostile case, but keep it honest.
    v.push(Case {
        name: "flush (control: must succeed)",
        setup: vec![(HDR_GPA, header(T_FLUSH, 0))],
        chain: vec![hdr_desc(), status_desc()],
        expect: Expect::Status(S_OK),
    });
    v
}

/// Runs one case on queue 0 of `s`; returns what was observed, or an error.
fn run_case(s: &mut Session, c: &Case) -> Result<String, String> {
    for (gpa, bytes) in &c.setup {
        s.guest.write(*gpa, bytes);
    }
    s.guest.write(STATUS_GPA, &[0xee]);
    let a = s.submit(0, &c.chain);
    let observed = match a {
        Answer::Used(head, len) => {
            let st = s.guest.read(STATUS_GPA, 1)[0];
            format!("used(head {head}, len {len}), status byte {st:#04x}")
        }
        Answer::Nothing => "no used entry".to_string(),
    };
    match c.expect {
        Expect::Dropped => {
            if a != Answer::Used(0, 0) {
                return Err(format!("{observed}; expected used(head 0, len 0)"));
            }
        }
        Expect::Status(st) => {
            if a != Answer::Used(0, 1) {
                return Err(format!("{observed}; expected used(head 0, len 1)"));
            }
            s.guest.expect(STATUS_GPA, &[st]);
        }
    }
    s.check_memory().map_err(|e| format!("{observed}; {e}"))?;
    Ok(observed)
}

#[test]
fn hostile_chains_get_exact_answers_and_the_queue_keeps_working() {
    let dir = TestDir::new();
    let (mut daemon, sock, ro_sock, by_sock, img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);
    let expected_img = pattern_bytes(IMG_SIZE, 0, Some(IMG_SEED));

    let mut s = Session::open(&sock, 16, Some(IMG_SEED));
    s.good_read(0).expect("first good read");
    let mut failures = Vec::new();
    for c in cases() {
        let r = run_case(&mut s, &c);
        assert_alive(&mut daemon, c.name);
        let after = s.good_read(0);
        match (&r, &after) {
            (Ok(obs), Ok(())) => eprintln!("ok   {}: {obs}; next good read ok", c.name),
            _ => {
                let line = format!("FAIL {}: {r:?}; next good read: {after:?}", c.name);
                eprintln!("{line}");
                failures.push(line);
                if after.is_err() {
                    // The queue is unusable; go on with a fresh session.
                    s = Session::open(&sock, 16, Some(IMG_SEED));
                }
            }
        }
    }

    // A head index the ring does not have: no used entry can name it; the next request works.
    s.guest.write(HDR_GPA, &header(T_IN, 8));
    s.post_raw(0, 5000, 0);
    let a = s.wait_used(0, SILENCE);
    let after = s.good_read(0);
    eprintln!("head index 5000 (queue size 16): {a:?}; next good read: {after:?}");
    if a != Answer::Nothing || after.is_err() {
        failures.push(format!("head 5000: {a:?}, then {after:?}"));
    }

    // A write on a read-only export.
    let mut ro = Session::open(&ro_sock, 16, Some(IMG_SEED));
    let c = Case {
        name: "write on a read-only export",
        setup: vec![(HDR_GPA, header(T_OUT, 0)), (DATA_GPA, vec![0x77; 4096])],
        chain: vec![
            hdr_desc(),
            d(DATA_GPA, 4096, VRING_F_NEXT, 2),
            status_desc(),
        ],
        expect: Expect::Status(S_IOERR),
    };
    let r = run_case(&mut ro, &c);
    let after = ro.good_read(0);
    eprintln!("{}: {r:?}; next good read: {after:?}", c.name);
    if r.is_err() || after.is_err() {
        failures.push(format!("{}: {r:?}, then {after:?}", c.name));
    }
    for discard in [T_DISCARD, T_WRITE_ZEROES] {
        let c = Case {
            name: "discard / write-zeroes on a read-only export",
            setup: vec![
                (HDR_GPA, header(discard, 0)),
                (DATA_GPA, dwz_segment(0, 8, 0)),
            ],
            chain: vec![hdr_desc(), d(DATA_GPA, 16, VRING_F_NEXT, 2), status_desc()],
            expect: Expect::Status(S_IOERR),
        };
        let r = run_case(&mut ro, &c);
        eprintln!("{} (type {discard}): {r:?}", c.name);
        if r.is_err() {
            failures.push(format!("{} (type {discard}): {r:?}", c.name));
        }
    }
    drop(ro);

    // Last: an avail index more than the queue size ahead. The queue stops until it is reset
    // (documented); the daemon stays up and a new connection works.
    s.guest.write(HDR_GPA, &header(T_IN, 8));
    s.write_descs(0, 0, &read_chain(512));
    s.post_raw(0, 0, 100);
    let a = s.wait_used(0, SILENCE);
    eprintln!("avail idx 101 ahead of a 16-entry ring: {a:?}");
    if a != Answer::Nothing {
        failures.push(format!("avail idx too far ahead answered {a:?}"));
    }
    if let Err(e) = s.check_memory() {
        failures.push(format!("avail idx too far ahead: {e}"));
    }
    drop(s);
    assert_alive(&mut daemon, "the broken avail index");
    let mut s = Session::open(&sock, 16, Some(IMG_SEED));
    if let Err(e) = s.good_read(0) {
        failures.push(format!("fresh session after the broken ring: {e}"));
    }
    drop(s);
    if let Err(e) = fresh_client_works(&sock) {
        failures.push(format!("libblkio client after everything: {e}"));
    }

    let ops = by.finish();
    eprintln!("bystander export served {ops} requests meanwhile");
    assert_alive(&mut daemon, "everything");
    daemon.terminate();
    assert_file_eq(
        &img,
        &expected_img,
        "hostile export's image (nothing may be written)",
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Random hostile chains against the live daemon
// ---------------------------------------------------------------------------------------------

/// Where random device-writable buffers may point: the daemon may write only there (and to the
/// used ring), so everything else in guest memory must keep its canary.
const SCRATCH_GPA: u64 = 0x8_0000;
const SCRATCH_LEN: u64 = 0x4_0000;
/// A second writable area: the last page of guest memory, for buffers that run off its end.
const TAIL_GPA: u64 = REGION_B_GPA + MIB - 0x1000;
/// Where random headers and device-readable buffers point.
const HDRS_GPA: u64 = 0x1_0000;
const HDRS_LEN: u64 = 0x1000;
/// Indirect tables of random chains (one 16-entry table per chain slot).
const TABLES_GPA: u64 = 0x4_0000;

/// Random descriptors for one chain (or indirect table) whose entries sit at `first..`.
/// Device-writable buffers lie in the scratch area, the last page of memory (running off its
/// end), the hole, or past 2^64 - 256; readable ones anywhere. `depth` > 0 makes a table.
fn random_descs(rng: &mut XorShift, s: &mut Session, c: u16, first: u16, depth: u32) -> Vec<D> {
    let n = 1 + rng.below(6) as u16;
    // A header: mostly a real type with a sector near or past the capacity.
    let hdr_at = HDRS_GPA + 32 * rng.below(HDRS_LEN / 32);
    let t = rng.pick(&[
        T_IN,
        T_IN,
        T_OUT,
        T_OUT,
        T_FLUSH,
        T_GET_ID,
        T_DISCARD,
        T_WRITE_ZEROES,
        3,
        0xffff_ffff,
    ]);
    let cap = IMG_SIZE / 512;
    let any = rng.below(cap);
    let sector = rng.pick(&[0, 1, cap - 8, cap - 1, cap, u64::MAX, any]);
    let mut h = header(t, sector);
    let seg_sector = rng.pick(&[0, cap - 8, u64::MAX]);
    h.extend_from_slice(&dwz_segment(
        seg_sector,
        rng.pick(&[0, 8, u32::MAX]),
        rng.pick(&[0, 1, 2]),
    ));
    s.guest.write(hdr_at, &h);
    let mut ds = Vec::new();
    for i in 0..n {
        let write = (i > 0 && rng.below(3) != 0) || (i == n - 1 && rng.below(8) != 0);
        let len = rng.pick(&[
            0u32,
            1,
            8,
            16,
            17,
            32,
            511,
            512,
            513,
            4096,
            8192,
            65536,
            0xffff_fff0,
        ]);
        let (addr, len) = if i == 0 && !write && rng.below(8) != 0 {
            (hdr_at, len.min(32))
        } else if write {
            match rng.below(8) {
                0 => (HOLE + rng.below(0x1000), len),
                1 => (u64::MAX - rng.below(0x100), len),
                2 => (TAIL_GPA + rng.below(0x1000), len), // may run off the end of memory
                _ => {
                    let a = SCRATCH_GPA + 512 * rng.below(SCRATCH_LEN / 512);
                    (a, len.min((SCRATCH_GPA + SCRATCH_LEN - a) as u32))
                }
            }
        } else {
            match rng.below(6) {
                0 => (HOLE, len),
                1 => (REGION_B_GPA + MIB - rng.below(64), len),
                _ => (HDRS_GPA + rng.below(HDRS_LEN), len),
            }
        };
        let mut flags = if write { VRING_F_WRITE } else { 0 };
        if i + 1 < n {
            flags |= VRING_F_NEXT;
        }
        if rng.below(8) == 0 {
            flags |= 0x8000; // a reserved bit
        }
        let next = if rng.below(16) == 0 {
            rng.below(70) as u16 // anywhere, back into the chain, or past the table
        } else {
            first + i + 1
        };
        ds.push(d(addr, len, flags, next));
    }
    // Sometimes the chain is an indirect table instead (and, once in a while, a table refers to
    // another one, which is not allowed).
    if depth < 2 && rng.below(6) == 0 {
        let table = TABLES_GPA + 0x400 * u64::from(c) + 0x100 * u64::from(depth);
        let inner = random_descs(rng, s, c, 0, depth + 1);
        s.guest.write(table, &desc_bytes(&inner));
        let len = match rng.below(8) {
            0 => 16 * inner.len() as u32 + 8, // not a multiple of 16
            1 => 0,
            _ => 16 * inner.len() as u32,
        };
        let at = rng.below(ds.len() as u64) as usize;
        ds[at] = d(
            table,
            len,
            VRING_F_INDIRECT | (ds[at].flags & VRING_F_NEXT),
            ds[at].next,
        );
    }
    ds
}

/// Writes a random chain at table slots `first..` (chain slot `c`).
fn random_chain(rng: &mut XorShift, s: &mut Session, c: u16) {
    let first = 8 * c;
    let ds = random_descs(rng, s, c, first, 0);
    s.write_descs(0, first, &ds);
}

#[test]
fn random_hostile_chains_never_hurt_the_daemon() {
    let seed: u64 = env_or("MQBLK_HOSTILE_SEED", 0x6d71_626c_6b21);
    let batches: usize = env_or("MQBLK_HOSTILE_BATCHES", 1000);
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);
    let mut rng = XorShift::new(seed);
    let mut s = Session::open(&sock, 64, None);
    let (mut answered, mut dropped, mut statuses) = (0u64, 0u64, [0u64; 256]);
    for b in 0..batches {
        // Up to 8 chains per batch, at table slots 8c.., posted together.
        let chains = 1 + rng.below(8) as u16;
        for c in 0..chains {
            random_chain(&mut rng, &mut s, c);
        }
        let avail = s.rings[0].avail;
        let start = s.rings[0].avail_idx;
        for c in 0..chains {
            let slot = avail + 4 + 2 * u64::from(start.wrapping_add(c) % 64);
            s.guest.write(slot, &(8 * c).to_le_bytes());
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        let new_idx = start.wrapping_add(chains);
        s.guest.write(avail + 2, &new_idx.to_le_bytes());
        s.rings[0].avail_idx = new_idx;
        s.rings[0].kick.write(1).unwrap();
        let t_batch = Instant::now();
        let mut heads = Vec::new();
        for _ in 0..chains {
            match s.wait_used(0, ANSWER_TIMEOUT) {
                Answer::Used(h, len) => heads.push((h, len)),
                Answer::Nothing => {
                    assert_alive(&mut daemon, &format!("batch {b} (seed {seed})"));
                    panic!(
                        "batch {b} (seed {seed}): {} of {chains} chains unanswered",
                        chains as usize - heads.len()
                    );
                }
            }
        }
        if std::env::var_os("HOSTILE_SLOW").is_some()
            && t_batch.elapsed() > Duration::from_millis(30)
        {
            eprintln!(
                "batch {b}: {chains} chains took {:?}: {heads:?}",
                t_batch.elapsed()
            );
        }
        let mut ids: Vec<u32> = heads.iter().map(|&(h, _)| h).collect();
        ids.sort_unstable();
        let want: Vec<u32> = (0..u32::from(chains)).map(|c| 8 * c).collect();
        assert_eq!(
            ids, want,
            "batch {b} (seed {seed}): used entries name other heads"
        );
        for &(h, len) in &heads {
            answered += 1;
            if len == 0 {
                dropped += 1;
            } else {
                // The status byte is the last byte of the chain's last descriptor.
                let last = last_desc(&mut s, h as u16);
                if let Some(at) = last.addr.checked_add(u64::from(last.len).saturating_sub(1)) {
                    if (SCRATCH_GPA..SCRATCH_GPA + SCRATCH_LEN).contains(&at) {
                        statuses[s.guest.read(at, 1)[0] as usize] += 1;
                    }
                }
            }
        }
        // Nothing outside the writable areas and the used ring may have changed.
        let skip = [
            s.rings[0].used_area(),
            (SCRATCH_GPA, SCRATCH_LEN as usize),
            (TAIL_GPA, 0x1000),
        ];
        if let Some(e) = s.guest.diff(&skip) {
            panic!("batch {b} (seed {seed}): {e}");
        }
        for (at, len) in [(SCRATCH_GPA, SCRATCH_LEN as usize), (TAIL_GPA, 0x1000)] {
            let now = s.guest.read(at, len);
            s.guest.expect(at, &now);
        }
        if b % 50 == 49 {
            assert_alive(&mut daemon, &format!("batch {b} (seed {seed})"));
        }
    }
    eprintln!(
        "seed {seed}: {answered} random chains answered, {dropped} dropped (used len 0); status bytes OK {} IOERR {} UNSUPP {}",
        statuses[0], statuses[1], statuses[2]
    );
    // The queue still serves a good request (the image may have been written: its data is not
    // checked, only the answer; session opened with no image seed).
    s.good_read(0).expect("a good read after the random chains");
    drop(s);
    fresh_client_works(&sock).expect("a new client after the random chains");
    by.finish();
    daemon.terminate();
}

/// The last descriptor of the (direct) chain at `head`, following NEXT at most 8 times.
fn last_desc(s: &mut Session, head: u16) -> D {
    let mut i = head;
    for _ in 0..8 {
        let b = s.guest.read(s.rings[0].desc + 16 * u64::from(i), 16);
        let dd = D {
            addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            flags: u16::from_le_bytes(b[12..14].try_into().unwrap()),
            next: u16::from_le_bytes(b[14..16].try_into().unwrap()),
        };
        if dd.flags & VRING_F_NEXT == 0 || dd.next >= 64 {
            return dd;
        }
        i = dd.next;
    }
    D {
        addr: u64::MAX,
        len: 0,
        flags: 0,
        next: 0,
    }
}
