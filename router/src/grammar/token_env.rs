//! The tokenizer as llguidance sees it: a trie of every token's bytes. Special tokens (chat
//! markers, EOS) are marked so that no grammar spells text with them.

use std::sync::Arc;

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::TokenizerBundle;

pub(super) struct BundleTokEnv {
    trie: TokTrie,
}

impl BundleTokEnv {
    pub fn new(tokenizer: &TokenizerBundle) -> BundleTokEnv {
        let vocab = tokenizer.vocab_size();
        let special = tokenizer.special_token_ids();
        let words: Vec<Vec<u8>> = (0..vocab as i32)
            .map(|id| {
                if special.binary_search(&id).is_ok() {
                    // llguidance's convention: a leading 0xFF byte marks a special token.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).as_bytes());
                    w
                } else {
                    tokenizer.token_bytes(id)
                }
            })
            .collect();
        let eos = tokenizer.eos_token_ids().first().copied().unwrap_or(0);
        let info = TokRxInfo::new(vocab as u32, eos as TokenId);
        BundleTokEnv {
            trie: TokTrie::from(&info, &words),
        }
    }

    pub fn into_env(self) -> llguidance::toktrie::TokEnv {
        Arc::new(self)
    }
}

impl TokenizerEnv for BundleTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Only used to force tokens, which the scheduler never asks for: the greedy split is enough.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}
