//! Reconnect test with a real Linux guest: SIGKILL the backend under load, restart it, and the
//! guest must not notice.
//!
//! QEMU 10 (TCG, 2 vCPUs) boots the kernel of Debian's linux-image-cloud-amd64 package with an
//! initramfs holding busybox and fio (`tests/guest/init-reconnect`, packed by
//! `tests/guest/mkinitramfs-fio.sh`) and one `vhost-user-blk-pci` disk with 2 queues whose
//! chardev has `reconnect-ms`, served by `mqblk serve` from a 160 MiB raw image. The guest runs
//! a write-and-verify workload with fio in passes over a 128 MiB area: each pass discards the
//! area, then 4 fio jobs (libaio, O_DIRECT, iodepth 32, two pinned to each vCPU, so two per
//! queue) write every block of their region once, 4 KiB to 1 MiB at a time, with a flush after
//! every 16 writes, and read it all back and verify it (the data names the pass and the write's
//! offset, so stale or misplaced data does not verify).
//!
//! Meanwhile this test kills mqblk with SIGKILL `DEFAULT_KILLS` times, 0.2 to 1 s apart, each
//! time as soon as the guest shows requests in flight; every other kill is a burst kill: SIGSTOP
//! for 0.1-0.4 s while the guest queues up requests, SIGCONT, and SIGKILL a few ms later while
//! the backend works through the whole batch. A moment later it starts a new mqblk on the same
//! socket and waits until QEMU has reconnected to it. Then it writes a stop marker into the
//! image (the disk's last 4 KiB block), which the guest reads after each pass: it finishes the
//! pass, verifies the whole area once more, and must finish with `RESULT PASS`: no I/O error, no
//! hang, every block verified. This test then checks the image file from the host: the md5 of
//! each 4 MiB chunk matches what the guest read, every 4 KiB block of the fio area holds the
//! last pass's data for a write that covers it, everything else is zeros (but the marker). It
//! stops the last mqblk with SIGTERM (it must exit 0) and checks the image again.
//!
//! A backend without in-flight tracking (VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD) fails this test:
//! QEMU then restarts each ring from its used index, so a request that was in flight behind one
//! that had completed is never executed (fio waits for it forever), and the completed ones
//! after it are executed and completed a second time (the guest's virtio driver sees "id N is
//! not a head!" and stops using the queue). That takes a kill at a moment when the backend has
//! completed requests out of order: flushes complete after the writes fetched behind them, and
//! small writes before big ones, but under TCG the guest is the bottleneck and the backend is
//! often idle, so only about one kill in four catches such a moment; 20 kills catch it in
//! nearly every run. The test sees the guest stall (or that message) and fails with the kill
//! timeline, the guest console and every backend's log. A backend that loses a used-buffer
//! notification in a restart (the guest waits for requests that are complete) fails the same
//! way.
//!
//! Tests: `guest_survives_backend_sigkill_and_restart` (the raw image above, 20 kills) and
//! `guest_survives_backend_sigkill_and_restart_on_qcow2`: the same run with `QCOW2_KILLS` (6)
//! kills on a `format=qcow2` export, an overlay with 64 KiB clusters that the first mqblk
//! creates over a raw base of zeros (`backing=base.raw,backing-format=raw`), so fio's 4 KiB to
//! 1 MiB writes allocate clusters, copy from the base around them, and turn the zero clusters
//! each pass's discard leaves back into data, while the backend is killed. The stop marker goes
//! into the base (the guest never writes that cluster, so it reads it from there). The image
//! checks read the guest's bytes through QEMU (`qemu-img convert -O raw`), and only after the
//! last mqblk has exited (before that, the metadata of writes since the guest's last flush may
//! still be in mqblk's memory); `qemu-img check` must then exit 0 or 3 (leaked clusters only,
//! which a SIGKILL may leave, as with QEMU).
//! `guest_survives_backend_sigkill_and_restart_on_qcow2_with_the_metadata_journal` runs the
//! qcow2 case with `metadata-commit=journal`, each restarted mqblk replaying the journal.
//!
//! Needs what `bash .ci/setup` installs: qemu-system-x86_64, qemu-img, busybox-static, fio, cpio,
//! zstd or gzip, and the guest kernel and virtio_blk module under target/guest. Without them this
//! test fails (on purpose).
//!
//! Environment knobs, for development and for reproducing a failure:
//! - `MQBLK_GUEST_SEED=N`: seed of fio's data and of the kill schedule (1..=2147483646); the
//!   default is derived from the clock and printed, and failures print it too.
//! - `MQBLK_RECONNECT_KILLS=N`: how many times to kill the backend (default 20, 6 on qcow2; 0
//!   runs the same workload for `CONTROL_RUN` without kills, as a control).
//! - `MQBLK_RECONNECT_MQBLK=PATH`: the mqblk binary to test instead of the one cargo built (for
//!   example an older build, to see that this test catches a backend without in-flight
//!   tracking).
//! - `MQBLK_GUEST_KEEP=1`: keep the work directory (image, console, logs) even when the test
//!   passes.

mod support;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::process::Signal;
use support::console::{Sample, Watch};
use support::daemon::{write_image, MIB, SHUTDOWN_TIMEOUT, STARTUP_TIMEOUT};
use support::proc::Proc;
use support::qemu::{
    failure_list, log_section, md5_hex, mqblk_serve, read_lossy, result_failure, seed_from_env,
    tail, word_value, GuestBoot, Qemu, WorkDir, MARK,
};
use support::qemu_img::qemu_img;
use support::rng::XorShift;

