#!/usr/bin/env python3
"""Writes small random Llama / Qwen2 decoder models and computes their reference logits.

Nothing is downloaded: the weights are drawn from a seed, the tokenizer is trained here on
the English text at the end of this file. Needs numpy, gguf, safetensors and tokenizers
(scripts/lib.sh's `llm_python VENV` makes a venv with the pinned versions).

Commands:

  make_llama.py make --out DIR --arch {llama,qwen2} --shape {tiny,small,bench} [--seed N]
                [--weights TYPE]... [--hf-dtype {f32,f16,bf16}] [--rope-scaling llama3]
                [--tied | --untied] [--attention-bias] [--init-std X]
  make_llama.py reference --model PATH --tokens 1,2,3 [--generate N] [--all] --out FILE.json
  make_llama.py verify --dir DIR [--tokens 1,2,3] [--generate N] [--tol 1e-5]

TYPE is one of f32, f16, bf16, q8_0, q4_0, q4_k, q6_k (repeat --weights for several; the
default is all of them for tiny and small, f16 alone for bench).

`make` writes into DIR (removing what an earlier `make` left there first):

  DIR/hf/config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
        generation_config.json
      The model as transformers saves LlamaForCausalLM / Qwen2ForCausalLM (tensor names
      model.embed_tokens.weight [V, E], model.layers.N.self_attn.q_proj.weight [out, in],
      ..., lm_head.weight only when the embeddings are not tied). Tensors in --hf-dtype
      (F32 by default, BF16 for bench).
  DIR/model-TYPE.gguf for each --weights TYPE
      Written with gguf's GGUFWriter the way llama.cpp's convert_hf_to_gguf.py writes the
      architecture (metadata keys, tensor names, q/k permutation for llama, norms and biases
      in F32, rope_freqs.weight for llama3 rope scaling; for f32, f16, bf16 and q8_0 the
      tensors are byte for byte what convert_hf_to_gguf.py --outtype TYPE writes from hf/)
      and, for the types that convert_hf_to_gguf.py cannot write (q4_0, q4_k, q6_k), the way
      `llama-quantize --pure` would: every 2-D weight in TYPE, with llama.cpp's fallback
      where a row length is not a multiple of the type's block (below). The tokenizer is in
      the file: tokenizer.ggml.model "gpt2" with pre --pre (the trained byte-level BPE
      splits text as that llama.cpp pre-tokenizer does: "llama-bpe" for llama, "qwen2" for
      qwen2 by default, or "gpt-2"); with --vocab spm, "llama": a SentencePiece BPE trained
      with the `sentencepiece` package as Llama 2's is configured (hf/ then holds
      tokenizer.model instead of tokenizer.json).
  DIR/text-cases.json
      The tokenizer's ids for a few texts and a chat rendered by jinja2 with its ids (the
      tests compare libinfer's tokenizers and chat templates with them).
  DIR/hf-TYPE/ for each quantized TYPE (q8_0, q4_0, q4_k, q6_k)
      An F32 Hugging Face folder holding the DEQUANTIZED weights of model-TYPE.gguf (the
      llama q/k permutation undone), the same config and tokenizer: the model that
      model-TYPE.gguf really is, so its reference logits are those of this folder.
  DIR/manifest.json
      {"arch", "shape", "seed", "hf_dtype", "config": config.json's content,
       "files": {"model-TYPE.gguf": {"weights": TYPE, "file_type": N,
                 "reference_hf": "hf" or "hf-TYPE", "tensor_types": {name: ggml type},
                 "fallbacks": {name: ggml type used in place of TYPE}}}}

Every format is the same model: the weights are drawn once, then rounded to values that
bf16 and f16 both hold exactly, so model-f32.gguf, model-f16.gguf, model-bf16.gguf and
hf/ in any --hf-dtype hold identical numbers (their reference is hf/). A quantized file is
that model quantized; its dequantized weights, in hf-TYPE/, are its reference.

Shapes (E hidden, L layers, H heads, KV heads, D head_dim, F intermediate, V vocab, C context):
  tiny:  E 64,  L 2,  H 4,  KV 2, D 16, F 160,  V 512,    C 256,   rope_theta 1e4
  small: E 256, L 2,  H 4,  KV 2, D 64, F 512,  V 512,    C 256,   rope_theta 1e4
  bench: E 896, L 24, H 14, KV 2, D 64, F 4864, V 151936, C 32768, rope_theta 1e6
         (Qwen2.5-0.5B's shape, tied embeddings; for llama the same without biases)
Weight matrices have std 0.02 in bench (Qwen2.5's initializer_range; a greedy continuation
there tends to repeat one token), 0.15 in tiny and 0.075 in small (below); --init-std
overrides. The HF folder also holds tokenizer_config.json (PreTrainedTokenizerFast, no BOS
added) and generation_config.json.
tiny's rows (64, 160) are not multiples of 256, so its q4_k and q6_k files hold no K-quant
tensor at all (llama.cpp's fallback, below, gives Q5_0 and Q8_0); small has every row a
multiple of 256, so its q4_k / q6_k files are pure Q4_K / Q6_K. bench's 896-long rows fall
back too, its 4864-long ones (ffn_down) do not. Embeddings are tied for qwen2 and bench,
untied for llama tiny/small (--tied / --untied override). --rope-scaling llama3 (llama
only) sets rope_scaling {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
"high_freq_factor": 4.0, "original_max_position_embeddings": 64}. --attention-bias gives
llama q/k/v/o biases, as transformers' attention_bias does (qwen2 always has q/k/v biases
and no o bias).

Quantization fallback (llama.cpp's quantizer, src/llama-quant.cpp): a K-quant
needs rows that are a multiple of 256; where a row is not, Q4_K falls back to Q5_0 and Q6_K
to Q8_0, and to F16 where even that block (32) does not divide the row. q8_0 / q4_0 rows
that are not a multiple of 32 become F16 (as convert_hf_to_gguf.py does for q8_0). gguf's
quants module quantizes Q8_0, Q4_0, Q5_0, BF16 (it only dequantizes K-quants): Q4_K and Q6_K
are quantized by this script (plain min/max scales; valid blocks, not llama.cpp's optimal
search) and read back with gguf.quants.dequantize.

`reference` runs an independent numpy forward pass (float64) written from transformers'
modeling_llama / modeling_qwen2: RMSNorm, rotary embeddings with rotate_half (and llama3
scaling), grouped-query attention with a causal mask, SwiGLU MLP, tied head. From a .gguf it
reads the tensors with gguf.GGUFReader, dequantizes them, undoes the llama q/k permutation
and takes the rope frequencies from the file (rope.freq_base, rope_freqs.weight). Output:
{"model", "prompt": [ids], "logits_last": [V], "logits_all": [[V] per prompt position]
(with --all), "greedy": [N ids, each fed back], "greedy_margins": [top-1 minus top-2 logit
at each greedy step], "logits_greedy": [[V] after feeding each greedy id but the last, so
N-1 rows] (with --all)}.

`verify` checks a DIR made by `make`: every GGUF parses with GGUFReader and holds the
tensor types of the manifest, its reference equals that of its reference_hf folder (all
prompt positions and greedy steps, max abs diff <= --tol, same greedy tokens), hf/ written
in the other dtypes gives the same logits, and the tokenizer round-trips text.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

WEIGHT_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q6_k"]
QUANTIZED = ["q8_0", "q4_0", "q4_k", "q6_k"]

SHAPES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=160, vocab=512,
                 context=256, rope_theta=10000.0, init_std=0.15),
    "small": dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=512,
                  context=256, rope_theta=10000.0, init_std=0.075),
    "bench": dict(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, ffn=4864,
                  vocab=151936, context=32768, rope_theta=1000000.0, init_std=0.02),
    # Llama-2-shaped, ~0.44B parameters, every row a whole number of 256-element K-quant
    # blocks (so Q4_K / Q6_K files hold K-quants throughout, unlike the 896-wide bench).
    "bench-llama": dict(hidden=1024, layers=24, heads=16, kv_heads=8, head_dim=64, ffn=4096,
                        vocab=32000, context=4096, rope_theta=10000.0, init_std=0.02),
}

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# HF tensor name (per layer: "model.layers.{i}." + key) -> GGUF name ("blk.{i}." + value).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def log(msg: str) -> None:
    print(msg, flush=True)


def hf_to_gguf_name(name: str) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 3)  # model, layers, i, rest
    return f"blk.{parts[2]}.{LAYER_NAMES[parts[3]]}"


def gguf_to_hf_name(name: str) -> str | None:
    for hf, gg in GLOBAL_NAMES.items():
        if name == gg:
            return hf
    if name.startswith("blk."):
        _, i, rest = name.split(".", 2)
        for hf, gg in LAYER_NAMES.items():
            if rest == gg:
                return f"model.layers.{i}.{hf}"
    return None  # rope_freqs.weight and the like


# ----------------------------------------------------------------------------------------
# Weights


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), as float32."""
    u = np.array(x, dtype=np.float32).view(np.uint32)  # a copy
    carry = (u >> 16) & 1
    carry += 0x7FFF
    u += carry  # no overflow for finite values
    u &= np.uint32(0xFFFF0000)
    return u.view(np.float32)


