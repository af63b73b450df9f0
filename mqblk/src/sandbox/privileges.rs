//! Privileges: every capability given up (the bounding and ambient sets included, so that none
//! can come back), no new privileges, and optionally another user and group.
//!
//! These calls change the calling thread only (rustix makes the raw system calls, without
//! glibc's broadcast to other threads): the sandbox makes them while the process has one thread.

use std::ffi::CString;

use rustix::process::{Gid, Uid};
use rustix::thread::{CapabilitySet, CapabilitySets};

use super::Error;

/// The user and group to run as (`--user`, `--group`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Identity {
    uid: Option<u32>,
    gid: u32,
}

impl Identity {
    /// The identity `user` and `group` name (numbers or names); `None` when neither is given.
    /// Without `group`, the user's own group.
    pub(super) fn resolve(
        user: Option<&str>,
        group: Option<&str>,
    ) -> Result<Option<Identity>, Error> {
        let user = user.map(lookup_user).transpose()?;
        let gid = match (group, user) {
            (Some(g), _) => lookup_group(g)?,
            (None, Some((_, gid))) => gid,
            (None, None) => return Ok(None),
        };
        Ok(Some(Identity {
            uid: user.map(|(uid, _)| uid),
            gid,
        }))
    }
}

impl Identity {
    /// The user and group the daemon runs as with this identity (the current ones where it
    /// does not name them).
    pub(super) fn owner(&self) -> (u32, u32) {
        let uid = self
            .uid
            .unwrap_or_else(|| rustix::process::geteuid().as_raw());
        (uid, self.gid)
    }
}

/// `--user`: its uid and primary gid (a number without a passwd entry: that number for both).
fn lookup_user(name: &str) -> Result<(u32, u32), Error> {
    match (lookup(name, libc::getpwnam_r), name.parse()) {
        (Some(pwd), _) => Ok((pwd.pw_uid, pwd.pw_gid)),
        (None, Ok(uid)) => Ok((uid, uid)),
        (None, Err(_)) => Err(Error::NoSuchUser(format!(
            "--user {name}: no such user (give a name from /etc/passwd or a number)"
        ))),
    }
}

/// `--group`: its gid.
fn lookup_group(name: &str) -> Result<u32, Error> {
    match (lookup(name, libc::getgrnam_r), name.parse()) {
        (Some(grp), _) => Ok(grp.gr_gid),
        (None, Ok(gid)) => Ok(gid),
        (None, Err(_)) => Err(Error::NoSuchUser(format!(
            "--group {name}: no such group (give a name from /etc/group or a number)"
        ))),
    }
}

/// `getpwnam_r` or `getgrnam_r`: name, entry, buffer, its length, result.
type GetByName<T> = unsafe extern "C" fn(
    *const libc::c_char,
    *mut T,
    *mut libc::c_char,
    libc::size_t,
    *mut *mut T,
) -> libc::c_int;

/// The entry `call` finds for `name`, if there is one. Only the entry's numbers may be used:
/// its strings point into a buffer dropped on return.
fn lookup<T: Copy>(name: &str, call: GetByName<T>) -> Option<T> {
    let name = CString::new(name).ok()?;
    // SAFETY: T is libc's passwd or group, plain C structs for which all-zero bytes (null
    // pointers, zero ids) are valid values.
    let mut entry: T = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 64 * 1024];
    let mut found: *mut T = std::ptr::null_mut();
    // SAFETY: every pointer names live memory of the size given: the call writes the entry
    // into `entry`, its strings into `buf`, and points `found` at `entry` or leaves it null.
    let r = unsafe {
        call(
            name.as_ptr(),
            &mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    (r == 0 && !found.is_null()).then_some(entry)
}

/// What the daemon keeps, if anything, for its rings (I/O threads' and qcow2 metadata workers').
///
/// io_uring charges a ring's memory, and the guest memory an I/O thread registers as fixed
/// buffers, against RLIMIT_MEMLOCK (summed over all the user's processes) unless the ring's
/// creator holds CAP_IPC_LOCK when it creates the ring. The daemon lifts the limit while it
/// still may (CAP_SYS_RESOURCE; systemd's `LimitMEMLOCK=infinity` does the same) and then keeps
/// nothing. Where the limit stays finite (a container without CAP_SYS_RESOURCE, say), a
/// confined daemon would run out of it with a few rings and fall back to readv/writev for any
/// guest larger than it (8 MiB by default): so it keeps CAP_IPC_LOCK, permitted but never
/// effective, in its control threads, and each I/O thread (and each qcow2 metadata worker, for
/// its ring and the copy-on-write buffers it registers) raises it for the one `io_uring_setup`
/// and then drops every capability for good ([`ring_setup`]).
pub(super) fn memlock_exemption() -> CapabilitySet {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads a live rlimit.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } == 0 {
        return CapabilitySet::empty();
    }
    let held = rustix::thread::capabilities(None)
        .is_ok_and(|c| c.effective.contains(CapabilitySet::IPC_LOCK));
    if held {
        tracing::info!(
            "RLIMIT_MEMLOCK is finite and cannot be lifted: control threads keep CAP_IPC_LOCK \
             (permitted, not effective) for creating I/O threads' rings"
        );
        CapabilitySet::IPC_LOCK
    } else {
        tracing::warn!(
            "RLIMIT_MEMLOCK is finite: I/O threads' rings and fixed buffers count against it \
             (raise it, e.g. LimitMEMLOCK=infinity)"
        );
        CapabilitySet::empty()
    }
}