/// Image size in MiB.
const IMAGE_MB: u64 = 160;
/// Queues of the vhost-user-blk device (and of the backend's export); also the vCPUs.
const QUEUES: usize = 2;
/// fio jobs in the guest, two per vCPU (so per queue): while one waits for its flush, the other
/// one's writes go on and complete before it.
const JOBS: u64 = 4;
/// The fio area: job j writes [FIO_OFFSET_MB + j * FIO_SIZE_MB, + FIO_SIZE_MB) MiB.
const FIO_OFFSET_MB: u64 = 1;
const FIO_SIZE_MB: u64 = 32;
/// Largest fio write (the guest's --bssplit), for the host's image check.
const FIO_MAX_BS: u64 = MIB;
/// fio's block granularity (smallest write; --bssplit) and the verify pattern's period.
const FIO_MIN_BS: u64 = 4096;
/// The guest fails if the test has not written the stop marker this long after the workload
/// started.
const WORKLOAD_MAX_S: u64 = 240;
/// With no kills (`MQBLK_RECONNECT_KILLS=0`), how long the workload runs before the stop marker.
const CONTROL_RUN: Duration = Duration::from_secs(15);
/// The stop marker, at the start of the image's last 4 KiB block.
const STOP_MARKER: &[u8] = b"MQBLK-STOP";
/// Default number of kills, half of them burst kills. About one kill in four catches the backend
/// with requests in flight behind completed ones (see the top of this file): a backend without
/// in-flight tracking failed within the first 7 kills in each of 6 runs.
const DEFAULT_KILLS: usize = 20;
/// QEMU's reconnect interval (`reconnect-ms` of the chardev).
const RECONNECT_MS: u64 = 100;
/// Between kills (measured from the previous reconnect, or from the start of the workload).
const KILL_GAP_MS: (u64, u64) = (200, 1000);
/// How long the backend stays dead.
const DOWN_MS: (u64, u64) = (100, 400);
/// Burst kills (odd ones): SIGSTOP the backend for `STOP_MS` while the guest queues up requests,
/// SIGCONT, and SIGKILL `BURST_KILL_MS` later, while it works through the whole batch.
const STOP_MS: (u64, u64) = (100, 400);
const BURST_KILL_MS: (u64, u64) = (2, 40);
/// After the gap, wait up to this long for a sample with at least `BUSY_INFLIGHT` requests in
/// flight, then go on anyway.
const BUSY_WAIT: Duration = Duration::from_secs(3);
const BUSY_INFLIGHT: u64 = 8;
/// Kills of the qcow2 run: fewer, so it takes about a minute.
const QCOW2_KILLS: usize = 6;
/// Requests the guest must have completed before the first kill (fio is really running).
const WARMUP_IOS: u64 = 300;
/// Boot to the first kill.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// For QEMU to reconnect to a restarted backend.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// The guest completed no request for this long while some were in flight: it hangs.
const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Whole guest run, boot to power-off (about 45-90 s under TCG on 2 busy cores).
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the console and logs are polled.
const POLL: Duration = Duration::from_millis(20);
#[test]
fn guest_survives_backend_sigkill_and_restart() {
    reconnect_run(Disk::Raw);
}

/// The same on a qcow2 overlay: what mqblk completed must survive its SIGKILL although the
/// guest sends no flush in between (mqblk writes the qcow2 metadata a write changed back before
/// completing it; before it did, fio's verification failed in the first pass with a kill,
/// `got pattern '00'`: the clusters those writes allocated read as zeros after the restart).
#[test]
fn guest_survives_backend_sigkill_and_restart_on_qcow2() {
    reconnect_run(Disk::Qcow2);
}

/// The same with `metadata-commit=journal`: the mappings a write made are only in the journal
/// beside the image when it completes, and each restarted mqblk replays them before the guest
/// reconnects.
#[test]
fn guest_survives_backend_sigkill_and_restart_on_qcow2_with_the_metadata_journal() {
    reconnect_run_with(Disk::Qcow2, "journal");
}

/// How the guest's disk is stored.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Disk {
    /// A raw image: the file holds the guest's bytes, and the test writes the stop marker into
    /// it.
    Raw,
    /// A qcow2 overlay (64 KiB clusters) that the first mqblk creates over a raw base of zeros;
    /// the test writes the stop marker into the base (the guest never writes that cluster) and
    /// reads the guest's bytes through `qemu-img convert`.
    Qcow2,
}

impl Disk {
    /// Kills unless `MQBLK_RECONNECT_KILLS` says otherwise.
    fn default_kills(self) -> usize {
        match self {
            Disk::Raw => DEFAULT_KILLS,
            Disk::Qcow2 => QCOW2_KILLS,
        }
    }
}

/// The tests run one at a time: each runs a TCG guest on a small machine.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The whole test (see the top of this file) on a disk stored as `disk`.
fn reconnect_run(disk: Disk) {
    reconnect_run_with(disk, "write");
}