def snap(x: np.ndarray) -> np.ndarray:
    """Rounds to values that float32, float16 and bfloat16 all hold exactly: bf16 first, then
    f16 (an f16 rounding of a bf16 value of this size is still a bf16 value)."""
    y = round_bf16(x).astype(np.float16).astype(np.float32)
    assert not (y.view(np.uint32) & 0xFFFF).any()
    return y


def model_config(arch: str, shape: str, tied: bool, attention_bias: bool, rope_scaling: str | None,
                 dtype: str) -> dict:
    s = SHAPES[shape]
    torch_dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]
    common = {
        "attention_dropout": 0.0,
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "hidden_size": s["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": s["ffn"],
        "max_position_embeddings": s["context"],
        "num_attention_heads": s["heads"],
        "num_hidden_layers": s["layers"],
        "num_key_value_heads": s["kv_heads"],
        "rope_scaling": None,
        "rope_theta": s["rope_theta"],
        "tie_word_embeddings": tied,
        "torch_dtype": torch_dtype,
        "use_cache": True,
        "vocab_size": s["vocab"],
    }
    if arch == "llama":
        cfg = dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                   attention_bias=attention_bias, mlp_bias=False, pretraining_tp=1,
                   rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1)
        if rope_scaling == "llama3":
            cfg["rope_scaling"] = dict(LLAMA3_SCALING)
            # Older convert_hf_to_gguf.py versions read original_max_position_embeddings for
            # the llama3 rope_freqs from the top level of the config (default 8192), newer ones
            # and transformers from rope_scaling: stating it at both places makes all agree.
            cfg["original_max_position_embeddings"] = LLAMA3_SCALING["original_max_position_embeddings"]
    else:
        cfg = dict(common, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                   max_window_layers=s["layers"], sliding_window=s["context"],
                   use_sliding_window=False, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0)
    return dict(sorted(cfg.items()))


def draw_weights(cfg: dict, std: float, seed: int) -> dict[str, np.ndarray]:
    """The model's tensors in HF layout (float32, snapped), drawn in a fixed order. std is
    the matrices' standard deviation: 0.02 for bench (Qwen2.5's initializer_range); tiny and
    small take 0.04 * sqrt(896 / E), so that the layers' outputs outweigh the embedding in
    the residual stream and a tied model does not just repeat its last token when decoding
    greedily."""
    rng = np.random.default_rng(seed)
    E, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    # Embeddings and head: logits of std ~1, so greedy top-1 / top-2 margins are large.
    emb_std = 1.0 / math.sqrt(E)
    bias = cfg.get("attention_bias", True) if cfg["model_type"] == "llama" else True

    def normal(shape, s):
        return snap(rng.standard_normal(shape, dtype=np.float32) * np.float32(s))

    def norm_weight():
        return snap(1.0 + rng.uniform(-0.1, 0.1, E).astype(np.float32))

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal((V, E), emb_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = normal((H * D, E), std)
        w[p + "self_attn.k_proj.weight"] = normal((KV * D, E), std)
        w[p + "self_attn.v_proj.weight"] = normal((KV * D, E), std)
        if bias:
            w[p + "self_attn.q_proj.bias"] = normal((H * D,), 0.1)
            w[p + "self_attn.k_proj.bias"] = normal((KV * D,), 0.1)
            w[p + "self_attn.v_proj.bias"] = normal((KV * D,), 0.1)
        w[p + "self_attn.o_proj.weight"] = normal((E, H * D), std)
        if bias and cfg["model_type"] == "llama":
            # Llama's attention_bias gives o_proj a bias too; Qwen2's o_proj has none.
            w[p + "self_attn.o_proj.bias"] = normal((E,), 0.1)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "mlp.gate_proj.weight"] = normal((F, E), std)
        w[p + "mlp.up_proj.weight"] = normal((F, E), std)
        w[p + "mlp.down_proj.weight"] = normal((E, F), std)
    w["model.norm.weight"] = norm_weight()
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal((V, E), emb_std)
    return w


