//! A hostile frontend against the real daemon.
//!
//! The frontend (tests/support/frontend.rs) sets the device up with the vhost crate's Frontend
//! and sends what no well-behaved library would (garbage, out-of-range indices, sizes and
//! addresses) as raw bytes on the same socket. It writes the descriptor table, avail ring and
//! requests by hand into guest memory that is filled with a canary and shadowed, so after every
//! request the test checks that the daemon wrote exactly what it should (the status byte, the
//! read data, the used ring) and nothing else.
//!
//! Each bad input must get its exact answer, and the queue (or, for protocol errors, the next
//! connection) must keep working; a second export in the same daemon is driven by a libblkio
//! client for the whole test and must see no error.
mod support;

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mqblk_client::{fill_pattern, Client, ConnectOptions};
use support::daemon::*;
use support::frontend::*;
use support::mem::memfd;
use support::rng::XorShift;
use vhost::vhost_user::message::{
    FrontendReq, VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserInflight,
    VhostUserProtocolFeatures,
};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vmm_sys_util::eventfd::EventFd;

// ---------------------------------------------------------------------------------------------
// A second export, served throughout
// ---------------------------------------------------------------------------------------------

/// A libblkio client writing and verifying data on another export until stopped.
struct Bystander {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<(u64, Vec<String>)>>,
}

impl Bystander {
    fn start(socket: PathBuf, size: u64) -> Bystander {
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut errors = Vec::new();
            let mut c = match Client::connect(&socket, 1) {
                Ok(c) => c,
                Err(e) => return (0, vec![format!("connect: {e:#}")]),
            };
            let mut ops = 0u64;
            let mut buf = vec![0u8; 4096];
            let mut i = 0u64;
            while !s2.load(Ordering::Relaxed) && errors.len() < 5 {
                let off = (i * 4096 * 7) % size;
                fill_pattern(&mut buf, off, 0xb0b0 + i);
                if let Err(e) = c.write(0, off, &buf) {
                    errors.push(format!("write at {off}: {e}"));
                }
                match c.read_vec(0, off, 4096) {
                    Ok(v) if v == buf => {}
                    Ok(_) => errors.push(format!("read at {off}: wrong data")),
                    Err(e) => errors.push(format!("read at {off}: {e}")),
                }
                ops += 2;
                i += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (ops, errors)
        });
        Bystander {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops it and asserts that every request succeeded; returns the request count.
    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let (ops, errors) = self
            .thread
            .take()
            .unwrap()
            .join()
            .expect("bystander panicked");
        assert!(errors.is_empty(), "the other export failed: {errors:?}");
        assert!(ops > 0, "the other export served nothing");
        ops
    }
}

impl Drop for Bystander {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn assert_alive(daemon: &mut Daemon, after: &str) {
    if let Some(st) = daemon.has_exited() {
        panic!(
            "daemon died after {after}: {st}\n--- daemon log ---\n{}",
            daemon.log()
        );
    }
}

/// A fresh libblkio client can connect to `socket` and read.
fn fresh_client_works(socket: &Path) -> Result<(), String> {
    // The hostile export's queue-size is 64; libblkio asks for 256 unless told.
    let mut opts = ConnectOptions::new(1);
    opts.queue_size = Some(64);
    let mut c = connect_retry(socket, &opts)?;
    c.set_timeout(ANSWER_TIMEOUT);
    c.read_vec(0, 0, 4096)
        .map(|_| ())
        .map_err(|e| format!("read: {e}"))
}

/// Connects a libblkio client, retrying for up to [`RECONNECT_GRACE`] while the daemon refuses
/// it as a second frontend: a previous frontend's close can reach the daemon late when another
/// test thread forks a process that holds a copy of that socket until its exec.
fn connect_retry(socket: &Path, opts: &ConnectOptions) -> Result<Client, String> {
    let deadline = Instant::now() + RECONNECT_GRACE;
    loop {
        match Client::connect_with(socket, opts) {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("connect: {e:#}")),
        }
    }
}

const IMG_SIZE: u64 = 8 * MIB;
const IMG_SEED: u64 = 0x5eed;

