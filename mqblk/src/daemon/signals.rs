//! SIGINT and SIGTERM: blocked in every thread, and waited for by the main thread.

use std::io;
use std::time::Duration;

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local, zero-initialised set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Blocks SIGINT and SIGTERM in this thread (and every thread it starts later), so that they
/// wait for [`wait`] instead of interrupting anyone.
pub fn block() -> io::Result<()> {
    let set = stop_signals();
    // SAFETY: pthread_sigmask on this thread with a valid set.
    let r = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    Ok(())
}

/// Waits up to `timeout` (forever with `None`) for SIGINT or SIGTERM, blocked beforehand with
/// [`block`]; returns its number.
pub fn wait(timeout: Option<Duration>) -> Option<i32> {
    let set = stop_signals();
    match timeout {
        None => loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: sigwait on a set of blocked signals; `sig` outlives the call.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                return Some(sig);
            }
        },
        Some(t) => {
            let ts = libc::timespec {
                tv_sec: t.as_secs() as libc::time_t,
                tv_nsec: t.subsec_nanos() as libc::c_long,
            };
            // SAFETY: sigtimedwait on a set of blocked signals; the info pointer may be null;
            // `ts` outlives the call.
            let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
            (sig > 0).then_some(sig)
        }
    }
}
