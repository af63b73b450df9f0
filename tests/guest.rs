//! End-to-end test with a real Linux guest.
//!
//! QEMU 10 (TCG, 2 vCPUs) boots the kernel of Debian's linux-image-cloud-amd64 package with a
//! busybox initramfs (`tests/guest/init`, packed by `tests/guest/mkinitramfs.sh`) and one
//! vhost-user-blk-pci disk with 2 queues, served by `mqblk serve` from a 64 MiB raw image. The
//! guest writes a deterministic pattern with O_DIRECT (one writer pinned to each vCPU, so both
//! queues carry requests) and with buffered writes + fsync, drops its caches, reads everything
//! back with O_DIRECT and buffered reads and compares; it reports on its serial console in
//! `MQBLK-GUEST: ...` lines and powers off. This test then checks those lines, checks the image
//! file from the host, sector by sector, against its own copy of the guest's pattern generator
//! (and zeros everywhere the guest did not write), stops mqblk with SIGTERM (it must exit 0),
//! and checks the image again.
//!
//! Needs what `bash .ci/setup` installs: qemu-system-x86_64, busybox-static, cpio, and the guest
//! kernel and virtio_blk module under target/guest. Without them this test fails (on purpose).
//!
//! Environment knobs, for development and for reproducing a failure:
//! - `MQBLK_GUEST_BACKEND=qsd`: serve the disk with qemu-storage-daemon instead of mqblk (to tell
//!   a guest/test problem from an mqblk problem); the default is `mqblk`.
//! - `MQBLK_GUEST_SEED=N`: pattern seed (1..=2147483646); the default is derived from the clock
//!   and printed, and failures print it too.

use std::borrow::Cow;
use std::fs;
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Image size in 512-byte sectors (64 MiB).
const IMAGE_SECTORS: u64 = 128 * 1024;
const SECTOR: usize = 512;
/// Queues of the vhost-user-blk device (and of the backend's export).
const QUEUES: usize = 2;
/// Whole guest run, boot to power-off; it takes about 10 s under TCG on 2 cores.
const GUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// For the backend to create its socket.
const SOCKET_TIMEOUT: Duration = Duration::from_secs(10);
/// For the backend to exit after SIGTERM.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Prefix of the guest's report lines on its console.
const MARK: &str = "MQBLK-GUEST: ";
mod support;
use support::proc::{build_initramfs, spawn_qemu, tool_version, Proc, Qemu};

const SETUP_HINT: &str = "run `bash .ci/setup` from the repository root to install QEMU, \
    busybox-static and the guest kernel";

