"""The work of ``mcpar``'s commands: ``train`` (and ``profile``), ``check``, and ``export``,
``import``, ``generate``. ``mcpar.cli`` parses the command line and imports only the module of
the command being run, so ``mcpar --help`` costs no torch import."""
