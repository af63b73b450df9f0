//! End-to-end test of mqblk on NVMe namespaces, inside a QEMU guest.
//!
//! The host here has no NVMe, so the test brings its own: QEMU 10 (TCG, 2 vCPUs) boots the guest
//! kernel (Debian's cloud kernel, NVMe and io_uring built in) with two emulated NVMe
//! controllers, one formatted with 512-byte LBAs and one with 4 KiB LBAs, both limited to
//! 32 KiB per command (MDTS), and one namespace per case, each backed by its own raw file here.
//! The initramfs (`tests/guest/init-nvme`, packed by `tests/guest/mkinitramfs-nvme.sh`) holds
//! this build's mqblk. For each case the guest runs `mqblk demo --export SPEC`: mqblk serves
//! the case's namespace and its built-in libblkio client writes a pattern seeded for the case
//! over the whole namespace, reads it back, re-reads it, reads at random, then zeroes a range,
//! discards one, flushes every queue and reads past the end (src/demo/requests.rs). The guest
//! relays every line of it (and of `mqblk serve`'s, where that serves) and powers off. The
//! host then checks:
//!
//! - the guest's RESULT, and each case's demo output: `demo OK` and every step-4 check;
//! - each namespace's backing file, byte for byte: the case's pattern where the verify step
//!   wrote it, zeros in the write-zeroes range, what the guest read in the discarded range,
//!   zeros anywhere else (so data written to another namespace, or at the wrong offset, fails);
//! - that the flushes reached the device: QEMU traces each flush command it receives
//!   (`pci_nvme_flush_ns`, by NSID, unique across the controllers), and each case's namespace
//!   must have received at least one per queue;
//! - the error cases: `mqblk serve` with engine=nvme on a block device, on a regular file and
//!   on a namespace formatted with metadata (QEMU's `ms=8`) exits by itself, at once, with one
//!   line on stderr that says what to use instead.
//!
//! Cases: both LBA sizes x the three thread mappings (baseline: 1 queue and 1 thread; mq: 2
//! queues, 1 thread; per-queue: 2 queues, 2 threads), one client job per queue; the per-queue
//! cases send 128 KiB requests, 4 times the controllers' MDTS, so that they must be split; the
//! 4 KiB mq case runs with `fixed-buffers=on`, and its single-buffer commands must have used
//! registered guest memory (demo's backend line counts them). In
//! those, `mqblk demo --export` serves the namespace itself; in one more case per LBA size
//! (per-queue, 4 KiB requests), `mqblk serve --sandbox strict` serves it, confined as in
//! production, and `mqblk demo --connect` drives it ([`Server`]). Each case's `engine` says
//! how it reaches its namespace ([`Engine`]).
//!
//! Needs what `bash .ci/setup` installs: qemu-system-x86_64, busybox-static, cpio, zstd or gzip,
//! and the guest kernel under target/guest. Without them this test fails (on purpose).
//!
//! Environment knobs: `MQBLK_GUEST_SEED=N` (the first case's seed; the default comes from the
//! clock and is printed), `MQBLK_GUEST_KEEP=1` (keep the work directory: backing files,
//! console, QEMU's log).
mod support;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use support::console::Watch;
use support::daemon::write_image;
use support::demo_report::{check_disk, expected_disk, DemoReport};
use support::qemu::{
    failure_list, log_section, seed_from_env, word_value, DeviceGuest, GuestBoot, WorkDir,
};

/// Each namespace's size (and its backing file's).
const NS_BYTES: u64 = 8 << 20;
/// The controllers' Maximum Data Transfer Size: 2^MDTS pages of 4 KiB, 32 KiB per command.
const MDTS: u32 = 3;
/// The controllers' memory page size (CAP.MPSMIN, which MDTS counts in).
const NVME_PAGE: u64 = 4096;
/// Bytes per request of the cases that cross MDTS.
const LARGE_REQUEST: usize = 128 << 10;
/// Seconds of random reads in each case (demo's step 3).
const RANDREAD_SECS: u32 = 1;
/// The guest kills a `mqblk demo` that runs longer (then it fails at once).
const CASE_TIMEOUT_SECS: u32 = 120;
/// Longest an error case may take, as the guest measures it: the error must come at once, not
/// after a timeout (TCG is slow, but mqblk starts in well under a second there).
const ERROR_CASE_SECS: f64 = 10.0;
/// The guest kills a `mqblk serve` of an error case that runs longer (it accepted the export).
const ERROR_CASE_TIMEOUT_SECS: u32 = 20;
/// The whole guest run, boot to power-off: about a minute under TCG on 2 cores.
const GUEST_TIMEOUT: Duration = Duration::from_secs(420);
/// How long QEMU may take to exit after the guest's RESULT line (it powers off).
const POWEROFF_TIMEOUT: Duration = Duration::from_secs(60);

