//! A context record on the receiving side: its payload fed to the stream's zstd context, which
//! rebuilds what the sender compressed in it, bounded by what the record announced. Nothing here
//! touches the cache, so a stream's context records can be fed on a worker (see `ahead.rs`)
//! while the decoder's thread rebuilds other streams' records.

use super::Decoder;
use crate::context::{
    CONTEXT_WINDOW_LOG, DECODER_CONTEXTS, LongContext, Run, Slots, StreamContext,
};
use crate::format::{
    CodecError, DEFERRED, FRESH, LONG, NO_CACHE, RUN_MAX_DECODE, TAG_LIT, TAG_LIT_CONTEXT,
    TAG_LIT_LZ4, TAG_LIT_ZSTD, TAG_RUN_END, get_len,
};

/// What a decoder accepts of stream contexts: the short ones counted in `contexts`, the long
/// ones it was offered (counted in their own slots), and whether it caches what they rebuild.
#[derive(Debug, Clone, Default)]
pub(crate) struct Accept {
    pub(crate) contexts: Slots,
    pub(crate) long: Option<(LongContext, Slots)>,
    pub(crate) dedup: bool,
}

/// A record's tag with its flags taken off, whether what it rebuilds is cached, and whether it
/// starts a fresh context.
pub(crate) fn classify(first: u8, dedup: bool) -> (u8, bool, bool) {
    match first {
        TAG_LIT | TAG_LIT_LZ4 | TAG_LIT_ZSTD | TAG_LIT_CONTEXT => (first, dedup, false),
        t if t & NO_CACHE != 0 && matches!(t & !NO_CACHE, TAG_LIT | TAG_LIT_LZ4 | TAG_LIT_ZSTD) => {
            (t & !NO_CACHE, false, false)
        }
        t if t & !(NO_CACHE | FRESH | LONG | DEFERRED) == TAG_LIT_CONTEXT
            && (t & LONG == 0 || t & FRESH != 0) =>
        {
            (TAG_LIT_CONTEXT, dedup && t & NO_CACHE == 0, t & FRESH != 0)
        }
        t => (t, false, false),
    }
}

/// The context record (or run end) at the front of `buf`, whose first byte is `first`, fed to
/// `stream`'s context: returns the bytes it used and, once its run is whole, the run (its
/// names not found yet). `room` is what the frame announced and its records before this one
/// did not rebuild: a run that would rebuild more is refused before anything is decompressed.
pub(crate) fn context_record(
    first: u8,
    buf: &[u8],
    stream: &mut StreamContext,
    room: usize,
    accept: &Accept,
) -> Result<(usize, Option<Run>), CodecError> {
    let (tag, cache, fresh) = classify(first, accept.dedup);
    let (raw_len, h1) = if tag == TAG_RUN_END {
        (0, 0)
    } else {
        get_len(buf, 1)?
    };
    let (clen, h2) = get_len(buf, 1 + h1)?;
    let at = 1 + h1 + h2;
    if buf.len() < at + clen {
        return Err(CodecError::Incomplete);
    }
    let payload = &buf[at..at + clen];
    let deferred = tag == TAG_LIT_CONTEXT && first & DEFERRED != 0;
    if tag == TAG_RUN_END && stream.run.is_empty() {
        return Err(CodecError::Malformed("a run end without a run"));
    }
    if fresh && !stream.run.is_empty() {
        return Err(CodecError::Malformed("a fresh context inside a run"));
    }
    // The run's chunks and this one: all rebuilt from this record on, within what the frame
    // announced and what a run may hold.
    let total = stream.run.iter().map(|r| r.0).sum::<usize>() + raw_len;
    if total > RUN_MAX_DECODE {
        return Err(CodecError::Malformed("run longer than a receiver accepts"));
    }
    if total > room {
        return Err(CodecError::Malformed(
            "record rebuilds more than its frame announced",
        ));
    }
    let long = first & LONG != 0;
    feed(
        payload,
        total,
        !deferred,
        fresh.then_some(long),
        stream,
        accept,
    )?;
    if tag == TAG_LIT_CONTEXT {
        stream.run.push((raw_len, cache));
    }
    if deferred {
        return Ok((at + clen, None));
    }
    let run = Run {
        bytes: std::mem::take(&mut stream.run_bytes),
        chunks: std::mem::take(&mut stream.run),
    };
    Ok((at + clen, Some(run)))
}

