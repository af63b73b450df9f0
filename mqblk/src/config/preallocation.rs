//! `preallocation=`: how the space of an image file mqblk creates, or grows through
//! `export_resize`, is provided. The names and meanings are qemu-img's (`-o preallocation=`),
//! so an operator's habits carry over, and the modes a format takes are the ones QEMU takes.

use super::qcow2::ImageFormat;
use super::ConfigError;

/// How new image space is provided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Preallocation {
    /// Nothing ahead (the default): a raw file is sparse, a qcow2 image allocates each cluster
    /// at its first write.
    #[default]
    Off,
    /// qcow2 only: every cluster is mapped (its L2 entry and refcount written) at once, over
    /// file space that stays a hole until written. A write never allocates, so it goes
    /// straight to the I/O thread's ring, as on an allocated image.
    Metadata,
    /// `metadata` (for qcow2) and the file's space reserved with `fallocate`, so that a
    /// full filesystem cannot fail a later write.
    Falloc,
    /// `metadata` (for qcow2) and zeros written over all of it: every block of the file
    /// written once, ahead.
    Full,
}

impl Preallocation {
    /// Refuses a mode `format` cannot take: `metadata` maps the clusters of a qcow2 image, and
    /// a raw file has none.
    pub(super) fn check(self, format: ImageFormat) -> Result<(), ConfigError> {
        if format == ImageFormat::Raw && self == Preallocation::Metadata {
            return Err(ConfigError::Invalid {
                key: "preallocation",
                value: "metadata".into(),
                allowed: "a raw image takes off, falloc or full (metadata maps the clusters of a \
                          qcow2 image; a raw file has none)",
            });
        }
        Ok(())
    }
}

/// Why an overlay takes only `preallocation=off`: its unallocated clusters show the backing
/// image's data, and clusters mapped ahead would hide it (QEMU refuses the same without
/// extended L2 entries, which mqblk does not serve).
pub(super) const OVERLAY: &str =
    "an overlay (backing=) takes only preallocation=off: clusters mapped ahead would hide its \
     backing image's data";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_raw_image_takes_every_mode_but_metadata() {
        use Preallocation::*;
        for mode in [Off, Falloc, Full] {
            assert_eq!(mode.check(ImageFormat::Raw), Ok(()), "{mode:?} on raw");
        }
        let e = Metadata.check(ImageFormat::Raw).unwrap_err().to_string();
        assert!(
            e.contains("preallocation=metadata") && e.contains("off, falloc or full"),
            "{e}"
        );
        for mode in [Off, Metadata, Falloc, Full] {
            assert_eq!(mode.check(ImageFormat::Qcow2), Ok(()), "{mode:?} on qcow2");
        }
    }
}
