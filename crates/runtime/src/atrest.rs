//! Keys for what the disk tier keeps when `optimize.disk.key_file` is set. Everything is
//! derived from the one cache key, each for one purpose (BLAKE3's `derive_key`), so nothing
//! the daemon writes shows a chunk's fingerprint or bytes to someone who can read the disk:
//!
//! - fingerprints in record headers are keyed ([`AtRest::tag`], a MAC under the cache key), so
//!   a reader cannot confirm that a chunk they know crossed the link;
//! - each segment file's records are sealed (AES-256-GCM) under a key of their own, derived
//!   from the cache key, a random salt kept beside the segments and the segment's number, so
//!   the random 96-bit nonces under one key number at most one segment's records;
//! - each saved state file is sealed whole under a key from the cache key and a random salt of
//!   its own at the head of the file ([`AtRest::seal_file`]).

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use wanopt_codec::cache::Fingerprint;

/// The AES-GCM tag's length.
pub const TAG_LEN: usize = 16;
/// A salt's length (per segment directory, per state file).
pub const SALT_LEN: usize = 32;
/// What a sealed file starts with.
const FILE_MAGIC: [u8; 4] = *b"WOE1";
/// Bytes a sealed file adds to its contents.
pub const FILE_OVERHEAD: usize = FILE_MAGIC.len() + SALT_LEN + NONCE_LEN + TAG_LEN;

const TAG_CONTEXT: &str = "wanopt 2026-11 disk tier: fingerprint tag";
const SEGMENT_CONTEXT: &str = "wanopt 2026-11 disk tier: segment key";
const FILE_CONTEXT: &str = "wanopt 2026-11 disk tier: state file key";

/// A file that cannot be unsealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("not a sealed file")]
    NotSealed,
    #[error("wrong key or damaged")]
    Open,
    #[error("no random bytes")]
    Random,
}

/// The keys derived from one cache key.
pub struct AtRest {
    master: [u8; 32],
    tag_key: [u8; 32],
    rng: SystemRandom,
}

impl std::fmt::Debug for AtRest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AtRest")
    }
}

impl AtRest {
    pub fn new(master: [u8; 32]) -> Self {
        AtRest {
            master,
            tag_key: blake3::derive_key(TAG_CONTEXT, &master),
            rng: SystemRandom::new(),
        }
    }

    /// What a record header holds in place of the fingerprint `f`.
    pub fn tag(&self, f: &Fingerprint) -> Fingerprint {
        let mut t = [0u8; 16];
        t.copy_from_slice(&blake3::keyed_hash(&self.tag_key, f).as_bytes()[..16]);
        t
    }

    /// Fresh random bytes.
    pub fn random<const N: usize>(&self) -> Result<[u8; N], SealError> {
        let mut b = [0u8; N];
        self.rng.fill(&mut b).map_err(|_| SealError::Random)?;
        Ok(b)
    }

    fn key(&self, context: &str, salt: &[u8], n: u32) -> LessSafeKey {
        let mut h = blake3::Hasher::new_derive_key(context);
        h.update(&self.master);
        h.update(salt);
        h.update(&n.to_be_bytes());
        let k = h.finalize();
        let key = UnboundKey::new(&AES_256_GCM, k.as_bytes());
        LessSafeKey::new(key.expect("32-byte key")) // invariant: BLAKE3 gives 32 bytes, AES-256's key length
    }

    /// The key of segment `seg` of the directory whose salt is `salt`.
    pub fn segment_key(&self, salt: &[u8; SALT_LEN], seg: u32) -> LessSafeKey {
        self.key(SEGMENT_CONTEXT, salt, seg)
    }

