//! Helpers for integration tests that run the real daemon: temp dirs and disk images, spawning
//! `mqblk serve` with `--export` specs, waiting for its sockets, and stopping it.
//!
//! Set `MQBLK_TEST_BACKEND=qsd` to run the same tests against qemu-storage-daemon instead (the
//! reference backend; thread-mapping settings are ignored there), or `MQBLK_BIN` to run another
//! build of mqblk. Set `MQBLK_TEST_LOG_LEVEL` to pass `--log-level` to mqblk. The daemon's
//! output goes to `daemon.log` in the test's directory and is printed when the test fails.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mqblk_client::{fill_pattern, Client, ConnectOptions, Pattern, Report, Workload};
use rustix::process::{kill_process, Pid, Signal};

/// Longest a daemon may take to create and listen on its sockets.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a daemon may take to exit after SIGTERM.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
/// A test whose daemon is still running after this long is stuck: the daemon is SIGKILLed, which
/// makes blocked client calls fail instead of hanging the test run.
pub const WATCHDOG: Duration = Duration::from_secs(60);

/// The watchdog for this test process: `MQBLK_TEST_WATCHDOG_SECS` or [`WATCHDOG`]. Long
/// soaks raise it; without it a daemon would be killed under a soak longer than a minute.
pub fn watchdog() -> Duration {
    Duration::from_secs(env_or("MQBLK_TEST_WATCHDOG_SECS", WATCHDOG.as_secs()))
}

/// A test's knob: the environment variable `name` if it is set and parses, else `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

/// A test's own temporary directory (removed when dropped).
pub struct TestDir {
    dir: tempfile::TempDir,
}

impl TestDir {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("mqblk-test-")
            .tempdir()
            .expect("creating a temp dir");
        Self { dir }
    }

    /// A directory on a tmpfs (/dev/shm) when the machine has one, else like [`TestDir::new`].
    /// For an image whose I/O must not share a journal with the test's other files: on ext4
    /// an O_DIRECT write updates the file's mtime and so waits for any journal commit the
    /// test's other file operations start (docs/PERFORMANCE.md 1a).
    pub fn on_tmpfs() -> Self {
        let mut b = tempfile::Builder::new();
        b.prefix("mqblk-test-");
        let dir = b.tempdir_in("/dev/shm").unwrap_or_else(|e| {
            eprintln!(
                "no tmpfs at /dev/shm ({e}): this test's image shares the disk's journal, \
                 and its timings may show that"
            );
            b.tempdir().expect("creating a temp dir")
        });
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A path inside the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Creates `name` of `size` bytes: zeroes (sparse) if `seed` is `None`, else the seeded
    /// pattern of [`fill_pattern`] (so a test can tell old data from new data and zeroes).
    pub fn image(&self, name: &str, size: u64, seed: Option<u64>) -> PathBuf {
        let path = self.join(name);
        write_image(&path, size, seed);
        path
    }
}

impl Default for TestDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestDir {
    /// Removes the qcow2 metadata journals the test's images left in the daemon's state
    /// directory (named after each image file, which the directory's removal then deletes).
    fn drop(&mut self) {
        fn journals_of(dir: &Path) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let path = e.path();
                match e.file_type() {
                    Ok(t) if t.is_dir() => journals_of(&path),
                    Ok(t) if t.is_file() => {
                        if let Ok(journal) = mqblk::format::qcow2::journal_path(&path) {
                            let _ = std::fs::remove_file(journal);
                        }
                    }
                    _ => {}
                }
            }
        }
        journals_of(self.dir.path());
    }
}

/// Writes an image file of `size` bytes; see [`TestDir::image`].
pub fn write_image(path: &Path, size: u64, seed: Option<u64>) {
    let f = File::create(path).expect("creating image");
    f.set_len(size).expect("sizing image");
    if let Some(seed) = seed {
        let mut buf = vec![0u8; MIB as usize];
        let mut off = 0;
        while off < size {
            let n = (size - off).min(MIB) as usize;
            fill_pattern(&mut buf[..n], off, seed);
            f.write_all_at(&buf[..n], off).expect("writing image");
            off += n as u64;
        }
    }
    f.sync_all().expect("syncing image");
}

