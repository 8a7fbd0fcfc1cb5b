"""The worker node (logstore.node, `cellstream serve`): the logstore contract over HTTP, the server, OpenAPI."""
