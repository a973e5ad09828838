"""SamplingParams: every bad field is rejected by name, every valid value is kept."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagellm.core.sampling_params import SamplingParams, SamplingType, StructuredOutputsParams


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.allowed_token_ids is None and p.bad_words is None
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.sampling_type is SamplingType.RANDOM and not p.has_penalties


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(2, 3)).stop_token_ids == [2, 3]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert all(isinstance(x, float) for x in (p.temperature, p.top_p, p.repetition_penalty))
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(stop="\n").stop == ["\n"]  # whitespace is a fine stop string
    assert SamplingParams(allowed_token_ids=(4, 2)).allowed_token_ids == [4, 2]
    assert SamplingParams(bad_words="Paris").bad_words == ["Paris"]
    assert SamplingParams(bad_words=[]).bad_words is None
    fmt = SamplingParams(structured_outputs={"choice": ("a", "b")}).structured_outputs
    assert fmt == StructuredOutputsParams(choice=["a", "b"]) and fmt.kind == "choice"
    assert SamplingParams(structured_outputs=fmt).structured_outputs is fmt
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    # vLLM's dataclass serialised whole: nulls, its private and backend keys are ignored.
    vllm = {"json": None, "regex": "a+", "structural_tag": None, "_backend": None,
            "_backend_was_auto": False, "disable_fallback": False}
    assert StructuredOutputsParams.from_dict(vllm) == StructuredOutputsParams(regex="a+")
    # vLLM's keyword: None is accepted as in vLLM, a tag is refused by name, not a TypeError.
    assert StructuredOutputsParams(regex="a+", structural_tag=None).kind == "regex"
    with pytest.raises(ValueError, match="structural_tag is not supported"):
        StructuredOutputsParams(structural_tag="{}")


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0, seed=1).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"


def test_has_penalties() -> None:
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


BAD_VALUES = [
    ("n", 0), ("n", 129), ("n", 1.0), ("n", True), ("n", "2"),
    ("temperature", -1), ("temperature", 100.5), ("temperature", "hot"),
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", None),
    ("temperature", True),
    ("top_p", 0), ("top_p", -0.1), ("top_p", 1.01), ("top_p", float("nan")), ("top_p", "1"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("top_k", False),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", [0.1]),
    ("seed", 1.0), ("seed", True), ("seed", "42"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 10.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", {"a"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]),
    ("stop_token_ids", 5), ("stop_token_ids", "12"),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("include_stop_str_in_output", 0),
    ("skip_special_tokens", None), ("spaces_between_special_tokens", 1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", "x"),
    ("frequency_penalty", -3), ("frequency_penalty", 2.0001),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 101),
    ("repetition_penalty", float("nan")),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [2.0]),
    ("allowed_token_ids", 7), ("allowed_token_ids", [True]),
    ("bad_words", [""]), ("bad_words", "  "), ("bad_words", ["ok", None]), ("bad_words", 3),
    ("bad_words", ["w"] * 1025),
    ("structured_outputs", "json"), ("structured_outputs", {}),
    ("structured_outputs", {"regex": 5}), ("structured_outputs", {"choice": "a"}),
    ("structured_outputs", {"choice": [1]}), ("structured_outputs", {"json": 3}),
    ("structured_outputs", {"json_object": False}),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("structured_outputs", {"json_object": True, "disable_any_whitespace": 1}),
    ("structured_outputs", {"structural_tag": "{}"}),
    ("structured_outputs", {"grammar": "a", "whitespace_pattern": 3}),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as excinfo:
        kwargs: dict[str, Any] = {field: value}
        SamplingParams(**kwargs)
    # The message says what would have been accepted, not only that something is wrong.
    assert "must" in str(excinfo.value)


def test_range_is_in_the_message() -> None:
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 100\], got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_unknown_field_and_positional_arguments_are_rejected() -> None:
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[call-arg]


def test_clone_validates_and_copies_lists() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[7], seed=3)
    q = p.clone(temperature=0.0)
    assert q.is_greedy and q.stop == ["x"] and q.seed == 3
    q.stop.append("y")
    assert p.stop == ["x"]
    with pytest.raises(ValueError, match="temperature"):
        p.clone(temperature=-1.0)
    assert dataclasses.replace(p, n=3).n == 3


def test_from_optional_takes_none_for_the_default() -> None:
    """vLLM's from_optional: a request's None means the default for the fields that take
    no None themselves, and JSON's string keys of logit_bias are token ids."""
    p = SamplingParams.from_optional(
        n=None, presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
        temperature=None, top_p=None, max_tokens=None, seed=None,
        logit_bias={"12": 5, 3: -1.5, "7": -1e9})
    assert (p.n, p.temperature, p.top_p, p.repetition_penalty) == (1, 1.0, 1.0, 1.0)
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    assert p.max_tokens is None and p.seed is None
    assert p.logit_bias == {12: 5.0, 3: -1.5, 7: -100.0}  # clamped, as vLLM's server does
    assert SamplingParams.from_optional(temperature=0.5, top_k=4) == SamplingParams(
        temperature=0.5, top_k=4)
    with pytest.raises(ValueError, match="logit_bias keys must be token ids.*'x'"):
        SamplingParams.from_optional(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="logit_bias keys.*-3"):
        SamplingParams.from_optional(logit_bias={"-3": 1})
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams.from_optional(top_k=None)


