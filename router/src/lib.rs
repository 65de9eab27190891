//! nsaserve's router: the HTTP API, tokenization, scheduling and the batch plans sent to the
//! tensor-parallel workers. Python reaches it through the thin `python` module (feature
//! `python`); everything else is plain Rust, tested with `cargo test`.

pub mod engine;
pub mod http;
pub mod metrics;
pub mod protocol;
pub mod scheduler;
pub mod tokenizer;
pub mod transport;
