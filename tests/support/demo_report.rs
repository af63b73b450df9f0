//! What `mqblk demo` printed, read back by a test ([`DemoReport`]), and what the disk it
//! drove must then hold ([`expected_disk`], [`check_disk`]).
//!
//! The lines (see src/demo.rs and src/demo/requests.rs): "demo OK: ..." when every step
//! passed; in step 4, "offers: NAME..." (or "offers: none") and one "check NAME RESULT
//! key=value..." line per check, RESULT being ok, FAIL or not-offered.

use mqblk_client::{check_pattern, job_regions};

/// One "check" line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DemoCheck {
    pub name: String,
    /// ok, FAIL or not-offered.
    pub result: String,
    /// The line after the result, for messages.
    pub details: String,
}

impl DemoCheck {
    /// The number in the `key=N` word of the line.
    pub fn number(&self, key: &str) -> Option<u64> {
        self.word(key)?.parse().ok()
    }

    /// The value of the `key=VALUE` word of the line.
    pub fn word(&self, key: &str) -> Option<&str> {
        self.details
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
    }
}

/// What one `mqblk demo` run printed.
#[derive(Clone, Debug, Default)]
pub struct DemoReport {
    /// It printed "demo OK".
    pub ok: bool,
    /// The names on its "offers:" line; `None` without one.
    pub offers: Option<Vec<String>>,
    pub checks: Vec<DemoCheck>,
}

impl DemoReport {
    /// Reads demo's output lines (leading spaces allowed).
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a str>) -> DemoReport {
        let mut r = DemoReport::default();
        for line in lines.into_iter().map(str::trim) {
            if line.starts_with("demo OK") {
                r.ok = true;
            } else if let Some(names) = line.strip_prefix("offers:") {
                r.offers = Some(
                    names
                        .split_whitespace()
                        .filter(|n| *n != "none")
                        .map(str::to_string)
                        .collect(),
                );
            } else if let Some(rest) = line.strip_prefix("check ") {
                let mut words = rest.splitn(3, ' ');
                let (Some(name), Some(result)) = (words.next(), words.next()) else {
                    continue;
                };
                r.checks.push(DemoCheck {
                    name: name.into(),
                    result: result.into(),
                    details: words.next().unwrap_or("").into(),
                });
            }
        }
        r
    }

    /// The check named `name`.
    pub fn check(&self, name: &str) -> Option<&DemoCheck> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// What is wrong with the run: no "demo OK", a check that failed or is missing, a check in
    /// `required` that was not offered.
    pub fn failures(&self, required: &[&str]) -> Vec<String> {
        let mut failures = Vec::new();
        if !self.ok {
            failures.push("no `demo OK` line".to_string());
        }
        if self.offers.is_none() {
            failures.push("no `offers:` line (step 4 did not run)".to_string());
        }
        for c in self.checks.iter().filter(|c| c.result == "FAIL") {
            failures.push(format!("check {} FAIL {}", c.name, c.details));
        }
        for name in ALL_CHECKS {
            match self.check(name) {
                None => failures.push(format!("no `check {name}` line")),
                Some(c) if c.result == "not-offered" && required.contains(&name) => {
                    failures.push(format!("the device does not offer {name}"))
                }
                Some(_) => {}
            }
        }
        failures
    }
}

/// Every check step 4 prints a line for.
pub const ALL_CHECKS: [&str; 5] = [
    "write-zeroes",
    "discard",
    "flush",
    "read-past-end",
    "read-across-end",
];

/// What a byte range of the disk must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Content {
    /// The verify step's pattern.
    Pattern,
    Zeros,
    /// Either, sector by sector (a discard that the device may or may not have deallocated).
    PatternOrZeros,
}

/// A range of the disk and what it must hold; `name` is for messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub name: String,
    pub offset: u64,
    pub len: u64,
    pub content: Content,
}

/// What a disk of `capacity` bytes, zeros before the run, holds after a demo run with `jobs`
/// jobs of `block_size`-byte requests that printed `report`: the pattern where the verify step
/// wrote it, zeros beyond, then step 4's ranges. Later spans override earlier ones.
pub fn expected_disk(
    report: &DemoReport,
    capacity: u64,
    jobs: usize,
    block_size: usize,
) -> Result<Vec<Span>, String> {
    let regions = job_regions(0, capacity, jobs, block_size).map_err(|e| e.to_string())?;
    let written: u64 = regions.iter().map(|r| r.1).sum();
    let mut spans = vec![
        Span {
            name: "written by the verify step".into(),
            offset: 0,
            len: written,
            content: Content::Pattern,
        },
        Span {
            name: "never written".into(),
            offset: written,
            len: capacity - written,
            content: Content::Zeros,
        },
    ];
    for (name, content_of) in [
        (
            "write-zeroes",
            (|_| Some(Content::Zeros)) as fn(Option<&str>) -> Option<Content>,
        ),
        ("discard", |reads| match reads? {
            "zeros" => Some(Content::Zeros),
            "pattern" => Some(Content::Pattern),
            _ => Some(Content::PatternOrZeros),
        }),
    ] {
        let Some(c) = report.check(name).filter(|c| c.result == "ok") else {
            continue;
        };
        let (Some(offset), Some(len), Some(content)) = (
            c.number("offset"),
            c.number("len"),
            content_of(c.word("reads")),
        ) else {
            return Err(format!(
                "`check {name} ok` lacks offset=, len= or reads=: {c:?}"
            ));
        };
        spans.push(Span {
            name: format!("{name} range"),
            offset,
            len,
            content,
        });
    }
    Ok(spans)
}

/// Unit of [`check_disk`]'s comparison (and of its counts).
const SECTOR: usize = 512;

/// Compares `disk` with `spans` (under pattern seed `seed`), sector by sector; one message per
/// span with sectors that differ, naming the first.
pub fn check_disk(disk: &[u8], spans: &[Span], seed: u64) -> Vec<String> {
    let zeros = [0u8; SECTOR];
    // For each sector, the last span that covers it.
    let mut bad: Vec<(u64, Option<u64>)> = vec![(0, None); spans.len()];
    for (i, sector) in disk.chunks(SECTOR).enumerate() {
        let at = (i * SECTOR) as u64;
        let Some(s) = spans
            .iter()
            .rposition(|s| at >= s.offset && at < s.offset + s.len)
        else {
            continue;
        };
        let is_pattern = || check_pattern(sector, at, seed).is_none();
        let good = match spans[s].content {
            Content::Pattern => is_pattern(),
            Content::Zeros => sector == &zeros[..sector.len()],
            Content::PatternOrZeros => sector == &zeros[..sector.len()] || is_pattern(),
        };
        if !good {
            bad[s].0 += 1;
            bad[s].1.get_or_insert(at);
        }
    }
    let mut failures = Vec::new();
    for (s, (count, first)) in spans.iter().zip(bad) {
        if let Some(first) = first {
            let i = first as usize;
            let show = &disk[i..(i + 16).min(disk.len())];
            failures.push(format!(
                "{} (offset {} + {}, {:?}): {count} sectors differ, the first at offset {first} \
                 (its first bytes: {show:02x?})",
                s.name, s.offset, s.len, s.content
            ));
        }
    }
    let end = spans.iter().map(|s| s.offset + s.len).max().unwrap_or(0);
    if disk.len() as u64 != end {
        failures.push(format!(
            "the disk holds {} bytes, expected {end}",
            disk.len()
        ));
    }
    failures
}
