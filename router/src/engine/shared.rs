//! State the engine thread shares with the request handlers: health, queue depth for admission,
//! and the metrics it feeds every step.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::ModelInfo;
use crate::metrics::{Metrics, SchedulerGauges};
use crate::protocol::BatchPlan;
use crate::scheduler::{RequestCounts, SchedulerStats};

pub struct Shared {
    pub healthy: AtomicBool,
    pub waiting: AtomicUsize,
    pub info: ModelInfo,
    pub num_pages: u32,
    pub page_size: u32,
    pub metrics: Arc<Metrics>,
    /// The scheduler's cumulative prefix-hit and preemption counts last published (metrics take
    /// deltas).
    prefix_hits_published: AtomicU64,
    preemptions_published: AtomicU64,
    /// The scheduler's request counts last published (likewise).
    requests_published: Mutex<RequestCounts>,
}

impl Shared {
    pub fn new(info: ModelInfo, num_pages: u32, page_size: u32, metrics: Arc<Metrics>) -> Self {
        Self {
            healthy: AtomicBool::new(true),
            waiting: AtomicUsize::new(0),
            info,
            num_pages,
            page_size,
            metrics,
            prefix_hits_published: AtomicU64::new(0),
            preemptions_published: AtomicU64::new(0),
            requests_published: Mutex::new(RequestCounts::default()),
        }
    }

    pub fn set_scheduler_stats(&self, stats: &SchedulerStats) {
        self.waiting.store(stats.waiting, Ordering::Relaxed);
        let hits = since(&self.prefix_hits_published, stats.prefix_hit_tokens_total);
        self.metrics.add_prefix_hit_tokens(hits);
        let preemptions = since(&self.preemptions_published, stats.preemptions_total);
        self.metrics.add_preemptions(preemptions);
        let mut published = self.requests_published.lock();
        let (now, before) = (stats.requests, *published);
        // Gauges and counts in one update, so that no scrape sees the one without the other.
        self.metrics.publish_engine(
            SchedulerGauges {
                waiting: stats.waiting as u64,
                running: stats.running as u64,
                kv_pages_used: stats.pages_in_use as u64,
                kv_pages_free: (stats.pages_free + stats.pages_cached) as u64,
                kv_pages_total: stats.pages_total as u64,
            },
            RequestCounts {
                submitted: now.submitted - before.submitted,
                finished: now.finished - before.finished,
                aborted: now.aborted - before.aborted,
                failed: now.failed - before.failed,
            },
        );
        *published = now;
    }

    pub fn observe_step(&self, plan: &BatchPlan) {
        self.metrics.observe_batch_size(plan.requests.len());
    }
}

/// How much a scheduler's cumulative count grew since it was last published (`published` then
/// holds `total`). A run's scheduler and its `Shared` start together from zero (a worker restart
/// makes both anew), so totals only grow; one that went down would have counted again from zero,
/// so all of it counts as new rather than wrapping around.
fn since(published: &AtomicU64, total: u64) -> u64 {
    let before = published.swap(total, Ordering::Relaxed);
    if total >= before {
        total - before
    } else {
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_of_a_cumulative_count() {
        let published = AtomicU64::new(0);
        assert_eq!(since(&published, 5), 5);
        assert_eq!(since(&published, 5), 0);
        assert_eq!(since(&published, 9), 4);
        assert_eq!(since(&published, 3), 3); // a count that went down (not within a run): all new
        assert_eq!(since(&published, 4), 1);
    }
}
