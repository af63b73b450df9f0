//! Shared harness of mqblk's fuzz targets.
//!
//! `parse_request` builds, from a structure-aware [`Input`], what a hostile guest controls: a
//! guest memory map with holes (and, in one layout, a region at the very top of the address
//! space), a descriptor table, an indirect table, request headers and discard segments, and the
//! avail ring (heads, and an avail index that may run ahead of the queue). It then does what an
//! mqblk I/O thread does with that ring: pop every chain (`virtio_queue::Queue`), parse it with
//! [`mqblk::blk::parse`], map the data buffers of a valid read/write with the I/O thread's own
//! `map_segments`, write the status byte and add the used entry, and checks invariants at every
//! step (see [`check_outcome`]). Every chain is also walked with mqblk's own
//! [`ChainWalker`] (which resubmits in-flight heads after a reconnect), which must yield exactly
//! the descriptors virtio-queue yields.
//!
//! `raw_bytes` feeds plain bytes straight to the parser as a descriptor list over a fixed memory
//! map: cheap, and good at finding arithmetic panics.
//!
//! `dirty_log` (module [`dirty_log`]) maps the live-migration dirty log from a hostile
//! frontend's memfd and marks a hostile guest's ranges in it, against a plain bitmap model.
//!
//! `qcow2_image` (module [`qcow2_image`]) opens a qcow2 image of arbitrary bytes as an export.
//!
//! The input is decoded by `arbitrary`'s derive: fields in order, integers little-endian, bools
//! from the low bit of a byte, zeros once the data runs out. [`Encode`] is the inverse, used by
//! `examples/gen_seeds.rs` to write the committed seed corpus.

pub mod dirty_log;
pub mod memory_table;
pub mod qcow2_image;

use arbitrary::Arbitrary;
use mqblk::blk::chain::{ChainWalker, HostTable};
use mqblk::blk::guest_bytes::host_range;
use mqblk::blk::{self, Kind, Limits, Rejected, Request, Scratch, Segment};
use mqblk::io::slots::{map_segments, IOV_MAX};
use virtio_bindings::virtio_blk::*;
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// The guest memory type of the targets (the I/O threads').
pub type Mem = GuestMemoryMmap<()>;

/// Descriptor flag bits, as u16.
pub const F_NEXT: u16 = VRING_DESC_F_NEXT as u16;
/// Device-writable.
pub const F_WRITE: u16 = VRING_DESC_F_WRITE as u16;
/// Refers to an indirect table.
pub const F_INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;

/// Largest queue size the harness builds (rings are laid out for it).
pub const MAX_QUEUE: u16 = 256;
/// Entries of the descriptor table that the input gives; the rest repeat them.
pub const NDESC: usize = 16;
/// Entries of the indirect table.
pub const NINDIRECT: usize = 16;
/// Headers (and discard segments) the input places in memory.
pub const NHDR: usize = 4;
/// Avail ring entries the input gives; the rest repeat them.
pub const NHEADS: usize = 8;

/// Offsets of the fixed structures inside region 0.
pub const DESC_OFF: u64 = 0x0;
/// Avail ring (never at GPA 0: virtio-queue treats that as "not ready").
pub const AVAIL_OFF: u64 = 0x1000;
/// Used ring.
pub const USED_OFF: u64 = 0x2000;
/// The indirect table.
pub const INDIRECT_OFF: u64 = 0x3000;
/// Where [`Addr`] selector 4 points: a page of headers and segments.
pub const SPOT_OFF: u64 = 0x4000;

/// A guest memory layout: (guest-physical start, size) of each region, in ascending order.
pub fn layout(sel: u8) -> &'static [(u64, usize)] {
    const L0: &[(u64, usize)] = &[(0x0, 0x10000), (0x20000, 0x10000)];
    const L1: &[(u64, usize)] = &[(0x1000, 0x10000), (0x12000, 0x1000), (0x100000, 0x10000)];
    // A region that ends 64 KiB below 2^64: address arithmetic near the top must not wrap.
    const L2: &[(u64, usize)] = &[(0x10000, 0x10000), (0xffff_ffff_fffe_0000, 0x10000)];
    // Two adjacent regions (one guest range split over two mappings) plus one past a hole.
    const L3: &[(u64, usize)] = &[(0x8000, 0x8000), (0x10000, 0x8000), (0x40000, 0x2000)];
    match sel % 4 {
        0 => L0,
        1 => L1,
        2 => L2,
        _ => L3,
    }
}

