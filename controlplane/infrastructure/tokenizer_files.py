"""A model's tokenizer directory (`[[models.available]] tokenizer`), read as transformers and
vLLM read a model directory from the Hub: `tokenizer.json` (the `tokenizers` library's file) and
`tokenizer_config.json` (its `chat_template`, or a `chat_template.jinja` beside it, and the
special tokens the template may use). The loader checks a directory with it, and each process
reads it with it when it first tokenizes for the model (`kvcache.tokenizer`); both open the
files without blocking and bounded (`small_files`)."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

from controlplane.infrastructure.small_files import check_small_file, read_small_file

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
"""A model's tokenizer.json (the large vocabularies' are tens of MiB)."""
MAX_TOKENIZER_CONFIG_BYTES = 4 * 1024 * 1024
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
"""The special tokens a chat template may name, as transformers hands them to it."""


class TokenizerFiles(NamedTuple):
    """What a tokenizer directory holds, read and checked."""

    tokenizer_json: str
    """The path of tokenizer.json (loaded by `kvcache.tokenizer`)."""
    chat_template: str
    """The default chat template; "" when the model has none (its chat requests are not tokenized)."""
    special_tokens: dict[str, str]
    """SPECIAL_TOKEN_KEYS the config sets, each as its text."""


def read_tokenizer_directory(directory: str) -> TokenizerFiles:
    """The files of `directory`, checked; ValueError naming the file and what is wrong with it."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory} is not a directory (a model's tokenizer directory holds {TOKENIZER_FILE} "
                         f"and {TOKENIZER_CONFIG_FILE})")  # fmt: skip
    tokenizer_json = os.path.join(directory, TOKENIZER_FILE)
    config_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    for path in (tokenizer_json, config_path):
        if not os.path.exists(path):
            raise ValueError(f"{path} is missing (a model's tokenizer directory holds {TOKENIZER_FILE} "
                             f"and {TOKENIZER_CONFIG_FILE})")  # fmt: skip
    try:
        check_small_file(tokenizer_json, MAX_TOKENIZER_BYTES, "a tokenizer.json")
        config = json.loads(read_small_file(config_path, MAX_TOKENIZER_CONFIG_BYTES, "a tokenizer_config.json"))
    except OSError as error:
        raise ValueError(f"reading {error.filename or directory}: {error.strerror or error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path}: not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: not a JSON object")
    template = _chat_template(config.get("chat_template"), config_path)
    template_path = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if not template and os.path.exists(template_path):
        try:
            template = read_small_file(template_path, MAX_TOKENIZER_CONFIG_BYTES, "a chat template").decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"reading {template_path}: {error}") from None
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # transformers' AddedToken, saved as its fields
            value = value.get("content")
        if isinstance(value, str):
            special[key] = value
        elif value is not None:
            raise ValueError(f"{config_path}: {key} must be a string or an object with a content string")
    return TokenizerFiles(tokenizer_json, template, special)


def _chat_template(value: object, config_path: str) -> str:
    """`chat_template` as transformers reads it: a string, or a list of named templates of which
    the one named `default` is used."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return entry["template"]
        return ""
    raise ValueError(f"{config_path}: chat_template must be a string or a list of named templates")
