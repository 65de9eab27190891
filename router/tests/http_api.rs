//! The HTTP API in-process: a scripted engine, a small byte-level BPE tokenizer written to a
//! temporary model directory, and requests sent straight into the axum router.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use futures::StreamExt;
use http_body_util::BodyExt;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tower::ServiceExt;

use nsaserve_router::engine::{
    Engine, FinishReason, GenerateEvent, GenerateRequest, ModelInfo, RequestStream, SubmitError,
};
use nsaserve_router::http::{
    router, serve_listener, HttpConfig, SamplingDefaults, SamplingDefaultsSource,
};
use nsaserve_router::metrics::{Metrics, SchedulerGauges};
use nsaserve_router::parsers::{ReasoningParserKind, ToolParserKind};
use nsaserve_router::protocol::{PromptLogprobs, TokenLogprobs};
use nsaserve_router::tokenizer::TokenizerBundle;

const BOS: i32 = 265;
const EOS: i32 = 266;
const VOCAB: u32 = 300;
/// GLM's reasoning and tool-call tags: added tokens that are not special (so decoding keeps
/// them, as it does for GLM's tokenizer), one id each from 267 on.
const MARKUP: [&str; 8] = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
];
const CONTEXT: u32 = 128;

// ---------------------------------------------------------------- tokenizer

/// GPT-2's byte-to-character table (the byte-level BPE alphabet).
fn byte_chars() -> Vec<char> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(255 + next).unwrap()
            }
        })
        .collect()
}

/// A byte-level BPE: ids 0..256 are the bytes, a few merges (256..265) make "hello" and
/// " world" single tokens, 265/266 are <s>/</s>, and 267.. are the [`MARKUP`] tags.
fn write_model_dir(dir: &std::path::Path, chat_template: &str) {
    let chars = byte_chars();
    let mut vocab = serde_json::Map::new();
    for (b, c) in chars.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let merges = [
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("Ġ", "w"),
        ("Ġw", "o"),
        ("Ġwo", "r"),
        ("Ġwor", "l"),
        ("Ġworl", "d"),
    ];
    for (id, (a, b)) in (256..).zip(merges) {
        vocab.insert(format!("{a}{b}"), json!(id));
    }
    let special = |id: i32, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let mut added_tokens = vec![special(BOS, "<s>"), special(EOS, "</s>")];
    for (id, tag) in (EOS + 1..).zip(MARKUP) {
        let mut token = special(id, tag);
        token["special"] = json!(false);
        added_tokens.push(token);
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [BOS], "tokens": ["<s>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()
        }
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let config = json!({"bos_token": "<s>", "eos_token": {"content": "</s>", "special": true}, "chat_template": chat_template});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        json!({"eos_token_id": [EOS]}).to_string(),
    )
    .unwrap();
}

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' and not tools %}{{ raise_exception('tool messages need tools') }}{% endif %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{% if greeting is defined %}{{ greeting }}{% endif %}";

fn tokenizer_with_template(template: &str) -> Arc<TokenizerBundle> {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), template);
    Arc::new(TokenizerBundle::from_model_dir(dir.path()).unwrap())
}

fn tokenizer() -> Arc<TokenizerBundle> {
    tokenizer_with_template(TEMPLATE)
}

// ---------------------------------------------------------------- scripted engine

#[derive(Clone)]
enum Reply {
    /// These tokens, then EOS (unless max_new_tokens is reached first).
    Text(String),
    /// `n` tokens of text, then a failure.
    FailAfter(usize, bool),
    /// Accepted by `submit`, then refused by the engine loop (the queue filled up meanwhile).
    RefusedLater(SubmitError),
}

struct ScriptedEngine {
    tokenizer: Arc<TokenizerBundle>,
    reply: Mutex<Reply>,
    delay: Mutex<Duration>,
    refuse: Mutex<Option<SubmitError>>,
    healthy: AtomicBool,
    /// The context it reports (byte-level prompts with tools need more than [`CONTEXT`]).
    max_context: Mutex<u32>,
    next_id: AtomicU64,
    submitted: Mutex<Vec<GenerateRequest>>,
    aborted: Arc<Mutex<Vec<u64>>>,
    abort_tx: mpsc::UnboundedSender<u64>,
}

impl ScriptedEngine {
    fn new(tokenizer: Arc<TokenizerBundle>) -> Arc<ScriptedEngine> {
        let (abort_tx, mut abort_rx) = mpsc::unbounded_channel::<u64>();
        let aborted = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&aborted);
        tokio::spawn(async move {
            while let Some(id) = abort_rx.recv().await {
                sink.lock().push(id);
            }
        });
        Arc::new(ScriptedEngine {
            tokenizer,
            reply: Mutex::new(Reply::Text("hello world".into())),
            delay: Mutex::new(Duration::ZERO),
            refuse: Mutex::new(None),
            healthy: AtomicBool::new(true),
            max_context: Mutex::new(CONTEXT),
            next_id: AtomicU64::new(1),
            submitted: Mutex::new(Vec::new()),
            aborted,
            abort_tx,
        })
    }

    fn set_reply(&self, reply: Reply) {
        *self.reply.lock() = reply;
    }

    fn logprobs_for(id: i32, top: Option<u32>) -> Option<TokenLogprobs> {
        let k = top?;
        Some(TokenLogprobs {
            logprob: -0.25,
            top: (0..k as i32)
                .map(|j| ((id + 1 + j) % 256, -1.0 - j as f32))
                .collect(),
        })
    }
}

impl Engine for ScriptedEngine {
    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError> {
        if let Some(e) = self.refuse.lock().clone() {
            return Err(e);
        }
        self.submitted.lock().push(request.clone());
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let reply = self.reply.lock().clone();
        let delay = *self.delay.lock();
        if let Reply::RefusedLater(e) = reply {
            let _ = tx.send(GenerateEvent::Refused(e));
            return Ok(RequestStream::new(id, rx, self.abort_tx.clone()));
        }
        let (mut ids, failure) = match reply {
            Reply::Text(t) => (self.tokenizer.encode(&t, false).unwrap(), None),
            Reply::RefusedLater(_) => unreachable!("answered above"),
            Reply::FailAfter(n, retryable) => (
                self.tokenizer.encode("hello world", false).unwrap()[..n].to_vec(),
                Some(retryable),
            ),
        };
        if failure.is_none() {
            ids.push(EOS);
        }
        tokio::spawn(async move {
            let top = request.sampling.top_logprobs;
            let prompt = &request.prompt_ids;
            if request.prompt_logprobs {
                let entries = prompt[1..]
                    .iter()
                    .map(|&t| ScriptedEngine::logprobs_for(t, top).unwrap())
                    .collect();
                let event = PromptLogprobs {
                    req_id: id,
                    first_pos: 1,
                    tokens: prompt[1..].to_vec(),
                    entries,
                };
                let _ = tx.send(GenerateEvent::PromptLogprobs(event));
            }
            let mut sent = 0u32;
            let mut reason = FinishReason::Length;
            for &t in &ids {
                if sent == request.max_new_tokens {
                    break;
                }
                tokio::time::sleep(delay).await;
                if tx
                    .send(GenerateEvent::Token {
                        id: t,
                        logprobs: ScriptedEngine::logprobs_for(t, top),
                    })
                    .is_err()
                {
                    return;
                }
                sent += 1;
                if request.stop_token_ids.contains(&t) {
                    reason = FinishReason::Stop;
                    break;
                }
            }
            let last = match failure {
                Some(retryable) => GenerateEvent::Failed {
                    message: "worker 1 died".into(),
                    retryable,
                },
                None => GenerateEvent::Finished {
                    reason,
                    prompt_tokens: prompt.len() as u32,
                    completion_tokens: sent,
                    cached_tokens: 3,
                },
            };
            let _ = tx.send(last);
        });
        Ok(RequestStream::new(id, rx, self.abort_tx.clone()))
    }

    fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    fn model_info(&self) -> ModelInfo {
        ModelInfo {
            served_model_name: "tiny".into(),
            max_context: *self.max_context.lock(),
            vocab_size: VOCAB,
        }
    }
}

// ---------------------------------------------------------------- harness

struct Harness {
    app: Router,
    engine: Arc<ScriptedEngine>,
    metrics: Arc<Metrics>,
    tokenizer: Arc<TokenizerBundle>,
}

fn harness_with(configure: impl FnOnce(&mut HttpConfig)) -> Harness {
    build_harness(tokenizer(), configure)
}

fn harness_with_template(template: &str) -> Harness {
    build_harness(tokenizer_with_template(template), |_| {})
}

fn build_harness(
    tokenizer: Arc<TokenizerBundle>,
    configure: impl FnOnce(&mut HttpConfig),
) -> Harness {
    let engine = ScriptedEngine::new(Arc::clone(&tokenizer));
    let metrics = Arc::new(Metrics::new());
    let mut cfg = HttpConfig::new("tiny");
    configure(&mut cfg);
    let app = router(
        cfg,
        engine.clone(),
        Arc::clone(&tokenizer),
        Arc::clone(&metrics),
    );
    Harness {
        app,
        engine,
        metrics,
        tokenizer,
    }
}

fn harness() -> Harness {
    harness_with(|_| {})
}

struct Reply_ {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: String,
}

impl Reply_ {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }

    fn chunks(&self) -> Vec<Value> {
        let events = self.events();
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "stream must end with [DONE]: {}",
            self.body
        );
        events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    }
}

impl Harness {
    async fn send(&self, request: Request<Body>) -> Reply_ {
        let response = self.app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        Reply_ {
            status,
            headers,
            body: String::from_utf8(bytes.to_vec()).unwrap(),
        }
    }

    async fn post_raw(&self, path: &str, body: impl Into<Body>) -> Reply_ {
        let request = Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.into())
            .unwrap();
        self.send(request).await
    }

    async fn post(&self, path: &str, body: Value) -> Reply_ {
        self.post_raw(path, body.to_string()).await
    }

    async fn get(&self, path: &str) -> Reply_ {
        self.send(Request::get(path).body(Body::empty()).unwrap())
            .await
    }

    fn prompt_len(&self, prompt: &str) -> u32 {
        self.tokenizer.encode(prompt, true).unwrap().len() as u32
    }
}

fn assert_error(reply: &Reply_, status: StatusCode, fragment: &str) {
    assert_eq!(reply.status, status, "body: {}", reply.body);
    let v = reply.json();
    let error = &v["error"];
    let message = error["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error.message: {v}"));
    assert!(
        message.contains(fragment),
        "{message:?} does not mention {fragment:?}"
    );
    assert!(error["type"].is_string(), "{v}");
    assert!(
        error.get("param").is_some() && error.get("code").is_some(),
        "{v}"
    );
}

/// Waits (briefly) until the engine has seen `count` aborts.
async fn wait_for_aborts(engine: &ScriptedEngine, count: usize) -> Vec<u64> {
    for _ in 0..200 {
        let aborted = engine.aborted.lock().clone();
        if aborted.len() >= count {
            return aborted;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    engine.aborted.lock().clone()
}

fn stream_text(chunks: &[Value], field: impl Fn(&Value) -> Option<&str>) -> HashMap<u64, String> {
    let mut texts = HashMap::new();
    for c in chunks {
        for choice in c["choices"].as_array().unwrap() {
            let index = choice["index"].as_u64().unwrap();
            if let Some(t) = field(choice) {
                texts.entry(index).or_insert_with(String::new).push_str(t);
            }
        }
    }
    texts
}

// ---------------------------------------------------------------- completions

#[tokio::test]
async fn completion_plain() {
    let h = harness();
    let r = h
        .post(
            "/v1/completions",
            json!({"model": "tiny", "prompt": "Say hi", "max_tokens": 20, "user": "u1"}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "tiny");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["text"], "hello world");
    assert_eq!(choice["finish_reason"], "stop");
    assert!(choice["logprobs"].is_null());
    let prompt_tokens = h.prompt_len("Say hi");
    // "hello", " world", EOS
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3,
               "prompt_tokens_details": {"cached_tokens": 3}})
    );
    let submitted = h.engine.submitted.lock()[0].clone();
    assert_eq!(
        submitted.prompt_ids[0], BOS,
        "raw prompts get the tokenizer's BOS"
    );
    assert_eq!(submitted.max_new_tokens, 20);
    assert_eq!(submitted.stop_token_ids, vec![EOS]);
}

