//! FastCDC's cut points found in pieces (issue 36): the same chunks as [`crate::chunks`], with
//! the costly part, hashing every byte, split into pieces that can run on several cores.
//!
//! FastCDC (v2020, normalization level 1, as `fastcdc::v2020::FastCDC::new` runs it) hashes a
//! chunk's bytes from `min_chunk` on with the gear hash `h = (h << 1) + GEAR[byte]` and cuts
//! before the first byte `q` where `h & mask == 0`: the strict mask below the average size, the
//! relaxed one above, `max_chunk` at most. Its two-bytes-a-step loop tests the same condition
//! at every byte (the even steps test `(h << 1) & (mask << 1)`, the same bits, as no mask has
//! bit 63). Both masks lie within the low 48 bits, and bit `k` of `h` depends only on the last
//! `k + 1` bytes, so whether a byte passes depends on the 48 bytes ending at it and not on where
//! its chunk began: except in the first 47 bytes hashed in a chunk, where fewer bytes have gone
//! in. So:
//! - [`candidates`] finds, in any piece of the data on its own, every byte whose 48-byte window
//!   passes either mask, flagged with which;
//! - [`select`] walks the chunks in order: the first 47 bytes hashed in each are hashed as
//!   FastCDC hashes them, the rest come from the candidates.

use std::ops::Range;

use crate::config::CodecConfig;

/// The window a byte's test depends on: the masks' highest bit is 47.
const WINDOW: usize = 48;

/// A byte whose window passes a mask: its offset in the data, and which masks it passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub at: usize,
    pub strict: bool,
    pub relaxed: bool,
}

/// The masks and gear table FastCDC uses for `cfg`.
#[derive(Debug, Clone)]
pub struct Masks {
    strict: u64,
    relaxed: u64,
    gear: [u64; 256],
    /// FastCDC's table was 256 entries long, as it always is.
    whole: bool,
    min: usize,
    avg: usize,
    max: usize,
}

impl Masks {
    pub fn new(cfg: &CodecConfig) -> Masks {
        let (strict, relaxed) =
            fastcdc::v2020::select_masks(cfg.avg_chunk, fastcdc::v2020::Normalization::Level1);
        let (table, _) = fastcdc::v2020::get_gear_with_seed(0);
        let mut gear = [0u64; 256];
        let whole = table.len() == gear.len();
        for (g, t) in gear.iter_mut().zip(table.iter()) {
            *g = *t;
        }
        Masks {
            strict,
            relaxed,
            gear,
            whole,
            min: cfg.min_chunk,
            avg: cfg.avg_chunk,
            max: cfg.max_chunk,
        }
    }

    /// Whether the masks fit what this module assumes (the low 48 bits); the callers fall back
    /// to [`crate::chunks`] if not.
    pub fn windowed(&self) -> bool {
        self.strict >> WINDOW == 0 && self.relaxed >> WINDOW == 0 && self.whole
    }

    fn gear(&self, b: u8) -> u64 {
        self.gear[usize::from(b)]
    }
}

/// The candidates among the bytes of `piece` (offsets in `data`), in order. Any split of the
/// data into pieces gives, put together, the candidates of the whole.
pub fn candidates(data: &[u8], piece: Range<usize>, m: &Masks) -> Vec<Candidate> {
    let end = piece.end.min(data.len());
    let from = piece.start.min(end);
    // Warm the hash on the bytes before the piece; a byte is a candidate only once its whole
    // window went in (the first 47 bytes of the data never are: they lie in a chunk's minimum).
    let warm = from.saturating_sub(WINDOW - 1);
    let mut h: u64 = 0;
    let mut out = Vec::with_capacity((end - from) >> 11);
    for (p, &b) in data[warm..end].iter().enumerate() {
        let p = warm + p;
        h = (h << 1).wrapping_add(m.gear(b));
        let (strict, relaxed) = (h & m.strict == 0, h & m.relaxed == 0);
        if (strict || relaxed) && p >= from && p + 1 >= warm + WINDOW {
            out.push(Candidate {
                at: p,
                strict,
                relaxed,
            });
        }
    }
    out
}

/// Pieces scanned side by side on one thread by [`candidates_side_by_side`].
pub const LANES: usize = 4;

