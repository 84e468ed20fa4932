"""Perplexity of the built-in model written as GGUF with quantized experts, loaded by ktorch, against the same file's
values computed in fp32 by transformers' eager experts: what the exact formats (experts_dtype="auto") and the
requantizing ones (int8, int4) cost in perplexity, on ktorch/builtin/eval.txt.

    python benchmarks/bench_gguf_perplexity.py                         # Q4_K gate/up + Q8_0 down, and Q8_0
    python benchmarks/bench_gguf_perplexity.py --types Q4_K/Q8_0 --max-tokens 8192

Types: GATE_UP/DOWN GGML names (one name: all three). The built-in model's expert rows are H = 256 long (gate/up:
any type) and I = 128 long (down: a 32-block type, Q8_0/Q4_0; K-quants need rows of 256, and llama.cpp falls back to
such types for them too). Non-expert weights are written F32 (the model's bf16 values exactly), so the rows differ
only in the experts. Benchmarks never assert; they print.

``--llama-perplexity BIN`` adds the llama.cpp comparison: the held-out text as plain text (documents joined by blank
lines, so that no special token needs parsing: both tokenizers give the same ids), ``BIN -m FILE -f TEXT -c 512 -b
512`` on each file, and ktorch's exact load of the same file scored the way llama-perplexity scores (chunks of 512
tokens, each chunk's second half: positions 256..510 predicting 257..511, the first token BOS where the tokenizer
adds one), side by side:

    python benchmarks/bench_gguf_perplexity.py --llama-perplexity /tmp/lcpp/bin/llama-perplexity --types Q4_K/Q8_0 Q8_0
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ktorch
from ktorch.builtin import eval_perplexity, load_builtin
from ktorch.integrations.gguf_writer import adds_bos, write_gguf_from_model


def file_values_model(model, path: Path):
    """``model`` (fp32, eager experts) with its experts replaced by the file's values (gguf.quants.dequantize)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def values(name):
        t = tensors[name]
        return torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            experts.gate_up_proj.copy_(torch.cat([values(f"blk.{i}.ffn_gate_exps.weight"),
                                                  values(f"blk.{i}.ffn_up_exps.weight")], dim=1))
            experts.down_proj.copy_(values(f"blk.{i}.ffn_down_exps.weight"))
    return model


def plain_text(folder: Path) -> Path:
    """The held-out documents as plain text (blank lines between them, no ``<|endoftext|>`` markers)."""
    from ktorch.builtin import EVAL_TEXT_PATH, read_documents

    path = folder / "eval_plain.txt"
    path.write_text("\n\n".join(d.strip() for d in read_documents(EVAL_TEXT_PATH)) + "\n", encoding="utf-8")
    return path


@torch.no_grad()
def llama_style_perplexity(model, tokenizer, text: str, n_ctx: int = 512, batch: int = 8) -> tuple[float, int]:
    """(perplexity, chunks) as llama-perplexity computes it: the text tokenized with the tokenizer's special tokens
    (BOS where it adds one, none parsed inside the text), cut into len // n_ctx chunks whose first token becomes BOS
    when the tokenizer adds one; each chunk's logits at positions n_ctx/2 .. n_ctx-2 score the next tokens."""
    ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.int64)
    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None  # as the file's add_bos_token says
    n_chunk, first = ids.numel() // n_ctx, n_ctx // 2
    nll, count = 0.0, 0
    for c0 in range(0, n_chunk, batch):
        chunks = torch.stack([ids[c * n_ctx:(c + 1) * n_ctx] for c in range(c0, min(n_chunk, c0 + batch))])
        if bos is not None:
            chunks[:, 0] = bos
        logp = torch.log_softmax(model(chunks).logits[:, first:n_ctx - 1].float(), dim=-1)
        nll -= float(logp.gather(-1, chunks[:, first + 1:, None]).sum())
        count += chunks.shape[0] * (n_ctx - 1 - first)
    return float(np.exp(nll / count)), n_chunk


