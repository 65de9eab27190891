//! Small string helpers shared by the incremental parsers.

/// Length of the longest proper prefix of `marker` that `text` ends with: those bytes may be
/// the start of a marker whose rest has not arrived yet, so they are held back.
pub fn partial_suffix(text: &str, marker: &str) -> usize {
    let max = marker.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// `text` split into its body and its trailing whitespace.
pub fn split_trailing_whitespace(text: &str) -> (&str, &str) {
    let body = text.trim_end();
    (body, &text[body.len()..])
}

/// Where to resume searching for `marker` in a buffer that was `searched` bytes long at the
/// last unsuccessful search: a match may straddle the old end.
pub fn resume_at(buffer: &str, searched: usize, marker: &str) -> usize {
    let mut at = searched.saturating_sub(marker.len());
    while !buffer.is_char_boundary(at) {
        at -= 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_suffix_finds_marker_starts() {
        assert_eq!(partial_suffix("abc<tool", "<tool_call>"), 5);
        assert_eq!(partial_suffix("abc<", "<tool_call>"), 1);
        assert_eq!(partial_suffix("abc", "<tool_call>"), 0);
        // A whole marker is not a partial one.
        assert_eq!(partial_suffix("<a>", "<a>"), 0);
        assert_eq!(partial_suffix("x<｜DS", "<｜DSML｜function_calls>"), 6);
        assert_eq!(partial_suffix("é", "<think>"), 0);
    }

    #[test]
    fn trailing_whitespace_split() {
        assert_eq!(split_trailing_whitespace("a b \n"), ("a b", " \n"));
        assert_eq!(split_trailing_whitespace("  "), ("", "  "));
    }
}
