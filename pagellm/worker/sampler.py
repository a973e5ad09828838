"""Turns one step's logits into one token per sampling request.

Order of operations (as in vLLM), for logits[N, vocab] with one row per request:

0. logit_bias: each request's {token id: bias} added to its logits;
1. penalties: repetition (over prompt + generated tokens), then frequency and presence
   (over generated tokens only);
2. structured output: tokens that would leave the request's format get -inf;
   allowed_token_ids: every other token gets -inf;
   min_tokens: EOS and the request's stop token ids get -inf until enough tokens exist;
   bad_words: a bad word's last token gets -inf where the tokens before it were the
   last ones generated. A row these leave with no token gets its allowed tokens back,
   and if it still has none, its format's (the format is the hardest rule: it wins over
   min_tokens, bad words and allowed_token_ids);
3. logprobs are taken here, as log_softmax of these logits: the model's distribution
   with the request's own rules applied, but *before* temperature and min-p/top-k/top-p.
   That makes a reported logprob depend only on the model, the prompt and the tokens so
   far, not on the sampling knobs, so a greedy and a temperature-1.2 request score the
   same text the same; it is also the distribution a greedy request takes its argmax of;
4. greedy rows take the argmax of these logits (lowest id on ties, like torch.argmax);
5. other rows: temperature, min-p, then top-k and top-p over what min-p left (vLLM's
   order: min-p is one of its logits processors, run before its top-k/top-p sampler),
   then one draw.

Draws use the exponential race, argmax(p_i / E_i) with E_i ~ Exp(1), which picks i with
probability p_i. A seeded request draws its E from its own generator, so its tokens do
not depend on which other requests share the batch, or in which order; unseeded rows
share one batched draw from torch's default generator.

Everything is vectorised over the batch and the vocabulary; the only Python loops are
per request (building the metadata, seeded draws, formatting logprobs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagellm.model import cpu_kernels

if TYPE_CHECKING:
    # Type-only: at run time the worker reads a few attributes of the params, so it
    # does not import core/ (see the layer table in DESIGN.md).
    from pagellm.core.sampling_params import SamplingParams

_SEED_MODULUS = 2**64


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator a seeded request keeps for its whole life (create once, reuse), and
    the one an engine draws its unseeded rows from.

    Any int is accepted: torch seeds are 64-bit, so the seed is reduced modulo 2**64
    (which is also what torch does with a negative seed).
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % _SEED_MODULUS)
    return generator


def _token_index(
    rows: Sequence[int], token_lists: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattens per-row token lists into (row, token id) pairs for scatter/index_put."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.long)
    row_index = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)),
                             dtype=torch.long)
    return row_index.to(device), token_ids.to(device)


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for N rows, as tensors on the logits' device.

    Built by `from_requests`. Optional tensors are None when no row of the step needs
    that stage, so a plain greedy or plain temperature batch skips it entirely.

    - temperature[N] (float32): 1.0 on greedy rows (never used there).
    - greedy_rows / random_rows (int64): row indices of each kind.
    - top_k[N] (int64, 0 = off), top_p[N] (float32, 1 = off), min_p[N] (float32, 0 = off).
    - generators: position in random_rows -> that seeded request's generator.
    - generator: the engine's own, for every unseeded random row (None: torch's global
      one). The engine keeps its own so that it neither resets the user's torch random
      stream nor has its draws moved by the user's torch code.
    - penalty_rows[P] (int64): rows with any penalty; the three penalty tensors are [P].
    - prompt_tokens / output_tokens: (position in penalty_rows, token id) pairs; prompt
      tokens are listed only for rows with a repetition penalty, the only one using them.
    - allowed_tokens: the rows limited to allowed_token_ids, and their (row, token id)
      pairs; every other token of those rows gets -inf.
    - blocked_tokens: (row, token id) pairs that min_tokens or bad_words forbid this step.
    - format_tokens: the rows under structured output, and [rows, vocab] bool of the
      tokens each row's format allows next.
    - logit_bias: (row, token id) pairs and the bias added to each.
    - num_logprobs[N]: the request's `logprobs` (None = not wanted).
    """

    num_rows: int
    temperature: torch.Tensor
    greedy_rows: torch.Tensor
    random_rows: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    generator: torch.Generator | None
    penalty_rows: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    prompt_tokens: tuple[torch.Tensor, torch.Tensor] | None
    output_tokens: tuple[torch.Tensor, torch.Tensor] | None
    allowed_tokens: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None
    blocked_tokens: tuple[torch.Tensor, torch.Tensor] | None
    format_tokens: tuple[torch.Tensor, torch.Tensor] | None
    num_logprobs: list[int | None]
    logit_bias: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None

    @property
    def all_greedy(self) -> bool:
        return self.random_rows.numel() == 0

    @property
    def all_random(self) -> bool:
        return self.greedy_rows.numel() == 0

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        *,
        eos_token_ids: Sequence[int] = (),
        bad_words: Sequence[BadWords | None] | None = None,
        format_tokens: tuple[Sequence[int], torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """Builds the metadata of one step; row i of the logits belongs to request i.

        `output_token_ids` are the tokens the request generated so far (not counting the
        one about to be sampled); they drive the penalties and min_tokens.
        `generators[i]` must be the request's own `make_generator(seed)` when it has a
        seed (kept by the caller across steps), else None. `eos_token_ids` are blocked
        with the stop token ids until min_tokens is reached, unless ignore_eos is set.
        `bad_words[i]` is what request i must not generate (the engine tokenizes its
        `bad_words`); None when no request has any. `format_tokens` is (rows, [rows,
        vocab] bool): the tokens structured output allows each of those rows next.
        `generator` draws for the rows without a seed.
        """
        num_rows = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows):
            raise ValueError(
                "params, prompt_token_ids, output_token_ids and generators must have one "
                f"entry per row, got {num_rows}, {len(prompt_token_ids)}, "
                f"{len(output_token_ids)}, {len(generators)}")
        dev = torch.device(device)

        temperature: list[float] = []
        greedy_rows: list[int] = []
        random_rows: list[int] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        seeded_generators: dict[int, torch.Generator] = {}
        penalty_rows: list[int] = []
        allowed_rows: list[int] = []
        allowed_lists: list[list[int]] = []
        blocked_rows: list[int] = []
        blocked_lists: list[list[int]] = []
        bias_rows: list[int] = []
        bias_lists: list[list[int]] = []
        bias_values: list[float] = []
        for row, p in enumerate(params):
            if p.logit_bias:
                bias_rows.append(row)
                bias_lists.append(list(p.logit_bias))
                bias_values.extend(p.logit_bias.values())
            if p.is_greedy:
                greedy_rows.append(row)
                temperature.append(1.0)
                top_k.append(0)
                top_p.append(1.0)
                min_p.append(0.0)
            else:
                random_rows.append(row)
                temperature.append(p.temperature)
                # Any k >= vocab keeps everything; capping keeps huge values within int64.
                top_k.append(min(p.top_k, 2**62))
                top_p.append(p.top_p)
                min_p.append(p.min_p)
                if p.seed is not None:
                    own = generators[row]
                    if own is None:
                        raise ValueError(
                            f"row {row} has seed={p.seed} but no generator: keep one "
                            "make_generator(seed) per request across steps")
                    seeded_generators[len(random_rows) - 1] = own
            if p.has_penalties:
                penalty_rows.append(row)
            if p.allowed_token_ids is not None:
                allowed_rows.append(row)
                allowed_lists.append(p.allowed_token_ids)
            blocked: list[int] = []
            if len(output_token_ids[row]) < p.min_tokens:
                blocked.extend(p.stop_token_ids)
                if not p.ignore_eos:
                    blocked.extend(eos_token_ids)
            words = bad_words[row] if bad_words is not None else None
            if words is not None:
                blocked.extend(words.bans(output_token_ids[row]))
            if blocked:
                blocked_rows.append(row)
                blocked_lists.append(blocked)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        repetition: torch.Tensor | None = None
        presence: torch.Tensor | None = None
        frequency: torch.Tensor | None = None
        prompt_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        output_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
        if penalty_rows:
            pen = [params[row] for row in penalty_rows]
            repetition = floats([p.repetition_penalty for p in pen])
            presence = floats([p.presence_penalty for p in pen])
            frequency = floats([p.frequency_penalty for p in pen])
            output_tokens = _token_index(
                range(len(pen)), [output_token_ids[row] for row in penalty_rows], dev)
            repeat = [i for i, p in enumerate(pen) if p.repetition_penalty != 1.0]
            prompt_tokens = _token_index(
                repeat, [prompt_token_ids[penalty_rows[i]] for i in repeat], dev)

        return cls(
            num_rows=num_rows,
            temperature=floats(temperature),
            greedy_rows=longs(greedy_rows),
            random_rows=longs(random_rows),
            top_k=longs(top_k) if any(k > 0 for k in top_k) else None,
            top_p=floats(top_p) if any(p < 1.0 for p in top_p) else None,
            min_p=floats(min_p) if any(p > 0.0 for p in min_p) else None,
            generators=seeded_generators,
            generator=generator,
            penalty_rows=longs(penalty_rows) if penalty_rows else None,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            allowed_tokens=((longs(allowed_rows), _token_index(allowed_rows, allowed_lists, dev))
                            if allowed_rows else None),
            blocked_tokens=_token_index(blocked_rows, blocked_lists, dev) if blocked_rows else None,
            format_tokens=(None if format_tokens is None else
                           (longs(list(format_tokens[0])), format_tokens[1].to(dev))),
            num_logprobs=[p.logprobs for p in params],
            logit_bias=((_token_index(bias_rows, bias_lists, dev), floats(bias_values))
                        if bias_rows else None),
        )


