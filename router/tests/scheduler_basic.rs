//! Scenario tests of the scheduler: admission errors, the shape of plans (chunks, decodes,
//! mixed steps, history, prompt logprobs), prefix reuse, preemption, aborts and worker death.

mod scheduler_common;

use std::collections::HashMap;

use nsaserve_router::engine::{FinishReason, GenerateEvent, SubmitError};
use nsaserve_router::protocol::{ForwardMode, SamplingParams, BAN_BIAS};
use nsaserve_router::scheduler::Scheduler;
use scheduler_common::*;

fn run_to_end(
    sched: &mut Scheduler,
    exec: &mut FakeExecutor,
    outcomes: &mut HashMap<u64, Outcome>,
) -> u64 {
    let mut n = 0;
    while step(sched, exec, n, outcomes) {
        n += 1;
        assert!(n < 100_000, "no progress");
    }
    n
}

fn seq(n: usize, base: i32) -> Vec<i32> {
    (0..n as i32).map(|i| base + i).collect()
}

#[test]
fn submit_rejects_what_can_never_run_and_bounds_the_queue() {
    let mut cfg = config(4, 8);
    cfg.max_context = 40;
    cfg.max_waiting = 2;
    let mut s = Scheduler::new(cfg);
    assert!(matches!(
        s.submit(1, request(vec![], 4, vec![])),
        Err(SubmitError::Invalid(_))
    ));
    assert!(matches!(
        s.submit(1, request(seq(30, 0), 11, vec![])),
        Err(SubmitError::Invalid(_))
    ));
    // 33 KV tokens need 9 pages of 4; the pool has 8.
    assert!(matches!(
        s.submit(1, request(seq(30, 0), 4, vec![])),
        Err(SubmitError::Invalid(_))
    ));
    // 32 KV tokens (the last sampled token is never stored) fit exactly.
    s.submit(1, request(seq(30, 0), 3, vec![])).unwrap();
    assert!(matches!(
        s.submit(1, request(seq(3, 0), 3, vec![])),
        Err(SubmitError::Invalid(_))
    ));
    s.submit(2, request(seq(3, 0), 3, vec![])).unwrap();
    assert!(matches!(
        s.submit(3, request(seq(3, 0), 3, vec![])),
        Err(SubmitError::Overloaded(_))
    ));
    assert_eq!(s.stats().waiting, 2);
}

#[test]
fn a_request_that_fills_the_whole_pool_runs_to_the_end() {
    let cfg = config(4, 8);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let req = request(seq(30, 0), 3, vec![]);
    s.submit(1, req.clone()).unwrap();
    run_to_end(&mut s, &mut exec, &mut out);
    check_outcome(1, &req, &out[&1], cfg.max_context);
    let st = s.stats();
    assert_eq!(st.pages_free + st.pages_cached, st.pages_total);
}

#[test]
fn long_prompts_are_chunked_and_only_the_last_chunk_samples() {
    let mut cfg = config(4, 64);
    cfg.chunked_prefill_size = Some(8);
    cfg.max_prefill_tokens = 8;
    let mut s = Scheduler::new(cfg.clone());
    let req = request(seq(20, 0), 2, vec![]);
    s.submit(1, req.clone()).unwrap();
    let mut exec = FakeExecutor::new(&cfg);
    let mut shapes = vec![];
    let mut out = HashMap::new();
    for n in 0.. {
        let Some(plan) = s.schedule(n) else { break };
        check_plan(&plan, cfg.num_pages);
        let r = &plan.requests[0];
        shapes.push((r.cached_len, r.input_ids.len(), r.sample, r.pages.len()));
        let res = exec.run(&plan);
        record(&mut out, s.on_result(&plan, &res));
    }
    assert_eq!(
        shapes,
        vec![
            (0, 8, false, 2),
            (8, 8, false, 4),
            (16, 4, true, 5),
            (20, 1, true, 6)
        ]
    );
    check_outcome(1, &req, &out[&1], cfg.max_context);
}

