//! Cost of building one decode step: 1024 running requests with about 2K tokens of context
//! (1,700-token prompts that grow over the warm-up and measured steps: 27 to 35 pages of 64,
//! about 32 on average). Times `Scheduler::schedule`, `BatchPlan::encode` and
//! `Scheduler::on_result` per step and prints p50/p90/p99 in microseconds.
//!
//! Run: `cargo bench --bench plan_build [-- results.json]`; with a path, the numbers are also
//! written there as JSON.

use std::time::Instant;

use nsaserve_router::engine::GenerateRequest;
use nsaserve_router::protocol::{SamplingParams, StepResult};
use nsaserve_router::scheduler::{Scheduler, SchedulerConfig};

const REQUESTS: usize = 1024;
const PROMPT: usize = 1700;
const WARMUP_STEPS: u64 = 20;
const MEASURED_STEPS: usize = 500;

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

struct Summary {
    name: &'static str,
    p50: f64,
    p90: f64,
    p99: f64,
    mean: f64,
}

fn summarize(name: &'static str, mut us: Vec<f64>) -> Summary {
    us.sort_by(|a, b| a.total_cmp(b));
    let mean = us.iter().sum::<f64>() / us.len() as f64;
    Summary {
        name,
        p50: percentile(&us, 0.5),
        p90: percentile(&us, 0.9),
        p99: percentile(&us, 0.99),
        mean,
    }
}

/// The fake executor's answer: one token for every request that samples.
fn result_for(plan: &nsaserve_router::protocol::BatchPlan) -> StepResult {
    StepResult {
        step: plan.step,
        sampled: plan
            .requests
            .iter()
            .filter(|r| r.sample)
            .map(|r| (r.id, 11, None))
            .collect(),
        ..Default::default()
    }
}

fn main() {
    let json_path = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let cfg = SchedulerConfig {
        page_size: 64,
        // Prompt pages plus room to decode through the measured steps.
        num_pages: (REQUESTS * (PROMPT + 600)).div_ceil(64) as u32,
        max_running_requests: REQUESTS,
        max_prefill_tokens: 65_536,
        chunked_prefill_size: Some(65_536),
        disable_radix_cache: false,
        max_context: 16_384,
        max_waiting: REQUESTS,
        priority: None,
    };
    let mut sched = Scheduler::new(cfg.clone());
    for id in 0..REQUESTS as u64 {
        // Distinct prompts: no prefix sharing, every request owns its ~32 pages.
        let prompt = (0..PROMPT as i32)
            .map(|k| (id as i32 * 7919 + k * 31) % 50_000)
            .collect();
        let req = GenerateRequest {
            prompt_ids: prompt,
            sampling: SamplingParams::default(),
            max_new_tokens: 10_000,
            min_new_tokens: 0,
            stop_token_ids: vec![],
            prompt_logprobs: false,
            allowed_tokens: None,
            constraint: None,
            priority: 0,
            cache_salt: None,
        };
        sched.submit(id, req).expect("fits");
    }
    // Prefill everything, then warm up on decode steps.
    let mut step = 0;
    while sched.stats().running < REQUESTS || sched.stats().waiting > 0 || step < WARMUP_STEPS {
        let plan = sched.schedule(step).expect("work to do");
        sched.on_result(&plan, &result_for(&plan));
        step += 1;
    }

    let (mut sched_us, mut encode_us, mut result_us) = (vec![], vec![], vec![]);
    let mut bytes = 0;
    for _ in 0..MEASURED_STEPS {
        let t0 = Instant::now();
        let plan = sched.schedule(step).expect("work to do");
        let t1 = Instant::now();
        let wire = plan.encode().expect("encodes");
        let t2 = Instant::now();
        let result = result_for(&plan);
        let t3 = Instant::now();
        sched.on_result(&plan, &result);
        let t4 = Instant::now();
        assert_eq!(plan.requests.len(), REQUESTS);
        assert!(plan.requests.iter().all(|r| r.input_ids.len() == 1));
        bytes = wire.len();
        sched_us.push((t1 - t0).as_secs_f64() * 1e6);
        encode_us.push((t2 - t1).as_secs_f64() * 1e6);
        result_us.push((t4 - t3).as_secs_f64() * 1e6);
        step += 1;
    }
    let pages_per_req = sched.stats().pages_in_use as f64 / REQUESTS as f64;
    let rows = [
        summarize("schedule", sched_us),
        summarize("encode", encode_us),
        summarize("on_result", result_us),
    ];
    println!(
        "plan_build: {REQUESTS} decode requests, ~{pages_per_req:.1} pages each, {MEASURED_STEPS} steps, plan {bytes} bytes"
    );
    for s in &rows {
        println!(
            "  {:<10} p50 {:>8.1} us  p90 {:>8.1} us  p99 {:>8.1} us  mean {:>8.1} us",
            s.name, s.p50, s.p90, s.p99, s.mean
        );
    }
    if let Some(path) = json_path {
        let mut obj = serde_json::Map::new();
        obj.insert("requests".into(), REQUESTS.into());
        obj.insert("prompt_tokens".into(), PROMPT.into());
        obj.insert("page_size".into(), cfg.page_size.into());
        obj.insert("pages_per_request".into(), pages_per_req.into());
        obj.insert("steps".into(), MEASURED_STEPS.into());
        obj.insert("plan_bytes".into(), bytes.into());
        for s in &rows {
            obj.insert(
                s.name.into(),
                serde_json::json!({"p50_us": s.p50, "p90_us": s.p90, "p99_us": s.p99, "mean_us": s.mean}),
            );
        }
        std::fs::write(&path, serde_json::to_string_pretty(&obj).expect("json"))
            .expect("write results");
        println!("wrote {path}");
    }
}
