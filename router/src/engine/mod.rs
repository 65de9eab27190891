//! The engine: the step loop that turns queued requests into batch plans, sends them to the
//! workers and routes their sampled tokens back to each request's event stream.

mod request;

pub use request::{
    Engine, FinishReason, GenerateEvent, GenerateRequest, ModelInfo, RequestId, RequestStream,
    SubmitError,
};