@dataclass(frozen=True)
class BadWords:
    """One request's bad words as token sequences, indexed so that a step looks up only
    the tokens just generated: one-token words are banned outright, a longer word's last
    token wherever the tokens before it were the last ones generated. Only generated
    tokens count, as in vLLM: the prompt may say the word."""

    always: frozenset[int]
    after: dict[tuple[int, ...], list[int]]
    prefix_lengths: tuple[int, ...]

    @classmethod
    def from_token_ids(cls, words: Sequence[Sequence[int]]) -> BadWords:
        always = {word[-1] for word in words if len(word) == 1}
        after: dict[tuple[int, ...], list[int]] = {}
        for word in words:
            if len(word) > 1:
                after.setdefault(tuple(word[:-1]), []).append(word[-1])
        return cls(frozenset(always), after, tuple(sorted({len(key) for key in after})))

    def bans(self, generated: Sequence[int]) -> list[int]:
        """The tokens that would complete a bad word if generated now."""
        banned = list(self.always)
        for length in self.prefix_lengths:
            if length > len(generated):
                break
            banned.extend(self.after.get(tuple(generated[len(generated) - length:]), ()))
        return banned


@dataclass
class TokenLogprobs:
    """Logprobs at one step of one request (see the module docstring for which ones).

    rank is 1 + the number of tokens strictly more likely than the sampled one;
    top_logprobs holds the request's `logprobs` most likely (token id, logprob) pairs,
    most likely first. A token blocked by min_tokens has logprob -inf.
    """

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One token per row; logprobs[i] is None where row i did not ask for logprobs."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Applies the three penalties in place, on the penalised rows only.

    Working on the P penalised rows keeps the [P, vocab] count table small when only a
    few requests of a large batch use penalties.
    """
    assert md.penalty_rows is not None and md.output_tokens is not None
    assert md.prompt_tokens is not None and md.repetition_penalty is not None
    assert md.presence_penalty is not None and md.frequency_penalty is not None
    rows = logits[md.penalty_rows]
    counts = torch.zeros_like(rows)
    counts.index_put_(md.output_tokens, torch.ones_like(md.output_tokens[1], dtype=rows.dtype),
                      accumulate=True)
    seen = counts > 0
    seen[md.prompt_tokens] = True
    # Hugging Face's rule: a repeated token's logit moves towards "less likely" whatever
    # its sign (divide a positive logit, multiply a negative one).
    rep = md.repetition_penalty.unsqueeze(1)
    rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
    rows -= md.frequency_penalty.unsqueeze(1) * counts
    rows -= md.presence_penalty.unsqueeze(1) * (counts > 0).to(rows.dtype)
    logits[md.penalty_rows] = rows


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks everything outside each row's top-k, then outside its top-p nucleus.

    Top-k keeps every token whose logit is at least the k-th largest, so tokens tied
    with the k-th all stay (vLLM's and transformers' rule; bit-identical logits happen,
    e.g. for a model's duplicate untrained embedding rows). Top-p keeps the smallest
    prefix of one stable descending sort whose mass reaches p (renormalised over the
    top-k survivors), ties cut like argmax cuts them (lowest id first), and always at
    least the top token, so a tiny top_p reduces to exactly the greedy token.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = sorted_logits.gather(-1, (k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 are left alone: rounding could otherwise push the running
        # sum to 1 before the tail and drop tokens that should stay possible.
        outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _sample_random(logits: torch.Tensor, rows: torch.Tensor, md: SamplingMetadata
                   ) -> torch.Tensor:
    """Samples one token for each of `rows` (non-greedy rows); `logits` holds just them."""
    logits = logits / md.temperature[rows].unsqueeze(1)
    if md.min_p is not None:
        # Before top-k and top-p, as vLLM orders them (transformers' warpers put min-p
        # last): top-p's nucleus is taken over what min-p leaves, renormalised.
        # p_i < min_p * p_max  <=>  logit_i < max_logit + log(min_p); log(0) = -inf
        # turns the test off for rows without min_p.
        floor = logits.amax(dim=-1, keepdim=True) + md.min_p[rows].log().unsqueeze(1)
        logits.masked_fill_(logits < floor, float("-inf"))
    top_k = None if md.top_k is None else md.top_k[rows]
    top_p = None if md.top_p is None else md.top_p[rows]
    if top_k is not None or top_p is not None:
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs)
    if len(md.generators) < race.shape[0]:
        race.exponential_(generator=md.generator)
    for position, generator in md.generators.items():
        race[position].exponential_(generator=generator)
    # A zero draw would turn a masked token's 0/0 into NaN, which argmax would pick.
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return _argmax_rows(probs / race)


def _collect_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
                      ) -> list[TokenLogprobs | None]:
    wanted = [row for row, k in enumerate(num_logprobs) if k is not None]
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    if not wanted:
        return result
    index = torch.tensor(wanted, dtype=torch.long, device=logprobs.device)
    rows = logprobs[index]
    tokens = sampled[index]
    token_logprob = rows.gather(1, tokens.unsqueeze(1))
    ranks = (rows > token_logprob).sum(dim=-1) + 1
    max_k = min(max(num_logprobs[row] or 0 for row in wanted), rows.shape[-1])
    top_values, top_ids = rows.topk(max_k, dim=-1)
    token_list: list[int] = tokens.tolist()
    logprob_list: list[float] = token_logprob.squeeze(1).tolist()
    rank_list: list[int] = ranks.tolist()
    top_value_list: list[list[float]] = top_values.tolist()
    top_id_list: list[list[int]] = top_ids.tolist()
    for i, row in enumerate(wanted):
        k = num_logprobs[row] or 0
        result[row] = TokenLogprobs(
            token_id=token_list[i],
            logprob=logprob_list[i],
            rank=rank_list[i],
            top_logprobs=list(zip(top_id_list[i][:k], top_value_list[i][:k], strict=True)),
        )
    return result


def score_tokens(logits: torch.Tensor, targets: list[int], num_top: int
                 ) -> list[TokenLogprobs]:
    """Prompt logprobs: each row's log-probability of its target token, with its rank
    and the `num_top` most likely tokens, from the model's raw distribution (no sampling
    knob applies to a prompt)."""
    index = torch.tensor(targets, dtype=torch.long, device=logits.device)
    scored = _collect_logprobs(logits.log_softmax(dim=-1), index,
                               [num_top] * len(targets))
    return [entry for entry in scored if entry is not None]


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax by torch.argmax's rules (lowest id on ties): through the compiled
    kernel where it is loaded (torch's CPU argmax takes ~0.9 ms on [32, 49152] logits, the
    kernel ~0.1), else torch."""
    if cpu_kernels.loaded() and logits.device.type == "cpu" and logits.is_contiguous():
        greedy: torch.Tensor = torch.ops.pagellm.argmax_rows(logits)
        return greedy
    return logits.argmax(dim=-1)


