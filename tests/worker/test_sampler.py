"""Sampler: greedy is exact argmax, draws follow the distribution, seeds are batch-proof."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from pagellm.core.sampling_params import SamplingParams
from pagellm.worker.sampler import (
    BadWords,
    SamplerOutput,
    SamplingMetadata,
    make_generator,
    sample,
)


def run(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    eos: Sequence[int] = (),
    bad_words: Sequence[Sequence[Sequence[int]]] | None = None,
    formats: dict[int, Sequence[int]] | None = None,
) -> SamplerOutput:
    """`formats`: row -> the tokens its structured output allows."""
    n = len(params)
    md = SamplingMetadata.from_requests(
        params,
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        eos_token_ids=eos,
        bad_words=(None if bad_words is None else
                   [BadWords.from_token_ids(words) if words else None for words in bad_words]),
        format_tokens=None if formats is None else (list(formats), _allowed(formats, logits)),
    )
    return sample(logits, md)


def _allowed(formats: dict[int, Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
    allowed = torch.zeros(len(formats), logits.shape[1], dtype=torch.bool)
    for index, tokens in enumerate(formats.values()):
        allowed[index, list(tokens)] = True
    return allowed


def test_greedy_is_argmax_and_input_is_untouched() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen)
    before = logits.clone()
    out = run(logits, [SamplingParams(temperature=0)] * 8)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    greedy = run(logits, [SamplingParams(temperature=0)] * 2).sampled_token_ids
    assert greedy == [1, 0]
    assert run(logits, [SamplingParams(top_p=1e-9)] * 2).sampled_token_ids == greedy
    # top_k=1 keeps every token tied for the top (vLLM's rule), and draws among them.
    drawn = {tuple(run(logits, [SamplingParams(top_k=1)] * 2).sampled_token_ids)
             for _ in range(200)}
    assert {first for first, _ in drawn} == {1, 3}
    assert {second for _, second in drawn} == {0, 1, 2, 3}


def test_greedy_rows_ignore_other_rows_in_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5),
              SamplingParams(seed=4), SamplingParams(temperature=0, presence_penalty=1.0),
              SamplingParams(top_p=0.5), SamplingParams(temperature=0)]
    gens = [None, None, make_generator(4), None, None, None]
    out = run(logits, params, generators=gens)
    argmax = logits.argmax(dim=-1).tolist()
    assert [out.sampled_token_ids[i] for i in (0, 3, 5)] == [argmax[i] for i in (0, 3, 5)]


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(16, 500) * 3
    argmax = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(top_k=1, temperature=1.3),
                   SamplingParams(top_p=1e-6, temperature=2.0),
                   SamplingParams(top_k=1, seed=9)):
        gens = [make_generator(9) if params.seed is not None else None for _ in range(16)]
        assert run(logits, [params] * 16, generators=gens).sampled_token_ids == argmax


def frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return counts / counts.sum()


LOGITS_4 = torch.tensor([1.0, 0.0, -0.5, 2.0])
DRAWS = 20_000
# Standard error of a frequency is at most 0.5 / sqrt(DRAWS) ~ 0.0035; allow 4 of them.
TOLERANCE = 0.015


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), torch.softmax(LOGITS_4, -1)),
        (SamplingParams(temperature=2.0), torch.softmax(LOGITS_4 / 2, -1)),
        (SamplingParams(temperature=0.5), torch.softmax(LOGITS_4 / 0.5, -1)),
        # top_k=2 keeps tokens 3 and 0, renormalised.
        (SamplingParams(top_k=2), torch.softmax(torch.tensor([1.0, -1e9, -1e9, 2.0]), -1)),
        # softmax = [.23, .09, .05, .63]: top_p=0.8 keeps 3 then 0 (0.63 < 0.8).
        (SamplingParams(top_p=0.8), torch.softmax(torch.tensor([1.0, -1e9, -1e9, 2.0]), -1)),
        # min_p=0.3 keeps p >= 0.3 * 0.63 = 0.19: tokens 3 and 0.
        (SamplingParams(min_p=0.3), torch.softmax(torch.tensor([1.0, -1e9, -1e9, 2.0]), -1)),
    ],
    ids=["plain", "temp2", "temp0.5", "top_k2", "top_p0.8", "min_p0.3"],
)
def test_draws_follow_the_distribution(params: SamplingParams, expected: torch.Tensor) -> None:
    torch.manual_seed(1234)
    logits = LOGITS_4.expand(DRAWS, 4).contiguous()
    freq = frequencies(run(logits, [params] * DRAWS).sampled_token_ids, 4)
    assert torch.allclose(freq, expected.double(), atol=TOLERANCE), (freq, expected)


def test_seeded_draws_follow_the_distribution() -> None:
    """One request drawing step after step from its own generator is also unbiased."""
    gen = make_generator(77)
    params = [SamplingParams(seed=77)]
    tokens = [run(LOGITS_4.unsqueeze(0), params, generators=[gen]).sampled_token_ids[0]
              for _ in range(2_000)]
    assert torch.allclose(frequencies(tokens, 4), torch.softmax(LOGITS_4, -1).double(),
                          atol=0.04)


def test_min_p_drops_unlikely_tokens() -> None:
    torch.manual_seed(3)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    tokens = run(logits, [SamplingParams(min_p=0.5)] * 4000).sampled_token_ids
    assert set(tokens) == {0, 1}
    assert abs(tokens.count(0) / 4000 - 0.5 / 0.8) < 0.03


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    """vLLM's and transformers' rule: a logit at least the k-th largest stays."""
    torch.manual_seed(6)
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0]).expand(DRAWS, 4).contiguous()
    tokens = run(logits, [SamplingParams(top_k=2)] * DRAWS).sampled_token_ids
    assert set(tokens) == {0, 1, 2}
    expected = torch.softmax(torch.tensor([2.0, 1.0, 1.0]), -1)[1].item()
    assert abs(tokens.count(2) / DRAWS - expected) < TOLERANCE


def test_min_p_comes_before_top_p() -> None:
    """vLLM's order: top-p's nucleus is taken over what min-p leaves, renormalised. Over
    [.4, .3, .2, .1], min_p=0.3 leaves the first three, [.44, .33, .22], of which
    top_p=0.75 keeps two; top-p first (transformers' order) would keep three, as .4 + .3
    of the whole distribution is under 0.75."""
    torch.manual_seed(5)
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(DRAWS, 4).contiguous()
    tokens = run(logits, [SamplingParams(min_p=0.3, top_p=0.75)] * DRAWS).sampled_token_ids
    assert set(tokens) == {0, 1}
    assert abs(tokens.count(0) / DRAWS - 0.4 / 0.7) < TOLERANCE


def test_rows_keep_their_own_knobs_in_one_batch() -> None:
    torch.manual_seed(4)
    logits = torch.randn(1, 50).expand(400, 50).contiguous()
    top3 = set(logits[0].topk(3).indices.tolist())
    params = [SamplingParams(top_k=3), SamplingParams()] * 200
    tokens = run(logits, params).sampled_token_ids
    assert set(tokens[0::2]) <= top3
    assert len(set(tokens[1::2])) > 3


def test_penalties_match_a_hand_computed_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25, logprobs=4)
    out = run(logits, [params], prompts=[[0, 1]], outputs=[[3, 3, 2]])
    # token 0: in the prompt, positive: 2 / 2 = 1 (presence/frequency skip prompt tokens)
    # token 1: in the prompt, negative: -1 * 2 = -2
    # token 2: generated once: 0.5 / 2 - 0.5 * 1 - 0.25 = -0.5
    # token 3: generated twice: 3 / 2 - 0.5 * 2 - 0.25 = 0.25
    # token 4: never seen: unchanged
    expected = torch.tensor([1.0, -2.0, -0.5, 0.25, -2.0])
    assert out.sampled_token_ids == [0]
    lp = out.logprobs[0]
    assert lp is not None
    reference = torch.log_softmax(expected, -1)
    assert lp.logprob == pytest.approx(reference[0].item(), abs=1e-6)
    ids = [t for t, _ in lp.top_logprobs]
    assert ids[:3] == [0, 3, 2] and ids[3] in (1, 4)  # tokens 1 and 4 tie at -2
    for token, value in lp.top_logprobs:
        assert value == pytest.approx(reference[token].item(), abs=1e-6)


def test_presence_and_frequency_ignore_the_prompt() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0,
                            logprobs=3)
    out = run(logits, [params], prompts=[[0, 0, 0]], outputs=[[1]])
    lp = out.logprobs[0]
    assert out.sampled_token_ids == [0] and lp is not None
    reference = torch.log_softmax(torch.tensor([1.0, -3.0, 0.0]), -1)
    assert dict(lp.top_logprobs) == pytest.approx(dict(enumerate(reference.tolist())))


def test_penalties_only_touch_their_own_rows() -> None:
    logits = torch.tensor([[3.0, 1.0], [3.0, 1.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)]
    out = run(logits, params, outputs=[[0, 0], [0, 0]])
    assert out.sampled_token_ids == [1, 0]


def test_logprobs_are_the_model_distribution_before_temperature() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 200) * 2
    params = [SamplingParams(temperature=0.7, logprobs=5), SamplingParams(logprobs=None),
              SamplingParams(temperature=0, logprobs=0)]
    out = run(logits, params)
    reference = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    for row in (0, 2):
        lp = out.logprobs[row]
        token = out.sampled_token_ids[row]
        assert lp is not None and lp.token_id == token
        assert lp.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
        assert lp.rank == int((reference[row] > reference[row, token]).sum()) + 1
    top = out.logprobs[0]
    assert top is not None
    values, ids = reference[0].topk(5)
    assert [t for t, _ in top.top_logprobs] == ids.tolist()
    assert [v for _, v in top.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
    greedy = out.logprobs[2]
    assert greedy is not None and greedy.rank == 1 and greedy.top_logprobs == []


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    eos, stop = 7, 5
    logits = torch.zeros(3, 10)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop], logprobs=1)
    out = run(logits, [params] * 3, outputs=[[1, 2], [1, 2, 3], [1, 2, 3, 4]], eos=[eos])
    assert out.sampled_token_ids[0] not in (eos, stop)
    assert out.sampled_token_ids[1:] == [eos, eos]
    blocked = out.logprobs[0]
    assert blocked is not None and blocked.top_logprobs[0][0] not in (eos, stop)
    # Random rows never draw a blocked token either, however likely it is.
    torch.manual_seed(6)
    many = run(logits[:1].expand(2000, 10).contiguous(), [SamplingParams(min_tokens=1)] * 2000,
               eos=[eos]).sampled_token_ids
    assert eos not in many


def test_ignore_eos_does_not_block_eos_for_min_tokens() -> None:
    logits = torch.zeros(1, 4)
    logits[0, 3] = 5.0
    params = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert run(logits, [params], eos=[3]).sampled_token_ids == [3]


def seeded_tokens(step_logits: list[torch.Tensor], row: int, others: list[SamplingParams],
                  params: SamplingParams) -> list[int]:
    """Runs `params` at batch position `row` among `others` for a few steps."""
    batch = others[:row] + [params] + others[row:]
    gens = [make_generator(p.seed) if p.seed is not None else None for p in batch]
    outputs: list[list[int]] = [[] for _ in batch]
    tokens = []
    for logits_for_request in step_logits:
        logits = torch.randn(len(batch), logits_for_request.shape[0])
        logits[row] = logits_for_request
        out = run(logits, batch, prompts=[[1, 2, 3]] * len(batch), outputs=outputs,
                  generators=gens)
        for i, token in enumerate(out.sampled_token_ids):
            outputs[i] = outputs[i] + [token]
        tokens.append(out.sampled_token_ids[row])
    return tokens


def test_seeded_request_is_reproducible_alone_and_in_any_batch() -> None:
    torch.manual_seed(7)
    step_logits = [torch.randn(500) for _ in range(8)]
    params = SamplingParams(seed=2024, temperature=0.9, top_p=0.95, top_k=50, min_p=0.01,
                            frequency_penalty=0.3)
    alone = seeded_tokens(step_logits, 0, [], params)
    others = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=5),
              SamplingParams(temperature=1.7), SamplingParams(seed=2024, repetition_penalty=1.5),
              SamplingParams(top_p=0.3, presence_penalty=1.0)]
    for row in (0, 2, 5):
        torch.manual_seed(100 + row)  # unseeded neighbours draw differently each time
        assert seeded_tokens(step_logits, row, others, params) == alone
    assert seeded_tokens(step_logits, 1, others[::-1], params) == alone


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)
    runs = []
    for seed in (1, 2, 1):
        gen = make_generator(seed)
        runs.append([run(logits, [SamplingParams(seed=seed)], generators=[gen])
                     .sampled_token_ids[0] for _ in range(10)])
    assert runs[0] == runs[2]
    assert runs[0] != runs[1]


def test_seed_reduction_matches_torch() -> None:
    assert make_generator(-1).initial_seed() == 2**64 - 1
    assert make_generator(2**64 + 5).initial_seed() == 5


def test_bad_inputs_are_reported() -> None:
    with pytest.raises(ValueError, match="generator"):
        SamplingMetadata.from_requests([SamplingParams(seed=1)], [[1]], [[]], [None])
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.from_requests([SamplingParams()], [[1], [2]], [[]], [None])
    md = SamplingMetadata.from_requests([SamplingParams()], [[1]], [[]], [None])
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 5), md)


def test_non_float32_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    out = run(logits, [SamplingParams(temperature=0, logprobs=1)])
    assert out.sampled_token_ids == [1]
    assert out.logprobs[0] is not None


def test_logit_bias_moves_greedy_and_random_rows_only_where_given() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 50, generator=gen)
    before = logits.clone()
    argmax = logits.argmax(dim=-1).tolist()
    target = (argmax[0] + 1) % 50
    params = [SamplingParams(temperature=0, logit_bias={target: 100.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logit_bias={argmax[2]: -100.0}),
              SamplingParams(temperature=1.0, seed=3, logit_bias={target: 100.0})]
    gens = [None, None, None, make_generator(3)]
    out = run(logits, params, generators=gens)
    assert torch.equal(logits, before)
    assert out.sampled_token_ids[0] == target
    assert out.sampled_token_ids[1] == argmax[1]
    second = logits[2].clone()
    second[argmax[2]] -= 100.0
    assert out.sampled_token_ids[2] == int(second.argmax())
    assert out.sampled_token_ids[3] == target


def test_logit_bias_is_added_exactly_and_seen_by_logprobs() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    out = run(logits, [SamplingParams(temperature=0, logprobs=1,
                                      logit_bias={0: 4.5, 2: -1.0})])
    biased = torch.tensor([[4.5, 1.0, 1.0, 3.0]])
    assert out.sampled_token_ids == [0]
    entry = out.logprobs[0]
    assert entry is not None
    assert entry.logprob == pytest.approx(float(biased.log_softmax(-1)[0, 0]))


def test_logit_bias_values_are_checked() -> None:
    for bad, field in [({1: 100.5}, "logit_bias[1]"), ({-1: 1.0}, "logit_bias keys"),
                       ({True: 1.0}, "logit_bias keys"), ([1, 2], "logit_bias must"),
                       ({2: "x"}, "logit_bias[2]")]:
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={5: -100}).logit_bias == {5: -100.0}


def test_allowed_token_ids_limit_greedy_and_random_rows_only() -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 50, generator=gen)
    allowed = [3, 17, 41]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0),
              SamplingParams(temperature=2.0, allowed_token_ids=allowed, logprobs=2),
              SamplingParams(temperature=1.0)]
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    seen: set[int] = set()
    for _ in range(200):
        out = run(logits, params)
        assert out.sampled_token_ids[0] == best_allowed
        assert out.sampled_token_ids[1] == logits[1].argmax().item()
        seen.add(out.sampled_token_ids[2])
    assert seen == set(allowed)  # all three drawn at temperature 2, nothing else
    logprobs = out.logprobs[2]
    assert logprobs is not None
    assert {token for token, _ in logprobs.top_logprobs} <= set(allowed)


def test_allowed_token_ids_keep_bias_and_min_tokens_blocks() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 9] = 5.0  # not allowed
    params = SamplingParams(temperature=0, allowed_token_ids=[2, 4, 6],
                            logit_bias={4: 1.0, 6: 2.0}, min_tokens=1, stop_token_ids=[6])
    assert run(logits, [params]).sampled_token_ids == [4]  # 6 blocked until min_tokens
    assert run(logits, [params], outputs=[[2]]).sampled_token_ids == [6]


def test_bad_words_ban_the_last_token_only_after_the_rest_was_generated() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7] = 3.0
    logits[0, 5] = 2.0
    logits[0, 1] = 1.0
    greedy = [SamplingParams(temperature=0)]
    one_token, two_tokens, three_tokens = [7], [4, 7], [3, 4, 5]
    assert run(logits, greedy, bad_words=[[one_token]]).sampled_token_ids == [5]
    assert run(logits, greedy, outputs=[[4]], bad_words=[[two_tokens]]).sampled_token_ids == [5]
    # Not right after 4, or 4 only in the prompt: 7 stays allowed.
    assert run(logits, greedy, outputs=[[4, 2]], bad_words=[[two_tokens]]
               ).sampled_token_ids == [7]
    assert run(logits, greedy, prompts=[[4]], bad_words=[[two_tokens]]).sampled_token_ids == [7]
    both = [[one_token, three_tokens]]
    assert run(logits, greedy, outputs=[[9, 3, 4]], bad_words=both).sampled_token_ids == [1]
    assert run(logits, greedy, outputs=[[4]], bad_words=both).sampled_token_ids == [5]


def test_bad_words_index_finds_every_word_ending_now() -> None:
    words = BadWords.from_token_ids([[7], [4, 7], [4, 8], [3, 4, 5], [9, 9]])
    assert sorted(words.bans([])) == [7]
    assert sorted(words.bans([1, 4])) == [7, 7, 8]
    assert sorted(words.bans([3, 4])) == [5, 7, 7, 8]
    assert sorted(words.bans([9])) == [7, 9]
    assert sorted(words.bans([9, 3])) == [7]


def test_a_row_whose_allowed_tokens_are_all_banned_keeps_them() -> None:
    """allowed_token_ids wins over a bad word that would leave nothing to sample: the row
    samples among its allowed tokens (never token 0 of an all -inf row), others stay
    banned as usual."""
    logits = torch.zeros(2, 10)
    logits[:, 5] = 1.0
    logits[:, 0] = 3.0
    params = [SamplingParams(temperature=0, allowed_token_ids=[5, 6], logprobs=1),
              SamplingParams(temperature=0, allowed_token_ids=[5, 6])]
    out = run(logits, params, outputs=[[4], [2]], bad_words=[[[4, 5], [4, 6]], [[4, 5]]])
    assert out.sampled_token_ids == [5, 5]
    logprobs = out.logprobs[0]
    assert logprobs is not None and logprobs.logprob > -1.0  # a real distribution
    out = run(logits[1:], params[1:], outputs=[[4]], bad_words=[[[4, 5]]])
    assert out.sampled_token_ids == [6]


def test_bad_words_are_per_row() -> None:
    logits = torch.zeros(3, 10)
    logits[:, 7] = 3.0
    params = [SamplingParams(temperature=0)] * 3
    out = run(logits, params, outputs=[[4], [4], [1]], bad_words=[[[4, 7]], [], [[4, 7]]])
    assert out.sampled_token_ids == [0, 7, 7]


def test_a_format_limits_its_rows_greedy_random_and_logprobs() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen)
    logits[:, 7] = 10.0
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=4)]
    formats = {0: [3, 9], 2: [11, 12, 13]}
    for _ in range(20):
        out = run(logits, params, formats=formats, generators=[None, None, make_generator(4)])
        assert out.sampled_token_ids[0] == [3, 9][int(logits[0, 9] > logits[0, 3])]
        assert out.sampled_token_ids[1] == 7  # no format: untouched
        assert out.sampled_token_ids[2] in (11, 12, 13)
    logprobs = out.logprobs[0]
    assert logprobs is not None
    assert {token for token, _ in logprobs.top_logprobs} == {3, 9}
    probs = torch.tensor([value for _, value in logprobs.top_logprobs]).exp()
    assert abs(float(probs.sum()) - 1.0) < 1e-5  # the distribution over the format's tokens


def test_the_format_wins_when_other_rules_leave_nothing() -> None:
    """A format that allows only EOS while min_tokens blocks it, or only a bad word's last
    token, or only tokens outside allowed_token_ids: the row samples what the format
    allows (never an all -inf row's token 0); rules that leave something still apply."""
    logits = torch.zeros(4, 10)
    logits[:, 0] = 5.0
    params = [SamplingParams(temperature=0, min_tokens=3),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, allowed_token_ids=[1, 2]),
              SamplingParams(temperature=0, min_tokens=3)]
    out = run(logits, params, eos=[8], outputs=[[], [4], [], []],
              bad_words=[[], [[4, 6]], [], []],
              formats={0: [8], 1: [6], 2: [5], 3: [8, 9]})
    assert out.sampled_token_ids == [8, 6, 5, 9]


def test_a_row_under_a_format_and_allowed_ids_keeps_both_when_bad_words_empty_it() -> None:
    """Restoring goes from the narrowest rules out: a row whose format and allowed ids
    share tokens that bad words then ban gets those shared tokens back (not every token
    of its format), and only a row whose rules share nothing falls back to its format."""
    logits = torch.zeros(2, 10)
    logits[:, 7] = 5.0  # in the format, not allowed
    logits[:, 3] = 1.0
    params = [SamplingParams(temperature=0, allowed_token_ids=[2, 3, 4])] * 2
    out = run(logits, params, outputs=[[9], [9]], bad_words=[[[9, 2], [9, 3]], []],
              formats={0: [2, 3, 7], 1: [7, 8]})
    assert out.sampled_token_ids == [3, 7]


def test_unseeded_rows_draw_from_the_engines_generator() -> None:
    """The engine passes its own generator for rows without a seed: their draws follow
    it, whatever torch's global stream does, and a seeded neighbour keeps its own."""
    logits = torch.zeros(3, 1000)
    params = [SamplingParams(), SamplingParams(seed=5), SamplingParams()]

    def draws(global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)
        md = SamplingMetadata.from_requests(params, [[0]] * 3, [[]] * 3,
                                            [None, make_generator(5), None],
                                            generator=make_generator(11))
        return sample(logits, md).sampled_token_ids

    assert draws(1) == draws(2)
    assert draws(1)[1] == run(logits[:1], [params[1]],
                              generators=[make_generator(5)]).sampled_token_ids[0]
