//! The space of a raw image file as `preallocation=` provides it: when mqblk creates the file,
//! and when `export_resize` grows it. (A qcow2 image's goes through imago: `qcow2/image.rs`.)

use std::fs::File;
use std::io::{self, IoSlice};

use rustix::fs::FallocateFlags;
use rustix::io::Errno;

use crate::config::Preallocation;

/// A buffer aligned for any O_DIRECT transfer.
#[repr(C, align(4096))]
pub(super) struct DirectBuf(pub(super) [u8; 4096]);

/// Zeros written per call under `preallocation=full`: 1 MiB, one zeroed page repeated.
const ZERO_PAGES_PER_WRITE: usize = 256;

/// Grows `file` from `from` to `to` bytes as `mode` says. The file may be open with O_DIRECT:
/// both offsets are multiples of 512, which is what direct I/O asks of them on the stores
/// mqblk serves from (a store that asks 4096 of a write that does not meet it has the zeros
/// left unwritten but reserved, as `falloc` leaves them, and says so in the log).
pub fn grow(file: &File, from: u64, to: u64, mode: Preallocation) -> io::Result<()> {
    if to <= from {
        return Ok(());
    }
    match mode {
        Preallocation::Off | Preallocation::Metadata => file.set_len(to),
        Preallocation::Falloc => reserve(file, from, to).map_err(|e| {
            let hint = match e {
                Errno::OPNOTSUPP | Errno::NOSYS => {
                    ": this filesystem does not take preallocation=falloc; full writes zeros \
                     instead, off leaves the file sparse"
                }
                _ => "",
            };
            io::Error::new(
                io::Error::from(e).kind(),
                format!("cannot reserve the file's space with fallocate ({e}){hint}"),
            )
        }),
        Preallocation::Full => {
            // Reserved first so the writes land side by side; where the filesystem cannot
            // reserve, the writes alone take the space.
            match reserve(file, from, to) {
                Err(Errno::OPNOTSUPP | Errno::NOSYS) => file.set_len(to)?,
                other => other?,
            }
            write_zeros(file, from, to)
        }
    }
}

/// Reserves `from..to` with `fallocate` (the file's size grows to `to`).
fn reserve(file: &File, from: u64, to: u64) -> rustix::io::Result<()> {
    rustix::fs::fallocate(file, FallocateFlags::empty(), from, to - from)
}

/// Writes zeros over `from..to`.
fn write_zeros(file: &File, mut from: u64, to: u64) -> io::Result<()> {
    let page = Box::new(DirectBuf([0; 4096]));
    let zeros = [IoSlice::new(&page.0); ZERO_PAGES_PER_WRITE];
    while from < to {
        let want = (to - from).min((ZERO_PAGES_PER_WRITE * page.0.len()) as u64) as usize;
        let (pages, tail) = (want / page.0.len(), want % page.0.len());
        let mut iovs = zeros[..pages].to_vec();
        if tail > 0 {
            iovs.push(IoSlice::new(&page.0[..tail]));
        }
        match rustix::io::pwritev(file, &iovs, from) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => from += n as u64,
            Err(Errno::INVAL) => {
                tracing::warn!(
                    offset = from,
                    "preallocation=full: the store refused a direct write of zeros here (its \
                     alignment); the rest of the new space stays reserved, reading as zeros"
                );
                return Ok(());
            }
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// The bytes of `file` the filesystem has given blocks.
    fn allocated(file: &File) -> u64 {
        file.metadata().unwrap().blocks() * 512
    }

    #[test]
    fn each_mode_grows_the_file_to_zeros_and_takes_its_space_as_it_says() {
        let dir = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        for (mode, reserved) in [
            (Preallocation::Off, false),
            (Preallocation::Falloc, true),
            (Preallocation::Full, true),
        ] {
            let path = dir.path().join(format!("{mode:?}"));
            let file = File::create(&path).unwrap();
            // A tail past a whole write, so the last write is a short one.
            let to = 3 * mib + 4096 + 512;
            grow(&file, 0, to, mode).unwrap();
            assert_eq!(file.metadata().unwrap().len(), to, "{mode:?}");
            assert_eq!(
                allocated(&file) >= to,
                reserved,
                "{mode:?}: {} bytes allocated",
                allocated(&file)
            );
            if mode == Preallocation::Full {
                // Written, not just reserved: no hole (ext4 reports a reserved but unwritten
                // range as one while none of it is in the page cache, so before the read).
                let hole = rustix::fs::seek(&file, rustix::fs::SeekFrom::Hole(0)).unwrap();
                assert_eq!(hole, to, "{mode:?}: the first hole");
            }
            let data = std::fs::read(&path).unwrap();
            assert!(data.iter().all(|b| *b == 0), "{mode:?} reads as zeros");
        }
    }
}
