//! Credit-based flow control, as plain structs: one pair per stream and one per link.
//!
//! The receiver grants an absolute byte limit; the sender never sends past it. Limits only grow, so
//! a repeated or reordered `MaxData` is harmless, and the limit doubles as an acknowledgement of what
//! the receiving application consumed. Invariants are asserted in debug builds and property-tested.

/// Sender side: how far the peer lets us send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendCredit {
    max: u64,
    sent: u64,
}

impl SendCredit {
    /// Starts with the peer's initial window.
    pub fn new(initial: u64) -> Self {
        SendCredit {
            max: initial,
            sent: 0,
        }
    }

    /// Bytes that may be sent now.
    pub fn available(&self) -> u64 {
        self.max - self.sent
    }

    /// Total bytes sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// Records `n` bytes sent; `n` must not exceed [`available`](Self::available).
    pub fn consume(&mut self, n: u64) {
        debug_assert!(n <= self.available(), "sent past credit");
        self.sent += n.min(self.available());
        self.check();
    }

    /// Takes the peer's own account after a lost connection: it received `sent` bytes and
    /// grants up to `max` (what was in flight is gone and will be sent again).
    pub fn resync(&mut self, sent: u64, max: u64) {
        self.sent = sent;
        self.max = max.max(sent);
        self.check();
    }

    /// The limit granted so far.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// Applies a new absolute limit from the peer; lower limits are stale and ignored.
    /// Returns true if credit grew.
    pub fn raise(&mut self, max: u64) -> bool {
        let grew = max > self.max;
        if grew {
            self.max = max;
        }
        self.check();
        grew
    }

    fn check(&self) {
        debug_assert!(
            self.sent <= self.max,
            "sent {} > max {}",
            self.sent,
            self.max
        );
    }
}

/// Receiver side: what we granted, what arrived and what the application consumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWindow {
    window: u64,
    advertised: u64,
    received: u64,
    consumed: u64,
}

/// The peer sent past the credit it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreditExceeded {
    /// Bytes the peer would have delivered in all.
    pub received: u64,
    /// The limit it had been granted.
    pub limit: u64,
}

impl RecvWindow {
    /// Grants `window` bytes at the start.
    pub fn new(window: u64) -> Self {
        RecvWindow {
            window,
            advertised: window,
            received: 0,
            consumed: 0,
        }
    }

    /// Its state: window, advertised, received, consumed (see [`from_parts`](Self::from_parts)).
    pub(crate) fn parts(&self) -> (u64, u64, u64, u64) {
        (self.window, self.advertised, self.received, self.consumed)
    }

    /// A window in the state [`parts`](Self::parts) gave, if it is one a window can be in.
    pub(crate) fn from_parts(
        window: u64,
        advertised: u64,
        received: u64,
        consumed: u64,
    ) -> Option<Self> {
        (consumed <= received
            && received <= advertised
            && advertised <= consumed.saturating_add(window.max(1).saturating_mul(2)))
        .then_some(RecvWindow {
            window,
            advertised,
            received,
            consumed,
        })
    }

    /// Bytes received but not yet consumed: what the receiver is buffering.
    pub fn buffered(&self) -> u64 {
        self.received - self.consumed
    }

    /// Total bytes received.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The limit granted so far.
    pub fn advertised(&self) -> u64 {
        self.advertised
    }

    /// Bytes consumed so far.
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// Forgets the last `n` bytes received (never below what was consumed): they were queued
    /// but not delivered when the connection was lost, and the peer sends them again.
    pub fn unreceive(&mut self, n: u64) {
        self.received = self.received.saturating_sub(n).max(self.consumed);
        self.check();
    }

    /// Records `n` bytes arriving; an error if they exceed the granted limit (nothing is recorded).
    pub fn on_receive(&mut self, n: u64) -> Result<(), CreditExceeded> {
        let total = self.received.saturating_add(n);
        if total > self.advertised {
            return Err(CreditExceeded {
                received: total,
                limit: self.advertised,
            });
        }
        self.received = total;
        self.check();
        Ok(())
    }

    /// Records `n` bytes consumed by the application. Returns a new limit to advertise once at least
    /// half the window has been consumed since the last grant, so updates are batched.
    pub fn on_consume(&mut self, n: u64) -> Option<u64> {
        self.on_consume_every(n, u64::MAX)
    }

    /// Like [`on_consume`](Self::on_consume), and also once `every` bytes were consumed since
    /// the last grant: the limit then acknowledges consumption often enough for the sender to
    /// let go of what it keeps (resumable streams).
    pub fn on_consume_every(&mut self, n: u64, every: u64) -> Option<u64> {
        debug_assert!(n <= self.buffered(), "consumed more than received");
        self.consumed += n.min(self.buffered());
        let since_grant = self.consumed - self.advertised.saturating_sub(self.window);
        let res = if self.advertised - self.consumed <= self.window / 2 || since_grant >= every {
            self.advertised = self.consumed + self.window;
            Some(self.advertised)
        } else {
            None
        };
        self.check();
        res
    }

    fn check(&self) {
        debug_assert!(self.consumed <= self.received);
        debug_assert!(self.received <= self.advertised);
        debug_assert!(self.advertised <= self.consumed + self.window.max(1) * 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Send(u64),
        Consume(u64),
        Deliver,
    }

    proptest! {
        /// A sender and receiver exchanging credit never overrun the window, never deadlock, and the
        /// receiver never buffers more than one window.
        #[test]
        fn credit_loop(window in 1u64..100_000, ops in proptest::collection::vec(
            prop_oneof![(1u64..50_000).prop_map(Op::Send), (1u64..50_000).prop_map(Op::Consume), Just(Op::Deliver)], 1..200)) {
            let mut tx = SendCredit::new(window);
            let mut rx = RecvWindow::new(window);
            let mut in_flight = 0u64;
            let mut updates: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::Send(n) => {
                        let n = n.min(tx.available());
                        tx.consume(n);
                        in_flight += n;
                    }
                    Op::Deliver => {
                        prop_assert!(rx.on_receive(in_flight).is_ok());
                        in_flight = 0;
                        // Updates may arrive late and out of order.
                        for m in updates.drain(..).rev() { tx.raise(m); }
                    }
                    Op::Consume(n) => {
                        let n = n.min(rx.buffered());
                        if let Some(m) = rx.on_consume(n) { updates.push(m); }
                    }
                }
                prop_assert!(rx.buffered() + in_flight <= window);
                prop_assert!(tx.sent() <= (rx.received() + in_flight));
            }
            // Drain everything: the sender must get credit back (no deadlock).
            prop_assert!(rx.on_receive(in_flight).is_ok());
            let b = rx.buffered();
            if let Some(m) = rx.on_consume(b) { tx.raise(m); }
            for m in updates { tx.raise(m); }
            prop_assert!(tx.available() > 0);
        }
    }

    #[test]
    fn overrun_is_detected() {
        let mut rx = RecvWindow::new(10);
        assert!(rx.on_receive(10).is_ok());
        assert_eq!(
            rx.on_receive(1),
            Err(CreditExceeded {
                received: 11,
                limit: 10
            })
        );
    }

    #[test]
    fn stale_limits_are_ignored() {
        let mut tx = SendCredit::new(100);
        assert!(tx.raise(200));
        assert!(!tx.raise(150));
        assert_eq!(tx.available(), 200);
    }
}
