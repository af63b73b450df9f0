//! The `dirty_log` target: the live-migration dirty log ([`mqblk::io::dirty_log::DirtyLog`])
//! against a hostile frontend and a hostile guest.
//!
//! The frontend chooses the log's file, offset and size (SET_LOG_BASE): here a memfd of up to
//! 64 KiB, created with or without MFD_ALLOW_SEALING and carrying any mix of seals, and any
//! offset and size (huge ones and ones whose sum wraps included). [`DirtyLog::map`] must accept
//! it exactly when [`expect_map`] says, and refuse it for the reason it gives: a log mqblk maps
//! wrongly either faults (SIGBUS, the whole daemon down) or writes into the frontend's memory
//! outside the log. Once mapped, the frontend may try to resize the file (a shrink must fail:
//! the file is sealed) and the guest's requests choose the ranges marked: small ranges inside
//! the log, ranges across its end, far beyond it, and ranges that wrap past 2^64.
//!
//! The oracle is a plain bitmap ([`model_mark`]): one loop over the pages of each range that
//! lie within the log, setting bit `page % 8` of byte `page / 8`, and a count (in u128, which
//! cannot overflow) of the pages beyond it. After the marks the whole file is read back through
//! a second descriptor (pread, not the mapping): the log's bytes must equal the model exactly,
//! and every other byte of the file must still be zero, including those that share a page with
//! the log (mapped, so writable, but not the log's).
//!
//! As in the crate root, the input is decoded by `arbitrary`'s derive and [`Encode`] is its
//! inverse, used by `examples/gen_seeds.rs` for the committed seeds.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

use arbitrary::Arbitrary;
use mqblk::io::dirty_log::{DirtyLog, LogError, LOG_PAGE, MAX_LOG_BYTES};

use crate::Encode;

/// Largest memfd the target makes: small, so that a run (create, map, read back) stays cheap,
/// and still a log of 512 Ki pages (2 GiB of guest memory).
pub const MAX_FILE: u64 = 64 * 1024;
/// Marks an input holds.
pub const NMARKS: usize = 32;

/// [`LogInput::flags`]: the memfd is created without MFD_ALLOW_SEALING (so it carries
/// F_SEAL_SEAL and cannot gain F_SEAL_SHRINK: mqblk must refuse it). Inverted so that an
/// all-zero input is a log mqblk accepts.
pub const NO_SEALING: u8 = 1 << 0;
/// Sealed with F_SEAL_SHRINK before it is handed over (QEMU's log).
pub const SEAL_SHRINK: u8 = 1 << 1;
/// Sealed with F_SEAL_SEAL: no further seals (refused unless F_SEAL_SHRINK is there already).
pub const SEAL_SEAL: u8 = 1 << 2;
/// Sealed with F_SEAL_GROW (then growing it after the map fails too; harmless to mqblk).
pub const SEAL_GROW: u8 = 1 << 3;
/// Sealed with F_SEAL_WRITE: no writable shared mapping, so mmap refuses it.
pub const SEAL_WRITE: u8 = 1 << 4;
/// Sealed with F_SEAL_FUTURE_WRITE: likewise.
pub const SEAL_FUTURE_WRITE: u8 = 1 << 5;
/// Once the log is mapped, halfway through the marks, the frontend resizes the file to
/// [`LogInput::resize`] bytes.
pub const RESIZE: u8 = 1 << 6;

/// A u64 chosen so that small in-range values and huge or wrapping ones both occur.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Num {
    /// Selector (mod 8); see [`Num::resolve`].
    pub sel: u8,
    /// Raw value.
    pub raw: u64,
}

