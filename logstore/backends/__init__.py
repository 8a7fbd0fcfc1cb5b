"""Storage backends, each whole in its folder: ``sqlite/`` the embedded default, ``mysql/`` MySQL/MariaDB,
``http/`` the client of a worker node (``cellstream serve``). Each has ``target.py`` (its URL's model and
parser) and a :class:`~logstore.persistence.NodeRecorder`; :data:`logstore.registry.BACKENDS` finds them by
URL scheme."""
