//! The hello: the first frame each side sends after TLS, with its settings, capabilities, the
//! saved cache states it offers and the services it scopes, and the limits on each list.

/// The first frame each side sends after TLS: who it is and what it can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Highest protocol version the sender speaks.
    pub version: u16,
    /// Lowest protocol version the sender still speaks.
    pub min_version: u16,
    /// The sender's site name (must match its certificate and the receiver's configured peer).
    pub site: String,
    /// Capability bits; unknown bits are ignored.
    pub capabilities: u64,
    /// Settings as (id, value) pairs; unknown ids are ignored, so later versions can add some.
    pub settings: Vec<(u16, u64)>,
    /// Saved chunk-cache states the sender can resume, so a restart keeps its dedup.
    pub caches: Vec<CacheOffer>,
    /// Services whose bytes the sender wants in caches of their own (`dedup_scope: service`).
    /// Both directions of a service use its own cache if either side names it. Optional on
    /// the wire: a hello that ends after its offers names none.
    pub scoped: Vec<String>,
}

/// Saved states of one chunk cache that a side can resume: both sides resume the newest state
/// that the receiving side offers and the sending side also has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheOffer {
    /// True for the receiving side's cache (its decoder), false for the sending side's mirror.
    pub decoder: bool,
    /// The lane whose frames feed the cache.
    pub lane: u8,
    /// Empty for the link's shared cache, else the service name.
    pub scope: String,
    /// Digests of the saved states, newest first.
    pub digests: Vec<[u8; 16]>,
}

/// Most cache offers a hello may carry, and most saved states per offer.
pub const MAX_OFFERS: usize = 512;
pub const MAX_DIGESTS: usize = 8;
/// Most service names a hello's scoped list may carry.
pub const MAX_SCOPED: usize = 128;

/// Setting ids carried in [`Hello::settings`].
pub mod setting {
    /// Initial per-stream receive window the sender grants, in bytes.
    pub const STREAM_WINDOW: u16 = 1;
    /// Initial link-level receive window the sender grants, in bytes.
    pub const LINK_WINDOW: u16 = 2;
    /// Largest data payload the sender accepts in one frame.
    pub const MAX_FRAME: u16 = 3;
    /// Most concurrent streams the sender accepts from its peer.
    pub const MAX_STREAMS: u16 = 4;
    /// The listener's random link token (a latency lane must present it).
    pub const TOKEN: u16 = 5;
    /// On a second connection's hello: attach it as the latency lane of the link with this token.
    pub const ATTACH: u16 = 6;
    /// Bytes of the sender's shared chunk cache (its decoder's): the peer's encoder mirrors it.
    pub const CACHE_BYTES: u16 = 7;
    /// Bytes of each of the sender's service-scoped chunk caches.
    pub const SERVICE_CACHE_BYTES: u16 = 8;
    /// With `CAP_LONG_CONTEXT`: the largest long-context window the sender decodes (log2 bytes).
    pub const CONTEXT_WINDOW_LOG: u16 = 9;
    /// With `CAP_LONG_CONTEXT`: long contexts per link the sender's peer may use at once.
    pub const CONTEXT_STREAMS: u16 = 10;
    /// On a reconnecting side's hello (with `CAP_RESUME`): resume the link whose listener token
    /// this is, with its streams.
    pub const RESUME: u16 = 11;
    /// On the listener's answer: 1 if it resumes the link the peer named (it still has it).
    pub const RESUMED: u16 = 12;
    /// On a latency lane's hello: the lane's id (the connecting side's random pick). A copy of
    /// the lane names the id of the lane it copies.
    pub const COPY_OF: u16 = 13;
    /// On a copy's hello, and on the listener's answer to it: the offset in the sender's lane
    /// byte stream where this connection's bytes start.
    pub const COPY_AT: u16 = 14;
    /// With `CAP_LANE_COPIES`: the most connections the sender takes for its latency lane.
    pub const LANE_COPIES: u16 = 15;
    /// On a resuming side's hello (with `CAP_REPLAY`): the main-lane bytes of the peer's it read
    /// on the lost connection, past the hellos. The peer sends the rest again, byte for byte.
    pub const REPLAY_RECEIVED: u16 = 16;
    /// Beside it: the first main-lane byte of ours we can still send again.
    pub const REPLAY_KEPT: u16 = 17;
}

impl Hello {
    /// The value of a setting, if present.
    pub fn setting(&self, id: u16) -> Option<u64> {
        self.settings
            .iter()
            .find(|(k, _)| *k == id)
            .map(|(_, v)| *v)
    }
}

/// Most settings a hello may carry.
pub const MAX_SETTINGS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_is_found_by_its_id_and_an_absent_one_is_none() {
        let h = Hello {
            version: 1,
            min_version: 1,
            site: "west".into(),
            capabilities: 0,
            settings: vec![(setting::TOKEN, 7), (setting::MAX_FRAME, 65536)],
            caches: Vec::new(),
            scoped: Vec::new(),
        };
        assert_eq!(h.setting(setting::TOKEN), Some(7));
        assert_eq!(h.setting(setting::MAX_FRAME), Some(65536));
        assert_eq!(h.setting(setting::RESUME), None);
    }
}
