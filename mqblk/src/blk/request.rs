//! Parsing and validation of virtio-blk requests (no I/O).
//!
//! Everything here is guest-controlled input. A chain is turned into a [`Request`] only after
//! every descriptor, length, sector range and flag has been checked; anything else becomes a
//! [`Rejected`] that says which status to write (and where), or that the chain is so broken
//! that no status can be written at all and the request is simply returned to the guest.
//!
//! The layout is not assumed (VIRTIO 1.x, 2.7.4 "Message Framing": the device MUST NOT make
//! assumptions about the particular arrangement of descriptors): the 16-byte header may span
//! several device-readable descriptors, and the status byte is the last byte of the last
//! descriptor, which may also carry data.

use super::guest_bytes;
use virtio_bindings::virtio_blk::*;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

/// log2 of the virtio-blk sector size.
pub const SECTOR_SHIFT: u32 = 9;
/// The virtio-blk sector: request offsets and lengths are in these units.
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;
/// Size of the request header (`struct virtio_blk_outhdr`).
pub const HEADER_LEN: usize = 16;
/// Size of one discard / write-zeroes segment (`struct virtio_blk_discard_write_zeroes`).
pub const DWZ_SEG_LEN: usize = 16;
/// Length of the GET_ID answer.
pub const ID_LEN: usize = VIRTIO_BLK_ID_BYTES as usize;

/// The status byte a request completes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// VIRTIO_BLK_S_OK
    Ok = VIRTIO_BLK_S_OK as u8,
    /// VIRTIO_BLK_S_IOERR
    IoErr = VIRTIO_BLK_S_IOERR as u8,
    /// VIRTIO_BLK_S_UNSUPP
    Unsupp = VIRTIO_BLK_S_UNSUPP as u8,
}

/// What a valid request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// VIRTIO_BLK_T_IN: read `len` bytes at `sector` into the data segments.
    Read,
    /// VIRTIO_BLK_T_OUT: write the data segments at `sector`.
    Write,
    /// VIRTIO_BLK_T_FLUSH: make completed writes durable.
    Flush,
    /// VIRTIO_BLK_T_GET_ID: write the serial into the data segments.
    GetId,
    /// VIRTIO_BLK_T_DISCARD of `len` bytes at `sector`.
    Discard,
    /// VIRTIO_BLK_T_WRITE_ZEROES of `len` bytes at `sector`; `unmap` allows deallocation.
    WriteZeroes {
        /// VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP was set.
        unmap: bool,
    },
}

impl Kind {
    /// The request type the counters keep apart; `None` for GET_ID, which is counted only in
    /// the totals.
    pub fn req_type(self) -> Option<ReqType> {
        match self {
            Kind::Read => Some(ReqType::Read),
            Kind::Write => Some(ReqType::Write),
            Kind::Flush => Some(ReqType::Flush),
            Kind::Discard => Some(ReqType::Discard),
            Kind::WriteZeroes { .. } => Some(ReqType::WriteZeroes),
            Kind::GetId => None,
        }
    }
}

/// The request types that carry data or change it: what the per-type counters and metrics
/// keep apart (the discriminant is the counters' array index).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReqType {
    /// VIRTIO_BLK_T_IN
    Read,
    /// VIRTIO_BLK_T_OUT
    Write,
    /// VIRTIO_BLK_T_FLUSH
    Flush,
    /// VIRTIO_BLK_T_DISCARD
    Discard,
    /// VIRTIO_BLK_T_WRITE_ZEROES
    WriteZeroes,
}

impl ReqType {
    /// How many there are.
    pub const COUNT: usize = 5;
    /// Every type, in index order.
    pub const ALL: [ReqType; ReqType::COUNT] = [
        ReqType::Read,
        ReqType::Write,
        ReqType::Flush,
        ReqType::Discard,
        ReqType::WriteZeroes,
    ];