#[test]
fn decodes_and_a_new_prompt_share_one_mixed_step() {
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    s.submit(1, request(seq(6, 0), 5, vec![])).unwrap();
    assert!(step(&mut s, &mut exec, 0, &mut out));
    s.submit(2, request(seq(9, 50), 5, vec![])).unwrap();
    let plan = s.schedule(1).unwrap();
    assert_eq!(plan.mode(), ForwardMode::Mixed);
    assert_eq!(
        plan.requests
            .iter()
            .map(|r| (r.id, r.input_ids.len()))
            .collect::<Vec<_>>(),
        vec![(1, 1), (2, 9)]
    );
    assert_eq!(s.stats().last_batch_size, 2);
}

#[test]
fn a_shared_prefix_is_reused_but_the_last_prompt_token_always_runs() {
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    // 12 prompt + 10 generated tokens: the KV of the first 21 is stored, 5 full pages.
    let first = request(seq(12, 0), 10, vec![]);
    s.submit(1, first.clone()).unwrap();
    run_to_end(&mut s, &mut exec, &mut out);
    // Same 12-token prompt: 3 full pages cached, but one token must run, so 2 pages are reused.
    s.submit(2, first.clone()).unwrap();
    let plan = s.schedule(100).unwrap();
    assert_eq!(
        (
            plan.requests[0].cached_len,
            plan.requests[0].input_ids.len()
        ),
        (8, 4)
    );
    record(&mut out, s.on_result(&plan, &exec.run(&plan)));
    // A longer prompt with the same start (the first request's whole sequence) reuses the
    // cached pages, the generated ones included.
    let mut longer = seq(12, 0);
    longer.extend(reference(&first, cfg.max_context).0);
    longer.extend([7, 7, 7]);
    s.submit(3, request(longer.clone(), 2, vec![])).unwrap();
    // Prompts that hold the same tokens at other positions must not hit (keys are prefixes).
    let shifted = request(longer[4..].to_vec(), 2, vec![]);
    s.submit(4, shifted.clone()).unwrap();
    run_to_end(&mut s, &mut exec, &mut out);
    check_outcome(2, &first, &out[&2], cfg.max_context);
    check_outcome(3, &request(longer, 2, vec![]), &out[&3], cfg.max_context);
    check_outcome(4, &shifted, &out[&4], cfg.max_context);
    assert_eq!(out[&2].finish.unwrap().3, 8);
    assert_eq!(out[&3].finish.unwrap().3, 20);
    assert_eq!(out[&4].finish.unwrap().3, 0);
    let st = s.stats();
    assert_eq!(st.prefix_hit_tokens_total, 28);
    assert_eq!(st.prompt_tokens_total, 12 + 12 + 25 + 21);
    assert_eq!(st.pages_free + st.pages_cached, st.pages_total);
    assert!(st.pages_cached > 0);
}

#[test]
fn a_cache_salt_shares_the_prefix_only_with_the_same_salt() {
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let salted = |salt: Option<&str>| {
        let mut r = request(seq(12, 0), 3, vec![]);
        r.cache_salt = salt.map(Into::into);
        r
    };
    // Each request runs alone after the ones before it are cached.
    let order = [None, Some("a"), Some("b"), Some("a"), None, Some("b")];
    for (id, salt) in order.iter().enumerate() {
        s.submit(id as u64, salted(*salt)).unwrap();
        run_to_end(&mut s, &mut exec, &mut out);
        check_outcome(
            id as u64,
            &salted(*salt),
            &out[&(id as u64)],
            cfg.max_context,
        );
        assert_eq!(
            s.cached_prefix_pages(&salted(*salt)),
            2,
            "{salt:?} cached now (a request reuses at most (12 - 1) / 4 pages)"
        );
    }
    // The first request of each name computes the prompt; later ones reuse 2 pages (8 tokens).
    let cached: Vec<u32> = (0..6).map(|id| out[&id].finish.unwrap().3).collect();
    assert_eq!(cached, [0, 0, 0, 8, 8, 8]);
    assert_eq!(s.cached_prefix_pages(&salted(Some("c"))), 0);
    s.check_invariants().unwrap();
}