#[tokio::test]
async fn completion_length_and_default_max_tokens_fill_the_context() {
    let h = harness();
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "Say hi", "max_tokens": 1}),
        )
        .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "hello");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    h.post("/v1/completions", json!({"prompt": "Say hi", "temperature": 0, "top_k": -1, "top_p": 0.5, "min_p": 0.1, "seed": 3,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1})).await;
    let r = h.engine.submitted.lock()[1].clone();
    assert_eq!(r.max_new_tokens, CONTEXT - h.prompt_len("Say hi"));
    let s = &r.sampling;
    assert_eq!(
        (s.temperature, s.top_k, s.top_p, s.min_p, s.seed),
        (0.0, 0, 0.5, 0.1, Some(3))
    );
    assert_eq!(
        (
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty
        ),
        (0.5, -0.5, 1.1)
    );
}

/// A model directory whose `generation_config.json` sets sampling defaults (min_p it leaves
/// out), and the API over it with `--sampling-defaults source`.
fn harness_with_sampling_defaults(source: SamplingDefaultsSource) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), TEMPLATE);
    let generation_config = json!({"eos_token_id": [EOS], "do_sample": false, "temperature": 0.6,
                                   "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05});
    std::fs::write(
        dir.path().join("generation_config.json"),
        generation_config.to_string(),
    )
    .unwrap();
    let tokenizer = Arc::new(TokenizerBundle::from_model_dir(dir.path()).unwrap());
    let defaults = SamplingDefaults::load(dir.path(), source).unwrap();
    build_harness(tokenizer, |c| c.sampling_defaults = defaults)
}

/// (temperature, top_p, top_k, min_p, repetition_penalty) of the `i`th submitted request.
fn submitted_sampling(h: &Harness, i: usize) -> (f32, f32, i32, f32, f32) {
    let s = h.engine.submitted.lock()[i].sampling.clone();
    (
        s.temperature,
        s.top_p,
        s.top_k,
        s.min_p,
        s.repetition_penalty,
    )
}

/// `body` with the fields of `extra` added.
fn merged(mut body: Value, extra: &Value) -> Value {
    let fields = extra.as_object().unwrap().clone();
    body.as_object_mut().unwrap().extend(fields);
    body
}

#[tokio::test]
async fn omitted_sampling_fields_take_the_model_defaults_unless_openai_is_asked() {
    let completion = json!({"prompt": "Say hi", "max_tokens": 2});
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let explicit = json!({"temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1});
    for (source, omitted, given) in [
        // The file's values (min_p: OpenAI's, the file has none); a request's own values win,
        // and the repetition_penalty it leaves out is still the model's.
        (
            SamplingDefaultsSource::Model,
            (0.6, 0.95, 20, 0.0, 1.05),
            (0.0, 0.5, 0, 0.1, 1.05),
        ),
        // The file ignored: OpenAI's.
        (
            SamplingDefaultsSource::Openai,
            (1.0, 1.0, 0, 0.0, 1.0),
            (0.0, 0.5, 0, 0.1, 1.0),
        ),
    ] {
        let h = harness_with_sampling_defaults(source);
        let requests = [
            ("/v1/completions", completion.clone()),
            ("/v1/chat/completions", chat.clone()),
            ("/v1/completions", merged(completion.clone(), &explicit)),
            ("/v1/chat/completions", merged(chat.clone(), &explicit)),
        ];
        for (path, body) in requests {
            let r = h.post(path, body).await;
            assert_eq!(r.status, StatusCode::OK, "{source:?} {path}: {}", r.body);
        }
        for i in 0..2 {
            assert_eq!(submitted_sampling(&h, i), omitted, "{source:?} request {i}");
        }
        for i in 2..4 {
            assert_eq!(submitted_sampling(&h, i), given, "{source:?} request {i}");
        }
    }
}

#[tokio::test]
async fn completion_stream_with_usage() {
    let h = harness();
    let body =
        json!({"prompt": "Say hi", "stream": true, "stream_options": {"include_usage": true}});
    let r = h.post("/v1/completions", body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let chunks = r.chunks();
    let (last, rest) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    let p = h.prompt_len("Say hi");
    assert_eq!(last["usage"]["prompt_tokens"], p);
    assert_eq!(last["usage"]["completion_tokens"], 3);
    assert_eq!(last["usage"]["total_tokens"], p + 3);
    for c in rest {
        assert_eq!(c["object"], "text_completion");
        assert!(c["usage"].is_null() && c.get("usage").is_some(), "{c}");
        assert_eq!(c["id"], last["id"]);
    }
    assert_eq!(stream_text(rest, |c| c["text"].as_str())[&0], "hello world");
    assert_eq!(rest.last().unwrap()["choices"][0]["finish_reason"], "stop");
    assert!(rest[..rest.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    // Without include_usage there is no usage field and no usage chunk.
    let chunks = h
        .post(
            "/v1/completions",
            json!({"prompt": "Say hi", "stream": true}),
        )
        .await
        .chunks();
    assert!(chunks
        .iter()
        .all(|c| c.get("usage").is_none() && !c["choices"].as_array().unwrap().is_empty()));
}

#[tokio::test]
async fn token_id_prompts_and_prompt_lists_make_choice_groups() {
    let h = harness();
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 2, "seed": 10}),
        )
        .await;
    let v = r.json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], "hello world");
    }
    let submitted = h.engine.submitted.lock().clone();
    let prompts: Vec<_> = submitted.iter().map(|r| r.prompt_ids.clone()).collect();
    assert_eq!(
        prompts,
        vec![vec![1, 2, 3], vec![1, 2, 3], vec![4, 5], vec![4, 5]]
    );
    let seeds: Vec<_> = submitted.iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, vec![Some(10), Some(11), Some(10), Some(11)]);
    // Each prompt counts once; completions add up.
    assert_eq!(v["usage"]["prompt_tokens"], 5);
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 6);

    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": ["a", "b"], "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn n_samples_stream_interleaved_by_index() {
    let h = harness();
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "x", "n": 3, "stream": true}),
        )
        .await;
    let chunks = r.chunks();
    let texts = stream_text(&chunks, |c| c["text"].as_str());
    assert_eq!(texts.len(), 3);
    assert!(texts.values().all(|t| t == "hello world"));
    let finishes = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 3);
}

// ---------------------------------------------------------------- stop strings and UTF-8

#[tokio::test]
async fn stop_string_across_tokens_is_cut_and_aborts() {
    let h = harness();
    h.engine
        .set_reply(Reply::Text("abc STOP def and more".into()));
    // Byte-level: "STOP" is four tokens.
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "x", "stop": ["STOP", "zzz"]}),
        )
        .await;
    let v = r.json();
    assert_eq!(v["choices"][0]["text"], "abc ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // a, b, c, space, S, T, O, P were generated when the stop string completed.
    assert_eq!(v["usage"]["completion_tokens"], 8);
    assert_eq!(
        wait_for_aborts(&h.engine, 1).await.len(),
        1,
        "a stop string must drop the engine request"
    );

    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "x", "stop": "STOP", "stream": true}),
        )
        .await;
    let chunks = r.chunks();
    for c in &chunks {
        let t = c["choices"][0]["text"].as_str().unwrap();
        assert!(!t.contains('S'), "a stop-string prefix leaked: {t:?}");
    }
    assert_eq!(stream_text(&chunks, |c| c["text"].as_str())[&0], "abc ");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[tokio::test]
async fn stop_strings_count_from_min_tokens_on() {
    let h = harness();
    h.engine.set_reply(Reply::Text("ab STOP cd STOP ef".into()));
    // Byte-level, a token a character: the first "STOP" completes with token 7, the second
    // with token 15. As vLLM counts, a stop string completed by token min_tokens counts.
    for (min_tokens, text, tokens) in [(7, "ab ", 7), (8, "ab STOP cd ", 15)] {
        for stream in [false, true] {
            let body = json!({"prompt": "x", "stop": "STOP", "min_tokens": min_tokens, "max_tokens": 30,
                              "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }});
            let r = h.post("/v1/completions", body).await;
            if stream {
                let chunks = r.chunks();
                assert_eq!(
                    stream_text(&chunks, |c| c["text"].as_str())[&0],
                    text,
                    "min_tokens {min_tokens}"
                );
                assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], tokens);
            } else {
                let v = r.json();
                assert_eq!(v["choices"][0]["text"], text, "min_tokens {min_tokens}");
                assert_eq!(v["choices"][0]["finish_reason"], "stop");
                assert_eq!(v["usage"]["completion_tokens"], tokens);
            }
        }
    }
}

#[tokio::test]
async fn held_back_stop_prefix_is_released_when_it_is_not_a_stop() {
    let h = harness();
    h.engine.set_reply(Reply::Text("abc ST".into()));
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "x", "stop": ["STOP"], "stream": true}),
        )
        .await;
    let chunks = r.chunks();
    assert_eq!(stream_text(&chunks, |c| c["text"].as_str())[&0], "abc ST");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[tokio::test]
async fn multibyte_characters_split_across_tokens_never_break() {
    let h = harness();
    let text = "héllo 日本語 😀!";
    h.engine.set_reply(Reply::Text(text.into()));
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}),
        )
        .await;
    let chunks = r.chunks();
    for c in &chunks {
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            assert!(!t.contains('\u{FFFD}'), "broken UTF-8 in chunk {t:?}");
        }
    }
    assert_eq!(
        stream_text(&chunks, |c| c["delta"]["content"].as_str())[&0],
        text
    );
    // And a stop string made of multi-byte characters.
    let r = h
        .post("/v1/completions", json!({"prompt": "x", "stop": ["日本"]}))
        .await;
    assert_eq!(r.json()["choices"][0]["text"], "héllo ");
}

#[tokio::test]
async fn stop_token_ids_and_ignore_eos() {
    let h = harness();
    let o = h.tokenizer.encode("o", false).unwrap()[0];
    h.engine.set_reply(Reply::Text("abco def".into()));
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "x", "stop_token_ids": [o]}),
        )
        .await;
    let v = r.json();
    assert_eq!(
        v["choices"][0]["text"], "abc",
        "a stop token's text is not output"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    h.post(
        "/v1/completions",
        json!({"prompt": "x", "ignore_eos": true, "stop_token_ids": [5]}),
    )
    .await;
    assert_eq!(h.engine.submitted.lock()[1].stop_token_ids, vec![5]);
}

// ---------------------------------------------------------------- logprobs and echo

#[tokio::test]
async fn completion_logprobs_shape() {
    let h = harness();
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 2, "max_tokens": 2}),
        )
        .await;
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"], json!(["hello", " world"]));
    assert_eq!(lp["token_logprobs"], json!([-0.25, -0.25]));
    assert_eq!(lp["text_offset"], json!([0, 5]));
    let top = lp["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    // The chosen token plus the two most likely ones.
    assert_eq!(top[0].as_object().unwrap().len(), 3);
    assert_eq!(top[0]["hello"], -0.25);
    assert_eq!(h.engine.submitted.lock()[0].sampling.top_logprobs, Some(2));
}

#[tokio::test]
async fn echo_with_prompt_logprobs() {
    let h = harness();
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "ab", "echo": true, "logprobs": 1, "max_tokens": 1}),
        )
        .await;
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], "abhello");
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"], json!(["<s>", "a", "b", "hello"]));
    assert_eq!(lp["token_logprobs"], json!([null, -0.25, -0.25, -0.25]));
    assert!(lp["top_logprobs"][0].is_null());
    assert_eq!(lp["top_logprobs"][1].as_object().unwrap().len(), 2);
    assert_eq!(lp["text_offset"], json!([0, 3, 4, 5]));
    assert!(h.engine.submitted.lock()[0].prompt_logprobs);

    // Streaming: the prompt comes first, then the completion.
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "ab", "echo": true, "logprobs": 1, "max_tokens": 1, "stream": true}),
        )
        .await;
    let chunks = r.chunks();
    assert_eq!(chunks[0]["choices"][0]["text"], "ab");
    assert_eq!(
        chunks[0]["choices"][0]["logprobs"]["token_logprobs"],
        json!([null, -0.25, -0.25])
    );
    assert_eq!(chunks[1]["choices"][0]["text"], "hello");
    assert_eq!(
        chunks[1]["choices"][0]["logprobs"]["text_offset"],
        json!([5])
    );

    // Echo without logprobs does not ask the engine for prompt logprobs.
    let r = h
        .post(
            "/v1/completions",
            json!({"prompt": "ab", "echo": true, "max_tokens": 1}),
        )
        .await;
    assert_eq!(r.json()["choices"][0]["text"], "abhello");
    assert!(!h.engine.submitted.lock()[2].prompt_logprobs);
}

