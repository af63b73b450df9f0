//! `metadata-commit=journal` (and `auto`, the default, wherever a journal can be kept): the
//! mappings of new clusters recorded outside the process before their writes complete, and the
//! tables written back at the guest's flush.
//!
//! `metadata-commit=write` writes imago's tables back before a write into a new cluster
//! completes, so that a crash of mqblk, which a guest outlives through a reconnect, loses no
//! acknowledged write. What that needs is the mapping out of the process, not the tables on the
//! disk: this journal is a file in the daemon's state directory
//! ([`journal_path`](crate::format::qcow2::journal_path)), mapped shared, and a record is two
//! stores into the mapping. A dead process's stores stay in the page cache. Nothing here is
//! ever synced: after a power loss the guest went down too and loses what it did not flush, and
//! the image holds the tables of its last write-back, in qcow2's order ([`write_order`]).
//!
//! The image is served as with `metadata-commit=flush` (marked dirty while its file lacks
//! mappings of completed writes, written back at the guest's flush), and every completed job
//! that changed mappings has a record of what its clusters map to afterwards: `(guest cluster,
//! host cluster)` for data, or a zero cluster. When an export opens an image that a crashed
//! daemon left marked, the records of this boot are replayed ([`journal_replay`]).
//!
//! A record is true as long as no later record names its guest cluster: a later change of the
//! cluster's mapping makes a later record, and a write in place changes only the data of the
//! host cluster the record names, which a replay reads as it is then. So a replay takes the
//! last record of each guest cluster.
//!
//! The records are a ring of [`capacity`](MappingJournal::capacity) entries between `head` and
//! `tail`. A write-back that began at `tail` = *n* covers the first *n* records (their mappings
//! were in imago's tables when it began), which it drops by moving `head` to *n*. A journal
//! past half full asks the worker for such a write-back; a full one makes a job write the
//! tables back itself, as `metadata-commit=write` does.
//!
//! [`write_order`]: super::write_order
//! [`journal_replay`]: super::journal_replay

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// What the staging area of a replay may hold: the data of this many bytes of clusters, so a
/// journal holds `JOURNAL_DATA_BOUND >> cluster_bits` records (1,024 at 64 KiB clusters).
pub const JOURNAL_DATA_BOUND: u64 = 64 << 20;

/// The fewest records a journal holds (at 2 MiB clusters the bound gives 32).
const MIN_RECORDS: u64 = 32;

/// The header's size: one page, so that the records begin page-aligned.
const HEADER: u64 = 4096;

const MAGIC: &[u8; 8] = b"MQBLKJNL";
const VERSION: u32 = 1;

// The header's fields (byte offsets).
const AT_VERSION: usize = 8;
const AT_CLUSTER_BITS: usize = 12;
const AT_DEV: usize = 16;
const AT_INO: usize = 24;
const AT_BORN: usize = 32;
const AT_BOOT_ID: usize = 48;
const BOOT_ID_LEN: usize = 36;
const AT_CAPACITY: usize = 88;
const AT_STATE: usize = 96;
const AT_HEAD: usize = 104;
const AT_TAIL: usize = 112;

/// Nothing recorded is pending: the image's mark, if any, is not this journal's.
const IDLE: u64 = 0;
/// Records cover the image's mark.
const OPEN: u64 = 1;
/// A replay copied the data the records name into the staging area (it reads from there if
/// it is cut short and runs again).
const STAGED: u64 = 2;

/// A record's host word for a zero cluster (a data cluster's is its offset, a multiple of 512,
/// with the lowest bit set).
const ZERO_CLUSTER: u64 = 2;

/// What one guest cluster maps to after a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapped {
    /// Data, in the image file's cluster at this offset.
    Data(u64),
    /// Zeros.
    Zero,
}

/// The journal of one image file.
pub struct MappingJournal {
    /// The header and the records, mapped.
    ptr: *mut u8,
    len: usize,
    /// The file, for the staging area past the mapping.
    file: File,
    /// Where the file is, for messages.
    path: PathBuf,
    capacity: u64,
    cluster_bits: u32,
    /// The image file's identity, as the header records it.
    identity: Identity,
    /// The header is this process's, and records go after its `tail` (set by
    /// [`begin`](Self::begin), cleared by [`close_if_done`](Self::close_if_done)).
    ours: bool,
    /// Counts the times it was begun: a [`Position`] of an earlier one is stale.
    generation: u64,
}