/// One emulated NVMe controller.
struct Controller {
    /// Its serial number, by which the guest finds it.
    serial: &'static str,
    /// Logical (and physical) block size of its namespaces.
    lba: u32,
}

const CONTROLLERS: [Controller; 2] = [
    Controller {
        serial: "mqblk512",
        lba: 512,
    },
    Controller {
        serial: "mqblk4k",
        lba: 4096,
    },
];

/// How a case reaches its namespace: the engine, and the device node it opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// io_uring on the namespace's block device (/dev/nvmeXnY).
    Uring,
    /// NVMe commands through io_uring passthrough on its character device (/dev/ngXnY).
    Nvme,
}

impl Engine {
    /// The spec's engine and path (@blk and @chr: the guest puts in the device's name).
    fn spec(self) -> &'static str {
        match self {
            Engine::Uring => "engine=uring,path=@blk",
            Engine::Nvme => "engine=nvme,path=@chr",
        }
    }
}

/// Which mqblk process serves a case's namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    /// `mqblk demo --export` itself, unconfined (its client shares the process), which also
    /// prints what the backend counted.
    Demo,
    /// `mqblk serve --sandbox strict`, confined as in production (Landlock, seccomp, the io_uring
    /// opcode allowlist), driven by `mqblk demo --connect`; it must exit 0 on SIGTERM.
    Serve,
}

impl Server {
    /// Its name in the case's parameter (see tests/guest/init-nvme).
    fn name(self) -> &'static str {
        match self {
            Server::Demo => "demo",
            Server::Serve => "serve",
        }
    }
}

/// One `mqblk demo` run in the guest, on a namespace of its own.
struct Case {
    name: &'static str,
    /// Index into [`CONTROLLERS`].
    controller: usize,
    /// Unique across the controllers: QEMU's flush trace names the namespace by it alone.
    nsid: u32,
    engine: Engine,
    server: Server,
    queues: u16,
    /// The spec's `threads=`.
    threads: &'static str,
    /// Bytes per request of the verify, re-read and random-read steps.
    block_size: usize,
    /// More export keys (after the spec's engine, path, queues and threads), or "".
    options: &'static str,
}

const CASES: [Case; 8] = [
    Case {
        name: "lba512-baseline",
        controller: 0,
        nsid: 1,
        engine: Engine::Nvme,
        server: Server::Demo,
        queues: 1,
        threads: "1",
        block_size: 4096,
        options: "",
    },
    Case {
        name: "lba512-mq",
        controller: 0,
        nsid: 2,
        engine: Engine::Nvme,
        server: Server::Demo,
        queues: 2,
        threads: "1",
        block_size: 4096,
        options: "",
    },
    Case {
        name: "lba512-per-queue",
        controller: 0,
        nsid: 3,
        engine: Engine::Nvme,
        server: Server::Demo,
        queues: 2,
        threads: "per-queue",
        block_size: LARGE_REQUEST,
        options: "",
    },
    Case {
        name: "lba512-served",
        controller: 0,
        nsid: 4,
        engine: Engine::Nvme,
        server: Server::Serve,
        queues: 2,
        threads: "per-queue",
        block_size: 4096,
        options: "",
    },
    Case {
        name: "lba4k-baseline",
        controller: 1,
        nsid: 5,
        engine: Engine::Nvme,
        server: Server::Demo,
        queues: 1,
        threads: "1",
        block_size: 4096,
        options: "",
    },
    Case {
        name: "lba4k-mq",
        controller: 1,
        nsid: 6,
        engine: Engine::Nvme,
        server: Server::Demo,
        queues: 2,
        threads: "1",
        block_size: 4096,
        // Single-buffer commands on registered guest memory (IORING_URING_CMD_FIXED).
        options: ",fixed-buffers=on",
    },
    Case {
        name: "lba4k-per-queue",
        controller: 1,
        nsid: 7,
        engine: Engine::Nvme,
        server: Server::Demo,
        queues: 2,
        threads: "per-queue",
        block_size: LARGE_REQUEST,
        options: "",
    },
    Case {
        name: "lba4k-served",
        controller: 1,
        nsid: 8,
        engine: Engine::Nvme,
        server: Server::Serve,
        queues: 2,
        threads: "per-queue",
        block_size: 4096,
        options: "",
    },
];

