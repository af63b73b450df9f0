//! The connection to a Ceph cluster and the image handles opened through it: every librados
//! and librbd call that is not on the request path, and the one-line errors they give.
//!
//! Every wait here is bounded by the export's `timeout=`: librados waits for the monitors, a
//! monitor command or an OSD request forever by default, and a daemon that hangs at start, or
//! keeps a guest's request forever, tells the operator nothing.

use std::ffi::{c_char, CStr, CString};
use std::io;
use std::ptr;
use std::sync::Arc;

use mqblk_rbd_sys as sys;

use crate::config::RbdConfig;

/// Why an rbd export could not be opened. Each message is one line naming what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    /// ceph.conf could not be read.
    #[error("cannot read the Ceph configuration {path}: {err} (conf=)")]
    Conf {
        /// conf= (or librados's default search).
        path: String,
        /// Why.
        err: io::Error,
    },
    /// The keyring could not be read.
    #[error("cannot read the keyring {path}: {err} (keyring=)")]
    Keyring {
        /// keyring=.
        path: String,
        /// Why.
        err: io::Error,
    },
    /// No monitor answered within the timeout.
    #[error("no Ceph monitor answered within {timeout_s} s (mon_host {mon_host} from {conf}): is the cluster up and reachable?")]
    Unreachable {
        /// The monitors that were tried.
        mon_host: String,
        /// Where they came from.
        conf: String,
        /// timeout=.
        timeout_s: u32,
    },
    /// The monitors refused the client's credentials.
    #[error("the Ceph monitors refused client.{user}'s credentials ({keyring}): {err}: check user= and keyring=")]
    Auth {
        /// user=.
        user: String,
        /// keyring= or librados's default.
        keyring: String,
        /// The monitors' answer.
        err: io::Error,
    },
    /// No key for the user was found.
    #[error("no key for client.{user} in {keyring}: pass keyring=PATH holding it (and user=NAME if it is not client.admin)")]
    NoKey {
        /// user=.
        user: String,
        /// keyring= or librados's default.
        keyring: String,
    },
    /// librbd's cache (direct=off) on a writable export with several I/O threads.
    #[error("direct=off (librbd's cache) needs threads=1 on a writable rbd export: each of the {threads} I/O threads has its own image handle and cache, and a flush on one would not reach the others' writes")]
    CacheNeedsOneThread {
        /// The export's I/O threads.
        threads: usize,
    },
    /// The pool does not exist.
    #[error("Ceph pool {0} does not exist (pool=)")]
    NoPool(String),
    /// The image does not exist.
    #[error("RBD image {0} does not exist: create it, or pass size=BYTES to have mqblk create it")]
    NoImage(String),
    /// The client may not use the pool or image.
    #[error("client.{user} may not open {what}: {err} (check its caps)")]
    Denied {
        /// user=.
        user: String,
        /// The pool or image.
        what: String,
        /// The cluster's answer.
        err: io::Error,
    },
    /// Any other failure of a librados or librbd call.
    #[error("{what}: {err}")]
    Call {
        /// What was being done.
        what: String,
        /// The error.
        err: io::Error,
    },
}

/// A librados or librbd return value as an error: they return `-errno`.
fn errno(r: i32) -> io::Error {
    io::Error::from_raw_os_error(-r)
}

/// A name for C: the config's names are checked to be free of NULs (no control character).
fn cstr(s: &str) -> CString {
    CString::new(s).expect("config names hold no NUL")
}

/// A connected cluster client with an I/O context on the export's pool and namespace.
pub struct Cluster {
    rados: sys::rados_t,
    ioctx: sys::rados_ioctx_t,
}

// SAFETY: a `rados_t` may be used from several threads; the ioctx is configured (pool,
// namespace) only in `connect`, before the `Cluster` is shared, and afterwards only passed to
// `rbd_open`/`rbd_create4`, which copy it (librados.h warns only against changing an ioctx's
// settings while others use it).
unsafe impl Send for Cluster {}
// SAFETY: as above.
unsafe impl Sync for Cluster {}

impl Drop for Cluster {
    fn drop(&mut self) {
        // SAFETY: `rados` was created in `connect` and `ioctx`, unless still null (a connect
        // that failed before opening the pool), too; each is destroyed once, here, after every
        // image opened through them is closed (each `Image` holds an `Arc<Cluster>`).
        unsafe {
            if !self.ioctx.is_null() {
                sys::rados_ioctx_destroy(self.ioctx);
            }
            sys::rados_shutdown(self.rados);
        }
    }
}

