"""runtime: the bottom floor of a run's machinery, which every role and the controller may use.

``errors.py`` (the errors that stop a run, under ``RunStop``, and ``SetupError``), ``procs.py``
(child processes of roles and the RPC to them, ``bind_device``), ``watchdog.py`` (stack dumps when
a wait runs out, children that end with their parent, deadlines that grow), ``handles.py`` (the
protocols by which one role holds another's capability), ``devices.py`` (what a device computes
natively: the ``native`` dtype), ``interrupt.py`` (Ctrl-C deferred to the end of the RL step in
progress). It imports nothing above ``types.py``.
"""
