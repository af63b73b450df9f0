//! Export settings: `--export SPEC` strings and TOML files into typed, validated config.
//!
//! The keys themselves (names, values, help, how each is applied) are one table in [`keys`].
//! Every error names the offending key and the values it accepts, because operators and scripts
//! read these messages.

pub mod file;
pub mod keys;
pub mod preallocation;
pub mod qcow2;
pub mod qos;
pub mod rbd;
pub mod state_dir;
pub mod tuning;
pub mod values;

use std::path::PathBuf;

use thiserror::Error;

pub use file::{config_toml, parse_config_file, write_atomically};
pub use preallocation::Preallocation;
pub use qcow2::{ImageFormat, Qcow2Config};
pub use qos::QosConfig;
pub use rbd::RbdConfig;
pub use tuning::{PollMode, Tuning};
pub use values::{parse_bool, parse_cpu_list, parse_size};

/// Most virtqueues one export offers.
pub const MAX_QUEUES: u16 = 64;
/// Largest virtqueue size (the split ring allows 32768; Linux and QEMU use up to 1024).
pub const MAX_QUEUE_SIZE: u16 = 32768;
/// Longest GET_ID answer the virtio-blk spec allows.
pub const MAX_SERIAL_LEN: usize = 20;

/// A configuration error, naming the key and what it accepts.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ConfigError {
    /// An unknown key.
    #[error("unknown key '{0}' (known keys: {names})", names = keys::names())]
    UnknownKey(String),
    /// An unknown key in a TOML `[[export]]` table (in the words serde uses for TOML).
    #[error("unknown field `{0}`, expected one of {names}", names = keys::names())]
    UnknownField(String),
    /// A key that is not a QoS key where only QoS keys may be given.
    #[error("'{0}' is not a QoS key (they are iops-total, iops-read, iops-write, bps-total, bps-read, bps-write, each with -max and -max-length, iops-size and group)")]
    NotQos(String),
    /// A key given without `=value`.
    #[error("'{0}' has no value: write {0}=VALUE")]
    MissingValue(String),
    /// A key given twice.
    #[error("key '{0}' is given twice")]
    Duplicate(String),
    /// A value this build cannot serve.
    #[error("{0}")]
    NotBuilt(&'static str),
    /// A required key is absent.
    #[error("{0}")]
    Required(&'static str),
    /// Two keys that exclude each other.
    #[error("{0}")]
    Exclusive(&'static str),
    /// A value out of its allowed set.
    #[error("invalid {key}={value}: {allowed}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What is allowed.
        allowed: &'static str,
    },
    /// A value that contradicts another key's (`why` names that key).
    #[error("invalid {key}={value}: {why}")]
    Conflict {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What it conflicts with and what is allowed.
        why: String,
    },
    /// The TOML file could not be read as TOML.
    #[error("{0}")]
    Toml(String),
    /// An error in one `[[export]]` table of a config file (numbered from 1).
    #[error("[[export]] #{index}: {error}")]
    InTable {
        /// Which table.
        index: usize,
        /// What is wrong with it.
        error: Box<ConfigError>,
    },
    /// No export at all.
    #[error("no export given: pass --export socket=PATH,path=IMAGE (see --help), or --api-socket PATH to add exports later")]
    NoExport,
    /// Two exports on one socket.
    #[error("two exports use socket={0}: each export needs its own socket")]
    SharedSocket(String),
    /// Two exports on one inherited descriptor.
    #[error("two exports use fd={0}: each export needs its own listening socket")]
    SharedFd(i32),
    /// Two exports with one id.
    #[error(
        "two exports have id={0}: give each export its own id= (by default the socket's file name)"
    )]
    SharedId(String),
}

/// Which storage engine serves an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// io_uring on a raw image file or block device.
    #[default]
    Uring,
    /// Completes every request at once; reads return zeros. Measures the backend itself.
    Null,
    /// A RAM disk (a memfd served through the io_uring engine).
    Mem,
    /// A Ceph RBD image through librbd (a build with the `rbd` feature).
    Rbd,
    /// An NVMe namespace's character device (`/dev/ngXnY`), driven with NVMe commands through
    /// io_uring passthrough: the host's block layer is skipped.
    Nvme,
}