#[tokio::test]
async fn chat_logprobs_shape_with_bytes() {
    let h = harness();
    h.engine.set_reply(Reply::Text("é".into()));
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 2});
    let v = h.post("/v1/chat/completions", body).await.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 2, "é is two byte tokens: {content:?}");
    assert_eq!(content[0]["bytes"], json!([0xC3]));
    assert_eq!(content[1]["bytes"], json!([0xA9]));
    assert_eq!(content[0]["logprob"], -0.25);
    let top = content[0]["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), 2);
    assert!(top[0]["token"].is_string() && top[0]["bytes"].is_array() && top[0]["logprob"] == -1.0);
    assert_eq!(v["choices"][0]["message"]["content"], "é");

    let body = json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true});
    let v = h.post("/v1/chat/completions", body).await.json();
    assert_eq!(
        v["choices"][0]["logprobs"]["content"][0]["top_logprobs"],
        json!([])
    );
    let v = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await
        .json();
    assert!(v["choices"][0]["logprobs"].is_null());
}

// ---------------------------------------------------------------- chat

#[tokio::test]
async fn chat_plain_renders_template() {
    let h = harness();
    let body = json!({
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "go"}
        ],
        "max_completion_tokens": 5,
        "chat_template_kwargs": {"greeting": "!"}
    });
    let r = h.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "hello world"})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let submitted = h.engine.submitted.lock()[0].clone();
    let rendered = h.tokenizer.decode(&submitted.prompt_ids, false);
    assert_eq!(
        rendered,
        "<s><|system|>be brief<|user|>one\ntwo<|assistant|>ok<|user|>go<|assistant|>!"
    );
    assert_eq!(
        submitted.prompt_ids.iter().filter(|&&t| t == BOS).count(),
        1,
        "no second BOS"
    );
    assert_eq!(submitted.max_new_tokens, 5);
    assert_eq!(v["usage"]["prompt_tokens"], submitted.prompt_ids.len());
}

#[tokio::test]
async fn chat_stream_shape() {
    let h = harness();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "n": 2,
                      "stream_options": {"include_usage": true}});
    let chunks = h.post("/v1/chat/completions", body).await.chunks();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(
        chunks[1]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(chunks[1]["choices"][0]["index"], 1);
    let texts = stream_text(&chunks, |c| c["delta"]["content"].as_str());
    assert_eq!(texts[&0], "hello world");
    assert_eq!(texts[&1], "hello world");
    let finals: Vec<_> = chunks
        .iter()
        .filter(|c| {
            c["choices"]
                .as_array()
                .is_some_and(|a| !a.is_empty() && !a[0]["finish_reason"].is_null())
        })
        .collect();
    assert_eq!(finals.len(), 2);
    assert!(finals.iter().all(|c| c["choices"][0]["delta"] == json!({})));
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 6);
}

#[tokio::test]
async fn chat_template_errors_are_bad_requests() {
    let h = harness();
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "tool", "content": "42", "tool_call_id": "a"}]}),
        )
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "tool messages need tools");
    // With tools the same conversation renders.
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "tool", "content": "42"}], "tools": tools}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    // Assistant tool calls reach the template with their JSON-string arguments parsed.
    let h2 = harness_with_template(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}{% endfor %}{% endfor %}",
    );
    let messages = json!([
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    ]);
    let r = h2
        .post("/v1/chat/completions", json!({"messages": messages}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let rendered = h2
        .tokenizer
        .decode(&h2.engine.submitted.lock()[0].prompt_ids, false);
    assert_eq!(rendered, "city=Paris;days=2;");
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "assistant", "content": null}]}),
        )
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "content");
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
        )
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "role");
    let r = h.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "text");
    let r = h
        .post("/v1/chat/completions", json!({"messages": []}))
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "empty");
    let r = h
        .post("/v1/chat/completions", json!({"model": "tiny"}))
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "messages");
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        )
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "logprobs");
    let body = json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0});
    let r = h.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(r.json()["choices"][0]["logprobs"].is_null());
    let r = h.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "top_logprobs");
}

// ---------------------------------------------------------------- errors

#[tokio::test]
async fn request_validation_errors() {
    let h = harness();
    let c = "/v1/completions";
    assert_error(
        &h.post_raw(c, "{not json").await,
        StatusCode::BAD_REQUEST,
        "Invalid JSON",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "temperature": "hot"}))
            .await,
        StatusCode::BAD_REQUEST,
        "Invalid JSON",
    );
    assert_error(
        &h.post(c, json!({"prompt": 5})).await,
        StatusCode::BAD_REQUEST,
        "Invalid JSON",
    );
    assert_error(
        &h.post(c, json!({"model": "gpt-9", "prompt": "x"})).await,
        StatusCode::NOT_FOUND,
        "gpt-9",
    );
    assert_eq!(
        h.post(c, json!({"model": "gpt-9", "prompt": "x"}))
            .await
            .json()["error"]["code"],
        "model_not_found"
    );
    assert_error(
        &h.post(c, json!({"prompt": ""})).await,
        StatusCode::BAD_REQUEST,
        "empty",
    );
    assert_error(
        &h.post(c, json!({"prompt": []})).await,
        StatusCode::BAD_REQUEST,
        "empty",
    );
    assert_error(
        &h.post(c, json!({"prompt": [[]]})).await,
        StatusCode::BAD_REQUEST,
        "empty",
    );
    assert_error(
        &h.post(c, json!({})).await,
        StatusCode::BAD_REQUEST,
        "prompt",
    );
    let long = "word ".repeat(100);
    assert_error(
        &h.post(c, json!({"prompt": long})).await,
        StatusCode::BAD_REQUEST,
        "maximum context length",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "max_tokens": 127})).await,
        StatusCode::BAD_REQUEST,
        "maximum context length",
    );
    assert_eq!(
        h.post(c, json!({"prompt": "x", "max_tokens": 126}))
            .await
            .status,
        StatusCode::OK
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "max_tokens": 0})).await,
        StatusCode::BAD_REQUEST,
        "max_tokens",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "temperature": -0.1})).await,
        StatusCode::BAD_REQUEST,
        "temperature",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "top_p": 0})).await,
        StatusCode::BAD_REQUEST,
        "top_p",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "top_p": 1.5})).await,
        StatusCode::BAD_REQUEST,
        "top_p",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "top_k": -2})).await,
        StatusCode::BAD_REQUEST,
        "top_k",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "n": 0})).await,
        StatusCode::BAD_REQUEST,
        "`n`",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "n": 129})).await,
        StatusCode::BAD_REQUEST,
        "`n`",
    );
    let stops: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
    assert_error(
        &h.post(c, json!({"prompt": "x", "stop": stops})).await,
        StatusCode::BAD_REQUEST,
        "stop",
    );
    assert_eq!(
        h.post(c, json!({"prompt": "x", "stop": &stops[..16]}))
            .await
            .status,
        StatusCode::OK
    );
    assert_error(
        &h.post(c, json!({"prompt": [1, 300]})).await,
        StatusCode::BAD_REQUEST,
        "vocabulary",
    );
    assert_error(
        &h.post(c, json!({"prompt": [-1]})).await,
        StatusCode::BAD_REQUEST,
        "vocabulary",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "stop_token_ids": [999]}))
            .await,
        StatusCode::BAD_REQUEST,
        "vocabulary",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "logprobs": 21})).await,
        StatusCode::BAD_REQUEST,
        "logprobs",
    );
    assert_error(
        &h.post(
            c,
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
        )
        .await,
        StatusCode::BAD_REQUEST,
        "stream",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "presence_penalty": 3}))
            .await,
        StatusCode::BAD_REQUEST,
        "presence_penalty",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "repetition_penalty": 0}))
            .await,
        StatusCode::BAD_REQUEST,
        "repetition_penalty",
    );
    assert!(
        h.engine.submitted.lock().len() == 2,
        "only the two valid requests reached the engine"
    );
}

