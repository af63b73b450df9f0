//! Child processes that are killed when dropped, tool checks, and the initramfs build.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Appended to "cannot start" messages.
pub const START_HINT: &str = "run `bash .ci/setup` from the repository root to install QEMU, \
    busybox-static, fio and the guest kernel";

pub struct Proc {
    pub name: String,
    pub child: Child,
}

impl Proc {
    pub fn spawn(name: String, cmd: &mut Command) -> Self {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}; {START_HINT}"));
        Proc { name, child }
    }

    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> io::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: libc::c_int) -> io::Result<()> {
        let pid = libc::pid_t::try_from(self.child.id())
            .map_err(|_| io::Error::other("pid out of range"))?;
        // SAFETY: kill(2) has no memory-safety preconditions; `pid` is our own child, not yet
        // reaped (we only reap it through `self.child`), so it cannot name another process.
        if unsafe { libc::kill(pid, sig) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// SIGKILL and reap (a no-op when it has exited already).
    pub fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            if let Err(e) = self.child.kill() {
                eprintln!("guest reconnect test: killing {}: {e}", self.name);
            }
            // SIGKILL cannot be caught, so this wait is bounded.
            let _ = self.child.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// First line of `tool --version`; panics with the setup hint when the tool is missing.
pub fn tool_version(tool: &str) -> String {
    match Command::new(tool)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
    {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or(tool)
            .to_string(),
        Ok(out) => panic!(
            "`{tool} --version` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => panic!("cannot run {tool}: {e}; {START_HINT}"),
    }
}

/// Runs an initramfs build script (`rel`, relative to the repository; a no-op when its output is
/// up to date) and returns the path it prints.
pub fn build_initramfs(repo: &Path, rel: &str) -> PathBuf {
    let script = repo.join(rel);
    let out = Command::new("bash")
        .arg(&script)
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

/// What differs between the guest tests' QEMU runs; [`spawn_qemu`] adds the common rest.
pub struct Qemu<'a> {
    /// vCPUs.
    pub smp: usize,
    /// `-cpu` model, if not QEMU's default.
    pub cpu: Option<&'a str>,
    /// The vhost-user socket.
    pub socket: &'a Path,
    /// More chardev options, each with its leading comma (e.g. `,reconnect-ms=200`).
    pub chardev_extra: String,
    /// Virtqueues of the vhost-user-blk device.
    pub queues: usize,
    /// File for the serial console.
    pub console: &'a Path,
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    /// Kernel command line.
    pub append: String,
    /// QEMU's own stdout and stderr.
    pub log: std::fs::File,
}

/// Starts QEMU under TCG with a vhost-user-blk disk on `q.socket` and shared (memfd) guest
/// memory, booting `q.kernel` and `q.initramfs` with the console in a file.
pub fn spawn_qemu(q: Qemu) -> Proc {
    let log2 = q.log.try_clone().expect("duplicate the QEMU log's fd");
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
                q.socket.display(),
                q.chardev_extra
            ),
        ),
        (
            "-device",
            format!("vhost-user-blk-pci,chardev=vub0,num-queues={}", q.queues),
        ),
        ("-display", "none".into()),
        ("-monitor", "none".into()),
        ("-serial", format!("file:{}", q.console.display())),
        ("-no-reboot", String::new()),
        ("-kernel", q.kernel.display().to_string()),
        ("-initrd", q.initramfs.display().to_string()),
        ("-append", q.append),
    ]);
    let mut cmd = Command::new("qemu-system-x86_64");
    for (opt, value) in args {
        cmd.arg(opt);
        if !value.is_empty() {
            cmd.arg(value);
        }
    }
    cmd.stdin(Stdio::null()).stdout(log2).stderr(q.log);
    Proc::spawn("qemu-system-x86_64".into(), &mut cmd)
}
