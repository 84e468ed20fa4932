"""ktorch.load on a gpt-oss checkpoint folder whose experts are OpenAI's MXFP4 blocks (``...experts.gate_up_proj_blocks``
/ ``_scales``, ``down_proj_blocks`` / ``_scales``, as the gpt-oss releases hold them), written here from a tiny random
transformers gpt_oss model: its expert weights encoded by the gguf package's MXFP4 quantizer and re-laid in OpenAI's
nibble order, with the release's ``quantization_config``.

- ``experts_dtype="auto"``: the experts stay MXFP4 4-bit codes (float4_e2m1fn_x2, 0.625 bytes a weight) whose weights
  are transformers' own decoding of the blocks (``convert_moe_packed_tensors``) bit for bit, biases too;
- an explicit dtype decodes them (bf16: the same weights, exactly);
- the model: ktorch's logits against transformers' eager gpt_oss holding the decoded weights;
- a scale byte past the exact range: CheckpointError.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import ktorch
from ktorch.integrations import packed_experts_of
from ktorch.integrations.checkpoint_loading import CheckpointError
from ktorch.integrations.gguf_loading import MXFP4_MAX_SCALE
from models import moe_experts_modules
from test_integrations_families import assert_logits_close
from test_load_gguf_gpt_oss import _tiny

pytest.importorskip("gguf")  # the blocks are made by the gguf package's MXFP4 quantizer
from ktorch.integrations.gguf_writer import encode  # noqa: E402

PARAMS = ("gate_up_proj", "down_proj")


def openai_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A transposed experts parameter [E, K, N] as OpenAI's MXFP4 tensors: blocks uint8 [E, N, K/32, 16] (element
    2j of a block in the low nibble of byte j, 2j + 1 in the high one) and scales uint8 [E, N, K/32] (E8M0)."""
    rows = w.detach().float().transpose(1, 2).contiguous()
    E, N, K = rows.shape
    b = encode(rows.numpy(), "MXFP4").reshape(E, N, K // 32, 17)  # GGML: scale byte, then elements j | j + 16 << 4
    nibbles = np.concatenate([b[..., 1:] & 0xF, b[..., 1:] >> 4], axis=-1)  # [.., 32] in element order
    blocks = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    return torch.from_numpy(blocks), torch.from_numpy(np.ascontiguousarray(b[..., 0]))


def write_folder(path, edit_scales=None):
    """A tiny gpt_oss saved with its experts as OpenAI's MXFP4 blocks; returns (model, folder, {key: tensor})."""
    from safetensors.torch import load_file, save_file

    model = _tiny()
    model.save_pretrained(path)
    (file,) = path.glob("*.safetensors")
    state = load_file(str(file))
    for key in [k for k in state if k.endswith(tuple(f"experts.{p}" for p in PARAMS))]:
        blocks, scales = openai_blocks(state.pop(key))
        if edit_scales is not None and key.endswith("layers.1.mlp.experts.down_proj"):
            edit_scales(scales)
        state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
    save_file(state, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return model, path, state


def transformers_weights(state: dict, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' decoding of layer's blocks (convert_moe_packed_tensors: the module's [E, K, N]) as
    (gate_up [E, 2I, H] gate rows then up rows, down [E, H, I]) in float32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    key = f"model.layers.{layer}.mlp.experts"
    gate_up, down = (convert_moe_packed_tensors(state[f"{key}.{p}_blocks"], state[f"{key}.{p}_scales"],
                                                dtype=torch.float32).transpose(1, 2) for p in PARAMS)
    return torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1), down


@pytest.fixture(scope="module")
def openai_folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.mark.parametrize("experts_dtype", ["auto", "bf16"])
def test_experts_are_the_blocks_values(openai_folder, experts_dtype):
    _, path, state = openai_folder
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.bfloat16, experts_dtype=experts_dtype, progress=False)
    c = loaded.config
    for layer, module in enumerate(moe_experts_modules(loaded)):
        packed = packed_experts_of(module)
        E, I, H = c.num_local_experts, c.intermediate_size, c.hidden_size
        if experts_dtype == "auto":
            assert module.kt_format == "mxfp4" and packed.w13.dtype == packed.w2.dtype == torch.float4_e2m1fn_x2
            assert sum(t.nbytes for t in packed.tensors()) == E * 3 * H * I * (0.5 + 4 / 32)
        else:
            assert module.kt_format == "bf16"
        want_gate_up, want_down = transformers_weights(state, layer)
        gate_up, down = packed.dequantize()
        assert want_gate_up.abs().max() > 0
        assert torch.equal(gate_up.float(), want_gate_up) and torch.equal(down.float(), want_down)
        b = state[f"model.layers.{layer}.mlp.experts.gate_up_proj_bias"]
        assert torch.equal(packed.w13_bias, torch.cat([b[:, 0::2], b[:, 1::2]], dim=1).float())
        assert torch.equal(packed.w2_bias, state[f"model.layers.{layer}.mlp.experts.down_proj_bias"].float())


def test_logits_match_hf_eager(openai_folder):
    model, path, state = openai_folder
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer, m in enumerate(moe_experts_modules(reference)):
            gate_up, down = transformers_weights(state, layer)
            I = gate_up.shape[1] // 2
            interleaved = torch.stack([gate_up[:, :I], gate_up[:, I:]], dim=2).reshape(gate_up.shape)
            m.gate_up_proj.copy_(interleaved.transpose(1, 2))
            m.down_proj.copy_(down.transpose(1, 2))
    loaded, _ = ktorch.load(path, device="cpu", dtype=torch.bfloat16, progress=False)
    ids = torch.randint(0, 256, (1, 40))
    assert_logits_close(reference.bfloat16(), loaded, ids, what="gpt-oss MXFP4 safetensors")


def test_scale_past_the_exact_range_is_an_error(tmp_path):
    def edit(scales):
        scales.view(-1)[3] = MXFP4_MAX_SCALE + 1

    _, path, _ = write_folder(tmp_path / "over", edit)
    with pytest.raises(CheckpointError, match=r"down_proj_scales.*E8M0 byte 253"):
        ktorch.load(path, device="cpu", progress=False)
