//! The qcow2 format as far as mqblk reads it itself: the header of each image of a chain
//! ([`header`]), and why an image cannot be served ([`Qcow2Error`], which the qcow2 engine
//! uses for its own failures too). The format is served by
//! [`engine::qcow2`](../../engine/qcow2/index.html), through imago.

pub mod header;

use std::io;
use std::path::{Path, PathBuf};

/// Where mqblk keeps the metadata journal of the qcow2 image at `image` (which must exist) with
/// `metadata-commit=journal` or `auto`: in its user's journals' directory in the state directory
/// ([`state_dir`](crate::config::state_dir)), named after the image file's device and inode, so
/// that nothing is left beside the image (where libvirt's directory pools would list it) and a
/// rename of the image keeps its journal. The engine's `mapping_journal` says what it holds.
pub fn journal_path(image: &Path) -> io::Result<PathBuf> {
    Ok(journal_path_of(&std::fs::metadata(image)?))
}

/// [`journal_path`] of the image file whose metadata is `image`.
pub fn journal_path_of(image: &std::fs::Metadata) -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    crate::config::state_dir::qcow2_journals().join(format!(
        "{:x}-{:x}.journal",
        image.dev(),
        image.ino()
    ))
}

/// The most images a backing chain may hold, the top included. imago (0.2.6) follows a chain
/// by recursion, a stack frame or more per image: when a queue starts (its cache
/// invalidation, from the vhost-user thread), when the metadata worker asks for the chain's
/// alignment (each write on the metadata path, and each copy-on-write from a backing image),
/// and when a chain is dropped (a snapshot, the export's end). (Its lookup of a mapping
/// through the chain is a loop.)
/// Served to a frontend, a chain of 500 images overflowed a debug build's 2 MiB thread stack
/// and one of 2,000 a release build's (2026-11-27), and a stack overflow aborts the whole
/// daemon; 200 and 1,000 were served. 127 is also what each I/O thread's cluster cache can
/// name ([`engine::qcow2`](../../engine/qcow2/index.html)'s mapping, 7 bits of layer).
pub const MAX_CHAIN: usize = 127;

/// The L2 tables imago (0.2.6) keeps in memory for each image of a chain, whatever their
/// cluster size (`qcow2/mod.rs`: `MetadataCaches::new(.., 128, 32)`); with each image's L1
/// table, which imago reads whole at open, what a chain's tables may take, which
/// `table-memory-max=` bounds
/// ([`DEFAULT_TABLE_MEMORY_MAX`](crate::config::qcow2::DEFAULT_TABLE_MEMORY_MAX) says why).
pub const IMAGO_CACHED_L2_TABLES: u64 = 128;

