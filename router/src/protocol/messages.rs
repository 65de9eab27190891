//! Control and result messages. Router -> worker: plans (see `plan.rs`), late masks (rank 0
//! only) and shutdown. Worker -> router: hello, heartbeat, fatal, and (rank 0 only) one step
//! result per plan.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::arrays::LeArray;
use super::plan::PlanError;

/// Sent once by every rank when its model and KV pool are ready.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub rank: u32,
    pub tp_size: u32,
    pub pid: u32,
    /// The model's name as the worker loaded it (its directory name, or "embedded").
    pub model_id: String,
    pub num_pages: u32,
    pub page_size: u32,
    /// Longest sequence (prompt + output) the model supports.
    pub max_context: u32,
    pub vocab_size: u32,
    pub version: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub rank: u32,
    /// The last step this rank finished.
    pub step: u64,
}

/// A rank that cannot go on (startup failure or crash) says why, in one line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fatal {
    pub rank: u32,
    pub message: String,
}

/// Logprobs of one sampled token: its own and the `top_logprobs` most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(i32, f32)>,
}

/// Logprobs of the prompt tokens a step ran, for `echo` with `logprobs`.
/// `first_pos` is the position of the first entry's token; the first prompt token has none.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobs {
    pub req_id: u64,
    pub first_pos: i32,
    pub tokens: Vec<i32>,
    pub entries: Vec<TokenLogprobs>,
}

/// Rank 0's answer to one plan.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepResult {
    pub step: u64,
    /// `(request id, sampled token, logprobs if asked)` for every request with `sample` set
    /// that did not fail.
    pub sampled: Vec<(u64, i32, Option<TokenLogprobs>)>,
    pub prompt_logprobs: Vec<PromptLogprobs>,
    /// Requests this step failed, with the reason. Other requests of the step are unaffected.
    pub errors: Vec<(u64, String)>,
    pub forward_ms: f64,
}

/// Everything a worker may send.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerMessage {
    Hello(Hello),
    Heartbeat(Heartbeat),
    Fatal(Fatal),
    Result(StepResult),
}

/// The allowed-token masks of a step's `mask_late` rows, sent to rank 0 once the step before
/// it is committed (the grammar has then seen the token each request sampled there). A late
/// row it leaves out samples unmasked: its request ended meanwhile, or its grammar has not
/// started (the model is still thinking).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LateMasks {
    pub step: u64,
    /// `(request id, mask words)`, bit `t % 32` of word `t / 32` allowing token `t`.
    pub masks: Vec<(u64, Vec<u32>)>,
}

/// Everything the router sends besides plans.
#[derive(Debug, Clone, PartialEq)]
pub enum RouterMessage {
    Masks(LateMasks),
    Shutdown,
}

/// Wire form of late masks; see docs/protocol.md.
#[derive(Debug, Serialize, Deserialize)]
struct WireMasks {
    kind: String,
    step: u64,
    req_ids: ByteBuf,
    mask_start: ByteBuf,
    mask_words: ByteBuf,
}

impl WireMasks {
    fn from_masks(m: &LateMasks) -> WireMasks {
        let mut start = Vec::with_capacity(m.masks.len() + 1);
        start.push(0i32);
        let mut words = Vec::new();
        for (_, w) in &m.masks {
            words.extend_from_slice(w);
            start.push(words.len() as i32);
        }
        WireMasks {
            kind: "masks".into(),
            step: m.step,
            req_ids: u64::to_bin(&m.masks.iter().map(|(id, _)| *id).collect::<Vec<_>>()),
            mask_start: i32::to_bin(&start),
            mask_words: u32::to_bin(&words),
        }
    }

