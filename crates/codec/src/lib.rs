//! The sans-IO optimization codec: content-defined chunking (FastCDC), 128-bit BLAKE3
//! fingerprints, a symmetric chunk cache, and adaptive compression (none, LZ4, zstd).
//!
//! An [`Encoder`] turns one direction's stream bytes into records: `Ref` (a chunk the peer holds),
//! `Lit` (a new chunk, maybe compressed, that both caches then hold) and `Raw` (bytes sent as they
//! are, such as a latency flush's short tail). A [`Decoder`] rebuilds the bytes exactly; a
//! reference it cannot resolve or verify is a [`CodecError::Miss`], never wrong data. Nothing here
//! does I/O; the link integration comes with the tunnel.

pub mod cache;

use cache::{ChunkCache, Fingerprint, fingerprint};

/// Largest chunk or raw record a decoder accepts, checked before anything is allocated.
pub const MAX_RECORD: usize = 1 << 20;

const TAG_RAW: u8 = 1;
const TAG_LIT: u8 = 2;
const TAG_REF: u8 = 3;

/// Compression of a literal chunk, as carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    None,
    Lz4,
    Zstd,
}

impl Codec {
    fn to_u8(self) -> u8 {
        match self {
            Codec::None => 0,
            Codec::Lz4 => 1,
            Codec::Zstd => 2,
        }
    }
    fn from_u8(v: u8) -> Result<Self, CodecError> {
        match v {
            0 => Ok(Codec::None),
            1 => Ok(Codec::Lz4),
            2 => Ok(Codec::Zstd),
            _ => Err(CodecError::Malformed("unknown compression")),
        }
    }
}

/// The compression setting of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Lz4,
    Zstd,
    /// Choose per chunk from a cheap compressibility estimate and the link pressure.
    Adaptive,
}

/// What currently limits throughput, as the runtime sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    /// The link is the bottleneck: spend CPU on ratio (zstd).
    LinkBound,
    /// The CPU is the bottleneck: prefer the cheapest codec that pays (LZ4).
    CpuBound,
}

/// Codec settings; both sides must agree on the cache size (the link hello carries it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecConfig {
    pub min_chunk: usize,
    pub avg_chunk: usize,
    pub max_chunk: usize,
    pub cache_bytes: usize,
    pub dedup: bool,
    pub compression: Compression,
    pub zstd_level: i32,
}

impl Default for CodecConfig {
    fn default() -> Self {
        CodecConfig {
            // Measured (tests.rs): with 8 KiB average chunks a backup with 10% of its 8 KiB blocks
            // changed costs about a fifth of the first transfer; 16 KiB cost about 30%.
            min_chunk: 2 * 1024,
            avg_chunk: 8 * 1024,
            max_chunk: 32 * 1024,
            cache_bytes: 256 << 20,
            dedup: true,
            compression: Compression::Adaptive,
            zstd_level: 3,
        }
    }
}

/// A decoding failure. `Incomplete` is normal: wait for more bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("incomplete record")]
    Incomplete,
    #[error("malformed record: {0}")]
    Malformed(&'static str),
    #[error("record of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("chunk not in the cache (or damaged there)")]
    Miss(Fingerprint),
    #[error("decompression failed")]
    Decompress,
}

/// Byte and chunk counts of an encoder.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EncodeStats {
    pub raw_bytes: u64,
    pub wire_bytes: u64,
    pub hit_chunks: u64,
    pub hit_bytes: u64,
    pub miss_chunks: u64,
    pub miss_bytes: u64,
    /// Raw bytes of literal chunks sent with each codec: none, lz4, zstd.
    pub codec_bytes: [u64; 3],
}

/// One direction's encoder, holding the mirror of the peer decoder's cache.
pub struct Encoder {
    cfg: CodecConfig,
    cache: ChunkCache,
    pending: Vec<u8>,
    stats: EncodeStats,
    /// One zstd context for the encoder's life: creating one per chunk cost more than compressing.
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

impl Encoder {
    pub fn new(cfg: CodecConfig) -> Self {
        Encoder {
            cache: ChunkCache::new(cfg.cache_bytes),
            zstd: zstd::bulk::Compressor::new(cfg.zstd_level).ok(),
            cfg,
            pending: Vec::new(),
            stats: EncodeStats::default(),
        }
    }

