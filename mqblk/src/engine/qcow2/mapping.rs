//! One I/O thread's cache of where guest clusters are: in which image of the chain, at which
//! offset of its file, or nowhere (they read as zeros).
//!
//! The fast path of a qcow2 export: a request whose clusters are all here, following each other
//! in one file, becomes one entry on the thread's own ring at the file offset, exactly as a
//! raw image's request does; a read of clusters that read as zeros is answered at once. A
//! write goes this way only to clusters allocated in the top image and writable in place (it
//! changes no metadata); everything else (allocation, copy-on-write, compressed clusters) takes
//! the metadata path. A write there may allocate a cluster other threads hold as "in a backing
//! file" or "zeros": it invalidates that range in every thread's cache before it completes.
//!
//! Direct-mapped: cluster `c` lives in slot `c % slots`, tagged with `c`. An image no larger
//! than the cache has one slot per cluster and nothing is ever evicted; a larger one evicts on
//! collision. No allocation or lock after it is built.

use crate::format::qcow2::MAX_CHAIN;

/// Where a run of guest clusters is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// In the file of image `layer` of the chain (0: the top), at `offset`; `writable`: a
    /// write may go there in place (top image, cluster not shared).
    File {
        /// The image, counted from the top.
        layer: u8,
        /// The file offset.
        offset: u64,
        /// Whether a write may go there.
        writable: bool,
    },
    /// Nowhere: the clusters read as zeros.
    Zeros,
}

/// The deepest layer whose clusters can be held: every chain mqblk opens, whose images are at
/// most [`MAX_CHAIN`] (a deeper layer would take the metadata path).
pub const MAX_LAYERS: u8 = 126;
const _: () = assert!(MAX_CHAIN <= MAX_LAYERS as usize + 1);

/// A slot's value: bit 63 writable, bits 56..63 the layer (`ZERO_LAYER`: zeros), bits 0..56
/// the file offset.
const ZERO_LAYER: u64 = 127;
const OFFSET_BITS: u32 = 56;
const WRITABLE: u64 = 1 << 63;

impl Target {
    /// Packs it, if it can be held.
    fn pack(self) -> Option<u64> {
        match self {
            Target::Zeros => Some(ZERO_LAYER << OFFSET_BITS),
            Target::File {
                layer,
                offset,
                writable,
            } => (layer <= MAX_LAYERS && offset >> OFFSET_BITS == 0).then(|| {
                u64::from(layer) << OFFSET_BITS | offset | if writable { WRITABLE } else { 0 }
            }),
        }
    }

    fn unpack(v: u64) -> Target {
        match (v >> OFFSET_BITS) & 0x7f {
            ZERO_LAYER => Target::Zeros,
            layer => Target::File {
                layer: layer as u8,
                offset: v & ((1 << OFFSET_BITS) - 1),
                writable: v & WRITABLE != 0,
            },
        }
    }

    /// The same target `bytes` further on.
    pub(super) fn advance(self, bytes: u64) -> Target {
        match self {
            Target::Zeros => Target::Zeros,
            Target::File {
                layer,
                offset,
                writable,
            } => Target::File {
                layer,
                offset: offset + bytes,
                writable,
            },
        }
    }
}

/// Where guest clusters are, for the clusters this thread has been told of.
pub struct MappingCache {
    cluster_bits: u32,
    /// `slots.len() - 1`: slots is a power of two.
    mask: u64,
    /// `(cluster + 1, packed target)`; a tag of 0 marks an empty slot.
    slots: Box<[(u64, u64)]>,
}

impl MappingCache {
    /// A cache for an image of `clusters` clusters of `1 << cluster_bits` bytes, holding at
    /// most `budget_bytes / 8` clusters (QEMU's l2-cache-size measure: one 8-byte L2 entry
    /// per cluster).
    pub fn new(cluster_bits: u32, clusters: u64, budget_bytes: u64) -> Self {
        let most = prev_power_of_two((budget_bytes / 8).max(1));
        let slots = clusters.max(1).next_power_of_two().min(most);
        MappingCache {
            cluster_bits,
            mask: slots - 1,
            slots: vec![(0, 0); slots as usize].into_boxed_slice(),
        }
    }