def llama_cpp_perplexity(binary: str, path: Path, text: Path) -> tuple[float, str]:
    """llama-perplexity's final estimate on ``path`` over ``text`` (n_ctx 512), and its chunk line."""
    import re
    import subprocess

    log_path = path.with_suffix(".llama-perplexity.log")  # a file, not a pipe: its logger's last lines reach it
    with open(log_path, "w") as log_file:
        run = subprocess.run([binary, "-m", str(path), "-f", str(text), "-c", "512", "-b", "512", "-t",
                              str(torch.get_num_threads())], stdout=log_file, stderr=subprocess.STDOUT)
    log = log_path.read_text(errors="replace")
    final = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if final is None and chunks is not None:  # its logger thread may lose the last line at exit: the running
        # estimate after the last chunk ("[99]186.72,") is the same figure
        final = re.search(rf"\[{chunks.group(1)}\]([0-9.]+),", log)
    if final is None:
        tail = " | ".join(log.strip().splitlines()[-3:])
        raise RuntimeError(f"llama-perplexity printed no final estimate (rc {run.returncode}): {tail}")
    return float(final.group(1)), chunks.group(1) if chunks else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q4_K/Q8_0", "Q8_0"])
    ap.add_argument("--max-tokens", type=int, default=None, help="score the first N tokens (default: all of eval.txt)")
    ap.add_argument("--keep", type=Path, default=None, help="write the files here and keep them")
    ap.add_argument("--llama-perplexity", metavar="BIN", default=None,
                    help="llama.cpp's llama-perplexity: compare it with ktorch's exact load on each file (no other rows)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, kernel {torch.ops.kt.selected_kernel()}, threads {torch.get_num_threads()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        text_path = plain_text(folder) if args.llama_perplexity else None  # one text for every file
        text = text_path.read_text(encoding="utf-8") if text_path is not None else None
        for spec in args.types:
            gate_up, _, down = spec.partition("/")
            down = down or gate_up
            model, tokenizer = load_builtin("cpu", torch.float32, experts_implementation="eager")
            path = folder / f"builtin-{gate_up}-{down}.gguf"
            write_gguf_from_model(model, path, experts_type=gate_up, experts_types={"down": down}, other_type="F32",
                                  tokenizer=tokenizer)  # llama.cpp reads its vocabulary from the file
            if args.llama_perplexity:
                loaded, _ = ktorch.load(path, device="cpu", dtype=torch.float32, progress=False, tokenizer=False)
                ours, n_chunk = llama_style_perplexity(loaded, tokenizer, text)
                theirs, their_chunks = llama_cpp_perplexity(args.llama_perplexity, path, text_path)
                print(f"| {spec} | ktorch auto ({loaded.model.layers[0].mlp.experts.kt_format}) {ours:.4f} | "
                      f"llama-perplexity {theirs:.4f} | ktorch / llama.cpp {ours / theirs:.5f} | chunks of 512: "
                      f"{n_chunk} / {their_chunks} |", flush=True)
                continue
            ref = eval_perplexity(file_values_model(model, path), tokenizer, max_tokens=args.max_tokens)
            rows.append((spec, "fp32 eager, file values", ref["perplexity"], 0.0, ref["tokens"]))
            for dtype in ("auto", "int8", "int4"):
                t0 = time.perf_counter()
                loaded, _ = ktorch.load(path, device="cpu", dtype=torch.float32, experts_dtype=dtype, progress=False,
                                        tokenizer=False)
                fmt = loaded.model.layers[0].mlp.experts.kt_format
                r = eval_perplexity(loaded, tokenizer, max_tokens=args.max_tokens)
                rows.append((spec, f"ktorch {dtype} ({fmt})", r["perplexity"],
                             100 * (r["perplexity"] / ref["perplexity"] - 1), r["tokens"]))
                print(f"{spec:<10} {rows[-1][1]:<32} ppl {r['perplexity']:.4f} ({rows[-1][3]:+.3f}%) "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
    if not rows:
        return
    print()
    print("| experts (gate_up/down) | model | perplexity | vs file values | tokens |")
    print("|---|---|---|---|---|")
    for spec, what, ppl, delta, tokens in rows:
        print(f"| {spec} | {what} | {ppl:.4f} | {delta:+.3f}% | {tokens} |")


if __name__ == "__main__":
    main()
