//! The caches of one link, one per lane and scope: mirrors of the peer's caches (send side) and
//! our own decoders (receive side), the saved states both sides agree to resume, checkpoints, and
//! the decoding of a stream's waiting frames against them.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use wanopt_codec::cache::{ChunkCache, Snapshot};
use wanopt_codec::{
    self as codec, CodecConfig, CodecError, Decoder, LongContext, Mirror, SharedBases, Slots,
    StreamContext,
};

use super::recv::{Decoded, RecvCoded};
use super::{
    CacheStat, CacheStorage, CodecCount, CodecSettings, Fingerprint, PeerCodec, Role, SavedCache,
    SavedState, StateRequest, lane_share,
};
use crate::frame::{self, CacheOffer};
use crate::lane::{CAP_DELTA, CAP_QUIET_BASES, LANES, MAIN_LANE};

/// Most bytes of referenced chunks a mirror keeps to answer misses, whatever the peer's window.
const MAX_RESEND: u64 = 256 << 20;

/// The caches of one link: mirrors of the peer's (send side) and our own (receive side).
/// Most bytes a frame's output buffer is sized for ahead (a frame rebuilds a turn's raw bytes,
/// 256 KiB at most from our encoder; more grows the buffer as needed).
const OUT_PRESIZE: usize = 1 << 20;

pub(crate) struct Contexts {
    own: CodecSettings,
    /// Chunking of what we send, fitted to the peer's frame size; `None` if the peer cannot decode.
    pub chunking: Option<CodecConfig>,
    peer_cache: u64,
    peer_service_cache: u64,
    resend: usize,
    mirrors: HashMap<Key, Mirror>,
    decoders: HashMap<Key, Decoder>,
    pub counts: HashMap<Arc<str>, CodecCount>,
    storage: Option<Arc<dyn CacheStorage>>,
    /// States we saved, offered in our hello.
    saved: HashMap<(Role, Key), Vec<SavedState>>,
    /// States both sides agreed to resume, until they are handed to the runtime to load.
    resume: HashMap<(Role, Key), Fingerprint>,
    /// States the runtime loaded, taken when the cache is first used.
    loaded: HashMap<(Role, Key), Snapshot>,
    /// Each mirror's clock at its last checkpoint: it changed since if it differs.
    checkpointed: HashMap<Key, u64>,
    /// Each decoder's state when a peer's checkpoint was last judged against it.
    judged: HashMap<Key, Judged>,
    /// Long contexts agreed for what we send (the peer's offer within ours), and the link's
    /// count of them in use each way: the bounds hold per link, whatever the caches.
    long_send: Option<LongContext>,
    /// Both sides keep a delta's bases in their place in the caches' order
    /// (`CAP_QUIET_BASES`): our mirrors and decoders do so while the peer's hello says it.
    quiet_bases: bool,
    long_out: Slots,
    long_in: Slots,
    /// Short stream contexts per lane, each side's count shared by the lane's mirrors (or
    /// decoders) of every scope: the bounds are per link, not per cache.
    short_out: [Slots; LANES],
    short_in: [Slots; LANES],
    /// What we sent, as delta bases for the main lane's mirrors (all scopes share it); `None`
    /// if we send no deltas or the peer does not decode them.
    bases: Option<SharedBases>,
    /// A store handed in by the runtime, outliving the link.
    pub given_bases: Option<SharedBases>,
    /// Threads the mirrors prepare chunks on (the runtime's pool).
    pub workers: Option<Arc<dyn codec::prepare::Workers>>,
}

impl std::fmt::Debug for Contexts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contexts")
            .field("chunking", &self.chunking)
            .field("mirrors", &self.mirrors.len())
            .field("decoders", &self.decoders.len())
            .finish()
    }
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

type Key = (usize, Arc<str>);

/// A decoder's state when a peer's checkpoint was last judged against it: its clock, its
/// digest then, and whether it was saved.
struct Judged {
    clock: u64,
    digest: Fingerprint,
    saved: bool,
}