/// `len` bytes of the seeded pattern as it lies at `offset`.
pub fn pattern(len: usize, offset: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, offset, seed);
    v
}

/// The expected content of a whole image: the seeded pattern (or zeroes), to be patched with
/// what a test wrote and then compared with [`assert_file_eq`].
pub fn pattern_bytes(size: u64, offset: u64, seed: Option<u64>) -> Vec<u8> {
    let mut v = vec![0u8; size as usize];
    if let Some(seed) = seed {
        fill_pattern(&mut v, offset, seed);
    }
    v
}

/// Reads `len` bytes at `offset` straight from the file on the host (not through the daemon).
pub fn read_file(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let f = File::open(path).expect("opening image");
    let mut v = vec![0u8; len];
    f.read_exact_at(&mut v, offset).expect("reading image");
    v
}

pub fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).expect("stat image").len()
}

/// Asserts that the whole file equals `expected`, naming the first differing offset.
pub fn assert_file_eq(path: &Path, expected: &[u8], what: &str) {
    let len = file_len(path);
    assert_eq!(len, expected.len() as u64, "{what}: image size changed");
    let actual = read_file(path, 0, expected.len());
    assert_bytes_eq(&actual, expected, 0, what);
}

/// Asserts `actual == expected`; on failure names the first differing disk offset (`base` is the
/// disk offset of byte 0) instead of dumping megabytes.
pub fn assert_bytes_eq(actual: &[u8], expected: &[u8], base: u64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        let end = (i + 16).min(actual.len());
        panic!(
            "{what}: first difference at disk offset {} (byte {i}): got {:02x?}, expected {:02x?}",
            base + i as u64,
            &actual[i..end],
            &expected[i..end]
        );
    }
}

/// Queue-to-thread mapping of an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapping {
    /// 1 queue, 1 thread.
    Baseline,
    /// N queues, 1 thread.
    Mq(usize),
    /// N queues, N threads.
    PerQueue(usize),
}

impl Mapping {
    pub fn queues(self) -> usize {
        match self {
            Mapping::Baseline => 1,
            Mapping::Mq(n) | Mapping::PerQueue(n) => n,
        }
    }
}

/// One `--export` of `mqblk serve`.
#[derive(Clone, Debug)]
pub struct Export {
    pub socket: PathBuf,
    pub path: Option<PathBuf>,
    pub engine: Option<String>,
    pub size: Option<u64>,
    pub queues: Option<usize>,
    pub queue_size: Option<u32>,
    /// `threads=` value: `per-queue` or a number.
    pub threads: Option<String>,
    pub readonly: bool,
    pub direct: Option<bool>,
    /// Further `key=value` pairs, passed as they are.
    pub extra: Vec<(String, String)>,
}

