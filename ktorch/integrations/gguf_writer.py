"""Writing llama.cpp GGUF files of MoE models: tiny ones from transformers models (tests) and big synthetic ones
(benchmarks/make_gguf.py), with names, shapes and metadata as llama.cpp's convert_hf_to_gguf.py writes them.

Tensor names come from the gguf package's own map (``gguf.get_tensor_name_map``); routed experts are stacked as
``blk.N.ffn_{gate,up}_exps.weight`` [E, I, H] and ``blk.N.ffn_down_exps.weight`` [E, H, I] (numpy order); for the
llama architecture (Mixtral) the Q and K projections are permuted as llama.cpp's converter does. Tensors are
encoded with ``gguf.quants.quantize`` where the gguf package can (F32, F16, BF16, Q8_0, Q4_0, ...); for Q4_K, Q5_K
and Q6_K, which it only decodes, ``quantize_k`` encodes with a plain per-sub-block min/max rule (not llama.cpp's
error search: the blocks are valid and decode with ``gguf.quants.dequantize``, they are just not optimal).

Writing streams: each tensor is produced and written in turn (``GGUFFileWriter``), so memory stays at one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

QK_K = 256


def _gguf():
    import gguf

    return gguf


# ---------------------------------------------------------------- K-quant encoders (gguf.quants only decodes them)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _quantize_q4_k_like(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K scales: 8 sub-blocks of 32, ``w = d*sc*q - dmin*m`` with q < 2**bits, 6-bit sc and m."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # [n, 8], <= 0 so that the subtracted minimum is >= 0
    hi = sub.max(-1)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    offset = -lo
    d = scale.max(-1, keepdims=True) / 63
    dmin = offset.max(-1, keepdims=True) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16 > 0, np.round(scale / d16), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dmin16 > 0, np.round(offset / dmin16), 0).clip(0, 63).astype(np.uint8)
        step = (d16 * sc)[..., None]
        q = np.where(step > 0, np.round((sub + (dmin16 * mn)[..., None]) / step), 0)
    q = q.clip(0, levels).astype(np.uint8)  # [n, 8, 32]
    packed_scales = np.empty((n, 12), dtype=np.uint8)
    packed_scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed_scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return d, dmin, packed_scales, q


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_q4_k_like(blocks, 4)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2i (low nibble) and 2i+1 (high nibble) share 32 bytes
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_q4_k_like(blocks, 5)
    low, high = q & 0x0F, q >> 4  # [n, 8, 32]
    pairs = low.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):  # bit 4 of sub-block j lives in bit j of byte l
        qh |= high[:, j] << j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, qs], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31  # [n, 16]; q - 32 in [-32, 31]
    d = scale.max(-1, keepdims=True) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16 > 0, np.round(scale / d16), 0).clip(-128, 127).astype(np.int8)
        step = (d16 * sc)[..., None]
        q = np.where(step != 0, np.round(sub / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 256)
    low, high = q & 0x0F, q >> 4
    halves = low.reshape(n, 2, 2, 64)  # [half, nibble, byte]
    ql = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, 128)
    quarters = high.reshape(n, 2, 4, 32)  # [half, 2-bit field, byte]
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for t in range(4):
        qh |= quarters[:, :, t] << (2 * t)
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


_K_ENCODERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def quantize_k(data: np.ndarray, type_name: str) -> np.ndarray:
    """Encodes ``data`` [..., K] (K a multiple of 256) as Q4_K, Q5_K or Q6_K blocks: uint8 [..., K/256*type_size]."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block_size:
        raise ValueError(f"quantize_k: the last dimension {data.shape[-1]} is not a multiple of {block_size} ({type_name})")
    blocks = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, block_size)
    encoded = _K_ENCODERS[type_name](blocks)
    assert encoded.shape[1] == type_size
    return encoded.reshape(*data.shape[:-1], data.shape[-1] // block_size * type_size)


def encode(data: np.ndarray, type_name: str) -> np.ndarray:
    """``data`` [..., K] float as GGML type ``type_name``: float32/float16 arrays for F32/F16, else uint8 bytes
    [..., row bytes] (BF16 included)."""
    gguf = _gguf()
    if type_name in _K_ENCODERS:
        return quantize_k(data, type_name)
    if type_name == "F64":  # llama.cpp never writes it for weights; tests use it as a type ktorch rejects
        return np.ascontiguousarray(data, dtype=np.float64).view(np.uint8)
    encoded = gguf.quants.quantize(np.asarray(data, dtype=np.float32), gguf.GGMLQuantizationType[type_name])
    if type_name == "BF16":
        encoded = encoded.view(np.uint8)
    return encoded


# ---------------------------------------------------------------- streaming file writer


@dataclass
class PlannedTensor:
    """A tensor to write: its GGUF name, numpy-order shape, GGML type name and a function producing its data
    (float [shape], or already encoded bytes when ``encoded`` is True)."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    produce: Callable[[], np.ndarray]
    encoded: bool = False


class GGUFFileWriter:
    """Metadata plus tensors written one at a time (``gguf.GGUFWriter``'s tensor-info-then-data protocol)."""

    def __init__(self, path: Path, arch: str):
        gguf = _gguf()
        self.path = Path(path)
        self.writer = gguf.GGUFWriter(str(self.path), arch)
        self.plan: list[PlannedTensor] = []

    def add(self, tensor: PlannedTensor) -> None:
        self.plan.append(tensor)

    def write(self, progress: bool = False) -> None:
        gguf = _gguf()
        for t in self.plan:
            qtype = gguf.GGMLQuantizationType[t.type_name]
            if t.type_name == "F32":
                self.writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), int(np.prod(t.shape)) * 4)
            elif t.type_name == "F16":
                self.writer.add_tensor_info(t.name, t.shape, np.dtype(np.float16), int(np.prod(t.shape)) * 2)
            else:
                byte_shape = gguf.quants.quant_shape_to_byte_shape(t.shape, qtype)
                self.writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()
        plan = self.plan
        if progress:
            from tqdm.auto import tqdm

            plan = tqdm(plan, desc=f"writing {self.path.name}", unit="tensor")
        for t in plan:
            data = t.produce()
            if not t.encoded:
                data = encode(data, t.type_name)
            self.writer.write_tensor_data(np.ascontiguousarray(data))
        self.writer.close()


