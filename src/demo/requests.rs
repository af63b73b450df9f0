//! Step 4 of `mqblk demo`: the requests other than reads and writes that the device offers
//! (write-zeroes, discard, flush), and reads past the end of the disk, each checked.
//!
//! It prints one line a program can parse for what the device offers, and one per check:
//!
//! ```text
//!   offers: flush discard write-zeroes          (the subset offered, or "offers: none")
//!   check NAME RESULT key=value...
//! ```
//!
//! where RESULT is `ok`, `FAIL` or `not-offered`. The checks:
//!
//! - `write-zeroes`: zeroes a range (its first half without unmap, its second half with unmap
//!   allowed), which must then read back as zeros (`reads=zeros`), the block on each side still
//!   holding the pattern (`neighbours=pattern`);
//! - `discard`: discards a range; it may read back as zeros or as the old data (`reads=zeros`,
//!   `reads=pattern` or `reads=mixed`), but the neighbours must hold the pattern;
//! - `flush`: a flush on every queue, each of which must succeed;
//! - `read-past-end`: a read starting at the capacity, on every queue; and `read-across-end`:
//!   a read of the last block and the one after it. Each must fail with EIO, in time.
//!
//! Every check needs the disk as the verify step left it: the seeded pattern over
//! `[0, written)`. The ranges lie in that area ([`Ranges`]), so that a reader of the disk
//! afterwards knows what each byte must hold (the lines give each range's `offset=` and `len=`).

use std::path::Path;
use std::time::Duration;

use anyhow::bail;

use mqblk_client::{check_pattern, Client, RequestError};

/// The longest a range of this step spans (1 MiB: large enough to cross any device's
/// transfer limit, small enough to read back in one request).
const MAX_RANGE: u64 = 1 << 20;

/// Longest wait for one request: a request past the end must fail, not hang.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the step's write-zeroes and discard go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ranges {
    /// Bytes the device addresses at a time (its block size, and its discard alignment).
    pub align: u64,
    /// Length of each range.
    pub len: u64,
    /// Start of the write-zeroes range (about a quarter into the written area).
    pub zeroes: u64,
    /// Start of the discard range (about halfway into the written area).
    pub discard: u64,
}

impl Ranges {
    /// Ranges for a disk whose first `written` bytes hold the pattern: aligned to `align`, no
    /// longer than `max_len` (the device's limit for one request), each with an aligned block
    /// of pattern on either side. `None` if the area is too small for that.
    pub fn new(written: u64, align: u64, max_len: u64) -> Option<Ranges> {
        let down = |x: u64| x / align * align;
        let len = down(MAX_RANGE.min(written / 8).min(max_len));
        let zeroes = down(written / 4);
        let discard = down(written / 2);
        let fits = len > 0
            && zeroes >= align
            && zeroes + len + align <= discard
            && discard + len + align <= written;
        fits.then_some(Ranges {
            align,
            len,
            zeroes,
            discard,
        })
    }
}

/// What the device offers, as libblkio reads it from the device's features and config space.
struct Offers {
    /// A volatile write cache to flush (libblkio's `flush-needed`).
    flush: bool,
    /// Most bytes per discard; 0 if discard is not offered.
    discard: u64,
    /// Most bytes per write-zeroes; 0 if write-zeroes is not offered.
    write_zeroes: u64,
}

impl Offers {
    fn read(client: &Client) -> Offers {
        Offers {
            flush: client.blkio().get_bool("flush-needed").unwrap_or(false),
            discard: client.prop_u64("max-discard-len").unwrap_or(0),
            write_zeroes: client.prop_u64("max-write-zeroes-len").unwrap_or(0),
        }
    }

    fn line(&self) -> String {
        let names: Vec<&str> = [
            (self.flush, "flush"),
            (self.discard > 0, "discard"),
            (self.write_zeroes > 0, "write-zeroes"),
        ]
        .into_iter()
        .filter_map(|(offered, name)| offered.then_some(name))
        .collect();
        if names.is_empty() {
            "none".into()
        } else {
            names.join(" ")
        }
    }
}

