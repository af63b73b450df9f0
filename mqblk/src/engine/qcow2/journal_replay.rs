//! Serving again an image that a daemon in `metadata-commit=journal` left marked dirty when it
//! crashed: its journal's records ([`mapping_journal`](super::mapping_journal)) are replayed
//! through imago before anything else reaches the image.
//!
//! The file holds the tables of the last write-back; the records name where the data of each
//! cluster mapped since then lies in the file. Those clusters may be counted free in the
//! file's refcounts, so imago may hand them out again as the replay allocates: every one is
//! read first, into the journal's staging area (the journal is marked staged once they all
//! are, so a replay cut short reads them from there when it runs again). Then each is written
//! at its guest offset through imago, and each zero cluster zeroed, the tables written back and
//! synced, the mark cleared and the journal emptied. A host cluster a record named and the
//! replay mapped anew stays counted: a leak, which `qemu-img check` reports, as a crash of
//! QEMU may leave.
//!
//! Records of another boot are not used: the machine went down with the guest, which loses
//! what it did not flush, and the file's tables are those of a write-back, in qcow2's order.

use std::path::Path;

use futures::executor::block_on;
use imago::io_buffers::IoVector;

use super::image::Image;
use super::mapping_journal::{Mapped, Pending};
use super::test_hooks;
use crate::engine::OpenError;
use crate::format::qcow2::Qcow2Error;

/// Brings `image` (at `path`, opened with its crash's mark let through, its locks taken) up
/// to what its journal records, and clears the mark.
pub fn recover(image: &Image, path: &Path) -> Result<(), OpenError> {
    let io = |what: &'static str| {
        let path = path.display().to_string();
        move |err: std::io::Error| OpenError::Io { what, path, err }
    };
    let (Some(mut journal), Some(dirty)) = (image.journal(), &image.dirty) else {
        return Err(Qcow2Error::Dirty(path.display().to_string()).into());
    };
    let replayed = match journal.pending_records() {
        Pending::None => return Err(Qcow2Error::Dirty(path.display().to_string()).into()),
        // Marked, and dead before a record: nothing acknowledged is missing from the tables.
        Pending::Nothing => {
            tracing::info!(
                image = %path.display(),
                "the image was left marked dirty by a crash of mqblk before its metadata \
                 journal held a record: its tables hold every acknowledged write; served"
            );
            None
        }
        Pending::OtherBoot => {
            tracing::warn!(
                image = %path.display(),
                "the image was marked dirty by mqblk's metadata journal before this boot: it \
                 holds what its last write-back wrote (the writes into new clusters its guest \
                 did not flush before the machine went down are lost, as with any writeback \
                 cache); served"
            );
            None
        }
        Pending::ThisBoot { records, staged } => {
            image
                .mend_tables()
                .map_err(io("cannot check the tables of"))?;
            let cluster = 1u64 << image.cluster_bits;
            let mut buf = ClusterBuf::new(cluster as usize);
            // Record `i`'s data goes in staging slot `i` (a zero record leaves its slot a hole).
            if !staged {
                for (i, &(_, mapped)) in records.iter().enumerate() {
                    if let Mapped::Data(host) = mapped {
                        read_cluster(&image.file, buf.bytes(), host)
                            .map_err(io("cannot read a journaled cluster of"))?;
                        journal
                            .stage(i, buf.bytes())
                            .map_err(io("cannot stage a journaled cluster of"))?;
                    }
                }
                journal.set_staged();
            }
            let size = image.access.size();
            for (i, &(guest, mapped)) in records.iter().enumerate() {
                test_hooks::replay_wrote(i as u64);
                // Past the image's end (a damaged journal): nothing to write.
                let Some(at) = guest.checked_mul(cluster).filter(|&at| at < size) else {
                    continue;
                };
                let len = cluster.min(size - at);
                match mapped {
                    Mapped::Data(_) => {
                        journal
                            .staged(i, buf.bytes())
                            .map_err(io("cannot read the staged clusters of"))?;
                        let mut v = IoVector::with_capacity(1);
                        v.push(&buf.bytes()[..len as usize]);
                        block_on(image.access.writev(v, at))
                            .map_err(io("cannot replay the metadata journal into"))?;
                    }
                    Mapped::Zero => block_on(image.access.write_zeroes(at, len))
                        .map_err(io("cannot replay the metadata journal into"))?,
                }
            }
            Some(records.len())
        }
    };
    // The mark is this process's now: cleared after the tables are written back and synced.
    let clear = async {
        dirty.mark(image.top_storage()).await?;
        let before = dirty.answered();
        image.access.flush().await?;
        image.access.sync().await?;
        dirty.clear(image.top_storage(), before).await?;
        image.access.sync().await
    };
    block_on(clear).map_err(io("cannot write the replayed metadata of"))?;
    journal.discard();
    if let Some(n) = replayed {
        tracing::warn!(
            image = %path.display(),
            clusters = n,
            journal = %journal.path().display(),
            "the image was left marked dirty by a crash of mqblk: the mappings its metadata \
             journal recorded since the guest's last flush are replayed"
        );
    }
    Ok(())
}

/// Reads the cluster at `host` of `file` into `buf` (page-aligned, a cluster long, so that an
/// O_DIRECT descriptor reads it too); what lies past the file's end reads as zeros.
fn read_cluster(file: &std::fs::File, buf: &mut [u8], host: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = rustix::io::pread(file, &mut buf[done..], host + done as u64)?;
        if n == 0 {
            buf[done..].fill(0);
            break;
        }
        done += n;
    }
    Ok(())
}

/// One cluster's buffer, page-aligned (the image file may be open with O_DIRECT).
struct ClusterBuf {
    pages: Vec<Page>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([u8; 4096]);

impl ClusterBuf {
    fn new(cluster: usize) -> ClusterBuf {
        ClusterBuf {
            pages: vec![Page([0; 4096]); cluster.div_ceil(4096)],
            len: cluster,
        }
    }

    /// The cluster's bytes.
    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `Page` is 4096 bytes with no padding (`repr(C)`, a byte array), so the
        // vector's pages are at least `len` contiguous initialised bytes, borrowed mutably
        // with `self`.
        unsafe { std::slice::from_raw_parts_mut(self.pages.as_mut_ptr().cast::<u8>(), self.len) }
    }
}
