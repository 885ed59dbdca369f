"""The ``castore`` command: inspect, check, tag, collect, compact, copy, import stores.

Every failure prints one line to stderr and exits non-zero; set
``CASTORE_DEBUG=1`` to get the traceback as well.

==============================  ==========================================================
module                          holds
==============================  ==========================================================
:mod:`castore.cli.main`         ``main`` (the console script) and the table of commands
:mod:`castore.cli.args`         the argument parser: every command, option and its help
:mod:`castore.cli.optionvalues` what an option's value may be (counts, sizes, durations)
:mod:`castore.cli.failures`     how a command fails: one line, an exit status, held warnings
:mod:`castore.cli.inspection`   ``log``, ``show``, ``diff``
:mod:`castore.cli.graph`        ``log --graph``: generations and their parents across runs
:mod:`castore.cli.origins`      how a generation was made (save, branch, amend, import, copy)
:mod:`castore.cli.values`       ``show``'s table of non-tensor values
:mod:`castore.cli.checks`       ``verify``, ``repair``
:mod:`castore.cli.collection`   ``tag``, ``untag``, ``gc``, ``du``, ``compact``
:mod:`castore.cli.tiers`        ``tiers``
:mod:`castore.cli.transfer`     ``copy``, ``export``, ``import``
:mod:`castore.cli.stores`       the store a command names, and what of a generation it holds
:mod:`castore.cli.output`       times, durations, ratios and tables as the commands print them
==============================  ==========================================================
"""

from castore.cli.main import COMMANDS, main

__all__ = ["COMMANDS", "main"]
