//! Session routing across engine replicas (DESIGN 6.3): every request of a session goes to the
//! same replica, so the session's KV blocks are reused there across turns.
//!
//! Rendezvous (highest-random-weight) hashing: a session goes to the replica with the highest
//! score `hash(session_id, replica_id)`. Adding a replica moves exactly the sessions whose new
//! score beats their old maximum (about 1/(N+1) of them, all to the new replica); removing one
//! moves only the sessions it held. No ring, no virtual nodes, O(N) per lookup.

use crate::hash::{hash_str, mix64};
use std::collections::BTreeMap;
use std::fmt;

/// An engine replica (a data-parallel rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplicaId(pub u32);

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replica {}", self.0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouterError {
    /// No replica is registered, so no request can be placed.
    NoReplicas,
    /// `add_replica` of an id already present.
    DuplicateReplica(ReplicaId),
    /// An operation named a replica the router does not hold.
    UnknownReplica(ReplicaId),
}

impl fmt::Display for RouterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouterError::NoReplicas => write!(f, "no engine replica is registered; add one first"),
            RouterError::DuplicateReplica(r) => write!(f, "{r} is already registered"),
            RouterError::UnknownReplica(r) => write!(f, "{r} is not registered"),
        }
    }
}

impl std::error::Error for RouterError {}

/// Seed of the session-id hash; fixed so routing is the same in every run.
const SESSION_SEED: u64 = 0x5e55_1011;

/// The rendezvous score of (session, replica): the session's stable hash combined with the
/// replica id through the SplitMix finalizer (a bijection, so distinct replicas never collide
/// for one session unless their mixed ids do).
pub fn score(session_hash: u64, replica: ReplicaId) -> u64 {
    mix64(session_hash ^ mix64(0x7265_706c_6963_6100 ^ replica.0 as u64))
}

/// Load and cache counters of one replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counters {
    routed: u64,
    in_flight: u64,
    prompt_tokens: u64,
    prefix_hit_tokens: u64,
}

/// One replica's exported counters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaSnapshot {
    pub replica: ReplicaId,
    /// Requests routed to it since it joined.
    pub routed: u64,
    /// Requests routed and not yet finished.
    pub in_flight: u64,
    /// Prompt tokens it was asked to prefill.
    pub prompt_tokens: u64,
    /// Of those, tokens served from its prefix cache.
    pub prefix_hit_tokens: u64,
    /// prefix_hit_tokens / prompt_tokens (0 when no prompt tokens yet).
    pub prefix_hit_rate: f64,
}

/// The router: the replica set and per-replica counters.
#[derive(Clone, Debug, Default)]
pub struct Router {
    replicas: BTreeMap<ReplicaId, Counters>,
}

impl Router {
    pub fn new(replicas: impl IntoIterator<Item = ReplicaId>) -> Result<Self, RouterError> {
        let mut r = Router::default();
        for id in replicas {
            r.add_replica(id)?;
        }
        Ok(r)
    }

    pub fn add_replica(&mut self, id: ReplicaId) -> Result<(), RouterError> {
        if self.replicas.contains_key(&id) {
            return Err(RouterError::DuplicateReplica(id));
        }
        self.replicas.insert(id, Counters::default());
        Ok(())
    }

    /// Removes a replica and its counters; its sessions route elsewhere from now on.
    pub fn remove_replica(&mut self, id: ReplicaId) -> Result<(), RouterError> {
        self.replicas
            .remove(&id)
            .map(|_| ())
            .ok_or(RouterError::UnknownReplica(id))
    }

    pub fn replicas(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        self.replicas.keys().copied()
    }

    /// The replica that owns `session_id` (no counters change). Ties in score (probability
    /// ~N/2^64) go to the smaller replica id, so the choice never depends on insertion order.
    pub fn route(&self, session_id: &str) -> Result<ReplicaId, RouterError> {
        let h = hash_str(SESSION_SEED, session_id);
        self.replicas
            .keys()
            .map(|&r| (score(h, r), std::cmp::Reverse(r)))
            .max()
            .map(|(_, std::cmp::Reverse(r))| r)
            .ok_or(RouterError::NoReplicas)
    }

    /// Routes a request and counts it as routed and in flight on its replica.
    pub fn dispatch(&mut self, session_id: &str) -> Result<ReplicaId, RouterError> {
        let r = self.route(session_id)?;
        let c = self.counters(r)?;
        c.routed += 1;
        c.in_flight += 1;
        Ok(r)
    }

    /// Records a finished request on `replica`.
    pub fn finish(&mut self, replica: ReplicaId) -> Result<(), RouterError> {
        let c = self.counters(replica)?;
        c.in_flight = c.in_flight.saturating_sub(1);
        Ok(())
    }

    /// Records a prefill on `replica`: `prompt_tokens` asked for, `hit_tokens` of them found in
    /// its prefix cache (the engine reports these from its block manager's stats).
    pub fn record_prefill(
        &mut self,
        replica: ReplicaId,
        prompt_tokens: u64,
        hit_tokens: u64,
    ) -> Result<(), RouterError> {
        let c = self.counters(replica)?;
        c.prompt_tokens += prompt_tokens;
        c.prefix_hit_tokens += hit_tokens.min(prompt_tokens);
        Ok(())
    }

    /// Every replica's counters, in replica-id order.
    pub fn snapshot(&self) -> Vec<ReplicaSnapshot> {
        self.replicas
            .iter()
            .map(|(&replica, c)| ReplicaSnapshot {
                replica,
                routed: c.routed,
                in_flight: c.in_flight,
                prompt_tokens: c.prompt_tokens,
                prefix_hit_tokens: c.prefix_hit_tokens,
                prefix_hit_rate: if c.prompt_tokens == 0 {
                    0.0
                } else {
                    c.prefix_hit_tokens as f64 / c.prompt_tokens as f64
                },
            })
            .collect()
    }

    fn counters(&mut self, r: ReplicaId) -> Result<&mut Counters, RouterError> {
        self.replicas
            .get_mut(&r)
            .ok_or(RouterError::UnknownReplica(r))
    }
}
