//! References named by their place in a stream log (see [`logs`](crate::logs)): the stream's
//! log starts with a `TAG_LOG` record, every cached chunk it carries is logged, and references
//! to chunks that follow each other in a log go as one reference run.

use bytes::Bytes;

use crate::format::Out;

use super::{Hint, Mirror};
use crate::config::Policy;
use crate::fingerprint::{Fingerprint, SHORT_CHECK, run_check, short_key};
use crate::format::{TAG_LOG, TAG_REF, TAG_REF_RUN, TAG_REF_RUN_SHORT, put_len, put_varint};
use crate::logs::MAX_REF_RUN;
use crate::report::{Report, Sent};

/// References gathered for one reference run: the place of the first in log `serial`, and each
/// one's fingerprint and length. `until`: for a run in the stream's own log, the entries it may
/// name (those logged before it started: the peer logs the run's own chunks after reading it).
pub(crate) struct RefRun {
    serial: u32,
    index: u64,
    names: Vec<(Fingerprint, usize)>,
    until: u64,
    /// Its record carries a short check (the peer reads them).
    short: bool,
}

impl RefRun {
    /// A bound on the bytes its records take (each as a plain reference).
    pub(crate) fn pending(&self) -> usize {
        20 * self.names.len()
    }
}

impl Mirror {
    /// Starts the stream's log if the peer reads them and the stream has none yet: a
    /// `TAG_LOG` record with the next serial. Returns the bytes written (counted in
    /// [`take_late`](Self::take_late)).
    pub(crate) fn start_log(
        &mut self,
        policy: &Policy,
        hint: &mut Hint,
        out: &mut impl Out,
    ) -> usize {
        if !policy.ref_runs || !policy.dedup || hint.log.is_some() {
            return 0;
        }
        let n = self.end_run(hint, out);
        self.log_serials = self.log_serials.wrapping_add(1).max(1);
        hint.log = Some(self.log_serials);
        out.put_u8(TAG_LOG);
        let k = 1 + put_varint(out, u64::from(self.log_serials));
        self.late.wire_bytes += k as u64;
        n + k
    }

    /// Logs a cached chunk the stream's record carried (in record order, as the peer does).
    pub(crate) fn log_chunk(&mut self, hint: &Hint, f: Fingerprint) {
        let Some(serial) = hint.log else {
            return;
        };
        let at = self.logs.append(serial, f);
        // A chunk repeated (zero blocks) keeps the place where its repeats began, so a later
        // run of them is named from there on (see `join_refs`).
        let repeat = at > 0
            && self.logs.get(serial, at - 1) == Some(&f)
            && self
                .places
                .get(&f)
                .is_some_and(|&(s, i)| s == serial && self.logs.get(s, i) == Some(&f));
        if !repeat {
            self.places.insert(f, (serial, at));
        }
        // Places the logs dropped leave the side table now and then (amortised).
        if self.places.len() > 2 * self.logs.limit() + 1024 {
            let logs = &self.logs;
            self.places
                .retain(|f, &mut (s, i)| logs.get(s, i) == Some(f));
        }
    }

    /// Adds a reference to `chunk` (which the peer holds) to the stream's reference run if the
    /// chunk's place in a log follows the run's last (or starts a run there); `None`: it has no
    /// place to be named by, and goes as a plain reference.
    pub(crate) fn join_refs(
        &mut self,
        f: Fingerprint,
        chunk: &[u8],
        short: bool,
        hint: &mut Hint,
        out: &mut impl Out,
    ) -> Option<Report> {
        let own = hint.log?;
        // The place after the open run's last, if the log there holds this chunk: a chunk
        // the log holds more than once (a run of zero blocks, a page two files share) is
        // named where the run goes on, not only at its last place (all `places` keeps). A
        // changed disk image's zero blocks went one reference run each: 0.128 MB of its
        // 0.289 MB.
        let next = hint.refs.as_deref().and_then(|r| {
            let i = r.index + r.names.len() as u64;
            (!r.names.is_empty() && i < r.until && self.logs.get(r.serial, i) == Some(&f))
                .then_some((r.serial, i))
        });
        let (serial, index) = match next {
            Some(place) => place,
            None => {
                let &(serial, index) = self.places.get(&f)?;
                if self.logs.get(serial, index) != Some(&f) {
                    return None;
                }
                (serial, index)
            }
        };
        let follows = hint.refs.as_deref().is_some_and(|r| {
            !r.names.is_empty()
                && r.serial == serial
                && r.index + r.names.len() as u64 == index
                && r.names.len() < MAX_REF_RUN
                && index < r.until
        });
        let mut run_end = 0;
        if !follows {
            run_end = self.end_run(hint, out);
            let until = if serial == own {
                self.logs.next_index(own)
            } else {
                u64::MAX
            };
            let run = hint.refs.get_or_insert_with(|| {
                Box::new(RefRun {
                    serial,
                    index,
                    names: Vec::new(),
                    until,
                    short,
                })
            });
            (run.serial, run.index, run.until, run.short) = (serial, index, until, short);
            run.names.clear();
        }
        if let Some(run) = hint.refs.as_deref_mut() {
            run.names.push((f, chunk.len()));
        }
        // The reference's cache operations now, in the order the peer will apply them.
        self.cache.touch(&f);
        self.recent.put(f, chunk);
        self.log_chunk(hint, f);
        hint.interrupted = true;
        Some(Report {
            sent: Sent::Ref,
            raw: chunk.len(),
            wire: 0,
            run_end,
            no_base: false,
        })
    }

    /// Writes the stream's reference run, if it has one: one record naming its place, or
    /// plain references where that does not pay (a single one) or the log no longer holds the
    /// place. Returns the bytes written (counted in [`take_late`](Self::take_late)).
    pub(crate) fn flush_refs(&mut self, hint: &mut Hint, out: &mut impl Out) -> usize {
        let Some(run) = hint.refs.as_deref_mut() else {
            return 0;
        };
        if run.names.is_empty() {
            return 0;
        }
        let k = run.names.len();
        // A single reference costs 19 bytes by name; by place, with a short check, about 14.
        let held = (k > 1 || run.short)
            && self
                .logs
                .names(run.serial, run.index, k, &mut self.names_scratch)
            && self
                .names_scratch
                .iter()
                .zip(&run.names)
                .all(|(a, b)| *a == b.0);
        let mut n = 0;
        if held {
            let mut check = run_check(run.names.iter().map(|r| &r.0));
            out.put_u8(if run.short {
                TAG_REF_RUN_SHORT
            } else {
                TAG_REF_RUN
            });
            n += 1 + put_varint(out, u64::from(run.serial));
            n += put_varint(out, run.index);
            n += put_varint(out, k as u64);
            if run.short {
                out.put_slice(&check[..SHORT_CHECK]);
                n += SHORT_CHECK;
                // The peer asks for the names by the short check's key.
                check = short_key(&check);
            } else {
                out.put_slice(&check);
                n += 16;
            }
            // A peer whose log differs asks for the names by the check.
            let names = &run.names;
            self.recent.put_with(check, 16 * k, || {
                Bytes::from(names.iter().flat_map(|r| r.0).collect::<Vec<u8>>())
            });
        } else {
            for (f, len) in &run.names {
                out.put_u8(TAG_REF);
                out.put_slice(f);
                n += 17 + put_len(out, *len);
            }
        }
        run.names.clear();
        self.late.hit_wire += n as u64;
        self.late.wire_bytes += n as u64;
        n
    }
}
