"""kvcache/tokenizer.py: a request's prompt as the token ids vLLM computes for it, from a real
tokenizer directory (`fixtures.tokenizer_dir`), rendered and tokenized in worker threads."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from fixtures.tokenizer_dir import BOS, write_tokenizer_dir
from kvcache.tokenizer import CACHED_PROMPTS, MAX_PROMPT_CHARACTERS, PromptTokens

CHAT = "/v1/chat/completions"
COMPLETION = "/v1/completions"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Grüße 😀"}]


def unexpected_warning(message: str) -> None:
    raise AssertionError(f"warned: {message}")


def body(**members) -> bytes:
    return msgspec.json.encode({"model": "m", **members})


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return write_tokenizer_dir(tmp_path / "tok")


def adding_bos(directory: Path) -> Tokenizer:
    """The directory's tokenizer made to add the bos token itself, as Llama's does: a chat's
    template writes it too, so a chat must not get it twice."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos)])
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


async def test_a_chat_is_rendered_with_the_models_template_and_tokenized_without_special_tokens_twice(directory):
    tokenizer = adding_bos(directory)
    tokens = await PromptTokens(unexpected_warning).tokens(str(directory), CHAT, body(messages=MESSAGES))
    rendered = "<s><|system|>\nYou are a helpful assistant.</s>\n<|user|>\nGrüße 😀</s>\n<|assistant|>\n"
    assert tokens == tuple(tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert tokens.count(tokenizer.token_to_id(BOS)) == 1
    without_generation = await PromptTokens(unexpected_warning).tokens(
        str(directory), CHAT, body(messages=MESSAGES, add_generation_prompt=False)
    )
    decoded = tokenizer.decode(list(without_generation), skip_special_tokens=False)
    assert decoded == rendered.removesuffix("<|assistant|>\n")


async def test_a_completions_prompt_is_tokenized_as_is_with_special_tokens(directory):
    tokenizer = adding_bos(directory)
    prompts = PromptTokens(unexpected_warning)
    text = "The quick brown fox jumps over the lazy dog."
    tokens = await prompts.tokens(str(directory), COMPLETION, body(prompt=text))
    assert tokens == tuple(tokenizer.encode(text).ids) and tokens[0] == tokenizer.token_to_id(BOS)
    batch = body(prompt=[text, "other"])
    assert await prompts.tokens(str(directory), COMPLETION, batch) == tokens  # a batch: its first prompt
    assert await prompts.tokens(str(directory), COMPLETION, body(prompt=[5, 6, 7])) == (5, 6, 7)  # token ids as given


async def test_content_parts_are_their_text_joined_by_newlines(directory):
    prompts = PromptTokens(unexpected_warning)
    content = [{"type": "text", "text": "one"}, {"type": "image_url"}, {"type": "text", "text": "two"}]
    parts = [{"role": "user", "content": content}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    assert await prompts.tokens(str(directory), CHAT, body(messages=parts)) == await prompts.tokens(
        str(directory), CHAT, body(messages=joined)
    )


async def test_a_prompt_the_gateway_cannot_tokenize_has_no_tokens(directory):
    prompts = PromptTokens(unexpected_warning)
    assert await prompts.tokens(str(directory), CHAT, b"not json") is None
    assert await prompts.tokens(str(directory), CHAT, body(messages="a string")) is None
    assert await prompts.tokens(str(directory), CHAT, body(messages=MESSAGES, chat_template="{{ 1 }}")) is None
    assert await prompts.tokens(str(directory), CHAT, body(messages=MESSAGES, continue_final_message=True)) is None
    assert await prompts.tokens(str(directory), COMPLETION, body(prompt={"a": 1})) is None
    assert await prompts.tokens(str(directory), COMPLETION, body()) is None
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert await PromptTokens(unexpected_warning).tokens(str(directory), CHAT, body(messages=MESSAGES)) is None
    del config["chat_template"]  # a model without a template: vLLM refuses its chats too
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert await PromptTokens(unexpected_warning).tokens(str(directory), CHAT, body(messages=MESSAGES)) is None


async def test_a_directory_that_no_longer_loads_gives_no_tokens_and_is_told_once(directory):
    warnings: list[str] = []
    prompts = PromptTokens(warnings.append)
    (directory / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    for question in ("one", "two"):
        assert await prompts.tokens(str(directory), COMPLETION, body(prompt=question)) is None
    assert len(warnings) == 1 and str(directory / "tokenizer.json") in warnings[0]
    write_tokenizer_dir(directory)  # mended: loaded again, its files being new
    assert await prompts.tokens(str(directory), COMPLETION, body(prompt="three"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).unlink()
    assert await prompts.tokens(str(directory), COMPLETION, body(prompt="four")) is None
    assert len(warnings) == 1  # told once per directory


async def test_a_long_prompt_is_cut_at_the_cap_on_a_whitespace(directory):
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    words = "lighthouse keeper " * (MAX_PROMPT_CHARACTERS // 18 + 100)
    tokens = await PromptTokens(unexpected_warning).tokens(str(directory), COMPLETION, body(prompt=words))
    text = tokenizer.decode(list(tokens))
    assert len(text) <= MAX_PROMPT_CHARACTERS and words.startswith(text) and text.endswith("keeper")


async def test_recent_prompts_tokens_are_kept_and_the_least_recent_forgotten(directory):
    warnings: list[str] = []
    prompts = PromptTokens(warnings.append)
    first = await prompts.tokens(str(directory), COMPLETION, body(prompt="prompt 0"))
    # Kept: the directory's files gone, the same prompt still has its tokens, in another body.
    (directory / "tokenizer.json").rename(directory / "moved.json")
    assert await prompts.tokens(str(directory), COMPLETION, body(prompt="prompt 0", max_tokens=3)) == first
    (directory / "moved.json").rename(directory / "tokenizer.json")
    for index in range(1, CACHED_PROMPTS + 1):
        await prompts.tokens(str(directory), COMPLETION, body(prompt=f"prompt {index}"))
    (directory / "tokenizer.json").rename(directory / "moved.json")
    assert await prompts.tokens(str(directory), COMPLETION, body(prompt="prompt 0")) is None  # forgotten
    assert await prompts.tokens(str(directory), COMPLETION, body(prompt=f"prompt {CACHED_PROMPTS}")) is not None
    assert len(warnings) == 1  # the directory without its tokenizer.json, when the forgotten prompt needed it


async def test_tokenizing_runs_off_the_event_loop(directory):
    """While a thread tokenizes, the trio thread goes on: a task started alongside runs its
    turns before the tokens come back."""
    prompts = PromptTokens(unexpected_warning)
    turns = 0
    done = trio.Event()

    async def count_turns() -> None:
        nonlocal turns
        while not done.is_set():
            turns += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(count_turns)
        await prompts.tokens(str(directory), COMPLETION, body(prompt="lighthouse " * 20_000))
        done.set()
    assert turns > 1


TEXTS = st.lists(st.sampled_from([*"ab ü\n😀.,", "</s>", "<s>", "<|user|>", " the", "sea"]), max_size=20).map("".join)


@settings(max_examples=60, deadline=None)
@given(chat=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), TEXTS), min_size=1, max_size=5))
def test_a_chat_tokenized_piece_by_piece_is_tokenized_as_a_whole(chat):
    """Recent pieces between special tokens are kept and reused; the tokens are the whole
    rendered text's, special tokens written by a client included."""
    directory = shared_directory()
    messages = [{"role": role, "content": content} for role, content in chat]
    tokens = trio.run(PromptTokens(unexpected_warning).tokens, str(directory), CHAT, body(messages=messages))
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rendered = "<s>" + "".join(f"<|{role}|>\n{content}</s>\n" for role, content in chat) + "<|assistant|>\n"
    assert tokens == tuple(tokenizer.encode(rendered, add_special_tokens=False).ids)


_SHARED: list[Path] = []


def shared_directory() -> Path:
    """One tokenizer directory for every example of a property test."""
    if not _SHARED:
        _SHARED.append(write_tokenizer_dir(Path(tempfile.mkdtemp(prefix="tokenizer-"))))
    return _SHARED[0]


async def test_a_tokenizer_that_treats_the_first_piece_apart_is_tokenized_whole(tmp_path):
    """A Metaspace pre-tokenizer (Llama 2's) marks only the text's first piece as a word's start:
    pieces between special tokens tokenized alone would differ, so the whole text is tokenized."""
    directory = write_tokenizer_dir(tmp_path / "tok")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials)
    tokenizer.train_from_iterator(["the sea and the wind", "a lighthouse keeper"] * 20, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    messages = [{"role": "user", "content": "the sea"}, {"role": "assistant", "content": "the wind"}]
    tokens = await PromptTokens(unexpected_warning).tokens(str(directory), CHAT, body(messages=messages))
    rendered = "<s><|user|>\nthe sea</s>\n<|assistant|>\nthe wind</s>\n<|assistant|>\n"
    assert tokens == tuple(tokenizer.encode(rendered, add_special_tokens=False).ids)
    pieces = [tokenizer.encode(piece, add_special_tokens=False).ids for piece in ("\nthe sea", "\nthe wind")]
    assert pieces[0] + pieces[1] != [t for t in tokens if t > 4]  # tokenized piece by piece, they would differ