impl Export {
    /// An export of the raw file `image` on `socket`.
    pub fn file(socket: impl Into<PathBuf>, image: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            path: Some(image.into()),
            engine: None,
            size: None,
            queues: None,
            queue_size: None,
            threads: None,
            readonly: false,
            direct: None,
            extra: Vec::new(),
        }
    }

    /// A null export (`engine=null`: reads give zeros, writes are dropped) of `size` bytes on
    /// `socket`.
    pub fn null(socket: impl Into<PathBuf>, size: u64) -> Self {
        Self {
            path: None,
            engine: Some("null".into()),
            size: Some(size),
            ..Self::file(socket, "")
        }
    }

    /// An export with no backing file, whose engine the caller sets (rbd).
    pub fn without_path(socket: impl Into<PathBuf>) -> Self {
        Self {
            path: None,
            ..Self::file(socket, "")
        }
    }

    pub fn queues(mut self, n: usize) -> Self {
        self.queues = Some(n);
        self
    }

    pub fn threads(mut self, t: &str) -> Self {
        self.threads = Some(t.to_string());
        self
    }

    /// Sets queues and threads for a thread mapping.
    pub fn mapping(self, m: Mapping) -> Self {
        match m {
            Mapping::Baseline => self.queues(1).threads("1"),
            Mapping::Mq(n) => self.queues(n).threads("1"),
            Mapping::PerQueue(n) => self.queues(n).threads("per-queue"),
        }
    }

    pub fn readonly(mut self) -> Self {
        self.readonly = true;
        self
    }

    pub fn direct(mut self, on: bool) -> Self {
        self.direct = Some(on);
        self
    }

    pub fn set(mut self, key: &str, value: &str) -> Self {
        self.extra.push((key.to_string(), value.to_string()));
        self
    }

    /// The `SPEC` of `--export SPEC`.
    pub fn spec(&self) -> String {
        let mut kv = vec![format!("socket={}", self.socket.display())];
        if let Some(p) = &self.path {
            kv.push(format!("path={}", p.display()));
        }
        if let Some(e) = &self.engine {
            kv.push(format!("engine={e}"));
        }
        if let Some(s) = self.size {
            kv.push(format!("size={s}"));
        }
        if let Some(q) = self.queues {
            kv.push(format!("queues={q}"));
        }
        if let Some(q) = self.queue_size {
            kv.push(format!("queue-size={q}"));
        }
        if let Some(t) = &self.threads {
            kv.push(format!("threads={t}"));
        }
        if self.readonly {
            kv.push("readonly=on".into());
        }
        if let Some(d) = self.direct {
            kv.push(format!("direct={}", if d { "on" } else { "off" }));
        }
        for (k, v) in &self.extra {
            kv.push(format!("{k}={v}"));
        }
        kv.join(",")
    }

    /// qemu-storage-daemon arguments serving the same export (node names from `i`).
    fn qsd_args(&self, i: usize) -> Vec<String> {
        let node = format!("node{i}");
        let direct = if self.direct.unwrap_or(true) {
            "on"
        } else {
            "off"
        };
        let ro = if self.readonly { "on" } else { "off" };
        let blockdev = match self.engine.as_deref() {
            Some("null") => format!(
                "driver=null-co,node-name={node},size={},read-zeroes=on",
                self.size.expect("null engine needs a size")
            ),
            _ => {
                let path = self.path.as_ref().expect("file export needs a path");
                if !path.exists() {
                    write_image(path, self.size.expect("missing image needs a size"), None);
                }
                format!(
                    "driver=file,node-name={node},filename={},cache.direct={direct},discard=unmap,read-only={ro}",
                    path.display()
                )
            }
        };
        let export = format!(
            "type=vhost-user-blk,id=exp{i},node-name={node},addr.type=unix,addr.path={},writable={},num-queues={}",
            self.socket.display(),
            if self.readonly { "off" } else { "on" },
            self.queues.unwrap_or(1)
        );
        vec!["--blockdev".into(), blockdev, "--export".into(), export]
    }
}

/// The daemon binary: this package's `mqblk`, or `MQBLK_BIN` if set.
pub fn mqblk_bin() -> PathBuf {
    std::env::var_os("MQBLK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_mqblk")))
}

fn use_qsd() -> bool {
    std::env::var("MQBLK_TEST_BACKEND").is_ok_and(|b| b == "qsd")
}

/// A running daemon. Dropping it kills it (SIGKILL); [`Daemon::terminate`] stops it the proper
/// way and checks that it exits cleanly.
pub struct Daemon {
    child: Option<Child>,
    log: PathBuf,
    watchdog: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
    pub exports: Vec<Export>,
}

impl Daemon {
    /// Starts `mqblk serve` with `exports` (logging to `dir/daemon.log`) and waits until every
    /// export's socket is listening.
    pub fn start(dir: &TestDir, exports: &[Export]) -> Self {
        Self::start_args(dir, exports, &[])
    }

    /// [`Daemon::start`] with extra arguments for `mqblk serve` (ignored with QSD).
    pub fn start_args(dir: &TestDir, exports: &[Export], args: &[&str]) -> Self {
        Self::start_env(dir, exports, args, &[])
    }

