//! `metadata-commit=flush`: the image file marked dirty while it lacks metadata of writes the
//! guest was told are done.
//!
//! In that mode a write into a new cluster completes once its data is written and its mapping
//! is in imago's tables, and the tables reach the file at the guest's next flush, as with
//! QEMU's qcow2 driver. A crash of mqblk in between loses those writes, and a guest that lives
//! on through a reconnect would read stale data where it wrote. So before the first such
//! write completes, the header's dirty bit is set on the file (qcow2's "do not trust this
//! image as it is" flag: QEMU sets it for lazy refcounts), and it is cleared only after a
//! write-back and sync that covered every such write. An image a crashed daemon left is then
//! refused when an export opens it again, in one line that names the loss and the repair
//! (`Qcow2Error::Dirty`), rather than served behind what its guest was told.
//!
//! The bit is written with imago's own `StorageExt::write` on the top file, whose range locks
//! serialize it with imago's read-modify-write of the header's first block (imago rewrites the
//! version 2 part when an L1 or refcount table moves). A served image has no incompatible
//! feature bit set (`header::parse` refuses every one), so the whole field is written.
//!
//! Setting the bit costs one header write per flush interval with allocations in it, clearing
//! it one more per flush that had set it.
//!
//! A mark can also be a live server's: a live migration's destination opens the image while
//! the source serves it, marked, and the source clears the mark at the switch-over, before the
//! destination's rings start (and read the header again). So every daemon serving an image in
//! this mode holds a shared lock on one byte of it ([`hold`]: an open file description lock,
//! which dies with the process); an image marked dirty whose byte another description holds
//! is opened (by a destination in either mode), and one marked with the byte free is what a
//! crash left, and is refused.

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use imago::StorageExt;

use super::storage::RingFile;
use super::table_io::TableIo;
use crate::engine::image_lock;
use crate::format::qcow2::header::{self, DIRTY, INCOMPATIBLE_FEATURES_AT};

/// The byte a serving daemon holds a shared lock on: far past any image's end, and apart from
/// the bytes QEMU locks (100 and up, 200 and up), so that `qemu-img` on a served image sees
/// nothing of it.
const LIVE_LOCK_AT: i64 = 0x6d71_626c_6b00;

/// The dirty mark of one image file (the top of a chain, served writable).
#[derive(Debug, Default)]
pub struct DirtyMark {
    /// The file carries the bit (set once its write completed; unset before the write that
    /// clears it begins).
    marked: AtomicBool,
    /// Jobs completed with metadata the file may lack.
    answered: AtomicU64,
    /// Held through a write of the bit.
    writing: futures::lock::Mutex<()>,
}

impl DirtyMark {
    /// Whether the file is marked: a job whose metadata is only in imago's tables may complete.
    pub fn marked(&self) -> bool {
        self.marked.load(Ordering::Acquire)
    }

    /// Counts a job completing with metadata the file may lack (while marked).
    pub fn answering(&self) {
        self.answered.fetch_add(1, Ordering::AcqRel);
    }

    /// How many have; read before a write-back that is to clear the mark.
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::Acquire)
    }

    /// Marks `file` dirty, unless it is.
    pub async fn mark(&self, file: &RingFile) -> io::Result<()> {
        let _writing = self.writing.lock().await;
        if self.marked() {
            return Ok(());
        }
        write_features(file, 1 << DIRTY).await?;
        self.marked.store(true, Ordering::Release);
        Ok(())
    }

    /// Clears the mark once a write-back and sync that began when [`answered`](Self::answered)
    /// read `before` is done, if no job has completed since with metadata the file may lack.
    pub async fn clear(&self, file: &RingFile, before: u64) -> io::Result<()> {
        let _writing = self.writing.lock().await;
        // Jobs complete on the worker's thread between its tasks' steps, never within this
        // check and the store after it: from the store on, a job that changed metadata waits
        // for `mark`, which waits for this write.
        if !self.marked() || self.answered() != before {
            return Ok(());
        }
        self.marked.store(false, Ordering::Release);
        // Failed, the file may still be marked: a false alarm at the next open, never a miss.
        write_features(file, 0).await
    }
}

/// Whether the file `tables` reads carries the dirty bit now: after this process's own mark
/// is cleared, another server's.
pub fn on_file(tables: &TableIo) -> io::Result<bool> {
    let bytes = tables.read(INCOMPATIBLE_FEATURES_AT, 8)?;
    Ok(header::dirty_in(bytes[..8].try_into().expect("8 bytes")))
}