    pub fn stats(&self) -> &EncodeStats {
        &self.stats
    }

    /// The mirror cache (for its size and evictions).
    pub fn cache(&self) -> &ChunkCache {
        &self.cache
    }

    /// Bytes held back waiting for a chunk boundary.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Takes stream bytes and appends records to `out`. Without `flush`, the bytes after the last
    /// chunk boundary wait for more data; with it (latency class, end of stream) nothing waits.
    pub fn push(&mut self, data: &[u8], flush: bool, pressure: Pressure, out: &mut Vec<u8>) {
        self.stats.raw_bytes += data.len() as u64;
        self.pending.extend_from_slice(data);
        let start = out.len();
        let mut consumed = 0;
        let pending = std::mem::take(&mut self.pending);
        let chunks: Vec<(usize, usize)> = fastcdc::v2020::FastCDC::new(
            &pending,
            self.cfg.min_chunk,
            self.cfg.avg_chunk,
            self.cfg.max_chunk,
        )
        .map(|c| (c.offset, c.length))
        .collect();
        for (i, (off, len)) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            // The last piece ends at the buffer's end, not at a content boundary: it waits, unless
            // it is a full-size chunk or the caller flushes.
            if last && !flush && *len < self.cfg.max_chunk {
                break;
            }
            let chunk = &pending[*off..off + len];
            if last && *len < self.cfg.min_chunk {
                put_raw(out, chunk);
            } else {
                self.emit_chunk(chunk, pressure, out);
            }
            consumed = off + len;
        }
        self.pending = pending[consumed..].to_vec();
        self.stats.wire_bytes += (out.len() - start) as u64;
    }

    fn emit_chunk(&mut self, chunk: &[u8], pressure: Pressure, out: &mut Vec<u8>) {
        let f = fingerprint(chunk);
        if self.cfg.dedup && self.cache.contains(&f) {
            self.cache.touch(&f);
            out.push(TAG_REF);
            out.extend_from_slice(&f);
            out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
            self.stats.hit_chunks += 1;
            self.stats.hit_bytes += chunk.len() as u64;
            return;
        }
        let codec = self.choose(chunk, pressure);
        let compressed = match codec {
            Codec::None => None,
            Codec::Lz4 => Some(lz4_flex::block::compress(chunk)),
            Codec::Zstd => self.zstd.as_mut().and_then(|z| z.compress(chunk).ok()),
        };
        out.push(TAG_LIT);
        match compressed {
            // Compression must pay for its own header (4 bytes) and then some.
            Some(c) if c.len() + 64 < chunk.len() => {
                out.push(codec.to_u8());
                out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
                out.extend_from_slice(&(c.len() as u32).to_be_bytes());
                out.extend_from_slice(&c);
                self.stats.codec_bytes[codec.to_u8() as usize] += chunk.len() as u64;
            }
            _ => {
                out.push(Codec::None.to_u8());
                out.extend_from_slice(&(chunk.len() as u32).to_be_bytes());
                out.extend_from_slice(chunk);
                self.stats.codec_bytes[0] += chunk.len() as u64;
            }
        }
        self.stats.miss_chunks += 1;
        self.stats.miss_bytes += chunk.len() as u64;
        if self.cfg.dedup {
            self.cache.insert(f, chunk.to_vec());
        }
    }

    /// Picks the codec for a chunk: a 4 KiB LZ4 trial tells incompressible data (encrypted,
    /// already compressed) apart at almost no cost; then link pressure decides between LZ4 and zstd.
    fn choose(&self, chunk: &[u8], pressure: Pressure) -> Codec {
        match self.cfg.compression {
            Compression::None => Codec::None,
            Compression::Lz4 => Codec::Lz4,
            Compression::Zstd => Codec::Zstd,
            Compression::Adaptive => {
                let sample = &chunk[..chunk.len().min(4096)];
                let trial = lz4_flex::block::compress(sample);
                if trial.len() * 100 > sample.len() * 95 {
                    Codec::None
                } else if pressure == Pressure::LinkBound {
                    Codec::Zstd
                } else {
                    Codec::Lz4
                }
            }
        }
    }
}