/// Runs `create` (a thread creating its ring) with `kept` effective, then gives up every
/// capability of the calling thread.
pub(super) fn ring_setup<T>(kept: CapabilitySet, create: impl FnOnce() -> T) -> T {
    if kept.is_empty() {
        return create();
    }
    let sets = |effective| CapabilitySets {
        effective,
        permitted: kept,
        inheritable: CapabilitySet::empty(),
    };
    if let Err(e) = rustix::thread::set_capabilities(None, sets(kept)) {
        tracing::warn!(err = %e, "cannot raise CAP_IPC_LOCK for the ring");
    }
    let out = create();
    let none = CapabilitySets {
        effective: CapabilitySet::empty(),
        permitted: CapabilitySet::empty(),
        inheritable: CapabilitySet::empty(),
    };
    if let Err(e) = rustix::thread::set_capabilities(None, none) {
        tracing::error!(err = %e, "cannot drop the I/O thread's capabilities");
    }
    out
}

/// Gives up every capability but `keep` (kept permitted, not effective), switches to
/// `identity` if given, and sets no_new_privs.
pub(super) fn drop_all(identity: Option<&Identity>, keep: CapabilitySet) -> Result<(), Error> {
    let refused = |what| {
        move |e: rustix::io::Errno| Error::Refused {
            what,
            err: e.into(),
        }
    };
    // The bounding set first: dropping from it needs CAP_SETPCAP, given up below. A daemon
    // started without that capability cannot shrink it, and cannot gain anything from it
    // either (no_new_privs, and no execve in its seccomp allowlist).
    for bit in 0..64 {
        let cap = CapabilitySet::from_bits_retain(1 << bit);
        if rustix::thread::capability_is_in_bounding_set(cap).unwrap_or(false) {
            if let Err(e) = rustix::thread::remove_capability_from_bounding_set(cap) {
                tracing::debug!(bit, err = %e, "capability left in the bounding set");
            }
        }
    }
    rustix::thread::clear_ambient_capability_set()
        .map_err(refused("clearing ambient capabilities"))?;
    if let Some(id) = identity {
        // Switching away from uid 0 clears the permitted set, unless told to keep it.
        if !keep.is_empty() {
            rustix::thread::set_keep_capabilities(true).map_err(refused("PR_SET_KEEPCAPS"))?;
        }
        let gid = Gid::from_raw(id.gid);
        rustix::thread::set_thread_groups(&[gid]).map_err(refused("setgroups (--group)"))?;
        rustix::thread::set_thread_res_gid(gid, gid, gid)
            .map_err(refused("setresgid (--group)"))?;
        if let Some(uid) = id.uid {
            let uid = Uid::from_raw(uid);
            rustix::thread::set_thread_res_uid(uid, uid, uid)
                .map_err(refused("setresuid (--user)"))?;
        }
    }
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: CapabilitySet::empty(),
            permitted: keep,
            inheritable: CapabilitySet::empty(),
        },
    )
    .map_err(refused("dropping capabilities"))?;
    rustix::thread::set_no_new_privs(true).map_err(refused("PR_SET_NO_NEW_PRIVS"))?;
    Ok(())
}