#[test]
fn disabling_the_radix_cache_disables_reuse() {
    let mut cfg = config(4, 64);
    cfg.disable_radix_cache = true;
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    for id in 0..3 {
        s.submit(id, request(seq(12, 0), 3, vec![])).unwrap();
        run_to_end(&mut s, &mut exec, &mut out);
    }
    let st = s.stats();
    assert_eq!(
        (st.prefix_hit_tokens_total, st.pages_cached, st.pages_free),
        (0, 0, 64)
    );
}

#[test]
fn concurrent_requests_share_a_prompt_prefix_once_it_is_prefilled() {
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let a = request(seq(16, 0), 10, vec![]);
    s.submit(1, a.clone()).unwrap();
    assert!(step(&mut s, &mut exec, 0, &mut out));
    let mut b_prompt = seq(16, 0);
    b_prompt.push(99);
    let b = request(b_prompt, 10, vec![]);
    s.submit(2, b.clone()).unwrap();
    let plan = s.schedule(1).unwrap();
    let pb = plan.requests.iter().find(|r| r.id == 2).unwrap();
    let pa = plan.requests.iter().find(|r| r.id == 1).unwrap();
    assert_eq!(pb.cached_len, 16);
    assert_eq!(pb.pages[..4], pa.pages[..4]);
    record(&mut out, s.on_result(&plan, &exec.run(&plan)));
    run_to_end(&mut s, &mut exec, &mut out);
    check_outcome(1, &a, &out[&1], cfg.max_context);
    check_outcome(2, &b, &out[&2], cfg.max_context);
}

#[test]
fn running_out_of_pages_preempts_the_newest_and_recomputes_it_correctly() {
    // 12 pages of 4: three requests of 12 prompt tokens each need 3 pages, then grow.
    let mut cfg = config(4, 12);
    cfg.max_prefill_tokens = 64;
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let reqs: Vec<_> = (0..3)
        .map(|i| request(seq(12, 100 * i), 20, vec![]))
        .collect();
    for (i, r) in reqs.iter().enumerate() {
        s.submit(i as u64, r.clone()).unwrap();
    }
    run_to_end(&mut s, &mut exec, &mut out);
    assert!(s.stats().preemptions_total > 0);
    for (i, r) in reqs.iter().enumerate() {
        check_outcome(i as u64, r, &out[&(i as u64)], cfg.max_context);
        assert_eq!(
            out[&(i as u64)].finish.unwrap().3,
            0,
            "recompute hits are not reported as cached"
        );
    }
    let st = s.stats();
    assert_eq!(st.pages_free + st.pages_cached, st.pages_total);
}

#[test]
fn abort_releases_pages_of_waiting_and_running_requests() {
    let mut cfg = config(4, 16);
    cfg.disable_radix_cache = true;
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    s.submit(1, request(seq(10, 0), 50, vec![])).unwrap();
    assert!(step(&mut s, &mut exec, 0, &mut out));
    s.submit(2, request(seq(10, 0), 50, vec![])).unwrap();
    assert!(s.stats().pages_free < 16);
    assert!(s.abort(1));
    assert!(s.abort(2));
    assert!(!s.abort(1));
    assert!(!s.abort(3));
    s.check_invariants().unwrap();
    let st = s.stats();
    assert_eq!((st.pages_free, st.running, st.waiting), (16, 0, 0));
    assert!(s.schedule(1).is_none());
}

#[test]
fn a_result_for_an_aborted_request_is_ignored() {
    let cfg = config(4, 16);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    s.submit(1, request(seq(10, 0), 50, vec![])).unwrap();
    let plan = s.schedule(0).unwrap();
    assert!(s.abort(1));
    assert!(s.on_result(&plan, &exec.run(&plan)).is_empty());
    s.check_invariants().unwrap();
}

