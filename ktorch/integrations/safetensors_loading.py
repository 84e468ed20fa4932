"""A Hugging Face checkpoint folder (config.json + *.safetensors) as a ``CheckpointSource``.

Files are checked and indexed with safetensors' ``safe_open``; tensor bytes are then read with plain positioned
reads at the offsets of the file's header (``read_tensor``), not through ``safe_open``'s memory map, whose pages
would stay in the process's resident set until the end of loading (measured: +50 MB per layer here, never
released). Routed experts may be stored fused (transformers >= 5 names,
``...experts.gate_up_proj`` [E, 2I, H] and ``...experts.down_proj`` [E, H, I]) or one expert at a time, as
released checkpoints and transformers' own ``save_pretrained`` write them
(``...experts.N.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]; Mixtral's ``w1``/``w3``/``w2``
under ``block_sparse_moe``). Other renamings come from transformers' checkpoint conversion mapping when it
offers one.

OpenAI's gpt-oss releases hold the experts as MXFP4 blocks: ``...experts.gate_up_proj_blocks`` uint8
[E, 2I, H/32, 16] with ``..._scales`` uint8 [E, 2I, H/32] (E8M0: 2**(s - 127)), ``down_proj_blocks``/``_scales``
likewise over [E, H, I/32]; element 32g + 2j of a row is the low nibble of byte j of block g, 32g + 2j + 1 its high
nibble, an E2M1 code (transformers' ``convert_moe_packed_tensors`` decodes them the same way); the gate/up rows
interleave as the module holds them. ``experts_dtype="auto"`` keeps them as MXFP4 4-bit codes
(``pack_quantized(mxfp4=True)``: the values exactly, 0.625 bytes a weight); an explicit dtype decodes and packs them.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Optional

import torch

import numpy as np

from ktorch.integrations.checkpoint_loading import CheckpointError, CheckpointSource
from ktorch.ops.moe import PackedExperts, pack_experts, pack_quantized
from ktorch.ops.packed_weights import MXFP4_CODES

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_tensor(path: Path, entry: dict, data_start: int, first: Optional[int] = None, end: Optional[int] = None) -> torch.Tensor:
    """Tensor (or rows ``first:end`` of its first dimension) described by safetensors header ``entry``
    (dtype, shape, data_offsets) of the file at ``path``, read into fresh memory."""
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(path, f"safetensors dtype {entry['dtype']} is not supported")
    shape = list(entry["shape"])
    start = data_start + entry["data_offsets"][0]
    if first is not None:
        row = (entry["data_offsets"][1] - entry["data_offsets"][0]) // max(1, shape[0])
        start += first * row
        shape[0] = end - first
    out = torch.empty(shape, dtype=dtype)
    view = out.view(torch.uint8).reshape(-1).numpy() if out.numel() else None
    if view is not None:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            if f.readinto(memoryview(view)) != view.nbytes:
                raise CheckpointError(path, "the file ends before the tensor's data does (truncated?)")
    return out


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def _renamer(model_type: str):
    """A function renaming checkpoint keys with transformers' plain renamings for ``model_type`` (identity if the
    installed transformers has none or a different API)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [t for t in (get_checkpoint_conversion_mapping(model_type) or []) if isinstance(t, WeightRenaming)]
    except Exception:  # noqa: BLE001 - an optional nicety; keys are then taken as they are
        renamings = []
    patterns = []
    for r in renamings:
        sources = r.source_patterns if isinstance(r.source_patterns, list) else [r.source_patterns]
        targets = r.target_patterns if isinstance(r.target_patterns, list) else [r.target_patterns]
        if len(sources) == 1 and len(targets) == 1:
            patterns.append((re.compile(sources[0]), targets[0]))

    def rename(key: str) -> str:
        for pattern, target in patterns:
            key = pattern.sub(target, key)
        return key

    return rename


