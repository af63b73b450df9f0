//! Memory shared with the daemon the way a vhost-user frontend shares guest memory: memfds, and
//! shared mappings of them.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};

use rustix::fs::{memfd_create, MemfdFlags};

/// A memfd of `len` bytes (zeroes).
pub fn memfd(name: &str, len: u64) -> File {
    memfd_flags(name, len, MemfdFlags::CLOEXEC)
}

/// A memfd of `len` bytes that can be sealed (MFD_ALLOW_SEALING), as frontends make dirty logs.
pub fn sealable_memfd(name: &str, len: u64) -> File {
    memfd_flags(name, len, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
}

fn memfd_flags(name: &str, len: u64, flags: MemfdFlags) -> File {
    let f = File::from(memfd_create(name, flags).unwrap_or_else(|e| panic!("memfd_create: {e}")));
    f.set_len(len).expect("sizing a memfd");
    f
}

/// A memfd mapped shared into this process: what the daemon maps from the descriptor, this
/// process sees at [`SharedMem::as_ptr`].
pub struct SharedMem {
    file: File,
    ptr: *mut u8,
    len: usize,
}

impl SharedMem {
    pub fn new(name: &str, len: usize) -> Self {
        Self::map(memfd(name, len as u64), len)
    }

    /// Maps the first `len` bytes of `file`.
    pub fn map(file: File, len: usize) -> Self {
        // SAFETY: a new shared mapping of a descriptor we own; it is unmapped in Drop and
        // nothing else maps at its address meanwhile.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap of a memfd");
        SharedMem {
            file,
            ptr: ptr.cast(),
            len,
        }
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The mapping as a slice. The daemon may write to it concurrently only while a request is
    /// in flight; callers look at it after the answer.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is live and `len` long, and `&mut self` keeps this process from
        // making another slice of it meanwhile.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for SharedMem {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in new(); no slice of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
