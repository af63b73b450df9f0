//! `engine=mem`: a RAM disk, a memfd served by the io_uring engine.

use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::path::Path;

use super::uring::{ioerr, UringEngine};
use super::OpenError;

/// A zeroed RAM disk of `size` bytes.
pub(super) fn open(size: u64) -> Result<UringEngine, OpenError> {
    // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"mqblk-mem".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(ioerr(
            "memfd_create for",
            Path::new("mem"),
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` is a fresh descriptor that we own exclusively.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|e| ioerr("sizing RAM disk", Path::new("mem"), e))?;
    Ok(UringEngine::new(file, size, 512, "mem"))
}
