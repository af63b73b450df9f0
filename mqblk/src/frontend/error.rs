//! Why the frontend session refuses a vhost-user message. Each message is the log line; the
//! frontend gets the protocol's failure reply (or, for messages that need an answer, the
//! connection is closed).

use vhost::vhost_user::Error as VhuError;

/// A refused vhost-user message.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A vring index beyond the export's queues.
    #[error("vring index {0} is beyond the export's queues")]
    NoSuchQueue(u32),
    /// SET_VRING_NUM with a size of 0, above the maximum, or not a power of two.
    #[error("queue size {num} refused: a power of two from 1 to {max}")]
    QueueSize {
        /// The size asked for.
        num: u32,
        /// The export's queue-size.
        max: u16,
    },
    /// The export's queue size, refused by virtio-queue (not a power of two up to 32768).
    #[error("{0:?}")]
    QueueSetup(virtio_queue::Error),
    /// A vring whose size or addresses do not fit guest memory, found as its queue starts.
    #[error("the frontend gave an invalid ring (size or addresses)")]
    InvalidRing,
    /// Ring addresses that do not translate into guest memory.
    #[error("ring address {0:#x} is not in any memory region")]
    UnmappedAddress(u64),
    /// Ring addresses without the alignment VIRTIO 2.7 requires.
    #[error("misaligned ring addresses (desc {desc:#x}, avail {avail:#x}, used {used:#x})")]
    MisalignedRing {
        /// Descriptor table.
        desc: u64,
        /// Avail ring.
        avail: u64,
        /// Used ring.
        used: u64,
    },
    /// Features acked that were not offered.
    #[error("features {0:#x} acked but not offered")]
    UnofferedFeatures(u64),
    /// A memory region of size 0, past the end of its file, or that cannot be mapped.
    #[error("memory region refused: {0}")]
    BadRegion(String),
    /// A memory table whose regions overlap or cannot be combined, or a region to remove that
    /// is not there.
    #[error("memory table refused: {0}")]
    BadMemoryTable(String),
    /// More memory regions than CONFIGURE_MEM_SLOTS allows.
    #[error("more than {0} memory regions")]
    TooManyRegions(u64),
    /// An in-flight region description that does not fit the export.
    #[error("{what} with {num_queues} queues of size {queue_size} does not fit the export")]
    InflightShape {
        /// GET_INFLIGHT_FD or SET_INFLIGHT_FD.
        what: &'static str,
        /// Queues described.
        num_queues: u16,
        /// Their size.
        queue_size: u16,
    },
    /// An in-flight region that cannot be created or mapped.
    #[error("in-flight region: {0}")]
    Inflight(std::io::Error),
    /// GET_CONFIG or SET_CONFIG outside the configuration space, or a write to a read-only
    /// field.
    #[error("config access at offset {offset}, {len} bytes, refused")]
    ConfigAccess {
        /// Offset.
        offset: u32,
        /// Length.
        len: usize,
    },
    /// A dirty log (SET_LOG_BASE) that cannot be mapped safely.
    #[error("dirty log refused: {0}")]
    DirtyLog(#[from] crate::io::dirty_log::LogError),
    /// A dirty log that does not cover guest memory.
    #[error(
        "dirty log refused: it covers {covers:#x} bytes of guest memory, which reaches {needs:#x}"
    )]
    LogTooSmall {
        /// Guest-physical bytes the log covers.
        covers: u64,
        /// Where guest memory ends.
        needs: u64,
    },
    /// A used ring logged (VHOST_VRING_F_LOG) beyond the dirty log.
    #[error("vring {index}: its used ring logged at {addr:#x} ({len} bytes) lies beyond the dirty log, which covers {covers:#x} bytes")]
    UsedLogOutside {
        /// The vring.
        index: usize,
        /// log_guest_addr.
        addr: u64,
        /// Bytes of the used ring.
        len: u64,
        /// Guest-physical bytes the log covers.
        covers: u64,
    },
    /// A request mqblk does not support.
    #[error("{0} is not supported")]
    Unsupported(&'static str),
}

impl From<Error> for VhuError {
    fn from(e: Error) -> Self {
        tracing::warn!(err = %e, "vhost-user message refused");
        match e {
            Error::Unsupported(what) => VhuError::InvalidOperation(what),
            e => {
                VhuError::ReqHandlerError(std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
            }
        }
    }
}

/// The session's result type.
pub type Result<T> = std::result::Result<T, Error>;
