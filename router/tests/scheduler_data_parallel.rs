//! Data-parallel attention scheduling: one scheduler per rank behind one interface.
//!
//! The fake executor keeps ONE pool of all ranks' pages in global numbering, so a page id or an
//! out slot moved to the wrong rank's range (or not moved) reads back the wrong tokens and the
//! outputs leave the reference. Every plan is also checked for the data-parallel layout: each
//! request's pages and slots inside its own rank's range, requests grouped by rank in rank
//! order, and overlap references naming the right row of the previous combined plan.

mod scheduler_common;

use std::collections::{HashMap, HashSet};

use nsaserve_router::engine::{GenerateEvent, GenerateRequest, RequestId, SubmitError};
use nsaserve_router::protocol::{BatchPlan, SamplingParams};
use nsaserve_router::scheduler::{
    DataParallelScheduler, PriorityPolicy, Scheduler, SchedulerConfig,
};
use scheduler_common::*;

fn seq(n: usize, base: i32) -> Vec<i32> {
    (0..n as i32).map(|i| base + i).collect()
}

/// `rank_pages` pages per rank, `dp` ranks.
fn dp(page_size: u32, rank_pages: u32, dp: usize) -> DataParallelScheduler {
    DataParallelScheduler::new(config(page_size, rank_pages * dp as u32), dp)
}

/// The data-parallel layout of a combined plan.
fn check_dp_plan(s: &DataParallelScheduler, plan: &BatchPlan) {
    check_plan(plan, s.config().num_pages);
    let p = s.config().num_pages as i32 / s.dp_size() as i32;
    let ps = plan.page_size as i32;
    let mut last_rank = 0;
    for r in &plan.requests {
        let rank = s.rank_of(r.id).expect("a planned request is on a rank") as i32;
        assert!(rank >= last_rank, "plan is not grouped by rank: {plan:?}");
        last_rank = rank;
        let (lo, hi) = (rank * p, (rank + 1) * p);
        assert!(
            r.pages.iter().all(|&g| g >= lo && g < hi),
            "request {} on rank {rank}: pages {:?} outside [{lo}, {hi})",
            r.id,
            r.pages
        );
        assert!(
            r.out_slots.iter().all(|&x| x >= lo * ps && x < hi * ps),
            "request {} on rank {rank}: out slots {:?} outside its range",
            r.id,
            r.out_slots
        );
    }
    // The wire form carries it unchanged (offsets of the flat arrays are derived from it).
    let back = BatchPlan::decode(&plan.encode().unwrap()).unwrap();
    assert_eq!(&back, plan);
}

/// Drives the data-parallel scheduler the way the engine does (overlap on or off), checking
/// every plan and every invariant.
struct DpDriver {
    overlap: bool,
    in_flight: Option<BatchPlan>,
    references: u64,
}

impl DpDriver {
    fn new(overlap: bool) -> Self {
        Self {
            overlap,
            in_flight: None,
            references: 0,
        }
    }

    fn step(
        &mut self,
        s: &mut DataParallelScheduler,
        exec: &mut FakeExecutor,
        n: u64,
        out: &mut HashMap<RequestId, Outcome>,
    ) -> bool {
        if !self.overlap {
            let Some(plan) = s.schedule(n) else {
                s.check_invariants().unwrap();
                return false;
            };
            check_dp_plan(s, &plan);
            s.check_invariants().unwrap();
            let result = exec.run(&plan);
            record(out, s.on_result(&plan, &result));
            s.check_invariants().unwrap();
            return true;
        }
        let next = s.schedule(n);
        s.check_invariants().unwrap();
        if let Some(plan) = &next {
            check_dp_plan(s, plan);
            for r in plan.requests.iter().filter(|r| r.input_prev_row >= 0) {
                let prev = self
                    .in_flight
                    .as_ref()
                    .expect("a reference needs a step in flight");
                let row = &prev.requests[r.input_prev_row as usize];
                assert!(
                    row.id == r.id && row.sample,
                    "request {}: input_prev_row {} names request {} of step {}",
                    r.id,
                    r.input_prev_row,
                    row.id,
                    prev.step
                );
                self.references += 1;
            }
            if let Some(prev) = &self.in_flight {
                check_no_reuse_in_flight(prev, plan);
            }
        }
        let had = self.in_flight.is_some();
        if let Some(prev) = self.in_flight.take() {
            let result = exec.run(&prev);
            record(out, s.on_result(&prev, &result));
            s.check_invariants().unwrap();
        }
        self.in_flight = next;
        had || self.in_flight.is_some()
    }

