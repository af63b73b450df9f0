//! An export's image format (`format=`) and the settings only a qcow2 image takes: the backing
//! image of a new overlay, the cluster size of a new image, and how much of the cluster mapping
//! each I/O thread keeps. The names follow qemu-img and QEMU's qcow2 driver (`backing_file`,
//! `cluster_size`, `l2-cache-size`), so an operator's numbers carry over.

use std::path::PathBuf;

use super::ConfigError;

/// How the bytes of `path` are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageFormat {
    /// The file or device is the disk, byte for byte (the default). Never probed: a raw image
    /// whose first bytes look like a qcow2 header stays raw, as QEMU's `format=raw` does.
    #[default]
    Raw,
    /// A qcow2 image (v2 or v3), possibly an overlay over a backing chain.
    Qcow2,
}

/// The format of a backing image named by `backing-format=`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingFormat {
    /// A raw file or device.
    Raw,
    /// A qcow2 image (with its own backing chain, if it has one).
    Qcow2,
}

impl BackingFormat {
    /// The name qcow2 headers record (the backing format header extension).
    pub fn name(self) -> &'static str {
        match self {
            BackingFormat::Raw => "raw",
            BackingFormat::Qcow2 => "qcow2",
        }
    }
}

/// When the metadata a write changed (the L2 entry of a new cluster, its refcount) reaches the
/// image file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetadataCommit {
    /// `Journal` where the image can be marked (version 3) and its journal kept (in the state
    /// directory), else `Write` (the default). Either keeps the promise that a crash of mqblk
    /// loses no acknowledged write; the image's open says which it took.
    #[default]
    Auto,
    /// Before the write completes: a crash of mqblk loses no acknowledged write, which a guest
    /// that outlives it through a reconnect relies on.
    Write,
    /// At the guest's next flush, as QEMU's qcow2 driver does: a crash of mqblk loses the
    /// writes into new clusters acknowledged since that flush. The image is marked dirty on
    /// file meanwhile, so that a crashed daemon's image is refused, naming the loss, rather than
    /// served behind what its guest was told.
    Flush,
    /// At the guest's next flush too, with each new cluster's mapping recorded before its write
    /// completes in a journal file in the state directory, which a daemon serving the image
    /// after a crash replays: a crash of mqblk loses no acknowledged write, as with `Write`,
    /// and a power loss leaves the image as of its last write-back, as with `Flush`
    /// (`engine::qcow2::mapping_journal`).
    Journal,
}

impl MetadataCommit {
    /// Whether the tables are written back at the guest's flush (and the image marked dirty
    /// meanwhile), rather than before each write completes. `Auto` is resolved to `Journal` or
    /// `Write` when the image opens, before this is asked.
    pub fn at_flush(self) -> bool {
        matches!(self, MetadataCommit::Flush | MetadataCommit::Journal)
    }

    /// Whether the image's mappings may be recorded in a journal.
    pub fn may_journal(self) -> bool {
        matches!(self, MetadataCommit::Auto | MetadataCommit::Journal)
    }
}

/// A new image's cluster size unless `cluster-size=` says otherwise (qemu-img's default).
pub const DEFAULT_CLUSTER_SIZE: u32 = 64 << 10;

/// The smallest and largest cluster sizes qcow2 allows.
pub const CLUSTER_SIZES: (u32, u32) = (512, 2 << 20);

/// `l2-cache-size=` unless given: 4 MiB of mapping entries (8 bytes per cluster, QEMU's
/// measure), which covers a 32 GiB image at 64 KiB clusters. Each I/O thread sizes its cache
/// to the image, so a smaller image takes less.
pub const DEFAULT_L2_CACHE_SIZE: u64 = 4 << 20;

/// The largest `l2-cache-size=` (1 GiB: 128 Ki clusters of mapping per MiB).
pub const MAX_L2_CACHE_SIZE: u64 = 1 << 30;

/// `table-memory-max=` unless given: the most memory the tables of an export's chain may take
/// in imago (`format::qcow2::IMAGO_CACHED_L2_TABLES` says what they are). Each image is
/// bounded by its header's checks (an L1 table of at most 32 MiB, clusters of at most 2 MiB:
/// 288 MiB), but a chain of `MAX_CHAIN` small files, each declaring the largest of both, could
/// make imago hold 36 GiB once a guest's reads reach their tables (20 such images took a
/// daemon to 4.8 GiB: docs/RELIABILITY.md): one image, often a tenant's upload, would take the
/// host's memory from every other export. 2 GiB takes a chain of `MAX_CHAIN` images with
/// 64 KiB clusters (8 MiB of L2 tables each, 1 GiB in all), or 7 with 2 MiB clusters.
pub const DEFAULT_TABLE_MEMORY_MAX: u64 = 2 << 30;

/// The range of `table-memory-max=`: from what one image of 64 KiB clusters takes (8 MiB of L2
/// tables and its L1 table) to 1 TiB.
pub const TABLE_MEMORY_MAX_RANGE: (u64, u64) = (16 << 20, 1 << 40);

/// The qcow2 settings of an export (`format=qcow2`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qcow2Config {
    /// Create the image, when `path` does not exist, as an overlay over this image.
    pub backing: Option<PathBuf>,
    /// The format of `backing` (required with it: the backing image is never probed).
    pub backing_format: Option<BackingFormat>,
    /// Cluster size in bytes of an image mqblk creates.
    pub cluster_size: u32,
    /// Bytes of cluster mapping each I/O thread caches (8 bytes per cluster).
    pub l2_cache_size: u64,
    /// The most memory the tables of the image's chain may take in imago.
    pub table_memory_max: u64,
    /// When the metadata of a write into a new cluster reaches the image file.
    pub metadata_commit: MetadataCommit,
}

impl Default for Qcow2Config {
    fn default() -> Self {
        Qcow2Config {
            backing: None,
            backing_format: None,
            cluster_size: DEFAULT_CLUSTER_SIZE,
            l2_cache_size: DEFAULT_L2_CACHE_SIZE,
            table_memory_max: DEFAULT_TABLE_MEMORY_MAX,
            metadata_commit: MetadataCommit::Auto,
        }
    }
}

/// The names of the keys that only `format=qcow2` takes.
pub const KEYS: &[&str] = &[
    "backing",
    "backing-format",
    "cluster-size",
    "l2-cache-size",
    "table-memory-max",
    "metadata-commit",
];

/// Whether `n` is a cluster size qcow2 allows.
pub fn valid_cluster_size(n: u64) -> bool {
    n.is_power_of_two() && (u64::from(CLUSTER_SIZES.0)..=u64::from(CLUSTER_SIZES.1)).contains(&n)
}

impl Qcow2Config {
    /// What the keys of a qcow2 export require of each other.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        match (&self.backing, self.backing_format) {
            (Some(_), None) => Err(ConfigError::Required(
                "backing-format=raw|qcow2 is required with backing= (mqblk does not guess a \
                 backing image's format)",
            )),
            (None, Some(_)) => Err(ConfigError::Required(
                "backing-format= is given without backing=PATH (the image the new overlay is \
                 created over)",
            )),
            _ => Ok(()),
        }
    }
}
