"""A request's prompt as the token ids its vLLM node computes, for `kv_aware` routing (the
index matches them against the blocks each node holds).

Per model, `[[models.available]] tokenizer = "DIR"` names a local model directory
(`controlplane.infrastructure.tokenizer_files`). A chat request's messages are rendered with the
model's chat template as transformers' `apply_chat_template` renders them (jinja2's immutable
sandbox, `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, `raise_exception`,
`strftime_now` and a `tojson` that keeps non-ASCII text; the special tokens of
tokenizer_config.json and the request's `add_generation_prompt` and `chat_template_kwargs`
given to the template), then tokenized without adding special tokens, as vLLM tokenizes a
chat's rendered prompt (the template writes them); a completion's prompt is tokenized with
them (vLLM's default for completions), and token ids given as the prompt are taken as they are.
A content given as parts is its text parts joined by newlines (vLLM's "string" content format).
A request that names its own template, continues its final message, or that the template
refuses has no tokens: the policy then falls back for it (`controlplane.rules.policies`).

`tokenizers` and jinja2 rather than transformers: transformers' fast tokenizer is this same
`tokenizers` Tokenizer loaded from the same tokenizer.json, and its `apply_chat_template` this
same jinja2 rendering, so the tokens are the same; transformers itself would add a large package
(and its imports) to every gateway process for two calls.

Bounded and off the event loop: a rendered prompt longer than MAX_PROMPT_CHARACTERS is cut
there, at the last whitespace before it (a token never spans one), so only its first blocks are
matched; tokenizing runs in worker threads (at most TOKENIZING_THREADS at once); the tokens of
the last CACHED_PROMPTS prompts are kept, keyed by a digest of the model's directory and the
request's prompt (its messages or prompt as sent, and the options that change the rendering),
so a prompt seen again (a retry) costs a digest on the trio thread. And a rendered chat is
tokenized piece by piece between its special tokens (the template's role markers and ends of
turn), the pieces of recent chats kept (CACHED_PIECE_TOKENS), so a conversation's next turn, or
another conversation under the same system prompt, tokenizes only its new pieces; `tokenizers`
itself cuts a text at its special tokens first, so the tokens are the whole text's (where they
would not be, `_special_splitter` says why, the whole text is tokenized). `tokenizers` is asked
for the ids alone (`encode_batch_fast`, which leaves out each token's offsets in the text: routing
never reads them, and computing them is a good part of `encode`'s work). No network: every file is
the directory's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import msgspec
import trio
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from controlplane.infrastructure.small_files import read_small_file
from controlplane.infrastructure.tokenizer_files import (
    MAX_TOKENIZER_BYTES,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TokenizerFiles,
    read_tokenizer_directory,
)

MAX_PROMPT_CHARACTERS = 256 * 1024
"""Characters of a rendered prompt (or a completion's prompt) tokenized; the rest is not matched."""
CACHED_PROMPTS = 256
"""Prompts whose tokens a process keeps, the least recently asked forgotten first."""
CACHED_PIECE_TOKENS = 1_000_000
"""Tokens of the pieces of recent chats kept per tokenizer (4 bytes each)."""
LOADED_TOKENIZERS = 8
"""Tokenizer directories a process keeps loaded (a reload may name others)."""
TOKENIZING_THREADS = 2

CHAT_PATH = "/v1/chat/completions"


class _Chat(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Any = None
    chat_template_kwargs: msgspec.Raw = msgspec.Raw(b"")


class _Completion(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.Raw(b"")


_decode_chat = msgspec.json.Decoder(_Chat).decode
_decode_completion = msgspec.json.Decoder(_Completion).decode


class ModelTokenizer:
    """One tokenizer directory, loaded: its `tokenizers` Tokenizer and its compiled chat template."""

    def __init__(self, files: TokenizerFiles) -> None:
        text = read_small_file(files.tokenizer_json, MAX_TOKENIZER_BYTES, "a tokenizer.json").decode("utf-8")
        try:
            self._tokenizer = Tokenizer.from_str(text)
            self._template = _compile(files.chat_template) if files.chat_template else None
        except Exception as error:  # tokenizers raises Exception itself; jinja2 its TemplateSyntaxError
            raise ValueError(f"{files.tokenizer_json}: {type(error).__name__}: {error}") from None
        self._special_tokens = files.special_tokens
        self._splitter = _special_splitter(json.loads(text))
        """The special tokens a rendered chat is cut at, with their ids; None when pieces between
        them would not be tokenized as the whole is (`_special_splitter`)."""
        self._pieces = _Pieces()

    def chat_tokens(self, messages: list[Any], add_generation_prompt: bool, kwargs: dict[str, Any]) -> list[int] | None:
        """The tokens of a chat's rendered prompt; None when the model has no template."""
        if self._template is None:
            return None
        chat = [_with_text_content(message) for message in messages]
        rendered = self._template.render(
            **{**kwargs, **self._special_tokens, "messages": chat, "add_generation_prompt": add_generation_prompt}
        )
        rendered = _capped(rendered)
        if self._splitter is None:
            return self._encode(rendered, add_special_tokens=False)
        pattern, ids = self._splitter
        tokens: list[int] = []
        for index, piece in enumerate(pattern.split(rendered)):
            if index % 2:
                tokens.append(ids[piece])
            elif piece:
                tokens += self._piece_tokens(piece)
        return tokens

    def _piece_tokens(self, piece: str) -> array:
        """The tokens of the text between two special tokens, tokenized once while recent."""
        key = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        tokens = self._pieces.get(key)
        if tokens is None:
            tokens = array("I", self._encode(piece, add_special_tokens=False))
            self._pieces.put(key, tokens)
        return tokens

    def completion_tokens(self, prompt: str) -> list[int]:
        return self._encode(_capped(prompt), add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of `text` (`encode_batch_fast` on a batch of one: no offsets, see the module's doc)."""
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _compile(template: str) -> jinja2.Template:
    """The chat template compiled as transformers compiles it (`apply_chat_template`)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def _special_splitter(tokenizer_json: dict[str, Any]) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """A pattern cutting a rendered chat at its special tokens, and their ids, when tokenizing
    the pieces between them one by one gives the tokens of the whole: `tokenizers` cuts a text at
    its added tokens before anything else and pre-tokenizes each piece on its own, so with a
    byte-level pre-tokenizer, no normalizer, and special tokens that match exactly (not
    normalized, no stripping, no whole-word rule, none inside another added token) it does. Else
    None: the whole text is tokenized each time (a Metaspace pre-tokenizer, as Llama 2's, treats
    the text's first piece apart)."""
    if tokenizer_json.get("normalizer") is not None or not _byte_level(tokenizer_json.get("pre_tokenizer")):
        return None
    added = [token for token in tokenizer_json.get("added_tokens") or [] if isinstance(token, dict)]
    special = {
        token["content"]: token["id"]
        for token in added
        if token.get("special") and isinstance(token.get("content"), str) and token["content"]
        and not any(token.get(key) for key in ("normalized", "lstrip", "rstrip", "single_word"))
    }  # fmt: skip
    contents = [token.get("content") for token in added if isinstance(token.get("content"), str)]
    if not special or any(inside in other and inside != other for inside in special for other in contents):
        return None
    alternatives = sorted(special, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")"), special


def _byte_level(pre_tokenizer: Any) -> bool:
    """A byte-level pre-tokenizer (GPT-2's, Llama 3's and Qwen's: splits by patterns, then bytes)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "Sequence":
        steps = pre_tokenizer.get("pretokenizers") or []
        kinds = [step.get("type") for step in steps if isinstance(step, dict)]
        return len(kinds) == len(steps) and kinds.count("ByteLevel") == 1 and set(kinds) <= {"Split", "ByteLevel"}
    return pre_tokenizer.get("type") == "ByteLevel"


class _Pieces:
    """The tokens of recent pieces of rendered chats (a system prompt, an earlier turn), by a
    digest of their text, the least recently used forgotten first past CACHED_PIECE_TOKENS;
    shared by the tokenizing threads."""

    def __init__(self) -> None:
        self._tokens: OrderedDict[bytes, array] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> array | None:
        with self._lock:
            tokens = self._tokens.get(key)
            if tokens is not None:
                self._tokens.move_to_end(key)
            return tokens

    def put(self, key: bytes, tokens: array) -> None:
        with self._lock:
            if key in self._tokens or len(tokens) > CACHED_PIECE_TOKENS:
                return
            self._tokens[key] = tokens
            self._held += len(tokens)
            while self._held > CACHED_PIECE_TOKENS:
                self._held -= len(self._tokens.popitem(last=False)[1])


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _with_text_content(message: Any) -> Any:
    """A message whose content is given as parts, with the text of its text parts instead,
    joined by newlines (vLLM's "string" content format)."""
    if isinstance(message, dict) and isinstance(message.get("content"), list):
        texts = [part.get("text") for part in message["content"] if isinstance(part, dict)]
        return {**message, "content": "\n".join(text for text in texts if isinstance(text, str))}
    return message


def _capped(text: str) -> str:
    """`text`, or its first MAX_PROMPT_CHARACTERS cut back to the last whitespace among them."""
    if len(text) <= MAX_PROMPT_CHARACTERS:
        return text
    cut = text[:MAX_PROMPT_CHARACTERS]
    end = max(cut.rfind(" "), cut.rfind("\n"))
    return cut[:end] if end > 0 else cut


class TokenizerUnusable(Exception):
    """A tokenizer directory that does not load (its files changed since the config was checked:
    gone, or not a tokenizer `tokenizers` reads, or a template jinja2 cannot compile)."""


class PromptTokens:
    """A process's tokenizing for `kv_aware`: each model directory loaded on first use (in a
    worker thread), the tokens of recent prompts, and the threads that tokenize. A directory
    that does not load gives no tokens (the policy falls back), and is told to `warn` once."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._recent: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._limiter = trio.CapacityLimiter(TOKENIZING_THREADS)
        self._loaded: OrderedDict[tuple[str, int, int], ModelTokenizer | TokenizerUnusable] = OrderedDict()
        self._loading = threading.Lock()
        self._warn = warn
        self._warned: set[str] = set()
        """The directories whose failure to load was told (the config's: bounded)."""

    async def tokens(self, directory: str, path: str, body: bytes) -> tuple[int, ...] | None:
        """The token ids of the request's prompt under the tokenizer of `directory` (None: the
        body has no prompt we tokenize, or the template refused it)."""
        try:
            if path == CHAT_PATH:
                chat = _decode_chat(body)
                if chat.chat_template is not None or chat.continue_final_message or not chat.messages:
                    return None
                options = b"1" if chat.add_generation_prompt else b"0"
                prompt = bytes(chat.messages) + b"\0" + options + bytes(chat.chat_template_kwargs)
            else:
                prompt = bytes(_decode_completion(body).prompt)
                if not prompt:
                    return None
        except msgspec.DecodeError:
            return None
        named = f"{directory}\0{path}\0".encode("utf-8", "surrogatepass")
        key = hashlib.blake2b(named + prompt, digest_size=16).digest()
        recent = self._recent
        tokens = recent.get(key)
        if tokens is not None:
            recent.move_to_end(key)
            return tokens
        try:
            tokens = await trio.to_thread.run_sync(self._tokenize, directory, path, body, limiter=self._limiter)
        except TokenizerUnusable as error:
            if directory not in self._warned:
                self._warned.add(directory)
                self._warn(str(error))
            return None
        if tokens is not None:
            recent[key] = tokens
            if len(recent) > CACHED_PROMPTS:
                recent.popitem(last=False)
        return tokens

    def _tokenize(self, directory: str, path: str, body: bytes) -> tuple[int, ...] | None:
        """In a worker thread: the tokens of the body's prompt (the tokenizer loaded first if need be)."""
        try:
            tokenizer = self._tokenizer(directory)
            if path == CHAT_PATH:
                chat = _decode_chat(body)
                messages = msgspec.json.decode(chat.messages)
                kwargs = msgspec.json.decode(chat.chat_template_kwargs) if chat.chat_template_kwargs else {}
                if not isinstance(messages, list) or not isinstance(kwargs, dict):
                    return None
                tokens = tokenizer.chat_tokens(messages, chat.add_generation_prompt, kwargs)
            else:
                tokens = _completion_tokens(tokenizer, msgspec.json.decode(_decode_completion(body).prompt))
        except (msgspec.DecodeError, jinja2.TemplateError, TypeError, ValueError):
            return None  # a prompt the node would refuse too: no tokens, the policy falls back
        return tuple(tokens) if tokens is not None else None

    def _tokenizer(self, directory: str) -> ModelTokenizer:
        """The directory's tokenizer, loaded again when its files changed (a reload, a new model);
        TokenizerUnusable when it does not load (kept, so it is not read again for each request)."""
        files = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
        try:
            key = (directory, *(os.stat(os.path.join(directory, name)).st_mtime_ns for name in files))
        except OSError as error:
            raise TokenizerUnusable(f"tokenizer {directory}: {error}") from None
        with self._loading:
            tokenizer = self._loaded.get(key)
            if tokenizer is None:
                try:
                    tokenizer = ModelTokenizer(read_tokenizer_directory(directory))
                except (ValueError, OSError) as error:
                    tokenizer = TokenizerUnusable(f"tokenizer {directory}: {error}")
                self._loaded[key] = tokenizer
                if len(self._loaded) > LOADED_TOKENIZERS:
                    self._loaded.popitem(last=False)
            self._loaded.move_to_end(key)
        if isinstance(tokenizer, TokenizerUnusable):
            raise TokenizerUnusable(*tokenizer.args)
        return tokenizer


def _completion_tokens(tokenizer: ModelTokenizer, prompt: Any) -> list[int] | None:
    """A completion's prompt: text tokenized, token ids as given (a batch: its first prompt, the
    one whose blocks the node computes first)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.completion_tokens(prompt)
    if isinstance(prompt, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
        return prompt[:MAX_PROMPT_CHARACTERS]
    return None
