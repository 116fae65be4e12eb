"""HF decoders captured on meta as CUDA runs them.

Llama, Mistral, Qwen2, Gemma, Phi-3 and GPT-2 built from tiny configs (``from_config``: no weights
downloaded), ``attn_implementation`` sdpa and eager. transformers comes with the dev extra
(pyproject.toml); without it these tests skip, saying so, except under CI (``CI=true``), where they
fail.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from oomtune.capture.recorder import capture_stream

BF16 = torch.bfloat16

if os.environ.get("CI", "").lower() == "true":
    import transformers
else:
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e '.[dev]')")

# -- HF decoders on meta -----------------------------------------------------------------------------------
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def _hf_configs():
    return {
        "llama": transformers.LlamaConfig(**TINY),
        "mistral": transformers.MistralConfig(**TINY),
        "qwen2": transformers.Qwen2Config(**TINY),
        "gemma": transformers.GemmaConfig(**TINY, head_dim=16),
        "phi3": transformers.Phi3Config(**TINY, pad_token_id=0),
        "gpt2": transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    }


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma", "phi3", "gpt2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_decoders_capture_on_meta(family, attn):
    """Built from their configs (no weights), bf16 autocast requested for the CPU (what the HF Trainer's
    bf16=True chooses without a GPU), two training steps captured on meta. sdpa runs flash on an
    A100 (bf16, causal, no mask; GQA for the decoders with fewer key/value heads), once per layer and
    step; eager runs no SDPA."""
    cfg = _hf_configs()[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    model.train()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.empty(2, 32, dtype=torch.long, device="meta")

    def step():
        with torch.autocast("cpu", dtype=BF16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    notes = []
    stream = capture_stream(step, existing=list(model.parameters()), device="meta", gpu="a100", notes=notes, calls=2)
    assert len(stream.sizes) > 500
    assert dict(notes[0].sdpa) == ({"flash": 4} if attn == "sdpa" else {})
    assert sorted(notes[0].optimizers) == ["adam: foreach"]
    assert notes[0].translations()   # the cpu autocast is said


def test_hf_flash_attention_2_is_refused_with_a_clear_line():
    """attn_implementation="flash_attention_2" needs the flash_attn package (CUDA only, not
    installable here): transformers refuses it before any capture, naming the package."""
    cfg = _hf_configs()["llama"]
    with pytest.raises((ImportError, ValueError), match="flash_attn|[Ff]lash[Aa]ttention"):
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2")


