//! What the QEMU guest tests share: the guest kernel and initramfs, the QEMU command line, the
//! work directory, the mqblk command that serves the guest's disk, and reading the guest's
//! serial console.

use std::cell::Cell;
use std::io;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use super::proc::{tool_version, Proc};

/// Appended to "missing" and "cannot start" messages.
pub const SETUP_HINT: &str = "run `bash .ci/setup` from the repository root to install QEMU, \
    busybox-static, fio, prometheus (promtool) and the guest kernel";

/// Prefix of the guest's report lines on its console.
pub const MARK: &str = "MQBLK-GUEST: ";

/// The modulus of the Park-Miller generator that the guests' data patterns come from
/// (tests/guest/init); seeds lie in 1..=M-2.
pub const PARK_MILLER_M: u64 = 2_147_483_647;

pub fn park_miller(v: u64) -> u64 {
    v * 16807 % PARK_MILLER_M
}

/// `MQBLK_GUEST_SEED`, or one derived from the clock (printed by the tests, so that a failure
/// can be rerun).
pub fn seed_from_env() -> u64 {
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

/// What a guest boots: the kernel that `.ci/setup` unpacked and an initramfs.
pub struct GuestBoot {
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    /// First line of `qemu-system-x86_64 --version`, for the test's log.
    pub qemu_version: String,
}

impl GuestBoot {
    /// Checks for the kernel and QEMU (panicking with [`SETUP_HINT`]) and builds the initramfs
    /// with `script` (relative to the repository; a no-op when its output is up to date).
    pub fn prepare(script: &str) -> Self {
        Self::prepare_with(script, &[])
    }

    /// [`GuestBoot::prepare`], passing `args` to the build script.
    pub fn prepare_with(script: &str, args: &[&str]) -> Self {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        let kernel = repo.join("target/guest/vmlinuz");
        assert!(
            kernel.is_file(),
            "guest kernel {} is missing: {SETUP_HINT}",
            kernel.display()
        );
        let qemu_version = tool_version("qemu-system-x86_64");
        let initramfs = build_initramfs(&repo.join(script), args);
        GuestBoot {
            kernel,
            initramfs,
            qemu_version,
        }
    }

    /// Starts QEMU under TCG with a vhost-user-blk disk on `dir.socket` and shared (memfd)
    /// guest memory, the serial console in `dir.console` and QEMU's own output in
    /// `dir.qemu_log`.
    pub fn spawn_qemu(&self, dir: &WorkDir, q: Qemu) -> Proc {
        let files = QemuFiles {
            socket: &dir.socket,
            console: &dir.console,
            log: &dir.qemu_log,
            extra: Vec::new(),
        };
        self.spawn_qemu_with(q, files)
    }

    /// [`GuestBoot::spawn_qemu`] with the files (and extra arguments) of `files`: for tests
    /// that run several QEMUs at once (a migration's source and destination).
    pub fn spawn_qemu_with(&self, q: Qemu, files: QemuFiles) -> Proc {
        let mut args: Vec<(&str, String)> = vec![
            ("-nodefaults", String::new()),
            ("-no-user-config", String::new()),
            ("-accel", "tcg".into()),
        ];
        if let Some(cpu) = q.cpu {
            args.push(("-cpu", cpu.into()));
        }
        args.extend([
            ("-smp", q.smp.to_string()),
            ("-m", "512M".into()),
            // vhost-user needs guest memory that the backend can map: a shared memfd.
            (
                "-object",
                "memory-backend-memfd,id=mem,size=512M,share=on".into(),
            ),
            ("-machine", "q35,memory-backend=mem".into()),
            (
                "-chardev",
                format!(
                    "socket,id=vub0,path={}{}",
                    files.socket.display(),
                    q.chardev_extra
                ),
            ),
            (
                "-device",
                format!(
                    "vhost-user-blk-pci,id={DISK_ID},chardev=vub0,num-queues={}",
                    q.queues
                ),
            ),
            ("-display", "none".into()),
            ("-monitor", "none".into()),
            ("-serial", format!("file:{}", files.console.display())),
            ("-no-reboot", String::new()),
            ("-kernel", self.kernel.display().to_string()),
            ("-initrd", self.initramfs.display().to_string()),
            ("-append", q.append),
        ]);
        let mut cmd = Command::new("qemu-system-x86_64");
        for (opt, value) in args {
            cmd.arg(opt);
            if !value.is_empty() {
                cmd.arg(value);
            }
        }
        cmd.args(&files.extra);
        Proc::spawn_logged("qemu-system-x86_64".into(), &mut cmd, files.log)
    }
}

/// A guest without a vhost-user disk, for [`GuestBoot::spawn_qemu_devices`]: its devices are
/// all in `args`, and its memory is private (nothing outside QEMU maps it).
pub struct DeviceGuest<'a> {
    /// vCPUs.
    pub smp: usize,
    /// Guest memory, in QEMU's `-m` syntax (e.g. "1G").
    pub memory: &'a str,
    /// Kernel command line.
    pub append: String,
    /// The devices and anything else for QEMU's command line (e.g. `-qmp ...`).
    pub args: Vec<String>,
    /// The guest's serial console.
    pub console: &'a Path,
    /// QEMU's own stdout and stderr.
    pub log: &'a Path,
}

