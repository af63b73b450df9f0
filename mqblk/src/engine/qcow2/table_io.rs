//! The image's own tables read and written outside imago, blocking: the header and the L1 and
//! refcount tables that [`WriteOrder`](super::write_order) mirrors, and the refcounts
//! [`refcount_repair`](super::refcount_repair) mends. Reads go through a buffer aligned for
//! O_DIRECT (the descriptor is imago's, with its flags); writes are written through.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use imago::io_buffers::IoBuffer;
use rustix::io::ReadWriteFlags;

use super::refcount_repair;
use super::write_order::WriteOrder;
use crate::format::qcow2::header::{self, Tables, HEAD_BYTES};

/// An image file, for its tables.
#[derive(Debug, Clone)]
pub struct TableIo {
    file: Arc<File>,
    path: PathBuf,
    /// What O_DIRECT needs of a buffer's address, an offset and a length.
    align: usize,
}

impl TableIo {
    /// `file` (at `path`, for messages), whose O_DIRECT alignment is `align`.
    pub fn new(file: File, path: &Path, align: usize) -> TableIo {
        TableIo {
            file: Arc::new(file),
            path: path.to_path_buf(),
            align: align.max(512),
        }
    }

    /// Calls `f` with the image's header and its L1 and refcount tables, as the file holds
    /// them.
    fn with_tables<R>(&self, f: impl FnOnce(&Tables) -> R) -> io::Result<R> {
        let size = self.file.metadata()?.len();
        let mut head = self.read(0, HEAD_BYTES.min(size as usize))?;
        // Refused at open when set; from then on the mark is ours (`dirty_mark`).
        header::unmark_dirty(&mut head);
        let header = header::parse(&self.path, &head).map_err(io::Error::other)?;
        let l1 = self.read(header.l1_offset, header.l1_entries as usize * 8)?;
        // Bounded at open: at most 8 MiB.
        let reftable_bytes = u64::from(header.reftable_clusters) << header.cluster_bits;
        let reftable = self.read(header.reftable_offset, reftable_bytes as usize)?;
        Ok(f(&Tables {
            header: &header,
            l1: &l1,
            reftable: &reftable,
        }))
    }

    /// The write ordering of this image, as its tables are now.
    pub fn write_order(&self) -> io::Result<WriteOrder> {
        self.with_tables(WriteOrder::new)
    }

    /// Gives `order` the tables as they are now (after a header write).
    pub fn reload(&self, order: &WriteOrder) -> io::Result<()> {
        self.with_tables(|t| order.reload(t))
    }

    /// Counts 1 each of the image's own tables that is counted 0 ([`refcount_repair`]);
    /// returns their offsets. Only while nothing else writes the image: before imago
    /// allocates, with no other backend serving it.
    pub fn repair_table_refcounts(&self) -> io::Result<Vec<u64>> {
        let file_size = self.file.metadata()?.len();
        self.with_tables(|t| {
            refcount_repair::repair(
                t,
                file_size,
                |offset, len| self.read(offset, len),
                |offset, bytes| self.write_through(offset, bytes),
            )
        })?
        .map_err(|e| match e.kind() {
            io::ErrorKind::InvalidData => {
                io::Error::new(e.kind(), format!("{}: {e}", self.path.display()))
            }
            _ => e,
        })
    }

    /// `len` bytes at `offset` (zeros past the end of the file).
    pub fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        if len == 0 {
            // (An image of size 0 has no L1 entries.)
            return Ok(Vec::new());
        }
        let align = self.align as u64;
        let start = offset / align * align;
        let end = (offset + len as u64).next_multiple_of(align);
        let mut buf = IoBuffer::new((end - start) as usize, self.align)?;
        let bytes = buf.as_mut().into_slice();
        let mut done = 0;
        while done < bytes.len() {
            let n = rustix::io::pread(&*self.file, &mut bytes[done..], start + done as u64)?;
            if n == 0 {
                bytes[done..].fill(0);
                break;
            }
            done += n;
        }
        let from = (offset - start) as usize;
        Ok(bytes[from..from + len].to_vec())
    }

    /// Writes `bytes` (aligned blocks) at `offset`, durable when this returns (`RWF_DSYNC`).
    fn write_through(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let mut buf = IoBuffer::new(bytes.len(), self.align)?;
        let data = buf.as_mut().into_slice();
        data.copy_from_slice(bytes);
        let mut done = 0;
        while done < data.len() {
            let at = offset + done as u64;
            let slice = [io::IoSlice::new(&data[done..])];
            match rustix::io::pwritev2(&*self.file, &slice, at, ReadWriteFlags::DSYNC) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_exact_past_the_end_and_empty_when_nothing_is_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, (0..8192u32).map(|i| i as u8).collect::<Vec<_>>()).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let t = TableIo::new(file, &path, 4096);
        assert!(t.read(100, 0).unwrap().is_empty());
        assert_eq!(
            t.read(4000, 200).unwrap(),
            (4000..4200u32).map(|i| i as u8).collect::<Vec<_>>()
        );
        // Past the end: zeros.
        assert_eq!(t.read(8190, 4).unwrap(), vec![254, 255, 0, 0]);
        t.write_through(4096, &[9u8; 4096]).unwrap();
        t.write_through(0, &[]).unwrap();
        assert_eq!(t.read(4095, 2).unwrap(), vec![255, 9]);
    }
}
