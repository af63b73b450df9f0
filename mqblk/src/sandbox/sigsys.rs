//! What happens when a thread makes a system call its seccomp allowlist forbids: the filter
//! traps (SECCOMP_RET_TRAP: the call is not made), this handler writes one line to stderr
//! naming the call and the thread, and the daemon then dies of SIGSYS, as it would under
//! SECCOMP_RET_KILL_PROCESS. Dying is the point: a forbidden call means a bug in an allowlist or
//! code that is not the daemon's, and systemd restarts the daemon on the same sockets. The line
//! is what makes the first case quick to fix.
//!
//! The handler runs in the trapping thread, under that thread's filter: it makes only calls
//! every allowlist has (`prctl(PR_GET_NAME)`, `write`, `rt_sigaction`, `gettid`, `tgkill` to its
//! own process).

use std::sync::atomic::{AtomicI32, Ordering};

use super::Error;

/// The process id, for re-raising SIGSYS from the handler without a lookup.
static PID: AtomicI32 = AtomicI32::new(0);

/// The part of `siginfo_t` the kernel fills in for SIGSYS (`struct { ... } _sigsys` in
/// `<asm-generic/siginfo.h>`, after the three ints and the union's alignment).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

/// Installs the handler (process-wide).
pub(super) fn install() -> Result<(), Error> {
    PID.store(std::process::id() as i32, Ordering::Relaxed);
    // SAFETY: a zeroed sigaction is valid (empty mask, no flags); the handler is an
    // `extern "C"` function of the SA_SIGINFO signature, which stays valid for the process's
    // life.
    let r = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            on_sigsys;
        sa.sa_sigaction = handler as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut())
    };
    if r != 0 {
        return Err(Error::Refused {
            what: "installing the SIGSYS handler",
            err: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SIGSYS, whose layout SigsysInfo mirrors.
    let nr = unsafe { (*info.cast::<SigsysInfo>()).syscall };
    let mut name = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes and a NUL into the 17-byte buffer.
    unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    let name_len = name.iter().position(|&b| b == 0).unwrap_or(16);

    let mut line = Line::default();
    line.push(b"mqblk: sandbox: thread ");
    line.push(&name[..name_len]);
    line.push(b" made system call ");
    line.push_number(nr as i64);
    line.push(b", which its seccomp allowlist forbids: the daemon stops (SIGSYS)\n");
    // SAFETY: writes the line's bytes to stderr; async-signal-safe.
    unsafe { libc::write(2, line.buf.as_ptr().cast(), line.len) };

    // SAFETY: async-signal-safe calls: restore SIGSYS's default action, then send it to this
    // thread. It is blocked while this handler runs, and delivered (killing the process) as
    // the handler returns, before the interrupted code resumes.
    unsafe {
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        let tid = libc::syscall(libc::SYS_gettid);
        libc::syscall(
            libc::SYS_tgkill,
            PID.load(Ordering::Relaxed),
            tid,
            libc::SIGSYS,
        );
    }
}

/// A fixed buffer for the report: a signal handler may not allocate.
struct Line {
    buf: [u8; 256],
    len: usize,
}

impl Default for Line {
    fn default() -> Self {
        Line {
            buf: [0; 256],
            len: 0,
        }
    }
}

impl Line {
    fn push(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    fn push_number(&mut self, v: i64) {
        if v < 0 {
            self.push(b"-");
        }
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        let mut v = v.unsigned_abs();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&digits[i..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_line_is_built_without_allocating() {
        let mut l = Line::default();
        l.push(b"call ");
        l.push_number(41);
        l.push(b" ");
        l.push_number(0);
        l.push(b" ");
        l.push_number(-7);
        assert_eq!(&l.buf[..l.len], b"call 41 0 -7");
        l.push(&[b'x'; 300]);
        assert_eq!(l.len, 256, "a long line is cut, never overflows");
    }
}
