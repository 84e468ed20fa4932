"""Options of ``torch.compile(model, backend="ktorch", mode=..., options={...})``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Union

from ktorch.ops.deferred_slots import is_deferred_count


@dataclass
class BackendOptions:
    """What the ktorch backend does with a graph.

    inductor:        compile everything but the CPU experts with Inductor (Triton on a GPU, C++ on the CPU);
                     False runs the rewritten FX graph as it is (fast to build; tests, debugging).
    async_experts:   split each CPU experts call into submit/wait (passes/async_boundary.py); False keeps the
                     blocking op with its hops to the CPU and back.
    overlap:         move work that does not need the experts' result between submit and wait.
    cuda_graphs:     replay graphs as CUDA graphs (Inductor's cudagraph trees); the host functions of the
                     submit/wait ops are captured with them. mode="reduce-overhead" or "max-autotune" sets it.
                     Ignored (with no error) for graphs that have no CUDA tensors.
    inductor_config: extra ``torch._inductor.config`` patches, e.g. {"max_autotune": True}.
    n_deferred_experts: per token, how many of its K routed experts (the lowest-weighted) each MoE layer but the
                     last defers to the next layer (passes/deferral.py, docs/deferral.md); 0 (default) defers
                     nothing and leaves the graph exactly as without the pass. Needs async_experts.
                     "runtime": every deferred call is built and the count is read when the graph runs
                     (``ktorch.compile.set_runtime_deferred_experts(d)``, process-wide, default 0), so one
                     compile serves every d, CUDA-graph replays included (sweeps, A/B runs).
    """

    inductor: bool = True
    async_experts: bool = True
    overlap: bool = True
    cuda_graphs: bool = False
    inductor_config: dict = field(default_factory=dict)
    n_deferred_experts: Union[int, str] = 0

    @classmethod
    def parse(cls, mode: Optional[str] = None, options: Optional[dict] = None) -> "BackendOptions":
        opts = cls()
        if mode in ("reduce-overhead", "max-autotune"):
            opts.cuda_graphs = True
        if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            opts.inductor_config["max_autotune"] = True
        elif mode not in (None, "default", "reduce-overhead"):
            raise ValueError(
                f"ktorch backend: unknown mode {mode!r}; use default, reduce-overhead, max-autotune or "
                "max-autotune-no-cudagraphs"
            )
        known = {f.name for f in fields(cls)}
        for key, value in (options or {}).items():
            if key not in known:
                raise ValueError(f"ktorch backend: unknown option {key!r}; options are {sorted(known)}")
            if key == "inductor_config":
                opts.inductor_config.update(value)
            else:
                setattr(opts, key, value)
        d = opts.n_deferred_experts
        if not is_deferred_count(d, runtime_ok=True):
            raise ValueError(f"ktorch backend: n_deferred_experts must be an int >= 0 or 'runtime', got {d!r}")
        if d and not opts.async_experts:
            raise ValueError("ktorch backend: n_deferred_experts needs async_experts=True (deferral moves waits)")
        return opts