impl Contexts {
    pub fn new(
        own: CodecSettings,
        storage: Option<Arc<dyn CacheStorage>>,
        listed: Vec<SavedCache>,
    ) -> Self {
        let mut saved = HashMap::new();
        // Without storage there is nowhere a resumed decoder's bytes could be.
        for c in listed.into_iter().filter(|_| storage.is_some()) {
            // Only states of our cache as configured now can be resumed by our decoders.
            // (and a decoder without a disk tier has no bytes to resume).
            let cap = own.capacity(c.lane, c.scope.is_empty());
            let disk = own.limits(c.lane, c.scope.is_empty()).1 > 0;
            let states: Vec<_> = c
                .states
                .into_iter()
                .filter(|s| c.role == Role::Mirror || (disk && s.capacity == cap))
                .take(frame::MAX_DIGESTS)
                .collect();
            if !states.is_empty() && c.lane < LANES {
                saved.insert((c.role, (c.lane, c.scope)), states);
            }
        }
        Contexts {
            own,
            chunking: None,
            peer_cache: 0,
            peer_service_cache: 0,
            resend: 0,
            mirrors: HashMap::new(),
            decoders: HashMap::new(),
            counts: HashMap::new(),
            storage,
            saved,
            resume: HashMap::new(),
            loaded: HashMap::new(),
            checkpointed: HashMap::new(),
            judged: HashMap::new(),
            long_send: None,
            quiet_bases: false,
            long_out: Slots::default(),
            long_in: Slots::default(),
            short_out: Default::default(),
            short_in: Default::default(),
            bases: None,
            given_bases: None,
            workers: None,
        }
    }

    /// Our saved states, for the hello.
    pub fn offers(&self) -> Vec<CacheOffer> {
        let mut v: Vec<CacheOffer> = self
            .saved
            .iter()
            .map(|((role, (lane, scope)), states)| CacheOffer {
                decoder: *role == Role::Decoder,
                lane: *lane as u8,
                scope: scope.to_string(),
                digests: states.iter().map(|s| s.digest).collect(),
            })
            .collect();
        v.sort_by(|a, b| (a.decoder, a.lane, &a.scope).cmp(&(b.decoder, b.lane, &b.scope)));
        v.truncate(frame::MAX_OFFERS);
        v
    }

    /// Chooses the states to resume from the peer's offers: for each cache, the newest state the
    /// receiving side offers that the sending side has too. Both sides choose alike.
    fn choose(&mut self, peer: &[CacheOffer]) {
        for o in peer {
            let key: Key = (usize::from(o.lane), Arc::from(o.scope.as_str()));
            // Their decoder and our mirror, or their mirror and our decoder.
            let (role, ours) = if o.decoder {
                (Role::Mirror, self.saved.get(&(Role::Mirror, key.clone())))
            } else {
                (Role::Decoder, self.saved.get(&(Role::Decoder, key.clone())))
            };
            let Some(ours) = ours else {
                continue;
            };
            let pick = if o.decoder {
                o.digests
                    .iter()
                    .find(|d| ours.iter().any(|s| s.digest == **d))
                    .copied()
            } else {
                ours.iter()
                    .find(|s| o.digests.contains(&s.digest))
                    .map(|s| s.digest)
            };
            if let Some(d) = pick {
                self.resume.insert((role, key), d);
            }
        }
        self.saved.clear();
    }

    /// Forgets one lane's caches: they start empty when next used.
    pub fn reset_lane(&mut self, lane: usize) {
        self.mirrors.retain(|k, _| k.0 != lane);
        self.decoders.retain(|k, _| k.0 != lane);
        self.checkpointed.retain(|k, _| k.0 != lane);
        self.judged.retain(|k, _| k.0 != lane);
        self.resume.retain(|k, _| k.1.0 != lane);
        self.loaded.retain(|k, _| k.1.0 != lane);
    }

    /// The zstd level mirrors are made with.
    pub fn zstd_level(&self) -> i32 {
        self.own.zstd_level
    }

    /// The zstd level of every mirror from now on, and of those made later.
    pub fn set_zstd_level(&mut self, level: i32) {
        self.own.zstd_level = level;
        for m in self.mirrors.values_mut() {
            m.set_zstd_level(level);
        }
    }