# ----------------------------------------------------------------------------------------
# Tokenizer

def special_tokens(arch: str) -> list[str]:
    """BOS/EOS first (ids 0 and 1 for llama, 0 for qwen2), then the chat template's."""
    if arch == "llama":
        return ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# The pre-tokenizers of llama.cpp's "llama-bpe" (Llama 3) and "qwen2", as their
# tokenizer.json files state them; "gpt-2" is ByteLevel's own regex.
PRE_SPLITS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

# Chat templates in the style of Llama 3 and Qwen2 (ChatML), run as transformers runs
# them (jinja2, trim_blocks, lstrip_blocks).
CHAT_TEMPLATES = {
    "llama": (
        "{{- bos_token }}\n"
        "{%- for message in messages %}\n"
        "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
        "        {{- raise_exception('unknown role ' + message['role']) }}\n"
        "    {%- endif %}\n"
        "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
        "{%- endif %}\n"),
    "qwen2": (
        "{%- for message in messages %}\n"
        "{%- if loop.first and message['role'] != 'system' %}\n"
        "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
        "{%- endif %}\n"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>' + '\\n' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "{{- '<|im_start|>assistant\\n' }}\n"
        "{%- endif %}\n"),
}

CHAT_TEMPLATES["llama2"] = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else '' %}\n"
    "{%- set turns = messages[1:] if messages[0]['role'] == 'system' else messages %}\n"
    "{%- for message in turns %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {{- bos_token + '[INST] ' + ('<<SYS>>\\n' + system.strip() + '\\n<</SYS>>\\n\\n' if loop.first and system else '') + message['content'].strip() + ' [/INST]' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'].strip() + ' ' + eos_token }}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('unknown role ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n")


def chat_template(cfg: dict, tok) -> str:
    """Llama 2's style for a SentencePiece vocabulary, else the architecture's."""
    return CHAT_TEMPLATES["llama2" if isinstance(tok, SpmTokenizer) else cfg["model_type"]]


# Texts whose token ids (and a chat whose rendering) the tests compare with this tokenizer's.
TEXT_CASES = [
    "Hello world",
    "The year 2024 had 366 days, didn't it? I'M SURE we'll see 12345678.",
    "  leading spaces\n\nand blank lines\r\n\ttabs   trailing  ",
    "na\u00efve caf\u00e9 \u2014 \u65e5\u672c\u8a9e \U0001F642 \u00e9\u00e9\u00e9",
    "code: fn main() { println!(\"{}\", x[0]); } // done",
    "",
]
CHAT_CASE = [
    {"role": "system", "content": "  You answer briefly. "},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? \u65e5\u672c"},
]


def train_tokenizer(arch: str, vocab_size: int, pre: str):
    """Byte-level BPE trained on TRAINING_TEXT to vocab_size tokens (special tokens first,
    then the 256 byte symbols, then merges; <unused_N> added tokens where the merges run
    out), split before BPE as llama.cpp's pre-tokenizer `pre` splits. llama adds <s> to a
    prompt (a TemplateProcessing post-processor, as Llama 3's tokenizer.json does)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=(pre == "llama-bpe")))
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    if arch == "llama":
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                          special_tokens=[("<s>", 0)])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=special_tokens(arch),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [line for line in TRAINING_TEXT.strip().splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab_size:
        tok.add_special_tokens([AddedToken(f"<unused_{i}>", special=True, normalized=False)
                                for i in range(vocab_size - n)])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(vocab_size))
    return tok


class SpmTokenizer:
    """A SentencePiece BPE model (the `sentencepiece` package) with the part of
    tokenizers.Tokenizer's interface this script uses. Encoding follows llama.cpp: the text
    is split at special tokens (<unk>, <s>, </s>), each piece of text is encoded on its own
    (so each gets SentencePiece's leading space), and BOS comes first when asked for."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    class _Added:
        def __init__(self, content):
            self.content = content

    def __init__(self, model_file: Path):
        import sentencepiece as spm
        self.model_file = model_file
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.specials = [self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())
                         if self.sp.is_control(i) or self.sp.is_unknown(i)]

    def encode(self, text: str, add_special_tokens: bool = True):
        import re
        ids = [self.sp.bos_id()] if add_special_tokens else []
        pattern = "(" + "|".join(re.escape(t) for t in self.specials) + ")"
        for part in re.split(pattern, text):
            if part in self.specials:
                ids.append(self.sp.piece_to_id(part))
            elif part:
                ids.extend(self.sp.encode(part))
        return self._Enc(ids)

    def decode(self, ids, skip_special_tokens=False):
        return self.sp.decode(ids)

    def token_to_id(self, t: str):
        i = self.sp.piece_to_id(t)
        return None if i == self.sp.unk_id() and t != self.sp.id_to_piece(i) else i

    def id_to_token(self, i: int) -> str:
        return self.sp.id_to_piece(i)

    def get_vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def get_added_tokens_decoder(self):
        return {self.sp.piece_to_id(t): self._Added(t) for t in self.specials}

    def save(self, path: str) -> None:
        shutil.copy(self.model_file, Path(path).parent / "tokenizer.model")


