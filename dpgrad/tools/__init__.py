"""The tools built on the library: the command line (``dpgrad autotune-report``, ``dpgrad
dashboard``, ``dpgrad demo``), the autotune report, the benchmarks' results files and their
dashboard, the model presets and the demo model. They use the library (``dpgrad``); nothing in
the library imports them.
"""
