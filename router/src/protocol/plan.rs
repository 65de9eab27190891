//! The batch plan: everything the workers need to run one step, built once by the scheduler.
//!
//! In memory a plan is a list of [`PlannedRequest`]s (easy to build and test). On the wire it is
//! one msgpack map of flat arrays (struct of arrays), every key present in every mode: a batch
//! with no cached prefix sends `cached_lens` full of zeros, never a missing field. That is the
//! lesson of the crash this project answers: metadata that exists on only some code paths.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::arrays::{ArrayError, LeArray};
use super::PROTOCOL_VERSION;

/// What kind of step this is. Data in the plan, never state kept on a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForwardMode {
    /// No request to run.
    Idle,
    /// Every request runs two or more tokens (a prompt or a prompt chunk).
    Prefill,
    /// Every request runs exactly one token.
    Decode,
    /// Both kinds in one step.
    Mixed,
}

impl ForwardMode {
    pub fn as_str(&self) -> &'static str {
        match self {
            ForwardMode::Idle => "idle",
            ForwardMode::Prefill => "prefill",
            ForwardMode::Decode => "decode",
            ForwardMode::Mixed => "mixed",
        }
    }
}

/// Sampling parameters of one request, as the worker's sampler reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 or negative means no top-k limit.
    pub top_k: i32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub seed: Option<u64>,
    /// `None`: no logprobs. `Some(n)`: the chosen token's logprob and the `n` most likely.
    pub top_logprobs: Option<u32>,
    /// (token id, bias) pairs added to the raw logits before the penalties (OpenAI's
    /// `logit_bias`); ids distinct and ascending.
    pub logit_bias: Vec<(i32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            top_logprobs: None,
            logit_bias: Vec::new(),
        }
    }
}

/// The bias that bans a token: finite (plans carry finite biases), and low enough that no
/// logit, temperature or penalty brings the token back (its probability is exactly 0).
pub const BAN_BIAS: f32 = -1.0e30;

impl SamplingParams {
    /// These parameters with `ids` banned (their bias BAN_BIAS, whatever the request's
    /// `logit_bias` said of them): `min_tokens`' stop tokens before the minimum.
    pub fn banning(&self, ids: &[i32]) -> SamplingParams {
        let mut bias: Vec<(i32, f32)> = self
            .logit_bias
            .iter()
            .copied()
            .filter(|(t, _)| !ids.contains(t))
            .chain(ids.iter().map(|&t| (t, BAN_BIAS)))
            .collect();
        bias.sort_unstable_by_key(|&(t, _)| t);
        bias.dedup_by_key(|&mut (t, _)| t);
        SamplingParams {
            logit_bias: bias,
            ..self.clone()
        }
    }

    /// True when the sampler needs the request's token history.
    pub fn needs_history(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }
}

/// The plan's bitmask for a set of token ids: bit `t % 32` of word `t / 32` allows token `t`.
pub fn token_mask(ids: &[i32]) -> Vec<u32> {
    let words = ids.iter().map(|&t| t as usize / 32 + 1).max().unwrap_or(0);
    let mut mask = vec![0u32; words];
    for &t in ids {
        mask[t as usize / 32] |= 1 << (t as usize % 32);
    }
    mask
}

