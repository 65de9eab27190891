//! The engine loop against a fake worker speaking the real protocol over real ZeroMQ sockets:
//! requests run to completion, stop tokens stop them, a worker that leaves a request out fails
//! only that request, a worker that goes silent fails everything and turns health off, and a
//! worker that dies is replaced: the engine serves again from an empty pool of the new size.
//! The fake worker resolves overlap references (`input_prev_row`) from what it sampled in the
//! previous step, as real workers do, and fails a request whose reference is wrong. It obeys
//! allowed-token masks, waiting for a step's late masks as rank 0 does.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nsaserve_router::engine::{
    Engine, EngineHandle, EngineLimits, FinishReason, GenerateEvent, GenerateRequest, Startup,
    WorkersInfo,
};
use nsaserve_router::metrics::Metrics;
use nsaserve_router::protocol::{
    decode_router_message, encode_worker_message, BatchPlan, Heartbeat, Hello, RouterMessage,
    SamplingParams, StepResult, WorkerMessage, PROTOCOL_VERSION,
};
use nsaserve_router::transport::Endpoints;

/// How the fake worker answers.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Token = 100 + position of the new token.
    Count,
    /// Leaves request id 2 out of every result.
    DropRequestTwo,
    /// Token = (31 * input token + position + 1) mod 1000: wrong inputs give wrong outputs.
    Echo,
}

/// The token the fake worker samples for one planned request, given its (resolved) input.
fn fake_token(behaviour: Behaviour, input: i32, seq_len: i32) -> i32 {
    match behaviour {
        Behaviour::Echo => (31 * input + seq_len) % 1000,
        _ => 100 + seq_len,
    }
}

/// What a test can do to a running fake worker.
#[derive(Default)]
struct Switches {
    /// Stops answering and heart-beating, sockets open (a hung worker).
    silent: AtomicBool,
    /// Closes its sockets and ends (a killed worker).
    gone: AtomicBool,
    /// Rows that arrived with `mask_late` (their masks in a later `masks` message).
    late_rows: AtomicU64,
}

/// The allowed token nearest above `token` (wrapping), or `token` without a mask.
fn obey(mask: Option<&[u32]>, token: i32) -> i32 {
    let Some(words) = mask else {
        return token;
    };
    let allowed = |t: usize| words.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
    let n = words.len() * 32;
    (0..n)
        .map(|k| (token as usize + k) % n)
        .find(|&t| allowed(t))
        .expect("a mask allows some token") as i32
}