    /// How many clusters it can hold.
    pub fn capacity(&self) -> u64 {
        self.mask + 1
    }

    fn slot(&self, cluster: u64) -> usize {
        (cluster & self.mask) as usize
    }

    /// Records that `len` bytes of guest clusters from `guest` (cluster-aligned) are at
    /// `target`, contiguously; a partial last cluster counts whole.
    pub fn insert(&mut self, guest: u64, target: Target, len: u64) {
        let first = guest >> self.cluster_bits;
        let count = len.div_ceil(1 << self.cluster_bits);
        for i in 0..count.min(self.capacity()) {
            let Some(v) = target.advance(i << self.cluster_bits).pack() else {
                return;
            };
            let slot = self.slot(first + i);
            self.slots[slot] = (first + i + 1, v);
        }
    }

    /// Where guest bytes `offset..offset + len` are, if every cluster they touch is held and
    /// the clusters follow each other in one file (or all read as zeros); for a write, only
    /// if they are writable in place.
    #[inline]
    pub fn lookup(&self, offset: u64, len: u64, write: bool) -> Option<Target> {
        let first = offset >> self.cluster_bits;
        let last = (offset + len.max(1) - 1) >> self.cluster_bits;
        let base = self.target_of(first)?;
        if write && !matches!(base, Target::File { writable: true, .. }) {
            return None;
        }
        for c in first + 1..=last {
            if self.target_of(c)? != base.advance((c - first) << self.cluster_bits) {
                return None;
            }
        }
        Some(base.advance(offset & ((1 << self.cluster_bits) - 1)))
    }

    /// Where the run from `offset` ends, at most `offset + len`: after the clusters that
    /// follow the first one in its file (or read as zeros with it) if it is held (one ring
    /// entry, or one answer, serves them), or at the first held cluster after it if it is not
    /// (the metadata path serves the stretch).
    pub fn run_end(&self, offset: u64, len: u64) -> u64 {
        let end = offset + len;
        let first = offset >> self.cluster_bits;
        let base = self.target_of(first);
        let mut c = first + 1;
        while c << self.cluster_bits < end {
            let continues = match (base, self.target_of(c)) {
                (Some(b), Some(t)) => t == b.advance((c - first) << self.cluster_bits),
                (None, None) => true,
                _ => false,
            };
            if !continues {
                return c << self.cluster_bits;
            }
            c += 1;
        }
        end
    }

    #[inline]
    fn target_of(&self, cluster: u64) -> Option<Target> {
        let (tag, v) = self.slots[self.slot(cluster)];
        (tag == cluster + 1).then(|| Target::unpack(v))
    }