    fn into_masks(self) -> Result<LateMasks, PlanError> {
        let ids = u64::from_bin("req_ids", &self.req_ids)?;
        let start = i32::from_bin("mask_start", &self.mask_start)?;
        let words = u32::from_bin("mask_words", &self.mask_words)?;
        if start.len() != ids.len() + 1
            || start[0] != 0
            || start[ids.len()] as usize != words.len()
            || start.windows(2).any(|p| p[0] > p[1])
        {
            return Err(PlanError::Invalid(format!(
                "masks: mask_start is not offsets 0..{} over {} requests",
                words.len(),
                ids.len()
            )));
        }
        let masks = ids
            .iter()
            .enumerate()
            .map(|(k, &id)| (id, words[start[k] as usize..start[k + 1] as usize].to_vec()))
            .collect();
        Ok(LateMasks {
            step: self.step,
            masks,
        })
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Kind {
    kind: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum WireControl {
    Hello(Hello),
    Heartbeat(Heartbeat),
    Fatal(Fatal),
    Shutdown {},
}

/// Wire form of a step result. Arrays are little-endian `bin`s; see docs/protocol.md.
#[derive(Debug, Serialize, Deserialize)]
struct WireResult {
    kind: String,
    step: u64,
    req_ids: ByteBuf,
    tokens: ByteBuf,
    /// Per sampled token: its logprob, NaN when logprobs were not asked for.
    logprobs: ByteBuf,
    top_start: ByteBuf,
    top_ids: ByteBuf,
    top_logprobs: ByteBuf,
    prompt_req_ids: ByteBuf,
    prompt_first_pos: ByteBuf,
    prompt_start: ByteBuf,
    prompt_tokens: ByteBuf,
    prompt_logprobs: ByteBuf,
    prompt_top_start: ByteBuf,
    prompt_top_ids: ByteBuf,
    prompt_top_logprobs: ByteBuf,
    errors: Vec<(u64, String)>,
    forward_ms: f64,
}

fn check_offsets(name: &'static str, off: &[i32], n: usize, total: usize) -> Result<(), PlanError> {
    if off.len() != n + 1
        || off[0] != 0
        || off[n] as usize != total
        || off.windows(2).any(|w| w[0] > w[1])
    {
        return Err(PlanError::Invalid(format!(
            "{name} is not monotonic offsets 0..{total} over {n} entries"
        )));
    }
    Ok(())
}

/// Splits flat top-k arrays into per-entry lists using `start` offsets.
fn split_top(start: &[i32], ids: &[i32], lps: &[f32]) -> Vec<Vec<(i32, f32)>> {
    start
        .windows(2)
        .map(|w| {
            (w[0] as usize..w[1] as usize)
                .map(|k| (ids[k], lps[k]))
                .collect()
        })
        .collect()
}

impl WireResult {
    fn into_result(self) -> Result<StepResult, PlanError> {
        let ids = u64::from_bin("req_ids", &self.req_ids)?;
        let tokens = i32::from_bin("tokens", &self.tokens)?;
        let lps = f32::from_bin("logprobs", &self.logprobs)?;
        let top_start = i32::from_bin("top_start", &self.top_start)?;
        let top_ids = i32::from_bin("top_ids", &self.top_ids)?;
        let top_lps = f32::from_bin("top_logprobs", &self.top_logprobs)?;
        let m = ids.len();
        if tokens.len() != m || lps.len() != m || top_ids.len() != top_lps.len() {
            return Err(PlanError::Invalid(
                "result arrays disagree in length".into(),
            ));
        }
        check_offsets("top_start", &top_start, m, top_ids.len())?;
        let tops = split_top(&top_start, &top_ids, &top_lps);
        let sampled = ids
            .into_iter()
            .zip(tokens)
            .zip(lps.into_iter().zip(tops))
            .map(|((id, tok), (lp, top))| {
                (
                    id,
                    tok,
                    (!lp.is_nan()).then_some(TokenLogprobs { logprob: lp, top }),
                )
            })
            .collect();

        let p_ids = u64::from_bin("prompt_req_ids", &self.prompt_req_ids)?;
        let p_first = i32::from_bin("prompt_first_pos", &self.prompt_first_pos)?;
        let p_start = i32::from_bin("prompt_start", &self.prompt_start)?;
        let p_tokens = i32::from_bin("prompt_tokens", &self.prompt_tokens)?;
        let p_lps = f32::from_bin("prompt_logprobs", &self.prompt_logprobs)?;
        let p_top_start = i32::from_bin("prompt_top_start", &self.prompt_top_start)?;
        let p_top_ids = i32::from_bin("prompt_top_ids", &self.prompt_top_ids)?;
        let p_top_lps = f32::from_bin("prompt_top_logprobs", &self.prompt_top_logprobs)?;
        let q = p_ids.len();
        if p_first.len() != q || p_tokens.len() != p_lps.len() || p_top_ids.len() != p_top_lps.len()
        {
            return Err(PlanError::Invalid(
                "prompt logprob arrays disagree in length".into(),
            ));
        }
        check_offsets("prompt_start", &p_start, q, p_tokens.len())?;
        check_offsets(
            "prompt_top_start",
            &p_top_start,
            p_tokens.len(),
            p_top_ids.len(),
        )?;
        let p_tops = split_top(&p_top_start, &p_top_ids, &p_top_lps);
        let prompt_logprobs = (0..q)
            .map(|i| {
                let r = p_start[i] as usize..p_start[i + 1] as usize;
                PromptLogprobs {
                    req_id: p_ids[i],
                    first_pos: p_first[i],
                    tokens: p_tokens[r.clone()].to_vec(),
                    entries: r
                        .map(|k| TokenLogprobs {
                            logprob: p_lps[k],
                            top: p_tops[k].clone(),
                        })
                        .collect(),
                }
            })
            .collect();
        Ok(StepResult {
            step: self.step,
            sampled,
            prompt_logprobs,
            errors: self.errors,
            forward_ms: self.forward_ms,
        })
    }

    fn from_result(r: &StepResult) -> Self {
        let flat_top = |tops: Vec<&Vec<(i32, f32)>>| {
            let mut start = vec![0i32];
            let (mut ids, mut lps) = (vec![], vec![]);
            for t in tops {
                for &(i, l) in t {
                    ids.push(i);
                    lps.push(l);
                }
                start.push(ids.len() as i32);
            }
            (i32::to_bin(&start), i32::to_bin(&ids), f32::to_bin(&lps))
        };
        let empty = Vec::new();
        let (top_start, top_ids, top_logprobs) = flat_top(
            r.sampled
                .iter()
                .map(|s| s.2.as_ref().map_or(&empty, |t| &t.top))
                .collect(),
        );
        let entries: Vec<&TokenLogprobs> = r
            .prompt_logprobs
            .iter()
            .flat_map(|p| p.entries.iter())
            .collect();
        let (prompt_top_start, prompt_top_ids, prompt_top_logprobs) =
            flat_top(entries.iter().map(|e| &e.top).collect());
        let mut p_start = vec![0i32];
        for p in &r.prompt_logprobs {
            p_start.push(p_start.last().unwrap() + p.tokens.len() as i32);
        }
        WireResult {
            kind: "result".into(),
            step: r.step,
            req_ids: u64::to_bin(&r.sampled.iter().map(|s| s.0).collect::<Vec<_>>()),
            tokens: i32::to_bin(&r.sampled.iter().map(|s| s.1).collect::<Vec<_>>()),
            logprobs: f32::to_bin(
                &r.sampled
                    .iter()
                    .map(|s| s.2.as_ref().map_or(f32::NAN, |t| t.logprob))
                    .collect::<Vec<_>>(),
            ),
            top_start,
            top_ids,
            top_logprobs,
            prompt_req_ids: u64::to_bin(
                &r.prompt_logprobs
                    .iter()
                    .map(|p| p.req_id)
                    .collect::<Vec<_>>(),
            ),
            prompt_first_pos: i32::to_bin(
                &r.prompt_logprobs
                    .iter()
                    .map(|p| p.first_pos)
                    .collect::<Vec<_>>(),
            ),
            prompt_start: i32::to_bin(&p_start),
            prompt_tokens: i32::to_bin(
                &r.prompt_logprobs
                    .iter()
                    .flat_map(|p| p.tokens.iter().copied())
                    .collect::<Vec<_>>(),
            ),
            prompt_logprobs: f32::to_bin(&entries.iter().map(|e| e.logprob).collect::<Vec<_>>()),
            prompt_top_start,
            prompt_top_ids,
            prompt_top_logprobs,
            errors: r.errors.clone(),
            forward_ms: r.forward_ms,
        }
    }
}

/// Decodes any worker -> router message by its `kind` key.
pub fn decode_worker_message(bytes: &[u8]) -> Result<WorkerMessage, PlanError> {
    let kind: Kind = rmp_serde::from_slice(bytes)?;
    Ok(match kind.kind.as_str() {
        "result" => {
            WorkerMessage::Result(rmp_serde::from_slice::<WireResult>(bytes)?.into_result()?)
        }
        _ => match rmp_serde::from_slice::<WireControl>(bytes)? {
            WireControl::Hello(h) => WorkerMessage::Hello(h),
            WireControl::Heartbeat(h) => WorkerMessage::Heartbeat(h),
            WireControl::Fatal(f) => WorkerMessage::Fatal(f),
            WireControl::Shutdown {} => {
                return Err(PlanError::Invalid(
                    "a worker sent a router-only message (shutdown)".into(),
                ))
            }
        },
    })
}

/// Encodes a worker message; the router uses this only in tests and the null-executor bench.
pub fn encode_worker_message(msg: &WorkerMessage) -> Result<Vec<u8>, PlanError> {
    Ok(match msg {
        WorkerMessage::Hello(h) => rmp_serde::to_vec_named(&WireControl::Hello(h.clone()))?,
        WorkerMessage::Heartbeat(h) => rmp_serde::to_vec_named(&WireControl::Heartbeat(h.clone()))?,
        WorkerMessage::Fatal(f) => rmp_serde::to_vec_named(&WireControl::Fatal(f.clone()))?,
        WorkerMessage::Result(r) => rmp_serde::to_vec_named(&WireResult::from_result(r))?,
    })
}

pub fn encode_router_message(msg: &RouterMessage) -> Result<Vec<u8>, PlanError> {
    Ok(match msg {
        RouterMessage::Masks(m) => rmp_serde::to_vec_named(&WireMasks::from_masks(m))?,
        RouterMessage::Shutdown => rmp_serde::to_vec_named(&WireControl::Shutdown {})?,
    })
}

/// Decodes a router message other than a plan (the golden vectors check the encoder with it).
pub fn decode_router_message(bytes: &[u8]) -> Result<RouterMessage, PlanError> {
    let kind: Kind = rmp_serde::from_slice(bytes)?;
    match kind.kind.as_str() {
        "masks" => Ok(RouterMessage::Masks(
            rmp_serde::from_slice::<WireMasks>(bytes)?.into_masks()?,
        )),
        "shutdown" => Ok(RouterMessage::Shutdown),
        other => Err(PlanError::Invalid(format!(
            "not a router message: kind {other:?}"
        ))),
    }
}
