//! The daemon that the hostile-frontend tests attack, and the export beside it that must go on
//! serving: `hostile` (writable, 2 queues of up to 64 entries), `ro` (read-only) and
//! `bystander`, which a libblkio client ([`Bystander`]) writes and verifies for the whole test.
//! Used by tests/hostile_*.rs and tests/migration_dirty_log.rs.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use mqblk_client::{fill_pattern, Client, ConnectOptions};

use super::daemon::*;
use super::frontend::ANSWER_TIMEOUT;
use super::wait::wait_until;

/// A libblkio client writing and verifying data on another export until stopped.
pub struct Bystander {
    stop: Arc<AtomicBool>,
    /// Requests answered so far.
    ops: Arc<AtomicU64>,
    thread: Option<JoinHandle<(u64, Vec<String>)>>,
}

impl Bystander {
    pub fn start(socket: PathBuf, size: u64) -> Bystander {
        let stop = Arc::new(AtomicBool::new(false));
        let ops_seen = Arc::new(AtomicU64::new(0));
        let (s2, seen) = (stop.clone(), ops_seen.clone());
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
                seen.store(ops, Ordering::Relaxed);
                i += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            (ops, errors)
        });
        Bystander {
            stop,
            ops: ops_seen,
            thread: Some(thread),
        }
    }

    /// Waits (bounded) until the client has been served: from then on its connection is set
    /// up and steady, and the daemon's descriptors can be counted.
    pub fn wait_serving(&self) {
        assert!(
            wait_until(Duration::from_secs(10), || self.ops.load(Ordering::Relaxed)
                > 0),
            "the other export's client was not served within 10 s"
        );
    }

    /// Waits (bounded) until the client has been served `more` requests from now: it was
    /// served after whatever the test did before.
    pub fn wait_served_more(&self, more: u64) {
        let target = self.ops.load(Ordering::Relaxed) + more;
        assert!(
            wait_until(Duration::from_secs(30), || self.ops.load(Ordering::Relaxed)
                >= target
                || self.thread.as_ref().is_some_and(|t| t.is_finished())),
            "the other export's client stalled"
        );
    }

    /// Waits (bounded) until it was served once more, after whatever the test did, then stops
    /// it and asserts that every request succeeded; returns the request count. (Stopping at
    /// once could find a client that a loaded machine had not yet served at all.)
    pub fn finish(mut self) -> u64 {
        self.wait_served_more(1);
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

pub fn assert_alive(daemon: &mut Daemon, after: &str) {
    if let Some(st) = daemon.has_exited() {
        panic!(
            "daemon died after {after}: {st}\n--- daemon log ---\n{}",
            daemon.log()
        );
    }
}

/// The descriptors the daemon holds, counted while a probe holds the export at `socket`: by
/// then every earlier connection of it has been torn down (`support::daemon::probe`).
pub fn fds_held(daemon: &Daemon, socket: &Path) -> usize {
    let _probe = probe(socket, &hostile_client_options());
    fd_count(daemon.pid())
}

/// How a libblkio client connects to the `hostile` export: its queue-size is 64, and libblkio
/// asks for 256 unless told.
pub fn hostile_client_options() -> ConnectOptions {
    let mut opts = ConnectOptions::new(1);
    opts.queue_size = Some(64);
    opts
}

/// A fresh libblkio client can connect to `socket` and read. Once it has, the daemon has torn
/// down every earlier connection to that export (see `support::daemon::probe`).
pub fn fresh_client_works(socket: &Path) -> Result<(), String> {
    let mut c = connect_retry(socket, &hostile_client_options())?;
    c.set_timeout(ANSWER_TIMEOUT);
    c.read_vec(0, 0, 4096)
        .map(|_| ())
        .map_err(|e| format!("read: {e}"))
}

/// The size of each export's image.
pub const IMG_SIZE: u64 = 8 * MIB;
/// The seed of the pattern in the `hostile` and `ro` images, which the frontend's reads check.
pub const IMG_SEED: u64 = 0x5eed;

/// Starts the daemon of these tests: `hostile` (writable, 2 queues of up to 64), `ro`
/// (read-only) and `bystander` (served to a libblkio client throughout). Returns it with the
/// three sockets, in that order, and the `hostile` export's image.
pub fn start_daemon(dir: &TestDir) -> (Daemon, PathBuf, PathBuf, PathBuf, PathBuf) {
    start_daemon_env(dir, &[])
}

/// [`start_daemon`] with variables set in the daemon's environment (a debug build's test
/// hooks).
pub fn start_daemon_env(
    dir: &TestDir,
    env: &[(&str, &str)],
) -> (Daemon, PathBuf, PathBuf, PathBuf, PathBuf) {
    let img = dir.image("hostile.img", IMG_SIZE, Some(IMG_SEED));
    let ro_img = dir.image("ro.img", IMG_SIZE, Some(IMG_SEED));
    let by_img = dir.image("bystander.img", IMG_SIZE, None);
    let (a, b, c) = (
        dir.join("hostile.sock"),
        dir.join("ro.sock"),
        dir.join("bystander.sock"),
    );
    let daemon = Daemon::start_env(
        dir,
        &[
            Export::file(&a, &img).queues(2).set("queue-size", "64"),
            Export::file(&b, &ro_img).readonly(),
            Export::file(&c, &by_img),
        ],
        &[],
        env,
    );
    (daemon, a, b, c, img)
}
