//! Malformed vhost-user messages from a hostile frontend: each gets a NACK or closes its own
//! connection, and nothing else. After each one a new frontend must be served, the daemon's
//! descriptors must be what they were, and a second export of the same daemon, driven by a
//! libblkio client throughout (tests/support/hostile.rs), must see no error.
//!
//! The frontend (tests/support/frontend.rs) sets the device up with the vhost crate's Frontend
//! and sends what no well-behaved library would (garbage, out-of-range indices, sizes and
//! addresses) as raw bytes on the same socket.
mod support;

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use mqblk_client::{Client, ConnectOptions};
use support::daemon::*;
use support::frontend::*;
use support::hostile::*;
use support::mem::memfd;
use vhost::vhost_user::message::{FrontendReq, VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vmm_sys_util::eventfd::EventFd;

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
    s.write_descs(0, 0, &read_chain(4096));
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
    // The descriptors are counted with the bystander's connection set up and a probe holding
    // the hostile export (so that every earlier connection of it has been torn down), before
    // and after.
    by.wait_serving();
    let fds_before = fds_held(&daemon, &sock);

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
        // A new client is served only once the daemon has dropped the bad connection.
        let client = fresh_client_works(&sock);
        assert_alive(&mut daemon, name);
        match client {
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

    let fds_after = fds_held(&daemon, &sock);
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

/// A bug that some message reaches ends that message's connection only. A debug build's test
/// hook (`frontend/test_hooks.rs`, `MQBLK_TEST_ONLY_PANIC_AFTER_START`) panics the session at
/// the message that starts the second queue (SET_VRING_ENABLE, from libblkio), with the first
/// queue's I/O thread already serving it: the listener catches the panic, closes that
/// connection and resets its session as for any disconnect (`daemon/listener.rs`). Then a new
/// frontend is served on both queues, the daemon holds the descriptors it held before, and the
/// export beside it saw no error.
#[test]
fn a_panic_while_a_message_is_handled_closes_that_connection_only() {
    if !support::skip::has_test_hooks() {
        return;
    }
    let dir = TestDir::new();
    let (mut daemon, sock, _ro, by_sock, _img) =
        start_daemon_env(&dir, &[("MQBLK_TEST_ONLY_PANIC_AFTER_START", "1")]);
    let by = Bystander::start(by_sock, IMG_SIZE);
    by.wait_serving();
    // A 1-queue probe (`fds_held`) never starts queue 1, so it does not set the panic off.
    let fds_before = fds_held(&daemon, &sock);

    let mut two_queues = ConnectOptions::new(2);
    two_queues.queue_size = Some(64);
    // libblkio waits for each message's reply, so the panic fails its setup; should a
    // client get through anyway, its connection must be gone.
    match Client::connect_with(&sock, &two_queues) {
        Err(e) => eprintln!("the connection that panicked failed its setup: {e:#}"),
        Ok(mut c) => {
            c.set_timeout(ANSWER_TIMEOUT);
            assert!(
                c.read_vec(0, 0, 4096).is_err(),
                "a client whose setup panicked the daemon was still served"
            );
        }
    }
    assert!(
        daemon.wait_for_log(
            "handling a vhost-user message panicked; closing the connection",
            Duration::from_secs(10)
        ),
        "no line about the panic in the daemon's log:\n{}",
        daemon.log()
    );
    assert_alive(&mut daemon, "the panic");

    // A new frontend, served on both queues: each writes a block and reads back the other's.
    let mut c = connect_retry(&sock, &two_queues).expect("a client after the panic");
    c.set_timeout(ANSWER_TIMEOUT);
    let blocks: Vec<Vec<u8>> = (0..2u64)
        .map(|q| {
            let mut b = vec![0u8; 4096];
            mqblk_client::fill_pattern(&mut b, q * 65536, 0xfa11 + q);
            b
        })
        .collect();
    for (q, b) in blocks.iter().enumerate() {
        c.write(q, q as u64 * 65536, b)
            .unwrap_or_else(|e| panic!("write on queue {q} after the panic: {e}"));
    }
    for (q, b) in blocks.iter().enumerate() {
        let got = c
            .read_vec(1 - q, q as u64 * 65536, 4096)
            .unwrap_or_else(|e| panic!("read on queue {} after the panic: {e}", 1 - q));
        assert!(
            &got == b,
            "queue {}: read back other data than written",
            1 - q
        );
    }
    drop(c);

    let fds_after = fds_held(&daemon, &sock);
    assert_eq!(
        fds_after, fds_before,
        "daemon descriptors: {fds_before} before the panic, {fds_after} after"
    );
    let ops = by.finish();
    eprintln!("bystander export served {ops} requests meanwhile");
    assert_alive(&mut daemon, "everything");
    daemon.terminate();
}
