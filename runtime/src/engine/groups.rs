//! A group's generation stopped from outside: over-sampling (APRIL) aborts the groups still in
//! flight when a step has its groups, either for good ([`Engine::abort_group`]) or until the
//! next batch ([`Engine::suspend_group`], [`Engine::resume_group`]: partial rollout).
//!
//! A group is named by its instance id (every member of a request shares it), so a command
//! reaches the members the caller has no handles for yet: siblings not forked, or a submit
//! whose handles are still on their way back.

use super::{Engine, Phase, Result, SeqHandle};

impl Engine {
    fn members_of(&self, instance: &str) -> Vec<SeqHandle> {
        self.seqs
            .iter()
            .filter(|(_, s)| s.meta.instance_id == instance)
            .map(|(&h, _)| h)
            .collect()
    }

    fn generated_of(&self, h: SeqHandle) -> Result<usize> {
        Ok(self.seq(h)?.loss_mask.iter().filter(|&&m| m).count())
    }

    /// Ends every trajectory of `instance` (any phase) without a sample and frees its blocks.
    /// Returns each one's generated tokens, in handle order (siblings of a leader whose prompt
    /// had not completed were never forked and are not in it).
    pub fn abort_group(&mut self, instance: &str) -> Result<Vec<usize>> {
        let mut generated = Vec::new();
        for h in self.members_of(instance) {
            generated.push(self.generated_of(h)?);
            self.release(h)?;
            self.seqs.remove(&h);
        }
        Ok(generated)
    }

    /// Stops the trajectories of `instance` that are generating (running or waiting): they
    /// keep their tokens, behavior log-probs and versions, free their K/V blocks and take no
    /// step until [`Engine::resume_group`]. Trajectories between turns stay as they are (an
    /// observation for one of them is the caller's to hold). Returns the generated tokens of
    /// every trajectory of the group the engine holds, in handle order.
    pub fn suspend_group(&mut self, instance: &str) -> Result<Vec<usize>> {
        let mut generated = Vec::new();
        for h in self.members_of(instance) {
            generated.push(self.generated_of(h)?);
            if self.seq(h)?.phase == Phase::Active {
                self.release(h)?;
                self.seq_mut(h)?.phase = Phase::Suspended;
            }
        }
        Ok(generated)
    }

    /// Queues the suspended trajectories of `instance` again, behind the waiting ones. Their
    /// K/V is computed again with the weights installed by then; the tokens they already hold
    /// keep the versions that sampled them, the ones they sample next record the current
    /// version. Returns the generated tokens of every trajectory of the group the engine
    /// holds, in handle order.
    pub fn resume_group(&mut self, instance: &str) -> Result<Vec<usize>> {
        let mut generated = Vec::new();
        for h in self.members_of(instance) {
            generated.push(self.generated_of(h)?);
            if self.seq(h)?.phase == Phase::Suspended {
                self.seq_mut(h)?.phase = Phase::Active;
                self.waiting.push_back(h);
            }
        }
        Ok(generated)
    }
}