impl Case {
    fn controller(&self) -> &'static Controller {
        &CONTROLLERS[self.controller]
    }

    /// Client jobs: one per queue.
    fn jobs(&self) -> usize {
        self.queues as usize
    }

    /// The QEMU drive of its namespace.
    fn drive_id(&self) -> String {
        format!("ns-{}", self.name)
    }

    fn image(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}.img", self.name))
    }

    /// Its kernel command line parameter (see tests/guest/init-nvme).
    fn param(&self, seed: u64) -> String {
        format!(
            "mqblk.case={}:{}:{}:{},queues={},threads={}{}:{}:{}:{seed}:{}",
            self.name,
            self.controller().serial,
            self.nsid,
            self.engine.spec(),
            self.queues,
            self.threads,
            self.options,
            self.block_size,
            self.jobs(),
            self.server.name(),
        )
    }
}

/// A `mqblk serve` that must refuse its export at once, with one line on stderr.
struct ErrorCase {
    name: &'static str,
    /// The namespace that `spec`'s @blk or @chr names: (index into [`CONTROLLERS`], NSID).
    ns: Option<(usize, u32)>,
    /// The export, without socket= (@file: a regular file).
    spec: &'static str,
    /// What the line must contain.
    line_contains: &'static [&'static str],
    /// QEMU `nvme-ns` properties of a namespace made for this case alone (at `ns`), if the
    /// case needs one of its own (a format mqblk refuses).
    own_namespace: Option<&'static str>,
}

const ERROR_CASES: [ErrorCase; 3] = [
    ErrorCase {
        name: "nvme-on-block-device",
        ns: Some((0, 1)),
        spec: "engine=nvme,path=@blk",
        line_contains: &["is a block device", "engine=uring"],
        own_namespace: None,
    },
    ErrorCase {
        name: "nvme-on-regular-file",
        ns: None,
        spec: "engine=nvme,path=@file",
        line_contains: &["is not an NVMe namespace's character device"],
        own_namespace: None,
    },
    // 8 bytes of metadata per 512-byte block (separate buffer: ms=8, mset=0).
    ErrorCase {
        name: "nvme-metadata-format",
        ns: Some((0, 9)),
        spec: "engine=nvme,path=@chr",
        line_contains: &["8 bytes of metadata per block", "engine=uring"],
        own_namespace: Some("ms=8"),
    },
];

impl ErrorCase {
    fn drive_id(&self) -> String {
        format!("ns-{}", self.name)
    }

    fn image(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}.img", self.name))
    }

    fn param(&self) -> String {
        let (serial, nsid) = match self.ns {
            Some((c, nsid)) => (CONTROLLERS[c].serial, nsid.to_string()),
            None => ("-", "-".to_string()),
        };
        format!("mqblk.error={}:{serial}:{nsid}:{}", self.name, self.spec)
    }
}

/// The seed of case `i`'s pattern: each case its own, so that data landing on another
/// namespace does not pass.
fn case_seed(seed: u64, i: usize) -> u64 {
    seed + i as u64
}

/// The kernel command line: the console, and the cases in order.
fn kernel_cmdline(seed: u64) -> String {
    let mut words = vec![
        "console=ttyS0".to_string(),
        "panic=-1".into(),
        "loglevel=4".into(),
        format!("mqblk.runtime={RANDREAD_SECS}"),
        format!("mqblk.timeout={CASE_TIMEOUT_SECS}"),
        format!("mqblk.error_timeout={ERROR_CASE_TIMEOUT_SECS}"),
    ];
    words.extend(
        CASES
            .iter()
            .enumerate()
            .map(|(i, c)| c.param(case_seed(seed, i))),
    );
    words.extend(ERROR_CASES.iter().map(ErrorCase::param));
    let line = words.join(" ");
    // x86's COMMAND_LINE_SIZE; the kernel would cut the line short.
    assert!(line.len() < 2048, "kernel command line too long: {line}");
    line
}