/// A guest address chosen so that it often lands somewhere interesting.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Addr {
    /// Selector (mod 8): 0..=2 inside region `sel` (mod the region count), 3 in the hole after
    /// region 0, 4 in the header spot, 5 the raw value `off`, 6 near the end of the last region,
    /// 7 `u64::MAX - off`.
    pub sel: u8,
    /// Offset or raw value.
    pub off: u32,
}

impl Addr {
    /// Resolves against a layout.
    pub fn resolve(&self, regions: &[(u64, usize)]) -> u64 {
        let off = u64::from(self.off);
        match self.sel % 8 {
            s @ 0..=2 => {
                let (base, size) = regions[s as usize % regions.len()];
                base + off % size as u64
            }
            3 => {
                let (base, size) = regions[0];
                base + size as u64 + off % 0x1000
            }
            4 => regions[0].0 + SPOT_OFF + off % 0x1000,
            5 => off,
            6 => {
                let (base, size) = regions[regions.len() - 1];
                base + size as u64 - (off % 64)
            }
            _ => u64::MAX - off,
        }
    }
}

/// One descriptor as the guest writes it.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RawDesc {
    /// Buffer address.
    pub addr: Addr,
    /// Length; see [`RawDesc::length`].
    pub len: u32,
    /// Flags (any bits, reserved ones included).
    pub flags: u16,
    /// Next index.
    pub next: u16,
}

impl RawDesc {
    /// The length written: small and sector-sized values are made common by the top bits.
    pub fn length(&self) -> u32 {
        match self.len >> 30 {
            0 => self.len & 0x3f,              // 0..63: headers, status, short buffers
            1 => ((self.len & 0xf) + 1) * 512, // 1..16 sectors
            2 => (self.len & 0x1fff) + 1,      // up to 8 KiB, any alignment
            _ => self.len | 0xffff_0000,       // huge
        }
    }

    /// Encodes it the way the guest writes it into a descriptor table.
    pub fn to_descriptor(&self, regions: &[(u64, usize)]) -> Descriptor {
        Descriptor::new(
            self.addr.resolve(regions),
            self.length(),
            self.flags,
            self.next,
        )
    }
}

/// A request header (and a discard/write-zeroes segment right after it) placed in memory.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hdr {
    /// Where.
    pub at: Addr,
    /// Request type: values below 16 map to the interesting types, others are used raw.
    pub typ: u32,
    /// Sector field.
    pub sector: u64,
    /// Segment: sector count.
    pub num: u32,
    /// Segment: flags.
    pub flags: u32,
}

impl Hdr {
    /// The request type written.
    pub fn request_type(&self) -> u32 {
        const TYPES: [u32; 8] = [
            VIRTIO_BLK_T_IN,
            VIRTIO_BLK_T_OUT,
            VIRTIO_BLK_T_FLUSH,
            VIRTIO_BLK_T_GET_ID,
            VIRTIO_BLK_T_DISCARD,
            VIRTIO_BLK_T_WRITE_ZEROES,
            VIRTIO_BLK_T_SECURE_ERASE,
            10, // VIRTIO_BLK_T_GET_LIFETIME
        ];
        if self.typ < 16 {
            TYPES[(self.typ % 8) as usize]
        } else {
            self.typ
        }
    }

    /// The 32 bytes written at `at`: header, then one segment.
    pub fn bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..4].copy_from_slice(&self.request_type().to_le_bytes());
        b[8..16].copy_from_slice(&self.sector.to_le_bytes());
        b[16..24].copy_from_slice(&(self.sector >> 3).to_le_bytes());
        b[24..28].copy_from_slice(&self.num.to_le_bytes());
        b[28..32].copy_from_slice(&self.flags.to_le_bytes());
        b
    }
}

