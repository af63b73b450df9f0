//! A vhost-user frontend for the hostile tests (tests/hostile.rs).
//!
//! It speaks vhost-user itself, byte by byte over the unix socket (SCM_RIGHTS for the memfd and
//! eventfds), so that it can send what no well-behaved library would. It shares a memfd as
//! guest memory (two regions with a hole between them), writes the descriptor table, avail ring
//! and requests by hand, kicks, and reads the used ring. Guest memory is filled with a canary
//! first and a shadow copy is kept, so that a test can check that the daemon wrote exactly what
//! it should and nothing else.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mqblk_client::check_pattern;
use vmm_sys_util::eventfd::EventFd;

/// How long a reconnect may be refused because the daemon has not yet seen the previous
/// frontend's close (see [`Session::negotiate_features`]).
pub const RECONNECT_GRACE: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------------------------
// vhost-user, by hand
// ---------------------------------------------------------------------------------------------

pub const GET_FEATURES: u32 = 1;
pub const SET_FEATURES: u32 = 2;
pub const SET_OWNER: u32 = 3;
pub const SET_MEM_TABLE: u32 = 5;
pub const SET_VRING_NUM: u32 = 8;
pub const SET_VRING_ADDR: u32 = 9;
pub const SET_VRING_BASE: u32 = 10;
pub const GET_VRING_BASE: u32 = 11;
pub const SET_VRING_KICK: u32 = 12;
pub const SET_VRING_CALL: u32 = 13;
pub const GET_PROTOCOL_FEATURES: u32 = 15;
pub const SET_PROTOCOL_FEATURES: u32 = 16;
pub const GET_QUEUE_NUM: u32 = 17;
pub const SET_VRING_ENABLE: u32 = 18;
pub const GET_CONFIG: u32 = 24;
pub const SET_CONFIG: u32 = 25;
pub const GET_INFLIGHT_FD: u32 = 31;
pub const SET_INFLIGHT_FD: u32 = 32;

pub const HDR_VERSION: u32 = 0x1;
pub const HDR_REPLY: u32 = 0x4;
pub const HDR_NEED_REPLY: u32 = 0x8;
/// vhost-user's largest message body (the vhost crate's MAX_MSG_SIZE).
pub const MAX_MSG_SIZE: u32 = 0x1000;

pub const F_INDIRECT_DESC: u64 = 1 << 28;
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
pub const F_VERSION_1: u64 = 1 << 32;
pub const F_BLK_RO: u64 = 1 << 5;
pub const F_BLK_FLUSH: u64 = 1 << 9;
pub const F_BLK_CONFIG_WCE: u64 = 1 << 11;
pub const P_MQ: u64 = 1 << 0;
pub const P_REPLY_ACK: u64 = 1 << 3;
pub const P_CONFIG: u64 = 1 << 9;
pub const P_INFLIGHT_SHMFD: u64 = 1 << 12;

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

/// One frontend connection.
pub struct Conn {
    pub sock: UnixStream,
}

impl Conn {
    pub fn connect(path: &Path) -> Conn {
        let sock = UnixStream::connect(path).expect("connecting to the export");
        sock.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
        Conn { sock }
    }

    /// Sends raw bytes, with file descriptors attached to the first byte.
    pub fn send_raw(&self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let mut iov = libc::iovec {
            iov_base: bytes.as_ptr() as *mut libc::c_void,
            iov_len: bytes.len(),
        };
        // SAFETY: a msghdr pointing at live locals (iov, cmsg buffer) for the duration of
        // sendmsg; the control buffer is sized with CMSG_SPACE for `fds`.
        unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            let fd_bytes = std::mem::size_of_val(fds) as u32;
            let mut cbuf = vec![0u8; libc::CMSG_SPACE(fd_bytes) as usize];
            if !fds.is_empty() {
                msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
                msg.msg_controllen = cbuf.len();
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as usize;
                std::ptr::copy_nonoverlapping(
                    fds.as_ptr() as *const u8,
                    libc::CMSG_DATA(c),
                    fd_bytes as usize,
                );
            }
            let n = libc::sendmsg(self.sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            if n as usize != bytes.len() {
                return Err(io::Error::other("short sendmsg"));
            }
        }
        Ok(())
    }

    pub fn send(&self, code: u32, flags: u32, body: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let mut m = u32s(&[code, HDR_VERSION | flags, body.len() as u32]);
        m.extend_from_slice(body);
        self.send_raw(&m, fds)
    }

