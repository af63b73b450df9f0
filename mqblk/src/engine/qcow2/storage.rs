//! An image file as imago sees it (its `Storage`): reads, writes and syncs go on the calling
//! metadata worker's ring ([`uring_io`](super::uring_io)), so the copy-on-writes and table
//! write-backs of the jobs a worker runs are in flight together; on a thread without a ring (a
//! control thread opening, resizing or snapshotting the image) they are blocking system calls.
//! Zeroing, discard and resize are rare and always blocking. A write goes plain, plain after a
//! sync, or written through, as [`write_order`](super::write_order) says: imago's ordering of
//! its metadata, and guest data before the L2 entries that point at it, hold on stable storage.
//!
//! The alignments O_DIRECT needs are probed once, by imago's own `File` over the same
//! descriptor, at open.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Instant;

use imago::io_buffers::{IoVector, IoVectorMut};
use imago::storage::drivers::CommonStorageHelper;
use imago::storage::PreallocateMode;
use imago::{Storage, StorageOpenOptions};

use super::counters::Counters;
use super::data_writes;
use super::fresh_space::FreshSpace;
use super::table_io::TableIo;
use super::uring_io::{self, Io};
use super::write_order::{WriteMode, WriteOrder};
use crate::format::qcow2::header::{DIRTY, DIRTY_BYTE, JOURNAL_OWNS_MARK_BYTE};

/// [`RingFile::hide_marks`]: the dirty bit.
const HIDE_DIRTY: u8 = 1;
/// [`RingFile::hide_marks`]: the journal's autoclear bit.
const HIDE_JOURNAL_OWNER: u8 = 2;

/// The most the top image file is grown ahead of its writes at a time (see
/// `RingFile::grow_for`).
const GROWTH: u64 = 16 << 20;

/// The least: a small file grows by its own size (to the next power of two), at least this,
/// so that an image that stays small does not take [`GROWTH`] of its filesystem (on a tmpfs,
/// zeroed memory) for writes it never makes.
const MIN_GROWTH: u64 = 1 << 20;

/// What [`RingFile::grow_for`] took ahead of writes, against what was written past the
/// file's end: it may take ahead at most twice what was written there, and [`GROWTH`] more.
/// Twice, not once: a write that lands behind a later one (the metadata worker's tasks
/// allocate in order but may grow the file out of it) is not counted, and with a bound of
/// once, those few uncounted bytes would add up over an image's life until they cut every
/// step. Atomics, as the tasks grow the file concurrently; a race lets a step through that the
/// bound would have cut, by at most one step per task.
#[derive(Debug)]
struct GrowthBudget {
    /// The end of the furthest write (at first, the file's length at open).
    written_end: AtomicU64,
    /// Bytes written past `written_end` as it then was (the gap before such a write, which
    /// stays a hole, not counted).
    appended: AtomicU64,
    /// Bytes taken past the ends of the writes that took them.
    taken_ahead: AtomicU64,
    /// Whether the bound has cut a step short yet (said once).
    cut: AtomicBool,
}

impl GrowthBudget {
    fn new(len: u64) -> GrowthBudget {
        GrowthBudget {
            written_end: AtomicU64::new(len),
            appended: AtomicU64::new(0),
            taken_ahead: AtomicU64::new(0),
            cut: AtomicBool::new(false),
        }
    }

    /// Counts a write of `offset..end`.
    fn wrote(&self, offset: u64, end: u64) {
        let before = self.written_end.fetch_max(end, Ordering::AcqRel);
        if end > before {
            self.appended
                .fetch_add(end - offset.max(before), Ordering::AcqRel);
        }
    }

