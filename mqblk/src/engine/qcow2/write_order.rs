//! Which of imago's writes must be durable when they complete, so that qcow2's ordering rules
//! hold on stable storage, and which may stay in the device's cache until the next flush.
//!
//! imago keeps the rules by the order of its writes: a dependent write is issued only after
//! the write it depends on has completed (a refcount block before the L2 table that uses its
//! new cluster, a new L2 table before the L1 entry that points at it, a new refcount block
//! before the refcount table entry, the header last). Completed is not durable: a device with
//! a volatile cache may keep the L2 table and lose the refcount block in a power loss, and the
//! image then holds a cluster in use with a refcount of 0, which the allocator hands out again.
//! QEMU puts a flush between the two. Here a write that something written later may depend on
//! is written through (`RWF_DSYNC`, FUA where the device has it), and the others stay plain:
//!
//! - guest data ([`data_writes`](super::data_writes)), which includes the rest of a new
//!   cluster that a copy-on-write read from the backing image;
//! - an L2 table that the L1 table already points at, but only after a sync of the plain
//!   writes completed before it (`Plain { sync_first }`): its new entries point at clusters
//!   whose data was written plain, and an entry that reached the disk before its data would
//!   make the cluster read as whatever the file held there, not the backing image's data the
//!   copy-on-write put around the guest's (qcow2's rule: data before the L2 entry; QEMU
//!   flushes before writing an L2 table after a copy-on-write). imago writes back all of a
//!   group commit's L2 tables at once, so one sync covers them all.
//!
//! - a refcount block that the refcount table already points at, while no cluster may have
//!   been freed: refcounts then only grow, the L2 entries that rely on them are written after
//!   the sync above, which covers the block, and the group commit's one sync orders both.
//!
//! Nothing imago writes later relies on an L2 entry except the refcount decrement of a cluster
//! the entry stopped using. Clusters are freed only when a write replaces a compressed, shared
//! (internal snapshot) or preallocated zero cluster, or a range holding a compressed cluster is
//! zeroed (imago keeps the allocation of other zeroed clusters); once that may have happened
//! ([`WriteOrder::may_free`]), a write-through write first syncs the plain ones before it.
//!
//! Everything else is written through: a refcount block once clusters may be freed, the
//! refcount table, the header, the L1 table, and a new L2 table or refcount block (not in the
//! L1 or refcount table yet). Both tables are mirrored here from the image at open and from
//! imago's writes to them; a write to the header's cluster reloads them (should that fail,
//! every table is written through from then on, after a sync of the plain writes before it).
//!
//! What it costs a group commit is one sync, before its L2 tables (docs/PERFORMANCE.md 13b and
//! 13c).
//!
//! One gap is imago's: it writes a new L2 table and the L1 entry that points at it (and a new
//! refcount block and its refcount table entry) before the refcount block that counts the new
//! table's cluster (QEMU writes the refcount first). A crash before the allocating job's group
//! commit leaves the table counted free; [`refcount_repair`](super::refcount_repair) counts it
//! again when an export of the image next starts its first ring, before anything is allocated.

use std::collections::HashSet;
use std::sync::Mutex;

use super::early_maps::{Early, EarlyMaps};
use crate::format::qcow2::header::{table_entries, Tables};

/// How one write goes to the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// A plain write; `sync_first`: only after an `fdatasync` that makes the plain writes
    /// before it durable.
    Plain { sync_first: bool },
    /// Written through (durable when it completes); `sync_first`: only after an `fdatasync`
    /// that makes the plain writes before it durable.
    Through { sync_first: bool },
}

/// The image file's write ordering state (the top image's: backing images are never written).
#[derive(Debug)]
pub struct WriteOrder {
    cluster: u64,
    state: Mutex<State>,
    /// New clusters mapped ahead of their data: the L2 table writes wait for it.
    pub early: EarlyMaps,
}

