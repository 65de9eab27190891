//! Test support: random walks through a compiled constraint, as a sampler would take them.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::TokenConstraint;
use crate::tokenizer::TokenizerBundle;

/// The token ids a mask allows.
pub fn allowed_ids(words: &[u32]) -> Vec<i32> {
    (0..words.len() * 32)
        .filter(|&t| words[t / 32] >> (t % 32) & 1 == 1)
        .map(|t| t as i32)
        .collect()
}

/// Picks allowed tokens with `pick` (given the allowed ids, the stop ids and a seeded rng) until
/// a stop token or the grammar's end; the text generated (special tokens kept), and whether it
/// ended rather than running out of `max_tokens`.
pub fn walk(
    tok: &TokenizerBundle,
    c: &mut TokenConstraint,
    seed: u64,
    max_tokens: usize,
    mut pick: impl FnMut(&[i32], &[i32], &mut StdRng) -> i32,
) -> (String, bool) {
    let stops = tok.eos_token_ids().to_vec();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ids = Vec::new();
    let mut ended = false;
    for _ in 0..max_tokens {
        let allowed = allowed_ids(&c.allowed_tokens(&stops, None).expect("a mask"));
        assert!(!allowed.is_empty(), "a mask allows some token");
        let t = pick(&allowed, &stops, &mut rng);
        if stops.contains(&t) {
            ended = true;
            break;
        }
        ids.push(t);
        if c.advance(t).expect("an allowed token fits") {
            ended = true;
            break;
        }
    }
    (tok.decode(&ids, false), ended)
}

/// Every allowed token equally likely.
pub fn uniform(allowed: &[i32], _stops: &[i32], rng: &mut StdRng) -> i32 {
    allowed[rng.random_range(0..allowed.len())]
}
