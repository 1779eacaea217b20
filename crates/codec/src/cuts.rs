//! FastCDC's cut points found in pieces (issue 36): the same chunks as [`crate::chunks`], the
//! cutting split into pieces that can run on several cores.
//!
//! FastCDC's next cut depends only on where the chunk begins and on the bytes after it, so the
//! chain of cuts begun at any point is the true one from the first cut the two share. A
//! piece's chain is begun a little before the piece ([`lookback`]), a guess that nearly always
//! meets the true chain before the piece begins; [`join`] checks each piece's chain against the
//! chain so far, and cuts on itself, a chunk or so, where they have not met. Each piece skips
//! the first bytes of every chunk as FastCDC does, so a piece costs what FastCDC costs, plus
//! its lookback. (Finding every byte whose 48-byte gear window passes a mask, which needs no
//! guess, hashes every byte: 833-911 MB/s a core here against FastCDC's 1,470-2,280.)

use std::ops::Range;

use crate::config::CodecConfig;

/// How far before its piece a piece's chain begins (see [`chain_in_piece`]): a chain begun
/// anywhere meets the true one at a common cut within a chunk or two. Measured on 40 MB of two
/// real tars in pieces of 64-320 KiB, the join cut 0.8 chunks itself per piece with none, 0.25
/// with 8 KiB, 0.12 with 16 KiB and 0.05 with 32 KiB (the default chunk sizes). Each chunk the
/// join cuts is cut and fingerprinted on the daemon's thread, in the link's order, while the
/// lookback is cut on a worker: a longest chunk's lookback (32 KiB, from 8 KiB) took the LZ4
/// path's serial share from a median of 0.072 to 0.051 (four streams, three data sets, four
/// runs each, interleaved), for 5% more CPU in all (see `crates/codec/PARALLEL.md`).
pub fn lookback(cfg: &CodecConfig) -> usize {
    cfg.max_chunk
}

/// The smallest piece worth a chain of its own: a longest chunk, whose lookback at most doubles
/// its cutting (on a worker). A link's turn cuts the bytes that came since the turn before,
/// about the turn's own (100-130 KiB in the codec's tests, 256 KiB for a bulk copy), so this
/// lets a turn's cutting go in up to eight pieces.
pub fn min_piece(cfg: &CodecConfig) -> usize {
    cfg.max_chunk
}

/// The chunks of `bytes` that start in `piece`, as (offset, length), cut by FastCDC from
/// `begin` on (at or before `piece.start`): from a boundary (the first piece), the true chunks;
/// from anywhere else (`piece.start - lookback`), a guess that [`join`] checks. Only chunks
/// that end before `bytes` does: the last may grow when more bytes come. A chunk that ends
/// before the end is the one FastCDC cuts there with any more bytes after it. `each` gets
/// them in order, and returns false for no more.
pub fn chain_in_piece(
    bytes: &[u8],
    begin: usize,
    piece: Range<usize>,
    cfg: &CodecConfig,
    mut each: impl FnMut(usize, usize) -> bool,
) {
    let begin = begin.min(piece.start).min(bytes.len());
    for (off, len) in crate::chunks(&bytes[begin..], cfg) {
        let off = begin + off;
        if off >= piece.end || off + len >= bytes.len() {
            break;
        }
        if off >= piece.start && !each(off, len) {
            break;
        }
    }
}

/// The chunk FastCDC cuts at `at` in `bytes`, if it ends before `bytes` does.
fn one_chunk(bytes: &[u8], at: usize, cfg: &CodecConfig) -> Option<usize> {
    let rest = bytes.get(at..)?;
    crate::chunks(rest, cfg)
        .next()
        .map(|(_, len)| len)
        .filter(|&len| len > 0 && at + len < bytes.len())
}

