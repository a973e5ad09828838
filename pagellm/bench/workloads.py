"""Seeded workload generators: the prompts every contender of a comparison is given.

Prompts are token ids cut from the model's own tokenizer output, so a requested length
is an exact token count, and every contender sees the very same ids (text would be
re-tokenized differently by each). The multi-turn workload is the exception that cannot
be fixed in advance: each turn's prompt contains the previous answers, so it is a script
(system prompt and user messages) that `ConversationState` turns into prompts as the
answers come in.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagellm.bench.text import TextGenerator

WORKLOAD_NAMES = ("shared-prefix", "multi-turn", "few-shot", "eviction", "no-sharing")


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workloads use."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class ConversationScript:
    """What the simulated user of one conversation says, turn by turn."""

    system: str
    user_messages: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    """Either flat `prompts` (sent all at once, or at an arrival rate) or `conversations`
    (sent turn by turn). `kv_cache_tokens` asks the engines for a pool of that many tokens
    (the eviction workload); None leaves the engines' defaults."""

    name: str
    params: dict[str, Any]
    output_len: int
    prompts: tuple[tuple[int, ...], ...] = ()
    conversations: tuple[ConversationScript, ...] = ()
    kv_cache_tokens: int | None = None

    @property
    def is_multi_turn(self) -> bool:
        return bool(self.conversations)

    @property
    def num_requests(self) -> int:
        if self.is_multi_turn:
            return sum(len(c.user_messages) for c in self.conversations)
        return len(self.prompts)


def chat_token_ids(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The model's chat template applied with a generation prompt, as plain token ids
    (transformers returns a list or an encoding depending on version)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(token) for token in ids]


@dataclass
class ConversationState:
    """One conversation in flight: the messages so far, and the next turn's prompt.

    Answers are recorded as text and re-rendered through the chat template, exactly as a
    chat client resends history, so the cache only helps as far as that re-rendering
    reproduces the tokens the engine saw before.
    """

    script: ConversationScript
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "system", "content": self.script.system}]

    @property
    def done(self) -> bool:
        return self.turn >= len(self.script.user_messages)

    def next_prompt(self, tokenizer: Tokenizer) -> list[int]:
        """The whole conversation so far plus the next user message."""
        user = {"role": "user", "content": self.script.user_messages[self.turn]}
        return chat_token_ids(tokenizer, [*self.messages, user])

    def record_answer(self, answer: str) -> None:
        self.messages.append({"role": "user", "content": self.script.user_messages[self.turn]})
        self.messages.append({"role": "assistant", "content": answer})
        self.turn += 1


def text_token_ids(gen: TextGenerator, tokenizer: Tokenizer, num_tokens: int) -> list[int]:
    """Exactly `num_tokens` ids of fresh prose: paragraphs are added until the text is
    long enough, then the ids are cut (cutting ids, not text, is what makes it exact).

    The text is encoded whole only once its paragraphs' separate counts come within a
    few tokens of `num_tokens` (with the default model's tokenizer their sum is the
    whole's exactly, a space starting a word; were it off, the ids would still be
    `num_tokens` of the same prose): encoding it whole after every paragraph made a long
    prompt quadratic (8,000 tokens 1.3 s, 100,000 minutes), for the same ids."""
    if num_tokens < 1:
        raise ValueError(f"a token count must be positive, got {num_tokens}")
    paragraphs = [gen.paragraph()]
    estimate = len(tokenizer.encode(paragraphs[0], add_special_tokens=False))
    while True:
        if estimate >= num_tokens - 16:
            ids = tokenizer.encode(" ".join(paragraphs), add_special_tokens=False)
            if len(ids) >= num_tokens:
                return list(ids[:num_tokens])
        paragraphs.append(gen.paragraph())
        estimate += len(tokenizer.encode(" " + paragraphs[-1], add_special_tokens=False))


def text_of_tokens(gen: TextGenerator, tokenizer: Tokenizer, num_tokens: int) -> str:
    """Prose of about `num_tokens` tokens, as text (for chat messages, which are text),
    ending at the last full sentence so a message never stops mid-word."""
    text = tokenizer.decode(text_token_ids(gen, tokenizer, num_tokens),
                            skip_special_tokens=True).strip()
    end = text.rfind(".")
    return text[: end + 1] if end > 0 else text


def shared_prefix(tokenizer: Tokenizer, seed: int = 0, num_requests: int = 32,
                  prefix_len: int = 1024, suffix_len: int = 32,
                  output_len: int = 32) -> Workload:
    """N requests = one shared prefix of P tokens + a distinct suffix of S tokens: a long
    system prompt or document asked many questions, the case prefix caching is for."""
    gen = TextGenerator(seed)
    prefix = text_token_ids(gen, tokenizer, prefix_len)
    prompts = tuple(tuple(prefix + text_token_ids(gen, tokenizer, suffix_len))
                    for _ in range(num_requests))
    return Workload("shared-prefix", dict(num_requests=num_requests, prefix_len=prefix_len,
                                          suffix_len=suffix_len, output_len=output_len),
                    output_len, prompts=prompts)


