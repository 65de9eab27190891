//! Structured outputs: a request's output constrained to a JSON schema, a regex, a list of
//! choices or a Lark grammar (OpenAI's `response_format`, vLLM's `guided_*` and
//! `structured_outputs`, SGLang's `json_schema` and `regex`).
//!
//! The router owns the constraint, as it owns everything else about a request: the HTTP layer
//! compiles it (`GrammarCompiler`), the scheduler computes the allowed-token mask of every
//! constrained row it plans and advances the grammar by each sampled token, and the plan carries
//! the masks to the workers, whose sampler removes every token a mask leaves out. The grammar
//! engine is llguidance (Earley parsing over lexemes, with the token trie walked once per mask).
//!
//! Files: `token_env` (the tokenizer as the grammar engine sees it: every token's bytes),
//! `spec` (the request's constraint, turned into a grammar), `constraint` (one request's
//! grammar state, its masks and how it advances).

mod constraint;
mod spec;
mod token_env;

pub use constraint::{GrammarCompiler, TokenConstraint};
pub use spec::{json_options, OutputConstraint};

#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod walk;
