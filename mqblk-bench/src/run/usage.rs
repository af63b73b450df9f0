//! What a run cost: the backend's CPU time and memory from /proc, the client's CPU, and the
//! CPU other processes used meanwhile (a noise indicator).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

/// Waits for a child with wait4(2); returns its wait status and the CPU seconds (user + system)
/// it and its reaped descendants used.
pub(super) fn wait_rusage(child: Child) -> anyhow::Result<(i32, f64)> {
    let pid = child.id() as i32;
    let mut status = 0;
    // SAFETY: rusage is plain data; wait4 on our own unreaped child writes status and ru.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: as above; the pointers are to live locals.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e).context("waiting for fio");
        }
    }
    // The child is reaped: forget the handle without waiting again.
    drop(child);
    Ok((status, tv(ru.ru_utime) + tv(ru.ru_stime)))
}

fn tv(t: libc::timeval) -> f64 {
    t.tv_sec as f64 + t.tv_usec as f64 * 1e-6
}

/// What one run cost: the backend's CPU and memory from /proc, the client's CPU.
pub(super) struct Usage {
    pub(super) backend_cpu_s: Option<f64>,
    pub(super) client_cpu_s: f64,
    pub(super) others_cpu_pct: Option<f64>,
    pub(super) vm_hwm_kib: Option<u64>,
    pub(super) rss_anon_kib: Option<u64>,
}

/// Runs `f` (the client) while sampling the backend's memory every 50 ms; reads the backend's
/// and this process's CPU time before and after.
pub(super) fn measure<T>(pid: i32, f: impl FnOnce() -> T) -> anyhow::Result<(T, Usage)> {
    let stat = PathBuf::from(format!("/proc/{pid}/stat"));
    let status = PathBuf::from(format!("/proc/{pid}/status"));
    let cpu0 = proc_cpu_secs(&stat);
    let self0 = self_cpu_secs();
    let host0 = host_busy_secs();
    let wall0 = Instant::now();
    let done = AtomicBool::new(false);
    let (out, max_anon) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut max_anon: Option<u64> = None;
            loop {
                if let Some(m) = proc_status(&status) {
                    max_anon = max_anon.max(m.rss_anon_kib);
                }
                if done.load(Ordering::Relaxed) {
                    return max_anon;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let out = f();
        done.store(true, Ordering::Relaxed);
        (out, sampler.join().unwrap_or(None))
    });
    let cpu1 = proc_cpu_secs(&stat);
    let self1 = self_cpu_secs();
    let host1 = host_busy_secs();
    let wall = wall0.elapsed();
    let mem = proc_status(&status);
    let backend_cpu_s = match (cpu0, cpu1) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let client_cpu_s = self1 - self0;
    Ok((
        out,
        Usage {
            backend_cpu_s,
            client_cpu_s,
            others_cpu_pct: others_pct(
                host0,
                host1,
                backend_cpu_s.unwrap_or(0.0) + client_cpu_s,
                wall,
            ),
            vm_hwm_kib: mem.as_ref().and_then(|m| m.vm_hwm_kib),
            rss_anon_kib: max_anon.max(mem.and_then(|m| m.rss_anon_kib)),
        },
    ))
}

/// Busy CPU time of the whole machine so far (all CPUs), in seconds, from /proc/stat.
pub(super) fn host_busy_secs() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks = parse_host_busy_ticks(&text)?;
    Some(ticks_to_secs(ticks))
}

/// Clock ticks (the unit of /proc's CPU times) in seconds.
fn ticks_to_secs(ticks: u64) -> f64 {
    let hz = rustix::param::clock_ticks_per_second();
    ticks as f64 / if hz > 0 { hz as f64 } else { 100.0 }
}

/// user + nice + system + irq + softirq + steal of the `cpu` line of /proc/stat (ticks):
/// everything but idle and iowait.
pub fn parse_host_busy_ticks(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<Vec<u64>>>()?;
    let g = |i: usize| f.get(i).copied().unwrap_or(0);
    Some(g(0) + g(1) + g(2) + g(5) + g(6) + g(7))
}

/// CPU used by everything else on the machine during a run, in percent of all CPUs: the
/// machine's busy time minus `ours` (backend + client), over `wall`.
pub(super) fn others_pct(
    host0: Option<f64>,
    host1: Option<f64>,
    ours: f64,
    wall: Duration,
) -> Option<f64> {
    let (a, b) = (host0?, host1?);
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1) as f64;
    let secs = wall.as_secs_f64();
    (secs > 0.0).then(|| ((b - a - ours) / secs / cpus * 100.0).max(0.0))
}

/// utime + stime of a process (all its threads, live and exited), in seconds.
fn proc_cpu_secs(stat: &Path) -> Option<f64> {
    let text = std::fs::read_to_string(stat).ok()?;
    let ticks = parse_stat_ticks(&text)?;
    Some(ticks_to_secs(ticks))
}

/// utime + stime (fields 14 and 15) from the text of /proc/PID/stat. The command name (field 2)
/// may contain spaces and parentheses, so fields are counted after its last ')'.
pub fn parse_stat_ticks(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14, index 11.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

fn self_cpu_secs() -> f64 {
    // SAFETY: rusage is plain data; getrusage writes it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a pointer to a live local.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Memory lines of /proc/PID/status.
#[derive(Debug, Default, PartialEq)]
pub struct ProcMem {
    /// Peak resident set (VmHWM), KiB.
    pub vm_hwm_kib: Option<u64>,
    /// Resident anonymous memory (RssAnon), KiB.
    pub rss_anon_kib: Option<u64>,
}

fn proc_status(path: &Path) -> Option<ProcMem> {
    std::fs::read_to_string(path).ok().map(|t| parse_status(&t))
}

/// Parses VmHWM and RssAnon from the text of /proc/PID/status.
pub fn parse_status(text: &str) -> ProcMem {
    let mut m = ProcMem::default();
    for line in text.lines() {
        let kib = |l: &str| {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        };
        if line.starts_with("VmHWM:") {
            m.vm_hwm_kib = kib(line);
        } else if line.starts_with("RssAnon:") {
            m.rss_anon_kib = kib(line);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_skip_odd_command_names() {
        let text = "1234 (my (odd) cmd) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 9 0 100 0 0";
        assert_eq!(parse_stat_ticks(text), Some(300));
        assert_eq!(parse_stat_ticks("garbage"), None);
        // The real thing for this process parses.
        let own = std::fs::read_to_string("/proc/self/stat").unwrap();
        assert!(parse_stat_ticks(&own).is_some());
    }

    #[test]
    fn host_busy_excludes_idle_and_iowait() {
        let t = "cpu  100 5 50 1000 300 7 3 2 0 0\ncpu0 50 2 25 500 150 3 1 1 0 0\n";
        assert_eq!(parse_host_busy_ticks(t), Some(100 + 5 + 50 + 7 + 3 + 2));
        assert_eq!(parse_host_busy_ticks("intr 5\n"), None);
        let own = std::fs::read_to_string("/proc/stat").unwrap();
        assert!(parse_host_busy_ticks(&own).is_some());
    }

    #[test]
    fn status_memory_lines() {
        let t = "Name:\tmqblk\nVmHWM:\t   12345 kB\nVmRSS:\t 100 kB\nRssAnon:\t    2048 kB\n";
        assert_eq!(
            parse_status(t),
            ProcMem {
                vm_hwm_kib: Some(12345),
                rss_anon_kib: Some(2048)
            }
        );
        assert_eq!(parse_status(""), ProcMem::default());
    }
}
