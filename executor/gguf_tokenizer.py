"""A GGUF file's tokenizer and chat template, built from its metadata (tokenizer.ggml.* and
tokenizer.chat_template) by transformers' own GGUF tokenizer conversion, so that a batch file of
chat requests runs with the GGUF file alone."""

from __future__ import annotations

import sys
from pathlib import Path

from hrm.gguf_file import read_gguf


def gguf_tokenizer(path: Path):
    """The file's tokenizer; None where its metadata holds none or one transformers cannot
    build (then prompts are token ids, and a text prompt is refused for want of a tokenizer).

    transformers' AutoTokenizer reads only the GGUF architectures its models cover (not
    deepseek2 or glm4moe); the tokenizer class itself builds from the metadata for any."""
    path = Path(path)
    if "tokenizer.ggml.model" not in read_gguf(path).metadata:
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except (OSError, ValueError, KeyError, IndexError) as exc:  # the run goes on with ids
        print(
            f"hrm: {path}: no tokenizer can be built from its metadata ({exc!r}); prompts must "
            "be token ids",
            file=sys.stderr,
        )
        return None