impl Num {
    /// The value, given the one that makes an edge here (`near`: the file's length for an
    /// offset, what is left of it for a size, the log's reach for an address, what is left of
    /// that for a length):
    /// 0 a few bytes (0 included), 1 up to 64 KiB, 2 up to 64 Ki pages at any alignment,
    /// 3 `near` ± 32 KiB, 4 `near` ± 32 Ki pages, 5 the raw u64, 6 within 64 KiB of
    /// `u64::MAX`, 7 a power of two ± 128.
    pub fn resolve(&self, near: u64) -> u64 {
        let r = self.raw;
        match self.sel % 8 {
            0 => r % 64,
            1 => r % (MAX_FILE + 1),
            2 => (r & 0xffff) * LOG_PAGE + (r >> 16) % LOG_PAGE,
            3 => near.wrapping_add(r as i16 as u64),
            4 => near.wrapping_add((r as i16 as u64).wrapping_mul(LOG_PAGE)),
            5 => r,
            6 => u64::MAX - r % 0x1_0000,
            _ => (1u64 << (r % 64)).wrapping_add((r >> 8) as i8 as u64),
        }
    }
}

/// One range a guest request wrote: `gpa..gpa + len`.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mark {
    /// Start (near: the log's reach).
    pub gpa: Num,
    /// Length (near: the log's reach less `gpa`, so that ranges end right at its edge).
    pub len: Num,
}

/// Everything the frontend and the guest control, for the `dirty_log` target.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq, Default)]
pub struct LogInput {
    /// The memfd's length in bytes (0 to 64 KiB - 1).
    pub file_len: u16,
    /// [`NO_SEALING`], the seals ([`SEAL_SHRINK`] ...) and [`RESIZE`].
    pub flags: u8,
    /// SET_LOG_BASE's offset (near: the file's length).
    pub offset: Num,
    /// SET_LOG_BASE's size (near: the file's length less the offset).
    pub size: Num,
    /// Marks applied: this mod (NMARKS + 1).
    pub nmarks: u8,
    /// The marks.
    pub marks: [Mark; NMARKS],
    /// The length the frontend resizes the file to, with [`RESIZE`]. (Last: `arbitrary`
    /// decodes the last field from whatever is left, which an array would not round-trip.)
    pub resize: u16,
}

/// What [`DirtyLog::map`] must answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// The log is mapped.
    Mapped,
    /// [`LogError::Size`]: 0 bytes or more than 1 GiB.
    Size,
    /// [`LogError::Unsealable`]: the file lacks F_SEAL_SHRINK and cannot gain it.
    Unsealable,
    /// [`LogError::PastEnd`]: offset + size overflows or passes the file's end.
    PastEnd,
    /// [`LogError::Map`]: the file is sealed against writing.
    Map,
}

/// The seals carried by a memfd made for `flags`, as F_GET_SEALS reports them.
pub fn seals_of(flags: u8) -> libc::c_int {
    if flags & NO_SEALING != 0 {
        // memfd_create without MFD_ALLOW_SEALING: F_SEAL_SEAL from the start.
        return libc::F_SEAL_SEAL;
    }
    let mut s = 0;
    for (bit, seal) in [
        (SEAL_SHRINK, libc::F_SEAL_SHRINK),
        (SEAL_SEAL, libc::F_SEAL_SEAL),
        (SEAL_GROW, libc::F_SEAL_GROW),
        (SEAL_WRITE, libc::F_SEAL_WRITE),
        (SEAL_FUTURE_WRITE, libc::F_SEAL_FUTURE_WRITE),
    ] {
        if flags & bit != 0 {
            s |= seal;
        }
    }
    s
}

/// The model of [`DirtyLog::map`], checks in its order: the size (1 byte to 1 GiB); the seal
/// (F_SEAL_SHRINK already there, or F_SEAL_SEAL absent so that mqblk can add it); the range
/// (offset + size neither overflows nor passes the file's end); and mmap itself, which refuses
/// a writable shared mapping of a file sealed against writing.
pub fn expect_map(file_len: u64, flags: u8, offset: u64, size: u64) -> Expect {
    let seals = seals_of(flags);
    let sealable = seals & libc::F_SEAL_SHRINK != 0 || seals & libc::F_SEAL_SEAL == 0;
    if size == 0 || size > MAX_LOG_BYTES {
        Expect::Size
    } else if !sealable {
        Expect::Unsealable
    } else if u128::from(offset) + u128::from(size) > u128::from(file_len) {
        Expect::PastEnd
    } else if seals & (libc::F_SEAL_WRITE | libc::F_SEAL_FUTURE_WRITE) != 0 {
        Expect::Map
    } else {
        Expect::Mapped
    }
}