    fn workers_died(&mut self, exec: &mut FakeExecutor) {
        self.in_flight = None;
        exec.forget_previous_step();
    }
}

fn run_to_end(
    s: &mut DataParallelScheduler,
    exec: &mut FakeExecutor,
    driver: &mut DpDriver,
    out: &mut HashMap<RequestId, Outcome>,
    mut n: u64,
) -> u64 {
    let start = n;
    while driver.step(s, exec, n, out) {
        n += 1;
        assert!(n - start < 100_000, "no progress");
    }
    n
}

fn pool_whole(s: &DataParallelScheduler) {
    let st = s.stats();
    assert_eq!((st.running, st.waiting), (0, 0));
    assert_eq!(
        st.pages_free + st.pages_cached,
        st.pages_total,
        "pages leaked"
    );
}

#[test]
fn limits_split_over_ranks_and_stats_sum() {
    let mut cfg = config(4, 30);
    cfg.max_running_requests = 5;
    cfg.max_prefill_tokens = 7;
    let s = DataParallelScheduler::new(cfg, 3);
    assert_eq!(s.dp_size(), 3);
    for r in 0..3 {
        let c = s.rank(r).config();
        assert_eq!(
            (c.num_pages, c.max_running_requests, c.max_prefill_tokens),
            (10, 2, 3)
        );
    }
    let st = s.stats();
    assert_eq!((st.pages_total, st.pages_free), (30, 30));
    assert_eq!(s.config().num_pages, 30);
}

#[test]
fn requests_spread_to_the_least_loaded_rank() {
    let mut s = dp(4, 16, 2);
    for id in 0..5 {
        s.submit(id, request(seq(6, 100 * id as i32), 4, vec![]))
            .unwrap();
    }
    let ranks: Vec<usize> = (0..5).map(|id| s.rank_of(id).unwrap()).collect();
    assert_eq!(ranks, vec![0, 1, 0, 1, 0]);
    assert_eq!(
        (s.rank(0).stats().waiting, s.rank(1).stats().waiting),
        (3, 2)
    );
    assert_eq!(s.stats().waiting, 5);
}

#[test]
fn submit_errors_are_those_of_one_rank_and_the_queue_bound_is_global() {
    let mut cfg = config(4, 16);
    cfg.max_waiting = 3;
    let mut s = DataParallelScheduler::new(cfg, 2);
    assert!(matches!(
        s.submit(1, request(vec![], 4, vec![])),
        Err(SubmitError::Invalid(_))
    ));
    // 33 KV tokens need 9 pages of 4: more than one rank's 8, though both ranks have 16.
    assert!(matches!(
        s.submit(1, request(seq(30, 0), 4, vec![])),
        Err(SubmitError::Invalid(_))
    ));
    s.submit(1, request(seq(30, 0), 3, vec![])).unwrap();
    s.submit(2, request(seq(3, 0), 3, vec![])).unwrap();
    // The id is on rank 0; the new request would go to rank 1.
    assert!(matches!(
        s.submit(1, request(seq(3, 0), 3, vec![])),
        Err(SubmitError::Invalid(_))
    ));
    s.submit(3, request(seq(3, 0), 3, vec![])).unwrap();
    assert!(matches!(
        s.submit(4, request(seq(3, 0), 3, vec![])),
        Err(SubmitError::Overloaded(_))
    ));
    assert_eq!(s.stats().waiting, 3);
}

