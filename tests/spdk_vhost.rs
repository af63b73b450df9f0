//! Whether SPDK's vhost target serves mqblk's own vhost-user frontend (tests/support/frontend.rs)
//! — the question behind `mqblk bench --backend spdk` (issue 21): libblkio, the bench's client,
//! refuses SPDK because DPDK's vhost library lacks the CONFIGURE_MEM_SLOTS protocol feature; the
//! hand-written frontend shares memory with SET_MEM_TABLE alone. The test starts the target as
//! the bench does (its command line and RPC calls, from mqblk-bench), serving an aio bdev on an
//! image filled with a known pattern, then connects, negotiates, sets up one virtqueue, reads a
//! block and checks the pattern, writes a block and reads it back, and checks the image.
//!
//! Needs an SPDK build (`scripts/spdk-build.sh SPDK_SRC DIR`) in `$MQBLK_SPDK_DIR`; without one
//! (CI builds no SPDK) it prints SKIPPED and passes.

mod support;

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use mqblk_bench::spdk::{rpc_calls, SpdkBuild, SPDK_DIR_ENV};
use mqblk_bench::EngineKind;
use mqblk_client::fill_pattern;
use support::frontend::{
    header, read_chain, Answer, Session, DATA_GPA, HDR_GPA, STATUS_GPA, S_OK, T_IN,
};
use support::proc::Proc;

const IMAGE_SIZE: u64 = 8 << 20;
const SEED: u64 = 0x7370_646b;
/// The controller's name, which is also its socket's name in the target's socket directory.
const CTRLR: &str = "blk0";

/// Prints the target's log when the test fails, so that what SPDK refused is in the output.
struct LogOnFailure<'a>(&'a Path);

impl Drop for LogOnFailure<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut log = String::new();
            if let Ok(mut f) = std::fs::File::open(self.0) {
                let _ = f.read_to_string(&mut log);
            }
            eprintln!("--- SPDK vhost's log ({}):\n{log}", self.0.display());
        }
    }
}

#[test]
fn spdk_serves_the_hand_written_frontend() {
    let Some(dir) = std::env::var_os(SPDK_DIR_ENV) else {
        eprintln!(
            "SKIPPED: {SPDK_DIR_ENV} is not set; build SPDK's vhost target with \
             scripts/spdk-build.sh SPDK_SRC DIR and set {SPDK_DIR_ENV}=DIR to run this test"
        );
        return;
    };
    let build = SpdkBuild::find(Some(Path::new(&dir))).unwrap_or_else(|e| panic!("{e}"));
    // On the machine's disk, not a tmpfs: the aio bdev opens its file with O_DIRECT.
    let tmp = tempfile::Builder::new()
        .prefix("spdk-vhost")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("a temporary directory");
    let image = tmp.path().join("disk.img");
    let mut data = vec![0u8; IMAGE_SIZE as usize];
    fill_pattern(&mut data, 0, SEED);
    std::fs::write(&image, &data).expect("writing the image");

    let rpc_sock = tmp.path().join("rpc.sock");
    let sock = tmp.path().join(CTRLR);
    let log = tmp.path().join("vhost.log");
    let argv = build.vhost_argv(tmp.path(), &rpc_sock);
    let mut vhost = Proc::spawn_logged(
        "SPDK vhost".into(),
        Command::new(&argv[0]).args(&argv[1..]),
        &log,
    );
    let _log_on_failure = LogOnFailure(&log);
    vhost
        .wait_for_socket(&rpc_sock, Duration::from_secs(30), || true)
        .unwrap_or_else(|e| panic!("{e}"));
    for call in rpc_calls(EngineKind::Uring, IMAGE_SIZE, Some(&image), CTRLR) {
        build
            .rpc(&rpc_sock, &call)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    vhost
        .wait_for_socket(&sock, Duration::from_secs(10), || true)
        .unwrap_or_else(|e| panic!("{e}"));

    // Negotiation (REPLY_ACK, MQ, CONFIG; VERSION_1, INDIRECT_DESC), SET_MEM_TABLE with two
    // regions, one ring of 128 on queue 0 with its call and kick eventfds.
    let mut s = Session::open(&sock, 128, Some(SEED));
    // A 4 KiB read at sector 8: the image's pattern, status OK, used length 4097.
    s.good_read(0).unwrap_or_else(|e| panic!("{e}"));
    // A 4 KiB write at sector 16, then read it back through the ring and from the image.
    s.good_write(0, 16, 0x5a);
    s.guest.write(HDR_GPA, &header(T_IN, 16));
    s.guest.write(STATUS_GPA, &[0xee]);
    s.guest.write(DATA_GPA, &[0u8; 4096]);
    assert_eq!(s.submit(0, &read_chain(4096)), Answer::Used(0, 4097));
    assert_eq!(s.guest.read(STATUS_GPA, 1)[0], S_OK, "read-back status");
    assert!(
        s.guest.read(DATA_GPA, 4096).iter().all(|&b| b == 0x5a),
        "the read-back does not give what was written"
    );
    let mut on_disk = vec![0u8; 4096];
    std::fs::File::open(&image)
        .and_then(|f| f.read_exact_at(&mut on_disk, 16 * 512))
        .expect("reading the image");
    assert!(
        on_disk.iter().all(|&b| b == 0x5a),
        "the write did not reach the image"
    );
    drop(s);
    // A SIGTERM while SPDK is still stopping the session can leave it hung (see
    // mqblk-bench/src/spdk.rs).
    build
        .wait_for_no_sessions(&rpc_sock, CTRLR, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}"));
    let problems = vhost.terminate(Duration::from_secs(15));
    assert!(problems.is_empty(), "{problems:?}");
}