#[tokio::test]
async fn logit_bias_reaches_the_engine_sorted_and_bad_maps_are_400() {
    let h = harness();
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "x"}]);
    let r = h
        .post(
            c,
            json!({"prompt": "x", "logit_bias": {"7": 100, "3": -100, " 5": 2.5}}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let r = h
        .post(chat, json!({"messages": msgs, "logit_bias": {"1": -1}}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    {
        let sub = h.engine.submitted.lock();
        assert_eq!(
            sub[0].sampling.logit_bias,
            vec![(3, -100.0), (5, 2.5), (7, 100.0)]
        );
        assert_eq!(sub[1].sampling.logit_bias, vec![(1, -1.0)]);
    }
    let too_many: serde_json::Map<String, Value> =
        (0..1025).map(|i| (i.to_string(), json!(1))).collect();
    let bad = [
        json!({"x": 1}),
        json!({"-1": 1}),
        json!({(VOCAB).to_string(): 1}),
        json!({"5": 100.5}),
        json!({"5": "big"}),
        json!({"5": 1, "05": 2}),
        Value::Object(too_many),
    ];
    for bias in bad {
        let r = h.post(c, json!({"prompt": "x", "logit_bias": bias})).await;
        assert_error(&r, StatusCode::BAD_REQUEST, "logit_bias");
    }
    assert_eq!(
        h.engine.submitted.lock().len(),
        2,
        "no bad request reached the engine"
    );
}

#[tokio::test]
async fn vllm_extras_that_would_change_the_output_are_refused_and_no_ops_pass() {
    let h = harness();
    let c = "/v1/completions";
    let refused = [
        ("bad_words", json!(["x"])),
        ("use_beam_search", json!(true)),
    ];
    for (field, value) in refused {
        let mut body = json!({"prompt": "x"});
        body[field] = value;
        let r = h.post(c, body).await;
        assert_error(&r, StatusCode::BAD_REQUEST, field);
        assert_eq!(r.json()["error"]["code"], "unsupported_parameter");
    }
    let no_ops = json!({"prompt": "x", "bad_words": [], "allowed_token_ids": null,
                        "include_stop_str_in_output": false, "skip_special_tokens": true,
                        "use_beam_search": false, "guided_json": null});
    let r = h.post(c, no_ops).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(h.engine.submitted.lock().len(), 1);
}

#[tokio::test]
async fn allowed_token_ids_reach_the_engine_as_a_mask() {
    let h = harness();
    let c = "/v1/completions";
    let r = h
        .post(c, json!({"prompt": "x", "allowed_token_ids": [3, 40, 33]}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let mask = h.engine.submitted.lock()[0].allowed_tokens.clone().unwrap();
    assert_eq!(*mask, vec![1 << 3, (1 << 1) | (1 << 8)]);
    for (ids, fragment) in [
        (json!([]), "at least one"),
        (json!([1, VOCAB]), "outside the vocabulary"),
    ] {
        let r = h
            .post(c, json!({"prompt": "x", "allowed_token_ids": ids}))
            .await;
        assert_error(&r, StatusCode::BAD_REQUEST, fragment);
        assert_eq!(r.json()["error"]["param"], "allowed_token_ids");
    }
}

#[tokio::test]
async fn stop_strings_and_special_tokens_can_stay_in_the_text() {
    let h = harness();
    let c = "/v1/completions";
    let text = |body: Value| async {
        let r = h.post(c, body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    // The scripted reply is "hello world" then EOS ("</s>", a special token).
    assert_eq!(
        text(json!({"prompt": "x", "stop": ["wor"]})).await,
        "hello "
    );
    assert_eq!(
        text(json!({"prompt": "x", "stop": ["wor"], "include_stop_str_in_output": true})).await,
        "hello wor"
    );
    assert_eq!(text(json!({"prompt": "x"})).await, "hello world");
    // The EOS token's text shows only when special tokens do.
    assert_eq!(
        text(json!({"prompt": "x", "include_stop_str_in_output": true})).await,
        "hello world"
    );
    assert_eq!(
        text(
            json!({"prompt": "x", "include_stop_str_in_output": true, "skip_special_tokens": false})
        )
        .await,
        "hello world</s>"
    );
    assert_eq!(
        text(json!({"prompt": "x", "skip_special_tokens": false})).await,
        "hello world"
    );
    let r = h
        .post(c, json!({"prompt": "x", "skip_special_tokens": "no"}))
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "expected a boolean");
}

#[tokio::test]
async fn structured_outputs_reach_the_engine_compiled_and_bad_ones_are_400() {
    let h = harness();
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "x"}]);
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let accepted = [
        (
            chat,
            json!({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": true}}}),
        ),
        (
            chat,
            json!({"messages": msgs, "response_format": {"type": "json_object"}}),
        ),
        (c, json!({"prompt": "x", "guided_json": schema})),
        (c, json!({"prompt": "x", "guided_regex": "[ab]+"})),
        (
            c,
            json!({"prompt": "x", "guided_choice": ["yes", "no"], "n": 2}),
        ),
        (c, json!({"prompt": "x", "guided_grammar": "start: \"a\"+"})),
        (
            c,
            json!({"prompt": "x", "structured_outputs": {"regex": "a"}}),
        ),
        (c, json!({"prompt": "x", "regex": "a"})),
        (c, json!({"prompt": "x", "json_schema": schema.to_string()})),
    ];
    for (path, body) in accepted {
        let before = h.engine.submitted.lock().len();
        let r = h.post(path, body.clone()).await;
        assert_eq!(r.status, StatusCode::OK, "{body}: {}", r.body);
        let submitted = h.engine.submitted.lock();
        assert!(submitted.len() > before);
        assert!(
            submitted[before..].iter().all(|g| g.constraint.is_some()),
            "{body}: every sample carries its compiled grammar"
        );
    }
    let refused = [
        (
            json!({"prompt": "x", "guided_regex": "(unclosed"}),
            "guided_regex",
        ),
        (
            json!({"prompt": "x", "guided_json": {"type": "no-such-type"}}),
            "guided_json",
        ),
        // GBNF is not Lark: `guided_grammar` takes Lark.
        (
            json!({"prompt": "x", "guided_grammar": "root ::= 'a'"}),
            "guided_grammar",
        ),
        (
            json!({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}),
            "guided_choice",
        ),
        (
            json!({"prompt": "x", "guided_regex": "a", "min_tokens": 2}),
            "min_tokens",
        ),
    ];
    for (body, param) in refused {
        let r = h.post(c, body.clone()).await;
        assert_error(&r, StatusCode::BAD_REQUEST, param);
        assert_eq!(r.json()["error"]["param"], param, "{body}");
    }
    let plain = h.post(c, json!({"prompt": "x"})).await;
    assert_eq!(plain.status, StatusCode::OK);
    assert!(h
        .engine
        .submitted
        .lock()
        .last()
        .unwrap()
        .constraint
        .is_none());
    // Counted once per request (not per sample) by kind; refused ones are not.
    let metrics = h.get("/metrics").await.body;
    for (kind, count) in [
        ("json_schema", 3),
        ("json_object", 1),
        ("regex", 3),
        ("choice", 1),
        ("grammar", 1),
    ] {
        let line =
            format!("nsaserve_structured_output_requests_total{{kind=\"{kind}\"}} {count}\n");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    assert!(
        metrics.contains("nsaserve_grammar_compile_seconds_count 9\n"),
        "{metrics}"
    );
}

#[tokio::test]
async fn min_tokens_reaches_the_engine_and_bad_values_are_refused() {
    let h = harness();
    let c = "/v1/completions";
    for body in [
        json!({"prompt": "x", "max_tokens": 5, "min_tokens": 3}),
        json!({"prompt": "x", "max_tokens": 5, "min_new_tokens": 3}),
        json!({"prompt": "x", "max_tokens": 5, "min_tokens": 3, "min_new_tokens": 3}),
    ] {
        let r = h.post(c, body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        assert_eq!(h.engine.submitted.lock().last().unwrap().min_new_tokens, 3);
    }
    let r = h.post(c, json!({"prompt": "x", "max_tokens": 5})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(h.engine.submitted.lock().last().unwrap().min_new_tokens, 0);
    let bad = [
        (json!({"prompt": "x", "min_tokens": -1}), "min_tokens"),
        (
            json!({"prompt": "x", "max_tokens": 2, "min_tokens": 3}),
            "min_tokens",
        ),
        (
            json!({"prompt": "x", "max_tokens": 2, "min_new_tokens": 3}),
            "min_new_tokens",
        ),
        (
            json!({"prompt": "x", "min_tokens": 1, "min_new_tokens": 2}),
            "min_new_tokens",
        ),
    ];
    for (body, param) in bad {
        let r = h.post(c, body).await;
        assert_error(&r, StatusCode::BAD_REQUEST, param);
    }
    assert_eq!(
        h.engine.submitted.lock().len(),
        4,
        "no bad request reached the engine"
    );
}

#[tokio::test]
async fn priority_reaches_the_engine_on_every_endpoint_and_bad_values_are_refused() {
    let h = harness();
    let msgs = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 2, "priority": -7}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 2, "priority": -7}),
        ),
        (
            "/v1/responses",
            json!({"input": "x", "max_output_tokens": 2, "priority": -7}),
        ),
        (
            "/v1/messages",
            json!({"messages": msgs, "max_tokens": 2, "priority": -7}),
        ),
    ];
    for (path, body) in cases {
        let r = h.post(path, body).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.body);
        assert_eq!(
            h.engine.submitted.lock().last().unwrap().priority,
            -7,
            "{path}"
        );
    }
    let r = h
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(h.engine.submitted.lock().last().unwrap().priority, 0);
    for bad in [json!(1_i64 << 40), json!(1.5), json!("high")] {
        let r = h
            .post("/v1/completions", json!({"prompt": "x", "priority": bad}))
            .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {}", r.body);
    }
    assert_eq!(
        h.engine.submitted.lock().len(),
        5,
        "no bad request reached the engine"
    );
}

#[tokio::test]
async fn cache_salt_reaches_the_engine_and_an_empty_one_is_refused() {
    let h = harness();
    let msgs = json!([{"role": "user", "content": "x"}]);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 2, "cache_salt": "t1"}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 2, "cache_salt": "t1"}),
        ),
    ] {
        let r = h.post(path, body).await;
        assert_eq!(r.status, StatusCode::OK, "{path}: {}", r.body);
        let salt = h.engine.submitted.lock().last().unwrap().cache_salt.clone();
        assert_eq!(salt.as_deref(), Some("t1"), "{path}");
    }
    let r = h
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 2}))
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let unsalted = h.engine.submitted.lock().last().unwrap().cache_salt.clone();
    assert_eq!(unsalted, None);
    let r = h
        .post("/v1/completions", json!({"prompt": "x", "cache_salt": ""}))
        .await;
    assert_error(&r, StatusCode::BAD_REQUEST, "cache_salt");
    assert_eq!(h.engine.submitted.lock().len(), 3);
}

#[tokio::test]
async fn unsupported_features_are_refused_not_ignored() {
    let h = harness();
    let c = "/v1/completions";
    let chat = "/v1/chat/completions";
    let msgs = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (c, json!({"prompt": "x", "best_of": 3}), "best_of"),
        (c, json!({"prompt": "x", "suffix": "end"}), "suffix"),
        (
            chat,
            json!({"messages": msgs, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            chat,
            json!({"messages": msgs, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (
            chat,
            json!({"messages": msgs, "response_format": {"type": "structural_tag"}}),
            "response_format",
        ),
        (c, json!({"prompt": "x", "ebnf": "root ::= \"a\""}), "ebnf"),
    ];
    for (path, body, param) in cases {
        let r = h.post(path, body).await;
        assert_error(&r, StatusCode::BAD_REQUEST, param);
        assert_eq!(r.json()["error"]["param"], param);
        assert_eq!(r.json()["error"]["code"], "unsupported_parameter");
    }
    let accepted = [
        (
            c,
            json!({"prompt": "x", "logit_bias": {}, "best_of": 1, "suffix": ""}),
        ),
        (
            chat,
            json!({"messages": msgs, "tool_choice": "auto", "response_format": {"type": "text"}}),
        ),
        (chat, json!({"messages": msgs, "tool_choice": "none"})),
    ];
    for (path, body) in accepted {
        let r = h.post(path, body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    }
}

#[tokio::test]
async fn configurable_limits_and_body_size() {
    let h = harness_with(|c| {
        c.max_body_bytes = 1000;
        c.max_stop_strings = 2;
        c.max_n = 4;
    });
    let c = "/v1/completions";
    let big = "x".repeat(2000);
    assert_error(
        &h.post(c, json!({"prompt": big})).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "1000 bytes",
    );
    // A body without Content-Length (chunked) is limited too.
    let chunks = futures::stream::iter(vec![
        Ok::<_, std::io::Error>(vec![b' '; 600]),
        Ok(vec![b' '; 600]),
    ]);
    let request = Request::post(c).body(Body::from_stream(chunks)).unwrap();
    assert_error(
        &h.send(request).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "1000 bytes",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "stop": ["a", "b", "c"]}))
            .await,
        StatusCode::BAD_REQUEST,
        "stop",
    );
    assert_error(
        &h.post(c, json!({"prompt": "x", "n": 5})).await,
        StatusCode::BAD_REQUEST,
        "`n`",
    );
}

#[tokio::test]
async fn engine_refusals_map_to_statuses() {
    let h = harness();
    let body = json!({"prompt": "x"});
    *h.engine.refuse.lock() = Some(SubmitError::Overloaded("queue full".into()));
    let r = h.post("/v1/completions", body.clone()).await;
    assert_error(&r, StatusCode::TOO_MANY_REQUESTS, "queue full");
    assert!(r.headers.contains_key(header::RETRY_AFTER));
    *h.engine.refuse.lock() = Some(SubmitError::Unavailable("restarting".into()));
    assert_error(
        &h.post("/v1/completions", body.clone()).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "restarting",
    );
    *h.engine.refuse.lock() = Some(SubmitError::Invalid("does not fit the KV pool".into()));
    let chat = json!({"messages": [{"role": "user", "content": "x"}]});
    assert_error(
        &h.post("/v1/chat/completions", chat).await,
        StatusCode::BAD_REQUEST,
        "KV pool",
    );
}

#[tokio::test]
async fn partial_submission_failure_aborts_accepted_samples() {
    struct RefuseThird(Arc<ScriptedEngine>, AtomicU64);
    impl Engine for RefuseThird {
        fn submit(&self, r: GenerateRequest) -> Result<RequestStream, SubmitError> {
            if self.1.fetch_add(1, Ordering::Relaxed) == 2 {
                return Err(SubmitError::Overloaded("full".into()));
            }
            self.0.submit(r)
        }
        fn healthy(&self) -> bool {
            true
        }
        fn model_info(&self) -> ModelInfo {
            self.0.model_info()
        }
    }
    let tokenizer = tokenizer();
    let inner = ScriptedEngine::new(Arc::clone(&tokenizer));
    let engine = Arc::new(RefuseThird(inner.clone(), AtomicU64::new(0)));
    let app = router(
        HttpConfig::new("tiny"),
        engine,
        tokenizer.clone(),
        Arc::new(Metrics::new()),
    );
    let h = Harness {
        app,
        engine: inner.clone(),
        metrics: Arc::new(Metrics::new()),
        tokenizer,
    };
    let r = h
        .post("/v1/completions", json!({"prompt": "x", "n": 3}))
        .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(wait_for_aborts(&inner, 2).await.len(), 2);
}

#[tokio::test]
async fn engine_failures_during_generation() {
    let h = harness();
    h.engine.set_reply(Reply::FailAfter(1, true));
    assert_error(
        &h.post("/v1/completions", json!({"prompt": "x"})).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "worker 1 died",
    );
    h.engine.set_reply(Reply::FailAfter(1, false));
    assert_error(
        &h.post("/v1/completions", json!({"prompt": "x"})).await,
        StatusCode::INTERNAL_SERVER_ERROR,
        "worker 1 died",
    );
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "stream": true}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let events = r.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("worker 1 died"));
}

#[tokio::test]
async fn a_refusal_from_the_engine_loop_keeps_its_status() {
    // The handle checks the queue bound against the last published count, so a burst (many
    // prompts x n) can reach a full queue in the engine loop: still a 429, never a 500.
    let h = harness();
    let full = SubmitError::Overloaded("512 requests are waiting".into());
    h.engine.set_reply(Reply::RefusedLater(full));
    let r = h
        .post("/v1/completions", json!({"prompt": ["x", "y"], "n": 3}))
        .await;
    assert_error(
        &r,
        StatusCode::TOO_MANY_REQUESTS,
        "512 requests are waiting",
    );
    h.engine
        .set_reply(Reply::RefusedLater(SubmitError::Unavailable(
            "restarting".into(),
        )));
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, "restarting");
}

#[tokio::test]
async fn dropping_a_stream_aborts_the_request() {
    let h = harness();
    h.engine
        .set_reply(Reply::Text("a long answer that keeps going".into()));
    *h.engine.delay.lock() = Duration::from_millis(20);
    let request = Request::post("/v1/completions")
        .body(Body::from(
            json!({"prompt": "x", "stream": true}).to_string(),
        ))
        .unwrap();
    let response = h.app.clone().oneshot(request).await.unwrap();
    let mut body = response.into_body().into_data_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    assert!(h.engine.aborted.lock().is_empty());
    drop(body);
    assert_eq!(wait_for_aborts(&h.engine, 1).await, vec![1]);
}

