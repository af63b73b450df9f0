//! Writes the committed seed corpus: `cargo run --example gen_seeds` (in fuzz/).
//!
//! Each seed is a named scenario, good or hostile, built as a structured [`Input`] and encoded
//! with [`Encode`] (the inverse of the fuzz target's `arbitrary` decoding), so libFuzzer starts
//! from inputs that reach deep into the parser instead of from random bytes. The generator also
//! runs every seed through the harness and prints what it popped and accepted, and fails if a
//! seed meant to be valid is not. The `dirty_log` seeds likewise: each must be mapped or
//! refused the way its scenario says.

use std::path::Path;

use mqblk_fuzz::*;

fn a(sel: u8, off: u32) -> Addr {
    Addr { sel, off }
}

fn d(addr: Addr, len: u32, flags: u16, next: u16) -> RawDesc {
    RawDesc {
        addr,
        len,
        flags,
        next,
    }
}

/// `RawDesc::len` values: `small(n)` is n bytes (n < 64), `sectors(n)` n*512 bytes (1..=16).
fn small(n: u32) -> u32 {
    n
}
fn sectors(n: u32) -> u32 {
    (1 << 30) | (n - 1)
}
fn bytes(n: u32) -> u32 {
    (2 << 30) | (n - 1)
}

const SPOT: Addr = Addr { sel: 4, off: 0 };

fn base(typ: u32, sector: u64) -> Input {
    let mut i = Input {
        layout: 0,
        qsize_log2: 4, // 16
        capacity: 2048,
        max_desc: 10,
        next_avail: 0,
        avail_ahead: 1,
        ..Input::default()
    };
    i.hdrs[0] = Hdr {
        at: SPOT,
        typ,
        sector,
        num: 8,
        flags: 0,
    };
    i
}

/// header -> data (4 KiB in region 1) -> status.
fn three(typ: u32, sector: u64, data_flags: u16) -> Input {
    let mut i = base(typ, sector);
    i.descs[0] = d(SPOT, small(16), F_NEXT, 1);
    i.descs[1] = d(a(1, 0x100), sectors(8), data_flags | F_NEXT, 2);
    i.descs[2] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    i
}