/// The daemon of these tests: `hostile` (writable, 2 queues of up to 64), `ro` (read-only) and
/// `bystander` (served to a libblkio client throughout).
fn start_daemon(dir: &TestDir) -> (Daemon, PathBuf, PathBuf, PathBuf, PathBuf) {
    let img = dir.image("hostile.img", IMG_SIZE, Some(IMG_SEED));
    let ro_img = dir.image("ro.img", IMG_SIZE, Some(IMG_SEED));
    let by_img = dir.image("bystander.img", IMG_SIZE, None);
    let (a, b, c) = (
        dir.join("hostile.sock"),
        dir.join("ro.sock"),
        dir.join("bystander.sock"),
    );
    let daemon = Daemon::start(
        dir,
        &[
            Export::file(&a, &img).queues(2).set("queue-size", "64"),
            Export::file(&b, &ro_img).readonly(),
            Export::file(&c, &by_img),
        ],
    );
    (daemon, a, b, c, img)
}

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

fn hdr_desc() -> D {
    d(HDR_GPA, 16, VRING_F_NEXT, 1)
}

fn status_desc() -> D {
    d(STATUS_GPA, 1, VRING_F_WRITE, 0)
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
    s.write_descs(
        0,
        0,
        &[
            hdr_desc(),
            d(DATA_GPA, 512, VRING_F_WRITE | VRING_F_NEXT, 2),
            status_desc(),
        ],
    );
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
// Malformed vhost-user messages
// ---------------------------------------------------------------------------------------------

/// One protocol-level misbehaviour: runs on a fresh connection, returns what the daemon did.
type Misbehaviour = fn(&Path) -> String;

/// Whether the daemon closes the connection soon after a bad message, in words.
fn closed_or_open(conn: &Conn) -> &'static str {
    if conn.closed_by_peer(Duration::from_millis(500)) {
        "closed by the daemon"
    } else {
        "still open"
    }
}

/// Reports how the connection ended after a bad message whose answer may be a NACK.
fn outcome(conn: &Conn, r: Result<(), String>) -> String {
    let r = match r {
        Ok(()) => "ACK".to_string(),
        Err(e) => e,
    };
    format!("{r}; connection {}", closed_or_open(conn))
}

// Each misbehaviour sends the message it is about as raw bytes (Conn::send and friends), also
// where the vhost crate's Frontend could send it: the Frontend checks arguments before sending
// (a memory table is not empty, no region has size 0, a kick comes with its fd, a vring size
// fits in a u16, vring indices stay below what GET_QUEUE_NUM said, in-flight sizes are not 0)
// and reads replies its own way, and it is the daemon's checks that are under test. What leads
// up to that message is well-formed and goes through the Frontend.

fn mis_garbage(p: &Path) -> String {
    let c = Conn::connect(p);
    let junk: Vec<u8> = (0..256u32).map(|i| (i * 151 + 7) as u8).collect();
    c.send_raw(&junk, &[]).unwrap();
    outcome(&c, Err("garbage sent".into()))
}

fn mis_huge_size(p: &Path) -> String {
    let c = Conn::connect(p);
    let header = u32s(&[FrontendReq::SET_FEATURES as u32, HDR_VERSION, 0x7fff_ffff]);
    c.send_raw(&header, &[]).unwrap();
    let _ = c.send_raw(&[0u8; 64], &[]);
    outcome(&c, Err("header with size 0x7fffffff sent".into()))
}

fn mis_size_mismatch(p: &Path) -> String {
    // SET_FEATURES with a 4-byte body instead of 8.
    let c = Conn::connect(p);
    let _ = c.fe.get_features();
    c.send(FrontendReq::SET_FEATURES, 0, &[1, 2, 3, 4], &[])
        .unwrap();
    outcome(&c, Err("SET_FEATURES with a 4-byte body sent".into()))
}

fn mis_partial(p: &Path) -> String {
    // A header that promises 40 bytes, 10 of them, then the frontend goes away.
    let c = Conn::connect(p);
    let mut m = u32s(&[FrontendReq::SET_VRING_ADDR as u32, HDR_VERSION, 40]);
    m.extend_from_slice(&[0u8; 10]);
    c.send_raw(&m, &[]).unwrap();
    drop(c);
    "partial message, then closed by the frontend".into()
}

fn mis_unknown_code(p: &Path) -> String {
    let c = Conn::connect(p);
    c.send(
        999u32,
        VhostUserHeaderFlag::NEED_REPLY.bits(),
        &[0u8; 8],
        &[],
    )
    .unwrap();
    outcome(&c, Err("request code 999 sent".into()))
}

