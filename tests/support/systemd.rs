//! What systemd does for a service, done by hand: a notification socket the daemon reports
//! to (`NOTIFY_SOCKET`), and listening sockets handed to it as descriptors 3, 4, ... (socket
//! activation's `LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES`, or `fd=N`).

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::daemon::mqblk_bin;

/// The first descriptor socket activation hands over (`SD_LISTEN_FDS_START`).
pub const LISTEN_FDS_START: RawFd = 3;

/// A `NOTIFY_SOCKET`: a unix datagram socket the test binds, collecting what the daemon says.
pub struct NotifySocket {
    sock: UnixDatagram,
    pub path: PathBuf,
    /// Every line received so far, in order (`READY=1`, `STATUS=...`, ...).
    pub lines: Vec<String>,
}

impl NotifySocket {
    pub fn bind(path: &Path) -> Self {
        let sock = UnixDatagram::bind(path)
            .unwrap_or_else(|e| panic!("binding the notify socket {}: {e}", path.display()));
        NotifySocket {
            sock,
            path: path.to_path_buf(),
            lines: Vec::new(),
        }
    }

    /// Receives until a line equal to `line` arrives (true) or `timeout` passes (false).
    pub fn wait_for(&mut self, line: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            if self.recv_one(left).iter().any(|l| l == line) {
                return true;
            }
        }
    }

    /// Receives whatever arrives within `window`.
    pub fn drain(&mut self, window: Duration) {
        let deadline = Instant::now() + window;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            self.recv_one(left);
        }
    }

    /// How many of the lines received so far equal `line`.
    pub fn count(&self, line: &str) -> usize {
        self.lines.iter().filter(|l| *l == line).count()
    }

    /// One datagram's lines (also appended to `lines`); none on timeout.
    fn recv_one(&mut self, timeout: Duration) -> Vec<String> {
        self.sock
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .expect("setting the notify socket's timeout");
        let mut buf = [0u8; 4096];
        match self.sock.recv(&mut buf) {
            Ok(n) => {
                let got: Vec<String> = String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .map(str::to_string)
                    .collect();
                self.lines.extend(got.iter().cloned());
                got
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Vec::new()
            }
            Err(e) => panic!("receiving on the notify socket: {e}"),
        }
    }
}

/// Makes `cmd`'s child see `fds` as descriptors 3, 4, ... (open across exec), as systemd
/// hands over the sockets of a socket unit. The caller keeps `fds` open until the child runs.
pub fn pass_fds(cmd: &mut Command, fds: &[RawFd]) {
    let mut fds = fds.to_vec();
    // Above every target: no copy made in the first pass can be overwritten by the second.
    let above = LISTEN_FDS_START + fds.len() as RawFd;
    // SAFETY: the closure runs in the forked child before exec and calls only fcntl and dup2,
    // which are async-signal-safe; it allocates nothing (`fds` was built before the fork and is
    // only overwritten in place).
    unsafe {
        cmd.pre_exec(move || {
            // First move every descriptor out of the way (close-on-exec copies, gone at exec):
            // a descriptor that already is one of the targets 3, 4, ... would otherwise be
            // overwritten before it is handed over.
            for fd in fds.iter_mut() {
                let copy = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, above);
                if copy < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                *fd = copy;
            }
            // Then into place; dup2's copy is open across exec.
            for (i, &fd) in fds.iter().enumerate() {
                if libc::dup2(fd, LISTEN_FDS_START + i as RawFd) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// `mqblk serve ARGS` socket-activated with `fds` named `names` (`LISTEN_FDNAMES`), as systemd
/// starts a service: `LISTEN_PID` must be the daemon's own pid, which a shell that then
/// execs the daemon knows.
pub fn activated_mqblk(fds: &[&dyn AsRawFd], names: &[&str], args: &[String]) -> Command {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(r#"export LISTEN_PID=$$; exec "$0" "$@""#)
        .arg(mqblk_bin())
        .arg("serve")
        .args(args)
        .env("LISTEN_FDS", fds.len().to_string())
        .env("LISTEN_FDNAMES", names.join(":"));
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    pass_fds(&mut cmd, &raw);
    cmd
}