/// QEMU's arguments for namespace `nsid` of controller `bus` on `image`, with `lba`-byte
/// blocks and the `nvme-ns` properties `props` (comma-separated, or empty).
fn push_namespace(
    args: &mut Vec<String>,
    bus: usize,
    image: &Path,
    drive_id: &str,
    nsid: u32,
    lba: u32,
    props: &str,
) {
    // discard=unmap: a deallocation punches a hole in the file, as on a real device.
    args.push("-drive".into());
    args.push(format!(
        "file={},if=none,id={drive_id},format=raw,discard=unmap",
        image.display()
    ));
    args.push("-device".into());
    let mut ns = format!(
        "nvme-ns,drive={drive_id},bus=nvme{bus},nsid={nsid},logical_block_size={lba},\
         physical_block_size={lba}"
    );
    if !props.is_empty() {
        ns.push(',');
        ns.push_str(props);
    }
    args.push(ns);
}

/// QEMU's arguments for the controllers and one namespace per case, each on its image.
fn nvme_args(dir: &Path) -> Vec<String> {
    let mut args = Vec::new();
    for (i, ctrl) in CONTROLLERS.iter().enumerate() {
        args.push("-device".into());
        args.push(format!(
            "nvme,serial={},id=nvme{i},mdts={MDTS}",
            ctrl.serial
        ));
        for case in CASES.iter().filter(|c| c.controller == i) {
            let (image, id) = (case.image(dir), case.drive_id());
            push_namespace(&mut args, i, &image, &id, case.nsid, ctrl.lba, "");
        }
        for case in &ERROR_CASES {
            let (Some(props), Some((c, nsid))) = (case.own_namespace, case.ns) else {
                continue;
            };
            if c == i {
                let (image, id) = (case.image(dir), case.drive_id());
                push_namespace(&mut args, i, &image, &id, nsid, ctrl.lba, props);
            }
        }
    }
    args
}

/// The guest's report lines about case `name` ("case NAME | LINE": demo's output), without
/// the prefix.
fn case_output<'a>(report: &'a [String], name: &str) -> Vec<&'a str> {
    let prefix = format!("case {name} | ");
    report
        .iter()
        .filter_map(|l| l.strip_prefix(&prefix))
        .collect()
}

/// The first report line starting with `prefix`.
fn line_starting<'a>(report: &'a [String], prefix: &str) -> Option<&'a str> {
    report
        .iter()
        .find(|l| l.starts_with(prefix))
        .map(String::as_str)
}

/// What is wrong with the namespaces as the guest saw them: each case's namespace must be
/// there, with its controller's block size, the test's size and transfer limit, and a
/// character device.
fn check_namespaces(report: &[String]) -> Vec<String> {
    let mut failures = Vec::new();
    let max_transfer_kb = (1u64 << MDTS) * NVME_PAGE / 1024;
    for case in &CASES {
        let ctrl = case.controller();
        let prefix = format!("ns {} {} ", ctrl.serial, case.nsid);
        let Some(line) = line_starting(report, &prefix) else {
            failures.push(format!(
                "the guest did not list namespace {} of controller {}",
                case.nsid, ctrl.serial
            ));
            continue;
        };
        let want = [
            ("lbs", u64::from(ctrl.lba)),
            ("sectors", NS_BYTES / 512),
            ("max_hw_kb", max_transfer_kb),
        ];
        for (key, value) in want {
            if word_value(line, key) != Some(value) {
                failures.push(format!("{}: expected {key}={value}: {line}", case.name));
            }
        }
        if !line.contains("chr_exists=yes") {
            failures.push(format!("{}: no character device: {line}", case.name));
        }
    }
    failures
}