/// How the export's queues map to I/O threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Threads {
    /// One I/O thread per queue (the default).
    #[default]
    PerQueue,
    /// This many threads; queue q is served by thread q % N.
    Count(u16),
}

/// One export: a disk served on one vhost-user socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    /// The export's name (API, stats, metrics); derived from the socket when not given.
    pub id: String,
    /// The vhost-user unix socket to listen on; empty when the export is given `fd`.
    pub socket: PathBuf,
    /// A listening unix socket inherited as this file descriptor, served instead of binding
    /// `socket`.
    pub fd: Option<i32>,
    /// Backing file or block device (uring engine).
    pub path: Option<PathBuf>,
    /// Storage engine.
    pub engine: EngineKind,
    /// Capacity in bytes (required for null and mem; for uring it creates a missing file).
    pub size: Option<u64>,
    /// Number of virtqueues offered.
    pub queues: u16,
    /// Maximum virtqueue size.
    pub queue_size: u16,
    /// Queue-to-thread mapping.
    pub threads: Threads,
    /// CPUs to pin I/O threads to (thread i on `cpus[i]`).
    pub cpus: Vec<usize>,
    /// Read-only export.
    pub readonly: bool,
    /// Open the backing file with O_DIRECT.
    pub direct: bool,
    /// GET_ID answer.
    pub serial: String,
    /// engine=null: whether a read fills the guest's buffers with zeroes.
    pub read_zeroes: bool,
    /// Polling, batch-wait and merging settings.
    pub tuning: Tuning,
    /// QoS limits and throttle group; `None` when no QoS key is given.
    pub qos: Option<QosConfig>,
    /// The RBD image and cluster (engine=rbd).
    pub rbd: RbdConfig,
    /// How `path` is laid out (engine=uring): raw (the default) or qcow2.
    pub format: ImageFormat,
    /// The qcow2 settings (format=qcow2).
    pub qcow2: Qcow2Config,
    /// How the space of an image file mqblk creates or grows is provided (engine=uring).
    pub preallocation: Preallocation,
}

impl Default for ExportConfig {
    /// Every key's default; `socket` is empty (required).
    fn default() -> Self {
        ExportConfig {
            id: String::new(),
            socket: PathBuf::new(),
            fd: None,
            path: None,
            engine: EngineKind::Uring,
            size: None,
            queues: 1,
            queue_size: 1024,
            threads: Threads::PerQueue,
            cpus: Vec::new(),
            readonly: false,
            direct: true,
            serial: "mqblk".into(),
            read_zeroes: true,
            tuning: Tuning::default(),
            qos: None,
            rbd: RbdConfig::default(),
            format: ImageFormat::Raw,
            qcow2: Qcow2Config::default(),
            preallocation: Preallocation::Off,
        }
    }
}

impl ExportConfig {
    /// Whether the export may keep a qcow2 metadata journal (`metadata-commit=journal` or
    /// `auto` on a writable qcow2 image).
    pub fn may_keep_qcow2_journal(&self) -> bool {
        self.format == ImageFormat::Qcow2
            && !self.readonly
            && self.qcow2.metadata_commit.may_journal()
    }

    /// Whether the export cannot be served without its qcow2 metadata journal
    /// (`metadata-commit=journal` on a writable qcow2 image; `auto` does without).
    pub fn needs_qcow2_journal(&self) -> bool {
        self.may_keep_qcow2_journal()
            && self.qcow2.metadata_commit == qcow2::MetadataCommit::Journal
    }

    /// The number of I/O threads this export runs.
    pub fn num_threads(&self) -> usize {
        match self.threads {
            Threads::PerQueue => self.queues as usize,
            Threads::Count(n) => (n as usize).min(self.queues as usize),
        }
    }

    /// The I/O thread that serves queue `q`.
    pub fn thread_of_queue(&self, q: usize) -> usize {
        q % self.num_threads()
    }