    /// The states chosen to resume, for the runtime to load; each is asked for once.
    pub fn take_requests(&mut self) -> Vec<StateRequest> {
        let mut v: Vec<StateRequest> = self
            .resume
            .drain()
            .map(|((role, (lane, scope)), digest)| StateRequest {
                role,
                lane,
                scope,
                digest,
            })
            .collect();
        v.sort_by(|a, b| {
            (a.lane, &a.scope, a.role.label()).cmp(&(b.lane, &b.scope, b.role.label()))
        });
        v
    }

    /// Keeps the states the runtime loaded until their caches are first used. A state that is
    /// missing, or is not the one asked for, leaves its cache empty, which costs dedup and never
    /// correctness (see [`Contexts::mirror`] and [`Contexts::decoder`]).
    pub fn states_loaded(&mut self, states: Vec<(StateRequest, Option<Snapshot>)>) {
        for (r, s) in states {
            if let Some(s) = s.filter(|s| s.digest() == r.digest) {
                self.loaded.insert((r.role, (r.lane, r.scope)), s);
            }
        }
    }

    /// Takes the peer's announced cache sizes and frame limit. Our mirrors never exceed our own
    /// limits; a smaller mirror holds a subset of the peer's cache (LRU keeps the most recent
    /// chunks that fit), so it never claims a chunk the peer has evicted.
    /// Chunks sent as references are kept for a miss as long as they could still be in flight:
    /// the peer's link window, plus slack for a round trip.
    pub fn on_peer(&mut self, peer: &PeerCodec, offers: &[CacheOffer]) {
        self.long_send = self
            .own
            .long_context
            .zip(peer.long)
            .map(|(ours, theirs)| ours.agree(&theirs));
        self.resend = usize::try_from(peer.link_window.min(MAX_RESEND)).unwrap_or(0) + (16 << 20);
        // Our caches apply the peer's order from now on, as the peer applies ours.
        self.quiet_bases = peer.caps & CAP_QUIET_BASES != 0;
        for m in self.mirrors.values_mut() {
            m.cache_mut().set_quiet_bases(self.quiet_bases);
        }
        for d in self.decoders.values_mut() {
            d.cache_mut().set_quiet_bases(self.quiet_bases);
        }
        // The runtime's store if it gave one (it outlives the connection), else one of our own.
        self.bases = if peer.caps & CAP_DELTA == 0 || self.own.delta_bytes == 0 {
            None
        } else {
            self.given_bases
                .clone()
                .or_else(|| codec::delta::shared(to_usize(self.own.delta_bytes)))
        };
        // A mirror costs about 64 bytes of memory per chunk: never more than our own cache.
        self.peer_cache = peer.cache.min(self.own.capacity(MAIN_LANE, true));
        self.peer_service_cache = peer.service_cache.min(self.own.capacity(MAIN_LANE, false));
        self.choose(offers);
        // A chunk and its record must fit in one frame of the peer's size.
        let room = peer.max_frame.saturating_sub(frame::CODED_OVERHEAD + 64);
        let avg = self.own.avg_chunk.min(room / 4);
        self.chunking = (avg >= *codec::AVG_CHUNK_RANGE.start()).then(|| {
            CodecConfig {
                zstd_level: self.own.zstd_level,
                runs: self.own.runs,
                ..CodecConfig::default()
            }
            .with_avg_chunk(avg)
        });
    }

    /// Counts what a service's stream sent.
    pub(crate) fn count_sent(&mut self, service: &Arc<str>, stats: &wanopt_codec::EncodeStats) {
        self.counts
            .entry(service.clone())
            .or_default()
            .sent
            .merge(stats);
    }