/// The true chain of chunks from the pieces' chains (each piece's from [`chain_in_piece`], in
/// order, the first begun at a boundary), as (offset, length, `T`), `make` giving a `T` for a
/// chunk cut here: the first piece's chunks, then each next piece's from where the chain so
/// far ends, when a chunk of that piece starts there. Where none does, the chain is cut on
/// here, `resync` chunks at most, until it meets one (or, past the last piece, to the end);
/// if it does not, the chain ends there (what follows is cut again later). The same chunks FastCDC cuts from the first piece's
/// start, as far as they go; returns how many were cut here.
pub fn join<T>(
    bytes: &[u8],
    cfg: &CodecConfig,
    pieces: &mut [Vec<(usize, usize, T)>],
    resync: usize,
    out: &mut Vec<(usize, usize, T)>,
    mut make: impl FnMut(usize, usize) -> T,
) -> usize {
    let mut here = 0;
    let Some((first, rest)) = pieces.split_first_mut() else {
        return 0;
    };
    out.append(first);
    let Some(&(o, l, _)) = out.last() else {
        return 0;
    };
    let mut end = o + l;
    let last = rest.len();
    for (k, p) in rest.iter_mut().enumerate() {
        let mut tries = 0;
        loop {
            let i = p.partition_point(|c| c.0 < end);
            match p.get(i) {
                // The chain passed every chunk of this piece (one shorter than a chunk): the
                // next piece's may meet it. After the last, it is cut on here.
                None if k + 1 < last => break,
                Some(c) if c.0 == end => {
                    out.extend(p.drain(i..));
                    if let Some(&(o, l, _)) = out.last() {
                        end = o + l;
                    }
                    break;
                }
                _ => {}
            }
            let Some(len) = (tries < resync)
                .then(|| one_chunk(bytes, end, cfg))
                .flatten()
            else {
                return here;
            };
            out.push((end, len, make(end, len)));
            here += 1;
            tries += 1;
            end += len;
        }
    }
    here
}

/// The pieces of `len` bytes of about `piece` bytes each (at least one, `len` 0 included).
pub fn pieces(len: usize, piece: usize) -> Vec<Range<usize>> {
    let piece = piece.max(1);
    let mut out: Vec<Range<usize>> = (0..len)
        .step_by(piece)
        .map(|s| s..(s + piece).min(len))
        .collect();
    if out.is_empty() {
        out.push(0..0);
    }
    out
}