/// Writes into `file`'s header whether a mark of this process is its metadata journal's
/// ([`header::JOURNAL_OWNS_MARK`]: set with `journal`, else cleared), unless it says so
/// already (`tables` reads the file as it is). Done before this process first marks the file,
/// so that a mark found with the bit set after a crash is the journal's, and one found
/// without it (this process in `metadata-commit=flush`, or another program since) is not
/// replayed.
pub async fn claim(file: &RingFile, tables: &TableIo, journal: bool) -> io::Result<()> {
    let bytes = tables.read(header::AUTOCLEAR_FEATURES_AT, 8)?;
    let now = u64::from_be_bytes(bytes[..8].try_into().expect("8 bytes"));
    let wanted = match journal {
        true => now | header::JOURNAL_OWNS_MARK,
        false => now & !header::JOURNAL_OWNS_MARK,
    };
    if wanted == now {
        return Ok(());
    }
    file.write(&wanted.to_be_bytes()[..], header::AUTOCLEAR_FEATURES_AT)
        .await
}

/// Takes the shared lock of a server of `file` in this mode, held while the file's open
/// description lives.
pub fn hold(file: &File) -> io::Result<()> {
    lock(file, libc::F_OFD_SETLK, libc::F_RDLCK as i16).map(|_| ())
}

/// Whether the image at `path` is marked dirty by a live server in this mode: its dirty bit
/// set (and nothing that an open would write back), and the server's lock held.
pub fn marked_by_a_live_server(path: &Path) -> io::Result<bool> {
    let head = header::read_head(path).map_err(io::Error::other)?;
    if !header::marked_dirty_alone(&head) {
        return Ok(false);
    }
    let probe = File::open(path)?;
    // Not yet held through `probe`'s own description, so any holder is another's.
    lock(&probe, libc::F_OFD_GETLK, libc::F_WRLCK as i16).map(|held| held != libc::F_UNLCK as i16)
}

/// `fcntl(cmd)` with an open file description lock of type `kind` on [`LIVE_LOCK_AT`]; returns
/// the type `F_OFD_GETLK` reports (`F_UNLCK`: none held in the way).
fn lock(file: &File, cmd: libc::c_int, kind: i16) -> io::Result<i16> {
    image_lock::ofd(file, cmd, kind, LIVE_LOCK_AT)
}

async fn write_features(file: &RingFile, bits: u64) -> io::Result<()> {
    file.write(&bits.to_be_bytes()[..], INCOMPATIBLE_FEATURES_AT)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;

    #[test]
    fn a_mark_is_a_live_server_s_while_its_lock_is_held() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h");
        let mut head = vec![0u8; 4096];
        head[..4].copy_from_slice(b"QFI\xfb");
        head[4..8].copy_from_slice(&3u32.to_be_bytes());
        std::fs::write(&path, &head).unwrap();
        let server = File::open(&path).unwrap();
        hold(&server).unwrap();
        assert!(!marked_by_a_live_server(&path).unwrap(), "not marked");
        head[79] = 1;
        std::fs::write(&path, &head).unwrap();
        assert!(marked_by_a_live_server(&path).unwrap());
        head[95] = 1;
        std::fs::write(&path, &head).unwrap();
        assert!(
            !marked_by_a_live_server(&path).unwrap(),
            "an autoclear bit set"
        );
        head[95] = 0;
        std::fs::write(&path, &head).unwrap();
        let other = File::open(&path).unwrap();
        hold(&other).unwrap();
        drop(server);
        assert!(
            marked_by_a_live_server(&path).unwrap(),
            "the other server holds it"
        );
        drop(other);
        assert!(
            !marked_by_a_live_server(&path).unwrap(),
            "no server: a crash's mark"
        );
    }

    #[test]
    fn the_mark_is_cleared_only_by_a_write_back_that_no_completion_followed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h");
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let file = RingFile::new(f, &path, true, false).unwrap();
        let on_file =
            || u64::from_be_bytes(std::fs::read(&path).unwrap()[72..80].try_into().unwrap());
        let m = DirtyMark::default();
        assert!(!m.marked());
        block_on(m.mark(&file)).unwrap();
        assert!(m.marked());
        assert_eq!(on_file(), 1, "the dirty bit, alone in the field");

        let before = m.answered();
        m.answering();
        block_on(m.clear(&file, before)).unwrap();
        assert!(m.marked(), "a job completed after the write-back began");
        assert_eq!(on_file(), 1);

        block_on(m.clear(&file, m.answered())).unwrap();
        assert!(!m.marked());
        assert_eq!(on_file(), 0);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            vec![0u8; 4096],
            "nothing else written"
        );
    }
}