class SafetensorsSource(CheckpointSource):
    """A transformers checkpoint folder: config.json and one or more .safetensors files."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise CheckpointError(self.path, "not a transformers checkpoint folder: no config.json in it")
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(self.path, "no .safetensors files in the folder")
        self._config = None
        self._rename = None
        self._keys: dict[str, tuple[str, str]] = {}  # model key -> (file, key in file)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._experts: dict[str, dict[tuple[int, str], str]] = {}  # experts module -> {(expert, proj): model key}
        self._mxfp4: dict[str, bool] = {}  # experts module held as MXFP4 blocks -> whether its gate/up rows interleave
        self._raw: list[tuple[str, str, tuple[int, ...]]] = []
        self._headers: dict[str, tuple[dict, int]] = {}  # file -> (header, offset of the data)
        for file in files:
            full = self.path / file
            if not full.is_file():
                raise CheckpointError(full, "listed in model.safetensors.index.json but missing")
            try:
                with safe_open(str(full), framework="pt") as f:
                    for key in f.keys():
                        self._raw.append((file, key, tuple(f.get_slice(key).get_shape())))
                self._headers[file] = _header(full)
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(full, f"not a readable safetensors file ({e})") from None

    def config(self):
        if self._config is None:
            from transformers import AutoConfig

            try:
                self._config = AutoConfig.from_pretrained(str(self.path))
            except (OSError, ValueError, KeyError) as e:
                raise CheckpointError(self.path / "config.json", f"transformers cannot read it: {e}") from None
            self._index_keys(self._config.model_type)
        return self._config

    def _index_keys(self, model_type: str) -> None:
        rename = _renamer(model_type)
        for file, key, shape in self._raw:
            name = rename(key)
            match = _PER_EXPERT.match(name)
            if match:
                proj = _PROJ.get(match["proj"], match["proj"])
                self._experts.setdefault(match["module"], {})[(int(match["expert"]), proj)] = name
            self._keys[name] = (file, key)
            self._shapes[name] = shape

    def _read(self, name: str, first: Optional[int] = None, end: Optional[int] = None) -> torch.Tensor:
        file, key = self._keys[name]
        header, data_start = self._headers[file]
        try:
            return read_tensor(self.path / file, header[key], data_start, first, end)
        except CheckpointError as e:
            raise CheckpointError(self.path / file, e.problem, tensor=key) from None

    def _where(self, name: str):
        return self.path / self._keys[name][0] if name in self._keys else self.path

    def check_tensor(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self._shapes:
            raise CheckpointError(self.path, "missing from the checkpoint", tensor=name)
        if self._shapes[name] != shape:
            raise CheckpointError(self._where(name), f"shape {list(self._shapes[name])}, the model expects {list(shape)}",
                                  tensor=self._keys[name][1])

    def read_tensor(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._read(name).to(device=device, dtype=dtype)

    def read_expert_rows(self, name: str, first: int, end: int) -> torch.Tensor:
        if f"{name}_blocks" in self._keys and name.rsplit(".", 1)[0] in self._mxfp4:  # decoded, in the module's layout
            codes, scales = self._mxfp4_codes(name, first, end)
            e, N, K = codes.shape
            values = codes.float().view(e, N, K // 32, 32) * scales.unsqueeze(-1)  # exact: <= 2 significant bits
            return values.view(e, N, K).transpose(1, 2)
        return self._read(name, first, end)

    # ------------------------------------------------------------ OpenAI's MXFP4 experts

    def check_stored_experts(self, module_name: str, module) -> None:
        params = dict(module.named_parameters(recurse=False))
        held = [p for p in params if f"{module_name}.{p}_blocks" in self._shapes]
        if not held:
            return super().check_stored_experts(module_name, module)
        if not module.is_transposed or sorted(held) != ["down_proj", "gate_up_proj"]:
            raise CheckpointError(self.path, f"{module_name}: MXFP4 blocks for {held}; ktorch reads them for gate_up_proj "
                                             "and down_proj of experts held transposed (gpt-oss)")
        for p, t in params.items():
            if p not in held:
                self.check_tensor(f"{module_name}.{p}", tuple(t.shape))
                continue
            E, K, N = t.shape  # the module's [E, in, out]; the blocks are [E, out, in / 32, 16]
            if K % 32:
                raise CheckpointError(self.path, f"{module_name}.{p}: {K} input channels, not whole MXFP4 blocks of 32")
            self.check_tensor(f"{module_name}.{p}_blocks", (E, N, K // 32, 16))
            self.check_tensor(f"{module_name}.{p}_scales", (E, N, K // 32))
        self._mxfp4[module_name] = not module.is_concatenated

    def _mxfp4_codes(self, name: str, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``first:end`` of parameter ``name`` held as MXFP4 blocks: (codes int8 [e, N, K], the E2M1 values
        doubled, in input-channel order; scales float32 [e, N, K / 32], 2**(s - 128)), so that codes * scale are the
        weights exactly; a scale byte past ``MXFP4_MAX_SCALE`` is a ``CheckpointError``."""
        from ktorch.integrations.gguf_loading import MXFP4_MAX_SCALE

        blocks = self._read(f"{name}_blocks", first, end)  # uint8 [e, N, G, 16]
        s = self._read(f"{name}_scales", first, end).to(torch.int32)  # [e, N, G]
        if s.numel() and int(s.max()) > MXFP4_MAX_SCALE:
            raise CheckpointError(self._where(f"{name}_scales"), f"an MXFP4 block scale (E8M0 byte {int(s.max())}) past "
                                  f"{MXFP4_MAX_SCALE}: its values cannot be held exactly (float32 overflow, or NaN)",
                                  tensor=f"{name}_scales")
        e, N, G, _ = blocks.shape
        nibbles = torch.stack([blocks.bitwise_and(0xF), blocks.bitwise_right_shift(4)], dim=-1)  # [e, N, G, 16, 2]
        codes = torch.from_numpy(np.asarray(MXFP4_CODES, dtype=np.int8)[nibbles.numpy()]).view(e, N, G * 32)
        # 2**(s - 128) as float32 bits: exponent field s - 1, or the subnormals 2**-127 and 2**-128 for s = 1, 0
        bits = torch.where(s < 2, torch.tensor(0x00200000, dtype=torch.int32).bitwise_left_shift(s),
                           (s - 1).bitwise_left_shift(23))
        return codes, bits.view(torch.float32)

    def _mxfp4_experts(self, module_name: str, first: int, end: int) -> PackedExperts:
        """Experts ``first:end`` of a module held as MXFP4 blocks, as MXFP4 4-bit codes (gate then up rows) with their
        biases."""
        interleaved = self._mxfp4[module_name]

        def gate_then_up(t: torch.Tensor) -> torch.Tensor:  # rows g0, u0, g1, u1, ... -> g0, g1, ..., u0, u1, ...
            return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1) if interleaved else t

        c13, s13 = (gate_then_up(t) for t in self._mxfp4_codes(f"{module_name}.gate_up_proj", first, end))
        c2, s2 = self._mxfp4_codes(f"{module_name}.down_proj", first, end)
        w13, sc13 = pack_quantized(c13, s13, bits=4, gate_up=True, mxfp4=True)
        w2, sc2 = pack_quantized(c2, s2, bits=4, mxfp4=True)
        b13 = b2 = None
        if f"{module_name}.gate_up_proj_bias" in self._keys:
            b13 = gate_then_up(self._read(f"{module_name}.gate_up_proj_bias", first, end).float()).contiguous()
        if f"{module_name}.down_proj_bias" in self._keys:
            b2 = self._read(f"{module_name}.down_proj_bias", first, end).float().contiguous()
        return PackedExperts(w13, sc13, w2, sc2, "mxfp4", None, b13, b2)

    def check_experts(self, module_name: str, num_experts: int, intermediate: int, hidden: int) -> None:
        fused = {"gate_up_proj": (num_experts, 2 * intermediate, hidden), "down_proj": (num_experts, hidden, intermediate)}
        if all(f"{module_name}.{p}" in self._shapes for p in fused):
            for p, shape in fused.items():
                self.check_tensor(f"{module_name}.{p}", shape)
            return
        per_expert = self._experts.get(module_name, {})
        expected = {"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
        for e in range(num_experts):
            for proj, shape in expected.items():
                name = per_expert.get((e, proj))
                if name is None:
                    raise CheckpointError(self.path, f"missing: expert {e} {proj} of {module_name} (neither fused "
                                                     f"{module_name}.gate_up_proj nor per-expert weights found)",
                                          tensor=f"{module_name}.{e}.{proj}.weight")
                self.check_tensor(name, shape)

    def experts_format(self, module_name: str, requested: str) -> tuple[str, Optional[int]]:
        if module_name in self._mxfp4 and requested == "auto":
            return "mxfp4", None  # (read_experts keeps the blocks' codes)
        return ("bf16" if requested == "auto" else requested), None

    def read_experts(self, module_name: str, first: int, end: int, fmt: str, group_size: Optional[int],
                     into: Optional[tuple] = None) -> PackedExperts:
        if fmt == "mxfp4":
            return self._mxfp4_experts(module_name, first, end)
        fused = f"{module_name}.gate_up_proj"
        if fused in self._keys:
            gate_up = self._read(fused, first, end)
            down = self._read(f"{module_name}.down_proj", first, end)
            return pack_experts(gate_up, down, dtype=fmt, group_size=group_size)
        names = self._experts[module_name]
        gate = torch.stack([self._read(names[(e, "gate_proj")]) for e in range(first, end)])
        up = torch.stack([self._read(names[(e, "up_proj")]) for e in range(first, end)])
        down = torch.stack([self._read(names[(e, "down_proj")]) for e in range(first, end)])
        return pack_experts(gate_proj=gate, up_proj=up, down_proj=down, dtype=fmt, group_size=group_size)

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except (OSError, ValueError, KeyError, TypeError):
            return None