/// What is wrong with case `i`: its exit status, its demo output, its backing file.
fn check_case(report: &[String], dir: &Path, seed: u64, i: usize) -> Vec<String> {
    let case = &CASES[i];
    let name = case.name;
    let mut failures = Vec::new();
    match line_starting(report, &format!("case {name} done ")) {
        None => failures.push("no `done` line: it did not run to its end".to_string()),
        Some(l) if word_value(l, "rc") != Some(0) => {
            // Its last line says why (demo's error, or the last step it reached).
            let last = case_output(report, name).last().copied().unwrap_or("");
            failures.push(format!("mqblk demo: {l}; its last line: {}", last.trim()));
        }
        Some(l) if case.server == Server::Serve && word_value(l, "serve_rc") != Some(0) => {
            let prefix = format!("case {name} serve | ");
            let last = report.iter().rev().find_map(|r| r.strip_prefix(&prefix));
            failures.push(format!(
                "mqblk serve must exit 0 on SIGTERM: {l}; its last line: {}",
                last.unwrap_or("")
            ));
        }
        Some(_) => {}
    }
    let output = case_output(report, name);
    let demo = DemoReport::parse(output.clone());
    // A flush on every queue: what QEMU's flush count is checked against.
    failures.extend(demo.failures(&["flush"]));
    if case.options.contains("fixed-buffers=on") {
        failures.extend(check_registered_buffers(&output));
    }
    let image = case.image(dir);
    match (
        expected_disk(&demo, NS_BYTES, case.jobs(), case.block_size),
        fs::read(&image),
    ) {
        (Ok(spans), Ok(data)) => failures.extend(
            check_disk(&data, &spans, case_seed(seed, i))
                .into_iter()
                .map(|f| format!("backing file {}: {f}", image.display())),
        ),
        (Err(e), _) => failures.push(e),
        (_, Err(e)) => failures.push(format!("reading {}: {e}", image.display())),
    }
    failures
        .into_iter()
        .map(|f| format!("case {name}: {f}"))
        .collect()
}

/// With `fixed-buffers=on` the verify step's single-buffer commands must have gone on
/// registered guest memory (demo's "backend (verify)" line counts them), not fallen back.
fn check_registered_buffers(output: &[&str]) -> Vec<String> {
    let line = output
        .iter()
        .find(|l| l.trim_start().starts_with("backend (verify):"));
    let fixed = line.and_then(|l| {
        let (head, _) = l.split_once(" on registered buffers")?;
        head.rsplit(' ').next()?.parse::<u64>().ok()
    });
    match fixed {
        Some(n) if n > 0 => Vec::new(),
        _ => vec![format!(
            "fixed-buffers=on, but no I/O went on registered buffers: {:?}",
            line.map(|l| l.trim())
        )],
    }
}

/// The QEMU trace event of a flush command, with the namespace's NSID after it in hex.
const FLUSH_EVENT: &str = "pci_nvme_flush_ns nsid 0x";

/// Flush commands per NSID in QEMU's trace (the log backend's lines: "PID@TIME:EVENT ARGS").
fn flushes_per_nsid(trace: &str) -> HashMap<u32, u64> {
    let mut counts = HashMap::new();
    for line in trace.lines() {
        let Some(nsid) = line.split_once(FLUSH_EVENT).and_then(|(_, hex)| {
            u32::from_str_radix(hex.split_whitespace().next().unwrap_or(""), 16).ok()
        }) else {
            continue;
        };
        *counts.entry(nsid).or_default() += 1;
    }
    counts
}

/// What is wrong with the flushes in QEMU's trace: each case's namespace must have received at
/// least one flush command per queue (its step 4 flushes every queue).
fn check_flushes(trace: &str) -> Vec<String> {
    let counts = flushes_per_nsid(trace);
    CASES
        .iter()
        .filter_map(|case| {
            let n = counts.get(&case.nsid).copied().unwrap_or(0);
            (n < u64::from(case.queues)).then(|| {
                format!(
                    "case {}: namespace {} received {n} flush commands, expected at least {} \
                     (one per queue): the flushes did not reach the device (all: {counts:?})",
                    case.name, case.nsid, case.queues
                )
            })
        })
        .collect()
}

