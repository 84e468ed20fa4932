"""A llama.cpp GGUF file as a ``CheckpointSource``: metadata -> transformers config, tensors -> transformers layout.

Parsing is the gguf package's (``gguf.GGUFReader``, ``gguf.quants.dequantize``, ``gguf.get_tensor_name_map``).

Architectures (``general.architecture`` -> transformers ``model_type``):
  qwen3moe -> qwen3_moe, qwen2moe -> qwen2_moe, llama with experts -> mixtral (Q/K rows un-permuted: llama.cpp's
  converter permutes them for its rotary layout), deepseek2 -> deepseek_v3 (sigmoid gating, ``exp_probs_b``) or
  deepseek_v2 (softmax gating); MLA's ``attn_k_b``/``attn_v_b`` are joined back into ``kv_b_proj``; gpt-oss ->
  gpt_oss (expert biases ``ffn_{gate,up,down}_exps.bias``, router bias, attention sinks, sliding-window layers;
  the experts module's interleaved, transposed parameters are assembled from the separate gate/up tensors and
  packed with the ``swiglu_oai`` activation of the config).

Routed experts (``blk.N.ffn_{gate,up}_exps.weight`` [E, I, H], ``ffn_down_exps.weight`` [E, H, I] in numpy order)
become the op's packed formats. With ``experts_dtype="auto"`` the file's own values, exactly (``EXACT_TYPES``,
``exact_codes``; no requantization): the op computes with codes * scale - min per group as the file stores them:
  Q8_0 -> int8 codes, a scale per 32          Q6_K -> int8 codes -32..31, a scale (d * sc) per 16
  Q5_K -> int8 codes 0..31, scale and min per 32   MXFP4 -> 4-bit E2M1 codes (doubled), scale 2**(e-128) per 32
  Q4_0 -> int4 codes q - 8, a scale per 32     Q4_K -> int4 codes 0..15 (nibbles), scale and min per 32
  (scales and minimums float32: an fp16 times a 6-bit integer, or a power of two, is exact there); gate and up of
  different types take the wider form (int8, the smaller group); w13 and w2 may differ (Q4_K_M: int4 gate/up,
  int8 down). gpt-oss's MXFP4 experts come with their biases (gate's then up's, down's).
  Layers with another type (Q4_1, Q2_K, IQ*, F16, ...): BF16, F16, F32 -> bf16, the rest -> int8 per channel.
An explicit ``experts_dtype`` converts every layer to it (requantizing; Q4_0 -> int4 with group 32 stays exact) and
prints the measured relative error against the file's values once.
docs/loading.md lists what each conversion loses, measured against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ktorch.integrations.checkpoint_loading import CheckpointError, CheckpointSource, _layer_index
from ktorch.ops.moe import GGUF_NATIVE_BLOCK_SIZES, PackedExperts, pack_experts, pack_kscales, pack_quantized

ARCHITECTURES = ("qwen3moe", "qwen2moe", "deepseek2", "llama", "gpt-oss")
_EXPERT_PROJS = ("gate", "up", "down")
# The largest E8M0 scale byte of an MXFP4 block decoded exactly: byte e scales the E2M1 values (0.5 .. 6, doubled
# to integers by the gguf package) by 2**(e-127); e = 252 gives at most 6 * 2**125, e = 253 overflows float32 for
# 12 (doubled 6), and 255 is NaN in the OCP MX format. Every byte <= 252 gives values with <= 2 significant bits
# in bf16's exponent range, subnormals down to 2**-133 included: exact.
MXFP4_MAX_SCALE = 252
_RANK = {"int4": 0, "int8": 1, "bf16": 2}
# experts_format's answer for a layer whose expert types all have an exact form (EXACT_TYPES): read_experts re-lays
# the file's codes; the packed layer's format is then "gguf:<types>", e.g. "gguf:Q4_K/Q6_K".
EXACT_FORMAT = "exact"


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("loading GGUF files needs the gguf package: pip install gguf") from None
    return gguf


def _auto_format(type_name: str) -> str:
    if type_name in ("Q4_0", "Q4_K"):
        return "int4"
    if type_name in ("F32", "F16", "BF16", "MXFP4"):
        return "bf16"
    return "int8"


def _from_file(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of an array that may view the read-only file mapping, without torch's one-time warning
    about non-writable arrays: these tensors are only read (converted, packed or copied to the GPU), never written."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def decoded_shape(shape: tuple, qtype) -> tuple:
    """The value shape of a quantized GGUF tensor whose bytes (numpy order, rows as bytes) have ``shape``."""
    block_size, type_size = _gguf().GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // type_size * block_size)


def dequantize(data: np.ndarray, qtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GGUF tensor bytes (numpy order, quantized rows as bytes) -> float tensor [..., K] with the file's values.

    Float types are reinterpreted in place (float16/bfloat16 stay in that dtype). Q8_0, Q4_0, Q4_K, Q5_K and Q6_K
    blocks are decoded by ``kt.gguf_dequantize`` (all cores, the same float32 operations as the gguf package);
    other quantized types by the gguf package's own ``dequantize_blocks`` of the type, called on large batches of
    blocks from a few threads (numpy releases the GIL there). ``out``: a contiguous float32 tensor of the result's
    size that the native types decode into (and return, reshaped); ignored otherwise.
    """
    gguf = _gguf()
    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        return _from_file(np.ascontiguousarray(data).view(np.float32))
    if qtype == T.F16:
        return _from_file(np.ascontiguousarray(data).view(np.float16))
    if qtype == T.BF16:
        return _from_file(np.ascontiguousarray(data).view(np.int16)).view(torch.bfloat16)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = decoded_shape(data.shape, qtype)
    if qtype.name in GGUF_NATIVE_BLOCK_SIZES:  # ktorch's own decoder (csrc/formats/gguf.cpp): bit-identical, one parallel pass
        blocks = _from_file(np.ascontiguousarray(data).reshape(-1, type_size))
        if out is None:
            return torch.ops.kt.gguf_dequantize(blocks, qtype.name).reshape(shape)
        torch.ops.kt.gguf_dequantize_into(blocks, qtype.name, out)
        return out.view(shape)
    decoder = getattr(gguf.quants, qtype.name, None)
    if decoder is None or not hasattr(decoder, "dequantize_blocks"):
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))
    blocks = np.ascontiguousarray(data).reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    step = 16384
    spans = [(i, min(i + step, blocks.shape[0])) for i in range(0, blocks.shape[0], step)]

    def run(span):
        out[span[0]:span[1]] = decoder.dequantize_blocks(blocks[span[0]:span[1]])

    if len(spans) > 1:
        with ThreadPoolExecutor(max_workers=min(len(spans), torch.get_num_threads())) as pool:
            list(pool.map(run, spans))
    else:
        for span in spans:
            run(span)
    return torch.from_numpy(out).reshape(shape)


