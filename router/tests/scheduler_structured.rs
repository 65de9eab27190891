//! Structured outputs through the scheduler: every row that samples under a grammar carries
//! its mask, in the plan or (planned ahead of its last token, under overlap) as a late mask
//! once that token is committed; the output follows the grammar, and a token that breaks it
//! fails only its request.

mod scheduler_common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use nsaserve_router::engine::{FinishReason, GenerateRequest};
use nsaserve_router::grammar::{GrammarCompiler, OutputConstraint};
use nsaserve_router::protocol::BatchPlan;
use nsaserve_router::scheduler::Scheduler;
use nsaserve_router::tokenizer::TokenizerBundle;
use scheduler_common::*;

fn tokenizer() -> Arc<TokenizerBundle> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pyworker/nsaserve/embedded_model");
    Arc::new(TokenizerBundle::from_model_dir(&dir).unwrap())
}

const PATTERN: &str = "[a-c]{2,6}";

fn matches_pattern(text: &str) -> bool {
    (2..=6).contains(&text.len()) && text.bytes().all(|b| (b'a'..=b'c').contains(&b))
}

/// Constrained requests (ids in the returned set) among plain ones, submitted together.
fn submit_mix(
    sched: &mut Scheduler,
    tok: &TokenizerBundle,
    compiler: &GrammarCompiler,
    rng: &mut Rng,
) -> (HashMap<u64, GenerateRequest>, HashSet<u64>) {
    let stops = tok.eos_token_ids().to_vec();
    let spec = OutputConstraint::Regex(PATTERN.into());
    let mut reqs = HashMap::new();
    let mut constrained = HashSet::new();
    for id in 0..24u64 {
        let prompt: Vec<i32> = (0..5 + rng.below(70))
            .map(|_| 6 + rng.below(600) as i32)
            .collect();
        let mut req = request(prompt, 12, stops.clone());
        if id % 2 == 0 {
            req.constraint = Some(compiler.compile(&spec, false).unwrap());
            constrained.insert(id);
        }
        sched.submit(id, req.clone()).unwrap();
        reqs.insert(id, req);
    }
    (reqs, constrained)
}

fn ended(outcomes: &HashMap<u64, Outcome>, id: u64) -> bool {
    outcomes
        .get(&id)
        .is_some_and(|o| o.finish.is_some() || o.failed.is_some())
}

/// Rows of constrained requests as the scheduler plans them: a mask in the plan exactly where
/// they sample with a known input, and a late mask where the input is the token in flight.
/// The number of late rows.
fn check_constrained_rows(plan: &BatchPlan, constrained: &HashSet<u64>) -> usize {
    let mut late = 0;
    for r in &plan.requests {
        if constrained.contains(&r.id) && r.input_prev_row >= 0 {
            assert!(
                r.mask_late && r.allowed_tokens.is_none(),
                "request {}",
                r.id
            );
            late += 1;
        } else if constrained.contains(&r.id) {
            assert!(!r.mask_late);
            assert_eq!(r.allowed_tokens.is_some(), r.sample, "request {}", r.id);
        } else {
            assert!(r.allowed_tokens.is_none() && !r.mask_late);
        }
    }
    late
}

