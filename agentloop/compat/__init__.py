"""Everything that exists only to match verl's public API (the one seam for verl compatibility).

Ported verl code imports from here (via the import map, :mod:`agentloop.compat.import_map`); the core
never imports from this package except the loop base class, for verl's constructor contract, and the manager,
for verl's constructor arguments (:mod:`agentloop.compat.manager_args`).
"""
