//! One I/O thread's cache of where guest clusters live in the image file.
//!
//! The fast path of a qcow2 export: a request whose clusters are all here, contiguous in the
//! file, becomes one entry on the thread's own ring at the file offset, exactly as a raw
//! image's request does. Only clusters allocated in the top image (writable in place: a write
//! there changes no metadata) are ever held; anything else (a cluster of a backing image, an
//! unallocated or zero cluster, a compressed one) takes the metadata path every time, because
//! a write elsewhere may allocate it at any moment.
//!
//! Direct-mapped: cluster `c` lives in slot `c % slots`, tagged with `c`. An image no larger
//! than the cache has one slot per cluster and nothing is ever evicted; a larger one evicts on
//! collision. No allocation or lock after it is built.

/// Where guest clusters are in the image file, for the clusters this thread has been told of.
pub struct MappingCache {
    cluster_bits: u32,
    /// `slots.len() - 1`: slots is a power of two.
    mask: u64,
    /// `(cluster + 1, file offset)`; a tag of 0 marks an empty slot.
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

    /// Records that `len` bytes of guest clusters from `guest` are at `host` in the file,
    /// contiguously, writable in place. Both offsets are cluster-aligned; a partial last
    /// cluster counts whole (the mapping is per cluster).
    pub fn insert(&mut self, guest: u64, host: u64, len: u64) {
        let first = guest >> self.cluster_bits;
        let count = len.div_ceil(1 << self.cluster_bits);
        for i in 0..count.min(self.capacity()) {
            let slot = self.slot(first + i);
            self.slots[slot] = (first + i + 1, host + (i << self.cluster_bits));
        }
    }

    /// The file offset of guest bytes `offset..offset + len` if every cluster they touch is
    /// held and the clusters follow each other in the file.
    #[inline]
    pub fn lookup(&self, offset: u64, len: u64) -> Option<u64> {
        let first = offset >> self.cluster_bits;
        let last = (offset + len.max(1) - 1) >> self.cluster_bits;
        let base = self.host_of(first)?;
        for c in first + 1..=last {
            if self.host_of(c)? != base + ((c - first) << self.cluster_bits) {
                return None;
            }
        }
        Some(base + (offset & ((1 << self.cluster_bits) - 1)))
    }

    /// Where the run from `offset` ends, at most `offset + len`: the last of the clusters
    /// that follow the first one in the file if it is held (one ring entry serves them), or
    /// the first held cluster after it if it is not (the metadata path serves the stretch).
    pub fn run_end(&self, offset: u64, len: u64) -> u64 {
        let end = offset + len;
        let first = offset >> self.cluster_bits;
        let first_host = self.host_of(first);
        let mut c = first + 1;
        while c << self.cluster_bits < end {
            let continues = match (first_host, self.host_of(c)) {
                (Some(h), Some(hc)) => hc == h + ((c - first) << self.cluster_bits),
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
    fn host_of(&self, cluster: u64) -> Option<u64> {
        let (tag, host) = self.slots[self.slot(cluster)];
        (tag == cluster + 1).then_some(host)
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

    #[test]
    fn a_request_maps_only_over_contiguous_held_clusters() {
        let mut m = MappingCache::new(16, 100, 4 << 20);
        assert_eq!(m.capacity(), 128);
        assert_eq!(m.lookup(0, 4096), None);
        m.insert(0, 10 * C, 2 * C);
        m.insert(5 * C, 3 * C, C);
        assert_eq!(m.lookup(4096, 4096), Some(10 * C + 4096));
        // Spanning clusters 0 and 1, which follow each other in the file.
        assert_eq!(m.lookup(C - 512, 1024), Some(11 * C - 512));
        // Cluster 2 is not held.
        assert_eq!(m.lookup(2 * C - 512, 1024), None);
        assert_eq!(m.lookup(5 * C + C - 4096, 4096), Some(4 * C - 4096));
        m.insert(6 * C, 9 * C, C);
        // Clusters 5 and 6 are both held but not contiguous in the file.
        assert_eq!(m.lookup(6 * C - 512, 1024), None);
    }

    #[test]
    fn runs_end_where_the_file_mapping_breaks() {
        let mut m = MappingCache::new(16, 64, 4 << 20);
        m.insert(0, 10 * C, 2 * C); // clusters 0-1 contiguous
        m.insert(2 * C, 40 * C, C); // cluster 2 elsewhere
                                    // clusters 3 and 4 not held; cluster 5 held
        m.insert(5 * C, 50 * C, C);
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
        m.insert(C, 100 * C, C);
        assert_eq!(m.lookup(C, 512), Some(100 * C));
        // Cluster 9 shares cluster 1's slot.
        assert_eq!(m.lookup(9 * C, 512), None);
        m.insert(9 * C, 200 * C, C);
        assert_eq!(m.lookup(9 * C, 512), Some(200 * C));
        assert_eq!(m.lookup(C, 512), None);
    }

    #[test]
    fn invalidation_forgets_exactly_the_range() {
        let mut m = MappingCache::new(16, 64, 4 << 20);
        m.insert(0, 0, 8 * C);
        m.invalidate(2 * C + 512, 512);
        assert_eq!(m.lookup(2 * C, 512), None);
        assert_eq!(m.lookup(C, 512), Some(C));
        assert_eq!(m.lookup(3 * C, 512), Some(3 * C));
        m.invalidate(0, 1 << 40);
        assert_eq!(m.lookup(3 * C, 512), None);
    }
}
