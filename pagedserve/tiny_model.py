"""Build a tiny random-weight Llama-family (or mixture-of-experts) checkpoint and a byte-level
BPE tokenizer, offline.

`make_tiny_model(out_dir, ...)` writes a directory that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load without network access:

    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Contract:
- The same arguments give byte-identical files (weights, config, tokenizer). Nothing depends on the
  global torch RNG, the clock, or hash randomisation.
- Every parameter is random: linear weights, embeddings and biases ~ N(0, init_std); RMSNorm weights
  ~ 1 + N(0, 0.1), so a runtime that drops a bias or a norm weight produces different tokens.
- The tokenizer is trained on `pagedserve/data/tiny_corpus.txt`; ids 0, 1, 2 are `<s>` (bos),
  `</s>` (eos) and `<pad>`, then the 256 byte symbols, then merges up to `vocab` entries. Single
  sequences get `<s>` prepended.

NOTE: init_std=0.1 keeps greedy decoding away from near-ties, so token-for-token comparisons against
transformers do not flip on float rounding. Measured with `top_logit_gaps()` on the default llama
config (fp32, random prompts of 16 ids, 32 greedy steps each), the top-1 minus top-2 logit gap was:
  8 prompts (256 steps):   median 0.176, min 8.6e-4 (1 step below 1e-3, 15 below 1e-2)
  32 prompts (1024 steps): median 0.182, min 7.5e-4 (0.4% of steps below 1e-3, 3.6% below 1e-2)
A larger std widens the gap but amplifies rounding faster than it widens it: the fp32-vs-fp64 logit
error grows from 3.8e-6 (std 0.1) to 1.6e-4 (std 0.5) while the min gap only reaches 2.2e-3, so 0.1
keeps the widest margin (~200x) for fp32 comparisons. In bf16 no std helps: bf16 compute differs
from fp64 by up to ~0.07 in the logits at std 0.1 and flips ~2% of greedy steps, so bf16 checks
need a tolerance (or a tie-aware comparison), not token equality over long generations.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "phi3", "gemma2", "gemma3",
    "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
GEMMA_ARCHS = ("gemma2", "gemma3")
# the archs `sliding_window` applies to
WINDOWED_ARCHS = ("mistral", "qwen3", "phi3", *GEMMA_ARCHS, "mixtral", "qwen2_moe")
# The mixtures of experts: 8 experts, 2 per token; Qwen's experts have a quarter of
# `intermediate` features (Qwen2-MoE's shared expert all of them), Mixtral's all of them
NUM_EXPERTS, EXPERTS_PER_TOKEN = 8, 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # trained first, in this order, so their ids are:
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
ROPE_THETA = 10_000.0
NORM_STD = 0.1
NUM_BYTE_SYMBOLS = 256
# NOTE: none of them 1.0 (nor the attention's 1 / sqrt(head_dim)), so a runtime that drops or
# misplaces one produces other logits (real Granite 3 checkpoints: 12, 0.22, 1/128, 8 or 16)
GRANITE_MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.15,
    "logits_scaling": 8.0,
}  # fmt: skip
# NOTE: Phi-4-mini's: rope rotates 3/4 of each head (12 of 16 dims here)
PHI3_PARTIAL_ROTARY_FACTOR = 0.75
# NOTE: Gemma's own values, each unlike the one a runtime falling back to Llama's would use:
# a window the test prompts cross, a scale that is not 1 / sqrt(head_dim = 32), soft-caps small
# enough to change logits of ~1 (real Gemma 2: window 4096, scalar 256 or 144, caps 50 and 30)
GEMMA_WINDOW = 12
GEMMA_QUERY_PRE_ATTN_SCALAR = 24
GEMMA2_SOFTCAPS: dict[str, Any] = {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}
# Gemma 3's global (full-attention) rope as its 4B-27B checkpoints have it; its local rope is
# the default at theta 10000
GEMMA3_GLOBAL_ROPE: dict[str, Any] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def corpus_path() -> Path:
    """The bundled UTF-8 corpus the tokenizer is trained on."""
    return Path(str(resources.files("pagedserve") / "data" / "tiny_corpus.txt"))


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    vocab: int = 512,
    dtype: str = "float32",
    seed: int = 0,
    max_position_embeddings: int = 2048,
    init_std: float = 0.1,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    sliding_window: int | None = None,
    partial_rotary_factor: float = PHI3_PARTIAL_ROTARY_FACTOR,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny checkpoint + tokenizer into `out_dir` (created if missing) and return its path.

    qwen3 (`Qwen3ForCausalLM`) gets q/k norms and a head_dim of 2 * hidden / heads, so that a
    runtime that derives head_dim from hidden / heads fails; its `sliding_window` applies to the
    second half of the layers (`max_window_layers`), as Qwen's configs lay windows out;
    qwen2_moe's to its even layers (0, 2, ...), as Qwen2MoeConfig lays them out.
    olmo2 (`Olmo2ForCausalLM`) gets its post-norms and q/k norms over the whole projections;
    granite (`GraniteForCausalLM`) the multipliers of `GRANITE_MULTIPLIERS`; phi3
    (`Phi3ForCausalLM`) its fused qkv_proj / gate_up_proj weights and `partial_rotary_factor`
    (default `PHI3_PARTIAL_ROTARY_FACTOR`; a longrope `rope_scaling` may carry
    `original_max_position_embeddings`, which Phi3Config keeps beside it).
    The mixtures of experts have `NUM_EXPERTS` experts, `EXPERTS_PER_TOKEN` per token: mixtral
    (`MixtralForCausalLM`, renormalised top-k weights) in every layer; qwen2_moe
    (`Qwen2MoeForCausalLM`) in every layer, top-k weights not renormalised, with a gated shared
    expert; qwen3_moe (`Qwen3MoeForCausalLM`, q/k norms, renormalised top-k weights) in every
    layer but the last, a dense MLP there (`mlp_only_layers`).
    gemma2 (`Gemma2ForCausalLM`) and gemma3 (`Gemma3ForCausalLM`, model_type gemma3_text) get
    head_dim 2 * hidden / heads, query_pre_attn_scalar `GEMMA_QUERY_PRE_ATTN_SCALAR`, sliding
    layers (window `sliding_window`, default `GEMMA_WINDOW`) alternating with full ones, and
    norm weights ~ N(0, 0.1) (Gemma's norms weigh by 1 + weight); gemma2 the soft-caps of
    `GEMMA2_SOFTCAPS`, gemma3 q/k norms and two ropes (`rope_scaling`, default
    `GEMMA3_GLOBAL_ROPE`, for its full layers).
    `config_overrides` are set on the config before the weights are drawn (e.g. a layout that
    llama.cpp's GGUF can express: `{"query_pre_attn_scalar": 32}`, `{"mlp_only_layers": []}`).

    Raises ValueError naming the argument for an unknown `arch` or `dtype`, shapes that do not
    divide (`hidden` by `heads`, `heads` by `kv_heads`), a `vocab` too small for the special tokens
    plus 256 byte symbols, or `sliding_window` on an arch not in `WINDOWED_ARCHS`.
    """
    _validate(arch, hidden, heads, kv_heads, vocab, dtype, sliding_window)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab, model_max_length=max_position_embeddings)
    config = build_config(
        arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate or 2 * hidden,
        vocab=vocab,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        sliding_window=sliding_window,
        partial_rotary_factor=partial_rotary_factor,
    )
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    model = build_model(config, seed=seed, init_std=init_std, dtype=DTYPES[dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _make_portable(out)
    return out


def _make_portable(out: Path) -> None:
    # NOTE: transformers 5 records its own `TokenizersBackend` class, which 4.x cannot import;
    # `PreTrainedTokenizerFast` loads the same tokenizer.json in both (5 maps it to the backend).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    # NOTE: safetensors is written through a private temp file (mode 0600); make it readable by
    # the other users a container or a shared volume may run the workers as.
    for path in out.glob("*.safetensors"):
        path.chmod(0o644)


def _validate(
    arch: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    dtype: str,
    sliding_window: int | None,
) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got arch={arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got dtype={dtype!r}")
    if heads <= 0 or hidden % heads:
        raise ValueError(f"hidden must be a multiple of heads, got hidden={hidden} heads={heads}")
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(
            f"heads must be a multiple of kv_heads, got heads={heads} kv_heads={kv_heads}"
        )
    min_vocab = len(SPECIAL_TOKENS) + NUM_BYTE_SYMBOLS
    if vocab < min_vocab:
        raise ValueError(f"vocab must be >= {min_vocab} (specials + bytes), got vocab={vocab}")
    if sliding_window is not None and arch not in WINDOWED_ARCHS:
        raise ValueError(
            f"sliding_window is only supported for arch in {WINDOWED_ARCHS}, got arch={arch!r} "
            f"sliding_window={sliding_window}"
        )


def build_tokenizer(vocab: int, *, model_max_length: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with at most `vocab` entries on the bundled corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        # NOTE: seed every byte so any UTF-8 text (bytes absent from the corpus too) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_text(), trainer=trainer)
    if tok.get_vocab_size() > vocab:
        raise RuntimeError(f"trained tokenizer has {tok.get_vocab_size()} tokens > vocab={vocab}")
    special_ids = tuple(tok.token_to_id(t) for t in SPECIAL_TOKENS)
    if special_ids != (BOS_ID, EOS_ID, PAD_ID):
        raise RuntimeError(f"special tokens {SPECIAL_TOKENS} got ids {special_ids}, not 0, 1, 2")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=model_max_length,
        # NOTE: decode must return exactly the encoded text ("a , b" stays "a , b").
        clean_up_tokenization_spaces=False,
    )


def _corpus_text() -> list[str]:
    # NOTE: one item in file order, so merges may span line ends and training is deterministic.
    return [corpus_path().read_text(encoding="utf-8")]


def build_config(
    arch: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_position_embeddings: int,
    rope_scaling: dict[str, Any] | None,
    tie_word_embeddings: bool,
    sliding_window: int | None,
    partial_rotary_factor: float = PHI3_PARTIAL_ROTARY_FACTOR,
) -> PretrainedConfig:
    """The transformers config for `arch`; RoPE goes into `rope_parameters` (transformers 5)."""
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters(rope_scaling),
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch in GEMMA_ARCHS:
        # NOTE: untied (real Gemma ties them), or the tiny model's greedy output is mostly its
        # last token again: the scaled embedding dominates the residual stream it is read from
        return _gemma_config(arch, common, sliding_window)
    if arch == "llama":
        return LlamaConfig(head_dim=hidden // heads, **common)
    if arch == "mistral":
        return MistralConfig(head_dim=hidden // heads, sliding_window=sliding_window, **common)
    if arch == "qwen3":
        return Qwen3Config(
            head_dim=2 * hidden // heads,
            use_sliding_window=sliding_window is not None,
            sliding_window=sliding_window,
            max_window_layers=layers // 2,
            **common,
        )
    if arch == "olmo2":
        return Olmo2Config(**common)
    if arch == "granite":
        return GraniteConfig(**GRANITE_MULTIPLIERS, **common)
    if arch == "phi3":
        return _phi3_config(common, sliding_window, partial_rotary_factor)
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return _moe_config(arch, layers, hidden, heads, intermediate, sliding_window, common)
    return Qwen2Config(use_sliding_window=False, **common)


def _phi3_config(
    common: dict[str, Any], sliding_window: int | None, partial_rotary_factor: float
) -> PretrainedConfig:
    # NOTE: Phi3Config puts its own `original_max_position_embeddings` (default 4096) into a
    # longrope's parameters, over the one given there
    rope = dict(common.pop("rope_parameters"), partial_rotary_factor=partial_rotary_factor)
    original = rope.get("original_max_position_embeddings", common["max_position_embeddings"])
    return Phi3Config(
        rope_parameters=rope, original_max_position_embeddings=original,
        sliding_window=sliding_window, **common,
    )  # fmt: skip


def _moe_config(
    arch: str,
    layers: int,
    hidden: int,
    heads: int,
    intermediate: int,
    sliding_window: int | None,
    common: dict[str, Any],
) -> PretrainedConfig:
    experts: dict[str, Any] = {"num_experts_per_tok": EXPERTS_PER_TOKEN}
    if arch == "mixtral":
        return MixtralConfig(
            head_dim=hidden // heads, sliding_window=sliding_window, num_local_experts=NUM_EXPERTS,
            **experts, **common,
        )  # fmt: skip
    qwen = {**experts, "num_experts": NUM_EXPERTS, "moe_intermediate_size": intermediate // 4}
    if arch == "qwen2_moe":
        # NOTE: a window on the even layers below max_window_layers: layer 0 of 2
        return Qwen2MoeConfig(
            use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
            max_window_layers=layers, shared_expert_intermediate_size=intermediate,
            norm_topk_prob=False, **qwen, **common,
        )  # fmt: skip
    # NOTE: Qwen3MoeConfig has no head_dim field; its attention reads one given as an extra key
    qwen["head_dim"] = 2 * hidden // heads
    return Qwen3MoeConfig(
        norm_topk_prob=True, mlp_only_layers=[layers - 1] if layers > 1 else [], **qwen, **common
    )


def _gemma_config(
    arch: str, common: dict[str, Any], sliding_window: int | None
) -> PretrainedConfig:
    common = {
        **common,
        "head_dim": 2 * common["hidden_size"] // common["num_attention_heads"],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": GEMMA_QUERY_PRE_ATTN_SCALAR,
        "sliding_window": sliding_window or GEMMA_WINDOW,
    }
    if arch == "gemma2":  # NOTE: Gemma2Config windows every other layer, the first one first
        return Gemma2Config(**GEMMA2_SOFTCAPS, **common)
    global_rope = common.pop("rope_parameters")
    if global_rope == rope_parameters(None):
        global_rope = copy.deepcopy(GEMMA3_GLOBAL_ROPE)
    ropes = {
        "sliding_attention": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "full_attention": global_rope,
    }
    layer_types = [  # NOTE: windowed, full, windowed, ... (real Gemma 3: five to one)
        "full_attention" if i % 2 else "sliding_attention"
        for i in range(common["num_hidden_layers"])
    ]
    return Gemma3TextConfig(rope_parameters=ropes, layer_types=layer_types, **common)


def rope_parameters(rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Merge a legacy-style `rope_scaling` dict (`rope_type` or `type`) with the default theta."""
    params: dict[str, Any] = (
        copy.deepcopy(rope_scaling) if rope_scaling else {"rope_type": "default"}
    )
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_theta", ROPE_THETA)
    return params


def build_model(
    config: PretrainedConfig, *, seed: int, init_std: float, dtype: torch.dtype
) -> PreTrainedModel:
    """Instantiate `config` and overwrite every parameter from a generator seeded with `seed`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    # NOTE: Gemma's norms weigh by 1 + weight: centred on 0, their scale is ~1 as the others'
    norm_centre = 0.0 if config.model_type in ("gemma2", "gemma3_text") else 1.0
    norm_params = {
        id(p)
        for module in model.modules()
        if type(module).__name__.endswith("RMSNorm")
        for p in module.parameters(recurse=False)
    }
    with torch.no_grad():
        for _, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if id(param) in norm_params:
                param.copy_(norm_centre + NORM_STD * noise)
            else:
                param.copy_(init_std * noise)
    model = model.to(dtype)
    model.config.dtype = dtype
    return model.eval()


def top_logit_gaps(
    model_dir: str | Path, *, num_prompts: int = 8, prompt_len: int = 16, steps: int = 32
) -> torch.Tensor:
    """Top-1 minus top-2 logit at every greedy step, for random prompts (a near-tie check)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gen = torch.Generator().manual_seed(1234)
    gaps = []
    with torch.no_grad():
        for _ in range(num_prompts):
            ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=gen)
            for _ in range(steps):
                logits = model(ids).logits[0, -1].float()
                top2 = logits.topk(2).values
                gaps.append(top2[0] - top2[1])
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return torch.stack(gaps)
