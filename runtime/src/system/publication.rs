//! Publication and sync: a publication queued to every live replica, what each replica did
//! with what it was sent (an install checked against what was published, or a refusal
//! answered by a full sync), and the trace span of a publication until every replica has it.
//! Changes with the weight-sync protocol inside a run.

use super::scheduler::Scheduler;
use super::stage::{RunError, StageObserver, SyncEvent};
use crate::clock::Micros;
use crate::learner::Publication;
use crate::metrics::Track;
use crate::sync::disk;
use crate::sync::lane::{Delivery, Outgoing, SyncPath, SyncReport};
use crate::trajectory::WeightVersion;
use std::collections::BTreeSet;
use std::sync::Arc;

/// A publication on its way to the replicas: the replicas that have not installed it yet.
pub(super) struct InFlightPublication {
    pub(super) version: WeightVersion,
    pub(super) start: Micros,
    pub(super) waiting: BTreeSet<usize>,
}

impl Scheduler<'_> {
    /// What a replica did with its weights: an install (checked against what was published),
    /// or a refusal answered by a full sync.
    pub(super) fn sync_report(
        &mut self,
        i: usize,
        report: SyncReport,
        restart: bool,
        observer: &mut dyn StageObserver,
    ) -> Result<(), RunError> {
        let now = self.clock.now();
        match report {
            SyncReport::Installed {
                version,
                hash,
                sent_bytes,
                encoding,
                ..
            } => {
                self.replicas[i].installed = Some(version);
                self.credit_install(i, version, now);
                observer.on_sync(&SyncEvent {
                    now,
                    replica: i,
                    version,
                    hash,
                    published: self.published_hashes.get(&version).copied(),
                    encoding,
                    sent_bytes,
                    restart,
                });
            }
            SyncReport::Refused { version, reason } => {
                self.orch.counters_mut().sync_refused += 1;
                self.trace.push(
                    Track::Health,
                    format!(
                        "replica {i} refused {}",
                        version.map_or("the newest version".to_string(), |v| v.to_string())
                    ),
                    now,
                    now,
                    vec![("reason".into(), reason)],
                );
                self.full_sync_after_refusal(i)?;
            }
            SyncReport::Skipped { .. } => {}
        }
        Ok(())
    }

    /// Answers a refusal with a full sync: the newest full image (delta path), or the newest
    /// file rewritten whole (disk path).
    fn full_sync_after_refusal(&mut self, i: usize) -> Result<(), RunError> {
        match &self.cfg.sync.path {
            SyncPath::Delta => {
                let full = self.latest_full.clone().ok_or_else(|| {
                    RunError::Sync("a refused delta but no full image to send".into())
                })?;
                let r = &mut self.replicas[i];
                // Queued deltas start from versions it will not hold: the full image replaces
                // them all.
                r.deliveries.clear();
                r.expected = Some(full.version);
                let bytes = full.sync_bytes();
                r.deliveries.push(Delivery::Bytes(full));
                let c = self.orch.counters_mut();
                c.sync_full_resyncs += 1;
                c.sync_bytes += bytes;
            }
            SyncPath::Disk(_) => {
                let Some((publication, bytes)) = &self.disk_last else {
                    return Ok(());
                };
                if self.disk_repaired != Some(publication.version) {
                    disk::repair(publication, bytes).map_err(|e| RunError::Sync(e.to_string()))?;
                    self.disk_repaired = Some(publication.version);
                    self.orch.counters_mut().sync_full_resyncs += 1;
                }
                let newest = publication.version;
                for r in self.replicas.iter_mut().filter(|r| r.alive) {
                    if r.installed.is_none_or(|v| v < newest) {
                        r.wake = true;
                    }
                }
            }
            SyncPath::InProcess => {
                return Err(RunError::Sync(format!(
                    "replica {i} refused an in-process publication"
                )))
            }
        }
        Ok(())
    }

    /// Replica `i` runs `version` now: it no longer waits for any publication up to it.
    fn credit_install(&mut self, i: usize, version: WeightVersion, now: Micros) {
        for p in &mut self.publications {
            if p.version <= version {
                p.waiting.remove(&i);
            }
        }
        self.close_publications(now);
    }

    /// Publications every live replica has installed end their trace span.
    pub(super) fn close_publications(&mut self, now: Micros) {
        let (done, open): (Vec<_>, Vec<_>) = std::mem::take(&mut self.publications)
            .into_iter()
            .partition(|p| p.waiting.is_empty());
        self.publications = open;
        for p in done {
            self.trace.push(
                Track::Sync,
                format!("publish {}", p.version),
                p.start,
                now,
                vec![("version".into(), p.version.0.to_string())],
            );
        }
    }

    /// Queues a publication to every live replica; returns its `sync_bytes` and
    /// `sync_encoding`.
    pub(super) fn send(
        &mut self,
        p: Arc<Publication>,
        out: Outgoing,
        now: Micros,
    ) -> (u64, String) {
        let live = self.replicas.iter().filter(|r| r.alive).count();
        let metric = out.sync_metric(&self.cfg.sync.path, live);
        if let Some(why) = &out.failed {
            // Disk path: the writer died; the replicas keep what they run.
            self.orch.counters_mut().sync_failed_writes += 1;
            self.trace.push(
                Track::Health,
                format!("publish {} failed", out.version),
                now,
                now,
                vec![("reason".into(), why.clone())],
            );
            return metric;
        }
        self.published += 1;
        self.published_hashes.insert(out.version, out.hash);
        {
            let c = self.orch.counters_mut();
            c.publications += 1;
            c.sync_bytes += metric.0;
        }
        let waiting: BTreeSet<usize> = (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.alive && r.installed.is_none_or(|v| v < out.version)
            })
            .collect();
        self.publications.push(InFlightPublication {
            version: out.version,
            start: now,
            waiting,
        });
        let disk = matches!(self.cfg.sync.path, SyncPath::Disk(_));
        for (r, d) in self.replicas.iter_mut().zip(out.deliveries) {
            if !r.alive {
                continue;
            }
            if let Some(d) = d {
                r.deliveries.push(d);
            }
            if disk {
                // The replica polls at the start of its next unit of work.
                r.wake = true;
            }
            r.expected = Some(out.version);
        }
        if out.full.is_some() {
            self.latest_full = out.full;
        }
        if out.disk.is_some() {
            self.disk_last = out.disk;
        }
        self.engine_weights = p;
        self.close_publications(now);
        metric
    }
}