/// One request's share of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedRequest {
    pub id: u64,
    /// Tokens run this step: a prompt chunk, or the one token generated last step. `[-1]`
    /// when that token is not known yet (see `input_prev_row`).
    pub input_ids: Vec<i32>,
    /// -1: `input_ids` are given. Otherwise the request runs one token, the one it samples in
    /// the previous step (`step - 1`), whose row in that plan this is; the workers fill it in
    /// (overlap: the router planned this step before that result came back).
    pub input_prev_row: i32,
    /// Tokens already in the KV cache (radix hit or earlier chunks). Positions of `input_ids`
    /// are `cached_len, cached_len + 1, ...`.
    pub cached_len: i32,
    /// The request's whole page list, covering `cached_len + input_ids.len()` tokens.
    pub pages: Vec<i32>,
    /// The KV slot (`page * page_size + offset`) each new token writes.
    pub out_slots: Vec<i32>,
    /// Whether this step produces a token for the request (false for non-final prompt chunks).
    pub sample: bool,
    /// Whether to return the logprobs of this step's prompt tokens (for `echo`).
    pub prompt_logprobs: bool,
    /// With `prompt_logprobs` on a non-final prompt chunk: the prompt token right after this
    /// chunk, so the chunk's last row can score it (the next chunk cannot: its logits come from
    /// this one). -1 otherwise.
    pub next_prompt_token: i32,
    pub sampling: SamplingParams,
    /// Penalty history, only when a penalty needs it (else empty): with `history_reset`, the
    /// request's prompt and generated tokens so far; without, only those after the tokens an
    /// earlier plan sent (the workers keep a request's history until `released`).
    pub history: Vec<i32>,
    /// How many of the request's whole history are prompt tokens (the rest are generated ones).
    pub history_prompt_len: i32,
    /// `history` replaces what the workers hold for the request instead of extending it.
    pub history_reset: bool,
    /// Structured output: the tokens the request may sample this step, as a bitmask (bit
    /// `t % 32` of word `t / 32` for token `t`; tokens past the last word are out). `None`:
    /// every token. Only on a sampling row. Shared: `allowed_token_ids`' mask is the same on
    /// every step, so a plan holds a reference to it instead of a copy.
    pub allowed_tokens: Option<Arc<Vec<u32>>>,
    /// Structured output under overlap: the row's mask depends on the token the request samples
    /// in the step still in flight, so it is not in this plan; a `masks` message brings it to
    /// rank 0 once that step's result is committed (or leaves the row out: then unmasked, as
    /// when the request ended meanwhile). Only on a sampling row without `allowed_tokens`.
    pub mask_late: bool,
}

