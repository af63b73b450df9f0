//! Host I/Os larger than the engine takes: an NVMe controller moves at most MDTS bytes per
//! command, and the kernel maps at most so many segments. A read or write past those limits is
//! cut into parts, each started on the engine on its own; the request completes when the last
//! part does, with the first failure if any part failed. Merging never builds such an I/O
//! (its limits are the engine's too), so only a single large request is ever split.

use crate::engine::Limits;

/// Where an engine's I/Os are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitLimits {
    /// Most bytes per part (a multiple of `block`).
    pub max_bytes: u64,
    /// Most iovecs per part.
    pub max_iovs: usize,
    /// The engine's block size: every part but the last is whole blocks.
    pub block: u64,
    /// Whether the engine's channel also cuts I/Os where its storage's runs end
    /// ([`Channel::run_end`](crate::engine::Channel::run_end)).
    pub cuts_runs: bool,
}

impl SplitLimits {
    /// The limits of an engine that has any, with `block` its block size.
    pub fn of(limits: &Limits, block: u32) -> Option<SplitLimits> {
        if limits.max_transfer.is_none() && limits.max_segments.is_none() && !limits.cuts_runs {
            return None;
        }
        let block = u64::from(block.max(512));
        Some(SplitLimits {
            max_bytes: limits
                .max_transfer
                .map_or(u64::MAX, |m| (u64::from(m) / block).max(1) * block),
            max_iovs: limits
                .max_segments
                .map_or(usize::MAX, |m| (m as usize).max(1)),
            block,
            cuts_runs: limits.cuts_runs,
        })
    }

    /// Whether an I/O of `bytes` in `iovcnt` iovecs must be split.
    pub fn needed(&self, bytes: u64, iovcnt: usize) -> bool {
        bytes > self.max_bytes || iovcnt > self.max_iovs
    }
}

/// One part: its disk offset and its iovecs, a range of the plan's iovec array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Part {
    /// Byte offset on the disk.
    pub offset: u64,
    /// Index of its first iovec in the plan's array.
    pub first: usize,
    /// Its number of iovecs.
    pub count: usize,
    /// Its bytes.
    pub bytes: u64,
}

/// The most parts one I/O is cut into. No guest driver sends a request anywhere near it (Linux's
/// largest is a few MiB, 4096 parts of 4 KiB are 16 MiB), but a guest can make one as large as
/// the disk from segments that all point at the same memory: each part costs the slot an iovec
/// and a `Part`, so an I/O that would need more fails instead.
pub const MAX_PARTS: usize = 4096;

/// Cuts the I/O of `iovs` at `offset` into parts within `limits`, and where `run_end` (given a
/// part's offset and the bytes left) says its run ends, writing the parts' iovecs (an iovec cut
/// in two appears in both parts, each with its share) to `out` and the parts to `parts`.
/// Returns false if no cut can keep a part within the limits and whole blocks (at most
/// `max_iovs` iovecs do not hold one block) or the I/O needs more than [`MAX_PARTS`] parts,
/// which fails the request.
pub fn plan(
    iovs: &[libc::iovec],
    offset: u64,
    limits: &SplitLimits,
    mut run_end: impl FnMut(u64, u64) -> u64,
    out: &mut Vec<libc::iovec>,
    parts: &mut Vec<Part>,
) -> bool {
    let total: u64 = iovs.iter().map(|v| v.iov_len as u64).sum();
    // The most bytes the part starting at `at` may hold.
    let mut part_max = |at: u64| {
        let run = run_end(at, offset + total - at).saturating_sub(at);
        // A run shorter than a block cannot be a part: cutting there would fail the request.
        limits.max_bytes.min(run.max(limits.block))
    };
    out.clear();
    parts.clear();
    // The cursor: iovec `i`, `used` bytes of it already in parts.
    let (mut i, mut used) = (0usize, 0usize);
    let mut part = Part {
        offset,
        ..Part::default()
    };
    let mut max = part_max(offset);
    loop {
        while i < iovs.len() && part.count < limits.max_iovs && part.bytes < max {
            let left = iovs[i].iov_len - used;
            if left == 0 {
                i += 1;
                used = 0;
                continue;
            }
            let take = left.min((max - part.bytes).min(usize::MAX as u64) as usize);
            out.push(libc::iovec {
                // A pointer offset within the iovec's own range: only arithmetic here.
                iov_base: iovs[i].iov_base.wrapping_byte_add(used),
                iov_len: take,
            });
            part.count += 1;
            part.bytes += take as u64;
            used += take;
        }
        // Skip what is left of empty iovecs, so that the end is seen.
        while i < iovs.len() && iovs[i].iov_len == used {
            i += 1;
            used = 0;
        }
        if i == iovs.len() {
            if part.count > 0 {
                parts.push(part);
            }
            return true;
        }
        // The part is full and more follows: end it on a block boundary, handing the
        // partial block back to the next part.
        let mut back = part.bytes % limits.block;
        if back == part.bytes {
            return false;
        }
        part.bytes -= back;
        while back > 0 {
            let last = out
                .last_mut()
                .expect("the part holds more than `back` bytes");
            let n = (last.iov_len as u64).min(back);
            last.iov_len -= n as usize;
            if last.iov_len == 0 {
                out.pop();
                part.count -= 1;
            }
            back -= n;
            // Move the cursor back by `n` bytes.
            let mut n = n as usize;
            while n > 0 {
                if used == 0 {
                    i -= 1;
                    used = iovs[i].iov_len;
                }
                let step = used.min(n);
                used -= step;
                n -= step;
            }
        }
        parts.push(part);
        if parts.len() == MAX_PARTS {
            return false;
        }
        part = Part {
            offset: part.offset + part.bytes,
            first: out.len(),
            count: 0,
            bytes: 0,
        };
        max = part_max(part.offset);
    }
}