    pub fn mirror(&mut self, lane: usize, scope: &Arc<str>) -> &mut Mirror {
        let size = if scope.is_empty() {
            self.peer_cache
        } else {
            self.peer_service_cache
        };
        let (level, resend) = (self.own.zstd_level, self.resend);
        let key = (lane, scope.clone());
        let resume = self.loaded.remove(&(Role::Mirror, key.clone()));
        let long = (self.long_send, self.long_out.clone());
        let short = self.short_out[lane.min(LANES - 1)].clone();
        // The latency lane sends no deltas (its streams never would).
        let bases = self.bases.clone().filter(|_| lane == MAIN_LANE);
        // Nor does it prepare chunks on workers: its small writes never wait for a pool.
        let workers = self.workers.clone().filter(|_| lane == MAIN_LANE);
        let quiet = self.quiet_bases;
        self.mirrors.entry(key).or_insert_with(|| {
            let mut m = Mirror::new(to_usize(lane_share(size, lane)), resend, level);
            m.cache_mut().set_quiet_bases(quiet);
            m.share_context_slots(short);
            m.set_long_context(long.0, long.1);
            m.set_bases(bases);
            m.set_workers(workers);
            if let Some(s) = resume {
                // A state of another size cannot be resumed: start empty (the peer's cache then
                // holds more than we assume, which only costs dedup).
                let _ = m.cache_mut().restore(&s);
            }
            m
        })
    }

    pub fn decoder(&mut self, lane: usize, scope: &Arc<str>) -> &mut Decoder {
        let key = (lane, scope.clone());
        let resume = self.loaded.remove(&(Role::Decoder, key.clone()));
        let (mem, disk) = self.own.limits(lane, scope.is_empty());
        let storage = self.storage.clone();
        let long = (self.own.long_context, self.long_in.clone());
        let short = self.short_in[lane.min(LANES - 1)].clone();
        let workers = self.workers.clone().filter(|_| lane == MAIN_LANE);
        let quiet = self.quiet_bases;
        self.decoders.entry(key).or_insert_with(|| {
            let store = (disk > 0)
                .then(|| storage.as_ref().and_then(|s| s.store(lane, scope)))
                .flatten();
            let mut cache = match store {
                Some(st) => ChunkCache::tiered(to_usize(mem), disk, st),
                None => ChunkCache::new(to_usize(mem)),
            };
            if let Some(s) = resume {
                // Chunks whose bytes are gone become misses, which the peer answers.
                let _ = cache.restore(&s);
            }
            cache.set_quiet_bases(quiet);
            let mut d = Decoder::with_cache(cache, true);
            d.share_context_slots(short);
            // What we offered in our hello, counted per link.
            d.set_long_context(long.0, long.1);
            // The latency lane's small frames never wait for a pool.
            d.set_workers(workers);
            d
        })
    }

    /// True if our decoder of a lane and scope was ever used.
    pub fn has_decoder(&self, lane: usize, scope: &str) -> bool {
        self.decoders.contains_key(&(lane, Arc::from(scope)))
    }

    /// Our decoder of a lane and scope, if it was ever used.
    pub fn existing_decoder(&mut self, lane: usize, scope: &Arc<str>) -> Option<&mut Decoder> {
        self.decoders.get_mut(&(lane, scope.clone()))
    }

    /// The mirrors changed since their last checkpoint, as (lane, scope).
    pub fn dirty_mirrors(&self) -> Vec<Key> {
        self.mirrors
            .iter()
            .filter(|(k, m)| self.checkpointed.get(*k).copied().unwrap_or(0) != m.cache().clock())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Takes a checkpoint of a mirror: its state now, which the frame emitted at this point of
    /// the lane tells the peer to save too.
    pub fn checkpoint_mirror(&mut self, lane: usize, scope: &str) -> Option<Arc<Snapshot>> {
        let key: Key = (lane, Arc::from(scope));
        let m = self.mirrors.get(&key)?;
        self.checkpointed.insert(key, m.cache().clock());
        Some(Arc::new(m.cache().snapshot()))
    }

    /// Our decoder's state, if it is the one the peer's checkpoint names.
    pub fn checkpoint_decoder(
        &mut self,
        lane: usize,
        scope: &str,
        digest: &Fingerprint,
    ) -> Option<Arc<Snapshot>> {
        let key: Key = (lane, Arc::from(scope));
        let d = self.decoders.get_mut(&key)?;
        // A cache in memory only has nothing to resume after a restart.
        if !d.cache().has_disk() {
            return None;
        }
        // A peer repeating checkpoints without sending anything in between costs nothing: our
        // state did not change, its digest is known (and it was saved, if it matched). A
        // different digest at the same state is judged against the one known: a checkpoint
        // deferred behind a stalled stream is judged once the decoder is past it and cannot
        // match, and the peer's next one, at the state the decoder is in by then, must.
        let clock = d.cache().clock();
        if let Some(j) = self.judged.get_mut(&key)
            && j.clock == clock
        {
            if j.saved || j.digest != *digest {
                return None;
            }
            j.saved = true;
            d.cache_mut().flush();
            return Some(Arc::new(d.cache().snapshot()));
        }
        d.cache_mut().flush();
        let s = d.cache().snapshot();
        let ours = s.digest();
        let saved = ours == *digest;
        self.judged.insert(
            key,
            Judged {
                clock,
                digest: ours,
                saved,
            },
        );
        saved.then(|| Arc::new(s))
    }

    /// The bytes of a chunk the peer asked for, if our mirror still holds it.
    pub fn resend(&self, lane: usize, scope: &str) -> impl Fn(&Fingerprint) -> Option<Bytes> + '_ {
        let m = self.mirrors.get(&(lane, Arc::from(scope)));
        move |f| m.and_then(|m| m.chunk(f))
    }