fn is_zeros(data: &[u8]) -> bool {
    data.iter().all(|&b| b == 0)
}

/// The step's checks on one connection, and the names of those that failed.
struct Checks {
    client: Client,
    queues: usize,
    capacity: u64,
    seed: u64,
    failed: Vec<&'static str>,
}

impl Checks {
    /// Prints a check's line; remembers it if it failed.
    fn report(&mut self, name: &'static str, outcome: Result<String, String>) {
        match outcome {
            Ok(details) => println!("  check {name} ok {details}"),
            Err(why) => {
                println!("  check {name} FAIL {why}");
                self.failed.push(name);
            }
        }
    }

    /// Reads `[offset - align, offset + len + align)` on queue `q`: the range and a block on
    /// either side. Returns what the range holds ("zeros", "pattern", "mixed"); an error if the
    /// read fails or a neighbour lost its pattern.
    fn read_around(
        &mut self,
        q: usize,
        offset: u64,
        len: u64,
        align: u64,
    ) -> Result<&'static str, String> {
        let start = offset - align;
        let data = self
            .client
            .read_vec(q, start, (len + 2 * align) as usize)
            .map_err(|e| format!("reading back offset={start} len={}: {e}", len + 2 * align))?;
        let (before, rest) = data.split_at(align as usize);
        let (range, after) = rest.split_at(len as usize);
        for (block, at, side) in [(before, start, "before"), (after, offset + len, "after")] {
            if let Some(bad) = check_pattern(block, at, self.seed) {
                return Err(format!(
                    "the block {side} the range lost its pattern (first wrong byte at {bad}): \
                     the request reached past its range"
                ));
            }
        }
        Ok(if is_zeros(range) {
            "zeros"
        } else if check_pattern(range, offset, self.seed).is_none() {
            "pattern"
        } else {
            "mixed"
        })
    }

    fn write_zeroes(&mut self, r: Ranges) -> Result<String, String> {
        let half = r.len / 2 / r.align * r.align;
        let parts = [
            (r.zeroes, half, false),
            (r.zeroes + half, r.len - half, true),
        ];
        for (offset, len, unmap) in parts.into_iter().filter(|p| p.1 > 0) {
            self.client
                .write_zeroes(0, offset, len, unmap)
                .map_err(|e| format!("offset={offset} len={len} unmap={unmap}: {e}"))?;
        }
        match self.read_around(0, r.zeroes, r.len, r.align)? {
            "zeros" => Ok(format!(
                "queue=0 offset={} len={} reads=zeros neighbours=pattern",
                r.zeroes, r.len
            )),
            other => Err(format!(
                "queue=0 offset={} len={} reads={other}: the zeroed range does not read back as \
                 zeros",
                r.zeroes, r.len
            )),
        }
    }

    fn discard(&mut self, r: Ranges) -> Result<String, String> {
        let q = self.queues - 1;
        self.client
            .discard(q, r.discard, r.len)
            .map_err(|e| format!("queue={q} offset={} len={}: {e}", r.discard, r.len))?;
        let reads = self.read_around(q, r.discard, r.len, r.align)?;
        Ok(format!(
            "queue={q} offset={} len={} reads={reads} neighbours=pattern",
            r.discard, r.len
        ))
    }

    fn flush(&mut self) -> Result<String, String> {
        for q in 0..self.queues {
            self.client
                .flush(q)
                .map_err(|e| format!("queue={q}: {e}"))?;
        }
        Ok(format!("queues={}", self.queues))
    }

    /// A read of `len` bytes at `offset` on every queue, each of which must fail with EIO.
    fn read_must_fail(&mut self, offset: u64, len: u64) -> Result<String, String> {
        for q in 0..self.queues {
            match self.client.read_vec(q, offset, len as usize) {
                Err(RequestError::Failed { errno, .. }) if errno == libc::EIO => {}
                Ok(_) => {
                    return Err(format!(
                        "queue={q} offset={offset} len={len}: the read succeeded (capacity {})",
                        self.capacity
                    ))
                }
                Err(e) => {
                    return Err(format!(
                        "queue={q} offset={offset} len={len}: {e} (expected EIO)"
                    ))
                }
            }
        }
        Ok(format!(
            "queues={} offset={offset} len={len} errno=EIO",
            self.queues
        ))
    }
}