#[test]
fn a_request_goes_to_the_rank_caching_its_prefix() {
    let mut s = dp(4, 32, 2);
    let mut exec = FakeExecutor::new(s.config());
    let mut out = HashMap::new();
    let mut driver = DpDriver::new(false);
    let (a, b) = (seq(20, 1000), seq(20, 2000));
    s.submit(1, request(a.clone(), 2, vec![])).unwrap();
    s.submit(2, request(b.clone(), 2, vec![])).unwrap();
    assert_eq!((s.rank_of(1), s.rank_of(2)), (Some(0), Some(1)));
    let n = run_to_end(&mut s, &mut exec, &mut driver, &mut out, 1);
    assert!(s.rank(1).stats().pages_cached > 0);

    // Both ranks idle and equal but for the cache: B's prefix goes to rank 1, not rank 0.
    let mut c = b[..16].to_vec();
    c.extend(seq(5, 3000));
    s.submit(3, request(c.clone(), 3, vec![])).unwrap();
    assert_eq!(s.rank_of(3), Some(1));
    // Rank 1 is busier now, yet A's prefix still goes to rank 0 ...
    s.submit(4, request(a[..12].to_vec(), 3, vec![])).unwrap();
    assert_eq!(s.rank_of(4), Some(0));
    // ... and B's too goes to rank 1, though rank 0 has fewer requests.
    s.submit(5, request(b.clone(), 3, vec![])).unwrap();
    assert_eq!(s.rank_of(5), Some(1));
    // No prefix anywhere: the least loaded rank.
    s.submit(6, request(seq(9, 5000), 3, vec![])).unwrap();
    assert_eq!(s.rank_of(6), Some(0));

    let hits_before = s.stats().prefix_hit_tokens_total;
    run_to_end(&mut s, &mut exec, &mut driver, &mut out, n);
    assert!(s.stats().prefix_hit_tokens_total >= hits_before + 16 + 8 + 16);
    check_outcome(3, &request(c, 3, vec![]), &out[&3], 4096);
    check_outcome(5, &request(b, 3, vec![]), &out[&5], 4096);
    pool_whole(&s);
}

#[test]
fn with_the_radix_cache_off_admission_ignores_prefixes() {
    let mut cfg = config(4, 64);
    cfg.disable_radix_cache = true;
    let mut s = DataParallelScheduler::new(cfg, 2);
    let mut exec = FakeExecutor::new(s.config());
    let mut out = HashMap::new();
    let mut driver = DpDriver::new(true);
    s.submit(1, request(seq(20, 0), 2, vec![])).unwrap();
    s.submit(2, request(seq(20, 500), 2, vec![])).unwrap();
    let n = run_to_end(&mut s, &mut exec, &mut driver, &mut out, 1);
    s.submit(3, request(seq(20, 500), 2, vec![])).unwrap();
    assert_eq!(s.rank_of(3), Some(0));
    run_to_end(&mut s, &mut exec, &mut driver, &mut out, n);
    pool_whole(&s);
}

#[test]
fn combined_plans_offset_pages_slots_and_overlap_references() {
    for overlap in [false, true] {
        let mut s = dp(4, 24, 3);
        let mut exec = FakeExecutor::new(s.config());
        let mut out = HashMap::new();
        let mut driver = DpDriver::new(overlap);
        let reqs: Vec<GenerateRequest> = (0..9)
            .map(|k| request(seq(3 + 2 * k, 100 * k as i32), 5 + k as u32, vec![]))
            .collect();
        for (id, r) in reqs.iter().enumerate() {
            s.submit(id as u64, r.clone()).unwrap();
        }
        let mut n = 1;
        let mut first = true;
        while driver.step(&mut s, &mut exec, n, &mut out) {
            if first {
                // The first plan holds every rank's requests, rank by rank, pages moved.
                let plan = driver.in_flight.clone().unwrap_or_else(|| {
                    // Without overlap the plan is committed already; plan again from the
                    // start to look at it.
                    let mut t = dp(4, 24, 3);
                    for (id, r) in reqs.iter().enumerate() {
                        t.submit(id as u64, r.clone()).unwrap();
                    }
                    t.schedule(1).unwrap()
                });
                let ranks: Vec<usize> = plan
                    .requests
                    .iter()
                    .map(|r| (r.pages[0] / 24) as usize)
                    .collect();
                assert_eq!(ranks, vec![0, 0, 0, 1, 1, 1, 2, 2, 2]);
                assert_eq!(plan.requests[3].pages[0], 24);
                assert_eq!(plan.requests[6].out_slots[0], 48 * 4);
                first = false;
            }
            n += 1;
        }
        for (id, r) in reqs.iter().enumerate() {
            check_outcome(id as u64, r, &out[&(id as u64)], 4096);
        }
        if overlap {
            assert!(driver.references > 20, "{} references", driver.references);
        }
        pool_whole(&s);
    }
}