/// The same, a qcow2 disk served with `metadata-commit=commit`.
fn reconnect_run_with(disk: Disk, commit: &'static str) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let boot = GuestBoot::prepare("tests/guest/mkinitramfs-fio.sh");
    let seed = seed_from_env();
    let kills = kills_from_env(disk.default_kills());
    let mqblk = mqblk_from_env();

    let mut run = Run::new(seed, mqblk, disk);
    run.metadata_commit = commit;
    eprintln!(
        "guest reconnect test: {}; backend {}; {disk:?} disk (metadata-commit={commit}); seed {seed}; {kills} kills; work \
         dir {}",
        boot.qemu_version,
        run.mqblk.display(),
        run.dir.path.display()
    );

    // For qcow2: the base (the first mqblk creates the overlay over it).
    write_image(run.raw_file(), IMAGE_MB * MIB, None);

    run.start_backend();
    if let Err(e) = run.wait_for_socket() {
        run.fail(&[e]);
    }
    let qemu = run.start_qemu(&boot);
    let mut watch = Watch::new(qemu, &run.dir.console, STALL_TIMEOUT, GUEST_TIMEOUT);

    // The kills.
    // The kill schedule, reproducible from the seed.
    let mut rng = XorShift::new(seed);
    let mut failures = Vec::new();
    if let Err(e) = kill_and_restart(&mut run, &mut watch, &mut rng, kills) {
        failures.push(e);
    }
    // Let the guest finish its workload.
    if failures.is_empty() {
        if let Err(e) = write_stop_marker(run.raw_file()) {
            failures.push(e);
        }
        watch.event("stop marker written".into());
    }

    // The guest finishes (or hangs).
    if failures.is_empty() {
        match watch.wait_for(
            GUEST_TIMEOUT.saturating_sub(watch.elapsed()),
            "the guest's RESULT line",
            |w| w.result().map(|_| ()),
        ) {
            Ok(()) => {}
            Err(e) => failures.push(e),
        }
    }
    // After RESULT the guest powers off; give QEMU a moment to exit, then make sure it has.
    let qemu_status = match watch.qemu.wait_timeout(Duration::from_secs(10)) {
        Ok(Some(status)) => Some(status),
        _ => {
            watch.qemu.kill();
            None
        }
    };
    let guest_time = watch.elapsed();
    watch.refresh();
    if failures.is_empty() {
        match qemu_status {
            Some(s) if s.success() => {}
            Some(s) => failures.push(format!("QEMU exited with {s}")),
            None => failures.push("QEMU did not exit after the guest's RESULT line".into()),
        }
        failures.extend(check_guest_report(&watch, &run.kills));
    }
    if failures.is_empty() {
        // Every write the guest saw complete must be in the file while the backend still runs,
        // and must still be there after it has shut down. (Not so on qcow2 while mqblk runs:
        // the metadata of writes after the guest's last flush may still be in mqblk's memory.)
        let md5s = guest_md5s(&watch);
        let passes = watch.value("workload-done", "passes").unwrap_or(0);
        let mut image_ok = true;
        if disk == Disk::Raw {
            let image_before = check_image(&run.dir.image, seed, passes, &md5s);
            image_ok = image_before.is_empty();
            failures.extend(image_before);
        }
        failures.extend(run.stop_backend());
        if disk == Disk::Qcow2 {
            failures.extend(check_qcow2_image(&run.dir.image));
        }
        if image_ok {
            let after = match disk {
                Disk::Raw => check_image(&run.dir.image, seed, passes, &md5s),
                Disk::Qcow2 => match guest_bytes(&run.dir.image, &run.dir.path) {
                    Ok(raw) => check_image(&raw, seed, passes, &md5s)
                        .into_iter()
                        .map(|f| format!("read through `qemu-img convert`: {f}"))
                        .collect(),
                    Err(e) => vec![e],
                },
            };
            failures.extend(
                after
                    .into_iter()
                    .map(|f| format!("after the backend exited: {f}")),
            );
        }
    }

    let summary = run.summary(&watch);
    if !failures.is_empty() {
        run.fail_with(&failures, &summary, &watch);
    }
    eprintln!(
        "guest reconnect test: PASS (guest {:.1} s, total {:.1} s)\n{summary}",
        guest_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// Waits for the workload, then kills and restarts the backend `kills` times.
fn kill_and_restart(
    run: &mut Run,
    watch: &mut Watch,
    rng: &mut XorShift,
    kills: usize,
) -> Result<(), String> {
    watch.wait_for(START_TIMEOUT, "the guest's workload to start", |w| {
        w.find("workload-start")?;
        let s = w.samples.last()?;
        (s.ios >= WARMUP_IOS).then_some(())
    })?;
    let workload_started = watch.elapsed();
    watch.event(format!(
        "workload running (ios={})",
        watch.samples.last().map_or(0, |s| s.ios)
    ));
    if kills == 0 {
        watch.run_for(CONTROL_RUN)?;
    }
    for n in 1..=kills {
        let gap = Duration::from_millis(rng.range(KILL_GAP_MS));
        watch.run_for(gap)?;
        if watch.find("workload-done").is_some() {
            return Err(format!(
                "the guest's workload ended ({:.1} s after it started) before kill {n}, without \
                 the stop marker",
                (watch.elapsed() - workload_started).as_secs_f64()
            ));
        }
        // Kill while the guest has requests in flight: as soon as a new sample shows some (fio
        // spends a good part of each pass starting up, under TCG).
        let busy_since = watch.samples.len();
        let busy_until = Instant::now() + BUSY_WAIT;
        while Instant::now() < busy_until
            && !(watch.samples.len() > busy_since
                && watch
                    .samples
                    .last()
                    .is_some_and(|s| s.inflight >= BUSY_INFLIGHT))
        {
            std::thread::sleep(POLL);
            watch.check()?;
        }
        let how = if n % 2 == 1 {
            // A burst kill: stop the backend while the guest queues up requests, let it fetch
            // them all at once and submit them in one batch, and kill it while it works through
            // them (writes complete in the order the host finishes them, flushes later).
            let stop = Duration::from_millis(rng.range(STOP_MS));
            let after = Duration::from_millis(rng.range(BURST_KILL_MS));
            run.signal_backend(Signal::STOP)?;
            watch.event(format!("kill {n}: SIGSTOP {}", run.backend_name()));
            watch.run_for(stop)?;
            run.signal_backend(Signal::CONT)?;
            std::thread::sleep(after);
            format!(
                "burst: stopped {:.2} s, killed {} ms after SIGCONT",
                stop.as_secs_f64(),
                after.as_millis()
            )
        } else {
            "plain".to_string()
        };
        let before = watch.samples.last().cloned();
        let at = watch.elapsed();
        let console_at = watch.console.len();
        run.kill_backend();
        let down = Duration::from_millis(rng.range(DOWN_MS));
        run.kills.push(Kill {
            n,
            how: how.clone(),
            at,
            down,
            reconnected: None,
            before: before.clone(),
            console_at,
            console_reconnected: None,
        });
        watch.event(format!(
            "kill {n} ({how}): SIGKILL {} (last guest sample: {})",
            run.backend_name(),
            before.as_ref().map_or("none".into(), |s| s.to_string())
        ));
        watch.run_for(down)?;
        run.start_backend();
        watch.event(format!("restart {n}: started {}", run.backend_name()));
        run.wait_for_socket()?;
        let log = run.backends.last().expect("just started").log.clone();
        watch.wait_for(
            RECONNECT_TIMEOUT,
            "QEMU to reconnect to the restarted backend",
            |_| {
                read_lossy(&log)
                    .contains("frontend connected")
                    .then_some(())
            },
        )?;
        let kill = run.kills.last_mut().expect("pushed above");
        kill.reconnected = Some(watch.elapsed() - at);
        kill.console_reconnected = Some(watch.console.len());
        watch.event(format!(
            "reconnect {n}: QEMU connected to {}",
            run.backend_name()
        ));
    }
    Ok(())
}

/// One kill and restart, as it happened.
struct Kill {
    n: usize,
    /// "plain" or "burst ...".
    how: String,
    /// Since QEMU started.
    at: Duration,
    /// How long the backend stayed dead.
    down: Duration,
    /// When QEMU had connected to the new backend, after the kill (None: it had not).
    reconnected: Option<Duration>,
    /// The guest's last sample before the kill.
    before: Option<Sample>,
    /// Console length at the kill and at the reconnect.
    console_at: usize,
    console_reconnected: Option<usize>,
}

/// Checks the guest's report after RESULT PASS; returns what is wrong.
fn check_guest_report(w: &Watch, kills: &[Kill]) -> Vec<String> {
    let mut failures = Vec::new();
    if let Some(f) = result_failure(w.report.iter().map(|(_, l)| l.as_str())) {
        return vec![f];
    }
    match w.value("queues=", "queues") {
        Some(q) if q == QUEUES as u64 => {}
        Some(q) => failures.push(format!(
            "the guest saw {q} queues on vda, expected {QUEUES}"
        )),
        None => failures.push("the guest did not report its queue count".into()),
    }
    let area_sectors = JOBS * FIO_SIZE_MB * MIB / 512;
    let passes = w.value("workload-done", "passes").unwrap_or(0);
    if passes < 2 {
        failures.push(format!(
            "the guest ran {passes} fio passes, expected at least 2"
        ));
    }
    for p in 1..=passes {
        let prefix = format!("pass {p} done ");
        match w.find(&prefix) {
            Some((_, line)) => {
                // Every block written once and read back once (more is fine: the kernel may
                // split nothing, but fio never writes less than the area).
                for key in ["wsect", "rsect"] {
                    match word_value(line, key) {
                        Some(n) if n >= area_sectors => {}
                        other => failures.push(format!(
                            "pass {p}: {key}={other:?}, expected at least {area_sectors} \
                             (the whole fio area)"
                        )),
                    }
                }
                if word_value(line, "flushes").unwrap_or(0) == 0 {
                    failures.push(format!("pass {p}: the guest sent no flush request"));
                }
            }
            None => failures.push(format!("no `pass {p} done` line from the guest")),
        }
    }
    if w.find("stop-seen").is_none() {
        failures.push("the guest did not report that it saw the stop marker".into());
    }
    match w.find("final-verify OK") {
        Some((_, line)) => match word_value(line, "rsect") {
            Some(n) if n >= area_sectors => {}
            other => failures.push(format!(
                "final verify read rsect={other:?}, expected at least {area_sectors}"
            )),
        },
        None => failures.push("no `final-verify OK` line from the guest".into()),
    }
    match w.find("dmesg-io-errors") {
        Some((_, "dmesg-io-errors 0")) => {}
        Some((_, line)) => failures.push(format!("the guest reported {line}")),
        None => failures.push("the guest did not report its kernel's I/O errors".into()),
    }
    // Every kill must have caught the workload running.
    if let Some((done_at, _)) = w.find("workload-done") {
        for k in kills {
            if k.console_at > done_at {
                failures.push(format!(
                    "kill {} came after the guest's workload had ended",
                    k.n
                ));
            }
        }
    }
    failures
}

/// The guest's "md5 LBA COUNT HEX" lines.
fn guest_md5s(w: &Watch) -> Vec<(u64, u64, String)> {
    w.report
        .iter()
        .filter_map(|(_, l)| {
            let mut it = l.strip_prefix("md5 ")?.split_whitespace();
            let lba = it.next()?.parse().ok()?;
            let count = it.next()?.parse().ok()?;
            let hex = it.next()?.to_string();
            Some((lba, count, hex))
        })
        .collect()
}

/// Checks the image file: the guest's md5s, the last pass's pattern over the fio area, the stop
/// marker, zeros elsewhere.
fn check_image(image: &Path, seed: u64, passes: u64, md5s: &[(u64, u64, String)]) -> Vec<String> {
    let data = match fs::read(image) {
        Ok(d) => d,
        Err(e) => return vec![format!("reading the image {}: {e}", image.display())],
    };
    if data.len() as u64 != IMAGE_MB * MIB {
        return vec![format!(
            "the image is {} bytes, expected {}",
            data.len(),
            IMAGE_MB * MIB
        )];
    }
    let mut failures = Vec::new();
    // The guest's view of each chunk of the fio area, as md5s.
    let chunks = JOBS * FIO_SIZE_MB / 4;
    if md5s.len() as u64 != chunks {
        failures.push(format!(
            "the guest printed {} md5 lines, expected {chunks}",
            md5s.len()
        ));
    }
    for (lba, count, want) in md5s {
        let (start, len) = ((lba * 512) as usize, (count * 512) as usize);
        let Some(slice) = data.get(start..start + len) else {
            failures.push(format!(
                "guest md5 of LBA {lba}+{count} is outside the image"
            ));
            continue;
        };
        match md5_hex(slice) {
            Ok(got) if &got == want => {}
            Ok(got) => failures.push(format!(
                "image LBA {lba}+{count}: md5 {got}, the guest read {want}"
            )),
            Err(e) => failures.push(e),
        }
    }
    // Block by block.
    let area = (
        FIO_OFFSET_MB * MIB,
        (FIO_OFFSET_MB + JOBS * FIO_SIZE_MB) * MIB,
    );
    let mut bad_zero = (0u64, None);
    let mut bad_pattern = (0u64, None);
    for b in (0..IMAGE_MB * MIB).step_by(FIO_MIN_BS as usize) {
        let block = &data[b as usize..(b + FIO_MIN_BS) as usize];
        if b == STOP_BLOCK {
            let mut want = vec![0u8; FIO_MIN_BS as usize];
            want[..STOP_MARKER.len()].copy_from_slice(STOP_MARKER);
            if block != want.as_slice() {
                failures.push(format!(
                    "the stop block at byte offset {b} holds something else than the marker"
                ));
            }
        } else if b < area.0 || b >= area.1 {
            if block.iter().any(|&x| x != 0) {
                bad_zero.0 += 1;
                bad_zero.1.get_or_insert(b);
            }
        } else if let Err(e) = check_pattern_block(block, b, seed, passes) {
            bad_pattern.0 += 1;
            bad_pattern.1.get_or_insert(format!("byte offset {b}: {e}"));
        }
    }
    if let (n, Some(first)) = bad_zero {
        failures.push(format!(
            "{n} blocks of 4 KiB outside the fio area are not zeros (first at byte offset {first})"
        ));
    }
    if let (n, Some(first)) = bad_pattern {
        failures.push(format!(
            "{n} blocks of 4 KiB of the fio area do not hold pass {passes}'s data (first: {first})"
        ));
    }
    failures
}

/// A 4 KiB block of the fio area at byte offset `b` must be fio's verify pattern of pass
/// `pass` (tests/guest/init-reconnect, fio_run): 16-byte records, seed and pass as big-endian
/// u32, then the byte offset of the write that covered the block as a little-endian u64; that
/// write starts at most `FIO_MAX_BS` before the block, on a 4 KiB boundary, in the same job's
/// region.
fn check_pattern_block(block: &[u8], b: u64, seed: u64, pass: u64) -> Result<(), String> {
    let mut tag = [0u8; 8];
    tag[..4].copy_from_slice(&(seed as u32).to_be_bytes());
    tag[4..].copy_from_slice(&(pass as u32).to_be_bytes());
    if block[..8] != tag {
        return Err(format!(
            "tag {:02x?}, expected {:02x?} (seed {seed}, pass {pass})",
            &block[..8],
            tag
        ));
    }
    let o = u64::from_le_bytes(block[8..16].try_into().expect("8 bytes"));
    let region = (b - FIO_OFFSET_MB * MIB) / (FIO_SIZE_MB * MIB);
    let region_start = FIO_OFFSET_MB * MIB + region * FIO_SIZE_MB * MIB;
    if o > b || b - o >= FIO_MAX_BS || o % FIO_MIN_BS != 0 || o < region_start {
        return Err(format!("write offset {o} cannot cover this block"));
    }
    if let Some(i) = block
        .chunks(16)
        .position(|r| r[..8] != tag || r[8..] != o.to_le_bytes())
    {
        return Err(format!("record {i} differs from the block's first"));
    }
    Ok(())
}

/// Byte offset of the stop marker's block: the image's last 4 KiB.
const STOP_BLOCK: u64 = IMAGE_MB * MIB - FIO_MIN_BS;

/// Writes the stop marker into the image (the backend reads it with O_DIRECT, which writes the
/// page cache back first; sync_data makes sure anyway).
fn write_stop_marker(image: &Path) -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new()
        .write(true)
        .open(image)
        .map_err(|e| format!("opening the image to write the stop marker: {e}"))?;
    f.write_all_at(STOP_MARKER, STOP_BLOCK)
        .and_then(|()| f.sync_data())
        .map_err(|e| format!("writing the stop marker: {e}"))
}

fn kills_from_env(default: usize) -> usize {
    match std::env::var("MQBLK_RECONNECT_KILLS") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|e| panic!("MQBLK_RECONNECT_KILLS={s:?}: {e}")),
        Err(_) => default,
    }
}