/// The oracle of [`DirtyLog::mark`]: sets the bits of the pages of `gpa..gpa + len` that lie
/// within the log `bits` (bit `page % 8` of byte `page / 8`) and returns the pages of the range
/// beyond the log, counted rather than walked (a range may span 2^52 pages). A range that runs
/// past the top of the address space ends at `u64::MAX` (there is no page beyond it; the log
/// saturates there too). Everything in u128: nothing can overflow.
///
/// Pages are set one at a time, except that a byte whose 8 pages all lie in the range is set
/// whole: the harness's own loops are instrumented like mqblk's code (a comparison hook per
/// iteration), and a page-by-page walk over a 64 KiB log would be most of a run's time.
pub fn model_mark(bits: &mut [u8], gpa: u64, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let page = u128::from(LOG_PAGE);
    let pages = bits.len() as u128 * 8;
    let first = u128::from(gpa) / page;
    let last = (u128::from(gpa) + u128::from(len) - 1).min(u128::from(u64::MAX)) / page;
    let mut p = first;
    while p <= last && p < pages {
        if p % 8 == 0 && p + 7 <= last && p + 7 < pages {
            // Pages p..=p+7: the whole byte, and as many whole bytes as follow.
            let whole = ((last + 1).min(pages) - p) / 8;
            bits[(p / 8) as usize..(p / 8 + whole) as usize].fill(0xff);
            p += whole * 8;
        } else {
            bits[(p / 8) as usize] |= 1 << (p % 8);
            p += 1;
        }
    }
    let beyond_from = first.max(pages);
    if last >= beyond_from {
        (last - beyond_from + 1) as u64
    } else {
        0
    }
}

/// What one input did, for the seed generator's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogOutcome {
    /// What map answered.
    pub map: Expect,
    /// Bits set in the log at the end.
    pub marked: u64,
    /// Pages the marks reported beyond the log.
    pub beyond: u64,
}

/// A memfd of `len` bytes, with the seals of `flags`.
fn memfd(len: u64, flags: u8) -> File {
    let mut mfd = libc::MFD_CLOEXEC;
    if flags & NO_SEALING == 0 {
        mfd |= libc::MFD_ALLOW_SEALING;
    }
    // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"mqblk-fuzz-dirty-log".as_ptr(), mfd) };
    assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
    // SAFETY: a fresh descriptor, owned by the File alone.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).expect("harness: sizing the memfd");
    let seals = seals_of(flags);
    if flags & NO_SEALING == 0 && seals != 0 {
        // SAFETY: fcntl on a descriptor we own, adding seals (an int argument).
        let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) };
        assert_eq!(rc, 0, "F_ADD_SEALS: {}", io::Error::last_os_error());
    }
    f
}

fn get_seals(f: &File) -> libc::c_int {
    // SAFETY: fcntl on a descriptor we own; F_GET_SEALS takes no argument.
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GET_SEALS) }
}

/// Whether `b` (at most 64 KiB, as every file here) is all zeros.
fn is_zero(b: &[u8]) -> bool {
    static ZEROS: [u8; 1 << 16] = [0; 1 << 16];
    b == &ZEROS[..b.len()]
}

/// The whole file, read through `view` (a descriptor of its own, not the mapping).
fn read_all(view: &File) -> Vec<u8> {
    let len = view.metadata().expect("harness: stat").len();
    let mut v = vec![0u8; len as usize];
    view.read_exact_at(&mut v, 0).expect("harness: pread");
    v
}