    /// How much may still be taken ahead, where `wanted` would be: said once per file when
    /// that is less (an image that writes far apart past its end).
    fn room(&self, wanted: u64, path: &Path) -> u64 {
        let allowed = 2 * self.appended.load(Ordering::Acquire) + GROWTH;
        let room = allowed.saturating_sub(self.taken_ahead.load(Ordering::Acquire));
        if room < wanted && !self.cut.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                image = %path.display(),
                written_past_end = self.appended.load(Ordering::Acquire),
                taken_ahead = self.taken_ahead.load(Ordering::Acquire),
                "the image writes far apart past the end of its file (its tables point there): the file is grown ahead of those writes only by what was written there"
            );
        }
        room.min(wanted)
    }

    fn took_ahead(&self, n: u64) {
        self.taken_ahead.fetch_add(n, Ordering::AcqRel);
    }
}

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
    /// Writes past the end grow the file first, by up to [`GROWTH`] at a time (see
    /// `grow_for`).
    prealloc: bool,
    /// What was taken ahead of writes, against what was written past the file's end.
    growth: GrowthBudget,
    /// What past the file's length at open still reads as zeros.
    fresh: FreshSpace,
    /// Which writes may stay plain (the top image's; without it every write but guest data is
    /// written through).
    order: Option<Arc<WriteOrder>>,
    /// The same file, for the tables [`WriteOrder`] mirrors.
    tables: TableIo,
    /// Held through a sync that [`WriteOrder`] asked for.
    syncing: futures::lock::Mutex<()>,
    /// Where the top image's syncs are counted (the export's metadata counters).
    counters: Option<Arc<Counters>>,
    /// Which of mqblk's marks reads of the header hide ([`hide_marks`](Self::hide_marks)):
    /// [`HIDE_DIRTY`], [`HIDE_JOURNAL_OWNER`].
    hidden: AtomicU8,
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
        let align = probe.mem_align().max(probe.req_align());
        let tables = TableIo::new(file.try_clone()?, path, align);
        Ok(RingFile {
            mem_align: probe.mem_align(),
            req_align: probe.req_align(),
            zero_align: probe.zero_align(),
            discard_align: probe.discard_align(),
            file,
            filename: path.to_path_buf(),
            size: AtomicU64::new(size),
            prealloc: writable,
            growth: GrowthBudget::new(size),
            fresh: FreshSpace::new(size),
            order: None,
            tables,
            syncing: futures::lock::Mutex::new(()),
            counters: None,
            hidden: AtomicU8::new(0),
            helper: CommonStorageHelper::default(),
        })
    }

    /// The same, with its write ordering read from the image (the top image of a chain), its
    /// syncs counted in `counters`.
    pub fn ordered(mut self, counters: Arc<Counters>) -> io::Result<RingFile> {
        self.order = Some(Arc::new(self.tables.write_order()?));
        self.counters = Some(counters);
        Ok(self)
    }

    /// Counts a sync that began at `began` and succeeded.
    fn synced(&self, began: Instant) {
        if let Some(c) = &self.counters {
            c.synced(began);
        }
    }

    /// While imago reads the header (opening the image, or reading it again in a refresh):
    /// reads show it without mqblk's own marks, which imago would refuse or clear. The
    /// journal's autoclear bit always (imago clears autoclear bits it does not know by writing
    /// the whole header, and a refresh refuses a header whose autoclear bits changed); the
    /// dirty bit when `dirty` (a live server's mark, [`dirty_mark`](super::dirty_mark)).
    pub fn hide_marks(&self, dirty: bool) {
        let dirty = if dirty { HIDE_DIRTY } else { 0 };
        self.hidden
            .store(HIDE_JOURNAL_OWNER | dirty, Ordering::Release);
    }

    /// Reads show the header as it is again: from then on imago and mqblk write its first
    /// block only by reading it, changing their fields and writing it back, which keeps the
    /// marks.
    pub fn show_marks(&self) {
        self.hidden.store(0, Ordering::Release);
    }

    /// Its write ordering, if it has one.
    pub fn write_order(&self) -> Option<Arc<WriteOrder>> {
        self.order.clone()
    }

    /// Its tables, for reading and mending outside imago.
    pub fn tables(&self) -> TableIo {
        self.tables.clone()
    }

    /// Makes the plain writes completed so far durable: an `fdatasync`, on the ring if this
    /// thread has one, unless one that began after them has ended meanwhile (a group commit's
    /// L2 tables are written together, and the first one's sync covers the others).
    async fn sync_data(&self, order: &WriteOrder) -> io::Result<()> {
        let needed = order.sync_begins();
        let _one_at_a_time = self.syncing.lock().await;
        if order.synced_mark() >= needed {
            return Ok(());
        }
        let mark = order.sync_begins();
        let began = Instant::now();
        uring_io::sync_data(&self.file).await?;
        self.synced(began);
        order.synced(mark);
        Ok(())
    }

    /// Makes the file reach `end` before a write of `offset..end`: new clusters go at the end
    /// of the file, and a direct write that extends a file is one the filesystem serialises
    /// (ext4 takes the inode's lock exclusively and completes it synchronously, so io_uring
    /// hands it to a worker thread). Grown by fallocate ahead of the writes, the file takes
    /// them as writes into its own (unwritten) blocks, side by side: to the next multiple of
    /// the file's size (a power of two, from [`MIN_GROWTH`] to [`GROWTH`]) past `end`. Where
    /// the filesystem has no room for the step, only up to `end`; where it has none for that,
    /// the error (`ENOSPC`) is the write's, before anything is written.
    ///
    /// The room is taken from the write on, not from the file's end: a gap between them stays
    /// a hole, as a write alone would leave it. Such a gap is no allocation of mqblk's (new
    /// clusters follow the last one used), but an image's refcounts may place its first free
    /// cluster anywhere, terabytes past its end, and what is taken here is taken from every
    /// other file on the filesystem.
    ///
    /// For the same reason the room taken ahead is bounded by what is written: in all, at
    /// most twice the bytes written past the file's end, and [`GROWTH`] more
    /// ([`GrowthBudget`]). Appending writes fill each step before the next is taken, so they
    /// do not meet the bound (no sample of the bench did: docs/PERFORMANCE.md 13h); an image
    /// whose refcount table points its refcount blocks at offsets far apart past its end (each
    /// write there a step of its own, never filled) would otherwise take [`GROWTH`] of the
    /// filesystem for every few hundred bytes it has written.
    pub fn grow_for(&self, offset: u64, end: u64) -> io::Result<()> {
        self.growth.wrote(offset, end);
        let size = self.size.load(Ordering::Acquire);
        if !self.prealloc || end <= size {
            return Ok(());
        }
        let ahead = size.next_power_of_two().clamp(MIN_GROWTH, GROWTH);
        let wanted = end.next_multiple_of(ahead) - end;
        let step = end + self.growth.room(wanted, &self.filename);
        let from = offset.clamp(size, end);
        let grown = match self.fallocate(0, from, step - from) {
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && step > end => {
                self.fallocate(0, from, end - from).map(|()| end)
            }
            other => other.map(|()| step),
        };
        match grown {
            Ok(to) => {
                self.growth.took_ahead(to - end);
                self.grown_to(to);
                Ok(())
            }
            // The write itself grows it then.
            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Whether `offset..offset + len` lies within the file and reads as zeros, untouched since
    /// the file grew over it ([`FreshSpace`]): a new cluster there needs only its nonzero
    /// part written.
    pub fn is_fresh(&self, offset: u64, len: u64) -> bool {
        offset + len <= self.size.load(Ordering::Acquire) && self.fresh.is_fresh(offset, len)
    }

    fn grown_to(&self, end: u64) {
        self.size.fetch_max(end, Ordering::AcqRel);
    }

    /// One `preadv` (read) or `pwritev`, on the ring if this thread has one. A write goes plain
    /// or written through as [`WriteOrder`] says (without one: plain only for guest data).
    async fn transfer(&self, iovecs: &[libc::iovec], offset: u64, write: bool) -> io::Result<u64> {
        let fd = self.file.as_raw_fd();
        let data = write && data_writes::is_data(iovecs);
        let len = iovecs.iter().map(|v| v.iov_len as u64).sum::<u64>();
        if let (true, false, Some(order)) = (write, data, &self.order) {
            if order.early.broken() {
                // A mapping may point at a cluster without its data (`early_maps`).
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            if order.may_hold_mappings(offset, len) {
                // The table's entries may map clusters whose data is still being written:
                // it goes after that data (and the sync below, after the wait, covers it).
                order.early.settled().await;
            }
        }
        let mode = match (&self.order, data) {
            _ if !write => WriteMode::Plain { sync_first: false },
            (Some(order), _) => order.mode(offset, len, data),
            (None, true) => WriteMode::Plain { sync_first: false },
            (None, false) => WriteMode::Through { sync_first: false },
        };
        let sync_first = match mode {
            WriteMode::Plain { sync_first } | WriteMode::Through { sync_first } => sync_first,
        };
        if let (true, Some(order)) = (sync_first, &self.order) {
            self.sync_data(order).await?;
        }
        let through = matches!(mode, WriteMode::Through { .. });
        let res = match uring_io::current() {
            Some(ring) => {
                let io = match (write, through) {
                    (false, _) => Io::Read(iovecs),
                    (true, false) => Io::Write(iovecs),
                    (true, true) => Io::WriteThrough(iovecs),
                };
                // SAFETY: the buffers are imago's, valid until this call returns, and the
                // operation is awaited (or, dropped, waits for its completion) within it.
                let op = unsafe { ring.start(fd, io, offset) };
                op.await as isize
            }
            None => loop {
                let off = offset as libc::off_t;
                let (ptr, n) = (iovecs.as_ptr(), iovecs.len() as libc::c_int);
                let flags = if through { libc::RWF_DSYNC } else { 0 };
                // SAFETY: the iovecs describe buffers valid for the call (imago's).
                let r = unsafe {
                    match write {
                        true => libc::pwritev2(fd, ptr, n, off, flags),
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
        // Only a read of the header's first bytes looks at the flags (data reads never do).
        if !write && offset <= JOURNAL_OWNS_MARK_BYTE.0 {
            let hidden = self.hidden.load(Ordering::Acquire);
            if hidden & HIDE_DIRTY != 0 {
                hide_bit(iovecs, offset, res as u64, (DIRTY_BYTE, 1 << DIRTY));
            }
            if hidden & HIDE_JOURNAL_OWNER != 0 {
                hide_bit(iovecs, offset, res as u64, JOURNAL_OWNS_MARK_BYTE);
            }
        }
        if let (true, Some(order)) = (write, &self.order) {
            self.wrote(order, mode, iovecs, offset, res as u64);
        }
        Ok(res as u64)
    }

    /// Tells `order` of a completed write of `done` bytes of `iovecs` at `offset`.
    fn wrote(
        &self,
        order: &WriteOrder,
        mode: WriteMode,
        iovecs: &[libc::iovec],
        offset: u64,
        done: u64,
    ) {
        match mode {
            WriteMode::Plain { .. } => order.wrote_plain(),
            WriteMode::Through { .. } => {
                let mut left = done as usize;
                let bytes: Vec<&[u8]> = iovecs
                    .iter()
                    .map(|v| {
                        let n = v.iov_len.min(left);
                        left -= n;
                        // SAFETY: the iovec's buffer is valid for this call (imago's), and
                        // `n` of its bytes were just written from it.
                        unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), n) }
                    })
                    .collect();
                if order.wrote_through(offset, &bytes) {
                    // The header changed (the L1 or refcount table may have moved); without
                    // them, every table is written through from now on.
                    if let Err(e) = self.tables.reload(order) {
                        tracing::warn!(err = %e, "cannot read the qcow2 L1 and refcount tables again");
                        order.reload_failed();
                    }
                }
            }
        }
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

/// Clears the bits `mask` of the file's byte `byte` in `done` bytes read into `iovecs` from
/// `offset`, if they hold it.
fn hide_bit(iovecs: &[libc::iovec], offset: u64, done: u64, (byte, mask): (u64, u8)) {
    if !(offset..offset + done).contains(&byte) {
        return;
    }
    let mut at = byte - offset;
    for v in iovecs {
        let len = v.iov_len as u64;
        if at < len {
            // SAFETY: the iovec's buffer is valid for this call (imago's), and byte `at` of it
            // was just read into.
            unsafe { *v.iov_base.cast::<u8>().add(at as usize) &= !mask };
            return;
        }
        at -= len;
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
        self.fresh.touch(offset, bufv.len());
        self.grow_for(offset, offset + bufv.len())?;
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
        self.fresh.touch(offset, length);
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
        self.fresh.touch(offset, length);
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
        let mark = self.order.as_ref().map(|o| o.sync_begins());
        let began = Instant::now();
        let synced = match uring_io::current() {
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
        };
        if synced.is_ok() {
            self.synced(began);
        }
        if let (Ok(()), Some(order), Some(mark)) = (&synced, &self.order, mark) {
            order.synced(mark);
        }
        synced
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
        // imago may map preallocated clusters there, which the I/O threads then write.
        self.fresh.touch(current, new_size.saturating_sub(current));
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

    /// A new empty image file in `dir`, open writable.
    fn new_writable(dir: &tempfile::TempDir) -> (PathBuf, RingFile) {
        let path = dir.path().join("img");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let f = RingFile::new(file, &path, true, false).unwrap();
        (path, f)
    }

    #[test]
    fn writes_past_the_end_grow_the_file_ahead_and_zeroing_never_shrinks_it() {
        let dir = tempfile::tempdir().unwrap();
        let (path, f) = new_writable(&dir);
        let len = || std::fs::metadata(&path).unwrap().len();
        let data = vec![7u8; 4096];
        // SAFETY: the buffer outlives the call (blocking here: no ring on this thread).
        block_on(unsafe { f.pure_writev(IoVector::from(&data), 8192) }).unwrap();
        assert_eq!((len(), f.size().unwrap()), (MIN_GROWTH, MIN_GROWTH));
        // Zeroes inside the file keep its length.
        // SAFETY: a pure write of zeroes, aligned.
        block_on(unsafe { f.pure_write_zeroes(0, 4096) }).unwrap();
        assert_eq!(len(), MIN_GROWTH);
        // Once the room taken is written, a write just past the grown end grows it by the
        // file's size, up to GROWTH at a time.
        let mut expected = MIN_GROWTH;
        let mut written_to = 12288;
        while expected < 2 * GROWTH {
            let fill = vec![7u8; (len() - written_to) as usize];
            // SAFETY: as above.
            block_on(unsafe { f.pure_writev(IoVector::from(&fill), written_to) }).unwrap();
            assert_eq!(len(), expected, "a write inside the room grew the file");
            // SAFETY: as above.
            block_on(unsafe { f.pure_writev(IoVector::from(&data), len()) }).unwrap();
            written_to = expected + 4096;
            expected += expected.min(GROWTH);
            assert_eq!(len(), expected);
        }
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes[8192..written_to as usize].iter().all(|&b| b == 7));
        assert!(bytes[..8192].iter().all(|&b| b == 0));
    }

    /// Writes far apart past the end (an image whose refcount table points its blocks there)
    /// take, in all, at most three times what they write, and GROWTH more: without the bound
    /// each took a step of its own (GROWTH once the file is large), never filled.
    #[test]
    fn writes_far_apart_past_the_end_take_little_more_than_they_write() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let (path, f) = new_writable(&dir);
        let data = vec![7u8; 4096];
        let (writes, apart) = (64u64, 4 * GROWTH);
        for k in 0..writes {
            // SAFETY: the buffer outlives the call (blocking here: no ring on this thread).
            block_on(unsafe { f.pure_writev(IoVector::from(&data), (k + 1) * apart) }).unwrap();
        }
        let taken = std::fs::metadata(&path).unwrap().blocks() * 512;
        let written = writes * 4096;
        assert!(
            taken <= 3 * written + GROWTH + MIN_GROWTH,
            "{writes} writes of 4 KiB took {taken} bytes"
        );
        assert!(taken >= written);
    }

    /// Dirty pages of `file` in its first `len` bytes, by cachestat(2) (Linux 6.5); `None`
    /// where the kernel has no such call.
    fn dirty_pages(file: &File, len: u64) -> Option<u64> {
        const SYS_CACHESTAT: libc::c_long = 451;
        let range = [0u64, len];
        let mut stat = [0u64; 5]; // cache, dirty, writeback, evicted, recently evicted
                                  // SAFETY: an open descriptor, and buffers of the sizes the call reads and writes.
        let r = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                file.as_raw_fd(),
                range.as_ptr(),
                stat.as_mut_ptr(),
                0,
            )
        };
        (r == 0).then_some(stat[1])
    }

    #[test]
    fn metadata_writes_are_durable_when_they_complete_and_guest_data_writes_are_not() {
        // A buffered file in the crate's directory (a disk filesystem: tmpfs never cleans its
        // pages): a written-through write leaves no dirty page behind, a plain one does. No
        // write order is given: every write but guest data is written through.
        let file = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let f = RingFile::new(file.try_clone().unwrap(), Path::new("img"), true, false).unwrap();
        if dirty_pages(&file, 1).is_none() {
            // A test that returned in silence would pass without having checked anything.
            let allow = "MQBLK_TEST_ALLOW_NO_CACHESTAT";
            let why = "this kernel has no cachestat(2) to see dirty pages with";
            assert!(
                std::env::var_os(allow).is_some(),
                "{why}; set {allow}=1 to skip this"
            );
            eprintln!("SKIPPED ({allow}): {why}");
            return;
        }
        let (data, table) = (vec![1u8; 65536], vec![2u8; 65536]);
        let write = |buf: &[u8], at: u64| {
            // SAFETY: the buffer outlives the call, which completes within it.
            let w = unsafe { f.pure_writev(IoVector::from(buf), at) };
            match uring_io::current() {
                Some(r) => uring_io::tests::drive(&r, w),
                None => block_on(w),
            }
            .unwrap();
        };
        for on_ring in [false, true] {
            if on_ring {
                uring_io::install(uring_io::tests::reactor());
            }
            file.sync_all().unwrap();
            {
                let _data = data_writes::register(&[&data]);
                write(&data, 0);
            }
            let dirty = dirty_pages(&file, 65536).unwrap();
            assert!(
                dirty > 0,
                "guest data is not written through (ring: {on_ring})"
            );
            file.sync_all().unwrap();
            write(&table, 65536);
            let dirty = dirty_pages(&file, 131072).unwrap();
            assert_eq!(dirty, 0, "metadata is written through (ring: {on_ring})");
        }
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
