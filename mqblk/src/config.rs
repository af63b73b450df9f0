//! Export settings: parse and validate `--export SPEC` strings and TOML files into typed config.
//!
//! Every error names the offending key and the values it accepts, because operators and scripts
//! read these messages.

use std::path::PathBuf;

use serde::Deserialize;
use thiserror::Error;

use crate::queue::poll::PollMode;
use crate::queue::worker::Tuning;

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
    #[error("unknown key '{0}' (known keys: socket, path, engine, size, queues, queue-size, threads, cpus, readonly, direct, serial, poll, poll-max-us, batch-wait-us, merge, fixed-files, fixed-buffers, sqpoll-idle-ms, coop-taskrun)")]
    UnknownKey(String),
    /// A key given without `=value`.
    #[error("'{0}' has no value: write {0}=VALUE")]
    MissingValue(String),
    /// A key given twice.
    #[error("key '{0}' is given twice")]
    Duplicate(String),
    /// A required key is absent.
    #[error("{0}")]
    Required(&'static str),
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
}

/// Which storage engine serves an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// io_uring on a raw image file or block device.
    Uring,
    /// Completes every request at once; reads return zeros. Measures the backend itself.
    Null,
    /// A RAM disk (a memfd served through the io_uring engine).
    Mem,
}

/// How the export's queues map to I/O threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// One I/O thread per queue (the default).
    PerQueue,
    /// This many threads; queue q is served by thread q % N.
    Count(u16),
}

/// One export: a disk served on one vhost-user socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    /// The vhost-user unix socket to listen on.
    pub socket: PathBuf,
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
    /// Polling, batch-wait and merging settings.
    pub tuning: Tuning,
}

impl ExportConfig {
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
}

/// Parses a size with an optional K/M/G/T suffix (powers of 1024), e.g. `64M`.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        (i, 't' | 'T') => (&s[..i], 1 << 40),
        (_, c) if c.is_ascii_digit() => (s, 1),
        _ => return None,
    };
    let n: u64 = num.parse().ok()?;
    n.checked_mul(mult)
}

/// Parses a CPU list such as `2-5,8`.
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split([',', ':']) {
        let part = part.trim();
        if part.is_empty() {
            return None;
        }
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if a > b || b - a > 4096 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

fn parse_bool(key: &'static str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(ConfigError::Invalid {
            key,
            value: v.into(),
            allowed: "on or off",
        }),
    }
}

/// Raw key/values before validation; shared by the CLI and TOML front ends.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct RawExport {
    socket: Option<String>,
    path: Option<String>,
    engine: Option<String>,
    size: Option<toml::Value>,
    queues: Option<toml::Value>,
    queue_size: Option<toml::Value>,
    threads: Option<toml::Value>,
    cpus: Option<toml::Value>,
    readonly: Option<toml::Value>,
    direct: Option<toml::Value>,
    serial: Option<String>,
    poll: Option<String>,
    poll_max_us: Option<toml::Value>,
    batch_wait_us: Option<toml::Value>,
    merge: Option<toml::Value>,
    fixed_files: Option<toml::Value>,
    fixed_buffers: Option<toml::Value>,
    sqpoll_idle_ms: Option<toml::Value>,
    coop_taskrun: Option<toml::Value>,
}

fn value_str(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Boolean(b) => if *b { "on" } else { "off" }.to_string(),
        other => other.to_string(),
    }
}

