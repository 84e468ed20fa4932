"""The torch.compile backend ``"ktorch"``: ``torch.compile(model, backend="ktorch", options={...})``.

See backend.py for the stages, options.py for the options, experts_runtime.py for what runs the CPU experts.
"""

from ktorch.compile.backend import REPORTS, CompileReport, compile_graph, ktorch_backend
from ktorch.compile.experts_runtime import RUNTIME, ExpertsRuntime, set_runtime_deferred_experts
from ktorch.compile.options import BackendOptions

__all__ = ["REPORTS", "RUNTIME", "BackendOptions", "CompileReport", "ExpertsRuntime", "compile_graph", "ktorch_backend",
           "set_runtime_deferred_experts"]