    /// The name the metrics use (the `op` label).
    pub fn name(self) -> &'static str {
        match self {
            ReqType::Read => "read",
            ReqType::Write => "write",
            ReqType::Flush => "flush",
            ReqType::Discard => "discard",
            ReqType::WriteZeroes => "write_zeroes",
        }
    }

    /// The type a request header names, if it is one of these.
    pub fn from_header(req_type: u32) -> Option<ReqType> {
        match req_type {
            VIRTIO_BLK_T_IN => Some(ReqType::Read),
            VIRTIO_BLK_T_OUT => Some(ReqType::Write),
            VIRTIO_BLK_T_FLUSH => Some(ReqType::Flush),
            VIRTIO_BLK_T_DISCARD => Some(ReqType::Discard),
            VIRTIO_BLK_T_WRITE_ZEROES => Some(ReqType::WriteZeroes),
            _ => None,
        }
    }
}

/// One guest data buffer of a request, in guest-physical terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical address.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// A validated request. Its data segments are in the `segs` vector passed to [`parse`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub kind: Kind,
    /// First sector (reads, writes, discard, write-zeroes).
    pub sector: u64,
    /// Bytes to transfer or to discard/zero.
    pub len: u64,
    /// Where the status byte goes (checked to lie in guest memory).
    pub status_addr: GuestAddress,
}

impl Request {
    /// Byte offset on the disk. Cannot overflow: checked against capacity by [`parse`].
    pub fn offset(&self) -> u64 {
        self.sector << SECTOR_SHIFT
    }
}

/// Why a request was refused. Each message is the log line's reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Reason {
    /// No head descriptor to start from.
    #[error("the chain is empty or its head is out of range")]
    EmptyChain,
    /// The chain cannot be walked to its end.
    #[error("the chain ends early (loop, bad next index, indirect table error or address outside guest memory)")]
    TruncatedChain,
    /// More descriptors than the advertised `seg_max` (plus header and status).
    #[error("the chain has more descriptors than seg_max allows")]
    TooManyDescriptors,
    /// No place for the status byte.
    #[error("the last descriptor is not device-writable, so there is no status byte")]
    NoStatus,
    /// The status byte's address does not translate.
    #[error("the status byte lies outside guest memory")]
    StatusOutOfMemory,
    /// Not a whole device-readable header before the data.
    #[error("the header is shorter than 16 bytes or not device-readable")]
    BadHeader,
    /// The header or a discard/write-zeroes segment cannot be read from guest memory.
    #[error("the header or a discard segment lies outside guest memory")]
    UnreadableHeader,
    /// A request type mqblk does not serve (answered UNSUPP).
    #[error("unsupported request type")]
    UnsupportedType,
    /// Data buffers device-writable for a write, or device-readable for a read.
    #[error("the data buffers have the wrong direction for the request type")]
    WrongDirection,
    /// Data not in whole sectors.
    #[error("the data length is not a multiple of 512 bytes")]
    UnalignedLength,
    /// Sectors beyond the capacity (or an overflowing range).
    #[error("the sector range ends past the capacity")]
    OutOfRange,
    /// A request that would change a read-only export.
    #[error("a write, discard or write-zeroes on a read-only export")]
    ReadOnly,
    /// Several discard/write-zeroes segments (mqblk advertises one).
    #[error("more than one discard/write-zeroes segment")]
    TooManyDwzSegments,
    /// A discard/write-zeroes payload that is not made of whole segments.
    #[error("the discard/write-zeroes payload is not a whole number of 16-byte segments")]
    BadDwzPayload,
    /// Flags a discard/write-zeroes segment may not carry.
    #[error("reserved flag bits are set in a discard/write-zeroes segment")]
    ReservedFlags,
    /// A discard/write-zeroes segment larger than advertised.
    #[error("the discard/write-zeroes sector count exceeds the advertised maximum")]
    TooManySectors,
    /// GET_ID without a buffer to write the id into.
    #[error("GET_ID has no writable buffer")]
    NoIdBuffer,
}

/// A refused request: what to answer, if anything can be answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// Why.
    pub reason: Reason,
    /// Where to write `status`; `None` when the chain has no usable status byte: the request is
    /// then returned with a used length of 0 and nothing is written.
    pub status_addr: Option<GuestAddress>,
    /// IOERR or UNSUPP.
    pub status: Status,
    /// The request's type, when its header could be read and names one of [`ReqType`]; the
    /// counters book the refusal as an error of that type.
    pub req_type: Option<ReqType>,
}