    /// `plain` sealed under a key of its own: magic, salt, nonce, ciphertext, tag.
    pub fn seal_file(&self, plain: &[u8]) -> Result<Vec<u8>, SealError> {
        let salt: [u8; SALT_LEN] = self.random()?;
        let nonce: [u8; NONCE_LEN] = self.random()?;
        let mut out = Vec::with_capacity(plain.len() + FILE_OVERHEAD);
        out.extend_from_slice(&FILE_MAGIC);
        out.extend_from_slice(&salt);
        out.extend_from_slice(&nonce);
        let at = out.len();
        out.extend_from_slice(plain);
        let tag = self
            .key(FILE_CONTEXT, &salt, 0)
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(FILE_MAGIC),
                &mut out[at..],
            )
            .map_err(|_| SealError::Open)?;
        out.extend_from_slice(tag.as_ref());
        Ok(out)
    }

    /// The contents of a file [`seal_file`](Self::seal_file) wrote, checked.
    pub fn open_file(&self, mut sealed: Vec<u8>) -> Result<Vec<u8>, SealError> {
        if !is_sealed(&sealed) || sealed.len() < FILE_OVERHEAD {
            return Err(SealError::NotSealed);
        }
        let salt = &sealed[4..4 + SALT_LEN];
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&sealed[4 + SALT_LEN..4 + SALT_LEN + NONCE_LEN]);
        let key = self.key(FILE_CONTEXT, salt, 0);
        let head = 4 + SALT_LEN + NONCE_LEN;
        let n = key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(FILE_MAGIC),
                &mut sealed[head..],
            )
            .map_err(|_| SealError::Open)?
            .len();
        sealed.copy_within(head..head + n, 0);
        sealed.truncate(n);
        Ok(sealed)
    }
}

/// Whether `bytes` look like a sealed file (they may still fail to open).
pub fn is_sealed(bytes: &[u8]) -> bool {
    bytes.starts_with(&FILE_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_files_round_trip_and_any_change_or_other_key_fails() {
        let a = AtRest::new([1; 32]);
        let plain: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let s = a.seal_file(&plain).expect("seal");
        assert_eq!(s.len(), plain.len() + FILE_OVERHEAD);
        assert!(!s.windows(32).any(|w| w == &plain[100..132]));
        assert_eq!(a.open_file(s.clone()).as_deref(), Ok(&plain[..]));
        // Two seals of the same contents share nothing (a salt and nonce each).
        let s2 = a.seal_file(&plain).expect("seal");
        assert_ne!(s[4..40], s2[4..40]);
        for at in [0, 5, 40, 100, s.len() - 1] {
            let mut bad = s.clone();
            bad[at] ^= 1;
            assert!(a.open_file(bad).is_err(), "flip at {at}");
        }
        assert!(a.open_file(s[..FILE_OVERHEAD - 1].to_vec()).is_err());
        assert_eq!(
            AtRest::new([2; 32]).open_file(s.clone()),
            Err(SealError::Open)
        );
        assert_eq!(a.open_file(plain), Err(SealError::NotSealed));
        assert_eq!(a.open_file(a.seal_file(&[]).expect("seal")), Ok(vec![]));
    }

    #[test]
    fn tags_and_segment_keys_differ_by_key_salt_and_segment() {
        let (a, b) = (AtRest::new([1; 32]), AtRest::new([2; 32]));
        let f = [9u8; 16];
        assert_ne!(a.tag(&f), f);
        assert_ne!(a.tag(&f), b.tag(&f));
        assert_eq!(a.tag(&f), AtRest::new([1; 32]).tag(&f));
        let seal = |k: &LessSafeKey| {
            let mut d = *b"sixteen bytes!!!";
            let _tag = k
                .seal_in_place_separate_tag(
                    Nonce::assume_unique_for_key([0; NONCE_LEN]),
                    Aad::empty(),
                    &mut d,
                )
                .expect("seal");
            d
        };
        let base = seal(&a.segment_key(&[0; 32], 1));
        assert_eq!(base, seal(&a.segment_key(&[0; 32], 1)));
        assert_ne!(base, seal(&a.segment_key(&[0; 32], 2)));
        assert_ne!(base, seal(&a.segment_key(&[1; 32], 1)));
        assert_ne!(base, seal(&b.segment_key(&[0; 32], 1)));
    }
}