    /// The research's name for this mapping, for logs and reports.
    pub fn mapping_name(&self) -> &'static str {
        match (self.queues, self.num_threads()) {
            (1, 1) => "baseline",
            (_, 1) => "mq",
            (q, t) if q as usize == t => "per-queue",
            _ => "grouped",
        }
    }

    /// Builds an export from `(key, value)` pairs, checking each against [`keys::keys`] and
    /// then the export as a whole.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, String)>,
    ) -> Result<ExportConfig, ConfigError> {
        let mut cfg = apply_pairs(pairs, |name| {
            keys::key(name).ok_or_else(|| ConfigError::UnknownKey(name.into()))
        })?;
        cfg.check()?;
        Ok(cfg)
    }

    /// Refuses the first of `names` set to other than its default, saying `why`.
    fn refuse_keys(&self, names: &[&str], why: &str) -> Result<(), ConfigError> {
        let default = ExportConfig::default();
        for name in names {
            let key = keys::key(name).expect("the names are in the key table");
            if let Some(value) = key
                .show(self)
                .filter(|v| Some(v) != key.show(&default).as_ref())
            {
                return Err(ConfigError::Conflict {
                    key: key.name,
                    value,
                    why: why.into(),
                });
            }
        }
        Ok(())
    }

    /// What no single key can check: required keys and keys that depend on each other.
    fn check(&mut self) -> Result<(), ConfigError> {
        match (self.socket.as_os_str().is_empty(), self.fd) {
            (true, None) => {
                return Err(ConfigError::Required(
                    "socket=PATH is required (the vhost-user unix socket to listen on), or fd=N \
                     (a listening unix socket inherited as file descriptor N)",
                ))
            }
            (false, Some(_)) => {
                return Err(ConfigError::Exclusive(
                    "socket= and fd= exclude each other: give socket=PATH to bind a path, or \
                     fd=N to serve an inherited listening socket",
                ))
            }
            _ => {}
        }
        if self.id.is_empty() {
            self.id = match self.fd {
                Some(fd) => format!("fd-{fd}"),
                None => default_id(&self.socket),
            };
        }
        match self.engine {
            EngineKind::Uring if self.path.is_none() => {
                return Err(ConfigError::Required(
                    "path=PATH is required with engine=uring (a raw image file or block device)",
                ))
            }
            EngineKind::Nvme if self.path.is_none() => {
                return Err(ConfigError::Required(
                    "path=PATH is required with engine=nvme (an NVMe namespace's character device, /dev/ngXnY)",
                ))
            }
            EngineKind::Null | EngineKind::Mem if self.size.is_none() => {
                return Err(ConfigError::Required(
                    "size=BYTES is required with engine=null and engine=mem",
                ))
            }
            EngineKind::Rbd => self.rbd.check()?,
            _ => {}
        }
        if self.format == ImageFormat::Qcow2 {
            if self.engine != EngineKind::Uring {
                return Err(ConfigError::Conflict {
                    key: "format",
                    value: "qcow2".into(),
                    why:
                        "a qcow2 image is served by engine=uring (a file or block device on path=)"
                            .into(),
                });
            }
            self.qcow2.check()?;
        } else {
            self.refuse_keys(qcow2::KEYS, "only format=qcow2 takes this key")?;
        }
        if self.engine == EngineKind::Uring {
            if self.qcow2.backing.is_some() {
                self.refuse_keys(&["preallocation"], preallocation::OVERLAY)?;
            }
            self.preallocation.check(self.format)?;
        } else {
            self.refuse_keys(
                &["preallocation"],
                "only engine=uring creates and grows image files",
            )?;
        }
        if self.engine != EngineKind::Rbd {
            self.refuse_keys(rbd::KEYS, "only engine=rbd takes this key")?;
        }
        if self.engine != EngineKind::Null {
            self.refuse_keys(&["read-zeroes"], "only engine=null takes this key")?;
        }
        if !self.cpus.is_empty() && self.cpus.len() < self.num_threads() {
            return Err(ConfigError::Invalid {
                key: "cpus",
                value: format!("{:?}", self.cpus),
                allowed:
                    "at least one CPU per I/O thread (threads = queues with threads=per-queue)",
            });
        }
        if self.tuning.poll_max_us == 0 {
            self.tuning.poll = PollMode::Off;
        }
        if let Some(q) = &self.qos {
            q.check()?;
        }
        Ok(())
    }
}

/// An export's default id: its socket's file name without the extension, with any character
/// an id may not hold replaced by '_'.
fn default_id(socket: &std::path::Path) -> String {
    let stem = socket
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let id: String = stem
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if id.is_empty() {
        "export".into()
    } else {
        id
    }
}