impl RawExport {
    /// Parses `key=value,key=value`.
    pub fn from_spec(spec: &str) -> Result<Self, ConfigError> {
        let mut raw = RawExport::default();
        for item in spec.split(',') {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| ConfigError::MissingValue(item.to_string()))?;
            let val = || toml::Value::String(v.to_string());
            let slot_str = |slot: &mut Option<String>| {
                if slot.is_some() {
                    return Err(ConfigError::Duplicate(k.to_string()));
                }
                *slot = Some(v.to_string());
                Ok(())
            };
            let slot_val = |slot: &mut Option<toml::Value>| {
                if slot.is_some() {
                    return Err(ConfigError::Duplicate(k.to_string()));
                }
                *slot = Some(val());
                Ok(())
            };
            match k {
                "socket" => slot_str(&mut raw.socket)?,
                "path" => slot_str(&mut raw.path)?,
                "engine" => slot_str(&mut raw.engine)?,
                "serial" => slot_str(&mut raw.serial)?,
                "poll" => slot_str(&mut raw.poll)?,
                "poll-max-us" => slot_val(&mut raw.poll_max_us)?,
                "batch-wait-us" => slot_val(&mut raw.batch_wait_us)?,
                "merge" => slot_val(&mut raw.merge)?,
                "fixed-files" => slot_val(&mut raw.fixed_files)?,
                "fixed-buffers" => slot_val(&mut raw.fixed_buffers)?,
                "sqpoll-idle-ms" => slot_val(&mut raw.sqpoll_idle_ms)?,
                "coop-taskrun" => slot_val(&mut raw.coop_taskrun)?,
                "size" => slot_val(&mut raw.size)?,
                "queues" => slot_val(&mut raw.queues)?,
                "queue-size" => slot_val(&mut raw.queue_size)?,
                "threads" => slot_val(&mut raw.threads)?,
                "cpus" => slot_val(&mut raw.cpus)?,
                "readonly" => slot_val(&mut raw.readonly)?,
                "direct" => slot_val(&mut raw.direct)?,
                _ => return Err(ConfigError::UnknownKey(k.to_string())),
            }
        }
        Ok(raw)
    }

    /// Validates into an [`ExportConfig`].
    pub fn validate(self) -> Result<ExportConfig, ConfigError> {
        let socket = self
            .socket
            .filter(|s| !s.is_empty())
            .ok_or(ConfigError::Required(
                "socket=PATH is required (the vhost-user unix socket to listen on)",
            ))?;
        let engine = match self.engine.as_deref() {
            None | Some("uring") => EngineKind::Uring,
            Some("null") => EngineKind::Null,
            Some("mem") => EngineKind::Mem,
            Some(v) => {
                return Err(ConfigError::Invalid {
                    key: "engine",
                    value: v.into(),
                    allowed: "uring, null or mem",
                })
            }
        };
        let size = match &self.size {
            None => None,
            Some(v) => {
                let s = value_str(v);
                let n = parse_size(&s).filter(|n| *n > 0 && n % 512 == 0).ok_or(
                    ConfigError::Invalid {
                        key: "size",
                        value: s,
                        allowed: "a positive multiple of 512 bytes, with optional K/M/G/T suffix",
                    },
                )?;
                Some(n)
            }
        };
        let path = self.path.filter(|p| !p.is_empty()).map(PathBuf::from);
        match engine {
            EngineKind::Uring if path.is_none() => {
                return Err(ConfigError::Required(
                    "path=PATH is required with engine=uring (a raw image file or block device)",
                ))
            }
            EngineKind::Null | EngineKind::Mem if size.is_none() => {
                return Err(ConfigError::Required(
                    "size=BYTES is required with engine=null and engine=mem",
                ))
            }
            _ => {}
        }
        let int = |key: &'static str,
                   v: &Option<toml::Value>,
                   allowed: &'static str,
                   lo: u64,
                   hi: u64|
         -> Result<Option<u64>, ConfigError> {
            match v {
                None => Ok(None),
                Some(v) => {
                    let s = value_str(v);
                    match s.parse::<u64>() {
                        Ok(n) if n >= lo && n <= hi => Ok(Some(n)),
                        _ => Err(ConfigError::Invalid {
                            key,
                            value: s,
                            allowed,
                        }),
                    }
                }
            }
        };
        let queues = int(
            "queues",
            &self.queues,
            "an integer from 1 to 64",
            1,
            MAX_QUEUES as u64,
        )?
        .unwrap_or(1) as u16;
        let queue_size = match int(
            "queue-size",
            &self.queue_size,
            "a power of two from 2 to 32768",
            2,
            MAX_QUEUE_SIZE as u64,
        )? {
            None => 1024,
            Some(n) if n.is_power_of_two() => n as u16,
            Some(n) => {
                return Err(ConfigError::Invalid {
                    key: "queue-size",
                    value: n.to_string(),
                    allowed: "a power of two from 2 to 32768",
                })
            }
        };
        let threads = match self.threads.as_ref().map(value_str).as_deref() {
            None | Some("per-queue") => Threads::PerQueue,
            Some(s) => match s.parse::<u16>() {
                Ok(n) if (1..=MAX_QUEUES).contains(&n) => Threads::Count(n),
                _ => {
                    return Err(ConfigError::Invalid {
                        key: "threads",
                        value: s.into(),
                        allowed: "per-queue, or a thread count from 1 to 64",
                    })
                }
            },
        };
        let cpus = match self.cpus.as_ref().map(value_str) {
            None => Vec::new(),
            Some(s) => {
                let online = std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1);
                let list =
                    parse_cpu_list(&s)
                        .filter(|l| !l.is_empty())
                        .ok_or(ConfigError::Invalid {
                            key: "cpus",
                            value: s.clone(),
                            allowed: "a CPU list such as 0-3,8",
                        })?;
                if list.iter().any(|&c| c >= 1024) {
                    return Err(ConfigError::Invalid {
                        key: "cpus",
                        value: s,
                        allowed: "CPU numbers below 1024",
                    });
                }
                let _ = online;
                list
            }
        };
        let readonly = match &self.readonly {
            None => false,
            Some(v) => parse_bool("readonly", &value_str(v))?,
        };
        let direct = match &self.direct {
            None => true,
            Some(v) => parse_bool("direct", &value_str(v))?,
        };
        let serial = self.serial.unwrap_or_else(|| "mqblk".to_string());
        if serial.len() > MAX_SERIAL_LEN {
            return Err(ConfigError::Invalid {
                key: "serial",
                value: serial,
                allowed: "at most 20 bytes",
            });
        }
        let mut tuning = Tuning::default();
        if let Some(p) = &self.poll {
            tuning.poll = p.parse().map_err(|_| ConfigError::Invalid {
                key: "poll",
                value: p.clone(),
                allowed: "off, on or adaptive",
            })?;
        }
        if let Some(n) = int(
            "poll-max-us",
            &self.poll_max_us,
            "an integer from 0 to 10000 (microseconds)",
            0,
            10_000,
        )? {
            tuning.poll_max_us = n as u32;
        }
        if let Some(n) = int(
            "batch-wait-us",
            &self.batch_wait_us,
            "an integer from 0 to 1000 (microseconds; 0 disables)",
            0,
            1000,
        )? {
            tuning.batch_wait_us = n as u32;
        }
        if let Some(v) = &self.merge {
            tuning.merge = parse_bool("merge", &value_str(v))?;
        }
        if let Some(v) = &self.fixed_files {
            tuning.fixed_files = parse_bool("fixed-files", &value_str(v))?;
        }
        if let Some(v) = &self.fixed_buffers {
            tuning.fixed_buffers = parse_bool("fixed-buffers", &value_str(v))?;
        }
        if let Some(v) = &self.coop_taskrun {
            tuning.coop_taskrun = parse_bool("coop-taskrun", &value_str(v))?;
        }
        if let Some(n) = int(
            "sqpoll-idle-ms",
            &self.sqpoll_idle_ms,
            "an integer from 0 to 10000 (milliseconds; 0 disables SQPOLL)",
            0,
            10_000,
        )? {
            tuning.sqpoll_idle_ms = n as u32;
        }
        if tuning.poll_max_us == 0 {
            tuning.poll = PollMode::Off;
        }
        let cfg = ExportConfig {
            socket: PathBuf::from(socket),
            path,
            engine,
            size,
            queues,
            queue_size,
            threads,
            cpus,
            readonly,
            direct,
            serial,
            tuning,
        };
        if !cfg.cpus.is_empty() && cfg.cpus.len() < cfg.num_threads() {
            return Err(ConfigError::Invalid {
                key: "cpus",
                value: format!("{:?}", cfg.cpus),
                allowed:
                    "at least one CPU per I/O thread (threads = queues with threads=per-queue)",
            });
        }
        Ok(cfg)
    }
}