#[test]
fn worker_errors_fail_one_request_and_fail_all_empties_everything() {
    let cfg = config(4, 32);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    for id in 0..4 {
        s.submit(id, request(seq(10, id as i32), 50, vec![]))
            .unwrap();
    }
    assert!(step(&mut s, &mut exec, 0, &mut out));
    exec.fail_next.insert(2);
    assert!(step(&mut s, &mut exec, 1, &mut out));
    assert_eq!(
        out[&2].failed.as_ref().unwrap(),
        &("injected failure".to_string(), false)
    );
    s.submit(9, request(seq(10, 0), 5, vec![])).unwrap();
    let events = s.fail_all("workers died");
    let mut ids: Vec<u64> = events.iter().map(|e| e.0).collect();
    ids.sort();
    assert_eq!(ids, vec![0, 1, 3, 9]);
    assert!(events.iter().all(|(_, e)| matches!(
        e,
        GenerateEvent::Failed {
            retryable: true,
            ..
        }
    )));
    s.check_invariants().unwrap();
    let st = s.stats();
    assert_eq!(
        (st.pages_free, st.pages_cached, st.running, st.waiting),
        (32, 0, 0, 0)
    );
}

#[test]
fn stop_tokens_and_max_new_tokens_finish_requests() {
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let prompt = seq(5, 0);
    let (free_run, _) = reference(&request(prompt.clone(), 10, vec![]), cfg.max_context);
    let stop_at = request(prompt.clone(), 10, vec![free_run[3]]);
    let zero = request(prompt.clone(), 0, vec![]);
    s.submit(1, stop_at.clone()).unwrap();
    s.submit(2, zero.clone()).unwrap();
    run_to_end(&mut s, &mut exec, &mut out);
    check_outcome(1, &stop_at, &out[&1], cfg.max_context);
    let stop_pos = free_run.iter().position(|&t| t == free_run[3]).unwrap();
    assert_eq!(out[&1].tokens.len(), stop_pos + 1);
    assert_eq!(out[&1].finish.unwrap().0, FinishReason::Stop);
    assert_eq!(out[&2].finish.unwrap(), (FinishReason::Length, 5, 0, 0));
}

#[test]
fn min_new_tokens_bans_the_stop_tokens_until_the_minimum() {
    let cfg = config(4, 64);
    let prompt = seq(5, 0);
    let (free_run, _) = reference(&request(prompt.clone(), 10, vec![]), cfg.max_context);
    // Without a minimum it would stop at its second token.
    let mut early = request(prompt.clone(), 10, vec![free_run[1]]);
    early.min_new_tokens = 4;
    let mut at_max = request(prompt.clone(), 3, vec![free_run[0]]);
    at_max.min_new_tokens = 3;
    for overlap in [false, true] {
        let mut s = Scheduler::new(cfg.clone());
        let mut exec = FakeExecutor::new(&cfg);
        let mut out = HashMap::new();
        s.submit(1, early.clone()).unwrap();
        s.submit(2, at_max.clone()).unwrap();
        let mut in_flight = None;
        let mut n = 0;
        loop {
            let more = if overlap {
                step_overlap(&mut s, &mut exec, n, &mut out, &mut in_flight)
            } else {
                step(&mut s, &mut exec, n, &mut out)
            };
            if !more {
                break;
            }
            // Plans ban the stop token exactly while fewer than the minimum are generated
            // (counting the tokens of plans in flight).
            n += 1;
            assert!(n < 1000);
        }
        check_outcome(1, &early, &out[&1], cfg.max_context);
        check_outcome(2, &at_max, &out[&2], cfg.max_context);
        assert!(out[&1].tokens.len() > 4 && !out[&1].tokens[..4].contains(&free_run[1]));
        assert_eq!(out[&2].tokens.len(), 3);
        assert_eq!(out[&2].finish.unwrap().0, FinishReason::Length);
    }
}

