//! What lives under a link's lock: the sans-IO [`Link`] and, beside it, the wakeups of each
//! stream and what the link's tasks collect for the supervisor and the loader.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use wanopt_proto::{Link, StateRequest, StreamId};

use super::carriers::LaneCopies;
use crate::sync::lock;

/// Wakeups and the reset reason of one stream.
#[derive(Debug, Default)]
pub(crate) struct StreamSignal {
    pub readable: Notify,
    pub writable: Notify,
    /// Reset, link closed, or finished: the stream is gone from the link.
    pub gone: Notify,
    reset: Mutex<Option<String>>,
}

impl StreamSignal {
    /// Why the stream ended: its reset's reason, or "stream closed".
    pub fn reason(&self) -> String {
        self.reset_reason()
            .unwrap_or_else(|| "stream closed".to_string())
    }

    /// The reason the stream was reset, if it was.
    pub fn reset_reason(&self) -> Option<String> {
        lock(&self.reset).clone()
    }

    /// Records a reset and wakes every waiter of the stream.
    pub fn set_reset(&self, reason: String) {
        *lock(&self.reset) = Some(reason);
        self.wake_all();
    }

    /// Wakes every waiter: readers, writers and whoever waits for the end.
    pub fn wake_all(&self) {
        self.readable.notify_one();
        self.writable.notify_one();
        self.gone.notify_one();
    }
}

/// One link's state machine and what its events left for the tasks around it.
pub(crate) struct Inner {
    pub link: Link,
    pub signals: HashMap<StreamId, Arc<StreamSignal>>,
    /// Streams the peer opened, until the reader tells the supervisor.
    pub opened: Vec<(StreamId, Arc<str>)>,
    /// The peer's hello was accepted on the current connection.
    pub up: bool,
    /// Saved cache states the link asked for, until the main lane's reader loads them.
    pub load: Vec<StateRequest>,
    /// The connections carrying the latency lane, each with a copy of its bytes.
    pub lane: LaneCopies,
}

impl Inner {
    pub fn new(link: Link) -> Self {
        Inner {
            link,
            signals: HashMap::new(),
            opened: Vec::new(),
            up: false,
            load: Vec::new(),
            lane: LaneCopies::new(),
        }
    }

    /// Wakes every stream: the link is gone for good.
    pub fn wake_all(&self) {
        for s in self.signals.values() {
            s.wake_all();
        }
    }
}
