//! What encoding reports: how each chunk was sent ([`Sent`], [`Report`]) and the counts of a
//! stream or a link ([`EncodeStats`]).

use crate::config::Codec;

/// How one chunk was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    /// As a reference to a chunk the peer holds.
    Ref,
    /// As data, with this codec.
    Lit(Codec),
    /// As a delta against similar chunks the peer holds.
    Delta,
    /// As raw bytes, not cached.
    Raw,
    /// Gathered into a delta run: its record comes when the run is flushed (one for the run,
    /// or a literal if the run did not pay), counted then (see `Mirror::take_late`).
    InRun,
    /// Not sent: its bases are being read from the disk tier, and the stream waits for them
    /// (see [`Policy::wait_bases`](crate::config::Policy::wait_bases)). Nothing was written.
    Wait,
}

/// What encoding one chunk did: how, raw bytes in, record bytes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub sent: Sent,
    pub raw: usize,
    pub wire: usize,
    /// Bytes written before the chunk's record for earlier chunks (a run's end, a delta run):
    /// counted with them, in the mirror's late counts (see `Mirror::take_late`).
    pub run_end: usize,
    /// A literal for which the delta index offered a base the peer holds, yet no delta went
    /// (it did not pay, the stream's context reached the base, or its bytes were on disk).
    pub no_base: bool,
}

/// Byte and chunk counts, summed from [`Report`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodeStats {
    pub raw_bytes: u64,
    pub wire_bytes: u64,
    pub hit_chunks: u64,
    pub hit_bytes: u64,
    /// The reference records' bytes: `hit_bytes` minus these is what dedup saved.
    pub hit_wire: u64,
    /// Chunks sent as data (literals), and their raw bytes.
    pub miss_chunks: u64,
    pub miss_bytes: u64,
    /// Chunks sent as deltas, their raw bytes and their records' bytes.
    pub delta_chunks: u64,
    pub delta_bytes: u64,
    pub delta_wire: u64,
    /// Raw bytes of literal chunks (and raw records, as none) sent with each codec: none, lz4, zstd.
    pub codec_bytes: [u64; 3],
    /// The record bytes they took: `codec_bytes` minus these is what each codec saved.
    pub codec_wire: [u64; 3],
    /// Literal chunks (and their raw bytes) for which the delta index offered a base but none
    /// was used: what the index found and could not turn into a delta.
    pub no_base_chunks: u64,
    pub no_base_bytes: u64,
    /// Turns a stream ended before a chunk to wait for its bases to be read from the disk
    /// tier (see [`Sent::Wait`]).
    pub base_waits: u64,
    /// Turns that wrote records: a link sends each as a frame with a header of its own.
    pub frames: u64,
    /// Turns planned while the stream's turn before still waited for its context records
    /// (see `send::emit_pending`).
    pub planned_behind: u64,
}

impl Report {
    /// A chunk that waits for its bases (see [`Sent::Wait`]).
    pub(crate) fn wait() -> Report {
        Report {
            sent: Sent::Wait,
            raw: 0,
            wire: 0,
            run_end: 0,
            no_base: false,
        }
    }
}

impl EncodeStats {
    /// Adds another set of counts.
    pub fn merge(&mut self, o: &EncodeStats) {
        self.raw_bytes += o.raw_bytes;
        self.wire_bytes += o.wire_bytes;
        self.hit_chunks += o.hit_chunks;
        self.hit_bytes += o.hit_bytes;
        self.hit_wire += o.hit_wire;
        self.miss_chunks += o.miss_chunks;
        self.miss_bytes += o.miss_bytes;
        self.delta_chunks += o.delta_chunks;
        self.delta_bytes += o.delta_bytes;
        self.delta_wire += o.delta_wire;
        self.no_base_chunks += o.no_base_chunks;
        self.no_base_bytes += o.no_base_bytes;
        self.base_waits += o.base_waits;
        self.frames += o.frames;
        self.planned_behind += o.planned_behind;
        for (a, b) in self.codec_bytes.iter_mut().zip(o.codec_bytes) {
            *a += b;
        }
        for (a, b) in self.codec_wire.iter_mut().zip(o.codec_wire) {
            *a += b;
        }
    }

    /// Adds one chunk's report.
    pub fn add(&mut self, r: &Report) {
        let raw = r.raw as u64;
        self.raw_bytes += raw;
        self.wire_bytes += r.wire as u64;
        match r.sent {
            Sent::Ref => {
                self.hit_chunks += 1;
                self.hit_bytes += raw;
                self.hit_wire += r.wire as u64;
            }
            Sent::Delta => {
                self.delta_chunks += 1;
                self.delta_bytes += raw;
                self.delta_wire += r.wire as u64;
            }
            Sent::Lit(c) => {
                self.miss_chunks += 1;
                self.miss_bytes += raw;
                self.codec_bytes[c.index()] += raw;
                self.codec_wire[c.index()] += r.wire as u64;
                if r.no_base {
                    self.no_base_chunks += 1;
                    self.no_base_bytes += raw;
                }
            }
            Sent::Raw => {
                self.codec_bytes[0] += raw;
                self.codec_wire[0] += r.wire as u64;
            }
            Sent::InRun => {}
            Sent::Wait => self.base_waits += 1,
        }
    }

    /// Adds a run's end: zstd output of literals counted already.
    pub fn add_run_end(&mut self, wire: usize) {
        self.wire_bytes += wire as u64;
        self.codec_wire[Codec::Zstd.index()] += wire as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_add_up_by_how_each_chunk_went_and_merge() {
        let r = |sent, raw, wire| Report {
            sent,
            raw,
            wire,
            run_end: 0,
            no_base: false,
        };
        let mut s = EncodeStats::default();
        s.add(&r(Sent::Ref, 8192, 20));
        s.add(&r(Sent::Lit(Codec::Lz4), 8192, 3000));
        s.add(&r(Sent::Delta, 8192, 100));
        s.add(&Report {
            no_base: true,
            ..r(Sent::Lit(Codec::Zstd), 4096, 1000)
        });
        s.add(&Report {
            run_end: 50,
            ..r(Sent::Raw, 10, 12)
        });
        s.add_run_end(50);
        // Gathered into a delta run: its raw bytes now, its record's when the run goes.
        s.add(&r(Sent::InRun, 8192, 0));
        // A chunk that waited for its bases: nothing sent yet, a wait counted.
        s.add(&Report::wait());
        assert_eq!(s.base_waits, 1);
        assert_eq!(
            (s.raw_bytes, s.wire_bytes),
            (4 * 8192 + 4096 + 10, 20 + 3000 + 100 + 1000 + 12 + 50)
        );
        assert_eq!((s.hit_chunks, s.miss_chunks, s.delta_chunks), (1, 2, 1));
        assert_eq!(s.codec_wire, [12, 3000, 1050]);
        assert_eq!((s.no_base_chunks, s.no_base_bytes), (1, 4096));
        let mut twice = s.clone();
        twice.merge(&s);
        assert_eq!(twice.wire_bytes, 2 * s.wire_bytes);
        assert_eq!(twice.codec_bytes[1], 2 * 8192);
    }
}