def multi_turn(tokenizer: Tokenizer, seed: int = 0, num_conversations: int = 8,
               num_turns: int = 4, system_len: int = 256, user_len: int = 64,
               output_len: int = 32) -> Workload:
    """C conversations x T turns. All conversations share one system prompt (as users of
    one deployment do); each turn resends the whole conversation, so turn t+1 starts
    with turn t's prompt and answer."""
    gen = TextGenerator(seed)
    system = "You are a helpful assistant. " + text_of_tokens(gen, tokenizer, system_len)
    conversations = tuple(
        ConversationScript(system, tuple(
            f"{text_of_tokens(gen, tokenizer, user_len)} {gen.question()}"
            for _ in range(num_turns)))
        for _ in range(num_conversations))
    return Workload("multi-turn", dict(num_conversations=num_conversations,
                                       num_turns=num_turns, system_len=system_len,
                                       user_len=user_len, output_len=output_len),
                    output_len, conversations=conversations)


def few_shot(tokenizer: Tokenizer, seed: int = 0, num_requests: int = 32,
             num_examples: int = 16, output_len: int = 32) -> Workload:
    """A fixed instruction and worked examples, then a new question: the prefix is the
    same for every request, and only the question differs."""
    gen = TextGenerator(seed)
    preamble = ("Answer each question in two sentences, in the style of the examples.\n\n"
                + "".join(f"Question: {gen.question()}\nAnswer: {gen.answer()}\n\n"
                          for _ in range(num_examples)))
    prefix = tokenizer.encode(preamble, add_special_tokens=False)
    prompts = tuple(
        tuple(prefix + tokenizer.encode(f"Question: {gen.question()}\nAnswer:",
                                        add_special_tokens=False))
        for _ in range(num_requests))
    return Workload("few-shot", dict(num_requests=num_requests, num_examples=num_examples,
                                     prefix_len=len(prefix), output_len=output_len),
                    output_len, prompts=prompts)


def eviction(tokenizer: Tokenizer, seed: int = 0, num_requests: int = 48,
             num_prefixes: int = 12, prefix_len: int = 512, suffix_len: int = 32,
             output_len: int = 32, zipf_s: float = 1.1) -> Workload:
    """Requests over several shared prefixes whose total is more than twice the KV pool.

    Prefixes are drawn from a seeded Zipf distribution, as real traffic is skewed: hot
    prefixes should stay cached while cold ones are evicted and recomputed, so the run
    measures whether eviction keeps the right blocks. The pool is a third of the prefixes'
    total, but never smaller than what four requests need at once.
    """
    gen = TextGenerator(seed)
    prefixes = [text_token_ids(gen, tokenizer, prefix_len) for _ in range(num_prefixes)]
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(num_prefixes)]
    choices = gen.rng.choices(range(num_prefixes), weights=weights, k=num_requests)
    prompts = tuple(tuple(prefixes[c] + text_token_ids(gen, tokenizer, suffix_len))
                    for c in choices)
    request_tokens = prefix_len + suffix_len + output_len
    pool = max(num_prefixes * prefix_len // 3, 4 * request_tokens)
    return Workload("eviction", dict(num_requests=num_requests, num_prefixes=num_prefixes,
                                     prefix_len=prefix_len, suffix_len=suffix_len,
                                     output_len=output_len, zipf_s=zipf_s,
                                     kv_cache_tokens=pool),
                    output_len, prompts=prompts, kv_cache_tokens=pool)


def no_sharing(tokenizer: Tokenizer, seed: int = 0, num_requests: int = 32,
               prompt_len: int = 1056, output_len: int = 32) -> Workload:
    """Unrelated prompts: caching can only cost here (hashing, lookups), never help.

    Each prompt opens with its own numbered heading, so no two share even a first block.
    """
    gen = TextGenerator(seed)
    prompts = []
    for index in range(num_requests):
        heading = tokenizer.encode(f"Record {index + 1} of {gen.rng.randrange(10**6)}. ",
                                   add_special_tokens=False)
        body = text_token_ids(gen, tokenizer, max(prompt_len - len(heading), 1))
        prompts.append(tuple((heading + body)[:prompt_len]))
    return Workload("no-sharing", dict(num_requests=num_requests, prompt_len=prompt_len,
                                       output_len=output_len),
                    output_len, prompts=tuple(prompts))


GENERATORS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "eviction": eviction,
    "no-sharing": no_sharing,
}


def default_params(name: str) -> dict[str, Any]:
    """The named workload's default sizes: the ones the issue's targets are stated for."""
    return {key: parameter.default
            for key, parameter in inspect.signature(GENERATORS[name]).parameters.items()
            if key not in ("tokenizer", "seed")}


def build_workload(name: str, tokenizer: Tokenizer, seed: int = 0, **params: Any) -> Workload:
    """The named workload; `params` are its generator's keyword arguments.

    None means "the generator's default", so a CLI can pass every option it has; a value
    the workload has no use for is an error rather than silently ignored.
    """
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    generator = GENERATORS[name]
    accepted = inspect.signature(generator).parameters
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"workload {name!r} does not take {', '.join(unknown)}; it takes "
                         f"{', '.join(p for p in accepted if p not in ('tokenizer', 'seed'))}")
    return generator(tokenizer, seed=seed, **given)
