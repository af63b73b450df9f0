//! An export's QoS settings: QEMU's throttling limits (`iops-total`, `bps-read-max`, ...),
//! `iops-size` and the throttle group, with QEMU's rules for which combinations make sense.
//!
//! Each limit is a leaky bucket (`io::qos::buckets` has the arithmetic): `rate` units per
//! second on average, and optionally bursts at up to `max` per second for `max_length`
//! seconds. A rate of 0 means no limit.

use serde::Serialize;

use super::ConfigError;

/// Largest rate or burst rate, as in QEMU (`THROTTLE_VALUE_MAX`).
pub const MAX_RATE: u64 = 1_000_000_000_000_000;

/// Longest burst, in seconds (the product with the burst rate is bounded by [`MAX_RATE`] too).
pub const MAX_BURST_LENGTH: u64 = 1_000_000_000;

/// One limit: a rate, and a burst above it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limit {
    /// Units (requests or bytes) per second on average; 0: unlimited.
    pub rate: u64,
    /// Burst rate in units per second; 0: no burst beyond a tenth of a second at `rate`.
    pub max: u64,
    /// Seconds a burst at `max` may last (at least 1).
    pub max_length: u64,
}

impl Default for Limit {
    fn default() -> Self {
        Limit {
            rate: 0,
            max: 0,
            max_length: 1,
        }
    }
}

/// The six limits, by what they count. The order is the one of [`QosConfig::limits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bucket {
    /// Requests, reads and writes together.
    IopsTotal,
    /// Read requests.
    IopsRead,
    /// Write requests.
    IopsWrite,
    /// Bytes, read and written together.
    BpsTotal,
    /// Bytes read.
    BpsRead,
    /// Bytes written.
    BpsWrite,
}

/// The name of a limit's rate key, by its [`Bucket`] variant (`limit_key!(IopsTotal)` is
/// `"iops-total"`); its burst rate's and burst length's keys add `-max` and `-max-length`.
/// The one place the names are spelled: a macro, so that the key table can also write them
/// into its help text at compile time.
macro_rules! limit_key {
    (IopsTotal) => {
        "iops-total"
    };
    (IopsRead) => {
        "iops-read"
    };
    (IopsWrite) => {
        "iops-write"
    };
    (BpsTotal) => {
        "bps-total"
    };
    (BpsRead) => {
        "bps-read"
    };
    (BpsWrite) => {
        "bps-write"
    };
}
pub(super) use limit_key;

impl Bucket {
    /// All six, in the order of [`QosConfig::limits`].
    pub const ALL: [Bucket; 6] = [
        Bucket::IopsTotal,
        Bucket::IopsRead,
        Bucket::IopsWrite,
        Bucket::BpsTotal,
        Bucket::BpsRead,
        Bucket::BpsWrite,
    ];

    /// The keys of this limit: `(rate, burst rate, burst length)`.
    pub const fn keys(self) -> (&'static str, &'static str, &'static str) {
        macro_rules! keys {
            ($bucket:ident) => {
                (
                    limit_key!($bucket),
                    concat!(limit_key!($bucket), "-max"),
                    concat!(limit_key!($bucket), "-max-length"),
                )
            };
        }
        match self {
            Bucket::IopsTotal => keys!(IopsTotal),
            Bucket::IopsRead => keys!(IopsRead),
            Bucket::IopsWrite => keys!(IopsWrite),
            Bucket::BpsTotal => keys!(BpsTotal),
            Bucket::BpsRead => keys!(BpsRead),
            Bucket::BpsWrite => keys!(BpsWrite),
        }
    }
}

/// An export's QoS: its limits, how requests are counted, and whether the limits are shared.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct QosConfig {
    /// Requests per second, reads and writes together.
    pub iops_total: Limit,
    /// Read requests per second.
    pub iops_read: Limit,
    /// Write requests per second.
    pub iops_write: Limit,
    /// Bytes per second, read and written together.
    pub bps_total: Limit,
    /// Bytes read per second.
    pub bps_read: Limit,
    /// Bytes written per second.
    pub bps_write: Limit,
    /// A request of more than this many bytes counts as `len / iops_size` requests in the
    /// iops limits (0: every request counts as one).
    pub iops_size: u64,
    /// The throttle group whose limits (and budget) this export shares; `None`: its own.
    pub group: Option<String>,
}