def _restore_emptied_rows(logits: torch.Tensor, rows: torch.Tensor, before: torch.Tensor
                          ) -> None:
    """Rows of `rows` left with no token to sample (all -inf) get their logits from
    `before` back. The rules that only forbid (bad words, EOS before min_tokens) give way
    to the ones that define what may be written at all (allowed_token_ids, a format):
    a row sampling from nothing would take token 0."""
    emptied = torch.isneginf(logits[rows]).all(dim=-1)
    logits[rows[emptied]] = before[emptied]


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """Picks one token per row of `logits` [N, vocab]; the input tensor is not modified."""
    if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
        raise ValueError(
            f"logits must be [{metadata.num_rows}, vocab], got {list(logits.shape)}")
    # A copy only where rows are changed in place (the caller's tensor is left alone).
    edits = (metadata.penalty_rows is not None or metadata.blocked_tokens is not None
             or metadata.logit_bias is not None or metadata.allowed_tokens is not None
             or metadata.format_tokens is not None)
    logits = logits.to(torch.float32, copy=edits)
    if metadata.logit_bias is not None:
        index, bias = metadata.logit_bias
        logits.index_put_(index, bias, accumulate=True)
    if metadata.penalty_rows is not None:
        _apply_penalties(logits, metadata)
    # Each row's logits under the rules that define what may be written, for
    # _restore_emptied_rows: (rows, their logits) after the format, then after
    # allowed_token_ids, restored in the opposite order, so the format wins last.
    defining: list[tuple[torch.Tensor, torch.Tensor]] = []
    if metadata.format_tokens is not None:
        rows, allowed = metadata.format_tokens
        formatted = logits[rows].masked_fill_(~allowed, float("-inf"))
        logits[rows] = formatted
        defining.append((rows, formatted))
    if metadata.allowed_tokens is not None:
        rows, pairs = metadata.allowed_tokens
        kept = logits[pairs]
        logits[rows] = float("-inf")
        logits[pairs] = kept
        defining.append((rows, logits[rows]))
    if metadata.blocked_tokens is not None:
        logits[metadata.blocked_tokens] = float("-inf")
    if metadata.blocked_tokens is not None or len(defining) > 1:
        for rows, before in reversed(defining):
            _restore_emptied_rows(logits, rows, before)
    wants_logprobs = any(k is not None for k in metadata.num_logprobs)
    logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None

    if metadata.all_random:
        sampled = _sample_random(logits, metadata.random_rows, metadata)
    else:
        sampled = _argmax_rows(logits)
        if not metadata.all_greedy:
            rows = metadata.random_rows
            sampled[rows] = _sample_random(logits[rows], rows, metadata)

    return SamplerOutput(
        sampled_token_ids=sampled.tolist(),
        logprobs=(_collect_logprobs(logprobs, sampled, metadata.num_logprobs)
                  if logprobs is not None else [None] * metadata.num_rows),
    )