/// Everything the guest controls, for the `parse_request` target.
#[derive(Arbitrary, Debug, Clone, PartialEq, Eq, Default)]
pub struct Input {
    /// Memory layout, see [`layout`].
    pub layout: u8,
    /// Queue size = 2^(this mod 7).
    pub qsize_log2: u8,
    /// Read-only export.
    pub readonly: bool,
    /// Capacity in sectors.
    pub capacity: u32,
    /// Limits::max_descriptors = 1 + (this mod 40).
    pub max_desc: u8,
    /// The queue's next avail index (as restored by SET_VRING_BASE).
    pub next_avail: u16,
    /// How far avail->idx is ahead of next_avail; see [`Input::avail_ahead`].
    pub avail_ahead: u16,
    /// Avail ring entries (repeated over the ring).
    pub heads: [u16; NHEADS],
    /// Descriptor table entries (repeated over the table).
    pub descs: [RawDesc; NDESC],
    /// The indirect table at INDIRECT_OFF.
    pub indirect: [RawDesc; NINDIRECT],
    /// Headers placed in memory.
    pub hdrs: [Hdr; NHDR],
    /// Byte that fills guest memory first.
    pub fill: u8,
}

impl Input {
    /// The queue size: 1 to 64. (Bigger rings take no other path, only longer: a loop walks
    /// queue-size descriptors, for each of queue-size chains.)
    pub fn queue_size(&self) -> u16 {
        1 << (self.qsize_log2 % 7)
    }

    /// avail->idx - next_avail: with the top bit clear, at most the queue size (a ring the
    /// device can serve); with it set, the raw low 15 bits (usually too far ahead: the ring is
    /// broken and nothing may be popped).
    pub fn avail_ahead(&self) -> u16 {
        if self.avail_ahead & 0x8000 == 0 {
            self.avail_ahead % (self.queue_size() + 1)
        } else {
            self.avail_ahead & 0x7fff
        }
    }

    /// The validation limits.
    pub fn limits(&self) -> Limits {
        Limits {
            capacity_sectors: u64::from(self.capacity),
            max_descriptors: 1 + usize::from(self.max_desc % 40),
            readonly: self.readonly,
            max_discard_sectors: 1 << 20,
            max_write_zeroes_sectors: 1 << 20,
        }
    }
}

/// Guest memory for a layout, every byte set to `fill`.
///
/// The mappings are made once per layout and thread and then only rewritten, so that an
/// execution costs a memset instead of mmap, page faults and munmap (several times faster).
/// Every byte is rewritten, so no state carries over from one input to the next.
pub fn build_memory(regions: &'static [(u64, usize)], fill: u8) -> Mem {
    use std::cell::RefCell;
    use std::collections::HashMap;
    thread_local! {
        static CACHE: RefCell<HashMap<usize, Mem>> = RefCell::new(HashMap::new());
    }
    let mem = CACHE.with(|c| {
        c.borrow_mut()
            .entry(regions.as_ptr() as usize)
            .or_insert_with(|| {
                let ranges: Vec<(GuestAddress, usize)> =
                    regions.iter().map(|&(a, s)| (GuestAddress(a), s)).collect();
                GuestMemoryMmap::from_ranges(&ranges).expect("layouts are valid")
            })
            .clone()
    });
    let page = [fill; 4096];
    for &(a, s) in regions {
        for off in (0..s as u64).step_by(4096) {
            mem.write_slice(&page, GuestAddress(a + off)).unwrap();
        }
    }
    mem
}

/// Checks what [`blk::parse`] said about one chain against the memory and the limits.
///
/// Invariants (each a way a guest could make mqblk touch memory it should not, or misreport):
/// * a status address, when there is one, lies in guest memory, and writing the status byte
///   there succeeds;
/// * a valid request stays inside the capacity (sector + len/512 <= capacity, no overflow),
///   its length is what its segments add up to (reads/writes: a multiple of 512), and it is
///   not a write on a read-only export;
/// * the data segments, mapped by the I/O thread's own code (`map_segments`), either all map and
///   then lie entirely in guest memory, or the mapping fails (the I/O thread then answers IOERR):
///   never a partial or out-of-memory mapping;
/// * reads/writes point no segment at the status byte's own descriptor tail.
pub fn check_outcome(
    mem: &Mem,
    limits: &Limits,
    res: &Result<Request, Rejected>,
    segs: &[Segment],
) {
    match res {
        Err(rej) => {
            if let Some(a) = rej.status_addr {
                assert!(mem.address_in_range(a), "status outside memory: {rej:?}");
                mem.write_obj(rej.status as u8, a)
                    .expect("status byte writable");
            }
        }
        Ok(req) => {
            assert!(
                mem.address_in_range(req.status_addr),
                "status outside memory: {req:?}"
            );
            mem.write_obj(0u8, req.status_addr)
                .expect("status byte writable");
            let end = req
                .sector
                .checked_add(req.len >> blk::request::SECTOR_SHIFT)
                .expect("sector range overflows");
            let total: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
            match req.kind {
                Kind::Read | Kind::Write => {
                    assert!(end <= limits.capacity_sectors, "past capacity: {req:?}");
                    assert_eq!(req.len % 512, 0, "unaligned: {req:?}");
                    assert_eq!(total, req.len, "segments do not add up: {req:?} {segs:?}");
                    assert!(!(limits.readonly && req.kind == Kind::Write), "write on RO");
                    let _ = req.offset(); // must not overflow
                    map_like_io_thread(mem, segs);
                }
                Kind::Discard | Kind::WriteZeroes { .. } => {
                    assert!(end <= limits.capacity_sectors, "past capacity: {req:?}");
                    assert!(!limits.readonly, "discard/write-zeroes on RO");
                    assert!(segs.is_empty());
                    let max = if req.kind == Kind::Discard {
                        limits.max_discard_sectors
                    } else {
                        limits.max_write_zeroes_sectors
                    };
                    assert!(req.len >> 9 <= u64::from(max));
                }
                Kind::GetId => {
                    assert!(req.len <= blk::request::ID_LEN as u64);
                    assert!(req.len <= total);
                }
                Kind::Flush => assert_eq!((req.sector, req.len), (0, 0)),
            }
        }
    }
}