impl GuestBoot {
    /// Starts QEMU under TCG (q35) with the devices of `g` and no others, the serial console in
    /// `g.console` and QEMU's own output in `g.log`.
    pub fn spawn_qemu_devices(&self, g: DeviceGuest) -> Proc {
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args([
            "-nodefaults",
            "-no-user-config",
            "-accel",
            "tcg",
            "-machine",
            "q35",
        ])
        .args(["-smp", &g.smp.to_string(), "-m", g.memory])
        .args(["-display", "none", "-monitor", "none"])
        .arg("-serial")
        .arg(format!("file:{}", g.console.display()))
        .arg("-no-reboot")
        .arg("-kernel")
        .arg(&self.kernel)
        .arg("-initrd")
        .arg(&self.initramfs)
        .args(["-append", &g.append])
        .args(&g.args);
        Proc::spawn_logged("qemu-system-x86_64".into(), &mut cmd, g.log)
    }
}

/// The QOM id of the guest's vhost-user-blk device (QMP names it by it).
pub const DISK_ID: &str = "vblk0";

/// Where one QEMU keeps its files, and what it adds to the command line.
pub struct QemuFiles<'a> {
    /// The vhost-user socket of its disk.
    pub socket: &'a Path,
    /// The guest's serial console.
    pub console: &'a Path,
    /// QEMU's own stdout and stderr.
    pub log: &'a Path,
    /// More arguments (e.g. `-qmp ...`, `-incoming ...`).
    pub extra: Vec<String>,
}

/// Runs an initramfs build script and returns the path it prints.
fn build_initramfs(script: &Path, args: &[&str]) -> PathBuf {
    let out = Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed ({}):\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        path.is_file(),
        "{} printed {path:?}, which is not a file",
        script.display()
    );
    path
}

/// What differs between the guest tests' QEMU runs; [`GuestBoot::spawn_qemu`] adds the rest.
pub struct Qemu {
    /// vCPUs.
    pub smp: usize,
    /// `-cpu` model, if not QEMU's default.
    pub cpu: Option<&'static str>,
    /// More chardev options, each with its leading comma (e.g. `,reconnect-ms=200`).
    pub chardev_extra: String,
    /// Virtqueues of the vhost-user-blk device.
    pub queues: usize,
    /// Kernel command line.
    pub append: String,
}

/// `mqblk serve` (the binary `bin`) exporting `dir.image` on `dir.socket` with `queues`
/// queues.
pub fn mqblk_serve(bin: &Path, dir: &WorkDir, queues: usize) -> Command {
    let mut cmd = Command::new(bin);
    // The log goes to a file, which is printed when the test fails: no ANSI colours.
    cmd.env("NO_COLOR", "1");
    cmd.arg("serve").arg("--export").arg(format!(
        "socket={},path={},queues={queues}",
        dir.socket.display(),
        dir.image.display()
    ));
    cmd
}

/// A guest test's files, in a temporary directory that is deleted at the end unless it is to
/// be kept: after a failure, or with `MQBLK_GUEST_KEEP=1`.
pub struct WorkDir {
    tmp: Option<tempfile::TempDir>,
    keep: Cell<bool>,
    pub path: PathBuf,
    /// The guest's disk.
    pub image: PathBuf,
    /// The vhost-user socket.
    pub socket: PathBuf,
    /// The guest's serial console.
    pub console: PathBuf,
    /// QEMU's own stdout and stderr.
    pub qemu_log: PathBuf,
}

