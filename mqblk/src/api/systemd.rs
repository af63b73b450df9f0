//! systemd: readiness and stop notifications, the watchdog, and the listening sockets socket
//! activation hands over. Outside systemd (no `NOTIFY_SOCKET`, `WATCHDOG_USEC` or
//! `LISTEN_FDS` for this process) every call here does nothing.
//!
//! Socket activation names each socket with its `FileDescriptorName=`; an export whose id is
//! that name serves it. Precedence for an export's listening socket: its own `fd=N`, then a
//! socket-activated one named by its id, then binding its `socket=PATH`.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use sd_notify::NotifyState;

use crate::config::ExportConfig;

/// Tells the service manager that every export listens (`READY=1`), with a status line.
pub fn notify_ready(status: &str) {
    notify(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// Tells the service manager that the daemon is draining (`STOPPING=1`).
pub fn notify_stopping() {
    notify(&[NotifyState::Stopping, NotifyState::Status("draining")]);
}

/// Tells the service manager that the daemon is alive (`WATCHDOG=1`).
pub fn notify_watchdog() {
    notify(&[NotifyState::Watchdog]);
}

fn notify(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(err = %e, "cannot notify the service manager (NOTIFY_SOCKET)");
    }
}

/// How often to send `WATCHDOG=1`: half the unit's `WatchdogSec=`, if it set one for this
/// process.
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
        .filter(|t| !t.is_zero())
        .map(|t| t / 2)
}

/// The listening sockets socket activation handed to this process, with their names
/// (`LISTEN_FDS`, `LISTEN_PID`, `LISTEN_FDNAMES`); none when it was not socket-activated.
pub fn listen_fds() -> io::Result<Vec<(RawFd, String)>> {
    Ok(sd_notify::listen_fds_with_names()?.collect())
}

/// Which socket-activated descriptor each export serves.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Activation {
    /// By export, in the order given.
    pub fds: Vec<Option<RawFd>>,
    /// Descriptors no export takes, and why, for the log.
    pub unused: Vec<(RawFd, String, &'static str)>,
}

/// Matches socket-activated descriptors (`named`: descriptor and `FileDescriptorName=`) to
/// `exports` by id. An export given `fd=` keeps it, and a descriptor some export names with
/// `fd=` is that export's alone.
pub fn assign(exports: &[ExportConfig], named: &[(RawFd, String)]) -> Activation {
    let mut out = Activation {
        fds: vec![None; exports.len()],
        unused: Vec::new(),
    };
    for (fd, name) in named {
        if exports.iter().any(|e| e.fd == Some(*fd)) {
            out.unused.push((
                *fd,
                name.clone(),
                "an export names this descriptor with fd=",
            ));
            continue;
        }
        let Some(i) = exports.iter().position(|e| &e.id == name) else {
            out.unused.push((
                *fd,
                name.clone(),
                "no export has this id (FileDescriptorName=)",
            ));
            continue;
        };
        if exports[i].fd.is_some() {
            out.unused
                .push((*fd, name.clone(), "the export with this id is given fd="));
        } else if out.fds[i].is_some() {
            out.unused.push((
                *fd,
                name.clone(),
                "another descriptor of this name came first",
            ));
        } else {
            out.fds[i] = Some(*fd);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_export_spec;

    #[test]
    fn activated_sockets_go_to_exports_by_id() {
        let exports = [
            parse_export_spec("id=vm1,socket=/run/vm1.sock,engine=null,size=1M").unwrap(),
            parse_export_spec("socket=/run/vm2.sock,engine=null,size=1M").unwrap(),
            parse_export_spec("id=vm3,fd=7,engine=null,size=1M").unwrap(),
            parse_export_spec("socket=/run/vm4.sock,engine=null,size=1M").unwrap(),
        ];
        let named: Vec<(RawFd, String)> = [
            (3, "vm2"),
            (4, "vm1"),
            (5, "vm3"),
            (6, "nobody"),
            (7, "vm4"),
            (8, "vm1"),
        ]
        .iter()
        .map(|&(fd, n)| (fd, n.to_string()))
        .collect();
        let a = assign(&exports, &named);
        // vm2's id is its socket's name; vm3 keeps its own fd=7, which is nobody else's.
        assert_eq!(a.fds, vec![Some(4), Some(3), None, None]);
        let unused: Vec<RawFd> = a.unused.iter().map(|u| u.0).collect();
        assert_eq!(unused, vec![5, 6, 7, 8]);
        assert_eq!(
            assign(&exports, &[]),
            Activation {
                fds: vec![None; 4],
                unused: vec![]
            }
        );
    }
}