/// A split host I/O's parts; its vectors keep their capacity from one use of
/// the slot to the next.
#[derive(Debug, Default)]
pub struct SplitState {
    /// The parts' iovecs, end to end.
    pub iovs: Vec<libc::iovec>,
    /// The parts.
    pub parts: Vec<Part>,
    /// Parts still in flight; 0 when the I/O is not split.
    pub left: u32,
    /// The first part's failure (a negative errno), or 0.
    pub error: i32,
    /// Bytes the parts transferred (engines that report bytes).
    pub done: u64,
    /// A part succeeded as a whole (engines whose commands are all or nothing).
    pub whole: bool,
}

/// How a part's completion left its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartDone {
    /// The I/O was not split: its result stands.
    NotSplit,
    /// Other parts are still in flight.
    Waiting,
    /// The last part completed: the request's result (bytes, or the first failure).
    Last(i32),
}

impl SplitState {
    /// Whether parts of the slot's I/O are in flight.
    pub fn in_progress(&self) -> bool {
        self.left > 0
    }

    /// Records a part's result: `res` as the engine gave it, `whole` if success means the
    /// whole part (an NVMe command); `io_len` is the request's bytes.
    pub fn part_done(&mut self, res: i32, whole: bool, io_len: u64) -> PartDone {
        if self.left == 0 {
            return PartDone::NotSplit;
        }
        if res < 0 {
            if self.error == 0 {
                self.error = res;
            }
        } else if whole {
            self.whole = true;
        } else {
            self.done += res as u64;
        }
        self.left -= 1;
        if self.left > 0 {
            return PartDone::Waiting;
        }
        let res = if self.error < 0 {
            self.error
        } else if self.whole {
            io_len.min(i32::MAX as u64) as i32
        } else {
            self.done.min(i32::MAX as u64) as i32
        };
        PartDone::Last(res)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(base: usize, len: usize) -> libc::iovec {
        libc::iovec {
            iov_base: base as *mut libc::c_void,
            iov_len: len,
        }
    }

    /// A plan's iovecs as `(address, length)`, and its parts.
    type Plan = (Vec<(usize, usize)>, Vec<Part>);

    fn run(iovs: &[libc::iovec], limits: SplitLimits) -> Option<Plan> {
        run_cut(iovs, limits, |at, left| at + left)
    }

    fn run_cut(
        iovs: &[libc::iovec],
        limits: SplitLimits,
        run_end: impl FnMut(u64, u64) -> u64,
    ) -> Option<Plan> {
        let (mut out, mut parts) = (Vec::new(), Vec::new());
        plan(iovs, 1 << 20, &limits, run_end, &mut out, &mut parts).then(|| {
            (
                out.iter()
                    .map(|v| (v.iov_base as usize, v.iov_len))
                    .collect(),
                parts,
            )
        })
    }

    fn check_covers(iovs: &[libc::iovec], out: &[(usize, usize)], parts: &[Part], l: &SplitLimits) {
        // The parts' iovecs are the input's bytes, in order, and each part is within limits.
        let flat = |v: &[(usize, usize)]| -> Vec<usize> {
            v.iter().flat_map(|&(b, n)| b..b + n).collect()
        };
        let input: Vec<(usize, usize)> = iovs
            .iter()
            .map(|v| (v.iov_base as usize, v.iov_len))
            .collect();
        assert_eq!(flat(out), flat(&input));
        let mut offset = 1 << 20;
        for (k, p) in parts.iter().enumerate() {
            assert_eq!(p.offset, offset);
            let bytes: u64 = out[p.first..p.first + p.count]
                .iter()
                .map(|v| v.1 as u64)
                .sum();
            assert_eq!(bytes, p.bytes);
            assert!(p.bytes <= l.max_bytes && p.count <= l.max_iovs, "{p:?}");
            if k + 1 < parts.len() {
                assert_eq!(p.bytes % l.block, 0, "part {k} is not whole blocks: {p:?}");
            }
            offset += p.bytes;
        }
    }

    #[test]
    fn one_large_buffer_is_cut_at_the_transfer_limit() {
        let l = SplitLimits {
            max_bytes: 32 << 10,
            max_iovs: 127,
            block: 4096,
            cuts_runs: false,
        };
        let iovs = [iov(0x10_0000, 128 << 10)];
        let (out, parts) = run(&iovs, l).unwrap();
        assert_eq!(parts.len(), 4);
        assert_eq!(out[1], (0x10_0000 + (32 << 10), 32 << 10));
        assert_eq!(parts[3].offset, (1 << 20) + (96 << 10));
        check_covers(&iovs, &out, &parts, &l);
        // Within the limits: one part, the same iovecs.
        let small = [iov(0x1000, 4096), iov(0x9000, 8192)];
        let (out, parts) = run(&small, l).unwrap();
        assert_eq!(parts.len(), 1);
        assert_eq!(out, vec![(0x1000, 4096), (0x9000, 8192)]);
        assert!(!l.needed(12288, 2) && l.needed(36 << 10, 1) && l.needed(4096, 128));
    }

    #[test]
    fn runs_the_channel_reports_become_parts() {
        // Runs end 60 KiB into the I/O and every 64 KiB after (qcow2 clusters mapped apart,
        // the I/O starting 4 KiB into one): its parts are 60, 64, 64 and the 4 KiB left.
        let l = SplitLimits {
            max_bytes: u64::MAX,
            max_iovs: usize::MAX,
            block: 512,
            cuts_runs: true,
        };
        let first_end = (1u64 << 20) + (60 << 10);
        let cluster_end = |at: u64, left: u64| {
            let e = if at < first_end {
                first_end
            } else {
                first_end + ((at - first_end) / 65536 + 1) * 65536
            };
            e.min(at + left)
        };
        let iovs = [iov(0x10_0000, 100 << 10), iov(0x40_0000, 92 << 10)];
        let (out, parts) = run_cut(&iovs, l, cluster_end).unwrap();
        let sizes: Vec<u64> = parts.iter().map(|p| p.bytes).collect();
        assert_eq!(sizes, vec![60 << 10, 64 << 10, 64 << 10, 4 << 10]);
        assert_eq!(parts[1].offset, first_end);
        check_covers(&iovs, &out, &parts, &l);
        // The transfer limit still applies within a run.
        let l = SplitLimits {
            max_bytes: 16 << 10,
            ..l
        };
        let (out, parts) = run_cut(&iovs, l, cluster_end).unwrap();
        assert!(parts.iter().all(|p| p.bytes <= 16 << 10));
        check_covers(&iovs, &out, &parts, &l);
    }

    #[test]
    fn an_io_needing_more_than_max_parts_fails() {
        // 4 KiB runs over one 16 MiB + 4 KiB segment (a guest's huge request over memory it
        // repeats): 4097 parts.
        let l = SplitLimits {
            max_bytes: u64::MAX,
            max_iovs: usize::MAX,
            block: 512,
            cuts_runs: true,
        };
        let every_4k = |at: u64, left: u64| ((at / 4096 + 1) * 4096).min(at + left);
        let at_most = [iov(0x10_0000, MAX_PARTS * 4096)];
        let (_, parts) = run_cut(&at_most, l, every_4k).unwrap();
        assert_eq!(parts.len(), MAX_PARTS);
        let one_more = [iov(0x10_0000, MAX_PARTS * 4096 + 4096)];
        assert!(run_cut(&one_more, l, every_4k).is_none());
        // The same through the transfer limit (an NVMe controller's MDTS).
        let mdts = SplitLimits {
            max_bytes: 4096,
            cuts_runs: false,
            ..l
        };
        assert!(run(&one_more, mdts).is_none());
    }

    #[test]
    fn too_many_iovecs_are_cut_on_block_boundaries() {
        // 512-byte segments on a 4 KiB-block device, 3 iovecs a part at most: a part of 1536
        // bytes holds no whole block, so no valid cut exists.
        let l = SplitLimits {
            max_bytes: 1 << 20,
            max_iovs: 3,
            block: 4096,
            cuts_runs: false,
        };
        let tiny: Vec<_> = (0..16).map(|k| iov(0x10_0000 + k * 0x1000, 512)).collect();
        assert!(run(&tiny, l).is_none());
        // 3 KiB segments, 3 a part: 9 KiB is cut back to 8 KiB, the last segment of the part
        // cut in two and its rest carried to the next part.
        let segs: Vec<_> = (0..8).map(|k| iov(0x20_0000 + k * 0x1000, 3072)).collect();
        let (out, parts) = run(&segs, l).unwrap();
        check_covers(&segs, &out, &parts, &l);
        assert_eq!(parts[0].bytes, 8192);
        assert_eq!(out[2], (0x20_2000, 2048));
        assert_eq!(out[3], (0x20_2000 + 2048, 1024));
        // Empty iovecs are skipped, never passed on.
        let with_empty = [iov(0x1000, 0), iov(0x2000, 4096), iov(0x3000, 0)];
        let (out, parts) = run(&with_empty, l).unwrap();
        assert_eq!((out, parts.len()), (vec![(0x2000, 4096)], 1));
    }

    #[test]
    fn many_shapes_cover_the_input() {
        // A deterministic sweep of segment sizes (multiples of 512) and limits.
        let mut x = 12345u64;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let n = 1 + (x >> 33) as usize % 40;
            let block = if x & 1 == 0 { 512 } else { 4096 };
            let l = SplitLimits {
                max_bytes: block * (1 + (x >> 20) % 16),
                max_iovs: 8 + (x >> 40) as usize % 8,
                block,
                cuts_runs: false,
            };
            let iovs: Vec<_> = (0..n)
                .map(|k| {
                    let len = 512 * (1 + ((x >> (k % 50)) as usize % 24));
                    iov(0x100_0000 * (k + 1), len)
                })
                .collect();
            if let Some((out, parts)) = run(&iovs, l) {
                check_covers(&iovs, &out, &parts, &l);
            } else {
                // Only when some window of max_iovs consecutive segments holds no block.
                assert!(block > 512);
            }
        }
    }

    #[test]
    fn the_last_part_decides_and_the_first_failure_wins() {
        let mut s = SplitState {
            left: 3,
            ..SplitState::default()
        };
        assert_eq!(s.part_done(4096, false, 12288), PartDone::Waiting);
        assert_eq!(s.part_done(-libc::EIO, false, 12288), PartDone::Waiting);
        assert_eq!(
            s.part_done(-libc::EINVAL, false, 12288),
            PartDone::Last(-libc::EIO)
        );
        assert_eq!(s.part_done(0, false, 1), PartDone::NotSplit);
        // All-or-nothing parts: success is the whole request.
        let mut s = SplitState {
            left: 2,
            ..SplitState::default()
        };
        assert_eq!(s.part_done(0, true, 65536), PartDone::Waiting);
        assert_eq!(s.part_done(0, true, 65536), PartDone::Last(65536));
        // Plain parts add up (a short part shows as a short request).
        let mut s = SplitState {
            left: 2,
            ..SplitState::default()
        };
        s.part_done(4096, false, 12288);
        assert_eq!(s.part_done(4096, false, 12288), PartDone::Last(8192));
    }
}