#[tokio::test]
async fn dropping_a_waiting_response_aborts_every_sample() {
    let h = harness();
    *h.engine.delay.lock() = Duration::from_millis(50);
    let body = json!({"prompt": "x", "n": 2}).to_string();
    let request = Request::post("/v1/completions")
        .body(Body::from(body))
        .unwrap();
    let pending = tokio::spawn(h.app.clone().oneshot(request));
    for _ in 0..200 {
        if h.engine.submitted.lock().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(h.engine.submitted.lock().len(), 2);
    pending.abort();
    let mut aborted = wait_for_aborts(&h.engine, 2).await;
    aborted.sort_unstable();
    assert_eq!(aborted, vec![1, 2]);
}

#[tokio::test]
async fn api_key_guards_v1_routes_only() {
    let h = harness_with(|c| c.api_key = Some("sesame".into()));
    let body = || Body::from(json!({"prompt": "x", "max_tokens": 1}).to_string());
    let r = h
        .send(Request::post("/v1/completions").body(body()).unwrap())
        .await;
    assert_error(&r, StatusCode::UNAUTHORIZED, "API key");
    assert_eq!(r.headers[header::WWW_AUTHENTICATE], "Bearer");
    let r = h
        .send(
            Request::post("/v1/completions")
                .header(header::AUTHORIZATION, "Bearer sesame!")
                .body(body())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h
        .send(
            Request::get("/v1/models")
                .header(header::AUTHORIZATION, "Basic sesame")
                .body(Body::empty())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = h
        .send(
            Request::post("/v1/completions")
                .header(header::AUTHORIZATION, "Bearer sesame")
                .body(body())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(h.get("/health").await.status, StatusCode::OK);
    assert!(h.engine.submitted.lock().len() == 1);
}

// ---------------------------------------------------------------- request ids

#[tokio::test]
async fn every_response_carries_a_request_id_and_keeps_the_clients() {
    let h = harness_with(|c| c.api_key = Some("sesame".into()));
    let id_of = |r: &Reply_| {
        r.headers
            .get("x-request-id")
            .unwrap_or_else(|| panic!("no x-request-id: {:?}", r.headers))
            .to_str()
            .unwrap()
            .to_owned()
    };
    let authed = |path: &str, id: Option<&str>, body: Value| {
        let mut b = Request::post(path)
            .header(header::AUTHORIZATION, "Bearer sesame")
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(id) = id {
            b = b.header("x-request-id", id);
        }
        b.body(Body::from(body.to_string())).unwrap()
    };
    let body = json!({"prompt": "hi", "max_tokens": 2});
    // Made by the server when the client sends none (or an unusable one) ...
    let a = h.send(authed("/v1/completions", None, body.clone())).await;
    let b = h
        .send(authed("/v1/completions", Some("has space"), body.clone()))
        .await;
    assert_eq!((a.status, b.status), (StatusCode::OK, StatusCode::OK));
    assert!(id_of(&a).starts_with("req-") && id_of(&b).starts_with("req-"));
    assert_ne!(id_of(&a), id_of(&b));
    // ... the client's own otherwise, streaming or not.
    let r = h
        .send(authed("/v1/completions", Some("gw-42"), body.clone()))
        .await;
    assert_eq!(id_of(&r), "gw-42");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = h
        .send(authed("/v1/completions", Some("gw-43"), streamed))
        .await;
    assert_eq!((r.status, id_of(&r).as_str()), (StatusCode::OK, "gw-43"));
    // Refusals carry one too: a bad body, a missing key, an unknown route.
    let r = h
        .send(authed(
            "/v1/completions",
            Some("gw-44"),
            json!({"prompt": 7}),
        ))
        .await;
    assert_eq!(
        (r.status, id_of(&r).as_str()),
        (StatusCode::BAD_REQUEST, "gw-44")
    );
    let r = h.post("/v1/completions", body).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert!(id_of(&r).starts_with("req-"));
    assert!(id_of(&h.get("/nowhere").await).starts_with("req-"));
}

// ---------------------------------------------------------------- tokenize, detokenize

#[tokio::test]
async fn tokenize_a_prompt_as_completions_does() {
    let h = harness();
    let r = h.post("/tokenize", json!({"prompt": "hello world"})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    let want = h.tokenizer.encode("hello world", true).unwrap();
    assert_eq!(want[0], BOS, "raw prompts get the tokenizer's BOS");
    assert_eq!(v["tokens"], json!(want));
    assert_eq!(v["count"], want.len());
    assert_eq!(v["max_model_len"], CONTEXT);
    assert!(v.get("token_strs").is_none(), "{v}");
    // The same count a completion request reports as its prompt tokens.
    let c = h
        .post(
            "/v1/completions",
            json!({"prompt": "hello world", "max_tokens": 2}),
        )
        .await
        .json();
    assert_eq!(c["usage"]["prompt_tokens"], v["count"]);
    let v = h
        .post(
            "/tokenize",
            json!({"model": "tiny", "prompt": "hello world", "add_special_tokens": false, "return_token_strs": true}),
        )
        .await
        .json();
    assert_eq!(
        v["tokens"],
        json!(h.tokenizer.encode("hello world", false).unwrap())
    );
    let pieces: Vec<&str> = v["token_strs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert_eq!(pieces.len(), v["count"].as_u64().unwrap() as usize);
    assert_eq!(pieces.concat(), "hello world");
    assert!(
        h.engine.submitted.lock().len() == 1,
        "tokenize generates nothing"
    );
}

#[tokio::test]
async fn tokenize_messages_as_chat_completions_does() {
    let h = harness();
    let messages = json!([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}
    ]);
    let kwargs = json!({"greeting": "!"});
    let v = h
        .post(
            "/tokenize",
            json!({"messages": messages, "chat_template_kwargs": kwargs}),
        )
        .await
        .json();
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": messages, "chat_template_kwargs": kwargs, "max_completion_tokens": 1}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let submitted = h.engine.submitted.lock()[0].prompt_ids.clone();
    assert_eq!(v["tokens"], json!(submitted));
    assert_eq!(
        h.tokenizer.decode(&submitted, false),
        "<s><|system|>be brief<|user|>one\ntwo<|assistant|>!"
    );
    let v = h
        .post(
            "/tokenize",
            json!({"messages": messages, "add_generation_prompt": false}),
        )
        .await
        .json();
    let ids: Vec<i32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(
        h.tokenizer.decode(&ids, false),
        "<s><|system|>be brief<|user|>one\ntwo"
    );
}

#[tokio::test]
async fn tokenize_refuses_bad_requests() {
    let h = harness();
    let cases = [
        (json!({}), StatusCode::BAD_REQUEST, "is required"),
        (
            json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
            StatusCode::BAD_REQUEST,
            "not both",
        ),
        (
            json!({"messages": []}),
            StatusCode::BAD_REQUEST,
            "must not be empty",
        ),
        (
            json!({"messages": [{"role": "robot", "content": "b"}]}),
            StatusCode::BAD_REQUEST,
            "must be one of",
        ),
        (
            json!({"messages": [{"role": "tool", "content": "42"}]}),
            StatusCode::BAD_REQUEST,
            "tool messages need tools",
        ),
        (
            json!({"prompt": 7}),
            StatusCode::BAD_REQUEST,
            "Invalid JSON body",
        ),
        (
            json!({"model": "other", "prompt": "a"}),
            StatusCode::NOT_FOUND,
            "`other` does not exist",
        ),
    ];
    for (body, status, fragment) in cases {
        assert_error(&h.post("/tokenize", body).await, status, fragment);
    }
}

#[tokio::test]
async fn detokenize_round_trips_and_checks_ids() {
    let h = harness();
    let ids = h.tokenizer.encode("hello world", true).unwrap();
    let r = h.post("/detokenize", json!({"tokens": ids})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.json(), json!({"prompt": "<s>hello world"}));
    assert_eq!(
        h.post("/detokenize", json!({"tokens": []})).await.json(),
        json!({"prompt": ""})
    );
    assert_error(
        &h.post("/detokenize", json!({"tokens": [1, VOCAB]})).await,
        StatusCode::BAD_REQUEST,
        "outside the vocabulary",
    );
    assert_error(
        &h.post("/detokenize", json!({"tokens": [-1]})).await,
        StatusCode::BAD_REQUEST,
        "outside the vocabulary",
    );
    assert_error(
        &h.post("/detokenize", json!({})).await,
        StatusCode::BAD_REQUEST,
        "`tokens` is required",
    );
    assert_error(
        &h.post("/detokenize", json!({"model": "x", "tokens": [1]}))
            .await,
        StatusCode::NOT_FOUND,
        "does not exist",
    );
}

#[tokio::test]
async fn tokenize_needs_the_api_key_like_v1() {
    let h = harness_with(|c| c.api_key = Some("sesame".into()));
    assert_eq!(
        h.post("/tokenize", json!({"prompt": "a"})).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        h.post("/detokenize", json!({"tokens": [1]})).await.status,
        StatusCode::UNAUTHORIZED
    );
    let r = h
        .send(
            Request::post("/tokenize")
                .header(header::AUTHORIZATION, "Bearer sesame")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(json!({"prompt": "a"}).to_string()))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

// ---------------------------------------------------------------- small endpoints

#[tokio::test]
async fn models_health_version_and_fallbacks() {
    let h = harness();
    let v = h.get("/v1/models").await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["max_model_len"], CONTEXT);
    // One model by name (the OpenAI client's models.retrieve): the same card, or a 404.
    assert_eq!(h.get("/v1/models/tiny").await.json(), v["data"][0]);
    let missing = h.get("/v1/models/org/other").await;
    assert_error(
        &missing,
        StatusCode::NOT_FOUND,
        "`org/other` does not exist",
    );
    assert_eq!(missing.json()["error"]["code"], "model_not_found");
    let slashed = harness_with(|c| c.served_model_name = "org/tiny".into());
    assert_eq!(
        slashed.get("/v1/models/org/tiny").await.json()["id"],
        "org/tiny"
    );
    assert_eq!(
        slashed.get("/v1/models/org%2Ftiny").await.json()["id"],
        "org/tiny"
    );
    assert_eq!(h.get("/health").await.status, StatusCode::OK);
    h.engine.healthy.store(false, Ordering::Relaxed);
    assert_error(
        &h.get("/health").await,
        StatusCode::SERVICE_UNAVAILABLE,
        "not healthy",
    );
    assert_eq!(
        h.get("/version").await.json()["version"],
        env!("CARGO_PKG_VERSION")
    );
    assert_error(
        &h.get("/v2/nothing").await,
        StatusCode::NOT_FOUND,
        "/v2/nothing",
    );
    assert_error(
        &h.get("/v1/completions").await,
        StatusCode::METHOD_NOT_ALLOWED,
        "not allowed",
    );
}

#[tokio::test]
async fn metrics_count_requests_and_latencies() {
    let h = harness();
    h.post("/v1/completions", json!({"prompt": "x"})).await;
    h.post("/v1/completions", json!({"prompt": ""})).await;
    h.metrics.set_scheduler_gauges(SchedulerGauges {
        waiting: 4,
        running: 2,
        kv_pages_used: 7,
        kv_pages_free: 9,
        kv_pages_total: 16,
    });
    h.metrics.observe_batch_size(2);
    h.metrics.add_prefix_hit_tokens(128);
    let r = h.get("/metrics").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.headers[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = r.body;
    assert!(
        text.contains("nsaserve_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("nsaserve_requests_total{endpoint=\"/v1/completions\",status=\"400\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("nsaserve_time_to_first_token_seconds_count 1\n"),
        "{text}"
    );
    assert!(text.contains("nsaserve_e2e_request_latency_seconds_count 1\n"));
    assert!(text.contains("nsaserve_inter_token_latency_seconds_count 2\n"));
    assert!(text.contains("nsaserve_time_per_output_token_seconds_count 1\n"));
    assert!(text.contains("nsaserve_generation_tokens_total 3\n"));
    assert!(text.contains("nsaserve_requests_waiting 4\n"));
    assert!(text.contains("nsaserve_kv_pages_used 7\n"));
    assert!(text.contains("nsaserve_prefix_cache_hit_tokens_total 128\n"));
    assert!(text.contains("nsaserve_batch_size_count 1\n"));
}

// ---------------------------------------------------------------- reasoning and tool calls

/// GLM-4.7/5's chat template, cut down to what these tests touch: tools listed in a system
/// turn, assistant turns with their reasoning and tool calls in GLM's markup, tool results as
/// observations, and the generation prompt that opens `<think>` (or closes it when
/// `enable_thinking` is false).
const GLM_TEMPLATE: &str = "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}{% endif %}{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}{% elif m.role == 'assistant' %}<|assistant|><think>{{ m.reasoning_content or '' }}</think>{{ m.content or '' }}{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}{% elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' }}{% endif %}";

/// DeepSeek-V3.2's turn markers; thinking opens in the prompt when `thinking` is true.
const DEEPSEEK_TEMPLATE: &str = "<｜begin▁of▁sentence｜>{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% endif %}{% endfor %}<｜Assistant｜>{{ '<think>' if thinking else '</think>' }}";

fn parser_harness(
    template: &str,
    reasoning: Option<ReasoningParserKind>,
    tools: Option<ToolParserKind>,
) -> Harness {
    let h = build_harness(tokenizer_with_template(template), |cfg| {
        cfg.reasoning_parser = reasoning;
        cfg.tool_call_parser = tools;
    });
    *h.engine.max_context.lock() = 4096;
    h
}

fn glm_harness() -> Harness {
    parser_harness(
        GLM_TEMPLATE,
        Some(ReasoningParserKind::Glm45),
        Some(ToolParserKind::Glm47),
    )
}

#[tokio::test]
async fn a_thinking_model_thinks_freely_before_its_structured_answer() {
    let h = glm_harness();
    // Whether the grammar of the request `kwargs` renders shapes the first generated token.
    let active_from_the_start = |kwargs: Value| {
        let h = &h;
        async move {
            let body = json!({"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}, "chat_template_kwargs": kwargs});
            let r = h.post("/v1/chat/completions", body).await;
            assert_eq!(r.status, StatusCode::OK, "{}", r.body);
            let submitted = h.engine.submitted.lock();
            submitted
                .last()
                .unwrap()
                .constraint
                .as_ref()
                .unwrap()
                .is_active()
        }
    };
    // The prompt opens <think>: the grammar waits for </think>.
    assert!(!active_from_the_start(json!({})).await);
    assert!(active_from_the_start(json!({"enable_thinking": false})).await);
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                        "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    ])
}

const GLM_CALL_REPLY: &str = "The user wants the weather.</think>Let me check.\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>";

fn rendered_prompt(h: &Harness) -> String {
    let submitted = h.engine.submitted.lock().last().unwrap().clone();
    h.tokenizer.decode(&submitted.prompt_ids, false)
}

fn assert_call_id(id: &Value) {
    let id = id.as_str().unwrap();
    assert!(
        id.starts_with("call_") && id.len() == 29,
        "OpenAI-style call id: {id}"
    );
}

#[tokio::test]
async fn chat_glm_reasoning_and_tool_call() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                      "tools": weather_tools()});
    let r = h.post("/v1/chat/completions", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    assert_eq!(
        rendered_prompt(&h),
        "[gMASK]<sop><|system|>\n# Tools\nget_weather\nget_time\n<|user|>Weather in Paris?<|assistant|><think>"
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_call_id(&message["tool_calls"][0]["id"]);
    let mut message = message.clone();
    message["tool_calls"][0]["id"] = json!("call_x");
    assert_eq!(
        message,
        json!({
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "The user wants the weather.",
            "tool_calls": [{"id": "call_x", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":2}"}}]
        })
    );
}

#[tokio::test]
async fn chat_glm_only_a_call_has_null_content() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(
        "Plan.</think><tool_call>get_time</tool_call>".into(),
    ));
    let body =
        json!({"messages": [{"role": "user", "content": "time?"}], "tools": weather_tools()});
    let v = h.post("/v1/chat/completions", body).await.json();
    let message = &v["choices"][0]["message"];
    assert_eq!(message["content"], Value::Null);
    assert!(message.as_object().unwrap().contains_key("content"));
    assert_eq!(message["tool_calls"][0]["function"]["arguments"], "{}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
}

#[tokio::test]
async fn chat_glm_stream_sends_reasoning_content_and_tool_call_deltas() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let body = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}],
                      "tools": weather_tools(), "stream": true, "logprobs": true});
    let chunks = h.post("/v1/chat/completions", body).await.chunks();
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let reasoning = stream_text(&chunks, |c| c["delta"]["reasoning_content"].as_str());
    let content = stream_text(&chunks, |c| c["delta"]["content"].as_str());
    assert_eq!(reasoning[&0], "The user wants the weather.");
    assert_eq!(content[&0], "Let me check.");
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 2, "a name delta, then an arguments delta");
    assert_call_id(&calls[0][0]["id"]);
    let mut first = calls[0].clone();
    first[0]["id"] = json!("call_x");
    assert_eq!(
        first,
        json!([{"index": 0, "id": "call_x", "type": "function",
                "function": {"name": "get_weather", "arguments": ""}}])
    );
    assert_eq!(
        *calls[1],
        json!([{"index": 0, "function": {"arguments": "{\"city\":\"Paris\",\"days\":2}"}}])
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    // Every generated token's logprob is sent exactly once, even those whose text was held.
    let tokens: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .map(Vec::len)
        .sum();
    let generated = h.tokenizer.encode(GLM_CALL_REPLY, false).unwrap().len();
    assert_eq!(tokens, generated);
}

#[tokio::test]
async fn chat_thinking_disabled_keeps_the_answer_in_content() {
    let h = glm_harness();
    h.engine
        .set_reply(Reply::Text("No thinking </think> here.".into()));
    let body = json!({"messages": [{"role": "user", "content": "hi"}],
                      "chat_template_kwargs": {"enable_thinking": false}});
    let v = h.post("/v1/chat/completions", body).await.json();
    assert!(rendered_prompt(&h).ends_with("<|assistant|></think>"));
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "No thinking </think> here."})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn chat_tool_turns_render_back_through_the_template() {
    let h = glm_harness();
    h.engine
        .set_reply(Reply::Text("Done.</think>It is sunny.".into()));
    let body = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
        ],
        "tools": weather_tools()
    });
    let v = h.post("/v1/chat/completions", body).await.json();
    assert_eq!(
        rendered_prompt(&h),
        "[gMASK]<sop><|system|>\n# Tools\nget_weather\nget_time\n<|user|>Weather in Paris?<|assistant|><think>Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|observation|><tool_response>sunny</tool_response><|assistant|><think>"
    );
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "It is sunny.", "reasoning_content": "Done."})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn chat_malformed_tool_markup_is_content_and_counted() {
    let h = glm_harness();
    let reply = "x</think>Try <tool_call>get_weather<arg_value>Paris</arg_value></tool_call>";
    h.engine.set_reply(Reply::Text(reply.into()));
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "tools": weather_tools()});
    let v = h.post("/v1/chat/completions", body.clone()).await.json();
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant",
               "content": "Try <tool_call>get_weather<arg_value>Paris</arg_value></tool_call>",
               "reasoning_content": "x"})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut stream = body;
    stream["stream"] = json!(true);
    let chunks = h.post("/v1/chat/completions", stream).await.chunks();
    let content = stream_text(&chunks, |c| c["delta"]["content"].as_str());
    assert_eq!(
        content[&0],
        "Try <tool_call>get_weather<arg_value>Paris</arg_value></tool_call>"
    );
    let metrics = h.get("/metrics").await.body;
    assert!(
        metrics.contains("nsaserve_parser_fallbacks_total{parser=\"glm47\"} 2\n"),
        "{metrics}"
    );
}