_READ_THREADS = 8
_READ_PIECE = 16 << 20
_READ_POOL: Optional[ThreadPoolExecutor] = None


def _pread(fd: int, out: np.ndarray, offset: int) -> None:
    """Fills the contiguous uint8 array ``out`` with the file's bytes from ``offset``: pieces of ``_READ_PIECE``
    bytes read by up to ``_READ_THREADS`` threads (``os.preadv`` releases the GIL), short reads continued; an
    EOFError where the file ends first."""
    view = memoryview(out).cast("B")
    n = len(view)

    def read(start: int) -> None:
        stop = min(start + _READ_PIECE, n)
        while start < stop:
            got = os.preadv(fd, [view[start:stop]], offset + start)
            if got <= 0:
                raise EOFError(f"the file ends at byte {offset + start}, before {offset + n}")
            start += got

    starts = range(0, n, _READ_PIECE)
    if len(starts) > 1:
        global _READ_POOL
        if _READ_POOL is None:  # one pool for the process: a load makes ~30 reads a layer
            _READ_POOL = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="ktorch-gguf-read")
        list(_READ_POOL.map(read, starts))
    elif n:
        read(0)


class _TruncatedTensor(ValueError):
    def __init__(self, name: str, start: int, end: int, size: int):
        super().__init__(name)
        self.name, self.start, self.end, self.size = name, start, end, size


def _reader_class():
    """``gguf.GGUFReader`` that, before laying out the tensors, checks each one's bytes lie inside the file, so a
    truncated file is reported with the first tensor it cuts (the plain reader fails in a numpy reshape)."""
    gguf = _gguf()

    class CheckedGGUFReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            for field in fields:
                try:
                    _, name_data, _, dims, raw_dtype, offset = field.parts
                    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                    start = int(start_offs + offset[0])
                    end = start + int(np.prod(dims)) * type_size // block_size
                except (ValueError, KeyError, TypeError):
                    break  # not the layout this check knows: let the reader decide
                if end > size:
                    raise _TruncatedTensor(bytes(name_data).decode("utf-8", "replace"), start, end, size)
            return super()._build_tensors(start_offs, fields)

    return CheckedGGUFReader


def _dequantizable(qtype) -> bool:
    gguf = _gguf()
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


