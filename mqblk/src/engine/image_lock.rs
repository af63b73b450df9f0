//! QEMU's image locks, so that mqblk and QEMU's programs (a VM, `qemu-img`, `qemu-io`,
//! qemu-storage-daemon) never open one image in ways that break each other: a second writer of
//! a qcow2 image, or `qemu-img resize` under a served one, corrupts it.
//!
//! QEMU's file driver (`block/file-posix.c`) takes open-file-description locks (`F_OFD_SETLK`,
//! shared) on single bytes of the image file: byte `100 + p` while it holds permission `p`, and
//! byte `200 + p` while it forbids others to hold `p`. Before holding `p` it checks that nobody
//! holds byte `200 + p`, and before forbidding `p` that nobody holds byte `100 + p`; it locks
//! first and checks after, so that of two processes opening at once at least one sees the
//! other. The bytes are locked, never written, so they are the same on every format and every
//! file size. mqblk takes the bytes qemu-storage-daemon takes for the same export (as seen in
//! `/proc/locks`): [`Perms`].
//!
//! The locks belong to an open file description, and die with it: a crashed daemon leaves
//! none. An [`ImageLock`] holds them on a description of its own, never handed to an io_uring:
//! a ring keeps the descriptions its requests used until its teardown, which the kernel
//! finishes after the process has exited, and QEMU opening the image the moment mqblk exits
//! would find it still locked.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The first of the bytes locked while a permission is held.
const HELD_AT: i64 = 100;
/// The first of the bytes locked while a permission is forbidden to others.
const UNSHARED_AT: i64 = 200;

/// QEMU's permissions (`BLK_PERM_*`), as bit numbers.
const CONSISTENT_READ: u8 = 0;
const WRITE: u8 = 1;
const WRITE_UNCHANGED: u8 = 2;
const RESIZE: u8 = 3;
/// Every permission QEMU locks a byte for.
const ALL: [u8; 4] = [CONSISTENT_READ, WRITE, WRITE_UNCHANGED, RESIZE];

/// The name QEMU gives permission `p` in its messages.
fn name(p: u8) -> &'static str {
    match p {
        CONSISTENT_READ => "consistent read",
        WRITE => "write",
        WRITE_UNCHANGED => "write unchanged",
        _ => "resize",
    }
}

/// What a process does to an image, and what it forbids others to do, as bit sets of
/// permissions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Perms {
    held: u8,
    unshared: u8,
}

const fn bits(perms: &[u8]) -> u8 {
    let mut b = 0;
    let mut i = 0;
    while i < perms.len() {
        b |= 1 << perms[i];
        i += 1;
    }
    b
}

impl Perms {
    /// A raw image served writable: read and written; nobody else may resize it (its capacity
    /// is the guest's). Others may write, as a shared disk's other users do.
    pub const RAW_WRITABLE: Perms = Perms {
        held: bits(&[CONSISTENT_READ, WRITE]),
        unshared: bits(&[RESIZE]),
    };
    /// A raw image served read-only.
    pub const RAW_READONLY: Perms = Perms {
        held: bits(&[CONSISTENT_READ]),
        unshared: bits(&[RESIZE]),
    };
    /// A qcow2 image served writable: its metadata has one writer, so nobody else may write or
    /// resize it.
    pub const QCOW2_WRITABLE: Perms = Perms {
        held: bits(&[CONSISTENT_READ, WRITE, RESIZE]),
        unshared: bits(&[WRITE, RESIZE]),
    };
    /// A qcow2 image served read-only: its metadata must not change under the export.
    pub const QCOW2_READONLY: Perms = Perms {
        held: bits(&[CONSISTENT_READ]),
        unshared: bits(&[WRITE, RESIZE]),
    };
    /// An image of a backing chain: read, and nothing forbidden (as QEMU opens one under a
    /// writable overlay).
    pub const BACKING: Perms = Perms {
        held: bits(&[CONSISTENT_READ]),
        unshared: 0,
    };
}

/// Why an image's locks could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another process's locks conflict with this export's.
    #[error(
        "{path} is in use by another process: it {conflict} (QEMU's image locks); stop that \
         process first, or serve a copy of the image"
    )]
    InUse {
        /// The image.
        path: String,
        /// What the other process does, in QEMU's words.
        conflict: String,
    },
    /// The lock calls themselves failed.
    #[error("cannot lock {path}: {err}")]
    Io {
        /// The image.
        path: String,
        /// The error.
        err: io::Error,
    },
}

/// QEMU's locks on one image, held on a description of its own.
#[derive(Debug)]
pub struct ImageLock {
    file: File,
    path: PathBuf,
    perms: Perms,
}

impl ImageLock {
    /// Opens another description of `served` (the image at `path`) for its locks, taking none
    /// yet.
    pub fn new(served: &File, path: &Path, perms: Perms) -> Result<ImageLock, LockError> {
        let io = |err| LockError::Io {
            path: path.display().to_string(),
            err,
        };
        let file = File::open(path).map_err(io)?;
        let (a, b) = (file.metadata().map_err(io)?, served.metadata().map_err(io)?);
        if (a.dev(), a.ino()) != (b.dev(), b.ino()) {
            return Err(io(io::Error::other("the path names another file now")));
        }
        Ok(ImageLock {
            file,
            path: path.to_path_buf(),
            perms,
        })
    }

