//! An image file as imago sees it (its `Storage`): reads, writes and syncs go on the calling
//! metadata worker's ring ([`uring_io`](super::uring_io)), so the copy-on-writes and table
//! write-backs of the jobs a worker runs are in flight together; on a thread without a ring (a
//! control thread opening, resizing or snapshotting the image) they are blocking system calls.
//! Zeroing, discard and resize are rare and always blocking.
//!
//! The alignments O_DIRECT needs are probed once, by imago's own `File` over the same
//! descriptor, at open.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::storage::PreallocateMode;
use imago::{Storage, StorageOpenOptions};

use super::uring_io::{self, Io};

/// How far ahead of its writes the top image file is grown (see `RingFile::grow_for`).
const GROWTH: u64 = 16 << 20;

/// An open image file (a layer of the chain).
#[derive(Debug)]
pub struct RingFile {
    file: File,
    filename: PathBuf,
    mem_align: usize,
    req_align: usize,
    zero_align: usize,
    discard_align: usize,
    /// The file's length as this process made it: writes and zeroing past the end grow it.
    size: AtomicU64,
    /// Writes past the end grow the file first, by [`GROWTH`] at a time (see `grow_for`).
    prealloc: bool,
    helper: CommonStorageHelper,
}

impl fmt::Display for RingFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "file:{}", self.filename.display())
    }
}

impl RingFile {
    /// `file`, opened at `path` as given (`writable`, `direct` must say how).
    pub fn new(file: File, path: &Path, writable: bool, direct: bool) -> io::Result<RingFile> {
        let opts = StorageOpenOptions::new()
            .filename(path)
            .write(writable)
            .direct(direct);
        let probe = imago::file::File::from_open_file(file.try_clone()?, opts)?;
        let size = file.metadata()?.len();
        Ok(RingFile {
            mem_align: probe.mem_align(),
            req_align: probe.req_align(),
            zero_align: probe.zero_align(),
            discard_align: probe.discard_align(),
            file,
            filename: path.to_path_buf(),
            size: AtomicU64::new(size),
            prealloc: writable,
            helper: CommonStorageHelper::default(),
        })
    }

    /// Makes the file reach `end` before a write there: new clusters go at the end of the
    /// file, and a direct write that extends a file is one the filesystem serialises (ext4
    /// takes the inode's lock exclusively and completes it synchronously, so io_uring hands it
    /// to a worker thread). Grown by fallocate ahead of the writes, the file takes them as
    /// writes into its own (unwritten) blocks, side by side.
    fn grow_for(&self, end: u64) -> io::Result<()> {
        let size = self.size.load(Ordering::Acquire);
        if !self.prealloc || end <= size {
            return Ok(());
        }
        let target = end.next_multiple_of(GROWTH);
        match self.fallocate(0, size, target - size) {
            Ok(()) => {
                self.grown_to(target);
                Ok(())
            }
            // The write itself grows it then.
            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn grown_to(&self, end: u64) {
        self.size.fetch_max(end, Ordering::AcqRel);
    }

    /// One `preadv` (read) or `pwritev`, on the ring if this thread has one.
    async fn transfer(&self, iovecs: &[libc::iovec], offset: u64, write: bool) -> io::Result<u64> {
        let fd = self.file.as_raw_fd();
        let res = match uring_io::current() {
            Some(ring) => {
                let io = match write {
                    true => Io::Write(iovecs),
                    false => Io::Read(iovecs),
                };
                // SAFETY: the buffers are imago's, valid until this call returns, and the
                // operation is awaited (or, dropped, waits for its completion) within it.
                let op = unsafe { ring.start(fd, io, offset) };
                op.await as isize
            }
            None => loop {
                let off = offset as libc::off_t;
                let (ptr, n) = (iovecs.as_ptr(), iovecs.len() as libc::c_int);
                // SAFETY: the iovecs describe buffers valid for the call (imago's).
                let r = unsafe {
                    match write {
                        true => libc::pwritev(fd, ptr, n, off),
                        false => libc::preadv(fd, ptr, n, off),
                    }
                };
                if r >= 0 {
                    break r;
                }
                let err = io::Error::last_os_error();
                if err.raw_os_error() != Some(libc::EINTR) {
                    return Err(err);
                }
            },
        };
        if res < 0 {
            return Err(io::Error::from_raw_os_error(-res as i32));
        }
        Ok(res as u64)
    }

    fn fallocate(&self, mode: i32, offset: u64, length: u64) -> io::Result<()> {
        let (off, len) = (offset as libc::off_t, length as libc::off_t);
        loop {
            // SAFETY: a descriptor this object owns and integer arguments.
            if unsafe { libc::fallocate(self.file.as_raw_fd(), mode, off, len) } == 0 {
                return Ok(());
            }
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EOPNOTSUPP) => return Err(io::ErrorKind::Unsupported.into()),
                _ => return Err(err),
            }
        }
    }
}

impl Storage for RingFile {
    fn mem_align(&self) -> usize {
        self.mem_align
    }

    fn req_align(&self) -> usize {
        self.req_align
    }

    fn zero_align(&self) -> usize {
        self.zero_align.max(self.req_align)
    }

    fn discard_align(&self) -> usize {
        self.discard_align.max(self.req_align)
    }