#[test]
fn plans_ban_stop_tokens_only_before_the_minimum() {
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let mut req = request(seq(3, 0), 6, vec![7, 2]);
    req.min_new_tokens = 2;
    req.sampling.logit_bias = vec![(2, 5.0), (9, -1.0)];
    s.submit(1, req).unwrap();
    let mut banned_samples = Vec::new();
    for n in 0.. {
        let Some(plan) = s.schedule(n) else { break };
        for r in plan.requests.iter().filter(|r| r.sample) {
            let bias = &r.sampling.logit_bias;
            banned_samples.push(bias.iter().any(|&(_, b)| b == BAN_BIAS));
            if banned_samples.len() <= 2 {
                // The request's own bias on a stop token gives way to the ban; others stay.
                assert_eq!(bias, &vec![(2, BAN_BIAS), (7, BAN_BIAS), (9, -1.0)]);
            } else {
                assert_eq!(bias, &vec![(2, 5.0), (9, -1.0)]);
            }
        }
        let result = exec.run(&plan);
        record(&mut out, s.on_result(&plan, &result));
    }
    assert_eq!(&banned_samples[..2], &[true, true]);
    assert!(banned_samples[2..].iter().all(|b| !b));
}

#[test]
fn history_goes_only_to_requests_with_penalties_and_prompt_logprobs_arrive_once() {
    let mut cfg = config(4, 64);
    cfg.chunked_prefill_size = Some(4);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let mut with_penalty = request(seq(6, 0), 3, vec![]);
    with_penalty.sampling = SamplingParams {
        repetition_penalty: 1.1,
        ..Default::default()
    };
    with_penalty.prompt_logprobs = true;
    s.submit(1, with_penalty.clone()).unwrap();
    // Outlives request 1, so a plan after request 1 ends says it is released.
    s.submit(2, request(seq(6, 0), 6, vec![])).unwrap();
    let mut held = HeldHistories::default();
    let (mut resets, mut released) = (0, false);
    for n in 0.. {
        let Some(plan) = s.schedule(n) else { break };
        held.apply(&plan);
        released |= plan.released.contains(&1);
        assert!(
            plan.released.iter().all(|&id| id == 1),
            "only a penalised request holds a history"
        );
        for r in &plan.requests {
            let wants = r.id == 1 && r.sample;
            if !wants {
                assert!(
                    r.history.is_empty() && !r.history_reset,
                    "request {} step {n}",
                    r.id
                );
            } else {
                resets += r.history_reset as u32;
                // The whole history once, then only what is new: one token a decode step.
                assert!(r.history_reset || r.history.len() <= 1, "step {n}");
                assert_eq!(held.0[&1].len() as i32, r.seq_len(), "step {n}");
                assert_eq!(held.0[&1][..6], seq(6, 0));
                assert_eq!(r.history_prompt_len, 6);
            }
            assert_eq!(r.prompt_logprobs, r.id == 1 && r.cached_len < 6);
        }
        let res = exec.run(&plan);
        record(&mut out, s.on_result(&plan, &res));
    }
    assert_eq!(resets, 1);
    assert!(
        released,
        "request 1 ended before request 2 and was released"
    );
    check_outcome(1, &with_penalty, &out[&1], cfg.max_context);
    assert!(
        !held.0.contains_key(&1),
        "its history was dropped once it ended"
    );
}

