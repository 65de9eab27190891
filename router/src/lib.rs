//! nsaserve's router: the HTTP API, tokenization, scheduling and the batch plans sent to the
//! tensor-parallel workers. Python reaches it through the thin `python` module (feature
//! `python`); everything else is plain Rust, tested with `cargo test`.

pub mod engine;
pub mod grammar;
pub mod http;
pub mod metrics;
pub mod parsers;
pub mod protocol;
#[cfg(feature = "python")]
mod python;
pub mod scheduler;
pub mod server;
pub mod tokenizer;
pub mod transport;
