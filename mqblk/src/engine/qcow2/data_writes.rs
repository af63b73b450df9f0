//! Which of imago's writes carry guest data: they are never written through, whatever
//! [`write_order`](super::write_order) says of the metadata around them (a flush makes guest
//! data durable, before the metadata that points at it; writing it through would cost every
//! allocating write a device flush).
//!
//! The metadata worker registers the buffers of the guest data it hands imago ([`register`])
//! for as long as the write runs; a write made only of registered buffers is data
//! ([`is_data`]), anything else is metadata. Buffers of live tasks never overlap (guest
//! memory, or a copy-on-write buffer of the task's own), and a write imago makes from a bounce
//! buffer of its own counts as metadata: written through, which is slower but never wrong.

use std::cell::RefCell;

thread_local! {
    /// The registered ranges of this thread's tasks: `(registration, start, end)`.
    static REGISTERED: RefCell<Vec<(u64, usize, usize)>> = const { RefCell::new(Vec::new()) };
    static NEXT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Keeps buffers registered as guest data until dropped.
pub struct Registered {
    id: u64,
}

/// Registers `bufs` as guest data on this thread until the returned guard is dropped.
pub fn register(bufs: &[&[u8]]) -> Registered {
    let id = NEXT.with(|n| {
        let id = n.get();
        n.set(id + 1);
        id
    });
    REGISTERED.with(|r| {
        let mut r = r.borrow_mut();
        for b in bufs.iter().filter(|b| !b.is_empty()) {
            let start = b.as_ptr() as usize;
            r.push((id, start, start + b.len()));
        }
    });
    Registered { id }
}

impl Drop for Registered {
    fn drop(&mut self) {
        REGISTERED.with(|r| r.borrow_mut().retain(|&(id, ..)| id != self.id));
    }
}

/// Whether a write of `iovecs` is made only of buffers registered on this thread as guest data.
pub fn is_data(iovecs: &[libc::iovec]) -> bool {
    REGISTERED.with(|r| {
        let r = r.borrow();
        !r.is_empty()
            && iovecs.iter().filter(|v| v.iov_len > 0).all(|v| {
                let (start, end) = (v.iov_base as usize, v.iov_base as usize + v.iov_len);
                r.iter().any(|&(_, s, e)| s <= start && end <= e)
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(b: &[u8]) -> libc::iovec {
        libc::iovec {
            iov_base: b.as_ptr() as *mut _,
            iov_len: b.len(),
        }
    }

    #[test]
    fn only_writes_made_of_registered_buffers_are_data() {
        let guest = vec![1u8; 8192];
        let rest = vec![2u8; 4096];
        let table = vec![3u8; 4096];
        assert!(!is_data(&[iov(&guest)]), "nothing registered");
        let g = register(&[&guest, &rest]);
        assert!(is_data(&[iov(&guest)]));
        // Parts of registered buffers (imago splits a write at mapping boundaries).
        assert!(is_data(&[iov(&guest[4096..]), iov(&rest[..512])]));
        assert!(!is_data(&[iov(&table)]), "an unregistered buffer");
        assert!(!is_data(&[iov(&guest), iov(&table)]), "partly unregistered");
        drop(g);
        assert!(!is_data(&[iov(&guest)]), "registration ended");
    }

    #[test]
    fn one_tasks_registration_ends_without_ending_anothers() {
        let a = vec![1u8; 4096];
        let b = vec![2u8; 4096];
        let ra = register(&[&a]);
        let rb = register(&[&b]);
        drop(ra);
        assert!(!is_data(&[iov(&a)]));
        assert!(is_data(&[iov(&b)]));
        drop(rb);
    }
}