/// `qemu-img check` of the qcow2 image: exit 0, or 3 (leaked clusters only: a SIGKILLed
/// backend may leave clusters it had allocated and not yet mapped, as QEMU would).
fn check_qcow2_image(image: &Path) -> Vec<String> {
    match qemu_img(&["check", "-f", "qcow2", &image.display().to_string()]) {
        Ok((code @ (0 | 3), text)) => {
            eprintln!("qemu-img check (exit {code}): {}", text.trim());
            vec![]
        }
        Ok((code, text)) => vec![format!(
            "qemu-img check {} exited {code} (0 or 3 expected):\n{text}",
            image.display()
        )],
        Err(e) => vec![e],
    }
}

/// The guest's bytes of the qcow2 image, as QEMU reads them: converted to a raw file in `dir`,
/// whose path it returns.
fn guest_bytes(image: &Path, dir: &Path) -> Result<PathBuf, String> {
    let out = dir.join("converted.raw");
    let _ = fs::remove_file(&out);
    let (image, raw) = (image.display().to_string(), out.display().to_string());
    match qemu_img(&["convert", "-f", "qcow2", "-O", "raw", &image, &raw])? {
        (0, _) => Ok(out),
        (code, text) => Err(format!("qemu-img convert {image} exited {code}: {text}")),
    }
}

