//! Deterministic test data shared by the workspace's tests and benches: the same seed gives the
//! same bytes everywhere, so a figure in one place can be reproduced in another.

/// `len` incompressible, deterministic bytes of `seed` (xorshift64, eight bytes per step).
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x = step(x);
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Bytes of a database block.
pub const BLOCK: usize = 8192;

/// `n` blocks of rows with random fields (compressing to about a third, as real rows do), each
/// padded with blanks, from `seed`: a datafile's pages.
pub fn rows(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n * BLOCK);
    for b in 0..n {
        while out.len() < (b + 1) * BLOCK - 80 {
            x = step(x);
            let row = format!("{b:05}|{:020}|{:x}|OPEN\n", x % 99_999_999_999, x >> 20);
            out.extend_from_slice(row.as_bytes());
        }
        out.resize((b + 1) * BLOCK, b' ');
    }
    out
}

/// `n` blocks of random lowercase words from `seed`: text that resembles no block of [`rows`]
/// nor of another seed.
pub fn words(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    let mut out = Vec::with_capacity(n * BLOCK + 16);
    while out.len() < n * BLOCK {
        x = step(x);
        for i in 0..(3 + x % 6) {
            out.push(b'a' + ((x >> (8 * i)) % 26) as u8);
        }
        out.push(if x.is_multiple_of(11) { b'\n' } else { b' ' });
    }
    out.truncate(n * BLOCK);
    out
}

/// `data` with two bytes of every block changed (where, by `salt`), as an OLTP run changes
/// each page a little.
pub fn edited(data: &[u8], salt: usize) -> Vec<u8> {
    let mut out = data.to_vec();
    for (b, block) in out.chunks_mut(BLOCK).enumerate() {
        if block.len() == BLOCK {
            block[300 + (b * 37 + salt * 101) % 6000] ^= 0x20;
            block[5000 + salt % 3000] = b'X';
        }
    }
    out
}

/// A copy sent as `first` parallel streams, then a changed copy as `changed` streams (at most
/// `first`), each of `n` blocks: the parts a backup tool's channels send side by side. A
/// changed part interleaves its old blocks, changed a little, with new blocks that every changed
/// part shares (each but the first with a few bytes of its own), so one stream's new block is
/// another's reference or delta base a moment after it was sent.
pub fn parallel_copies(first: usize, changed: usize, n: usize) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let firsts: Vec<Vec<u8>> = (0..first).map(|i| rows(i as u64 + 1, n)).collect();
    let fresh = words(99, n / 2);
    let changed = firsts
        .iter()
        .take(changed)
        .enumerate()
        .map(|(i, old)| {
            let old = edited(&old[..n / 2 * BLOCK], i);
            let new = if i == 0 {
                fresh.clone()
            } else {
                edited(&fresh, 7 + i)
            };
            let mut out = Vec::with_capacity(old.len() + new.len());
            for (a, b) in old.chunks(BLOCK).zip(new.chunks(BLOCK)) {
                out.extend_from_slice(a);
                out.extend_from_slice(b);
            }
            out
        })
        .collect();
    (firsts, changed)
}

/// [`parallel_copies`]' parts sent through `s` (a stream for each first part), the first copy
/// then the changed one, as clients writing 64 KiB at a time: the records, and each turn's
/// stream and where its records end.
pub fn send_parallel_copies(
    s: &mut crate::Streams,
    copies: &(Vec<Vec<u8>>, Vec<Vec<u8>>),
    pressure: crate::Pressure,
) -> (Vec<u8>, Vec<(usize, usize)>) {
    let (mut wire, mut turns) = (Vec::new(), Vec::new());
    for parts in [&copies.0, &copies.1] {
        let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        s.send(&refs, 64 << 10, pressure, &mut wire, &mut turns);
    }
    (wire, turns)
}

/// What each stream of [`send_parallel_copies`] carried: its first part, then its changed one.
pub fn parallel_streams(copies: &(Vec<Vec<u8>>, Vec<Vec<u8>>)) -> Vec<Vec<u8>> {
    let mut streams = copies.0.clone();
    for (s, c) in streams.iter_mut().zip(&copies.1) {
        s.extend_from_slice(c);
    }
    streams
}

/// The `turns` of `wire` (each turn's stream and where its records end) decoded frame by
/// frame, each in its stream's context, into `n` streams' bytes; `None` if a frame does not
/// decode whole or names a stream past the `n`th.
pub fn decode_turns(
    cfg: &crate::CodecConfig,
    wire: &[u8],
    turns: &[(usize, usize)],
    n: usize,
) -> Option<Vec<Vec<u8>>> {
    let mut dec = crate::Decoder::new(cfg);
    let mut outs = vec![Vec::new(); n];
    let mut ctxs: Vec<crate::StreamContext> = (0..n).map(|_| Default::default()).collect();
    let mut from = 0;
    for &(k, end) in turns {
        let frame = wire.get(from..end)?;
        let (used, stop) = dec.decode_frame(frame, outs.get_mut(k)?, ctxs.get_mut(k)?, usize::MAX);
        if used != frame.len() || stop.is_some() {
            return None;
        }
        from = end;
    }
    Some(outs)
}

fn step(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
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
