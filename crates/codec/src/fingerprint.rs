//! A chunk's name: the first 16 bytes (128 bits) of its BLAKE3 hash. The cache, the stores and
//! both ends of the codec name chunks by it, and every chunk read back is checked against it.

/// A chunk fingerprint: the first 16 bytes (128 bits) of its BLAKE3 hash.
pub type Fingerprint = [u8; 16];

/// The fingerprint of `data`.
pub fn fingerprint(data: &[u8]) -> Fingerprint {
    let h = blake3::hash(data);
    let mut f = [0u8; 16];
    f.copy_from_slice(&h.as_bytes()[..16]);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fingerprint_is_the_head_of_the_blake3_hash() {
        let f = fingerprint(b"redo");
        assert_eq!(&f[..], &blake3::hash(b"redo").as_bytes()[..16]);
        assert_ne!(f, fingerprint(b"redo "));
    }
}
