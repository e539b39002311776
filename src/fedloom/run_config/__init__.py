"""The sections of a run config that belong to the run itself (data, model, training,
evaluation, executor, monitoring, asynchrony, serving) and the machinery of the cross-section
rules. Mechanism sections live with their packages (``privacy/config.py``, ``secure/config.py``,
...); ``fedloom.config`` composes them all into ``RunConfig`` and loads YAML."""