/// The candidates of [`LANES`] pieces at once, on one thread: each piece's hash waits on its
/// own last step, so advancing several side by side lets the CPU overlap them (one piece at a
/// time is bound by that chain, as FastCDC's own loop is). The same as [`candidates`] of each.
pub fn candidates_side_by_side(
    data: &[u8],
    pieces: &[Range<usize>; LANES],
    m: &Masks,
) -> [Vec<Candidate>; LANES] {
    let lane = pieces.clone().map(|p| {
        let end = p.end.min(data.len());
        let from = p.start.min(end);
        (from.saturating_sub(WINDOW - 1), from, end)
    });
    // The length all lanes scan together; each lane's rest goes on its own after.
    let common = lane.iter().map(|(w, _, e)| e - w).min().unwrap_or(0);
    let [s0, s1, s2, s3] = lane.map(|(w, _, _)| &data[w..w + common]);
    let either = m.strict & m.relaxed;
    let g = &m.gear;
    let mut out: [Vec<Candidate>; LANES] = Default::default();
    let (mut h0, mut h1, mut h2, mut h3) = (0u64, 0u64, 0u64, 0u64);
    let bytes = s0.iter().zip(s1).zip(s2).zip(s3);
    for (k, (((&b0, &b1), &b2), &b3)) in bytes.enumerate() {
        h0 = (h0 << 1).wrapping_add(g[usize::from(b0)]);
        h1 = (h1 << 1).wrapping_add(g[usize::from(b1)]);
        h2 = (h2 << 1).wrapping_add(g[usize::from(b2)]);
        h3 = (h3 << 1).wrapping_add(g[usize::from(b3)]);
        // Either mask passing needs the bits they share clear: one cheap test for all lanes,
        // rarely passed.
        if ((h0 & either) == 0) | ((h1 & either) == 0) | ((h2 & either) == 0) | ((h3 & either) == 0)
        {
            for (i, h) in [h0, h1, h2, h3].into_iter().enumerate() {
                let (warm, from, _) = lane[i];
                let p = warm + k;
                let (strict, relaxed) = (h & m.strict == 0, h & m.relaxed == 0);
                if (strict || relaxed) && p >= from && p + 1 >= warm + WINDOW {
                    out[i].push(Candidate {
                        at: p,
                        strict,
                        relaxed,
                    });
                }
            }
        }
    }
    for (i, (warm, from, end)) in lane.into_iter().enumerate() {
        let rest = (warm + common).max(from);
        if rest < end {
            let more = candidates(data, rest..end, m);
            out[i].extend(more);
        }
    }
    out
}

/// The candidates of `pieces`, in order, [`LANES`] at a time side by side.
pub fn candidates_of(data: &[u8], pieces: &[Range<usize>], m: &Masks) -> Vec<Vec<Candidate>> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut groups = pieces.chunks_exact(LANES);
    for g in groups.by_ref() {
        if let Ok(g) = <&[Range<usize>; LANES]>::try_from(g) {
            out.extend(candidates_side_by_side(data, g, m));
        }
    }
    for p in groups.remainder() {
        out.push(candidates(data, p.clone(), m));
    }
    out
}

/// The chunks of `data` as (offset, length), from its candidates (all of them, in order): the
/// same as [`crate::chunks`] gives. The last chunk ends at the end of `data`.
pub fn select(data: &[u8], cands: &[Candidate], m: &Masks) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(data.len() / m.avg.max(1) + 1);
    let mut start = 0;
    let mut next = 0; // the first candidate not before `start`
    while start < data.len() {
        let len = chunk_len(data, start, cands, &mut next, m);
        out.push((start, len));
        start += len;
    }
    out
}

/// The length of the chunk at `start`, as FastCDC's `cut_gear` finds it.
fn chunk_len(data: &[u8], start: usize, cands: &[Candidate], next: &mut usize, m: &Masks) -> usize {
    let mut remaining = data.len() - start;
    if remaining <= m.min {
        return remaining;
    }
    let mut center = m.avg;
    if remaining > m.max {
        remaining = m.max;
    } else if remaining < center {
        center = remaining;
    }
    // FastCDC tests bytes two at a time: the strict mask for q < 2 * (center / 2), the relaxed
    // one up to 2 * (remaining / 2), each test at q cutting before q.
    let strict_end = 2 * (center / 2);
    let relaxed_end = 2 * (remaining / 2);
    let first = m.min;
    // The first bytes hashed, whose hash holds fewer than a window's bytes: hashed here.
    let warm_end = (first + WINDOW - 1).min(relaxed_end);
    let mut h: u64 = 0;
    for q in first..warm_end {
        h = (h << 1).wrapping_add(m.gear(data[start + q]));
        let mask = if q < strict_end { m.strict } else { m.relaxed };
        if h & mask == 0 {
            return q;
        }
    }
    // The rest: the candidates, whose windows are whole here.
    while *next < cands.len() && cands[*next].at < start + warm_end {
        *next += 1;
    }
    let mut i = *next;
    while let Some(c) = cands.get(i) {
        let q = c.at - start;
        if q >= relaxed_end {
            break;
        }
        if (q < strict_end && c.strict) || (q >= strict_end && c.relaxed) {
            return q;
        }
        i += 1;
    }
    remaining
}