#[tokio::test]
async fn chat_tool_choice_none_required_and_named() {
    let h = glm_harness();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    // "none": markup stays text.
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let v = h
        .post(
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": "none"}),
        )
        .await
        .json();
    assert!(v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains("<tool_call>get_weather"));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // "required", obeyed.
    let v = h
        .post(
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": "required"}),
        )
        .await
        .json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    // Named: only that tool is rendered, and only calls to it count (the grammar, tested
    // below, keeps a real model from writing others; this engine ignores it).
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let v = h
        .post(
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": named}),
        )
        .await
        .json();
    assert!(rendered_prompt(&h).contains("# Tools\nget_time\n<|user|>"));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let v = h
        .post(
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": named}),
        )
        .await
        .json();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    // Bad choices.
    let chat = "/v1/chat/completions";
    let cases = [
        (
            json!({"messages": msgs, "tool_choice": "required"}),
            "needs `tools`",
        ),
        (
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "not in `tools`",
        ),
        (
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": "sometimes"}),
            "must be",
        ),
    ];
    for (body, fragment) in cases {
        let r = h.post(chat, body).await;
        assert_error(&r, StatusCode::BAD_REQUEST, fragment);
        assert_eq!(r.json()["error"]["param"], "tool_choice");
    }
}

/// The ids `text` encodes to, one token each (the markup tags are single tokens).
fn token_id(h: &Harness, text: &str) -> i32 {
    let ids = h.tokenizer.encode(text, false).unwrap();
    assert_eq!(ids.len(), 1, "{text:?} is one token");
    ids[0]
}

#[tokio::test]
async fn chat_forced_tool_choice_constrains_decoding_to_calls() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let allowed = |c: &mut nsaserve_router::grammar::TokenConstraint, t: i32| {
        let words = c.allowed_tokens(&[EOS], None).unwrap();
        words
            .get(t as usize / 32)
            .is_some_and(|w| w >> (t % 32) & 1 == 1)
    };
    let submitted = |h: &Harness| h.engine.submitted.lock().last().unwrap().clone();
    // "auto": no grammar.
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"messages": msgs, "tools": weather_tools()}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert!(submitted(&h).constraint.is_none());
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let r = h
            .post(
                "/v1/chat/completions",
                json!({"messages": msgs, "tools": weather_tools(), "tool_choice": choice}),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.body);
        let mut c = submitted(&h)
            .constraint
            .expect("a forced choice is a grammar");
        // The model thinks freely, then may only open a call.
        assert!(!c.is_active());
        c.advance(token_id(&h, "</think>")).unwrap();
        assert!(c.is_active());
        assert!(allowed(&mut c, token_id(&h, "<tool_call>")));
        assert!(!allowed(&mut c, token_id(&h, "hello")));
        assert!(!allowed(&mut c, EOS), "no answer without a call");
        c.advance(token_id(&h, "<tool_call>")).unwrap();
        for t in h.tokenizer.encode("get_", false).unwrap() {
            assert!(allowed(&mut c, t));
            c.advance(t).unwrap();
        }
        let byte = |s: &str| h.tokenizer.encode(s, false).unwrap()[0];
        assert!(allowed(&mut c, byte("w")), "get_weather");
        assert_eq!(
            allowed(&mut c, byte("t")),
            choice == "required",
            "get_time only if not named"
        );
    }
    let metrics = h.get("/metrics").await.body;
    assert!(
        metrics.contains("nsaserve_structured_output_requests_total{kind=\"tool_call\"} 2\n"),
        "{metrics}"
    );
    // A forced choice is already a grammar; nor can it promise min_tokens.
    let chat = "/v1/chat/completions";
    let cases = [
        (
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": "required",
                   "response_format": {"type": "json_object"}}),
            "tool_choice",
            "cannot be combined with `response_format`",
        ),
        (
            json!({"messages": msgs, "tools": weather_tools(), "tool_choice": "required", "min_tokens": 3}),
            "min_tokens",
            "forced `tool_choice`",
        ),
        (
            json!({"messages": msgs, "tools": [{"type": "function", "function": {}}], "tool_choice": "required"}),
            "tools",
            "each with a `name`",
        ),
    ];
    for (body, param, fragment) in cases {
        let r = h.post(chat, body).await;
        assert_error(&r, StatusCode::BAD_REQUEST, fragment);
        assert_eq!(r.json()["error"]["param"], param);
    }
}

