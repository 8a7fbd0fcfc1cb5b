"""The `cellstream` command through main(argv): output, exit codes, the demo, `run` and `dlq`."""