/// Parses one `--export` spec.
pub fn parse_export_spec(spec: &str) -> Result<ExportConfig, ConfigError> {
    RawExport::from_spec(spec)?.validate()
}

/// A TOML config file: `[[export]]` tables with the same keys as `--export`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    export: Vec<RawExport>,
    #[serde(rename = "log-level")]
    log_level: Option<String>,
}

/// Reads a TOML config file into exports and an optional log level.
pub fn parse_config_file(text: &str) -> Result<(Vec<ExportConfig>, Option<String>), String> {
    let file: ConfigFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (i, raw) in file.export.into_iter().enumerate() {
        out.push(
            raw.validate()
                .map_err(|e| format!("[[export]] #{}: {e}", i + 1))?,
        );
    }
    Ok((out, file.log_level))
}

/// Checks a set of exports against each other.
pub fn check_exports(exports: &[ExportConfig]) -> Result<(), String> {
    if exports.is_empty() {
        return Err("no export given: pass --export socket=PATH,path=IMAGE (see --help)".into());
    }
    for (i, a) in exports.iter().enumerate() {
        for b in &exports[i + 1..] {
            if a.socket == b.socket {
                return Err(format!(
                    "two exports use socket={}: each export needs its own socket",
                    a.socket.display()
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("4K"), Some(4096));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("2g"), Some(2 << 30));
        assert_eq!(parse_size("1T"), Some(1 << 40));
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("12Q"), None);
        assert_eq!(parse_size("99999999999999T"), None);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("2-5,8"), Some(vec![2, 3, 4, 5, 8]));
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list("5-2"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert_eq!(parse_cpu_list("1,,2"), None);
    }

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
        assert!(
            e("socket=s,engine=foo").contains("engine=foo")
                && e("socket=s,engine=foo").contains("uring, null or mem")
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
    fn toml_file() {
        let (ex, lvl) = parse_config_file(
            r#"
log-level = "debug"
[[export]]
socket = "/tmp/a.sock"
path = "/tmp/a.img"
queues = 2
readonly = true
[[export]]
socket = "/tmp/b.sock"
engine = "null"
size = "1G"
threads = "per-queue"
"#,
        )
        .unwrap();
        assert_eq!(lvl.as_deref(), Some("debug"));
        assert_eq!(ex.len(), 2);
        assert!(ex[0].readonly);
        assert_eq!(ex[0].queues, 2);
        assert_eq!(ex[1].size, Some(1 << 30));
        let err =
            parse_config_file("[[export]]\nsocket='x'\nengine='zzz'\nsize='1M'\n").unwrap_err();
        assert!(err.contains("engine=zzz"), "{err}");
        let err = parse_config_file("[[export]]\nsockett='x'\n").unwrap_err();
        assert!(err.contains("sockett"), "{err}");
        assert!(check_exports(&[]).is_err());
    }
}