#[test]
fn a_rank_going_idle_keeps_the_other_ranks_references_right() {
    // Rank 0's request ends early, so rank 1's rows move up in the combined plan while its
    // requests still reference rows of the previous plan.
    let mut s = dp(4, 32, 2);
    let mut exec = FakeExecutor::new(s.config());
    let mut out = HashMap::new();
    let mut driver = DpDriver::new(true);
    let reqs = [
        request(seq(5, 0), 2, vec![]),
        request(seq(5, 100), 12, vec![]),
        request(seq(5, 200), 3, vec![]),
        request(seq(5, 300), 12, vec![]),
    ];
    for (id, r) in reqs.iter().enumerate() {
        s.submit(id as u64, r.clone()).unwrap();
    }
    assert_eq!(s.rank_of(2), Some(0));
    run_to_end(&mut s, &mut exec, &mut driver, &mut out, 1);
    for (id, r) in reqs.iter().enumerate() {
        check_outcome(id as u64, r, &out[&(id as u64)], 4096);
    }
    assert!(driver.references > 10);
    pool_whole(&s);
}

#[test]
fn preemption_on_one_rank_leaves_the_other_alone() {
    for overlap in [false, true] {
        // 8 pages of 4 per rank; two long requests on rank 0 cannot both fit.
        let mut s = dp(4, 8, 2);
        let mut exec = FakeExecutor::new(s.config());
        let mut out = HashMap::new();
        let mut driver = DpDriver::new(overlap);
        let long_a = request(seq(8, 0), 20, vec![]);
        let short = request(seq(4, 500), 3, vec![]);
        let long_c = request(seq(8, 900), 20, vec![]);
        s.submit(1, long_a.clone()).unwrap();
        s.submit(2, short.clone()).unwrap();
        s.submit(3, long_c.clone()).unwrap();
        assert_eq!(
            (s.rank_of(1), s.rank_of(2), s.rank_of(3)),
            (Some(0), Some(1), Some(0))
        );
        run_to_end(&mut s, &mut exec, &mut driver, &mut out, 1);
        assert!(s.rank(0).stats().preemptions_total > 0);
        assert_eq!(s.rank(1).stats().preemptions_total, 0);
        assert_eq!(
            s.stats().preemptions_total,
            s.rank(0).stats().preemptions_total
        );
        check_outcome(1, &long_a, &out[&1], 4096);
        check_outcome(2, &short, &out[&2], 4096);
        check_outcome(3, &long_c, &out[&3], 4096);
        pool_whole(&s);
    }
}

#[test]
fn an_abort_or_a_failure_on_one_rank_leaves_the_other_alone() {
    for overlap in [false, true] {
        let mut s = dp(4, 16, 2);
        let mut exec = FakeExecutor::new(s.config());
        let mut out = HashMap::new();
        let mut driver = DpDriver::new(overlap);
        let reqs: Vec<GenerateRequest> = (0..4)
            .map(|k| request(seq(6, 100 * k), 10, vec![]))
            .collect();
        for (id, r) in reqs.iter().enumerate() {
            s.submit(id as u64, r.clone()).unwrap();
        }
        // 0 and 2 on rank 0, 1 and 3 on rank 1.
        let mut n = 1;
        for _ in 0..3 {
            driver.step(&mut s, &mut exec, n, &mut out);
            n += 1;
        }
        let rank1 = s.rank(1).stats();
        assert!(s.abort(0));
        assert!(!s.abort(0));
        exec.fail_next.insert(2);
        assert_eq!(
            s.rank(1).stats(),
            rank1,
            "an abort on rank 0 touched rank 1"
        );
        run_to_end(&mut s, &mut exec, &mut driver, &mut out, n);
        assert!(out[&2].failed.is_some());
        check_outcome(1, &reqs[1], &out[&1], 4096);
        check_outcome(3, &reqs[3], &out[&3], 4096);
        let (r0, r1) = (s.rank(0).stats().requests, s.rank(1).stats().requests);
        assert_eq!((r0.aborted, r0.failed, r0.finished), (1, 1, 0));
        assert_eq!((r1.aborted, r1.failed, r1.finished), (0, 0, 2));
        assert!(!s.abort(0));
        assert!(!s.abort(77));
        pool_whole(&s);
    }
}

