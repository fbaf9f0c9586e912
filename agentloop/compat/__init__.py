"""Everything that exists only to match verl's public API (the one seam for verl compatibility).

Ported verl code imports from here (via the import map, :mod:`agentloop.compat.import_map`).  The
rest of agentloop imports this package only where verl's contract reaches in: ``loops/base.py``
(``wrappers``, ``loop_helpers``: verl's loop constructor and helpers), ``rollout/worker.py``
(``chat_template``, ``rollout_trace``), ``rollout/manager.py`` (``manager_args``: verl's constructor
arguments), ``cli/rollout.py`` (``port``: the ``agentloop port`` command) and ``utils/imports.py``
(``import_map``, only for ``verl.*`` class paths in configs).
"""
