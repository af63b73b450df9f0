//! [`HostInfo`]: the machine a run was measured on, recorded with its results.

use serde::Serialize;

/// Machine facts recorded with the results.
#[derive(Debug, Clone, Serialize)]
pub struct HostInfo {
    /// UTC date and time the run started.
    pub date: String,
    /// Online CPUs.
    pub nproc: usize,
    /// /proc/cpuinfo model name.
    pub cpu_model: String,
    /// Kernel release.
    pub kernel: String,
    /// /proc/loadavg at the start.
    pub loadavg: String,
    /// mqblk's version.
    pub mqblk_version: String,
}

impl HostInfo {
    /// Reads them now.
    pub fn collect() -> HostInfo {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu_model = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let loadavg = read("/proc/loadavg")
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        HostInfo {
            date: utc_now(),
            nproc: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_model,
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            loadavg,
            mqblk_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format_utc(secs)
}

/// `YYYY-MM-DD HH:MM:SS UTC` for seconds since the epoch.
pub fn format_utc(secs: u64) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_utc(951_782_400 + 3661), "2000-02-29 01:01:01 UTC");
        assert_eq!(format_utc(1_767_225_599), "2025-12-31 23:59:59 UTC");
    }
}
