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

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use imago::StorageExt;

use super::storage::RingFile;
use crate::format::qcow2::header::{DIRTY, INCOMPATIBLE_FEATURES_AT};

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

async fn write_features(file: &RingFile, bits: u64) -> io::Result<()> {
    file.write(&bits.to_be_bytes()[..], INCOMPATIBLE_FEATURES_AT)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;

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