    /// Starts feeding the frame that just arrived on a stream with nothing else waiting (no
    /// earlier frame, no stall) to the stream's context ahead of its turn (see
    /// [`Feeding`](wanopt_codec::Feeding)), if it holds context records: the stream's context
    /// is the feeding's until [`RecvCoded::fed`] gives it back, which must come before the
    /// frame is decoded.
    pub fn feed_ahead(
        &mut self,
        rc: &mut RecvCoded,
        lane: usize,
        service: &Arc<str>,
    ) -> Option<wanopt_codec::Feeding> {
        if rc.stall.is_some() || rc.frames.len() != 1 {
            return None;
        }
        let p = rc.frames.front()?;
        let scope = if p.scoped {
            service.clone()
        } else {
            Arc::from("")
        };
        let announced = usize::try_from(p.remaining).unwrap_or(usize::MAX);
        let records = p.records.clone();
        self.decoder(lane, &scope)
            .feed_ahead(records, &mut rc.context, announced)
    }

    /// Has the workers rebuild the delta runs of frames fed ahead (`feeds`) whose bases the
    /// frames decoded since brought (see [`Decoder::rebuild_later`]), each by the decoder that
    /// fed it.
    pub fn rebuild_later<'a>(&self, feeds: impl Iterator<Item = &'a wanopt_codec::Feeding>) {
        let Some(w) = self.workers.as_deref() else {
            return;
        };
        for f in feeds {
            for d in self.decoders.values() {
                d.rebuild_later(f, w);
            }
        }
    }

    /// Decodes a stream's waiting frames until they run out (all but the last `keep`: frames
    /// fed ahead, which wait for their turn) or a reference misses (counted as a need of the
    /// stream's service when it asks the peer).
    pub fn decode(
        &mut self,
        rc: &mut RecvCoded,
        lane: usize,
        service: &Arc<str>,
        keep: usize,
    ) -> Result<Decoded, String> {
        let mut got = Decoded::default();
        if rc.stall.is_some() {
            return Ok(got);
        }
        let link_scope: Arc<str> = Arc::from("");
        while rc.frames.len() > keep
            && let Some(p) = rc.frames.front_mut()
        {
            let scope = if p.scoped { service } else { &link_scope };
            let dec = self.decoder(lane, scope);
            let before = dec.stats();
            let announced = usize::try_from(p.remaining).unwrap_or(usize::MAX);
            // Sized once for what the frame announced (up to a bound a peer cannot raise): a
            // buffer grown by doubling took the receiving daemon a third of its time in fresh
            // pages for the reallocations.
            let mut out = Vec::with_capacity(announced.min(OUT_PRESIZE));
            let mut miss = None;
            let mut on_store = false;
            // Each record within what the frame announced (and paid credit for); with workers,
            // the frame's literals alone are decompressed on them first.
            // Literals decompressed ahead are handed on as they are (the cache's own bytes),
            // not copied into `out`.
            let mut handed = wanopt_codec::HandedOn::default();
            let (used, stop) = dec.decode_frame_handing(
                &p.records,
                &mut out,
                &mut handed,
                &mut rc.context,
                announced,
            );
            p.records.advance(used);
            let failed = match stop {
                None => None,
                Some(CodecError::Miss(f)) => {
                    miss = Some((f, p.scoped));
                    None
                }
                Some(CodecError::Pending(f)) => {
                    miss = Some((f, p.scoped));
                    on_store = true;
                    None
                }
                Some(CodecError::Incomplete) => Some("truncated record".to_string()),
                Some(e) => Some(e.to_string()),
            };
            if let Some(e) = failed {
                return Err(e);
            }
            let after = dec.stats();
            let r = &mut self.counts.entry(service.clone()).or_default().received;
            r.hit_chunks += after.hit_chunks - before.hit_chunks;
            r.hit_bytes += after.hit_bytes - before.hit_bytes;
            r.lit_chunks += after.lit_chunks - before.lit_chunks;
            r.lit_bytes += after.lit_bytes - before.lit_bytes;
            r.delta_chunks += after.delta_chunks - before.delta_chunks;
            r.delta_bytes += after.delta_bytes - before.delta_bytes;
            let n = (out.len() + handed.bytes()) as u64;
            if n > p.remaining {
                return Err("records rebuild more bytes than announced".into());
            }
            p.remaining -= n;
            // A frame cut short (a miss), or whose literals were handed on, holds no more than
            // it copied.
            if out.capacity() > 2 * out.len() + 4096 {
                out.shrink_to_fit();
            }
            handed.segments(Bytes::from(out), &mut got.data);
            if let Some(m) = miss {
                // A chunk on our disk tier is being read: the stream waits for our store, not
                // the peer.
                rc.stall = Some(m);
                rc.stalls += 1;
                rc.on_store = on_store;
                if !on_store {
                    got.need = Some(m);
                }
                return Ok(got);
            }
            if p.remaining != 0 {
                return Err("records rebuild fewer bytes than announced".into());
            }
            if p.fin {
                // Nothing follows the stream's last frame: its context can go now.
                got.fin = true;
                rc.context = StreamContext::default();
            }
            rc.pop_front();
        }
        Ok(got)
    }

    /// Sizes of every cache, for gauges.
    pub fn cache_stats(&self) -> Vec<CacheStat> {
        let stat =
            |(lane, scope): &(usize, Arc<str>), role, c: &codec::cache::ChunkCache| CacheStat {
                lane: *lane,
                scope: scope.clone(),
                role,
                bytes: c.size() as u64,
                chunks: c.len() as u64,
                evictions: c.evictions(),
                tiers: c.tier_stats(),
            };
        self.mirrors
            .iter()
            .map(|(k, m)| stat(k, "mirror", m.cache()))
            .chain(
                self.decoders
                    .iter()
                    .map(|(k, d)| stat(k, "decoder", d.cache())),
            )
            .chain(
                self.bases
                    .as_ref()
                    .and_then(|b| b.lock().ok())
                    .map(|b| CacheStat {
                        lane: MAIN_LANE,
                        scope: Arc::from(""),
                        role: "bases",
                        bytes: b.size() as u64,
                        chunks: b.len() as u64,
                        evictions: b.evictions(),
                        tiers: b.tier_stats(),
                    }),
            )
            .collect()
    }

    /// Test hook: the digests of our mirrors' and decoders' caches (see
    /// [`ChunkCache::digest`]), by role, lane and scope: a mirror's equals its peer decoder's
    /// while the two are in step.
    pub fn cache_digests(&self) -> Vec<(&'static str, usize, Arc<str>, Fingerprint)> {
        let mirrors = self.mirrors.iter().map(|(k, m)| ("mirror", k, m.cache()));
        let decoders = self.decoders.iter().map(|(k, d)| ("decoder", k, d.cache()));
        mirrors
            .chain(decoders)
            .map(|(role, (lane, scope), c)| (role, *lane, scope.clone(), c.digest()))
            .collect()
    }

    /// Literals our decoders took as fed ahead.
    pub fn lits_ahead(&self) -> u64 {
        self.decoders.values().map(Decoder::lits_ahead).sum()
    }

    /// Test hook: damages a chunk in our decoder caches, as bad memory would.
    pub fn corrupt_decoders(&mut self) -> usize {
        let mut n = 0;
        for d in self.decoders.values_mut() {
            n += d.cache_mut().corrupt_all_for_test();
        }
        n
    }
}