    /// Forgets the clusters that guest bytes `offset..offset + len` touch.
    pub fn invalidate(&mut self, offset: u64, len: u64) {
        let first = offset >> self.cluster_bits;
        let count = (offset + len.max(1) - 1) / (1 << self.cluster_bits) - first + 1;
        if count >= self.capacity() {
            return self.clear();
        }
        for c in first..first + count {
            let slot = self.slot(c);
            if self.slots[slot].0 == c + 1 {
                self.slots[slot] = (0, 0);
            }
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.slots.fill((0, 0));
    }
}

fn prev_power_of_two(n: u64) -> u64 {
    1 << (63 - n.leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: u64 = 64 << 10;

    fn top(offset: u64) -> Target {
        Target::File {
            layer: 0,
            offset,
            writable: true,
        }
    }

    fn backing(offset: u64) -> Target {
        Target::File {
            layer: 1,
            offset,
            writable: false,
        }
    }

    #[test]
    fn a_request_maps_only_over_contiguous_held_clusters() {
        let mut m = MappingCache::new(16, 100, 4 << 20);
        assert_eq!(m.capacity(), 128);
        assert_eq!(m.lookup(0, 4096, false), None);
        m.insert(0, top(10 * C), 2 * C);
        m.insert(5 * C, top(3 * C), C);
        assert_eq!(m.lookup(4096, 4096, true), Some(top(10 * C + 4096)));
        // Spanning clusters 0 and 1, which follow each other in the file.
        assert_eq!(m.lookup(C - 512, 1024, true), Some(top(11 * C - 512)));
        // Cluster 2 is not held.
        assert_eq!(m.lookup(2 * C - 512, 1024, false), None);
        assert_eq!(
            m.lookup(5 * C + C - 4096, 4096, true),
            Some(top(4 * C - 4096))
        );
        m.insert(6 * C, top(9 * C), C);
        // Clusters 5 and 6 are both held but not contiguous in the file.
        assert_eq!(m.lookup(6 * C - 512, 1024, false), None);
    }

    #[test]
    fn backing_and_zero_clusters_serve_reads_only() {
        let mut m = MappingCache::new(16, 64, 4 << 20);
        m.insert(0, backing(7 * C), 2 * C);
        m.insert(2 * C, Target::Zeros, 3 * C);
        assert_eq!(m.lookup(C + 512, 512, false), Some(backing(8 * C + 512)));
        assert_eq!(m.lookup(C + 512, 512, true), None);
        assert_eq!(m.lookup(2 * C + 512, 2 * C, false), Some(Target::Zeros));
        assert_eq!(m.lookup(3 * C, 512, true), None);
        // A backing cluster next to a zero one: two runs.
        assert_eq!(m.lookup(2 * C - 512, 1024, false), None);
        assert_eq!(m.run_end(C, 4 * C), 2 * C);
        assert_eq!(m.run_end(2 * C, 8 * C), 5 * C);
        // The same offset in another image is another place.
        m.insert(5 * C, top(9 * C), C);
        assert_eq!(m.lookup(5 * C, 512, true), Some(top(9 * C)));
        assert_eq!(m.run_end(4 * C, 2 * C), 5 * C);
        // What cannot be held is not: an offset beyond 2^56.
        m.insert(6 * C, top(1 << 60), C);
        assert_eq!(m.lookup(6 * C, 512, false), None);
    }

    #[test]
    fn runs_end_where_the_file_mapping_breaks() {
        let mut m = MappingCache::new(16, 64, 4 << 20);
        m.insert(0, top(10 * C), 2 * C); // clusters 0-1 contiguous
        m.insert(2 * C, top(40 * C), C); // cluster 2 elsewhere
                                         // clusters 3 and 4 not held; cluster 5 held
        m.insert(5 * C, top(50 * C), C);
        assert_eq!(m.run_end(4096, 8 * C), 2 * C);
        assert_eq!(m.run_end(2 * C, 8 * C), 3 * C);
        assert_eq!(m.run_end(3 * C + 512, 8 * C), 5 * C);
        assert_eq!(m.run_end(5 * C, 4096), 5 * C + 4096);
        assert_eq!(m.run_end(4096, 4096), 8192);
    }

    #[test]
    fn collisions_evict_and_tags_tell_clusters_apart() {
        // Budget of 8 entries (64 bytes) for an image of 1000 clusters.
        let mut m = MappingCache::new(16, 1000, 64);
        assert_eq!(m.capacity(), 8);
        m.insert(C, top(100 * C), C);
        assert_eq!(m.lookup(C, 512, true), Some(top(100 * C)));
        // Cluster 9 shares cluster 1's slot.
        assert_eq!(m.lookup(9 * C, 512, false), None);
        m.insert(9 * C, top(200 * C), C);
        assert_eq!(m.lookup(9 * C, 512, true), Some(top(200 * C)));
        assert_eq!(m.lookup(C, 512, false), None);
    }

    #[test]
    fn invalidation_forgets_exactly_the_range() {
        let mut m = MappingCache::new(16, 64, 4 << 20);
        m.insert(0, top(0), 8 * C);
        m.invalidate(2 * C + 512, 512);
        assert_eq!(m.lookup(2 * C, 512, false), None);
        assert_eq!(m.lookup(C, 512, false), Some(top(C)));
        assert_eq!(m.lookup(3 * C, 512, false), Some(top(3 * C)));
        m.invalidate(0, 1 << 40);
        assert_eq!(m.lookup(3 * C, 512, false), None);
    }
}
