//! `format=qcow2`: qcow2 images and their backing chains, through imago, on the per-queue data
//! path.
//!
//! imago (a qcow2 library by a QEMU block-layer maintainer) owns the format: the header, the L1
//! and L2 tables, refcounts, allocation, copy-on-write from backing images, zero clusters,
//! compressed clusters, resize and image creation. mqblk keeps the data path: each I/O thread
//! caches where guest clusters are in the image file ([`mapping`]) and turns a request on
//! cached clusters into one entry on its own ring at the file offset, as for a raw image. What
//! the cache cannot serve goes to a few metadata workers per export ([`metadata`]), which do
//! it through imago and answer with the mappings the thread may cache from then on.
//!
//! The one hazard of caching mappings is a cluster that moves while a thread still points at
//! it. mqblk never frees a cluster while it serves an image: discard and write-zeroes turn
//! clusters into zero clusters that keep their place in the file (with `unmap`, the file's
//! blocks are punched out), so a stale mapping can only point at the cluster's own place.
//! Such a mapping is still stale (a write there would be lost behind the zero flag), so every
//! zeroing bumps the image's epoch with the range it made stale, before the request
//! completes, and each thread forgets that range before it next uses its cache.

mod channel;
pub mod header;
mod image;
mod mapping;
mod metadata;

use std::io;
use std::path::Path;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use rustix::event::{eventfd, EventfdFlags};

use crate::config::ExportConfig;
use crate::engine::{self, Channel, Engine, Limits, OpenError, ResizeError};
use channel::Qcow2Channel;
use image::Image;
use mapping::MappingCache;
use metadata::{Job, Replies};

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
    #[error("{0} is marked dirty (it was not closed cleanly and its refcounts may be wrong): repair it with `qemu-img check -r all {0}` first")]
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
    /// A backing chain that comes back to itself.
    #[error("the backing chain loops: {0}")]
    BackingLoop(String),
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
    /// A new image needs a size.
    #[error("image {0} does not exist: pass size=BYTES (or backing=) to have mqblk create it")]
    SizeNeeded(String),
    /// O_DIRECT refused.
    #[error("the filesystem holding {0} refuses O_DIRECT: pass direct=off for this export")]
    DirectRefused(String),
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

/// How many metadata workers an export with `threads` I/O threads gets: enough that backing
/// reads and allocations of different threads run side by side, few enough to stay rare.
fn worker_count(threads: usize) -> usize {
    threads.clamp(2, 8)
}

/// A qcow2 export's storage.
pub struct Qcow2Engine {
    image: Arc<Image>,
    jobs: Mutex<Sender<Job>>,
    block_size: u32,
    l2_cache_size: u64,
    writable: bool,
    _workers: Vec<std::thread::JoinHandle<()>>,
}

/// Opens (or creates, with `size=` or `backing=`) the qcow2 image of `cfg`.
pub fn open(cfg: &ExportConfig) -> Result<Qcow2Engine, OpenError> {
    let path = cfg
        .path
        .as_deref()
        .expect("config checked: qcow2 has a path");
    Ok(open_path(path, cfg)?)
}

fn open_path(path: &Path, cfg: &ExportConfig) -> Result<Qcow2Engine, Qcow2Error> {
    if !path.exists() {
        if cfg.readonly {
            return Err(Qcow2Error::SizeNeeded(path.display().to_string()));
        }
        image::create(path, cfg.size, &cfg.qcow2)?;
    } else {
        image::check_backing(path, &cfg.qcow2)?;
    }
    let image = image::open(path, cfg.readonly, cfg.direct)?;
    let block_size = if cfg.direct {
        engine::uring::probe_direct_block_size(&image.file, image.access.size())
    } else {
        512
    };
    let cluster = 1u64 << image.cluster_bits;
    if cluster < u64::from(block_size) {
        return Err(Qcow2Error::ClusterBelowBlock {
            path: path.display().to_string(),
            cluster,
            block: block_size,
        });
    }
    let image = Arc::new(image);
    let (jobs, workers) = metadata::start_workers(
        &image,
        worker_count(cfg.num_threads()),
        &format!("qcow2-{}", cfg.id),
    )
    .map_err(|err| Qcow2Error::Io {
        what: "cannot start the metadata workers of",
        path: path.display().to_string(),
        err,
    })?;
    Ok(Qcow2Engine {
        image,
        jobs: Mutex::new(jobs),
        block_size,
        l2_cache_size: cfg.qcow2.l2_cache_size,
        writable: !cfg.readonly,
        _workers: workers,
    })
}

impl From<Qcow2Error> for OpenError {
    fn from(e: Qcow2Error) -> Self {
        OpenError::Qcow2(e)
    }
}

impl Engine for Qcow2Engine {
    fn name(&self) -> &'static str {
        "qcow2"
    }

    fn capacity(&self) -> u64 {
        self.image.access.size() & !511
    }

    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn channel(&self) -> io::Result<Box<dyn Channel>> {
        let clusters = self
            .image
            .access
            .size()
            .div_ceil(1 << self.image.cluster_bits);
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Ok(Box::new(Qcow2Channel {
            image: self.image.clone(),
            jobs,
            replies: Arc::new(Replies {
                done: Mutex::new(Vec::new()),
                event: eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?,
            }),
            cache: MappingCache::new(self.image.cluster_bits, clusters, self.l2_cache_size),
            epoch: self.image.epoch.load(std::sync::atomic::Ordering::Acquire),
            reaped: Vec::new(),
        }))
    }

    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let actual = self.image.access.size();
        match size {
            None => Err(ResizeError::SizeNeeded("qcow2")),
            Some(s) if s < actual => Err(ResizeError::Shrink { actual }),
            Some(s) => {
                self.image
                    .access
                    .resize_grow(s, imago::format::PreallocateMode::None)?;
                self.image.access.flush()?;
                self.image.access.sync()?;
                Ok(s)
            }
        }
    }

    fn sync_host_cache(&self) -> io::Result<()> {
        // Everything the next backend to open the image (after a migration) needs: data,
        // and the metadata imago holds in memory.
        rustix::fs::fdatasync(&self.image.file)?;
        self.image.access.flush()?;
        self.image.access.sync()
    }

    fn ring_opcodes(&self) -> &'static [u8] {
        engine::uring::RW_OPCODES
    }

    fn limits(&self) -> Limits {
        Limits {
            discard: self.writable,
            write_zeroes: self.writable,
            ..Limits::default()
        }
    }
}
