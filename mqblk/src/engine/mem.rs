//! `engine=mem`: a RAM disk, a memfd served by the io_uring engine.

use std::fs::File;
use std::path::Path;

use rustix::fs::{memfd_create, MemfdFlags};

use super::uring::{ioerr, UringEngine};
use super::OpenError;

/// A zeroed RAM disk of `size` bytes.
pub(super) fn open(size: u64) -> Result<UringEngine, OpenError> {
    let file = File::from(
        memfd_create(c"mqblk-mem", MemfdFlags::CLOEXEC)
            .map_err(|e| ioerr("memfd_create for", Path::new("mem"), e.into()))?,
    );
    file.set_len(size)
        .map_err(|e| ioerr("sizing RAM disk", Path::new("mem"), e))?;
    Ok(UringEngine::new(file, size, 512, "mem"))
}
