//! File seals (memfd_create(2), "File sealing"): a sealed size is a promise the kernel keeps
//! for every holder of the file, the frontend included.

use std::fs::File;
use std::io;

use rustix::fs::SealFlags;

/// Makes sure `file` can never shrink: it carries `F_SEAL_SHRINK`, or gets it now. Fails for a
/// file that is not a memfd, a memfd created without `MFD_ALLOW_SEALING`, or one sealed
/// against further seals without `F_SEAL_SHRINK`.
pub fn against_shrinking(file: &File) -> io::Result<()> {
    let seals = rustix::fs::fcntl_get_seals(file)?;
    if seals.contains(SealFlags::SHRINK) {
        return Ok(());
    }
    rustix::fs::fcntl_add_seals(file, SealFlags::SHRINK)?;
    Ok(())
}

/// A new memfd of `size` bytes whose size nobody can change, not even mqblk: sealed against
/// shrinking, growing and further sealing. For regions mqblk hands to a frontend.
pub fn sized_memfd(name: &std::ffi::CStr, size: u64) -> io::Result<File> {
    use rustix::fs::MemfdFlags;
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    let file = File::from(fd);
    file.set_len(size)?;
    rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::MemfdFlags;

    #[test]
    fn a_sealable_memfd_is_sealed_and_then_cannot_shrink() {
        let fd = rustix::fs::memfd_create(c"t", MemfdFlags::ALLOW_SEALING).unwrap();
        let f = File::from(fd);
        f.set_len(8192).unwrap();
        against_shrinking(&f).unwrap();
        assert!(f.set_len(4096).is_err(), "a sealed file shrank");
        f.set_len(16384).unwrap();
        // Sealing again is a no-op.
        against_shrinking(&f).unwrap();
    }

    #[test]
    fn a_memfd_without_allow_sealing_cannot_be_sealed() {
        let f = File::from(rustix::fs::memfd_create(c"t", MemfdFlags::empty()).unwrap());
        f.set_len(4096).unwrap();
        assert!(against_shrinking(&f).is_err());
        let plain = tempfile::tempfile().unwrap();
        assert!(against_shrinking(&plain).is_err());
    }

    #[test]
    fn a_sized_memfd_keeps_its_size() {
        let f = sized_memfd(c"t", 4096).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 4096);
        assert!(f.set_len(0).is_err());
        assert!(f.set_len(8192).is_err());
        assert!(rustix::fs::fcntl_add_seals(&f, SealFlags::WRITE).is_err());
    }
}