#[tokio::test]
async fn chat_parallel_tool_calls_false_keeps_the_first_call() {
    let h = glm_harness();
    let two = format!("{GLM_CALL_REPLY}<tool_call>get_time</tool_call>");
    h.engine.set_reply(Reply::Text(two));
    let msgs = json!([{"role": "user", "content": "hi"}]);
    for (parallel, calls) in [(Value::Null, 2), (json!(true), 2), (json!(false), 1)] {
        let body =
            json!({"messages": msgs, "tools": weather_tools(), "parallel_tool_calls": parallel});
        let v = h.post("/v1/chat/completions", body.clone()).await.json();
        let got = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(got.len(), calls, "{v}");
        assert_eq!(got[0]["function"]["name"], "get_weather");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        // Streamed: the same calls, indexed from 0.
        let mut body = body;
        body["stream"] = json!(true);
        let r = h.post("/v1/chat/completions", body).await;
        let names: Vec<String> = r
            .chunks()
            .iter()
            .flat_map(|e| {
                e["choices"][0]["delta"]["tool_calls"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|d| d["function"]["name"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(names.len(), calls, "{}", r.body);
    }
}

#[tokio::test]
async fn chat_deepseek_v32_dsml_calls() {
    let h = parser_harness(
        DEEPSEEK_TEMPLATE,
        Some(ReasoningParserKind::DeepSeekV3),
        Some(ToolParserKind::DeepSeekV32),
    );
    let reply = "Two lookups.</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">杭州</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>";
    h.engine.set_reply(Reply::Text(reply.into()));
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "tools": weather_tools(),
                      "chat_template_kwargs": {"thinking": true}});
    let v = h.post("/v1/chat/completions", body.clone()).await.json();
    let message = &v["choices"][0]["message"];
    assert_eq!(message["content"], Value::Null);
    assert_eq!(message["reasoning_content"], "Two lookups.");
    let functions: Vec<&Value> = message["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["function"])
        .collect();
    assert_eq!(
        functions,
        [
            &json!({"name": "get_weather", "arguments": "{\"city\":\"杭州\",\"days\":3}"}),
            &json!({"name": "get_time", "arguments": "{}"})
        ]
    );
    // Streamed: two calls, indexes 0 and 1.
    let mut stream = body;
    stream["stream"] = json!(true);
    let chunks = h.post("/v1/chat/completions", stream).await.chunks();
    let indexes: Vec<u64> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["index"].as_u64())
        .collect();
    assert_eq!(indexes, [0, 0, 1, 1]);
    // Thinking off: the prompt closes `</think>` and nothing is taken for reasoning.
    h.engine.set_reply(Reply::Text("Hello.".into()));
    let v = h
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await
        .json();
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": "Hello."})
    );
}

// ---------------------------------------------------------------- responses

/// A stream of named events (the Responses and the Messages APIs): (name, data) pairs, checked
/// to carry their name as `type` and to end without `[DONE]`.
fn named_events(reply: &Reply_) -> Vec<(String, Value)> {
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let mut events = Vec::new();
    let mut name = None;
    for line in reply.body.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = Some(n.to_owned());
        } else if let Some(data) = line.strip_prefix("data: ") {
            assert_ne!(
                data, "[DONE]",
                "a stream of named events ends with its last event"
            );
            let v: Value = serde_json::from_str(data).unwrap();
            let name = name.take().expect("every event is named");
            assert_eq!(v["type"], name.as_str());
            events.push((name, v));
        }
    }
    events
}

/// A Responses API stream's events, numbered consecutively from 0.
fn response_events(reply: &Reply_) -> Vec<(String, Value)> {
    let events = named_events(reply);
    for (i, (_, v)) in events.iter().enumerate() {
        assert_eq!(v["sequence_number"], i as u64);
    }
    events
}

/// Output items without their generated ids.
fn without_ids(items: &Value) -> Value {
    let mut items = items.clone();
    for item in items.as_array_mut().unwrap() {
        let id = item["id"].as_str().unwrap();
        let prefix = match item["type"].as_str().unwrap() {
            "reasoning" => "rs_",
            "message" => "msg_",
            _ => "fc_",
        };
        assert!(id.starts_with(prefix), "{item}");
        item.as_object_mut().unwrap().remove("id");
        if let Some(call_id) = item.get("call_id") {
            assert_call_id(call_id);
            item["call_id"] = json!("call_x");
        }
    }
    items
}

#[tokio::test]
async fn responses_reasoning_answer_and_call_as_output_items() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let tools = json!([{"type": "function", "name": "get_weather", "description": "Weather by city",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                                       "required": ["city"]}},
                       {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]);
    let body = json!({"input": "Weather in Paris?", "tools": tools, "metadata": {"k": "v"}});
    let r = h.post("/v1/responses", body.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    // The prompt is the chat template's, as chat completions renders it.
    let chat_prompt = {
        let chat = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": weather_tools()});
        h.post("/v1/chat/completions", chat).await;
        rendered_prompt(&h)
    };
    h.post("/v1/responses", body.clone()).await;
    assert_eq!(rendered_prompt(&h), chat_prompt);
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(v["object"], "response");
    assert_eq!(
        (&v["status"], &v["store"], &v["error"]),
        (&json!("completed"), &json!(false), &Value::Null)
    );
    assert_eq!(v["tools"], tools);
    assert_eq!(v["metadata"], json!({"k": "v"}));
    assert_eq!(v["tool_choice"], "auto");
    assert_eq!(
        without_ids(&v["output"]),
        json!([
            {"type": "reasoning", "summary": [], "status": "completed",
             "content": [{"type": "reasoning_text", "text": "The user wants the weather."}]},
            {"type": "message", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "call_id": "call_x", "name": "get_weather",
             "arguments": "{\"city\":\"Paris\",\"days\":2}", "status": "completed"}
        ])
    );
    let usage = &v["usage"];
    let generated = h.tokenizer.encode(GLM_CALL_REPLY, false).unwrap().len() as u64 + 1; // and EOS
    assert_eq!(usage["output_tokens"], generated);
    let reasoning = h
        .tokenizer
        .encode("The user wants the weather.", false)
        .unwrap()
        .len();
    assert_eq!(
        usage["output_tokens_details"]["reasoning_tokens"],
        reasoning as u64
    );
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + generated
    );
}

#[tokio::test]
async fn responses_stream_events_build_the_same_output() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let body = json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}],
                      "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]});
    let whole = h.post("/v1/responses", body.clone()).await.json();
    let mut stream = body;
    stream["stream"] = json!(true);
    let events = response_events(&h.post("/v1/responses", stream).await);
    // Consecutive deltas of one kind are squeezed into one name.
    let mut names: Vec<&str> = Vec::new();
    for (name, _) in &events {
        if !(name.ends_with(".delta") && names.last() == Some(&name.as_str())) {
            names.push(name);
        }
    }
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    // Deltas add up to the items' texts; every event names its item's output index.
    let text = |kind: &str| -> String {
        events
            .iter()
            .filter(|(n, _)| n == kind)
            .map(|(_, v)| v["delta"].as_str().unwrap())
            .collect()
    };
    assert_eq!(
        text("response.reasoning_text.delta"),
        "The user wants the weather."
    );
    assert_eq!(text("response.output_text.delta"), "Let me check.");
    assert_eq!(
        text("response.function_call_arguments.delta"),
        "{\"city\":\"Paris\",\"days\":2}"
    );
    let done: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "response.output_item.done")
        .map(|(_, v)| v)
        .collect();
    for (i, d) in done.iter().enumerate() {
        assert_eq!(d["output_index"], i as u64);
    }
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["status"], "completed");
    assert_eq!(without_ids(&last["output"]), without_ids(&whole["output"]));
    let done_items: Vec<Value> = done.iter().map(|d| d["item"].clone()).collect();
    assert_eq!(Value::Array(done_items), last["output"]);
    assert_eq!(last["usage"], whole["usage"]);
}

#[tokio::test]
async fn responses_tool_round_trip_renders_like_chat() {
    let h = glm_harness();
    h.engine
        .set_reply(Reply::Text("Done.</think>It is sunny.".into()));
    let input = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    ]);
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
                       {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]);
    let v = h
        .post("/v1/responses", json!({"input": input, "tools": tools}))
        .await
        .json();
    assert_eq!(
        rendered_prompt(&h),
        "[gMASK]<sop><|system|>\n# Tools\nget_weather\nget_time\n<|user|>Weather in Paris?<|assistant|><think>Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|observation|><tool_response>sunny</tool_response><|assistant|><think>"
    );
    let output = without_ids(&v["output"]);
    assert_eq!(output[0]["content"][0]["text"], "Done.");
    assert_eq!(output[1]["content"][0]["text"], "It is sunny.");
}

#[tokio::test]
async fn responses_cut_at_max_output_tokens_are_incomplete() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(
        "Thinking for a long while.</think>Answer.".into(),
    ));
    let body = json!({"input": "hi", "max_output_tokens": 3});
    let v = h.post("/v1/responses", body.clone()).await.json();
    assert_eq!(v["status"], "incomplete");
    assert_eq!(
        v["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(v["max_output_tokens"], 3);
    assert_eq!(v["usage"]["output_tokens"], 3);
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{v}");
    assert_eq!(
        (&output[0]["type"], &output[0]["status"]),
        (&json!("reasoning"), &json!("incomplete"))
    );
    let mut stream = body;
    stream["stream"] = json!(true);
    let events = response_events(&h.post("/v1/responses", stream).await);
    let (name, last) = events.last().unwrap();
    assert_eq!(name, "response.incomplete");
    assert_eq!(
        last["response"]["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
}

#[tokio::test]
async fn responses_structured_output_and_sampling_reach_the_engine() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text("x</think>{}".into()));
    let body = json!({"input": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": 7,
                      "text": {"format": {"type": "json_schema", "name": "obj", "schema": {"type": "object"}}}});
    let v = h.post("/v1/responses", body).await.json();
    assert_eq!((&v["temperature"], &v["top_p"]), (&json!(0.5), &json!(0.9)));
    assert_eq!(v["text"]["format"]["type"], "json_schema");
    let submitted = h.engine.submitted.lock().last().unwrap().clone();
    assert!(submitted.constraint.is_some());
    assert_eq!(submitted.sampling.top_k, 7);
}

#[tokio::test]
async fn responses_reasoning_effort_none_turns_thinking_off() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text("Plain answer.".into()));
    let v = h
        .post(
            "/v1/responses",
            json!({"input": "hi", "reasoning": {"effort": "none"}}),
        )
        .await
        .json();
    assert!(rendered_prompt(&h).ends_with("<|assistant|></think>"));
    assert_eq!(v["output"][0]["content"][0]["text"], "Plain answer.");
    assert_eq!(v["reasoning"]["effort"], "none");
    h.post(
        "/v1/responses",
        json!({"input": "hi", "reasoning": {"effort": "high"}}),
    )
    .await;
    assert!(rendered_prompt(&h).ends_with("<|assistant|><think>"));
}

#[tokio::test]
async fn responses_refuse_what_they_cannot_do() {
    let h = glm_harness();
    let cases = [
        (
            json!({"input": "x", "previous_response_id": "resp_1"}),
            "stores no responses",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
            "stores none",
        ),
        (json!({"input": "x", "background": true}), "Background"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}),
            "reads text",
        ),
        (json!({"input": "x", "n": 2}), "`n` must be 1"),
        (
            json!({"input": "x", "response_format": {"type": "json_object"}}),
            "text.format",
        ),
        (
            json!({"input": "x", "include": ["message.output_text.logprobs"]}),
            "not supported",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "function tools",
        ),
        (json!({"input": "x", "truncation": "auto"}), "disabled"),
        (json!({"input": "x", "max_output_tokens": 0}), "at least 1"),
        (
            json!({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [{"type": "function", "name": "f"}]}),
            "not in `tools`",
        ),
        (json!({"model": "other", "input": "x"}), "other"),
        (json!({}), "`input` is required"),
    ];
    for (body, fragment) in cases {
        let r = h.post("/v1/responses", body.clone()).await;
        let status = if fragment == "other" {
            StatusCode::NOT_FOUND
        } else {
            StatusCode::BAD_REQUEST
        };
        assert_error(&r, status, fragment);
    }
    assert!(
        h.engine.submitted.lock().is_empty(),
        "nothing refused reaches the engine"
    );
}

// ---------------------------------------------------------------- anthropic messages