def train_spm(out: Path, vocab_size: int) -> SpmTokenizer:
    """A SentencePiece BPE model trained on TRAINING_TEXT as Llama 2's tokenizer.model is
    configured: identity normalization, extra whitespace kept, a leading space added, digits
    split, byte fallback; <unk> 0, <s> 1, </s> 2."""
    import io
    import sentencepiece as spm
    lines = [line for line in TRAINING_TEXT.strip().splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, allow_whitespace_only_pieces=True, hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    path = out / "spm.model"
    path.write_bytes(model.getvalue())
    return SpmTokenizer(path)


# ----------------------------------------------------------------------------------------
# Quantization

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """(n, 256) float32 -> (n, 144) uint8 Q4_K blocks: d, dmin (f16), 12 bytes of 6-bit
    scales and mins for the 8 sub-blocks of 32, 128 bytes of 4-bit values;
    x = d * sc[j] * q - dmin * m[j]."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(axis=-1), 0.0)           # (n, 8), <= 0
    hi = x.max(axis=-1)
    scale = (hi - lo) / 15.0
    offset = -lo
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(offset.max(axis=-1) / 63.0)
    df = d.astype(np.float32)[:, None]
    dminf = dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.ceil(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.ceil(offset / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        shift = (dminf * m)[..., None]
        q = np.where(step > 0, np.rint((x + shift) / step), 0).clip(0, 15).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    # qs byte g*32 + p: sub-block 2g in the low nibble, 2g+1 in the high nibble.
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                           scales, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """(n, 256) float32 -> (n, 210) uint8 Q6_K blocks: 128 bytes of low 4 bits, 64 bytes of
    high 2 bits, 16 int8 scales (one per 16 values), d (f16); x = d * sc[i] * (q - 32)."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16).astype(np.float32)
    sub = np.abs(x).max(axis=-1) / 31.0             # (n, 16)
    d = _f16(sub.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(sub / df), 0).clip(0, 127)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint(x / step), 0).clip(-32, 31)
    sc = sc.astype(np.int8)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # value h*128 + k*32 + p
    ql = np.empty((n, 2, 2, 32), np.uint8)
    ql[:, :, 0, :] = (q[:, :, 0, :] & 0x0F) | ((q[:, :, 2, :] & 0x0F) << 4)
    ql[:, :, 1, :] = (q[:, :, 1, :] & 0x0F) | ((q[:, :, 3, :] & 0x0F) << 4)
    hi = q >> 4
    qh = hi[:, :, 0, :] | (hi[:, :, 1, :] << 2) | (hi[:, :, 2, :] << 4) | (hi[:, :, 3, :] << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           d.view(np.uint8).reshape(n, 2)], axis=1)


def _quantize_k(x: np.ndarray, fn, type_size: int) -> np.ndarray:
    rows, cols = x.shape
    flat = x.reshape(-1, 256)
    out = np.empty((flat.shape[0], type_size), np.uint8)
    chunk = 1 << 16
    for i in range(0, flat.shape[0], chunk):
        out[i:i + chunk] = fn(flat[i:i + chunk])
    return out.reshape(rows, cols // 256 * type_size)


def gguf_type(name: str):
    import gguf
    return gguf.GGMLQuantizationType[name.upper()]


def pick_type(requested: str, cols: int):
    """The ggml type llama.cpp's quantizer stores a row of `cols` values in when
    `requested` is asked: Q4_K -> Q5_0 and Q6_K -> Q8_0 where 256 does not divide the row,
    F16 where the (fallback) type's block does not either."""
    import gguf
    T = gguf.GGMLQuantizationType
    t = gguf_type(requested)
    block = gguf.GGML_QUANT_SIZES[t][0]
    if cols % block == 0:
        return t
    t = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}.get(t, T.F16)
    if cols % gguf.GGML_QUANT_SIZES[t][0] != 0:
        t = T.F16
    return t


def encode(x: np.ndarray, t) -> tuple[np.ndarray, np.ndarray]:
    """x (2-D float32) in ggml type t -> (data for GGUFWriter, the dequantized float32)."""
    import gguf
    T = gguf.GGMLQuantizationType
    if t == T.F32:
        return x, x
    if t == T.F16:
        data = x.astype(np.float16)
        return data, data.astype(np.float32)
    if t == T.Q4_K:
        data = _quantize_k(x, quantize_q4_k, 144)
    elif t == T.Q6_K:
        data = _quantize_k(x, quantize_q6_k, 210)
    else:
        data = gguf.quants.quantize(x, t)
    deq = gguf.quants.dequantize(data, t).reshape(x.shape).astype(np.float32)
    return data, deq


# ----------------------------------------------------------------------------------------
# The llama q/k permutation (convert_hf_to_gguf.py's LlamaModel.permute): HF's rotary
# embedding rotates dimension j with j + D/2 of each head (rotate_half), llama.cpp's
# LLAMA rope rotates adjacent pairs (2j, 2j+1); the permutation moves row j + D/2 of each
# head next to row j: new row (h, 2j + s) = old row (h, s*D/2 + j).

def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf.py computes it for llama3 rope scaling: per
    rotary frequency, the factor llama.cpp divides it by (1, factor, or the smooth mix)."""
    rs = cfg["rope_scaling"]
    base = float(cfg["rope_theta"])
    dim = cfg["head_dim"]
    freqs = (1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    factor = rs.get("factor", 8.0)
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = cfg.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# ----------------------------------------------------------------------------------------
# Writing

def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    from safetensors import TensorSpec, serialize_file
    keep = []
    specs = {}
    for name, x in tensors.items():
        if dtype == "f32":
            data, st = np.ascontiguousarray(x, np.float32), "float32"
        elif dtype == "f16":
            data, st = np.ascontiguousarray(x.astype(np.float16)), "float16"
        else:
            bits = round_bf16(x).view(np.uint32)
            data, st = np.ascontiguousarray((bits >> 16).astype(np.uint16)), "bfloat16"
        keep.append(data)
        specs[name] = TensorSpec(dtype=st, shape=list(data.shape), data_ptr=data.ctypes.data,
                                 data_len=data.nbytes)
    serialize_file(specs, str(path), metadata={"format": "pt"})
    path.chmod(0o644)
    del keep


def write_hf(folder: Path, cfg: dict, tensors: dict[str, np.ndarray], tok, dtype: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg, torch_dtype={"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype])
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # Generation also ends at the chat template's end-of-turn token.
    turn_end = tok.token_to_id("<|eot_id|>" if cfg["model_type"] == "llama" else "<|im_end|>")
    eos = [cfg["eos_token_id"]] + ([turn_end] if turn_end is not None else [])
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(folder / "tokenizer.json"))
    specials = [tok.id_to_token(cfg["bos_token_id"]), tok.id_to_token(cfg["eos_token_id"])]
    tcfg = {
        "add_bos_token": cfg["model_type"] == "llama",
        "add_eos_token": False,
        "bos_token": specials[0],
        "eos_token": specials[-1],
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template(cfg, tok),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    write_safetensors(folder / "model.safetensors", tensors, dtype)
    size = (folder / "model.safetensors").stat().st_size
    log(f"wrote {folder}/ ({cfg['model_type']}, {dtype.upper()} safetensors, {len(tensors)} tensors, "
        f"{size / 1e6:.1f} MB, tokenizer {tok.get_vocab_size()} tokens)")


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", "q4_k": "MOSTLY_Q4_K_M", "q6_k": "MOSTLY_Q6_K"}


def add_bpe_vocab(w, cfg: dict, tok, pre: str, hf_dir: Path) -> None:
    """A byte-level BPE vocabulary, as convert_hf_to_gguf.py's _set_vocab_gpt2 writes it."""
    import gguf
    vocab = tok.get_vocab()
    inv = {i: t for t, i in vocab.items()}
    added = {a.content for a in tok.get_added_tokens_decoder().values()}
    tokens = [inv[i] for i in range(cfg["vocab_size"])]
    types = [gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)