/// Feeds a context record's `payload` to `stream`'s context (a new one when `fresh` is `Some`,
/// a long one if it says so), appending what it rebuilds to the stream's run bytes, which may
/// grow to `limit` bytes and no further. With `complete` the payload must bring them to exactly
/// `limit`, and nothing beyond may be left in the context, or the next record would start with
/// this one's bytes. A window larger than the context's is refused by zstd before it
/// allocates; `limit` is checked against [`RUN_MAX_DECODE`] by the caller.
pub(crate) fn feed(
    payload: &[u8],
    limit: usize,
    complete: bool,
    fresh: Option<bool>,
    stream: &mut StreamContext,
    accept: &Accept,
) -> Result<(), CodecError> {
    use zstd::zstd_safe::{DCtx, DParameter, InBuffer, OutBuffer};
    debug_assert!(limit <= RUN_MAX_DECODE.max(crate::format::MAX_RECORD));
    if let Some(long) = fresh {
        stream.dctx = None;
        let (permit, window_log) = if long {
            let (l, slots) = accept
                .long
                .as_ref()
                .ok_or(CodecError::Malformed("a long context was not offered"))?;
            let permit = slots
                .take(l.streams * 2)
                .ok_or(CodecError::Malformed("too many long compression contexts"))?;
            (permit, l.window_log)
        } else {
            let permit = accept
                .contexts
                .take(DECODER_CONTEXTS)
                .ok_or(CodecError::Malformed("too many compression contexts"))?;
            (permit, CONTEXT_WINDOW_LOG)
        };
        let mut dctx = DCtx::try_create().ok_or(CodecError::Decompress)?;
        dctx.set_parameter(DParameter::WindowLogMax(window_log))
            .map_err(|_| CodecError::Decompress)?;
        stream.dctx = Some((dctx, permit));
    }
    let Some((dctx, _)) = stream.dctx.as_mut() else {
        return Err(CodecError::Malformed("context record without a context"));
    };
    let start = stream.run_bytes.len();
    if start > limit {
        return Err(CodecError::Malformed("run longer than announced"));
    }
    // Written in place of the spare room, not zeroed first: a pass over every byte less. zstd
    // may fill the whole room (more than `limit` if the buffer had more), which is refused.
    stream.run_bytes.reserve(limit - start);
    let mut input = InBuffer::around(payload);
    let mut output = OutBuffer::around_pos(&mut stream.run_bytes, start);
    let result = loop {
        // Checked before zstd is called: a deferred record may carry nothing, and zstd counts
        // calls without input against the stream.
        if input.pos() == payload.len() && (!complete || output.pos() == limit) {
            if !complete {
                break Ok(());
            }
            // Anything more would spill into the next record.
            let mut probe = [0u8; 1];
            let mut more = OutBuffer::around(&mut probe[..]);
            let mut none = InBuffer::around(&[]);
            break match dctx.decompress_stream(&mut more, &mut none) {
                Ok(_) if more.pos() == 0 => Ok(()),
                _ => Err(CodecError::Decompress),
            };
        }
        let before = (input.pos(), output.pos());
        if dctx.decompress_stream(&mut output, &mut input).is_err() || output.pos() > limit {
            break Err(CodecError::Decompress);
        }
        if (input.pos(), output.pos()) == before {
            break Err(CodecError::Decompress);
        }
    };
    if result.is_err() {
        // The context is out of step now: later records of it fail too, until a fresh one.
        stream.dctx = None;
        stream.run.clear();
        stream.run_bytes.clear();
    }
    result
}

impl Decoder {
    /// [`feed`] with this decoder's contexts.
    #[cfg(test)]
    pub(crate) fn feed_context(
        &mut self,
        payload: &[u8],
        limit: usize,
        complete: bool,
        fresh: Option<bool>,
        stream: &mut StreamContext,
    ) -> Result<(), CodecError> {
        feed(payload, limit, complete, fresh, stream, &self.accept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CodecConfig;
    use crate::mirror::{Hint, Mirror};

    /// What a mirror compressed in a stream's context is rebuilt by feeding it to the stream's
    /// context on this side, exactly to the announced length; garbage fails and leaves no
    /// context behind.
    #[test]
    fn a_context_payload_rebuilds_what_the_mirror_compressed() {
        let mut m = Mirror::new(1 << 20, 1 << 20, 3);
        let mut hint = Hint::default();
        let page = vec![7u8; 4096];
        let payload = m
            .compress_in_context(&page, &mut hint, false)
            .expect("a context");
        let mut dec = Decoder::new(&CodecConfig::default());
        let mut s = StreamContext::default();
        dec.feed_context(&payload, page.len(), true, Some(false), &mut s)
            .expect("rebuilt");
        assert_eq!(s.run_bytes, page);
        let mut bad = StreamContext::default();
        assert!(
            dec.feed_context(&[0xff; 16], 4096, true, Some(false), &mut bad)
                .is_err()
        );
        assert!(bad.dctx.is_none(), "a failed context is dropped");
    }
}
