//! The raw bytes behind each token id. Chat logprobs report them (`bytes`) because a token can
//! hold part of a multi-byte character, which no string can show. Byte-level BPE vocabularies
//! (GPT-2 style) spell bytes with printable stand-in characters; SentencePiece vocabularies
//! spell raw bytes as `<0xNN>` tokens and spaces as `▁`.

use tokenizers::Tokenizer;

/// The GPT-2 byte-level alphabet: the character each byte is spelled with. Printable Latin-1
/// bytes stand for themselves, the other bytes map in order to the characters from U+0100 on.
pub fn byte_level_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next = 0u32;
    for b in 0..=255u8 {
        chars[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(255 + next).expect("U+0100..U+0143 are characters")
        };
    }
    chars
}

/// The inverse of `byte_level_chars`.
fn byte_level_char_to_byte() -> std::collections::HashMap<char, u8> {
    (0..=255u8)
        .zip(byte_level_chars())
        .map(|(b, c)| (c, b))
        .collect()
}

fn byte_fallback(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

pub(super) struct TokenBytes {
    by_id: Vec<Option<Box<[u8]>>>,
}

impl TokenBytes {
    pub fn new(tokenizer: &Tokenizer) -> TokenBytes {
        let decoder_json = serde_json::to_string(&tokenizer.get_decoder()).unwrap_or_default();
        let byte_level = decoder_json.contains("\"ByteLevel\"");
        let char_to_byte = byte_level_char_to_byte();
        let size = tokenizer.get_vocab_size(true);
        let by_id = (0..size as u32)
            .map(|id| {
                let token = tokenizer.id_to_token(id)?;
                if let Some(b) = byte_fallback(&token) {
                    return Some(vec![b].into_boxed_slice());
                }
                if byte_level {
                    // Added tokens outside the byte alphabet fall back to their decoded text.
                    token
                        .chars()
                        .map(|c| char_to_byte.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                        .map(Vec::into_boxed_slice)
                } else {
                    Some(
                        token
                            .replace('\u{2581}', " ")
                            .into_bytes()
                            .into_boxed_slice(),
                    )
                }
            })
            .collect();
        TokenBytes { by_id }
    }

    pub fn get(&self, id: i32) -> Option<&[u8]> {
        self.by_id.get(usize::try_from(id).ok()?)?.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection_with_known_points() {
        let map = byte_level_char_to_byte();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'\u{0120}'], b' '); // "Ġ"
        assert_eq!(map[&'A'], b'A');
        assert_eq!(map[&'\u{0100}'], 0);
        let mut bytes: Vec<u8> = map.values().copied().collect();
        bytes.sort_unstable();
        bytes.dedup();
        assert_eq!(bytes.len(), 256);
    }

    #[test]
    fn byte_fallback_tokens() {
        assert_eq!(byte_fallback("<0xE4>"), Some(0xE4));
        assert_eq!(byte_fallback("<0xE>"), None);
        assert_eq!(byte_fallback("hello"), None);
    }
}