/// Why a qcow2 image cannot be served. Each message is one line for the operator.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    /// The header is not one mqblk can read.
    #[error("{path} is not a qcow2 image mqblk can serve: {why} (a raw image needs format=raw)")]
    BadHeader {
        /// The image.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// The dirty bit: the image was not closed cleanly, its refcounts may be wrong.
    #[error("{0} is marked dirty (it was not closed cleanly and its refcounts may be wrong; if mqblk served it with metadata-commit=flush, the writes into new clusters acknowledged since the guest's last flush are lost): repair it with `qemu-img check -r all {0}` first")]
    Dirty(String),
    /// The corrupt bit.
    #[error(
        "{0} is marked corrupt: repair it with `qemu-img check -r all {0}` (or restore it) first"
    )]
    Corrupt(String),
    /// An incompatible feature mqblk does not serve.
    #[error("{path} uses a qcow2 feature mqblk cannot serve ({feature}): convert it with `qemu-img convert -O qcow2` first")]
    Unserved {
        /// The image.
        path: String,
        /// The feature.
        feature: String,
    },
    /// Encryption.
    #[error("{0} is encrypted, which mqblk does not serve: decrypt it with `qemu-img convert` (or serve it with qemu-storage-daemon)")]
    Encrypted(String),
    /// A backing file that is not there.
    #[error("the backing file of {image}, {backing}, does not exist")]
    MissingBacking {
        /// The image naming it.
        image: String,
        /// Where it was looked for.
        backing: String,
    },
    /// `metadata-commit=flush` or `journal` on a version 2 image, which has no dirty bit to
    /// mark it with.
    #[error("{0} is a qcow2 version 2 image, and metadata-commit=flush and journal need version 3 (they mark the image dirty between flushes): upgrade it with `qemu-img amend -o compat=1.1 {0}`, or serve it with metadata-commit=write")]
    FlushCommitNeedsV3(String),
    /// An image a crash left marked, served with `metadata-commit=journal`, whose journal is
    /// not there.
    #[error("{image} is marked dirty and its metadata journal {journal} is missing (a daemon with another --state-dir keeps it there: serve the image with that one); without it the writes into new clusters acknowledged since the guest's last flush are lost; repair the image with `qemu-img check -r all {image}` first")]
    JournalMissing {
        /// The image.
        image: String,
        /// Where its journal should be.
        journal: String,
    },
    /// An image a crash of mqblk in `metadata-commit=journal` left marked, opened in another
    /// mode, which would not replay the journal (nor would a repair).
    #[error("{image} is marked dirty by a crash of mqblk serving it with metadata-commit=journal, and its metadata journal {journal} holds the mappings of the writes into new clusters acknowledged since the guest's last flush: replay them with `mqblk replay-journal {image}`, or serve it with metadata-commit=journal, which replays them too (`qemu-img check -r all` would drop them)")]
    MarkedByJournal {
        /// The image.
        image: String,
        /// Its journal.
        journal: String,
    },
    /// A backing chain that comes back to itself.
    #[error("the backing chain loops: {0}")]
    BackingLoop(String),
    /// A backing chain of more than [`MAX_CHAIN`] images.
    #[error("the backing chain of {0} holds more than {MAX_CHAIN} images: shorten it with `qemu-img commit` or `qemu-img rebase` first")]
    ChainTooDeep(String),
    /// A backing chain whose tables could take more than `table-memory-max=`.
    #[error("the backing chain of {image} could hold at least {mib} MiB of tables in memory (each image's L1 table, and {IMAGO_CACHED_L2_TABLES} of its clusters), more than table-memory-max={max_mib}M: shorten it with `qemu-img commit` or `qemu-img rebase`, convert its images to smaller clusters, or raise table-memory-max")]
    ChainTablesTooLarge {
        /// The top image.
        image: String,
        /// What its tables could take, in MiB, as far as the chain was followed (it stops
        /// at the first image past the bound).
        mib: u64,
        /// `table-memory-max`, in MiB.
        max_mib: u64,
    },
    /// A backing file name that is a protocol or JSON description.
    #[error("the backing file of {image} is {backing:?}, which is not a path mqblk can open")]
    BackingNotAPath {
        /// The image.
        image: String,
        /// The recorded name.
        backing: String,
    },
    /// A backing format other than raw or qcow2.
    #[error(
        "the backing file of {image} has format {format}; mqblk serves raw and qcow2 backing files"
    )]
    BackingFormat {
        /// The image.
        image: String,
        /// The recorded format.
        format: String,
    },
    /// backing= names another backing file than the existing image has.
    #[error("{image} exists with backing file {recorded}, not {given}: drop backing= to serve it as it is")]
    BackingDiffers {
        /// The image.
        image: String,
        /// backing= value.
        given: String,
        /// What the header records.
        recorded: String,
    },
    /// A snapshot's overlay path is taken.
    #[error("{0} exists: a snapshot creates a new overlay, give a path that does not exist")]
    SnapshotExists(String),
    /// A new image needs a size.
    #[error("image {0} does not exist: pass size=BYTES (or backing=) to have mqblk create it")]
    SizeNeeded(String),
    /// Clusters smaller than the storage's O_DIRECT block.
    #[error("{path} has {cluster}-byte clusters, below the {block}-byte blocks O_DIRECT needs there: pass direct=off")]
    ClusterBelowBlock {
        /// The image.
        path: String,
        /// Its cluster size.
        cluster: u64,
        /// The storage's block size.
        block: u32,
    },
    /// Any other I/O error, with context.
    #[error("{what} {path}: {err}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: String,
        /// The error.
        err: io::Error,
    },
}
