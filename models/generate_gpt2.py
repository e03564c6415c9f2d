#!/usr/bin/env python3
"""Writes the tiny GPT-2 model `models/tiny_gpt2/1/` and its reference data.

The model is a Hugging Face GPT2LMHeadModel (2 layers, 4 heads, 64-wide, 256-token
vocabulary, 128 positions) with random weights drawn from a fixed seed, saved with
`save_pretrained(..., safe_serialization=True)`; only `config.json` and
`model.safetensors` are kept. The weights are drawn wider than Hugging Face's own
initialisation (normal, std 0.2; layer-norm gains around 1) so that the logits are far
apart and greedy decoding is never decided by a near tie: the seed is the first one
whose smallest top-1/top-2 logit gap over every greedy step is above MIN_GAP.

`tests/fixtures/models/tiny_gpt2.json` gets, for a few fixed prompts (token ids), the
logits at every prompt position, the greedy continuation of `generate(do_sample=False,
max_new_tokens=24)` (no end-of-sequence token can stop it: the model has none in its
vocabulary), and for one prompt the logits of every generated step (`output_scores`).
`src/llm/` replays it in its unit tests. `models/tiny_gpt2/config.pbtxt` is written by
hand, not here.

Needs: torch, transformers, safetensors, numpy (`pip install torch transformers`).
Run from anywhere: `python3 models/generate_gpt2.py`. Running it twice on the same
machine and library versions gives byte-identical files.
"""

import json
import os
import shutil
import tempfile

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(ROOT, "tiny_gpt2", "1")
FIXTURE = os.path.join(os.path.dirname(ROOT), "tests", "fixtures", "models", "tiny_gpt2.json")

NEW_TOKENS = 24
MIN_GAP = 1e-2
PROMPT_LENGTHS = [1, 7, 23, 60]
# The prompt whose generated steps' logits are recorded too.
SCORED_PROMPT = 1


def config():
    cfg = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        vocab_size=256,
        n_positions=128,
        activation_function="gelu_new",
        # No token of the vocabulary ends or pads a sequence: greedy decoding always
        # runs for exactly NEW_TOKENS tokens.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    return cfg


def build(seed):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            if ".ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)
    model.eval()
    return model


def prompts():
    rng = np.random.default_rng(1234)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in PROMPT_LENGTHS]


def greedy(model, prompt, scores):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        output_scores=scores,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == NEW_TOKENS, tokens
    step_logits = [s[0].float().numpy() for s in out.scores] if scores else None
    return tokens, step_logits


def min_gap(model, all_prompts):
    """The smallest top-1/top-2 gap over every greedy step of every prompt."""
    gap = float("inf")
    with torch.no_grad():
        for prompt in all_prompts:
            tokens, _ = greedy(model, prompt, False)
            seq = torch.tensor([prompt + tokens])
            logits = model(seq).logits[0, len(prompt) - 1 : -1]
            top = torch.topk(logits, 2, dim=-1).values
            gap = min(gap, float((top[:, 0] - top[:, 1]).min()))
    return gap


def rounded(values):
    """float32 values as shortest-ish decimal text with 7 significant digits."""
    return [float(f"{float(v):.7g}") for v in np.asarray(values, dtype=np.float32).ravel()]


def main():
    all_prompts = prompts()
    seed = 0
    while True:
        model = build(seed)
        gap = min_gap(model, all_prompts)
        if gap > MIN_GAP:
            break
        seed += 1

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        os.makedirs(MODEL_DIR, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(os.path.join(tmp, name), os.path.join(MODEL_DIR, name))

    cases = []
    with torch.no_grad():
        for i, prompt in enumerate(all_prompts):
            logits = model(torch.tensor([prompt])).logits[0].float().numpy()
            tokens, step_logits = greedy(model, prompt, i == SCORED_PROMPT)
            case = {
                "prompt": prompt,
                "prompt_logits": [rounded(row) for row in logits],
                "greedy": tokens,
            }
            if step_logits is not None:
                case["step_logits"] = [rounded(row) for row in step_logits]
            cases.append(case)

    fixture = {
        "model": "tiny_gpt2",
        "reference": "transformers GPT2LMHeadModel (float32, eager attention)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "seed": seed,
        "min_greedy_top2_gap": round(gap, 6),
        "vocab_size": 256,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    with open(FIXTURE, "w") as f:
        # One line per logits row keeps the file readable and diffable.
        f.write(json.dumps(fixture, separators=(",", ":")))
        f.write("\n")
    print(f"seed {seed}, smallest greedy top-2 gap {gap:.4g}, wrote {MODEL_DIR} and {FIXTURE}")


if __name__ == "__main__":
    main()
