"""conveyor: streaming reinforcement-learning post-training for language models.

The Python API (``conveyor.api``) is imported on first use, so ``import conveyor``
stays light (no torch)::

    import conveyor
    cfg = conveyor.load_config("my.yaml", ["loop.steps=20"])
    summary = conveyor.train(cfg, run_dir="runs/mine")
    print(summary.final.greedy_reward, conveyor.generate("runs/mine", ["12+34="]))
"""
__version__ = "0.1.0"

__all__ = ["load_config", "train", "generate", "evaluate", "export", "model_dir", "run_config",
           "TrainSummary", "EvalResult", "__version__"]
_API = frozenset(__all__) - {"__version__"}


def __getattr__(name: str):
    if name in _API:
        from conveyor import api
        return getattr(api, name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