/// Runs the mix to the end; the number of preemptions and of rows planned with late masks.
fn run(overlap: bool, page_size: u32, num_pages: u32) -> (u64, usize) {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(Arc::clone(&tok));
    let cfg = config(page_size, num_pages);
    let mut sched = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let mut rng = Rng::new(7);
    let (reqs, constrained) = submit_mix(&mut sched, &tok, &compiler, &mut rng);
    let mut outcomes = HashMap::new();
    let mut in_flight: Option<BatchPlan> = None;
    let mut late = 0;
    for n in 0..2000 {
        let progress = if overlap {
            // As step_overlap, checking the plan before its late masks are merged.
            let next = sched.schedule(n);
            if let Some(plan) = &next {
                check_plan(plan, cfg.num_pages);
                late += check_constrained_rows(plan, &constrained);
            }
            let had = in_flight.is_some();
            let mut next = next;
            if let Some(prev) = in_flight.take() {
                let result = exec.run(&prev);
                record(&mut outcomes, sched.on_result(&prev, &result));
                sched.check_invariants().unwrap();
                if let Some(plan) = next.as_mut() {
                    merge_late_masks(&mut sched, plan);
                    for r in plan.requests.iter().filter(|r| constrained.contains(&r.id)) {
                        // A row without a mask samples for a request that has just ended.
                        assert!(
                            !r.sample || r.allowed_tokens.is_some() || ended(&outcomes, r.id),
                            "request {} unmasked",
                            r.id
                        );
                    }
                }
            }
            in_flight = next;
            had || in_flight.is_some()
        } else {
            match sched.schedule(n) {
                Some(plan) => {
                    check_plan(&plan, cfg.num_pages);
                    assert_eq!(check_constrained_rows(&plan, &constrained), 0);
                    let result = exec.run(&plan);
                    record(&mut outcomes, sched.on_result(&plan, &result));
                    sched.check_invariants().unwrap();
                    true
                }
                None => false,
            }
        };
        if !progress {
            break;
        }
    }
    assert_eq!(outcomes.len(), reqs.len());
    let stops = tok.eos_token_ids();
    for (id, req) in &reqs {
        let o = &outcomes[id];
        assert!(o.failed.is_none(), "request {id}: {:?}", o.failed);
        if constrained.contains(id) {
            let (reason, ..) = o.finish.unwrap();
            assert_eq!(
                reason,
                FinishReason::Stop,
                "request {id}: the grammar ends it"
            );
            let body: Vec<i32> = o
                .tokens
                .iter()
                .copied()
                .filter(|t| !stops.contains(t))
                .collect();
            let text = tok.decode(&body, false);
            assert!(matches_pattern(&text), "request {id}: {text:?}");
        } else {
            check_outcome(*id, req, o, cfg.max_context);
        }
    }
    let stats = sched.stats();
    assert_eq!((stats.running, stats.waiting), (0, 0));
    (stats.preemptions_total, late)
}

#[test]
fn constrained_outputs_follow_the_grammar_without_overlap() {
    run(false, 16, 256);
}

#[test]
fn constrained_requests_are_planned_ahead_with_late_masks_under_overlap() {
    let (_, late) = run(true, 16, 256);
    // 12 constrained requests of 2-6 tokens: every decode step after the first planned ahead.
    assert!(
        late >= 12,
        "constrained decode steps are planned ahead: {late} late rows"
    );
}

#[test]
fn constrained_requests_survive_preemption() {
    // 24 prompts of up to 75 tokens, growing by up to 12, in 4-token pages: a pool of 30
    // pages holds a couple of them at a time.
    assert!(run(false, 4, 30).0 > 0, "the small pool preempts");
    assert!(run(true, 4, 30).0 > 0, "the small pool preempts");
}

