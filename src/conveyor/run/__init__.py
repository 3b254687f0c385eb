"""run: the top floor, one training run built and run over the handles a launcher provides.

``session.py`` (``run``, ``build``, ``Session``: a run from start to finish over any
``launch.api.Launcher``), ``local.py`` (``run_local``: with the local launcher) and ``ray.py``
(``run_ray``: with the Ray launcher, connected to the cluster); a run's phases: ``sft.py`` (the
warm start), ``evaluate.py`` (evaluation), ``checkpoints.py`` (what a checkpoint holds besides the
trainer's state, which are kept) and ``judge_setup.py`` (a judge reward's engine from the config).
Only this floor, ``api.py`` and ``cli.py`` import ``launch/``: a launcher starts roles and knows
nothing of the run it serves.
"""