#[test]
fn fail_all_empties_every_rank() {
    let mut s = dp(4, 16, 2);
    let mut exec = FakeExecutor::new(s.config());
    let mut out = HashMap::new();
    let mut driver = DpDriver::new(true);
    for id in 0..5 {
        s.submit(id, request(seq(6, 10 * id as i32), 10, vec![]))
            .unwrap();
    }
    driver.step(&mut s, &mut exec, 1, &mut out);
    driver.step(&mut s, &mut exec, 2, &mut out);
    driver.workers_died(&mut exec);
    let events = s.fail_all("gone");
    assert_eq!(events.len(), 5);
    assert!(events.iter().all(|(_, e)| matches!(
        e,
        GenerateEvent::Failed {
            retryable: true,
            ..
        }
    )));
    s.check_invariants().unwrap();
    let st = s.stats();
    assert_eq!((st.pages_free, st.running, st.waiting), (32, 0, 0));
    assert_eq!(st.requests.failed, 5);
    // Serving goes on with fresh step numbers after a restart of the same scheduler.
    s.submit(9, request(seq(6, 0), 4, vec![])).unwrap();
    run_to_end(&mut s, &mut exec, &mut driver, &mut out, 3);
    check_outcome(9, &request(seq(6, 0), 4, vec![]), &out[&9], 4096);
}

/// A random workload: submits sharing prefixes, steps, aborts, injected failures and worker
/// deaths on tiny pools.
fn random_case(seed: u64, ranks: usize, overlap: bool) {
    let mut rng = Rng::new(seed);
    let page_size = [1u32, 2, 4][rng.below(3) as usize];
    let mut cfg = SchedulerConfig {
        page_size,
        num_pages: (6 + rng.below(30) as u32) * ranks as u32,
        max_running_requests: 1 + rng.below(10) as usize,
        max_prefill_tokens: 2 + rng.below(48) as usize,
        chunked_prefill_size: (rng.below(4) != 0).then(|| 1 + rng.below(16) as usize),
        disable_radix_cache: rng.below(4) == 0,
        max_context: 64,
        max_waiting: 24,
        priority: None,
    };
    // Priority scheduling in a third of the cases, drawn apart so the other draws stay as
    // they were: small thresholds, so victims (in flight or not) are chosen often.
    let mut prio_rng = Rng::new(seed ^ 0x5eed_9e1a);
    if prio_rng.below(3) == 0 {
        cfg.priority = Some(PriorityPolicy {
            low_values_first: prio_rng.below(2) == 0,
            preemption_threshold: prio_rng.below(4) as u32,
        });
    }
    if cfg.max_prefill_tokens < ranks {
        cfg.max_prefill_tokens = ranks;
    }
    let bases: Vec<Vec<i32>> = (0..3)
        .map(|i| (0..24).map(|k| 100 * (i + 1) + k).collect())
        .collect();
    let mut s = DataParallelScheduler::new(cfg.clone(), ranks);
    let mut exec = FakeExecutor::new(s.config());
    let mut out: HashMap<u64, Outcome> = HashMap::new();
    let mut submitted: Vec<(u64, GenerateRequest)> = Vec::new();
    let mut aborted = HashSet::new();
    let mut driver = DpDriver::new(overlap);
    let mut n = 1u64;
    for _ in 0..120 {
        match rng.below(13) {
            0..=3 => {
                let b = &bases[rng.below(3) as usize];
                let mut prompt = b[..rng.below(24) as usize].to_vec();
                prompt.extend((0..rng.below(10)).map(|_| rng.below(50) as i32));
                let mut req = request(prompt, rng.below(12) as u32, vec![]);
                if rng.below(3) == 0 {
                    req.stop_token_ids.push(rng.below(VOCAB) as i32);
                }
                req.prompt_logprobs = rng.below(7) == 0;
                req.priority = prio_rng.below(8) as i32;
                if rng.below(5) == 0 {
                    req.sampling = SamplingParams {
                        frequency_penalty: 0.5,
                        ..Default::default()
                    };
                }
                let id = submitted.len() as u64;
                if s.submit(id, req.clone()).is_ok() {
                    submitted.push((id, req));
                }
            }
            4..=9 => {
                if driver.step(&mut s, &mut exec, n, &mut out) {
                    n += 1;
                }
            }
            10 => {
                if !submitted.is_empty() {
                    let id = rng.below(submitted.len() as u64);
                    let live = !out
                        .get(&id)
                        .is_some_and(|o| o.finish.is_some() || o.failed.is_some());
                    assert_eq!(s.abort(id), live && !aborted.contains(&id), "abort {id}");
                    aborted.insert(id);
                    s.check_invariants().unwrap();
                }
            }
            11 => {
                if !submitted.is_empty() {
                    exec.fail_next.insert(rng.below(submitted.len() as u64));
                }
            }
            _ => {
                if rng.below(8) == 0 {
                    driver.workers_died(&mut exec);
                    record(&mut out, s.fail_all("workers died"));
                    s.check_invariants().unwrap();
                    let st = s.stats();
                    assert_eq!(
                        (st.pages_free, st.running, st.waiting),
                        (st.pages_total, 0, 0)
                    );
                }
            }
        }
    }
    exec.fail_next.clear();
    run_to_end(&mut s, &mut exec, &mut driver, &mut out, n);
    pool_whole(&s);
    for (id, req) in &submitted {
        let o = out.get(id).cloned().unwrap_or_default();
        let ended =
            o.finish.is_some() as u32 + o.failed.is_some() as u32 + aborted.contains(id) as u32;
        assert!(ended >= 1, "request {id} never ended");
        if o.finish.is_some() {
            check_outcome(*id, req, &o, cfg.max_context);
        }
    }
    let c = s.stats().requests;
    assert_eq!(c.submitted, submitted.len() as u64);
    assert_eq!(c.submitted, c.finished + c.aborted + c.failed);
}