fn anthropic_tools() -> Value {
    json!([{"name": "get_weather", "description": "Weather by city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                             "required": ["city"]}},
           {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}])
}

fn assert_tool_use_id(block: &Value) -> Value {
    let id = block["id"].as_str().unwrap();
    assert!(id.starts_with("toolu_") && id.len() == 30, "{id}");
    let mut block = block.clone();
    block["id"] = json!("toolu_x");
    block
}

#[tokio::test]
async fn messages_thinking_text_and_tool_use_blocks() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let body = json!({"max_tokens": 200, "tools": anthropic_tools(),
                      "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let r = h.post("/v1/messages", body).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let v = r.json();
    let prompt = rendered_prompt(&h);
    let chat = json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": weather_tools()});
    h.post("/v1/chat/completions", chat).await;
    assert_eq!(
        prompt,
        rendered_prompt(&h),
        "rendered as chat completions renders it"
    );
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        (&v["type"], &v["role"], &v["stop_reason"]),
        (&json!("message"), &json!("assistant"), &json!("tool_use"))
    );
    assert_eq!(v["stop_sequence"], Value::Null);
    let content = v["content"].as_array().unwrap();
    assert_eq!(
        content[0],
        json!({"type": "thinking", "thinking": "The user wants the weather.", "signature": ""})
    );
    assert_eq!(content[1], json!({"type": "text", "text": "Let me check."}));
    assert_eq!(
        assert_tool_use_id(&content[2]),
        json!({"type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {"city": "Paris", "days": 2}})
    );
    let generated = h.tokenizer.encode(GLM_CALL_REPLY, false).unwrap().len() as u64 + 1; // and EOS
    assert_eq!(v["usage"]["output_tokens"], generated);
    // Prompt tokens split into those read from the prefix cache and the rest.
    let prompt = h.engine.submitted.lock()[0].prompt_ids.len() as u64;
    let usage = &v["usage"];
    let (fresh, cached) = (
        usage["input_tokens"].as_u64().unwrap(),
        usage["cache_read_input_tokens"].as_u64().unwrap(),
    );
    assert_eq!(fresh + cached, prompt);
}

#[tokio::test]
async fn messages_stream_blocks_as_anthropic_streams_them() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text(GLM_CALL_REPLY.into()));
    let body = json!({"max_tokens": 200, "tools": anthropic_tools(), "stream": true,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]});
    let events = named_events(&h.post("/v1/messages", body).await);
    let mut names: Vec<String> = Vec::new();
    for (name, v) in &events {
        let name = match name.as_str() {
            "content_block_start" => {
                format!("start {}", v["content_block"]["type"].as_str().unwrap())
            }
            "content_block_delta" => v["delta"]["type"].as_str().unwrap().to_owned(),
            other => other.to_owned(),
        };
        if !(name.ends_with("_delta") && names.last() == Some(&name)) {
            names.push(name);
        }
    }
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "start thinking",
            "thinking_delta",
            "content_block_stop",
            "start text",
            "text_delta",
            "content_block_stop",
            "start tool_use",
            "input_json_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let start = &events[0].1["message"];
    assert_eq!(
        (&start["content"], &start["stop_reason"]),
        (&json!([]), &Value::Null)
    );
    let collect = |kind: &str, field: &str| -> String {
        events
            .iter()
            .filter(|(_, v)| v["delta"]["type"] == kind)
            .map(|(_, v)| v["delta"][field].as_str().unwrap())
            .collect()
    };
    assert_eq!(
        collect("thinking_delta", "thinking"),
        "The user wants the weather."
    );
    assert_eq!(collect("text_delta", "text"), "Let me check.");
    let input: Value = serde_json::from_str(&collect("input_json_delta", "partial_json")).unwrap();
    assert_eq!(input, json!({"city": "Paris", "days": 2}));
    // Blocks are numbered 0, 1, 2 by their start, deltas and stop.
    for (name, v) in &events {
        if name.starts_with("content_block") {
            assert!(v["index"].as_u64().unwrap() <= 2);
        }
    }
    let delta = &events[events.len() - 2].1;
    assert_eq!(
        delta["delta"],
        json!({"stop_reason": "tool_use", "stop_sequence": null})
    );
    let generated = h.tokenizer.encode(GLM_CALL_REPLY, false).unwrap().len() as u64 + 1;
    assert_eq!(delta["usage"]["output_tokens"], generated);
}

#[tokio::test]
async fn messages_tool_round_trip_renders_like_chat() {
    let h = glm_harness();
    h.engine
        .set_reply(Reply::Text("Done.</think>It is sunny.".into()));
    let body = json!({"max_tokens": 50, "tools": anthropic_tools(), "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": "s"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}
    ]});
    let v = h.post("/v1/messages", body).await.json();
    assert_eq!(
        rendered_prompt(&h),
        "[gMASK]<sop><|system|>\n# Tools\nget_weather\nget_time\n<|user|>Weather in Paris?<|assistant|><think>Need the tool.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><|observation|><tool_response>sunny</tool_response><|assistant|><think>"
    );
    assert_eq!(
        v["content"][1],
        json!({"type": "text", "text": "It is sunny."})
    );
    assert_eq!(v["stop_reason"], "end_turn");
}

#[tokio::test]
async fn messages_stop_sequences_and_max_tokens() {
    let h = glm_harness();
    h.engine
        .set_reply(Reply::Text("x</think>hello END world".into()));
    let body = json!({"max_tokens": 50, "stop_sequences": ["END"], "messages": [{"role": "user", "content": "hi"}],
                      "thinking": {"type": "disabled"}});
    let v = h.post("/v1/messages", body.clone()).await.json();
    assert!(
        rendered_prompt(&h).ends_with("<|assistant|></think>"),
        "thinking disabled"
    );
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "x</think>hello "}])
    );
    assert_eq!(
        (&v["stop_reason"], &v["stop_sequence"]),
        (&json!("stop_sequence"), &json!("END"))
    );
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let events = named_events(&h.post("/v1/messages", stream).await);
    let delta = &events[events.len() - 2].1["delta"];
    assert_eq!(
        *delta,
        json!({"stop_reason": "stop_sequence", "stop_sequence": "END"})
    );
    let mut short = body;
    short["max_tokens"] = json!(2);
    short["stop_sequences"] = json!([]);
    let v = h.post("/v1/messages", short).await.json();
    assert_eq!(
        (&v["stop_reason"], &v["usage"]["output_tokens"]),
        (&json!("max_tokens"), &json!(2))
    );
}

#[tokio::test]
async fn messages_errors_take_anthropics_shape() {
    let h = glm_harness();
    let user = json!([{"role": "user", "content": "x"}]);
    let cases = [
        (
            json!({"messages": user}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "image",
        ),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "prefill",
        ),
        (
            json!({"max_tokens": 5, "messages": user, "tools": [{"type": "bash_20250124", "name": "bash"}]}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "custom tools",
        ),
        (
            json!({"max_tokens": 5, "messages": user, "model": "claude-x"}),
            StatusCode::NOT_FOUND,
            "not_found_error",
            "claude-x",
        ),
        (
            json!({"max_tokens": 0, "messages": user}),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "max_tokens",
        ),
    ];
    for (body, status, kind, fragment) in cases {
        let r = h.post("/v1/messages", body.clone()).await;
        assert_eq!(r.status, status, "{body}: {}", r.body);
        let v = r.json();
        assert_eq!(
            (&v["type"], &v["error"]["type"]),
            (&json!("error"), &json!(kind)),
            "{v}"
        );
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(fragment),
            "{message:?} does not mention {fragment:?}"
        );
    }
    assert!(h.engine.submitted.lock().is_empty());
}

#[tokio::test]
async fn messages_count_tokens_counts_the_prompt_a_request_renders() {
    let h = glm_harness();
    h.engine.set_reply(Reply::Text("Hi.".into()));
    let request = json!({"max_tokens": 5, "tools": anthropic_tools(), "system": "Be brief.",
                         "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    h.post("/v1/messages", request.clone()).await;
    let prompt = h.engine.submitted.lock()[0].prompt_ids.len() as u64;
    let r = h.post("/v1/messages/count_tokens", request.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.json(), json!({"input_tokens": prompt}));
    // A named tool_choice renders only that tool: a shorter prompt.
    let mut named = request;
    named["tool_choice"] = json!({"type": "tool", "name": "get_time"});
    let n = h.post("/v1/messages/count_tokens", named).await.json()["input_tokens"]
        .as_u64()
        .unwrap();
    assert!(n < prompt, "{n} >= {prompt}");
    let r = h
        .post("/v1/messages/count_tokens", json!({"messages": []}))
        .await;
    assert_eq!(
        (r.status, &r.json()["error"]["type"]),
        (StatusCode::BAD_REQUEST, &json!("invalid_request_error"))
    );
    assert_eq!(
        h.engine.submitted.lock().len(),
        1,
        "counting generates nothing"
    );
}

#[tokio::test]
async fn messages_take_the_api_key_as_x_api_key() {
    let h = harness_with(|c| c.api_key = Some("sesame".into()));
    let body = || {
        Body::from(
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}).to_string(),
        )
    };
    let send = |key: Option<&'static str>| {
        let mut request =
            Request::post("/v1/messages").header(header::CONTENT_TYPE, "application/json");
        if let Some(key) = key {
            request = request.header("x-api-key", key);
        }
        h.send(request.body(body()).unwrap())
    };
    assert_eq!(send(None).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(send(Some("sesame!")).await.status, StatusCode::UNAUTHORIZED);
    let r = send(Some("sesame")).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
}

// ---------------------------------------------------------------- model directory

#[test]
fn model_dir_files_and_precedence() {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), "from tokenizer_config");
    std::fs::write(
        dir.path().join("config.json"),
        json!({"eos_token_id": 3}).to_string(),
    )
    .unwrap();
    let bundle = TokenizerBundle::from_model_dir(dir.path()).unwrap();
    assert_eq!(bundle.eos_token_ids(), &[3, EOS]);
    assert_eq!(bundle.vocab_size(), 267 + MARKUP.len());
    let render = |b: &TokenizerBundle| {
        b.chat_template()
            .unwrap()
            .render(&[], None, true, &Default::default())
            .unwrap()
    };
    assert_eq!(render(&bundle), "from tokenizer_config");
    std::fs::write(dir.path().join("chat_template.jinja"), "from jinja file").unwrap();
    assert_eq!(
        render(&TokenizerBundle::from_model_dir(dir.path()).unwrap()),
        "from jinja file"
    );
    assert!(TokenizerBundle::from_model_dir(&dir.path().join("missing")).is_err());
}

#[test]
fn incremental_detokenizer_matches_full_decode() {
    let tok = tokenizer();
    let text = "hello world, héllo 日本語 😀 done";
    let ids = tok.encode(text, false).unwrap();
    let prompt = tok.encode("start", true).unwrap();
    let mut d = nsaserve_router::tokenizer::IncrementalDetokenizer::new(&prompt);
    let mut out = String::new();
    for &id in &ids {
        let piece = d.push(&tok, id);
        assert!(!piece.contains('\u{FFFD}'));
        out.push_str(&piece);
    }
    out.push_str(&d.flush(&tok));
    assert_eq!(out, text);
}

// ---------------------------------------------------------------- over TCP

/// One HTTP/1.1 exchange on a fresh connection; returns the raw response.
async fn raw_http(addr: std::net::SocketAddr, request: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    String::from_utf8(response).unwrap()
}

#[tokio::test]
async fn serves_over_tcp_and_shuts_down() {
    let tokenizer = tokenizer();
    let engine = ScriptedEngine::new(Arc::clone(&tokenizer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(serve_listener(
        listener,
        HttpConfig::new("tiny"),
        engine,
        tokenizer,
        Arc::new(Metrics::new()),
        async move {
            let _ = stop_rx.await;
        },
    ));
    let body = json!({"prompt": "x", "stream": true}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let response = raw_http(addr, &request).await;
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
    assert!(
        response.contains("content-type: text/event-stream"),
        "{response}"
    );
    assert!(response.contains("data: [DONE]"), "{response}");
    let health = raw_http(
        addr,
        "GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(health.starts_with("HTTP/1.1 200 OK\r\n"), "{health}");
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Streaming decode equals the full decode for any text, and no piece ends mid-character.
    #[test]
    fn incremental_detokenizer_property(text in "[a-z hé日😀,]{0,30}", prompt in "[a-z é]{0,8}") {
        let tok = shared_tokenizer();
        let ids = tok.encode(&text, false).unwrap();
        let prompt_ids = tok.encode(&prompt, true).unwrap();
        let mut d = nsaserve_router::tokenizer::IncrementalDetokenizer::new(&prompt_ids);
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(&tok, id);
            proptest::prop_assert!(!piece.contains(char::REPLACEMENT_CHARACTER), "broken piece {:?}", piece);
            out.push_str(&piece);
        }
        out.push_str(&d.flush(&tok));
        proptest::prop_assert_eq!(out, text);
    }
}

fn shared_tokenizer() -> Arc<TokenizerBundle> {
    static SHARED: std::sync::OnceLock<Arc<TokenizerBundle>> = std::sync::OnceLock::new();
    Arc::clone(SHARED.get_or_init(tokenizer))
}