/// The chunks of `data` found in pieces of about `piece` bytes, each piece's candidates by
/// `find` (which may run them on several threads; it gets every piece and returns their
/// candidates in the same order): the same chunks as [`crate::chunks`].
pub fn chunks_in_pieces(
    data: &[u8],
    cfg: &CodecConfig,
    piece: usize,
    find: impl FnOnce(&[Range<usize>], &Masks) -> Vec<Vec<Candidate>>,
) -> Vec<(usize, usize)> {
    let m = Masks::new(cfg);
    if !m.windowed() {
        return crate::chunks(data, cfg).collect();
    }
    let piece = piece.max(WINDOW);
    let pieces: Vec<Range<usize>> = (0..data.len())
        .step_by(piece)
        .map(|s| s..(s + piece).min(data.len()))
        .collect();
    let found = find(&pieces, &m);
    let all: Vec<Candidate> = found.into_iter().flatten().collect();
    select(data, &all, &m)
}

/// [`chunks_in_pieces`] with every piece on the calling thread.
pub fn chunks_serial(data: &[u8], cfg: &CodecConfig, piece: usize) -> Vec<(usize, usize)> {
    chunks_in_pieces(data, cfg, piece, |pieces, m| {
        pieces
            .iter()
            .map(|p| candidates(data, p.clone(), m))
            .collect()
    })
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

    #[test]
    fn side_by_side_finds_what_one_by_one_finds() {
        let m = Masks::new(&CodecConfig::default());
        let data = mixed(7, 300_000);
        for pieces in [
            [0..1000, 1000..70_000, 70_000..70_001, 80_000..300_000],
            [5..5, 100..50_000, 0..300_000, 299_990..400_000],
        ] {
            let got = candidates_side_by_side(&data, &pieces, &m);
            for (g, p) in got.iter().zip(pieces.iter()) {
                assert_eq!(*g, candidates(&data, p.clone(), &m), "{p:?}");
            }
        }
    }

    #[test]
    fn the_default_masks_fit_the_window() {
        assert!(Masks::new(&CodecConfig::default()).windowed());
    }

    #[test]
    fn pieces_give_the_same_chunks_on_real_bytes() {
        // This crate's own source and the test data beside it: text, as real as it gets here.
        let mut text = Vec::new();
        for dir in ["src", "src/tests", "src/mirror", "src/decoder"] {
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
        let cfg = CodecConfig::default();
        let want = fastcdc(&text, &cfg);
        for piece in [48, 1000, 4096, 65_536, 1 << 20] {
            assert_eq!(chunks_serial(&text, &cfg, piece), want, "piece {piece}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any data, any piece size, any chunk sizes FastCDC accepts: the chunks of the pieces
        /// are FastCDC's.
        #[test]
        fn pieces_give_fastcdcs_chunks(
            seed in any::<u64>(),
            len in 0usize..400_000,
            piece in 1usize..200_000,
            random in any::<bool>(),
            sizes in prop_oneof![Just((4096usize, 8192usize, 32768usize)), Just((2048, 4096, 16384)), Just((8192, 16384, 65536)), Just((64, 256, 1024))],
        ) {
            let data = if random {
                let mut x = seed | 1;
                (0..len).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect::<Vec<u8>>()
            } else {
                mixed(seed, len)
            };
            let cfg = CodecConfig { min_chunk: sizes.0, avg_chunk: sizes.1, max_chunk: sizes.2, ..CodecConfig::default() };
            prop_assume!(Masks::new(&cfg).windowed());
            prop_assert_eq!(chunks_serial(&data, &cfg, piece), fastcdc(&data, &cfg));
        }
    }
}
