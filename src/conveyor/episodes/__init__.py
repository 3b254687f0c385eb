"""episodes: multi-turn episodes, above the roles and below the controller.

``multi_turn.py`` (the token-in / token-out turn loop), ``runner.py`` (the ``EpisodeRunner``:
groups of episodes on one event loop, turns routed to engine workers), ``agents.py`` (an external
agent's episode through the endpoint), ``openai_server.py`` and ``openai_api.py`` (the
OpenAI-compatible endpoint and its requests and replies), ``transcript.py`` (an agent's calls
matched against the recorded tokens). How an episode is played is the environment's declaration
(``env.api.PlayedBy``). It imports the roles' public modules and the floors below them, never
``controller/`` or ``run/``.
"""