impl WorkDir {
    pub fn new(prefix: &str) -> Self {
        let tmp = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("create a temporary directory for the image and socket");
        let path = tmp.path().to_path_buf();
        let socket = path.join("vub.sock");
        // sun_path holds 108 bytes, and mqblk's `--export` takes comma-separated keys.
        assert!(
            socket.as_os_str().len() < 100,
            "socket path {} is too long for a unix socket; set TMPDIR to a shorter directory",
            socket.display()
        );
        assert!(
            !path.to_string_lossy().contains(','),
            "temporary directory {} contains a comma; set TMPDIR to another directory",
            path.display()
        );
        WorkDir {
            tmp: Some(tmp),
            keep: Cell::new(std::env::var_os("MQBLK_GUEST_KEEP").is_some_and(|v| v == "1")),
            image: path.join("disk.img"),
            socket,
            console: path.join("console.log"),
            qemu_log: path.join("qemu.log"),
            path,
        }
    }

    /// Keeps the directory, and says so (with the seed to rerun with) in the last line of a
    /// failure report.
    pub fn keep_for(&self, seed: u64) -> String {
        self.keep.set(true);
        format!(
            "----- end; seed {seed} (rerun with MQBLK_GUEST_SEED={seed}); image and logs kept in \
             {} -----",
            self.path.display()
        )
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Some(tmp) = self.tmp.take() {
            if self.keep.get() {
                let _ = tmp.keep();
            }
        }
    }
}

/// The head of a failure report: `title`, then each failure on its own line.
pub fn failure_list(title: &str, failures: &[String]) -> String {
    let mut msg = format!("{title}:\n");
    for f in failures {
        msg.push_str(&format!("  - {f}\n"));
    }
    msg
}

/// A section of a failure report: the last `lines` lines of the file at `path`.
pub fn log_section(what: &str, path: &Path, lines: usize) -> String {
    format!(
        "----- {what} ({}) -----\n{}\n",
        path.display(),
        tail(&read_lossy(path), lines)
    )
}

/// A log or console file as text (carriage returns dropped), or a note saying why not.
pub fn read_lossy(path: &Path) -> String {
    match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).replace('\r', ""),
        Err(e) if e.kind() == io::ErrorKind::NotFound => "<not created>".to_string(),
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let skip = lines.len().saturating_sub(n);
    let mut out = String::new();
    if skip > 0 {
        out.push_str(&format!("[... {skip} lines left out ...]\n"));
    }
    out.push_str(&lines[skip..].join("\n"));
    out
}

/// The guest's report in a console line: the text after [`MARK`]. The kernel may print on the
/// same console, so the marker can follow other output on a line.
pub fn report_line(line: &str) -> Option<&str> {
    line.find(MARK).map(|i| line[i + MARK.len()..].trim())
}

/// Guest kernel messages on the console that mean the disk broke (the guests log warnings and
/// worse): a request completed twice ("id N is not a head"), I/O errors, a virtqueue broken or
/// a task hung on the disk, a panic.
const KERNEL_TROUBLE: &[&str] = &[
    "is not a head",
    "I/O error",
    "virtqueue",
    "blocked for more than",
    "Kernel panic",
    "BUG:",
    "Oops",
];

/// Whether a console line is a kernel message of [`KERNEL_TROUBLE`] (never the guest's own
/// report lines, which may quote them).
pub fn is_kernel_trouble(line: &str) -> bool {
    !line.contains(MARK) && KERNEL_TROUBLE.iter().any(|k| line.contains(k))
}

/// The number in a `key=N` word of `line`.
pub fn word_value(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// What is wrong with the `RESULT` lines among the guest's report lines: there must be one, and
/// it must say PASS.
pub fn result_failure<'a>(report: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let results: Vec<&str> = report
        .into_iter()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .collect();
    match results.as_slice() {
        ["PASS"] => None,
        [] => Some("the guest printed no RESULT line (it crashed or hung)".into()),
        [one] => Some(format!("the guest reported: RESULT {one}")),
        many => Some(format!("the guest printed several RESULT lines: {many:?}")),
    }
}

/// md5 of `data` as hex, by md5sum(1) (coreutils); an error if md5sum fails.
pub fn md5_hex(data: &[u8]) -> Result<String, String> {
    let mut child = Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run md5sum: {e}"))?;
    {
        let mut stdin = child.stdin.take().expect("piped");
        stdin
            .write_all(data)
            .map_err(|e| format!("writing to md5sum: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for md5sum: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "md5sum failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::to_string)
        .ok_or_else(|| "md5sum printed nothing".into())
}
