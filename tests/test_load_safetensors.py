"""ktorch.load on Hugging Face checkpoint folders: experts stored per expert (as released checkpoints and
transformers' save_pretrained write them, Mixtral's block_sparse_moe.w1/w3/w2 included) or fused (transformers
>= 5 parameter names); logits against HF eager; and peak memory while loading, measured in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ktorch
from ktorch.integrations import packed_experts_of
from models import assert_logits_match, moe_experts_modules, tiny_model

pytest.importorskip("safetensors")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_per_expert_checkpoint_matches_hf_eager(family, tmp_path):
    torch.manual_seed(0)
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    index = json.dumps(sorted(__import__("safetensors").safe_open(str(tmp_path / "model.safetensors"), "pt").keys()))
    assert ".experts.0." in index  # stored one expert at a time
    if family == "mixtral":
        assert "block_sparse_moe.experts.0.w1.weight" in index
    loaded, _ = ktorch.load(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    assert all(m.kt_format == "bf16" for m in moe_experts_modules(loaded))
    assert_logits_match(model, loaded, torch.float32, torch.randint(0, 256, (1, 48)))


def test_fused_checkpoint_int8(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe")
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded, _ = ktorch.load(tmp_path, device="cpu", dtype=torch.float32, experts_dtype="int8", progress=False)
    for want, got in zip(moe_experts_modules(model), moe_experts_modules(loaded)):
        gate_up, down = packed_experts_of(got).dequantize()
        assert got.kt_format == "int8"
        for a, b in ((gate_up, want.gate_up_proj), (down, want.down_proj)):
            assert ((a - b).norm() / b.norm()).item() < 0.01  # int8 per-channel rounding only


_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, ktorch

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    from transformers import AutoConfig, AutoModelForCausalLM  # code pages of the libraries are not loading memory
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
    base = status("VmRSS")
    model, _ = ktorch.load(sys.argv[1], device="cpu", experts_dtype="int4", progress=False)
    packed = sum(t.numel() * t.element_size() for m in model.modules() if getattr(m, "kt_w13", None) is not None
                 for t in (m.kt_w13, m.kt_w13_scales, m.kt_w2, m.kt_w2_scales))
    print(json.dumps({"base": base, "peak": status("VmHWM"), "packed": packed}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc for VmHWM")
def test_peak_memory_is_packed_model_plus_about_one_layer(tmp_path):
    """12 layers of 64 experts (H=256, I=512): 600 MB of bf16 experts on disk, 150 MB packed as int4. Loading
    peaks at the packed model plus about one layer of unpacked experts, far below the checkpoint's size."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", num_hidden_layers=12, hidden_size=256, moe_intermediate_size=512, num_experts=64,
                       num_experts_per_tok=4, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    layer_fp32 = 64 * 3 * 256 * 512 * 4  # one layer's unpacked experts, fp32: 100 MB
    checkpoint_experts = 12 * layer_fp32 // 2  # bf16 on disk: 600 MB
    del model
    env = dict(os.environ, OMP_NUM_THREADS="2")
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout.strip().splitlines()[-1])
    grew = m["peak"] - m["base"]
    bound = m["packed"] + 2.5 * layer_fp32 + 64e6
    print(f"peak RSS growth {grew / 1e6:.0f} MB, packed {m['packed'] / 1e6:.0f} MB, bound {bound / 1e6:.0f} MB, "
          f"checkpoint experts {checkpoint_experts / 1e6:.0f} MB")
    assert bound < checkpoint_experts  # the bound means something: holding the checkpoint would break it
    assert grew <= bound, f"loading grew RSS by {grew / 1e6:.0f} MB > {bound / 1e6:.0f} MB"


def test_builtin_name_loads_the_shipped_model():
    """ktorch.load("builtin") is the model `ktorch generate --model builtin` runs: the shipped checkpoint, experts
    packed, logits equal to loading its folder by path."""
    from ktorch.builtin import BUILTIN_PATH

    model, tokenizer = ktorch.load("builtin", device="cpu", experts_dtype="bf16", progress=False)
    by_path, _ = ktorch.load(BUILTIN_PATH, device="cpu", experts_dtype="bf16", progress=False, tokenizer=False)
    ids = tokenizer("The meaning of life is", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, by_path(ids).logits, rtol=0, atol=0)
    assert any(getattr(m, "kt_format", None) == "bf16" for m in model.modules())
