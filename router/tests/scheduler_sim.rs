//! Long simulation: thousands of requests with shared system prompts, random lengths, stop
//! tokens, aborts, and a pool small enough that eviction and preemption happen all the time.
//! Every request must end (finished ones with exactly the reference output) and the pool must
//! come back whole. The default tests run 2,000 requests with overlap off and on (outputs equal
//! the reference either way, so they are identical); the ignored one 10,000.

mod scheduler_common;

use std::collections::{HashMap, HashSet};

use nsaserve_router::engine::GenerateRequest;
use nsaserve_router::scheduler::{PriorityPolicy, Scheduler, SchedulerConfig};
use scheduler_common::*;

fn simulate(total: usize, seed: u64, overlap: bool, priority: Option<PriorityPolicy>) {
    let cfg = SchedulerConfig {
        page_size: 16,
        num_pages: 120,
        max_running_requests: 48,
        max_prefill_tokens: 512,
        chunked_prefill_size: Some(256),
        disable_radix_cache: false,
        max_context: 2048,
        max_waiting: 1_000_000,
        priority,
    };
    let mut rng = Rng::new(seed);
    let mut salt_rng = Rng::new(seed ^ 0x5a17);
    let systems: Vec<Vec<i32>> = (0..8)
        .map(|s| {
            (0..rng.below(300) as i32)
                .map(|k| 10_000 * (s + 1) + k)
                .collect()
        })
        .collect();
    let stops: Vec<i32> = (0..10).map(|k| k * 97).collect();

    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out: HashMap<u64, Outcome> = HashMap::new();
    let mut reqs: Vec<GenerateRequest> = Vec::new();
    let mut aborted: HashSet<u64> = HashSet::new();
    let mut n = 0u64;
    let mut driver = Driver::new(overlap);
    while reqs.len() < total || s.stats().running + s.stats().waiting > 0 || driver.busy() {
        for _ in 0..rng.below(4) {
            if reqs.len() == total {
                break;
            }
            let mut prompt = systems[rng.below(8) as usize].clone();
            prompt.extend((0..1 + rng.below(200)).map(|_| rng.below(VOCAB) as i32));
            let mut req = request(prompt, 1 + rng.below(160) as u32, stops.clone());
            req.prompt_logprobs = rng.below(50) == 0;
            // Under priority scheduling: urgencies 0-39, so some pairs differ by more than
            // the threshold and preempt, others do not.
            req.priority = rng.below(40) as i32;
            // A quarter under each of two salts: their pages are shared only within the salt.
            req.cache_salt = match salt_rng.below(4) {
                0 => Some("tenant-a".into()),
                1 => Some("tenant-b".into()),
                _ => None,
            };
            let id = reqs.len() as u64;
            s.submit(id, req.clone())
                .expect("every simulated request fits");
            reqs.push(req);
        }
        if rng.below(40) == 0 && !reqs.is_empty() {
            let id = rng.below(reqs.len() as u64);
            let live = !out
                .get(&id)
                .is_some_and(|o| o.finish.is_some() || o.failed.is_some());
            if live && !aborted.contains(&id) {
                assert!(s.abort(id));
                aborted.insert(id);
            }
        }
        driver.step(&mut s, &mut exec, n, &mut out);
        n += 1;
        assert!(n < 50 * total as u64 + 10_000, "no progress");
    }
    let st = s.stats();
    assert_eq!(
        st.pages_free + st.pages_cached,
        st.pages_total,
        "pages leaked"
    );
    assert!(
        st.preemptions_total > 0,
        "the pool was meant to be tight enough to preempt"
    );
    assert!(st.prefix_hit_tokens_total > 0);
    let mut finished = 0;
    for (id, req) in reqs.iter().enumerate() {
        let id = id as u64;
        match out.get(&id) {
            Some(o) if o.finish.is_some() => {
                check_outcome(id, req, o, cfg.max_context);
                finished += 1;
            }
            _ => assert!(aborted.contains(&id), "request {id} never ended"),
        }
    }
    assert!(finished + aborted.len() == total);
    assert_eq!(
        overlap,
        driver.references > 0,
        "overlap planned steps ahead"
    );
    eprintln!(
        "{total} requests, {n} steps, {} preemptions, {} of {} prompt tokens from the cache",
        st.preemptions_total, st.prefix_hit_tokens_total, st.prompt_tokens_total
    );
}

#[test]
fn two_thousand_requests_all_end_and_the_pool_returns() {
    simulate(2_000, 1, false, None);
}

#[test]
fn two_thousand_requests_with_overlap_all_end_and_the_pool_returns() {
    simulate(2_000, 1, true, None);
}

#[test]
fn two_thousand_prioritised_requests_all_end_and_the_pool_returns() {
    let policy = |low_values_first| {
        Some(PriorityPolicy {
            low_values_first,
            preemption_threshold: 10,
        })
    };
    simulate(2_000, 3, false, policy(false));
    simulate(2_000, 3, true, policy(true));
}

#[test]
#[ignore = "long: about ten times the default simulation"]
fn ten_thousand_requests_all_end_and_the_pool_returns() {
    simulate(10_000, 2, true, None);
}
