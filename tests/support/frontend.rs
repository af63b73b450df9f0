//! The hand-written vhost-user frontend of the hostile tests (tests/hostile_*.rs), also used
//! where a test needs what no frontend library sends (tests/crash.rs: the guest's cache mode;
//! tests/migration_dirty_log.rs: the dirty log).
//!
//! Well-formed messages go through the vhost crate's [`Frontend`]; the malformed ones that the
//! tests exist to send (garbage, out-of-range indices, sizes and addresses, truncated
//! messages) are written as raw bytes on the same socket ([`Conn::send`]), so that no library
//! check stands between them and the daemon. Guest memory is a memfd shared as two regions with
//! a hole between them, filled with a canary and shadowed; the descriptor table, avail ring and
//! requests are written by hand, and the used ring is read by hand.

use std::io::{self, Read};
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mqblk_client::check_pattern;
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures, MAX_MSG_SIZE,
    VHOST_USER_MAX_VRINGS,
};
use vhost::vhost_user::{Error as VhuError, Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::daemon::RECONNECT_GRACE;
use super::mem::SharedMem;

/// The protocol version in a message header's flags.
pub const HDR_VERSION: u32 = 0x1;

pub const F_INDIRECT_DESC: u64 = 1 << 28;
pub const F_VERSION_1: u64 = 1 << 32;
pub const F_BLK_RO: u64 = 1 << 5;
pub const F_BLK_FLUSH: u64 = 1 << 9;
pub const F_BLK_CONFIG_WCE: u64 = 1 << 11;

pub const VRING_F_NEXT: u16 = 1;
pub const VRING_F_WRITE: u16 = 2;
pub const VRING_F_INDIRECT: u16 = 4;

pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;

pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;

/// How long an answer may take.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long to watch for an answer that must not come.
pub const SILENCE: Duration = Duration::from_millis(300);

pub fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn u64s(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// What the daemon answered to a message that the [`Frontend`] sent: Ok, `Err("NACK")` when it
/// acked with an error, or `Err("closed: ...")` when the connection failed or timed out. A
/// reply that does not answer the request (another request code, no REPLY flag, a malformed
/// body) fails the test.
pub fn answer<T>(r: vhost::Result<T>) -> Result<T, String> {
    let e = match r {
        Ok(v) => return Ok(v),
        Err(vhost::Error::VhostUserProtocol(e)) => e,
        Err(e) => return Err(format!("closed: {e}")),
    };
    match e {
        VhuError::BackendInternalError => Err("NACK".into()),
        VhuError::InvalidMessage => {
            panic!("the daemon's reply does not answer the request (code, REPLY flag or body)")
        }
        VhuError::InvalidParam | VhuError::InactiveFeature(_) | VhuError::InactiveOperation(_) => {
            panic!("test bug: the vhost crate refused to send the message: {e}")
        }
        e => Err(format!("closed: {e}")),
    }
}

// ---------------------------------------------------------------------------------------------
// The connection: the vhost crate's Frontend, and raw bytes on the same socket
// ---------------------------------------------------------------------------------------------

/// One frontend connection: the vhost crate's [`Frontend`] and, on the same socket, the raw
/// side for malformed messages and for watching the connection.
pub struct Conn {
    pub fe: Frontend,
    raw: UnixStream,
}

impl Conn {
    pub fn connect(path: &Path) -> Conn {
        let sock = UnixStream::connect(path).expect("connecting to the export");
        // A socket option: the Frontend's reads time out too.
        sock.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
        let raw = sock.try_clone().expect("duplicating the socket");
        // The Frontend refuses vring indices from this bound on. The queue count is not known
        // before GET_QUEUE_NUM, which most sessions do not send: the protocol's maximum.
        let fe = Frontend::from_stream(sock, VHOST_USER_MAX_VRINGS);
        Conn { fe, raw }
    }

    /// Sends raw bytes, with file descriptors attached to the first byte.
    pub fn send_raw(&self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let n = self
            .raw
            .send_with_fds(&[bytes], fds)
            .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
        if n != bytes.len() {
            return Err(io::Error::other("short sendmsg"));
        }
        Ok(())
    }

    /// Sends a message: header (request `code`, version and `flags`, body size), then `body`.
    pub fn send(
        &self,
        code: impl Into<u32>,
        flags: u32,
        body: &[u8],
        fds: &[RawFd],
    ) -> io::Result<()> {
        let mut m = u32s(&[code.into(), HDR_VERSION | flags, body.len() as u32]);
        m.extend_from_slice(body);
        self.send_raw(&m, fds)
    }

    /// Reads one reply: (code, flags, body).
    pub fn recv(&self) -> io::Result<(u32, u32, Vec<u8>)> {
        let mut s = &self.raw;
        let mut h = [0u8; 12];
        s.read_exact(&mut h)?;
        let w = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
        let (code, flags, size) = (w(0), w(4), w(8));
        if size as usize > MAX_MSG_SIZE {
            return Err(io::Error::other(format!("reply size {size}")));
        }
        let mut body = vec![0u8; size as usize];
        s.read_exact(&mut body)?;
        assert!(
            flags & VhostUserHeaderFlag::REPLY.bits() != 0,
            "reply without the REPLY flag"
        );
        Ok((code, flags, body))
    }

    /// Sends a message with NEED_REPLY and reads the ack: Ok, or Err("NACK (value)") /
    /// Err("closed: ...").
    pub fn send_acked(
        &self,
        code: impl Into<u32>,
        body: &[u8],
        fds: &[RawFd],
    ) -> Result<(), String> {
        let code = code.into();
        self.send(code, VhostUserHeaderFlag::NEED_REPLY.bits(), body, fds)
            .map_err(|e| format!("closed: send: {e}"))?;
        let (c, _, b) = self.recv().map_err(|e| format!("closed: {e}"))?;
        assert_eq!(c, code, "ack for another request");
        match u64::from_le_bytes(b[..8].try_into().unwrap()) {
            0 => Ok(()),
            v => Err(format!("NACK ({v})")),
        }
    }

    /// Whether the daemon closes the connection within `within`.
    pub fn closed_by_peer(&self, within: Duration) -> bool {
        self.raw.set_read_timeout(Some(within)).unwrap();
        let mut b = [0u8; 64];
        let r = (&self.raw).read(&mut b);
        self.raw.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
        match r {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
        }
    }

    /// Sets up vring `q` with `size` entries at the frontend addresses `(desc, used, avail)`,
    /// its kick and (if given) its call eventfd, and enables it.
    pub fn start_vring(
        &mut self,
        q: usize,
        size: u16,
        (desc, used, avail): (u64, u64, u64),
        call: Option<&EventFd>,
        kick: &EventFd,
    ) -> Result<(), String> {
        answer(self.fe.set_vring_num(q, size))?;
        answer(self.fe.set_vring_base(q, 0))?;
        let addrs = VringConfigData {
            queue_max_size: size,
            queue_size: size,
            flags: 0,
            desc_table_addr: desc,
            used_ring_addr: used,
            avail_ring_addr: avail,
            log_addr: None,
        };
        answer(self.fe.set_vring_addr(q, &addrs))?;
        if let Some(call) = call {
            answer(self.fe.set_vring_call(q, call))?;
        }
        answer(self.fe.set_vring_kick(q, kick))?;
        answer(self.fe.set_vring_enable(q, true))
    }
}

/// A memory region as [`Frontend::set_mem_table`] takes it.
fn region(
    gpa: u64,
    size: u64,
    user_addr: u64,
    offset: u64,
    fd: RawFd,
) -> VhostUserMemoryRegionInfo {
    VhostUserMemoryRegionInfo {
        guest_phys_addr: gpa,
        memory_size: size,
        userspace_addr: user_addr,
        mmap_offset: offset,
        mmap_handle: fd,
    }
}

// ---------------------------------------------------------------------------------------------
// Guest memory: a memfd, two regions with a hole, a canary and a shadow copy
// ---------------------------------------------------------------------------------------------

pub const MIB_U: usize = 1 << 20;
/// Region A: GPA 0 .. 1 MiB (file offset 0). Region B: GPA 2 MiB .. 3 MiB (file offset 1 MiB).
pub const REGION_B_GPA: u64 = 0x20_0000;
/// A guest-physical address in the hole between the regions.
pub const HOLE: u64 = 0x15_0000;
pub const CANARY: u8 = 0xa5;

pub struct Guest {
    pub mem: SharedMem,
    /// (gpa, size, file offset)
    pub regions: Vec<(u64, u64, u64)>,
    pub shadow: Vec<u8>,
}

impl Guest {
    pub fn new() -> Guest {
        Self::with_memory(SharedMem::new("hostile-guest", 2 * MIB_U))
    }

    /// A guest whose memory is `mem` (2 MiB).
    pub fn with_memory(mem: SharedMem) -> Guest {
        let len = 2 * MIB_U;
        assert_eq!(mem.len(), len, "test bug: guest memory is 2 MiB");
        let mut g = Guest {
            mem,
            regions: vec![
                (0, MIB_U as u64, 0),
                (REGION_B_GPA, MIB_U as u64, MIB_U as u64),
            ],
            shadow: vec![CANARY; len],
        };
        g.mem.as_mut_slice().fill(CANARY);
        g
    }

    /// The frontend's address of the memfd's first byte.
    pub fn base(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    pub fn fd(&self) -> RawFd {
        self.mem.fd()
    }

    /// The memory table: each region at its frontend address shifted by its entry of `skews`
    /// (missing entries: 0).
    pub fn mem_table(&self, skews: &[u64]) -> Vec<VhostUserMemoryRegionInfo> {
        self.regions
            .iter()
            .enumerate()
            .map(|(i, &(gpa, size, off))| {
                let skew = skews.get(i).copied().unwrap_or(0);
                let user_addr = (self.base() + off).wrapping_add(skew);
                region(gpa, size, user_addr, off, self.fd())
            })
            .collect()
    }

    pub fn off(&self, gpa: u64, len: usize) -> usize {
        for &(g, s, o) in &self.regions {
            if gpa >= g && gpa + len as u64 <= g + s {
                return (o + gpa - g) as usize;
            }
        }
        panic!("test bug: {gpa:#x}+{len} is not in guest memory");
    }

    /// The frontend's own address of a guest-physical address (what SET_VRING_ADDR carries).
    pub fn user_addr(&self, gpa: u64) -> u64 {
        self.base() + self.off(gpa, 1) as u64
    }

    /// Writes guest memory (and the shadow).
    pub fn write(&mut self, gpa: u64, data: &[u8]) {
        let o = self.off(gpa, data.len());
        self.mem.as_mut_slice()[o..o + data.len()].copy_from_slice(data);
        self.shadow[o..o + data.len()].copy_from_slice(data);
    }

    pub fn read(&mut self, gpa: u64, len: usize) -> Vec<u8> {
        let o = self.off(gpa, len);
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds (checked by off). The daemon writes this memory only while a
        // request is in flight; callers read it after the answer (the fence above orders it).
        unsafe { std::ptr::copy_nonoverlapping(self.mem.as_ptr().add(o), v.as_mut_ptr(), len) };
        v
    }

    pub fn read_u16(&mut self, gpa: u64) -> u16 {
        let o = self.off(gpa, 2);
        // SAFETY: in bounds and 2-aligned (ring fields); volatile: the daemon updates it.
        let v = unsafe { std::ptr::read_volatile(self.mem.as_ptr().add(o) as *const u16) };
        std::sync::atomic::fence(Ordering::SeqCst);
        u16::from_le(v)
    }

    /// Records that the daemon is expected to have written `data` at `gpa`.
    pub fn expect(&mut self, gpa: u64, data: &[u8]) {
        let o = self.off(gpa, data.len());
        self.shadow[o..o + data.len()].copy_from_slice(data);
    }

    /// The first difference between guest memory and the shadow outside `skip` (gpa ranges).
    pub fn diff(&mut self, skip: &[(u64, usize)]) -> Option<String> {
        let skip: Vec<(usize, usize)> = skip.iter().map(|&(g, l)| (self.off(g, l), l)).collect();
        let mem = self.read_all();
        // Compare page by page (a memcmp), and byte by byte only where a page differs.
        for (p, (a, b)) in mem.chunks(4096).zip(self.shadow.chunks(4096)).enumerate() {
            if a == b {
                continue;
            }
            for (k, (x, y)) in a.iter().zip(b).enumerate() {
                let i = p * 4096 + k;
                if x != y && !skip.iter().any(|&(o, l)| i >= o && i < o + l) {
                    let (g, _, o) = self
                        .regions
                        .iter()
                        .copied()
                        .find(|&(_, s, o)| i as u64 >= o && (i as u64) < o + s)
                        .unwrap();
                    return Some(format!(
                        "guest memory changed at GPA {:#x}: {x:#04x}, expected {y:#04x}",
                        g + i as u64 - o
                    ));
                }
            }
        }
        None
    }

    /// A copy of the whole memfd.
    pub fn read_all(&mut self) -> Vec<u8> {
        std::sync::atomic::fence(Ordering::SeqCst);
        let len = self.mem.len();
        let mut v = vec![0u8; len];
        // SAFETY: the whole live mapping; see `read`.
        unsafe { std::ptr::copy_nonoverlapping(self.mem.as_ptr(), v.as_mut_ptr(), len) };
        v
    }
}

// ---------------------------------------------------------------------------------------------
// A session: a configured device with hand-written rings
// ---------------------------------------------------------------------------------------------

/// Where things live in guest memory (region A unless said otherwise).
pub const HDR_GPA: u64 = 0x1_0000;
pub const STATUS_GPA: u64 = 0x8000;
pub const DATA_GPA: u64 = 0x2_0000;
pub const INDIRECT_GPA: u64 = 0x6_0000;
pub const INDIRECT2_GPA: u64 = 0x7_0000;

pub fn ring_gpas(q: u32) -> (u64, u64, u64) {
    let b = 0x1000 + u64::from(q) * 0x3000;
    (b, b + 0x1000, b + 0x2000)
}

pub struct Ring {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub avail_idx: u16,
    pub used_idx: u16,
    pub kick: EventFd,
    pub _call: EventFd,
}

impl Ring {
    pub fn used_area(&self) -> (u64, usize) {
        (self.used, 6 + 8 * self.size as usize)
    }
}

/// A descriptor as the test writes it.
#[derive(Clone, Copy, Debug)]
pub struct D {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

pub fn d(addr: u64, len: u32, flags: u16, next: u16) -> D {
    D {
        addr,
        len,
        flags,
        next,
    }
}

/// The descriptor of a request header at [`HDR_GPA`], chained to descriptor 1.
pub fn hdr_desc() -> D {
    d(HDR_GPA, 16, VRING_F_NEXT, 1)
}

/// The descriptor of a status byte at [`STATUS_GPA`], the end of a chain.
pub fn status_desc() -> D {
    d(STATUS_GPA, 1, VRING_F_WRITE, 0)
}

/// The chain of a read of `len` bytes into [`DATA_GPA`], at descriptors 0 to 2 (its header at
/// [`HDR_GPA`] is the caller's to write).
pub fn read_chain(len: u32) -> [D; 3] {
    [
        hdr_desc(),
        d(DATA_GPA, len, VRING_F_WRITE | VRING_F_NEXT, 2),
        status_desc(),
    ]
}

pub fn desc_bytes(ds: &[D]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 * ds.len());
    for x in ds {
        v.extend_from_slice(&x.addr.to_le_bytes());
        v.extend_from_slice(&x.len.to_le_bytes());
        v.extend_from_slice(&x.flags.to_le_bytes());
        v.extend_from_slice(&x.next.to_le_bytes());
    }
    v
}

pub fn header(t: u32, sector: u64) -> Vec<u8> {
    let mut h = u32s(&[t, 0]);
    h.extend_from_slice(&sector.to_le_bytes());
    h
}

pub fn dwz_segment(sector: u64, num: u32, flags: u32) -> Vec<u8> {
    let mut s = sector.to_le_bytes().to_vec();
    s.extend_from_slice(&u32s(&[num, flags]));
    s
}

pub struct Session {
    /// Dropping it disconnects.
    pub conn: Conn,
    pub guest: Guest,
    pub rings: Vec<Ring>,
    /// The export's image and its seed, to check reads.
    pub image_seed: Option<u64>,
}

/// The answer to one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// A used entry: (head, len).
    Used(u32, u32),
    /// No used entry within the time the test watched.
    Nothing,
}

impl Session {
    /// Connects and negotiates; stops before SET_MEM_TABLE.
    pub fn negotiate(path: &Path) -> Result<(Conn, u64), String> {
        Self::negotiate_with(path, VhostUserProtocolFeatures::empty())
    }

    /// [`Session::negotiate`], acking the protocol features `extra` as well.
    pub fn negotiate_with(
        path: &Path,
        extra: VhostUserProtocolFeatures,
    ) -> Result<(Conn, u64), String> {
        Self::negotiate_features(path, extra, 0)
    }

    /// [`Session::negotiate_with`], acking the device features `features` as well.
    pub fn negotiate_features(
        path: &Path,
        extra: VhostUserProtocolFeatures,
        features: u64,
    ) -> Result<(Conn, u64), String> {
        // The daemon serves one frontend per socket and closes a second one at once. The
        // previous session's close can reach it late (another test thread forking a process
        // holds a copy of the socket until its exec), so retry a refused connection briefly.
        let deadline = Instant::now() + RECONNECT_GRACE;
        let (mut conn, offered) = loop {
            let conn = Conn::connect(path);
            match answer(conn.fe.get_features()) {
                Ok(f) => break (conn, f),
                Err(e) if e.starts_with("closed") && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e),
            }
        };
        let pf = answer(conn.fe.get_protocol_features())?;
        assert!(
            pf.contains(VhostUserProtocolFeatures::REPLY_ACK),
            "REPLY_ACK not offered"
        );
        assert!(
            pf.contains(extra),
            "protocol features {extra:?} not offered ({pf:?})"
        );
        // Without NEED_REPLY: REPLY_ACK is in force only once this message is through.
        answer(conn.fe.set_protocol_features(
            VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::REPLY_ACK
                | VhostUserProtocolFeatures::CONFIG
                | extra,
        ))?;
        // From here on every message asks for an ack, so that the test sees each NACK (messages
        // with a reply of their own get just that reply).
        conn.fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        answer(conn.fe.set_owner())?;
        assert!(
            offered & features == features,
            "features {features:#x} not offered ({offered:#x})"
        );
        let want = F_VERSION_1
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            | F_INDIRECT_DESC
            | (offered & F_BLK_RO)
            | features;
        answer(conn.fe.set_features(want))?;
        Ok((conn, offered))
    }

    pub fn set_mem_table(conn: &Conn, guest: &Guest) -> Result<(), String> {
        answer(conn.fe.set_mem_table(&guest.mem_table(&[]))).map(|_| ())
    }

    pub fn setup_ring(
        conn: &mut Conn,
        guest: &mut Guest,
        q: u32,
        size: u16,
    ) -> Result<Ring, String> {
        let (desc, avail, used) = ring_gpas(q);
        guest.write(desc, &vec![0u8; 16 * size as usize]);
        guest.write(avail, &vec![0u8; 6 + 2 * size as usize]);
        guest.write(used, &vec![0u8; 6 + 8 * size as usize]);
        let kick = EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK).unwrap();
        let call = EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK).unwrap();
        let addrs = (
            guest.user_addr(desc),
            guest.user_addr(used),
            guest.user_addr(avail),
        );
        conn.start_vring(q as usize, size, addrs, Some(&call), &kick)?;
        Ok(Ring {
            size,
            desc,
            avail,
            used,
            avail_idx: 0,
            used_idx: 0,
            kick,
            _call: call,
        })
    }

    /// A fully set up session with one ring of `size` on queue 0.
    pub fn open(path: &Path, size: u16, image_seed: Option<u64>) -> Session {
        Self::open_features(path, size, image_seed, 0)
    }

    /// [`Session::open`], acking the device features `features` as well.
    pub fn open_features(
        path: &Path,
        size: u16,
        image_seed: Option<u64>,
        features: u64,
    ) -> Session {
        let (conn, _) =
            Self::negotiate_features(path, VhostUserProtocolFeatures::empty(), features)
                .expect("negotiation");
        Self::start(conn, size, image_seed)
    }

    /// Sets up guest memory and a ring of `size` on queue 0 of the negotiated `conn`.
    pub fn start(mut conn: Conn, size: u16, image_seed: Option<u64>) -> Session {
        let mut guest = Guest::new();
        Self::set_mem_table(&conn, &guest).expect("SET_MEM_TABLE");
        let ring = Self::setup_ring(&mut conn, &mut guest, 0, size).expect("vring setup");
        Session {
            conn,
            guest,
            rings: vec![ring],
            image_seed,
        }
    }

    /// Writes descriptors into the table starting at index `first`.
    pub fn write_descs(&mut self, q: usize, first: u16, ds: &[D]) {
        let at = self.rings[q].desc + 16 * u64::from(first);
        self.guest.write(at, &desc_bytes(ds));
    }

    /// Puts `head` on the avail ring with an idx `extra` further than it should be, and kicks.
    pub fn post_raw(&mut self, q: usize, head: u16, extra: u16) {
        let r = &self.rings[q];
        let slot = r.avail + 4 + 2 * u64::from(r.avail_idx % r.size);
        let (avail, new_idx) = (r.avail, r.avail_idx.wrapping_add(1).wrapping_add(extra));
        self.guest.write(slot, &head.to_le_bytes());
        std::sync::atomic::fence(Ordering::SeqCst);
        self.guest.write(avail + 2, &new_idx.to_le_bytes());
        let r = &mut self.rings[q];
        r.avail_idx = new_idx;
        r.kick.write(1).unwrap();
    }

    /// Waits for the next used entry (or watches `SILENCE` for one that must not come).
    pub fn wait_used(&mut self, q: usize, timeout: Duration) -> Answer {
        let deadline = Instant::now() + timeout;
        let (used, size, seen) = {
            let r = &self.rings[q];
            (r.used, r.size, r.used_idx)
        };
        loop {
            let idx = self.guest.read_u16(used + 2);
            if idx != seen {
                let e = self.guest.read(used + 4 + 8 * u64::from(seen % size), 8);
                self.rings[q].used_idx = seen.wrapping_add(1);
                return Answer::Used(
                    u32::from_le_bytes(e[0..4].try_into().unwrap()),
                    u32::from_le_bytes(e[4..8].try_into().unwrap()),
                );
            }
            if Instant::now() > deadline {
                return Answer::Nothing;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Posts the chain `ds` (at descriptor 0) and returns the answer.
    pub fn submit(&mut self, q: usize, ds: &[D]) -> Answer {
        self.write_descs(q, 0, ds);
        self.post_raw(q, 0, 0);
        self.wait_used(q, ANSWER_TIMEOUT)
    }

    /// Checks guest memory against the shadow, ignoring the used rings.
    pub fn check_memory(&mut self) -> Result<(), String> {
        let skip: Vec<(u64, usize)> = self.rings.iter().map(|r| r.used_area()).collect();
        match self.guest.diff(&skip) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A write of 4 KiB of `fill` at `sector` from DATA_GPA on queue `q`: must complete OK.
    pub fn good_write(&mut self, q: usize, sector: u64, fill: u8) {
        self.guest.write(HDR_GPA, &header(T_OUT, sector));
        self.guest.write(DATA_GPA, &[fill; 4096]);
        self.guest.write(STATUS_GPA, &[0xee]);
        let a = self.submit(
            q,
            &[
                d(HDR_GPA, 16, VRING_F_NEXT, 1),
                d(DATA_GPA, 4096, VRING_F_NEXT, 2),
                d(STATUS_GPA, 1, VRING_F_WRITE, 0),
            ],
        );
        assert_eq!(a, Answer::Used(0, 1), "write at sector {sector}");
        assert_eq!(
            self.guest.read(STATUS_GPA, 1)[0],
            S_OK,
            "write at sector {sector}"
        );
    }

    /// A good read of 4 KiB at sector 8 into DATA_GPA: must complete OK with the image's data.
    pub fn good_read(&mut self, q: usize) -> Result<(), String> {
        self.guest.write(HDR_GPA, &header(T_IN, 8));
        self.guest.write(STATUS_GPA, &[0xee]);
        self.guest.write(DATA_GPA, &[CANARY; 4096]);
        let a = self.submit(q, &read_chain(4096));
        if a != Answer::Used(0, 4097) {
            return Err(format!("good read answered {a:?}, expected Used(0, 4097)"));
        }
        let st = self.guest.read(STATUS_GPA, 1)[0];
        if st != S_OK {
            return Err(format!("good read status {st}"));
        }
        let data = self.guest.read(DATA_GPA, 4096);
        if let Some(seed) = self.image_seed {
            if let Some(o) = check_pattern(&data, 4096, seed) {
                return Err(format!("good read: wrong data at byte offset {o}"));
            }
        }
        self.guest.expect(DATA_GPA, &data);
        self.guest.expect(STATUS_GPA, &[S_OK]);
        self.check_memory()
    }
}