/// Maps data segments with the I/O thread's own code ([`map_segments`]) and checks the result:
/// either every segment lies in guest memory and the iovecs cover exactly the segments' bytes,
/// or the mapping is refused (the I/O thread then answers IOERR).
pub fn map_like_io_thread(mem: &Mem, segs: &[Segment]) {
    let mut iovs = Vec::new();
    let inside = |s: &Segment| {
        s.addr
            .checked_add(u64::from(s.len).saturating_sub(1))
            .is_some()
            && mem.check_range(s.addr, s.len as usize)
    };
    if map_segments(mem, segs, &mut iovs) {
        let mapped: usize = iovs.iter().map(|v| v.iov_len).sum();
        let want: usize = segs.iter().map(|s| s.len as usize).sum();
        assert_eq!(mapped, want, "partial mapping of {segs:?}");
        assert!(iovs.len() <= IOV_MAX);
        for s in segs {
            assert!(
                inside(s) || s.len == 0,
                "segment outside memory mapped: {s:?}"
            );
        }
    } else {
        assert!(
            segs.iter().any(|s| !inside(s) && s.len > 0) || segs.len() > IOV_MAX / 2,
            "segments inside memory failed to map: {segs:?}"
        );
    }
}

/// Called with each chain's parse result and data segments.
pub type Observer<'a> = dyn FnMut(&Result<Request, Rejected>, &[Segment]) + 'a;

/// Runs one `parse_request` input: returns (chains popped, valid requests).
pub fn run_queue(input: &Input) -> (usize, usize) {
    run_queue_with(input, &mut |_, _| {})
}