/// What is wrong with the error cases: each `mqblk serve` must have exited by itself with a
/// failure, at once, with one line on stderr (holding `line_contains` once that is checked).
fn check_error_cases(report: &[String]) -> Vec<String> {
    let mut failures = Vec::new();
    for case in &ERROR_CASES {
        let name = case.name;
        let Some(summary) = line_starting(report, &format!("error {name} rc=")) else {
            failures.push(format!("error case {name}: it did not run"));
            continue;
        };
        let prefix = format!("error {name} | ");
        let lines: Vec<&str> = report
            .iter()
            .filter_map(|l| l.strip_prefix(&prefix))
            .collect();
        let rc = word_value(summary, "rc");
        let secs: Option<f64> = summary
            .split_whitespace()
            .find_map(|w| w.strip_prefix("secs=")?.parse().ok());
        let what = format!("error case {name} ({summary}; stderr: {lines:?})");
        eprintln!("{what}");
        // 137: killed by the guest's timeout; it did not exit by itself.
        if rc == Some(0) || rc == Some(137) || rc.is_none() {
            failures.push(format!("{what}: mqblk serve must exit non-zero by itself"));
        }
        if secs.is_none_or(|s| s > ERROR_CASE_SECS) {
            failures.push(format!(
                "{what}: it must fail at once (within {ERROR_CASE_SECS} s)"
            ));
        }
        if word_value(summary, "lines") != Some(1) || lines.len() != 1 {
            failures.push(format!("{what}: stderr must be exactly one line"));
        }
        let line = lines.first().copied().unwrap_or("");
        for want in case.line_contains {
            if !line.contains(want) {
                failures.push(format!("{what}: the line must contain {want:?}"));
            }
        }
    }
    failures
}

/// The test's files and its seed.
struct Run {
    dir: WorkDir,
    seed: u64,
    /// QEMU's trace of the flush commands.
    trace: PathBuf,
}

impl Run {
    /// Starts the guest: QEMU with the controllers and namespaces, tracing flush commands.
    fn start_guest(&self, boot: &GuestBoot) -> Watch {
        let mut args = nvme_args(&self.dir.path);
        args.push("-trace".into());
        args.push(format!(
            "enable=pci_nvme_flush_ns,file={}",
            self.trace.display()
        ));
        let qemu = boot.spawn_qemu_devices(DeviceGuest {
            smp: 2,
            memory: "1G",
            append: kernel_cmdline(self.seed),
            args,
            console: &self.dir.console,
            log: &self.dir.qemu_log,
        });
        // No sampler lines, so no stall detection: GUEST_TIMEOUT bounds the run.
        Watch::new(qemu, &self.dir.console, GUEST_TIMEOUT, GUEST_TIMEOUT)
    }

    /// Panics with `failures` and everything needed to debug them; keeps the work directory.
    fn fail(&self, failures: &[String]) -> ! {
        let mut msg = failure_list("NVMe guest test failed", failures);
        msg.push_str(&log_section("guest console", &self.dir.console, 150));
        msg.push_str(&log_section("QEMU output", &self.dir.qemu_log, 30));
        msg.push_str(&self.dir.keep_for(self.seed));
        panic!("{msg}");
    }
}

/// Waits for the guest's RESULT line (Err unless it says PASS), then for QEMU to exit.
fn wait_for_guest(watch: &mut Watch) -> Result<(), String> {
    watch.wait_for(GUEST_TIMEOUT, "the guest's RESULT line", |w| {
        w.result().map(|_| ())
    })?;
    match watch.qemu.wait_timeout(POWEROFF_TIMEOUT) {
        Ok(Some(status)) if status.success() => Ok(()),
        Ok(Some(status)) => Err(format!("QEMU exited with {status}")),
        Ok(None) => Err(format!(
            "the guest did not power off within {POWEROFF_TIMEOUT:?} of its RESULT line"
        )),
        Err(e) => Err(format!("waiting for QEMU: {e}")),
    }
}