/// The chunks of `bytes` (which start at a boundary) that end before it does, cut as chains
/// in pieces of about `piece` bytes, each begun `lookback` bytes before its piece, and joined
/// (see [`join`]), `run` running the pieces' chains (each a closure; on as many threads as it
/// likes). Returns the chunks and how many the join cut itself.
pub fn chains_in_pieces(
    bytes: &[u8],
    cfg: &CodecConfig,
    piece: usize,
    lookback: usize,
    resync: usize,
    run: impl FnOnce(&mut [Box<dyn FnMut() + Send + '_>]),
) -> (Vec<(usize, usize)>, usize) {
    let ranges = pieces(bytes.len(), piece);
    let mut found: Vec<Vec<(usize, usize, ())>> = vec![Vec::new(); ranges.len()];
    {
        let mut jobs: Vec<Box<dyn FnMut() + Send + '_>> = ranges
            .iter()
            .zip(found.iter_mut())
            .map(|(r, f)| {
                let r = r.clone();
                let begin = if r.start == 0 {
                    0
                } else {
                    r.start.saturating_sub(lookback)
                };
                Box::new(move || {
                    chain_in_piece(bytes, begin, r.clone(), cfg, |o, l| {
                        f.push((o, l, ()));
                        true
                    })
                }) as Box<dyn FnMut() + Send + '_>
            })
            .collect();
        run(&mut jobs);
    }
    let mut out = Vec::new();
    let here = join(bytes, cfg, &mut found, resync, &mut out, |_, _| ());
    (out.into_iter().map(|(o, l, ())| (o, l)).collect(), here)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fastcdc(data: &[u8], cfg: &CodecConfig) -> Vec<(usize, usize)> {
        crate::chunks(data, cfg).collect()
    }

    /// Bytes with long runs (filler, zero pages) between random stretches: every branch of the
    /// cut (strict, relaxed, the maximum, the warm start) is taken.
    fn mixed(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed | 1;
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let run = (x % 40_000) as usize;
            if x & 3 == 0 {
                out.extend(std::iter::repeat_n((x >> 8) as u8, run));
            } else {
                for _ in 0..run {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    out.push(x as u8);
                }
            }
        }
        out.truncate(len);
        out
    }

    /// FastCDC's chunks of `data` that end before it does.
    fn fastcdc_closed(data: &[u8], cfg: &CodecConfig) -> Vec<(usize, usize)> {
        let mut v = fastcdc(data, cfg);
        v.retain(|&(o, l)| o + l < data.len());
        v
    }

    fn chains(
        data: &[u8],
        cfg: &CodecConfig,
        piece: usize,
        lookback: usize,
        resync: usize,
    ) -> (Vec<(usize, usize)>, usize) {
        chains_in_pieces(data, cfg, piece, lookback, resync, |jobs| {
            jobs.iter_mut().for_each(|j| j())
        })
    }

    #[test]
    fn chains_in_pieces_give_fastcdcs_chunks_on_real_bytes_and_zeros() {
        let text = own_source();
        let cfg = CodecConfig::default();
        let want = fastcdc_closed(&text, &cfg);
        for piece in [1000, 4096, 65_536, 1 << 20] {
            for lookback in [0, 4096, cfg.max_chunk] {
                let (got, _) = chains(&text, &cfg, piece, lookback, usize::MAX);
                assert_eq!(got, want, "piece {piece} lookback {lookback}");
            }
        }
        // Zeros: every chain cuts the same lengths from where it began, so chains begun
        // apart never meet; the join cuts them all itself, or stops where told to.
        let mut zeros = vec![0u8; 1 << 20];
        zeros.extend(crate::testdata::noise(3, 200_000));
        let want = fastcdc_closed(&zeros, &cfg);
        let (got, here) = chains(&zeros, &cfg, 100_000, 1000, usize::MAX);
        assert_eq!(got, want);
        assert!(
            here > 0,
            "the join cut the chunks the pieces' chains missed"
        );
        let (got, _) = chains(&zeros, &cfg, 100_000, 1000, 2);
        assert!(
            got.len() < want.len() && want.starts_with(&got),
            "a prefix, stopped at 2 tries"
        );
    }

    /// This crate's own source: text, as real as it gets here.
    fn own_source() -> Vec<u8> {
        let mut text = Vec::new();
        for dir in ["src", "src/tests", "src/mirror", "src/decoder", "src/send"] {
            let Ok(rd) =
                std::fs::read_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir))
            else {
                continue;
            };
            let mut files: Vec<_> = rd.flatten().map(|e| e.path()).collect();
            files.sort();
            for f in files {
                if let Ok(b) = std::fs::read(&f) {
                    text.extend_from_slice(&b);
                }
            }
        }
        assert!(text.len() > 100_000, "{} bytes", text.len());
        text
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Chains begun in pieces, any piece size and lookback, joined: FastCDC's chunks (but
        /// the last, which may grow), or with few tries to meet, a prefix of them.
        #[test]
        fn chains_in_pieces_join_into_fastcdcs_chunks(
            seed in any::<u64>(),
            len in 0usize..400_000,
            piece in 1usize..200_000,
            lookback in 0usize..70_000,
            resync in prop_oneof![Just(usize::MAX), 0usize..4],
            random in any::<bool>(),
            sizes in prop_oneof![Just((4096usize, 8192usize, 32768usize)), Just((2048, 4096, 16384)), Just((64, 256, 1024))],
        ) {
            let data = if random { crate::testdata::noise(seed, len) } else { mixed(seed, len) };
            let cfg = CodecConfig { min_chunk: sizes.0, avg_chunk: sizes.1, max_chunk: sizes.2, ..CodecConfig::default() };
            let want = fastcdc_closed(&data, &cfg);
            let (got, _) = chains(&data, &cfg, piece, lookback, resync);
            if resync == usize::MAX {
                prop_assert_eq!(got, want);
            } else {
                prop_assert!(want.starts_with(&got), "{} of {}", got.len(), want.len());
            }
        }
    }
}