fn mqblk_from_env() -> PathBuf {
    match std::env::var_os("MQBLK_RECONNECT_MQBLK") {
        Some(p) if !p.is_empty() => {
            let p = PathBuf::from(p);
            assert!(
                p.is_file(),
                "MQBLK_RECONNECT_MQBLK={}: no such file",
                p.display()
            );
            p
        }
        _ => PathBuf::from(env!("CARGO_BIN_EXE_mqblk")),
    }
}

/// One mqblk process (an incarnation of the backend).
struct Backend {
    proc: Proc,
    log: PathBuf,
}

/// One test run: its files, in a [`WorkDir`], and its processes.
struct Run {
    dir: WorkDir,
    disk: Disk,
    /// The qcow2 overlay's base (`Disk::Qcow2`).
    base: PathBuf,
    seed: u64,
    mqblk: PathBuf,
    /// The qcow2 export's `metadata-commit=`.
    metadata_commit: &'static str,
    backends: Vec<Backend>,
    kills: Vec<Kill>,
}

impl Run {
    fn new(seed: u64, mqblk: PathBuf, disk: Disk) -> Self {
        let mut dir = WorkDir::new("mqblk-reconnect.");
        if disk == Disk::Qcow2 {
            dir.image = dir.path.join("disk.qcow2");
        }
        Run {
            base: dir.path.join("base.raw"),
            dir,
            disk,
            seed,
            mqblk,
            metadata_commit: "write",
            backends: Vec::new(),
            kills: Vec::new(),
        }
    }