#[test]
fn guest_writes_and_reads_back_through_vhost_user_blk() {
    let started = Instant::now();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let guest_dir = repo.join("target/guest");
    let kernel = guest_dir.join("vmlinuz");
    assert!(
        kernel.is_file(),
        "guest kernel {} is missing: {SETUP_HINT}",
        kernel.display()
    );
    let qemu_version = tool_version("qemu-system-x86_64");
    let initramfs = build_initramfs(repo, "tests/guest/mkinitramfs.sh");
    let backend = BackendKind::from_env();
    let seed = seed_from_env();

    let run = Run::new(seed);
    eprintln!(
        "guest test: {qemu_version}; backend {backend:?}; seed {seed}; work dir {}",
        run.dir.display()
    );

    let image = fs::File::create(&run.image).expect("create the disk image");
    image
        .set_len(IMAGE_SECTORS * SECTOR as u64)
        .expect("size the disk image");
    drop(image);

    let mut server = run.start_backend(backend);
    if let Err(e) = wait_for_socket(&mut server, &run.socket) {
        run.fail(&[e]);
    }

    let qemu_started = Instant::now();
    let mut qemu = run.start_qemu(&kernel, &initramfs);
    let qemu_status = match qemu.wait_timeout(GUEST_TIMEOUT) {
        Ok(Some(status)) => status,
        Ok(None) => {
            qemu.kill();
            let backend_state = match server.try_wait() {
                Ok(None) => "still running".to_string(),
                Ok(Some(status)) => format!("exited with {status}"),
                Err(e) => format!("unknown: {e}"),
            };
            run.fail(&[format!(
                "the guest did not power off within {GUEST_TIMEOUT:?}; QEMU was killed \
                 ({} {backend_state})",
                server.name
            )]);
        }
        Err(e) => run.fail(&[format!("waiting for QEMU: {e}")]),
    };
    let guest_time = qemu_started.elapsed();

    let mut failures = Vec::new();
    if !qemu_status.success() {
        failures.push(format!("QEMU exited with {qemu_status}"));
    }
    let console = run.console();
    failures.extend(check_guest_report(&console));
    if backend == BackendKind::Mqblk {
        failures.extend(check_write_through(&console, &run.stats));
    }

    // Every write the guest saw complete must be in the file while the backend still runs, and
    // must still be there after it has shut down.
    let image_before = check_image(&run.image, seed);
    let image_ok = image_before.is_empty();
    failures.extend(image_before);
    failures.extend(stop_backend(&mut server));
    if image_ok {
        failures.extend(
            check_image(&run.image, seed)
                .into_iter()
                .map(|f| format!("after the backend exited: {f}")),
        );
    }

    if !failures.is_empty() {
        run.fail(&failures);
    }
    eprintln!(
        "guest test: PASS (guest {:.1} s, total {:.1} s)",
        guest_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// Which daemon serves the disk.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BackendKind {
    Mqblk,
    /// qemu-storage-daemon: only for developing this test (`MQBLK_GUEST_BACKEND=qsd`).
    Qsd,
}

impl BackendKind {
    fn from_env() -> Self {
        match std::env::var("MQBLK_GUEST_BACKEND").as_deref() {
            Err(_) | Ok("") | Ok("mqblk") => BackendKind::Mqblk,
            Ok("qsd") => BackendKind::Qsd,
            Ok(other) => panic!("MQBLK_GUEST_BACKEND={other:?}: expected `mqblk` or `qsd`"),
        }
    }
}

fn seed_from_env() -> u64 {
    match std::env::var("MQBLK_GUEST_SEED") {
        Ok(s) => {
            let seed: u64 = s
                .parse()
                .unwrap_or_else(|e| panic!("MQBLK_GUEST_SEED={s:?}: {e}"));
            assert!(
                (1..PARK_MILLER_M - 1).contains(&seed),
                "MQBLK_GUEST_SEED={seed}: must be in 1..={}",
                PARK_MILLER_M - 2
            );
            seed
        }
        Err(_) => {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            (nanos ^ (u64::from(std::process::id()) << 20)) % (PARK_MILLER_M - 2) + 1
        }
    }
}

/// The files of one test run, all in a temporary directory, which is deleted at the end unless
/// the test failed.
struct Run {
    tmp: Option<tempfile::TempDir>,
    keep: std::cell::Cell<bool>,
    dir: PathBuf,
    seed: u64,
    image: PathBuf,
    socket: PathBuf,
    console: PathBuf,
    qemu_log: PathBuf,
    backend_log: PathBuf,
    /// mqblk's `--stats-file`.
    stats: PathBuf,
}

impl Run {
    fn new(seed: u64) -> Self {
        let tmp = tempfile::Builder::new()
            .prefix("mqblk-guest.")
            .tempdir()
            .expect("create a temporary directory for the image and socket");
        let dir = tmp.path();
        let socket = dir.join("vub.sock");
        // sun_path holds 108 bytes, and mqblk's `--export` takes comma-separated keys.
        assert!(
            socket.as_os_str().len() < 100,
            "socket path {} is too long for a unix socket; set TMPDIR to a shorter directory",
            socket.display()
        );
        assert!(
            !dir.to_string_lossy().contains(','),
            "temporary directory {} contains a comma; set TMPDIR to another directory",
            dir.display()
        );
        Run {
            dir: dir.to_path_buf(),
            keep: std::cell::Cell::new(false),
            seed,
            image: dir.join("disk.img"),
            socket,
            console: dir.join("console.log"),
            qemu_log: dir.join("qemu.log"),
            backend_log: dir.join("backend.log"),
            stats: dir.join("stats.json"),
            tmp: Some(tmp),
        }
    }

    fn log_file(&self, path: &Path) -> fs::File {
        fs::File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()))
    }

    /// Starts the backend serving `self.image` on `self.socket`, stderr and stdout to
    /// `self.backend_log`.
    fn start_backend(&self, kind: BackendKind) -> Proc {
        let log = self.log_file(&self.backend_log);
        let log2 = log.try_clone().expect("duplicate the backend log's fd");
        let mut cmd = match kind {
            BackendKind::Mqblk => {
                let mut cmd = Command::new(env!("CARGO_BIN_EXE_mqblk"));
                // The log goes to a file, which is printed when the test fails: no ANSI colours.
                cmd.env("NO_COLOR", "1");
                cmd.arg("serve")
                    .arg("--export")
                    .arg(format!(
                        "socket={},path={},queues={QUEUES}",
                        self.socket.display(),
                        self.image.display()
                    ))
                    .arg("--stats-file")
                    .arg(&self.stats);
                cmd
            }
            BackendKind::Qsd => {
                let mut cmd = Command::new("qemu-storage-daemon");
                cmd.arg("--blockdev")
                    .arg(format!(
                        "driver=file,node-name=file0,filename={},cache.direct=on",
                        self.image.display()
                    ))
                    .arg("--export")
                    .arg(format!(
                        "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,\
                         addr.path={},writable=on,num-queues={QUEUES}",
                        self.socket.display()
                    ));
                cmd
            }
        };
        cmd.stdin(Stdio::null()).stdout(log2).stderr(log);
        let name = match kind {
            BackendKind::Mqblk => "mqblk",
            BackendKind::Qsd => "qemu-storage-daemon",
        };
        Proc::spawn(name.into(), &mut cmd)
    }

    /// Starts QEMU: serial console to `self.console`, QEMU's own output to `self.qemu_log`.
    fn start_qemu(&self, kernel: &Path, initramfs: &Path) -> Proc {
        let append = format!(
            "console=ttyS0 panic=-1 loglevel=4 mqblk.seed={} mqblk.expect_queues={QUEUES}",
            self.seed
        );
        spawn_qemu(Qemu {
            smp: 2,
            cpu: None,
            socket: &self.socket,
            chardev_extra: String::new(),
            queues: QUEUES,
            console: &self.console,
            kernel,
            initramfs,
            append,
            log: self.log_file(&self.qemu_log),
        })
    }

    fn console(&self) -> String {
        read_lossy(&self.console)
    }

    /// Panics with `failures` and everything needed to debug them; keeps the work directory.
    fn fail(&self, failures: &[String]) -> ! {
        let mut msg = String::from("guest end-to-end test failed:\n");
        for f in failures {
            msg.push_str(&format!("  - {f}\n"));
        }
        for (what, path) in [
            ("guest console", &self.console),
            ("QEMU output", &self.qemu_log),
            ("backend log", &self.backend_log),
        ] {
            msg.push_str(&format!(
                "----- {what} ({}) -----\n{}\n",
                path.display(),
                tail(&read_lossy(path), 200)
            ));
        }
        msg.push_str(&format!(
            "----- end; seed {} (rerun with MQBLK_GUEST_SEED={}); image and logs kept in {} -----",
            self.seed,
            self.seed,
            self.dir.display()
        ));
        self.keep.set(true);
        panic!("{msg}");
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            if self.keep.get() {
                let _ = tmp.keep();
            }
        }
    }
}

