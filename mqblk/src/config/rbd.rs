//! An export's Ceph RBD settings (`engine=rbd`): which image in which pool and namespace, and
//! how to reach and authenticate to the cluster. The keys mirror qemu-storage-daemon's rbd
//! driver (`pool`, `image`, `namespace`, `conf`, `user`), so an operator can move an export
//! between the two without translating names.

use std::path::PathBuf;

use super::ConfigError;

/// Whether this build can serve `engine=rbd` (the `rbd` cargo feature links librbd).
pub const BUILT: bool = cfg!(feature = "rbd");

/// The default Ceph client name (`client.admin`), as QEMU's rbd driver defaults it.
pub const DEFAULT_USER: &str = "admin";

/// The default bound, in seconds, on every wait for the cluster: connecting to the monitors
/// (`client_mount_timeout`), a monitor command (`rados_mon_op_timeout`) and an OSD request
/// (`rados_osd_op_timeout`). librados waits forever by default; a daemon must not.
pub const DEFAULT_TIMEOUT_S: u32 = 30;

/// Where an `engine=rbd` export's image is and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdConfig {
    /// The RADOS pool holding the image.
    pub pool: Option<String>,
    /// The image's name.
    pub image: Option<String>,
    /// The RADOS namespace within the pool; `None`: the pool's default namespace.
    pub namespace: Option<String>,
    /// ceph.conf; `None`: librados's search path (`$CEPH_CONF`, /etc/ceph/ceph.conf, ...).
    pub conf: Option<PathBuf>,
    /// The Ceph client name without `client.` (`admin` by default).
    pub user: String,
    /// A keyring file; `None`: the one ceph.conf names, or librados's default locations.
    pub keyring: Option<PathBuf>,
    /// Seconds any wait for the cluster may last before the request (or the start) fails.
    pub timeout_s: u32,
}

impl Default for RbdConfig {
    fn default() -> Self {
        RbdConfig {
            pool: None,
            image: None,
            namespace: None,
            conf: None,
            user: DEFAULT_USER.into(),
            keyring: None,
            timeout_s: DEFAULT_TIMEOUT_S,
        }
    }
}

/// The names of the keys that only `engine=rbd` takes.
pub const KEYS: &[&str] = &[
    "pool",
    "image",
    "namespace",
    "conf",
    "user",
    "keyring",
    "timeout",
];

/// A pool, image or namespace name: non-empty, printable, and free of the characters the
/// export spec and Ceph's own `pool/namespace/image` notation use as separators.
pub fn valid_name(v: &str) -> bool {
    !v.is_empty() && v.len() <= 255 && v.chars().all(|c| !c.is_control() && !"/@,=".contains(c))
}

impl RbdConfig {
    /// The image as `rbd` names it: `pool/[namespace/]image`.
    pub fn spec(&self) -> String {
        let pool = self.pool.as_deref().unwrap_or("");
        let image = self.image.as_deref().unwrap_or("");
        match &self.namespace {
            Some(ns) => format!("{pool}/{ns}/{image}"),
            None => format!("{pool}/{image}"),
        }
    }

    /// The keys an rbd export cannot do without.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if !BUILT {
            return Err(ConfigError::NotBuilt(
                "engine=rbd needs mqblk built with the rbd feature (cargo build --release \
                 --features rbd, with Debian's librbd-dev and librados-dev installed)",
            ));
        }
        if self.pool.is_none() || self.image.is_none() {
            return Err(ConfigError::Required(
                "pool=NAME and image=NAME are required with engine=rbd (the RBD image to serve)",
            ));
        }
        Ok(())
    }
}