def test_for_child() -> None:
    parent = SamplingParams(n=4, seed=10, temperature=0.5)
    children = [parent.for_child(i) for i in range(parent.n)]
    assert [c.n for c in children] == [1] * 4
    assert [c.seed for c in children] == [10, 11, 12, 13]
    assert all(c.temperature == 0.5 for c in children)
    assert SamplingParams(n=2).for_child(1).seed is None


def reals(low: float, high: float, *, exclude_min: bool = False) -> st.SearchStrategy[float]:
    return st.floats(low, high, exclude_min=exclude_min, allow_nan=False, allow_infinity=False)


@given(
    n=st.integers(1, 128),
    temperature=reals(0, 100),
    top_p=reals(0, 1, exclude_min=True),
    top_k=st.integers(-1, 10**6),
    min_p=reals(0, 1),
    seed=st.none() | st.integers(-(2**70), 2**70),
    max_tokens=st.none() | st.integers(1, 10**6),
    presence_penalty=reals(-2, 2),
    frequency_penalty=reals(-2, 2),
    repetition_penalty=reals(0, 100, exclude_min=True),
    logprobs=st.none() | st.integers(0, 20),
    stop=st.none() | st.text(min_size=1) | st.lists(st.text(min_size=1), max_size=4),
    stop_token_ids=st.lists(st.integers(0, 2**31), max_size=4),
    data=st.data(),
)
def test_valid_values_are_kept(
    n: int, temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
    max_tokens: int | None, presence_penalty: float, frequency_penalty: float,
    repetition_penalty: float, logprobs: int | None, stop: str | list[str] | None,
    stop_token_ids: list[int], data: st.DataObject,
) -> None:
    min_tokens = data.draw(st.integers(0, max_tokens if max_tokens is not None else 10**6))
    p = SamplingParams(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
        max_tokens=max_tokens, min_tokens=min_tokens, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
        logprobs=logprobs, stop=stop, stop_token_ids=stop_token_ids,
    )
    assert (p.n, p.temperature, p.top_p, p.min_p, p.seed) == (
        n, temperature, top_p, min_p, None if seed == -1 else seed)
    assert p.top_k == max(top_k, 0)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (max_tokens, min_tokens, logprobs)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        presence_penalty, frequency_penalty, repetition_penalty)
    expected_stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    assert p.stop == expected_stop and p.stop_token_ids == stop_token_ids
    assert p.clone() == p


def test_detokenize_false_refuses_stop_strings() -> None:
    assert SamplingParams(detokenize=False, stop_token_ids=[2]).detokenize is False
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop="x")
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("keep", "max_tokens", "expected"), [
    (None, 1, [1, 2, 3, 4, 5]), (2, 1, [4, 5]), (4, 1, [2, 3, 4, 5]),
    (-1, None, [3, 4, 5]), (-1, 2, [4, 5]), (-1, 3, [5])])
def test_truncate_prompt_tokens_keeps_the_last_tokens(keep: int | None, max_tokens: int | None,
                                                      expected: list[int]) -> None:
    """-1 keeps as many as leave room for max_tokens in max_model_len (4 here)."""
    params = SamplingParams(truncate_prompt_tokens=keep, max_tokens=max_tokens)
    assert params.truncate([1, 2, 3, 4, 5], max_model_len=4) == expected
    assert params.clone(n=2).truncate_prompt_tokens == keep


def test_truncate_to_nothing_is_refused() -> None:
    """A budget as large as the context leaves no prompt: refused (vLLM refuses it too),
    not a prompt cut to one token."""
    params = SamplingParams(truncate_prompt_tokens=-1, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens \\(4\\) leaves none"):
        params.truncate([1, 2, 3, 4, 5], max_model_len=4)


def test_truncate_past_the_context_is_refused() -> None:
    """As vLLM refuses it: such a setting cuts nothing, so the request would run on a
    prompt the client meant to cut."""
    params = SamplingParams(truncate_prompt_tokens=5)
    assert params.truncate([1, 2, 3], max_model_len=5) == [1, 2, 3]
    with pytest.raises(ValueError, match="truncate_prompt_tokens \\(5\\) is larger than the "
                                         "model's context \\(4 tokens\\)"):
        params.truncate([1, 2, 3], max_model_len=4)


@pytest.mark.parametrize("keep", [0, -2, 1.5, True])
def test_truncate_prompt_tokens_range(keep: object) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=keep)  # type: ignore[arg-type]