#[derive(Debug)]
struct State {
    /// The L1 table's entries: the L2 tables.
    l1: Mirror,
    /// The refcount table's entries: the refcount blocks.
    reftable: Mirror,
    /// Plain writes completed (guest data and metadata).
    plain_done: u64,
    /// `plain_done` as the last sync began: those are durable.
    plain_synced: u64,
    /// Clusters may have been freed (see the module's text).
    frees: bool,
    /// The mirrors are the image's (false after the header changed and the tables could not
    /// be read again).
    mirrored: bool,
}

/// A table of cluster offsets (the L1 or refcount table) as the image file holds it.
#[derive(Debug, Default)]
struct Mirror {
    /// Where the table is in the file.
    offset: u64,
    /// Its entries (a file offset; 0: none).
    entries: Vec<u64>,
    /// The same, as a set.
    targets: HashSet<u64>,
}

impl Mirror {
    fn load(&mut self, offset: u64, bytes: &[u8], count: usize) {
        self.offset = offset;
        self.entries = table_entries(bytes).take(count).collect();
        self.targets = self.entries.iter().copied().filter(|&t| t != 0).collect();
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.targets.clear();
    }

    /// Takes the whole entries that `b`, written at `at`, holds.
    fn take(&mut self, at: u64, b: &[u8]) {
        let end = (at + b.len() as u64).min(self.offset + 8 * self.entries.len() as u64);
        let mut entry = at.max(self.offset).next_multiple_of(8);
        while entry + 8 <= end {
            let i = ((entry - self.offset) / 8) as usize;
            let within = (entry - at) as usize;
            let value = table_entries(&b[within..within + 8])
                .next()
                .expect("8 bytes");
            let old = std::mem::replace(&mut self.entries[i], value);
            if old != value {
                if old != 0 && !self.entries.contains(&old) {
                    self.targets.remove(&old);
                }
                if value != 0 {
                    self.targets.insert(value);
                }
            }
            entry += 8;
        }
    }
}

impl State {
    fn load(&mut self, cluster: u64, t: &Tables) {
        let h = t.header;
        self.l1.load(h.l1_offset, t.l1, h.l1_entries as usize);
        let reftable_entries = (u64::from(h.reftable_clusters) * cluster / 8) as usize;
        self.reftable
            .load(h.reftable_offset, t.reftable, reftable_entries);
        self.mirrored = true;
        // Internal snapshots share clusters: writes free them.
        self.frees |= h.snapshots > 0;
    }
}

