//! Copy-on-write done by the metadata workers themselves, and the locks that keep it correct.
//!
//! A guest write of part of a cluster that the top image does not hold yet needs the rest of
//! the cluster from where it reads now (a backing image, or zeros). imago does that under
//! its lock of the cluster's L2 table: a read of the whole cluster, a write of it, then the
//! guest's write, one after the other, while every other allocation in the same table (512 MiB
//! of guest disk at 64 KiB clusters) waits. Here the worker reads the cluster first, on its
//! ring, outside any imago lock and in parallel with other jobs, copies the guest's data into
//! it, and then hands imago one write of the whole cluster, which imago maps without copying
//! anything: one write under the table's lock instead of three I/Os. The cluster is built in a
//! buffer of the worker's registered region ([`cluster_buffers`](super::cluster_buffers)).
//! Where the rest is zeros and the cluster lands in file space that reads as zeros
//! ([`fresh_space`](super::fresh_space)), only the guest's part is written: a 4 KiB write into
//! a new image's 64 KiB cluster writes 4 KiB, not 64.
//!
//! Between reading the rest and writing the cluster, nothing else may change the cluster, or
//! the stale rest would overwrite it. Every metadata-path write holds its clusters
//! ([`ClusterLocks`](super::locks::ClusterLocks)) for the whole of its work (the I/O threads write only clusters already allocated,
//! which this path never rewrites), and zeroing holds `Image::zeroing` exclusively, which
//! every write holds shared.

use std::io;
use std::ops::Range;
use std::os::fd::RawFd;

use imago::io_buffers::IoVector;
use imago::storage::ext::StorageExt;

use super::cluster_buffers::ClusterBuffer;
use super::data_writes;
use super::image::{resolve, Image};
use super::mapping::Target;
use super::test_hooks;
use super::uring_io;

/// Writes the guest's `data` (`len` bytes at guest `offset`, inside one cluster and less than
/// all of it) into a cluster that the top image does not hold yet, as one write of the whole
/// cluster: the rest read from where the cluster reads now. `None` when that is not the case
/// (the cluster is allocated, or only imago can read it, or the range is not inside one
/// cluster), or the rest could not be read: imago's own write does it then.
///
/// The caller holds the cluster (`Image::cow_locks`) and `Image::zeroing` shared.
pub async fn write_into_new_cluster(
    image: &Image,
    offset: u64,
    data: &[&[u8]],
    len: u64,
) -> Option<io::Result<()>> {
    let size = 1u64 << image.cluster_bits;
    let start = offset & !(size - 1);
    if len == 0 || len >= size || offset + len > start + size {
        return None;
    }
    let mut cluster = ClusterBuffer::take(size as usize, image.access.mem_align().max(4096))?;
    let guest = offset - start..offset - start + len;
    // Whether every byte of the cluster outside the guest's part reads as zeros.
    let mut rest_is_zeros = true;
    let mut at = start;
    while at < start + size {
        let (target, n) = resolve(&image.access, at, start + size - at).await.ok()?;
        let n = n.min(start + size - at);
        if n == 0 {
            return None;
        }
        let within = (at - start) as usize..(at - start + n) as usize;
        let dst = &mut cluster.bytes_mut()[within];
        match target? {
            Target::Zeros => dst.fill(0),
            Target::File { layer, offset, .. } if layer > 0 => {
                read_full(image.layer_fd(layer)?, dst, offset).await.ok()?;
                // (A hole in a raw base reads as zeros as well as an unallocated cluster.)
                let within_guest = guest.start <= at - start && at - start + n <= guest.end;
                rest_is_zeros &= within_guest || is_zeros(dst);
            }
            // In the top image: written in place by imago.
            Target::File { .. } => return None,
        }
        at += n;
    }
    // The guest's part copied in: the cluster goes out as one buffer of the worker's
    // registered region (`cluster_buffers`). A frontend that truncated the memory meanwhile
    // makes this copy fault; the daemon's SIGBUS guard contains it on any thread.
    test_hooks::BEFORE_COPYING_GUEST_DATA.wait().await;
    let mut at = (offset - start) as usize;
    for d in data {
        let n = d.len().min(size as usize - at);
        cluster.bytes_mut()[at..at + n].copy_from_slice(&d[..n]);
        at += n;
    }
    // Where the rest is zeros and the cluster lands in fresh file space, only the guest's
    // part (out to the file's alignment) needs writing.
    let align = image.access.req_align().max(image.access.mem_align()) as u64;
    let part = rest_is_zeros.then(|| {
        let from = (guest.start / align * align).min(size) as usize;
        from..guest.end.next_multiple_of(align).min(size) as usize
    });
    // The whole cluster is data (`data_writes`).
    let _data = data_writes::register(&[cluster.bytes()]);
    let written = write_cluster(image, cluster.bytes(), part, start).await;
    if let Ok(in_part) = written {
        image.counters.wrote_cow(in_part);
    }
    Some(written.map(drop))
}

