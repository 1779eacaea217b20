//! What the application reads of a stream: its received bytes taken in order, a piece or
//! several at a time, each taken one giving the peer its credit back (the stream's and the
//! link's window); then the stream's end.

use std::collections::VecDeque;

use bytes::Bytes;

use super::{Link, ReadOutcome, State};
use crate::error::StreamError;
use crate::frame::{Frame, StreamId};
use crate::lane::MAIN_LANE;

/// On a resumable link, a stream's consumption is confirmed (a `MaxData`) at least every this
/// many bytes, so the sender's kept bytes stay small however many streams are open.
const ACK_EVERY: u64 = 64 * 1024;

impl Link {
    /// Takes the next received bytes of a stream, returning credit to the peer.
    pub fn read(&mut self, id: StreamId) -> Result<ReadOutcome, StreamError> {
        let s = self.streams.get_mut(&id).ok_or(StreamError::Unknown(id))?;
        if let Some(b) = s.recv.queue.pop_front() {
            self.consumed(id, b.len());
            return Ok(ReadOutcome::Data(b));
        }
        let s = self.streams.get_mut(&id).ok_or(StreamError::Unknown(id))?;
        if s.recv.fin_ready() {
            s.recv.read_done = true;
            self.maybe_remove(id);
            return Ok(ReadOutcome::Fin);
        }
        if self.state == State::Closed {
            return Err(StreamError::LinkClosed);
        }
        Ok(ReadOutcome::Blocked)
    }

    /// Takes more of what a stream received, as [`read`](Self::read) does, while it has bytes
    /// waiting: up to `pieces` of them, and no more once `bytes` are taken (for one vectored
    /// write). Never its end: [`read`](Self::read) says that, once every byte is taken. How
    /// many pieces it took.
    pub fn read_more(
        &mut self,
        id: StreamId,
        into: &mut VecDeque<Bytes>,
        pieces: usize,
        bytes: usize,
    ) -> usize {
        let (mut n, mut taken) = (0, 0);
        while n < pieces && taken < bytes {
            let Some(b) = self
                .streams
                .get_mut(&id)
                .and_then(|s| s.recv.queue.pop_front())
            else {
                break;
            };
            self.consumed(id, b.len());
            taken += b.len();
            into.push_back(b);
            n += 1;
        }
        n
    }

    /// `n` bytes of stream `id` were read: credit back to the peer, for the stream and the link.
    fn consumed(&mut self, id: StreamId, n: usize) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let n = n as u64;
        // A resumable peer keeps what we have not confirmed: confirm it often.
        let every = if self.resumable { ACK_EVERY } else { u64::MAX };
        if let Some(max) = s.recv.window.on_consume_every(n, every)
            && !s.recv.fin_received
        {
            self.ctrl[s.lane].push_back(Frame::MaxData { stream: id, max });
        }
        if let Some(max) = self.link_window.on_consume(n) {
            self.ctrl[MAIN_LANE].push_back(Frame::MaxData {
                stream: StreamId::LINK,
                max,
            });
        }
    }
}
