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
//! Tests: `guest_writes_and_reads_back_through_vhost_user_blk` (the raw image above) and
//! `guest_writes_and_reads_back_through_a_qcow2_overlay`: the same guest run on a `format=qcow2`
//! export, an overlay with 2 MiB clusters that mqblk creates over a raw base image
//! (`backing=base.raw,backing-format=raw`); and
//! `guest_writes_and_reads_back_through_a_qcow2_overlay_with_metadata_commit_flush`, the same
//! with `metadata-commit=flush` (the guest's fsync writes the tables back and unmarks the
//! image; the image is checked, by QEMU, while mqblk still serves it). The base holds zeros where the guest expects zeros
//! and other data (the pattern of another seed) where the guest writes, so every guest write
//! into a cluster of the overlay that is not yet allocated copies the rest of the cluster from
//! the base, and that old data must be overwritten by the guest's later writes: its 64 KiB
//! writes fill each 2 MiB cluster in 32 steps, and its two parallel O_DIRECT writers (one per
//! queue) meet in one cluster. The image checks read the guest-visible bytes through QEMU
//! (`qemu-img convert -O raw`); after mqblk has exited, `qemu-img check` must find the image
//! clean (exit 0) and the base must be unchanged.
//!
//! Needs what `bash .ci/setup` installs: qemu-system-x86_64, qemu-img, busybox-static, cpio,
//! and the guest kernel and virtio_blk module under target/guest. Without them this test fails
//! (on purpose).
//!
//! Environment knobs, for development and for reproducing a failure:
//! - `MQBLK_GUEST_BACKEND=qsd`: serve the disk with qemu-storage-daemon instead of mqblk (to tell
//!   a guest/test problem from an mqblk problem); the default is `mqblk`. For the qcow2 test,
//!   qemu-img creates the same overlay and qemu-storage-daemon serves it.
//! - `MQBLK_GUEST_SEED=N`: pattern seed (1..=2147483646); the default is derived from the clock
//!   and printed, and failures print it too.
//! - `MQBLK_GUEST_KEEP=1`: keep the work directory (image, console, logs) even when the test
//!   passes.
mod support;

use std::borrow::Cow;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::daemon::{stats_when, write_image, SHUTDOWN_TIMEOUT, STARTUP_TIMEOUT};
use support::proc::Proc;
use support::qemu::{
    failure_list, log_section, mqblk_serve, park_miller, read_lossy, report_line, result_failure,
    seed_from_env, word_value, GuestBoot, Qemu, WorkDir, PARK_MILLER_M,
};
use support::qemu_img::qemu_img;

/// Image size in 512-byte sectors (64 MiB).
const IMAGE_SECTORS: u64 = 128 * 1024;
const SECTOR: usize = 512;
/// Queues of the vhost-user-blk device (and of the backend's export).
const QUEUES: usize = 2;
/// Whole guest run, boot to power-off; it takes about 10 s under TCG on 2 cores.
const GUEST_TIMEOUT: Duration = Duration::from_secs(120);

#[test]
fn guest_writes_and_reads_back_through_vhost_user_blk() {
    guest_run(Disk::Raw);
}

#[test]
fn guest_writes_and_reads_back_through_a_qcow2_overlay() {
    guest_run(Disk::Qcow2 {
        flush_commit: false,
    });
}

#[test]
fn guest_writes_and_reads_back_through_a_qcow2_overlay_with_metadata_commit_flush() {
    guest_run(Disk::Qcow2 { flush_commit: true });
}