fn spawn_fake_worker(
    endpoints: Endpoints,
    behaviour: Behaviour,
    num_pages: u32,
    switches: Arc<Switches>,
) {
    std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let plans = ctx.socket(zmq::PULL).unwrap();
        plans.connect(&endpoints.plans(0)).unwrap();
        plans.set_rcvtimeo(100).unwrap();
        let events = ctx.socket(zmq::PUSH).unwrap();
        events.connect(&endpoints.events()).unwrap();
        let hello = Hello {
            rank: 0,
            tp_size: 1,
            pid: std::process::id(),
            model_id: "fake".into(),
            num_pages,
            page_size: 4,
            max_context: 256,
            vocab_size: 1000,
            version: PROTOCOL_VERSION,
        };
        events
            .send(
                encode_worker_message(&WorkerMessage::Hello(hello)).unwrap(),
                0,
            )
            .unwrap();
        // (request id, sampled token) of each row of the previous plan.
        let mut prev: Vec<(u64, Option<i32>)> = vec![];
        let mut prev_step = 0;
        loop {
            if switches.gone.load(Ordering::SeqCst) {
                return;
            }
            if switches.silent.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            let beat = WorkerMessage::Heartbeat(Heartbeat { rank: 0, step: 0 });
            events
                .send(encode_worker_message(&beat).unwrap(), 0)
                .unwrap();
            let Ok(bytes) = plans.recv_bytes(0) else {
                continue;
            };
            let Ok(plan) = BatchPlan::decode(&bytes) else {
                return;
            };
            // Late masks come once the router has committed the previous step, before anything else.
            let late = plan.requests.iter().filter(|r| r.mask_late).count() as u64;
            let mut late_masks = std::collections::HashMap::new();
            if late > 0 {
                switches.late_rows.fetch_add(late, Ordering::SeqCst);
                let masks = loop {
                    if let Ok(bytes) = plans.recv_bytes(0) {
                        match decode_router_message(&bytes) {
                            Ok(RouterMessage::Masks(m)) if m.step == plan.step => break m,
                            Ok(RouterMessage::Masks(_)) => continue,
                            _ => return,
                        }
                    }
                };
                late_masks.extend(masks.masks);
            }
            let mut sampled = vec![];
            let mut errors = vec![];
            let mut rows = vec![];
            for r in &plan.requests {
                let input = if r.input_prev_row >= 0 {
                    match prev.get(r.input_prev_row as usize) {
                        Some(&(id, Some(t))) if id == r.id && prev_step + 1 == plan.step => t,
                        _ => {
                            errors.push((r.id, "bad input_prev_row".to_string()));
                            rows.push((r.id, None));
                            continue;
                        }
                    }
                } else {
                    *r.input_ids.last().unwrap()
                };
                let dropped = matches!(behaviour, Behaviour::DropRequestTwo) && r.id == 2;
                let mask = r
                    .allowed_tokens
                    .as_deref()
                    .or_else(|| late_masks.get(&r.id))
                    .map(Vec::as_slice);
                let token = (r.sample && !dropped)
                    .then(|| obey(mask, fake_token(behaviour, input, r.seq_len())));
                if let Some(t) = token {
                    sampled.push((r.id, t, None));
                }
                rows.push((r.id, token));
            }
            (prev, prev_step) = (rows, plan.step);
            let result = StepResult {
                step: plan.step,
                sampled,
                errors,
                ..Default::default()
            };
            events
                .send(
                    encode_worker_message(&WorkerMessage::Result(result)).unwrap(),
                    0,
                )
                .unwrap();
        }
    });
}

/// Binds the router's sockets and starts a fake worker with `num_pages` pages; returns the
/// sockets with its hello, ready for `EngineHandle::start` or `restart`.
fn start_worker(
    endpoints: &Endpoints,
    behaviour: Behaviour,
    num_pages: u32,
) -> (Startup, WorkersInfo, Arc<Switches>) {
    let mut startup = Startup::bind(endpoints, 1).unwrap();
    let switches = Arc::new(Switches::default());
    spawn_fake_worker(endpoints.clone(), behaviour, num_pages, switches.clone());
    let workers = loop {
        if let Some(w) = startup.poll_ready(Duration::from_secs(5)).unwrap() {
            break w;
        }
    };
    (startup, workers, switches)
}

struct Started {
    engine: Arc<EngineHandle>,
    switches: Arc<Switches>,
    metrics: Arc<Metrics>,
    endpoints: Endpoints,
    _dir: tempfile::TempDir,
}

fn start_engine(behaviour: Behaviour) -> Started {
    start_engine_with(behaviour, true)
}

fn start_engine_with(behaviour: Behaviour, overlap: bool) -> Started {
    start_engine_dp(behaviour, overlap, 1)
}

/// With `dp_size` > 1 the one fake worker stands for a data-parallel group: the router plans
/// over `dp_size` pools of the 64 pages it reports.
fn start_engine_dp(behaviour: Behaviour, overlap: bool, dp_size: usize) -> Started {
    let dir = tempfile::tempdir().unwrap();
    let endpoints = Endpoints::Ipc {
        dir: dir.path().display().to_string(),
    };
    let (startup, workers, switches) = start_worker(&endpoints, behaviour, 64);
    let limits = EngineLimits {
        served_model_name: "fake".into(),
        max_running_requests: 8,
        max_prefill_tokens: 64,
        chunked_prefill_size: Some(8),
        disable_radix_cache: false,
        max_waiting: 16,
        heartbeat_timeout: Duration::from_millis(1500),
        disable_overlap_schedule: !overlap,
        dp_size,
        priority: None,
    };
    let metrics = Arc::new(Metrics::new());
    let engine = EngineHandle::start(startup, &workers, &limits, metrics.clone());
    Started {
        engine,
        switches,
        metrics,
        endpoints,
        _dir: dir,
    }
}

