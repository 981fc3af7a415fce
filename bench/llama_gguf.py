"""A bf16 GGUF of a random checkpoint, for bench_cpu_peers.py's llama.cpp rows.

llama.cpp's own convert_hf_to_gguf.py converts; it needs a tokenizer, which a random checkpoint
lacks. One is trained here (a small byte-level BPE, the `tokenizers` library transformers
brings) and saved beside the weights; the converter pads the vocabulary to the model's size.
The converter names a BPE tokenizer's pre-tokenizer by a hash of how it splits a test text, and a
fresh vocabulary matches no known hash, so the conversion runs through this file, which names it
"qwen2" where the hash is unknown (the benchmark feeds token ids; the text side is never used).

    PYTHON bench/llama_gguf.py LLAMA_CPP_TREE HF_DIR OUT.gguf
"""

from __future__ import annotations

import logging
import os
import random
import runpy
import subprocess
import sys
from pathlib import Path

FALLBACK_PRE = "qwen2"


def llama_cpp_tree(binary: str) -> Path:
    """The llama.cpp source tree a built binary sits in (build/bin/...): the one holding
    convert_hf_to_gguf.py."""
    for parent in Path(binary).resolve().parents:
        if (parent / "convert_hf_to_gguf.py").is_file():
            return parent
    print(f"bench_cpu_peers: --llama-batched-bench {binary}: not inside a llama.cpp tree with "
          "convert_hf_to_gguf.py", file=sys.stderr)  # fmt: skip
    raise SystemExit(2)


def save_tokenizer(directory: Path, vocab: int = 1024) -> None:
    """A byte-level BPE of `vocab` tokens trained on made-up words, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnoprstuvw") for _ in range(rng.randint(2, 9)))
             for _ in range(4000)]  # fmt: skip
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(4000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)


def convert_to_gguf(python: str, tree: Path, checkpoint: Path, out: Path) -> Path:
    """`checkpoint` (given a tokenizer) as a bf16 GGUF at `out`, converted by `python`."""
    save_tokenizer(checkpoint)
    done = subprocess.run(
        [python, __file__, str(tree), str(checkpoint), str(out)], capture_output=True, text=True
    )
    if done.returncode != 0 or not out.is_file():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"bench_cpu_peers: converting {checkpoint.name} to GGUF with {python} failed: {tail}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return out


def _convert(tree: str, checkpoint: str, out: str) -> None:
    """Run the tree's converter on `checkpoint`, an unknown pre-tokenizer hash named qwen2."""
    sys.path[:0] = [tree, os.path.join(tree, "gguf-py")]
    from conversion.base import TextModel  # the module the converter's classes come from

    known = TextModel.get_vocab_base_pre

    def named(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            logging.warning("unknown pre-tokenizer hash: named %s", FALLBACK_PRE)
            return FALLBACK_PRE

    TextModel.get_vocab_base_pre = named
    script = os.path.join(tree, "convert_hf_to_gguf.py")
    sys.argv = [script, checkpoint, "--outtype", "bf16", "--outfile", out]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _convert(*sys.argv[1:4])