#[test]
fn mqblk_serves_nvme_namespaces_inside_a_guest() {
    let started = Instant::now();
    let boot = GuestBoot::prepare_with(
        "tests/guest/mkinitramfs-nvme.sh",
        &[env!("CARGO_BIN_EXE_mqblk")],
    );
    let seed = seed_from_env();
    let dir = WorkDir::new("mqblk-nvme.");
    let run = Run {
        trace: dir.path.join("nvme-trace.log"),
        dir,
        seed,
    };
    eprintln!(
        "NVMe guest test: {}; seed {seed}; work dir {}",
        boot.qemu_version,
        run.dir.path.display()
    );
    for case in &CASES {
        write_image(&case.image(&run.dir.path), NS_BYTES, None);
    }
    for case in ERROR_CASES.iter().filter(|c| c.own_namespace.is_some()) {
        write_image(&case.image(&run.dir.path), NS_BYTES, None);
    }

    let guest_started = Instant::now();
    let mut watch = run.start_guest(&boot);
    let mut failures = Vec::new();
    if let Err(e) = wait_for_guest(&mut watch) {
        watch.qemu.kill();
        failures.push(e);
    }
    let guest_time = guest_started.elapsed();
    watch.refresh();
    let report: Vec<String> = watch.report.iter().map(|(_, l)| l.clone()).collect();

    failures.extend(check_namespaces(&report));
    for i in 0..CASES.len() {
        failures.extend(check_case(&report, &run.dir.path, seed, i));
    }
    match fs::read_to_string(&run.trace) {
        Ok(trace) => failures.extend(check_flushes(&trace)),
        Err(e) => failures.push(format!("QEMU's trace {}: {e}", run.trace.display())),
    }
    failures.extend(check_error_cases(&report));
    if !failures.is_empty() {
        run.fail(&failures);
    }
    for case in &CASES {
        if let Some(l) = line_starting(&report, &format!("case {} done ", case.name)) {
            eprintln!("{l}");
        }
    }
    eprintln!(
        "NVMe guest test: PASS (guest {:.1} s, total {:.1} s)",
        guest_time.as_secs_f64(),
        started.elapsed().as_secs_f64()
    );
}