    fn size(&self) -> io::Result<u64> {
        Ok(self.size.load(Ordering::Acquire))
    }

    fn resolve_relative_path<P: AsRef<Path>>(&self, relative: P) -> io::Result<PathBuf> {
        let dir = self.filename.parent().unwrap_or(Path::new("."));
        Ok(dir.join(relative))
    }

    fn get_filename(&self) -> Option<PathBuf> {
        Some(self.filename.clone())
    }

    async unsafe fn pure_readv(
        &self,
        mut bufv: IoVectorMut<'_>,
        mut offset: u64,
    ) -> io::Result<()> {
        while !bufv.is_empty() {
            // SAFETY: the slices live as long as `bufv`, which outlives the transfer.
            let n = self
                .transfer(unsafe { bufv.as_iovec() }, offset, false)
                .await?;
            if n == 0 {
                // Past the end of the file: zeros, as imago expects.
                bufv.fill(0);
                break;
            }
            bufv = bufv.split_tail_at(n);
            offset += n;
        }
        Ok(())
    }

    async unsafe fn pure_writev(&self, mut bufv: IoVector<'_>, mut offset: u64) -> io::Result<()> {
        self.grow_for(offset + bufv.len())?;
        while !bufv.is_empty() {
            // SAFETY: as for the read.
            let n = self
                .transfer(unsafe { bufv.as_iovec() }, offset, true)
                .await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            bufv = bufv.split_tail_at(n);
            offset += n;
            self.grown_to(offset);
        }
        Ok(())
    }

    async unsafe fn pure_write_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        // Without KEEP_SIZE a range past the end grows the file (never shrinks it); where the
        // filesystem cannot, imago writes zeroes itself (`Unsupported`).
        self.fallocate(libc::FALLOC_FL_ZERO_RANGE, offset, length)?;
        self.grown_to(offset + length);
        Ok(())
    }

    async unsafe fn pure_write_allocated_zeroes(&self, offset: u64, length: u64) -> io::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.pure_write_zeroes(offset, length).await }
    }

    async unsafe fn pure_discard(&self, offset: u64, length: u64) -> io::Result<()> {
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        match self.fallocate(mode, offset, length) {
            // Discarding is advice: a filesystem that cannot punch keeps the data.
            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
            other => other,
        }
    }

    async fn flush(&self) -> io::Result<()> {
        // Nothing is buffered here.
        Ok(())
    }

    async fn sync(&self) -> io::Result<()> {
        match uring_io::current() {
            Some(ring) => {
                let fd = self.file.as_raw_fd();
                // SAFETY: a sync names no memory.
                let res = unsafe { ring.start(fd, Io::Sync { data_only: false }, 0) }.await;
                match res {
                    0.. => Ok(()),
                    e => Err(io::Error::from_raw_os_error(-e)),
                }
            }
            None => self.file.sync_all(),
        }
    }

    async unsafe fn invalidate_cache(&self) -> io::Result<()> {
        // Nothing is cached here (and O_DIRECT, when on, bypasses the page cache).
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        &self.helper
    }

    async fn resize(&self, new_size: u64, prealloc_mode: PreallocateMode) -> io::Result<()> {
        let current = self.size.load(Ordering::Acquire);
        if new_size > current && prealloc_mode == PreallocateMode::Allocate {
            self.fallocate(0, current, new_size - current)?;
        } else if new_size > current && prealloc_mode == PreallocateMode::WriteData {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "preallocation by writing data",
            ));
        }
        self.file.set_len(new_size)?;
        self.size.store(new_size, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;

    use super::*;

    #[test]
    fn writes_past_the_end_grow_the_file_ahead_and_zeroing_never_shrinks_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let f = RingFile::new(file, &path, true, false).unwrap();
        let len = || std::fs::metadata(&path).unwrap().len();
        let data = vec![7u8; 4096];
        // SAFETY: the buffer outlives the call (blocking here: no ring on this thread).
        block_on(unsafe { f.pure_writev(IoVector::from(&data), 8192) }).unwrap();
        assert_eq!((len(), f.size().unwrap()), (GROWTH, GROWTH));
        // Zeroes inside the file keep its length.
        // SAFETY: a pure write of zeroes, aligned.
        block_on(unsafe { f.pure_write_zeroes(0, 4096) }).unwrap();
        assert_eq!(len(), GROWTH);
        // A write just past the grown end grows it by another step.
        // SAFETY: as above.
        block_on(unsafe { f.pure_writev(IoVector::from(&data), GROWTH) }).unwrap();
        assert_eq!(len(), 2 * GROWTH);
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes[8192..12288].iter().all(|&b| b == 7));
        assert!(bytes[..8192].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_read_only_file_is_never_grown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![1u8; 4096]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let f = RingFile::new(file, &path, false, false).unwrap();
        let mut buf = vec![0u8; 8192];
        let v = imago::io_buffers::IoVectorMut::from(&mut buf[..]);
        // SAFETY: the buffer outlives the call.
        block_on(unsafe { f.pure_readv(v, 0) }).unwrap();
        // Past the end reads as zeros.
        assert!(buf[..4096].iter().all(|&b| b == 1) && buf[4096..].iter().all(|&b| b == 0));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4096);
    }
}