/// The tests run one at a time: each runs a TCG guest on a small machine.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The guest run on a disk stored as `disk`, and every check of it (see the top of this file).
fn guest_run(disk: Disk) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let boot = GuestBoot::prepare("tests/guest/mkinitramfs.sh");
    let backend = BackendKind::from_env();
    let seed = seed_from_env();

    let run = Run::new(seed, disk);
    eprintln!(
        "guest test: {}; backend {backend:?}; {disk:?} disk; seed {seed}; work dir {}",
        boot.qemu_version,
        run.dir.path.display()
    );

    let base = run.prepare_disk(backend);

    let mut server = run.start_backend(backend);
    if let Err(e) = server.wait_for_socket(&run.dir.socket, STARTUP_TIMEOUT, || true) {
        run.fail(&[e]);
    }

    let qemu_started = Instant::now();
    let mut qemu = run.start_qemu(&boot);
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

    // Every write the guest saw complete must be in the image while the backend still runs,
    // and must still be there after it has shut down. (On qcow2 too: the guest's fsync of
    // region B flushed everything written before it, and the write-through rewrite of region A
    // after it lands in clusters allocated before it.) qemu-storage-daemon offers the disk
    // write-through, so the guest sends no flush, and keeps the qcow2 metadata in memory: with
    // it, the qcow2 image is checked only after it has exited.
    let mut image_ok = true;
    if !(matches!(disk, Disk::Qcow2 { .. }) && backend == BackendKind::Qsd) {
        let image_before = run.check_disk();
        image_ok = image_before.is_empty();
        failures.extend(image_before);
    }
    failures.extend(server.terminate(SHUTDOWN_TIMEOUT));
    if let Some(base) = base {
        failures.extend(check_qcow2_image(&run.dir.image));
        if fs::read(&run.base).ok().as_ref() != Some(&base) {
            failures.push(format!(
                "the backing image {} was written to",
                run.base.display()
            ));
        }
    }
    if image_ok {
        failures.extend(
            run.check_disk()
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

/// How the guest's disk is stored.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Disk {
    /// A raw image: the file holds the guest's bytes.
    Raw,
    /// A qcow2 overlay with `QCOW2_CLUSTER` clusters over a raw base image (see the top of this
    /// file); QEMU reads the guest's bytes out of it for the checks. `flush_commit`: served
    /// with `metadata-commit=flush`.
    Qcow2 { flush_commit: bool },
}

/// The qcow2 overlay's cluster size: larger than the guest's 64 KiB writes, so that each first
/// write into a cluster copies the rest of it from the base, and large enough that the two
/// O_DIRECT writers of region A (a half each, 2 MiB) meet in one cluster.
const QCOW2_CLUSTER: &str = "2M";

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

/// One test run: its files, in a [`WorkDir`], and its seed.
struct Run {
    dir: WorkDir,
    seed: u64,
    disk: Disk,
    /// The qcow2 overlay's backing image (`Disk::Qcow2`).
    base: PathBuf,
    backend_log: PathBuf,
    /// mqblk's `--stats-file`.
    stats: PathBuf,
}

impl Run {
    fn new(seed: u64, disk: Disk) -> Self {
        let mut dir = WorkDir::new("mqblk-guest.");
        if matches!(disk, Disk::Qcow2 { .. }) {
            dir.image = dir.path.join("disk.qcow2");
        }
        Run {
            seed,
            disk,
            base: dir.path.join("base.raw"),
            backend_log: dir.path.join("backend.log"),
            stats: dir.path.join("stats.json"),
            dir,
        }
    }

    /// Writes the raw image; for qcow2, the base image (returned, to check later that it was
    /// not written), and for qemu-storage-daemon the overlay (mqblk creates its own).
    fn prepare_disk(&self, kind: BackendKind) -> Option<Vec<u8>> {
        let size = IMAGE_SECTORS * SECTOR as u64;
        match self.disk {
            Disk::Raw => {
                write_image(&self.dir.image, size, None);
                None
            }
            Disk::Qcow2 { .. } => {
                let base = base_image(self.seed);
                fs::write(&self.base, &base)
                    .unwrap_or_else(|e| panic!("writing {}: {e}", self.base.display()));
                if kind == BackendKind::Qsd {
                    let image = self.dir.image.display().to_string();
                    let cluster = format!("cluster_size={QCOW2_CLUSTER}");
                    match qemu_img(&[
                        "create", "-f", "qcow2", "-o", &cluster, "-b", "base.raw", "-F", "raw",
                        &image,
                    ]) {
                        Ok((0, _)) => {}
                        Ok((code, out)) => panic!("qemu-img create exited {code}: {out}"),
                        Err(e) => panic!("{e}"),
                    }
                }
                Some(base)
            }
        }
    }

    /// Starts the backend serving the image on the socket, stderr and stdout to
    /// `self.backend_log`.
    fn start_backend(&self, kind: BackendKind) -> Proc {
        let (name, mut cmd) = match kind {
            BackendKind::Mqblk => {
                let bin = Path::new(env!("CARGO_BIN_EXE_mqblk"));
                let mut cmd = match self.disk {
                    Disk::Raw => mqblk_serve(bin, &self.dir, QUEUES),
                    Disk::Qcow2 { flush_commit } => {
                        // mqblk creates the overlay (the backing path as given: relative to
                        // the overlay's directory).
                        let export = format!(
                            "socket={},path={},queues={QUEUES},format=qcow2,backing=base.raw,\
                             backing-format=raw,cluster-size={QCOW2_CLUSTER},\
                             metadata-commit={}",
                            self.dir.socket.display(),
                            self.dir.image.display(),
                            if flush_commit { "flush" } else { "write" }
                        );
                        let mut cmd = Command::new(bin);
                        cmd.env("NO_COLOR", "1")
                            .args(["serve", "--export", &export]);
                        cmd
                    }
                };
                cmd.arg("--stats-file").arg(&self.stats);
                ("mqblk", cmd)
            }
            BackendKind::Qsd => {
                let mut cmd = Command::new("qemu-storage-daemon");
                cmd.arg("--blockdev").arg(format!(
                    "driver=file,node-name=file0,filename={},cache.direct=on",
                    self.dir.image.display()
                ));
                let node = match self.disk {
                    Disk::Raw => "file0",
                    Disk::Qcow2 { .. } => {
                        // The backing image is opened as the overlay's header names it.
                        cmd.arg("--blockdev")
                            .arg("driver=qcow2,node-name=fmt0,file=file0");
                        "fmt0"
                    }
                };
                cmd.arg("--export").arg(format!(
                    "type=vhost-user-blk,id=exp0,node-name={node},addr.type=unix,\
                     addr.path={},writable=on,num-queues={QUEUES}",
                    self.dir.socket.display()
                ));
                ("qemu-storage-daemon", cmd)
            }
        };
        Proc::spawn_logged(name.into(), &mut cmd, &self.backend_log)
    }

    /// Checks the guest's bytes: the raw image's, or what QEMU reads out of the qcow2 overlay.
    fn check_disk(&self) -> Vec<String> {
        match self.disk {
            Disk::Raw => check_image(&self.dir.image, self.seed),
            Disk::Qcow2 { .. } => {
                let out = self.dir.path.join("converted.raw");
                let _ = fs::remove_file(&out);
                let (image, raw) = (
                    self.dir.image.display().to_string(),
                    out.display().to_string(),
                );
                // -U: qemu-storage-daemon (MQBLK_GUEST_BACKEND=qsd) holds QEMU's image locks.
                let failures =
                    match qemu_img(&["convert", "-U", "-f", "qcow2", "-O", "raw", &image, &raw]) {
                        Ok((0, _)) => check_image(&out, self.seed)
                            .into_iter()
                            .map(|f| format!("read through `qemu-img convert`: {f}"))
                            .collect(),
                        Ok((code, text)) => {
                            vec![format!("qemu-img convert {image} exited {code}: {text}")]
                        }
                        Err(e) => vec![e],
                    };
                if failures.is_empty() {
                    let _ = fs::remove_file(&out);
                }
                failures
            }
        }
    }

    fn start_qemu(&self, boot: &GuestBoot) -> Proc {
        let append = format!(
            "console=ttyS0 panic=-1 loglevel=4 mqblk.seed={} mqblk.expect_queues={QUEUES}",
            self.seed
        );
        boot.spawn_qemu(
            &self.dir,
            Qemu {
                smp: 2,
                cpu: None,
                chardev_extra: String::new(),
                queues: QUEUES,
                append,
            },
        )
    }

    fn console(&self) -> String {
        read_lossy(&self.dir.console)
    }

    /// Panics with `failures` and everything needed to debug them; keeps the work directory.
    fn fail(&self, failures: &[String]) -> ! {
        let mut msg = failure_list("guest end-to-end test failed", failures);
        for (what, path) in [
            ("guest console", &self.dir.console),
            ("QEMU output", &self.dir.qemu_log),
            ("backend log", &self.backend_log),
        ] {
            msg.push_str(&log_section(what, path, 200));
        }
        msg.push_str(&self.dir.keep_for(self.seed));
        panic!("{msg}");
    }
}

/// Checks the guest's `MQBLK-GUEST:` lines; returns what is wrong.
fn check_guest_report(console: &str) -> Vec<String> {
    let report: Vec<&str> = console.lines().filter_map(report_line).collect();
    if report.is_empty() {
        return vec![
            "the guest printed no MQBLK-GUEST lines (did the kernel boot and run /init?)".into(),
        ];
    }
    // The guest stops at its first failure, so there is no point in listing what is missing.
    if let Some(f) = result_failure(report.iter().copied()) {
        return vec![f];
    }
    // It passed: check that it really did everything, and what it saw.
    let mut failures = Vec::new();
    // A `key=N` word of any report line.
    let value = |key: &str| report.iter().find_map(|l| word_value(l, key));
    match value("queues") {
        Some(q) if q == QUEUES as u64 => {}
        Some(q) => failures.push(format!(
            "the guest saw {q} queues on vda, expected {QUEUES}"
        )),
        None => failures.push("the guest did not report its queue count".into()),
    }
    match value("size-sectors") {
        Some(s) if s == IMAGE_SECTORS => {}
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
    // The counter only grows: wait (bounded) for the stats file to show all 64.
    let counted = |v: &serde_json::Value| v["exports"][0]["sync_writes"].as_u64();
    match stats_when(stats, Duration::from_secs(10), |v| counted(v) >= Some(64))
        .map(|v| counted(&v))
    {
        Ok(Some(n)) if n >= 64 => vec![],
        Ok(n) => vec![format!(
            "after the guest chose write-through, mqblk wrote only {n:?} requests with \
             RWF_DSYNC (expected at least 64)"
        )],
        Err(e) => vec![e],
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

/// The disk as the layout has it: `pattern` in its pattern extents, zeros elsewhere.
fn patterned_image(pattern: &Pattern) -> Vec<u8> {
    let mut image = vec![0u8; IMAGE_SECTORS as usize * SECTOR];
    for (_, start, count, content) in layout(IMAGE_SECTORS) {
        if content == Content::Pattern {
            for lba in start..start + count {
                let at = lba as usize * SECTOR;
                image[at..at + SECTOR].copy_from_slice(&pattern.sector(lba));
            }
        }
    }
    image
}

/// The qcow2 overlay's base image: zeros where the guest leaves zeros, and where it writes, the
/// pattern of another seed (old data, which must not show through).
fn base_image(seed: u64) -> Vec<u8> {
    patterned_image(&Pattern::new(seed % (PARK_MILLER_M - 2) + 1))
}

/// `qemu-img check` of the qcow2 image: it must find it clean (exit 0: no corruption, no
/// leaked cluster, as after a clean shutdown).
fn check_qcow2_image(image: &Path) -> Vec<String> {
    match qemu_img(&["check", "-f", "qcow2", &image.display().to_string()]) {
        Ok((0, text)) => {
            eprintln!("qemu-img check {}: {}", image.display(), text.trim());
            vec![]
        }
        Ok((code, text)) => vec![format!(
            "qemu-img check {} exited {code} (expected 0):\n{text}",
            image.display()
        )],
        Err(e) => vec![e],
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
    let mut image = patterned_image(&Pattern::new(seed));
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