fn request(prompt: Vec<i32>, max_new_tokens: u32, stop: Vec<i32>) -> GenerateRequest {
    GenerateRequest {
        prompt_ids: prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        max_new_tokens,
        min_new_tokens: 0,
        stop_token_ids: stop,
        prompt_logprobs: false,
        allowed_tokens: None,
        constraint: None,
        priority: 0,
        cache_salt: None,
    }
}

/// Every event of a request, up to and including the last one.
async fn collect(mut s: nsaserve_router::engine::RequestStream) -> Vec<GenerateEvent> {
    let mut out = vec![];
    while let Some(e) = tokio::time::timeout(Duration::from_secs(10), s.events.recv())
        .await
        .unwrap()
    {
        let last = matches!(
            e,
            GenerateEvent::Finished { .. } | GenerateEvent::Failed { .. }
        );
        out.push(e);
        if last {
            break;
        }
    }
    out
}

fn tokens(events: &[GenerateEvent]) -> Vec<i32> {
    events
        .iter()
        .filter_map(|e| {
            if let GenerateEvent::Token { id, .. } = e {
                Some(*id)
            } else {
                None
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_to_length_and_to_a_stop_token() {
    let started = start_engine(Behaviour::Count);
    let engine = &started.engine;
    // A 10-token prompt is chunked (8 + 2); the new tokens are 100 + position.
    let long = engine
        .submit(request((1..=10).collect(), 4, vec![]))
        .unwrap();
    let stopped = engine
        .submit(request(vec![5, 6, 7], 10, vec![105]))
        .unwrap();
    let (long, stopped) = (collect(long).await, collect(stopped).await);
    assert_eq!(tokens(&long), vec![110, 111, 112, 113]);
    assert!(matches!(
        long.last(),
        Some(GenerateEvent::Finished {
            reason: FinishReason::Length,
            completion_tokens: 4,
            ..
        })
    ));
    assert_eq!(tokens(&stopped), vec![103, 104, 105]);
    assert!(matches!(
        stopped.last(),
        Some(GenerateEvent::Finished {
            reason: FinishReason::Stop,
            ..
        })
    ));
    assert!(engine.healthy());
    engine.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_worker_leaves_out_fails_alone() {
    let started = start_engine(Behaviour::DropRequestTwo);
    let engine = &started.engine;
    let one = engine.submit(request(vec![1, 2], 3, vec![])).unwrap();
    let two = engine.submit(request(vec![1, 2], 3, vec![])).unwrap();
    assert_eq!(two.id, 2);
    let (one, two) = (collect(one).await, collect(two).await);
    assert_eq!(tokens(&one).len(), 3);
    assert!(
        matches!(two.last(), Some(GenerateEvent::Failed { message, .. }) if message.contains("no token"))
    );
    assert!(engine.healthy());
    engine.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_fails_open_requests_and_turns_health_off() {
    let started = start_engine(Behaviour::Count);
    let engine = &started.engine;
    started.switches.silent.store(true, Ordering::SeqCst);
    let stream = engine.submit(request(vec![1, 2, 3], 50, vec![])).unwrap();
    let started = std::time::Instant::now();
    let events = collect(stream).await;
    assert!(
        matches!(events.last(), Some(GenerateEvent::Failed { .. })),
        "{events:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!engine.healthy());
    assert!(matches!(
        engine.submit(request(vec![1], 1, vec![])),
        Err(nsaserve_router::engine::SubmitError::Unavailable(_))
    ));
    engine.shutdown();
}

/// Polls the metrics text until every line in `want` is there (the engine publishes its gauges
/// between steps).
async fn wait_for_metrics(metrics: &Metrics, want: &[&str]) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = metrics.render();
        if want.iter().all(|line| text.lines().any(|l| l == *line)) {
            return text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "missing {want:?} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_is_replaced_and_the_engine_serves_again_from_an_empty_pool() {
    let started = start_engine(Behaviour::Count);
    let engine = &started.engine;
    // A long generation holds pages when its worker dies.
    let mut held = engine
        .submit(request((1..=10).collect(), 200, vec![]))
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), held.events.recv()).await;
    assert!(matches!(first, Ok(Some(GenerateEvent::Token { .. }))));
    let died = std::time::Instant::now();
    started.switches.gone.store(true, Ordering::SeqCst);
    let rest = collect(held).await;
    assert!(
        matches!(
            rest.last(),
            Some(GenerateEvent::Failed {
                retryable: true,
                ..
            })
        ),
        "{rest:?}"
    );
    assert!(died.elapsed() < Duration::from_secs(5));
    assert!(!engine.healthy());

    // The old sockets close before the same endpoints are bound for the new worker, whose
    // pool is smaller: the new scheduler must use its size, with every page free.
    engine.end_run();
    let (startup, workers, _switches) = start_worker(&started.endpoints, Behaviour::Count, 32);
    engine.restart(startup, &workers);
    assert!(engine.healthy());
    let events = collect(engine.submit(request(vec![5, 6, 7], 4, vec![])).unwrap()).await;
    assert_eq!(tokens(&events), vec![103, 104, 105, 106]);
    // 33 pages of 4 tokens fit the old pool but not the new one.
    assert!(matches!(
        engine.submit(request((0..100).collect(), 32, vec![])),
        Err(nsaserve_router::engine::SubmitError::Invalid(_))
    ));
    wait_for_metrics(
        &started.metrics,
        &[
            "nsaserve_kv_pages_total 32",
            "nsaserve_kv_pages_used 0",
            "nsaserve_kv_pages_free 32",
            "nsaserve_requests_running 0",
            "nsaserve_requests_waiting 0",
            "nsaserve_worker_restarts_total 1",
            "nsaserve_engine_requests_submitted_total 2",
            "nsaserve_engine_requests_ended_total{outcome=\"finished\"} 1",
            "nsaserve_engine_requests_ended_total{outcome=\"failed\"} 1",
        ],
    )
    .await;
    engine.shutdown();
}

/// More generation than the 64-page pool holds at once: the scheduler preempts running requests
/// (they recompute, mostly from the prefix cache), every request still gets its exact tokens,
/// and /metrics counts the preemptions and each request's queue time once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemptions_keep_outputs_exact_and_are_counted() {
    let started = start_engine(Behaviour::Count);
    let engine = &started.engine;
    // 8 requests of 10 + 40 tokens need 8 x 13 pages of 4 tokens; the pool has 64.
    let streams: Vec<_> = (0..8)
        .map(|i| {
            let prompt = (0..10).map(|k| i * 10 + k).collect();
            engine.submit(request(prompt, 40, vec![])).unwrap()
        })
        .collect();
    for s in streams {
        let events = collect(s).await;
        assert_eq!(tokens(&events), (110..150).collect::<Vec<_>>());
    }
    // Each request's wait for its first step is observed once, preempted or not.
    let text = wait_for_metrics(
        &started.metrics,
        &[
            "nsaserve_kv_pages_used 0",
            "nsaserve_request_queue_time_seconds_count 8",
        ],
    )
    .await;
    let preemptions: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("nsaserve_preemptions_total "))
        .expect("no preemption counter")
        .parse()
        .unwrap();
    assert!(preemptions > 0, "{text}");
    engine.shutdown();
}

/// Outputs and finish reasons of a mixed workload (chunked prompts, stop tokens, max_tokens of
/// 1 and 0, more requests than may run at once) on one engine.
async fn workload(overlap: bool) -> Vec<(Vec<i32>, String)> {
    workload_dp(overlap, 1).await
}

async fn workload_dp(overlap: bool, dp_size: usize) -> Vec<(Vec<i32>, String)> {
    let started = start_engine_dp(Behaviour::Echo, overlap, dp_size);
    let engine = &started.engine;
    let mut streams = vec![];
    for i in 0..12i32 {
        let prompt: Vec<i32> = (0..(1 + i * 3 % 17)).map(|k| (k * 7 + i) % 50).collect();
        let max_new = [0, 1, 2, 5, 9][i as usize % 5];
        // A seventh of all tokens stop these requests: some stop early, some run to length.
        let stop = if i % 3 == 0 {
            (0..1000).filter(|t| t % 7 == i % 7).collect()
        } else {
            vec![]
        };
        streams.push(engine.submit(request(prompt, max_new, stop)).unwrap());
    }
    let mut out = vec![];
    for s in streams {
        let events = collect(s).await;
        let end = match events.last() {
            Some(GenerateEvent::Finished {
                reason,
                completion_tokens,
                ..
            }) => format!("{}:{completion_tokens}", reason.as_openai()),
            other => format!("{other:?}"),
        };
        out.push((tokens(&events), end));
    }
    let total = format!("nsaserve_kv_pages_total {}", 64 * dp_size);
    let free = format!("nsaserve_kv_pages_free {}", 64 * dp_size);
    wait_for_metrics(
        &started.metrics,
        &[&total, &free, "nsaserve_kv_pages_used 0"],
    )
    .await;
    assert!(engine.healthy());
    engine.shutdown();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlap_gives_the_same_outputs_as_planning_after_each_result() {
    let with = workload(true).await;
    let without = workload(false).await;
    assert_eq!(with, without);
    assert!(with
        .iter()
        .all(|(_, end)| end.starts_with("stop") || end.starts_with("length")));
    assert!(with.iter().any(|(t, _)| t.len() >= 5), "{with:?}");
    assert!(
        with.iter().any(|(_, end)| end.starts_with("stop")),
        "{with:?}"
    );
}

/// Data-parallel attention over two and three ranks: the engine plans combined steps over every
/// rank's pages (overlap references included) and the outputs are those of one pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_give_the_same_outputs_as_one_pool() {
    let one = workload(true).await;
    for dp_size in [2, 3] {
        assert_eq!(
            workload_dp(true, dp_size).await,
            one,
            "dp {dp_size}, overlap"
        );
        assert_eq!(workload_dp(false, dp_size).await, one, "dp {dp_size}");
    }
}

/// Structured outputs through the engine and a worker that obeys masks: with overlap the
/// constrained requests are planned ahead (late masks, sent after each commit and before the
/// next plan) and give the outputs planning after each result gives; so do data-parallel ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_masks_give_the_outputs_of_masks_in_the_plan() {
    use nsaserve_router::grammar::{GrammarCompiler, OutputConstraint};
    use nsaserve_router::tokenizer::TokenizerBundle;

    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pyworker/nsaserve/embedded_model");
    let tok = Arc::new(TokenizerBundle::from_model_dir(&dir).unwrap());
    let compiler = GrammarCompiler::new(Arc::clone(&tok));
    let run = |overlap: bool, dp_size: usize| {
        let (tok, compiler) = (Arc::clone(&tok), &compiler);
        async move {
            let started = start_engine_dp(Behaviour::Echo, overlap, dp_size);
            let mut streams = vec![];
            for i in 0..6i32 {
                let mut req = request((0..3 + i).collect(), 12, tok.eos_token_ids().to_vec());
                let spec = OutputConstraint::Regex(
                    ["[a-c]{4}", "(ab|ba){1,3}c", "[0-9]{2,5}"][i as usize % 3].into(),
                );
                req.constraint = Some(compiler.compile(&spec, false).unwrap());
                streams.push(started.engine.submit(req).unwrap());
            }
            let mut out = vec![];
            for s in streams {
                let events = collect(s).await;
                assert!(
                    matches!(events.last(), Some(GenerateEvent::Finished { .. })),
                    "{events:?}"
                );
                let body: Vec<i32> = tokens(&events)
                    .into_iter()
                    .filter(|t| !tok.eos_token_ids().contains(t))
                    .collect();
                out.push(tok.decode(&body, false));
            }
            let late = started.switches.late_rows.load(Ordering::SeqCst);
            started.engine.shutdown();
            (out, late)
        }
    };
    let (planned, late) = run(false, 1).await;
    assert_eq!(late, 0, "without overlap every mask is in its plan");
    for (i, text) in planned.iter().enumerate() {
        let ok = match i % 3 {
            0 => text.len() == 4 && text.bytes().all(|b| (b'a'..=b'c').contains(&b)),
            1 => text.ends_with('c') && text.len() >= 3,
            _ => (2..=5).contains(&text.len()) && text.bytes().all(|b| b.is_ascii_digit()),
        };
        assert!(ok, "request {i}: {text:?}");
    }
    let (ahead, late) = run(true, 1).await;
    assert_eq!(ahead, planned);
    assert!(
        late >= 6,
        "constrained decode steps planned ahead: {late} late rows"
    );
    let (dp, late) = run(true, 2).await;
    assert_eq!(dp, planned);
    assert!(late >= 6, "{late}");
}
