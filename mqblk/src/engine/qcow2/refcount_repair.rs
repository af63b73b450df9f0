//! Before anything is allocated, the refcounts of the image's own tables: an L2 table or refcount block that its
//! L1 table or refcount table points at, counted 0, is counted 1 again; a table (or the
//! header) that no refcount block covers makes the image refused.
//!
//! imago writes a new L2 table and the L1 entry that points at it (and a new refcount block
//! and the refcount table entry) before the refcount block that counts the new table's
//! cluster, which stays in its cache until the next write-back (QEMU writes the refcount
//! first). A crash in between, of mqblk or of power, leaves a table in use whose cluster is
//! counted free, and the next allocation would hand that cluster out again, to be overwritten
//! with guest data. `qemu-img check` reports it as an error (`refcount=0 reference=1`). Only
//! these tables are exposed (a data cluster's refcount is written before the L2 entry that
//! uses it), so only they are checked, which costs reading the refcount blocks that count
//! them, not a walk of every L2 table. It runs when an export's first ring starts
//! ([`Image::mend_tables`](super::image::Image::mend_tables)), not at open: until then the source
//! of a live migration may still be writing the image.
//!
//! A cluster of the image's own metadata that no refcount block covers (its refcount table
//! entry is 0) is no crash's doing: imago writes a new refcount block and its table entry
//! before it returns the cluster it allocates. Such an image is corrupt, and imago would
//! allocate that cluster (the header's, say) as if free: a crafted image of this kind, found
//! by the `qcow2_image` fuzz target, sent imago's allocator into a recursion that overflowed
//! the worker's stack and ended the daemon at the guest's first write. So it is an error
//! here, and the export's queues do not start (`qemu-img check -r all` mends the image).
//!
//! Two refcount table entries that point at one refcount block are refused too: the block's
//! counts would stand for two ranges of clusters at once (`qemu-img check`: "refcount block
//! N refcount=2"). It is also how a small crafted file could count clusters in use by the
//! billion (one full block named by every entry of its table), which imago's allocator walks
//! one at a time at the first write (about 0.13 µs each), holding the worker for minutes. With
//! every block a cluster of its own in the file, what the allocator could be made to walk
//! still grows with the file's bytes times 8 / 2^refcount_order: a 1 GiB file of one-bit
//! refcounts counts 8 Gi clusters in use, some twenty minutes of the walk, during which the
//! export's worker serves nothing and the daemon's shutdown, which drains it, waits. So a refcount block may count
//! clusters in use only below [`COUNTED_PAST_END_MAX`] past the end of the file; one that
//! counts any further out is refused. No image counts clusters that far out unless made to:
//! what a crash leaves counted past the end is what was being allocated, and mqblk grows the
//! file at most 16 MiB ahead. What the allocator can walk is then the clusters up to that
//! bound, rounded up to one block's range: 2.3–2.4 s for the widest, a one-bit block of 2 MiB
//! clusters (docs/RELIABILITY.md; `qemu-img check -r all` mends such an image).
//!
//! Why a covered header is what bounds that recursion (imago 0.2.6, `qcow2/allocation.rs`):
//! for a range with no refcount block, the allocator looks for a cluster for one from its
//! first free cluster up to the range's first cluster, and failing that places the block at
//! that first cluster, counting itself. For range 0 that is offset 0, which the refcount
//! table reads as "no block": the next allocation makes the block again, from inside its own
//! search, without end. Any other block lands at a nonzero offset, and the first free cluster
//! passes a range only once a block covers it (a free lowers it only to a cluster it has
//! passed), so a search for a block meets ranges already covered, and nests once at most.

use std::io;

use crate::format::qcow2::header::{table_entries, Tables};

/// How far past the end of the image's file its refcount blocks may count clusters in use:
/// beyond what any crash leaves counted, and 2 Mi clusters (a quarter of a second of imago's
/// walk) at the smallest cluster size.
pub const COUNTED_PAST_END_MAX: u64 = 1 << 30;

/// The refcount of entry `index` of a refcount block of `bits`-bit entries.
fn get(block: &[u8], index: u64, bits: u32) -> u64 {
    if bits >= 8 {
        let (w, at) = ((bits / 8) as usize, index as usize * (bits / 8) as usize);
        block[at..at + w]
            .iter()
            .fold(0u64, |v, &b| (v << 8) | u64::from(b))
    } else {
        let (byte, shift) = (
            (index * u64::from(bits) / 8) as usize,
            (index * u64::from(bits)) % 8,
        );
        u64::from(block[byte] >> shift) & ((1 << bits) - 1)
    }
}

