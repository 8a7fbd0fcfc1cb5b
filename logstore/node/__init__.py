"""The worker node (``cellstream serve``): the store API over HTTP, its wire format and OpenAPI
document (needs ``cellstream[server]``)."""
