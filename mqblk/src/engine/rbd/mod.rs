//! The rbd engine: a Ceph RBD image through librbd (`engine=rbd`, the `rbd` cargo feature).
//!
//! The export connects once (`cluster.rs`): one librados client and one I/O context, shared by
//! its threads, since librados is thread-safe and one client means one set of monitor and OSD
//! sessions. Each I/O thread then opens its own image handle (`channel.rs`), because librbd
//! queues a handle's completions in one queue behind one eventfd: with a handle per thread,
//! each thread's completions come back to it alone, without a lock or a hand-off between
//! threads. The engine keeps one more handle of its own for what is not on the request path
//! (the size, a resize).

mod channel;
mod cluster;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mqblk_rbd_sys as sys;

use super::{Channel, Engine, OpenError, ResizeError};
use crate::config::ExportConfig;

pub use cluster::RbdError;
use cluster::{Cluster, Image};

/// The features mqblk gives an image it creates (`size=`): librbd's defaults less the
/// exclusive lock and what depends on it (object map, fast diff). Each I/O thread writes
/// through its own handle; with the exclusive lock those handles would take the lock from each
/// other on every write that follows another thread's.
const CREATE_FEATURES: u64 = (sys::RBD_FEATURE_LAYERING | sys::RBD_FEATURE_DEEP_FLATTEN) as u64;

/// An RBD image served by per-thread handles.
pub struct RbdEngine {
    /// The engine's own handle: size and resize.
    control: Mutex<Image>,
    cluster: Arc<Cluster>,
    image: String,
    readonly: bool,
    cache: bool,
    capacity: AtomicU64,
}

/// Connects to the cluster and opens the image `cfg` names, creating it when `size=` is given
/// and it is missing.
pub fn open(cfg: &ExportConfig) -> Result<RbdEngine, OpenError> {
    let rbd = &cfg.rbd;
    // direct=on (the default) bypasses librbd's cache, as QEMU's cache.direct=on does.
    let cache = !cfg.direct;
    // librbd's cache belongs to an image handle, and each I/O thread has its own: a flush on
    // one queue would not reach writes another thread's cache acknowledged, nor would a read
    // on one queue see them. With the cache on, one thread writes.
    if cache && !cfg.readonly && cfg.num_threads() > 1 {
        return Err(RbdError::CacheNeedsOneThread {
            threads: cfg.num_threads(),
        }
        .into());
    }
    let cluster = Arc::new(Cluster::connect(rbd, cache)?);
    let image = rbd.image.clone().expect("config checked: rbd has an image");
    let spec = rbd.spec();
    let opened = match cluster.open(&image, cfg.readonly) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => match cfg.size {
            Some(size) if !cfg.readonly => {
                cluster
                    .create(&image, size, CREATE_FEATURES)
                    .map_err(|err| RbdError::Call {
                        what: format!("cannot create RBD image {spec}"),
                        err,
                    })?;
                tracing::info!(image = %spec, size, "created RBD image");
                cluster.open(&image, cfg.readonly)
            }
            _ => return Err(RbdError::NoImage(spec).into()),
        },
        other => other,
    };
    let control = opened.map_err(|err| match err.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => RbdError::Denied {
            user: rbd.user.clone(),
            what: format!("image {spec}"),
            err,
        },
        _ => RbdError::Call {
            what: format!("cannot open RBD image {spec}"),
            err,
        },
    })?;
    let call = |what: &str| {
        let what = format!("{what} {spec}");
        move |err| RbdError::Call { what, err }
    };
    let actual = control
        .size()
        .map_err(call("cannot get the size of RBD image"))?;
    if let Some(given) = cfg.size {
        if given != actual {
            return Err(OpenError::SizeMismatch {
                path: spec,
                given,
                actual,
            });
        }
    }
    let capacity = actual & !511;
    if capacity == 0 {
        return Err(OpenError::TooSmall(spec));
    }
    let features = control
        .features()
        .map_err(call("cannot read the features of RBD image"))?;
    if features & u64::from(sys::RBD_FEATURE_EXCLUSIVE_LOCK) != 0
        && cfg.num_threads() > 1
        && !cfg.readonly
    {
        tracing::warn!(image = %spec, "the image has the exclusive-lock feature: the I/O threads' handles pass the lock to each other when they write in turn; for writes from several threads, disable it (rbd feature disable {spec} fast-diff object-map exclusive-lock) or use threads=1");
    }
    Ok(RbdEngine {
        control: Mutex::new(control),
        cluster,
        image,
        readonly: cfg.readonly,
        cache,
        capacity: AtomicU64::new(capacity),
    })
}

impl Engine for RbdEngine {
    fn name(&self) -> &'static str {
        "rbd"
    }
    fn capacity(&self) -> u64 {
        self.capacity.load(Ordering::Relaxed)
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn channel(&self) -> io::Result<Box<dyn Channel>> {
        Ok(Box::new(channel::RbdChannel::open(
            &self.cluster,
            &self.image,
            self.readonly,
            self.cache,
        )?))
    }

    fn resize(&self, size: Option<u64>) -> Result<u64, ResizeError> {
        let control = self.control.lock().unwrap_or_else(|e| e.into_inner());
        let new = match size {
            Some(s) => {
                control.resize(s)?;
                s
            }
            None => match control.size()? & !511 {
                0 => return Err(ResizeError::BadSize(0)),
                n => n,
            },
        };
        self.capacity.store(new, Ordering::Relaxed);
        Ok(new)
    }
}