/// Sets entry `index` of a refcount block of `bits`-bit entries to `value` (which fits).
fn set(block: &mut [u8], index: u64, bits: u32, value: u64) {
    if bits >= 8 {
        let (w, at) = ((bits / 8) as usize, index as usize * (bits / 8) as usize);
        for (i, b) in block[at..at + w].iter_mut().enumerate() {
            *b = (value >> (8 * (w - 1 - i))) as u8;
        }
    } else {
        let (byte, shift) = (
            (index * u64::from(bits) / 8) as usize,
            (index * u64::from(bits)) % 8,
        );
        let mask = (((1u16 << bits) - 1) << shift) as u8;
        block[byte] = (block[byte] & !mask) | (((value as u8) << shift) & mask);
    }
}

/// The tables an L1 or refcount table points at.
fn entries(table: &[u8]) -> impl Iterator<Item = u64> + '_ {
    table_entries(table).filter(|&o| o != 0)
}

/// Counts 1 every L2 table and refcount block of the image (`tables`) that is counted 0,
/// reading refcount blocks with `read(offset, len)` and writing them back whole with
/// `write(offset, bytes)`. Returns the tables' offsets it counted again; an error
/// (`InvalidData`) where a table or the header is covered by no refcount block, or where two
/// refcount table entries point at one block.
pub fn repair(
    tables: &Tables,
    file_size: u64,
    read: impl Fn(u64, usize) -> io::Result<Vec<u8>>,
    mut write: impl FnMut(u64, &[u8]) -> io::Result<()>,
) -> io::Result<Vec<u64>> {
    let Tables {
        header,
        l1,
        reftable,
    } = *tables;
    let cluster_bits = header.cluster_bits;
    let cluster = 1usize << cluster_bits;
    let bits = 1u32 << header.refcount_order;
    // log2 of the entries of a refcount block.
    let rb_bits = cluster_bits + 3 - header.refcount_order;
    let refblocks: Vec<u64> = table_entries(reftable).collect();
    let mut distinct: Vec<u64> = entries(reftable).collect();
    distinct.sort_unstable();
    if let Some(shared) = distinct.windows(2).find(|w| w[0] == w[1]) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the image is corrupt: two refcount table entries point at the refcount block \
                 at offset {}; run `qemu-img check -r all` on it",
                shared[0]
            ),
        ));
    }
    refuse_counts_far_past_the_end(&refblocks, file_size, cluster_bits, rb_bits, bits, &read)?;
    // The L2 tables and refcount blocks, and the clusters of the L1 and refcount tables
    // themselves (a grown table is as exposed as a new L2 table).
    let spans = |offset: u64, len: u64| {
        let first = offset >> cluster_bits;
        let last = (offset + len.max(1)).div_ceil(cluster as u64);
        (first..last).map(move |c| c << cluster_bits)
    };
    // What lies past the end of the file or off a cluster boundary is not a table of this
    // image (imago refuses such an image when it reads there): left alone, never written.
    let mut tables: Vec<u64> = std::iter::once(0)
        .chain(entries(l1))
        .chain(entries(reftable))
        .chain(spans(header.l1_offset, 8 * u64::from(header.l1_entries)))
        .chain(spans(header.reftable_offset, reftable.len() as u64))
        .filter(|&t| t < file_size && t % cluster as u64 == 0)
        .collect();
    tables.sort_unstable();
    tables.dedup();
    let mut repaired = Vec::new();
    let mut block: Option<(u64, Vec<u8>, bool)> = None; // (offset, bytes, changed)
    for table in tables {
        let index = table >> cluster_bits;
        let rb = refblocks.get((index >> rb_bits) as usize).copied();
        let Some(rb) = rb.filter(|&rb| rb != 0 && rb < file_size && rb % cluster as u64 == 0)
        else {
            let what = if table == 0 { "the header" } else { "a table" };
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the image is corrupt: {what} at offset {table} is counted by no refcount \
                     block; run `qemu-img check -r all` on it"
                ),
            ));
        };
        if block.as_ref().map(|b| b.0) != Some(rb) {
            if let Some((at, bytes, true)) = block.take() {
                write(at, &bytes)?;
            }
            block = Some((rb, read(rb, cluster)?, false));
        }
        let (_, bytes, changed) = block.as_mut().expect("just read");
        let within = index & ((1 << rb_bits) - 1);
        if get(bytes, within, bits) == 0 {
            set(bytes, within, bits, 1);
            *changed = true;
            repaired.push(table);
        }
    }
    if let Some((at, bytes, true)) = block {
        write(at, &bytes)?;
    }
    Ok(repaired)
}