fn read_lossy(path: &Path) -> String {
    match fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).replace('\r', ""),
        Err(e) if e.kind() == io::ErrorKind::NotFound => "<not created>".to_string(),
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let skip = lines.len().saturating_sub(n);
    let mut out = String::new();
    if skip > 0 {
        out.push_str(&format!("[... {skip} lines left out ...]\n"));
    }
    out.push_str(&lines[skip..].join("\n"));
    out
}

/// Waits until the backend has created its socket; fails early if the backend exits.
fn wait_for_socket(server: &mut Proc, socket: &Path) -> Result<(), String> {
    let deadline = Instant::now() + SOCKET_TIMEOUT;
    loop {
        if let Ok(meta) = fs::metadata(socket) {
            if meta.file_type().is_socket() {
                return Ok(());
            }
            return Err(format!("{} exists but is not a socket", socket.display()));
        }
        match server.try_wait() {
            Ok(Some(status)) => {
                return Err(format!(
                    "{} exited ({status}) before creating its socket {}",
                    server.name,
                    socket.display()
                ))
            }
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for {}: {e}", server.name)),
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{} did not create its socket {} within {SOCKET_TIMEOUT:?}",
                server.name,
                socket.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends SIGTERM to the backend and expects a clean exit (status 0) within `EXIT_TIMEOUT`.
fn stop_backend(server: &mut Proc) -> Vec<String> {
    let name = server.name.clone();
    match server.try_wait() {
        Ok(Some(status)) => {
            return vec![format!(
                "{name} exited on its own ({status}) before the test sent SIGTERM"
            )]
        }
        Ok(None) => {}
        Err(e) => return vec![format!("checking on {name}: {e}")],
    }
    if let Err(e) = server.signal(libc::SIGTERM) {
        return vec![format!("sending SIGTERM to {name}: {e}")];
    }
    match server.wait_timeout(EXIT_TIMEOUT) {
        Ok(Some(status)) if status.success() => vec![],
        Ok(Some(status)) => vec![format!("{name} exited with {status} after SIGTERM")],
        Ok(None) => {
            server.kill();
            vec![format!(
                "{name} did not exit within {EXIT_TIMEOUT:?} of SIGTERM (killed it)"
            )]
        }
        Err(e) => vec![format!("waiting for {name} after SIGTERM: {e}")],
    }
}

/// Checks the guest's `MQBLK-GUEST:` lines; returns what is wrong.
fn check_guest_report(console: &str) -> Vec<String> {
    // The kernel may print on the same console; the marker can follow other output on a line.
    let report: Vec<&str> = console
        .lines()
        .filter_map(|l| l.find(MARK).map(|i| l[i + MARK.len()..].trim()))
        .collect();
    if report.is_empty() {
        return vec![
            "the guest printed no MQBLK-GUEST lines (did the kernel boot and run /init?)".into(),
        ];
    }
    let results: Vec<&str> = report
        .iter()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .collect();
    // The guest stops at its first failure, so there is no point in listing what is missing.
    match results.as_slice() {
        ["PASS"] => {}
        [] => return vec!["the guest printed no RESULT line (it crashed or hung)".into()],
        [one] => return vec![format!("the guest reported: RESULT {one}")],
        many => return vec![format!("the guest printed several RESULT lines: {many:?}")],
    }
    // It passed: check that it really did everything, and what it saw.
    let mut failures = Vec::new();
    // `key=value` words of all report lines.
    let value = |key: &str| {
        report
            .iter()
            .flat_map(|l| l.split_whitespace())
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    };
    match value("queues") {
        Some(q) if q == QUEUES.to_string() => {}
        Some(q) => failures.push(format!(
            "the guest saw {q} queues on vda, expected {QUEUES}"
        )),
        None => failures.push("the guest did not report its queue count".into()),
    }
    match value("size-sectors") {
        Some(s) if s == IMAGE_SECTORS.to_string() => {}
        Some(s) => failures.push(format!(
            "the guest saw a disk of {s} sectors, expected {IMAGE_SECTORS}"
        )),
        None => failures.push("the guest did not report the disk size".into()),
    }
    // Interrupts per queue: every queue carried requests, so every queue must have signalled.
    match report.iter().find_map(|l| l.strip_prefix("irqs")) {
        Some(irqs) => {
            let counts: Vec<(&str, u64)> = irqs
                .split_whitespace()
                .filter_map(|w| {
                    let (q, n) = w.split_once('=')?;
                    Some((q, n.parse().ok()?))
                })
                .collect();
            if counts.len() != QUEUES || counts.iter().any(|&(_, n)| n == 0) {
                failures.push(format!(
                    "expected interrupts on all {QUEUES} queues, the guest saw:{irqs}"
                ));
            }
        }
        None => failures.push("the guest did not report its per-queue interrupts".into()),
    }
    for region in ["Z", "A", "B", "C"] {
        for mode in ["direct", "buffered"] {
            let ok = format!("verify-{mode} {region} OK ");
            if !report.iter().any(|l| l.starts_with(&ok)) {
                failures.push(format!("no `{}` line from the guest", ok.trim_end()));
            }
        }
    }
    failures
}

/// The guest turned the write cache off and rewrote region A (4 MiB in 64 KiB O_DIRECT
/// writes): mqblk must have submitted those writes with RWF_DSYNC (its `sync_writes` counter,
/// zero before the switch since nothing else writes through).
fn check_write_through(console: &str, stats: &Path) -> Vec<String> {
    if !console.contains("MQBLK-GUEST: write-through t=") {
        return vec!["the guest did not switch the disk to write-through (see its report)".into()];
    }
    // The stats file is rewritten every 100 ms.
    std::thread::sleep(Duration::from_millis(300));
    let text = match fs::read_to_string(stats) {
        Ok(t) => t,
        Err(e) => {
            return vec![format!(
                "reading mqblk's stats file {}: {e}",
                stats.display()
            )]
        }
    };
    let v: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => return vec![format!("mqblk's stats file: {e}: {text}")],
    };
    match v["exports"][0]["sync_writes"].as_u64() {
        Some(n) if n >= 64 => vec![],
        Some(n) => vec![format!(
            "after the guest chose write-through, mqblk wrote only {n} requests with RWF_DSYNC \
             (expected at least 64)"
        )],
        None => vec![format!("no sync_writes in mqblk's stats file: {text}")],
    }
}

/// What the guest leaves in one region of the disk (see the layout in tests/guest/init).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Content {
    Zeros,
    Pattern,
}

/// The guest's disk layout: (name, first LBA, sectors, content), in LBA order, covering the
/// whole disk. Must match tests/guest/init.
fn layout(sectors: u64) -> Vec<(&'static str, u64, u64, Content)> {
    let c = sectors - 2048;
    vec![
        ("Z", 0, 2048, Content::Zeros),
        ("A", 2048, 8192, Content::Pattern),
        ("gap A-B", 10240, 16384 - 10240, Content::Zeros),
        ("B", 16384, 8192, Content::Pattern),
        ("gap B-C", 24576, c - 24576, Content::Zeros),
        ("C", c, 2048, Content::Pattern),
    ]
}

const PARK_MILLER_M: u64 = 2_147_483_647;

fn park_miller(v: u64) -> u64 {
    v * 16807 % PARK_MILLER_M
}

/// The guest's data pattern; a copy of `gen_pattern` in tests/guest/init (which documents it).
struct Pattern {
    seed: u64,
    bodies: Vec<Vec<u8>>,
}

impl Pattern {
    fn new(seed: u64) -> Self {
        let bodies = (0..64u64)
            .map(|k| {
                let mut y = (seed + k * 104_729) % (PARK_MILLER_M - 1) + 1;
                let mut body = String::with_capacity(448);
                for _ in 0..28 {
                    let a = park_miller(y);
                    y = park_miller(a);
                    body.push_str(&format!("{a:08x}{:07x}\n", y % (1 << 28)));
                }
                assert_eq!(body.len(), 448);
                body.into_bytes()
            })
            .collect();
        Pattern { seed, bodies }
    }

    fn sector(&self, lba: u64) -> Vec<u8> {
        let x = park_miller((self.seed + lba * 7919) % (PARK_MILLER_M - 1) + 1);
        let header = format!("mqblk seed={:010} lba={lba:010} x={x:08x}", self.seed);
        let mut s = format!("{header:<63}\n").into_bytes();
        s.extend_from_slice(&self.bodies[(x % 64) as usize]);
        assert_eq!(s.len(), SECTOR);
        s
    }
}

/// Compares the image file with what the guest should have left in it.
fn check_image(image: &Path, seed: u64) -> Vec<String> {
    let data = match fs::read(image) {
        Ok(d) => d,
        Err(e) => return vec![format!("reading the image {}: {e}", image.display())],
    };
    let expected_len = IMAGE_SECTORS as usize * SECTOR;
    if data.len() != expected_len {
        return vec![format!(
            "the image is {} bytes, expected {expected_len}",
            data.len()
        )];
    }
    let pattern = Pattern::new(seed);
    let zeros = vec![0u8; SECTOR];
    let mut failures = Vec::new();
    for (name, start, count, content) in layout(IMAGE_SECTORS) {
        let mut bad = 0u64;
        let mut first = None;
        for lba in start..start + count {
            let got = &data[lba as usize * SECTOR..(lba as usize + 1) * SECTOR];
            let want: Cow<[u8]> = match content {
                Content::Zeros => Cow::Borrowed(&zeros),
                Content::Pattern => Cow::Owned(pattern.sector(lba)),
            };
            if got != &*want {
                bad += 1;
                first.get_or_insert_with(|| (lba, got.to_vec(), want.into_owned()));
            }
        }
        if let Some((lba, got, want)) = first {
            // Show 64 bytes around the first difference within the sector.
            let at = got.iter().zip(&want).position(|(g, w)| g != w).unwrap_or(0);
            let from = at.saturating_sub(16).min(SECTOR - 64);
            failures.push(format!(
                "image region {name} ({content:?}, LBA {start}+{count}): {bad} sectors differ; \
                 first at LBA {lba}, byte {at}; bytes {from}..{}:\n      found    {:?}\n      \
                 expected {:?}",
                from + 64,
                String::from_utf8_lossy(&got[from..from + 64]),
                String::from_utf8_lossy(&want[from..from + 64]),
            ));
        }
    }
    failures
}

#[test]
fn pattern_matches_the_guest_generator() {
    // Sector 2048 with seed 12345, as generated by tests/guest/init's awk (busybox 1.35).
    let s = Pattern::new(12345).sector(2048);
    assert_eq!(
        &s[..64],
        format!(
            "{:<63}\n",
            "mqblk seed=0000012345 lba=0000002048 x=03457855"
        )
        .as_bytes()
    );
    assert_eq!(&s[64..80], b"2794ce62a79983b\n");
    assert_eq!(&s[496..], b"180a1456dbd266e\n");
}

#[test]
fn guest_report_failures_are_detected() {
    let good = "junk\nMQBLK-GUEST: queues=2\r\nMQBLK-GUEST: size-sectors=131072 write-cache=x\n\
        MQBLK-GUEST: irqs req.0=5 req.1=7\n"
        .to_string()
        + &["Z", "A", "B", "C"]
            .iter()
            .flat_map(|r| {
                ["direct", "buffered"].map(|m| format!("MQBLK-GUEST: verify-{m} {r} OK 00\n"))
            })
            .collect::<String>();
    assert_eq!(
        check_guest_report(&(good.clone() + "[ 1.0] x MQBLK-GUEST: RESULT PASS\n")),
        Vec::<String>::new()
    );
    let failed = check_guest_report(&(good.clone() + "MQBLK-GUEST: RESULT FAIL verify A\n"));
    assert!(failed[0].contains("FAIL verify A"), "{failed:?}");
    let one_irq = good.replace("req.1=7", "req.1=0") + "MQBLK-GUEST: RESULT PASS\n";
    assert_eq!(check_guest_report(&one_irq).len(), 1);
    let early_pass =
        good.replace("MQBLK-GUEST: verify-buffered C OK 00\n", "") + "MQBLK-GUEST: RESULT PASS\n";
    assert_eq!(
        check_guest_report(&early_pass),
        vec!["no `verify-buffered C OK` line from the guest".to_string()]
    );
    let three = good.replace("queues=2", "queues=3") + "MQBLK-GUEST: RESULT PASS\n";
    assert!(check_guest_report(&three)[0].contains("3 queues"));
    assert_eq!(check_guest_report("no report").len(), 1);
}

#[test]
fn image_check_detects_misplaced_and_corrupt_data() {
    let dir = tempfile::tempdir().expect("create a temporary directory");
    let path = dir.path().join("disk.img");
    let seed = 4242;
    let pattern = Pattern::new(seed);
    let mut image = vec![0u8; IMAGE_SECTORS as usize * SECTOR];
    for (_, start, count, content) in layout(IMAGE_SECTORS) {
        if content == Content::Pattern {
            for lba in start..start + count {
                let at = lba as usize * SECTOR;
                image[at..at + SECTOR].copy_from_slice(&pattern.sector(lba));
            }
        }
    }
    fs::write(&path, &image).expect("write the image");
    assert_eq!(check_image(&path, seed), Vec::<String>::new());
    assert_eq!(
        check_image(&path, seed + 1).len(),
        3,
        "wrong seed: A, B and C differ"
    );

    // One flipped byte in B, and A's last sector also written one sector too far (into the gap).
    image[16500 * SECTOR + 300] ^= 1;
    let last_a = 10239 * SECTOR;
    image.copy_within(last_a..last_a + SECTOR, last_a + SECTOR);
    fs::write(&path, &image).expect("write the image");
    let failures = check_image(&path, seed);
    assert_eq!(failures.len(), 2, "{failures:#?}");
    assert!(failures[0].contains("region gap A-B") && failures[0].contains("LBA 10240,"));
    assert!(failures[1].contains("region B ") && failures[1].contains("LBA 16500, byte 300;"));
}