impl WriteOrder {
    /// The ordering state of an image with `tables`.
    pub fn new(tables: &Tables) -> WriteOrder {
        let cluster = 1 << tables.header.cluster_bits;
        let mut state = State {
            l1: Mirror::default(),
            reftable: Mirror::default(),
            plain_done: 0,
            plain_synced: 0,
            frees: false,
            mirrored: false,
        };
        state.load(cluster, tables);
        WriteOrder {
            cluster,
            state: Mutex::new(state),
            early: EarlyMaps::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The table a write of `len` bytes at `offset` is into, if it is one of `mirror`'s.
    fn in_table_of(&self, mirror: &Mirror, offset: u64, len: u64) -> bool {
        let table = offset & !(self.cluster - 1);
        mirror.targets.contains(&table) && offset + len <= table + self.cluster
    }

    /// Whether a metadata write of `len` bytes at `offset` may hold L2 entries (and so must
    /// wait for [`EarlyMaps::settled`]): a write into an L2 table the L1 table points at (a
    /// new table holds no mapping before the L1 table points at it), or any, once the L1
    /// table is not known here.
    pub fn may_hold_mappings(&self, offset: u64, len: u64) -> bool {
        let s = self.state();
        !s.mirrored || self.in_table_of(&s.l1, offset, len)
    }

    /// Counts a data write into a cluster to be mapped ahead of it ([`EarlyMaps::begin`]);
    /// `None` when the L2 tables are not known here (their writes could not wait for it).
    pub fn begin_early(&self) -> Option<Early<'_>> {
        if !self.state().mirrored {
            return None;
        }
        self.early.begin()
    }

    /// How to write `len` bytes at `offset`; `data`: guest data.
    pub fn mode(&self, offset: u64, len: u64, data: bool) -> WriteMode {
        if data {
            return WriteMode::Plain { sync_first: false };
        }
        let s = self.state();
        let unsynced = s.plain_done != s.plain_synced;
        if !s.mirrored {
            // Any table may be an L2 table: after the data written before it, durable when
            // it completes.
            return WriteMode::Through {
                sync_first: unsynced,
            };
        }
        if self.in_table_of(&s.l1, offset, len) {
            return WriteMode::Plain {
                sync_first: unsynced,
            };
        }
        if !s.frees && self.in_table_of(&s.reftable, offset, len) {
            // Refcounts only grow: the sync before the next L2 table covers them.
            return WriteMode::Plain { sync_first: false };
        }
        WriteMode::Through {
            sync_first: s.frees && unsynced,
        }
    }

    /// A plain write (guest data or metadata) completed.
    pub fn wrote_plain(&self) {
        self.state().plain_done += 1;
    }

    /// The mark of the last sync that ended: the plain writes counted up to it are durable.
    pub fn synced_mark(&self) -> u64 {
        self.state().plain_synced
    }

    /// A sync of the file begins: the plain writes completed so far are durable once it ends.
    /// Returns the mark to give [`synced`](Self::synced).
    pub fn sync_begins(&self) -> u64 {
        self.state().plain_done
    }

    /// The sync that began at `mark` ended.
    pub fn synced(&self, mark: u64) {
        let mut s = self.state();
        s.plain_synced = s.plain_synced.max(mark);
    }

    /// A write-through of `bytes` at `offset` completed: the L1 and refcount table entries it
    /// set are taken. Returns whether it wrote into the header's cluster (the caller then
    /// [`reload`]s).
    ///
    /// [`reload`]: Self::reload
    pub fn wrote_through(&self, offset: u64, bytes: &[&[u8]]) -> bool {
        let mut s = self.state();
        let mut at = offset;
        for b in bytes {
            s.l1.take(at, b);
            s.reftable.take(at, b);
            at += b.len() as u64;
        }
        offset < self.cluster
    }

    /// The header changed: the tables are taken again.
    pub fn reload(&self, tables: &Tables) {
        self.state().load(self.cluster, tables);
    }

    /// The header changed and the tables could not be read again: every table is written
    /// through from now on, after a sync of the plain writes before it (any may be an L2
    /// table), and every metadata write waits for early mappings' data.
    pub fn reload_failed(&self) {
        let mut s = self.state();
        s.l1.clear();
        s.reftable.clear();
        s.mirrored = false;
    }

    /// Clusters may be freed from now on (a write replaced a cluster, or a range was zeroed):
    /// a write-through write first syncs the plain writes before it.
    pub fn may_free(&self) {
        self.state().frees = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::qcow2::header::Header;

    const C: u64 = 1 << 16;

    fn header(l1_offset: u64, l1_entries: u32, snapshots: u32) -> Header {
        Header {
            version: 3,
            cluster_bits: 16,
            size: 1 << 40,
            backing: None,
            backing_format: None,
            l1_offset,
            l1_entries,
            snapshots,
            reftable_offset: 0,
            reftable_clusters: 0,
            refcount_order: 4,
        }
    }

    fn order(header: &Header, l1: &[u8], reftable: &[u8]) -> WriteOrder {
        WriteOrder::new(&Tables {
            header,
            l1,
            reftable,
        })
    }

    fn l1(entries: &[u64]) -> Vec<u8> {
        entries
            .iter()
            .flat_map(|e| (e | 1 << 63).to_be_bytes())
            .collect()
    }

    #[test]
    fn only_guest_data_and_the_l2_tables_the_l1_table_points_at_are_written_plain() {
        let w = order(&header(3 * C, 4, 0), &l1(&[5 * C, 0, 6 * C, 0]), &[]);
        let through = WriteMode::Through { sync_first: false };
        let plain = WriteMode::Plain { sync_first: false };
        assert_eq!(w.mode(9 * C, C, true), plain, "guest data");
        assert_eq!(w.mode(5 * C, C, false), plain, "a known L2 table");
        assert_eq!(w.mode(6 * C + 4096, 512, false), plain, "part of one");
        assert_eq!(w.mode(6 * C, 2 * C, false), through, "beyond it");
        assert_eq!(
            w.mode(7 * C, C, false),
            through,
            "a new table or a refcount block"
        );
        assert_eq!(w.mode(3 * C, 512, false), through, "the L1 table");
        assert_eq!(w.mode(0, 4096, false), through, "the header");
    }

    #[test]
    fn a_new_l2_table_is_written_through_until_the_l1_table_points_at_it() {
        let w = order(&header(3 * C, 4, 0), &l1(&[5 * C, 0, 0, 0]), &[]);
        let through = WriteMode::Through { sync_first: false };
        let plain = WriteMode::Plain { sync_first: false };
        assert_eq!(w.mode(8 * C, C, false), through);
        // imago writes the entry (here: the aligned sector that holds entries 0..4).
        let sector = l1(&[5 * C, 8 * C, 0, 0]);
        assert!(!w.wrote_through(3 * C, &[&sector]));
        assert_eq!(w.mode(8 * C, C, false), plain);
        // Written in two buffers, one entry each, an entry replaced: the old table is no
        // longer plain.
        let (a, b) = (l1(&[9 * C]), l1(&[0]));
        w.wrote_through(3 * C + 8, &[&a, &b]);
        assert_eq!(w.mode(9 * C, C, false), plain);
        assert_eq!(w.mode(8 * C, C, false), through);
        // A header write says so.
        assert!(w.wrote_through(0, &[&[0u8; 512]]));
        w.reload(&Tables {
            header: &header(10 * C, 2, 0),
            l1: &l1(&[11 * C, 0]),
            reftable: &[],
        });
        assert_eq!(w.mode(11 * C, C, false), plain);
        assert_eq!(w.mode(5 * C, C, false), through);
    }

    #[test]
    fn once_clusters_may_be_freed_a_write_through_first_syncs_the_plain_writes() {
        let w = order(&header(3 * C, 1, 0), &l1(&[5 * C]), &[]);
        w.wrote_plain();
        assert_eq!(
            w.mode(7 * C, C, false),
            WriteMode::Through { sync_first: false },
            "nothing freed: a refcount only grows before the L2 entry"
        );
        w.may_free();
        assert_eq!(
            w.mode(7 * C, C, false),
            WriteMode::Through { sync_first: true }
        );
        let mark = w.sync_begins();
        w.wrote_plain(); // during the sync: not covered by it
        w.synced(mark);
        assert_eq!(
            w.mode(7 * C, C, false),
            WriteMode::Through { sync_first: true }
        );
        w.synced(w.sync_begins());
        assert_eq!(
            w.mode(7 * C, C, false),
            WriteMode::Through { sync_first: false }
        );
        // Internal snapshots: from the start.
        let w = order(&header(3 * C, 1, 1), &l1(&[5 * C]), &[]);
        w.wrote_plain();
        assert_eq!(
            w.mode(7 * C, C, false),
            WriteMode::Through { sync_first: true }
        );
    }

    #[test]
    fn an_l2_table_is_written_only_after_a_sync_of_the_data_written_before_it() {
        let w = order(&header(3 * C, 1, 0), &l1(&[5 * C]), &[]);
        assert_eq!(
            w.mode(5 * C, C, false),
            WriteMode::Plain { sync_first: false },
            "nothing written yet"
        );
        // A copy-on-write's data (the guest's and the backing image's rest) completed.
        assert_eq!(
            w.mode(9 * C, C, true),
            WriteMode::Plain { sync_first: false }
        );
        w.wrote_plain();
        assert_eq!(
            w.mode(5 * C, C, false),
            WriteMode::Plain { sync_first: true },
            "the entry that points at it must not reach the disk first"
        );
        let mark = w.sync_begins();
        w.synced(mark);
        assert_eq!(w.synced_mark(), mark);
        assert_eq!(
            w.mode(5 * C, C, false),
            WriteMode::Plain { sync_first: false }
        );
        // Nothing freed: a refcount block (or a new table) is written through without a sync.
        w.wrote_plain();
        assert_eq!(
            w.mode(7 * C, C, false),
            WriteMode::Through { sync_first: false }
        );
    }

    #[test]
    fn a_refcount_block_the_refcount_table_points_at_is_plain_until_clusters_may_be_freed() {
        // A refcount table of one cluster at 2C that points at a refcount block at 4C.
        let mut h = header(3 * C, 1, 0);
        (h.reftable_offset, h.reftable_clusters) = (2 * C, 1);
        let mut reftable = l1(&[4 * C]);
        reftable.resize(C as usize, 0);
        let w = order(&h, &l1(&[5 * C]), &reftable);
        let plain = WriteMode::Plain { sync_first: false };
        assert_eq!(w.mode(4 * C, C, false), plain, "refcounts only grow");
        // Written plain, it is covered by the sync before the next L2 table.
        w.wrote_plain();
        assert_eq!(
            w.mode(5 * C, C, false),
            WriteMode::Plain { sync_first: true }
        );
        // A new refcount block is written through until the refcount table points at it.
        assert_eq!(
            w.mode(8 * C, C, false),
            WriteMode::Through { sync_first: false }
        );
        assert!(!w.wrote_through(2 * C + 8, &[&l1(&[8 * C])]));
        assert_eq!(w.mode(8 * C, C, false), plain);
        // Once clusters may be freed, a decrement goes after the L2 entries before it.
        w.may_free();
        assert_eq!(
            w.mode(4 * C, C, false),
            WriteMode::Through { sync_first: true }
        );
    }

    #[test]
    fn only_writes_that_may_hold_l2_entries_wait_for_early_mappings() {
        let w = order(&header(3 * C, 2, 0), &l1(&[5 * C, 0]), &[]);
        assert!(w.may_hold_mappings(5 * C + 512, 512), "a known L2 table");
        assert!(
            !w.may_hold_mappings(7 * C, C),
            "a new table or a refcount block"
        );
        assert!(!w.may_hold_mappings(3 * C, 16), "the L1 table");
        let early = w.begin_early().expect("the tables are known");
        drop(early);
        // Once the tables are not known, every metadata write waits, and nothing is mapped
        // early.
        w.reload_failed();
        assert!(w.may_hold_mappings(7 * C, C));
        assert!(w.begin_early().is_none());
    }

    #[test]
    fn once_the_tables_are_not_known_every_table_goes_through_after_the_data_before_it() {
        let w = order(&header(3 * C, 1, 0), &l1(&[5 * C]), &[]);
        w.reload_failed();
        let through = |sync_first| WriteMode::Through { sync_first };
        assert_eq!(
            w.mode(5 * C, C, false),
            through(false),
            "nothing written yet"
        );
        // A new cluster's data, written plain: any table may map it.
        assert_eq!(
            w.mode(9 * C, C, true),
            WriteMode::Plain { sync_first: false }
        );
        w.wrote_plain();
        for table in [5 * C, 7 * C] {
            assert_eq!(w.mode(table, C, false), through(true), "at {table}");
        }
    }
}
