//! The daemon's log: a log that can no longer be written costs its lines, never a thread.
mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use mqblk_client::Client;
use support::daemon::*;
use support::mount::Mount;

const KIB: u64 = 1024;

/// Standard error whose reader is gone (a pipe closed at the other end, as when the log
/// collector a service's output goes to restarts; a file on a full filesystem fails the same
/// way): every line the daemon logs fails to be written, with EPIPE. Here the vhost-user thread
/// logs the frontend's connection, and the I/O thread each write that the image's full
/// filesystem fails (rate-limited: a second round comes after the limit lets a line through
/// again). The lines are lost, and nothing else: the writes fail with EIO, the export goes on
/// serving every block it acknowledged, and the daemon stops cleanly. (With
/// tracing-subscriber's default, a line it cannot write is reported with `eprintln!`, which
/// panics when that fails too: the connection was reset before the first request.)
#[test]
fn a_log_that_cannot_be_written_stops_no_thread() {
    let dir = TestDir::new();
    let Some(m) = Mount::new(&dir, "small", "tmpfs", "size=1m") else {
        return; // reported as SKIPPED by Mount::new
    };
    // A sparse 16 MiB image on a 1 MiB filesystem.
    let img = m.path().join("disk.raw");
    write_image(&img, 16 << 20, None);
    let sock = dir.join("s.sock");
    let export = Export::file(&sock, &img).direct(false);
    let mut cmd = Command::new(mqblk_bin());
    cmd.arg("serve").arg("--export").arg(export.spec());
    let (reader, writer) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    let mut d = Daemon::spawn_with_stderr(&dir, cmd, &[&sock], Some(Stdio::from(writer)));
    drop(reader);

    let mut c = Client::connect(&sock, 1).unwrap();
    c.set_timeout(Duration::from_secs(10));
    let block = |k: u64| vec![(k % 251) as u8 + 1; 64 * KIB as usize];
    let (mut written, mut failed) = (Vec::new(), 0);
    for round in 0..2 {
        if round == 1 {
            std::thread::sleep(Duration::from_millis(1100));
        }
        for k in (round * 32..round * 32 + 32).map(|k| k as u64) {
            match c.write(0, k * 64 * KIB, &block(k)) {
                Ok(()) => written.push(k),
                Err(e) => {
                    assert_eq!(e.errno(), Some(libc::EIO), "block {k}: {e}");
                    failed += 1;
                }
            }
        }
    }
    assert!(
        !written.is_empty() && failed > 32,
        "the filesystem should fill in the first round: {} written, {failed} failed",
        written.len()
    );
    for &k in &written {
        assert!(
            c.read_vec(0, k * 64 * KIB, 64 * KIB as usize).unwrap() == block(k),
            "block {k} reads back"
        );
    }
    c.flush(0).expect("a flush");
    drop(c);
    assert!(d.has_exited().is_none(), "the daemon exited");
    let status = d.stop();
    assert!(status.success(), "the daemon stopped with {status}");
}
