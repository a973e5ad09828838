"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

A prefix is only reused when requests agree on its tokens, so the first question when a
hit rate is low is "what tokens does this request become?". /tokenize answers it with the
very code the generation endpoints use: `prompt` is encoded as completions encode it, and
`messages` rendered as chat completions render them.
"""

from __future__ import annotations

from typing import Any

from pagellm.entrypoints.openai.errors import bad_request
from pagellm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.serving import ServerContext, encode
from pagellm.entrypoints.openai.serving_chat import check_rendering, render_messages
from pagellm.entrypoints.openai.tool_calls import function_schemas


def _token_ids(context: ServerContext, body: TokenizeRequest) -> list[int]:
    """Runs on the tokenizer thread: a long prompt takes as long as it would to serve."""
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return encode(context.engine.tokenizer, body.prompt, "prompt", add_special)
    return render_messages(context, body)


def _check(body: TokenizeRequest) -> None:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt (text, as for completions) or "
                          "messages (a conversation, as for chat completions)",
                          param="prompt" if body.messages is None else "messages")
    if body.messages is not None:
        check_rendering(body)
    if body.tools:
        function_schemas(body.tools)  # checked as chat checks them: the same 400s


async def tokenize(context: ServerContext, body: TokenizeRequest) -> TokenizeResponse:
    context.check_model(body.model)
    _check(body)
    token_ids = await context.off_loop(_token_ids, context, body)
    token_strs = None
    if body.return_token_strs:
        token_strs = [str(piece) for piece in
                      context.engine.tokenizer.convert_ids_to_tokens(token_ids)]
    return TokenizeResponse(count=len(token_ids), max_model_len=context.engine.max_model_len,
                            tokens=token_ids, token_strs=token_strs)


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's GET /tokenizer_info: what the tokenizer was configured with (its
    tokenizer_config.json, special tokens as their text), its class and the chat
    template the server renders with (the --chat-template one, if given), from which a
    client such as lm-evaluation-harness tokenizes through /tokenize and renders chats
    itself. Paths on the server mean nothing to a client and are left out."""
    config = {key: _json_value(value) for key, value in tokenizer.init_kwargs.items()
              if not key.endswith("_file") and key != "name_or_path"}
    # The added tokens as tokenizer_config.json writes them, id: {"content", "special",
    # ...}, which vLLM's tests of this endpoint read.
    added = tokenizer.init_kwargs.get("added_tokens_decoder")
    if isinstance(added, dict):
        config["added_tokens_decoder"] = {str(index): _added_token(token)
                                          for index, token in added.items()}
    config["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        config["chat_template"] = tokenizer.chat_template
    return config


def _added_token(token: Any) -> dict[str, Any]:
    if isinstance(token, dict):
        return token
    return {field: getattr(token, field) for field in
            ("content", "single_word", "lstrip", "rstrip", "normalized", "special")}


def _json_value(value: Any) -> Any:
    """A configuration value as JSON: an added token as its text."""
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return getattr(value, "content", str(value))


async def detokenize(context: ServerContext, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids, special tokens included (as vLLM decodes them)."""
    context.check_model(body.model)
    vocab = context.engine.vocab_size
    for token in body.tokens:
        if not 0 <= token < vocab:
            raise bad_request(f"tokens must be token ids in [0, {vocab}), got {token}",
                              param="tokens")
    text = await context.off_loop(context.engine.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=str(text))