    /// Reads one reply: (code, flags, body).
    pub fn recv(&self) -> io::Result<(u32, u32, Vec<u8>)> {
        let mut s = &self.sock;
        let mut h = [0u8; 12];
        s.read_exact(&mut h)?;
        let w = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
        let (code, flags, size) = (w(0), w(4), w(8));
        if size > MAX_MSG_SIZE {
            return Err(io::Error::other(format!("reply size {size}")));
        }
        let mut body = vec![0u8; size as usize];
        s.read_exact(&mut body)?;
        assert!(flags & HDR_REPLY != 0, "reply without the REPLY flag");
        Ok((code, flags, body))
    }

    /// A request that has a reply body (GET_*).
    pub fn get(&self, code: u32, body: &[u8]) -> Result<Vec<u8>, String> {
        self.send(code, 0, body, &[])
            .map_err(|e| format!("send: {e}"))?;
        let (c, _, b) = self.recv().map_err(|e| format!("closed: {e}"))?;
        assert_eq!(c, code, "reply to another request");
        Ok(b)
    }

    pub fn get_u64(&self, code: u32) -> Result<u64, String> {
        let b = self.get(code, &[])?;
        Ok(u64::from_le_bytes(b[..8].try_into().unwrap()))
    }

    /// A request answered with REPLY_ACK: Ok, or Err("NACK")/Err("closed: ...").
    pub fn set(&self, code: u32, body: &[u8], fds: &[RawFd]) -> Result<(), String> {
        self.send(code, HDR_NEED_REPLY, body, fds)
            .map_err(|e| format!("closed: send: {e}"))?;
        let (c, _, b) = self.recv().map_err(|e| format!("closed: {e}"))?;
        assert_eq!(c, code, "ack for another request");
        match u64::from_le_bytes(b[..8].try_into().unwrap()) {
            0 => Ok(()),
            v => Err(format!("NACK ({v})")),
        }
    }

    /// A request sent without asking for an ack.
    pub fn set_noack(&self, code: u32, body: &[u8]) {
        self.send(code, 0, body, &[]).expect("send");
    }

    /// Whether the daemon closes the connection within `within`.
    pub fn closed_by_peer(&self, within: Duration) -> bool {
        self.sock.set_read_timeout(Some(within)).unwrap();
        let mut b = [0u8; 64];
        let r = (&self.sock).read(&mut b);
        self.sock.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
        match r {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
        }
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
    pub fd: File,
    pub base: *mut u8,
    pub len: usize,
    /// (gpa, size, file offset)
    pub regions: Vec<(u64, u64, u64)>,
    pub shadow: Vec<u8>,
}

impl Guest {
    pub fn new() -> Guest {
        let len = 2 * MIB_U;
        // SAFETY: plain syscalls; the mapping is owned by the Guest and unmapped in Drop.
        let (fd, base) = unsafe {
            let fd = libc::memfd_create(c"hostile-guest".as_ptr(), libc::MFD_CLOEXEC);
            assert!(fd >= 0, "memfd_create");
            assert_eq!(libc::ftruncate(fd, len as i64), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            (File::from_raw_fd(fd), p as *mut u8)
        };
        let mut g = Guest {
            fd,
            base,
            len,
            regions: vec![
                (0, MIB_U as u64, 0),
                (REGION_B_GPA, MIB_U as u64, MIB_U as u64),
            ],
            shadow: vec![CANARY; len],
        };
        g.mem().fill(CANARY);
        g
    }

    pub fn mem(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live and `len` long. The daemon writes to it concurrently only
        // while a request is in flight; the test reads it after the answer.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
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
        self.base as u64 + self.off(gpa, 1) as u64
    }

    /// Writes guest memory (and the shadow).
    pub fn write(&mut self, gpa: u64, data: &[u8]) {
        let o = self.off(gpa, data.len());
        self.mem()[o..o + data.len()].copy_from_slice(data);
        self.shadow[o..o + data.len()].copy_from_slice(data);
    }

    pub fn read(&mut self, gpa: u64, len: usize) -> Vec<u8> {
        let o = self.off(gpa, len);
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut v = vec![0u8; len];
        // SAFETY: in bounds (checked by off). The daemon writes this memory only while a
        // request is in flight; callers read it after the answer (the fence above orders it).
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(o), v.as_mut_ptr(), len) };
        v
    }

    pub fn read_u16(&mut self, gpa: u64) -> u16 {
        let o = self.off(gpa, 2);
        // SAFETY: in bounds and 2-aligned (ring fields); volatile: the daemon updates it.
        let v = unsafe { std::ptr::read_volatile(self.base.add(o) as *const u16) };
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
        let mut v = vec![0u8; self.len];
        // SAFETY: the whole live mapping; see `read`.
        unsafe { std::ptr::copy_nonoverlapping(self.base, v.as_mut_ptr(), self.len) };
        v
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in new().
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
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
    #[allow(dead_code)]
    pub index: u32,
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
    /// Kept open for the session's lifetime; dropping it disconnects.
    #[allow(dead_code)]
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
        Self::negotiate_with(path, 0)
    }

