//! Stream slots of the local clients: a service holds at most its `max_streams`, one client
//! address at most `max_streams_per_client` of them, and bulk services together leave
//! `limits.latency_reserve` of `limits.max_streams` to latency services, so one client of a minor
//! service cannot take every slot from Data Guard.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use wanopt_proto::Class;

use crate::config::{Limits, Service};
use crate::sync::lock;

#[derive(Default)]
struct Counts {
    service: HashMap<String, u32>,
    client: HashMap<(String, IpAddr), u32>,
    bulk: u32,
}

/// The slots in use, shared by every service of one daemon.
#[derive(Default)]
pub(crate) struct Slots {
    counts: Mutex<Counts>,
}

/// A slot held by one stream; dropping it frees the slot.
pub(crate) struct Slot {
    slots: Arc<Slots>,
    service: String,
    client: IpAddr,
    bulk: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = lock(&self.slots.counts);
        dec(&mut c.service, &self.service);
        dec(&mut c.client, &(self.service.clone(), self.client));
        if self.bulk {
            c.bulk -= 1;
        }
    }
}

fn dec<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u32>, k: &K) {
    if let Some(n) = m.get_mut(k) {
        *n -= 1;
        if *n == 0 {
            m.remove(k);
        }
    }
}

impl Slots {
    /// Takes a slot for a client of `svc` at `client`, or names the limit that is full (the
    /// label the refusal is counted under).
    pub(crate) fn take(
        self: &Arc<Self>,
        svc: &Service,
        limits: &Limits,
        client: IpAddr,
    ) -> Result<Slot, &'static str> {
        let mut c = lock(&self.counts);
        let bulk = svc.class == Class::Bulk;
        let key = (svc.name.clone(), client);
        if c.service.get(&svc.name).copied().unwrap_or(0) >= svc.max_streams {
            return Err("service_full");
        }
        if c.client.get(&key).copied().unwrap_or(0) >= svc.max_streams_per_client {
            return Err("client_full");
        }
        if bulk && c.bulk >= limits.max_streams - limits.latency_reserve {
            return Err("bulk_full");
        }
        *c.service.entry(svc.name.clone()).or_insert(0) += 1;
        *c.client.entry(key).or_insert(0) += 1;
        if bulk {
            c.bulk += 1;
        }
        Ok(Slot {
            slots: self.clone(),
            service: svc.name.clone(),
            client,
            bulk,
        })
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        let c = lock(&self.counts);
        c.service.is_empty() && c.client.is_empty() && c.bulk == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn clients_services_and_the_bulk_class_each_have_a_limit() {
        let cfg = Config::parse(
            "site: west\nlink: {connect: 'e:1', peer: east}\ntls: {ca: a, cert: b, key: c}\nservices:\n  - {name: rman, listen: '127.0.0.1:1', max_streams: 5, max_streams_per_client: 2}\n  - {name: gg, listen: '127.0.0.1:2'}\n  - {name: dg, listen: '127.0.0.1:3', class: latency}\nlimits: {max_streams: 8, latency_reserve: 2}\n",
            std::path::Path::new("x.yaml"),
        )
        .expect("config");
        let (rman, gg, dg) = (&cfg.services[0], &cfg.services[1], &cfg.services[2]);
        let s = Arc::new(Slots::default());
        let ip = |n: u8| IpAddr::from([10, 0, 0, n]);
        let take = |svc, n| s.take(svc, &cfg.limits, ip(n));
        let mut held = vec![take(rman, 1).expect("1"), take(rman, 1).expect("2")];
        assert_eq!(take(rman, 1).err(), Some("client_full"));
        held.push(take(rman, 2).expect("another client"));
        held.push(take(rman, 3).expect("4"));
        held.push(take(rman, 4).expect("5"));
        assert_eq!(take(rman, 5).err(), Some("service_full"));
        // Bulk: 6 of 8 may be taken (2 kept for latency).
        held.push(take(gg, 1).expect("6"));
        assert_eq!(take(gg, 2).err(), Some("bulk_full"));
        held.push(take(dg, 1).expect("latency uses the reserve"));
        held.push(take(dg, 1).expect("latency uses the reserve"));
        held.remove(0);
        held.push(take(gg, 2).expect("a freed slot is reused"));
        drop(held);
        assert!(s.is_empty(), "nothing leaked");
    }
}