    /// [`ImageLock::new`], then [`ImageLock::take`].
    pub fn taken(served: &File, path: &Path, perms: Perms) -> Result<ImageLock, LockError> {
        let lock = ImageLock::new(served, path, perms)?;
        lock.take()?;
        Ok(lock)
    }

    /// Takes the locks (again, if held), or none if another process's conflict.
    pub fn take(&self) -> Result<(), LockError> {
        lock(&self.file, self.perms, &self.path)
    }

    /// Lets go of the locks.
    pub fn release(&self) {
        unlock(&self.file);
    }
}

/// Takes the locks of `perms` on `file` (the image at `path`), replacing any this description
/// held before, and checks that no other description's locks conflict; on a conflict, this
/// description holds none of the locks afterwards.
fn lock(file: &File, perms: Perms, path: &Path) -> Result<(), LockError> {
    let io = |err| LockError::Io {
        path: path.display().to_string(),
        err,
    };
    for p in ALL {
        for (at, set) in [(HELD_AT, perms.held), (UNSHARED_AT, perms.unshared)] {
            let kind = if set & (1 << p) != 0 {
                libc::F_RDLCK
            } else {
                libc::F_UNLCK
            };
            match ofd(file, libc::F_OFD_SETLK, kind as i16, at + i64::from(p)) {
                Ok(_) => {}
                // Only a write lock refuses a shared one; QEMU takes none, but whoever does
                // forbids everything.
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                    unlock(file);
                    return Err(LockError::InUse {
                        path: path.display().to_string(),
                        conflict: "holds an exclusive lock on the image".into(),
                    });
                }
                Err(e) => {
                    unlock(file);
                    return Err(io(e));
                }
            }
        }
    }
    match conflict(file, perms) {
        Ok(None) => Ok(()),
        Ok(Some(conflict)) => {
            unlock(file);
            Err(LockError::InUse {
                path: path.display().to_string(),
                conflict,
            })
        }
        Err(e) => {
            unlock(file);
            Err(io(e))
        }
    }
}

/// Lets go of every lock of QEMU's protocol `file`'s description holds.
fn unlock(file: &File) {
    for p in ALL {
        for at in [HELD_AT, UNSHARED_AT] {
            // Unlocking what is not locked succeeds; nothing else can fail on a valid file.
            let _ = ofd(
                file,
                libc::F_OFD_SETLK,
                libc::F_UNLCK as i16,
                at + i64::from(p),
            );
        }
    }
}

/// What another description does that `perms` cannot live with, in QEMU's words.
fn conflict(file: &File, perms: Perms) -> io::Result<Option<String>> {
    for p in ALL {
        if perms.held & (1 << p) != 0 && held_elsewhere(file, UNSHARED_AT + i64::from(p))? {
            return Ok(Some(format!("forbids others to {}", name(p))));
        }
        if perms.unshared & (1 << p) != 0 && held_elsewhere(file, HELD_AT + i64::from(p))? {
            return Ok(Some(format!(
                "holds the \"{}\" permission, which this export forbids",
                name(p)
            )));
        }
    }
    Ok(None)
}

/// Whether a description other than `file`'s holds a lock on byte `at`.
fn held_elsewhere(file: &File, at: i64) -> io::Result<bool> {
    // A lock of `file`'s own description never gets in the way of its own test.
    ofd(file, libc::F_OFD_GETLK, libc::F_WRLCK as i16, at).map(|kind| kind != libc::F_UNLCK as i16)
}

/// `fcntl(cmd)` with an open file description lock of type `kind` on byte `at` of `file`;
/// returns the type `F_OFD_GETLK` reports (`F_UNLCK`: none held in the way).
pub fn ofd(file: &File, cmd: libc::c_int, kind: i16, at: i64) -> io::Result<i16> {
    // SAFETY: an all-zero flock is a valid value of the plain C struct.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = at;
    fl.l_len = 1;
    // SAFETY: a descriptor `file` owns, and a flock the call reads and (for GETLK) writes.
    if unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fl.l_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    #[test]
    fn two_writers_of_a_qcow2_image_conflict_and_raw_ones_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let (a, b) = (open(&path), open(&path));
        lock(&a, Perms::QCOW2_WRITABLE, &path).unwrap();
        let e = lock(&b, Perms::QCOW2_WRITABLE, &path).unwrap_err();
        assert!(e.to_string().contains("forbids others to write"), "{e}");
        // The loser holds nothing: the winner's own check still passes.
        assert_eq!(conflict(&a, Perms::QCOW2_WRITABLE).unwrap(), None);
        // A backing chain's reader lives with a writer.
        lock(&b, Perms::BACKING, &path).unwrap();
        unlock(&a);
        unlock(&b);
        lock(&a, Perms::RAW_WRITABLE, &path).unwrap();
        lock(&b, Perms::RAW_WRITABLE, &path).unwrap();
        // A qcow2 writer forbids the raw writers' write.
        let c = open(&path);
        let e = lock(&c, Perms::QCOW2_WRITABLE, &path).unwrap_err();
        assert!(e.to_string().contains("\"write\" permission"), "{e}");
        // Taken again with fewer permissions, a description lets the others go.
        lock(&a, Perms::BACKING, &path).unwrap();
        lock(&b, Perms::BACKING, &path).unwrap();
        lock(&c, Perms::QCOW2_WRITABLE, &path).unwrap();
    }
}
