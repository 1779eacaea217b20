//! Deterministic test data shared by the workspace's tests and benches: the same seed gives the
//! same bytes everywhere, so a figure in one place can be reproduced in another.

/// `len` incompressible, deterministic bytes of `seed` (xorshift64, eight bytes per step).
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn noise_is_deterministic_and_does_not_compress() {
        let a = super::noise(7, 1 << 16);
        assert_eq!(a, super::noise(7, 1 << 16));
        assert_ne!(a, super::noise(8, 1 << 16));
        assert_eq!(&super::noise(7, 100)[..], &a[..100]);
        let z = zstd::bulk::compress(&a, 3).expect("zstd");
        assert!(z.len() > a.len(), "{} of {}", z.len(), a.len());
    }
}
