//! The founding matrix in miniature: the same prompts give the same outputs whether they run
//! alone or among many other requests (sharing their prefixes, preempting each other), with
//! the radix cache on or off and chunked prefill on or off. The fake executor's token is a
//! function of the sequence it reads back through the plan's page table, so any mix-up of
//! cached and fresh requests in one batch shows as a different output.

mod scheduler_common;

use std::collections::HashMap;

use nsaserve_router::engine::GenerateRequest;
use nsaserve_router::scheduler::{Scheduler, SchedulerConfig, SchedulerStats};
use scheduler_common::*;

fn cfg(radix: bool, chunk: Option<usize>) -> SchedulerConfig {
    SchedulerConfig {
        page_size: 8,
        num_pages: 64,
        max_running_requests: 32,
        max_prefill_tokens: 192,
        chunked_prefill_size: chunk,
        disable_radix_cache: !radix,
        max_context: 1024,
        max_waiting: 10_000,
        priority: None,
    }
}

fn probes() -> Vec<GenerateRequest> {
    let system: Vec<i32> = (0..100).collect();
    (0..6)
        .map(|i| {
            let mut p = system[..40 + 12 * i].to_vec();
            p.extend([500 + i as i32, 7, 7]);
            request(p, 40, vec![3, 141])
        })
        .collect()
}

/// Runs `reqs` through one scheduler; they arrive `per_step` at a time.
fn run(
    cfg: &SchedulerConfig,
    reqs: &[GenerateRequest],
    per_step: usize,
) -> (HashMap<u64, Outcome>, SchedulerStats) {
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(cfg);
    let mut out = HashMap::new();
    let mut next = 0;
    let mut n = 0;
    loop {
        for _ in 0..per_step {
            if next < reqs.len() {
                s.submit(next as u64, reqs[next].clone()).unwrap();
                next += 1;
            }
        }
        if !step(&mut s, &mut exec, n, &mut out) && next == reqs.len() {
            break;
        }
        n += 1;
    }
    let st = s.stats();
    assert_eq!(st.pages_free + st.pages_cached, st.pages_total);
    (out, st)
}

#[test]
fn outputs_do_not_depend_on_batch_mates_cache_or_chunking() {
    let probes = probes();
    let alone: Vec<Vec<i32>> = probes
        .iter()
        .map(|p| {
            run(&cfg(false, None), std::slice::from_ref(p), 1).0[&0]
                .tokens
                .clone()
        })
        .collect();
    // Crowd: probes interleaved with requests sharing their prefixes, and repeats of the
    // probes themselves so later copies hit the cache built by earlier ones.
    let mut rng = Rng::new(7);
    let mut crowd = Vec::new();
    let mut probe_ids = Vec::new();
    for round in 0..3 {
        for (i, p) in probes.iter().enumerate() {
            probe_ids.push((crowd.len() as u64, i));
            crowd.push(p.clone());
            for _ in 0..3 + round {
                let mut q = p.prompt_ids[..rng.below(p.prompt_ids.len() as u64) as usize].to_vec();
                q.extend((0..1 + rng.below(60)).map(|_| rng.below(VOCAB) as i32));
                crowd.push(request(q, 1 + rng.below(60) as u32, vec![3]));
            }
        }
    }
    for radix in [true, false] {
        for chunk in [None, Some(16)] {
            let c = cfg(radix, chunk);
            let (out, st) = run(&c, &crowd, 5);
            assert!(
                st.preemptions_total > 0,
                "the crowd should overflow the pool"
            );
            assert_eq!(st.prefix_hit_tokens_total > 0, radix);
            for &(id, i) in &probe_ids {
                assert_eq!(
                    out[&id].tokens, alone[i],
                    "probe {i} (request {id}), radix {radix}, chunk {chunk:?}"
                );
            }
            for (id, req) in crowd.iter().enumerate() {
                check_outcome(id as u64, req, &out[&(id as u64)], c.max_context);
            }
            let (alone_same_cfg, _) = run(&c, std::slice::from_ref(&probes[0]), 1);
            assert_eq!(alone_same_cfg[&0].tokens, alone[0]);
        }
    }
}
