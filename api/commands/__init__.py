"""One module per ``overtake`` sub-command; each has ``register(subparsers)`` and ``run(args) -> int``."""
