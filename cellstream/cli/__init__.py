"""The ``cellstream`` command: one module per command group, each with ``register(subparsers)``."""