fn put_raw(out: &mut Vec<u8>, data: &[u8]) {
    out.push(TAG_RAW);
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

fn be32(b: &[u8]) -> usize {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
}

/// One direction's decoder with its cache.
pub struct Decoder {
    cache: ChunkCache,
    dedup: bool,
    zstd: Option<zstd::bulk::Decompressor<'static>>,
}

impl Decoder {
    pub fn new(cfg: &CodecConfig) -> Self {
        Decoder {
            cache: ChunkCache::new(cfg.cache_bytes),
            dedup: cfg.dedup,
            zstd: zstd::bulk::Decompressor::new().ok(),
        }
    }

    pub fn cache(&self) -> &ChunkCache {
        &self.cache
    }

    /// Test hook: the cache, to damage it.
    #[doc(hidden)]
    pub fn cache_mut(&mut self) -> &mut ChunkCache {
        &mut self.cache
    }

    /// Decodes the first whole record of `buf`, appending its bytes to `out`; returns how many
    /// input bytes it used. Lengths are checked before anything is allocated.
    pub fn decode_record(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<usize, CodecError> {
        let Some(&tag) = buf.first() else {
            return Err(CodecError::Incomplete);
        };
        let need = |n: usize| {
            if buf.len() < n {
                Err(CodecError::Incomplete)
            } else {
                Ok(())
            }
        };
        match tag {
            TAG_RAW => {
                need(5)?;
                let len = be32(&buf[1..5]);
                if len > MAX_RECORD {
                    return Err(CodecError::TooLarge(len));
                }
                need(5 + len)?;
                out.extend_from_slice(&buf[5..5 + len]);
                Ok(5 + len)
            }
            TAG_REF => {
                need(21)?;
                let mut f = [0u8; 16];
                f.copy_from_slice(&buf[1..17]);
                let len = be32(&buf[17..21]);
                let chunk = self.cache.get(&f).ok_or(CodecError::Miss(f))?;
                if chunk.len() != len {
                    return Err(CodecError::Malformed(
                        "reference length differs from the chunk",
                    ));
                }
                out.extend_from_slice(chunk);
                Ok(21)
            }
            TAG_LIT => {
                need(6)?;
                let codec = Codec::from_u8(buf[1])?;
                let raw_len = be32(&buf[2..6]);
                if raw_len > MAX_RECORD {
                    return Err(CodecError::TooLarge(raw_len));
                }
                let (chunk, used) = if codec == Codec::None {
                    need(6 + raw_len)?;
                    (buf[6..6 + raw_len].to_vec(), 6 + raw_len)
                } else {
                    need(10)?;
                    let clen = be32(&buf[6..10]);
                    if clen > MAX_RECORD {
                        return Err(CodecError::TooLarge(clen));
                    }
                    need(10 + clen)?;
                    let payload = &buf[10..10 + clen];
                    // Decompression is bounded by the announced size: a bomb is an error.
                    let chunk = match codec {
                        Codec::Lz4 => lz4_flex::block::decompress(payload, raw_len)
                            .map_err(|_| CodecError::Decompress)?,
                        _ => self
                            .zstd
                            .as_mut()
                            .ok_or(CodecError::Decompress)?
                            .decompress(payload, raw_len)
                            .map_err(|_| CodecError::Decompress)?,
                    };
                    if chunk.len() != raw_len {
                        return Err(CodecError::Decompress);
                    }
                    (chunk, 10 + clen)
                };
                out.extend_from_slice(&chunk);
                if self.dedup {
                    self.cache.insert(fingerprint(&chunk), chunk);
                }
                Ok(used)
            }
            _ => Err(CodecError::Malformed("unknown record")),
        }
    }

    /// Decodes every whole record at the front of `buf`; returns the bytes used.
    pub fn decode(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<usize, CodecError> {
        let mut used = 0;
        loop {
            match self.decode_record(&buf[used..], out) {
                Ok(n) => used += n,
                Err(CodecError::Incomplete) => return Ok(used),
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests;