#[test]
fn random_workloads_keep_every_rank_consistent() {
    for seed in 0..300 {
        random_case(seed, 2 + (seed % 3) as usize, seed % 2 == 0);
    }
}

/// With one rank the data-parallel scheduler is the plain scheduler: the same plans, events and
/// statistics on a random workload, overlap on and off.
#[test]
fn one_rank_is_the_plain_scheduler() {
    for seed in 0..40u64 {
        let overlap = seed % 2 == 1;
        let mut rng = Rng::new(1000 + seed);
        let mut cfg = config(
            [1u32, 4, 16][rng.below(3) as usize],
            8 + rng.below(40) as u32,
        );
        cfg.max_running_requests = 1 + rng.below(8) as usize;
        cfg.max_prefill_tokens = 4 + rng.below(64) as usize;
        cfg.chunked_prefill_size = Some(1 + rng.below(32) as usize);
        cfg.max_context = 128;
        cfg.max_waiting = 16;
        let mut plain = Scheduler::new(cfg.clone());
        let mut one = DataParallelScheduler::new(cfg.clone(), 1);
        let mut exec_a = FakeExecutor::new(&cfg);
        let mut exec_b = FakeExecutor::new(&cfg);
        let (mut flight_a, mut flight_b): (Option<BatchPlan>, Option<BatchPlan>) = (None, None);
        let base: Vec<i32> = (0..40).collect();
        let mut n = 1;
        let mut next_id = 0u64;
        for _ in 0..300 {
            match rng.below(8) {
                0..=2 => {
                    let mut prompt = base[..rng.below(40) as usize].to_vec();
                    prompt.extend((0..1 + rng.below(20)).map(|_| rng.below(VOCAB) as i32));
                    let req = request(prompt, rng.below(30) as u32, vec![7, 11]);
                    let (a, b) = (plain.submit(next_id, req.clone()), one.submit(next_id, req));
                    assert_eq!(format!("{a:?}"), format!("{b:?}"));
                    next_id += 1;
                }
                3 if next_id > 0 => {
                    let id = rng.below(next_id);
                    assert_eq!(plain.abort(id), one.abort(id));
                }
                _ => {
                    let (pa, pb) = (plain.schedule(n), one.schedule(n));
                    assert_eq!(pa, pb, "plans differ at step {n}");
                    if pa.is_some() {
                        n += 1;
                    }
                    if !overlap {
                        flight_a = None;
                        flight_b = None;
                        if let (Some(a), Some(b)) = (&pa, &pb) {
                            let (ra, rb) = (exec_a.run(a), exec_b.run(b));
                            let (ea, eb) = (plain.on_result(a, &ra), one.on_result(b, &rb));
                            assert_eq!(format!("{ea:?}"), format!("{eb:?}"));
                        }
                    } else {
                        if let (Some(a), Some(b)) = (flight_a.take(), flight_b.take()) {
                            let (ra, rb) = (exec_a.run(&a), exec_b.run(&b));
                            let (ea, eb) = (plain.on_result(&a, &ra), one.on_result(&b, &rb));
                            assert_eq!(format!("{ea:?}"), format!("{eb:?}"));
                        }
                        flight_a = pa;
                        flight_b = pb;
                    }
                }
            }
            assert_eq!(plain.stats(), one.stats());
            one.check_invariants().unwrap();
        }
    }
}