/// [`run_queue`], calling `seen` with every chain's parse result.
pub fn run_queue_with(input: &Input, seen: &mut Observer<'_>) -> (usize, usize) {
    let regions = layout(input.layout);
    let mem = build_memory(regions, input.fill);
    let base = regions[0].0;
    let qsize = input.queue_size();

    // Headers and segments. Some land outside memory: those writes just fail.
    // Written first: the tables and rings written next win where they overlap.
    for h in &input.hdrs {
        let _ = mem.write_slice(&h.bytes(), GuestAddress(h.at.resolve(regions)));
    }
    // The descriptor table: the input's entries repeated over the whole table.
    for i in 0..qsize as u64 {
        let d = input.descs[i as usize % NDESC].to_descriptor(regions);
        mem.write_obj(d, GuestAddress(base + DESC_OFF + 16 * i))
            .unwrap();
    }
    for (i, rd) in input.indirect.iter().enumerate() {
        let d = rd.to_descriptor(regions);
        mem.write_obj(d, GuestAddress(base + INDIRECT_OFF + 16 * i as u64))
            .unwrap();
    }
    // The avail ring: flags 0 (notify), idx, ring[], used_event.
    let avail = GuestAddress(base + AVAIL_OFF);
    let idx = input.next_avail.wrapping_add(input.avail_ahead());
    mem.write_obj(0u16, avail).unwrap();
    mem.write_obj(idx.to_le(), avail.unchecked_add(2)).unwrap();
    for i in 0..qsize as u64 {
        let h = input.heads[i as usize % NHEADS];
        mem.write_obj(h.to_le(), avail.unchecked_add(4 + 2 * i))
            .unwrap();
    }

    let mut q = Queue::new(MAX_QUEUE).unwrap();
    q.set_size(qsize);
    q.set_desc_table_address(
        Some((base + DESC_OFF) as u32),
        Some(((base + DESC_OFF) >> 32) as u32),
    );
    q.set_avail_ring_address(
        Some((base + AVAIL_OFF) as u32),
        Some(((base + AVAIL_OFF) >> 32) as u32),
    );
    q.set_used_ring_address(
        Some((base + USED_OFF) as u32),
        Some(((base + USED_OFF) >> 32) as u32),
    );
    q.set_next_avail(input.next_avail);
    q.set_next_used(input.next_avail);
    q.set_event_idx(input.qsize_log2 & 0x80 != 0);
    q.set_ready(true);
    assert!(q.is_valid(&mem), "harness rings must be valid");

    let limits = input.limits();
    let mut scratch = Scratch::with_capacity(limits.max_descriptors);
    let mut segs = Vec::with_capacity(limits.max_descriptors);
    let (mut popped, mut ok) = (0usize, 0usize);
    // The descriptor table at its host address, as the I/O thread reads it (io::ring_view).
    let host_table = host_range(&mem, GuestAddress(base + DESC_OFF), 16 * usize::from(qsize))
        .and_then(std::ptr::NonNull::new)
        .filter(|p| p.as_ptr().addr() % 16 == 0)
        // SAFETY: the table lies in one region of `mem` (host_range), which outlives every
        // walk below; 16-aligned (checked).
        .map(|p| unsafe { HostTable::new(p, qsize) });
    // A ring can hold at most `qsize` chains: popping more would mean reading entries twice.
    while let Some(chain) = q.pop_descriptor_chain(&mem) {
        popped += 1;
        assert!(
            popped <= qsize as usize,
            "popped more chains than the ring holds"
        );
        let head = chain.head_index();
        // mqblk's own walker (used to resubmit in-flight heads after a reconnect) must see
        // exactly the chain virtio-queue sees.
        let theirs: Vec<Descriptor> = chain.clone().collect();
        let ours: Vec<Descriptor> =
            ChainWalker::new(&mem, GuestAddress(base + DESC_OFF), qsize, head).collect();
        assert!(
            theirs.len() == ours.len() && theirs.iter().zip(&ours).all(|(a, b)| same_desc(a, b)),
            "ChainWalker disagrees with virtio-queue at head {head}:\n{theirs:?}\n{ours:?}"
        );
        // So must the walk the I/O thread makes, reading the table at its host address.
        if let Some(host) = host_table {
            let hosted: Vec<Descriptor> =
                ChainWalker::new(&mem, GuestAddress(base + DESC_OFF), qsize, head)
                    .with_host_table(Some(host))
                    .collect();
            assert!(
                hosted.len() == ours.len()
                    && hosted.iter().zip(&ours).all(|(a, b)| same_desc(a, b)),
                "the host-table walk disagrees at head {head}:\n{hosted:?}\n{ours:?}"
            );
        }
        let res = blk::parse(chain, &mem, &limits, &mut scratch, &mut segs);
        assert!(
            segs.len() <= limits.max_descriptors,
            "unbounded segment list"
        );
        check_outcome(&mem, &limits, &res, &segs);
        seen(&res, &segs);
        if res.is_ok() {
            ok += 1;
        }
        // Bad heads are refused by add_used; the I/O thread logs and goes on, so do we.
        let _ = q.add_used(&mem, head, 1);
    }
    // The I/O thread's notification check reads the rings too.
    let _ = q.needs_notification(&mem);
    let _ = q.enable_notification(&mem);
    (popped, ok)
}

fn same_desc(a: &Descriptor, b: &Descriptor) -> bool {
    (a.addr(), a.len(), a.flags(), a.next()) == (b.addr(), b.len(), b.flags(), b.next())
}

/// The fixed memory of the `raw_bytes` target: two regions with a hole between them.
pub fn raw_regions() -> &'static [(u64, usize)] {
    &[(0x0, 0x4000), (0x8000, 0x4000)]
}

