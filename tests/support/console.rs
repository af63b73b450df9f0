//! A QEMU guest's serial console, watched while the guest runs: the guest's report lines, its
//! sampler's lines (requests in flight and completed, which show a stall), kernel messages that
//! mean trouble, and QEMU's exit. The guests' report format is that of tests/guest/init*.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::proc::Proc;
use super::qemu::{is_kernel_trouble, read_lossy, report_line, word_value};

/// How often a [`Watch`] reads the console while it waits.
const POLL: Duration = Duration::from_millis(20);

/// One line of the guest's sampler: "s t=UPTIME inflight=N ios=N".
#[derive(Clone, Debug)]
pub struct Sample {
    /// The guest's uptime, as printed.
    pub t: String,
    /// Requests in flight on the disk.
    pub inflight: u64,
    /// Requests the disk has completed.
    pub ios: u64,
    /// Where the line starts in the console.
    pub offset: usize,
}

impl Sample {
    /// The sample in report line `text` (the text after the marker) found at `offset` of the
    /// console; None if it is not a sampler line or lacks one of its numbers.
    pub fn parse(text: &str, offset: usize) -> Option<Sample> {
        let rest = text.strip_prefix("s ")?;
        let t = rest
            .split_whitespace()
            .find_map(|w| w.strip_prefix("t="))?
            .to_string();
        Some(Sample {
            t,
            inflight: word_value(rest, "inflight")?,
            ios: word_value(rest, "ios")?,
            offset,
        })
    }
}

impl std::fmt::Display for Sample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "guest t={} inflight={} ios={}",
            self.t, self.inflight, self.ios
        )
    }
}

/// QEMU and its console: polled for the guest's lines, for a stall, for kernel errors.
pub struct Watch {
    /// The guest's QEMU.
    pub qemu: Proc,
    console_path: PathBuf,
    started: Instant,
    /// The console as last read.
    pub console: String,
    /// Length of the console's complete lines parsed so far.
    parsed: usize,
    /// The guest's report lines: (offset in the console, text after the marker).
    pub report: Vec<(usize, String)>,
    pub samples: Vec<Sample>,
    /// When `ios` last changed, and its value.
    progress: (Instant, u64),
    /// No request completed for this long while some were in flight: the guest hangs.
    stall: Duration,
    /// The whole guest run, from QEMU's start.
    limit: Duration,
    /// Timeline, for the report.
    pub events: Vec<(Duration, String)>,
}

impl Watch {
    /// Watches `qemu`, whose console is the file `console`, for at most `limit`; a guest with
    /// requests in flight that completes none for `stall` hangs.
    pub fn new(qemu: Proc, console: &Path, stall: Duration, limit: Duration) -> Self {
        Watch {
            qemu,
            console_path: console.to_path_buf(),
            started: Instant::now(),
            console: String::new(),
            parsed: 0,
            report: Vec::new(),
            samples: Vec::new(),
            progress: (Instant::now(), 0),
            stall,
            limit,
            events: Vec::new(),
        }
    }

    /// Time since the watch (QEMU) started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Adds `what` to the timeline.
    pub fn event(&mut self, what: String) {
        self.events.push((self.elapsed(), what));
    }

    /// Re-reads the console and parses the complete lines that are new.
    pub fn refresh(&mut self) {
        let text = read_lossy(&self.console_path);
        if text.len() <= self.console.len() {
            return;
        }
        self.console = text;
        let complete = self.console.rfind('\n').map_or(0, |i| i + 1);
        let mut offset = self.parsed;
        for line in self.console[self.parsed..complete].split_inclusive('\n') {
            let start = offset;
            offset += line.len();
            let Some(text) = report_line(line).map(str::to_string) else {
                continue;
            };
            if let Some(s) = Sample::parse(&text, start) {
                if s.ios != self.progress.1 {
                    self.progress = (Instant::now(), s.ios);
                }
                self.samples.push(s);
            } else {
                self.report.push((start, text));
            }
        }
        self.parsed = complete;
    }

    /// The first report line starting with `prefix`, with its offset.
    pub fn find(&self, prefix: &str) -> Option<(usize, &str)> {
        self.report
            .iter()
            .find(|(_, l)| l.starts_with(prefix))
            .map(|(o, l)| (*o, l.as_str()))
    }

    /// `key=value` of the first report line starting with `prefix`.
    pub fn value(&self, prefix: &str, key: &str) -> Option<u64> {
        let (_, line) = self.find(prefix)?;
        word_value(line, key)
    }

    /// What the guest's RESULT line says, once it has printed one.
    pub fn result(&self) -> Option<&str> {
        self.report
            .iter()
            .find_map(|(_, l)| l.strip_prefix("RESULT "))
    }

    /// Kernel messages on the console that mean trouble.
    fn kernel_trouble(&self) -> Vec<&str> {
        self.console
            .lines()
            .filter(|l| is_kernel_trouble(l))
            .collect()
    }

    /// Checks QEMU, the guest's progress and its kernel; Err describes what went wrong.
    pub fn check(&mut self) -> Result<(), String> {
        self.refresh();
        if let Some(line) = self.kernel_trouble().first().map(|l| l.to_string()) {
            // The first line is the verdict; the rest of the message (the trace) is in the
            // console file, which a failure report reads once QEMU has stopped.
            return Err(format!("the guest kernel reported: {line}"));
        }
        if let Some(r) = self.result() {
            if r != "PASS" {
                return Err(format!("the guest reported: RESULT {r}"));
            }
        }
        match self.qemu.try_wait() {
            Ok(Some(status)) => {
                self.refresh();
                if self.result().is_some() {
                    return Ok(());
                }
                return Err(format!(
                    "QEMU exited ({status}) without the guest's RESULT line"
                ));
            }
            Ok(None) => {}
            Err(e) => return Err(format!("waiting for QEMU: {e}")),
        }
        if let Some(last) = self.samples.last() {
            let still = self.progress.0.elapsed();
            if last.inflight > 0 && still >= self.stall {
                return Err(format!(
                    "the guest hangs: {} requests in flight and none completed for {:.0} s \
                     (ios stuck at {}; last sample: {last})",
                    last.inflight,
                    still.as_secs_f64(),
                    last.ios
                ));
            }
        }
        if self.elapsed() >= self.limit {
            return Err(format!("the guest did not finish within {:?}", self.limit));
        }
        Ok(())
    }

    /// Polls until `done` gives Some; Err on trouble or after `timeout` (named `what`).
    pub fn wait_for<T>(
        &mut self,
        timeout: Duration,
        what: &str,
        mut done: impl FnMut(&Self) -> Option<T>,
    ) -> Result<T, String> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check()?;
            if let Some(v) = done(self) {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(format!("timed out after {timeout:?} waiting for {what}"));
            }
            std::thread::sleep(POLL);
        }
    }

    /// Lets `d` pass while the guest works, checking on it meanwhile; Err if it fails or
    /// finishes in that time (the test still had work to do while it ran).
    pub fn run_for(&mut self, d: Duration) -> Result<(), String> {
        let end = Instant::now() + d;
        loop {
            self.check()?;
            if self.result().is_some() {
                return Err("the guest finished while the test still needed it running".into());
            }
            let now = Instant::now();
            if now >= end {
                return Ok(());
            }
            std::thread::sleep(POLL.min(end - now));
        }
    }
}
