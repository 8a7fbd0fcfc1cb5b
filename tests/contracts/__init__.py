"""The test cases every backend runs, written once: subclasses provide the store."""
