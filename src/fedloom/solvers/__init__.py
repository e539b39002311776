"""Client programs and the backends that run them (sequential, vmap), with the pieces local
solvers are made of. Above the core, below the algorithms."""
