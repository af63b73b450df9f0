//! The frontend's dirty log (vhost-user "Migration": VHOST_F_LOG_ALL with the protocol feature
//! LOG_SHMFD): a bitmap in memory the frontend shares, one bit per 4 KiB guest-physical page,
//! byte `page / 8`, bit `page % 8`, starting at guest address 0. While a VM migrates, the
//! frontend copies guest memory to the destination and, after each pass, reads and clears this
//! log (with atomic exchanges) to learn which pages the backend changed meanwhile, so that it
//! sends them again.
//!
//! Nothing but mqblk can fill it: io_uring reads write into guest pages from the kernel, which
//! no dirty bitmap of the frontend (nor vm-memory's) ever sees. A page is marked after it is
//! written, so that a pass that clears the bit before the write cannot hide it.
//!
//! The mapping is a file the frontend hands over and could shrink at any moment; a write to a
//! shared mapping past the end of its file raises SIGBUS, which would take the whole daemon
//! down. mqblk therefore maps only a log whose file is sealed against shrinking (F_SEAL_SHRINK,
//! a guarantee the kernel keeps for every holder of the file): QEMU's log is a memfd sealed
//! that way already, Cloud Hypervisor's a memfd that allows sealing, which mqblk seals itself.
//! A file that cannot be sealed (not a memfd, or sealed against further seals) is refused.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU8, Ordering};

/// Bytes of guest memory one bit of the log covers (VHOST_LOG_PAGE).
pub const LOG_PAGE: u64 = 0x1000;

/// Largest log mqblk maps: 1 GiB covers 32 TiB of guest-physical address space.
pub const MAX_LOG_BYTES: u64 = 1 << 30;

/// Why a log handed over with SET_LOG_BASE is refused. Each message is its log line.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A log of 0 bytes or larger than [`MAX_LOG_BYTES`].
    #[error("a log of {0} bytes (1 byte to 1 GiB)")]
    Size(u64),
    /// The file cannot be sealed against shrinking.
    #[error(
        "its file cannot be sealed against shrinking ({0}): the frontend could truncate it \
         under mqblk"
    )]
    Unsealable(io::Error),
    /// The file's length cannot be read.
    #[error("cannot stat its file: {0}")]
    Stat(io::Error),
    /// The log does not lie within its file.
    #[error("{size} bytes at offset {offset} extend past the end of its {file_len}-byte file")]
    PastEnd {
        /// The log's size.
        size: u64,
        /// Its offset in the file.
        offset: u64,
        /// The file's length.
        file_len: u64,
    },
    /// mmap refused the file (not mappable, or not writable).
    #[error("cannot map it: {0}")]
    Map(io::Error),
}

/// A mapped dirty log.
pub struct DirtyLog {
    /// The mapping as mmap returned it (page-aligned), and its length.
    map: *mut libc::c_void,
    map_len: usize,
    /// The log's first byte (inside the mapping: the offset need not be page-aligned).
    bits: *const AtomicU8,
    /// Bytes of log.
    len: usize,
    /// Keeps the file (and its seal) as long as the mapping.
    _file: File,
}

// SAFETY: the mapping is shared memory accessed only through `AtomicU8`s (`mark`), from any
// thread; the pointers are never handed out.
unsafe impl Send for DirtyLog {}
// SAFETY: as above: every access is atomic.
unsafe impl Sync for DirtyLog {}

impl Drop for DirtyLog {
    fn drop(&mut self) {
        // SAFETY: `map`/`map_len` are exactly what mmap returned, and nothing refers into the
        // mapping once the last owner drops it.
        unsafe {
            libc::munmap(self.map, self.map_len);
        }
    }
}

