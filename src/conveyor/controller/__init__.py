"""controller: the pieces the loop and a run use besides the roles (admission, batches, step stats, objective, evaluation, warm start); episodes are ``episodes/``, one run is ``run/session.py``."""
