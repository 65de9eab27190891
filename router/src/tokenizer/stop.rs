//! Stop strings, matched on the decoded text rather than on tokens: a stop string can span
//! several tokens and a token can hold a stop string plus more text. Text that could still
//! become a stop string (a suffix equal to some stop string's beginning) is held back, so
//! neither a whole stop string nor its first part ever reaches the client.

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// Bytes of `held` that came before stop strings could end the text (`push_unmatched`): a
    /// stop string ending within them does not count.
    floor: usize,
    /// The text ends after the stop string instead of before it (vLLM's
    /// `include_stop_str_in_output`).
    include_stop: bool,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet; this text is safe to send.
    Continue(String),
    /// A stop string matched: send this text (everything before the match, or up to its end
    /// with `including_stops`) and stop.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            floor: 0,
            include_stop: false,
            matched: None,
        }
    }

    /// The stop string that ended the text (Anthropic's `stop_sequence`), if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The text a stop string ends keeps the stop string itself.
    pub fn including_stops(mut self, include: bool) -> StopMatcher {
        self.include_stop = include;
        self
    }

    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(text.to_owned());
        }
        self.held.push_str(text);
        // The stop string that is complete first wins (as it would if text arrived a character
        // at a time, so the answer never depends on how tokens split the text); among those
        // completing together, the one starting first. The output ends before it (or after it,
        // with `include_stop`).
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| {
                // Only occurrences ending past the floor: those starting from `from` on.
                let mut from = (self.floor + 1).saturating_sub(s.len());
                while !self.held.is_char_boundary(from) {
                    from += 1;
                }
                self.held[from..]
                    .find(s.as_str())
                    .map(|start| (from + start + s.len(), from + start))
            })
            .min();
        if let Some((end, start)) = first_match {
            self.matched = Some(self.held[start..end].to_owned());
            let out = self.held[..if self.include_stop { end } else { start }].to_owned();
            self.held.clear();
            self.floor = 0;
            return StopOutcome::Stopped(out);
        }
        StopOutcome::Continue(self.release())
    }

    /// `push` before stop strings may end the text (`min_tokens` not reached): nothing matches,
    /// and a suffix that could still grow into a stop string is held as `push` holds it, so a
    /// stop string that starts here and completes later is still found.
    pub fn push_unmatched(&mut self, text: &str) -> String {
        if self.stops.is_empty() {
            return text.to_owned();
        }
        self.held.push_str(text);
        let out = self.release();
        self.floor = self.held.len();
        out
    }

    /// Sends all of the held text but the longest suffix that could begin a stop string.
    fn release(&mut self) -> String {
        let keep = self.partial_match_len();
        let sent = self.held.len() - keep;
        let out = self.held[..sent].to_owned();
        self.held.drain(..sent);
        self.floor = self.floor.saturating_sub(sent);
        out
    }

    /// Generation ended without a stop string: the held text was never a stop string.
    pub fn flush(&mut self) -> String {
        self.floor = 0;
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of the held text that begins some stop string.
    fn partial_match_len(&self) -> usize {
        let held = self.held.as_bytes();
        let len = held.len();
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // Candidates start where a stop string's first byte occurs: a cheap filter before the
        // full prefix comparison (stop strings can be long). A UTF-8 continuation byte never
        // starts a string, so a match always begins on a character boundary.
        (1..longest.min(len + 1))
            .rev()
            .find(|&k| {
                let tail = &held[len - k..];
                self.stops
                    .iter()
                    .any(|s| s.as_bytes()[0] == tail[0] && s.as_bytes().starts_with(tail))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_across_pieces_is_cut_and_not_leaked() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
        assert_eq!(
            run(&["END"], &["hello EN", "X"]),
            ("hello ENX".into(), false)
        );
        assert_eq!(
            run(&["\n\n", "STOP"], &["a\n", "b STO", "P\n\n"]),
            ("a\nb ".into(), true)
        );
    }

    #[test]
    fn text_pushed_unmatched_never_stops_but_a_stop_completed_later_does() {
        let mut m = StopMatcher::new(vec!["END".into(), "ab".into()]);
        // Before the minimum: whole stop strings pass; a possible start ("E") is held.
        assert_eq!(m.push_unmatched("x END ab E"), "x END ab ");
        // After it: "E" + "ND" completes a stop string that began before.
        assert_eq!(m.push("ND y"), StopOutcome::Stopped("".into()));
        let mut m = StopMatcher::new(vec!["abcd".into(), "ab".into()]);
        // "ab" is complete before the minimum, and held as the start of "abcd".
        assert_eq!(m.push_unmatched("xab"), "x");
        // It does not count afterwards; "abcd" completing later does.
        assert_eq!(m.push("c"), StopOutcome::Continue("".into()));
        assert_eq!(m.push("d!"), StopOutcome::Stopped("".into()));
        let mut m = StopMatcher::new(vec!["abcd".into(), "ab".into()]);
        assert_eq!(m.push_unmatched("xab"), "x");
        assert_eq!(m.push("z ab"), StopOutcome::Stopped("abz ".into()));
        // Multi-byte text around the floor.
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push_unmatched("日é"), "日");
        assert_eq!(m.push("!"), StopOutcome::Stopped("".into()));
    }

    #[test]
    fn earliest_match_wins_and_prefix_is_held() {
        let mut m = StopMatcher::new(vec!["bc".into(), "abcd".into()]);
        assert_eq!(m.push("xab"), StopOutcome::Continue("x".into()));
        assert_eq!(m.push("c"), StopOutcome::Stopped("a".into()));
    }

    #[test]
    fn the_stop_complete_first_wins_however_the_text_is_split() {
        // "日 é" starts before " " but is complete only after it.
        let want = ("日日".to_string(), true);
        assert_eq!(run(&[" ", "日 é"], &["日日 é"]), want);
        assert_eq!(run(&[" ", "日 é"], &["日", "日", " ", "é"]), want);
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        assert_eq!(run(&["é!"], &["café", "!x"]), ("caf".into(), true));
        assert_eq!(run(&["日本"], &["今日", "は"]), ("今日は".into(), false));
    }

    proptest::proptest! {
        /// However the text is split, the output is the text up to the stop string that is
        /// complete first.
        #[test]
        fn streaming_equals_cutting_the_whole_text(
            text in "[abé日 ]{0,40}",
            stops in proptest::collection::vec("[abé日 ]{1,4}", 0..4),
            cuts in proptest::collection::vec(0usize..40, 0..10),
        ) {
            let first = stops.iter().filter_map(|s| text.find(s.as_str()).map(|p| (p + s.len(), p))).min();
            let expected = match first {
                Some((_, pos)) => (text[..pos].to_owned(), true),
                None => (text.clone(), false),
            };
            let mut bounds: Vec<usize> = cuts.into_iter().filter(|&c| text.is_char_boundary(c.min(text.len()))).map(|c| c.min(text.len())).collect();
            bounds.push(0);
            bounds.push(text.len());
            bounds.sort_unstable();
            let pieces: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            proptest::prop_assert_eq!(run(&stop_refs, &pieces), expected);
        }
    }

    #[test]
    fn no_stops_passes_everything() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn included_stop_strings_end_the_text_after_themselves() {
        let mut m = StopMatcher::new(vec!["END".into(), "ab".into()]).including_stops(true);
        assert_eq!(m.push("xx E"), StopOutcome::Continue("xx ".into()));
        assert_eq!(m.push("NDyy"), StopOutcome::Stopped("END".into()));
        let mut m = StopMatcher::new(vec!["abcd".into(), "bc".into()]).including_stops(true);
        assert_eq!(m.push("zabcd"), StopOutcome::Stopped("zabc".into()));
        assert_eq!(m.matched(), Some("bc"));
    }

    #[test]
    fn the_matched_stop_string_is_kept() {
        let mut m = StopMatcher::new(vec!["END".into(), "ab".into()]);
        assert_eq!(m.matched(), None);
        m.push("xx E");
        assert_eq!(m.matched(), None);
        m.push("NDyy");
        assert_eq!(m.matched(), Some("END"));
    }
}
