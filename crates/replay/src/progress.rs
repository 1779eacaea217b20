//! A progress line on stderr for long runs, drawn only when stderr is a terminal (never in logs
//! or pipes), at most five times a second.

use std::io::Write;
use std::time::{Duration, Instant};

pub struct Progress {
    what: String,
    total: u64,
    done: u64,
    last: Option<Instant>,
    tty: bool,
    bytes: bool,
}

impl Progress {
    /// Progress over `total` bytes.
    pub fn new(what: &str, total: u64) -> Progress {
        Self::with_unit(what, total, true)
    }

    /// Progress over `total` steps (paths, connections).
    pub fn steps(what: &str, total: u64) -> Progress {
        Self::with_unit(what, total, false)
    }

    fn with_unit(what: &str, total: u64, bytes: bool) -> Progress {
        // SAFETY: isatty only inspects the descriptor.
        let tty = unsafe { libc::isatty(2) } == 1;
        Progress {
            what: what.to_string(),
            total,
            done: 0,
            last: None,
            tty,
            bytes,
        }
    }

    pub fn add(&mut self, n: u64) {
        self.done = self.done.saturating_add(n);
        if !self.tty
            || self
                .last
                .is_some_and(|t| t.elapsed() < Duration::from_millis(200))
        {
            return;
        }
        self.last = Some(Instant::now());
        let pct = (self.done.min(self.total) * 100)
            .checked_div(self.total)
            .unwrap_or(100) as usize;
        let bar = "#".repeat(pct / 4) + &" ".repeat(25 - pct / 4);
        let mut e = std::io::stderr().lock();
        let amount = if self.bytes {
            format!(
                "{:.1} of {:.1} MiB",
                self.done as f64 / 1048576.0,
                self.total as f64 / 1048576.0
            )
        } else {
            format!("{} of {}", self.done, self.total)
        };
        let _ = write!(e, "\r{} [{bar}] {pct:>3}% {amount}", self.what);
        let _ = e.flush();
    }

    pub fn finish(&mut self) {
        if self.tty && self.last.is_some() {
            let mut e = std::io::stderr().lock();
            let _ = writeln!(e);
        }
    }
}