/// The host-side half of the harness on a real demo run, without a guest: `mqblk demo
/// --export` on an image file here, its output read by [`DemoReport`], the file checked by
/// [`check_disk`]; and the check catches a wrong byte, a wrong seed, a lost zero range.
#[test]
fn host_check_agrees_with_a_demo_run_and_catches_bad_data() {
    let dir = tempfile::tempdir().expect("create a temporary directory");
    let image = dir.path().join("disk.img");
    let (size, jobs, block_size, seed) = (8u64 << 20, 2, 8192, 4242);
    write_image(&image, size, None);
    let out = Command::new(env!("CARGO_BIN_EXE_mqblk"))
        .args(["demo", "--export"])
        .arg(format!(
            "engine=uring,path={},queues=2,threads=1,direct=off",
            image.display()
        ))
        .args([
            "--jobs",
            &jobs.to_string(),
            "--block-size",
            &block_size.to_string(),
        ])
        .args(["--seed", &seed.to_string(), "--runtime", "0.2"])
        .output()
        .expect("run mqblk demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "mqblk demo failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let demo = DemoReport::parse(stdout.lines());
    assert_eq!(
        demo.failures(&["flush", "write-zeroes", "discard"]),
        Vec::<String>::new(),
        "{stdout}"
    );
    let spans = expected_disk(&demo, size, jobs, block_size).expect("spans");
    let mut data = fs::read(&image).expect("read the image");
    assert_eq!(check_disk(&data, &spans, seed), Vec::<String>::new());
    assert_eq!(
        check_disk(&data, &spans, seed + 1).len(),
        1,
        "another seed's pattern"
    );

    let zeroed = demo
        .check("write-zeroes")
        .and_then(|c| c.number("offset"))
        .expect("offset");
    data[zeroed as usize + 100] = 1;
    data[4096 + 7] ^= 0x80;
    let failures = check_disk(&data, &spans, seed);
    assert_eq!(failures.len(), 2, "{failures:#?}");
    assert!(
        failures[0].starts_with("written by the verify step")
            && failures[0].contains("offset 4096 ")
    );
    assert!(
        failures[1].starts_with("write-zeroes range")
            && failures[1].contains(&format!("offset {zeroed} "))
    );
}

#[test]
fn demo_report_failures_are_detected() {
    let good = "  offers: flush discard write-zeroes\n\
        check write-zeroes ok queue=0 offset=4096 len=8192 reads=zeros neighbours=pattern\n\
        check discard ok queue=1 offset=65536 len=8192 reads=mixed neighbours=pattern\n\
        check flush ok queues=2\n\
        check read-past-end ok queues=2 offset=1048576 len=512 errno=EIO\n\
        check read-across-end ok queues=2 offset=1048064 len=1024 errno=EIO\n\
        demo OK: data verified";
    let r = DemoReport::parse(good.lines());
    assert_eq!(r.failures(&["flush"]), Vec::<String>::new());
    assert_eq!(
        r.check("discard").and_then(|c| c.word("reads")),
        Some("mixed")
    );

    let failed = good.replace("check flush ok queues=2", "check flush FAIL queue=1: EIO");
    assert_eq!(
        DemoReport::parse(failed.lines()).failures(&[]),
        ["check flush FAIL queue=1: EIO"]
    );
    let unoffered = good.replace("check flush ok queues=2", "check flush not-offered");
    assert_eq!(
        DemoReport::parse(unoffered.lines())
            .failures(&["flush"])
            .len(),
        1
    );
    assert_eq!(DemoReport::parse(unoffered.lines()).failures(&[]).len(), 0);
    let short = good
        .replace("demo OK", "demo failed")
        .replace("check read-past-end", "x");
    assert_eq!(DemoReport::parse(short.lines()).failures(&[]).len(), 2);
}

#[test]
fn guest_parameters_name_each_case_and_engine() {
    let cmdline = kernel_cmdline(7);
    assert!(cmdline.contains(
        "mqblk.case=lba4k-per-queue:mqblk4k:7:engine=nvme,path=@chr,queues=2,\
         threads=per-queue:131072:2:13:demo"
    ));
    assert!(cmdline.contains(
        "mqblk.case=lba512-served:mqblk512:4:engine=nvme,path=@chr,queues=2,\
         threads=per-queue:4096:2:10:serve"
    ));
    assert!(cmdline.contains("mqblk.error=nvme-on-regular-file:-:-:engine=nvme,path=@file"));
    let uring = Case {
        engine: Engine::Uring,
        ..CASES[0]
    };
    assert_eq!(
        uring.param(1),
        "mqblk.case=lba512-baseline:mqblk512:1:engine=uring,path=@blk,queues=1,threads=1:4096:1:1:\
         demo"
    );
    // Every case on a namespace of its own, and every drive's id unique.
    for (i, a) in CASES.iter().enumerate() {
        for b in &CASES[i + 1..] {
            assert!((a.controller, a.nsid) != (b.controller, b.nsid) && a.name != b.name);
        }
    }
    assert!(CASES
        .iter()
        .any(|c| c.block_size as u64 > (1 << MDTS) * NVME_PAGE));
}

#[test]
fn error_case_checks_catch_hangs_chatter_and_wrong_lines() {
    let lines_of = |case: &ErrorCase, rc: u32, secs: f64, lines: &[&str]| {
        let name = case.name;
        let mut v = vec![format!(
            "error {name} rc={rc} secs={secs} lines={}",
            lines.len()
        )];
        v.extend(lines.iter().map(|l| format!("error {name} | {l}")));
        v
    };
    let [blk, file, meta] = &ERROR_CASES;
    // The line each case wants: everything it must contain.
    let want = |case: &ErrorCase| format!("mqblk: error: {}", case.line_contains.join(" ... "));
    let (blk_line, file_line, meta_line) = (want(blk), want(file), want(meta));
    let meta_ok = lines_of(meta, 1, 0.2, &[&meta_line]);
    let good = [
        lines_of(blk, 1, 0.3, &[&blk_line]),
        lines_of(file, 1, 0.2, &[&file_line]),
        meta_ok.clone(),
    ]
    .concat();
    assert_eq!(check_error_cases(&good), Vec::<String>::new());

    let hung = [
        lines_of(blk, 137, 20.0, &[]),
        lines_of(file, 1, 0.2, &[&file_line]),
        meta_ok.clone(),
    ]
    .concat();
    let failures = check_error_cases(&hung);
    assert!(
        failures.iter().all(|f| f.contains(blk.name)),
        "{failures:#?}"
    );
    for why in ["exit non-zero by itself", "at once", "exactly one line"] {
        assert!(
            failures.iter().any(|f| f.contains(why)),
            "{why}: {failures:#?}"
        );
    }

    let chatty = [
        lines_of(blk, 1, 0.3, &[&blk_line, "and more"]),
        lines_of(file, 0, 0.2, &[&file_line]),
        meta_ok.clone(),
    ]
    .concat();
    assert_eq!(check_error_cases(&chatty).len(), 2);

    let wrong = [
        lines_of(blk, 1, 0.3, &[&blk_line]),
        lines_of(file, 1, 0.2, &["mqblk: error: something else"]),
        meta_ok,
    ]
    .concat();
    assert_eq!(check_error_cases(&wrong).len(), file.line_contains.len());
}
