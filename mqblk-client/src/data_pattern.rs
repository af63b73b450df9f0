//! The verify pattern: data that is a function of its absolute disk offset and a seed, so that
//! data at the wrong offset, stale data and data from another run are all detected, also when
//! the image file is read directly on the host.

/// splitmix64's finaliser: a good 64-bit mix, also what seeds each job's random offsets.
#[inline]
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[inline]
fn pattern_word(seed: u64, pos: u64) -> u64 {
    mix64(pos ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Fills `buf` with the pattern for disk bytes `offset..offset + buf.len()` under `seed`: every
/// 8-byte little-endian word is a hash of its absolute disk position and the seed.
///
/// `offset` and `buf.len()` must be multiples of 8.
pub fn fill_pattern(buf: &mut [u8], offset: u64, seed: u64) {
    debug_assert!(offset.is_multiple_of(8) && buf.len().is_multiple_of(8));
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern_word(seed, offset + 8 * i as u64).to_le_bytes());
    }
}

/// Checks `buf` against the pattern for disk bytes starting at `offset`. Returns the disk offset
/// of the first wrong byte's word, or `None` if all match.
pub fn check_pattern(buf: &[u8], offset: u64, seed: u64) -> Option<u64> {
    debug_assert!(offset.is_multiple_of(8) && buf.len().is_multiple_of(8));
    for (i, w) in buf.chunks_exact(8).enumerate() {
        let pos = offset + 8 * i as u64;
        if u64::from_le_bytes(w.try_into().unwrap()) != pattern_word(seed, pos) {
            return Some(pos);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_detects_misplaced_and_foreign_data() {
        let mut a = vec![0u8; 4096];
        fill_pattern(&mut a, 8192, 7);
        assert_eq!(check_pattern(&a, 8192, 7), None);
        assert_eq!(check_pattern(&a, 8192 + 4096, 7), Some(8192 + 4096));
        assert_eq!(check_pattern(&a, 8192, 8), Some(8192));
        a[4000] ^= 1;
        assert_eq!(check_pattern(&a, 8192, 7), Some(8192 + 4000 / 8 * 8));
        assert!(check_pattern(&[0u8; 512], 0, 7).is_some());
    }
}