#[test]
fn penalty_histories_and_their_release_cross_ranks_intact() {
    // Rank 0 of the workers holds every penalised request's history, whichever attention rank
    // the request lives on: the combined plan must carry each rank's deltas and released ids.
    let mut s = dp(4, 40, 3);
    let mut exec = FakeExecutor::new(s.config());
    let mut out = HashMap::new();
    let penalised = SamplingParams {
        repetition_penalty: 1.2,
        ..Default::default()
    };
    let reqs: Vec<GenerateRequest> = (0..9)
        .map(|k| {
            let mut r = request(seq(3 + k, 50 * k as i32), 3 + 2 * k as u32, vec![]);
            if k < 6 {
                r.sampling = penalised.clone(); // the last three outlive them, unpenalised
            }
            r
        })
        .collect();
    for (id, r) in reqs.iter().enumerate() {
        s.submit(id as u64, r.clone()).unwrap();
    }
    let mut held = HeldHistories::default();
    let mut released: HashSet<u64> = HashSet::new();
    let mut rank_of: HashMap<u64, usize> = HashMap::new();
    let mut n = 1;
    while let Some(plan) = s.schedule(n) {
        check_dp_plan(&s, &plan);
        held.apply(&plan);
        for id in &plan.released {
            assert!(released.insert(*id), "request {id} released twice");
        }
        for r in &plan.requests {
            rank_of.insert(
                r.id,
                s.rank_of(r.id).expect("a planned request is on a rank"),
            );
            if r.sample && r.id < 6 {
                assert_eq!(
                    held.0[&r.id].len() as i32,
                    r.seq_len(),
                    "request {} step {n}",
                    r.id
                );
            } else {
                assert!(r.history.is_empty() && !r.history_reset);
            }
        }
        let result = exec.run(&plan);
        record(&mut out, s.on_result(&plan, &result));
        n += 1;
    }
    for (id, r) in reqs.iter().enumerate() {
        check_outcome(id as u64, r, &out[&(id as u64)], 4096);
    }
    let ranks: HashSet<usize> = released.iter().map(|id| rank_of[id]).collect();
    assert!(
        released.len() == 6 && ranks.len() > 1,
        "released {released:?}"
    );
    pool_whole(&s);
}

#[test]
fn a_rank_gone_idle_still_releases_its_ended_requests_histories() {
    // A penalised request ends on rank 0 while rank 1 runs on: rank 0 plans nothing more, yet
    // the next combined plan must say the request is released (else rank 0 of the workers
    // would hold its history until rank 0 of attention got work again).
    let mut s = dp(4, 40, 2);
    let mut exec = FakeExecutor::new(s.config());
    let mut out = HashMap::new();
    let mut short = request(seq(4, 0), 2, vec![]);
    short.sampling = SamplingParams {
        frequency_penalty: 0.5,
        ..Default::default()
    };
    s.submit(1, short).unwrap();
    s.submit(2, request(seq(4, 100), 12, vec![])).unwrap();
    assert_ne!(s.rank_of(1), s.rank_of(2));
    let mut released_at = None;
    let mut n = 1;
    while let Some(plan) = s.schedule(n) {
        if plan.released.contains(&1) {
            released_at = Some(n);
        }
        let result = exec.run(&plan);
        record(&mut out, s.on_result(&plan, &result));
        n += 1;
    }
    let ended = out[&1].finish.is_some();
    assert!(
        ended && released_at.is_some(),
        "request 1 was never released"
    );
    assert!(
        released_at.unwrap() <= 4,
        "released late, at step {released_at:?}"
    );
}
