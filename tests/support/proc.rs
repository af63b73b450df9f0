//! Child processes that are killed when dropped, tool checks, and what /proc says about a
//! process's threads.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, Pid, Signal};

use super::qemu::SETUP_HINT;

/// How often the waits look.
const POLL: Duration = Duration::from_millis(20);

pub struct Proc {
    pub name: String,
    pub child: Child,
}

impl Proc {
    pub fn spawn(name: String, cmd: &mut Command) -> Self {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}; {SETUP_HINT}"));
        Proc { name, child }
    }

    /// [`Proc::spawn`] with no stdin and stdout and stderr into a new file `log`.
    pub fn spawn_logged(name: String, cmd: &mut Command, log: &Path) -> Self {
        let out =
            std::fs::File::create(log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        let err = out.try_clone().expect("duplicate the log's fd");
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        Self::spawn(name, cmd)
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
            std::thread::sleep(POLL);
        }
    }

    pub fn signal(&self, sig: Signal) -> io::Result<()> {
        // Our own child, not yet reaped (we only reap it through `self.child`), so its pid
        // cannot name another process.
        Ok(kill_process(Pid::from_child(&self.child), sig)?)
    }

    /// SIGKILL and reap (a no-op when it has exited already).
    pub fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            if let Err(e) = self.child.kill() {
                eprintln!("killing {}: {e}", self.name);
            }
            // SIGKILL cannot be caught, so this wait is bounded.
            let _ = self.child.wait();
        }
    }

    /// Waits until the process has created the unix socket `socket` and `ready()` holds (for a
    /// socket left behind by a killed predecessor, `ready` looks for more); fails early if the
    /// process exits.
    pub fn wait_for_socket(
        &mut self,
        socket: &Path,
        timeout: Duration,
        ready: impl Fn() -> bool,
    ) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(meta) = std::fs::metadata(socket) {
                if !meta.file_type().is_socket() {
                    return Err(format!("{} exists but is not a socket", socket.display()));
                }
                if ready() {
                    return Ok(());
                }
            }
            match self.try_wait() {
                Ok(Some(status)) => {
                    return Err(format!(
                        "{} exited ({status}) before listening on {}",
                        self.name,
                        socket.display()
                    ))
                }
                Ok(None) => {}
                Err(e) => return Err(format!("waiting for {}: {e}", self.name)),
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{} did not listen on {} within {timeout:?}",
                    self.name,
                    socket.display()
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Sends SIGTERM and expects a clean exit (status 0) within `timeout`; returns what is wrong.
    pub fn terminate(&mut self, timeout: Duration) -> Vec<String> {
        let name = self.name.clone();
        match self.try_wait() {
            Ok(Some(status)) => {
                return vec![format!(
                    "{name} exited on its own ({status}) before the test sent SIGTERM"
                )]
            }
            Ok(None) => {}
            Err(e) => return vec![format!("checking on {name}: {e}")],
        }
        if let Err(e) = self.signal(Signal::TERM) {
            return vec![format!("sending SIGTERM to {name}: {e}")];
        }
        match self.wait_timeout(timeout) {
            Ok(Some(status)) if status.success() => vec![],
            Ok(Some(status)) => vec![format!("{name} exited with {status} after SIGTERM")],
            Ok(None) => {
                self.kill();
                vec![format!(
                    "{name} did not exit within {timeout:?} of SIGTERM (killed it)"
                )]
            }
            Err(e) => vec![format!("waiting for {name} after SIGTERM: {e}")],
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
        Err(e) => panic!("cannot run {tool}: {e}; {SETUP_HINT}"),
    }
}

/// One thread of a process, from /proc/PID/task.
#[derive(Clone, Debug)]
pub struct Task {
    /// Its name (`comm`), e.g. `mqblk-io0-disk`.
    pub name: String,
    /// Its state letter: `R` running, `S` sleeping, `D` in uninterruptible sleep, ...
    pub state: char,
    /// CPU time it has used, user and system, in seconds.
    pub cpu_secs: f64,
}

/// The threads of process `pid` (those that exit while being read are left out).
pub fn tasks(pid: u32) -> Vec<Task> {
    // USER_HZ, the unit of utime and stime (100 on every Linux architecture this runs on).
    const TICKS: f64 = 100.0;
    let dir = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap_or_else(|e| panic!("reading /proc/{pid}/task: {e}"));
    dir.flatten()
        .filter_map(|e| {
            let name = std::fs::read_to_string(e.path().join("comm")).ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // After the parenthesised name: the state is field 3, utime and stime 14 and 15.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split(' ').collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(Task {
                name: name.trim().to_string(),
                state: f.first()?.chars().next()?,
                cpu_secs: ticks / TICKS,
            })
        })
        .collect()
}