#[test]
fn penalised_requests_are_planned_ahead_with_the_history_they_know() {
    // Overlap: step 1 is planned before step 0's result. The penalised request runs its pending
    // token by reference like any other; the history the worker holds is the tokens known so far
    // (the pending one is the worker's to add), and its prompt length is unchanged.
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    let mut penalised = request(seq(6, 0), 4, vec![]);
    penalised.sampling = SamplingParams {
        frequency_penalty: 0.5,
        ..Default::default()
    };
    s.submit(1, penalised.clone()).unwrap();
    let mut held = HeldHistories::default();
    let first = s.schedule(0).unwrap();
    held.apply(&first);
    assert!(first.requests[0].history_reset);
    assert_eq!(held.0[&1], seq(6, 0));
    let second = s.schedule(1).unwrap();
    held.apply(&second);
    let r = &second.requests[0];
    assert_eq!((r.id, r.input_prev_row, r.cached_len), (1, 0, 6));
    // Nothing new is known yet: no tokens, no reset.
    assert!(r.history.is_empty() && !r.history_reset);
    assert_eq!(held.0[&1], seq(6, 0));
    assert_eq!(r.history_prompt_len, 6);
    assert_eq!(held.0[&1].len() as i32, r.seq_len() - 1);
    record(&mut out, s.on_result(&first, &exec.run(&first)));
    record(&mut out, s.on_result(&second, &exec.run(&second)));
    s.check_invariants().unwrap();
    let mut n = 2;
    while let Some(plan) = s.schedule(n) {
        held.apply(&plan);
        for r in plan.requests.iter().filter(|r| r.sample) {
            let pending = (r.input_prev_row >= 0) as i32;
            assert_eq!(
                held.0[&r.id].len() as i32,
                r.seq_len() - pending,
                "step {n}"
            );
        }
        record(&mut out, s.on_result(&plan, &exec.run(&plan)));
        n += 1;
    }
    check_outcome(1, &penalised, &out[&1], cfg.max_context);
    let mut whole = seq(6, 0);
    whole.extend(&out[&1].tokens[..out[&1].tokens.len() - 1]);
    assert_eq!(held.0[&1], whole[..held.0[&1].len()]);
}

#[test]
fn the_scheduler_can_move_to_the_engine_thread() {
    fn assert_send<T: Send + 'static>() {}
    assert_send::<Scheduler>();
}

#[test]
fn requests_in_flight_are_planned_ahead_by_reference_at_most_one_step() {
    let cfg = config(4, 64);
    let mut s = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut out = HashMap::new();
    s.submit(1, request(seq(6, 0), 4, vec![])).unwrap();
    let first = s.schedule(0).unwrap();
    s.submit(2, request(seq(6, 10), 4, vec![])).unwrap();
    // Step 1 is planned before step 0's result: request 1 runs the token step 0 samples for
    // it (row 0 there), by reference; the newcomer runs its prompt.
    let second = s.schedule(1).unwrap();
    let rows: Vec<_> = second
        .requests
        .iter()
        .map(|r| (r.id, r.input_ids.clone(), r.input_prev_row, r.cached_len))
        .collect();
    assert_eq!(rows, vec![(1, vec![-1], 0, 6), (2, seq(6, 10), -1, 0)]);
    // A request is never planned a third step deep; one in flight once still is.
    let third = s.schedule(2).unwrap();
    let rows: Vec<_> = third
        .requests
        .iter()
        .map(|r| (r.id, r.input_prev_row))
        .collect();
    assert_eq!(rows, vec![(2, 1)]);
    s.check_invariants().unwrap();
    record(&mut out, s.on_result(&first, &exec.run(&first)));
    record(&mut out, s.on_result(&second, &exec.run(&second)));
    record(&mut out, s.on_result(&third, &exec.run(&third)));
    // A result applied twice changes nothing.
    assert!(s.on_result(&first, &exec.run(&first)).is_empty());
    s.check_invariants().unwrap();
    let mut n = 4;
    while step(&mut s, &mut exec, n, &mut out) {
        n += 1;
    }
    check_outcome(1, &request(seq(6, 0), 4, vec![]), &out[&1], cfg.max_context);
    check_outcome(
        2,
        &request(seq(6, 10), 4, vec![]),
        &out[&2],
        cfg.max_context,
    );
}