/// Writes `cluster`, the new contents of the cluster at guest `start`, and maps it: mapped
/// first and written after where it may be ([`early_maps`](super::early_maps)), so that
/// imago's lock of the L2 table is not held through the write. `part`: the bytes of
/// `cluster` outside it are zeros, so where the new cluster lands in fresh file space
/// ([`RingFile::is_fresh`](super::storage::RingFile::is_fresh)), only `part` is written.
/// Returns whether only `part` was.
async fn write_cluster(
    image: &Image,
    cluster: &[u8],
    part: Option<Range<usize>>,
    start: u64,
) -> io::Result<bool> {
    let size = cluster.len() as u64;
    let whole = || IoVector::from(cluster);
    let Some(order) = image.write_order.as_deref() else {
        return image.access.writev(whole(), start).await.map(|()| false);
    };
    let mapping = image.access.prepare_data_mapping(start, size, true).await?;
    let (storage, at) = (mapping.storage(), mapping.offset());
    if mapping.length() < size {
        // Not one cluster (cannot be, for a cluster-aligned range): imago's own write.
        drop(mapping);
        return image.access.writev(whole(), start).await.map(|()| false);
    }
    // Room for the cluster first: a full filesystem fails this request alone, before its
    // mapping exists (dropped, imago frees the cluster), not a write after it.
    storage.grow_for(at, at + size)?;
    // Asked once the file has grown over the cluster; nothing else writes the cluster until
    // its write below (imago gave it to this request alone).
    let (at, bytes, in_part) = match part.filter(|_| storage.is_fresh(at, size)) {
        Some(part) => (at + part.start as u64, &cluster[part], true),
        None => (at, cluster, false),
    };
    let whole = || IoVector::from(bytes);
    let Some(early) = order.begin_early() else {
        // An L2 table write waits for the early ones: data first, as imago does.
        storage.writev(whole(), at).await?;
        return image
            .access
            .commit_data_mapping(mapping)
            .await
            .map(|()| in_part);
    };
    image.access.commit_data_mapping(mapping).await?;
    test_hooks::BEFORE_EARLY_DATA.wait().await;
    let mut written = storage.writev(whole(), at).await;
    if written.is_err() {
        // Once more before giving the image up.
        written = storage.writev(whole(), at).await;
    }
    if let Err(e) = &written {
        // A mapping now points at a cluster without its data (`early_maps`).
        image.give_up(&format!(
            "a new cluster's data (at {at}) could not be written after its mapping: {e}"
        ));
    }
    drop(early);
    written.map(|()| in_part)
}

/// Whether `bytes` are all zeros (a word at a time: backing data is rarely zeros, and then
/// its first word says so).
fn is_zeros(bytes: &[u8]) -> bool {
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    words
        .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
        .all(|w| w == 0)
        && tail.iter().all(|&b| b == 0)
}

/// Fills `buf` from `fd` at `offset`; past the end of the file, with zeros.
async fn read_full(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = uring_io::read_at(fd, &mut buf[done..], offset + done as u64).await?;
        if n == 0 {
            buf[done..].fill(0);
            break;
        }
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn is_zeros_looks_at_every_byte_whatever_its_alignment() {
        let mut buf = vec![0u8; 4096 + 3];
        for (start, end) in [(0, 4099), (1, 4099), (3, 17), (5, 5)] {
            assert!(super::is_zeros(&buf[start..end]));
        }
        for at in [0, 1, 7, 8, 2048, 4098] {
            buf[at] = 1;
            assert!(!super::is_zeros(&buf[..]), "a byte at {at}");
            assert!(!super::is_zeros(&buf[at..]), "the first byte, at {at}");
            buf[at] = 0;
        }
    }
}