fn mis_bad_version(p: &Path) -> String {
    let c = Conn::connect(p);
    c.send_raw(&u32s(&[FrontendReq::GET_FEATURES as u32, 0x2, 0]), &[])
        .unwrap();
    outcome(&c, Err("header version 2 sent".into()))
}

fn mis_unoffered_features(p: &Path) -> String {
    let (c, offered) = Session::negotiate(p).unwrap();
    let features = offered | (1 << 63) | (1 << 55);
    let r = c.send_acked(FrontendReq::SET_FEATURES, &u64s(&[features]), &[]);
    outcome(&c, r)
}

fn with_mem(p: &Path) -> (Conn, Guest) {
    let (c, _) = Session::negotiate(p).unwrap();
    let g = Guest::new();
    Session::set_mem_table(&c, &g).unwrap();
    (c, g)
}

/// SET_VRING_NUM `num` on vring `index`, after the memory table.
fn set_vring_num_raw(p: &Path, index: u32, num: u32) -> String {
    let (c, _g) = with_mem(p);
    let r = c.send_acked(FrontendReq::SET_VRING_NUM, &u32s(&[index, num]), &[]);
    outcome(&c, r)
}

fn mis_vring_num_0(p: &Path) -> String {
    set_vring_num_raw(p, 0, 0)
}

fn mis_vring_num_3(p: &Path) -> String {
    set_vring_num_raw(p, 0, 3)
}

fn mis_vring_num_too_big(p: &Path) -> String {
    // The export's queue-size is 64.
    set_vring_num_raw(p, 0, 128)
}

fn mis_vring_num_65536(p: &Path) -> String {
    set_vring_num_raw(p, 0, 65536)
}

/// A SET_VRING_ADDR body for vring 0: descriptor table, used ring, avail ring.
fn vring_addr_body(desc: u64, used: u64, avail: u64) -> Vec<u8> {
    let mut body = u32s(&[0, 0]);
    body.extend_from_slice(&u64s(&[desc, used, avail, 0]));
    body
}

fn mis_vring_addr_outside(p: &Path) -> String {
    let (c, g) = with_mem(p);
    answer(c.fe.set_vring_num(0, 16)).unwrap();
    // The descriptor table at a user address the mem table does not cover.
    let body = vring_addr_body(0x1000, g.user_addr(0x3000), g.user_addr(0x2000));
    let r = c.send_acked(FrontendReq::SET_VRING_ADDR, &body, &[]);
    outcome(&c, r)
}

fn mis_vring_addr_runs_out(p: &Path) -> String {
    // The used ring starts inside region A but runs past its end into the hole.
    let (mut c, g) = with_mem(p);
    answer(c.fe.set_vring_num(0, 64)).unwrap();
    let body = vring_addr_body(
        g.user_addr(0x1000),
        g.user_addr(0x10_0000 - 64),
        g.user_addr(0x2000),
    );
    let r = c.send_acked(FrontendReq::SET_VRING_ADDR, &body, &[]);
    let kick = EventFd::new(libc::EFD_CLOEXEC).unwrap();
    let r2 = r
        .clone()
        .and_then(|_| answer(c.fe.set_vring_kick(0, &kick)))
        .and_then(|_| answer(c.fe.set_vring_enable(0, true)));
    let _ = kick.write(1);
    format!(
        "SET_VRING_ADDR {r:?}, then kick+enable {r2:?}; {}",
        outcome(&c, Ok(()))
    )
}

fn mis_vring_index(p: &Path) -> String {
    set_vring_num_raw(p, 200, 16)
}

fn mis_queue_num_plus_one(p: &Path) -> String {
    let (mut c, _g) = with_mem(p);
    let n = answer(c.fe.get_queue_num()).unwrap() as u32;
    let r = c.send_acked(FrontendReq::SET_VRING_NUM, &u32s(&[n, 16]), &[]);
    format!(
        "GET_QUEUE_NUM = {n}, SET_VRING_NUM index {n}: {}",
        outcome(&c, r)
    )
}

fn mis_kick_index(p: &Path) -> String {
    let (mut c, _g) = with_mem(p);
    let n = answer(c.fe.get_queue_num()).unwrap();
    let kick = EventFd::new(libc::EFD_CLOEXEC).unwrap();
    let r = c.send_acked(
        FrontendReq::SET_VRING_KICK,
        &u64s(&[n]),
        &[kick.as_raw_fd()],
    );
    format!("SET_VRING_KICK index {n}: {}", outcome(&c, r))
}