/// Where a journal's records ended when a write-back began: the records it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    generation: u64,
    tail: u64,
}

// SAFETY: the mapping is owned by the journal and only reached through `&self`/`&mut self`;
// the raw pointer is what keeps the type from being `Send` on its own.
unsafe impl Send for MappingJournal {}

/// The image file a journal belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    /// Its birth time, where the filesystem keeps one (else 0): a file made anew with the
    /// inode of a deleted one differs.
    born: (i64, u32),
}

impl Identity {
    fn of(file: &File) -> io::Result<Identity> {
        let m = file.metadata()?;
        let born = rustix::fs::statx(
            file,
            "",
            rustix::fs::AtFlags::EMPTY_PATH,
            rustix::fs::StatxFlags::BTIME,
        )
        .ok()
        .filter(|s| s.stx_mask & rustix::fs::StatxFlags::BTIME.bits() != 0)
        .map_or((0, 0), |s| (s.stx_btime.tv_sec, s.stx_btime.tv_nsec));
        Ok(Identity {
            dev: m.dev(),
            ino: m.ino(),
            born,
        })
    }
}

/// What an opened journal says about an image a crash left marked.
#[derive(Debug)]
pub enum Pending {
    /// Records of this boot: the last one of each guest cluster (in guest cluster order), and
    /// whether their data is already staged.
    ThisBoot {
        /// Guest cluster index, and what it maps to.
        records: Vec<(u64, Mapped)>,
        /// The data clusters' bytes are in the staging area, record `i`'s in slot `i`.
        staged: bool,
    },
    /// Records of another boot: the machine went down with the guest.
    OtherBoot,
    /// This image's journal, of this boot, holding no records: the mark was made and the
    /// process died before a job that needed a record completed.
    Nothing,
    /// Nothing that speaks for the mark (another image's journal, or one never written).
    None,
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`), read once: [`prepare`] reads it before
/// the sandbox closes `/proc`.
pub fn boot_id() -> Option<&'static [u8; BOOT_ID_LEN]> {
    static ID: OnceLock<Option<[u8; BOOT_ID_LEN]>> = OnceLock::new();
    ID.get_or_init(|| {
        let s = std::fs::read("/proc/sys/kernel/random/boot_id").ok()?;
        s.get(..BOOT_ID_LEN)?.try_into().ok()
    })
    .as_ref()
}

/// Reads what a journal needs from outside the sandbox (the boot id).
pub fn prepare() {
    let _ = boot_id();
}

/// The records a journal holds for clusters of `1 << cluster_bits` bytes.
pub fn capacity_for(cluster_bits: u32) -> u64 {
    (JOURNAL_DATA_BOUND >> cluster_bits).max(MIN_RECORDS)
}

impl MappingJournal {
    /// Opens the journal of the image file `image_file` (in the state directory:
    /// [`journal_path`](crate::format::qcow2::journal_path)), creating it if `create` (and its
    /// directory, unless the daemon is confined); leaves what it holds as it is.
    pub fn open(image_file: &File, cluster_bits: u32, create: bool) -> io::Result<MappingJournal> {
        if boot_id().is_none() {
            // Without it a crash would read as a reboot, and its records would not be replayed.
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "cannot read this boot's id (/proc/sys/kernel/random/boot_id), which the \
                 journal needs to tell a crash of mqblk from a reboot: serve the image with \
                 metadata-commit=write or flush",
            ));
        }
        let path = crate::format::qcow2::journal_path_of(&image_file.metadata()?);
        // A confined daemon made its directory before the sandbox closed (`sandbox::enter`).
        if create && !crate::sandbox::confined() {
            crate::config::state_dir::make_qcow2_journals(
                rustix::process::geteuid().as_raw(),
                rustix::process::getegid().as_raw(),
            )?;
        }
        let capacity = capacity_for(cluster_bits);
        let mapped = HEADER + (capacity * 16).next_multiple_of(4096);
        let file_len = mapped + (capacity << cluster_bits);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        if file.metadata()?.len() != file_len {
            // Made anew, or left by a build of another layout: emptied of a header this one
            // would read, and the mapped part written, so that a store into the mapping never
            // needs a block the filesystem may not have (a full one would send SIGBUS). The
            // staging area stays a hole until a replay writes it.
            file.set_len(0)?;
            file.set_len(file_len)?;
            rustix::io::pwrite(&file, &vec![0; mapped as usize], 0)?;
        }
        let len = usize::try_from(mapped).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
        // SAFETY: a fresh shared mapping of the file's first `len` bytes (within its length,
        // just checked or set); checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let identity = Identity::of(image_file)?;
        Ok(MappingJournal {
            ptr: ptr.cast(),
            len,
            file,
            path,
            capacity,
            cluster_bits,
            identity,
            ours: false,
            generation: 0,
        })
    }

    /// Where the journal is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How many records it holds at most.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        assert!(at.is_multiple_of(8) && at + 8 <= self.len);
        // SAFETY: in the mapping (checked), 8-byte aligned (the mapping is page-aligned), and
        // the mapping lives as long as `self`; atomics make the shared access sound.
        unsafe { &*self.ptr.add(at).cast::<AtomicU64>() }
    }

    fn bytes(&self, at: usize, len: usize) -> &[u8] {
        assert!(at + len <= self.len);
        // SAFETY: in the mapping (checked), which lives as long as `self`. Only this process
        // writes these bytes while it serves the image.
        unsafe { std::slice::from_raw_parts(self.ptr.add(at), len) }
    }

    fn bytes_mut(&mut self, at: usize, len: usize) -> &mut [u8] {
        assert!(at + len <= self.len);
        // SAFETY: as in `bytes`; `&mut self` makes it the only reference of this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }

    fn u64_at(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.bytes(at, 8).try_into().expect("8 bytes"))
    }

    fn head(&self) -> u64 {
        self.word(AT_HEAD).load(Ordering::Acquire)
    }

    fn tail(&self) -> u64 {
        self.word(AT_TAIL).load(Ordering::Acquire)
    }

    /// The records appended so far: a write-back that begins now covers these.
    pub fn position(&self) -> Position {
        Position {
            generation: self.generation,
            tail: self.tail(),
        }
    }

    /// Records not yet covered by a write-back.
    pub fn pending(&self) -> u64 {
        self.tail().saturating_sub(self.head())
    }

    /// Whether a write-back should run to make room.
    pub fn wants_write_back(&self) -> bool {
        self.ours && self.pending() >= self.capacity / 2
    }

    /// Takes the journal for this process's records, emptied: the image's mark is this
    /// process's from now on (nothing of an earlier mark is pending: the image was opened
    /// unmarked, or replayed, or marked by a live server that has since cleared its mark).
    fn begin(&mut self) {
        if self.ours {
            return;
        }
        self.stamp(OPEN);
        self.ours = true;
        self.generation += 1;
    }

    /// Empties a journal this process is not writing of what another left in it, once the
    /// image is this process's (its locks taken, any earlier mark replayed or cleared): a mark
    /// this process makes before its first record finds it idle, not holding records of
    /// another process's mark.
    pub fn forget_others(&mut self) {
        if !self.ours {
            self.stamp(IDLE);
        }
    }

    /// Writes the header for this image and boot, in `state`, with no records.
    fn stamp(&mut self, state: u64) {
        self.word(AT_STATE).store(IDLE, Ordering::Release);
        self.word(AT_HEAD).store(0, Ordering::Release);
        self.word(AT_TAIL).store(0, Ordering::Release);
        let id = self.identity;
        let cluster_bits = self.cluster_bits;
        let capacity = self.capacity;
        let h = self.bytes_mut(0, AT_STATE);
        h[..8].copy_from_slice(MAGIC);
        h[AT_VERSION..AT_VERSION + 4].copy_from_slice(&VERSION.to_le_bytes());
        h[AT_CLUSTER_BITS..AT_CLUSTER_BITS + 4].copy_from_slice(&cluster_bits.to_le_bytes());
        h[AT_DEV..AT_DEV + 8].copy_from_slice(&id.dev.to_le_bytes());
        h[AT_INO..AT_INO + 8].copy_from_slice(&id.ino.to_le_bytes());
        h[AT_BORN..AT_BORN + 8].copy_from_slice(&id.born.0.to_le_bytes());
        h[AT_BORN + 8..AT_BORN + 12].copy_from_slice(&id.born.1.to_le_bytes());
        let boot = boot_id()
            .copied()
            .expect("checked when the journal was opened");
        h[AT_BOOT_ID..AT_BOOT_ID + BOOT_ID_LEN].copy_from_slice(&boot);
        h[AT_CAPACITY..AT_CAPACITY + 8].copy_from_slice(&capacity.to_le_bytes());
        self.word(AT_STATE).store(state, Ordering::Release);
    }

    /// Appends the records of `records` (guest cluster index, what it maps to now), all or
    /// none: false when they do not fit (the caller writes the tables back instead).
    pub fn append(&mut self, records: &[(u64, Mapped)]) -> bool {
        self.begin();
        let tail = self.tail();
        if self.pending() + records.len() as u64 > self.capacity {
            return false;
        }
        for (i, &(guest, mapped)) in records.iter().enumerate() {
            let slot = HEADER as usize + ((tail + i as u64) % self.capacity) as usize * 16;
            let host = match mapped {
                Mapped::Data(offset) => offset | 1,
                Mapped::Zero => ZERO_CLUSTER,
            };
            self.word(slot).store(guest, Ordering::Relaxed);
            self.word(slot + 8).store(host, Ordering::Relaxed);
        }
        // Published after the records: a process that dies between the two leaves them
        // unnamed, and their jobs never completed.
        self.word(AT_TAIL)
            .store(tail + records.len() as u64, Ordering::Release);
        true
    }

    /// Whether `at` is a position of the journal as this process holds it now.
    fn current(&self, at: Position) -> bool {
        self.ours && at.generation == self.generation
    }

    /// Drops the records before `upto` (a [`position`](Self::position) read before a
    /// write-back that has since completed; nothing if the journal was begun anew since).
    pub fn checkpoint(&mut self, upto: Position) {
        if self.current(upto) && upto.tail > self.head() {
            self.word(AT_HEAD).store(upto.tail, Ordering::Release);
        }
    }

    /// Gives the journal up once the image is unmarked with nothing recorded after `upto` (a
    /// position read before the write-back that let the mark be cleared): the next record
    /// begins it anew.
    pub fn close_if_done(&mut self, upto: Position) {
        if self.current(upto) && self.tail() == upto.tail {
            self.word(AT_HEAD).store(upto.tail, Ordering::Release);
            self.word(AT_STATE).store(IDLE, Ordering::Release);
            self.ours = false;
        }
    }

    /// Empties it after a replay, or when its records are of another boot.
    pub fn discard(&mut self) {
        self.word(AT_STATE).store(IDLE, Ordering::Release);
        self.ours = false;
    }

    /// Marks the staging area as holding the pending records' data.
    pub fn set_staged(&mut self) {
        self.word(AT_STATE).store(STAGED, Ordering::Release);
    }

    /// What it holds for an image a crash left marked.
    pub fn pending_records(&self) -> Pending {
        let state = self.word(AT_STATE).load(Ordering::Acquire);
        let h = self.bytes(0, AT_STATE);
        let id = &self.identity;
        let same_image = &h[..8] == MAGIC
            && u32::from_le_bytes(h[AT_VERSION..AT_VERSION + 4].try_into().expect("4")) == VERSION
            && u32::from_le_bytes(
                h[AT_CLUSTER_BITS..AT_CLUSTER_BITS + 4]
                    .try_into()
                    .expect("4"),
            ) == self.cluster_bits
            && self.u64_at(AT_DEV) == id.dev
            && self.u64_at(AT_INO) == id.ino
            && self.u64_at(AT_BORN) as i64 == id.born.0
            && self.u64_at(AT_BORN + 8) as u32 == id.born.1
            && self.u64_at(AT_CAPACITY) == self.capacity;
        if !same_image || !(state == IDLE || state == OPEN || state == STAGED) {
            return Pending::None;
        }
        let this_boot =
            boot_id().is_some_and(|b| &h[AT_BOOT_ID..AT_BOOT_ID + BOOT_ID_LEN] == b.as_slice());
        if !this_boot {
            return Pending::OtherBoot;
        }
        if state == IDLE {
            return Pending::Nothing;
        }
        let (head, tail) = (self.head(), self.tail());
        if tail < head || tail - head > self.capacity {
            return Pending::None;
        }
        let mut last = std::collections::BTreeMap::new();
        for seq in head..tail {
            let slot = HEADER as usize + (seq % self.capacity) as usize * 16;
            let guest = self.word(slot).load(Ordering::Relaxed);
            let host = self.word(slot + 8).load(Ordering::Relaxed);
            let mapped = match host {
                ZERO_CLUSTER => Mapped::Zero,
                h => Mapped::Data(h & !1),
            };
            last.insert(guest, mapped);
        }
        Pending::ThisBoot {
            records: last.into_iter().collect(),
            staged: state == STAGED,
        }
    }

    /// Where staging slot `i` (one cluster) lies in the file.
    fn slot_at(&self, i: usize) -> u64 {
        self.len as u64 + ((i as u64) << self.cluster_bits)
    }

    /// Writes `cluster` (one cluster's bytes) into staging slot `i`.
    pub fn stage(&self, i: usize, cluster: &[u8]) -> io::Result<()> {
        rustix::io::pwrite(&self.file, cluster, self.slot_at(i))
            .map_err(io::Error::from)
            .and_then(|n| match n == cluster.len() {
                true => Ok(()),
                false => Err(io::ErrorKind::WriteZero.into()),
            })
    }

    /// Reads staging slot `i` into `cluster`.
    pub fn staged(&self, i: usize, cluster: &mut [u8]) -> io::Result<()> {
        let len = cluster.len();
        let n = rustix::io::pread(&self.file, cluster, self.slot_at(i))?;
        match n == len {
            true => Ok(()),
            false => Err(io::ErrorKind::UnexpectedEof.into()),
        }
    }
}

impl Drop for MappingJournal {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `open`; no reference into it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The records `j` holds for a replay of this boot, which it must hold.
    fn this_boot(j: &MappingJournal) -> Vec<(u64, Mapped)> {
        match j.pending_records() {
            Pending::ThisBoot { records, .. } => records,
            p => panic!("{p:?}"),
        }
    }

    /// Removes a test's journal from the state directory when dropped.
    struct Removed(PathBuf);

    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// The journal of the image file `f`, removed now too: one of a deleted file whose inode
    /// `f` took may be left in the state directory.
    fn journal_of(f: &File) -> Removed {
        let path = crate::format::qcow2::journal_path_of(&f.metadata().unwrap());
        let _ = std::fs::remove_file(&path);
        Removed(path)
    }

    fn journal(dir: &Path) -> (Removed, File, MappingJournal) {
        let img = dir.join("disk.qcow2");
        std::fs::write(&img, b"image").unwrap();
        let f = File::open(&img).unwrap();
        let removed = journal_of(&f);
        let j = MappingJournal::open(&f, 16, true).unwrap();
        (removed, f, j)
    }

    #[test]
    fn the_last_record_of_each_cluster_is_pending_until_a_write_back_covers_it() {
        let dir = tempfile::tempdir().unwrap();
        let (_removed, f, mut j) = journal(dir.path());
        assert!(matches!(j.pending_records(), Pending::None), "nothing yet");
        assert!(j.append(&[(3, Mapped::Data(0x30000)), (1, Mapped::Data(0x40000))]));
        assert!(j.append(&[(3, Mapped::Zero)]));
        let covered = j.position();
        assert!(j.append(&[(7, Mapped::Data(0x50000))]));
        // What another process (a replay after a crash) reads.
        let other = MappingJournal::open(&f, 16, false).unwrap();
        match other.pending_records() {
            Pending::ThisBoot { records, staged } => {
                assert!(!staged);
                assert_eq!(
                    records,
                    vec![
                        (1, Mapped::Data(0x40000)),
                        (3, Mapped::Zero),
                        (7, Mapped::Data(0x50000))
                    ]
                );
            }
            p => panic!("{p:?}"),
        }
        j.checkpoint(covered);
        assert_eq!(this_boot(&other), vec![(7, Mapped::Data(0x50000))]);
        // Not done: a record came after the write-back began.
        j.close_if_done(covered);
        assert!(matches!(other.pending_records(), Pending::ThisBoot { .. }));
        let tail = j.position();
        j.close_if_done(tail);
        // A position of the journal before it was begun anew covers nothing of the new one.
        assert!(j.append(&[(8, Mapped::Zero)]));
        j.checkpoint(tail);
        j.close_if_done(tail);
        assert!(
            matches!(other.pending_records(), Pending::ThisBoot { .. }),
            "stale"
        );
        let now = j.position();
        j.close_if_done(now);
        assert!(
            matches!(other.pending_records(), Pending::Nothing),
            "closed"
        );
        // Begun anew by the next record, emptied.
        assert!(j.append(&[(9, Mapped::Zero)]));
        assert_eq!(this_boot(&other), vec![(9, Mapped::Zero)]);
    }

    #[test]
    fn an_image_taken_over_forgets_what_another_process_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let (_removed, f, mut crashed) = journal(dir.path());
        assert!(crashed.append(&[(4, Mapped::Data(0x60000))]));
        // The next process to take the image (after the mark was repaired by another program,
        // say) empties the journal before it marks the image: its own mark, should it die
        // before its first record, is not taken for the crashed process's records.
        let mut next = MappingJournal::open(&f, 16, false).unwrap();
        assert!(matches!(next.pending_records(), Pending::ThisBoot { .. }));
        next.forget_others();
        assert!(matches!(next.pending_records(), Pending::Nothing));
        // One writing its own records keeps them.
        assert!(next.append(&[(5, Mapped::Zero)]));
        next.forget_others();
        assert_eq!(this_boot(&next), vec![(5, Mapped::Zero)]);
    }

    #[test]
    fn a_full_journal_refuses_records_until_a_write_back_drops_some() {
        let dir = tempfile::tempdir().unwrap();
        let (_removed, _f, mut j) = journal(dir.path());
        let cap = j.capacity();
        assert_eq!(cap, 1024, "64 MiB of 64 KiB clusters");
        for i in 0..cap {
            assert!(!j.wants_write_back() || i >= cap / 2);
            assert!(j.append(&[(i, Mapped::Data(i << 16))]), "record {i}");
        }
        assert!(j.wants_write_back());
        assert!(!j.append(&[(0, Mapped::Zero)]), "full");
        j.checkpoint(Position {
            generation: j.generation,
            tail: 10,
        });
        assert!(
            j.append(&[(0, Mapped::Zero)]),
            "room again, past the ring's end"
        );
        assert!(!j.append(&(0..10).map(|i| (i, Mapped::Zero)).collect::<Vec<_>>()));
    }

    #[test]
    fn a_journal_of_another_boot_or_another_file_covers_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (removed, f, mut j) = journal(dir.path());
        assert!(j.append(&[(1, Mapped::Zero)]));
        // Another boot's id.
        j.bytes_mut(AT_BOOT_ID, 1)[0] ^= 1;
        let other = MappingJournal::open(&f, 16, false).unwrap();
        assert!(matches!(other.pending_records(), Pending::OtherBoot));
        j.bytes_mut(AT_BOOT_ID, 1)[0] ^= 1;
        assert!(matches!(other.pending_records(), Pending::ThisBoot { .. }));
        // A journal named after another file (an inode number used again by a file made
        // anew): its header names the first file.
        let img2 = dir.path().join("disk2.qcow2");
        std::fs::write(&img2, b"image").unwrap();
        let f2 = File::open(&img2).unwrap();
        let removed2 = journal_of(&f2);
        std::fs::copy(&removed.0, &removed2.0).unwrap();
        let other = MappingJournal::open(&f2, 16, false).unwrap();
        assert!(matches!(other.pending_records(), Pending::None));
        // Not created when asked not to.
        let none = dir.path().join("none.qcow2");
        std::fs::write(&none, b"x").unwrap();
        let none = File::open(&none).unwrap();
        let _removed_none = journal_of(&none);
        let e = MappingJournal::open(&none, 16, false);
        assert_eq!(e.err().map(|e| e.kind()), Some(io::ErrorKind::NotFound));
    }
}