fn seeds() -> Vec<(&'static str, Input, bool)> {
    let mut v = Vec::new();
    // typ 0..=7 map to IN, OUT, FLUSH, GET_ID, DISCARD, WRITE_ZEROES, SECURE_ERASE, LIFETIME.
    v.push(("read_ok", three(0, 8, F_WRITE), true));
    v.push(("write_ok", three(1, 2040, 0), true));
    let mut i = base(2, 0);
    i.descs[0] = d(SPOT, small(16), F_NEXT, 1);
    i.descs[1] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    v.push(("flush_ok", i, true));
    let mut i = three(3, 0, F_WRITE);
    i.descs[1].len = bytes(20);
    v.push(("get_id_ok", i, true));
    let mut i = base(4, 0);
    i.descs[0] = d(SPOT, small(32), F_NEXT, 1); // header + segment in one descriptor
    i.descs[1] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    v.push(("discard_ok", i, true));
    let mut i = base(5, 0);
    i.hdrs[0].flags = 1; // unmap
    i.descs[0] = d(SPOT, small(16), F_NEXT, 1);
    i.descs[1] = d(a(4, 16), small(16), F_NEXT, 2);
    i.descs[2] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    v.push(("write_zeroes_split_ok", i, true));
    // Any layout: header split over two descriptors, status shares the data descriptor.
    let mut i = base(0, 0);
    i.descs[0] = d(SPOT, small(10), F_NEXT, 1);
    i.descs[1] = d(a(4, 10), small(6), F_NEXT, 2);
    i.descs[2] = d(a(1, 0), bytes(513), F_WRITE, 0);
    v.push(("any_layout_ok", i, true));
    // Indirect: head refers to a 3-entry indirect table.
    let mut i = base(0, 16);
    i.descs[0] = d(a(0, INDIRECT_OFF as u32), small(48), F_INDIRECT, 0);
    i.indirect[0] = d(SPOT, small(16), F_NEXT, 1);
    i.indirect[1] = d(a(1, 0x2000), sectors(2), F_WRITE | F_NEXT, 2);
    i.indirect[2] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    v.push(("indirect_ok", i, true));
    // Several chains on a bigger ring, next_avail near the wrap.
    let mut i = three(0, 0, F_WRITE);
    i.qsize_log2 = 6;
    i.next_avail = 0xfffe;
    i.avail_ahead = 6;
    i.heads = [0, 3, 6, 9, 0, 3, 6, 9];
    for k in 1..4u16 {
        let b = 3 * k as usize;
        i.descs[b] = d(SPOT, small(16), F_NEXT, b as u16 + 1);
        i.descs[b + 1] = d(
            a(1, 0x1000 * u32::from(k)),
            sectors(1),
            F_WRITE | F_NEXT,
            b as u16 + 2,
        );
        i.descs[b + 2] = d(a(0, 0x5000 + u32::from(k)), small(1), F_WRITE, 0);
    }
    v.push(("many_chains_wrap", i, true));

    // Hostile ones.
    let mut i = three(0, 0, F_WRITE);
    i.descs[2] = d(a(0, 0x5000), small(1), F_WRITE | F_NEXT, 0);
    v.push(("loop", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.descs[0].next = 0;
    i.max_desc = 39;
    i.qsize_log2 = 6;
    v.push(("self_loop_64", i, false));
    let mut i = base(0, 0);
    i.descs[0] = d(a(5, 0x7fff_0000), small(48), F_INDIRECT, 0);
    v.push(("indirect_outside", i, false));
    let mut i = base(0, 0);
    i.descs[0] = d(a(0, INDIRECT_OFF as u32), small(48), F_INDIRECT, 0);
    i.indirect[0] = d(SPOT, small(16), F_NEXT, 1);
    i.indirect[1] = d(a(0, INDIRECT_OFF as u32), small(48), F_INDIRECT | F_NEXT, 2);
    i.indirect[2] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    v.push(("indirect_nested", i, false));
    let mut i = base(0, 0);
    i.descs[0] = d(a(0, INDIRECT_OFF as u32), 0xffff_fff0, F_INDIRECT, 0);
    v.push(("indirect_huge", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.descs[0].addr = a(3, 0);
    v.push(("header_in_hole", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.descs[2].flags = 0;
    v.push(("status_readonly", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.descs[2].addr = a(7, 0);
    v.push(("status_at_u64_max", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.descs[1].addr = a(3, 0x10);
    v.push(("data_in_hole", i, true));
    let mut i = three(0, 0, F_WRITE);
    i.descs[1].addr = a(6, 32);
    v.push(("data_across_end", i, true));
    let mut i = three(0, 0, F_WRITE);
    i.layout = 2;
    i.descs[1].addr = a(6, 16);
    i.descs[2].addr = a(6, 1);
    v.push(("top_of_memory", i, true));
    let mut i = three(0, 0, F_WRITE);
    i.layout = 3;
    i.descs[1].addr = a(0, 0x7f00);
    v.push(("across_adjacent_regions", i, true));
    v.push(("past_capacity", three(0, 2047, F_WRITE), false));
    v.push(("sector_u64_max", three(1, u64::MAX, 0), false));
    let mut i = three(1, 0, 0);
    i.descs[1].len = bytes(511);
    v.push(("unaligned", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.hdrs[0].typ = 0xdead_beef;
    v.push(("unknown_type", i, false));
    let mut i = base(4, 0);
    i.descs[0] = d(SPOT, small(16), F_NEXT, 1);
    i.descs[1] = d(a(4, 16), small(32), F_NEXT, 2);
    i.descs[2] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    v.push(("two_discard_segments", i, false));
    let mut i = base(4, 0);
    i.hdrs[0].flags = 2;
    i.descs[0] = d(SPOT, small(32), F_NEXT, 1);
    i.descs[1] = d(a(0, 0x5000), small(1), F_WRITE, 0);
    v.push(("discard_reserved_flags", i, false));
    let mut i = three(1, 0, 0);
    i.readonly = true;
    v.push(("write_readonly", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.avail_ahead = 0x8000 | 17;
    v.push(("avail_too_far_ahead", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.heads = [999; NHEADS];
    v.push(("head_out_of_range", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.max_desc = 1;
    v.push(("too_many_descriptors", i, false));
    let mut i = three(0, 0, F_WRITE);
    i.descs[1].len = 0xffff_fff0;
    v.push(("length_overflow", i, false));
    v
}

fn raw_seeds() -> Vec<(&'static str, Vec<u8>)> {
    fn hdr(typ: u32, sector: u64) -> [u8; 32] {
        let mut h = [0u8; 32];
        h[0..4].copy_from_slice(&typ.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        h[24..28].copy_from_slice(&8u32.to_le_bytes());
        h
    }
    fn desc(addr: u64, len: u32, flags: u16) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b
    }
    fn seed(typ: u32, sector: u64, descs: &[[u8; 16]]) -> Vec<u8> {
        let mut v = vec![0xa0, 0, 0x10, 0]; // 21 descriptors, discard max 1024, capacity 0x10 * 8 sectors
        v.extend_from_slice(&hdr(typ, sector));
        for d in descs {
            v.extend_from_slice(d);
        }
        v
    }
    let (n, w) = (F_NEXT, F_WRITE);
    vec![
        (
            "read",
            seed(
                0,
                8,
                &[
                    desc(0x100, 16, n),
                    desc(0x8000, 4096, w | n),
                    desc(0x3000, 1, w),
                ],
            ),
        ),
        (
            "write",
            seed(
                1,
                0,
                &[
                    desc(0x100, 16, n),
                    desc(0x1000, 1024, n),
                    desc(0x3000, 1, w),
                ],
            ),
        ),
        (
            "discard",
            seed(11, 0, &[desc(0x100, 32, n), desc(0x3000, 1, w)]),
        ),
        (
            "status_top",
            seed(0, 0, &[desc(0x100, 16, n), desc(u64::MAX, 2, w)]),
        ),
        (
            "data_hole",
            seed(
                1,
                0,
                &[desc(0x100, 16, n), desc(0x5000, 512, n), desc(0x3000, 1, w)],
            ),
        ),
    ]
}

/// Seeds of the `dirty_log` target: the logs QEMU and Cloud Hypervisor hand over, unaligned
/// ones, a frontend that resizes the file, each way a log is refused, and guest ranges inside,
/// across the end of, far beyond and wrapping past the log.
mod log_seeds {
    use mqblk_fuzz::dirty_log::*;

    /// `Num` values (see `Num::resolve`).
    pub fn tiny(n: u64) -> Num {
        Num { sel: 0, raw: n }
    }
    pub fn bytes(n: u64) -> Num {
        Num { sel: 1, raw: n }
    }
    /// `p` pages plus `off` bytes.
    pub fn pages(p: u16, off: u16) -> Num {
        Num {
            sel: 2,
            raw: u64::from(p) | (u64::from(off) << 16),
        }
    }
    /// The edge (`near`) plus `d` bytes.
    pub fn edge(d: i16) -> Num {
        Num {
            sel: 3,
            raw: d as u16 as u64,
        }
    }
    /// The edge plus `d` pages.
    pub fn edge_pages(d: i16) -> Num {
        Num {
            sel: 4,
            raw: d as u16 as u64,
        }
    }
    pub fn raw(n: u64) -> Num {
        Num { sel: 5, raw: n }
    }
    /// `u64::MAX - k`.
    pub fn top(k: u16) -> Num {
        Num {
            sel: 6,
            raw: u64::from(k),
        }
    }
    /// `2^e + d`.
    pub fn pow2(e: u8, d: i8) -> Num {
        Num {
            sel: 7,
            raw: u64::from(e) | (u64::from(d as u8) << 8),
        }
    }

    fn m(gpa: Num, len: Num) -> Mark {
        Mark { gpa, len }
    }

    fn log(file_len: u16, flags: u8, offset: Num, size: Num, marks: &[Mark]) -> LogInput {
        let mut i = LogInput {
            file_len,
            flags,
            offset,
            size,
            nmarks: marks.len() as u8,
            ..LogInput::default()
        };
        i.marks[..marks.len()].copy_from_slice(marks);
        i
    }

    /// What an I/O thread marks: a status byte, a 4 KiB read, a 64 KiB read across pages, a
    /// used ring, the log's last page, a range across its end, one far beyond, one wrapping.
    fn io_marks() -> Vec<Mark> {
        vec![
            m(pages(3, 17), tiny(1)),
            m(pages(8, 0), pages(1, 0)),
            m(pages(100, 512), pages(16, 0)),
            m(pages(2, 0x100), bytes(6 + 8 * 256)),
            m(edge_pages(-1), edge(0)),
            m(edge_pages(-2), pages(5, 0)),
            m(pow2(40, 0), pages(1, 0)),
            m(top(10), tiny(20)),
        ]
    }

    /// `i`, which the frontend resizes to `to` bytes once it is mapped.
    fn resized(mut i: LogInput, to: u16) -> LogInput {
        i.flags |= RESIZE;
        i.resize = to;
        i
    }

    pub fn seeds() -> Vec<(&'static str, LogInput, Expect)> {
        use Expect::*;
        let io = io_marks();
        let everything = [m(tiny(0), raw(u64::MAX)), m(tiny(1), top(0))];
        vec![
            // QEMU: a page-rounded memfd sealed against shrinking; 32 KiB covers 1 GiB.
            (
                "qemu",
                log(32768, SEAL_SHRINK, tiny(0), bytes(32768), &io),
                Mapped,
            ),
            // Cloud Hypervisor: a memfd that allows sealing; mqblk seals it.
            (
                "cloud_hypervisor",
                log(4096, 0, tiny(0), edge(0), &io),
                Mapped,
            ),
            (
                "shrink_and_seal",
                log(8192, SEAL_SHRINK | SEAL_SEAL, tiny(0), bytes(100), &io),
                Mapped,
            ),
            // Not page-aligned: the log shares its page with bytes that must stay untouched.
            (
                "unaligned_offset",
                log(8192, 0, bytes(100), tiny(2), &io),
                Mapped,
            ),
            (
                "offset_in_second_page",
                log(12288, SEAL_GROW, bytes(4096 + 17), bytes(4000), &io),
                Mapped,
            ),
            (
                "last_byte_of_file",
                log(65535, 0, edge(-1), tiny(1), &io),
                Mapped,
            ),
            // The frontend resizes a mapped log: shrinking must fail, growing is its business.
            (
                "shrink_mapped",
                resized(log(16384, 0, tiny(0), bytes(16384), &io), 0),
                Mapped,
            ),
            (
                "grow_mapped",
                resized(log(4096, 0, bytes(1000), bytes(3000), &io), 65535),
                Mapped,
            ),
            (
                "grow_sealed",
                resized(log(4096, SEAL_GROW, tiny(0), bytes(4096), &io), 8192),
                Mapped,
            ),
            (
                "mark_everything",
                log(1024, 0, tiny(0), edge(0), &everything),
                Mapped,
            ),
            // Refused.
            (
                "no_sealing",
                log(4096, NO_SEALING, tiny(0), bytes(4096), &io),
                Unsealable,
            ),
            (
                "sealed_against_seals",
                log(4096, SEAL_SEAL, tiny(0), bytes(4096), &io),
                Unsealable,
            ),
            (
                "write_sealed",
                log(4096, SEAL_SHRINK | SEAL_WRITE, tiny(0), bytes(4096), &io),
                Map,
            ),
            (
                "future_write_sealed",
                log(4096, SEAL_FUTURE_WRITE, tiny(0), bytes(64), &io),
                Map,
            ),
            ("past_end", log(4096, 0, bytes(4000), edge(1), &io), PastEnd),
            ("offset_wraps", log(4096, 0, top(0), tiny(2), &io), PastEnd),
            ("empty_file", log(0, 0, tiny(0), tiny(1), &io), PastEnd),
            ("size_zero", log(4096, 0, tiny(0), tiny(0), &io), Size),
            (
                "size_over_1g",
                log(4096, 0, tiny(0), pow2(30, 1), &io),
                Size,
            ),
        ]
    }
}

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let pr = dir.join("parse_request");
    let rb = dir.join("raw_bytes");
    std::fs::create_dir_all(&pr).unwrap();
    std::fs::create_dir_all(&rb).unwrap();
    for (name, input, valid) in seeds() {
        let bytes = input.to_bytes();
        assert_eq!(
            Input::from_bytes(&bytes).as_ref(),
            Some(&input),
            "{name}: encoding"
        );
        let (popped, ok) = run_queue(&input);
        for line in explain(&input) {
            println!("    {line}");
        }
        println!(
            "parse_request/{name}: {} bytes, popped {popped}, valid {ok}",
            bytes.len()
        );
        if valid {
            assert!(ok > 0, "{name} was meant to hold a valid request");
        }
        std::fs::write(pr.join(name), bytes).unwrap();
    }
    let dl = dir.join("dirty_log");
    std::fs::create_dir_all(&dl).unwrap();
    for (name, input, want) in log_seeds::seeds() {
        use mqblk_fuzz::dirty_log::{run_dirty_log, LogInput};
        let bytes = input.to_bytes();
        assert_eq!(
            LogInput::from_bytes(&bytes).as_ref(),
            Some(&input),
            "{name}: encoding"
        );
        let out = run_dirty_log(&input);
        println!("dirty_log/{name}: {} bytes, {out:?}", bytes.len());
        assert_eq!(out.map, want, "{name}: map");
        std::fs::write(dl.join(name), bytes).unwrap();
    }
    for (name, bytes) in raw_seeds() {
        let ok = run_raw(&bytes);
        println!("raw_bytes/{name}: {} bytes, valid {ok:?}", bytes.len());
        std::fs::write(rb.join(name), bytes).unwrap();
    }
}
