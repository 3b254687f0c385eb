"""A run with its roles as Ray actors (``launch.backend=ray``).

Contract: ``run_ray(cfg, run_dir, resume=False)`` runs ``session.run`` in this process (the
driver) with the ``RayLauncher``s of ``launch.ray.launchers(cfg)``: connected to the cluster at
``launch.ray_address`` (or a local Ray started for the run), their placement groups removed and
the connection closed at the end; it returns the run's summary. Importing this module imports
Ray (a ``ModuleNotFoundError`` naming ``ray`` where it is not installed).
"""
from __future__ import annotations

from pathlib import Path

from conveyor.config import RunConfig
from conveyor.launch.ray import launchers
from conveyor.run.session import run

__all__ = ["run_ray"]


def run_ray(cfg: RunConfig, run_dir: Path, resume: bool = False) -> dict:
    with launchers(cfg) as launcher:
        return run(cfg, run_dir, resume, launcher)
