//! Several engine replicas (data-parallel ranks) behind the session router (DESIGN 6.3).
//!
//! Every trajectory of a session goes to the replica [`Router::route`] picks for its
//! `session_id` (rendezvous hashing), so a session's KV and prefix blocks stay on one replica.
//! [`Replicas::run_until_idle`] runs every replica's engine on its own thread (scoped threads:
//! on CPU each replica is a thread; on GPUs each would own a device) until none has work. The
//! router's per-replica counters are fed from the real engines: requests routed and in flight
//! from submit/finish, prompt and prefix-hit tokens from each block manager's stats.

use super::{Engine, EngineError, Event, Request, Result, SeqHandle, SwapMode};
use crate::router::{ReplicaId, ReplicaSnapshot, Router};
use crate::trajectory::{Sample, TerminalReason, TokenId, WeightVersion};
use sluice_model::Arena;
use std::collections::BTreeMap;

/// Engines keyed by replica id, and the router in front of them.
pub struct Replicas {
    router: Router,
    engines: BTreeMap<ReplicaId, Engine>,
    /// Prompt and prefix-hit tokens of each block manager already reported to the router.
    reported: BTreeMap<ReplicaId, (u64, u64)>,
}

fn routing(e: crate::router::RouterError) -> EngineError {
    EngineError::Invalid(format!("router: {e}"))
}

impl Replicas {
    /// Replicas 0..n, one per engine.
    pub fn new(engines: Vec<Engine>) -> Result<Replicas> {
        if engines.is_empty() {
            return Err(EngineError::Invalid("Replicas::new: no engines".into()));
        }
        let ids: Vec<ReplicaId> = (0..engines.len() as u32).map(ReplicaId).collect();
        let router = Router::new(ids.iter().copied()).map_err(routing)?;
        Ok(Replicas {
            router,
            engines: ids.iter().copied().zip(engines).collect(),
            reported: ids.iter().map(|&r| (r, (0, 0))).collect(),
        })
    }

    pub fn replicas(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        self.engines.keys().copied()
    }

    pub fn engine(&self, r: ReplicaId) -> Result<&Engine> {
        self.engines
            .get(&r)
            .ok_or_else(|| EngineError::Invalid(format!("no replica {r}")))
    }

    fn engine_mut(&mut self, r: ReplicaId) -> Result<&mut Engine> {
        self.engines
            .get_mut(&r)
            .ok_or_else(|| EngineError::Invalid(format!("no replica {r}")))
    }

    /// Routes a request by its session id and queues it there; one in-flight count per
    /// trajectory of the group.
    pub fn submit(&mut self, req: Request) -> Result<(ReplicaId, Vec<SeqHandle>)> {
        let r = self.router.route(&req.session_id).map_err(routing)?;
        let (g, session) = (req.group_size, req.session_id.clone());
        let handles = self.engine_mut(r)?.submit(req)?;
        for _ in 0..g {
            self.router.dispatch(&session).map_err(routing)?;
        }
        Ok((r, handles))
    }

    /// [`Engine::observe`] on replica `r`.
    pub fn observe(
        &mut self,
        r: ReplicaId,
        h: SeqHandle,
        observation: &[TokenId],
        max_new_tokens: u32,
    ) -> Result<()> {
        self.engine_mut(r)?.observe(h, observation, max_new_tokens)
    }

    /// [`Engine::finish`] on replica `r`.
    pub fn finish(
        &mut self,
        r: ReplicaId,
        h: SeqHandle,
        reward: f32,
        reason: TerminalReason,
    ) -> Result<Sample> {
        let s = self.engine_mut(r)?.finish(h, reward, reason)?;
        self.router.finish(r).map_err(routing)?;
        Ok(s)
    }

    /// Swaps every replica's weights (between steps).
    pub fn swap_weights(
        &mut self,
        arena: &Arena,
        version: WeightVersion,
        mode: Option<SwapMode>,
    ) -> Result<()> {
        for e in self.engines.values_mut() {
            e.swap_weights(arena, version, mode)?;
        }
        Ok(())
    }

    /// Runs every replica on its own thread until none has work; returns the events in
    /// replica order.
    pub fn run_until_idle(&mut self) -> Result<Vec<(ReplicaId, Event)>> {
        let results: Vec<(ReplicaId, Result<Vec<Event>>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .engines
                .iter_mut()
                .map(|(&r, e)| (r, scope.spawn(move || e.run_until_idle())))
                .collect();
            handles
                .into_iter()
                .map(|(r, h)| {
                    let out = h.join().unwrap_or_else(|_| {
                        Err(EngineError::Invalid(format!(
                            "replica {r}'s thread panicked"
                        )))
                    });
                    (r, out)
                })
                .collect()
        });
        let mut events = Vec::new();
        for (r, out) in results {
            for ev in out? {
                if matches!(ev, Event::Finished { .. }) {
                    self.router.finish(r).map_err(routing)?;
                }
                events.push((r, ev));
            }
        }
        self.sync_counters()?;
        Ok(events)
    }

    /// Reports each block manager's new prompt and prefix-hit tokens to the router.
    fn sync_counters(&mut self) -> Result<()> {
        for (&r, e) in &self.engines {
            let kv = e.stats().kv;
            let seen = self.reported.entry(r).or_insert((0, 0));
            let (dp, dh) = (kv.prompt_tokens - seen.0, kv.prefix_hit_tokens - seen.1);
            *seen = (kv.prompt_tokens, kv.prefix_hit_tokens);
            self.router.record_prefill(r, dp, dh).map_err(routing)?;
        }
        Ok(())
    }

    /// The router's per-replica counters (load, prompt tokens, prefix-hit rate), fed from the
    /// engines' block managers.
    pub fn snapshot(&mut self) -> Result<Vec<ReplicaSnapshot>> {
        self.sync_counters()?;
        Ok(self.router.snapshot())
    }

    pub fn router(&self) -> &Router {
        &self.router
    }
}