impl QosConfig {
    /// The limit of `b`.
    pub fn limit(&self, b: Bucket) -> &Limit {
        match b {
            Bucket::IopsTotal => &self.iops_total,
            Bucket::IopsRead => &self.iops_read,
            Bucket::IopsWrite => &self.iops_write,
            Bucket::BpsTotal => &self.bps_total,
            Bucket::BpsRead => &self.bps_read,
            Bucket::BpsWrite => &self.bps_write,
        }
    }

    /// The limit of `b`, mutably.
    pub fn limit_mut(&mut self, b: Bucket) -> &mut Limit {
        match b {
            Bucket::IopsTotal => &mut self.iops_total,
            Bucket::IopsRead => &mut self.iops_read,
            Bucket::IopsWrite => &mut self.iops_write,
            Bucket::BpsTotal => &mut self.bps_total,
            Bucket::BpsRead => &mut self.bps_read,
            Bucket::BpsWrite => &mut self.bps_write,
        }
    }

    /// The six limits, in the order of [`Bucket::ALL`].
    pub fn limits(&self) -> [Limit; 6] {
        Bucket::ALL.map(|b| *self.limit(b))
    }

    /// Whether any limit is set (QEMU's `throttle_enabled`): without one, requests are never
    /// held back and the I/O threads skip admission altogether.
    pub fn is_limited(&self) -> bool {
        Bucket::ALL.iter().any(|&b| self.limit(b).rate > 0)
    }

    /// The settings as `key=value` pairs, as an `--export` spec gives them (only what differs
    /// from the defaults; empty for no QoS at all).
    pub fn to_spec(&self) -> String {
        let mut kv = Vec::new();
        for b in Bucket::ALL {
            let l = self.limit(b);
            let (rate, max, len) = b.keys();
            if l.rate > 0 {
                kv.push(format!("{rate}={}", l.rate));
            }
            if l.max > 0 {
                kv.push(format!("{max}={}", l.max));
            }
            if l.max_length > 1 {
                kv.push(format!("{len}={}", l.max_length));
            }
        }
        if self.iops_size > 0 {
            kv.push(format!("iops-size={}", self.iops_size));
        }
        if let Some(g) = &self.group {
            kv.push(format!("group={g}"));
        }
        kv.join(",")
    }

    /// The same limits, without the group: what members of one group must agree on.
    pub fn without_group(&self) -> QosConfig {
        QosConfig {
            group: None,
            ..self.clone()
        }
    }

