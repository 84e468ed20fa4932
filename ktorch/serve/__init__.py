"""``ktorch serve``: an OpenAI-compatible server over transformers' continuous batching (docs/architecture.md, section 6).

``ServeEngine`` (engine.py) owns the continuous-batching manager of a ktorch-prepared model; ``OpenAIServer``
(app.py) is the aiohttp application in front of it; ``run_server`` starts both."""

from ktorch.serve.engine import AdmissionError, EngineConfig, SamplingParams, ServeEngine

__all__ = ["AdmissionError", "EngineConfig", "SamplingParams", "ServeEngine", "OpenAIServer", "run_server"]


def __getattr__(name):
    if name in ("OpenAIServer", "run_server"):  # aiohttp only when serving
        from ktorch.serve import app

        return getattr(app, name) if name == "OpenAIServer" else _run_server
    raise AttributeError(name)


def _run_server(model, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                config: EngineConfig = EngineConfig(), print_fn=print) -> None:
    """Serves ``model`` until interrupted (SIGINT/SIGTERM)."""
    from aiohttp import web

    from ktorch.serve.app import OpenAIServer

    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    engine = ServeEngine(model, eos_token_id=eos, pad_token_id=getattr(tokenizer, "pad_token_id", None), config=config)
    server = OpenAIServer(engine, tokenizer, model_name)
    web.run_app(server.make_app(), host=host, port=port, print=print_fn, access_log=None, shutdown_timeout=2)
