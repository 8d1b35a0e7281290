"""fixtures/tokenizer_dir.py: the small tokenizer directory the KV-event tests, the demo and the
bench share: real files that `tokenizers` and jinja2 load, the same bytes on every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from fixtures.tokenizer_dir import write_tokenizer_dir

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def test_the_directory_loads_and_a_chat_renders_and_tokenizes_back(tmp_path):
    directory = write_tokenizer_dir(tmp_path / "tok")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(config["chat_template"])
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Grüße 😀"}]
    prompt = template.render(
        messages=messages, add_generation_prompt=True, bos_token=config["bos_token"], eos_token=config["eos_token"]
    )
    assert prompt.startswith("<s><|system|>\n") and prompt.endswith("<|assistant|>\n")
    ids = tokenizer.encode(prompt).ids
    assert ids[0] == tokenizer.token_to_id("<s>")
    assert ids[:2] == tokenizer.encode(prompt, add_special_tokens=False).ids[:2]  # the template brings the bos
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    assert 256 < tokenizer.get_vocab_size() < 1000


def test_the_command_line_writes_the_same_bytes_as_the_function(tmp_path):
    write_tokenizer_dir(tmp_path / "a")
    subprocess.run([sys.executable, "-m", "fixtures.tokenizer_dir", str(tmp_path / "b")], cwd=PROJECT_ROOT, check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