def add_spm_vocab(w, cfg: dict, tok: "SpmTokenizer") -> None:
    """A SentencePiece vocabulary, as convert_hf_to_gguf.py's _set_vocab_sentencepiece writes
    it: pieces, scores and types, padded to the embedding's rows with unused [PADn]."""
    import gguf
    sp = tok.sp
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        t = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            t = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            t = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            t = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            t = gguf.TokenType.BYTE
        types.append(t)
    for i in range(len(tokens), cfg["vocab_size"]):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(chat_template(cfg, tok))


def write_gguf(path: Path, cfg: dict, tensors: dict[str, np.ndarray], wtype: str, hf_dir: Path,
               tok, pre: str, name: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Writes the model in GGUF; returns the manifest entry and the dequantized tensors in
    HF layout (the model this file holds)."""
    import gguf
    T = gguf.GGMLQuantizationType
    arch = cfg["model_type"]
    E, H, KV, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ftype = gguf.LlamaFileType[FILE_TYPES[wtype]]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(E)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(D)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if isinstance(tok, SpmTokenizer):
        add_spm_vocab(w, cfg, tok)
    else:
        add_bpe_vocab(w, cfg, tok, pre, hf_dir)

    entry = {"weights": wtype, "file_type": int(ftype),
             "reference_hf": "hf" if wtype not in QUANTIZED else f"hf-{wtype}",
             "tensor_types": {}, "fallbacks": {}}
    dequantized: dict[str, np.ndarray] = {}

    def add(gname: str, data: np.ndarray, t) -> None:
        w.add_tensor(gname, data, raw_dtype=t if data.dtype == np.uint8 else None)
        entry["tensor_types"][gname] = t.name

    if cfg.get("rope_scaling") and cfg["rope_scaling"].get("rope_type") == "llama3":
        add("rope_freqs.weight", llama3_rope_freqs(cfg), T.F32)

    for hname, x in tensors.items():
        gname = hf_to_gguf_name(hname)
        perm = None
        if arch == "llama" and ".q_proj." in hname:
            perm = H
        elif arch == "llama" and ".k_proj." in hname:
            perm = KV
        if perm is not None:
            x = permute(x, perm)
        if x.ndim == 1 or gname.endswith("_norm.weight") or not gname.endswith(".weight"):
            t = T.F32  # norms and biases stay F32 (convert_hf_to_gguf.py, llama-quantize)
        else:
            t = pick_type(wtype, x.shape[-1])
            if t != gguf_type(wtype):
                entry["fallbacks"][gname] = t.name
        data, deq = encode(x, t)
        add(gname, data, t)
        dequantized[hname] = unpermute(deq, perm) if perm is not None else deq

    total, shared, expert, n_expert = w.get_total_parameter_count()
    w.add_size_label(gguf.size_label(total, shared, expert, n_expert))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    counts: dict[str, int] = {}
    for t in entry["tensor_types"].values():
        counts[t] = counts.get(t, 0) + 1
    fb = f", fallbacks {len(entry['fallbacks'])}" if entry["fallbacks"] else ""
    log(f"wrote {path} ({arch}, {wtype}: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        + f"{fb}, {path.stat().st_size / 1e6:.1f} MB)")
    return entry, dequantized


def cmd_make(args) -> None:
    t0 = time.time()
    if args.rope_scaling == "llama3" and args.arch != "llama":
        sys.exit("--rope-scaling llama3 is for --arch llama")
    if args.attention_bias and args.arch != "llama":
        sys.exit("--attention-bias is for --arch llama (qwen2 always has q/k/v biases)")
    weights = args.weights or (["f16"] if args.shape.startswith("bench") else list(WEIGHT_TYPES))
    weights = list(dict.fromkeys(weights))
    hf_dtype = args.hf_dtype or ("bf16" if args.shape.startswith("bench") else "f32")
    tied = args.tied if args.tied is not None else (args.arch == "qwen2" or args.shape == "bench")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model-*.gguf")) + [out / "manifest.json"]:
        old.unlink(missing_ok=True)
    for old in [out / "hf"] + list(out.glob("hf-*")):
        if old.is_dir():
            shutil.rmtree(old)

    cfg = model_config(args.arch, args.shape, tied, args.attention_bias, args.rope_scaling, hf_dtype)
    pre = args.pre or {"llama": "llama-bpe", "qwen2": "qwen2"}[args.arch]
    if args.vocab == "spm":
        if args.arch != "llama":
            sys.exit("--vocab spm is for --arch llama")
        tok = train_spm(out, cfg["vocab_size"])
        cfg = dict(cfg, bos_token_id=tok.sp.bos_id(), eos_token_id=tok.sp.eos_id())
        pre = "default"
    else:
        tok = train_tokenizer(args.arch, cfg["vocab_size"], pre)
    tensors = draw_weights(cfg, args.init_std or SHAPES[args.shape]["init_std"], args.seed)
    write_hf(out / "hf", cfg, tensors, tok, hf_dtype)

    name = f"{args.arch}-{args.shape}-seed{args.seed}"
    manifest = {"arch": args.arch, "shape": args.shape, "seed": args.seed, "hf_dtype": hf_dtype,
                "config": json.loads((out / "hf" / "config.json").read_text()), "files": {}}
    for wtype in weights:
        path = out / f"model-{wtype}.gguf"
        entry, deq = write_gguf(path, cfg, tensors, wtype, out / "hf", tok, pre, name)
        if wtype in QUANTIZED:
            write_hf(out / f"hf-{wtype}", cfg, deq, tok, "f32")
        else:
            assert all(np.array_equal(deq[k], tensors[k]) for k in tensors), wtype
        manifest["files"][path.name] = entry
        del deq
    manifest["pre"] = pre
    manifest["vocab"] = args.vocab
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    write_text_cases(out / "text-cases.json", out / "hf", tok)
    log(f"wrote {out / 'manifest.json'} ({len(weights)} GGUF files, {time.time() - t0:.1f} s)")


def write_text_cases(path: Path, hf_dir: Path, tok) -> None:
    """The tokenizer's ids for TEXT_CASES (with the special tokens it adds to a prompt, and
    the texts with every special token of the vocabulary inside), and CHAT_CASE rendered by
    jinja2 as transformers' apply_chat_template renders it, with its ids."""
    import jinja2
    import jinja2.sandbox
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    specials = [a.content for a in tok.get_added_tokens_decoder().values()
                if not a.content.startswith("<unused_")]
    texts = TEXT_CASES + ["x" + "".join(specials) + " y " + specials[-1] + "z"]
    cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=True).ids,
              "ids_plain": tok.encode(t, add_special_tokens=False).ids} for t in texts]
    for c in cases:
        # Text with special tokens inside does not come back from SentencePiece (each
        # piece after one gained a leading space); everything else does.
        c["round_trip"] = tok.decode(c["ids_plain"], skip_special_tokens=False) == c["text"]
        assert c["round_trip"] or (isinstance(tok, SpmTokenizer) and c is cases[-1]), c["text"]

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    rendered = env.from_string(tcfg["chat_template"]).render(
        messages=CHAT_CASE, add_generation_prompt=True,
        bos_token=tcfg["bos_token"], eos_token=tcfg["eos_token"])
    chat = {"messages": CHAT_CASE, "rendered": rendered,
            "ids": tok.encode(rendered, add_special_tokens=False).ids}
    path.write_text(json.dumps({"cases": cases, "chat": chat}, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------
# Reading and the reference forward pass

ST_DTYPES = {"F32": np.float32, "float32": np.float32, "F16": np.float16, "float16": np.float16}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import deserialize
    out = {}
    for name, t in deserialize(path.read_bytes()):
        dt = t["dtype"]
        if dt in ("BF16", "bfloat16"):
            bits = np.frombuffer(t["data"], np.uint16).astype(np.uint32) << 16
            x = bits.view(np.float32)
        elif dt in ST_DTYPES:
            x = np.frombuffer(t["data"], ST_DTYPES[dt]).astype(np.float32)
        else:
            raise ValueError(f"{path}: {name} has dtype {dt}")
        out[name] = x.reshape(t["shape"])
    return out


def hf_inv_freq(cfg: dict) -> np.ndarray:
    """transformers' rotary inverse frequencies (default, or llama3 rope scaling)."""
    D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (np.arange(0, D, 2, dtype=np.float64) / D))
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise ValueError(f"rope_scaling {kind!r} is not supported")
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_l = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, inv_l)