class GGUFSource(CheckpointSource):
    """One llama.cpp GGUF file (split files are not supported)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        reader = _reader_class()  # outside the try: a missing gguf package is not a corrupt file
        try:
            self.reader = reader(str(self.path))
        except _TruncatedTensor as e:
            raise CheckpointError(self.path, f"the file ends before the tensor's data does (bytes {e.start}..{e.end} of a "
                                             f"{e.size}-byte file); truncated download?", tensor=e.name) from None
        except Exception as e:  # noqa: BLE001 - the reader raises ValueError, KeyError, IndexError... on bad bytes
            raise CheckpointError(self.path, f"cannot parse it as GGUF ({type(e).__name__}: {e}); the file is corrupt "
                                             f"or truncated ({size} bytes)") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:  # a truncated file leaves tensors short of their bytes
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise CheckpointError(self.path, f"the file ends before the tensor's data does (needs bytes "
                                                 f"{t.data_offset}..{t.data_offset + t.n_bytes}, the file has {size}); "
                                                 "truncated download?", tensor=t.name)
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(self.path, f"architecture {self.arch!r} is not supported (ktorch loads "
                                             f"{', '.join(ARCHITECTURES)} MoE models)")
        self._config = None
        self._hf_to_gguf: dict[str, str] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # read_experts' decode buffers, one per projection
        self._fd: Optional[int] = None  # the file, for _read_bytes' reads (opened at the first)
        self._loss_reported = False  # read_experts prints a requantization's measured loss once
        self._mmap: Optional[mmap.mmap] = None

    # ------------------------------------------------------------ metadata

    def _field(self, key: str, default=None):
        field = self.reader.get_field(key)
        if field is None:
            return default
        value = field.contents()
        return value

    def _required(self, key: str):
        value = self._field(f"{self.arch}.{key}")
        if value is None:
            raise CheckpointError(self.path, f"metadata key {self.arch}.{key} is missing; it is needed to build the model")
        return value

    def _gguf_shape(self, name: str) -> Optional[tuple[int, ...]]:
        """The numpy-order shape of tensor ``name`` ([rows, cols] = transformers' [out, in] for matrices)."""
        t = self.tensors.get(name)
        return None if t is None else tuple(int(d) for d in reversed(t.shape.tolist()))

    def default_dtype(self, device: torch.device) -> torch.dtype:
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def config(self):
        if self._config is not None:
            return self._config
        from transformers import AutoConfig

        f = self._required
        embed = self._gguf_shape("token_embd.weight")
        if embed is None:
            raise CheckpointError(self.path, "missing from the file", tensor="token_embd.weight")
        hidden = int(f("embedding_length"))
        heads = int(f("attention.head_count"))
        common = dict(
            vocab_size=embed[0],
            hidden_size=hidden,
            num_hidden_layers=int(f("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._field(f"{self.arch}.attention.head_count_kv", heads)),
            max_position_embeddings=int(self._field(f"{self.arch}.context_length", 4096)),
            rms_norm_eps=float(self._field(f"{self.arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_parameters={"rope_type": "default", "rope_theta": float(self._field(f"{self.arch}.rope.freq_base", 10000.0))},
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self._field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self._field("tokenizer.ggml.padding_token_id"),
        )
        experts = int(f("expert_count")) if self.arch != "llama" else int(self._field("llama.expert_count", 0) or 0)
        used = int(self._field(f"{self.arch}.expert_used_count", 0) or 0)
        if experts == 0:
            raise CheckpointError(self.path, f"{self.arch} model without routed experts ({self.arch}.expert_count "
                                             "missing or 0); ktorch loads MoE models")
        key_length = self._field(f"{self.arch}.attention.key_length")
        if self.arch == "qwen3moe":
            kwargs = dict(model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=used,
                          moe_intermediate_size=int(f("expert_feed_forward_length")),
                          intermediate_size=int(self._field("qwen3moe.feed_forward_length", 0) or f("expert_feed_forward_length")),
                          head_dim=int(key_length or hidden // heads), norm_topk_prob=True,  # llama.cpp always normalizes
                          decoder_sparse_step=1, mlp_only_layers=[])
        elif self.arch == "qwen2moe":
            shared = self._gguf_shape("blk.0.ffn_up_shexp.weight")
            kwargs = dict(model_type="qwen2_moe", num_experts=experts, num_experts_per_tok=used,
                          moe_intermediate_size=int(f("expert_feed_forward_length")),
                          intermediate_size=int(self._field("qwen2moe.feed_forward_length", 0) or f("expert_feed_forward_length")),
                          shared_expert_intermediate_size=int(self._field("qwen2moe.expert_shared_feed_forward_length", 0)
                                                              or (shared[0] if shared else 0)),
                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
        elif self.arch == "gpt-oss":
            window = int(self._field("gpt-oss.attention.sliding_window", 0) or 0)
            kwargs = dict(model_type="gpt_oss", num_local_experts=experts, num_experts_per_tok=used,
                          intermediate_size=int(self._field("gpt-oss.expert_feed_forward_length", 0)
                                                or f("feed_forward_length")),
                          head_dim=int(key_length or hidden // heads), sliding_window=window or None,
                          attention_bias="blk.0.attn_q.bias" in self.tensors)
            if not window:  # no sliding window in the file: every layer attends to the whole context
                kwargs["layer_types"] = ["full_attention"] * int(f("block_count"))
            if self._field("gpt-oss.rope.scaling.type") == "yarn":  # betas: the file's, else llama.cpp's 32 / 1
                common["rope_parameters"] = {
                    **common["rope_parameters"], "rope_type": "yarn", "truncate": False,
                    "beta_fast": float(self._field("gpt-oss.rope.scaling.yarn_beta_fast", 0) or 32.0),
                    "beta_slow": float(self._field("gpt-oss.rope.scaling.yarn_beta_slow", 0) or 1.0),
                    "factor": float(f("rope.scaling.factor")),
                    "original_max_position_embeddings": int(f("rope.scaling.original_context_length"))}
        elif self.arch == "llama":
            gate = self._gguf_shape("blk.0.ffn_gate_exps.weight")
            kwargs = dict(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=used,
                          intermediate_size=gate[1] if gate else int(f("feed_forward_length")),
                          head_dim=int(self._field("llama.rope.dimension_count", 0) or hidden // heads))
        else:  # deepseek2
            rope_dim = int(f("rope.dimension_count"))
            key_mla = self._field("deepseek2.attention.key_length_mla")
            value_mla = self._field("deepseek2.attention.value_length_mla")
            sigmoid = int(self._field("deepseek2.expert_gating_func", 1) or 1) == 2 or "blk.1.exp_probs_b.bias" in self.tensors
            kwargs = dict(
                model_type="deepseek_v3" if sigmoid else "deepseek_v2",
                n_routed_experts=experts, num_experts_per_tok=used,
                moe_intermediate_size=int(f("expert_feed_forward_length")),
                intermediate_size=int(self._field("deepseek2.feed_forward_length", 0) or f("expert_feed_forward_length")),
                n_shared_experts=int(self._field("deepseek2.expert_shared_count", 0) or 0),
                first_k_dense_replace=int(self._field("deepseek2.leading_dense_block_count", 0) or 0),
                routed_scaling_factor=float(self._field("deepseek2.expert_weights_scale", 1.0) or 1.0),
                norm_topk_prob=bool(self._field("deepseek2.expert_weights_norm", False)),
                n_group=int(self._field("deepseek2.expert_group_count", 1) or 1),
                topk_group=int(self._field("deepseek2.expert_group_used_count", 1) or 1),
                q_lora_rank=self._field("deepseek2.attention.q_lora_rank"),
                kv_lora_rank=int(f("attention.kv_lora_rank")),
                qk_rope_head_dim=rope_dim,
                qk_nope_head_dim=int(key_mla if key_mla is not None else key_length) - rope_dim,
                v_head_dim=int(value_mla if value_mla is not None else f("attention.value_length")),
            )
            if not sigmoid:
                kwargs["topk_method"] = "group_limited_greedy" if kwargs["n_group"] > 1 else "greedy"
        model_type = kwargs.pop("model_type")
        try:
            self._config = AutoConfig.for_model(model_type, **common, **kwargs)
        except (ValueError, TypeError) as e:
            raise CheckpointError(self.path, f"its metadata does not make a valid {model_type} config: {e}") from None
        return self._config

    # ------------------------------------------------------------ names

    def _gguf_name(self, name: str) -> Optional[str]:
        gguf = _gguf()
        if not self._hf_to_gguf:
            arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self.arch)
            self._name_map = gguf.get_tensor_name_map(arch_enum, int(self._required("block_count")))
        if name not in self._hf_to_gguf:
            if name.endswith("self_attn.kv_b_proj.weight"):
                mapped = name.replace("kv_b_proj", "kv_b")  # assembled from attn_k_b/attn_v_b or attn_kv_b
            else:
                mapped = self._name_map.get_name(name.replace(".e_score_correction_bias", ".e_score_correction.bias"),
                                                 try_suffixes=(".weight", ".bias"))
            self._hf_to_gguf[name] = mapped
        return self._hf_to_gguf[name]

    def _tensor(self, gguf_name: str, hf_name: str):
        t = self.tensors.get(gguf_name)
        if t is None:
            raise CheckpointError(self.path, f"missing from the file (the model's {hf_name})", tensor=gguf_name)
        return t

    def _check_dequantizable(self, t) -> None:
        if not _dequantizable(t.tensor_type):
            raise CheckpointError(self.path, f"tensor type {t.tensor_type.name} is not supported (the gguf package "
                                             "cannot decode it)", tensor=t.name)

    def _check_shape(self, gguf_name: str, hf_name: str, shape: tuple[int, ...]) -> None:
        t = self._tensor(gguf_name, hf_name)
        have = self._gguf_shape(gguf_name)
        if have != shape:
            raise CheckpointError(self.path, f"shape {list(have)} (numpy order), the model's {hf_name} needs "
                                             f"{list(shape)}", tensor=gguf_name)
        self._check_dequantizable(t)

    def check_tensor(self, name: str, shape: tuple[int, ...]) -> None:
        if self.arch == "gpt-oss" and ".mlp.experts." in name:
            for gguf_name, want in self._gpt_oss_expert_parts(name, shape):
                self._check_shape(gguf_name, name, want)
            return
        mapped = self._gguf_name(name)
        if mapped is None:
            raise CheckpointError(self.path, f"the model's {name} has no GGUF name in the gguf package's map for "
                                             f"{self.arch}")
        if name.endswith("self_attn.kv_b_proj.weight"):
            layer = _layer_index(name)
            if f"blk.{layer}.attn_kv_b.weight" in self.tensors:
                return self._check_shape(f"blk.{layer}.attn_kv_b.weight", name, shape)
            c = self.config()
            heads = c.num_attention_heads
            self._check_shape(f"blk.{layer}.attn_k_b.weight", name, (heads, c.kv_lora_rank, c.qk_nope_head_dim))
            self._check_shape(f"blk.{layer}.attn_v_b.weight", name, (heads, c.v_head_dim, c.kv_lora_rank))
            return
        self._check_shape(_with_suffix(mapped), name, shape)

    def _array(self, t, first: Optional[int] = None, end: Optional[int] = None) -> torch.Tensor:
        """Tensor ``t`` (experts ``first:end`` of a stacked one) as a float tensor in numpy order."""
        return dequantize(t.data if first is None else t.data[first:end], t.tensor_type)

    def read_tensor(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        mapped = self._gguf_name(name)
        if name.endswith("self_attn.kv_b_proj.weight"):
            layer = _layer_index(name)
            if f"blk.{layer}.attn_kv_b.weight" in self.tensors:
                value = self._array(self.tensors[f"blk.{layer}.attn_kv_b.weight"])
            else:
                k_b = self._array(self.tensors[f"blk.{layer}.attn_k_b.weight"]).float().transpose(1, 2)  # [h, nope, lora]
                v_b = self._array(self.tensors[f"blk.{layer}.attn_v_b.weight"]).float()  # [h, v, lora]
                value = torch.cat([k_b, v_b], dim=1).reshape(-1, k_b.shape[-1])
        else:
            gguf_name = _with_suffix(mapped)
            value = self._array(self.tensors[gguf_name])
            if self.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                c = self.config()
                heads = c.num_attention_heads if ".q_proj" in name else c.num_key_value_heads
                value = _llama_unpermute(value, heads)
        return value.to(device=device, dtype=dtype, copy=True)  # a copy: the file's pages stay read-only

    # ------------------------------------------------------------ experts

    def _gpt_oss_expert_parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The GGUF tensors (and their numpy-order shapes) that make gpt-oss experts parameter ``name`` of
        ``shape`` (the module's layout: ``gate_up_proj`` [E, H, 2I], ``gate_up_proj_bias`` [E, 2I], ``down_proj``
        [E, I, H], ``down_proj_bias`` [E, H])."""
        layer, param = _layer_index(name), name.rsplit(".", 1)[1]
        blk = f"blk.{layer}.ffn"
        if param == "gate_up_proj":
            E, H, I2 = shape
            return [(f"{blk}_gate_exps.weight", (E, I2 // 2, H)), (f"{blk}_up_exps.weight", (E, I2 // 2, H))]
        if param == "gate_up_proj_bias":
            E, I2 = shape
            return [(f"{blk}_gate_exps.bias", (E, I2 // 2)), (f"{blk}_up_exps.bias", (E, I2 // 2))]
        if param == "down_proj":
            E, I, H = shape
            return [(f"{blk}_down_exps.weight", (E, H, I))]
        if param == "down_proj_bias":
            return [(f"{blk}_down_exps.bias", tuple(shape))]
        raise CheckpointError(self.path, f"the model's {name} has no GGUF tensor in ktorch's gpt-oss mapping")

    def _expert_values(self, gguf_name: str, first: int, end: int) -> torch.Tensor:
        """Experts ``first:end`` of a stacked tensor, decoded to float; MXFP4 checked to be exact in bf16."""
        t = self.tensors[gguf_name]
        data = t.data[first:end]
        if t.tensor_type.name == "MXFP4":
            self._check_mxfp4_scales(t, first, end)
        return self._array(t, first, end).float()

    def _check_mxfp4_scales(self, t, first: int, end: int, data: Optional[np.ndarray] = None) -> None:
        """CheckpointError for an MXFP4 block scale byte past MXFP4_MAX_SCALE in experts ``first:end`` of ``t``
        (``data``: their bytes, already read)."""
        block_size, type_size = _gguf().GGML_QUANT_SIZES[t.tensor_type]
        data = t.data[first:end] if data is None else data
        scales = np.ascontiguousarray(data).reshape(-1, type_size)[:, 0]
        top = int(scales.max()) if scales.size else 0
        if top > MXFP4_MAX_SCALE:
            raise CheckpointError(self.path, f"an MXFP4 block scale (E8M0 byte {top}) past {MXFP4_MAX_SCALE}: its "
                                             "values overflow float32 or are NaN, so they cannot be held exactly",
                                  tensor=t.name)

    def read_expert_rows(self, name: str, first: int, end: int) -> torch.Tensor:
        """gpt-oss experts parameter ``name`` (experts ``first:end``) in the transformers module's layout: the
        file's separate gate and up tensors interleaved (g0, u0, g1, u1, ...) and transposed back."""
        if self.arch != "gpt-oss":
            return super().read_expert_rows(name, first, end)
        param = name.rsplit(".", 1)[1]
        names = self._gpt_oss_expert_parts(name, (0, 0) if param == "gate_up_proj_bias" else (0, 0, 0))
        parts = [self._expert_values(n, first, end) for n, _ in names]
        if param == "gate_up_proj":  # [e, I, H] twice -> [e, H, 2I] interleaved
            gate, up = parts
            return torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2]).transpose(1, 2)
        if param == "gate_up_proj_bias":  # [e, I] twice -> [e, 2I] interleaved
            return torch.stack(parts, dim=2).reshape(parts[0].shape[0], -1)
        if param == "down_proj":  # [e, H, I] -> [e, I, H]
            return parts[0].transpose(1, 2)
        return parts[0]

    def _experts_tensors(self, module_name: str) -> dict:
        layer = int(module_name.split(".layers.")[1].split(".")[0])
        return {p: self._tensor(f"blk.{layer}.ffn_{p}_exps.weight", f"{module_name} ({p})") for p in _EXPERT_PROJS}

    def check_experts(self, module_name: str, num_experts: int, intermediate: int, hidden: int) -> None:
        expected = {"gate": (num_experts, intermediate, hidden), "up": (num_experts, intermediate, hidden),
                    "down": (num_experts, hidden, intermediate)}
        for proj, t in self._experts_tensors(module_name).items():
            self._check_shape(t.name, f"{module_name} {proj} projections", expected[proj])

    def experts_format(self, module_name: str, requested: str) -> tuple[str, Optional[int]]:
        types = [t.tensor_type.name for t in self._experts_tensors(module_name).values()]
        if requested == "auto" and all(n in EXACT_TYPES for n in types):
            return EXACT_FORMAT, None
        fmt = max((_auto_format(n) for n in types), key=_RANK.get) if requested == "auto" else requested
        return fmt, (32 if fmt == "int4" else None)

    def read_experts(self, module_name: str, first: int, end: int, fmt: str, group_size: Optional[int],
                     into: Optional[tuple] = None) -> PackedExperts:
        tensors = self._experts_tensors(module_name)
        types = {p: t.tensor_type.name for p, t in tensors.items()}
        if fmt == EXACT_FORMAT or (fmt == "int4" and group_size == 32 and set(types.values()) == {"Q4_0"}):
            return self._exact_experts(tensors, first, end, into)
        arrays = {p: dequantize(t.data[first:end], t.tensor_type, self._scratch(p, end - first, t))
                  for p, t in tensors.items()}
        packed = pack_experts(gate_proj=arrays["gate"], up_proj=arrays["up"], down_proj=arrays["down"], dtype=fmt,
                              group_size=group_size)
        if not self._loss_reported:
            self._report_loss(packed, arrays, types, fmt)
        return packed

    def _exact_experts(self, tensors: dict, first: int, end: int, into: Optional[tuple] = None) -> PackedExperts:
        """Experts ``first:end`` in the op's exact formats for their GGUF types (``EXACT_TYPES``): the file's codes,
        scales and minimums re-laid, nothing requantized. gate and up share w13: of different types, both take the
        wider form (``_common_form``). ``into`` (``read_experts``): w13's and w2's codes are packed into its first and
        third tensors (the layer's rows), the scales returned apart."""
        into = into or (None,) * 4
        raw = {p: self._read_bytes(p, t, first, end) for p, t in tensors.items()}
        for p, t in tensors.items():
            if t.tensor_type.name == "MXFP4":
                self._check_mxfp4_scales(t, first, end, raw[p])
        parts = {p: exact_codes(raw[p], t.tensor_type.name) for p, t in tensors.items()}
        forms = {p: EXACT_TYPES[t.tensor_type.name] for p, t in tensors.items()}
        form13 = _common_form(forms["gate"], forms["up"])
        gate, up = (_as_form(parts[p], forms[p], form13) for p in ("gate", "up"))
        mins13 = None if gate[2] is None else torch.cat([gate[2], up[2]], dim=1)
        w13, s13 = pack_quantized(self._joined("codes13", gate[0], up[0]), torch.cat([gate[1], up[1]], dim=1), mins13,
                                  bits=form13[0], gate_up=True, mxfp4=form13[3] == "mxfp4", out=into[0])
        codes, scales, mins = parts["down"]
        w2, s2 = pack_quantized(codes, scales, mins, bits=forms["down"][0], mxfp4=forms["down"][3] == "mxfp4",
                                out=into[2])
        # K-quant scales at the file's size (two-level), where a projection (gate and up: both) is of such a type
        ktypes = {p: t.tensor_type.name for p, t in tensors.items() if t.tensor_type.name in KSCALES_ON_LOAD}
        if ktypes.get("gate") is not None and ktypes.get("gate") == ktypes.get("up"):
            g, u = (exact_kscales(raw[p], ktypes[p]) for p in ("gate", "up"))
            s13 = pack_kscales(*(None if a is None else torch.cat([a, b], dim=1) for a, b in zip(g, u)), gate_up=True)
        if "down" in ktypes:
            s2 = pack_kscales(*exact_kscales(raw["down"], ktypes["down"]))
        names = dict.fromkeys(t.tensor_type.name for t in tensors.values())
        b13 = b2 = None
        if self.arch == "gpt-oss":  # biases: gate's then up's [e, 2I] (PackedExperts.w13_bias), down's [e, H]
            layer = tensors["gate"].name.split(".")[1]
            bias = {p: self._array(self.tensors[f"blk.{layer}.ffn_{p}_exps.bias"], first, end).float().contiguous()
                    for p in _EXPERT_PROJS}
            b13, b2 = torch.cat([bias["gate"], bias["up"]], dim=1).contiguous(), bias["down"]
        return PackedExperts(w13, s13, w2, s2, "gguf:" + "/".join(names), None, b13, b2)

    def _report_loss(self, packed: PackedExperts, arrays: dict, types: dict, fmt: str) -> None:
        """Prints, once per file, the relative error of requantizing the first layer's first experts to ``fmt``
        against the file's values (an explicit ``experts_dtype``, or types with no exact format)."""
        self._loss_reported = True
        n = min(2, packed.num_experts)
        gate_up, down = PackedExperts(packed.w13[:n], None if packed.w13_scales is None else packed.w13_scales[:n],
                                      packed.w2[:n], None if packed.w2_scales is None else packed.w2_scales[:n],
                                      packed.format).dequantize()
        ref13 = torch.cat([arrays["gate"][:n], arrays["up"][:n]], dim=1).float()
        ref2 = arrays["down"][:n].float()
        err = math.sqrt(float((gate_up - ref13).square().sum() + (down - ref2).square().sum()) /
                        max(float(ref13.square().sum() + ref2.square().sum()), 1e-30))
        exact = all(t in EXACT_TYPES for t in types.values())
        print(f"ktorch.load: {self.path.name}: routed experts ({'/'.join(dict.fromkeys(types.values()))}) converted to "
              f"{fmt}: relative error {err:.4g} against the file's values (first layer, {n} experts)"
              + ("; experts_dtype='auto' keeps them exact" if exact and err > 0 else ""), file=sys.stderr)

    def _read_bytes(self, proj: str, t, first: int, end: int) -> np.ndarray:
        """Experts ``first:end`` of the tensor ``t`` (block bytes, uint8: ``t.data[first:end]``'s array) read from the
        file with ``os.preadv`` by ``_READ_THREADS`` threads into a buffer kept for ``proj``, reused from chunk to
        chunk (valid until the next chunk's read): a first touch of the file's mapped pages faulted them in one at a
        time, single-threaded (device, a 12-layer Q8_0 file under cProfile: the reads 4.48 s of a 32.7 s load).
        Other dtypes (float experts): the mapped array."""
        data = t.data
        if data.dtype != np.uint8 or data.ndim < 2:
            return np.asarray(data[first:end])
        per = data[0].nbytes
        out = self._reused("raw:" + proj, per * (end - first), torch.uint8).numpy()
        _pread(self._file(), out, t.data_offset + first * per)
        return out.reshape(end - first, *data.shape[1:])

    def _file(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def _joined(self, key: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate and up [e, rows, K] joined along the rows, in a buffer reused from chunk to chunk and layer to layer
        (``pack_quantized`` copies out of it): a fresh one per chunk spent its time in first-touch page faults
        (a 2-layer Q8_0 file on the dev machine: torch.cat 1.19 s of a 9.0 s load)."""
        shape = (gate.shape[0], gate.shape[1] + up.shape[1], *gate.shape[2:])
        return torch.cat([gate, up], dim=1, out=self._reused(key, math.prod(shape), gate.dtype).view(shape))

    def _reused(self, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of the buffer kept under ``key``, made anew only where it is too small or of another
        dtype (``_scratch``, ``_joined``)."""
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def _scratch(self, proj: str, experts: int, t) -> Optional[torch.Tensor]:
        """A float32 buffer for ``experts`` experts of ``t`` decoded, reused from chunk to chunk and layer to layer
        (a fresh quarter-gigabyte tensor per chunk spent more time in page faults than in decoding); None for
        the types ``dequantize`` does not decode natively."""
        if t.tensor_type.name not in GGUF_NATIVE_BLOCK_SIZES:
            return None
        return self._reused(proj, math.prod(decoded_shape((experts, *t.data.shape[1:]), t.tensor_type)), torch.float32)

    def release(self) -> None:
        """Drops the file pages read so far from this process (they stay in the page cache)."""
        data = self.reader.data
        base = getattr(data, "_mmap", None)
        if base is not None and hasattr(base, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                base.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    # ------------------------------------------------------------ tokenizer

    def tokenizer(self):
        model = self._field("tokenizer.ggml.model")
        if model in (None, "none"):
            return None
        tokenizer = None
        try:
            from transformers import PreTrainedTokenizerFast
            from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

            architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(self.path))
            backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{**tokenizer_config, **extra})
        except ImportError:
            pass
        if tokenizer is None:
            try:  # transformers releases before the gguf integration package (e.g. 5.17)
                from transformers import PreTrainedTokenizerFast

                tokenizer = PreTrainedTokenizerFast.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
            except Exception as e:  # noqa: BLE001
                raise CheckpointError(self.path, f"transformers cannot build its tokenizer ({model!r}): {e}") from None
        if self._field("tokenizer.ggml.pre") == "gpt-2":
            # GPT-2's own split (ByteLevel's regex, no normalizer), as llama.cpp reads this key. Some transformers
            # releases pick the pre-tokenizer by architecture instead (qwen3moe: Qwen2's regex, NFC).
            from tokenizers import pre_tokenizers

            backend = tokenizer.backend_tokenizer
            backend.normalizer = None
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        add_bos, bos_id = self._field("tokenizer.ggml.add_bos_token"), self._field("tokenizer.ggml.bos_token_id")
        if add_bos is not None and bos_id is not None:
            _set_add_bos(tokenizer, bool(add_bos), int(bos_id))
        return tokenizer


def _set_add_bos(tokenizer, add_bos: bool, bos_id: int) -> None:
    """Makes ``tokenizer`` prepend the file's BOS token (id ``bos_id``) exactly when the file's
    ``tokenizer.ggml.add_bos_token`` says so. transformers' GGUF conversion does not read that key in every
    release, and some releases give the tokenizer a BOS string outside the file's vocabulary."""
    bos = tokenizer.convert_ids_to_tokens(bos_id)
    if bos is None:
        return
    if tokenizer.bos_token_id != bos_id:
        tokenizer.bos_token = bos
    if (tokenizer("a").input_ids[:1] == [bos_id]) == add_bos:
        return
    from tokenizers import processors

    backend = tokenizer.backend_tokenizer
    steps = [] if backend.post_processor is None else [backend.post_processor]
    if add_bos:
        steps.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                   special_tokens=[(bos, bos_id)]))
        backend.post_processor = processors.Sequence(steps) if len(steps) > 1 else steps[0]
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)


def _with_suffix(name: str) -> str:
    return name if name.endswith((".weight", ".bias")) else name + ".weight"


def _llama_unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``LlamaModel.permute`` of Q/K rows."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _q4k_steps(gguf, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step, low) [n, 8] of Q4_K blocks: each sub-block's value is step * q - low; symmetric int4 when low = 8 step."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), dmin * m.astype(np.float32)


# The GGUF expert types ``experts_dtype="auto"`` keeps exact: type -> (bits of the op format, group, affine, code
# table). The codes of Q5_K (0..31) and Q6_K (-32..31) are held one byte each (int8), Q4_0 and Q4_K as nibbles (int4),
# MXFP4's as their 4-bit E2M1 codes (the int4 layout, code table "mxfp4": each nibble the E2M1 value doubled,
# -12..12; ``pack_quantized(mxfp4=True)``); the scales (and minimums) as float32 per group, which holds each exactly
# (an fp16 times a 6-bit integer, or a power of two) - except where a projection is Q5_K or Q6_K
# (``KSCALES_ON_LOAD``: two-level, at the file's size), which ``_exact_experts`` keeps as the file has them.
EXACT_TYPES = {"Q8_0": (8, 32, False, None), "Q6_K": (8, 16, False, None), "Q5_K": (8, 32, True, None),
               "MXFP4": (4, 32, False, "mxfp4"), "Q4_0": (4, 32, False, None), "Q4_K": (4, 32, True, None)}


def _f16(b: np.ndarray) -> np.ndarray:
    """fp16 bytes [n, 2] (a strided column of blocks) as float32 [n, 1]. Through torch where the array is
    writable (``_read_bytes``' buffers): its strided copy is ~4x numpy's (18M blocks: 0.14 against 0.56 s)."""
    if b.flags.writeable:
        return torch.from_numpy(b).contiguous().view(torch.float16).float().numpy()
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def exact_codes(data: np.ndarray, type_name: str) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The codes, scales and minimums of GGUF blocks of a type in ``EXACT_TYPES``: data [..., row bytes] (numpy order)
    -> (codes int8 [..., K], scales float32 [..., K / group], mins float32 like scales or None), such that
    ``codes * scales - mins`` (per group) equals ``gguf.quants.dequantize`` bit for bit (the same float32 products).
    Q4_0's codes are q - 8 (symmetric int4), Q4_K's the unsigned nibbles 0..15, MXFP4's the doubled E2M1 values with
    scale 2**(e - 128) (the gguf package's own table and scale)."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    lead = data.shape[:-1]
    K = data.shape[-1] // type_size * block_size
    b = np.ascontiguousarray(data).reshape(-1, type_size)
    n = b.shape[0]
    mins = None
    if type_name == "Q8_0":
        scales = _f16(b[:, :2])
        codes = b[:, 2:].view(np.int8)
    elif type_name == "Q4_0":
        scales = _f16(b[:, :2])
        qs = b[:, 2:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
        scales, mins = d * sc.astype(np.float32), dmin * m.astype(np.float32)
        if type_name == "Q4_K":
            qs = b[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            codes = (qs & np.uint8(0x0F)).reshape(n, 256).astype(np.int8)
        else:
            qh, qs = b[:, 16:48], b[:, 48:]
            ql = qs.reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
            qh = qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
            ql = (ql & np.uint8(0x0F)).reshape(n, -1, 32)
            qh = (qh & np.uint8(0x01)).reshape(n, -1, 32)
            codes = (ql | (qh << np.uint8(4))).reshape(n, 256).astype(np.int8)
    elif type_name == "Q6_K":
        ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
        scales = _f16(d) * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)
        ql = ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        ql = (ql & np.uint8(0x0F)).reshape(n, -1, 32)
        qh = qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh = (qh & np.uint8(0x03)).reshape(n, -1, 32)
        codes = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, 256)
    elif type_name == "MXFP4":
        scales = gguf.quants.MXFP4.e8m0_to_fp32_half(np.ascontiguousarray(b[:, :1]))
        qs = b[:, 1:].reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        table = np.array(gguf.quants.MXFP4.kvalues, dtype=np.int8)
        codes = table[(qs & np.uint8(0x0F))].reshape(n, 32)
    else:
        raise ValueError(f"exact_codes: {type_name} is not one of {sorted(EXACT_TYPES)}")

    def out(a: np.ndarray, last: int) -> torch.Tensor:  # (a strided writable array: torch's copy, ~4x numpy's)
        return torch.from_numpy(a if a.flags.writeable else np.ascontiguousarray(a)).reshape(*lead, last)

    group = EXACT_TYPES[type_name][1]
    return (out(codes, K), out(scales.astype(np.float32), K // group),
            None if mins is None else out(mins.astype(np.float32), K // group))


# The K-quant types whose scales load at the file's size (two-level: ``pack_kscales``): a sub-scale per group
# (Q4_K/Q5_K: 6-bit sc and m as uint8; Q6_K: sc as int8) and a float32 d (and dmin) per 256 weights.
KSCALE_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# The types the loader keeps in that form: all three. Q5_K and Q6_K decode no slower in it (one Qwen3-30B-A3B layer at
# T = 1, cold caches, H200 host, session 29, aa017df, `bench_fused_moe.py --tokens 1`: Q6_K two-level 0.371 ms against
# 0.514, Q5_K 0.362 ms, 116% of the read bandwidth). Q4_K's AMX prefill needs it: its integer sub-scales let the tile
# walk sum whole super-blocks (amx/kernels.cpp, kq4_block), where the float32 form goes to the AVX-512 kernel: session
# 41, same layer, 16 threads, one call: T = 1 / 512 / 2048 0.338 / 14.57 / 40.62 ms two-level against 0.330 / 14.92 /
# 59.08 float32 per group, in 0.594 bytes a weight instead of 0.75. (Q8_0 with its float16 d decoded slower, 0.349
# against 0.329 ms, session 29, and has no tile walk of its own: float32 per group.) The op takes every form.
KSCALES_ON_LOAD = ("Q4_K", "Q5_K", "Q6_K")


def exact_kscales(data: np.ndarray, type_name: str) -> tuple:
    """The two-level scales of GGUF blocks of a type in ``KSCALE_TYPES``: data [..., row bytes] (numpy order) ->
    (sub [..., K / group] uint8 (Q4_K, Q5_K) or int8 (Q6_K), supers float32 [..., K / 256], sub_mins, super_mins
    like them or None), such that ``supers * sub`` (per group) is ``exact_codes``'s scales bit for bit (and
    ``super_mins * sub_mins`` its minimums)."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    lead = data.shape[:-1]
    b = np.ascontiguousarray(data).reshape(-1, type_size)

    def out(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(*lead, -1)

    if type_name in ("Q4_K", "Q5_K"):
        sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
        return (out(sc.astype(np.uint8)), out(_f16(b[:, 0:2])), out(m.astype(np.uint8)), out(_f16(b[:, 2:4])))
    if type_name == "Q6_K":
        return out(np.ascontiguousarray(b[:, 192:208]).view(np.int8)), out(_f16(b[:, 208:210])), None, None
    raise ValueError(f"exact_kscales: {type_name} is not one of {KSCALE_TYPES}")


def _common_form(a: tuple, b: tuple) -> tuple:
    """The form (bits, group, affine, code table) that holds the codes of forms a and b exactly: a itself when they
    agree, else int8 codes (no table) with the smaller group, affine if either is (a scale per 32 repeats over two
    groups of 16, a symmetric group takes minimum 0; MXFP4's values -12..12 are int8 codes as they are)."""
    if a == b:
        return a
    return 8, min(a[1], b[1]), a[2] or b[2], None


def _as_form(part: tuple, form: tuple, to: tuple) -> tuple:
    """(codes, scales, mins) of ``form`` re-expressed in form ``to`` (``_common_form``), exactly."""
    codes, scales, mins = part
    if form == to:
        return part
    rep = form[1] // to[1]
    scales = scales.repeat_interleave(rep, dim=-1)
    if to[2]:
        mins = torch.zeros_like(scales) if mins is None else mins.repeat_interleave(rep, dim=-1)
    return codes, scales, mins