/// Runs one `dirty_log` input; panics where mqblk disagrees with the model.
pub fn run_dirty_log(input: &LogInput) -> LogOutcome {
    let file_len = u64::from(input.file_len);
    let flags = input.flags;
    let file = memfd(file_len, flags);
    let view = file.try_clone().expect("harness: dup");
    let offset = input.offset.resolve(file_len);
    let size = input.size.resolve(file_len.wrapping_sub(offset));
    let want = expect_map(file_len, flags, offset, size);

    let log = match DirtyLog::map(file, offset, size) {
        Ok(log) => {
            assert_eq!(want, Expect::Mapped, "mapped {size} bytes at {offset}");
            log
        }
        Err(e) => {
            let got = match &e {
                LogError::Size(s) => {
                    assert_eq!(*s, size, "{e}");
                    Expect::Size
                }
                LogError::Unsealable(_) => Expect::Unsealable,
                LogError::PastEnd {
                    size: s,
                    offset: o,
                    file_len: l,
                } => {
                    assert_eq!((*s, *o, *l), (size, offset, file_len), "{e}");
                    Expect::PastEnd
                }
                LogError::Map(_) => Expect::Map,
                LogError::Stat(_) => panic!("stat of a memfd failed: {e}"),
            };
            assert_eq!(got, want, "{size} bytes at {offset} refused: {e}");
            // A refused log leaves the file as it was (a seal aside).
            let bytes = read_all(&view);
            assert_eq!(
                bytes.len() as u64,
                file_len,
                "file resized by a refused map"
            );
            assert!(is_zero(&bytes), "refused map wrote the file");
            return LogOutcome {
                map: got,
                marked: 0,
                beyond: 0,
            };
        }
    };

    // Mapped: the file can no longer shrink, whoever holds it.
    assert_ne!(get_seals(&view) & libc::F_SEAL_SHRINK, 0, "mapped unsealed");
    assert_eq!(log.len() as u64, size);
    assert!(!log.is_empty());
    let covers = size * 8 * LOG_PAGE; // size <= 64 KiB: no overflow
    assert_eq!(log.covers(), covers);

    let mut model = vec![0u8; size as usize];
    let mut cur_len = file_len;
    let mut beyond = 0u64;
    let n = usize::from(input.nmarks) % (NMARKS + 1);
    for (i, m) in input.marks[..n].iter().enumerate() {
        if i == n / 2 && flags & RESIZE != 0 {
            cur_len = frontend_resize(&view, cur_len, u64::from(input.resize), flags);
        }
        let gpa = m.gpa.resolve(covers);
        let len = m.len.resolve(covers.wrapping_sub(gpa));
        let fits = u128::from(gpa) + u128::from(len) <= u128::from(covers);
        assert_eq!(log.fits(gpa, len), fits, "fits({gpa:#x}, {len:#x})");
        let got = log.mark(gpa, len);
        let want = model_mark(&mut model, gpa, len);
        assert_eq!(got, want, "mark({gpa:#x}, {len:#x}): pages beyond the log");
        beyond += want;
    }
    if n == 0 && flags & RESIZE != 0 {
        cur_len = frontend_resize(&view, cur_len, u64::from(input.resize), flags);
    }

    let bytes = read_all(&view);
    assert_eq!(bytes.len() as u64, cur_len, "file length");
    // Slice comparisons (memcmp) first, the byte-by-byte search only to report a mismatch.
    let (start, end) = (offset as usize, (offset + size) as usize);
    if bytes[start..end] != model[..] {
        let i = (0..model.len())
            .find(|&i| bytes[start + i] != model[i])
            .unwrap();
        panic!(
            "log byte {i} (page {}..{}) is {:#010b}, the model says {:#010b}",
            i * 8,
            i * 8 + 7,
            bytes[start + i],
            model[i]
        );
    }
    if !is_zero(&bytes[..start]) || !is_zero(&bytes[end..]) {
        let i = (0..bytes.len())
            .find(|&i| (i < start || i >= end) && bytes[i] != 0)
            .unwrap();
        panic!(
            "file byte {i} outside the log ({start}..{end}) written: {:#04x}",
            bytes[i]
        );
    }
    drop(log);
    LogOutcome {
        map: Expect::Mapped,
        marked: model.iter().map(|b| u64::from(b.count_ones())).sum(),
        beyond,
    }
}

