//! The send half of a stream: what the application wrote and the link has not sent yet, the
//! peer's credit for the stream, the finish flags and, for an optimized stream, its coder.
//! Credit and offsets count raw (application) bytes, coded or not.

use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};

use crate::coding::SendCoder;
use crate::error::StreamError;
use crate::flow::SendCredit;
use crate::frame::StreamId;

#[derive(Debug)]
pub(crate) struct SendHalf {
    pub queue: VecDeque<Bytes>,
    /// Bytes in `queue`.
    pub queued: usize,
    pub credit: SendCredit,
    pub fin_requested: bool,
    pub fin_sent: bool,
    /// A write found the buffer full: [`Event::Writable`](crate::Event) follows when it drains.
    pub write_blocked: bool,
    /// The stream's encoder state, when its service is optimized.
    pub coder: Option<Box<SendCoder>>,
}

impl SendHalf {
    pub fn new(credit: u64, coder: Option<Box<SendCoder>>) -> Self {
        SendHalf {
            queue: VecDeque::new(),
            queued: 0,
            credit: SendCredit::new(credit),
            fin_requested: false,
            fin_sent: false,
            write_blocked: false,
            coder,
        }
    }

    /// True if the scheduler has something to send, ignoring link credit. An optimized stream's
    /// bytes wait for a chunk boundary (a whole chunk) or a flush, and for credit to cover its
    /// next chunk.
    pub fn wants_send(&self) -> bool {
        let fin_only = self.fin_requested && !self.fin_sent && self.queued == 0;
        match &self.coder {
            None => (self.queued > 0 && self.credit.available() > 0) || fin_only,
            Some(c) => {
                let ready = self.queued >= c.max_chunk || c.flush_at > self.credit.sent();
                (self.queued > 0 && ready && self.credit.available() >= self.min_credit())
                    || fin_only
            }
        }
    }

    /// Credit the next frame needs: any byte for a plain stream, its next chunk for a coded one.
    pub fn min_credit(&self) -> u64 {
        match &self.coder {
            None => 1,
            Some(c) => self.queued.min(c.max_chunk) as u64,
        }
    }

    /// How many of `want` bytes fit in a buffer of `cap` now; marks the half blocked if none.
    pub fn room(&mut self, id: StreamId, cap: usize, want: usize) -> Result<usize, StreamError> {
        if self.fin_requested {
            return Err(StreamError::Finished(id));
        }
        let n = cap.saturating_sub(self.queued).min(want);
        if n == 0 {
            self.write_blocked = want > 0;
        }
        Ok(n)
    }

    /// Queues written bytes. A latency stream never waits for a chunk boundary: what was written
    /// goes out.
    pub fn push(&mut self, chunk: Bytes, latency: bool) {
        self.queued += chunk.len();
        self.queue.push_back(chunk);
        if latency {
            self.flush_all();
        }
    }

    /// Everything queued so far must go without waiting for a boundary. Returns true if that
    /// moved the flush point (only optimized streams ever wait).
    pub fn flush_all(&mut self) -> bool {
        let end = self.credit.sent() + self.queued as u64;
        match self.coder.as_mut() {
            Some(c) if c.flush_at < end => {
                c.flush_at = end;
                true
            }
            _ => false,
        }
    }

    /// Ends the send side once the queued bytes are sent; false if it was ended already.
    pub fn finish(&mut self) -> bool {
        if self.fin_requested {
            return false;
        }
        self.fin_requested = true;
        self.flush_all();
        true
    }

    /// Moves up to `n` queued bytes into `out` (a plain `Data` frame's payload).
    pub fn take_into(&mut self, mut n: usize, out: &mut BytesMut) {
        while n > 0 {
            let Some(front) = self.queue.front_mut() else {
                break;
            };
            let take = n.min(front.len());
            out.extend_from_slice(&front[..take]);
            front.advance(take);
            if front.is_empty() {
                self.queue.pop_front();
            }
            n -= take;
        }
    }

    /// Records that a frame covering `n` raw bytes (and the end, with `fin`) went out. Returns
    /// true if a blocked writer may write again (the buffer is below `cap`).
    pub fn on_sent(&mut self, n: usize, fin: bool, cap: usize) -> bool {
        self.queued -= n;
        self.credit.consume(n as u64);
        self.fin_sent |= fin;
        let unblocked = self.write_blocked && self.queued < cap;
        if unblocked {
            self.write_blocked = false;
        }
        unblocked
    }
}
