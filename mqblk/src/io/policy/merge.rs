//! Merging adjacent requests into one host I/O.
//!
//! Within one batch of one queue, requests in the same direction on contiguous sectors become
//! one readv/writev, bounded by IOV_MAX iovecs and a maximum size. Each request keeps its own
//! status. The decision is a pure function of the requests' shapes.

/// Direction of a mergeable request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// A read.
    Read,
    /// A write.
    Write,
}

/// What the merge decision needs to know about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Direction.
    pub dir: Dir,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// Number of iovecs.
    pub iovs: usize,
}

/// Merge limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergeLimits {
    /// Most iovecs in one merged I/O (IOV_MAX).
    pub max_iovs: usize,
    /// Most bytes in one merged I/O.
    pub max_bytes: u64,
}

/// Whether `next` can extend a merged run that currently ends with `run` (a `Shape` describing
/// the whole run so far).
pub fn can_extend(run: &Shape, next: &Shape, limits: &MergeLimits) -> bool {
    run.dir == next.dir
        && run.offset.checked_add(run.len) == Some(next.offset)
        && run.iovs + next.iovs <= limits.max_iovs
        && run.len + next.len <= limits.max_bytes
}

/// Splits `shapes` (in submission order) into runs to submit as one I/O each; calls `emit`
/// with (first index, count) for each run, in order. Only neighbours in submission order
/// merge, so the guest's order is kept.
pub fn plan(shapes: &[Shape], limits: &MergeLimits, mut emit: impl FnMut(usize, usize)) {
    let mut start = 0;
    while start < shapes.len() {
        let mut run = shapes[start];
        let mut n = 1;
        while start + n < shapes.len() && can_extend(&run, &shapes[start + n], limits) {
            let s = &shapes[start + n];
            run.len += s.len;
            run.iovs += s.iovs;
            n += 1;
        }
        emit(start, n);
        start += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: MergeLimits = MergeLimits {
        max_iovs: 4,
        max_bytes: 64 * 1024,
    };

    fn s(dir: Dir, offset: u64, len: u64) -> Shape {
        Shape {
            dir,
            offset,
            len,
            iovs: 1,
        }
    }

    fn runs(shapes: &[Shape]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        plan(shapes, &L, |a, b| out.push((a, b)));
        out
    }

    #[test]
    fn sequential_writes_merge() {
        let v = [
            s(Dir::Write, 0, 4096),
            s(Dir::Write, 4096, 4096),
            s(Dir::Write, 8192, 4096),
        ];
        assert_eq!(runs(&v), vec![(0, 3)]);
    }

    #[test]
    fn direction_gap_and_order_break_runs() {
        let v = [
            s(Dir::Write, 0, 4096),
            s(Dir::Read, 4096, 4096),
            s(Dir::Read, 8192, 4096),
            s(Dir::Read, 16384, 4096),
            s(Dir::Read, 12288, 4096),
        ];
        assert_eq!(runs(&v), vec![(0, 1), (1, 2), (3, 1), (4, 1)]);
    }

    #[test]
    fn limits_bound_runs() {
        let v: Vec<Shape> = (0..6).map(|i| s(Dir::Read, i * 4096, 4096)).collect();
        assert_eq!(runs(&v), vec![(0, 4), (4, 2)]);
        let big: Vec<Shape> = (0..3).map(|i| s(Dir::Write, i * 32768, 32768)).collect();
        assert_eq!(runs(&big), vec![(0, 2), (2, 1)]);
    }

    #[test]
    fn overflow_offsets_do_not_merge() {
        let v = [s(Dir::Read, u64::MAX - 511, 512), s(Dir::Read, 0, 512)];
        assert_eq!(runs(&v), vec![(0, 1), (1, 1)]);
        assert!(runs(&[]).is_empty());
    }
}
