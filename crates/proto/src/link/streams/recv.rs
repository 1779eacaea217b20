//! The receive half of a stream: bytes the peer sent that the application has not read, the
//! window we grant, the end flags and, for an optimized stream, the coded frames still waiting
//! to be decoded (a stream stalls there while a chunk it references is fetched).

use std::collections::VecDeque;

use bytes::Bytes;

use crate::coding::RecvCoded;
use crate::flow::RecvWindow;

#[derive(Debug)]
pub(crate) struct RecvHalf {
    pub queue: VecDeque<Bytes>,
    pub window: RecvWindow,
    pub fin_received: bool,
    /// The application read the end: this half is finished.
    pub read_done: bool,
    pub coded: Option<Box<RecvCoded>>,
    /// With resumption: the peer was told its end arrived (`Finished`).
    pub finished_sent: bool,
}

impl RecvHalf {
    pub fn new(window: u64) -> Self {
        RecvHalf {
            queue: VecDeque::new(),
            window: RecvWindow::new(window),
            fin_received: false,
            read_done: false,
            coded: None,
            finished_sent: false,
        }
    }

    /// After a lost connection: drops the coded frames not yet rebuilt (the peer sends their
    /// bytes again) and returns how many raw bytes they covered.
    pub fn drop_undecoded(&mut self) -> u64 {
        let Some(c) = self.coded.take() else {
            return 0;
        };
        let n = c.undecoded();
        if !c.is_empty() {
            // The end, if it came, was in the last of them.
            self.fin_received = false;
        }
        self.window.unreceive(n);
        n
    }

    /// True when the peer's end may be read: fin arrived and everything before it was rebuilt.
    pub fn fin_ready(&self) -> bool {
        self.fin_received && self.coded.as_ref().is_none_or(|c| c.is_empty())
    }

    pub fn readable(&self) -> bool {
        !self.queue.is_empty() || self.fin_ready()
    }

    /// True while coded frames wait to be decoded (plain data must not overtake them).
    pub fn coded_waiting(&self) -> bool {
        self.coded.as_ref().is_some_and(|c| !c.is_empty())
    }

    /// Bytes held: rebuilt but unread, plus coded records waiting.
    pub fn buffered(&self) -> usize {
        self.queue.iter().map(Bytes::len).sum::<usize>()
            + self.coded.as_ref().map_or(0, |c| c.buffered())
    }
}
