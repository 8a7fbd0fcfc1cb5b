"""The demo's example files, shipped with the package: an app (``billing``), an index definition file
(``indexes.yaml``) and a connector file (``lake.yaml``)."""