/// What the device advertised, against which requests are checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Capacity in 512-byte sectors.
    pub capacity_sectors: u64,
    /// Most descriptors one chain may have (seg_max plus header and status, plus slack for
    /// drivers that split the header).
    pub max_descriptors: usize,
    /// Read-only export.
    pub readonly: bool,
    /// max_discard_sectors advertised; 0 when discard is not offered.
    pub max_discard_sectors: u32,
    /// max_write_zeroes_sectors advertised; 0 when write-zeroes is not offered.
    pub max_write_zeroes_sectors: u32,
}

#[derive(Clone, Copy)]
struct Piece {
    addr: GuestAddress,
    len: u32,
    write: bool,
}

/// Scratch space reused across requests so that parsing allocates nothing once warm.
#[derive(Default)]
pub struct Scratch {
    pieces: Vec<Piece>,
}

impl Scratch {
    /// Scratch space for chains of up to `max_descriptors` descriptors.
    pub fn with_capacity(max_descriptors: usize) -> Self {
        Scratch {
            pieces: Vec::with_capacity(max_descriptors),
        }
    }
}

fn reject(reason: Reason, status_addr: Option<GuestAddress>, status: Status) -> Rejected {
    Rejected {
        reason,
        status_addr,
        status,
        req_type: None,
    }
}

