"""Datasets: sglang's range-ratio lengths, seeds, and prefixes that really are shared."""

from __future__ import annotations

import numpy as np
import pytest

from nsaserve.bench.datasets import random_dataset, sample_lengths, shared_prefix_dataset, warmup_dataset


@pytest.mark.parametrize(("length", "ratio", "low"), [(100, 0.0, 1), (100, 0.5, 50), (7, 0.3, 2), (10, 0.05, 1), (64, 1.0, 64)])
def test_lengths_cover_exactly_max1_floor_ratio_len_to_len(length, ratio, low):
    lens = sample_lengths(np.random.default_rng(0), length, ratio, 20000)
    assert lens.min() == low and lens.max() == length
    if length - low < 200:  # every value in the range shows up: uniform integers, both ends included
        assert set(lens.tolist()) == set(range(low, length + 1))
    assert abs(lens.mean() - (low + length) / 2) < 0.02 * length + 0.1


def test_lengths_reject_bad_ratios():
    with pytest.raises(ValueError):
        sample_lengths(np.random.default_rng(0), 10, 1.5, 3)
    with pytest.raises(ValueError):
        sample_lengths(np.random.default_rng(0), 0, 0.5, 3)


def test_random_token_ids_have_the_sampled_lengths_and_stay_below_the_vocab():
    convs = random_dataset(np.random.default_rng(3), 200, 300, 40, 0.25, vocab_size=1000)
    turns = [c.turns[0] for c in convs]
    assert all(len(c.turns) == 1 for c in convs)
    assert all(len(t.prompt) == t.prompt_len and 75 <= t.prompt_len <= 300 for t in turns)
    assert all(10 <= t.output_len <= 40 for t in turns)
    ids = np.concatenate([t.prompt for t in turns])
    assert ids.min() >= 0 and ids.max() < 1000 and len(np.unique(ids)) > 900
    assert all(t.messages is None for t in turns)  # token ids cannot go to chat


def test_random_dataset_is_fixed_by_the_seed():
    a = random_dataset(np.random.default_rng(5), 20, 64, 16, 0.5, vocab_size=None)
    b = random_dataset(np.random.default_rng(5), 20, 64, 16, 0.5, vocab_size=None)
    c = random_dataset(np.random.default_rng(6), 20, 64, 16, 0.5, vocab_size=None)
    assert [x.turns[0] for x in a] == [x.turns[0] for x in b]
    assert [x.turns[0].prompt for x in a] != [x.turns[0].prompt for x in c]


def test_random_text_prompts_have_about_one_word_per_token_and_chat_messages():
    convs = random_dataset(np.random.default_rng(1), 10, 50, 8, 1.0, vocab_size=None)
    for conv in convs:
        t = conv.turns[0]
        assert len(t.prompt.split()) == 50 == t.prompt_len
        assert t.messages == [{"role": "user", "content": t.prompt}]


def test_shared_prefix_token_turns_extend_each_other_and_share_the_system_prompt():
    S, Q, OUT, T = 100, 10, 7, 4
    convs = shared_prefix_dataset(np.random.default_rng(2), 5, S, Q, OUT, T, vocab_size=5000)
    system = convs[0].turns[0].prompt[:S]
    for conv in convs:
        assert len(conv.turns) == T
        for k, turn in enumerate(conv.turns):
            assert len(turn.prompt) == turn.prompt_len == S + (k + 1) * Q + k * OUT
            assert turn.prompt[:S] == system
            assert turn.output_len == OUT
        for prev, nxt in zip(conv.turns, conv.turns[1:]):
            assert nxt.prompt[: len(prev.prompt)] == prev.prompt
    # Beyond the system prompt, conversations differ (their own questions).
    firsts = {tuple(c.turns[0].prompt[S:]) for c in convs}
    assert len(firsts) == len(convs)


def test_shared_prefix_text_turns_extend_each_other_as_strings_and_as_messages():
    convs = shared_prefix_dataset(np.random.default_rng(2), 3, 40, 5, 6, 3, vocab_size=None)
    system = convs[0].turns[0].messages[0]
    for conv in convs:
        assert conv.turns[0].messages[0] == system and system["role"] == "system"
        for prev, nxt in zip(conv.turns, conv.turns[1:]):
            assert nxt.prompt.startswith(prev.prompt) and len(nxt.prompt) > len(prev.prompt)
            assert nxt.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in nxt.messages[len(prev.messages) :]] == ["assistant", "user"]
        assert [m["role"] for m in conv.turns[-1].messages] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_warmup_requests_match_the_first_shape_but_not_its_content():
    first = random_dataset(np.random.default_rng(0), 1, 50, 9, 1.0, vocab_size=300)[0].turns[0]
    warm = warmup_dataset(np.random.default_rng([0, 1]), first, 3, vocab_size=300)
    assert len(warm) == 3
    for conv in warm:
        (t,) = conv.turns
        assert (t.prompt_len, t.output_len, len(t.prompt)) == (50, 9, 50)
        assert t.prompt != first.prompt
