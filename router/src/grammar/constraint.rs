//! One request's grammar state: the tokens it allows next, and how a sampled token advances it.

use std::sync::{Arc, OnceLock};

use llguidance::{Matcher, ParserFactory};

use super::spec::OutputConstraint;
use super::token_env::BundleTokEnv;
use crate::tokenizer::TokenizerBundle;

/// Compiles requests' constraints against the served tokenizer. The token trie behind it is
/// built on first use (about a second for a 150K-token vocabulary), so a server whose clients
/// never constrain their output never pays for it.
pub struct GrammarCompiler {
    tokenizer: Arc<TokenizerBundle>,
    factory: OnceLock<Result<ParserFactory, String>>,
    /// The token that ends the model's thinking (`</think>`), when the vocabulary has it.
    think_end: Option<i32>,
}

impl GrammarCompiler {
    pub fn new(tokenizer: Arc<TokenizerBundle>) -> GrammarCompiler {
        let think_end = tokenizer.token_id("</think>");
        GrammarCompiler {
            tokenizer,
            factory: OnceLock::new(),
            think_end,
        }
    }

    fn factory(&self) -> Result<&ParserFactory, String> {
        self.factory
            .get_or_init(|| {
                let env = BundleTokEnv::new(&self.tokenizer).into_env();
                let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                // Grammar problems reach the client as errors, not the server's stderr.
                factory.quiet();
                Ok(factory)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The constraint's grammar, ready to run from the first generated token; or, with
    /// `after_thinking`, from the token after `</think>` (a model that thinks first writes its
    /// thinking freely, and the answer is what the constraint shapes). Errors describe what is
    /// wrong with the schema, regex or grammar.
    pub fn compile(
        &self,
        constraint: &OutputConstraint,
        after_thinking: bool,
    ) -> Result<TokenConstraint, String> {
        let parser = self.factory()?.create_parser(constraint.grammar());
        let matcher = Matcher::new(parser);
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(TokenConstraint {
            matcher: Box::new(matcher),
            starts_after: if after_thinking { self.think_end } else { None },
            eos: self.tokenizer.eos_token_ids().first().copied(),
            error: None,
        })
    }
}

/// A compiled constraint on one request's output, advanced token by token by the scheduler.
pub struct TokenConstraint {
    /// Boxed: a matcher is large, and requests carry the constraint through channels and queues.
    matcher: Box<Matcher>,
    /// The grammar starts after this token is sampled (the end of the model's thinking).
    pub(super) starts_after: Option<i32>,
    /// The token the grammar engine allows when the output may end (the tokenizer's first EOS).
    eos: Option<i32>,
    /// Why the grammar could not go on, once it could not.
    error: Option<String>,
}

impl Clone for TokenConstraint {
    /// A copy that advances on its own (each of a request's `n` samples has one) and shares the
    /// lexer's caches with the original (thread-safe in llguidance): what one sample's masks
    /// computed, the others reuse.
    fn clone(&self) -> Self {
        TokenConstraint {
            matcher: Box::new((*self.matcher).clone()),
            starts_after: self.starts_after,
            eos: self.eos,
            error: self.error.clone(),
        }
    }
}

impl std::fmt::Debug for TokenConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConstraint")
            .field("starts_after", &self.starts_after)
            .field("stopped", &self.matcher.is_stopped())
            .field("error", &self.error)
            .finish()
    }
}

impl TokenConstraint {
    /// Whether the next token is constrained (false while the model still thinks).
    pub fn is_active(&self) -> bool {
        self.starts_after.is_none()
    }

    /// The tokens allowed next, as a bitmask (bit `t % 32` of word `t / 32` for token `t`;
    /// tokens past the last word are not allowed). Where the grammar lets the output end, every
    /// one of `stop_token_ids` is allowed too (a model may end its turn with any of its EOS
    /// tokens). With `only` (`allowed_token_ids`' mask), no token outside it. `Err` when the
    /// grammar cannot go on; the error is kept for `error`.
    pub fn allowed_tokens(
        &mut self,
        stop_token_ids: &[i32],
        only: Option<&[u32]>,
    ) -> Result<Vec<u32>, String> {
        let mut words = match self.matcher.compute_mask() {
            Ok(mask) => mask.as_slice().to_vec(),
            Err(e) => return Err(self.fail(e.to_string())),
        };
        let allowed = |words: &[u32], t: i32| {
            let t = t as usize;
            words.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
        };
        if self.eos.is_some_and(|e| allowed(&words, e)) {
            for &t in stop_token_ids {
                let t = t as usize;
                if words.len() <= t / 32 {
                    words.resize(t / 32 + 1, 0);
                }
                words[t / 32] |= 1 << (t % 32);
            }
        }
        if let Some(only) = only {
            words.truncate(only.len());
            for (w, o) in words.iter_mut().zip(only) {
                *w &= o;
            }
        }
        if words.iter().all(|&w| w == 0) {
            return Err(self.fail(match only {
                Some(_) => "no token the grammar allows is in `allowed_token_ids`".into(),
                None => "the grammar allows no next token".into(),
            }));
        }
        Ok(words)
    }

    /// Advances by a sampled token (not a stop token: those end the request). True when the
    /// grammar is complete and allows nothing more, so the output ends here.
    pub fn advance(&mut self, token: i32) -> Result<bool, String> {
        if let Some(start) = self.starts_after {
            if token == start {
                self.starts_after = None;
            }
            return Ok(false);
        }
        match self.matcher.consume_token(token as u32) {
            Ok(()) => Ok(self.matcher.is_stopped()),
            Err(e) => Err(self.fail(format!("token {token} does not fit the grammar: {e}"))),
        }
    }

    /// Why the grammar could not go on, if it could not.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    fn fail(&mut self, message: String) -> String {
        let message = format!("structured output: {message}");
        self.error = Some(message.clone());
        message
    }
}