/// Runs one `raw_bytes` input:
/// `[0]` limits selector, `[1]` readonly/fill, `[2..4]` capacity (sectors), `[4..36]` bytes
/// written at 0x100 (headers, segments), then 16-byte descriptors (addr u64, len u32, flags
/// u16, next u16, all little-endian) handed to the parser as a chain, at most 64.
pub fn run_raw(data: &[u8]) -> Option<bool> {
    if data.len() < 36 {
        return None;
    }
    let regions = raw_regions();
    let mem = build_memory(regions, data[1] & 0xfe);
    mem.write_slice(&data[4..36], GuestAddress(0x100)).unwrap();
    let limits = Limits {
        capacity_sectors: u64::from(u16::from_le_bytes([data[2], data[3]])) * 8,
        max_descriptors: 1 + usize::from(data[0] % 70),
        readonly: data[1] & 1 != 0,
        max_discard_sectors: 1 << (data[0] >> 4),
        max_write_zeroes_sectors: 1 << 20,
    };
    let descs = data[36..].chunks_exact(16).take(64).map(|c| {
        Descriptor::new(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            u32::from_le_bytes(c[8..12].try_into().unwrap()),
            u16::from_le_bytes(c[12..14].try_into().unwrap()),
            u16::from_le_bytes(c[14..16].try_into().unwrap()),
        )
    });
    let mut scratch = Scratch::default();
    let mut segs = Vec::new();
    let res = blk::parse(descs, &mem, &limits, &mut scratch, &mut segs);
    check_outcome(&mem, &limits, &res, &segs);
    Some(res.is_ok())
}

/// The inverse of the derived `Arbitrary` decoding, for writing seeds.
pub trait Encode {
    /// Appends the bytes that decode to `self`.
    fn encode(&self, out: &mut Vec<u8>);
}

macro_rules! encode_int {
    ($($t:ty),*) => {$(
        impl Encode for $t {
            fn encode(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
encode_int!(u8, u16, u32, u64);

impl Encode for bool {
    fn encode(&self, out: &mut Vec<u8>) {
        out.push(u8::from(*self));
    }
}

impl<T: Encode, const N: usize> Encode for [T; N] {
    fn encode(&self, out: &mut Vec<u8>) {
        for x in self {
            x.encode(out);
        }
    }
}

impl Encode for Addr {
    fn encode(&self, out: &mut Vec<u8>) {
        self.sel.encode(out);
        self.off.encode(out);
    }
}

impl Encode for RawDesc {
    fn encode(&self, out: &mut Vec<u8>) {
        self.addr.encode(out);
        self.len.encode(out);
        self.flags.encode(out);
        self.next.encode(out);
    }
}

impl Encode for Hdr {
    fn encode(&self, out: &mut Vec<u8>) {
        self.at.encode(out);
        self.typ.encode(out);
        self.sector.encode(out);
        self.num.encode(out);
        self.flags.encode(out);
    }
}

impl Encode for Input {
    fn encode(&self, out: &mut Vec<u8>) {
        self.layout.encode(out);
        self.qsize_log2.encode(out);
        self.readonly.encode(out);
        self.capacity.encode(out);
        self.max_desc.encode(out);
        self.next_avail.encode(out);
        self.avail_ahead.encode(out);
        self.heads.encode(out);
        self.descs.encode(out);
        self.indirect.encode(out);
        self.hdrs.encode(out);
        self.fill.encode(out);
    }
}

impl Input {
    /// The bytes that decode to this input.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.encode(&mut v);
        v
    }

    /// Decodes bytes the way the fuzz target does.
    pub fn from_bytes(data: &[u8]) -> Option<Input> {
        let u = arbitrary::Unstructured::new(data);
        Input::arbitrary_take_rest(u).ok()
    }
}

/// Debug aid: the parse result of every chain of an input.
pub fn explain(input: &Input) -> Vec<String> {
    let mut out = Vec::new();
    run_queue_with(input, &mut |res, segs| {
        out.push(format!("{res:?} {segs:?}"))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_round_trips() {
        let mut i = Input {
            layout: 3,
            capacity: 0x1234_5678,
            readonly: true,
            ..Input::default()
        };
        i.descs[3] = RawDesc {
            addr: Addr { sel: 7, off: 99 },
            len: 0xdead_beef,
            flags: 0xffff,
            next: 0x8001,
        };
        i.hdrs[1].sector = u64::MAX - 1;
        i.fill = 0xa5;
        assert_eq!(Input::from_bytes(&i.to_bytes()), Some(i));
    }
}
