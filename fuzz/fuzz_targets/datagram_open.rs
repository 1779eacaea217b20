//! Fuzzes the latency lane's datagrams: arbitrary bytes must be refused by the opener without a
//! panic, and pieces at arbitrary offsets and lengths (what an authenticated but hostile peer
//! could seal) must merge without a panic, holding at most the merge's limits, while the bytes
//! it delivers stay the bytes the lane's own copy brings.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use wanopt_proto::copies::{Merge, PIECES_LIMIT};
use wanopt_proto::datagram::{Opener, Sealer};

const HOLD: usize = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let key = [9u8; 32];
    let mut opener = Opener::new(&key, 1);
    let mut raw = data.to_vec();
    assert!(opener.open(&mut raw).is_err(), "unsealed bytes never open");

    // The lane's true bytes: the input itself. A copy brings them in order; sealed pieces of
    // them, or of garbage at the same offsets, come in between.
    let mut sealer = Sealer::new(&key, 1);
    let mut merge = Merge::new(HOLD);
    merge.attach(0, 0).expect("attach");
    let mut out = BytesMut::new();
    let mut copy_at = 0usize;
    // With the first bit clear every piece is of the true bytes, and so is all that is
    // delivered; otherwise some pieces are garbage a hostile peer sealed.
    let all_honest = data.first().is_some_and(|b| b & 1 == 0);
    let mut i = 0usize;
    while i + 4 <= data.len() {
        let offset = u64::from(u16::from_be_bytes([data[i], data[i + 1]])) * 7;
        let len = usize::from(data[i + 2]) * 11;
        let honest = all_honest || data[i + 3] & 1 == 0;
        i += 4;
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        let end = start.saturating_add(len).min(data.len());
        let piece: Vec<u8> = if honest {
            data[start..end].to_vec()
        } else {
            vec![0xA5; len]
        };
        for mut d in sealer.seal(offset, &piece) {
            if let Ok((at, bytes, _)) = opener.open(&mut d) {
                let before = out.len();
                let n = merge.piece(at, bytes, &mut out);
                assert_eq!(n, out.len() - before);
            }
        }
        assert!(merge.held_bytes() <= PIECES_LIMIT + HOLD);
        // The copy moves on by a step.
        let step = usize::from(data[i - 1] >> 1).min(data.len() - copy_at);
        if merge
            .input(0, &data[copy_at..copy_at + step], &mut out)
            .is_err()
        {
            return;
        }
        copy_at += step;
        assert_eq!(merge.delivered() as usize, out.len());
    }
    let _ = merge.input(0, &data[copy_at..], &mut out);
    assert_eq!(merge.delivered() as usize, out.len());
    if all_honest {
        assert_eq!(&out[..], &data[..out.len()]);
    }
});
