"""The model's generation_config.json gives the defaults of unset sampling options (vLLM's
`generation_config`): "auto" reads the model's, "vllm" keeps the engine's own, a folder
reads that folder's, and `override_generation_config` lays keys over either."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.config import EngineConfig
from pagellm.engine.generation_config import sampling_defaults
from tests.engine.conftest import assert_idle, make_tiny_model

RECOMMENDED = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
               "max_new_tokens": 5, "do_sample": True, "eos_token_id": 1}


@pytest.fixture(scope="module")
def model_with_defaults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("genconf") / "llama")
    (path / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return path


def _llm(model: Path, **options: object) -> LLM:
    return LLM(str(model), skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
               **options)  # type: ignore[arg-type]


def test_sampling_defaults_take_the_sampling_keys_under_sampling_params_names() -> None:
    assert sampling_defaults(RECOMMENDED) == {
        "temperature": 0.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
        "max_tokens": 5}
    assert sampling_defaults({"temperature": None, "bos_token_id": 0}) == {}
    assert sampling_defaults({"presence_penalty": 0.5, "frequency_penalty": 0.2,
                              "min_p": 0.05}) == {
        "presence_penalty": 0.5, "frequency_penalty": 0.2, "min_p": 0.05}


def test_the_models_defaults_apply_where_no_sampling_params_are_given(
        model_with_defaults: Path) -> None:
    llm = _llm(model_with_defaults)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty,
            defaults.max_tokens) == (0.0, 0.9, 20, 1.1, 5)
    prompt = {"prompt_token_ids": [5, 9, 11, 40, 2]}
    implicit = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    explicit = llm.generate(prompt, SamplingParams(
        temperature=0.0, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=5),
        use_tqdm=False)[0].outputs[0]
    assert implicit.token_ids == explicit.token_ids
    assert 1 <= len(implicit.token_ids) <= 5
    # Given params are the caller's whole choice: nothing of the defaults is mixed in.
    neutral = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=9,
                                                  ignore_eos=True), use_tqdm=False)
    assert len(neutral[0].outputs[0].token_ids) == 9
    engine = llm.llm_engine
    engine.add_request("no-params", prompt)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_default_sampling_params().max_tokens == 5
    assert_idle(engine)


def test_vllm_keeps_the_engines_own_defaults(model_with_defaults: Path) -> None:
    defaults = _llm(model_with_defaults, generation_config="vllm").get_default_sampling_params()
    plain = SamplingParams()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (
        plain.temperature, plain.top_p, plain.top_k, plain.max_tokens)


def test_a_folder_and_an_override(model_with_defaults: Path, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    llm = _llm(model_with_defaults, generation_config=str(tmp_path),
               override_generation_config={"max_new_tokens": 3, "top_k": 0})
    assert llm.llm_engine.generation_defaults.sampling == {"temperature": 0.7, "top_k": 0,
                                                           "max_tokens": 3}
    over_auto = _llm(model_with_defaults, override_generation_config={"temperature": 0.5})
    assert over_auto.get_default_sampling_params().temperature == 0.5
    assert over_auto.get_default_sampling_params().top_k == 20
    # A null in the override removes the model's value.
    cleared = _llm(model_with_defaults, override_generation_config={"top_k": None})
    assert cleared.get_default_sampling_params().top_k == SamplingParams().top_k


def test_an_operators_max_new_tokens_limits_every_server_request(
        model_with_defaults: Path, tmp_path: Path) -> None:
    """vLLM's server caps max_tokens at a chosen folder's or the override's
    max_new_tokens; the model's own is only a default."""
    assert _llm(model_with_defaults).llm_engine.generation_defaults.max_tokens_limit is None
    overridden = _llm(model_with_defaults, override_generation_config={"max_new_tokens": 9})
    assert overridden.llm_engine.generation_defaults.max_tokens_limit == 9
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    folder = _llm(model_with_defaults, generation_config=str(tmp_path))
    assert folder.llm_engine.generation_defaults.max_tokens_limit == 7
    # Offline, as in vLLM's LLM, it is a default only: given params are used as they are.
    output = folder.generate({"prompt_token_ids": [5, 9, 11]}, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 10


def test_bad_generation_configs_fail_at_start_naming_the_problem(
        model_with_defaults: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generation_config: no generation_config.json in"):
        _llm(model_with_defaults, generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="override_generation_config: temperature = -1 "
                                         "cannot be a default .*temperature"):
        _llm(model_with_defaults, override_generation_config={"temperature": -1})
    with pytest.raises(ValueError, match="override_generation_config: max_new_tokens = 0 "
                                         "cannot be a default"):
        _llm(model_with_defaults, override_generation_config={"max_new_tokens": 0})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text('{"top_k": 20.5}')
    with pytest.raises(ValueError, match=r"bad/generation_config.json: top_k = 20.5 cannot"):
        _llm(model_with_defaults, generation_config=str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="override_generation_config: do_sample, max_tokens "
                                         "set no default; it takes temperature, .*max_new_tokens"
                                         r" \(the generation config's name for max_tokens"):
        EngineConfig(override_generation_config={"max_tokens": 5, "do_sample": False})
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineConfig(generation_config="")
    with pytest.raises(ValueError, match="override_generation_config must be"):
        EngineConfig(override_generation_config=[("temperature", 0.5)])  # type: ignore[arg-type]
