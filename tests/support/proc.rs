#![allow(dead_code)]
//! A child process of a guest test (QEMU or a backend), killed when dropped. Shared by
//! `tests/guest.rs` and `tests/guest_reconnect.rs` through `#[path]`.

use std::io;
use std::process::{Child, Command, ExitStatus};
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