# ---------------------------------------------------------------- transformers model -> GGUF

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "deepseek_v2": "deepseek2",
             "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss"}


def llama_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for llama-architecture rotary embeddings (rotate-half pairs -> adjacent)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def add_arch_metadata(writer, config, arch: str, vocab_size: int) -> None:
    """The ``{arch}.*`` keys llama.cpp reads for ``config`` (a transformers config)."""
    w = writer
    a = arch
    n_head = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    rope = getattr(config, "rope_parameters", None) or {}
    w.add_uint32(f"{a}.block_count", config.num_hidden_layers)
    w.add_uint32(f"{a}.context_length", config.max_position_embeddings)
    w.add_uint32(f"{a}.embedding_length", config.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", config.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", config.num_key_value_heads)
    w.add_float32(f"{a}.rope.freq_base", float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    w.add_uint32(f"{a}.vocab_size", vocab_size)
    if arch == "llama":
        w.add_uint32(f"{a}.expert_count", config.num_local_experts)
        w.add_uint32(f"{a}.expert_used_count", config.num_experts_per_tok)
        w.add_uint32(f"{a}.rope.dimension_count", head_dim)
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)
    elif arch == "gpt-oss":  # as llama.cpp's GptOssModel writes it
        w.add_uint32(f"{a}.expert_count", config.num_local_experts)
        w.add_uint32(f"{a}.expert_used_count", config.num_experts_per_tok)
        w.add_uint32(f"{a}.expert_feed_forward_length", config.intermediate_size)
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)
        if config.sliding_window:
            w.add_uint32(f"{a}.attention.sliding_window", config.sliding_window)
        if rope.get("rope_type") == "yarn":
            w.add_string(f"{a}.rope.scaling.type", "yarn")
            w.add_float32(f"{a}.rope.scaling.factor", float(rope["factor"]))
            w.add_uint32(f"{a}.rope.scaling.original_context_length", int(rope["original_max_position_embeddings"]))
    elif arch in ("qwen3moe", "qwen2moe"):
        w.add_uint32(f"{a}.expert_count", config.num_experts)
        w.add_uint32(f"{a}.expert_used_count", config.num_experts_per_tok)
        w.add_uint32(f"{a}.expert_feed_forward_length", config.moe_intermediate_size)
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)
        if arch == "qwen2moe":
            w.add_uint32(f"{a}.expert_shared_feed_forward_length", config.shared_expert_intermediate_size)
    elif arch == "deepseek2":
        w.add_uint32(f"{a}.leading_dense_block_count", config.first_k_dense_replace)
        w.add_uint32(f"{a}.expert_count", config.n_routed_experts)
        w.add_uint32(f"{a}.expert_used_count", config.num_experts_per_tok)
        w.add_uint32(f"{a}.expert_feed_forward_length", config.moe_intermediate_size)
        w.add_uint32(f"{a}.expert_shared_count", config.n_shared_experts)
        w.add_float32(f"{a}.expert_weights_scale", float(config.routed_scaling_factor))
        w.add_bool(f"{a}.expert_weights_norm", bool(config.norm_topk_prob))
        w.add_uint32(f"{a}.expert_gating_func", 2 if config.model_type == "deepseek_v3" else 1)  # sigmoid / softmax
        w.add_uint32(f"{a}.expert_group_count", getattr(config, "n_group", 1) or 1)
        w.add_uint32(f"{a}.expert_group_used_count", getattr(config, "topk_group", 1) or 1)
        if config.q_lora_rank:
            w.add_uint32(f"{a}.attention.q_lora_rank", config.q_lora_rank)
        w.add_uint32(f"{a}.attention.kv_lora_rank", config.kv_lora_rank)
        w.add_uint32(f"{a}.rope.dimension_count", config.qk_rope_head_dim)
        # MLA as current llama.cpp writes it: key/value lengths of the absorbed form, and of the plain form (_mla)
        w.add_uint32(f"{a}.attention.key_length", config.kv_lora_rank + config.qk_rope_head_dim)
        w.add_uint32(f"{a}.attention.value_length", config.kv_lora_rank)
        w.add_uint32(f"{a}.attention.key_length_mla", config.qk_nope_head_dim + config.qk_rope_head_dim)
        w.add_uint32(f"{a}.attention.value_length_mla", config.v_head_dim)


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` puts its BOS token first when it encodes text (GGUF's ``tokenizer.ggml.add_bos_token``)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def add_tokenizer_metadata(writer, tokenizer, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (transformers, ``tokenizer.json`` model type BPE) as ``tokenizer.ggml.*`` keys
    with model "gpt2", or ``tokenizer.ggml.model = "none"`` when ``tokenizer`` is None (a benchmark file)."""
    if tokenizer is None:
        writer.add_tokenizer_model("none")
        return
    import json

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    tokens = [""] * vocab_size
    types = [1] * vocab_size  # normal
    for token, index in vocab.items():
        tokens[index] = token
    for added in state.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added.get("special") else 4  # control / user defined
    for i, t in enumerate(tokens):
        if not t:
            tokens[i], types[i] = f"[PAD{i}]", 5  # unused
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex of a ByteLevel(use_regex=True) pre-tokenizer
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(adds_bos(tokenizer))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        writer.add_chat_template(template)


def write_gguf_from_model(
    model,
    path: Path,
    experts_type: str = "Q8_0",
    other_type: str = "F16",
    tokenizer=None,
    experts_types: Optional[dict[str, str]] = None,
    edit: Optional[Callable[[list[PlannedTensor]], list[PlannedTensor]]] = None,
) -> Path:
    """Writes a transformers MoE model (Qwen2/3-MoE, Mixtral, DeepSeek-V2/V3, gpt-oss) as llama.cpp's converter
    would (gpt-oss: MXFP4 experts with ``experts_type="MXFP4"``, expert biases F32).

    Args:
        model: the causal LM (weights on the CPU; transformers >= 5 fused experts ``gate_up_proj`` [E, 2I, H],
            ``down_proj`` [E, H, I]).
        path: the .gguf file to write.
        experts_type: GGML type name of the routed experts (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, BF16, F16, F32, ...).
        other_type: type of the other 2-D weights (1-D tensors and routers stay F32, as llama.cpp keeps them).
        tokenizer: a byte-level BPE transformers tokenizer to embed, or None for ``tokenizer.ggml.model = "none"``.
        experts_types: per projection overrides, e.g. ``{"down": "Q6_K"}`` (as Q4_K_M files mix types).
        edit: changes the list of tensors before writing (tests of bad files drop or reshape one).
    """
    import torch

    gguf = _gguf()
    config = model.config
    arch = GGUF_ARCH[config.model_type]
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    vocab_size = state["model.embed_tokens.weight"].shape[0]
    out = GGUFFileWriter(path, arch)
    out.writer.add_name(f"ktorch-test-{config.model_type}")
    out.writer.add_file_type(1 if other_type == "F16" else 0)
    add_arch_metadata(out.writer, config, arch, vocab_size)
    add_tokenizer_metadata(out.writer, tokenizer, vocab_size)
    out.writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tied = getattr(config, "tie_word_embeddings", False)
    types = {"gate": experts_type, "up": experts_type, "down": experts_type, **(experts_types or {})}

    def const(a):
        return lambda: a

    for key, value in state.items():
        if key == "lm_head.weight" and tied:
            continue
        if arch == "gpt-oss" and ".mlp.experts." in key:  # [E, H, 2I] interleaved gate/up -> separate [E, I, H]
            layer = int(key.split(".layers.")[1].split(".")[0])
            param = key.rsplit(".", 1)[1]
            blk = f"blk.{layer}.ffn"
            if param == "gate_up_proj":
                for proj, part in (("gate", value[:, :, 0::2]), ("up", value[:, :, 1::2])):
                    part = np.ascontiguousarray(part.transpose(0, 2, 1))
                    out.add(PlannedTensor(f"{blk}_{proj}_exps.weight", part.shape, types[proj], const(part)))
            elif param == "gate_up_proj_bias":
                for proj, part in (("gate", value[:, 0::2]), ("up", value[:, 1::2])):
                    part = np.ascontiguousarray(part)
                    out.add(PlannedTensor(f"{blk}_{proj}_exps.bias", part.shape, "F32", const(part)))
            elif param == "down_proj":
                part = np.ascontiguousarray(value.transpose(0, 2, 1))
                out.add(PlannedTensor(f"{blk}_down_exps.weight", part.shape, types["down"], const(part)))
            else:
                out.add(PlannedTensor(f"{blk}_down_exps.bias", value.shape, "F32", const(value)))
            continue
        if key.endswith(".experts.gate_up_proj"):
            layer = int(key.split(".layers.")[1].split(".")[0])
            inter = value.shape[1] // 2
            out.add(PlannedTensor(f"blk.{layer}.ffn_gate_exps.weight", value[:, :inter].shape, types["gate"],
                                  const(np.ascontiguousarray(value[:, :inter]))))
            out.add(PlannedTensor(f"blk.{layer}.ffn_up_exps.weight", value[:, inter:].shape, types["up"],
                                  const(np.ascontiguousarray(value[:, inter:]))))
            continue
        if key.endswith(".experts.down_proj"):
            layer = int(key.split(".layers.")[1].split(".")[0])
            out.add(PlannedTensor(f"blk.{layer}.ffn_down_exps.weight", value.shape, types["down"], const(value)))
            continue
        if key.endswith("self_attn.kv_b_proj.weight"):  # MLA: llama.cpp splits kv_b into k_b (transposed) and v_b
            layer = int(key.split(".layers.")[1].split(".")[0])
            n_head = config.num_attention_heads
            kv_b = value.reshape(n_head, config.qk_nope_head_dim + config.v_head_dim, -1)
            k_b = np.ascontiguousarray(kv_b[:, : config.qk_nope_head_dim].transpose(0, 2, 1))  # [n_head, kv_lora, nope]
            v_b = np.ascontiguousarray(kv_b[:, config.qk_nope_head_dim:])  # [n_head, v_head_dim, kv_lora]
            out.add(PlannedTensor(f"blk.{layer}.attn_k_b.weight", k_b.shape, other_type, const(k_b)))
            out.add(PlannedTensor(f"blk.{layer}.attn_v_b.weight", v_b.shape, other_type, const(v_b)))
            continue
        hf_key = key.replace(".e_score_correction_bias", ".e_score_correction.bias")
        name = name_map.get_name(hf_key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"write_gguf_from_model: no GGUF name for {key}")
        if key.endswith("self_attn.sinks"):
            name += ".weight"  # as llama.cpp's converter names it
        if arch == "llama" and key.endswith("self_attn.q_proj.weight"):
            value = llama_permute(value, config.num_attention_heads)
        elif arch == "llama" and key.endswith("self_attn.k_proj.weight"):
            value = llama_permute(value, config.num_key_value_heads)
        keep_f32 = value.ndim == 1 or name.endswith("ffn_gate_inp.weight") or name.endswith("ffn_gate_inp_shexp.weight")
        out.add(PlannedTensor(name, value.shape, "F32" if keep_f32 else other_type, const(value)))
    if edit is not None:
        out.plan = edit(out.plan)
    with torch.no_grad():
        out.write()
    return Path(path)


# ---------------------------------------------------------------- synthetic benchmark files

FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
              "Q6_K": "MOSTLY_Q6_K", "BF16": "MOSTLY_BF16", "F16": "MOSTLY_F16", "F32": "ALL_F32"}


def write_random_qwen3moe_gguf(
    path: Path,
    experts_type: str = "Q8_0",
    num_layers: int = 48,
    num_experts: int = 128,
    experts_per_token: int = 8,
    hidden_size: int = 2048,
    expert_intermediate_size: int = 768,
    num_heads: int = 32,
    num_kv_heads: int = 4,
    head_dim: int = 128,
    vocab_size: int = 151936,
    distinct_experts: int = 4,
    seed: int = 0,
    progress: bool = True,
    router_skew: float = 0.0,
) -> Path:
    """A random qwen3moe GGUF (Qwen3-30B-A3B's shape by default) for speed benchmarks: no tokenizer
    (``tokenizer.ggml.model = "none"``, ``qwen3moe.vocab_size``), experts in ``experts_type``, other matrices F16.

    Each layer's experts repeat ``distinct_experts`` random experts (encoded once), so every expert has its own
    bytes in the file and the same access pattern as a real model while writing stays fast; memory stays at one
    tensor. llama.cpp's ``llama-bench`` and ``ktorch generate --model`` accept the file.

    ``router_skew`` s > 0 makes routing concentrate like a Zipf law of exponent about s (qwen3moe routers have no
    bias tensor, so the bias rides on the hidden states): every token embedding gets one shared direction u (as long
    as its random part), and each layer's router row of the expert of rank r (a random order per layer) gets
    -s * ln(r + 1) / |x . u| along u, where x . u is the shared direction's share of a normalized layer input. The
    bias is strongest in the first layers and fades as the residual stream grows. 0 (default): near-uniform routing.
    """
    from transformers import AutoConfig

    gguf = _gguf()
    if num_experts % distinct_experts:
        raise ValueError(f"write_random_qwen3moe_gguf: num_experts={num_experts} must be a multiple of "
                         f"distinct_experts={distinct_experts}")
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=6144, moe_intermediate_size=expert_intermediate_size, num_experts=num_experts,
        num_experts_per_tok=experts_per_token, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    rng = np.random.default_rng(seed)
    out = GGUFFileWriter(path, "qwen3moe")
    out.writer.add_name(f"random Qwen3-30B-A3B-shaped MoE ({experts_type} experts)")
    out.writer.add_file_type(int(gguf.LlamaFileType[FILE_TYPES.get(experts_type, "MOSTLY_Q8_0")]))
    add_arch_metadata(out.writer, config, "qwen3moe", vocab_size)
    add_tokenizer_metadata(out.writer, None, vocab_size)
    out.writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def normal(shape, std):
        return lambda: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def ones(n):
        return lambda: np.ones(n, dtype=np.float32)

    H, I, E = hidden_size, expert_intermediate_size, num_experts
    pools = {}

    def experts(proj: str, rows: int, cols: int):
        def produce():
            if proj not in pools:  # encoded once, reused by every layer
                pools[proj] = encode(rng.standard_normal((distinct_experts, rows, cols), dtype=np.float32)
                                     * np.float32(cols ** -0.5), experts_type)
            return np.tile(pools[proj], (E // distinct_experts, 1, 1))
        return produce

    skew_rng = np.random.default_rng(seed + 1_000_003)  # its own draws: with no skew the file is what it was
    shared = skew_rng.standard_normal(H).astype(np.float32)
    shared /= np.linalg.norm(shared)

    def embeddings():
        e = rng.standard_normal((vocab_size, H), dtype=np.float32) * np.float32(0.02)
        if router_skew > 0:
            e += shared * np.float32(0.02 * H ** 0.5)  # as long as the random part
        return e

    def router():
        w = rng.standard_normal((E, H), dtype=np.float32) * np.float32(H ** -0.5)
        if router_skew > 0:
            rank = skew_rng.permutation(E)
            along = (H / 2) ** 0.5  # u's share of an RMS-normalized input: half its square norm H
            w += np.outer(-router_skew * np.log1p(rank) / along, shared).astype(np.float32)
        return w

    out.add(PlannedTensor("token_embd.weight", (vocab_size, H), "F16", embeddings))
    for b in range(num_layers):
        blk = f"blk.{b}"
        out.add(PlannedTensor(f"{blk}.attn_norm.weight", (H,), "F32", ones(H)))
        out.add(PlannedTensor(f"{blk}.attn_q.weight", (num_heads * head_dim, H), "F16", normal((num_heads * head_dim, H), H ** -0.5)))
        out.add(PlannedTensor(f"{blk}.attn_k.weight", (num_kv_heads * head_dim, H), "F16", normal((num_kv_heads * head_dim, H), H ** -0.5)))
        out.add(PlannedTensor(f"{blk}.attn_v.weight", (num_kv_heads * head_dim, H), "F16", normal((num_kv_heads * head_dim, H), H ** -0.5)))
        out.add(PlannedTensor(f"{blk}.attn_output.weight", (H, num_heads * head_dim), "F16", normal((H, num_heads * head_dim), (num_heads * head_dim) ** -0.5)))
        out.add(PlannedTensor(f"{blk}.attn_q_norm.weight", (head_dim,), "F32", ones(head_dim)))
        out.add(PlannedTensor(f"{blk}.attn_k_norm.weight", (head_dim,), "F32", ones(head_dim)))
        out.add(PlannedTensor(f"{blk}.ffn_norm.weight", (H,), "F32", ones(H)))
        out.add(PlannedTensor(f"{blk}.ffn_gate_inp.weight", (E, H), "F32", router))
        out.add(PlannedTensor(f"{blk}.ffn_gate_exps.weight", (E, I, H), experts_type, experts("gate", I, H), encoded=True))
        out.add(PlannedTensor(f"{blk}.ffn_up_exps.weight", (E, I, H), experts_type, experts("up", I, H), encoded=True))
        out.add(PlannedTensor(f"{blk}.ffn_down_exps.weight", (E, H, I), experts_type, experts("down", H, I), encoded=True))
    out.add(PlannedTensor("output_norm.weight", (H,), "F32", ones(H)))
    out.add(PlannedTensor("output.weight", (vocab_size, H), "F16", normal((vocab_size, H), H ** -0.5)))
    out.write(progress=progress)
    return Path(path)
