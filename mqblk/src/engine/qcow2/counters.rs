//! What a qcow2 export's metadata path has done, for the management API and the metrics: the
//! requests its worker performed, the group commits that wrote imago's tables back, and the
//! syncs of the image file, with the time each took. The time of a write-back or a sync is
//! what an allocating write waits for (with `metadata-commit=write`), so these say
//! how much of a slow allocating write is the store's sync latency.
//!
//! One set per export, kept across snapshots (each new top counts into the same set), so that
//! every counter only grows. Counted per job and per commit or sync, never per request on the
//! I/O threads' path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// A qcow2 export's metadata-path counters, as read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MetadataCounters {
    /// Requests the metadata worker performed (what the I/O threads' mapping caches could not
    /// serve: allocating writes, reads of backing images, zero or compressed clusters, the
    /// first access to a neighbourhood of clusters, flushes, discards and write-zeroes).
    pub requests: u64,
    /// Group commits that wrote imago's tables back to the image file before their requests
    /// completed (`metadata-commit=write`).
    pub write_backs: u64,
    /// Time spent in those write-backs, in nanoseconds (their syncs included).
    pub write_back_ns: u64,
    /// `fdatasync`s and `fsync`s of the image file: before the L2 tables of a write-back (so
    /// that new clusters' data is durable before the entries that map them), and a guest
    /// flush's.
    pub syncs: u64,
    /// Time spent in those syncs, in nanoseconds.
    pub sync_ns: u64,
    /// New clusters the worker built for a guest write of part of them (copy-on-write: the
    /// guest's data, and the rest from the backing image or zeros).
    pub cow_writes: u64,
    /// Of those, the ones written only in the guest's part: the rest was zeros and the cluster
    /// landed in file space that reads as zeros (`fresh_space`).
    pub cow_writes_in_part: u64,
}

impl MetadataCounters {
    /// Adds `other`'s counts (several exports' summed).
    pub fn add(&mut self, other: &MetadataCounters) {
        let MetadataCounters {
            requests,
            write_backs,
            write_back_ns,
            syncs,
            sync_ns,
            cow_writes,
            cow_writes_in_part,
        } = other;
        self.requests += requests;
        self.write_backs += write_backs;
        self.write_back_ns += write_back_ns;
        self.syncs += syncs;
        self.sync_ns += sync_ns;
        self.cow_writes += cow_writes;
        self.cow_writes_in_part += cow_writes_in_part;
    }
}

/// The live counters, shared by an export's engine and each top image it serves.
#[derive(Debug, Default)]
pub struct Counters {
    requests: AtomicU64,
    write_backs: AtomicU64,
    write_back_ns: AtomicU64,
    syncs: AtomicU64,
    sync_ns: AtomicU64,
    cow_writes: AtomicU64,
    cow_writes_in_part: AtomicU64,
}

impl Counters {
    /// The worker performed a request.
    pub fn performed(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// A write-back that began at `began` ended.
    pub fn wrote_back(&self, began: Instant) {
        self.write_backs.fetch_add(1, Ordering::Relaxed);
        self.write_back_ns
            .fetch_add(nanos_since(began), Ordering::Relaxed);
    }

    /// A sync of the image file that began at `began` ended.
    pub fn synced(&self, began: Instant) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.sync_ns
            .fetch_add(nanos_since(began), Ordering::Relaxed);
    }

    /// A new cluster was written for a guest write of part of it; `in_part`: only that part.
    pub fn wrote_cow(&self, in_part: bool) {
        self.cow_writes.fetch_add(1, Ordering::Relaxed);
        if in_part {
            self.cow_writes_in_part.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What they say now.
    pub fn load(&self) -> MetadataCounters {
        MetadataCounters {
            requests: self.requests.load(Ordering::Relaxed),
            write_backs: self.write_backs.load(Ordering::Relaxed),
            write_back_ns: self.write_back_ns.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            sync_ns: self.sync_ns.load(Ordering::Relaxed),
            cow_writes: self.cow_writes.load(Ordering::Relaxed),
            cow_writes_in_part: self.cow_writes_in_part.load(Ordering::Relaxed),
        }
    }
}

fn nanos_since(began: Instant) -> u64 {
    u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
