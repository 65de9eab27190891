//! Property tests: random sequences of submits (with shared prefixes), steps, aborts, worker
//! errors and worker deaths on tiny pools, so eviction and preemption happen constantly.
//! After every step the plan is valid and alias-free and every internal invariant holds; at
//! the end every request ended exactly once, finished ones match the reference output, and
//! the pool is whole again (free + cached == total). Half the cases run with overlap (step N+1
//! planned before step N's result), where aborts and failures meet requests in flight.

mod scheduler_common;

use std::collections::HashMap;

use nsaserve_router::engine::GenerateRequest;
use nsaserve_router::protocol::SamplingParams;
use nsaserve_router::scheduler::{Scheduler, SchedulerConfig};
use proptest::prelude::*;
use scheduler_common::*;

#[derive(Debug, Clone)]
enum Op {
    Submit {
        base: usize,
        prefix: usize,
        suffix: Vec<i32>,
        max_new: u32,
        stop: Option<i32>,
        prompt_lp: bool,
        penalty: bool,
    },
    Step,
    Abort(usize),
    FailOne(usize),
    FailAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..24usize, prop::collection::vec(0..50i32, 0..10), 0..12u32, prop::option::of(0..VOCAB as i32), prop::bool::weighted(0.15), prop::bool::weighted(0.2))
            .prop_map(|(base, prefix, suffix, max_new, stop, prompt_lp, penalty)| Op::Submit { base, prefix, suffix, max_new, stop, prompt_lp, penalty }),
        6 => Just(Op::Step),
        1 => (0..64usize).prop_map(Op::Abort),
        1 => (0..64usize).prop_map(Op::FailOne),
        1 => prop::bool::weighted(0.1).prop_map(|b| if b { Op::FailAll } else { Op::Step }),
    ]
}

fn cfg() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop_oneof![Just(1u32), Just(2), Just(4)],
        6..40u32,
        1..8usize,
        2..48usize,
        prop::option::of(1..16usize),
        prop::bool::weighted(0.25),
    )
        .prop_map(
            |(page_size, num_pages, max_running, budget, chunk, no_radix)| SchedulerConfig {
                page_size,
                num_pages,
                max_running_requests: max_running,
                max_prefill_tokens: budget,
                chunked_prefill_size: chunk,
                disable_radix_cache: no_radix,
                max_context: 64,
                max_waiting: 16,
                priority: None,
            },
        )
}

/// Three base prompts that requests share prefixes of.
fn base(i: usize) -> Vec<i32> {
    (0..24).map(|k| 100 * (i as i32 + 1) + k).collect()
}

fn run_case(cfg: SchedulerConfig, ops: Vec<Op>, overlap: bool) {
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out: HashMap<u64, Outcome> = HashMap::new();
    let mut submitted: Vec<(u64, GenerateRequest)> = Vec::new();
    let mut aborted = std::collections::HashSet::new();
    let mut n = 0u64;
    let mut driver = Driver::new(overlap);
    for op in ops {
        match op {
            Op::Submit {
                base: b,
                prefix,
                suffix,
                max_new,
                stop,
                prompt_lp,
                penalty,
            } => {
                let mut prompt = base(b)[..prefix].to_vec();
                prompt.extend(suffix);
                let mut req = request(prompt, max_new, stop.into_iter().collect());
                req.prompt_logprobs = prompt_lp;
                if penalty {
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
            Op::Step => {
                driver.step(&mut s, &mut exec, n, &mut out);
                n += 1;
            }
            Op::Abort(k) => {
                if let Some((id, _)) = submitted.get(k) {
                    let live = !out
                        .get(id)
                        .is_some_and(|o| o.finish.is_some() || o.failed.is_some());
                    assert_eq!(s.abort(*id), live && !aborted.contains(id), "abort {id}");
                    aborted.insert(*id);
                    s.check_invariants().unwrap();
                }
            }
            Op::FailOne(k) => {
                if let Some((id, _)) = submitted.get(k) {
                    exec.fail_next.insert(*id);
                }
            }
            Op::FailAll => {
                // The workers died: a step in flight never comes back.
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
    exec.fail_next.clear();
    let mut idle = 0;
    while driver.step(&mut s, &mut exec, n, &mut out) {
        n += 1;
        idle += 1;
        assert!(idle < 5_000, "no progress");
    }
    let st = s.stats();
    assert_eq!((st.running, st.waiting), (0, 0));
    assert_eq!(
        st.pages_free + st.pages_cached,
        st.pages_total,
        "pages leaked"
    );
    for (id, req) in &submitted {
        let o = out.get(id).cloned().unwrap_or_default();
        let ended =
            o.finish.is_some() as u32 + o.failed.is_some() as u32 + aborted.contains(id) as u32;
        assert!(ended >= 1, "request {id} never ended");
        if o.finish.is_some() {
            check_outcome(*id, req, &o, cfg.max_context);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_the_pool_and_the_outputs_right(cfg in cfg(), ops in prop::collection::vec(op(), 1..80), overlap in prop::bool::ANY) {
        run_case(cfg, ops, overlap);
    }
}