/// An error (`InvalidData`) if a refcount block counts a cluster in use
/// [`COUNTED_PAST_END_MAX`] or more past the end of the file (`file_size`), which imago's
/// allocator would walk one at a time. Only the blocks whose range begins that far out are
/// read (a legitimate image has none, or none that counts anything); a block past the end of
/// the file reads as zeros and counts nothing.
fn refuse_counts_far_past_the_end(
    refblocks: &[u64],
    file_size: u64,
    cluster_bits: u32,
    rb_bits: u32,
    bits: u32,
    read: &impl Fn(u64, usize) -> io::Result<Vec<u8>>,
) -> io::Result<()> {
    // Bytes of the file a refcount block's range covers (at most 2^45: 2 MiB clusters,
    // 1-bit refcounts).
    let range_bits = rb_bits + cluster_bits;
    let bound = file_size.saturating_add(COUNTED_PAST_END_MAX);
    let first_checked = bound.div_ceil(1 << range_bits);
    let far = refblocks.iter().enumerate().skip(first_checked as usize);
    for (index, &rb) in far.filter(|&(_, &rb)| rb != 0 && rb < file_size) {
        let block = read(rb, 1 << cluster_bits)?;
        let Some(byte) = block.iter().position(|&b| b != 0) else {
            continue;
        };
        let entry = (byte as u64 * 8 / u64::from(bits)..)
            .find(|&e| get(&block, e, bits) != 0)
            .expect("a nonzero byte holds a nonzero entry");
        // (Past 2^64 with a reftable of a million entries and the widest blocks.)
        let at = ((index as u128) << range_bits) + (u128::from(entry) << cluster_bits);
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the image's refcount block at offset {rb} counts the cluster at offset {at} in \
                 use, more than {} MiB past the end of its file ({file_size} bytes), which \
                 imago's allocator would walk one cluster at a time; run `qemu-img check -r all` \
                 on it",
                COUNTED_PAST_END_MAX >> 20
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::format::qcow2::header::Header;

    const C: u64 = 1 << 16;

    #[test]
    fn refcounts_of_every_width_read_back_as_set() {
        for order in 0..=6u32 {
            let bits = 1 << order;
            let mut block = vec![0u8; 4096];
            let max = if bits == 64 {
                u64::MAX
            } else {
                (1 << bits) - 1
            };
            for i in 0..64u64 {
                set(&mut block, i, bits, (i * 7) & max);
            }
            for i in 0..64u64 {
                assert_eq!(
                    get(&block, i, bits),
                    (i * 7) & max,
                    "order {order}, entry {i}"
                );
            }
        }
        // 16 bits, big-endian, as qcow2 stores them.
        let mut b = vec![0u8; 8];
        set(&mut b, 1, 16, 0x0102);
        assert_eq!(b[2..4], [1, 2]);
    }

    /// Writes table entry `v` (with the COPIED flag) at `at`.
    fn put(f: &mut [u8], at: u64, v: u64) {
        f[at as usize..at as usize + 8].copy_from_slice(&(v | 1 << 63).to_be_bytes())
    }

    /// An image of 8 clusters of 64 KiB with 16-bit refcounts: 0 header, 1 reftable,
    /// 2 refblock, 3 L1, 4 and 6 L2 tables, 5 data. The L2 table at cluster 4 is counted 0
    /// (its allocation's refcount was lost); the one at 6 is counted 2 (shared); cluster 7 is
    /// free. With its header.
    fn image() -> (Vec<u8>, Header) {
        let mut file = vec![0u8; 8 * C as usize];
        put(&mut file, C, 2 * C); // reftable[0] = refblock
        put(&mut file, 3 * C, 4 * C); // L1[0]
        put(&mut file, 3 * C + 8, 6 * C); // L1[1]
        for cluster in [0u64, 1, 2, 3, 5] {
            set(&mut file[2 * C as usize..3 * C as usize], cluster, 16, 1);
        }
        set(&mut file[2 * C as usize..3 * C as usize], 6, 16, 2);
        let header = Header {
            version: 3,
            cluster_bits: 16,
            size: 1 << 30,
            backing: None,
            backing_format: None,
            l1_offset: 3 * C,
            l1_entries: 2,
            snapshots: 0,
            reftable_offset: C,
            reftable_clusters: 1,
            refcount_order: 4,
        };
        (file, header)
    }

    #[test]
    fn a_table_counted_free_is_counted_again_and_nothing_else_changes() {
        let (file, header) = image();
        let file = RefCell::new(file);
        let read = |at: u64, len: usize| Ok(file.borrow()[at as usize..at as usize + len].to_vec());
        let writes = RefCell::new(0);
        let write = |at: u64, bytes: &[u8]| {
            *writes.borrow_mut() += 1;
            file.borrow_mut()[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
            Ok(())
        };
        let (l1, reftable) = (read(3 * C, 16).unwrap(), read(C, C as usize).unwrap());
        let tables = Tables {
            header: &header,
            l1: &l1,
            reftable: &reftable,
        };
        assert_eq!(repair(&tables, 8 * C, read, write).unwrap(), vec![4 * C]);
        let f = file.borrow();
        let rb = &f[2 * C as usize..3 * C as usize];
        let counts: Vec<u64> = (0..8).map(|i| get(rb, i, 16)).collect();
        assert_eq!(counts, [1, 1, 1, 1, 1, 1, 2, 0]);
        assert_eq!(*writes.borrow(), 1);
        drop(f);
        // Nothing left to do: nothing written.
        assert!(repair(&tables, 8 * C, read, write).unwrap().is_empty());
        assert_eq!(*writes.borrow(), 1);
        // No refcount block for the first clusters (header, tables): corrupt, refused.
        let no_refblock = vec![0u8; C as usize];
        let uncovered = Tables {
            reftable: &no_refblock,
            ..tables
        };
        let e = repair(&uncovered, 8 * C, read, write).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("the header at offset 0"), "{e}");
        assert_eq!(*writes.borrow(), 1, "nothing written");
        // Two refcount table entries for one block: corrupt, refused.
        let mut shared = reftable.clone();
        shared[8..16].copy_from_slice(&reftable[0..8]);
        let two = Tables {
            reftable: &shared,
            ..tables
        };
        let e = repair(&two, 8 * C, read, write).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(
            e.to_string()
                .contains(&format!("point at the refcount block at offset {}", 2 * C)),
            "{e}"
        );
        assert_eq!(*writes.borrow(), 1, "nothing written");
    }

    /// A refcount block may count clusters in use up to [`COUNTED_PAST_END_MAX`] past the end
    /// of the file (a range of 2 GiB at 64 KiB clusters and 16-bit refcounts: block 1 begins
    /// 2 GiB in), not beyond.
    #[test]
    fn clusters_counted_in_use_far_past_the_end_of_the_file_are_refused() {
        let (mut file, header) = image();
        let far_block = 7 * C;
        put(&mut file, C + 8, far_block); // reftable[1]: clusters from 2 GiB on
        let size = file.len() as u64;
        let refcounts = |file: &[u8], end: u64| {
            let read = |at: u64, len: usize| Ok(file[at as usize..at as usize + len].to_vec());
            let (l1, reftable) = (read(3 * C, 16).unwrap(), read(C, C as usize).unwrap());
            let tables = Tables {
                header: &header,
                l1: &l1,
                reftable: &reftable,
            };
            let mut written = false;
            let result = repair(&tables, end, read, |_, _| {
                written = true;
                Ok(())
            });
            (result, written)
        };
        // The block counts nothing: served (and the table at 4, and the block itself, are
        // counted again).
        let (result, _) = refcounts(&file, size);
        assert_eq!(result.unwrap(), vec![4 * C, far_block]);
        // It counts the cluster 2 GiB + 3 clusters in: refused, named, nothing written.
        set(&mut file[far_block as usize..], 3, 16, 1);
        let (result, written) = refcounts(&file, size);
        let e = result.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let at = (2 << 30) + 3 * C;
        assert!(
            e.to_string().contains(&format!(
                "refcount block at offset {far_block} counts the cluster at offset {at} in use"
            )) && e.to_string().contains("qemu-img check -r all"),
            "{e}"
        );
        assert!(!written, "nothing is written");
        // A file 1 GiB longer (as if its end were nearer): within the bound, served.
        let (result, _) = refcounts(&file, size + (1 << 30));
        assert!(result.is_ok());
        // With 1-bit refcounts a block counts 64 Ki * 8 clusters: block 1 begins 32 GiB in,
        // and its entry 3 is bit 3 of byte 0.
        let mut one_bit = vec![0u8; C as usize];
        set(&mut one_bit, 3, 1, 1);
        let read = |at: u64, len: usize| {
            let mut b = if at == far_block {
                one_bit.clone()
            } else {
                vec![0; len]
            };
            b.truncate(len);
            Ok(b)
        };
        let (cluster_bits, rb_bits) = (16, 16 + 3);
        let e = refuse_counts_far_past_the_end(
            &[2 * C, far_block],
            size,
            cluster_bits,
            rb_bits,
            1,
            &read,
        )
        .unwrap_err();
        let at = (32u64 << 30) + 3 * C;
        assert!(
            e.to_string().contains(&format!("cluster at offset {at}")),
            "{e}"
        );
        // A block past the end of the file reads as zeros: nothing to walk.
        let past = refuse_counts_far_past_the_end(
            &[2 * C, size + C],
            size,
            cluster_bits,
            rb_bits,
            1,
            &read,
        );
        assert!(past.is_ok());
    }
}