    /// QEMU's rules (`throttle_is_valid`), each error naming the offending key: a burst rate
    /// needs a rate and may not be below it, a burst length needs a burst rate, a total limit
    /// excludes per-direction ones of its kind, `iops-size` needs an iops limit.
    pub fn check(&self) -> Result<(), ConfigError> {
        let conflict = |key: &'static str, value: u64, why: String| ConfigError::Conflict {
            key,
            value: value.to_string(),
            why,
        };
        for b in Bucket::ALL {
            let l = self.limit(b);
            let (rate_key, max_key, len_key) = b.keys();
            if l.rate > MAX_RATE || l.max > MAX_RATE {
                let (key, v) = if l.rate > MAX_RATE {
                    (rate_key, l.rate)
                } else {
                    (max_key, l.max)
                };
                return Err(conflict(key, v, format!("at most {MAX_RATE}")));
            }
            if l.max_length == 0 || l.max_length > MAX_BURST_LENGTH {
                return Err(conflict(
                    len_key,
                    l.max_length,
                    format!("an integer from 1 to {MAX_BURST_LENGTH} (seconds)"),
                ));
            }
            if l.max > 0 && l.rate == 0 {
                return Err(conflict(
                    max_key,
                    l.max,
                    format!("needs {rate_key} (a burst rate above a rate)"),
                ));
            }
            if l.max > 0 && l.max < l.rate {
                return Err(conflict(
                    max_key,
                    l.max,
                    format!(
                        "at least {rate_key}={} (a burst rate is not below the rate)",
                        l.rate
                    ),
                ));
            }
            if l.max_length > 1 && l.max == 0 {
                return Err(conflict(
                    len_key,
                    l.max_length,
                    format!(
                        "needs {max_key} (a burst length is the length of a burst at that rate)"
                    ),
                ));
            }
            if l.max.saturating_mul(l.max_length) > MAX_RATE {
                return Err(conflict(
                    len_key,
                    l.max_length,
                    format!(
                        "at most {} with {max_key}={} (their product is at most {MAX_RATE})",
                        MAX_RATE / l.max,
                        l.max
                    ),
                ));
            }
        }
        for (total, read, write) in [
            (Bucket::IopsTotal, Bucket::IopsRead, Bucket::IopsWrite),
            (Bucket::BpsTotal, Bucket::BpsRead, Bucket::BpsWrite),
        ] {
            let t = self.limit(total);
            for dir in [read, write] {
                let d = self.limit(dir);
                let (t_rate, t_max, _) = total.keys();
                let (d_rate, d_max, _) = dir.keys();
                if t.rate > 0 && d.rate > 0 {
                    return Err(conflict(
                        d_rate,
                        d.rate,
                        format!("not together with {t_rate} (as in QEMU: a total limit, or read and write limits)"),
                    ));
                }
                if t.max > 0 && d.max > 0 {
                    return Err(conflict(
                        d_max,
                        d.max,
                        format!("not together with {t_max} (as in QEMU: a total limit, or read and write limits)"),
                    ));
                }
            }
        }
        let iops = [Bucket::IopsTotal, Bucket::IopsRead, Bucket::IopsWrite];
        if self.iops_size > 0 && iops.iter().all(|&b| self.limit(b).rate == 0) {
            return Err(conflict(
                "iops-size",
                self.iops_size,
                "needs an iops limit (iops-total, iops-read or iops-write)".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut QosConfig)) -> Result<(), String> {
        let mut q = QosConfig::default();
        f(&mut q);
        q.check().map_err(|e| e.to_string())
    }

    #[test]
    fn unlimited_by_default() {
        let q = QosConfig::default();
        assert!(!q.is_limited());
        assert_eq!(q.check(), Ok(()));
        assert_eq!(q.iops_total.max_length, 1);
    }

    #[test]
    fn qemu_rules_name_the_key() {
        let e = with(|q| q.iops_total.max = 10).unwrap_err();
        assert!(
            e.contains("iops-total-max=10") && e.contains("needs iops-total"),
            "{e}"
        );
        let e = with(|q| {
            q.bps_read = Limit {
                rate: 100,
                max: 50,
                max_length: 1,
            }
        })
        .unwrap_err();
        assert!(
            e.contains("bps-read-max=50") && e.contains("at least bps-read=100"),
            "{e}"
        );
        let e = with(|q| {
            q.iops_write = Limit {
                rate: 100,
                max: 0,
                max_length: 5,
            }
        })
        .unwrap_err();
        assert!(
            e.contains("iops-write-max-length=5") && e.contains("needs iops-write-max"),
            "{e}"
        );
        let e = with(|q| {
            q.iops_total.rate = 100;
            q.iops_read.rate = 50;
        })
        .unwrap_err();
        assert!(
            e.contains("iops-read=50") && e.contains("not together with iops-total"),
            "{e}"
        );
        let e = with(|q| {
            q.bps_total = Limit {
                rate: 100,
                max: 200,
                max_length: 1,
            };
            q.bps_write = Limit {
                rate: 0,
                max: 0,
                max_length: 1,
            };
            q.bps_read = Limit {
                rate: 0,
                max: 300,
                max_length: 1,
            };
        })
        .unwrap_err();
        assert!(e.contains("bps-read-max=300"), "{e}");
        let e = with(|q| q.iops_size = 4096).unwrap_err();
        assert!(
            e.contains("iops-size=4096") && e.contains("needs an iops limit"),
            "{e}"
        );
        let e = with(|q| {
            q.bps_total = Limit {
                rate: 1,
                max: MAX_RATE,
                max_length: 2,
            }
        })
        .unwrap_err();
        assert!(e.contains("bps-total-max-length=2"), "{e}");
        let e = with(|q| q.iops_total.max_length = 0).unwrap_err();
        assert!(e.contains("iops-total-max-length=0"), "{e}");
    }

    #[test]
    fn valid_combinations() {
        assert_eq!(
            with(|q| {
                q.iops_read = Limit {
                    rate: 100,
                    max: 1000,
                    max_length: 60,
                };
                q.iops_write.rate = 50;
                q.bps_total.rate = 1 << 20;
                q.iops_size = 4096;
                q.group = Some("g".into());
            }),
            Ok(())
        );
        let mut q = QosConfig::default();
        q.bps_write.rate = 1;
        assert!(q.is_limited());
        q.group = Some("a".into());
        assert_eq!(q.without_group().group, None);
        q.iops_read = Limit {
            rate: 10,
            max: 20,
            max_length: 3,
        };
        assert_eq!(
            q.to_spec(),
            "iops-read=10,iops-read-max=20,iops-read-max-length=3,bps-write=1,group=a"
        );
        assert_eq!(QosConfig::default().to_spec(), "");
    }
}