    /// The raw file the test writes: the image, or the qcow2 overlay's base.
    fn raw_file(&self) -> &Path {
        match self.disk {
            Disk::Raw => &self.dir.image,
            Disk::Qcow2 => &self.base,
        }
    }

    fn backend_name(&self) -> String {
        match self.backends.last() {
            Some(b) => format!("{} (pid {})", b.proc.name, b.proc.child.id()),
            None => "no backend".into(),
        }
    }

    /// Starts a new mqblk serving the image on the socket (replacing a stale socket), its
    /// output to backend-N.log.
    fn start_backend(&mut self) {
        let n = self.backends.len();
        let log = self.dir.path.join(format!("backend-{n}.log"));
        let mut cmd = match self.disk {
            Disk::Raw => mqblk_serve(&self.mqblk, &self.dir, QUEUES),
            Disk::Qcow2 => {
                // The first one creates the overlay; the backing path as given, relative to the
                // overlay's directory.
                let export = format!(
                    "socket={},path={},queues={QUEUES},format=qcow2,backing=base.raw,\
                     backing-format=raw,metadata-commit={}",
                    self.dir.socket.display(),
                    self.dir.image.display(),
                    self.metadata_commit
                );
                let mut cmd = std::process::Command::new(&self.mqblk);
                cmd.env("NO_COLOR", "1")
                    .args(["serve", "--export", &export]);
                cmd
            }
        };
        let proc = Proc::spawn_logged(format!("mqblk #{n}"), &mut cmd, &log);
        self.backends.push(Backend { proc, log });
    }