impl PlannedRequest {
    pub fn seq_len(&self) -> i32 {
        self.cached_len + self.input_ids.len() as i32
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BatchPlan {
    pub step: u64,
    pub page_size: u32,
    pub requests: Vec<PlannedRequest>,
    /// Requests that left since the previous plan and had a penalty history on the workers,
    /// which may now drop it.
    pub released: Vec<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("plan encoding failed: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    #[error("plan decoding failed: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    #[error(transparent)]
    Array(#[from] ArrayError),
    #[error("plan is inconsistent: {0}")]
    Invalid(String),
}

/// Number of keys in a plan message (the fields of `WirePlan`).
const PLAN_KEYS: u32 = 41;

/// The wire form. Field order and names are the protocol; see docs/protocol.md.
#[derive(Debug, Serialize, Deserialize)]
struct WirePlan {
    kind: String,
    version: u32,
    step: u64,
    mode: ForwardMode,
    page_size: u32,
    num_reqs: u32,
    num_tokens: u32,
    num_pages: u32,
    req_ids: ByteBuf,
    query_start: ByteBuf,
    input_ids: ByteBuf,
    positions: ByteBuf,
    cached_lens: ByteBuf,
    page_start: ByteBuf,
    page_table: ByteBuf,
    out_slots: ByteBuf,
    sample: ByteBuf,
    prompt_logprobs: ByteBuf,
    next_prompt_token: ByteBuf,
    input_prev_row: ByteBuf,
    temperature: ByteBuf,
    top_p: ByteBuf,
    top_k: ByteBuf,
    min_p: ByteBuf,
    repetition_penalty: ByteBuf,
    frequency_penalty: ByteBuf,
    presence_penalty: ByteBuf,
    seed: ByteBuf,
    has_seed: ByteBuf,
    top_logprobs: ByteBuf,
    history_start: ByteBuf,
    history: ByteBuf,
    history_prompt_lens: ByteBuf,
    history_reset: ByteBuf,
    bias_start: ByteBuf,
    bias_token: ByteBuf,
    bias_value: ByteBuf,
    mask_start: ByteBuf,
    mask_words: ByteBuf,
    mask_late: ByteBuf,
    released: ByteBuf,
}

/// Writes msgpack directly (the subset a plan needs).
struct PlanWriter {
    buf: Vec<u8>,
    declared_keys: u32,
    written_keys: u32,
}

impl PlanWriter {
    fn with_capacity(n: usize) -> Self {
        Self {
            buf: Vec::with_capacity(n),
            declared_keys: 0,
            written_keys: 0,
        }
    }

    fn map_len(&mut self, len: u32) {
        self.declared_keys = len;
        rmp::encode::write_map_len(&mut self.buf, len).expect("writing to a Vec cannot fail");
    }

    fn key(&mut self, key: &str) {
        self.written_keys += 1;
        rmp::encode::write_str(&mut self.buf, key).expect("writing to a Vec cannot fail");
    }

    fn str_field(&mut self, key: &str, value: &str) {
        self.key(key);
        rmp::encode::write_str(&mut self.buf, value).expect("writing to a Vec cannot fail");
    }

    fn uint_field(&mut self, key: &str, value: u64) {
        self.key(key);
        rmp::encode::write_uint(&mut self.buf, value).expect("writing to a Vec cannot fail");
    }

    /// A `bin` of `count` little-endian elements.
    fn array<T: LeArray>(&mut self, key: &str, count: usize, values: impl Iterator<Item = T>) {
        self.key(key);
        self.bin_header(count * T::WIDTH);
        let start = self.buf.len();
        for v in values {
            v.put(&mut self.buf);
        }
        assert_eq!(
            self.buf.len() - start,
            count * T::WIDTH,
            "array `{key}` has a wrong count"
        );
    }

    /// `[0, a, a+b, ...]` of consecutive lengths, as an i32 `bin`.
    fn offsets(&mut self, key: &str, lengths: impl ExactSizeIterator<Item = usize>) {
        self.key(key);
        self.bin_header((lengths.len() + 1) * 4);
        let mut total = 0i32;
        total.put(&mut self.buf);
        for len in lengths {
            total += len as i32;
            total.put(&mut self.buf);
        }
    }

    fn bin_header(&mut self, bytes: usize) {
        rmp::encode::write_bin_len(&mut self.buf, bytes as u32)
            .expect("writing to a Vec cannot fail");
    }

    fn finish(self) -> Vec<u8> {
        assert_eq!(
            self.written_keys, self.declared_keys,
            "plan map length does not match its keys"
        );
        self.buf
    }
}

impl BatchPlan {
    /// Whether a previous step exists for `input_prev_row` to reference.
    fn step_has_prev(&self) -> bool {
        self.step >= 1
    }

    pub fn num_tokens(&self) -> usize {
        self.requests.iter().map(|r| r.input_ids.len()).sum()
    }

    /// The forward mode the requests' shapes imply: a request running one token is
    /// decode-shaped (whether it is a generated token or a one-token prompt tail), any other
    /// is prefill-shaped. The mode is always this function of the requests, never a choice.
    pub fn mode(&self) -> ForwardMode {
        let decodes = self
            .requests
            .iter()
            .filter(|r| r.input_ids.len() == 1)
            .count();
        match (self.requests.len(), decodes) {
            (0, _) => ForwardMode::Idle,
            (n, d) if d == n => ForwardMode::Decode,
            (_, 0) => ForwardMode::Prefill,
            _ => ForwardMode::Mixed,
        }
    }

    /// Encodes the plan straight into one buffer: keys in `WirePlan` order, each array's `bin`
    /// header followed by its little-endian elements. No intermediate vectors, because this
    /// runs every step for every running request (the golden vectors pin the same bytes that
    /// `rmp_serde` would produce from `WirePlan`).
    pub fn encode(&self) -> Result<Vec<u8>, PlanError> {
        let r = &self.requests;
        let n = r.len();
        let tokens = self.num_tokens();
        let pages: usize = r.iter().map(|q| q.pages.len()).sum();
        let history: usize = r.iter().map(|q| q.history.len()).sum();
        let mut w = PlanWriter::with_capacity(512 + 4 * (3 * tokens + pages + history) + 70 * n);
        w.map_len(PLAN_KEYS);
        w.str_field("kind", "plan");
        w.uint_field("version", PROTOCOL_VERSION as u64);
        w.uint_field("step", self.step);
        w.str_field("mode", self.mode().as_str());
        w.uint_field("page_size", self.page_size as u64);
        w.uint_field("num_reqs", n as u64);
        w.uint_field("num_tokens", tokens as u64);
        w.uint_field("num_pages", pages as u64);
        w.array("req_ids", n, r.iter().map(|q| q.id));
        w.offsets("query_start", r.iter().map(|q| q.input_ids.len()));
        w.array(
            "input_ids",
            tokens,
            r.iter().flat_map(|q| q.input_ids.iter().copied()),
        );
        w.array(
            "positions",
            tokens,
            r.iter()
                .flat_map(|q| (0..q.input_ids.len() as i32).map(move |i| q.cached_len + i)),
        );
        w.array("cached_lens", n, r.iter().map(|q| q.cached_len));
        w.offsets("page_start", r.iter().map(|q| q.pages.len()));
        w.array(
            "page_table",
            pages,
            r.iter().flat_map(|q| q.pages.iter().copied()),
        );
        w.array(
            "out_slots",
            tokens,
            r.iter().flat_map(|q| q.out_slots.iter().copied()),
        );
        w.array("sample", n, r.iter().map(|q| q.sample as u8));
        w.array(
            "prompt_logprobs",
            n,
            r.iter().map(|q| q.prompt_logprobs as u8),
        );
        w.array(
            "next_prompt_token",
            n,
            r.iter().map(|q| q.next_prompt_token),
        );
        w.array("input_prev_row", n, r.iter().map(|q| q.input_prev_row));
        w.array("temperature", n, r.iter().map(|q| q.sampling.temperature));
        w.array("top_p", n, r.iter().map(|q| q.sampling.top_p));
        w.array("top_k", n, r.iter().map(|q| q.sampling.top_k));
        w.array("min_p", n, r.iter().map(|q| q.sampling.min_p));
        w.array(
            "repetition_penalty",
            n,
            r.iter().map(|q| q.sampling.repetition_penalty),
        );
        w.array(
            "frequency_penalty",
            n,
            r.iter().map(|q| q.sampling.frequency_penalty),
        );
        w.array(
            "presence_penalty",
            n,
            r.iter().map(|q| q.sampling.presence_penalty),
        );
        w.array("seed", n, r.iter().map(|q| q.sampling.seed.unwrap_or(0)));
        w.array(
            "has_seed",
            n,
            r.iter().map(|q| q.sampling.seed.is_some() as u8),
        );
        w.array(
            "top_logprobs",
            n,
            r.iter()
                .map(|q| q.sampling.top_logprobs.map_or(-1, |k| k as i32)),
        );
        w.offsets("history_start", r.iter().map(|q| q.history.len()));
        w.array(
            "history",
            history,
            r.iter().flat_map(|q| q.history.iter().copied()),
        );
        w.array(
            "history_prompt_lens",
            n,
            r.iter().map(|q| q.history_prompt_len),
        );
        w.array("history_reset", n, r.iter().map(|q| q.history_reset as u8));
        let biases: usize = r.iter().map(|q| q.sampling.logit_bias.len()).sum();
        w.offsets("bias_start", r.iter().map(|q| q.sampling.logit_bias.len()));
        w.array(
            "bias_token",
            biases,
            r.iter()
                .flat_map(|q| q.sampling.logit_bias.iter().map(|&(t, _)| t)),
        );
        w.array(
            "bias_value",
            biases,
            r.iter()
                .flat_map(|q| q.sampling.logit_bias.iter().map(|&(_, b)| b)),
        );
        let mask_len = |q: &PlannedRequest| q.allowed_tokens.as_ref().map_or(0, |m| m.len());
        w.offsets("mask_start", r.iter().map(mask_len));
        w.array(
            "mask_words",
            r.iter().map(mask_len).sum(),
            r.iter()
                .flat_map(|q| q.allowed_tokens.iter().flat_map(|m| m.iter().copied())),
        );
        w.array("mask_late", n, r.iter().map(|q| q.mask_late as u8));
        w.array(
            "released",
            self.released.len(),
            self.released.iter().copied(),
        );
        Ok(w.finish())
    }

    /// Decodes and validates a plan. The router never needs this at run time; it exists so the
    /// golden vectors and fuzz tests can check the encoder against the documented rules.
    pub fn decode(bytes: &[u8]) -> Result<Self, PlanError> {
        let w: WirePlan = rmp_serde::from_slice(bytes)?;
        let bad = |m: String| Err(PlanError::Invalid(m));
        if w.kind != "plan" {
            return bad(format!("kind is {:?}, expected \"plan\"", w.kind));
        }
        if w.version != PROTOCOL_VERSION {
            return bad(format!(
                "protocol version {} (expected {PROTOCOL_VERSION})",
                w.version
            ));
        }
        let n = w.num_reqs as usize;
        let ids = u64::from_bin("req_ids", &w.req_ids)?;
        let qs = i32::from_bin("query_start", &w.query_start)?;
        let toks = i32::from_bin("input_ids", &w.input_ids)?;
        let pos = i32::from_bin("positions", &w.positions)?;
        let cached = i32::from_bin("cached_lens", &w.cached_lens)?;
        let ps = i32::from_bin("page_start", &w.page_start)?;
        let pt = i32::from_bin("page_table", &w.page_table)?;
        let slots = i32::from_bin("out_slots", &w.out_slots)?;
        let hs = i32::from_bin("history_start", &w.history_start)?;
        let hist = i32::from_bin("history", &w.history)?;
        let bs = i32::from_bin("bias_start", &w.bias_start)?;
        let bias_token = i32::from_bin("bias_token", &w.bias_token)?;
        let bias_value = f32::from_bin("bias_value", &w.bias_value)?;
        let ms = i32::from_bin("mask_start", &w.mask_start)?;
        let mask_words = u32::from_bin("mask_words", &w.mask_words)?;
        if bias_value.len() != bias_token.len() {
            return bad(format!(
                "bias_value has {} entries for {} bias_token",
                bias_value.len(),
                bias_token.len()
            ));
        }
        let per_req: [(&str, usize); 2] = [("req_ids", ids.len()), ("cached_lens", cached.len())];
        for (name, len) in per_req {
            if len != n {
                return bad(format!("{name} has {len} entries for {n} requests"));
            }
        }
        for (name, off, total) in [
            ("query_start", &qs, toks.len()),
            ("page_start", &ps, pt.len()),
            ("history_start", &hs, hist.len()),
            ("bias_start", &bs, bias_token.len()),
            ("mask_start", &ms, mask_words.len()),
        ] {
            if off.len() != n + 1
                || off[0] != 0
                || off[n] as usize != total
                || off.windows(2).any(|p| p[0] > p[1])
            {
                return bad(format!(
                    "{name} is not monotonic offsets 0..{total} over {n} requests"
                ));
            }
        }
        if toks.len() != w.num_tokens as usize
            || pos.len() != toks.len()
            || slots.len() != toks.len()
        {
            return bad("input_ids, positions, out_slots and num_tokens disagree".into());
        }
        let col = |name: &'static str, b: &ByteBuf| -> Result<Vec<f32>, PlanError> {
            let v = f32::from_bin(name, b)?;
            if v.len() != n {
                return Err(PlanError::Invalid(format!(
                    "{name} has {} entries for {n} requests",
                    v.len()
                )));
            }
            Ok(v)
        };
        let temperature = col("temperature", &w.temperature)?;
        let top_p = col("top_p", &w.top_p)?;
        let min_p = col("min_p", &w.min_p)?;
        let rep = col("repetition_penalty", &w.repetition_penalty)?;
        let freq = col("frequency_penalty", &w.frequency_penalty)?;
        let pres = col("presence_penalty", &w.presence_penalty)?;
        let top_k = i32::from_bin("top_k", &w.top_k)?;
        let seed = u64::from_bin("seed", &w.seed)?;
        let has_seed = u8::from_bin("has_seed", &w.has_seed)?;
        let tlp = i32::from_bin("top_logprobs", &w.top_logprobs)?;
        let sample = u8::from_bin("sample", &w.sample)?;
        let plp = u8::from_bin("prompt_logprobs", &w.prompt_logprobs)?;
        let npt = i32::from_bin("next_prompt_token", &w.next_prompt_token)?;
        let ipr = i32::from_bin("input_prev_row", &w.input_prev_row)?;
        let hpl = i32::from_bin("history_prompt_lens", &w.history_prompt_lens)?;
        let hreset = u8::from_bin("history_reset", &w.history_reset)?;
        let mask_late = u8::from_bin("mask_late", &w.mask_late)?;
        let released = u64::from_bin("released", &w.released)?;
        for (name, flags) in [("history_reset", &hreset), ("mask_late", &mask_late)] {
            if flags.iter().any(|&v| v > 1) {
                return bad(format!("{name} holds a value other than 0 and 1"));
            }
        }
        for (name, len) in [
            ("top_k", top_k.len()),
            ("seed", seed.len()),
            ("has_seed", has_seed.len()),
            ("top_logprobs", tlp.len()),
            ("sample", sample.len()),
            ("prompt_logprobs", plp.len()),
            ("next_prompt_token", npt.len()),
            ("input_prev_row", ipr.len()),
            ("history_prompt_lens", hpl.len()),
            ("history_reset", hreset.len()),
            ("mask_late", mask_late.len()),
        ] {
            if len != n {
                return bad(format!("{name} has {len} entries for {n} requests"));
            }
        }
        let mut requests = Vec::with_capacity(n);
        for i in 0..n {
            let (t0, t1) = (qs[i] as usize, qs[i + 1] as usize);
            if pos[t0..t1]
                .iter()
                .enumerate()
                .any(|(k, &p)| p != cached[i] + k as i32)
            {
                return bad(format!(
                    "request {}: positions do not follow cached_len",
                    ids[i]
                ));
            }
            requests.push(PlannedRequest {
                id: ids[i],
                input_ids: toks[t0..t1].to_vec(),
                input_prev_row: ipr[i],
                cached_len: cached[i],
                pages: pt[ps[i] as usize..ps[i + 1] as usize].to_vec(),
                out_slots: slots[t0..t1].to_vec(),
                sample: sample[i] != 0,
                prompt_logprobs: plp[i] != 0,
                next_prompt_token: npt[i],
                sampling: SamplingParams {
                    temperature: temperature[i],
                    top_p: top_p[i],
                    top_k: top_k[i],
                    min_p: min_p[i],
                    repetition_penalty: rep[i],
                    frequency_penalty: freq[i],
                    presence_penalty: pres[i],
                    seed: (has_seed[i] != 0).then_some(seed[i]),
                    top_logprobs: (tlp[i] >= 0).then_some(tlp[i] as u32),
                    logit_bias: (bs[i] as usize..bs[i + 1] as usize)
                        .map(|k| (bias_token[k], bias_value[k]))
                        .collect(),
                },
                history: hist[hs[i] as usize..hs[i + 1] as usize].to_vec(),
                history_prompt_len: hpl[i],
                history_reset: hreset[i] != 0,
                allowed_tokens: (ms[i] < ms[i + 1])
                    .then(|| Arc::new(mask_words[ms[i] as usize..ms[i + 1] as usize].to_vec())),
                mask_late: mask_late[i] != 0,
            });
        }
        let plan = BatchPlan {
            step: w.step,
            page_size: w.page_size,
            requests,
            released,
        };
        if w.mode != plan.mode() {
            return bad(format!(
                "mode {:?} contradicts the requests, which make it {:?}",
                w.mode,
                plan.mode()
            ));
        }
        plan.validate(None)?;
        Ok(plan)
    }

    /// The consistency rules every plan must satisfy (the worker checks the same ones).
    /// `num_pages`: the pool size, when known, to range-check page ids.
    pub fn validate(&self, num_pages: Option<u32>) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::Invalid(m));
        let ps = self.page_size as i32;
        if ps <= 0 {
            return bad("page_size must be positive".into());
        }
        let mut written = std::collections::HashSet::new();
        for r in &self.requests {
            let id = r.id;
            if r.cached_len < 0 {
                return bad(format!("request {id}: negative cached_len"));
            }
            if r.input_ids.is_empty() {
                return bad(format!("request {id}: no tokens to run"));
            }
            if r.out_slots.len() != r.input_ids.len() {
                return bad(format!(
                    "request {id}: {} out_slots for {} tokens",
                    r.out_slots.len(),
                    r.input_ids.len()
                ));
            }
            let need_pages = (r.seq_len() + ps - 1) / ps;
            if (r.pages.len() as i32) < need_pages {
                return bad(format!(
                    "request {id}: {} pages cannot hold {} tokens",
                    r.pages.len(),
                    r.seq_len()
                ));
            }
            if let Some(p) = r
                .pages
                .iter()
                .find(|&&p| p < 0 || num_pages.is_some_and(|n| p as u32 >= n))
            {
                return bad(format!("request {id}: page {p} outside the pool"));
            }
            for (k, &slot) in r.out_slots.iter().enumerate() {
                let pos = r.cached_len + k as i32;
                let expect = r.pages[(pos / ps) as usize] * ps + pos % ps;
                if slot != expect {
                    return bad(format!("request {id}: token {pos} writes slot {slot}, its page table says {expect}"));
                }
                if !written.insert(slot) {
                    return bad(format!(
                        "request {id}: slot {slot} written twice in one step"
                    ));
                }
            }
            if r.input_prev_row < -1
                || (r.input_prev_row >= 0 && (r.input_ids != [-1] || !self.step_has_prev()))
            {
                return bad(format!(
                    "request {id}: input_prev_row {} needs a previous step and input_ids [-1]",
                    r.input_prev_row
                ));
            }
            if r.input_prev_row == -1 && r.input_ids.iter().any(|&t| t < 0) {
                return bad(format!("request {id}: a negative input token"));
            }
            // Only a reset carries the whole history to check the prompt length against.
            if r.history_prompt_len < 0
                || (r.history_reset && r.history_prompt_len as usize > r.history.len())
            {
                return bad(format!("request {id}: history_prompt_len out of range"));
            }
            let bias = &r.sampling.logit_bias;
            if bias.iter().any(|&(t, b)| t < 0 || !b.is_finite())
                || bias.windows(2).any(|p| p[0].0 >= p[1].0)
            {
                return bad(format!(
                    "request {id}: logit_bias needs distinct ascending token ids >= 0 and finite biases"
                ));
            }
            if let Some(mask) = &r.allowed_tokens {
                if !r.sample || mask.iter().all(|&w| w == 0) {
                    return bad(format!(
                        "request {id}: an allowed-token mask needs a sampling row and an allowed token"
                    ));
                }
            }
            if r.mask_late && (!r.sample || r.allowed_tokens.is_some()) {
                return bad(format!(
                    "request {id}: mask_late needs a sampling row without a mask in the plan"
                ));
            }
        }
        Ok(())
    }
}