fn mis_get_vring_base_index(p: &Path) -> String {
    let (c, _g) = with_mem(p);
    c.send(FrontendReq::GET_VRING_BASE, 0, &u32s(&[77, 0]), &[])
        .unwrap();
    outcome(&c, Err("GET_VRING_BASE index 77 sent".into()))
}

fn mis_kick_without_fd(p: &Path) -> String {
    // Neither an fd nor the "no fd" flag (0x100).
    let (c, _g) = with_mem(p);
    let r = c.send_acked(FrontendReq::SET_VRING_KICK, &u64s(&[0]), &[]);
    outcome(&c, r)
}

fn mis_fds_on_wrong_message(p: &Path) -> String {
    // SET_OWNER with 8 file descriptors attached: they must be refused and closed.
    let c = Conn::connect(p);
    let efds: Vec<EventFd> = (0..8)
        .map(|_| EventFd::new(libc::EFD_CLOEXEC).unwrap())
        .collect();
    let fds: Vec<RawFd> = efds.iter().map(|e| e.as_raw_fd()).collect();
    let _ = c.send(FrontendReq::SET_OWNER, 0, &[], &fds);
    outcome(&c, Err("SET_OWNER with 8 fds sent".into()))
}

/// SET_MEM_TABLE with the regions `regions` gives for the guest memory, as (gpa, size, user
/// address, file offset), each with the guest memory's fd or, if `fds` is given, with that many
/// fds.
fn mem_table_raw(
    p: &Path,
    regions: impl Fn(&Guest) -> Vec<[u64; 4]>,
    fds: Option<usize>,
) -> String {
    let (c, _) = Session::negotiate(p).unwrap();
    let g = Guest::new();
    let regions = regions(&g);
    let mut body = u32s(&[regions.len() as u32, 0]);
    for r in &regions {
        body.extend_from_slice(&u64s(r));
    }
    let fds = vec![g.fd(); fds.unwrap_or(regions.len())];
    let r = c.send_acked(FrontendReq::SET_MEM_TABLE, &body, &fds);
    outcome(&c, r)
}

fn mis_mem_table_zero_regions(p: &Path) -> String {
    mem_table_raw(p, |_| vec![], None)
}

fn mis_mem_table_fd_mismatch(p: &Path) -> String {
    // Two regions, one fd.
    let regions = |g: &Guest| {
        g.regions
            .iter()
            .map(|&(gpa, size, off)| [gpa, size, g.base() + off, off])
            .collect()
    };
    mem_table_raw(p, regions, Some(1))
}

fn mis_mem_table_overlap(p: &Path) -> String {
    let regions = |g: &Guest| vec![[0, MIB, g.base(), 0], [MIB / 2, MIB, g.base() + MIB, MIB]];
    mem_table_raw(p, regions, None)
}

fn mis_mem_table_wraps(p: &Path) -> String {
    mem_table_raw(p, |g| vec![[u64::MAX - 4095, MIB, g.base(), 0]], None)
}

fn mis_mem_table_zero_size(p: &Path) -> String {
    mem_table_raw(p, |g| vec![[0, 0, g.base(), 0]], None)
}

/// Reports the reply to a bad GET message (the length of its body) and how the connection
/// ended.
fn reply_outcome(c: &Conn) -> String {
    let r = c.recv().map(|(_, _, b)| b.len());
    format!("reply {r:?}; connection {}", closed_or_open(c))
}

fn mis_get_config_past_end(p: &Path) -> String {
    let (c, _) = Session::negotiate(p).unwrap();
    // struct { offset, size, flags, payload[size] }
    let mut body = u32s(&[90, 16, 0]);
    body.extend_from_slice(&[0u8; 16]);
    c.send(FrontendReq::GET_CONFIG, 0, &body, &[]).unwrap();
    reply_outcome(&c)
}