    fn signal_backend(&mut self, sig: Signal) -> Result<(), String> {
        let b = self.backends.last().expect("a backend was started");
        b.proc
            .signal(sig)
            .map_err(|e| format!("sending signal {} to {}: {e}", sig.as_raw(), b.proc.name))
    }

    fn kill_backend(&mut self) {
        if let Some(b) = self.backends.last_mut() {
            b.proc.kill();
        }
    }

    /// Waits until the current backend listens on the socket; fails early if it exits.
    fn wait_for_socket(&mut self) -> Result<(), String> {
        let b = self.backends.last_mut().expect("a backend was started");
        let log = &b.log;
        // A stale socket of a killed backend is there too: also wait for the log line.
        b.proc
            .wait_for_socket(&self.dir.socket, STARTUP_TIMEOUT, || {
                read_lossy(log).contains("export ready")
            })
    }

    /// Sends SIGTERM to the current backend and expects a clean exit (status 0).
    fn stop_backend(&mut self) -> Vec<String> {
        match self.backends.last_mut() {
            Some(b) => b.proc.terminate(SHUTDOWN_TIMEOUT),
            None => vec!["no backend to stop".into()],
        }
    }

    fn start_qemu(&self, boot: &GuestBoot) -> Proc {
        let append = format!(
            "console=ttyS0 panic=-1 loglevel=4 mqblk.seed={} mqblk.expect_queues={QUEUES} \
             mqblk.jobs={JOBS} mqblk.fio_offset_mb={FIO_OFFSET_MB} \
             mqblk.fio_size_mb={FIO_SIZE_MB} mqblk.workload_max_s={WORKLOAD_MAX_S}",
            self.seed
        );
        // reconnect-ms: when the backend goes away, QEMU retries the socket at this
        // interval and, once connected, sets the device up again (with the in-flight
        // region, where the backend offers VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD).
        boot.spawn_qemu(
            &self.dir,
            Qemu {
                smp: QUEUES,
                // SSE4.2 and friends: fio and the kernel use them where they can.
                cpu: Some("max"),
                chardev_extra: format!(",reconnect-ms={RECONNECT_MS}"),
                queues: QUEUES,
                append,
            },
        )
    }

    /// Kills, in flight, durations: printed on success and on failure.
    fn summary(&self, w: &Watch) -> String {
        let mut s = String::new();
        let workload = match (w.find("workload-start"), w.find("workload-done")) {
            (Some((_, a)), Some((_, b))) => match (guest_t(a), guest_t(b)) {
                (Some(a), Some(b)) => format!("{:.1} s", b - a),
                _ => "?".into(),
            },
            (Some(_), None) => "did not finish".into(),
            _ => "did not start".into(),
        };
        let passes = w.value("workload-done", "passes");
        let flushes: u64 = (1..=passes.unwrap_or(0))
            .filter_map(|p| w.value(&format!("pass {p} done "), "flushes"))
            .sum();
        s.push_str(&format!(
            "  kills done: {}; fio passes: {} ({flushes} flushes); workload (guest time): \
             {workload}; QEMU ran {:.1} s\n",
            self.kills.len(),
            passes.map_or("?".into(), |p| p.to_string()),
            w.elapsed().as_secs_f64()
        ));
        for k in &self.kills {
            let reconnected_at = k.console_reconnected.unwrap_or(usize::MAX);
            // Samples taken while the backend was down: the requests stuck in flight.
            let stuck = w
                .samples
                .iter()
                .filter(|s| s.offset >= k.console_at && s.offset < reconnected_at)
                .map(|s| s.inflight)
                .max();
            let after = w
                .samples
                .iter()
                .find(|s| s.offset >= reconnected_at)
                .map(|s| s.ios);
            // The backend started after this kill logs what it resubmitted, per queue.
            let resubmitted: Option<u64> = self.backends.get(k.n).and_then(|b| {
                let counts: Vec<u64> = read_lossy(&b.log)
                    .lines()
                    .filter_map(|l| word_value(l, "resubmitted"))
                    .collect();
                (!counts.is_empty()).then(|| counts.iter().sum())
            });
            s.push_str(&format!(
                "  kill {} ({}) at +{:.2} s: guest in flight just before: {}; while down: {}; \
                 backend resubmitted: {}; down {:.2} s; {}; guest ios after: {}\n",
                k.n,
                k.how,
                k.at.as_secs_f64(),
                k.before
                    .as_ref()
                    .map_or("?".into(), |b| format!("{} (ios={})", b.inflight, b.ios)),
                stuck.map_or("no sample".into(), |n| format!("up to {n}")),
                resubmitted.map_or("none logged".into(), |n| n.to_string()),
                k.down.as_secs_f64(),
                k.reconnected
                    .map_or("QEMU did not reconnect".into(), |d| format!(
                        "reconnected {:.2} s after the kill",
                        d.as_secs_f64()
                    )),
                after.map_or("none".into(), |n| n.to_string()),
            ));
        }
        // A guest that stopped making progress: after which kill?
        if let (None, Some(last)) = (w.result(), w.samples.last()) {
            if last.inflight > 0 {
                let since = w.samples.iter().find(|s| s.ios == last.ios).unwrap_or(last);
                let after = match self
                    .kills
                    .iter()
                    .rev()
                    .find(|k| k.console_at <= since.offset)
                {
                    Some(k) => format!("after kill {} ({})", k.n, k.how),
                    None => "before the first kill".into(),
                };
                s.push_str(&format!(
                    "  the guest's progress stopped {after}: completed requests stuck at {} from \
                     guest t={} on, {} in flight\n",
                    last.ios, since.t, last.inflight
                ));
            }
        }
        // What each restarted backend said about the requests it resubmitted, if anything.
        for (i, b) in self.backends.iter().enumerate().skip(1) {
            for line in read_lossy(&b.log).lines().filter(|l| {
                let l = l.to_ascii_lowercase();
                l.contains("resubmit") || l.contains("inflight")
            }) {
                s.push_str(&format!("  backend-{i}: {line}\n"));
            }
        }
        s
    }

