"""The `keras-mhf` command line: one module per subcommand, each with
`main(argv=None, prog=None)`; `keras_mhf.cli.main` dispatches."""
