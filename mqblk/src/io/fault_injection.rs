//! Faults a test can make an I/O thread suffer, to prove what contains them: a panic (the
//! export is marked failed, the others keep serving) and a system call outside the thread's
//! seccomp allowlist (the sandbox stops it). Debug builds only: a release build has neither the
//! command nor the management method that sends it.

use std::str::FromStr;

/// A fault to inject into an I/O thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The thread panics.
    Panic,
    /// The thread makes a system call no I/O thread needs (it opens an IPv4 TCP socket).
    ForbiddenSyscall,
}

impl Fault {
    /// The names the management API accepts.
    pub const NAMES: &'static str = "panic or forbidden-syscall";

    /// Makes the calling (I/O) thread suffer the fault.
    pub(super) fn inflict(self) {
        let current = std::thread::current();
        let thread = current.name().unwrap_or("an I/O thread");
        match self {
            Fault::Panic => panic!("{thread}: injected fault"),
            Fault::ForbiddenSyscall => {
                let r = std::net::TcpListener::bind("127.0.0.1:0");
                tracing::warn!(
                    thread,
                    allowed = r.is_ok(),
                    "injected forbidden system call returned"
                );
            }
        }
    }
}

/// A fault name that is none of [`Fault::NAMES`].
#[derive(Debug, thiserror::Error)]
#[error("'fault' is '{0}': {names}", names = Fault::NAMES)]
pub struct UnknownFault(String);

impl FromStr for Fault {
    type Err = UnknownFault;

    fn from_str(s: &str) -> Result<Fault, UnknownFault> {
        match s {
            "panic" => Ok(Fault::Panic),
            "forbidden-syscall" => Ok(Fault::ForbiddenSyscall),
            _ => Err(UnknownFault(s.into())),
        }
    }
}