impl DirtyLog {
    /// Maps `size` bytes of `file` at `offset` (SET_LOG_BASE), sealing the file against
    /// shrinking first so that the length checked here stays true.
    pub fn map(file: File, offset: u64, size: u64) -> Result<DirtyLog, LogError> {
        if size == 0 || size > MAX_LOG_BYTES {
            return Err(LogError::Size(size));
        }
        crate::shm::seal::against_shrinking(&file).map_err(LogError::Unsealable)?;
        let file_len = file.metadata().map_err(LogError::Stat)?.len();
        if offset.checked_add(size).is_none_or(|end| end > file_len) {
            return Err(LogError::PastEnd {
                size,
                offset,
                file_len,
            });
        }
        // mmap wants a page-aligned offset: map from the page the log starts in.
        let page = rustix::param::page_size() as u64;
        let delta = offset % page;
        let map_len = (size + delta) as usize;
        let map_offset = libc::off_t::try_from(offset - delta)
            .map_err(|_| LogError::Map(io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
        // SAFETY: a fresh shared mapping of bytes that lie within the file (checked above, and
        // the file cannot shrink: sealed); the result is checked before use.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                map_offset,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(LogError::Map(io::Error::last_os_error()));
        }
        // SAFETY: `delta < map_len`, so the log's first byte lies inside the mapping.
        let bits = unsafe { map.cast::<u8>().add(delta as usize) }.cast::<AtomicU8>();
        Ok(DirtyLog {
            map,
            map_len,
            bits,
            len: size as usize,
            _file: file,
        })
    }

    /// Bytes of log.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a log has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Guest-physical bytes the log covers (from address 0).
    pub fn covers(&self) -> u64 {
        self.len as u64 * 8 * LOG_PAGE
    }

    /// Whether the guest-physical range `gpa..gpa + len` lies within what the log covers.
    pub fn fits(&self, gpa: u64, len: u64) -> bool {
        gpa.checked_add(len).is_some_and(|end| end <= self.covers())
    }

    /// Marks the pages of the guest-physical range `gpa..gpa + len` dirty. Returns the pages
    /// of the range that lie beyond the log (not marked; 0 when it all fits).
    pub fn mark(&self, gpa: u64, len: u64) -> u64 {
        if len == 0 {
            return 0;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len - 1) / LOG_PAGE;
        let pages = self.len as u64 * 8;
        let end = last.min(pages.saturating_sub(1));
        let mut p = first;
        while p <= end {
            let (byte, mask, n) = bits_of(p, end);
            // SAFETY: `byte = p / 8` with `p < pages = len * 8`, so within the log.
            let cell = unsafe { &*self.bits.add(byte as usize) };
            // Release: whoever reads the bit with an acquire (the frontend's exchange) sees
            // the page's new content, which this thread wrote or saw completed before.
            cell.fetch_or(mask, Ordering::Release);
            p += n;
        }
        if last >= pages {
            last - first.max(pages) + 1
        } else {
            0
        }
    }
}

/// The log byte of page `p`, the mask of the bits from `p` to at most `end` within that byte,
/// and how many pages the mask covers.
fn bits_of(p: u64, end: u64) -> (u64, u8, u64) {
    let bit = p % 8;
    let n = (8 - bit).min(end - p + 1);
    let mask = (((1u16 << n) - 1) << bit) as u8;
    (p / 8, mask, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::{memfd_create, MemfdFlags};

    fn memfd(len: u64, flags: MemfdFlags) -> File {
        let f = File::from(memfd_create(c"dirty-log-test", flags).unwrap());
        f.set_len(len).unwrap();
        f
    }

    fn sealable(len: u64) -> File {
        memfd(len, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
    }

    fn read(f: &File, at: u64, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut v, at).unwrap();
        v
    }

    #[test]
    fn marks_each_page_of_a_range_once() {
        let f = sealable(4096);
        let view = f.try_clone().unwrap();
        let log = DirtyLog::map(f, 0, 16).unwrap();
        assert_eq!(log.covers(), 128 * LOG_PAGE);
        assert_eq!(log.mark(0, 1), 0);
        assert_eq!(read(&view, 0, 1), [0b1]);
        // Pages 3..=12: bits 3-7 of byte 0, 0-4 of byte 1.
        assert_eq!(log.mark(3 * LOG_PAGE + 100, 10 * LOG_PAGE - 100), 0);
        assert_eq!(read(&view, 0, 3), [0b1111_1001, 0b0001_1111, 0]);
        // A 2-byte write straddling pages 16 and 17.
        log.mark(17 * LOG_PAGE - 1, 2);
        assert_eq!(read(&view, 2, 1), [0b11]);
        // Zero bytes mark nothing.
        log.mark(100 * LOG_PAGE, 0);
        assert_eq!(read(&view, 12, 1), [0]);
        // A whole byte.
        log.mark(64 * LOG_PAGE, 8 * LOG_PAGE);
        assert_eq!(read(&view, 8, 1), [0xff]);
    }

    #[test]
    fn never_writes_past_the_log() {
        let f = sealable(4096);
        let view = f.try_clone().unwrap();
        // 2 bytes at offset 100 (not page-aligned): 16 pages.
        let log = DirtyLog::map(f, 100, 2).unwrap();
        assert_eq!(
            log.mark(15 * LOG_PAGE, 3 * LOG_PAGE),
            2,
            "pages 16 and 17 are outside"
        );
        assert_eq!(read(&view, 100, 3), [0, 0x80, 0]);
        assert_eq!(log.mark(1 << 40, 4096), 1);
        assert_eq!(log.mark(u64::MAX - 10, 100), 1, "saturates at the top");
        assert!(log.fits(0, 16 * LOG_PAGE) && !log.fits(0, 16 * LOG_PAGE + 1));
        assert!(!log.fits(u64::MAX, 2));
        assert_eq!(read(&view, 102, 1), [0]);
        assert!(read(&view, 0, 100).iter().all(|&b| b == 0));
    }

    #[test]
    fn refuses_what_could_fault() {
        assert!(matches!(
            DirtyLog::map(sealable(4096), 0, 0),
            Err(LogError::Size(0))
        ));
        assert!(matches!(
            DirtyLog::map(sealable(4096), 0, MAX_LOG_BYTES + 1),
            Err(LogError::Size(_))
        ));
        assert!(matches!(
            DirtyLog::map(sealable(4096), 4000, 200),
            Err(LogError::PastEnd { .. })
        ));
        assert!(matches!(
            DirtyLog::map(sealable(4096), u64::MAX, 2),
            Err(LogError::PastEnd { .. })
        ));
        // A memfd created without MFD_ALLOW_SEALING carries F_SEAL_SEAL: it could shrink.
        assert!(matches!(
            DirtyLog::map(memfd(4096, MemfdFlags::CLOEXEC), 0, 16),
            Err(LogError::Unsealable(_))
        ));
        // A pipe is no file to map.
        let (r, _w) = rustix::pipe::pipe().unwrap();
        assert!(DirtyLog::map(File::from(r), 0, 16).is_err());
    }

    #[test]
    fn a_mapped_log_cannot_be_truncated_under_it() {
        let f = sealable(4096);
        let frontend = f.try_clone().unwrap();
        let log = DirtyLog::map(f, 0, 4096).unwrap();
        let e = frontend.set_len(0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        assert_eq!(log.mark(32767 * LOG_PAGE, 1), 0);
        // Growing is the frontend's business.
        frontend.set_len(8192).unwrap();
        assert_eq!(read(&frontend, 4095, 1), [0x80]);
    }
}