/// Parses and validates one descriptor chain.
///
/// `descs` yields the chain's descriptors (indirect tables already followed, as
/// `virtio_queue::DescriptorChain` does). On success, `segs` holds the request's data
/// segments, in order.
pub fn parse<M, I>(
    descs: I,
    mem: &M,
    limits: &Limits,
    scratch: &mut Scratch,
    segs: &mut Vec<Segment>,
) -> Result<Request, Rejected>
where
    M: GuestMemoryBackend + ?Sized,
    I: IntoIterator<Item = Descriptor>,
{
    segs.clear();
    let pieces = &mut scratch.pieces;
    pieces.clear();

    // Walk the chain, keeping at most `max_descriptors` and always the last one.
    let mut count = 0usize;
    let mut last: Option<Descriptor> = None;
    for d in descs {
        count += 1;
        if count <= limits.max_descriptors {
            pieces.push(Piece {
                addr: d.addr(),
                len: d.len(),
                write: d.is_write_only(),
            });
        }
        last = Some(d);
    }
    let last = last.ok_or(reject(Reason::EmptyChain, None, Status::IoErr))?;
    if last.has_next() {
        // The iterator stopped although the descriptor says more follow: a loop (ttl ran out),
        // an out-of-range next index, a bad indirect table, or unreadable descriptor memory.
        return Err(reject(Reason::TruncatedChain, None, Status::IoErr));
    }

    // The status byte: the last byte of the last descriptor, which must be device-writable.
    if !last.is_write_only() || last.len() == 0 {
        return Err(reject(Reason::NoStatus, None, Status::IoErr));
    }
    let status_addr = last
        .addr()
        .checked_add(u64::from(last.len()) - 1)
        .filter(|a| mem.address_in_range(*a))
        .ok_or(reject(Reason::StatusOutOfMemory, None, Status::IoErr))?;
    let st = Some(status_addr);
    if count > limits.max_descriptors {
        return Err(reject(Reason::TooManyDescriptors, st, Status::IoErr));
    }
    // Drop the status byte from the pieces.
    if let Some(p) = pieces.last_mut() {
        p.len -= 1;
        if p.len == 0 {
            pieces.pop();
        }
    }

    // The header: the first 16 bytes, from device-readable descriptors.
    let mut hdr = [0u8; HEADER_LEN];
    let mut got = 0usize;
    let mut first_data = 0usize;
    let mut first_off = 0u32;
    for (i, p) in pieces.iter().enumerate() {
        if got == HEADER_LEN {
            break;
        }
        if p.write {
            return Err(reject(Reason::BadHeader, st, Status::IoErr));
        }
        let take = (HEADER_LEN - got).min(p.len as usize);
        if !guest_bytes::read(mem, p.addr, &mut hdr[got..got + take]) {
            return Err(reject(Reason::UnreadableHeader, st, Status::IoErr));
        }
        got += take;
        first_data = i;
        first_off = take as u32;
        if take == p.len as usize {
            first_data = i + 1;
            first_off = 0;
        }
    }
    if got < HEADER_LEN {
        return Err(reject(Reason::BadHeader, st, Status::IoErr));
    }
    let req_type = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
    let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());

    // The data segments: what is between the header and the status byte.
    let mut data_len = 0u64;
    let mut any_read = false;
    let mut any_write = false;
    for (i, p) in pieces.iter().enumerate().skip(first_data) {
        let off = if i == first_data { first_off } else { 0 };
        let len = p.len - off;
        if len == 0 {
            continue;
        }
        // Cannot overflow: `off <= p.len` and guest addresses are checked when mapped.
        let addr = match p.addr.checked_add(u64::from(off)) {
            Some(a) => a,
            None => return Err(reject(Reason::UnreadableHeader, st, Status::IoErr)),
        };
        if p.write {
            any_write = true;
        } else {
            any_read = true;
        }
        data_len += u64::from(len);
        segs.push(Segment { addr, len });
    }

    let request = |kind, sector, len| Request {
        kind,
        sector,
        len,
        status_addr,
    };
    let check_range = |sector: u64, len: u64| -> Result<(), Rejected> {
        let end = sector.checked_add(len >> SECTOR_SHIFT);
        match end {
            Some(end) if end <= limits.capacity_sectors => Ok(()),
            _ => Err(reject(Reason::OutOfRange, st, Status::IoErr)),
        }
    };

    // Everything refused from here on is refused as a request of its type.
    let mut typed = || match req_type {
        VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
            let is_write = req_type == VIRTIO_BLK_T_OUT;
            if (is_write && any_write) || (!is_write && any_read) {
                return Err(reject(Reason::WrongDirection, st, Status::IoErr));
            }
            if is_write && limits.readonly {
                return Err(reject(Reason::ReadOnly, st, Status::IoErr));
            }
            if !data_len.is_multiple_of(SECTOR_SIZE) {
                return Err(reject(Reason::UnalignedLength, st, Status::IoErr));
            }
            check_range(sector, data_len)?;
            let kind = if is_write { Kind::Write } else { Kind::Read };
            Ok(request(kind, sector, data_len))
        }
        VIRTIO_BLK_T_FLUSH => Ok(request(Kind::Flush, 0, 0)),
        VIRTIO_BLK_T_GET_ID => {
            if any_read || !any_write {
                return Err(reject(Reason::NoIdBuffer, st, Status::IoErr));
            }
            Ok(request(Kind::GetId, 0, data_len.min(ID_LEN as u64)))
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            let discard = req_type == VIRTIO_BLK_T_DISCARD;
            if any_write {
                return Err(reject(Reason::WrongDirection, st, Status::IoErr));
            }
            if data_len == 0 || !data_len.is_multiple_of(DWZ_SEG_LEN as u64) {
                return Err(reject(Reason::BadDwzPayload, st, Status::IoErr));
            }
            if data_len > DWZ_SEG_LEN as u64 {
                return Err(reject(Reason::TooManyDwzSegments, st, Status::Unsupp));
            }
            if limits.readonly {
                return Err(reject(Reason::ReadOnly, st, Status::IoErr));
            }
            // The one segment may itself be split over descriptors: gather it.
            let mut seg = [0u8; DWZ_SEG_LEN];
            let mut at = 0usize;
            for s in segs.iter() {
                let n = s.len as usize;
                if mem.read_slice(&mut seg[at..at + n], s.addr).is_err() {
                    return Err(reject(Reason::UnreadableHeader, st, Status::IoErr));
                }
                at += n;
            }
            segs.clear();
            let dsector = u64::from_le_bytes(seg[0..8].try_into().unwrap());
            let num = u32::from_le_bytes(seg[8..12].try_into().unwrap());
            let flags = u32::from_le_bytes(seg[12..16].try_into().unwrap());
            let allowed_flags = if discard {
                0
            } else {
                VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
            };
            if flags & !allowed_flags != 0 {
                return Err(reject(Reason::ReservedFlags, st, Status::Unsupp));
            }
            let max = if discard {
                limits.max_discard_sectors
            } else {
                limits.max_write_zeroes_sectors
            };
            if max == 0 {
                // Not offered: the storage has no such operation.
                return Err(reject(Reason::UnsupportedType, st, Status::Unsupp));
            }
            if num > max {
                return Err(reject(Reason::TooManySectors, st, Status::IoErr));
            }
            let len = u64::from(num) << SECTOR_SHIFT;
            check_range(dsector, len)?;
            let kind = if discard {
                Kind::Discard
            } else {
                Kind::WriteZeroes {
                    unmap: flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
                }
            };
            Ok(request(kind, dsector, len))
        }
        _ => Err(reject(Reason::UnsupportedType, st, Status::Unsupp)),
    };
    typed().map_err(|r| Rejected {
        req_type: ReqType::from_header(req_type),
        ..r
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use vm_memory::GuestMemoryMmap;

    const W: u16 = VRING_DESC_F_WRITE as u16;
    const N: u16 = VRING_DESC_F_NEXT as u16;

    fn mem() -> GuestMemoryMmap {
        // Two regions with a hole between them.
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), 0x10_0000),
            (GuestAddress(0x20_0000), 0x10_0000),
        ])
        .unwrap()
    }

    fn limits() -> Limits {
        Limits {
            capacity_sectors: 2048,
            max_descriptors: 8,
            readonly: false,
            max_discard_sectors: 1024,
            max_write_zeroes_sectors: 1024,
        }
    }

    fn hdr(m: &GuestMemoryMmap, at: u64, t: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&t.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        m.write_slice(&h, GuestAddress(at)).unwrap();
    }

    fn dwz(m: &GuestMemoryMmap, at: u64, sector: u64, num: u32, flags: u32) {
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&num.to_le_bytes());
        s[12..16].copy_from_slice(&flags.to_le_bytes());
        m.write_slice(&s, GuestAddress(at)).unwrap();
    }

    fn d(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    fn run(
        m: &GuestMemoryMmap,
        l: &Limits,
        descs: Vec<Descriptor>,
    ) -> Result<(Request, Vec<Segment>), Rejected> {
        let mut s = Scratch::default();
        let mut segs = Vec::new();
        parse(descs, m, l, &mut s, &mut segs).map(|r| (r, segs))
    }

    /// A standard 3-descriptor request: header at 0x1000, data at 0x2000, status at 0x3000.
    fn three(
        t: u32,
        sector: u64,
        len: u32,
        data_write: bool,
    ) -> (GuestMemoryMmap, Vec<Descriptor>) {
        let m = mem();
        hdr(&m, 0x1000, t, sector);
        let df = if data_write { W | N } else { N };
        (
            m,
            vec![d(0x1000, 16, N), d(0x2000, len, df), d(0x3000, 1, W)],
        )
    }

    fn rejected(r: Result<(Request, Vec<Segment>), Rejected>) -> Rejected {
        r.expect_err("request should be rejected")
    }

    #[test]
    fn read_ok() {
        let (m, c) = three(VIRTIO_BLK_T_IN, 8, 4096, true);
        let (r, segs) = run(&m, &limits(), c).unwrap();
        assert_eq!(r.kind, Kind::Read);
        assert_eq!((r.sector, r.len, r.offset()), (8, 4096, 4096));
        assert_eq!(r.status_addr, GuestAddress(0x3000));
        assert_eq!(
            segs,
            vec![Segment {
                addr: GuestAddress(0x2000),
                len: 4096
            }]
        );
    }

    #[test]
    fn write_ok_up_to_last_sector() {
        let (m, c) = three(VIRTIO_BLK_T_OUT, 2040, 4096, false);
        let (r, _) = run(&m, &limits(), c).unwrap();
        assert_eq!((r.kind, r.sector, r.len), (Kind::Write, 2040, 4096));
    }

    #[test]
    fn any_layout_header_split_and_status_shared_with_data() {
        let m = mem();
        hdr(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        // Header over two descriptors (10 + 6), then one descriptor of data + status.
        let c = vec![d(0x1000, 10, N), d(0x100a, 6, N), d(0x2000, 513, W)];
        let (r, segs) = run(&m, &limits(), c).unwrap();
        assert_eq!((r.kind, r.len), (Kind::Read, 512));
        assert_eq!(r.status_addr, GuestAddress(0x2200));
        assert_eq!(
            segs,
            vec![Segment {
                addr: GuestAddress(0x2000),
                len: 512
            }]
        );
        // Header and data in one readable descriptor.
        hdr(&m, 0x4000, VIRTIO_BLK_T_OUT, 1);
        let c = vec![d(0x4000, 16 + 1024, N), d(0x3000, 1, W)];
        let (r, segs) = run(&m, &limits(), c).unwrap();
        assert_eq!((r.kind, r.sector, r.len), (Kind::Write, 1, 1024));
        assert_eq!(
            segs,
            vec![Segment {
                addr: GuestAddress(0x4010),
                len: 1024
            }]
        );
    }

    #[test]
    fn out_of_range_is_ioerr() {
        for (sector, len) in [
            (2048u64, 512u32),
            (2047, 1024),
            (u64::MAX, 512),
            (u64::MAX >> 9, 512),
        ] {
            let (m, c) = three(VIRTIO_BLK_T_IN, sector, len, true);
            let e = rejected(run(&m, &limits(), c));
            assert_eq!(
                (e.reason, e.status),
                (Reason::OutOfRange, Status::IoErr),
                "sector {sector}"
            );
            assert_eq!(e.status_addr, Some(GuestAddress(0x3000)));
            assert_eq!(e.req_type, Some(ReqType::Read), "booked as a read");
        }
    }

    #[test]
    fn unaligned_length_is_ioerr() {
        let (m, c) = three(VIRTIO_BLK_T_OUT, 0, 511, false);
        let e = rejected(run(&m, &limits(), c));
        assert_eq!(
            (e.reason, e.status),
            (Reason::UnalignedLength, Status::IoErr)
        );
    }

    #[test]
    fn write_on_readonly_is_ioerr() {
        let (m, c) = three(VIRTIO_BLK_T_OUT, 0, 512, false);
        let l = Limits {
            readonly: true,
            ..limits()
        };
        let e = rejected(run(&m, &l, c));
        assert_eq!((e.reason, e.status), (Reason::ReadOnly, Status::IoErr));
        assert_eq!(e.req_type, Some(ReqType::Write));
        // Reads and flushes still work on a read-only export.
        let (m, c) = three(VIRTIO_BLK_T_IN, 0, 512, true);
        assert!(run(&m, &l, c).is_ok());
        let (m, c) = three(VIRTIO_BLK_T_FLUSH, 0, 0, false);
        assert!(run(&m, &l, c[..1].iter().chain(&c[2..]).copied().collect()).is_ok());
    }

    #[test]
    fn wrong_direction_is_ioerr() {
        let (m, c) = three(VIRTIO_BLK_T_IN, 0, 512, false);
        assert_eq!(
            rejected(run(&m, &limits(), c)).reason,
            Reason::WrongDirection
        );
        let (m, c) = three(VIRTIO_BLK_T_OUT, 0, 512, true);
        assert_eq!(
            rejected(run(&m, &limits(), c)).reason,
            Reason::WrongDirection
        );
    }

    #[test]
    fn req_types_index_the_counters_in_order() {
        for (i, t) in ReqType::ALL.iter().enumerate() {
            assert_eq!(*t as usize, i, "{t:?}");
        }
        let names: Vec<_> = ReqType::ALL.iter().map(|t| t.name()).collect();
        assert_eq!(names, ["read", "write", "flush", "discard", "write_zeroes"]);
        assert_eq!(
            ReqType::from_header(VIRTIO_BLK_T_WRITE_ZEROES),
            Kind::WriteZeroes { unmap: true }.req_type()
        );
        assert_eq!(ReqType::from_header(VIRTIO_BLK_T_GET_ID), None);
        assert_eq!(Kind::GetId.req_type(), None);
    }

    #[test]
    fn unknown_type_is_unsupp() {
        for t in [2u32, 3, 5, 14, 15, 16, 0xdead_beef] {
            let (m, c) = three(t, 0, 512, true);
            let e = rejected(run(&m, &limits(), c));
            assert_eq!(
                (e.reason, e.status),
                (Reason::UnsupportedType, Status::Unsupp),
                "type {t}"
            );
            assert_eq!(e.req_type, None, "type {t} is none of the counted types");
        }
    }

    #[test]
    fn flush_and_get_id() {
        let m = mem();
        hdr(&m, 0x1000, VIRTIO_BLK_T_FLUSH, 0);
        let (r, _) = run(&m, &limits(), vec![d(0x1000, 16, N), d(0x3000, 1, W)]).unwrap();
        assert_eq!(r.kind, Kind::Flush);
        hdr(&m, 0x1000, VIRTIO_BLK_T_GET_ID, 0);
        let (r, segs) = run(
            &m,
            &limits(),
            vec![d(0x1000, 16, N), d(0x2000, 64, W | N), d(0x3000, 1, W)],
        )
        .unwrap();
        assert_eq!((r.kind, r.len), (Kind::GetId, 20));
        assert_eq!(segs.len(), 1);
        let e = rejected(run(&m, &limits(), vec![d(0x1000, 16, N), d(0x3000, 1, W)]));
        assert_eq!(e.reason, Reason::NoIdBuffer);
    }

    fn dwz_req(
        t: u32,
        sector: u64,
        num: u32,
        flags: u32,
        l: &Limits,
    ) -> Result<(Request, Vec<Segment>), Rejected> {
        let m = mem();
        hdr(&m, 0x1000, t, 0);
        dwz(&m, 0x2000, sector, num, flags);
        run(
            &m,
            l,
            vec![d(0x1000, 16, N), d(0x2000, 16, N), d(0x3000, 1, W)],
        )
    }

    #[test]
    fn discard_and_write_zeroes() {
        let (r, segs) = dwz_req(VIRTIO_BLK_T_DISCARD, 8, 16, 0, &limits()).unwrap();
        assert_eq!((r.kind, r.sector, r.len), (Kind::Discard, 8, 16 * 512));
        assert!(segs.is_empty());
        let (r, _) = dwz_req(VIRTIO_BLK_T_WRITE_ZEROES, 0, 8, 1, &limits()).unwrap();
        assert_eq!(r.kind, Kind::WriteZeroes { unmap: true });
        let (r, _) = dwz_req(VIRTIO_BLK_T_WRITE_ZEROES, 0, 8, 0, &limits()).unwrap();
        assert_eq!(r.kind, Kind::WriteZeroes { unmap: false });
    }

    #[test]
    fn discard_bad_cases() {
        let l = limits();
        let e = dwz_req(VIRTIO_BLK_T_DISCARD, 0, 8, 1, &l).unwrap_err();
        assert_eq!(
            (e.reason, e.status),
            (Reason::ReservedFlags, Status::Unsupp)
        );
        let e = dwz_req(VIRTIO_BLK_T_WRITE_ZEROES, 0, 8, 2, &l).unwrap_err();
        assert_eq!(
            (e.reason, e.status),
            (Reason::ReservedFlags, Status::Unsupp)
        );
        let e = dwz_req(VIRTIO_BLK_T_DISCARD, 2040, 16, 0, &l).unwrap_err();
        assert_eq!((e.reason, e.status), (Reason::OutOfRange, Status::IoErr));
        let e = dwz_req(VIRTIO_BLK_T_DISCARD, 0, 1025, 0, &l).unwrap_err();
        assert_eq!(
            (e.reason, e.status),
            (Reason::TooManySectors, Status::IoErr)
        );
        let e = dwz_req(VIRTIO_BLK_T_WRITE_ZEROES, u64::MAX, 1, 0, &l).unwrap_err();
        assert_eq!(e.reason, Reason::OutOfRange);
        let ro = Limits {
            readonly: true,
            ..l
        };
        let e = dwz_req(VIRTIO_BLK_T_DISCARD, 0, 8, 0, &ro).unwrap_err();
        assert_eq!((e.reason, e.status), (Reason::ReadOnly, Status::IoErr));
        // Storage without the operation (it was not offered): UNSUPP, whatever the count.
        let without = Limits {
            max_discard_sectors: 0,
            max_write_zeroes_sectors: 0,
            ..l
        };
        for t in [VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_WRITE_ZEROES] {
            for num in [0, 8] {
                let e = dwz_req(t, 0, num, 0, &without).unwrap_err();
                assert_eq!(
                    (e.reason, e.status),
                    (Reason::UnsupportedType, Status::Unsupp)
                );
            }
        }
        // Two segments: UNSUPP.
        let m = mem();
        hdr(&m, 0x1000, VIRTIO_BLK_T_DISCARD, 0);
        let e = rejected(run(
            &m,
            &l,
            vec![d(0x1000, 16, N), d(0x2000, 32, N), d(0x3000, 1, W)],
        ));
        assert_eq!(
            (e.reason, e.status),
            (Reason::TooManyDwzSegments, Status::Unsupp)
        );
        // A partial segment: IOERR.
        let e = rejected(run(
            &m,
            &l,
            vec![d(0x1000, 16, N), d(0x2000, 8, N), d(0x3000, 1, W)],
        ));
        assert_eq!((e.reason, e.status), (Reason::BadDwzPayload, Status::IoErr));
    }

    #[test]
    fn missing_or_readonly_status_is_dropped() {
        let m = mem();
        hdr(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let e = rejected(run(
            &m,
            &limits(),
            vec![d(0x1000, 16, N), d(0x2000, 512, 0)],
        ));
        assert_eq!((e.reason, e.status_addr), (Reason::NoStatus, None));
        let e = rejected(run(&m, &limits(), vec![d(0x1000, 16, N), d(0x2000, 0, W)]));
        assert_eq!((e.reason, e.status_addr), (Reason::NoStatus, None));
        let e = rejected(run(&m, &limits(), vec![]));
        assert_eq!((e.reason, e.status_addr), (Reason::EmptyChain, None));
        assert_eq!(e.req_type, None, "no header read, no type");
    }

    #[test]
    fn status_outside_memory_is_dropped() {
        let m = mem();
        hdr(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        // In the hole between the regions, and past the end of memory, and wrapping around.
        for (addr, len) in [(0x15_0000u64, 1u32), (0x40_0000, 1), (u64::MAX, 2)] {
            let e = rejected(run(&m, &limits(), vec![d(0x1000, 16, N), d(addr, len, W)]));
            assert_eq!(
                (e.reason, e.status_addr),
                (Reason::StatusOutOfMemory, None),
                "{addr:#x}"
            );
        }
    }

    #[test]
    fn truncated_chain_is_dropped() {
        let (m, mut c) = three(VIRTIO_BLK_T_IN, 0, 512, true);
        // The iterator stopped at a descriptor that still has NEXT set (loop / bad index).
        c[2] = Descriptor::new(0x3000, 1, W | N, 7);
        let e = rejected(run(&m, &limits(), c));
        assert_eq!((e.reason, e.status_addr), (Reason::TruncatedChain, None));
    }

    #[test]
    fn too_many_descriptors_is_ioerr() {
        let m = mem();
        hdr(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let mut c = vec![d(0x1000, 16, N)];
        for i in 0..20 {
            c.push(d(0x2000 + i * 512, 512, W | N));
        }
        c.push(d(0x3000, 1, W));
        let e = rejected(run(&m, &limits(), c));
        assert_eq!(
            (e.reason, e.status),
            (Reason::TooManyDescriptors, Status::IoErr)
        );
        assert_eq!(e.status_addr, Some(GuestAddress(0x3000)));
    }

    #[test]
    fn bad_header() {
        let m = mem();
        hdr(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let e = rejected(run(&m, &limits(), vec![d(0x1000, 8, N), d(0x3000, 1, W)]));
        assert_eq!(e.reason, Reason::BadHeader);
        let e = rejected(run(
            &m,
            &limits(),
            vec![d(0x1000, 16, W | N), d(0x3000, 1, W)],
        ));
        assert_eq!(e.reason, Reason::BadHeader);
        // Header in the hole.
        let e = rejected(run(
            &m,
            &limits(),
            vec![d(0x15_0000, 16, N), d(0x3000, 1, W)],
        ));
        assert_eq!(
            (e.reason, e.status),
            (Reason::UnreadableHeader, Status::IoErr)
        );
    }
}
