"""Empirical privacy auditing of dpgrad's training in one run (``dpgrad audit``).

- ``dpgrad.audit.bounds``: the audited epsilon from canary guesses (Steinke, Nasr and
  Jagielski 2023; Mahloujifar, Melis and Chaudhuri's f-DP bound), pure Python.
- ``dpgrad.audit.run``: the audit (white-box gradient canaries that are samples of the
  batch, or black-box input canaries) of DP-SGD through ``dpgrad.opacus.make_private`` or
  ``dpgrad.hf.DPTrainer``, and the same audit of the idealised Gaussian mechanism (needs
  Opacus, for the training path and its accountant); its settings in ``config``, its models
  and losses in ``models``, its training runs in ``training``.
"""