/// Reads a configuration value back from librados (for error messages).
fn conf_get(rados: sys::rados_t, key: &str) -> String {
    let mut buf = [0u8; 512];
    let key = cstr(key);
    // SAFETY: `rados` is a created handle; librados writes at most `buf.len()` bytes,
    // NUL-terminated, into the live buffer.
    let r = unsafe {
        sys::rados_conf_get(
            rados,
            key.as_ptr(),
            buf.as_mut_ptr().cast::<c_char>(),
            buf.len(),
        )
    };
    if r < 0 {
        return "?".into();
    }
    CStr::from_bytes_until_nul(&buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Sets a configuration value on a handle not yet connected.
fn conf_set(rados: sys::rados_t, key: &str, value: &str) -> Result<(), RbdError> {
    let (k, v) = (cstr(key), cstr(value));
    // SAFETY: `rados` is a created, not yet connected handle; both strings outlive the call.
    let r = unsafe { sys::rados_conf_set(rados, k.as_ptr(), v.as_ptr()) };
    if r < 0 {
        return Err(RbdError::Call {
            what: format!("cannot set the Ceph option {key}={value}"),
            err: errno(r),
        });
    }
    Ok(())
}

impl Cluster {
    /// Connects as `client.<user>` with `cfg`'s ceph.conf and keyring, `cache` choosing
    /// librbd's cache, and opens the pool (and namespace). Fails within about `timeout=`.
    pub fn connect(cfg: &RbdConfig, cache: bool) -> Result<Cluster, RbdError> {
        let name = cstr(&format!("client.{}", cfg.user));
        let cluster_name = cstr("ceph");
        let mut rados: sys::rados_t = ptr::null_mut();
        // SAFETY: `rados` receives a new handle; the strings outlive the call.
        let r = unsafe { sys::rados_create2(&mut rados, cluster_name.as_ptr(), name.as_ptr(), 0) };
        if r < 0 {
            return Err(RbdError::Call {
                what: "cannot create a Ceph client".into(),
                err: errno(r),
            });
        }
        // From here the handle is shut down on every path, by this guard or by `Cluster`.
        let mut guard = Cluster {
            rados,
            ioctx: ptr::null_mut(),
        };
        let conf_path = cfg.conf.as_deref().map(|p| cstr(&p.display().to_string()));
        let conf_shown = match &cfg.conf {
            Some(p) => p.display().to_string(),
            None => "the default ceph.conf".into(),
        };
        if let Some(p) = &cfg.conf {
            // librados says only "no such file" without naming it; name it.
            if let Err(err) = std::fs::metadata(p) {
                return Err(RbdError::Conf {
                    path: conf_shown,
                    err,
                });
            }
        }
        // SAFETY: `rados` is created and not connected; a null path means librados's search.
        let r = unsafe {
            sys::rados_conf_read_file(
                rados,
                conf_path.as_ref().map_or(ptr::null(), |c| c.as_ptr()),
            )
        };
        if r < 0 {
            return Err(RbdError::Conf {
                path: conf_shown,
                err: errno(r),
            });
        }
        if let Some(k) = &cfg.keyring {
            // librados would only say that it found no key, later, and name no file.
            if let Err(err) = std::fs::File::open(k) {
                return Err(RbdError::Keyring {
                    path: k.display().to_string(),
                    err,
                });
            }
            conf_set(rados, "keyring", &k.display().to_string())?;
        }
        let t = cfg.timeout_s.to_string();
        for key in [
            "client_mount_timeout",
            "rados_mon_op_timeout",
            "rados_osd_op_timeout",
        ] {
            conf_set(rados, key, &t)?;
        }
        conf_set(rados, "rbd_cache", if cache { "true" } else { "false" })?;
        // librados's own messages would come on mqblk's stderr between its log lines; its
        // failures reach the operator as this module's one-line errors instead. ceph.conf's
        // log_file still gets them where it is set.
        conf_set(rados, "log_to_stderr", "false")?;
        conf_set(rados, "err_to_stderr", "false")?;
        let keyring = cfg
            .keyring
            .as_ref()
            .map(|k| k.display().to_string())
            .unwrap_or_else(|| conf_get(rados, "keyring"));
        // SAFETY: `rados` is configured and not yet connected.
        let r = unsafe { sys::rados_connect(rados) };
        if r < 0 {
            let user = cfg.user.clone();
            return Err(match -r {
                libc::ETIMEDOUT => RbdError::Unreachable {
                    mon_host: conf_get(rados, "mon_host"),
                    conf: conf_shown,
                    timeout_s: cfg.timeout_s,
                },
                libc::ENOENT => RbdError::NoKey { user, keyring },
                libc::EACCES | libc::EPERM => RbdError::Auth {
                    user,
                    keyring,
                    err: errno(r),
                },
                _ => RbdError::Call {
                    what: format!("cannot connect to the Ceph cluster ({conf_shown})"),
                    err: errno(r),
                },
            });
        }
        let pool = cfg.pool.as_deref().expect("config checked: rbd has a pool");
        let pool_c = cstr(pool);
        // SAFETY: `rados` is connected; `ioctx` receives a new I/O context.
        let r = unsafe { sys::rados_ioctx_create(rados, pool_c.as_ptr(), &mut guard.ioctx) };
        if r < 0 {
            return Err(match -r {
                libc::ENOENT => RbdError::NoPool(pool.into()),
                libc::EACCES | libc::EPERM => RbdError::Denied {
                    user: cfg.user.clone(),
                    what: format!("pool {pool}"),
                    err: errno(r),
                },
                _ => RbdError::Call {
                    what: format!("cannot open Ceph pool {pool}"),
                    err: errno(r),
                },
            });
        }
        if let Some(ns) = &cfg.namespace {
            let ns = cstr(ns);
            // SAFETY: `ioctx` is open; librados copies the name.
            unsafe { sys::rados_ioctx_set_namespace(guard.ioctx, ns.as_ptr()) };
        }
        Ok(guard)
    }

    /// Opens `image` (read-only when `readonly`). The handle keeps the cluster connection.
    pub fn open(self: &Arc<Self>, image: &str, readonly: bool) -> io::Result<Image> {
        let name = cstr(image);
        let mut handle: sys::rbd_image_t = ptr::null_mut();
        // SAFETY: `ioctx` is open; `handle` receives the image; a null snapshot name means
        // the image's head.
        let r = unsafe {
            if readonly {
                sys::rbd_open_read_only(self.ioctx, name.as_ptr(), &mut handle, ptr::null())
            } else {
                sys::rbd_open(self.ioctx, name.as_ptr(), &mut handle, ptr::null())
            }
        };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(Image {
            handle,
            _cluster: self.clone(),
        })
    }

    /// Creates `image` of `size` bytes with the features in `features`.
    pub fn create(&self, image: &str, size: u64, features: u64) -> io::Result<()> {
        let name = cstr(image);
        let mut opts: sys::rbd_image_options_t = ptr::null_mut();
        // SAFETY: `opts` receives a new options object, destroyed below.
        unsafe { sys::rbd_image_options_create(&mut opts) };
        // SAFETY: `opts` is live; FEATURES is a u64 option.
        let r = unsafe {
            sys::rbd_image_options_set_uint64(opts, sys::RBD_IMAGE_OPTION_FEATURES as i32, features)
        };
        let r = if r < 0 {
            r
        } else {
            // SAFETY: `ioctx` is open, `opts` live; librbd copies what it needs.
            unsafe { sys::rbd_create4(self.ioctx, name.as_ptr(), size, opts) }
        };
        // SAFETY: created above, destroyed once.
        unsafe { sys::rbd_image_options_destroy(opts) };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(())
    }
}

/// An open image handle. Closed on drop (which waits for its requests in flight), before the
/// cluster connection it holds can be shut down.
pub struct Image {
    pub(super) handle: sys::rbd_image_t,
    _cluster: Arc<Cluster>,
}

// SAFETY: an `rbd_image_t` may be used from any thread (librbd locks its image context); an
// `Image` is moved to the I/O thread that owns it, or kept behind the engine's mutex.
unsafe impl Send for Image {}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: the handle was opened by `Cluster::open` and is closed once, here; the
        // cluster it came from lives until after this (`_cluster` drops after `drop` returns).
        unsafe { sys::rbd_close(self.handle) };
    }
}

impl Image {
    /// The image's size in bytes, as the cluster has it now.
    pub fn size(&self) -> io::Result<u64> {
        let mut size = 0u64;
        // SAFETY: an open handle; librbd refreshes the header if it changed and writes the
        // size into the live u64.
        let r = unsafe { sys::rbd_get_size(self.handle, &mut size) };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(size)
    }

    /// The image's feature bits (`RBD_FEATURE_*`).
    pub fn features(&self) -> io::Result<u64> {
        let mut f = 0u64;
        // SAFETY: an open handle; writes into the live u64.
        let r = unsafe { sys::rbd_get_features(self.handle, &mut f) };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(f)
    }

    /// Resizes the image (other handles learn of it through the header's watch).
    pub fn resize(&self, size: u64) -> io::Result<()> {
        // SAFETY: an open, writable handle.
        let r = unsafe { sys::rbd_resize(self.handle, size) };
        if r < 0 {
            return Err(errno(r));
        }
        Ok(())
    }
}
