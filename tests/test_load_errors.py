"""Bad checkpoints stop ktorch.load at once with a message naming the file, the tensor and the problem.

GGUF: truncated, corrupt header, not GGUF at all, unknown architecture, unsupported tensor type, missing tensor,
wrong shape. safetensors folders: no config.json, unreadable file, missing tensor, wrong shape, missing expert.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

import ktorch
from ktorch.integrations.checkpoint_loading import CheckpointError
from ktorch.integrations.gguf_writer import write_gguf_from_model
from models import tiny_model

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def good_gguf(model, tmp_path_factory):
    return write_gguf_from_model(model, tmp_path_factory.mktemp("good") / "good.gguf", experts_type="Q8_0")


def _load_error(path) -> str:
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError) as info:
        ktorch.load(path, device="cpu", progress=False)
    assert time.perf_counter() - t0 < 30  # before any long work
    message = str(info.value)
    assert str(path) in message, message
    return message


def test_good_file_loads(good_gguf):
    model, tokenizer = ktorch.load(good_gguf, device="cpu", progress=False)
    assert tokenizer is None and model.config.num_hidden_layers == 2


def test_truncated_gguf(good_gguf, tmp_path):
    data = good_gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) - 5000])
    message = _load_error(path)
    assert "truncated" in message and "tensor '" in message


def test_corrupt_gguf_header(good_gguf, tmp_path):
    data = bytearray(good_gguf.read_bytes())
    data[8:24] = b"\xff" * 16  # tensor and key-value counts
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    message = _load_error(path)
    assert "cannot parse it as GGUF" in message and "corrupt or truncated" in message


def test_a_missing_gguf_package_is_named_not_called_a_corrupt_file(good_gguf, monkeypatch, capsys):
    """Without the gguf package (a setup that skipped the dependency), a good file is not reported corrupt: the
    error names the package to install, from Python and from the CLI."""
    import sys

    from ktorch import cli

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ImportError, match="pip install gguf"):
        ktorch.load(good_gguf, device="cpu", progress=False)
    assert cli.main(["generate", "--model", str(good_gguf), "--device", "cpu", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "pip install gguf" in err and "corrupt" not in err, err


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in _load_error(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _load_error(path)
    assert "architecture 'mamba' is not supported" in message and "qwen3moe" in message


def test_unsupported_tensor_type(model, tmp_path):
    def to_f64(plan):
        return [dataclasses.replace(t, type_name="F64") if t.name == "blk.1.ffn_up_exps.weight" else t for t in plan]

    path = write_gguf_from_model(model, tmp_path / "f64.gguf", experts_type="Q8_0", edit=to_f64)
    message = _load_error(path)
    assert "tensor 'blk.1.ffn_up_exps.weight'" in message and "tensor type F64 is not supported" in message


def test_missing_tensor(model, tmp_path):
    path = write_gguf_from_model(model, tmp_path / "missing.gguf", experts_type="Q8_0",
                                 edit=lambda plan: [t for t in plan if t.name != "blk.1.attn_k.weight"])
    message = _load_error(path)
    assert "tensor 'blk.1.attn_k.weight'" in message and "missing from the file" in message


def test_missing_experts_tensor(model, tmp_path):
    path = write_gguf_from_model(model, tmp_path / "missing_exps.gguf", experts_type="Q8_0",
                                 edit=lambda plan: [t for t in plan if t.name != "blk.0.ffn_down_exps.weight"])
    message = _load_error(path)
    assert "tensor 'blk.0.ffn_down_exps.weight'" in message and "missing from the file" in message


def test_wrong_shape(model, tmp_path):
    def shrink(plan):
        out = []
        for t in plan:
            if t.name == "blk.0.ffn_gate_exps.weight":  # one expert too few
                data = t.produce()[:-1]
                t = dataclasses.replace(t, shape=data.shape, produce=lambda data=data: data)
            out.append(t)
        return out

    path = write_gguf_from_model(model, tmp_path / "shape.gguf", experts_type="Q8_0", edit=shrink)
    message = _load_error(path)
    assert "tensor 'blk.0.ffn_gate_exps.weight'" in message and "shape [7, 64, 64]" in message and "[8, 64, 64]" in message


# ---------------------------------------------------------------- safetensors folders


@pytest.fixture(scope="module")
def good_folder(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder)
    return folder


def _rewrite(folder, tmp_path, change):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_folder_without_config(tmp_path):
    message = _load_error(tmp_path)
    assert "no config.json" in message


def test_unreadable_safetensors(good_folder, tmp_path):
    out = _rewrite(good_folder, tmp_path, lambda t: None)
    (out / "model.safetensors").write_bytes(b"\x00" * 64)
    message = _load_error(out)
    assert "model.safetensors" in message and "not a readable safetensors file" in message


def test_safetensors_missing_tensor(good_folder, tmp_path):
    out = _rewrite(good_folder, tmp_path, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    message = _load_error(out)
    assert "tensor 'model.layers.1.self_attn.o_proj.weight'" in message and "missing from the checkpoint" in message


def test_safetensors_wrong_shape(good_folder, tmp_path):
    def change(t):
        t["model.layers.0.mlp.gate.weight"] = torch.zeros(7, 64)

    message = _load_error(_rewrite(good_folder, tmp_path, change))
    assert "tensor 'model.layers.0.mlp.gate.weight'" in message and "shape [7, 64], the model expects [8, 64]" in message


def test_safetensors_missing_expert(good_folder, tmp_path):
    def change(t):
        for k in [k for k in t if k.startswith("model.layers.1.mlp.experts.3.")]:
            del t[k]
        for k in [k for k in t if k.startswith("model.layers.1.mlp.experts.gate_up_proj")]:
            del t[k]

    message = _load_error(_rewrite(good_folder, tmp_path, change))
    assert "expert 3 gate_proj of model.layers.1.mlp.experts" in message


def test_a_device_this_process_cannot_use_is_named_before_loading(good_gguf, model, monkeypatch):
    """load and prepare on a CUDA device this torch cannot use (CPU builds, a GPU index past the GPUs there are):
    a ValueError naming the device before any loading or placement, not torch's assertion halfway through."""
    def no_opening(*args, **kwargs):
        raise AssertionError("the checkpoint was opened before the device was checked")

    monkeypatch.setattr(ktorch.loading, "open_checkpoint", no_opening)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"load: device 'cuda': this torch sees no CUDA GPU .*use device='cpu'"):
            ktorch.load(good_gguf, device="cuda")
        with pytest.raises(ValueError, match=r"prepare: device 'cuda:0': this torch sees no CUDA GPU"):
            ktorch.prepare(tiny_model("qwen3_moe"), device="cuda:0")
    else:
        past = torch.cuda.device_count()
        with pytest.raises(ValueError, match=rf"load: device 'cuda:{past}': this machine has {past} CUDA GPU"):
            ktorch.load(good_gguf, device=f"cuda:{past}")


def test_a_file_shorter_than_a_read_is_an_eof_error_naming_the_bytes(tmp_path):
    """gguf_loading._pread (the experts' parallel reads) where the file ends first (it shrank after being checked at
    open): an EOFError naming where it ended, for one piece and for several."""
    import os

    import numpy as np

    import ktorch.integrations.gguf_loading as gl

    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(10)))
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(8, dtype=np.uint8)
        gl._pread(fd, out, 2)
        assert out.tolist() == list(range(2, 10))
        with pytest.raises(EOFError, match="the file ends at byte 10, before 14"):
            gl._pread(fd, np.zeros(8, dtype=np.uint8), 6)
        big = np.zeros(gl._READ_PIECE + 4, dtype=np.uint8)  # two pieces, the pool's path
        with pytest.raises(EOFError, match="the file ends at byte 10"):
            gl._pread(fd, big, 0)
    finally:
        os.close(fd)