    /// [`Session::negotiate`], acking the protocol features `extra` as well.
    pub fn negotiate_with(path: &Path, extra: u64) -> Result<(Conn, u64), String> {
        Self::negotiate_features(path, extra, 0)
    }

    /// [`Session::negotiate_with`], acking the device features `features` as well.
    pub fn negotiate_features(
        path: &Path,
        extra: u64,
        features: u64,
    ) -> Result<(Conn, u64), String> {
        // The daemon serves one frontend per socket and closes a second one at once. The
        // previous session's close can reach it late (another test thread forking a process
        // holds a copy of the socket until its exec), so retry a refused connection briefly.
        let deadline = Instant::now() + RECONNECT_GRACE;
        let (conn, offered) = loop {
            let conn = Conn::connect(path);
            match conn.get_u64(GET_FEATURES) {
                Ok(f) => break (conn, f),
                Err(e) if e.starts_with("closed") && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e),
            }
        };
        let pf = conn.get_u64(GET_PROTOCOL_FEATURES)?;
        assert!(pf & P_REPLY_ACK != 0, "REPLY_ACK not offered");
        assert!(
            pf & extra == extra,
            "protocol features {extra:#x} not offered ({pf:#x})"
        );
        conn.set_noack(
            SET_PROTOCOL_FEATURES,
            &u64s(&[P_MQ | P_REPLY_ACK | P_CONFIG | extra]),
        );
        conn.set(SET_OWNER, &[], &[])?;
        assert!(
            offered & features == features,
            "features {features:#x} not offered ({offered:#x})"
        );
        let want =
            F_VERSION_1 | F_PROTOCOL_FEATURES | F_INDIRECT_DESC | (offered & F_BLK_RO) | features;
        conn.set(SET_FEATURES, &u64s(&[want]), &[])?;
        Ok((conn, offered))
    }

    pub fn set_mem_table(conn: &Conn, guest: &Guest) -> Result<(), String> {
        let mut body = u32s(&[guest.regions.len() as u32, 0]);
        let mut fds = Vec::new();
        for &(gpa, size, off) in &guest.regions {
            body.extend_from_slice(&u64s(&[gpa, size, guest.base as u64 + off, off]));
            fds.push(guest.fd.as_raw_fd());
        }
        conn.set(SET_MEM_TABLE, &body, &fds)
    }

    pub fn setup_ring(conn: &Conn, guest: &mut Guest, q: u32, size: u16) -> Result<Ring, String> {
        let (desc, avail, used) = ring_gpas(q);
        guest.write(desc, &vec![0u8; 16 * size as usize]);
        guest.write(avail, &vec![0u8; 6 + 2 * size as usize]);
        guest.write(used, &vec![0u8; 6 + 8 * size as usize]);
        conn.set(SET_VRING_NUM, &u32s(&[q, u32::from(size)]), &[])?;
        conn.set(SET_VRING_BASE, &u32s(&[q, 0]), &[])?;
        let mut body = u32s(&[q, 0]);
        body.extend_from_slice(&u64s(&[
            guest.user_addr(desc),
            guest.user_addr(used),
            guest.user_addr(avail),
            0,
        ]));
        conn.set(SET_VRING_ADDR, &body, &[])?;
        let kick = EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK).unwrap();
        let call = EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK).unwrap();
        conn.set(SET_VRING_CALL, &u64s(&[u64::from(q)]), &[call.as_raw_fd()])?;
        conn.set(SET_VRING_KICK, &u64s(&[u64::from(q)]), &[kick.as_raw_fd()])?;
        conn.set(SET_VRING_ENABLE, &u32s(&[q, 1]), &[])?;
        Ok(Ring {
            index: q,
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
        let (conn, _) = Self::negotiate_features(path, 0, features).expect("negotiation");
        let mut guest = Guest::new();
        Self::set_mem_table(&conn, &guest).expect("SET_MEM_TABLE");
        let ring = Self::setup_ring(&conn, &mut guest, 0, size).expect("vring setup");
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

    /// A good read of 4 KiB at sector 8 into DATA_GPA: must complete OK with the image's data.
    pub fn good_read(&mut self, q: usize) -> Result<(), String> {
        self.guest.write(HDR_GPA, &header(T_IN, 8));
        self.guest.write(STATUS_GPA, &[0xee]);
        self.guest.write(DATA_GPA, &[CANARY; 4096]);
        let a = self.submit(
            q,
            &[
                d(HDR_GPA, 16, VRING_F_NEXT, 1),
                d(DATA_GPA, 4096, VRING_F_WRITE | VRING_F_NEXT, 2),
                d(STATUS_GPA, 1, VRING_F_WRITE, 0),
            ],
        );
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