#[test]
fn allowed_token_ids_mask_every_sampling_step_and_still_plan_ahead() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(Arc::clone(&tok));
    let cfg = config(16, 256);
    let mut sched = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let only: Vec<i32> = vec![7, 40, 41, 300, 301, 302];
    let mask = Arc::new(nsaserve_router::protocol::token_mask(&only));
    let mut free = request((10..40).collect(), 10, vec![]);
    free.allowed_tokens = Some(Arc::clone(&mask));
    // With a grammar too: the masks are ANDed (the regex allows "a".."c", so 300-302's text
    // must not matter; the walk still finds an allowed token or fails cleanly).
    let letters: Vec<i32> = "abc"
        .chars()
        .map(|c| tok.encode(&c.to_string(), false).unwrap()[0])
        .collect();
    let mut both = request((10..40).collect(), 10, tok.eos_token_ids().to_vec());
    both.allowed_tokens = Some(Arc::new(nsaserve_router::protocol::token_mask(&[
        letters[0], letters[2],
    ])));
    both.constraint = Some(
        compiler
            .compile(&OutputConstraint::Regex("[a-c]{3}".into()), false)
            .unwrap(),
    );
    sched.submit(1, free).unwrap();
    sched.submit(2, both).unwrap();
    let mut outcomes = HashMap::new();
    let mut in_flight: Option<BatchPlan> = None;
    let mut ahead = 0;
    for n in 0..200 {
        let progress = step_overlap(&mut sched, &mut exec, n, &mut outcomes, &mut in_flight);
        if let Some(plan) = &in_flight {
            for r in plan.requests.iter().filter(|r| r.sample) {
                // Only a row planned ahead for a request that has just ended goes unmasked.
                assert!(
                    r.allowed_tokens.is_some() || ended(&outcomes, r.id),
                    "step {n}: request {} unmasked",
                    r.id
                );
                ahead += (r.input_prev_row >= 0) as u32;
            }
        }
        if !progress {
            break;
        }
    }
    assert!(
        ahead > 10,
        "neither a static mask nor a grammar stops planning ahead"
    );
    let free_out = &outcomes[&1];
    assert_eq!(free_out.tokens.len(), 10);
    assert!(
        free_out.tokens.iter().all(|t| only.contains(t)),
        "{:?}",
        free_out.tokens
    );
    let both_out = &outcomes[&2];
    let body: Vec<i32> = both_out
        .tokens
        .iter()
        .copied()
        .filter(|t| !tok.eos_token_ids().contains(t))
        .collect();
    assert_eq!(body.len(), 3, "{:?}", both_out);
    assert!(
        body.iter().all(|t| *t == letters[0] || *t == letters[2]),
        "{body:?}"
    );
}

#[test]
fn a_grammar_with_no_allowed_token_refuses_only_its_request() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(Arc::clone(&tok));
    let cfg = config(16, 256);
    let mut sched = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let x = tok.encode("x", false).unwrap()[0];
    let mut stuck = request(vec![10, 11, 12], 8, tok.eos_token_ids().to_vec());
    stuck.constraint = Some(
        compiler
            .compile(&OutputConstraint::Regex("x".into()), false)
            .unwrap(),
    );
    // The grammar needs "x"; allowed_token_ids leave it out.
    stuck.allowed_tokens = Some(Arc::new(nsaserve_router::protocol::token_mask(&[x + 1])));
    let good = request(vec![10, 11, 13], 8, vec![]);
    sched.submit(1, stuck).unwrap();
    sched.submit(2, good.clone()).unwrap();
    let mut outcomes = HashMap::new();
    let mut n = 0;
    while step(&mut sched, &mut exec, n, &mut outcomes) {
        n += 1;
    }
    let (message, _) = outcomes[&1].failed.clone().expect("request 1 is refused");
    assert!(
        message.starts_with("refused:") && message.contains("allowed_token_ids"),
        "{message}"
    );
    assert!(outcomes[&1].tokens.is_empty());
    check_outcome(2, &good, &outcomes[&2], cfg.max_context);
    assert_eq!(sched.stats().requests.failed, 1);
}

#[test]
fn a_token_outside_the_mask_fails_only_its_request() {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(Arc::clone(&tok));
    let cfg = config(16, 256);
    let mut sched = Scheduler::new(cfg.clone());
    let mut exec = FakeExecutor::new(&cfg);
    let stops = tok.eos_token_ids().to_vec();
    // "x" only: the fake model's own pick for this prompt is not "x".
    let spec = OutputConstraint::Regex("x".into());
    let mut bad = request(vec![10, 11, 12], 8, stops.clone());
    bad.constraint = Some(compiler.compile(&spec, false).unwrap());
    let good = request(vec![10, 11, 13], 8, stops.clone());
    sched.submit(1, bad).unwrap();
    sched.submit(2, good.clone()).unwrap();
    exec.ignore_masks.insert(1);
    let mut outcomes = HashMap::new();
    let mut n = 0;
    while step(&mut sched, &mut exec, n, &mut outcomes) {
        n += 1;
    }
    let (message, retryable) = outcomes[&1].failed.clone().expect("request 1 fails");
    assert!(
        message.contains("structured output") && !retryable,
        "{message}"
    );
    assert!(
        outcomes[&1].tokens.is_empty(),
        "the breaking token is not reported"
    );
    check_outcome(2, &good, &outcomes[&2], cfg.max_context);
    assert_eq!(sched.stats().requests.failed, 1);
}
