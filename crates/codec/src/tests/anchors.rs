//! The delta index's anchors and keys against the versions first written (one loop, a branch
//! per byte): the faster ones must find exactly the same, or a store's bases indexed before
//! would no longer be found.

use crate::delta::{
    ANCHOR_LEN, ANCHOR_LOW, ANCHOR_SHIFT, GEAR, KEY_MIN, KEY_SPAN, MAX_ANCHORS, PAD, anchors,
    collapsed_key, key,
};
use crate::testdata::noise;

/// The collapsed key as it was written first (a branch per byte).
fn collapsed_key_reference(data: &[u8]) -> Option<u64> {
    let data = &data[..data.len().min(KEY_SPAN)];
    let mut w = [0u8; ANCHOR_LEN];
    let mut n = 0;
    let mut at = 0;
    while at < data.len() {
        let b = data[at];
        if n == 0 || w[n - 1] != b {
            w[n] = b;
            n += 1;
            if n == ANCHOR_LEN {
                break;
            }
            at += 1;
            continue;
        }
        // Inside a run: eight bytes at a time.
        while data
            .get(at..at + 8)
            .is_some_and(|e| <[u8; 8]>::try_from(e).is_ok_and(|e| e == [b; 8]))
        {
            at += 8;
        }
        at += 1;
    }
    (n >= KEY_MIN).then(|| key(&w) ^ n as u64)
}

/// The one-loop version `anchors` replaced: the same anchors, slower.
fn anchors_reference(data: &[u8], out: &mut Vec<u64>) {
    out.clear();
    let end = data.len().saturating_sub(ANCHOR_LEN);
    let mut h = 0u64;
    let mut recent = [u64::MAX; 4];
    let mut run = 0;
    for (i, &b) in data[..end].iter().enumerate() {
        h = (h << 1).wrapping_add(GEAR[usize::from(b)]);
        if i > 0 && data[i - 1] == b {
            run += 1;
        } else {
            // The end of padding (a run of at least PAD bytes) is an anchor of its own, ranked
            // by its key: what follows padding is a record's own bytes.
            if run >= PAD {
                out.push(key(&data[i..i + 16]) >> 32 << 32 | i as u64);
            }
            run = 1;
        }
        let rank = if h >> ANCHOR_SHIFT == 0 {
            h >> (ANCHOR_SHIFT - 32)
        } else if h & ANCHOR_LOW == 0 {
            h >> 32
        } else {
            continue;
        };
        if !recent.contains(&h) {
            recent.rotate_right(1);
            recent[0] = h;
            // Inside a run, only its last byte: the run's bytes all have the same key.
            if data[i + 1] != b {
                out.push(rank << 32 | (i as u64 + 1));
            }
        }
    }
    if out.len() > MAX_ANCHORS {
        out.select_nth_unstable(MAX_ANCHORS);
        out.truncate(MAX_ANCHORS);
    }
    out.retain_mut(|v| {
        let at = (*v & 0xFFFF_FFFF) as usize;
        collapsed_key_reference(&data[at..])
            .map(|k| *v = k)
            .is_some()
    });
    out.sort_unstable();
    out.dedup();
}

proptest::proptest! {
    /// The two-pass anchors are the one-loop ones, on bytes of a small alphabet with runs
    /// of every length (padding, repeats, the ends of the slice) and on text rows.
    #[test]
    fn anchors_are_the_reference_ones(
        pieces in proptest::collection::vec((0u8..4, 1usize..40, proptest::bool::ANY), 0..600),
        seed in 0u64..1000,
    ) {
        let mut data = Vec::new();
        let noise = crate::testdata::noise(seed, 64 * 1024);
        for (i, (b, n, run)) in pieces.iter().enumerate() {
            if *run {
                data.extend(std::iter::repeat_n(b" 0a\xff"[usize::from(*b)], *n));
            } else {
                let at = (i * 97) % (noise.len() - 64);
                data.extend_from_slice(&noise[at..at + n]);
            }
        }
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        anchors(&data, &mut fast);
        anchors_reference(&data, &mut slow);
        proptest::prop_assert_eq!(fast, slow);
        for at in (0..data.len()).step_by(5) {
            proptest::prop_assert_eq!(
                collapsed_key(&data[at..]),
                collapsed_key_reference(&data[at..])
            );
        }
    }
}

#[test]
fn anchors_are_the_reference_ones_on_rows_and_filler() {
    let mut rows = Vec::new();
    for i in 0..2000u64 {
        rows.extend_from_slice(
            format!(
                "{i:>8}|{:>6}|{}\n",
                i * 37 % 1000,
                " ".repeat((i % 90) as usize)
            )
            .as_bytes(),
        );
    }
    let mut zeros = noise(9, 3000);
    zeros.extend(std::iter::repeat_n(0u8, 5000));
    zeros.extend_from_slice(&noise(10, 40));
    for data in [&rows[..], &zeros, &noise(11, 70_000), &[7u8; 40_000]] {
        for len in [0, 1, 31, 32, 33, 47, 48, 49, 8192, data.len()] {
            let d = &data[..len.min(data.len())];
            let (mut fast, mut slow) = (Vec::new(), Vec::new());
            anchors(d, &mut fast);
            anchors_reference(d, &mut slow);
            assert_eq!(fast, slow, "{len} bytes");
        }
    }
}
