"""Storage backends: each one a :class:`logstore.persistence.NodeRecorder`, whole in its own place.

``sqlite/`` is the embedded default, ``mysql/`` MySQL/MariaDB (pool, driver-error boundary, moves),
and :mod:`logstore.backends.http` the client of a worker node (``cellstream serve``)."""