    /// [`Daemon::start_args`] with variables set in mqblk's environment (ignored with QSD).
    pub fn start_env(
        dir: &TestDir,
        exports: &[Export],
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut cmd;
        if use_qsd() {
            cmd = Command::new("qemu-storage-daemon");
            for (i, e) in exports.iter().enumerate() {
                cmd.args(e.qsd_args(i));
            }
        } else {
            cmd = Command::new(mqblk_bin());
            cmd.arg("serve");
            for e in exports {
                cmd.arg("--export").arg(e.spec());
            }
            cmd.args(args);
            cmd.envs(env.iter().copied());
        }
        let sockets: Vec<&Path> = exports.iter().map(|e| e.socket.as_path()).collect();
        let mut d = Self::spawn(dir, cmd, &sockets);
        d.exports = exports.to_vec();
        d
    }

    /// Runs `cmd` (a daemon command line built by the test, e.g. with inherited descriptors)
    /// as a [`Daemon`] logging to `dir/daemon.log`, and waits until each of `sockets` listens.
    pub fn spawn(dir: &TestDir, cmd: Command, sockets: &[&Path]) -> Self {
        Self::spawn_with_stderr(dir, cmd, sockets, None)
    }

    /// [`Daemon::spawn`] with the daemon's standard error on `stderr` instead of the log file
    /// (which then holds its command line and standard output only).
    pub fn spawn_with_stderr(
        dir: &TestDir,
        mut cmd: Command,
        sockets: &[&Path],
        stderr: Option<Stdio>,
    ) -> Self {
        let log = dir.join("daemon.log");
        let logf = File::create(&log).expect("creating daemon log");
        if !use_qsd() {
            if let Ok(level) = std::env::var("MQBLK_TEST_LOG_LEVEL") {
                cmd.arg("--log-level").arg(level);
            }
        }
        writeln!(&logf, "$ {cmd:?}").ok();
        let stderr = stderr.unwrap_or_else(|| logf.try_clone().expect("dup log fd").into());
        cmd.stdin(Stdio::null()).stdout(logf).stderr(stderr);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
        let pid = Pid::from_child(&child);

        let (tx, rx) = mpsc::channel::<()>();
        let limit = watchdog();
        let watchdog = std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!("watchdog: daemon {pid} still running after {limit:?}, killing it");
                // The pid is still our unreaped child (the watchdog is stopped before the child
                // is waited for).
                let _ = kill_process(pid, Signal::KILL);
            }
        });

        let mut d = Daemon {
            child: Some(child),
            log,
            watchdog: Some((tx, watchdog)),
            exports: Vec::new(),
        };
        for socket in sockets {
            d.wait_listening(socket);
        }
        d
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("daemon already stopped").id()
    }

    /// Sends `sig` to the daemon, our unreaped child (so its pid names no other process).
    pub fn signal(&self, sig: Signal) {
        let child = self.child.as_ref().expect("daemon already stopped");
        let _ = kill_process(Pid::from_child(child), sig);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (up to `within`) until the log holds `text`; whether it came.
    pub fn wait_for_log(&self, text: &str, within: Duration) -> bool {
        super::wait::wait_until(within, || self.log().contains(text))
    }

    fn wait_listening(&mut self, socket: &Path) {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let mut appeared: Option<Instant> = None;
        loop {
            if socket.exists() {
                let since = *appeared.get_or_insert_with(Instant::now);
                // Listening per /proc/net/unix; or, should that table not show it (another
                // network namespace, a path spelt differently), the socket has existed for 1 s.
                if is_listening(socket) || since.elapsed() > Duration::from_secs(1) {
                    return;
                }
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().expect("waitpid") {
                self.child = None;
                panic!(
                    "daemon exited ({status}) before listening on {}\n--- daemon log ---\n{}",
                    socket.display(),
                    self.log()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "{} not listening after {STARTUP_TIMEOUT:?}\n--- daemon log ---\n{}",
                    socket.display(),
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits up to `timeout` for the daemon to exit by itself; its status, reaped.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.has_exited() {
                self.stop_watchdog();
                self.child = None;
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether the daemon has exited (reaping it if so).
    pub fn has_exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().expect("waitpid")
    }

    fn stop_watchdog(&mut self) {
        if let Some((tx, handle)) = self.watchdog.take() {
            drop(tx);
            handle.join().ok();
        }
    }

    /// Sends SIGTERM and waits (bounded) for the daemon to exit; returns its exit status.
    pub fn stop(&mut self) -> ExitStatus {
        self.stop_watchdog();
        let mut child = self.child.take().expect("daemon already stopped");
        // Our unreaped child.
        let _ = kill_process(Pid::from_child(&child), Signal::TERM);
        let deadline = Instant::now() + SHUTDOWN_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().expect("waitpid") {
                return status;
            }
            if Instant::now() > deadline {
                child.kill().ok();
                child.wait().ok();
                panic!(
                    "daemon did not exit within {SHUTDOWN_TIMEOUT:?} of SIGTERM\n--- daemon log ---\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends SIGTERM and asserts that the daemon exits with status 0 in time.
    pub fn terminate(mut self) {
        let status = self.stop();
        assert!(
            status.success(),
            "daemon exited with {status} after SIGTERM\n--- daemon log ---\n{}",
            self.log()
        );
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_watchdog();
        if let Some(mut child) = self.child.take() {
            child.kill().ok();
            child.wait().ok();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- daemon log ({}) ---\n{}",
                self.log.display(),
                self.log()
            );
        }
    }
}

/// The daemon's `--stats-file` once `ready` holds for it, or as last read when `timeout` has
/// passed without that (the caller's assertions then say what is missing). The daemon rewrites
/// the file every 100 ms from counters its I/O threads publish once per loop iteration, so a
/// test waits for the file to count what it did (e.g. `requests` at least the requests it saw
/// answered) before it reads other counters. An error if the file never parsed.
pub fn stats_when(
    stats: &Path,
    timeout: Duration,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> Result<serde_json::Value, String> {
    let mut last = Err(format!("mqblk's stats file {}: not read", stats.display()));
    super::wait::wait_until(timeout, || {
        last = std::fs::read_to_string(stats)
            .map_err(|e| format!("reading mqblk's stats file {}: {e}", stats.display()))
            .and_then(|text| {
                serde_json::from_str(&text).map_err(|e| format!("mqblk's stats file: {e}: {text}"))
            });
        last.as_ref().is_ok_and(&ready)
    });
    last
}

/// A counter of the first export in a stats file read by [`stats_when`].
pub fn export_counter(stats: &serde_json::Value, name: &str) -> u64 {
    stats["exports"][0][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name} in mqblk's stats file: {stats}"))
}

/// How long a reconnect may be refused: the daemon serves one frontend per socket and closes a
/// second one at once, and the previous frontend's close can reach it late (another test thread
/// forking a process holds a copy of that socket until its exec).
pub const RECONNECT_GRACE: Duration = Duration::from_secs(2);

/// Connects a libblkio client, retrying for up to [`RECONNECT_GRACE`] while the daemon refuses
/// it as a second frontend.
pub fn connect_retry(socket: &Path, opts: &ConnectOptions) -> Result<Client, String> {
    let deadline = Instant::now() + RECONNECT_GRACE;
    loop {
        match Client::connect_with(socket, opts) {
            Ok(c) => return Ok(c),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("connect: {e:#}")),
        }
    }
}

/// How many file descriptors process `pid` has open (0 if it cannot be read).
pub fn fd_count(pid: u32) -> usize {
    // A failed read is a failure, not 0: a before/after comparison of two zeros would pass.
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/fd: {e}"))
        .count()
}

/// A libblkio client of `socket` that has been served one read. Once it has, every earlier
/// connection of that export has been torn down (drained, its memory and descriptors let go):
/// the daemon serves one frontend per socket and accepts the next only after that. A test that
/// compares the daemon's descriptors or memory before and after some connections reads them
/// while a probe holds each export, instead of some guessed time after the last client left.
pub fn probe(socket: &Path, opts: &ConnectOptions) -> Client {
    let mut c = connect_retry(socket, opts)
        .unwrap_or_else(|e| panic!("probe of {}: {e}", socket.display()));
    c.read_vec(0, 0, 4096)
        .unwrap_or_else(|e| panic!("probe of {}: read: {e}", socket.display()));
    c
}

/// The unix sockets bound to `path`, from /proc/net/unix: (flags, state) of each. Read instead
/// of connecting, so that the daemon never sees a stray connection. Panics if the table cannot
/// be read: a check that cannot tell must not pass.
fn unix_sockets(path: &Path) -> Vec<(u32, u8)> {
    let table = std::fs::read_to_string("/proc/net/unix")
        .unwrap_or_else(|e| panic!("cannot read /proc/net/unix for {}: {e}", path.display()));
    let want = path.to_string_lossy();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode Path
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 || f[7] != want {
                return None;
            }
            Some((
                u32::from_str_radix(f[3], 16).ok()?,
                u8::from_str_radix(f[5], 16).ok()?,
            ))
        })
        .collect()
}

/// Whether a unix socket bound at `path` is listening (flag __SO_ACCEPTCON).
pub fn is_listening(path: &Path) -> bool {
    unix_sockets(path)
        .iter()
        .any(|&(flags, _)| flags & 0x10000 != 0)
}

/// Connections to the socket at `path` that wait in its backlog, not yet accepted (state
/// SS_CONNECTING: the kernel lists them under the listener's path until they are accepted).
pub fn connections_waiting(path: &Path) -> usize {
    unix_sockets(path)
        .iter()
        .filter(|&&(flags, state)| flags & 0x10000 == 0 && state == 2)
        .count()
}

/// Opens the image for host-side writes while the daemon is stopped (e.g. to corrupt it).
pub fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("opening image")
}

/// A verified workload (`Pattern::Verify`: each job writes its pattern in 4 KiB requests and
/// reads it back) of `ops` writes per job over `queues`, at iodepth 8 with a 10 s I/O timeout;
/// callers change the fields they need otherwise.
pub fn verify_workload(socket: &Path, queues: usize, jobs: usize, ops: u64, seed: u64) -> Workload {
    let mut w = Workload::new(socket);
    w.num_queues = queues;
    w.jobs = jobs;
    w.iodepth = 8;
    w.block_size = 4096;
    w.pattern = Pattern::Verify;
    w.ops_per_job = Some(ops);
    w.seed = seed;
    w.io_timeout = Duration::from_secs(10);
    w
}

/// Patches `expected` (the whole image) with what a [`verify_workload`] run wrote.
pub fn apply_verify(expected: &mut [u8], r: &Report, seed: u64) {
    for j in &r.jobs {
        let (off, len) = (j.region.0 as usize, j.pattern_bytes as usize);
        fill_pattern(&mut expected[off..off + len], off as u64, seed);
    }
}

/// `--export SPEC` as arguments.
pub fn export_arg(spec: impl Into<String>) -> Vec<String> {
    vec!["--export".into(), spec.into()]
}

/// Runs `mqblk serve ARGS`, which must refuse to start within `within`: exit code 1, no
/// panic. Returns stderr from its `mqblk: error:` line on
/// (an error may span lines: a TOML parse error quotes the file).
pub fn serve_fails_stderr(args: &[String], within: Duration) -> String {
    let started = Instant::now();
    let mut cmd = Command::new(mqblk_bin());
    cmd.arg("serve").args(args);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawning mqblk");
    while child.try_wait().expect("waitpid").is_none() {
        if started.elapsed() > within {
            child.kill().ok();
            let out = child.wait_with_output().unwrap();
            panic!(
                "mqblk serve {args:?} is still running after {within:?}: it should have refused to start\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "mqblk serve {args:?}: expected exit code 1 (0, or killed by a signal?); stderr:\n{stderr}"
    );
    assert!(
        !stderr.contains("panicked"),
        "mqblk serve {args:?} panicked:\n{stderr}"
    );
    let at = stderr
        .find("mqblk: error: ")
        .unwrap_or_else(|| panic!("mqblk serve {args:?}: no 'mqblk: error:' line:\n{stderr}"));
    eprintln!(
        "mqblk serve {args:?}\n  -> {} ({:.1} s)",
        stderr[at..].trim_end(),
        started.elapsed().as_secs_f64()
    );
    stderr[at..].trim_end().to_string()
}

/// [`serve_fails_stderr`] for an error of one line, the last of stderr: returns that line.
pub fn serve_fails(args: &[String], within: Duration) -> String {
    let error = serve_fails_stderr(args, within);
    assert!(
        !error.contains('\n') && error.len() > "mqblk: error: ".len() + 10,
        "mqblk serve {args:?}: not one clear line: {error:?}"
    );
    error
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}