class Model:
    def __init__(self, n_layers, n_head, n_kv, head_dim, eps, inv_freq, w):
        self.n_layers, self.n_head, self.n_kv, self.head_dim = n_layers, n_head, n_kv, head_dim
        self.eps = eps
        self.inv_freq = np.asarray(inv_freq, np.float64)
        self.w = {k: v.astype(np.float64) for k, v in w.items()}
        if "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        self.vocab = self.w["lm_head.weight"].shape[0]


def load_hf(folder: Path) -> Model:
    cfg = json.loads((folder / "config.json").read_text())
    w = read_safetensors(folder / "model.safetensors")
    if cfg.get("tie_word_embeddings", False):
        w.pop("lm_head.weight", None)
    H = cfg["num_attention_heads"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    return Model(cfg["num_hidden_layers"], H, cfg.get("num_key_value_heads", H), D,
                 cfg["rms_norm_eps"], hf_inv_freq(cfg), w)


def _field(reader, key, default=None):
    f = reader.get_field(key)
    return default if f is None else f.contents()


def load_gguf(path: Path) -> Model:
    import gguf
    r = gguf.GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path}: architecture {arch!r}")
    E = _field(r, f"{arch}.embedding_length")
    H = _field(r, f"{arch}.attention.head_count")
    KV = _field(r, f"{arch}.attention.head_count_kv", H)
    D = _field(r, f"{arch}.attention.key_length", E // H)
    n_rot = _field(r, f"{arch}.rope.dimension_count", D)
    assert n_rot == D, "partial rotary is not supported"
    base = float(_field(r, f"{arch}.rope.freq_base", 10000.0))
    eps = float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
    w: dict[str, np.ndarray] = {}
    rope_freqs = None
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        x = x.reshape(shape)
        if t.name == "rope_freqs.weight":
            rope_freqs = x.astype(np.float64)
            continue
        name = gguf_to_hf_name(t.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name}")
        if arch == "llama" and ".q_proj." in name:
            x = unpermute(x, H)
        elif arch == "llama" and ".k_proj." in name:
            x = unpermute(x, KV)
        w[name] = x
    # llama.cpp: theta_i = pos * base^(-2i/n_rot) / rope_freqs[i]
    inv = 1.0 / (base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))
    if rope_freqs is not None:
        inv = inv / rope_freqs
    return Model(_field(r, f"{arch}.block_count"), H, KV, D, eps, inv, w)