/// The frontend resizes a mapped log's file from `cur` to `new` bytes: shrinking must fail
/// (the seal mqblk relies on), growing fails only under F_SEAL_GROW. Returns the new length.
fn frontend_resize(view: &File, cur: u64, new: u64, flags: u8) -> u64 {
    let r = view.set_len(new);
    let refused = new < cur || (new > cur && seals_of(flags) & libc::F_SEAL_GROW != 0);
    match r {
        Ok(()) => {
            assert!(
                !refused,
                "the frontend resized a mapped log from {cur} to {new}"
            );
            new
        }
        Err(e) => {
            assert!(refused, "resizing from {cur} to {new}: {e}");
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            cur
        }
    }
}

impl Encode for Num {
    fn encode(&self, out: &mut Vec<u8>) {
        self.sel.encode(out);
        self.raw.encode(out);
    }
}

impl Encode for Mark {
    fn encode(&self, out: &mut Vec<u8>) {
        self.gpa.encode(out);
        self.len.encode(out);
    }
}

impl Encode for LogInput {
    fn encode(&self, out: &mut Vec<u8>) {
        self.file_len.encode(out);
        self.flags.encode(out);
        self.offset.encode(out);
        self.size.encode(out);
        self.nmarks.encode(out);
        self.marks.encode(out);
        self.resize.encode(out);
    }
}

impl LogInput {
    /// The bytes that decode to this input.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode(&mut v);
        v
    }

    /// Decodes bytes the way the fuzz target does.
    pub fn from_bytes(data: &[u8]) -> Option<LogInput> {
        let u = arbitrary::Unstructured::new(data);
        LogInput::arbitrary_take_rest(u).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_round_trips() {
        let mut i = LogInput {
            file_len: 4096,
            flags: SEAL_SHRINK | RESIZE,
            offset: Num { sel: 1, raw: 100 },
            size: Num {
                sel: 5,
                raw: u64::MAX,
            },
            nmarks: 3,
            resize: 9000,
            ..LogInput::default()
        };
        i.marks[NMARKS - 1] = Mark {
            gpa: Num { sel: 6, raw: 7 },
            len: Num {
                sel: 3,
                raw: 0xffff,
            },
        };
        assert_eq!(LogInput::from_bytes(&i.to_bytes()), Some(i));
    }

    /// The model's whole-byte shortcut against a walk of every page, on a 3-byte log.
    #[test]
    fn model_agrees_with_a_page_walk() {
        for first in 0..40u64 {
            for n in 1..40u64 {
                let mut fast = vec![0u8; 3];
                let beyond = model_mark(&mut fast, first * LOG_PAGE + 5, n * LOG_PAGE - 5);
                let mut slow = vec![0u8; 3];
                for p in first..first + n {
                    if p < 24 {
                        slow[(p / 8) as usize] |= 1 << (p % 8);
                    }
                }
                assert_eq!(fast, slow, "pages {first}+{n}");
                assert_eq!(
                    beyond,
                    (first..first + n).filter(|&p| p >= 24).count() as u64
                );
            }
        }
    }

    #[test]
    fn model_marks_like_the_unit_tests() {
        let mut b = vec![0u8; 2];
        assert_eq!(model_mark(&mut b, 15 * LOG_PAGE, 3 * LOG_PAGE), 2);
        assert_eq!(b, [0, 0x80]);
        assert_eq!(model_mark(&mut b, u64::MAX - 10, 100), 1);
        assert_eq!(model_mark(&mut b, 0, u64::MAX), (1 << 52) - 16);
        assert_eq!(b, [0xff, 0xff]);
        // Whole bytes between partial ones, and a range that ends inside the log.
        let mut b = vec![0u8; 4];
        assert_eq!(model_mark(&mut b, 5 * LOG_PAGE, 20 * LOG_PAGE), 0);
        assert_eq!(b, [0b1110_0000, 0xff, 0xff, 0b0000_0001]);
        assert_eq!(model_mark(&mut b, 24 * LOG_PAGE + 1, 16 * LOG_PAGE), 9);
        assert_eq!(b, [0b1110_0000, 0xff, 0xff, 0xff]);
    }
}