/// Applies `(key, value)` pairs to a default export, each key found by `lookup` (which says
/// why a name is refused) and given at most once.
fn apply_pairs<'a>(
    pairs: impl IntoIterator<Item = (&'a str, String)>,
    lookup: impl Fn(&str) -> Result<&'static keys::Key, ConfigError>,
) -> Result<ExportConfig, ConfigError> {
    let mut cfg = ExportConfig::default();
    let mut seen: Vec<&'static str> = Vec::new();
    for (name, value) in pairs {
        let key = lookup(name)?;
        if seen.contains(&key.name) {
            return Err(ConfigError::Duplicate(name.into()));
        }
        seen.push(key.name);
        key.apply(&mut cfg, &value).ok_or(ConfigError::Invalid {
            key: key.name,
            value,
            allowed: key.allowed,
        })?;
    }
    Ok(cfg)
}

/// QoS settings alone from `(key, value)` pairs (the management API's `export_set_qos`):
/// every key must be a QoS key; no key at all means no limit.
pub fn qos_from_pairs<'a>(
    pairs: impl IntoIterator<Item = (&'a str, String)>,
) -> Result<QosConfig, ConfigError> {
    let cfg = apply_pairs(pairs, |name| {
        keys::key(name)
            .filter(|k| keys::is_qos_key(k.name))
            .ok_or_else(|| ConfigError::NotQos(name.into()))
    })?;
    let qos = cfg.qos.unwrap_or_default();
    qos.check()?;
    Ok(qos)
}

/// Parses one `--export` spec: `key=value` pairs separated by commas.
pub fn parse_export_spec(spec: &str) -> Result<ExportConfig, ConfigError> {
    let mut pairs = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| ConfigError::MissingValue(item.to_string()))?;
        pairs.push((k, v.to_string()));
    }
    ExportConfig::from_pairs(pairs)
}

/// Checks a set of exports against each other; `allow_none` when exports can come later
/// (through the management API).
pub fn check_exports(exports: &[ExportConfig], allow_none: bool) -> Result<(), ConfigError> {
    if exports.is_empty() && !allow_none {
        return Err(ConfigError::NoExport);
    }
    for (i, a) in exports.iter().enumerate() {
        if let Some(e) = exports[i + 1..].iter().find_map(|b| clash(a, b)) {
            return Err(e);
        }
    }
    Ok(())
}

