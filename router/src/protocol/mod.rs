//! The router <-> worker protocol: typed messages, their msgpack encoding and the raw
//! little-endian arrays inside them. `docs/protocol.md` is the human-readable form of this
//! module; the golden vectors under `tests/golden/` pin the bytes for both languages.

mod arrays;
mod messages;
mod plan;

pub use arrays::{ArrayError, LeArray};
pub use messages::{
    decode_router_message, decode_worker_message, encode_router_message, encode_worker_message,
    Fatal, Heartbeat, Hello, LateMasks, PromptLogprobs, RouterMessage, StepResult, TokenLogprobs,
    WorkerMessage,
};
pub use plan::{
    token_mask, BatchPlan, ForwardMode, PlanError, PlannedRequest, SamplingParams, BAN_BIAS,
};

/// Bumped whenever a field is added, removed or changes meaning. A worker whose hello carries
/// another version is refused at startup with a message naming both versions.
pub const PROTOCOL_VERSION: u32 = 6;
