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
    /// With resumption: every byte written from `kept_from` on (sent or not), until the peer
    /// says it has them, so they can be sent again after a lost connection. The buffers are
    /// shared with `queue`, so unsent bytes are not held twice.
    pub kept: Option<Kept>,
    /// The peer has every byte and the end (its `Finished`, or its resume list said so).
    pub fin_acked: bool,
}

/// What a resumable stream keeps of what it wrote (see [`SendHalf::kept`]).
#[derive(Debug, Default)]
pub(crate) struct Kept {
    pub bufs: VecDeque<Bytes>,
    /// Stream offset of the first kept byte.
    pub from: u64,
    /// Bytes in `bufs`.
    pub len: usize,
    /// The peer's stream window when the stream opened: its limit minus this is what it
    /// consumed at least.
    pub peer_window: u64,
}

impl Kept {
    /// Forgets what lies below `offset` (the peer has it).
    pub fn release(&mut self, offset: u64) {
        while self.from < offset {
            let Some(front) = self.bufs.front_mut() else {
                break;
            };
            let n = (offset - self.from).min(front.len() as u64) as usize;
            front.advance(n);
            self.from += n as u64;
            self.len -= n;
            if front.is_empty() {
                self.bufs.pop_front();
            }
        }
    }

    /// The kept bytes from `offset` on, as buffers to queue again; `None` if they are not all
    /// kept.
    pub fn bytes_from(&self, offset: u64) -> Option<VecDeque<Bytes>> {
        let mut skip = usize::try_from(offset.checked_sub(self.from)?).ok()?;
        if skip > self.len {
            return None;
        }
        let mut out = VecDeque::new();
        for b in &self.bufs {
            if skip >= b.len() {
                skip -= b.len();
                continue;
            }
            out.push_back(b.slice(skip..));
            skip = 0;
        }
        Some(out)
    }
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
            kept: None,
            fin_acked: false,
        }
    }

    /// Stream offset just past the last byte written.
    pub fn end(&self) -> u64 {
        self.credit.sent() + self.queued as u64
    }

    /// True once nothing of this half can be asked for again: its end went out and, with
    /// resumption, the peer confirmed it.
    pub fn finished(&self) -> bool {
        self.fin_sent && (self.kept.is_none() || self.fin_acked)
    }

    /// The peer granted up to `max`: with resumption, what it consumed is let go.
    pub fn on_max_data(&mut self, max: u64) {
        if let Some(k) = self.kept.as_mut() {
            let consumed = max.saturating_sub(k.peer_window).min(self.credit.sent());
            k.release(consumed);
        }
    }

    /// The peer has everything up to `offset` and the end: returns false if that is more than
    /// we sent (a protocol violation).
    pub fn on_finished(&mut self, offset: u64) -> bool {
        if !self.fin_sent || offset != self.credit.sent() {
            return false;
        }
        self.fin_acked = true;
        if let Some(k) = self.kept.as_mut() {
            k.release(offset);
        }
        true
    }

    /// After a lost connection: the peer received `received` bytes and grants up to `max`.
    /// What it lacks is queued again (for an optimized stream, with a fresh coder); false if
    /// that is not possible (more than we sent, or less than it had confirmed).
    pub fn rewind(
        &mut self,
        received: u64,
        max: u64,
        fin: bool,
        coder: Option<Box<SendCoder>>,
    ) -> bool {
        let end = self.end();
        let Some(k) = self.kept.as_mut() else {
            return false;
        };
        if received > self.credit.sent() {
            return false;
        }
        let Some(queue) = k.bytes_from(received) else {
            return false;
        };
        k.release(received);
        if fin && !(received == end && self.fin_sent) {
            return false;
        }
        // What was plain before goes without waiting for a boundary.
        let flush_at = self.coder.as_ref().map_or(end, |c| c.sender.flush_at);
        self.queue = queue;
        self.queued = (end - received) as usize;
        self.credit.resync(received, max);
        if fin {
            self.fin_acked = true;
        } else {
            self.fin_sent = false;
        }
        self.coder = coder.map(|mut c| {
            c.sender.flush_at = flush_at;
            c
        });
        true
    }

    /// True if the scheduler has something to send, ignoring link credit. An optimized stream's
    /// bytes wait for a flush or for enough of them to make a turn (`gather`: whole chunks, and
    /// not a frame for every write of a client that writes in small pieces), and for credit to
    /// cover its next chunk.
    pub fn wants_send(&self) -> bool {
        let fin_only = self.fin_requested && !self.fin_sent && self.queued == 0;
        match &self.coder {
            None => (self.queued > 0 && self.credit.available() > 0) || fin_only,
            Some(c) => {
                let ready = self.queued >= c.gather || c.sender.flush_at > self.credit.sent();
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
        if let Some(k) = self.kept.as_mut() {
            k.len += chunk.len();
            k.bufs.push_back(chunk.clone());
        }
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
            Some(c) if c.sender.flush_at < end => {
                c.sender.flush_at = end;
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