/// Why exports `a` and `b` cannot both run, if they cannot: one socket path (exports on
/// inherited descriptors have none to share), one inherited descriptor, or one id.
pub fn clash(a: &ExportConfig, b: &ExportConfig) -> Option<ConfigError> {
    if !a.socket.as_os_str().is_empty() && a.socket == b.socket {
        return Some(ConfigError::SharedSocket(a.socket.display().to_string()));
    }
    if let Some(fd) = a.fd.filter(|&fd| b.fd == Some(fd)) {
        return Some(ConfigError::SharedFd(fd));
    }
    if a.id == b.id {
        return Some(ConfigError::SharedId(a.id.clone()));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_spec() {
        let c = parse_export_spec(
            "socket=/tmp/a.sock,path=/tmp/img,queues=4,queue-size=256,threads=2,cpus=0-1,readonly=on,direct=off,serial=abc",
        )
        .unwrap();
        assert_eq!(c.queues, 4);
        assert_eq!(c.queue_size, 256);
        assert_eq!(c.threads, Threads::Count(2));
        assert_eq!(c.num_threads(), 2);
        assert_eq!(c.thread_of_queue(3), 1);
        assert!(c.readonly && !c.direct);
        assert_eq!(c.cpus, vec![0, 1]);
        assert_eq!(c.mapping_name(), "grouped");
        let c =
            parse_export_spec("socket=s,path=p,poll=on,poll-max-us=100,batch-wait-us=8,merge=off")
                .unwrap();
        assert_eq!(c.tuning.poll, PollMode::On);
        assert_eq!(
            (c.tuning.poll_max_us, c.tuning.batch_wait_us, c.tuning.merge),
            (100, 8, false)
        );
        let c = parse_export_spec(
            "socket=s,path=p,fixed-files=off,fixed-buffers=on,sqpoll-idle-ms=5,coop-taskrun=off",
        )
        .unwrap();
        assert_eq!(
            (
                c.tuning.fixed_files,
                c.tuning.fixed_buffers,
                c.tuning.sqpoll_idle_ms,
                c.tuning.coop_taskrun
            ),
            (false, true, 5, false)
        );
        assert_eq!(
            parse_export_spec("socket=s,path=p").unwrap().tuning,
            Tuning::default()
        );
    }

    #[test]
    fn preallocation_names_what_each_image_takes() {
        let c = parse_export_spec("socket=s,path=p,size=1M,preallocation=falloc").unwrap();
        assert_eq!(c.preallocation, Preallocation::Falloc);
        let c = parse_export_spec("socket=s,path=p,format=qcow2,preallocation=metadata").unwrap();
        assert_eq!(c.preallocation, Preallocation::Metadata);
        for (spec, says) in [
            (
                "socket=s,path=p,preallocation=sparse",
                "invalid preallocation=sparse: off, metadata, falloc or full",
            ),
            (
                "socket=s,path=p,preallocation=metadata",
                "invalid preallocation=metadata: a raw image takes off, falloc or full",
            ),
            (
                "socket=s,path=p,format=qcow2,backing=b,backing-format=raw,preallocation=full",
                "invalid preallocation=full: an overlay (backing=) takes only preallocation=off",
            ),
            (
                "socket=s,engine=mem,size=1M,preallocation=full",
                "invalid preallocation=full: only engine=uring creates and grows image files",
            ),
        ] {
            let e = parse_export_spec(spec).unwrap_err().to_string();
            assert!(e.contains(says), "{spec}: {e}");
        }
    }

    #[test]
    fn ids() {
        let c = parse_export_spec("socket=/run/mqblk/vm-1.sock,path=p").unwrap();
        assert_eq!(c.id, "vm-1");
        let c = parse_export_spec("socket=/run/x y.sock,path=p,id=disk.0").unwrap();
        assert_eq!(c.id, "disk.0");
        assert_eq!(
            parse_export_spec("socket=/run/x y.sock,path=p").unwrap().id,
            "x_y"
        );
        let e = parse_export_spec("socket=s,path=p,id=a/b")
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid id=a/b"), "{e}");
        let a = parse_export_spec("socket=/a/s.sock,path=p").unwrap();
        let b = parse_export_spec("socket=/b/s.sock,path=p").unwrap();
        let e = check_exports(&[a, b], false).unwrap_err().to_string();
        assert!(e.contains("id=s"), "{e}");
    }

    #[test]
    fn socket_or_inherited_fd() {
        let c = parse_export_spec("fd=3,engine=null,size=1M").unwrap();
        assert_eq!((c.fd, c.id.as_str()), (Some(3), "fd-3"));
        assert!(c.socket.as_os_str().is_empty());
        let c = parse_export_spec("fd=0,id=vm1,engine=null,size=1M").unwrap();
        assert_eq!((c.fd, c.id.as_str()), (Some(0), "vm1"));
        let e = |s: &str| parse_export_spec(s).unwrap_err().to_string();
        assert!(e("engine=null,size=1M").contains("socket=PATH is required"));
        assert!(e("engine=null,size=1M").contains("fd=N"));
        let both = e("socket=s,fd=3,engine=null,size=1M");
        assert!(
            both.contains("socket= and fd= exclude each other"),
            "{both}"
        );
        for bad in ["-1", "x", "2147483648", ""] {
            let msg = e(&format!("fd={bad},engine=null,size=1M"));
            assert!(
                msg.contains(&format!("invalid fd={bad}")) && msg.contains("file descriptor"),
                "{msg}"
            );
        }
        let a = parse_export_spec("fd=3,id=a,engine=null,size=1M").unwrap();
        let b = parse_export_spec("fd=3,id=b,engine=null,size=1M").unwrap();
        let e = check_exports(&[a.clone(), b], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("fd=3"), "{e}");
        // Exports on inherited sockets have no path to share.
        let b = parse_export_spec("fd=4,id=b,engine=null,size=1M").unwrap();
        assert!(clash(&a, &b).is_none());
        assert!(matches!(clash(&a, &a), Some(ConfigError::SharedFd(3))));
        check_exports(&[a, b], false).unwrap();
    }

    #[test]
    fn poll_modes() {
        for (v, mode) in [
            ("adaptive", PollMode::Adaptive),
            ("on", PollMode::On),
            ("off", PollMode::Off),
        ] {
            let c = parse_export_spec(&format!("socket=s,path=p,poll={v}")).unwrap();
            assert_eq!(c.tuning.poll, mode);
        }
        assert!(parse_export_spec("socket=s,path=p,poll=sometimes").is_err());
    }

    #[test]
    fn defaults_and_mappings() {
        let c = parse_export_spec("socket=s,path=p").unwrap();
        assert_eq!(
            (c.queues, c.queue_size, c.direct, c.readonly),
            (1, 1024, true, false)
        );
        assert_eq!(c.engine, EngineKind::Uring);
        assert_eq!(c.mapping_name(), "baseline");
        let c = parse_export_spec("socket=s,engine=null,size=1G,queues=4,threads=1").unwrap();
        assert_eq!(c.mapping_name(), "mq");
        let c = parse_export_spec("socket=s,engine=mem,size=1G,queues=4").unwrap();
        assert_eq!(c.mapping_name(), "per-queue");
        assert_eq!(c.num_threads(), 4);
    }

    #[test]
    fn errors_name_the_key() {
        let e = |s: &str| parse_export_spec(s).unwrap_err().to_string();
        assert!(e("path=p").contains("socket=PATH is required"));
        assert!(e("socket=s").contains("path=PATH is required"));
        assert!(e("socket=s,engine=null").contains("size=BYTES is required"));
        let zeroes = e("socket=s,path=p,read-zeroes=off");
        assert!(
            zeroes.contains("read-zeroes") && zeroes.contains("only engine=null"),
            "{zeroes}"
        );
        assert!(e("socket=s,engine=null,size=1M,read-zeroes=maybe").contains("on or off"));
        assert!(
            !parse_export_spec("socket=s,engine=null,size=1M,read-zeroes=off")
                .unwrap()
                .read_zeroes
        );
        assert!(
            e("socket=s,engine=foo").contains("engine=foo")
                && e("socket=s,engine=foo").contains("uring, null, mem, rbd or nvme")
        );
        assert!(e("socket=s,path=p,queues=0").contains("queues"));
        assert!(e("socket=s,path=p,queues=65").contains("1 to 64"));
        assert!(e("socket=s,path=p,queue-size=100").contains("power of two"));
        assert!(e("socket=s,path=p,threads=x").contains("per-queue"));
        assert!(e("socket=s,path=p,readonly=maybe").contains("on or off"));
        assert!(e("socket=s,path=p,size=7").contains("multiple of 512"));
        assert!(e("socket=s,path=p,bogus=1").contains("unknown key 'bogus'"));
        assert!(e("socket=s,path=p,queues").contains("no value"));
        assert!(e("socket=s,socket=t,path=p").contains("twice"));
        assert!(e("socket=s,path=p,serial=123456789012345678901").contains("20 bytes"));
        assert!(e("socket=s,path=p,queues=4,cpus=0-1").contains("cpus"));
        assert!(e("socket=s,path=p,poll=maybe").contains("off, on or adaptive"));
        for key in ["conf", "keyring"] {
            let msg = e(&format!(
                "socket=s,engine=rbd,pool=p,image=i,{key}=/etc/a\0b"
            ));
            assert!(
                msg.contains(&format!("{key}=")) && msg.contains("without NUL bytes"),
                "{msg}"
            );
        }
        assert!(e("socket=s,path=p,poll-max-us=x").contains("poll-max-us"));
        assert!(e("socket=s,path=p,batch-wait-us=5000").contains("batch-wait-us"));
        assert!(e("socket=s,path=p,merge=2").contains("merge"));
        assert!(e("socket=s,path=p,fixed-files=maybe").contains("fixed-files"));
        assert!(e("socket=s,path=p,fixed-buffers=1x").contains("fixed-buffers"));
        assert!(e("socket=s,path=p,sqpoll-idle-ms=-1").contains("sqpoll-idle-ms"));
        assert!(e("socket=s,path=p,sqpoll-idle-ms=20000").contains("0 to 10000"));
        assert!(e("socket=s,path=p,coop-taskrun=sometimes").contains("coop-taskrun"));
    }

    #[test]
    fn qos_keys() {
        assert_eq!(parse_export_spec("socket=s,path=p").unwrap().qos, None);
        let c = parse_export_spec(
            "socket=s,path=p,iops-read=100,iops-read-max=1000,iops-read-max-length=60,\
             iops-write=50,bps-total=10M,bps-total-max=20M,iops-size=16K,group=g.1",
        )
        .unwrap();
        let q = c.qos.unwrap();
        assert_eq!(
            q.iops_read,
            qos::Limit {
                rate: 100,
                max: 1000,
                max_length: 60
            }
        );
        assert_eq!((q.iops_write.rate, q.iops_total.rate), (50, 0));
        assert_eq!((q.bps_total.rate, q.bps_total.max), (10 << 20, 20 << 20));
        assert_eq!((q.iops_size, q.group.as_deref()), (16384, Some("g.1")));
        assert!(q.is_limited());
        // A group alone is QoS configured without a limit.
        let q = parse_export_spec("socket=s,path=p,group=g")
            .unwrap()
            .qos
            .unwrap();
        assert!(!q.is_limited());
        let e = |s: &str| parse_export_spec(s).unwrap_err().to_string();
        assert!(e("socket=s,path=p,iops-total=x").contains("invalid iops-total=x"));
        assert!(e("socket=s,path=p,bps-read=1Q").contains("K/M/G/T"));
        assert!(e("socket=s,path=p,iops-total=1,iops-total-max-length=0").contains("1 to"));
        assert!(e("socket=s,path=p,group=a/b").contains("invalid group=a/b"));
        let conflict = e("socket=s,path=p,iops-total=100,iops-write=10");
        assert!(
            conflict.contains("invalid iops-write=10") && conflict.contains("iops-total"),
            "{conflict}"
        );
        let conflict = e("socket=s,path=p,bps-write=100,bps-write-max=10");
        assert!(conflict.contains("invalid bps-write-max=10"), "{conflict}");
        let (ex, _) = parse_config_file(
            "[[export]]\nsocket='a'\npath='p'\niops-total=2000\niops-total-max='4000'\n",
        )
        .unwrap();
        let q = ex[0].qos.as_ref().unwrap();
        assert_eq!((q.iops_total.rate, q.iops_total.max), (2000, 4000));
    }

    #[test]
    fn rbd_keys() {
        let e = |s: &str| parse_export_spec(s).unwrap_err().to_string();
        let rbd_only = e("socket=s,path=p,pool=rbd");
        assert!(
            rbd_only.contains("invalid pool=rbd") && rbd_only.contains("engine=rbd"),
            "{rbd_only}"
        );
        assert!(e("socket=s,path=p,timeout=5").contains("only engine=rbd"));
        assert!(e("socket=s,engine=rbd,pool=a/b,image=i").contains("invalid pool=a/b"));
        assert!(e("socket=s,engine=rbd,pool=p,image=i,timeout=0").contains("1 to 3600"));
        assert!(e("socket=s,engine=rbd,pool=p,image=i,user=a b").contains("invalid user=a b"));
        if rbd::BUILT {
            assert!(
                e("socket=s,engine=rbd,pool=p").contains("pool=NAME and image=NAME are required")
            );
            let c = parse_export_spec(
                "socket=s,engine=rbd,pool=p,image=i,namespace=n,conf=/c,keyring=/k",
            )
            .unwrap();
            assert_eq!(c.rbd.spec(), "p/n/i");
            assert_eq!(
                (c.rbd.user.as_str(), c.rbd.timeout_s),
                ("admin", rbd::DEFAULT_TIMEOUT_S)
            );
            assert_eq!(c.rbd.keyring.as_deref(), Some(std::path::Path::new("/k")));
        } else {
            let msg = e("socket=s,engine=rbd,pool=p,image=i");
            assert!(msg.contains("--features rbd"), "{msg}");
        }
    }

    #[test]
    fn no_exports() {
        assert!(check_exports(&[], false).is_err());
        assert!(check_exports(&[], true).is_ok());
    }
}