/// Runs the step on the device served on `socket` with `queues` queues, whose first `written`
/// bytes hold the pattern of `seed`. Fails if any check fails.
pub fn run(socket: &Path, queues: usize, written: u64, seed: u64) -> anyhow::Result<()> {
    let mut client = Client::connect(socket, queues)?;
    client.set_timeout(REQUEST_TIMEOUT);
    let offers = Offers::read(&client);
    println!("  offers: {}", offers.line());
    let block = u64::from(client.block_size());
    let discard_align = client
        .prop_i32("discard-alignment")
        .map_or(0, |a| a.max(0) as u64);
    let align = block.max(discard_align).max(512);
    let max_len = [offers.discard, offers.write_zeroes]
        .into_iter()
        .filter(|&m| m > 0)
        .min()
        .unwrap_or(u64::MAX);
    let Some(ranges) = Ranges::new(written, align, max_len) else {
        bail!("step 4: the disk is too small ({written} bytes written) for its ranges");
    };
    let mut checks = Checks {
        capacity: client.capacity(),
        client,
        queues,
        seed,
        failed: Vec::new(),
    };
    if offers.write_zeroes > 0 {
        let outcome = checks.write_zeroes(ranges);
        checks.report("write-zeroes", outcome);
    } else {
        println!("  check write-zeroes not-offered");
    }
    if offers.discard > 0 {
        let outcome = checks.discard(ranges);
        checks.report("discard", outcome);
    } else {
        println!("  check discard not-offered");
    }
    if offers.flush {
        let outcome = checks.flush();
        checks.report("flush", outcome);
    } else {
        println!("  check flush not-offered");
    }
    let capacity = checks.capacity;
    let outcome = checks.read_must_fail(capacity, block);
    checks.report("read-past-end", outcome);
    let outcome = checks.read_must_fail(capacity - block, 2 * block);
    checks.report("read-across-end", outcome);
    if !checks.failed.is_empty() {
        bail!("step 4: {} failed", checks.failed.join(", "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_aligned_apart_and_inside_the_written_area() {
        for (written, align) in [
            (16 << 20, 4096),
            (16 << 20, 512),
            (1 << 20, 4096),
            (256 << 20, 512),
        ] {
            let r = Ranges::new(written, align, u64::MAX).expect("fits");
            for x in [r.len, r.zeroes, r.discard] {
                assert_eq!(x % align, 0, "{r:?}");
            }
            assert!(r.len > 0 && r.len <= MAX_RANGE, "{r:?}");
            assert!(r.zeroes >= align, "{r:?}");
            assert!(r.zeroes + r.len + align <= r.discard, "{r:?}");
            assert!(r.discard + r.len + align <= written, "{r:?}");
        }
    }

    #[test]
    fn ranges_respect_the_device_limit_and_refuse_tiny_disks() {
        let r = Ranges::new(64 << 20, 4096, 64 << 10).expect("fits");
        assert_eq!(r.len, 64 << 10);
        assert_eq!(Ranges::new(4 * 4096, 4096, u64::MAX), None);
        assert_eq!(Ranges::new(16 << 20, 4096, 100), None);
    }

    #[test]
    fn zeros_are_told_from_data() {
        assert!(is_zeros(&[0; 4096]));
        let mut one = [0u8; 4096];
        one[4095] = 1;
        assert!(!is_zeros(&one));
    }
}