/// VhostUserInflight: mmap_size, mmap_offset, num_queues, queue_size (repr(C): 24 bytes).
fn inflight_msg(size: u64, offset: u64, num_queues: u16, queue_size: u16) -> Vec<u8> {
    let mut b = u64s(&[size, offset]);
    b.extend_from_slice(&num_queues.to_le_bytes());
    b.extend_from_slice(&queue_size.to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    b
}

fn mis_get_inflight_huge(p: &Path) -> String {
    let (c, _) = Session::negotiate_with(p, VhostUserProtocolFeatures::INFLIGHT_SHMFD).unwrap();
    let body = inflight_msg(0, 0, 1, 65535);
    c.send(FrontendReq::GET_INFLIGHT_FD, 0, &body, &[]).unwrap();
    reply_outcome(&c)
}

/// SET_INFLIGHT_FD of a `len`-byte memfd with the message body `body`.
fn set_inflight_raw(p: &Path, len: u64, body: &[u8]) -> String {
    let (c, _) = Session::negotiate_with(p, VhostUserProtocolFeatures::INFLIGHT_SHMFD).unwrap();
    let f = memfd("inflight", len);
    let r = c.send_acked(FrontendReq::SET_INFLIGHT_FD, body, &[f.as_raw_fd()]);
    outcome(&c, r)
}

fn mis_set_inflight_past_eof(p: &Path) -> String {
    // A 4 KiB memfd claimed to hold 1 MiB of in-flight state.
    set_inflight_raw(p, 4096, &inflight_msg(MIB, 0, 1, 64))
}

fn mis_set_inflight_offset_wraps(p: &Path) -> String {
    set_inflight_raw(p, 4096, &inflight_msg(2048, u64::MAX - 1000, 1, 64))
}

fn mis_set_inflight_too_many_queues(p: &Path) -> String {
    set_inflight_raw(p, 1 << 20, &inflight_msg(1 << 20, 0, 9, 64))
}

fn mis_set_inflight_queue_size_0(p: &Path) -> String {
    set_inflight_raw(p, 4096, &inflight_msg(4096, 0, 1, 0))
}

fn mis_close_mid_setup(p: &Path) -> String {
    // Everything set up and a ring running with a request in flight, then the frontend
    // vanishes without GET_VRING_BASE.
    let mut s = Session::open(p, 16, Some(IMG_SEED));
    s.guest.write(HDR_GPA, &header(T_IN, 8));
    s.write_descs(
        0,
        0,
        &[
            hdr_desc(),
            d(DATA_GPA, 4096, VRING_F_WRITE | VRING_F_NEXT, 2),
            status_desc(),
        ],
    );
    s.post_raw(0, 0, 0);
    drop(s);
    "closed by the frontend with a request posted".into()
}

fn mis_close_after_mem_table(p: &Path) -> String {
    let (c, g) = with_mem(p);
    answer(c.fe.set_vring_num(0, 16)).unwrap();
    drop(c);
    drop(g);
    "closed by the frontend after SET_MEM_TABLE and SET_VRING_NUM".into()
}

fn mis_close_immediately(p: &Path) -> String {
    drop(UnixStream::connect(p).unwrap());
    "connected and closed at once".into()
}

#[test]
fn malformed_messages_close_only_that_connection() {
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) = start_daemon(&dir);
    let by = Bystander::start(by_sock, IMG_SIZE);
    // Let the bystander connect before counting descriptors.
    fresh_client_works(&sock).expect("first client");
    std::thread::sleep(Duration::from_millis(200));
    let fds_before = fd_count(daemon.pid());

    let cases: Vec<(&str, Misbehaviour)> = vec![
        ("garbage bytes", mis_garbage),
        ("header with a huge size", mis_huge_size),
        ("body shorter than the request needs", mis_size_mismatch),
        ("partial message then close", mis_partial),
        ("unknown request code", mis_unknown_code),
        ("header version 2", mis_bad_version),
        ("SET_FEATURES with bits not offered", mis_unoffered_features),
        ("SET_VRING_NUM 0", mis_vring_num_0),
        ("SET_VRING_NUM 3 (not a power of two)", mis_vring_num_3),
        ("SET_VRING_NUM 128 (> queue-size 64)", mis_vring_num_too_big),
        ("SET_VRING_NUM 65536", mis_vring_num_65536),
        (
            "SET_VRING_ADDR outside the mem table",
            mis_vring_addr_outside,
        ),
        (
            "SET_VRING_ADDR used ring running into the hole",
            mis_vring_addr_runs_out,
        ),
        ("SET_VRING_NUM on vring 200", mis_vring_index),
        (
            "GET_QUEUE_NUM then SET_VRING_NUM on index = queues",
            mis_queue_num_plus_one,
        ),
        ("SET_VRING_KICK on index = queues", mis_kick_index),
        ("GET_VRING_BASE on vring 77", mis_get_vring_base_index),
        (
            "SET_VRING_KICK without an fd or the no-fd flag",
            mis_kick_without_fd,
        ),
        ("SET_OWNER with 8 fds attached", mis_fds_on_wrong_message),
        ("SET_MEM_TABLE with 0 regions", mis_mem_table_zero_regions),
        (
            "SET_MEM_TABLE with 2 regions and 1 fd",
            mis_mem_table_fd_mismatch,
        ),
        (
            "SET_MEM_TABLE with overlapping regions",
            mis_mem_table_overlap,
        ),
        (
            "SET_MEM_TABLE region wrapping past 2^64",
            mis_mem_table_wraps,
        ),
        ("SET_MEM_TABLE region of size 0", mis_mem_table_zero_size),
        ("GET_CONFIG past the config space", mis_get_config_past_end),
        (
            "GET_INFLIGHT_FD with queue_size 65535",
            mis_get_inflight_huge,
        ),
        (
            "SET_INFLIGHT_FD claiming 1 MiB of a 4 KiB memfd",
            mis_set_inflight_past_eof,
        ),
        (
            "SET_INFLIGHT_FD with an offset that wraps",
            mis_set_inflight_offset_wraps,
        ),
        (
            "SET_INFLIGHT_FD with 9 queues",
            mis_set_inflight_too_many_queues,
        ),
        (
            "SET_INFLIGHT_FD with queue_size 0",
            mis_set_inflight_queue_size_0,
        ),
        (
            "close mid-setup with a request in flight",
            mis_close_mid_setup,
        ),
        ("close after SET_MEM_TABLE", mis_close_after_mem_table),
        ("connect and close at once", mis_close_immediately),
    ];
    let mut failures = Vec::new();
    for (name, f) in cases {
        let obs = f(&sock);
        std::thread::sleep(Duration::from_millis(20));
        assert_alive(&mut daemon, name);
        match fresh_client_works(&sock) {
            Ok(()) => eprintln!("ok   {name}: {obs}; a new client works"),
            Err(e) => {
                let line = format!("FAIL {name}: {obs}; a new client: {e}");
                eprintln!("{line}");
                failures.push(line);
            }
        }
    }
    // libblkio asking for more queues than offered fails cleanly on the client side; asking for
    // a bigger ring than the export's queue-size is refused by the daemon (SET_VRING_NUM).
    let mut opts = ConnectOptions::new(3);
    opts.queue_size = Some(64);
    match Client::connect_with(&sock, &opts) {
        Ok(_) => failures.push("libblkio with 3 queues on a 2-queue export connected".into()),
        Err(e) => eprintln!("ok   libblkio asking 3 queues of 2: {e:#}"),
    }
    fresh_client_works(&sock).expect("client after the queue-count mismatch");
    match Client::connect(&sock, 1) {
        Ok(_) => failures
            .push("libblkio with 256-entry rings on a queue-size=64 export connected".into()),
        Err(e) => {
            eprintln!("ok   libblkio asking 256-entry rings of a queue-size=64 export: {e:#}")
        }
    }
    fresh_client_works(&sock).expect("client after the queue-size mismatch");

    std::thread::sleep(Duration::from_millis(200));
    let fds_after = fd_count(daemon.pid());
    eprintln!("daemon fds: {fds_before} before, {fds_after} after");
    if fds_after != fds_before {
        failures.push(format!(
            "daemon descriptors: {fds_before} before, {fds_after} after"
        ));
    }
    let ops = by.finish();
    eprintln!("bystander export served {ops} requests meanwhile");
    assert_alive(&mut daemon, "everything");
    daemon.terminate();
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Memory-table abuse that could take the whole daemon down
// ---------------------------------------------------------------------------------------------

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
    // SAFETY: ftruncate on the guest memfd this test owns; shrinking it is the hostile act here.
    assert_eq!(unsafe { libc::ftruncate(g.fd(), 64 * 1024) }, 0);
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
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(c);
    std::thread::sleep(Duration::from_millis(100));
    assert_alive(&mut daemon, "a memory region larger than its file");
    fresh_client_works(&sock).expect("a new client after the bad region");
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
        g.write(
            desc,
            &desc_bytes(&[
                hdr_desc(),
                d(DATA_GPA, 512, VRING_F_WRITE | VRING_F_NEXT, 2),
                status_desc(),
            ]),
        );
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

// ---------------------------------------------------------------------------------------------
// Cache mode (CONFIG_WCE)
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

/// The export's count of write-through writes.
fn sync_writes(stats: &Path) -> u64 {
    stats_sync_writes(stats).unwrap()
}

#[test]
fn guest_turning_the_write_cache_off_makes_writes_write_through() {
    let dir = TestDir::new();
    let img = dir.image("wce.img", IMG_SIZE, Some(IMG_SEED));
    let sock = dir.join("wce.sock");
    let stats = dir.join("stats.json");
    let stats_arg = stats.display().to_string();
    let daemon = Daemon::start_args(
        &dir,
        &[Export::file(&sock, &img)],
        &["--stats-file", &stats_arg],
    );
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
    assert_eq!(sync_writes(&stats), 0, "write-back mode wrote through");

    set_config_writeback(&mut s.conn, false);
    assert_eq!(
        config_writeback(&mut s.conn),
        0,
        "the cache mode did not stick"
    );
    write_some(&mut s, 64, 0x22);
    assert_eq!(
        sync_writes(&stats),
        4,
        "write-through mode: every write must carry RWF_DSYNC"
    );

    set_config_writeback(&mut s.conn, true);
    assert_eq!(config_writeback(&mut s.conn), 1);
    write_some(&mut s, 128, 0x33);
    assert_eq!(sync_writes(&stats), 4, "back in write-back mode");

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
    let img = dir.image("cached.img", IMG_SIZE, Some(IMG_SEED));
    let sock = dir.join("cached.sock");
    let daemon = Daemon::start(&dir, &[Export::file(&sock, &img).direct(false)]);
    let image = File::open(&img).unwrap();
    let Some(before) = unwritten_pages(&image) else {
        // Only by asking: otherwise a machine with an older kernel would pass without a check.
        assert!(
            std::env::var_os("MQBLK_TEST_ALLOW_NO_CACHESTAT").is_some(),
            "this kernel has no cachestat(2) (Linux 6.5) to see dirty pages with; set \
             MQBLK_TEST_ALLOW_NO_CACHESTAT=1 to skip this test"
        );
        eprintln!("SKIPPED (MQBLK_TEST_ALLOW_NO_CACHESTAT): no cachestat(2) on this kernel");
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
    let img = dir.image("wce.img", IMG_SIZE, Some(IMG_SEED));
    let sock = dir.join("wce.sock");
    let stats_a = dir.join("stats-a.json");
    let stats_arg = stats_a.display().to_string();
    let daemon = Daemon::start_args(
        &dir,
        &[Export::file(&sock, &img)],
        &["--stats-file", &stats_arg],
    );

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
    assert_eq!(sync_writes(&stats_a), 1);
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
    let stats_arg = stats_b.display().to_string();
    let _ = std::fs::remove_file(&sock);
    let daemon = Daemon::start_args(
        &dir_b,
        &[Export::file(&sock, &img)],
        &["--stats-file", &stats_arg],
    );
    let mut s = connect(&region);
    assert_eq!(
        config_writeback(&mut s.conn),
        0,
        "the restarted mqblk forgot that the guest chose write-through"
    );
    s.good_write(0, 8, 0x5a);
    assert_eq!(
        sync_writes(&stats_b),
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

// ---------------------------------------------------------------------------------------------
// Live migration: the dirty log
// ---------------------------------------------------------------------------------------------

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
    let mut fds = [0; 2];
    // SAFETY: pipe with a live 2-element array; the results are checked and owned below.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fresh descriptors, each owned by one File.
    let (r, _w) = unsafe {
        use std::os::fd::FromRawFd;
        (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
    };
    offer_log(p, &r, LOG_BYTES, 0)
}

fn log_sealed_against_writes(p: &Path) -> String {
    let f = support::mem::sealable_memfd("read-only-log", 4096);
    // SAFETY: fcntl on a descriptor we own, adding a seal.
    assert_eq!(
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_WRITE) },
        0
    );
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
        std::thread::sleep(Duration::from_millis(20));
        assert_alive(&mut daemon, name);
        let ok = obs.starts_with(want);
        // The daemon logs as it refuses; allow it a moment to reach the file.
        let deadline = Instant::now() + Duration::from_secs(2);
        let logged = loop {
            let log = daemon.log();
            let new = log.get(log_before..).unwrap_or("").to_string();
            if new.contains(want_logged) || Instant::now() >= deadline {
                break new;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let logged_ok = logged.contains(want_logged);
        let client = fresh_client_works(&sock);
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