    /// Panics with `failures` and everything needed to debug them; keeps the work directory.
    fn fail_with(&mut self, failures: &[String], summary: &str, w: &Watch) -> ! {
        let mut msg = failure_list("guest reconnect test failed", failures);
        msg.push_str(&format!("----- kills -----\n{summary}"));
        msg.push_str("----- timeline (since QEMU started) -----\n");
        for (at, what) in &w.events {
            msg.push_str(&format!("  +{:.2} s {what}\n", at.as_secs_f64()));
        }
        // The console without most sampler lines (they are in the file).
        let console = read_lossy(&self.dir.console);
        let lines: Vec<&str> = console.lines().collect();
        let last_samples: Vec<usize> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.contains(&format!("{MARK}s t=")))
            .map(|(i, _)| i)
            .collect();
        let keep_from = last_samples
            .len()
            .saturating_sub(15)
            .min(last_samples.len());
        let keep: std::collections::HashSet<usize> =
            last_samples[keep_from..].iter().copied().collect();
        let filtered: Vec<&str> = lines
            .iter()
            .enumerate()
            .filter(|(i, l)| !l.contains(&format!("{MARK}s t=")) || keep.contains(i))
            .map(|(_, l)| *l)
            .collect();
        msg.push_str(&format!(
            "----- guest console ({}; sampler lines but the last 15 left out) -----\n{}\n",
            self.dir.console.display(),
            tail(&filtered.join("\n"), 120)
        ));
        msg.push_str(&log_section("QEMU output", &self.dir.qemu_log, 40));
        msg.push_str(&self.backend_logs());
        msg.push_str(&self.dir.keep_for(self.seed));
        panic!("{msg}");
    }

    /// Fails before QEMU has started.
    fn fail(&mut self, failures: &[String]) -> ! {
        let mut msg = failure_list("guest reconnect test failed", failures);
        msg.push_str(&self.backend_logs());
        msg.push_str(&self.dir.keep_for(self.seed));
        panic!("{msg}");
    }

    /// The end of each backend's log, for a failure report.
    fn backend_logs(&self) -> String {
        self.backends
            .iter()
            .enumerate()
            .map(|(i, b)| log_section(&format!("backend {i} log"), &b.log, 30))
            .collect()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // The processes before the directory (Proc's drop kills them).
        self.backends.clear();
    }
}

/// The `t=` value of a report line, as seconds of guest uptime.
fn guest_t(line: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("t="))
        .and_then(|v| v.parse().ok())
}

/// The host's image check must accept what the guest's fio writes and reject what it does not.
#[test]
fn pattern_check_accepts_fio_records_only() {
    let (seed, pass) = (123_456u64, 3u64);
    let record = |o: u64| {
        let mut r = Vec::new();
        r.extend_from_slice(&(seed as u32).to_be_bytes());
        r.extend_from_slice(&(pass as u32).to_be_bytes());
        r.extend_from_slice(&o.to_le_bytes());
        r
    };
    let block = |o: u64| record(o).repeat(FIO_MIN_BS as usize / 16);
    let b = FIO_OFFSET_MB * MIB + 8 * FIO_MIN_BS;
    // Written by a write starting at b, or up to 1 MiB before it.
    assert_eq!(check_pattern_block(&block(b), b, seed, pass), Ok(()));
    assert_eq!(
        check_pattern_block(&block(b - 8 * FIO_MIN_BS), b, seed, pass),
        Ok(())
    );
    // An earlier pass, another seed, a write that cannot cover it, a torn block.
    assert!(check_pattern_block(&block(b), b, seed, pass - 1).is_err());
    assert!(check_pattern_block(&block(b), b, seed + 1, pass).is_err());
    assert!(check_pattern_block(&block(b + FIO_MIN_BS), b, seed, pass).is_err());
    assert!(check_pattern_block(&block(b - 2), b, seed, pass).is_err());
    let mut torn = block(b);
    torn[2048..].copy_from_slice(&block(b - FIO_MIN_BS)[2048..]);
    assert!(check_pattern_block(&torn, b, seed, pass).is_err());
    // A write in job 0's region cannot cover a block of job 1's.
    let b1 = (FIO_OFFSET_MB + FIO_SIZE_MB) * MIB;
    assert!(check_pattern_block(&block(b1 - FIO_MIN_BS), b1, seed, pass).is_err());
    assert_eq!(check_pattern_block(&block(b1), b1, seed, pass), Ok(()));
}