def load_model(path: Path) -> Model:
    return load_gguf(path) if path.suffix == ".gguf" else load_hf(path)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x (T, heads, D); HF convention: dimension j rotates with j + D/2."""
    freqs = positions[:, None].astype(np.float64) * inv_freq[None, :]   # (T, D/2)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]            # (T, 1, D)
    return x * np.cos(emb) + rotate_half(x) * np.sin(emb)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def forward(m: Model, tokens: list[int], cache: list, start: int) -> np.ndarray:
    """Runs tokens at positions start.. with the K/V cache (a list per layer, extended);
    returns logits (T, V)."""
    w = m.w
    T = len(tokens)
    pos = np.arange(start, start + T)
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    group = m.n_head // m.n_kv
    scale = 1.0 / math.sqrt(m.head_dim)
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], m.eps)

        def proj(name):
            y = h @ w[p + f"self_attn.{name}.weight"].T
            b = w.get(p + f"self_attn.{name}.bias")
            return y if b is None else y + b

        q = apply_rope(proj("q_proj").reshape(T, m.n_head, m.head_dim), pos, m.inv_freq)
        k = apply_rope(proj("k_proj").reshape(T, m.n_kv, m.head_dim), pos, m.inv_freq)
        v = proj("v_proj").reshape(T, m.n_kv, m.head_dim)
        if len(cache) <= i:
            cache.append((np.zeros((0, m.n_kv, m.head_dim)), np.zeros((0, m.n_kv, m.head_dim))))
        K = np.concatenate([cache[i][0], k])
        V = np.concatenate([cache[i][1], v])
        cache[i] = (K, V)
        S = K.shape[0]
        Kh = np.repeat(K, group, axis=1).transpose(1, 0, 2)   # (H, S, D); head h uses kv h // group
        Vh = np.repeat(V, group, axis=1).transpose(1, 0, 2)
        scores = np.einsum("thd,hsd->hts", q, Kh) * scale     # (H, T, S)
        mask = np.arange(S)[None, :] > pos[:, None]            # key after the query
        scores = np.where(mask[None], -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        att = np.einsum("hts,hsd->thd", probs, Vh).reshape(T, m.n_head * m.head_dim)
        x = x + att @ w[p + "self_attn.o_proj.weight"].T
        if p + "self_attn.o_proj.bias" in w:
            x = x + w[p + "self_attn.o_proj.bias"]
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], m.eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], m.eps)
    return x @ w["lm_head.weight"].T


def margin(logits: np.ndarray) -> float:
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0])


def run_reference(m: Model, prompt: list[int], generate: int) -> dict:
    if not prompt:
        raise ValueError("empty prompt")
    if max(prompt) >= m.vocab or min(prompt) < 0:
        raise ValueError(f"token ids must be in [0, {m.vocab})")
    cache: list = []
    logits = forward(m, prompt, cache, 0)
    out = {"prompt": list(prompt), "logits_last": logits[-1], "logits_all": logits,
           "greedy": [], "greedy_margins": [], "logits_greedy": []}
    last = logits[-1]
    pos = len(prompt)
    for n in range(generate):
        nxt = int(np.argmax(last))
        out["greedy"].append(nxt)
        out["greedy_margins"].append(margin(last))
        if n + 1 < generate:
            last = forward(m, [nxt], cache, pos)[-1]
            out["logits_greedy"].append(last)
            pos += 1
    return out


def parse_tokens(s: str) -> list[int]:
    return [int(t) for t in s.replace(" ", "").split(",") if t]


def cmd_reference(args) -> None:
    m = load_model(Path(args.model))
    r = run_reference(m, parse_tokens(args.tokens), args.generate)
    doc = {"model": str(args.model), "prompt": r["prompt"],
           "logits_last": [float(v) for v in r["logits_last"]]}
    if args.all:
        doc["logits_all"] = [[float(v) for v in row] for row in r["logits_all"]]
    doc["greedy"] = r["greedy"]
    doc["greedy_margins"] = r["greedy_margins"]
    if args.all:
        doc["logits_greedy"] = [[float(v) for v in row] for row in r["logits_greedy"]]
    Path(args.out).write_text(json.dumps(doc) + "\n")
    log(f"wrote {args.out} ({len(r['prompt'])} prompt tokens, vocab {m.vocab}, "
        f"greedy {r['greedy']})")


# ----------------------------------------------------------------------------------------
# verify

def max_diff(a: dict, b: dict) -> float:
    """Largest logit difference over the prompt positions and, where both decoded the same
    tokens, the greedy steps."""
    diff = float(np.max(np.abs(a["logits_all"] - b["logits_all"])))
    if a["greedy"] == b["greedy"]:
        for x, y in zip(a["logits_greedy"], b["logits_greedy"]):
            diff = max(diff, float(np.max(np.abs(x - y))))
    return diff


def cmd_verify(args) -> None:
    import gguf
    from tokenizers import Tokenizer
    d = Path(args.dir)
    manifest = json.loads((d / "manifest.json").read_text())
    vocab = manifest["config"]["vocab_size"]
    failures = []

    tok = Tokenizer.from_file(str(d / "hf" / "tokenizer.json"))
    text = "The quick brown fox jumps over the lazy dog, and the river runs to the sea."
    ids = tok.encode(text).ids
    if tok.decode(ids) != text or max(ids) >= vocab:
        failures.append("tokenizer does not round-trip")
    prompt = parse_tokens(args.tokens) if args.tokens else ids[:12]
    log(f"prompt {prompt} ({len(ids)} tokens for {text!r})")

    refs: dict[str, dict] = {}

    def ref(folder: str) -> dict:
        if folder not in refs:
            refs[folder] = run_reference(load_hf(d / folder), prompt, args.generate)
        return refs[folder]

    base = ref("hf")
    log(f"hf: greedy {base['greedy']}, min greedy margin {min(base['greedy_margins'] or [0]):.4f}, "
        f"logits_last std {np.std(base['logits_last']):.3f}")
    for fname, entry in manifest["files"].items():
        r = gguf.GGUFReader(str(d / fname))
        got = {t.name: t.tensor_type.name for t in r.tensors}
        if got != entry["tensor_types"]:
            failures.append(f"{fname}: tensor types differ from the manifest")
        want = ref(entry["reference_hf"])
        have = run_reference(load_gguf(d / fname), prompt, args.generate)
        diff = max_diff(have, want)
        same = have["greedy"] == want["greedy"]
        vs_base = float(np.max(np.abs(want["logits_all"] - base["logits_all"])))
        msg = (f"{fname}: {len(r.tensors)} tensors parse; vs {entry['reference_hf']}/ max |dlogit| "
               f"{diff:.2e}, greedy {'same' if same else 'DIFFERENT'}; "
               f"min margin {min(want['greedy_margins'] or [0]):.4f}; {entry['reference_hf']}/ vs hf/ "
               f"max |dlogit| {vs_base:.3g}")
        log(msg)
        if diff > args.tol or not same:
            failures.append(msg)
    # The HF folder in the other dtypes is the same model.
    for dtype in ("f16", "bf16"):
        tmp = d / f".verify-hf-{dtype}"
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(d / "hf", tmp)
        write_safetensors(tmp / "model.safetensors", read_safetensors(d / "hf" / "model.safetensors"), dtype)
        have = run_reference(load_hf(tmp), prompt, args.generate)
        shutil.rmtree(tmp)
        diff = max_diff(have, base)
        log(f"hf as {dtype}: max |dlogit| {diff:.2e}")
        if diff > args.tol:
            failures.append(f"hf as {dtype} differs by {diff}")
    if failures:
        for f in failures:
            log("FAIL " + f)
        sys.exit(1)
    log(f"verify {d}: ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write the HF folder and GGUF files")
    mk.add_argument("--out", required=True)
    mk.add_argument("--arch", choices=["llama", "qwen2"], required=True)
    mk.add_argument("--shape", choices=list(SHAPES), required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--weights", action="append", choices=WEIGHT_TYPES)
    mk.add_argument("--hf-dtype", choices=["f32", "f16", "bf16"])
    mk.add_argument("--rope-scaling", choices=["llama3"])
    mk.add_argument("--attention-bias", action="store_true")
    mk.add_argument("--vocab", choices=["bpe", "spm"], default="bpe",
                    help="bpe: byte-level BPE (tokenizers); spm: SentencePiece BPE as Llama 2's (sentencepiece)")
    mk.add_argument("--pre", choices=["gpt-2", *PRE_SPLITS],
                    help="llama.cpp pre-tokenizer the tokenizer follows (default: llama-bpe for llama, qwen2 for qwen2)")
    mk.add_argument("--init-std", type=float, help="std of the weight matrices (default per shape)")
    tie = mk.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None)
    tie.add_argument("--untied", dest="tied", action="store_false")
    rf = sub.add_parser("reference", help="numpy forward pass of an HF folder or a .gguf")
    rf.add_argument("--model", required=True)
    rf.add_argument("--tokens", required=True)
    rf.add_argument("--generate", type=int, default=0)
    rf.add_argument("--all", action="store_true")
    rf.add_argument("--out", required=True)
    vf = sub.add_parser("verify", help="check a folder written by make")
    vf.add_argument("--dir", required=True)
    vf.add_argument("--tokens")
    vf.add_argument("--generate", type=int, default=16)
    vf.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    {"make": cmd_make, "reference": cmd_reference, "verify": cmd_verify}[args.cmd](args)


TRAINING_TEXT = """
The river runs past the old mill and down to the sea, where the boats come in at dusk.
Every morning the baker opens his shop before the sun is up, and the smell of bread fills the street.
She wrote the letter twice, because the first time her hand was shaking too much to read.
The children played in the garden until their mother called them in for dinner.
A small dog followed the travellers all the way from the village to the edge of the forest.
In winter the lake freezes over, and people walk across it to visit their friends on the other side.
He said that he would come back tomorrow, but nobody believed him.
The library was quiet except for the sound of pages turning and the clock on the wall.
They built the bridge in three years, using stone from the hills to the north.
When the storm came, the fishermen pulled their nets in and waited in the harbour.
My grandfather kept a notebook in which he wrote down the weather every single day.
The train was late again, so we sat on the bench and watched the pigeons.
Learning a new language takes time, patience, and a great deal of practice.
The market sells apples, pears, cheese, fresh fish, and flowers of every colour.
If you follow the path through the woods, you will find a small house with a red door.
The teacher asked the students to write a short story about a journey they had taken.
At night the city lights shine on the water, and the streets are full of music.
The old man smiled and said that the best things in life are often the simplest.
We walked for hours along the coast, listening to the waves and the cry of the gulls.
The museum has a collection of paintings, maps, and tools from the early days of the town.
Please close the window before you leave, because it might rain later this evening.
The farmer planted wheat in the spring and harvested it at the end of the summer.
She found an old photograph in the attic, showing a family she had never seen before.
The doctor told him to rest, drink plenty of water, and come back in a week.
Our neighbours are friendly people who always wave when they see us in the street.
The mountain road is narrow and steep, and in places it is barely wide enough for a car.
He read the book in a single night, and in the morning he started it again.
The garden is full of roses, and in June the whole house smells of them.
A good cup of tea, a warm fire, and a quiet evening are all that I need.
The ship left the port at noon and sailed west toward the islands.
When they reached the top of the hill, they could see the whole valley below them.
The shop on the corner sells newspapers, sweets, and postcards of the castle.
It was the coldest winter anyone could remember, and the snow lay deep for months.
The students listened carefully as the professor explained the history of the city.
She opened the door slowly, not knowing what she would find on the other side.
The birds return every spring and build their nests under the roof of the barn.
We counted the stars until we fell asleep on the grass behind the house.
The workers finished the new school just in time for the start of the year.
He keeps his tools in a wooden box that his father made many years ago.
The road to the village was closed, so we had to take the long way around the lake.
Three friends shared a small flat near the station and took turns cooking dinner.
The price of bread went up again this week, and people are starting to complain.
The band played until midnight, and nobody wanted to go home.
On Sundays the family walks to the park, feeds the ducks, and buys ice cream.
The captain looked at the sky and said that the wind would change before evening.
A letter arrived from abroad, with a stamp that nobody in the house had seen before.
The hospital is at the end of the street, next to the church and the post office.
She spent the afternoon reading in the shade of the big oak tree.
The clock struck twelve, and the hall fell silent as the speaker stood up.
They planted a row of trees along the road, and now it is green all summer.
The numbers one, two, three, four, five, six, seven, eight, nine and ten are easy to learn.
In 1999 the town had 4,250 people; by 2024 it had grown to more than 12,000.
What time does the last bus leave? I think it is at half past eleven.
"Wait for me!" she shouted, running down the hill with her bag in her hand.
The recipe needs two eggs, a cup of flour, some milk, and a pinch of salt.
It's not the size of the house that matters, it's the people who live in it.
"""


if __name__ == "__main__":
    main()
