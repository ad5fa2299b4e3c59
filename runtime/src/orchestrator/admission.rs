//! Admission and the learner's pick (DESIGN 6.4): which task starts a group next, within the
//! backpressure room and the concurrency budgets, and which ready groups the learner takes;
//! with share correction both follow the tasks' target shares (see the module docs of
//! [`super`]).

use super::*;

impl Orchestrator {
    /// Starts groups while `room` trajectories may start: a group needs G. `route` names the
    /// replica of a session; `waiting[task]` is how many complete groups of each task wait in
    /// the buffer; `step_s` is the learner's recent seconds per step and `per_step` its groups
    /// per step. Returns the submit commands.
    pub fn admit(
        &mut self,
        now: Micros,
        mut room: u64,
        route: &mut dyn FnMut(&str) -> usize,
        waiting: &BTreeMap<String, u64>,
        pace: Pace,
    ) -> Vec<Action> {
        let g = self.policy.group_size as u64;
        let waiting: Vec<u64> = self
            .tasks
            .iter()
            .map(|t| waiting.get(t.task.name()).copied().unwrap_or(0))
            .collect();
        let mut out = Vec::new();
        while room >= g {
            let Some(t) = self.choose_task(&waiting, pace) else {
                break;
            };
            out.push(self.start_group(t, now, route));
            room -= g;
        }
        out
    }

    /// The task to start a group of next, or None when no task has concurrency room.
    ///
    /// With share correction, the task whose supply (groups in flight plus groups waiting in
    /// the buffer) is smallest against what the learner needs of it: by Little's law a task
    /// whose groups take T seconds, consumed at target share x groups per step every `step_s`
    /// seconds, needs share x per_step x (1 + T / step_s) groups in the pipeline (in flight,
    /// plus a step's worth ready). So a slow task gets more of the backpressure room and a fast
    /// one is started just in time. Before any group of a task has finished, its completion
    /// time counts as `step_s`. Without correction, the task with the most free concurrency.
    fn choose_task(&self, waiting: &[u64], pace: Pace) -> Option<usize> {
        let g = self.policy.group_size as u64;
        let open = |i: usize| self.stats[i].in_flight + g <= self.tasks[i].concurrency;
        let candidates = (0..self.tasks.len()).filter(|&i| open(i));
        if self.policy.share_correction {
            let step_s = pace.step_s.max(1e-3);
            let pressure = |i: usize| {
                let st = &self.stats[i];
                let supply = st.in_flight as f64 / g as f64 + waiting[i] as f64;
                let t = if st.trajectories_finished >= g {
                    st.mean_completion_s()
                } else {
                    step_s
                };
                let need = self.tasks[i].target_share
                    * pace.groups_per_step.max(1) as f64
                    * (1.0 + t / step_s);
                if need > 0.0 {
                    supply / need
                } else {
                    f64::INFINITY
                }
            };
            // Ties: the earlier task (min_by keeps the first minimum).
            candidates.min_by(|&a, &b| pressure(a).total_cmp(&pressure(b)))
        } else {
            // Uncorrected: the task with the most free concurrency (ties: the earlier task).
            candidates.max_by(|&a, &b| {
                let free = |i: usize| self.tasks[i].concurrency - self.stats[i].in_flight;
                free(a).cmp(&free(b)).then(b.cmp(&a))
            })
        }
    }

    /// The learner consumed these groups (by task name).
    pub fn on_consumed<'a>(&mut self, tasks: impl IntoIterator<Item = &'a str>) {
        for name in tasks {
            if let Some(i) = self.tasks.iter().position(|t| t.task.name() == name) {
                self.stats[i].groups_consumed += 1;
            }
        }
    }

    /// Which of the ready groups (their task names, oldest first) the learner takes, or None
    /// to wait for more. Without share correction: the oldest `n`. With it, the batch follows
    /// the target shares given what was consumed so far: each of the `n` picks goes to the
    /// task furthest below its target (its oldest ready group); if that task has no ready
    /// group left but has trajectories in flight, the learner waits for them (None) rather
    /// than let a faster task take its place; a task with nothing in flight is passed over.
    /// So a task's share reaches its target whenever its flow allows it, and when its flow
    /// cannot (min(lambda, c/T) * q too small) the learner slows down instead of skewing.
    pub fn pick(&self, ready: &[&str], n: usize) -> Option<Vec<usize>> {
        if !self.policy.share_correction {
            return (ready.len() >= n).then(|| (0..n).collect());
        }
        let index_of = |name: &str| self.tasks.iter().position(|t| t.task.name() == name);
        let mut consumed: Vec<f64> = self
            .stats
            .iter()
            .map(|s| s.groups_consumed as f64)
            .collect();
        let mut total: f64 = consumed.iter().sum();
        let mut taken = vec![false; ready.len()];
        let mut passed_over = vec![false; self.tasks.len()];
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            // The neediest task not passed over.
            let neediest =
                (0..self.tasks.len())
                    .filter(|&t| !passed_over[t])
                    .max_by(|&a, &b| {
                        let d = |t: usize| self.tasks[t].target_share * (total + 1.0) - consumed[t];
                        d(a).total_cmp(&d(b)).then(b.cmp(&a))
                    })?;
            let oldest = ready
                .iter()
                .enumerate()
                .find(|(i, name)| !taken[*i] && index_of(name) == Some(neediest))
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    taken[i] = true;
                    consumed[neediest] += 1.0;
                    total += 1.0;
                    out.push(i);
                }
                None if self.stats[neediest].in_flight > 0 => return None,
                None => passed_over[neediest] = true,
            }
        }
        Some(out)
    }
}
